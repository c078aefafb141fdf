"""Exact-outcome tests of the contiguous max-length baseline: first-fit, fragmentation, errors."""

from __future__ import annotations

import pytest

from benchmarks.contiguous_allocator import (
    ContiguousAllocator,
    ContiguousAllocatorError,
    InvalidArgumentError,
    InvalidConfigError,
    NoContiguousSpaceError,
    RequestTooLargeError,
    ReservationExceededError,
    SequenceExistsError,
    UnknownSequenceError,
)


def test_reserves_max_model_len_per_sequence_first_fit():
    alloc = ContiguousAllocator(num_slots=1024, max_model_len=256)
    assert [alloc.allocate(s, n) for s, n in [("r1", 40), ("r2", 17), ("r3", 95), ("r4", 8)]] == [
        0,
        256,
        512,
        768,
    ]
    assert alloc.reservation("r3") == (512, 256)
    stats = alloc.stats()
    assert (stats.reserved_slots, stats.used_slots, stats.free_slots) == (1024, 160, 0)
    assert not alloc.can_allocate(1)
    with pytest.raises(NoContiguousSpaceError, match="needs 256 contiguous slots; 0 free"):
        alloc.allocate("r5", 1)
    alloc.free("r2")
    assert alloc.free_extents() == [(256, 256)]
    assert alloc.allocate("r5", 3) == 256  # the freed hole is reused
    alloc.check_integrity()


def test_first_fit_with_mixed_reservations_fragments_the_slab():
    alloc = ContiguousAllocator(num_slots=1000, max_model_len=256)
    assert alloc.allocate("a", 10) == 0
    assert alloc.allocate("b", 10) == 256
    assert alloc.allocate("c", 10) == 512
    alloc.free("b")
    assert alloc.allocate("d", 10, reserve=100) == 256  # lowest gap that fits
    assert alloc.allocate("e", 10, reserve=200) == 768  # 156-slot hole at 356 is too small
    assert alloc.free_extents() == [(356, 156), (968, 32)]
    stats = alloc.stats()
    assert (stats.free_slots, stats.largest_free_extent) == (188, 156)
    # 188 slots free in total, but no single hole holds 180: external fragmentation.
    assert not alloc.can_allocate(10, reserve=180)
    with pytest.raises(NoContiguousSpaceError, match="188 free in total, largest gap 156"):
        alloc.allocate("f", 10, reserve=180)
    assert alloc.allocate("f", 10, reserve=150) == 356
    alloc.check_integrity()


def test_tokens_grow_inside_the_reservation_only():
    alloc = ContiguousAllocator(num_slots=64, max_model_len=8)
    alloc.allocate("a", 5)
    alloc.allocate("b", 2)
    alloc.append_tokens("a", 3)
    assert alloc.num_tokens("a") == 8
    assert alloc.slot_mapping("a", 6, 8) == [6, 7]
    assert alloc.slot_mapping("b", 0, 2) == [8, 9]
    with pytest.raises(ReservationExceededError, match="would hold 9 tokens but reserved only 8"):
        alloc.append_tokens("a")
    assert alloc.num_tokens("a") == 8
    alloc.free("a")
    with pytest.raises(UnknownSequenceError, match="cannot free 'a': unknown or already freed"):
        alloc.free("a")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_slots": 0, "max_model_len": 8}, "num_slots must be a positive int, got 0"),
        ({"num_slots": 64, "max_model_len": 0}, "max_model_len must be a positive int, got 0"),
        ({"num_slots": 64, "max_model_len": 8.0}, "max_model_len must be a positive int"),
    ],
)
def test_invalid_config(kwargs, match):
    with pytest.raises(InvalidConfigError, match=match):
        ContiguousAllocator(**kwargs)


def test_misuse_raises_clear_errors():
    alloc = ContiguousAllocator(num_slots=64, max_model_len=32)
    alloc.allocate("a", 4)
    cases = [
        (lambda: alloc.allocate("a", 1), SequenceExistsError, "sequence 'a' already exists"),
        (lambda: alloc.allocate("b", 0), InvalidArgumentError, "at least one token"),
        (lambda: alloc.allocate("b", -1), InvalidArgumentError, "non-negative"),
        (lambda: alloc.allocate("b", 33), RequestTooLargeError, "33 tokens exceed max_model_len"),
        (lambda: alloc.allocate("b", 4, reserve=3), InvalidArgumentError, "smaller than"),
        (lambda: alloc.allocate("b", 4, reserve=65), RequestTooLargeError, "can never fit"),
        (lambda: alloc.append_tokens("zz"), UnknownSequenceError, "unknown sequence 'zz'"),
        (lambda: alloc.append_tokens("a", -2), InvalidArgumentError, "non-negative"),
        (lambda: alloc.slot_mapping("a", 0, 5), InvalidArgumentError, "out of range"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()
        assert issubclass(error, ContiguousAllocatorError)
    assert not alloc.can_allocate(33)
    assert alloc.stats().num_seqs == 1
    alloc.check_integrity()


def test_check_integrity_detects_overlap():
    alloc = ContiguousAllocator(num_slots=64, max_model_len=16)
    alloc.allocate("a", 1)
    alloc.allocate("b", 1)
    alloc._seqs["a"].size = 20
    with pytest.raises(AssertionError, match="reservation of 'b' overlaps"):
        alloc.check_integrity()
