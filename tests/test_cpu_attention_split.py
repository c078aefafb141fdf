"""The bf16 CPU kernel's split rows and prefetching (common/core/attention/cpu_attention.c).

A call with fewer than 4 query rows cuts each row longer than 256 tokens into
256-token chunks, computed as separate work items (each with its own softmax max
and sum) and merged afterwards, so that batch-1 decode uses every thread. The rule
depends on the rows and lengths only: results must not depend on the thread count.
Rows that are not split keep exactly the arithmetic of a big batch.

Checked against the float64 dense reference with test_cpu_attention_kernel's bf16
tolerance (half an output ulp plus BF16_ACC_ULPS units of fp32 accumulation at the
scale of max|v|: the merge's rescaling is fp32 arithmetic, well inside it), over
head sizes 32/64/128, GQA groups 1/2/3/4/8, block sizes 8/16/32, randomly permuted
block tables and lengths that end inside blocks, tiles and chunks.
"""

from __future__ import annotations

import pytest
import torch
from builders import one_torch_thread  # noqa: F401 (autouse fixture)
from test_cpu_attention_kernel import (
    LIB,
    _assert_bf16_close,
    _decode_case,
    _row_reference,
    needs_kernel,
)

from pagedserve.common.core.attention import cpu_kernel
from pagedserve.common.core.attention.base import write_kv

BF16 = torch.bfloat16


def _attend(case, threads: int = 1, out: torch.Tensor | None = None) -> torch.Tensor:
    """Write the case's new K/V, then one kernel call with `threads` threads."""
    q, k, v, kc, vc, meta, _ = case
    write_kv(k, v, kc, vc, meta.slot_mapping)
    out = torch.empty_like(q) if out is None else out
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        d = q.shape[-1]
        cpu_kernel.attend(LIB, q, kc, vc, meta.block_tables, meta.seq_lens, d**-0.5, out)
    finally:
        torch.set_num_threads(before)
    return out


@needs_kernel
@pytest.mark.parametrize(
    "lens",
    [[1000], [257, 700], [513, 3, 1029], [256, 255]],
    ids=["1x1000", "257+700", "513+3+1029", "unsplit-256+255"],
)
@pytest.mark.parametrize("group", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("d, block_size", [(64, 16), (32, 8), (128, 32)])
def test_bf16_split_rows_match_dense_reference(lens, group, d, block_size):
    kvh = 2
    case = _decode_case(lens, kvh * group, kvh, d, block_size, seed=group * d, dtype=BF16)
    out = _attend(case, threads=2)
    _assert_bf16_close(out, case[-1], float(case[4].abs().max()))


@needs_kernel
@pytest.mark.parametrize("lens", [[1000], [300, 777], [1, 600, 2000]])
def test_bf16_split_rows_do_not_depend_on_the_thread_count(lens):
    case = _decode_case(lens, 9, 3, 64, 16, seed=len(lens), dtype=BF16)
    one = _attend(case, threads=1).clone()
    two = _attend(case, threads=2)
    assert torch.equal(one, two)


@needs_kernel
def test_bf16_rows_not_split_keep_the_batch_arithmetic_and_zero_lengths_stay_untouched():
    """One call of 3 rows (split: the 900-token row) and the same rows among 6 (no
    row split): the short row is bit-identical, the long one within tolerance; a row
    of length 0 is left as it was."""
    h, kvh, d = 6, 2, 64
    _, _, _, kc, vc, meta, _ = _decode_case([900, 40], h, kvh, d, 16, seed=21, dtype=BF16)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(6, h, d, generator=g).to(BF16)
    rows = torch.tensor([0, 1, 0, 1, 1, 0], dtype=torch.int32)
    lens = torch.tensor([900, 40, 0, 33, 1, 517], dtype=torch.int32)

    small = torch.full((3, h, d), 5.0, dtype=BF16)
    cpu_kernel.attend(LIB, q[:3], kc, vc, meta.block_tables, lens[:3], d**-0.5, small, rows[:3])
    big = torch.full((6, h, d), 5.0, dtype=BF16)
    cpu_kernel.attend(LIB, q, kc, vc, meta.block_tables, lens, d**-0.5, big, rows)

    assert torch.equal(small[1], big[1])  # 40 tokens: never split
    assert bool((small[2] == 5.0).all()) and bool((big[2] == 5.0).all())
    v_scale = float(vc.abs().max())
    for r, out in ((0, small[0]), (0, big[0]), (5, big[5]), (3, big[3]), (4, big[4])):
        ref = _row_reference(
            q[r], kc, vc, meta.block_tables[int(rows[r])].tolist(), int(lens[r]), 16
        )
        _assert_bf16_close(out, ref, v_scale)


@needs_kernel
def test_bf16_prefill_rows_with_prefetch_of_the_next_row_match_reference():
    """Many prefill-style rows over two sequences in one call (each thread prefetches
    the row it takes next): every causal length 1..300 of one sequence, interleaved
    with rows of the other, on two threads."""
    h, kvh, d = 8, 2, 64
    _, _, _, kc, vc, meta, _ = _decode_case([300, 170], h, kvh, d, 16, seed=7, dtype=BF16)
    n = 300 + 170
    rows = torch.tensor([0] * 300 + [1] * 170, dtype=torch.int32)
    lens = torch.tensor([*range(1, 301), *range(1, 171)], dtype=torch.int32)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(3))
    rows, lens = rows[perm].contiguous(), lens[perm].contiguous()
    q = torch.randn(n, h, d, generator=torch.Generator().manual_seed(4)).to(BF16)
    out = torch.empty_like(q)
    torch.set_num_threads(2)
    try:
        cpu_kernel.attend(LIB, q, kc, vc, meta.block_tables, lens, d**-0.5, out, rows)
    finally:
        torch.set_num_threads(1)
    v_scale = float(vc.abs().max())
    for r in range(0, n, 7):
        table = meta.block_tables[int(rows[r])].tolist()
        _assert_bf16_close(out[r], _row_reference(q[r], kc, vc, table, int(lens[r]), 16), v_scale)


@needs_kernel
def test_bf16_split_row_with_a_bad_block_id_is_refused_before_any_write():
    kc = torch.randn(64, 16, 2, 32).to(BF16)
    q, out = torch.randn(1, 4, 32).to(BF16), torch.full((1, 4, 32), 7.0, dtype=BF16)
    table = torch.arange(40, dtype=torch.int32).view(1, 40).clone()
    table[0, 30] = 64  # token 480's block: past the cache, inside the second chunk
    lens = torch.tensor([600], dtype=torch.int32)
    with pytest.raises(ValueError, match="query row 0"):
        cpu_kernel.attend(LIB, q, kc, kc, table, lens, 0.1, out)
    assert bool((out == 7.0).all())
