"""Triton paged-attention kernels vs a dense torch reference, in the Triton interpreter.

conftest.py sets TRITON_INTERPRET=1 before triton is imported, so the kernels run on CPU
tensors. The interpreter costs ~3.5 ms per loop iteration of a program, so shapes are
small: few sequences, 2 KV heads, contexts under ~100 positions, and 16-wide tiles (the
kernels' minimum) so that short contexts still span several loop iterations: decode steps
of 16 positions cover two blocks of 8 or half a block of 32; prefill uses 16-row tiles
and steps of max(16, block_size).

Every input is random (randn K/V in every cache block, used or not; block tables drawn
from a random permutation of the pool), and context lengths are chosen per block size to
end on a block boundary, mid-block, one short of a boundary, and at a single token.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import builders
import pytest
import torch
from builders import PagedSession, hf_greedy, load_hf, tiny_checkpoint

from pagedserve.common.core.attention.base import AttentionMetadata
from pagedserve.common.core.attention.triton_backend import TritonAttentionBackend
from pagedserve.common.core.attention.triton_decode import paged_decode_attention
from pagedserve.common.core.attention.triton_prefill import paged_prefill_attention
from pagedserve.common.core.loader import load_model

# Relative error ||out - ref|| / ||ref|| against a fp32 reference over the same inputs.
# fp32: the kernels compute in fp32 throughout; only the summation order differs from the
#   reference (measured <= 2.2e-7).
FP32_TOL = 1e-5
# fp16: softmax probabilities are rounded to fp16 before the P @ V product and the output
#   is rounded to fp16, each a relative error up to 2**-11 ~ 4.9e-4 (measured <= 2.3e-4).
FP16_TOL = 2e-3
# bf16: 8-bit significand, each rounding up to 2**-8 ~ 3.9e-3 (measured <= 3.3e-3). The
#   interpreter's bf16 `tl.dot` is broken, so there the kernels upcast dot operands to fp32
#   (DOT_FP32); the roundings of P and of the output remain.
BF16_TOL = 1.6e-2
TOLERANCE = {torch.float32: FP32_TOL, torch.float16: FP16_TOL, torch.bfloat16: BF16_TOL}

NUM_KV_HEADS = 2
HEAD_DIM = 64
TILE = 16  # BLOCK_N (and BLOCK_M) in the kernel tests


# ---- builders -----------------------------------------------------------------------


def random_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype, gen
) -> tuple[torch.Tensor, torch.Tensor]:
    """k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], all randn."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return (
        torch.randn(shape, generator=gen).to(dtype),
        torch.randn(shape, generator=gen).to(dtype),
    )


def random_block_tables(seq_lens: list[int], block_size: int, num_blocks: int, gen) -> torch.Tensor:
    """[B, max_blocks] int32: distinct blocks drawn from a permutation of the pool, 0-padded."""
    needed = [math.ceil(n / block_size) for n in seq_lens]
    assert sum(needed) <= num_blocks, "pool too small for the test's sequences"
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.zeros(len(seq_lens), max(needed), dtype=torch.int32)
    taken = 0
    for i, n in enumerate(needed):
        table[i, :n] = torch.tensor(perm[taken : taken + n], dtype=torch.int32)
        taken += n
    return table


def context_lengths(block_size: int) -> list[int]:
    """Boundary, mid-block, one short of a boundary, a single token."""
    return [2 * block_size, 3 * block_size + block_size // 2 + 1, 2 * block_size - 1, 1]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


# ---- reference ----------------------------------------------------------------------


def reference_attention(
    q: torch.Tensor,  # [T, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    query_lens: list[int],
    seq_lens: list[int],
    scale: float,
) -> torch.Tensor:  # [T, num_q_heads, head_dim] fp32
    """Dense fp32 attention: gather each sequence's context, causal mask with offset."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float32)
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        pos = torch.arange(seq_len)
        blocks = block_tables[i, pos // block_size].long()
        # k, v: [seq_len, num_q_heads, head_dim] (each KV head repeated for its group)
        k = k_cache[blocks, pos % block_size].float().repeat_interleave(group, dim=1)
        v = v_cache[blocks, pos % block_size].float().repeat_interleave(group, dim=1)
        qs = q[start : start + q_len].float()  # [q_len, H, D]
        scores = torch.einsum("thd,shd->hts", qs, k) * scale  # [H, q_len, seq_len]
        q_pos = torch.arange(seq_len - q_len, seq_len)
        scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[start : start + q_len] = torch.einsum("hts,shd->thd", scores.softmax(-1), v)
        start += q_len
    return out


@dataclass
class Case:
    """The new tokens' queries over a random paged cache, and the reference to check with."""

    q: torch.Tensor  # [T, num_q_heads, head_dim]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    tables: torch.Tensor
    query_lens: list[int]
    seq_lens: list[int]
    scale: float

    def error(self, out: torch.Tensor, label: str) -> float:
        """`out`'s relative error against the dense reference (printed under `label`)."""
        ref = reference_attention(
            self.q,
            self.k_cache,
            self.v_cache,
            self.tables,
            self.query_lens,
            self.seq_lens,
            self.scale,
        )
        assert out.dtype == self.q.dtype and out.shape == self.q.shape
        err = rel_err(out, ref)
        print(f"{label}: rel err {err:.2e}")
        return err


def random_case(
    query_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    group: int,
    dtype: torch.dtype,
    seed: int,
    head_dim: int,
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(math.ceil(n / block_size) for n in seq_lens) + 3  # + unused blocks
    k_cache, v_cache = random_cache(num_blocks, block_size, NUM_KV_HEADS, head_dim, dtype, gen)
    tables = random_block_tables(seq_lens, block_size, num_blocks, gen)
    q = torch.randn(sum(query_lens), NUM_KV_HEADS * group, head_dim, generator=gen).to(dtype)
    return Case(q, k_cache, v_cache, tables, query_lens, seq_lens, head_dim**-0.5)


# ---- decode -------------------------------------------------------------------------


def run_decode_case(
    block_size: int,
    group: int,
    dtype: torch.dtype,
    num_splits: int,
    seed: int,
    head_dim: int = HEAD_DIM,
    seq_lens: list[int] | None = None,
) -> float:
    seq_lens = seq_lens or context_lengths(block_size)
    c = random_case([1] * len(seq_lens), seq_lens, block_size, group, dtype, seed, head_dim)
    out = paged_decode_attention(
        c.q,
        c.k_cache,
        c.v_cache,
        c.tables,
        torch.tensor(seq_lens, dtype=torch.int32),
        c.scale,
        max_seq_len=max(seq_lens),
        num_splits=num_splits,
        block_n=TILE,
    )
    return c.error(out, f"decode bs={block_size} group={group} {dtype} splits={num_splits}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decode_matches_reference(block_size: int, group: int, dtype: torch.dtype) -> None:
    err = run_decode_case(block_size, group, dtype, num_splits=1, seed=block_size * 10 + group)
    assert err < TOLERANCE[dtype]


@pytest.mark.parametrize(
    ("block_size", "group", "dtype", "num_splits"),
    [(8, 3, torch.float32, 3), (16, 4, torch.float16, 2), (32, 1, torch.float32, 4)],
)
def test_decode_split_kv_matches_reference(
    block_size: int, group: int, dtype: torch.dtype, num_splits: int
) -> None:
    """Flash-decoding: the short sequences leave tail splits empty (lse = -inf)."""
    err = run_decode_case(block_size, group, dtype, num_splits, seed=7 + num_splits)
    assert err < TOLERANCE[dtype]


def test_decode_bf16_and_odd_head_dim() -> None:
    """bf16 (dot operands upcast in the interpreter) and head_dim 40, padded to 64."""
    assert run_decode_case(16, 3, torch.bfloat16, 2, seed=3) < BF16_TOL
    assert run_decode_case(16, 3, torch.float32, 1, seed=4, head_dim=40) < FP32_TOL


# ---- prefill with a cached prefix --------------------------------------------------


def prefill_shapes(block_size: int) -> tuple[list[int], list[int]]:
    """(query_lens, seq_lens): a cached prefix ending mid-block, one ending on a boundary,
    a fresh prompt ending mid-block, and one new token completing a block."""
    query_lens = [5, block_size, block_size + 5, 1]
    cached = [block_size + 3, 2 * block_size, 0, block_size - 1]
    return query_lens, [c + n for c, n in zip(cached, query_lens, strict=True)]


def run_prefill_case(
    block_size: int, group: int, dtype: torch.dtype, seed: int, head_dim: int = HEAD_DIM
) -> float:
    query_lens, seq_lens = prefill_shapes(block_size)
    c = random_case(query_lens, seq_lens, block_size, group, dtype, seed, head_dim)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    out = paged_prefill_attention(
        c.q,
        c.k_cache,
        c.v_cache,
        query_start_loc.to(torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
        c.tables,
        c.scale,
        max_query_len=max(query_lens),
        block_m=TILE,
        block_n=max(TILE, block_size),  # decode covers steps shorter than a block
    )
    return c.error(out, f"prefill bs={block_size} group={group} {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_prefill_with_cached_prefix_matches_reference(
    block_size: int, group: int, dtype: torch.dtype
) -> None:
    err = run_prefill_case(block_size, group, dtype, seed=100 + block_size * 10 + group)
    assert err < TOLERANCE[dtype]


def test_prefill_bf16_and_odd_head_dim() -> None:
    assert run_prefill_case(8, 3, torch.bfloat16, seed=5) < BF16_TOL
    assert run_prefill_case(16, 4, torch.float32, seed=6, head_dim=40) < FP32_TOL


# ---- the backend over a mixed batch -----------------------------------------------


def slots_for(table_row: torch.Tensor, positions: range, block_size: int) -> list[int]:
    return [int(table_row[p // block_size]) * block_size + p % block_size for p in positions]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_backend_mixed_batch(dtype: torch.dtype) -> None:
    """Prefills (cached prefix, fresh, and a prefix hit on a block written this very step)
    then decodes, through `TritonAttentionBackend.forward` with the kernels' default tiles
    and the default model's 9 query heads over 3 KV heads."""
    gen = torch.Generator().manual_seed(42 + (dtype == torch.float16))
    block_size, kv_heads, group, head_dim = 16, 3, 3, 64
    # seq 0: fresh prompt of 20 (writes blocks 0-1 of its table this step)
    # seq 1: prefill of 7 over a 16-token prefix = seq 0's first block, written this step
    # seq 2: prefill of 9 over a cached prefix of 37 (ends mid-block)
    # seqs 3-5: decodes at context 1, 48 (boundary) and 75
    query_lens = [20, 7, 9, 1, 1, 1]
    seq_lens = [20, 23, 46, 1, 48, 75]
    num_prefills = 3
    num_blocks = 24
    k_cache, v_cache = random_cache(num_blocks, block_size, kv_heads, head_dim, dtype, gen)
    tables = random_block_tables(seq_lens, block_size, num_blocks, gen)
    tables[1, 0] = tables[0, 0]  # the shared first block
    total = sum(query_lens)
    q = torch.randn(total, kv_heads * group, head_dim, generator=gen).to(dtype)
    k = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)

    slot_mapping: list[int] = []
    for i, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        slot_mapping += slots_for(tables[i], range(seq_len - q_len, seq_len), block_size)
    starts = [0, *torch.tensor(query_lens).cumsum(0).tolist()]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        num_prefills=num_prefills,
        num_prefill_tokens=sum(query_lens[:num_prefills]),
        num_decode_tokens=len(query_lens) - num_prefills,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )
    scale = head_dim**-0.5
    backend = TritonAttentionBackend()
    assert backend.name == "triton"
    out = backend.forward(q, k, v, k_cache, v_cache, meta, scale)

    # K/V landed in their slots before attention read them.
    flat = torch.tensor(slot_mapping)
    assert torch.equal(k_cache.view(-1, kv_heads, head_dim)[flat], k)
    assert torch.equal(v_cache.view(-1, kv_heads, head_dim)[flat], v)
    ref = reference_attention(q, k_cache, v_cache, tables, query_lens, seq_lens, scale)
    err = rel_err(out, ref)
    print(f"backend mixed batch {dtype}: rel err {err:.2e}")
    assert out.shape == q.shape and out.dtype == dtype
    assert err < TOLERANCE[dtype]
    # Each part against the reference separately, so one cannot hide in the other's norm.
    n_pre = meta.num_prefill_tokens
    assert rel_err(out[:n_pre], ref[:n_pre]) < TOLERANCE[dtype]
    assert rel_err(out[n_pre:], ref[n_pre:]) < TOLERANCE[dtype]


# ---- bad input --------------------------------------------------------------------


def _decode_inputs(
    num_q_heads: int = 6, head_dim: int = 16, dtype: torch.dtype = torch.float32
) -> dict:
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = random_cache(4, 8, 2, head_dim, dtype, gen)
    return {
        "q": torch.randn(1, num_q_heads, head_dim, generator=gen).to(dtype),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": torch.tensor([[1, 2]], dtype=torch.int32),
        "seq_lens": torch.tensor([10], dtype=torch.int32),
        "scale": 0.25,
        "max_seq_len": 10,
    }


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="head_dim 320"):
        paged_decode_attention(**_decode_inputs(head_dim=320))
    with pytest.raises(ValueError, match=r"num_q_heads \(5\) must be a multiple of num_kv_heads"):
        paged_decode_attention(**_decode_inputs(num_q_heads=5))
    args = _decode_inputs()
    args["q"] = args["q"].half()
    with pytest.raises(ValueError, match="share a dtype"):
        paged_decode_attention(**args)
    args = _decode_inputs()
    args["block_tables"] = args["block_tables"].long()
    with pytest.raises(ValueError, match="must be int32"):
        paged_decode_attention(**args)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        paged_decode_attention(**_decode_inputs(), block_n=24)
    backend = TritonAttentionBackend()
    assert backend.supports(64, torch.float16) is None
    assert "head_dim 512" in backend.supports(512, torch.float16)
    assert "float64" in backend.supports(64, torch.float64)


def test_cpu_without_interpreter_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="need a CUDA device, or TRITON_INTERPRET=1"):
        paged_decode_attention(**_decode_inputs())


# ---- the real compiler ------------------------------------------------------------


def test_kernels_compile_for_a_gpu(tmp_path: Path) -> None:
    """The interpreter accepts what a GPU would not (dot tiles under 16, over-budget shared
    memory): compile decode, merge and prefill for sm_90 down to a cubin with Triton's
    ptxas, in a child process without TRITON_INTERPRET (no GPU needed)."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("TRITON_INTERPRET", None)
    report = tmp_path / "compile.json"
    cmd = [sys.executable, "-m", "benchmarks.triton_compile", "--arch", "90", "--dtype", "fp16"]
    cmd += ["--shape", "3", "16", "64", "--json", str(report)]
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(report.read_text())
    assert [r["kernel"] for r in results] == ["decode", "merge", "prefill"]
    assert all(r["ok"] and 0 < r["shared_bytes"] <= r["limit_bytes"] for r in results)


# ---- the model on the Triton backend ----------------------------------------------


def _prompt(n: int, salt: int) -> list[int]:
    return [3 + (i * 37 + salt * 11) % (builders.TINY_VOCAB - 3) for i in range(n)]


def test_tiny_model_on_triton_backend_matches_transformers() -> None:
    """Greedy decoding of the tiny Qwen3 (9 q over 3 KV heads, head_dim 16, 2 layers) with
    every attention on the Triton kernels equals `transformers` generate, token for token.
    Step 1 prefills prompts of 3, 16 and 21 tokens (block size 8: mid-block and on a
    boundary); step 2 is a mixed batch: a prompt whose first 2 blocks are a prefix-cache
    hit on prompt c's blocks is prefilled while a, b and c decode; then all decode."""
    path = tiny_checkpoint("qwen3")
    model = load_model(str(path), attention_backend="triton").model
    assert model.attention_backend.name == "triton"
    steps = 14
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: OpenMP barriers on 2 shared cores cost more
    try:
        sess = PagedSession(model, num_blocks=64, block_size=8, seed=1)
        prompts = {"a": _prompt(3, 1), "b": _prompt(16, 2), "c": _prompt(21, 3)}
        for name, p in prompts.items():
            sess.add(name, p)
        prefill, decode = list(prompts), []
        for step in range(steps):
            if step == 1:
                prompts["later"] = prompts["c"][:16] + _prompt(5, 5)
                sess.add_with_prefix("later", prompts["later"], "c", n_blocks=2)
                prefill, decode = ["later"], ["a", "b", "c"]
            for name, row in sess.step(prefill, decode).items():
                sess.seqs[name].tokens.append(int(row.argmax()))
            prefill, decode = [], list(prompts)
        hf = load_hf(path)
        for name, p in prompts.items():
            ours = sess.seqs[name].tokens[len(p) :]
            assert len(ours) == (steps - 1 if name == "later" else steps)
            assert ours == hf_greedy(hf, p, len(ours)), f"prompt {name}"
    finally:
        torch.set_num_threads(threads)


# ---- the benchmark runs end to end on CPU -----------------------------------------


def test_attention_benchmark_runs_on_cpu(tmp_path: Path) -> None:
    """`benchmarks/attention.py` on a one-point grid: torch backend and dense SDPA rows in
    the JSON, the backend's output equal to SDPA's, bandwidths against a measured copy."""
    from benchmarks import attention

    report = tmp_path / "attention.json"
    argv = ["--device", "cpu", "--batch", "2", "--context", "40"]
    assert attention.main([*argv, "--rotate-mib", "1", "--json", str(report)]) == 0
    data = json.loads(report.read_text())
    rows = data["results"]
    assert [(r["batch"], r["context"], r["backend"]) for r in rows] == [
        (2, 40, "sdpa"),
        (2, 40, "torch"),
    ]
    assert data["copy_bandwidth_gbs"] > 0
    torch_row = rows[1]
    assert torch_row["max_rel_err"] < FP32_TOL
    assert torch_row["ms_per_step"] == pytest.approx(30 * torch_row["ms_per_layer"])
    assert torch_row["vs_sdpa"] == pytest.approx(
        rows[0]["ms_per_layer"] / torch_row["ms_per_layer"]
    )
