"""What quantizing an LLM cost: greedy agreement with the float model, perplexity on a text, and size.

Both models run as dialogs (`quiver t2t export --report`): per prompt, how many leading greedy tokens of
the quantized model equal the float model's (and their mean); the perplexity of each on one text (exp of
minus the mean log-probability of each token given those before it, one decode step per token).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from quiver.errors import GenerationError
from quiver.formats.files import read_text
from quiver.t2t.dialog import Dialog

# Prompts of several kinds (facts, code, a list, a story): greedy text that diverges early on one of
# them shows quantization noise the others may hide.
DEFAULT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Three things to pack for a week of hiking:",
    "Once upon a time, in a village by the sea,",
    "Water boils at a lower temperature on a mountain because",
)
# A plain paragraph for perplexity when the user gives no text (written for this purpose).
DEFAULT_TEXT = (
    "The river ran wide and slow through the valley, carrying the last of the spring snow down from the "
    "hills. Farmers along its banks had planted early that year, trusting the warm weeks of April, and by "
    "June the fields were green from the water's edge to the foot of the forest. In the town, the market "
    "opened at dawn: bread, cheese, cherries and the first beans were sold from wooden stalls, and the "
    "talk was of rain, of prices, and of the new bridge the council had promised for the autumn. Children "
    "ran between the carts while their parents counted coins, and an old man played the violin by the "
    "fountain, as he had done every Saturday for forty years."
)
MAX_TEXT_TOKENS = 512  # perplexity is measured on at most this many tokens of the text
MAX_TEXT_BYTES = 1 << 20


@dataclass(frozen=True)
class QualityReport:
    """Agreement per prompt (leading identical greedy tokens of `tokens`), perplexities and sizes."""

    prompts: list[str]
    tokens: int
    agreement: list[int]
    float_perplexity: float
    quantized_perplexity: float
    text_tokens: int
    float_bytes: int
    quantized_bytes: int

    @property
    def mean_agreement(self) -> float:
        return sum(self.agreement) / len(self.agreement)

    def as_json(self) -> dict[str, Any]:
        return asdict(self) | {"mean_agreement": self.mean_agreement}


def read_prompts(path: Path) -> list[str]:
    """One prompt per non-empty line of a UTF-8 file (`\\n` inside a line stands for a newline)."""
    lines = read_text(path, limit=MAX_TEXT_BYTES, what="the prompt list").splitlines()
    prompts = [line.replace("\\n", "\n") for line in lines if line.strip()]
    if not prompts:
        raise GenerationError(f"{path}: no prompts; write one per line")
    return prompts


def leading_equal(got: Sequence[int], want: Sequence[int]) -> int:
    """How many of `got` equal `want` before the first that does not."""
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


def perplexity(dialog: Dialog, ids: Sequence[int]) -> float:
    scores = dialog.log_likelihoods(ids)
    return math.exp(-float(scores.mean()))


def quality_report(
    float_config: Path,
    quantized_config: Path,
    prompts: Sequence[str] = DEFAULT_PROMPTS,
    text: str = DEFAULT_TEXT,
    tokens: int = 32,
    on_step: Callable[[str], object] = lambda _: None,
) -> QualityReport:
    """Runs both models (their configs from `quiver t2t export`) on the prompts and the text."""
    if tokens < 1 or not prompts:
        raise GenerationError("a quality report needs at least one prompt and one token")
    replies: list[list[list[int]]] = []
    scores: list[float] = []
    sizes: list[int] = []
    for label, config in (("float", float_config), ("quantized", quantized_config)):
        with Dialog.from_config(config) as dialog:
            ids = dialog.tokenizer.encode(text)[: min(MAX_TEXT_TOKENS, dialog.config.context_size - 1)]
            if len(ids) < 2:
                raise GenerationError("the perplexity text has fewer than 2 tokens; give a longer one")
            answers = []
            for index, prompt in enumerate(prompts):
                on_step(f"{label} model: prompt {index + 1}/{len(prompts)}")
                dialog.reset()
                answers.append(dialog.query(prompt, max_new_tokens=tokens, min_new_tokens=tokens, greedy=True).new_ids)
            on_step(f"{label} model: perplexity over {len(ids)} tokens")
            scores.append(perplexity(dialog, ids))
            sizes.append(sum(p.stat().st_size for p in dialog.config.ctx_bins))
            replies.append(answers)
    return QualityReport(
        prompts=list(prompts),
        tokens=tokens,
        agreement=[leading_equal(q, f) for f, q in zip(*replies)],
        float_perplexity=scores[0],
        quantized_perplexity=scores[1],
        text_tokens=len(ids),
        float_bytes=sizes[0],
        quantized_bytes=sizes[1],
    )
