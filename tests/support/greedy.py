"""Greedy decoding in tests: the dialog's tokens per prompt, and a prompt's next-token logits."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from quiver.t2t.batch import BASE_SLOT, BatchDecoder
from quiver.t2t.dialog import Dialog


def dialog_greedy(dialog: Dialog, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """`tokens` greedy tokens after each prompt (end-of-sequence kept out, as transformers' min_new_tokens)."""
    results = []
    for ids in prompts:
        dialog.reset()
        results.append(dialog.token_query(ids, max_new_tokens=tokens, min_new_tokens=tokens, greedy=True).new_ids)
    return results


def next_token_logits(config: Path, prompt: list[int]) -> np.ndarray:
    """The logits after `prompt`, from the serving graph of the dialog config at `config`."""
    decoder = BatchDecoder.from_config(config, max_batch=1)
    try:
        return decoder.prefill(0, prompt, 0, BASE_SLOT).copy()
    finally:
        decoder.close()
