"""OpenAI's and vLLM's sampling controls in the sampler every path shares (the dialog and the server)."""

from __future__ import annotations

import numpy as np
import pytest

from quiver.errors import GenerationError
from quiver.t2t.sampling import Sampler, Sampling

LOGITS = np.array([2.0, 1.9, 0.0, -1.0], np.float32)


@pytest.mark.parametrize(
    "controls, reply, best",
    [
        ({}, [0, 0], 0),
        ({"presence_penalty": 0.5}, [0, 0], 1),  # 2.0 - 0.5 = 1.5 < 1.9
        ({"presence_penalty": 0.05}, [0, 0], 0),  # 1.95 > 1.9
        ({"frequency_penalty": 0.04}, [0, 0], 0),  # 2.0 - 2 x 0.04 = 1.92 > 1.9
        ({"frequency_penalty": 0.06}, [0, 0], 1),  # 1.88 < 1.9
        ({"frequency_penalty": 0.06}, [0], 0),  # once: 1.94
        ({"presence_penalty": -2.0}, [1], 1),  # a negative penalty favours what is there: 1.9 + 2 > 2.0
    ],
)
def test_presence_and_frequency_penalties_lower_the_replys_tokens_as_openai_says(
    controls: dict[str, float], reply: list[int], best: int
) -> None:
    sampler = Sampler(Sampling(greedy=True, **controls))
    assert sampler.next_token(LOGITS.copy(), seen=[3, *reply], reply=reply) == best


def test_a_logit_bias_is_added_to_its_tokens_logits() -> None:
    assert Sampler(Sampling(greedy=True, logit_bias=((1, 0.2),))).next_token(LOGITS.copy(), seen=[]) == 1  # 2.1 > 2
    assert Sampler(Sampling(greedy=True, logit_bias=((1, 0.05),))).next_token(LOGITS.copy(), seen=[]) == 0
    assert Sampler(Sampling(greedy=True, logit_bias=((0, -100.0),))).next_token(LOGITS.copy(), seen=[]) == 1


def test_the_penalties_read_the_reply_not_the_prompt() -> None:
    sampler = Sampler(Sampling(greedy=True, presence_penalty=2.0))
    assert sampler.next_token(LOGITS.copy(), seen=[0, 0, 0], reply=[]) == 0  # token 0 only in the prompt


def test_min_p_drops_tokens_below_its_share_of_the_likeliest() -> None:
    # probabilities 0.5, 0.3, 0.15, 0.05 (logits their logs): min-p 0.2 keeps those >= 0.1, the first three
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    sampler = Sampler(Sampling(greedy=False, temperature=1.0, min_p=0.2, seed=0))
    drawn = {sampler.next_token(logits.copy(), seen=[]) for _ in range(400)}
    assert drawn == {0, 1, 2}
    loose = Sampler(Sampling(greedy=False, temperature=1.0, seed=0))
    assert 3 in {loose.next_token(logits.copy(), seen=[]) for _ in range(400)}


@pytest.mark.parametrize(
    "field, value",
    [("min_p", 1.5), ("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("logit_bias", ((3, 101.0),))],
)
def test_controls_out_of_range_are_refused(field: str, value: object) -> None:
    with pytest.raises(GenerationError, match="sampling:"):
        Sampling(**{field: value})
