"""Reads a GGUF file (llama.cpp's format) as a model: its config, its weights dequantized, its tokenizer.

The file's metadata becomes the transformers config the families read (`families.read_config_fields`),
strictly as they read config.json: a metadata key of the architecture Quiver does not know is refused.
Tensor names map to transformers' (`blk.N.attn_q` -> `model.layers.N.self_attn.q_proj`), with llama.cpp's
reordering of Llama's q/k rows undone; every block type the `gguf` package knows is dequantized to float32
(exact: what llama.cpp computes with), then the export goes on as from a folder (`--weight-bitwidth`
quantizes again). The tokenizer is rebuilt as a tokenizer.json: byte-level BPE with the file's tokens and
merges, the pre-tokenizer llama.cpp uses for the file's `tokenizer.ggml.pre`, its control tokens special;
the chat template is the file's. What this does not cover is refused in one line: other architectures,
SentencePiece vocabularies, pre-tokenizers not listed, Llama 3's rope factors.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from quiver.errors import ModelFolderError
from quiver.t2t.families import DecoderConfig, read_config_fields

GGUF_MAGIC = b"GGUF"
# llama.cpp's architecture -> the transformers class whose recipe reads it, and its metadata -> config
_ARCHITECTURES = {"llama": "LlamaForCausalLM"}
_LLAMA_KEYS = {
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
}
_NAMES = [  # GGUF tensor name -> transformers'
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.attn_q\.(weight|bias)", r"model.layers.\1.self_attn.q_proj.\2"),
    (r"blk\.(\d+)\.attn_k\.(weight|bias)", r"model.layers.\1.self_attn.k_proj.\2"),
    (r"blk\.(\d+)\.attn_v\.(weight|bias)", r"model.layers.\1.self_attn.v_proj.\2"),
    (r"blk\.(\d+)\.attn_output\.(weight|bias)", r"model.layers.\1.self_attn.o_proj.\2"),
    (r"blk\.(\d+)\.ffn_gate\.(weight|bias)", r"model.layers.\1.mlp.gate_proj.\2"),
    (r"blk\.(\d+)\.ffn_up\.(weight|bias)", r"model.layers.\1.mlp.up_proj.\2"),
    (r"blk\.(\d+)\.ffn_down\.(weight|bias)", r"model.layers.\1.mlp.down_proj.\2"),
]
# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp), applied in turn, each piece split again by the next
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZERS = {
    "smollm": [r"\p{N}", _GPT2],
    "gpt-2": [_GPT2],
    "default": [_GPT2],
    "llama-bpe": [_LLAMA3],
    "llama3": [_LLAMA3],
}
_CONTROL = 3  # llama.cpp's token type of special tokens (`<|im_start|>`)


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
        self._tensors = {t.name: t for t in self._reader.tensors}
        if "rope_freqs.weight" in self._tensors:
            raise ModelFolderError(f"{path}: Llama 3's rope factors (rope_freqs) in GGUF are not supported yet; "
                                   "export the model's transformers folder")  # fmt: skip
        self.config = read_config_fields(self._config(arch), path)
        self._names: dict[str, str] = {}
        for name in self._tensors:
            hf = next((re.sub(f"^{p}$", r, name) for p, r in _NAMES if re.fullmatch(p, name)), None)
            if hf is None:
                raise ModelFolderError(f"{path}: tensor {name!r} has no place in Quiver's {self.config.architecture}; "
                                       "the text would differ")  # fmt: skip
            self._names[hf] = name
        self._read: set[str] = set()

    def _config(self, arch: str) -> dict[str, Any]:
        prefix = f"{arch}."
        raw: dict[str, Any] = {"architectures": [_ARCHITECTURES[arch]], "hidden_act": "silu"}
        for key in self._reader.fields:
            if not key.startswith(prefix):
                continue
            short = key[len(prefix) :]
            if short == "rope.dimension_count":
                continue  # checked below against the head size
            if short not in _LLAMA_KEYS:
                raise ModelFolderError(f"{self.path}: GGUF metadata {key!r} is not supported by Quiver; the text "
                                       "would differ from the model's")  # fmt: skip
            raw[_LLAMA_KEYS[short]] = _value(self._reader, key)
        tokens = self._reader.fields.get("tokenizer.ggml.tokens")
        if "vocab_size" not in raw and tokens is not None:
            raw["vocab_size"] = len(tokens.data)
        raw["tie_word_embeddings"] = "output.weight" not in self._tensors
        heads, hidden = raw.get("num_attention_heads"), raw.get("hidden_size")
        rotary = _value(self._reader, f"{prefix}rope.dimension_count")
        if rotary is not None and isinstance(heads, int) and isinstance(hidden, int) and heads:
            if rotary != raw.get("head_dim", hidden // heads):
                raise ModelFolderError(f"{self.path}: partial rotary ({rotary} dimensions) in GGUF is not supported")
        for token, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("padding", "pad_token_id")):
            value = _value(self._reader, f"tokenizer.ggml.{token}_token_id")
            if value is not None:
                raw[key] = int(value)
        return raw

    def get(self, name: str) -> np.ndarray:
        import gguf

        source = self._names.get(name)
        if source is None:
            raise ModelFolderError(f"{self.path}: the GGUF file has no tensor for {name!r}")
        self._read.add(name)
        tensor = self._tensors[source]
        shape = [int(d) for d in reversed(tensor.shape)]  # GGUF lists the innermost dimension first
        try:
            values = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32).reshape(shape)
            if ".attn_q." in source or ".attn_k." in source:  # llama.cpp reorders Llama's q/k rows: undone
                heads = self.config.heads if ".attn_q." in source else self.config.kv_heads
                values = values.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
        except (ValueError, NotImplementedError) as exc:
            raise ModelFolderError(f"{self.path}: tensor {source!r} ({tensor.tensor_type.name}, {shape}) cannot be "
                                   f"read ({exc})") from None  # fmt: skip
        return np.ascontiguousarray(values)

    def names(self) -> list[str]:
        """Every tensor of the file, by its transformers name."""
        return list(self._names)

    def unused(self) -> list[str]:
        return sorted(n for n in self._names if n not in self._read)

    def blocks(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """A Q4_0 or Q4_1 tensor's own 4-bit blocks of 32 (None for any other type): q [N, K / 32, 32]
        (0..15), scales and minimums [N, K / 32], w = scale q + minimum, rows in transformers' order."""
        import gguf

        source = self._names.get(name)
        if source is None:
            return None
        tensor = self._tensors[source]
        kinds = {gguf.GGMLQuantizationType.Q4_0: 18, gguf.GGMLQuantizationType.Q4_1: 20}
        if tensor.tensor_type not in kinds or len(tensor.shape) != 2:
            return None
        k, n = (int(d) for d in tensor.shape)
        size = kinds[tensor.tensor_type]
        raw = np.asarray(tensor.data, np.uint8).reshape(n, k // 32, size)
        scales = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        if tensor.tensor_type == gguf.GGMLQuantizationType.Q4_1:
            minimums, packed = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32), raw[..., 4:]
        else:  # Q4_0: w = scale (q - 8)
            minimums, packed = -8 * scales, raw[..., 2:]
        q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)  # a block's first 16 in the low nibbles
        if ".attn_q." in source or ".attn_k." in source:  # the rows llama.cpp reordered, put back
            heads = self.config.heads if ".attn_q." in source else self.config.kv_heads

            def rows(a: np.ndarray) -> np.ndarray:
                return a.reshape(heads, n // heads // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)

            q, scales, minimums = rows(q), rows(scales), rows(minimums)
        return np.ascontiguousarray(q), scales, minimums

    def write_tokenizer(self, out: Path) -> None:
        """tokenizer.json (and the chat template, as tokenizer_config.json holds it) from the file."""
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

        kind = _value(self._reader, "tokenizer.ggml.model")
        pre = _value(self._reader, "tokenizer.ggml.pre", "default")
        if kind != "gpt2":
            raise ModelFolderError(f"{self.path}: a {kind!r} tokenizer (SentencePiece) in GGUF is not supported yet; "
                                   "export the model's transformers folder")  # fmt: skip
        if pre not in _PRE_TOKENIZERS:
            known = ", ".join(sorted(_PRE_TOKENIZERS))
            raise ModelFolderError(f"{self.path}: GGUF pre-tokenizer {pre!r} is not supported (known: {known}); "
                                   "export the model's transformers folder")  # fmt: skip
        tokens = [str(t) for t in _value(self._reader, "tokenizer.ggml.tokens", [])]
        merges: list[tuple[str, str]] = []
        for merge in _value(self._reader, "tokenizer.ggml.merges", []):
            left, sep, right = str(merge).partition(" ")
            if not sep:
                raise ModelFolderError(f"{self.path}: GGUF merge {str(merge)[:40]!r} is not two tokens")
            merges.append((left, right))
        types = list(_value(self._reader, "tokenizer.ggml.token_type", []))
        if not tokens or len(types) not in (0, len(tokens)):
            raise ModelFolderError(f"{self.path}: the GGUF tokenizer has {len(tokens)} tokens and {len(types)} types")
        tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
        splits: list[Any] = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _PRE_TOKENIZERS[pre]]
        splits.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(splits)
        tokenizer.decoder = decoders.ByteLevel()
        special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL]
        tokenizer.add_special_tokens(special)
        bos, eos = (_value(self._reader, f"tokenizer.ggml.{t}_token_id") for t in ("bos", "eos"))
        for token in (bos, eos):
            if token is not None and not 0 <= int(token) < len(tokens):
                raise ModelFolderError(f"{self.path}: GGUF token id {token} lies outside its {len(tokens)} tokens")
        if _value(self._reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
            tokenizer.post_processor = processors.TemplateProcessing(
                single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], int(bos))]
            )
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


def read_gguf(path: Path) -> tuple[DecoderConfig, GgufModel]:
    model = GgufModel(path)
    return model.config, model
