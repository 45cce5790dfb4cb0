"""The prefix cache: the longest prefix a prompt shares with a kept one (found by whole blocks, followed token
by token past them), under its adapter and strengths only, a batch row held as its sequence left it preferred
to a copy, a copy made only for a prompt whose first block was seen before, the least recently used out past
the budget (a held row's memory given back), an adapter's entries forgotten when its weights change."""

from __future__ import annotations

import numpy as np

from quiver.serve.prefix_cache import BLOCK, PrefixCache, prefix_key

BASE = prefix_key(None, {})
TOKEN_BYTES = 2 * 4 * 4  # _rows: 2 heads of 4 float32 a token


def _rows(length: int) -> dict[str, np.ndarray]:
    return {"past.0.key": np.arange(2 * length * 4, dtype=np.float32).reshape(2, length, 4)}


def _store(cache: PrefixCache, key: tuple, prompt: list[int]) -> list[int]:
    """The lengths `store` asked copies of."""
    asked: list[int] = []
    cache.store(key, prompt, lambda length: asked.append(length) or _rows(length), TOKEN_BYTES)
    return asked


def _store_seen(cache: PrefixCache, key: tuple, prompt: list[int]) -> list[int]:
    """`_store` after a first sight of the prompt's first block (which copies nothing)."""
    assert _store(cache, key, prompt) == []
    return _store(cache, key, prompt)


def test_the_longest_shared_prefix_is_found_past_its_whole_blocks_leaving_a_token_to_feed() -> None:
    cache = PrefixCache(1 << 30)
    prompt = list(range(3 * BLOCK + 10))
    assert _store(cache, BASE, prompt) == []  # its first block never seen before: no copy
    assert _store(cache, BASE, prompt) == [len(prompt)]  # seen: every token, not only whole blocks
    assert _store(cache, BASE, prompt) == []  # held already: no second copy
    assert _store(cache, BASE, prompt[:40]) == []  # nor of a prefix of it
    assert _store(cache, BASE, list(range(500, 500 + BLOCK - 1))) == []  # no whole block to be found by
    found = cache.lookup(BASE, prompt[: 2 * BLOCK + 5] + [999] * 80)
    assert found is not None and found.length == 2 * BLOCK + 5 and not isinstance(found.source, int)
    np.testing.assert_array_equal(found.source["past.0.key"], _rows(len(prompt))["past.0.key"])
    assert cache.lookup(BASE, prompt).length == len(prompt) - 1  # type: ignore[union-attr]  # one token left to feed
    assert cache.lookup(BASE, prompt + [5, 6]).length == len(prompt)  # type: ignore[union-attr]
    assert cache.lookup(BASE, [7] + prompt[1:]) is None  # the first block differs
    assert cache.lookup(BASE, prompt[:BLOCK]) is None  # no whole block to find it by, and no row of its own
    assert _store(cache, BASE, prompt[:BLOCK] + [1] * 40) == [BLOCK + 40]  # its first block was seen
    assert cache.lookup(prefix_key("adapter", {}), prompt) is None
    assert cache.lookup(prefix_key(None, {"adapter": 0.5}), prompt) is None
    assert cache.hits == 3 and cache.reused_tokens == (2 * BLOCK + 5) + (len(prompt) - 1) + len(prompt)


def test_a_held_row_is_found_in_place_preferred_to_a_copy_and_released_when_written() -> None:
    cache = PrefixCache(1 << 30)
    chat = list(range(100, 100 + 2 * BLOCK + 3))
    _store_seen(cache, BASE, chat)
    reply = [1, 2, 3]
    assert cache.hold(4, BASE, chat + reply, TOKEN_BYTES)
    turn = chat + reply + [9] * 30
    found = cache.lookup(BASE, turn, row=4)
    assert found is not None and found.source == 4 and found.length == len(chat) + 3
    elsewhere = cache.lookup(BASE, turn, row=0)  # from row 0, held row 4 is a copy source
    assert elsewhere is not None and elsewhere.source == 4 and elsewhere.length == len(chat) + 3
    assert cache.lookup(BASE, chat + [9] * 30, row=4).source == 4  # type: ignore[union-attr]  # a tie: no copy
    cache.release(4)
    found = cache.lookup(BASE, turn, row=4)
    assert found is not None and not isinstance(found.source, int) and found.length == len(chat)  # the copy is left
    assert not cache.hold(5, BASE, chat[:20], TOKEN_BYTES)  # the copy holds all of it: the row goes back
    assert not cache.hold(5, BASE, [], TOKEN_BYTES)


def test_the_budget_drops_the_least_recently_used_and_gives_held_rows_back_an_adapter_is_forgotten() -> None:
    one = (BLOCK + 1) * TOKEN_BYTES
    given_back: list[int] = []
    cache = PrefixCache(2 * one, give_back=given_back.append)
    first, second, third = ([n] * (BLOCK + 1) for n in (1, 2, 3))
    _store_seen(cache, BASE, first)
    assert cache.hold(3, BASE, second, TOKEN_BYTES)
    assert cache.lookup(BASE, first + [0]) is not None  # first is now the most recently used
    _store_seen(cache, BASE, third)
    assert cache.lookup(BASE, second + [0], row=3) is None and cache.lookup(BASE, first + [0]) is not None
    assert given_back == [3] and cache.nbytes == 2 * one
    adapted = prefix_key("a", {"a": 1.0})
    assert cache.hold(6, adapted, first, TOKEN_BYTES)
    cache.forget("a")
    assert cache.lookup(adapted, first + [0], row=6) is None and cache.lookup(BASE, first + [0]) is not None
    assert given_back == [3]  # the copy of `third` made room for row 6; forgetting gives no row back itself
    assert _store_seen(PrefixCache(0), BASE, first) == []  # off
    assert not PrefixCache(0).hold(0, BASE, first, TOKEN_BYTES)
