"""The OpenAI-compatible HTTP API, served from the router process (issue 12).

    POST /v1/completions, POST /v1/chat/completions  (JSON, or SSE with "stream": true)
    GET  /v1/models, GET /health, GET /metrics

Design: one path for both APIs. Each HTTP request becomes the same GenerateRequest
the gRPC API takes (router/openai_protocol.py) and runs through the router's own
Generation handler (GenerationServicer.Generate, router/service.py) in-process,
with `HttpCallContext` standing in for the gRPC call: `abort` raises
`GenerationAborted` (its status becomes the HTTP status, OpenAI's error shape),
`write` hands each GenerateResponse to the HTTP side, `invocation_metadata` carries
the HTTP `Authorization` header as gRPC's `authorization` metadata. So validation,
admission control, routing, drain, metrics and authentication are the gRPC API's own,
with no second copy that could drift (the alternative, a gRPC client of the router's
own port, would add a hop and a serialization per token and lose the client's
address). uvicorn runs on the router's event loop (`OpenAIServer`, started and stopped
by Router.start / Router.stop), so the handler runs exactly as it does for gRPC.

Decisions:
- A generation runs in a task of its own (`Generations`), its responses queued for
  the HTTP side. The queue is unbounded: it holds at most max_tokens * n responses of
  one request (bounded by the router's limits), and the handler never waits on a slow
  HTTP client, just as gRPC's own send buffer does not stall the router.
- A client that disconnects cancels the task (as a cancelled gRPC call does): the
  dispatcher cancels the Decode call, the worker aborts the request and frees its
  blocks. Streams are watched by Starlette's disconnect listener; before the first
  chunk, and for non-streaming requests, by `_unless_disconnected`.
- A streaming request answers its HTTP status only once the first response came:
  a request refused by validation, admission or authentication gets its 400 / 429 /
  401 as a plain JSON error, never a 200 stream that carries an error. An error after
  the stream started is sent as a `data: {"error": ...}` event, then `data: [DONE]`.
- Chat without max_tokens (and max_completion_tokens) may use the rest of the
  context, as OpenAI and vLLM do: the router templates the messages once here (on
  the frontend threads, sizes checked first) to learn their length, before the
  handler runs. That templating happens before authentication; it is bounded by the
  router's input limits.
- Multiple prompts in one completions request run as one Generate each, merged;
  choice index = prompt index * n + sample index (OpenAI's numbering).
- `X-Request-Id`, when given, becomes the request id (`-i` appended for a batch);
  otherwise the router makes one. Response ids are `cmpl-<id>` / `chatcmpl-<id>`.
- Token strings in logprobs are each token decoded alone (as vLLM returns them).
- The request body is capped at `_BODY_FACTOR` times the largest valid gRPC request
  (ModelFrontend.max_request_bytes; JSON escaping makes text up to 6x longer): 413.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from pagedserve.common.api.sampling_params import InvalidRequestError
from pagedserve.router.auth import AuthError
from pagedserve.router.openai_protocol import (
    FINISH_REASONS,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    chat_request,
    completion_requests,
    validation_error,
)
from pagedserve.v1 import generation_pb2 as gen_pb

if TYPE_CHECKING:
    from pagedserve.common.runtime.tls import TLSFiles
    from pagedserve.router.server import Router

logger = logging.getLogger(__name__)
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

_BODY_FACTOR = 8
# gRPC status -> (HTTP status, OpenAI error type, OpenAI error code)
_HTTP_OF: dict[grpc.StatusCode, tuple[int, str, str | None]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", None),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error", None),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error", "timeout"),
}


# -- the gRPC context the Generation handler sees -------------------------------------


class Metadatum(NamedTuple):
    """One metadata entry, shaped as grpc.aio's (`.key`, `.value`, or unpacked)."""

    key: str
    value: str


class GenerationAborted(Exception):
    """The handler ended the call with a status (HttpCallContext.abort)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details

    def to_openai(self) -> OpenAIError:
        status, type_, code = _HTTP_OF.get(self.code, (500, "internal_error", None))
        return OpenAIError(status, self.details, type_, code=code)


def _metadata(request: Request) -> tuple[Metadatum, ...]:
    """The HTTP Authorization header as gRPC's `authorization` metadata."""
    auth = request.headers.get("authorization")
    return (Metadatum("authorization", auth),) if auth is not None else ()


class HttpCallContext:
    """What the Generation handler (router/service.py, dispatch.py, metrics.py) uses of
    a grpc.aio.ServicerContext, for a call that came over HTTP. No deadline: an HTTP
    client bounds a request by disconnecting."""

    def __init__(
        self,
        metadata: tuple[Metadatum, ...],
        peer: str,
        sink: Callable[[gen_pb.GenerateResponse], None],
    ) -> None:
        self._metadata = metadata
        self._peer = peer
        self._sink = sink
        self._code: grpc.StatusCode | None = None
        self._details = ""

    async def abort(self, code: grpc.StatusCode, details: str = "", *_: object) -> None:
        self._code, self._details = code, details
        raise GenerationAborted(code, details)

    async def write(self, message: gen_pb.GenerateResponse) -> None:
        self._sink(message)

    def time_remaining(self) -> float | None:
        return None

    def invocation_metadata(self) -> tuple[Metadatum, ...]:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def details(self) -> str:
        return self._details

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details


GenerateHandler = Callable[[gen_pb.GenerateRequest, HttpCallContext], Awaitable[None]]


@dataclass
class _Item:
    call: int
    response: gen_pb.GenerateResponse | None  # None: call `call` ended (with `error`)
    error: GenerationAborted | None = None


class Generations:
    """GenerateRequests run through the handler, one task each; iterating yields
    (request index, response) in arrival order, and raises GenerationAborted when one
    of them failed (the others are cancelled). `cancel()` ends them all."""

    def __init__(
        self,
        handler: GenerateHandler,
        requests: list[gen_pb.GenerateRequest],
        metadata: tuple[Metadatum, ...],
        peer: str,
    ) -> None:
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._open = len(requests)
        self._tasks = [
            asyncio.ensure_future(self._run(handler, i, r, metadata, peer))
            for i, r in enumerate(requests)
        ]

    async def _run(
        self,
        handler: GenerateHandler,
        i: int,
        request: gen_pb.GenerateRequest,
        metadata: tuple[Metadatum, ...],
        peer: str,
    ) -> None:
        ctx = HttpCallContext(metadata, peer, lambda r: self._queue.put_nowait(_Item(i, r)))
        error: GenerationAborted | None = None
        try:
            await handler(request, ctx)
        except GenerationAborted as e:
            error = e
        except asyncio.CancelledError:
            error = GenerationAborted(grpc.StatusCode.CANCELLED, "the client disconnected")
            raise
        except Exception as e:  # a bug: answered 500, logged with its traceback
            logger.exception("the Generation handler failed on an HTTP request")
            error = GenerationAborted(grpc.StatusCode.INTERNAL, f"internal error: {e!r}")
        finally:
            self._queue.put_nowait(_Item(i, None, error))

    def __aiter__(self) -> Generations:
        return self

    async def __anext__(self) -> tuple[int, gen_pb.GenerateResponse]:
        while self._open:
            item = await self._queue.get()
            if item.response is not None:
                return item.call, item.response
            self._open -= 1
            if item.error is not None:
                self.cancel()
                self._open = 0
                raise item.error
        raise StopAsyncIteration

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()


class _ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (call after the body was read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; if the client disconnects first, cancels it and raises
    _ClientGone (the caller then cancels its generations)."""
    work_task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work_task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work_task.done():  # the client left (or we were cancelled ourselves)
            work_task.cancel()
    if not work_task.done():
        raise _ClientGone
    return work_task.result()


# -- formatting -----------------------------------------------------------------------


@dataclass
class _Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[gen_pb.TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text_offset: int = 0  # completions' logprobs.text_offset, across stream chunks


@dataclass
class _Usage:
    prompt: dict[int, int] = field(default_factory=dict)  # request index -> its prompt
    cached: dict[int, int] = field(default_factory=dict)
    completion: int = 0

    def add(self, call: int, r: gen_pb.GenerateResponse) -> None:
        if r.HasField("usage"):  # a sample's last message
            self.prompt[call] = r.usage.prompt_tokens
            self.cached[call] = r.usage.cached_tokens
            self.completion += r.usage.completion_tokens

    def as_dict(self) -> dict[str, Any]:
        prompt = sum(self.prompt.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion,
            "total_tokens": prompt + self.completion,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached.values())},
        }


def _stop_reason(r: gen_pb.GenerateResponse) -> str | int | None:
    which = r.WhichOneof("stop_matched")
    return getattr(r, which) if which is not None else None


def _sse(obj: object) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class _Format:
    """The response shapes of one endpoint (completions or chat)."""

    object_final = ""
    object_chunk = ""
    id_prefix = ""

    def __init__(self, api: OpenAIAPI, n: int, top_logprobs: int, token_ids: bool = False) -> None:
        self.api = api
        self.n = n
        self.top = top_logprobs
        self.token_ids = token_ids  # vLLM's return_token_ids
        self.created = int(time.time())
        self.id = ""
        self.choices: dict[int, _Choice] = {}

    def choice(self, call: int, r: gen_pb.GenerateResponse) -> _Choice:
        if not self.id:
            self.id = f"{self.id_prefix}{r.request_id}"
        index = call * self.n + r.index
        return self.choices.setdefault(index, _Choice(index))

    def envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.api.model_name,
            "choices": choices,
        }

    def chunk(self, call: int, r: gen_pb.GenerateResponse) -> dict[str, Any] | None:
        raise NotImplementedError

    def final(self, usage: _Usage) -> dict[str, Any]:
        body = self.envelope(
            self.object_final, [self.final_choice(self.choices[i]) for i in sorted(self.choices)]
        )
        body["usage"] = usage.as_dict()
        return body

    def final_choice(self, c: _Choice) -> dict[str, Any]:
        raise NotImplementedError

    def add(self, call: int, r: gen_pb.GenerateResponse) -> _Choice:
        """Accumulates a response into its choice (non-streaming)."""
        c = self.choice(call, r)
        c.text += r.text
        c.token_ids.extend(r.token_ids)
        c.logprobs.extend(r.logprobs)
        if r.finish_reason:
            c.finish_reason = FINISH_REASONS.get(r.finish_reason, "stop")
            c.stop_reason = _stop_reason(r)
        return c

    def with_ids(self, choice: dict[str, Any], ids: list[int]) -> dict[str, Any]:
        if self.token_ids:
            choice["token_ids"] = ids
        return choice

    def usage_chunk(self, usage: _Usage) -> dict[str, Any]:
        body = self.envelope(self.object_chunk, [])
        body["usage"] = usage.as_dict()
        return body


class _CompletionFormat(_Format):
    object_final = object_chunk = "text_completion"
    id_prefix = "cmpl-"

    def logprobs(self, c: _Choice, lps: list[gen_pb.TokenLogprobs]) -> dict[str, Any] | None:
        if self.top < 0:
            return None
        tokens, offsets = [], []
        for lp in lps:
            text = self.api.token_text(lp.token_id)
            tokens.append(text)
            offsets.append(c.text_offset)
            c.text_offset += len(text)
        tops = []
        for lp, text in zip(lps, tokens, strict=True):
            top = {self.api.token_text(t.token_id): t.logprob for t in lp.top[: self.top]}
            top.setdefault(text, lp.logprob)
            tops.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def chunk(self, call: int, r: gen_pb.GenerateResponse) -> dict[str, Any] | None:
        c = self.choice(call, r)
        if not (r.text or r.finish_reason or (r.token_ids and (self.top >= 0 or self.token_ids))):
            return None
        finish = FINISH_REASONS.get(r.finish_reason) if r.finish_reason else None
        choice = {"index": c.index, "text": r.text, "logprobs": self.logprobs(c, list(r.logprobs))}
        choice.update(finish_reason=finish, stop_reason=_stop_reason(r))
        return self.envelope(self.object_chunk, [self.with_ids(choice, list(r.token_ids))])

    def final_choice(self, c: _Choice) -> dict[str, Any]:
        choice = {"index": c.index, "text": c.text, "logprobs": self.logprobs(c, c.logprobs)}
        choice.update(finish_reason=c.finish_reason, stop_reason=c.stop_reason)
        return self.with_ids(choice, c.token_ids)


class _ChatFormat(_Format):
    object_final = "chat.completion"
    object_chunk = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def logprobs(self, lps: list[gen_pb.TokenLogprobs]) -> dict[str, Any] | None:
        if self.top < 0:
            return None

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.api.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        content = []
        for lp in lps:
            e = entry(lp.token_id, lp.logprob)
            e["top_logprobs"] = [entry(t.token_id, t.logprob) for t in lp.top[: self.top]]
            content.append(e)
        return {"content": content}

    def chunk(self, call: int, r: gen_pb.GenerateResponse) -> dict[str, Any] | None:
        first = call * self.n + r.index not in self.choices
        c = self.choice(call, r)
        # A choice's first chunk carries the assistant role (as OpenAI streams it).
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        if not (
            first
            or r.text
            or r.finish_reason
            or (r.token_ids and (self.top >= 0 or self.token_ids))
        ):
            return None
        finish = FINISH_REASONS.get(r.finish_reason) if r.finish_reason else None
        if r.text:
            delta["content"] = r.text
        choice = {
            "index": c.index,
            "delta": delta,
            "logprobs": self.logprobs(list(r.logprobs)) if r.logprobs else None,
            "finish_reason": finish,
            "stop_reason": _stop_reason(r),
        }
        return self.envelope(self.object_chunk, [self.with_ids(choice, list(r.token_ids))])

    def final_choice(self, c: _Choice) -> dict[str, Any]:
        choice = {
            "index": c.index,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": self.logprobs(c.logprobs),
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        return self.with_ids(choice, c.token_ids)


# -- the API --------------------------------------------------------------------------


class OpenAIAPI:
    """The endpoints, over one router (called on the router's loop)."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.frontend = router.frontend
        self.model_name: str = router.frontend.model_name
        self.created = int(time.time())
        self.handler: GenerateHandler = router._generation_servicer().Generate
        self.max_body_bytes = _BODY_FACTOR * self.frontend.max_request_bytes()
        self.token_text = functools.lru_cache(maxsize=1 << 16)(self._decode_one)

    def _decode_one(self, token_id: int) -> str:
        return self.frontend.tokenizer.decode([token_id])

    # -- endpoints ----------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        self._authenticate(request)
        body = await self._parse(request, CompletionRequest)
        self._check_model(body.model)
        reqs = completion_requests(body)
        self._set_request_ids(request, reqs)
        top = body.logprobs if body.logprobs is not None else -1
        fmt = _CompletionFormat(self, body.n or 1, top, body.return_token_ids)
        return await self._respond(request, reqs, fmt, body.stream, body.include_usage)

    async def chat_completions(self, request: Request) -> Response:
        self._authenticate(request)  # before the chat template runs for max_tokens
        body = await self._parse(request, ChatCompletionRequest)
        self._check_model(body.model)
        req = chat_request(body)
        if not req.sampling.HasField("max_tokens"):
            req.sampling.max_tokens = await self._rest_of_context(req)
        self._set_request_ids(request, [req])
        top = (body.top_logprobs or 0) if body.logprobs else -1
        fmt = _ChatFormat(self, body.n or 1, top, body.return_token_ids)
        return await self._respond(request, [req], fmt, body.stream, body.include_usage)

    async def models(self, request: Request) -> Response:
        self._authenticate(request)  # as gRPC's GetModelInfo (and vLLM's /v1/*)
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "pagedserve",
            "root": self.model_name,
            "max_model_len": self.frontend.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, request: Request) -> Response:
        """200 while the router takes requests (a decode worker is live, not draining)."""
        if self.router.draining:
            raise OpenAIError(503, "router is shutting down", "service_unavailable_error")
        if not self.router.registry.candidates("decode"):
            raise OpenAIError(503, "no live decode worker", "service_unavailable_error")
        return Response(status_code=200)

    async def metrics(self, request: Request) -> Response:
        return Response(
            generate_latest(self.router.metrics.registry), media_type=CONTENT_TYPE_LATEST
        )

    # -- helpers ------------------------------------------------------------------------

    async def _parse(self, request: Request, model: type[M]) -> M:
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > self.max_body_bytes:
                raise OpenAIError(
                    413, f"the request body is larger than {self.max_body_bytes} bytes"
                )
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise OpenAIError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise OpenAIError(400, "the request body must be a JSON object")
        try:
            return model.model_validate(data)
        except ValidationError as e:
            raise validation_error(e.errors()) from None

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise OpenAIError(
                404,
                f"The model `{model}` does not exist: this server serves `{self.model_name}` "
                "(GET /v1/models)",
                param="model",
                code="model_not_found",
            )

    @staticmethod
    def _set_request_ids(request: Request, reqs: list[gen_pb.GenerateRequest]) -> None:
        rid = request.headers.get("x-request-id")
        if not rid:
            return
        for i, r in enumerate(reqs):
            r.request_id = rid if len(reqs) == 1 else f"{rid}-{i}"

    async def _rest_of_context(self, req: gen_pb.GenerateRequest) -> int:
        """Chat without max_tokens: the context left after the templated prompt."""
        try:
            self.frontend.check_sizes(req)
            ids = await self.router.routing.off_loop(self.frontend.chat_ids, req.messages.messages)
        except InvalidRequestError as e:
            raise OpenAIError(400, str(e)) from None
        return max(1, self.frontend.max_model_len - len(ids))

    def _authenticate(self, request: Request) -> None:
        """The API key check of the gRPC API (router/auth.py), first thing on every /v1
        route: 401 before the body is parsed. The Generation handler checks it again for
        the calls it runs (one code path for both APIs); /health and /metrics stay open,
        as vLLM's do."""
        try:
            self.router.dispatcher.auth.authenticate(_metadata(request))
        except AuthError as e:
            self.router.counters["unauthenticated"] += 1
            raise OpenAIError(401, str(e), "authentication_error") from None

    def _start(self, request: Request, reqs: list[gen_pb.GenerateRequest]) -> Generations:
        metadata = _metadata(request)
        client = request.client
        peer = f"http:{client.host}:{client.port}" if client else "http:unknown"
        return Generations(self.handler, reqs, metadata, peer)

    async def _respond(
        self,
        request: Request,
        reqs: list[gen_pb.GenerateRequest],
        fmt: _Format,
        stream: bool,
        include_usage: bool,
    ) -> Response:
        gens = self._start(request, reqs)
        try:
            if not stream:
                return JSONResponse(await _unless_disconnected(request, self._collect(gens, fmt)))
            first = await _unless_disconnected(request, anext(gens, None))
        except GenerationAborted as e:
            raise e.to_openai() from None
        except BaseException:  # the client left (_ClientGone), or a bug: end the work
            gens.cancel()
            raise
        return StreamingResponse(
            self._stream(gens, fmt, first, include_usage), media_type="text/event-stream"
        )

    async def _collect(self, gens: Generations, fmt: _Format) -> dict[str, Any]:
        usage = _Usage()
        try:
            async for call, r in gens:
                usage.add(call, r)
                fmt.add(call, r)
        finally:
            gens.cancel()
        return fmt.final(usage)

    async def _stream(
        self,
        gens: Generations,
        fmt: _Format,
        first: tuple[int, gen_pb.GenerateResponse] | None,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        usage = _Usage()
        try:
            item = first
            while item is not None:
                call, r = item
                usage.add(call, r)
                chunk = fmt.chunk(call, r)
                if chunk is not None:
                    yield _sse(chunk)
                item = await anext(gens, None)
            if include_usage:
                yield _sse(fmt.usage_chunk(usage))
        except GenerationAborted as e:  # after the stream started: an error event
            err = e.to_openai()
            yield _sse(err.body())
        finally:
            gens.cancel()
        yield "data: [DONE]\n\n"


# -- the app and its server -----------------------------------------------------------


def create_app(router: Router) -> FastAPI:
    api = OpenAIAPI(router)
    app = FastAPI(title="pagedserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/metrics", api.metrics, methods=["GET"])

    async def openai_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, OpenAIError)
        return JSONResponse(exc.body(), status_code=exc.status)

    async def client_gone(request: Request, exc: Exception) -> Response:
        return Response(status_code=499)  # nobody reads it

    app.add_exception_handler(OpenAIError, openai_error)
    app.add_exception_handler(_ClientGone, client_gone)
    return app


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # The router owns SIGTERM / SIGINT (router/server.py `serve`): it drains both APIs.
        yield


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket of our own, so a taken port raises OSError here (uvicorn
    would log and sys.exit) and port 0 tells us which port it got."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as e:
        raise OSError(e.errno, f"cannot listen for HTTP on {host}:{port}: {e.strerror}") from e


class OpenAIServer:
    """uvicorn serving `create_app(router)` on the router's loop (bind, start, stop;
    Router.start binds before anything else serves, so a taken port fails early)."""

    def __init__(self, router: Router, host: str, port: int, tls: TLSFiles | None = None) -> None:
        self.router = router
        self.host = host
        self.port = port
        # The public port's certificate (RouterConfig.public_tls): HTTPS with the same
        # files as the gRPC port, so nothing public is served in plaintext beside TLS.
        self.tls = tls
        self.scheme = "https" if tls is not None else "http"
        self.address = ""
        self._socket: socket.socket | None = None
        self._server: _Uvicorn | None = None
        self._task: asyncio.Task | None = None

    def bind(self) -> None:
        """Takes the port now (OSError naming it if taken); `start` serves it."""
        if self._socket is None:
            self._socket = _bind(self.host, self.port)

    async def start(self) -> str:
        self.bind()
        sock = self._socket
        assert sock is not None
        port = sock.getsockname()[1]
        config = uvicorn.Config(
            create_app(self.router),
            lifespan="off",
            log_config=None,  # leave the process's logging alone
            access_log=False,
            timeout_graceful_shutdown=2,
            ssl_certfile=self.tls.certfile if self.tls else None,
            ssl_keyfile=self.tls.keyfile if self.tls else None,
        )
        server = _Uvicorn(config)
        self._server = server
        self._task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started:
            if self._task.done():
                sock.close()
                self._task.result()  # raises what stopped it
                raise RuntimeError("the HTTP server exited while starting")
            await asyncio.sleep(0.01)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.address = f"{host}:{port}"
        logger.info("OpenAI-compatible API on %s://%s/v1", self.scheme, self.address)
        return self.address

    async def stop(self) -> None:
        """Closes the listener and the idle connections (Router.stop drains the
        generations first, so no stream is cut here)."""
        if self._server is None or self._task is None:  # bound, never served
            if self._socket is not None:
                self._socket.close()
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(self._task, timeout=10)
        except Exception as e:
            logger.warning("the HTTP server did not stop cleanly: %r", e)
        self._server = None
