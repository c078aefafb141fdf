"""Redis mode: the worker registry fed from the workers' stats in Redis.

Several routers share the workers: each worker writes its WorkerStats to Redis
(common/runtime/prefix_index/worker_registry.py) and every router reads them all every
`registry_poll_s` into its own WorkerRegistry (router/registry.py), as if they were
heartbeats. A Redis that fails (down, hung, READONLY, OOM, NOPERM...) never stops
routing: the router keeps its last view (`RegistryFeed.degraded`).

On the router's event loop only (no locks); the Redis reads themselves run on a
thread of their own (`RegistryFeed.poll_loop`).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
from collections.abc import Callable
from typing import Protocol

from google.protobuf.message import DecodeError

from pagedserve.common.runtime.prefix_index import IndexUnavailableError
from pagedserve.common.runtime.prefix_index.faults import Backoff, LogLimiter
from pagedserve.router.registry import WorkerRegistry
from pagedserve.v1 import worker_pb2

logger = logging.getLogger(__name__)


class RegistrySource(Protocol):
    """What the feed reads (RedisWorkerRegistry): worker id -> serialized stats or a
    tombstone; raises on any Redis error."""

    def read(self) -> dict[str, bytes]: ...


class RegistryFeed:
    """Applies what a RegistrySource reads to `registry`, and rides out its outages.

    `heartbeat` records one worker's stats (Router.heartbeat: ValueError for a worker
    of another model); `counters` gets "registry_unavailable" and "registry_malformed".
    """

    def __init__(
        self,
        registry: WorkerRegistry,
        counters: collections.Counter[str],
        heartbeat: Callable[[worker_pb2.WorkerStats], None],
        poll_s: float,
    ) -> None:
        self.registry = registry
        self.counters = counters
        self.heartbeat = heartbeat
        self.poll_s = poll_s
        self.fed: dict[str, int] = {}  # worker id -> timestamp of the stats applied
        self.outage = False  # the last read failed: the view is the last good one
        self._log = LogLimiter(logger)

    async def poll_loop(self, source: RegistrySource) -> None:
        """Reads `source` every `registry_poll_s`, on a thread of its own.

        The read (a socket timeout at worst, when Redis hangs) never runs on the event
        loop. After a failed read the next one waits a backoff measured from the end of
        the failure (`registry_poll_s` doubling up to 2 s, jittered). While degraded,
        the last view is kept alive every `registry_poll_s`, through backoff waits and
        hung reads alike, so no wait here outlasts the workers' timeout. Nothing but
        cancellation ends this loop: an error of any kind is logged (rate-limited) and
        the router keeps its last view (`degraded`).
        """
        poll_s = self.poll_s
        backoff = Backoff(poll_s, max(poll_s, 2.0))
        reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="redis-registry")
        loop = asyncio.get_running_loop()
        try:
            while True:
                due = loop.time() + (backoff.delay() or poll_s)
                while (left := due - loop.time()) > 0:
                    await asyncio.sleep(min(left, poll_s))
                    self.keep_view()
                read = loop.run_in_executor(reader, source.read)
                while not read.done():
                    await asyncio.wait({read}, timeout=poll_s)
                    self.keep_view()
                try:
                    self.apply(read.result())
                except Exception as e:  # IndexUnavailableError (any Redis error) or a bug
                    backoff.failed()
                    self.degraded(e)
                else:
                    backoff.succeeded()
        finally:
            reader.shutdown(wait=False, cancel_futures=True)

    def poll_once(self, source: RegistrySource) -> bool:
        """One read of `source`, applied; False if it failed (degraded). Blocks on Redis."""
        try:
            self.apply(source.read())
        except Exception as e:
            self.degraded(e)
            return False
        return True

    def keep_view(self) -> None:
        """While degraded: the workers fed from Redis stay routable (see `degraded`)."""
        if self.outage:
            for wid in self.fed:
                self.registry.touch(wid)

    def degraded(self, e: Exception) -> None:
        """Redis failed us (down, hung, READONLY, OOM, NOPERM...): keep the last view.

        The workers fed from Redis stay routable (a call that fails marks its worker
        down as usual) until it answers; routing goes by load where the prefix index
        fails too. The read writes a probe key (worker_registry.py), so a Redis that
        refuses the workers' writes lands here too rather than in a sweep of them all.
        """
        if not self.outage:
            self._log.reset("outage")  # a new outage: say so at once
        self._log.log(
            logging.WARNING,
            "outage",
            "worker registry unusable, keeping the last view of %d workers: %s: %s",
            len(self.fed),
            type(e).__name__,
            e,
            exc_info=not isinstance(e, IndexUnavailableError),
        )
        self.outage = True
        self.counters["registry_unavailable"] += 1
        self.keep_view()

    def apply(self, entries: dict[str, bytes]) -> None:
        """Applies the workers' stats read from Redis (new ones only) and their goodbyes.

        A malformed entry (not a WorkerStats, or another worker's id inside) is skipped
        and logged (rate-limited), never fatal for the others.
        """
        from pagedserve.common.runtime.prefix_index.worker_registry import TOMBSTONE

        if self.outage:
            logger.warning("worker registry reachable again")
            self.outage = False
            # Give every worker fed from Redis a full timeout to report again: its own
            # beats may still be backing off from the outage.
            for wid in self.fed:
                self.registry.touch(wid)
        for wid, data in entries.items():
            if data == TOMBSTONE:
                if self.fed.pop(wid, None) is not None:
                    self.registry.goodbye(wid)
                continue
            try:
                stats = worker_pb2.WorkerStats.FromString(data)
                if stats.worker_id != wid:
                    raise ValueError(f"stats of {stats.worker_id!r} under the key of {wid!r}")
            except (DecodeError, ValueError) as e:
                self.counters["registry_malformed"] += 1
                self._log.log(
                    logging.WARNING, "malformed", "skipping worker %r in Redis: %s", wid, e
                )
                continue
            if self.fed.get(wid) == stats.timestamp_unix_ms:
                continue  # no news: a silent worker is not kept alive by its old key
            try:
                self.heartbeat(stats)
            except ValueError:
                continue  # another model's worker on the same Redis
            self.fed[wid] = stats.timestamp_unix_ms
