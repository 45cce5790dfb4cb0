"""Seeded models made in-process, for the demo, tests, benchmarks and the guides' examples: transformer
families (a base and fine-tunes) and more PEFT adapters like a given one."""
