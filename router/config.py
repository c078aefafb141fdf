"""The router's configuration: one frozen dataclass, checked where it is built."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pagedserve.common.config import ConfigError

DEFAULT_PORT = 50051  # the public Generation service; the CLI dials this by default


@dataclass(frozen=True)
class LoadWeights:
    """How the least-loaded policy weighs a worker's load (see router/policy.py).

    load = max(router in-flight, running + waiting)   # requests on the worker
         + waiting * waiting                           # queued work is worse than running
         + kv_usage * kv_usage                         # a full pool preempts soon
    """

    waiting: float = 1.0
    kv_usage: float = 4.0

    def __post_init__(self) -> None:
        if self.waiting < 0 or self.kv_usage < 0:
            raise ConfigError(f"load weights must be >= 0, got {self}")


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT  # 0 = any free port (tests)
    # The served model: a local checkpoint dir, or None for the default model. The router
    # loads only its tokenizer and config (never weights).
    model: str | None = None
    # Longest prompt + max_tokens a request may ask for; None = the model's. Must not
    # exceed the workers' (SchedulerConfig.max_model_len), or they refuse what passed here.
    max_model_len: int | None = None
    max_n: int = 16  # the workers' EngineConfig.max_n
    max_logprobs: int = 20  # the workers' EngineConfig.max_logprobs
    # Admission control: at most max_inflight requests run; max_queued more wait for a
    # slot; anything beyond is answered RESOURCE_EXHAUSTED at once.
    max_inflight: int = 256
    max_queued: int = 1024
    # A worker without a heartbeat for this long is dropped from routing.
    worker_timeout_s: float = 3.0
    # Conditional disaggregation: a prompt whose uncached part is shorter than this goes
    # straight to a decode worker (no Prefill call). For now the uncached part is the
    # whole prompt; the prefix index (issue 6) will subtract the decode worker's hits.
    disagg_min_prompt_tokens: int = 32
    # Lease of exported KV asked of the prefill worker, in ms; None = the worker's default.
    lease_ttl_ms: int | None = None
    # What a decode worker does when pulling KV fails; None = the worker's configured one.
    transfer_failure_policy: Literal["recompute", "fail"] | None = None
    load_weights: LoadWeights = field(default_factory=LoadWeights)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        if self.max_inflight < 1:
            raise ConfigError(f"max_inflight must be >= 1, got {self.max_inflight}")
        if self.max_queued < 0:
            raise ConfigError(f"max_queued must be >= 0, got {self.max_queued}")
        if self.worker_timeout_s <= 0:
            raise ConfigError(f"worker_timeout_s must be > 0, got {self.worker_timeout_s}")
        if self.disagg_min_prompt_tokens < 0:
            raise ConfigError(
                f"disagg_min_prompt_tokens must be >= 0, got {self.disagg_min_prompt_tokens}"
            )
        if self.lease_ttl_ms is not None and self.lease_ttl_ms < 1:
            raise ConfigError(f"lease_ttl_ms must be >= 1, got {self.lease_ttl_ms}")
        if self.transfer_failure_policy not in (None, "recompute", "fail"):
            raise ConfigError(
                "transfer_failure_policy must be 'recompute', 'fail' or None, "
                f"got {self.transfer_failure_policy!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_n < 1 or self.max_logprobs < 0:
            raise ConfigError(
                f"max_n must be >= 1 and max_logprobs >= 0, got {self.max_n}, {self.max_logprobs}"
            )

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"
