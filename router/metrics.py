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
  pagedserve:router_worker_registry_unavailable_total
  pagedserve:router_retries_total{pool}, pagedserve:router_leases_released_total
  pagedserve:router_live_workers{pool}                   prefill / decode / colocated
  pagedserve:router_up
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

from pagedserve.common.runtime.metrics_server import PREFIX, MetricsServer
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
        yield _gauge("up", "1 when the router's event loop answered this scrape.", snap is not None)
        if snap is not None:
            yield from families(snap)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(R + name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(R + name, doc, value=value)


def _labelled(
    kind: type[CounterMetricFamily] | type[GaugeMetricFamily],
    name: str,
    doc: str,
    label: str,
    values: dict[str, float],
) -> Metric:
    family = kind(R + name, doc, labels=[label])
    for key, value in values.items():
        family.add_metric([key], value)
    return family


def families(s: RouterSnapshot) -> Iterator[Metric]:
    """The scrape-time series of one snapshot (everything but the request histograms)."""
    c = s.counters
    yield _counter("requests_received", "Generate calls received.", c.get("requests", 0))
    yield _gauge("requests_inflight", "Requests holding an admission slot.", s.inflight)
    yield _gauge("requests_queued", "Requests waiting for an admission slot.", s.queued)
    yield _labelled(
        GaugeMetricFamily,
        "admission_limit",
        "Admission control limits (max_inflight, max_queued).",
        "kind",
        {"inflight": s.max_inflight, "queued": s.max_queued},
    )
    yield _counter(
        "admission_rejections",
        "Requests refused with RESOURCE_EXHAUSTED (every slot and queue place taken).",
        s.rejected_total,
    )
    yield _labelled(
        CounterMetricFamily,
        "routing_decisions",
        "How each prompt got computed (see router/metrics.py).",
        "kind",
        {kind: c.get(key, 0) for kind, key in ROUTING_KINDS},
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
    )
    yield _counter(
        "prefix_export_blocks", "Blocks exported for pulls.", c.get("prefix_export_blocks", 0)
    )
    lookups = c.get("index_lookups", 0)
    hits = c.get("index_hits", 0)
    yield _labelled(
        CounterMetricFamily,
        "prefix_index_lookups",
        "Prefix-index lookups: hit (a routable worker holds >= 1 block), miss, skipped.",
        "result",
        {"hit": hits, "miss": lookups - hits, "skipped": c.get("index_skipped", 0)},
    )
    yield _counter(
        "prefix_index_query_blocks",
        "Full prompt blocks looked up in the prefix index.",
        c.get("index_query_blocks", 0),
    )
    yield _counter(
        "prefix_index_hit_blocks",
        "Of those, blocks held by the best holder.",
        c.get("index_hit_blocks", 0),
    )
    yield _counter(
        "prefix_index_unavailable",
        "Prefix-index calls that failed (routing fell back to load only).",
        c.get("index_unavailable", 0),
    )
    yield _gauge("prefix_index_up", "0 while the prefix index is unreachable.", s.index_up)
    yield _counter(
        "worker_registry_unavailable",
        "Reads of the Redis worker registry that failed.",
        c.get("registry_unavailable", 0),
    )
    yield _labelled(
        CounterMetricFamily,
        "retries",
        "Calls retried on another worker after UNAVAILABLE.",
        "pool",
        {"prefill": c.get("prefill_retries", 0), "decode": c.get("decode_retries", 0)},
    )
    yield _counter(
        "leases_released",
        "KV leases the router released (handles never consumed).",
        c.get("leases_released", 0),
    )
    yield _labelled(
        GaugeMetricFamily,
        "live_workers",
        "Workers the router routes to, by pool.",
        "pool",
        dict(s.live_workers),
    )


class RouterMetrics:
    """The registry of one router; `serve` exposes it over HTTP."""

    def __init__(self, router: Router, scrape_timeout_s: float = 5.0) -> None:
        self.router = router
        self.scrape_timeout_s = scrape_timeout_s
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_RouterCollector(self))
        reg = self.registry
        self.requests = Counter(
            R + "requests", "Generate calls ended, by gRPC status code.", ["code"], registry=reg
        )
        self.success = Counter(
            R + "request_success",
            "Samples ended, by finish reason.",
            ["finished_reason"],
            registry=reg,
        )
        self.prompt_tokens = Counter(
            R + "prompt_tokens", "Prompt tokens of the requests served.", registry=reg
        )
        self.generation_tokens = Counter(
            R + "generation_tokens", "Tokens streamed to clients.", registry=reg
        )
        self.ttft = Histogram(
            R + "time_to_first_token_seconds",
            "Arrival to the first token streamed.",
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            R + "inter_token_latency_seconds",
            "Gap between consecutive token-bearing messages of a sample.",
            buckets=ITL_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            R + "e2e_request_latency_seconds",
            "Arrival to the end of the stream, requests that ended OK.",
            buckets=E2E_BUCKETS,
            registry=reg,
        )
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
        code = grpc.StatusCode.OK
        try:
            async with contextlib.aclosing(responses) as inner:  # closed with us, at once
                async for r in inner:
                    if r.token_ids:
                        now = time.perf_counter()
                        if not first_token:
                            first_token = True
                            self.ttft.observe(now - arrived)
                        if r.index in last:
                            self.itl.observe(now - last[r.index])
                        last[r.index] = now
                        self.generation_tokens.inc(len(r.token_ids))
                    if r.finish_reason:
                        self.success.labels(_FINISH.get(r.finish_reason, "other")).inc()
                    if r.HasField("usage") and not prompt_counted:
                        prompt_counted = True
                        self.prompt_tokens.inc(r.usage.prompt_tokens)
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
            self.requests.labels(code.name).inc()
            if code == grpc.StatusCode.OK:
                self.e2e.observe(time.perf_counter() - arrived)


def _status_of(context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    """The status the handler set (abort sets it before raising); UNKNOWN if none."""
    try:
        code = context.code()
    except Exception:  # not every context implements code()
        return grpc.StatusCode.UNKNOWN
    if isinstance(code, grpc.StatusCode):
        return code
    return _CODES.get(code, grpc.StatusCode.UNKNOWN)
