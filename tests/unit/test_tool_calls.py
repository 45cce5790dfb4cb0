"""Tool calls read back from each family's format (vLLM's parser names), the choice's checks, the JSON
schema a required or named choice is forced with, and a streamed reply's content held back where a call
may begin."""

from __future__ import annotations

import json

import pytest

from quiver.serve.tools import ToolError, ToolStream, parser_for, template_messages, tool_request

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def _calls(parser: str, text: str) -> tuple[str | None, list[tuple[str, dict]]]:
    request = tool_request({"tools": [WEATHER, TIME]}, parser)
    assert request is not None
    content, calls = request.calls(text)
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize(
    ("parser", "text", "content"),
    [
        ("hermes", 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
                   '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "Let me check."),
        ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                        '{"name": "get_time", "parameters": {}}', None),
        ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                    '{"name": "get_time", "arguments": "{}"}]', None),
        ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", '
                    '"arguments": {}}]', None),
    ],
)  # fmt: skip
def test_each_familys_calls_are_read_back(parser: str, text: str, content: str | None) -> None:
    assert _calls(parser, text) == (content, [("get_weather", {"city": "Oslo"}), ("get_time", {})])


def test_text_without_calls_or_with_calls_that_do_not_parse_is_text() -> None:
    assert _calls("hermes", "It is sunny.") == ("It is sunny.", [])
    assert _calls("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": ') == (
        '<tool_call>{"name": "get_weather", "arguments": {"city": ', [])  # fmt: skip
    assert _calls("hermes", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>')[1] == []  # an unknown tool
    assert _calls("llama3_json", "{not json")[1] == []


def test_the_parser_is_read_from_the_template_and_auto_needs_one() -> None:
    assert parser_for("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert parser_for("[TOOL_CALLS]") == "mistral" and parser_for("plain") is None
    assert parser_for("<tool_call>", "llama3_json") == "llama3_json" and parser_for("<tool_call>", "none") is None
    with pytest.raises(ToolError, match="--tool-call-parser") as refused:
        tool_request({"tools": [WEATHER]}, None)
    assert refused.value.param == "tool_choice"
    assert tool_request({"tools": [WEATHER], "tool_choice": "none"}, None) is not None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
        ({"tools": "x"}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_bad_tools_are_refused_naming_the_field(body: dict, param: str) -> None:
    with pytest.raises(ToolError) as refused:
        tool_request(body, "hermes")
    assert refused.value.param == param


def test_a_required_or_named_choice_is_a_schema_and_its_reply_the_calls() -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    named = tool_request({"tools": [WEATHER, TIME], "tool_choice": choice}, None)
    assert named is not None and named.grammar_schema() == WEATHER["function"]["parameters"]
    content, calls = named.calls('{"city": "Oslo"}')
    assert content is None and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    required = tool_request({"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False}, None)
    assert required is not None
    schema = required.grammar_schema()
    assert schema is not None and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]] == ["get_weather", "get_time"]
    content, calls = required.calls('[{"name": "get_time", "parameters": {}}]')
    assert content is None and calls[0]["function"] == {"name": "get_time", "arguments": "{}"}


def test_a_streamed_reply_holds_back_where_a_call_may_begin() -> None:
    request = tool_request({"tools": [WEATHER]}, "hermes")
    assert request is not None
    stream = ToolStream(request)
    pieces = [stream.feed(p) for p in ("Sure", ", <tool", "_call>", '{"name": "get_weather", "arguments": ',
                                       '{"city": "Oslo"}}', "</tool_call>")]  # fmt: skip
    assert pieces == ["Sure", ", ", "", "", "", ""]
    held, calls = stream.end()
    assert held == "" and calls[0]["index"] == 0 and calls[0]["function"]["name"] == "get_weather"
    text = ToolStream(request)
    assert [text.feed(p) for p in ("a <to", "y> b")] == ["a ", "<toy> b"] and text.end() == ("", [])


def test_template_messages_give_the_calls_arguments_as_objects() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    shown = template_messages([{"role": "assistant", "content": "", "tool_calls": [call]}])
    assert shown[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
