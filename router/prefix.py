"""The router's side of the global prefix index: where it lives, one match per request.

Two homes, one interface (`PrefixIndex`):

- embedded (no Redis configured): an `EmbeddedPrefixIndex` inside this router; the
  workers publish to it through the router's PrefixIndex gRPC service
  (`WorkerConfig.index_address` = the router's address);
- Redis (`RouterConfig.redis_url`): a `RedisPrefixIndex` namespaced by the workers'
  model id (`WorkerStats.model_name`, which is the engine's `model_id`), opened once
  the first worker has reported it; the workers publish to Redis themselves, and
  every router replica reads the same view.

A request's chain of block hashes is computed here exactly as the workers' block
managers compute it (`block_hashes` with the workers' block size, model id and the
request's cache salt), over the prompt minus its last token: a worker always
computes at least one token, so a block ending at the last token is never a hit.

Blocks in flight: a prompt the router has just sent to a worker is not in the index
until that worker has computed it, so a second request with the same prefix arriving
meanwhile would see nobody holding it and compute it again elsewhere. The router
therefore credits a worker with the chain of every request it is computing for this
router (`reserve`, released when the request ends), as Dynamo's and llm-d's routers
do; such blocks count for routing but not as a source of a pull.

Off the event loop: in Redis mode the router's requests look the index up with
`match_async`, which runs the round trip on a small thread pool of its own
(`LOOKUP_THREADS`): a Redis that accepts but never answers costs those threads a
socket timeout, never the event loop (health checks, GetModelInfo and the other
requests go on). When every lookup thread is busy the request is routed by load
only at once (counted as `index_busy`) rather than queued behind a stuck lookup.
The sync `match` remains for `preview` and tests (it blocks its caller).

Degraded mode: when the index cannot be used (`IndexUnavailableError`: any Redis
error, READONLY / OOM / NOPERM answers included; or any unexpected error of a lookup)
the match is None and routing goes by load only; the index is tried again after
`PrefixRouting.index_retry_s`, so an outage costs one failed call per period, not
one per request. When Redis answers again the workers resync their full lists by
themselves (their publishers see the empty index as a gap), so the index refills
within a publisher retry period. A stale entry (a block the worker evicted since)
costs a recompute on that worker, never a wrong answer: workers compare token ids
on every hit and an export of a missing prefix answers NOT_FOUND.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from pagedserve.common.api.hashing import block_hashes
from pagedserve.common.runtime.prefix_index import (
    EmbeddedPrefixIndex,
    IndexUnavailableError,
    PrefixIndex,
    open_prefix_index,
)
from pagedserve.router.config import RouterConfig
from pagedserve.router.policy import PrefixMatch
from pagedserve.router.registry import WorkerRegistry

logger = logging.getLogger(__name__)

EMBEDDED_NAMESPACE = "embedded"  # one router serves one model: no need to tell them apart
LOOKUP_THREADS = 4  # Redis lookups in flight at once (~120 us each when Redis is healthy)


def hash_chain(
    prompt_token_ids: Sequence[int], cache_salt: str | None, model_id: str, block_size: int
) -> list[bytes]:
    """The chain a worker would compute for this prompt (pure: safe on any thread)."""
    return block_hashes(prompt_token_ids[:-1], block_size, model_id, cache_salt)


class PrefixLookup:
    def __init__(
        self,
        config: RouterConfig,
        registry: WorkerRegistry,
        counters: collections.Counter[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.registry = registry
        self.counters = counters if counters is not None else collections.Counter()
        self.clock = clock
        self.redis_url = config.redis_url
        # The embedded index, served to the workers by the router (None in Redis mode).
        self.embedded: EmbeddedPrefixIndex | None = (
            None if self.redis_url else EmbeddedPrefixIndex(EMBEDDED_NAMESPACE)
        )
        self._redis: dict[str, PrefixIndex] = {}  # model id -> its Redis index
        self._pending: dict[str, collections.Counter[bytes]] = {}  # worker -> chain refcounts
        self.retry_at = 0.0  # clock time before which the index is not tried (after a failure)
        self.unavailable = False  # the last call failed (degraded: load-only routing)
        self._lookups: ThreadPoolExecutor | None = None  # Redis mode: match_async's threads
        self._in_flight = 0  # match_async lookups running on those threads
        self._scripts_loaded: set[str] = set()  # model ids whose scripts were loaded

    def index(self, model_id: str | None = None) -> PrefixIndex | None:
        """The index for `model_id` (the registry's model when None); None if unknown yet."""
        if self.embedded is not None:
            return self.embedded
        model_id = model_id or self.registry.model_id()
        if not model_id:
            return None
        index = self._redis.get(model_id)
        if index is None:
            assert self.redis_url
            from pagedserve.common.runtime.prefix_index.connection import client_name

            index = self._redis[model_id] = open_prefix_index(
                self.redis_url, model_id, name=client_name("router", "index")
            )
            logger.info("prefix index: redis %s, namespace %r", index.url, model_id)  # type: ignore[attr-defined]
        return index

    def chain_key(self) -> tuple[str, int] | None:
        """(model id, block size) the workers hash with; None before any worker reported."""
        model_id = self.registry.model_id()
        if model_id is None:
            return None
        return model_id, self.registry.block_size()

    def chain(self, prompt_token_ids: Sequence[int], cache_salt: str | None) -> list[bytes] | None:
        """The prompt's block hashes as the workers compute them; None before any worker."""
        key = self.chain_key()
        return None if key is None else hash_chain(prompt_token_ids, cache_salt, *key)

    def match(
        self,
        prompt_token_ids: Sequence[int],
        cache_salt: str | None,
        hashes: list[bytes] | None = None,
    ) -> PrefixMatch | None:
        """Per routable worker, how many leading blocks of the prompt it holds.

        `hashes`: the prompt's chain if the caller computed it already (the router
        hashes off its event loop, `hash_chain` with `chain_key()`).
        None: no worker has reported its model yet, or the index is unusable (then it
        is not asked again before `index_retry_s`). Blocks on the index round trip:
        the router's requests use `match_async`.
        """
        plan = self._lookup_plan(prompt_token_ids, cache_salt, hashes)
        if not isinstance(plan, tuple):
            return plan
        hashes, index = plan
        try:
            counts = index.match(hashes)
        except Exception as e:
            self._outage(e)
            return None
        return self._matched(hashes, counts)

    async def match_async(
        self,
        prompt_token_ids: Sequence[int],
        cache_salt: str | None,
        hashes: list[bytes] | None = None,
    ) -> PrefixMatch | None:
        """`match`, with a Redis round trip run on the lookup threads, off the event loop."""
        if self.embedded is not None:  # in memory: nothing to wait for
            return self.match(prompt_token_ids, cache_salt, hashes)
        plan = self._lookup_plan(prompt_token_ids, cache_salt, hashes)
        if not isinstance(plan, tuple):
            return plan
        hashes, index = plan
        if self._in_flight >= LOOKUP_THREADS:
            self.counters["index_busy"] += 1
            return None
        if self._lookups is None:
            self._lookups = ThreadPoolExecutor(LOOKUP_THREADS, thread_name_prefix="index-lookup")
        model_id = self.registry.model_id() or ""
        self._in_flight += 1
        try:
            loop = asyncio.get_running_loop()
            counts = await loop.run_in_executor(
                self._lookups, self._lookup, index, model_id, hashes
            )
        except Exception as e:
            self._outage(e)
            return None
        finally:
            self._in_flight -= 1
        return self._matched(hashes, counts)

    def _lookup(self, index: PrefixIndex, model_id: str, hashes: list[bytes]) -> dict[str, int]:
        """On a lookup thread: load the scripts once (so later matches are 1 RTT), match."""
        if model_id not in self._scripts_loaded:
            with contextlib.suppress(IndexUnavailableError):  # else loaded on first use
                index.load_scripts()  # type: ignore[attr-defined]
                self._scripts_loaded.add(model_id)
        return index.match(hashes)

    def _lookup_plan(
        self, prompt_token_ids: Sequence[int], cache_salt: str | None, hashes: list[bytes] | None
    ) -> tuple[list[bytes], PrefixIndex] | PrefixMatch | None:
        """(chain, index) to look up; or the answer itself when no lookup is due: None (no
        model yet, backing off, no index) or an empty match (a prompt under one block)."""
        hashes = self._hashes_to_look_up(prompt_token_ids, cache_salt, hashes)
        if not hashes:
            return None if hashes is None else PrefixMatch(self.registry.block_size(), 0, {})
        index = self.index()
        if index is None:
            return None
        return hashes, index

    def _hashes_to_look_up(
        self,
        prompt_token_ids: Sequence[int],
        cache_salt: str | None,
        hashes: list[bytes] | None = None,
    ) -> list[bytes] | None:
        """The chain to look up (`hashes` if given); None when no lookup is due (no model
        yet, backing off)."""
        if hashes is None:
            hashes = self.chain(prompt_token_ids, cache_salt)
        if hashes is None or self.clock() < self.retry_at:
            return None
        return hashes

    def _matched(self, hashes: list[bytes], counts: dict[str, int]) -> PrefixMatch:
        if self.unavailable:
            logger.warning("prefix index reachable again: prefix-aware routing resumes")
            self.unavailable = False
        bs = self.registry.block_size()
        blocks = {w: n for w, n in counts.items() if n}
        holders = [
            (info, n)
            for w, n in blocks.items()
            if (info := self.registry.get(w)) and not info.stats.draining  # leaving: no pulls
        ]
        holders.sort(key=lambda h: (-h[1], h[0].inflight, h[0].worker_id))
        for worker_id, pending in self._pending.items():
            n = next((i for i, h in enumerate(hashes) if h not in pending), len(hashes))
            if n > blocks.get(worker_id, 0):
                blocks[worker_id] = n
        return PrefixMatch(bs, len(hashes), blocks, holders, tuple(hashes))

    def reserve(self, worker_id: str, hashes: Sequence[bytes]) -> Callable[[], None]:
        """Credit `worker_id` with `hashes` (a request is computing them there) until the
        returned function is called. Runs on the router's loop: no locks."""
        pending = self._pending.setdefault(worker_id, collections.Counter())
        pending.update(hashes)

        def release() -> None:
            pending.subtract(hashes)
            for h in hashes:
                if pending[h] <= 0:
                    pending.pop(h, None)
            if not pending and self._pending.get(worker_id) is pending:
                del self._pending[worker_id]

        return release

    def _outage(self, e: Exception) -> None:
        """A failed lookup (now, after it returned): load-only until `index_retry_s` passed."""
        self.counters["index_unavailable"] += 1
        self.retry_at = self.clock() + self.config.prefix.index_retry_s
        if not self.unavailable:
            logger.warning(
                "prefix index unusable, routing by load only: %s: %s",
                type(e).__name__,
                e,
                exc_info=not isinstance(e, IndexUnavailableError),
            )
        self.unavailable = True

    def close(self) -> None:
        if self._lookups is not None:
            self._lookups.shutdown(wait=False, cancel_futures=True)
            self._lookups = None
        for index in self._redis.values():
            index.close()
        self._redis.clear()
