"""MKL's packed GEMM for fp32 weights (common/core/mkl_pack.py) against torch's matmul.

One packed copy serves every row count (it is packed with a hint of PACK_ROWS rows);
results are compared with `x @ w` in float64 on random inputs: the packed GEMM sums in
its own order, so equality is to fp32 rounding, bounded here by a relative tolerance
far below what a wrong or stale weight gives.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.common.core import mkl_pack
from pagedserve.common.core.model import _mm, pack_weight

pytestmark = pytest.mark.skipif(
    not mkl_pack.available(), reason="this torch has no MKL packed GEMM"
)

# fp32 accumulation over k <= 1536 terms of N(0, 1) products vs the float64 result:
# relative error ~1e-7 to 1e-6; a wrong weight is off by O(1)
REL_TOL = 1e-5


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("k,n", [(576, 960), (1536, 576), (64, 4099), (3, 5)])
@pytest.mark.parametrize("rows", [1, 2, 7, 64, mkl_pack.PACK_ROWS, 700])
def test_packed_matmul_matches_float64_at_any_row_count(k, n, rows):
    g = torch.Generator().manual_seed(rows * 7 + k)
    w = torch.randn(k, n, generator=g)
    x = torch.randn(rows, k, generator=g)
    packed = mkl_pack.PackedMatrix(w)
    out = packed.mm(x)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    assert _rel(out, x.double() @ w.double()) < REL_TOL
    bias = torch.randn(n, generator=g)
    kept = bias.clone()
    assert _rel(packed.mm(x, bias), x.double() @ w.double() + bias.double()) < REL_TOL
    assert torch.equal(bias, kept)  # the bias is read, never written


def test_packed_copy_is_independent_of_the_weight_and_of_the_inputs_layout():
    """Changing w after packing changes nothing (a copy, not a reference); a strided
    input (a column slice, a transposed view) gives the contiguous input's result."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 40, generator=g)
    x = torch.randn(12, 200, generator=g)
    packed = mkl_pack.PackedMatrix(w)
    before = packed.mm(x[:, 10:106])  # row stride 200, not 96
    w.mul_(-3.0)
    assert torch.equal(packed.mm(x[:, 10:106].contiguous()), before)
    xt = torch.randn(96, 12, generator=g).t()  # column-major rows
    assert torch.equal(packed.mm(xt), packed.mm(xt.contiguous()))
    assert packed.mm(torch.empty(0, 96)).shape == (0, 40)


def test_packed_matmul_refuses_what_it_cannot_read():
    packed = mkl_pack.PackedMatrix(torch.randn(8, 4))
    for bad in (torch.randn(3, 9), torch.randn(3, 8, dtype=torch.float64), torch.randn(8)):
        with pytest.raises(ValueError, match="expected fp32 CPU input"):
            packed.mm(bad)
    with pytest.raises(ValueError, match="2-D fp32 CPU weight"):
        mkl_pack.PackedMatrix(torch.randn(8, 4, dtype=torch.bfloat16))


@pytest.mark.parametrize("pack_threads,run_threads", [(1, 2), (2, 1)])
def test_thread_count_at_packing_does_not_change_results(pack_threads, run_threads):
    """MKL advises packing and computing on the same thread count for speed; a
    worker whose thread count changes after loading must still get right results."""
    saved = torch.get_num_threads()
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(576, 3072, generator=g), torch.randn(64, 576, generator=g)
    try:
        torch.set_num_threads(pack_threads)
        packed = mkl_pack.PackedMatrix(w)
        torch.set_num_threads(run_threads)
        assert _rel(packed.mm(x), x.double() @ w.double()) < REL_TOL
    finally:
        torch.set_num_threads(saved)


def test_model_matmul_takes_the_packed_gemm_above_one_row_and_gemv_at_one():
    """`pack_weight(w, "mkl")` packs fp32 for MKL; `_mm` uses it for more than one row and
    MKL's GEMV (`x @ w`, bit-identical to transformers' matmul) for one."""
    g = torch.Generator().manual_seed(9)
    w, x = torch.randn(64, 48, generator=g), torch.randn(5, 64, generator=g)
    packed = pack_weight(w, "mkl")
    assert type(packed) is mkl_pack.PackedMatrix
    assert torch.equal(_mm(x[:1], w, None, packed), x[:1] @ w)
    assert torch.equal(_mm(x, w, None, packed), packed.mm(x))
    assert _rel(_mm(x, w, None, packed), x.double() @ w.double()) < REL_TOL
