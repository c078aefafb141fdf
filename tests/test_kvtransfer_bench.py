"""benchmarks/kvtransfer.py: the timing helpers, and one real run at the smallest size
(an exporter process, real gRPC on loopback, real /dev/shm segments)."""

from __future__ import annotations

import json

import pytest

from benchmarks import kvtransfer as bench


def test_times_interleaved_runs_the_variants_in_turns():
    calls: list[str] = []
    turns = bench.times_interleaved(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3
    )
    assert calls == ["a", "b"] + ["a", "b"] * 3  # one warm-up each, then turns
    assert {k: len(v) for k, v in turns.seconds.items()} == {"a": 3, "b": 3}
    assert all(t >= 0 for ts in turns.seconds.values() for t in ts)
    assert turns.cpu_seconds == {"a": [], "b": []}  # no clocks given


def test_cpu_clocks_are_read_around_each_turn_and_summed_per_variant():
    ticks = iter(range(100))
    clock_reads: list[str] = []
    current = ["warm-up"]

    def clock() -> float:
        clock_reads.append(current[0])
        return float(next(ticks))

    def variant(name: str):
        return lambda: current.__setitem__(0, name)

    turns = bench.times_interleaved({"a": variant("a"), "b": variant("b")}, 2, (clock,))
    # Each turn: one read before it, one after; the clock ticks by 1 per read, so
    # every turn costs 1 "CPU second" on it, summed over 2 turns per variant.
    assert turns.cpu_seconds == {"a": [2.0], "b": [2.0]}
    assert len(clock_reads) == 8  # not read around the warm-ups


def test_paired_ratio_is_the_median_of_per_turn_ratios():
    baseline = [1.0, 2.0, 3.0]
    measured = [2.0, 2.0, 1.0]  # turn ratios 0.5, 1.0, 3.0
    assert bench.paired_ratio(baseline, measured) == 1.0
    with pytest.raises(ValueError):  # turns must pair up
        bench.paired_ratio([1.0], [1.0, 2.0])


def test_one_run_end_to_end(tmp_path, capsys):
    out = tmp_path / "kv.json"
    assert bench.main(["--tokens", "16", "--repeats", "1", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["tokens"], row["blocks"]) == (16, 1)
    assert row["bytes"] == 30 * 2 * 16 * 3 * 64 * 2  # one block of the default layout
    assert row["grpc_vs_raw"] > 0 and row["grpc_vs_raw_paired"] > 0
    cpu = [
        row[f"{k}_cpu_{side}_us_per_mib"]
        for k in ("grpc", "raw")
        for side in ("puller", "exporter")
    ]
    assert all(us > 0 for us in cpu)  # every stream costs both processes some CPU
    assert row["grpc_vs_raw_cpu"] == pytest.approx((cpu[2] + cpu[3]) / (cpu[0] + cpu[1]))
    # the pull of an in-place lease (a default worker's exports) is measured beside it
    ip = [row[f"grpc_inplace_cpu_{side}_us_per_mib"] for side in ("puller", "exporter")]
    assert all(us > 0 for us in ip) and row["grpc_inplace_vs_raw_paired"] > 0
    assert row["grpc_inplace_vs_raw_cpu"] == pytest.approx((cpu[2] + cpu[3]) / sum(ip))
    printed = capsys.readouterr().out
    assert "paired" in printed and "cpu raw/grpc" in printed and "cpu raw/ip" in printed
