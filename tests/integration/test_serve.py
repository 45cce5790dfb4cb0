"""`quiver serve` as its users drive it: the official `openai` client and plain HTTP, on 127.0.0.1."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest

from quiver.serve.prefix_cache import BLOCK
from quiver.t2t.batch import BatchDecoder
from quiver.t2t.export import ExportOptions, export
from tests.support.serving import KEY, MALLOC_ON_HUGE_PAGES, Running, http, start_server, stop_server, t2t_greedy
from tests.support.tiny_llm import forward, tiny_adapter, tiny_decoder

PROMPT = "the quick brown fox"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for d in documents or [] %}<|document|>{{ d['title'] }}: {{ d['text'] }}\n{% endfor %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("serve")
    weights = tiny_decoder(root / "model", "LlamaForCausalLM")
    config = json.loads((root / "model" / "tokenizer_config.json").read_text()) if (
        root / "model" / "tokenizer_config.json").is_file() else {}  # fmt: skip
    config |= {"chat_template": CHAT_TEMPLATE, "bos_token": "<s>", "eos_token": "</s>"}
    (root / "model" / "tokenizer_config.json").write_text(json.dumps(config))
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    tiny_adapter(root / "all", weights, 4, targets, seed=1)
    tiny_adapter(root / "qv", weights, 2, ["q_proj", "v_proj"], seed=2)
    adapters = {"all": root / "all", "qv": root / "qv"}
    return export(root / "model", root / "out", adapters, options=ExportOptions(context_size=64)).path


@pytest.fixture(scope="module")
def server(exported: Path) -> Iterator[Running]:
    running = start_server(exported, "--api-key", KEY)
    yield running
    stop_server(running)


def _t2t_greedy(config: Path, *args: str, tokens: int = 8) -> list[int]:
    return t2t_greedy(config, PROMPT, *args, tokens=tokens)


# --- the API the openai client speaks --------------------------------------------------------------------------
def test_the_models_are_the_base_and_every_adapter(server: Running) -> None:
    ids = [m.id for m in server.client().models.list().data]
    assert ids == ["out", "all", "qv"]


@pytest.mark.parametrize("adapter", [None, "all", "qv"])
def test_greedy_completions_are_the_tokens_t2t_run_gives(server: Running, adapter: str | None) -> None:
    expected = _t2t_greedy(server.config, *(["-l", adapter] if adapter else []))
    model = adapter or "out"
    reply = server.client().completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    choice = reply.choices[0]
    assert choice.model_extra is not None and choice.model_extra["token_ids"] == expected
    assert reply.usage is not None and reply.usage.completion_tokens == len(expected)
    streamed = server.client().completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == choice.text


def test_a_request_sets_the_strengths_of_its_adapter(server: Running) -> None:
    client = server.client()
    base = client.completions.create(model="out", prompt=PROMPT, max_tokens=8, temperature=0)
    off = client.completions.create(model="all", prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body={"lora": {"all": 0.0}})  # fmt: skip
    on = client.completions.create(model="all", prompt=PROMPT, max_tokens=8, temperature=0)
    assert off.choices[0].model_extra["token_ids"] == base.choices[0].model_extra["token_ids"]  # type: ignore[index]
    assert on.choices[0].model_extra["token_ids"] == _t2t_greedy(server.config, "-l", "all")  # type: ignore[index]


def test_chat_renders_the_models_template_and_streams_the_same_reply(server: Running) -> None:
    client = server.client()
    messages: Any = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPT}]
    whole = client.chat.completions.create(model="qv", messages=messages, max_tokens=6, temperature=0)
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].finish_reason in ("stop", "length")
    pieces = list(client.chat.completions.create(model="qv", messages=messages, max_tokens=6, temperature=0,
                                                 stream=True))  # fmt: skip
    assert pieces[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in pieces) == whole.choices[0].message.content
    assert pieces[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_min_tokens_keeps_the_end_of_sequence_out(server: Running) -> None:
    reply = server.client().completions.create(model="out", prompt=PROMPT, max_tokens=30, temperature=0,
                                               extra_body={"min_tokens": 30})  # fmt: skip
    assert reply.usage is not None and reply.usage.completion_tokens == 30
    assert reply.choices[0].finish_reason == "length"


def test_sampling_with_a_seed_repeats(server: Running) -> None:
    client = server.client()
    runs = [client.completions.create(model="out", prompt=PROMPT, max_tokens=8, temperature=0.9, seed=5)
            for _ in range(2)]  # fmt: skip
    assert runs[0].choices[0].text == runs[1].choices[0].text


# --- bad requests: OpenAI's status codes and error objects, the server serving on ---------------------------------
def test_without_the_key_only_health_answers(server: Running) -> None:
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong").models.list()
    status, _, body = http(f"{server.url}/v1/models", key=None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert http(f"{server.url}/health", key=None)[0] == 200


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        (json.dumps({"model": "out", "prompt": PROMPT, "max_tokens": "x"}).encode(), 400, "max_tokens"),
        (json.dumps({"model": "out", "prompt": PROMPT, "max_tokens": 10_000}).encode(), 400, "max_tokens"),
        (json.dumps({"model": "nope", "prompt": PROMPT}).encode(), 404, "model"),
        (json.dumps({"prompt": PROMPT}).encode(), 400, "model"),
        (json.dumps({"model": "out", "prompt": PROMPT, "n": 17}).encode(), 400, "n"),
        (json.dumps({"model": "out", "prompt": PROMPT, "n": 2, "best_of": 1}).encode(), 400, "best_of"),
        (json.dumps({"model": "out", "prompt": PROMPT, "best_of": 2, "stream": True}).encode(), 400, "best_of"),
        (json.dumps({"model": "out", "prompt": [PROMPT] * 9, "n": 2}).encode(), 400, "n"),
        (json.dumps({"model": "out", "prompt": PROMPT, "temperature": -1}).encode(), 400, "temperature"),
        (json.dumps({"model": "out", "prompt": PROMPT, "stop": ["a"] * 5}).encode(), 400, "stop"),
        (json.dumps({"model": "out", "prompt": PROMPT, "logprobs": 21}).encode(), 400, "logprobs"),
        (json.dumps({"model": "out", "prompt": ""}).encode(), 400, "prompt"),
        (json.dumps({"model": "out", "prompt": [10**9]}).encode(), 400, "prompt"),
        (json.dumps({"model": "all", "prompt": PROMPT, "lora": {"all": "x"}}).encode(), 400, "lora"),
        (json.dumps({"model": "out", "prompt": PROMPT * 100}).encode(), 400, "prompt"),
        (json.dumps({"model": "out", "prompt": PROMPT, "stream": "yes"}).encode(), 400, "stream"),
        (json.dumps({"model": "out", "prompt": PROMPT, "max_tokens": 4, "min_tokens": 5}).encode(), 400, "min_tokens"),
        # fields not implemented are refused by name at any value but their neutral one; unknown ones always
        (json.dumps({"model": "out", "prompt": PROMPT, "presence_penalty": 2.5}).encode(), 400, "presence_penalty"),
        (json.dumps({"model": "out", "prompt": PROMPT, "top_k": -2}).encode(), 400, "top_k"),
        (json.dumps({"model": "out", "prompt": PROMPT, "min_p": 1.5}).encode(), 400, "min_p"),
        (json.dumps({"model": "out", "prompt": PROMPT, "logit_bias": {"999999": 10}}).encode(), 400, "logit_bias"),
        (json.dumps({"model": "out", "prompt": PROMPT, "logit_bias": {"5": 101}}).encode(), 400, "logit_bias"),
        (
            json.dumps({"model": "out", "prompt": PROMPT, "response_format": {"type": "xml"}}).encode(),
            400,
            "response_format",
        ),
        (json.dumps({"model": "out", "prompt": PROMPT, "guided_regex": "[a-z"}).encode(), 400, "guided_regex"),
        (json.dumps({"model": "out", "prompt": PROMPT, "guided_choice": ["x"] * 1025}).encode(), 400, "guided_choice"),
        (json.dumps({"model": "out", "prompt": PROMPT, "grammar": "root ::= ("}).encode(), 400, "grammar"),
        (
            json.dumps({"model": "out", "prompt": PROMPT, "json_schema": {"type": "strnig"}}).encode(),
            400,
            "json_schema",
        ),
        (
            json.dumps({"model": "out", "prompt": PROMPT, "guided_regex": "a", "guided_choice": ["a"]}).encode(),
            400,
            "guided_choice",
        ),
        (json.dumps({"model": "out", "prompt": PROMPT, "stop_token_ids": [-1]}).encode(), 400, "stop_token_ids"),
        (json.dumps({"model": "out", "prompt": PROMPT, "best_of": 17}).encode(), 400, "best_of"),
        (json.dumps({"model": "out", "prompt": PROMPT, "temprature": 0}).encode(), 400, "temprature"),
        (json.dumps({"model": "out", "prompt": PROMPT, "messages": []}).encode(), 400, "messages"),
        (
            json.dumps({"model": "out", "prompt": PROMPT, "stream_options": {"include_usage": True}}).encode(),
            400,
            "stream_options",
        ),
    ],
)
def test_bad_requests_get_openais_error_object(server: Running, body: bytes, status: int, param: str | None) -> None:
    got, _, reply = http(f"{server.url}/v1/completions", "POST", body)
    assert got == status and set(reply["error"]) == {"message", "type", "param", "code"}, reply
    assert reply["error"]["param"] == param
    assert server.client().completions.create(model="out", prompt=PROMPT, max_tokens=2, temperature=0).choices


def test_unknown_routes_and_methods_answer_openais_error_object(server: Running) -> None:
    status, _, reply = http(f"{server.url}/v1/embeddings", "POST", b"{}")
    assert status == 404 and set(reply["error"]) == {"message", "type", "param", "code"}, reply
    assert reply["error"]["code"] == "not_found" and "/v1/embeddings" in reply["error"]["message"]
    status, headers, reply = http(f"{server.url}/v1/completions", "GET")
    assert status == 405 and reply["error"]["code"] == "method_not_allowed" and "POST" in headers["Allow"], reply
    assert http(f"{server.url}/v1/embeddings", "POST", b"{}", key=None)[0] == 401  # the key first, as before


def test_logprobs_are_the_models_log_softmax_and_stream_as_they_come(server: Running) -> None:
    """Each generated token's log-probability and the most likely tokens', from the model's logits before
    any sampling control: the first token's equal the numpy forward pass's log-softmax."""
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer

    weights = load_file(str(server.config.parent.parent / "model" / "model.safetensors"))
    tokenizer = Tokenizer.from_file(str(server.config.parent / "tokenizer.json"))
    ids = tokenizer.encode(PROMPT).ids
    logits = forward(weights, ids)
    want = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    best = np.argsort(-want)[:3]
    client = server.client()
    reply = client.completions.create(model="out", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and logprobs.token_logprobs is not None
    assert logprobs.top_logprobs is not None and logprobs.text_offset is not None
    assert "".join(logprobs.tokens) == reply.choices[0].text and len(logprobs.tokens) == 6
    np.testing.assert_allclose(logprobs.token_logprobs[0], want[best[0]], atol=1e-4)
    first = logprobs.top_logprobs[0]
    assert list(first) == [tokenizer.decode([int(i)]) for i in best]
    np.testing.assert_allclose(sorted(first.values(), reverse=True), want[best], atol=1e-4)
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(6)]
    streamed = client.completions.create(model="out", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                         stream=True)  # fmt: skip
    pieces = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [t for p in pieces for t in p.tokens or []] == logprobs.tokens
    # this request may begin from the last one's rows (prefix reuse), its last prompt token fed alone: the
    # values agree to float rounding
    assert [v for p in pieces for v in p.token_logprobs or []] == pytest.approx(logprobs.token_logprobs, abs=1e-4)
    assert [o for p in pieces for o in p.text_offset or []] == logprobs.text_offset
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model="qv", messages=messages, max_tokens=5, temperature=0, logprobs=True,
                                          top_logprobs=2)  # fmt: skip
    content = chat.choices[0].logprobs.content if chat.choices[0].logprobs else None
    assert content is not None and "".join(c.token for c in content) == chat.choices[0].message.content
    for entry in content:  # greedy: the chosen token is the most likely
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == entry.logprob <= 0
        assert (
            entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
            and bytes(entry.bytes or []).decode() == entry.token
        )
    plain = client.chat.completions.create(model="qv", messages=messages, max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == chat.choices[0].message.content
    streamed_chat = client.chat.completions.create(model="qv", messages=messages, max_tokens=5, temperature=0,
                                                   logprobs=True, stream=True)  # fmt: skip
    tokens = [
        c.token
        for e in streamed_chat
        if e.choices and e.choices[0].logprobs
        for c in e.choices[0].logprobs.content or []
    ]
    assert tokens == [c.token for c in content]
    status, reply_ = _post(server, "/v1/chat/completions", {"model": "out", "messages": messages, "top_logprobs": 2})
    assert status == 400 and reply_["error"]["param"] == "top_logprobs"


def test_echo_gives_the_prompts_log_probabilities_as_lm_eval_asks_for_them(server: Running) -> None:
    """lm-eval's loglikelihood request (token ids, `echo`, `max_tokens` 0, `logprobs` 1): each prompt token's
    log-probability after the ones before it (the numpy forward pass's), the first's null; with new tokens,
    the prompt's then theirs."""
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer

    weights = load_file(str(server.config.parent.parent / "model" / "model.safetensors"))
    tokenizer = Tokenizer.from_file(str(server.config.parent / "tokenizer.json"))
    ids = tokenizer.encode(PROMPT).ids
    client = server.client()
    scored = client.completions.create(model="out", prompt=ids, echo=True, max_tokens=0, logprobs=1)
    choice = scored.choices[0]
    assert choice.text == tokenizer.decode(ids) and choice.logprobs is not None
    values = choice.logprobs.token_logprobs or []
    assert len(values) == len(ids) and values[0] is None and (choice.logprobs.top_logprobs or [0])[0] is None
    for position in (1, len(ids) // 2, len(ids) - 1):
        logits = forward(weights, ids[:position])
        want = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
        np.testing.assert_allclose(values[position], want[ids[position]], atol=1e-4)
    assert scored.usage is not None and scored.usage.completion_tokens == 0
    more = client.completions.create(model="out", prompt=PROMPT, echo=True, max_tokens=3, logprobs=0, temperature=0)
    alone = client.completions.create(model="out", prompt=PROMPT, max_tokens=3, logprobs=0, temperature=0)
    assert more.choices[0].text == PROMPT + alone.choices[0].text
    tail = (more.choices[0].logprobs.token_logprobs or [])[len(ids) :] if more.choices[0].logprobs else None
    # the prompt fed a token at a time: the same values but for the order of float additions
    np.testing.assert_allclose(
        tail or [], (alone.choices[0].logprobs.token_logprobs or []) if alone.choices[0].logprobs else [1], atol=1e-4
    )
    status, reply = _post(server, "/v1/completions", {"model": "out", "prompt": PROMPT, "max_tokens": 0})
    assert status == 400 and reply["error"]["param"] == "max_tokens", reply  # 0 only to score an echoed prompt
    # streamed: the prompt first (its text and log-probabilities), then the completion's, as whole
    stream = client.completions.create(model="out", prompt=PROMPT, echo=True, max_tokens=3, logprobs=0, temperature=0,
                                       stream=True)  # fmt: skip
    pieces = [c.choices[0] for c in stream if c.choices]
    assert pieces[0].text == PROMPT and "".join(p.text for p in pieces) == more.choices[0].text
    whole = more.choices[0].logprobs
    assert whole is not None and [t for p in pieces if p.logprobs for t in p.logprobs.tokens or []] == whole.tokens
    assert [v for p in pieces if p.logprobs for v in p.logprobs.token_logprobs or []] == whole.token_logprobs


SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 1, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["colour", "size", "tags", "ok"],
    "additionalProperties": False,
}


def _valid(reply: Any) -> bool:
    """SCHEMA checked by hand (a reference apart from the grammar engine)."""
    return (
        isinstance(reply, dict) and set(reply) == {"colour", "size", "tags", "ok"} and reply["colour"] in
        ("red", "green", "blue") and type(reply["size"]) is int and 1 <= reply["size"] <= 9 and
        isinstance(reply["tags"], list) and len(reply["tags"]) <= 2 and set(reply["tags"]) <= {"a", "b"}
        and isinstance(reply["ok"], bool)
    )  # fmt: skip


def _completion_text(server: Running, **fields: Any) -> str:
    status, reply = _post(server, "/v1/completions", {"model": "out", "prompt": PROMPT, "temperature": 1.0, **fields})
    assert status == 200 and reply["choices"][0]["finish_reason"] == "stop", (fields, reply["choices"][0])
    return str(reply["choices"][0]["text"])


def test_structured_outputs_hold_the_schema_regex_choice_and_grammar_asked(server: Running) -> None:
    """Every reply of a random-weight model, sampled, matches its constraint: OpenAI's json_schema (strict),
    vLLM's guided regex and choice and structured_outputs, llama.cpp's GBNF grammar; rows without one are
    untouched."""
    client = server.client()
    small = {"type": "object", "properties": {"c": {"enum": ["r", "g"]}, "n": {"type": "integer", "minimum": 1,
             "maximum": 9}}, "required": ["c", "n"], "additionalProperties": False}  # fmt: skip
    form = {"type": "json_schema", "json_schema": {"name": "thing", "schema": small, "strict": True}}
    messages = [{"role": "user", "content": "a thing"}]
    for seed in range(8):
        chat = client.chat.completions.create(model="qv", messages=messages, max_tokens=25, temperature=1.2,
                                              seed=seed, response_format=form)  # type: ignore[arg-type]  # fmt: skip
        reply = json.loads(chat.choices[0].message.content or "")
        assert chat.choices[0].finish_reason == "stop" and reply["c"] in ("r", "g") and 1 <= reply["n"] <= 9, reply
    for seed in range(6):
        assert _valid(json.loads(_completion_text(server, max_tokens=50, seed=seed, response_format={
            "type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}})))  # fmt: skip
    assert _valid(json.loads(_completion_text(server, max_tokens=50, seed=9, structured_outputs={"json": SCHEMA})))
    for seed in range(4):
        assert re.fullmatch("[0-9]{3}-[a-c]{2,4}", _completion_text(server, max_tokens=20, seed=seed,
                                                                guided_regex="[0-9]{3}-[a-c]{2,4}"))  # fmt: skip
        assert _completion_text(server, max_tokens=9, seed=seed, guided_choice=["yes", "no"]) in ("yes", "no")
        assert _completion_text(server, max_tokens=9, seed=seed, grammar='root ::= "on" | "off"') in ("on", "off")
    expected = _t2t_greedy(server.config, tokens=8)  # unconstrained rows beside constrained ones: unchanged
    with ThreadPoolExecutor(4) as pool:
        plain = pool.submit(client.completions.create, model="out", prompt=PROMPT, max_tokens=8, temperature=0)
        constrained = [pool.submit(_completion_text, server, max_tokens=50, seed=s, guided_json=SCHEMA)
                       for s in range(3)]  # fmt: skip
        assert (plain.result().choices[0].model_extra or {})["token_ids"] == expected
        assert all(_valid(json.loads(c.result())) for c in constrained)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}, "days": {"type": "integer", "minimum": 1,
    "maximum": 3}}, "required": ["city", "days"], "additionalProperties": False}}}  # fmt: skip
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
    "zone": {"enum": ["utc", "cet"]}}, "required": ["zone"], "additionalProperties": False}}}  # fmt: skip


def _weather(arguments: str) -> bool:
    given = json.loads(arguments)
    return set(given) == {"city", "days"} and given["city"] in ("Oslo", "Lima") and given["days"] in (1, 2, 3)


def test_a_required_or_named_tool_choice_returns_valid_calls_whole_and_streamed(server: Running) -> None:
    client = server.client()
    messages = [{"role": "user", "content": "weather?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(4):
        reply = client.chat.completions.create(model="out", messages=messages, max_tokens=25, temperature=1.0,
                                               seed=seed, tools=[WEATHER, CLOCK], tool_choice=named)  # type: ignore[list-item,arg-type]  # fmt: skip
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        calls = choice.message.tool_calls or []
        assert len(calls) == 1 and calls[0].function.name == "get_weather" and _weather(calls[0].function.arguments)
    tiny = {"type": "function", "function": {"name": "t", "parameters": {"type": "object", "properties": {},
                                                                          "additionalProperties": False}}}  # fmt: skip
    required = {"model": "out", "messages": [{"role": "user", "content": "w"}], "max_tokens": 34, "seed": 1,
                "tools": [tiny], "tool_choice": "required", "parallel_tool_calls": False}  # fmt: skip
    choice = _post(server, "/v1/chat/completions", required)[1]["choices"][0]  # the context is 64 characters
    assert choice["finish_reason"] == "tool_calls" and [c["function"] for c in choice["message"]["tool_calls"]] == [
        {"name": "t", "arguments": "{}"}], choice  # fmt: skip
    streamed = client.chat.completions.create(model="out", messages=messages, max_tokens=25, temperature=1.0, seed=2,
                                              tools=[WEATHER], tool_choice=named, stream=True)  # type: ignore[list-item,arg-type]  # fmt: skip
    deltas = [c.choices[0] for c in streamed if c.choices]
    parts = [t for d in deltas for t in d.delta.tool_calls or []]
    assert deltas[-1].finish_reason == "tool_calls" and len(parts) == 1 and _weather(parts[0].function.arguments or "")
    assert not any(d.delta.content for d in deltas)
    # the calls and their result go back into the conversation as OpenAI's clients send them
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'},
    }
    turn = messages + [{"role": "assistant", "content": None, "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]  # fmt: skip
    assert _post(server, "/v1/chat/completions", {"model": "out", "messages": turn, "max_tokens": 2})[0] == 200
    refused = _post(server, "/v1/chat/completions", {"model": "out", "messages": messages, "tools": [WEATHER]})[1]
    assert refused["error"]["param"] == "tool_choice" and "--tool-call-parser" in refused["error"]["message"]
    both = {"model": "out", "messages": messages, "tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}
    assert _post(server, "/v1/chat/completions", both)[1]["error"]["param"] == "guided_regex"


HERMES = (  # no newline after a block tag: the server trims those as transformers does, jinja2's default not
    "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}</tools>"
    "{% endif %}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}<tool_call>{{ c['function']['name'] }}:"
    "{{ c['function']['arguments']['zone'] }}</tool_call>{% endfor %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_tools_reach_the_template_and_auto_reads_its_format(exported: Path, tmp_path: Path) -> None:
    """A template that writes hermes calls: the server reads that format for tool_choice auto, the template
    lists the tools, and an assistant's calls reach it with their arguments as objects."""
    from jinja2 import Template
    from tokenizers import Tokenizer

    template = tmp_path / "hermes.jinja"
    template.write_text(HERMES)
    running = start_server(exported, "--chat-template", str(template))
    try:
        call = {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "utc"}'}}
        messages = [{"role": "user", "content": "time?"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
        status, tokens = _post(running, "/tokenize", {"messages": messages, "tools": [WEATHER, CLOCK],
                                                      "add_generation_prompt": False})  # fmt: skip
        shown = [{**m, "tool_calls": [{**call, "function": {"name": "get_time", "arguments": {"zone": "utc"}}}]}
                 if m.get("tool_calls") else m for m in messages]  # fmt: skip
        text = Template(HERMES).render(messages=shown, tools=[WEATHER, CLOCK], add_generation_prompt=False)
        assert "get_weather;get_time;" in text and "<tool_call>get_time:utc</tool_call>" in text
        tokenizer = Tokenizer.from_file(str(exported.parent / "tokenizer.json"))
        assert status == 200 and tokens["tokens"] == tokenizer.encode(text, add_special_tokens=False).ids
        auto = _post(running, "/v1/chat/completions", {"model": "out", "messages": messages[:1], "max_tokens": 4,
                                                       "tools": [CLOCK], "temperature": 0})  # fmt: skip
        assert auto[0] == 200 and auto[1]["choices"][0]["message"]["content"] is not None  # a random model: text
    finally:
        stop_server(running)


def test_n_choices_prompt_lists_and_best_of_are_indexed_as_openai_does(server: Running) -> None:
    """`n` choices per prompt (choice j seeded seed + j), lists of prompts (choice index prompt x n + j),
    `best_of` (the n most likely of best_of), usage over them all; streamed choices under their index."""
    client = server.client()
    greedy = client.completions.create(model="out", prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text
    other = "hello there"
    other_greedy = client.completions.create(model="out", prompt=other, max_tokens=6, temperature=0).choices[0].text
    both = client.completions.create(model="out", prompt=[PROMPT, other], max_tokens=6, temperature=0, n=2)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [greedy, greedy, other_greedy, other_greedy]
    assert both.usage is not None and both.usage.completion_tokens == 24
    prompt_tokens = [client.completions.create(model="out", prompt=p, max_tokens=1).usage for p in (PROMPT, other)]
    assert both.usage.prompt_tokens == sum(u.prompt_tokens for u in prompt_tokens if u is not None)
    sampled = client.completions.create(model="out", prompt=PROMPT, max_tokens=12, temperature=1.5, n=3, seed=7)
    alone = [client.completions.create(model="out", prompt=PROMPT, max_tokens=12, temperature=1.5, seed=7 + j)
             for j in range(3)]  # fmt: skip
    assert [c.text for c in sampled.choices] == [a.choices[0].text for a in alone]
    assert len({c.text for c in sampled.choices}) > 1  # seeded choices differ from each other
    best = client.completions.create(model="out", prompt=PROMPT, max_tokens=8, temperature=1.5, n=2, best_of=3, seed=1,
                                     logprobs=0)  # fmt: skip
    candidates = client.completions.create(model="out", prompt=PROMPT, max_tokens=8, temperature=1.5, n=3, seed=1,
                                           logprobs=0)  # fmt: skip
    totals = sorted((sum((c.logprobs.token_logprobs or []) if c.logprobs else []), c.text) for c in candidates.choices)
    assert [c.text for c in best.choices] == [text for _, text in totals[::-1][:2]]
    hi = [{"role": "user", "content": "hi"}]
    streamed = client.chat.completions.create(model="qv", messages=hi, max_tokens=5, temperature=0, n=2, stream=True,
                                              stream_options={"include_usage": True})  # fmt: skip
    texts: dict[int, str] = {}
    usage = None
    for event in streamed:
        for choice in event.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        usage = event.usage or usage
    whole = client.chat.completions.create(model="qv", messages=hi, max_tokens=5, temperature=0)
    assert texts == {0: whole.choices[0].message.content, 1: whole.choices[0].message.content}
    assert (
        usage is not None and whole.usage is not None and usage.completion_tokens == 2 * whole.usage.completion_tokens
    )


def test_a_chat_may_continue_its_last_message_and_pass_the_template_its_names(server: Running) -> None:
    """`continue_final_message` (transformers' cut right after the last message's text) and
    `chat_template_kwargs`: the same tokens as a completion of the text rendered so (by jinja2 here)."""
    from jinja2 import Template

    client = server.client()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the quick"}]
    rendered = Template(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=False, bos_token="<s>")
    cut = rendered[: rendered.rindex("the quick") + len("the quick")]
    status, tokens = _post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False,
                                                 "continue_final_message": True})  # fmt: skip
    assert status == 200, tokens
    chat = _post(server, "/v1/chat/completions", {"model": "out", "messages": messages, "max_tokens": 6,
                                                  "temperature": 0, "add_generation_prompt": False,
                                                  "continue_final_message": True})[1]  # fmt: skip
    plain = client.completions.create(model="out", prompt=tokens["tokens"], max_tokens=6, temperature=0)
    assert chat["choices"][0]["message"]["content"] == plain.choices[0].text
    assert tokens["tokens"] == _post(server, "/tokenize", {"prompt": cut, "add_special_tokens": False})[1]["tokens"]
    asked = {"model": "out", "messages": messages, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}}
    status, reply = _post(server, "/v1/chat/completions", asked)  # a name this template does not read: no change
    assert status == 200, reply


def _post(server: Running, route: str, body: dict[str, Any]) -> tuple[int, Any]:
    status, _, reply = http(f"{server.url}{route}", "POST", json.dumps(body).encode())
    return status, reply


def test_documents_reach_the_chat_template(server: Running) -> None:
    """vLLM's `documents` (a retrieval template's, transformers' `documents`): rendered where the template
    puts them; anything but a list of objects of strings is a 400 naming the field."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(server.config.parent / "tokenizer.json"))
    documents = [{"title": "Rivers", "text": "The Loire is long."}]
    body = {"model": "out", "messages": [{"role": "user", "content": "hi"}], "documents": documents}
    status, reply = _post(server, "/tokenize", body)
    assert status == 200 and tokenizer.decode(reply["tokens"]).count("Rivers: The Loire is long.") == 1, reply
    assert tokenizer.decode(_post(server, "/tokenize", {**body, "documents": []})[1]["tokens"]).count("Loire") == 0
    status, reply = _post(server, "/v1/chat/completions", {**body, "max_tokens": 2})
    assert status == 200 and reply["usage"]["prompt_tokens"] > 12, reply
    for bad in ([{"title": 3}], "text", [[]]):
        status, reply = _post(server, "/v1/chat/completions", {**body, "documents": bad})
        assert status == 400 and reply["error"]["param"] == "documents", reply


def test_tokenize_detokenize_and_version_answer_as_vllms_routes(server: Running) -> None:
    from jinja2 import Template
    from tokenizers import Tokenizer

    import quiver

    tokenizer = Tokenizer.from_file(str(server.config.parent / "tokenizer.json"))  # the library, not Quiver
    status, reply = _post(server, "/tokenize", {"model": "out", "prompt": PROMPT, "return_token_strs": True})
    want = tokenizer.encode(PROMPT).ids
    assert status == 200 and reply["tokens"] == want and reply["count"] == len(want), reply
    assert reply["max_model_len"] == 64 and reply["token_strs"] == [tokenizer.decode([i]) for i in want]
    assert _post(server, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False})[1]["tokens"] == (
        tokenizer.encode(PROMPT, add_special_tokens=False).ids
    )
    messages = [{"role": "user", "content": "hi"}]
    for prompt in (True, False):
        text = Template(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=prompt, bos_token="<s>")
        status, reply = _post(
            server, "/tokenize", {"model": "qv", "messages": messages, "add_generation_prompt": prompt}
        )
        assert status == 200 and reply["tokens"] == tokenizer.encode(text, add_special_tokens=False).ids, reply
    status, reply = _post(server, "/detokenize", {"model": "out", "tokens": want})
    assert status == 200 and reply == {"prompt": tokenizer.decode(want)}
    status, _, reply = http(f"{server.url}/version")
    assert status == 200 and reply == {"version": quiver.__version__}
    refused = {
        "/tokenize": [({"prompt": PROMPT, "messages": messages}, "prompt"), ({"prompt": PROMPT, "echo": True}, "echo"),
                      ({"prompt": PROMPT, "model": "nope"}, "model"), ({"prompt": 5}, "prompt"),
                      ({"messages": messages, "chat_template_kwargs": {"messages": 1}}, "chat_template_kwargs"),
                      ({"messages": messages, "continue_final_message": True, "add_generation_prompt": True},
                       "continue_final_message")],
        "/detokenize": [({"tokens": [10**9]}, "tokens"), ({"tokens": ["a"]}, "tokens"),
                        ({"tokens": [1] * 65}, "tokens"), ({"tokens": [1], "prompt": "x"}, "prompt")],
    }  # fmt: skip
    for route, cases in refused.items():
        for body, param in cases:
            status, reply = _post(server, route, body)
            assert status in (400, 404) and reply["error"]["param"] == param, (route, body, reply)
    assert http(f"{server.url}/tokenize", "POST", b"{}", key=None)[0] == 401


def test_a_clients_defaults_for_fields_not_implemented_pass(server: Running) -> None:
    neutral = {
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "top_k": -1,
        "min_p": 0,
        "logprobs": None,
        "response_format": {"type": "text"},
        "user": "someone",
        "logit_bias": {},
        "echo": False,
        "best_of": 1,
    }
    body = json.dumps({"model": "out", "prompt": PROMPT, "max_tokens": 2, **neutral}).encode()
    got, _, reply = http(f"{server.url}/v1/completions", "POST", body)
    assert got == 200 and reply["usage"]["completion_tokens"] == 2, reply


@pytest.mark.parametrize(
    "controls",
    [{"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 3.0}, {"top_k": 1, "min_p": 0.5}],
)
def test_sampling_controls_give_what_the_dialog_gives_with_them(
    server: Running, exported: Path, controls: dict[str, float]
) -> None:
    from quiver.t2t.dialog import Dialog

    reply = server.client().completions.create(model="out", prompt=PROMPT, max_tokens=24, temperature=0,
                                               extra_body=controls)  # fmt: skip
    with Dialog.from_config(exported) as dialog:
        plain = dialog.query(PROMPT, max_new_tokens=24, greedy=True).new_ids
        dialog.reset()
        want = dialog.query(PROMPT, max_new_tokens=24, greedy=True, **controls).new_ids
    assert reply.choices[0].token_ids == want  # type: ignore[attr-defined]
    if "top_k" not in controls:  # greedy: top-k 1 and min-p change nothing, a penalty on a repeated token does
        assert want != plain


def test_a_logit_bias_and_stop_token_ids_act_as_they_do_in_the_dialog(server: Running, exported: Path) -> None:
    from quiver.t2t.dialog import Dialog

    client = server.client()
    with Dialog.from_config(exported) as dialog:
        plain = dialog.query(PROMPT, max_new_tokens=12, greedy=True).new_ids
        dialog.reset()
        banned = dialog.query(PROMPT, max_new_tokens=12, greedy=True, logit_bias={plain[0]: -100}).new_ids
        dialog.reset()
        stopped = dialog.query(PROMPT, max_new_tokens=12, greedy=True, stop_token_ids=[plain[3]]).new_ids
    assert banned[0] != plain[0] and stopped == plain[: plain.index(plain[3]) + 1]
    reply = client.completions.create(model="out", prompt=PROMPT, max_tokens=12, temperature=0,
                                      logit_bias={str(plain[0]): -100})  # fmt: skip
    assert reply.choices[0].token_ids == banned  # type: ignore[attr-defined]
    reply = client.completions.create(model="out", prompt=PROMPT, max_tokens=12, temperature=0,
                                      extra_body={"stop_token_ids": [plain[3]]})  # fmt: skip
    assert reply.choices[0].token_ids == stopped and reply.choices[0].finish_reason == "stop"  # type: ignore[attr-defined]
    reply = client.completions.create(model="out", prompt=PROMPT, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})  # fmt: skip
    assert reply.choices[0].token_ids[: len(plain)] == plain  # type: ignore[attr-defined]


def test_the_token_that_ends_a_reply_has_its_log_probability(server: Running) -> None:
    """An ending token (here a stop token id) gives no text but is a token of the reply, with its entry in
    `logprobs` as vLLM gives it: lm-eval reads the entry after the echoed prompt as the generated one."""
    client = server.client()
    plain = client.completions.create(model="out", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0)
    ids = plain.choices[0].token_ids  # type: ignore[attr-defined]
    assert plain.choices[0].logprobs is not None and len(plain.choices[0].logprobs.token_logprobs or []) == 8
    end = next(i for i in range(1, 8) if ids[i] not in ids[:i])  # a token the reply has not had before
    for stream in (False, True):
        reply = client.completions.create(model="out", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0,
                                          stream=stream, extra_body={"stop_token_ids": [ids[end]]})  # fmt: skip
        chunks = list(reply) if stream else [reply]
        values = [
            v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs
        ]
        assert chunks[-1].choices[0].finish_reason == "stop"
        np.testing.assert_allclose(values, (plain.choices[0].logprobs.token_logprobs or [])[: end + 1], atol=1e-5)


def test_a_stream_ends_with_its_usage_only_when_asked(server: Running) -> None:
    client = server.client()
    chunks = list(client.chat.completions.create(
        model="out", messages=[{"role": "user", "content": PROMPT}], max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    assert all(c.usage is None for c in chunks[:-1])
    plain = list(client.completions.create(model="out", prompt=PROMPT, max_tokens=4, temperature=0, stream=True))
    assert plain[-1].choices and all(c.usage is None for c in plain)


def test_a_body_over_the_limit_is_refused_before_it_is_read(server: Running) -> None:
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:  # the headers only: no body follows
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {5 << 20}\r\n\r\n".encode())  # fmt: skip
        reply = b""
        while b"\r\n\r\n" not in reply or len(reply.split(b"\r\n\r\n", 1)[1]) < _content_length(reply):
            piece = sock.recv(65536)
            if not piece:
                break
            reply += piece
    text = reply.decode()
    assert text.startswith("HTTP/1.1 413") and '"code":"body_too_large"' in text.replace(" ", "")


def _content_length(reply: bytes) -> int:
    for line in reply.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def test_a_strength_the_adapter_lacks_is_a_400_and_chat_messages_are_checked(server: Running) -> None:
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="no strength"):
        client.completions.create(model="qv", prompt=PROMPT, max_tokens=2, extra_body={"lora": {"nope": 1.0}})
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="out", messages=[{"role": "wizard", "content": "x"}])  # type: ignore[misc]


def test_a_full_queue_answers_429_with_retry_after_and_the_rest_are_served(exported: Path) -> None:
    running = start_server(exported, "--max-queue", "1", "--max-batch", "1")
    try:
        body = json.dumps({"model": "out", "prompt": PROMPT, "max_tokens": 40, "temperature": 0}).encode()
        with ThreadPoolExecutor(12) as pool:
            results = list(pool.map(lambda _: http(f"{running.url}/v1/completions", "POST", body, None), range(12)))
        refused = [r for r in results if r[0] == 429]
        assert refused and all(r[1]["Retry-After"] and r[2]["error"]["type"] == "rate_limit_error" for r in refused)
        assert all(r[0] == 200 for r in results if r[0] != 429)
    finally:
        stop_server(running)


def test_servers_with_a_packed_weights_folder_share_one_form_and_give_the_same_tokens(
    exported: Path, tmp_path: Path
) -> None:
    expected = _t2t_greedy(exported, "-l", "all")
    for _ in range(2):  # the first makes the form, the second maps it
        running = start_server(exported, "--packed-weights", str(tmp_path))
        try:
            reply = running.client().completions.create(model="all", prompt=PROMPT, max_tokens=8, temperature=0)
            assert reply.choices[0].model_extra is not None and reply.choices[0].model_extra["token_ids"] == expected
        finally:
            stop_server(running)
        assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 1


def test_a_client_that_goes_away_mid_stream_leaves_the_server_serving(server: Running) -> None:
    client = server.client()
    for _ in range(3):
        stream = client.completions.create(model="out", prompt=PROMPT, max_tokens=50, temperature=0, stream=True)
        next(iter(stream))
        stream.close()  # gone after its first token (the engine-level test shows the job stops)
    assert client.completions.create(model="out", prompt=PROMPT, max_tokens=2, temperature=0).choices


def test_metrics_count_requests_and_tokens(server: Running) -> None:
    server.client().completions.create(model="out", prompt=PROMPT, max_tokens=3, temperature=0)
    request = urllib.request.Request(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        text = response.read().decode()
    for name in ("quiver_requests_total", "quiver_generated_tokens_total", "quiver_queue_length",
                 "quiver_time_to_first_token_seconds_bucket", "quiver_adapter_loads_total"):  # fmt: skip
        assert name in text, name
    assert 'route="/v1/completions",status="200"' in text


@pytest.mark.skipif(
    not MALLOC_ON_HUGE_PAGES,
    reason="this kernel or C library gives no huge pages on request (THP not in madvise mode, or not glibc 2.35+)",
)
def test_the_server_restarts_itself_with_malloc_on_huge_pages(server: Running) -> None:
    """`quiver serve` execs itself once with glibc's malloc asking for huge pages: the same process (the pid
    the test started), its environment says so, and the kernel gave it some."""
    proc = Path(f"/proc/{server.process.pid}")
    environ = proc.joinpath("environ").read_bytes().split(b"\0")
    tunables = next(v for v in environ if v.startswith(b"GLIBC_TUNABLES=")).decode()
    assert "glibc.malloc.hugetlb=1" in tunables.split("=", 1)[1].split(":")
    assert b"serve" in proc.joinpath("cmdline").read_bytes().split(b"\0")  # the same command line, run again
    huge = next(line for line in proc.joinpath("smaps_rollup").read_text().splitlines() if line.startswith("AnonHuge"))
    assert int(huge.split()[1]) > 0


def test_a_server_beyond_loopback_needs_a_key(exported: Path) -> None:
    command = [sys.executable, "-m", "quiver", "serve", "-c", str(exported), "--host", "0.0.0.0", "--port", "0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "needs an API key" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("lora", "says", "code"),
    [("nameonly", "NAME=PATH", 2), ("x=/no/such/folder", "such", 1), ("big={wide}", "rank", 1),
     ("all={peft}", "taken", 1)],
)  # fmt: skip
def test_a_bad_lora_at_start_is_one_line(exported: Path, tmp_path: Path, lora: str, says: str, code: int) -> None:
    """`--lora` adapters are checked before the server listens: not NAME=PATH (a usage error, as in `t2t
    export`: exit 2), missing, a rank beyond the context's branches, a name taken (exit 1)."""
    from safetensors.numpy import load_file, save_file

    wide = tmp_path / "wide"  # the "all" adapter's modules at twice its rank
    wide.mkdir()
    tensors = load_file(str(exported.parent.parent / "all" / "adapter_model.safetensors"))
    config = json.loads((exported.parent.parent / "all" / "adapter_config.json").read_text()) | {"r": 8}
    save_file({k: np.concatenate([v, v], axis=0 if ".lora_A." in k else 1) for k, v in tensors.items()},
              str(wide / "adapter_model.safetensors"))  # fmt: skip
    (wide / "adapter_config.json").write_text(json.dumps(config))
    entry = lora.format(wide=wide, peft=exported.parent.parent / "qv")
    command = [sys.executable, "-m", "quiver", "serve", "-c", str(exported), "--port", "0", "--lora", entry]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == code and says in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_the_engine_refuses_beyond_its_queue_and_skips_what_was_cancelled(exported: Path) -> None:
    from quiver.serve.scheduler import Done, Generation, QueueFullError, Scheduler

    decoder = BatchDecoder.from_config(exported, max_batch=1)  # one running, then the queue
    try:
        ids = decoder.tokenizer.encode(PROMPT)
        request = Generation(ids, None, {}, 40, 0.0, 1.0, None, ())
        engine = Scheduler(decoder, max_queue=1)
        finished: list[Any] = []
        arrived = threading.Event()

        def sink(event: Any) -> None:
            if isinstance(event, Done):
                finished.append(event)
                arrived.set()

        engine.submit(request, sink)  # the worker takes it
        deadline = time.monotonic() + 10
        while engine.waiting and time.monotonic() < deadline:
            time.sleep(0.01)
        waiting = engine.submit(request, sink)
        with pytest.raises(QueueFullError):
            engine.submit(request, sink)
        engine.cancel(waiting)
        deadline = time.monotonic() + 30
        while (engine.waiting or engine.batch_size or len(finished) < 2) and time.monotonic() < deadline:
            time.sleep(0.01)  # the worker skips the cancelled one
        ran, skipped = sorted(finished, key=lambda done: len(done.token_ids), reverse=True)
        assert len(ran.token_ids) == 40 and ran.finish_reason == "length"
        assert skipped.token_ids == [] and skipped.finish_reason == "cancelled"  # it never ran
        arrived.clear()

        def cancelling(event: Any) -> None:  # a client gone after the first token
            if isinstance(event, Done):
                finished.append(event)
                arrived.set()
            else:
                engine.cancel(running)

        running = engine.submit(request, cancelling)
        assert arrived.wait(30)
        engine.close()
        assert finished[-1].finish_reason == "cancelled" and len(finished[-1].token_ids) < 40
    finally:
        decoder.close()


def test_adapters_warmed_at_start_fill_their_first_slot_without_reading_a_section(
    exported: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from quiver.formats.section import SectionFile

    copy = shutil.copytree(exported.parent, tmp_path / "copy")  # files this process has never read
    opened: list[Path] = []
    read = SectionFile.open.__func__  # type: ignore[attr-defined]

    def counted(cls: type[SectionFile], path: Path, *args: Any, **kwargs: Any) -> SectionFile:
        opened.append(Path(path))
        return read(cls, path, *args, **kwargs)  # type: ignore[no-any-return]

    monkeypatch.setattr(SectionFile, "open", classmethod(counted))
    decoder = BatchDecoder.from_config(copy / exported.name, max_batch=2)
    try:
        budget = sum(p.stat().st_size for p in decoder.adapters.get("all").bin_sections)
        assert decoder.warm_adapters(budget) == ["all"]  # "qv" is beyond what is left of the budget
        warmed = len(opened)
        assert warmed >= 1
        decoder.acquire_slot("all")
        assert len(opened) == warmed  # its slot filled from what was read and checked at the start
        decoder.acquire_slot("qv")
        assert len(opened) == warmed + 1  # not warmed: read on its first request
    finally:
        decoder.close()


def test_a_batch_beyond_the_machines_memory_is_refused_at_start(exported: Path) -> None:
    from quiver.errors import GenerationError

    with pytest.raises(GenerationError, match="--max-batch"):  # terabytes of KV cache: allocated at start
        BatchDecoder.from_config(exported, max_batch=10**9)


def test_an_outbox_delivers_in_order_with_one_wake_up_for_what_arrives_together() -> None:
    import asyncio

    from quiver.serve.loop import Outbox

    async def main() -> tuple[list[int], list[int], int]:
        outbox = Outbox(asyncio.get_running_loop())
        wake_ups = [0]
        deliver = outbox._deliver

        def counted() -> None:
            wake_ups[0] += 1
            deliver()

        outbox._deliver = counted  # type: ignore[method-assign]
        first: asyncio.Queue[int] = asyncio.Queue()
        second: asyncio.Queue[int] = asyncio.Queue()
        put_first, put_second = outbox.sink(first), outbox.sink(second)

        def engine_step() -> None:
            for i in range(100):
                put_first(i)
                put_second(-i)

        # another thread puts 200 items while the loop's thread is busy (joined, not awaited: an await
        # would let the loop deliver what arrived so far, and the rest would ask for a wake-up of its own)
        step = threading.Thread(target=engine_step)
        step.start()
        step.join(10)
        got_first = [await asyncio.wait_for(first.get(), 10) for _ in range(100)]
        got_second = [await asyncio.wait_for(second.get(), 10) for _ in range(100)]
        return got_first, got_second, wake_ups[0]

    got_first, got_second, wake_ups = asyncio.run(main())
    assert got_first == list(range(100)) and got_second == [-i for i in range(100)]
    assert wake_ups == 1


def test_a_sink_that_fails_loses_its_event_and_the_engine_serves_on(exported: Path) -> None:
    from quiver.serve.scheduler import Done, Generation, Scheduler

    decoder = BatchDecoder.from_config(exported, max_batch=2)
    engine = Scheduler(decoder)
    try:
        ids = decoder.tokenizer.encode(PROMPT)
        finished = threading.Event()
        done: list[Done] = []

        def failing(event: Any) -> None:
            raise RuntimeError("a sink whose loop is gone")

        def good(event: Any) -> None:
            if isinstance(event, Done):
                done.append(event)
                finished.set()

        engine.submit(Generation(ids, None, {}, 8, 0.0, 1.0, None, ()), failing)
        engine.submit(Generation(ids, "all", {}, 8, 0.0, 1.0, None, ()), good)
        assert finished.wait(60)
        assert len(done[0].token_ids) == 8 and done[0].finish_reason == "length"
    finally:
        engine.close()
        decoder.close()


def test_a_sequence_that_fails_leaves_no_row_held_one_that_ends_well_does(exported: Path, tmp_path: Path) -> None:
    """A row whose step overflowed (an adapter's finite weights too large: logits not finite) may hold keys
    and values that are not finite: it goes back, never held for a prompt that begins as it did."""
    from safetensors.numpy import load_file, save_file

    from quiver.serve.scheduler import Done, Failed, Generation, Scheduler

    tiny_adapter(tmp_path / "huge", load_file(str(exported.parent.parent / "model" / "model.safetensors")), 2,
                 ["q_proj", "v_proj"], seed=5)  # fmt: skip
    adapter = tmp_path / "huge" / "adapter_model.safetensors"
    save_file({name: np.full_like(a, 1e30) for name, a in load_file(str(adapter)).items()}, str(adapter))
    decoder = BatchDecoder.from_config(exported, max_batch=2, adapter_slots=1)
    decoder.add_adapter("huge", tmp_path / "huge")
    engine = Scheduler(decoder)
    try:
        ids = decoder.tokenizer.encode(PROMPT)
        for adapter_name, ending in (("huge", Failed), ("all", Done)):
            ended: list[Any] = []
            finished = threading.Event()

            def sink(event: Any, ended: list[Any] = ended, finished: threading.Event = finished) -> None:
                if isinstance(event, (Done, Failed)):
                    ended.append(event)
                    finished.set()

            engine.submit(Generation(ids, adapter_name, {}, 4, 0.0, 1.0, None, ()), sink)
            assert finished.wait(60) and isinstance(ended[0], ending), ended
            assert engine.prefixes is not None
            assert engine.prefixes.held_rows == (frozenset({0}) if ending is Done else frozenset())
    finally:
        engine.close()
        decoder.close()


@pytest.mark.parametrize("prefix_cache_bytes", [0, 64 << 20])
def test_sequences_joining_and_leaving_the_batch_keep_their_tokens(exported: Path, prefix_cache_bytes: int) -> None:
    """Six requests through a batch of four: they join as rows free up and leave at different steps (each
    that ends hands its row to the last), on three adapters and strengths; each gets what it gets alone.
    After, every row's memory went back but the rows the prefix cache holds, when it has a budget."""
    from quiver.serve.scheduler import Done, Generation, Scheduler
    from quiver.t2t.dialog import Dialog

    cases = [(None, {}, 5), ("all", {}, 20), ("qv", {}, 9), ("all", {"all": 0.5}, 14), ("qv", {}, 3), (None, {}, 17)]
    prompts = [PROMPT, "jumps over", "the lazy dog", PROMPT, "a b c", "over the dog"]
    with Dialog.from_config(exported) as dialog:
        expected = []
        for (adapter, strengths, tokens), prompt in zip(cases, prompts):
            dialog.use(adapter, strengths)
            expected.append(dialog.query(prompt, max_new_tokens=tokens, greedy=True).new_ids)
    decoder = BatchDecoder.from_config(exported, max_batch=4, adapter_slots=2)
    try:
        engine = Scheduler(decoder, prefix_cache_bytes=prefix_cache_bytes)
        done: dict[int, Any] = {}
        finished = threading.Event()

        def sink_of(index: int) -> Any:
            def sink(event: Any) -> None:
                if isinstance(event, Done):
                    done[index] = event
                    if len(done) == len(cases):
                        finished.set()

            return sink

        for index, ((adapter, strengths, tokens), prompt) in enumerate(zip(cases, prompts)):
            ids = decoder.tokenizer.encode(prompt)
            engine.submit(Generation(ids, adapter, strengths, tokens, 0.0, 1.0, None, ()), sink_of(index))
        assert finished.wait(60)
        engine.close()
        assert [done[i].token_ids for i in range(len(cases))] == expected
        # every sequence ended: every row's cache memory went back to the OS (dropped pages read as zeros),
        # but those the prefix cache holds as their sequences left them
        held = engine.prefixes.held_rows if engine.prefixes is not None else frozenset()
        assert bool(held) == bool(prefix_cache_bytes)
        for row in range(decoder.max_batch):
            assert any(array[row].any() for array in decoder._cache.values()) == (row in held)
    finally:
        decoder.close()


def test_a_row_of_a_mixed_step_runs_its_slots_current_adapter(exported: Path) -> None:
    """A step of mixed adapters reads each row's copy of its slot: the row gives the logits it gives when
    every row runs that slot, and after the slot is refilled with another adapter, the new one's."""
    from quiver.t2t.batch import BASE_SLOT

    decoder = BatchDecoder.from_config(exported, max_batch=2, adapter_slots=1)
    try:
        ids = decoder.tokenizer.encode(PROMPT)
        cached, token = len(ids), ids[-1]

        def mixed_then_alone(slot: int) -> tuple[np.ndarray, np.ndarray]:
            decoder.prefill(0, ids, 0, slot)
            decoder.prefill(1, ids, 0, BASE_SLOT)
            mixed = decoder.decode([token, token], [cached, cached], [slot, BASE_SLOT]).copy()
            return mixed, decoder.decode([token], [cached], [slot]).copy()  # the same position written again

        first = decoder.acquire_slot("all")
        assert first is not None
        mixed_all, alone_all = mixed_then_alone(first)
        decoder.release_slot(first)
        second = decoder.acquire_slot("qv")  # the only slot, refilled
        assert second == first
        mixed_qv, alone_qv = mixed_then_alone(second)
        np.testing.assert_allclose(mixed_all[0], alone_all[0], atol=1e-4)
        np.testing.assert_allclose(mixed_qv[0], alone_qv[0], atol=1e-4)
        assert np.abs(mixed_qv[0] - mixed_all[0]).max() > 1e-2  # the row's copy followed the slot
        assert np.abs(mixed_qv[1] - mixed_all[1]).max() < 1e-4  # the base row: no adapter either time
    finally:
        decoder.close()


def test_a_step_that_fails_fails_its_batch_and_the_engine_goes_on(exported: Path) -> None:
    """A run ORT refuses (a token id beyond the vocabulary, which the HTTP layer would have refused) ends
    the requests of that batch with a typed failure; the worker lives on and serves the next one."""
    from quiver.errors import QuiverError
    from quiver.serve.scheduler import Done, Failed, Generation, Scheduler

    decoder = BatchDecoder.from_config(exported, max_batch=2)
    try:
        engine = Scheduler(decoder)
        events: list[Any] = []
        ended = threading.Semaphore(0)

        def sink(event: Any) -> None:
            if isinstance(event, (Done, Failed)):
                events.append(event)
                ended.release()

        engine.submit(Generation([10**6], None, {}, 4, 0.0, 1.0, None, ()), sink)
        assert ended.acquire(timeout=60)
        good = Generation(decoder.tokenizer.encode(PROMPT), None, {}, 4, 0.0, 1.0, None, ())
        engine.submit(good, sink)
        assert ended.acquire(timeout=60)
        engine.close()
        assert isinstance(events[0], Failed) and isinstance(events[0].error, QuiverError)
        assert isinstance(events[1], Done) and len(events[1].token_ids) == 4
    finally:
        decoder.close()


def test_the_serving_guides_example_runs(server: Running, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.support import ROOT

    guide = (ROOT / "docs" / "serve.md").read_text()
    block = guide.split("```python\n", 1)[1].split("```", 1)[0]
    code = (block.replace("http://127.0.0.1:8000/v1", f"{server.url}/v1").replace('"KEY"', f'"{KEY}"')
            .replace('"chat"', '"all"').replace('"sharp"', '"qv"'))  # fmt: skip
    exec(compile(code, "docs/serve.md", "exec"), {})
    assert "['out', 'all', 'qv']" in capsys.readouterr().out


def test_adapters_load_and_unload_while_serving_when_allowed(exported: Path, server: Running) -> None:
    body = json.dumps({"lora_name": "copy", "lora_path": str(exported.parent / "all.qsec")}).encode()
    status, _, reply = http(f"{server.url}/v1/load_lora_adapter", "POST", body)
    assert status == 404 and reply["error"]["code"] == "not_enabled"  # off unless the server was told
    running = start_server(exported, "--allow-adapter-loading", "--lora", f"start={exported.parent.parent / 'qv'}")
    try:
        client = running.client(key=None)
        load = f"{running.url}/v1/load_lora_adapter"
        request = urllib.request.Request(load, data=body, method="POST", headers={"Content-Type": "application/json"})
        assert urllib.request.urlopen(request, timeout=60).status == 200
        assert [m.id for m in client.models.list().data] == ["out", "all", "qv", "start", "copy"]
        started = [client.completions.create(model=m, prompt=PROMPT, max_tokens=8, temperature=0).choices[0]
                   .model_extra["token_ids"] for m in ("start", "qv")]  # type: ignore[index]  # fmt: skip
        assert started[0] == started[1]  # --lora NAME=PEFT_FOLDER at start: the adapter the "qv" section holds
        tokens = [client.completions.create(model=m, prompt=PROMPT, max_tokens=8, temperature=0).choices[0]
                  .model_extra["token_ids"] for m in ("copy", "all")]  # type: ignore[index]  # fmt: skip
        assert tokens[0] == tokens[1]  # the same section under another name
        for bad, code in [
            ({"lora_name": "copy", "lora_path": str(exported.parent / "qv.qsec")}, "exists"),
            ({"lora_name": "folder", "lora_path": str(exported.parent)}, "invalid_adapter"),  # no PEFT in it
            ({"lora_name": "x" * 300, "lora_path": str(exported.parent / "qv.qsec")}, "invalid_value"),
            ({"lora_name": "junk", "lora_path": str(exported)}, "invalid_adapter"),  # not a section
            ({"lora_name": "none", "lora_path": "/no/such.qsec"}, "invalid_adapter"),
        ]:
            status, _, reply = http(load, "POST", json.dumps(bad).encode(), None)
            assert status == 400 and reply["error"]["code"] == code, reply
        peft = json.dumps({"lora_name": "peft", "lora_path": str(exported.parent.parent / "all")}).encode()
        assert http(load, "POST", peft, None)[0] == 200  # the PEFT folder the "all" section was made from
        reply = client.completions.create(model="peft", prompt=PROMPT, max_tokens=8, temperature=0)
        assert reply.choices[0].model_extra is not None and reply.choices[0].model_extra["token_ids"] == tokens[1]
        unload = json.dumps({"lora_name": "copy"}).encode()
        assert http(f"{running.url}/v1/unload_lora_adapter", "POST", unload, None)[0] == 200
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="copy", prompt=PROMPT, max_tokens=2)
        assert http(f"{running.url}/v1/unload_lora_adapter", "POST", unload, None)[0] == 404
    finally:
        stop_server(running)


@pytest.fixture(scope="module")
def long_context(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    """The tiny model with a context long enough for prefixes of whole blocks, and an adapter."""
    root = tmp_path_factory.mktemp("prefixes")
    weights = tiny_decoder(root / "model", "LlamaForCausalLM")
    tiny_adapter(root / "qv", weights, 2, ["q_proj", "v_proj"], seed=2)
    config = export(root / "model", root / "long", {"qv": root / "qv"}, options=ExportOptions(context_size=320)).path
    running = start_server(config, "--api-key", KEY)
    yield running
    stop_server(running)


def _prefix_hits(running: Running) -> tuple[float, float]:
    """The prefix cache's hits and tokens spared, from /metrics."""
    text = http(f"{running.url}/metrics")[2]
    found = dict(re.findall(r"^(quiver_prefix_cache_(?:hits|reused_tokens)) (\S+)$", text, re.M))
    return float(found["quiver_prefix_cache_hits"]), float(found["quiver_prefix_cache_reused_tokens"])


def test_a_prompt_that_begins_as_a_recent_one_reuses_its_rows_and_gives_the_same_tokens(long_context: Running) -> None:
    """Prefixes kept by adapter and strengths: every reply equals `quiver t2t run`'s (no cache there), the
    hits and tokens spared counted in /metrics."""
    client = long_context.client()
    shared = "the quick brown fox jumps over the lazy dog " * 6
    first, second = shared + "and runs away", shared[:200] + "but the cat sleeps"
    length = _post(long_context, "/tokenize", {"prompt": first})[1]["count"]
    assert length > 2 * BLOCK  # whole blocks to keep

    def greedy(prompt: str, model: str = "long") -> list[int]:
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
        return list((reply.choices[0].model_extra or {})["token_ids"])

    def hits() -> tuple[float, float]:
        return _prefix_hits(long_context)

    assert greedy(first) == t2t_greedy(long_context.config, first) and hits() == (0, 0)
    assert greedy(first) == t2t_greedy(long_context.config, first)
    assert hits() == (1, length - 1)  # all of it but the token whose logits start the reply
    assert greedy(second) == t2t_greedy(long_context.config, second) and hits()[0] == 2
    assert greedy(first, "qv") == t2t_greedy(long_context.config, first, "-l", "qv")  # the base's rows: not its
    assert hits()[0] == 2
    assert greedy(first, "qv") == t2t_greedy(long_context.config, first, "-l", "qv") and hits()[0] == 3


def test_a_prompt_scored_alone_is_kept_for_the_next_request_that_begins_with_it(long_context: Running) -> None:
    """lm-eval's loglikelihood request (`echo`, `max_tokens` 0) ends as soon as its prompt is in: its rows are
    kept all the same (as its row is given back), so a generation on that context reuses them."""
    client = long_context.client()
    context = "a river runs through the valley and the town " * 6
    length = _post(long_context, "/tokenize", {"prompt": context})[1]["count"]
    before = _prefix_hits(long_context)
    client.completions.create(model="long", prompt=context, echo=True, max_tokens=0, logprobs=1)
    reply = client.completions.create(model="long", prompt=context, max_tokens=8, temperature=0)
    after = _prefix_hits(long_context)
    assert after == (before[0] + 1, before[1] + length - 1)
    assert list((reply.choices[0].model_extra or {})["token_ids"]) == t2t_greedy(long_context.config, context)


def test_a_chat_turn_reuses_the_last_turn_and_its_reply_in_place(long_context: Running) -> None:
    """A sequence that ends in the last row leaves that row as it is, held for a prompt that begins as it
    did: the next turn of a chat reuses the previous prompt and the reply tokens fed after it (all but the
    last), and its reply equals the one computed from nothing (an echo, which never reuses rows)."""
    client = long_context.client()

    def ids(text: str) -> list[int]:
        return list(_post(long_context, "/tokenize", {"prompt": text})[1]["tokens"])

    def greedy(prompt: list[int], **extra: Any) -> list[int]:
        reply = client.completions.create(model="long", prompt=prompt, max_tokens=8, temperature=0, **extra)
        return list((reply.choices[0].model_extra or {})["token_ids"])

    turn = ids("the old lighthouse keeper counted the ships that passed in the night " * 2)
    said = greedy(turn)
    following = turn + said + ids(" and the sea was calm")
    before = _prefix_hits(long_context)
    again = greedy(following)
    assert _prefix_hits(long_context) == (before[0] + 1, before[1] + len(turn) + len(said) - 1)
    assert again == greedy(following, echo=True, logprobs=1)
