"""The compiled CPU attention kernel (common/core/attention/cpu_attention.c) and its fallback.

The kernel (decode rows, and prefill rows with their causal lengths) is compared
with softmax attention computed densely in float64 and with the pure-torch decode
path, in fp32 and in bf16 (inputs rounded to bf16 first, the reference computed
from the rounded values, an elementwise tolerance of half an output ulp plus
fp32 accumulation: see BF16_ACC_ULPS), over head sizes that take its AVX-512 code
(fp32: 16, 32, 64, 128; bf16: 32, 64, 128, 256, where the CPU has AVX-512)
and its plain-C code (24; 16 in bf16), GQA group
sizes 1/3/4, block sizes 8/16/32 and lengths ending inside and on the edge of
blocks and 16-token tiles; rows picking their sequence and length; the split
of prefills between kernel and SDPA. Also: bad lengths/block ids are refused
before any read, thread count does not change results, a disabled or unbuildable kernel
falls back to torch, builds are cached, and one backend serves two threads; the
bf16 engine's greedy output with the kernel against the torch path, and with the
kernel switched off.
Also the process-wide malloc tuning that CPU models apply (model.py).
"""

from __future__ import annotations

import math
import os
import platform
import subprocess
import sys
import tempfile
import threading

import pytest
import torch
from builders import bf16_paths_agree, fresh_library, make_metadata, one_torch_thread  # noqa: F401 (autouse fixture)

from pagedserve.common.core.attention import cpu_kernel, torch_backend
from pagedserve.common.core.attention.base import write_kv
from pagedserve.common.core.attention.torch_backend import TorchAttentionBackend
from pagedserve.common.core.config import cpuinfo_flags
from pagedserve.common.core.model import tune_cpu_malloc

LIB = cpu_kernel.load()
needs_kernel = pytest.mark.skipif(LIB is None, reason="the CPU kernel did not build here")


def _decode_case(lens, h, kvh, d, block_size, seed, dtype=torch.float32):
    """Decode-only batch over a randomly permuted cache. Returns tensors + reference.

    Inputs are drawn in fp32 and rounded to `dtype`; the float64 reference is
    computed from the rounded values (so for bf16 it holds no input rounding)."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = sum(math.ceil(n / block_size) for n in lens) + 2
    perm = torch.randperm(n_blocks, generator=g).tolist()
    k_cache = torch.randn(n_blocks, block_size, kvh, d, generator=g).to(dtype)
    v_cache = torch.randn(n_blocks, block_size, kvh, d, generator=g).to(dtype)
    tables, refs, slots = [], [], []
    q = torch.randn(len(lens), h, d, generator=g).to(dtype)
    k_new = torch.randn(len(lens), kvh, d, generator=g).to(dtype)
    v_new = torch.randn(len(lens), kvh, d, generator=g).to(dtype)
    for i, n in enumerate(lens):
        table = [perm.pop() for _ in range(math.ceil(n / block_size))]
        tables.append(table)
        slots.append(table[(n - 1) // block_size] * block_size + (n - 1) % block_size)
        flat = torch.tensor(
            [table[p // block_size] * block_size + p % block_size for p in range(n)]
        )
        k_full = k_cache.view(-1, kvh, d)[flat].clone()
        v_full = v_cache.view(-1, kvh, d)[flat].clone()
        k_full[-1], v_full[-1] = k_new[i], v_new[i]
        kk = k_full.double().repeat_interleave(h // kvh, dim=1)  # [n, h, d]
        vv = v_full.double().repeat_interleave(h // kvh, dim=1)
        p = (torch.einsum("hd,nhd->hn", q[i].double(), kk) * d**-0.5).softmax(-1)
        refs.append(torch.einsum("hn,nhd->hd", p, vv))
    meta = make_metadata([1] * len(lens), list(lens), tables, slots, 0)
    return q, k_new, v_new, k_cache, v_cache, meta, torch.stack(refs)


def _rel(out, ref):
    return float((out.double() - ref).norm() / ref.norm())


LENS = [1, 2, 15, 16, 17, 31, 33, 48, 64, 100, 7]


@needs_kernel
@pytest.mark.parametrize("d", [16, 32, 64, 128, 24])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_kernel_matches_dense_reference_and_torch_path(d, group, block_size):
    kvh = 2
    q, k, v, kc, vc, meta, ref = _decode_case(LENS, kvh * group, kvh, d, block_size, seed=d)
    kc2, vc2 = kc.clone(), vc.clone()
    out = TorchAttentionBackend().forward(q, k, v, kc, vc, meta, d**-0.5)
    torch_out = TorchAttentionBackend(cpu_kernel=False).forward(q, k, v, kc2, vc2, meta, d**-0.5)
    assert _rel(out, ref) < 1e-6
    assert _rel(torch_out, ref) < 1e-6
    torch.testing.assert_close(out, torch_out, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_kernel", [True, False])
def test_block_major_layer_views_match_contiguous_caches(dtype, use_kernel):
    """The cache is block-major ([blocks, layers, 2, ...], kv_cache.py), so a layer's
    k_cache/v_cache are views whose block stride spans every layer. Attention over those
    views (the C kernel, or the torch path's gather) and write_kv into them give exactly
    what they give on contiguous copies, and write_kv touches no other layer's bytes."""
    if use_kernel and LIB is None:
        pytest.skip("the CPU kernel did not build here")
    h, kvh, d, bs, layers, layer = 6, 2, 64, 16, 3, 1
    q, k, v, kc, vc, meta, ref = _decode_case(LENS, h, kvh, d, bs, seed=21, dtype=dtype)
    g = torch.Generator().manual_seed(22)
    kv = torch.randn(kc.shape[0], layers, 2, bs, kvh, d, generator=g).to(dtype)
    kv[:, layer, 0], kv[:, layer, 1] = kc, vc
    k_view, v_view = kv[:, layer, 0], kv[:, layer, 1]
    assert not k_view.is_contiguous() and k_view.stride(0) == layers * 2 * bs * kvh * d
    before = kv.clone()
    backend = TorchAttentionBackend(cpu_kernel=use_kernel)
    out_view = backend.forward(q, k, v, k_view, v_view, meta, d**-0.5)
    out_flat = TorchAttentionBackend(cpu_kernel=use_kernel).forward(q, k, v, kc, vc, meta, d**-0.5)
    assert torch.equal(out_view, out_flat)
    assert _rel(out_view, ref) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert torch.equal(kv[:, layer, 0], kc) and torch.equal(kv[:, layer, 1], vc)
    written = kv[:, layer] != before[:, layer]
    assert written.any()  # the new tokens' K/V landed in this layer's tiles
    others = [i for i in range(layers) if i != layer]
    assert torch.equal(kv[:, others], before[:, others])


def test_write_kv_refuses_a_cache_layout_it_cannot_view_as_token_rows():
    """write_kv raises before writing anything when a block's tile is not contiguous
    (`tile_contiguous` false: the kernel refuses it too) or when the block stride is
    not a whole number of token rows (a layout the kernel reads but write_kv's row view
    cannot express); the block-major layer view passes both."""
    nb, bs, kvh, d = 4, 8, 2, 16
    k, v = torch.randn(1, kvh, d), torch.randn(1, kvh, d)
    slots = torch.tensor([bs + 3])  # block 1, offset 3
    kv = torch.zeros(nb, 3, 2, bs, kvh, d)  # block-major, 3 layers
    tile = bs * kvh * d
    # [nb, bs, kvh, d] with each tile stored heads-major, and with a block stride one
    # element past a tile: a K and a V cache of each
    heads_major = [torch.zeros(nb, kvh, bs, d).transpose(1, 2) for _ in "kv"]
    odd_stride = [
        torch.zeros(nb * (tile + 1)).as_strided((nb, bs, kvh, d), (tile + 1, kvh * d, d, 1))
        for _ in "kv"
    ]
    assert cpu_kernel.tile_contiguous(kv[:, 1, 0])
    assert not cpu_kernel.tile_contiguous(heads_major[0])
    assert cpu_kernel.tile_contiguous(odd_stride[0])
    write_kv(k, v, kv[:, 1, 0], kv[:, 1, 1], slots)
    assert torch.equal(kv[1, 1, 0, 3], k[0]) and torch.equal(kv[1, 1, 1, 3], v[0])
    for k_cache, v_cache in (heads_major, odd_stride):
        with pytest.raises(ValueError, match=r"each block's \[block_size, kvh, head_dim\] tile"):
            write_kv(k, v, k_cache, v_cache, slots)
        assert not k_cache.any() and not v_cache.any()


def test_write_kv_with_a_step_memo_writes_each_layer_into_its_own_tiles():
    """Every layer of a step shares the metadata's memo, in which write_kv keeps each
    cache view's token-row view: with one memo for all layers (as `forward` passes
    it), each layer's K/V still lands in that layer's tiles only, and again in a second
    step (a new memo) after the cache was rebuilt at another address."""
    nb, bs, kvh, d, layers = 5, 8, 2, 16, 3
    slots = torch.tensor([bs + 3, 3 * bs])  # block 1 offset 3, block 3 offset 0
    for step in range(2):
        kv = torch.zeros(nb, layers, 2, bs, kvh, d)
        memo: dict = {}
        for layer in range(layers):
            k = torch.full((2, kvh, d), 10.0 * step + layer + 1)
            write_kv(k, -k, kv[:, layer, 0], kv[:, layer, 1], slots, memo)
        for layer in range(layers):
            want = 10.0 * step + layer + 1
            for kvi, sign in ((0, 1), (1, -1)):
                tiles = kv[:, layer, kvi]
                assert torch.equal(tiles[1, 3], torch.full((kvh, d), sign * want))
                assert torch.equal(tiles[3, 0], torch.full((kvh, d), sign * want))
                assert int((tiles != 0).sum()) == 2 * kvh * d  # nothing else written


@needs_kernel
def test_kernel_on_strided_query_rows_and_long_sequences():
    """q as the model hands it (a view into a wider qk tensor), lengths past 512."""
    h, kvh, d = 9, 3, 64
    q, k, v, kc, vc, meta, ref = _decode_case([700, 513, 1, 64], h, kvh, d, 16, seed=5)
    wide = torch.zeros(q.shape[0], h + kvh, d)
    wide[:, :h] = q
    out = torch.empty(q.shape[0], h, d)
    write_kv(k, v, kc, vc, meta.slot_mapping)
    qv = wide[:, :h]
    assert cpu_kernel.fits(qv, kc, vc, meta.block_tables, meta.seq_lens)
    cpu_kernel.attend(LIB, qv, kc, vc, meta.block_tables, meta.seq_lens, d**-0.5, out)
    assert _rel(out, ref) < 1e-6


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_thread_count_does_not_change_results(dtype: torch.dtype):
    q, k, v, kc, vc, meta, _ = _decode_case(LENS * 3, 8, 2, 64, 16, seed=11, dtype=dtype)
    backend = TorchAttentionBackend()
    one = backend.forward(q, k, v, kc, vc, meta, 0.125)
    torch.set_num_threads(2)
    try:
        two = backend.forward(q, k, v, kc, vc, meta, 0.125)
    finally:
        torch.set_num_threads(1)
    assert torch.equal(one, two)  # each sequence is computed whole by one thread


@needs_kernel
@pytest.mark.parametrize(
    "what, lens, table, row_seq",
    [
        ("block id past the cache", [20], [[0, 99]], None),
        ("negative block id", [20], [[0, -1]], None),
        ("length past the table", [40], [[0, 1]], None),
        ("negative length", [-1], [[0]], None),
        ("sequence index past the tables", [5], [[0]], [1]),
    ],
)
def test_kernel_refuses_bad_lengths_block_ids_and_sequences(what, lens, table, row_seq):
    kc = torch.randn(4, 16, 2, 32)
    vc = torch.randn(4, 16, 2, 32)
    q, out = torch.randn(1, 4, 32), torch.full((1, 4, 32), 7.0)
    tables = torch.tensor(table, dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    rows = None if row_seq is None else torch.tensor(row_seq, dtype=torch.int32)
    with pytest.raises(ValueError, match="query row 0"):
        cpu_kernel.attend(LIB, q, kc, vc, tables, seq_lens, 0.1, out, rows)
    assert bool((out == 7.0).all()), f"{what}: output written before the check"


@needs_kernel
def _row_reference(q, kc, vc, table: list[int], n: int, block_size: int = 8):
    """Attention of one query row [H, D] over the first n tokens of a block table,
    densely in float64 (GQA: query head h reads KV head h // (H // KVH))."""
    h, d = q.shape
    kvh = kc.shape[2]
    flat = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n)])
    kk = kc.view(-1, kvh, d)[flat].double().repeat_interleave(h // kvh, dim=1)
    vv = vc.view(-1, kvh, d)[flat].double().repeat_interleave(h // kvh, dim=1)
    p = (torch.einsum("hd,nhd->hn", q.double(), kk) * d**-0.5).softmax(-1)
    return torch.einsum("hn,nhd->hd", p, vv)


@needs_kernel
@pytest.mark.parametrize(
    "dtype, d", [(torch.float32, 32), (torch.bfloat16, 32), (torch.bfloat16, 24)]
)
def test_kernel_rows_pick_their_sequence_and_length_and_skip_zero_lengths(dtype, d):
    """Prefill-style rows: row r of a sequence attends its first r + 1 tokens (the
    causal rule), through a table picked by row_seq; rows of length 0 stay untouched."""
    h, kvh = 6, 2
    _, _, _, kc, vc, meta, _ = _decode_case([40, 24], h, kvh, d, 8, seed=9, dtype=dtype)
    rows = torch.tensor([0, 0, 1, 1, 0], dtype=torch.int32)
    lens = torch.tensor([1, 40, 24, 0, 17], dtype=torch.int32)
    qr = torch.randn(5, h, d, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = torch.full((5, h, d), 3.0, dtype=dtype)
    cpu_kernel.attend(LIB, qr, kc, vc, meta.block_tables, lens, d**-0.5, out, rows)
    for r, (seq, n) in enumerate(zip(rows.tolist(), lens.tolist(), strict=True)):
        if n == 0:
            assert bool((out[r] == 3.0).all())
            continue
        ref = _row_reference(qr[r], kc, vc, meta.block_tables[seq].tolist(), n)
        if dtype == torch.bfloat16:
            _assert_bf16_close(out[r], ref, float(vc.abs().max()))
        else:
            assert _rel(out[r], ref) < 1e-6


@needs_kernel
@pytest.mark.parametrize("d", [16, 32, 64, 128, 24])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_fp32_prefill_chunk_rows_in_groups_match_reference_and_rows_alone(d, group, block_size):
    """fp32 rows of one sequence in one call (a prefill chunk after a cached prefix, or a
    whole prompt) take the grouped code (up to 8 rows, K transposed per 16-token tile):
    each row against the float64 reference, and against the same row attended alone
    (one row per call never groups) to fp32 rounding. Chunks of 1, 7, 8, 9, 20 and 37
    rows starting at 0, 5 and 30 cached tokens (groups with a short last one; rows
    ending on and off 16-token tiles), two sequences interleaved in one call, and a
    length-0 row that must break a group and stay untouched."""
    kvh = 2
    h = kvh * group
    gen = torch.Generator().manual_seed(d * 100 + group * 10 + block_size)
    n_blocks = 40
    kc = torch.randn(n_blocks, block_size, kvh, d, generator=gen)
    vc = torch.randn(n_blocks, block_size, kvh, d, generator=gen)
    perm = torch.randperm(n_blocks, generator=gen).tolist()
    width = -(-70 // block_size)
    tables = torch.tensor([perm[:width], perm[width : 2 * width]], dtype=torch.int32)
    for ctx, n in [(0, 1), (0, 20), (5, 7), (5, 9), (30, 8), (30, 37)]:
        rows_seq, lens = [], []
        for i in range(n):  # sequence 0's chunk, with sequence 1's rows after its first 3
            rows_seq.append(0)
            lens.append(ctx + i + 1)
            if i == 2:
                rows_seq += [1, 1, 1]
                lens += [ctx + 1, 0, ctx + 3]
        r = len(lens)
        q = torch.randn(r, h, d, generator=gen)
        out = torch.full((r, h, d), 3.0)
        row_seq = torch.tensor(rows_seq, dtype=torch.int32)
        lens_t = torch.tensor(lens, dtype=torch.int32)
        cpu_kernel.attend(LIB, q, kc, vc, tables, lens_t, d**-0.5, out, row_seq)
        for i, (seq, n_tok) in enumerate(zip(rows_seq, lens, strict=True)):
            if n_tok == 0:
                assert bool((out[i] == 3.0).all()), "a length-0 row was written"
                continue
            ref = _row_reference(q[i], kc, vc, tables[seq].tolist(), n_tok, block_size)
            assert _rel(out[i], ref) < 1e-6, (ctx, n, i)
            alone = torch.empty(1, h, d)
            cpu_kernel.attend(
                LIB, q[i : i + 1], kc, vc, tables, lens_t[i : i + 1], d**-0.5, alone,
                row_seq[i : i + 1],
            )  # fmt: skip
            assert torch.allclose(out[i], alone[0], rtol=1e-5, atol=1e-6), (ctx, n, i)


@needs_kernel
@pytest.mark.parametrize(
    "dtype, limit, tol",
    [
        (torch.float32, "_KERNEL_MAX_PREFILL_LEN", 1e-6),
        # bf16 SDPA rows: test_torch_attention's bf16 tolerance
        (torch.bfloat16, "_KERNEL_MAX_PREFILL_LEN_BF16", 2e-2),
    ],
    ids=["fp32", "bf16"],
)
def test_long_prefills_go_to_sdpa_short_ones_to_the_kernel(monkeypatch, dtype, limit, tol):
    """One mixed batch split between the two paths (threshold lowered to 20 tokens):
    prefills with and without a cached prefix on both sides, plus decodes."""
    from test_torch_attention import _run_case

    monkeypatch.setattr(torch_backend, limit, 20)
    seqs = [(0, 13), (0, 40), (16, 3), (24, 9), (5, 1), (0, 1), (30, 1), (63, 1)]
    rel, _, _ = _run_case(seqs, 5, 3, 8, dtype, seed=4)
    assert rel < tol
    calls = []
    monkeypatch.setattr(torch_backend, "_prefill_one", lambda *a: calls.append(a[-2]) or 0.0)
    monkeypatch.setattr(cpu_kernel, "attend", lambda *a: calls.append(a[5].tolist()))
    _run_case(seqs, 5, 3, 8, dtype, seed=4)
    kernel_lens = calls[0]
    # rows of (0, 13), (16, 3) and (5, 1) and the decodes; 0 for (0, 40) and (24, 9)
    assert kernel_lens == [*range(1, 14), *[0] * 40, 17, 18, 19, *[0] * 9, 6, 1, 31, 64]
    assert sorted(p.seq_len for p in calls[1:]) == [33, 40]


def test_fits_rejects_what_the_kernel_cannot_read():
    q, kc = torch.randn(2, 4, 32), torch.randn(4, 16, 2, 32)
    tables, lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    assert cpu_kernel.fits(q, kc, kc, tables, lens)
    assert cpu_kernel.fits(q.bfloat16(), kc.bfloat16(), kc.bfloat16(), tables, lens)
    assert not cpu_kernel.fits(q.half(), kc.half(), kc.half(), tables, lens)
    assert not cpu_kernel.fits(q.bfloat16(), kc, kc, tables, lens)  # mixed dtypes
    assert not cpu_kernel.fits(q, kc, kc, tables.long(), lens)
    assert not cpu_kernel.fits(q.transpose(0, 1), kc, kc, tables, lens)  # strided heads
    assert not cpu_kernel.fits(q, kc[:, ::2], kc[:, ::2], tables, lens)  # strided cache
    assert not cpu_kernel.fits(torch.randn(2, 3, 32), kc, kc, tables, lens)  # 3 % 2 heads


@pytest.fixture
def fresh_load(monkeypatch, tmp_path):
    with fresh_library(cpu_kernel.load, monkeypatch, tmp_path) as cache_dir:
        yield cache_dir


def test_disabled_or_unbuildable_kernel_falls_back_to_torch(fresh_load, monkeypatch, caplog):
    q, k, v, kc, vc, meta, ref = _decode_case([5, 40], 6, 2, 32, 16, seed=3)
    monkeypatch.setenv("PAGEDSERVE_CPU_KERNEL", "0")
    with caplog.at_level("INFO", logger=cpu_kernel.__name__):
        assert cpu_kernel.load() is None
    assert [r.levelname for r in caplog.records] == ["INFO"]  # chosen: said quietly
    out = TorchAttentionBackend().forward(q, k, v, kc, vc, meta, 32**-0.5)
    assert _rel(out, ref) < 1e-6
    cpu_kernel.load.cache_clear()
    caplog.clear()
    monkeypatch.delenv("PAGEDSERVE_CPU_KERNEL")
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level("INFO", logger=cpu_kernel.__name__):
        assert cpu_kernel.load() is None
    # Not chosen: loud, with what to install.
    (record,) = caplog.records
    assert record.levelname == "WARNING" and "apt-get install gcc" in record.getMessage()
    assert list(fresh_load.rglob("*.so")) == []


@needs_kernel
def test_build_is_cached_per_source_and_reused(fresh_load):
    lib = cpu_kernel.load()
    assert lib is not None
    built = list(fresh_load.rglob("*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    cpu_kernel.load.cache_clear()
    assert cpu_kernel.load() is not None
    assert [p.stat().st_mtime_ns for p in fresh_load.rglob("*.so")] == [mtime]
    assert not [p for p in fresh_load.rglob("*") if p.suffix != ".so" and p.is_file()]


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "torch"])
def test_one_backend_serves_two_threads(use_kernel):
    """Per-step plans and gather buffers are per thread: two threads interleaving
    steps of different batches on one backend both get their own answers."""
    backend = TorchAttentionBackend(cpu_kernel=use_kernel)
    cases = [_decode_case([300, 500, 200, 9], 6, 2, 32, 8, seed=s) for s in (1, 2)]
    errors: list[float] = []
    barrier = threading.Barrier(2)

    def run(case):
        q, k, v, kc, vc, meta, ref = case
        for _ in range(20):
            barrier.wait()
            errors.append(_rel(backend.forward(q, k, v, kc, vc, meta, 32**-0.5), ref))

    threads = [threading.Thread(target=run, args=(c,)) for c in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 40
    assert max(errors) < 1e-6


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)
def test_cpu_malloc_tuning_is_applied_once_and_keeps_freed_pages():
    """model.tune_cpu_malloc (run by building a CPU model): a step's worth of freed
    multi-MB temporaries is reused by the next step instead of faulting again.

    Page-fault counts are a property of the machine and of the heap's layout (tuned,
    one round faulted 1, 6k or 31k pages on the same machine), so the claim is a
    ratio in steady state: the same rounds in two fresh processes, tuned and untuned,
    measured in this test."""
    if os.environ.get("PAGEDSERVE_MALLOC_TUNING") == "0":
        assert tune_cpu_malloc() is False
        return
    assert tune_cpu_malloc() is True
    assert tune_cpu_malloc() is True  # idempotent

    tuned = _steady_state_faults(tuning=True)
    untuned = _steady_state_faults(tuning=False)
    assert tuned * 4 < untuned, f"faults per round: tuned {tuned}, untuned {untuned}"


_FAULT_ROUND = """
import resource, sys, torch
from pagedserve.common.core.model import tune_cpu_malloc
assert tune_cpu_malloc() is (sys.argv[1] == "1")

def one_round():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    ts = [torch.empty(10 << 20).fill_(1.0) for _ in range(4)]  # 4 x 40 MB, then freed
    del ts
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

# 40 MB is above glibc's dynamic mmap threshold ceiling (32 MB), so untuned every
# round mmaps and faults afresh ([41009, 40964, 40964, ...] here); below it, glibc
# raises its own threshold after a round or two and untuned settles too. Tuned, the
# heap settles within three rounds ([40978, 10240, 40960, 0, 0, 0] here): a serving
# loop lives in that steady state, so rounds 4-6 are compared.
rounds = [one_round() for _ in range(6)]
print(sum(rounds[3:]))
"""


def _steady_state_faults(tuning: bool) -> int:
    """Page faults of rounds 4-6 of big temporaries, in a fresh process."""
    env = {**os.environ, "PAGEDSERVE_MALLOC_TUNING": "1" if tuning else "0"}
    out = subprocess.run(
        [sys.executable, "-c", _FAULT_ROUND, "1" if tuning else "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return int(out.stdout.split()[-1])


# ---- bf16 -----------------------------------------------------------------------------

# bf16 tolerance. Inputs are rounded to bf16 first and the float64 reference is
# computed from those same rounded values, so the kernel's only errors are its
# fp32 arithmetic and the final rounding of each output element to bf16. Hence,
# elementwise: |out - ref| <= half a bf16 ulp of ref (the output rounding, 2^-9
# relative) + BF16_ACC_ULPS * 2^-24 * max|v| (fp32 sums over at most ~800 terms
# whose rounding errors have random signs: about sqrt(n) units of 2^-24 at the
# scale of the sum, which is at most max|v|; measured here: <= 0.13 units). Any
# extra rounding to bf16 inside the kernel (of the softmax weights, say) would
# show as ~2^-9 of |out|, thousands of times this margin.
BF16_ACC_ULPS = 64


def _assert_bf16_close(out: torch.Tensor, ref: torch.Tensor, v_scale: float) -> None:
    assert out.dtype == torch.bfloat16
    tiny = torch.finfo(torch.float32).tiny
    half_ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(tiny))) - 8)
    excess = (out.double() - ref).abs() - half_ulp - BF16_ACC_ULPS * 2**-24 * v_scale
    worst = float(excess.max())
    assert worst <= 0, f"bf16 kernel error exceeds half an ulp + accumulation by {worst:.3g}"


@pytest.fixture
def kernel_calls(monkeypatch):
    """The dtypes of the q tensors handed to the C kernel, in order."""
    calls: list[torch.dtype] = []
    real = cpu_kernel.attend

    def spy(lib, q, *a, **kw):
        calls.append(q.dtype)
        return real(lib, q, *a, **kw)

    monkeypatch.setattr(cpu_kernel, "attend", spy)
    return calls


@needs_kernel
@pytest.mark.parametrize("d", [16, 32, 64, 128, 24])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_bf16_kernel_matches_dense_reference(d, group, block_size, kernel_calls):
    """Through the backend (new K/V written into the bf16 cache, then attended)."""
    kvh = 2
    q, k, v, kc, vc, meta, ref = _decode_case(
        LENS, kvh * group, kvh, d, block_size, seed=d, dtype=torch.bfloat16
    )
    out = TorchAttentionBackend().forward(q, k, v, kc, vc, meta, d**-0.5)
    assert kernel_calls == [torch.bfloat16]
    _assert_bf16_close(out, ref, float(vc.abs().max()))


@needs_kernel
@pytest.mark.parametrize("d", [64, 256])
def test_bf16_kernel_on_strided_query_rows_and_long_sequences(d):
    h, kvh = 9, 3
    q, k, v, kc, vc, meta, ref = _decode_case(
        [700, 513, 1, 64], h, kvh, d, 16, seed=5, dtype=torch.bfloat16
    )
    wide = torch.zeros(q.shape[0], h + kvh, d, dtype=torch.bfloat16)
    wide[:, :h] = q
    out = torch.empty(q.shape[0], h, d, dtype=torch.bfloat16)
    write_kv(k, v, kc, vc, meta.slot_mapping)
    qv = wide[:, :h]
    assert cpu_kernel.fits(qv, kc, vc, meta.block_tables, meta.seq_lens)
    cpu_kernel.attend(LIB, qv, kc, vc, meta.block_tables, meta.seq_lens, d**-0.5, out)
    _assert_bf16_close(out, ref, float(vc.abs().max()))


@needs_kernel
@pytest.mark.parametrize("block_size", [8, 16])
def test_bf16_mixed_batch_of_prefills_and_decodes_all_in_the_kernel(block_size, kernel_calls):
    """Prefills with and without a cached prefix and decodes, one bf16 kernel call."""
    from test_torch_attention import _run_case

    seqs = [(0, 13), (16, 3), (24, 9), (5, 1), (0, 1), (30, 1), (63, 1)]
    _, out, ref = _run_case(seqs, 3, 3, block_size, torch.bfloat16, seed=4)
    assert kernel_calls == [torch.bfloat16]
    # _run_case draws every K/V from N(0, 1) rounded to bf16: |v| < 6 here
    _assert_bf16_close(out, ref, 6.0)


@needs_kernel
@pytest.mark.parametrize(
    "march",
    [["-march=native", "-mno-avx512bf16"], ["-march=x86-64-v2"]],
    ids=["avx512f-without-bf16", "plain-c"],
)
def test_bf16_portable_paths_match_dense_reference(march, tmp_path):
    """The paths other CPUs take, built here with those instructions withheld: AVX-512F
    without AVX512_BF16 (two FMAs for the dot product) and no AVX-512 at all."""
    if platform.machine() != "x86_64":
        pytest.skip("x86 flags")
    if "avx512f" not in cpuinfo_flags() and "-mno-avx512bf16" in march:
        pytest.skip("no AVX-512 here")
    import ctypes

    flags = [f for f in cpu_kernel._FLAGS if not f.startswith("-march=")]
    out_so = tmp_path / "k.so"
    cmd = ["gcc", *flags, *march, "-o", str(out_so), str(cpu_kernel._SOURCE)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    lib = cpu_kernel.bind(ctypes.CDLL(str(out_so)))
    for d in (16, 32, 64, 256):
        for group in (1, 3):
            q, k, v, kc, vc, meta, ref = _decode_case(
                [*LENS, 300], 2 * group, 2, d, 16, seed=d, dtype=torch.bfloat16
            )
            write_kv(k, v, kc, vc, meta.slot_mapping)
            out = torch.empty_like(q)
            cpu_kernel.attend(lib, q, kc, vc, meta.block_tables, meta.seq_lens, d**-0.5, out)
            _assert_bf16_close(out, ref, float(vc.abs().max()))


# The engine in bf16, kernel against torch path. The two attentions differ only
# in rounding (each output element is within half a bf16 ulp of exact), but the
# difference passes through the layers and the logits are bf16 too: a logit
# between 8 and 16 moves in steps of 2^-4 = 0.0625 nats. Measured here: the
# chosen tokens' logprobs differ by <= 0.042; the bound is two such steps, far
# below what a wrong attention gives (several nats). Where the torch path's top
# two are closer than NEAR_TIE_NATS the greedy pick may go either way: the
# comparison of that sequence stops at the first divergence.
ENGINE_LOGPROB_TOL = 0.125
NEAR_TIE_NATS = 0.1


def _tiny_llama(head_dim: int) -> str:
    """A tiny random Llama (6 query heads over 2 KV heads) with this head size."""
    from builders import _randomize, tiny_config, tiny_tokenizer
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("llama")
    cfg.head_dim = head_dim
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _randomize(model, 0)
    out = tempfile.mkdtemp(prefix=f"pagedserve-bf16-d{head_dim}-")
    model.save_pretrained(out)
    tiny_tokenizer().save_pretrained(out)
    return out


def _greedy(llm, prompts, max_tokens=16):
    from pagedserve.common.api.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    return [o.completions[0] for o in llm.generate(prompts, params)]


@pytest.fixture
def kernel_memo_cleared_after(monkeypatch):
    """For a test that switches the kernel off for the process: `cpu_kernel.load`'s memo
    is cleared after it, so the next test loads the kernel again (from the build cache
    every engine uses). Not `fresh_load`: an empty cache dir made each such test compile
    the kernel afresh (~10 s), and building is test_build_is_cached_per_source_and_reused's
    subject, not theirs."""
    yield
    cpu_kernel.load.cache_clear()


@needs_kernel
@pytest.mark.parametrize("head_dim", [16, 64], ids=["d16-plain-C", "d64-avx512"])
def test_bf16_engine_with_kernel_matches_torch_path_and_falls_back(
    head_dim, kernel_calls, kernel_memo_cleared_after, monkeypatch
):
    import shutil

    from pagedserve.common.core.llm import LLM

    path = _tiny_llama(head_dim)
    try:
        llm = LLM(path, dtype="bfloat16", num_blocks=128, enable_prefix_caching=False)
        backend = llm.engine.model.attention_backend
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (9, 23, 40, 70)]

        with_kernel = _greedy(llm, prompts)
        assert kernel_calls and set(kernel_calls) == {torch.bfloat16}
        kernel_calls.clear()
        backend.cpu_kernel = False
        torch_path = _greedy(llm, prompts)
        assert kernel_calls == []
        compared = bf16_paths_agree(with_kernel, torch_path, NEAR_TIE_NATS, ENGINE_LOGPROB_TOL)
        assert compared >= 2 * 16  # most of it was compared (measured: 48 of 64)

        # the kernel switched off for the process: the torch path, bit for bit
        backend.cpu_kernel = True
        monkeypatch.setenv("PAGEDSERVE_CPU_KERNEL", "0")
        cpu_kernel.load.cache_clear()
        fallback = _greedy(llm, prompts)
        assert kernel_calls == []
        assert [c.token_ids for c in fallback] == [c.token_ids for c in torch_path]
        assert [[lp.logprob for lp in c.logprobs] for c in fallback] == [
            [lp.logprob for lp in c.logprobs] for c in torch_path
        ]
    finally:
        shutil.rmtree(path, ignore_errors=True)
