"""Text generation on real weights (tests/real/make_llms.py): SmolLM2 with PEFT adapters, and the Qwen2
architecture, against transformers' and PEFT's own greedy generations."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from quiver.t2t.dialog import Dialog
from quiver.t2t.export import ExportOptions, export
from tests.support import ROOT

TOKENS = 32  # transformers generated 32 tokens per prompt (eos suppressed, as min_new_tokens does)


@pytest.fixture(scope="module")
def expected(real_llms: Path) -> dict[str, Any]:
    return json.loads((real_llms / "expected.json").read_text())


@pytest.fixture(scope="module")
def smollm2(real_llms: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("smollm2")
    adapters = {name: real_llms / name for name in ("adapter_all", "adapter_qv")}
    return export(real_llms / "smollm2", out, adapters, options=ExportOptions(context_size=256)).path


def _greedy(dialog: Dialog, prompts: list[list[int]]) -> list[list[int]]:
    results = []
    for ids in prompts:
        dialog.reset()
        results.append(dialog.token_query(ids, max_new_tokens=TOKENS, min_new_tokens=TOKENS, greedy=True).new_ids)
    return results


def test_greedy_generation_equals_transformers(smollm2: Path, expected: dict[str, Any]) -> None:
    with Dialog.from_config(smollm2) as dialog:
        assert [dialog.tokenizer.encode(p) for p in expected["prompts"]] == expected["prompt_ids"]
        assert _greedy(dialog, expected["prompt_ids"]) == expected["base"]


@pytest.mark.parametrize("adapter", ["adapter_all", "adapter_qv"])
def test_adapters_equal_peft_and_strength_zero_equals_the_base(
    smollm2: Path, expected: dict[str, Any], adapter: str
) -> None:
    with Dialog.from_config(smollm2) as dialog:
        dialog.apply_lora(adapter)
        assert _greedy(dialog, expected["prompt_ids"]) == expected[adapter]
        dialog.set_lora_strength(adapter, 0.5)
        assert _greedy(dialog, expected["prompt_ids"]) == expected[f"{adapter}@0.5"]
        dialog.set_lora_strength(adapter, 0.0)
        assert _greedy(dialog, expected["prompt_ids"]) == expected["base"]
    assert expected[adapter] != expected["base"]


def test_qwen2_architecture_equals_transformers(real_llms: Path, expected: dict[str, Any], tmp_path: Path) -> None:
    config = export(real_llms / "qwen2", tmp_path, options=ExportOptions(context_size=128)).path
    with Dialog.from_config(config) as dialog:
        assert _greedy(dialog, expected["prompt_ids"]) == expected["qwen2"]


def test_the_prefill_and_decode_context_is_one_model(smollm2: Path, real_llms: Path) -> None:
    weights = (real_llms / "smollm2" / "model.safetensors").stat().st_size
    context = (smollm2.parent / "model.qctx").stat().st_size
    sections = sum(p.stat().st_size for p in smollm2.parent.glob("*.qsec"))
    assert context <= 1.02 * weights, (context, weights)
    assert sections < 0.05 * weights  # the adapters travel as small sections, not as model copies


def test_the_t2t_guides_example_runs_as_written(
    real_llms: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import re

    guide = (ROOT / "docs" / "t2t.md").read_text()
    (example,) = re.findall(r"```python\n(.*?)```", guide, re.S)
    export(real_llms / "smollm2", tmp_path / "smollm2", {"chat": real_llms / "adapter_all"},
           options=ExportOptions(context_size=256))  # fmt: skip
    monkeypatch.chdir(tmp_path)
    exec(compile(example, "docs/t2t.md", "exec"), {})
