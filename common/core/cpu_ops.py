"""Fused single-pass CPU kernels (cpu_ops.c) for the decoder's small ops, bf16 and fp32.

Why: in bf16 each of these ops is several aten ops that each make a pass over the
activations and most write an fp32 temporary: RMSNorm is float(), pow, mean, add,
rsqrt, mul, to(bf16), mul; SiLU-and-mul two passes over a strided view (and the
prepacked down matmul then copies that view); RoPE three products, a subtraction and
an addition. Each kernel here reads its inputs once,
computes in fp32 and writes bf16 once; the residual add is fused with the RMSNorm
that follows it (the sum is written back over the layer output `y`, the normalized
rows into a new tensor), and Qwen3's per-head q/k RMSNorm with RoPE (in place in the
qkv matmul's output).

Measured on a 2-core EPYC Zen 4 (avx512_bf16, no AMX), SmolLM2-135M shapes, min of
200 calls (wrapper included), torch ops -> fused, microseconds, 2 threads:
  tokens   add + RMSNorm   SiLU-and-mul [T, 1536]   RoPE [T, 12, 64]
     1       19 -> 10          7.5 -> 6.6               23 -> 13
     8       23 -> 12           15 -> 13                26 -> 15
    64       44 -> 20           54 -> 37                54 -> 21
   512      187 -> 93          368 -> 263              175 -> 78
(1 thread: 64 tokens 48 -> 29, 80 -> 65, 57 -> 29; SiLU is bound by exp and the
division, which torch computes the same way.) Per forward that is about 3 ms of a
~125 ms batch-64 decode step and ~12 ms of a ~430 ms 512-token prefill: 2-3%, far
less than `decode_step --profile` suggests (16 and 55 ms there), because the
profiler's per-op cost inflates exactly these many small aten ops. End to end
(`decode_step --fused on off`, `engine_throughput --fused on off`) the difference
was within the noise of the shared machine when first measured (load average 2-7);
on the quiet machine later (2026-12-01, 2 threads, median ms per decode step, on /
off): batch 1 33.3 / 38.2, batch 4 34.6 / 34.1, batch 8 36.5 / 36.8, batch 64 108.9
/ 109.2 -- neutral from batch 4 up, ~13% at batch 1. Kept on: never slower, and fewer
passes over the activations.

Numerics: every bf16 rounding happens where transformers' bf16 forward (and this
model's torch path) rounds, so results are bit-identical except where the fp32 sum
of squares of an RMSNorm (summed in another order than torch's) or SiLU's exp
(a polynomial within ~1 fp32 ulp of torch's) moves a value across a bf16 rounding
boundary: then it differs by one bf16 ulp (counts in tests/test_cpu_ops.py).

fp32 too (2026-12-02, measured on a 2-core Skylake-SP Xeon). Measured before: in this torch (2.13, CPU) `F.rms_norm` in
fp32 is not one kernel but a composite of ~10 aten ops (pow, sum, div_, add_, rsqrt,
mul, mul, type_as, ...: 56 us for one 576-wide row here, nearly all dispatch), the
residual add another op, SiLU-and-mul two strided passes plus the copy that the
prepacked down matmul makes of the strided result, RoPE three products, a subtraction
and an addition. In-process, alternating, 1 thread, min us, torch -> fused (wrapper
included), SmolLM2-135M shapes (`FP32_NUMBERS` below for the command):
  tokens   RMSNorm        add + RMSNorm   SiLU-and-mul (+ copy)   RoPE q+k [T, 12, 64]
     1       56 -> 27        50 -> 25          43 -> 27               97 -> 42
    64      148 -> 56       140 -> 59         304 -> 167             218 -> 77
   512      831 -> 232     1105 -> 331       2599 -> 969            1269 -> 274
  2048     4292 -> 1211    5278 -> 1710     11238 -> 4708           6375 -> 1294
The fp32 kernels are the bf16 ones without the roundings to bf16, in torch's order of
operations: RoPE and the residual add are bit-identical to torch; RMSNorm sums its
squares in double (torch: rounded squares in fp32, blocked), so a row's mean may
differ in its last bit or two and every normalized value of that row with it (at
most 4 ulps measured); SiLU's exp is the Cephes polynomial (at most 4 ulps from
torch's SiLU, which matches neither x / (1 + exp(-x)) nor x * sigmoid(x) computed
with torch's own ops bit for bit). That is below the ~1e-6 relative by which the
prepacked fp32 matmuls (model.can_prepack) already differ from transformers' MKL
ones, and every token-exact fp32 test against transformers (tests/test_model.py,
test_engine.py, test_dtype.py) passes with these ops on. `PAGEDSERVE_CPU_OPS=0`
(with `PAGEDSERVE_PREPACK=0`) gives bit-identical fp32 logits to transformers back.

Build and fallback as for the attention kernel (`attention/cpu_kernel.py`, shared
build code in `cbuild.py`): built with gcc on first use, cached per source,
compiler and CPU; when it cannot be built or loaded, or `PAGEDSERVE_CPU_OPS=0`,
`load()` returns None once (logged: INFO when switched off, WARNING otherwise) and
the model uses its torch ops. The kernels run on torch's OpenMP threads with
`torch.get_num_threads()`; small calls stay on the calling thread (see the C file).

The wrappers check dtypes and layouts (a few attribute reads per call, against
~90-120 calls per forward) and raise ValueError rather than let C read out of bounds.

FP32_NUMBERS: the fp32 table above came from an in-process script timing each torch
formula of model.py against its wrapper here, alternating, 300 rounds, on the
shared 2-core Skylake-SP Xeon (avx512f, no avx512_bf16, no AMX; load average 1.5-3
from other work; medians 1.5-2x the minima).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from pagedserve.common.core import cbuild

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_ops.c")
_FLAGS = (
    "-O3",
    "-march=native",
    "-mprefer-vector-width=512",
    "-fno-math-errno",
    "-ffp-contract=off",  # no FMA across a rounding torch does (see the C file)
    "-fopenmp",
    "-fPIC",
    "-shared",
)
_ENV_SWITCH = "PAGEDSERVE_CPU_OPS"
# the C entry points' name suffix per dtype
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the argument types of a built library's entry points; returns it, with
    `lib.pagedserve_ops`: {(op name, dtype): entry point}."""
    i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    signatures = {
        "rms_norm": [ptr, i64, ptr, ptr, i64, i64, i64, f32, i32],
        "add_rms_norm": [ptr, ptr, ptr, ptr, ptr, i64, i64, f32, i32],
        "silu_and_mul": [ptr, i64, ptr, i64, i64, i32],
        "rope": [ptr, i64, i64, i64, i64, ptr, ptr, i64, ptr, f32, i32],
    }
    entries = {}
    for name, args in signatures.items():
        for dtype, suffix in _SUFFIX.items():
            fn = getattr(lib, f"pagedserve_{name}_{suffix}")
            fn.argtypes = args
            fn.restype = None
            entries[name, dtype] = fn
    lib.pagedserve_ops = entries
    return lib


@functools.cache
def load() -> ctypes.CDLL | None:
    """The built library, or None (logged once) when it cannot be had here."""
    lib = cbuild.load_or_none(
        _SOURCE, _FLAGS, _ENV_SWITCH, "fused CPU ops", "torch's ops (slower)", log
    )
    return None if lib is None else bind(lib)


# The checks below run on every call (~120 per forward), so each is a fast predicate
# (`_rows`, `_vector`: a few attribute reads, ~4 us a tensor on a 2-core Skylake-SP
# Xeon where a wrapper with the descriptive checks run each time cost 68 us at one token against
# 8 us for the C call itself); only when one fails does `_refuse` work out what is
# wrong and raise ValueError. They are what keeps C from reading out of bounds.
# Since 2026-12-02 the wrappers write the predicate out inline with the cheapest
# accessors (same Xeon, per call: `.ndim`/`.dtype`/`.is_cpu` 0.15-0.25 us,
# `is_contiguous()` 0.5, one `shape` or `stride()` tuple ~1, where `stride(i)` alone is
# ~1 and `device.type` 1.8): 16-31 -> 14-19 us a call at one row (medians, a quiet
# minute), RoPE the most (its two reshapes are skipped for contiguous tables). What
# they accept and refuse is unchanged.


def _rows(t: torch.Tensor, width: int, dtype: torch.dtype) -> bool:
    """t: a `dtype` CPU tensor [rows, width] with contiguous rows."""
    return (
        t.dtype is dtype and t.is_cpu and t.dim() == 2 and t.shape[1] == width and t.stride(1) == 1
    )


def _vector(t: torch.Tensor, n: int, dtype: torch.dtype) -> bool:
    """t: a contiguous `dtype` CPU tensor [n]."""
    return t.dtype is dtype and t.is_cpu and t.dim() == 1 and t.shape[0] == n and t.is_contiguous()


def _refuse(op: str, tensors: dict[str, tuple[torch.Tensor, int]], dtype: torch.dtype) -> None:
    """Raise ValueError naming the first of `tensors` ({name: (tensor, row width)}; a
    weight is checked as one row) that is not a `dtype` [rows, width] CPU tensor with
    contiguous rows, or the dtype when the op has none for it. Returns when all are
    fine: the caller raises for its own further conditions."""
    if dtype not in _SUFFIX:
        raise ValueError(f"{op}: bf16 or fp32 CPU tensors only, got {dtype}")
    for name, (t, width) in tensors.items():
        if t.device.type != "cpu" or t.dtype not in _SUFFIX:
            raise ValueError(
                f"{op} {name}: bf16 or fp32 CPU tensors only, got {t.dtype} on {t.device}"
            )
        if t.dtype != dtype:
            raise ValueError(f"{op} {name}: {t.dtype}, but the op runs in {dtype}")
        rows = t.view(1, -1) if t.dim() == 1 and t.is_contiguous() else t
        if rows.dim() != 2 or rows.shape[1] != width or rows.stride(1) != 1:
            raise ValueError(
                f"{op} {name}: expected [rows, {width}] with contiguous rows, "
                f"got shape {tuple(t.shape)} strides {t.stride()}"
            )


def rms_norm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)) over the last dim of x [T, N] (bf16: the
    normalized value rounded to bf16 before the weight, as transformers does), as a
    new contiguous tensor (x's rows may be strided). bf16 or fp32, x and weight alike."""
    dt = x.dtype
    fn = lib.pagedserve_ops.get(("rms_norm", dt))
    if not (
        fn is not None
        and weight.dtype is dt
        and x.is_cpu
        and weight.is_cpu
        and x.ndim == 2
        and weight.ndim == 1
        and weight.is_contiguous()
    ):
        fn = None
    else:
        t, n = x.shape
        xs0, xs1 = x.stride()
        if n != weight.shape[0] or xs1 != 1:
            fn = None
    if fn is None:
        n = weight.shape[0]
        _refuse("rms_norm", {"x": (x, n), "weight": (weight, n)}, dt)
        raise ValueError(f"rms_norm: weight must be a contiguous [{n}], got {weight.stride()}")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    fn(x.data_ptr(), xs0, weight.data_ptr(), out.data_ptr(), n, t, n, eps, torch.get_num_threads())
    return out


def add_rms_norm(
    lib: ctypes.CDLL, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, h): s = x + y (bf16: rounded), written over y (which is returned as s), and
    h = rms_norm(s) * weight, new. x, y: [T, N] contiguous, bf16 or fp32."""
    dt = x.dtype
    fn = lib.pagedserve_ops.get(("add_rms_norm", dt))
    shape = x.shape
    if not (
        fn is not None
        and y.dtype is dt
        and weight.dtype is dt
        and x.is_cpu
        and y.is_cpu
        and weight.is_cpu
        and len(shape) == 2
        and weight.ndim == 1
        and shape[1] == weight.shape[0]
        and y.shape == shape
        and x.is_contiguous()
        and y.is_contiguous()
        and weight.is_contiguous()
    ):
        n = weight.shape[0]
        _refuse("add_rms_norm", {"x": (x, n), "y": (y, n), "weight": (weight, n)}, dt)
        for name, t in (("x", x), ("y", y)):
            if not t.is_contiguous():
                raise ValueError(f"add_rms_norm {name}: must be contiguous, strides {t.stride()}")
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} and y {tuple(y.shape)} differ")
    h = torch.empty_like(x)
    yp = y.data_ptr()
    fn(
        x.data_ptr(), yp, yp, weight.data_ptr(), h.data_ptr(), shape[0], shape[1], eps,
        torch.get_num_threads(),
    )  # fmt: skip
    return y, h


def silu_and_mul(lib: ctypes.CDLL, gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I] = [gate | up] (bf16: rounded after the SiLU
    and after the product), as a new contiguous [T, I] (gate_up's rows may be strided)."""
    dt = gate_up.dtype
    if gate_up.ndim != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_and_mul: expected [T, 2I], got {tuple(gate_up.shape)}")
    fn = lib.pagedserve_ops.get(("silu_and_mul", dt))
    s0, s1 = gate_up.stride()
    if fn is None or s1 != 1 or not gate_up.is_cpu:
        width = gate_up.shape[1]
        _refuse("silu_and_mul", {"gate_up": (gate_up, width)}, dt)
        raise AssertionError("unreachable: _refuse covers every condition above")
    t, width = gate_up.shape
    out = torch.empty((t, width // 2), dtype=dt)
    fn(gate_up.data_ptr(), s0, out.data_ptr(), t, width // 2, torch.get_num_threads())
    return out


def rope_(
    lib: ctypes.CDLL,
    x: torch.Tensor,  # [T, heads, D], heads contiguous, rows may be strided
    cos: torch.Tensor,  # [T, 1, D] or [T, D], rows contiguous
    sin: torch.Tensor,
    norm_weight: torch.Tensor | None = None,  # [D]: rms-normalize each head first
    eps: float = 0.0,
) -> torch.Tensor:
    """In place: x = rope(x) with model.apply_rope's roundings, each head first
    replaced by rms_norm(head) * norm_weight when given (Qwen3's q/k norm). Returns x.
    bf16 or fp32, all tensors alike."""
    t, heads, d = x.shape
    dt = x.dtype
    xs = x.stride()
    if d % 2 or xs[2] != 1 or xs[1] != d:
        raise ValueError(f"rope_: x [T, heads, D] needs even D, contiguous heads; {xs}")
    fn = lib.pagedserve_ops.get(("rope", dt))
    # The common case first, without the reshapes: cos and sin contiguous [T, (1,) D]
    # of x's dtype (what the model's `_rope_tables` makes), each row D apart.
    if (
        fn is not None
        and x.is_cpu
        and cos.dtype is dt
        and sin.dtype is dt
        and cos.is_cpu
        and sin.is_cpu
        and cos.is_contiguous()
        and sin.is_contiguous()
        and cos.numel() == t * d
        and sin.numel() == t * d
        and cos.shape[-1] == d
        and sin.shape[-1] == d
        and (norm_weight is None or _vector(norm_weight, d, dt))
    ):
        fn(
            x.data_ptr(), xs[0], t, heads, d, cos.data_ptr(), sin.data_ptr(), d,
            None if norm_weight is None else norm_weight.data_ptr(), eps,
            torch.get_num_threads(),
        )  # fmt: skip
        return x
    if cos.numel() != t * d or sin.numel() != t * d or cos.shape[-1] != d or sin.shape[-1] != d:
        raise ValueError(  # (before, `reshape` raised a RuntimeError here)
            f"rope_: cos/sin {tuple(cos.shape)}, {tuple(sin.shape)} for {t} tokens of D={d}"
        )
    c, s = cos.reshape(t, d), sin.reshape(t, d)
    ok = (
        dt in _SUFFIX
        and x.dtype is dt
        and x.is_cpu
        and _rows(c, d, dt)
        and _rows(s, d, dt)
        and c.shape[0] == t
        and s.shape[0] == t
        and (norm_weight is None or _vector(norm_weight, d, dt))
    )
    if not ok:
        tensors = {"x": (x.view(t, heads * d), heads * d), "cos": (c, d), "sin": (s, d)}
        if norm_weight is not None:
            tensors["norm_weight"] = (norm_weight, d)
        _refuse("rope_", tensors, dt)
        raise ValueError(f"rope_: norm_weight must be a contiguous [{d}]")
    if c.stride(0) != s.stride(0):
        raise ValueError(f"rope_: cos and sin row strides differ: {c.stride(0)}, {s.stride(0)}")
    lib.pagedserve_ops["rope", dt](
        x.data_ptr(), xs[0], t, heads, d, c.data_ptr(), s.data_ptr(), c.stride(0),
        None if norm_weight is None else norm_weight.data_ptr(), eps, torch.get_num_threads(),
    )  # fmt: skip
    return x
