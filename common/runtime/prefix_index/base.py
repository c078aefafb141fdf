"""The global prefix index: its interface and the events workers send to it.

The index answers one question for the router: *for this chain of block hashes,
how many leading blocks does each live worker already hold?* Workers keep it
current by publishing what their block manager reports (a full block cached ->
``STORED``, a cached block evicted -> ``REMOVED``).

Sequence numbers and resync
---------------------------
Every event a worker publishes gets the next number of a per-worker counter;
events travel in an :class:`EventBatch` that covers ``[seq_start, seq_end)``.
The index remembers, per worker, the next number it expects:

- ``seq_start == expected``                -> applied
- ``seq_end <= expected``                  -> a redelivered batch: ignored (``DUPLICATE``)
- ``seq_start < expected < seq_end``       -> only the unseen tail is applied
- ``seq_start > expected``                 -> events were lost: ``GAP``; the worker is
  marked as needing resync and its batches are ignored (``RESYNC_PENDING``) until
  :meth:`PrefixIndex.resync` replaces its entries wholesale.

A worker the index does not know (first contact, an index that restarted empty,
a worker that was removed or reaped) is also a ``GAP``: a worker enters the
index only through a resync, so an index never holds half of a worker's state.
Resync carries the number of the first event *not* reflected in the snapshot.
While a worker awaits its resync, its last known entries still count in
``match``: a stale entry costs the router a recompute, never a wrong answer.

Why a snapshot plus a replay converges: both events are set operations on one
hash ("holds" / "does not hold"), so the state of a hash is decided by its last
event. A snapshot taken after some events were numbered but before they were
applied already reflects them; replaying them on top changes nothing in the end.

Liveness
--------
``heartbeat(worker, ttl_s)`` keeps a worker alive for ``ttl_s`` seconds. Only
live workers appear in :meth:`match` and :meth:`workers`. A worker whose
heartbeat lapsed is reaped (all its entries dropped) by the next ``heartbeat``
of any worker, by :meth:`workers`, or by :meth:`reap`; a worker must therefore
heartbeat before (or right after) its resync. ``remove_worker`` is the goodbye.

``heartbeat`` answers whether the index needs the worker's full list (it holds no
sequence state for it, or awaits its resync). A reaped worker that caches nothing
new sends no batch whose ``GAP`` would tell it that it was forgotten; without this
answer an idle worker stayed out of ``match`` until its next event, its cached
prefixes invisible to every router.

Hashes are the block manager's chained block hashes: ``HASH_SIZE`` raw bytes.
This module imports nothing outside the standard library.
"""

from __future__ import annotations

import enum
import struct
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

HASH_SIZE = 16
"""Length in bytes of a block hash (the block manager's chained hash)."""

MAX_WORKER_ID_LEN = 256


class IndexUnavailableError(RuntimeError):
    """The index backend cannot be reached (Redis down, refused, timed out).

    The router catches it and routes by load only; publishers catch it and
    resync once the backend answers again.
    """


class EventKind(enum.IntEnum):
    """What happened to a block hash on a worker (the wire value is the int)."""

    STORED = 1
    REMOVED = 2


class ApplyResult(enum.Enum):
    """What the index did with an :class:`EventBatch`."""

    APPLIED = "applied"  # some or all events were new and are now reflected
    DUPLICATE = "duplicate"  # every event was already applied: nothing changed
    GAP = "gap"  # events were lost (or the worker is unknown): resync needed now
    RESYNC_PENDING = "pending"  # ignored: still waiting for this worker's resync

    @property
    def needs_resync(self) -> bool:
        return self in (ApplyResult.GAP, ApplyResult.RESYNC_PENDING)


def check_hash(block_hash: object) -> bytes:
    """Return ``block_hash`` as bytes, or raise naming what is wrong with it."""
    if not isinstance(block_hash, (bytes, bytearray, memoryview)):
        raise TypeError(f"block hash must be bytes, got {type(block_hash).__name__}")
    block_hash = bytes(block_hash)
    if len(block_hash) != HASH_SIZE:
        raise ValueError(f"block hash must be {HASH_SIZE} bytes, got {len(block_hash)}")
    return block_hash


def check_worker_id(worker_id: object) -> str:
    """Return ``worker_id`` if it is a usable id, else raise naming the problem."""
    if not isinstance(worker_id, str):
        raise TypeError(f"worker id must be str, got {type(worker_id).__name__}")
    if not worker_id or len(worker_id) > MAX_WORKER_ID_LEN:
        raise ValueError(f"worker id must be 1..{MAX_WORKER_ID_LEN} characters, got {worker_id!r}")
    if not worker_id.isprintable() or any(c.isspace() for c in worker_id):
        raise ValueError(f"worker id must be printable without whitespace, got {worker_id!r}")
    return worker_id


def check_seq(seq: object, what: str = "sequence number") -> int:
    if isinstance(seq, bool) or not isinstance(seq, int):
        raise TypeError(f"{what} must be int, got {type(seq).__name__}")
    if seq < 0:
        raise ValueError(f"{what} must be >= 0, got {seq}")
    return seq


def check_ttl(ttl_s: object) -> float:
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)):
        raise TypeError(f"ttl_s must be a number of seconds, got {type(ttl_s).__name__}")
    if not ttl_s > 0 or ttl_s == float("inf"):
        raise ValueError(f"ttl_s must be a positive finite number of seconds, got {ttl_s}")
    return float(ttl_s)


@dataclass(frozen=True, slots=True)
class IndexEvent:
    """One change to a worker's cached blocks."""

    kind: EventKind
    block_hash: bytes

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", EventKind(self.kind))
        object.__setattr__(self, "block_hash", check_hash(self.block_hash))

    @staticmethod
    def stored(block_hash: bytes) -> IndexEvent:
        return IndexEvent(EventKind.STORED, block_hash)

    @staticmethod
    def removed(block_hash: bytes) -> IndexEvent:
        return IndexEvent(EventKind.REMOVED, block_hash)


# Wire layout of an EventBatch (little endian, no pickle):
#   magic b"PSIX" | version u8 | seq_start u64 | worker_id_len u16 | count u32
#   | worker_id utf-8 [worker_id_len] | count x (kind u8 | hash [HASH_SIZE])
_MAGIC = b"PSIX"
_VERSION = 1
_HEADER = struct.Struct("<4sBQHI")
_EVENT = struct.Struct(f"<B{HASH_SIZE}s")


@dataclass(frozen=True, slots=True)
class EventBatch:
    """Events ``seq_start, seq_start + 1, ...`` of one worker, in order."""

    worker_id: str
    seq_start: int
    events: tuple[IndexEvent, ...]

    def __post_init__(self) -> None:
        check_worker_id(self.worker_id)
        check_seq(self.seq_start, "seq_start")
        events = tuple(self.events)
        for i, event in enumerate(events):
            if not isinstance(event, IndexEvent):
                raise TypeError(f"events[{i}] must be an IndexEvent, got {type(event).__name__}")
        object.__setattr__(self, "events", events)

    @property
    def seq_end(self) -> int:
        """One past the last sequence number in this batch."""
        return self.seq_start + len(self.events)

    def to_bytes(self) -> bytes:
        worker = self.worker_id.encode()
        header = _HEADER.pack(_MAGIC, _VERSION, self.seq_start, len(worker), len(self.events))
        body = b"".join(_EVENT.pack(int(e.kind), e.block_hash) for e in self.events)
        return header + worker + body

    @staticmethod
    def from_bytes(data: bytes) -> EventBatch:
        if len(data) < _HEADER.size:
            raise ValueError(f"event batch too short: {len(data)} bytes < header {_HEADER.size}")
        magic, version, seq_start, worker_len, count = _HEADER.unpack_from(data)
        if magic != _MAGIC:
            raise ValueError(f"not an event batch: magic {magic!r} != {_MAGIC!r}")
        if version != _VERSION:
            raise ValueError(f"unsupported event batch version {version} (expected {_VERSION})")
        expected = _HEADER.size + worker_len + count * _EVENT.size
        if len(data) != expected:
            raise ValueError(f"event batch length {len(data)} != {expected} for {count} events")
        offset = _HEADER.size + worker_len
        worker_id = data[_HEADER.size : offset].decode()
        events = []
        for i in range(count):
            kind, block_hash = _EVENT.unpack_from(data, offset + i * _EVENT.size)
            if kind not in EventKind._value2member_map_:
                raise ValueError(f"event {i} has unknown kind {kind}")
            events.append(IndexEvent(EventKind(kind), block_hash))
        return EventBatch(worker_id, seq_start, tuple(events))


@dataclass(frozen=True, slots=True)
class WorkerIndexState:
    """What the index remembers about a worker's event stream."""

    next_seq: int  # the sequence number the index expects next
    needs_resync: bool  # a gap was seen; batches are ignored until a resync


class PrefixIndex(ABC):
    """Which worker holds which block hashes, for one model namespace.

    Implementations are safe to call from several threads.
    """

    @abstractmethod
    def apply(self, batch: EventBatch) -> ApplyResult:
        """Record a worker's stored/removed hashes, checking its sequence numbers."""

    def apply_many(self, batches: Sequence[EventBatch]) -> list[ApplyResult]:
        """Apply several batches in order (one round trip where the backend allows)."""
        return [self.apply(batch) for batch in batches]

    @abstractmethod
    def resync(self, worker_id: str, block_hashes: Iterable[bytes], next_seq: int) -> None:
        """Replace ``worker_id``'s entries with exactly ``block_hashes``.

        ``next_seq`` is the number of the first event not reflected in the list;
        the worker's resync-pending state is cleared.
        """

    @abstractmethod
    def remove_worker(self, worker_id: str) -> None:
        """Drop every entry, the sequence state and the liveness of ``worker_id``."""

    @abstractmethod
    def heartbeat(self, worker_id: str, ttl_s: float) -> bool:
        """Keep ``worker_id`` alive for ``ttl_s`` seconds from now; reap lapsed workers.

        Returns True if the index needs ``worker_id``'s full list: it does not know the
        worker (first contact, removed, reaped after a lapse, a restarted index) or
        awaits its resync. False: its entries are current up to its sequence number.
        Lapsed workers, ``worker_id`` included, are reaped before the answer is read.
        """

    @abstractmethod
    def match(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """For every live worker, how many leading blocks of the chain it holds.

        The count for a worker stops at its first miss: a worker holding blocks
        0, 1 and 3 of a chain scores 2. Live workers holding nothing score 0.
        """

    @abstractmethod
    def workers(self) -> list[str]:
        """The live workers, sorted; reaps workers whose heartbeat lapsed."""

    @abstractmethod
    def reap(self) -> list[str]:
        """Drop the entries of every worker whose heartbeat lapsed; return them sorted."""

    @abstractmethod
    def worker_hashes(self, worker_id: str) -> set[bytes]:
        """The hashes recorded for ``worker_id`` (live or not yet reaped)."""

    @abstractmethod
    def worker_state(self, worker_id: str) -> WorkerIndexState | None:
        """The sequence state of ``worker_id``, or None if the index does not know it."""

    def is_available(self) -> bool:
        """Whether the backend answers right now."""
        return True

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release connections; the object is unusable afterwards."""
