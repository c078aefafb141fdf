"""The torch paged-attention backend against a naive dense reference.

Each case builds sequences with random (never zero) K/V, writes the cached
context into a cache through randomly permuted block tables, hands the backend
only the new tokens, and compares with softmax attention computed densely in
float64 over the full per-sequence K/V (GQA by repeat_interleave, causal with the
context offset).

Tolerances (relative error ||out - ref|| / ||ref||): fp32 1e-5, bf16 2e-2
(bf16 inputs carry 8 mantissa bits: ~4e-3 per element, and SDPA accumulates
in fp32).
"""

from __future__ import annotations

import math

import pytest
import torch
from builders import make_metadata, one_torch_thread  # noqa: F401 (autouse fixture)

from pagedserve.common.core.attention import get_attention_backend, torch_backend
from pagedserve.common.core.attention.torch_backend import TorchAttentionBackend

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
HEAD_DIM = 32
NUM_KV_HEADS = 2


def _reference(q, k_full, v_full, ctx_len, scale):
    """q: [Tq, H, d]; k_full/v_full: [S, kvh, d]; queries at positions ctx_len + i."""
    group = q.shape[1] // k_full.shape[1]
    k = k_full.double().repeat_interleave(group, dim=1)  # [S, H, d]
    v = v_full.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,shd->hqs", q.double(), k) * scale  # [H, Tq, S]
    qpos = torch.arange(q.shape[0])[:, None] + ctx_len
    kpos = torch.arange(k.shape[0])[None, :]
    scores = scores.masked_fill(kpos > qpos, float("-inf"))
    return torch.einsum("hqs,shd->qhd", scores.softmax(-1), v)  # [Tq, H, d]


def _run_case(seqs, num_prefills, group, block_size, dtype, seed, backend=None):
    """seqs: [(ctx_len, q_len)] with prefills first. Returns (rel_err, backend_out, ref)."""
    g = torch.Generator().manual_seed(seed)
    h, kvh, d = NUM_KV_HEADS * group, NUM_KV_HEADS, HEAD_DIM
    blocks_needed = [math.ceil((c + q) / block_size) for c, q in seqs]
    num_blocks = sum(blocks_needed) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    k_cache = torch.randn(num_blocks, block_size, kvh, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kvh, d, generator=g).to(dtype)
    qs, ks, vs, refs, tables, slots = [], [], [], [], [], []
    for ctx, q_len in seqs:
        n = ctx + q_len
        table = [perm.pop() for _ in range(math.ceil(n / block_size))]
        k_full = torch.randn(n, kvh, d, generator=g).to(dtype)
        v_full = torch.randn(n, kvh, d, generator=g).to(dtype)
        q = torch.randn(q_len, h, d, generator=g).to(dtype)
        for p in range(ctx):  # the cached prefix is already in the cache
            k_cache[table[p // block_size], p % block_size] = k_full[p]
            v_cache[table[p // block_size], p % block_size] = v_full[p]
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx, n)]
        qs.append(q)
        ks.append(k_full[ctx:])
        vs.append(v_full[ctx:])
        refs.append(_reference(q, k_full, v_full, ctx, d**-0.5))
        tables.append(table)
    meta = make_metadata(
        [q for _, q in seqs], [c + q for c, q in seqs], tables, slots, num_prefills
    )
    backend = backend or TorchAttentionBackend()
    out = backend.forward(
        torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache, meta, d**-0.5
    )
    ref = torch.cat(refs)
    # the new tokens' K/V landed in their slots
    slot_t = torch.tensor(slots)
    torch.testing.assert_close(k_cache.view(-1, kvh, d)[slot_t], torch.cat(ks), rtol=0, atol=0)
    torch.testing.assert_close(v_cache.view(-1, kvh, d)[slot_t], torch.cat(vs), rtol=0, atol=0)
    rel = float((out.double() - ref).norm() / ref.norm())
    return rel, out, ref


# (ctx_len, q_len), prefills first. Lengths end mid-block and on block boundaries
# for block sizes 8, 16 and 32; prefills with and without a cached prefix.
def _mixed_batch(block_size: int) -> tuple[list[tuple[int, int]], int]:
    b = block_size
    prefills = [(0, 13), (0, 2 * b), (b, 5), (2 * b, b), (b + 3, 1)]
    decodes = [(0, 1), (b - 1, 1), (2 * b + 4, 1), (3 * b - 1, 1), (b + 1, 1)]
    return prefills + decodes, len(prefills)


@pytest.fixture(params=["one_chunk", "small_chunks"])
def decode_chunking(request, monkeypatch):
    """Decode sequences in one chunk, or cut into chunks of about 2 blocks of K."""
    if request.param == "small_chunks":
        monkeypatch.setattr(torch_backend, "_CHUNK_BYTES", 64 * NUM_KV_HEADS * HEAD_DIM * 4)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_mixed_batch_matches_dense_reference(group, block_size, dtype, decode_chunking):
    seqs, num_prefills = _mixed_batch(block_size)
    rel, out, _ = _run_case(
        seqs, num_prefills, group, block_size, dtype, seed=group * 100 + block_size
    )
    assert out.dtype == dtype
    assert rel < TOL[dtype], f"relative error {rel:.2e} >= {TOL[dtype]:.0e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_only_and_prefill_only_batches(dtype, decode_chunking):
    rel, _, _ = _run_case([(7, 1), (64, 1), (40, 1)], 0, 3, 16, dtype, seed=1)
    assert rel < TOL[dtype]
    rel, _, _ = _run_case([(0, 37), (16, 16), (5, 30)], 3, 3, 16, dtype, seed=2)
    assert rel < TOL[dtype]


def test_fp32_error_is_reported_small():
    """The fp32 path is not just within tolerance but at rounding level."""
    seqs, n_pre = _mixed_batch(16)
    rel, _, _ = _run_case(seqs, n_pre, 3, 16, torch.float32, seed=7)
    assert rel < 1e-6


def test_reads_blocks_written_by_another_sequence_in_the_same_step():
    """Seq B's cached prefix is the block seq A writes in this very step (base.py)."""
    torch.manual_seed(0)
    bs, kvh, d, h = 8, 2, 16, 6
    k_cache = torch.randn(6, bs, kvh, d)
    v_cache = torch.randn(6, bs, kvh, d)
    k_a, v_a, q_a = torch.randn(bs, kvh, d), torch.randn(bs, kvh, d), torch.randn(bs, h, d)
    k_b, v_b, q_b = torch.randn(3, kvh, d), torch.randn(3, kvh, d), torch.randn(3, h, d)
    # A: 8 new tokens in block 4. B: prefix = block 4 (A's), 3 new tokens in block 1.
    slots = [4 * bs + i for i in range(bs)] + [1 * bs + i for i in range(3)]
    meta = make_metadata([bs, 3], [bs, bs + 3], [[4], [4, 1]], slots, 2)
    out = TorchAttentionBackend().forward(
        torch.cat([q_a, q_b]), torch.cat([k_a, k_b]), torch.cat([v_a, v_b]),
        k_cache, v_cache, meta, d**-0.5,
    )  # fmt: skip
    ref_b = _reference(q_b, torch.cat([k_a, k_b]), torch.cat([v_a, v_b]), bs, d**-0.5)
    torch.testing.assert_close(out[bs:].double(), ref_b, rtol=1e-5, atol=1e-5)


def test_plan_is_rebuilt_for_a_new_metadata_object():
    """Same backend, two steps with different layouts: both correct."""
    backend = TorchAttentionBackend()
    rel1, _, _ = _run_case([(0, 9), (3, 1)], 1, 2, 8, torch.float32, 3, backend)
    rel2, _, _ = _run_case([(0, 4), (20, 1), (9, 1)], 1, 2, 8, torch.float32, 4, backend)
    rel3, _, _ = _run_case([(0, 4), (20, 1), (9, 1)], 1, 2, 16, torch.float32, 4, backend)
    assert max(rel1, rel2, rel3) < 1e-5


# ---- selection and bad input -----------------------------------------------------


def test_backend_selection():
    assert get_attention_backend(None, torch.device("cpu")).name == "torch"
    assert get_attention_backend("torch", "cpu").name == "torch"
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        get_attention_backend("flash", "cpu")


def _tiny_inputs(q_lens, seq_lens, num_prefills):
    kvh, h, d, bs = 1, 2, 8, 4
    t = sum(q_lens)
    cache = torch.randn(8, bs, kvh, d)
    tables = [[i] for i in range(len(q_lens))]
    meta = make_metadata(q_lens, seq_lens, tables, list(range(t)), num_prefills)
    return torch.randn(t, h, d), torch.randn(t, kvh, d), cache, meta


def test_decode_sequence_with_two_new_tokens_is_rejected():
    q, k, cache, meta = _tiny_inputs([2, 2], [2, 3], num_prefills=1)
    with pytest.raises(ValueError, match="decode sequence 1 has query_len 2"):
        TorchAttentionBackend().forward(q, k, k, cache, cache.clone(), meta, 1.0)


def test_inconsistent_prefill_token_count_is_rejected():
    q, k, cache, meta = _tiny_inputs([3, 1], [3, 2], num_prefills=1)
    meta.num_prefill_tokens = 2
    with pytest.raises(ValueError, match="num_prefill_tokens 2"):
        TorchAttentionBackend().forward(q, k, k, cache, cache.clone(), meta, 1.0)


def test_seq_len_shorter_than_query_is_rejected():
    q, k, cache, meta = _tiny_inputs([3], [2], num_prefills=1)
    with pytest.raises(ValueError, match="query_len 3 with seq_len 2"):
        TorchAttentionBackend().forward(q, k, k, cache, cache.clone(), meta, 1.0)


def test_decode_chunks_sort_by_length_and_respect_the_size_bound():
    lens = [40, 3, 17, 64, 9, 33]
    tables = [[i * 8 + j for j in range(-(-n // 8))] for i, n in enumerate(lens)]
    meta = make_metadata([1] * 6, lens, tables, [0] * 6, 0)
    chunks = torch_backend._decode_chunks(
        meta, meta.block_tables.long(), 8, chunk_tokens=48, device=torch.device("cpu")
    )
    rows = [c.rows.tolist() for c in chunks]
    assert rows == [[1, 4], [2], [5], [0], [3]]  # ascending length, <= 48 padded tokens
    assert [(c.n, c.max_len) for c in chunks] == [(2, 16), (1, 24), (1, 40), (1, 40), (1, 64)]
    assert chunks[0].blocks.tolist() == [8, 0, 32, 33]  # seq 1 padded with block 0
    assert chunks[0].mask[:, 0, 0].sum(-1).tolist() == [3, 9]
