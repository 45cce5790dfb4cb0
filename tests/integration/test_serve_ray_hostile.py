"""`quiver serve --ray` against hostile clients, on the local Ray cluster it starts itself (no $RAY_ADDRESS):
its HTTP front holds `quiver serve`'s limits on heads and connections before the key, it answers 429 past
what the replicas hold, and the cluster listens on loopback alone but for each replica's gRPC port, which
refuses a caller without the cluster's token. Raw sockets on 127.0.0.1, every loop bounded in count and time."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import psutil
import pytest

from quiver.t2t.export import ExportOptions, export
from tests.support.serving import (
    KEY,
    Running,
    flood_head,
    hold_unfinished_heads,
    http,
    rss_mb,
    start_server,
    stop_server,
)
from tests.support.tiny_llm import tiny_decoder

pytestmark = pytest.mark.integration

HEADER_TIMEOUT = 2.0
MAX_BATCH, MAX_QUEUE = 1, 2  # one replica: it holds 3 requests, one decoding and two waiting
LONG = 200  # tokens each request decodes (min_tokens): long enough for every request to arrive meanwhile


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    root = tmp_path_factory.mktemp("ray-hostile")
    tiny_decoder(root / "model")
    config = export(root / "model", root / "out", {}, options=ExportOptions(context_size=256)).path
    # a cluster of its own: nothing of a cluster these tests' other modules start
    env = {name: value for name, value in os.environ.items() if not name.startswith("RAY_")}
    running = start_server(config, "--ray", "--replicas", "1", "--replica-cpus", "1", "--max-batch", str(MAX_BATCH),
                           "--max-queue", str(MAX_QUEUE), "--api-key", KEY, "--http", "httptools",
                           "--header-timeout", str(HEADER_TIMEOUT), env=env)  # fmt: skip
    yield running
    stop_server(running)
    assert not _cluster(running), "the local cluster outlived its server"


def _cluster(running: Running) -> list[psutil.Process]:
    try:
        return psutil.Process(running.process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_64_mib_of_request_head_without_the_key_costs_the_front_under_16_mb(served: Running) -> None:
    before = rss_mb(served.process.pid)
    reply, sent = flood_head(served, b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n", b"X-A: b\r\n", 64 << 20)
    assert reply.startswith(b"HTTP/1.1 431"), reply[:200]
    assert sent < 64 << 20
    assert rss_mb(served.process.pid) - before < 16
    assert http(f"{served.url}/health", key=None)[0] == 200


def test_unfinished_heads_are_closed_and_a_key_holder_is_served_meanwhile(served: Running) -> None:
    hold_unfinished_heads(served, 2000, HEADER_TIMEOUT)


def test_requests_past_what_the_replicas_hold_are_answered_429(served: Running) -> None:
    client = served.client()

    def complete(_: int) -> int | str:
        try:
            reply = client.completions.create(model="out", prompt="a", max_tokens=LONG,
                                              extra_body={"min_tokens": LONG})  # fmt: skip
        except openai.RateLimitError:
            return 429
        return len(reply.choices[0].text) and int(reply.usage.completion_tokens)  # type: ignore[union-attr]

    sent = 4 * (MAX_BATCH + MAX_QUEUE)
    with ThreadPoolExecutor(sent) as pool:
        results = list(pool.map(complete, range(sent)))
    answered = [r for r in results if r != 429]
    # those taken decode whole; past the replica's rows and queue the rest are refused at once
    assert answered and all(r == LONG for r in answered), results
    assert results.count(429) >= sent - 2 * (MAX_BATCH + MAX_QUEUE), results
    # sampled from a random model, so the end of sequence may come first: min_tokens keeps it out
    after = client.completions.create(model="out", prompt="a", max_tokens=2, extra_body={"min_tokens": 2})
    assert after.usage is not None and after.usage.completion_tokens == 2


def test_the_local_cluster_listens_on_loopback_but_for_token_guarded_replica_ports(served: Running) -> None:
    beyond: list[tuple[str, int, str]] = []
    for process in [psutil.Process(served.process.pid), *_cluster(served)]:
        try:
            listening = [c for c in process.net_connections("inet") if c.status == psutil.CONN_LISTEN]
            name = " ".join(process.cmdline())
        except psutil.NoSuchProcess:
            continue
        for connection in listening:
            host = ipaddress.ip_address(connection.laddr.ip)
            mapped = getattr(host, "ipv4_mapped", None)
            if not (mapped or host).is_loopback:
                beyond.append((connection.laddr.ip, connection.laddr.port, name))
    # Ray binds each replica's gRPC server (calls between deployments) on every interface whatever the
    # node's address: it answers no caller without the token
    assert all("ServeReplica" in name for _, _, name in beyond), beyond
    assert beyond, "the replica's gRPC port was expected beyond loopback: check what this Ray binds"
    for _, port, _ in beyond:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/ray.serve.ASGIService/HandleRequest")
            with pytest.raises(grpc.RpcError) as refused:
                call(b"", timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    # and the front's own port: the one the server printed, on the loopback address it was given
    assert served.url.startswith("http://127.0.0.1:")
