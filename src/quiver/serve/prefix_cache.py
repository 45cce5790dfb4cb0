"""Automatic prefix reuse: the KV cache rows of recent prompts, so a prompt that begins as one of them
(a multi-turn chat, a shared system prompt, lm-eval's repeated contexts) is prefilled from where they part.

Prefixes are matched in blocks of `BLOCK` tokens by chained hashes of their tokens (vLLM's automatic
prefix caching, at its block size: a chat's new turn recomputes at most 15 tokens it could have reused),
under the adapter and strengths that computed them (an adapter's low-rank terms change the keys and
values); a hit is checked token by token (a hash may collide). Each prompt stores its longest whole-block
prefix once (a copy of its rows), every shorter block prefix pointing into it; the least recently used go
past `budget_bytes`. An adapter loaded or unloaded under a name forgets that name's prefixes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

BLOCK = 16  # tokens a prefix is matched by (64: a 10-turn chat's last turn 1.72x its first, against 1.42x)
DEFAULT_BUDGET_BYTES = 256 << 20

PrefixKey = tuple[str | None, tuple[tuple[str, float], ...]]  # the adapter (None: the base model), its strengths


def prefix_key(adapter: str | None, strengths: Mapping[str, float]) -> PrefixKey:
    return adapter, tuple(sorted(strengths.items()))


@dataclass
class _Entry:
    key: PrefixKey
    tokens: tuple[int, ...]
    rows: Mapping[str, np.ndarray]  # each cache's [heads, len(tokens), head_dim] copy
    nbytes: int


class PrefixCache:
    """Recently computed prompt prefixes' cache rows, least recently used out past `budget_bytes`."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._index: dict[tuple[PrefixKey, Hashable], tuple[int, int]] = {}  # (key, block hash) -> (entry, length)
        self._bytes = 0
        self._next = 0
        self._lock = threading.Lock()  # adapters are loaded from the HTTP thread, prompts run on the scheduler's
        self.hits = 0
        self.reused_tokens = 0

    def lookup(self, key: PrefixKey, prompt: Sequence[int]) -> tuple[Mapping[str, np.ndarray], int] | None:
        """The stored rows of the longest whole-block prefix `prompt` shares with a stored one (always
        leaving a token to feed: its logits start the reply), and how many tokens they hold; None: none."""
        usable = (len(prompt) - 1) // BLOCK
        hashes = _block_hashes(prompt, usable)
        with self._lock:
            for blocks in range(usable, 0, -1):
                found = self._index.get((key, hashes[blocks - 1]))
                if found is None or found[0] not in self._entries:
                    continue
                entry = self._entries[found[0]]
                length = blocks * BLOCK
                if entry.tokens[:length] != tuple(prompt[:length]):
                    continue  # a hash collision
                self._entries.move_to_end(found[0])
                self.hits += 1
                self.reused_tokens += length
                return entry.rows, length
        return None

    def store(self, key: PrefixKey, prompt: Sequence[int], copy: Callable[[int], Mapping[str, np.ndarray]]) -> None:
        """Keeps `prompt`'s longest whole-block prefix, its rows from `copy(length)`, unless held already."""
        blocks = len(prompt) // BLOCK
        if blocks == 0 or self.budget_bytes <= 0:
            return
        hashes = _block_hashes(prompt, blocks)
        with self._lock:
            held = self._index.get((key, hashes[-1]))
            if held is not None and held[1] == blocks * BLOCK and held[0] in self._entries:
                self._entries.move_to_end(held[0])
                return
        rows = copy(blocks * BLOCK)  # outside the lock: a copy of the rows takes milliseconds
        nbytes = sum(int(a.nbytes) for a in rows.values())
        if nbytes > self.budget_bytes:
            return
        with self._lock:
            number, self._next = self._next, self._next + 1
            self._entries[number] = _Entry(key, tuple(prompt[: blocks * BLOCK]), rows, nbytes)
            self._bytes += nbytes
            for index, block_hash in enumerate(hashes):
                self._index[(key, block_hash)] = (number, (index + 1) * BLOCK)
            while self._bytes > self.budget_bytes:
                self._drop(next(iter(self._entries)))

    def forget(self, adapter: str) -> None:
        """An adapter's prefixes (its weights under that name changed)."""
        with self._lock:
            for number in [n for n, e in self._entries.items() if e.key[0] == adapter]:
                self._drop(number)

    def _drop(self, number: int) -> None:
        entry = self._entries.pop(number)
        self._bytes -= entry.nbytes
        for block in [k for k, v in self._index.items() if v[0] == number]:  # pointers into it, not newer ones
            del self._index[block]

    @property
    def nbytes(self) -> int:
        return self._bytes


def _block_hashes(prompt: Sequence[int], blocks: int) -> list[int]:
    """Chained hashes of the first `blocks` blocks: each names its block and everything before it."""
    hashes, previous = [], 0
    for index in range(blocks):
        previous = hash((previous, tuple(prompt[index * BLOCK : (index + 1) * BLOCK])))
        hashes.append(previous)
    return hashes
