"""The Admin service: the cluster's status, and resizing its pools (`pagedserve status`,
`pagedserve scale`).

Served on the router's internal listener only: the status names every worker's address
and Scale stops workers, neither is for API clients.

Status is the router's own view (its admission counters and the latest heartbeat of
every registered worker), so it costs the workers nothing. Scaling needs whoever owns
the workers: `pagedserve up` sets `Router.scaler` to its launcher's `Cluster.scale`;
a router started alone (`python -m pagedserve.router`, Kubernetes) has none, and Scale
answers FAILED_PRECONDITION with what to do instead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from pagedserve.v1 import admin_pb2, admin_pb2_grpc, worker_pb2

if TYPE_CHECKING:
    from pagedserve.router.server import Router

logger = logging.getLogger(__name__)

POOL_ORDER = {worker_pb2.WORKER_POOL_PREFILL: 0, worker_pb2.WORKER_POOL_DECODE: 1}


@dataclass
class ScaleResult:
    """What a scaler did (Admin.Scale's answer)."""

    started: list[str] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)
    cut: list[str] = field(default_factory=list)  # stopped at the drain timeout, not empty
    prefill: int = 0
    decode: int = 0


# (wanted prefill or None, wanted decode or None, drain timeout in s or None) -> result.
# Blocking (it starts and stops workers): the servicer runs it off the event loop.
Scaler = Callable[[int | None, int | None, float | None], ScaleResult]


class AdminServicer(admin_pb2_grpc.AdminServicer):
    """Reads the router's state on its event loop; runs Scale in a thread."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self._scaling = asyncio.Lock()  # one resize at a time

    async def GetClusterStatus(self, request, context):  # noqa: N802
        return cluster_status(self.router)

    async def Scale(self, request, context):  # noqa: N802
        scaler = self.router.scaler
        if scaler is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this router does not own its workers (it was not started by `pagedserve "
                "up`): resize the worker Deployments or Ray worker groups instead, e.g. "
                "`kubectl scale deployment/pagedserve-decode --replicas=N`",
            )
        prefill = request.prefill if request.HasField("prefill") else None
        decode = request.decode if request.HasField("decode") else None
        if decode == 0:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "--decode 0 would leave nothing to serve requests: keep at least one",
            )
        if self._scaling.locked():
            await context.abort(
                grpc.StatusCode.ABORTED, "another scale is in progress: retry when it ends"
            )
        async with self._scaling:
            timeout = request.drain_timeout_s or None
            try:
                result = await asyncio.to_thread(scaler, prefill, decode, timeout)
            except Exception as e:  # a worker that did not start, Ray gone, ...
                logger.exception("scale failed")
                await context.abort(grpc.StatusCode.INTERNAL, f"scale failed: {e}")
        return admin_pb2.ScaleResponse(**dataclasses.asdict(result))  # the same fields


def cluster_status(router: Router) -> admin_pb2.ClusterStatus:
    """The router's admission state and its registered workers, by pool then id."""
    now = router.registry.clock()
    workers = sorted(
        router.registry.workers(), key=lambda w: (POOL_ORDER.get(w.stats.pool, 2), w.worker_id)
    )
    adm = router.admission
    status = admin_pb2.ClusterStatus(
        model_name=router.frontend.model_name,
        router_address=router.address,
        scalable=router.scaler is not None,
    )
    status.requests_inflight, status.requests_queued = adm.inflight, adm.queued
    status.max_inflight, status.max_queued = adm.max_inflight, adm.max_queued
    status.workers.extend(w.stats for w in workers)
    status.heartbeat_age_s.extend(max(0.0, now - w.last_seen) for w in workers)
    return status
