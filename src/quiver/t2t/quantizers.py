"""Weight-only quantization of an LLM graph: MatMul weights to 4 or 8 bits per block (ORT's MatMulNBits), and
mixture-of-experts stacks to ORT's QMoE on the same blocks (`rtn` and `rtn-asym` only: see `_experts_in_blocks`).

Quantizers, by name:

* `rtn`: round to nearest, symmetric blocks (ONNX Runtime's `MatMulNBitsQuantizer`): w = s (q - 8). In
  blocks of 32 (the default) each weight is one node of Quiver's own operator, `ai.quiver::MatMul4Bits`
  (the cpu backend's kernel: `quiver.backends.cpu.native_ops`), ORT's blocks with their scales in
  float16 (the minimum -8 s): read where they lie, where ORT's MatMulNBits packs its own copy at each
  session (the open's time and memory at 1B); the activations on 8 bits as ORT's int8 kernel rounds
  them, a prompt's and a decode step's. Where the kernel is not built the node is ORT's MatMulNBits
  again, on the same blocks.
* `rtn-asym`: round to nearest with a 4-bit integer zero point per block (the same quantizer,
  asymmetric): w = s (q - z). In blocks of 32, `MatMul4Bits` nodes too, ORT's blocks with each one's scale
  and minimum -z s in float16 (a tied head that is the token table stays MatMulNBits: its rows are
  gathered from those blocks).
* `rtn-min`: round to nearest with a scale and a float minimum per block, as GGUF's Q4_1 stores them:
  w = s q + m, s = (max - min) / 15, m = min, both then rounded to float16 (as GGUF stores them: every
  form below holds the same weights). Exact for weights already on such a grid (a model dequantized
  from Q4_1, as SmolLM2's are). MatMulNBits' fast kernels take integer zero points only (a float one is
  far slower) and round the activations to int8 (which loses the grid), so in blocks of 32 each weight
  is one `MatMul4Bits` node: a prompt's at accuracy level 0 (its activations on ~16 bits: two 8-bit
  rows), a decode step's (`exact_rows`, a graph of its own) marked `few_rows` (16 bits). Where the
  kernel is not built, ORT's operators in its place (see native_ops); in other block sizes, a prompt's
  x W = MatMulNBits(x; q, s, zero point 8) at float activations (accuracy level 0, set on the node) +
  (x's sums per block) C, C[b, n] = m + 8 s: one small MatMul per projection, the sums once per input
  (a MatMul by ones on each block).
* `hqq`: the same form as `rtn-min` (a scale and a float minimum per block, the same forms), the
  minimum fitted by HQQ (Badri & Shaji, 2023: a few half-quadratic steps that make the rounding error
  sparse, an l0.7 penalty) instead of taken from the block's smallest weight; no calibration.
* `gptq`, `gptq-asym`: 4-bit blocks by GPTQ (`quiver.passes.gptq`), symmetric or with a 4-bit zero point
  per block, from the float model's inputs to each MatMul on calibration prompts (in blocks of 32
  `MatMul4Bits` nodes, as `rtn-asym`'s); weights set to 8 bits (the LM head by default) round to nearest.

The LoRA branches (updateable tensors) stay in float. The LM head is the largest single weight a decode
step reads (SmolLM2: 49152 x 576; Llama 3.2's 128k x 2048). A tied head (its float rows are the token
table the embedding Gather reads) takes one of two layouts:

* `TABLE` (`rtn`, `rtn-asym` at 4 bits: the fast quantizers' default, onnxruntime-genai's int4 layout):
  the head's 4-bit blocks are the token table too; the embedding gathers the bytes of its rows from the
  head's tensors (MatMulNBits', or under `rtn` in blocks of 32 MatMul4Bits': the scales the first half of
  its float16 halves) and dequantizes them in the graph. One copy of the table, at 4 bits.
* `SHORTLIST` (the accurate quantizers' default, and at 8 bits): at 4 bits the head loses most of a small
  model's greedy agreement (measured), so 4-bit blocks rank every token, and the top `SHORTLIST_SIZE`
  logits are computed again from the table's rows (TopK, a Gather of those rows, one small MatMul,
  ScatterElements), the table itself in 8-bit blocks. The ranking blocks are coarser than the layers'
  (`RANKING_BLOCK`, with a zero point each): they only have to keep the float head's best token among
  the top 32, and a decode step reads fewer scales. The float head's choice, unless its best token ranks
  below 32 at 4 bits; the other logits keep their 4-bit values.

An untied head (no float rows without a second copy) takes 8 bits, or float under `rtn-min` and `hqq`
(its 8-bit kernel needs int8 activations to be fast). Overrides change that per weight: rules
`PATTERN=4|8|float` (and `lm_head.weight=shortlist|table`), matched in order against each MatMul's weight
name (transformers', `model.layers.0.mlp.down_proj.weight`; the LM head is `lm_head.weight`, tied or not),
the last match winning. Weights set to 8 bits under `rtn-min` take symmetric 8-bit blocks.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Collection, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from quiver import ort_package
from quiver.errors import QuantizationError
from quiver.ir.deferred import Deferred, Shape, made_together
from quiver.ir.nibbles import pack_nibbles, unpack_bits

if TYPE_CHECKING:  # onnx loads when a model is quantized, not with the CLI that names the quantizers
    import onnx

    from quiver.passes.gptq import BlockWeights

QUANTIZERS = ("rtn", "rtn-asym", "rtn-min", "hqq", "gptq", "gptq-asym")
# the quantizers whose blocks ORT's QMoE takes for mixture-of-experts layers (integer zero points only)
EXPERT_QUANTIZERS = ("rtn", "rtn-asym")
_FC1, _FC2 = 2, 4  # the expert stacks' inputs of ORT's MoE (QMoE: their blocks; scales after each)
MINIMUM_FORM = ("rtn-min", "hqq")  # quantizers whose blocks carry a float minimum (added apart; exact rows)
CALIBRATED = ("gptq", "gptq-asym")  # quantizers that read the float model's inputs on calibration prompts
# quantizers whose tied head is the token table's 4-bit blocks by default (`TABLE`): the fast ones, as
# onnxruntime-genai lays out its int4 models; the accurate ones keep a shortlist over 8-bit rows
FAST_HEAD = ("rtn", "rtn-asym")
DEFAULT_QUANTIZER = "rtn"
# The accuracy level (ORT's MatMulNBits compute type) each quantizer's configs ask for: None leaves the
# backend's default (int8 activations, fastest); `rtn-min`'s and `hqq`'s blocks set their own on the node.
ACCURACY_LEVELS: dict[str, int | None] = {
    "rtn": None,
    "rtn-asym": None,
    "rtn-min": None,
    "hqq": None,
    "gptq": None,
    "gptq-asym": None,
}


TABLE_BITS = 8  # token tables of quantized exports: symmetric 8-bit blocks (SmolLM2 kept 128 of 128 tokens)
SHORTLIST = "shortlist"  # the LM head at 4 bits, its best tokens' logits computed again from float rows
TABLE = "table"  # a tied LM head at 4 bits whose blocks are the token table's rows too (no other copy)
SHORTLIST_SIZE = 32  # how many: the float head's best token ranks below this at 4 bits (almost) never
# The shortlist's ranking blocks (round to nearest, a 4-bit zero point each). Measured on SmolLM2 (2685
# decode positions, greedy and sampled, ORT's int8 activations): the float head's best token ranked at
# worst 12th at blocks of 32 (symmetric), 15th at 128 with zero points, 33rd at 128 without; a head of
# 128-blocks runs ~0.3 ms faster than one of 32-blocks (49152 x 576), ~5 % of a decode step.
RANKING_BLOCK = 128
Width = int | str | None  # a weight's bits: 4, 8, None (float) or, for the LM head only, SHORTLIST or TABLE
Override = tuple[str, Width]  # a weight-name pattern and its width
HEAD_WEIGHT = "lm_head.weight"  # the name overrides match the LM head by, tied or not


def parse_override(rule: str) -> Override:
    """`PATTERN=4|8|float` (an fnmatch pattern over weight names) or `lm_head.weight=shortlist` as a pattern
    and its width."""
    pattern, sep, value = rule.rpartition("=")
    widths: dict[str, Width] = {"4": 4, "8": 8, "float": None, SHORTLIST: SHORTLIST, TABLE: TABLE}
    if not sep or not pattern or value not in widths:
        raise QuantizationError(
            f"quantization override {rule!r}: write PATTERN=4, PATTERN=8 or PATTERN=float (or "
            f"{HEAD_WEIGHT}={SHORTLIST} or {HEAD_WEIGHT}={TABLE}), the pattern over weight names such as "
            f"model.layers.0.mlp.down_proj.weight or {HEAD_WEIGHT}"
        )
    return pattern, widths[value]


def _overridden(name: str, default: Width, overrides: Sequence[Override]) -> Width:
    for pattern, width in overrides:
        if fnmatch.fnmatchcase(name, pattern):
            default = width
    return default


def head_bits(quantizer: str, overrides: Sequence[Override] = (), tied: bool = False, bits: int = 4) -> Width:
    """The LM head's width (None: float, the tied embedding itself): where the head is tied, one set of 4-bit
    blocks for the head and the token table in a 4-bit export by `rtn` or `rtn-asym` (`TABLE`), else a
    shortlist; an untied head 8-bit, or float with `rtn-min` and `hqq`; unless an override says otherwise."""
    table = bits == 4 and quantizer in FAST_HEAD
    default: Width = (TABLE if table else SHORTLIST) if tied else None if quantizer in MINIMUM_FORM else 8
    return _overridden(HEAD_WEIGHT, default, overrides)


def carried_head(overrides: Sequence[Override] = (), tied: bool = True) -> Width:
    """The LM head's width beside a GGUF file's carried blocks: a tied head a shortlist (its 4-bit ranking
    from the file's token table, the best tokens' logits from the table's own rows: the file's values),
    an untied one float; `lm_head.weight` overrides alone (the carried blocks have their bits)."""
    stray = [pattern for pattern, _ in overrides if pattern != HEAD_WEIGHT]
    if stray:
        raise QuantizationError(f"a GGUF file's carried blocks keep their own bits: only {HEAD_WEIGHT}=... applies "
                                f"(not {stray[0]}); give --weight-bitwidth to quantize again")  # fmt: skip
    width = _overridden(HEAD_WEIGHT, SHORTLIST if tied else None, overrides)
    if width == TABLE:
        raise QuantizationError(f"{HEAD_WEIGHT}={TABLE} is for `rtn` and `rtn-asym` exports; beside a GGUF file's "
                                f"carried blocks give {HEAD_WEIGHT}={SHORTLIST}, 4, 8 or float")  # fmt: skip
    return width


def quantize_weights(
    model: onnx.ModelProto,
    bits: int,
    block_size: int,
    exclude: Collection[str] = (),
    head: str | None = None,
    quantizer: str = DEFAULT_QUANTIZER,
    overrides: Sequence[Override] = (),
    moments: Mapping[str, np.ndarray] | None = None,
    solved: dict[str, BlockWeights] | None = None,
    head_rows: str | None = None,
    deferred: dict[str, Deferred] | None = None,
    table_bits: int | None = None,
    exact_rows: bool = False,
) -> onnx.ModelProto:
    """Every MatMul by a constant weight at `bits` with `quantizer`, except those reading `exclude`; the
    node named `head` (the LM head) at `head_bits`; `overrides` (the module) last. `moments`: what the
    calibrated quantizers read, `calibration_moments` of the float model; `solved`: their blocks by weight
    name, shared by the graphs of one export (which share their weights), so each is solved once.
    `head_rows`: the head's float [vocab, hidden] rows (a tied head's embedding), which a shortlist head
    rescores its best tokens with; without them the head is not a shortlist by default. `deferred`: the
    model's placeholders' values (a streaming export): the quantized weights are deferred too, each made
    when the context stores it. `table_bits`: the token tables' width by default (8: `TABLE_BITS`; None
    keeps them float), a table also read as float weights (a tied head left float) staying float.
    `exact_rows`: `rtn-min`'s and `hqq`'s blocks in their form for a decode step (see the module)."""
    if quantizer not in QUANTIZERS:
        raise QuantizationError(f"unknown quantizer {quantizer!r}; choose one of {', '.join(QUANTIZERS)}")
    if bits not in (4, 8) or block_size < 16 or block_size & (block_size - 1):
        raise QuantizationError(
            f"weights quantize to 4 or 8 bits in blocks of a power of two >= 16, not {bits} / {block_size}"
        )
    if quantizer in (*MINIMUM_FORM, *CALIBRATED) and bits != 4:
        raise QuantizationError(f"the {quantizer} quantizer makes 4-bit weights; use --weight-bitwidth 4")
    if quantizer in CALIBRATED and moments is None:
        raise QuantizationError(f"the {quantizer} quantizer needs calibration prompts (--calibration FILE)")
    plan, tables, experts = _plan(model, bits, exclude, head, quantizer, overrides, head_rows is not None, table_bits)
    in_blocks = {name: int(width) for name, width in experts.items() if width is not None}
    if in_blocks and quantizer not in EXPERT_QUANTIZERS:
        raise QuantizationError(
            f"the {quantizer} quantizer does not quantize mixture-of-experts layers ({next(iter(in_blocks))}): use "
            f"{' or '.join(EXPERT_QUANTIZERS)}, or keep the experts float with --override '*.mlp.experts.*=float'"
        )
    shortlisted = {n for n, w in plan.items() if w == SHORTLIST}
    if shortlisted and head_rows is None:
        raise QuantizationError(
            f"{HEAD_WEIGHT}={SHORTLIST} needs the head's float rows, which this graph does not hold; "
            f"give {HEAD_WEIGHT}=4, 8 or float"
        )
    tabled = {n for n, w in plan.items() if w == TABLE}
    asked = {n for n in tables if any(fnmatch.fnmatchcase(n, p) for p, _ in overrides)}  # by an override
    table = next((t for t in model.graph.initializer if t.name == head_rows), None) if tabled else None
    if tabled:
        if table is None or table.name in asked or len(table.dims) != 2:
            raise QuantizationError(
                f"{HEAD_WEIGHT}={TABLE} makes the head's 4-bit blocks the token table too: it needs a head tied to the "
                f"token table, and no width of its own for that table; give {HEAD_WEIGHT}={SHORTLIST}, 4, 8 or float"
            )
        tables = {n: w for n, w in tables.items() if n != table.name}
    # the head's input and output, and its rows as they are now (ORT's quantizer drops initializers no node
    # reads: an untied head's rows)
    shortlist = None
    head_node = next((n for n in model.graph.node if n.name in shortlisted), None)
    if head_node is not None:
        rows = next((t for t in model.graph.initializer if t.name == head_rows), None)
        if rows is None or len(rows.dims) != 2:
            raise QuantizationError(f"the LM head's float rows {head_rows!r} are not a [vocab, hidden] weight")
        shortlist = (head_node.input[0], head_node.output[0], rows)
    nodes = {width: {n for n, w in plan.items() if w == width} for width in (4, 8)}
    if quantizer in MINIMUM_FORM:
        fit = hqq_minimums if quantizer == "hqq" else block_minimums
        if nodes[4]:
            model = _with_block_minimums(model, block_size, nodes[4], fit, deferred=deferred, exact_rows=exact_rows)
        model = _ort_rtn(model, 8, block_size, nodes[8], True, deferred) if nodes[8] else model
    elif quantizer in CALIBRATED:
        assert moments is not None
        blocks = solved if solved is not None else {}
        gptq = quantizer == "gptq"
        model = _by_gptq(model, block_size, nodes[4], gptq, moments, blocks, deferred) if nodes[4] else model
        model = _ort_rtn(model, 8, block_size, nodes[8], True, deferred) if nodes[8] else model
    else:
        for width in (4, 8):
            if nodes[width]:
                # `rtn`'s 4-bit blocks of 32 on Quiver's kernel: read in place (ORT packs its own copy)
                model = _ort_rtn(model, width, block_size, nodes[width], quantizer == "rtn", deferred, native=True)
    quantized_tables = _quantized_tables(model, tables, block_size, deferred, asked) if tables else {}
    if shortlist is not None:  # the approximate head ranks, whatever the quantizer
        hidden_size = int(shortlist[2].dims[1])  # the float rows' [vocab, hidden]
        model = _ort_rtn(model, 4, _ranking_block(hidden_size, block_size), shortlisted, False, deferred)
        model = _shortlisted_head(model, *shortlist, quantized_tables.get(shortlist[2].name))
    if table is not None:  # the head in the layers' blocks, its rows the table's: onnxruntime-genai's int4 layout
        # (on Quiver's kernel where symmetric: the rows gathered from blocks with zero points are MatMulNBits')
        symmetric = quantizer == "rtn"
        model = _ort_rtn(model, 4, block_size, tabled, symmetric, deferred, native=symmetric)
        halves = symmetric and _on_quivers_kernel(4, block_size, int(table.dims[1]))  # as _ort_rtn wrote the head
        _table_from_head(model, table.name, HEAD_WEIGHT, int(table.dims[1]), block_size, symmetric, halves)
    if in_blocks:
        model = _experts_in_blocks(model, in_blocks, block_size, quantizer == "rtn", deferred)
    from quiver.ir.edit import drop_unread_initializers

    # an untied head's float rows no shortlist reads (the model holds them only for one)
    outputs = {o.name for o in model.graph.output}
    drop_unread_initializers(model.graph, {t.name for t in model.graph.initializer} - outputs)
    return model


@dataclasses.dataclass(frozen=True)
class _Table:
    """A token table's quantized tensors, as GatherBlockQuantized reads them."""

    data: str
    scales: str
    zero_points: str
    bits: int
    block_size: int


def _gather_rows(table: str, ids: str, out: str, name: str, quantized: _Table | None) -> onnx.NodeProto:
    """Rows of a token table: a Gather, or of its quantized form, dequantized (ORT's GatherBlockQuantized)."""
    from onnx import helper

    from quiver.ir.ops import MS_DOMAIN

    if quantized is None:
        return helper.make_node("Gather", [table, ids], [out], name=name, axis=0)
    return helper.make_node(
        "GatherBlockQuantized", [quantized.data, ids, quantized.scales, quantized.zero_points], [out], name=name,
        domain=MS_DOMAIN, bits=quantized.bits, block_size=quantized.block_size, gather_axis=0, quantize_axis=1,
    )  # fmt: skip


def table_blocks(table: np.ndarray, bits: int, block_size: int) -> list[np.ndarray]:
    """A [vocab, hidden] token table in symmetric blocks along each row: the unsigned integers (packed two
    to a byte at 4 bits), a scale per block, the zero points (the middle, 2^(bits-1), packed alike). Made
    a slice of rows at a time: a 128k-token table is a gigabyte in float32, and its temporaries as many."""
    vocab, hidden = table.shape
    top, count = (1 << (bits - 1)) - 1, hidden // block_size
    q = np.empty((vocab, hidden * bits // 8), np.uint8)
    scales = np.empty((vocab, count), np.float32)
    step = max(1, (32 << 20) // (4 * hidden))  # rows of ~32 MB of float32 at a time
    for start in range(0, vocab, step):
        rows = slice(start, min(vocab, start + step))
        blocks = np.asarray(table[rows], np.float32).reshape(-1, count, block_size)
        scales[rows] = np.abs(blocks).max(axis=-1) / top
        safe = np.where(scales[rows] > 0, scales[rows], 1).astype(np.float32)
        values = (np.clip(np.rint(blocks / safe[..., None]), -top, top) + top + 1).astype(np.uint8)
        q[rows] = pack_nibbles(values.reshape(-1, hidden)) if bits == 4 else values.reshape(-1, hidden)
    zeros = np.full((vocab, count), top + 1, np.uint8)
    if bits == 4:
        zeros = pack_nibbles(np.pad(zeros, ((0, 0), (0, count % 2))))
    return [q, scales, zeros]


def _table_blocks_of(table: Deferred, bits: int, block_size: int) -> list[np.ndarray]:
    return table_blocks(table.compute(), bits, block_size)


def _quantized_tables(
    model: onnx.ModelProto,
    tables: Mapping[str, int],
    block_size: int,
    deferred: dict[str, Deferred] | None,
    asked: Collection[str],
) -> dict[str, _Table]:
    """Each token table of `tables` (name -> 4 or 8 bits) in blocks along its rows, its Gathers become
    GatherBlockQuantized (ORT's, dequantizing the rows they take). A table something else still reads as
    float (a tied head left float) stays float, or is refused where an override (`asked`) named it."""
    from quiver.ir.ops import use_microsoft_domain

    weights = _Weights(model.graph, deferred)
    done: dict[str, _Table] = {}
    for name, bits in tables.items():
        readers = [n for n in model.graph.node if name in n.input]
        if any(n.op_type != "Gather" or list(n.input).index(name) != 0 for n in readers):
            if name not in asked:
                continue
            raise QuantizationError(f"{name} is read as float weights beside its Gather (a tied LM head in float): "
                                    f"quantize the head too (--weight-bitwidth) or keep {name}=float")  # fmt: skip
        vocab, hidden = (int(d) for d in weights.tensors[name].dims)
        if hidden % block_size:
            raise QuantizationError(f"{name}: rows of {hidden} do not split into blocks of {block_size}")
        count = hidden // block_size
        shapes = [((vocab, hidden * bits // 8), np.uint8), ((vocab, count), np.float32),
                  ((vocab, (count + 1) // 2 if bits == 4 else count), np.uint8)]  # fmt: skip
        parts = made_together(shapes, partial(_table_blocks_of, weights.value(name), bits, block_size))
        table = _Table(f"{name}.q{bits}", f"{name}.q{bits}.scales", f"{name}.q{bits}.zero_points", bits, block_size)
        for part_name, part in zip((table.data, table.scales, table.zero_points), parts):
            weights.add(part_name, part)
        for node in readers:
            node.CopyFrom(_gather_rows(name, node.input[1], node.output[0], node.name, table))
        done[name] = table
    use_microsoft_domain(model)
    return done


def _table_from_head(
    model: onnx.ModelProto, table: str, head: str, hidden: int, block: int, symmetric: bool, halves: bool = False
) -> None:
    """Every Gather of `table`'s rows reads them from the 4-bit head's blocks instead (MatMulNBits' tensors of
    `head`: [vocab, blocks, block / 2], a scale per block and, unless `symmetric`, a 4-bit zero point; else
    8; with `halves`, MatMul4Bits' symmetric blocks: the scales the first half of `head`.halves, float16):
    the rows' bytes gathered, their nibbles split (the low one first, as MatMulNBits packs them), and
    (q - zero) * scale. ORT's GatherBlockQuantized computes the same, but only from tensors of other shapes
    (2-d data, scales of the data's rank), which would be a second copy of the table in the context. The
    ids' rank is read from the graph's inputs: the reshapes then copy the leading sizes (0), with no Shape
    node that a graph's fixed input sizes would fold into other constants (a decode graph would then no
    longer be the prefill graph's body, and not share its session)."""
    from onnx import helper

    graph = model.graph
    count = -(-hidden // block)
    weights = _Weights(graph, None)
    constants: dict[str, np.ndarray] = {
        "fifteen": np.array(15, np.uint8), "four": np.array(4, np.uint8), "eight": np.array(8, np.float32),
        "last": np.array([-1], np.int64), "start": np.array([0], np.int64), "blocks": np.array([count], np.int64),
        "hidden": np.array([hidden], np.int64), "first": np.array([0], np.int64), "pair": np.array([-2], np.int64),
    }  # fmt: skip
    ranks = {i.name: len(i.type.tensor_type.shape.dim) for i in graph.input if i.type.tensor_type.HasField("shape")}
    c = {key: weights.add(f"/model/embed_tokens/from_head/{key}", value) for key, value in constants.items()}

    def reshaped(x: str, keep: int | None, p: str) -> list[onnx.NodeProto]:
        """`x` [..., a, b] as [..., a b] (`{p}/output_0`): `keep` leading sizes copied (0s), or where the rank
        is not known, the sizes but the last two read by a Shape node."""
        if keep is not None:
            shape = weights.add(f"{p}/shape", np.array([0] * keep + [-1], np.int64))
            return [helper.make_node("Reshape", [x, shape], [f"{p}/output_0"], name=f"{p}/Reshape")]
        return [
            helper.make_node("Shape", [x], [f"{p}/leading"], name=f"{p}/Shape", end=-2),
            helper.make_node("Concat", [f"{p}/leading", c["last"]], [f"{p}/shape"], name=f"{p}/Concat", axis=0),
            helper.make_node("Reshape", [x, f"{p}/shape"], [f"{p}/output_0"], name=f"{p}/Reshape"),
        ]  # fmt: skip

    def nibbles(packed: str, keep: int | None, p: str) -> list[onnx.NodeProto]:
        """`packed` uint8 [..., n] as its 4-bit values [..., 2 n] in float (`{p}/float`), low nibble first
        (`keep`: how many sizes come before the last, if known)."""
        return [
            helper.make_node("BitwiseAnd", [packed, c["fifteen"]], [f"{p}/low"], name=f"{p}/BitwiseAnd"),
            helper.make_node("BitShift", [packed, c["four"]], [f"{p}/high"], name=f"{p}/BitShift", direction="RIGHT"),
            helper.make_node("Unsqueeze", [f"{p}/low", c["last"]], [f"{p}/low1"], name=f"{p}/UnsqueezeLow"),
            helper.make_node("Unsqueeze", [f"{p}/high", c["last"]], [f"{p}/high1"], name=f"{p}/UnsqueezeHigh"),
            helper.make_node("Concat", [f"{p}/low1", f"{p}/high1"], [f"{p}/pairs"], name=f"{p}/Concat", axis=-1),
            *reshaped(f"{p}/pairs", keep, f"{p}/values"),
            helper.make_node("Cast", [f"{p}/values/output_0"], [f"{p}/float"], name=f"{p}/Cast", to=1),
        ]  # fmt: skip

    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.op_type != "Gather" or node.input[0] != table:
            nodes.append(node)
            continue
        ids, p = node.input[1], f"{node.name}/from_head"
        rank = ranks.get(ids)
        parts = {"Q4": f"{head}_Q4"}
        if halves:  # [..., 2, blocks] float16: the scales are the first of the two
            parts["halves"] = f"{head}.halves"
        else:
            parts.update({part: f"{head}_{part}" for part in ("scales", *(() if symmetric else ("zero_points",)))})
        nodes += [helper.make_node("Gather", [tensor, ids], [f"{p}/{part}"], name=f"{p}/Gather_{part}", axis=0)
                  for part, tensor in parts.items()]  # fmt: skip
        if halves:
            nodes += [
                helper.make_node("Gather", [f"{p}/halves", c["first"]], [f"{p}/scales1"], name=f"{p}/GatherScales",
                                 axis=-2),
                helper.make_node("Squeeze", [f"{p}/scales1", c["pair"]], [f"{p}/scales16"], name=f"{p}/Squeeze"),
                helper.make_node("Cast", [f"{p}/scales16"], [f"{p}/scales"], name=f"{p}/CastScales", to=1),
            ]  # fmt: skip
        nodes += nibbles(f"{p}/Q4", None if rank is None else rank + 1, f"{p}/q")  # [..., blocks, block]
        zero = c["eight"]
        if not symmetric:
            nodes += nibbles(f"{p}/zero_points", rank, f"{p}/z")  # [..., 2 ceil(blocks / 2)]
            nodes += [
                helper.make_node("Slice", [f"{p}/z/float", c["start"], c["blocks"], c["last"]], [f"{p}/z"],
                                 name=f"{p}/SliceZeros"),
                helper.make_node("Unsqueeze", [f"{p}/z", c["last"]], [f"{p}/zero"], name=f"{p}/UnsqueezeZeros"),
            ]  # fmt: skip
            zero = f"{p}/zero"
        nodes += [
            helper.make_node("Unsqueeze", [f"{p}/scales", c["last"]], [f"{p}/scale"], name=f"{p}/UnsqueezeScales"),
            helper.make_node("Sub", [f"{p}/q/float", zero], [f"{p}/centered"], name=f"{p}/Sub"),
            helper.make_node("Mul", [f"{p}/centered", f"{p}/scale"], [f"{p}/blocks"], name=f"{p}/Mul"),
            *reshaped(f"{p}/blocks", rank, f"{p}/padded"),
            helper.make_node("Slice", [f"{p}/padded/output_0", c["start"], c["hidden"], c["last"]], [node.output[0]],
                             name=f"{p}/Slice"),
        ]  # fmt: skip
    del graph.node[:]
    graph.node.extend(nodes)


def _ranking_block(hidden: int, block_size: int) -> int:
    """The shortlist's ranking blocks: `RANKING_BLOCK`, or within a smaller hidden size the largest power of
    two that fits (a block longer than the rows would be padding), never finer than the layers' blocks."""
    return min(RANKING_BLOCK, max(block_size, 1 << (hidden.bit_length() - 1)))


def _shortlisted_head(
    model: onnx.ModelProto, hidden: str, logits: str, rows: onnx.TensorProto, table: _Table | None = None
) -> onnx.ModelProto:
    """The 4-bit head's `logits` with its best `SHORTLIST_SIZE` entries computed again from the float `rows`
    [vocab, hidden] (or from `table`, those rows quantized as a token table: gathered dequantized): TopK, a
    Gather of those rows, their products with `hidden`, ScatterElements. Any leading dimensions (a batch
    of rows) carry through."""
    from onnx import helper, numpy_helper

    from quiver.ir.ops import MS_DOMAIN, use_microsoft_domain

    graph = model.graph
    approx = f"{logits}.approx"
    if table is None and not any(t.name == rows.name for t in graph.initializer):
        graph.initializer.append(rows)
    vocab = int(rows.dims[0])

    def part(name: str) -> str:
        return f"/lm_head/shortlist/{name}"

    for node in graph.node:
        if logits in node.output:
            node.output[list(node.output).index(logits)] = approx
    graph.initializer.extend(
        [
            numpy_helper.from_array(np.array([min(SHORTLIST_SIZE, vocab)], np.int64), part("k")),
            numpy_helper.from_array(np.array([-2], np.int64), part("axis")),
        ]
    )
    # right after the head: nodes that read its logits (a bias, a scale, a soft-cap) come after these
    at = next(i for i, node in enumerate(graph.node) if approx in node.output) + 1
    shortlist_nodes = (
        [
            helper.make_node("TopK", [approx, part("k")], [part("values"), part("ids")], name=part("TopK"), axis=-1),
            _gather_rows(rows.name, part("ids"), part("rows"), part("Gather"), table),
            helper.make_node("Unsqueeze", [hidden, part("axis")], [part("hidden")], name=part("Unsqueeze")),
            helper.make_node("FusedMatMul", [part("hidden"), part("rows")], [part("products")], name=part("MatMul"),
                             domain=MS_DOMAIN, transB=1, alpha=1.0),
            helper.make_node("Squeeze", [part("products"), part("axis")], [part("exact")], name=part("Squeeze")),
            helper.make_node("ScatterElements", [approx, part("ids"), part("exact")], [logits],
                             name=part("ScatterElements"), axis=-1),
        ]
    )  # fmt: skip
    for offset, node in enumerate(shortlist_nodes):
        graph.node.insert(at + offset, node)
    use_microsoft_domain(model)
    return model


def _plan(
    model: onnx.ModelProto,
    bits: int,
    exclude: Collection[str],
    head: str | None,
    quantizer: str,
    overrides: Sequence[Override],
    tied: bool,
    table_bits: int | None = None,
) -> tuple[dict[str, Width], dict[str, int], dict[str, Width]]:
    """Each MatMul by a constant 2-d weight (not reading `exclude`): its width (bits, None for float, or
    SHORTLIST for the head; `tied`: the head's float rows are at hand); the token tables (a Gather's
    2-d weight) at `table_bits` (None: float) unless an override says otherwise; and the expert stacks of
    each MoE node (by their names, `model.layers.0.mlp.experts.fc1`) at `bits` unless one says otherwise."""
    weights = {t.name: t for t in model.graph.initializer if len(t.dims) == 2}
    excluded = set(exclude)
    plan: dict[str, Width] = {}
    experts: dict[str, Width] = {}
    matched: set[str] = set()
    tables: dict[str, int] = {}
    for name in sorted({n.input[0] for n in model.graph.node if n.op_type == "Gather" and n.input[0] in weights}):
        matched |= {p for p, _ in overrides if fnmatch.fnmatchcase(name, p)}
        width = _overridden(name, table_bits, overrides)
        if width == SHORTLIST:
            raise QuantizationError(f"only the LM head ({HEAD_WEIGHT}) can be a {SHORTLIST}, not {name}")
        if width is not None:
            tables[name] = int(width)
    for node in model.graph.node:
        if node.op_type != "MatMul" or len(node.input) != 2 or node.input[1] not in weights:
            continue
        if excluded.intersection(node.input):
            continue
        name, default = (
            (HEAD_WEIGHT, head_bits(quantizer, tied=tied, bits=bits)) if node.name == head else (node.input[1], bits)
        )
        matched |= {p for p, _ in overrides if fnmatch.fnmatchcase(name, p)}
        plan[node.name] = _overridden(name, default, overrides)
        if plan[node.name] == SHORTLIST and node.name != head:
            raise QuantizationError(f"only the LM head ({HEAD_WEIGHT}) can be a {SHORTLIST}, not {name}")
    for node in model.graph.node:  # mixture-of-experts layers: each expert stack by its name
        if _is_moe(node):
            for name in [n for n in (node.input[_FC1], node.input[_FC2]) if n not in excluded]:
                matched |= {p for p, _ in overrides if fnmatch.fnmatchcase(name, p)}
                experts[name] = _overridden(name, bits, overrides)
                if experts[name] in (SHORTLIST, TABLE):
                    raise QuantizationError(f"only the LM head ({HEAD_WEIGHT}) can be a {experts[name]}, not {name}")
    if head is None or head not in plan:  # the head as the tied embedding: matched, not quantized here
        matched |= {p for p, _ in overrides if fnmatch.fnmatchcase(HEAD_WEIGHT, p)}
    unmatched = [p for p, _ in overrides if p not in matched]
    if unmatched:
        names = sorted(weights)[:3]
        raise QuantizationError(
            f"quantization override {unmatched[0]!r} matches no MatMul weight; weight names look like "
            f"{', '.join(names)} (and {HEAD_WEIGHT} for the LM head)"
        )
    return plan, tables, experts


class _Weights:
    """A graph's weights as the quantizers read and add them: its initializers' values, or a streaming
    export's deferred ones (`deferred`: then large new weights are deferred too, made when stored)."""

    def __init__(self, graph: onnx.GraphProto, deferred: dict[str, Deferred] | None) -> None:
        self.graph = graph
        self.deferred = deferred
        self.tensors = {t.name: t for t in graph.initializer}

    def value(self, name: str) -> Deferred:
        tensor = self.tensors[name]
        if self.deferred is not None and name in self.deferred:
            return self.deferred[name]
        from onnx import numpy_helper

        return Deferred(tensor.dims, np.float32, lambda: numpy_helper.to_array(tensor).astype(np.float32, copy=False))

    def add(self, name: str, value: np.ndarray | Deferred) -> str:
        from quiver.passes.load import weight_initializer

        self.graph.initializer.append(weight_initializer(name, value, self.deferred))
        self.tensors[name] = self.graph.initializer[-1]
        return name


def _rtn_blocks(weight: np.ndarray, bits: int, block_size: int, symmetric: bool) -> list[np.ndarray]:
    """ONNX Runtime's round to nearest (the kernels of its `MatMulNBitsQuantizer`) of a [K, N] weight: the
    packed blocks [N, blocks, bytes], the scales [N, blocks] and (asymmetric) the packed zero points,
    a slice of columns at a time (blocks run along K: columns are independent), so a large weight (a
    128k-token head) is never copied whole."""
    capi = ort_package.submodule("capi._pybind_state")
    quantize = capi.quantize_matmul_4bits if bits == 4 else capi.quantize_matmul_8bits
    k, n = weight.shape
    per_byte = 8 // bits
    count = -(-k // block_size)
    packed = np.zeros((n, count, block_size // per_byte), np.uint8)
    scales = np.zeros((n, count), np.float32)
    zeros = np.zeros((n, -(-count // per_byte)), np.uint8)
    step = max(1, (32 << 20) // (4 * count * block_size))  # columns of ~32 MB of float32 at a time
    for start in range(0, n, step):
        end = min(n, start + step)
        piece = np.zeros((count * block_size, end - start), np.float32)  # padded along K, as ORT's quantizer pads
        piece[:k] = weight[:, start:end]
        parts = (packed[start:end].copy(), scales[start:end].copy(), zeros[start:end].copy())
        quantize(parts[0], piece, parts[1], parts[2], block_size, end - start, k, symmetric)
        packed[start:end], scales[start:end], zeros[start:end] = parts
    return [packed, scales] if symmetric else [packed, scales, zeros]


def _rtn_names(name: str, bits: int, symmetric: bool) -> list[str]:
    """The tensors ORT's `MatMulNBitsQuantizer` names for a weight's blocks: data, scales, zero points."""
    return [f"{name}_Q{bits}", f"{name}_scales"] + ([] if symmetric else [f"{name}_zero_points"])


def _rtn_forms(k: int, n: int, bits: int, block_size: int, symmetric: bool) -> list[tuple[Shape, type]]:
    """The shapes and types `_rtn_blocks` makes for a [K, N] weight, in `_rtn_names`' order."""
    count, per_byte = -(-k // block_size), 8 // bits
    forms: list[tuple[Shape, type]] = [((n, count, block_size // per_byte), np.uint8), ((n, count), np.float32),
                                       ((n, -(-count // per_byte)), np.uint8)]  # fmt: skip
    return forms[:2] if symmetric else forms


def _rtn_of(weight: Deferred, bits: int, block_size: int, symmetric: bool) -> list[np.ndarray]:
    return _rtn_blocks(weight.compute(), bits, block_size, symmetric)


def _halves(scales: np.ndarray, zeros: np.ndarray | int) -> np.ndarray:
    """Blocks' scales [N, blocks] and integer zero points (w = s (q - z)) in Quiver's kernel's form: each
    block's scale and minimum -z s, float16 [N, 2, blocks] (the minimum of the float16 scale: for z = 8
    exact, else within float16's rounding of it, ~0.4 % of a step at most)."""
    halves = np.empty((scales.shape[0], 2, scales.shape[1]), np.float16)
    halves[:, 0] = scales
    halves[:, 1] = -np.asarray(zeros, np.float32) * halves[:, 0].astype(np.float32)
    return halves


def _rtn_halves(weight: Deferred, block_size: int, symmetric: bool) -> list[np.ndarray]:
    """ORT's 4-bit blocks of `weight` (symmetric, or with its 4-bit zero points) in Quiver's kernel's form:
    the packed blocks, and each block's scale and minimum as float16 ([N, 2, K / block])."""
    if symmetric:
        packed, scales = _rtn_of(weight, 4, block_size, True)
        return [packed, _halves(scales, 8)]
    packed, scales, points = _rtn_of(weight, 4, block_size, False)
    return [packed, _halves(scales, unpack_bits(points, 4)[:, : scales.shape[1]])]


def _on_quivers_kernel(bits: int, block_size: int, k: int) -> bool:
    """Whether 4-bit blocks of a [K, N] weight can be Quiver's MatMul4Bits (blocks of 32, K a multiple of
    them: ORT's quantizer pads others)."""
    from quiver.ir.quiver_ops import MATMUL_4BITS_BLOCK

    return bits == 4 and block_size == MATMUL_4BITS_BLOCK and k % block_size == 0


def _matmul_4bits(node: onnx.NodeProto, names: Sequence[str], k: int, n: int, symmetric: bool) -> onnx.NodeProto:
    """`node` (a MatMul) as Quiver's MatMul4Bits on the blocks `names` (packed, halves)."""
    from onnx import helper

    from quiver.ir.quiver_ops import MATMUL_4BITS, MATMUL_4BITS_BLOCK, QUIVER_DOMAIN

    return helper.make_node(MATMUL_4BITS, [node.input[0], *names], list(node.output), name=f"{node.name}_Q4",
                            domain=QUIVER_DOMAIN, K=k, N=n, block_size=MATMUL_4BITS_BLOCK, few_rows=0,
                            symmetric=int(symmetric))  # fmt: skip


def _ort_rtn(
    model: onnx.ModelProto,
    bits: int,
    block_size: int,
    include: Collection[str],
    symmetric: bool,
    deferred: dict[str, Deferred] | None = None,
    native: bool = False,
) -> onnx.ModelProto:
    """ORT's round to nearest on the MatMul nodes named in `include` (a [K, N] constant weight each): the
    MatMulNBits nodes, tensors and names ORT's `MatMulNBitsQuantizer` writes, one weight at a time; with
    `native` (4-bit blocks of 32), the same blocks as Quiver's `MatMul4Bits` nodes, their scales and
    minimums float16 (see `quiver.backends.cpu.native_ops`: ORT's operators again where that kernel is
    not built)."""
    from onnx import helper

    from quiver.ir.edit import drop_unread_initializers
    from quiver.ir.ops import MS_DOMAIN, use_microsoft_domain, use_quiver_domain
    from quiver.ir.quiver_ops import QUIVER_DOMAIN

    graph = model.graph
    weights = _Weights(graph, deferred)
    done: set[str] = set()
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        tensor = weights.tensors.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if tensor is None or len(tensor.dims) != 2 or node.name not in include:
            nodes.append(node)
            continue
        name = node.input[1]
        k, n = (int(d) for d in tensor.dims)
        if native and _on_quivers_kernel(bits, block_size, k):
            names = [f"{name}_Q4", f"{name}.halves"]
            if name not in done:
                count = k // block_size
                forms = [((n, count, block_size // 2), np.uint8), ((n, 2, count), np.float16)]
                made = made_together(forms, partial(_rtn_halves, weights.value(name), block_size, symmetric))
                for part, array in zip(names, made):
                    weights.add(part, array)
                done.add(name)
            nodes.append(_matmul_4bits(node, names, k, n, symmetric))
            continue
        names = _rtn_names(name, bits, symmetric)
        if name not in done:  # a weight several MatMuls read is quantized once
            made = made_together(
                _rtn_forms(k, n, bits, block_size, symmetric),
                partial(_rtn_of, weights.value(name), bits, block_size, symmetric),
            )
            for part, array in zip(names, made):
                weights.add(part, array)
            done.add(name)
        nodes.append(helper.make_node("MatMulNBits", [node.input[0], *names], list(node.output),
                                      name=f"{node.name}_Q{bits}", domain=MS_DOMAIN, K=k, N=n, bits=bits,
                                      block_size=block_size))  # fmt: skip
    del graph.node[:]
    graph.node.extend(nodes)
    drop_unread_initializers(graph, done)
    use_microsoft_domain(model)
    if any(n.domain == QUIVER_DOMAIN for n in graph.node):
        use_quiver_domain(model)
    return model


def _is_moe(node: onnx.NodeProto) -> bool:
    from quiver.ir.ops import MS_DOMAIN

    return node.op_type == "MoE" and node.domain == MS_DOMAIN and len(node.input) > _FC2


def _experts_in_blocks(
    model: onnx.ModelProto,
    widths: Mapping[str, int],
    block_size: int,
    symmetric: bool,
    deferred: dict[str, Deferred] | None,
) -> onnx.ModelProto:
    """Each MoE node whose expert stacks `widths` names as ORT's QMoE on ORT's round-to-nearest blocks of
    them (the same blocks MatMulNBits takes: [experts, N, K / block, bytes] read as [experts, N, K * bits / 8],
    scales [experts, N, K / block], zero points packed as MatMulNBits packs them), one expert at a time.

    QMoE's CPU kernel weighs the top-k experts by a softmax over those k alone (the top-k weights normalized)
    whatever its attribute says: where the model leaves them unnormalized (Qwen's MoE), the router's softmax
    over every expert is given as `router_weights` (the top-k values of which it takes as they are)."""
    from onnx import helper

    from quiver.ir.edit import drop_unread_initializers
    from quiver.ir.ops import MS_DOMAIN

    graph = model.graph
    weights = _Weights(graph, deferred)
    done: set[str] = set()
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        names = (node.input[_FC1], node.input[_FC2]) if _is_moe(node) else ()
        if not names or not all(n in widths for n in names):
            nodes.append(node)
            continue
        bits = widths[names[0]]
        if widths[names[1]] != bits:
            raise QuantizationError(f"{names[0]} and {names[1]} are one layer's experts: give them one width")
        blocks: list[list[str]] = []
        for name in names:
            parts = _rtn_names(name, bits, symmetric)
            blocks.append(parts)
            if name in done:
                continue
            stack = weights.value(name)  # [experts, N, K]: each expert's weight [out, in] as the checkpoint's
            if deferred is None or name not in deferred:  # in memory already: converted once, not per expert
                stack = Deferred.of(stack.compute())
            experts, n, k = stack.shape
            if k % block_size:
                raise QuantizationError(f"{name}: its experts' inputs ({k}) are not whole blocks of {block_size}; "
                                        "give another --block-size, or keep them float")  # fmt: skip
            forms = _rtn_forms(k, n, bits, block_size, symmetric)
            made = [made_together(forms, partial(_rtn_of, stack.item(e).T, bits, block_size, symmetric))
                    for e in range(experts)]  # fmt: skip
            for index, part in enumerate(parts):
                stacked = Deferred.stack([expert[index] for expert in made])
                weights.add(part, stacked.reshape(experts, n, k * bits // 8) if index == 0 else stacked)
            done.add(name)
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        (fc1, fc1_scales, *fc1_points), (fc2, fc2_scales, *fc2_points) = blocks
        inputs = [node.input[0], node.input[1], fc1, fc1_scales, "", fc2, fc2_scales, "", "", "", "",
                  *(fc1_points or [""]), *(fc2_points or [""]), ""]  # fmt: skip
        if not attributes.get("normalize_routing_weights", 0):
            softmax = f"{node.name}/router_softmax"
            nodes.append(helper.make_node("Softmax", [node.input[1]], [f"{softmax}/output_0"], name=softmax, axis=-1))
            inputs.append(f"{softmax}/output_0")
        nodes.append(helper.make_node("QMoE", inputs, list(node.output), name=f"{node.name}_Q{bits}", domain=MS_DOMAIN,
                                      expert_weight_bits=bits, block_size=block_size, **attributes))  # fmt: skip
    del graph.node[:]
    graph.node.extend(nodes)
    drop_unread_initializers(graph, done)
    return model


def calibration_tensors(model: onnx.ModelProto, exclude: Collection[str] = ()) -> list[str]:
    """The inputs of the MatMuls by constant 2-d weights (those not reading `exclude`): what GPTQ measures."""
    weights = {t.name for t in model.graph.initializer if len(t.dims) == 2}
    return sorted(
        {
            n.input[0]
            for n in model.graph.node
            if n.op_type == "MatMul" and len(n.input) == 2 and n.input[1] in weights and not set(n.input) & set(exclude)
        }
    )


def calibration_moments(
    model: onnx.ModelProto, prompts: Sequence[Sequence[int]], exclude: Collection[str] = ()
) -> dict[str, np.ndarray]:
    """Σ xᵀx of each MatMul's input as the float prefill graph computes it on each prompt (token ids) from
    an empty cache: other inputs zero (no adapter, no cached tokens)."""
    from quiver.passes.gptq import input_moments
    from quiver.passes.qdq import placeholder_sample
    from quiver.t2t.graph import INPUT_IDS, SEQLENS_K, TOTAL_LENGTH

    zeros = placeholder_sample(model)

    def feeds(ids: Sequence[int]) -> dict[str, np.ndarray]:
        return zeros | {
            INPUT_IDS: np.array([ids], np.int64),
            SEQLENS_K: np.array([len(ids) - 1], np.int32),
            TOTAL_LENGTH: np.array(len(ids), np.int32),
        }

    if not prompts or not all(prompts):
        raise QuantizationError("calibration needs at least one prompt, none of them empty")
    return input_moments(model, (feeds(ids) for ids in prompts), calibration_tensors(model, exclude))


def _by_gptq(
    model: onnx.ModelProto,
    block_size: int,
    include: Collection[str],
    symmetric: bool,
    moments: Mapping[str, np.ndarray],
    solved: dict[str, BlockWeights],
    deferred: dict[str, Deferred] | None = None,
) -> onnx.ModelProto:
    """The MatMuls named in `include` by GPTQ's 4-bit blocks: in blocks of 32, Quiver's MatMul4Bits (each
    block's scale and minimum -z s in float16, as `rtn`'s and `rtn-asym`'s); in others, ONNX's blocked
    DequantizeLinear of int4 weights, which `to_matmul_nbits` turns into MatMulNBits (with zero points
    where a block has one)."""
    from onnx import helper

    from quiver.ir.edit import drop_unread_initializers
    from quiver.ir.ops import use_quiver_domain
    from quiver.passes.gptq import moments_of, quantize_blocks
    from quiver.passes.nbits import to_matmul_nbits

    graph = model.graph
    weights = _Weights(graph, deferred)
    constants = weights.tensors
    readers: dict[str, list[str]] = {}  # weight -> the inputs it multiplies
    for node in graph.node:
        if node.op_type == "MatMul" and node.name in include and node.input[1] in constants:
            readers.setdefault(node.input[1], []).append(node.input[0])
    dequantizers = []
    native: dict[str, tuple[list[str], int, int]] = {}  # weight -> its MatMul4Bits blocks, K, N
    for name, inputs in readers.items():
        if len(constants[name].dims) != 2:
            continue
        if name not in solved:
            weight = weights.value(name).compute()
            solved[name] = quantize_blocks(weight, 4, block_size, symmetric, moments_of(inputs, moments))
        blocks = solved[name]
        k, n = blocks.q.shape
        if _on_quivers_kernel(4, block_size, k):
            packed = pack_nibbles(blocks.q.T.reshape(n, k // block_size, block_size))  # MatMulNBits' layout
            names = [f"{name}_Q4", f"{name}.halves"]
            weights.add(names[0], packed)
            weights.add(names[1], _halves(blocks.scales.T, blocks.zeros.T))
            native[name] = (names, k, n)
            continue
        stem = f"{name}.gptq"
        graph.initializer.extend(blocks.int4_initializers(f"{stem}.q", f"{stem}.scales", f"{stem}.zero_points"))
        dequantizers.append(
            helper.make_node(
                "DequantizeLinear",
                [f"{stem}.q", f"{stem}.scales", f"{stem}.zero_points"],
                [stem],
                name=f"{stem}.dequantize",
                axis=0,
                block_size=block_size,
            )
        )
        for node in graph.node:
            if node.op_type == "MatMul" and node.name in include and node.input[1] == name:
                node.input[1] = stem
    nodes = [*dequantizers]
    for node in graph.node:
        read = str(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else ""
        nodes.append(_matmul_4bits(node, *native[read], symmetric) if node.name in include and read in native else node)
    del graph.node[:]
    graph.node.extend(nodes)
    to_matmul_nbits(model)
    drop_unread_initializers(graph, set(readers))
    if native:
        use_quiver_domain(model)
    return model


def block_minimums(weight: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A [K, N] weight as 4-bit blocks along K with a scale and a minimum each: q [N, K / block, block]
    (0..15), scales and minimums [N, K / block]; w[k, n] = scale q + minimum."""
    k, n = weight.shape
    blocks = np.ascontiguousarray(weight.T, dtype=np.float32).reshape(n, k // block_size, block_size)
    low, high = blocks.min(axis=-1), blocks.max(axis=-1)
    scales = ((high - low) / 15).astype(np.float32)
    safe = np.where(scales > 0, scales, 1).astype(np.float32)  # a constant block: q = 0, w = its minimum
    q = np.clip(np.rint((blocks - low[..., None]) / safe[..., None]), 0, 15).astype(np.uint8)
    return q, scales, low.astype(np.float32)


def hqq_minimums(
    weight: np.ndarray, block_size: int, iterations: int = 20, norm: float = 0.7
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`block_minimums`' form with HQQ's minimum: the scale from the block's range, then the zero point
    z (w = s (q - z), m = -s z) refined by half-quadratic steps — W_e = shrink_lp(W - Ŵ), z = mean(q -
    (W - W_e) / s) — while the mean |W - Ŵ| falls (HQQ's reference `optimize_weights_proximal`)."""
    k, n = weight.shape
    w = np.ascontiguousarray(weight.T, dtype=np.float32).reshape(n, k // block_size, block_size)
    low, high = w.min(axis=-1, keepdims=True), w.max(axis=-1, keepdims=True)
    scale = np.where(high > low, (high - low) / 15, 1).astype(np.float32)
    zero = -low / scale
    beta, best, kept = 10.0, np.inf, zero
    for _ in range(iterations):
        q = np.clip(np.rint(w / scale + zero), 0, 15)
        error = w - scale * (q - zero)
        mean = float(np.abs(error).mean())
        if mean >= best:
            break
        best, kept = mean, zero
        with np.errstate(divide="ignore"):  # |e|^(p-1) is infinite at 0: shrinks that entry to 0
            sparse = np.sign(error) * np.maximum(np.abs(error) - np.abs(error) ** (norm - 1) / beta, 0)
        zero = (q - (w - sparse) / scale).mean(axis=-1, keepdims=True)
        beta *= 1.01
    q = np.clip(np.rint(w / scale + kept), 0, 15).astype(np.uint8)
    return q, scale[..., 0], (-kept * scale)[..., 0].astype(np.float32)


Blocks = tuple[np.ndarray, np.ndarray, np.ndarray]  # q [N, K / block, block] (0..15), scales, minimums [N, K / block]


def joined_blocks(parts: Sequence[Callable[[], Blocks]]) -> Blocks:
    """Blocks of several weights with the same input side by side (their outputs one after another)."""
    made = [make() for make in parts]
    return tuple(np.concatenate([m[i] for m in made]) for i in range(3))  # type: ignore[return-value]


def with_given_blocks(
    model: onnx.ModelProto,
    block_size: int,
    blocks: Mapping[str, Callable[[], Blocks]],
    deferred: dict[str, Deferred] | None = None,
    exact_rows: bool = False,
) -> onnx.ModelProto:
    """Each MatMul whose weight `blocks` names runs on those 4-bit blocks as they are (a GGUF file's Q4_0 and
    Q4_1 blocks: w = scale q + minimum; each read when it is stored), in the form `rtn-min` writes."""
    include = {n.name for n in model.graph.node if n.op_type == "MatMul" and len(n.input) == 2 and n.input[1] in blocks}
    return _with_block_minimums(model, block_size, include, given=blocks, deferred=deferred, exact_rows=exact_rows)


def _minimum_form(make: Callable[[], Blocks]) -> list[np.ndarray]:
    """The blocks `make` gives as `rtn-min`'s tensors: the packed integers, the scales (flat), what each
    block's sum of x is multiplied by, m + 8 s ([K / block, N]), and the scales and minimums as float16
    ([N, 2, K / block]: Quiver's own kernel's). Scales and minimums are float16 values in all of them, as
    GGUF stores them (exact for a GGUF file's blocks; within 2^-11 of a fitted value), so every form holds
    the same weights."""
    q, scales, minimums = make()
    halves = np.stack([scales, minimums], axis=1).astype(np.float16)
    scales, minimums = halves[:, 0].astype(np.float32), halves[:, 1].astype(np.float32)
    return [pack_nibbles(q), scales.reshape(-1), np.ascontiguousarray((minimums + 8 * scales).T), halves]


def _fitted(fit: Callable[[np.ndarray, int], Blocks], weight: Deferred, block_size: int) -> Blocks:
    return fit(weight.compute(), block_size)


def _block_ones(k: int, block_size: int) -> np.ndarray:
    """E [K, K / block]: ones on each block, x E the sums of x per block."""
    return np.kron(np.eye(k // block_size, dtype=np.float32), np.ones((block_size, 1), np.float32))


def _with_block_minimums(
    model: onnx.ModelProto,
    block_size: int,
    include: Collection[str],
    fit: Callable[[np.ndarray, int], Blocks] = block_minimums,
    given: Mapping[str, Callable[[], Blocks]] | None = None,
    deferred: dict[str, Deferred] | None = None,
    exact_rows: bool = False,
) -> onnx.ModelProto:
    """`rtn-min` and `hqq` (see the module): each MatMul named in `include` that fits (a [K, N] weight, K a
    multiple of the block) takes its blocks by `fit` (or `given`, by weight name), as one MatMul4Bits
    node in blocks of 32 (`exact_rows`: a decode step's, marked `few_rows`; else a prompt's, at accuracy
    level 0), else as MatMulNBits at float activations + the minimums' MatMul; the others stay as they are."""
    from onnx import helper

    from quiver.ir.edit import drop_unread_initializers
    from quiver.ir.ops import MS_DOMAIN, use_microsoft_domain, use_quiver_domain
    from quiver.ir.quiver_ops import MATMUL_4BITS, MATMUL_4BITS_BLOCK, QUIVER_DOMAIN

    graph = model.graph
    weights = _Weights(graph, deferred)
    block_sums: dict[str, str] = {}  # input -> its sums per block (one per input, whatever reads it)
    nodes: list[onnx.NodeProto] = []
    replaced: set[str] = set()
    native = block_size == MATMUL_4BITS_BLOCK  # Quiver's kernel takes blocks of 32
    for node in graph.node:
        weight = weights.tensors.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if weight is None or len(weight.dims) != 2 or weight.dims[0] % block_size or node.name not in include:
            nodes.append(node)
            continue
        source, name, out = node.input[0], node.input[1], node.output[0]
        k, n = (int(d) for d in weight.dims)
        if name not in replaced:  # a weight read by several MatMuls is quantized once
            make = given[name] if given and name in given else partial(_fitted, fit, weights.value(name), block_size)
            count = k // block_size
            shapes = [((n, count, block_size // 2), np.uint8), ((n * count,), np.float32), ((count, n), np.float32)]
            parts = made_together([*shapes, ((n, 2, count), np.float16)], partial(_minimum_form, make))
            # Quiver's kernel reads the blocks and their halves (ORT's form is made of those where it is
            # not built); ORT's operators the blocks, scales and offsets
            kept = (".q4", ".halves") if native else (".q4", ".scales", ".offsets")
            for suffix, part in zip((".q4", ".scales", ".offsets", ".halves"), parts):
                if suffix in kept:
                    weights.add(f"{name}{suffix}", part)
            replaced.add(name)
        if native:  # one node: Quiver's kernel, or ORT's operators in its place (the cpu backend's choice)
            # a prompt's activations kept to ~16 bits, as the blocks' accuracy asks (accuracy level 0)
            level: dict[str, Any] = {} if exact_rows else {"accuracy_level": 0}
            nodes.append(helper.make_node(MATMUL_4BITS, [source, f"{name}.q4", f"{name}.halves"], [out],
                                          name=node.name, domain=QUIVER_DOMAIN, K=k, N=n, block_size=block_size,
                                          few_rows=int(exact_rows), **level))  # fmt: skip
            continue
        if source not in block_sums:  # x E, E [K, K / block] ones on each block: one MatMul, any input rank
            sums = block_sums[source] = f"{source}.block_sums"
            weights.add(
                f"{sums}.blocks", Deferred((k, k // block_size), np.float32, partial(_block_ones, k, block_size))
            )
            nodes.append(helper.make_node("MatMul", [source, f"{sums}.blocks"], [sums], name=sums))
        nodes.append(helper.make_node(
            "MatMulNBits", [source, f"{name}.q4", f"{name}.scales"], [f"{out}.q4"], name=f"{node.name}.q4",
            domain=MS_DOMAIN, K=k, N=n, bits=4, block_size=block_size, accuracy_level=0,
        ))  # fmt: skip
        terms = [f"{out}.q4"]
        nodes += [
            helper.make_node("MatMul", [block_sums[source], f"{name}.offsets"], [f"{out}.minimums"],
                             name=f"{node.name}.minimums"),
            helper.make_node("Sum", [*terms, f"{out}.minimums"], [out], name=node.name),
        ]  # fmt: skip
    del graph.node[:]
    graph.node.extend(nodes)
    drop_unread_initializers(graph, replaced)
    use_microsoft_domain(model)
    if any(n.domain == QUIVER_DOMAIN for n in graph.node):
        use_quiver_domain(model)
    return model
