"""Where received KV units land: a fresh tensor, or the decode worker's own cache.

A transfer's units are numbered `u = row * n + position` with `row = 2 * layer + kv`
over the transfer's layers (see wire.py). A chunk's consecutive units cover, in
general, the end of one row, some whole rows, and the start of another:

    row r0:   . . . [p0 ......... n)        head: one partial row
    rows r1..r2:    [0 ........... n)        body: whole rows, one op for all of them
    row r3:         [0 ..... p1) . . .       tail: one partial row

so a sink writes every chunk with at most three tensor ops, whatever its size.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.kvtransfer.wire import ChunkHeader


@dataclass(frozen=True)
class Span:
    """Units of rows [row_start, row_end), positions [pos_start, pos_end) of each row,
    taken from data[data_start : data_end] (row-major)."""

    row_start: int
    row_end: int
    pos_start: int
    pos_end: int
    data_start: int
    data_end: int


def spans(unit_start: int, count: int, n: int) -> Iterator[Span]:
    """Split units [unit_start, unit_start + count) of rows of `n` into head/body/tail."""
    u, end = unit_start, unit_start + count
    if u % n and u < end:  # head: finish the row we start inside
        take = min(n - u % n, end - u)
        yield Span(u // n, u // n + 1, u % n, u % n + take, u - unit_start, u - unit_start + take)
        u += take
    full = (end - u) // n
    if full:  # body: whole rows
        yield Span(u // n, u // n + full, 0, n, u - unit_start, u - unit_start + full * n)
        u += full * n
    if u < end:  # tail: the start of the last row
        yield Span(u // n, u // n + 1, 0, end - u, u - unit_start, end - unit_start)


class TensorSink:
    """Writes a transfer into `out`: [L, 2, n, block_size, kvh, head_dim] (a view is fine)."""

    def __init__(self, out: torch.Tensor) -> None:
        if out.ndim != 6 or out.shape[1] != 2:
            raise ValueError(
                f"out must be [L, 2, n, block_size, kvh, head_dim], got {tuple(out.shape)}"
            )
        self.out = out
        self.n = out.shape[2]

    def bind(self, header: ChunkHeader) -> None:
        if tuple(self.out.shape) != header.transfer_shape:
            raise ValueError(
                f"out is {tuple(self.out.shape)}, the transfer is {header.transfer_shape}"
            )
        if self.out.dtype != header.dtype:
            raise ValueError(f"out is {self.out.dtype}, the transfer is {header.dtype}")

    def write_units(self, unit_start: int, data: torch.Tensor) -> None:
        data = data.to(self.out.device)
        if self.out.is_contiguous():
            flat = self.out.view(-1, *self.out.shape[3:])  # [L * 2 * n, bs, kvh, d]
            flat[unit_start : unit_start + data.shape[0]].copy_(data)
            return
        for s in spans(unit_start, data.shape[0], self.n):
            part = data[s.data_start : s.data_end].view(
                s.row_end - s.row_start, -1, *data.shape[1:]
            )
            for i, r in enumerate(range(s.row_start, s.row_end)):
                self.out[r // 2, r % 2, s.pos_start : s.pos_end].copy_(part[i])


class CacheSink:
    """Writes a transfer straight into a paged KV cache, at the receiver's block ids.

    kv: [num_layers, 2, num_blocks, block_size, kvh, head_dim], the whole cache
    (`KVCache.kv`); transfer block position i lands in block `dst_block_ids[i]` of the
    transfer's layers. One copy from the receive buffer into the cache, no staging.

    Every unit is one contiguous run of bytes in the cache, so the cache is viewed as
    rows of unit bytes and a chunk is written with one row scatter over precomputed row
    numbers (dtype-agnostic: bf16 moves as bytes). On CPU the scatter is numpy's
    fancy-index assignment, which copies each row with memcpy: ~6 GB/s here, where
    torch's `index_copy_` managed ~4 GB/s and scattering fp16 elements along the block
    dimension ~2 GB/s. On a GPU it is `index_copy_`.
    """

    def __init__(self, kv: torch.Tensor, dst_block_ids: Sequence[int]) -> None:
        if kv.ndim != 6 or kv.shape[1] != 2:
            raise ValueError(
                f"kv must be [L, 2, num_blocks, block_size, kvh, head_dim], got {tuple(kv.shape)}"
            )
        ids = [int(b) for b in dst_block_ids]
        bad = [b for b in ids if not 0 <= b < kv.shape[2]]
        if bad:
            raise ValueError(f"destination block ids {bad} out of range [0, {kv.shape[2]})")
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate destination block ids in {ids}")
        self.kv = kv
        self.ids = torch.tensor(ids, dtype=torch.long, device=kv.device)
        self.n = len(ids)
        self.layer_start = 0
        unit_bytes = kv[0, 0, 0].numel() * kv.element_size()
        # kv as [L * 2 * num_blocks, unit bytes]: (layer, t, block) is row
        # (2 * layer + t) * num_blocks + block
        rows = kv.view(-1).view(torch.uint8).view(-1, unit_bytes) if kv.is_contiguous() else None
        self._rows = rows.numpy() if rows is not None and kv.device.type == "cpu" else rows
        self._index: torch.Tensor | np.ndarray | None = None  # cache row of each unit

    def bind(self, header: ChunkHeader) -> None:
        if header.num_blocks != self.n:
            raise ValueError(
                f"transfer has {header.num_blocks} blocks, {self.n} destination ids given"
            )
        if header.num_layers != self.kv.shape[0]:
            raise ValueError(
                f"sender's model has {header.num_layers} layers, this cache {self.kv.shape[0]}"
            )
        if header.unit_shape != tuple(self.kv.shape[3:]):
            raise ValueError(
                f"sender's blocks are {header.unit_shape}, this cache's {tuple(self.kv.shape[3:])}"
            )
        if header.dtype != self.kv.dtype:
            raise ValueError(f"sender's KV is {header.dtype}, this cache is {self.kv.dtype}")
        self.layer_start = header.layer_start
        rows = torch.arange(2 * header.layer_start, 2 * header.layer_end, device=self.kv.device)
        # unit u = row * n + position  ->  cache row (2 * layer_start + row) * NB + ids[position]
        index = (rows[:, None] * self.kv.shape[2] + self.ids[None, :]).reshape(-1)
        self._index = index.numpy() if isinstance(self._rows, np.ndarray) else index

    def write_units(self, unit_start: int, data: torch.Tensor) -> None:
        data = data.to(self.kv.device, non_blocking=True)
        k = data.shape[0]
        if self._rows is not None and self._index is not None:
            units = data.contiguous().view(-1).view(torch.uint8).view(k, -1)  # [k, unit bytes]
            where = self._index[unit_start : unit_start + k]
            if isinstance(self._rows, np.ndarray):
                self._rows[where] = units.numpy()
            else:
                self._rows.index_copy_(0, where, units)
            return
        base = 2 * self.layer_start  # non-contiguous cache: per row of the transfer
        for s in spans(unit_start, k, self.n):
            part = data[s.data_start : s.data_end].view(
                s.row_end - s.row_start, -1, *data.shape[1:]
            )
            for i, r in enumerate(range(base + s.row_start, base + s.row_end)):
                self.kv[r // 2, r % 2].index_copy_(0, self.ids[s.pos_start : s.pos_end], part[i])
