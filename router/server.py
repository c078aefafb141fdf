"""The router: the public gRPC server in front of the prefill and decode pools.

Generate, step by step (`_serve`):
  1. validate and tokenize (ModelFrontend) -> INVALID_ARGUMENT with the engine's message;
  2. admission control -> RESOURCE_EXHAUSTED at once when running + queued are full;
  3. Prefill on the least-loaded prefill worker, unless the prompt is shorter than
     `disagg_min_prompt_tokens` (conditional disaggregation) or no prefill worker is
     live. UNAVAILABLE marks that worker down and retries once on another; after
     that (or on any other failure but a bad request or the deadline) the decode
     worker prefills locally;
  4. Decode on the least-loaded decode worker, with the KV handle, relaying every
     DecodeStep's response. UNAVAILABLE before anything was streamed marks the worker
     down and retries on another (prefilling there: the handle may be spent); after
     something was streamed the stream ends with UNAVAILABLE.

The client's deadline bounds every downstream call (`time_remaining`). A client that
cancels or disconnects cancels this handler's task: the open downstream call is
cancelled with it (the decode worker aborts the request and frees its blocks), and a
KV handle obtained but not yet consumed by a decode worker has its lease released.
One gap remains by design: a Prefill response in flight when the client leaves is
never seen here; its lease expires after the TTL (counted by the worker).

Also served: the worker Registry (heartbeats), grpc.health.v1 (overall "" and per pool
"pagedserve.prefill" / "pagedserve.decode") and server reflection.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagedserve.common.sampling_params import InvalidRequestError
from pagedserve.common.worker import GRPC_OPTIONS
from pagedserve.router.admission import Admission, AdmissionRejected
from pagedserve.router.config import RouterConfig
from pagedserve.router.frontend import ModelFrontend, ResolvedRequest
from pagedserve.router.policy import LeastLoadedPolicy, RouteRequest, RoutingPolicy
from pagedserve.router.registry import WorkerInfo, WorkerRegistry
from pagedserve.v1 import (
    generation_pb2,
    generation_pb2_grpc,
    kvtransfer_pb2,
    worker_pb2,
    worker_pb2_grpc,
)

__all__ = ["Router", "RouterConfig", "RouterHandle", "serve", "start_router_in_thread"]
logger = logging.getLogger(__name__)
T = TypeVar("T")

HEALTH_PREFILL = "pagedserve.prefill"
HEALTH_DECODE = "pagedserve.decode"
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_POLICY_PB = {
    None: worker_pb2.TRANSFER_FAILURE_POLICY_UNSPECIFIED,
    "recompute": worker_pb2.TRANSFER_FAILURE_POLICY_RECOMPUTE,
    "fail": worker_pb2.TRANSFER_FAILURE_POLICY_FAIL,
}
# Downstream codes passed to the client as they are. CANCELLED from a worker (it shut
# down, or aborted the request itself; our own client's cancel never gets here) is a
# worker failure to the client: UNAVAILABLE. Anything else becomes INTERNAL.
_PASS_THROUGH = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE,
}
# A decode worker refusing a request because its KV import failed under the "fail"
# policy answers UNAVAILABLE with this prefix; the worker is fine, so no retry.
_IMPORT_FAILED = "KV import failed"


class _Abort(Exception):
    """End the client's call with this status (raised inside the request path)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Router:
    """Owns the server, the registry, admission control and the routing policy.

    Everything runs on one asyncio loop; `start_router_in_thread` gives sync code one.
    """

    def __init__(
        self,
        config: RouterConfig,
        policy: RoutingPolicy | None = None,
        frontend: ModelFrontend | None = None,
    ) -> None:
        self.config = config
        self.frontend = frontend or ModelFrontend(config)
        self.registry = WorkerRegistry(config.worker_timeout_s)
        self.policy = policy or LeastLoadedPolicy(config.load_weights)
        self.admission = Admission(config.max_inflight, config.max_queued)
        self.counters: collections.Counter[str] = collections.Counter()
        self.active_requests: set[str] = set()
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.address = ""
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._background: set[asyncio.Task] = set()
        self._stopped: asyncio.Event | None = None
        self._sweeper: asyncio.Task | None = None
        self.registry.listeners.append(self._on_membership_change)

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> str:
        """Binds and starts serving; returns host:port."""
        self._stopped = asyncio.Event()
        self._health_lock = asyncio.Lock()
        server = grpc.aio.server(options=GRPC_OPTIONS)
        generation_pb2_grpc.add_GenerationServicer_to_server(_GenerationServicer(self), server)
        worker_pb2_grpc.add_RegistryServicer_to_server(_RegistryServicer(self), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = (
            generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
            worker_pb2.DESCRIPTOR.services_by_name["Registry"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(names, server)
        port = server.add_insecure_port(self.config.address)
        if port == 0:
            raise OSError(f"cannot listen on {self.config.address}")
        self.address = f"{self.config.host}:{port}"
        await server.start()
        self.server = server
        await self._update_health()
        self._sweeper = asyncio.create_task(self._sweep_loop())
        logger.info("router serving %s on %s", self.frontend.model_name, self.address)
        return self.address

    async def stop(self, grace: float = 1.0) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        await self.health.enter_graceful_shutdown()
        if self.server is not None:
            await self.server.stop(grace)
        if self._background:
            await asyncio.wait(self._background, timeout=grace + 1)
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
        if self._stopped is not None:
            self._stopped.set()

    async def wait_stopped(self) -> None:
        assert self._stopped is not None, "start() first"
        await self._stopped.wait()

    async def _sweep_loop(self) -> None:
        period = min(0.5, self.config.worker_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            self.registry.sweep()

    # -- workers ------------------------------------------------------------------------

    def channel(self, address: str) -> grpc.aio.Channel:
        """One channel per worker address, kept for the router's life (gRPC reconnects)."""
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
        return ch

    def _on_membership_change(self) -> None:
        self._spawn(self._update_health())

    async def _update_health(self) -> None:
        async with self._health_lock:  # in order: the last update reads the latest state
            prefill = bool(self.registry.candidates("prefill"))
            decode = bool(self.registry.candidates("decode"))
            await self.health.set(HEALTH_PREFILL, _SERVING if prefill else _NOT_SERVING)
            await self.health.set(HEALTH_DECODE, _SERVING if decode else _NOT_SERVING)
            # The router can answer requests whenever a decode worker is live (it
            # prefills locally without prefill workers).
            await self.health.set("", _SERVING if decode else _NOT_SERVING)

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def pick(self, role: str, rr: RouteRequest, exclude: set[str]) -> WorkerInfo | None:
        """The policy's best live worker for `role`, minus `exclude`; logs the inputs."""
        ranked = self.policy.rank(role, rr, self.registry.candidates(role, exclude))
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "route %s %s prompt_tokens=%d excluded=%s candidates=%s -> %s",
                rr.request_id,
                role,
                len(rr.prompt_token_ids),
                sorted(exclude),
                [(s.worker.worker_id, round(s.score, 3), s.inputs) for s in ranked],
                ranked[0].worker.worker_id if ranked else None,
            )
        return ranked[0].worker if ranked else None

    # -- Generate -----------------------------------------------------------------------

    async def generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        self.counters["requests"] += 1
        try:
            resolved = self.frontend.resolve(request)
            if resolved.request_id in self.active_requests:
                raise InvalidRequestError(
                    f"request_id {resolved.request_id!r} is already in flight"
                )
        except InvalidRequestError as e:
            self.counters["invalid"] += 1
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self.active_requests.add(resolved.request_id)  # queued ones count: ids stay unique
        try:
            await self.admission.acquire()
        except AdmissionRejected as e:
            self.active_requests.discard(resolved.request_id)
            self.counters["rejected"] += 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except BaseException:  # cancelled while queued
            self.active_requests.discard(resolved.request_id)
            raise
        try:
            async with contextlib.aclosing(self._serve(resolved, context)) as responses:
                async for response in responses:
                    yield response
        except _Abort as e:
            await context.abort(e.code, e.message)
        finally:
            self.active_requests.discard(resolved.request_id)
            self.admission.release()

    async def _serve(
        self, r: ResolvedRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        rr = RouteRequest(r.request_id, r.prompt_token_ids, r.cache_salt)
        handle = await self._prefill(r, rr, context)
        lease_open = handle is not None and bool(handle.lease_id)
        tried: set[str] = set()
        streamed = 0
        try:
            while True:
                worker = self.pick("decode", rr, tried)
                if worker is None:
                    raise _Abort(grpc.StatusCode.UNAVAILABLE, _no_worker_message("decode", tried))
                tried.add(worker.worker_id)
                req = worker_pb2.DecodeRequest(
                    request=r.tokenized,
                    kv=handle,
                    on_transfer_failure=_POLICY_PB[self.config.transfer_failure_policy],
                )
                stub = worker_pb2_grpc.DecodeStub(self.channel(worker.address))
                call = stub.Decode(req, timeout=context.time_remaining())
                worker.inflight += 1
                try:
                    async for step in call:
                        lease_open = False  # the first step comes after the import ended
                        streamed += 1
                        yield step.response
                    return
                except grpc.aio.AioRpcError as e:
                    if not self._decode_retryable(e, worker, streamed):
                        raise _downstream_abort(e, "decode", worker, streamed) from None
                    self.counters["decode_retries"] += 1
                    if lease_open:  # the next worker prefills locally: the handle may be spent
                        self._release_lease(handle)
                        lease_open = False
                    handle = None
                finally:
                    worker.inflight -= 1
                    call.cancel()  # no-op when done; aborts the request downstream otherwise
        finally:
            if lease_open:
                self._release_lease(handle)

    def _decode_retryable(self, e: grpc.aio.AioRpcError, worker: WorkerInfo, streamed: int) -> bool:
        """UNAVAILABLE from a dead worker: mark it down; retry if nothing was streamed."""
        if e.code() != grpc.StatusCode.UNAVAILABLE or e.details().startswith(_IMPORT_FAILED):
            return False
        self.registry.mark_down(worker, f"Decode failed with UNAVAILABLE: {e.details()}")
        return streamed == 0

    async def _prefill(
        self, r: ResolvedRequest, rr: RouteRequest, context: grpc.aio.ServicerContext
    ) -> kvtransfer_pb2.KVHandle | None:
        """A KV handle from a prefill worker, or None: the decode worker prefills locally."""
        if r.prompt_len < self.config.disagg_min_prompt_tokens:
            logger.debug(
                "route %s: %d prompt tokens < disagg_min_prompt_tokens %d: local prefill",
                r.request_id,
                r.prompt_len,
                self.config.disagg_min_prompt_tokens,
            )
            self.counters["local_prefill_short"] += 1
            return None
        req = worker_pb2.PrefillRequest(request=r.tokenized)
        if self.config.lease_ttl_ms is not None:
            req.lease_ttl_ms = self.config.lease_ttl_ms
        tried: set[str] = set()
        for _attempt in range(2):  # the first choice, then one retry elsewhere
            worker = self.pick("prefill", rr, tried)
            if worker is None:
                break
            tried.add(worker.worker_id)
            stub = worker_pb2_grpc.PrefillStub(self.channel(worker.address))
            worker.inflight += 1
            try:
                handle = await stub.Prefill(req, timeout=context.time_remaining())
                self.counters["prefill_calls"] += 1
                return handle
            except grpc.aio.AioRpcError as e:
                code = e.code()
                if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise _downstream_abort(e, "prefill", worker, 0) from None
                if code != grpc.StatusCode.UNAVAILABLE:
                    logger.warning(
                        "Prefill of %s on %s failed (%s: %s): prefilling on the decode worker",
                        r.request_id,
                        worker.worker_id,
                        code.name,
                        e.details(),
                    )
                    break
                self.registry.mark_down(worker, f"Prefill failed with UNAVAILABLE: {e.details()}")
                self.counters["prefill_retries"] += 1
            finally:
                worker.inflight -= 1
        self.counters["local_prefill_fallback"] += 1
        return None

    def _release_lease(self, handle: kvtransfer_pb2.KVHandle | None) -> None:
        """Ends an unconsumed lease off the request's path (best effort: leases expire)."""
        if handle is None or not handle.lease_id:
            return

        async def run() -> None:
            stub = worker_pb2_grpc.PrefillStub(self.channel(handle.transfer_address))
            try:
                await stub.ReleaseLease(
                    worker_pb2.ReleaseLeaseRequest(lease_id=handle.lease_id), timeout=5.0
                )
                self.counters["leases_released"] += 1
            except grpc.aio.AioRpcError as e:
                logger.info("releasing lease %s failed: %s", handle.lease_id, e.code().name)

        self._spawn(run())

    # -- Registry ----------------------------------------------------------------------

    def heartbeat(self, stats: worker_pb2.WorkerStats) -> None:
        """Records a heartbeat; raises ValueError for a worker of another model."""
        name = stats.model_name.split("@", 1)[0]
        if name != self.frontend.model_name:
            raise ValueError(
                f"worker {stats.worker_id!r} serves {stats.model_name!r}, this router "
                f"serves {self.frontend.model_name!r}: not registered"
            )
        self.registry.heartbeat(stats)


def _no_worker_message(role: str, tried: set[str]) -> str:
    if tried:
        return f"no live {role} worker left to serve the request (tried {sorted(tried)})"
    return f"no live {role} worker: the {role} pool is empty or every worker is down"


def _downstream_abort(
    e: grpc.aio.AioRpcError, role: str, worker: WorkerInfo, streamed: int
) -> _Abort:
    code = e.code()
    if code == grpc.StatusCode.CANCELLED:
        code = grpc.StatusCode.UNAVAILABLE
    elif code not in _PASS_THROUGH:
        code = grpc.StatusCode.INTERNAL
    where = f"{role} worker {worker.worker_id}"
    if streamed:
        where += f" (after {streamed} streamed messages)"
    return _Abort(code, f"{where}: {e.details()}")


class _GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, router: Router) -> None:
        self.router = router

    async def Generate(self, request, context):  # noqa: N802 (gRPC method name)
        # grpc.aio needs an async generator function here, not one returning a generator.
        async with contextlib.aclosing(self.router.generate(request, context)) as responses:
            async for response in responses:
                yield response

    async def GetModelInfo(self, request, context):  # noqa: N802
        return self.router.frontend.model_info(self.router.registry.block_size())


class _RegistryServicer(worker_pb2_grpc.RegistryServicer):
    def __init__(self, router: Router) -> None:
        self.router = router

    async def Heartbeat(self, request, context):  # noqa: N802
        try:
            self.router.heartbeat(request.stats)
        except ValueError as e:
            logger.warning("heartbeat refused: %s", e)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        # resync_needed stays false until the prefix index (issue 6) follows events.
        return worker_pb2.HeartbeatResponse()

    async def Goodbye(self, request, context):  # noqa: N802
        self.router.registry.goodbye(request.worker_id)
        return worker_pb2.GoodbyeResponse()


# -- running from sync code ------------------------------------------------------------


class RouterHandle:
    """A router on its own thread and event loop (for the launcher and tests)."""

    def __init__(self, router: Router, loop: asyncio.AbstractEventLoop, thread: threading.Thread):
        self.router = router
        self.loop = loop
        self.thread = thread

    @property
    def address(self) -> str:
        return self.router.address

    def call(self, fn: Callable[[Router], T], timeout: float = 10.0) -> T:
        """Runs `fn(router)` on the router's loop (state is only touched there)."""

        async def run() -> T:
            return fn(self.router)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def live_worker_ids(self) -> list[str]:
        """Ids of the workers the router routes to now."""
        return self.call(lambda r: sorted(w.worker_id for w in r.registry.workers()))

    def stop(self, grace: float = 1.0) -> None:
        if not self.thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self.router.stop(grace), self.loop).result(grace + 10)
        self.thread.join(10)

    def __enter__(self) -> RouterHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_router_in_thread(
    config: RouterConfig, policy: RoutingPolicy | None = None
) -> RouterHandle:
    """Loads the tokenizer, starts the router on a new thread, returns once it serves."""
    router = Router(config, policy)
    started: concurrent.futures.Future[asyncio.AbstractEventLoop] = concurrent.futures.Future()

    def run() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(router.start())
        except BaseException as e:
            started.set_exception(e)
            loop.close()
            return
        started.set_result(loop)
        try:
            loop.run_until_complete(router.wait_stopped())
        finally:
            loop.close()

    thread = threading.Thread(target=run, name="router", daemon=True)
    thread.start()
    loop = started.result(timeout=60)
    return RouterHandle(router, loop, thread)


async def serve(config: RouterConfig, policy: RoutingPolicy | None = None) -> None:
    """Runs a router until cancelled (python -m pagedserve.router)."""
    router = Router(config, policy)
    await router.start()
    try:
        await router.wait_stopped()
    finally:
        await router.stop()
