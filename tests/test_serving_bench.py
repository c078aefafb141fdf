"""benchmarks/serving.py: its metric definitions on synthetic timestamps (vllm bench
serve's), its seeded workload, and its load generator through a real router with
in-process workers on a tiny checkpoint (both configurations, a handful of requests)."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
from router_fixtures import MAX_MODEL_LEN, ROUTER_CONFIG, engine_held, start_cluster

from benchmarks.serving import (
    SLO,
    Arrival,
    Phase,
    PhaseRun,
    RequestRecord,
    RequestSpec,
    WorkloadConfig,
    build_phases,
    compare,
    isolation_ratio,
    itl_by_overlap,
    measure_config,
    phase_metrics,
    poisson_arrivals,
    random_prompt,
    run_phase,
    serving_configs,
    sharegpt_like,
    summarize,
)

# -- metrics on synthetic timestamps --------------------------------------------------------


def synthetic_records() -> list[RequestRecord]:
    return [
        # 4 chunks of one token: TTFT 0.5, E2E 1.0, ITL 0.125/0.25/0.125, TPOT 0.5/3
        RequestRecord(
            "short", 10, 4, start=0.0, chunk_times=[0.5, 0.625, 0.875, 1.0], output_tokens=4
        ),
        # 2 chunks carrying 3 tokens (coalesced): TTFT 0.25, E2E 0.75, ITL 0.5, TPOT 0.5/2
        RequestRecord("short", 20, 3, start=1.0, chunk_times=[1.25, 1.75], output_tokens=3),
        # 1 token: TTFT = E2E = 0.375, no ITL, no TPOT (0 for goodput)
        RequestRecord("long", 30, 1, start=2.0, chunk_times=[2.375], output_tokens=1),
        # failed after streaming and never sent: neither counts anywhere but `failed`
        RequestRecord(
            "short", 40, 4, start=3.0, chunk_times=[3.5], output_tokens=1, error="CANCELLED: x"
        ),
        RequestRecord("short", 50, 4, error="not sent"),
    ]


def test_per_request_definitions():
    r1, r2, r3, *_ = synthetic_records()
    assert (r1.ttft, r1.latency, r1.itl, r1.tpot) == (0.5, 1.0, [0.125, 0.25, 0.125], 0.5 / 3)
    assert (r2.ttft, r2.latency, r2.itl, r2.tpot) == (0.25, 0.75, [0.5], 0.25)
    assert (r3.ttft, r3.latency, r3.itl, r3.tpot) == (0.375, 0.375, [], None)


def test_summary_matches_vllm_definitions():
    m = summarize(synthetic_records(), duration_s=4.0, slo=SLO())
    assert (m.completed, m.failed, m.total_input, m.total_output) == (3, 2, 60, 8)
    assert (m.request_throughput, m.output_throughput, m.total_token_throughput) == (
        0.75,
        2.0,
        17.0,
    )
    assert m.good_requests is None and m.goodput is None
    # ms; percentiles interpolate linearly between order statistics (numpy's default)
    assert m.ttft.n == 3 and m.ttft.mean == pytest.approx(375.0)
    assert (m.ttft.p50, m.ttft.p99) == (375.0, pytest.approx(375.0 + 0.98 * 125.0))
    assert m.tpot.n == 2  # the single-token request has no TPOT
    assert m.tpot.mean == pytest.approx((500.0 / 3 + 250.0) / 2)
    assert m.tpot.p99 == pytest.approx(500.0 / 3 + 0.99 * (250.0 - 500.0 / 3))
    assert m.itl.n == 4  # every gap of every successful request, pooled
    assert (m.itl.mean, m.itl.p50) == (250.0, 187.5)
    assert m.itl.p99 == pytest.approx(250.0 + 0.97 * 250.0)
    assert (m.itl.max, m.ttft.max, m.e2e.max) == (500.0, 500.0, 1000.0)
    assert (m.e2e.mean, m.e2e.p50) == (pytest.approx(2125.0 / 3), 750.0)


def test_goodput_counts_requests_meeting_every_slo():
    recs = synthetic_records()
    # TTFT <= 375 ms: r2 (250) and r3 (375, the bound itself counts) but not r1 (500)
    m = summarize(recs, 4.0, SLO(ttft_ms=375.0))
    assert (m.good_requests, m.goodput) == (2, 0.5)
    # + TPOT <= 200 ms: r2's 250 fails; r3 has one token (TPOT 0) and passes
    m = summarize(recs, 4.0, SLO(ttft_ms=375.0, tpot_ms=200.0))
    assert (m.good_requests, m.goodput) == (1, 0.25)
    # E2E <= 750 ms: r2 (750) and r3 (375)
    assert summarize(recs, 4.0, SLO(e2e_ms=750.0)).good_requests == 2
    assert summarize(recs, 4.0, SLO(tpot_ms=1000.0)).good_requests == 3


def test_nothing_completed_and_bad_duration():
    m = summarize([RequestRecord("short", 5, 4, error="x")], 1.0, SLO(ttft_ms=1.0))
    assert (m.completed, m.failed, m.good_requests) == (0, 1, 0)
    assert m.ttft is m.tpot is m.itl is m.e2e is None
    with pytest.raises(ValueError, match="duration"):
        summarize([], 0.0, SLO())


def test_isolation_ratio_and_comparison():
    def run(name: str, gap: float, long_gap: float | None) -> PhaseRun:
        recs = [
            RequestRecord(
                "short",
                4,
                3,
                start=0.0,
                chunk_times=[0.5, 0.5 + gap, 0.5 + 2 * gap],
                output_tokens=3,
            )
        ]
        if long_gap is not None:  # one stalled gap in a second short request
            recs.append(
                RequestRecord(
                    "short", 4, 2, start=0.0, chunk_times=[0.5, 0.5 + long_gap], output_tokens=2
                )
            )
            recs.append(
                RequestRecord("long", 64, 2, start=0.0, chunk_times=[3.0, 3.5], output_tokens=2)
            )
        return PhaseRun(name, recs, 4.0, 0.0)

    colo = phase_metrics(
        {"decode": run("decode", 0.25, None), "interference": run("interference", 0.25, 2.0)}, SLO()
    )
    dis = phase_metrics(
        {"decode": run("decode", 0.5, None), "interference": run("interference", 0.5, 0.5)}, SLO()
    )
    # the interference phase's decode stream alone excludes the long request's own gap
    assert colo["interference/short"].itl.n == 3 and colo["interference"].itl.n == 4
    p99 = float(np.percentile([250.0, 250.0, 2000.0], 99))
    assert isolation_ratio(colo) == pytest.approx(p99 / 250.0)
    assert isolation_ratio(dis) == 1.0
    cmp = compare({"colocated": colo, "disaggregated": dis})
    assert cmp["isolation_p99_itl"] == {
        "colocated": pytest.approx(p99 / 250.0),
        "disaggregated": 1.0,
    }
    row = cmp["disaggregated_over_colocated"]["decode-stream ITL p99, interference"]
    assert row == {
        "colocated": pytest.approx(p99),
        "disaggregated": 500.0,
        "ratio": pytest.approx(500.0 / p99),
    }
    assert (
        cmp["disaggregated_over_colocated"]["sharegpt TTFT p99"]["ratio"] is None
    )  # no such phase


def test_itl_split_by_what_long_prompts_were_doing():
    recs = [
        # a long prompt: prefilling over (1.0, 2.0), decoding over (2.0, 2.5)
        RequestRecord("long", 64, 2, start=1.0, chunk_times=[2.0, 2.5], output_tokens=2),
        RequestRecord("long", 64, 2, start=0.0, error="CANCELLED: ignored"),
        # gaps: 0.25 clear, 0.75 and 0.625 overlap the prefill, 0.875 the decode
        RequestRecord(
            "short", 4, 5, start=0.0, chunk_times=[0.5, 0.75, 1.5, 2.125, 3.0], output_tokens=5
        ),
    ]
    split = itl_by_overlap(PhaseRun("interference", recs, 4.0, 0.0))
    pre, dec, clear = (
        split[c] for c in ("during a long prefill", "during a long decode", "clear of long prompts")
    )
    assert (pre.n, pre.mean, pre.max) == (2, 687.5, 750.0)
    assert (dec.n, dec.max, clear.n, clear.max) == (1, 875.0, 1, 250.0)
    no_long = itl_by_overlap(PhaseRun("decode", recs[2:], 4.0, 0.0))
    assert [None if st is None else st.n for st in no_long.values()] == [None, None, 4]


# -- workload -----------------------------------------------------------------------------

ALL_PHASES = ("sharegpt", "decode", "interference")


def test_workload_is_seeded_and_interference_adds_periodic_long_prompts():
    cfg = WorkloadConfig(seed=3, num_short=20, short_rate=2.0, long_every_s=2.0)
    a = build_phases(cfg, vocab_size=1000, max_len=1024, names=ALL_PHASES)
    assert a == build_phases(cfg, 1000, 1024, ALL_PHASES)
    assert a != build_phases(dataclasses.replace(cfg, seed=4), 1000, 1024, ALL_PHASES)
    share, decode, interf = a
    assert len(share.arrivals) == cfg.num_prompts and len(decode.arrivals) == 20
    assert all(a.spec.kind == "short" and a.gated for a in decode.arrivals)
    assert all(
        len(a.spec.prompt_token_ids) == 16 and a.spec.max_tokens == 32 for a in decode.arrivals
    )
    # the same stream, plus long prompts at (k + 1/2) periods while it is being sent
    assert [x for x in interf.arrivals if x.spec.kind == "short"] == list(decode.arrivals)
    longs = [x for x in interf.arrivals if x.spec.kind == "long"]
    span = decode.arrivals[-1].at_s
    assert [x.at_s for x in longs] == [2.0 * (k + 0.5) for k in range(len(longs))]
    assert longs[-1].at_s <= span < longs[-1].at_s + 2.0 and not any(x.gated for x in longs)
    assert all(
        len(x.spec.prompt_token_ids) == cfg.long_prompt_len and x.spec.max_tokens == 4
        for x in longs
    )
    assert [x.at_s for x in interf.arrivals] == sorted(x.at_s for x in interf.arrivals)
    ids = {t for p in a for x in p.arrivals for t in x.spec.prompt_token_ids}
    assert min(ids) >= 100 and max(ids) < 1000  # above the special tokens, within the vocab


def test_sharegpt_lengths_heavy_tailed_and_scaled():
    full = sharegpt_like(4000, 1.0, 50_000, 4096, random.Random(0))
    inputs = np.array([len(s.prompt_token_ids) for s in full])
    outputs = np.array([s.max_tokens for s in full])
    # means near the paper's 161 / 338 (the clip at 1024 trims the tail a little)
    assert 140 < inputs.mean() < 175 and 300 < outputs.mean() < 345
    assert np.median(inputs) < inputs.mean() and inputs.max() == 1024  # right-skewed
    assert inputs.min() >= 4 and outputs.min() >= 4
    small = sharegpt_like(4000, 0.1, 50_000, 4096, random.Random(0))
    assert 12 < np.mean([len(s.prompt_token_ids) for s in small]) < 18
    assert all(len(s.prompt_token_ids) >= 4 and s.max_tokens >= 2 for s in small)
    capped = sharegpt_like(200, 1.0, 50_000, 300, random.Random(1))
    assert all(len(s.prompt_token_ids) + s.max_tokens <= 300 for s in capped)


def test_poisson_arrivals():
    t = poisson_arrivals(5000, 4.0, random.Random(0))
    gaps = np.diff(t)
    assert t[0] == 0.0 and (gaps > 0).all() and 0.24 < gaps.mean() < 0.26
    assert poisson_arrivals(3, None, random.Random(0)) == [0.0, 0.0, 0.0]


def test_bad_workload_input():
    with pytest.raises(ValueError, match="request rate"):
        poisson_arrivals(3, 0.0, random.Random(0))
    with pytest.raises(ValueError, match="length scale"):
        sharegpt_like(3, 0.0, 1000, 512, random.Random(0))
    with pytest.raises(ValueError, match="long prompt"):
        build_phases(WorkloadConfig(long_prompt_len=600), 1000, 512, ALL_PHASES)
    with pytest.raises(ValueError, match="unknown phase"):
        build_phases(WorkloadConfig(), 1000, 1024, ["decode", "prefill"])
    with pytest.raises(ValueError, match="short_output_len"):
        WorkloadConfig(short_output_len=1)
    with pytest.raises(ValueError, match="prefill"):
        serving_configs(0, 1)


# -- the load generator through a real router ----------------------------------------------

TINY_WORKLOAD = WorkloadConfig(
    seed=1,
    num_prompts=4,
    request_rate=None,  # all at once, gated by the concurrency cap
    length_scale=0.05,
    num_short=4,
    short_rate=None,
    short_prompt_len=8,
    short_output_len=6,
    long_prompt_len=64,
    long_output_len=2,
    long_every_s=0.2,
)
CONCURRENCY = 2
CAP_S = 1.0


@pytest.mark.parametrize("config", serving_configs(1, 1), ids=lambda c: c.name)
def test_benchmark_core_through_router(config):
    pools = {"prefill": config.num_prefill, "decode": config.num_decode}
    router_config = dataclasses.replace(
        ROUTER_CONFIG, disagg_min_prompt_tokens=config.disagg_min_prompt_tokens
    )
    cluster = start_cluster(router_config, {p: n for p, n in pools.items() if n})
    try:
        info = cluster.client().model_info()
        phases = build_phases(TINY_WORKLOAD, info.vocab_size, MAX_MODEL_LEN, ALL_PHASES)
        runs = measure_config(cluster.address, phases, concurrency=CONCURRENCY, timeout_s=60.0)
        sent = sum(len(p.arrivals) for p in phases)
        counters = cluster.router.call(lambda r: dict(r.counters))
        # Held after 8 decode steps (tokens streamed), it is running when the cap comes,
        # on any machine; CAP_S only has to outlast its way there (milliseconds).
        with engine_held(cluster.pool("decode"), after_steps=8) as held:
            capped = run_phase(cluster.address, too_long_phase(info.vocab_size), timeout_s=CAP_S)
            held.wait(0)
        cluster.wait_quiescent()  # the cancelled request's blocks (and leases) came back
    finally:
        cluster.stop()
    assert list(runs) == list(ALL_PHASES)
    for phase in phases:
        check_run(phase, runs[phase.name])
    # colocated: every prompt prefilled where it decodes; disaggregated: none
    assert counters["requests"] == sent
    assert counters.get("prefill_calls", 0) == (sent if config.num_prefill else 0)
    metrics = phase_metrics(runs, SLO(ttft_ms=60_000.0, tpot_ms=60_000.0))
    assert set(metrics) == {*ALL_PHASES, "interference/short"}
    assert metrics["interference/short"].completed == TINY_WORKLOAD.num_short
    assert metrics["interference"].completed == TINY_WORKLOAD.num_short + 1  # one long prompt
    assert all(m.failed == 0 and m.good_requests == m.completed for m in metrics.values())
    assert isolation_ratio(metrics) is not None
    # the time cap: the running request is cancelled, the later one never sent
    assert [r.success for r in capped.records] == [False, False]
    assert capped.records[0].start is not None and capped.records[1].start is None
    assert capped.records[0].chunk_times  # it was streaming when the cap came
    assert capped.records[1].error == "not sent: the phase's time cap came first"


def too_long_phase(vocab_size: int) -> Phase:
    """A request held before its end (engine_held), then one sent only after 30 s."""
    rng = random.Random(7)
    spec = RequestSpec("short", random_prompt(8, vocab_size, rng), MAX_MODEL_LEN - 8)
    return Phase("capped", (Arrival(0.0, spec), Arrival(30.0, spec)))


def check_run(phase: Phase, run: PhaseRun) -> None:
    assert len(run.records) == len(phase.arrivals)
    for a, r in zip(phase.arrivals, run.records, strict=True):
        assert r.success, r.error
        assert (r.kind, r.prompt_len, r.max_tokens) == (
            a.spec.kind,
            len(a.spec.prompt_token_ids),
            a.spec.max_tokens,
        )
        assert r.output_tokens == a.spec.max_tokens  # ignore_eos: exactly max_tokens
        assert r.start <= r.chunk_times[0] and r.chunk_times == sorted(r.chunk_times)
        assert len(r.itl) == len(r.chunk_times) - 1
    # the cap: a gated request starts only after another one's last chunk freed a slot
    gated = [
        (r.start, r.chunk_times[-1])
        for a, r in zip(phase.arrivals, run.records, strict=True)
        if a.gated
    ]
    for start, _ in gated:
        assert sum(1 for s, e in gated if s <= start < e) <= CONCURRENCY
