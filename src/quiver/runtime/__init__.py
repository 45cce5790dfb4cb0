"""Runtime: contexts (built, saved, mapped), their graphs and bound runs, feeds checked, updateable tensors and
sections, run-state snapshots, tuned configurations picked per device, and qnn-net-run style I/O."""
