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

Shared memory (`shm_dir`, CPU caches only): the tensor is then a MAP_SHARED mapping
of a file `pagedserve-kvcache-<pid>-<random>` in that directory (a tmpfs, /dev/shm),
its pages allocated and faulted in up front (common/shm.py: a full tmpfs fails at
start-up with ENOSPC, never with SIGBUS later), so that a KV exporter on the same host
can let pullers read exported blocks where they are, one copy instead of two
(kvtransfer/source.py, in-place exports; it finds the file by the tensor's address,
`shm.shared_file_of`). Attention and K/V writes cost the same on tmpfs pages as on
anonymous ones (benchmarks/NOTES.md, "KV transfer in place"). When the directory lacks
room the cache falls back to ordinary memory and says so in a log line. The file is
unlinked by `close()`, or when the cache is collected or the interpreter exits; the
files of processes that died without that are found by `remove_stale_cache_files`.
"""

from __future__ import annotations

import logging
import os
import secrets
import weakref
from contextlib import suppress
from pathlib import Path

import torch

from pagedserve.common import shm
from pagedserve.common.api.model_config import ModelSpec

logger = logging.getLogger(__name__)
CACHE_FILE_PREFIX = shm.KV_CACHE_FILE_PREFIX
# group 1: the creating process's pid; then 16 hex digits (several caches per process)
CACHE_FILE_NAME = shm.KV_CACHE_FILE


class KVCache:
    """Storage for `num_blocks` KV blocks of `block_size` tokens each."""

    def __init__(
        self,
        spec: ModelSpec,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str | torch.device,
        shm_dir: str | Path | None = None,
    ) -> None:
        """shm_dir: allocate the cache in a shared-memory file there (see the module
        docstring); None, or a device other than the CPU: ordinary memory."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_blocks, spec.num_layers, 2, block_size, spec.num_kv_heads, spec.head_dim)
        self.shm_path: Path | None = None  # the shared file holding the cache, if any
        self._finalizer: weakref.finalize | None = None
        kv = None
        if shm_dir is not None and self.device.type == "cpu":
            kv = self._allocate_shared(Path(shm_dir), shape, dtype)
        # Zero-filled so that padded slots (never attended to) hold finite values (a new
        # tmpfs file's pages are zeros too).
        self.kv = kv if kv is not None else torch.zeros(shape, dtype=dtype, device=self.device)
        # (kv, [(k_cache, v_cache) per layer]): `layer`'s views, made on first use
        self._layer_views: tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]] | None
        self._layer_views = None

    def _allocate_shared(self, shm_dir: Path, shape: tuple, dtype: torch.dtype):
        """The cache tensor in a new shared file, or None (logged) when there is no room."""
        nbytes = dtype.itemsize
        for n in shape:
            nbytes *= n
        size = -(-nbytes // shm.PAGE) * shm.PAGE
        path = shm_dir / f"{CACHE_FILE_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        try:
            shm.check_room(shm_dir, size)
            mapping = shm.create_shm(path, size)
        except OSError as e:
            logger.warning(
                "KV cache (%d bytes) in ordinary memory, not in shared memory: %s "
                "(in-place KV exports off; exports are staged)",
                size,
                e,
            )
            return None
        flat = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)  # keeps `mapping`
        self.shm_path = path
        address = flat.data_ptr()
        shm.register(shm.SharedFile(path, address, size))
        self._finalizer = weakref.finalize(self, _unlink_cache_file, path, address)
        logger.info("KV cache in shared memory: %s (%.1f MiB)", path, size / 2**20)
        return flat.view(dtype).view(shape)

    def close(self) -> None:
        """Unlink the cache's shared file, if any (idempotent). The memory stays mapped
        for this cache and for pullers that map it until the last mapping goes."""
        if self._finalizer is not None:
            self._finalizer()

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
        with block stride `kv.stride(0)` (see the module docstring).

        The views are made once per `kv` tensor and handed out again: each forward
        asks once per layer, and two indexing ops cost ~10 us a layer (0.3 ms of a
        30-layer step; 2026-12-02, 2-core Skylake-SP Xeon). Rebuilt if `kv` is
        replaced (it is not, after __init__; the identity check is what makes it safe)."""
        views = self._layer_views
        if views is None or views[0] is not self.kv:
            kv = self.kv
            with torch.inference_mode(False):  # plain views, whoever asks first
                views = (kv, [(kv[:, j, 0], kv[:, j, 1]) for j in range(kv.shape[1])])
            self._layer_views = views
        return views[1][i]

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


def _unlink_cache_file(path: Path, address: int) -> None:
    shm.unregister(address)
    with suppress(FileNotFoundError):
        path.unlink()


def remove_stale_cache_files(shm_dir: str | Path = shm.SHM_DIR) -> list[str]:
    """Unlink KV cache files whose process is gone; returns their names."""
    return shm.remove_stale(Path(shm_dir), CACHE_FILE_NAME)


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
