"""Structure-aware fuzzing of context binaries (`.qctx`) and sections (`.qsec`).

Each input is a seed file with one or more mutations: header JSON values and keys (then the header's
checksum and the preamble are recomputed, so mutations get past them), raw header bytes, preamble
fields, truncation and extension points, data bytes, graph skeletons (protobuf fields; the file is laid
out again by Quiver's own writer) and LoRA metadata. Each runs in a forked child with memory and time
caps: load, verify, execute every graph (a section: apply it, then execute). An outcome must be a
typed `QuiverError`, a `verify` failure, or an output equal to the seed's ("other" counts files that
are still well-formed contexts computing something else, e.g. two same-shaped weights swapped).

    python -m tests.fuzz.harness --count 20000 --jobs 2         # the long campaign (JSON report)
    python -m tests.fuzz.harness --count 1 --first 1234 --show  # one input again
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import resource
import select
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

import quiver
from quiver.commands.report import describe_context, describe_section
from quiver.formats.layout import PREAMBLE_SIZE, Preamble
from quiver.formats.reader import ContextFile
from quiver.formats.section import SectionFile
from quiver.formats.writer import ContextWriter

MEMORY_CAP = 3 << 30  # address space a child may add to what the harness already has
TIME_CAP_S = 20


@dataclass
class Seed:
    name: str
    context: bytes
    feeds: dict[str, dict[str, np.ndarray]]  # per graph
    expected: dict[str, dict[str, np.ndarray]]  # per graph, without a section
    section: bytes | None = None  # a section of this context, and its graph
    section_graph: str = ""
    expected_with_section: dict[str, np.ndarray] | None = None


# --- seeds ------------------------------------------------------------------------------------------


def _run_all(context: quiver.Context, feeds: dict[str, dict[str, np.ndarray]]) -> dict[str, dict[str, np.ndarray]]:
    return {name: context.graph(name).execute(feeds[name]) for name in context.graph_names}


def make_seeds(folder: Path) -> list[Seed]:
    """A LoRA context with a section (PEFT adapters through `quiver lora prepare`), a transformer family,
    and a 4-bit quantized transformer."""
    from quiver.testing.family import SMALL, make_family, sample_input_ids
    from tests.stress.concurrency import X, make_lora_project

    seeds = []
    project = make_lora_project(folder / "lora")
    feeds = {"model": {"x": X}}
    with quiver.Context.from_binary(project.context) as context:
        expected = _run_all(context, feeds)
        context.apply_binary_section("model", project.section("strong"))
        with_section = context.graph("model").execute(feeds["model"])
        context.wait_until_ready()
    seeds.append(
        Seed(
            "lora",
            project.context.read_bytes(),
            feeds,
            expected,
            project.section("strong").read_bytes(),
            "model",
            with_section,
        )
    )
    family = quiver.Context.create("cpu", workdir=folder)
    for name, model in list(make_family(SMALL, count=2).items()):
        family.add_graph(name, model)
    path = family.save(folder / "family.qctx")
    family.close()
    ids = {"input_ids": sample_input_ids(SMALL, 1, 6, seed=5)}
    with quiver.Context.from_binary(path) as context:
        feeds = {name: ids for name in context.graph_names}
        expected = _run_all(context, feeds)
        context.wait_until_ready()
    seeds.append(Seed("family", path.read_bytes(), feeds, expected))
    # a quantized context: weights with encodings (format 1.2) and 4-bit MatMulNBits blocks
    from quiver.passes.qdq import QuantizeOptions, quantize

    base = next(iter(make_family(SMALL, count=1).values()))
    samples = [{"input_ids": sample_input_ids(SMALL, 1, 6, seed=s)} for s in range(4)]
    qdq, _ = quantize(base, samples, QuantizeOptions(weight_bits=4, block_size=32))
    quantized = quiver.Context.create("cpu", workdir=folder)
    quantized.add_graph("base", qdq)
    path = quantized.save(folder / "quantized.qctx")
    quantized.close()
    with quiver.Context.from_binary(path) as context:
        feeds = {"base": ids}
        expected = _run_all(context, feeds)
        context.wait_until_ready()
    seeds.append(Seed("quantized", path.read_bytes(), feeds, expected))
    return seeds


# --- mutations --------------------------------------------------------------------------------------

_SENTINEL = "@@quiver-fuzz@@"
_RAW_VALUES = [
    "0", "-1", "1", "4096", "4097", "2147483648", "18446744073709551617", "1" * 5000, "1e999", "-1e999",
    "NaN", "Infinity", "1.5", "true", "null", '""', '"x"', '"' + "y" * 5000 + '"', "[]", "{}", "[[[[]]]]",
    "[" * 5000 + "]" * 5000, '"\\ud800"', '"\\u001b[31mred"', '"a\\u0000b"', '"\\u202eevil"', '"float32"',
    '"int4"', '"float8e4m3fn"', '"string"', '"bool"', "[1, 2, 3]", "[-1]", "[0]", "[1000000000, 1000000000]",
    '{"sha256": "0"}', '"' + "0" * 64 + '"', '"' + "f" * 64 + '"', '"quiver-weight"',
]  # fmt: skip


def _split(data: bytes) -> tuple[bytes, Preamble, dict[str, Any]]:
    magic, pre = Preamble.unpack(data[:PREAMBLE_SIZE])
    return magic, pre, json.loads(data[pre.header_offset :])


def reseal(data: bytes, header_text: bytes) -> bytes:
    """The file with a new header at its tail, its length and checksum in the preamble recomputed."""
    magic, pre = Preamble.unpack(data[:PREAMBLE_SIZE])
    body = data[: pre.header_offset]
    new = Preamble(
        pre.major,
        pre.minor,
        pre.flags,
        pre.header_offset,
        len(header_text),
        pre.header_offset + len(header_text),
        hashlib.sha256(header_text).digest(),
        pre.reserved,
    )
    return new.pack(magic) + body[PREAMBLE_SIZE:] + header_text


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            found += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found += _paths(value, (*prefix, index))
    return found


def _set(node: Any, path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def _header_value(data: bytes, rng: random.Random) -> bytes:
    _, pre, header = _split(data)
    path = rng.choice(_paths(header)[1:])
    _set(header, path, _SENTINEL)
    text = json.dumps(header).replace(json.dumps(_SENTINEL), rng.choice(_RAW_VALUES))
    return reseal(data, text.encode())


def _header_delete(data: bytes, rng: random.Random) -> bytes:
    _, pre, header = _split(data)
    paths = [p for p in _paths(header)[1:] if p]
    path = rng.choice(paths)
    parent: Any = header
    for key in path[:-1]:
        parent = parent[key]
    del parent[path[-1]]
    return reseal(data, json.dumps(header).encode())


def _header_swap(data: bytes, rng: random.Random) -> bytes:
    """Two values of the header exchanged (indices, offsets, names): structure kept, meaning changed."""
    _, pre, header = _split(data)
    leaves = [p for p in _paths(header)[1:] if not isinstance(_get(header, p), (dict, list))]
    first, second = rng.sample(leaves, 2)
    a, b = _get(header, first), _get(header, second)
    _set(header, first, b)
    _set(header, second, a)
    return reseal(data, json.dumps(header).encode())


def _get(node: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        node = node[key]
    return node


def _header_bytes(data: bytes, rng: random.Random) -> bytes:
    _, pre = Preamble.unpack(data[:PREAMBLE_SIZE])
    header = bytearray(data[pre.header_offset :])
    for _ in range(rng.randint(1, 4)):
        position = rng.randrange(len(header))
        choice = rng.random()
        if choice < 0.4:
            header[position] = rng.randrange(256)
        elif choice < 0.7:
            header[position:position] = bytes([rng.choice(b'{}[]",:0123456789-e.\\\xff\xc3\x80')])
        else:
            del header[position : position + rng.randint(1, 8)]
    return reseal(data, bytes(header))


def _preamble_field(data: bytes, rng: random.Random) -> bytes:
    magic, pre = Preamble.unpack(data[:PREAMBLE_SIZE])
    fields = vars(pre).copy()
    field = rng.choice(["major", "minor", "flags", "header_offset", "header_length", "file_length", "reserved"])
    limits = {"major": 0xFFFF, "minor": 0xFFFF, "flags": 0xFFFFFFFF}
    value = rng.choice([0, 1, 2, 4095, 4096, len(data), len(data) + 1, 2**32 - 1, 2**63, 2**64 - 1])
    fields[field] = value % (limits.get(field, 2**64 - 1) + 1)
    if field == "reserved" or rng.random() < 0.2:
        magic = rng.choice([magic, b"QCTX\r\n\x1a\n", b"QSEC\r\n\x1a\n", b"PK\x03\x04xxxx"])
    return Preamble(**fields).pack(magic) + data[PREAMBLE_SIZE:]


def _truncate(data: bytes, rng: random.Random) -> bytes:
    cut = rng.choice([rng.randrange(len(data)), rng.randrange(PREAMBLE_SIZE + 1), len(data) - 1])
    cut_data = data[:cut]
    if cut >= PREAMBLE_SIZE and rng.random() < 0.5:  # the preamble told the new length
        magic, pre = Preamble.unpack(cut_data[:PREAMBLE_SIZE])
        fields = {**vars(pre), "file_length": cut}
        cut_data = Preamble(**fields).pack(magic) + cut_data[PREAMBLE_SIZE:]
    return cut_data


def _extend(data: bytes, rng: random.Random) -> bytes:
    magic, pre = Preamble.unpack(data[:PREAMBLE_SIZE])
    extra = bytes(rng.randrange(256) for _ in range(rng.choice([1, 7, 64, 4096])))
    fields = {**vars(pre), "file_length": len(data) + len(extra)}
    return Preamble(**fields).pack(magic) + data[PREAMBLE_SIZE:] + extra


def _data_bytes(data: bytes, rng: random.Random) -> bytes:
    _, pre = Preamble.unpack(data[:PREAMBLE_SIZE])
    body = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        position = rng.randrange(PREAMBLE_SIZE, pre.header_offset)
        body[position] ^= 1 << rng.randrange(8)
    return bytes(body)


def _skeleton(data: bytes, rng: random.Random) -> bytes:
    """One graph's ONNX structure mutated, the file laid out again by Quiver's writer (checksums right)."""
    file = ContextFile(data)
    name = rng.choice(list(file.graphs))
    model = onnx.ModelProto.FromString(file.skeleton(name))
    _mutate_model(model, rng)
    skeletons = {g: file.skeleton(g) for g in file.graphs}
    skeletons[name] = model.SerializeToString()
    return _relayout(file, skeletons)


def _mutate_model(model: onnx.ModelProto, rng: random.Random) -> None:
    graph = model.graph
    node = rng.choice(graph.node) if graph.node else None
    kind = rng.randrange(12)
    if kind == 0 and node is not None:
        del node.input[:]
    elif kind == 1 and node is not None and node.input:
        node.input[rng.randrange(len(node.input))] = rng.choice(["", "missing", graph.input[0].name])
    elif kind == 2 and node is not None:
        node.op_type = rng.choice(["NoSuchOp", "Gather", "MatMulNBits", "Loop", "If", "Constant", "Reshape"])
    elif kind == 3 and node is not None:
        node.attribute.append(onnx.helper.make_attribute(rng.choice(["axis", "to", "perm", "value"]), "wrong"))
    elif kind == 4 and graph.initializer:
        tensor = rng.choice(graph.initializer)
        tensor.data_type = rng.choice([0, 8, 16, 17, 21, 22, 23, 999])
    elif kind == 5 and graph.initializer:
        tensor = rng.choice(graph.initializer)
        tensor.dims.append(rng.choice([0, 2, 1 << 40]))
    elif kind == 6 and graph.output:
        del graph.output[:]
    elif kind == 7:
        graph.input.append(graph.input[0])
    elif kind == 8:
        graph.input[0].type.tensor_type.elem_type = rng.choice([0, 8, 17, 23, 999])
    elif kind == 9 and node is not None:
        node.domain = rng.choice(["com.microsoft", "ai.onnx.ml", "evil"])
    elif kind == 10:
        del model.opset_import[:]
    elif node is not None:
        node.output[0] = graph.output[0].name if graph.output else "y"


def _relayout(file: ContextFile, skeletons: dict[str, bytes]) -> bytes:
    writer = ContextWriter(tempfile.gettempdir())
    try:
        for weight in file.weights:
            chunk = bytes(file.buffer[weight.offset : weight.offset + weight.length])
            index = writer.add_weight(weight.dtype, weight.shape, [chunk], weight.encoding)
            assert index == weight.index
        for name, entry in file.graphs.items():
            writer.add_graph(name, skeletons[name], entry.weights, entry.updateable)
        path = writer.finish()
        try:
            return path.read_bytes()
        finally:
            writer.discard()
    except BaseException:
        writer.abort()
        raise


def _lora_metadata(data: bytes, rng: random.Random) -> bytes:
    _, pre, header = _split(data)
    lora = header.setdefault("metadata", {}).setdefault("lora", {})
    key = rng.choice(["alpha_input", "adapters", "alphas", "active"])
    lora[key] = _SENTINEL
    text = json.dumps(header).replace(json.dumps(_SENTINEL), rng.choice(_RAW_VALUES))
    return reseal(data, text.encode())


Mutator = Callable[[bytes, random.Random], bytes]
_ANY_FILE: dict[str, Mutator] = {
    "header_value": _header_value,
    "header_delete": _header_delete,
    "header_swap": _header_swap,
    "header_bytes": _header_bytes,
    "preamble_field": _preamble_field,
    "truncate": _truncate,
    "extend": _extend,
    "data_bytes": _data_bytes,
}
MUTATORS: dict[str, dict[str, Mutator]] = {
    "context": {**_ANY_FILE, "skeleton": _skeleton},
    "section": {**_ANY_FILE, "lora_metadata": _lora_metadata},
}


def make_input(seeds: list[Seed], index: int, base_seed: int) -> tuple[Seed, str, list[str], bytes]:
    """Input number `index` of a campaign: reproducible on its own."""
    rng = random.Random(base_seed * 1_000_003 + index)
    seed = rng.choice(seeds)
    kind = "section" if seed.section is not None and rng.random() < 0.4 else "context"
    data = seed.section if kind == "section" else seed.context
    assert data is not None
    applied = []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        name = rng.choice(list(MUTATORS[kind]))
        try:
            data = MUTATORS[kind][name](data, rng)
        except Exception:  # a mutation that no longer applies to an already mutated file: stop here
            break
        applied.append(name)
    return seed, kind, applied, data


# --- the oracle, in a child -------------------------------------------------------------------------


def _same(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> bool:
    return got.keys() == expected.keys() and all(
        got[k].shape == v.shape and np.allclose(got[k], v, rtol=1e-5, atol=1e-5) for k, v in expected.items()
    )


def oracle(seed: Seed, kind: str, data: bytes) -> str:
    """The outcome of one input: typed, verify, same, other, or untyped:<what>."""
    try:
        if kind == "context":
            with quiver.Context.from_binary(data) as context:
                describe_context(context)  # what `quiver inspect` shows
                if context.file.verify():
                    return "verify"
                for name in context.graph_names:
                    context.graph(name).encodings()
                same = all(
                    name in seed.expected and _same(context.graph(name).execute(seed.feeds[name]), seed.expected[name])
                    for name in context.graph_names
                )
                return "same" if same and context.graph_names == list(seed.expected) else "other"
        with quiver.Context.from_binary(seed.context) as context:
            section = SectionFile(data)
            describe_section(section, "fuzzed.qsec")
            if section.verify():
                return "verify"
            context.apply_binary_section(seed.section_graph, section)
            got = context.graph(seed.section_graph).execute(seed.feeds[seed.section_graph])
            assert seed.expected_with_section is not None
            return "same" if _same(got, seed.expected_with_section) else "other"
    except quiver.QuiverError:
        return "typed"
    except Exception as exc:  # what the campaign is looking for
        return f"untyped:{type(exc).__name__}: {str(exc)[:200]}"


def _child(seed: Seed, kind: str, data: bytes, write: int) -> None:
    """Runs in the forked child: caps, oracle, report, and out without any exit work."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (_address_space() + MEMORY_CAP, hard))
        signal.alarm(TIME_CAP_S)  # default action: the child ends, the parent sees SIGALRM
        outcome = oracle(seed, kind, data)
    except MemoryError:
        outcome = "untyped:MemoryError"
    except BaseException as exc:
        outcome = f"untyped:{type(exc).__name__}: {exc}"
    os.write(write, outcome.encode("utf-8", "replace")[:4000])
    os._exit(0)


def _address_space() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 0


@dataclass
class Result:
    index: int
    seed: str
    kind: str
    mutations: list[str]
    outcome: str


def campaign(seeds: list[Seed], count: int, jobs: int, first: int = 0, base_seed: int = 0) -> list[Result]:
    """Inputs `first` .. `first + count - 1`, each in its own forked child, `jobs` at a time."""
    results: list[Result] = []
    running: dict[int, tuple[int, Result]] = {}  # pid -> (read end, result to fill)
    pending = iter(range(first, first + count))
    exhausted = False
    while running or not exhausted:
        while not exhausted and len(running) < jobs:
            index = next(pending, None)
            if index is None:
                exhausted = True
                break
            seed, kind, mutations, data = make_input(seeds, index, base_seed)
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(read)
                _child(seed, kind, data, write)
            os.close(write)
            running[pid] = (read, Result(index, seed.name, kind, mutations, ""))
        if not running:
            break  # the inputs ran out just as the last child was collected
        pid, status = os.wait()
        read, result = running.pop(pid)
        ready, _, _ = select.select([read], [], [], 0)
        report = os.read(read, 4096).decode("utf-8", "replace") if ready else ""
        os.close(read)
        if os.WIFSIGNALED(status):
            signal_name = signal.Signals(os.WTERMSIG(status)).name
            result.outcome = "hang" if signal_name == "SIGALRM" else f"crash:{signal_name}"
        else:
            result.outcome = report or f"crash:exit {os.waitstatus_to_exitcode(status)}"
        results.append(result)
    return sorted(results, key=lambda r: r.index)


ACCEPTED = ("typed", "verify", "same", "other")


def summary(results: list[Result]) -> dict[str, Any]:
    outcomes = Counter(r.outcome.split(":")[0] for r in results)
    bad = [r for r in results if r.outcome not in ACCEPTED]
    return {
        "inputs": len(results),
        "outcomes": dict(outcomes),
        "by_mutation": {
            name: dict(Counter(r.outcome.split(":")[0] for r in results if name in r.mutations))
            for name in sorted({m for r in results for m in r.mutations})
        },
        "failures": len(bad),
        "failure_examples": [vars(r) for r in bad[:20]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--count", type=int, default=20000)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--first", type=int, default=0, help="index of the first input (to replay one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show", action="store_true", help="print every input's outcome")
    args = parser.parse_args()
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as folder:
        seeds = make_seeds(Path(folder))
        results = campaign(seeds, args.count, args.jobs, args.first, args.seed)
    if args.show:
        for result in results:
            print(json.dumps(vars(result)), file=sys.stderr)
    print(json.dumps({**summary(results), "seconds": round(time.monotonic() - start, 1)}, indent=2))


if __name__ == "__main__":
    main()
