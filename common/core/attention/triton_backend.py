"""The Triton attention backend: paged K/V write, then the prefill and decode kernels.

Per layer and step (the batch layout of `base.py`: prefills first, then decodes):

    write_kv                  every new token's K/V into its slot (torch index_copy_,
                              one scatter per cache, before any attention reads)
    paged_prefill_attention   tokens [0, num_prefill_tokens): causal over cached prefix
                              + this step's tokens, read back through the block table
    paged_decode_attention    tokens [num_prefill_tokens, T): one per sequence,
                              split-KV over its context

Both kernels write into slices of one output tensor, so no concatenation follows.
"""

from __future__ import annotations

import torch

from pagedserve.common.core.attention.base import AttentionBackend, AttentionMetadata, LayerKV
from pagedserve.common.core.attention.triton_common import MAX_HEAD_DIM, SUPPORTED_DTYPES
from pagedserve.common.core.attention.triton_decode import paged_decode_attention
from pagedserve.common.core.attention.triton_prefill import paged_prefill_attention


class TritonAttentionBackend(AttentionBackend):
    """Paged attention on the Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1)."""

    name = "triton"

    def supports(self, head_dim: int, dtype: torch.dtype) -> str | None:
        """None when (head_dim, dtype) can run on these kernels, else the reason."""
        if head_dim > MAX_HEAD_DIM:
            return f"head_dim {head_dim} exceeds the Triton kernels' maximum {MAX_HEAD_DIM}"
        if dtype not in SUPPORTED_DTYPES:
            return f"dtype {dtype} is not supported by the Triton kernels (fp32, fp16, bf16)"
        return None

    def check(self, q: torch.Tensor, meta: AttentionMetadata) -> None:
        _check_meta(q, meta)

    def attend(
        self, q: torch.Tensor, kv: LayerKV, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        k_cache, v_cache = kv.k_cache, kv.v_cache
        out = torch.empty_like(q)
        num_pre, num_pre_tokens = meta.num_prefills, meta.num_prefill_tokens
        if num_pre > 0:
            paged_prefill_attention(
                q[:num_pre_tokens],
                k_cache,
                v_cache,
                meta.query_start_loc[: num_pre + 1],
                meta.seq_lens[:num_pre],
                meta.block_tables[:num_pre],
                scale,
                max_query_len=max(meta.query_lens_cpu[:num_pre]),
                out=out[:num_pre_tokens],
            )
        if meta.num_decodes > 0:
            paged_decode_attention(
                q[num_pre_tokens:],
                k_cache,
                v_cache,
                meta.block_tables[num_pre:],
                meta.seq_lens[num_pre:],
                scale,
                max_seq_len=max(meta.seq_lens_cpu[num_pre:]),
                out=out[num_pre_tokens:],
            )
        return out


def _check_meta(q: torch.Tensor, meta: AttentionMetadata) -> None:
    """The cheap host-side consistency checks (no device syncs)."""
    expected = meta.num_prefill_tokens + meta.num_decode_tokens
    if q.shape[0] != expected:
        raise ValueError(
            f"q has {q.shape[0]} tokens, metadata describes {meta.num_prefill_tokens} prefill "
            f"+ {meta.num_decode_tokens} decode tokens"
        )
    if meta.num_decode_tokens != meta.num_decodes:
        raise ValueError(
            f"{meta.num_decode_tokens} decode tokens for {meta.num_decodes} decode sequences "
            "(one token each expected)"
        )
    if sum(meta.query_lens_cpu[: meta.num_prefills]) != meta.num_prefill_tokens:
        raise ValueError("num_prefill_tokens != sum of the prefill sequences' query lengths")
