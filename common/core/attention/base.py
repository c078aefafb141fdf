"""The contract between the model and its attention backends.

Layout of the paged KV cache (one tensor for the whole model, see `kv_cache.py`):

    kv: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]   block-major
    k_cache = kv[:, layer, 0]   # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache = kv[:, layer, 1]   # same

so a backend's k_cache / v_cache are strided views: block b's [block_size, kvh,
head_dim] tile is contiguous, at element offset b * k_cache.stride(0) (which is
num_layers * 2 * block_size * kvh * head_dim, not one tile). Backends index blocks
through stride(0) (the Triton and C kernels take it as an argument), never by
assuming consecutive blocks are adjacent; a plain contiguous [num_blocks, ...]
tensor (unit tests) is the special case stride(0) = one tile.

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

from dataclasses import dataclass, field

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
    # What backends derive from this step's metadata once and reuse in every layer
    # (e.g. `write_kv`'s slot rows). Built per step with the metadata, never shared.
    memo: dict = field(default_factory=dict, repr=False, compare=False)

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
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, meta.memo)
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
    memo: dict | None = None,  # AttentionMetadata.memo: per-step results shared by layers
) -> None:
    """Scatter each new token's K/V into its slot (the reshape_and_cache of vLLM).

    The caches are layer views of the block-major cache (block stride > one tile), so
    they cannot be viewed as [num_blocks * block_size, kvh, d]. Instead each is seen
    as rows of one token's [kvh, d] starting at its own first element: block b's token
    o is row b * rows_per_block + o, rows_per_block = stride(0) / (kvh * d). That row
    view is contiguous, so `index_copy_` keeps its one-memcpy-per-token path (an
    `index_put_` over (block, offset) pairs copies element by element). The view runs
    past the layer's own tiles into the other layers' bytes of each block, but only
    rows that are this layer's tokens are ever indexed.
    """
    rows_k, per_block = _token_rows_memo(k_cache, memo)
    rows_v, _ = _token_rows_memo(v_cache, memo)
    rows = _slot_rows(slot_mapping, k_cache.shape[1], per_block, memo)
    rows_k.index_copy_(0, rows, k.to(k_cache.dtype))
    rows_v.index_copy_(0, rows, v.to(v_cache.dtype))


def _token_rows_memo(cache: torch.Tensor, memo: dict | None) -> tuple[torch.Tensor, int]:
    """`_token_rows(cache)`, its checks and arithmetic done once a step: they depend
    only on the shape and strides, which every layer's view of the cache shares (each
    layer's view starts at its own address, so the row view itself is made per call,
    one `as_strided`). Checks and all cost ~9 us a cache view, ~0.5 ms of a 30-layer
    step (2026-12-02, 2-core Skylake-SP Xeon)."""
    if memo is None:
        return _token_rows(cache)
    key = ("token_rows", cache.shape, cache.stride())
    got = memo.get(key)
    if got is None:
        rows, per_block = _token_rows(cache)
        memo[key] = (rows.shape, rows.stride(), per_block)
        return rows, per_block
    shape, stride, per_block = got
    return cache.as_strided(shape, stride), per_block


def _slot_rows(
    slot_mapping: torch.Tensor, bs: int, per_block: int, memo: dict | None
) -> torch.Tensor:
    """Row of each slot in `_token_rows`' view. Every layer of a step writes the same
    slots, and the four small tensor ops cost ~60 us a call on 2 cores (measured), ~2 ms
    a 30-layer step if redone per layer: `forward` passes its metadata's memo, so they
    run once a step."""
    if per_block == bs:
        return slot_mapping
    if memo is not None and (bs, per_block) in memo:
        return memo[bs, per_block]
    rows = (slot_mapping // bs) * per_block + slot_mapping % bs
    if memo is not None:
        memo[bs, per_block] = rows
    return rows


def tile_contiguous(cache: torch.Tensor) -> bool:
    """Whether `cache` [NB, BS, KVH, D] has each block's [BS, KVH, D] tile contiguous and
    blocks at least a tile apart: a contiguous tensor or a layer view of the
    block-major cache (kv_cache.py), the layouts of the module docstring. The one
    definition of that predicate: the C kernel's `cpu_kernel.fits` asks it, and
    `_token_rows` (write_kv) raises when it fails."""
    if cache.ndim != 4:
        return False
    _, bs, kvh, d = cache.shape
    st = cache.stride()
    return st[3] == 1 and st[2] == d and st[1] == kvh * d and st[0] >= bs * kvh * d


def _token_rows(cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(rows, rows_per_block): `cache` [NB, BS, kvh, d] with contiguous block tiles as
    a contiguous [(NB - 1) * rows_per_block + BS, kvh, d] view (see `write_kv`).

    Beyond `tile_contiguous`, the block stride must be a whole number of token rows
    (kvh * d), or block b would not start at a row of the view; the block-major cache's
    stride always is (layers * 2 * BS * kvh * d), the C kernel does not need it."""
    nb, bs, h, d = cache.shape
    st = cache.stride()
    if not tile_contiguous(cache) or st[0] % (h * d):
        raise ValueError(
            f"KV cache view with strides {st} for shape {tuple(cache.shape)}: each block's "
            "[block_size, kvh, head_dim] tile must be contiguous"
        )
    per_block = st[0] // (h * d)
    n_rows = (nb - 1) * per_block + bs if nb else 0
    return cache.as_strided((n_rows, h, d), (h * d, d, 1)), per_block
