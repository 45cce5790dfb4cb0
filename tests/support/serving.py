"""Running `quiver serve` in tests: a real server process on 127.0.0.1, reached by the `openai` client and
plain HTTP, every wait bounded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai

from quiver import portable

KEY = "serve-test-key"
# whether a server these tests start runs with glibc's malloc on huge pages (its restart's, or the tests'
# own environment's choice): what the huge-page tests check, where this machine gives them on request
MALLOC_ON_HUGE_PAGES = "glibc.malloc.hugetlb=1" in (portable.huge_page_tunables(os.environ) or "").split(":")


@dataclass
class Running:
    """A server process, its dialog config and its address."""

    config: Path
    url: str
    process: subprocess.Popen[str]

    def client(self, key: str | None = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key or "none", max_retries=0, timeout=60)


def start_server(config: Path, *options: str) -> Running:
    command = [sys.executable, "-m", "quiver", "serve", "-c", str(config), "--port", "0", *options]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None
    line = process.stdout.readline()
    if "http://" not in line:
        process.kill()
        raise AssertionError(f"the server did not start: {line}{process.communicate(timeout=30)[1]}")
    url = line.split("http://", 1)[1].split("/v1", 1)[0]
    return Running(config, f"http://{url}", process)


def stop_server(running: Running) -> None:
    running.process.terminate()  # SIGTERM: a clean shutdown
    assert running.process.wait(30) == 0


def http(url: str, method: str = "GET", body: bytes | None = None, key: str | None = KEY) -> tuple[int, Any, Any]:
    request = urllib.request.Request(url, data=body, method=method)
    request.add_header("Content-Type", "application/json")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers, decoded(response.read(), response.headers)
    except urllib.error.HTTPError as error:
        return error.code, error.headers, decoded(error.read(), error.headers)


def decoded(data: bytes, headers: Any) -> Any:
    """JSON replies as objects, the plain-text ones (vLLM's adapter routes) as text."""
    return json.loads(data or b"null") if "json" in headers.get("Content-Type", "") else data.decode()


def t2t_greedy(config: Path, prompt: str, *args: str, tokens: int = 8) -> list[int]:
    """The token ids `quiver t2t run --greedy` gives (`args`: e.g. `-l ADAPTER`), its own process."""
    command = [sys.executable, "-m", "quiver", "t2t", "run", "-c", str(config), "-p", prompt, "--greedy", "--json",
               "--max-new-tokens", str(tokens), *args]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return list(json.loads(result.stdout)["new_ids"])
