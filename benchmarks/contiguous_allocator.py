"""Contiguous KV allocation: the baseline that PagedAttention replaces.

Systems before vLLM (FasterTransformer, Orca) stored a sequence's KV cache in one
contiguous chunk, reserved at admission for the longest the sequence might become,
because the output length is unknown in advance. This allocator does exactly that over a
slab of `num_slots` token slots:

    [ seq a: 256 reserved            ][ gap ][ seq b: 256 reserved ]...
      ^ tokens used  ^ reserved, unused (internal fragmentation)

- Each sequence reserves `reserve` consecutive slots up front (default `max_model_len`).
- Placement is first-fit: the lowest-address gap that is large enough. With reservations
  of different sizes the slab fragments (a request can be refused while enough slots are
  free in total: external fragmentation); `NoContiguousSpaceError` says so.
- A reservation never grows: a sequence that outgrows it is an error, not a reallocation.

Standard library only; the KV-waste benchmark drives it side by side with `BlockManager`.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


class ContiguousAllocatorError(Exception):
    """Base class of every error the contiguous allocator raises."""


class InvalidConfigError(ContiguousAllocatorError, ValueError):
    """Bad constructor argument."""


class InvalidArgumentError(ContiguousAllocatorError, ValueError):
    """Bad argument to a method (negative count, position out of range, ...)."""


class UnknownSequenceError(ContiguousAllocatorError, LookupError):
    """The sequence was never allocated or was already freed (covers a double free)."""


class SequenceExistsError(ContiguousAllocatorError):
    """`allocate` with a sequence id that is already live."""


class RequestTooLargeError(ContiguousAllocatorError):
    """Longer than max_model_len, or a reservation larger than the whole slab."""


class NoContiguousSpaceError(ContiguousAllocatorError):
    """No single gap is large enough right now (there may be enough slots in total)."""


class ReservationExceededError(ContiguousAllocatorError):
    """A sequence grew past the slots reserved for it."""


@dataclass
class ContiguousStats:
    num_slots: int
    max_model_len: int
    num_seqs: int
    reserved_slots: int  # sum of reservations
    used_slots: int  # tokens actually held
    free_slots: int  # num_slots - reserved_slots
    largest_free_extent: int  # the biggest reservation that would fit now


@dataclass
class _Reservation:
    start: int
    size: int
    num_tokens: int


class ContiguousAllocator:
    """One slab of token slots; per sequence one contiguous reservation, placed first-fit."""

    def __init__(self, num_slots: int, max_model_len: int) -> None:
        for name, value in (("num_slots", num_slots), ("max_model_len", max_model_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidConfigError(f"{name} must be a positive int, got {value!r}")
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        self._seqs: dict[str, _Reservation] = {}
        self._starts: list[int] = []  # sorted reservation starts
        self._by_start: dict[int, str] = {}

    # ------------------------------------------------------------------ queries

    def has_seq(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def num_tokens(self, seq_id: str) -> int:
        return self._seq(seq_id).num_tokens

    def reservation(self, seq_id: str) -> tuple[int, int]:
        """(first slot, number of slots) reserved for the sequence."""
        r = self._seq(seq_id)
        return r.start, r.size

    def slot_mapping(self, seq_id: str, start: int, end: int) -> list[int]:
        r = self._seq(seq_id)
        if not 0 <= start <= end <= r.num_tokens:
            raise InvalidArgumentError(
                f"positions [{start}, {end}) out of range for {seq_id!r} with {r.num_tokens} tokens"
            )
        return list(range(r.start + start, r.start + end))

    def free_extents(self) -> list[tuple[int, int]]:
        """Gaps between reservations as (start, size), in address order."""
        gaps, cursor = [], 0
        for start in self._starts:
            if start > cursor:
                gaps.append((cursor, start - cursor))
            cursor = start + self._seqs[self._by_start[start]].size
        if cursor < self.num_slots:
            gaps.append((cursor, self.num_slots - cursor))
        return gaps

    def largest_free_extent(self) -> int:
        return max((size for _, size in self.free_extents()), default=0)

    def stats(self) -> ContiguousStats:
        reserved = sum(r.size for r in self._seqs.values())
        return ContiguousStats(
            num_slots=self.num_slots,
            max_model_len=self.max_model_len,
            num_seqs=len(self._seqs),
            reserved_slots=reserved,
            used_slots=sum(r.num_tokens for r in self._seqs.values()),
            free_slots=self.num_slots - reserved,
            largest_free_extent=self.largest_free_extent(),
        )

    # ------------------------------------------------------------------ verbs

    def can_allocate(self, num_tokens: int, reserve: int | None = None) -> bool:
        """Whether `allocate` would succeed now (False also when it can never fit)."""
        try:
            size = self._reservation_size(num_tokens, reserve)
        except RequestTooLargeError:
            return False
        return self._first_fit(size) is not None

    def allocate(self, seq_id: str, num_tokens: int, reserve: int | None = None) -> int:
        """Reserve `reserve` (default max_model_len) slots for a prompt of `num_tokens`.

        Returns the first slot of the reservation.
        """
        if seq_id in self._seqs:
            raise SequenceExistsError(f"sequence {seq_id!r} already exists")
        size = self._reservation_size(num_tokens, reserve)
        start = self._first_fit(size)
        if start is None:
            free = self.num_slots - sum(r.size for r in self._seqs.values())
            raise NoContiguousSpaceError(
                f"sequence {seq_id!r} needs {size} contiguous slots; {free} free in total, "
                f"largest gap {self.largest_free_extent()}"
            )
        self._seqs[seq_id] = _Reservation(start, size, num_tokens)
        bisect.insort(self._starts, start)
        self._by_start[start] = seq_id
        return start

    def append_tokens(self, seq_id: str, num_tokens: int = 1) -> None:
        r = self._seq(seq_id)
        _check_non_negative("num_tokens", num_tokens)
        if r.num_tokens + num_tokens > r.size:
            raise ReservationExceededError(
                f"sequence {seq_id!r} would hold {r.num_tokens + num_tokens} tokens "
                f"but reserved only {r.size}"
            )
        r.num_tokens += num_tokens

    def free(self, seq_id: str) -> None:
        r = self._seqs.pop(seq_id, None)
        if r is None:
            raise UnknownSequenceError(f"cannot free {seq_id!r}: unknown or already freed")
        self._starts.remove(r.start)
        del self._by_start[r.start]

    # ------------------------------------------------------------------ internals

    def _seq(self, seq_id: str) -> _Reservation:
        r = self._seqs.get(seq_id)
        if r is None:
            raise UnknownSequenceError(f"unknown sequence {seq_id!r} (never allocated or freed)")
        return r

    def _reservation_size(self, num_tokens: int, reserve: int | None) -> int:
        _check_non_negative("num_tokens", num_tokens)
        if num_tokens == 0:
            raise InvalidArgumentError("a sequence needs at least one token")
        size = self.max_model_len if reserve is None else reserve
        _check_non_negative("reserve", size)
        if num_tokens > self.max_model_len:
            raise RequestTooLargeError(
                f"{num_tokens} tokens exceed max_model_len {self.max_model_len}"
            )
        if size < num_tokens:
            raise InvalidArgumentError(f"reserve {size} is smaller than the {num_tokens} tokens")
        if size > self.num_slots:
            raise RequestTooLargeError(
                f"a reservation of {size} slots can never fit a slab of {self.num_slots}"
            )
        return size

    def _first_fit(self, size: int) -> int | None:
        for start, gap in self.free_extents():
            if gap >= size:
                return start
        return None

    def check_integrity(self) -> None:
        """Reservations lie inside the slab, do not overlap, and hold their tokens."""
        if sorted(r.start for r in self._seqs.values()) != self._starts:
            raise AssertionError("start index disagrees with the reservations")
        cursor = 0
        for start in self._starts:
            seq_id = self._by_start[start]
            r = self._seqs[seq_id]
            if start < cursor:
                raise AssertionError(f"reservation of {seq_id!r} overlaps the previous one")
            if not 0 <= r.num_tokens <= r.size:
                raise AssertionError(f"{seq_id!r} holds {r.num_tokens} tokens in {r.size} slots")
            cursor = start + r.size
        if cursor > self.num_slots:
            raise AssertionError("a reservation runs past the end of the slab")


def _check_non_negative(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidArgumentError(f"{name} must be a non-negative int, got {value!r}")
