"""Many sequences over one context, one decode step for all of them, each on its own adapter (`quiver serve`).

Runs the context's batched graph (`batch`, made by `quiver t2t export`; its decode steps `batch_decode`
where the export made that graph): every row is one sequence with its own KV cache row and its own length,
and its own adapter. Adapters live in slots: each slot holds an
adapter's Aᵀ and B tables (`quiver.lora.create`'s per-row form), filled from its sections at the
strengths a request gives, kept while any sequence uses it and reused least recently used first. Any
number of adapters may exist on disk: only those in use need a slot. Slot 0 is the base model: no tables.

A step whose rows all run one adapter feeds that slot's tables, [1, R, width], one product for every row
(the base model: tables of rank 0, nothing read). A step of mixed adapters feeds per-row tables, [rows, R, width]:
row i holds a copy of its slot's, made when the row's adapter changes (a sequence joins or moves there;
a memory copy, between steps), so each step reads every row's tables once, in place.

Rows in decode are 0..n-1: a step runs on views of the first n rows of every buffer (leading-axis views
are contiguous, so ORT reads them in place). A sequence is prefilled, a window at a time, in the row
after them, and a sequence that ends leaves its row to the last one (its cache entries copied over).
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from quiver import fork, portable
from quiver.errors import GenerationError, QuiverError
from quiver.formats.section import SectionFile
from quiver.lora.create import fill_slot, table_module
from quiver.lora.peft import PeftAdapter, load_peft_adapter
from quiver.runtime.bound_run import BoundRun
from quiver.runtime.context import Context
from quiver.runtime.sections import SECTION_CACHE_BYTES
from quiver.runtime.state import MAX_LORA_STRENGTH
from quiver.t2t.adapters import AdapterSet
from quiver.t2t.config import (
    BATCH_DECODE_GRAPH,
    BATCH_GRAPH,
    DialogConfig,
    adapter_use_cases,
    cpu_backend_for,
    read_dialog_config,
)
from quiver.t2t.graph import INPUT_IDS, LOGITS, PAST, PRESENT, SEQLENS_K, TOTAL_LENGTH
from quiver.t2t.kv_memory import CacheMemory, zeros
from quiver.t2t.tokenizer import TextTokenizer

BASE_SLOT = 0


@dataclass(frozen=True)
class _Table:
    """One adapter table (an attach point's Aᵀ or B): each slot's and each row's [rank, width]."""

    slots: np.ndarray  # [slots - 1, rank, width]: slot s in entry s - 1 (the base model has none)
    rows: np.ndarray  # [max_batch, rank, width]: a copy of each row's slot, for steps of mixed adapters
    none: np.ndarray  # [1, 0, width]: no adapter


AdapterKey = tuple[str, tuple[tuple[str, float], ...]]  # an adapter and the strengths it runs with
_Binding = tuple[BoundRun, np.ndarray, np.ndarray, np.ndarray]  # the run; its ids, lengths, total
_PER_ROW = -1  # a binding on each row's own tables (else: on one slot's, for every row)


def _row_shape(shape: tuple[int | str | None, ...] | None) -> tuple[int, ...]:
    """A KV cache input's shape past the batch axis, [heads, positions, head size], when fixed; else ()."""
    if shape is None or len(shape) != 4 or not all(isinstance(d, int) for d in shape[1:]):
        return ()
    return tuple(int(d) for d in shape[1:])  # type: ignore[arg-type]


_TOO_BIG = "serve fewer sequences at once (--max-batch), or export with a smaller --context-size"


def _check_fits(needed: int) -> None:
    """Refuses, before a byte is written, buffers larger than the machine's memory (which writing them
    would not survive: the kernel kills a process that overcommits, it raises nothing)."""
    memory = portable.physical_memory()
    if memory is not None and needed > memory:
        raise GenerationError(
            f"the batch's KV cache and logits need {needed / 2**30:.1f} GiB; this machine has {memory / 2**30:.1f} "
            f"GiB: {_TOO_BIG}"
        )


class BatchDecoder:
    """The batched graph of one context, its KV rows and its adapter slots (one engine thread drives it;
    the adapter set may change from any thread)."""

    def __init__(
        self,
        config: DialogConfig,
        max_batch: int = 8,
        adapter_slots: int | None = None,
        packed_weights: str | Path | None = None,
    ) -> None:
        """`packed_weights`: a folder where the graph's packed weights are kept in a file, made once and
        mapped by every process that serves this context on the machine (see `CpuBackend`)."""
        if max_batch < 1:
            raise GenerationError(f"a batch holds at least one sequence, not {max_batch}")
        self.config = config
        self.max_batch = max_batch
        self.tokenizer = TextTokenizer(config.tokenizer)
        self._lock = threading.Lock()
        backend = cpu_backend_for(config, packed_weights, lazy_prepack=False)
        self._context = Context.from_binary(config.ctx_bins[0], backend=backend)
        try:
            self._setup(adapter_slots if adapter_slots is not None else max_batch)
        except BaseException:
            self._context.close()
            raise
        self.adapters = AdapterSet(self._context, adapter_use_cases(config), config.path)
        self.on_fill: Callable[[float], object] | None = None  # told how long each slot fill took
        fork.reset_after_fork(self)
        # prepare (and pack) the graphs now: the first request measures generation, not session creation
        self.prefill(0, [0], 0, BASE_SLOT)
        if self._step is not self._graph:
            self.decode([0], [1], [BASE_SLOT])
        self.free([0])  # the warm-up's cache pages: no sequence holds row 0 yet

    @classmethod
    def from_config(
        cls,
        path: str | Path,
        max_batch: int = 8,
        adapter_slots: int | None = None,
        packed_weights: str | Path | None = None,
    ) -> BatchDecoder:
        return cls(read_dialog_config(path), max_batch, adapter_slots, packed_weights)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()

    def _setup(self, adapter_slots: int) -> None:
        config = self.config
        if config.kv_cache != "quiver":
            raise GenerationError(
                f"{config.path}: a decoder packed as it was exported elsewhere runs under `quiver t2t run`; serving "
                "batches Quiver's own graphs: export the model's transformers folder with `quiver t2t export`"
            )
        if BATCH_GRAPH not in self._context.graph_names:
            raise GenerationError(
                f"{config.ctx_bins[0]} has no batched graph {BATCH_GRAPH!r} (serving needs it); export the model "
                "again with this version's `quiver t2t export`"
            )
        self._graph = graph = self._context.graph(BATCH_GRAPH)
        # decode steps run the export's graph of their own where it made one (Quiver's attention for one row a
        # sequence: the same inputs, outputs and weights), else the batched graph too
        names = self._context.graph_names
        self._step = self._context.graph(BATCH_DECODE_GRAPH) if BATCH_DECODE_GRAPH in names else graph
        inputs = {i.name: i for i in graph.inputs}
        rows = {name: _row_shape(info.shape) for name, info in inputs.items() if name.startswith(PAST)}
        if not rows or not all(rows.values()):
            raise GenerationError(f"{config.ctx_bins[0]}: graph {BATCH_GRAPH!r} has no KV cache inputs of a fixed size")
        self.capacity = next(iter(rows.values()))[1]
        if config.context_size > self.capacity:
            raise GenerationError(
                f"{config.path}: context.size {config.context_size} exceeds the {self.capacity} positions of the "
                "context's KV cache; lower it or export with a larger --context-size"
            )
        _check_fits(4 * self.max_batch * (sum(int(np.prod(row)) for row in rows.values()) + config.n_vocab))
        # every row's cache at full context, its memory made as tokens arrive and given back as sequences end
        self._cache_memory = CacheMemory({name: (self.max_batch, *row) for name, row in rows.items()})
        self._cache = self._cache_memory.arrays
        self._logits = zeros((self.max_batch, 1, config.n_vocab))  # as rows are used: logits and row tables
        # the adapter tables, each slot's and each row's [rank, width]: the rank is that of the prefill
        # graph's tensor of the same name, which the adapters' sections hold
        prefill = self._context.file.graphs.get(config.prefill_graph)
        if prefill is None:
            raise GenerationError(f"{config.ctx_bins[0]} lacks the config's prefill graph {config.prefill_graph!r}")
        weights = prefill.weights
        self._slot_count = adapter_slots + 1  # slot 0 (the base model) has no tables
        self._tables: dict[str, _Table] = {}
        for name, info in inputs.items():
            if name in (INPUT_IDS, SEQLENS_K, TOTAL_LENGTH) or name.startswith(PAST):
                continue
            stored = self._context.file.weights[weights[name]].shape if name in weights else None
            three_d = info.shape is not None and len(info.shape) == 3  # [1 or rows, rank, width]
            if stored is None or len(stored) != 2 or table_module(name) is None or not three_d:
                raise GenerationError(
                    f"{config.ctx_bins[0]}: graph {BATCH_GRAPH!r} input {name!r} is no adapter table of this "
                    "version's; export the model again with this version's `quiver t2t export`"
                )
            # the prefill graph's tensor of that name: Aᵀ's stored [in, R], B's [R, out]
            rank, width = (stored[0], stored[1]) if name.endswith(".B") else (stored[1], stored[0])
            self._tables[name] = _Table(
                np.zeros((adapter_slots, rank, width), np.float32),  # mapped as slots are filled
                zeros((self.max_batch, rank, width)),
                np.zeros((1, 0, width), np.float32),
            )
        self._peft: dict[str, PeftAdapter] = {}  # adapters loaded from PEFT folders (no sections)
        self._slots: OrderedDict[AdapterKey, int] = OrderedDict()  # filled slots, least recently used first
        self._users = [0] * self._slot_count  # sequences using each slot (a slot in use is never refilled)
        self._fills = [0] * self._slot_count  # how often each slot was filled: a row's copy of it is current
        self._row_holds: list[tuple[int, int]] = [(BASE_SLOT, 0)] * self.max_batch  # (slot, fill) each row copies
        self._bound: dict[tuple[int, int], _Binding] = {}

    # --- adapter slots ------------------------------------------------------------------------------
    def acquire_slot(self, adapter: str | None, strengths: Mapping[str, float] | None = None) -> int | None:
        """The slot holding `adapter` (None: the base model) at these strengths (those not given: its
        sections'), filled now if no slot holds it; None while every slot is in use. The slot stays
        as it is until `release_slot`."""
        if adapter is None:
            with self._lock:
                self._users[BASE_SLOT] += 1
            return BASE_SLOT
        if not self._tables:
            raise GenerationError(f"{self.config.ctx_bins[0]} was exported without adapters: only its base model runs")
        key: AdapterKey = (adapter, tuple(sorted((strengths or {}).items())))
        with self._lock:
            slot = self._slots.get(key)
            if slot is not None:
                self._slots.move_to_end(key)
            else:
                slot = self._free_slot()
                if slot is None:
                    return None
                start = time.perf_counter()
                self._fills[slot] += 1  # before any write: rows' copies of what it held are stale from here
                self._fill(slot, adapter, strengths or {})
                self._slots[key] = slot
                if self.on_fill is not None:
                    self.on_fill(time.perf_counter() - start)
            self._users[slot] += 1
            return slot

    def warm_adapters(self, budget_bytes: int = SECTION_CACHE_BYTES // 2) -> list[str]:
        """Reads and checks the sections of the adapters known now, in order, while their files fit
        `budget_bytes` (a part of the verified-section cache, so they stay in it): a first request on one then
        costs a slot fill, not a read and a check of its every tensor on the engine's thread, between two
        decode steps of the others. One that cannot be read is left to its first request to report.
        Returns the names warmed."""
        warmed, spent = [], 0
        for name in self.adapters.names:
            try:
                paths = self.adapters.get(name).bin_sections
                size = sum(Path(p).stat().st_size for p in paths)
                if not paths or spent + size > budget_bytes:
                    continue
                self._sections(paths)
            except (QuiverError, OSError):
                continue
            warmed.append(name)
            spent += size
        return warmed

    def _sections(self, paths: Sequence[Path]) -> list[SectionFile]:
        """An adapter's sections, read and checked against the prefill graph (whose values fill slots)."""
        return [self._context.check_binary_section(self.config.prefill_graph, path) for path in paths]

    def add_adapter(self, name: str, source: str | Path | Sequence[str | Path]) -> None:
        """One more adapter by name: a PEFT folder, or its sections (.qsec made for this context), checked
        now; it takes a slot when a request uses it."""
        if isinstance(source, (str, Path)) and Path(source).is_dir():
            adapter = self._peft_adapter(name, Path(source))
            self.adapters.add_unsectioned(name)
            with self._lock:
                self._peft[name] = adapter
        else:
            self.adapters.add(name, [source] if isinstance(source, (str, Path)) else source)

    def _peft_adapter(self, name: str, folder: Path) -> PeftAdapter:
        """A PEFT adapter, checked against the tables: every module it adapts has one, no rank beyond it."""
        adapter = load_peft_adapter(folder, name)
        tables = {found: self._tables[t] for t in self._tables if (found := table_module(t)) is not None}
        for module, weights in adapter.modules.items():
            a, b = tables.get((module, "A")), tables.get((module, "B"))
            if weights.is_conv or a is None or b is None:
                raise GenerationError(
                    f"{folder}: module {module!r} has no LoRA branch in this context (it has them on "
                    f"{len({m for m, _ in tables})} modules); export the model with an adapter on it"
                )
            (_, rank, width_in), width_out = a.slots.shape, b.slots.shape[2]
            if weights.rank > rank or weights.lora_a.shape[1] != width_in or weights.lora_b.shape[0] != width_out:
                raise GenerationError(
                    f"{folder}: module {module!r} is rank {weights.rank}, [{weights.lora_b.shape[0]} x "
                    f"{weights.lora_a.shape[1]}]; this context's branch there is at most rank {rank}, "
                    f"[{width_out} x {width_in}]: export with an adapter of that rank, or use another base model"
                )
        return adapter

    def remove_adapter(self, name: str) -> None:
        """Forgets an adapter: new requests for it are refused; sequences running on it finish."""
        self.adapters.remove(name)
        with self._lock:  # its slots are free once no sequence uses them (a new adapter may take the name)
            self._peft.pop(name, None)
            for key in [k for k in self._slots if k[0] == name]:
                del self._slots[key]

    def release_slot(self, slot: int) -> None:
        with self._lock:
            self._users[slot] -= 1

    def _free_slot(self) -> int | None:
        """A slot never filled, else the least recently used one no sequence uses (forgotten now)."""
        filled = set(self._slots.values())
        empty = [s for s in range(1, self._slot_count) if s not in filled and not self._users[s]]
        if empty:
            return empty[0]
        key = next((k for k, s in self._slots.items() if self._users[s] == 0), None)
        return None if key is None else self._slots.pop(key)

    def _fill(self, slot: int, adapter: str, strengths: Mapping[str, float]) -> None:
        for name, value in strengths.items():  # a strength beyond these overflows the step: NaN for every row
            if not math.isfinite(value) or abs(value) > MAX_LORA_STRENGTH:
                raise GenerationError(
                    f"strength {value} for {name!r} is not a number from -{MAX_LORA_STRENGTH:g} to "
                    f"{MAX_LORA_STRENGTH:g}"
                )
        config = self.adapters.get(adapter)
        peft = self._peft.get(adapter)
        if peft is not None:
            self._fill_from_peft(slot, peft, strengths)
            return
        state = self._context.state_with_sections(self.config.prefill_graph, self._sections(config.bin_sections))
        if state.lora is None:
            raise GenerationError(f"adapter {adapter!r}: its sections carry no LoRA strengths; export it again")
        alphas = np.array(state.lora.alphas, np.float32)
        for name, value in strengths.items():
            if name not in state.lora.active:
                raise GenerationError(f"adapter {adapter!r} has no strength {name!r}; it has {list(state.lora.active)}")
            alphas[state.lora.adapters.index(name)] = value
        fill_slot(self._slot_rows(slot), state.values, alphas)

    def _fill_from_peft(self, slot: int, adapter: PeftAdapter, strengths: Mapping[str, float]) -> None:
        """A slot from a PEFT adapter itself: Aᵀ is PEFT's A, B is PEFT's Bᵀ times its scaling and strength."""
        unknown = sorted(set(strengths) - {adapter.name})
        if unknown:
            raise GenerationError(f"adapter {adapter.name!r} has no strength {unknown[0]!r}; it has [{adapter.name!r}]")
        strength = float(strengths.get(adapter.name, 1.0))
        for name, rows in self._slot_rows(slot).items():
            found = table_module(name)
            weights = adapter.modules.get(found[0]) if found else None
            if weights is None:
                rows[:] = 0
                continue
            rows[weights.rank :] = 0
            if name.endswith(".B"):
                np.multiply(weights.lora_b.T, weights.scaling * strength, out=rows[: weights.rank])
            else:
                np.copyto(rows[: weights.rank], weights.lora_a)

    def _slot_rows(self, slot: int) -> dict[str, np.ndarray]:
        """Each table's [rank, width] of one adapter slot (views), to fill."""
        return {name: t.slots[slot - 1] for name, t in self._tables.items()}

    def _slot_tables(self, slot: int) -> dict[str, np.ndarray]:
        """Each table of one slot as the graph's input when every row runs it, [1, rank, width] (views; the
        base model's: rank 0)."""
        if slot == BASE_SLOT:
            return {name: t.none for name, t in self._tables.items()}
        return {name: t.slots[slot - 1 : slot] for name, t in self._tables.items()}

    def _copy_to_rows(self, slots: Sequence[int]) -> None:
        """Row i's tables made a copy of slot `slots[i]`'s (zeros for the base model), where they are not."""
        for row, slot in enumerate(slots):
            holds = (slot, self._fills[slot])
            if self._row_holds[row] == holds:
                continue
            for table in self._tables.values():
                if slot == BASE_SLOT:
                    table.rows[row] = 0
                else:
                    table.rows[row] = table.slots[slot - 1]
            self._row_holds[row] = holds

    # --- steps --------------------------------------------------------------------------------------
    def prefill(self, row: int, ids: Sequence[int], cached: int, slot: int) -> np.ndarray:
        """Feeds `ids` to row `row`, which holds `cached` tokens, on adapter slot `slot`; returns the logits
        of the last ([vocab], a view the next step overwrites)."""
        total = cached + len(ids)
        feeds: dict[str, np.ndarray] = {
            INPUT_IDS: np.array([ids], np.int64),
            SEQLENS_K: np.array([total - 1], np.int32),
            TOTAL_LENGTH: np.array(total, np.int32),
            **self._slot_tables(slot),
        }
        caches, out = self._rows(slice(row, row + 1))
        with self._lock:
            # a window of a prompt gives back what its activations took: the decode steps between need far less
            self._graph.execute(feeds | caches, out=out, release_scratch=len(ids) > 1)
        return self._logits[row, 0]

    def decode(self, tokens: Sequence[int], cached: Sequence[int], slots: Sequence[int]) -> np.ndarray:
        """One step of rows 0..n-1: row i feeds `tokens[i]` after its `cached[i]` tokens, on slot `slots[i]`;
        returns the logits, [n, vocab] (a view the next step overwrites)."""
        n = len(tokens)
        with self._lock:
            shared = slots[0] if all(s == slots[0] for s in slots) else _PER_ROW
            if shared == _PER_ROW:
                self._copy_to_rows(slots)
            run, ids, lengths, total = self._binding(n, shared)
            ids[:, 0] = tokens
            lengths[:] = cached  # GQA's seqlens_k: the tokens after this step, minus one
            total[()] = max(cached) + 1
            run.run()
        return self._logits[:n, 0]

    def _binding(self, n: int, tables: int) -> _Binding:
        """The run of n rows on one slot's tables (`tables`, a slot) or each row's own (`_PER_ROW`), bound
        once (views of the same buffers each time)."""
        bound = self._bound.get((n, tables))
        if bound is None:
            ids, lengths, total = np.zeros((n, 1), np.int64), np.zeros(n, np.int32), np.zeros((), np.int32)
            caches, out = self._rows(slice(0, n))
            if tables == _PER_ROW:
                feeds = {name: t.rows[:n] for name, t in self._tables.items()}
            else:
                feeds = self._slot_tables(tables)
            feeds |= {INPUT_IDS: ids, SEQLENS_K: lengths, TOTAL_LENGTH: total, **caches}
            run = self._step.bind(feeds, out)
            bound = self._bound[(n, tables)] = (run, ids, lengths, total)
        return bound

    def _rows(self, rows: slice) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """The cache views of these rows as past feeds, and the outputs: the logits, and as presents the
        very same view objects (the backend then hands ORT one buffer for both: appended in place)."""
        caches = {name: array[rows] for name, array in self._cache.items()}
        out = {LOGITS: self._logits[rows]} | {PRESENT + n[len(PAST) :]: a for n, a in caches.items()}
        return caches, out

    def move(self, source: int, target: int, cached: int) -> None:
        """Moves a sequence's cache entries (its first `cached` positions) from one row to another; the
        target's former entries and the source's memory are given back."""
        with self._lock:
            self._cache_memory.drop_rows([target])
            for array in self._cache.values():
                array[target, :, :cached] = array[source, :, :cached]
            self._cache_memory.drop_rows([source])

    def copy_out(self, row: int, length: int) -> dict[str, np.ndarray]:
        """A copy of a row's first `length` cache positions (a prompt prefix kept for reuse)."""
        with self._lock:
            return {name: array[row, :, :length].copy() for name, array in self._cache.items()}

    def copy_in(self, row: int, rows: Mapping[str, np.ndarray] | int, length: int) -> None:
        """Writes `length` positions kept by `copy_out`, or those of another row, into a row: its sequence
        goes on after them."""
        with self._lock:
            for name, array in self._cache.items():
                array[row, :, :length] = array[rows, :, :length] if isinstance(rows, int) else rows[name][:, :length]

    @property
    def token_bytes(self) -> int:
        """The bytes one position of one row takes across every cache."""
        return sum(int(a[0, :, 0].nbytes) for a in self._cache.values())

    def free(self, rows: Sequence[int]) -> None:
        """These rows' sequences ended: their cache memory goes back to the OS."""
        with self._lock:
            self._cache_memory.drop_rows(rows)

    def close(self) -> None:
        self._context.close()
