"""Exact-outcome tests of the paged block manager: ids, orders, refcounts, copies, events."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys

import pytest

from pagedserve.common.api.hashing import HashInputError, block_hashes, extra_key, hash_block
from pagedserve.common.core import block_manager as bm_module
from pagedserve.common.core.block_manager import (
    BlockCopy,
    BlockManager,
    BlockManagerError,
    BlockRemoved,
    BlockStored,
    InvalidArgumentError,
    InvalidConfigError,
    NoFreeBlocksError,
    RequestTooLargeError,
    SequenceExistsError,
    UnknownSequenceError,
)


def toks(start: int, n: int) -> list[int]:
    """n distinct token ids starting at `start`."""
    return list(range(start, start + n))


def refcounts(bm: BlockManager) -> list[int]:
    return [bm.block_ref_count(i) for i in range(bm.num_blocks)]


def snapshot(bm: BlockManager) -> tuple:
    """Everything observable, to assert that a failed call changed nothing."""
    stats = bm.stats()
    return (stats, refcounts(bm), sorted(bm.cached_hashes()), bm.num_free_blocks())


# ---------------------------------------------------------------------------- hashing


def test_hash_block_follows_the_documented_encoding():
    extra = extra_key("smollm2", "tenant-a")
    model, salt = b"smollm2", b"tenant-a"
    assert extra == struct.pack("<I", 7) + model + b"\x01" + struct.pack("<I", 8) + salt
    assert extra_key("smollm2", None) == struct.pack("<I", 7) + model + b"\x00"

    h0 = hash_block(None, [1, 2, 70000], extra)
    expected0 = hashlib.blake2b(
        b"\x00" + struct.pack("<4I", 3, 1, 2, 70000) + extra, digest_size=16
    ).digest()
    assert h0 == expected0
    h1 = hash_block(h0, [5], extra)
    expected1 = hashlib.blake2b(
        b"\x01" + h0 + struct.pack("<2I", 1, 5) + extra, digest_size=16
    ).digest()
    assert h1 == expected1
    assert len(h1) == 16


def test_block_hashes_chain_full_blocks_only():
    tokens = toks(100, 11)  # block_size 4: two full blocks, 3 tokens left over
    extra = extra_key("m", None)
    h0 = hash_block(None, tokens[0:4], extra)
    h1 = hash_block(h0, tokens[4:8], extra)
    assert block_hashes(tokens, 4, "m") == [h0, h1]
    assert block_hashes(tokens[:3], 4, "m") == []
    # The chain makes a block's hash depend on everything before it.
    assert block_hashes([0, 0, 0, 0] + tokens[4:8], 4, "m")[1] != h1


def test_extra_keys_separate_models_salts_and_empty_salt():
    tokens = toks(0, 4)
    variants = [
        block_hashes(tokens, 4, "", None),
        block_hashes(tokens, 4, "", ""),
        block_hashes(tokens, 4, "", "a"),
        block_hashes(tokens, 4, "a", None),
        block_hashes(tokens, 4, "ab", "c"),
        block_hashes(tokens, 4, "a", "bc"),
    ]
    assert len({tuple(v) for v in variants}) == len(variants)


HASH_SCRIPT = (
    "import json; from pagedserve.common.api.hashing import block_hashes; "
    "print(json.dumps([h.hex() for h in block_hashes(list(range(1000, 1050)), 16, "
    "'smollm2', 'tenant')] + [h.hex() for h in block_hashes([7] * 32, 8)]))"
)


def test_hashes_are_equal_across_processes_with_different_hash_seeds():
    expected = [h.hex() for h in block_hashes(toks(1000, 50), 16, "smollm2", "tenant")]
    expected += [h.hex() for h in block_hashes([7] * 32, 8)]
    outputs = []
    for seed in ("0", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run(
            [sys.executable, "-c", HASH_SCRIPT], env=env, capture_output=True, text=True, check=True
        )
        outputs.append(json.loads(result.stdout))
    assert outputs[0] == outputs[1] == expected
    assert len(expected) == 3 + 4


def test_manager_stores_exactly_the_router_hashes():
    bm = BlockManager(8, 4, model_id="m")
    tokens = toks(0, 13)
    bm.allocate("a", tokens, cache_salt="s")
    bm.mark_computed("a", 13)
    expected = block_hashes(tokens, 4, "m", "s")
    assert bm.seq_block_hashes("a") == expected
    assert [e.block_hash for e in bm.drain_events()] == expected
    assert sorted(bm.cached_hashes()) == sorted(expected)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: block_hashes([1, 2], 0), "block_size must be a positive int"),
        (lambda: hash_block(None, [-1], b""), r"token ids must be ints in \[0, 2\*\*32\)"),
        (lambda: hash_block(None, [2**32], b""), r"token ids must be ints in \[0, 2\*\*32\)"),
        (lambda: hash_block(b"short", [1], b""), "parent hash must be 16 bytes, got 5"),
        (lambda: extra_key(3, None), "model_id must be a str"),
        (lambda: extra_key("m", 5), "cache_salt must be a str or None"),
    ],
)
def test_hashing_rejects_bad_input(call, match):
    with pytest.raises(HashInputError, match=match):
        call()


# ---------------------------------------------------------------------------- allocation


def test_allocate_takes_blocks_in_order_and_appends_only_when_full():
    bm = BlockManager(8, 4)
    assert bm.allocate("a", toks(0, 10)) == 0
    assert bm.block_table("a") == [0, 1, 2]
    assert (bm.num_tokens("a"), bm.num_computed_tokens("a")) == (10, 0)
    assert bm.num_free_blocks() == 5
    assert bm.usage() == 3 / 8
    assert bm.append_tokens("a", [10, 11]) == []  # fills block 2, no new block
    assert bm.block_table("a") == [0, 1, 2]
    assert bm.append_tokens("a", [12]) == []
    assert bm.block_table("a") == [0, 1, 2, 3]
    assert bm.slot_mapping("a", 0, 13) == list(range(13))
    bm.allocate("b", toks(50, 5))
    assert bm.block_table("b") == [4, 5]
    assert bm.slot_mapping("b", 3, 5) == [4 * 4 + 3, 5 * 4 + 0]
    bm.check_integrity()


def test_free_returns_blocks_tail_first_and_free_list_is_fifo():
    bm = BlockManager(4, 2, enable_prefix_caching=False)
    bm.allocate("a", toks(0, 6))
    bm.allocate("b", toks(10, 2))
    assert (bm.block_table("a"), bm.block_table("b")) == ([0, 1, 2], [3])
    bm.free("a")  # free list: 2, 1, 0
    assert bm.num_free_blocks() == 3
    bm.allocate("c", toks(20, 4))
    assert bm.block_table("c") == [2, 1]
    bm.free("b")  # free list: 0, 3
    bm.allocate("d", toks(30, 3))
    assert bm.block_table("d") == [0, 3]
    assert refcounts(bm) == [1, 1, 1, 1]
    bm.check_integrity()


def test_sequence_ending_on_a_block_boundary_gets_a_block_on_the_next_token():
    bm = BlockManager(4, 4)
    bm.allocate("a", toks(0, 8))
    assert bm.block_table("a") == [0, 1]
    assert bm.can_append("a", 1)
    bm.append_tokens("a", [8])
    assert bm.block_table("a") == [0, 1, 2]
    assert bm.append_tokens("a", []) == []
    assert bm.block_table("a") == [0, 1, 2]


# ---------------------------------------------------------------------------- prefix caching


def test_prefix_hit_shares_blocks_and_counts_tokens():
    bm = BlockManager(8, 4)
    prompt = toks(0, 10)
    bm.allocate("a", prompt)
    bm.mark_computed("a", 10)
    h = block_hashes(prompt, 4)
    assert bm.drain_events() == [
        BlockStored(h[0], None, (0, 1, 2, 3), 0),
        BlockStored(h[1], h[0], (4, 5, 6, 7), 1),
    ]
    assert bm.drain_events() == []
    assert bm.match_prefix(prompt) == 8
    assert bm.allocate("b", prompt) == 8
    assert bm.block_table("b") == [0, 1, 3]
    assert bm.num_computed_tokens("b") == 8
    assert bm.seq_block_hashes("b") == h
    assert refcounts(bm)[:4] == [2, 2, 1, 1]
    stats = bm.stats()
    assert (stats.prefix_query_tokens, stats.prefix_hit_tokens) == (20, 8)
    assert stats.prefix_hit_rate == 0.4
    assert (stats.num_used, stats.num_cached, stats.num_stored) == (4, 2, 2)
    bm.check_integrity()


def test_a_prompt_is_never_matched_in_full():
    bm = BlockManager(8, 4)
    bm.allocate("a", toks(0, 9))
    bm.mark_computed("a", 9)
    assert bm.match_prefix(toks(0, 8)) == 4  # both blocks cached, last one left to compute
    assert bm.match_prefix(toks(0, 9)) == 8
    assert bm.match_prefix(toks(0, 4)) == 0
    assert bm.match_prefix(toks(0, 3)) == 0
    assert bm.allocate("b", toks(0, 8)) == 4
    assert bm.block_table("b") == [0, 3]


def test_cache_salt_and_model_id_isolate_the_cache():
    bm = BlockManager(8, 4, model_id="m1")
    bm.allocate("a", toks(0, 9), cache_salt="tenant-a")
    bm.mark_computed("a", 9)
    assert bm.match_prefix(toks(0, 9), cache_salt="tenant-a") == 8
    assert bm.match_prefix(toks(0, 9), cache_salt="tenant-b") == 0
    assert bm.match_prefix(toks(0, 9)) == 0
    assert bm.seq_block_hashes("a") == block_hashes(toks(0, 9), 4, "m1", "tenant-a")
    assert bm.seq_block_hashes("a") != block_hashes(toks(0, 9), 4, "m2", "tenant-a")


def test_a_hash_hit_with_other_token_ids_is_a_miss(monkeypatch):
    # Every block collides on the hash; only the token comparison tells them apart.
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, tokens, extra: b"\x07" * 16)
    bm = BlockManager(8, 4)
    bm.allocate("a", toks(0, 5))
    bm.mark_computed("a", 5)
    assert bm.match_prefix(toks(100, 5)) == 0
    assert bm.allocate("b", toks(100, 5)) == 0
    assert bm.block_table("b") == [2, 3]
    assert bm.match_prefix(toks(0, 5)) == 4


def test_lru_eviction_takes_never_cached_blocks_first_then_the_tail():
    bm = BlockManager(4, 2)
    prompt = toks(0, 5)
    h = block_hashes(prompt, 2)
    bm.allocate("a", prompt)
    bm.mark_computed("a", 5)
    bm.drain_events()
    bm.free("a")  # block 2 (partial) -> free list; 1 then 0 -> LRU
    stats = bm.stats()
    assert (stats.num_free, stats.num_cached_free, stats.num_used) == (2, 2, 0)
    bm.allocate("b", toks(100, 6))  # free 3, free 2, then evict the LRU block: 1 (the tail)
    assert bm.block_table("b") == [3, 2, 1]
    assert bm.drain_events() == [BlockRemoved(h[1], 1)]
    assert bm.match_prefix(prompt) == 2  # block 0 still cached
    assert bm.cached_hashes() == [h[0]]
    assert bm.stats().num_evictions == 1
    bm.check_integrity()


def test_lru_order_follows_release_order_across_sequences():
    bm = BlockManager(6, 2)
    bm.allocate("a", toks(0, 4))
    bm.allocate("b", toks(10, 4))
    bm.mark_computed("a", 4)
    bm.mark_computed("b", 4)
    ha, hb = block_hashes(toks(0, 4), 2), block_hashes(toks(10, 4), 2)
    bm.drain_events()
    bm.free("b")  # LRU: 3, 2
    bm.free("a")  # LRU: 3, 2, 1, 0
    assert bm.evict(3) == 3
    assert bm.drain_events() == [
        BlockRemoved(hb[1], 3),
        BlockRemoved(hb[0], 2),
        BlockRemoved(ha[1], 1),
    ]
    assert bm.cached_hashes() == [ha[0]]
    # Evicted blocks join the free list behind the never-used ones.
    bm.allocate("c", toks(20, 10))
    assert bm.block_table("c") == [4, 5, 3, 2, 1]
    assert bm.evict() == 1
    assert bm.drain_events() == [BlockRemoved(ha[0], 0)]
    assert bm.evict() == 0
    assert bm.evict(5) == 0
    bm.check_integrity()


def test_hit_revives_a_cached_free_block_and_protects_it_from_eviction():
    bm = BlockManager(3, 2)
    prompt = toks(0, 5)
    bm.allocate("a", prompt)
    bm.mark_computed("a", 5)
    bm.free("a")  # free: 2; LRU: 1, 0
    assert bm.can_allocate(prompt)
    # Needs 3 blocks: hits 0 and 1 come out of the LRU, the fresh one is block 2.
    assert bm.allocate("b", prompt) == 4
    assert bm.block_table("b") == [0, 1, 2]
    assert refcounts(bm) == [1, 1, 1]
    assert not any(isinstance(e, BlockRemoved) for e in bm.drain_events())
    assert bm.stats().num_evictions == 0
    bm.check_integrity()


def test_revived_hits_count_against_the_free_pool():
    bm = BlockManager(3, 2)
    prompt = toks(0, 5)
    bm.allocate("a", prompt)
    bm.mark_computed("a", 5)
    bm.free("a")  # LRU: 1, 0; free: 2
    bm.allocate("x", toks(50, 1))  # takes block 2
    # The prompt needs 3 blocks: 2 hits (revived from the LRU) + 1 fresh, but only 2 are
    # allocatable and the fresh one could only come from evicting a hit.
    assert not bm.can_allocate(prompt)
    before = snapshot(bm)
    with pytest.raises(NoFreeBlocksError, match="needs 3 free blocks, 2 allocatable"):
        bm.allocate("b", prompt)
    assert snapshot(bm) == before
    assert not bm.has_seq("b")
    assert bm.can_allocate(toks(0, 4))  # 1 hit + 1 fresh, evicting the other cached block
    bm.allocate("b", toks(0, 4))
    assert bm.block_table("b") == [0, 1]
    bm.check_integrity()


def test_duplicate_content_stays_private_and_is_not_cached_twice():
    bm = BlockManager(8, 4)
    prompt = toks(0, 9)
    bm.allocate("a", prompt)
    bm.allocate("b", prompt)  # nothing computed yet: no hit
    assert (bm.block_table("a"), bm.block_table("b")) == ([0, 1, 2], [3, 4, 5])
    bm.mark_computed("a", 9)
    bm.mark_computed("b", 9)
    assert [e.block_id for e in bm.drain_events()] == [0, 1]
    assert bm.seq_block_hashes("b") == bm.seq_block_hashes("a")
    bm.free("b")  # private blocks go to the free list, not the LRU
    stats = bm.stats()
    assert (stats.num_free, stats.num_cached_free, stats.num_cached) == (5, 0, 2)
    bm.free("a")
    stats = bm.stats()
    assert (stats.num_free, stats.num_cached_free, stats.num_cached) == (6, 2, 2)
    bm.check_integrity()


def test_mark_computed_is_incremental_and_caches_generated_blocks():
    bm = BlockManager(8, 4)
    bm.allocate("a", toks(0, 6))
    bm.mark_computed("a", 3)
    assert bm.drain_events() == []
    bm.mark_computed("a", 6)
    assert [e.block_id for e in bm.drain_events()] == [0]
    bm.append_tokens("a", [6, 7, 8])
    bm.mark_computed("a", 9)
    events = bm.drain_events()
    assert [(e.block_id, e.token_ids) for e in events] == [(1, (4, 5, 6, 7))]
    assert events[0].parent_hash == bm.seq_block_hashes("a")[0]
    assert bm.seq_block_hashes("a") == block_hashes(toks(0, 9), 4)


def test_prefix_caching_off_caches_nothing():
    bm = BlockManager(4, 2, enable_prefix_caching=False)
    bm.allocate("a", toks(0, 5))
    bm.mark_computed("a", 5)
    assert bm.seq_block_hashes("a") == block_hashes(toks(0, 5), 2)
    assert bm.drain_events() == []
    bm.free("a")
    assert bm.match_prefix(toks(0, 5)) == 0
    assert bm.allocate("b", toks(0, 5)) == 0
    stats = bm.stats()
    assert (stats.num_cached, stats.prefix_query_tokens, stats.prefix_hit_tokens) == (0, 10, 0)


# ---------------------------------------------------------------------------- fork, COW


def test_fork_shares_every_block_and_state():
    bm = BlockManager(8, 4)
    bm.allocate("a", toks(0, 10))
    bm.mark_computed("a", 10)
    bm.fork("a", "b")
    assert bm.block_table("b") == [0, 1, 2]
    assert (bm.num_tokens("b"), bm.num_computed_tokens("b")) == (10, 10)
    assert bm.seq_block_hashes("b") == bm.seq_block_hashes("a")
    assert refcounts(bm)[:4] == [2, 2, 2, 0]
    bm.free("a")
    assert refcounts(bm)[:3] == [1, 1, 1]
    assert bm.block_table("b") == [0, 1, 2]
    bm.check_integrity()


def test_write_into_shared_partial_block_copies_it_first():
    bm = BlockManager(8, 4)
    bm.allocate("a", toks(0, 10))
    bm.fork("a", "b")
    assert bm.append_tokens("b", [99]) == [BlockCopy(src=2, dst=3)]
    assert bm.block_table("b") == [0, 1, 3]
    assert bm.block_table("a") == [0, 1, 2]
    assert refcounts(bm)[:4] == [2, 2, 1, 1]
    assert bm.append_tokens("a", [42]) == []  # block 2 is a's alone now
    assert bm.append_tokens("b", [98]) == []
    assert bm.stats().num_cow_copies == 1
    bm.check_integrity()


def test_cow_and_new_block_in_one_append():
    bm = BlockManager(8, 4)
    bm.allocate("a", toks(0, 10))
    bm.fork("a", "b")
    bm.fork("a", "c")
    assert refcounts(bm)[2] == 3
    assert bm.append_tokens("b", [1, 2, 3]) == [BlockCopy(src=2, dst=3)]
    assert bm.block_table("b") == [0, 1, 3, 4]
    assert bm.append_tokens("c", [5]) == [BlockCopy(src=2, dst=5)]
    assert bm.append_tokens("a", [7]) == []
    assert refcounts(bm)[:6] == [3, 3, 1, 1, 1, 1]
    bm.check_integrity()


def test_fork_on_a_full_block_needs_no_copy():
    bm = BlockManager(8, 4)
    bm.allocate("a", toks(0, 8))
    bm.fork("a", "b")
    assert bm.append_tokens("b", [1]) == []
    assert bm.append_tokens("a", [2]) == []
    assert (bm.block_table("a"), bm.block_table("b")) == ([0, 1, 3], [0, 1, 2])


def test_cow_without_a_free_block_fails_cleanly():
    bm = BlockManager(3, 4)
    bm.allocate("a", toks(0, 10))
    bm.fork("a", "b")
    assert not bm.can_append("b", 1)
    before = snapshot(bm)
    with pytest.raises(NoFreeBlocksError, match="needs 1 free blocks, 0 allocatable"):
        bm.append_tokens("b", [5])
    assert snapshot(bm) == before
    assert bm.num_tokens("b") == 10
    bm.free("a")
    assert bm.append_tokens("b", [5]) == []  # no longer shared: written in place


def test_append_without_free_blocks_fails_cleanly():
    bm = BlockManager(3, 2)
    bm.allocate("a", toks(0, 3))
    bm.allocate("b", toks(0, 1))
    assert bm.can_append("a", 1)
    assert not bm.can_append("a", 2)
    with pytest.raises(NoFreeBlocksError, match="appending 2 tokens to 'a' needs 1 free"):
        bm.append_tokens("a", [3, 4])
    assert bm.num_tokens("a") == 3
    assert bm.block_table("a") == [0, 1]
    bm.free("b")
    assert bm.append_tokens("a", [3, 4]) == []
    assert bm.block_table("a") == [0, 1, 2]


# ---------------------------------------------------------------------------- misuse


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_blocks": 0}, "num_blocks must be a positive int, got 0"),
        ({"num_blocks": 4, "block_size": 0}, "block_size must be a positive int, got 0"),
        ({"num_blocks": 4, "block_size": -16}, "block_size must be a positive int, got -16"),
        ({"num_blocks": 4, "block_size": True}, "block_size must be a positive int, got True"),
        ({"num_blocks": 2.0}, "num_blocks must be a positive int, got 2.0"),
        ({"num_blocks": 4, "model_id": None}, "model_id must be a str"),
    ],
)
def test_invalid_config(kwargs, match):
    with pytest.raises(InvalidConfigError, match=match):
        BlockManager(**kwargs)


def test_misuse_raises_clear_errors_and_changes_nothing():
    bm = BlockManager(4, 4)
    bm.allocate("a", toks(0, 5))
    bm.mark_computed("a", 2)
    before = snapshot(bm)
    cases = [
        (lambda: bm.free("zzz"), UnknownSequenceError, "cannot free 'zzz'"),
        (lambda: bm.append_tokens("zzz", [1]), UnknownSequenceError, "unknown sequence 'zzz'"),
        (lambda: bm.can_append("zzz"), UnknownSequenceError, "unknown sequence 'zzz'"),
        (lambda: bm.block_table("zzz"), UnknownSequenceError, "unknown sequence"),
        (lambda: bm.mark_computed("zzz", 1), UnknownSequenceError, "unknown sequence"),
        (lambda: bm.fork("zzz", "y"), UnknownSequenceError, "unknown sequence 'zzz'"),
        (lambda: bm.allocate("a", [1]), SequenceExistsError, "sequence 'a' already exists"),
        (lambda: bm.fork("a", "a"), SequenceExistsError, "cannot fork into 'a'"),
        (lambda: bm.allocate("b", []), InvalidArgumentError, "at least one token"),
        (lambda: bm.allocate("b", [1, -2]), InvalidArgumentError, r"\[0, 2\*\*32\)"),
        (lambda: bm.allocate("b", [2**32]), InvalidArgumentError, r"\[0, 2\*\*32\)"),
        (lambda: bm.allocate("b", [1.5]), InvalidArgumentError, "sequence of ints"),
        (lambda: bm.allocate("b", 7), InvalidArgumentError, "sequence of ints"),
        (lambda: bm.append_tokens("a", ["x"]), InvalidArgumentError, "sequence of ints"),
        (lambda: bm.mark_computed("a", 1), InvalidArgumentError, r"must lie in \[2 computed"),
        (lambda: bm.mark_computed("a", 6), InvalidArgumentError, "5 tokens"),
        (lambda: bm.mark_computed("a", -1), InvalidArgumentError, "non-negative"),
        (lambda: bm.can_append("a", -1), InvalidArgumentError, "non-negative"),
        (lambda: bm.slot_mapping("a", 0, 6), InvalidArgumentError, r"\[0, 6\) out of range"),
        (lambda: bm.slot_mapping("a", 3, 2), InvalidArgumentError, "out of range"),
        (lambda: bm.evict(-1), InvalidArgumentError, "num_blocks must be a non-negative int"),
        (lambda: bm.block_ref_count(4), InvalidArgumentError, "block id 4 out of range"),
        (
            lambda: bm.allocate("b", toks(0, 17)),
            RequestTooLargeError,
            r"needs 5 blocks \(17 tokens at block_size 4\) but the pool has only 4",
        ),
        (
            lambda: bm.append_tokens("a", toks(0, 12)),
            RequestTooLargeError,
            "would need 5 blocks but the pool has only 4",
        ),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()
        assert issubclass(error, BlockManagerError)
        assert snapshot(bm) == before
    assert not bm.can_allocate(toks(0, 17))
    assert not bm.can_append("a", 12)
    assert bm.num_tokens("a") == 5
    bm.check_integrity()


def test_double_free_is_an_error():
    bm = BlockManager(4, 4)
    bm.allocate("a", toks(0, 5))
    bm.free("a")
    with pytest.raises(UnknownSequenceError, match="cannot free 'a': unknown or already freed"):
        bm.free("a")
    assert bm.num_free_blocks() == 4
    assert refcounts(bm) == [0, 0, 0, 0]


def test_numpy_style_ints_are_accepted_as_plain_ints():
    class Index:  # what numpy / torch integer scalars look like to operator.index
        def __init__(self, v: int) -> None:
            self.v = v

        def __index__(self) -> int:
            return self.v

    bm = BlockManager(4, 2)
    bm.allocate("a", [Index(i) for i in range(3)])
    bm.mark_computed("a", 3)
    assert bm.seq_block_hashes("a") == block_hashes([0, 1, 2], 2)


# ---------------------------------------------------------------------------- integrity


def test_check_integrity_names_the_broken_invariant():
    def broken(mutate):
        bm = BlockManager(4, 2)
        bm.allocate("a", toks(0, 3))
        bm.mark_computed("a", 2)
        bm.check_integrity()
        mutate(bm)
        return bm

    bm = broken(lambda b: setattr(b._blocks[0], "ref_count", 2))
    with pytest.raises(AssertionError, match="block 0: refcount 2 but 1 table entries"):
        bm.check_integrity()
    bm = broken(lambda b: b._free.append(0))
    with pytest.raises(AssertionError, match="refcount 1 but in free/cached-free"):
        bm.check_integrity()
    bm = broken(lambda b: b._hash_to_block.update({b"\x01" * 16: 0}))
    with pytest.raises(AssertionError, match="hash map points 0101"):
        bm.check_integrity()
    bm = broken(lambda b: b._seqs["a"].block_table.append(1))
    with pytest.raises(AssertionError, match="sequence 'a': a block appears twice in its table"):
        bm.check_integrity()
    bm = broken(lambda b: setattr(b._seqs["a"], "num_tokens", 5))
    with pytest.raises(AssertionError, match="sequence 'a': 2 blocks for 5 tokens"):
        bm.check_integrity()
    bm = broken(lambda b: setattr(b._blocks[0], "token_ids", (9, 9)))
    with pytest.raises(AssertionError, match="cached block 0 holds other tokens"):
        bm.check_integrity()


def test_acquire_cached_prefix_pins_every_full_block_and_takes_none():
    bm = BlockManager(num_blocks=8, block_size=4, model_id="m")
    toks = list(range(100, 112))  # 3 full blocks
    bm.allocate("a", toks)
    bm.mark_computed("a", 12)
    table = bm.block_table("a")
    bm.free("a")
    free_before = bm.num_free_blocks()
    assert bm.acquire_cached_prefix("x", toks + [1, 2]) == 12  # all 3 blocks, unlike allocate
    assert bm.block_table("x") == table and bm.num_computed_tokens("x") == 12
    assert [bm.block_ref_count(b) for b in table] == [1, 1, 1]
    assert bm.num_free_blocks() == free_before - 3  # revived from the LRU, nothing fresh
    assert bm.acquire_cached_prefix("y", toks, cache_salt="other") == 0
    assert not bm.has_seq("y")
    bm.check_integrity()
    bm.free("x")
    assert bm.num_free_blocks() == free_before
    bm.check_integrity()
