"""Structured outputs' grammars (llguidance): a JSON schema's objects that list their properties allow no
others unless they say so (xgrammar's strict mode, vLLM's default), walking only keywords whose values are
schemas; a constraint refuses what its grammar does not allow; a grammar that does not build is one line."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from tokenizers import Tokenizer

from quiver.serve.grammar import Constraint, GrammarError, Grammars, _closed, json_schema_grammar, regex_grammar
from quiver.t2t.tokenizer import TextTokenizer
from tests.support.tiny_llm import tiny_decoder


@pytest.fixture(scope="module")
def grammars(tmp_path_factory: pytest.TempPathFactory) -> tuple[Grammars, TextTokenizer]:
    folder = tmp_path_factory.mktemp("tiny")
    tiny_decoder(folder)
    tokenizer = TextTokenizer(folder / "tokenizer.json")
    size = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    return Grammars(tokenizer, (), size), tokenizer


def _accepts(grammars: tuple[Grammars, TextTokenizer], grammar: str, text: str) -> bool:
    built, tokenizer = grammars
    constraint = built.constraint(grammar)
    try:
        for token in tokenizer.encode(text, add_special_tokens=False):
            constraint.advance(token)
    except GrammarError:
        return False
    return True


def test_listed_properties_close_an_object_unless_it_says_otherwise(grammars: tuple[Grammars, TextTokenizer]) -> None:
    closed = json_schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}}})
    assert _accepts(grammars, closed, '{"a":1}') and not _accepts(grammars, closed, '{"a":1,"b":2}')
    opened = json_schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}},
                                  "additionalProperties": True})  # fmt: skip
    assert _accepts(grammars, opened, '{"a":1,"b":2}')
    schema = {"properties": {"properties": {"properties": {"x": {}}}, "e": {"enum": [{"properties": {}}]}},
              "$defs": {"D": {"properties": {}}}}  # fmt: skip
    assert _closed(schema) == {
        "properties": {"properties": {"properties": {"x": {}}, "additionalProperties": False},
                       "e": {"enum": [{"properties": {}}]}},
        "$defs": {"D": {"properties": {}, "additionalProperties": False}}, "additionalProperties": False,
    }  # fmt: skip


def test_a_bad_constraint_is_one_line(grammars: tuple[Grammars, TextTokenizer]) -> None:
    built, _ = grammars
    with pytest.raises(GrammarError, match="cannot be used"):
        built.check(regex_grammar("[a-z"))
    with pytest.raises(GrammarError, match="not a JSON object"):
        json_schema_grammar("{not json")
    assert _accepts(grammars, regex_grammar("ab+"), "abbb") and not _accepts(grammars, regex_grammar("ab+"), "ba")


def test_a_mask_computed_ahead_on_another_thread_is_the_one_computed_in_place(
    grammars: tuple[Grammars, TextTokenizer],
) -> None:
    """The engine computes a row's next mask while ORT runs the step: the same mask as computed in place,
    and one computed before a token was taken is not used after it."""
    built, _ = grammars
    grammar = regex_grammar("(ab|cd)e+")

    def masked(constraint: Constraint) -> np.ndarray:
        logits = np.zeros(built._vocabulary + 3, np.float32)  # three rows past the vocabulary: padding
        constraint.mask(logits)
        return np.isinf(logits)

    in_place = masked(built.constraint(grammar))
    ahead = built.constraint(grammar)
    worker = threading.Thread(target=ahead.compute)
    worker.start()
    worker.join()
    assert np.array_equal(masked(ahead), in_place)
    assert in_place[-3:].all() and 0 < int((~in_place).sum()) < built._vocabulary
    first = int(np.flatnonzero(~in_place)[0])
    stale, fresh = built.constraint(grammar), built.constraint(grammar)
    stale.compute()  # before the token: no longer the next mask once it is taken
    stale.advance(first)
    fresh.advance(first)
    after = masked(fresh)
    assert np.array_equal(masked(stale), after) and not np.array_equal(after, in_place)
