"""Reads a GGUF file (llama.cpp's format) as a model: its config, its weights dequantized, its tokenizer.

The file's metadata becomes the transformers config the families read (`families.read_config_fields`),
strictly as they read config.json: a metadata key of the architecture Quiver does not know is refused.
Tensor names map to transformers' (`blk.N.attn_q` -> `model.layers.N.self_attn.q_proj`), with llama.cpp's
reordering of Llama's q/k rows undone; every block type the `gguf` package knows is dequantized to float32
(exact: what llama.cpp computes with), then the export goes on as from a folder (`--weight-bitwidth`
quantizes again). The tokenizer is rebuilt as a tokenizer.json: byte-level BPE with the file's tokens and
merges, the pre-tokenizer llama.cpp uses for the file's `tokenizer.ggml.pre`, its control tokens special;
the chat template is the file's. Llama 3's rope scaling, which llama.cpp's converter writes as a tensor of
divisors (`rope_freqs`), divides the rope's frequencies as llama.cpp does. Mixtures of experts (`qwen2moe`,
`qwen3moe`, and `llama` files with experts: Mixtral) hold each layer's experts stacked in one tensor
(`blk.N.ffn_gate_exps` [experts, rows, columns]); each expert is read as transformers names it, its own slice
dequantized alone. Their routing is what llama.cpp computes for the architecture (Qwen2-MoE's weights as the
softmax gives them, Qwen3-MoE's and Mixtral's renormalized over the chosen experts), whatever config the file
came from. Gemma's files (`gemma`, `gemma2`, `gemma3`) hold their norms as 1 + w and their SentencePiece
vocabulary; their queries are scaled as llama.cpp scales them (the 27B models' by hidden / heads, the others'
by the head size), and Gemma 2's soft-caps and window are llama.cpp's defaults where the file has none.
Phi-3's files (`phi3`) keep q/k/v and gate/up fused as transformers does, Phi-4-mini's partial rotary
from `rope.dimension_count`; their sliding window is the model's (transformers applies it; llama.cpp turns
Phi-3's off, so past the window the two differ: Quiver keeps the model's), and Phi-3.5's and Phi-4-mini's
longrope comes from its factor tensors and attention factor (1 where the file has none, as llama.cpp reads it).
Phi-2's files (`phi2`) hold LayerNorms with biases and a biased head, as transformers' PhiForCausalLM.
SentencePiece vocabularies (`tokenizer.ggml.model` llama: Llama 2's, Mistral 7B's) are BPE joined by the
pieces' scores, as llama.cpp tokenizes them. What this does not cover is refused in one line: other
architectures, pre-tokenizers not listed, routers other than a softmax.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from quiver.errors import ModelFolderError
from quiver.ir.deferred import Deferred
from quiver.t2t.families import read_config_fields, with_frequency_divisors

GGUF_MAGIC = b"GGUF"
ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's per-pair rope divisors (Llama 3's scaling)
# longrope's per-pair factors (Phi-3.5's, Phi-4-mini's): the short ones, then those past the original context
LONGROPE_FACTORS = ("rope_factors_short.weight", "rope_factors_long.weight")
_COMMON_KEYS = {  # llama.cpp's metadata (after `ARCH.`) -> transformers' config field
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "context_length": "max_position_embeddings",
    "vocab_size": "vocab_size",
    "attention.key_length": "head_dim",
    "attention.value_length": "_value_length",  # checked equal to the key length
}
_COMMON_NAMES = [  # GGUF tensor name -> transformers'
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"blk\.(\d+)\.attn_q\.(weight|bias)", r"model.layers.\1.self_attn.q_proj.\2"),
    (r"blk\.(\d+)\.attn_k\.(weight|bias)", r"model.layers.\1.self_attn.k_proj.\2"),
    (r"blk\.(\d+)\.attn_v\.(weight|bias)", r"model.layers.\1.self_attn.v_proj.\2"),
    (r"blk\.(\d+)\.attn_output\.(weight|bias)", r"model.layers.\1.self_attn.o_proj.\2"),
    (r"blk\.(\d+)\.ffn_gate\.(weight|bias)", r"model.layers.\1.mlp.gate_proj.\2"),
    (r"blk\.(\d+)\.ffn_up\.(weight|bias)", r"model.layers.\1.mlp.up_proj.\2"),
    (r"blk\.(\d+)\.ffn_down\.(weight|bias)", r"model.layers.\1.mlp.down_proj.\2"),
]


# Llama's layout: the norm before the MLP is transformers' post_attention_layernorm
_LLAMA_NORMS = [(r"blk\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight")]

_QK_NORMS = [(r"blk\.(\d+)\.attn_q_norm\.weight", r"model.layers.\1.self_attn.q_norm.weight"),
             (r"blk\.(\d+)\.attn_k_norm\.weight", r"model.layers.\1.self_attn.k_norm.weight")]  # fmt: skip


def _experts(router: str, expert: str, parts: tuple[str, str, str]) -> list[tuple[str, str]]:
    """A mixture of experts' router and its stacked experts (`expert` formatted with `{e}` later, per expert)."""
    names = [(r"blk\.(\d+)\.ffn_gate_inp\.weight", rf"model.layers.\1.{router}.weight")]
    for gguf_part, part in zip(("gate", "up", "down"), parts):
        names.append((rf"blk\.(\d+)\.ffn_{gguf_part}_exps\.weight", rf"model.layers.\1.{expert}.{part}.weight"))
    return names


_QWEN_EXPERTS = _experts("mlp.gate", "mlp.experts.{e}", ("gate_proj", "up_proj", "down_proj"))
_QWEN2_SHARED_EXPERT = [
    (r"blk\.(\d+)\.ffn_gate_inp_shexp\.weight", r"model.layers.\1.mlp.shared_expert_gate.weight"),
    *((rf"blk\.(\d+)\.ffn_{p}_shexp\.weight", rf"model.layers.\1.mlp.shared_expert.{p}_proj.weight")
      for p in ("gate", "up", "down")),
]  # fmt: skip
_MIXTRAL_EXPERTS = [
    *_experts("block_sparse_moe.gate", "block_sparse_moe.experts.{e}", ("w1", "w3", "w2")),
    # older files: one tensor per expert (`blk.N.ffn_gate.E.weight`)
    *((rf"blk\.(\d+)\.ffn_{p}\.(\d+)\.weight", rf"model.layers.\1.block_sparse_moe.experts.\2.{w}.weight")
      for p, w in (("gate", "w1"), ("up", "w3"), ("down", "w2"))),
]  # fmt: skip
_GEMMA_MLP = {"hidden_activation": "gelu_pytorch_tanh"}  # llama.cpp's GELU is the tanh approximation
# Gemma 2 and 3: norms after attention and after the MLP, and the one before the MLP named for it
_GEMMA_NORMS = [
    (r"blk\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.pre_feedforward_layernorm.weight"),
    (r"blk\.(\d+)\.post_attention_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.post_ffw_norm\.weight", r"model.layers.\1.post_feedforward_layernorm.weight"),
]
_EXPERT_KEYS = {"expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
                "expert_feed_forward_length": "moe_intermediate_size"}  # fmt: skip
# what llama.cpp routes with, fixed by the architecture: a file's own keys for it are held to these values
_ROUTING_KEYS = ("expert_weights_norm", "expert_weights_scale", "expert_gating_func")
_SOFTMAX = 1  # llama.cpp's expert_gating_func of a softmax router
# Qwen's mixtures as llama.cpp builds them: experts on every layer
_EVERY_LAYER_SPARSE = {"hidden_act": "silu", "decoder_sparse_step": 1, "mlp_only_layers": []}


@dataclass(frozen=True)
class _Architecture:
    """How llama.cpp writes one architecture: its transformers class, the config fields beyond the common
    ones, its tensor names beyond the common ones, and what its converter did to the weights."""

    family: str
    fields: dict[str, Any]  # fixed config fields
    keys: dict[str, str]  # more metadata -> config
    names: list[tuple[str, str]]
    permuted_qk: bool = False  # Llama's q/k rows reordered for llama.cpp's rope
    norms_plus_one: bool = False  # Gemma's norm weights stored as 1 + w
    gemma_vocabulary: bool = False  # a SentencePiece vocabulary as Gemma's (no space prefix, merges by order)
    partial_rotary: bool = False  # rope.dimension_count may rotate part of a head (Phi-4-mini's)
    longrope: bool = False  # longrope's factors as tensors (LONGROPE_FACTORS), its attention factor as metadata
    # llama.cpp scales queries by 1 / sqrt(head size), but a model of this many layers' (Gemma 2's and 3's 27B,
    # told apart by their layer counts as llama.cpp tells them) by 1 / sqrt(hidden / heads), as Google's code does
    wide_query_scale_layers: int | None = None
    normalized_experts: bool | None = None  # a mixture of experts: whether llama.cpp renormalizes the chosen


# a `llama` file with experts (`llama.expert_count`): Mixtral, as llama.cpp's converter writes it
_MIXTRAL = _Architecture(
    "MixtralForCausalLM", {"hidden_act": "silu"},
    {"expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok"},
    [*_LLAMA_NORMS, *_MIXTRAL_EXPERTS], permuted_qk=True, normalized_experts=True,
)  # fmt: skip


_ARCHITECTURES = {
    "llama": _Architecture("LlamaForCausalLM", {"hidden_act": "silu"}, {}, _LLAMA_NORMS, permuted_qk=True),
    "qwen2": _Architecture("Qwen2ForCausalLM", {"hidden_act": "silu"}, {}, _LLAMA_NORMS),
    "qwen3": _Architecture("Qwen3ForCausalLM", {"hidden_act": "silu"}, {}, [*_LLAMA_NORMS, *_QK_NORMS]),
    "qwen2moe": _Architecture(
        "Qwen2MoeForCausalLM", {**_EVERY_LAYER_SPARSE, "norm_topk_prob": False},
        _EXPERT_KEYS | {"expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
        [*_LLAMA_NORMS, *_QWEN_EXPERTS, *_QWEN2_SHARED_EXPERT], normalized_experts=False,
    ),
    "qwen3moe": _Architecture(
        "Qwen3MoeForCausalLM", {**_EVERY_LAYER_SPARSE, "norm_topk_prob": True},
        _EXPERT_KEYS, [*_LLAMA_NORMS, *_QK_NORMS, *_QWEN_EXPERTS], normalized_experts=True,
    ),
    "phi3": _Architecture(
        "Phi3ForCausalLM", {"hidden_act": "silu"},
        {"rope.scaling.original_context_length": "original_max_position_embeddings",
         "attention.sliding_window": "sliding_window", "rope.scaling.attn_factor": "_rope_attention_factor"},
        [(r"blk\.(\d+)\.attn_qkv\.(weight|bias)", r"model.layers.\1.self_attn.qkv_proj.\2"),
         (r"blk\.(\d+)\.ffn_up\.weight", r"model.layers.\1.mlp.gate_up_proj.weight"), *_LLAMA_NORMS],
        partial_rotary=True, longrope=True,
    ),
    "phi2": _Architecture(
        # one LayerNorm (with a bias) before attention and the MLP side by side; biases everywhere, the head's too
        "PhiForCausalLM", {"hidden_act": "gelu_new"}, {"attention.layer_norm_epsilon": "layer_norm_eps"},
        [(r"blk\.(\d+)\.attn_norm\.(weight|bias)", r"model.layers.\1.input_layernorm.\2"),
         (r"blk\.(\d+)\.attn_output\.(weight|bias)", r"model.layers.\1.self_attn.dense.\2"),
         (r"blk\.(\d+)\.ffn_up\.(weight|bias)", r"model.layers.\1.mlp.fc1.\2"),
         (r"blk\.(\d+)\.ffn_down\.(weight|bias)", r"model.layers.\1.mlp.fc2.\2"),
         (r"output_norm\.(weight|bias)", r"model.final_layernorm.\1"), (r"output\.(weight|bias)", r"lm_head.\1")],
        partial_rotary=True,
    ),
    "gemma": _Architecture(
        "GemmaForCausalLM", _GEMMA_MLP, {}, _LLAMA_NORMS, norms_plus_one=True, gemma_vocabulary=True
    ),
    "gemma2": _Architecture(
        # llama.cpp's defaults where a file leaves them out (Gemma 2's own)
        "Gemma2ForCausalLM",
        {**_GEMMA_MLP, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "sliding_window": 4096},
        {"attention.sliding_window": "sliding_window", "attn_logit_softcapping": "attn_logit_softcapping",
         "final_logit_softcapping": "final_logit_softcapping"},
        _GEMMA_NORMS, norms_plus_one=True, gemma_vocabulary=True, wide_query_scale_layers=46,
    ),
    "gemma3": _Architecture(
        "Gemma3ForCausalLM", {**_GEMMA_MLP, "rope_local_base_freq": 10000.0},
        {"attention.sliding_window": "sliding_window", "final_logit_softcapping": "final_logit_softcapping"},
        [*_GEMMA_NORMS, *_QK_NORMS], norms_plus_one=True, gemma_vocabulary=True, wide_query_scale_layers=62,
    ),
}  # fmt: skip
# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp), applied in turn, each piece split again by the next
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (  # Llama 3's, but digits one by one
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {
    "smollm": [r"\p{N}", _GPT2],
    "gpt-2": [_GPT2],
    "phi-2": [_GPT2],  # Phi-2's files, and Phi-4-mini's: GPT-2's to llama.cpp
    "default": [_GPT2],
    "llama-bpe": [_LLAMA3],
    "llama3": [_LLAMA3],
    "qwen2": [_QWEN2],  # Qwen2's, Qwen2.5's and Qwen3's files
}
_CONTROL = 3  # llama.cpp's token type of special tokens (`<|im_start|>`)
_USER_DEFINED = 4  # added tokens matched whole but not special (`<think>`)


def is_gguf(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return path.is_file() and f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _reader(path: Path) -> Any:
    try:
        import gguf
    except ImportError:
        raise ModelFolderError(
            f"{path} is a GGUF file: reading it needs the gguf extra: pip install 'quiver[gguf]'"
        ) from None
    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001  the gguf package raises what its parser meets
        raise ModelFolderError(f"{path}: not a GGUF file gguf can read ({type(exc).__name__}: {exc})") from None


def _float32(path: Path, tensor: Any, index: int | None = None) -> np.ndarray:
    """A tensor of the file as float32, whatever block type the `gguf` package knows; `index`: only that
    slice of its outermost axis (one of stacked experts: the others are not read)."""
    import gguf

    data = tensor.data if index is None else tensor.data[index]
    try:
        return np.asarray(gguf.quants.dequantize(data, tensor.tensor_type), np.float32)
    except (ValueError, NotImplementedError) as exc:
        raise ModelFolderError(f"{path}: tensor {tensor.name!r} ({tensor.tensor_type.name}) cannot be read "
                               f"({exc})") from None  # fmt: skip


def _value(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


class GgufModel:
    """A GGUF file as the export reads a folder: `config`, `get(name)` and `unused()`, a tokenizer.json."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._reader = _reader(path)
        arch = _value(self._reader, "general.architecture")
        if arch not in _ARCHITECTURES:
            known = ", ".join(sorted(_ARCHITECTURES))
            raise ModelFolderError(f"{path}: a GGUF {arch!r} model; Quiver reads GGUF files of {known} (or export the "
                                   "model's transformers folder)")  # fmt: skip
        self.arch = _ARCHITECTURES[arch]
        if arch == "llama" and _value(self._reader, "llama.expert_count", 0):
            self.arch = _MIXTRAL
        self._tensors = {t.name: t for t in self._reader.tensors}
        self.config = read_config_fields(self._config(arch), path)
        if ROPE_FREQS in self._tensors:  # Llama 3's rope scaling, as llama.cpp's converter writes it
            self.config = with_frequency_divisors(self.config, tuple(self._per_pair(ROPE_FREQS)), path)
        self._names: dict[str, str] = {}
        self._expert: dict[str, int] = {}  # an expert's name -> its place in the stacked tensor it is read from
        for name in self._tensors:
            if name == ROPE_FREQS or (self.arch.longrope and name in LONGROPE_FACTORS):
                continue  # read into the config
            names = [*self.arch.names, *_COMMON_NAMES]  # an architecture's own first (Phi-3's fused ffn_up)
            hf = next((re.sub(f"^{p}$", r, name) for p, r in names if re.fullmatch(p, name)), None)
            if hf is None:
                raise ModelFolderError(f"{path}: tensor {name!r} has no place in Quiver's {self.config.architecture}; "
                                       "the text would differ")  # fmt: skip
            if "{e}" not in hf:
                self._names[hf] = name
                continue
            shape = self._tensors[name].shape  # GGUF lists the innermost first: the experts last
            experts = self.config.moe.experts if self.config.moe is not None else None
            if len(shape) != 3 or int(shape[-1]) != experts:
                raise ModelFolderError(f"{path}: tensor {name!r} has shape {list(reversed(shape))}, not {experts} "
                                       "stacked experts")  # fmt: skip
            for e in range(experts):
                self._names[hf.format(e=e)] = name
                self._expert[hf.format(e=e)] = e
        self._read: set[str] = set()

    def _config(self, arch: str) -> dict[str, Any]:
        prefix = f"{arch}."
        raw: dict[str, Any] = {"architectures": [self.arch.family], **self.arch.fields}
        keys = _COMMON_KEYS | self.arch.keys
        for key in self._reader.fields:
            if not key.startswith(prefix):
                continue
            short = key[len(prefix) :]
            if short == "rope.dimension_count":
                continue  # checked below against the head size
            if short in _ROUTING_KEYS and self.arch.normalized_experts is not None:
                self._check_routing(key, short)
                continue
            if short not in keys:
                raise ModelFolderError(f"{self.path}: GGUF metadata {key!r} is not supported by Quiver; the text "
                                       "would differ from the model's")  # fmt: skip
            raw[keys[short]] = _value(self._reader, key)
        values = raw.pop("_value_length", None)
        if values is not None and values != raw.get("head_dim"):
            raise ModelFolderError(f"{self.path}: values of {values} dimensions beside keys of {raw.get('head_dim')}")
        if raw.get("sliding_window") == 0:  # llama.cpp's "no window" (Phi-4's files write it so)
            raw["sliding_window"] = None
        longrope = self._longrope(raw.pop("_rope_attention_factor", None))
        if longrope is not None:
            raw["rope_scaling"] = longrope
            # llama.cpp's original context is the trained one where the file has none (its n_ctx_orig_yarn)
            raw.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings"))
        if self.arch.family == "Qwen2MoeForCausalLM":  # llama.cpp adds q, k and v biases where the file has them
            raw["qkv_bias"] = "blk.0.attn_q.bias" in self._tensors
        tokens = self._reader.fields.get("tokenizer.ggml.tokens")
        if "vocab_size" not in raw and tokens is not None:
            raw["vocab_size"] = len(tokens.data)
        raw["tie_word_embeddings"] = "output.weight" not in self._tensors
        heads, hidden = raw.get("num_attention_heads"), raw.get("hidden_size")
        if isinstance(heads, int) and isinstance(hidden, int) and heads > 0:  # else the config's check refuses it
            rotary, head = _value(self._reader, f"{prefix}rope.dimension_count"), raw.get("head_dim", hidden // heads)
            if rotary is not None and rotary != head:
                if not self.arch.partial_rotary or not isinstance(rotary, int):
                    raise ModelFolderError(f"{self.path}: partial rotary ({rotary} dimensions) in GGUF is not "
                                           "supported")  # fmt: skip
                raw["partial_rotary_factor"] = rotary / head  # Phi-4-mini's: the config's check takes it from here
            if self.arch.wide_query_scale_layers is not None:
                wide = raw.get("num_hidden_layers") == self.arch.wide_query_scale_layers
                raw["query_pre_attn_scalar"] = hidden // heads if wide else raw.get("head_dim", hidden // heads)
        for token, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("padding", "pad_token_id")):
            value = _value(self._reader, f"tokenizer.ggml.{token}_token_id")
            if value is not None:
                raw[key] = int(value)
        return raw

    def _check_routing(self, key: str, short: str) -> None:
        """A routing key of a mixture of experts: llama.cpp routes each architecture one way (a softmax, the
        chosen weights renormalized or not, unscaled), so a file saying otherwise has no one meaning."""
        value = _value(self._reader, key)
        expected: Any = {"expert_weights_norm": self.arch.normalized_experts, "expert_gating_func": _SOFTMAX}.get(short)
        if short == "expert_weights_scale":
            if not isinstance(value, (int, float)) or value not in (0.0, 1.0):  # 0: unset, as llama.cpp reads it
                raise ModelFolderError(f"{self.path}: GGUF {key} = {value}: scaled expert weights are not supported")
        elif value != expected:
            raise ModelFolderError(f"{self.path}: GGUF {key} = {value}, where llama.cpp routes a {self.arch.family} "
                                   f"with {expected}: the text would differ from one of them")  # fmt: skip

    def _per_pair(self, name: str) -> list[float]:
        """A 1-d tensor of one number per rotated pair (a rope's factors), as Python floats."""
        tensor = self._tensors[name]
        if len(tensor.shape) != 1 or int(tensor.shape[0]) > 1 << 16:
            raise ModelFolderError(f"{self.path}: {name} has shape {list(tensor.shape)}, not one factor per "
                                   "rotated pair")  # fmt: skip
        return [float(v) for v in np.asarray(_float32(self.path, tensor), np.float64).reshape(-1)]

    def _longrope(self, attention: Any) -> dict[str, Any] | None:
        """Phi-3.5's and Phi-4-mini's longrope as llama.cpp's converter writes it, as a config's rope scaling:
        the short and long factors as tensors, the attention factor as metadata (1 where the file has none,
        as llama.cpp takes it; transformers would compute one from the context lengths)."""
        if not self.arch.longrope:
            return None
        if not isinstance(attention, (int, float, type(None))):
            raise ModelFolderError(f"{self.path}: GGUF rope.scaling.attn_factor must be a number")
        short, long = (name in self._tensors for name in LONGROPE_FACTORS)
        if not (short or long):
            if attention not in (None, 1.0):  # llama.cpp would scale every rotation by it: no rope of Quiver's does
                raise ModelFolderError(f"{self.path}: a rope attention factor ({attention}) without longrope's factor "
                                       "tensors is not supported")  # fmt: skip
            return None
        if short != long:
            have, lack = LONGROPE_FACTORS if short else reversed(LONGROPE_FACTORS)
            raise ModelFolderError(f"{self.path}: tensor {have!r} without {lack!r}: longrope needs both")
        factors = [self._per_pair(name) for name in LONGROPE_FACTORS]
        if len(factors[0]) != len(factors[1]):
            raise ModelFolderError(f"{self.path}: {len(factors[0])} short and {len(factors[1])} long rope factors: "
                                   "longrope takes one of each per rotated pair")  # fmt: skip
        return {"rope_type": "longrope", "short_factor": factors[0], "long_factor": factors[1],
                "attention_factor": 1.0 if attention is None else float(attention)}  # fmt: skip

    def deferred(self, name: str) -> Deferred:
        """The tensor as float32 (dequantized), made when it is stored (the name counts as used now)."""
        source = self._names.get(name)
        if source is None:
            raise ModelFolderError(f"{self.path}: the GGUF file has no tensor for {name!r}")
        self._read.add(name)
        shape = [int(d) for d in reversed(self._tensors[source].shape)]  # GGUF lists the innermost first
        expert = self._expert.get(name)
        if expert is not None:  # one of a stacked tensor's experts
            shape = shape[1:]
        elif name.endswith("shared_expert_gate.weight") and len(shape) == 1:  # a row, whether stored 1-d or 2-d
            shape = [1, *shape]
        return Deferred(shape, np.float32, lambda: self._dequantized(source, shape, expert))

    def _dequantized(self, source: str, shape: list[int], expert: int | None = None) -> np.ndarray:
        tensor = self._tensors[source]
        values = _float32(self.path, tensor, expert)
        if values.size != int(np.prod(shape, dtype=np.int64)):
            raise ModelFolderError(f"{self.path}: tensor {source!r} holds {values.size} values, not {shape}")
        values = values.reshape(shape)
        values = self._rows_back(source, values)
        if self.arch.norms_plus_one and source.endswith("norm.weight"):  # stored as 1 + w for llama.cpp
            values = values - np.float32(1)
        return np.ascontiguousarray(values)

    def get(self, name: str) -> np.ndarray:
        return self.deferred(name).compute()

    def names(self) -> list[str]:
        """Every tensor of the file, by its transformers name."""
        return list(self._names)

    def unused(self) -> list[str]:
        return sorted(n for n in self._names if n not in self._read)

    def _block_bytes(self, source: str) -> int | None:
        """The bytes of one block of 32 where the tensor is Q4_0 (18) or Q4_1 (20) and 2-d, else None."""
        import gguf

        tensor = self._tensors[source]
        kinds = {gguf.GGMLQuantizationType.Q4_0: 18, gguf.GGMLQuantizationType.Q4_1: 20}
        return kinds.get(tensor.tensor_type) if len(tensor.shape) == 2 else None

    def has_blocks(self, name: str) -> bool:
        """Whether the tensor is Q4_0 or Q4_1 (`blocks` reads it)."""
        source = self._names.get(name)
        return source is not None and self._block_bytes(source) is not None

    def blocks(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A Q4_0 or Q4_1 tensor's own 4-bit blocks of 32 (`has_blocks`): q [N, K / 32, 32] (0..15), scales
        and minimums [N, K / 32], w = scale q + minimum, rows in transformers' order."""
        source = self._names[name]
        size = self._block_bytes(source)
        assert size is not None, name
        tensor = self._tensors[source]
        k, n = (int(d) for d in tensor.shape)
        raw = np.asarray(tensor.data, np.uint8).reshape(n, k // 32, size)
        scales = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        if size == 20:  # Q4_1: w = scale q + minimum
            minimums, packed = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32), raw[..., 4:]
        else:  # Q4_0: w = scale (q - 8)
            minimums, packed = -8 * scales, raw[..., 2:]
        q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)  # a block's first 16 in the low nibbles
        q, scales, minimums = (self._rows_back(source, a) for a in (q, scales, minimums))
        return np.ascontiguousarray(q), scales, minimums

    def _rows_back(self, source: str, rows: np.ndarray) -> np.ndarray:
        """Llama's q/k rows (the first axis) in transformers' order: llama.cpp's converter reorders them."""
        if not self.arch.permuted_qk or not (".attn_q." in source or ".attn_k." in source):
            return rows
        heads = self.config.heads if ".attn_q." in source else self.config.kv_heads
        n = rows.shape[0]
        return rows.reshape(heads, n // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)

    def write_tokenizer(self, out: Path) -> None:
        """tokenizer.json (and the chat template, as tokenizer_config.json holds it) from the file."""
        from tokenizers import AddedToken, Tokenizer, processors

        kind = _value(self._reader, "tokenizer.ggml.model")
        tokens = [str(t) for t in _value(self._reader, "tokenizer.ggml.tokens", [])]
        types = list(_value(self._reader, "tokenizer.ggml.token_type", []))
        if not tokens or len(types) not in (0, len(tokens)):
            raise ModelFolderError(f"{self.path}: the GGUF tokenizer has {len(tokens)} tokens and {len(types)} types")
        ids = {t: _value(self._reader, f"tokenizer.ggml.{t}_token_id") for t in ("bos", "eos", "unknown")}
        for token in ids.values():
            if token is not None and not 0 <= int(token) < len(tokens):
                raise ModelFolderError(f"{self.path}: GGUF token id {token} lies outside its {len(tokens)} tokens")
        spelled = tokens  # as the file spells them: user-defined tokens are added only as it does
        tokenizer: Tokenizer
        if kind == "gpt2":
            tokenizer = self._byte_level(tokens)
        elif kind == "llama" and self.arch.gemma_vocabulary:
            tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]  # spaces as "▁"
            unknown = ids["unknown"]
            tokenizer = _gemma_sentencepiece(tokens, tokens[int(unknown)] if unknown is not None else None)
        elif kind == "llama":  # Llama 2's, Mistral 7B's, TinyLlama's: SentencePiece's BPE by its scores
            scores = list(_value(self._reader, "tokenizer.ggml.scores", []))
            if len(scores) != len(tokens) or not all(isinstance(s, (int, float)) for s in scores):
                raise ModelFolderError(f"{self.path}: the GGUF tokenizer has {len(tokens)} tokens and {len(scores)} "
                                       "scores, not a number for each")  # fmt: skip
            unknown = ids["unknown"]
            prefix = bool(_value(self._reader, "tokenizer.ggml.add_space_prefix", True))  # llama.cpp's default
            tokenizer = _llama_sentencepiece(
                tokens, [float(s) for s in scores], tokens[int(unknown)] if unknown is not None else None, prefix
            )
        else:
            raise ModelFolderError(f"{self.path}: a {kind!r} tokenizer in a GGUF {self.arch.family} is not supported "
                                   "yet; export the model's transformers folder")  # fmt: skip
        special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL]
        tokenizer.add_special_tokens(special)
        plain = [
            AddedToken(t, special=False, normalized=False)
            for t, file_t, k in zip(tokens, spelled, types)
            if k == _USER_DEFINED and t == file_t  # a respelled one ("  " as "▁▁") is left to the merges
        ]
        tokenizer.add_tokens(plain)
        bos, eos = ids["bos"], ids["eos"]
        if _value(self._reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
            tokenizer.post_processor = processors.TemplateProcessing(
                single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]}:1 $B:1",
                special_tokens=[(tokens[bos], int(bos))],
            )  # fmt: skip
        out.mkdir(parents=True, exist_ok=True)
        tokenizer.save(str(out / "tokenizer.json"))
        template = _value(self._reader, "tokenizer.chat_template")
        if template is not None:
            document = {"chat_template": str(template)}
            if eos is not None:
                document["eos_token"] = tokens[int(eos)]
            if bos is not None:
                document["bos_token"] = tokens[int(bos)]
            (out / "tokenizer_config.json").write_text(json.dumps(document, indent=1))

    def _byte_level(self, tokens: list[str]) -> Any:
        """Byte-level BPE (`tokenizer.ggml.model` gpt2): the file's merges, llama.cpp's pre-tokenizer."""
        from tokenizers import Tokenizer, decoders, models

        pre = _value(self._reader, "tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            known = ", ".join(sorted(PRE_TOKENIZERS))
            raise ModelFolderError(f"{self.path}: GGUF pre-tokenizer {pre!r} is not supported (known: {known}); "
                                   "export the model's transformers folder")  # fmt: skip
        merges: list[tuple[str, str]] = []
        for merge in _value(self._reader, "tokenizer.ggml.merges", []):
            left, sep, right = str(merge).partition(" ")
            if not sep:
                raise ModelFolderError(f"{self.path}: GGUF merge {str(merge)[:40]!r} is not two tokens")
            merges.append((left, right))
        tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
        tokenizer.pre_tokenizer = pre_tokenizer(pre)
        tokenizer.decoder = decoders.ByteLevel()
        return tokenizer


def pre_tokenizer(pre: str) -> Any:
    """llama.cpp's pre-tokenizer for a file's `tokenizer.ggml.pre` (a key of PRE_TOKENIZERS), then bytes."""
    from tokenizers import Regex, pre_tokenizers

    splits: list[Any] = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[pre]]
    splits.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(splits)


def _merges_from_order(tokens: list[str]) -> list[tuple[str, str]]:
    """A SentencePiece vocabulary's BPE merges, which Gemma's files do not list: every split of a token into
    two tokens, earlier tokens first (Gemma's merge order is its file order; transformers' GGUF reader
    recovers them the same way, `generate_merges` with each token's position as its score)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found: list[tuple[str, str, int]] = []
    for merged, index in vocab.items():
        local = [(merged[:cut], merged[cut:]) for cut in range(1, len(merged))]
        local = [pair for pair in local if pair[0] in vocab and pair[1] in vocab]
        local.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        found += [(left, right, index) for left, right in local]
    found.sort(key=lambda m: (-m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _gemma_sentencepiece(tokens: list[str], unknown: str | None) -> Any:
    """Gemma's tokenizer as transformers writes it: BPE over "▁"-spelled spaces, bytes as a fallback."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tokens)}
    model = models.BPE(vocab=vocab, merges=_merges_from_order(tokens), unk_token=unknown, fuse_unk=True,
                       byte_fallback=True)  # fmt: skip
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )  # fmt: skip
    return tokenizer


def _merges_by_score(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """A SentencePiece BPE vocabulary's merges, which llama.cpp's files do not list: every split of a token into
    two tokens, ranked by the merged token's score (SentencePiece's BPE joins the adjacent pair whose join
    scores highest, as llama.cpp's tokenizer does), a token's own splits by their parts' scores (transformers'
    GGUF reader ranks them the same way)."""
    score = dict(zip(tokens, scores))
    found: list[tuple[str, str, float]] = []
    for merged, merged_score in score.items():
        local = [(merged[:cut], merged[cut:]) for cut in range(1, len(merged))]
        local = [pair for pair in local if pair[0] in score and pair[1] in score]
        local.sort(key=lambda pair: (score[pair[0]], score[pair[1]]), reverse=True)
        found += [(left, right, merged_score) for left, right in local]
    found.sort(key=lambda m: m[2], reverse=True)  # stable: a token's splits keep their order
    return [(left, right) for left, right, _ in found]


def _llama_sentencepiece(tokens: list[str], scores: list[float], unknown: str | None, space_prefix: bool) -> Any:
    """A SentencePiece BPE vocabulary (`tokenizer.ggml.model` llama) as llama.cpp tokenizes with it: spaces
    as "▁", one before the text and after each special token where the file asks (`add_space_prefix`, on by
    default), pieces joined by score, bytes as a fallback."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {t: i for i, t in enumerate(tokens)}
    model = models.BPE(vocab=vocab, merges=_merges_by_score(tokens, scores), unk_token=unknown, fuse_unk=True,
                       byte_fallback=True)  # fmt: skip
    tokenizer = Tokenizer(model)
    # a normalizer runs on each stretch of text between special tokens: the prefix comes after each of them,
    # as llama.cpp adds it after each special token (a pre-tokenizer's "first" scheme would not)
    spaces = normalizers.Replace(" ", "\u2581")
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), spaces]) if space_prefix else spaces
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer
