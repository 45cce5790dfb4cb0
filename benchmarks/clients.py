"""The clients people use, against `quiver serve` on SmolLM2-135M-Instruct (fp32, context 1024):
LangChain's `ChatOpenAI.with_structured_output` (json_schema and function calling, 20 requests each,
sampled at temperature 0.7), `bind_tools` with a named `tool_choice`, and the `OpenAI` LLM's `.batch()`.

    python benchmarks/run.py --only clients

Needs the bench extra (`langchain-openai`). Counts, not timings: how many replies parse as the asked object.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from quiver.t2t.export import ExportOptions, export
from serve import _free_port, _wait_healthy

REQUESTS = 20


def measure_clients(folder: Path, llms: Path) -> dict[str, Any]:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI, OpenAI
    from pydantic import BaseModel, Field

    config = export(llms / "smollm2", folder / "smol", options=ExportOptions(context_size=1024)).path
    port = _free_port()
    process = subprocess.Popen([sys.executable, "-m", "quiver", "serve", "-c", str(config), "--port", str(port)],
                               stdout=subprocess.DEVNULL)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, process)

        class Person(BaseModel):
            """A person."""

            name: str = Field(description="their name", max_length=30)
            age: int = Field(description="age in years", ge=0, le=120)

        @tool
        def get_weather(city: str) -> str:
            """The weather in a city."""
            return "sunny"

        chat = ChatOpenAI(base_url=f"{url}/v1", api_key="none", model="smol", temperature=0.7, max_tokens=120)
        result: dict[str, Any] = {"model": "SmolLM2-135M-Instruct fp32, context 1024", "requests": REQUESTS}
        for method in ("json_schema", "function_calling"):
            structured = chat.with_structured_output(Person, method=method)
            replies = [structured.invoke(f"Describe person number {i}: Ann, 30 years old.") for i in range(REQUESTS)]
            result[f"with_structured_output {method}: valid"] = sum(isinstance(r, Person) for r in replies)
        called = chat.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
        result["bind_tools named: calls"] = [{"name": c["name"], "args": c["args"]} for c in called.tool_calls]
        llm = OpenAI(base_url=f"{url}/v1", api_key="none", model="smol", max_tokens=12, temperature=0)
        result["OpenAI .batch() replies"] = llm.batch(["The capital of France is", "Once upon a time", "1, 2, 3,"])
        return result
    finally:
        process.terminate()
        process.wait(60)
