"""The names of a text-generation graph's inputs and outputs, for what runs it without building one."""

from __future__ import annotations

INPUT_IDS = "input_ids"
SEQLENS_K = "seqlens_k"  # [1] int32: tokens in the cache after this step, minus one (GQA's convention)
TOTAL_LENGTH = "total_sequence_length"  # [] int32: tokens in the cache after this step
LOGITS = "logits"
BATCH = "batch"  # the rows (sequences) of a batched graph
PAST, PRESENT = "past_key_values.", "present."  # the KV cache's inputs and outputs: PAST + "{layer}.key"...


def past_names(layer: int) -> tuple[str, str]:
    return f"{PAST}{layer}.key", f"{PAST}{layer}.value"


def present_names(layer: int) -> tuple[str, str]:
    return f"{PRESENT}{layer}.key", f"{PRESENT}{layer}.value"
