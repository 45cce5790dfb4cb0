"""Genie's dialog: generates text from a prefill + decode context, switching LoRA adapters between queries.

The KV cache is one pair of [1, kv_heads, context, head_dim] buffers per layer, allocated once. Each
step feeds them as the graph's past and binds them as its present outputs (`Graph.execute(out=...)`),
so ORT's GroupQueryAttention appends the step's keys and values in place: no per-token copy or
allocation. A prompt longer than the prefill window is fed in chunks. The last generated token is fed
at the start of the next query, so a dialog continues where it stopped (Genie's multi-turn dialog).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from quiver import fork
from quiver.errors import GenerationError, QuiverError
from quiver.runtime.context import Context
from quiver.t2t.adapters import AdapterSet
from quiver.t2t.config import DialogConfig, cpu_backend_for, read_dialog_config
from quiver.t2t.continuation import Continuation, ending_tokens
from quiver.t2t.io_names import INPUT_IDS, LOGITS, PAST, PRESENT, SEQLENS_K, TOTAL_LENGTH
from quiver.t2t.kv_memory import CacheMemory
from quiver.t2t.sampling import Sampler, Sampling
from quiver.t2t.tokenizer import TextTokenizer, is_utf8

if TYPE_CHECKING:  # an imported decoder's cache loads its module (and ONNX's) when one is opened
    from quiver.t2t.external_cache import ExternalCache


def _fixed(shape: tuple[int | str | None, ...] | None) -> tuple[int, ...]:
    """A tensor's shape when every dimension is a number, else ()."""
    if shape is None or not all(isinstance(d, int) for d in shape):
        return ()
    return tuple(int(d) for d in shape if isinstance(d, int))


@dataclass(frozen=True)
class QueryResult:
    prompt_ids: list[int]
    new_ids: list[int]
    text: str
    stop_reason: str  # "eos", "stop-sequence", "max-new-tokens", "context-full" or "aborted"
    prefill_tok_s: float
    decode_tok_s: float


@dataclass(frozen=True)
class DialogState:
    """What `save()` keeps: the tokens so far, their cache entries, and the adapter in use."""

    history: tuple[int, ...]
    pending: tuple[int, ...]
    cache: dict[str, np.ndarray]
    adapter: str | None
    strengths: dict[str, float] = field(default_factory=dict)


class Dialog:
    """A text-generation dialog over one context (Genie's GenieDialog)."""

    def __init__(self, config: DialogConfig) -> None:
        self.config = config
        self.tokenizer = TextTokenizer(config.tokenizer)
        backend = cpu_backend_for(config) if config.backend == "cpu" else "reference"
        self._context = Context.from_binary(config.ctx_bins[0], backend=backend)
        self._adapters = AdapterSet(self._context, config.adapters, config.path)  # and those added since
        try:
            self._prefill = self._context.graph(config.prefill_graph)
            self._decode = self._context.graph(config.decode_graph)
        except Exception:
            self._context.close()
            raise
        self._history: list[int] = []  # tokens whose keys and values are in the cache
        self._pending: list[int] = []  # generated, not yet fed (the next query starts with them)
        self._adapter: str | None = None
        self._lock = threading.Lock()  # one query at a time
        self._abort = threading.Event()
        fork.reset_after_fork(self)
        self._external: ExternalCache | None = None
        if config.kv_cache != "quiver":  # a decoder exported elsewhere: its cache through an attention mask
            from quiver.t2t.external_cache import ExternalCache

            try:
                self._external = ExternalCache(self._decode, config.kv_cache, config.context_size)
            except Exception:
                self._context.close()
                raise
            self.capacity = self._external.capacity
            self._cache = self._external.cache
            self._logits = np.zeros((1, 1, config.n_vocab), np.float32)
        else:
            self._bind_quiver_graphs(config)
        # Prepare (and pack) both graphs now, as Genie does when a dialog is created: a query then
        # measures generation, not session creation. One step runs, on the prefill graph (the first run
        # of a session allocates what its runs use); the decode graph is prepared without a run, usually
        # on the prefill graph's executable (the same body), where a step would only read every weight again.
        self._step(self._prefill, [0])
        self._history = []
        self._context.prepare_graph(config.decode_graph)

    def _bind_quiver_graphs(self, config: DialogConfig) -> None:
        """`quiver t2t export`'s graphs: one fixed cache buffer per layer, a decode step bound once."""
        shapes = {i.name: _fixed(i.shape) for i in self._decode.inputs if i.name.startswith(PAST)}
        logits_shape = next((_fixed(o.shape) for o in self._decode.outputs if o.name == LOGITS), ())
        if not shapes or not logits_shape or not all(len(s) == 4 for s in shapes.values()):
            self._context.close()
            raise GenerationError(
                f"{config.ctx_bins[0]} is not a text-generation context (no KV cache inputs or logits in graph "
                f"{config.decode_graph!r}); make it with `quiver t2t export`"
            )
        self.capacity = next(iter(shapes.values()))[2]
        if config.context_size > self.capacity:
            self._context.close()
            raise GenerationError(
                f"{config.path}: context.size {config.context_size} exceeds the {self.capacity} positions of the "
                "context binary's KV cache; lower it or export with a larger --context-size"
            )
        self._cache = CacheMemory(shapes).arrays  # its memory grows with the tokens cached
        self._logits = np.zeros(logits_shape, np.float32)
        self._out = {LOGITS: self._logits} | {PRESENT + n[len(PAST) :]: a for n, a in self._cache.items()}
        self._token_feeds = token, seqlens, length = (
            np.zeros((1, 1), np.int64),
            np.zeros(1, np.int32),
            np.zeros((), np.int32),
        )
        # a decode step runs on arrays bound once: the token arrays are rewritten in place each step, through
        # flat views of their memory (a plain buffer write costs less than numpy's indexing, between steps)
        self._token_views = tuple(_flat_view(a) for a in self._token_feeds)
        try:
            self._decode_run = self._decode.bind(
                {INPUT_IDS: token, SEQLENS_K: seqlens, TOTAL_LENGTH: length, **self._cache}, self._out
            )
        except QuiverError as exc:
            self._context.close()
            raise GenerationError(
                f"{config.ctx_bins[0]}: graph {config.decode_graph!r} does not take a decode step's inputs ({exc}); "
                "make the context with `quiver t2t export`"
            ) from None

    @classmethod
    def from_config(cls, path: str | Path) -> Dialog:
        return cls(read_dialog_config(path))

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        self._abort = threading.Event()

    # --- generation -------------------------------------------------------------------------------
    def query(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int | None = None,
        min_new_tokens: int = 0,
        greedy: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        repetition_penalty: float = 1.0,
        seed: int | None = None,
        on_token: Callable[[str], object] | None = None,
        stop: Sequence[str] = (),
        min_p: float = 0.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logit_bias: Mapping[int, float] | None = None,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
    ) -> QueryResult:
        """Generates a reply to `prompt`: raw text (apply the model's chat template first if it has one)
        or token ids.

        Sampling options left as None take the config's `sampler` values; giving a temperature, top-k
        or top-p without `greedy` samples. `min_new_tokens` keeps eos tokens out until that many were
        generated; `on_token` receives the text as it is decided. `min_p`, `presence_penalty` and
        `frequency_penalty` as OpenAI's and vLLM's servers apply them (`quiver.t2t.sampling`), and
        `logit_bias` ({token id: -100 to 100}); `stop_token_ids` end the reply as an eos token does, and
        `ignore_eos` lets the model's eos tokens through (vLLM's).
        """
        if isinstance(prompt, str) and not is_utf8(prompt):
            raise GenerationError("the prompt is not UTF-8 text (it holds undecodable bytes); give it as UTF-8")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        defaults = self.config.sampler
        if greedy is None:
            greedy = defaults.greedy and temperature is None and top_k is None and top_p is None
        sampling = Sampling(
            greedy=greedy,
            temperature=defaults.temperature if temperature is None else temperature,
            top_k=defaults.top_k if top_k is None else top_k,
            top_p=defaults.top_p if top_p is None else top_p,
            repetition_penalty=repetition_penalty,
            seed=defaults.seed if seed is None else seed,
            min_p=min_p,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            logit_bias=tuple(sorted((int(k), float(v)) for k, v in (logit_bias or {}).items())),
        )
        prompt_ids = [int(i) for i in ids]
        vocab = int(self._logits.shape[-1])
        if not all(0 <= i < vocab for i, _ in sampling.logit_bias) or not all(0 <= i < vocab for i in stop_token_ids):
            raise GenerationError(f"logit_bias and stop_token_ids name token ids in [0, {vocab})")
        eos = ending_tokens(self.config.eos_tokens, stop_token_ids, ignore_eos)
        if not prompt_ids or not all(0 <= i < vocab for i in prompt_ids):
            raise GenerationError(f"a query needs token ids in [0, {vocab}); got {len(prompt_ids)} ids")
        limit = self.config.context_size
        if max_new_tokens is None:
            max_new_tokens = limit
        if max_new_tokens < 1 or not 0 <= min_new_tokens <= max_new_tokens:
            raise GenerationError(
                f"max_new_tokens {max_new_tokens} must be >= 1 and >= min_new_tokens {min_new_tokens}"
            )
        with self._lock:
            self._abort.clear()
            fed = self._pending + prompt_ids
            if len(self._history) + len(fed) >= limit:
                raise GenerationError(
                    f"the prompt ({len(prompt_ids)} tokens) does not fit the context: {limit} positions, "
                    f"{len(self._history)} in use; shorten it, reset() the dialog or export a larger context"
                )
            return self._generate(
                prompt_ids, fed, Sampler(sampling), max_new_tokens, min_new_tokens, on_token, stop, eos
            )

    def _generate(
        self,
        prompt: list[int],
        fed: list[int],
        sampler: Sampler,
        max_new_tokens: int,
        min_new_tokens: int,
        on_token: Callable[[str], object] | None,
        stop: Sequence[str],
        eos: Sequence[int],
    ) -> QueryResult:
        start = time.perf_counter()
        window = self.config.prefill_window
        for begin in range(0, len(fed), window):
            # the prompt's last window gives back the memory the prompt's activations took (ORT's arena would
            # keep it all through the single tokens that follow: 30-40 MB for a 1B model's 512-token window),
            # even a last window of one token after a full one
            self._step(self._prefill, fed[begin : begin + window], release_scratch=begin + window >= len(fed))
        self._pending = []
        prefilled = time.perf_counter()
        reply = Continuation(
            self.tokenizer,
            sampler,
            eos,
            self._history,
            len(self._history),
            self.config.context_size,
            max_new_tokens,
            min_new_tokens,
            stop,
        )
        history, logits = self._history, self._logits
        with self._decode_loop() as decode:
            while True:
                piece = reply.step(logits)
                if piece and on_token is not None:
                    on_token(piece)
                if reply.reason is not None:
                    break
                if self._abort.is_set():
                    reply.reason, reply.pending = "aborted", reply.new_ids[-1:]
                    break
                token = reply.new_ids[-1]  # fed at the next position: its keys and values join the cache
                decode(token)
                history.append(token)
        self._pending = reply.pending
        new, text, reason = reply.new_ids, reply.text, reply.reason
        finished = time.perf_counter()
        decoded = max(len(new) - 1, 0)
        return QueryResult(
            prompt_ids=prompt,
            new_ids=new,
            text=text,
            stop_reason=reason,
            prefill_tok_s=len(fed) / max(prefilled - start, 1e-9),
            decode_tok_s=decoded / (finished - prefilled) if decoded else 0.0,
        )

    @contextmanager
    def _decode_loop(self) -> Iterator[Callable[[int], object]]:
        """A decode step as a call that feeds one token after the history (which the caller extends)."""
        if self._external is not None:
            yield lambda token: self._step(self._decode, [token], extend=False)
            return
        views, history = self._token_views, self._history
        with self._decode_run.repeating() as run:  # the decode graph held for the loop: a step is its run

            def decode(token: int) -> None:
                views[0][0], views[1][0], views[2][0] = token, len(history), len(history) + 1
                run()

            yield decode

    def _step(self, graph: object, ids: list[int], extend: bool = True, release_scratch: bool = False) -> None:
        """Feeds tokens: their keys and values land in the cache, the logits of the last in `_logits`."""
        if self._external is not None:
            self._external.step(graph, ids, len(self._history), self._logits)  # type: ignore[arg-type]
            self._cache = self._external.cache
            if extend:
                self._history.extend(ids)
            return
        total = len(self._history) + len(ids)
        if len(ids) == 1:  # the same small arrays each time (the backend keeps their wrappers)
            token, seqlens, length = self._token_feeds
            views = self._token_views
            views[0][0], views[1][0], views[2][0] = ids[0], total - 1, total
        else:
            token, seqlens, length = (
                np.array([ids], np.int64),
                np.array([total - 1], np.int32),
                np.array(total, np.int32),
            )
        if graph is self._decode and len(ids) == 1:
            self._decode_run.run()  # bound to the token arrays just written
        else:
            feeds = {INPUT_IDS: token, SEQLENS_K: seqlens, TOTAL_LENGTH: length, **self._cache}
            graph.execute(feeds, out=self._out, release_scratch=release_scratch)  # type: ignore[attr-defined]
        self._history.extend(ids)

    @property
    def context(self) -> Context:
        return self._context

    def sample_feeds(self, prompt_ids: Sequence[int]) -> dict[str, list[dict[str, np.ndarray]]]:
        """Inputs of real steps, for tuning: the prompt's first prefill window (on an empty cache) and the
        decode step that follows the whole prompt (its cache filled by it). Resets the conversation."""
        if self._external is not None:
            raise GenerationError("tuning measures `quiver t2t export`'s graphs; an imported decoder runs untuned")
        ids = [int(i) for i in prompt_ids]
        window = ids[: self.config.prefill_window]
        if len(ids) + 1 >= self.capacity or not ids:
            raise GenerationError(f"sample prompts have 1 to {self.capacity - 2} tokens; got {len(ids)}")
        empty = {name: np.zeros_like(array) for name, array in self._cache.items()}
        prefill: dict[str, np.ndarray] = {
            INPUT_IDS: np.array([window], np.int64),
            SEQLENS_K: np.array([len(window) - 1], np.int32),
            TOTAL_LENGTH: np.array(len(window), np.int32),
            **empty,
        }
        with self._lock:
            self._history, self._pending = [], []
            for begin in range(0, len(ids), self.config.prefill_window):
                self._step(self._prefill, ids[begin : begin + self.config.prefill_window])
            token = int(np.argmax(self._logits.reshape(-1)))
            decode: dict[str, np.ndarray] = {
                INPUT_IDS: np.array([[token]], np.int64),
                SEQLENS_K: np.array([len(ids)], np.int32),
                TOTAL_LENGTH: np.array(len(ids) + 1, np.int32),
                **{name: array.copy() for name, array in self._cache.items()},
            }
            self._history, self._pending = [], []
        return {self.config.prefill_graph: [prefill], self.config.decode_graph: [decode]}

    def log_likelihoods(self, ids: Sequence[int]) -> np.ndarray:
        """The natural log-probability of each token after the first, given those before it (one step per
        token, as teacher forcing; perplexity is exp of minus their mean). Resets the conversation."""
        tokens = [int(i) for i in ids]
        if not 2 <= len(tokens) < self.config.context_size:
            raise GenerationError(f"scoring takes 2 to {self.config.context_size - 1} tokens; got {len(tokens)}")
        if min(tokens) < 0 or max(tokens) >= self.config.n_vocab:
            raise GenerationError(f"token ids are 0 to {self.config.n_vocab - 1}")
        scores = np.empty(len(tokens) - 1, np.float64)
        with self._lock:
            self._history, self._pending = [], []
            self._step(self._prefill, tokens[:1])
            for position, token in enumerate(tokens[1:]):
                logits = self._logits.reshape(-1).astype(np.float64)
                top = logits.max()
                scores[position] = logits[token] - top - np.log(np.exp(logits - top).sum())
                if position + 2 < len(tokens):
                    self._step(self._decode, [token])
            self._history, self._pending = [], []
        return scores

    def token_query(self, ids: Sequence[int], **options: Any) -> QueryResult:
        """Generates from token ids (Genie's GenieDialog_tokenQuery); the options are `query`'s."""
        return self.query(list(ids), **options)

    # --- state --------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forgets the conversation. The cache keeps the memory its longest conversation so far made (given
        back, the next prompt's prefill would make it again, and run slower)."""
        with self._lock:
            self._history, self._pending = [], []

    def abort(self) -> None:
        """Stops a query running in another thread after its current step (Genie's signal)."""
        self._abort.set()

    def save(self) -> DialogState:
        """The dialog so far (Genie's GenieDialog_save): its tokens, their cache entries, its adapter."""
        with self._lock:
            used = len(self._history)
            return DialogState(
                tuple(self._history),
                tuple(self._pending),
                {name: array[:, :, :used].copy() for name, array in self._cache.items()},
                self._adapter,
                dict(self._decode.lora_strengths),
            )

    def restore(self, state: DialogState) -> None:
        """Returns to a saved state (Genie's GenieDialog_restore), its adapter and strengths included."""
        if set(state.cache) != set(self._cache) or len(state.history) > self.capacity:
            raise GenerationError("this saved state belongs to another model; restore it on the dialog that saved it")
        with self._lock:
            if state.adapter is not None:
                self._apply(state.adapter)
                for name, value in state.strengths.items():
                    self._set_strength(name, value)
            used = len(state.history)
            if self._external is not None:
                self._external.keep(state.cache, used)
                self._cache = self._external.cache
            else:
                for name, array in state.cache.items():
                    self._cache[name][:, :, :used] = array
            self._history, self._pending = list(state.history), list(state.pending)

    # --- adapters -----------------------------------------------------------------------------------
    @property
    def adapters(self) -> list[str]:
        return self._adapters.names

    def add_adapter(self, name: str, sections: Sequence[str | Path]) -> None:
        """Makes one more adapter usable by name, its sections checked now (`AdapterSet.add`)."""
        self._adapters.add(name, sections)

    def remove_adapter(self, name: str) -> None:
        """Forgets an adapter added or configured (queries on it are refused from now on)."""
        self._adapters.remove(name)

    @property
    def adapter(self) -> str | None:
        """The adapter the next query runs with (`apply_lora`), or None: the base model."""
        return self._adapter

    def use(self, adapter: str | None, strengths: Mapping[str, float] | None = None) -> None:
        """Runs the next query on `adapter` (None: the base model) with `strengths` for the adapters its
        section holds (those not given keep the section's own); resets the conversation. A server calls
        this per request: applying a section takes well under a millisecond. The base model after an
        adapter is the adapter at strength 0: its LoRA branches then add exactly zero."""
        with self._lock:
            if adapter is None:
                if self._adapter is not None:
                    for name, value in self._decode.lora_strengths.items():
                        if value:
                            self._set_strength(name, 0.0)
            else:
                self._apply(adapter)  # the section's strengths again, whatever a previous query set
                for name, value in (strengths or {}).items():
                    self._set_strength(name, value)
            self._history, self._pending = [], []

    def apply_lora(self, name: str) -> None:
        """Applies an adapter's sections (Genie's applyLora); the next query starts a new conversation."""
        with self._lock:
            self._apply(name)
            self._history, self._pending = [], []

    def _apply(self, name: str) -> None:
        adapter = self._adapters.get(name)
        for section in adapter.bin_sections:
            self._context.apply_binary_section(None, section)
        self._adapter = name

    def set_lora_strength(self, name: str, value: float) -> None:
        """Sets the strength of one adapter of the applied use case (Genie's setLoraStrength): by its alpha
        name as the config's `alphas` give it, or by the adapter's own name; resets the conversation."""
        with self._lock:
            self._set_strength(name, value)
            self._history, self._pending = [], []

    def _set_strength(self, name: str, value: float) -> None:
        if self._adapter is None:
            raise GenerationError("no adapter applied: apply_lora(name) first, then set its strengths")
        adapter = self._strength_of(name)
        for graph in (self._prefill, self._decode):
            graph.set_lora_strength(adapter, float(value))

    def _strength_of(self, name: str) -> str:
        """The adapter an alpha name sets: the config's `alphas` of the applied use case name its adapters in
        the order its section holds them (Genie keys strengths by alpha name, QNN's alpha tensor by adapter)."""
        assert self._adapter is not None
        known = self._decode.lora_strengths
        alphas = self._adapters.get(self._adapter).alphas
        active = self._decode.lora_active
        if name in alphas and alphas.index(name) < len(active):
            return active[alphas.index(name)]
        if name in known:
            return name
        raise GenerationError(
            f"use case {self._adapter!r} has no strength {name!r}; its alphas are {list(alphas)} (adapters "
            f"{list(active) or 'none: the base model'})"
        )

    def close(self) -> None:
        self._context.close()

    def __enter__(self) -> Dialog:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _flat_view(array: np.ndarray) -> memoryview[int]:
    """The array's memory as a flat buffer of its integers (item writes change the array)."""
    flat: Any = array.reshape(-1).data.cast("B")
    return cast("memoryview[int]", flat.cast(array.dtype.char))
