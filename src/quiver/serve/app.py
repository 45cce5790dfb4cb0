"""`quiver serve`: OpenAI's HTTP API over a Genie dialog config, on Starlette (routes) and uvicorn (HTTP).

Routes: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (`stream` as server-sent
events ending in `data: [DONE]`), vLLM's `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`,
`POST /tokenize` and `/detokenize`, `GET /version`, `GET /health`, `GET /metrics`. With an API key
every route but `/health` needs `Authorization: Bearer KEY`, checked before a byte of the body is read;
bodies are read up to `max_body_bytes`. Bad requests, unknown routes and methods get OpenAI's error
object (400/401/404/405/413); a full queue gets 429 with `Retry-After`. A client that goes away cancels
its request at the scheduler's next step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, cast

from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

import quiver
from quiver import portable
from quiver.errors import QuiverError
from quiver.serve.browsers import BrowserGuard
from quiver.serve.chat import ChatTemplate
from quiver.serve.grammar import GrammarError, Grammars, json_schema_grammar
from quiver.serve.guard import Guard, Limits, guarded
from quiver.serve.loop import Outbox, drained
from quiver.serve.metrics import Metrics
from quiver.serve.openai_api import (
    ApiError,
    Echo,
    Served,
    chat_messages,
    chat_rendering,
    check_fields,
    choice_counts,
    chunk,
    completion,
    completion_prompts,
    constraint_field,
    detokenize_request,
    echoed,
    generation,
    include_usage,
    new_id,
    reply_logprobs,
    tokenize_request,
    usage,
    usage_chunk,
)
from quiver.serve.scheduler import Done, Event, Failed, Generation, Job, QueueFullError, SchedulerFaultError, Token
from quiver.serve.service import Service, ServiceUnavailableError
from quiver.serve.tools import ToolError, ToolRequest, ToolStream, parser_for, template_messages, tool_request
from quiver.t2t.tokenizer import is_utf8

MAX_BODY_BYTES = 4 << 20
MAX_BODIES_BYTES = 32 << 20  # bodies being read at once, all clients together (8 of the largest)
_TRIM_AFTER_BYTES = 256 << 10
_TRIM_AFTER_S = 0.5
BODY_TIMEOUT_S = 30.0  # a body must arrive whole within this, once its head has
MAX_MODEL_NAME = 256  # characters of an adapter name a client gives
MAX_PATH = 4096  # characters of a path a client gives (Linux's PATH_MAX)
MAX_LOADED_ADAPTERS = 256  # adapters a server holds by name at once, those of its config included
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's, for /v1/completions (chat runs until the context is full)


class _AsciiJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: an error may quote what a client sent, lone surrogates
    included, which UTF-8 cannot encode (Starlette's own JSONResponse would fail into a plain-text 500)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _error_response(error: ApiError) -> JSONResponse:
    headers = {"Retry-After": "1"} if error.status in (429, 503) else None
    return _AsciiJSONResponse(error.body(), status_code=error.status, headers=headers)


class _ApiKey:
    """Refuses every request but `GET /health` without the key, before the route reads anything."""

    def __init__(self, app: ASGIApp, key: str | None) -> None:
        self.app, self.key = app, key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.key is not None and scope.get("path") != "/health":
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, b"Bearer " + self.key.encode()):
                error = ApiError(401, "a valid API key is required: 'Authorization: Bearer KEY'", None,
                                 "invalid_api_key")  # fmt: skip
                await _error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _unknown_route(request: Request, exc: Exception) -> Response:
    """Starlette's 404 (no such route) and 405 (not that method) in OpenAI's error object."""
    status = int(getattr(exc, "status_code", 404))
    what = "no route" if status == 404 else "the route does not take"
    path = request.url.path[:100]
    error = ApiError(status, f"{what} {request.method[:10]} {path}; see GET /v1/models and the docs' routes",
                     None, "not_found" if status == 404 else "method_not_allowed")  # fmt: skip
    response = _error_response(error)
    if status == 405 and isinstance(getattr(exc, "headers", None), dict):
        response.headers.update(exc.headers)  # type: ignore[attr-defined]  # Allow
    return response


class Server:
    """The routes over one generation service; `app` is the ASGI application uvicorn (or Ray Serve) runs."""

    def __init__(
        self,
        service: Service,
        base: str,
        chat_template: ChatTemplate | None = None,
        api_key: str | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        adapter_loading: bool = False,
        body_timeout_s: float = BODY_TIMEOUT_S,
        max_bodies_bytes: int = MAX_BODIES_BYTES,
        max_queue: int = 64,
        hosts: frozenset[str] | None = None,
        allowed_origins: Sequence[str] = (),
        max_loaded_adapters: int = MAX_LOADED_ADAPTERS,
        tool_call_parser: str = "auto",
    ) -> None:
        self.service = service
        self._outbox: Outbox | None = None  # the scheduler's tokens to the event loop
        self.base = base
        self.chat_template = chat_template
        self.tool_parser = parser_for(chat_template.source if chat_template else None, tool_call_parser)
        self.adapter_loading = adapter_loading
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.max_bodies_bytes = max_bodies_bytes
        self._bodies_bytes = 0  # bytes of bodies being read now (the event loop's thread alone counts)
        self._trim_due = False
        self.max_queue = max_queue  # requests being tokenized and waiting, together
        self.max_loaded_adapters = max_loaded_adapters
        self._preparing = 0  # requests being tokenized (off the loop) now
        self._grammar_check: Grammars | None = None
        self.metrics = Metrics(lambda: service.waiting, lambda: service.batch_size)
        service.watch(self.metrics)
        routes = [
            Route("/health", self._health, methods=["GET"]),
            Route("/metrics", self._metrics, methods=["GET"]),
            Route("/v1/models", self._counted("/v1/models", self._models), methods=["GET"]),
            Route("/v1/completions", self._counted("/v1/completions", self._completions), methods=["POST"]),
            Route("/v1/chat/completions", self._counted("/v1/chat/completions", self._chat), methods=["POST"]),
            Route("/v1/load_lora_adapter", self._counted("/v1/load_lora_adapter", self._load), methods=["POST"]),
            Route("/v1/unload_lora_adapter", self._counted("/v1/unload_lora_adapter", self._unload), methods=["POST"]),
            Route("/tokenize", self._counted("/tokenize", self._tokenize), methods=["POST"]),
            Route("/detokenize", self._counted("/detokenize", self._detokenize), methods=["POST"]),
            Route("/version", self._version, methods=["GET"]),
        ]
        # the browser checks first, then CORS (its preflights carry no key) for the origins the operator names
        # alone, then the key, then a route
        # an unknown route or method answers OpenAI's error object too, as every other refusal does
        missing = {404: _unknown_route, 405: _unknown_route}
        app: ASGIApp = _ApiKey(Starlette(routes=routes, exception_handlers=missing), api_key or None)
        if allowed_origins:
            app = CORSMiddleware(app, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                                 allow_headers=["Authorization", "Content-Type"])  # fmt: skip
        self.app: ASGIApp = BrowserGuard(app, hosts)

    @property
    def served(self) -> Served:
        """The models as they are now (adapters may be loaded and unloaded while the server runs)."""
        service = self.service
        return Served(self.base, service.adapter_names(), service.context_size, service.vocabulary)

    def close(self) -> None:
        self.service.close()

    def _counted(self, route: str, handler: Callable[[Request], Awaitable[Response]]) -> Callable[..., Any]:
        async def counted(request: Request) -> Response:
            try:
                response = await handler(request)
            except ApiError as error:
                response = _error_response(error)
            except Exception as exc:  # noqa: BLE001  the server answers, in OpenAI's schema, and goes on
                response = _error_response(ApiError(500, f"internal error: {type(exc).__name__}", None, "internal"))
            self.metrics.requests.labels(route, str(response.status_code)).inc()
            return response

        return counted

    # --- routes -----------------------------------------------------------------------------------------
    async def _health(self, _: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def _metrics(self, _: Request) -> Response:
        return Response(self.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _models(self, _: Request) -> Response:
        created = int(time.time())
        models = [{"id": m, "object": "model", "created": created, "owned_by": "quiver"}
                  for m in self.served.model_ids()]  # fmt: skip
        return JSONResponse({"object": "list", "data": models})

    async def _completions(self, request: Request) -> Response:
        body = await self._body(request)
        check_fields(body, chat=False)
        served = self.served
        prompts = completion_prompts(body, served.vocabulary, served.context_size)
        tokenizer = self.service.tokenizer
        ids = [await self._prepared(tokenizer.encode, p) if isinstance(p, str) else p for p in prompts]
        requests = [generation(body, served, i, COMPLETIONS_DEFAULT_MAX_TOKENS) for i in ids]
        echoes = None
        if echoed(body):  # the prompt as given, or its ids' text
            echoes = [Echo(p if isinstance(p, str) else tokenizer.decode(i), i) for p, i in zip(prompts, ids)]
        return await self._generate(request, body, requests, False, echoes)

    async def _chat(self, request: Request) -> Response:
        body = await self._body(request)
        check_fields(body, chat=True)
        messages = chat_messages(body, self.served.context_size)
        rendering = chat_rendering(body)
        template = self.chat_template
        if template is None:
            raise ApiError(400, "this model has no chat template: use /v1/completions, or start the server with "
                           "--chat-template", "messages", "no_chat_template")  # fmt: skip

        try:
            tools = tool_request(body, self.tool_parser)
        except ToolError as exc:
            raise ApiError(400, str(exc), exc.param, "invalid_value") from None
        forced = tools.grammar_schema() if tools else None
        if forced is not None and constraint_field(body):
            raise ApiError(400, "a required or named tool_choice is a constraint already: drop "
                           f"'{constraint_field(body)}'", constraint_field(body), "invalid_value")  # fmt: skip
        rendering = rendering.with_tools(tools)  # the template lists them
        shown = template_messages(messages)

        def render_and_encode() -> list[int]:
            try:
                text = template.render(shown, **vars(rendering))
            except ValueError as exc:
                raise ApiError(400, str(exc), "messages", "invalid_value") from None
            return self.service.tokenizer.encode(text, add_special_tokens=False)  # the template wrote them

        ids = await self._prepared(render_and_encode)
        request_ = generation(body, self.served, ids, None)
        if forced is not None:
            try:
                request_ = replace(request_, grammar=json_schema_grammar(forced))
            except GrammarError as exc:
                raise ApiError(400, str(exc), "tools", "invalid_value") from None
        return await self._generate(request, body, [request_], True, tools=tools)

    async def _tokenize(self, request: Request) -> Response:
        """vLLM's route: a prompt's or a chat's token ids (and their strings), the context they must fit."""
        asked = tokenize_request(await self._body(request), self.served)
        template, tokenizer = self.chat_template, self.service.tokenizer
        if asked.messages is not None and template is None:
            raise ApiError(400, "this model has no chat template: tokenize a 'prompt'", "messages", "no_chat_template")

        def encode() -> list[int]:
            if asked.messages is None:
                return tokenizer.encode(asked.text or "", add_special_tokens=asked.add_special_tokens)
            assert template is not None
            try:
                text = template.render(template_messages(asked.messages), **vars(asked.rendering))
            except ValueError as exc:
                raise ApiError(400, str(exc), "messages", "invalid_value") from None
            return tokenizer.encode(text, add_special_tokens=asked.add_special_tokens)

        ids = await self._prepared(encode)
        strings = [tokenizer.decode([i]) for i in ids] if asked.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": self.served.context_size, "tokens": ids,
                             "token_strs": strings})  # fmt: skip

    async def _detokenize(self, request: Request) -> Response:
        """vLLM's route: token ids back to text."""
        ids = detokenize_request(await self._body(request), self.served)
        tokenizer = self.service.tokenizer
        return JSONResponse({"prompt": await asyncio.to_thread(tokenizer.decode, ids)})

    async def _version(self, _: Request) -> Response:
        return JSONResponse({"version": quiver.__version__})

    async def _prepared(self, work: Callable[..., list[int]], *args: Any) -> list[int]:
        """Tokenizing (and rendering) off the event loop, where a long prompt stalls no stream; requests being
        prepared count against the queue's bound with those waiting in it (429 past it)."""
        if self._preparing + self.service.waiting >= self.max_queue:
            raise ApiError(429, f"{self.max_queue} requests are waiting already; try again shortly", None,
                           "queue_full")  # fmt: skip
        self._preparing += 1
        try:
            return await asyncio.to_thread(work, *args)
        finally:
            self._preparing -= 1

    async def _load(self, request: Request) -> Response:
        """vLLM's route: `{"lora_name", "lora_path"}`, a PEFT folder or a section (.qsec) made for this
        model's context, checked now and usable by the next request."""
        body = await self._adapter_body(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ApiError(400, "give 'lora_name' and 'lora_path' (a PEFT folder, or a .qsec of this model)",
                           "lora_path", "missing")  # fmt: skip
        if len(name) > MAX_MODEL_NAME or not name.isprintable():
            raise ApiError(400, f"'lora_name' must be up to {MAX_MODEL_NAME} printable characters", "lora_name",
                           "invalid_value")  # fmt: skip
        if len(path) > MAX_PATH or "\0" in path or not is_utf8(path) or not is_utf8(name):
            raise ApiError(400, f"'lora_path' must be a path of up to {MAX_PATH} characters and 'lora_name' text",
                           "lora_path", "invalid_value")  # fmt: skip
        names = self.service.adapter_names()
        if name == self.base or name in names:
            raise ApiError(400, f"the model '{name[:100]}' exists already; unload it first", "lora_name", "exists")
        if len(names) >= self.max_loaded_adapters:
            raise ApiError(400, f"{len(names)} adapters are loaded, the most this server holds "
                           "(--max-loaded-adapters); unload one first", "lora_name", "too_many_adapters")  # fmt: skip
        try:
            await asyncio.to_thread(self.service.add_adapter, name, path)
        except (QuiverError, OSError) as exc:
            # the reason goes to the operator's log only: a client learns nothing of the server's files (whether
            # a path exists, is a folder or a file, its size) beyond "not an adapter of this model"
            print(f"quiver serve: adapter {name!r} not loaded from {path!r}: {exc}", file=sys.stderr, flush=True)
            raise ApiError(
                400,
                "'lora_path' names no PEFT adapter folder or section (.qsec) of this model that the "
                "server can read; the server's log says why",
                "lora_path",
                "invalid_adapter",
            ) from None
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    async def _unload(self, request: Request) -> Response:
        body = await self._adapter_body(request)
        name = body.get("lora_name")
        if not isinstance(name, str) or name not in self.service.adapter_names():
            raise ApiError(404, f"no adapter '{str(name)[:100]}' to unload", "lora_name", "model_not_found")
        self.service.remove_adapter(name)
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")

    async def _adapter_body(self, request: Request) -> dict[str, Any]:
        if not self.adapter_loading:
            raise ApiError(404, "loading adapters while serving is off: start the server with "
                           "--allow-adapter-loading", None, "not_enabled")  # fmt: skip
        return await self._body(request)

    async def _body(self, request: Request) -> dict[str, Any]:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise ApiError(413, f"the body exceeds {self.max_body_bytes} bytes", None, "body_too_large")
        data = bytearray()
        try:
            # the reader returns its refusal rather than raising it: an error raised in the task wait_for
            # runs would sit in a reference cycle with that task (and the request's buffers with it) until
            # the cyclic collector runs
            refused = await asyncio.wait_for(self._read(request, data), self.body_timeout_s)
        except TimeoutError:
            refused = ApiError(408, f"the body did not arrive within {self.body_timeout_s:g} s", None,
                               "body_timeout")  # fmt: skip
        finally:
            self._bodies_bytes -= len(data)
        if refused is not None:
            data.clear()
            self._trim_soon()
            raise refused
        try:
            body = json.loads(data)
        except (ValueError, RecursionError):
            raise ApiError(400, "the body is not valid JSON", None, "invalid_json") from None
        finally:
            if len(data) >= _TRIM_AFTER_BYTES:  # a large body's pages back to the OS once it is parsed
                asyncio.get_running_loop().call_soon(portable.return_freed_memory)
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object", None, "invalid_body")
        return body

    def _trim_soon(self) -> None:
        """The heap's free pages back to the OS within a second of a refused body (once, however many are
        refused meanwhile): what the refused bodies held is free then."""
        if not self._trim_due:
            self._trim_due = True
            asyncio.get_running_loop().call_later(_TRIM_AFTER_S, self._trim)

    def _trim(self) -> None:
        self._trim_due = False
        portable.return_freed_memory()

    async def _read(self, request: Request, data: bytearray) -> ApiError | None:
        """The body into `data`, bounded by its size and by what all bodies being read may hold; why it
        was refused, if it was."""
        async for piece in request.stream():
            data += piece
            self._bodies_bytes += len(piece)
            if len(data) > self.max_body_bytes:
                return ApiError(413, f"the body exceeds {self.max_body_bytes} bytes", None, "body_too_large")
            if self._bodies_bytes > self.max_bodies_bytes:
                return ApiError(503, "the server is reading too many bodies at once; retry", None, "busy")
        return None

    async def _generate(
        self,
        http: Request,
        body: dict[str, Any],
        prompts: list[Generation],
        chat: bool,
        echoes: list[Echo] | None = None,
        tools: ToolRequest | None = None,
    ) -> Response:
        """Runs each prompt's generations (`n`, `best_of`) and answers with their choices, whole or streamed
        (`echoes`: each prompt, echoed before its choices)."""
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, "'stream' must be true or false", "stream", "invalid_type")
        usage = include_usage(body)
        if usage and not stream:
            raise ApiError(400, "'stream_options' is only allowed when 'stream' is true", "stream_options",
                           "invalid_value")  # fmt: skip
        counts = choice_counts(body, len(prompts), stream)
        grammar = prompts[0].grammar  # one per request, the same for each prompt
        if grammar is not None:  # built once here, off the loop, within its limits: a bad one is the client's 400
            try:
                await asyncio.to_thread(self._grammars().check, grammar)
            except GrammarError as exc:
                raise ApiError(400, str(exc), constraint_field(body), "invalid_value") from None
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        self._outbox = outbox = Outbox.on(self._outbox, loop)
        jobs: list[Job] = []
        try:
            for index, one in enumerate(g for p in prompts for g in counts.expanded(p)):
                jobs.append(self.service.submit(one, partial(self._tagged, outbox, events, index)))
        except QueueFullError as exc:
            for job in jobs:
                self.service.cancel(job)
            raise ApiError(429, str(exc), None, "queue_full") from None
        request_id, model = new_id("chatcmpl" if chat else "cmpl"), str(body["model"])
        prompt_tokens = sum(len(p.prompt_ids) for p in prompts)
        echoed_ = [echo for echo in echoes for _ in range(counts.n)] if echoes else None
        if stream:
            used = prompt_tokens if usage else None
            replies = self._events(jobs, events, request_id, model, chat, used, tools, echoed_)
            return StreamingResponse(replies, media_type="text/event-stream")
        watcher = asyncio.create_task(self._cancel_when_gone(http, jobs))
        try:
            dones = await self._collect(jobs, events)
        finally:
            watcher.cancel()
            for job in jobs:
                self.service.cancel(job)  # a no-op once it is done
        asked = prompts[0].logprobs is not None
        choices = [
            c for p in range(len(prompts)) for c in counts.chosen(dones[p * counts.best_of :][: counts.best_of], asked)
        ]
        text_of = self.service.tokenizer.token_text
        return JSONResponse(completion(request_id, model, choices, chat, text_of, prompt_tokens, echoed_, tools))

    def _grammars(self) -> Grammars:
        """llguidance's view of the tokenizer, made at the first constrained request (~0.2 s, off the loop)."""
        if self._grammar_check is None:
            self._grammar_check = Grammars(self.service.tokenizer, (), self.served.vocabulary)
        return self._grammar_check

    @staticmethod
    def _tagged(outbox: Outbox, events: asyncio.Queue[tuple[int, Event]], index: int, event: Event) -> None:
        outbox.put(events, (index, event))

    async def _cancel_when_gone(self, http: Request, jobs: list[Job]) -> None:
        """A client that hangs up before its whole reply frees its row at the next step."""
        while not await http.is_disconnected():
            await asyncio.sleep(0.25)
        for job in jobs:
            self.service.cancel(job)

    async def _collect(self, jobs: list[Job], events: asyncio.Queue[tuple[int, Event]]) -> list[Done]:
        """Every generation's end, in the order of `jobs`; the first failure fails the request."""
        previous = [job.submitted for job in jobs]
        dones: dict[int, Done] = {}
        while len(dones) < len(jobs):
            index, event = await events.get()
            if isinstance(event, Token):
                previous[index] = self._timed(jobs[index], event, previous[index])
            elif isinstance(event, Failed):
                raise _failure(event.error)
            else:
                self._count(event)
                dones[index] = event
        return [dones[i] for i in range(len(jobs))]

    async def _events(
        self,
        jobs: list[Job],
        events: asyncio.Queue[tuple[int, Event]],
        request_id: str,
        model: str,
        chat: bool,
        prompt_tokens: int | None,
        tools: ToolRequest | None = None,
        echoes: list[Echo] | None = None,
    ) -> AsyncIterator[str]:
        """The stream's server-sent events, each choice's under its index, those decided while the last were
        sent in one write (a client or a hop that falls behind gets fewer, larger writes), with a last chunk
        of the usage where asked (`prompt_tokens` given: `stream_options.include_usage`, OpenAI's: no
        choices); a chat's tool calls as one delta at the end of their choice (`tools`); each choice's
        prompt first where echoed (`echoes`: its text, and its log-probabilities where asked); the request is
        cancelled if the client goes away."""
        count = len(jobs)
        first, previous = [True] * count, [job.submitted for job in jobs]
        asked, text_of = jobs[0].generation.logprobs is not None, self.service.tokenizer.token_text
        sent, offset = [0] * count, [0] * count  # log-probabilities sent, the characters before the next piece
        echoed = [False] * count  # each choice's prompt sent (where echoed)
        streams = [ToolStream(tools) for _ in jobs] if tools is not None else None
        dones: dict[int, Done] = {}
        try:
            while len(dones) < count:
                out = []
                for i, event in await drained(events):
                    if echoes is not None and not echoed[i] and not isinstance(event, Failed):  # the prompt first
                        echoed[i], echo = True, replace(echoes[i], logprobs=event.prompt_logprobs or ())
                        logprobs = reply_logprobs([] if asked else None, text_of, chat, echo=echo)
                        out.append(_sse(chunk(request_id, model, chat, echo.text, logprobs=logprobs, index=i)))
                        offset[i] = len(echo.text)
                    if isinstance(event, Token):
                        previous[i] = self._timed(jobs[i], event, previous[i])
                        logprobs = reply_logprobs(event.logprobs if asked else None, text_of, chat, offset[i])
                        sent[i], offset[i] = sent[i] + len(event.logprobs), offset[i] + len(event.text)
                        text = streams[i].feed(event.text) if streams else event.text
                        if not text and logprobs is None:
                            continue  # held back: the beginning of a tool call, perhaps
                        out.append(_sse(chunk(request_id, model, chat, text, first=first[i], logprobs=logprobs,
                                              index=i)))  # fmt: skip
                    elif isinstance(event, Failed):
                        out.append(_sse(_failure(event.error).body()))
                        yield "".join(out)
                        return
                    else:
                        self._count(event)
                        dones[i] = event
                        rest = event.logprobs[sent[i] :] if event.logprobs is not None else None
                        logprobs = reply_logprobs(rest or None, text_of, chat, offset[i])
                        held, calls = streams[i].end() if streams else ("", [])
                        finish = "tool_calls" if calls and event.finish_reason == "stop" else None
                        if held or calls:
                            out.append(_sse(chunk(request_id, model, chat, held, first=first[i], index=i,
                                                  tool_calls=calls)))  # fmt: skip
                            first[i] = False
                        out.append(_sse(chunk(request_id, model, chat, done=event, first=first[i], logprobs=logprobs,
                                              index=i, finish_reason=finish)))  # fmt: skip
                    first[i] = False
                if len(dones) == count and prompt_tokens is not None:
                    out.append(_sse(usage_chunk(request_id, model, chat, usage(prompt_tokens, list(dones.values())))))
                yield "".join(out)
            yield "data: [DONE]\n\n"
        finally:
            for job in jobs:
                self.service.cancel(job)  # a no-op once it is done; a client gone stops it at the next step

    def _timed(self, job: Job, token: Token, previous: float) -> float:
        (self.metrics.first_token if previous == job.submitted else self.metrics.between_tokens).observe(
            token.at - previous
        )
        return token.at

    def _count(self, done: Done) -> None:
        self.metrics.prompt_tokens.inc(done.prompt_tokens)
        self.metrics.generated_tokens.inc(len(done.token_ids))


def _failure(error: QuiverError) -> ApiError:
    """A generation that failed: a full queue, a lost replica (both worth retrying), else the client's
    request was bad (an adapter's strength it lacks...)."""
    if isinstance(error, QueueFullError):
        return ApiError(429, str(error), None, "queue_full")
    if isinstance(error, ServiceUnavailableError):
        return ApiError(503, str(error), None, "service_unavailable")
    if isinstance(error, SchedulerFaultError):
        return ApiError(500, str(error), None, "engine_fault")
    return ApiError(400, str(error), None, "generation_failed")


def _sse(event: dict[str, Any]) -> str:
    return f"data: {json.dumps(event, separators=(',', ':'))}\n\n"


SHUTDOWN_TIMEOUT_S = 5  # how long a stop waits for requests in flight (an unfinished body included)


def serve(
    server: Server,
    host: str,
    port: int,
    on_ready: Callable[[str, int], object] | None = None,
    limits: Limits | None = None,
    parser: str = "auto",
) -> None:
    """Runs the server with uvicorn until interrupted (SIGINT, SIGTERM), its connections behind `limits`
    (`serve.guard`) whichever HTTP `parser` uvicorn runs ("auto": httptools where installed, else h11)."""
    import uvicorn
    from uvicorn.config import HTTP_PROTOCOLS
    from uvicorn.importer import import_from_string

    protocols = cast("dict[str, str]", HTTP_PROTOCOLS)  # keyed by a Literal in some uvicorn versions' hints
    limits = limits or Limits()
    protocol = guarded(import_from_string(protocols[parser]), Guard(limits))
    config = uvicorn.Config(
        server.app,
        host=host,
        port=port,
        log_level="warning",
        lifespan="off",
        http=protocol,
        timeout_graceful_shutdown=SHUTDOWN_TIMEOUT_S,
        # h11's own bound on an unfinished head (16 KiB by default) must not come before the guard's: a
        # head between the two got h11's bare 400 instead of the guard's 431, depending on how reads split
        h11_max_incomplete_event_size=limits.max_head + len(b"\r\n\r\n"),
    )
    runner = uvicorn.Server(config)

    async def main() -> None:
        task = asyncio.create_task(runner.serve())
        while not runner.started and not task.done():
            await asyncio.sleep(0.01)
        if runner.started and on_ready is not None:
            bound = runner.servers[0].sockets[0].getsockname()
            on_ready(str(bound[0]), int(bound[1]))
        await task

    try:
        asyncio.run(main())
    finally:
        server.close()


def base_name(config_path: Path) -> str:
    """The base model's id: the folder of its dialog config (e.g. `smollm2`)."""
    return config_path.resolve().parent.name or "base"
