"""The router's gRPC servicers: Generation (the public API) and the worker Registry.

Requests that are not valid protobuf (a string field with bad UTF-8) are answered
INVALID_ARGUMENT, not gRPC's UNKNOWN (`_lenient`); requests larger than the largest
valid one (ModelFrontend.max_request_bytes) are refused by gRPC itself with
RESOURCE_EXHAUSTED before they are parsed (router/server.py sets the limit).

Authentication comes first on the public API: both Generation methods map the call's
`authorization: Bearer <key>` metadata to a tenant (router/auth.py) before anything
else, and end a call without a valid key UNAUTHENTICATED (counted as
"unauthenticated"), so such a call costs no tokenizing, admission or model work.

The servicers hold no routing state: Generate runs router/dispatch.py's
`Dispatcher.generate` for the caller's tenant under the router's drain (`Drain`:
router/server.py `Router.drain` sets it), the Registry feeds heartbeats and goodbyes
to the worker registry.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
from google.protobuf.message import DecodeError

from pagedserve.router.auth import Authenticator, AuthError, Tenant
from pagedserve.router.dispatch import Undecodable
from pagedserve.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)
T = TypeVar("T")

SHUTTING_DOWN = "router is shutting down"  # UNAVAILABLE while draining (Router.drain)

GenerateFn = Callable[
    [generation_pb2.GenerateRequest | Undecodable, grpc.aio.ServicerContext, Tenant],
    AsyncIterator[generation_pb2.GenerateResponse],
]


@dataclass
class Drain:
    """Graceful shutdown as the Generate handlers see it (Router.drain changes it):
    whether admission is closed, the handlers in flight, and, once the grace period is
    over, the message their cancellation ends them with (UNAVAILABLE, not CANCELLED)."""

    draining: bool = False
    streams: set[asyncio.Task] = field(default_factory=set)
    cut_message: str | None = None


def _lenient(parse: Callable[[bytes], T]) -> Callable[[bytes], T | Undecodable]:
    """A deserializer that hands parse errors to the handler instead of raising.

    gRPC answers a raising deserializer with UNKNOWN; the handler answers an
    Undecodable with INVALID_ARGUMENT, which is what it is.
    """

    def deserialize(data: bytes) -> T | Undecodable:
        try:
            return parse(data)
        except DecodeError as e:
            return Undecodable(str(e))

    return deserialize


def add_generation_service(servicer: GenerationServicer, server: grpc.aio.Server) -> None:
    """generation_pb2_grpc.add_GenerationServicer_to_server, with `_lenient` parsing."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=_lenient(generation_pb2.GenerateRequest.FromString),
            response_serializer=generation_pb2.GenerateResponse.SerializeToString,
        ),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetModelInfo,
            request_deserializer=generation_pb2.GetModelInfoRequest.FromString,
            response_serializer=generation_pb2.ModelInfo.SerializeToString,
        ),
    }
    name = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """`generate`: the request's responses for a tenant (Dispatcher.generate, counted by
    the metrics); `model_info`: GetModelInfo's answer now; `auth`: who may call (an open
    one lets everybody in); `counters` gets "refused_draining" and "unauthenticated"."""

    def __init__(
        self,
        generate: GenerateFn,
        model_info: Callable[[], generation_pb2.ModelInfo],
        drain: Drain,
        counters: collections.Counter[str],
        auth: Authenticator,
    ) -> None:
        self.generate = generate
        self.model_info = model_info
        self.drain = drain
        self.counters = counters
        self.auth = auth

    async def authenticate(self, context: grpc.aio.ServicerContext) -> Tenant:
        """The caller's tenant; a missing or wrong key ends the call UNAUTHENTICATED."""
        try:
            return self.auth.authenticate(context.invocation_metadata())
        except AuthError as e:
            self.counters["unauthenticated"] += 1
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))
            raise  # abort raises; this only keeps a context whose abort returns honest

    async def Generate(self, request, context):  # noqa: N802 (gRPC method name)
        tenant = await self.authenticate(context)  # first: before the request is looked at
        drain = self.drain
        if drain.draining:  # admission is closed: nothing was done, another replica can
            self.counters["refused_draining"] += 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{SHUTTING_DOWN}; retry elsewhere")
        task = asyncio.current_task()
        assert task is not None
        drain.streams.add(task)
        responses = self.generate(request, context, tenant)
        # context.write, not yield: a drain that cancels this task past its grace period
        # interrupts the write here, where it can end the call UNAVAILABLE.
        try:
            async with contextlib.aclosing(responses) as responses:
                async for response in responses:
                    await context.write(response)
        except asyncio.CancelledError:
            if drain.cut_message is None:
                raise  # the client left
            await context.abort(grpc.StatusCode.UNAVAILABLE, drain.cut_message)
        finally:
            drain.streams.discard(task)

    async def GetModelInfo(self, request, context):  # noqa: N802
        await self.authenticate(context)
        return self.model_info()


class RegistryServicer(worker_pb2_grpc.RegistryServicer):
    """`heartbeat` records a worker's stats (ValueError: refused); `goodbye` drops one."""

    def __init__(
        self,
        heartbeat: Callable[[worker_pb2.WorkerStats], worker_pb2.HeartbeatResponse | None],
        goodbye: Callable[[str], None],
    ) -> None:
        self.heartbeat = heartbeat
        self.goodbye = goodbye

    async def Heartbeat(self, request, context):  # noqa: N802
        try:
            response = self.heartbeat(request.stats)
        except ValueError as e:
            logger.warning("heartbeat refused: %s", e)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        # The live peers (the worker's trusted KV sources); the prefix index asks for
        # resyncs itself (a publisher's batch answered GAP): nothing else to say here.
        return response if response is not None else worker_pb2.HeartbeatResponse()

    async def Goodbye(self, request, context):  # noqa: N802
        self.goodbye(request.worker_id)
        return worker_pb2.GoodbyeResponse()
