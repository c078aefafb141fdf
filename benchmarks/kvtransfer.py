"""KV transfer throughput: a request's blocks through each transport, next to baselines.

    python -m benchmarks.kvtransfer [--tokens 16 64 256 1024 2048] [--repeats 7] [--json PATH]

The default model's KV layout (SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, fp16,
16-token blocks: 360 KiB per block), for prompts of 16 to 2048 tokens. Every transfer
goes from randomly placed blocks of one cache into randomly placed blocks of another
(`CacheSink`), checksums on, 1 MiB chunks. Measured in one run:

- memcpy:   `copy_` of a contiguous tensor of the same bytes into a buffer allocated
            and faulted in before timing (the baseline for shm), timed in turns with
            the shm and in-place moves. Not `clone()`: that
            allocates and page-faults its destination on every call (1.6 GB/s at 45 MiB
            against 7-11 GB/s for a copy into a ready buffer here), which flattered
            every ratio against it (NOTES.md, 2026-12-01).
- shm:      export (gather into a pooled /dev/shm segment + checksums) + pull (map,
            verify, scatter into the destination cache) + release, all in this process.
            The columns `export` and `pull` split it; `pull/mem` is the decode side's
            share alone. The design copies twice (cache -> segment -> cache), so 50% of
            one memcpy is its ceiling at equal copy speeds.
- in place: the same move from a source cache allocated in a /dev/shm file
            (`KVCache(shm_dir=...)`): export in place (a descriptor, no copy) + pull
            (the puller maps the exporter's cache file and copies the blocks straight
            into the destination cache, no checksum) + release. One copy: 100% of
            memcpy is its ceiling. Timed in turns with `shm` (staged), same run.
- raw grpc: a bare streaming RPC sending pre-built bytes messages of the same sizes as
            the transport's KVChunk messages, received and dropped (the baseline for grpc),
            over the transport's own channel: the same connection and options.
- grpc:     `GrpcTransport.pull_into` from an exporter in another process (its own
            cache, KVSource, KVTransfer servicer) of a staged lease: frame (one copy out
            of the segment), send, unframe, verify, scatter. The export is done before
            timing (its cost is `export`).
- grpc ip:  the same pull of an in-place lease (the exporter's cache in a /dev/shm
            file, as a worker's is by default): what a puller on another host gets
            from a default worker. The exporter checksums each chunk's blocks where
            they lie and copies them into the message at pull time (nothing was done
            at export), so its exporter side costs a checksum more than `grpc`.

Ratios: shm / memcpy and in place / memcpy (target >= 50%) and grpc / raw grpc, grpc ip /
raw grpc (target >= 80%). Throughput is
payload bytes over the best time of `--repeats` runs after one warm-up: the machine is
shared, and the minimum is the measurement least disturbed by other processes (each
ratio compares best with best, taken in the same run; grpc and raw grpc run in turns,
so that a load that comes and goes hits both alike). `paired` is the median over turns
of raw time / grpc time, one pull and one raw stream back to back, which one lucky or
unlucky turn cannot move. A second table gives each side's CPU time per MiB (every
thread of the puller, this process, and of the exporter) for the pulls and the raw
streams, and `cpu raw/grpc`: where the gap goes, per side. On the shared 2-core
machine (load average ~6.5, 2026-12-01), three runs at 256/1024/2048 tokens gave
best / best 38-98%, paired 55-81%, CPU 54-78%: read a ratio from several runs. Both
processes run torch with `--threads` threads. Checksums: the wire format's default kind (XXH3-64 when `xxhash`
is installed, else CRC-32), or `--checksum`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import struct
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import asdict, dataclass
from typing import NamedTuple

import grpc
import torch

from benchmarks.cli import print_rows
from pagedserve.common.api.model_config import ModelSpec
from pagedserve.common.core.kv_cache import KVCache
from pagedserve.common.shm import SHM_DIR
from pagedserve.kvtransfer.handle import ExportedKV
from pagedserve.kvtransfer.sinks import CacheSink
from pagedserve.kvtransfer.source import KVSource, add_kvtransfer_service
from pagedserve.kvtransfer.transport import GrpcTransport, ShmTransport
from pagedserve.kvtransfer.wire import (
    CHECKSUM_KINDS,
    DEFAULT_CHECKSUM,
    DEFAULT_MAX_CHUNK_BYTES,
    frame_kvchunk,
    header_size,
    plan_chunks,
)

# The default model (DESIGN.md): KV per token = 2 x 30 x 3 x 64 x 2 B = 22.5 KiB.
NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 30, 3, 64, 16, torch.float16
TOKENS = (16, 64, 256, 1024, 2048)
CACHE_BLOCKS = 160  # per cache: room for the largest request (128 blocks) plus spares
BENCH_SERVICE = "pagedserve.bench.KVTransferBench"


def new_cache(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # block-major, as KVCache.kv: one block's layers, K and V, are one contiguous run
    shape = (CACHE_BLOCKS, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return torch.randn(shape, generator=g).to(DTYPE)


def shm_cache(seed: int) -> KVCache:
    """`new_cache(seed)`'s contents in a cache allocated in a /dev/shm file (in place)."""
    spec = ModelSpec(
        "llama", 1, 1, 1, NUM_LAYERS, NUM_KV_HEADS, NUM_KV_HEADS, HEAD_DIM, 1e-5, 1e4,
        None, 1, False, False, False, None, (),
    )  # fmt: skip
    cache = KVCache(spec, CACHE_BLOCKS, BLOCK_SIZE, DTYPE, "cpu", shm_dir=SHM_DIR)
    if cache.shm_path is None:
        raise SystemExit(f"{SHM_DIR} has no room for a {cache.nbytes}-byte cache")
    cache.kv.copy_(new_cache(seed))
    return cache


def random_blocks(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(CACHE_BLOCKS, generator=g)[:n].tolist()


def message_sizes(num_blocks: int, chunk_bytes: int) -> list[int]:
    """Sizes of the framed KVChunk messages the transport sends for `num_blocks`."""
    unit = BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
    hsize = header_size("", num_blocks)
    plan = plan_chunks(NUM_LAYERS * 2 * num_blocks, unit, chunk_bytes)
    return [len(frame_kvchunk(b"\0" * hsize, b"\0" * count * unit)) for _, count in plan]


# ------------------------------------------------------------------ exporter process


def _exporter_main(conn, threads: int, chunk_bytes: int, checksum: str) -> None:
    """A worker-like process: a cache, a KVSource, KVTransfer + raw stream + export RPCs.
    Two caches of the same contents: one in ordinary memory (its exports are staged)
    and one in a /dev/shm file (exported in place, as a default worker's)."""
    torch.set_num_threads(threads)
    kv = new_cache(seed=1)
    shared = shm_cache(seed=1)
    source = KVSource(max_chunk_bytes=chunk_bytes, checksum=checksum)
    messages: dict[int, bytes] = {}

    def export(request: bytes, context) -> bytes:
        n, in_place = struct.unpack("<II", request)
        ids, tokens = random_blocks(n, seed=n), n * BLOCK_SIZE
        if in_place:
            handle = source.export(shared.kv, ids, num_tokens=tokens, on_end=lambda: None)
        else:
            handle = source.export(kv, ids, num_tokens=tokens)
        assert handle.in_place == bool(in_place), handle
        return handle.to_proto().SerializeToString()

    def release(request: bytes, context) -> bytes:
        return b"\x01" if source.release(request.decode()) else b"\x00"

    def cpu_seconds(request: bytes, context) -> bytes:
        return struct.pack("<d", time.process_time())  # every thread of this process

    def raw_stream(request: bytes, context):
        sizes = struct.unpack(f"<{len(request) // 4}I", request)
        for size in sizes:
            if size not in messages:
                # random bytes, not bytes(size): a zero-filled buffer is calloc'd onto the
                # kernel's shared zero page until written, and a stream of it cost the
                # puller 35-40 % more CPU than one of real messages (NOTES, 2026-12-01),
                # a baseline slower than the data it stands for
                messages[size] = os.urandom(size)
            yield messages[size]

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    add_kvtransfer_service(server, source)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                BENCH_SERVICE,
                {
                    "Export": grpc.unary_unary_rpc_method_handler(export),
                    "Release": grpc.unary_unary_rpc_method_handler(release),
                    "CpuSeconds": grpc.unary_unary_rpc_method_handler(cpu_seconds),
                    "RawStream": grpc.unary_stream_rpc_method_handler(raw_stream),
                },
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    source.transfer_address = f"127.0.0.1:{port}"
    server.start()
    conn.send(port)
    conn.recv()  # until the parent says stop
    server.stop(grace=None).wait()
    source.close()
    shared.close()


# ------------------------------------------------------------------ measurements


@dataclass
class Row:
    tokens: int
    blocks: int
    bytes: int
    memcpy_gbps: float
    shm_gbps: float
    shm_export_gbps: float
    shm_pull_gbps: float
    inplace_gbps: float  # in-place export + pull + release
    inplace_pull_gbps: float
    raw_grpc_gbps: float
    grpc_gbps: float
    shm_vs_memcpy: float
    shm_pull_vs_memcpy: float
    inplace_vs_memcpy: float
    inplace_speedup_paired: float  # median over turns of staged shm time / in-place time
    grpc_vs_raw: float
    grpc_vs_raw_paired: float  # median of per-turn ratios (see paired_ratio)
    grpc_inplace_gbps: float  # the pull of an in-place lease
    grpc_inplace_vs_raw: float
    grpc_inplace_vs_raw_paired: float
    # CPU time per MiB of payload, summed over every thread of a process: the puller
    # (this process) and the exporter, for the pulls and for the raw streams.
    grpc_cpu_puller_us_per_mib: float
    grpc_cpu_exporter_us_per_mib: float
    raw_cpu_puller_us_per_mib: float
    raw_cpu_exporter_us_per_mib: float
    grpc_vs_raw_cpu: float  # raw CPU / grpc CPU, both processes together
    grpc_inplace_cpu_puller_us_per_mib: float
    grpc_inplace_cpu_exporter_us_per_mib: float
    grpc_inplace_vs_raw_cpu: float


def best_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


class Turns(NamedTuple):
    seconds: dict[str, list[float]]  # wall time of each turn, per variant
    cpu_seconds: dict[str, list[float]]  # per variant, per clock: summed over the turns


def times_interleaved(
    fns: dict[str, Callable[[], object]],
    repeats: int,
    cpu_clocks: Sequence[Callable[[], float]] = (),
) -> Turns:
    """`repeats` times of each of `fns`, run in turns (a, b, a, b, ...) after one warm-up
    each: a load that comes and goes on a shared machine then hits every variant alike,
    where timing all of one before the other let the load decide a ratio.

    `cpu_clocks` (CPU seconds of a process) are read around every turn, outside its
    wall time, and summed per variant: CPU time is what a variant costs, wall time that
    plus whatever other processes on a shared machine took meanwhile."""
    for fn in fns.values():
        fn()
    seconds: dict[str, list[float]] = {name: [] for name in fns}
    cpu = {name: [0.0] * len(cpu_clocks) for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            c0 = [clock() for clock in cpu_clocks]
            t0 = time.perf_counter()
            fn()
            seconds[name].append(time.perf_counter() - t0)
            for i, clock in enumerate(cpu_clocks):
                cpu[name][i] += clock() - c0[i]
    return Turns(seconds, cpu)


def paired_ratio(baseline: list[float], measured: list[float]) -> float:
    """Median over turns of baseline time / measured time, each pair run back to back:
    steadier than best / best when the machine's load moves between turns."""
    return statistics.median(b / m for b, m in zip(baseline, measured, strict=True))


def measure(
    tokens: int,
    repeats: int,
    chunk_bytes: int,
    checksum: str,
    channel: grpc.Channel,
    grpc_transport: GrpcTransport,
) -> Row:
    n = -(-tokens // BLOCK_SIZE)
    src, dst = new_cache(seed=2), torch.zeros_like(new_cache(seed=2))
    src_ids, dst_ids = random_blocks(n, seed=3), random_blocks(n, seed=4)
    nbytes = NUM_LAYERS * 2 * n * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
    flat = src[:n].contiguous()

    ready = torch.empty_like(flat).fill_(0)  # allocated and faulted in before timing

    # shm: export + pull + release, and each phase on its own; staged and in place in
    # turns (the in-place source is a copy of `src` in a /dev/shm cache file).
    shm = ShmTransport()
    sink = CacheSink(dst, dst_ids)
    inplace_src = shm_cache(seed=2)
    with KVSource(max_chunk_bytes=chunk_bytes, checksum=checksum) as source:
        phases: dict[str, list[float]] = {}

        def move(kind: str, kv: torch.Tensor, on_end) -> None:
            t0 = time.perf_counter()
            handle = source.export(kv, src_ids, num_tokens=tokens, on_end=on_end)
            t1 = time.perf_counter()
            shm.pull_into(handle, sink)
            t2 = time.perf_counter()
            source.release(handle.lease_id)
            t3 = time.perf_counter()
            assert handle.in_place == (on_end is not None), handle
            phases.setdefault(f"{kind} export", []).append(t1 - t0)
            phases.setdefault(f"{kind} pull", []).append(t2 - t1)
            phases.setdefault(f"{kind} total", []).append(t3 - t0)

        def memcpy() -> None:
            t0 = time.perf_counter()
            ready.copy_(flat)
            phases.setdefault("memcpy", []).append(time.perf_counter() - t0)

        # memcpy, staged and in place in turns: the baseline from the same minutes of
        # a shared machine as the two transports (timed apart, it moved 2x between runs)
        turns = [("shm", src, None), ("inplace", inplace_src.kv, lambda: None)]
        memcpy()
        for turn in turns:  # warm-up
            move(*turn)
        phases.clear()
        for _ in range(repeats):
            memcpy()
            for turn in turns:
                move(*turn)
                if turn[0] == "inplace":
                    assert torch.equal(dst[dst_ids], src[src_ids]), "in-place pull corrupted data"
                    dst.zero_()
                else:
                    assert torch.equal(dst[dst_ids], src[src_ids]), "shm transfer corrupted data"
                    dst.zero_()
    inplace_src.close()
    t_shm, t_export, t_pull = (min(phases[f"shm {k}"]) for k in ("total", "export", "pull"))
    t_inplace, t_inplace_pull = (min(phases[f"inplace {k}"]) for k in ("total", "pull"))
    t_memcpy = min(phases["memcpy"])

    # grpc: the exporter process holds the blocks; pull them repeatedly from one lease.
    # The raw stream runs over the transport's own channel (one TCP connection, the
    # same options and flow-control state), in turns with the pulls.
    export = channel.unary_unary(f"/{BENCH_SERVICE}/Export")
    from pagedserve.v1 import kvtransfer_pb2

    staged, in_place = (
        ExportedKV.from_proto(
            kvtransfer_pb2.KVHandle.FromString(export(struct.pack("<II", n, flag)))
        )
        for flag in (0, 1)
    )
    sizes = message_sizes(n, chunk_bytes)
    request = struct.pack(f"<{len(sizes)}I", *sizes)
    dst.zero_()
    exporter_cpu = channel.unary_unary(f"/{BENCH_SERVICE}/CpuSeconds")
    remote = new_cache(seed=1)[list(staged.block_ids)]

    def pull(handle: ExportedKV) -> None:
        grpc_transport.pull_into(handle, sink)

    with grpc_transport.channels.use(staged.transfer_address) as transfer_channel:
        raw = transfer_channel.unary_stream(f"/{BENCH_SERVICE}/RawStream")
        pull(in_place)
        assert torch.equal(dst[dst_ids], remote), "grpc pull of an in-place lease corrupted data"
        dst.zero_()
        turns = times_interleaved(
            {
                "grpc": lambda: pull(staged),
                "grpc ip": lambda: pull(in_place),
                "raw": lambda: sum(len(m) for m in raw(request)),
            },
            repeats,
            cpu_clocks=(time.process_time, lambda: struct.unpack("<d", exporter_cpu(b""))[0]),
        )
    times = turns.seconds
    t_grpc, t_raw, t_ip = min(times["grpc"]), min(times["raw"]), min(times["grpc ip"])
    us_per_mib = {
        k: [c / repeats / (nbytes / 2**20) * 1e6 for c in v] for k, v in turns.cpu_seconds.items()
    }
    assert torch.equal(dst[dst_ids], remote), "grpc transfer corrupted data"
    for handle in (staged, in_place):
        channel.unary_unary(f"/{BENCH_SERVICE}/Release")(handle.lease_id.encode())
    raw_cpu = sum(us_per_mib["raw"])

    gbps = lambda t: nbytes / t / 1e9  # noqa: E731
    return Row(
        tokens=tokens,
        blocks=n,
        bytes=nbytes,
        memcpy_gbps=gbps(t_memcpy),
        shm_gbps=gbps(t_shm),
        shm_export_gbps=gbps(t_export),
        shm_pull_gbps=gbps(t_pull),
        inplace_gbps=gbps(t_inplace),
        inplace_pull_gbps=gbps(t_inplace_pull),
        raw_grpc_gbps=gbps(t_raw),
        grpc_gbps=gbps(t_grpc),
        shm_vs_memcpy=t_memcpy / t_shm,
        shm_pull_vs_memcpy=t_memcpy / t_pull,
        inplace_vs_memcpy=t_memcpy / t_inplace,
        inplace_speedup_paired=paired_ratio(phases["shm total"], phases["inplace total"]),
        grpc_vs_raw=t_raw / t_grpc,
        grpc_vs_raw_paired=paired_ratio(times["raw"], times["grpc"]),
        grpc_inplace_gbps=gbps(t_ip),
        grpc_inplace_vs_raw=t_raw / t_ip,
        grpc_inplace_vs_raw_paired=paired_ratio(times["raw"], times["grpc ip"]),
        grpc_cpu_puller_us_per_mib=us_per_mib["grpc"][0],
        grpc_cpu_exporter_us_per_mib=us_per_mib["grpc"][1],
        raw_cpu_puller_us_per_mib=us_per_mib["raw"][0],
        raw_cpu_exporter_us_per_mib=us_per_mib["raw"][1],
        grpc_vs_raw_cpu=raw_cpu / sum(us_per_mib["grpc"]),
        grpc_inplace_cpu_puller_us_per_mib=us_per_mib["grpc ip"][0],
        grpc_inplace_cpu_exporter_us_per_mib=us_per_mib["grpc ip"][1],
        grpc_inplace_vs_raw_cpu=raw_cpu / sum(us_per_mib["grpc ip"]),
    )


TABLE_HEAD = (
    f"{'tokens':>6} {'blocks':>6} {'MiB':>7} | {'memcpy':>7} {'shm':>7} {'export':>7} "
    f"{'pull':>7} {'shm/mem':>7} {'pull/mem':>8} | {'inplace':>7} {'in/mem':>6} "
    f"{'in:shm':>6} | {'raw grpc':>8} {'grpc':>7} {'grpc/raw':>8} {'paired':>6} "
    f"{'grpc ip':>7} {'ip/raw':>6} {'paired':>6}"
)


def _row_line(r: Row) -> str:
    return (
        f"{r.tokens:>6} {r.blocks:>6} {r.bytes / 2**20:>7.2f} | {r.memcpy_gbps:>7.2f} "
        f"{r.shm_gbps:>7.2f} {r.shm_export_gbps:>7.2f} {r.shm_pull_gbps:>7.2f} "
        f"{r.shm_vs_memcpy:>7.0%} {r.shm_pull_vs_memcpy:>8.0%} | {r.inplace_gbps:>7.2f} "
        f"{r.inplace_vs_memcpy:>6.0%} {r.inplace_speedup_paired:>5.2f}x | "
        f"{r.raw_grpc_gbps:>8.2f} {r.grpc_gbps:>7.2f} {r.grpc_vs_raw:>8.0%} "
        f"{r.grpc_vs_raw_paired:>6.0%} {r.grpc_inplace_gbps:>7.2f} "
        f"{r.grpc_inplace_vs_raw:>6.0%} {r.grpc_inplace_vs_raw_paired:>6.0%}"
    )


CPU_HEAD = (
    f"{'tokens':>6} | {'raw: puller':>11} {'exporter':>8} | {'grpc: puller':>12} "
    f"{'exporter':>8} | {'cpu raw/grpc':>12} | {'grpc ip: puller':>15} {'exporter':>8} | "
    f"{'cpu raw/ip':>10}"
)


def _cpu_line(r: Row) -> str:
    return (
        f"{r.tokens:>6} | {r.raw_cpu_puller_us_per_mib:>11.0f} "
        f"{r.raw_cpu_exporter_us_per_mib:>8.0f} | {r.grpc_cpu_puller_us_per_mib:>12.0f} "
        f"{r.grpc_cpu_exporter_us_per_mib:>8.0f} | {r.grpc_vs_raw_cpu:>12.0%} | "
        f"{r.grpc_inplace_cpu_puller_us_per_mib:>15.0f} "
        f"{r.grpc_inplace_cpu_exporter_us_per_mib:>8.0f} | {r.grpc_inplace_vs_raw_cpu:>10.0%}"
    )


def print_table(rows: list[Row], checksum: str) -> None:
    title = f"throughput in GB/s (payload bytes / best time), checksum {checksum}"
    print_rows(title, TABLE_HEAD, map(_row_line, rows))
    title = "CPU us per MiB of payload, every thread of each process, mean over the turns"
    print_rows(title, CPU_HEAD, map(_cpu_line, rows))
    big = [r for r in rows if r.tokens >= 256]
    label = "median over >= 256 tokens" if big else "median over all sizes"
    shm = statistics.median(r.shm_vs_memcpy for r in big or rows)
    inplace = statistics.median(r.inplace_vs_memcpy for r in big or rows)
    grpc_ratio = statistics.median(r.grpc_vs_raw for r in big or rows)
    paired = statistics.median(r.grpc_vs_raw_paired for r in big or rows)
    cpu = statistics.median(r.grpc_vs_raw_cpu for r in big or rows)
    ip = statistics.median(r.grpc_inplace_vs_raw for r in big or rows)
    ip_paired = statistics.median(r.grpc_inplace_vs_raw_paired for r in big or rows)
    ip_cpu = statistics.median(r.grpc_inplace_vs_raw_cpu for r in big or rows)
    print(
        f"{label}: shm/memcpy {shm:.0%}, in place/memcpy {inplace:.0%} (target >= 50%), "
        f"grpc/raw grpc {grpc_ratio:.0%} (paired {paired:.0%}, CPU {cpu:.0%}), "
        f"grpc ip/raw grpc {ip:.0%} (paired {ip_paired:.0%}, CPU {ip_cpu:.0%}) (target >= 80%)"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--chunk-bytes", type=int, default=DEFAULT_MAX_CHUNK_BYTES)
    p.add_argument("--threads", type=int, default=1, help="torch threads in each process")
    p.add_argument("--checksum", choices=sorted(CHECKSUM_KINDS), default=DEFAULT_CHECKSUM)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=_exporter_main, args=(child, args.threads, args.chunk_bytes, args.checksum)
    )
    proc.start()
    try:
        port = parent.recv()
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")  # exports and releases
        # One transport for the whole run, as a worker keeps one (its channels stay open).
        grpc_transport = GrpcTransport(max_chunk_bytes=args.chunk_bytes)
        rows = [
            measure(t, args.repeats, args.chunk_bytes, args.checksum, channel, grpc_transport)
            for t in args.tokens
        ]
        grpc_transport.close()
        channel.close()
    finally:
        parent.send("stop")
        proc.join(timeout=10)
        if proc.is_alive():
            proc.terminate()
    print_table(rows, args.checksum)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "benchmark": "kvtransfer",
                    "config": {k: v for k, v in vars(args).items() if k != "json"},
                    "layout": {
                        "num_layers": NUM_LAYERS,
                        "num_kv_heads": NUM_KV_HEADS,
                        "head_dim": HEAD_DIM,
                        "block_size": BLOCK_SIZE,
                        "dtype": str(DTYPE),
                    },
                    "rows": [asdict(r) for r in rows],
                },
                f,
                indent=2,
            )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
