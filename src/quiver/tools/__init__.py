"""Tools over the API: the CLI, the demo, reports, qnn-net-run style I/O."""
