"""Quiver on Ray Serve: replicas of `quiver serve`'s scheduler over one context, adapters multiplexed to them.

`QuiverReplica` runs the continuous-batching scheduler of `quiver serve` over the dialog config's context
(each replica maps the same `.qsec`/`.qctx` files, so replicas on one node share their pages). In front of
the replicas, `quiver serve`'s own `Server` (OpenAI's routes) sends each generation to a replica with the
adapter as Ray's multiplexed model id: Ray routes it to a replica that holds that adapter already
(`serve.multiplexed`, least recently used adapters forgotten past `max_loras`), the base model to any
replica. The front tokenizes and renders chat templates; replicas only decode.

Two fronts. `quiver serve --ray` (`run`) serves HTTP from its own process, through the guarded uvicorn of
`quiver serve` (`serve.guard`: head, time and connection caps before the key), with Ray's HTTP proxy off:
nothing of Ray's listens on the HTTP address. Ray Serve's own config (`serve run config.yaml`, import path
`quiver.serve.ray:build`, `args` as in `RayOptions`) deploys the front as a deployment, `QuiverIngress`,
behind Ray's HTTP proxy, whose limits on heads and connections are Ray's (put it behind a reverse proxy).
Adapters loaded over HTTP are checked by one replica, then named with their path in every request for
them: the path must be readable on every node.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import ray
from ray import serve
from ray.exceptions import RayError
from ray.serve.deployment import Deployment
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from quiver.backends.cpu.packed_file import folder_from
from quiver.errors import QuiverError
from quiver.portable import huge_page_tunables
from quiver.serve.app import BODY_TIMEOUT_S, Server, base_name
from quiver.serve.app import serve as serve_http
from quiver.serve.browsers import allowed_hosts
from quiver.serve.chat import find_chat_template
from quiver.serve.guard import Limits
from quiver.serve.loop import Outbox, drained
from quiver.serve.metrics import Metrics
from quiver.serve.prefix_cache import DEFAULT_BUDGET_BYTES
from quiver.serve.scheduler import Done, Event, Failed, Generation, Job, QueueFullError, Token, TokenLogprob
from quiver.serve.service import LocalService, ServiceUnavailableError
from quiver.t2t.config import adapter_use_cases, read_dialog_config
from quiver.t2t.model_source import ensure_model_folder
from quiver.t2t.tokenizer import TextTokenizer

APP_NAME = "quiver"


class ReplicaLostError(ServiceUnavailableError):
    """The replica running a request stopped (killed, or its node lost): send the request again."""


@dataclasses.dataclass(frozen=True)
class RayOptions:
    """What a Quiver application on Ray Serve is built from (`quiver serve --ray`'s flags, or the `args` of
    a Ray Serve config)."""

    config: str  # the Genie dialog config, at the same path on every node
    replicas: int = 1
    min_replicas: int | None = None  # both set: autoscaling between them instead of `replicas`
    max_replicas: int | None = None
    replica_cpus: float = 1.0  # Ray's logical CPUs per replica (its ORT threads come from the config)
    max_batch: int = 8
    max_loras: int | None = None
    prefill_window: int | None = None
    max_queue: int = 64
    loras: Mapping[str, str] = dataclasses.field(default_factory=dict)  # NAME -> PEFT folder or .qsec
    api_key: str | None = None
    allow_adapter_loading: bool = False
    chat_template: str | None = None
    model_source: str | None = None  # where a node without the config's folder copies it from (checked)
    # where each node keeps the packed weights its replicas map ("default": $QUIVER_PACKED_WEIGHTS or the
    # user's cache; "off": each replica packs its own copy)
    packed_weights: str | None = "default"
    host: str = "127.0.0.1"  # where Ray's proxy listens: the Host requests may give (with allowed_hosts)
    allowed_hosts: Sequence[str] = ()
    allowed_origins: Sequence[str] = ()
    max_loaded_adapters: int = 256
    tool_call_parser: str = "auto"
    prefix_cache_mb: int = DEFAULT_BUDGET_BYTES >> 20

    @classmethod
    def from_args(cls, args: Mapping[str, Any]) -> RayOptions:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(args) - known)
        if unknown:
            raise QuiverError(f"unknown Quiver option {unknown[0]!r} in the Ray Serve config; known: {sorted(known)}")
        if "config" not in args:
            raise QuiverError("the Ray Serve config's args need 'config': the path of a genie_config.json")
        return cls(**args)


# --- replicas -------------------------------------------------------------------------------------------
def _event(event: Event, held: bool | None = None) -> dict[str, Any]:
    """A scheduler event as plain data (Ray sends it to the ingress); the end says whether the replica held
    the request's adapter already (None: the base model)."""
    if isinstance(event, Token):
        return {"text": event.text, "logprobs": event.logprobs, "prompt_logprobs": event.prompt_logprobs}
    if isinstance(event, Done):
        return {"done": dataclasses.asdict(event), "held": held}
    return {"error": str(event.error), "queue_full": isinstance(event.error, QueueFullError)}


def _from_event(data: Mapping[str, Any]) -> Event:
    if "text" in data:
        prompt = data.get("prompt_logprobs")
        return Token(str(data["text"]), time.perf_counter(), tuple(TokenLogprob(*e) for e in data.get("logprobs", ())),
                     None if prompt is None else tuple(TokenLogprob(*e) for e in prompt))  # fmt: skip
    if "done" in data:
        done = dict(data["done"])
        for key in ("logprobs", "prompt_logprobs"):
            if done.get(key) is not None:
                done[key] = tuple(TokenLogprob(*e) for e in done[key])
        return Done(**done)
    error = QueueFullError if data.get("queue_full") else QuiverError
    return Failed(error(str(data.get("error", "the replica failed"))))


class _HeldAdapter:
    """What Ray's multiplexing holds per adapter on a replica (the slot itself is the decoder's, reused
    least recently used first; this only tells Ray's router where the adapter is warm)."""

    def __init__(self, name: str) -> None:
        self.name = name


class QuiverReplica:
    """One scheduler over the context: decodes what the ingress sends, adapters registered on first use."""

    def __init__(self, options: RayOptions) -> None:
        config = ensure_model_folder(options.config, options.model_source)
        self._service = LocalService.open(config, options.max_batch, options.max_loras, options.loras,
                                          options.max_queue, options.prefill_window,
                                          folder_from(options.packed_weights),
                                          options.prefix_cache_mb << 20)  # fmt: skip
        self._decoder = self._service.decoder
        self._sources: dict[str, str] = {}  # adapters registered from a path given by the ingress
        self._loads: dict[str, int] = {}  # per adapter: how often Ray had to load it here
        self._outbox: Outbox | None = None  # the scheduler's tokens to the replica's event loop

        async def hold(model_id: str) -> _HeldAdapter:  # called by Ray only for an adapter not held here
            self._loads[model_id] = self._loads.get(model_id, 0) + 1
            return _HeldAdapter(model_id)

        # wired here, not on the class: the number of adapters held is an option (Ray finds it at init)
        self._hold = serve.multiplexed(max_num_models_per_replica=options.max_loras or options.max_batch)(hold)

    def _register(self, name: str, source: str | None) -> None:
        """An adapter the config does not name: added from its path (again if the path changed)."""
        if source is None or self._sources.get(name) == source:
            return
        if name in self._sources:
            self._decoder.remove_adapter(name)
        self._decoder.add_adapter(name, Path(source))
        self._service.forget_prefixes(name)
        self._sources[name] = source

    def check_adapter(self, name: str, source: str) -> None:
        """Raises unless `source` is an adapter this context can run (the ingress asks before it offers it)."""
        probe = f"{name}\x00check"
        self._decoder.add_adapter(probe, Path(source))
        self._decoder.remove_adapter(probe)

    async def generate(self, fields: dict[str, Any], source: str | None = None) -> AsyncIterator[list[dict[str, Any]]]:
        """A generation's events, as `_event` writes them, until its end: those decided while the last were
        sent go in one message (each message is a remote call: an ingress that falls behind gets fewer)."""
        generation = Generation(**{**fields, "stop": tuple(fields.get("stop", ()))})
        if generation.adapter is not None:
            try:
                await asyncio.to_thread(self._register, generation.adapter, source)
            except QuiverError as exc:
                yield [_event(Failed(exc))]
                return
            model_id = serve.get_multiplexed_model_id() or generation.adapter
            loads = self._loads.get(model_id, 0)
            await self._hold(model_id)
            held: bool | None = self._loads.get(model_id, 0) == loads
        else:
            held = None
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        try:
            self._outbox = outbox = Outbox.on(self._outbox, loop)
            job = self._service.submit(generation, outbox.sink(events))
        except QueueFullError as exc:
            yield [_event(Failed(exc))]
            return
        try:
            while True:
                pending = await drained(events)
                yield [_event(event, held) for event in pending]
                if not isinstance(pending[-1], Token):
                    return
        finally:
            self._service.cancel(job)  # the ingress went away: freed at the next step

    def __del__(self) -> None:
        service = getattr(self, "_service", None)
        if service is not None:
            service.close()


# --- the ingress ----------------------------------------------------------------------------------------
class RayService:
    """The generation service of the ingress: every generation runs on a replica, routed by its adapter."""

    def __init__(self, replicas: DeploymentHandle, options: RayOptions) -> None:
        config = read_dialog_config(ensure_model_folder(options.config, options.model_source))
        self._replicas = replicas
        self.tokenizer = TextTokenizer(config.tokenizer)
        self.context_size = config.context_size
        self.vocabulary = config.n_vocab
        self._adapters: dict[str, str | None] = dict.fromkeys(adapter_use_cases(config))
        self._adapters |= dict.fromkeys(options.loras)  # the replicas load these at start
        self._running: dict[int, asyncio.Task[None]] = {}  # by id() of their job
        self._watch: Metrics | None = None
        # what the replicas hold at once (rows and queue each): past it the ingress answers 429 itself, as
        # one `quiver serve` does past --max-queue, rather than leaving requests waiting in Ray's proxy
        self.capacity = _replica_count(options) * (options.max_batch + options.max_queue)

    def adapter_names(self) -> list[str]:
        return list(self._adapters)

    def submit(self, generation: Generation, sink: Callable[[Event], object]) -> Job:
        if len(self._running) >= self.capacity:
            raise QueueFullError(f"every replica's rows and queue are full ({self.capacity}); try again shortly")
        job = Job(generation, sink)
        task = asyncio.get_running_loop().create_task(self._run(job))
        self._running[id(job)] = task
        task.add_done_callback(lambda _: self._running.pop(id(job), None))
        return job

    async def _run(self, job: Job) -> None:
        generation = job.generation
        handle = self._replicas.options(stream=True, multiplexed_model_id=generation.adapter or "")
        source = self._adapters.get(generation.adapter) if generation.adapter is not None else None
        response = cast(DeploymentResponseGenerator, handle.generate.remote(dataclasses.asdict(generation), source))
        try:
            ended = False
            async for message in response:
                for data in message:
                    if data.get("held") is not None and self._watch is not None:
                        self._watch.adapter_routed.labels("yes" if data["held"] else "no").inc()
                    event = _from_event(data)
                    ended = not isinstance(event, Token)
                    job.sink(event)
            if not ended:  # the replica's stream stopped short of an end: the client hears so, never waits on
                job.sink(Failed(ReplicaLostError("the replica's stream ended before the reply did; send it again")))
        except asyncio.CancelledError:
            response.cancel()
            raise
        except BackPressureError as exc:
            job.sink(Failed(QueueFullError(f"every replica is full; try again shortly ({exc})")))
        except Exception as exc:  # noqa: BLE001  whatever Ray raises, the client gets an answer, never a hang
            stopped = "stopped" if isinstance(exc, RayError) else "failed"
            job.sink(Failed(ReplicaLostError(f"the replica running this request {stopped} ({type(exc).__name__}); "
                                             "send it again")))  # fmt: skip

    def cancel(self, job: Job) -> None:
        task = self._running.get(id(job))
        if task is not None:
            task.cancel()

    @property
    def waiting(self) -> int:
        return 0  # requests wait in Ray's queues, reported by Ray's own metrics

    @property
    def batch_size(self) -> int:
        return len(self._running)  # in flight from this ingress

    def add_adapter(self, name: str, path: str) -> None:
        try:
            self._replicas.check_adapter.remote(name, path).result()
        except RayError as exc:
            cause = getattr(exc, "cause", None)
            raise QuiverError(str(cause) if isinstance(cause, QuiverError) else str(exc).splitlines()[-1]) from None
        self._adapters[name] = path

    def remove_adapter(self, name: str) -> None:
        self._adapters.pop(name, None)

    def watch(self, metrics: Metrics) -> None:
        self._watch = metrics

    def close(self) -> None:
        for task in list(self._running.values()):
            task.cancel()


def ray_server(replicas: DeploymentHandle, options: RayOptions, body_timeout_s: float = BODY_TIMEOUT_S) -> Server:
    """OpenAI's routes (`quiver serve`'s own `Server`) in front of the replicas."""
    config = Path(options.config)
    chosen = Path(options.chat_template) if options.chat_template else None
    template = find_chat_template(config.resolve().parent, chosen)
    return Server(RayService(replicas, options), base_name(config), template, options.api_key,
                  adapter_loading=options.allow_adapter_loading, max_queue=options.max_queue,
                  hosts=allowed_hosts(options.host, options.allowed_hosts), allowed_origins=options.allowed_origins,
                  max_loaded_adapters=options.max_loaded_adapters, body_timeout_s=body_timeout_s,
                  tool_call_parser=options.tool_call_parser)  # fmt: skip


class QuiverIngress:
    """The front as a deployment, behind Ray's HTTP proxy (Ray Serve's own config)."""

    def __init__(self, replicas: DeploymentHandle, options: RayOptions) -> None:
        self.server = ray_server(replicas, options)

    def __serve_build_asgi_app__(self) -> Any:
        """Ray Serve's hook for an ingress whose ASGI app is made per replica, after `__init__`."""
        return self.server.app


_REFUSING = 256  # requests past the replicas' capacity the ingress takes in to answer 429 (more: Ray's 503)


def _replica_count(options: RayOptions) -> int:
    return options.max_replicas if options.max_replicas is not None else options.replicas


def _replica_deployment(options: RayOptions) -> Deployment:
    scaling: dict[str, Any]
    if options.min_replicas is not None and options.max_replicas is not None:
        scaling = {"autoscaling_config": {"min_replicas": options.min_replicas, "max_replicas": options.max_replicas}}
    else:
        scaling = {"num_replicas": options.replicas}
    actor: dict[str, Any] = {"num_cpus": options.replica_cpus}
    tunables = huge_page_tunables(os.environ)
    if tunables is not None:  # a replica decodes all its life: its malloc on huge pages, as `quiver serve`'s
        actor["runtime_env"] = {"env_vars": {"GLIBC_TUNABLES": tunables}}
    return cast(Deployment, serve.deployment(QuiverReplica)).options(
        name="QuiverReplica",
        ray_actor_options=actor,
        max_ongoing_requests=options.max_batch + options.max_queue,
        **scaling,
    )


def application(options: RayOptions) -> serve.Application:
    """The replicas behind the front as a deployment (`QuiverIngress`): what Ray Serve's config deploys."""
    # one ingress (it holds the adapters loaded over HTTP), light enough to need no CPU of its own, taking
    # as many requests at once as every replica may hold (Ray's default, 5, would cap each batch at 5 rows)
    # and more, which it answers 429 at once (`RayService.capacity`); Ray's proxy queues few before it
    capacity = _replica_count(options) * (options.max_batch + options.max_queue)
    ingress = cast(Deployment, serve.deployment(cast(Any, serve.ingress())(QuiverIngress)))
    ingress = ingress.options(name="QuiverIngress", num_replicas=1, ray_actor_options={"num_cpus": 0},
                              max_ongoing_requests=capacity + _REFUSING, max_queued_requests=_REFUSING)  # fmt: skip
    return ingress.bind(_replica_deployment(options).bind(options), options)


def build(args: dict[str, Any]) -> serve.Application:
    """Ray Serve's application builder (`import_path: quiver.serve.ray:build` in a Serve config)."""
    return application(RayOptions.from_args(args))


def run(
    options: RayOptions,
    host: str,
    port: int,
    on_ready: Callable[[str, int], object],
    limits: Limits | None = None,
    parser: str = "auto",
    body_timeout_s: float = BODY_TIMEOUT_S,
) -> None:
    """Deploys the replicas on the Ray cluster at `RAY_ADDRESS` (else on a local one started now, with this
    machine's CPUs) and serves OpenAI's routes at http://host:port from this process, behind `limits`, until
    SIGINT or SIGTERM; then deletes the replicas, and stops Ray Serve and the cluster when it started them."""
    address = os.environ.get("RAY_ADDRESS") or None
    # a local cluster gets the logical CPUs the replicas ask for, even beyond this machine's cores
    cpus = None if address else max(os.cpu_count() or 1, math.ceil(options.replicas * options.replica_cpus))

    stopping = signal.getsignal(signal.SIGTERM)
    ray.init(address=address, num_cpus=cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
    signal.signal(signal.SIGTERM, stopping)  # Ray's driver would exit at once, skipping the cleanup below
    try:
        # Ray's HTTP proxy off: its heads, connections and timeouts are not bounded as this front's are
        serve.start(proxy_location="Disabled")
        replicas = serve.run(_replica_deployment(options).bind(options), name=APP_NAME, route_prefix=None)
        # uvicorn stops on SIGINT and SIGTERM (its handlers replace Ray's while it serves)
        serve_http(ray_server(replicas, options, body_timeout_s), host, port, on_ready, limits, parser)
    finally:
        try:
            if address is None:
                serve.shutdown()
            else:
                serve.delete(APP_NAME)
        finally:
            ray.shutdown()
