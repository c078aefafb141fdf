"""Decode attention over a paged KV cache: torch backend vs Triton kernel vs dense SDPA.

One decode step of one layer: B sequences, one new token each, every sequence with the
same context length (so the dense baseline has a contiguous [B, kv_heads, ctx, head_dim]
K/V to run `scaled_dot_product_attention` on). The paged backends read the same K/V from
a block pool through randomly permuted block tables, and their time includes writing the
B new tokens' K/V (what `forward` does every layer).

Reported per (batch, context, backend):
    ms/layer      median time of one call
    ms/step       ms/layer x --layers (30 = the default model, SmolLM2-135M): the
                  attention share of one decode step
    KV GB/s       KV bytes the step must read (B x ctx x kv_heads x head_dim x 2 (K, V)
                  x element size) / time
    % copy        that, as a share of the device's copy bandwidth measured in this run
                  (a device-to-device `copy_` of 1 GiB (CUDA) / 256 MiB (CPU), counted
                  as bytes read + bytes written)
    vs sdpa       dense SDPA time / this time (> 1: faster than the dense baseline)
    max err       relative error vs the dense SDPA output (a kernel that measures fast
                  but computes garbage shows here)

On CUDA every backend runs (times from `triton.testing.do_bench`, median, L2 flushed
between runs). On CPU the Triton kernel only runs in the interpreter, which is not a
measurement, so the default there is torch + sdpa over a small grid; `--backends triton`
forces the interpreter anyway (TRITON_INTERPRET=1 is set before triton is imported).

    python -m benchmarks.attention                      # device default grid
    python -m benchmarks.attention --batch 1 8 32 --context 128 512 1024 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from benchmarks.cli import print_rows
from pagedserve.common.core.attention.base import AttentionMetadata

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# Target from the issue: Triton decode at >= 70% of copy bandwidth at batch >= 32, ctx >= 1024.
TARGET_FRACTION = 0.70


@dataclass
class Row:
    batch: int
    context: int
    backend: str
    ms_per_layer: float
    ms_per_step: float
    kv_gbs: float
    frac_copy_bw: float
    vs_sdpa: float | None
    max_rel_err: float | None
    copies: int  # K/V copies rotated through (see DecodeCase)
    timing: str  # cudagraph | eager | wall


# ---- timing ---------------------------------------------------------------------------


def time_ms(
    fn: Callable[[], object], device: torch.device, eager: bool = False
) -> tuple[float, str]:
    """(median milliseconds of one call of fn, how it was timed).

    CUDA: replayed from a CUDA graph (`do_bench_cudagraph`), so host launch overhead is
    not counted: the figure is the GPU's. Eager `do_bench` (launch overhead included)
    with `eager`, or if fn cannot be captured. CPU: wall clock, median of >= 3 calls.
    """
    if device.type == "cuda":
        from triton.testing import do_bench, do_bench_cudagraph

        if eager:
            return float(do_bench(fn, warmup=25, rep=100, return_mode="median")), "eager"
        try:
            return float(do_bench_cudagraph(fn, rep=100, return_mode="median")), "cudagraph"
        except Exception as e:  # capture refused: time eagerly instead, and say so
            print(f"note: CUDA graph capture failed ({type(e).__name__}: {e}); timing eagerly")
            torch.cuda.synchronize()
            return float(do_bench(fn, warmup=25, rep=100, return_mode="median")), "eager"
    fn()  # warm-up (plans, allocator)
    samples: list[float] = []
    deadline = time.perf_counter() + 0.2
    while len(samples) < 3 or (time.perf_counter() < deadline and len(samples) < 200):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples), "wall"


def copy_bandwidth_gbs(device: torch.device) -> float:
    """Device-to-device copy bandwidth, bytes read + bytes written per second (GB/s)."""
    nbytes = (1 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    if device.type == "cuda":
        from triton.testing import do_bench

        ms = float(do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median"))
    else:
        ms, _ = time_ms(lambda: dst.copy_(src), device)
    return 2 * nbytes / (ms * 1e-3) / 1e9


# ---- one decode step -------------------------------------------------------------------


@dataclass
class DecodeCase:
    """One layer's decode step, with `copies` identical K/V stores to rotate through.

    A timed call runs the step once per copy, each copy at its own addresses, so that
    consecutive steps never find the previous one's K/V in the cache (L2 on a GPU, L3 on
    a CPU): like the engine, where each of the 30 layers reads its own K/V.
    """

    q: torch.Tensor  # [B, q_heads, head_dim]
    k_new: torch.Tensor  # [B, kv_heads, head_dim]
    v_new: torch.Tensor
    meta: AttentionMetadata
    caches: list[tuple[torch.Tensor, torch.Tensor]]  # k/v [num_blocks, bs, kv_heads, d]
    dense: list[tuple[torch.Tensor, torch.Tensor]]  # k/v [B, kv_heads, ctx, d], contiguous
    scale: float
    kv_bytes: int  # K and V bytes one step reads


def num_copies(kv_bytes: int, args: argparse.Namespace, device: torch.device) -> int:
    """Copies whose K/V together pass --rotate-mib, at most 64, within half the free memory."""
    copies = max(1, min(64, -(-(args.rotate_mib << 20) // kv_bytes)))
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        copies = max(1, min(copies, free // (2 * 2 * kv_bytes)))  # paged + dense per copy
    return copies


def make_case(batch: int, ctx: int, args: argparse.Namespace, device: torch.device) -> DecodeCase:
    dtype, bs = DTYPES[args.dtype], args.block_size
    kvh, hq, d = args.kv_heads, args.q_heads, args.head_dim
    seed = batch * 7919 + ctx
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = -(-ctx // bs)
    num_blocks = batch * blocks_per_seq + 1
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    tables = perm[: batch * blocks_per_seq].view(batch, blocks_per_seq).to(torch.int32)
    tables = tables.to(device)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=dtype)

    # Dense K/V first (the new token's already at position ctx - 1), scattered into blocks.
    k_dense, v_dense = randn(batch, kvh, ctx, d), randn(batch, kvh, ctx, d)
    k_cache, v_cache = randn(num_blocks, bs, kvh, d), randn(num_blocks, bs, kvh, d)
    pos = torch.arange(ctx, device=device)
    slots = tables[:, pos // bs].long() * bs + pos % bs  # [B, ctx]
    k_cache.view(-1, kvh, d)[slots.reshape(-1)] = k_dense.transpose(1, 2).reshape(-1, kvh, d)
    v_cache.view(-1, kvh, d)[slots.reshape(-1)] = v_dense.transpose(1, 2).reshape(-1, kvh, d)

    meta = AttentionMetadata(
        slot_mapping=slots[:, -1].contiguous(),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device=device),
        block_tables=tables,
        num_prefills=0,
        num_prefill_tokens=0,
        num_decode_tokens=batch,
        max_query_len=1,
        max_seq_len=ctx,
        query_lens_cpu=[1] * batch,
        seq_lens_cpu=[ctx] * batch,
    )
    kv_bytes = 2 * batch * ctx * kvh * d * k_cache.element_size()
    copies = num_copies(kv_bytes, args, device)
    return DecodeCase(
        q=randn(batch, hq, d),
        k_new=k_dense[:, :, -1].contiguous(),
        v_new=v_dense[:, :, -1].contiguous(),
        meta=meta,
        caches=[(k_cache, v_cache)]
        + [(k_cache.clone(), v_cache.clone()) for _ in range(copies - 1)],
        dense=[(k_dense, v_dense)]
        + [(k_dense.clone(), v_dense.clone()) for _ in range(copies - 1)],
        scale=d**-0.5,
        kv_bytes=kv_bytes,
    )


def sdpa_fn(case: DecodeCase, copies: int) -> Callable[[], torch.Tensor]:
    q4 = case.q[:, :, None, :]  # [B, q_heads, 1, d]

    def run() -> torch.Tensor:
        for k, v in case.dense[:copies]:
            o = F.scaled_dot_product_attention(q4, k, v, scale=case.scale, enable_gqa=True)
        return o[:, :, 0, :]

    return run


def backend_fn(backend, case: DecodeCase, copies: int) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        for k_cache, v_cache in case.caches[:copies]:
            o = backend.forward(
                case.q, case.k_new, case.v_new, k_cache, v_cache, case.meta, case.scale
            )
        return o

    return run


def load_backends(names: list[str], device: torch.device) -> dict[str, object]:
    backends: dict[str, object] = {}
    if "torch" in names:
        from pagedserve.common.core.attention.torch_backend import TorchAttentionBackend

        backends["torch"] = TorchAttentionBackend()
    if "triton" in names:
        if device.type == "cpu":
            os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import
        from pagedserve.common.core.attention.triton_backend import TritonAttentionBackend

        backends["triton"] = TritonAttentionBackend()
    return backends


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def bench_point(
    batch: int, ctx: int, args: argparse.Namespace, device: torch.device, backends: dict,
    copy_gbs: float,
) -> list[Row]:  # fmt: skip
    case = make_case(batch, ctx, args, device)
    copies = len(case.caches)
    ref = sdpa_fn(case, 1)()
    fns = {"sdpa": sdpa_fn(case, copies)}
    fns.update({name: backend_fn(b, case, copies) for name, b in backends.items()})
    timed = {
        name: time_ms(fn, device, args.eager) for name, fn in fns.items() if name in args.backends
    }
    times = {name: ms / copies for name, (ms, _) in timed.items()}
    rows = []
    for name, ms in times.items():
        err = None if name == "sdpa" else rel_err(backend_fn(backends[name], case, 1)(), ref)
        gbs = case.kv_bytes / (ms * 1e-3) / 1e9
        vs = times["sdpa"] / ms if "sdpa" in times else None
        rows.append(
            Row(batch, ctx, name, ms, ms * args.layers, gbs, gbs / copy_gbs, vs, err,
                copies, timed[name][1])
        )  # fmt: skip
    return rows


# ---- report ---------------------------------------------------------------------------


TABLE_HEAD = (
    f"{'batch':>5} {'ctx':>5} {'backend':>7} {'ms/layer':>9} {'ms/step':>9} "
    f"{'KV GB/s':>8} {'% copy':>7} {'vs sdpa':>8} {'max err':>8} {'copies':>6} timing"
)


def print_table(rows: list[Row], layers: int) -> None:
    print_rows(f"(ms/step = ms/layer x {layers} layers)", TABLE_HEAD, map(_row_line, rows))


def _row_line(r: Row) -> str:
    vs = f"{r.vs_sdpa:7.2f}x" if r.vs_sdpa is not None else f"{'-':>8}"
    err = f"{r.max_rel_err:8.1e}" if r.max_rel_err is not None else f"{'-':>8}"
    return (
        f"{r.batch:>5} {r.context:>5} {r.backend:>7} {r.ms_per_layer:9.3f} "
        f"{r.ms_per_step:9.2f} {r.kv_gbs:8.1f} {100 * r.frac_copy_bw:6.1f}% {vs} {err} "
        f"{r.copies:>6} {r.timing}"
    )


def target_summary(rows: list[Row]) -> str | None:
    """The issue's GPU target: triton >= 70% of copy bandwidth at batch >= 32, ctx >= 1024."""
    hits = [r for r in rows if r.backend == "triton" and r.batch >= 32 and r.context >= 1024]
    if not hits:
        return None
    worst = min(hits, key=lambda r: r.frac_copy_bw)
    ok = "met" if worst.frac_copy_bw >= TARGET_FRACTION else "NOT met"
    return (
        f"target (triton >= {TARGET_FRACTION:.0%} of copy bandwidth at batch >= 32, ctx >= 1024):"
        f" {ok}; worst {worst.frac_copy_bw:.1%} at batch {worst.batch}, ctx {worst.context}"
    )


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device: torch.device) -> dict:
    info = {
        "device": str(device),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        import triton

        info["triton"] = triton.__version__
    return info


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--batch", type=int, nargs="+", help="default 1 8 32 64 (cuda), 1 8 32 (cpu)")
    p.add_argument(
        "--context",
        type=int,
        nargs="+",
        help="default 128 512 1024 2048 4096 (cuda), 128 512 (cpu)",
    )
    p.add_argument("--backends", nargs="+", choices=["torch", "triton", "sdpa"])
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default fp16 (cuda), fp32 (cpu)")
    p.add_argument("--block-size", type=int, default=16)
    # The default model (SmolLM2-135M): 9 query heads over 3 KV heads, head_dim 64, 30 layers.
    p.add_argument("--q-heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument(
        "--rotate-mib", type=int, default=256,
        help="rotate through K/V copies totalling at least this much (cache-cold reads)",
    )  # fmt: skip
    p.add_argument("--eager", action="store_true", help="CUDA: time eagerly, not from a graph")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    on_gpu = args.device.startswith("cuda")
    args.batch = args.batch or ([1, 8, 32, 64] if on_gpu else [1, 8, 32])
    args.context = args.context or ([128, 512, 1024, 2048, 4096] if on_gpu else [128, 512])
    args.backends = args.backends or (["torch", "triton", "sdpa"] if on_gpu else ["torch", "sdpa"])
    args.dtype = args.dtype or ("fp16" if on_gpu else "fp32")
    if args.q_heads % args.kv_heads:
        p.error(f"--q-heads {args.q_heads} is not a multiple of --kv-heads {args.kv_heads}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    backends = load_backends(args.backends, device)
    copy_gbs = copy_bandwidth_gbs(device)
    print(f"device {device} ({machine(device).get('gpu') or cpu_name()}), {args.dtype}, "
          f"q_heads {args.q_heads}, kv_heads {args.kv_heads}, head_dim {args.head_dim}, "
          f"block_size {args.block_size}; copy bandwidth {copy_gbs:.1f} GB/s")  # fmt: skip
    if device.type == "cpu" and "triton" in backends:
        print("note: triton on CPU runs in the interpreter; its times are not a measurement")
        args.rotate_mib = 0  # one K/V copy: the interpreter is slow enough as it is
    rows: list[Row] = []
    for batch in args.batch:
        for ctx in args.context:
            rows += bench_point(batch, ctx, args, device, backends, copy_gbs)
    print_table(rows, args.layers)
    summary = target_summary(rows)
    if summary:
        print(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "benchmark": "attention",
                    "machine": machine(device),
                    "config": {k: v for k, v in vars(args).items() if k != "json"},
                    "copy_bandwidth_gbs": copy_gbs,
                    "target": summary,
                    "results": [asdict(r) for r in rows],
                },
                f,
                indent=2,
            )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
