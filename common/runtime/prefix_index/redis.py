"""The prefix index on Redis: one view shared by every router replica.

Only this module, ``connection`` (how every client connects) and ``worker_registry``
import ``redis``; nothing in the engine core does.

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
``ps:{ns}:old:<worker>``       SET      hashes of a removed worker (or of one being
                                        resynced) still to unlink from ``h:`` sets
``ps:{ns}:draining``           SET      workers whose ``old:`` set is not empty
=============================  =======  ===========================================

Decisions
---------
- Every operation is a Lua script, so each step is atomic: ``apply`` checks the
  sequence number and applies the batch in one step (no reader sees half a
  batch; a batch re-sent after a lost reply is recognised as a duplicate).
- ``match`` is one EVALSHA: it reads the registry, keeps the workers whose
  ``alive:`` key exists, then walks the chain's ``h:`` sets and stops as soon as
  no live worker holds the next block. (The first call after Redis lost its
  script cache costs a NOSCRIPT + EVAL, which redis-py does for us.)
- No script touches more than ``max_hashes_per_call`` hashes (default 2048,
  ~30 ms on a slow 2-core machine): Redis runs one script at a time, so a
  100k-hash resync in one script would stall every router's ``match`` for
  seconds and outlast the client's socket timeout. Hence:

  * ``apply_many`` splits big batches (consecutive sequence numbers) and sends
    at most that many events per round trip (one pipeline in the usual case);
  * removing a worker (goodbye, reaping, or the start of its resync) is O(1):
    its ``w:`` set is renamed to ``old:`` and the worker leaves the registry
    (so it leaves ``match`` at once); its ``h:`` memberships are then unlinked
    in bounded steps ("draining") by ``remove_worker``/``resync`` (their own
    worker, until done) and by every ``heartbeat``/``workers`` (one step);
  * ``resync`` = begin (detach the old list, mark the worker resync-pending),
    drain its old list, add the new list chunk by chunk, and the last chunk
    sets the sequence number and clears the pending mark. Until then ``match``
    sees a subset of the list (it under-claims; never a wrong answer), and
    batches for the worker are ignored (``RESYNC_PENDING``).
- Liveness is the ``alive:`` key's TTL: a dead worker leaves ``match`` the moment
  its key expires. Its entries cannot expire by TTL (an ``h:`` set is shared by
  all workers), so the next heartbeat of any worker, ``workers()`` or ``reap()``
  removes every registered worker without an ``alive:`` key.
- Any Redis error (refused, timed out, authentication failed, loading, and also
  READONLY / OOM / NOPERM / WRONGTYPE answers) raises :class:`IndexUnavailableError`
  after at most one immediate retry with a short socket timeout (connection.py): the
  router falls back to load-only routing, publishers resync when it answers again (a
  restarted, empty Redis answers every batch with GAP).
- Replies are parsed defensively: an entry that does not decode (a worker id that is
  not UTF-8, a member of a ``w:`` set that is not a hash) is skipped and logged, so a
  malformed key costs that entry, never the whole answer.
- Scripts use no Redis 7-only syntax, so a Redis 6.2 server works too.

An ACL user for the index needs ``~ps:*`` (or the namespaced pattern) and the
commands ``+evalsha +eval +script|load +ping +client|setname`` (every connection
names itself, connection.py) plus those the scripts call (``+@read +@write``).

Size: over the ~500-line mark on purpose. The Lua scripts and the Python that
calls them are kept side by side: each script's keys and arguments are read next to
the call that passes them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

from pagedserve.common.runtime.prefix_index.base import (
    HASH_SIZE,
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
from pagedserve.common.runtime.prefix_index.connection import (
    DEFAULT_SOCKET_TIMEOUT_S,
    check_namespace,
    check_url,
    client_name,
    connect_redis,
    redact_url,
    redis_errors,
)
from pagedserve.common.runtime.prefix_index.faults import LogLimiter

logger = logging.getLogger(__name__)

# Shared Lua helpers. KEYS[1] is always the registry (ps:{ns}:workers), ARGV[1]
# the namespace prefix (ps:{ns}:). Every write to an h: key (shared by all workers)
# is a pcall: an h: key someone overwrote with another type (WRONGTYPE) is left as
# it is (that block is simply not indexed) instead of failing every worker's
# apply, resync and heartbeat-drain.
_LUA_PRELUDE = """
local prefix = ARGV[1]
local registry = KEYS[1]
local draining = prefix .. 'draining'

-- O(1): move the worker's hashes to its old: set, to be unlinked by drain().
local function detach_entries(w)
  local wkey, okey = prefix .. 'w:' .. w, prefix .. 'old:' .. w
  if redis.call('EXISTS', wkey) == 0 then return end
  if redis.call('EXISTS', okey) == 1 then
    redis.call('SUNIONSTORE', okey, okey, wkey)  -- an earlier drain was cut short
    redis.call('DEL', wkey)
  else
    redis.call('RENAME', wkey, okey)
  end
  redis.call('SADD', draining, w)
end

local function remove_worker(w)
  detach_entries(w)
  redis.call('DEL', prefix .. 'm:' .. w, prefix .. 'alive:' .. w)
  redis.call('SREM', registry, w)
end

-- Unlink up to `budget` detached hashes (of worker `only`, or of any worker).
-- Returns the hashes `only` still has to drain, or the workers still draining.
local function drain(budget, only)
  local todo = only and {only} or redis.call('SMEMBERS', draining)
  for _, w in ipairs(todo) do
    if budget <= 0 then break end
    local okey = prefix .. 'old:' .. w
    local popped = redis.call('SPOP', okey, budget)
    for _, hx in ipairs(popped) do
      redis.pcall('SREM', prefix .. 'h:' .. hx, w)
    end
    budget = budget - #popped
    if redis.call('EXISTS', okey) == 0 then redis.call('SREM', draining, w) end
  end
  if only then return redis.call('SCARD', prefix .. 'old:' .. only) end
  return redis.call('SCARD', draining)
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
    redis.pcall('SADD', prefix .. 'h:' .. hx, w)
    redis.call('SADD', wkey, hx)
  else
    redis.pcall('SREM', prefix .. 'h:' .. hx, w)
    redis.call('SREM', wkey, hx)
  end
end
redis.call('HSET', mkey, 'next', string.format('%.0f', seq + n))
return 'applied'
"""
)

# ARGV: prefix, worker, budget. Detaches the worker's list, marks it resync-pending,
# drains one step; returns the hashes still to drain.
_RESYNC_BEGIN_LUA = (
    _LUA_PRELUDE
    + """
local w = ARGV[2]
detach_entries(w)
redis.call('DEL', prefix .. 'm:' .. w)
redis.call('HSET', prefix .. 'm:' .. w, 'next', '0', 'resync', '1')
redis.call('SADD', registry, w)
return drain(tonumber(ARGV[3]), w)
"""
)

# ARGV: prefix, worker, next_seq ('' except on the last chunk), then hex hashes.
# Returns 0 (and adds nothing) if the worker was removed since its resync began.
_RESYNC_ADD_LUA = (
    _LUA_PRELUDE
    + """
local w = ARGV[2]
local mkey, wkey = prefix .. 'm:' .. w, prefix .. 'w:' .. w
if redis.call('HGET', mkey, 'resync') ~= '1' then return 0 end
for i = 4, #ARGV do
  redis.pcall('SADD', prefix .. 'h:' .. ARGV[i], w)
  redis.call('SADD', wkey, ARGV[i])
end
if ARGV[3] ~= '' then
  redis.call('HSET', mkey, 'next', ARGV[3], 'resync', '0')
end
return 1
"""
)

# ARGV: prefix, budget[, worker]. One drain step; see drain() for the reply.
_DRAIN_LUA = _LUA_PRELUDE + "\nreturn drain(tonumber(ARGV[2]), ARGV[3])\n"

# ARGV: prefix, worker, budget. Returns the hashes of the worker still to drain.
_REMOVE_LUA = _LUA_PRELUDE + "\nremove_worker(ARGV[2])\nreturn drain(tonumber(ARGV[3]), ARGV[2])\n"

# ARGV: prefix, worker, ttl in ms, budget. Reaps first (a lapsed worker is reaped by
# its own late heartbeat, then comes back alive with no entries); then one drain step.
# Returns {reaped workers, 1 if the index needs the worker's full list else 0}: no m:
# hash (unknown, removed, reaped) or one marked resync-pending.
_HEARTBEAT_LUA = (
    _LUA_PRELUDE
    + """
local dead = reap()
redis.call('SET', prefix .. 'alive:' .. ARGV[2], '1', 'PX', ARGV[3])
redis.call('SADD', registry, ARGV[2])
drain(tonumber(ARGV[4]))
local state = redis.call('HMGET', prefix .. 'm:' .. ARGV[2], 'next', 'resync')
local need = 0
if not state[1] or state[2] == '1' then need = 1 end
return {dead, need}
"""
)

# ARGV: prefix, budget. Returns {reaped workers, live workers, workers still draining}.
_REAP_LUA = (
    _LUA_PRELUDE
    + """
local dead = reap()
local left = drain(tonumber(ARGV[2]))
return {dead, redis.call('SMEMBERS', registry), left}
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
  -- pcall: an h: key someone overwrote with another type (WRONGTYPE) reads as an
  -- empty set (an error table has no array part), not as an error for the request.
  for _, w in ipairs(redis.pcall('SMEMBERS', KEYS[i])) do
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


__all__ = ["RedisPrefixIndex", "check_namespace", "redact_url"]  # re-exported for callers


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
        socket_timeout_s: float = DEFAULT_SOCKET_TIMEOUT_S,
        max_hashes_per_call: int = 2048,
        name: str | None = None,
        **connection_options: Any,
    ):
        check_url(url)
        check_namespace(namespace)
        check_namespace(key_prefix)
        if not isinstance(max_hashes_per_call, int) or max_hashes_per_call < 1:
            raise ValueError(f"max_hashes_per_call must be a positive int: {max_hashes_per_call!r}")
        self.namespace = namespace
        self.url = redact_url(url)
        self.max_hashes_per_call = max_hashes_per_call
        self._prefix = f"{key_prefix}:{{{namespace}}}:"
        self._registry = self._prefix + "workers"
        self._describe = f"redis prefix index {self.url} (namespace {namespace!r})"
        self._malformed = LogLimiter(logger)
        self._redis = connect_redis(
            url,
            name=name or client_name("index", namespace),
            socket_timeout_s=socket_timeout_s,
            **connection_options,
        )
        self._scripts: list[Any] = []
        register = self._register
        self._apply = register(_APPLY_LUA)
        self._resync_begin = register(_RESYNC_BEGIN_LUA)
        self._resync_add = register(_RESYNC_ADD_LUA)
        self._drain = register(_DRAIN_LUA)
        self._remove = register(_REMOVE_LUA)
        self._heartbeat = register(_HEARTBEAT_LUA)
        self._reap = register(_REAP_LUA)
        self._match = register(_MATCH_LUA)

    def _register(self, source: str) -> Any:
        script = self._redis.register_script(source)
        self._scripts.append(script)
        return script

    def load_scripts(self) -> None:
        """Load every script into Redis now (e.g. at router start), so that even the
        first ``match`` is one round trip. Optional: a missing script is loaded on use."""
        with self._guard("load_scripts"):
            for script in self._scripts:
                script.sha = self._redis.script_load(script.script)

    # -- keys -----------------------------------------------------------------

    def hash_key(self, block_hash: bytes) -> str:
        return f"{self._prefix}h:{block_hash.hex()}"

    def worker_key(self, worker_id: str) -> str:
        return f"{self._prefix}w:{worker_id}"

    @property
    def key_pattern(self) -> str:
        """A SCAN/KEYS pattern matching every key of this namespace."""
        return self._prefix.replace("{", "\\{").replace("}", "\\}") + "*"

    def _guard(self, what: str) -> AbstractContextManager[None]:
        return redis_errors(self._describe, what)

    def _skip(self, what: str, raw: object) -> None:
        """A malformed entry in a reply: logged (rate-limited) and left out."""
        self._malformed.log(
            logging.WARNING,
            what,
            "%s: skipping a malformed %s: %r",
            self._describe,
            what,
            raw,
        )

    def _worker_ids(self, raw: Iterable[object], what: str) -> list[str]:
        ids = []
        for member in raw:
            worker_id = _decode_worker_id(member)
            if worker_id is None:
                self._skip(what, member)
            else:
                ids.append(worker_id)
        return sorted(ids)

    def _run(self, script: Any, *args: object, client: Any = None) -> Any:
        """Run one of our scripts: KEYS = [registry], ARGV = [prefix, *args]."""
        return script(keys=[self._registry], args=[self._prefix, *args], client=client)

    # -- writes ---------------------------------------------------------------

    def apply(self, batch: EventBatch) -> ApplyResult:
        return self.apply_many([batch])[0]

    def apply_many(self, batches: Sequence[EventBatch]) -> list[ApplyResult]:
        """Apply batches in order; one round trip per ``max_hashes_per_call`` events."""
        for batch in batches:
            if not isinstance(batch, EventBatch):
                raise TypeError(f"apply() takes EventBatch objects, got {type(batch).__name__}")
        # pieces[i] = (index of its batch, sub-batch of <= max_hashes_per_call events)
        limit = self.max_hashes_per_call
        pieces = [
            (i, EventBatch(b.worker_id, b.seq_start + k, b.events[k : k + limit]))
            for i, b in enumerate(batches)
            for k in range(0, max(len(b.events), 1), limit)
        ]
        replies: list[ApplyResult] = []
        with self._guard("apply"):
            for group in _groups(pieces, limit):
                if len(group) == 1:
                    replies.append(_result(self._run(self._apply, *self._apply_args(group[0][1]))))
                    continue
                pipe = self._redis.pipeline(transaction=False)
                for _, piece in group:
                    self._run(self._apply, *self._apply_args(piece), client=pipe)
                replies.extend(_result(r) for r in pipe.execute())
        results: list[list[ApplyResult]] = [[] for _ in batches]
        for (i, _), reply in zip(pieces, replies, strict=True):
            results[i].append(reply)
        return [_combine(r) for r in results]

    @staticmethod
    def _apply_args(batch: EventBatch) -> list[str | int]:
        ops = [
            ("s" if e.kind is EventKind.STORED else "r") + e.block_hash.hex() for e in batch.events
        ]
        return [batch.worker_id, batch.seq_start, *ops]

    def resync(self, worker_id: str, block_hashes: Iterable[bytes], next_seq: int) -> None:
        check_worker_id(worker_id)
        check_seq(next_seq, "next_seq")
        hexes = sorted({check_hash(h).hex() for h in block_hashes})
        limit = self.max_hashes_per_call
        chunks = [hexes[i : i + limit] for i in range(0, len(hexes), limit)] or [[]]
        with self._guard("resync"):
            left = self._run(self._resync_begin, worker_id, limit)
            while left > 0:
                left = self._run(self._drain, limit, worker_id)
            # One chunk per round trip: pipelined chunks could run back to back
            # inside one event-loop turn and hold Redis as long as one big script.
            for k, chunk in enumerate(chunks):
                last = k == len(chunks) - 1
                if not self._run(self._resync_add, worker_id, next_seq if last else "", *chunk):
                    logger.warning("resync of %s cut short: removed meanwhile", worker_id)
                    return

    def remove_worker(self, worker_id: str) -> None:
        check_worker_id(worker_id)
        limit = self.max_hashes_per_call
        with self._guard("remove_worker"):
            left = self._run(self._remove, worker_id, limit)
            while left > 0:
                left = self._run(self._drain, limit, worker_id)

    def heartbeat(self, worker_id: str, ttl_s: float) -> bool:
        check_worker_id(worker_id)
        ttl_ms = max(1, round(check_ttl(ttl_s) * 1000))
        with self._guard("heartbeat"):
            _, need = self._run(self._heartbeat, worker_id, ttl_ms, self.max_hashes_per_call)
        return bool(need)

    def reap(self) -> list[str]:
        limit = self.max_hashes_per_call
        with self._guard("reap"):
            dead, _, left = self._run(self._reap, limit)
            while left > 0:
                left = self._run(self._drain, limit)
        return self._worker_ids(dead, "worker id")

    # -- reads ----------------------------------------------------------------

    def match(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        keys = [self._registry, *(self.hash_key(check_hash(h)) for h in block_hashes)]
        with self._guard("match"):
            flat = self._match(keys=keys, args=[self._prefix])
        counts = {}
        for raw, n in zip(flat[::2], flat[1::2], strict=True):
            worker_id = _decode_worker_id(raw)
            if worker_id is None:
                self._skip("worker id", raw)
            else:
                counts[worker_id] = int(n)  # the script's own integer
        return counts

    def workers(self) -> list[str]:
        with self._guard("workers"):
            _, live, _ = self._run(self._reap, self.max_hashes_per_call)
        # The script removed every registered worker without an alive: key, so the
        # rest of the registry is the live set.
        return self._worker_ids(live, "worker id")

    def worker_hashes(self, worker_id: str) -> set[bytes]:
        check_worker_id(worker_id)
        with self._guard("worker_hashes"):
            members = self._redis.smembers(self.worker_key(worker_id))
        hashes = set()
        for member in members:
            block_hash = _decode_hash(member)
            if block_hash is None:
                self._skip("block hash", member)
            else:
                hashes.add(block_hash)
        return hashes

    def worker_state(self, worker_id: str) -> WorkerIndexState | None:
        check_worker_id(worker_id)
        with self._guard("worker_state"):
            nxt, resync = self._redis.hmget(f"{self._prefix}m:{worker_id}", "next", "resync")
        if nxt is None:
            return None
        try:
            return WorkerIndexState(int(nxt), resync == b"1")
        except ValueError as exc:
            raise IndexUnavailableError(
                f"{self._describe}: malformed state of worker {worker_id!r}: {nxt!r}"
            ) from exc

    def is_available(self) -> bool:
        try:
            with self._guard("ping"):
                self._redis.ping()
        except IndexUnavailableError:
            return False
        return True

    def close(self) -> None:
        self._redis.close()


def _decode_worker_id(raw: object) -> str | None:
    """A worker id from a reply, or None if it is not one (not UTF-8, not a valid id)."""
    try:
        return check_worker_id(raw.decode() if isinstance(raw, bytes) else raw)
    except (UnicodeDecodeError, TypeError, ValueError):
        return None


def _decode_hash(raw: object) -> bytes | None:
    """A block hash from its stored hex, or None if it is not one."""
    try:
        block_hash = bytes.fromhex(raw.decode())  # type: ignore[union-attr]
    except (AttributeError, UnicodeDecodeError, ValueError):
        return None
    return block_hash if len(block_hash) == HASH_SIZE else None


def _result(reply: object) -> ApplyResult:
    """An apply script's reply; anything else means the index state is not ours: resync."""
    result = _RESULTS.get(reply)  # type: ignore[call-overload]
    if result is None:
        logger.warning("redis prefix index: unexpected apply reply %r; resyncing", reply)
        return ApplyResult.GAP
    return result


def _groups(pieces: list[tuple[int, EventBatch]], limit: int) -> Iterator[list]:
    """Consecutive pieces whose events add up to at most ``limit`` (one piece at least)."""
    group: list[tuple[int, EventBatch]] = []
    size = 0
    for piece in pieces:
        n = len(piece[1].events)
        if group and size + n > limit:
            yield group
            group, size = [], 0
        group.append(piece)
        size += n
    if group:
        yield group


def _combine(replies: list[ApplyResult]) -> ApplyResult:
    """One result for a batch sent in pieces."""
    for reply in replies:
        if reply.needs_resync:
            return reply
    return ApplyResult.APPLIED if ApplyResult.APPLIED in replies else ApplyResult.DUPLICATE
