"""The fp32 GEMM backend chosen per weight shape at load (common/core/fp32_gemm.py).

The choice itself is tested on injected times (no clock is read, no test asserts a
wall-clock time); the real measurement runs on the tiny random checkpoints, and greedy
tokens match transformers in fp32 with every backend, forced or chosen.
"""

from __future__ import annotations

import logging

import pytest
import torch
from builders import (
    PagedSession,
    hf_greedy,
    load_hf,
    one_torch_thread,  # noqa: F401 (autouse fixture)
    tiny_checkpoint,
)

from pagedserve.common.api.limits import ConfigError
from pagedserve.common.core import fp32_gemm, mkl_pack
from pagedserve.common.core.config import EngineConfig
from pagedserve.common.core.loader import load_model

NEW_TOKENS = 24
ROLES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")


def _times(**per_backend: tuple[float, ...]) -> dict[str, dict[int, float]]:
    """backend=(seconds at 16, 64, 256 rows) -> the Times table."""
    return {b: dict(zip((16, 64, 256), ts, strict=True)) for b, ts in per_backend.items()}


# ---- the choice, on given times -------------------------------------------------------


def test_the_faster_backend_wins_by_its_geometric_mean_over_row_counts():
    # oneDNN twice as fast everywhere (the AMD EPYC case)
    assert fp32_gemm.pick(_times(mkl=(2.0, 4.0, 8.0), onednn=(1.0, 2.0, 4.0))) == "onednn"
    # MKL 20 % faster everywhere (the Skylake Xeon case): beyond the tie band
    assert fp32_gemm.pick(_times(mkl=(1.0, 2.0, 4.0), onednn=(1.2, 2.4, 4.8))) == "mkl"
    # each wins somewhere: ratios 1.5, 1, 1 vs 1, 1.1, 1.1 -> geomeans 1.145 vs 1.066
    t = _times(mkl=(1.5, 1.0, 1.0), onednn=(1.0, 1.1, 1.1))
    s = fp32_gemm.scores(t)
    assert s["mkl"] == pytest.approx(1.5 ** (1 / 3))
    assert s["onednn"] == pytest.approx(1.1 ** (2 / 3))
    assert fp32_gemm.pick(t) == "onednn"


def test_close_calls_go_to_the_preferred_backend_whichever_measured_faster():
    """Within TIE (5 %) the order of PREFERENCE decides: plain, then oneDNN, then MKL,
    so a near-tie does not flap between loads."""
    assert fp32_gemm.PREFERENCE == ("plain", "onednn", "mkl")
    for mkl in (0.96, 1.0, 1.04):  # MKL a little faster, equal, a little slower
        assert fp32_gemm.pick(_times(mkl=(mkl,) * 3, onednn=(1.0,) * 3)) == "onednn"
    assert fp32_gemm.pick(_times(mkl=(0.94,) * 3, onednn=(1.0,) * 3)) == "mkl"
    assert fp32_gemm.pick(_times(mkl=(1.0,) * 3, onednn=(1.0,) * 3, plain=(1.03,) * 3)) == "plain"
    assert fp32_gemm.pick(_times(mkl=(1.0,) * 3, onednn=(1.1,) * 3, plain=(1.2,) * 3)) == "mkl"


def test_choose_measures_each_role_at_its_row_counts_and_logs_one_line(caplog):
    w = {n: torch.zeros(8, 4 + i) for i, n in enumerate(ROLES)}
    roles = {
        n: (w[n], fp32_gemm.HEAD_ROWS if n == "lm_head" else fp32_gemm.LAYER_ROWS) for n in ROLES
    }
    calls = []

    def measure(weight, rows, backends):
        calls.append((tuple(weight.shape), tuple(rows), tuple(backends)))
        fast = "mkl" if weight.shape[1] == 6 else "onednn"  # gate_up_proj: MKL
        return {b: {r: (1.0 if b == fast else 2.0) for r in rows} for b in backends}

    with caplog.at_level(logging.INFO, logger=fp32_gemm.__name__):
        got = fp32_gemm.choose(roles, backends=("mkl", "onednn"), measure=measure)
    assert {r: c.backend for r, c in got.items()} == {
        "qkv_proj": "onednn",
        "o_proj": "onednn",
        "gate_up_proj": "mkl",
        "down_proj": "onednn",
        "lm_head": "onednn",
    }
    assert calls == [
        ((8, 4), (16, 64, 256), ("mkl", "onednn")),
        ((8, 5), (16, 64, 256), ("mkl", "onednn")),
        ((8, 6), (16, 64, 256), ("mkl", "onednn")),
        ((8, 7), (16, 64, 256), ("mkl", "onednn")),
        ((8, 8), (16, 64), ("mkl", "onednn")),
    ]
    lines = [r.getMessage() for r in caplog.records if r.name == fp32_gemm.__name__]
    assert len(lines) == 1
    assert (
        "gate_up_proj 8x6 mkl (ms at 16/64/256 rows: mkl 1e+03/1e+03/1e+03, onednn 2e+03"
        in lines[0]
    )
    assert "lm_head 8x8 onednn (ms at 16/64 rows:" in lines[0]


def test_timing_takes_turns_and_keeps_each_backends_best(monkeypatch):
    """A fake clock (one tick per read) and fake backends: every backend runs the same
    number of rounds (MIN_ROUNDS once the cell's budget is spent), first in turn."""
    order: list[str] = []
    monkeypatch.setattr(fp32_gemm, "pack", lambda w, b: b)
    monkeypatch.setattr(fp32_gemm, "_runner", lambda w, b: lambda x: order.append(b))
    ticks = iter(range(10**6))
    monkeypatch.setattr(fp32_gemm, "CELL_BUDGET_S", 0.5)
    t = fp32_gemm.time_backends(torch.zeros(4, 3), (2,), ("a", "b"), clock=lambda: next(ticks))
    warm, timed = order[:2], order[2:]
    assert warm == ["a", "b"]
    assert timed == ["a", "b", "b", "a", "a", "b"][: 2 * fp32_gemm.MIN_ROUNDS]
    assert t == {"a": {2: 1}, "b": {2: 1}}


# ---- overrides ------------------------------------------------------------------------


def test_mode_from_the_argument_else_the_environment_else_auto(monkeypatch):
    monkeypatch.delenv(fp32_gemm.MODE_ENV, raising=False)
    assert fp32_gemm.resolve_mode(None) == "auto"
    monkeypatch.setenv(fp32_gemm.MODE_ENV, "plain")
    assert fp32_gemm.resolve_mode(None) == "plain"
    assert fp32_gemm.resolve_mode("onednn") == "onednn"
    with pytest.raises(ValueError, match="fp32 GEMM must be one of"):
        fp32_gemm.resolve_mode("fast")
    with pytest.raises(ConfigError, match="fp32_gemm must be"):
        EngineConfig(dtype="float32", fp32_gemm="fast")  # type: ignore[arg-type]


def test_mkl_pack_off_leaves_mkl_out_of_the_choice_and_refuses_forcing_it(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_MKL_PACK", "0")
    assert "mkl" not in fp32_gemm.available_backends()
    assert "mkl" not in fp32_gemm.auto_candidates()
    assert fp32_gemm.auto_candidates() == (
        ("onednn",) if fp32_gemm.onednn_available() else ("plain",)
    )
    with pytest.raises(ValueError, match="'mkl' is not available here"):
        fp32_gemm.forced({"o_proj": (torch.zeros(4, 4), (16,))}, "mkl")


def test_a_single_candidate_is_taken_without_timing():
    def measure(w, rows, backends):
        raise AssertionError("nothing to compare")

    got = fp32_gemm.choose({"o_proj": (torch.zeros(4, 4), (16,))}, ("plain",), measure)
    assert got["o_proj"].backend == "plain" and got["o_proj"].times == {}


# ---- in the model ---------------------------------------------------------------------


def _packed_kind(p) -> str:
    return "plain" if p is None else "mkl" if type(p) is mkl_pack.PackedMatrix else "onednn"


def _assert_model_uses(model, backends: dict[str, str]) -> None:
    assert {r: c.backend for r, c in model.gemm_choices.items()} == backends
    for layer in model.layers:
        for m in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            assert _packed_kind(layer.packed.get(m)) == backends[m], m
    assert _packed_kind(model.lm_head_packed) == backends["lm_head"]


def _greedy_matches_transformers(model, path) -> None:
    hf = load_hf(path)
    prompts = {"a": [3 + i * 7 % 300 for i in range(5)], "b": [5 + i * 11 % 300 for i in range(19)]}
    sess = PagedSession(model, num_blocks=32, block_size=8, seed=1)
    for name, p in prompts.items():
        sess.add(name, p)
    sess.greedy(list(prompts), NEW_TOKENS)
    for name, p in prompts.items():
        assert sess.seqs[name].tokens[len(p) :] == hf_greedy(hf, p, NEW_TOKENS), name


@pytest.mark.parametrize("backend", fp32_gemm.available_backends())
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_each_forced_backend_gives_transformers_greedy_tokens(arch, backend):
    path = tiny_checkpoint(arch)
    model = load_model(str(path), dtype=torch.float32, fp32_gemm=backend).model
    _assert_model_uses(model, dict.fromkeys(ROLES, backend))
    _greedy_matches_transformers(model, path)


def test_auto_packs_each_role_as_the_measurement_says(monkeypatch):
    """The model asks for a measurement per role, with layer 0's weights at LAYER_ROWS
    and the LM head at HEAD_ROWS, and packs every layer as chosen (injected times: MKL
    faster for the LM head, oneDNN for the layers' matrices)."""
    if not mkl_pack.available():
        pytest.skip("this torch has no MKL packed GEMM")
    monkeypatch.setattr(fp32_gemm, "_measured", {})
    monkeypatch.setattr(fp32_gemm, "auto_candidates", lambda: ("mkl", "onednn"))
    calls = []

    def fake(w, rows, backends):
        calls.append((tuple(w.shape), tuple(rows)))
        fast = "mkl" if tuple(rows) == fp32_gemm.HEAD_ROWS else "onednn"
        return {b: {r: (1.0 if b == fast else 3.0) for r in rows} for b in backends}

    monkeypatch.setattr(fp32_gemm, "time_backends", fake)
    path = tiny_checkpoint("llama")
    model = load_model(str(path), dtype=torch.float32, fp32_gemm="auto").model
    layer = model.layers[0]
    assert calls == [
        (tuple(layer.qkv_proj.shape), fp32_gemm.LAYER_ROWS),
        (tuple(layer.o_proj.shape), fp32_gemm.LAYER_ROWS),
        (tuple(layer.gate_up_proj.shape), fp32_gemm.LAYER_ROWS),
        (tuple(layer.down_proj.shape), fp32_gemm.LAYER_ROWS),
        (tuple(model.lm_head.shape), fp32_gemm.HEAD_ROWS),
    ]
    _assert_model_uses(model, {**dict.fromkeys(ROLES, "onednn"), "lm_head": "mkl"})
    _greedy_matches_transformers(model, path)


def test_auto_measures_for_real_on_a_tiny_model_and_keeps_transformers_tokens(monkeypatch):
    monkeypatch.setattr(fp32_gemm, "_measured", {})
    monkeypatch.delenv(fp32_gemm.MODE_ENV, raising=False)
    path = tiny_checkpoint("qwen3")
    model = load_model(str(path), dtype=torch.float32).model
    assert model.fp32_gemm_mode == "auto"
    chosen = {r: c.backend for r, c in model.gemm_choices.items()}
    assert set(chosen) == set(ROLES)
    assert set(chosen.values()) <= set(fp32_gemm.auto_candidates())
    for c in model.gemm_choices.values():
        if len(fp32_gemm.auto_candidates()) > 1:
            assert set(c.times) == set(fp32_gemm.auto_candidates())
            assert all(t > 0 for ts in c.times.values() for t in ts.values())
    _assert_model_uses(model, chosen)
    _greedy_matches_transformers(model, path)
    # a second load in the process takes the cached measurement: the same choice
    again = load_model(str(path), dtype=torch.float32).model
    assert {r: c.backend for r, c in again.gemm_choices.items()} == chosen


def test_prepack_off_by_environment_keeps_plain_matmuls(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_PREPACK", "0")
    model = load_model(str(tiny_checkpoint("llama")), dtype=torch.float32, fp32_gemm="mkl").model
    assert model.gemm_choices == {}
    assert all(layer.packed == {} for layer in model.layers) and model.lm_head_packed is None
