"""What a worker's answer means for a request: failure, refusal, or final; the retry budget.

A worker *failure* is UNAVAILABLE (also marks the worker down), INTERNAL/UNKNOWN (its
forward failed the batch), CANCELLED by the worker, a Prefill past
`prefill_timeout_s`, or a Decode stream that stalls (router/watch.py). A request is
retried after a failure at most once, counted over both hops, never replayed around
the pool: a request that breaks every worker's forward breaks two. (The local prefill
after failed Prefills is not a retry: the decode worker runs the request anyway.) A
*refusal* is RESOURCE_EXHAUSTED (the worker's waiting queue or its RPC threads are
full; nothing ran): the request moves to a worker not tried yet, each worker once,
without using the retry; when every decode worker refused, the client gets
RESOURCE_EXHAUSTED. INVALID_ARGUMENT (the request's own fault) and the client's own
deadline are never retried.

Used by router/dispatch.py (the request's path), which decides with `Failure.kind`
and `Attempts.allow`, and ends the client's call with an `Abort`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from pagedserve.router.registry import WorkerInfo

# Downstream codes passed to the client as they are. CANCELLED from a worker (it shut
# down, or aborted the request itself; our own client's cancel never gets here) is a
# worker failure to the client: UNAVAILABLE. So is FAILED_PRECONDITION: a decode
# worker refusing a KV handle whose exporter it does not know as a live peer (its
# peer list lags a registration or a leave by a heartbeat; kvtransfer/validate.py):
# the request may go to another worker. Anything else becomes INTERNAL.
_PASS_THROUGH = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE,
}
# What a worker's answer means for the request (see the module docstring).
_FAILED = {
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.CANCELLED,
}
_REFUSED = grpc.StatusCode.RESOURCE_EXHAUSTED


class Abort(Exception):
    """End the client's call with this status (raised inside the request path)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Stalled(Exception):
    """A Decode stream made no progress within its bound (router/watch.py)."""

    def __init__(self, details: str, dropped: bool) -> None:
        super().__init__(details)
        self.details = details
        self.dropped = dropped  # the worker had left the registry


def no_worker_message(role: str, tried: set[str]) -> str:
    if tried:
        return f"no live {role} worker left to serve the request (tried {sorted(tried)})"
    return f"no live {role} worker: the {role} pool is empty or every worker is down"


@dataclass
class Failure:
    """What went wrong on one worker, for the retry decision and the client's message."""

    code: grpc.StatusCode
    details: str
    role: str
    worker: WorkerInfo
    stalled: bool = False
    dropped: bool = False

    @classmethod
    def of(cls, e: grpc.aio.AioRpcError | Stalled, role: str, worker: WorkerInfo) -> Failure:
        if isinstance(e, Stalled):
            return cls(grpc.StatusCode.UNAVAILABLE, e.details, role, worker, True, e.dropped)
        return cls(e.code(), e.details() or "", role, worker)

    def kind(self) -> str:
        """ "refused" (nothing ran: try another), "failed" (may retry once) or "final"."""
        if self.code == _REFUSED:
            return "refused"
        return "failed" if self.code in _FAILED else "final"

    def message(self, streamed: int) -> str:
        where = f"{self.role} worker {self.worker.worker_id} ({self.worker.address})"
        if streamed:
            where += f" (after {streamed} streamed messages)"
        return f"{where}: {self.details}"

    def abort(self, streamed: int) -> Abort:
        code = self.code
        if code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.FAILED_PRECONDITION):
            code = grpc.StatusCode.UNAVAILABLE
        elif code not in _PASS_THROUGH:
            code = grpc.StatusCode.INTERNAL
        return Abort(code, self.message(streamed))


@dataclass
class Attempts:
    """One request's retry budget, over both hops: one retry after a failure; refusals
    (RESOURCE_EXHAUSTED: nothing ran) move the request without using it."""

    retries_left: int = 1
    refused: set[str] = field(default_factory=set)
    failures: list[Failure] = field(default_factory=list)

    def allow(self, kind: str, failure: Failure) -> bool:
        """Whether the request may go on to another worker after `failure`."""
        if kind == "refused":
            self.refused.add(failure.worker.worker_id)
            return True
        self.failures.append(failure)
        if self.retries_left <= 0:
            return False
        self.retries_left -= 1
        return True

    def none_left(self, role: str, tried: set[str]) -> Abort:
        """The abort when no `role` worker is left to try."""
        if tried and tried <= self.refused:
            return Abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"every live {role} worker is full (refused by {sorted(tried)}): retry later",
            )
        message = no_worker_message(role, tried)
        if self.failures:
            message += f"; last failure: {self.failures[-1].message(0)}"
        return Abort(grpc.StatusCode.UNAVAILABLE, message)
