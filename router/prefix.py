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

Degraded mode: when the index cannot be reached (`IndexUnavailableError`) the match
is None and routing goes by load only; the index is tried again after
`PrefixRouting.index_retry_s`, so an outage costs one failed call per period, not
one per request. When Redis answers again the workers resync their full lists by
themselves (their publishers see the empty index as a gap), so the index refills
within a publisher retry period. A stale entry (a block the worker evicted since)
costs a recompute on that worker, never a wrong answer: workers compare token ids
on every hit and an export of a missing prefix answers NOT_FOUND.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

from pagedserve.common.block_manager import block_hashes
from pagedserve.common.prefix_index import (
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
            index = self._redis[model_id] = open_prefix_index(self.redis_url, model_id)
            logger.info("prefix index: redis %s, namespace %r", index.url, model_id)  # type: ignore[attr-defined]
            with contextlib.suppress(IndexUnavailableError):  # else loaded on first use
                index.load_scripts()  # type: ignore[attr-defined]  (even the first match: 1 RTT)
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
        None: no worker has reported its model yet, or the index is unreachable
        (then it is not asked again before `index_retry_s`).
        """
        if hashes is None:
            hashes = self.chain(prompt_token_ids, cache_salt)
        if hashes is None or self.clock() < self.retry_at:
            return None
        bs = self.registry.block_size()
        if not hashes:
            return PrefixMatch(bs, 0, {})
        index = self.index()
        if index is None:
            return None
        try:
            counts = index.match(hashes)
        except IndexUnavailableError as e:
            self._outage(e)
            return None
        if self.unavailable:
            logger.warning("prefix index reachable again: prefix-aware routing resumes")
            self.unavailable = False
        blocks = {w: n for w, n in counts.items() if n}
        holders = [(info, n) for w, n in blocks.items() if (info := self.registry.get(w))]
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

    def _outage(self, e: IndexUnavailableError) -> None:
        self.counters["index_unavailable"] += 1
        self.retry_at = self.clock() + self.config.prefix.index_retry_s
        if not self.unavailable:
            logger.warning("prefix index unreachable, routing by load only: %s", e)
        self.unavailable = True

    def close(self) -> None:
        for index in self._redis.values():
            index.close()
        self._redis.clear()
