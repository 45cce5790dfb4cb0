"""One reply as it is generated: each next token chosen from the logits, and when and why the reply ends.

A dialog (one sequence) and `quiver serve`'s batch (many, one row each) decide tokens the same way: the
sampler picks from the logits (end-of-sequence kept out until `min_new_tokens`), the text grows by whole
characters, and the reply ends at an end-of-sequence token, a stop string, `max_new_tokens` or a full
context.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from quiver.t2t.sampling import Sampler
from quiver.t2t.tokenizer import TextTokenizer


def ending_tokens(
    eos_tokens: Sequence[int], stop_token_ids: Sequence[int] = (), ignore_eos: bool = False
) -> tuple[int, ...]:
    """The tokens that end a reply: the model's eos tokens (unless `ignore_eos`, vLLM's) and a request's
    `stop_token_ids`, each once."""
    return tuple(dict.fromkeys([*(() if ignore_eos else eos_tokens), *stop_token_ids]))


class Continuation:
    """The tokens and text of one reply; `step(logits)` per position until `reason` is set."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        sampler: Sampler,
        eos_tokens: Sequence[int],
        seen: Sequence[int],
        cached: int,
        context_size: int,
        max_new_tokens: int,
        min_new_tokens: int = 0,
        stop: Sequence[str] = (),
    ) -> None:
        self._sampler = sampler
        self._eos = set(eos_tokens)
        self._eos_ids = sorted(self._eos)
        self._seen = list(seen)  # the conversation's tokens so far (the repetition penalty reads them)
        self._cached = cached  # tokens whose keys and values are in the cache
        self._context_size = context_size
        self._max, self._min = max_new_tokens, min_new_tokens
        self._stop = [StopString(s) for s in stop if s]
        self._stream = tokenizer.stream()
        self.new_ids: list[int] = []
        self.text = ""
        self._released = 0  # characters of `text` handed out by `step`
        self.reason: str | None = None  # "eos", "stop-sequence", "max-new-tokens" or "context-full" when ended
        self.pending: list[int] = []  # a last token not fed to the cache (a dialog's next query starts with it)

    def step(self, logits: np.ndarray) -> str:
        """Chooses the next token from `logits` (modified in place: eos masked) and returns the text that
        is now final (may be empty: a character still incomplete, or text that may begin a stop string,
        held back until it does not). After it, either `reason` is set, or the caller feeds
        `new_ids[-1]` to the cache and calls `step` again on the logits that gives."""
        if len(self.new_ids) < self._min and self._eos:
            logits = logits.reshape(-1)
            for eos in self._eos_ids:  # a few ids: plain item writes cost less than one fancy-indexed one
                logits[eos] = -np.inf
        token = self._sampler.next_token(logits, self._seen, self.new_ids)
        self.new_ids.append(token)
        self._seen.append(token)
        if token in self._eos:
            self.reason = "eos"
            return self._release(len(self.text))
        piece = self._stream.push(token)
        hit = self._stop_hit(piece)
        self.text += piece
        if hit >= 0:
            self.text, self.reason, self.pending = self.text[:hit], "stop-sequence", [token]
        elif len(self.new_ids) >= self._max:
            self.reason, self.pending = "max-new-tokens", [token]
        elif self._cached + 1 >= self._context_size:
            self.reason = "context-full"
        else:
            self._cached += 1  # the caller feeds it
            return self._release(len(self.text) - self._stop_prefix())
        return self._release(len(self.text))

    def _stop_hit(self, piece: str) -> int:
        return first_stop(self._stop, len(self.text), piece) if self._stop else -1

    def _stop_prefix(self) -> int:
        """The length of the longest end of the text that begins a stop string (it may yet become one)."""
        return max((stop.matched for stop in self._stop), default=0)

    def _release(self, end: int) -> str:
        piece = self.text[self._released : end]
        self._released = max(self._released, end)
        return piece


def first_stop(stops: Sequence[StopString], length: int, piece: str) -> int:
    """Where the first of `stops` begins in a text of `length` characters once `piece` joins it, or -1: each
    stop string matched character by character as the text grows (the work of a step is its new
    characters, not the whole text again)."""
    hit = -1
    for offset, character in enumerate(piece):
        end = length + offset + 1
        for stop in stops:
            if stop.feed(character):
                start = end - len(stop.text)
                hit = start if hit < 0 else min(hit, start)
    return hit


class StopString:
    """A stop string matched as text arrives (Knuth-Morris-Pratt): `matched` is the length of the
    longest end of the text so far that begins it."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.matched = 0
        self._fallback = [0] * len(text)  # the longest proper prefix that is also a suffix of text[:i + 1]
        length = 0
        for i in range(1, len(text)):
            while length and text[i] != text[length]:
                length = self._fallback[length - 1]
            if text[i] == text[length]:
                length += 1
            self._fallback[i] = length

    def feed(self, character: str) -> bool:
        """Whether the text now ends with the whole stop string."""
        text, matched = self.text, self.matched
        while matched and text[matched] != character:
            matched = self._fallback[matched - 1]
        if text[matched] == character:
            matched += 1
        if matched == len(text):
            self.matched = self._fallback[matched - 1]
            return True
        self.matched = matched
        return False
