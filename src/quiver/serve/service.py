"""What the HTTP routes drive: a generation service, the scheduler in this process or replicas on Ray Serve."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

from quiver.errors import QuiverError
from quiver.serve.metrics import Metrics
from quiver.serve.prefix_cache import DEFAULT_BUDGET_BYTES
from quiver.serve.scheduler import Event, Generation, Job, Scheduler
from quiver.t2t.batch import BatchDecoder
from quiver.t2t.config import read_dialog_config
from quiver.t2t.external_batch import ExternalBatch
from quiver.t2t.tokenizer import TextTokenizer


class ServiceUnavailableError(QuiverError):
    """The service lost a request it had taken (a replica stopped): sending it again will work (HTTP 503)."""


class Service(Protocol):
    """Runs generations and holds the adapters they name (the routes tokenize; the service decodes)."""

    tokenizer: TextTokenizer
    context_size: int
    vocabulary: int

    def adapter_names(self) -> list[str]: ...

    def submit(self, generation: Generation, sink: Callable[[Event], object]) -> Job:
        """Queues a generation, its events to `sink` (from any thread). Raises `QueueFullError`."""
        ...

    def cancel(self, job: Job) -> None: ...

    @property
    def waiting(self) -> int: ...

    @property
    def batch_size(self) -> int: ...

    def add_adapter(self, name: str, path: str) -> None:
        """One more adapter (a PEFT folder or a .qsec), checked now (blocks: call it off the event loop)."""
        ...

    def remove_adapter(self, name: str) -> None: ...

    def watch(self, metrics: Metrics) -> None:
        """Reports what only the service sees (decode steps, slot fills) to `metrics`."""
        ...

    def close(self) -> None: ...


class LocalService:
    """The continuous-batching scheduler over one context, in this process (`quiver serve`)."""

    @classmethod
    def open(
        cls,
        config: str | Path,
        max_batch: int,
        max_loras: int | None,
        adapters: Mapping[str, str | Path],
        max_queue: int = 64,
        prefill_window: int | None = None,
        packed_weights: str | Path | None = None,
        prefix_cache_bytes: int = DEFAULT_BUDGET_BYTES,
    ) -> LocalService:
        """The scheduler over a dialog config, with more adapters (NAME -> PEFT folder or .qsec) checked now;
        `packed_weights`: a folder where its packed weights are kept, shared by the processes that serve it."""
        dialog = read_dialog_config(config)
        decoder: BatchDecoder | ExternalBatch
        if dialog.kv_cache != "quiver":  # a decoder exported elsewhere: its rows stepped one by one
            decoder = ExternalBatch(dialog, max_batch, packed_weights)
        else:
            decoder = BatchDecoder(dialog, max_batch, max_loras, packed_weights)
        try:
            for name, path in adapters.items():
                decoder.add_adapter(name, Path(path))
            decoder.warm_adapters()  # the first request on an adapter waits for no read of its sections
        except QuiverError:
            decoder.close()
            raise
        return cls(decoder, max_queue, prefill_window, prefix_cache_bytes)

    def __init__(
        self,
        decoder: BatchDecoder | ExternalBatch,
        max_queue: int = 64,
        prefill_window: int | None = None,
        prefix_cache_bytes: int = DEFAULT_BUDGET_BYTES,
    ) -> None:
        self.decoder = decoder
        self.scheduler = Scheduler(
            decoder, max_queue, prefill_window=prefill_window, prefix_cache_bytes=prefix_cache_bytes
        )
        self.tokenizer = decoder.tokenizer
        self.context_size = decoder.config.context_size
        self.vocabulary = decoder.config.n_vocab

    def adapter_names(self) -> list[str]:
        return self.decoder.adapters.names

    def submit(self, generation: Generation, sink: Callable[[Event], object]) -> Job:
        return self.scheduler.submit(generation, sink)

    def cancel(self, job: Job) -> None:
        self.scheduler.cancel(job)

    @property
    def waiting(self) -> int:
        return self.scheduler.waiting

    @property
    def batch_size(self) -> int:
        return self.scheduler.batch_size

    def add_adapter(self, name: str, path: str) -> None:
        self.decoder.add_adapter(name, Path(path))
        self.forget_prefixes(name)

    def remove_adapter(self, name: str) -> None:
        self.decoder.remove_adapter(name)
        self.forget_prefixes(name)

    def forget_prefixes(self, adapter: str) -> None:
        """Prompts computed under an adapter of that name: its weights changed, their rows no longer hold."""
        if self.scheduler.prefixes is not None:
            self.scheduler.prefixes.forget(adapter)

    def watch(self, metrics: Metrics) -> None:
        def filled(seconds: float) -> None:
            metrics.adapter_loads.inc()
            metrics.adapter_fill.observe(seconds)

        self.decoder.on_fill = filled
        self.scheduler.on_step = lambda rows: metrics.decode_steps.labels(str(rows)).inc()
        prefixes = self.scheduler.prefixes
        if prefixes is not None:
            metrics.watch_prefixes(lambda: prefixes.hits, lambda: prefixes.reused_tokens, lambda: prefixes.nbytes)

    def close(self) -> None:
        """Stops the scheduler (requests not finished end cancelled) and unmaps the context."""
        self.scheduler.close()
        self.decoder.close()
