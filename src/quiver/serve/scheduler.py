"""The scheduler behind `quiver serve`: continuous batching of requests on mixed adapters.

One worker thread drives a `BatchDecoder`. Requests wait in a bounded queue and join the running batch
at step boundaries: a request takes a KV row and its adapter's slot (filled from the adapter's sections,
or its PEFT folder, if no slot holds it), and its prompt is prefilled a window at a time. Each decode
step runs every sequence in the batch, each on its own adapter and strengths, in one run of the
batched graph. A sequence that ends (or whose client went away) leaves at the next step boundary and
gives its row and slot back. Events go to a sink the caller gives (the HTTP layer's event loop), so a
slow client never holds the worker.

Prefill against decode: a request never stalls a stream that began before it arrived by more than one
prefill window (a decode step follows each window). Requests that arrive together, while no stream
decodes yet, are prefilled back to back before their first decode step, as vLLM's scheduler gives
prefills priority: each gets its first token as early as the machine allows, and a stream of that
wave waits for the wave's prompts once, between its first and second token.
"""

from __future__ import annotations

import collections
import concurrent.futures
import math
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import numpy as np

from quiver.errors import QuiverError
from quiver.serve.grammar import Constraint, Grammars
from quiver.serve.prefix_cache import DEFAULT_BUDGET_BYTES, PrefixCache, prefix_key
from quiver.t2t.batch import BatchDecoder
from quiver.t2t.continuation import Continuation, ending_tokens
from quiver.t2t.external_batch import ExternalBatch
from quiver.t2t.sampling import Sampler, Sampling, log_probabilities

FinishReason = Literal["stop", "length", "cancelled"]
_FINISH: dict[str, FinishReason] = {
    "eos": "stop",
    "stop-sequence": "stop",
    "max-new-tokens": "length",
    "context-full": "length",
    "aborted": "cancelled",
}


class SchedulerFaultError(QuiverError):
    """The model's step gave this request something no token can be chosen from (logits not finite): the
    server's fault, not the request's; the other requests in the batch go on (HTTP 500)."""


class QueueFullError(QuiverError):
    """The scheduler has as many requests waiting as it may hold: try again later (HTTP 429)."""


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
    top_k: int = 0  # 0: every token
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # end the reply as eos tokens do
    ignore_eos: bool = False  # the model's eos tokens do not end the reply
    logprobs: int | None = None  # each token's log-probability and this many most likely tokens' (None: none)
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (its first has none), fed one by one
    grammar: str | None = None  # llguidance's grammar the reply must match (`serve.grammar`), checked already


class TokenLogprob(NamedTuple):
    """A generated token's log-probability (the log-softmax of the model's logits before any sampling
    control, as vLLM's default), and the most likely tokens' at that position, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Token:
    text: str
    at: float  # time.perf_counter() when it was decided
    logprobs: tuple[TokenLogprob, ...] = ()  # the tokens' decided since the last event, where asked
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # on a sequence's first event: the prompt's, where asked


@dataclass(frozen=True)
class Done:
    prompt_tokens: int
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    logprobs: tuple[TokenLogprob, ...] | None = None  # the reply's tokens', where asked (an ending one's too)
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # the prompt's tokens' but its first, where asked


@dataclass(frozen=True)
class Failed:
    error: QuiverError


Event = Token | Done | Failed


@dataclass
class Job:
    """A request in the scheduler: cancelled when its client is gone (before it runs, or at its next step)."""

    generation: Generation
    sink: Callable[[Event], object]
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass
class _Sequence:
    """A request in the batch: its row, its adapter slot, its prompt as fed so far, its reply."""

    job: Job
    row: int
    slot: int
    reply: Continuation
    cached: int = 0  # tokens in its cache row
    began: float = math.inf  # when its prompt was all in (its stream began)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # where asked: each reply token's, an ending one's too
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # where asked: each prompt token's but the first
    sent: int = 0  # of `logprobs`, those its Token events carried
    prompt_sent: bool = False  # its prompt's log-probabilities went with a Token event (an echo that streams)
    constraint: Constraint | None = None  # its grammar's matcher, where it has one


class Scheduler:
    """Runs generations in one batch of at most `decoder.max_batch` sequences, `max_queue` waiting."""

    def __init__(
        self,
        decoder: BatchDecoder | ExternalBatch,
        max_queue: int = 64,
        on_step: Callable[[int], object] | None = None,
        prefill_window: int | None = None,
        prefix_cache_bytes: int = DEFAULT_BUDGET_BYTES,
    ) -> None:
        self.decoder = decoder
        self._window = prefill_window or decoder.config.prefill_window
        # recent prompts' cache rows, where the decoder's rows can be copied (Quiver's own batched graph)
        reusable = isinstance(decoder, BatchDecoder) and prefix_cache_bytes > 0
        self.prefixes: PrefixCache | None = None
        if reusable:  # a held row the budget pushes out goes back from the scheduler's thread (see PrefixCache)
            self.prefixes = PrefixCache(prefix_cache_bytes, give_back=lambda row: decoder.free([row]))
        self._queue: queue.Queue[Job | None] = queue.Queue(max_queue)
        self._rows: list[_Sequence] = []  # decoding: row i is self._rows[i]
        self._prefilling: _Sequence | None = None  # in the row after them
        self._unstored: _Sequence | None = None  # prefilled, its prompt's rows kept once its first token is out
        self._grammar_cache: Grammars | None = None  # llguidance's view of the tokenizer, at the first grammar
        self._mask_worker: concurrent.futures.ThreadPoolExecutor | None = None  # at the first constrained step
        # taken from the queue, waiting for an adapter slot to come free, oldest first; requests behind them
        # that need no new slot (the base model, an adapter a slot holds) go ahead
        self._held: collections.deque[Job] = collections.deque()
        self._closing = False
        self._decided: list[tuple[Callable[[Event], object], Event]] = []  # this step's events, sent after it
        self.on_step = on_step  # told the rows of every decode step
        self._thread = threading.Thread(target=self._work, name="quiver-serve-scheduler", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self._queue.qsize() + len(self._held)

    @property
    def batch_size(self) -> int:
        """Sequences in the batch: decoding, and the one being prefilled."""
        return len(self._batch())

    def submit(self, generation: Generation, sink: Callable[[Event], object]) -> Job:
        """Queues a generation; its events go to `sink` (from the scheduler's thread). Raises `QueueFullError`."""
        job = Job(generation, sink)
        try:
            if self.waiting >= self._queue.maxsize:  # queued and held for a slot, together
                raise queue.Full
            self._queue.put_nowait(job)
        except queue.Full:
            if not self._drop_cancelled():  # places held by clients that hung up are given back first
                raise QueueFullError(f"{self._queue.maxsize} requests are waiting already; try again shortly") from None
            return self.submit(generation, sink)
        return job

    def _drop_cancelled(self) -> bool:
        """Takes the waiting requests whose clients went away out of the queue (they end cancelled); whether
        any was."""
        with self._queue.mutex:
            waiting = self._queue.queue
            dropped = [j for j in waiting if j is not None and j.cancelled.is_set()]
            if dropped:
                kept = [j for j in waiting if j is None or not j.cancelled.is_set()]
                waiting.clear()
                waiting.extend(kept)
                self._queue.not_full.notify(len(dropped))
        for job in dropped:
            job.sink(_unrun(job))
        return bool(dropped)

    def cancel(self, job: Job) -> None:
        """The client is gone: a waiting job is skipped, a running one leaves the batch at the next step."""
        job.cancelled.set()

    def close(self) -> None:
        """Stops the worker at the next step boundary; every request not finished ends cancelled."""
        self._closing = True
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancelled.set()
                job.sink(_unrun(job))
        try:
            self._queue.put_nowait(None)  # wakes a worker waiting for work
        except queue.Full:
            pass
        self._thread.join(30)
        if self._mask_worker is not None:
            self._mask_worker.shutdown(wait=False)

    # --- the worker -------------------------------------------------------------------------------------
    def _work(self) -> None:
        while not self._closing:
            try:
                self._admit()
                if self._prefilling is not None:
                    self._prefill()
                    if self._prefill_first():
                        continue
                if self._rows:
                    self._decode()
            except Exception as exc:  # noqa: BLE001  the worker never dies: the batch fails, typed, and it goes on
                failure = exc if isinstance(exc, QuiverError) else QuiverError(f"generation failed: {exc!r}")
                batch, self._rows, self._prefilling = self._batch(), [], None
                self.decoder.free([s.row for s in batch])
                for sequence in batch:  # every row is free again: nothing to move
                    self.decoder.release_slot(sequence.slot)
                    self._send(sequence.job, Failed(failure))
            finally:
                self._flush()
                self._store_prefix()
        for sequence in self._batch():
            self._leave(sequence, self._done(sequence, "cancelled"))
        self._flush()
        for job in self._held:
            job.sink(_unrun(job))

    def _batch(self) -> list[_Sequence]:
        return [*self._rows, *([self._prefilling] if self._prefilling is not None else [])]

    def _admit(self) -> None:
        """Takes the next request into the batch when a row is free and no prompt is being prefilled
        (waits for one when nothing runs): the oldest held for a slot that can have one now, else the
        queue's next; one that must wait for a slot is held, and those behind it go ahead."""
        while self._prefilling is None and len(self._rows) < self.decoder.max_batch and not self._closing:
            if self._admit_held():
                continue
            if len(self._held) >= self._queue.maxsize:  # held ones count as waiting: the queue's bound holds
                return
            try:
                job = self._queue.get(block=not self._rows and not self._held)
            except queue.Empty:
                return
            if job is None:
                return
            if not self._start(job):
                self._held.append(job)

    def _admit_held(self) -> bool:
        """Starts the oldest held request that can have a slot now (those whose clients went away end);
        whether one started."""
        for job in list(self._held):
            if job.cancelled.is_set():
                self._held.remove(job)
                job.sink(_unrun(job))
            elif self._start(job):
                self._held.remove(job)
                return True
        return False

    def _start(self, job: Job) -> bool:
        """Begins prefilling `job` on a slot of its adapter; False when it must wait for a slot (a job whose
        client went away, or that asks for what cannot be, ends here, and counts as started)."""
        if job.cancelled.is_set():
            job.sink(_unrun(job))
            return True
        request = job.generation
        try:
            slot = self.decoder.acquire_slot(request.adapter, request.strengths)
        except QuiverError as exc:
            job.sink(Failed(exc))
            return True
        if slot is None:  # every slot holds an adapter in use: wait for a sequence to end
            return False
        constraint = None
        if request.grammar is not None:
            try:
                constraint = self._grammars().constraint(request.grammar)
            except QuiverError as exc:
                self.decoder.release_slot(slot)
                job.sink(Failed(exc))
                return True
        sequence = _Sequence(job, len(self._rows), slot, self._reply(request), constraint=constraint)
        if self.prefixes is not None:
            hit = None
            if request.prompt_logprobs is None:  # an echo scores every prompt token
                hit = self.prefixes.lookup(prefix_key(request.adapter, request.strengths), request.prompt_ids,
                                           sequence.row)  # fmt: skip
            self.prefixes.release(sequence.row)  # the row is this sequence's now
            if hit is not None:
                assert isinstance(self.decoder, BatchDecoder)
                if hit.source != sequence.row:  # a copy, or another row held as it was: copied in
                    self.decoder.copy_in(sequence.row, hit.source, hit.length)
                sequence.cached = hit.length
        self._prefilling = sequence
        return True

    def _grammars(self) -> Grammars:
        if self._grammar_cache is None:
            config = self.decoder.config
            self._grammar_cache = Grammars(self.decoder.tokenizer, config.eos_tokens, config.n_vocab)
        return self._grammar_cache

    def _reply(self, request: Generation) -> Continuation:
        sampled = request.temperature > 0
        sampling = Sampling(
            greedy=not sampled,
            temperature=request.temperature if sampled else 1.0,
            top_k=request.top_k,
            top_p=request.top_p if sampled else 1.0,
            seed=request.seed,
            min_p=request.min_p,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=request.repetition_penalty,
            logit_bias=request.logit_bias,
        )
        config = self.decoder.config
        return Continuation(
            self.decoder.tokenizer,
            Sampler(sampling),
            ending_tokens(config.eos_tokens, request.stop_token_ids, request.ignore_eos),
            request.prompt_ids,
            len(request.prompt_ids),
            config.context_size,
            request.max_tokens,
            request.min_tokens,
            request.stop,
        )

    def _prefill_first(self) -> bool:
        """Whether the next prompt window may run before a decode step: while no sequence decodes yet and
        the prompt arrived before every running stream began (requests that arrive together are prefilled
        back to back, their first tokens as early as they can be). Otherwise a decode step comes after
        each window: a request stalls streams that began before it by one window at most."""
        if any(len(s.reply.new_ids) > 1 for s in self._rows):
            return False
        began = min((s.began for s in self._rows), default=math.inf)
        if self._prefilling is not None:
            return self._prefilling.job.submitted < began
        with self._queue.mutex:  # the next request to join: held for a slot, else the queue's first
            waiting = self._held[0] if self._held else next((j for j in self._queue.queue if j is not None), None)
        return waiting is not None and waiting.submitted < began

    def _prefill(self) -> None:
        """One window of the prompt being prefilled; its first token when the prompt is all in."""
        sequence = self._prefilling
        assert sequence is not None
        if sequence.job.cancelled.is_set():
            self._leave(sequence, self._done(sequence, "cancelled"))
            return
        request = sequence.job.generation
        prompt, scored = request.prompt_ids, request.prompt_logprobs
        # a prompt whose tokens' log-probabilities are asked goes in a token at a time: each run's logits are
        # those of one position (the graphs give the last position's alone)
        window = prompt[sequence.cached : sequence.cached + (1 if scored is not None else self._window)]
        logits = self.decoder.prefill(sequence.row, window, sequence.cached, sequence.slot)
        sequence.cached += len(window)
        if scored is not None and sequence.cached < len(prompt):
            sequence.prompt_logprobs.append(_entry(log_probabilities(logits), prompt[sequence.cached], scored))
        if sequence.cached < len(prompt):
            return
        self._unstored = sequence  # its rows kept for the next prompt that begins as it does (`_store_prefix`)
        if request.max_tokens == 0:  # the prompt's log-probabilities alone (an echo with nothing more)
            self._leave(sequence, self._done(sequence, "length"))
            return
        self._prefilling = None
        row = len(self._rows)  # rows may have left while it was prefilled: it joins right after the others
        if sequence.row != row:
            if self.prefixes is not None:
                self.prefixes.release(row)
            self.decoder.move(sequence.row, row, sequence.cached)
            sequence.row = row
        self._rows.append(sequence)
        sequence.began = time.perf_counter()
        self._advance(sequence, logits)

    def _decode(self) -> None:
        """One step of every decoding sequence, each on its own adapter slot."""
        for sequence in [s for s in self._rows if s.job.cancelled.is_set()]:
            self._leave(sequence, self._done(sequence, "cancelled"))
        if not self._rows:
            return
        rows = list(self._rows)
        # the constrained rows' next masks, computed while ORT runs the step (both let the GIL go)
        constraints = [s.constraint for s in rows if s.constraint is not None]
        masks = self._masks().submit(_compute_masks, constraints) if constraints else None
        try:
            logits = self.decoder.decode(
                [s.reply.new_ids[-1] for s in rows], [s.cached for s in rows], [s.slot for s in rows]
            )
        finally:
            if masks is not None:
                masks.result()
        if self.on_step is not None:
            self.on_step(len(rows))
        for sequence in rows:  # all first: a sequence that ends moves the last one, whole, into its row
            sequence.cached += 1
        for index, sequence in enumerate(rows):
            self._advance(sequence, logits[index])

    def _masks(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._mask_worker is None:
            self._mask_worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="quiver-serve-masks")
        return self._mask_worker

    def _advance(self, sequence: _Sequence, logits: np.ndarray) -> None:
        """The sequence's next token from its logits: streamed, and the end of its reply when it ends. A row
        whose logits hold NaN or +inf (an adapter or strength that overflowed it) ends alone."""
        if not math.isfinite(float(logits.max())):  # NaN propagates into the max, and so does +inf
            self._leave(sequence, Failed(SchedulerFaultError(
                "the model's output for this request was not finite (an adapter's weights or strengths overflow "
                "it); the request ended, the others go on")))  # fmt: skip
            return
        asked = sequence.job.generation.logprobs
        scores = log_probabilities(logits) if asked is not None else None  # before step masks or biases them
        constraint = sequence.constraint
        try:
            if constraint is not None:
                constraint.mask(logits)
            piece = sequence.reply.step(logits)
            reason = sequence.reply.reason
            if constraint is not None and reason != "eos":
                constraint.advance(sequence.reply.new_ids[-1])
        except QuiverError as exc:  # the grammar failed (its limits): this request ends, the others go on
            self._leave(sequence, Failed(exc))
            return
        if scores is not None:  # an ending token's too (no text, but a token: vLLM's, and lm-eval counts on it)
            sequence.logprobs.append(_entry(scores, sequence.reply.new_ids[-1], asked or 0))
        if piece:
            entries, sequence.sent = tuple(sequence.logprobs[sequence.sent :]), len(sequence.logprobs)
            prompt = None
            if sequence.job.generation.prompt_logprobs is not None and not sequence.prompt_sent:
                prompt, sequence.prompt_sent = tuple(sequence.prompt_logprobs), True
            self._send(sequence.job, Token(piece, time.perf_counter(), entries, prompt))
        if reason is not None:
            self._leave(sequence, self._done(sequence, _FINISH.get(reason, "stop")))

    @staticmethod
    def _done(sequence: _Sequence, reason: FinishReason) -> Done:
        reply, request = sequence.reply, sequence.job.generation
        logprobs = tuple(sequence.logprobs) if request.logprobs is not None else None
        scored = tuple(sequence.prompt_logprobs) if request.prompt_logprobs is not None else None
        return Done(len(request.prompt_ids), list(reply.new_ids), reply.text, reason, logprobs, scored)

    def _store_prefix(self) -> None:
        """Keeps the rows of the prompt prefilled last (a copy: milliseconds at a long prompt) for prompts that
        begin as it does, once its first token has gone to its client, or before its row is given back."""
        sequence, self._unstored = self._unstored, None
        if sequence is None or self.prefixes is None or sequence not in self._batch():
            return
        decoder, row, request = self.decoder, sequence.row, sequence.job.generation
        assert isinstance(decoder, BatchDecoder)
        key = prefix_key(request.adapter, request.strengths)
        self.prefixes.store(key, request.prompt_ids, lambda length: decoder.copy_out(row, length), decoder.token_bytes)

    def _give_back(self, sequence: _Sequence, row: int, kept: bool) -> None:
        """The row `sequence` leaves: where it still holds its rows as it left them (and `kept`), held for a
        prompt that begins as it did (its reply too: a chat's next turn); else its memory goes back."""
        if kept and self.prefixes is not None and sequence.row == row:
            assert isinstance(self.decoder, BatchDecoder)
            request = sequence.job.generation
            fed = [*request.prompt_ids, *sequence.reply.new_ids][: sequence.cached]
            key = prefix_key(request.adapter, request.strengths)
            if self.prefixes.hold(row, key, fed, self.decoder.token_bytes):
                return
        self.decoder.free([row])

    def _leave(self, sequence: _Sequence, event: Event) -> None:
        """The sequence gives its row (to the last one, moved into it) and its slot back; its client gets
        `event`."""
        # a sequence that ends well in the row it leaves keeps it as it is (a failed one's rows may not be finite)
        kept = isinstance(event, Done) and self.prefixes is not None
        keeps_row = kept and (sequence is self._prefilling or (sequence in self._rows and self._rows[-1] is sequence))
        if sequence is self._unstored:  # a row kept as it is needs no copy of its prompt; one another moves into does
            if keeps_row:
                self._unstored = None
            else:
                self._store_prefix()
        if sequence is self._prefilling:
            self._prefilling = None
            self._give_back(sequence, sequence.row, kept)
        elif sequence in self._rows:
            index = self._rows.index(sequence)
            last = self._rows.pop()
            if last is not sequence:
                self.decoder.move(last.row, index, last.cached)
                last.row = index
                self._rows[index] = last
            self._give_back(sequence, len(self._rows), kept)  # the row the last one left (or the sequence's own)
        self.decoder.release_slot(sequence.slot)
        self._send(sequence.job, event)

    def _send(self, job: Job, event: Event) -> None:
        """Keeps an event of this step for `_flush`."""
        self._decided.append((job.sink, event))

    def _flush(self) -> None:
        """Hands the step's events to their sinks, once its tokens are all decided: a sink may wake another
        thread (the HTTP layer's event loop), which then takes the GIL while the next step runs in ORT, not
        while this one's Python (whose numpy calls let it go) chooses the other streams' tokens."""
        decided, self._decided = self._decided, []
        for sink, event in decided:
            try:
                sink(event)
            except Exception:  # noqa: BLE001  a sink that fails loses its own event; the worker goes on
                pass


def _entry(scores: np.ndarray, token: int, top: int) -> TokenLogprob:
    """`token`'s log-probability among `scores` and the `top` most likely tokens'."""
    best: tuple[tuple[int, float], ...] = ()
    if top:
        ids = np.argpartition(scores, -top)[-top:]
        ids = ids[np.argsort(-scores[ids], kind="stable")]
        best = tuple((int(i), float(scores[i])) for i in ids)
    return TokenLogprob(token, float(scores[token]), best)


def _compute_masks(constraints: list[Constraint]) -> None:
    """Each constraint's next mask; one that fails is left to fail again where its row is masked (its
    request ends there, the others go on)."""
    for constraint in constraints:
        try:
            constraint.compute()
        except Exception:  # noqa: BLE001, S112
            continue


def _unrun(job: Job) -> Done:
    """The end of a request that never ran (its client went away, or the server is stopping)."""
    return Done(len(job.generation.prompt_ids), [], "", "cancelled")
