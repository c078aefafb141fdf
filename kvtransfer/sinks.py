"""Where received KV units land: a fresh tensor, or the decode worker's own cache.

A transfer's units are numbered block-major (wire.py): unit `u` is row `u % R` of
block position `u // R`, with `R = 2 * L` rows (`row = 2 * layer + kv`) per block
over the transfer's L layers. Both destinations store a block's rows back to back
too, so unit (position, row) lands at destination row

    dest(position, row) = ids[position] * S + offset + row

of the destination viewed as rows of unit bytes: a block-major cache has
`S = 2 * num_layers` rows per block and `offset = 2 * layer_start`; a tensor
`[n, L, 2, ...]` has `S = R`, `offset = 0` and ids 0..n-1. `RowMap` turns a chunk's
unit range into *runs*: maximal ranges of units whose destination rows are
consecutive. One block's rows are always one run (a whole block over every layer is
one memcpy of 360 KiB for the default model); neighbouring blocks merge when their
destination rows touch (consecutive ids, every layer); a chunk cut inside a block
gives one partial run at either end. So a sink writes a 1 MiB chunk with a handful
of copies, never unit by unit.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from pagedserve.kvtransfer.wire import ChunkHeader, tensor_view


class RowMap:
    """Unit -> destination row, as runs: unit (p, r) goes to row ids[p] * stride + offset + r.

    `starts[i]` is the first unit of run i, `rows[i]` its destination row; run i ends
    where run i + 1 starts (the last at `num_units`).
    """

    def __init__(
        self, ids: Sequence[int], units_per_block: int, stride: int, offset: int = 0
    ) -> None:
        if offset < 0 or offset + units_per_block > stride:
            raise ValueError(
                f"{units_per_block} rows at offset {offset} do not fit {stride} rows per block"
            )
        self.units_per_block = units_per_block
        self.num_units = len(ids) * units_per_block
        starts: list[int] = []
        rows: list[int] = []
        next_row = None  # the row right after the previous run
        for p, b in enumerate(ids):
            row = int(b) * stride + offset
            if row != next_row:  # a new run (else block p continues the previous one)
                starts.append(p * units_per_block)
                rows.append(row)
            next_row = row + units_per_block
        starts.append(self.num_units)  # sentinel: the end of the last run
        self.starts = starts
        self.rows = rows

    def pieces(self, unit_start: int, count: int) -> Iterator[tuple[int, int, int]]:
        """(data_start, data_end, dest_row) of each run units [unit_start, +count) touch:
        data[data_start:data_end] (indices into the chunk) go to consecutive rows from
        dest_row."""
        end = unit_start + count
        if not 0 <= unit_start <= end <= self.num_units:
            raise ValueError(f"units [{unit_start}, {end}) outside [0, {self.num_units})")
        i = bisect.bisect_right(self.starts, unit_start) - 1
        u = unit_start
        while u < end:
            stop = min(self.starts[i + 1], end)
            yield u - unit_start, stop - unit_start, self.rows[i] + u - self.starts[i]
            u = stop
            i += 1


def copy_mapped(dst: np.ndarray, dst_map: RowMap, src: np.ndarray, src_map: RowMap) -> None:
    """Every unit of a transfer from `src` rows (unit u at `src_map`'s row) to `dst` rows
    (at `dst_map`'s): one copy per piece where neither side's run breaks, so a block
    (every layer) is one memcpy and runs of consecutive ids on both sides merge."""
    n = dst_map.num_units
    if src_map.num_units != n:
        raise ValueError(f"copying {src_map.num_units} units into {n}")
    i = j = u = 0
    while u < n:
        d_end, s_end = dst_map.starts[i + 1], src_map.starts[j + 1]
        end = min(d_end, s_end)
        d = dst_map.rows[i] + u - dst_map.starts[i]
        s = src_map.rows[j] + u - src_map.starts[j]
        dst[d : d + end - u] = src[s : s + end - u]
        u = end
        i += end == d_end
        j += end == s_end


def unit_rows(t: torch.Tensor) -> torch.Tensor | np.ndarray | None:
    """A contiguous tensor [..., bs, kvh, d] as rows of unit bytes (numpy on CPU: its
    slice assignment is a plain memcpy with less per-call cost than torch's copy_), or
    None when it is not contiguous (the per-unit fallback)."""
    if not t.is_contiguous():
        return None
    unit_bytes = t[(0,) * (t.ndim - 3)].numel() * t.element_size()
    rows = t.view(-1).view(torch.uint8).view(-1, unit_bytes)  # dtype-agnostic: bf16 as bytes
    return rows.numpy() if t.device.type == "cpu" else rows


def _copy_runs(
    rows: torch.Tensor | np.ndarray, row_map: RowMap, unit_start: int, data: torch.Tensor
) -> None:
    """data [k, bs, kvh, d] (units unit_start..) into `rows`, one copy per run."""
    k = data.shape[0]
    units = data.contiguous().view(-1).view(torch.uint8).view(k, -1)  # [k, unit bytes]
    if isinstance(rows, np.ndarray):
        src = units.numpy()
        for a, b, row in row_map.pieces(unit_start, k):
            rows[row : row + b - a] = src[a:b]
    else:
        for a, b, row in row_map.pieces(unit_start, k):
            rows[row : row + b - a].copy_(units[a:b])


def _copy_run_bytes(
    rows: np.ndarray, row_map: RowMap, unit_start: int, count: int, buf: memoryview
) -> None:
    """`count` units of raw bytes (units unit_start..) into `rows`, one copy per run:
    `_copy_runs` without the torch views (a gRPC chunk arrives as bytes)."""
    src = np.frombuffer(buf, dtype=np.uint8).reshape(count, rows.shape[1])
    for a, b, row in row_map.pieces(unit_start, count):
        rows[row : row + b - a] = src[a:b]


class _RowSink:
    """What both sinks share: a target tensor (`_target`) seen as rows of unit bytes
    (`_rows`, see `unit_rows`; None when it is strided) and the map of the bound
    transfer's units onto those rows (`_map`; None until `bind` where it depends on
    the transfer). A subclass sets the three and writes strided targets itself
    (`write_units`)."""

    _target: torch.Tensor
    _rows: torch.Tensor | np.ndarray | None
    _map: RowMap | None

    def _bound(self, method: str) -> RowMap:
        if self._map is None:
            raise RuntimeError(f"{type(self).__name__}.{method} before bind")
        return self._map

    def write_units(self, unit_start: int, data: torch.Tensor) -> None:
        raise NotImplementedError

    def write_unit_bytes(self, unit_start: int, count: int, buf: memoryview) -> None:
        """`write_units` for `count` units as raw bytes (see KVSink in wire.py)."""
        row_map = self._bound("write_unit_bytes")
        if isinstance(self._rows, np.ndarray):
            _copy_run_bytes(self._rows, row_map, unit_start, count, buf)
        else:
            shape = (count, *self._target.shape[3:])
            self.write_units(unit_start, tensor_view(buf, self._target.dtype, shape))

    def copy_from(self, src: np.ndarray, src_map: RowMap) -> bool:
        """The whole bound transfer from rows `src` (see `copy_mapped`) in one pass;
        False when this sink cannot (a GPU or strided target): use write_units."""
        row_map = self._bound("copy_from")
        if not isinstance(self._rows, np.ndarray):
            return False
        copy_mapped(self._rows, row_map, src, src_map)
        return True


class TensorSink(_RowSink):
    """Writes a transfer into `out`: [n, L, 2, block_size, kvh, head_dim] (a view is fine)."""

    def __init__(self, out: torch.Tensor) -> None:
        if out.ndim != 6 or out.shape[2] != 2:
            raise ValueError(
                f"out must be [n, L, 2, block_size, kvh, head_dim], got {tuple(out.shape)}"
            )
        self.out = self._target = out
        self._rows = unit_rows(out)
        n, L = out.shape[:2]
        self._map = RowMap(range(n), 2 * L, 2 * L)  # out's rows are the units: one run

    def bind(self, header: ChunkHeader) -> None:
        if tuple(self.out.shape) != header.transfer_shape:
            raise ValueError(
                f"out is {tuple(self.out.shape)}, the transfer is {header.transfer_shape}"
            )
        if self.out.dtype != header.dtype:
            raise ValueError(f"out is {self.out.dtype}, the transfer is {header.dtype}")

    def write_units(self, unit_start: int, data: torch.Tensor) -> None:
        data = data.to(self.out.device)
        if self._rows is not None:
            _copy_runs(self._rows, self._map, unit_start, data)
            return
        R = self._map.units_per_block  # a strided view: unit by unit
        for j, u in enumerate(range(unit_start, unit_start + data.shape[0])):
            p, r = divmod(u, R)
            self.out[p, r // 2, r % 2].copy_(data[j])


class CacheSink(_RowSink):
    """Writes a transfer straight into a paged KV cache, at the receiver's block ids.

    kv: [num_blocks, num_layers, 2, block_size, kvh, head_dim], the whole block-major
    cache (`KVCache.kv`); transfer block position i lands in block `dst_block_ids[i]`
    of the transfer's layers. One copy from the receive buffer into the cache, no
    staging.

    The cache is viewed as rows of unit bytes ([num_blocks * num_layers * 2, unit
    bytes], dtype-agnostic: bf16 moves as bytes) and each chunk is written as runs of
    consecutive rows (`RowMap`), one copy each: on CPU numpy slice assignment
    (memcpy), on a GPU `copy_` from the chunk moved to the device once. A strided
    (non-contiguous) cache falls back to one copy per unit.
    """

    def __init__(self, kv: torch.Tensor, dst_block_ids: Sequence[int]) -> None:
        if kv.ndim != 6 or kv.shape[2] != 2:
            raise ValueError(
                f"kv must be [num_blocks, L, 2, block_size, kvh, head_dim], got {tuple(kv.shape)}"
            )
        ids = [int(b) for b in dst_block_ids]
        bad = [b for b in ids if not 0 <= b < kv.shape[0]]
        if bad:
            raise ValueError(f"destination block ids {bad} out of range [0, {kv.shape[0]})")
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate destination block ids in {ids}")
        self.kv = self._target = kv
        self.ids = ids
        self.n = len(ids)
        self.layer_start = 0
        self._rows = unit_rows(kv)
        self._map: RowMap | None = None  # set by bind: depends on the layer range

    def bind(self, header: ChunkHeader) -> None:
        if header.num_blocks != self.n:
            raise ValueError(
                f"transfer has {header.num_blocks} blocks, {self.n} destination ids given"
            )
        if header.num_layers != self.kv.shape[1]:
            raise ValueError(
                f"sender's model has {header.num_layers} layers, this cache {self.kv.shape[1]}"
            )
        if header.unit_shape != tuple(self.kv.shape[3:]):
            raise ValueError(
                f"sender's blocks are {header.unit_shape}, this cache's {tuple(self.kv.shape[3:])}"
            )
        if header.dtype != self.kv.dtype:
            raise ValueError(f"sender's KV is {header.dtype}, this cache is {self.kv.dtype}")
        self.layer_start = header.layer_start
        # unit (p, row) -> cache row ids[p] * 2 * num_layers + 2 * layer_start + row
        stride = 2 * self.kv.shape[1]
        self._map = RowMap(self.ids, header.units_per_block, stride, 2 * header.layer_start)

    def write_units(self, unit_start: int, data: torch.Tensor) -> None:
        row_map = self._bound("write_units")
        data = data.to(self.kv.device, non_blocking=True)
        if self._rows is not None:
            _copy_runs(self._rows, row_map, unit_start, data)
            return
        R = row_map.units_per_block  # a strided cache: unit by unit
        for j, u in enumerate(range(unit_start, unit_start + data.shape[0])):
            p, r = divmod(u, R)
            layer = self.layer_start + r // 2
            self.kv[self.ids[p], layer, r % 2].copy_(data[j])
