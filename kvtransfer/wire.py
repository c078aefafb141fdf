"""The KV wire format: chunks of raw tensor bytes, each behind a fixed binary header.

A *transfer* moves the K and V of `n` blocks over a layer range, laid out exactly as
`KVCache.read_blocks` returns them (the cache is block-major, see common/core/kv_cache.py):

    blocks: [n, L, 2, block_size, num_kv_heads, head_dim]     L = layer_end - layer_start

The transfer is cut into *units*, one block of one layer's K or V, numbered in that
layout's order (block-major, then layer, then K/V):

    unit u  ->  block position = u // (2 * L)
                row = u % (2 * L)     (row = 2 * (layer - layer_start) + kv, kv 0=K 1=V)
    one unit = [block_size, num_kv_heads, head_dim] elements, contiguous

so one block's units over the transfer's layers are consecutive, and consecutive in a
block-major cache too: a sink copies a whole block (all layers) with one memcpy. (Wire
version 1 numbered units layer-major, `row = u // n`; a version-1 chunk is refused
with KVTransferError, never read in the wrong order.)

Units are grouped into *chunks* of consecutive units, at most `max_chunk_bytes` of payload
each (1 MiB by default: well under gRPC's 4 MiB message limit, and large enough that
per-message costs do not dominate). Chunks hold whole units so that a receiver can
place every chunk into its own cache as it arrives, without staging the transfer. A
chunk may start or end inside a block (a block of the default model is 360 KiB in
bf16, 60 units of 6 KiB).

One chunk on the wire is `header || payload`:

    fixed part (64 bytes, little-endian, `_FIXED`):
        magic "PSKV", version, dtype code, checksum kind, header length, num_layers (of the
        model), layer_start, layer_end, num_kv_heads, head_dim, request id length,
        block_size, num_blocks, num_tokens, chunk_index, chunk_count, unit_start,
        unit_count, payload length, checksum
    variable part: request id (UTF-8), then num_blocks block ids (uint32 each)
    payload: unit_count units, raw little-endian bytes of the dtype (bf16 as its
        16-bit pattern: numpy has no bfloat16, so bytes are handled as uint8)

The checksum covers the header with its checksum field left out, then the payload, so
a flipped bit in a block id is caught as surely as one in the data. Two kinds, named
in the header so a receiver verifies whatever the sender chose:

    xxh3   XXH3-64 (the `xxhash` package): ~50 GB/s here, RocksDB's default block
           checksum; the sender's default when `xxhash` is installed
    crc32  CRC-32 (zlib): ~4 GB/s, always available; the fallback

At 4 GB/s, CRC-32 on both ends cost more than moving the bytes through shared memory
(a copy runs at ~6 GB/s), which is why the fast kind exists. A mismatch raises
`KVChecksumError`; anything malformed, inconsistent or missing (a truncated stream)
raises `KVTransferError`. Never pickle.

Every chunk repeats the block ids: 4 bytes per block, under 0.1% of a 1 MiB chunk for
a 2048-token prompt, and it makes each chunk self-describing.

Size: over the ~500-line mark on purpose. The format is read in one place: the
header layout, the encoder, the decoder and every validation of an incoming chunk
(the decoder is the trust boundary for bytes from another machine), so a change to
the format cannot miss one of its readers.
"""

from __future__ import annotations

import bisect
import os
import struct
import threading
import warnings
import zlib
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

MAGIC = b"PSKV"
VERSION = 2  # 2: block-major unit order (1 was layer-major)
DEFAULT_MAX_CHUNK_BYTES = 1 << 20
# Largest chunk either side accepts: the gRPC channels are configured for it.
MAX_CHUNK_BYTES_LIMIT = 16 << 20


class _Fixed(NamedTuple):
    """The fixed part of a chunk header, field by field (little-endian, 64 bytes)."""

    magic: bytes  # 4s  b"PSKV"
    version: int  # H
    dtype_code: int  # B   DTYPE_CODES
    checksum_kind: int  # B   CHECKSUM_KINDS
    header_len: int  # I   fixed + request id + block ids
    num_layers: int  # H   of the model
    layer_start: int  # H
    layer_end: int  # H   exclusive
    num_kv_heads: int  # H
    head_dim: int  # H
    request_id_len: int  # H
    block_size: int  # I
    num_blocks: int  # I
    num_tokens: int  # I
    chunk_index: int  # I
    chunk_count: int  # I
    unit_start: int  # I
    unit_count: int  # I
    payload_len: int  # I
    checksum: int  # Q   last, so "the header minus its checksum" is two slices


_FIXED = struct.Struct("<4sHBBIHHHHHHIIIIIIIIQ")
_CHECKSUM_OFFSET = _FIXED.size - 8
assert _FIXED.size == 64

CHECKSUM_KINDS = {"crc32": 0, "xxh3": 1}  # name -> code in the header's kind byte
_KIND_NAMES = {code: name for name, code in CHECKSUM_KINDS.items()}
try:
    import xxhash
except ImportError:  # pragma: no cover - depends on the environment
    xxhash = None
DEFAULT_CHECKSUM = "xxh3" if xxhash is not None else "crc32"

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float8_e4m3fn: 4,
    torch.float8_e5m2: 5,
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


class KVTransferError(Exception):
    """A transfer failed: malformed or inconsistent chunk, truncated stream, lost peer.

    `cause` names the kind of failure for metrics (kvtransfer/stats.py): a subclass
    sets its own, a gRPC failure its status ("timeout", "unavailable", ...)."""

    cause: str = "transfer"


class KVChecksumError(KVTransferError):
    """A chunk's payload or header does not match its checksum (corrupted in transit)."""

    cause = "checksum"


class LeaseNotFoundError(KVTransferError):
    """The lease is unknown, released or expired (gRPC NOT_FOUND)."""

    cause = "lease_not_found"


class TransferMismatchError(KVTransferError, ValueError):
    """A well-formed transfer that does not fit the destination (shape, dtype, block
    count): the sink's refusal, raised by `ChunkAssembler` as the module's own error
    (and still a ValueError, as sinks raise it)."""

    cause = "invalid"


class TransferCancelled(KVTransferError):
    """The puller stopped the transfer: the request it was for ended (cancel, deadline)."""

    cause = "cancelled"


@dataclass(frozen=True)
class ChunkHeader:
    """The header of one chunk; see the module docstring for the layout."""

    request_id: str
    dtype: torch.dtype
    num_layers: int  # layers of the model (the exporter's cache)
    layer_start: int
    layer_end: int  # exclusive
    block_size: int
    num_kv_heads: int
    head_dim: int
    block_ids: tuple[int, ...]  # the exporter's block ids, in transfer order
    num_tokens: int  # prompt tokens the exported blocks hold
    chunk_index: int
    chunk_count: int
    unit_start: int
    unit_count: int
    payload_len: int
    checksum_kind: int = CHECKSUM_KINDS[DEFAULT_CHECKSUM]  # see CHECKSUM_KINDS
    checksum: int = 0

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def unit_shape(self) -> tuple[int, int, int]:
        return (self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def unit_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def num_units(self) -> int:
        return (self.layer_end - self.layer_start) * 2 * self.num_blocks

    @property
    def transfer_shape(self) -> tuple[int, ...]:
        """[n, L, 2, block_size, num_kv_heads, head_dim] of the whole transfer."""
        return (self.num_blocks, self.layer_end - self.layer_start, 2, *self.unit_shape)

    @property
    def units_per_block(self) -> int:
        """2 * L: the units of one block over the transfer's layers (consecutive)."""
        return 2 * (self.layer_end - self.layer_start)

    def same_transfer(self, other: ChunkHeader) -> bool:
        """True when both headers describe chunks of one transfer."""
        keys = ("request_id", "dtype", "num_layers", "layer_start", "layer_end")
        keys += ("block_size", "num_kv_heads", "head_dim", "block_ids", "num_tokens")
        keys += ("chunk_count",)
        return all(getattr(self, k) == getattr(other, k) for k in keys)


def dtype_code(dtype: torch.dtype) -> int:
    """The wire code of a dtype; ValueError for one the format does not carry."""
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        names = ", ".join(str(d) for d in DTYPE_CODES)
        raise ValueError(f"dtype {dtype} cannot travel: supported are {names}") from None


def encode_header(h: ChunkHeader) -> bytes:
    """Pack a header; its checksum field is written as given (see `seal`)."""
    return _pack_fixed(h, _variable_part(h))


def encode_headers(headers: Sequence[ChunkHeader]) -> list[bytes]:
    """`encode_header` of each header of one transfer (same request id and block ids,
    as `chunk_headers` makes them): the variable part is checked and packed once, not
    per chunk (128 block ids checked and packed 45 times cost ~6% of an export)."""
    if not headers:
        return []
    tail = _variable_part(headers[0])
    first = headers[0]
    if any(h.block_ids != first.block_ids or h.request_id != first.request_id for h in headers):
        raise ValueError("encode_headers: headers of more than one transfer")
    return [_pack_fixed(h, tail) for h in headers]


def _variable_part(h: ChunkHeader) -> bytes:
    rid = h.request_id.encode()
    if len(rid) > 0xFFFF:
        raise ValueError(f"request id is {len(rid)} bytes, at most 65535 fit the header")
    if any(not 0 <= b <= 0xFFFFFFFF for b in h.block_ids):
        raise ValueError(f"block ids must fit uint32, got {list(h.block_ids)}")
    return rid + struct.pack(f"<{h.num_blocks}I", *h.block_ids)


def _pack_fixed(h: ChunkHeader, tail: bytes) -> bytes:
    rid_len = len(tail) - 4 * h.num_blocks
    fixed = _Fixed(
        MAGIC, VERSION, dtype_code(h.dtype), h.checksum_kind,
        _FIXED.size + len(tail), h.num_layers, h.layer_start, h.layer_end,
        h.num_kv_heads, h.head_dim, rid_len, h.block_size, h.num_blocks, h.num_tokens,
        h.chunk_index, h.chunk_count, h.unit_start, h.unit_count, h.payload_len, h.checksum,
    )  # fmt: skip
    return _FIXED.pack(*fixed) + tail


def decode_header(buf: bytes | memoryview) -> ChunkHeader:
    """Parse and validate a header (the first bytes of `buf`); KVTransferError if bad."""
    mv = memoryview(buf)
    if len(mv) < _FIXED.size:
        raise KVTransferError(f"chunk header truncated: {len(mv)} bytes, need {_FIXED.size}")
    f = _Fixed._make(_FIXED.unpack_from(mv))
    if f.magic != MAGIC:
        raise KVTransferError(f"not a KV chunk: magic {bytes(f.magic)!r}, expected {MAGIC!r}")
    if f.version != VERSION:
        raise KVTransferError(
            f"KV wire version {f.version} not supported (this is {VERSION}: block-major "
            "units; version 1 was layer-major): exporter and puller must run the same release"
        )
    if f.dtype_code not in CODE_DTYPES:
        raise KVTransferError(f"unknown dtype code {f.dtype_code} in chunk header")
    if f.checksum_kind not in _KIND_NAMES:
        raise KVTransferError(f"unknown checksum kind {f.checksum_kind} in chunk header")
    ids_at = _FIXED.size + f.request_id_len
    if f.header_len != ids_at + 4 * f.num_blocks or len(mv) < f.header_len:
        raise KVTransferError(
            f"chunk header length {f.header_len} inconsistent with {f.request_id_len}-byte "
            f"request id, {f.num_blocks} block ids and {len(mv)} bytes available"
        )
    try:
        request_id = bytes(mv[_FIXED.size : ids_at]).decode()
    except UnicodeDecodeError:
        raise KVTransferError("request id in chunk header is not UTF-8") from None
    block_ids = struct.unpack_from(f"<{f.num_blocks}I", mv, ids_at)
    h = ChunkHeader(
        request_id, CODE_DTYPES[f.dtype_code], f.num_layers, f.layer_start, f.layer_end,
        f.block_size, f.num_kv_heads, f.head_dim, block_ids, f.num_tokens, f.chunk_index, f.chunk_count, f.unit_start, f.unit_count, f.payload_len,
        f.checksum_kind, f.checksum,
    )  # fmt: skip
    _validate(h)
    return h


def header_length(buf: bytes | memoryview) -> int:
    """The total header length recorded in a header's fixed part."""
    if len(buf) < _FIXED.size:
        raise KVTransferError(f"chunk header truncated: {len(buf)} bytes, need {_FIXED.size}")
    return struct.unpack_from("<I", buf, 8)[0]


# Byte ranges of a header that every chunk of one transfer shares (all but chunk_index,
# unit_start, unit_count, payload_len and the checksum): see `decode_sibling_header`.
_SHARED_SPANS = ((0, 36), (40, 44), (_FIXED.size, None))
# chunk_index, (chunk_count skipped), unit_start, unit_count, payload_len: bytes 36-56
_PER_CHUNK = struct.Struct("<I4xIII")


def decode_sibling_header(
    first: ChunkHeader, first_raw: bytes, buf: bytes | memoryview
) -> ChunkHeader | None:
    """`decode_header(buf)` for a chunk whose header repeats `first_raw` (the raw header
    of an accepted chunk `first` of the same transfer) outside its per-chunk fields, or
    None when it does not (the caller then decodes it in full, with its errors).

    Why: a gRPC pull decodes one header per 1 MiB message, and the full decode (struct,
    a named tuple, UTF-8, 128 block ids) plus `same_transfer` (11 field comparisons)
    cost ~30 us of Python each (2026-12-02, NOTES.md). As strict as the full path:
    the shared bytes are byte-equal to a header that passed `decode_header`, so magic,
    version, dtype, checksum kind, header length, request id and block ids are valid and
    `same_transfer(first)` holds; the per-chunk fields go through the same `_validate`.
    """
    mv = memoryview(buf)
    if len(mv) != len(first_raw):
        return None
    for a, b in _SHARED_SPANS:
        if mv[a:b] != first_raw[a:b]:
            return None
    index, unit_start, unit_count, payload_len = _PER_CHUNK.unpack_from(mv, 36)
    (value,) = struct.unpack_from("<Q", mv, _CHECKSUM_OFFSET)
    h = _replace(
        first,
        chunk_index=index,
        unit_start=unit_start,
        unit_count=unit_count,
        payload_len=payload_len,
        checksum=value,
    )
    _validate(h)
    return h


def _validate(h: ChunkHeader) -> None:
    if not 0 <= h.layer_start < h.layer_end <= h.num_layers:
        raise KVTransferError(
            f"layer range [{h.layer_start}, {h.layer_end}) outside the model's {h.num_layers}"
        )
    if min(h.block_size, h.num_kv_heads, h.head_dim, h.num_blocks) <= 0:
        raise KVTransferError(f"empty block shape in chunk header: {h.transfer_shape}")
    if not 0 <= h.chunk_index < h.chunk_count:
        raise KVTransferError(f"chunk index {h.chunk_index} not in [0, {h.chunk_count})")
    if h.unit_count <= 0 or h.unit_start + h.unit_count > h.num_units:
        raise KVTransferError(
            f"chunk units [{h.unit_start}, {h.unit_start + h.unit_count}) outside the "
            f"transfer's {h.num_units}"
        )
    if h.payload_len != h.unit_count * h.unit_bytes:
        raise KVTransferError(
            f"payload length {h.payload_len} != {h.unit_count} units x {h.unit_bytes} bytes"
        )


def checksum(header_bytes: bytes | memoryview, payload: bytes | memoryview) -> int:
    """The header's kind of checksum over the header minus its checksum field, then the payload."""
    return checksum_parts(header_bytes, (payload,))


def checksum_parts(header_bytes: bytes | memoryview, payload_parts: Sequence) -> int:
    """`checksum` of a payload given as consecutive parts (any C-contiguous buffers),
    e.g. a chunk's runs of cache rows, checksummed where they lie (no joined copy)."""
    mv = memoryview(header_bytes)
    parts = (mv[:_CHECKSUM_OFFSET], mv[_FIXED.size : header_length(mv)], *payload_parts)
    kind = mv[7]
    if kind == CHECKSUM_KINDS["crc32"]:
        crc = 0
        for part in parts:
            crc = zlib.crc32(part, crc)
        return crc
    if kind != CHECKSUM_KINDS["xxh3"]:
        raise KVTransferError(f"unknown checksum kind {kind} in chunk header")
    if xxhash is None:
        raise KVTransferError("chunk is checksummed with XXH3-64: install the xxhash package")
    h = xxhash.xxh3_64()
    for part in parts:
        h.update(part)
    return h.intdigest()


def slow_checksum(kind: int) -> bool:
    """True for kinds worth moving off the copying thread (CRC-32 runs at ~4 GB/s)."""
    return kind == CHECKSUM_KINDS["crc32"]


def checksum_kind(name: str | None) -> int:
    """The header code of a checksum kind name (None = DEFAULT_CHECKSUM)."""
    name = name or DEFAULT_CHECKSUM
    if name not in CHECKSUM_KINDS:
        raise ValueError(f"checksum {name!r} not one of {sorted(CHECKSUM_KINDS)}")
    if name == "xxh3" and xxhash is None:
        raise ValueError("checksum 'xxh3' needs the xxhash package")
    return CHECKSUM_KINDS[name]


def seal(header_bytes: bytes, payload: bytes | memoryview) -> tuple[bytes, int]:
    """The header with its checksum field filled in for `payload`, and that checksum."""
    return seal_parts(header_bytes, (payload,))


def seal_parts(header_bytes: bytes, payload_parts: Sequence) -> tuple[bytes, int]:
    """`seal` for a payload given as consecutive parts (see `checksum_parts`)."""
    value = checksum_parts(header_bytes, payload_parts)
    sealed = (
        header_bytes[:_CHECKSUM_OFFSET] + struct.pack("<Q", value) + header_bytes[_FIXED.size :]
    )
    return sealed, value


def verify(header: ChunkHeader, header_bytes: bytes | memoryview, payload: memoryview) -> None:
    """Raise KVChecksumError unless `payload` and the header match the header's checksum."""
    if len(payload) != header.payload_len:
        raise KVTransferError(
            f"chunk {header.chunk_index}: payload is {len(payload)} bytes, header says "
            f"{header.payload_len}"
        )
    actual = checksum(header_bytes, payload)
    if actual != header.checksum:
        raise KVChecksumError(
            f"chunk {header.chunk_index}/{header.chunk_count} of request "
            f"{header.request_id!r}: {_KIND_NAMES[header.checksum_kind]} {actual:#018x} != "
            f"{header.checksum:#018x}"
        )


def plan_chunks(num_units: int, unit_bytes: int, max_chunk_bytes: int) -> list[tuple[int, int]]:
    """Cut `num_units` units into (unit_start, unit_count) chunks of <= max_chunk_bytes.

    Every chunk but the last holds the same number of units (as many as fit).
    """
    if not 0 < max_chunk_bytes <= MAX_CHUNK_BYTES_LIMIT:
        raise ValueError(
            f"max_chunk_bytes must be in (0, {MAX_CHUNK_BYTES_LIMIT}], got {max_chunk_bytes}"
        )
    if unit_bytes > max_chunk_bytes:
        raise ValueError(
            f"one block of one layer's K or V is {unit_bytes} bytes, more than "
            f"max_chunk_bytes={max_chunk_bytes}: raise the chunk size"
        )
    per_chunk = max_chunk_bytes // unit_bytes
    return [(s, min(per_chunk, num_units - s)) for s in range(0, num_units, per_chunk)]


def byte_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, as a flat memoryview (no copy)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    return memoryview(t.view(-1).view(torch.uint8).numpy()).cast("B")


def tensor_view(buf: bytes | memoryview, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """A tensor over `buf`'s bytes (no copy); the caller keeps `buf` alive and unmodified.

    Read-only buffers (bytes from gRPC, a read-only mapping) are fine as long as the
    tensor is only read: torch warns about them, so the warning is silenced here.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(buf, dtype=torch.uint8)
    return flat.view(dtype).view(*shape)


@dataclass
class Chunk:
    """One encoded chunk: sealed header bytes, its parsed form, and the payload."""

    header: ChunkHeader
    header_bytes: bytes
    payload: memoryview


def encode_chunks(
    blocks: torch.Tensor,  # [n, L, 2, block_size, num_kv_heads, head_dim]
    *,
    block_ids: Sequence[int],
    num_tokens: int,
    request_id: str = "",
    layer_start: int = 0,
    num_layers: int | None = None,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    checksum: str | None = None,
) -> Iterator[Chunk]:
    """Cut a block set into sealed chunks; payloads are views into `blocks` (no copy).

    `blocks` must be a contiguous CPU tensor and stay unmodified while the chunks are
    in use. `num_layers` is the model's layer count (default: layer_start + L).
    Arguments are checked here, before the first chunk is asked for.
    """
    if blocks.ndim != 6 or blocks.shape[2] != 2:
        raise ValueError(
            f"blocks must be [n, L, 2, block_size, kv_heads, head_dim], got {tuple(blocks.shape)}"
        )
    n, L, _, bs, kvh, hd = blocks.shape
    if len(block_ids) != n:
        raise ValueError(f"{len(block_ids)} block ids for {n} blocks")
    headers = chunk_headers(
        request_id=request_id,
        dtype=blocks.dtype,
        num_layers=num_layers if num_layers is not None else layer_start + L,
        layer_start=layer_start,
        layer_end=layer_start + L,
        block_size=bs,
        num_kv_heads=kvh,
        head_dim=hd,
        block_ids=block_ids,
        num_tokens=num_tokens,
        max_chunk_bytes=max_chunk_bytes,
        checksum=checksum,
    )
    return _sealed_chunks(headers, byte_view(blocks))


def chunk_headers(
    *,
    request_id: str,
    dtype: torch.dtype,
    num_layers: int,
    layer_start: int,
    layer_end: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    block_ids: Sequence[int],
    num_tokens: int,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    checksum: str | None = None,
) -> list[ChunkHeader]:
    """The (unsealed, checksum 0) headers of every chunk of a transfer; ValueError if invalid."""
    template = ChunkHeader(
        request_id=request_id,
        dtype=dtype,
        num_layers=num_layers,
        layer_start=layer_start,
        layer_end=layer_end,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_ids=tuple(int(b) for b in block_ids),
        num_tokens=num_tokens,
        chunk_index=0,
        chunk_count=0,
        unit_start=0,
        unit_count=0,
        payload_len=0,
        checksum_kind=checksum_kind(checksum),
    )
    _validate_template(template)
    plan = plan_chunks(template.num_units, template.unit_bytes, max_chunk_bytes)
    return [
        _replace(
            template,
            chunk_index=i,
            chunk_count=len(plan),
            unit_start=start,
            unit_count=count,
            payload_len=count * template.unit_bytes,
        )
        for i, (start, count) in enumerate(plan)
    ]


def payload_range(h: ChunkHeader) -> slice:
    """Where chunk `h`'s payload sits in the transfer's contiguous bytes."""
    return slice(h.unit_start * h.unit_bytes, h.unit_start * h.unit_bytes + h.payload_len)


def _sealed_chunks(headers: list[ChunkHeader], data: memoryview) -> Iterator[Chunk]:
    for h, raw in zip(headers, encode_headers(headers), strict=True):
        payload = data[payload_range(h)]
        sealed, crc = seal(raw, payload)
        yield Chunk(_replace(h, checksum=crc), sealed, payload)


def _validate_template(h: ChunkHeader) -> None:
    if h.num_blocks == 0:
        raise ValueError("a transfer needs at least one block")
    if not 0 <= h.layer_start < h.layer_end <= h.num_layers:
        raise ValueError(
            f"layer range [{h.layer_start}, {h.layer_end}) outside {h.num_layers} layers"
        )
    if h.num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {h.num_tokens}")
    dtype_code(h.dtype)


def _replace(h: ChunkHeader, **changes: object) -> ChunkHeader:
    return ChunkHeader(**{**h.__dict__, **changes})


class KVSink(Protocol):
    """Where received units go. `bind` sees the first header and may refuse it."""

    def bind(self, header: ChunkHeader) -> None:
        """Check the transfer fits (shape, dtype); raise ValueError naming what differs."""
        ...

    def write_units(self, unit_start: int, data: torch.Tensor) -> None:
        """Store units [unit_start, unit_start + k); data: [k, block_size, kvh, head_dim].

        `data` may view a receive buffer: copy it, do not keep it.
        """
        ...

    # Optional: `write_unit_bytes(unit_start, count, buf)`, the same units as raw bytes
    # (a memoryview of `count` units in the bound transfer's dtype and unit shape). When
    # a sink has it, ChunkAssembler calls it instead of `write_units` for chunks given as
    # bytes (gRPC), sparing a tensor view per chunk. Not part of the Protocol, so
    # wrappers that only forward `write_units` keep working.


class ChunkAssembler:
    """Receives one transfer's chunks in any order and writes each into a sink.

    Checks that all chunks belong to the same transfer (and to the one the puller
    `expect`s) and every chunk's checksum; `finish()` raises if a checksum failed or a
    chunk is missing, which is how a stream cut short is detected.

    With `overlap`, checksums run on a helper thread while the caller copies the next
    chunk (zlib releases the GIL, torch copies too): a pull costs about max(copy,
    checksum) instead of their sum. The price: a corrupted chunk may already be in the
    sink when the error is raised, so a failed pull's destination blocks are garbage
    (they are anyway, half-written). Without it, each chunk is verified before it is
    written. The default (None) overlaps only slow checksums (CRC-32): XXH3 costs
    less than handing the work to another thread.
    """

    MAX_PENDING = 8  # chunks whose checksum may still be running (bounds held buffers)

    def __init__(
        self, sink: KVSink, expect: TransferSpec | None = None, *, overlap: bool | None = None
    ) -> None:
        self.sink = sink
        self.expect = expect
        self.overlap = overlap
        self.first: ChunkHeader | None = None
        self.seen: set[int] = set()
        self._units: list[tuple[int, int]] = []  # unit ranges received, sorted
        self.units_written = 0
        self.payload_bytes = 0
        self._pending: deque[Future[None]] = deque()
        self._first_raw: bytes | None = None  # raw header of `first`, when given to add()
        # A sink that takes a chunk's raw bytes (CacheSink, TensorSink on CPU) skips the
        # per-chunk tensor view (~40 us of torch calls per chunk, NOTES.md 2026-12-02).
        self._write_bytes = getattr(sink, "write_unit_bytes", None)

    def add(self, header_bytes: bytes | memoryview, payload: bytes | memoryview) -> ChunkHeader:
        """Check one chunk (checksum possibly in the background) and hand it to the sink.

        After the first chunk, a header that repeats the first one's shared fields is
        decoded by `decode_sibling_header` (the per-chunk fields only); any other goes
        through `decode_header` and the membership check as before."""
        header = None
        if self.first is not None and self._first_raw is not None:
            header = decode_sibling_header(self.first, self._first_raw, header_bytes)
        if header is None:
            header = decode_header(header_bytes)
        first = self.first
        result = self.add_decoded(header, header_bytes, payload)
        if first is None:  # accepted as the transfer's first chunk
            self._first_raw = bytes(header_bytes)
        return result

    def add_decoded(
        self,
        header: ChunkHeader,
        header_bytes: bytes | memoryview,
        payload: bytes | memoryview,
        data: torch.Tensor | None = None,
    ) -> ChunkHeader:
        """`add` for a header the caller has decoded from `header_bytes` (decode_header,
        e.g. parse_segment), and optionally the payload as a tensor [unit_count,
        *unit_shape] over the same bytes: a shm pull views the whole segment once
        instead of making a tensor per chunk (per-chunk Python cost was ~15% of a
        45 MiB pull, NOTES.md)."""
        payload = memoryview(payload)
        if len(payload) != header.payload_len:
            raise KVTransferError(
                f"chunk {header.chunk_index}: payload is {len(payload)} bytes, header says "
                f"{header.payload_len}"
            )
        self._check_membership(header)
        overlap = self.overlap if self.overlap is not None else slow_checksum(header.checksum_kind)
        if overlap:
            self._pending.append(checksum_executor().submit(verify, header, header_bytes, payload))
            while len(self._pending) > self.MAX_PENDING:
                self._pending.popleft().result()
        else:
            verify(header, header_bytes, payload)
        if data is None and self._write_bytes is not None:
            self._write_bytes(header.unit_start, header.unit_count, payload)
        else:
            if data is None:
                data = tensor_view(payload, header.dtype, (header.unit_count, *header.unit_shape))
            elif data.shape[0] != header.unit_count:
                raise KVTransferError(
                    f"chunk {header.chunk_index}: {data.shape[0]} units given for "
                    f"{header.unit_count}"
                )
            self.sink.write_units(header.unit_start, data)
        self.seen.add(header.chunk_index)
        self.units_written += header.unit_count
        self.payload_bytes += header.payload_len
        return header

    def _check_membership(self, header: ChunkHeader) -> None:
        if self.first is None:
            if self.expect is not None:
                self.expect.check(header)
            try:
                self.sink.bind(header)
            except TransferMismatchError:
                raise
            except ValueError as e:  # the sink's refusal: this module's error, same message
                raise TransferMismatchError(str(e)) from None
            self.first = header
        elif not header.same_transfer(self.first):
            raise KVTransferError(
                f"chunk {header.chunk_index} belongs to another transfer than chunk "
                f"{self.first.chunk_index} (request {header.request_id!r})"
            )
        if header.chunk_index in self.seen:
            raise KVTransferError(f"chunk {header.chunk_index} received twice")
        self._claim_units(header)

    def _claim_units(self, header: ChunkHeader) -> None:
        """Each unit arrives once. A sender that seals its own headers could otherwise
        place two chunks on the same units and leave others unwritten (stale KV read as
        the prompt's) while the unit count in `finish` still adds up; with no overlap,
        that count proves every unit was written."""
        start, end = header.unit_start, header.unit_start + header.unit_count
        i = bisect.bisect_left(self._units, (start, end))
        before = i > 0 and self._units[i - 1][1] > start
        after = i < len(self._units) and self._units[i][0] < end
        if before or after:
            raise KVTransferError(
                f"chunk {header.chunk_index} covers units [{start}, {end}), some of which "
                "another chunk already delivered"
            )
        self._units.insert(i, (start, end))

    def wait_checksums(self) -> None:
        """Wait for the background checksums; raise the first failure."""
        error: BaseException | None = None
        while self._pending:
            try:
                self._pending.popleft().result()
            except BaseException as e:  # keep draining: no thread may outlive the buffers' use
                error = error or e
        if error is not None:
            raise error

    def finish(self) -> ChunkHeader:
        """Raise unless every chunk of the transfer arrived intact."""
        self.wait_checksums()
        if self.first is None:
            raise KVTransferError("transfer ended before its first chunk")
        total = self.first.chunk_count
        if len(self.seen) != total or self.units_written != self.first.num_units:
            missing = sorted(set(range(total)) - self.seen)
            raise KVTransferError(
                f"transfer of request {self.first.request_id!r} truncated: "
                f"{len(self.seen)} of {total} chunks arrived (missing {missing[:8]}"
                f"{'...' if len(missing) > 8 else ''})"
            )
        return self.first

    def abort(self) -> None:
        """Drop the transfer: wait for background checksums, ignore their outcome."""
        with suppress(BaseException):
            self.wait_checksums()


_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def checksum_executor() -> ThreadPoolExecutor:
    """The helper thread that computes checksums next to copies (one per process)."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedserve-kv-crc")
        return _executor


def _forget_executor() -> None:  # a forked child has no helper thread: make a new one
    global _executor
    _executor = None


os.register_at_fork(after_in_child=_forget_executor)


@dataclass(frozen=True)
class TransferSpec:
    """What a puller asked for; the first chunk must match it."""

    block_ids: tuple[int, ...]
    layer_start: int
    layer_end: int
    dtype: torch.dtype | None = None
    unit_shape: tuple[int, int, int] | None = None

    def check(self, h: ChunkHeader) -> None:
        if h.block_ids != self.block_ids:
            raise KVTransferError(
                f"sender sent blocks {list(h.block_ids)[:8]}..., asked for "
                f"{list(self.block_ids)[:8]}..."
            )
        if (h.layer_start, h.layer_end) != (self.layer_start, self.layer_end):
            raise KVTransferError(
                f"sender sent layers [{h.layer_start}, {h.layer_end}), asked for "
                f"[{self.layer_start}, {self.layer_end})"
            )
        if self.dtype is not None and h.dtype != self.dtype:
            raise KVTransferError(f"sender sent {h.dtype}, expected {self.dtype}")
        if self.unit_shape is not None and h.unit_shape != self.unit_shape:
            raise KVTransferError(
                f"sender sent blocks of {h.unit_shape}, expected {self.unit_shape}"
            )


def header_size(request_id: str, num_blocks: int) -> int:
    """Bytes of a chunk header for this request id and block count."""
    return _FIXED.size + len(request_id.encode()) + 4 * num_blocks


# --- KVChunk framing -------------------------------------------------------------------
#
# Over gRPC each chunk travels as a `pagedserve.v1.KVChunk {bytes header = 1; bytes
# payload = 2}` message. The generated message class copies a 1 MiB payload twice
# (parse, then attribute access), which halved streaming throughput here, so both ends
# frame and unframe the two fields by hand: one copy into the message on the sender,
# zero-copy views on the receiver. The bytes are a valid KVChunk; a client using the
# generated stubs reads them unchanged.

_TAG_HEADER = b"\x0a"  # field 1, wire type 2 (length-delimited)
_TAG_PAYLOAD = b"\x12"  # field 2, wire type 2


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(mv: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while pos < len(mv):
        byte = mv[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            break
    raise KVTransferError("malformed KVChunk message: bad varint")


def frame_kvchunk(header_bytes: bytes | memoryview, payload: bytes | memoryview) -> bytes:
    """Serialize a KVChunk message (one copy of the payload)."""
    return frame_kvchunk_parts(header_bytes, (payload,))


def frame_kvchunk_parts(header_bytes: bytes | memoryview, payload_parts: Sequence) -> bytes:
    """`frame_kvchunk` for a payload given as consecutive parts (C-contiguous buffers,
    e.g. numpy rows of a cache): the parts are copied once, straight into the message,
    so a chunk gathered from scattered blocks needs no contiguous buffer of its own."""
    payload_len = sum(memoryview(p).nbytes for p in payload_parts)
    return b"".join(
        (
            _TAG_HEADER,
            _varint(len(header_bytes)),
            header_bytes,
            _TAG_PAYLOAD,
            _varint(payload_len),
            *payload_parts,
        )
    )


def unframe_kvchunk(buf: bytes | memoryview) -> tuple[memoryview, memoryview]:
    """(header, payload) views into a serialized KVChunk; unknown fields are skipped.

    The layout `frame_kvchunk` writes (field 1, then field 2, nothing else) is read
    directly; anything else goes through the general field loop below (same result
    for that layout, so the fast path accepts nothing the loop would refuse)."""
    mv = memoryview(buf)
    if len(mv) > 1 and mv[0] == 0x0A:
        hlen, pos = _read_varint(mv, 1)
        hend = pos + hlen
        if hend < len(mv) and mv[hend] == 0x12:
            plen, ppos = _read_varint(mv, hend + 1)
            if ppos + plen == len(mv):
                return mv[pos:hend], mv[ppos:]
    fields: dict[int, memoryview] = {}
    pos = 0
    while pos < len(mv):
        key, pos = _read_varint(mv, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 2:
            length, pos = _read_varint(mv, pos)
            if pos + length > len(mv):
                raise KVTransferError("malformed KVChunk message: field runs past the end")
            fields[number] = mv[pos : pos + length]
            pos += length
        elif wire_type == 0:
            _, pos = _read_varint(mv, pos)
        elif wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
        else:
            raise KVTransferError(f"malformed KVChunk message: wire type {wire_type}")
    if 1 not in fields or 2 not in fields:
        raise KVTransferError("KVChunk message without header or payload")
    return fields[1], fields[2]
