"""Admission control: a bounded number of running and queued requests.

At most `max_inflight` requests hold a slot; up to `max_queued` more wait for one,
first come first served; a request beyond both is refused at once (the server
answers RESOURCE_EXHAUSTED), so an overloaded router sheds load instead of letting
every request's latency grow without bound.

A released slot is handed straight to the oldest waiter (the in-flight count does
not dip), so a newcomer cannot overtake the queue. Runs on one asyncio loop; no locks.
"""

from __future__ import annotations

import asyncio
from collections import deque


class AdmissionRejected(Exception):
    """Every slot and every queue place is taken; the message says how many."""


class Admission:
    def __init__(self, max_inflight: int, max_queued: int) -> None:
        if max_inflight < 1 or max_queued < 0:
            raise ValueError(
                f"need max_inflight >= 1 and max_queued >= 0, got {max_inflight}, {max_queued}"
            )
        self.max_inflight = max_inflight
        self.max_queued = max_queued
        self.inflight = 0
        self.rejected_total = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def queued(self) -> int:
        return sum(1 for f in self._waiters if not f.done())

    async def acquire(self) -> None:
        """Takes a slot, waiting in the queue if needed; raises AdmissionRejected when full.

        Cancelling the waiting coroutine (client gone, deadline) leaves the queue cleanly.
        """
        if self.inflight < self.max_inflight and not self._waiters:
            self.inflight += 1
            return
        if len(self._waiters) >= self.max_queued:
            self.rejected_total += 1
            raise AdmissionRejected(
                f"the router is at capacity ({self.inflight} requests running, "
                f"{len(self._waiters)} queued; limits {self.max_inflight} and "
                f"{self.max_queued}): retry later"
            )
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # the slot arrived just as we left: pass it on
            elif fut in self._waiters:
                self._waiters.remove(fut)
            raise

    def release(self) -> None:
        """Frees a slot, handing it to the oldest waiter if any."""
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.inflight -= 1
        assert self.inflight >= 0, "release() without acquire()"
