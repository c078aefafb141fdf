"""Attention backends over the paged KV cache (torch reference, Triton kernels).

Selection: `get_attention_backend(name, device)`
    "torch"   gather-by-block-table + SDPA, any device (the CPU default)
    "triton"  the Triton paged-attention kernels (the CUDA default); imported lazily
              so that CPU-only processes never import triton
    None      auto: triton on cuda, torch elsewhere

A backend may define `supports(head_dim, dtype) -> str | None` (None = fine, else
the reason); `check_backend_supports` turns a reason into a load-time error.
"""

from __future__ import annotations

import torch

from pagedserve.common.core.attention.base import AttentionBackend, AttentionMetadata, write_kv

BACKEND_NAMES = ("torch", "triton")

__all__ = [
    "BACKEND_NAMES",
    "AttentionBackend",
    "AttentionMetadata",
    "check_backend_supports",
    "get_attention_backend",
    "write_kv",
]


def get_attention_backend(name: str | None, device: torch.device | str) -> AttentionBackend:
    """The backend called `name` ("torch" | "triton"), or the device's default for None."""
    device = torch.device(device)
    if name is None or name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from pagedserve.common.core.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from pagedserve.common.core.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKEND_NAMES}")


def check_backend_supports(backend: AttentionBackend, head_dim: int, dtype: torch.dtype) -> None:
    """Raise ValueError naming the problem if `backend` cannot run this head_dim/dtype."""
    supports = getattr(backend, "supports", None)
    if supports is None:
        return
    reason = supports(head_dim, dtype)
    if reason:
        raise ValueError(f"attention backend {backend.name!r} cannot run this model: {reason}")
