"""Tests on real models and real peers: the corpora, ORT's node tests, the CLI and tuning end to end."""
