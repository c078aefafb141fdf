"""The embedded worker registry: who is serving, where, and how loaded.

Workers announce themselves with a heartbeat (WorkerStats) every interval. A worker
leaves routing when
  - it says Goodbye (at once),
  - no heartbeat arrived for `timeout_s` (`sweep`, run periodically by the server),
  - a call to it failed with UNAVAILABLE (`mark_down`, by the request that saw it).
A worker that was dropped but is alive after all comes back with its next heartbeat
(as does a restarted worker, possibly at a new address).

Pure bookkeeping on the router's event loop (no locks, no gRPC); the server owns the
channels. `clock` is injectable so the timeout is tested without sleeping.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pagedserve.v1 import worker_pb2

logger = logging.getLogger(__name__)

POOL_NAMES = {
    worker_pb2.WORKER_POOL_PREFILL: "prefill",
    worker_pb2.WORKER_POOL_DECODE: "decode",
    worker_pb2.WORKER_POOL_COLOCATED: "colocated",
}
# Which pools serve each role. A colocated worker prefills locally when it decodes:
# the router sends it requests without a KV handle, never a Prefill call.
ROLE_POOLS = {"prefill": ("prefill",), "decode": ("decode", "colocated")}


@dataclass
class WorkerInfo:
    """One live worker as the router sees it."""

    worker_id: str
    pool: str  # "prefill" | "decode" | "colocated"
    address: str  # host:port of its gRPC services
    stats: worker_pb2.WorkerStats  # the last heartbeat's
    last_seen: float  # registry clock at the last heartbeat
    inflight: int = 0  # calls this router has open on it now (fresher than stats)


class WorkerRegistry:
    def __init__(self, timeout_s: float = 3.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self.clock = clock
        self._workers: dict[str, WorkerInfo] = {}
        self.drops: deque[tuple[str, str]] = deque(maxlen=1000)  # (worker_id, reason)
        self.listeners: list[Callable[[], None]] = []  # called when membership changes
        # Called with a worker's record and the reason when that record leaves: a drop,
        # or a re-registration under a new address or pool (the old record is gone).
        self.drop_listeners: list[Callable[[WorkerInfo, str], None]] = []
        # HeartbeatResponse per model name, built on demand and dropped on every
        # membership change (`_changed`): heartbeats are answered without walking the
        # registry each time, and the Redis feed's heartbeats never build one.
        self._peer_lists: dict[str, worker_pb2.HeartbeatResponse] = {}

    # -- membership -----------------------------------------------------------------

    def heartbeat(self, stats: worker_pb2.WorkerStats) -> WorkerInfo:
        """Records a worker's heartbeat; raises ValueError for a malformed one."""
        if not stats.worker_id or not stats.address:
            raise ValueError("a heartbeat needs worker_id and address")
        pool = POOL_NAMES.get(stats.pool)
        if pool is None:
            raise ValueError(f"worker {stats.worker_id!r} sent an unknown pool {stats.pool}")
        info = self._workers.get(stats.worker_id)
        now = self.clock()
        if info is not None and info.address == stats.address and info.pool == pool:
            info.stats, info.last_seen = stats, now
            return info
        old = info
        info = WorkerInfo(stats.worker_id, pool, stats.address, stats, now)
        self._workers[stats.worker_id] = info
        if old is not None:
            self._left(old, f"re-registered as {pool} at {stats.address}")
        logger.info("worker %s (%s) joined at %s", info.worker_id, pool, info.address)
        self._changed()
        return info

    def goodbye(self, worker_id: str) -> bool:
        return self._drop(worker_id, "goodbye")

    def mark_down(self, info: WorkerInfo, reason: str) -> bool:
        """Drops `info` unless it re-registered since (a newer record replaced it)."""
        if self._workers.get(info.worker_id) is not info:
            return False
        return self._drop(info.worker_id, reason)

    def sweep(self) -> list[str]:
        """Drops workers whose last heartbeat is older than timeout_s; returns their ids."""
        now = self.clock()
        stale = [w.worker_id for w in self._workers.values() if now - w.last_seen > self.timeout_s]
        for wid in stale:
            self._drop(wid, f"no heartbeat for {self.timeout_s:g} s")
        return stale

    def _drop(self, worker_id: str, reason: str) -> bool:
        info = self._workers.pop(worker_id, None)
        if info is None:
            return False
        self.drops.append((worker_id, reason))
        logger.log(
            logging.INFO if reason == "goodbye" else logging.WARNING,
            "worker %s (%s, %s) dropped: %s",
            worker_id,
            info.pool,
            info.address,
            reason,
        )
        self._left(info, reason)
        self._changed()
        return True

    def _left(self, info: WorkerInfo, reason: str) -> None:
        for fn in self.drop_listeners:
            fn(info, reason)

    def _changed(self) -> None:
        self._peer_lists.clear()
        for fn in self.listeners:
            fn()

    # -- queries ----------------------------------------------------------------------

    def get(self, worker_id: str) -> WorkerInfo | None:
        return self._workers.get(worker_id)

    def workers(self) -> list[WorkerInfo]:
        return list(self._workers.values())

    def candidates(self, role: str, exclude: Iterable[str] = ()) -> list[WorkerInfo]:
        """Live workers that can take `role` ("prefill" or "decode"), minus `exclude` and
        minus draining ones (leaving: they finish what they hold, take nothing new)."""
        pools = ROLE_POOLS[role]
        skip = set(exclude)
        return [
            w
            for w in self._workers.values()
            if w.pool in pools and w.worker_id not in skip and not w.stats.draining
        ]

    def live_peers(self, model_name: str) -> worker_pb2.HeartbeatResponse:
        """The heartbeat answer for a worker of `model_name`: every live worker of exactly
        that model (itself included), by id and transfer address.

        Exactly the model, not just its name: a decode worker pulls KV only from these,
        and KV of another checkpoint revision has the right shape but the wrong values.
        The message is shared between callers until the membership changes: read it,
        never modify it.
        """
        response = self._peer_lists.get(model_name)
        if response is None:
            peers = [
                worker_pb2.LivePeer(worker_id=w.worker_id, transfer_address=w.address)
                for w in sorted(self._workers.values(), key=lambda w: w.worker_id)
                if w.stats.model_name == model_name
            ]
            response = self._peer_lists[model_name] = worker_pb2.HeartbeatResponse(peers=peers)
        return response

    def model_id(self) -> str | None:
        """The workers' model identity (their block hashes' model id), once one reported it."""
        for w in self._workers.values():
            if w.stats.model_name:
                return w.stats.model_name
        return None

    def touch(self, worker_id: str) -> None:
        """Keeps a worker routable without fresh stats (its registry is unreachable)."""
        info = self._workers.get(worker_id)
        if info is not None:
            info.last_seen = self.clock()

    def block_size(self, default: int = 16) -> int:
        for w in self._workers.values():
            if w.stats.block_size:
                return w.stats.block_size
        return default
