"""Compile the Triton paged-attention kernels for a GPU architecture, without a GPU.

The interpreter (TRITON_INTERPRET=1) is lenient where a GPU is not (ENV.md): `tl.dot`
under 16, types a GPU lowering rejects, shared memory a card does not have. This runs the
real compiler down to a cubin (Triton's bundled ptxas) for each launch configuration the
launchers can pick, and reports the shared memory each kernel needs against the
architecture's per-block limit. It must run with TRITON_INTERPRET unset (it removes it
before importing triton).

    python -m benchmarks.triton_compile                    # sm_90 (H100/H200), all configs
    python -m benchmarks.triton_compile --arch 80 86 --dtype fp16 --json out.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from dataclasses import asdict, dataclass

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from benchmarks.cli import print_rows
from pagedserve.common.core.attention import triton_decode, triton_prefill  # noqa: E402
from pagedserve.common.core.attention.triton_common import PagedShape, default_tile  # noqa: E402

# Shared memory one block may use (opt-in maximum), bytes, by compute capability.
SMEM_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# (group, block_size, head_dim): the default model (9 over 3, head_dim 64), MHA with a
# large head, a non-power-of-two head_dim, and the largest head_dim the kernels accept.
SHAPES = [(3, 16, 64), (1, 8, 128), (4, 32, 40), (8, 16, 256)]


@dataclass
class Result:
    arch: int
    kernel: str
    dtype: str
    group: int
    block_size: int
    head_dim: int
    tile: int
    shared_bytes: int
    limit_bytes: int
    ok: bool
    seconds: float


def _signature(fn, pointers: dict[str, str], floats: set[str], consts: dict) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        else:
            sig[name] = "fp32" if name in floats else "i32"
    return sig


def _compile(fn, arch: int, pointers: dict, floats: set, consts: dict, num_warps: int):
    src = triton.compiler.ASTSource(
        fn=fn, signature=_signature(fn, pointers, floats, consts), constexprs=consts
    )
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})


def compile_configs(arch: int, dtype: str, group: int, block_size: int, head_dim: int):
    """Yield (kernel name, tile, compiled kernel) for decode, merge and prefill, with the
    constexprs and warps the launchers pick for this shape and dtype."""
    shape = PagedShape(group, 1, head_dim, block_size)  # one KV head: the group's q heads
    tile = default_tile(shape, TORCH_DTYPES[dtype])
    io = {n: f"*{dtype}" for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
    ints = {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32"}
    parts = {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"}
    scale = {"scale_log2"}
    decode = triton_decode.decode_constexprs(shape, TORCH_DTYPES[dtype], tile, split=True)
    yield (
        "decode",
        tile,
        _compile(triton_decode._paged_decode_kernel, arch, io | ints | parts, scale, decode,
                 triton_decode.DECODE_NUM_WARPS),
    )  # fmt: skip
    merge = triton_decode.merge_constexprs(shape, triton_decode.MAX_SPLITS)
    yield (
        "merge",
        merge["SPLITS_PAD"],
        _compile(triton_decode._merge_splits_kernel, arch, parts | io, set(), merge,
                 triton_decode.MERGE_NUM_WARPS),
    )  # fmt: skip
    prefill = triton_prefill.prefill_constexprs(shape, TORCH_DTYPES[dtype], tile, tile)
    yield (
        "prefill",
        tile,
        _compile(triton_prefill._paged_prefill_kernel, arch, io | ints, scale, prefill,
                 triton_prefill.PREFILL_NUM_WARPS),
    )  # fmt: skip


def run(archs: list[int], dtypes: list[str], shapes: list[tuple[int, int, int]]) -> list[Result]:
    results = []
    for arch, dtype, (group, bs, hd) in itertools.product(archs, dtypes, shapes):
        t0 = time.perf_counter()
        for name, tile, kernel in compile_configs(arch, dtype, group, bs, hd):
            smem = int(kernel.metadata.shared)
            limit = SMEM_LIMIT.get(arch, 99 * 1024)
            results.append(
                Result(arch, name, dtype, group, bs, hd, tile, smem, limit, smem <= limit,
                       time.perf_counter() - t0)
            )  # fmt: skip
            t0 = time.perf_counter()
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, nargs="+", default=[90], help="compute capabilities")
    p.add_argument("--dtype", nargs="+", choices=sorted(TORCH_DTYPES), default=["fp16", "bf16"])
    p.add_argument("--shape", nargs=3, type=int, action="append", metavar=("GROUP", "BS", "HD"))
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    results = run(args.arch, args.dtype, [tuple(s) for s in args.shape] if args.shape else SHAPES)
    head = f"{'arch':>4} {'kernel':>7} {'dtype':>5} {'group':>5} {'bs':>3} {'hd':>4} {'tile':>4} {'smem KiB':>9} {'limit':>6}  ok"
    print_rows(
        None,
        head,
        (
            f"sm{r.arch:<2} {r.kernel:>7} {r.dtype:>5} {r.group:>5} {r.block_size:>3} "
            f"{r.head_dim:>4} {r.tile:>4} {r.shared_bytes / 1024:9.1f} {r.limit_bytes // 1024:6}"
            f"  {'yes' if r.ok else 'NO'}"
            for r in results
        ),
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
