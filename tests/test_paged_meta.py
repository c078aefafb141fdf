"""benchmarks/paged_meta.py: the step benchmarks' synthetic attention metadata."""

from __future__ import annotations

import pytest

from benchmarks.paged_meta import paged_metadata


def test_each_new_token_gets_its_own_slot_in_its_own_blocks():
    q_lens, ctxs = [5, 1, 1], [20, 31, 0]  # a prefill chunk on a cached prefix, 2 decodes
    meta = paged_metadata(q_lens, ctxs, block_size=16, num_blocks=8, seed=3)
    tables = meta.block_tables.tolist()
    slots = meta.slot_mapping.tolist()
    positions = [p for q, c in zip(q_lens, ctxs, strict=True) for p in range(c, c + q)]
    owners = [i for i, q in enumerate(q_lens) for _ in range(q)]
    for slot, pos, seq in zip(slots, positions, owners, strict=True):
        assert divmod(slot, 16) == (tables[seq][pos // 16], pos % 16)
    used = [b for t, q, c in zip(tables, q_lens, ctxs, strict=True) for b in t[: -(-(c + q) // 16)]]
    assert len(used) == len(set(used)) == 2 + 2 + 1  # no block shared between sequences
    assert meta.seq_lens.tolist() == meta.seq_lens_cpu == [25, 32, 1]
    assert meta.query_start_loc.tolist() == [0, 5, 6, 7]
    assert (meta.num_prefills, meta.num_prefill_tokens, meta.num_decode_tokens) == (1, 5, 2)
    assert (meta.max_query_len, meta.max_seq_len) == (5, 32)


def test_the_shuffle_follows_the_seed_and_too_few_blocks_is_an_error():
    a = paged_metadata([1] * 4, [40] * 4, 16, 64, seed=0).block_tables
    assert a.equal(paged_metadata([1] * 4, [40] * 4, 16, 64, seed=0).block_tables)
    assert not a.equal(paged_metadata([1] * 4, [40] * 4, 16, 64, seed=1).block_tables)
    with pytest.raises(ValueError, match="cannot hold"):
        paged_metadata([1] * 4, [40] * 4, 16, 11)  # 4 x 3 blocks needed
