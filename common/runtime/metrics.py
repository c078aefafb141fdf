"""The Prometheus exporter of a worker: engine, block-pool, lease, KV-transfer and
per-request phase numbers.

The engine core keeps plain counters (`EngineStats`, `BlockManagerStats`, the
engine's `RequestStatsLog`, the KV source's lease counts, the KV transport's
`TransferStats`); this module, an edge like the gRPC servers, is the only one in
common/ that imports `prometheus_client`. Each worker serves its own endpoint
(`WorkerConfig.metrics_port`, on the worker's listen host) and labels every series
with `model_name`, `pool` and `worker`, so one Prometheus query sums a model or a
pool, or picks a worker.

Decisions:
- Read at scrape time, not pushed, from the scraping thread, like the worker's
  heartbeats (`WorkerRuntime.stats`): a scrape must not wait behind a long prefill
  step. Every field is an int or a len() read, atomic under the GIL; one snapshot may
  mix two consecutive steps, which a 15 s scrape tolerates.
- Histograms are observed where their events happen: step durations and the
  per-request phases by a step hook on the engine thread (draining the engine's
  `request_stats.finished`), KV pull durations by a `TransferStats` listener on the
  pulling thread.
- Liveness from progress, not from answering: the step hook (after every step and
  every idle tick, ~50 ms apart when idle) stamps the time, so
  `pagedserve:engine_tick_age_seconds` grows only while one step runs or the loop is
  stuck, and `pagedserve:engine_up` is 0 once it exceeds `stall_s` (60 s: far above
  any sane step).
- One `CollectorRegistry` per worker (never the global one), so several workers and
  routers in one process (tests, a single-machine cluster) keep their series apart.
- A series named like one of vLLM's has vLLM's meaning (`vllm:num_requests_running`
  -> `pagedserve:num_requests_running`): in particular `prompt_tokens_total` counts
  whole prompts, prefix-cache hits included, once per request, on the worker that
  prefilled it (common/core/request_stats.py); the tokens actually computed are
  `prompt_tokens_computed_total`. KV usage is a fraction in [0, 1].
- `model_name` is the served name (the checkpoint's, as the router reports it), not
  the model id with its weights digest (`worker_info{model}` keeps that).
- `WorkerConfig.metrics_compat = "vllm"` also exports the vLLM-named copies of the
  per-engine series the Kubernetes Gateway API inference extension and vLLM's
  dashboards read (VLLM_SERIES below, plus `vllm:cache_config_info` and the phase
  histograms), with the same labels. Request-level token counters and latency
  histograms (vllm:prompt_tokens_total, vllm:time_to_first_token_seconds, ...) come
  from the router, which sees each request once: workers exporting them too would
  count a disaggregated request twice.

Series (labels `model_name`, `pool`, `worker` on all):
  pagedserve:worker_info{model, address, block_size}   1
  pagedserve:engine_up                                  0 when the engine loop made no progress
                                                        for stall_s (or its counters failed)
  pagedserve:engine_tick_age_seconds                    since the loop last ended a step/tick
  pagedserve:num_requests_running / _waiting / _swapped sequences (samples) in each queue
  pagedserve:kv_cache_usage_perc                        blocks held by sequences / all blocks
  pagedserve:num_blocks / num_free_blocks / num_cached_blocks / num_used_blocks
  pagedserve:num_preemptions_total
  pagedserve:prompt_tokens_total                        prompts prefilled here, cache hits included
  pagedserve:prompt_tokens_computed_total               prompt tokens computed (cache hits not)
  pagedserve:generation_tokens_total                    tokens sampled
  pagedserve:prefix_cache_queries_total / _hits_total   prompt tokens looked up / found cached
  pagedserve:prefix_cache_evictions_total               cached blocks evicted (LRU)
  pagedserve:engine_steps_total, pagedserve:engine_forward_seconds_total
  pagedserve:engine_step_duration_seconds               histogram, one sample per step
  pagedserve:request_queue_time_seconds                 histograms, one sample per request
  pagedserve:request_prefill_time_seconds               that ended here (see request_stats.py
  pagedserve:request_decode_time_seconds                for which phases a request has)
  pagedserve:request_inference_time_seconds
  pagedserve:kv_open_leases, pagedserve:kv_leases_expired_total, pagedserve:kv_staged_bytes
  pagedserve:kv_exports_refused_total                   exports refused at a staging cap
  pagedserve:kv_exports_private_total                   exports staged privately (/dev/shm full)
  pagedserve:kv_exports_in_place_total                  exports read in place (no copy)
  pagedserve:kv_exports_in_place_capped_total           staged instead: the in-place pin cap
  pagedserve:kv_in_place_pinned_bytes                   cache bytes pinned by in-place leases
  pagedserve:kv_transfer_pulls_total{transport}         successful pulls into this worker
  pagedserve:kv_transfer_bytes_total{transport}         KV payload bytes pulled
  pagedserve:kv_transfer_blocks_total{outcome}          pulled / reused (offered, already held)
  pagedserve:kv_transfer_seconds{transport}             histogram, one sample per pull
  pagedserve:kv_transfer_failures_total{cause}          failed pulls (kvtransfer/stats.py CAUSES)
  pagedserve:kv_transfer_checksum_mismatches_total
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedserve.common.runtime.metrics_server import PREFIX, VLLM_PREFIX, MetricsServer
from pagedserve.kvtransfer.stats import CAUSES, PullRecord, TransferSnapshot

if TYPE_CHECKING:
    from pagedserve.common.core.block_manager import BlockManagerStats
    from pagedserve.common.core.engine import EngineStats, LLMEngine
    from pagedserve.common.core.request_stats import FinishedRequestStats
    from pagedserve.common.runtime.worker import WorkerRuntime

logger = logging.getLogger(__name__)

WORKER_LABELS = ("model_name", "pool", "worker")
# Engine step times: ~1 ms (a decode step on a GPU) to seconds (a long prefill on CPU).
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Request phases: a queue wait of a few ms to a decode of minutes.
PHASE_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
    300.0, 600.0,
)  # fmt: skip
# One KV pull: well under a ms over shared memory to seconds for a long prompt over a WAN.
TRANSFER_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0,
)  # fmt: skip
TRANSPORTS = ("shm", "grpc")
# Series also exported under vllm: with metrics_compat="vllm" (same meaning, same labels).
VLLM_SERIES = frozenset(
    {
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "num_preemptions",
        "prefix_cache_queries",
        "prefix_cache_hits",
    }
)
PHASES = ("queue", "prefill", "decode", "inference")
COMPAT_MODES = ("vllm",)
# The HELP text of each scrape-time series, by name (without prefix or _total): one table,
# so that the collector below reads as one line a series.
HELP = {
    "engine_up": "1 while the engine loop makes progress (0: stuck, or its counters unreadable).",
    "engine_tick_age_seconds": "Seconds since the engine loop last ended a step or an idle tick.",
    "kv_open_leases": "Exported KV block sets not yet released.",
    "kv_leases_expired": "Leases that expired unpulled (their KV was freed): lost work.",
    "kv_staged_bytes": "Staging memory held by open leases, bytes.",
    "kv_exports_refused": "KV exports refused at a staging cap (max open leases or staged bytes).",
    "kv_exports_private": (
        "KV exports staged in private memory (shared memory full): pulled over gRPC."
    ),
    "kv_exports_in_place": "KV exports read in place out of this worker's cache (no copy).",
    "kv_exports_in_place_capped": (
        "KV exports staged instead of in place: in-place leases pinned kv_max_in_place_bytes."
    ),
    "kv_in_place_pinned_bytes": (
        "KV cache bytes pinned by open in-place leases (kept from reuse until released)."
    ),
    "kv_transfer_pulls": "Successful KV pulls into this worker, by the transport that moved them.",
    "kv_transfer_bytes": "KV payload bytes pulled into this worker.",
    "kv_transfer_blocks": (
        "KV blocks of pulled leases: pulled, or reused (offered but already held here)."
    ),
    "kv_transfer_failures": "Failed KV pulls, by cause (see kvtransfer/stats.py).",
    "kv_transfer_checksum_mismatches": (
        "KV pulls that failed a chunk checksum (corruption in transit or in staging)."
    ),
    "num_requests_running": "Sequences in the running batch.",
    "num_requests_waiting": "Sequences waiting to be scheduled.",
    "num_requests_swapped": "Preempted sequences swapped to host memory.",
    "kv_cache_usage_perc": "Fraction of KV blocks held by sequences (0-1).",
    "num_blocks": "KV blocks in the pool.",
    "num_free_blocks": "KV blocks free and not cached.",
    "num_cached_blocks": "KV blocks free but cached (evictable prefix cache).",
    "num_used_blocks": "KV blocks held by sequences.",
    "num_preemptions": "Sequences preempted for lack of blocks.",
    "prompt_tokens": "Prompt tokens of the requests prefilled here, prefix-cache hits included.",
    "prompt_tokens_computed": "Prompt tokens computed (prefix-cache hits excluded).",
    "generation_tokens": "Tokens generated.",
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache.",
    "prefix_cache_evictions": "Cached blocks evicted (LRU).",
    "engine_steps": "Engine steps run.",
    "engine_forward_seconds": "Seconds inside the model forward and logits, summed over steps.",
}


@dataclass(frozen=True)
class WorkerSnapshot:
    """What one scrape reads: the engine's counters (None when it did not answer),
    the KV exporter's lease counts and the KV transport's pull counts."""

    engine: EngineStats | None
    blocks: BlockManagerStats | None
    open_leases: int
    expired_leases_total: int
    staged_bytes: int
    tick_age_s: float = 0.0  # seconds since the engine loop last ended a step or idle tick
    engine_up: bool = True  # the loop made progress within stall_s
    prompt_tokens: int = 0  # prompts prefilled here, cache hits included (request_stats)
    exports_refused_total: int = 0  # KVSource.refused_total
    exports_private_total: int = 0  # KVSource.private_fallbacks
    exports_in_place_total: int = 0  # KVSource.in_place_total
    exports_in_place_capped_total: int = 0  # KVSource.in_place_refused
    in_place_pinned_bytes: int = 0  # KVSource.pinned_bytes
    transfer: TransferSnapshot | None = None


@dataclass(frozen=True)
class WorkerIdentity:
    pool: str
    worker: str
    model: str = ""  # the model id (name@digest)
    address: str = ""
    block_size: int = 0
    model_name: str = ""  # the served name: model without "@digest"
    num_blocks: int = 0
    enable_prefix_caching: bool = True


def served_name(model_id: str) -> str:
    """The served name of a model id ("name@digest" -> "name"), as the router names it."""
    return model_id.split("@", 1)[0]


class _Families:
    """Builds a scrape's families, with vLLM-named copies of VLLM_SERIES when asked."""

    def __init__(self, labels: list[str], compat: str | None) -> None:
        self.labels = labels
        self.compat = compat
        self.out: list[Metric] = []

    def _add(self, kind, name: str, doc: str, value: float) -> None:
        prefixes = [PREFIX]
        if self.compat == "vllm" and name in VLLM_SERIES:
            prefixes.append(VLLM_PREFIX)
        for prefix in prefixes:
            family = kind(prefix + name, doc, labels=WORKER_LABELS)
            family.add_metric(self.labels, value)
            self.out.append(family)

    def gauge(self, name: str, value: float) -> None:
        self._add(GaugeMetricFamily, name, HELP[name], value)

    def counter(self, name: str, value: float) -> None:
        self._add(CounterMetricFamily, name, HELP[name], value)

    def labelled_counter(self, name: str, label: str, values: dict[str, float]) -> None:
        family = CounterMetricFamily(PREFIX + name, HELP[name], labels=(*WORKER_LABELS, label))
        for key, value in values.items():
            family.add_metric([*self.labels, key], value)
        self.out.append(family)


@dataclass(eq=False)  # hashed by identity: a registry keys its collectors by them
class _WorkerCollector(Collector):
    """Turns a WorkerSnapshot into metric families at scrape time."""

    identity: WorkerIdentity
    snapshot: Callable[[], WorkerSnapshot]
    compat: str | None = None
    labels: list[str] = field(init=False)

    def __post_init__(self) -> None:
        ident = self.identity
        self.labels = [ident.model_name, ident.pool, ident.worker]

    def collect(self) -> Iterator[Metric]:
        ident = self.identity
        info = GaugeMetricFamily(
            PREFIX + "worker_info",
            "Static facts about the worker (value 1).",
            labels=(*WORKER_LABELS, "model", "address", "block_size"),
        )
        info.add_metric([*self.labels, ident.model, ident.address, str(ident.block_size)], 1.0)
        yield info
        if self.compat == "vllm":
            yield self._cache_config_info()
        snap = self.snapshot()
        f = _Families(self.labels, self.compat)
        f.gauge("engine_up", snap.engine_up and snap.engine is not None)
        f.gauge("engine_tick_age_seconds", snap.tick_age_s)
        f.gauge("kv_open_leases", snap.open_leases)
        f.counter("kv_leases_expired", snap.expired_leases_total)
        f.gauge("kv_staged_bytes", snap.staged_bytes)
        f.counter("kv_exports_refused", snap.exports_refused_total)
        f.counter("kv_exports_private", snap.exports_private_total)
        f.counter("kv_exports_in_place", snap.exports_in_place_total)
        f.counter("kv_exports_in_place_capped", snap.exports_in_place_capped_total)
        f.gauge("kv_in_place_pinned_bytes", snap.in_place_pinned_bytes)
        _transfer_families(f, snap.transfer or TransferSnapshot())
        if snap.engine is not None and snap.blocks is not None:
            _engine_families(f, snap, snap.engine, snap.blocks)
        yield from f.out

    def _cache_config_info(self) -> GaugeMetricFamily:
        ident = self.identity
        info = GaugeMetricFamily(
            VLLM_PREFIX + "cache_config_info",
            "Information of the KV cache configuration (value 1).",
            labels=(*WORKER_LABELS, "block_size", "num_gpu_blocks", "enable_prefix_caching"),
        )
        info.add_metric(
            [
                *self.labels,
                str(ident.block_size),
                str(ident.num_blocks),
                str(ident.enable_prefix_caching),
            ],
            1.0,
        )
        return info


def _transfer_families(f: _Families, t: TransferSnapshot) -> None:
    f.labelled_counter("kv_transfer_pulls", "transport", {k: t.pulls.get(k, 0) for k in TRANSPORTS})
    f.labelled_counter("kv_transfer_bytes", "transport", {k: t.bytes.get(k, 0) for k in TRANSPORTS})
    pulled = sum(t.pulled_blocks.values())
    f.labelled_counter(
        "kv_transfer_blocks", "outcome", {"pulled": pulled, "reused": t.reused_blocks}
    )
    f.labelled_counter("kv_transfer_failures", "cause", {c: t.failures.get(c, 0) for c in CAUSES})
    f.counter("kv_transfer_checksum_mismatches", t.checksum_mismatches)


def _engine_families(
    f: _Families, snap: WorkerSnapshot, e: EngineStats, b: BlockManagerStats
) -> None:
    """The engine's series: `e` and `b` are `snap.engine` and `snap.blocks`, known present."""
    f.gauge("num_requests_running", e.num_running)
    f.gauge("num_requests_waiting", e.num_waiting)
    f.gauge("num_requests_swapped", e.num_swapped)
    f.gauge("kv_cache_usage_perc", e.kv_usage)
    f.gauge("num_blocks", b.num_blocks)
    f.gauge("num_free_blocks", b.num_free)
    f.gauge("num_cached_blocks", b.num_cached_free)
    f.gauge("num_used_blocks", b.num_used)
    f.counter("num_preemptions", e.num_preemptions)
    f.counter("prompt_tokens", snap.prompt_tokens)
    f.counter("prompt_tokens_computed", e.prefill_tokens)
    f.counter("generation_tokens", e.decode_tokens)
    f.counter("prefix_cache_queries", e.prefix_query_tokens)
    f.counter("prefix_cache_hits", e.prefix_hit_tokens)
    f.counter("prefix_cache_evictions", b.num_evictions)
    f.counter("engine_steps", e.num_steps)
    f.counter("engine_forward_seconds", e.forward_s_total)


_PHASE_DOCS = {
    "queue": "Arrival on this worker to its first engine step (an import's KV pull included).",
    "prefill": "First engine step to the first token sampled here (requests prefilled here).",
    "decode": "First token to the last token (requests decoded here).",
    "inference": "First engine step to the last token.",
}


class WorkerMetrics:
    """A worker's registry: the scrape-time collector plus the histograms.

    `snapshot` is called on the scraping thread and must be safe there (see `attach`).
    """

    def __init__(
        self,
        identity: WorkerIdentity,
        snapshot: Callable[[], WorkerSnapshot],
        compat: str | None = None,
    ) -> None:
        if compat not in (None, *COMPAT_MODES):
            raise ValueError(f"metrics compat must be one of {COMPAT_MODES} or None: {compat!r}")
        self.identity = identity
        self.compat = compat
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_WorkerCollector(identity, snapshot, compat))
        labels = (identity.model_name, identity.pool, identity.worker)
        self.step_duration = self._histogram(
            "engine_step_duration_seconds",
            "Wall time of one engine step (schedule, forward, sample).",
            STEP_BUCKETS,
        ).labels(*labels)
        prefixes = [PREFIX] + ([VLLM_PREFIX] if compat == "vllm" else [])
        # phase -> one child per exported prefix (pagedserve:, and vllm: with compat)
        self.phases: dict[str, list] = {
            phase: [
                self._histogram(
                    f"request_{phase}_time_seconds", _PHASE_DOCS[phase], PHASE_BUCKETS, prefix
                ).labels(*labels)
                for prefix in prefixes
            ]
            for phase in PHASES
        }
        transfer = Histogram(
            PREFIX + "kv_transfer_seconds",
            "Wall time of one KV pull into this worker (successful or not).",
            labelnames=(*WORKER_LABELS, "transport"),
            buckets=TRANSFER_BUCKETS,
            registry=self.registry,
        )
        self.transfer_seconds = {k: transfer.labels(*labels, k) for k in (*TRANSPORTS, "none")}
        self._steps_seen = 0
        self.last_tick = time.monotonic()  # see on_step
        self.server: MetricsServer | None = None

    def _histogram(self, name: str, doc: str, buckets, prefix: str = PREFIX) -> Histogram:
        return Histogram(
            prefix + name, doc, labelnames=WORKER_LABELS, buckets=buckets, registry=self.registry
        )

    @classmethod
    def attach(cls, runtime: WorkerRuntime, stall_s: float = 60.0) -> WorkerMetrics:
        """Metrics of `runtime`: scrapes read its counters, a step hook stamps progress
        and feeds the histograms, a transfer listener times the KV pulls. Call before
        the loop starts (hooks are not locked)."""
        engine = runtime.engine
        source = runtime.kv_source
        transfer_stats = getattr(runtime.kv_transport, "stats", None)
        identity = WorkerIdentity(
            pool=runtime.config.pool,
            worker=runtime.config.worker_id,
            model=engine.model_id,
            address=runtime.address,
            block_size=engine.block_manager.block_size,
            model_name=served_name(engine.model_id),
            num_blocks=engine.block_manager.num_blocks,
            enable_prefix_caching=engine.config.cache.enable_prefix_caching,
        )
        metrics: WorkerMetrics

        def snapshot() -> WorkerSnapshot:
            e = b = None
            try:
                e, b = engine.stats(), engine.block_manager.stats()
            except Exception:  # not expected (len() reads); report it instead of failing
                logger.exception("metrics: reading the engine of %s failed", identity.worker)
            age = time.monotonic() - metrics.last_tick
            return WorkerSnapshot(
                e,
                b,
                source.open_leases,
                source.expired_total,
                source.staged_bytes,
                tick_age_s=age,
                engine_up=age < stall_s,
                prompt_tokens=engine.request_stats.prompt_tokens,
                exports_refused_total=source.refused_total,
                exports_private_total=source.private_fallbacks,
                exports_in_place_total=source.in_place_total,
                exports_in_place_capped_total=source.in_place_refused,
                in_place_pinned_bytes=source.pinned_bytes,
                transfer=transfer_stats.snapshot() if transfer_stats is not None else None,
            )

        metrics = cls(identity, snapshot, runtime.config.metrics_compat)
        metrics._steps_seen = engine.stats().num_steps
        runtime.loop.step_hooks.append(metrics.on_step)
        if transfer_stats is not None:
            transfer_stats.listeners.append(metrics.on_pull)
        return metrics

    def on_step(self, engine: LLMEngine) -> None:
        """Step hook (engine thread, after every step and idle tick): stamps progress,
        observes the duration of a step not yet seen and the requests that ended."""
        self.last_tick = time.monotonic()
        s = engine.stats()
        if s.num_steps != self._steps_seen:  # hooks run after every step: at most one new
            self._steps_seen = s.num_steps
            self.step_duration.observe(s.last_step_s)
        for finished in engine.request_stats.drain():
            self.observe_request(finished)

    def observe_request(self, r: FinishedRequestStats) -> None:
        values = {
            "queue": r.queue_s,
            "prefill": r.prefill_s,
            "decode": r.decode_s,
            "inference": r.inference_s,
        }
        for phase, value in values.items():
            if value is not None:
                for child in self.phases[phase]:
                    child.observe(value)

    def on_pull(self, rec: PullRecord) -> None:
        """TransferStats listener (the pulling thread): times every pull."""
        child = self.transfer_seconds.get(rec.transport, self.transfer_seconds["none"])
        child.observe(rec.seconds)

    def serve(self, host: str, port: int) -> MetricsServer:
        """Starts the HTTP endpoint (port 0 = any free one); returns it."""
        if self.server is not None:
            raise RuntimeError(
                f"metrics of {self.identity.worker} already served on {self.server.address}"
            )
        self.server = MetricsServer(self.registry, host, port)
        logger.info(
            "worker %s metrics on http://%s/metrics", self.identity.worker, self.server.address
        )
        return self.server

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
