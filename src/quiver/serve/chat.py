"""Chat templates: the model's own Jinja template (from `tokenizer_config.json` or `chat_template.jinja`),
rendered in a sandbox as transformers renders it: loop controls (`{% break %}`, `{% continue %}`), the
`{% generation %}` block (its body rendered as it is: it marks the assistant's tokens for training),
`raise_exception`, `strftime_now`, and a `tojson` that keeps non-ASCII text (transformers' own)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from quiver.errors import ModelFolderError
from quiver.formats.files import read_text

TEMPLATE_FILE, TOKENIZER_CONFIG = "chat_template.jinja", "tokenizer_config.json"


class ChatTemplate:
    """A compiled chat template and the special tokens it may name."""

    def __init__(self, source: str, special: dict[str, str], origin: str) -> None:
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_generation_block(), loopcontrols]
        )
        environment.globals["raise_exception"] = raise_exception
        environment.globals["strftime_now"] = _strftime_now
        environment.filters["tojson"] = _tojson
        try:
            self._template = environment.from_string(source)
        except TemplateError as exc:
            raise ModelFolderError(f"the chat template of {origin} does not compile: {exc}") from None
        self._special = special
        self.origin = origin
        self.source = source  # what it says (a tool-call format is read from it)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for `messages`, ending where the assistant's reply begins (unless not
        `add_generation_prompt`), or, with `continue_final_message`, right after the last message's text
        (the reply continues it: transformers' cut). `variables`: more names for the template (a request's
        `chat_template_kwargs`, e.g. `enable_thinking`). Raises ValueError with the template's own message
        when it refuses the conversation (roles out of order...)."""
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be set")
        # as transformers: `tools` and `documents` always named (None unless given), reasoning under its names
        names = {"tools": None, "documents": None, **(variables or {}), **self._special}
        messages = [_reasoning_aliased(m) for m in messages]
        try:
            text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **names)
        except Exception as exc:  # noqa: BLE001  a template is code: whatever it raises, it refused these messages
            raise ValueError(f"the chat template refused the messages: {type(exc).__name__}: {exc}"[:500]) from None
        if not continue_final_message:
            return text
        final = messages[-1]["content"]
        at = text.rfind(final.strip())
        if not final.strip() or at < 0:
            raise ValueError("continue_final_message: the last message's text does not appear in the rendered chat")
        kept = len(final.lstrip()) if text[at : at + len(final.lstrip())] == final.lstrip() else len(final.strip())
        return text[: at + kept]


_REASONING = ("reasoning_content", "thinking", "reasoning")  # a message's reasoning, by the names templates read


def _reasoning_aliased(message: Mapping[str, Any]) -> Mapping[str, Any]:
    """The message with its reasoning (under any of `_REASONING`'s names) as `thinking` and
    `reasoning_content` too (transformers' `_alias_reasoning_fields`: gpt-oss reads `thinking`)."""
    reasoning = next((message[k] for k in _REASONING if message.get(k) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(str(format))


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _generation_block() -> type:
    """transformers' `{% generation %}...{% endgeneration %}` tag, its body rendered as it is."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationBlock(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            line = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(line)

        def _body(self, caller: Any) -> str:
            return str(caller())

    return GenerationBlock


def find_chat_template(folder: Path, explicit: Path | None = None) -> ChatTemplate | None:
    """The template beside a dialog config (or `explicit`): `chat_template.jinja`, else the
    `chat_template` of `tokenizer_config.json`; None when the model has none (chat is then refused)."""
    config: dict[str, Any] = {}
    if (folder / TOKENIZER_CONFIG).is_file():
        try:
            loaded = json.loads(read_text(folder / TOKENIZER_CONFIG, limit=16 << 20, what=TOKENIZER_CONFIG))
        except (ValueError, RecursionError) as exc:
            raise ModelFolderError(f"{folder / TOKENIZER_CONFIG} is not JSON ({exc})") from None
        config = loaded if isinstance(loaded, dict) else {}
    # the special tokens by name (transformers' special_tokens_map): a string, or an added token's content
    special = {key: text for key, value in config.items() if key.endswith("_token") and (text := _token_text(value))}
    for path in (explicit, folder / TEMPLATE_FILE):
        if path is not None and path.is_file():
            return ChatTemplate(read_text(path, limit=1 << 20, what="chat template"), special, str(path))
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)  # fmt: skip
    if isinstance(template, str):
        return ChatTemplate(template, special, str(folder / TOKENIZER_CONFIG))
    return None


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # an AddedToken as tokenizer_config.json writes it
        value = value.get("content")
    return value if isinstance(value, str) else None
