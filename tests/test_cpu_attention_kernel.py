"""The compiled CPU decode kernel (common/attention/cpu_decode.c) and its fallback.

The kernel is compared with softmax attention computed densely in float64 and
with the pure-torch decode path, over head sizes that take its AVX-512 code
(16, 32, 64, 128 where the CPU has AVX-512) and its plain-C code (24), GQA group
sizes 1/3/4, block sizes 8/16/32 and lengths ending inside and on the edge of
blocks and 16-token tiles. Also: bad lengths/block ids are refused before any
read, thread count does not change results, a disabled or unbuildable kernel
falls back to torch, builds are cached, and one backend serves two threads.
Also the process-wide malloc tuning that CPU models apply (model.py).
"""

from __future__ import annotations

import math
import os
import platform
import resource
import threading

import pytest
import torch
from builders import make_metadata, one_torch_thread  # noqa: F401 (autouse fixture)

from pagedserve.common.attention import cpu_kernel
from pagedserve.common.attention.base import write_kv
from pagedserve.common.attention.torch_backend import TorchAttentionBackend
from pagedserve.common.model import tune_cpu_malloc

LIB = cpu_kernel.load()
needs_kernel = pytest.mark.skipif(LIB is None, reason="the CPU kernel did not build here")


def _decode_case(lens, h, kvh, d, block_size, seed):
    """Decode-only batch over a randomly permuted cache. Returns tensors + reference."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = sum(math.ceil(n / block_size) for n in lens) + 2
    perm = torch.randperm(n_blocks, generator=g).tolist()
    k_cache = torch.randn(n_blocks, block_size, kvh, d, generator=g)
    v_cache = torch.randn(n_blocks, block_size, kvh, d, generator=g)
    tables, refs, slots = [], [], []
    q = torch.randn(len(lens), h, d, generator=g)
    k_new = torch.randn(len(lens), kvh, d, generator=g)
    v_new = torch.randn(len(lens), kvh, d, generator=g)
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
    cpu_kernel.decode_f32(LIB, qv, kc, vc, meta.block_tables, meta.seq_lens, d**-0.5, out)
    assert _rel(out, ref) < 1e-6


@needs_kernel
def test_thread_count_does_not_change_results():
    q, k, v, kc, vc, meta, _ = _decode_case(LENS * 3, 8, 2, 64, 16, seed=11)
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
    "what, lens, table",
    [
        ("block id past the cache", [20], [[0, 99]]),
        ("negative block id", [20], [[0, -1]]),
        ("length past the table", [40], [[0, 1]]),
        ("zero length", [0], [[0]]),
    ],
)
def test_kernel_refuses_bad_lengths_and_block_ids(what, lens, table):
    kc = torch.randn(4, 16, 2, 32)
    vc = torch.randn(4, 16, 2, 32)
    q, out = torch.randn(1, 4, 32), torch.full((1, 4, 32), 7.0)
    tables = torch.tensor(table, dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    with pytest.raises(ValueError, match="decode sequence 0"):
        cpu_kernel.decode_f32(LIB, q, kc, vc, tables, seq_lens, 0.1, out)
    assert bool((out == 7.0).all()), f"{what}: output written before the check"


def test_fits_rejects_what_the_kernel_cannot_read():
    q, kc = torch.randn(2, 4, 32), torch.randn(4, 16, 2, 32)
    tables, lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    assert cpu_kernel.fits(q, kc, kc, tables, lens)
    assert not cpu_kernel.fits(q.bfloat16(), kc.bfloat16(), kc.bfloat16(), tables, lens)
    assert not cpu_kernel.fits(q, kc, kc, tables.long(), lens)
    assert not cpu_kernel.fits(q.transpose(0, 1), kc, kc, tables, lens)  # strided heads
    assert not cpu_kernel.fits(q, kc[:, ::2], kc[:, ::2], tables, lens)  # strided cache
    assert not cpu_kernel.fits(torch.randn(2, 3, 32), kc, kc, tables, lens)  # 3 % 2 heads


@pytest.fixture
def fresh_load(monkeypatch, tmp_path):
    """`cpu_kernel.load` with its memo cleared and the build cache in tmp_path."""
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    cpu_kernel.load.cache_clear()
    yield tmp_path
    cpu_kernel.load.cache_clear()


def test_disabled_or_unbuildable_kernel_falls_back_to_torch(fresh_load, monkeypatch):
    q, k, v, kc, vc, meta, ref = _decode_case([5, 40], 6, 2, 32, 16, seed=3)
    monkeypatch.setenv("PAGEDSERVE_CPU_KERNEL", "0")
    assert cpu_kernel.load() is None
    out = TorchAttentionBackend().forward(q, k, v, kc, vc, meta, 32**-0.5)
    assert _rel(out, ref) < 1e-6
    cpu_kernel.load.cache_clear()
    monkeypatch.delenv("PAGEDSERVE_CPU_KERNEL")
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert cpu_kernel.load() is None
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
    """model.tune_cpu_malloc (run by building a CPU model): a freed 16 MB tensor's
    pages are reused by the next one of that size instead of faulting again."""
    if os.environ.get("PAGEDSERVE_MALLOC_TUNING") == "0":
        assert tune_cpu_malloc() is False
        return
    assert tune_cpu_malloc() is True
    assert tune_cpu_malloc() is True  # idempotent
    torch.empty(4 << 20).fill_(1.0)  # allocate, touch, free
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(4 << 20).fill_(2.0)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before < 100  # 4096 untuned
