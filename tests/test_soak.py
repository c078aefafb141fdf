"""The soak benchmark's short version: a bounded count of requests, asserted by counts.

A router with deliberately small admission limits (so the load is above capacity)
over 1 prefill + 2 decode in-process workers on the tiny checkpoint; 10 client threads
send 80 seeded requests: greedy ones checked token for token against the engine
alone, sampled ones, ones the client cancels mid-stream, ones with short deadlines,
and bad ones. Every outcome must be clean, every greedy output correct, and every pool
free-or-cached with no lease open afterwards. (benchmarks/soak.py runs the same for
minutes on Ray worker processes and reports resident memory too.)
"""

from __future__ import annotations

import dataclasses
import os

import pytest
from builders import tiny_checkpoint
from router_fixtures import MAX_MODEL_LEN, ROUTER_CONFIG, start_cluster

from benchmarks.soak import CLEAN, WorkerProbe, inspect_workers, read_rss, report, run_soak
from pagedserve.common.api.sampling_params import SamplingParams
from pagedserve.common.core.llm import LLM

pytestmark = pytest.mark.slow

NUM_REQUESTS = 80
CONCURRENCY = 10


@pytest.fixture(scope="module")
def small_cluster():
    config = dataclasses.replace(ROUTER_CONFIG, max_inflight=6, max_queued=3)
    c = start_cluster(config, {"prefill": 1, "decode": 2})
    yield c
    c.stop()


@pytest.fixture(scope="module")
def reference():
    llm = LLM(str(tiny_checkpoint("llama")), dtype="float32", num_blocks=64, max_model_len=256)

    def greedy(requests):
        prompts = [list(p) for p, _ in requests]
        params = [SamplingParams(**sampling) for _, sampling in requests]
        return [o.completions[0].token_ids for o in llm.generate(prompts, params)]

    return greedy


def probes(cluster) -> list[WorkerProbe]:
    return [
        WorkerProbe(
            name,
            0,
            kv_in_use=lambda w=w: w.loop.call(lambda e: e.block_manager.usage()),
            open_leases=lambda w=w: w.kv_source.open_leases,
            check_integrity=w.check_integrity,
        )
        for name, w in cluster.workers.items()
    ]


def test_soak_above_capacity_loses_nothing(small_cluster, reference):
    vocab = small_cluster.client().model_info().vocab_size
    result = run_soak(
        small_cluster.address,
        vocab_size=vocab,
        max_model_len=MAX_MODEL_LEN,
        concurrency=CONCURRENCY,
        num_requests=NUM_REQUESTS,
        seed=7,
        reference=reference,
    )
    inspect_workers(result, probes(small_cluster))
    rss = read_rss({"test process": os.getpid()})
    assert rss["test process"] > 0
    text = report(result, {k: 1 for k in result.by_kind})
    assert result.sent == NUM_REQUESTS
    assert sum(result.outcomes.values()) == NUM_REQUESTS, text
    assert result.num_unclean == 0, text
    assert set(result.outcomes) <= CLEAN, text
    # Every kind was exercised, and each kind ended the way it should.
    assert result.by_kind["greedy"]["completed"] > 0, text
    assert result.by_kind["sampled"]["completed"] > 0, text
    assert result.by_kind["cancelled"]["cancelled"] > 0, text
    bad = result.by_kind["bad"]
    assert sum(bad.values()) > 0 and bad["invalid_argument_expected"] + bad[
        "resource_exhausted"
    ] == sum(bad.values()), text
    assert result.outcomes["resource_exhausted"] > 0, "the load never exceeded admission"
    assert not result.leaked and not result.open_leases and not result.integrity_errors, text


def test_soak_result_as_json():
    import json
    from collections import Counter

    from benchmarks.soak import SoakResult, to_json

    r = SoakResult(sent=3, by_kind={"greedy": Counter(completed=2), "bad": Counter()})
    r.outcomes.update(completed=2, cancelled_wrongly=1)
    r.rss_start_mib, r.rss_end_mib = {"w": 100.0}, {"w": 105.0}
    data = json.loads(json.dumps(to_json(r)))
    assert data["outcomes"] == {"completed": 2, "cancelled_wrongly": 1}
    assert data["by_kind"] == {"greedy": {"completed": 2}, "bad": {}}
    assert data["num_unclean"] == 1 and data["rss_growth"] == {"w": 1.05}
