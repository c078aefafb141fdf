"""The receiving side: pull exported blocks into your own, behind one interface.

    transport.pull_into(handle, CacheSink(cache.kv, my_block_ids), block_ids=missing)
    blocks = transport.pull(handle)          # [n, L, 2, block_size, kvh, head_dim]

`handle` is the exporter's `ExportedKV` (from a KVHandle). `block_ids` names which of
its blocks to pull, by the exporter's ids (default: all, in handle order); `layers` a
layer range. Every chunk's checksum is verified before the pull returns (XXH3: before
the chunk is written; CRC-32: alongside the copy, see `ChunkAssembler`); a mismatch
raises `KVChecksumError`, a broken or short stream `KVTransferError`, an unknown,
released or expired lease `LeaseNotFoundError`. The decode worker maps these to its
policy (recompute locally, or fail the request). A failed pull may have written some
of the destination blocks: they must be treated as garbage (never cached or shared).

Two implementations:
- `ShmTransport`: same host. Maps the exporter's /dev/shm segment read-only, verifies
  the chunks and copies straight into the sink: one copy, no exporter involvement.
  An in-place lease (source.py) has a descriptor instead of a segment: the puller maps
  the exporter's KV cache file itself and copies the blocks from there into the sink,
  the only copy of the transfer, then reads the descriptor again: if the lease ended
  meanwhile (its blocks may have been reused under the copy) the pull fails with
  LeaseNotFoundError and the sink's blocks are garbage, as for any failed pull.
- `GrpcTransport`: any host. Streams `KVTransfer.PullBlocks` from the exporter's
  address, chunk by chunk, each verified and written into the sink as it arrives.
Every gRPC pull has a deadline (`GrpcTransport.timeout_s`, the caller's if shorter),
so a hung exporter cannot hold the puller's thread, and the blocks it writes into,
forever; channels are kept per exporter address in an LRU `ChannelCache` (workers
restart on new ports), also by the worker's lease releaser (common/runtime/leases.py).
`AutoTransport` picks per handle with `choose_transport` (shared memory when both
sides have the same host id and the exporter staged in /dev/shm, gRPC otherwise, or
forced by `mode`), and falls back to gRPC when the segment is not visible here.
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import grpc
import numpy as np
import torch

from pagedserve.kvtransfer.handle import ExportedKV, local_host_id
from pagedserve.kvtransfer.segment import (
    SEGMENT_HEADER_BYTES,
    SHM_DIR,
    MappingCache,
    SegmentView,
    is_in_place,
    lease_segment_path,
    parse_segment,
    segment_pid,
)
from pagedserve.kvtransfer.sinks import RowMap, TensorSink
from pagedserve.kvtransfer.source import SERVICE_NAME, positions_of
from pagedserve.kvtransfer.stats import PullRecord, TransferStats, failure_cause
from pagedserve.kvtransfer.wire import (
    DEFAULT_MAX_CHUNK_BYTES,
    MAX_CHUNK_BYTES_LIMIT,
    ChunkAssembler,
    ChunkHeader,
    KVSink,
    KVTransferError,
    LeaseNotFoundError,
    TransferSpec,
    plan_chunks,
    tensor_view,
    unframe_kvchunk,
    verify,
)
from pagedserve.v1 import kvtransfer_pb2

TransportKind = Literal["shm", "grpc"]
MODES = ("auto", "shm", "grpc")
logger = logging.getLogger(__name__)
# Internal RPCs get bounded deadlines by default, so that a peer that never answers
# cannot hold a thread (and the blocks it writes into) forever. Workers configure them
# (WorkerConfig.kv_pull_timeout_s).
DEFAULT_PULL_TIMEOUT_S = 60.0
DEFAULT_MAX_CHANNELS = 32
# An in-place descriptor is a page of header plus a block id table (4 bytes a block).
MAX_DESCRIPTOR_BYTES = 16 << 20


def choose_transport(local_host_id: str, remote_host_id: str, mode: str = "auto") -> TransportKind:
    """Shared memory when both ends are on one host, gRPC otherwise; `mode` forces one."""
    if mode not in MODES:
        raise ValueError(f"KV transport mode {mode!r} not one of {MODES}")
    if mode != "auto":
        return mode  # type: ignore[return-value]
    return "shm" if local_host_id == remote_host_id else "grpc"


@dataclass(frozen=True)
class PullResult:
    """What one pull moved."""

    transport: TransportKind
    num_blocks: int
    layer_start: int
    layer_end: int
    payload_bytes: int
    num_chunks: int


def request_spec(
    handle: ExportedKV, block_ids: Sequence[int] | None, layers: tuple[int, int] | None
) -> TransferSpec:
    """What a pull asks for; ValueError for ids not in the lease or a bad layer range."""
    lay = handle.layout
    ids = handle.block_ids if block_ids is None else tuple(int(b) for b in block_ids)
    if not ids:
        raise ValueError("nothing to pull: block_ids is empty")
    positions_of(handle.block_ids, ids)  # validates membership and duplicates
    l0, l1 = layers if layers is not None else (0, lay.num_layers)
    if not 0 <= l0 < l1 <= lay.num_layers:
        raise ValueError(f"layer range [{l0}, {l1}) outside the model's {lay.num_layers} layers")
    return TransferSpec(ids, l0, l1, lay.dtype, lay.unit_shape)


class KVTransport(ABC):
    """Pulls exported KV blocks into a sink."""

    name: str

    @abstractmethod
    def pull_into(
        self,
        handle: ExportedKV,
        sink: KVSink,
        block_ids: Sequence[int] | None = None,
        layers: tuple[int, int] | None = None,
        *,
        timeout: float | None = None,
    ) -> PullResult:
        """Pull `block_ids` (exporter ids, default all) over `layers` into `sink`."""

    def pull(
        self,
        handle: ExportedKV,
        block_ids: Sequence[int] | None = None,
        layers: tuple[int, int] | None = None,
        *,
        timeout: float | None = None,
    ) -> torch.Tensor:
        """The blocks as a new tensor [n, L, 2, block_size, kvh, head_dim]."""
        spec = request_spec(handle, block_ids, layers)
        lay = handle.layout
        shape = (len(spec.block_ids), spec.layer_end - spec.layer_start, 2, *lay.unit_shape)
        out = torch.empty(shape, dtype=lay.dtype)
        self.pull_into(handle, TensorSink(out), block_ids, layers, timeout=timeout)
        return out

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release connections; the transport is unusable afterwards."""


class ShmTransport(KVTransport):
    """Same host: map the exporter's segment, verify, copy into the sink."""

    name = "shm"

    def __init__(
        self,
        shm_dir: Path = SHM_DIR,
        *,
        overlap: bool | None = None,
        max_mapped_bytes: int = 256 << 20,
        max_cache_mapped_bytes: int = 256 << 30,
    ) -> None:
        """max_mapped_bytes: exporters' segment files kept mapped between pulls
        (segment.MappingCache); 0 maps every pull afresh. max_cache_mapped_bytes: the
        same for exporters' KV cache files (in-place leases): a cache lives as long as
        its worker and is mapped whole, lazily (see MappingCache's populate), so the cap
        is on address space, not memory (the pages are the exporter's); a mapping goes
        when its file is unlinked."""
        self.shm_dir = Path(shm_dir)
        self.overlap = overlap  # checksums on the helper thread (see ChunkAssembler)
        self.mappings = MappingCache(max_mapped_bytes)
        self.cache_mappings = MappingCache(max_cache_mapped_bytes, populate=False)

    def pull_into(self, handle, sink, block_ids=None, layers=None, *, timeout=None) -> PullResult:
        spec = request_spec(handle, block_ids, layers)
        if not handle.shm_name:
            raise KVTransferError(f"lease {handle.lease_id!r} was not staged in shared memory")
        if handle.expired():
            raise LeaseNotFoundError(f"lease {handle.lease_id!r} expired")
        # The handle comes from the caller: only a name that follows the segment naming
        # rule, for this lease, inside shm_dir is ever opened (ValueError otherwise).
        path = lease_segment_path(self.shm_dir, handle.shm_name, handle.lease_id)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise LeaseNotFoundError(
                f"segment {handle.shm_name} of lease {handle.lease_id!r} is gone "
                "(released or expired), or not visible from this process"
            ) from None
        try:
            head = os.pread(fd, SEGMENT_HEADER_BYTES, 0)
            if not any(head[:8]):  # an in-place descriptor invalidated, not yet unlinked
                raise LeaseNotFoundError(f"lease {handle.lease_id!r} ended")
            if is_in_place(head):
                return self._pull_in_place(handle, spec, fd, sink)
        finally:
            os.close(fd)
        try:
            mapping = self.mappings.open(path)
        except FileNotFoundError:
            raise LeaseNotFoundError(
                f"segment {handle.shm_name} of lease {handle.lease_id!r} is gone "
                "(released or expired), or not visible from this process"
            ) from None
        # The mapping is never closed explicitly: tensors viewing it keep it alive, and
        # it is unmapped when the last one is gone.
        segment = parse_segment(memoryview(mapping))
        first = segment.headers[0][0] if segment.headers else None
        if (
            segment.lease_id != handle.lease_id
            or first is None
            or first.block_ids != handle.block_ids
        ):
            raise KVTransferError(
                f"segment {handle.shm_name} does not hold lease {handle.lease_id!r}"
            )
        whole = (spec.layer_start, spec.layer_end) == (0, handle.layout.num_layers)
        if spec.block_ids == handle.block_ids and whole:
            result = self._pull_whole(segment, sink, spec)
        else:
            result = self._pull_part(segment, first, sink, spec)
        if not segment.unchanged():  # the exporter reused it (lease ended) while we copied
            raise LeaseNotFoundError(f"lease {handle.lease_id!r} ended during the pull")
        return result

    def close(self) -> None:
        """Drop the kept mappings (pulls in progress keep theirs until done)."""
        self.mappings.close()
        self.cache_mappings.close()

    def _pull_in_place(self, handle: ExportedKV, spec: TransferSpec, fd: int, sink) -> PullResult:
        """Copy the blocks of an in-place lease (descriptor open as `fd`) out of the
        exporter's cache file into the sink, then check the lease still held them.

        No content checksum here, by decision: the exporter pins the blocks for the whole
        lease, so they cannot change under a copy that the descriptor check below finds
        inside the lease, and a memcpy between two mappings of one machine's memory has
        no wire to corrupt bytes on; a checksum would cost a third pass over the data
        (an XXH3 pass was 6.4 ms of a 25 ms pull of 45 MiB here) to guard against
        nothing this path can do. Staged segments and gRPC keep their checksums.
        """
        size = os.fstat(fd).st_size
        if size > MAX_DESCRIPTOR_BYTES:
            raise KVTransferError(f"in-place descriptor {handle.shm_name} is {size} bytes")
        raw = os.pread(fd, size, 0)
        if not any(raw[:8]):
            raise LeaseNotFoundError(f"lease {handle.lease_id!r} ended")
        view = parse_segment(memoryview(raw))
        first = view.headers[0][0] if view.headers else None
        lay = handle.layout
        if (
            view.lease_id != handle.lease_id
            or first is None
            or first.block_ids != handle.block_ids
            or (first.num_layers, first.unit_shape, first.dtype)
            != (lay.num_layers, lay.unit_shape, lay.dtype)
        ):
            raise KVTransferError(
                f"descriptor {handle.shm_name} does not hold lease {handle.lease_id!r}"
            )
        ref = view.cache_ref()
        unit_bytes = first.unit_bytes
        L = first.num_layers
        if (
            ref.block_bytes != 2 * L * unit_bytes
            or max(first.block_ids) >= ref.num_blocks
            or ref.pid != segment_pid(handle.shm_name)
        ):
            raise KVTransferError(
                f"descriptor {handle.shm_name}: cache {ref.name} of {ref.num_blocks} blocks "
                f"of {ref.block_bytes} bytes does not fit lease {handle.lease_id!r}"
            )
        cache_path = self.shm_dir / ref.name  # the name is checked by CacheRef.unpack
        try:
            mapping = self.cache_mappings.open(cache_path)
        except FileNotFoundError:
            raise LeaseNotFoundError(
                f"the KV cache {ref.name} of lease {handle.lease_id!r} is gone (exporter closed)"
            ) from None
        if len(mapping) < ref.end():
            raise KVTransferError(f"KV cache file {ref.name} is shorter than its descriptor says")
        rows = np.frombuffer(
            mapping, np.uint8, count=ref.num_blocks * ref.block_bytes, offset=ref.offset
        ).reshape(-1, unit_bytes)
        sub_header = _sub_header(first, spec)
        spec.check(sub_header)
        sink.bind(sub_header)
        # exporter block ids[p], layers [l0, l1): cache rows ids[p] * 2L + 2 * l0 + r
        src_map = RowMap(spec.block_ids, sub_header.units_per_block, 2 * L, 2 * spec.layer_start)
        copy_from = getattr(sink, "copy_from", None)
        if copy_from is None or not copy_from(rows, src_map):
            for a, b, row in src_map.pieces(0, src_map.num_units):  # one write per run
                data = memoryview(rows[row : row + b - a]).cast("B")
                sink.write_units(a, tensor_view(data, first.dtype, (b - a, *first.unit_shape)))
        if os.pread(fd, SEGMENT_HEADER_BYTES, 0) != view.header_bytes:
            raise LeaseNotFoundError(
                f"lease {handle.lease_id!r} ended during the pull (its blocks may have been "
                "reused under the copy)"
            )
        nbytes = sub_header.num_units * unit_bytes
        return PullResult("shm", len(spec.block_ids), spec.layer_start, spec.layer_end, nbytes, 0)

    def _pull_whole(self, segment, sink, spec) -> PullResult:
        """Every chunk as staged: copy it, its checksum verified alongside."""
        units = _units_of(segment)  # one tensor over the payload, sliced per chunk
        asm = ChunkAssembler(sink, spec, overlap=self.overlap)
        try:
            for header, raw in segment.headers:  # decoded and validated by parse_segment
                data = units[header.unit_start : header.unit_start + header.unit_count]
                asm.add_decoded(header, raw, segment.chunk_payload(header), data)
            first = asm.finish()
        except BaseException:
            asm.abort()
            raise
        return PullResult(
            "shm",
            first.num_blocks,
            first.layer_start,
            first.layer_end,
            asm.payload_bytes,
            len(segment.headers),
        )

    def _pull_part(self, segment, first: ChunkHeader, sink, spec: TransferSpec) -> PullResult:
        """Some blocks or layers: verify the chunks holding them, then copy those runs.

        The segment is block-major: layers [l0, l1) of staged block position p are
        units [p * R + 2 * l0, p * R + 2 * l1) (R = 2 * num_layers), one contiguous
        run, so each wanted block is one copy (a run of consecutive positions over
        every layer, e.g. the suffix a prefix hit leaves, is one copy in all).
        """
        positions = positions_of(first.block_ids, spec.block_ids)
        R = first.units_per_block
        lo, hi = 2 * spec.layer_start, 2 * spec.layer_end
        wanted = sorted((p * R + lo, p * R + hi) for p in positions)  # disjoint unit ranges
        ends = [e for _, e in wanted]
        for header, raw in segment.headers:
            start, end = header.unit_start, header.unit_start + header.unit_count
            i = bisect.bisect_right(ends, start)  # first wanted range ending after `start`
            if i < len(wanted) and wanted[i][0] < end:
                verify(header, raw, segment.chunk_payload(header))
        sub_header = _sub_header(first, spec)
        spec.check(sub_header)
        sink.bind(sub_header)
        payload = _units_of(segment).view(first.transfer_shape)
        unit_shape = first.unit_shape
        per_block = hi - lo
        i = 0
        while i < len(positions):
            j = i + 1  # positions[i:j]: consecutive staged blocks, one copy over all layers
            while per_block == R and j < len(positions) and positions[j] == positions[j - 1] + 1:
                j += 1
            p = positions[i]
            data = payload[p : p + j - i, spec.layer_start : spec.layer_end]  # contiguous
            sink.write_units(i * per_block, data.reshape(-1, *unit_shape))
            i = j
        n = len(positions)
        nbytes = sub_header.num_units * sub_header.unit_bytes
        return PullResult("shm", n, spec.layer_start, spec.layer_end, nbytes, len(segment.headers))


def _units_of(segment: SegmentView) -> torch.Tensor:
    """The segment's payload as units [num_units, bs, kvh, d] of its first chunk's
    transfer; KVTransferError when the payload's length does not match that transfer."""
    first = segment.headers[0][0]
    if len(segment.payload) != first.num_units * first.unit_bytes:
        raise KVTransferError(
            f"KV segment payload is {len(segment.payload)} bytes, its transfer "
            f"{first.transfer_shape} needs {first.num_units * first.unit_bytes}"
        )
    return tensor_view(segment.payload, first.dtype, (first.num_units, *first.unit_shape))


def _sub_header(first: ChunkHeader, spec: TransferSpec) -> ChunkHeader:
    """A header describing the part `spec` of the transfer `first` belongs to."""
    fields = {
        **first.__dict__,
        "block_ids": spec.block_ids,
        "layer_start": spec.layer_start,
        "layer_end": spec.layer_end,
        "chunk_index": 0,
        "chunk_count": 1,
    }
    return ChunkHeader(**fields)


class GrpcTransport(KVTransport):
    """Any host: stream KVTransfer.PullBlocks, verify and place each chunk on arrival."""

    name = "grpc"

    def __init__(
        self,
        *,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        overlap: bool | None = None,
        timeout_s: float | None = DEFAULT_PULL_TIMEOUT_S,
        max_channels: int = DEFAULT_MAX_CHANNELS,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        """timeout_s: deadline of every pull (a caller's shorter timeout wins), so a
        hung exporter cannot hold the puller's thread and blocks; None = the caller's.
        max_channels: open channels kept, one per exporter address, LRU.
        credentials: mutual TLS to the exporters (the worker's internal plane), None =
        plaintext."""
        plan_chunks(1, 1, max_chunk_bytes)  # validates the chunk size
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s}")
        self.max_chunk_bytes = max_chunk_bytes
        self.overlap = overlap  # checksums on the helper thread (see ChunkAssembler)
        self.timeout_s = timeout_s
        limit = MAX_CHUNK_BYTES_LIMIT + (1 << 20)  # largest chunk plus its header
        self.channels = ChannelCache(
            max_channels,
            options=[("grpc.max_receive_message_length", limit)],
            credentials=credentials,
        )

    def _deadline(self, timeout: float | None) -> float | None:
        if timeout is None or self.timeout_s is None:
            return timeout if timeout is not None else self.timeout_s
        return min(timeout, self.timeout_s)

    def pull_into(self, handle, sink, block_ids=None, layers=None, *, timeout=None) -> PullResult:
        spec = request_spec(handle, block_ids, layers)
        if not handle.transfer_address:
            raise KVTransferError(f"lease {handle.lease_id!r} has no transfer address")
        request = kvtransfer_pb2.PullRequest(
            lease_id=handle.lease_id,
            block_ids=[] if spec.block_ids == handle.block_ids else list(spec.block_ids),
            layers=kvtransfer_pb2.LayerRange(start=spec.layer_start, end=spec.layer_end),
            max_chunk_bytes=self.max_chunk_bytes,
        )
        asm = ChunkAssembler(sink, spec, overlap=self.overlap)
        with self.channels.use(handle.transfer_address) as channel:
            pull_blocks = channel.unary_stream(
                f"/{SERVICE_NAME}/PullBlocks",
                request_serializer=kvtransfer_pb2.PullRequest.SerializeToString,
                response_deserializer=None,  # raw KVChunk bytes, unframed by hand (wire.py)
            )
            stream = pull_blocks(request, timeout=self._deadline(timeout))
            # Each chunk is verified and written here before the next is asked for. That
            # already overlaps with receiving: gRPC's core keeps reading the stream into
            # its buffers meanwhile (a 300 us pause per 1 MiB message left a raw
            # stream's time unchanged here). A writer thread that scattered chunk k
            # while this thread waited for k + 1 was measured (2026-12-01, 2-core EPYC,
            # three alternating runs each) and did not pay: median gRPC/raw 60-85% without it,
            # 63-74% with it; sender and receiver already keep both cores busy, so the
            # hand-off per chunk is pure overhead. Re-checked 2026-12-02 on a 2-core
            # Skylake-SP: raw stream and pull both use ~2 cores per unit of wall time,
            # so the ratio is a CPU ratio; what is left is copies and per-chunk Python
            # (NOTES.md, "gRPC KV transport against a raw gRPC stream").
            try:
                for message in stream:
                    asm.add(*unframe_kvchunk(message))
                first = asm.finish()
            except grpc.RpcError as e:
                asm.abort()
                raise _rpc_error(e, handle) from None
            except BaseException:
                stream.cancel()  # stop the sender: a bad chunk ends the transfer
                asm.abort()
                raise
        return PullResult(
            "grpc",
            first.num_blocks,
            first.layer_start,
            first.layer_end,
            asm.payload_bytes,
            len(asm.seen),
        )

    def close(self) -> None:
        self.channels.close()


class ChannelCache:
    """Open gRPC channels by address, at most `max_channels`, least recently used evicted.

    Peers come and go (Ray restarts a worker on a new port), so a map that only grows
    would keep a channel, and its reconnect attempts, per dead address forever. An
    evicted channel is closed at once, or when its last user is done with it (closing
    a channel cancels its calls in flight).
    """

    def __init__(
        self,
        max_channels: int = 32,
        options: list | None = None,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        """credentials: TLS of every channel (the internal plane's mutual TLS), None =
        plaintext."""
        if max_channels < 1:
            raise ValueError(f"max_channels must be >= 1, got {max_channels}")
        self.max_channels = max_channels
        self.options = options or []
        self.credentials = credentials
        self._open: OrderedDict[str, _Channel] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)

    def addresses(self) -> list[str]:
        """Cached addresses, least recently used first."""
        with self._lock:
            return list(self._open)

    @contextmanager
    def use(self, address: str) -> Iterator[grpc.Channel]:
        """The channel to `address` (opened if needed), kept open while in the block."""
        with self._lock:
            entry = self._open.get(address)
            if entry is None:
                entry = self._open[address] = _Channel(self._dial(address))
            self._open.move_to_end(address)
            entry.users += 1
            while len(self._open) > self.max_channels:
                _, evicted = self._open.popitem(last=False)
                evicted.evicted = True
                if not evicted.users:
                    evicted.channel.close()
        try:
            yield entry.channel
        finally:
            with self._lock:
                entry.users -= 1
                close = entry.evicted and not entry.users
            if close:
                entry.channel.close()

    def _dial(self, address: str) -> grpc.Channel:
        if self.credentials is None:
            return grpc.insecure_channel(address, options=self.options)
        return grpc.secure_channel(address, self.credentials, options=self.options)

    def close(self) -> None:
        with self._lock:
            entries = list(self._open.values())
            self._open.clear()
        for entry in entries:
            entry.channel.close()


@dataclass
class _Channel:
    channel: grpc.Channel
    users: int = 0
    evicted: bool = False


def _rpc_error(e: grpc.RpcError, handle: ExportedKV) -> KVTransferError:
    code, details = e.code(), e.details()
    where = f"lease {handle.lease_id!r} at {handle.transfer_address}"
    if code == grpc.StatusCode.NOT_FOUND:
        return LeaseNotFoundError(f"{where}: {details}")
    error = KVTransferError(f"pulling {where} failed: {code.name}: {details}")
    error.cause = _RPC_CAUSES.get(code, "transfer")
    return error


_RPC_CAUSES = {
    grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.CANCELLED: "cancelled",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "resource_exhausted",
}


class AutoTransport(KVTransport):
    """Chooses shared memory or gRPC per handle (see `choose_transport`)."""

    name = "auto"

    def __init__(
        self,
        *,
        host_id: str | None = None,
        mode: str = "auto",
        shm: ShmTransport | None = None,
        grpc_transport: GrpcTransport | None = None,
    ) -> None:
        choose_transport("", "", mode)  # validates the mode
        self.host_id = host_id or local_host_id()
        self.mode = mode
        self.shm = shm or ShmTransport()
        self.grpc = grpc_transport or GrpcTransport()
        self.stats = TransferStats()  # every pull's bytes, blocks, time or failure

    def choose(self, handle: ExportedKV) -> KVTransport:
        kind = choose_transport(self.host_id, handle.host_id, self.mode)
        if kind == "shm" and self.mode == "auto" and not handle.shm_name:
            kind = "grpc"  # the exporter staged privately: only gRPC can reach it
        return self.shm if kind == "shm" else self.grpc

    def pull_into(self, handle, sink, block_ids=None, layers=None, *, timeout=None) -> PullResult:
        """Pulls with the chosen transport; every pull is recorded in `stats`."""
        t0 = time.perf_counter()
        tried: list[KVTransport] = []
        try:
            result = self._pull(handle, sink, block_ids, layers, timeout, tried)
        except BaseException as e:
            kind = tried[-1].name if tried else "none"
            self.stats.record(PullRecord(kind, time.perf_counter() - t0, failure=failure_cause(e)))
            raise
        offered = len(handle.block_ids)
        asked = offered if block_ids is None else len(block_ids)
        self.stats.record(
            PullRecord(
                result.transport,
                time.perf_counter() - t0,
                payload_bytes=result.payload_bytes,
                pulled_blocks=result.num_blocks,
                reused_blocks=offered - asked,
            )
        )
        return result

    def _pull(self, handle, sink, block_ids, layers, timeout, tried: list) -> PullResult:
        transport = self.choose(handle)
        tried.append(transport)
        try:
            return transport.pull_into(handle, sink, block_ids, layers, timeout=timeout)
        except LeaseNotFoundError:
            # Same host id but another /dev/shm (a container): the exporter may still
            # serve it over gRPC. If the lease is really gone, gRPC says so too.
            fallback = transport is self.shm and self.mode == "auto" and handle.transfer_address
            if not fallback or handle.expired():
                raise
        tried.append(self.grpc)
        return self.grpc.pull_into(handle, sink, block_ids, layers, timeout=timeout)

    def close(self) -> None:
        self.shm.close()
        self.grpc.close()
