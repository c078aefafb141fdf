"""What the pulls of one transport moved and how they failed, as plain counters.

`AutoTransport` records every pull here (kvtransfer/transport.py); a worker's
Prometheus exporter (common/runtime/metrics.py) reads `snapshot()` at scrape time and
registers a listener for the per-pull duration histogram. Nothing here imports
Prometheus: kvtransfer moves bytes and only counts them.

Counted per pull (one `pull_into` call, a shared-memory fallback to gRPC included):
- success: pulls, payload bytes and blocks by the transport that moved them, and the
  blocks the lease offered that the puller did not ask for ("reused": the puller
  already held them, e.g. its own prefix-cache hits of an imported prompt);
- failure: its cause (`failure_cause`), and checksum mismatches on their own.
Pulls run on many handler threads at once: updates take a lock (a few per pull).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from pagedserve.kvtransfer.wire import KVTransferError

logger = logging.getLogger(__name__)

CAUSES = (
    "checksum",  # a chunk did not match its checksum (KVChecksumError)
    "lease_not_found",  # unknown, released or expired lease
    "timeout",  # the pull's deadline passed
    "unavailable",  # the exporter did not answer (gRPC UNAVAILABLE)
    "cancelled",  # the request it was for ended during the pull
    "resource_exhausted",  # the exporter refused (gRPC RESOURCE_EXHAUSTED)
    "transfer",  # a malformed, inconsistent or truncated stream
    "invalid",  # bad block ids or layer range (ValueError)
    "other",  # anything else (an unexpected exception)
)


def failure_cause(error: BaseException) -> str:
    """One of CAUSES for an exception a pull raised."""
    if isinstance(error, KVTransferError):
        return error.cause if error.cause in CAUSES else "transfer"
    if isinstance(error, ValueError):
        return "invalid"
    if isinstance(error, grpc.RpcError):
        return "unavailable" if error.code() == grpc.StatusCode.UNAVAILABLE else "transfer"
    return "other"


@dataclass(frozen=True)
class PullRecord:
    """One pull: what it moved, or why it failed (`failure` set, counts 0)."""

    transport: str  # "shm" or "grpc": the transport that moved it (or was tried last)
    seconds: float
    payload_bytes: int = 0
    pulled_blocks: int = 0
    reused_blocks: int = 0
    failure: str | None = None


@dataclass(frozen=True)
class TransferSnapshot:
    pulls: dict[str, int] = field(default_factory=dict)  # transport -> successful pulls
    bytes: dict[str, int] = field(default_factory=dict)  # transport -> payload bytes
    pulled_blocks: dict[str, int] = field(default_factory=dict)  # transport -> blocks
    reused_blocks: int = 0
    failures: dict[str, int] = field(default_factory=dict)  # cause -> failed pulls
    checksum_mismatches: int = 0


class TransferStats:
    """Cumulative counters of a transport's pulls; `listeners` see every record."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pulls: collections.Counter[str] = collections.Counter()
        self._bytes: collections.Counter[str] = collections.Counter()
        self._blocks: collections.Counter[str] = collections.Counter()
        self._failures: collections.Counter[str] = collections.Counter()
        self._reused = 0
        # Called on the pulling thread after each record (e.g. a histogram's observe);
        # append before pulls start. A listener that raises loses only its own update.
        self.listeners: list[Callable[[PullRecord], None]] = []

    def record(self, rec: PullRecord) -> None:
        with self._lock:
            if rec.failure is None:
                self._pulls[rec.transport] += 1
                self._bytes[rec.transport] += rec.payload_bytes
                self._blocks[rec.transport] += rec.pulled_blocks
                self._reused += rec.reused_blocks
            else:
                self._failures[rec.failure] += 1
        for listener in self.listeners:
            try:
                listener(rec)
            except Exception:  # metrics must never fail a pull
                logger.exception("a KV transfer stats listener failed")

    def snapshot(self) -> TransferSnapshot:
        with self._lock:
            return TransferSnapshot(
                pulls=dict(self._pulls),
                bytes=dict(self._bytes),
                pulled_blocks=dict(self._blocks),
                reused_blocks=self._reused,
                failures=dict(self._failures),
                checksum_mismatches=self._failures["checksum"],
            )
