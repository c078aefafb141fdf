"""The router: the public gRPC server in front of the prefill and decode pools.

Generate, step by step (`_serve`):
  1. check fields, sizes and sampling options (ModelFrontend.precheck, on the loop:
     cheap) -> INVALID_ARGUMENT with the engine's message;
  2. admission control -> RESOURCE_EXHAUSTED at once when running + queued are full;
     then tokenize / apply the chat template (ModelFrontend.tokenize) on the
     frontend threads, never on the event loop (a big prompt would stall every
     stream); only admitted requests tokenize, so that work is bounded too;
  3. hash the prompt's blocks (frontend threads) and look them up in the prefix index (router/prefix.py; one
     round trip; skipped by policies that ignore it, load only while it is down),
     and rank the decode workers (router/policy.py: blocks each would not compute,
     against its load);
  4. conditional disaggregation: when the best decode worker would compute fewer
     than `disagg_min_prompt_tokens` prompt tokens (the prompt minus the prefix it
     holds or will pull: the next turn of a chat it served) or no prefill worker is
     live, it prefills locally; otherwise Prefill on the best prefill worker.
     A failed Prefill (below) is retried once on another prefill worker; after
     that the decode worker prefills locally;
  5. Decode on the chosen decode worker (re-ranked after a Prefill), with the KV
     handle, relaying every DecodeStep's response. A worker failure before anything
     was streamed retries on another (prefilling there: the handle may be spent);
     after something was streamed the stream ends with UNAVAILABLE.

Failures and retries. A worker *failure* is UNAVAILABLE (also marks the worker down),
INTERNAL/UNKNOWN (its forward failed the batch), CANCELLED by the worker, a Prefill
past `prefill_timeout_s`, or a Decode stream that stalls (below). A request is
retried after a failure at most once, counted over both hops, never replayed around
the pool: a request that breaks every worker's forward breaks two. (The local
prefill after failed Prefills is not a retry: the decode worker runs the request
anyway.) A *refusal* is RESOURCE_EXHAUSTED (the worker's waiting queue or its RPC
threads are full; nothing ran): the request moves to a worker not tried yet, each
worker once, without using the retry; when every decode worker refused, the client
gets RESOURCE_EXHAUSTED. INVALID_ARGUMENT (the request's own fault) and the client's
own deadline are never retried.

Bounded calls. Every internal call ends within a bound of RouterConfig, even without
a client deadline: Prefill, ExportPrefix and ReleaseLease by deadlines; Decode (a long
generation is legitimate) by progress: a stream that sends nothing for
`decode_idle_timeout_s`, or for `decode_drop_grace_s` after its worker left the
registry, is cancelled (`_relay`), with a message that names the worker (id and
address). Channels keep HTTP/2 keepalive (common/runtime/grpc_options.py), so a silently cut
link fails its calls within ~20 s even where no timer would. Channels to workers that
left the registry are closed once their last call ended (`_use_channel`): Ray
restarts workers on new ports, so the map would otherwise only grow.

Cross-worker reuse: when the worker about to compute a prompt (a prefill worker, or
a decode worker prefilling locally) lacks a prefix that another worker holds and
the policy found pulling it cheaper than computing it (router/cost.py), the router
asks the holder to ExportPrefix and passes the handle as `prefix`: the worker pulls
the blocks it lacks into its prefix cache first and releases the lease. A holder
that no longer has the prefix (a stale index entry) answers NOT_FOUND, and a failed
pull is computed locally: a stale index costs time, never a wrong answer.

The client's deadline bounds every downstream call (`time_remaining`). A client that
cancels or disconnects cancels this handler's task: the open downstream call is
cancelled with it (the decode worker aborts the request and frees its blocks), and a
KV handle obtained but not yet consumed by a decode worker has its lease released.
A Prefill (or ExportPrefix) response in flight when the client leaves is never seen
here: the worker notices its caller is gone and releases that lease itself
(prefill_worker/servicer.py, `_hand_over`); only a caller that leaves in the instant
between that check and the send leaves a lease to its TTL. A prefix handle passed to a worker that failed or never answered is
released by the router (ReleaseLease is idempotent, so also when the worker did).

Requests that are not valid protobuf (a string field with bad UTF-8) are answered
INVALID_ARGUMENT, not gRPC's UNKNOWN (`_lenient`); requests larger than the largest
valid one (ModelFrontend.max_request_bytes) are refused by gRPC itself with
RESOURCE_EXHAUSTED before they are parsed.

Also served: the worker Registry (heartbeats), grpc.health.v1 (overall "" and per pool
"pagedserve.prefill" / "pagedserve.decode") and server reflection.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagedserve.common.api.sampling_params import InvalidRequestError
from pagedserve.common.runtime.grpc_options import CHANNEL_OPTIONS, SERVER_OPTIONS, with_option
from pagedserve.common.runtime.prefix_index import IndexUnavailableError
from pagedserve.common.runtime.prefix_index.faults import Backoff, LogLimiter
from pagedserve.common.runtime.prefix_index.remote import PrefixIndexServicer
from pagedserve.router.admission import Admission, AdmissionRejected
from pagedserve.router.config import RouterConfig
from pagedserve.router.cost import TransferEstimator
from pagedserve.router.frontend import ModelFrontend, ResolvedRequest
from pagedserve.router.metrics import RouterMetrics
from pagedserve.router.policy import (
    LeastLoadedPolicy,
    PrefixAwarePolicy,
    PrefixMatch,
    RouteRequest,
    RoutingPolicy,
    Scored,
)
from pagedserve.router.prefix import PrefixLookup, hash_chain
from pagedserve.router.registry import WorkerInfo, WorkerRegistry
from pagedserve.v1 import (
    generation_pb2,
    generation_pb2_grpc,
    index_pb2,
    index_pb2_grpc,
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
# What a worker's answer means for the request (see the module docstring).
_FAILED = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.CANCELLED,
}
_REFUSED = grpc.StatusCode.RESOURCE_EXHAUSTED
SHUTTING_DOWN = "router is shutting down"  # UNAVAILABLE while draining (Router.drain)


def default_policy(config: RouterConfig) -> RoutingPolicy:
    """Prefix-aware (the default) or least-loaded (`config.prefix.enabled` False)."""
    if config.prefix.enabled:
        return PrefixAwarePolicy(config.prefix, config.load_weights)
    return LeastLoadedPolicy(config.load_weights)


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
        self._redis_fed: dict[str, int] = {}  # worker id -> timestamp of the stats applied
        self._registry_outage = False  # the last read failed: the view is the last good one
        self._registry_log = LogLimiter(logger)
        # Seconds from a request's arrival to its routing decision (validation,
        # tokenizing, admission, hashing, index lookup, ranking), newest last.
        self.route_latencies: collections.deque[float] = collections.deque(maxlen=100_000)
        self.admission = Admission(config.max_inflight, config.max_queued)
        self.active_requests: set[str] = set()
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.address = ""
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._channel_users: collections.Counter[str] = collections.Counter()
        self._watches: dict[str, set[_StreamWatch]] = {}  # worker id -> its open Decode streams
        # Tokenizing, chat templates and block hashing run here, off the event loop.
        self._frontend_pool = concurrent.futures.ThreadPoolExecutor(
            config.frontend_threads, thread_name_prefix="router-frontend"
        )
        self._background: set[asyncio.Task] = set()
        self._stopped: asyncio.Event | None = None
        self._sweeper: asyncio.Task | None = None
        self._poller: asyncio.Task | None = None
        # Graceful shutdown (drain()): Generate handlers in flight, and whether the grace
        # period is over (their cancellation then ends them UNAVAILABLE, not CANCELLED).
        self.draining = False
        self._streams: set[asyncio.Task] = set()
        self._cut_message: str | None = None
        self._end_grace: asyncio.Event | None = None
        self.registry.listeners.append(self._on_membership_change)
        self.registry.drop_listeners.append(self._on_worker_left)
        self.metrics = RouterMetrics(self)  # served by start() when config.metrics_port is set

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> str:
        """Binds and starts serving; returns host:port."""
        self._stopped = asyncio.Event()
        self._end_grace = asyncio.Event()
        self._health_lock = asyncio.Lock()
        # The public server receives what the largest valid request needs, no more.
        limit = self.frontend.max_request_bytes()
        server = grpc.aio.server(
            options=with_option(SERVER_OPTIONS, "grpc.max_receive_message_length", limit)
        )
        _add_generation_service(_GenerationServicer(self), server)
        worker_pb2_grpc.add_RegistryServicer_to_server(_RegistryServicer(self), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = [
            generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
            worker_pb2.DESCRIPTOR.services_by_name["Registry"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ]
        if self.prefix.embedded is not None:  # the workers publish their blocks here
            servicer = PrefixIndexServicer(self.prefix.embedded)
            index_pb2_grpc.add_PrefixIndexServicer_to_server(servicer, server)
            names.append(index_pb2.DESCRIPTOR.services_by_name["PrefixIndex"].full_name)
        reflection.enable_server_reflection(names, server)
        port = server.add_insecure_port(self.config.address)
        if port == 0:
            raise OSError(f"cannot listen on {self.config.address}")
        self.address = f"{self.config.host}:{port}"
        await server.start()
        self.server = server
        if self.config.metrics_port is not None:
            self.metrics.serve(self.config.host, self.config.metrics_port)
        await self._update_health()
        self._sweeper = asyncio.create_task(self._sweep_loop())
        if self.config.redis_url:
            from pagedserve.common.runtime.prefix_index.connection import client_name
            from pagedserve.common.runtime.prefix_index.worker_registry import RedisWorkerRegistry

            self.redis_registry = RedisWorkerRegistry(
                self.config.redis_url, name=client_name("router", "registry")
            )
            self._poller = asyncio.create_task(self._registry_poll_loop())
        logger.info(
            "router serving %s on %s (index: %s, policy: %s)",
            self.frontend.model_name,
            self.address,
            "redis" if self.config.redis_url else "embedded",
            type(self.policy).__name__,
        )
        return self.address

    async def drain(self, grace_s: float) -> int:
        """Stops admitting, lets the streams in flight finish; returns how many were cut.

        At once: new Generate calls end UNAVAILABLE ("router is shutting down") and every
        health service reports NOT_SERVING, so load balancers and clients go elsewhere,
        while this server keeps answering health checks, heartbeats and the streams in
        flight. Streams still open after `grace_s` seconds (or at `end_grace()`: a second
        signal) end UNAVAILABLE with a message that says so; their downstream calls are
        cancelled with them, so the workers free their blocks.
        """
        if not self.draining:
            self.draining = True
            logger.info("draining: %d stream(s) in flight, grace %g s", len(self._streams), grace_s)
            await self.health.enter_graceful_shutdown()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        assert self._end_grace is not None, "start() first"
        grace_ended = asyncio.ensure_future(self._end_grace.wait())
        try:
            while self._streams and not grace_ended.done() and loop.time() < deadline:
                await asyncio.wait(
                    {*self._streams, grace_ended},
                    timeout=deadline - loop.time(),
                    return_when=asyncio.FIRST_COMPLETED,
                )
        finally:
            grace_ended.cancel()
        cut = list(self._streams)
        if cut:
            logger.warning("shutdown grace period over: ending %d stream(s) UNAVAILABLE", len(cut))
            why = (
                "the shutdown grace period was ended early (a second stop signal)"
                if self._end_grace.is_set()
                else f"the stream did not finish within its {grace_s:g} s shutdown grace period"
            )
            self._cut_message = f"{SHUTTING_DOWN}: {why}; retry on another replica"
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
        if self.server is not None:
            await self.server.stop(grace)
        if self._background:
            await asyncio.wait(self._background, timeout=grace + 1)
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
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

    async def _registry_poll_loop(self) -> None:
        """Reads the Redis worker registry every `registry_poll_s`, on a thread of its own.

        The read (a socket timeout at worst, when Redis hangs) never runs on the event
        loop. After a failed read the next one waits a backoff measured from the end of
        the failure (`registry_poll_s` doubling up to 2 s, jittered). While degraded,
        the last view is kept alive every `registry_poll_s`, through backoff waits and
        hung reads alike, so no wait here outlasts the workers' timeout. Nothing but
        cancellation ends this loop: an error of any kind is logged (rate-limited) and
        the router keeps its last view (`_registry_degraded`).
        """
        registry = self.redis_registry
        assert registry is not None
        poll_s = self.config.registry_poll_s
        backoff = Backoff(poll_s, max(poll_s, 2.0))
        reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="redis-registry")
        loop = asyncio.get_running_loop()
        try:
            while True:
                due = loop.time() + (backoff.delay() or poll_s)
                while (left := due - loop.time()) > 0:
                    await asyncio.sleep(min(left, poll_s))
                    self._keep_registry_view()
                read = loop.run_in_executor(reader, registry.read)
                while not read.done():
                    await asyncio.wait({read}, timeout=poll_s)
                    self._keep_registry_view()
                try:
                    self._apply_registry(read.result())
                except Exception as e:  # IndexUnavailableError (any Redis error) or a bug
                    backoff.failed()
                    self._registry_degraded(e)
                else:
                    backoff.succeeded()
        finally:
            reader.shutdown(wait=False, cancel_futures=True)

    def _keep_registry_view(self) -> None:
        """While degraded: the workers fed from Redis stay routable (see below)."""
        if self._registry_outage:
            for wid in self._redis_fed:
                self.registry.touch(wid)

    def poll_redis_registry(self) -> bool:
        """One read of the Redis worker registry, applied; False if it failed (degraded).

        Blocks on Redis: the router's own loop uses `_registry_poll_loop` instead.
        """
        assert self.redis_registry is not None
        try:
            self._apply_registry(self.redis_registry.read())
        except Exception as e:
            self._registry_degraded(e)
            return False
        return True

    def _registry_degraded(self, e: Exception) -> None:
        """Redis failed us (down, hung, READONLY, OOM, NOPERM...): keep the last view.

        The workers fed from Redis stay routable (a call that fails marks its worker
        down as usual) until it answers; routing goes by load where the prefix index
        fails too. The read writes a probe key (worker_registry.py), so a Redis that
        refuses the workers' writes lands here too rather than in a sweep of them all.
        """
        if not self._registry_outage:
            self._registry_log.reset("outage")  # a new outage: say so at once
        self._registry_log.log(
            logging.WARNING,
            "outage",
            "worker registry unusable, keeping the last view of %d workers: %s: %s",
            len(self._redis_fed),
            type(e).__name__,
            e,
            exc_info=not isinstance(e, IndexUnavailableError),
        )
        self._registry_outage = True
        self.counters["registry_unavailable"] += 1
        self._keep_registry_view()

    def _apply_registry(self, entries: dict[str, bytes]) -> None:
        """Applies the workers' stats read from Redis (new ones only) and their goodbyes.

        A malformed entry (not a WorkerStats, or another worker's id inside) is skipped
        and logged (rate-limited), never fatal for the others.
        """
        from pagedserve.common.runtime.prefix_index.worker_registry import TOMBSTONE

        if self._registry_outage:
            logger.warning("worker registry reachable again")
            self._registry_outage = False
            # Give every worker fed from Redis a full timeout to report again: its own
            # beats may still be backing off from the outage.
            for wid in self._redis_fed:
                self.registry.touch(wid)
        for wid, data in entries.items():
            if data == TOMBSTONE:
                if self._redis_fed.pop(wid, None) is not None:
                    self.registry.goodbye(wid)
                continue
            try:
                stats = worker_pb2.WorkerStats.FromString(data)
                if stats.worker_id != wid:
                    raise ValueError(f"stats of {stats.worker_id!r} under the key of {wid!r}")
            except (DecodeError, ValueError) as e:
                self.counters["registry_malformed"] += 1
                self._registry_log.log(
                    logging.WARNING, "malformed", "skipping worker %r in Redis: %s", wid, e
                )
                continue
            if self._redis_fed.get(wid) == stats.timestamp_unix_ms:
                continue  # no news: a silent worker is not kept alive by its old key
            try:
                self.heartbeat(stats)
            except ValueError:
                continue  # another model's worker on the same Redis
            self._redis_fed[wid] = stats.timestamp_unix_ms

    # -- workers ------------------------------------------------------------------------

    def channel(self, address: str) -> grpc.aio.Channel:
        """One channel per worker address (gRPC reconnects it); calls take it through
        `_use_channel`, so that it is closed once its worker left and its calls ended."""
        ch = self._channels.get(address)
        if ch is None:
            ch = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self._channels[address] = ch
        return ch

    @contextlib.contextmanager
    def _use_channel(self, address: str) -> Iterator[grpc.aio.Channel]:
        """The channel to `address`, counted as in use until the block ends."""
        ch = self.channel(address)
        self._channel_users[address] += 1
        try:
            yield ch
        finally:
            self._channel_users[address] -= 1
            if self._channel_users[address] <= 0:
                del self._channel_users[address]
                self._prune_channel(address)

    def _prune_channel(self, address: str) -> None:
        """Closes the channel to `address` if no live worker has it and no call uses it."""
        if self._channel_users.get(address) or address not in self._channels:
            return
        if any(w.address == address for w in self.registry.workers()):
            return
        ch = self._channels.pop(address)
        self.counters["channels_closed"] += 1
        self._spawn(ch.close())

    def _on_worker_left(self, info: WorkerInfo, reason: str) -> None:
        """A worker record left the registry: its streams get `decode_drop_grace_s`
        more (`_relay`), and its channel closes once unused."""
        for watch in self._watches.get(info.worker_id, ()):
            if watch.worker is info:
                watch.left(reason)
        self._prune_channel(info.address)

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

    def route_request(self, r: ResolvedRequest, hashes: list[bytes] | None = None) -> RouteRequest:
        """What the policy sees: the request plus, for a prefix-aware policy, the index's
        per-worker match of its prompt (None while the index is unreachable).

        `hashes`: the prompt's chain if computed already (hashed here when None: fine
        for previews, not for requests). Blocks on a Redis index (for `preview`);
        requests use `_route`, which hashes and looks up off the event loop."""
        match = None
        if self.policy.uses_prefix_index:
            match = self.prefix.match(r.prompt_token_ids, r.cache_salt, hashes)
        return self._route_request(r, match)

    async def route_request_async(
        self, r: ResolvedRequest, hashes: list[bytes] | None = None
    ) -> RouteRequest:
        """`route_request` with the index lookup off the event loop (router/prefix.py)."""
        match = None
        if self.policy.uses_prefix_index:
            match = await self.prefix.match_async(r.prompt_token_ids, r.cache_salt, hashes)
        return self._route_request(r, match)

    def _route_request(self, r: ResolvedRequest, match: PrefixMatch | None) -> RouteRequest:
        if self.policy.uses_prefix_index:
            self.counters["index_lookups" if match is not None else "index_skipped"] += 1
            if match is not None and match.holders:  # for the metrics (router/metrics.py)
                self.counters["index_hits"] += 1
                self.counters["index_hit_blocks"] += match.holders[0][1]
            if match is not None:
                self.counters["index_query_blocks"] += match.num_blocks
        return RouteRequest(r.request_id, r.prompt_token_ids, r.cache_salt, match)

    async def _route(self, r: ResolvedRequest) -> RouteRequest:
        """`route_request` with the prompt hashed on the frontend threads."""
        hashes = None
        key = self.prefix.chain_key() if self.policy.uses_prefix_index else None
        if key is not None:
            hashes = await self._off_loop(hash_chain, r.prompt_token_ids, r.cache_salt, *key)
        return await self.route_request_async(r, hashes)

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._frontend_pool, fn, *args)

    def pick(self, role: str, rr: RouteRequest, exclude: set[str]) -> Scored | None:
        """The policy's best live worker for `role`, minus `exclude`; logs the inputs."""
        ranked = self.policy.rank(role, rr, self.registry.candidates(role, exclude))
        if logger.isEnabledFor(logging.DEBUG):
            m = rr.prefix
            logger.debug(
                "route %s %s prompt_tokens=%d chain_blocks=%s index=%s excluded=%s "
                "candidates=%s -> %s",
                rr.request_id,
                role,
                len(rr.prompt_token_ids),
                m.num_blocks if m else None,
                dict(m.blocks) if m else "none",
                sorted(exclude),
                [(s.worker.worker_id, round(s.score, 3), s.inputs) for s in ranked],
                ranked[0].worker.worker_id if ranked else None,
            )
        return ranked[0] if ranked else None

    def preview(
        self, role: str, prompt_token_ids: list[int], cache_salt: str | None = None
    ) -> list[Scored]:
        """How a request with this prompt would be ranked now (for tests and debugging)."""
        r = ResolvedRequest("preview", list(prompt_token_ids), None, cache_salt)  # type: ignore[arg-type]
        return self.policy.rank(role, self.route_request(r), self.registry.candidates(role))

    # -- Generate -----------------------------------------------------------------------

    async def generate(
        self,
        request: generation_pb2.GenerateRequest | _Undecodable,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        self.counters["requests"] += 1
        arrived = time.perf_counter()
        try:
            if isinstance(request, _Undecodable):
                raise InvalidRequestError(
                    f"the request is not a valid GenerateRequest ({request.error}); "
                    "string fields (prompt, messages, request_id, cache_salt, stop) "
                    "must be valid UTF-8"
                )
            rid, params = self.frontend.precheck(request)
            if rid in self.active_requests:
                raise InvalidRequestError(f"request_id {rid!r} is already in flight")
        except InvalidRequestError as e:
            self.counters["invalid"] += 1
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self.active_requests.add(rid)  # queued ones count: ids stay unique
        try:
            await self.admission.acquire()
        except AdmissionRejected as e:
            self.active_requests.discard(rid)
            self.counters["rejected"] += 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except BaseException:  # cancelled while queued
            self.active_requests.discard(rid)
            raise
        try:
            try:
                resolved = await self._off_loop(self.frontend.tokenize, request, rid, params)
            except InvalidRequestError as e:
                self.counters["invalid"] += 1
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
            serving = self._serve(resolved, context, arrived)
            async with contextlib.aclosing(serving) as responses:
                async for response in responses:
                    yield response
        except _Abort as e:
            await context.abort(e.code, e.message)
        finally:
            self.active_requests.discard(rid)
            self.admission.release()

    async def _serve(
        self, r: ResolvedRequest, context: grpc.aio.ServicerContext, arrived: float
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        rr = await self._route(r)
        first = self.pick("decode", rr, set())
        if first is None:
            raise _Abort(grpc.StatusCode.UNAVAILABLE, _no_worker_message("decode", set()))
        disaggregate = self._disaggregate(r, first)
        self.route_latencies.append(time.perf_counter() - arrived)
        releases: list[Callable[[], None]] = []  # credits for blocks being computed
        try:
            async with contextlib.aclosing(
                self._dispatch(r, rr, context, first, disaggregate, releases)
            ) as responses:
                async for response in responses:
                    yield response
        finally:
            for release in releases:
                release()

    def _reserve(self, rr: RouteRequest, worker: WorkerInfo, releases: list) -> None:
        """Credit `worker` with the prompt's chain while this request computes it there."""
        if rr.prefix is not None and rr.prefix.hashes:
            releases.append(self.prefix.reserve(worker.worker_id, rr.prefix.hashes))

    def _bounded(self, context: grpc.aio.ServicerContext, bound: float) -> tuple[float, bool]:
        """(timeout for an internal call, whether it is our bound rather than the
        client's deadline): a DEADLINE_EXCEEDED under our bound is the worker's failure."""
        remaining = context.time_remaining()
        if remaining is None or remaining > bound:
            return bound, True
        return remaining, False

    async def _dispatch(
        self,
        r: ResolvedRequest,
        rr: RouteRequest,
        context: grpc.aio.ServicerContext,
        first: Scored,
        disaggregate: bool,
        releases: list[Callable[[], None]],
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        attempts = _Attempts()
        handle = await self._prefill(r, rr, context, releases, attempts) if disaggregate else None
        # After a Prefill the decode worker only pulls blocks: rank again (loads moved).
        choice: Scored | None = first if handle is None else None
        lease_open = handle is not None and bool(handle.lease_id)
        tried: set[str] = set()
        streamed = 0
        try:
            while True:
                scored = choice or self.pick("decode", rr, tried)
                choice = None
                if scored is None:
                    raise attempts.none_left("decode", tried)
                worker = scored.worker
                tried.add(worker.worker_id)
                self._reserve(rr, worker, releases)
                prefix = None
                if handle is None and scored.pull is not None:
                    prefix = await self._export_prefix(r, rr, scored, context)
                req = worker_pb2.DecodeRequest(
                    request=r.tokenized,
                    kv=handle,
                    on_transfer_failure=_POLICY_PB[self.config.transfer_failure_policy],
                    prefix=prefix,
                )
                worker.inflight += 1
                answered = False
                try:
                    async with contextlib.aclosing(self._relay(worker, req, context)) as steps:
                        async for step in steps:
                            answered = True
                            lease_open = False  # the first step comes after the import ended
                            streamed += 1
                            yield step.response
                    return
                except (grpc.aio.AioRpcError, _Stalled) as e:
                    failure = _Failure.of(e, "decode", worker)
                    kind = self._decode_outcome(failure, streamed)
                    if kind == "final" or not attempts.allow(kind, failure):
                        raise failure.abort(streamed) from None
                    self.counters["decode_refused" if kind == "refused" else "decode_retries"] += 1
                    if kind == "failed" and lease_open:  # the next worker prefills locally:
                        self._release_lease(handle)  # the handle may be spent
                        lease_open = False
                    if kind == "failed":
                        handle = None  # (a refusal touched nothing: the handle is still good)
                finally:
                    worker.inflight -= 1
                    if not answered:  # failed or cancelled: the worker may never have
                        self._release_lease(prefix)  # released the prefix (idempotent)
        finally:
            if lease_open:
                self._release_lease(handle)

    async def _relay(
        self,
        worker: WorkerInfo,
        req: worker_pb2.DecodeRequest,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[worker_pb2.DecodeStep]:
        """The Decode stream of `req` on `worker`, message by message, under the progress
        bounds: nothing for `decode_idle_timeout_s`, or for `decode_drop_grace_s` once
        the worker left the registry, raises _Stalled (the call is cancelled, so the
        worker aborts the request and frees its blocks if it still can)."""
        with self._use_channel(worker.address) as channel:
            call = worker_pb2_grpc.DecodeStub(channel).Decode(req, timeout=context.time_remaining())
            watch = _StreamWatch(worker, call, self.config)
            watches = self._watches.setdefault(worker.worker_id, set())
            watches.add(watch)
            try:
                async for step in call:
                    watch.progress(relaying=True)
                    yield step
                    watch.progress(relaying=False)
            except (asyncio.CancelledError, grpc.aio.AioRpcError) as e:
                # The watch cancelled the call (not our client: its cancel reaches this
                # task, which then counts as cancelling).
                task = asyncio.current_task()
                if watch.stalled is None or (task is not None and task.cancelling()):
                    raise
                if isinstance(e, grpc.aio.AioRpcError) and e.code() != grpc.StatusCode.CANCELLED:
                    raise
                raise watch.stalled from None
            finally:
                watch.close()
                call.cancel()  # no-op when done; aborts the request downstream otherwise
                watches.discard(watch)
                if not watches and self._watches.get(worker.worker_id) is watches:
                    del self._watches[worker.worker_id]

    def _disaggregate(self, r: ResolvedRequest, decode: Scored) -> bool:
        """Prefill on a prefill worker, or locally on `decode`?

        Locally when the part of the prompt `decode` would compute (the prompt minus
        the prefix it holds or will pull, as the policy scored it) is shorter than
        `disagg_min_prompt_tokens`, or when no prefill worker is live.
        """
        uncached = r.prompt_len if decode.compute_tokens is None else decode.compute_tokens
        if uncached >= self.config.disagg_min_prompt_tokens:
            return True
        logger.debug(
            "route %s: %d of %d prompt tokens to compute on %s < disagg_min_prompt_tokens %d: "
            "local prefill",
            r.request_id,
            uncached,
            r.prompt_len,
            decode.worker.worker_id,
            self.config.disagg_min_prompt_tokens,
        )
        short = r.prompt_len < self.config.disagg_min_prompt_tokens
        self.counters["local_prefill_short" if short else "local_prefill_cached"] += 1
        return False

    def _decode_outcome(self, failure: _Failure, streamed: int) -> str:
        """ "refused", "failed" (may move, once) or "final"; marks a dead worker down.

        After something was streamed nothing moves: the client has part of an answer.
        """
        if failure.code == grpc.StatusCode.UNAVAILABLE and not failure.stalled:
            if failure.details.startswith(_IMPORT_FAILED):
                return "final"  # the worker is fine: the KV it was handed was not
            self.registry.mark_down(
                failure.worker, f"Decode failed with UNAVAILABLE: {failure.details}"
            )
        elif failure.stalled and not failure.dropped:
            self.registry.mark_down(failure.worker, f"Decode stalled: {failure.details}")
        if streamed:
            return "final"
        return failure.kind()

    async def _prefill(
        self,
        r: ResolvedRequest,
        rr: RouteRequest,
        context: grpc.aio.ServicerContext,
        releases: list[Callable[[], None]],
        attempts: _Attempts,
    ) -> kvtransfer_pb2.KVHandle | None:
        """A KV handle from a prefill worker, or None: the decode worker prefills locally."""
        tried: set[str] = set()
        while True:
            scored = self.pick("prefill", rr, tried)
            if scored is None:
                break
            worker = scored.worker
            tried.add(worker.worker_id)
            self._reserve(rr, worker, releases)
            req = worker_pb2.PrefillRequest(request=r.tokenized)
            if self.config.lease_ttl_ms is not None:
                req.lease_ttl_ms = self.config.lease_ttl_ms
            prefix = None
            if scored.pull is not None:
                prefix = await self._export_prefix(r, rr, scored, context)
                if prefix is not None:
                    req.prefix.CopyFrom(prefix)
            timeout, ours = self._bounded(context, self.config.prefill_timeout_s)
            worker.inflight += 1
            answered = False
            try:
                with self._use_channel(worker.address) as channel:
                    stub = worker_pb2_grpc.PrefillStub(channel)
                    handle = await stub.Prefill(req, timeout=timeout)
                answered = True
                self.counters["prefill_calls"] += 1
                self.estimator.observe_layout(handle.layout)
                return handle
            except grpc.aio.AioRpcError as e:
                failure = _Failure.of(e, "prefill", worker)
                code = failure.code
                if code == grpc.StatusCode.DEADLINE_EXCEEDED and ours:
                    failure.code = code = grpc.StatusCode.UNAVAILABLE
                    failure.details = (
                        f"no answer within prefill_timeout_s {self.config.prefill_timeout_s:g} s"
                    )
                elif code == grpc.StatusCode.UNAVAILABLE:
                    self.registry.mark_down(
                        worker, f"Prefill failed with UNAVAILABLE: {e.details()}"
                    )
                kind = failure.kind()
                if kind == "final":
                    raise failure.abort(0) from None
                self.counters["prefill_refused" if kind == "refused" else "prefill_retries"] += 1
                if not attempts.allow(kind, failure):
                    logger.warning(
                        "Prefill of %s failed again (%s): prefilling on the decode worker",
                        r.request_id,
                        failure.message(0),
                    )
                    break
            finally:
                worker.inflight -= 1
                if not answered:  # failed or cancelled: the worker may never have
                    self._release_lease(prefix)  # released the prefix (idempotent)
        self.counters["local_prefill_fallback"] += 1
        return None

    async def _export_prefix(
        self,
        r: ResolvedRequest,
        rr: RouteRequest,
        scored: Scored,
        context: grpc.aio.ServicerContext,
    ) -> kvtransfer_pb2.KVHandle | None:
        """Asks the holder of the prompt's prefix to export it for `scored.worker`.

        None when the holder no longer has it (NOT_FOUND: a stale index entry) or the
        call fails: the target then computes the prefix itself.
        """
        plan = scored.pull
        assert plan is not None and rr.prefix is not None
        tokens = r.prompt_token_ids[: plan.holder_blocks * rr.prefix.block_size]
        req = worker_pb2.ExportPrefixRequest(
            token_ids=tokens,
            cache_salt=r.cache_salt or "",
            lease_ttl_ms=self.config.prefix.export_lease_ttl_ms,
        )
        holder = plan.holder
        timeout, _ours = self._bounded(context, self.config.export_timeout_s)
        started = time.perf_counter()
        try:
            with self._use_channel(holder.address) as channel:
                handle = await worker_pb2_grpc.PrefillStub(channel).ExportPrefix(
                    req, timeout=timeout
                )
        except grpc.aio.AioRpcError as e:
            stale = e.code() == grpc.StatusCode.NOT_FOUND
            self.counters["prefix_export_missing" if stale else "prefix_export_failed"] += 1
            logger.info(
                "ExportPrefix of %d blocks for %s on %s failed (%s): %s computes them",
                plan.holder_blocks,
                r.request_id,
                holder.worker_id,
                e.code().name,
                scored.worker.worker_id,
            )
            return None
        elapsed = time.perf_counter() - started
        self.estimator.observe_export(elapsed)
        self.estimator.observe_layout(handle.layout)
        self.counters["prefix_exports"] += 1
        self.counters["prefix_export_blocks"] += len(handle.block_ids)
        logger.debug(
            "route %s: %s pulls %d blocks from %s (has %d, holder %d; estimated transfer "
            "%.2f ms vs recompute %.2f ms; export took %.2f ms)",
            r.request_id,
            scored.worker.worker_id,
            len(handle.block_ids) - plan.own_blocks,
            holder.worker_id,
            plan.own_blocks,
            plan.holder_blocks,
            plan.transfer_s * 1000,
            plan.recompute_s * 1000,
            elapsed * 1000,
        )
        return handle

    def _release_lease(self, handle: kvtransfer_pb2.KVHandle | None) -> None:
        """Ends an unconsumed lease off the request's path (best effort: leases expire)."""
        if handle is None or not handle.lease_id:
            return

        async def run() -> None:
            try:
                with self._use_channel(handle.transfer_address) as channel:
                    resp = await worker_pb2_grpc.PrefillStub(channel).ReleaseLease(
                        worker_pb2.ReleaseLeaseRequest(lease_id=handle.lease_id),
                        timeout=self.config.release_lease_timeout_s,
                    )
                if resp.released:  # False: the worker it was meant for released it already
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


class _Stalled(Exception):
    """A Decode stream made no progress within its bound (`Router._relay`)."""

    def __init__(self, details: str, dropped: bool) -> None:
        super().__init__(details)
        self.details = details
        self.dropped = dropped  # the worker had left the registry


@dataclass
class _Failure:
    """What went wrong on one worker, for the retry decision and the client's message."""

    code: grpc.StatusCode
    details: str
    role: str
    worker: WorkerInfo
    stalled: bool = False
    dropped: bool = False

    @classmethod
    def of(cls, e: grpc.aio.AioRpcError | _Stalled, role: str, worker: WorkerInfo) -> _Failure:
        if isinstance(e, _Stalled):
            return cls(grpc.StatusCode.UNAVAILABLE, e.details, role, worker, True, e.dropped)
        return cls(e.code(), e.details() or "", role, worker)

    def kind(self) -> str:
        """ "refused" (nothing ran: try another), "failed" (may retry once) or "final"."""
        if self.code == _REFUSED:
            return "refused"
        return "failed" if self.code in _FAILED else "final"

    def message(self, streamed: int) -> str:
        where = f"{self.role} worker {self.worker.worker_id} ({self.worker.address})"
        if streamed:
            where += f" (after {streamed} streamed messages)"
        return f"{where}: {self.details}"

    def abort(self, streamed: int) -> _Abort:
        code = self.code
        if code == grpc.StatusCode.CANCELLED:
            code = grpc.StatusCode.UNAVAILABLE
        elif code not in _PASS_THROUGH:
            code = grpc.StatusCode.INTERNAL
        return _Abort(code, self.message(streamed))


@dataclass
class _Attempts:
    """One request's retry budget, over both hops: one retry after a failure; refusals
    (RESOURCE_EXHAUSTED: nothing ran) move the request without using it."""

    retries_left: int = 1
    refused: set[str] = field(default_factory=set)
    failures: list[_Failure] = field(default_factory=list)

    def allow(self, kind: str, failure: _Failure) -> bool:
        """Whether the request may go on to another worker after `failure`."""
        if kind == "refused":
            self.refused.add(failure.worker.worker_id)
            return True
        self.failures.append(failure)
        if self.retries_left <= 0:
            return False
        self.retries_left -= 1
        return True

    def none_left(self, role: str, tried: set[str]) -> _Abort:
        """The abort when no `role` worker is left to try."""
        if tried and tried <= self.refused:
            return _Abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"every live {role} worker is full (refused by {sorted(tried)}): retry later",
            )
        message = _no_worker_message(role, tried)
        if self.failures:
            message += f"; last failure: {self.failures[-1].message(0)}"
        return _Abort(grpc.StatusCode.UNAVAILABLE, message)


class _StreamWatch:
    """The progress bound of one Decode stream (`Router._relay`).

    A timer on the event loop, not a timeout around each read: it fires at the
    deadline (`decode_idle_timeout_s` after the last message, or `decode_drop_grace_s`
    after the worker left the registry, whichever is first), re-arms itself if the
    stream moved on since, and otherwise records why and cancels the call. Time the
    relay spends handing a message on (a slow client) is not the worker's: it does not
    count.
    """

    def __init__(self, worker: WorkerInfo, call: grpc.aio.Call, cfg: RouterConfig) -> None:
        self.worker = worker
        self.call = call
        self.cfg = cfg
        self.loop = asyncio.get_running_loop()
        self.last = self.loop.time()  # the call's start, or its last message
        self.relaying = False  # handing a message on: the worker is not late meanwhile
        self.left_reason: str | None = None
        self.left_at = 0.0
        self.stalled: _Stalled | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._arm()

    def progress(self, relaying: bool) -> None:
        self.last = self.loop.time()
        self.relaying = relaying

    def left(self, reason: str) -> None:
        """The worker left the registry: the deadline moves closer."""
        self.left_reason, self.left_at = reason, self.loop.time()
        self._arm()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _drop_deadline(self) -> float | None:
        if self.left_reason is None:
            return None
        return max(self.last, self.left_at) + self.cfg.decode_drop_grace_s

    def _deadline(self) -> float:
        idle = self.last + self.cfg.decode_idle_timeout_s
        dropped = self._drop_deadline()
        return idle if dropped is None else min(idle, dropped)

    def _arm(self) -> None:
        self.close()
        self._timer = self.loop.call_at(self._deadline(), self._expire)

    def _expire(self) -> None:
        if self.relaying:
            self.last = self.loop.time()
        if self.relaying or self.loop.time() < self._deadline():
            self._arm()  # it moved on since the timer was set
            return
        self.stalled = self._why()
        self.call.cancel()

    def _why(self) -> _Stalled:
        dropped = self._drop_deadline()
        if dropped is not None and dropped <= self.last + self.cfg.decode_idle_timeout_s:
            return _Stalled(
                f"the worker left the registry ({self.left_reason}) and sent nothing for "
                f"{self.cfg.decode_drop_grace_s:g} s after (decode_drop_grace_s): "
                "stream cancelled",
                dropped=True,
            )
        return _Stalled(
            f"sent nothing for {self.cfg.decode_idle_timeout_s:g} s "
            "(decode_idle_timeout_s): stream cancelled",
            dropped=False,
        )


# -- the public service ----------------------------------------------------------------


@dataclass(frozen=True)
class _Undecodable:
    """A request that failed to parse (bad UTF-8 in a string field, a corrupt message)."""

    error: str


def _lenient(parse: Callable[[bytes], T]) -> Callable[[bytes], T | _Undecodable]:
    """A deserializer that hands parse errors to the handler instead of raising.

    gRPC answers a raising deserializer with UNKNOWN; the handler answers an
    _Undecodable with INVALID_ARGUMENT, which is what it is.
    """

    def deserialize(data: bytes) -> T | _Undecodable:
        try:
            return parse(data)
        except DecodeError as e:
            return _Undecodable(str(e))

    return deserialize


def _add_generation_service(servicer: _GenerationServicer, server: grpc.aio.Server) -> None:
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


class _GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, router: Router) -> None:
        self.router = router

    async def Generate(self, request, context):  # noqa: N802 (gRPC method name)
        router = self.router
        if router.draining:  # admission is closed: nothing was done, another replica can
            router.counters["refused_draining"] += 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{SHUTTING_DOWN}; retry elsewhere")
        task = asyncio.current_task()
        assert task is not None
        router._streams.add(task)
        responses = router.metrics.track(router.generate(request, context), context)
        # context.write, not yield: a drain that cancels this task past its grace period
        # interrupts the write here, where it can end the call UNAVAILABLE.
        try:
            async with contextlib.aclosing(responses) as responses:
                async for response in responses:
                    await context.write(response)
        except asyncio.CancelledError:
            if router._cut_message is None:
                raise  # the client left
            await context.abort(grpc.StatusCode.UNAVAILABLE, router._cut_message)
        finally:
            router._streams.discard(task)

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
        # The prefix index asks for resyncs itself (a publisher's batch answered GAP):
        # nothing to say here.
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
