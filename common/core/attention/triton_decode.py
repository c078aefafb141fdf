"""Triton paged-attention decode kernel: flash-decoding over a block table.

Each decode sequence has one new query token that attends to its whole context
[0, seq_len), read from the paged cache through its block table.

Work split (grid = (num_seqs, num_kv_heads, num_splits)):
- one program per (sequence, KV head, split). All query heads of the KV head's GQA group
  are packed as the rows of one tile, so each K/V element is loaded once per group, not
  once per query head. The group is padded to a power of two >= 16 (MIN_DOT_DIM; the
  default model has 9 q heads over 3 KV heads: group 3 -> 16 rows, 3 live). The spare
  rows cost tensor-core work only, which a kernel bound by reading K/V has to spare.
- a split is a contiguous range of `tokens_per_split` context positions (flash-decoding):
  with few sequences the context is cut into splits so that enough programs run to keep
  every SM streaming K/V. Splits are the same for every sequence of the batch, so the
  tail splits of a short sequence are empty (they write lse = -inf and weigh 0).
- inside a split the program walks BLOCK_N positions at a time; BLOCK_N may span several
  cache blocks or part of one: each position looks up its own block id
  (`block_tables[seq, pos // BLOCK_SIZE]`, cast to int64 before the stride math).
- online softmax in fp32, in base 2 (`scale * log2(e)` folded into the scores).

With one split the program normalizes and writes the output. With several, each writes
its normalized partial output and log-sum-exp, and `_merge_splits_kernel` combines them:
    out = sum_s exp2(lse_s - lse_max) * o_s / sum_s exp2(lse_s - lse_max)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.common.core.attention.triton_common import (
    LOG2_E,
    MIN_DOT_DIM,
    PagedShape,
    cdiv,
    check_paged_inputs,
    default_tile,
    dot_settings,
    next_pow2,
    sm_count,
)

# Split only while each split keeps at least this many positions (2 loop iterations):
# shorter splits spend more on the merge than they win in parallelism.
MIN_TOKENS_PER_SPLIT = 128
# Programs wanted in flight per SM before the context is split further.
PROGRAMS_PER_SM = 4
MAX_SPLITS = 64
DECODE_NUM_WARPS = 4
MERGE_NUM_WARPS = 2


@triton.jit
def _paged_decode_kernel(
    q_ptr,  # [B, num_q_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    out_ptr,  # [B, num_q_heads, head_dim]                    (SPLIT == False)
    part_out_ptr,  # [B, num_q_heads, num_splits, HEAD_DIM] fp32   (SPLIT == True)
    part_lse_ptr,  # [B, num_q_heads, num_splits] fp32, base-2 lse (SPLIT == True)
    scale_log2,  # softmax scale * log2(e)
    tokens_per_split,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_od,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lt,
    stride_lh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    head = kvh * GROUP + g  # [G] query heads served by this KV head

    # q: [G, D]; padded heads and dims load 0, so their scores are 0 (finite), never NaN.
    q_off = seq * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd
    q = tl.load(q_ptr + q_off, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max (base 2)
    l_i = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)

    bt_row = block_tables_ptr + seq * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)  # [N] context positions
        pos_mask = pos < end
        blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=pos_mask, other=0).to(tl.int64)
        slot_k = blk * stride_kb + (pos % BLOCK_SIZE) * stride_kt + kvh * stride_kh
        slot_v = blk * stride_vb + (pos % BLOCK_SIZE) * stride_vt + kvh * stride_vh
        kv_mask = pos_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + slot_k[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [N, D]
        v = tl.load(v_cache_ptr + slot_v[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [N, D]
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [G, N]
        s = tl.where(pos_mask[None, :], s, float("-inf"))
        # The first iteration of a non-empty split has a live position, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if SPLIT:
        # An empty split (start >= seq_len) keeps l_i = 0: it stores o = 0, lse = -inf.
        live = l_i > 0
        o = acc / tl.where(live, l_i, 1.0)[:, None]
        lse = tl.where(live, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        p_off = seq * stride_pt + head[:, None] * stride_ph + split * stride_ps + d[None, :]
        tl.store(part_out_ptr + p_off, o, mask=g_mask[:, None] & d_mask[None, :])
        tl.store(part_lse_ptr + seq * stride_lt + head * stride_lh + split, lse, mask=g_mask)
    else:
        o = acc / l_i[:, None]
        o_off = seq * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od
        tl.store(
            out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :]
        )


@triton.jit
def _merge_splits_kernel(
    part_out_ptr,  # [B, num_q_heads, num_splits, HEAD_DIM] fp32
    part_lse_ptr,  # [B, num_q_heads, num_splits] fp32 (base 2)
    out_ptr,  # [B, num_q_heads, head_dim]
    num_splits,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lt,
    stride_lh,
    stride_ot,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    s_mask = s < num_splits
    d_mask = d < HEAD_DIM

    lse = tl.load(
        part_lse_ptr + seq * stride_lt + head * stride_lh + s, mask=s_mask, other=float("-inf")
    )  # [S]
    # Split 0 always holds position 0 (seq_len >= 1), so lse_max is finite.
    w = tl.exp2(lse - tl.max(lse, 0))  # [S], 0 for empty or padded splits
    p_off = seq * stride_pt + head * stride_ph + s[:, None] * stride_ps + d[None, :]
    o = tl.load(part_out_ptr + p_off, mask=s_mask[:, None] & d_mask[None, :], other=0.0)  # [S, D]
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)  # [D]
    o_off = seq * stride_ot + head * stride_oh + d * stride_od
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def decode_constexprs(shape: PagedShape, dtype: torch.dtype, block_n: int, split: bool) -> dict:
    """Compile-time parameters of `_paged_decode_kernel` (also compiled ahead of time by
    `benchmarks/triton_compile.py`, so that check sees exactly what the launcher picks)."""
    dot_fp32, dot_precision = dot_settings(dtype)
    return {
        "GROUP": shape.group,
        "GROUP_PAD": max(MIN_DOT_DIM, next_pow2(shape.group)),
        "HEAD_DIM": shape.head_dim,
        "HEAD_DIM_PAD": shape.head_dim_pad,
        "BLOCK_SIZE": shape.block_size,
        "BLOCK_N": block_n,
        "SPLIT": split,
        "DOT_FP32": dot_fp32,
        "DOT_PRECISION": dot_precision,
    }


def merge_constexprs(shape: PagedShape, num_splits: int) -> dict:
    """Compile-time parameters of `_merge_splits_kernel`."""
    return {
        "HEAD_DIM": shape.head_dim,
        "HEAD_DIM_PAD": shape.head_dim_pad,
        "SPLITS_PAD": next_pow2(num_splits),
    }


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device, block_n: int
) -> int:
    """Splits per sequence: enough programs to fill the GPU, each split >= MIN_TOKENS_PER_SPLIT.

    On CPU (the interpreter) one split: there is no parallelism to win.
    """
    if device.type != "cuda":
        return 1
    wanted = cdiv(PROGRAMS_PER_SM * sm_count(device), num_seqs * num_kv_heads)
    most = max(1, max_seq_len // max(MIN_TOKENS_PER_SPLIT, block_n))
    return max(1, min(wanted, most, MAX_SPLITS))


def paged_decode_attention(
    q: torch.Tensor,  # [B, num_q_heads, head_dim], one new token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [B, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor,  # [B] int32, context length including the new token (>= 1)
    scale: float,
    max_seq_len: int,
    out: torch.Tensor | None = None,  # [B, num_q_heads, head_dim]
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:  # [B, num_q_heads, head_dim]
    """Attention of one query token per sequence over its paged context.

    Launch: grid (B, num_kv_heads, num_splits), num_warps 4; constexprs GROUP (q heads per
    KV head) padded to GROUP_PAD = max(16, next_pow2(GROUP)), HEAD_DIM padded to
    max(16, next_pow2(head_dim)), BLOCK_SIZE (cache block), BLOCK_N (positions per step,
    a power of two >= 16; default `default_tile`). Strides are passed explicitly; only
    the last (head_dim) stride of the caches must be 1. `max_seq_len` (host int) sizes
    the splits without a device sync.
    """
    shape = check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    num_seqs = q.shape[0]
    # Positions per loop step: 64 x head_dim 64 x 2 B = 8 KiB of K (and of V) at fp16.
    block_n = block_n or default_tile(shape, q.dtype)
    if block_n < MIN_DOT_DIM or block_n != next_pow2(block_n):
        raise ValueError(f"block_n must be a power of two >= {MIN_DOT_DIM}, got {block_n}")
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1 for decode, got {max_seq_len}")
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, shape.num_kv_heads, max_seq_len, q.device, block_n)
    # Whole BLOCK_N steps per split; recount so the longest sequence has no empty tail.
    tokens_per_split = cdiv(cdiv(max_seq_len, num_splits), block_n) * block_n
    num_splits = cdiv(max_seq_len, tokens_per_split)
    split = num_splits > 1

    if split:
        part_out = torch.empty(
            num_seqs,
            shape.num_q_heads,
            num_splits,
            shape.head_dim,
            dtype=torch.float32,
            device=q.device,
        )
        part_lse = torch.empty(
            num_seqs, shape.num_q_heads, num_splits, dtype=torch.float32, device=q.device
        )
    else:  # unused by the kernel; any fp32 tensor keeps the signature fixed
        part_out = part_lse = torch.empty(1, 1, 1, 1, dtype=torch.float32, device=q.device)

    grid = (num_seqs, shape.num_kv_heads, num_splits)
    _paged_decode_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse,
        scale * LOG2_E, tokens_per_split,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        **decode_constexprs(shape, q.dtype, block_n, split),
        num_warps=DECODE_NUM_WARPS,
    )  # fmt: skip
    if split:
        _merge_splits_kernel[(num_seqs, shape.num_q_heads)](
            part_out, part_lse, out, num_splits,
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1), out.stride(2),
            **merge_constexprs(shape, num_splits),
            num_warps=MERGE_NUM_WARPS,
        )  # fmt: skip
    return out
