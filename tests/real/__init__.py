"""The real-model corpus: its export script and what tests and benchmarks share about it."""
