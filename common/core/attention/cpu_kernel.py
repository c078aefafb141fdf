"""A compiled fp32/bf16 paged-attention kernel for the CPU (cpu_attention.c), built on first use.

Why: decode attention is memory-bound (a decode token does ~1.5 flop per byte of
K/V it reads), and the pure-torch path has to gather every sequence's blocks into
a padded buffer before SDPA can read them, so each K/V byte crosses memory twice
and SDPA then runs a generic kernel over 3-row queries. The C kernel reads the
blocks in place through the block table, K once and V once, with one exact
softmax per head in between (see the C file). The same code serves prefill
tokens, each as one query row over its causal prefix: for the short prompts
here that beats SDPA's flash kernel, whose GEMM tiles are mostly overhead at
these sizes (numbers in torch_backend.py).

bf16 (q, caches and output in bf16) goes through a twin entry point with the
same arguments: the arithmetic is fp32 (bf16 products are exact in fp32, sums
and the softmax are fp32), only the output is rounded to bf16, so it is as
accurate as the fp32 kernel on the same bf16 inputs and reads half the bytes.
With AVX512_BF16 the scores use `_mm512_dpbf16_ps`; with AVX-512F alone two
FMAs on the even/odd halves; elsewhere plain C (see the C file).

Build: `gcc -O3 -march=native -fopenmp -shared` (about a second), once per source
text, compiler and CPU, into `$PAGEDSERVE_CACHE_DIR` (default
`~/.cache/pagedserve`)/kernels/, written to a temporary name and renamed so that
processes building at once never load a half-written file (`cbuild.py`, shared
with the fused bf16 ops of `cpu_ops.py`). Anything that fails
(no compiler, a compile error, a load error, `PAGEDSERVE_CPU_KERNEL=0`) makes
`load()` return None once and callers use the torch path: logged at INFO when
disabled on purpose, at WARNING otherwise (the torch path is several times slower
at decode, so a machine without gcc must not lose the kernel silently).

Threads: the kernel's OpenMP parallel region runs in the process's already loaded
libgomp (torch's: the dynamic loader matches the soname libgomp.so.1), with
`torch.get_num_threads()` threads, so it shares torch's thread pool rather than
adding a second one that would spin against it on a small machine.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from pagedserve.common.core import cbuild
from pagedserve.common.core.attention.base import tile_contiguous
from pagedserve.common.core.cbuild import cache_dir  # noqa: F401 (this module's API)

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_attention.c")
_FLAGS = (
    "-O3",
    "-march=native",
    "-mprefer-vector-width=512",
    "-fno-math-errno",
    "-fopenmp",
    "-fPIC",
    "-shared",
)
_ENV_SWITCH = "PAGEDSERVE_CPU_KERNEL"


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the argument types of a built library's entry points; returns it."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for fn in (lib.pagedserve_attend_f32, lib.pagedserve_attend_bf16):
        fn.argtypes = [ptr, i64, ptr, ptr, i64, ptr, i64, i64, i64, ptr, ptr]
        fn.argtypes += [i64, i64, i64, i64, i64, i64, ctypes.c_float, ptr, i64, ctypes.c_int]
        fn.restype = ctypes.c_int
    return lib


@functools.cache
def load() -> ctypes.CDLL | None:
    """The built kernel library, or None (logged once) when it cannot be had here."""
    lib = cbuild.load_or_none(
        _SOURCE, _FLAGS, _ENV_SWITCH, "CPU attention kernel", "torch attention", log
    )
    return None if lib is None else bind(lib)


# The kernel's entry point per element type (q, caches and out share it).
_ENTRY = {torch.float32: "pagedserve_attend_f32", torch.bfloat16: "pagedserve_attend_bf16"}


def attend(
    lib: ctypes.CDLL,
    q: torch.Tensor,  # [R, H, D] fp32 or bf16, rows may be strided, each row contiguous
    k_cache: torch.Tensor,  # [NB, BS, KVH, D] q's dtype, each block's tile contiguous
    v_cache: torch.Tensor,  # the same, same block stride (the block-major cache's views)
    block_tables: torch.Tensor,  # [S, max_blocks] int32, each row contiguous
    lens: torch.Tensor,  # [R] int32 contiguous: tokens row r attends; 0 = skip the row
    scale: float,
    out: torch.Tensor,  # [R, H, D] q's dtype, rows may be strided, each row contiguous
    row_seq: torch.Tensor | None = None,  # [R] int32: table row per query row; None = r
) -> None:
    """out[r] = softmax(q[r] k^T * scale) v over the first lens[r] cached tokens of
    sequence row_seq[r]: a decode token attends its whole context, a prefill token
    at position p its first p + 1 tokens. Rows with lens 0 are left untouched.

    The caller guarantees the layouts (see `fits`); the kernel checks every length,
    sequence index and block id it would read before reading anything.
    """
    r, h, d = q.shape
    nb, bs, kvh, _ = k_cache.shape
    block_stride = k_cache.stride(0)  # elements; > bs * kvh * d in the block-major cache
    rc = getattr(lib, _ENTRY[q.dtype])(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        nb,
        block_tables.data_ptr(),
        block_tables.shape[0],
        block_tables.stride(0),
        block_tables.shape[1],
        None if row_seq is None else row_seq.data_ptr(),
        lens.data_ptr(),
        r,
        h,
        kvh,
        d,
        bs,
        block_stride,
        scale,
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
    )
    if rc == -1:
        raise MemoryError("CPU attention kernel could not allocate its per-thread scratch")
    if rc < -1:
        i = -2 - rc
        seq = i if row_seq is None else int(row_seq[i])
        table = block_tables[seq].tolist() if 0 <= seq < block_tables.shape[0] else None
        raise ValueError(
            f"query row {i}: length {int(lens[i])}, sequence {seq} or a block id in "
            f"{table} is out of range (block_size {bs}, {nb} blocks)"
        )


def fits(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lens: torch.Tensor,
) -> bool:
    """Whether `attend` can run on these tensors as they are."""
    return (
        q.dtype == k_cache.dtype == v_cache.dtype
        and q.dtype in _ENTRY
        and q.device.type == k_cache.device.type == v_cache.device.type == "cpu"
        and block_tables.device.type == lens.device.type == "cpu"
        and tile_contiguous(k_cache)
        and k_cache.shape == v_cache.shape
        and k_cache.stride() == v_cache.stride()
        and block_tables.dtype == lens.dtype == torch.int32
        and block_tables.stride(-1) == 1
        and lens.is_contiguous()
        and q.stride(2) == 1
        and q.stride(1) == q.shape[2]
        and q.shape[1] % k_cache.shape[2] == 0
        and q.shape[2] == k_cache.shape[3]
    )
