"""The Decode stream watch: a long generation is legitimate, a silent stream is not.

Every internal call of the router ends within a bound of RouterConfig, even without a
client deadline. Prefill, ExportPrefix and ReleaseLease have deadlines
(router/dispatch.py); a Decode stream is bounded by progress instead: one that sends
nothing for `decode_idle_timeout_s`, or for `decode_drop_grace_s` after its worker
left the registry, is cancelled (`DecodeStreams.relay`), with a message that names the
worker (id and address), and ends in `Stalled` (router/failures.py: a worker failure).

On the router's event loop only (no locks).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from pagedserve.router.channels import WorkerChannels
from pagedserve.router.config import RouterConfig
from pagedserve.router.failures import Stalled
from pagedserve.router.registry import WorkerInfo
from pagedserve.v1 import worker_pb2, worker_pb2_grpc


class DecodeStreams:
    """The open Decode streams, by worker, so that a worker leaving shortens their bound."""

    def __init__(self, config: RouterConfig, channels: WorkerChannels) -> None:
        self.config = config
        self.channels = channels
        self._watches: dict[str, set[StreamWatch]] = {}  # worker id -> its open streams

    async def relay(
        self, worker: WorkerInfo, req: worker_pb2.DecodeRequest, timeout: float | None
    ) -> AsyncIterator[worker_pb2.DecodeStep]:
        """The Decode stream of `req` on `worker`, message by message, under the progress
        bounds: nothing for `decode_idle_timeout_s`, or for `decode_drop_grace_s` once
        the worker left the registry, raises Stalled (the call is cancelled, so the
        worker aborts the request and frees its blocks if it still can). `timeout`: the
        client's deadline (None: none)."""
        with self.channels.use(worker.address) as channel:
            call = worker_pb2_grpc.DecodeStub(channel).Decode(req, timeout=timeout)
            watch = StreamWatch(worker, call, self.config)
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

    def worker_left(self, info: WorkerInfo, reason: str) -> None:
        """`info` left the registry: its streams get `decode_drop_grace_s` more."""
        for watch in self._watches.get(info.worker_id, ()):
            if watch.worker is info:
                watch.left(reason)


class StreamWatch:
    """The progress bound of one Decode stream (`DecodeStreams.relay`).

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
        self.stalled: Stalled | None = None
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

    def _why(self) -> Stalled:
        dropped = self._drop_deadline()
        if dropped is not None and dropped <= self.last + self.cfg.decode_idle_timeout_s:
            return Stalled(
                f"the worker left the registry ({self.left_reason}) and sent nothing for "
                f"{self.cfg.decode_drop_grace_s:g} s after (decode_drop_grace_s): "
                "stream cancelled",
                dropped=True,
            )
        return Stalled(
            f"sent nothing for {self.cfg.decode_idle_timeout_s:g} s "
            "(decode_idle_timeout_s): stream cancelled",
            dropped=False,
        )
