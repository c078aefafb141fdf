"""Paged attention in plain torch, plus a compiled CPU kernel for fp32 and bf16: the
CPU default and the reference for kernels.

Per layer: write the new K/V into the cache (`write_kv`), then attend.

fp32 and bf16 on the CPU (when `cpu_kernel.py` could build `cpu_attention.c`): one kernel
call per layer attends every decode token and every token of the prefills up to
`_KERNEL_MAX_PREFILL_LEN` long, each token as one query row reading its
sequence's blocks in place through the block table (K once, V once, an exact
softmax per head in between): a decode token over its whole context, a prefill
token at position p over the first p + 1 tokens (the causal rule, cached prefix
or not). Per step the plan holds each row's sequence and length.
Measured on the 2-core Xeon here:
  - decode, one layer, 64 sequences of 100-600 tokens (23.8k context tokens), 2
    threads: torch path 5.8 ms, kernel 2.7 ms, merely reading those 37 MB
    of K/V (a `sum`) 1.9 ms: decode attention is memory-bound and the kernel is
    within 1.4x of the read (1 thread, CPU time: 11.6 / 5.5 / 3.9 ms). In the
    engine a batch-64 decode step went from 262 to 198 ms (interleaved A/B).
  - prefill, one sequence, 2 threads, against SDPA (flash, `is_causal`): 128
    tokens 0.30 vs 0.66 ms, 256: 0.92 vs 1.08, 512: 3.2 vs 4.0, 640: 5.9 vs 6.7,
    768: 8.6 vs 7.4 (the kernel does no GEMM, so long prompts are SDPA's: hence
    the 640 limit). A whole 2048-token prefill forward (8 x 256 tokens): 2242 ->
    1877 ms, a mix of 16-500 tokens 2300 -> 1842 ms (medians of 8, alternating).
(An earlier C trial gained only 1.2-1.6x on decode: a straightforward loop spends
its time in per-token horizontal sums and scalar exp; see the C file.)
bf16 (K/V cache in bf16, fp32 arithmetic inside): on an EPYC with avx512_bf16
(no AMX), one layer of the batch-64 decode above at context 257, 1 thread,
medians of 15 alternating: bf16 kernel 2.6 ms, fp32 kernel 4.3, bf16 torch path
6.3 (it was the only bf16 path before). Prefill limit: `_KERNEL_MAX_PREFILL_LEN_BF16`.

Prefill sequences otherwise (longer, other dtypes or devices, `cpu_kernel=False`,
no compiler), one SDPA call each:
  - no cached prefix (ctx == 0): attend over the sequence's own new q/k/v with
    `is_causal`; the cache is not read at all.
  - cached prefix (ctx > 0): gather the K/V blocks of positions [0, seq_len)
    through the block table and use an explicit mask: query i (position ctx + i)
    sees keys j <= ctx + i.

Decode otherwise (other dtypes or devices, `cpu_kernel=False`, no compiler),
a few batched SDPA calls:
  the sequences are sorted by context length and cut into chunks of at most
  `_CHUNK_BYTES` of gathered K (one sequence per chunk if it alone is longer).
  Per chunk, one `index_select` of whole blocks over the cache gathers a padded
  [n, L, kvh, d] K and V (L = the chunk's longest context in whole blocks), and
  one SDPA with a padding mask attends. GQA packs the `group` query heads of a
  KV head as `group` query rows: q [n, kvh, group, d] against k [n, kvh, L, d],
  so K/V are never expanded (and no causal mask is needed: every query of a
  decode sequence sits at its last position).

Measured for that path (64 decode sequences of 100-700 tokens, fp32, one
layer): a fresh padded gather + SDPA 48 ms; with the gather writing into
buffers kept across layers and steps 10-11 ms (fresh multi-MB tensors cost page
faults: 6.7 MB took 1.3 ms fresh, 0.6 ms reused). Chunking then changes little
(3 MiB chunks vs one padded batch: 11.0 vs 10.5 ms on 2 threads, 16.3 vs 17.9 ms
on 1), but it bounds the buffers (one padded batch of 64 long sequences is tens
of MB) and sorting cuts the padding (29k instead of 45k gathered tokens for 27k
real ones).

GQA in prefill expands K/V with stride-0 views ([kvh, group, S, d]); this was
2.5-4x faster than `enable_gqa=True` or `repeat_interleave`.

Index tensors and masks depend only on the metadata and the block size, so they
are built once per step (by the first layer) and reused by the other layers: the
backend keeps the last metadata object and its plan, and rebuilds when handed a
different object. Metadata must therefore not be mutated once a step has begun
(build a new one per step). That plan and the gather buffers are kept per
thread (`threading.local`), so one backend (one loaded model) may serve engines
on several threads; the C kernel keeps no state between calls.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedserve.common.core.attention import cpu_kernel
from pagedserve.common.core.attention.base import AttentionBackend, AttentionMetadata, LayerKV

# Upper bound on one decode chunk's gathered K (the same again for V).
_CHUNK_BYTES = 3 << 20
# Prefill sequences up to this length go through the C kernel, longer ones SDPA
# (fp32: measured on a Xeon, see the top).
_KERNEL_MAX_PREFILL_LEN = 640
# bf16: the kernel reads half the bytes and SDPA's bf16 path gained nothing over
# its fp32 one on an EPYC with avx512_bf16 (no AMX), one sequence, 1 thread,
# kernel vs SDPA, median ms: 256 tokens 1.2 vs 3.5, 512: 7.5 vs 24, 1024: 16 vs
# 28, 2048 (2 threads) 211 vs 354. Capped at 1024 all the same: on a CPU with
# AMX, SDPA's GEMMs run on the tile units and long prompts may well be its
# (not measured).
_KERNEL_MAX_PREFILL_LEN_BF16 = 1024


def _kernel_max_prefill_len(dtype: torch.dtype) -> int:
    return _KERNEL_MAX_PREFILL_LEN_BF16 if dtype == torch.bfloat16 else _KERNEL_MAX_PREFILL_LEN


@dataclass
class _PrefillPlan:
    q_start: int
    q_len: int
    ctx_len: int  # tokens already in the cache before this step
    seq_len: int
    blocks: torch.Tensor | None  # [n_blocks] int64 block ids, None when ctx_len == 0
    mask: torch.Tensor | None  # [q_len, seq_len] bool, True = attend


@dataclass
class _DecodeChunk:
    rows: torch.Tensor | None  # [n] int64 rows among the decode tokens; None = all, in order
    blocks: torch.Tensor  # [n * n_blocks] int64 block ids, padded with block 0
    mask: torch.Tensor  # [n, 1, 1, L] bool, True = attend
    n: int
    max_len: int  # L: padded context length (whole blocks)


@dataclass
class _Plan:
    prefills: list[_PrefillPlan]
    tables: torch.Tensor  # [B, max_blocks] int64 block tables on the cache's device
    block_size: int
    token_bytes: int  # one token's K bytes in one layer (kvh * d * element size)
    decode_chunks: list[_DecodeChunk] | None = None  # built on first torch decode
    # for the C kernel, built on first use: each token row's sequence and how many
    # tokens it attends (0 for rows of prefills left to SDPA), both [T] int32
    kernel_rows: tuple[torch.Tensor, torch.Tensor] | None = None


class _ThreadState(threading.local):
    """What one thread's calls keep between layers: the plan of the step in flight
    and the decode gather buffers. Per thread, so that engines on different
    threads may share one backend (and one model)."""

    def __init__(self) -> None:
        self.plan_meta: AttentionMetadata | None = None
        self.plan_key: tuple | None = None
        self.plan: _Plan | None = None
        self.buffers: dict[tuple, torch.Tensor] = {}


class TorchAttentionBackend(AttentionBackend):
    """Gather-by-block-table + SDPA. Works on any device and dtype torch supports.

    `cpu_kernel`: run fp32/bf16 decode and short prefills on the CPU through the
    compiled kernel (`cpu_kernel.py`) when it builds here; False keeps every path
    in torch.
    """

    name = "torch"

    def __init__(self, cpu_kernel: bool = True) -> None:
        self.cpu_kernel = cpu_kernel
        self._state = _ThreadState()

    def supports(self, head_dim: int, dtype: torch.dtype) -> str | None:
        """None when (head_dim, dtype) can run here, else the reason it cannot."""
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return f"dtype {dtype} is not supported (fp32, fp16, bf16)"
        return None

    def attend(
        self, q: torch.Tensor, kv: LayerKV, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        k, v, k_cache, v_cache = kv.k, kv.v, kv.k_cache, kv.v_cache
        plan = self._get_plan(meta, k_cache)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)  # ~2x cheaper
        lib = cpu_kernel.load() if self.cpu_kernel else None
        tables = meta.block_tables
        kernel = lib is not None and cpu_kernel.fits(q, k_cache, v_cache, tables, meta.seq_lens)
        max_prefill = _kernel_max_prefill_len(q.dtype)
        if kernel:  # decode rows and short prefills' rows, in one call
            row_seq, row_lens = _kernel_rows(plan, meta, max_prefill)
            cpu_kernel.attend(lib, q, k_cache, v_cache, tables, row_lens, scale, out, row_seq)
        for p in plan.prefills:
            if not kernel or p.seq_len > max_prefill:
                out[p.q_start : p.q_start + p.q_len] = _prefill_one(
                    q, k, v, k_cache, v_cache, p, scale
                )
        if meta.num_decode_tokens and not kernel:
            start = meta.num_prefill_tokens
            chunks = self._decode_chunks(plan, meta)
            self._decode(q[start:], k_cache, v_cache, chunks, scale, out[start:])
        return out

    # ---- planning (once per step) ----------------------------------------------

    def _get_plan(self, meta: AttentionMetadata, k_cache: torch.Tensor) -> _Plan:
        st = self._state
        _, block_size, kvh, d = k_cache.shape
        key = (block_size, kvh * d * k_cache.element_size(), k_cache.device)
        if meta is not st.plan_meta or key != st.plan_key:
            _check_meta(meta)
            st.plan = _make_plan(meta, block_size, key[1], k_cache.device)
            st.plan_meta, st.plan_key = meta, key
        assert st.plan is not None
        return st.plan

    def _decode_chunks(self, plan: _Plan, meta: AttentionMetadata) -> list[_DecodeChunk]:
        """The plan's decode chunks, built on first use (the C kernel needs none)."""
        if plan.decode_chunks is None:
            block_size, token_bytes = plan.block_size, plan.token_bytes
            chunk_tokens = max(block_size, _CHUNK_BYTES // token_bytes)
            plan.decode_chunks = _decode_chunks(
                meta, plan.tables, block_size, chunk_tokens, plan.tables.device
            )
        return plan.decode_chunks

    # ---- decode in torch ----------------------------------------------------------

    def _gather(self, cache: torch.Tensor, blocks: torch.Tensor, which: int) -> torch.Tensor:
        """cache[blocks] ([n_blocks, block_size, kvh, d]) into a reused buffer."""
        shape = (blocks.shape[0], *cache.shape[1:])
        numel = shape[0] * cache[0].numel()
        key = (which, cache.dtype, cache.device)
        buffers = self._state.buffers
        buf = buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 1 << 16), dtype=cache.dtype, device=cache.device)
            buffers[key] = buf
        return torch.index_select(cache, 0, blocks, out=buf[:numel].view(shape))

    def _decode(
        self,
        q: torch.Tensor,  # [B, H, d]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        chunks: list[_DecodeChunk],
        scale: float,
        out: torch.Tensor,  # [B, H, d], written in place
    ) -> None:
        _, h, d = q.shape
        kvh = k_cache.shape[2]
        group = h // kvh
        for c in chunks:
            ks = self._gather(k_cache, c.blocks, 0).view(c.n, c.max_len, kvh, d).transpose(1, 2)
            vs = self._gather(v_cache, c.blocks, 1).view(c.n, c.max_len, kvh, d).transpose(1, 2)
            qc = q if c.rows is None else q.index_select(0, c.rows)
            q4 = qc.view(c.n, kvh, group, d)  # the group's query heads as query rows
            o = F.scaled_dot_product_attention(q4, ks, vs, attn_mask=c.mask, scale=scale)
            if c.rows is None:
                out.copy_(o.view(c.n, h, d))
            else:
                out.index_copy_(0, c.rows, o.view(c.n, h, d))


def _kernel_rows(
    plan: _Plan, meta: AttentionMetadata, max_prefill: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row_seq, row_lens) for the C kernel, once per step: token row t of sequence
    i at position p attends p + 1 tokens (a decode token: all seq_len of them);
    prefills longer than `max_prefill` get 0 (left to SDPA)."""
    if plan.kernel_rows is None:
        q_lens = torch.tensor(meta.query_lens_cpu)
        seq_lens = torch.tensor(meta.seq_lens_cpu)
        row_seq = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens)  # [T]
        first = torch.cumsum(q_lens, 0) - q_lens  # each sequence's first row
        row_lens = (seq_lens - q_lens)[row_seq] + torch.arange(len(row_seq)) - first[row_seq] + 1
        too_long = seq_lens > max_prefill
        too_long[meta.num_prefills :] = False
        row_lens[too_long[row_seq]] = 0  # left to SDPA
        plan.kernel_rows = (row_seq.to(torch.int32), row_lens.to(torch.int32))
    return plan.kernel_rows


def _check_meta(meta: AttentionMetadata) -> None:
    n = meta.num_seqs
    if len(meta.query_lens_cpu) != n:
        raise ValueError(f"metadata has {len(meta.query_lens_cpu)} query lengths for {n} sequences")
    if not 0 <= meta.num_prefills <= n:
        raise ValueError(f"num_prefills {meta.num_prefills} not in [0, {n}]")
    for i, (ql, sl) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
        if ql < 1 or sl < ql:
            raise ValueError(f"sequence {i}: query_len {ql} with seq_len {sl}")
        if i >= meta.num_prefills and ql != 1:
            raise ValueError(f"decode sequence {i} has query_len {ql}, expected 1")
    n_pre_tokens = sum(meta.query_lens_cpu[: meta.num_prefills])
    if n_pre_tokens != meta.num_prefill_tokens:
        raise ValueError(
            f"num_prefill_tokens {meta.num_prefill_tokens} != sum of prefill query "
            f"lengths {n_pre_tokens}"
        )
    if meta.num_decode_tokens != n - meta.num_prefills:
        raise ValueError(
            f"num_decode_tokens {meta.num_decode_tokens} != decode sequences "
            f"{n - meta.num_prefills}"
        )


def _make_plan(
    meta: AttentionMetadata, block_size: int, token_bytes: int, device: torch.device
) -> _Plan:
    tables = meta.block_tables.to(device=device, dtype=torch.long)  # [B, max_blocks]
    prefills: list[_PrefillPlan] = []
    q_start = 0
    for i in range(meta.num_prefills):
        q_len, seq_len = meta.query_lens_cpu[i], meta.seq_lens_cpu[i]
        ctx = seq_len - q_len
        blocks = mask = None
        if ctx > 0:
            blocks = tables[i, : -(-seq_len // block_size)]
            # query row r sits at position ctx + r and sees keys j <= ctx + r
            kpos = torch.arange(seq_len, device=device)
            qpos = torch.arange(ctx, seq_len, device=device)
            mask = kpos[None, :] <= qpos[:, None]  # [q_len, seq_len]
        prefills.append(_PrefillPlan(q_start, q_len, ctx, seq_len, blocks, mask))
        q_start += q_len
    return _Plan(prefills, tables, block_size, token_bytes)


def _decode_chunks(
    meta: AttentionMetadata,
    tables: torch.Tensor,
    block_size: int,
    chunk_tokens: int,
    device: torch.device,
) -> list[_DecodeChunk]:
    """Decode sequences sorted by length, cut where a chunk's padded size would
    exceed `chunk_tokens` (n * L), each chunk padded to its longest sequence."""
    first = meta.num_prefills
    lens = meta.seq_lens_cpu[first:]
    order = sorted(range(len(lens)), key=lens.__getitem__)
    groups: list[list[int]] = []
    for i in order:  # ascending length: the newest member is the longest
        n_blocks = -(-lens[i] // block_size)
        if groups and (len(groups[-1]) + 1) * n_blocks * block_size <= chunk_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    in_order = len(groups) == 1 and order == list(range(len(lens)))
    chunks = []
    for g in groups:
        n_blocks = -(-max(lens[i] for i in g) // block_size)
        rows = torch.tensor(g, device=device)
        blocks = tables[first + rows, :n_blocks].reshape(-1)
        g_lens = torch.tensor([lens[i] for i in g], device=device)
        max_len = n_blocks * block_size
        mask = torch.arange(max_len, device=device)[None, :] < g_lens[:, None]  # [n, L]
        chunks.append(
            _DecodeChunk(
                None if in_order else rows, blocks, mask[:, None, None, :], len(g), max_len
            )
        )
    return chunks


# ---- prefill -------------------------------------------------------------------------


def _prefill_one(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    p: _PrefillPlan,
    scale: float,
) -> torch.Tensor:  # [q_len, H, d]
    kvh, d = k.shape[1], k.shape[2]
    group = q.shape[1] // kvh
    qs = q[p.q_start : p.q_start + p.q_len]  # [Tq, H, d]
    if p.blocks is None:
        ks = k[p.q_start : p.q_start + p.q_len]  # [S, kvh, d], S == Tq
        vs = v[p.q_start : p.q_start + p.q_len]
    else:
        ks = k_cache.index_select(0, p.blocks).view(-1, kvh, d)[: p.seq_len]  # [S, kvh, d]
        vs = v_cache.index_select(0, p.blocks).view(-1, kvh, d)[: p.seq_len]
    s_len = ks.shape[0]
    q4 = qs.transpose(0, 1).view(kvh, group, p.q_len, d)  # [kvh, g, Tq, d]
    k4 = ks.transpose(0, 1)[:, None].expand(kvh, group, s_len, d)  # [kvh, g, S, d]
    v4 = vs.transpose(0, 1)[:, None].expand(kvh, group, s_len, d)
    if p.mask is None:
        o = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale)
    else:
        o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=p.mask, scale=scale)
    return o.reshape(kvh * group, p.q_len, d).transpose(0, 1)  # [Tq, H, d]
