"""The sending side: block sets exported under leases, and the gRPC service serving them.

A worker that computed a prompt's KV calls `KVSource.export(kv, block_ids, ...)`. The
blocks are copied once into a staged segment (segment.py: chunk headers with their
checksums, then the payload), in /dev/shm when `use_shm` (same-host pullers map it) or
in private memory. From then on the segment is independent of the cache: the worker
may keep the blocks (prefix cache) or free them; the lease only holds the segment.
For a cache on a GPU this copy is the device-to-host copy any transfer needs.

The segment's payload is the transfer's block-major order ([n, L, 2, bs, kvh, d],
wire.py), and the cache is block-major too, so a block (every layer's K and V) is one
contiguous run on both sides: the gather is one memcpy per block (per run of
consecutive block ids). It is done chunk by chunk, each chunk's CRC computed on a
helper thread while the next chunk is gathered (both release the GIL), so exporting
costs about one copy.

A lease ends by `release` (the puller is done), by expiry (`expire()`, called from the
worker's loop; `get` also refuses an expired lease), or by `close`. Its segment is
then renamed out of the lease's name (a late puller finds nothing) and kept, mapped
and paged in, in a pool of at most `pool_bytes` for the next export: creating,
faulting in and freeing tens of MiB of /dev/shm per request cost more than the copy
itself. Segments beyond the pool are unlinked. An expired lease's segment is reused
only after `reuse_grace_s`, in case a slow puller still reads it (and a puller checks
the segment header after copying, see segment.py). Segments of an exporter that dies
without closing are found by `segment.remove_stale_segments` (the name carries the
pid); an exporter unlinks its own segments at interpreter exit.

Staging is bounded: at most `max_open_leases` leases and `max_staged_bytes` staged
(the worker derives the byte cap from /dev/shm's free space at start-up); an export
past either raises `StagingFullError` (the Prefill servicer answers RESOURCE_EXHAUSTED)
after first ending leases past their expiry. A new /dev/shm segment is created only
if the filesystem has room, with its pages allocated up front (segment.create_shm);
when /dev/shm is full the lease is staged in private memory instead and pullers use
gRPC (`handle.shm_name` is empty), so a full tmpfs never ends in SIGBUS.

In-place exports (one copy instead of two, same-host pullers): when the caller passes
`on_end` and the cache tensor it exports from lives in a shared file in `shm_dir`
(common/core/kv_cache.py; `shm.shared_file_of` finds it by address), nothing is copied:
the lease's file is an in-place descriptor (segment.py: the block ids, the layout and
the cache file's name) and a puller reads the blocks straight out of the exporter's
cache (transport.py). The caller must keep the exported blocks pinned (unchanged,
never reused) until the lease ends: `on_end()` is called exactly once then, on release,
expiry or close, after the descriptor was invalidated (its header zeroed, the file
unlinked), from whichever thread ended the lease. The handle says `in_place`; for a
staged export `on_end` is not kept and the caller may unpin at once. In-place leases
pin at most `max_in_place_bytes` of blocks together (the decode side's pace now holds
the exporter's pool, which staging avoided); beyond that, and for caches in ordinary
memory, the export is staged as before. gRPC pullers of an in-place lease get each
chunk checksummed where its blocks lie in the cache and copied once, straight into the
message (`InPlaceBlocks.messages`), sealed as staged chunks are.

`add_kvtransfer_service(server, source)` registers `pagedserve.v1.KVTransfer` on a
gRPC server (sync, or grpc.aio with a migration thread pool: the handler is a plain
generator).

Size: over the ~500-line mark on purpose. A lease's whole life is here: admission
against the staging caps, staging (shm segment or private memory), expiry, release
and the PullBlocks servicer that reads it; its locking is only correct seen whole.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import torch

from pagedserve.common.shm import shared_file_of
from pagedserve.kvtransfer.faults import fault_chunk
from pagedserve.kvtransfer.handle import ExportedKV, KVLayout, local_host_id
from pagedserve.kvtransfer.segment import (
    SEGMENT_HEADER_BYTES,
    SHM_DIR,
    CacheRef,
    SegmentLayout,
    SegmentView,
    check_lease_id,
    create_shm,
    free_bytes,
    pack_descriptor,
    parse_segment,
    segment_name,
)
from pagedserve.kvtransfer.sinks import RowMap, unit_rows
from pagedserve.kvtransfer.wire import (
    DEFAULT_MAX_CHUNK_BYTES,
    ChunkHeader,
    LeaseNotFoundError,
    checksum_executor,
    checksum_kind,
    chunk_headers,
    encode_chunks,
    encode_header,
    encode_headers,
    frame_kvchunk,
    frame_kvchunk_parts,
    header_size,
    payload_range,
    plan_chunks,
    seal,
    seal_parts,
    slow_checksum,
    tensor_view,
)
from pagedserve.v1 import kvtransfer_pb2

logger = logging.getLogger(__name__)
SERVICE_NAME = "pagedserve.v1.KVTransfer"
_MIB = 1 << 20


@dataclass
class _Buffer:
    """Staging memory: a mapped /dev/shm file, or private memory. Reused via the pool."""

    flat: memoryview  # writable bytes, `capacity` long
    capacity: int
    path: Path | None  # the file's current name; None for private memory
    keepalive: object  # the mmap or tensor behind `flat`
    generation: int = 0  # bumped on every reuse
    reusable_at: float = 0.0  # on the source's clock


@dataclass
class StagedBlocks:
    """One exported block set: its handle and its staged segment."""

    handle: ExportedKV
    segment: SegmentView
    payload: torch.Tensor  # [n, L, 2, block_size, kvh, head_dim], a view of the segment
    expires_at: float  # on the source's clock
    max_chunk_bytes: int  # chunk size the segment was cut with
    checksum: str | None  # checksum kind of the chunks (None = the default)
    buffer: _Buffer
    generation: int  # buffer.generation while this lease owns it

    @property
    def path(self) -> Path | None:
        return self.buffer.path

    @property
    def staged_bytes(self) -> int:
        return self.buffer.capacity

    pinned_bytes = 0  # a staged lease pins no block of the cache

    def valid(self) -> bool:
        """False once the buffer was handed to another lease."""
        return self.buffer.generation == self.generation

    def chunks(
        self,
        block_ids: Sequence[int] | None = None,
        layers: tuple[int, int] | None = None,
        max_chunk_bytes: int | None = None,
    ) -> Iterator[tuple[memoryview | bytes, memoryview]]:
        """(header, payload) of each chunk of the requested part; ValueError if invalid.

        The whole set in the staged chunk size is served from the segment as is
        (checksums computed at export); any other request gathers its blocks and
        layers into a new contiguous tensor and seals fresh chunks over it.
        """
        lay = self.handle.layout
        ids = self.handle.block_ids if not block_ids else tuple(block_ids)
        l0, l1 = layers if layers is not None else (0, lay.num_layers)
        if not 0 <= l0 < l1 <= lay.num_layers:
            raise ValueError(
                f"layer range [{l0}, {l1}) outside the model's {lay.num_layers} layers"
            )
        chunk = max_chunk_bytes or self.max_chunk_bytes
        plan_chunks(1, self.payload[0, 0, 0].numel() * self.payload.element_size(), chunk)
        whole = ids == self.handle.block_ids and (l0, l1) == (0, lay.num_layers)
        if whole and chunk == self.max_chunk_bytes:
            return ((raw, self.segment.chunk_payload(h)) for h, raw in self.segment.headers)
        pos = torch.tensor(positions_of(self.handle.block_ids, ids), dtype=torch.long)
        # one gather: [len(ids), l1 - l0, 2, bs, kvh, d], contiguous (a block's layer
        # range is one contiguous run of the segment)
        sub = self.payload[:, l0:l1].index_select(0, pos)
        encoded = encode_chunks(
            sub,
            block_ids=ids,
            num_tokens=self.handle.num_tokens,
            request_id=self.handle.request_id,
            layer_start=l0,
            num_layers=lay.num_layers,
            max_chunk_bytes=chunk,
            checksum=self.checksum,
        )
        return ((c.header_bytes, c.payload) for c in encoded)


def positions_of(all_ids: Sequence[int], wanted: Sequence[int]) -> list[int]:
    """Index of each wanted block id in `all_ids`; ValueError naming unknown/duplicate ids."""
    index = {b: i for i, b in enumerate(all_ids)}
    unknown = [b for b in wanted if b not in index]
    if unknown:
        raise ValueError(f"block ids {unknown} are not in the lease (it holds {list(all_ids)})")
    if len(set(wanted)) != len(wanted):
        raise ValueError(f"duplicate block ids in {list(wanted)}")
    return [index[b] for b in wanted]


@dataclass
class InPlaceBlocks:
    """One block set exported in place: its handle, the cache it stays in, its descriptor."""

    handle: ExportedKV
    kv: torch.Tensor  # the exporter's whole cache [num_blocks, L, 2, bs, kvh, d]
    expires_at: float  # on the source's clock
    max_chunk_bytes: int
    checksum: str | None
    path: Path  # the in-place descriptor (segment.py)
    pinned_bytes: int  # the exported blocks' bytes, pinned by the caller until on_end
    on_end: Callable[[], None]
    ended: bool = False  # set (under the source's lock) before on_end runs
    staged_bytes = 0

    def valid(self) -> bool:
        """False once the lease ended: its blocks may be reused from then on."""
        return not self.ended

    def chunks(
        self,
        block_ids: Sequence[int] | None = None,
        layers: tuple[int, int] | None = None,
        max_chunk_bytes: int | None = None,
    ) -> Iterator[tuple[bytes, memoryview]]:
        """(header, payload) of each chunk of the requested part, gathered from the cache
        chunk by chunk and sealed (a gRPC puller verifies checksums as for a staged
        lease); ValueError if the request is invalid. A caller checks `valid()` after
        taking each chunk: a chunk gathered after the lease ended may hold reused blocks.
        """
        return (
            (sealed, memoryview(b"".join(parts)))
            for sealed, parts in self._sealed_parts(block_ids, layers, max_chunk_bytes)
        )

    def messages(
        self,
        block_ids: Sequence[int] | None = None,
        layers: tuple[int, int] | None = None,
        max_chunk_bytes: int | None = None,
    ) -> Iterator[bytes]:
        """`chunks` framed as KVChunk messages (PullBlocks); ValueError if invalid.

        Each message is built straight from the cache: the chunk's runs of cache rows
        are checksummed where they lie, then joined into the message, one copy. (It was
        gather into a chunk buffer, checksum, copy into the message: two copies a chunk,
        and a fresh, page-faulted buffer each; NOTES.md, 2026-12-02.) Same `valid()`
        rule as `chunks`."""
        return (
            frame_kvchunk_parts(sealed, parts)
            for sealed, parts in self._sealed_parts(block_ids, layers, max_chunk_bytes)
        )

    def _sealed_parts(
        self,
        block_ids: Sequence[int] | None,
        layers: tuple[int, int] | None,
        max_chunk_bytes: int | None,
    ) -> Iterator[tuple[bytes, list[np.ndarray]]]:
        """(sealed header, the chunk's runs of cache rows) of each chunk of the requested
        part, each sealed when asked for; the request is validated at once (ValueError)."""
        lay = self.handle.layout
        ids = self.handle.block_ids if not block_ids else tuple(int(b) for b in block_ids)
        positions_of(self.handle.block_ids, ids)  # membership and duplicates
        l0, l1 = layers if layers is not None else (0, lay.num_layers)
        if not 0 <= l0 < l1 <= lay.num_layers:
            raise ValueError(
                f"layer range [{l0}, {l1}) outside the model's {lay.num_layers} layers"
            )
        headers = chunk_headers(
            **_transfer_fields(
                self.kv, lay, ids, self.handle.num_tokens, self.handle.request_id, (l0, l1)
            ),
            max_chunk_bytes=max_chunk_bytes or self.max_chunk_bytes,
            checksum=self.checksum,
        )
        return _sealed_runs(self.kv, ids, l0, l1, headers)


def _sealed_runs(
    kv: torch.Tensor, ids: tuple[int, ...], l0: int, l1: int, headers: list[ChunkHeader]
) -> Iterator[tuple[bytes, list[np.ndarray]]]:
    """Each chunk of the transfer of blocks `ids`, layers [l0, l1) of the block-major
    CPU cache `kv`: its header sealed over the chunk's runs of cache rows (`RowMap`: a
    block over every layer is one run), and those runs, views into the cache."""
    src = unit_rows(kv)
    row_map = RowMap(ids, 2 * (l1 - l0), 2 * kv.shape[1], 2 * l0)
    for h, raw in zip(headers, encode_headers(headers), strict=True):
        parts = [src[row : row + b - a] for a, b, row in row_map.pieces(h.unit_start, h.unit_count)]
        yield seal_parts(raw, parts)[0], parts


class KVSource:
    """Exports block sets under leases and serves them until released or expired."""

    def __init__(
        self,
        *,
        host_id: str | None = None,
        transfer_address: str = "",
        use_shm: bool = True,
        shm_dir: Path = SHM_DIR,
        default_ttl_s: float = 30.0,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        checksum: str | None = None,
        pool_bytes: int = 256 * _MIB,
        reuse_grace_s: float = 5.0,
        on_expire: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_staged_bytes: int | None = None,
        max_open_leases: int | None = None,
        max_in_place_bytes: int = 256 * _MIB,
    ) -> None:
        """max_staged_bytes, max_open_leases: caps on what open leases hold (None: no cap);
        an export beyond them raises StagingFullError. The pool (`pool_bytes`) is apart.
        max_in_place_bytes: cache bytes that in-place leases may pin together; an export
        past it is staged instead (0: never in place).
        """
        for name, cap in (
            ("max_staged_bytes", max_staged_bytes),
            ("max_open_leases", max_open_leases),
        ):
            if cap is not None and cap < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {cap}")
        if default_ttl_s <= 0:
            raise ValueError(f"default_ttl_s must be > 0, got {default_ttl_s}")
        if max_in_place_bytes < 0:
            raise ValueError(f"max_in_place_bytes must be >= 0, got {max_in_place_bytes}")
        if pool_bytes < 0 or reuse_grace_s < 0:
            raise ValueError(
                f"pool_bytes and reuse_grace_s must be >= 0, got {pool_bytes}, {reuse_grace_s}"
            )
        plan_chunks(1, 1, max_chunk_bytes)  # validates the chunk size
        checksum_kind(checksum)  # validates the checksum kind
        self.checksum = checksum
        self.host_id = host_id or local_host_id()
        self.transfer_address = transfer_address
        self.use_shm = use_shm
        self.shm_dir = Path(shm_dir)
        self.default_ttl_s = default_ttl_s
        self.max_chunk_bytes = max_chunk_bytes
        self.pool_bytes = pool_bytes
        self.reuse_grace_s = reuse_grace_s
        self.on_expire = on_expire
        self.clock = clock
        self.expired_total = 0
        self.max_staged_bytes = max_staged_bytes
        self.max_open_leases = max_open_leases
        self.refused_total = 0  # exports refused at a cap
        self.private_fallbacks = 0  # exports staged privately: /dev/shm had no room
        self.max_in_place_bytes = max_in_place_bytes
        self.in_place_total = 0  # exports done in place
        self.in_place_refused = 0  # in-place exports staged instead: at max_in_place_bytes
        self._leases: dict[str, StagedBlocks | InPlaceBlocks] = {}
        self._pinning: dict[str, int] = {}  # in-place leases being made: bytes reserved
        self._dirs_seen: dict[Path, bool] = {}  # directory -> is shm_dir (_in_shm_dir)
        self._staging: dict[str, int] = {}  # leases being staged: bytes reserved
        self._pool: list[_Buffer] = []
        self._lock = threading.Lock()
        self._names = itertools.count()
        # Pool file names must differ between the sources of one process (several
        # workers in one test process would otherwise rename each other's files).
        self._tag = uuid.uuid4().hex[:8]
        self._paths: set[Path] = set()  # every file we own, unlinked if we are never closed
        self._finalizer = weakref.finalize(self, _unlink_all, self._paths)

    # -- exporting ------------------------------------------------------------------------

    def export(
        self,
        kv: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, kvh, head_dim]
        block_ids: Sequence[int],
        *,
        num_tokens: int,
        request_id: str = "",
        lease_id: str | None = None,
        ttl_s: float | None = None,
        on_end: Callable[[], None] | None = None,
    ) -> ExportedKV:
        """Stage blocks `block_ids` of cache `kv` under a new lease; returns its handle.

        `block_ids` hold the prompt in order, so `num_tokens` must fill the last one
        partly or fully: (n - 1) * block_size < num_tokens <= n * block_size.

        on_end: the caller keeps the blocks pinned until it is called, so the export may
        be in place (the module docstring): then the handle says `in_place` and
        `on_end()` runs exactly once, when the lease ends. Otherwise (the handle's
        `in_place` is False) it is never called and the blocks are free at once.
        """
        lease_id = lease_id or uuid.uuid4().hex
        check_lease_id(lease_id)  # the naming rule pullers check handles against
        ttl = self.default_ttl_s if ttl_s is None else ttl_s
        if ttl <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl}")
        layout = KVLayout.of_cache(kv)
        ids = tuple(int(b) for b in block_ids)
        num_blocks = kv.shape[0]  # once: a torch call per id cost ~0.5 ms at 128 ids
        bad = [b for b in ids if not 0 <= b < num_blocks]
        if not ids or bad or len(set(ids)) != len(ids):
            raise ValueError(
                f"block ids must be distinct ids in [0, {kv.shape[0]}), at least one; "
                f"got {list(ids)}"
            )
        bs = layout.block_size
        if not (len(ids) - 1) * bs < num_tokens <= len(ids) * bs:
            raise ValueError(
                f"num_tokens {num_tokens} does not fill {len(ids)} blocks of {bs} tokens "
                f"(expected {(len(ids) - 1) * bs + 1}..{len(ids) * bs})"
            )
        with self._lock:
            if lease_id in self._leases or lease_id in self._staging:
                raise ValueError(f"lease {lease_id!r} is already open")
        try:
            staged: StagedBlocks | InPlaceBlocks | None = None
            if on_end is not None:
                staged = self._in_place(
                    kv, layout, ids, num_tokens, request_id, lease_id, ttl, on_end
                )
            if staged is None:
                staged = self._stage(kv, layout, ids, num_tokens, request_id, lease_id, ttl)
        finally:
            with self._lock:
                self._staging.pop(lease_id, None)
                self._pinning.pop(lease_id, None)
        with self._lock:
            self._leases[lease_id] = staged
        return staged.handle

    # -- in place -------------------------------------------------------------------------

    def _in_place(
        self, kv, layout, ids, num_tokens, request_id, lease_id, ttl, on_end
    ) -> InPlaceBlocks | None:
        """An in-place lease over the cache's own blocks, or None: the cache is not in a
        shared file of `shm_dir`, the in-place cap is reached, or the lease cap is (the
        staged export then refuses it), or the descriptor could not be written."""
        if not self.use_shm or kv.device.type != "cpu" or not kv.is_contiguous():
            return None
        found = shared_file_of(kv.data_ptr(), kv.numel() * kv.element_size())
        if found is None or not self._in_shm_dir(found[0].path):
            return None  # pullers look for the cache file in shm_dir
        shared, offset = found
        block_bytes = kv[0].numel() * kv.element_size()
        nbytes = len(ids) * block_bytes
        with self._lock:
            if lease_id in self._leases or lease_id in self._staging:
                raise ValueError(f"lease {lease_id!r} is already open")
            leases = len(self._leases) + len(self._staging)
            if self.max_open_leases is not None and leases >= self.max_open_leases:
                return None
            if self._pinned() + nbytes > self.max_in_place_bytes:
                self.in_place_refused += 1
                return None
            self._staging[lease_id] = 0  # an open lease, no staging memory
            self._pinning[lease_id] = nbytes
        # The descriptor's chunk header: a chunk of the whole transfer over its first
        # block's units (any valid chunk carries the transfer's ids and layout; cutting
        # the whole plan to take its first header cost ~2 ms at 128 blocks).
        units = 2 * layout.num_layers
        first = ChunkHeader(
            **_transfer_fields(kv, layout, ids, num_tokens, request_id),
            chunk_index=0,
            chunk_count=1,
            unit_start=0,
            unit_count=units,
            payload_len=block_bytes,
            checksum_kind=checksum_kind(self.checksum),
        )
        ref = CacheRef(shared.path.name, offset, kv.shape[0], block_bytes)
        path = self.shm_dir / segment_name(os.getpid(), lease_id)
        try:
            self._write_descriptor(path, pack_descriptor(lease_id, encode_header(first), ref))
        except OSError as e:  # /dev/shm full, say: staged (privately, if need be) instead
            logger.warning("in-place export of lease %s staged instead: %s", lease_id, e)
            return None
        self.in_place_total += 1
        handle = ExportedKV(
            lease_id=lease_id,
            request_id=request_id,
            host_id=self.host_id,
            transfer_address=self.transfer_address,
            shm_name=path.name,
            block_ids=ids,
            num_tokens=num_tokens,
            layout=layout,
            expires_unix_ms=int((time.time() + ttl) * 1000),
            in_place=True,
        )
        return InPlaceBlocks(
            handle,
            kv,
            self.clock() + ttl,
            self.max_chunk_bytes,
            self.checksum,
            path,
            nbytes,
            on_end,
        )

    def _write_descriptor(self, path: Path, data: bytes) -> None:
        """Write an in-place descriptor under a temporary name, then give it `path`, so
        a puller never reads a half-written one."""
        tmp = path.with_name(path.name + ".tmp")
        self._paths.update((tmp, path))
        try:
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
            os.rename(tmp, path)
            self._paths.discard(tmp)
        except BaseException:
            for p in (tmp, path):
                with suppress(FileNotFoundError):
                    p.unlink()
                self._paths.discard(p)
            raise

    def _invalidate(self, lease: InPlaceBlocks) -> None:
        """End an in-place lease's descriptor (lock held): its segment header zeroed, so a
        puller that has it open fails its check after the copy, then unlinked, so no
        new puller finds it. Only after this may the blocks be unpinned."""
        lease.ended = True
        try:
            fd = os.open(lease.path, os.O_WRONLY)
        except FileNotFoundError:
            fd = -1
        if fd >= 0:
            try:
                os.pwrite(fd, bytes(SEGMENT_HEADER_BYTES), 0)
            finally:
                os.close(fd)
            with suppress(FileNotFoundError):
                lease.path.unlink()
        self._paths.discard(lease.path)

    def _in_shm_dir(self, path: Path) -> bool:
        """Whether `path` is a file of shm_dir (resolved once per directory)."""
        ok = self._dirs_seen.get(path.parent)
        if ok is None:
            ok = self._dirs_seen[path.parent] = path.parent.resolve() == self.shm_dir.resolve()
        return ok

    def _pinned(self) -> int:
        """Bytes pinned by in-place leases, open or being made (lock held)."""
        open_ = sum(s.pinned_bytes for s in self._leases.values())
        return open_ + sum(self._pinning.values())

    def _admit(self, lease_id: str, size: int) -> None:
        """Reserve room for a lease staging `size` bytes, or raise StagingFullError.

        Leases past their expiry are ended first: they would go at the next expire().
        """
        problem = ""
        for attempt in range(2):
            with self._lock:
                if lease_id in self._staging or lease_id in self._leases:
                    raise ValueError(f"lease {lease_id!r} is already open")
                problem = self._over_cap(size)
                if not problem:
                    self._staging[lease_id] = size
                    return
            if attempt == 0:
                self.expire()
        self.refused_total += 1
        raise StagingFullError(
            f"KV staging is full: {problem}; retry when leases are released or expire"
        )

    def _over_cap(self, size: int) -> str:
        """Why a new lease of `size` bytes does not fit now ("" if it does); lock held."""
        leases = len(self._leases) + len(self._staging)
        if self.max_open_leases is not None and leases >= self.max_open_leases:
            return f"{leases} leases open, at most {self.max_open_leases}"
        held = sum(s.staged_bytes for s in self._leases.values()) + sum(self._staging.values())
        if self.max_staged_bytes is not None and held + size > self.max_staged_bytes:
            return (
                f"{held} bytes staged, this lease needs {size} more, at most "
                f"{self.max_staged_bytes}"
            )
        return ""

    def _stage(self, kv, layout, ids, num_tokens, request_id, lease_id, ttl) -> StagedBlocks:
        headers = chunk_headers(
            **_transfer_fields(kv, layout, ids, num_tokens, request_id),
            max_chunk_bytes=self.max_chunk_bytes,
            checksum=self.checksum,
        )
        payload_len = headers[0].num_units * headers[0].unit_bytes
        seg = SegmentLayout.plan(header_size(request_id, len(ids)), len(headers), payload_len)
        self._admit(lease_id, _capacity(seg.total_len))
        buf = self._take_buffer(seg.total_len)
        try:
            flat = buf.flat
            flat[:SEGMENT_HEADER_BYTES] = bytes(SEGMENT_HEADER_BYTES)  # "being written"
            shape = (len(ids), layout.num_layers, 2, *layout.unit_shape)
            payload = tensor_view(flat[seg.payload_offset : seg.total_len], kv.dtype, shape)
            sealed = _gather_and_seal(
                kv, ids, payload, flat[seg.payload_offset : seg.total_len], headers
            )
            table = SEGMENT_HEADER_BYTES
            for header_bytes in sealed:
                flat[table : table + len(header_bytes)] = header_bytes
                table += len(header_bytes)
            flat[:SEGMENT_HEADER_BYTES] = seg.pack(lease_id)
            segment = parse_segment(flat)
            if buf.path is not None:  # now complete: give it the lease's name
                self._rename(buf, self.shm_dir / segment_name(os.getpid(), lease_id))
        except BaseException:
            self._discard(buf)
            raise
        handle = ExportedKV(
            lease_id=lease_id,
            request_id=request_id,
            host_id=self.host_id,
            transfer_address=self.transfer_address,
            shm_name=buf.path.name if buf.path is not None else "",
            block_ids=ids,
            num_tokens=num_tokens,
            layout=layout,
            expires_unix_ms=int((time.time() + ttl) * 1000),
        )
        expires_at = self.clock() + ttl
        return StagedBlocks(
            handle,
            segment,
            payload,
            expires_at,
            self.max_chunk_bytes,
            self.checksum,
            buf,
            buf.generation,
        )

    # -- staging buffers ------------------------------------------------------------------

    def _take_buffer(self, size: int) -> _Buffer:
        """A pooled buffer that fits (at most 2x, or +1 MiB, too big), else a new one."""
        now = self.clock()
        with self._lock:
            fits = [
                b
                for b in self._pool
                if size <= b.capacity <= max(2 * size, size + _MIB) and b.reusable_at <= now
            ]
            if fits:
                buf = min(fits, key=lambda b: b.capacity)
                self._pool.remove(buf)
                buf.generation += 1
                return buf
        capacity = _capacity(size)
        if self.use_shm:
            try:
                return self._new_shm_buffer(capacity)
            except OSError as e:  # no room in /dev/shm: private memory, served over gRPC
                self.private_fallbacks += 1
                logger.warning("staging %d bytes privately (gRPC pulls only): %s", capacity, e)
        tensor = torch.empty(capacity, dtype=torch.uint8)
        return _Buffer(memoryview(tensor.numpy()), capacity, None, tensor)

    def _new_shm_buffer(self, capacity: int) -> _Buffer:
        """A new /dev/shm segment; OSError when the filesystem has no room for it.

        Checked twice: free space first (cheap, and leaves other users their share),
        then create_shm allocates every page (posix_fallocate), so a tmpfs filled by
        someone else in between fails here too, never with SIGBUS on a write later.
        """
        free = free_bytes(self.shm_dir)
        if free < capacity:
            raise OSError(
                errno.ENOSPC, f"{self.shm_dir} has {free} bytes free, a segment needs {capacity}"
            )
        path = self._pool_path()
        self._paths.add(path)
        try:
            mapping = create_shm(path, capacity)
        except BaseException:
            self._paths.discard(path)
            raise
        return _Buffer(memoryview(mapping), capacity, path, mapping)

    def _pool_path(self) -> Path:
        return self.shm_dir / segment_name(os.getpid(), f"pool-{self._tag}-{next(self._names)}")

    def _recycle(self, buf: _Buffer, delay: float) -> None:
        """Return a lease's buffer to the pool (caller holds the lock), or free it."""
        pooled = sum(b.capacity for b in self._pool)
        if pooled + buf.capacity > self.pool_bytes:
            self._discard(buf)
            return
        if buf.path is not None:
            self._rename(buf, self._pool_path())  # the lease's name disappears now
        buf.reusable_at = self.clock() + delay
        self._pool.append(buf)

    def _rename(self, buf: _Buffer, new: Path) -> None:
        os.rename(buf.path, new)
        self._paths.add(new)
        self._paths.discard(buf.path)
        buf.path = new

    def _discard(self, buf: _Buffer) -> None:
        """Free a buffer: unlink its file; the memory goes with the last mapping."""
        buf.generation += 1
        if buf.path is not None:
            with suppress(FileNotFoundError):
                buf.path.unlink()
            self._paths.discard(buf.path)

    # -- leases ---------------------------------------------------------------------------

    def get(self, lease_id: str) -> StagedBlocks | InPlaceBlocks:
        """The blocks of an open lease; LeaseNotFoundError otherwise."""
        with self._lock:
            staged = self._leases.get(lease_id)
            expired = staged is not None and self.clock() >= staged.expires_at
            if expired:
                self._end(lease_id, expired=True)
        if expired:
            self._ended([staged])
            self._notify_expired([lease_id])
            raise LeaseNotFoundError(f"lease {lease_id!r} expired")
        if staged is None:
            raise LeaseNotFoundError(f"unknown lease {lease_id!r} (never exported, or released)")
        return staged

    def release(self, lease_id: str) -> bool:
        """End a lease; False when it was not open (unknown, released or expired)."""
        with self._lock:
            ended = self._end(lease_id, expired=False)
        self._ended([ended])
        return ended is not None

    def expire(self) -> list[str]:
        """End every lease past its expiry; returns their ids (and counts them)."""
        now = self.clock()
        with self._lock:
            ids = [lid for lid, s in self._leases.items() if now >= s.expires_at]
            ended = [self._end(lid, expired=True) for lid in ids]
        self._ended(ended)
        self._notify_expired(ids)
        return ids

    @property
    def open_leases(self) -> int:
        with self._lock:
            return len(self._leases)

    @property
    def staged_bytes(self) -> int:
        """Bytes of staging memory held by open leases."""
        with self._lock:
            return sum(s.staged_bytes for s in self._leases.values())

    @property
    def pinned_bytes(self) -> int:
        """Cache bytes pinned by open in-place leases."""
        with self._lock:
            return sum(s.pinned_bytes for s in self._leases.values())

    @property
    def pooled_bytes(self) -> int:
        """Bytes of staging memory kept for reuse."""
        with self._lock:
            return sum(b.capacity for b in self._pool)

    def close(self) -> None:
        """End every lease and free every segment, pooled ones included (idempotent)."""
        with self._lock:
            ended = [self._end(lid, expired=False) for lid in list(self._leases)]
            for buf in self._pool:
                self._discard(buf)
            self._pool.clear()
        self._ended(ended)
        self._finalizer()

    def __enter__(self) -> KVSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _end(self, lease_id: str, *, expired: bool) -> StagedBlocks | InPlaceBlocks | None:
        """Take a lease out (lock held); the caller passes it to `_ended` after the lock."""
        staged = self._leases.pop(lease_id, None)
        if staged is not None:
            self.expired_total += expired
            if isinstance(staged, InPlaceBlocks):
                self._invalidate(staged)
            else:
                self._recycle(staged.buffer, self.reuse_grace_s if expired else 0.0)
        return staged

    def _ended(self, leases: Sequence[StagedBlocks | InPlaceBlocks | None]) -> None:
        """Tell the owners of ended in-place leases that their blocks are free (outside
        the lock: an `on_end` may call back into this source)."""
        for lease in leases:
            if isinstance(lease, InPlaceBlocks):
                try:
                    lease.on_end()
                except Exception:
                    logger.exception("on_end of in-place lease %s failed", lease.handle.lease_id)

    def _notify_expired(self, lease_ids: list[str]) -> None:
        if self.on_expire is not None:
            for lid in lease_ids:
                self.on_expire(lid)


def _transfer_fields(
    kv, layout, ids, num_tokens: int, request_id: str, layers: tuple[int, int] | None = None
) -> dict:
    """The chunk-header fields of a transfer of blocks `ids` of cache `kv`, layers
    [l0, l1) (None: every layer): what staged chunks, an in-place descriptor's header
    and the chunks gathered for a gRPC pull of an in-place lease have in common."""
    l0, l1 = layers if layers is not None else (0, layout.num_layers)
    return dict(
        request_id=request_id,
        dtype=kv.dtype,
        num_layers=layout.num_layers,
        layer_start=l0,
        layer_end=l1,
        block_size=layout.block_size,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        block_ids=ids,
        num_tokens=num_tokens,
    )


class StagingFullError(RuntimeError):
    """An export refused: the source's cap on open leases or staged bytes is reached."""


def _capacity(size: int) -> int:
    """Staging buffers come in whole MiB (so the pool can reuse them)."""
    return -(-size // _MIB) * _MIB


def _gather_and_seal(
    kv: torch.Tensor,  # [num_blocks, L, 2, bs, kvh, d], the block-major cache
    ids: tuple[int, ...],
    payload: torch.Tensor,  # [n, L, 2, bs, kvh, d], a view of `data`
    data: memoryview,
    headers: list[ChunkHeader],
) -> list[bytes]:
    """payload[i] = kv[ids[i]], chunk by chunk; returns the sealed headers.

    On a contiguous CPU cache each chunk's units are gathered right before it is
    sealed, as runs of consecutive cache rows (`RowMap`: a whole block, every layer,
    is one memcpy; consecutive ids merge), so a slow checksum (CRC-32, on the helper
    thread) overlaps the next chunk's gather. A GPU cache is gathered on the device
    and copied to the host at once (one device-to-host copy), then sealed.
    """
    src = unit_rows(kv) if kv.device.type == "cpu" else None
    dst = unit_rows(payload)
    if src is None or dst is None:
        index = torch.tensor(ids, dtype=torch.long, device=kv.device)
        payload.copy_(kv.index_select(0, index))
    else:
        units_per_block = 2 * kv.shape[1]
        row_map = RowMap(ids, units_per_block, units_per_block)
    sealed: list[bytes | Future] = []
    for h, raw in zip(headers, encode_headers(headers), strict=True):
        if src is not None and dst is not None:
            u0 = h.unit_start
            for a, b, row in row_map.pieces(u0, h.unit_count):
                dst[u0 + a : u0 + b] = src[row : row + b - a]
        if slow_checksum(h.checksum_kind):
            sealed.append(checksum_executor().submit(seal, raw, data[payload_range(h)]))
        else:  # XXH3 of a chunk just written (in cache): cheaper than a hand-off
            sealed.append(seal(raw, data[payload_range(h)])[0])
    return [s.result()[0] if isinstance(s, Future) else s for s in sealed]


def _unlink_all(paths: set[Path]) -> None:
    for p in list(paths):
        with suppress(FileNotFoundError):
            p.unlink()
    paths.clear()


# -- gRPC service -------------------------------------------------------------------------


class KVTransferServicer:
    """`pagedserve.v1.KVTransfer`: streams a lease's blocks as framed KVChunk messages."""

    def __init__(self, source: KVSource) -> None:
        self.source = source

    def PullBlocks(  # noqa: N802 (gRPC method name)
        self, request: kvtransfer_pb2.PullRequest, context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        try:
            staged = self.source.get(request.lease_id)
        except LeaseNotFoundError as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        layers = (request.layers.start, request.layers.end) if request.HasField("layers") else None
        try:
            part = (list(request.block_ids), layers, request.max_chunk_bytes or None)
            if isinstance(staged, InPlaceBlocks):  # framed straight from the cache
                messages = staged.messages(*part)
            else:  # one copy of each chunk out of the segment: gRPC Python sends `bytes`
                messages = (frame_kvchunk(h, p) for h, p in staged.chunks(*part))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        for message in messages:
            if not staged.valid():  # released and reused while we were sending
                context.abort(
                    grpc.StatusCode.NOT_FOUND, f"lease {request.lease_id!r} ended during the pull"
                )
            yield from fault_chunk(message, self.source.transfer_address)  # tests: faults.py


def add_kvtransfer_service(server: grpc.Server, source: KVSource) -> KVTransferServicer:
    """Register the KVTransfer service for `source` on `server` (before it starts)."""
    servicer = KVTransferServicer(source)
    handler = grpc.method_handlers_generic_handler(
        SERVICE_NAME,
        {
            "PullBlocks": grpc.unary_stream_rpc_method_handler(
                servicer.PullBlocks,
                request_deserializer=kvtransfer_pb2.PullRequest.FromString,
                response_serializer=None,  # already serialized: framed KVChunk bytes
            )
        },
    )
    server.add_generic_rpc_handlers((handler,))
    return servicer
