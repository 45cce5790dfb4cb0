"""Makes the chat-template corpus: real models' chat templates, each rendered by transformers for a few
conversations, as the ground truth of `quiver serve`'s renderer (no model hub).

    python tests/real/make_templates.py OUT_DIR

The templates are the ones llama.cpp keeps of real models (`models/templates/*.jinja`: Llama 3.x, Qwen
2.5/3/3.5, Gemma 2/4, Mistral, Phi-3.5, Granite, SmolLM3, DeepSeek, gpt-oss, GLM, Kimi, ...), taken from
the `llama-cpp-python` sdist that vendors llama.cpp (fetched with pip). Needs transformers (see
`ci/real-models.txt`). Writes `templates/*.jinja` and `expected.json`: the conversations (messages,
`add_generation_prompt`, the template's other names), and per template and conversation the text
transformers' `render_jinja_template` (what `apply_chat_template(tokenize=False)` renders) gives, or the
error it raises. `strftime_now` sees the fixed date `DATE`.
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from transformers.utils import chat_template_utils

SDIST = "llama-cpp-python==0.3.36"
DATE = datetime.datetime(2026, 1, 15, 9, 30)
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city's name."}},
                "required": ["city"],
            },
        },
    }
]
CALL = {"id": "abc123xyz", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "What is 2+2? Réponds en français."},
]
# name -> (messages, add_generation_prompt, more names for the template)
CASES: dict[str, tuple[list[dict[str, Any]], bool, dict[str, Any]]] = {
    "one_question": ([{"role": "user", "content": "Hello, who are you?"}], True, {}),
    "system_and_turns": (CHAT, True, {}),
    "no_generation_prompt": (CHAT, False, {}),
    "thinking_off": ([{"role": "user", "content": "Hello"}], True, {"enable_thinking": False}),
    "tools": ([{"role": "user", "content": "Weather in Paris?"}], True, {"tools": TOOLS}),
    "tool_round": (
        [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "abc123xyz", "name": "get_weather", "content": '{"temp": 21}'},
        ],
        True,
        {"tools": TOOLS},
    ),
}


class _FixedDate(datetime.datetime):
    @classmethod
    def now(cls, tz: Any = None) -> _FixedDate:  # noqa: ARG003
        return cls(DATE.year, DATE.month, DATE.day, DATE.hour, DATE.minute)


def _templates(out: Path) -> list[Path]:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", tmp,
                        SDIST], check=True)  # fmt: skip
        archive = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                if member.isfile() and "/models/templates/" in member.name and member.name.endswith(".jinja"):
                    source = tar.extractfile(member)
                    assert source is not None
                    (out / Path(member.name).name).write_bytes(source.read())
    return sorted(out.glob("*.jinja"))


def _render(template: str, messages: list[dict[str, Any]], prompt: bool, names: dict[str, Any]) -> dict[str, str]:
    names = dict(names)
    tools = names.pop("tools", None)
    try:
        text = chat_template_utils.render_jinja_template(
            conversations=[messages], tools=tools, chat_template=template, add_generation_prompt=prompt,
            **SPECIAL, **names,
        )[0]  # fmt: skip
    except Exception as exc:  # noqa: BLE001  a template that refuses a conversation: the refusal is the truth
        return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    return {"text": text[0] if isinstance(text, list) else text}


def main() -> None:
    out = Path(sys.argv[1])
    folder = out / "templates"
    folder.mkdir(parents=True, exist_ok=True)
    chat_template_utils.datetime = _FixedDate  # type: ignore[misc]  what strftime_now reads
    conversations = {name: {"messages": messages, "add_generation_prompt": prompt, "variables": names}
                     for name, (messages, prompt, names) in CASES.items()}  # fmt: skip
    expected: dict[str, Any] = {"date": DATE.isoformat(), "special": SPECIAL, "conversations": conversations,
                                "cases": {}}  # fmt: skip
    for path in _templates(folder):
        source = path.read_text()
        rendered = {name: _render(source, *case) for name, case in CASES.items()}
        expected["cases"][path.name] = rendered
    (out / "expected.json").write_text(json.dumps(expected, ensure_ascii=False, indent=1))
    import transformers

    (out / "versions.json").write_text(json.dumps({"transformers": transformers.__version__, "sdist": SDIST}))


if __name__ == "__main__":
    main()
