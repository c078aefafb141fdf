"""The gRPC puller's per-chunk shortcuts (branch grpcpipe, NOTES 2026-12-02) accept and
refuse exactly what the general paths do: `decode_sibling_header` against
`decode_header`, `unframe_kvchunk`'s direct read against its field loop, and sinks'
`write_unit_bytes` against `write_units`."""

from __future__ import annotations

import struct
import threading

import pytest
import torch

from pagedserve.decode_worker.servicer import StopOnCancel
from pagedserve.kvtransfer.sinks import CacheSink, TensorSink
from pagedserve.kvtransfer.wire import (
    ChunkAssembler,
    KVTransferError,
    TransferCancelled,
    checksum,
    decode_header,
    decode_sibling_header,
    encode_chunks,
    frame_kvchunk,
    frame_kvchunk_parts,
    seal,
    seal_parts,
    unframe_kvchunk,
)
from pagedserve.v1 import kvtransfer_pb2

L, NB, BS, KVH, HD = 4, 12, 4, 2, 8


def make_cache(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((NB, L, 2, BS, KVH, HD), generator=g).to(torch.float16)


def chunks_of(blocks: torch.Tensor, ids, request_id="r"):
    return list(
        encode_chunks(
            blocks,
            block_ids=list(ids),
            num_tokens=len(ids) * BS,
            request_id=request_id,
            max_chunk_bytes=1024,
        )
    )


def test_sibling_header_decodes_every_chunk_like_decode_header():
    blocks = make_cache()[:3].contiguous()
    chunks = chunks_of(blocks, (5, 1, 7))
    first = decode_header(chunks[0].header_bytes)
    assert len(chunks) > 2
    for c in chunks:
        assert decode_sibling_header(first, c.header_bytes, c.header_bytes) == decode_header(
            c.header_bytes
        )
        assert decode_sibling_header(first, chunks[0].header_bytes, c.header_bytes) == (
            decode_header(c.header_bytes)
        )


@pytest.mark.parametrize(
    "offset",
    [
        6,  # dtype code
        7,  # checksum kind
        12,  # num_layers
        40,  # chunk_count
        32,  # num_tokens
        64,  # request id
        66,  # first block id
    ],
)
def test_sibling_header_refuses_any_change_outside_the_per_chunk_fields(offset):
    blocks = make_cache()[:3].contiguous()
    chunks = chunks_of(blocks, (5, 1, 7))
    first = decode_header(chunks[0].header_bytes)
    changed = bytearray(chunks[1].header_bytes)
    changed[offset] ^= 0x01
    assert decode_sibling_header(first, chunks[0].header_bytes, bytes(changed)) is None
    assert decode_sibling_header(first, chunks[0].header_bytes, bytes(changed[:-4])) is None


def test_sibling_header_validates_the_per_chunk_fields():
    blocks = make_cache()[:3].contiguous()
    chunks = chunks_of(blocks, (5, 1, 7))
    first = decode_header(chunks[0].header_bytes)
    raw = bytearray(chunks[1].header_bytes)
    struct.pack_into("<I", raw, 44, 10_000)  # unit_start past the transfer's units
    with pytest.raises(KVTransferError, match="outside the transfer's"):
        decode_sibling_header(first, chunks[0].header_bytes, bytes(raw))
    with pytest.raises(KVTransferError, match="outside the transfer's"):
        decode_header(bytes(raw))
    # through the assembler: the same refusal, the chunk never reaches the sink
    out = torch.zeros_like(blocks)
    asm = ChunkAssembler(TensorSink(out))
    asm.add(chunks[0].header_bytes, chunks[0].payload)
    with pytest.raises(KVTransferError, match="outside the transfer's"):
        asm.add(bytes(raw), chunks[1].payload)
    assert asm.seen == {0}


def test_assembler_refuses_a_foreign_chunk_after_the_first():
    blocks = make_cache()[:3].contiguous()
    mine, other = chunks_of(blocks, (5, 1, 7), "a"), chunks_of(blocks, (5, 1, 8), "a")
    asm = ChunkAssembler(TensorSink(torch.zeros_like(blocks)))
    asm.add(mine[0].header_bytes, mine[0].payload)
    with pytest.raises(KVTransferError, match="another transfer"):
        asm.add(other[1].header_bytes, other[1].payload)


def test_unframe_direct_read_matches_the_field_loop():
    blocks = make_cache()[:3].contiguous()
    c = chunks_of(blocks, (5, 1, 7))[0]
    framed = frame_kvchunk(c.header_bytes, c.payload)
    header, payload = unframe_kvchunk(framed)
    assert (bytes(header), bytes(payload)) == (c.header_bytes, bytes(c.payload))
    # payload first, then header: not the direct layout, read by the loop, same fields
    reordered = b"".join(
        (
            kvtransfer_pb2.KVChunk(payload=bytes(c.payload)).SerializeToString(),
            kvtransfer_pb2.KVChunk(header=c.header_bytes).SerializeToString(),
        )
    )
    header, payload = unframe_kvchunk(reordered)
    assert (bytes(header), bytes(payload)) == (c.header_bytes, bytes(c.payload))
    # a byte after the payload: not the direct layout; the loop refuses it as before
    with pytest.raises(KVTransferError, match="malformed KVChunk"):
        unframe_kvchunk(framed + b"\x00")


@pytest.mark.parametrize("kind", ["xxh3", "crc32"])
def test_parts_helpers_equal_the_joined_payload(kind):
    """`seal_parts` / `frame_kvchunk_parts` over a payload in pieces (numpy rows, as the
    exporter's in-place path passes a cache's runs) give what `seal` / `frame_kvchunk`
    give for the pieces joined: same checksum, same message bytes, and the message
    parses back (with its protobuf class too) to that header and payload."""
    rows = make_cache(3).view(-1).view(torch.uint8).view(-1, BS * KVH * HD * 2).numpy()
    pieces = [rows[7:9], rows[20:21], rows[2:6]]  # three runs, out of order
    joined = b"".join(pieces)
    # any header of the format (seal overwrites its checksum field)
    header = list(
        encode_chunks(make_cache()[:1].contiguous(), block_ids=[3], num_tokens=BS, checksum=kind)
    )[0].header_bytes
    assert seal_parts(header, pieces) == seal(header, joined)
    sealed, value = seal_parts(header, pieces)
    assert value == checksum(sealed, joined) != 0
    message = frame_kvchunk_parts(sealed, pieces)
    assert message == frame_kvchunk(sealed, joined)
    h, p = unframe_kvchunk(message)
    assert (bytes(h), bytes(p)) == (sealed, joined)
    parsed = kvtransfer_pb2.KVChunk.FromString(message)
    assert (parsed.header, parsed.payload) == (sealed, joined)


class TensorsOnly:
    """A sink with `write_units` only (a wrapper that forwards tensors)."""

    def __init__(self, sink) -> None:
        self.sink = sink
        self.calls = 0

    def bind(self, header) -> None:
        self.sink.bind(header)

    def write_units(self, unit_start, data) -> None:
        self.calls += 1
        self.sink.write_units(unit_start, data)


@pytest.mark.parametrize("wrap", ["none", "tensors_only", "stop_on_cancel", "stop_on_tensors"])
def test_chunks_given_as_bytes_land_in_the_cache_through_any_sink(wrap):
    src = make_cache(1)
    ids, dst_ids = (5, 1, 7), (2, 3, 9)
    blocks = src[list(ids)].contiguous()
    kv = torch.zeros_like(src)
    sink = CacheSink(kv, dst_ids)
    if wrap == "tensors_only":
        sink = TensorsOnly(sink)
    elif wrap == "stop_on_cancel":
        sink = StopOnCancel(sink, threading.Event())
    elif wrap == "stop_on_tensors":
        sink = StopOnCancel(TensorsOnly(sink), threading.Event())
    asm = ChunkAssembler(sink)
    for c in chunks_of(blocks, ids):
        asm.add(*unframe_kvchunk(frame_kvchunk(c.header_bytes, c.payload)))
    asm.finish()
    assert torch.equal(kv[list(dst_ids)], blocks)
    untouched = [b for b in range(NB) if b not in dst_ids]
    assert not kv[untouched].any()
    if wrap == "tensors_only":
        assert sink.calls == len(asm.seen)


def test_stop_on_cancel_refuses_bytes_once_cancelled():
    src = make_cache(1)
    blocks = src[[5, 1, 7]].contiguous()
    cancelled = threading.Event()
    kv = torch.zeros_like(src)
    asm = ChunkAssembler(StopOnCancel(CacheSink(kv, (2, 3, 9)), cancelled))
    chunks = chunks_of(blocks, (5, 1, 7))
    asm.add(chunks[0].header_bytes, chunks[0].payload)
    cancelled.set()
    with pytest.raises(TransferCancelled):
        asm.add(chunks[1].header_bytes, chunks[1].payload)


def test_tensor_sink_bytes_path_matches_the_tensor_path():
    blocks = make_cache(2)[:4].contiguous()
    chunks = chunks_of(blocks, (0, 1, 2, 3))
    by_bytes, by_tensor = torch.zeros_like(blocks), torch.zeros_like(blocks)
    a, b = ChunkAssembler(TensorSink(by_bytes)), ChunkAssembler(TensorsOnly(TensorSink(by_tensor)))
    for c in chunks:
        a.add(c.header_bytes, c.payload)
        b.add(c.header_bytes, c.payload)
    a.finish(), b.finish()
    assert torch.equal(by_bytes, blocks) and torch.equal(by_tensor, blocks)
