"""The prefix index on Redis: one view shared by every router replica.

This is the only module in ``common/`` that imports ``redis``.

Storage layout
--------------
Every key of a namespace (one model identity) starts with ``{prefix}:{{{ns}}}:``,
e.g. ``ps:{smollm2-135m}:``. The braces are a Redis Cluster hash tag: all keys of
a namespace live in one slot, so the Lua scripts below may touch keys they
compute themselves. Hashes are stored as 32 lowercase hex characters.

=============================  =======  ===========================================
key                            type     contents
=============================  =======  ===========================================
``ps:{ns}:h:<hash hex>``       SET      ids of the workers holding that block
``ps:{ns}:w:<worker>``         SET      hex hashes the worker holds (inverse of h:)
``ps:{ns}:m:<worker>``         HASH     ``next`` = next expected seq no,
                                        ``resync`` = 1 while a resync is pending
``ps:{ns}:alive:<worker>``     STRING   exists while the worker is alive (PX TTL)
``ps:{ns}:workers``            SET      every worker with state in the namespace
=============================  =======  ===========================================

Decisions
---------
- Every operation is one Lua script (one round trip, atomic): ``apply`` checks
  the sequence number and applies the batch in one step, so no reader sees half
  a batch, and a batch re-sent after a lost reply is recognised as a duplicate.
  Several batches go in one pipeline (``apply_many``).
- ``match`` is one EVALSHA: it reads the registry, keeps the workers whose
  ``alive:`` key exists, then walks the chain's ``h:`` sets and stops as soon as
  no live worker holds the next block. (The first call after Redis lost its
  script cache costs a NOSCRIPT + EVAL, which redis-py does for us.)
- Liveness is the ``alive:`` key's TTL: a dead worker leaves ``match`` the moment
  its key expires. Its entries cannot expire by TTL (an ``h:`` set is shared by
  all workers), so they are reaped by the next heartbeat of any worker, by
  ``workers()`` or by ``reap()``: one script that drops every registered worker
  without an ``alive:`` key.
- Unreachable Redis (refused, timed out, authentication failed, loading) raises
  :class:`IndexUnavailableError` after at most one immediate retry with a short
  socket timeout: the router falls back to load-only routing, publishers resync
  when it answers again (a restarted, empty Redis answers every batch with GAP).
- Scripts use no Redis 7-only syntax, so a Redis 6.2 server works too.

An ACL user for the index needs ``~ps:*`` (or the namespaced pattern) and the
commands ``+evalsha +eval +script|load +ping`` plus those the scripts call
(``+@read +@write``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pagedserve.common.prefix_index.base import (
    ApplyResult,
    EventBatch,
    EventKind,
    IndexUnavailableError,
    PrefixIndex,
    WorkerIndexState,
    check_hash,
    check_seq,
    check_ttl,
    check_worker_id,
)

# Shared Lua helpers. KEYS[1] is always the registry (ps:{ns}:workers), ARGV[1]
# the namespace prefix (ps:{ns}:).
_LUA_PRELUDE = """
local prefix = ARGV[1]
local registry = KEYS[1]

local function drop_entries(w)
  local wkey = prefix .. 'w:' .. w
  for _, hx in ipairs(redis.call('SMEMBERS', wkey)) do
    redis.call('SREM', prefix .. 'h:' .. hx, w)
  end
  redis.call('DEL', wkey)
end

local function remove_worker(w)
  drop_entries(w)
  redis.call('DEL', prefix .. 'm:' .. w, prefix .. 'alive:' .. w)
  redis.call('SREM', registry, w)
end

local function reap()
  local dead = {}
  for _, w in ipairs(redis.call('SMEMBERS', registry)) do
    if redis.call('EXISTS', prefix .. 'alive:' .. w) == 0 then
      remove_worker(w)
      dead[#dead + 1] = w
    end
  end
  return dead
end
"""

# ARGV: prefix, worker, seq_start, then one 's<hex>' (stored) / 'r<hex>' (removed) per event.
_APPLY_LUA = (
    _LUA_PRELUDE
    + """
local w, seq = ARGV[2], tonumber(ARGV[3])
local n = #ARGV - 3
local mkey = prefix .. 'm:' .. w
local state = redis.call('HMGET', mkey, 'next', 'resync')
if not state[1] then
  redis.call('HSET', mkey, 'next', '0', 'resync', '1')
  redis.call('SADD', registry, w)
  return 'gap'
end
if state[2] == '1' then return 'pending' end
local nxt = tonumber(state[1])
if seq > nxt then
  redis.call('HSET', mkey, 'resync', '1')
  return 'gap'
end
if seq + n <= nxt then return 'duplicate' end
local wkey = prefix .. 'w:' .. w
for i = nxt - seq + 4, #ARGV do
  local op = ARGV[i]
  local hx = string.sub(op, 2)
  if string.sub(op, 1, 1) == 's' then
    redis.call('SADD', prefix .. 'h:' .. hx, w)
    redis.call('SADD', wkey, hx)
  else
    redis.call('SREM', prefix .. 'h:' .. hx, w)
    redis.call('SREM', wkey, hx)
  end
end
redis.call('HSET', mkey, 'next', string.format('%.0f', seq + n))
return 'applied'
"""
)

# ARGV: prefix, worker, next_seq, then the worker's full list of hex hashes.
_RESYNC_LUA = (
    _LUA_PRELUDE
    + """
local w = ARGV[2]
local mkey, wkey = prefix .. 'm:' .. w, prefix .. 'w:' .. w
drop_entries(w)
for i = 4, #ARGV do
  redis.call('SADD', prefix .. 'h:' .. ARGV[i], w)
  redis.call('SADD', wkey, ARGV[i])
end
redis.call('DEL', mkey)
redis.call('HSET', mkey, 'next', ARGV[3], 'resync', '0')
redis.call('SADD', registry, w)
return 1
"""
)

# ARGV: prefix, worker.
_REMOVE_LUA = _LUA_PRELUDE + "\nremove_worker(ARGV[2])\nreturn 1\n"

# ARGV: prefix, worker, ttl in ms. Reaps first, so a worker never reaps itself.
_HEARTBEAT_LUA = (
    _LUA_PRELUDE
    + """
local dead = reap()
redis.call('SET', prefix .. 'alive:' .. ARGV[2], '1', 'PX', ARGV[3])
redis.call('SADD', registry, ARGV[2])
return dead
"""
)

# ARGV: prefix. Returns {dead workers, live workers}.
_REAP_LUA = (
    _LUA_PRELUDE
    + """
local dead = reap()
return {dead, redis.call('SMEMBERS', registry)}
"""
)

# KEYS: registry, then the h: key of every block of the chain. ARGV: prefix.
# Returns a flat {worker, count, worker, count, ...} for every live worker.
_MATCH_LUA = """
local prefix = ARGV[1]
local counts, active, order, nactive = {}, {}, {}, 0
for _, w in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if redis.call('EXISTS', prefix .. 'alive:' .. w) == 1 then
    counts[w] = 0
    active[w] = true
    order[#order + 1] = w
    nactive = nactive + 1
  end
end
for i = 2, #KEYS do
  if nactive == 0 then break end
  local still, n = {}, 0
  for _, w in ipairs(redis.call('SMEMBERS', KEYS[i])) do
    if active[w] then
      still[w] = true
      counts[w] = i - 1
      n = n + 1
    end
  end
  active, nactive = still, n
end
local out = {}
for _, w in ipairs(order) do
  out[#out + 1] = w
  out[#out + 1] = counts[w]
end
return out
"""

_RESULTS = {
    b"applied": ApplyResult.APPLIED,
    b"duplicate": ApplyResult.DUPLICATE,
    b"gap": ApplyResult.GAP,
    b"pending": ApplyResult.RESYNC_PENDING,
}


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for messages and logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))


def check_namespace(namespace: object) -> str:
    if not isinstance(namespace, str) or not namespace:
        raise ValueError(f"namespace must be a non-empty string, got {namespace!r}")
    if any(c in "{}" or c.isspace() for c in namespace) or not namespace.isprintable():
        raise ValueError(f"namespace must be printable without braces or spaces: {namespace!r}")
    return namespace


class RedisPrefixIndex(PrefixIndex):
    """The prefix index of one namespace (model identity) on a Redis server.

    ``url`` is ``redis://[user[:password]@]host[:port][/db]`` or ``rediss://...``
    (TLS; options such as ``ssl_ca_certs`` may go in the query string or in
    ``connection_options``, which are passed to ``redis.Redis.from_url``).
    Nothing is sent to Redis until the first call, so a router can start while
    Redis is down.
    """

    def __init__(
        self,
        url: str,
        namespace: str,
        *,
        key_prefix: str = "ps",
        socket_timeout_s: float = 0.5,
        **connection_options: Any,
    ):
        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis url must start with redis://, rediss:// or unix://: {url!r}")
        check_namespace(namespace)
        check_namespace(key_prefix)
        check_ttl(socket_timeout_s)
        self.namespace = namespace
        self.url = redact_url(url)
        self._prefix = f"{key_prefix}:{{{namespace}}}:"
        self._registry = self._prefix + "workers"
        options: dict[str, Any] = {
            "socket_timeout": socket_timeout_s,
            "socket_connect_timeout": socket_timeout_s,
            # One immediate retry: rides over a connection the server closed
            # (restart) without stretching an outage into seconds.
            "retry": Retry(NoBackoff(), 1),
        }
        options.update(connection_options)
        self._redis = redis.Redis.from_url(url, **options)
        self._apply = self._redis.register_script(_APPLY_LUA)
        self._resync = self._redis.register_script(_RESYNC_LUA)
        self._remove = self._redis.register_script(_REMOVE_LUA)
        self._heartbeat = self._redis.register_script(_HEARTBEAT_LUA)
        self._reap = self._redis.register_script(_REAP_LUA)
        self._match = self._redis.register_script(_MATCH_LUA)

    # -- keys -----------------------------------------------------------------

    def hash_key(self, block_hash: bytes) -> str:
        return f"{self._prefix}h:{block_hash.hex()}"

    def worker_key(self, worker_id: str) -> str:
        return f"{self._prefix}w:{worker_id}"

    @property
    def key_pattern(self) -> str:
        """A SCAN/KEYS pattern matching every key of this namespace."""
        return self._prefix.replace("{", "\\{").replace("}", "\\}") + "*"

    @contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        try:
            yield
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            raise IndexUnavailableError(
                f"redis prefix index {self.url} (namespace {self.namespace!r}) "
                f"unavailable during {what}: {type(exc).__name__}: {exc}"
            ) from exc

    # -- writes ---------------------------------------------------------------

    def apply(self, batch: EventBatch) -> ApplyResult:
        return self.apply_many([batch])[0]

    def apply_many(self, batches: Sequence[EventBatch]) -> list[ApplyResult]:
        """Apply several batches in one pipeline; results in order."""
        for batch in batches:
            if not isinstance(batch, EventBatch):
                raise TypeError(f"apply() takes EventBatch objects, got {type(batch).__name__}")
        if not batches:
            return []
        with self._guard("apply"):
            if len(batches) == 1:
                replies = [self._apply(keys=[self._registry], args=self._apply_args(batches[0]))]
            else:
                pipe = self._redis.pipeline(transaction=False)
                for batch in batches:
                    self._apply(keys=[self._registry], args=self._apply_args(batch), client=pipe)
                replies = pipe.execute()
        return [_RESULTS[reply] for reply in replies]

    def _apply_args(self, batch: EventBatch) -> list[str | int]:
        ops = [
            ("s" if e.kind is EventKind.STORED else "r") + e.block_hash.hex() for e in batch.events
        ]
        return [self._prefix, batch.worker_id, batch.seq_start, *ops]

    def resync(self, worker_id: str, block_hashes: Iterable[bytes], next_seq: int) -> None:
        check_worker_id(worker_id)
        check_seq(next_seq, "next_seq")
        hexes = sorted({check_hash(h).hex() for h in block_hashes})
        with self._guard("resync"):
            self._resync(keys=[self._registry], args=[self._prefix, worker_id, next_seq, *hexes])

    def remove_worker(self, worker_id: str) -> None:
        check_worker_id(worker_id)
        with self._guard("remove_worker"):
            self._remove(keys=[self._registry], args=[self._prefix, worker_id])

    def heartbeat(self, worker_id: str, ttl_s: float) -> None:
        check_worker_id(worker_id)
        ttl_ms = max(1, round(check_ttl(ttl_s) * 1000))
        with self._guard("heartbeat"):
            self._heartbeat(keys=[self._registry], args=[self._prefix, worker_id, ttl_ms])

    def reap(self) -> list[str]:
        with self._guard("reap"):
            dead, _ = self._reap(keys=[self._registry], args=[self._prefix])
        return sorted(w.decode() for w in dead)

    # -- reads ----------------------------------------------------------------

    def match(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        keys = [self._registry, *(self.hash_key(check_hash(h)) for h in block_hashes)]
        with self._guard("match"):
            flat = self._match(keys=keys, args=[self._prefix])
        return {flat[i].decode(): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    def workers(self) -> list[str]:
        with self._guard("workers"):
            _, live = self._reap(keys=[self._registry], args=[self._prefix])
        # The script reaped every registered worker without an alive: key, so the
        # rest of the registry is the live set.
        return sorted(w.decode() for w in live)

    def worker_hashes(self, worker_id: str) -> set[bytes]:
        check_worker_id(worker_id)
        with self._guard("worker_hashes"):
            members = self._redis.smembers(self.worker_key(worker_id))
        return {bytes.fromhex(m.decode()) for m in members}

    def worker_state(self, worker_id: str) -> WorkerIndexState | None:
        check_worker_id(worker_id)
        with self._guard("worker_state"):
            nxt, resync = self._redis.hmget(f"{self._prefix}m:{worker_id}", "next", "resync")
        if nxt is None:
            return None
        return WorkerIndexState(int(nxt), resync == b"1")

    def is_available(self) -> bool:
        try:
            with self._guard("ping"):
                self._redis.ping()
        except IndexUnavailableError:
            return False
        return True

    def close(self) -> None:
        self._redis.close()
