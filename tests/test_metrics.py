"""Prometheus metrics of real in-process workers and a router, scraped over HTTP.

A router and one prefill + one decode worker (tiny checkpoint, real gRPC on
loopback) each serve their own /metrics on 127.0.0.1 (port 0 = any free port). The
tests send requests through the router and check the scraped values exactly: token
counts, request counts by status code, routing decisions, blocks and leases, KV bytes
and blocks pulled, per-request phase histograms, the `model_name` label on every
series, and the vLLM-named series (only with metrics_compat="vllm").
"""

from __future__ import annotations

import asyncio
import dataclasses
import urllib.error
import urllib.request

import grpc
import pytest
from builders import one_torch_thread  # noqa: F401  (autouse: one torch thread)
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from router_fixtures import ROUTER_CONFIG, Cluster, tiny_engine_config, wait_for

from pagedserve import launch
from pagedserve.common.api.limits import ConfigError
from pagedserve.common.runtime.metrics import WorkerIdentity, WorkerMetrics, WorkerSnapshot
from pagedserve.common.runtime.worker import WorkerConfig
from pagedserve.kvtransfer.faults import FaultInjector, FaultSpec, install
from pagedserve.router.config import RouterConfig
from pagedserve.router.metrics import RouterSnapshot
from pagedserve.router.metrics import families as router_families
from pagedserve.router.server import start_router_in_thread
from pagedserve.worker import start_worker

PROMPT = list(range(5, 45))  # 40 tokens: 2 full blocks of 16 in the chain of 39
MAX_TOKENS = 7


# -- scraping helpers (also used by test_deploy.py) --------------------------------------


def scrape_text(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        assert resp.status == 200
        return resp.read().decode()


def parse_samples(text: str) -> dict[tuple[str, frozenset], float]:
    """{(sample name, frozenset of label items): value}."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def exported_names(text: str) -> set[str]:
    """Every series name a PromQL query may use, derived from the families' types (a
    labelled family without children yet still counts: its name is exported)."""
    names: set[str] = set()
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_count", "_sum", "_created"),
        "gauge": ("",),
    }
    for family in text_string_to_metric_families(text):
        names.update(family.name + s for s in suffixes.get(family.type, ("",)))
        names.update(s.name for s in family.samples)
    return names


class Scrape:
    """One scrape of one endpoint; `value(name, **labels)` finds exactly one sample."""

    def __init__(self, address: str) -> None:
        self.text = scrape_text(address)
        self.samples = parse_samples(self.text)

    def value(self, name: str, **labels: str) -> float:
        want = set(labels.items())
        found = [v for (n, ls), v in self.samples.items() if n == name and want <= ls]
        assert len(found) == 1, f"{name}{labels}: {len(found)} samples in\n{self.text}"
        return found[0]

    def label_values(self, label: str) -> set[str]:
        return {v for (_, ls) in self.samples for k, v in ls if k == label}

    def names(self) -> set[str]:
        return {n for n, _ in self.samples}

    def assert_model_name_everywhere(self, name: str) -> None:
        """Every sample carries model_name=`name`."""
        for n, ls in self.samples:
            assert ("model_name", name) in ls, f"{n}{dict(ls)} lacks model_name={name!r}"


# -- fixtures ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    ec = tiny_engine_config()
    rc = dataclasses.replace(ROUTER_CONFIG, model=ec.model, metrics_port=0)
    c = Cluster(start_router_in_thread(rc), ec)
    try:
        for worker_id, pool in [("p0", "prefill"), ("d0", "decode")]:
            # The workers publish their cached blocks to the router's embedded index.
            c.add_worker(worker_id, pool, metrics_port=0, index_address=c.internal_address)
        yield c
    finally:
        c.stop()


def router_scrape(c: Cluster) -> Scrape:
    return Scrape(c.router.router.metrics.server.address)


def worker_scrape(c: Cluster, worker_id: str) -> Scrape:
    return Scrape(c.workers[worker_id].metrics.server.address)


def block_bytes(rt) -> int:
    """KV payload bytes of one block of `rt`'s cache (every layer, K and V)."""
    kv = rt.engine.kv_cache.kv  # [blocks, layers, 2, block_size, kv_heads, head_dim]
    return kv[0].numel() * kv.element_size()


def tiny_model_name(c: Cluster) -> str:
    return c.router.router.frontend.model_name


def generate(c: Cluster, prompt: list[int]) -> list:
    with c.client() as client:
        return list(
            client.generate(
                token_ids=prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
            )
        )


# -- tests -------------------------------------------------------------------------------


def test_one_disaggregated_request(cluster):
    responses = generate(cluster, PROMPT)
    token_msgs = [r for r in responses if r.token_ids]
    assert sum(len(r.token_ids) for r in responses) == MAX_TOKENS
    cluster.wait_quiescent()  # blocks back, leases released

    r = router_scrape(cluster)
    assert r.value("pagedserve:router_up") == 1
    assert r.value("pagedserve:router_requests_received_total") == 1
    assert r.value("pagedserve:router_requests_total", code="OK") == 1
    assert r.value("pagedserve:router_prompt_tokens_total") == len(PROMPT)
    assert r.value("pagedserve:router_generation_tokens_total") == MAX_TOKENS
    assert r.value("pagedserve:router_request_success_total", finished_reason="length") == 1
    assert r.value("pagedserve:router_time_to_first_token_seconds_count") == 1
    assert r.value("pagedserve:router_inter_token_latency_seconds_count") == len(token_msgs) - 1
    assert r.value("pagedserve:router_e2e_request_latency_seconds_count") == 1
    assert r.value("pagedserve:router_routing_decisions_total", kind="prefill_decode") == 1
    for kind in ("local_prefill_short", "local_prefill_cached", "cross_worker_pull"):
        assert r.value("pagedserve:router_routing_decisions_total", kind=kind) == 0
    assert r.value("pagedserve:router_prefix_index_lookups_total", result="miss") == 1
    assert r.value("pagedserve:router_prefix_index_lookups_total", result="hit") == 0
    assert r.value("pagedserve:router_prefix_index_query_blocks_total") == 2
    assert r.value("pagedserve:router_requests_inflight") == 0
    assert r.value("pagedserve:router_admission_limit", kind="inflight") == 64
    assert r.value("pagedserve:router_live_workers", pool="prefill") == 1
    assert r.value("pagedserve:router_live_workers", pool="decode") == 1
    assert r.value("pagedserve:router_live_workers", pool="colocated") == 0
    name = tiny_model_name(cluster)
    r.assert_model_name_everywhere(name)
    assert not {n for n in r.names() if n.startswith("vllm:")}  # no compat asked

    p = worker_scrape(cluster, "p0")
    assert p.label_values("worker") == {"p0"} and p.label_values("pool") == {"prefill"}
    p.assert_model_name_everywhere(name)
    assert not {n for n in p.names() if n.startswith("vllm:")}
    assert p.value("pagedserve:engine_up") == 1
    # vLLM's meaning: the whole prompt, once, where it was prefilled.
    assert p.value("pagedserve:prompt_tokens_total") == len(PROMPT)
    assert p.value("pagedserve:prompt_tokens_computed_total") == len(PROMPT)
    # The prefill worker's phases: queued, prefilled, handed over (no decode here).
    assert p.value("pagedserve:request_queue_time_seconds_count") == 1
    assert p.value("pagedserve:request_prefill_time_seconds_count") == 1
    assert p.value("pagedserve:request_decode_time_seconds_count") == 0
    assert p.value("pagedserve:kv_transfer_pulls_total", transport="shm") == 0
    assert p.value("pagedserve:generation_tokens_total") == 1  # the first token
    assert p.value("pagedserve:prefix_cache_queries_total") == len(PROMPT)
    assert p.value("pagedserve:prefix_cache_hits_total") == 0
    assert p.value("pagedserve:num_cached_blocks") == 2  # the prompt's full blocks
    assert p.value("pagedserve:num_used_blocks") == 0
    assert p.value("pagedserve:num_free_blocks") == 128 - 2
    assert p.value("pagedserve:num_blocks") == 128
    assert p.value("pagedserve:kv_cache_usage_perc") == 0
    assert p.value("pagedserve:kv_open_leases") == 0
    assert p.value("pagedserve:kv_leases_expired_total") == 0
    # Exported in place (the default: the cache is a /dev/shm file), pin returned on release.
    assert p.value("pagedserve:kv_exports_in_place_total") == 1
    assert p.value("pagedserve:kv_exports_in_place_capped_total") == 0
    assert p.value("pagedserve:kv_in_place_pinned_bytes") == 0
    assert p.value("pagedserve:kv_staged_bytes") == 0
    assert p.value("pagedserve:engine_steps_total") == 1
    assert p.value("pagedserve:engine_step_duration_seconds_count") == 1
    assert p.value("pagedserve:worker_info", block_size="16") == 1

    d = worker_scrape(cluster, "d0")
    assert d.label_values("worker") == {"d0"} and d.label_values("pool") == {"decode"}
    d.assert_model_name_everywhere(name)
    assert d.value("pagedserve:prompt_tokens_total") == 0  # the prompt's KV was pulled
    assert d.value("pagedserve:prompt_tokens_computed_total") == 0
    # One pull over shared memory (one host): the prompt's 3 blocks (2 full + 1 partial).
    dw = cluster.workers["d0"]
    assert d.value("pagedserve:kv_transfer_pulls_total", transport="shm") == 1
    assert d.value("pagedserve:kv_transfer_pulls_total", transport="grpc") == 0
    assert d.value("pagedserve:kv_transfer_bytes_total", transport="shm") == 3 * block_bytes(dw)
    assert d.value("pagedserve:kv_transfer_blocks_total", outcome="pulled") == 3
    assert d.value("pagedserve:kv_transfer_blocks_total", outcome="reused") == 0
    assert d.value("pagedserve:kv_transfer_seconds_count", transport="shm") == 1
    assert d.value("pagedserve:kv_transfer_checksum_mismatches_total") == 0
    for cause in ("checksum", "lease_not_found", "timeout", "cancelled", "transfer"):
        assert d.value("pagedserve:kv_transfer_failures_total", cause=cause) == 0
    # The decode worker's phases: its queue (the import included), no prefill, a decode.
    phases = ("queue", "prefill", "decode", "inference")
    counts = {ph: d.value(f"pagedserve:request_{ph}_time_seconds_count") for ph in phases}
    assert counts == {"queue": 1, "prefill": 0, "decode": 1, "inference": 1}
    assert d.value("pagedserve:kv_exports_refused_total") == 0
    assert d.value("pagedserve:kv_exports_private_total") == 0
    assert d.value("pagedserve:generation_tokens_total") == MAX_TOKENS - 1
    assert d.value("pagedserve:num_requests_running") == 0
    assert d.value("pagedserve:num_preemptions_total") == 0
    steps = d.value("pagedserve:engine_steps_total")
    assert steps == MAX_TOKENS - 1
    assert d.value("pagedserve:engine_step_duration_seconds_count") == steps
    # The scraped numbers are the engine's own.
    stats = cluster.workers["d0"].loop.call(lambda e: e.stats())
    assert stats.decode_tokens == MAX_TOKENS - 1 and stats.num_steps == steps


def test_repeated_prompt_hits_the_prefix_cache_and_index(cluster):
    r0 = router_scrape(cluster)
    p0 = worker_scrape(cluster, "p0")
    # Wait until both workers' blocks of the prompt reached the router's index.
    wait_for(
        lambda: len(cluster.router.call(lambda r: r.prefix.match(PROMPT, None)).holders) == 2,
        what="the prompt's blocks in the prefix index",
    )
    generate(cluster, PROMPT)
    cluster.wait_quiescent()

    r = router_scrape(cluster)
    hits = "pagedserve:router_prefix_index_lookups_total"
    assert r.value(hits, result="hit") == r0.value(hits, result="hit") + 1
    assert r.value("pagedserve:router_prefix_index_hit_blocks_total") == 2
    assert r.value("pagedserve:router_requests_total", code="OK") == 2
    assert r.value("pagedserve:router_generation_tokens_total") == 2 * MAX_TOKENS
    # 40 - 32 cached = 8 tokens to compute >= disagg_min_prompt_tokens: prefill on p0.
    assert r.value("pagedserve:router_routing_decisions_total", kind="prefill_decode") == 2
    p = worker_scrape(cluster, "p0")
    cached = 32
    assert p.value("pagedserve:prefix_cache_hits_total") == cached
    assert p.value("pagedserve:prefix_cache_queries_total") == 2 * len(PROMPT)
    # prompt_tokens_total includes the cached tokens (vLLM's meaning); _computed does not.
    assert p.value("pagedserve:prompt_tokens_total") == p0.value(
        "pagedserve:prompt_tokens_total"
    ) + len(PROMPT)
    assert (
        p.value("pagedserve:prompt_tokens_computed_total")
        == p0.value("pagedserve:prompt_tokens_computed_total") + len(PROMPT) - cached
    )
    assert p.value("pagedserve:num_cached_blocks") == 2
    assert p.value("pagedserve:request_prefill_time_seconds_count") == 2
    # The decode worker held the 2 full blocks already: it pulled only the partial one.
    d = worker_scrape(cluster, "d0")
    assert d.value("pagedserve:kv_transfer_pulls_total", transport="shm") == 2
    assert d.value("pagedserve:kv_transfer_blocks_total", outcome="pulled") == 3 + 1
    assert d.value("pagedserve:kv_transfer_blocks_total", outcome="reused") == 2
    dw = cluster.workers["d0"]
    assert d.value("pagedserve:kv_transfer_bytes_total", transport="shm") == 4 * block_bytes(dw)
    assert d.value("pagedserve:request_decode_time_seconds_count") == 2


def test_status_codes_admission_and_live_workers():
    """A router without workers: UNAVAILABLE, INVALID_ARGUMENT, RESOURCE_EXHAUSTED."""
    ec = tiny_engine_config()
    config = RouterConfig(
        port=0, model=ec.model, max_model_len=256, max_inflight=1, max_queued=0, metrics_port=0
    )
    handle = start_router_in_thread(config)
    address = handle.router.metrics.server.address
    try:
        with Cluster(handle, ec).client(timeout=10) as client:
            for kwargs, code in [
                ({"max_tokens": 4}, grpc.StatusCode.UNAVAILABLE),  # no decode worker
                ({"max_tokens": 10_000}, grpc.StatusCode.INVALID_ARGUMENT),
            ]:
                with pytest.raises(grpc.RpcError) as err:
                    client.collect(token_ids=PROMPT, **kwargs)
                assert err.value.code() == code
            # The client sees a request's status before the router's handler has run its
            # finally (which frees the slot): wait for the slots to empty, then hold the
            # only one (as a running request would): the next request is refused.
            wait_for(lambda: handle.router.admission.inflight == 0, what="slots freed")
            asyncio.run_coroutine_threadsafe(handle.router.admission.acquire(), handle.loop).result(
                5
            )
            with pytest.raises(grpc.RpcError) as err:
                client.collect(token_ids=PROMPT, max_tokens=4)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            held = Scrape(address)
            handle.call(lambda r: r.admission.release())
        s = Scrape(address)
        assert held.value("pagedserve:router_requests_inflight") == 1
        assert s.value("pagedserve:router_requests_inflight") == 0
        assert s.value("pagedserve:router_requests_received_total") == 3
        assert s.value("pagedserve:router_requests_total", code="UNAVAILABLE") == 1
        assert s.value("pagedserve:router_requests_total", code="INVALID_ARGUMENT") == 1
        assert s.value("pagedserve:router_requests_total", code="RESOURCE_EXHAUSTED") == 1
        assert s.value("pagedserve:router_admission_rejections_total") == 1
        assert s.value("pagedserve:router_e2e_request_latency_seconds_count") == 0  # OK only
        assert s.value("pagedserve:router_time_to_first_token_seconds_count") == 0
        assert s.value("pagedserve:router_live_workers", pool="decode") == 0
    finally:
        handle.stop()
    with pytest.raises(urllib.error.URLError):  # the endpoint closed with the router
        scrape_text(address)


def test_engine_that_does_not_answer_reports_engine_up_0():
    snap = WorkerSnapshot(
        engine=None, blocks=None, open_leases=2, expired_leases_total=3, staged_bytes=4096
    )
    metrics = WorkerMetrics(WorkerIdentity("decode", "d9", model_name="m"), lambda: snap)
    samples = parse_samples(generate_latest(metrics.registry).decode())
    labels = frozenset({"model_name": "m", "pool": "decode", "worker": "d9"}.items())
    assert samples[("pagedserve:engine_up", labels)] == 0
    assert samples[("pagedserve:kv_open_leases", labels)] == 2
    assert samples[("pagedserve:kv_leases_expired_total", labels)] == 3
    assert samples[("pagedserve:kv_staged_bytes", labels)] == 4096
    assert not any(name == "pagedserve:num_requests_running" for name, _ in samples)


def test_engine_progress_and_stall():
    """engine_up follows the loop's progress: idle ticks keep it up, a stopped loop not."""
    rt = start_worker(WorkerConfig("s0", "decode", tiny_engine_config(), metrics_port=0))
    try:
        metrics = WorkerMetrics.attach(rt, stall_s=0.5)  # a second exporter, quick to stall
        name = metrics.identity.model_name
        labels = frozenset({"model_name": name, "pool": "decode", "worker": "s0"}.items())

        def read(name: str) -> float:
            return parse_samples(generate_latest(metrics.registry).decode())[(name, labels)]

        wait_for(lambda: metrics.last_tick > 0 and read("pagedserve:engine_tick_age_seconds") < 0.5)
        assert read("pagedserve:engine_up") == 1  # idle: the loop ticks every ~50 ms
        rt.loop.stop()
        wait_for(lambda: read("pagedserve:engine_up") == 0, what="engine_up to drop")
        assert read("pagedserve:engine_tick_age_seconds") >= 0.5
        assert Scrape(rt.metrics.server.address).value("pagedserve:engine_up") == 1  # 60 s
    finally:
        rt.stop(grace=0.2)


def test_router_counters_map_to_series():
    """The router's counters, as its request path names them, become these series."""
    snap = RouterSnapshot(
        counters={
            "requests": 9,
            "prefill_calls": 3,
            "local_prefill_short": 2,
            "local_prefill_cached": 1,
            "local_prefill_fallback": 1,
            "prefix_exports": 2,
            "prefix_export_missing": 1,
            "prefix_export_blocks": 7,
            "index_lookups": 8,
            "index_hits": 5,
            "index_skipped": 1,
            "index_unavailable": 4,
            "prefill_retries": 1,
            "decode_retries": 2,
            # counters other parts of the router added (router/server.py, router/prefix.py)
            "index_busy": 3,
            "registry_malformed": 2,
            "refused_draining": 5,
            "prefill_refused": 4,
            "decode_refused": 6,
            "channels_closed": 1,
        },
        inflight=1,
        queued=0,
        max_inflight=4,
        max_queued=2,
        rejected_total=6,
        live_workers={"prefill": 0, "decode": 2, "colocated": 0},
        index_up=False,
    )
    samples = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in router_families(snap, "m")
        for s in family.samples
    }

    def v(name: str, **labels: str) -> float:
        return samples[
            ("pagedserve:router_" + name, frozenset({**labels, "model_name": "m"}.items()))
        ]

    decisions = {"prefill_decode": 3, "local_prefill_short": 2, "local_prefill_cached": 1}
    decisions |= {"local_prefill_fallback": 1, "cross_worker_pull": 2}
    for kind, n in decisions.items():
        assert v("routing_decisions_total", kind=kind) == n
    assert [v("prefix_exports_total", outcome=o) for o in ("ok", "missing", "failed")] == [2, 1, 0]
    assert v("prefix_export_blocks_total") == 7
    lookups = [v("prefix_index_lookups_total", result=r) for r in ("hit", "miss", "skipped")]
    assert lookups == [5, 3, 1]
    assert v("prefix_index_unavailable_total") == 4 and v("prefix_index_up") == 0
    assert v("retries_total", pool="prefill") == 1 and v("retries_total", pool="decode") == 2
    assert v("admission_rejections_total") == 6 and v("requests_received_total") == 9
    assert v("admission_limit", kind="queued") == 2 and v("requests_inflight") == 1
    assert v("live_workers", pool="decode") == 2 and v("live_workers", pool="prefill") == 0
    assert v("prefix_index_busy_total") == 3 and v("worker_registry_malformed_total") == 2
    assert v("draining_refusals_total") == 5 and v("channels_closed_total") == 1
    assert v("worker_refusals_total", pool="prefill") == 4
    assert v("worker_refusals_total", pool="decode") == 6


def test_bad_metrics_ports_are_refused():
    with pytest.raises(ValueError, match="metrics_port"):
        WorkerConfig("w", "decode", metrics_port=70000)
    with pytest.raises(ConfigError, match="metrics_port"):
        RouterConfig(metrics_port=-1)
    with pytest.raises(ValueError, match="metrics_compat"):
        WorkerConfig("w", "decode", metrics_compat="sglang")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="metrics_compat"):
        RouterConfig(metrics_compat="sglang")  # type: ignore[arg-type]


VLLM_WORKER = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:cache_config_info",
    "vllm:request_queue_time_seconds_count",
    "vllm:request_prefill_time_seconds_count",
    "vllm:request_decode_time_seconds_count",
    "vllm:request_inference_time_seconds_count",
}
VLLM_ROUTER = {
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_count",
    "vllm:time_per_output_token_seconds_count",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:request_prompt_tokens_count",
    "vllm:request_generation_tokens_count",
}


def test_vllm_compat_series_and_grpc_transfer_failures():
    """metrics_compat="vllm" on router and workers: vLLM's names with vLLM's meanings,
    model_name on each; KV over gRPC, then a corrupted chunk counted by cause."""
    ec = tiny_engine_config()
    rc = dataclasses.replace(ROUTER_CONFIG, model=ec.model, metrics_port=0, metrics_compat="vllm")
    c = Cluster(start_router_in_thread(rc), ec)
    try:
        for worker_id, pool in [("p0", "prefill"), ("d0", "decode")]:
            c.add_worker(
                worker_id, pool, metrics_port=0, metrics_compat="vllm", kv_transport="grpc"
            )
        generate(c, PROMPT)
        c.wait_quiescent()
        name = tiny_model_name(c)
        r, p, d = router_scrape(c), worker_scrape(c, "p0"), worker_scrape(c, "d0")
        for s in (r, p, d):
            s.assert_model_name_everywhere(name)
        assert r.names() >= VLLM_ROUTER and p.names() >= VLLM_WORKER and d.names() >= VLLM_WORKER
        # Request-level series once, at the router; per-engine ones at each worker.
        assert not {n for n in p.names() | d.names() if n.startswith("vllm:")} & VLLM_ROUTER
        assert r.value("vllm:prompt_tokens_total") == len(PROMPT)
        assert r.value("vllm:generation_tokens_total") == MAX_TOKENS
        assert r.value("vllm:request_success_total", finished_reason="length") == 1
        assert r.value("vllm:time_to_first_token_seconds_count") == 1
        assert r.value("vllm:e2e_request_latency_seconds_count") == 1
        assert r.value("vllm:request_prompt_tokens_sum") == len(PROMPT)
        assert r.value("vllm:request_generation_tokens_sum") == MAX_TOKENS
        gaps = r.value("pagedserve:router_inter_token_latency_seconds_count")
        assert r.value("vllm:inter_token_latency_seconds_count") == gaps
        assert r.value("vllm:time_per_output_token_seconds_count") == gaps
        assert p.value("vllm:prefix_cache_queries_total") == len(PROMPT)
        assert p.value("vllm:request_prefill_time_seconds_count") == 1
        assert d.value("vllm:request_decode_time_seconds_count") == 1
        assert d.value("vllm:num_requests_running") == 0
        assert d.value("vllm:num_requests_waiting") == 0
        assert d.value("vllm:kv_cache_usage_perc") == 0
        assert d.value("vllm:cache_config_info", block_size="16", num_gpu_blocks="128") == 1
        dw = c.workers["d0"]
        assert d.value("pagedserve:kv_transfer_pulls_total", transport="grpc") == 1
        assert d.value("pagedserve:kv_transfer_bytes_total", transport="grpc") == 3 * block_bytes(
            dw
        )
        # A corrupted chunk: the decode worker recomputes (the client sees no error) and
        # counts a checksum failure.
        previous = install(FaultInjector(FaultSpec(corrupt_chunk=1.0)))
        try:
            generate(c, [t + 100 for t in PROMPT])
        finally:
            install(previous)
        c.wait_quiescent()
        d = worker_scrape(c, "d0")
        assert d.value("pagedserve:kv_transfer_failures_total", cause="checksum") == 1
        assert d.value("pagedserve:kv_transfer_checksum_mismatches_total") == 1
        assert d.value("pagedserve:kv_transfer_pulls_total", transport="grpc") == 1
        assert d.value("pagedserve:kv_transfer_seconds_count", transport="grpc") == 2
        # Recomputed here (the prompt and the imported first token): computed tokens count
        # it; the prompt itself was counted once, by p0, which prefilled it.
        assert d.value("pagedserve:prompt_tokens_computed_total") == len(PROMPT) + 1
        assert d.value("pagedserve:prompt_tokens_total") == 0
        r = router_scrape(c)
        assert r.value("vllm:request_success_total", finished_reason="length") == 2
    finally:
        c.stop()


def test_cli_metrics_compat_flags():
    from pagedserve.router.__main__ import build_parser as router_parser

    assert router_parser().parse_args(["--metrics-compat", "vllm"]).metrics_compat == "vllm"
    assert router_parser().parse_args([]).metrics_compat is None
    args = launch.build_parser().parse_args(["--metrics-compat", "vllm"])
    assert args.metrics_compat == "vllm"
    with pytest.raises(SystemExit):
        launch.build_parser().parse_args(["--metrics-compat", "sglang"])


def test_launcher_metrics_ports_and_placement():
    """`pagedserve up` flags: ports per worker, the router address workers dial."""
    args = launch.build_parser().parse_args(
        ["--prefill", "2", "--decode", "2", "--metrics-port", "9400"]
        + ["--worker-metrics-port", "9401", "--advertise-host", "10.0.0.7"]
    )
    assert (args.metrics_port, args.worker_metrics_port, args.pool_resources) == (9400, 9401, False)
    spec = launch.ClusterSpec(
        num_prefill=2, num_decode=2, worker_metrics_port=9401, worker_port=50060
    )

    def ports(cluster, pool: str, index: int) -> tuple[int, int | None]:
        config = cluster.worker_config(pool, index, "127.0.0.1:1")
        return config.port, config.metrics_port

    c = launch.Cluster(spec)
    # Workers may share a machine: prefill-0, prefill-1, decode-0, decode-1 on 9401..9404
    # (metrics) and 50060..50063 (gRPC).
    got = [ports(c, p, i) for p in ("prefill", "decode") for i in (0, 1)]
    assert got == [(50060 + k, 9401 + k) for k in range(4)]
    # One worker per node (custom resources): the same ports everywhere.
    one_per_node = launch.Cluster(dataclasses.replace(spec, pool_resources=True))
    assert ports(one_per_node, "decode", 1) == (50060, 9401)
    assert ports(launch.Cluster(launch.ClusterSpec()), "decode", 0) == (0, None)  # any free; off
    assert ports(launch.Cluster(launch.ClusterSpec(worker_metrics_port=0)), "decode", 1) == (0, 0)
    assert launch.advertised_address("0.0.0.0:50051", None) == "0.0.0.0:50051"
    assert launch.advertised_address("0.0.0.0:50051", "10.0.0.7") == "10.0.0.7:50051"
