"""The check of tests/dtype_guard.py: a test that leaves its dtype to `auto` fails on any
machine unless it is marked, and the marked ones are what `make test-dtypes` selects."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import dtype_guard
import pytest
from builders import tiny_checkpoint

from pagedserve.common.core.llm import LLM

TESTS = Path(__file__).resolve().parent

INNER = """
import pytest
from pagedserve.common.core.config import resolve_dtype


def test_forgot():
    assert resolve_dtype("auto", "cpu") in ("float32", "bfloat16")


@pytest.mark.dtype_auto
def test_meant_it():
    assert resolve_dtype("auto", "cpu") in ("float32", "bfloat16")


def test_stated():
    assert resolve_dtype("float32", "cpu") == "float32"


def test_explicit_flags():
    assert resolve_dtype("auto", "cpu", frozenset({"amx_bf16"})) == "bfloat16"


@pytest.fixture(scope="module")
def engine_dtype():
    return resolve_dtype("auto", "cpu")


def test_fixture_forgot(engine_dtype):
    assert engine_dtype
"""


def run_inner(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_inner.py").write_text(INNER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)])}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "dtype_guard"]
        + ["-p", "no:cacheprovider", "--rootdir", str(tmp_path), *args, "test_inner.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def outcomes(out: str) -> dict[str, str]:
    """test name -> PASSED/FAILED, from -rA's short summary."""
    got = {}
    for line in out.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("PASSED", "FAILED") and "::" in rest:
            got[rest.split("::")[1].split()[0]] = word
    return got


def test_an_unmarked_test_that_resolves_auto_fails_and_the_marked_are_selected(tmp_path):
    everything = run_inner(tmp_path)
    assert outcomes(everything.stdout) == {
        "test_forgot": "FAILED",
        "test_meant_it": "PASSED",
        "test_stated": "PASSED",
        "test_explicit_flags": "PASSED",
        "test_fixture_forgot": "FAILED",  # the read was in its module fixture's set-up
    }, everything.stdout
    assert "test_forgot resolved dtype 'auto'" in everything.stdout
    assert "mark it @pytest.mark.dtype_auto" in everything.stdout

    selected = run_inner(tmp_path, "-m", dtype_guard.MARKER)
    assert selected.returncode == 0, selected.stdout
    assert outcomes(selected.stdout) == {"test_meant_it": "PASSED"}, selected.stdout


@pytest.mark.dtype_auto
def test_an_engine_left_on_auto_is_what_the_guard_sees():
    """The engine's own path to the flags (LLM -> engine -> resolve_dtype) is counted;
    a stated dtype is not."""
    path = str(tiny_checkpoint("llama"))
    before = dtype_guard._reads
    LLM(path, dtype="float32", num_blocks=16, max_model_len=64)
    assert dtype_guard._reads == before
    LLM(path, num_blocks=16, max_model_len=64)
    assert dtype_guard._reads > before
