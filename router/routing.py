"""The routing decision of one request: which workers, and whether to disaggregate.

  - hash the prompt's blocks (on the frontend threads, never on the event loop) and
    look them up in the prefix index (router/prefix.py; one round trip; skipped by
    policies that ignore it, load only while it is down);
  - rank the workers of a role (router/policy.py: blocks each would not compute,
    against its load) and take the best one not tried yet (`Routing.pick`);
  - conditional disaggregation (`Routing.disaggregate`): when the best decode worker
    would compute fewer than `disagg_min_prompt_tokens` prompt tokens (the prompt
    minus the prefix it holds or will pull: the next turn of a chat it served) or no
    prefill worker is live, it prefills locally; otherwise Prefill on the best
    prefill worker (router/dispatch.py).

On the router's event loop only (no locks).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pagedserve.router.config import RouterConfig
from pagedserve.router.frontend import ResolvedRequest
from pagedserve.router.policy import (
    LeastLoadedPolicy,
    PrefixAwarePolicy,
    PrefixMatch,
    RouteRequest,
    RoutingPolicy,
    Scored,
)
from pagedserve.router.prefix import PrefixLookup, hash_chain
from pagedserve.router.registry import WorkerRegistry

logger = logging.getLogger(__name__)
T = TypeVar("T")


def default_policy(config: RouterConfig) -> RoutingPolicy:
    """Prefix-aware (the default) or least-loaded (`config.prefix.enabled` False)."""
    if config.prefix.enabled:
        return PrefixAwarePolicy(config.prefix, config.load_weights)
    return LeastLoadedPolicy(config.load_weights)


def computes(choice: Scored, prompt_len: int) -> int:
    """Prompt tokens `choice` would compute (a policy that does not say: all of them)."""
    return prompt_len if choice.compute_tokens is None else choice.compute_tokens


@dataclass(eq=False)
class Routing:
    """The policy applied to the live workers, with the prefix index's match.

    `frontend_pool`: the threads that tokenize and hash (`off_loop`); `counters` gets
    the index lookups and the local-prefill decisions.
    """

    config: RouterConfig
    policy: RoutingPolicy
    registry: WorkerRegistry
    prefix: PrefixLookup
    counters: collections.Counter[str]
    frontend_pool: concurrent.futures.Executor

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the frontend threads."""
        return await asyncio.get_running_loop().run_in_executor(self.frontend_pool, fn, *args)

    def route_request(self, r: ResolvedRequest, hashes: list[bytes] | None = None) -> RouteRequest:
        """What the policy sees: the request plus, for a prefix-aware policy, the index's
        per-worker match of its prompt (None while the index is unreachable).

        `hashes`: the prompt's chain if computed already (hashed here when None: fine
        for previews, not for requests). Blocks on a Redis index (for `preview`);
        requests use `route`, which hashes and looks up off the event loop."""
        match = None
        if self.policy.uses_prefix_index:
            match = self.prefix.match(r.prompt_token_ids, r.cache_salt, hashes)
        return self._route_request(r, match)

    async def route_request_async(
        self, r: ResolvedRequest, hashes: list[bytes] | None = None
    ) -> RouteRequest:
        """`route_request` with the index lookup off the event loop (router/prefix.py)."""
        match = None
        if self.policy.uses_prefix_index:
            match = await self.prefix.match_async(r.prompt_token_ids, r.cache_salt, hashes)
        return self._route_request(r, match)

    def _route_request(self, r: ResolvedRequest, match: PrefixMatch | None) -> RouteRequest:
        if self.policy.uses_prefix_index:
            self.counters["index_lookups" if match is not None else "index_skipped"] += 1
            if match is not None and match.holders:  # for the metrics (router/metrics.py)
                self.counters["index_hits"] += 1
                self.counters["index_hit_blocks"] += match.holders[0][1]
            if match is not None:
                self.counters["index_query_blocks"] += match.num_blocks
        return RouteRequest(r.request_id, r.prompt_token_ids, r.cache_salt, match)

    async def route(self, r: ResolvedRequest) -> RouteRequest:
        """`route_request` with the prompt hashed on the frontend threads."""
        hashes = None
        key = self.prefix.chain_key() if self.policy.uses_prefix_index else None
        if key is not None:
            hashes = await self.off_loop(hash_chain, r.prompt_token_ids, r.cache_salt, *key)
        return await self.route_request_async(r, hashes)

    def pick(self, role: str, rr: RouteRequest, exclude: set[str]) -> Scored | None:
        """The policy's best live worker for `role`, minus `exclude`; logs the inputs.
        A prefill worker picked computes the prompt (less its hits): the policy is told
        (`RoutingPolicy.assigned`); a decode worker, only once it prefills locally
        (`disaggregate`), since after a Prefill it computes nothing."""
        ranked = self.policy.rank(role, rr, self.registry.candidates(role, exclude))
        if ranked and role == "prefill":
            self.policy.assigned(ranked[0].worker, computes(ranked[0], len(rr.prompt_token_ids)))
        if logger.isEnabledFor(logging.DEBUG):
            m = rr.prefix
            logger.debug(
                "route %s %s prompt_tokens=%d chain_blocks=%s index=%s excluded=%s "
                "candidates=%s -> %s",
                rr.request_id,
                role,
                len(rr.prompt_token_ids),
                m.num_blocks if m else None,
                dict(m.blocks) if m else "none",
                sorted(exclude),
                [(s.worker.worker_id, round(s.score, 3), s.inputs) for s in ranked],
                ranked[0].worker.worker_id if ranked else None,
            )
        return ranked[0] if ranked else None

    def preview(
        self, role: str, prompt_token_ids: list[int], cache_salt: str | None = None
    ) -> list[Scored]:
        """How a request with this prompt would be ranked now (for tests and debugging)."""
        r = ResolvedRequest("preview", list(prompt_token_ids), None, cache_salt)  # type: ignore[arg-type]
        return self.policy.rank(role, self.route_request(r), self.registry.candidates(role))

    def disaggregate(self, r: ResolvedRequest, decode: Scored) -> bool:
        """Prefill on a prefill worker, or locally on `decode`?

        Locally when the part of the prompt `decode` would compute (the prompt minus
        the prefix it holds or will pull, as the policy scored it) is shorter than
        `disagg_min_prompt_tokens`, or when no prefill worker is live.
        """
        uncached = computes(decode, r.prompt_len)
        if uncached >= self.config.disagg_min_prompt_tokens:
            return True
        self.policy.assigned(decode.worker, uncached)
        logger.debug(
            "route %s: %d of %d prompt tokens to compute on %s < disagg_min_prompt_tokens %d: "
            "local prefill",
            r.request_id,
            uncached,
            r.prompt_len,
            decode.worker.worker_id,
            self.config.disagg_min_prompt_tokens,
        )
        short = r.prompt_len < self.config.disagg_min_prompt_tokens
        self.counters["local_prefill_short" if short else "local_prefill_cached"] += 1
        return False
