"""OpenAI's HTTP API as Quiver serves it: requests checked field by field, replies and errors in its schema.

Only what the scheduler can honour is accepted: every field is honoured, metadata (`user`...), or refused
with a 400 naming it (`param`), as OpenAI's own server refuses an unknown one; fields not implemented yet
(`logprobs`, `tools`, `response_format`...) are accepted only at their neutral value, so a client's
defaults pass and nothing asked for is silently ignored. Sampling: `temperature`, `top_p`, `top_k`
(vLLM's: -1 or 0 off), `min_p`, `presence_penalty` and `frequency_penalty` (OpenAI's, over the reply's
tokens), `repetition_penalty` (vLLM's and transformers', over prompt and reply), `logit_bias`;
`stop_token_ids` and `ignore_eos` (vLLM's). Quiver's extensions ride in the body (the `openai` client's
`extra_body`): `lora`, strengths per adapter (Genie's), e.g. `{"lora": {"chat": 0.5}}`, and vLLM's
`min_tokens`. Non-streaming replies carry each choice's `token_ids`.
"""

from __future__ import annotations

import itertools
import json
import math
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from dataclasses import field as dataclasses_field
from typing import Any

from quiver.runtime.state import MAX_LORA_STRENGTH
from quiver.serve.grammar import GrammarError, choice_grammar, json_schema_grammar, lark_grammar, regex_grammar
from quiver.serve.scheduler import Done, Generation, TokenLogprob
from quiver.serve.tools import ToolError, ToolRequest, tool_request
from quiver.t2t.tokenizer import is_utf8

MAX_STOP = 4  # OpenAI's limit on stop sequences

# Every field a request may carry, and what becomes of it. Honoured: read below. Metadata: OpenAI's fields
# that change nothing in the reply (who asks, what to store, routing hints). Neutral only: fields of
# OpenAI's schemas or vLLM's extras that Quiver does not implement yet, accepted only at the value that
# asks for nothing (a client library sending its defaults), else a 400 naming the field. Anything else
# is refused as OpenAI refuses it ("Unrecognized request argument"): nothing is silently ignored.
# the fields that constrain a reply to a grammar (one at most): OpenAI's, vLLM's, llama.cpp's
_CONSTRAINTS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                "structured_outputs", "grammar", "json_schema")  # fmt: skip
_HONOURED = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "seed", "stream",
             "stream_options", "n", "min_tokens", "lora", "top_k", "min_p", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "logit_bias", "stop_token_ids", "ignore_eos", "logprobs",
             *_CONSTRAINTS}  # fmt: skip
MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS = 1024, 64  # entries a request may give
MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat's top_logprobs (and vLLM's default max_logprobs)
_RENDERING = {
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
    "documents",
}  # how the chat template renders
MAX_DOCUMENTS = 64
_HONOURED_BY_ROUTE = {
    True: {"messages", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls", *_RENDERING},
    False: {"prompt", "best_of", "echo"},
}  # chat, completions
MAX_CHOICES = 16  # generations one request may ask for: prompts x (best_of or n)
MAX_CHOICE_STRINGS = 1024
_METADATA = {"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key", "request_id"}
_OFF: tuple[Any, ...] = (None, False, 0, 0.0, [], {}, "")
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "echo": _OFF, "best_of": (None, 1), "suffix": _OFF,
    "functions": _OFF, "function_call": (None, "none", "auto"),
    "skip_special_tokens": (None, True), "spaces_between_special_tokens": (None, True),
    "include_stop_str_in_output": _OFF,
    "modalities": (None, ["text"]), "prediction": _OFF, "audio": _OFF, "reasoning_effort": (None,),
    "web_search_options": _OFF, "prompt_logprobs": (None,), "allowed_token_ids": (None,), "bad_words": _OFF,
    "use_beam_search": _OFF, "length_penalty": (None, 1, 1.0), "truncate_prompt_tokens": (None,),
    "verbosity": (None,), "cache_prompt": (None, True, False),
}  # fmt: skip


class ApiError(Exception):
    """A request the server refuses: HTTP `status` and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    @property
    def kind(self) -> str:
        return {401: "authentication_error", 404: "invalid_request_error", 429: "rate_limit_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error"
        )

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Served:
    """What the server offers: the base model's id, the adapters' names, the context, the vocabulary."""

    base: str
    adapters: Sequence[str]
    context_size: int
    vocabulary: int

    def model_ids(self) -> list[str]:
        return [self.base, *self.adapters]


def _field(body: Mapping[str, Any], name: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        expected = " or ".join(k.__name__ for k in kinds)
        raise ApiError(400, f"'{name}' must be {expected}, not {type(value).__name__}", name, "invalid_type")
    return value


def _number(body: Mapping[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = float(_field(body, name, (int, float), default))
    if not (math.isfinite(value) and low <= value <= high):
        raise ApiError(400, f"'{name}' must be from {low} to {high}, not {value}", name, "invalid_value")
    return value


def _token_id(value: Any, vocabulary: int) -> int | None:
    """A token id given as an integer or (a JSON object's key) its decimal text, within the vocabulary."""
    if isinstance(value, str) and value.isdigit() and len(value) <= 12:
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocabulary:
        return value
    return None


def check_fields(body: Any, chat: bool) -> None:
    """Refuses a field Quiver does not honour (or a neutral-only one at another value), naming it."""
    honoured = _HONOURED | _HONOURED_BY_ROUTE[chat] | _METADATA
    _check_route_fields(body, honoured, _NEUTRAL, "chat completions" if chat else "completions")


# vLLM's /tokenize (text, or messages through the chat template) and /detokenize
_TOKENIZE = {"model", "prompt", "messages", "add_special_tokens", "return_token_strs", "tools", *_RENDERING}
_RESERVED = {"messages", "add_generation_prompt", "bos_token", "eos_token", "tools", "documents", "raise_exception"}
_DETOKENIZE = {"model", "tokens"}


def _check_route_fields(body: Any, honoured: set[str], neutral: Mapping[str, tuple[Any, ...]], route: str) -> None:
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", None, "invalid_body")
    for name, value in body.items():
        if name in honoured:
            continue
        if name in neutral:
            if not any(value == off and type(value) is type(off) or value is off for off in neutral[name]):
                raise ApiError(400, f"'{name}' is not supported by this server (only its default is accepted)",
                               name, "unsupported_parameter")  # fmt: skip
            continue
        raise ApiError(400, f"Unrecognized request argument supplied to {route}: '{str(name)[:60]}'",
                       str(name)[:60], "unsupported_parameter")  # fmt: skip


def _served_model(body: Mapping[str, Any], served: Served, required: bool) -> str | None:
    """`model`, one that is served (the base model's id or an adapter's name)."""
    model = _field(body, "model", (str,))
    if model is None and required:
        raise ApiError(400, "'model' is required: the base model's id or an adapter's name", "model", "missing")
    if model is not None and model not in served.model_ids():
        raise ApiError(404, f"the model '{model[:100]}' does not exist; GET /v1/models lists them", "model",
                       "model_not_found")  # fmt: skip
    return model


@dataclass(frozen=True)
class ChatRendering:
    """How a request asks the chat template to render: `add_generation_prompt` (default true),
    `continue_final_message` (the reply continues the last message), `chat_template_kwargs` (more names),
    `documents` (for retrieval templates)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    variables: Mapping[str, Any] = dataclasses_field(default_factory=dict)

    def with_tools(self, tools: ToolRequest | None) -> ChatRendering:
        """The rendering with the request's tools for the template to list (its `tools`)."""
        return replace(self, variables={**self.variables, "tools": tools.tools}) if tools else self


def chat_rendering(body: Mapping[str, Any]) -> ChatRendering:
    """A chat request's rendering fields, checked (transformers' and vLLM's rules)."""
    cont = _field(body, "continue_final_message", (bool,), False)
    prompt = _field(body, "add_generation_prompt", (bool,), not cont)
    if prompt and cont:
        raise ApiError(400, "'continue_final_message' needs 'add_generation_prompt': false", "continue_final_message",
                       "invalid_value")  # fmt: skip
    variables = _field(body, "chat_template_kwargs", (dict,), {})
    bad = [k for k in variables if not isinstance(k, str) or not k.isidentifier() or k in _RESERVED]
    if bad or len(variables) > 64:
        raise ApiError(400, "'chat_template_kwargs' maps up to 64 names (not messages, tools, the special tokens) to "
                       "values", "chat_template_kwargs", "invalid_value")  # fmt: skip
    documents = _field(body, "documents", (list,), None)
    if documents is not None:  # vLLM's: for a retrieval template (transformers passes them as `documents`)
        plain = all(isinstance(d, dict) and all(isinstance(v, str) for v in d.values()) for d in documents)
        if not plain or len(documents) > MAX_DOCUMENTS:
            raise ApiError(400, f"'documents' is a list of up to {MAX_DOCUMENTS} objects of strings (e.g. title, "
                           "text)", "documents", "invalid_value")  # fmt: skip
        variables = {**variables, "documents": documents}
    return ChatRendering(prompt, cont, dict(variables))


@dataclass(frozen=True)
class TokenizeRequest:
    """A checked /tokenize body: text to encode (special tokens added or not), or chat messages to render."""

    text: str | None
    messages: list[dict[str, str]] | None
    add_special_tokens: bool
    rendering: ChatRendering
    return_token_strs: bool


def tokenize_request(body: Any, served: Served) -> TokenizeRequest:
    """vLLM's /tokenize body: `prompt` (text; `add_special_tokens` default true) or `messages` (rendered by
    the chat template; `add_generation_prompt` default true, `add_special_tokens` default false)."""
    _check_route_fields(body, _TOKENIZE, {}, "tokenize")
    _served_model(body, served, required=False)
    chat = "messages" in body
    if chat == ("prompt" in body):
        raise ApiError(400, "give either 'prompt' (text) or 'messages' (a chat)", "prompt", "invalid_value")
    if chat:
        messages, text = chat_messages(body, served.context_size), None
    else:
        text, messages = _field(body, "prompt", (str,), ""), None
        if len(text) > served.context_size * MAX_CHARS_PER_TOKEN:
            raise ApiError(400, f"'prompt' is longer than the model's context of {served.context_size} tokens "
                           "could hold", "prompt", "context_length_exceeded")  # fmt: skip
        text = _text(text, "prompt")
    return TokenizeRequest(
        text,
        messages,
        _field(body, "add_special_tokens", (bool,), not chat),
        _with_tools(chat_rendering(body), body),
        _field(body, "return_token_strs", (bool,), False),
    )


def _with_tools(rendering: ChatRendering, body: Mapping[str, Any]) -> ChatRendering:
    """The rendering with a body's `tools` for the template to list (checked as a chat's are)."""
    try:
        tools = tool_request({"tools": body.get("tools"), "tool_choice": "none"}, None)
    except ToolError as exc:
        raise ApiError(400, str(exc), exc.param, "invalid_value") from None
    return rendering.with_tools(tools)


def detokenize_request(body: Any, served: Served) -> list[int]:
    """vLLM's /detokenize body: `tokens`, ids of this model's vocabulary (at most a context's worth)."""
    _check_route_fields(body, _DETOKENIZE, {}, "detokenize")
    _served_model(body, served, required=False)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in tokens):
        raise ApiError(400, "'tokens' must be a list of token ids", "tokens", "invalid_value")
    if len(tokens) > served.context_size:
        raise ApiError(400, f"'tokens' holds more than the model's context of {served.context_size}", "tokens",
                       "context_length_exceeded")  # fmt: skip
    if not all(0 <= i < served.vocabulary for i in tokens):
        raise ApiError(400, f"token ids in 'tokens' must be 0 to {served.vocabulary - 1}", "tokens", "invalid_value")
    return tokens


def include_usage(body: Mapping[str, Any]) -> bool:
    """`stream_options.include_usage`: a streamed reply ends with a chunk of the usage (OpenAI's)."""
    options = _field(body, "stream_options", (dict,), {})
    unknown = sorted(set(options) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        raise ApiError(400, f"'stream_options.{str(unknown[0])[:40]}' is not supported", "stream_options",
                       "unsupported_parameter")  # fmt: skip
    if options.get("continuous_usage_stats"):
        raise ApiError(400, "'stream_options.continuous_usage_stats' is not supported", "stream_options",
                       "unsupported_parameter")  # fmt: skip
    value = options.get("include_usage", False)
    if not isinstance(value, bool):
        raise ApiError(400, "'stream_options.include_usage' must be true or false", "stream_options", "invalid_type")
    return value


def _constrains(value: Any) -> bool:
    return value is not None and value != {"type": "text"}  # response_format text: no constraint


def constraint_field(body: Mapping[str, Any]) -> str | None:
    """The field of `body` that constrains its reply (`constraint_grammar` allows one)."""
    return next((n for n in _CONSTRAINTS if _constrains(body.get(n))), None)


def constraint_grammar(body: Mapping[str, Any]) -> str | None:
    """The grammar (llguidance's) a request's reply must match, from whichever field asks: OpenAI's
    `response_format` (json_object, json_schema), vLLM's guided json / regex / choice / grammar and its
    `structured_outputs`, llama.cpp's `grammar` (GBNF) and `json_schema`; None where none does."""
    asked = [n for n in _CONSTRAINTS if _constrains(body.get(n))]
    if len(asked) > 1:
        raise ApiError(400, f"give one constraint, not {' and '.join(asked)}", asked[1], "invalid_value")
    if not asked:
        return None
    name = asked[0]
    kind, value = name, body[name]
    if name == "response_format":
        kind, value = _response_format(value)
    elif name == "structured_outputs":
        given = [k for k in ("json", "regex", "choice", "grammar") if isinstance(value, dict) and k in value]
        if len(given) != 1 or len(value) != 1:
            raise ApiError(400, "'structured_outputs' holds one of json, regex, choice, grammar", name, "invalid_value")
        kind, value = f"guided_{given[0]}", value[given[0]]
    try:
        if kind in ("guided_json", "json_schema"):
            if not isinstance(value, (dict, str)):
                raise GrammarError("a JSON schema is an object")
            return json_schema_grammar(value)
        if kind == "guided_regex" and isinstance(value, str):
            return regex_grammar(value)
        if kind == "guided_choice" and isinstance(value, list) and 0 < len(value) <= MAX_CHOICE_STRINGS:
            if all(isinstance(c, str) and c for c in value):
                return choice_grammar(value)
        if kind in ("guided_grammar", "grammar") and isinstance(value, str) and value.strip():
            return lark_grammar(value)
    except GrammarError as exc:
        raise ApiError(400, str(exc), name, "invalid_value") from None
    raise ApiError(400, f"'{name}' is not a constraint this server reads (a regex, up to {MAX_CHOICE_STRINGS} "
                   "choices, a grammar, a JSON schema)", name, "invalid_value")  # fmt: skip


def _response_format(value: Any) -> tuple[str, Any]:
    """OpenAI's `response_format`: json_object (any JSON object) or json_schema ({name, schema, strict})."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        return "json_schema", {"type": "object"}
    if kind == "json_schema" and isinstance(value.get("json_schema"), dict):
        schema = value["json_schema"].get("schema", {})
        return "json_schema", schema if schema is not None else {}
    raise ApiError(400, "'response_format' must be text, json_object or json_schema with a 'json_schema' object",
                   "response_format", "invalid_value")  # fmt: skip


def echoed(body: Mapping[str, Any]) -> bool:
    """Completions' `echo`: the prompt's text (and with `logprobs`, its tokens') before the completion's."""
    echo = _field(body, "echo", (bool,), False)
    if echo and "messages" in body:
        raise ApiError(400, "'echo' is a completions field", "echo", "unsupported_parameter")
    return bool(echo)


def _logprobs(body: Mapping[str, Any]) -> int | None:
    """How many of the most likely tokens to report beside each generated one's log-probability (None: no
    log-probabilities): chat's `logprobs` (true) and `top_logprobs`, completions' `logprobs` (a count)."""
    if "messages" in body:
        top = _field(body, "top_logprobs", (int,))
        if not _field(body, "logprobs", (bool,), False):
            if top:
                raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs", "invalid_value")
            return None
        top, param = top or 0, "top_logprobs"
    else:
        top, param = _field(body, "logprobs", (int,)), "logprobs"
        if top is None:
            return None
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"'{param}' must be 0 to {MAX_TOP_LOGPROBS}", param, "invalid_value")
    return int(top)


def generation(body: Any, served: Served, prompt_ids: list[int], default_max_tokens: int | None) -> Generation:
    """A request body's sampling fields and adapter, checked against what is served (its fields checked
    first by `check_fields`)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", None, "invalid_body")
    model = _served_model(body, served, required=True)
    room = served.context_size - len(prompt_ids) - 1
    if room < 1:
        where = "messages" if "messages" in body else "prompt"
        raise ApiError(400, f"the prompt ({len(prompt_ids)} tokens) leaves no room in the {served.context_size}-token "
                       "context; shorten it", where, "context_length_exceeded")  # fmt: skip
    given = body.get("max_completion_tokens")
    max_tokens = given if given is not None else body.get("max_tokens")  # a null field is an absent one
    if max_tokens is None:  # chat: until the context is full; completions: OpenAI's 16
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    echo = echoed(body)
    least = 0 if echo else 1  # an echo may ask for the prompt's log-probabilities alone (lm-eval's requests)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not least <= max_tokens <= room:
        raise ApiError(400, f"'max_tokens' must be {least} to {room} (the context's room after the prompt), not "
                       f"{str(max_tokens)[:40]}", "max_tokens", "invalid_value")  # fmt: skip
    min_tokens = _field(body, "min_tokens", (int,), 0)
    if not 0 <= min_tokens <= max_tokens:
        raise ApiError(400, f"'min_tokens' must be 0 to max_tokens ({max_tokens})", "min_tokens", "invalid_value")
    stop = _field(body, "stop", (str, list), [])
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > MAX_STOP or not all(isinstance(s, str) and 0 < len(s) <= 256 for s in stops):
        raise ApiError(400, f"'stop' must be a string or up to {MAX_STOP} non-empty strings", "stop", "invalid_value")
    seed = _field(body, "seed", (int,))
    if seed is not None and not 0 <= seed < 2**63:
        raise ApiError(400, "'seed' must be 0 to 2^63 - 1", "seed", "invalid_value")
    strengths = _field(body, "lora", (dict,), {})
    if strengths and model == served.base:
        raise ApiError(400, "'lora' sets an adapter's strengths: name an adapter as the model", "lora", "invalid_value")
    for name, value in strengths.items():
        if (
            not isinstance(value, (int, float))
            or isinstance(value, bool)
            or not math.isfinite(value)
            or abs(value) > MAX_LORA_STRENGTH
        ):
            raise ApiError(400, f"'lora.{str(name)[:40]}' must be a number from -{MAX_LORA_STRENGTH:g} to "
                           f"{MAX_LORA_STRENGTH:g}", "lora", "invalid_value")  # fmt: skip
    bias = _field(body, "logit_bias", (dict,), {})
    if len(bias) > MAX_LOGIT_BIAS or not all(
        _token_id(k, served.vocabulary) is not None and isinstance(v, (int, float)) and not isinstance(v, bool)
        and math.isfinite(v) and -100 <= v <= 100 for k, v in bias.items()
    ):  # fmt: skip
        raise ApiError(400, f"'logit_bias' maps up to {MAX_LOGIT_BIAS} token ids (0 to {served.vocabulary - 1}) to "
                       "biases from -100 to 100", "logit_bias", "invalid_value")  # fmt: skip
    stop_ids = _field(body, "stop_token_ids", (list,), [])
    if len(stop_ids) > MAX_STOP_TOKEN_IDS or not all(_token_id(i, served.vocabulary) is not None for i in stop_ids):
        raise ApiError(400, f"'stop_token_ids' lists up to {MAX_STOP_TOKEN_IDS} token ids, 0 to "
                       f"{served.vocabulary - 1}", "stop_token_ids", "invalid_value")  # fmt: skip
    logprobs = _logprobs(body)
    top_k = _field(body, "top_k", (int,), 0)
    if top_k < -1:
        raise ApiError(400, "'top_k' must be -1 or 0 (every token) or a count of tokens", "top_k", "invalid_value")
    return Generation(
        prompt_ids=prompt_ids,
        adapter=None if model == served.base else model,
        strengths={str(k): float(v) for k, v in strengths.items()},
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        seed=seed,
        stop=tuple(stops),
        min_tokens=min_tokens,
        top_k=max(top_k, 0),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 1e-3, 100.0),
        logit_bias=tuple(sorted((int(k), float(v)) for k, v in bias.items())),
        stop_token_ids=tuple(int(i) for i in stop_ids),
        ignore_eos=_field(body, "ignore_eos", (bool,), False),
        logprobs=logprobs,
        prompt_logprobs=logprobs if echo and logprobs is not None else None,
        grammar=constraint_grammar(body),
    )


# The most characters a token stands for in a prompt checked before it is tokenized: more than any
# tokenizer's longest tokens on average (runs of spaces are the longest), so that only a prompt that could
# never fit the context is refused on its length alone, before the work of tokenizing it.
MAX_CHARS_PER_TOKEN = 64


def _text(value: str, param: str) -> str:
    """A string from the body that is text: no lone surrogates (JSON's \\ud800 escapes) or NUL."""
    if not is_utf8(value):
        raise ApiError(400, f"'{param}' holds text that is not Unicode (a lone surrogate)", param, "invalid_value")
    if "\0" in value:
        raise ApiError(400, f"'{param}' holds a NUL character", param, "invalid_value")
    return value


def completion_prompts(body: Any, vocabulary: int, context_size: int) -> list[str | list[int]]:
    """`prompt`: text, token ids, or a list of either (OpenAI's prompt lists: a choice per prompt); one that
    could not fit the context is refused before any work on it."""
    prompt = body.get("prompt") if isinstance(body, dict) else None
    many = isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)
    prompts = list(prompt) if many and isinstance(prompt, list) else [prompt]
    if len(prompts) > MAX_CHOICES:
        raise ApiError(400, f"'prompt' lists {len(prompts)} prompts; at most {MAX_CHOICES}", "prompt", "invalid_value")
    return [_one_prompt(p, vocabulary, context_size) for p in prompts]


def _one_prompt(prompt: Any, vocabulary: int, context_size: int) -> str | list[int]:
    if isinstance(prompt, (str, list)) and len(prompt) > context_size * (
        MAX_CHARS_PER_TOKEN if isinstance(prompt, str) else 1
    ):
        raise ApiError(400, f"'prompt' is longer than the model's context of {context_size} tokens could hold",
                       "prompt", "context_length_exceeded")  # fmt: skip
    if isinstance(prompt, str) and prompt:
        return _text(prompt, "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        if not all(0 <= i < vocabulary for i in prompt):
            raise ApiError(400, f"token ids in 'prompt' must be 0 to {vocabulary - 1}", "prompt", "invalid_value")
        return list(prompt)
    raise ApiError(400, "'prompt' must be a non-empty string, a list of token ids, or a list of those", "prompt",
                   "invalid_value")  # fmt: skip


@dataclass(frozen=True)
class ChoiceCounts:
    """Per prompt, `best_of` generations of which the `n` most likely (by the sum of their tokens'
    log-probabilities) are the choices; `best_of` is `n` unless asked."""

    n: int
    best_of: int

    def expanded(self, request: Generation) -> list[Generation]:
        """The generations of one prompt: generation j samples with seed + j (a seeded request's choices
        differ, each reproducible); ranking them needs their log-probabilities."""
        ranked = self.best_of > self.n and request.logprobs is None
        return [
            replace(request, seed=None if request.seed is None else (request.seed + j) % 2**63,
                                logprobs=0 if ranked else request.logprobs)
            for j in range(self.best_of)
        ]  # fmt: skip

    def chosen(self, dones: Sequence[Done], report_logprobs: bool) -> list[Done]:
        """Of one prompt's generations, its choices: the `n` most likely where `best_of` > `n`."""
        kept = list(dones)
        if self.best_of > self.n:
            kept = sorted(kept, key=lambda d: -sum(e.logprob for e in d.logprobs or ()))[: self.n]
        return kept if report_logprobs else [replace(d, logprobs=None) for d in kept]


def choice_counts(body: Mapping[str, Any], prompts: int, stream: bool) -> ChoiceCounts:
    """`n` (choices per prompt) and completions' `best_of`, bounded: prompts x best_of <= MAX_CHOICES."""
    n = _field(body, "n", (int,), 1)
    best_of = _field(body, "best_of", (int,), n)
    if n < 1 or best_of < n:
        raise ApiError(400, "'n' must be at least 1, and 'best_of' at least 'n'", "n" if n < 1 else "best_of",
                       "invalid_value")  # fmt: skip
    if best_of > n and stream:
        raise ApiError(400, "'best_of' above 'n' cannot stream (the choices are known at the end)", "best_of",
                       "invalid_value")  # fmt: skip
    if prompts * best_of > MAX_CHOICES:
        param = "best_of" if "best_of" in body else "n"
        raise ApiError(400, f"{prompts} prompt(s) x {best_of} choices is more than this server's {MAX_CHOICES} "
                       "generations a request", param, "invalid_value")  # fmt: skip
    return ChoiceCounts(n, best_of)


MAX_TOOL_CALLS = 64  # calls one assistant message may hold


def chat_messages(body: Any, context_size: int) -> list[dict[str, Any]]:
    """`messages`: a list of {role, content} with text content (parts of type text are joined), an
    assistant's `tool_calls` and a tool's reply (`tool_call_id`); a chat that could not fit the context is
    refused before it is rendered."""
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", "messages", "invalid_value")
    if len(messages) > context_size:
        raise ApiError(400, f"{len(messages)} messages cannot fit the model's context of {context_size} tokens",
                       "messages", "context_length_exceeded")  # fmt: skip
    checked = [_message(message, index) for index, message in enumerate(messages)]
    if sum(len(json.dumps(m)) for m in checked) > context_size * MAX_CHARS_PER_TOKEN:
        raise ApiError(400, f"the messages are longer than the model's context of {context_size} tokens could hold",
                       "messages", "context_length_exceeded")  # fmt: skip
    return checked


def _message(message: Any, index: int) -> dict[str, Any]:
    where = f"messages[{index}]"
    role = message.get("role") if isinstance(message, dict) else None
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, list):  # [{"type": "text", "text": ...}]
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        content = "".join(p for p in parts if isinstance(p, str)) if len(parts) == len(content) else None
    calls = message.get("tool_calls") if role == "assistant" else None
    if calls and content is None:
        content = ""  # an assistant's turn of calls alone
    if role not in ("system", "developer", "user", "assistant", "tool") or not isinstance(content, str):
        raise ApiError(400, f"{where} must have a role (system, user, assistant, tool) and text content", where,
                       "invalid_value")  # fmt: skip
    checked: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": _text(content, where)}
    if calls:
        if not isinstance(calls, list) or len(calls) > MAX_TOOL_CALLS or not all(_a_call(c) for c in calls):
            raise ApiError(400, f"{where}.tool_calls must be up to {MAX_TOOL_CALLS} of {{id, type: function, "
                           "function: {name, arguments}}}", where, "invalid_value")  # fmt: skip
        checked["tool_calls"] = [{"id": c["id"], "type": "function", "function": {"name": c["function"]["name"],
                                  "arguments": c["function"]["arguments"]}} for c in calls]  # fmt: skip
    if role == "tool":
        for key in ("tool_call_id", "name"):
            if isinstance(message.get(key), str):
                checked[key] = message[key]
    return checked


def _a_call(call: Any) -> bool:
    function = call.get("function") if isinstance(call, dict) else None
    return (
        isinstance(function, dict) and isinstance(call.get("id"), str) and isinstance(function.get("name"), str)
        and isinstance(function.get("arguments"), str)
    )  # fmt: skip


def usage(prompt_tokens: int, choices: Sequence[Done]) -> dict[str, int]:
    """The usage of a request: its prompts' tokens (each once), its choices' tokens."""
    generated = sum(len(done.token_ids) for done in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": generated, "total_tokens": prompt_tokens + generated}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


TokenText = Callable[[int], str]  # a token id's text (the tokenizer's, special tokens written out)
LOGPROB_FLOOR = -9999.0  # JSON has no -inf (vLLM's floor)


def _logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def _chat_logprobs(entries: Sequence[TokenLogprob], text_of: TokenText) -> dict[str, Any]:
    """Chat's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def one(token: int, logprob: float) -> dict[str, Any]:
        text = text_of(token)
        return {"token": text, "logprob": _logprob(logprob), "bytes": list(text.encode())}

    return {"content": [one(e.token, e.logprob) | {"top_logprobs": [one(*t) for t in e.top]} for e in entries]}


def _completion_logprobs(
    entries: Sequence[TokenLogprob], text_of: TokenText, offset: int, echo: Echo | None = None
) -> dict[str, Any]:
    """Completions' `logprobs`: tokens, token_logprobs, top_logprobs ({token: logprob}), text_offset (each
    token's start in the text, from `offset`); an echoed prompt's tokens first (its first token has none)."""
    scored: list[TokenLogprob | None] = [None, *echo.logprobs] if echo else []
    tokens = [text_of(t) for t in echo.ids] if echo else []
    tokens += [text_of(e.token) for e in entries]
    every = [*scored, *entries]
    return {
        "tokens": tokens,
        "token_logprobs": [None if e is None else _logprob(e.logprob) for e in every],
        "top_logprobs": [None if e is None else {text_of(i): _logprob(v) for i, v in e.top} for e in every],
        "text_offset": list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=offset)) if tokens else [],
    }


@dataclass(frozen=True)
class Echo:
    """A completion's prompt, echoed before its text: the prompt's text, its ids and (asked) their
    log-probabilities (but the first's)."""

    text: str
    ids: Sequence[int]
    logprobs: Sequence[TokenLogprob] = ()


def reply_logprobs(
    entries: Sequence[TokenLogprob] | None, text_of: TokenText, chat: bool, offset: int = 0, echo: Echo | None = None
) -> Any:
    """A choice's `logprobs` for `entries` (None where the request asked for none)."""
    if entries is None:
        return None
    return _chat_logprobs(entries, text_of) if chat else _completion_logprobs(entries, text_of, offset, echo)


def completion(
    request_id: str,
    model: str,
    choices: Sequence[Done],
    chat: bool,
    text_of: TokenText,
    prompt_tokens: int,
    echoes: Sequence[Echo] | None = None,
    tools: ToolRequest | None = None,
) -> dict[str, Any]:
    """The whole reply of a non-streaming request: its choices, indexed in order (`echoes`: each one's
    prompt, echoed before it; `tools`: a chat's tool calls read from each)."""
    made = []
    for index, done in enumerate(choices):
        choice: dict[str, Any] = {"index": index, "finish_reason": done.finish_reason, "token_ids": done.token_ids}
        echo = echoes[index] if echoes else None
        if echo is not None and done.prompt_logprobs is not None:
            echo = replace(echo, logprobs=done.prompt_logprobs)
        if chat:
            content, calls = tools.calls(done.text) if tools else (done.text, [])
            choice["message"] = {"role": "assistant", "content": content}
            if calls:
                choice["message"]["tool_calls"] = calls
                choice["finish_reason"] = "tool_calls" if done.finish_reason == "stop" else done.finish_reason
        else:
            choice["text"] = (echo.text if echo else "") + done.text
        choice["logprobs"] = reply_logprobs(done.logprobs, text_of, chat, echo=echo)
        made.append(choice)
    kind = "chat.completion" if chat else "text_completion"
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": model, "choices": made,
            "usage": usage(prompt_tokens, choices)}  # fmt: skip


def chunk(request_id: str, model: str, chat: bool, text: str | None = None, done: Done | None = None,
          first: bool = False, logprobs: Any = None, index: int = 0, tool_calls: list[dict[str, Any]] | None = None,
          finish_reason: str | None = None) -> dict[str, Any]:  # fmt: skip
    """One server-sent event of a streaming reply's choice `index`: a piece of text (and its tokens'
    `logprobs`, made by `reply_logprobs`), tool calls, or its end (finish reason: `done`'s, or as given)."""
    choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason or (done.finish_reason if done else None)}
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    choice["logprobs"] = logprobs
    kind = "chat.completion.chunk" if chat else "text_completion"
    event = {"id": request_id, "object": kind, "created": int(time.time()), "model": model, "choices": [choice]}
    return event


def usage_chunk(request_id: str, model: str, chat: bool, used: dict[str, int]) -> dict[str, Any]:
    """The last event of a stream whose request asked for its usage: no choices, the usage."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": model, "choices": [],
            "usage": used}  # fmt: skip
