"""Chat templates render as transformers renders them: loop controls, `{% generation %}`, `strftime_now`,
its `tojson` (non-ASCII kept), `raise_exception`; a template that does not compile is one line."""

from __future__ import annotations

from datetime import datetime

import pytest

from quiver.errors import ModelFolderError
from quiver.serve.chat import ChatTemplate

MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "héllo"},
    {"role": "assistant", "content": "hi"},
    {"role": "user", "content": "bye"},
    {"role": "user", "content": "never rendered"},
]


def test_loop_controls_the_generation_block_and_transformers_tojson() -> None:
    source = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
        "{% if loop.index > 4 %}{% break %}{% endif %}"
        "{% if m['role'] == 'assistant' %}{% generation %}<a>{{ m['content'] }}</a>{% endgeneration %}"
        "{% else %}<u>{{ m['content'] | tojson }}</u>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<a>{% endif %}"
    )
    template = ChatTemplate(source, {}, "test")
    assert template.render(MESSAGES) == '<u>"héllo"</u><a>hi</a><u>"bye"</u><a>'
    assert template.render(MESSAGES, add_generation_prompt=False) == '<u>"héllo"</u><a>hi</a><u>"bye"</u>'
    indented = ChatTemplate("{{ messages[0] | tojson(indent=2) }}", {}, "test").render(MESSAGES[:1])
    assert indented == '{\n  "role": "system",\n  "content": "be brief"\n}'


def test_strftime_now_is_todays_date_and_raise_exception_refuses() -> None:
    year = ChatTemplate("{{ strftime_now('%Y') }}", {}, "test").render(MESSAGES)
    assert year in {str(datetime.now().year), str(datetime.now().year - 1)}  # a render across new year's eve
    refusing = ChatTemplate("{{ raise_exception('roles must alternate') }}", {}, "test")
    with pytest.raises(ValueError, match="roles must alternate"):
        refusing.render(MESSAGES)


def test_a_template_that_does_not_compile_is_one_line() -> None:
    with pytest.raises(ModelFolderError, match="does not compile"):
        ChatTemplate("{% for m in messages %}", {}, "test")


def test_continue_final_message_cuts_after_its_text_and_names_reach_the_template() -> None:
    source = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}{% if think %}<think>{% endif %}"
    )
    template = ChatTemplate(source, {}, "test")
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon "}]
    assert (
        template.render(chat, add_generation_prompt=False, continue_final_message=True)
        == "<user>hi</s><assistant>Once upon "
    )
    assert template.render(chat[:1], variables={"think": True}) == "<user>hi</s><think>"
    with pytest.raises(ValueError, match="cannot both be set"):
        template.render(chat, continue_final_message=True)
    trimmed = ChatTemplate("{% for m in messages %}[{{ m['content'] | trim }}]{% endfor %}", {}, "test")
    assert trimmed.render(chat, add_generation_prompt=False, continue_final_message=True) == "[hi][Once upon"
