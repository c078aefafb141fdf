"""The contract between the model and its attention backends.

Layout of the paged KV cache (one tensor for the whole model, see `kv_cache.py`):

    kv: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    k_cache = kv[layer, 0]   # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache = kv[layer, 1]   # same

A token at position `p` of a sequence lives in block `block_table[p // block_size]`
at offset `p % block_size`; its flat slot is `block_id * block_size + offset`.

A batch is a flat list of new tokens, sequences one after another, **prefill
sequences first, then decode sequences** (one new token each):

    tokens:  [ seq0 new tokens | seq1 new tokens | ... | decode0 | decode1 | ... ]
    query_start_loc[i] .. query_start_loc[i+1]   the new tokens of sequence i
    seq_lens[i]                                   context length after this step
                                                  (cached/previously computed + new)

so sequence i's new tokens sit at positions [seq_lens[i] - q_len_i, seq_lens[i]) and
attend causally to every position before them, cached or new.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Everything a backend needs to run one layer's attention over a batch."""

    slot_mapping: torch.Tensor  # [T] int64: flat cache slot of each new token's K/V
    query_start_loc: torch.Tensor  # [B + 1] int32: cumulative new-token counts
    seq_lens: torch.Tensor  # [B] int32: context length after this step
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, padded with 0
    num_prefills: int  # sequences [0, num_prefills) have q_len >= 1 and come first
    num_prefill_tokens: int  # tokens [0, num_prefill_tokens) belong to them
    num_decode_tokens: int  # the rest: one token per decode sequence
    max_query_len: int
    max_seq_len: int
    # Host copies, so backends can loop over sequences without device syncs.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_decodes(self) -> int:
        return self.num_seqs - self.num_prefills


@dataclass(frozen=True)
class LayerKV:
    """One layer's new K/V (this step's tokens) and its paged cache, which already holds
    them when a backend's `attend` runs."""

    k: torch.Tensor  # [T, num_kv_heads, head_dim]
    v: torch.Tensor  # [T, num_kv_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]


class AttentionBackend:
    """Writes the new tokens' K/V into the cache, then attends through block tables.

    All K/V of a layer are written before any attention of that layer is computed,
    so a sequence may read blocks that another sequence in the same batch is
    writing in this very step (prefix-cache hits on blocks computed this step).
    `forward` keeps that order for every backend: a backend implements `attend`
    (and `check`, for checks that must pass before anything is written).
    """

    name: str

    def forward(
        self,
        q: torch.Tensor,  # [T, num_q_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_q_heads, head_dim]
        self.check(q, meta)
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.attend(q, LayerKV(k, v, k_cache, v_cache), meta, scale)

    def check(self, q: torch.Tensor, meta: AttentionMetadata) -> None:
        """Raises ValueError for metadata that does not fit `q`; nothing checked here."""

    def attend(
        self, q: torch.Tensor, kv: LayerKV, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:  # [T, num_q_heads, head_dim]
        raise NotImplementedError


def write_kv(
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """Scatter each new token's K/V into its slot (the reshape_and_cache of vLLM)."""
    nb, bs, h, d = k_cache.shape
    k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
