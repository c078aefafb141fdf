"""Triton paged-attention prefill kernel: new tokens over a cached prefix, causal.

A prefill sequence i brings q_len new tokens whose K/V the backend has already written
into the paged cache (together with any cached prefix), so the kernel reads the whole
context [0, seq_len) through the block table:

    # [0, seq_len - q_len)        cached prefix (earlier steps / prefix-cache hits)
    # [seq_len - q_len, seq_len)  this step's tokens; new token j sits at position
    #                             seq_len - q_len + j and sees positions <= its own

Work split (grid = (max_tiles, num_prefills, num_kv_heads)):
- the rows of a tile are BLOCK_M (token, query-head) pairs of one sequence and one KV
  head's GQA group, flattened: row r of tile t is pair f = t * BLOCK_M + r, token
  f // GROUP, head kvh * GROUP + f % GROUP. Any group size packs without padding, and each
  K/V tile loaded serves every query head of the group.
- the program walks the context from position 0 up to the causal limit of its last token,
  BLOCK_N positions at a time, each position looking up its block id in the block table
  (cast to int64 before the stride math); scores are masked by
  `pos <= seq_len - q_len + token` and an online softmax (fp32, base 2) accumulates, so the
  full score matrix never exists: memory per program is O(BLOCK_M x BLOCK_N).
- programs whose tile starts past their sequence's q_len * GROUP pairs return at once
  (the grid is sized by the longest prefill).
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
)

PREFILL_NUM_WARPS = 4


@triton.jit
def _paged_prefill_kernel(
    q_ptr,  # [T, num_q_heads, head_dim], prefill tokens, sequences one after another
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [P, max_blocks] int32
    query_start_loc_ptr,  # [P + 1] int32
    seq_lens_ptr,  # [P] int32
    out_ptr,  # [T, num_q_heads, head_dim]
    scale_log2,  # softmax scale * log2(e)
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
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    kvh = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    if tile * BLOCK_M >= q_len * GROUP:
        return
    ctx_len = seq_len - q_len  # positions before this step's first token

    f = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [M] flat (token, head-in-group) pairs
    row_mask = f < q_len * GROUP
    tok = f // GROUP  # [M] new-token index within the sequence
    head = kvh * GROUP + f % GROUP  # [M] query head
    q_pos = ctx_len + tok  # [M] absolute position of each row's token
    d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = d < HEAD_DIM

    # q: [M, D]
    q_off = (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
    q_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + q_off + d[None, :] * stride_qd, mask=q_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)

    # The tile's last live token bounds the context it needs (causal).
    last_tok = tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // GROUP, q_len - 1)
    kv_end = ctx_len + last_tok + 1
    bt_row = block_tables_ptr + seq * stride_bt
    for n0 in range(0, kv_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)  # [N]
        pos_mask = pos < kv_end
        blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=pos_mask, other=0).to(tl.int64)
        slot_k = blk * stride_kb + (pos % BLOCK_SIZE) * stride_kt + kvh * stride_kh
        slot_v = blk * stride_vb + (pos % BLOCK_SIZE) * stride_vt + kvh * stride_vh
        kv_mask = pos_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + slot_k[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [N, D]
        v = tl.load(v_cache_ptr + slot_v[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [N, D]
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [M, N]
        causal = (pos[None, :] <= q_pos[:, None]) & pos_mask[None, :]
        s = tl.where(causal, s, float("-inf"))
        # Position 0 is visible to every row and lies in the first step: m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    o = acc / l_i[:, None]
    o_off = (q_start + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh
    tl.store(out_ptr + o_off + d[None, :] * stride_od, o.to(out_ptr.dtype.element_ty), mask=q_mask)


def prefill_constexprs(shape: PagedShape, dtype: torch.dtype, block_m: int, block_n: int) -> dict:
    """Compile-time parameters of `_paged_prefill_kernel` (also compiled ahead of time by
    `benchmarks/triton_compile.py`, so that check sees exactly what the launcher picks)."""
    dot_fp32, dot_precision = dot_settings(dtype)
    return {
        "GROUP": shape.group,
        "HEAD_DIM": shape.head_dim,
        "HEAD_DIM_PAD": shape.head_dim_pad,
        "BLOCK_SIZE": shape.block_size,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "DOT_FP32": dot_fp32,
        "DOT_PRECISION": dot_precision,
    }


def paged_prefill_attention(
    q: torch.Tensor,  # [T, num_q_heads, head_dim], prefill tokens of P sequences
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], K/V written
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [P + 1] int32, cumulative new-token counts
    seq_lens: torch.Tensor,  # [P] int32, context length after this step (>= q_len)
    block_tables: torch.Tensor,  # [P, max_blocks] int32, padded with 0
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,  # [T, num_q_heads, head_dim]
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:  # [T, num_q_heads, head_dim]
    """Causal attention of each sequence's new tokens over its whole paged context.

    Launch: grid (cdiv(max_query_len * GROUP, BLOCK_M), P, num_kv_heads), num_warps 4;
    constexprs GROUP, HEAD_DIM padded to max(16, next_pow2(head_dim)), BLOCK_SIZE,
    BLOCK_M and BLOCK_N (powers of two >= 16; default `default_tile`). Strides are passed
    explicitly; only the last (head_dim) stride of the caches must be 1. `max_query_len`
    (host int, the longest q_len among these P sequences) sizes the grid without a
    device sync.
    """
    shape = check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    block_m = block_m or default_tile(shape, q.dtype)  # (token, head) rows per tile
    block_n = block_n or default_tile(shape, q.dtype)  # context positions per step
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if value < MIN_DOT_DIM or value != next_pow2(value):
            raise ValueError(f"{name} must be a power of two >= {MIN_DOT_DIM}, got {value}")
    if query_start_loc.dtype != torch.int32:
        raise ValueError(f"query_start_loc must be int32, got {query_start_loc.dtype}")
    num_prefills = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_prefills + 1:
        raise ValueError(
            f"query_start_loc has {query_start_loc.shape[0]} entries for {num_prefills} sequences"
        )
    if out is None:
        out = torch.empty_like(q)
    if num_prefills == 0 or max_query_len == 0:
        return out

    grid = (cdiv(max_query_len * shape.group, block_m), num_prefills, shape.num_kv_heads)
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        scale * LOG2_E,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        **prefill_constexprs(shape, q.dtype, block_m, block_n),
        num_warps=PREFILL_NUM_WARPS,
    )  # fmt: skip
    return out
