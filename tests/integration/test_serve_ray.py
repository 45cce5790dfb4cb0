"""`quiver serve --ray` on a real local Ray cluster (a head and a worker node, separate processes on 127.0.0.1)
driven by the `openai` client: greedy text through Ray Serve is `quiver t2t run --greedy`'s, requests for an
adapter go to the replicas that hold it, the replicas of a node map one copy of the packed weights, and a
replica killed mid-stream fails only its own requests."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest

from quiver.backends.cpu.packed_file import FOLDER_ENV, WEIGHTS
from quiver.t2t.export import ExportOptions, export
from tests.support.serving import MALLOC_ON_HUGE_PAGES, Running, http, start_server, stop_server, t2t_greedy

pytestmark = pytest.mark.integration

RAY = str(Path(sys.executable).parent / "ray")
PROMPT = "The capital of France is"
TOKENS = 12
REPLICA_PROCESS = "ServeReplica:quiver:QuiverReplica"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _ray(*args: str) -> None:
    result = subprocess.run([RAY, *args], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


@pytest.fixture(scope="module")
def packed_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("packed-weights")


@pytest.fixture(scope="module")
def cluster(packed_folder: Path) -> Iterator[str]:
    """A head node (no CPUs for replicas) and a worker node with three: separate processes, one address,
    Ray's token authentication on (its token in the environment of every process that joins), the node's
    packed weights kept in a folder of the test's."""
    port = _free_port()
    names = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_ADDRESS", FOLDER_ENV)
    saved = {name: os.environ.get(name) for name in names}
    os.environ |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16), FOLDER_ENV: str(packed_folder)}
    _ray("start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus", "0",
         "--include-dashboard=false", "--disable-usage-stats")  # fmt: skip
    try:
        _ray("start", "--address", f"127.0.0.1:{port}", "--node-ip-address", "127.0.0.1", "--num-cpus", "3")
        os.environ["RAY_ADDRESS"] = f"127.0.0.1:{port}"  # what `quiver serve --ray` joins
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=120)
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


@pytest.fixture(scope="module")
def served(real_llms: Path, cluster: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    out = tmp_path_factory.mktemp("ray-served") / "smollm2"
    adapters = {name: real_llms / name for name in ("adapter_all", "adapter_qv")}
    export(real_llms / "smollm2", out, adapters, options=ExportOptions(context_size=256))
    # served from a folder this "node" lacks: copied from the export by --model-source, checked, then served
    config = out.parent / "node" / "smollm2" / "genie_config.json"
    running = start_server(config, "--ray", "--replicas", "2", "--max-batch", "4", "--allow-adapter-loading",
                           "--model-source", str(out))  # fmt: skip
    yield running
    stop_server(running)


def _replicas() -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if any(REPLICA_PROCESS in part for part in process.info["cmdline"] or ()):
            found.append(process)
    return found


def test_greedy_through_ray_serve_is_what_t2t_run_gives(served: Running) -> None:
    client = served.client(None)
    for model, args in (("smollm2", ()), ("adapter_all", ("-l", "adapter_all")), ("adapter_qv", ("-l", "adapter_qv"))):
        reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0)
        assert reply.choices[0].model_extra is not None
        ids = list(reply.choices[0].model_extra["token_ids"])
        assert ids == t2t_greedy(served.config, PROMPT, *args, tokens=TOKENS), model
        pieces = client.completions.create(model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0, stream=True)
        assert "".join(p.choices[0].text for p in pieces if p.choices) == reply.choices[0].text, model
    chat = client.chat.completions.create(model="adapter_all", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0)  # fmt: skip
    assert chat.choices[0].message.content and chat.usage is not None and chat.usage.completion_tokens == 4
    # log-probabilities cross from the replicas too, streamed and whole alike
    asked = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 2}
    whole = client.completions.create(**asked).choices[0].logprobs
    assert whole is not None and whole.token_logprobs is not None and len(whole.token_logprobs) == 4
    streamed = [c.choices[0].logprobs for c in client.completions.create(**asked, stream=True) if c.choices]
    # the second request may begin from the first's rows (prefix reuse: its last prompt token fed alone, a
    # product of other shapes), so the two agree to float rounding, not bit for bit
    assert [v for p in streamed if p for v in p.token_logprobs or []] == pytest.approx(whole.token_logprobs, abs=1e-4)
    echoed = {**asked, "echo": True}  # the prompt's log-probabilities cross too, with the first streamed piece
    whole = client.completions.create(**echoed).choices[0].logprobs
    streamed = [c.choices[0].logprobs for c in client.completions.create(**echoed, stream=True) if c.choices]
    assert whole is not None and [v for p in streamed if p for v in p.token_logprobs or []] == whole.token_logprobs
    assert sorted(m.id for m in client.models.list().data) == ["adapter_all", "adapter_qv", "smollm2"]
    assert http(f"{served.url}/health", key=None)[0] == 200


def test_the_replicas_of_a_node_map_one_packed_copy_of_its_weights(served: Running, packed_folder: Path) -> None:
    forms = [p for p in packed_folder.iterdir() if p.is_dir()]
    assert len(forms) == 1, forms  # made by one replica, mapped by both
    weights = str(forms[0] / WEIGHTS)
    replicas = _replicas()
    assert len(replicas) == 2
    for replica in replicas:
        assert any(m.path == weights for m in replica.memory_maps(grouped=True)), replica.pid


@pytest.mark.skipif(not MALLOC_ON_HUGE_PAGES, reason="no huge pages on request here")
def test_the_replicas_start_with_malloc_on_huge_pages(served: Running) -> None:
    """Ray starts replicas from its raylet, not from `quiver serve`: they get the restarted server's choice
    of huge pages through their runtime environment."""
    replicas = _replicas()
    assert len(replicas) == 2
    for replica in replicas:
        assert "glibc.malloc.hugetlb=1" in replica.environ().get("GLIBC_TUNABLES", "").split(":"), replica.pid


def test_a_peft_adapter_loaded_over_http_runs_on_the_replicas(served: Running, real_llms: Path) -> None:
    """vLLM's load route on Ray: one replica checks the folder, every replica it lands on registers it."""
    client = served.client(None)
    body = json.dumps({"lora_name": "peft_all", "lora_path": str(real_llms / "adapter_all")}).encode()
    status, _, text = http(f"{served.url}/v1/load_lora_adapter", "POST", body, key=None)
    assert status == 200, text
    expected = t2t_greedy(served.config, PROMPT, "-l", "adapter_all", tokens=TOKENS)  # its exported section
    for _ in range(3):  # whichever replica runs it
        reply = client.completions.create(model="peft_all", prompt=PROMPT, max_tokens=TOKENS, temperature=0)
        assert reply.choices[0].model_extra is not None
        assert list(reply.choices[0].model_extra["token_ids"]) == expected
    bad = json.dumps({"lora_name": "nothing", "lora_path": str(real_llms / "smollm2")}).encode()
    status, _, error = http(f"{served.url}/v1/load_lora_adapter", "POST", bad, key=None)
    assert status == 400 and error["error"]["code"] == "invalid_adapter", error
    assert "nothing" not in [m.id for m in client.models.list().data]
    status, _, _ = http(f"{served.url}/v1/unload_lora_adapter", "POST", b'{"lora_name": "peft_all"}', key=None)
    assert status == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="peft_all", prompt=PROMPT, max_tokens=2)


def _held(running: Running) -> dict[str, float]:
    _, _, text = http(f"{running.url}/metrics", key=None)
    return {held: float(n) for held, n in re.findall(r'quiver_adapter_requests_total\{held="(\w+)"\} (\S+)', text)}


def test_requests_for_an_adapter_land_on_a_replica_that_holds_it(served: Running) -> None:
    client = served.client(None)
    for model in ("adapter_all", "adapter_qv"):  # warm: each adapter held by some replica
        client.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0)
    time.sleep(2)  # Ray's routers learn where each adapter is held from the replicas' reports
    before = _held(served)
    models = ["adapter_all", "adapter_qv"] * 10
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda m: client.completions.create(model=m, prompt=PROMPT, max_tokens=2, temperature=0),
                      models))  # fmt: skip
    after = _held(served)
    held = after.get("yes", 0) - before.get("yes", 0)
    missed = after.get("no", 0) - before.get("no", 0)
    assert held + missed == len(models)
    assert held / len(models) >= 0.9, (held, missed)


def _stream(client: openai.OpenAI, index: int) -> dict[str, Any]:
    """A long greedy stream: how many pieces came, and the error that ended it, if one did."""
    pieces, error = 0, None
    try:
        stream = client.completions.create(model="smollm2", prompt=f"{PROMPT} {index}", max_tokens=200,
                                           temperature=0, stream=True, extra_body={"min_tokens": 200})  # fmt: skip
        for piece in stream:
            pieces += bool(piece.choices and piece.choices[0].text)
    except openai.APIError as exc:
        error = exc
    return {"pieces": pieces, "error": error}


def test_a_replica_killed_mid_stream_fails_only_its_own_requests(served: Running) -> None:
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0, timeout=120)
    replicas = _replicas()
    assert len(replicas) == 2
    with ThreadPoolExecutor(6) as pool:
        streams = [pool.submit(_stream, client, i) for i in range(6)]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and sum(r.cpu_percent(0.2) > 5 for r in replicas) < 2:
            pass  # both replicas decoding
        os.kill(replicas[0].pid, signal.SIGKILL)
        results = [s.result(timeout=180) for s in streams]
    failed = [r for r in results if r["error"] is not None]
    finished = [r for r in results if r["error"] is None]
    assert failed and finished, results  # the killed replica's streams fail, the other's run to the end
    assert all(r["pieces"] == 200 for r in finished)
    assert all("replica" in str(r["error"]) for r in failed), [str(r["error"]) for r in failed]
    for _ in range(4):  # later requests succeed (the other replica, then the one Ray restarts)
        reply = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=4, temperature=0)
        assert reply.usage is not None and reply.usage.completion_tokens == 4


def test_bad_options_are_one_line(tmp_path: Path) -> None:
    from quiver.errors import QuiverError
    from quiver.serve.ray import RayOptions

    with pytest.raises(QuiverError, match="unknown Quiver option 'replcas'"):
        RayOptions.from_args({"config": "x.json", "replcas": 2})
    with pytest.raises(QuiverError, match="need 'config'"):
        RayOptions.from_args({"replicas": 2})
    missing = tmp_path / "genie_config.json"  # checked before any cluster starts
    result = subprocess.run([sys.executable, "-m", "quiver", "serve", "-c", str(missing), "--ray"],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode != 0 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "genie_config.json" in result.stderr and "Traceback" not in result.stderr


def test_the_documented_serve_config_is_one_ray_accepts(tmp_path: Path) -> None:
    """docs/ray/serve-config.yaml parses as Ray Serve's own schema, and its args build the application."""
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from quiver.serve.ray import RayOptions, build

    document = yaml.safe_load((Path(__file__).parents[2] / "docs" / "ray" / "serve-config.yaml").read_text())
    schema = ServeDeploySchema.model_validate(document)
    (app,) = schema.applications
    assert app.import_path == "quiver.serve.ray:build"
    args = dict(app.args) | {"config": str(tmp_path / "genie_config.json"), "loras": {}}
    options = RayOptions.from_args(args)
    assert (options.min_replicas, options.max_replicas, options.max_batch, options.max_loras) == (1, 3, 8, 8)
    build(args)  # binds the two deployments with these options (nothing deployed)
