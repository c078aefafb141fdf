"""Routing policy: which worker of a role gets a request.

The interface is one verb, `rank`: order the candidates best first, each with its
score and the inputs that produced it (logged at debug level by the server). The
server takes the first candidate and falls back to the next on failure. Issue 6's
prefix-aware policy implements the same verb, adding per-candidate prefix overlap
from the index to the load terms; `RouteRequest` already carries what it needs
(token ids and cache salt, from which the block hashes follow).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedserve.router.config import LoadWeights
from pagedserve.router.registry import WorkerInfo


@dataclass(frozen=True)
class RouteRequest:
    """What a policy may look at."""

    request_id: str
    prompt_token_ids: Sequence[int]
    cache_salt: str | None = None


@dataclass(frozen=True)
class Scored:
    worker: WorkerInfo
    score: float  # lower is better
    inputs: dict[str, float] = field(default_factory=dict)  # for the debug log


class RoutingPolicy(ABC):
    @abstractmethod
    def rank(
        self, role: str, request: RouteRequest, candidates: Sequence[WorkerInfo]
    ) -> list[Scored]:
        """`candidates` ordered best first (role: "prefill" or "decode")."""


class LeastLoadedPolicy(RoutingPolicy):
    """Least load first; ties go to the lower worker id (deterministic).

    Load counts requests on the worker: the router's own in-flight calls are the
    freshest number, the last heartbeat's running + waiting also sees other routers'
    work, so the larger of the two. Waiting requests and KV usage weigh extra (see
    LoadWeights).
    """

    def __init__(self, weights: LoadWeights | None = None) -> None:
        self.weights = weights or LoadWeights()

    def rank(
        self, role: str, request: RouteRequest, candidates: Sequence[WorkerInfo]
    ) -> list[Scored]:
        scored = [self._score(w) for w in candidates]
        return sorted(scored, key=lambda s: (s.score, s.worker.worker_id))

    def _score(self, w: WorkerInfo) -> Scored:
        s = w.stats
        inputs = {
            "inflight": float(w.inflight),
            "running": float(s.num_running),
            "waiting": float(s.num_waiting),
            "kv_usage": round(float(s.kv_usage), 4),
        }
        load = (
            max(w.inflight, s.num_running + s.num_waiting)
            + self.weights.waiting * s.num_waiting
            + self.weights.kv_usage * s.kv_usage
        )
        return Scored(w, load, inputs)
