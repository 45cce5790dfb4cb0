"""Structured outputs: the tokens a grammar allows next, as a mask on a row's logits (llguidance).

A request's constraint (`response_format` json_object / json_schema, vLLM's guided json / regex /
choice / grammar, llama.cpp's `grammar` and `json_schema`) becomes one llguidance grammar (a string:
it crosses to Ray replicas as the request does). llguidance, not xgrammar: it needs nothing beyond itself
(xgrammar's wheel pulls torch, transformers and triton), reads the tokenizer.json Quiver already has,
bounds the work a grammar may cost (`LLParserLimits`: a client's grammar is untrusted), and is what
llama.cpp's and vLLM's servers use too. JSON is compact (no free whitespace: a model cannot wander in
spaces until its tokens run out) unless a schema's `x-guidance` asks otherwise.

Only rows with a constraint pay: their matcher computes the tokens it allows (about a millisecond a
row), and the row's logits outside them are set to -inf before its token is chosen; every other row is
untouched. The scheduler has the masks of a decode step computed while ORT runs that step (`compute`, on
another thread: llguidance lets the GIL go), so they cost the step little more than applying them.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from quiver.errors import QuiverError

if TYPE_CHECKING:  # llguidance loads with the first constrained request
    from llguidance import LLMatcher, LLParserLimits, LLTokenizer

    from quiver.t2t.tokenizer import TextTokenizer

JSON_DEFAULTS = {"whitespace_flexible": False}
# what one client's grammar may cost (llguidance's defaults are 4-10x these)
_LIMITS: dict[str, Any] = {"initial_lexer_fuel": 250_000, "step_lexer_fuel": 100_000, "step_max_items": 25_000,
           "max_lexer_states": 50_000, "max_grammar_size": 100_000, "verbose_errors": False}  # fmt: skip


class GrammarError(QuiverError):
    """A constraint llguidance cannot build or that outgrows its limits: the request's fault (HTTP 400)."""


def json_schema_grammar(schema: Any) -> str:
    """The grammar of JSON text valid under `schema` (a dict, or a JSON string of one); an object that lists
    its properties and says nothing of others allows no others (xgrammar's strict mode, vLLM's default:
    a model would otherwise write keys of its own until its tokens run out)."""
    from llguidance import LLMatcher

    try:
        parsed = json.loads(schema) if isinstance(schema, str) else schema
        return str(LLMatcher.grammar_from_json_schema(_closed(parsed), defaults=JSON_DEFAULTS))  # type: ignore[arg-type]
    except (ValueError, TypeError, RecursionError) as exc:
        raise GrammarError(f"the JSON schema is not a JSON object ({str(exc)[:200]})") from None


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMAS = ("items", "additionalItems", "additionalProperties", "unevaluatedProperties", "not", "if", "then", "else",
            "contains", "propertyNames")  # fmt: skip


def _closed(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` wherever an object lists properties and leaves it unsaid
    (walking only the keywords whose values are schemas: an `enum`'s or a `default`'s values stay)."""
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            closed[key] = {name: _closed(value) for name, value in schema[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            closed[key] = [_closed(value) for value in schema[key]]
    for key in _SCHEMAS:
        if key in schema:
            closed[key] = _closed(schema[key])
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


def regex_grammar(pattern: str) -> str:
    from llguidance import LLMatcher

    return str(LLMatcher.grammar_from_regex(pattern))


def choice_grammar(choices: Sequence[str]) -> str:
    """One of `choices`, exactly."""
    return regex_grammar("|".join(f"(?:{re.escape(c)})" for c in choices))


def lark_grammar(source: str) -> str:
    """A Lark grammar (llguidance's own form, vLLM's `guided_grammar`), or a GBNF one (llama.cpp's)."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return str(LLMatcher.grammar_from_lark(any_to_lark(source)))
    except Exception as exc:  # noqa: BLE001  the converter raises what its parser raises
        raise GrammarError(f"the grammar is neither Lark nor GBNF llguidance reads ({str(exc)[:200]})") from None


class Grammars:
    """llguidance's view of one model's tokenizer (made once, ~0.2 s, at the first constrained request)
    and the matchers of its requests."""

    def __init__(self, tokenizer: TextTokenizer, eos_tokens: Sequence[int], vocabulary: int) -> None:
        self._text = tokenizer
        self._eos = list(eos_tokens)
        self._vocabulary = vocabulary
        self._tokenizer: LLTokenizer | None = None
        self._lock = threading.Lock()

    def _llg(self) -> tuple[LLTokenizer, LLParserLimits]:
        from llguidance import LLParserLimits, LLTokenizer

        with self._lock:
            if self._tokenizer is None:
                eos = self._eos or None  # none given: the tokenizer's own
                self._tokenizer = LLTokenizer(self._text.to_json(), n_vocab=self._vocabulary, eos_token=eos)
            return self._tokenizer, LLParserLimits(**_LIMITS)

    def check(self, grammar: str) -> None:
        """Raises GrammarError unless `grammar` builds within the limits (before the request is queued)."""
        from llguidance import LLMatcher

        tokenizer, limits = self._llg()
        error = LLMatcher.validate_grammar(grammar, tokenizer, limits=limits)
        if error:
            raise GrammarError(f"the constraint cannot be used: {error.strip().splitlines()[0][:300]}")

    def constraint(self, grammar: str) -> Constraint:
        from llguidance import LLMatcher

        tokenizer, limits = self._llg()
        matcher = LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
        if matcher.is_error():
            raise GrammarError(f"the constraint cannot be used: {matcher.get_error()[:300]}")
        return Constraint(matcher, tokenizer.vocab_size)


class Constraint:
    """One row's matcher: masks the logits, follows the chosen tokens (once the grammar is complete it
    allows only an end-of-sequence token: the reply ends there)."""

    def __init__(self, matcher: LLMatcher, vocabulary: int) -> None:
        self._matcher = matcher
        self._bits = np.zeros((1, (vocabulary + 31) // 32), np.int32)
        self._vocabulary = vocabulary
        self._refused: np.ndarray | None = None  # the next token's mask, once computed: True where refused

    def compute(self) -> None:
        """Computes the mask of the next token (another thread may: llguidance lets the GIL go meanwhile)."""
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self._matcher, self._bits)
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self._vocabulary]
        self._refused = allowed == 0

    def mask(self, logits: np.ndarray) -> None:
        """Sets the logits of every token the grammar does not allow next to -inf, in place."""
        if self._refused is None:
            self.compute()
        refused, self._refused = self._refused, None
        assert refused is not None
        flat = logits.reshape(-1)
        flat[self._vocabulary :] = -np.inf  # rows past the tokenizer's vocabulary: padding no text has
        np.copyto(flat[: self._vocabulary], -np.inf, where=refused[: flat.size])
        if self._matcher.is_error():
            raise GrammarError(f"the constraint failed while generating: {self._matcher.get_error()[:300]}")

    def advance(self, token: int) -> None:
        self._refused = None  # a mask computed before this token is no longer the next one's
        if not self._matcher.consume_token(token):
            raise GrammarError(f"the constraint refused token {token}: {self._matcher.get_error()[:300]}")
