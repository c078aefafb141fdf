"""benchmarks/kvtransfer.py: the timing helpers, and one real run at the smallest size
(an exporter process, real gRPC on loopback, real /dev/shm segments)."""

from __future__ import annotations

import json

import pytest

from benchmarks import kvtransfer as bench


def test_times_interleaved_runs_the_variants_in_turns():
    calls: list[str] = []
    times = bench.times_interleaved(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3
    )
    assert calls == ["a", "b"] + ["a", "b"] * 3  # one warm-up each, then turns
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3}
    assert all(t >= 0 for ts in times.values() for t in ts)


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
    assert "paired" in capsys.readouterr().out
