"""Fused single-pass bf16 CPU kernels (cpu_ops.c) for the decoder's small ops.

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

bf16 only: fp32 keeps torch's ops, which must stay token-exact with transformers
(`F.rms_norm` in fp32 is already one fused op).

Build and fallback as for the attention kernel (`attention/cpu_kernel.py`, shared
build code in `cbuild.py`): built with gcc on first use, cached per source,
compiler and CPU; when it cannot be built or loaded, or `PAGEDSERVE_CPU_OPS=0`,
`load()` returns None once (logged: INFO when switched off, WARNING otherwise) and
the model uses its torch ops. The kernels run on torch's OpenMP threads with
`torch.get_num_threads()`; small calls stay on the calling thread (see the C file).

The wrappers check dtypes and layouts (a few attribute reads per call, against
~120 calls per forward) and raise ValueError rather than let C read out of bounds.
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


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the argument types of a built library's entry points; returns it."""
    i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    signatures = {
        "pagedserve_rms_norm_bf16": [ptr, i64, ptr, ptr, i64, i64, i64, f32, i32],
        "pagedserve_add_rms_norm_bf16": [ptr, ptr, ptr, ptr, ptr, i64, i64, f32, i32],
        "pagedserve_silu_and_mul_bf16": [ptr, i64, ptr, i64, i64, i32],
        "pagedserve_rope_bf16": [ptr, i64, i64, i64, i64, ptr, ptr, i64, ptr, f32, i32],
    }
    for name, args in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = None
    return lib


@functools.cache
def load() -> ctypes.CDLL | None:
    """The built library, or None (logged once) when it cannot be had here."""
    lib = cbuild.load_or_none(
        _SOURCE, _FLAGS, _ENV_SWITCH, "fused bf16 CPU ops", "torch's ops (slower in bf16)", log
    )
    return None if lib is None else bind(lib)


def _check_rows(name: str, t: torch.Tensor, width: int) -> None:
    """t: bf16 on the CPU, [rows, width] with contiguous rows."""
    if t.dtype != torch.bfloat16 or t.device.type != "cpu":
        raise ValueError(f"{name}: bf16 CPU tensors only, got {t.dtype} on {t.device}")
    if t.ndim != 2 or t.shape[1] != width or t.stride(1) != 1:
        raise ValueError(
            f"{name}: expected [rows, {width}] with contiguous rows, "
            f"got shape {tuple(t.shape)} strides {t.stride()}"
        )


def rms_norm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * bf16(x * rsqrt(mean(x^2) + eps)) over the last dim of x [T, N], as a new
    contiguous tensor (x's rows may be strided)."""
    n = weight.shape[0]
    _check_rows("rms_norm x", x, n)
    _check_rows("rms_norm weight", weight.view(1, n), n)
    out = torch.empty(x.shape, dtype=x.dtype)
    lib.pagedserve_rms_norm_bf16(
        x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), n, x.shape[0], n,
        eps, torch.get_num_threads(),
    )  # fmt: skip
    return out


def add_rms_norm(
    lib: ctypes.CDLL, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, h): s = bf16(x + y), written over y (which is returned as s), and
    h = rms_norm(s) * weight, new. x, y: [T, N] contiguous."""
    n = weight.shape[0]
    for name, t in (("x", x), ("y", y), ("weight", weight.view(1, n))):
        _check_rows(f"add_rms_norm {name}", t, n)
        if not t.is_contiguous():
            raise ValueError(f"add_rms_norm {name}: must be contiguous, strides {t.stride()}")
    if x.shape != y.shape:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} and y {tuple(y.shape)} differ")
    h = torch.empty(x.shape, dtype=x.dtype)
    lib.pagedserve_add_rms_norm_bf16(
        x.data_ptr(), y.data_ptr(), y.data_ptr(), weight.data_ptr(), h.data_ptr(),
        x.shape[0], n, eps, torch.get_num_threads(),
    )  # fmt: skip
    return y, h


def silu_and_mul(lib: ctypes.CDLL, gate_up: torch.Tensor) -> torch.Tensor:
    """bf16(bf16(silu(gate)) * up) for gate_up [T, 2I] = [gate | up], as a new
    contiguous [T, I] (gate_up's rows may be strided)."""
    if gate_up.ndim != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_and_mul: expected [T, 2I], got {tuple(gate_up.shape)}")
    _check_rows("silu_and_mul gate_up", gate_up, gate_up.shape[1])
    i = gate_up.shape[1] // 2
    out = torch.empty((gate_up.shape[0], i), dtype=gate_up.dtype)
    lib.pagedserve_silu_and_mul_bf16(
        gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), gate_up.shape[0], i,
        torch.get_num_threads(),
    )  # fmt: skip
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
    replaced by rms_norm(head) * norm_weight when given (Qwen3's q/k norm). Returns x."""
    t, heads, d = x.shape
    if d % 2 or x.stride(2) != 1 or x.stride(1) != d:
        raise ValueError(f"rope_: x [T, heads, D] needs even D, contiguous heads; {x.stride()}")
    _check_rows("rope_ x", x.view(t, heads * d), heads * d)
    c, s = cos.reshape(t, d), sin.reshape(t, d)
    _check_rows("rope_ cos", c, d)
    _check_rows("rope_ sin", s, d)
    if c.stride(0) != s.stride(0):
        raise ValueError(f"rope_: cos and sin row strides differ: {c.stride(0)}, {s.stride(0)}")
    w = None
    if norm_weight is not None:
        _check_rows("rope_ norm_weight", norm_weight.view(1, d), d)
        w = norm_weight.data_ptr()
    lib.pagedserve_rope_bf16(
        x.data_ptr(), x.stride(0), t, heads, d, c.data_ptr(), s.data_ptr(), c.stride(0), w,
        eps, torch.get_num_threads(),
    )  # fmt: skip
    return x
