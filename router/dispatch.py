"""One Generate request's path: checks, admission, route, Prefill, Decode, leases.

Step by step (`Dispatcher.generate`, for a tenant the Generation servicer has already
authenticated: router/auth.py, router/service.py):
  1. check fields, sizes and sampling options (ModelFrontend.precheck, on the loop:
     cheap) -> INVALID_ARGUMENT with the engine's message;
  2. the tenant's concurrency limit (`TenantLimits`), then admission control ->
     RESOURCE_EXHAUSTED at once when the tenant is at its limit or running + queued
     are full; both are released however the request ends;
     then tokenize / apply the chat template (ModelFrontend.tokenize, which also
     computes the tenant's effective cache salt) on the frontend threads, never on
     the event loop (a big prompt would stall every stream); only admitted requests
     tokenize, so that work is bounded too;
  3. route (router/routing.py): hash the prompt, look it up in the prefix index, rank
     the decode workers, and decide whether to disaggregate;
  4. Prefill on the best prefill worker (`_prefill`) when disaggregating. A failed
     Prefill is retried once on another prefill worker; after that the decode worker
     prefills locally;
  5. Decode on the chosen decode worker (re-ranked after a Prefill), with the KV
     handle, relaying every DecodeStep's response (router/watch.py bounds the stream).
     A worker failure before anything was streamed retries on another (prefilling
     there: the handle may be spent); after something was streamed the stream ends
     with UNAVAILABLE. What counts as a failure or a refusal, and the retry budget:
     router/failures.py.

Bounded calls: Prefill, ExportPrefix and ReleaseLease end by deadlines of RouterConfig
(`prefill_timeout_s`, `export_timeout_s`, `release_lease_timeout_s`) even without a
client deadline; a DEADLINE_EXCEEDED under our own bound is the worker's failure.

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
between that check and the send leaves a lease to its TTL. A prefix handle passed to
a worker that failed or never answered is released by the router (ReleaseLease is
idempotent, so also when the worker did).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import grpc

from pagedserve.common.api.sampling_params import InvalidRequestError
from pagedserve.common.runtime.leases import release_lease
from pagedserve.router.admission import Admission, AdmissionRejected
from pagedserve.router.auth import Authenticator, Tenant, TenantLimitExceeded, TenantLimits
from pagedserve.router.channels import WorkerChannels
from pagedserve.router.config import RouterConfig
from pagedserve.router.cost import TransferEstimator
from pagedserve.router.failures import Abort, Attempts, Failure, Stalled, no_worker_message
from pagedserve.router.frontend import ModelFrontend, ResolvedRequest
from pagedserve.router.policy import RouteRequest, Scored
from pagedserve.router.prefix import PrefixLookup
from pagedserve.router.registry import WorkerInfo, WorkerRegistry
from pagedserve.router.routing import Routing
from pagedserve.router.watch import DecodeStreams
from pagedserve.v1 import generation_pb2, kvtransfer_pb2, worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

_POLICY_PB = {
    None: worker_pb2.TRANSFER_FAILURE_POLICY_UNSPECIFIED,
    "recompute": worker_pb2.TRANSFER_FAILURE_POLICY_RECOMPUTE,
    "fail": worker_pb2.TRANSFER_FAILURE_POLICY_FAIL,
}
# A decode worker refusing a request because its KV import failed under the "fail"
# policy answers UNAVAILABLE with this prefix; the worker is fine, so no retry.
_IMPORT_FAILED = "KV import failed"


@dataclass(frozen=True)
class Undecodable:
    """A request that failed to parse (bad UTF-8 in a string field, a corrupt message):
    router/service.py hands it here, to be answered INVALID_ARGUMENT."""

    error: str


@dataclass
class RequestContext:
    """One routed request on its way through the pools: what every step of it needs."""

    request: ResolvedRequest
    route: RouteRequest
    grpc: grpc.aio.ServicerContext  # the client's call: its deadline
    # Credits for blocks being computed (PrefixLookup.reserve), ended with the request.
    releases: list[Callable[[], None]] = field(default_factory=list)
    attempts: Attempts = field(default_factory=Attempts)

    def bounded(self, bound: float) -> tuple[float, bool]:
        """(timeout for an internal call, whether it is our bound rather than the
        client's deadline): a DEADLINE_EXCEEDED under our bound is the worker's failure."""
        remaining = self.grpc.time_remaining()
        if remaining is None or remaining > bound:
            return bound, True
        return remaining, False


@dataclass(eq=False)
class Dispatcher:
    """Runs Generate requests (`generate`) over the router's parts.

    `spawn` runs a coroutine in the background (lease releases, off the request's
    path); `active_requests` holds the ids in flight or queued (kept unique);
    `route_latencies` gets the seconds from each request's arrival to its routing
    decision (validation, tokenizing, admission, hashing, index lookup, ranking).
    `auth` is built here from the config's API keys (a bad keys file stops the router
    from starting) and handed to the Generation servicer, which authenticates;
    `tenant_limits` counts each tenant's requests against its `max_inflight`.
    """

    config: RouterConfig
    frontend: ModelFrontend
    admission: Admission
    routing: Routing
    registry: WorkerRegistry
    prefix: PrefixLookup
    estimator: TransferEstimator
    channels: WorkerChannels
    streams: DecodeStreams
    counters: collections.Counter[str]
    spawn: Callable[[Coroutine[Any, Any, Any]], None]
    active_requests: set[str] = field(default_factory=set, init=False)
    route_latencies: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=100_000), init=False
    )
    auth: Authenticator = field(init=False)
    tenant_limits: TenantLimits = field(default_factory=TenantLimits, init=False)

    def __post_init__(self) -> None:
        self.auth = Authenticator.from_config(self.config.api_key, self.config.api_keys_file)

    async def generate(
        self,
        request: generation_pb2.GenerateRequest | Undecodable,
        context: grpc.aio.ServicerContext,
        tenant: Tenant,
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        self.counters["requests"] += 1
        arrived = time.perf_counter()
        try:
            if isinstance(request, Undecodable):
                raise InvalidRequestError(
                    f"the request is not a valid GenerateRequest ({request.error}); "
                    "string fields (prompt, messages, request_id, cache_salt, stop) "
                    "must be valid UTF-8"
                )
            client_rid, params = self.frontend.precheck(request)
            rid = tenant.request_id(client_rid)
            if rid in self.active_requests:
                raise InvalidRequestError(f"request_id {client_rid!r} is already in flight")
        except InvalidRequestError as e:
            self.counters["invalid"] += 1
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self.active_requests.add(rid)  # queued ones count: ids stay unique
        try:
            await self._admit(tenant)
        except (AdmissionRejected, TenantLimitExceeded) as e:
            self.active_requests.discard(rid)
            self.counters["rejected" if isinstance(e, AdmissionRejected) else "tenant_limited"] += 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except BaseException:  # cancelled while queued
            self.active_requests.discard(rid)
            raise
        try:
            try:
                resolved = await self.routing.off_loop(
                    self.frontend.tokenize, request, rid, params, tenant
                )
            except InvalidRequestError as e:
                self.counters["invalid"] += 1
                raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
            serving = self._serve(resolved, context, arrived)
            async with contextlib.aclosing(serving) as responses:
                async for response in responses:
                    if rid != client_rid:  # the workers know the tenant's id
                        response.request_id = client_rid
                    yield response
        except Abort as e:
            await context.abort(e.code, e.message)
        finally:
            self.active_requests.discard(rid)
            self.admission.release()
            self.tenant_limits.release(tenant)

    async def _admit(self, tenant: Tenant) -> None:
        """A place under the tenant's limit, then a router slot (waiting in its queue);
        raises TenantLimitExceeded or AdmissionRejected, holding neither.

        The tenant's limit comes first, so a tenant at its limit takes no queue place
        from the others."""
        self.tenant_limits.acquire(tenant)
        try:
            await self.admission.acquire()
        except BaseException:
            self.tenant_limits.release(tenant)
            raise

    async def _serve(
        self, r: ResolvedRequest, context: grpc.aio.ServicerContext, arrived: float
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        rr = await self.routing.route(r)
        first = self.routing.pick("decode", rr, set())
        if first is None:
            raise Abort(grpc.StatusCode.UNAVAILABLE, no_worker_message("decode", set()))
        disaggregate = self.routing.disaggregate(r, first)
        self.route_latencies.append(time.perf_counter() - arrived)
        ctx = RequestContext(r, rr, context)
        try:
            async with contextlib.aclosing(self._dispatch(ctx, first, disaggregate)) as responses:
                async for response in responses:
                    yield response
        finally:
            for release in ctx.releases:
                release()

    def _reserve(self, ctx: RequestContext, worker: WorkerInfo) -> None:
        """Credit `worker` with the prompt's chain while this request computes it there."""
        rr = ctx.route
        if rr.prefix is not None and rr.prefix.hashes:
            ctx.releases.append(self.prefix.reserve(worker.worker_id, rr.prefix.hashes))

    async def _dispatch(
        self, ctx: RequestContext, first: Scored, disaggregate: bool
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        handle = await self._prefill(ctx) if disaggregate else None
        # After a Prefill the decode worker only pulls blocks: rank again (loads moved).
        choice: Scored | None = first if handle is None else None
        lease_open = handle is not None and bool(handle.lease_id)
        tried: set[str] = set()
        streamed = 0
        try:
            while True:
                scored = choice or self.routing.pick("decode", ctx.route, tried)
                choice = None
                if scored is None:
                    raise ctx.attempts.none_left("decode", tried)
                worker = scored.worker
                tried.add(worker.worker_id)
                self._reserve(ctx, worker)
                prefix = None
                if handle is None and scored.pull is not None:
                    prefix = await self._export_prefix(ctx, scored)
                req = worker_pb2.DecodeRequest(
                    request=ctx.request.tokenized,
                    kv=handle,
                    on_transfer_failure=_POLICY_PB[self.config.transfer_failure_policy],
                    prefix=prefix,
                )
                worker.inflight += 1
                answered = False
                try:
                    relay = self.streams.relay(worker, req, ctx.grpc.time_remaining())
                    async with contextlib.aclosing(relay) as steps:
                        async for step in steps:
                            answered = True
                            lease_open = False  # the first step comes after the import ended
                            streamed += 1
                            yield step.response
                    return
                except (grpc.aio.AioRpcError, Stalled) as e:
                    failure = Failure.of(e, "decode", worker)
                    kind = self._decode_outcome(failure, streamed)
                    if kind == "final" or not ctx.attempts.allow(kind, failure):
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

    def _decode_outcome(self, failure: Failure, streamed: int) -> str:
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

    async def _prefill(self, ctx: RequestContext) -> kvtransfer_pb2.KVHandle | None:
        """A KV handle from a prefill worker, or None: the decode worker prefills locally."""
        r = ctx.request
        tried: set[str] = set()
        while True:
            scored = self.routing.pick("prefill", ctx.route, tried)
            if scored is None:
                break
            worker = scored.worker
            tried.add(worker.worker_id)
            self._reserve(ctx, worker)
            req = worker_pb2.PrefillRequest(request=r.tokenized)
            if self.config.lease_ttl_ms is not None:
                req.lease_ttl_ms = self.config.lease_ttl_ms
            prefix = None
            if scored.pull is not None:
                prefix = await self._export_prefix(ctx, scored)
                if prefix is not None:
                    req.prefix.CopyFrom(prefix)
            timeout, ours = ctx.bounded(self.config.prefill_timeout_s)
            worker.inflight += 1
            answered = False
            try:
                with self.channels.use(worker.address) as channel:
                    stub = worker_pb2_grpc.PrefillStub(channel)
                    handle = await stub.Prefill(req, timeout=timeout)
                answered = True
                self.counters["prefill_calls"] += 1
                self.estimator.observe_layout(handle.layout)
                return handle
            except grpc.aio.AioRpcError as e:
                failure = Failure.of(e, "prefill", worker)
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
                if not ctx.attempts.allow(kind, failure):
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
        self, ctx: RequestContext, scored: Scored
    ) -> kvtransfer_pb2.KVHandle | None:
        """Asks the holder of the prompt's prefix to export it for `scored.worker`.

        None when the holder no longer has it (NOT_FOUND: a stale index entry) or the
        call fails: the target then computes the prefix itself.
        """
        r, rr = ctx.request, ctx.route
        plan = scored.pull
        assert plan is not None and rr.prefix is not None
        tokens = r.prompt_token_ids[: plan.holder_blocks * rr.prefix.block_size]
        req = worker_pb2.ExportPrefixRequest(
            token_ids=tokens,
            cache_salt=r.cache_salt or "",
            lease_ttl_ms=self.config.prefix.export_lease_ttl_ms,
        )
        holder = plan.holder
        timeout, _ours = ctx.bounded(self.config.export_timeout_s)
        started = time.perf_counter()
        try:
            with self.channels.use(holder.address) as channel:
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
                with self.channels.use(handle.transfer_address) as channel:
                    resp = await release_lease(
                        channel, handle.lease_id, self.config.release_lease_timeout_s
                    )
                if resp.released:  # False: the worker it was meant for released it already
                    self.counters["leases_released"] += 1
            except grpc.aio.AioRpcError as e:
                logger.info("releasing lease %s failed: %s", handle.lease_id, e.code().name)

        self.spawn(run())
