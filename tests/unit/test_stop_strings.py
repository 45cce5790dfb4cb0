"""Stop strings matched as text arrives give what searching the whole text each step gives."""

from __future__ import annotations

import random

from quiver.t2t.continuation import StopString, first_stop


def _searched(text: str, stops: list[str]) -> tuple[int, int]:
    """The whole text searched: where the first stop string begins, and the longest end of the text that
    begins one (what a reply holds back)."""
    hit = min((i for s in stops if (i := text.find(s)) >= 0), default=-1)
    prefix = max((n for s in stops for n in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:n])),
                 default=0)  # fmt: skip
    return hit, prefix


def test_incremental_matching_equals_searching_the_whole_text() -> None:
    rng = random.Random(7)
    for _ in range(400):
        alphabet = "ab" if rng.random() < 0.7 else "abc "
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
        matchers = [StopString(s) for s in stops]
        text = ""
        while len(text) < 60:
            piece = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
            hit = first_stop(matchers, len(text), piece)
            expected_hit, _ = _searched(text + piece, stops)
            assert hit == expected_hit, (stops, text, piece)
            if hit >= 0:
                break
            text += piece
            assert max(m.matched for m in matchers) == _searched(text, stops)[1], (stops, text)


def test_long_stop_strings_cost_a_step_its_new_characters() -> None:
    stops = [StopString("x" * 255 + str(i)) for i in range(4)]
    calls = 0
    for stop in stops:
        original = stop.feed

        def counted(character: str, feed=original) -> bool:  # type: ignore[no-untyped-def]
            nonlocal calls
            calls += 1
            return feed(character)

        stop.feed = counted  # type: ignore[method-assign]
    text = ""
    for _ in range(200):
        piece = "xx"
        assert first_stop(stops, len(text), piece) == -1
        text += piece
    assert calls == 4 * len(text)  # one call per stop string per new character, whatever the text's length
