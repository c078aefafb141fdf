"""The router's configuration: one frozen dataclass, checked where it is built."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pagedserve.common.api.limits import ConfigError, RequestLimits
from pagedserve.common.runtime.tls import TLSFiles

DEFAULT_PORT = 50051  # the public Generation service; the CLI dials this by default
# The OpenAI-compatible HTTP API's port in `pagedserve up` and `python -m
# pagedserve.router` (RouterConfig.http_port itself defaults to off, so that routers
# built in code, tests among them, never collide on a fixed port).
DEFAULT_HTTP_PORT = 8000
# The internal listener (Registry, PrefixIndex) of `pagedserve up` and of a standalone
# router (python -m pagedserve.router): workers dial it, so it needs a fixed port there.
DEFAULT_INTERNAL_PORT = 50052


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
class PrefixRouting:
    """How the prefix-aware policy weighs cached blocks, transfers and load (policy.py).

    Every candidate gets a cost in *prompt-token equivalents*:

        cost = prefix_weight * (tokens it must compute + transfer cost in tokens)
             + evict_weight  * tokens of other prefixes its cache would evict
             + load_weight   * load                    # load as in LoadWeights

    where "tokens it must compute" are the prompt tokens beyond the prefix it holds
    (or would pull from a holder), and a pull of B blocks costs
    `transfer_overhead_s + B * bytes_per_block / transfer_bytes_per_s` seconds, i.e.
    that many seconds times `prefill_tokens_per_s` tokens. A pull is planned only
    when it is cheaper than computing the same blocks (`B * block_size /
    prefill_tokens_per_s`). The defaults are CPU numbers: ~1k prompt tokens/s for
    a 135M model on two cores (SmolLM2-135M fp32 measured 430 tokens/s on one
    thread here, 512-token prompts), ~1 GB/s for the gRPC transport on loopback (shared
    memory is faster), a few ms for ExportPrefix plus the pull's round trips (the
    router replaces the overhead with the lowest recent ExportPrefix latency it
    measured, and the KV bytes per token with the layout of the handles it sees;
    see router/cost.py).
    """

    enabled: bool = True  # False: the least-loaded policy, no index lookups
    prefix_weight: float = 1.0
    # One unit of load (a request running or queued on the worker) is worth computing
    # this many prompt tokens: a worker 512 cached tokens ahead keeps a request until
    # it has about 8 more requests than the others.
    load_weight: float = 64.0
    # An evicted cached token is computed again later with about this probability:
    # what duplicating a prefix on a full worker costs (policy.py).
    evict_weight: float = 0.5
    pull: bool = True  # cross-worker reuse: pull a prefix from its holder when cheaper
    prefill_tokens_per_s: float = 1000.0
    transfer_bytes_per_s: float = 1.0e9
    transfer_overhead_s: float = 0.005
    # Lease asked of a holder for an exported prefix (the target releases it at once).
    export_lease_ttl_ms: int = 10_000
    # After the index failed (Redis down), route by load only for this long before
    # trying it again, so an outage costs one failed call per period, not per request.
    index_retry_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("prefix_weight", "load_weight", "evict_weight", "transfer_overhead_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("prefill_tokens_per_s", "transfer_bytes_per_s", "index_retry_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.export_lease_ttl_ms < 1:
            raise ConfigError(f"export_lease_ttl_ms must be >= 1, got {self.export_lease_ttl_ms}")


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT  # 0 = any free port (tests)
    # The internal listener (router/server.py, "two planes"): the workers' Registry and
    # PrefixIndex, never on the public port. Loopback by default; 0 = any free port.
    internal_host: str = "127.0.0.1"
    internal_port: int = 0
    # TLS of the public port (certfile + keyfile); None = plaintext (common/runtime/tls.py).
    public_tls: TLSFiles | None = None
    # Mutual TLS of the internal listener and of the router's channels to the workers
    # (certfile + keyfile + ca_certs); None = plaintext.
    internal_tls: TLSFiles | None = None
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
    # Conditional disaggregation: a prompt whose uncached part on the chosen decode
    # worker (the prompt minus the prefix it holds or will pull) is shorter than this
    # goes straight to that decode worker (no Prefill call).
    disagg_min_prompt_tokens: int = 32
    # Lease of exported KV asked of the prefill worker, in ms; None = the worker's default.
    lease_ttl_ms: int | None = None
    # What a decode worker does when pulling KV fails; None = the worker's configured one.
    transfer_failure_policy: Literal["recompute", "fail"] | None = None
    load_weights: LoadWeights = field(default_factory=LoadWeights)
    prefix: PrefixRouting = field(default_factory=PrefixRouting)
    # The shared state of several router replicas: the prefix index (namespaced by the
    # workers' model id) and the worker registry. None = embedded: the index lives in
    # this router (workers publish to its PrefixIndex service) and workers register by
    # heartbeat to its Registry service. URL forms: redis://[user[:password]@]host:port/db,
    # rediss://... (TLS).
    redis_url: str | None = field(default=None, repr=False)  # may carry a password
    registry_poll_s: float = 0.25  # how often the Redis worker registry is read
    # Prometheus endpoint (router/metrics.py) on `host`: None = none, 0 = any free port.
    metrics_port: int | None = None
    # "vllm": also export the vLLM-named request series (vllm:time_to_first_token_seconds,
    # vllm:prompt_tokens_total, ...) that vLLM's dashboards read; None: pagedserve:* only.
    metrics_compat: Literal["vllm"] | None = None
    # OpenAI-compatible HTTP API (router/openai_api.py) on `host`: None = off, 0 = any free.
    http_port: int | None = None
    # -- bounds on the router's internal calls (router/dispatch.py, watch.py) -------
    # Every call to a worker ends within its bound even when the client set no
    # deadline (the client's deadline, when earlier, wins). A Prefill is one prompt's
    # forward plus its queueing on the worker.
    prefill_timeout_s: float = 60.0
    export_timeout_s: float = 5.0  # ExportPrefix only stages cached blocks: quick or broken
    release_lease_timeout_s: float = 5.0
    # Decode streams have no total deadline (a long generation is legitimate): a
    # stream with no message for decode_idle_timeout_s (the worker hangs, or the
    # link is silently cut) is cancelled; before its first token the request moves
    # to another worker (once), after it the client's stream ends with UNAVAILABLE
    # naming the worker. The first message waits for the prompt's prefill, so this
    # must exceed the longest prefill plus queueing on a loaded worker.
    decode_idle_timeout_s: float = 30.0
    # A stream whose worker left the registry (goodbye, missed heartbeats, failed
    # call) gets only this long after the drop to send its next message.
    decode_drop_grace_s: float = 1.0
    # -- input limits (router/frontend.py): INVALID_ARGUMENT beyond them -------------
    max_request_id_bytes: int = 256
    max_cache_salt_bytes: int = 1024
    # A text prompt, or all chat messages together (roles and contents), UTF-8 bytes.
    max_prompt_bytes: int = 1 << 20
    max_messages: int = 256
    # Threads that tokenize, apply chat templates and hash prompts off the event loop.
    frontend_threads: int = 4
    # -- API keys (router/auth.py); neither set = the API is open, as before -------------
    # One key, tenant "default" (`vllm serve --api-key`); repr=False keeps it out of logs.
    api_key: str | None = field(default=None, repr=False)
    # Several keys: one `KEY TENANT [MAX_INFLIGHT]` per line (format: router/auth.py).
    api_keys_file: str | None = None

    def __post_init__(self) -> None:
        for name in (
            "prefill_timeout_s",
            "export_timeout_s",
            "release_lease_timeout_s",
            "decode_idle_timeout_s",
            "decode_drop_grace_s",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in (
            "max_request_id_bytes",
            "max_cache_salt_bytes",
            "max_prompt_bytes",
            "max_messages",
            "frontend_threads",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        if not 0 <= self.internal_port < 65536:
            raise ConfigError(f"internal_port must be in [0, 65535], got {self.internal_port}")
        if self.internal_tls is not None:
            self.internal_tls.require_ca("internal_tls (mutual TLS)")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ConfigError(
                f"metrics_port must be in [0, 65535] or None, got {self.metrics_port}"
            )
        if self.http_port is not None and not 0 <= self.http_port < 65536:
            raise ConfigError(f"http_port must be in [0, 65535] or None, got {self.http_port}")
        if self.metrics_compat not in (None, "vllm"):
            raise ConfigError(f"metrics_compat must be 'vllm' or None, got {self.metrics_compat!r}")
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
        if self.redis_url is not None and not self.redis_url.startswith(
            ("redis://", "rediss://", "unix://")
        ):
            scheme = self.redis_url.split("://", 1)[0] if "://" in self.redis_url else "none"
            raise ConfigError(
                f"redis_url must start with redis://, rediss:// or unix://, got scheme {scheme!r}"
            )
        if not self.registry_poll_s > 0:
            raise ConfigError(f"registry_poll_s must be > 0, got {self.registry_poll_s}")
        self.limits  # noqa: B018 (checks max_model_len, max_n, max_logprobs)

    @property
    def limits(self) -> RequestLimits:
        """The request limits the router enforces: the workers' (EngineConfig.limits)."""
        return RequestLimits(self.max_model_len, self.max_n, self.max_logprobs)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def internal_bind_address(self) -> str:
        return f"{self.internal_host}:{self.internal_port}"
