"""The KV-waste benchmark: the seed example's numbers exactly, and its stream simulator."""

from __future__ import annotations

import json

from benchmarks import kv_waste
from benchmarks.kv_waste import (
    ContiguousBackend,
    PagedBackend,
    Request,
    run_workload1,
    run_workload3,
    sharegpt_stream,
    simulate_stream,
)


def test_workload1_reproduces_the_seed_example():
    w1 = run_workload1()
    c, p = w1["contiguous"], w1["paged"]
    assert (c.served, c.rejected, p.served, p.rejected) == (4, 0, 4, 0)
    assert (c.reserved_slots, c.needed_slots) == (1024, 415)
    assert round(c.waste_pct) == 59
    assert c.free_blocks == 0
    # ceil(52/16) + ceil(20/16) + ceil(135/16) + ceil(208/16) = 4 + 2 + 9 + 13 = 28 blocks
    assert (p.reserved_slots, p.needed_slots) == (448, 415)
    assert round(p.waste_pct) == 7
    assert p.free_blocks == 36


def test_workload1_shared_system_prompt_saves_192_slots():
    w1 = run_workload1()
    off, on = w1["shared_paged_no_cache"], w1["shared_paged_cache"]
    assert w1["shared_saved_slots"] == 192  # 96 tokens = 6 blocks, stored once instead of 3x
    assert off.reserved_slots - on.reserved_slots == 192
    assert on.prefix_hit_tokens == 2 * 96
    assert off.prefill_tokens - on.prefill_tokens == 192
    assert on.needed_slots == off.needed_slots - 192
    assert on.tokens_held == off.tokens_held
    assert w1["shared_contiguous"].reserved_slots == 3 * 256


def test_workload1_does_not_depend_on_the_token_ids():
    a, b = run_workload1(seed=0), run_workload1(seed=7)
    for key in ("contiguous", "paged", "shared_paged_no_cache", "shared_paged_cache"):
        assert a[key].reserved_slots == b[key].reserved_slots


def test_workload3_shares_the_512_token_system_prompt():
    w3 = run_workload3()
    off, on, c = w3["paged_no_cache"], w3["paged_cache"], w3["contiguous"]
    assert on.served == off.served == c.served == 10
    assert on.prefix_hit_tokens == 9 * 512
    assert off.prefix_hit_tokens == 0
    assert off.reserved_slots - on.reserved_slots == 9 * 512
    assert off.prefill_tokens - on.prefill_tokens == 9 * 512
    assert c.reserved_slots == 10 * 2048


def test_paged_stream_trace_with_one_preemption():
    # Pool of 4 blocks x 2 slots. Step 0: A (3 tokens, 2 blocks) and B (2 tokens, 1 block)
    # are admitted; B's first token takes the last block. Step 1: A needs a block, so the
    # latest admitted (B, 1 token generated) is preempted and requeued as prompt 3 / output
    # 3. A finishes at step 2, B is readmitted at step 3 and finishes at step 5.
    requests = [Request("A", 0, 3, 3), Request("B", 0, 2, 4)]
    r = simulate_stream(requests, PagedBackend(pool_slots=8, block_size=2, watermark=0.0))
    assert (r.served, r.rejected, r.preemptions) == (2, 0, 1)
    assert (r.steps, r.makespan, r.peak_concurrent) == (6, 5, 2)
    assert r.sum_running == 3 + 4  # every requested token generated exactly once
    assert r.sum_needed == 7 + 5 + 6 + 4 + 5 + 6
    assert r.sum_reserved == 8 + 6 + 6 + 4 + 6 + 6


def test_contiguous_stream_trace():
    # 8 slots, max_len 6: one reservation at a time, so B waits for A to finish.
    requests = [Request("A", 0, 3, 3), Request("B", 0, 2, 4)]
    r = simulate_stream(requests, ContiguousBackend(pool_slots=8, max_len=6))
    assert (r.served, r.preemptions, r.steps, r.makespan, r.peak_concurrent) == (2, 0, 7, 6, 1)
    assert r.sum_needed == (4 + 5 + 6) + (3 + 4 + 5 + 6)
    assert r.sum_reserved == 7 * 6


def test_stream_conserves_tokens_and_paged_beats_contiguous():
    requests = sharegpt_stream(120, seed=3)
    assert all(r.prompt_len >= 1 and r.prompt_len + r.output_len <= 2048 for r in requests)
    assert requests == sharegpt_stream(120, seed=3)  # seeded
    total_output = sum(r.output_len for r in requests)
    paged = simulate_stream(requests, PagedBackend(kv_waste.POOL_SLOTS, 16))
    contiguous = simulate_stream(requests, ContiguousBackend(kv_waste.POOL_SLOTS, 2048))
    for r in (paged, contiguous):
        assert r.served == 120
        assert r.sum_running == total_output
    assert contiguous.peak_concurrent == 16  # 32768 / 2048
    assert paged.waste_pct < 4.0
    assert paged.peak_concurrent > 2.5 * contiguous.peak_concurrent


def test_main_prints_tables_and_writes_json(tmp_path, capsys):
    path = tmp_path / "kv.json"
    kv_waste.main(["--requests", "40", "--json", str(path)])
    out = capsys.readouterr().out
    assert "Workload 1:" in out and "Workload 2:" in out and "Workload 3:" in out
    assert "prefix caching saves 192 slots (12 blocks)" in out
    data = json.loads(path.read_text())
    assert data["workload1"]["paged"]["reserved_slots"] == 448
    assert data["workload2"]["requests"]["count"] == 40
    assert sorted(data["workload2"]["sweep"]) == ["1", "128", "16", "32", "64", "8"]
