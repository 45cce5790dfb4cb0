"""The LoRA flow on a real `torch.onnx` (dynamo) export of a small Llama with real PEFT adapters.

tests/support/fixtures/make_llama_lora.py made the model, the adapters (with PEFT) and the expected logits (PEFT's own
forward with the adapters active); here no torch or PEFT is needed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import quiver
from quiver.lora.prepare import prepare
from tests.support import FIXTURES  # noqa: E402
from tests.support.cli import assert_one_line_error
from tests.support.cli import quiver as run_cli

LLAMA = FIXTURES / "llama"
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


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same flow quantized (a16w8 base, 16-bit adapters), calibrated on the fixture's ids and seven more."""
    root = tmp_path_factory.mktemp("llama_q")
    (root / "lora.yaml").write_text(YAML)
    ids = np.load(LLAMA / "input_ids.npy")
    rng = np.random.default_rng(0)
    lines = []
    for i in range(8):
        np.save(root / f"calib_{i}.npy", ids if i == 0 else rng.integers(0, 128, ids.shape).astype(ids.dtype))
        lines.append(f"input_ids:={root / f'calib_{i}.npy'}")
    (root / "calib.txt").write_text("\n".join(lines) + "\n")
    result = run_cli(
        "lora", "prepare", "--lora-config", root / "lora.yaml", "-o", root / "out", "--input-list", root / "calib.txt",
        "--act-bitwidth", "16", "--weight-bitwidth", "8", "--lora-weight-bitwidth", "16",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return root / "out"


@pytest.mark.parametrize("use_case", ["base", "elementary", "long", "elementary_long"])
def test_quantized_use_cases_match_peft_within_quantization_noise(quantized: Path, use_case: str) -> None:
    context = quiver.Context.from_binary(quantized / "lora.qctx")
    context.apply_binary_section("model", quantized / f"{use_case}.qsec")
    logits = context.graph("model").execute({"input_ids": np.load(LLAMA / "input_ids.npy")})["logits"]
    expected = np.load(LLAMA / f"expected_{use_case}.npy")
    # the adapters move these logits by 0.46 to 0.63; 16-bit activations and 8-bit weights by ~0.01
    assert np.abs(logits - expected).max() < 0.03


def test_calibration_inputs_the_model_cannot_run_are_a_one_line_error(tmp_path: Path) -> None:
    (tmp_path / "lora.yaml").write_text(YAML)
    np.save(tmp_path / "bad.npy", np.full((1, 8), 850, np.int64))  # the vocabulary has 128 tokens
    (tmp_path / "calib.txt").write_text(f"input_ids:={tmp_path / 'bad.npy'}\n")
    result = run_cli(
        "lora", "prepare", "--lora-config", tmp_path / "lora.yaml", "-o", tmp_path / "out",
        "--input-list", tmp_path / "calib.txt", "--act-bitwidth", "16",
    )  # fmt: skip
    assert_one_line_error(result, "calibration inputs", "out of data bounds")
