"""`quiver serve` on real weights (SmolLM2 and its PEFT adapters, tests/real/make_llms.py): many requests on
many adapters decoded in one batch give exactly what one request alone gives, and what transformers gives."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from quiver.t2t.export import ExportOptions, export
from quiver.testing.adapter_family import reseeded_adapters
from tests.support.serving import Running, http, start_server, stop_server, t2t_greedy

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,", "The river"]
TOKENS = 24


@pytest.fixture(scope="module")
def adapters(real_llms: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Eight adapters: the corpus's two and six more like them (other seeded weights)."""
    root = tmp_path_factory.mktemp("adapters")
    found = {name: real_llms / name for name in ("adapter_all", "adapter_qv")}
    found |= reseeded_adapters(real_llms / "adapter_all", root, 3, "all")
    found |= reseeded_adapters(real_llms / "adapter_qv", root, 3, "qv")
    return found


@pytest.fixture(scope="module")
def server(real_llms: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    out = tmp_path_factory.mktemp("served") / "smollm2"
    config = export(real_llms / "smollm2", out, adapters, options=ExportOptions(context_size=256)).path
    running = start_server(config, "--max-batch", "8", "--allow-adapter-loading")
    yield running
    stop_server(running)


def _steps_by_rows(running: Running) -> dict[int, float]:
    _, _, text = http(f"{running.url}/metrics")
    return {int(rows): float(n) for rows, n in re.findall(r'quiver_decode_steps_total\{rows="(\d+)"\} (\S+)', text)}


def _completion(running: Running, model: str, prompt: str, stream: bool, **extra: Any) -> list[int] | str:
    client = running.client()
    if not stream:
        reply = client.completions.create(
            model=model, prompt=prompt, max_tokens=TOKENS, temperature=0, extra_body=extra
        )
        assert reply.choices[0].model_extra is not None
        return list(reply.choices[0].model_extra["token_ids"])
    pieces = client.completions.create(
        model=model, prompt=prompt, max_tokens=TOKENS, temperature=0, stream=True, extra_body=extra
    )
    return "".join(p.choices[0].text for p in pieces if p.choices)


def test_eight_requests_on_eight_adapters_in_one_batch_are_what_t2t_run_gives(
    server: Running, adapters: dict[str, Path]
) -> None:
    names = list(adapters)
    assert len(names) == 8
    jobs = [(name, PROMPTS[i % len(PROMPTS)], i % 2 == 1) for i, name in enumerate(names)]
    before = _steps_by_rows(server)
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: _completion(server, *job), jobs))
    after = _steps_by_rows(server)
    assert after.get(8, 0) > before.get(8, 0), after  # all eight were decoded together
    for (name, prompt, streamed), result in zip(jobs, got):
        expected = t2t_greedy(server.config, prompt, "-l", name, tokens=TOKENS)
        if streamed:  # a stream carries text: the text of those tokens
            assert result == _detokenized(server, expected), name
        else:
            assert result == expected, name


def _detokenized(running: Running, ids: list[int]) -> str:
    from quiver.t2t.tokenizer import TextTokenizer

    return TextTokenizer(running.config.parent / "tokenizer.json").decode(ids)


def test_a_mixed_batch_equals_transformers_and_peft(server: Running, real_llms: Path) -> None:
    """Base, two adapters and one at half strength, three prompts each, all at once: transformers' and
    PEFT's own greedy tokens (tests/real/make_llms.py), 32 each with the end of sequence kept out."""
    expected = json.loads((real_llms / "expected.json").read_text())
    base = server.config.parent.name
    cases = [(base, {}, "base"), ("adapter_all", {}, "adapter_all"), ("adapter_qv", {}, "adapter_qv"),
             ("adapter_all", {"lora": {"adapter_all": 0.5}}, "adapter_all@0.5")]  # fmt: skip
    jobs = [(model, extra, key, i) for model, extra, key in cases for i in range(len(expected["prompt_ids"]))]
    client = server.client()

    def run(job: tuple[str, dict[str, Any], str, int]) -> list[int]:
        model, extra, _, i = job
        reply = client.completions.create(model=model, prompt=expected["prompt_ids"][i], max_tokens=32, temperature=0,
                                          extra_body={**extra, "min_tokens": 32})  # fmt: skip
        assert reply.choices[0].model_extra is not None
        return list(reply.choices[0].model_extra["token_ids"])

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(run, jobs))
    for (_, _, key, i), tokens in zip(jobs, got):
        assert tokens == expected[key][i], (key, i)


def test_echoed_prompt_logprobs_and_the_repetition_penalty_equal_transformers(server: Running, real_llms: Path) -> None:
    """lm-eval's loglikelihood request (`echo`, `max_tokens` 0, `logprobs` 1): each prompt token's
    log-probability within 2e-3 of transformers' log-softmax; `repetition_penalty` greedy: transformers'
    `generate(repetition_penalty=...)` tokens (tests/real/make_llms.py)."""
    expected = json.loads((real_llms / "expected.json").read_text())
    base, client = server.config.parent.name, server.client()
    penalty = expected["repetition_penalty"]
    for ids, logprobs, tokens in zip(expected["prompt_ids"], expected["prompt_logprobs"], penalty["tokens"]):
        scored = client.completions.create(model=base, prompt=ids, echo=True, max_tokens=0, logprobs=1)
        assert scored.choices[0].logprobs is not None
        values = scored.choices[0].logprobs.token_logprobs or []
        assert len(values) == len(ids) and values[0] is None
        np.testing.assert_allclose(values[1:], logprobs, atol=2e-3)
        extra = {"repetition_penalty": penalty["penalty"], "min_tokens": 32}
        reply = client.completions.create(model=base, prompt=ids, max_tokens=32, temperature=0, extra_body=extra)
        assert reply.choices[0].model_extra is not None and reply.choices[0].model_extra["token_ids"] == tokens


SCHEMAS = [  # enums, nested arrays, bounded numbers, nested objects
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                               "maxItems": 3}},
     "required": ["color", "tags"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "integer", "minimum": -9, "maximum": 9}}}},
     "required": ["matrix"]},
    {"type": "object", "properties": {"price": {"type": "number", "minimum": 0, "maximum": 1000},
                                      "ok": {"type": "boolean"}, "kind": {"enum": [1, 2, "three"]}},
     "required": ["price", "ok", "kind"]},
    {"type": "object", "properties": {"person": {"type": "object", "properties": {
        "first": {"type": "string", "maxLength": 12},
        "langs": {"type": "array", "items": {"enum": ["en", "fr", "de"]}, "maxItems": 3}},
        "required": ["first", "langs"]}}, "required": ["person"]},
]  # fmt: skip


def test_json_schema_replies_of_the_real_model_validate_fifty_of_fifty(server: Running) -> None:
    """50 sampled chat replies (10 per schema, each its own seed) parse as JSON and validate against their
    schema (the `jsonschema` library's validator, not Quiver's), all ending by themselves."""
    import jsonschema

    client, base = server.client(), server.config.parent.name

    def reply(index: int) -> tuple[dict[str, Any], Any, str]:
        schema = SCHEMAS[index % len(SCHEMAS)]
        form = {"type": "json_schema", "json_schema": {"name": "record", "schema": schema}}
        done = client.chat.completions.create(
            model=base, messages=[{"role": "user", "content": "Give me an example record as JSON."}], max_tokens=200,
            temperature=1.0, seed=index, response_format=form,  # type: ignore[arg-type]
        )  # fmt: skip
        return schema, json.loads(done.choices[0].message.content or ""), done.choices[0].finish_reason

    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(reply, range(50)))
    for schema, value, finish in replies:
        jsonschema.validate(value, schema)
        assert finish == "stop"


def test_a_peft_adapter_loaded_while_streams_run_serves_the_next_request(server: Running, real_llms: Path) -> None:
    """vLLM's load route with a PEFT folder (the corpus's adapter_qv, under another name): it fills a slot
    straight from PEFT's tensors, and gives what its exported section gives."""
    jobs = [(name, PROMPTS[i % len(PROMPTS)], True) for i, name in enumerate(["adapter_all", "all_0", "qv_1"] * 2)]
    with ThreadPoolExecutor(len(jobs) + 1) as pool:
        running = [pool.submit(_completion, server, *job) for job in jobs]
        body = json.dumps({"lora_name": "late", "lora_path": str(real_llms / "adapter_qv")}).encode()
        status, _, text = http(f"{server.url}/v1/load_lora_adapter", "POST", body)
        assert status == 200, text
        late = _completion(server, "late", PROMPTS[0], False)
        streamed = [f.result(timeout=300) for f in running]
    assert late == t2t_greedy(server.config, PROMPTS[0], "-l", "adapter_qv", tokens=TOKENS)
    assert all(isinstance(s, str) and s for s in streamed)
    status, _, _ = http(f"{server.url}/v1/unload_lora_adapter", "POST", json.dumps({"lora_name": "late"}).encode())
    assert status == 200


def test_an_onnxruntime_genai_export_is_served_with_genais_own_greedy_tokens(real_llms: Path, tmp_path: Path) -> None:
    """A decoder packed as genai's builder exported it: three concurrent requests, each row stepped on its
    own cache, give genai's own greedy tokens; loading an adapter is refused, saying why."""
    from quiver.t2t.onnx_decoder import import_decoder

    expected = json.loads((real_llms / "expected.json").read_text())
    theirs = json.loads((real_llms / "genai_expected.json").read_text())["genai_tiny"]
    config = import_decoder(real_llms / "genai_tiny", tmp_path / "packed", context_size=256).path
    running = start_server(config, "--max-batch", "4", "--allow-adapter-loading")
    try:
        client = running.client()

        def complete(prompt: str) -> list[int]:
            reply = client.completions.create(model="packed", prompt=prompt, max_tokens=32, temperature=0)
            assert reply.choices[0].model_extra is not None
            return list(reply.choices[0].model_extra["token_ids"])

        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(complete, expected["prompts"]))
        for ours, generated in zip(got, theirs):
            assert ours[: len(generated)] == generated
        load = {"lora_name": "x", "lora_path": str(real_llms / "adapter_qv")}
        status, _, body = http(f"{running.url}/v1/load_lora_adapter", "POST", json.dumps(load).encode())
        assert status == 400 and body["error"]["code"] == "invalid_adapter", body
    finally:
        stop_server(running)
