"""`quiver serve` against hostile clients: raw sockets on 127.0.0.1, the server in its own process (its
memory read from /proc), with each of uvicorn's HTTP parsers. Every loop is bounded in count and time."""

from __future__ import annotations

import json
import signal
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from quiver.t2t.export import ExportOptions, export
from tests.support.serving import (
    KEY,
    Running,
    address,
    flood_head,
    hold_unfinished_heads,
    http,
    reply_of,
    rss_mb,
    start_server,
    stop_server,
)
from tests.support.tiny_llm import tiny_adapter, tiny_decoder

PARSERS = ["h11", "httptools"]
HEADER_TIMEOUT = 2.0
BODY_TIMEOUT = 3.0


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, np.ndarray]:
    return tiny_decoder(tmp_path_factory.mktemp("hostile") / "model", "LlamaForCausalLM")


@pytest.fixture(scope="module")
def exported(weights: dict[str, np.ndarray], tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("exported")
    tiny_adapter(root / "qv", weights, 2, ["q_proj", "v_proj"], seed=2)
    model = next(iter(tmp_path_factory.getbasetemp().glob("hostile*/model")))
    return export(model, root / "out", {"qv": root / "qv"}, options=ExportOptions(context_size=64)).path


@pytest.fixture(scope="module", params=PARSERS)
def server(request: pytest.FixtureRequest, exported: Path) -> Iterator[Running]:
    running = start_server(exported, "--api-key", KEY, "--allow-adapter-loading", "--http", request.param,
                           "--header-timeout", str(HEADER_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT))  # fmt: skip
    yield running
    stop_server(running)


@pytest.mark.parametrize(
    ("first", "line", "status"),
    [
        (b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n", b"X-A: b\r\n", 431),  # headers that never end
        (b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: ", b"b" * 1024, 431),  # one endless header
        (b"GET /", b"a" * 1024, 414),  # an endless URL
    ],
    ids=["many-headers", "one-header", "url"],
)
def test_64_mib_of_request_head_without_the_key_costs_under_16_mb(
    server: Running, first: bytes, line: bytes, status: int
) -> None:
    before = rss_mb(server.process.pid)
    reply, sent = flood_head(server, first, line, 64 << 20)
    grown = rss_mb(server.process.pid) - before
    assert reply.startswith(f"HTTP/1.1 {status}".encode()), reply[:200]
    assert sent < 64 << 20  # the server stopped reading long before
    assert grown < 16, f"{grown:.1f} MB"
    assert http(f"{server.url}/health", key=None)[0] == 200


def test_connections_holding_unfinished_heads_are_closed_and_a_key_holder_is_served_meanwhile(
    server: Running,
) -> None:
    hold_unfinished_heads(server, 2000, HEADER_TIMEOUT)


def test_bodies_that_never_finish_are_bounded_in_memory_and_time(server: Running) -> None:
    before = rss_mb(server.process.pid)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {4 << 20}\r\n\r\n"
    ).encode()
    socks = []
    try:
        for _ in range(150):  # each sends 4 MiB - 1 byte of its body, then stops
            sock = socket.create_connection(address(server), timeout=30)
            sock.sendall(head)
            socks.append(sock)
        payload = b" " * ((4 << 20) - 1)
        for sock in socks:
            sock.setblocking(False)
            try:
                sock.send(payload)  # what the server takes now; it may stop reading
            except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                pass
        peak = rss_mb(server.process.pid) - before
        replies = []
        for sock in socks:
            sock.setblocking(True)
            replies.append(reply_of(sock, BODY_TIMEOUT + 5))
    finally:
        for sock in socks:
            sock.close()
    # 32 MiB for all bodies being read, plus the parser's buffer per connection (uvicorn pauses reading at
    # 64 KiB, after a read of up to 256 KiB: ~0.6 MB each, 90 MB for 150): not the 600 MB they sent
    assert peak < 160, f"{peak:.0f} MB while 150 bodies were held"
    statuses = {r[9:12] for r in replies if r}
    assert statuses <= {b"408", b"503"} and statuses, statuses
    time.sleep(0.5)
    after = rss_mb(server.process.pid) - before
    assert after < 40, f"{after:.0f} MB kept after the clients left"
    assert http(f"{server.url}/health", key=None)[0] == 200


@pytest.mark.parametrize("parser", PARSERS)
def test_a_server_with_an_unfinished_body_stops_on_sigterm(exported: Path, parser: str) -> None:
    running = start_server(exported, "--api-key", KEY, "--http", parser)
    with socket.create_connection(address(running), timeout=30) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{".encode())  # fmt: skip
        time.sleep(0.3)
        start = time.monotonic()
        running.process.send_signal(signal.SIGTERM)
        try:
            code = running.process.wait(15)
        except Exception:
            running.process.kill()
            raise
    assert code == 0 and time.monotonic() - start < 10


def _poisoned(folder: Path, weights: dict[str, np.ndarray], value: float, alpha: float = 4.0) -> Path:
    """A PEFT adapter of the tiny model on q/v whose weights are all `value`."""
    tiny_adapter(folder, weights, 2, ["q_proj", "v_proj"], seed=5)
    tensors = {}
    for name, weight in weights.items():
        if name.endswith(("q_proj.weight", "v_proj.weight")):
            module = name.removesuffix(".weight")
            tensors[f"base_model.model.{module}.lora_A.weight"] = np.full((2, weight.shape[1]), value, np.float32)
            tensors[f"base_model.model.{module}.lora_B.weight"] = np.full((weight.shape[0], 2), value, np.float32)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps(config | {"lora_alpha": alpha}))
    return folder


def _greedy(running: Running, model: str, extra: dict[str, object] | None = None) -> list[int]:
    reply = running.client().completions.create(
        model=model, prompt="the quick brown fox", max_tokens=12, temperature=0, extra_body=extra or {}
    )
    assert reply.choices[0].model_extra is not None
    return list(reply.choices[0].model_extra["token_ids"])


def test_a_request_with_an_absurd_strength_or_a_poisoned_adapter_ends_alone(
    exported: Path, weights: dict[str, np.ndarray], tmp_path: Path
) -> None:
    running = start_server(exported, "--api-key", KEY, "--allow-adapter-loading", "--max-batch", "4")
    try:
        solo = {model: _greedy(running, model) for model in ("out", "qv")}
        for strength in (1e300, 3.5e38, 1e4):  # refused before they reach the engine
            status, _, body = http(f"{running.url}/v1/completions", "POST", json.dumps(
                {"model": "qv", "prompt": "a", "max_tokens": 2, "lora": {"qv": strength}}).encode())  # fmt: skip
            assert status == 400 and body["error"]["param"] == "lora", body
        for value, alpha in ((float("nan"), 4.0), (0.1, 1e308)):  # NaN weights; lora_alpha / r overflowing
            folder = _poisoned(tmp_path / f"bad{alpha}", weights, value, alpha)
            status, _, body = http(f"{running.url}/v1/load_lora_adapter", "POST",
                                   json.dumps({"lora_name": "bad", "lora_path": str(folder)}).encode())  # fmt: skip
            assert status == 400 and body["error"]["code"] == "invalid_adapter", body
            assert "bad" not in [m.id for m in running.client().models.list().data]
        # weights finite but overflowing the step: that request ends alone (the engine's fault, 500); three
        # greedy streams decoded beside it keep exactly their solo tokens
        huge = _poisoned(tmp_path / "huge", weights, 1e30)
        assert http(f"{running.url}/v1/load_lora_adapter", "POST",
                    json.dumps({"lora_name": "huge", "lora_path": str(huge)}).encode())[0] == 200  # fmt: skip
        with ThreadPoolExecutor(4) as pool:
            streams = [pool.submit(_greedy, running, model) for model in ("out", "qv", "out")]
            poisoned = pool.submit(http, f"{running.url}/v1/completions", "POST",
                                   json.dumps({"model": "huge", "prompt": "a", "max_tokens": 8}).encode())  # fmt: skip
            assert [f.result() for f in streams] == [solo["out"], solo["qv"], solo["out"]]
            status, _, body = poisoned.result()
        assert status == 500 and body["error"]["code"] == "engine_fault", body
    finally:
        stop_server(running)


def test_an_adapter_file_is_checked_from_its_header_before_its_data_is_read(
    server: Running, weights: dict[str, np.ndarray], tmp_path: Path
) -> None:
    """A lone 256 MiB lora_A (no lora_B): refused from the safetensors header, nothing of it read."""
    folder = tmp_path / "lopsided"
    tiny_adapter(folder, weights, 2, ["q_proj"], seed=3)
    module = next(n for n in weights if n.endswith("q_proj.weight")).removesuffix(".weight")
    save_file({f"base_model.model.{module}.lora_A.weight": np.zeros((2, 32 << 20), np.float32)},
              str(folder / "adapter_model.safetensors"))  # fmt: skip
    before = rss_mb(server.process.pid)
    status, _, body = http(f"{server.url}/v1/load_lora_adapter", "POST",
                           json.dumps({"lora_name": "lopsided", "lora_path": str(folder)}).encode())  # fmt: skip
    assert status == 400 and body["error"]["code"] == "invalid_adapter", body
    assert rss_mb(server.process.pid) - before < 32


def test_a_4_mib_prompt_or_a_huge_chat_is_refused_before_any_work_and_stalls_no_stream(server: Running) -> None:
    gaps: list[float] = []

    def stream() -> None:
        pieces = server.client().completions.create(
            model="out", prompt="the quick brown fox", max_tokens=48, temperature=0, stream=True,
            extra_body={"min_tokens": 48},
        )  # fmt: skip
        last = time.monotonic()
        for _ in pieces:
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(stream)
        time.sleep(0.05)
        for body in (
            {"model": "out", "prompt": "x" * ((4 << 20) - 200), "max_tokens": 1},  # the body just under 4 MiB
            {"model": "out", "prompt": [1] * 1_000_000, "max_tokens": 1},
            {"model": "out", "messages": [{"role": "user", "content": "hi"}] * 118_000, "max_tokens": 1},
        ):
            route = "chat/completions" if "messages" in body else "completions"
            status, _, reply = http(f"{server.url}/v1/{route}", "POST", json.dumps(body).encode())
            assert status == 400 and reply["error"]["code"] == "context_length_exceeded", reply
        running.result(timeout=60)
    assert max(gaps[1:]) < 0.2, max(gaps[1:])


@pytest.mark.parametrize("text", ["\ud800", "a\u0000b"], ids=["lone-surrogate", "nul"])
def test_a_prompt_that_is_not_text_is_a_400_not_a_500(server: Running, text: str) -> None:
    body = json.dumps({"model": "out", "prompt": text, "max_tokens": 1}).encode()  # JSON escapes them
    status, _, reply = http(f"{server.url}/v1/completions", "POST", body)
    assert status == 400 and reply["error"]["param"] == "prompt", reply


def test_a_null_field_is_an_absent_one(server: Running) -> None:
    body = {"model": "out", "prompt": "the quick brown fox", "max_completion_tokens": None, "max_tokens": 3,
            "temperature": None, "stop": None, "seed": None, "min_tokens": 3}  # fmt: skip
    status, _, reply = http(f"{server.url}/v1/completions", "POST", json.dumps(body).encode())
    assert status == 200 and reply["usage"]["completion_tokens"] == 3, reply  # max_tokens holds


def test_adapter_paths_get_one_answer_whatever_lies_there_and_bad_strings_are_400s(
    server: Running, exported: Path
) -> None:
    """The client learns nothing of the server's files: a missing path, a folder, a regular file, a device
    and /proc/self/mem all get the same 400; a NUL, a 100k-character path, a lone surrogate get 400s."""
    messages = set()
    for path in ("/no/such/adapter", "/etc", "/etc/passwd", "/dev/zero", "/proc/self/mem", str(exported)):
        body = json.dumps({"lora_name": "probe", "lora_path": path}).encode()
        status, _, reply = http(f"{server.url}/v1/load_lora_adapter", "POST", body)
        assert status == 400 and reply["error"]["code"] == "invalid_adapter", (path, reply)
        messages.add(reply["error"]["message"])
    assert len(messages) == 1, messages
    for bad in ({"lora_name": "x", "lora_path": "/tmp/a\u0000b"}, {"lora_name": "x", "lora_path": "/" + "a" * 100_000},
                {"lora_name": "\ud800", "lora_path": "/tmp"}, {"lora_name": "x", "lora_path": "\udfff"}):  # fmt: skip
        status, headers, reply = http(f"{server.url}/v1/load_lora_adapter", "POST", json.dumps(bad).encode())
        assert status == 400 and "json" in headers.get("Content-Type", ""), reply
    status, headers, reply = http(f"{server.url}/v1/completions", "POST",
                                  json.dumps({"model": "\ud800", "prompt": "a"}).encode())  # fmt: skip
    assert status == 404 and reply["error"]["param"] == "model", reply  # OpenAI's error object, not plain text


def test_a_request_whose_client_hung_up_while_queued_gives_its_place_back(exported: Path) -> None:
    from quiver.serve.scheduler import Done, Generation, Scheduler
    from quiver.t2t.batch import BatchDecoder

    decoder = BatchDecoder.from_config(exported, max_batch=1)  # one running, then a queue of one
    try:
        ids = decoder.tokenizer.encode("the quick brown fox")
        long = Generation(ids, None, {}, 40, 0.0, 1.0, None, (), min_tokens=40)
        engine = Scheduler(decoder, max_queue=1)
        ended: list[Done] = []
        sink = lambda event: ended.append(event) if isinstance(event, Done) else None  # noqa: E731
        engine.submit(long, sink)
        deadline = time.monotonic() + 10
        while engine.waiting and time.monotonic() < deadline:
            time.sleep(0.01)
        gone = engine.submit(long, sink)
        engine.cancel(gone)  # its client hung up while it waited
        engine.submit(long, sink)  # takes the place back: no 429
        deadline = time.monotonic() + 60
        while len(ended) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        reasons = sorted(done.finish_reason for done in ended)
        assert reasons == ["cancelled", "length", "length"], reasons
        engine.close()
    finally:
        decoder.close()


def test_a_web_page_can_neither_post_simple_requests_nor_rebind_a_name(exported: Path) -> None:
    """The keyless loopback default: a cross-site form POST (text/plain) is a 415 before anything runs, a
    rebound Host a 400; CORS answers only the origins the operator names."""
    running = start_server(exported, "--allow-adapter-loading", "--allowed-origins", "https://app.example")
    try:
        host, port = address(running)
        for headers, status in (
            ({"Content-Type": "text/plain"}, 415),  # what a page may send without a preflight
            ({"Content-Type": "application/x-www-form-urlencoded"}, 415),
            ({"Content-Type": "application/json", "Host": "evil.example"}, 400),  # DNS rebinding
            ({"Content-Type": "application/json", "Host": f"localhost:{port}"}, 200),  # loopback's own name
        ):
            unload = json.dumps({"lora_name": "qv"}).encode()
            request = urllib.request.Request(f"{running.url}/v1/unload_lora_adapter", data=unload, method="POST",
                                             headers=headers)  # fmt: skip
            try:
                with urllib.request.urlopen(request, timeout=30) as reply:
                    got = reply.status
            except urllib.error.HTTPError as error:
                got = error.code
            assert got == status, (headers, got)
        assert [m.id for m in running.client(None).models.list().data] == ["out"]  # the last request alone ran
        for origin, allowed in (("https://app.example", True), ("https://evil.example", False)):
            preflight = urllib.request.Request(f"{running.url}/v1/completions", method="OPTIONS", headers={
                "Origin": origin, "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "content-type"})  # fmt: skip
            try:
                with urllib.request.urlopen(preflight, timeout=30) as reply:
                    granted = reply.headers.get("access-control-allow-origin")
            except urllib.error.HTTPError as error:
                granted = error.headers.get("access-control-allow-origin")
            assert (granted == origin) is allowed, (origin, granted)
    finally:
        stop_server(running)


def test_a_thousand_adapter_loads_and_unloads_leave_memory_as_it_was_and_loads_are_capped(exported: Path) -> None:
    section = exported.parent / "qv.qsec"
    running = start_server(exported, "--api-key", KEY, "--allow-adapter-loading", "--max-loaded-adapters", "4")
    try:

        def call(route: str, body: dict[str, str]) -> tuple[int, Any]:
            status, _, reply = http(f"{running.url}/v1/{route}", "POST", json.dumps(body).encode())
            return status, reply

        for i in range(30):  # the allocator's own first growth, before the measured loads
            assert call("load_lora_adapter", {"lora_name": f"w{i}", "lora_path": str(section)})[0] == 200
            assert call("unload_lora_adapter", {"lora_name": f"w{i}"})[0] == 200
        before = rss_mb(running.process.pid)
        for i in range(1000):
            assert call("load_lora_adapter", {"lora_name": f"a{i}", "lora_path": str(section)})[0] == 200
            assert call("unload_lora_adapter", {"lora_name": f"a{i}"})[0] == 200
        grown = rss_mb(running.process.pid) - before
        assert grown < 10, f"{grown:.1f} MB"
        # the config's adapter (qv) and three loaded make four: a fifth is refused, saying why
        for i in range(3):
            assert call("load_lora_adapter", {"lora_name": f"b{i}", "lora_path": str(section)})[0] == 200
        status, reply = call("load_lora_adapter", {"lora_name": "b3", "lora_path": str(section)})
        assert status == 400 and reply["error"]["code"] == "too_many_adapters", reply
    finally:
        stop_server(running)


def test_a_request_waiting_for_an_adapter_slot_holds_back_no_base_model_request(
    exported: Path, weights: dict[str, np.ndarray], tmp_path: Path
) -> None:
    from quiver.serve.scheduler import Done, Generation, Scheduler
    from quiver.t2t.batch import BatchDecoder

    tiny_adapter(tmp_path / "other", weights, 2, ["q_proj", "v_proj"], seed=9)
    decoder = BatchDecoder.from_config(exported, max_batch=4, adapter_slots=1)  # one adapter slot
    try:
        decoder.add_adapter("other", tmp_path / "other")
        ids = decoder.tokenizer.encode("the quick brown fox")
        engine = Scheduler(decoder, max_queue=8)
        order: list[str] = []

        def request(adapter: str | None, tokens: int) -> None:
            def sink(event: object) -> None:
                if isinstance(event, Done):
                    order.append(adapter or "base")

            engine.submit(Generation(ids, adapter, {}, tokens, 0.0, 1.0, None, (), min_tokens=tokens), sink)

        request("qv", 50)  # takes the one slot for 50 steps
        request("other", 4)  # needs the slot: held until "qv" ends
        request(None, 2)  # the base model needs no slot: it runs beside "qv" at once
        deadline = time.monotonic() + 60
        while len(order) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert order == ["base", "qv", "other"], order
        engine.close()
    finally:
        decoder.close()
