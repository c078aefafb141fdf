"""The in-process prefix index: the single-machine default (no Redis configured).

Same semantics as the Redis backend (see ``base.py``), held in dicts behind one
lock. Liveness is a deadline on a monotonic clock; lapsed workers stop
appearing in ``match``/``workers`` at once and are reaped by the next
``heartbeat``, ``workers`` or ``reap`` call.

Layout (mirrors the Redis one)::

    _holders[hash]   -> set of worker ids holding that block
    _hashes[worker]  -> set of hashes that worker holds
    _streams[worker] -> WorkerIndexState (next expected seq, resync pending)
    _deadline[worker]-> monotonic time its heartbeat lapses

``match`` costs O(live workers + sum over the matched prefix of its holders).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence

from pagedserve.common.runtime.prefix_index.base import (
    ApplyResult,
    EventBatch,
    EventKind,
    PrefixIndex,
    WorkerIndexState,
    check_hash,
    check_seq,
    check_ttl,
    check_worker_id,
)


class EmbeddedPrefixIndex(PrefixIndex):
    """Thread-safe in-memory index for one model namespace.

    ``clock`` returns seconds on a monotonic scale (``time.monotonic`` unless a
    test wants to drive time).
    """

    def __init__(self, namespace: str = "default", clock: Callable[[], float] = time.monotonic):
        if not isinstance(namespace, str) or not namespace:
            raise ValueError(f"namespace must be a non-empty string, got {namespace!r}")
        self.namespace = namespace
        self._clock = clock
        self._lock = threading.Lock()
        self._holders: dict[bytes, set[str]] = {}
        self._hashes: dict[str, set[bytes]] = {}
        self._streams: dict[str, WorkerIndexState] = {}
        self._deadline: dict[str, float] = {}

    # -- writes ---------------------------------------------------------------

    def apply(self, batch: EventBatch) -> ApplyResult:
        if not isinstance(batch, EventBatch):
            raise TypeError(f"apply() takes an EventBatch, got {type(batch).__name__}")
        worker = batch.worker_id
        with self._lock:
            state = self._streams.get(worker)
            if state is None or batch.seq_start > state.next_seq:
                # Unknown worker or lost events: wait for its full list.
                self._streams[worker] = WorkerIndexState(state.next_seq if state else 0, True)
                return ApplyResult.GAP
            if state.needs_resync:
                return ApplyResult.RESYNC_PENDING
            if batch.seq_end <= state.next_seq:
                return ApplyResult.DUPLICATE
            # [seq_start, next_seq) already applied; apply [next_seq, seq_end).
            for event in batch.events[state.next_seq - batch.seq_start :]:
                if event.kind is EventKind.STORED:
                    self._add(worker, event.block_hash)
                else:
                    self._discard(worker, event.block_hash)
            self._streams[worker] = WorkerIndexState(batch.seq_end, False)
            return ApplyResult.APPLIED

    def resync(self, worker_id: str, block_hashes: Iterable[bytes], next_seq: int) -> None:
        check_worker_id(worker_id)
        check_seq(next_seq, "next_seq")
        new = {check_hash(h) for h in block_hashes}
        with self._lock:
            self._drop_entries(worker_id)
            for block_hash in new:
                self._add(worker_id, block_hash)
            self._streams[worker_id] = WorkerIndexState(next_seq, False)

    def remove_worker(self, worker_id: str) -> None:
        check_worker_id(worker_id)
        with self._lock:
            self._remove(worker_id)

    def heartbeat(self, worker_id: str, ttl_s: float) -> bool:
        check_worker_id(worker_id)
        ttl_s = check_ttl(ttl_s)
        with self._lock:
            self._reap_locked()
            self._deadline[worker_id] = self._clock() + ttl_s
            state = self._streams.get(worker_id)
            return state is None or state.needs_resync

    def reap(self) -> list[str]:
        with self._lock:
            return self._reap_locked()

    # -- reads ----------------------------------------------------------------

    def match(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        chain = [check_hash(h) for h in block_hashes]
        with self._lock:
            counts = dict.fromkeys(self._live_locked(), 0)
            active = set(counts)
            # Walk the chain; a worker leaves `active` at its first miss.
            for depth, block_hash in enumerate(chain, start=1):
                active &= self._holders.get(block_hash, set())
                if not active:
                    break
                for worker in active:
                    counts[worker] = depth
            return counts

    def workers(self) -> list[str]:
        with self._lock:
            self._reap_locked()
            return sorted(self._live_locked())

    def worker_hashes(self, worker_id: str) -> set[bytes]:
        check_worker_id(worker_id)
        with self._lock:
            return set(self._hashes.get(worker_id, ()))

    def worker_state(self, worker_id: str) -> WorkerIndexState | None:
        check_worker_id(worker_id)
        with self._lock:
            return self._streams.get(worker_id)

    # -- helpers (caller holds the lock) --------------------------------------

    def _live_locked(self) -> list[str]:
        now = self._clock()
        return [w for w, deadline in self._deadline.items() if deadline > now]

    def _reap_locked(self) -> list[str]:
        now = self._clock()
        known = set(self._deadline) | set(self._hashes) | set(self._streams)
        dead = sorted(w for w in known if self._deadline.get(w, now) <= now)
        for worker in dead:
            self._remove(worker)
        return dead

    def _remove(self, worker: str) -> None:
        self._drop_entries(worker)
        self._streams.pop(worker, None)
        self._deadline.pop(worker, None)

    def _drop_entries(self, worker: str) -> None:
        for block_hash in self._hashes.pop(worker, set()):
            holders = self._holders[block_hash]
            holders.discard(worker)
            if not holders:
                del self._holders[block_hash]

    def _add(self, worker: str, block_hash: bytes) -> None:
        self._holders.setdefault(block_hash, set()).add(worker)
        self._hashes.setdefault(worker, set()).add(block_hash)

    def _discard(self, worker: str, block_hash: bytes) -> None:
        holders = self._holders.get(block_hash)
        if holders is not None:
            holders.discard(worker)
            if not holders:
                del self._holders[block_hash]
        hashes = self._hashes.get(worker)
        if hashes is not None:
            hashes.discard(block_hash)
            if not hashes:
                del self._hashes[worker]
