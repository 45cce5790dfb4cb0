"""`quiver serve` over a decoder exported elsewhere (`quiver.t2t.onnx_decoder`): `BatchDecoder`'s interface,
each row its own cache (`ExternalCache`) stepped in turn through the decode graph. Such a graph takes one
sequence a run, so a step of n rows is n runs: correct tokens, without the batched graph's speed-up."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from quiver import fork
from quiver.errors import GenerationError
from quiver.runtime.context import Context
from quiver.t2t.config import DialogConfig, cpu_backend_for
from quiver.t2t.external_cache import ExternalCache
from quiver.t2t.tokenizer import TextTokenizer

BASE_SLOT = 0


class NoAdapters:
    """The adapter set of a context without any: queries name none, loads are refused."""

    names: list[str] = []


class ExternalBatch:
    """Rows of an imported decoder for the serving engine (one engine thread drives it)."""

    def __init__(self, config: DialogConfig, max_batch: int = 8, packed_weights: str | Path | None = None) -> None:
        if max_batch < 1:
            raise GenerationError(f"a batch holds at least one sequence, not {max_batch}")
        self.config = config
        self.max_batch = max_batch
        self.tokenizer = TextTokenizer(config.tokenizer)
        self.adapters = NoAdapters()
        self.on_fill = None
        self._lock = threading.Lock()
        backend = cpu_backend_for(config, packed_weights, lazy_prepack=False)  # packed before the first request
        self._context = Context.from_binary(config.ctx_bins[0], backend=backend)
        try:
            self._prefill = self._context.graph(config.prefill_graph)
            self._decode = self._context.graph(config.decode_graph)
            self._rows = [ExternalCache(self._decode, config.kv_cache, config.context_size) for _ in range(max_batch)]
        except BaseException:
            self._context.close()
            raise
        self._logits = np.zeros((max_batch, config.n_vocab), np.float32)
        fork.reset_after_fork(self)
        self.prefill(0, [0], 0, BASE_SLOT)  # prepare the graphs now, not on the first request

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()

    def _refuse(self) -> GenerationError:
        return GenerationError(
            f"{self.config.path}: a decoder packed as it was exported elsewhere runs without adapters; export the "
            "transformers folder with `quiver t2t export --lora` to serve adapters"
        )

    def acquire_slot(self, adapter: str | None, strengths: Mapping[str, float] | None = None) -> int | None:
        if adapter is not None:
            raise self._refuse()
        return BASE_SLOT

    def release_slot(self, slot: int) -> None:
        pass  # one slot, the base model's, never refilled

    def warm_adapters(self, budget_bytes: int = 0) -> list[str]:
        return []

    def add_adapter(self, name: str, source: str | Path | Sequence[str | Path]) -> None:
        raise self._refuse()

    def remove_adapter(self, name: str) -> None:
        raise self._refuse()

    def prefill(self, row: int, ids: Sequence[int], cached: int, slot: int) -> np.ndarray:
        """Feeds `ids` to row `row` after its `cached` tokens; the logits of the last ([vocab])."""
        with self._lock:
            self._rows[row].step(self._prefill, list(ids), cached, self._logits[row])
        return self._logits[row]

    def decode(self, tokens: Sequence[int], cached: Sequence[int], slots: Sequence[int]) -> np.ndarray:
        """One token for each of rows 0..n-1 (a run each); their logits, [n, vocab]."""
        with self._lock:
            for row, (token, done) in enumerate(zip(tokens, cached)):
                self._rows[row].step(self._decode, [int(token)], int(done), self._logits[row])
        return self._logits[: len(tokens)]

    def move(self, source: int, target: int, cached: int) -> None:
        """The sequence of row `source` continues in row `target` (its cache goes with it)."""
        with self._lock:
            self._rows[target], self._rows[source] = self._rows[source], self._rows[target]

    def free(self, rows: Sequence[int]) -> None:
        """Nothing to give back: each row's cache is the exported decoder's own, grown by its runs."""

    def close(self) -> None:
        self._context.close()
