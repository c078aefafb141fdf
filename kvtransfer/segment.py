"""A staged block set in one buffer: the chunk headers, then the raw payload.

The exporter stages every exported block set in this layout, in a /dev/shm file
(pullers on the same host map it) or in private memory (served over gRPC only):

    [0, 256)                     segment header (_SEGMENT): magic "PSKVSEG1", version,
                                 chunk count, table length, payload offset/length, total
                                 length, the lease id
    [256, 256 + table_len)       the chunks' wire headers (wire.py), back to back, each
                                 sealed with its chunk's checksum
    [payload_offset, +len)       payload [n, L, 2, block_size, kvh, head_dim] (block-major,
                                 wire.py's unit order), page aligned; chunk i's payload
                                 is its units' byte range in it, and block i's layers
                                 [l0, l1) are one contiguous sub-run of block i
    [total, capacity)            unused (a reused segment may be larger than needed)

so the segment holds exactly the chunks a full pull streams, checksums included, and
a same-host puller verifies and copies them without the exporter doing anything.

Files are named `pagedserve-kv-<pid>-<lease id>` while they hold a lease and
`pagedserve-kv-<pid>-pool-<k>` while they wait in the exporter's pool for reuse; the
pid lets `remove_stale_segments` find the segments of exporters that died without
cleaning up. A segment gets its lease's name only once complete (written under a
`.tmp` or pool name, then renamed), so a puller never maps a half-written one. A
rewrite starts by zeroing the segment header, so a puller that compares the header
before and after its copy detects a segment reused under it.

An *in-place descriptor* (flag FLAG_IN_PLACE in the segment header) is a segment whose
payload is not the KV but a reference to it: the exporter's KV cache lives in a shared
file (common/core/kv_cache.py) and an in-place lease lets same-host pullers read the
exported blocks there (kvtransfer/source.py). Its chunk table holds one wire header,
the transfer's first chunk's, unsealed: it carries the request, the block ids, the
layer count and the block shape and dtype, read by the same decoder as any chunk; its
payload is a `CacheRef` (the cache file's name, where block 0 starts in it, its block
count and block size in bytes). Same name as a segment (`pagedserve-kv-<pid>-<lease>`),
written under `.tmp` and renamed, so the naming rule, `lease_segment_path` and
`remove_stale_segments` apply unchanged. When the lease ends the exporter zeroes the
descriptor's segment header, then unlinks it, and only then lets the blocks go: a
puller that reads the header again after its copy and finds it unchanged knows the
blocks were still pinned while it copied (transport.py).
"""

from __future__ import annotations

import mmap
import os
import re
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

# create_shm, free_bytes: re-exported (this module's names before common/shm.py existed)
from pagedserve.common.shm import (
    KV_CACHE_FILE,
    KV_SEGMENT_FILE,
    KV_SEGMENT_PREFIX,
    PAGE,
    SHM_DIR,
    remove_stale,
)
from pagedserve.common.shm import create_shm as create_shm
from pagedserve.common.shm import free_bytes as free_bytes
from pagedserve.kvtransfer.wire import (
    ChunkHeader,
    KVTransferError,
    decode_header,
    header_length,
    payload_range,
)

SEGMENT_MAGIC = b"PSKVSEG1"
SEGMENT_VERSION = 1
SEGMENT_HEADER_BYTES = 256
MAX_LEASE_ID_BYTES = 128
FLAG_IN_PLACE = 1  # the segment header's flags: an in-place descriptor (module docstring)
SEGMENT_PREFIX = KV_SEGMENT_PREFIX
# magic, version, flags, chunk count, table length, payload offset, payload length,
# total length, lease id length; then the lease id (<= 128 bytes)
_SEGMENT = struct.Struct("<8sHHIQQQQH")
_NAME = KV_SEGMENT_FILE  # group 1: the exporter's pid


# The naming rule of leases and of their segments, one for both sides: the exporter
# checks it where names are made (KVSource.export, segment_name), a puller checks a
# handle against it before opening anything (kvtransfer/validate.py, ShmTransport). A
# lease id is 1-128 of [A-Za-z0-9_-] (so never a path separator, a dot or ".."), and
# not "pool-..." (the exporter's names for segments waiting in its pool); the segment
# of lease L exported by process P is exactly `pagedserve-kv-<P>-<L>` in the shm dir.
# fullmatch, not match: `$` would let a trailing newline through.
LEASE_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
POOL_PREFIX = "pool-"
_LEASE_SEGMENT = re.compile(rf"{SEGMENT_PREFIX}(\d{{1,10}})-(.+)")


def segment_name(pid: int, lease_id: str) -> str:
    return f"{SEGMENT_PREFIX}{pid}-{lease_id}"


def check_lease_id(lease_id: str) -> None:
    """ValueError unless `lease_id` follows the naming rule above."""
    if not LEASE_ID.fullmatch(lease_id) or lease_id.startswith(POOL_PREFIX):
        raise ValueError(
            f"lease id {lease_id[:160]!r} is not a lease id: expected 1-128 characters of "
            f"[A-Za-z0-9_-], not starting with {POOL_PREFIX!r}"
        )


def check_segment_name(name: str, lease_id: str) -> None:
    """ValueError unless `name` is the segment name of lease `lease_id` (any exporter pid)."""
    check_lease_id(lease_id)
    m = _LEASE_SEGMENT.fullmatch(name)
    if m is None or m.group(2) != lease_id:
        raise ValueError(
            f"shared-memory segment name {name[:160]!r} is not the segment of lease "
            f"{lease_id!r}: expected {SEGMENT_PREFIX}<pid>-{lease_id}"
        )


def segment_pid(name: str) -> int:
    """The exporter pid in a lease's segment name (checked by `check_segment_name`)."""
    m = _LEASE_SEGMENT.fullmatch(name)
    if m is None:
        raise ValueError(f"{name[:160]!r} is not a segment name")
    return int(m.group(1))


def lease_segment_path(shm_dir: Path, name: str, lease_id: str) -> Path:
    """The path of lease `lease_id`'s segment `name` in `shm_dir`; ValueError if the name
    breaks the rule or the path leaves `shm_dir` (a symbolic link planted there)."""
    check_segment_name(name, lease_id)
    path = shm_dir / name
    if path.resolve().parent != shm_dir.resolve():
        raise ValueError(f"segment {name!r} resolves outside {shm_dir}")
    return path


@dataclass(frozen=True)
class SegmentLayout:
    """Byte offsets of a segment holding `num_chunks` headers of `header_len` bytes."""

    num_chunks: int
    table_len: int
    payload_offset: int
    payload_len: int

    @classmethod
    def plan(cls, header_len: int, num_chunks: int, payload_len: int) -> SegmentLayout:
        table_len = header_len * num_chunks
        payload_offset = -(-(SEGMENT_HEADER_BYTES + table_len) // PAGE) * PAGE
        return cls(num_chunks, table_len, payload_offset, payload_len)

    @property
    def total_len(self) -> int:
        return self.payload_offset + self.payload_len

    def pack(self, lease_id: str, flags: int = 0) -> bytes:
        lid = lease_id.encode()
        if len(lid) > MAX_LEASE_ID_BYTES:
            raise ValueError(f"lease id is {len(lid)} bytes, at most {MAX_LEASE_ID_BYTES}")
        fixed = _SEGMENT.pack(
            SEGMENT_MAGIC,
            SEGMENT_VERSION,
            flags,
            self.num_chunks,
            self.table_len,
            self.payload_offset,
            self.payload_len,
            self.total_len,
            len(lid),
        )
        return (fixed + lid).ljust(SEGMENT_HEADER_BYTES, b"\0")


@dataclass
class SegmentView:
    """A parsed segment: its lease, each chunk's header (parsed and raw) and payload bytes."""

    layout: SegmentLayout
    lease_id: str
    headers: list[tuple[ChunkHeader, memoryview]]
    payload: memoryview
    header_bytes: bytes  # a copy of the segment header as parsed (see `unchanged`)
    _buf: memoryview
    flags: int = 0

    @property
    def in_place(self) -> bool:
        """An in-place descriptor: the payload is a `CacheRef`, not the KV."""
        return bool(self.flags & FLAG_IN_PLACE)

    def cache_ref(self) -> CacheRef:
        if not self.in_place:
            raise KVTransferError("not an in-place descriptor: no cache reference")
        return CacheRef.unpack(self.payload)

    def chunk_payload(self, h: ChunkHeader) -> memoryview:
        return self.payload[payload_range(h)]

    def unchanged(self) -> bool:
        """False when the segment was rewritten (reused) since it was parsed."""
        return bytes(self._buf[:SEGMENT_HEADER_BYTES]) == self.header_bytes


def is_in_place(head: bytes) -> bool:
    """Whether the first SEGMENT_HEADER_BYTES of a file are an in-place descriptor's."""
    if len(head) < _SEGMENT.size:
        return False
    magic, version, flags = _SEGMENT.unpack_from(head)[:3]
    return magic == SEGMENT_MAGIC and version == SEGMENT_VERSION and bool(flags & FLAG_IN_PLACE)


def parse_segment(buf: memoryview) -> SegmentView:
    """Parse a segment; KVTransferError when it is malformed, truncated or being written."""
    if len(buf) < SEGMENT_HEADER_BYTES:
        raise KVTransferError(f"KV segment truncated: {len(buf)} bytes")
    header_bytes = bytes(buf[:SEGMENT_HEADER_BYTES])
    magic, version, flags, num_chunks, table_len, payload_offset, payload_len, total, lid_len = (
        _SEGMENT.unpack_from(header_bytes)
    )
    if magic != SEGMENT_MAGIC or version != SEGMENT_VERSION:
        raise KVTransferError(f"not a complete KV segment (magic {magic!r}, version {version})")
    if total > len(buf) or payload_offset + payload_len != total or lid_len > MAX_LEASE_ID_BYTES:
        raise KVTransferError(f"KV segment is {len(buf)} bytes, its header says {total}")
    lease_id = header_bytes[_SEGMENT.size : _SEGMENT.size + lid_len].decode(errors="replace")
    layout = SegmentLayout(num_chunks, table_len, payload_offset, payload_len)
    headers, pos = [], SEGMENT_HEADER_BYTES
    for _ in range(num_chunks):
        n = header_length(buf[pos:])
        raw = buf[pos : pos + n]
        headers.append((decode_header(raw), raw))
        pos += n
    if pos != SEGMENT_HEADER_BYTES + table_len:
        raise KVTransferError("KV segment's chunk table does not match its length")
    view = SegmentView(layout, lease_id, headers, buf[payload_offset:total], header_bytes, buf)
    view.flags = flags
    return view


# The cache reference of an in-place descriptor: where block 0 starts in the cache file,
# the cache's block count, one block's bytes, the file name's length; then the name.
_CACHE_REF = struct.Struct("<QQQH")
# A KV cache file (common/core/kv_cache.py's name, defined in common/shm.py): group 1
# the pid of the process that made it.
CACHE_FILE_NAME = KV_CACHE_FILE


@dataclass(frozen=True)
class CacheRef:
    """Where an in-place lease's blocks are: block b is bytes [offset + b * block_bytes,
    + block_bytes) of cache file `name` (in the exporter's shm dir)."""

    name: str
    offset: int
    num_blocks: int
    block_bytes: int

    def pack(self) -> bytes:
        name = self.name.encode()
        return _CACHE_REF.pack(self.offset, self.num_blocks, self.block_bytes, len(name)) + name

    @classmethod
    def unpack(cls, buf: bytes | memoryview) -> CacheRef:
        if len(buf) < _CACHE_REF.size:
            raise KVTransferError(f"in-place descriptor's cache reference truncated: {len(buf)}")
        offset, num_blocks, block_bytes, name_len = _CACHE_REF.unpack_from(buf)
        raw = bytes(buf[_CACHE_REF.size : _CACHE_REF.size + name_len])
        name = raw.decode(errors="replace")
        if len(raw) != name_len or CACHE_FILE_NAME.fullmatch(name) is None:
            raise KVTransferError(f"in-place descriptor names no KV cache file: {name[:80]!r}")
        return cls(name, offset, num_blocks, block_bytes)

    @property
    def pid(self) -> int:
        return int(CACHE_FILE_NAME.fullmatch(self.name).group(1))

    def end(self) -> int:
        """The file length the blocks need."""
        return self.offset + self.num_blocks * self.block_bytes


def pack_descriptor(lease_id: str, first_header: bytes, ref: CacheRef) -> bytes:
    """An in-place descriptor (see the module docstring): segment header with
    FLAG_IN_PLACE, the transfer's first chunk header, the cache reference."""
    payload = ref.pack()
    layout = SegmentLayout.plan(len(first_header), 1, len(payload))
    out = bytearray(layout.total_len)
    out[:SEGMENT_HEADER_BYTES] = layout.pack(lease_id, FLAG_IN_PLACE)
    out[SEGMENT_HEADER_BYTES : SEGMENT_HEADER_BYTES + len(first_header)] = first_header
    out[layout.payload_offset :] = payload
    return bytes(out)


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


@dataclass
class _Mapped:
    mapping: mmap.mmap
    fd: int  # kept open: fstat tells when the exporter has unlinked the file
    size: int


class MappingCache:
    """Read-only mappings of exporters' segment files, kept across pulls.

    An exporter reuses its segment files (its pool renames the same file from lease
    to lease), and mapping one costs a puller what copying a third of it does here:
    MAP_POPULATE sets up every page table entry (7-8 ms for 45 MiB on a 2-core
    Skylake-SP Xeon, plus 2-3 ms of munmap afterwards, in a 40 ms pull; NOTES.md). So a
    mapping is kept and found again by the file's identity, (st_dev, st_ino), whatever its
    name: while a mapping is held the inode cannot be freed, so no other file can
    come to have that identity. What it maps is never trusted for that: every pull
    parses the segment, checks the lease it holds and the checksums, and compares
    the segment header after copying (SegmentView.unchanged), as with a fresh map.

    Held mappings keep the exporter's memory alive after it unlinks a file, so they
    are bounded: a mapping whose file has no name left is dropped at the next `open`,
    the least recently used go beyond `max_bytes`, and `close` drops all. The whole
    file is mapped (a pooled file may serve larger segments later).

    populate=False maps without MAP_POPULATE, for exporters' KV cache files (in-place
    leases): a cache is as large as its worker's pool (1 GiB by default, tens of GiB on
    a big host) and a pull reads a few MiB of it, while populating every page table
    entry up front cost 0.8 s per GiB here (3.3 s for 4 GiB, 2-core Skylake-SP Xeon,
    2026-12-02), all of it inside the first pull of each decode worker from each
    prefill worker. Lazily mapped, a pull faults in only the pages it touches, once.
    """

    def __init__(self, max_bytes: int = 256 << 20, *, populate: bool = True) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._flags = mmap.MAP_SHARED | (_POPULATE if populate else 0)
        self._maps: dict[tuple[int, int], _Mapped] = {}  # insertion order = LRU order
        self._lock = threading.Lock()
        self.maps_total = 0  # mmap calls (cache misses)

    def open(self, path: Path) -> mmap.mmap:
        """A read-only mapping of segment file `path` (FileNotFoundError if it is gone)."""
        fd = os.open(path, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            key = (st.st_dev, st.st_ino)
            with self._lock:
                self._prune()
                entry = self._maps.pop(key, None)
                if entry is not None and entry.size == st.st_size:
                    self._maps[key] = entry  # most recently used
                    return entry.mapping
                if entry is not None:
                    os.close(entry.fd)
            if st.st_size < SEGMENT_HEADER_BYTES:
                raise KVTransferError(f"KV segment {path} is truncated ({st.st_size} bytes)")
            mapping = mmap.mmap(fd, st.st_size, flags=self._flags, prot=mmap.PROT_READ)
            with self._lock:
                self.maps_total += 1
                if st.st_size > self.max_bytes:  # too large to keep: a one-off mapping
                    return mapping
                self._maps[key] = _Mapped(mapping, fd, st.st_size)
                fd = -1  # kept
                self._evict()
            return mapping
        finally:
            if fd >= 0:
                os.close(fd)

    def _prune(self) -> None:
        """Drop mappings of files the exporter has unlinked (lock held)."""
        for key, entry in list(self._maps.items()):
            try:
                gone = os.fstat(entry.fd).st_nlink == 0
            except OSError:
                gone = True
            if gone:
                self._drop(key)

    def _evict(self) -> None:
        while sum(e.size for e in self._maps.values()) > self.max_bytes:
            self._drop(next(iter(self._maps)))

    def _drop(self, key: tuple[int, int]) -> None:
        # The mapping itself is not closed: tensors of a pull in progress may view it;
        # it is unmapped when the last of them is gone.
        entry = self._maps.pop(key)
        os.close(entry.fd)

    @property
    def mapped_bytes(self) -> int:
        with self._lock:
            return sum(e.size for e in self._maps.values())

    def close(self) -> None:
        with self._lock:
            for key in list(self._maps):
                self._drop(key)


def list_segments(shm_dir: Path = SHM_DIR) -> list[str]:
    """Names of every pagedserve KV segment in `shm_dir` (complete or being written)."""
    try:
        return sorted(p.name for p in shm_dir.iterdir() if _NAME.match(p.name))
    except FileNotFoundError:
        return []


def remove_stale_segments(shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink segments (and in-place descriptors) whose exporter process is gone;
    returns their names."""
    return remove_stale(shm_dir, _NAME)
