"""Automatic prefix reuse: the KV cache rows of recent prompts and replies, so a prompt that begins as one of
them (a multi-turn chat, a shared system prompt, lm-eval's repeated contexts) is prefilled from where they part.

Two kinds of entry, one budget, least recently used out first:
* a **copy** of a prompt's rows, made once its first token is out (so requests that run beside it can
  begin from it), for a prompt whose first block was seen before (a shared system prompt, a chat's later
  turns): a prompt nothing began as is not likely to be begun as, and its copy would hold memory for
  nothing (admitted on the second sight, as a cache's doorkeeper does);
* a **held row**: a batch row whose sequence ended, left as it was (its prompt and the reply tokens fed
  after it) instead of given back — llama.cpp's slots keep their cache the same way. A chat's next turn
  starts in that row with no copy at all, and reuses the reply too.

Entries are found by chained hashes of their whole blocks of `BLOCK` tokens (vLLM's automatic prefix
caching), under the adapter and strengths that computed them (an adapter's low-rank terms change the keys
and values); a found entry is checked token by token (a hash may collide) and followed past its last
whole block, token by token, as far as it and the prompt agree. An adapter loaded or unloaded under a
name forgets that name's entries.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

BLOCK = 16  # tokens an entry is indexed by (the tail past its last whole block is matched token by token)
DEFAULT_BUDGET_BYTES = 256 << 20
SEEN = 4096  # first blocks remembered (hashes, not rows) to admit copies on their second sight

PrefixKey = tuple[str | None, tuple[tuple[str, float], ...]]  # the adapter (None: the base model), its strengths
Rows = Mapping[str, np.ndarray]  # each cache's [heads, tokens, head_dim] copy


def prefix_key(adapter: str | None, strengths: Mapping[str, float]) -> PrefixKey:
    return adapter, tuple(sorted(strengths.items()))


@dataclass(frozen=True)
class Hit:
    """`length` tokens of a prompt whose rows are kept: in `source`, a copy, or a batch row (its number)."""

    length: int
    source: Rows | int


@dataclass
class _Entry:
    key: PrefixKey
    tokens: tuple[int, ...]
    nbytes: int
    source: Rows | int  # a copy, or a batch row held as its sequence left it

    @property
    def row(self) -> int | None:
        return self.source if isinstance(self.source, int) else None


class PrefixCache:
    """Recently computed prefixes' cache rows, the least recently used out past `budget_bytes`.

    `give_back(row)` is called (from the thread that stores and holds: the scheduler's) for a held row the
    budget pushes out, so its memory goes back; `forget`, called from other threads, never calls it (the
    scheduler may be writing the row): a forgotten row's pages go back when it is next used or held."""

    def __init__(
        self, budget_bytes: int = DEFAULT_BUDGET_BYTES, give_back: Callable[[int], object] | None = None
    ) -> None:
        self.budget_bytes = budget_bytes
        self._give_back = give_back or (lambda row: None)
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._index: dict[tuple[PrefixKey, Hashable], list[int]] = {}  # (key, chained block hash) -> entries
        self._held: dict[int, int] = {}  # batch row -> its entry
        self._seen: OrderedDict[tuple[PrefixKey, Hashable], None] = OrderedDict()  # first blocks, least recent first
        self._bytes = 0
        self._next = 0
        self._lock = threading.Lock()  # adapters are loaded from the HTTP thread, prompts run on the scheduler's
        self.hits = 0
        self.reused_tokens = 0

    def lookup(self, key: PrefixKey, prompt: Sequence[int], row: int | None = None) -> Hit | None:
        """The longest prefix of `prompt` kept under `key` (always leaving a token to feed: its logits start
        the reply); batch row `row`'s own entry, if it has one, wins a tie (it needs no copy). None: none."""
        limit = len(prompt) - 1
        hashes = _block_hashes(prompt, limit // BLOCK)
        with self._lock:
            best: tuple[int, int] | None = None  # (length, entry)
            own = self._held.get(row) if row is not None else None
            if own is not None and self._entries[own].key == key:
                best = (_agreeing(self._entries[own].tokens, prompt, 0, limit), own)
            for blocks in range(len(hashes), 0, -1):
                whole = blocks * BLOCK
                found = False
                for number in self._index.get((key, hashes[blocks - 1]), ()):
                    entry = self._entries[number]
                    if entry.tokens[:whole] != tuple(prompt[:whole]):
                        continue  # a hash collision
                    found = True
                    length = _agreeing(entry.tokens, prompt, whole, limit)
                    if best is None or length > best[0]:
                        best = (length, number)
                if found:
                    break
            if best is None or best[0] == 0:
                return None
            length, number = best
            entry = self._entries[number]
            self._entries.move_to_end(number)
            self.hits += 1
            self.reused_tokens += length
            return Hit(length, entry.source)

    def store(self, key: PrefixKey, prompt: Sequence[int], copy: Callable[[int], Rows], token_bytes: int) -> None:
        """Keeps a copy of `prompt`'s rows (`copy(len(prompt))`, `token_bytes` a token) where its first block
        was seen before, unless an entry under `key` holds them all already, or it has no whole block to be
        found by."""
        if len(prompt) < BLOCK or len(prompt) * token_bytes > self.budget_bytes:
            return
        with self._lock:
            if not self._seen_before(key, prompt) or self._covered(key, prompt):
                return
        rows = copy(len(prompt))  # outside the lock: a copy of the rows takes milliseconds
        self._add(_Entry(key, tuple(prompt), len(prompt) * token_bytes, rows))

    def hold(self, row: int, key: PrefixKey, tokens: Sequence[int], token_bytes: int) -> bool:
        """Keeps batch row `row` as it is, holding `tokens`' rows; False (the row is to be given back) when
        it holds nothing worth its memory: no tokens, more than the budget, or what a copy holds already."""
        self.release(row)
        if not tokens or len(tokens) * token_bytes > self.budget_bytes:
            return False
        with self._lock:
            if self._covered(key, tokens):
                return False
        self._add(_Entry(key, tuple(tokens), len(tokens) * token_bytes, row))
        return True

    def release(self, row: int) -> None:
        """Batch row `row` is to be written (a sequence begins in it, or another moves in): whatever it
        held is no longer there."""
        with self._lock:
            number = self._held.get(row)
            if number is not None:
                self._drop(number)

    def forget(self, adapter: str) -> None:
        """An adapter's entries (its weights under that name changed)."""
        with self._lock:
            for number in [n for n, e in self._entries.items() if e.key[0] == adapter]:
                self._drop(number)

    def _seen_before(self, key: PrefixKey, prompt: Sequence[int]) -> bool:
        """Whether a prompt under `key` began with `prompt`'s first block before; remembers that this one did."""
        first = (key, _block_hashes(prompt, 1)[0])
        seen = first in self._seen
        self._seen[first] = None
        self._seen.move_to_end(first)
        if len(self._seen) > SEEN:
            self._seen.popitem(last=False)
        return seen

    def _covered(self, key: PrefixKey, tokens: Sequence[int]) -> bool:
        """Whether an entry under `key` holds `tokens`' rows already (it begins with them all); marks it used."""
        hashes = _block_hashes(tokens, len(tokens) // BLOCK)
        for number in self._index.get((key, hashes[-1]), ()) if hashes else ():
            if self._entries[number].tokens[: len(tokens)] == tuple(tokens):
                self._entries.move_to_end(number)
                return True
        return False

    def _add(self, entry: _Entry) -> None:
        given_back = []
        with self._lock:
            number, self._next = self._next, self._next + 1
            self._entries[number] = entry
            self._bytes += entry.nbytes
            if entry.row is not None:
                self._held[entry.row] = number
            for block_hash in _block_hashes(entry.tokens, len(entry.tokens) // BLOCK):
                self._index.setdefault((entry.key, block_hash), []).append(number)
            while self._bytes > self.budget_bytes:
                oldest = next(iter(self._entries))
                row = self._entries[oldest].row
                self._drop(oldest)
                if row is not None and row != entry.row:
                    given_back.append(row)
        for row in given_back:  # outside the lock: the caller's own thread gives the memory back
            self._give_back(row)

    def _drop(self, number: int) -> None:
        entry = self._entries.pop(number)
        self._bytes -= entry.nbytes
        if entry.row is not None:
            del self._held[entry.row]
        for block_hash in _block_hashes(entry.tokens, len(entry.tokens) // BLOCK):
            numbers = self._index[(entry.key, block_hash)]
            numbers.remove(number)
            if not numbers:
                del self._index[(entry.key, block_hash)]

    @property
    def nbytes(self) -> int:
        return self._bytes

    @property
    def held_rows(self) -> frozenset[int]:
        """The batch rows held as their sequences left them."""
        with self._lock:
            return frozenset(self._held)


def _agreeing(tokens: Sequence[int], prompt: Sequence[int], start: int, limit: int) -> int:
    """How many leading tokens `tokens` and `prompt` share (known to agree before `start`), at most `limit`."""
    end = min(len(tokens), limit)
    if end <= start:
        return end
    differ = np.flatnonzero(np.asarray(tokens[start:end]) != np.asarray(prompt[start:end]))
    return start + int(differ[0]) if differ.size else end


def _block_hashes(tokens: Sequence[int], blocks: int) -> list[int]:
    """Chained hashes of the first `blocks` blocks: each names its block and everything before it."""
    hashes, previous = [], 0
    for index in range(blocks):
        previous = hash((previous, tuple(tokens[index * BLOCK : (index + 1) * BLOCK])))
        hashes.append(previous)
    return hashes
