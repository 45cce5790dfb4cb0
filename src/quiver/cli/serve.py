"""`quiver serve`: OpenAI's HTTP API over a Genie dialog config (vLLM's and llama.cpp's server role)."""

from __future__ import annotations

import os
import secrets
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from quiver.cli.common import cli, console, named_path
from quiver.errors import QuiverError
from quiver.serve.tools import PARSERS as TOOL_PARSERS  # names only: the serve extra loads with a server

if TYPE_CHECKING:
    from quiver.serve.guard import Limits

API_KEY_ENVIRONMENT = "QUIVER_API_KEY"


class ServeError(QuiverError):
    """`quiver serve` cannot start as asked."""


@cli.command("serve")
@click.option("-c", "--config", "config_path", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="A Genie dialog config (genie_config.json, from `quiver t2t export`).")  # fmt: skip
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to listen on (loopback by default).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option(
    "--api-key", help=f"The key clients must send as 'Authorization: Bearer KEY' (default: ${API_KEY_ENVIRONMENT})."
)
@click.option("--max-queue", default=64, show_default=True, type=click.IntRange(1, 100_000),
              help="Requests that may wait; more are answered 429.")  # fmt: skip
@click.option("--chat-template", type=click.Path(dir_okay=False, path_type=Path),
              help="A Jinja chat template (default: the model's, beside the config).")  # fmt: skip
@click.option("--max-batch", default=8, show_default=True, type=click.IntRange(1, 256),
              help="Sequences decoded together in one step (a row's KV cache takes memory as its tokens "
                   "arrive, up to the context size).")  # fmt: skip
@click.option("--max-loras", default=None, type=click.IntRange(1, 1024),
              help="Adapter slots: adapters (at given strengths) held at once [default: --max-batch].")  # fmt: skip
@click.option("--prefill-window", default=None, type=click.IntRange(1, 1 << 20),
              help="Prompt tokens prefilled between two decode steps [default: the config's].")  # fmt: skip
@click.option("--lora", "loras", multiple=True, metavar="NAME=PATH",
              help="One more adapter to serve: a PEFT folder or a .qsec of this context (repeatable).")  # fmt: skip
@click.option("--allow-adapter-loading", is_flag=True,
              help="Let clients load and unload adapters (.qsec paths on this machine) while it serves.")  # fmt: skip
@click.option("--ray", "on_ray", is_flag=True,
              help="Serve on Ray Serve: replicas of the engine behind this process's HTTP front, adapters routed "
                   "to the replicas that hold them (the cluster at $RAY_ADDRESS, else a local one).")  # fmt: skip
@click.option("--replicas", default=1, show_default=True, type=click.IntRange(1, 1024),
              help="With --ray: engine replicas (each maps the same context).")  # fmt: skip
@click.option("--replica-cpus", default=1.0, show_default=True, type=click.FloatRange(0, 1024),
              help="With --ray: Ray's logical CPUs each replica asks for.")  # fmt: skip
@click.option("--packed-weights", metavar="FOLDER|off|default",
              help="Keep the model's packed weights in a file under FOLDER, made once and mapped by every server "
                   "process on this machine instead of packed by each ['default' ($QUIVER_PACKED_WEIGHTS, else "
                   "~/.cache/quiver/packed-weights) with --ray, else off].")  # fmt: skip
@click.option("--max-connections", default=1024, show_default=True, type=click.IntRange(1, 1 << 20),
              help="Connections held at once; past it, the oldest one still without a request is closed.")  # fmt: skip
@click.option("--max-connections-per-client", default=128, show_default=True, type=click.IntRange(1, 1 << 20),
              help="Connections from one address; past it, its oldest without a request is closed.")  # fmt: skip
@click.option("--header-timeout", default=10.0, show_default=True, type=click.FloatRange(0.1, 3600),
              help="Seconds for a request head to arrive (from the connection or the last response).")  # fmt: skip
@click.option("--body-timeout", default=30.0, show_default=True, type=click.FloatRange(0.1, 3600),
              help="Seconds for a request's body to arrive once its head has.")  # fmt: skip
@click.option("--max-loaded-adapters", default=256, show_default=True, type=click.IntRange(1, 1 << 20),
              help="Adapters held by name at once (the config's included); loading past it is refused.")  # fmt: skip
@click.option("--allowed-hosts", "hosts", multiple=True, metavar="NAME[,NAME...]",
              help="Host names requests may give besides the listening address (others: 400).")  # fmt: skip
@click.option("--allowed-origins", "origins", multiple=True, metavar="ORIGIN[,ORIGIN...]",
              help="Web origins whose pages may call the server (CORS); none by default.")  # fmt: skip
@click.option("--prefix-cache-mb", default=256, show_default=True, type=click.IntRange(0, 1 << 20),
              help="Memory for recent prompts' cache rows, reused by prompts that begin alike (0: off).")  # fmt: skip
@click.option("--tool-call-parser", type=click.Choice(["auto", "none", *TOOL_PARSERS]), default="auto",
              show_default=True,
              help="How a reply's tool calls are written (vLLM's names); auto: as the template shows.")  # fmt: skip
@click.option("--http", "parser", type=click.Choice(["auto", "h11", "httptools"]), default="auto", show_default=True,
              help="uvicorn's HTTP parser (auto: httptools where installed); the limits hold with either.")  # fmt: skip
@click.option("--model-source", metavar="FOLDER|URL",
              help="With --ray: where a node without the config's folder copies it from (a folder or a "
                   "file/http(s) URL of one); every context and section is checked before use.")  # fmt: skip
def serve_command(
    config_path: Path,
    host: str,
    port: int,
    api_key: str | None,
    max_queue: int,
    chat_template: Path | None,
    max_batch: int,
    max_loras: int | None,
    prefill_window: int | None,
    loras: tuple[str, ...],
    allow_adapter_loading: bool,
    on_ray: bool,
    replicas: int,
    replica_cpus: float,
    model_source: str | None,
    packed_weights: str | None,
    max_connections: int,
    max_connections_per_client: int,
    header_timeout: float,
    body_timeout: float,
    parser: str,
    hosts: tuple[str, ...],
    origins: tuple[str, ...],
    max_loaded_adapters: int,
    tool_call_parser: str,
    prefix_cache_mb: int,
) -> None:
    """Serve a model and its adapters with OpenAI's API: /v1/completions, /v1/chat/completions, /v1/models."""
    try:
        from quiver.serve.app import Server, base_name, serve
        from quiver.serve.browsers import allowed_hosts
        from quiver.serve.chat import find_chat_template
        from quiver.serve.guard import Limits
        from quiver.serve.service import LocalService
    except ImportError as exc:
        raise ServeError(
            f"serving needs the serve extra ({exc.name} is missing): pip install 'quiver[serve]'"
        ) from None
    from quiver.backends.cpu import folder_from
    from quiver.tuning.server import is_loopback

    key = api_key or os.environ.get(API_KEY_ENVIRONMENT) or None
    if key is None and not is_loopback(host):
        raise ServeError(f"a server on {host} (beyond loopback) needs an API key: pass --api-key or set "
                         f"{API_KEY_ENVIRONMENT}, or listen on 127.0.0.1")  # fmt: skip
    template = find_chat_template(config_path.resolve().parent, chat_template)
    added = [named_path(entry, "a PEFT folder or a .qsec") for entry in loras]
    given_hosts = [name for entry in hosts for name in entry.split(",") if name.strip()]
    given_origins = [origin.strip() for entry in origins for origin in entry.split(",") if origin.strip()]

    limits = Limits(header_timeout=header_timeout, max_connections=max_connections,
                    max_per_client=max_connections_per_client)  # fmt: skip

    def ready(bound_host: str, bound_port: int, models: list[str]) -> None:
        where = f"on Ray Serve, {replicas} replica(s) " if on_ray else ""
        console.print(f"quiver serve {where}on http://{bound_host}:{bound_port}/v1 (models: {', '.join(models)}; "
                      "Ctrl-C stops it)")  # fmt: skip

    # Ctrl-C (SIGINT) and SIGTERM stop it however it was started: uvicorn shuts down on either, then
    # raises it again, which ends here as KeyboardInterrupt (a shell starts background jobs with SIGINT
    # ignored, and Python then leaves it ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if on_ray:
        args = {
            "replicas": replicas,
            "replica_cpus": replica_cpus,
            "max_batch": max_batch,
            "max_loras": max_loras,
            "prefill_window": prefill_window,
            "max_queue": max_queue,
            "loras": {name: str(path.resolve()) for name, path in added},
            "api_key": key,
            "allow_adapter_loading": allow_adapter_loading,
            "chat_template": str(chat_template.resolve()) if chat_template is not None else None,
            "model_source": model_source,
            "packed_weights": packed_weights or "default",
            "host": host,
            "allowed_hosts": given_hosts,
            "allowed_origins": given_origins,
            "max_loaded_adapters": max_loaded_adapters,
            "tool_call_parser": tool_call_parser,
            "prefix_cache_mb": prefix_cache_mb,
        }
        try:
            _serve_on_ray(config_path, host, port, args, ready, limits, parser, body_timeout)
        except KeyboardInterrupt:
            pass
        return
    service = LocalService.open(config_path, max_batch, max_loras, dict(added), max_queue, prefill_window,
                                folder_from(packed_weights), prefix_cache_mb << 20)  # fmt: skip
    server = Server(service, base_name(config_path), template, key, adapter_loading=allow_adapter_loading,
                    body_timeout_s=body_timeout, max_queue=max_queue, hosts=allowed_hosts(host, given_hosts),
                    allowed_origins=given_origins, max_loaded_adapters=max_loaded_adapters,
                    tool_call_parser=tool_call_parser)  # fmt: skip
    try:
        serve(server, host, port, lambda h, p: ready(h, p, server.served.model_ids()), limits, parser)
    except KeyboardInterrupt:
        pass


def _serve_on_ray(
    config_path: Path,
    host: str,
    port: int,
    args: dict[str, Any],
    ready: Callable[[str, int, list[str]], None],
    limits: Limits,
    parser: str,
    body_timeout: float,
) -> None:
    if not os.environ.get("RAY_ADDRESS"):
        # the local cluster started here is this machine's alone: Ray's single-machine mode puts its node on
        # the loopback address (its GCS, raylet, agents and metrics listen there; read when Ray is imported,
        # so set first), and it admits only processes holding a token made now (Ray's token authentication),
        # which its workers inherit: that also guards the one port Ray binds on every interface whatever
        # the node's address, each replica's gRPC server for calls between deployments
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        if "RAY_AUTH_MODE" not in os.environ:
            os.environ |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    try:
        from quiver.serve.ray import RayOptions, run
    except ImportError as exc:
        raise ServeError(f"--ray needs the ray extra ({exc.name} is missing): pip install 'quiver[ray]'") from None
    from quiver.t2t.config import adapter_use_cases, read_dialog_config
    from quiver.t2t.model_source import ensure_model_folder

    # checked here: a bad config is one line, not a replica's traceback
    config = read_dialog_config(ensure_model_folder(config_path, args.get("model_source")))
    options = RayOptions.from_args({"config": str(config_path.resolve()), **args})
    models = [config_path.resolve().parent.name, *adapter_use_cases(config), *options.loras]
    run(options, host, port, lambda h, p: ready(h, p, models), limits, parser, body_timeout)
