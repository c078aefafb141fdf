"""fp32 weights packed once for MKL's packed GEMM (cblas_sgemm_pack / _compute): one of
the fp32 GEMM backends that `fp32_gemm` chooses between at load, by measuring.

Where it wins: at the row counts of decode and chunked-prefill steps on the 2-core
Skylake-SP Xeon (avx512f, no avx512_bf16, no AMX), MKL's GEMM over a weight packed
once at load ran faster than both the oneDNN-prepacked matmul and MKL's plain `x @ w`,
and was the fixed fp32 choice from 2026-12-02 to 2026-12-05. Measured there,
2026-12-02, torch 2.13.0+cpu, 30
distinct weights of each of SmolLM2-135M's four matrices cycled as in the model, best
of 5, ms for the four matrices of 30 layers (`qkv`, `o_proj`, `gate_up`, `down`),
oneDNN prepacked -> MKL packed (packing hint m=256):

    rows        4      16      64     128     256     512    2048
    2 threads  47->35  64->50  146->112  249->202  469->382  898->810  3197->2948
    1 thread   78->76  110->98  255->220  487->425  840->747  1684->1478  6035->5744

Where it loses: on AMD EPYCs (Zen 4 / Zen 5) MKL's fp32 GEMM runs at about half of
oneDNN's rate on the same shapes (benchmarks/NOTES.md, "fp32 GEMM chosen at load"), so
a fixed choice was wrong on one CPU or the other: `fp32_gemm` now times both on the
model's own weights and keeps the faster one per weight shape.

At one row MKL's plain GEMV (`x @ w`) stays the fastest (the caller keeps it there).
torch exposes the same routine only as `mkl::_mkl_linear`, which uses the packed
copy solely when the batch equals the row count the weight was packed for and
otherwise falls back to `linear` on the transposed weight; the packed format itself
serves any row count (the row count given at packing only steers MKL's choice of
blocking and threading), so this module calls the two CBLAS entry points itself,
through ctypes, from the MKL that torch links (`libtorch_cpu.so` exports them).

Numerics: the packed GEMM sums in its own order (as oneDNN's did), so fp32 results
differ from transformers' `F.linear` by rounding (~1e-6 relative); every token-exact
test against transformers passes with it. `PAGEDSERVE_PREPACK=0` turns packing off
(plain `x @ w`, bit-identical to transformers' matmuls).

Where MKL or the symbols are missing (a torch built without MKL, e.g. on aarch64),
`available()` is False and `fp32_gemm` leaves MKL out of the choice.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# CBLAS enum values (mkl_cblas.h)
_ROW_MAJOR = 101
_NO_TRANS = 111
_B_MATRIX = 162
_PACKED = 151

# The row count MKL is told at packing. One packed copy serves every row count; 256
# was at or near the best from 4 to 2048 rows in the table above (16 lost up to 30 %
# from 64 rows on, 2048 lost up to 40 % below 64).
PACK_ROWS = 256
# Packed buffers are placed at this alignment (MKL: a packed matrix must not move).
_ALIGN = 64


@functools.lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL | None:
    """The MKL that torch links, with the packed-GEMM entry points typed; None when
    this torch has no MKL or does not export them."""
    if not torch.backends.mkl.is_available():
        return None
    path = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        lib = ctypes.CDLL(str(path))  # already loaded by torch: the same handle, no new scope
        get_size, pack, compute = (
            lib.cblas_sgemm_pack_get_size,
            lib.cblas_sgemm_pack,
            lib.cblas_sgemm_compute,
        )
    except (OSError, AttributeError) as e:
        log.info("MKL packed GEMM not available (%s); fp32 GEMM chosen without it", e)
        return None
    i, p = ctypes.c_int, ctypes.c_void_p
    get_size.restype = ctypes.c_size_t
    get_size.argtypes = [i, i, i, i]
    pack.restype = None
    pack.argtypes = [i, i, i, i, i, i, ctypes.c_float, p, i, p]
    compute.restype = None
    compute.argtypes = [i, i, i, i, i, i, p, i, p, i, ctypes.c_float, p, i]
    return lib


def available() -> bool:
    """Whether fp32 weights can be packed for MKL's packed GEMM here
    (`PAGEDSERVE_MKL_PACK=0`: no, so `fp32_gemm` chooses without it)."""
    return os.environ.get("PAGEDSERVE_MKL_PACK", "1") != "0" and _lib() is not None


class PackedMatrix:
    """An fp32 weight w [in, out] (the model's layout), packed once for
    `cblas_sgemm_compute`; `mm(x, bias)` = x @ w (+ bias) for any number of rows.

    The packed copy is as large as w (MKL reserves more address space than it
    writes; untouched pages cost no memory). It holds no reference to w: changing w
    afterwards needs a new pack (`PagedCausalLM.prepack_weights`)."""

    __slots__ = ("_buf", "_ptr", "in_features", "out_features", "_compute")

    def __init__(self, w: torch.Tensor) -> None:
        lib = _lib()
        if lib is None:
            raise RuntimeError("MKL packed GEMM is not available in this torch")
        if w.dtype != torch.float32 or w.dim() != 2 or w.device.type != "cpu":
            raise ValueError(
                f"expected a 2-D fp32 CPU weight, got {w.dtype} {tuple(w.shape)} on {w.device}"
            )
        w = w.detach().contiguous()
        k, n = w.shape
        size = lib.cblas_sgemm_pack_get_size(_B_MATRIX, PACK_ROWS, n, k)
        self._buf = torch.empty(size + _ALIGN, dtype=torch.uint8)
        self._ptr = -self._buf.data_ptr() % _ALIGN + self._buf.data_ptr()
        lib.cblas_sgemm_pack(
            _ROW_MAJOR, _B_MATRIX, _NO_TRANS, PACK_ROWS, n, k, 1.0, w.data_ptr(), n, self._ptr
        )
        self.in_features, self.out_features = k, n
        self._compute = lib.cblas_sgemm_compute

    def mm(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, in] fp32 -> [T, out] fp32 (+ bias [out])."""
        k, n = self.in_features, self.out_features
        if x.dtype is not torch.float32 or x.dim() != 2 or x.shape[1] != k or not x.is_cpu:
            raise ValueError(
                f"expected fp32 CPU input [T, {k}], got {x.dtype} {tuple(x.shape)} on {x.device}"
            )
        if x.stride(1) != 1 or x.stride(0) < k:
            x = x.contiguous()
        m = x.shape[0]
        out, beta = torch.empty((m, n), dtype=torch.float32), 0.0
        if bias is not None:  # C := x @ w + C, C prefilled with the bias rows
            out.copy_(bias)
            beta = 1.0
        if m:
            self._compute(
                _ROW_MAJOR,
                _NO_TRANS,
                _PACKED,
                m,
                n,
                k,
                x.data_ptr(),
                x.stride(0),
                self._ptr,
                n,
                beta,
                out.data_ptr(),
                n,
            )
        return out
