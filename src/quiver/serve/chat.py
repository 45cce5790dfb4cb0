"""Chat templates: the model's own Jinja template (from `tokenizer_config.json` or `chat_template.jinja`),
rendered in a sandbox as transformers renders it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from quiver.errors import ModelFolderError
from quiver.formats.files import read_text

TEMPLATE_FILE, TOKENIZER_CONFIG = "chat_template.jinja", "tokenizer_config.json"


class ChatTemplate:
    """A compiled chat template and the special tokens it may name."""

    def __init__(self, source: str, special: dict[str, str], origin: str) -> None:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = raise_exception
        try:
            self._template = environment.from_string(source)
        except TemplateError as exc:
            raise ModelFolderError(f"the chat template of {origin} does not compile: {exc}") from None
        self._special = special
        self.origin = origin

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages`, ending where the assistant's reply begins (unless not
        `add_generation_prompt`). Raises ValueError with the template's own message when it refuses the
        conversation (roles out of order...)."""
        from jinja2 import TemplateError

        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self._special
            )
        except TemplateError as exc:
            raise ValueError(f"the chat template refused the messages: {exc}") from None


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
    special = {k: v for k in ("bos_token", "eos_token") if isinstance(v := config.get(k), str)}
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
