"""Host-side checks and launch settings shared by the Triton paged-attention kernels.

Kept apart from the kernels so that `triton_decode.py` and `triton_prefill.py` each hold
one kernel family and its launcher, and both reject bad input with the same words.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Register budget of one program: acc [rows, head_dim] and a K/V tile [BLOCK_N, head_dim].
MAX_HEAD_DIM = 256
# `tl.dot` on a GPU needs the reduction dimension K >= 16 (Triton 3.7's NVIDIA backend pads
# a small M or N itself; AMD's needs 16 for all three). Every dot dimension here (head_dim,
# BLOCK_M, BLOCK_N, the decode group rows) is padded to at least this.
MIN_DOT_DIM = 16
LOG2_E = 1.4426950408889634


def is_interpreter() -> bool:
    """True when Triton runs kernels on CPU tensors (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def cdiv(a: int, b: int) -> int:
    """Ceiling division of positive ints."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (`tl.arange` needs power-of-two lengths)."""
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class PagedShape:
    """Sizes read off the cache and the query, validated once per launch."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def head_dim_pad(self) -> int:
        return max(MIN_DOT_DIM, next_pow2(self.head_dim))


def check_paged_inputs(
    q: torch.Tensor,  # [T, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
) -> PagedShape:
    """Raise a ValueError/RuntimeError naming what a kernel cannot take; return the sizes."""
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, num_q_heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_q_heads = q.shape[1]
    if q.shape[2] != head_dim:
        raise ValueError(f"q head_dim {q.shape[2]} != cache head_dim {head_dim}")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(
            f"head_dim {head_dim} is not supported by the Triton kernels (max {MAX_HEAD_DIM})"
        )
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {q.dtype} is not supported (use one of {SUPPORTED_DTYPES})")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(
            f"q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError(
            f"block_tables and seq_lens must be int32, got {block_tables.dtype} and {seq_lens.dtype}"
        )
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must be contiguous in head_dim")
    _check_device(q, k_cache, v_cache, block_tables, seq_lens)
    return PagedShape(num_q_heads, num_kv_heads, head_dim, block_size)


def _check_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type == "cuda":
        if tensors[0].dtype == torch.bfloat16 and not _cuda_has_bf16(device.index):
            raise RuntimeError(f"{torch.cuda.get_device_name(device)} has no bfloat16 support")
        return
    if device.type == "cpu" and is_interpreter():
        return
    raise RuntimeError(
        f"the Triton kernels need a CUDA device, or TRITON_INTERPRET=1 set before triton is "
        f"imported to run on CPU tensors; got device {device}"
    )


@functools.cache
def _cuda_has_bf16(index: int | None) -> bool:
    """bf16 tensor-core math needs compute capability 8.0 (Ampere) or later."""
    return torch.cuda.get_device_capability(index)[0] >= 8


def dot_settings(dtype: torch.dtype) -> tuple[bool, str]:
    """(DOT_FP32, DOT_PRECISION) constexprs for the kernels.

    DOT_FP32: upcast `tl.dot` operands to fp32. Only for bf16 in the interpreter, whose bf16
    `tl.dot` returns garbage (ENV.md); on a GPU bf16 runs on the tensor cores.
    DOT_PRECISION: "ieee" so fp32 caches get fp32 products instead of tf32 (ignored for
    fp16/bf16 operands).
    """
    return dtype == torch.bfloat16 and is_interpreter(), "ieee"


def default_tile(shape: PagedShape, dtype: torch.dtype) -> int:
    """Rows/positions per tile: 64, halved for each doubling of a head row past 256 bytes.

    The prefill kernel holds q, K and V tiles in shared memory; 64 x 256 B rows (fp16
    head_dim 128) need 40 KiB. Larger rows (fp16 head_dim 256, fp32 head_dim >= 128)
    shrink the tile so every configuration fits the 99 KiB per block of consumer GPUs
    (sm_86/sm_89); `python -m benchmarks.triton_compile` checks this per architecture.
    """
    row_bytes = shape.head_dim_pad * torch.empty((), dtype=dtype).element_size()
    if row_bytes <= 256:
        return 64
    return 32 if row_bytes <= 512 else 16


_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 elsewhere); cached per device index."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]
