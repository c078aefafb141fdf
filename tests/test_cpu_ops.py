"""The fused CPU ops (common/core/cpu_ops.c), bf16 and fp32, against the torch formulas
they replace.

Each kernel is run on random bf16 inputs (no zeros) of several shapes: rows of 1 and
many, widths that are and are not multiples of 16 (the AVX-512 path's masked tail),
strided rows where the model passes views; the built-for-this-CPU library and the
plain C fallback (built here with AVX-512 withheld) both.

Tolerances. SiLU-and-mul, the residual add and RoPE round where torch rounds and
compute the same fp32 operations: bit-identical (SiLU's exp is a polynomial, not
torch's Sleef exp, but agreed on every value tried: 6M random ones and the
extremes). RMSNorm sums its squares in another order than torch, so the fp32 mean
may differ in its last bit, and a normalized value lying next to a bf16 rounding
boundary then rounds the other way: one bf16 step before the bf16 multiply by the
weight, which can carry it to two. (The kernel sums in double, so its mean is as
close to exact as fp32 holds and the differences are torch's own rounding.)
Measured on 6M elements per op here: 11 (rms_norm) and 10 (add + rms_norm)
differing elements, none by more than two steps, the same with the plain C path. The bound: at most 1 element in 20,000 (+2, for small shapes) differs, by at
most 2 steps (`_assert_near_bitwise`).
"""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F
from builders import bf16_paths_agree, fresh_library, one_torch_thread, tiny_checkpoint  # noqa: F401 (autouse fixture)

from pagedserve.common.core import cpu_ops
from pagedserve.common.core.loader import load_model
from pagedserve.common.core.model import apply_rope, rms_norm

LIB = cpu_ops.load()
needs_lib = pytest.mark.skipif(LIB is None, reason="the fused CPU ops did not build here")

RMS_SHAPES = [(1, 576), (7, 17), (64, 576), (33, 100), (5, 2048), (3, 1), (300, 577)]
SILU_SHAPES = [(1, 1536), (8, 1536), (64, 1536), (9, 37), (3, 1), (130, 1000)]
# (tokens, heads, head_dim): half head sizes 32, 5, 17 (masked tail), 64, 8
ROPE_SHAPES = [(1, 12, 64), (9, 3, 10), (64, 12, 64), (5, 2, 34), (17, 4, 128), (3, 9, 16)]
MAX_STEPS = 2
MAX_SHARE = 1 / 20000
FP32_MAX_ULPS = 8
DTYPES = [torch.bfloat16, torch.float32]


def _rand(
    g: torch.Generator, *shape: int, scale: float = 1.0, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Random values (bf16 unless `dtype`), none of them zero."""
    x = torch.randn(*shape, generator=g) * scale
    x = torch.where(x.abs() < 1e-3, torch.full_like(x, 0.5), x)
    return x.to(dtype)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many fp32 values apart each pair is (for values of equal sign)."""
    return (a.view(torch.int32).long() - b.view(torch.int32).long()).abs()


def _assert_fp32_near(got: torch.Tensor, ref: torch.Tensor) -> None:
    """RMSNorm's and SiLU's fp32 tolerance (see the module docstring)."""
    assert got.dtype == ref.dtype == torch.float32 and got.shape == ref.shape
    assert torch.equal(got.isnan(), ref.isnan())
    keep = ~ref.isnan()
    ulps = _ulps(got[keep], ref[keep])
    assert int(ulps.max()) <= FP32_MAX_ULPS, f"an element is {int(ulps.max())} ulps off"


def _assert_same(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Bit for bit (bf16 or fp32)."""
    if got.dtype == torch.bfloat16:
        _assert_bitwise(got, ref)
    else:
        assert got.dtype == ref.dtype and got.shape == ref.shape
        n = int((_ulps(got, ref) > 0).sum())
        assert n == 0, f"{n} of {ref.numel()} elements differ"


def _assert_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """RMSNorm's tolerance for either dtype."""
    if got.dtype == torch.bfloat16:
        _assert_near_bitwise(got, ref)
    else:
        _assert_fp32_near(got, ref)


def _steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 values apart each pair is (for values of equal sign)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def _assert_bitwise(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.dtype == ref.dtype == torch.bfloat16 and got.shape == ref.shape
    n = int((_steps(got, ref) > 0).sum())
    assert n == 0, f"{n} of {ref.numel()} elements differ"


def _assert_near_bitwise(got: torch.Tensor, ref: torch.Tensor) -> None:
    """RMSNorm's tolerance (see the module docstring)."""
    assert got.dtype == ref.dtype == torch.bfloat16 and got.shape == ref.shape
    steps = _steps(got, ref)
    n = int((steps > 0).sum())
    assert int(steps.max()) <= MAX_STEPS, f"an element is {int(steps.max())} bf16 steps off"
    assert n <= ref.numel() * MAX_SHARE + 2, f"{n} of {ref.numel()} elements differ"


@pytest.fixture(scope="module")
def plain_c_lib(tmp_path_factory) -> ctypes.CDLL:
    """The plain C fallback, built once for the module: 66 tests use it, and a build
    per test was a gcc run of ~2 s each (~2 min of the suite). Sharing it loses
    nothing: the tests only call its entry points, none changes the library."""
    if platform.machine() != "x86_64" or shutil.which("gcc") is None:
        pytest.skip("needs gcc on x86_64")
    flags = [f for f in cpu_ops._FLAGS if not f.startswith("-march=")]
    out = tmp_path_factory.mktemp("plain-c-ops") / "ops.so"
    cmd = ["gcc", *flags, "-march=x86-64-v2", "-o", str(out), str(cpu_ops._SOURCE)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    return cpu_ops.bind(ctypes.CDLL(str(out)))


@pytest.fixture(params=["native", "plain-c"])
def lib(request) -> ctypes.CDLL:
    """The library as built for this CPU, and the plain C fallback that CPUs without
    AVX-512 (F, BW, VL) get, built here with those withheld."""
    if request.param == "native":
        if LIB is None:
            pytest.skip("the fused CPU ops did not build here")
        return LIB
    return request.getfixturevalue("plain_c_lib")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", RMS_SHAPES, ids=str)
def test_rms_norm_matches_torch(lib, shape, dtype):
    g = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    t, n = shape
    w = _rand(g, n, dtype=dtype)
    x = _rand(g, t, n + 5, scale=3.0, dtype=dtype)[:, 2 : n + 2]  # strided rows
    _assert_close(cpu_ops.rms_norm(lib, x, w, 1e-5), rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", RMS_SHAPES, ids=str)
def test_add_rms_norm_matches_torch_and_writes_the_sum_over_y(lib, shape, dtype):
    g = torch.Generator().manual_seed(shape[0] * 5 + shape[1])
    t, n = shape
    x, y = _rand(g, t, n, scale=4.0, dtype=dtype), _rand(g, t, n, dtype=dtype)
    w = _rand(g, n, dtype=dtype)
    x_before = x.clone()
    ref_sum = x + y
    s, h = cpu_ops.add_rms_norm(lib, x, y, w, 1e-6)
    assert s.data_ptr() == y.data_ptr()  # in place over the layer output
    assert torch.equal(x, x_before)  # the residual input is left alone
    _assert_same(s, ref_sum)
    _assert_close(h, rms_norm(ref_sum, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SILU_SHAPES, ids=str)
def test_silu_and_mul_matches_torch(lib, shape, dtype):
    g = torch.Generator().manual_seed(shape[0] + shape[1])
    t, i = shape
    gate_up = _rand(g, t, 2 * i + 3, scale=4.0, dtype=dtype)[:, : 2 * i]  # strided rows
    gate, up = gate_up.clone().split(i, dim=-1)
    ref = F.silu(gate, inplace=True).mul_(up)  # the model's torch path
    got = cpu_ops.silu_and_mul(lib, gate_up)
    assert got.is_contiguous()
    if dtype == torch.bfloat16:
        _assert_bitwise(got, ref)
    else:
        _assert_fp32_near(got, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_extremes_match_torch(lib, dtype):
    """exp overflow and underflow, infinities and NaN: the same values as torch
    (a NaN where torch has one, whatever its bits); fp32 also over a wide range."""
    vals = [-200.0, -100.0, -89.0, -88.5, -88.0, -87.0, -50.0, -20.0, -1e-30, 1e-30, 5.0]
    vals += [88.0, 90.0, 200.0, float("inf"), -float("inf"), float("nan")]
    gate = torch.tensor(vals).to(dtype)
    if dtype == torch.float32:
        gate = torch.cat([gate, torch.linspace(-120, 120, 4099)])
    up = torch.full_like(gate, 1.5)
    got = cpu_ops.silu_and_mul(lib, torch.cat([gate, up]).view(1, -1))[0]
    ref = F.silu(gate).mul(up)
    assert torch.equal(got.isnan(), ref.isnan())
    keep = ~ref.isnan()
    if dtype == torch.bfloat16:
        _assert_bitwise(got[keep], ref[keep])
    else:
        assert torch.equal(got[keep] == 0, ref[keep] == 0)  # underflow where torch's does
        assert torch.equal(got[keep].isinf(), ref[keep].isinf())
        _assert_fp32_near(got[keep], ref[keep])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=str)
def test_rope_in_place_matches_apply_rope(lib, shape, dtype):
    """On q and k heads as the model passes them: views into the qkv matmul's output
    (strided rows), cos/sin [T, 1, D] (random here: both halves read)."""
    g = torch.Generator().manual_seed(sum(shape))
    t, heads, d = shape
    qkv = _rand(g, t, (heads + 2) * d, dtype=dtype)
    x = qkv[:, : heads * d].view(t, heads, d)
    cos, sin = _rand(g, t, 1, d, dtype=dtype), _rand(g, t, 1, d, dtype=dtype)
    ref = apply_rope(x.clone(), cos, sin)
    rest = qkv[:, heads * d :].clone()
    assert cpu_ops.rope_(lib, x, cos, sin) is x
    _assert_same(x, ref)
    assert torch.equal(qkv[:, heads * d :], rest)  # v is not touched


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_takes_cos_sin_rows_of_any_stride_and_two_dim_tables(lib, dtype):
    """cos/sin as the model makes them ([T, 1, D] contiguous: the wrapper's fast path),
    as [T, D], and as strided rows of wider tables (its general path) rotate alike."""
    g = torch.Generator().manual_seed(41)
    t, heads, d = 7, 3, 16
    x = _rand(g, t, heads, d, dtype=dtype)
    wide_c, wide_s = _rand(g, t, 3 * d, dtype=dtype), _rand(g, t, 3 * d, dtype=dtype)
    cos, sin = wide_c[:, d : 2 * d], wide_s[:, d : 2 * d]  # rows 3 * D apart
    ref = apply_rope(x.clone(), cos[:, None], sin[:, None])
    for c, s in (
        (cos, sin),
        (cos.contiguous(), sin.contiguous()),
        (cos.contiguous()[:, None], sin.contiguous()[:, None]),
    ):
        _assert_same(cpu_ops.rope_(lib, x.clone(), c, s), ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=str)
def test_rope_with_head_norm_is_rms_norm_then_apply_rope(lib, shape, dtype):
    """Qwen3's q/k norm: each head rms-normalized (RMSNorm's tolerance against torch),
    then rotated: bit for bit apply_rope of the kernel's own normalized heads (a
    one-step difference of a normalized value can grow to many steps of a rotated one
    where the two products nearly cancel, so the whole is not compared by steps)."""
    g = torch.Generator().manual_seed(sum(shape) + 1)
    t, heads, d = shape
    x, w = _rand(g, t, heads, d, scale=2.0, dtype=dtype), _rand(g, d, dtype=dtype)
    cos, sin = _rand(g, t, 1, d, dtype=dtype), _rand(g, t, 1, d, dtype=dtype)
    normed = cpu_ops.rms_norm(lib, x.view(t * heads, d), w, 1e-6).view(t, heads, d)
    _assert_close(normed, rms_norm(x, w, 1e-6))
    _assert_same(cpu_ops.rope_(lib, x.clone(), cos, sin, w, 1e-6), apply_rope(normed, cos, sin))


@needs_lib
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("threads", [1, 2])
def test_thread_count_does_not_change_results(threads, dtype):
    g = torch.Generator().manual_seed(9)
    x, y = _rand(g, 300, 576, dtype=dtype), _rand(g, 300, 576, dtype=dtype)
    w = _rand(g, 576, dtype=dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    one = cpu_ops.add_rms_norm(LIB, x, y.clone(), w, 1e-6)[1]
    torch.set_num_threads(threads)
    try:
        assert torch.equal(cpu_ops.add_rms_norm(LIB, x, y.clone(), w, 1e-6)[1], one)
    finally:
        torch.set_num_threads(before)


@needs_lib
def test_bad_layouts_and_dtypes_are_refused():
    x = torch.randn(4, 32).bfloat16()
    w = torch.randn(32).bfloat16()
    with pytest.raises(ValueError, match="bf16 or fp32 CPU tensors only"):
        cpu_ops.rms_norm(LIB, x.double(), w.double(), 1e-6)
    with pytest.raises(
        ValueError, match="weight: torch.bfloat16, but the op runs in torch.float32"
    ):
        cpu_ops.rms_norm(LIB, x.float(), w, 1e-6)  # mixed dtypes
    with pytest.raises(ValueError, match="cos: torch.float32, but the op runs in torch.bfloat16"):
        cpu_ops.rope_(LIB, x.view(4, 2, 16), torch.ones(4, 1, 16), torch.ones(4, 1, 16))
    with pytest.raises(ValueError, match=r"expected \[rows, 32\]"):
        cpu_ops.rms_norm(LIB, x.t().contiguous().t(), w, 1e-6)  # column-major
    with pytest.raises(ValueError, match="must be contiguous"):
        cpu_ops.add_rms_norm(LIB, x, torch.randn(4, 64).bfloat16()[:, :32], w, 1e-6)
    with pytest.raises(ValueError, match=r"expected \[T, 2I\]"):
        cpu_ops.silu_and_mul(LIB, torch.randn(4, 33).bfloat16())
    with pytest.raises(ValueError, match="even D"):
        cpu_ops.rope_(LIB, torch.randn(2, 3, 7).bfloat16(), x, x)
    # what the wrappers' fast checks pass to their full ones
    with pytest.raises(ValueError, match=r"y: expected \[rows, 32\]"):
        cpu_ops.add_rms_norm(LIB, x, torch.randn(4, 16).bfloat16(), w, 1e-6)  # y's width
    with pytest.raises(ValueError, match=r"x: expected \[rows, 16\]"):
        cpu_ops.add_rms_norm(LIB, x, x.clone(), w[:16], 1e-6)  # the weight's width
    with pytest.raises(ValueError, match=r"differ"):
        cpu_ops.add_rms_norm(LIB, x, x[:3].clone(), w, 1e-6)
    with pytest.raises(ValueError, match=r"weight: expected \[rows, 32\]"):
        cpu_ops.rms_norm(LIB, x, torch.randn(64).bfloat16()[::2], 1e-6)  # strided weight
    with pytest.raises(ValueError, match=r"cos/sin \(3, 16\), \(3, 16\) for 4 tokens"):
        cpu_ops.rope_(LIB, x.view(4, 2, 16), x[:3, :16], x[:3, :16])
    c = torch.randn(5, 16).bfloat16()
    with pytest.raises(ValueError, match=r"cos/sin \(5, 16\), \(5, 16\) for 4 tokens"):
        cpu_ops.rope_(LIB, x.view(4, 2, 16), c, c)
    with pytest.raises(ValueError, match=r"cos/sin \(4, 2, 8\)"):  # right size, wrong D
        cpu_ops.rope_(LIB, x.view(4, 2, 16), c[:4].view(4, 2, 8), c[:4].view(4, 2, 8))
    with pytest.raises(ValueError, match=r"gate_up: expected \[rows, 64\]"):
        cpu_ops.silu_and_mul(LIB, torch.randn(64, 4).bfloat16().t())  # column-major


# ---- the model ------------------------------------------------------------------------


@pytest.fixture
def fresh_load(monkeypatch, tmp_path):
    with fresh_library(cpu_ops.load, monkeypatch, tmp_path) as cache_dir:
        yield cache_dir


def test_disabled_or_unbuildable_ops_fall_back_to_torch(fresh_load, monkeypatch, caplog):
    path = str(tiny_checkpoint("llama"))
    monkeypatch.setenv("PAGEDSERVE_CPU_OPS", "0")
    with caplog.at_level("INFO", logger=cpu_ops.__name__):
        model = load_model(path, dtype=torch.bfloat16).model
    assert model.ops is None
    assert [r.levelname for r in caplog.records] == ["INFO"]  # chosen: said quietly
    with pytest.raises(ValueError, match="fused CPU ops need bf16 or fp32 on the CPU"):
        model.use_fused_ops(True)
    cpu_ops.load.cache_clear()
    caplog.clear()
    monkeypatch.delenv("PAGEDSERVE_CPU_OPS")
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level("INFO", logger=cpu_ops.__name__):
        assert load_model(path, dtype=torch.bfloat16).model.ops is None
    (record,) = caplog.records  # not chosen: loud, with what to install
    assert record.levelname == "WARNING" and "apt-get install gcc" in record.getMessage()
    assert list(fresh_load.rglob("*.so")) == []


@needs_lib
def test_fp16_keeps_torch_ops():
    model = load_model(str(tiny_checkpoint("llama")), dtype=torch.float16).model
    assert model.ops is None and model.use_fused_ops() is False
    with pytest.raises(ValueError, match="dtype torch.float16"):
        model.use_fused_ops(True)


@pytest.fixture
def op_calls(monkeypatch):
    """How often the model called each fused op."""
    calls: dict[str, int] = {}
    for name in ("rms_norm", "add_rms_norm", "silu_and_mul", "rope_"):
        real = getattr(cpu_ops, name)

        def spy(*a, _real=real, _name=name, **kw):
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*a, **kw)

        monkeypatch.setattr(cpu_ops, name, spy)
    return calls


# The engine, fused ops on against off, per dtype:
# - bf16: the ops agree bit for bit but for RMSNorm's rare one- or two-step
#   differences, which pass through the layers into bf16 logits (steps of 2^-4 nats
#   between 8 and 16): the bound is two such steps, as for the attention kernel
#   (tests/test_cpu_attention_kernel.py); a wrong op moves logprobs by nats. Where the
#   torch path's top two are closer than NEAR_TIE_NATS the greedy pick may go either
#   way: that sequence's comparison stops at the first divergence.
# - fp32: their differences (a few fp32 ulps in RMSNorm and SiLU, see the module
#   docstring) reach the logprobs as ~1e-6 nats on the tiny models; a wrong op moves
#   them by far more than FP32_LOGPROB_TOL. Greedy tokens must be the same (no
#   near-ties are allowed for: fp32 must stay token-exact).
ENGINE_LOGPROB_TOL = 0.125
NEAR_TIE_NATS = 0.1
FP32_LOGPROB_TOL = 1e-4


def _greedy(llm, prompts, max_tokens=16):
    from pagedserve.common.api.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    return [o.completions[0] for o in llm.generate(prompts, params)]


def _assert_op_counts(op_calls: dict[str, int], layers: int, arch: str) -> None:
    """Every forward went through the fused ops: per forward one rms_norm (the first
    layer's input norm), two add_rms_norm and one silu_and_mul per layer, and RoPE once
    per layer over q and k heads together, or twice (q, then k) with Qwen3's q/k norm."""
    steps = op_calls["rms_norm"]
    assert steps >= 16
    assert op_calls == {
        "rms_norm": steps,
        "add_rms_norm": 2 * layers * steps,
        "silu_and_mul": layers * steps,
        "rope_": (2 if arch == "qwen3" else 1) * layers * steps,
    }


@needs_lib
@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: q/k norm fused into RoPE
@pytest.mark.parametrize("dtype, seed", [("bfloat16", 3), ("float32", 4)])
def test_engine_with_fused_ops_matches_torch_ops(dtype, seed, arch, op_calls):
    """Greedy runs of the engine with the fused ops, then with torch's ops (the prompts'
    seed per dtype is the one each dtype's test had before they were merged)."""
    from pagedserve.common.core.llm import LLM

    llm = LLM(str(tiny_checkpoint(arch)), dtype=dtype, num_blocks=128)
    model = llm.engine.model
    assert model.ops is not None
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (9, 23, 40, 70)]
    fused = _greedy(llm, prompts)
    _assert_op_counts(op_calls, len(model.layers), arch)
    op_calls.clear()
    assert model.use_fused_ops(False) is False
    llm.engine.block_manager.evict()  # no prefix-cache hits from the first run
    torch_ops = _greedy(llm, prompts)
    assert op_calls == {}
    if dtype == "bfloat16":
        compared = bf16_paths_agree(fused, torch_ops, NEAR_TIE_NATS, ENGINE_LOGPROB_TOL)
        assert compared >= 2 * 16
    else:
        for a, b in zip(fused, torch_ops, strict=True):
            assert a.token_ids == b.token_ids
            for la, lb in zip(a.logprobs, b.logprobs, strict=True):
                assert abs(la.logprob - lb.logprob) <= FP32_LOGPROB_TOL
    assert model.use_fused_ops() is True


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")
def test_a_shared_header_is_part_of_the_build_key(monkeypatch, tmp_path):
    """Both C sources include bf16.h and avx512_exp.h from common/core; a change in a
    header must rebuild every library that includes it, not load the one built from
    the old header."""
    from pagedserve.common.core import cbuild
    from pagedserve.common.core.attention import cpu_kernel

    attention_dir = cpu_kernel._SOURCE.parent
    assert cbuild.local_includes(cpu_kernel._SOURCE) == [
        attention_dir / "../bf16.h",
        attention_dir / "../avx512_exp.h",
    ]
    assert cbuild.local_includes(cpu_ops._SOURCE) == [
        cpu_ops._SOURCE.parent / "avx512_exp.h",
        cpu_ops._SOURCE.parent / "bf16.h",
    ]
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "src" / "lib.c"
    src.parent.mkdir()
    src.write_text('#include "value.h"\nint value(void) { return VALUE; }\n')
    flags = ("-O1", "-fPIC", "-shared")
    values = []
    for v in (1, 2, 1):
        (src.parent / "value.h").write_text(f"#define VALUE {v}\n")
        lib = cbuild.build_and_load(src, flags)
        values.append(lib.value())
    assert values == [1, 2, 1]
    assert len(list((tmp_path / "cache").rglob("lib-*.so"))) == 2  # the third: from cache
