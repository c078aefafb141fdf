"""The Prometheus exporter of a worker: engine, block-pool and lease numbers per pool.

The engine core keeps plain counters (`EngineStats`, `BlockManagerStats`, the KV
source's lease counts); this module, an edge like the gRPC servers, is the only one
in common/ that imports `prometheus_client`. Each worker serves its own endpoint
(`WorkerConfig.metrics_port`, on the worker's listen host) and labels every series
with `pool` and `worker`, so one Prometheus query sums a pool or picks a worker.

Decisions:
- Read at scrape time, not pushed, from the scraping thread, like the worker's
  heartbeats (`WorkerRuntime.stats`): a scrape must not wait behind a long prefill
  step. Every field is an int or a len() read, atomic under the GIL; one snapshot may
  mix two consecutive steps, which a 15 s scrape tolerates. Nothing costs the
  engine anything between scrapes.
- Liveness from progress, not from answering: a step hook (engine thread, after
  every step and every idle tick, ~50 ms apart when idle) stamps the time, so
  `pagedserve:engine_tick_age_seconds` grows only while one step runs or the loop is
  stuck, and `pagedserve:engine_up` is 0 once it exceeds `stall_s` (60 s: far above
  any sane step). The same hook observes each new step's duration for the histogram
  (steps are counted by the engine, so an idle tick observes nothing).
- One `CollectorRegistry` per worker (never the global one), so several workers and
  routers in one process (tests, a single-machine cluster) keep their series apart.
- Names follow vLLM's (`vllm:num_requests_running` -> `pagedserve:num_requests_running`);
  counters get `_total` from the client library. KV usage is a fraction in [0, 1]
  (like `vllm:kv_cache_usage_perc`: 1 means every block is held).

Series (labels `pool`, `worker` on all):
  pagedserve:worker_info{model, address, block_size}   1
  pagedserve:engine_up                                  0 when the engine loop made no progress
                                                        for stall_s (or its counters failed)
  pagedserve:engine_tick_age_seconds                    since the loop last ended a step/tick
  pagedserve:num_requests_running / _waiting / _swapped sequences (samples) in each queue
  pagedserve:kv_cache_usage_perc                        blocks held by sequences / all blocks
  pagedserve:num_blocks / num_free_blocks / num_cached_blocks / num_used_blocks
  pagedserve:num_preemptions_total
  pagedserve:prompt_tokens_total                        prompt tokens computed (cache hits not)
  pagedserve:generation_tokens_total                    tokens sampled
  pagedserve:prefix_cache_queries_total / _hits_total   prompt tokens looked up / found cached
  pagedserve:prefix_cache_evictions_total               cached blocks evicted (LRU)
  pagedserve:engine_steps_total, pagedserve:engine_forward_seconds_total
  pagedserve:engine_step_duration_seconds               histogram, one sample per step
  pagedserve:kv_open_leases, pagedserve:kv_leases_expired_total, pagedserve:kv_staged_bytes
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedserve.common.runtime.metrics_server import PREFIX, MetricsServer

if TYPE_CHECKING:
    from pagedserve.common.core.block_manager import BlockManagerStats
    from pagedserve.common.core.engine import EngineStats, LLMEngine
    from pagedserve.common.runtime.worker import WorkerRuntime

logger = logging.getLogger(__name__)

WORKER_LABELS = ("pool", "worker")
# Engine step times: ~1 ms (a decode step on a GPU) to seconds (a long prefill on CPU).
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True)
class WorkerSnapshot:
    """What one scrape reads: the engine's counters (None when it did not answer)
    and the lease counters of the KV exporter."""

    engine: EngineStats | None
    blocks: BlockManagerStats | None
    open_leases: int
    expired_leases_total: int
    staged_bytes: int
    tick_age_s: float = 0.0  # seconds since the engine loop last ended a step or idle tick
    engine_up: bool = True  # the loop made progress within stall_s


@dataclass(frozen=True)
class WorkerIdentity:
    pool: str
    worker: str
    model: str = ""
    address: str = ""
    block_size: int = 0


class _WorkerCollector(Collector):
    """Turns a WorkerSnapshot into metric families at scrape time."""

    def __init__(self, identity: WorkerIdentity, snapshot: Callable[[], WorkerSnapshot]) -> None:
        self.identity = identity
        self.snapshot = snapshot
        self.labels = [identity.pool, identity.worker]

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(PREFIX + name, doc, labels=WORKER_LABELS)
        g.add_metric(self.labels, value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(PREFIX + name, doc, labels=WORKER_LABELS)
        c.add_metric(self.labels, value)
        return c

    def collect(self) -> Iterator[Metric]:
        ident = self.identity
        info = GaugeMetricFamily(
            PREFIX + "worker_info",
            "Static facts about the worker (value 1).",
            labels=(*WORKER_LABELS, "model", "address", "block_size"),
        )
        info.add_metric([*self.labels, ident.model, ident.address, str(ident.block_size)], 1.0)
        yield info
        snap = self.snapshot()
        yield self._gauge(
            "engine_up",
            "1 while the engine loop makes progress (0: stuck, or its counters unreadable).",
            snap.engine_up and snap.engine is not None,
        )
        yield self._gauge(
            "engine_tick_age_seconds",
            "Seconds since the engine loop last ended a step or an idle tick.",
            snap.tick_age_s,
        )
        yield self._gauge(
            "kv_open_leases", "Exported KV block sets not yet released.", snap.open_leases
        )
        yield self._counter(
            "kv_leases_expired",
            "Leases that expired unpulled (their KV was freed): lost work.",
            snap.expired_leases_total,
        )
        yield self._gauge(
            "kv_staged_bytes", "Staging memory held by open leases, bytes.", snap.staged_bytes
        )
        if snap.engine is not None and snap.blocks is not None:
            yield from self._engine_families(snap.engine, snap.blocks)

    def _engine_families(self, e: EngineStats, b: BlockManagerStats) -> Iterator[Metric]:
        g, c = self._gauge, self._counter
        yield g("num_requests_running", "Sequences in the running batch.", e.num_running)
        yield g("num_requests_waiting", "Sequences waiting to be scheduled.", e.num_waiting)
        yield g(
            "num_requests_swapped", "Preempted sequences swapped to host memory.", e.num_swapped
        )
        yield g("kv_cache_usage_perc", "Fraction of KV blocks held by sequences (0-1).", e.kv_usage)
        yield g("num_blocks", "KV blocks in the pool.", b.num_blocks)
        yield g("num_free_blocks", "KV blocks free and not cached.", b.num_free)
        yield g(
            "num_cached_blocks",
            "KV blocks free but cached (evictable prefix cache).",
            b.num_cached_free,
        )
        yield g("num_used_blocks", "KV blocks held by sequences.", b.num_used)
        yield c("num_preemptions", "Sequences preempted for lack of blocks.", e.num_preemptions)
        yield c(
            "prompt_tokens",
            "Prompt tokens computed (prefix-cache hits excluded).",
            e.prefill_tokens,
        )
        yield c("generation_tokens", "Tokens generated.", e.decode_tokens)
        yield c(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            e.prefix_query_tokens,
        )
        yield c(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache.", e.prefix_hit_tokens
        )
        yield c("prefix_cache_evictions", "Cached blocks evicted (LRU).", b.num_evictions)
        yield c("engine_steps", "Engine steps run.", e.num_steps)
        yield c(
            "engine_forward_seconds",
            "Seconds inside the model forward and logits, summed over steps.",
            e.forward_s_total,
        )


class WorkerMetrics:
    """A worker's registry: the scrape-time collector plus the step-time histogram.

    `snapshot` is called on the scraping thread and must be safe there (see `attach`).
    """

    def __init__(self, identity: WorkerIdentity, snapshot: Callable[[], WorkerSnapshot]) -> None:
        self.identity = identity
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_WorkerCollector(identity, snapshot))
        self.step_duration = Histogram(
            PREFIX + "engine_step_duration_seconds",
            "Wall time of one engine step (schedule, forward, sample).",
            labelnames=WORKER_LABELS,
            buckets=STEP_BUCKETS,
            registry=self.registry,
        ).labels(identity.pool, identity.worker)
        self._steps_seen = 0
        self.last_tick = time.monotonic()  # see on_step
        self.server: MetricsServer | None = None

    @classmethod
    def attach(cls, runtime: WorkerRuntime, stall_s: float = 60.0) -> WorkerMetrics:
        """Metrics of `runtime`: scrapes read its counters, a step hook stamps progress
        and feeds the histogram. Call before the loop starts (hooks are not locked)."""
        engine = runtime.engine
        source = runtime.kv_source
        identity = WorkerIdentity(
            pool=runtime.config.pool,
            worker=runtime.config.worker_id,
            model=engine.model_id,
            address=runtime.address,
            block_size=engine.block_manager.block_size,
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
            )

        metrics = cls(identity, snapshot)
        metrics._steps_seen = engine.stats().num_steps
        runtime.loop.step_hooks.append(metrics.on_step)
        return metrics

    def on_step(self, engine: LLMEngine) -> None:
        """Step hook (engine thread, after every step and idle tick): stamps progress,
        observes the duration of a step not yet seen."""
        self.last_tick = time.monotonic()
        s = engine.stats()
        if s.num_steps != self._steps_seen:  # hooks run after every step: at most one new
            self._steps_seen = s.num_steps
            self.step_duration.observe(s.last_step_s)

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
