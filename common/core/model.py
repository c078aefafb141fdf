"""A Llama-family decoder whose attention reads and writes K/V through block tables.

One class covers Llama, Mistral, Qwen2 (q/k/v biases) and Qwen3 (RMSNorm over
each q/k head before RoPE); GQA with any group size. Numerics follow
`transformers` (RMSNorm in fp32, RoPE tables in fp32 cast to the model dtype,
softmax inside SDPA) so that greedy decoding in fp32 agrees token for token.

The input is a flat batch of new tokens (see `attention/base.py` for the layout):

    input_ids: [T]   positions: [T]   ->   hidden: [T, hidden_size] (after final norm)

and the engine calls `compute_logits` only on the rows it samples from.

Weights: q/k/v are fused into one `qkv_proj` and gate/up into one `gate_up_proj`
so each layer runs 4 matmuls instead of 7; `load_weights` takes the checkpoint's
per-projection tensors (Hugging Face names) and copies them into the fused
slices.

Projection matrices are stored transposed, [in, out], and applied as `x @ w`:
MKL's fp32 GEMM was 2-3x faster in that layout than `F.linear`'s [out, in] for the
decode shapes here (M = 8..48 rows; e.g. 32 x 576 @ 576 x 3072: 0.57 vs 1.49 ms,
the 49152-wide LM head at 32 rows: 14 vs 25 ms; equal from M = 64 up). A tied LM
head therefore gets its own transposed copy on CPU (vocab x hidden more memory);
elsewhere it reuses the embedding through `F.linear`.

In bf16 and fp32 on the CPU the small ops run as fused C kernels (`cpu_ops.py`,
switched by `use_fused_ops`): each residual add together with the RMSNorm after it
(which is why a layer takes and returns both the residual stream and its normalized
copy), SiLU-and-mul, and RoPE (with Qwen3's q/k norm) in place in the qkv output. In
bf16 they round where the torch ops round; in fp32 RMSNorm and SiLU may differ from
torch's by a few ulps (cpu_ops.py says why that was accepted).
"""

from __future__ import annotations

import ctypes
import math
import os
import platform
import re
from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.common.api.model_config import ModelSpec
from pagedserve.common.core import cpu_ops, fp32_gemm, mkl_pack
from pagedserve.common.core.attention.base import AttentionBackend, AttentionMetadata
from pagedserve.common.core.kv_cache import KVCache

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_malloc_tuned: bool | None = None


def tune_cpu_malloc() -> bool:
    """Make glibc keep freed memory for reuse (once per process); True if in effect.

    A forward on the CPU allocates multi-MB temporaries (at 2048 tokens: 25 MB
    for gate_up, 6 MB per RoPE term). glibc serves such sizes with fresh mmaps,
    or trims them off the heap once freed, so steps keep paying first-touch page
    faults to get them back. Measured here, one 2048-token prefill forward
    (8 x 256): 51k-122k faults and 2125-2244 ms untuned, none and 1950 ms tuned;
    the engine64 workload: 242k -> 37k faults. Decode batches are too small to
    notice. With allocations under 64 MB served from the heap and up to 512 MB
    of free heap kept, the memory is reused instead; larger ones (the KV cache,
    weights) are still mmapped and returned on free, and peak RSS did not change
    (3.18 GB either way). Process-wide, so it is done once, from the first CPU
    model built; `PAGEDSERVE_MALLOC_TUNING=0` skips it; a no-op off glibc.
    """
    global _malloc_tuned
    if _malloc_tuned is None:
        _malloc_tuned = False
        if os.environ.get("PAGEDSERVE_MALLOC_TUNING", "1") != "0" and (
            platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
        ):
            try:
                mallopt = ctypes.CDLL(None).mallopt
                ok = mallopt(_M_MMAP_THRESHOLD, 64 << 20) == 1
                _malloc_tuned = ok and mallopt(_M_TRIM_THRESHOLD, 512 << 20) == 1
            except (OSError, AttributeError):
                pass
    return _malloc_tuned


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def _mm(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor | mkl_pack.PackedMatrix | None = None,
) -> torch.Tensor:
    """x [T, in] @ w [in, out] (+ bias [out]); through `packed` (w packed by
    `pack_weight`: for MKL's packed GEMM or reordered for oneDNN, whichever
    `fp32_gemm` chose for this weight in fp32; oneDNN in bf16) when given, except for
    one fp32 row: there MKL's GEMV was as fast or faster (the 49152-wide LM head: 10.5
    vs 4.6 GFLOP/s against oneDNN, see `can_prepack`; 6.8 vs 7.7 ms against the packed
    GEMM, `mkl_pack`). No `packed` (fp32 "plain"): `x @ w`, as transformers computes."""
    if packed is not None and (x.shape[0] > 1 or x.dtype != torch.float32):
        if type(packed) is mkl_pack.PackedMatrix:
            return packed.mm(x, bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [None], "")
    return x @ w if bias is None else torch.addmm(bias, x, w)


def can_prepack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether weights of `dtype` on `device` get a GEMM backend chosen at load, with
    packed copies where it needs them (see `pack_weight`, `PagedCausalLM.prepack_weights`).

    bf16 and fp32 on the CPU. Why bf16: torch's bf16 `x @ w` on the CPU is a oneDNN
    matmul that reorders the weight into oneDNN's blocked layout on every call,
    which dominates at few rows; reordered once here (what vLLM-CPU does too), the
    same kernels run on the CPU's bf16 instructions (AMX tiles where present)
    without that copy, with the same results (bit-identical on the tiny models
    of tests/test_model.py). Measured on an EPYC with
    avx512_bf16 (no AMX), 1 thread, GFLOP/s, bf16 `x @ w` -> prepacked: qkv
    576x960 at 1 row 18 -> 33, 8 rows 96 -> 119, 64 rows 170 -> 202; gate_up
    576x3072 at 1/8/64/512 rows 20/94/188/149 -> 48/177/203/152; the 49152-wide
    LM head at 8/64 rows 32/116 -> 96/177. bf16 is always oneDNN-prepacked.

    Why fp32 too (2026-12-01): MKL's fp32 `x @ w` -> oneDNN prepacked, same EPYC, 1
    thread, best of 20: gate_up at 8/64/512 rows 39/77/92 -> 103/108/108, the LM head
    at 8/64 rows 19/53 -> 52/101; at 1 row equal, but the LM head 10.5 -> 4.6 (so `_mm`
    keeps MKL for a single fp32 row). The cost is bit-parity: oneDNN sums
    in another order than MKL (which transformers' `F.linear` uses), so fp32 logits
    move by ~1e-6 relative (tests/test_model.py bounds it); greedy tokens still
    match transformers in every parity test (vLLM-CPU's fp32 differs from
    transformers in the same way and matched it on all 64 engine64 requests).

    fp32 from 2026-12-02 took MKL's packed GEMM instead (`mkl_pack`; 8-25 % faster
    than oneDNN's prepacked matmul at 4-2048 rows on a Skylake-SP Xeon), which on AMD
    EPYCs runs at about half of oneDNN's rate. Since 2026-12-05 neither is fixed: the
    backend of each fp32 weight shape (MKL packed or oneDNN prepacked) is measured at
    load on this CPU (`fp32_gemm`; EngineConfig.fp32_gemm / $PAGEDSERVE_FP32_GEMM force
    one, or plain `x @ w`). Same numerics story for both packed backends.
    `PAGEDSERVE_PREPACK=0` turns packing off (plain `x @ w` everywhere: bit-identical
    fp32 logits to transformers); `PAGEDSERVE_MKL_PACK=0` leaves MKL out of the choice.
    """
    if device.type != "cpu" or os.environ.get("PAGEDSERVE_PREPACK", "1") == "0":
        return False
    if dtype == torch.float32:
        return True  # "plain" at worst, where neither packed backend is available
    return (
        dtype == torch.bfloat16
        and fp32_gemm.onednn_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def pack_weight(
    w: torch.Tensor, backend: str = "onednn"
) -> torch.Tensor | mkl_pack.PackedMatrix | None:
    """w [in, out] packed for `_mm` (a copy, opaque) in `backend`'s form: "mkl"
    (fp32 only: MKL's packed GEMM), "onednn" (reordered into oneDNN's layout), or
    "plain" (None: `_mm` multiplies by w itself). fp32's backend is chosen per weight
    shape at load (`fp32_gemm`); bf16 takes oneDNN."""
    return fp32_gemm.pack(w, backend)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalize in fp32, cast back, then scale by weight.

    In fp32 torch's `F.rms_norm` gives bit-identical results (checked over shapes
    1-2048 x 16-2048) with one call instead of six; on the CPU that call is itself a
    composite of ~10 aten ops (torch 2.13: 56 us for one 576-wide row here), which is
    why fp32 on the CPU takes the fused kernel of `cpu_ops` instead (`can_fuse`)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def can_fuse(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the model's small ops run as the fused C kernels of `cpu_ops` (built on
    first call; False where they cannot be built, see `cpu_ops.load`).

    bf16 and fp32 on the CPU: there they replace several aten ops each (numbers in
    cpu_ops.py). fp32 was left on torch's ops at first, to stay bit for bit what
    transformers computes; it was fused too (2026-12-02) once the prepacked fp32
    matmuls had given that up anyway, since `F.rms_norm` in fp32 turned out to be ~10
    aten ops here, not one (cpu_ops.py: the numbers, and the fp32 tolerances)."""
    return (
        dtype in (torch.bfloat16, torch.float32)
        and device.type == "cpu"
        and cpu_ops.load() is not None
    )


def add_rms_norm(
    ops: ctypes.CDLL | None, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + y, rms_norm(x + y)): a residual add and the RMSNorm after it, in one pass
    through the fused kernel when `ops` is given (then y's storage holds the sum)."""
    if ops is not None:
        return cpu_ops.add_rms_norm(ops, x, y, weight, eps)
    x = x + y
    return x, rms_norm(x, weight, eps)


def _rms_norm(
    ops: ctypes.CDLL | None, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """`rms_norm`, through the fused kernel when `ops` is given."""
    return rms_norm(x, weight, eps) if ops is None else cpu_ops.rms_norm(ops, x, weight, eps)


# ---- rotary position embedding ---------------------------------------------------


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """[head_dim // 2] fp32 inverse frequencies, with linear or Llama-3 scaling."""
    d = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    scaling = spec.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    # llama3: long wavelengths divided by `factor`, short ones kept, a smooth ramp between.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1), for
    x: [T, heads, d]; cos/sin: [T, 1, d] (already in x's dtype).

    Computed half by half into one output, without rotate_half's negated copy
    and `cat`: the same roundings (so the same bits: -a * s == -(a * s)) with 3
    new tensors instead of 5. At 2048 tokens x 12 heads: 6.6 -> 0.9 ms here, most
    of the old cost being first-touch page faults on the temporaries (with
    `tune_cpu_malloc` in effect: 3.2 -> 1.6 ms)."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    out = x * cos
    out[..., :h] -= x2 * sin[..., :h]
    out[..., h:] += x1 * sin[..., h:]
    return out


# ---- layers -----------------------------------------------------------------------


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP, both with residuals."""

    def __init__(
        self,
        spec: ModelSpec,
        layer_idx: int,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        s = spec
        self.spec = spec
        self.layer_idx = layer_idx
        self.backend = backend
        self.scale = s.head_dim**-0.5
        p = {"dtype": dtype, "device": device}
        self.input_layernorm = _param(s.hidden_size, **p)
        self.post_attention_layernorm = _param(s.hidden_size, **p)
        # [in, out] matrices; qkv columns: [q: H*d | k: kvh*d | v: kvh*d]
        self.qkv_proj = _param(s.hidden_size, s.q_size + 2 * s.kv_size, **p)
        self.qkv_bias = _param(s.q_size + 2 * s.kv_size, **p) if s.attention_bias else None
        self.o_proj = _param(s.q_size, s.hidden_size, **p)
        self.o_bias = _param(s.hidden_size, **p) if s.o_proj_bias else None
        self.q_norm = _param(s.head_dim, **p) if s.qk_norm else None
        self.k_norm = _param(s.head_dim, **p) if s.qk_norm else None
        # gate_up columns: [gate: I | up: I]
        self.gate_up_proj = _param(s.hidden_size, 2 * s.intermediate_size, **p)
        self.gate_up_bias = _param(2 * s.intermediate_size, **p) if s.mlp_bias else None
        self.down_proj = _param(s.intermediate_size, s.hidden_size, **p)
        self.down_bias = _param(s.hidden_size, **p) if s.mlp_bias else None
        # packed copies of the four matrices, by name (see `pack_weight`); empty = none
        self.packed: dict[str, torch.Tensor | mkl_pack.PackedMatrix] = {}

    MATRICES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

    def prepack(self, backends: Mapping[str, str]) -> None:
        """(Re)build this layer's packed copies: matrix name -> backend (`pack_weight`);
        a matrix not named, or "plain", gets none."""
        self.packed = {}
        for name, backend in backends.items():
            packed = pack_weight(getattr(self, name), backend)
            if packed is not None:
                self.packed[name] = packed

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]: the residual stream
        h: torch.Tensor,  # [T, hidden]: x after this layer's input RMSNorm
        cos: torch.Tensor,  # [T, 1, d]
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        next_norm: torch.Tensor,  # the next layer's input RMSNorm weight, or the final one
        ops: ctypes.CDLL | None = None,  # the fused CPU kernels (cpu_ops), or torch ops
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, h) for the next layer: the residual stream and its next RMSNorm.

        Each residual add is done together with the RMSNorm that follows it (the
        post-attention one, and the next layer's input norm or the final norm), so
        that the fused kernel can make one pass for both."""
        eps = self.spec.rms_norm_eps
        attn = self._attention(h, cos, sin, kv_cache, meta, ops)
        x, h = add_rms_norm(ops, x, attn, self.post_attention_layernorm, eps)
        return add_rms_norm(ops, x, self._mlp(h, ops), next_norm, eps)

    def _mlp(self, h: torch.Tensor, ops: ctypes.CDLL | None) -> torch.Tensor:
        s = self.spec
        gate_up = _mm(h, self.gate_up_proj, self.gate_up_bias, self.packed.get("gate_up_proj"))
        if ops is not None:
            act = cpu_ops.silu_and_mul(ops, gate_up)  # contiguous: the down matmul copies none
        else:
            gate, up = gate_up.split(s.intermediate_size, dim=-1)
            act = F.silu(gate, inplace=True).mul_(up)  # in place: no [T, I] temporaries
        return _mm(act, self.down_proj, self.down_bias, self.packed.get("down_proj"))

    def _attention(
        self,
        h: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        ops: ctypes.CDLL | None = None,
    ) -> torch.Tensor:
        s = self.spec
        t = h.shape[0]
        qkv = _mm(h, self.qkv_proj, self.qkv_bias, self.packed.get("qkv_proj"))
        n_qk = s.num_q_heads + s.num_kv_heads
        # qkv's heads [q | k | v] as views: one `view` and one `split_with_sizes` (a
        # slice and a view each cost ~3-4 us, `Tensor.split`'s Python ~7 us; ~10 us a
        # layer saved this way, 2026-12-02, 2-core Skylake-SP Xeon)
        heads = qkv.view(t, n_qk + s.num_kv_heads, s.head_dim)
        qk, v = torch.split_with_sizes(heads, (n_qk, s.num_kv_heads), 1)
        if ops is not None:
            # In place in qkv (q/k rows stay strided, as v's already are): the fused
            # kernel normalizes (Qwen3) and rotates each head in one pass; without
            # q/k norms, q and k heads in one call (each call's Python costs ~20 us).
            q, k = torch.split_with_sizes(qk, (s.num_q_heads, s.num_kv_heads), 1)
            if self.q_norm is None:
                cpu_ops.rope_(ops, qk, cos, sin)
            else:
                cpu_ops.rope_(ops, q, cos, sin, self.q_norm, s.rms_norm_eps)
                cpu_ops.rope_(ops, k, cos, sin, self.k_norm, s.rms_norm_eps)
        elif self.q_norm is None:
            # RoPE over q and k heads at once: [T, H + kvh, d]
            qk = apply_rope(qk, cos, sin)
            q, k = qk.split((s.num_q_heads, s.num_kv_heads), dim=1)
        else:
            q, k, _ = qkv.split((s.q_size, s.kv_size, s.kv_size), dim=-1)
            q = rms_norm(q.view(t, s.num_q_heads, s.head_dim), self.q_norm, s.rms_norm_eps)
            k = rms_norm(k.view(t, s.num_kv_heads, s.head_dim), self.k_norm, s.rms_norm_eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache, v_cache = kv_cache.layer(self.layer_idx)
        o = self.backend.forward(q, k, v, k_cache, v_cache, meta, self.scale)  # [T, H, d]
        return _mm(o.reshape(t, s.q_size), self.o_proj, self.o_bias, self.packed.get("o_proj"))


# ---- the model ----------------------------------------------------------------------


class PagedCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 / Qwen3 over a paged KV cache."""

    def __init__(
        self,
        spec: ModelSpec,
        attention_backend: AttentionBackend,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        fp32_gemm_mode: str | None = None,
    ) -> None:
        """`fp32_gemm_mode`: how fp32 weights' GEMM backends are chosen at
        `prepack_weights` ("auto": measured; "mkl", "onednn", "plain": forced; None:
        $PAGEDSERVE_FP32_GEMM, else "auto"), see `fp32_gemm`."""
        super().__init__()
        device = torch.device(device)
        self.fp32_gemm_mode = fp32_gemm.resolve_mode(fp32_gemm_mode)
        # weight role -> the backend in use and why (`prepack_weights`); {} = plain
        self.gemm_choices: dict[str, fp32_gemm.Choice] = {}
        if device.type == "cpu":
            tune_cpu_malloc()
        self.spec = spec
        self.dtype = dtype
        self.attention_backend = attention_backend
        p = {"dtype": dtype, "device": device}
        self.embed_tokens = _param(spec.vocab_size, spec.hidden_size, **p)
        self.layers = nn.ModuleList(
            DecoderLayer(spec, i, attention_backend, dtype, device) for i in range(spec.num_layers)
        )
        self.norm = _param(spec.hidden_size, **p)
        # [hidden, vocab]; None = tied and applied through the embedding (not on CPU)
        self.lm_head: nn.Parameter | None = None
        if not spec.tie_word_embeddings or device.type == "cpu":
            self.lm_head = _param(spec.hidden_size, spec.vocab_size, **p)
        # the LM head's packed copy, see `prepack_weights`
        self.lm_head_packed: torch.Tensor | mkl_pack.PackedMatrix | None = None
        self.ops: ctypes.CDLL | None = None  # the fused CPU kernels; see `use_fused_ops`
        self.use_fused_ops()
        self.register_buffer("inv_freq", rope_inv_freq(spec).to(device), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden], after the final norm
        self._check_inputs(input_ids, positions, kv_cache, meta)
        cos, sin = self._rope_tables(positions)
        x = F.embedding(input_ids, self.embed_tokens)
        norms = [layer.input_layernorm for layer in self.layers] + [self.norm]
        h = _rms_norm(self.ops, x, norms[0], self.spec.rms_norm_eps)
        for layer, next_norm in zip(self.layers, norms[1:], strict=True):
            x, h = layer(x, h, cos, sin, kv_cache, meta, next_norm, self.ops)
        return h

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""
        if self.lm_head is None:
            return F.linear(hidden, self.embed_tokens).float()
        return _mm(hidden, self.lm_head, None, self.lm_head_packed).float()

    @torch.no_grad()
    def prepack_weights(
        self, enabled: bool | None = None, fp32_gemm_mode: str | None = None
    ) -> bool:
        """Choose each projection matrix's and the LM head's GEMM backend and build the
        packed copies it needs (`pack_weight`), used by the forward from then on; with
        False, drop them all (plain `x @ w`). None = where `can_prepack` says so.
        fp32: per weight role (one shape across all layers), measured on this CPU or
        forced by `fp32_gemm_mode` (given here, it replaces the model's; see
        `fp32_gemm`); bf16: oneDNN. Done by `load_weights`; call again after changing
        a weight in place (an "auto" choice is not measured twice in a process). The
        [in, out] parameters stay as they are (the copies cost as much memory again).
        Returns whether packed copies are in use."""
        if fp32_gemm_mode is not None:
            self.fp32_gemm_mode = fp32_gemm.resolve_mode(fp32_gemm_mode)
        if enabled is None:
            enabled = can_prepack(self.dtype, self.device)
        self.gemm_choices = self._choose_gemm() if enabled else {}
        backends = {role: c.backend for role, c in self.gemm_choices.items()}
        for layer in self.layers:
            layer.prepack({m: backends[m] for m in DecoderLayer.MATRICES if m in backends})
        self.lm_head_packed = None
        if "lm_head" in backends:
            self.lm_head_packed = pack_weight(self.lm_head, backends["lm_head"])
        return self.lm_head_packed is not None or any(layer.packed for layer in self.layers)

    def _choose_gemm(self) -> dict[str, fp32_gemm.Choice]:
        """Weight role -> GEMM backend: fp32 measured (or forced), bf16 oneDNN. Each
        role is timed at the row counts it runs at (`fp32_gemm.LAYER_ROWS`/`HEAD_ROWS`)
        on layer 0's weight: every layer has the same shapes."""
        roles = {
            m: (getattr(self.layers[0], m), fp32_gemm.LAYER_ROWS) for m in DecoderLayer.MATRICES
        }
        if self.lm_head is not None:
            roles["lm_head"] = (self.lm_head, fp32_gemm.HEAD_ROWS)
        if self.dtype != torch.float32:
            return {
                r: fp32_gemm.Choice(r, tuple(w.shape), "onednn", {}) for r, (w, _) in roles.items()
            }
        if self.fp32_gemm_mode == "auto":
            return fp32_gemm.choose(roles)
        return fp32_gemm.forced(roles, self.fp32_gemm_mode)

    def use_fused_ops(self, enabled: bool | None = None) -> bool:
        """Run RMSNorm (with the residual add before it), SiLU-and-mul and RoPE through
        the fused C kernels of `cpu_ops` (True) or torch's ops (False); None = where
        `can_fuse` says so (bf16 or fp32 on the CPU, the kernels built). True where they cannot
        run is refused. Returns whether the fused kernels are in use."""
        possible = can_fuse(self.dtype, self.device)
        if enabled and not possible:
            raise ValueError(
                f"fused CPU ops need bf16 or fp32 on the CPU and a built cpu_ops library "
                f"(dtype {self.dtype}, device {self.device}; see the log for the build)"
            )
        self.ops = cpu_ops.load() if possible and enabled is not False else None
        return self.ops is not None

    def _rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [T, 1, d] in the model dtype, computed like transformers (fp32)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, d]
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def _check_inputs(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> None:
        s = self.spec
        if input_ids.ndim != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} "
                "must be equal-length 1-D tensors"
            )
        n_tokens = meta.num_prefill_tokens + meta.num_decode_tokens
        if input_ids.shape[0] != n_tokens:
            raise ValueError(
                f"got {input_ids.shape[0]} tokens but the metadata describes {n_tokens}"
            )
        expected = (s.num_layers, 2, s.num_kv_heads, s.head_dim)
        got = (kv_cache.kv.shape[1], kv_cache.kv.shape[2], *kv_cache.kv.shape[4:])
        if got != expected:
            raise ValueError(
                f"KV cache (layers, 2, kv_heads, head_dim) = {got} does not fit the model {expected}"
            )
        if kv_cache.dtype != self.dtype:
            raise ValueError(f"KV cache dtype {kv_cache.dtype} != model dtype {self.dtype}")
        if input_ids.device.type == "cpu" and n_tokens:
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= s.vocab_size:
                raise ValueError(f"token ids must be in [0, {s.vocab_size}), got [{lo}, {hi}]")

    # ---- weights --------------------------------------------------------------------

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the (fused) parameters.

        Raises ValueError naming any unexpected tensor, any shape mismatch, and any
        parameter slice that the checkpoint did not provide.
        """
        missing = set(self._expected_weight_names())
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and self.spec.tie_word_embeddings:
                continue  # tied: the embedding is the LM head
            target = self._weight_target(name)
            if target is None:
                raise ValueError(f"unexpected tensor {name!r} in checkpoint")
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
                )
            target.copy_(tensor)
            missing.discard(name)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:5]}")
        if self.spec.tie_word_embeddings and self.lm_head is not None:
            self.lm_head.copy_(self.embed_tokens.t())
        self.prepack_weights()

    def _expected_weight_names(self) -> list[str]:
        s = self.spec
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not s.tie_word_embeddings:
            names.append("lm_head.weight")
        for i in range(s.num_layers):
            pre = f"model.layers.{i}"
            names += [f"{pre}.input_layernorm.weight", f"{pre}.post_attention_layernorm.weight"]
            names += [f"{pre}.self_attn.{p}_proj.weight" for p in "qkvo"]
            names += [f"{pre}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
            if s.attention_bias:
                names += [f"{pre}.self_attn.{p}_proj.bias" for p in "qkv"]
            if s.o_proj_bias:
                names.append(f"{pre}.self_attn.o_proj.bias")
            if s.qk_norm:
                names += [f"{pre}.self_attn.q_norm.weight", f"{pre}.self_attn.k_norm.weight"]
            if s.mlp_bias:
                names += [f"{pre}.mlp.{p}_proj.bias" for p in ("gate", "up", "down")]
        return names

    _LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")

    def _weight_target(self, name: str) -> torch.Tensor | None:
        """The view (of a parameter or a fused slice of one) that checkpoint tensor
        `name` fills, in the checkpoint's own [out, in] orientation."""
        s = self.spec
        top = {"model.embed_tokens.weight": self.embed_tokens, "model.norm.weight": self.norm}
        if not s.tie_word_embeddings:
            top["lm_head.weight"] = self.lm_head.t()
        if name in top:
            return top[name]
        m = self._LAYER_RE.fullmatch(name)
        if m is None or int(m.group(1)) >= s.num_layers:
            return None
        layer: DecoderLayer = self.layers[int(m.group(1))]
        qkv_rows = {
            "q": (0, s.q_size),
            "k": (s.q_size, s.kv_size),
            "v": (s.q_size + s.kv_size, s.kv_size),
        }
        gate_up_rows = {
            "gate": (0, s.intermediate_size),
            "up": (s.intermediate_size, s.intermediate_size),
        }
        rest = m.group(2)
        direct = {
            "input_layernorm.weight": layer.input_layernorm,
            "post_attention_layernorm.weight": layer.post_attention_layernorm,
            "self_attn.o_proj.weight": layer.o_proj.t(),
            "self_attn.o_proj.bias": layer.o_bias,
            "self_attn.q_norm.weight": layer.q_norm,
            "self_attn.k_norm.weight": layer.k_norm,
            "mlp.down_proj.weight": layer.down_proj.t(),
            "mlp.down_proj.bias": layer.down_bias,
        }
        if rest in direct:
            return direct[rest]
        m2 = re.fullmatch(r"self_attn\.([qkv])_proj\.(weight|bias)", rest)
        if m2:
            fused = layer.qkv_proj.t() if m2.group(2) == "weight" else layer.qkv_bias
            start, size = qkv_rows[m2.group(1)]
            return None if fused is None else fused.narrow(0, start, size)
        m2 = re.fullmatch(r"mlp\.(gate|up)_proj\.(weight|bias)", rest)
        if m2:
            fused = layer.gate_up_proj.t() if m2.group(2) == "weight" else layer.gate_up_bias
            start, size = gate_up_rows[m2.group(1)]
            return None if fused is None else fused.narrow(0, start, size)
        return None
