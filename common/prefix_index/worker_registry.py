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
- Unreachable Redis raises :class:`IndexUnavailableError`, as the prefix index does:
  routers keep their last view, workers keep heartbeating and republish when it
  answers again (a restarted Redis is refilled within one heartbeat interval).

An edge module (Redis): the engine core never imports it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pagedserve.common.prefix_index.base import IndexUnavailableError, check_ttl, check_worker_id
from pagedserve.common.prefix_index.redis import check_namespace, redact_url

logger = logging.getLogger(__name__)

TOMBSTONE = b""  # the value a worker leaves behind when it says goodbye

# KEYS[1] = the member set. ARGV[1] = the key prefix of the stats keys.
# Returns a flat {worker, stats, worker, stats, ...}; drops members whose key expired.
_READ_LUA = """
local out = {}
for _, w in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local v = redis.call('GET', ARGV[1] .. w)
  if v then
    out[#out + 1] = w
    out[#out + 1] = v
  else
    redis.call('SREM', KEYS[1], w)
  end
end
return out
"""


class RedisWorkerRegistry:
    """Workers' stats in Redis, with a TTL per worker.

    ``url`` as for :class:`~pagedserve.common.prefix_index.redis.RedisPrefixIndex`.
    Nothing is sent until the first call.
    """

    def __init__(
        self,
        url: str,
        *,
        key_prefix: str = "ps",
        socket_timeout_s: float = 0.5,
        **connection_options: Any,
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis url must start with redis://, rediss:// or unix://: {url!r}")
        check_namespace(key_prefix)
        check_ttl(socket_timeout_s)
        self.url = redact_url(url)
        self._members = f"{key_prefix}:{{registry}}:workers"
        self._stats_prefix = f"{key_prefix}:{{registry}}:w:"
        options: dict[str, Any] = {
            "socket_timeout": socket_timeout_s,
            "socket_connect_timeout": socket_timeout_s,
            "retry": Retry(NoBackoff(), 1),
        }
        options.update(connection_options)
        self._redis = redis.Redis.from_url(url, **options)
        self._read = self._redis.register_script(_READ_LUA)

    def stats_key(self, worker_id: str) -> str:
        return self._stats_prefix + worker_id

    @contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        try:
            yield
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            raise IndexUnavailableError(
                f"redis worker registry {self.url} unavailable during {what}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc

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
        with self._guard(what):
            pipe = self._redis.pipeline(transaction=True)
            pipe.set(self.stats_key(worker_id), value, px=ttl_ms)
            pipe.sadd(self._members, worker_id)
            pipe.execute()

    def read(self) -> dict[str, bytes]:
        """Every worker with a live key: its stats bytes, or ``TOMBSTONE`` if it left."""
        with self._guard("read"):
            flat = self._read(keys=[self._members], args=[self._stats_prefix])
        return {flat[i].decode(): bytes(flat[i + 1]) for i in range(0, len(flat), 2)}

    def close(self) -> None:
        self._redis.close()


class RegistryPublisher:
    """The worker's side: publish stats every heartbeat, a tombstone on goodbye.

    Never raises for an unreachable Redis (the heartbeat loop must go on): it logs
    the outage once and the next beat tries again.
    """

    def __init__(self, url: str, worker_id: str, ttl_s: float) -> None:
        self.registry = RedisWorkerRegistry(url)
        self.worker_id = check_worker_id(worker_id)
        self.ttl_s = check_ttl(ttl_s)
        self._outage = False

    def beat(self, stats: bytes) -> bool:
        """Publish ``stats``; False if Redis could not be reached."""
        try:
            self.registry.publish(self.worker_id, stats, self.ttl_s)
        except IndexUnavailableError as exc:
            if not self._outage:
                logger.warning("worker registry unreachable from %s: %s", self.worker_id, exc)
            self._outage = True
            return False
        if self._outage:
            logger.warning("worker registry reachable again from %s", self.worker_id)
        self._outage = False
        return True

    def goodbye(self) -> None:
        try:
            self.registry.goodbye(self.worker_id)
        except IndexUnavailableError as exc:
            logger.info("goodbye to the worker registry failed (its TTL drops us): %s", exc)
        self.registry.close()
