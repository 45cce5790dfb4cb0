"""The LoRA flow on a real `torch.onnx` (dynamo) export of a small Llama with real PEFT adapters.

tests/fixtures/make_llama_lora.py made the model, the adapters (with PEFT) and the expected logits (PEFT's own
forward with the adapters active); here no torch or PEFT is needed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import quiver
from quiver.lora.prepare import prepare

LLAMA = Path(__file__).resolve().parent / "fixtures" / "llama"
YAML = f"""
adapter:
- name: elementary
  lora_config: {LLAMA / "elementary"}
- name: long
  lora_config: {LLAMA / "long"}
use-case:
- name: base
  adapter_names: []
  model_name: {LLAMA / "model.onnx"}
- name: elementary
  adapter_names: [elementary]
- name: long
  adapter_names: [long]
- name: elementary_long
  adapter_names: [elementary, long]
  adapter_alphas: [1.0, 1.0]
"""


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("llama")
    (root / "lora.yaml").write_text(YAML)
    manifest = prepare(root / "lora.yaml", root / "out")
    assert set(manifest["use_cases"]) == {"base", "elementary", "long", "elementary_long"}
    return root / "out"


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("use_case", ["base", "elementary", "long", "elementary_long"])
def test_each_use_case_matches_peft_logits(prepared: Path, backend: str, use_case: str) -> None:
    context = quiver.Context.from_binary(prepared / "lora.qctx", backend=backend)
    context.apply_binary_section("model", prepared / f"{use_case}.qsec")
    logits = context.graph("model").execute({"input_ids": np.load(LLAMA / "input_ids.npy")})["logits"]
    np.testing.assert_allclose(logits, np.load(LLAMA / f"expected_{use_case}.npy"), atol=1e-3, rtol=0)


def test_two_adapters_at_once_with_one_at_half_strength_match_peft(prepared: Path) -> None:
    context = quiver.Context.from_binary(prepared / "lora.qctx", backend="cpu")
    context.apply_binary_section("model", prepared / "elementary_long.qsec")
    graph = context.graph("model")
    graph.set_lora_strength("elementary", 0.5)
    logits = graph.execute({"input_ids": np.load(LLAMA / "input_ids.npy")})["logits"]
    np.testing.assert_allclose(logits, np.load(LLAMA / "expected_elementary_half_long.npy"), atol=1e-3, rtol=0)


def test_switching_use_cases_back_and_forth_on_one_loaded_context(prepared: Path) -> None:
    context = quiver.Context.from_binary(prepared / "lora.qctx", backend="cpu")
    ids = np.load(LLAMA / "input_ids.npy")
    for use_case in ("long", "elementary", "base", "long"):
        context.apply_binary_section("model", prepared / f"{use_case}.qsec")
        logits = context.graph("model").execute({"input_ids": ids})["logits"]
        np.testing.assert_allclose(logits, np.load(LLAMA / f"expected_{use_case}.npy"), atol=1e-3, rtol=0)
