"""benchmarks/engine_throughput.py: the vLLM-CPU launch (bound cores, preloads, env),
the per-dtype comparison table, and a failed vLLM run reported with its output tail
while pagedserve's rows (start-up included) still print, on a tiny checkpoint.

vLLM itself is not installed in the test venv (it needs its own): the failure test runs
this venv's python as `--vllm-python`, the real mistake of pointing at the wrong
interpreter, so its ImportError is what the report must surface."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from builders import one_torch_thread, tiny_checkpoint  # noqa: F401 (autouse fixture)

from benchmarks.engine_throughput import (
    VLLM_KV_CACHE_GIB,
    _run_logged,
    compared,
    cpu_list,
    main,
    paired_ratio,
    vllm_launch,
)


def test_cpu_list_compresses_runs():
    assert cpu_list([0, 1]) == "0-1"
    assert cpu_list([7, 0, 2, 3, 4]) == "0,2-4,7"
    assert cpu_list([5]) == "5"


def _fake_venv_and_libs(tmp_path: Path) -> tuple[str, Path]:
    """A venv layout with libiomp5.so and a /usr/lib-like root with tcmalloc (empty
    files: only their paths matter to the launch)."""
    (tmp_path / "venv" / "lib").mkdir(parents=True)
    (tmp_path / "venv" / "lib" / "libiomp5.so").touch()
    multiarch = tmp_path / "usrlib" / "x86_64-linux-gnu"
    multiarch.mkdir(parents=True)
    (multiarch / "libtcmalloc_minimal.so.4").touch()
    return str(tmp_path / "venv" / "bin" / "python"), tmp_path / "usrlib"


def test_vllm_launch_is_the_best_configuration(tmp_path):
    python, lib_root = _fake_venv_and_libs(tmp_path)
    base = {"PYTHONPATH": "/some/worktree", "LD_PRELOAD": "/already.so", "PATH": "/bin"}
    launch = vllm_launch(python, threads=1, eager=False, base_env=base, lib_root=lib_root)
    first_core = str(min(os.sched_getaffinity(0)))
    assert launch.bind == first_core
    assert launch.env["VLLM_CPU_OMP_THREADS_BIND"] == first_core
    assert launch.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert launch.env["VLLM_CPU_KVCACHE_SPACE"] == str(VLLM_KV_CACHE_GIB)
    assert launch.env["LD_PRELOAD"] == ":".join(
        [
            str(lib_root / "x86_64-linux-gnu" / "libtcmalloc_minimal.so.4"),
            str(tmp_path / "venv" / "lib" / "libiomp5.so"),
            "/already.so",
        ]
    )
    assert "PYTHONPATH" not in launch.env and launch.env["PATH"] == "/bin"
    assert launch.preloaded == ("tcmalloc", "iomp5")
    assert launch.label() == f"compiled, bind {first_core} +tcmalloc +iomp5"
    assert base["LD_PRELOAD"] == "/already.so"  # the caller's mapping is not touched


def test_vllm_launch_without_the_libraries_preloads_nothing(tmp_path):
    launch = vllm_launch(
        str(tmp_path / "bin" / "python"), None, eager=True, base_env={}, lib_root=tmp_path
    )
    cores = sorted(os.sched_getaffinity(0))
    assert launch.bind == cpu_list(cores)
    assert "LD_PRELOAD" not in launch.env and launch.preloaded == ()
    assert launch.label() == f"eager, bind {cpu_list(cores)}"


def _row(name: str, engine: str, dtype: str, tok_per_s: float, outputs: dict) -> dict:
    return {"name": name, "engine": engine, "dtype": dtype, "tok_per_s": tok_per_s,
            "outputs": outputs}  # fmt: skip


def test_each_row_is_compared_with_pagedserve_of_its_dtype():
    a, b = [1, 2], [1, 3]
    rows = compared(
        [
            _row("pagedserve engine", "pagedserve", "bfloat16", 200.0, {"0": a, "1": a}),
            _row("pagedserve engine", "pagedserve", "float32", 100.0, {"0": a, "1": b}),
            _row("kernel off", "pagedserve", "bfloat16", 160.0, {"0": a, "1": b}),
            _row("transformers", "transformers", "bfloat16", 50.0, {"0": b}),
            _row("vLLM-CPU", "vllm", "bfloat16", 400.0, {"0": a, "1": b}),
            _row("vLLM-CPU", "vllm", "float32", 80.0, {"0": a, "1": b}),
        ]
    )
    got = [(r["vs"], r["engine_x"], r["greedy_equal"]) for r in rows]
    assert all(r["paired_x"] is None for r in rows)  # one round: nothing paired
    assert got == [
        ("pagedserve engine bfloat16", 1.0, "2/2"),
        ("pagedserve engine float32", 1.0, "2/2"),
        ("pagedserve engine bfloat16", 1.25, "1/2"),
        ("pagedserve engine bfloat16", 4.0, "0/1"),
        ("pagedserve engine bfloat16", 0.5, "1/2"),
        ("pagedserve engine float32", 1.25, "2/2"),
    ]


def test_paired_ratio_is_the_median_of_same_round_ratios():
    """Rounds pair up in order: a host that slowed down in round 2 slows both rows."""
    ref = {"tok_per_s_runs": [100.0, 50.0, 90.0]}
    row = {"tok_per_s_runs": [80.0, 50.0, 60.0]}  # ratios 1.25, 1.0, 1.5
    assert paired_ratio(ref, row) == 1.25
    assert paired_ratio(ref, {"tok_per_s_runs": [80.0, 50.0]}) is None  # rounds differ
    assert paired_ratio({"tok_per_s_runs": [100.0]}, {"tok_per_s_runs": [80.0]}) is None
    assert paired_ratio(ref, {}) is None  # e.g. a transformers row


def test_a_timed_out_run_is_killed_with_its_children(tmp_path):
    """vLLM's engine core is a child of the script: a timeout must take both down."""
    log = tmp_path / "log"
    child = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen(['sleep', '60'])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    assert _run_logged([sys.executable, "-c", child], dict(os.environ), log, 3.0) is None
    grandchild = int(log.read_text().split()[0])
    assert _wait_not_running(grandchild, 10.0)


def _wait_not_running(pid: int, within_s: float) -> bool:
    """Whether `pid` is gone or a zombie within `within_s` (SIGKILL lands asynchronously
    on the other members of a group; a zombie waits for init to reap it)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def tiny_workload(tmp_path) -> Path:
    reqs = [
        {"id": 0, "prompt_token_ids": list(range(17, 37)), "max_tokens": 4},
        {"id": 1, "prompt_token_ids": list(range(40, 57)), "max_tokens": 3},
    ]
    path = tmp_path / "wl.json"
    path.write_text(json.dumps({"requests": reqs}))
    return path


def test_failed_vllm_run_is_reported_and_pagedserve_rows_kept(tiny_workload, tmp_path, capsys):
    out = tmp_path / "report.json"
    argv = ["--model", str(tiny_checkpoint("llama")), "--workload", str(tiny_workload),
            "--skip-baselines", "--dtype", "float32", "--vllm-eager", "--repeat", "2",
            "--vllm-python", sys.executable, "--json", str(out)]  # fmt: skip
    assert main(argv) == 1
    cap = capsys.readouterr()
    assert "exited 1" in cap.err and "No module named 'vllm'" in cap.err
    assert "CalledProcessError" not in cap.err
    assert "vLLM-CPU failed" in cap.out
    report = json.loads(out.read_text())
    (row,) = report["results"]
    assert (row["engine"], row["dtype"], row["output_tokens"]) == ("pagedserve", "float32", 7)
    assert row["startup_s"] > 0 and (row["engine_x"], row["greedy_equal"]) == (1.0, "2/2")
    assert f"{row['startup_s']:8.1f}" in cap.out  # the start s column
    # Tried in the first round only: a vLLM that failed once is not run again.
    assert len(report["failures"]) == 1 and "No module named 'vllm'" in report["failures"][0]
    assert len(row["tok_per_s_runs"]) == 2 and row["paired_x"] == 1.0
    assert report["vllm_env"]["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"


def test_missing_vllm_python_is_refused_before_any_run(tiny_workload, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--workload", str(tiny_workload), "--vllm-python", "/nonexistent/bin/python"])
    assert exc.value.code == 2
    assert "--vllm-python /nonexistent/bin/python: no such executable" in capsys.readouterr().err
