"""`pip install .` gives a working package, used from outside the source tree.

The wheel is built from `git archive HEAD` (what a clone has: no generated files
beyond those committed, no .venv, no caches), installed into a fresh virtual
environment, and used from a temporary directory, never the checkout:

- the package's files are the wheel's (not the checkout's), stubs, .proto sources,
  the C kernel source and the LICENSE included;
- `pagedserve --help` runs;
- the offline `LLM` generates on a tiny checkpoint, token for token what this
  checkout's engine generates (float32);
- a router and a worker started from the installed package answer a request.

The fresh environment gets the heavy dependencies (torch, ray, ...) from this
test's own environment through a .pth line (installing them again would take
minutes and the network), and the package itself only from the wheel: the
checkout's editable-install hook lives in a .pth file of the outer environment,
which a path added by a .pth line does not run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest
from builders import tiny_checkpoint

from pagedserve.common.api.sampling_params import SamplingParams
from pagedserve.common.core.llm import LLM

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow

PROMPT = [5, 17, 42, 9, 300, 12, 77, 8]
MAX_TOKENS = 10

_USE_INSTALLED = """
import json, sys
import pagedserve
from pagedserve.common.core.llm import LLM
from pagedserve.common.api.sampling_params import SamplingParams

assert pagedserve.__file__.startswith(sys.prefix), pagedserve.__file__
llm = LLM(sys.argv[1], dtype="float32", num_blocks=32, max_model_len=128)
params = SamplingParams(temperature=0, max_tokens=int(sys.argv[3]), ignore_eos=True)
offline = llm.generate([json.loads(sys.argv[2])], params)[0].completions[0].token_ids

from pagedserve.common.core.config import CacheConfig, EngineConfig, SchedulerConfig
from pagedserve.common.runtime.worker import WorkerConfig
from pagedserve.router.client import Client
from pagedserve.router.config import RouterConfig
from pagedserve.router.server import start_router_in_thread
from pagedserve.worker import start_worker

engine = EngineConfig(model=sys.argv[1], dtype="float32", cache=CacheConfig(num_blocks=32),
                      scheduler=SchedulerConfig(max_model_len=128), num_threads=1)
router = start_router_in_thread(RouterConfig(port=0, model=sys.argv[1], max_model_len=128))
worker = start_worker(WorkerConfig("w0", "colocated", engine,
                                   registry_address=router.internal_address,
                                   heartbeat_interval_s=0.2))
try:
    import time
    end = time.monotonic() + 60
    while not router.live_worker_ids():
        assert time.monotonic() < end, "the worker never registered"
        time.sleep(0.05)
    with Client(router.address, timeout=60) as client:
        served = client.collect(token_ids=json.loads(sys.argv[2]), max_tokens=int(sys.argv[3]),
                                temperature=0, ignore_eos=True)[0].token_ids
finally:
    worker.stop(grace=0.2)
    router.stop()
print(json.dumps({"offline": list(offline), "served": list(served)}))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout (the wheel is built from `git archive HEAD`)")
    work = tmp_path_factory.mktemp("wheel")
    archive = work / "src.tar"
    subprocess.run(
        ["git", "archive", "--format=tar", "-o", str(archive), "HEAD"], cwd=ROOT, check=True
    )
    src = work / "src"
    with tarfile.open(archive) as tar:
        tar.extractall(src, filter="data")
    dist = work / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(dist), str(src)],
        cwd=work, check=True, capture_output=True, text=True,
    )  # fmt: skip
    (whl,) = dist.glob("pagedserve-*.whl")
    return whl


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory) -> Path:
    env_dir = tmp_path_factory.mktemp("venv") / "env"
    subprocess.run([sys.executable, "-m", "venv", str(env_dir)], check=True)
    py = env_dir / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    # The dependencies, from this environment (see the module docstring).
    Path(site, "_pagedserve_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return env_dir


def outside_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["HOME"] = os.environ.get("HOME", str(tmp_path))
    return env


def test_wheel_contents(wheel: Path):
    names = set(zipfile.ZipFile(wheel).namelist())
    for stub in ("generation", "worker", "kvtransfer", "index"):
        assert f"pagedserve/v1/{stub}_pb2.py" in names
        assert f"pagedserve/v1/{stub}_pb2_grpc.py" in names
        assert f"pagedserve/proto/pagedserve/v1/{stub}.proto" in names
    assert "pagedserve/common/core/attention/cpu_attention.c" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), "no LICENSE"
    assert not any(n.startswith(("benchmarks/", "tests/")) for n in names)


def test_installed_cli_help(venv: Path, tmp_path: Path):
    out = subprocess.run(
        [str(venv / "bin" / "pagedserve"), "--help"],
        cwd=tmp_path, env=outside_env(tmp_path), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "generate" in out.stdout and "up" in out.stdout


def test_installed_package_generates_offline_and_serves(venv: Path, tmp_path: Path):
    ckpt = str(tiny_checkpoint("llama"))
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", _USE_INSTALLED, ckpt, json.dumps(PROMPT),
         str(MAX_TOKENS)],
        cwd=tmp_path, env=outside_env(tmp_path), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    llm = LLM(ckpt, dtype="float32", num_blocks=32, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = llm.generate([PROMPT], params)[0].completions[0].token_ids
    assert got["offline"] == want
    assert got["served"] == want
