"""A decode step's attention alone: Quiver's `ai.quiver::DecodeAttention` against ONNX Runtime's
GroupQueryAttention (com.microsoft, the kernel it replaces) on the same inputs, at Llama-3.2-3B's shapes (24
query heads, 8 kv heads of 128), one new row, every layer's own keys and values (28 layers: 4.8 MB a layer at
590 positions, 135 MB a step, more than the caches hold), past and present one buffer as Quiver binds them.
One session of each, 2 threads both, the order turning round by round: the milliseconds for the 28 layers
and the keys' and values' bytes read per second. JSON on stdout.

    python benchmarks/decode_attention.py [--rounds 5] [--positions 590 2000]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from quiver.backends.cpu.native_ops import built_library, lowered
from quiver.ir.quiver_ops import DECODE_ATTENTION, QUIVER_DOMAIN
from quiver.testing.attention import INPUTS, attention_model
from timing import alternating_medians

HEADS, KV_HEADS, HEAD_SIZE, LAYERS, BUFFER, THREADS = 24, 8, 128, 28, 2048, 2


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = THREADS
    library = built_library()
    if isinstance(library, str):
        raise SystemExit(f"Quiver's native library is not built here: {library}")
    options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _step(
    session: ort.InferenceSession, caches: list[tuple[np.ndarray, np.ndarray]], feeds: dict[str, np.ndarray]
) -> Callable[[], None]:
    """A step's attention over every layer's own keys and values, written in place (past = present)."""
    bindings = []
    for key, value in caches:
        binding = session.io_binding()
        for name, array in {**feeds, "past_key": key, "past_value": value}.items():
            binding.bind_cpu_input(name, array)
        binding.bind_output("out")
        binding.bind_output("present_key", "cpu", 0, np.float32, list(key.shape), key.ctypes.data)
        binding.bind_output("present_value", "cpu", 0, np.float32, list(value.shape), value.ctypes.data)
        bindings.append(binding)

    def run() -> None:
        for binding in bindings:
            session.run_with_iobinding(binding)

    return run


def measure(positions: int, rounds: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    shape = (1, KV_HEADS, BUFFER, HEAD_SIZE)
    caches = [(rng.standard_normal(shape, np.float32), rng.standard_normal(shape, np.float32)) for _ in range(LAYERS)]
    angles = rng.uniform(0, 6.3, (BUFFER, HEAD_SIZE // 2))
    feeds = {
        "query": rng.standard_normal((1, 1, (HEADS + 2 * KV_HEADS) * HEAD_SIZE), np.float32),
        "seqlens_k": np.array([positions - 1], np.int32),
        "total_sequence_length": np.array([positions], np.int32),
        "cos": np.cos(angles).astype(np.float32),
        "sin": np.sin(angles).astype(np.float32),
    }
    # q, k and v packed in the query, rotary on, as Quiver's exports write it; ORT's form as Quiver lowers it
    ours = attention_model(DECODE_ATTENTION, QUIVER_DOMAIN, [n for n in INPUTS if n not in ("key", "value")],
                           num_heads=HEADS, kv_num_heads=KV_HEADS, do_rotary=1)  # fmt: skip
    steps = {
        "quiver DecodeAttention": _step(_session(ours), caches, feeds),
        "ort GroupQueryAttention": _step(_session(lowered(ours)), caches, feeds),
    }
    samples = alternating_medians(steps, rounds, iterations=20, warm_up=3)
    read = LAYERS * 2 * KV_HEADS * positions * HEAD_SIZE * 4  # the keys and values a step reads
    result: dict[str, Any] = {"positions": positions, "bytes_read": read}
    for name, rounds_ms in samples.items():
        ms = statistics.median(rounds_ms)
        result[name] = {"ms": ms, "gb_s": read / ms / 1e6, "rounds_ms": rounds_ms}
    result["quiver_over_ort"] = result["quiver DecodeAttention"]["ms"] / result["ort GroupQueryAttention"]["ms"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--positions", type=int, nargs="+", default=[590, 2000])
    args = parser.parse_args()
    print(json.dumps({
        "shapes": f"{HEADS} heads, {KV_HEADS} kv heads of {HEAD_SIZE}, {LAYERS} layers, buffers of {BUFFER}",
        "threads": THREADS,
        "rounds": args.rounds,
        "steps": [measure(p, args.rounds) for p in args.positions],
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
