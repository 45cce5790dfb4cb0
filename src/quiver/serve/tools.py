"""Tool calling: a chat request's `tools` and `tool_choice`, the tools handed to the chat template, and the
calls read back from the reply into OpenAI's `tool_calls`.

`tool_choice` "required" or a named function is forced through structured decoding (`serve.grammar`):
the reply is JSON made for it (the named function's arguments; for "required" a list of
{name, parameters}), as vLLM does, whatever the model's own format. "auto" lets the model choose: its
reply is read with the parser of its family's format (vLLM's names): `hermes` (Qwen 2.5/3, Hermes:
`<tool_call>{json}</tool_call>`), `llama3_json` (Llama 3.1+: a JSON object, after `<|python_tag|>` or
alone), `mistral` (`[TOOL_CALLS]` and a JSON list), `granite` (`<|tool_call|>` and a JSON list);
`auto` (the default) picks it from the chat template's text. A reply with no call, or one that does not
parse, is text. "none": the template sees the tools, the reply is text.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

PARSERS = ("hermes", "llama3_json", "mistral", "granite")
MAX_TOOLS = 128
# the text each family's template holds when it writes tool calls that way (the first match wins)
_SIGNS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<|tool_call|>", "granite"),
          ("<|python_tag|>", "llama3_json"), ('"parameters": dictionary of argument name', "llama3_json"))  # fmt: skip


class ToolError(ValueError):
    """A request's tools or tool_choice that cannot be honoured (the message says which field and why)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def parser_for(template_source: str | None, asked: str = "auto") -> str | None:
    """The parser of a model's tool calls: `asked`, or with "auto" the one its chat template's text shows."""
    if asked != "auto":
        return None if asked == "none" else asked
    return next((name for sign, name in _SIGNS if template_source and sign in template_source), None)


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools (OpenAI's form), what it asks of them, and the parser its reply is read with."""

    tools: list[dict[str, Any]]
    choice: str  # "auto", "none", "required" or "named"
    name: str | None  # the named function
    parallel: bool
    parser: str | None

    def grammar_schema(self) -> dict[str, Any] | None:
        """The JSON schema forcing the reply where the choice is required or named, else None."""
        if self.choice == "named":
            return self._parameters(self.name)
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                   "parameters": self._parameters(t["function"]["name"])},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]  # fmt: skip
        item = {"anyOf": calls} if len(calls) > 1 else calls[0]
        return {"type": "array", "items": item, "minItems": 1, **({} if self.parallel else {"maxItems": 1})}

    def _parameters(self, name: str | None) -> dict[str, Any]:
        function = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        schema = function.get("parameters")
        return schema if isinstance(schema, dict) else {"type": "object"}

    def calls(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The reply's text (None when it is all calls) and its tool calls, OpenAI's form."""
        if self.choice == "none" or not self.tools:
            return text, []
        if self.choice == "named":
            return None, [_call(self.name or "", text.strip())]
        if self.choice == "required":
            try:
                found = [(c["name"], c.get("parameters", {})) for c in json.loads(text)]
            except (ValueError, TypeError, KeyError):
                return text, []  # cut short by max_tokens: not a call
            return None, [_call(name, json.dumps(arguments, ensure_ascii=False)) for name, arguments in found]
        read = _READERS.get(self.parser or "")
        if read is None:
            return text, []
        content, found = read(text)
        known = {t["function"]["name"] for t in self.tools}
        if not found or any(name not in known for name, _ in found):
            return text, []
        calls = [_call(name, json.dumps(arguments, ensure_ascii=False)) for name, arguments in found]
        return (content or None), calls

    def start(self) -> str | None:
        """The text a streamed reply's calls begin with (what is held back from the content), None: no calls
        in text (the choice forces them, or forbids them)."""
        if self.choice in ("named", "required"):
            return ""  # the whole reply is the call
        if self.choice == "none" or self.parser is None:
            return None
        return {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "granite": "<|tool_call|>",
                "llama3_json": "{"}[self.parser]  # fmt: skip


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name,
            "arguments": arguments}}  # fmt: skip


def tool_request(body: Mapping[str, Any], parser: str | None) -> ToolRequest | None:
    """A chat body's `tools`, `tool_choice` and `parallel_tool_calls`, checked; None without tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool) and parallel is not None:
        raise ToolError("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ToolError("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ToolError(f"'tools' must be a list of up to {MAX_TOOLS} functions", "tools")
    names = []
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if (
            not isinstance(function, dict)
            or not isinstance(name, str)
            or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name)
        ):
            raise ToolError(f"tools[{index}] must be {{type: function, function: {{name, parameters}}}} with a "
                            "name of letters, digits, _ . - (up to 64)", "tools")  # fmt: skip
        if not isinstance(function.get("parameters", {}), dict):
            raise ToolError(f"tools[{index}].function.parameters must be a JSON schema object", "tools")
        names.append(name)
    if len(set(names)) != len(names):
        raise ToolError("two tools have the same name", "tools")
    named = None
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        named = function.get("name") if isinstance(function, dict) else None
        if named not in names:
            raise ToolError("'tool_choice' names no function of 'tools'", "tool_choice")
        kind = "named"
    elif choice in (None, "auto", "none", "required"):
        kind = choice or "auto"
    else:
        raise ToolError("'tool_choice' must be none, auto, required or {type: function, function: {name}}",
                        "tool_choice")  # fmt: skip
    if kind == "auto" and parser is None:
        raise ToolError("this model's tool-call format is unknown (its chat template shows none): ask with "
                        "tool_choice required or a named function, or start the server with --tool-call-parser",
                        "tool_choice")  # fmt: skip
    return ToolRequest([dict(t) for t in tools], kind, named, parallel is not False, parser)


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates read them: an assistant's tool calls with their arguments as objects
    (transformers' convention; OpenAI sends JSON text)."""
    out = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                function = dict(call["function"])
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except (ValueError, TypeError):
                    pass  # not JSON: the template gets the text
                calls.append({**call, "function": function})
            message["tool_calls"] = calls
        out.append(message)
    return out


def _hermes(text: str) -> tuple[str, list[tuple[str, Any]]]:
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    found = []
    for body in re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text[start:], re.DOTALL):
        call = _object(body.strip())
        if call is None:
            return text, []
        found.append(call)
    return text[:start], found


def _listed(marker: str) -> Callable[[str], tuple[str, list[tuple[str, Any]]]]:
    """A family whose calls follow `marker` as one JSON list (Mistral's, Granite's)."""

    def read(text: str) -> tuple[str, list[tuple[str, Any]]]:
        start = text.find(marker)
        if start < 0:
            return text, []
        try:
            listed = json.loads(text[start + len(marker) :].strip())
        except ValueError:
            return text, []
        calls = [_named(c) for c in (listed if isinstance(listed, list) else [listed])]
        return (text[:start], [c for c in calls if c is not None]) if all(calls) else (text, [])

    return read


def _llama3(text: str) -> tuple[str, list[tuple[str, Any]]]:
    body = text.removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    found, decoder, at = [], json.JSONDecoder(), 0
    while at < len(body):
        try:
            value, end = decoder.raw_decode(body, at)
        except ValueError:
            return text, []
        call = _named(value)
        if call is None:
            return text, []
        found.append(call)
        at = end
        while at < len(body) and body[at] in " \n;":  # several calls: `; ` between them
            at += 1
    return "", found


def _object(text: str) -> tuple[str, Any] | None:
    try:
        return _named(json.loads(text))
    except ValueError:
        return None


def _named(value: Any) -> tuple[str, Any] | None:
    """{name, arguments} (or Llama's {name, parameters}) as (name, arguments)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return value["name"], arguments


_READERS: dict[str, Callable[[str], tuple[str, list[tuple[str, Any]]]]] = {
    "hermes": _hermes, "llama3_json": _llama3, "mistral": _listed("[TOOL_CALLS]"), "granite": _listed("<|tool_call|>"),
}  # fmt: skip


class ToolStream:
    """A streamed choice's text as it may go out: content up to where its calls begin (a possible beginning
    held back), then, at the end, its calls, or the held text as content where none parse."""

    def __init__(self, request: ToolRequest) -> None:
        self._request = request
        self._start = request.start()
        self._text = ""
        self._sent = 0  # characters of the text sent as content
        self._calling = self._start == ""

    def feed(self, piece: str) -> str:
        """The content `piece` lets go out now."""
        self._text += piece
        if self._start is None:  # no call can come: all of it is content
            return piece
        if self._calling:
            return ""
        at = self._text.find(self._start, self._sent)
        if at >= 0:
            self._calling = True
            end = at
        else:  # hold back an end that may begin the calls' start
            held = next((k for k in range(len(self._start) - 1, 0, -1) if self._text.endswith(self._start[:k])), 0)
            end = len(self._text) - held
        out, self._sent = self._text[self._sent : end], end
        return out

    def end(self) -> tuple[str, list[dict[str, Any]]]:
        """The content still held and the calls (OpenAI's form, with their `index`), once the reply is whole."""
        if self._start is None:
            return "", []
        _, calls = self._request.calls(self._text)
        if not calls:
            return self._text[self._sent :], []
        return "", [{"index": i, **call} for i, call in enumerate(calls)]
