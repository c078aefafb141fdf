"""Routing policy: which worker of a role gets a request.

The interface is one verb, `rank`: order the candidates best first, each with its
score and the inputs that produced it (logged at debug level by the server). The
server takes the first candidate and falls back to the next on failure.

- `LeastLoadedPolicy`: load only (requests on the worker, queue, KV usage).
- `RoundRobinPolicy`: a baseline for benchmarks: the next worker in turn.
- `PrefixAwarePolicy`: prefix overlap from the index against load, in one cost
  (see `PrefixRouting` in config.py); it also plans cross-worker pulls: a candidate
  that lacks a prefix another worker holds is scored as if it pulled it, when that
  is cheaper than computing it, and its `Scored.pull` says from whom.

A policy that fills `Scored.compute_tokens` tells the server how much of the prompt
the worker would compute (conditional disaggregation compares it with
`disagg_min_prompt_tokens`); one that leaves it None is taken to compute it all.
"""

from __future__ import annotations

import itertools
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from pagedserve.router.config import LoadWeights, PrefixRouting
from pagedserve.router.cost import TransferEstimator
from pagedserve.router.registry import WorkerInfo


@dataclass(frozen=True)
class PrefixMatch:
    """What the prefix index says about one request's prompt (one lookup per request).

    The chain covers the full blocks of the prompt minus its last token (a worker
    always computes at least one token, so that block could never be a hit).
    """

    block_size: int
    num_blocks: int  # full blocks in the chain
    # Worker id -> leading blocks of the chain it holds, or will hold once the
    # requests this router already sent it have computed them (see PrefixLookup).
    blocks: Mapping[str, int]
    # Routable workers whose index entries hold at least one block, most blocks first
    # (then fewest of the router's calls open on them, then id): sources of a pull.
    holders: Sequence[tuple[WorkerInfo, int]] = ()
    hashes: Sequence[bytes] = ()  # the chain itself

    def held(self, worker_id: str) -> int:
        return self.blocks.get(worker_id, 0)


@dataclass(frozen=True)
class RouteRequest:
    """What a policy may look at."""

    request_id: str
    prompt_token_ids: Sequence[int]
    cache_salt: str | None = None
    # The index's answer; None when there is no index, it is unreachable (load-only
    # routing) or no worker has reported its model yet.
    prefix: PrefixMatch | None = None


@dataclass(frozen=True)
class PullPlan:
    """Pull `holder_blocks` leading blocks from `holder` (the target has `own_blocks`)."""

    holder: WorkerInfo
    holder_blocks: int
    own_blocks: int
    transfer_s: float  # estimated time to move the missing blocks
    recompute_s: float  # estimated time to compute them instead

    @property
    def blocks(self) -> int:
        """Blocks that travel."""
        return self.holder_blocks - self.own_blocks


@dataclass(frozen=True)
class Scored:
    worker: WorkerInfo
    score: float  # lower is better
    inputs: dict[str, float | str] = field(default_factory=dict)  # for the debug log
    compute_tokens: int | None = None  # prompt tokens it would compute; None = all
    pull: PullPlan | None = None  # a prefix to pull before computing, if any


class RoutingPolicy(ABC):
    # Whether the server should look the prompt up in the prefix index for this policy.
    uses_prefix_index: bool = False

    @abstractmethod
    def rank(
        self, role: str, request: RouteRequest, candidates: Sequence[WorkerInfo]
    ) -> list[Scored]:
        """`candidates` ordered best first (role: "prefill" or "decode")."""

    def assigned(self, worker: WorkerInfo, tokens: int) -> None:
        """The router sends `worker` a request that will compute `tokens` prompt tokens
        there (router/routing.py calls it once per prompt prefilled: on the prefill
        worker picked, or on the decode worker that prefills locally). A policy that
        keeps state about its decisions records it here. Default: nothing."""
        return None


def worker_load(w: WorkerInfo, weights: LoadWeights) -> tuple[float, dict[str, float | str]]:
    """A worker's load and its inputs.

    Load counts requests on the worker: the router's own in-flight calls are the
    freshest number, the last heartbeat's running + waiting also sees other routers'
    work, so the larger of the two. Waiting requests and KV usage weigh extra.
    """
    s = w.stats
    inputs: dict[str, float | str] = {
        "inflight": float(w.inflight),
        "running": float(s.num_running),
        "waiting": float(s.num_waiting),
        "kv_usage": round(float(s.kv_usage), 4),
    }
    load = (
        max(w.inflight, s.num_running + s.num_waiting)
        + weights.waiting * s.num_waiting
        + weights.kv_usage * s.kv_usage
    )
    return load, inputs


def evictions(w: WorkerInfo, new_blocks: int) -> int:
    """Cached blocks `w` would evict to hold `new_blocks` more (0 if stats are unknown)."""
    s = w.stats
    if not s.num_total_blocks or new_blocks <= 0:
        return 0
    empty = s.num_free_blocks - s.num_cached_blocks  # free and holding nothing
    return max(0, new_blocks - empty)


def occupancy(w: WorkerInfo) -> float:
    """Fraction of the worker's KV blocks holding something (in use, or cached and free)."""
    s = w.stats
    if not s.num_total_blocks:
        return 0.0
    return (s.num_total_blocks - s.num_free_blocks + s.num_cached_blocks) / s.num_total_blocks


class Backlog:
    """Prompt tokens this router sent each worker and that it has likely not computed
    yet: a virtual queue per worker, which each routing decision fills with the tokens
    the chosen worker will compute (`add`), and which drains at `tokens_per_s` (the
    configured prefill speed).

    Why: the load term counts requests, but a request that computes a 300-token prompt
    holds up whatever arrives behind it on that worker for a whole prefill step, and
    one that computes 30 tokens (a cache hit) for almost nothing. With load alone, a
    hot prefix's holder kept its requests while a cold prompt's prefill held its steps.

    The router does not see when a worker's prefill ends (the policy is not told of a
    first token), hence the drain at the configured rate: an estimate that is too slow
    only spreads requests a little more eagerly (a pull instead of a short wait), one
    that is too fast falls back to the load term alone. A worker on which this router
    has no call open (`WorkerInfo.inflight` 0) has nothing of its queued: 0, whatever
    the drain says (requests sent one after another never see the previous one's
    tokens). The price: between a decision and the dispatcher opening its call (after
    an ExportPrefix) the chosen worker's backlog reads 0.
    """

    def __init__(self, tokens_per_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.tokens_per_s = tokens_per_s
        self.clock = clock
        self._queued: dict[str, tuple[float, float]] = {}  # worker id -> (tokens, as of when)

    def tokens(self, w: WorkerInfo) -> float:
        """Tokens still queued on `w` now."""
        if not w.inflight:
            return 0.0
        queued, since = self._queued.get(w.worker_id, (0.0, 0.0))
        return max(0.0, queued - (self.clock() - since) * self.tokens_per_s)

    def add(self, w: WorkerInfo, tokens: float) -> None:
        """`w` is sent `tokens` more to compute."""
        self._queued[w.worker_id] = (self.tokens(w) + tokens, self.clock())


class LeastLoadedPolicy(RoutingPolicy):
    """Least load first; ties go to the lower worker id (deterministic)."""

    def __init__(self, weights: LoadWeights | None = None) -> None:
        self.weights = weights or LoadWeights()

    def rank(
        self, role: str, request: RouteRequest, candidates: Sequence[WorkerInfo]
    ) -> list[Scored]:
        scored = [Scored(w, *worker_load(w, self.weights)) for w in candidates]
        return sorted(scored, key=lambda s: (s.score, s.worker.worker_id))


class RoundRobinPolicy(RoutingPolicy):
    """Each role's workers in turn (by id), whatever their load or cache: a baseline."""

    def __init__(self) -> None:
        self._turn: dict[str, itertools.count] = {}

    def rank(
        self, role: str, request: RouteRequest, candidates: Sequence[WorkerInfo]
    ) -> list[Scored]:
        ordered = sorted(candidates, key=lambda w: w.worker_id)
        if not ordered:
            return []
        k = next(self._turn.setdefault(role, itertools.count())) % len(ordered)
        ordered = ordered[k:] + ordered[:k]
        return [Scored(w, float(i), {"turn": float(k)}) for i, w in enumerate(ordered)]


class PrefixAwarePolicy(RoutingPolicy):
    """Fewest prompt tokens to compute (own hits or a cheap pull) against load.

    For each candidate (prompt of P tokens, block size b, index match m):

        own      = m[candidate]                          # leading blocks it holds
        pull     = the holder with the most blocks h > own, if moving h - own blocks
                   is estimated cheaper than computing them
        reuse    = h if pull else own
        compute  = P - reuse * b                         # tokens it would compute
        queued   = prompt tokens this router sent it that it has likely not computed
                   yet (`Backlog`): the prefill work ahead of this request there
        evicted  = blocks of the chain it lacks (to pull or compute) beyond its
                   empty blocks: each evicts a cached block of another prefix
        cost     = prefix_weight * (queued + compute + transfer_s * prefill_tokens_per_s)
                 + evict_weight * evicted * b            # expected recompute later
                 + load_weight * load                    # load as LeastLoadedPolicy's

    The first term is the request's time to first token in tokens: the work queued
    ahead of it, its own, and the pull. Without `queued`, a hot prefix's holder kept
    its requests while a cold prompt's prefill held its steps (the load term counts
    requests, not their tokens), and a pull to an idle worker was not planned.

    The eviction term is what makes a holder worth a little queueing when caches are
    full: sending a request elsewhere (even with a cheap pull) duplicates its prefix
    and pushes some other prefix out of that worker's cache.

    Lowest cost first; ties (typically: a prefix nobody holds, idle workers) go to
    the worker whose KV blocks hold the least (in use or cached, as its last
    heartbeat says), so new prefixes spread over the caches instead of piling up on
    the lowest id and evicting each other; then to the lower id. Without an index answer
    (`request.prefix` None: no index, or Redis down) every candidate computes the
    whole prompt and the order is the least-loaded one.
    """

    uses_prefix_index = True

    def __init__(
        self,
        config: PrefixRouting | None = None,
        weights: LoadWeights | None = None,
        estimator: TransferEstimator | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config or PrefixRouting()
        self.weights = weights or LoadWeights()
        self.estimator = estimator or TransferEstimator(self.config)
        if self.estimator.config != self.config:
            raise ValueError("the estimator must be built from the policy's PrefixRouting config")
        self.backlog = Backlog(self.config.prefill_tokens_per_s, clock)

    def assigned(self, worker: WorkerInfo, tokens: int) -> None:
        """`worker`'s backlog grows by the tokens it was sent to compute."""
        self.backlog.add(worker, tokens)

    def rank(
        self, role: str, request: RouteRequest, candidates: Sequence[WorkerInfo]
    ) -> list[Scored]:
        scored = [self._score(w, request) for w in candidates]
        return sorted(scored, key=lambda s: (s.score, occupancy(s.worker), s.worker.worker_id))

    def _score(self, w: WorkerInfo, request: RouteRequest) -> Scored:
        load, inputs = worker_load(w, self.weights)
        prompt_len = len(request.prompt_token_ids)
        match = request.prefix
        own = match.held(w.worker_id) if match else 0
        pull = self.plan_pull(w, match) if match else None
        reuse = pull.holder_blocks if pull else own
        bs = match.block_size if match else 0
        compute = prompt_len - reuse * bs
        transfer_tokens = pull.transfer_s * self.config.prefill_tokens_per_s if pull else 0.0
        # Blocks it would newly cache (pulled or computed) beyond its empty ones evict
        # other cached prefixes, some of which will be computed again.
        new_blocks = match.num_blocks - own if match else 0
        evicted = evictions(w, new_blocks)
        queued = self.backlog.tokens(w)
        cost = (
            self.config.prefix_weight * (queued + compute + transfer_tokens)
            + self.config.evict_weight * evicted * bs
            + self.config.load_weight * load
        )
        inputs.update(
            own_blocks=float(own),
            queued_tokens=round(queued, 1),
            compute_tokens=float(compute),
            evicts_blocks=float(evicted),
            load=round(load, 4),
        )
        if pull:
            inputs.update(
                pull_from=pull.holder.worker_id,
                pull_blocks=float(pull.blocks),
                pull_transfer_ms=round(pull.transfer_s * 1000, 3),
                pull_recompute_ms=round(pull.recompute_s * 1000, 3),
            )
        return Scored(w, cost, inputs, compute, pull)

    def plan_pull(self, target: WorkerInfo, match: PrefixMatch) -> PullPlan | None:
        """Pull from the best holder when moving its extra blocks beats computing them."""
        if not self.config.pull:
            return None
        own = match.held(target.worker_id)
        for holder, blocks in match.holders:
            if holder.worker_id == target.worker_id:
                continue
            if blocks <= own:
                return None  # holders are sorted by blocks: nobody has more
            tokens = (blocks - own) * match.block_size
            transfer_s = self.estimator.transfer_s(tokens)
            recompute_s = self.estimator.compute_s(tokens)
            if transfer_s >= recompute_s:
                return None
            return PullPlan(holder, blocks, own, transfer_s, recompute_s)
        return None
