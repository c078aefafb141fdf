"""KV transfer: wire format, sinks, the exporter, both transports (real gRPC on loopback,
real /dev/shm segments) and the choice between them.

Small caches (4 layers, 2 KV heads, head_dim 8, block 4) so every test runs in
milliseconds; bit-exactness is checked on the raw bits (`view` as integers), so NaN
patterns and bf16 survive too.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import random
import subprocess
import sys
import textwrap
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch

from pagedserve.kvtransfer.handle import ExportedKV, KVLayout, local_host_id
from pagedserve.kvtransfer.segment import (
    SHM_DIR,
    create_shm,
    list_segments,
    parse_segment,
    remove_stale_segments,
    segment_name,
)
from pagedserve.kvtransfer.sinks import CacheSink, RowMap, TensorSink, _copy_runs, unit_rows
from pagedserve.kvtransfer.source import (
    SERVICE_NAME,
    KVSource,
    StagingFullError,
    add_kvtransfer_service,
)
from pagedserve.kvtransfer.transport import (
    AutoTransport,
    GrpcTransport,
    ShmTransport,
    choose_transport,
)
from pagedserve.kvtransfer.wire import (
    CHECKSUM_KINDS,
    DEFAULT_CHECKSUM,
    ChunkAssembler,
    ChunkHeader,
    KVChecksumError,
    KVTransferError,
    LeaseNotFoundError,
    decode_header,
    encode_chunks,
    encode_header,
    frame_kvchunk,
    plan_chunks,
    seal,
    unframe_kvchunk,
)
from pagedserve.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc

L, NB, BS, KVH, HD = 4, 12, 4, 2, 8  # layers, cache blocks, block size, kv heads, head dim
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HAVE_XXHASH = importlib.util.find_spec("xxhash") is not None
CHECKSUMS = [
    "crc32",
    pytest.param("xxh3", marks=pytest.mark.skipif(not HAVE_XXHASH, reason="xxhash not installed")),
]
UNIT_ELEMS = BS * KVH * HD  # elements of one block of one layer's K or V


def make_cache(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(
        -(2**15), 2**15, (NB, L, 2, BS, KVH, HD * dtype.itemsize // 2), generator=g
    )
    return bits.to(torch.int16).view(dtype)  # random bit patterns, NaNs and infs included


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(bits(a), bits(b))


def my_segments() -> list[str]:
    prefix = segment_name(os.getpid(), "")
    return [n for n in list_segments() if n.startswith(prefix)]


@pytest.fixture(autouse=True)
def no_segment_leaks():
    before = set(my_segments())
    yield
    assert set(my_segments()) - before == set(), "a test left /dev/shm segments behind"


@pytest.fixture
def source():
    src = KVSource(max_chunk_bytes=1024)
    yield src
    src.close()


@pytest.fixture
def served():
    """A KVSource behind a real gRPC server on 127.0.0.1 (port 0), stopped in teardown."""
    src = KVSource(max_chunk_bytes=1024)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    add_kvtransfer_service(server, src)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    src.transfer_address = f"127.0.0.1:{port}"
    client = GrpcTransport(max_chunk_bytes=1024)
    yield src, client
    client.close()
    server.stop(grace=None).wait()
    src.close()


# ---------------------------------------------------------------------------------- wire


def test_header_round_trips_every_field():
    h = ChunkHeader(
        request_id="req-é-1",
        dtype=torch.bfloat16,
        num_layers=30,
        layer_start=3,
        layer_end=9,
        block_size=16,
        num_kv_heads=3,
        head_dim=64,
        block_ids=(7, 0, 4_000_000_000),
        num_tokens=40,
        chunk_index=2,
        chunk_count=5,
        unit_start=6,
        unit_count=3,
        payload_len=3 * 16 * 3 * 64 * 2,
        checksum=0xDEADBEEF,
    )
    raw = encode_header(h)
    assert len(raw) == 64 + len("req-é-1".encode()) + 3 * 4
    assert decode_header(raw) == h


@pytest.mark.parametrize(
    ("num_units", "unit_bytes", "max_chunk", "expected"),
    [
        (10, 100, 1000, [(0, 10)]),
        (10, 100, 300, [(0, 3), (3, 3), (6, 3), (9, 1)]),
        (9, 100, 300, [(0, 3), (3, 3), (6, 3)]),
        (3, 100, 100, [(0, 1), (1, 1), (2, 1)]),
        (4, 100, 399, [(0, 3), (3, 1)]),
    ],
)
def test_plan_chunks_fills_chunks_with_whole_units(num_units, unit_bytes, max_chunk, expected):
    assert plan_chunks(num_units, unit_bytes, max_chunk) == expected


def test_plan_chunks_rejects_a_unit_larger_than_a_chunk():
    with pytest.raises(ValueError, match="more than max_chunk_bytes=99"):
        plan_chunks(1, 100, 99)
    with pytest.raises(ValueError, match="max_chunk_bytes must be in"):
        plan_chunks(1, 1, 0)


@pytest.mark.parametrize(
    ("ids", "per_block", "stride", "offset"),
    [
        ([0, 1, 2], 8, 8, 0),  # a tensor's own rows: one run
        ([3, 4, 9, 10, 11, 0], 8, 8, 0),  # consecutive ids merge: runs 3-4, 9-11, 0
        ([5, 2, 7], 4, 8, 2),  # a layer range: every block is its own run
        ([6, 7, 1], 4, 8, 4),  # ... even with consecutive ids (the rows do not touch)
        ([1], 2, 8, 6),
    ],
)
def test_row_map_pieces_send_every_unit_to_its_row_once(ids, per_block, stride, offset):
    row_map = RowMap(ids, per_block, stride, offset)
    total = len(ids) * per_block
    expected = [ids[u // per_block] * stride + offset + u % per_block for u in range(total)]
    for start in range(total):
        for count in range(1, total - start + 1):
            got = []
            for a, b, row in row_map.pieces(start, count):
                assert 0 <= a < b <= count
                got += [(a + i, row + i) for i in range(b - a)]
            assert got == [(i, expected[start + i]) for i in range(count)]
    # fewest copies: a run ends only where the destination rows stop being consecutive
    breaks = sum(expected[u] != expected[u - 1] + 1 for u in range(1, total))
    assert len(list(row_map.pieces(0, total))) == breaks + 1
    with pytest.raises(ValueError, match="outside"):
        list(row_map.pieces(total - 1, 2))


@pytest.mark.parametrize("checksum", CHECKSUMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("units_per_chunk", [1, 3, 7, 100])
def test_chunks_reassemble_bit_exact(dtype, units_per_chunk, checksum):
    blocks = make_cache(dtype)[:5].contiguous()  # [5, L, 2, ...]
    unit_bytes = UNIT_ELEMS * dtype.itemsize
    chunks = list(
        encode_chunks(
            blocks,
            block_ids=[3, 1, 4, 9, 2],
            num_tokens=18,
            request_id="r",
            max_chunk_bytes=units_per_chunk * unit_bytes,
            checksum=checksum,
        )
    )
    assert {c.header.checksum_kind for c in chunks} == {CHECKSUM_KINDS[checksum]}
    num_units = L * 2 * 5
    assert len(chunks) == -(-num_units // units_per_chunk)
    assert sum(c.header.unit_count for c in chunks) == num_units
    out = torch.empty_like(blocks)
    asm = ChunkAssembler(TensorSink(out))
    for c in reversed(chunks):  # any order
        asm.add(c.header_bytes, c.payload)
    first = asm.finish()
    assert (first.block_ids, first.num_tokens, first.request_id) == ((3, 1, 4, 9, 2), 18, "r")
    assert_bit_equal(out, blocks)


def _chunks(dtype=torch.float16, request_id="r", ids=(0, 1, 2), checksum=None):
    blocks = make_cache(dtype)[: len(ids)].contiguous()
    return blocks, list(
        encode_chunks(
            blocks,
            block_ids=list(ids),
            num_tokens=len(ids) * BS,
            request_id=request_id,
            max_chunk_bytes=1024,
            checksum=checksum,
        )
    )


@pytest.mark.parametrize("checksum", CHECKSUMS)
@pytest.mark.parametrize("overlap", [True, False])
def test_corrupted_payload_raises_checksum_error(overlap, checksum):
    blocks, chunks = _chunks(checksum=checksum)
    bad = bytearray(chunks[2].payload)
    bad[17] ^= 0x01
    asm = ChunkAssembler(TensorSink(torch.empty_like(blocks)), overlap=overlap)
    with pytest.raises(KVChecksumError, match="chunk 2/"):
        for i, c in enumerate(chunks):
            asm.add(c.header_bytes, bad if i == 2 else c.payload)
        asm.finish()


@pytest.mark.parametrize("checksum", CHECKSUMS)
def test_corrupted_block_id_in_header_raises_checksum_error(checksum):
    blocks, chunks = _chunks(ids=(5, 6, 7), checksum=checksum)
    header = bytearray(chunks[0].header_bytes)
    header[-4] ^= 0x02  # last block id: 7 -> 5, structurally valid
    assert decode_header(bytes(header)).block_ids == (5, 6, 5)
    asm = ChunkAssembler(TensorSink(torch.empty_like(blocks)), overlap=False)
    with pytest.raises(KVChecksumError):
        asm.add(bytes(header), chunks[0].payload)


def test_checksum_kind_is_validated():
    with pytest.raises(ValueError, match="checksum 'md5' not one of"):
        _chunks(checksum="md5")
    with pytest.raises(ValueError, match="checksum 'md5'"):
        KVSource(checksum="md5")
    _, chunks = _chunks(checksum="crc32")
    raw = bytearray(chunks[0].header_bytes)
    raw[7] = 9  # the checksum kind byte
    with pytest.raises(KVTransferError, match="unknown checksum kind 9"):
        decode_header(bytes(raw))
    assert ("xxh3" if HAVE_XXHASH else "crc32") == DEFAULT_CHECKSUM


def test_missing_chunk_is_a_truncated_transfer():
    blocks, chunks = _chunks()
    asm = ChunkAssembler(TensorSink(torch.empty_like(blocks)))
    for c in chunks[:-1]:
        asm.add(c.header_bytes, c.payload)
    with pytest.raises(
        KVTransferError, match=f"truncated: {len(chunks) - 1} of {len(chunks)} chunks"
    ):
        asm.finish()
    with pytest.raises(KVTransferError, match="before its first chunk"):
        ChunkAssembler(TensorSink(torch.empty_like(blocks))).finish()


def test_duplicate_or_foreign_chunks_are_rejected():
    blocks, chunks = _chunks(request_id="a")
    _, other = _chunks(request_id="b")
    asm = ChunkAssembler(TensorSink(torch.empty_like(blocks)))
    asm.add(chunks[0].header_bytes, chunks[0].payload)
    with pytest.raises(KVTransferError, match="received twice"):
        asm.add(chunks[0].header_bytes, chunks[0].payload)
    with pytest.raises(KVTransferError, match="another transfer"):
        asm.add(other[1].header_bytes, other[1].payload)
    asm.abort()


def test_short_payload_and_malformed_headers_raise():
    blocks, chunks = _chunks()
    asm = ChunkAssembler(TensorSink(torch.empty_like(blocks)))
    with pytest.raises(KVTransferError, match="payload is 10 bytes"):
        asm.add(chunks[0].header_bytes, chunks[0].payload[:10])
    raw = chunks[0].header_bytes
    with pytest.raises(KVTransferError, match="not a KV chunk"):
        decode_header(b"XXXX" + raw[4:])
    with pytest.raises(KVTransferError, match="version 9"):
        decode_header(raw[:4] + b"\x09\x00" + raw[6:])
    with pytest.raises(KVTransferError, match="truncated"):
        decode_header(raw[:30])
    with pytest.raises(KVTransferError, match="inconsistent"):
        decode_header(raw[:-1])


def test_kvchunk_framing_is_the_protobuf_message():
    _, chunks = _chunks()
    c = chunks[0]
    framed = frame_kvchunk(c.header_bytes, c.payload)
    msg = kvtransfer_pb2.KVChunk.FromString(framed)
    assert (msg.header, msg.payload) == (c.header_bytes, bytes(c.payload))
    # ... and a message written by protobuf (with an unknown field added) unframes.
    extra = kvtransfer_pb2.KVChunk(header=b"h" * 200, payload=b"p" * 70000).SerializeToString()
    header, payload = unframe_kvchunk(extra + b"\x18\x05")  # field 3, varint 5
    assert (bytes(header), bytes(payload)) == (b"h" * 200, b"p" * 70000)
    with pytest.raises(KVTransferError, match="without header or payload"):
        unframe_kvchunk(kvtransfer_pb2.KVChunk(header=b"h").SerializeToString())
    with pytest.raises(KVTransferError, match="past the end"):
        unframe_kvchunk(framed[:-1])


# --------------------------------------------------------------------------------- sinks


@pytest.mark.parametrize("dtype", DTYPES)
def test_cache_sink_writes_only_the_destination_blocks(dtype):
    blocks, chunks = _chunks(dtype, ids=(0, 1, 2))
    cache = torch.zeros(NB, L, 2, BS, KVH, HD, dtype=dtype)
    asm = ChunkAssembler(CacheSink(cache, [9, 0, 5]))
    for c in chunks:
        asm.add(c.header_bytes, c.payload)
    asm.finish()
    assert_bit_equal(cache[[9, 0, 5]], blocks)
    others = [b for b in range(NB) if b not in (9, 0, 5)]
    assert not bits(cache[others]).any()


def test_sinks_write_into_non_contiguous_views():
    blocks, chunks = _chunks(torch.bfloat16, ids=(0, 1, 2))
    wide = torch.zeros(NB, L, 2, BS, KVH, 2 * HD, dtype=torch.bfloat16)
    cache = wide[..., :HD]  # a strided view: the per-row fallback path
    assert not cache.is_contiguous()
    out = torch.zeros(3, L, 4, BS, KVH, HD, dtype=torch.bfloat16)[:, :, 1:3]
    assert not out.is_contiguous()
    for sink in (CacheSink(cache, [4, 11, 2]), TensorSink(out)):
        asm = ChunkAssembler(sink)
        for c in chunks:
            asm.add(c.header_bytes, c.payload)
        asm.finish()
    assert_bit_equal(cache[[4, 11, 2]], blocks)
    assert_bit_equal(out, blocks)
    assert not bits(wide[..., HD:]).any()


def test_cache_sink_refuses_a_mismatched_transfer():
    _, chunks = _chunks(torch.float16, ids=(0, 1))
    cases = [
        (
            torch.zeros(NB, L, 2, BS, KVH, HD, dtype=torch.float32),
            [1, 2],
            "sender's KV is torch.float16",
        ),
        (torch.zeros(NB, L, 2, BS, KVH, HD, dtype=torch.float16), [1], "2 blocks, 1 destination"),
        (torch.zeros(NB, L + 1, 2, BS, KVH, HD, dtype=torch.float16), [1, 2], "has 4 layers"),
        (torch.zeros(NB, L, 2, BS, KVH, 2 * HD, dtype=torch.float16), [1, 2], "blocks are"),
    ]
    for cache, ids, message in cases:
        with pytest.raises(ValueError, match=message):
            ChunkAssembler(CacheSink(cache, ids)).add(chunks[0].header_bytes, chunks[0].payload)
    with pytest.raises(ValueError, match="out of range"):
        CacheSink(cases[0][0], [NB])
    with pytest.raises(ValueError, match="duplicate"):
        CacheSink(cases[0][0], [1, 1])


# ------------------------------------------------------------------------- export + shm


@pytest.mark.parametrize("dtype", DTYPES)
def test_shm_round_trip_bit_exact(source, dtype):
    cache = make_cache(dtype)
    handle = source.export(cache, [7, 2, 11], num_tokens=10, request_id="req-1")
    assert handle.shm_name == segment_name(os.getpid(), handle.lease_id)
    assert (SHM_DIR / handle.shm_name).exists()
    out = ShmTransport().pull(handle)
    assert_bit_equal(out, cache[[7, 2, 11]])
    source.release(handle.lease_id)


@pytest.mark.parametrize("transport", ["shm", "grpc"])
@pytest.mark.parametrize(
    ("block_ids", "layers"),
    [(None, (1, 3)), ([2, 11], None), ([11, 7], (0, 1)), ([7], (3, 4))],
)
def test_partial_pulls(served, transport, block_ids, layers):
    source, client = served
    cache = make_cache(torch.float16)
    handle = source.export(cache, [7, 2, 11], num_tokens=12)
    t = ShmTransport() if transport == "shm" else client
    ids = block_ids or [7, 2, 11]
    l0, l1 = layers or (0, L)
    out = t.pull(handle, block_ids, layers)
    assert_bit_equal(out, cache[ids][:, l0:l1])
    dst = torch.zeros_like(cache)
    result = t.pull_into(handle, CacheSink(dst, [0, 1, 2][: len(ids)]), block_ids, layers)
    assert (result.transport, result.num_blocks, result.layer_start, result.layer_end) == (
        transport,
        len(ids),
        l0,
        l1,
    )
    assert result.payload_bytes == (l1 - l0) * 2 * len(ids) * UNIT_ELEMS * 2
    assert_bit_equal(dst[: len(ids), l0:l1], cache[ids][:, l0:l1])
    assert (
        not bits(dst[len(ids) :]).any()
        and not bits(dst[:, :l0]).any()
        and not bits(dst[:, l1:]).any()
    )


def test_pull_rejects_bad_requests_before_moving_anything(source):
    handle = source.export(make_cache(torch.float16), [7, 2], num_tokens=8)
    shm = ShmTransport()
    with pytest.raises(ValueError, match=r"block ids \[3\] are not in the lease"):
        shm.pull(handle, [3])
    with pytest.raises(ValueError, match="duplicate block ids"):
        shm.pull(handle, [7, 7])
    with pytest.raises(ValueError, match="nothing to pull"):
        shm.pull(handle, [])
    with pytest.raises(ValueError, match=r"layer range \[2, 2\)"):
        shm.pull(handle, None, (2, 2))
    source.release(handle.lease_id)


def test_export_rejects_bad_arguments(source):
    cache = make_cache(torch.float16)
    with pytest.raises(ValueError, match="distinct ids"):
        source.export(cache, [1, 1], num_tokens=8)
    with pytest.raises(ValueError, match="distinct ids"):
        source.export(cache, [NB], num_tokens=4)
    with pytest.raises(ValueError, match="does not fill 2 blocks"):
        source.export(cache, [1, 2], num_tokens=4)  # would fit in one block
    with pytest.raises(ValueError, match="lease id"):
        source.export(cache, [1], num_tokens=4, lease_id="../etc")
    source.export(cache, [1], num_tokens=4, lease_id="same")
    with pytest.raises(ValueError, match="already open"):
        source.export(cache, [2], num_tokens=4, lease_id="same")
    assert source.open_leases == 1
    source.release("same")


def test_released_segments_leave_dev_shm(source):
    cache = make_cache(torch.float32)
    handles = [source.export(cache, [i], num_tokens=BS) for i in range(3)]
    names = {h.shm_name for h in handles}
    assert names <= set(my_segments())
    assert source.release(handles[0].lease_id) is True
    assert source.release(handles[0].lease_id) is False  # idempotent
    assert handles[0].shm_name not in my_segments()  # renamed into the pool
    with pytest.raises(LeaseNotFoundError, match="is gone"):
        ShmTransport().pull(handles[0])
    source.close()
    assert my_segments() == []  # leases and pool alike
    assert source.open_leases == 0 and source.pooled_bytes == 0


def test_pooled_segment_is_reused_and_old_handle_stays_dead(source):
    cache = make_cache(torch.float16)
    first = source.export(cache, [1, 2], num_tokens=8)
    source.release(first.lease_id)
    pooled = source.pooled_bytes
    assert pooled > 0
    second = source.export(cache, [3, 4], num_tokens=8)
    assert source.pooled_bytes == 0 and source.staged_bytes == pooled  # the same buffer
    with pytest.raises(LeaseNotFoundError):
        ShmTransport().pull(first)
    assert_bit_equal(ShmTransport().pull(second), cache[[3, 4]])
    source.release(second.lease_id)


def test_pool_is_bounded(source):
    small = KVSource(pool_bytes=0)
    try:
        h = small.export(make_cache(torch.float16), [1], num_tokens=1)
        small.release(h.lease_id)
        assert small.pooled_bytes == 0 and my_segments() == []
    finally:
        small.close()


def test_segment_rewritten_under_a_reader_is_detected(source):
    cache = make_cache(torch.float16)
    first = source.export(cache, [1, 2], num_tokens=8)
    segment = source.get(first.lease_id).segment
    assert segment.unchanged()
    source.release(first.lease_id)
    second = source.export(cache, [5, 6], num_tokens=8)  # reuses the buffer
    assert not segment.unchanged()
    source.release(second.lease_id)


@pytest.mark.parametrize("checksum", CHECKSUMS)
def test_corrupted_segment_raises_checksum_error(source, checksum):
    source.checksum = checksum
    cache = make_cache(torch.float16)
    handle = source.export(cache, [4, 5, 6], num_tokens=12)
    path = SHM_DIR / handle.shm_name
    data = bytearray(path.read_bytes())
    layout = parse_segment(memoryview(bytes(data))).layout
    data[layout.total_len - 100] ^= 0x10  # inside the last chunk's payload
    path.write_bytes(bytes(data))
    with pytest.raises(KVChecksumError):
        ShmTransport().pull(handle)
    with pytest.raises(KVChecksumError):  # a partial pull verifies the chunks it reads
        ShmTransport().pull(handle, layers=(L - 1, L))
    source.release(handle.lease_id)


def test_expired_lease_is_freed_and_counted():
    now = [100.0]
    expired = []
    src = KVSource(default_ttl_s=30.0, clock=lambda: now[0], on_expire=expired.append)
    try:
        h1 = src.export(make_cache(torch.float16), [1], num_tokens=3)
        h2 = src.export(make_cache(torch.float16), [2], num_tokens=3, ttl_s=60.0)
        now[0] += 30.0
        assert src.expire() == [h1.lease_id]
        assert expired == [h1.lease_id] and src.expired_total == 1 and src.open_leases == 1
        assert h1.shm_name not in my_segments()
        with pytest.raises(LeaseNotFoundError, match="unknown lease"):
            src.get(h1.lease_id)
        now[0] += 30.0  # h2 expires; `get` notices before any expire() call
        with pytest.raises(LeaseNotFoundError, match="expired"):
            src.get(h2.lease_id)
        assert expired == [h1.lease_id, h2.lease_id] and src.expired_total == 2
        assert src.release(h2.lease_id) is False
    finally:
        src.close()


def test_expired_segment_waits_out_the_grace_period_before_reuse():
    now = [0.0]
    src = KVSource(default_ttl_s=1.0, reuse_grace_s=5.0, clock=lambda: now[0])
    try:
        cache = make_cache(torch.float16)
        src.export(cache, [1], num_tokens=3)
        now[0] = 2.0
        src.expire()
        pooled = src.pooled_bytes
        src.release(src.export(cache, [2], num_tokens=3).lease_id)  # needs a new buffer
        assert src.pooled_bytes == 2 * pooled
    finally:
        src.close()


def test_stale_segments_of_dead_exporters_are_removed(tmp_path):
    dead_pid = 2**22 + 12345  # above the default pid_max: never a live process
    stale = tmp_path / segment_name(dead_pid, "abc")
    stale.write_bytes(b"x")
    mine = tmp_path / segment_name(os.getpid(), "def")
    mine.write_bytes(b"y")
    (tmp_path / "unrelated").write_bytes(b"z")
    assert remove_stale_segments(tmp_path) == [stale.name]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, "unrelated"])


def test_private_staging_has_no_segment(served):
    _, client = served
    src = KVSource(use_shm=False, transfer_address=served[0].transfer_address)
    try:
        handle = src.export(make_cache(torch.float16), [1], num_tokens=2)
        assert handle.shm_name == "" and my_segments() == []
        with pytest.raises(KVTransferError, match="not staged in shared memory"):
            ShmTransport().pull(handle)
        assert parse_segment(src.get(handle.lease_id).buffer.flat).lease_id == handle.lease_id
    finally:
        src.close()


# ---------------------------------------------------------------------------------- gRPC


@pytest.mark.parametrize("dtype", DTYPES)
def test_grpc_round_trip_bit_exact(served, dtype):
    source, client = served
    cache = make_cache(dtype)
    handle = source.export(cache, [3, 0, 10, 6], num_tokens=16, request_id="req-g")
    assert_bit_equal(client.pull(handle), cache[[3, 0, 10, 6]])
    dst = torch.zeros_like(cache)
    result = client.pull_into(handle, CacheSink(dst, [1, 2, 3, 4]))
    assert result.num_chunks == -(-(L * 2 * 4 * UNIT_ELEMS * dtype.itemsize) // 1024)
    assert_bit_equal(dst[[1, 2, 3, 4]], cache[[3, 0, 10, 6]])
    source.release(handle.lease_id)


def test_grpc_unknown_lease_is_not_found(served):
    source, client = served
    handle = source.export(make_cache(torch.float16), [1], num_tokens=2)
    source.release(handle.lease_id)
    with pytest.raises(LeaseNotFoundError, match="unknown lease"):
        client.pull(handle)
    with grpc.insecure_channel(source.transfer_address) as channel:
        stub = kvtransfer_pb2_grpc.KVTransferStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.PullBlocks(kvtransfer_pb2.PullRequest(lease_id="nope")))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert "unknown lease 'nope'" in err.value.details()


def test_grpc_invalid_pull_requests(served):
    source, _ = served
    handle = source.export(make_cache(torch.float16), [1, 2], num_tokens=8)
    bad = [
        (kvtransfer_pb2.PullRequest(lease_id=handle.lease_id, block_ids=[9]), "not in the lease"),
        (
            kvtransfer_pb2.PullRequest(
                lease_id=handle.lease_id, layers=kvtransfer_pb2.LayerRange(start=2, end=9)
            ),
            "layer range",
        ),
        (
            kvtransfer_pb2.PullRequest(lease_id=handle.lease_id, max_chunk_bytes=8),
            "raise the chunk size",
        ),
    ]
    with grpc.insecure_channel(source.transfer_address) as channel:
        stub = kvtransfer_pb2_grpc.KVTransferStub(channel)
        for request, message in bad:
            with pytest.raises(grpc.RpcError) as err:
                list(stub.PullBlocks(request))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in err.value.details()
    source.release(handle.lease_id)


def test_generated_stub_reads_the_stream(served):
    source, _ = served
    cache = make_cache(torch.bfloat16)
    handle = source.export(cache, [5, 8], num_tokens=8)
    out = torch.empty(2, L, 2, BS, KVH, HD, dtype=torch.bfloat16)
    asm = ChunkAssembler(TensorSink(out))
    with grpc.insecure_channel(source.transfer_address) as channel:
        for msg in kvtransfer_pb2_grpc.KVTransferStub(channel).PullBlocks(
            kvtransfer_pb2.PullRequest(lease_id=handle.lease_id)
        ):
            asm.add(msg.header, msg.payload)
    assert asm.finish().block_ids == (5, 8)
    assert_bit_equal(out, cache[[5, 8]])
    source.release(handle.lease_id)


@pytest.mark.parametrize("checksum", CHECKSUMS)
def test_grpc_corrupted_chunk_raises_checksum_error(served, checksum):
    source, client = served
    source.checksum = checksum
    handle = source.export(make_cache(torch.float16), [1, 2, 3], num_tokens=12)
    payload = source.get(handle.lease_id).payload  # the staged copy the server sends
    payload.view(torch.uint8).view(-1)[2000] ^= 0x40
    with pytest.raises(KVChecksumError):
        client.pull(handle)
    source.release(handle.lease_id)


class _Misbehaving:
    """A real gRPC server on the KVTransfer path that cuts streams short."""

    def __init__(self, source: KVSource, mode: str) -> None:
        self.source, self.mode = source, mode
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        handler = grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "PullBlocks": grpc.unary_stream_rpc_method_handler(
                    self.pull, request_deserializer=kvtransfer_pb2.PullRequest.FromString
                )
            },
        )
        self.server.add_generic_rpc_handlers((handler,))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def pull(self, request, context):
        chunks = list(self.source.get(request.lease_id).chunks())
        for i, (header, payload) in enumerate(chunks):
            if i == len(chunks) // 2:
                if self.mode == "abort":
                    context.abort(grpc.StatusCode.UNAVAILABLE, "exporter shutting down")
                return  # "truncate": end the stream cleanly, chunks missing
            yield frame_kvchunk(header, payload)


@pytest.mark.parametrize("mode", ["truncate", "abort"])
def test_grpc_broken_stream_raises(source, mode):
    bad = _Misbehaving(source, mode)
    try:
        handle = source.export(make_cache(torch.float16), [1, 2, 3], num_tokens=12).with_address(
            bad.address
        )
        client = GrpcTransport(max_chunk_bytes=1024)
        expected = "truncated" if mode == "truncate" else "UNAVAILABLE: exporter shutting down"
        with pytest.raises(KVTransferError, match=expected) as err:
            client.pull(handle)
        assert not isinstance(err.value, KVChecksumError)
        client.close()
        source.release(handle.lease_id)
    finally:
        bad.server.stop(grace=None).wait()


def test_grpc_unreachable_exporter_raises():
    handle = ExportedKV(
        lease_id="x",
        request_id="",
        host_id="elsewhere",
        transfer_address="127.0.0.1:1",
        shm_name="",
        block_ids=(0,),
        num_tokens=1,
        layout=KVLayout(L, BS, KVH, HD, torch.float16),
        expires_unix_ms=2**62,
    )
    client = GrpcTransport()
    with pytest.raises(KVTransferError, match="UNAVAILABLE"):
        client.pull(handle, timeout=5)
    client.close()


# ------------------------------------------------------------------- choosing a transport


def test_choose_transport():
    assert choose_transport("a", "a") == "shm"
    assert choose_transport("a", "b") == "grpc"
    assert choose_transport("a", "a", mode="grpc") == "grpc"
    assert choose_transport("a", "b", mode="shm") == "shm"
    with pytest.raises(ValueError, match="mode 'tcp'"):
        choose_transport("a", "a", mode="tcp")
    assert local_host_id() == local_host_id() and "/" in local_host_id()


def test_auto_transport_picks_per_handle(served):
    source, client = served
    cache = make_cache(torch.float16)
    handle = source.export(cache, [1, 2], num_tokens=8)
    auto = AutoTransport(grpc_transport=client)
    dst = torch.zeros_like(cache)
    assert auto.pull_into(handle, CacheSink(dst, [3, 4])).transport == "shm"
    remote = ExportedKV(**{**handle.__dict__, "host_id": "another-host/boot"})
    assert auto.pull_into(remote, CacheSink(dst, [3, 4])).transport == "grpc"
    forced = AutoTransport(mode="grpc", grpc_transport=client)
    assert forced.pull_into(handle, CacheSink(dst, [3, 4])).transport == "grpc"
    # Same host id but the segment is not visible here: falls back to gRPC. (A
    # well-formed name for the lease, from a pid that cannot exist: a name that breaks
    # the naming rule is refused before anything is opened, see test_handle_fuzz.py.)
    gone = segment_name(999_999_999, handle.lease_id)
    hidden = ExportedKV(**{**handle.__dict__, "shm_name": gone})
    assert auto.pull_into(hidden, CacheSink(dst, [3, 4])).transport == "grpc"
    assert_bit_equal(dst[[3, 4]], cache[[1, 2]])
    source.release(handle.lease_id)
    with pytest.raises(LeaseNotFoundError):  # gone for both transports
        auto.pull(handle)


def test_exported_handle_round_trips_through_the_proto(source):
    handle = source.export(make_cache(torch.bfloat16), [4, 9, 1], num_tokens=11, request_id="rq")
    msg = kvtransfer_pb2.KVHandle.FromString(handle.to_proto().SerializeToString())
    assert msg.layout.dtype == "bfloat16" and list(msg.block_ids) == [4, 9, 1]
    assert ExportedKV.from_proto(msg, request_id="rq") == handle
    source.release(handle.lease_id)


def test_no_segment_survives_the_exporter_process(tmp_path):
    """An exporter process that exits without close() still unlinks its segments."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from pagedserve.kvtransfer.source import KVSource\n"
        "src = KVSource()\n"
        "h = src.export(torch.zeros(4, 2, 2, 4, 2, 8), [0, 3], num_tokens=5)\n"
        "src.release(src.export(torch.zeros(4, 2, 2, 4, 2, 8), [1], num_tokens=1).lease_id)\n"
        "print(h.shm_name)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    name = out.stdout.strip()
    assert name.startswith("pagedserve-kv-")
    assert not (Path(SHM_DIR) / name).exists()
    pid = name.split("-")[2]
    assert not [n for n in list_segments() if n.startswith(f"pagedserve-kv-{pid}-")]


# -- staging limits: a full tmpfs, caps on leases and bytes ------------------------------


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 1 MiB tmpfs (needs root: mount), unmounted at teardown."""
    mnt = tmp_path / "shm"
    mnt.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
            check=True,
            capture_output=True,
        )
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot mount a tmpfs here: {e}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_create_shm_on_a_full_tmpfs_raises_enospc(small_tmpfs):
    """The pages are allocated up front: no sparse file that SIGBUSes at a write later."""
    with pytest.raises(OSError) as err:
        create_shm(small_tmpfs / segment_name(os.getpid(), "big"), 2 << 20)
    assert err.value.errno == errno.ENOSPC
    assert list(small_tmpfs.iterdir()) == []


def test_full_tmpfs_stages_privately_and_serves_every_lease(small_tmpfs):
    """Exports go on past a full tmpfs: staged privately (served over gRPC) instead.

    Run in a child process: the failure this guards against is a SIGBUS, which would
    kill the test session.
    """
    script = textwrap.dedent(
        f"""
        from pathlib import Path
        import torch
        from pagedserve.kvtransfer.source import KVSource
        from pagedserve.kvtransfer.transport import ShmTransport
        shm = Path({str(small_tmpfs)!r})
        g = torch.Generator().manual_seed(0)
        cache = torch.randn(12, 4, 2, 4, 2, 8, generator=g).to(torch.float16)
        src = KVSource(shm_dir=shm, pool_bytes=0)
        first = src.export(cache, [1, 2], num_tokens=8)  # 1 MiB: all the tmpfs has
        rest = [src.export(cache, [i], num_tokens=4) for i in (3, 4)]
        assert first.shm_name and (shm / first.shm_name).exists()
        assert [h.shm_name for h in rest] == ["", ""] and src.private_fallbacks == 2
        assert torch.equal(ShmTransport(shm).pull(first), cache[[1, 2]])
        for h, i in zip(rest, (3, 4)):
            assert torch.equal(src.get(h.lease_id).payload, cache[[i]])
        src.close()
        assert list(shm.iterdir()) == []
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert done.stdout.strip() == "ok"


def test_open_leases_are_capped():
    cache = make_cache(torch.float16)
    src = KVSource(use_shm=False, max_open_leases=2)
    try:
        a = src.export(cache, [1], num_tokens=4)
        src.export(cache, [2], num_tokens=4)
        with pytest.raises(StagingFullError, match="2 leases open, at most 2"):
            src.export(cache, [3], num_tokens=4)
        assert src.refused_total == 1 and src.open_leases == 2
        src.release(a.lease_id)
        src.export(cache, [3], num_tokens=4)
    finally:
        src.close()


def test_staged_bytes_are_capped_and_expired_leases_make_room():
    now = [0.0]
    cache = make_cache(torch.float16)
    src = KVSource(use_shm=False, max_staged_bytes=1 << 20, clock=lambda: now[0])
    try:
        src.export(cache, [1], num_tokens=4, ttl_s=1.0)  # one MiB buffer: the cap
        with pytest.raises(StagingFullError, match="at most 1048576"):
            src.export(cache, [2], num_tokens=4)
        now[0] = 2.0  # the first lease is past its expiry: swept to make room
        src.export(cache, [2], num_tokens=4)
        assert src.expired_total == 1 and src.open_leases == 1
    finally:
        src.close()


@pytest.mark.parametrize("cap", ["max_open_leases", "max_staged_bytes"])
def test_caps_must_be_positive(cap):
    with pytest.raises(ValueError, match=cap):
        KVSource(use_shm=False, **{cap: 0})


# ------------------------------------------------------------------ block-major placement


def expected_after_pull(src, src_ids, dst_ids, layers, base):
    """What moving blocks `src_ids` (layers [l0, l1)) of `src` into `dst_ids` of a cache
    holding `base` must leave there, built block by block, layer by layer, K and V,
    with plain indexing: no unit or row arithmetic shared with the code under test."""
    out = base.clone()
    l0, l1 = layers
    for s, d in zip(src_ids, dst_ids, strict=True):
        for layer in range(l0, l1):
            for kv in (0, 1):
                out[d, layer, kv] = src[s, layer, kv]
    return out


def unit_bytes(dtype: torch.dtype) -> int:
    return UNIT_ELEMS * dtype.itemsize


@pytest.mark.parametrize("checksum", CHECKSUMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layers", [(0, L), (1, 3), (3, 4)])
@pytest.mark.parametrize("units_per_chunk", [1, 3, 5, 8, 13, 100])
def test_chunks_land_every_block_at_its_destination_id(dtype, layers, units_per_chunk, checksum):
    src = make_cache(dtype, seed=1)
    src_ids = [10, 3, 4, 7, 0, 1]
    dst_ids = [6, 2, 11, 7, 8, 0]  # permuted, some consecutive (7, 8), some not
    l0, l1 = layers
    blocks = src[src_ids][:, l0:l1].contiguous()  # what read_blocks + a layer slice gives
    # never a whole number of units, and (for 3, 5, 13) chunks that start and end
    # inside a block (a block is 2 * (l1 - l0) units)
    max_chunk = units_per_chunk * unit_bytes(dtype) + 7
    chunks = list(
        encode_chunks(
            blocks,
            block_ids=src_ids,
            num_tokens=len(src_ids) * BS,
            layer_start=l0,
            num_layers=L,
            max_chunk_bytes=max_chunk,
            checksum=checksum,
        )
    )
    assert {c.header.unit_count for c in chunks[:-1]} <= {units_per_chunk}
    base = make_cache(dtype, seed=2)  # random, so a stray write shows
    dst = base.clone()
    asm = ChunkAssembler(CacheSink(dst, dst_ids))
    for c in random.Random(units_per_chunk).sample(chunks, len(chunks)):  # any order
        asm.add(c.header_bytes, c.payload)
    asm.finish()
    assert_bit_equal(dst, expected_after_pull(src, src_ids, dst_ids, layers, base))
    out = torch.zeros(len(src_ids), l1 - l0, 2, BS, KVH, HD, dtype=dtype)
    asm = ChunkAssembler(TensorSink(out))
    for c in chunks:
        asm.add(c.header_bytes, c.payload)
    asm.finish()
    assert_bit_equal(out, blocks)


def test_a_chunk_is_written_as_runs_of_whole_blocks():
    """A chunk cut inside blocks is a partial run at each end and whole blocks between
    (consecutive destination ids over every layer: one run), not unit by unit."""
    src = make_cache(torch.float16, seed=1)
    ids = [2, 3, 4, 9]  # destination 5, 6, 7 consecutive: one run of 3 blocks
    chunks = list(
        encode_chunks(
            src[ids].contiguous(),
            block_ids=ids,
            num_tokens=4 * BS,
            max_chunk_bytes=27 * unit_bytes(torch.float16),  # 3 blocks and 3 units
        )
    )
    assert [(c.header.unit_start, c.header.unit_count) for c in chunks] == [(0, 27), (27, 5)]
    dst = torch.zeros_like(src)
    sink = CacheSink(dst, [5, 6, 7, 0])
    asm = ChunkAssembler(sink)
    for c in chunks:
        asm.add(c.header_bytes, c.payload)
    asm.finish()
    runs = [list(sink._map.pieces(c.header.unit_start, c.header.unit_count)) for c in chunks]
    # (data start, data end, cache row), one copy each. chunk 0: blocks 5, 6, 7 whole
    # (24 units, one run) + 3 units of block 0; chunk 1: the rest of block 0
    assert runs == [[(0, 24, 5 * 2 * L), (24, 27, 0)], [(0, 5, 3)]]
    assert_bit_equal(dst[[5, 6, 7, 0]], src[ids])


@pytest.mark.parametrize("transport", ["shm", "grpc"])
@pytest.mark.parametrize(
    ("block_ids", "layers"),
    [
        (None, None),
        (None, (1, 3)),
        ([9, 4, 5], None),  # a permuted subset, 4-5 consecutive in the lease
        ([4, 5, 2], (0, L)),
        ([5, 0, 9], (2, 4)),
        ([2], (3, 4)),
    ],
)
def test_pulls_land_every_block_at_its_destination_id(transport, block_ids, layers):
    """Export with chunks cut inside blocks (3.4 units), pull with another cut for gRPC
    (5.4 units, re-chunked by the servicer), into permuted non-contiguous ids."""
    dtype = torch.bfloat16
    src_cache = make_cache(dtype, seed=3)
    lease_ids = [0, 4, 5, 9, 2]
    src = KVSource(max_chunk_bytes=3 * unit_bytes(dtype) + 50)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    add_kvtransfer_service(server, src)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    src.transfer_address = f"127.0.0.1:{port}"
    client = GrpcTransport(max_chunk_bytes=5 * unit_bytes(dtype) + 50)
    try:
        handle = src.export(src_cache, lease_ids, num_tokens=5 * BS - 1)
        t = ShmTransport() if transport == "shm" else client
        ids = block_ids or lease_ids
        dst_ids = [8, 3, 4, 11, 1][: len(ids)]
        base = make_cache(dtype, seed=4)
        dst = base.clone()
        result = t.pull_into(handle, CacheSink(dst, dst_ids), block_ids, layers)
        assert result.transport == transport
        l0, l1 = layers or (0, L)
        assert_bit_equal(dst, expected_after_pull(src_cache, ids, dst_ids, (l0, l1), base))
        assert_bit_equal(t.pull(handle, block_ids, layers), src_cache[ids][:, l0:l1])
    finally:
        client.close()
        server.stop(grace=None).wait()
        src.close()


def test_copy_runs_on_torch_rows_as_on_numpy_rows():
    """The torch branch of the run copy (what a GPU cache uses) places units as the
    numpy one does: checked here on CPU tensors, on a GPU below when there is one."""
    src = make_cache(torch.float16, seed=5)
    ids, dst_ids = [3, 1, 2], [4, 5, 0]
    blocks = src[ids][:, 1:4].contiguous()
    row_map = RowMap(dst_ids, 6, 2 * L, 2)
    units = blocks.view(-1, BS, KVH, HD)
    base = make_cache(torch.float16, seed=6)
    as_numpy, as_torch = base.clone(), base.clone()
    for start, count in [(0, 4), (4, 7), (11, 7)]:
        _copy_runs(unit_rows(as_numpy), row_map, start, units[start : start + count])
        rows = as_torch.view(-1).view(torch.uint8).view(-1, UNIT_ELEMS * 2)
        _copy_runs(rows, row_map, start, units[start : start + count])
    expected = expected_after_pull(src, ids, dst_ids, (1, 4), base)
    assert_bit_equal(as_numpy, expected)
    assert_bit_equal(as_torch, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_export_and_pull_with_caches_on_a_gpu(source):
    src = make_cache(torch.bfloat16, seed=7).cuda()
    handle = source.export(src, [6, 1, 2], num_tokens=3 * BS)
    base = make_cache(torch.bfloat16, seed=8).cuda()
    dst = base.clone()
    ShmTransport().pull_into(handle, CacheSink(dst, [0, 10, 11]), None, (1, 4))
    expected = expected_after_pull(src.cpu(), [6, 1, 2], [0, 10, 11], (1, 4), base.cpu())
    assert_bit_equal(dst.cpu(), expected)
    source.release(handle.lease_id)


def test_a_version_1_chunk_is_refused():
    """Version 1 numbered units layer-major: read as version 2 it would put every unit
    in the wrong place, so a well-formed, correctly sealed v1 chunk is refused."""
    blocks, chunks = _chunks()
    raw = bytearray(chunks[0].header_bytes)
    assert int.from_bytes(raw[4:6], "little") == 2
    raw[4:6] = (1).to_bytes(2, "little")
    v1, _ = seal(bytes(raw), chunks[0].payload)
    with pytest.raises(KVTransferError, match="version 1 not supported"):
        decode_header(v1)
    asm = ChunkAssembler(TensorSink(torch.empty_like(blocks)))
    with pytest.raises(KVTransferError, match="version 1 not supported"):
        asm.add(v1, chunks[0].payload)


def test_shm_puller_keeps_the_mapping_of_a_reused_segment_file():
    """The exporter's pool hands one file from lease to lease: the puller maps it once,
    reads each lease's own blocks through it, and lets it go once the file is unlinked."""
    cache = make_cache(torch.float16)
    shm = ShmTransport()
    with KVSource(max_chunk_bytes=1024) as src:
        for ids in ([1, 2], [5, 6], [9, 3]):
            handle = src.export(cache, ids, num_tokens=8)
            assert_bit_equal(shm.pull(handle), cache[ids])
            src.release(handle.lease_id)  # back to the pool: the next export reuses it
        assert shm.mappings.maps_total == 1
        kept = shm.mappings.mapped_bytes
        assert kept > 0
    # the source unlinked its files: the next pull (another exporter) drops the mapping
    with KVSource(max_chunk_bytes=1024) as other:
        handle = other.export(cache, [4], num_tokens=4)
        assert_bit_equal(shm.pull(handle), cache[[4]])
        assert shm.mappings.maps_total == 2
        assert shm.mappings.mapped_bytes == kept  # only the new file (same capacity)
        other.release(handle.lease_id)
    shm.close()
    assert shm.mappings.mapped_bytes == 0
    fresh = ShmTransport(max_mapped_bytes=0)  # nothing kept: a map per pull
    with KVSource(max_chunk_bytes=1024) as src:
        for ids in ([1], [2]):
            handle = src.export(cache, ids, num_tokens=4)
            assert_bit_equal(fresh.pull(handle), cache[ids])
            src.release(handle.lease_id)
    assert (fresh.mappings.maps_total, fresh.mappings.mapped_bytes) == (2, 0)
