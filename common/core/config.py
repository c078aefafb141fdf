"""Engine configuration: small frozen dataclasses, checked where they are built.

Per-role copies (a prefill worker with a bigger token budget, say) are made with
`dataclasses.replace`, never by mutating a shared instance.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from pagedserve.common.api.limits import ConfigError, RequestLimits

GiB = 1 << 30


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache.

    The capacity is `num_blocks` when given, else whatever fits in `kv_cache_bytes`
    (the CPU analogue of vLLM's gpu_memory_utilization); the engine logs the result.
    """

    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # the pool's size in blocks; None: from kv_cache_bytes
    # Per engine (one worker). 1 GiB, as `pagedserve up` always gave its workers (the
    # default had drifted to 2 GiB here): a launcher puts several workers on one machine,
    # and 1 GiB holds ~23k tokens of SmolLM2-135M in fp32 (45 KiB a token).
    kv_cache_bytes: int = 1 * GiB
    enable_prefix_caching: bool = True  # share full blocks between sequences by hash
    # What happens to the newest running sequence when the pool runs dry:
    # "recompute" frees its blocks and re-prefills it later (the prefix cache helps);
    # "swap" copies its KV to host memory and back.
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    # Admission keeps this fraction of the pool free, so that running sequences can
    # grow a few steps before anything has to be preempted (vLLM's watermark).
    watermark: float = 0.01
    # Allocate the cache in a shared-memory file in this directory (a tmpfs such as
    # /dev/shm; CPU caches only), so that same-host KV pullers can read exported blocks
    # in place (kv_cache.py, kvtransfer/source.py). None: ordinary memory. Falls back to
    # ordinary memory, with a warning, when the directory lacks room.
    shm_dir: str | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_bytes < 1:
            raise ConfigError(f"kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ConfigError(
                f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}"
            )
        if not 0.0 <= self.watermark < 1.0:
            raise ConfigError(f"watermark must be in [0, 1), got {self.watermark}")


@dataclass(frozen=True)
class SchedulerConfig:
    """How much work one engine step may take on."""

    max_num_seqs: int = 128  # running sequences at once
    max_num_batched_tokens: int = 2048  # new tokens (prefill + decode) per step
    # Split long prompts into chunks of the remaining token budget, so one long
    # prefill does not stall every running decode for a whole step.
    enable_chunked_prefill: bool = True
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # New requests refused (QueueFullError; a worker answers RESOURCE_EXHAUSTED and the
    # router tries another) while this many sequences wait to be admitted, so a
    # worker's queue, and the latency of what is in it, cannot grow without bound.
    # 8 full batches of the default max_num_seqs. Preempted sequences re-enter the
    # queue regardless (they were admitted once). None = unbounded: the offline `LLM`
    # submits all its prompts at once.
    max_num_waiting_seqs: int | None = 1024

    def __post_init__(self) -> None:
        if self.max_num_waiting_seqs is not None and self.max_num_waiting_seqs < 1:
            raise ConfigError(
                f"max_num_waiting_seqs must be >= 1 or None, got {self.max_num_waiting_seqs}"
            )
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        RequestLimits(max_model_len=self.max_model_len)  # checks it


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine (one worker, or the offline `LLM`) runs with."""

    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct)
    # "auto": bfloat16 on CUDA and on CPUs with native bf16 matrix instructions
    # (avx512_bf16 / AMX), float32 elsewhere: without them torch emulates bf16 and
    # a bf16 matmul runs ~5x slower than fp32 (measured on a 2-core AVX-512 Xeon).
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    device: str = "cpu"  # "cpu", "cuda", "cuda:1", ...
    attention_backend: str | None = None  # None: Triton on CUDA, torch on CPU
    # fp32 on the CPU: the GEMM behind each weight shape. "auto" measures MKL's packed
    # GEMM, oneDNN's prepacked matmul and plain `x @ w` at load and keeps the fastest
    # (the faster one differs by CPU, up to 2x; common/core/fp32_gemm.py); a backend
    # name forces it. None: $PAGEDSERVE_FP32_GEMM, else "auto".
    fp32_gemm: Literal["auto", "mkl", "onednn", "plain"] | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    max_n: int = 16  # largest `n` (parallel samples) a request may ask for
    max_logprobs: int = 20  # most top logprobs a request may ask for per token
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    # Seeds the global RNG that sampled requests without their own `seed` draw from
    # (vLLM's --seed); None leaves it unseeded. A request's `seed` always wins.
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ConfigError(
                f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}"
            )
        if self.fp32_gemm not in (None, "auto", "mkl", "onednn", "plain"):
            raise ConfigError(
                f"fp32_gemm must be auto, mkl, onednn or plain, got {self.fp32_gemm!r}"
            )
        self.limits  # noqa: B018 (checks max_n, max_logprobs)

    @property
    def limits(self) -> RequestLimits:
        """The request limits this engine enforces (max_model_len None = the model's)."""
        return RequestLimits(self.scheduler.max_model_len, self.max_n, self.max_logprobs)


# The CPU flags that dtype resolution sees. Set, it replaces /proc/cpuinfo's flags line
# (space-separated, e.g. "avx512f amx_bf16" to resolve `auto` as on an AMX Xeon, or
# "avx512f" as on one without bf16), so both branches of `auto` can be exercised on
# any machine: the tests inject flags this way, and CI runs the dtype-sensitive test
# files once more with each setting (.ci/run).
CPU_FLAGS_ENV = "PAGEDSERVE_CPU_FLAGS"
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags() -> frozenset[str]:
    """The flags dtype resolution sees: $PAGEDSERVE_CPU_FLAGS when set, else the CPU's."""
    forced = os.environ.get(CPU_FLAGS_ENV)
    if forced is not None:
        return frozenset(forced.replace(",", " ").split())
    return cpuinfo_flags()


def cpuinfo_flags() -> frozenset[str]:
    """This CPU's real feature flags (/proc/cpuinfo's flags or Features line; empty where
    there is none). What compiled code may use: never overridden by the switch above."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith(("flags", "Features"))), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def cpu_has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    """Whether this CPU multiplies bf16 in hardware (x86 avx512_bf16 or AMX)."""
    flags = cpu_flags() if flags is None else flags
    return any(flag in flags for flag in BF16_CPU_FLAGS)


def resolve_dtype(dtype: str, device: str, flags: frozenset[str] | None = None) -> str:
    """The concrete dtype for "auto" on this device (see EngineConfig.dtype).

    `flags` are the CPU's feature flags (default: `cpu_flags()`); tests pass them.
    """
    if dtype != "auto":
        return dtype
    if device.startswith("cuda") or cpu_has_native_bf16(flags):
        return "bfloat16"
    return "float32"
