"""The paged KV cache: one tensor holding every layer's K and V blocks.

    kv: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]   block-major

One allocation for the whole model (so a byte budget maps to a block count with
no per-layer slack). Block-major: **all of a block's bytes, every layer's K and V,
are one contiguous run** (`num_layers * 2 * block_size * kvh * d` elements, 360 KiB
for the default model in bf16). That is the unit everything outside attention moves:
KV transfer exports and imports a block with one copy, copy-on-write copies a block
with one copy, a swap reads it with one copy. The layer-major alternative
([num_layers, 2, num_blocks, ...], this cache's layout until 2026-12) cut a block
into 2 * num_layers runs of 6 KiB scattered over the whole cache, and copying runs
of that size at random places ran at 3-4 GB/s where one contiguous range copies at
8-11 GB/s on the developers' 2-core EPYC (benchmarks/NOTES.md, "KV transfer on one
host"). Here the cache is the transfer layout, so nothing is reordered on the way
out or in.

Attention reads one layer: `layer(i)` is (kv[:, i, 0], kv[:, i, 1]), views of shape
[num_blocks, block_size, kvh, d] whose block stride is `num_layers * 2 * block_size
* kvh * d` elements; within a block a layer's K (or V) is still one contiguous
[block_size, kvh, d] tile, which is what the kernels read per block (the C and
Triton kernels take the block stride as an argument; nothing assumes consecutive
blocks are adjacent).

Block ids are physical: which block belongs to which sequence is the block
manager's business; this class only stores bytes and copies blocks.
"""

from __future__ import annotations

import torch

from pagedserve.common.api.model_config import ModelSpec


class KVCache:
    """Storage for `num_blocks` KV blocks of `block_size` tokens each."""

    def __init__(
        self,
        spec: ModelSpec,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str | torch.device,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        # Zero-filled so that padded slots (never attended to) hold finite values.
        self.kv = torch.zeros(
            (num_blocks, spec.num_layers, 2, block_size, spec.num_kv_heads, spec.head_dim),
            dtype=dtype,
            device=self.device,
        )

    @property
    def num_layers(self) -> int:
        return self.kv.shape[1]

    @property
    def bytes_per_block(self) -> int:
        return self.spec.kv_bytes_per_block(self.block_size, self.dtype)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of layer i, each a [num_blocks, block_size, kvh, d] view
        with block stride `kv.stride(0)` (see the module docstring)."""
        return self.kv[:, i, 0], self.kv[:, i, 1]

    def _ids(self, block_ids: list[int]) -> torch.Tensor:
        ids = torch.as_tensor(block_ids, dtype=torch.long)
        if ids.ndim != 1:
            raise ValueError(f"block ids must be a flat list, got shape {tuple(ids.shape)}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
            raise ValueError(f"block ids {bad} out of range [0, {self.num_blocks})")
        return ids.to(self.device)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: for each (src, dst), copy block src into dst in every layer.

        All sources are read before any destination is written, so a dst may be
        another pair's src within one call.
        """
        if not pairs:
            return
        src = self._ids([s for s, _ in pairs])
        dst = self._ids([d for _, d in pairs])
        if len(set(dst.tolist())) != len(pairs):
            raise ValueError(f"copy_blocks: duplicate destination blocks in {pairs}")
        # kv[dst] = kv[src]: one contiguous run per block.
        self.kv.index_copy_(0, dst, self.kv.index_select(0, src))

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """[n, num_layers, 2, block_size, kvh, d], a contiguous copy (swap, tests)."""
        return self.kv.index_select(0, self._ids(block_ids))

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Inverse of `read_blocks`: data [n, num_layers, 2, block_size, kvh, d]."""
        ids = self._ids(block_ids)
        expected = (len(block_ids), *self.kv.shape[1:])
        if tuple(data.shape) != expected:
            raise ValueError(f"write_blocks: data shape {tuple(data.shape)} != expected {expected}")
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"write_blocks: duplicate block ids {block_ids}")
        self.kv.index_copy_(0, ids, data.to(device=self.device, dtype=self.dtype))


def num_blocks_for_budget(
    spec: ModelSpec, block_size: int, dtype: torch.dtype, budget_bytes: int
) -> int:
    """How many whole KV blocks fit in `budget_bytes` (the cache's capacity).

    Raises if not even one block fits, naming the bytes one block needs.
    """
    per_block = spec.kv_bytes_per_block(block_size, dtype)
    n = int(budget_bytes) // per_block
    if n < 1:
        raise ValueError(
            f"KV budget of {budget_bytes} bytes holds no block: one block of "
            f"{block_size} tokens needs {per_block} bytes ({dtype})"
        )
    return n
