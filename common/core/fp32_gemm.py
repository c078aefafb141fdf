"""Which GEMM runs each fp32 weight on the CPU: chosen by measuring at load.

Backends (what `model._mm` runs for more than one row; one row is always `x @ w`):

    "mkl"     MKL's packed GEMM over a copy packed once at load (`mkl_pack`)
    "onednn"  oneDNN's matmul over a copy reordered once at load (torch.ops.mkldnn)
    "plain"   `x @ w`: MKL's sgemm on the [in, out] weight itself; no copy, and
              bit-identical to transformers' `F.linear`

Why measure: the faster one depends on the CPU, by up to 2x either way. On a Skylake-SP
Xeon MKL's packed GEMM ran 8-25 % faster than oneDNN's prepacked matmul at 4-2048 rows
(mkl_pack.py has the table), so it was the fixed choice from 2026-12-02; on AMD EPYCs
(Zen 4 / Zen 5, avx512_bf16, no AMX) MKL's fp32 GEMM runs at about half of oneDNN's
rate (benchmarks/NOTES.md, "fp32 GEMM chosen at load"), which left fp32 engine64 at
0.47x vLLM there. A choice made on one CPU is wrong on the other, so `choose` times the
candidates on this CPU, on the model's own weights, when the model is packed.

How (`choose`): one weight per role (`qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj`
of layer 0, and the LM head): every layer has the same shapes, so one layer stands for
all 30. The candidates are the packed backends ("mkl", "onednn"; `auto_candidates` says
why not "plain"). Each gets its own packed copy of that weight, and is timed at the row
counts the engine runs it at: decode-sized and prefill-sized batches (`LAYER_ROWS`), the
LM head at decode sizes only (`HEAD_ROWS`: logits are computed only for sampled rows),
at torch's current thread count (the engine sets it before loading). Backends take
turns within each round (so a neighbour's burst of load hits them all), and each
keeps its best time over the rounds (`time_backends`: at least `MIN_ROUNDS`, more
while the cell's time budget lasts). The score of a backend is the geometric mean over
row counts of its time over the best time at that row count (1.0: fastest everywhere);
`pick` takes the lowest, except that a backend earlier in `PREFERENCE` within `TIE` of
it wins instead: close calls resolve the same way every time, towards no copy and
bit-parity ("plain") and then torch's own oneDNN. The timed weight is hot in cache,
where the model streams 30 layers' weights through it: a simplification, accepted
since the choice matters where the backends differ by far more (2x on AMD EPYCs) than
cache residency moves them, and the tie band absorbs the close calls.
The outcome is cached per (shape, rows, threads, candidates) for the process, so the
engines of one process (tests, benchmarks) choose alike and measure once. Cost: 1.6 s
for SmolLM2-135M on 2 threads of a shared Zen 4 EPYC (2.5 s in busier minutes; the LM
head's cells are half of it), a few ms on the tiny test models; `choose` logs one line
with every shape's choice and times.

Override (`resolve_mode`): EngineConfig.fp32_gemm (`--fp32-gemm`) or, where that is
not given, $PAGEDSERVE_FP32_GEMM: "auto" (measure; the default) or a backend name for
every weight. `PAGEDSERVE_PREPACK=0` still turns all packing off ("plain" everywhere),
and `PAGEDSERVE_MKL_PACK=0` removes "mkl" from the candidates.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from pagedserve.common.core import mkl_pack

log = logging.getLogger(__name__)

BACKENDS = ("mkl", "onednn", "plain")
MODES = ("auto", *BACKENDS)
MODE_ENV = "PAGEDSERVE_FP32_GEMM"

# Close calls (scores within TIE of the best) go to the earliest of these: "plain"
# needs no second copy of the weights and matches transformers bit for bit; oneDNN is
# torch's own path (the one bf16 takes too).
PREFERENCE = ("plain", "onednn", "mkl")
TIE = 0.05

# Row counts timed: decode batches (16, 64 running sequences) and a prefill chunk (256
# tokens; chunks run up to the 2048-token budget, at about the same rate from 256 rows
# up); the LM head sees only sampled rows.
LAYER_ROWS = (16, 64, 256)
HEAD_ROWS = (16, 64)

# Per (weight, row count): at least MIN_ROUNDS rounds (one call per backend each), more
# while CELL_BUDGET_S lasts, at most MAX_ROUNDS. ~20 cells for a model: 14 ms-sized
# ones and the LM head's, which take their MIN_ROUNDS and no more.
MIN_ROUNDS = 3
MAX_ROUNDS = 20
CELL_BUDGET_S = 0.03

# backend -> rows -> best seconds per call
Times = dict[str, dict[int, float]]
Measure = Callable[[torch.Tensor, Sequence[int], Sequence[str]], Times]


def resolve_mode(mode: str | None) -> str:
    """The mode in force: `mode` when given, else $PAGEDSERVE_FP32_GEMM, else "auto"."""
    mode = mode if mode is not None else os.environ.get(MODE_ENV, "auto")
    if mode not in MODES:
        raise ValueError(f"fp32 GEMM must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def onednn_available() -> bool:
    """Whether this torch can reorder fp32 weights for oneDNN's matmul."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def available_backends() -> tuple[str, ...]:
    """The backends this torch can run, in BACKENDS order ("plain" always)."""
    ok = {"mkl": mkl_pack.available(), "onednn": onednn_available(), "plain": True}
    return tuple(b for b in BACKENDS if ok[b])


def auto_candidates() -> tuple[str, ...]:
    """What "auto" measures: the packed backends available here, or "plain" alone
    where there is none. "plain" is MKL's own sgemm packing the weight on every call,
    i.e. the "mkl" backend with more work (never faster than both beyond noise in the
    table of benchmarks/NOTES.md): timing it would cost a third more load time and add
    a third chance for a noisy measurement to pick wrong. Forced, it still runs."""
    return tuple(b for b in available_backends() if b != "plain") or ("plain",)


def pack(w: torch.Tensor, backend: str) -> torch.Tensor | mkl_pack.PackedMatrix | None:
    """w [in, out] in `backend`'s form for `model._mm`: an MKL-packed copy, a oneDNN
    reordered copy, or None ("plain": `_mm` multiplies by w itself)."""
    if backend == "mkl":
        return mkl_pack.PackedMatrix(w)
    if backend == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(w.t().contiguous(), None)
    if backend == "plain":
        return None
    raise ValueError(f"unknown fp32 GEMM backend {backend!r}")


def _runner(
    w: torch.Tensor, packed: torch.Tensor | mkl_pack.PackedMatrix | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> x @ w through `packed` as `model._mm` does for more than one row."""
    if packed is None:
        return lambda x: x @ w
    if isinstance(packed, mkl_pack.PackedMatrix):
        return packed.mm
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [None], "")


def time_backends(
    w: torch.Tensor,
    rows: Sequence[int],
    backends: Sequence[str],
    clock: Callable[[], float] = time.perf_counter,
) -> Times:
    """Best seconds per call of x [r, in] @ w for each backend and row count r.

    Backends take turns in each round, the first one rotating, after one warm-up call
    each (a first call allocates and, for oneDNN, builds its kernel)."""
    runs = {b: _runner(w, pack(w, b)) for b in backends}
    gen = torch.Generator().manual_seed(0)
    times: Times = {b: {} for b in backends}
    for r in rows:
        x = torch.randn(r, w.shape[0], generator=gen, dtype=w.dtype)
        for run in runs.values():
            run(x)
        best = dict.fromkeys(backends, math.inf)
        start = clock()
        rounds = 0
        while rounds < MIN_ROUNDS or (rounds < MAX_ROUNDS and clock() - start < CELL_BUDGET_S):
            i = rounds % len(backends)
            for b in (*backends[i:], *backends[:i]):
                t0 = clock()
                runs[b](x)
                best[b] = min(best[b], clock() - t0)
            rounds += 1
        for b in backends:
            times[b][r] = best[b]
    return times


def scores(times: Mapping[str, Mapping[int, float]]) -> dict[str, float]:
    """Each backend's geometric mean, over row counts, of its time over the best
    backend's time at that row count (1.0 = fastest at every row count)."""
    rows = next(iter(times.values())).keys()
    best = {r: min(t[r] for t in times.values()) for r in rows}
    return {
        b: math.exp(sum(math.log(t[r] / best[r]) for r in rows) / len(rows))
        for b, t in times.items()
    }


def pick(times: Mapping[str, Mapping[int, float]]) -> str:
    """The backend to use: the lowest score, or the first backend in PREFERENCE whose
    score is within TIE of it (so that close calls do not flap between loads)."""
    s = scores(times)
    low = min(s.values())
    return next(b for b in (*PREFERENCE, *s) if b in s and s[b] <= low * (1 + TIE))


@dataclass(frozen=True)
class Choice:
    """One weight role's backend, and the times (ms per call) it was chosen on."""

    role: str
    shape: tuple[int, int]  # [in, out]
    backend: str
    times: Mapping[str, Mapping[int, float]]  # backend -> rows -> seconds; {} when forced

    def describe(self) -> str:
        k, n = self.shape
        if not self.times:
            return f"{self.role} {k}x{n} {self.backend}"
        rows = "/".join(str(r) for r in next(iter(self.times.values())))
        ms = ", ".join(
            f"{b} " + "/".join(f"{1e3 * s:.3g}" for s in t.values()) for b, t in self.times.items()
        )
        return f"{self.role} {k}x{n} {self.backend} (ms at {rows} rows: {ms})"


# (in, out, rows, threads, candidates) -> times, for the process
_measured: dict[tuple, Times] = {}


def choose(
    weights: Mapping[str, tuple[torch.Tensor, Sequence[int]]],
    backends: Sequence[str] | None = None,
    measure: Measure | None = None,
) -> dict[str, Choice]:
    """role -> Choice for each role's (weight [in, out], row counts to time at).

    `backends`: the candidates (default: `auto_candidates()`). `measure` replaces
    the timing (`time_backends`) and its cache, for tests. Logs one line."""
    backends = tuple(backends or auto_candidates())
    t0 = time.perf_counter()
    out: dict[str, Choice] = {}
    for role, (w, rows) in weights.items():
        if len(backends) == 1:
            times: Times = {}
        elif measure is not None:
            times = measure(w, rows, backends)
        else:
            key = (*w.shape, tuple(rows), torch.get_num_threads(), backends)
            if key not in _measured:
                _measured[key] = time_backends(w, rows, backends)
            times = _measured[key]
        backend = pick(times) if times else backends[0]
        out[role] = Choice(role, (w.shape[0], w.shape[1]), backend, times)
    log.info(
        "fp32 GEMM per weight, measured on %d threads in %.2f s: %s",
        torch.get_num_threads(),
        time.perf_counter() - t0,
        "; ".join(c.describe() for c in out.values()),
    )
    return out


def forced(
    weights: Mapping[str, tuple[torch.Tensor, Sequence[int]]], backend: str
) -> dict[str, Choice]:
    """role -> Choice of `backend` for every role (a forced mode); refuses a backend
    this torch cannot run. Logs one line."""
    if backend not in available_backends():
        raise ValueError(
            f"fp32 GEMM {backend!r} is not available here (available: "
            f"{', '.join(available_backends())}; {mkl_pack.__name__}.available() covers mkl)"
        )
    out = {
        role: Choice(role, (w.shape[0], w.shape[1]), backend, {})
        for role, (w, _) in weights.items()
    }
    log.info("fp32 GEMM %s for every weight (forced)", backend)
    return out
