"""The worker registry on Redis: every router replica sees the same workers.

With a Redis URL configured, each worker writes its latest ``WorkerStats`` (the
serialized protobuf; this module never parses it) under a key with a TTL on every
heartbeat, and every router reads all of them periodically into its own
``WorkerRegistry`` (router/registry.py). Without Redis the router's gRPC Registry
service plays this part (embedded mode).

Layout (the registry is shared by every model; routers filter by model name)::

    ps:{registry}:workers        SET     ids of the workers that published
    ps:{registry}:w:<worker>     STRING  WorkerStats bytes (PX TTL); b"" = said goodbye

Decisions
---------
- Liveness is the key's TTL (a dead worker's key expires) plus the timestamp inside
  the stats: a router refreshes a worker only when its timestamp moved, so a key
  that has not expired yet does not keep a silent worker routable.
- A clean goodbye overwrites the stats with an empty value (a tombstone with a
  short TTL), so routers drop the worker at their next read instead of waiting
  for their timeout.
- ``read`` is one round trip (a Lua script): the members, their values, and the
  removal of members whose key expired.
- Any Redis error raises :class:`IndexUnavailableError`, as the prefix index does
  (connection.py): routers keep their last view, workers keep heartbeating and
  republish when it answers again (a restarted Redis is refilled within one
  heartbeat interval).
- ``read`` also writes (a probe key with a TTL), so a Redis that answers reads but
  refuses writes (READONLY after a failover, OOM, an ACL without write rights) fails
  the read too: the router then knows the workers *cannot* report and keeps its last
  view, instead of taking their frozen timestamps for silence and dropping them all.
- A member whose value is not a string (WRONGTYPE) or whose id does not decode is
  skipped (and logged, rate-limited), never fatal for the whole read.

An ACL user needs what the prefix index needs (redis.py) plus ``+multi +exec``.

An edge module (Redis): the engine core never imports it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from pagedserve.common.runtime.prefix_index import connection
from pagedserve.common.runtime.prefix_index.base import (
    IndexUnavailableError,
    check_ttl,
    check_worker_id,
)
from pagedserve.common.runtime.prefix_index.faults import Backoff, LogLimiter

logger = logging.getLogger(__name__)

TOMBSTONE = b""  # the value a worker leaves behind when it says goodbye

# KEYS[1] = the member set, KEYS[2] = the write probe. ARGV[1] = the key prefix of the
# stats keys. Returns a flat {worker, stats, worker, stats, ...}; drops members whose
# key expired; skips (keeps) members whose key is not a string. The probe SET comes
# first, so a Redis refusing writes fails the whole read (see Decisions).
_READ_LUA = """
redis.call('SET', KEYS[2], '1', 'PX', 60000)
local out = {}
for _, w in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local v = redis.pcall('GET', ARGV[1] .. w)
  if type(v) == 'string' then
    out[#out + 1] = w
    out[#out + 1] = v
  elseif not v then
    redis.call('SREM', KEYS[1], w)
  end
end
return out
"""


class RedisWorkerRegistry:
    """Workers' stats in Redis, with a TTL per worker.

    ``url`` as for :class:`~pagedserve.common.runtime.prefix_index.redis.RedisPrefixIndex`.
    Nothing is sent until the first call.
    """

    def __init__(
        self,
        url: str,
        *,
        key_prefix: str = "ps",
        socket_timeout_s: float = connection.DEFAULT_SOCKET_TIMEOUT_S,
        name: str | None = None,
        **connection_options: Any,
    ) -> None:
        connection.check_url(url)
        connection.check_namespace(key_prefix)
        self.url = connection.redact_url(url)
        self._members = f"{key_prefix}:{{registry}}:workers"
        self._stats_prefix = f"{key_prefix}:{{registry}}:w:"
        self._probe = f"{key_prefix}:{{registry}}:write-probe"
        self._describe = f"redis worker registry {self.url}"
        self._malformed = LogLimiter(logger)
        self._redis = connection.connect_redis(
            url,
            name=name or connection.client_name("registry"),
            socket_timeout_s=socket_timeout_s,
            **connection_options,
        )
        self._read = self._redis.register_script(_READ_LUA)

    def stats_key(self, worker_id: str) -> str:
        return self._stats_prefix + worker_id

    def publish(self, worker_id: str, stats: bytes, ttl_s: float) -> None:
        """Store ``worker_id``'s stats for ``ttl_s`` seconds (one round trip)."""
        check_worker_id(worker_id)
        if not isinstance(stats, bytes) or not stats:
            raise ValueError("stats must be non-empty bytes (a serialized WorkerStats)")
        self._write(worker_id, stats, ttl_s, "publish")

    def goodbye(self, worker_id: str, tombstone_ttl_s: float = 30.0) -> None:
        """Mark ``worker_id`` as gone: routers drop it at their next read."""
        check_worker_id(worker_id)
        self._write(worker_id, TOMBSTONE, tombstone_ttl_s, "goodbye")

    def _write(self, worker_id: str, value: bytes, ttl_s: float, what: str) -> None:
        ttl_ms = max(1, round(check_ttl(ttl_s) * 1000))
        with connection.redis_errors(self._describe, what):
            pipe = self._redis.pipeline(transaction=True)
            pipe.set(self.stats_key(worker_id), value, px=ttl_ms)
            pipe.sadd(self._members, worker_id)
            pipe.execute()

    def read(self) -> dict[str, bytes]:
        """Every worker with a live key: its stats bytes, or ``TOMBSTONE`` if it left.

        Raises :class:`IndexUnavailableError` when Redis cannot be read *or written*.
        """
        with connection.redis_errors(self._describe, "read"):
            flat = self._read(keys=[self._members, self._probe], args=[self._stats_prefix])
        entries = {}
        for raw, value in zip(flat[::2], flat[1::2], strict=True):
            try:
                entries[check_worker_id(raw.decode())] = bytes(value)
            except (UnicodeDecodeError, TypeError, ValueError):
                self._malformed.log(
                    logging.WARNING, "id", "%s: skipping a malformed worker id %r", self.url, raw
                )
        return entries

    def close(self) -> None:
        self._redis.close()


class RegistryPublisher:
    """The worker's side: publish stats every heartbeat, a tombstone on goodbye.

    Never raises (the heartbeat loop must go on, whatever Redis answers): a failed
    beat is logged (the first of an outage at once, then rate-limited), counted in
    ``failures``, and the next beat is skipped until a backoff measured from the end
    of the failed call has passed (``retry_s`` doubling up to ``max_retry_s``,
    jittered), so a hung Redis costs the heartbeat thread one socket timeout per
    backoff period, not one per beat. The cap stays below a router's worker timeout (3 s by default):
    once Redis is back, a worker reports again before the routers' grace (a full
    timeout from the first good read) runs out. ``degraded`` is True from a failed
    beat until the next good one.
    """

    def __init__(
        self,
        url: str,
        worker_id: str,
        ttl_s: float,
        *,
        retry_s: float = 0.25,
        max_retry_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.worker_id = check_worker_id(worker_id)
        self.registry = RedisWorkerRegistry(url, name=connection.client_name("worker", worker_id))
        self.ttl_s = check_ttl(ttl_s)
        self.backoff = Backoff(retry_s, max_retry_s, clock=clock)
        self.failures = 0
        self.degraded = False
        self._log = LogLimiter(logger)

    def beat(self, stats: bytes) -> bool:
        """Publish ``stats``; False if it was not published (Redis failed, or backing off)."""
        if not self.backoff.ready():
            return False
        try:
            self.registry.publish(self.worker_id, stats, self.ttl_s)
        except Exception as exc:  # IndexUnavailableError, or a bug: neither may stop beats
            self.backoff.failed()
            self.failures += 1
            if not self.degraded:
                self._log.reset("fail")
            self.degraded = True
            self._log.log(
                logging.WARNING,
                "fail",
                "worker registry: %s cannot publish its stats (retrying in %.1f s): %s",
                self.worker_id,
                self.backoff.delay(),
                exc,
                exc_info=not isinstance(exc, IndexUnavailableError),
            )
            return False
        self.backoff.succeeded()
        if self.degraded:
            logger.warning("worker registry reachable again from %s", self.worker_id)
        self.degraded = False
        return True

    def goodbye(self) -> None:
        try:
            self.registry.goodbye(self.worker_id)
        except Exception as exc:  # best effort: the TTL drops us anyway
            logger.info("goodbye to the worker registry failed (its TTL drops us): %s", exc)
        self.registry.close()
