"""Real models' chat templates (tests/real/make_templates.py: the ones llama.cpp keeps, 70 of them) render
as transformers renders them: the same text for each conversation (so the same tokens), or a refusal
where transformers' rendering raised."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from quiver.serve import chat


@pytest.fixture(scope="module")
def expected(real_templates: Path) -> dict[str, Any]:
    return dict(json.loads((real_templates / "expected.json").read_text()))


def _names(real_templates: Path) -> list[str]:
    return sorted(p.name for p in (real_templates / "templates").glob("*.jinja"))


def test_every_real_template_renders_as_transformers_does(
    real_templates: Path, expected: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    fixed = datetime.fromisoformat(expected["date"])

    class _FixedDate(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> datetime:  # noqa: ARG003
            return fixed

    monkeypatch.setattr(chat, "datetime", _FixedDate)  # what strftime_now reads, as when transformers rendered
    names = _names(real_templates)
    assert len(names) >= 60 and set(names) == set(expected["cases"]) and len(expected["conversations"]) >= 6
    differ: list[str] = []
    for name in names:
        template = chat.ChatTemplate((real_templates / "templates" / name).read_text(), expected["special"], name)
        for case, conversation in expected["conversations"].items():  # as transformers was given them
            want = expected["cases"][name][case]
            try:
                got = template.render(conversation["messages"], add_generation_prompt=conversation[
                    "add_generation_prompt"], variables=conversation["variables"])  # fmt: skip
            except ValueError:
                got = None
            if "error" in want:
                if got is not None:
                    differ.append(f"{name} {case}: transformers refused ({want['error'][:80]}), Quiver rendered")
            elif got != want["text"]:
                differ.append(f"{name} {case}: {got!r:.120} != {want['text']!r:.120}")
    assert not differ, f"{len(differ)} renderings differ:\n" + "\n".join(differ[:20])
