"""fp32 GEMM rates per backend on SmolLM2-135M's weight shapes (what `fp32_gemm` chooses
between at load), GFLOP/s, best of `--repeat` interleaved calls on a hot weight:

    python -m benchmarks.fp32_gemm                       # 2 threads, 1/16/64/256/512 rows
    python -m benchmarks.fp32_gemm --threads 1 --repeat 50

Each backend's form is built by `fp32_gemm.pack` and called as `model._mm` calls it for
more than one row (at one row `_mm` always takes plain `x @ w`).
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.cli import print_rows
from pagedserve.common.core import fp32_gemm

# SmolLM2-135M: hidden 576, 9 q / 3 kv heads of 64, MLP 1536, vocab 49152
SHAPES = {
    "qkv": (576, 960),
    "o_proj": (576, 576),
    "gate_up": (576, 3072),
    "down": (1536, 576),
    "lm_head": (576, 49152),
}
HEAD_MAX_ROWS = 64  # the LM head runs only on sampled rows


def rates(k: int, n: int, rows: list[int], backends: tuple[str, ...], repeat: int) -> list[str]:
    w = torch.randn(k, n)
    runs = {b: fp32_gemm._runner(w, fp32_gemm.pack(w, b)) for b in backends}
    cells = []
    for r in rows:
        x = torch.randn(r, k)
        best = dict.fromkeys(backends, float("inf"))
        for run in runs.values():
            run(x)
        for i in range(repeat):
            for b in backends[i % len(backends) :] + backends[: i % len(backends)]:
                t0 = time.perf_counter()
                runs[b](x)
                best[b] = min(best[b], time.perf_counter() - t0)
        cells.append(" / ".join(f"{2 * r * k * n / best[b] / 1e9:.0f}" for b in backends))
    return cells


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256, 512])
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    backends = fp32_gemm.available_backends()
    lines = []
    for name, (k, n) in SHAPES.items():
        rows = [r for r in args.rows if name != "lm_head" or r <= HEAD_MAX_ROWS]
        cells = rates(k, n, rows, backends, args.repeat)
        lines.append(
            f"{name + f' {k}x{n}':<18} "
            + "  ".join(f"{r}: {c}" for r, c in zip(rows, cells, strict=True))
        )
    print_rows(
        f"GFLOP/s, {' / '.join(backends)}, {args.threads} threads, best of {args.repeat}",
        f"{'weight':<18} rows: rates",
        lines,
    )


if __name__ == "__main__":
    main()
