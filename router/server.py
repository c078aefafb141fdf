"""The router's server: `Router` (its parts, lifecycle, health) and running it.

`Router` owns the gRPC server and puts the router's parts together, each in a module
of its own:
  - router/dispatch.py: one Generate request's path (checks, admission, route,
    Prefill, Decode, leases), with router/failures.py (what a worker's answer means,
    the retry budget) and router/watch.py (the Decode stream's progress bound);
  - router/routing.py: the routing decision (prefix index lookup, policy ranking,
    local or disaggregated prefill);
  - router/channels.py: one channel per worker, closed once its worker left;
  - router/registry.py + router/registry_feed.py: the live workers (heartbeats here,
    or read from Redis in Redis mode);
  - router/service.py: the servicers (Generation, with its lenient request parsing,
    and Registry).

Two planes, two listeners (issue 11). The public one (`host:port`) serves only
Generation, grpc.health.v1 (overall "" and per pool "pagedserve.prefill" /
"pagedserve.decode") and server reflection listing just those; it receives what the
largest valid request needs, no more (ModelFrontend.max_request_bytes): gRPC refuses
larger ones RESOURCE_EXHAUSTED. The internal one (`internal_host:internal_port`,
loopback by default; `Router.internal_address`) serves the worker Registry
(heartbeats, goodbyes), in embedded mode the PrefixIndex the workers publish their
blocks to, the operator's Admin service (`pagedserve status/scale`), and health: what
only workers and operators may call, so a client of the API can neither
register a fake worker nor touch the index. TLS on the public listener
(config.public_tls), mutual TLS on the internal one and on the channels to the workers
(config.internal_tls); see common/runtime/tls.py.

Lifecycle: `start`, `drain` (graceful shutdown: admission closes, streams in flight
get a grace period), `stop`; `start_router_in_thread` runs one for sync code
(`RouterHandle`), `serve` until SIGTERM or SIGINT (python -m pagedserve.router).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import signal
import threading
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagedserve.common.runtime import tls as tls_files
from pagedserve.common.runtime.grpc_options import SERVER_OPTIONS, with_option
from pagedserve.common.runtime.prefix_index.remote import PrefixIndexServicer
from pagedserve.router.admin import AdminServicer, Scaler
from pagedserve.router.admission import Admission
from pagedserve.router.channels import WorkerChannels
from pagedserve.router.config import RouterConfig
from pagedserve.router.cost import TransferEstimator
from pagedserve.router.dispatch import Dispatcher
from pagedserve.router.frontend import ModelFrontend, ResolvedRequest
from pagedserve.router.metrics import RouterMetrics
from pagedserve.router.policy import RouteRequest, RoutingPolicy, Scored
from pagedserve.router.prefix import PrefixLookup
from pagedserve.router.registry import WorkerInfo, WorkerRegistry
from pagedserve.router.registry_feed import RegistryFeed
from pagedserve.router.routing import Routing, default_policy
from pagedserve.router.service import (
    SHUTTING_DOWN,
    Drain,
    GenerationServicer,
    RegistryServicer,
    add_generation_service,
)
from pagedserve.router.watch import DecodeStreams
from pagedserve.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    generation_pb2,
    index_pb2,
    index_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

if TYPE_CHECKING:
    from pagedserve.router.openai_api import OpenAIServer

__all__ = ["Router", "RouterConfig", "RouterHandle", "serve", "start_router_in_thread"]
logger = logging.getLogger(__name__)
T = TypeVar("T")

HEALTH_PREFILL = "pagedserve.prefill"
HEALTH_DECODE = "pagedserve.decode"
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Router:
    """Owns the server, the registry, admission control and the routing policy.

    Everything runs on one asyncio loop; `start_router_in_thread` gives sync code one.
    Tests, benchmarks and the metrics read its bookkeeping here (`counters`,
    `registry`, `prefix`, `admission`, `active_requests`, `route_latencies`...).
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
        self.counters: collections.Counter[str] = collections.Counter()
        self.policy = policy or default_policy(config)
        # Shared with the policy, so what the router measures feeds its estimates.
        self.estimator: TransferEstimator = getattr(self.policy, "estimator", None) or (
            TransferEstimator(config.prefix)
        )
        spec = self.frontend.spec
        self.estimator.set_model(spec.num_layers, spec.num_kv_heads, spec.head_dim)
        self.prefix = PrefixLookup(config, self.registry, self.counters)
        # Redis mode: workers' stats are read from Redis (several routers share them).
        self.redis_registry = None
        self.registry_feed = RegistryFeed(
            self.registry, self.counters, self.heartbeat, config.registry_poll_s
        )
        self.admission = Admission(config.max_inflight, config.max_queued)
        # Whoever owns the workers and can resize the pools (router/admin.py); `pagedserve
        # up` sets its launcher's, a router started alone has none.
        self.scaler: Scaler | None = None
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None  # the public listener
        self.address = ""
        self.internal_server: grpc.aio.Server | None = None  # Registry, PrefixIndex
        self.internal_address = ""  # host:port the workers dial (registry, index)
        # Tokenizing, chat templates and block hashing run here, off the event loop.
        self._frontend_pool = concurrent.futures.ThreadPoolExecutor(
            config.frontend_threads, thread_name_prefix="router-frontend"
        )
        self.routing = Routing(
            config, self.policy, self.registry, self.prefix, self.counters, self._frontend_pool
        )
        tls = config.internal_tls
        self.channels = WorkerChannels(
            self.registry,
            self.counters,
            self._spawn,
            tls_files.internal_channel_credentials(tls) if tls is not None else None,
        )
        self.decode_streams = DecodeStreams(config, self.channels)
        self.dispatcher = Dispatcher(
            config=config,
            frontend=self.frontend,
            admission=self.admission,
            routing=self.routing,
            registry=self.registry,
            prefix=self.prefix,
            estimator=self.estimator,
            channels=self.channels,
            streams=self.decode_streams,
            counters=self.counters,
            spawn=self._spawn,
        )
        self.active_requests = self.dispatcher.active_requests
        self.route_latencies = self.dispatcher.route_latencies
        self._background: set[asyncio.Task] = set()
        self._stopped: asyncio.Event | None = None
        self._sweeper: asyncio.Task | None = None
        self._poller: asyncio.Task | None = None
        # Graceful shutdown (drain()): Generate handlers in flight, and whether the grace
        # period is over (their cancellation then ends them UNAVAILABLE, not CANCELLED).
        self.drain_state = Drain()
        self._end_grace: asyncio.Event | None = None
        self.registry.listeners.append(self._on_membership_change)
        self.registry.drop_listeners.append(self._on_worker_left)
        self.metrics = RouterMetrics(self)  # served by start() when config.metrics_port is set
        self.http: OpenAIServer | None = None  # the OpenAI API, when config.http_port is set

    # What tests poke at, where it lives now.
    @property
    def draining(self) -> bool:
        return self.drain_state.draining

    @property
    def _channels(self) -> dict[str, grpc.aio.Channel]:
        return self.channels.open

    @property
    def _redis_fed(self) -> dict[str, int]:
        return self.registry_feed.fed

    @property
    def _registry_outage(self) -> bool:
        return self.registry_feed.outage

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> str:
        """Binds both listeners and starts serving; returns the public host:port."""
        self._stopped = asyncio.Event()
        self._end_grace = asyncio.Event()
        self._health_lock = asyncio.Lock()
        # issue 12: the OpenAI-compatible HTTP API takes its port first, so that a port
        # in use fails before anything serves.
        if self.config.http_port is not None:
            from pagedserve.router.openai_api import OpenAIServer

            config = self.config
            self.http = OpenAIServer(self, config.host, config.http_port, config.public_tls)
            self.http.bind()
        self.server = await self._start_public()
        try:
            self.internal_server = await self._start_internal()
        except BaseException:
            await self.server.stop(None)
            raise
        if self.config.metrics_port is not None:
            self.metrics.serve(self.config.host, self.config.metrics_port)
        await self._update_health()
        # issue 12: the HTTP API serves after the first health update (gRPC health
        # reports SERVING until then, so nothing slow may come before it).
        if self.http is not None:
            await self.http.start()
        self._sweeper = asyncio.create_task(self._sweep_loop())
        if self.config.redis_url:
            from pagedserve.common.runtime.prefix_index.connection import client_name
            from pagedserve.common.runtime.prefix_index.worker_registry import RedisWorkerRegistry

            self.redis_registry = RedisWorkerRegistry(
                self.config.redis_url, name=client_name("router", "registry")
            )
            self._poller = asyncio.create_task(self.registry_feed.poll_loop(self.redis_registry))
        logger.info(
            "router serving %s on %s, internal plane on %s (index: %s, policy: %s)",
            self.frontend.model_name,
            self.address,
            self.internal_address,
            "redis" if self.config.redis_url else "embedded",
            type(self.policy).__name__,
        )
        return self.address

    async def _start_public(self) -> grpc.aio.Server:
        """The public listener: Generation, health and reflection of those, nothing else.

        It receives what the largest valid request needs, no more. TLS when
        config.public_tls is set (no client certificates: clients are not peers).
        """
        limit = self.frontend.max_request_bytes()
        server = grpc.aio.server(
            options=with_option(SERVER_OPTIONS, "grpc.max_receive_message_length", limit)
        )
        add_generation_service(self._generation_servicer(), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = [
            generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ]
        reflection.enable_server_reflection(names, server)
        tls = self.config.public_tls
        creds = tls_files.public_server_credentials(tls) if tls is not None else None
        port = tls_files.add_port(server, self.config.address, creds)
        if port == 0:
            raise OSError(f"cannot listen on {self.config.address}")
        self.address = f"{self.config.host}:{port}"
        await server.start()
        return server

    async def _start_internal(self) -> grpc.aio.Server:
        """The internal listener: the workers' Registry, the embedded PrefixIndex, the
        operator's Admin (status, scale), health.

        Bound to config.internal_host (loopback by default), mutual TLS when
        config.internal_tls is set: only holders of a certificate from the internal CA
        may register as workers or publish to the index.
        """
        server = grpc.aio.server(options=SERVER_OPTIONS)
        registry = RegistryServicer(self.heartbeat, self.registry.goodbye)
        worker_pb2_grpc.add_RegistryServicer_to_server(registry, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        # The operator's Admin service (router/admin.py: status, scale): never public.
        admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(self), server)
        names = [
            worker_pb2.DESCRIPTOR.services_by_name["Registry"].full_name,
            admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ]
        if self.prefix.embedded is not None:  # the workers publish their blocks here
            servicer = PrefixIndexServicer(self.prefix.embedded)
            index_pb2_grpc.add_PrefixIndexServicer_to_server(servicer, server)
            names.append(index_pb2.DESCRIPTOR.services_by_name["PrefixIndex"].full_name)
        reflection.enable_server_reflection(names, server)
        tls = self.config.internal_tls
        creds = tls_files.internal_server_credentials(tls) if tls is not None else None
        bind = self.config.internal_bind_address
        port = tls_files.add_port(server, bind, creds)
        if port == 0:
            raise OSError(f"cannot listen on {bind} (the internal listener)")
        self.internal_address = f"{self.config.internal_host}:{port}"
        await server.start()
        return server

    def _generation_servicer(self) -> GenerationServicer:
        def generate(request, context, tenant):
            return self.metrics.track(self.dispatcher.generate(request, context, tenant), context)

        def model_info() -> generation_pb2.ModelInfo:
            return self.frontend.model_info(self.registry.block_size())

        return GenerationServicer(
            generate, model_info, self.drain_state, self.counters, self.dispatcher.auth
        )

    async def drain(self, grace_s: float) -> int:
        """Stops admitting, lets the streams in flight finish; returns how many were cut.

        At once: new Generate calls end UNAVAILABLE ("router is shutting down") and every
        health service reports NOT_SERVING, so load balancers and clients go elsewhere,
        while this server keeps answering health checks, heartbeats and the streams in
        flight. Streams still open after `grace_s` seconds (or at `end_grace()`: a second
        signal) end UNAVAILABLE with a message that says so; their downstream calls are
        cancelled with them, so the workers free their blocks.
        """
        state = self.drain_state
        if not state.draining:
            state.draining = True
            logger.info("draining: %d stream(s) in flight, grace %g s", len(state.streams), grace_s)
            await self.health.enter_graceful_shutdown()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        assert self._end_grace is not None, "start() first"
        grace_ended = asyncio.ensure_future(self._end_grace.wait())
        try:
            while state.streams and not grace_ended.done() and loop.time() < deadline:
                await asyncio.wait(
                    {*state.streams, grace_ended},
                    timeout=deadline - loop.time(),
                    return_when=asyncio.FIRST_COMPLETED,
                )
        finally:
            grace_ended.cancel()
        cut = list(state.streams)
        if cut:
            logger.warning("shutdown grace period over: ending %d stream(s) UNAVAILABLE", len(cut))
            why = (
                "the shutdown grace period was ended early (a second stop signal)"
                if self._end_grace.is_set()
                else f"the stream did not finish within its {grace_s:g} s shutdown grace period"
            )
            state.cut_message = f"{SHUTTING_DOWN}: {why}; retry on another replica"
            for task in cut:
                task.cancel()
            await asyncio.wait(cut, timeout=2.0)  # a client that does not read holds its task
        return len(cut)

    def end_grace(self) -> None:
        """Ends a drain's grace period now (call on the router's loop)."""
        if self._end_grace is not None:
            self._end_grace.set()

    async def stop(self, grace: float = 1.0) -> None:
        """Drains (`grace` seconds for the streams in flight), then stops serving."""
        if self.server is not None:
            await self.drain(grace)
        for task in (self._sweeper, self._poller):
            if task is not None:
                task.cancel()
        if self.http is not None:  # after the drain: its generations have ended
            await self.http.stop()
        if self.server is not None:
            await self.server.stop(grace)
        if self.internal_server is not None:
            await self.internal_server.stop(grace)
        if self._background:
            await asyncio.wait(self._background, timeout=grace + 1)
        await self.channels.close_all()
        self._frontend_pool.shutdown(wait=False, cancel_futures=True)
        self.prefix.close()
        if self.redis_registry is not None:
            self.redis_registry.close()
        self.metrics.close()
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

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- workers ------------------------------------------------------------------------

    def heartbeat(self, stats: worker_pb2.WorkerStats) -> worker_pb2.HeartbeatResponse:
        """Records a heartbeat and answers the live peers (the KV sources the worker may
        trust); raises ValueError for a worker of another model."""
        name = stats.model_name.split("@", 1)[0]
        if name != self.frontend.model_name:
            raise ValueError(
                f"worker {stats.worker_id!r} serves {stats.model_name!r}, this router "
                f"serves {self.frontend.model_name!r}: not registered"
            )
        self.registry.heartbeat(stats)
        return self.registry.live_peers(stats.model_name)

    def poll_redis_registry(self) -> bool:
        """One read of the Redis worker registry, applied; False if it failed (degraded).

        Blocks on Redis: the router's own loop polls on a thread (RegistryFeed.poll_loop).
        """
        assert self.redis_registry is not None
        return self.registry_feed.poll_once(self.redis_registry)

    def channel(self, address: str) -> grpc.aio.Channel:
        """The channel to a worker's `address` (router/channels.py)."""
        return self.channels.get(address)

    def route_request(self, r: ResolvedRequest, hashes: list[bytes] | None = None) -> RouteRequest:
        """Routing.route_request (blocks on a Redis index: for benchmarks and previews)."""
        return self.routing.route_request(r, hashes)

    def pick(self, role: str, rr: RouteRequest, exclude: set[str]) -> Scored | None:
        """Routing.pick: the policy's best live worker for `role`, minus `exclude`."""
        return self.routing.pick(role, rr, exclude)

    def preview(
        self, role: str, prompt_token_ids: list[int], cache_salt: str | None = None
    ) -> list[Scored]:
        """How a request with this prompt would be ranked now (for tests and debugging)."""
        return self.routing.preview(role, prompt_token_ids, cache_salt)

    def _on_worker_left(self, info: WorkerInfo, reason: str) -> None:
        """A worker record left the registry: its streams get `decode_drop_grace_s`
        more (router/watch.py), and its channel closes once unused."""
        self.decode_streams.worker_left(info, reason)
        self.channels.prune(info.address)

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

    @property
    def internal_address(self) -> str:
        """host:port of the internal listener (what workers' registry_address names)."""
        return self.router.internal_address

    def call(self, fn: Callable[[Router], T], timeout: float = 10.0) -> T:
        """Runs `fn(router)` on the router's loop (state is only touched there)."""

        async def run() -> T:
            return fn(self.router)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def live_worker_ids(self) -> list[str]:
        """Ids of the workers the router routes to now."""
        return self.call(lambda r: sorted(w.worker_id for w in r.registry.workers()))

    def drain(self, grace_s: float) -> int:
        """Router.drain from sync code; returns how many streams were cut."""
        if not self.thread.is_alive():
            return 0
        future = asyncio.run_coroutine_threadsafe(self.router.drain(grace_s), self.loop)
        return future.result(grace_s + 15)

    def end_grace(self) -> None:
        """Ends a drain's grace period now; safe from any thread (a signal handler)."""
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.router.end_grace)

    def stop(self, grace: float = 1.0) -> None:
        """Drains for up to `grace` seconds (Router.stop), then stops the thread."""
        if not self.thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self.router.stop(grace), self.loop).result(2 * grace + 20)
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


async def serve(
    config: RouterConfig, policy: RoutingPolicy | None = None, shutdown_grace_s: float = 25.0
) -> None:
    """Runs a router until SIGTERM or SIGINT (python -m pagedserve.router), then drains.

    The first signal drains (Router.drain: `shutdown_grace_s` for the streams in
    flight), a second one ends the grace period at once. Signals are only handled on
    the main thread; elsewhere (and also there) cancelling the task, or stopping the
    router, ends it too. The default grace stays under Kubernetes' default 30 s
    termination grace period.
    """
    router = Router(config, policy)
    await router.start()
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()

    def on_signal() -> None:
        if stop_requested.is_set():
            router.end_grace()
        stop_requested.set()

    signals = [signal.SIGTERM, signal.SIGINT]
    if threading.current_thread() is threading.main_thread():
        for sig in signals:
            loop.add_signal_handler(sig, on_signal)
    else:
        signals = []
    waiters = {
        asyncio.ensure_future(stop_requested.wait()),
        asyncio.ensure_future(router.wait_stopped()),
    }
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        logger.info("stop requested: draining for up to %g s", shutdown_grace_s)
    finally:
        for waiter in waiters:
            waiter.cancel()
        await router.stop(shutdown_grace_s)
        for sig in signals:
            loop.remove_signal_handler(sig)
