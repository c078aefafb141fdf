"""The router's Prometheus exporter: requests, latencies, admission, routing decisions.

Two sources, one registry per router (never the global one: several routers in one
process keep their series apart):

- `track` wraps every Generate stream and observes, as the client sees it, the
  request's outcome (its gRPC status code), TTFT (arrival -> first token), the gap
  between consecutive token-bearing messages of a sample (ITL, as `vllm bench serve`
  defines it), E2E latency, finish reasons and token counts.
- At scrape time a collector reads the router's own bookkeeping (`Router.counters`,
  `Admission`, `WorkerRegistry`, the prefix lookup's state) on the router's event
  loop, where that state lives (no locks there), so a scrape sees one consistent
  view; if the loop does not answer within `scrape_timeout_s` the scrape reports
  `pagedserve:router_up 0`.

Every series carries `model_name` (the served model, `Frontend.model_name`), so that
the router's series join the workers' and vLLM's dashboards on it.

Over the ~500-line mark on purpose: it is off the request path (a stream wrapper and
a scrape-time collector) and mostly the list of series with their help texts, which
reads best in one place next to the table below.

Series:
  pagedserve:router_requests_total{code}                 ended requests by gRPC status
  pagedserve:router_requests_received_total
  pagedserve:router_request_success_total{finished_reason} samples ended by length/stop/eos
  pagedserve:router_prompt_tokens_total, pagedserve:router_generation_tokens_total
  pagedserve:router_time_to_first_token_seconds          histogram
  pagedserve:router_inter_token_latency_seconds          histogram
  pagedserve:router_e2e_request_latency_seconds          histogram
  pagedserve:router_requests_inflight / _queued, pagedserve:router_admission_limit{kind}
  pagedserve:router_admission_rejections_total
  pagedserve:router_routing_decisions_total{kind}        how each prompt got computed:
      prefill_decode (a Prefill call succeeded), local_prefill_short (prompt under
      disagg_min_prompt_tokens), local_prefill_cached (the decode worker holds most of
      it), local_prefill_fallback (no prefill worker answered), cross_worker_pull (a
      holder exported a cached prefix to the worker that computes the rest)
  pagedserve:router_prefix_exports_total{outcome}        ok / missing (stale index) / failed
  pagedserve:router_prefix_export_blocks_total
  pagedserve:router_prefix_index_lookups_total{result}   hit / miss / skipped (index down or
                                                         no worker yet)
  pagedserve:router_prefix_index_query_blocks_total / _hit_blocks_total
  pagedserve:router_prefix_index_unavailable_total, pagedserve:router_prefix_index_up
  pagedserve:router_prefix_index_busy_total              lookups skipped: every lookup thread
                                                         busy (also in lookups{result=skipped})
  pagedserve:router_worker_registry_unavailable_total
  pagedserve:router_worker_registry_malformed_total      Redis registry entries skipped (bad data)
  pagedserve:router_retries_total{pool}, pagedserve:router_leases_released_total
  pagedserve:router_worker_refusals_total{pool}          RESOURCE_EXHAUSTED from a worker: the
                                                         request moved to another one
  pagedserve:router_draining_refusals_total              Generate calls refused while draining
                                                         (UNAVAILABLE; not in requests_total)
  pagedserve:router_channels_closed_total                channels to departed workers closed
  pagedserve:router_live_workers{pool}                   prefill / decode / colocated
  pagedserve:router_up
(`Router.counters` "invalid" and "rejected" are requests_total{code=INVALID_ARGUMENT}
and admission_rejections_total.)

With `RouterConfig.metrics_compat = "vllm"` the router also exports, under vLLM's
names and meanings, the request-level series vLLM's dashboards read (the workers
export the per-engine gauges, see common/runtime/metrics.py; exporting these once, at
the router that sees every request once, keeps a disaggregated request from counting
twice):
  vllm:prompt_tokens_total, vllm:generation_tokens_total
  vllm:request_success_total{finished_reason}            stop (eos included) / length / abort
  vllm:request_prompt_tokens, vllm:request_generation_tokens   histograms per request
  vllm:time_to_first_token_seconds, vllm:e2e_request_latency_seconds
  vllm:inter_token_latency_seconds, vllm:time_per_output_token_seconds  (the same
      per-gap samples: vLLM's older name for the latter)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedserve.common.runtime.metrics_server import PREFIX, VLLM_PREFIX, MetricsServer
from pagedserve.v1 import generation_pb2

if TYPE_CHECKING:
    from pagedserve.router.server import Router

logger = logging.getLogger(__name__)

R = PREFIX + "router_"
POOLS = ("prefill", "decode", "colocated")
# (metric kind label, Router.counters key)
ROUTING_KINDS = (
    ("prefill_decode", "prefill_calls"),
    ("local_prefill_short", "local_prefill_short"),
    ("local_prefill_cached", "local_prefill_cached"),
    ("local_prefill_fallback", "local_prefill_fallback"),
    ("cross_worker_pull", "prefix_exports"),
)
# Latency buckets, seconds: CPU prefill of long prompts takes seconds; GPU decode ms.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# Tokens per request (vllm:request_prompt_tokens / _generation_tokens): 1 to 128k.
TOKEN_BUCKETS = tuple(float(2**k) for k in range(18))
# Our finish reasons -> vLLM's finished_reason label (vLLM reports an EOS as "stop").
_VLLM_FINISH = {"length": "length", "stop": "stop", "eos": "stop", "abort": "abort"}
_CODES = {c.value[0]: c for c in grpc.StatusCode}
_FINISH = {
    generation_pb2.FINISH_REASON_LENGTH: "length",
    generation_pb2.FINISH_REASON_STOP: "stop",
    generation_pb2.FINISH_REASON_EOS: "eos",
    generation_pb2.FINISH_REASON_ABORT: "abort",
}


@dataclass(frozen=True)
class RouterSnapshot:
    """The router's bookkeeping at one instant (read on its event loop)."""

    counters: dict[str, int]
    inflight: int
    queued: int
    max_inflight: int
    max_queued: int
    rejected_total: int
    live_workers: dict[str, int] = field(default_factory=dict)  # pool -> count
    index_up: bool = True


def take_snapshot(router: Router) -> RouterSnapshot:
    """Reads `router` (call on its event loop)."""
    live = dict.fromkeys(POOLS, 0)
    for w in router.registry.workers():
        live[w.pool] = live.get(w.pool, 0) + 1
    adm = router.admission
    return RouterSnapshot(
        counters=dict(router.counters),
        inflight=adm.inflight,
        queued=adm.queued,
        max_inflight=adm.max_inflight,
        max_queued=adm.max_queued,
        rejected_total=adm.rejected_total,
        live_workers=live,
        index_up=not router.prefix.unavailable,
    )


class _RouterCollector(Collector):
    def __init__(self, metrics: RouterMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        snap = self.metrics.snapshot()
        model = self.metrics.model_name
        up = "1 when the router's event loop answered this scrape."
        yield _gauge("up", up, snap is not None, model)
        if snap is not None:
            yield from families(snap, model)


def _gauge(name: str, doc: str, value: float, model: str) -> GaugeMetricFamily:
    family = GaugeMetricFamily(R + name, doc, labels=["model_name"])
    family.add_metric([model], value)
    return family


# Counters by pool: (series name, Router.counters key "<pool>_<suffix>", help).
_POOL_COUNTERS = (
    ("retries", "retries", "Calls retried on another worker after UNAVAILABLE."),
    (
        "worker_refusals",
        "refused",
        "Calls a worker refused (RESOURCE_EXHAUSTED: full); the request moved on.",
    ),
)
# Plain counters: (series name, Router.counters key, help), each labelled model_name.
_COUNTERS = (
    (
        "draining_refusals",
        "refused_draining",
        "Generate calls refused with UNAVAILABLE while the router drains.",
    ),
    (
        "worker_registry_unavailable",
        "registry_unavailable",
        "Reads of the Redis worker registry that failed.",
    ),
    (
        "worker_registry_malformed",
        "registry_malformed",
        "Worker entries in the Redis registry skipped as malformed.",
    ),
    (
        "leases_released",
        "leases_released",
        "KV leases the router released (handles never consumed).",
    ),
    ("channels_closed", "channels_closed", "Channels to workers that left, closed."),
    (
        "prefix_index_busy",
        "index_busy",
        "Lookups skipped because every lookup thread was busy (counted in skipped too).",
    ),
    (
        "prefix_index_query_blocks",
        "index_query_blocks",
        "Full prompt blocks looked up in the prefix index.",
    ),
    ("prefix_index_hit_blocks", "index_hit_blocks", "Of those, blocks held by the best holder."),
    (
        "prefix_index_unavailable",
        "index_unavailable",
        "Prefix-index calls that failed (routing fell back to load only).",
    ),
)


def _counter(name: str, doc: str, value: float, model: str) -> CounterMetricFamily:
    family = CounterMetricFamily(R + name, doc, labels=["model_name"])
    family.add_metric([model], value)
    return family


def _labelled(
    kind: type[CounterMetricFamily] | type[GaugeMetricFamily],
    name: str,
    doc: str,
    label: str,
    values: dict[str, float],
    model: str,
) -> Metric:
    family = kind(R + name, doc, labels=["model_name", label])
    for key, value in values.items():
        family.add_metric([model, key], value)
    return family


def families(s: RouterSnapshot, model: str = "") -> Iterator[Metric]:
    """The scrape-time series of one snapshot (everything but the request histograms),
    labelled model_name=`model`."""
    c = s.counters
    m = model
    yield _counter("requests_received", "Generate calls received.", c.get("requests", 0), m)
    yield _gauge("requests_inflight", "Requests holding an admission slot.", s.inflight, m)
    yield _gauge("requests_queued", "Requests waiting for an admission slot.", s.queued, m)
    yield _labelled(
        GaugeMetricFamily,
        "admission_limit",
        "Admission control limits (max_inflight, max_queued).",
        "kind",
        {"inflight": s.max_inflight, "queued": s.max_queued},
        m,
    )
    yield _counter(
        "admission_rejections",
        "Requests refused with RESOURCE_EXHAUSTED (every slot and queue place taken).",
        s.rejected_total,
        m,
    )
    yield _labelled(
        CounterMetricFamily,
        "routing_decisions",
        "How each prompt got computed (see router/metrics.py).",
        "kind",
        {kind: c.get(key, 0) for kind, key in ROUTING_KINDS},
        m,
    )
    yield _labelled(
        CounterMetricFamily,
        "prefix_exports",
        "ExportPrefix calls for cross-worker pulls, by outcome (missing: stale index entry).",
        "outcome",
        {
            "ok": c.get("prefix_exports", 0),
            "missing": c.get("prefix_export_missing", 0),
            "failed": c.get("prefix_export_failed", 0),
        },
        m,
    )
    yield _counter(
        "prefix_export_blocks", "Blocks exported for pulls.", c.get("prefix_export_blocks", 0), m
    )
    yield from _index_families(c, s.index_up, m)
    for name, suffix, doc in _POOL_COUNTERS:
        by_pool = {pool: c.get(f"{pool}_{suffix}", 0) for pool in ("prefill", "decode")}
        yield _labelled(CounterMetricFamily, name, doc, "pool", by_pool, m)
    for name, key, doc in _COUNTERS:
        yield _counter(name, doc, c.get(key, 0), m)
    yield _labelled(
        GaugeMetricFamily,
        "live_workers",
        "Workers the router routes to, by pool.",
        "pool",
        dict(s.live_workers),
        m,
    )


def _index_families(c: dict[str, int], index_up: bool, m: str) -> Iterator[Metric]:
    lookups = c.get("index_lookups", 0)
    hits = c.get("index_hits", 0)
    yield _labelled(
        CounterMetricFamily,
        "prefix_index_lookups",
        "Prefix-index lookups: hit (a routable worker holds >= 1 block), miss, skipped.",
        "result",
        {"hit": hits, "miss": lookups - hits, "skipped": c.get("index_skipped", 0)},
        m,
    )
    yield _gauge("prefix_index_up", "0 while the prefix index is unreachable.", index_up, m)


class _ModelSeries:
    """Series under one prefix, each labelled with the served model's name."""

    def __init__(self, reg: CollectorRegistry, prefix: str, model: str) -> None:
        self.reg, self.prefix, self.model = reg, prefix, model

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(self.prefix + name, doc, ["model_name"], registry=self.reg).labels(
            self.model
        )

    def _by(self, name: str, doc: str, label: str) -> Counter:
        """A counter family with one more label: bind it per value with `.labels`."""
        return Counter(self.prefix + name, doc, ["model_name", label], registry=self.reg)

    def _histogram(self, name: str, doc: str, buckets) -> Histogram:
        return Histogram(
            self.prefix + name, doc, ["model_name"], buckets=buckets, registry=self.reg
        ).labels(self.model)


class _RequestSeries(_ModelSeries):
    """The request-side series under one prefix, bound to the model_name label."""

    def __init__(self, reg: CollectorRegistry, prefix: str, model: str) -> None:
        super().__init__(reg, prefix, model)
        self._requests = self._by("requests", "Generate calls ended, by gRPC status code.", "code")
        self._success = self._by(
            "request_success", "Samples ended, by finish reason.", "finished_reason"
        )
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens of the requests served.")
        self.generation_tokens = self._counter("generation_tokens", "Tokens streamed to clients.")
        self.ttft = self._histogram(
            "time_to_first_token_seconds", "Arrival to the first token streamed.", TTFT_BUCKETS
        )
        self.itl = self._histogram(
            "inter_token_latency_seconds",
            "Gap between consecutive token-bearing messages of a sample.",
            ITL_BUCKETS,
        )
        self.e2e = self._histogram(
            "e2e_request_latency_seconds",
            "Arrival to the end of the stream, requests that ended OK.",
            E2E_BUCKETS,
        )

    def requests(self, code: str):
        return self._requests.labels(self.model, code)

    def success(self, reason: str):
        return self._success.labels(self.model, reason)


class _VllmSeries(_ModelSeries):
    """vLLM's request-level series (metrics_compat="vllm"), with vLLM's meanings."""

    def __init__(self, reg: CollectorRegistry, model: str) -> None:
        super().__init__(reg, VLLM_PREFIX, model)
        hist = self._histogram
        self.prompt_tokens = self._counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = self._counter(
            "generation_tokens", "Number of generation tokens processed."
        )
        self._success = self._by(
            "request_success", "Count of successfully processed requests.", "finished_reason"
        )
        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Inter-token latency.", ITL_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds", "Time per output token.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End to end request latency.", E2E_BUCKETS)
        self.request_prompt_tokens = hist(
            "request_prompt_tokens", "Number of prefill tokens processed.", TOKEN_BUCKETS
        )
        self.request_generation_tokens = hist(
            "request_generation_tokens", "Number of generation tokens processed.", TOKEN_BUCKETS
        )

    def success(self, reason: str):
        return self._success.labels(self.model, _VLLM_FINISH.get(reason, "abort"))


class RouterMetrics:
    """The registry of one router; `serve` exposes it over HTTP."""

    def __init__(self, router: Router, scrape_timeout_s: float = 5.0) -> None:
        self.router = router
        self.scrape_timeout_s = scrape_timeout_s
        self.model_name: str = router.frontend.model_name
        compat = getattr(router.config, "metrics_compat", None)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_RouterCollector(self))
        self.series = _RequestSeries(self.registry, R, self.model_name)
        self.vllm = _VllmSeries(self.registry, self.model_name) if compat == "vllm" else None
        self.server: MetricsServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None

    # -- scrape side -------------------------------------------------------------------

    def snapshot(self) -> RouterSnapshot | None:
        """The router's state, read on its loop; None if the loop did not answer."""
        loop = self._loop
        if loop is None or threading.get_ident() == self._loop_thread:
            return take_snapshot(self.router)  # not serving yet, or called on the loop

        async def read() -> RouterSnapshot:
            return take_snapshot(self.router)

        try:
            return asyncio.run_coroutine_threadsafe(read(), loop).result(self.scrape_timeout_s)
        except Exception as e:  # a closed or stuck loop: report it instead of failing
            logger.warning("metrics: the router's loop did not answer: %s", e)
            return None

    def serve(self, host: str, port: int) -> MetricsServer:
        """Starts the HTTP endpoint (port 0 = any free one). Call on the router's loop."""
        if self.server is not None:
            raise RuntimeError(f"router metrics already served on {self.server.address}")
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self.server = MetricsServer(self.registry, host, port)
        logger.info("router metrics on http://%s/metrics", self.server.address)
        return self.server

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        self._loop = None

    # -- request side ------------------------------------------------------------------

    async def track(
        self,
        responses: AsyncIterator[generation_pb2.GenerateResponse],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """Relays `responses`, observing latencies, tokens and the final status code."""
        arrived = time.perf_counter()
        first_token = False
        last: dict[int, float] = {}  # sample index -> time of its last token
        prompt_counted = False
        generated = 0
        code = grpc.StatusCode.OK
        series, vllm = self.series, self.vllm
        try:
            async with contextlib.aclosing(responses) as inner:  # closed with us, at once
                async for r in inner:
                    if r.token_ids:
                        now = time.perf_counter()
                        if not first_token:
                            first_token = True
                            series.ttft.observe(now - arrived)
                            if vllm is not None:
                                vllm.ttft.observe(now - arrived)
                        if r.index in last:
                            self._observe_itl(now - last[r.index])
                        last[r.index] = now
                        generated += len(r.token_ids)
                        series.generation_tokens.inc(len(r.token_ids))
                        if vllm is not None:
                            vllm.generation_tokens.inc(len(r.token_ids))
                    if r.finish_reason:
                        reason = _FINISH.get(r.finish_reason, "other")
                        series.success(reason).inc()
                        if vllm is not None:
                            vllm.success(reason).inc()
                    if r.HasField("usage") and not prompt_counted:
                        prompt_counted = True
                        series.prompt_tokens.inc(r.usage.prompt_tokens)
                        if vllm is not None:
                            vllm.prompt_tokens.inc(r.usage.prompt_tokens)
                            vllm.request_prompt_tokens.observe(r.usage.prompt_tokens)
                    yield r
        except (asyncio.CancelledError, GeneratorExit):
            code = grpc.StatusCode.CANCELLED  # the client left, or its deadline passed:
            remaining = context.time_remaining()
            if remaining is not None and remaining <= 0:
                code = grpc.StatusCode.DEADLINE_EXCEEDED
            raise
        except BaseException:
            code = _status_of(context)
            raise
        finally:
            series.requests(code.name).inc()
            if code == grpc.StatusCode.OK:
                series.e2e.observe(time.perf_counter() - arrived)
                if vllm is not None:
                    vllm.e2e.observe(time.perf_counter() - arrived)
                    vllm.request_generation_tokens.observe(generated)

    def _observe_itl(self, gap: float) -> None:
        self.series.itl.observe(gap)
        if self.vllm is not None:
            self.vllm.itl.observe(gap)
            self.vllm.tpot.observe(gap)


def _status_of(context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    """The status the handler set (abort sets it before raising); UNKNOWN if none."""
    try:
        code = context.code()
    except Exception:  # not every context implements code()
        return grpc.StatusCode.UNKNOWN
    if isinstance(code, grpc.StatusCode):
        return code
    return _CODES.get(code, grpc.StatusCode.UNKNOWN)
