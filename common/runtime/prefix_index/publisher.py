"""Worker side of the prefix index: keep the index equal to this worker's cache.

A worker owns one :class:`IndexPublisher`. Its loop (the thread that owns the
block manager) feeds it what ``block_manager.drain_events()`` returns and calls
:meth:`IndexPublisher.tick` now and then::

    publisher = IndexPublisher(index, worker_id, snapshot=block_manager.cached_hashes)
    while serving:
        engine.step()
        publisher.publish(block_manager.drain_events())
        publisher.tick()          # heartbeat when due, resync when needed

Decisions
---------
- Events are numbered here, in the order the block manager reported them, from
  0 per publisher; they are buffered and sent as :class:`EventBatch` es of at most
  ``max_batch_events`` on :meth:`flush` (several batches go in one pipeline).
- A publisher starts out needing a resync: its first flush publishes the full
  list (``snapshot()``), so a restarted worker overwrites whatever an index still
  remembers under its id.
- Whenever the index answers GAP/RESYNC_PENDING, or cannot be reached, buffered
  events are dropped and the next flush publishes the full list instead. While
  the index is unreachable nothing is buffered, so an outage costs no memory.
- Resync heartbeats first, so another worker's reaping cannot drop the list
  between the two calls.
- A heartbeat that the index answers with "I need your list" (it reaped or lost
  this worker) makes a resync due at once, so an idle worker, which sends no batch
  whose GAP would say so, rejoins the index within one heartbeat.
- Any exception from the index (not only :class:`IndexUnavailableError`: a bug, a
  snapshot that could not be taken) counts as lost contact: buffered events are
  dropped, a resync is due, and the error is logged (the first of an outage at once,
  then at most one line per 30 s). Nothing a backend does stops the caller's loop.
- Events lost before they were numbered (a full queue between the engine thread and
  the publishing thread, say) are reported with :meth:`lost`: a resync is due, and
  its snapshot, taken after the loss, covers them.
- ``snapshot`` is called from whichever thread calls ``flush``/``tick``/``resync``:
  call them from the thread that owns the block manager, or pass a ``snapshot`` that
  asks that thread for it (the worker's IndexSync publishes from a thread of its own,
  so that a hung index never stalls the engine, and does the latter).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pagedserve.common.runtime.prefix_index.base import (
    EventBatch,
    IndexEvent,
    IndexUnavailableError,
    PrefixIndex,
    check_ttl,
    check_worker_id,
)
from pagedserve.common.runtime.prefix_index.faults import LogLimiter

logger = logging.getLogger(__name__)

# Block-manager event classes, matched by name so this module (and the index)
# does not import the engine: BlockStored(block_hash, parent_hash, token_ids,
# block_id) and BlockRemoved(block_hash, block_id).
_STORED_NAMES = frozenset({"BlockStored"})
_REMOVED_NAMES = frozenset({"BlockRemoved"})


def to_index_event(event: object) -> IndexEvent:
    """An :class:`IndexEvent` from an IndexEvent or a block manager event."""
    if isinstance(event, IndexEvent):
        return event
    name = type(event).__name__
    if name in _STORED_NAMES:
        return IndexEvent.stored(event.block_hash)  # type: ignore[attr-defined]
    if name in _REMOVED_NAMES:
        return IndexEvent.removed(event.block_hash)  # type: ignore[attr-defined]
    raise TypeError(f"cannot publish a {name}: expected IndexEvent, BlockStored or BlockRemoved")


@dataclass
class PublisherStats:
    """Counters for the metrics exporter."""

    events: int = 0  # events numbered
    batches: int = 0  # batches the index applied (or found duplicate)
    resyncs: int = 0  # full lists published
    dropped_events: int = 0  # buffered events discarded in favour of a resync
    unavailable: int = 0  # calls that found the index unreachable


class IndexPublisher:
    """Numbers, batches and publishes one worker's block events to an index."""

    def __init__(
        self,
        index: PrefixIndex,
        worker_id: str,
        snapshot: Callable[[], Iterable[bytes]],
        *,
        ttl_s: float = 10.0,
        heartbeat_every_s: float | None = None,
        max_batch_events: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not isinstance(max_batch_events, int) or max_batch_events < 1:
            raise ValueError(f"max_batch_events must be a positive int, got {max_batch_events!r}")
        self.index = index
        self.worker_id = check_worker_id(worker_id)
        self.ttl_s = check_ttl(ttl_s)
        # Three heartbeats per TTL: one lost beat does not kill the worker.
        self.heartbeat_every_s = check_ttl(heartbeat_every_s or self.ttl_s / 3)
        self.max_batch_events = max_batch_events
        self.stats = PublisherStats()
        self._snapshot = snapshot
        self._clock = clock
        self._lock = threading.Lock()
        self._next_seq = 0  # number of the next event
        self._pending: list[IndexEvent] = []  # events [next_seq - len, next_seq), unsent
        self._needs_resync = True
        self._next_heartbeat = float("-inf")
        self._outage = False
        self._log = LogLimiter(logger)

    @property
    def next_seq(self) -> int:
        return self._next_seq

    @property
    def needs_resync(self) -> bool:
        return self._needs_resync

    @property
    def degraded(self) -> bool:
        """True from a failed call to the index until the next one that succeeds."""
        return self._outage

    # -- feeding --------------------------------------------------------------

    def add(self, events: Iterable[object]) -> int:
        """Number and buffer events (IndexEvent or block manager events); return how many."""
        converted = [to_index_event(e) for e in events]
        with self._lock:
            self._next_seq += len(converted)
            self.stats.events += len(converted)
            if not self._needs_resync:  # a pending resync will cover them
                self._pending.extend(converted)
            return len(converted)

    def lost(self, count: int) -> None:
        """``count`` events were lost before they were numbered: resync at the next flush."""
        with self._lock:
            self.stats.dropped_events += count
            self._resync_due_locked()

    def publish(self, events: Iterable[object]) -> bool:
        """``add`` then ``flush``."""
        self.add(events)
        return self.flush()

    # -- sending --------------------------------------------------------------

    def flush(self) -> bool:
        """Send buffered events (or the full list if a resync is due).

        Returns True if the index now reflects every event numbered so far,
        False if it could not be reached (a resync is then due).
        """
        with self._lock:
            if self._needs_resync:
                return self._resync_locked()
            if not self._pending:
                return True
            start = self._next_seq - len(self._pending)
            step = self.max_batch_events
            batches = [
                EventBatch(self.worker_id, start + i, tuple(self._pending[i : i + step]))
                for i in range(0, len(self._pending), step)
            ]
            try:
                results = self.index.apply_many(batches)
            except Exception as exc:
                self._lost_contact_locked(exc)
                return False
            self._pending.clear()
            self.stats.batches += len(batches)
            if any(r.needs_resync for r in results):
                logger.info("prefix index asked %s for a resync (%s)", self.worker_id, results)
                self._needs_resync = True
                return self._resync_locked()
            self._back_in_contact_locked()
            return True

    def heartbeat(self) -> bool:
        """Renew this worker's liveness now; False if the index is unreachable."""
        with self._lock:
            return self._heartbeat_locked()

    def tick(self) -> bool:
        """Heartbeat if one is due, then flush. Call it from the worker loop."""
        with self._lock:
            due = self._clock() >= self._next_heartbeat
            if due and not self._heartbeat_locked():
                return False
        return self.flush()

    def resync(self) -> bool:
        """Publish the full list now (e.g. after the block manager was reset)."""
        with self._lock:
            self._needs_resync = True
            return self._resync_locked()

    def goodbye(self) -> bool:
        """Remove this worker from the index (clean shutdown)."""
        with self._lock:
            self._pending.clear()
            self._needs_resync = True
            try:
                self.index.remove_worker(self.worker_id)
            except Exception as exc:
                self._lost_contact_locked(exc)
                return False
            return True

    # -- helpers (caller holds the lock) --------------------------------------

    def _heartbeat_locked(self) -> bool:
        try:
            forgotten = self.index.heartbeat(self.worker_id, self.ttl_s)
        except Exception as exc:
            self._lost_contact_locked(exc)
            return False
        self._next_heartbeat = self._clock() + self.heartbeat_every_s
        if forgotten and not self._needs_resync:
            # Reaped (a late heartbeat), removed, or an index that restarted: the list
            # goes at the next flush (tick's own), even if no event ever follows.
            logger.info("prefix index no longer holds %s's list: resyncing", self.worker_id)
            self._resync_due_locked()
        return True

    def _resync_locked(self) -> bool:
        try:
            # Everything numbered so far happened before this snapshot: it is covered.
            hashes = list(self._snapshot())
            next_seq = self._next_seq
            self.index.heartbeat(self.worker_id, self.ttl_s)
            self.index.resync(self.worker_id, hashes, next_seq)
        except Exception as exc:
            self._lost_contact_locked(exc)
            return False
        self._next_heartbeat = self._clock() + self.heartbeat_every_s
        self.stats.dropped_events += len(self._pending)
        self._pending.clear()
        self._needs_resync = False
        self.stats.resyncs += 1
        logger.info(
            "published %d block hashes of %s (seq %d)", len(hashes), self.worker_id, next_seq
        )
        self._back_in_contact_locked()
        return True

    def _resync_due_locked(self) -> None:
        """Buffered events are dropped (counted) and the next flush publishes the full list."""
        self.stats.dropped_events += len(self._pending)
        self._pending.clear()
        self._needs_resync = True

    def _lost_contact_locked(self, exc: Exception) -> None:
        self.stats.unavailable += 1
        self._resync_due_locked()
        if not self._outage:
            self._log.reset("lost")  # a new outage: say so at once
        self._log.log(
            logging.WARNING,
            "lost",
            "prefix index unusable from %s (resync pending): %s: %s",
            self.worker_id,
            type(exc).__name__,
            exc,
            exc_info=not isinstance(exc, IndexUnavailableError),
        )
        self._outage = True

    def _back_in_contact_locked(self) -> None:
        if self._outage:
            logger.warning("prefix index reachable again from %s", self.worker_id)
        self._outage = False
