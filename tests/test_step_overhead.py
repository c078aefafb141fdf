"""benchmarks/step_overhead.py runs its three steps and its wrapper timings (a smoke
test of the benchmark, not of any timing)."""

from __future__ import annotations

import torch

from benchmarks import step_overhead


def test_step_overhead_reports_each_step_and_saves_their_logits(tmp_path, capsys):
    out = tmp_path / "logits.pt"
    step_overhead.main(["--iters", "1", "--save", str(out)])
    lines = capsys.readouterr().out.splitlines()
    for name in ("decode b1 @287", "decode b8 @287", "prefill 32 @256"):
        assert any(line.startswith(f"{name}: ") and "ms (min" in line for line in lines)
    logits = torch.load(out)
    assert {k: tuple(v.shape) for k, v in logits.items()} == {
        "decode b1 @287": (1, 512),
        "decode b8 @287": (8, 512),
        "prefill 32 @256": (1, 512),
    }
    assert all(torch.isfinite(v).all() for v in logits.values())
