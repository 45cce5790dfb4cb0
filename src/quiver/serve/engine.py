"""The generation engine behind `quiver serve`: a bounded queue of requests and one worker that runs them.

The worker owns the dialog (its KV cache, its applied adapter): each request gets the adapter and
strengths it names (a section applied in well under a millisecond), a fresh conversation, and its
tokens as they are decided. Events go to a sink the caller gives (the HTTP layer's event loop), so a
slow client never holds the worker. One request runs at a time for now; batching many sequences in one
decode step is the next step of this engine (see the issue "Serving").
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from quiver.errors import QuiverError
from quiver.t2t.dialog import Dialog, QueryResult

FinishReason = Literal["stop", "length", "cancelled"]
_FINISH: dict[str, FinishReason] = {
    "eos": "stop",
    "stop-sequence": "stop",
    "max-new-tokens": "length",
    "context-full": "length",
    "aborted": "cancelled",
}


class _Cancelled(Exception):
    """Raised from the token callback when the client is gone: the query ends at once."""


class QueueFullError(QuiverError):
    """The engine has as many requests waiting as it may hold: try again later (HTTP 429)."""


@dataclass(frozen=True)
class Generation:
    """One request, checked: token ids in, sampling settings, the adapter (None: the base model)."""

    prompt_ids: list[int]
    adapter: str | None
    strengths: Mapping[str, float]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    min_tokens: int = 0  # end-of-sequence tokens are kept out until this many were generated (vLLM's)


@dataclass(frozen=True)
class Token:
    text: str
    at: float  # time.perf_counter() when it was decided


@dataclass(frozen=True)
class Done:
    prompt_tokens: int
    token_ids: list[int]
    text: str
    finish_reason: FinishReason


@dataclass(frozen=True)
class Failed:
    error: QuiverError


Event = Token | Done | Failed


@dataclass
class Job:
    """A request in the engine: cancelled when its client is gone (before it runs, or at its next step)."""

    generation: Generation
    sink: Callable[[Event], object]
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)


class Engine:
    """Runs generations on one dialog, first come first served, at most `max_queue` waiting."""

    def __init__(self, dialog: Dialog, max_queue: int = 64, on_start: Callable[[Job], object] | None = None) -> None:
        self.dialog = dialog
        self._queue: queue.Queue[Job | None] = queue.Queue(max_queue)
        self._running: Job | None = None
        self._lock = threading.Lock()
        self._on_start = on_start
        self._thread = threading.Thread(target=self._work, name="quiver-serve-engine", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    @property
    def busy(self) -> bool:
        return self._running is not None

    def submit(self, generation: Generation, sink: Callable[[Event], object]) -> Job:
        """Queues a generation; its events go to `sink` (from the engine's thread). Raises `QueueFullError`."""
        job = Job(generation, sink)
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFullError(f"{self._queue.maxsize} requests are waiting already; try again shortly") from None
        return job

    def cancel(self, job: Job) -> None:
        """The client is gone: a waiting job is skipped, a running one stops after its current step."""
        job.cancelled.set()
        with self._lock:
            if self._running is job:
                self.dialog.abort()

    def close(self) -> None:
        """Stops the worker after the job it runs (waiting ones are cancelled)."""
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancelled.set()
        self._queue.put(None)
        self._thread.join(30)

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if job.cancelled.is_set():
                continue
            with self._lock:
                self._running = job
            try:
                if self._on_start is not None:
                    self._on_start(job)
                job.sink(self._run(job))
            except QuiverError as exc:
                job.sink(Failed(exc))
            except Exception as exc:  # noqa: BLE001  the worker never dies: the request fails, typed
                job.sink(Failed(QuiverError(f"generation failed: {type(exc).__name__}: {exc}")))
            finally:
                with self._lock:
                    self._running = None

    def _run(self, job: Job) -> Done:
        request = job.generation
        self.dialog.use(request.adapter, request.strengths)

        def on_token(piece: str) -> None:
            if job.cancelled.is_set():
                raise _Cancelled
            job.sink(Token(piece, time.perf_counter()))

        try:
            result: QueryResult = self.dialog.query(
                request.prompt_ids,
                max_new_tokens=request.max_tokens,
                min_new_tokens=request.min_tokens,
                greedy=request.temperature == 0,
                temperature=request.temperature if request.temperature > 0 else None,
                top_p=request.top_p if request.temperature > 0 else None,
                top_k=0 if request.temperature > 0 else None,  # OpenAI's API has no top-k: all tokens
                seed=request.seed,
                on_token=on_token,
                stop=request.stop,
            )
        except _Cancelled:
            return Done(len(request.prompt_ids), [], "", "cancelled")
        reason = "cancelled" if job.cancelled.is_set() else _FINISH.get(result.stop_reason, "stop")
        return Done(len(request.prompt_ids), list(result.new_ids), result.text, reason)
