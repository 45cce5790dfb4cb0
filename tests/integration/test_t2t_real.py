"""Text generation on real weights (tests/real/make_llms.py): SmolLM2 with PEFT adapters, and the Qwen2
architecture, against transformers' and PEFT's own greedy generations."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from quiver.t2t.dialog import Dialog
from quiver.t2t.export import ExportOptions, export
from quiver.t2t.quality import read_prompts
from quiver.t2t.quantizers import CALIBRATED, QUANTIZERS
from tests.support import ROOT
from tests.support.cli import assert_one_line_error, quiver

TOKENS = 32  # transformers generated 32 tokens per prompt (eos suppressed, as min_new_tokens does)
CALIBRATION = tuple(read_prompts(ROOT / "tests" / "data" / "calibration_prompts.txt"))  # not the evaluated ones


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


def test_repetition_penalty_equals_transformers_generate(smollm2: Path, expected: dict[str, Any]) -> None:
    """transformers' RepetitionPenaltyLogitsProcessor (over the prompt and the reply so far), greedy."""
    reference = expected["repetition_penalty"]
    got = []
    with Dialog.from_config(smollm2) as dialog:
        for ids in expected["prompt_ids"]:
            dialog.reset()
            result = dialog.token_query(ids, max_new_tokens=TOKENS, min_new_tokens=TOKENS, greedy=True,
                                        repetition_penalty=reference["penalty"])  # fmt: skip
            got.append(result.new_ids)
    assert got == reference["tokens"]
    assert got != expected["base"]  # the penalty changed the text: the test sees it applied


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


def test_custom_alpha_names_and_the_base_use_case_equal_peft(smollm2: Path, expected: dict[str, Any]) -> None:
    document = json.loads(smollm2.read_text())
    for adapter in document["dialog"]["engine"]["model"]["binary"]["lora"]["adapters"]:
        adapter["alphas"] = [f"alpha-{name}" for name in adapter["alphas"]]  # names of the user's choosing
    renamed = smollm2.with_name("alphas.json")
    renamed.write_text(json.dumps(document))
    with Dialog.from_config(renamed) as dialog:
        dialog.apply_lora("adapter_all")
        assert _greedy(dialog, expected["prompt_ids"]) == expected["adapter_all"]
        dialog.set_lora_strength("alpha-adapter_all", 0.5)
        assert _greedy(dialog, expected["prompt_ids"]) == expected["adapter_all@0.5"]
        dialog.set_lora_strength("alpha-adapter_all", 0.0)
        assert _greedy(dialog, expected["prompt_ids"]) == expected["base"]
        dialog.apply_lora("base")
        assert _greedy(dialog, expected["prompt_ids"]) == expected["base"]


def test_qwen2_architecture_equals_transformers(real_llms: Path, expected: dict[str, Any], tmp_path: Path) -> None:
    config = export(real_llms / "qwen2", tmp_path, options=ExportOptions(context_size=128)).path
    with Dialog.from_config(config) as dialog:
        assert _greedy(dialog, expected["prompt_ids"]) == expected["qwen2"]


def _leading_equal(ours: list[int], theirs: list[int]) -> int:
    """How many tokens of `ours` equal `theirs` before the first that does not."""
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))


@pytest.fixture(scope="module")
def agreement_at_4_bits(real_llms: Path, expected: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Per quantizer: the 4-bit model's greedy tokens that equal transformers' fp32 ones (128 per prompt)
    before the first that differs, per prompt."""
    found = {}
    for quantizer in QUANTIZERS:
        out = tmp_path_factory.mktemp(f"int4-{quantizer}")
        calibration = CALIBRATION if quantizer in CALIBRATED else ()
        options = ExportOptions(context_size=256, weight_bits=4, quantizer=quantizer, calibration=calibration)
        with Dialog.from_config(export(real_llms / "smollm2", out, options=options).path) as dialog:
            long = len(expected["base_long"][0])
            replies = []
            for ids in expected["prompt_ids"]:
                dialog.reset()
                replies.append(dialog.token_query(ids, max_new_tokens=long, min_new_tokens=long, greedy=True).new_ids)
        found[quantizer] = [_leading_equal(r, t) for r, t in zip(replies, expected["base_long"])]
    return found


def test_int4_with_a_scale_and_minimum_per_block_keeps_the_float_models_text(agreement_at_4_bits: dict) -> None:
    # SmolLM2's weights are a Q4_1 model dequantized: rtn-min's blocks of 32 are its blocks, exactly, and
    # HQQ's fitted minimums find them too
    for quantizer in ("rtn-min", "hqq"):
        assert all(kept >= 100 for kept in agreement_at_4_bits[quantizer]), agreement_at_4_bits


def test_the_best_quantizer_keeps_more_than_llama_cpps_q4_1(agreement_at_4_bits: dict) -> None:
    means = {name: sum(kept) / len(kept) for name, kept in agreement_at_4_bits.items()}
    assert max(means.values()) > 18, means  # llama.cpp's Q4_1 keeps 13-18 of these (its int8 activations)
    assert means["rtn-min"] >= max(means["rtn"], means["rtn-asym"]), means


def test_gptq_keeps_more_than_rounding_to_nearest_on_the_same_grid(agreement_at_4_bits: dict) -> None:
    means = {name: sum(kept) / len(kept) for name, kept in agreement_at_4_bits.items()}
    assert means["gptq-asym"] > means["rtn-asym"] and means["gptq"] > means["rtn"], means


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


_ANONYMOUS_GROWTH = r"""
import dataclasses, sys
from pathlib import Path
from quiver.t2t.config import read_dialog_config
from quiver.t2t.dialog import Dialog
def anonymous():
    lines = Path("/proc/self/smaps_rollup").read_text().splitlines()
    return next(int(line.split()[1]) for line in lines if line.startswith("Anonymous:"))
config = read_dialog_config(sys.argv[1])
if sys.argv[2] == "one":
    config = dataclasses.replace(config, decode_graph=config.prefill_graph)
before = anonymous()
with Dialog(config):  # both graphs prepared (packed) as the dialog opens
    print(anonymous() - before)
"""


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="reads /proc/self/smaps_rollup (Linux)")
def test_the_decode_graph_packs_no_second_copy_of_the_weights(smollm2: Path) -> None:
    """The prefill and decode graphs share every packed weight, the tied LM head (the token table a Gather
    also reads) included: the second graph's session costs SmolLM2's private memory next to nothing
    (it cost 220 MB, two copies of the 108 MB head among them, when the head was packed per graph)."""
    import subprocess
    import sys

    grown = {}
    for graphs in ("one", "two"):
        out = subprocess.run([sys.executable, "-c", _ANONYMOUS_GROWTH, str(smollm2), graphs], capture_output=True,
                             text=True, check=True)  # fmt: skip
        grown[graphs] = int(out.stdout.strip().splitlines()[-1]) / 1024
    assert grown["two"] - grown["one"] < 40, grown  # MB: the decode session's own buffers, no weights


# --- decoders exported elsewhere (onnxruntime-genai's model builder), packed as they are -----------------
def _genai_folder(real_llms: Path, name: str, tmp_path: Path, share_buffer: bool) -> Path:
    """The builder's folder as it is, or a copy whose genai_config.json says past and present do not share a
    buffer (the cache then grows by each step's present, as optimum's exports need)."""
    source = real_llms / name
    if share_buffer:
        return source
    folder = tmp_path / f"{name}_growing"
    shutil.copytree(source, folder)
    config = json.loads((folder / "genai_config.json").read_text())
    assert config["search"]["past_present_share_buffer"] is True
    config["search"]["past_present_share_buffer"] = False
    (folder / "genai_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(("name", "share_buffer"), [("genai_fp32", True), ("genai_tiny", True), ("genai_tiny", False)])
def test_an_onnxruntime_genai_export_runs_under_t2t_run_with_genais_own_greedy_tokens(
    real_llms: Path, expected: dict[str, Any], tmp_path: Path, name: str, share_buffer: bool
) -> None:
    theirs = json.loads((real_llms / "genai_expected.json").read_text())[name]
    folder = _genai_folder(real_llms, name, tmp_path, share_buffer)
    packed = quiver("t2t", "export", "--model", folder, "-o", tmp_path / "packed", "--context-size", "256")
    assert packed.returncode == 0, packed.stderr
    config = json.loads((tmp_path / "packed" / "genie_config.json").read_text())
    kv_cache = config["dialog"]["engine"]["model"]["binary"]["quiver"]["kv-cache"]
    assert kv_cache == ("shared" if share_buffer else "growing")
    eos = config["dialog"]["context"]["eos-token"]
    for prompt, generated in zip(expected["prompts"], theirs):
        (tmp_path / "prompt.txt").write_text(prompt)
        run = quiver("t2t", "run", "-c", tmp_path / "packed" / "genie_config.json", "--prompt-file",
                     tmp_path / "prompt.txt", "--greedy", "--max-new-tokens", str(TOKENS), "--json")  # fmt: skip
        assert run.returncode == 0, run.stderr
        ours = json.loads(run.stdout)["new_ids"]
        assert ours[: len(generated)] == generated  # genai stops at an eos and leaves it out
        assert len(generated) == TOKENS or ours[len(generated)] in (eos if isinstance(eos, list) else [eos])
    assert len({len(g) for g in theirs}) >= 1 and any(len(g) == TOKENS for g in theirs)


def test_an_onnx_decoder_with_inputs_quiver_cannot_feed_is_refused_in_one_line(real_llms: Path, tmp_path: Path) -> None:
    import onnx

    folder = tmp_path / "odd"
    shutil.copytree(real_llms / "genai_tiny", folder)
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    model.graph.input.append(onnx.helper.make_tensor_value_info("token_type_ids", onnx.TensorProto.INT64, [1, "s"]))
    onnx.save(model, str(folder / "model.onnx"))
    assert_one_line_error(quiver("t2t", "export", "--model", folder, "-o", tmp_path / "out"), "token_type_ids")
    usage = quiver(
        "t2t", "export", "--model", real_llms / "genai_tiny", "-o", tmp_path / "out", "--weight-bitwidth", "4"
    )
    assert usage.returncode == 2 and "--weight-bitwidth work on a transformers folder" in usage.stderr
