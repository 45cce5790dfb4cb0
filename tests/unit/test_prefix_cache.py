"""The prefix cache: the longest whole-block prefix a prompt shares with a kept one, under its adapter
and strengths only, checked token by token, the least recently used out past the budget, an adapter's
prefixes forgotten when its weights change."""

from __future__ import annotations

import numpy as np

from quiver.serve.prefix_cache import BLOCK, PrefixCache, prefix_key

BASE = prefix_key(None, {})


def _rows(length: int) -> dict[str, np.ndarray]:
    return {"past.0.key": np.arange(2 * length * 4, dtype=np.float32).reshape(2, length, 4)}


def _store(cache: PrefixCache, key: tuple, prompt: list[int]) -> list[int]:
    asked: list[int] = []
    cache.store(key, prompt, lambda length: asked.append(length) or _rows(length))
    return asked


def test_the_longest_shared_whole_block_prefix_is_found_leaving_a_token_to_feed() -> None:
    cache = PrefixCache(1 << 30)
    prompt = list(range(3 * BLOCK + 10))
    assert _store(cache, BASE, prompt) == [3 * BLOCK]
    assert _store(cache, BASE, prompt) == []  # held already: no second copy
    found = cache.lookup(BASE, prompt[: 2 * BLOCK + 5] + [999] * 80)
    assert found is not None and found[1] == 2 * BLOCK
    np.testing.assert_array_equal(
        found[0]["past.0.key"][:, : 2 * BLOCK], _rows(3 * BLOCK)["past.0.key"][:, : 2 * BLOCK]
    )
    assert cache.lookup(BASE, prompt[: 3 * BLOCK])[1] == 2 * BLOCK  # type: ignore[index]  # one token left to feed
    assert cache.lookup(BASE, [7] + prompt[1:]) is None  # the first block differs
    assert cache.lookup(prefix_key("adapter", {}), prompt) is None
    assert cache.lookup(prefix_key(None, {"adapter": 0.5}), prompt) is None
    assert cache.hits == 2 and cache.reused_tokens == 4 * BLOCK


def test_the_budget_drops_the_least_recently_used_and_an_adapter_is_forgotten() -> None:
    one = _rows(BLOCK)["past.0.key"].nbytes
    cache = PrefixCache(2 * one)
    first, second, third = ([n] * (BLOCK + 1) for n in (1, 2, 3))
    for prompt in (first, second):
        _store(cache, BASE, prompt)
    assert cache.lookup(BASE, first) is not None  # first is now the most recently used
    _store(cache, BASE, third)
    assert cache.lookup(BASE, second) is None and cache.lookup(BASE, first) is not None
    assert cache.nbytes == 2 * one
    adapted = prefix_key("a", {"a": 1.0})
    _store(cache, adapted, first)
    cache.forget("a")
    assert cache.lookup(adapted, first) is None and cache.lookup(BASE, first) is not None
    assert _store(PrefixCache(0), BASE, first) == []  # off
