"""Quiver's own ONNX Runtime kernels (domain `ai.quiver`): built at first use, or lowered to ORT's ops.

`DecodeAttention` is ORT's GroupQueryAttention (the same inputs, outputs and attributes) for a decode
step's few rows, a layer's keys and values read once per kv head (`native/decode_attention.c`); lowered,
it is GroupQueryAttention again.

`MatMul4Bits(A, B, halves[, scales, offsets])` multiplies A by 4-bit blocks of 32 with a scale and a
minimum each (GGUF's Q4_1: w = s q + m): B [N, K/32, 16] in MatMulNBits' layout, `halves` float16
[N, 2, K/32] (a column's scales, then its minimums). `scales` ([N * K/32], float) and `offsets` ([K/32, N]
float, m + 8 s) are the same blocks as ORT's operators take them (MatMulNBits with zero point 8, plus each
block's sum of A times the offsets); exports leave them out and the lowering makes them of `halves`.
Attribute `symmetric` marks blocks with m = -8 s (`rtn`'s: ORT's MatMulNBits alone in its place). The
weights are read where they lie: nothing is packed or copied when a session is made, so a context's
mapped blocks are all the memory they take. ONNX Runtime has no fast kernel for float minimums, and
packs its own copy of every block at each session, so Quiver carries one (`native/matmul_4bits.c`):
a few rows (a decode step) with A's blocks rounded to 16 bits (exact to ~2e-5 of the float product; a
node marked `few_rows`, or below level 4), else to 8 bits as ORT's int8 kernel does (`rtn`'s);
many (a prompt, 8 rows and more) as MLAS does, on 8 bits with VNNI's integer products (accuracy level
4, the backend's default), or on 8 bits twice, A then what that loses (~16 bits: a node or backend at
a level below 4, as `rtn-min`'s and `hqq`'s prompts ask).

The library (`native/*.c`) is compiled with the machine's C compiler at first use (`$CC`, else `cc`,
`gcc` or `clang`; `-O3 -march=native`) into the user's cache (`$QUIVER_NATIVE`, else
~/.cache/quiver/native), keyed by the sources, the compiler and the processor, and used where it has a
fast path (x86-64 with AVX-512 VNNI, or AVX2 with FMA and F16C: there a prompt takes the 16-bit path).
Elsewhere — no compiler, another processor, `QUIVER_NATIVE=off`, a build that failed — each node is
lowered to ORT's own operators on `scales` and `offsets`, the same numbers within the rounding:
MatMulNBits at float activations plus the minimums' product (a symmetric node: MatMulNBits alone, at
the session's accuracy level), or, for a node marked `few_rows` (a decode step's), MatMulNBits on the
input's exact rows (the input and what ORT's int8 grid loses of it, as two rows: the remainder's
rounding is 255 times finer).
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from quiver.formats.files import cache_folder_setting
from quiver.ir import proto
from quiver.ir.nibbles import pack_nibbles
from quiver.ir.quiver_ops import DECODE_ATTENTION, MATMUL_4BITS
from quiver.ir.quiver_ops import MATMUL_4BITS_BLOCK as BLOCK
from quiver.ir.quiver_ops import QUIVER_DOMAIN as DOMAIN
from quiver.portable import at_fork

MS_DOMAIN = "com.microsoft"  # ONNX Runtime's contrib operators (MatMulNBits)
SETTING = "QUIVER_NATIVE"  # off: never built nor used; a folder: where the build is kept
_NATIVE = Path(__file__).parent / "native"
# the library's sources (one op a file, and its entry point) and the header they share
SOURCES = tuple(_NATIVE / name for name in ("matmul_4bits.c", "decode_attention.c", "register.c"))
_HEADER = _NATIVE / "ort_abi.h"
_LIBRARY = "libquiver_ops.so"
_BUILD_TIMEOUT_S = 300


@dataclass(frozen=True)
class NativeOps:
    """The built library (`path`), or why there is none (`reason`)."""

    path: Path | None
    reason: str = ""


_lock = threading.Lock()
_built: NativeOps | None = None


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # a parent's thread may have held it, building, as the process forked


at_fork(after_in_child=_after_fork_in_child)


def native_ops() -> NativeOps:
    """The library, built on the first call in this process (a few seconds, once per machine: kept in the
    cache), or why Quiver's kernel is not used here."""
    global _built
    with _lock:
        if _built is None:
            _built = _build()
        return _built


def _processor() -> str:
    """What `-march=native` depends on: the processor's name and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(lines)))


def _compiler() -> str | None:
    import shutil

    named = os.environ.get("CC", "").strip()
    if named:
        return shutil.which(named.split()[0])
    return next((found for c in ("cc", "gcc", "clang") if (found := shutil.which(c))), None)


def _build() -> NativeOps:
    built = built_library()
    if not isinstance(built, Path):
        return NativeOps(None, built)
    try:
        fast = int(ctypes.CDLL(str(built)).quiver_fast())
    except (OSError, AttributeError) as exc:
        return NativeOps(None, f"its build {built} does not load: {exc}; delete that folder to build it again")
    if not fast:
        return NativeOps(None, "this processor has neither AVX-512 VNNI nor AVX2 with FMA and F16C (its fast paths)")
    return NativeOps(built)


def built_library() -> Path | str:
    """The library built for this machine (made now if it is not in the cache), whatever paths it has
    (the portable one too), else why not."""
    import hashlib
    import subprocess  # the process's first build costs these imports, not every process's import

    folder = cache_folder_setting(SETTING, "native")
    if folder is None:
        return f"turned off ({SETTING}=off)"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"its fast path is for x86-64 Linux (this is {platform.system()} {platform.machine()})"
    compiler = _compiler()
    if compiler is None:
        return "no C compiler found (set CC, or install gcc or clang)"
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"the C compiler {compiler} does not run: {exc}"
    code = [path.read_bytes() for path in (*SOURCES, _HEADER)]
    key = hashlib.sha256(b"\0".join([*code, compiler.encode(), version, _processor().encode()]))
    target = folder / key.hexdigest()[:20] / _LIBRARY
    for place in (folder, target.parent):  # code this process loads: only its user may have written it
        try:
            status = place.stat()
        except OSError:
            continue  # made below, owner-only
        if status.st_uid != os.getuid() or status.st_mode & 0o022:
            return f"{place} is not this user's alone (chmod go-w, or set {SETTING} to a folder of your own)"
    if not target.is_file():
        failed = _compile(compiler, target)
        if failed:
            return failed
    return target


def _compile(compiler: str, target: Path) -> str:
    """Compiles the source into `target` (written aside, then renamed: another process never sees half of
    it); "" when done, else what went wrong."""
    import subprocess
    import tempfile

    try:
        # owner-only, as code this process will load: another user writing there would run as this one
        target.parent.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        target.parent.mkdir(mode=0o700, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as scratch:
            made = Path(scratch) / _LIBRARY
            command = [compiler, "-O3", "-march=native", "-shared", "-fPIC", "-pthread", "-o", str(made),
                       *map(str, SOURCES), "-lm"]  # fmt: skip
            result = subprocess.run(command, capture_output=True, timeout=_BUILD_TIMEOUT_S, check=False, text=True)
            if result.returncode != 0:
                first = (result.stderr.strip().splitlines() or ["no message"])[0]
                return f"its build failed ({compiler}: {first})"
            os.replace(made, target)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"it could not be built in {target.parent}: {exc}"
    return ""


def uses_native_ops(model: proto.ModelProto) -> bool:
    return any(node.domain == DOMAIN for node in model.graph.node)


def _library_for(model: bytes) -> Path | None:
    """The built library, for a model that names Quiver's domain (built on first need); else None."""
    return native_ops().path if DOMAIN.encode() in model else None


@functools.cache
def _entry(library: Path) -> Any:
    """The library's RegisterCustomOps, loaded once per process (not at every session)."""
    entry = ctypes.CDLL(str(library)).RegisterCustomOps
    entry.restype, entry.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_void_p]
    return entry


def register_python(options: object, model: bytes) -> None:
    """Registers the library with ORT Python-API session options, for a model that uses its ops."""
    built = _library_for(model)
    if built is not None:
        options.register_custom_ops_library(str(built))  # type: ignore[attr-defined]


def register_c(options: int, api_base: int, model: bytes) -> int:
    """Registers the library with C-API session options (`api_base`: that ORT's OrtApiBase); the
    OrtStatus* its entry point returns (0: done, or nothing to register)."""
    built = _library_for(model)
    return 0 if built is None else int(_entry(built)(options, api_base) or 0)


def lowered(model: proto.ModelProto) -> proto.ModelProto:
    """The model with each of Quiver's nodes as ORT's own operators: `DecodeAttention` as GroupQueryAttention,
    `MatMul4Bits` as the module says; the constants they
    add (the block-sum matrices, the identity blocks, ORT's form of `halves` where the node names none)
    inline or as nodes on constants, which ORT folds when it makes the session."""
    from onnx import helper, numpy_helper

    result = proto.ModelProto()
    result.CopyFrom(model)
    graph = result.graph
    nodes: list[proto.NodeProto] = []
    sums: dict[str, str] = {}  # input -> its block sums
    exact: dict[str, str] = {}  # input -> its exact rows
    weights: dict[str, np.ndarray] = {}  # the constants added
    formed: dict[str, tuple[str, str]] = {}  # halves -> ORT's scales and offsets made of them
    for node in graph.node:
        if node.domain == DOMAIN and node.op_type == DECODE_ATTENTION:  # ORT's own, the same inputs and attributes
            attention = proto.NodeProto()
            attention.CopyFrom(node)
            attention.op_type, attention.domain = "GroupQueryAttention", MS_DOMAIN
            nodes.append(attention)
            continue
        if node.domain != DOMAIN or node.op_type != MATMUL_4BITS:
            nodes.append(node)
            continue
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        k, n = int(attributes["K"]), int(attributes["N"])
        few_rows, symmetric = bool(attributes.get("few_rows", 0)), bool(attributes.get("symmetric", 0))
        source, out = node.input[0], node.output[0]
        scales, minimums = (node.input[i] if len(node.input) > i else "" for i in (3, 4))
        if not scales or (not minimums and not symmetric):  # ORT's form from the halves, folded at the session
            if node.input[2] not in formed:
                made, formed[node.input[2]] = _ort_form(node.input[2], k, n, weights, with_offsets=not symmetric)
                nodes += made
            scales, minimums = formed[node.input[2]]
        if symmetric and not few_rows:  # w = s (q - 8): MatMulNBits alone, at the session's accuracy level
            nodes.append(helper.make_node("MatMulNBits", [source, node.input[1], scales], [out], name=node.name,
                                          domain=MS_DOMAIN, K=k, N=n, bits=4, block_size=BLOCK))  # fmt: skip
            continue
        read = source
        if few_rows:
            if source not in exact:
                exact[source], made = _exact_rows(weights, source)
                nodes += made
            read = exact[source]
        level: dict[str, Any] = {} if few_rows else {"accuracy_level": 0}
        nodes.append(helper.make_node(
            "MatMulNBits", [read, node.input[1], scales], [f"{out}.q4"], name=f"{node.name}.q4",
            domain=MS_DOMAIN, K=k, N=n, bits=4, block_size=BLOCK, **level,
        ))  # fmt: skip
        terms = [f"{out}.q4"]
        if few_rows:  # the rows' products, the input's and its remainder's, summed
            terms = [f"{out}.grid", f"{out}.remainder"]
            nodes.append(helper.make_node("Split", [f"{out}.q4"], terms, name=f"{node.name}.split", axis=-2,
                                          num_outputs=2))  # fmt: skip
        if not symmetric:  # each block's sum of x times its offset
            if source not in sums:
                sums[source] = f"{source}.block_sums"
                ones = f"{sums[source]}.blocks"
                weights[ones] = np.kron(np.eye(k // BLOCK, dtype=np.float32), np.ones((BLOCK, 1), np.float32))
                nodes.append(helper.make_node("MatMul", [source, ones], [sums[source]], name=sums[source]))
            nodes.append(helper.make_node("MatMul", [sums[source], minimums], [f"{out}.minimums"],
                                          name=f"{node.name}.minimums"))  # fmt: skip
            terms.append(f"{out}.minimums")
        nodes.append(helper.make_node("Sum", terms, [out], name=node.name))
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(numpy_helper.from_array(array, name) for name, array in weights.items())
    kept = [o for o in result.opset_import if o.domain != DOMAIN]
    del result.opset_import[:]
    result.opset_import.extend(kept)
    if not any(o.domain == MS_DOMAIN for o in kept):
        result.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return result


def _ort_form(
    halves: str, k: int, n: int, weights: dict[str, np.ndarray], with_offsets: bool
) -> tuple[list[proto.NodeProto], tuple[str, str]]:
    """Nodes making ORT's tensors from `halves` [N, 2, K/32] (float16): the scales [N * K/32] and, if
    `with_offsets`, the offsets [K/32, N] (m + 8 s), both float; constant, so ORT folds them once when it
    makes the session. The nodes, and the two tensors' names."""
    from onnx import TensorProto, helper

    at = f"{halves}.ort"
    constants = {"zero": [0], "one": [1], "two": [2], "flat": [-1], "columns": [n, k // BLOCK]}
    for name, values in constants.items():
        weights[f"{at}.{name}"] = np.array(values, np.int64)
    scales, offsets = f"{at}.scales", f"{at}.offsets"

    def node(op: str, inputs: tuple[str, ...], out: str, **attributes: Any) -> proto.NodeProto:
        return helper.make_node(op, [f"{at}.{i}" for i in inputs], [f"{at}.{out}"], name=f"{at}.{out}", **attributes)

    made = [
        helper.make_node("Cast", [halves], [f"{at}.float"], name=f"{at}.float", to=TensorProto.FLOAT),
        node("Slice", ("float", "zero", "one", "one"), "s"),
        node("Reshape", ("s", "flat"), "scales"),
    ]
    if with_offsets:
        weights[f"{at}.eight"] = np.array(8, np.float32)
        made += [
            node("Slice", ("float", "one", "two", "one"), "m"),
            node("Mul", ("s", "eight"), "8s"),
            node("Add", ("m", "8s"), "m8s"),
            node("Reshape", ("m8s", "columns"), "by_column"),
            node("Transpose", ("by_column",), "offsets", perm=[1, 0]),
        ]
    return made, (scales, offsets if with_offsets else "")


def _exact_rows(weights: dict[str, np.ndarray], source: str) -> tuple[str, list[proto.NodeProto]]:
    """`source`'s rows followed by what ORT's int8 activations lose of them: x's blocks through
    MatMulNBits by the identity are x on the int8 grid that kernel rounds it to, x minus that the
    remainder, both as rows of one input [..., 2 S, K] (the remainder's rounding is 255 times finer)."""
    from onnx import helper

    identity = f"quiver.identity{BLOCK}"
    if f"{identity}.q4" not in weights:
        q = np.full((BLOCK, 1, BLOCK), 8, np.uint8)  # one 4-bit block per row: q 9 on the diagonal, 8 elsewhere
        q[np.arange(BLOCK), 0, np.arange(BLOCK)] = 9
        weights[f"{identity}.q4"] = pack_nibbles(q)
        weights[f"{identity}.scales"] = np.ones(BLOCK, np.float32)
        weights[f"{identity}.blocks"] = np.array([-1, BLOCK], np.int64)
    rows = f"{source}.exact_rows"
    return rows, [
        helper.make_node("Reshape", [source, f"{identity}.blocks"], [f"{rows}.blocks"], name=f"{rows}.blocks"),
        helper.make_node(
            "MatMulNBits", [f"{rows}.blocks", f"{identity}.q4", f"{identity}.scales"], [f"{rows}.grid"],
            name=f"{rows}.grid", domain=MS_DOMAIN, K=BLOCK, N=BLOCK, bits=4, block_size=BLOCK,
        ),
        helper.make_node("Sub", [f"{rows}.blocks", f"{rows}.grid"], [f"{rows}.lost"], name=f"{rows}.lost"),
        helper.make_node("Shape", [source], [f"{rows}.shape"], name=f"{rows}.shape"),
        helper.make_node("Reshape", [f"{rows}.lost", f"{rows}.shape"], [f"{rows}.remainder"],
                         name=f"{rows}.remainder"),
        helper.make_node("Concat", [source, f"{rows}.remainder"], [rows], name=rows, axis=-2),
    ]  # fmt: skip
