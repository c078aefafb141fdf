"""Time per decode step of the default model on CPU: pagedserve (torch backend) vs transformers.

One decode step = every sequence of the batch advances by one token: the model
forward over B new tokens (K/V written into the paged cache, attention over
`--context` cached tokens each) plus the LM head on the B rows. The cache holds
random K/V (attention costs the same whatever the values); block tables are
shuffled, as after a while of serving.

Baseline, in the same run: transformers' forward of one token per sequence with a
`DynamicCache` of the same context length (cropped back after every step), LM
head included, the way `generate` runs a decode step. The two are timed in
alternation; the table shows the median (and the minimum) per step, speedup =
transformers median / pagedserve median.

Every dtype's model is loaded first and all variants are timed in one
alternation, so the bf16/fp32 ratio (and, with `--kernel on off`, the compiled
attention kernel against the torch gather + SDPA path; with `--prepack on off`,
weights packed at load (MKL's packed GEMM in fp32, oneDNN in bf16) against torch's
matmul; with `--fused on off`, the fused C kernels (bf16, fp32) of RMSNorm +
residual add, SiLU-and-mul and RoPE vs torch's ops) comes from the same minutes of
a shared machine: `vs first` = the first row's median / this row's. `--kernel off
--prepack off --fused off` is the engine as it was before bf16 got any of them.

`--profile` instead breaks one decode step (`--batch`'s first value, default 64
with it) and one `--prefill-len`-token prefill step into per-op times with
torch.profiler: matmuls named by their weight, RMSNorm, RoPE, attention (the C
kernel or the torch path, K/V writes apart), SiLU-and-mul, logits.

    python -m benchmarks.decode_step                      # fp32 and bf16, batch 1 8 32
    python -m benchmarks.decode_step --dtype bf16 --batch 32 --context 512 --json out.json
    python -m benchmarks.decode_step --no-baseline --batch 1 8 64 --kernel on off --prepack on off
    python -m benchmarks.decode_step --no-baseline --dtype bf16 --batch 1 8 64 --fused on off
    python -m benchmarks.decode_step --profile --dtype fp32 bf16 --json profile.json
    python -m benchmarks.decode_step --no-baseline --dtype fp32 --kv-cache anon shm

`--kv-cache anon shm` times the same step with the KV cache in ordinary memory and in a
/dev/shm file (KVCache(shm_dir=...), the in-place KV export's requirement), in turns.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.cli import add_on_off, engine_switches
from benchmarks.paged_meta import paged_metadata
from pagedserve.common.core.kv_cache import KVCache
from pagedserve.common.core.loader import LoadedModel, load_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _interleaved_ms(
    fns: list[Callable[[], object]], iters: int, warmup: int
) -> list[tuple[float, float]]:
    """(median, min) ms of each fn, run alternately so that both see the same load.

    The 2 cores here are shared: other processes' bursts inflate single samples
    several-fold, so the minimum is reported beside the median.
    """
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(iters):
        for fn, ts in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
    return [(statistics.median(ts), min(ts)) for ts in times]


def paged_step(
    loaded: LoadedModel, batch: int, context: int, block_size: int, shm_dir: str | None = None
) -> Callable[[], None]:
    """shm_dir: the cache in a shared-memory file there (`--kv-cache shm`)."""
    model, spec = loaded.model, loaded.spec
    per_seq = -(-(context + 1) // block_size)
    cache = KVCache(spec, batch * per_seq + 1, block_size, model.dtype, "cpu", shm_dir=shm_dir)
    if shm_dir is not None and cache.shm_path is None:
        raise SystemExit(f"no room in {shm_dir} for the KV cache")
    cache.kv.normal_()
    ids = torch.randint(17, spec.vocab_size, (batch,))
    positions = torch.full((batch,), context, dtype=torch.int64)

    def step() -> None:
        meta = paged_metadata([1] * batch, [context] * batch, block_size, cache.num_blocks)
        hidden = model(ids, positions, cache, meta)
        model.compute_logits(hidden)

    return step


def transformers_step(hf, batch: int, context: int) -> Callable[[], None]:
    from transformers import DynamicCache

    cfg = hf.config
    kvh, d = cfg.num_key_value_heads, cfg.head_dim
    dtype = hf.dtype
    cache = DynamicCache(config=cfg)
    for layer in range(cfg.num_hidden_layers):
        cache.update(
            torch.randn(batch, kvh, context, d, dtype=dtype),
            torch.randn(batch, kvh, context, d, dtype=dtype),
            layer,
        )
    ids = torch.randint(17, cfg.vocab_size, (batch, 1))
    positions = torch.full((batch, 1), context)
    mask = torch.ones(batch, context + 1, dtype=torch.long)

    @torch.inference_mode()
    def step() -> None:
        hf(ids, cache=cache, position_ids=positions, attention_mask=mask, use_cache=True)
        cache.crop(-1)  # back to `context` tokens

    return step


def _with_settings(step: Callable[[], None], model, kernel: bool, prepack: bool, fused: bool):
    """`step` run with the compiled CPU attention kernel on or off, the model's
    prepacked weights in use or not (swapped in and out, not rebuilt) and the fused
    bf16 ops on or off."""
    packs = ([layer.packed for layer in model.layers], model.lm_head_packed)
    backend = model.attention_backend
    ops = model.ops

    def run() -> None:
        backend.cpu_kernel = kernel
        model.ops = ops if fused else None
        for layer, packed in zip(model.layers, packs[0], strict=True):
            layer.packed = packed if prepack else {}
        model.lm_head_packed = packs[1] if prepack else None
        step()

    return run


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES))
    ap.add_argument("--batch", nargs="+", type=int, default=None, help="default 1 8 32")
    ap.add_argument("--context", type=int, default=256, help="cached tokens per sequence")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-baseline", action="store_true", help="skip transformers")
    add_on_off(ap, "--kernel", "C attention kernel where it fits (off: the torch path)")
    add_on_off(
        ap,
        "--prepack",
        "weights packed at load (fp32: the GEMM measured at load, bf16: oneDNN; model.can_prepack)",
    )
    add_on_off(ap, "--fused", "fused C kernels of the small ops (CPU, model.can_fuse)")
    ap.add_argument(
        "--kv-cache",
        nargs="+",
        default=["anon"],
        choices=["anon", "shm"],
        help="KV cache in ordinary (anonymous) memory, in a /dev/shm file, or both (in turns)",
    )
    ap.add_argument("--profile", action="store_true", help="per-op breakdown instead")
    ap.add_argument("--prefill-len", type=int, default=512, help="--profile's prefill step")
    ap.add_argument("--json", help="write the rows as JSON to this path")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.profile:
        return profile_main(args)
    batches = args.batch or [1, 8, 32]

    loaded = {d: load_model(None, dtype=DTYPES[d], attention_backend="torch") for d in args.dtype}
    hfs = {}
    if not args.no_baseline:
        from transformers import AutoModelForCausalLM

        for d, lm in loaded.items():
            hfs[d] = AutoModelForCausalLM.from_pretrained(
                str(lm.source_dir), dtype=DTYPES[d]
            ).eval()
    rows = []
    for b in batches:
        variants, fns = [], []
        for d, lm in loaded.items():
            for where in args.kv_cache:
                shm_dir = "/dev/shm" if where == "shm" else None
                step = paged_step(lm, b, args.context, args.block_size, shm_dir)
                for k, pk, f in engine_switches(args, DTYPES[d]):
                    variants.append(("pagedserve", d, k, pk, f, where))
                    fns.append(_with_settings(step, lm.model, k == "on", pk == "on", f == "on"))
            if d in hfs:
                variants.append(("transformers", d, "-", "-", "-", "-"))
                fns.append(transformers_step(hfs[d], b, args.context))
        times = _interleaved_ms(fns, args.iters, warmup=2)
        ref = {
            d: t for (who, d, *_), t in zip(variants, times, strict=True) if who == "transformers"
        }
        first = times[0][0]
        for (who, d, k, pk, f, where), (med, lo) in zip(variants, times, strict=True):
            if who != "pagedserve":
                continue
            row = dict(
                dtype=d,
                kv_cache=where,
                kernel=k,
                prepack=pk,
                fused=f,
                batch=b,
                context=args.context,
                pagedserve_ms=round(med, 2),
                pagedserve_min_ms=round(lo, 2),
                vs_first=round(first / med, 2),
                transformers_ms=None,
                transformers_min_ms=None,
                speedup=None,
                pagedserve_tok_s=round(b / med * 1e3, 1),
            )
            if d in ref:
                row.update(
                    transformers_ms=round(ref[d][0], 2),
                    transformers_min_ms=round(ref[d][1], 2),
                    speedup=round(ref[d][0] / med, 2),
                )
            rows.append(row)
            _print_row(row, header=len(rows) == 1)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"threads": args.threads, "block_size": args.block_size, "rows": rows}, f, indent=2
            )
    return rows


def _print_row(r: dict, header: bool) -> None:
    if header:
        print(
            f"{'dtype':>5} {'kv':>4} {'kernel':>6} {'prepack':>7} {'fused':>5} {'batch':>5} {'ctx':>5} {'pagedserve ms (min)':>20} "
            f"{'vs first':>8} {'transformers ms (min)':>22} {'speedup':>8} {'tok/s':>7}"
        )
    ours = f"{r['pagedserve_ms']:.1f} ({r['pagedserve_min_ms']:.1f})"
    base = "-"
    if r["transformers_ms"] is not None:
        base = f"{r['transformers_ms']:.1f} ({r['transformers_min_ms']:.1f})"
    ratio = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
    print(
        f"{r['dtype']:>5} {r['kv_cache']:>4} {r['kernel']:>6} {r['prepack']:>7} {r['fused']:>5} {r['batch']:>5} {r['context']:>5} {ours:>20} "
        f"{r['vs_first']:>7.2f}x {base:>22} {ratio:>8} {r['pagedserve_tok_s']:>7.0f}",
        flush=True,
    )


# ---- --profile: per-op breakdown ------------------------------------------------------


def prefill_step(loaded: LoadedModel, n: int, block_size: int) -> Callable[[], None]:
    """A whole-prompt prefill of n tokens, logits for its last row (as the engine does)."""
    model, spec = loaded.model, loaded.spec
    cache = KVCache(spec, -(-n // block_size) + 1, block_size, model.dtype, "cpu")
    ids = torch.randint(17, spec.vocab_size, (n,))
    positions = torch.arange(n)

    def step() -> None:
        meta = paged_metadata([n], [0], block_size, cache.num_blocks)
        hidden = model(ids, positions, cache, meta)
        model.compute_logits(hidden[-1:])

    return step


def _labelled(fn: Callable, label: str) -> Callable:
    def wrapped(*a, **kw):
        with torch.profiler.record_function(label):
            return fn(*a, **kw)

    return wrapped


@contextlib.contextmanager
def _phase_labels():
    """Label the model's phases for the profiler by wrapping their functions for the
    duration (the engine's code is not changed for profiling)."""
    from pagedserve.common.core import cpu_ops, mkl_pack
    from pagedserve.common.core import model as model_mod
    from pagedserve.common.core.attention import base, cpu_kernel, torch_backend

    patches = [
        (model_mod, "rms_norm", "rms_norm"),
        (model_mod, "apply_rope", "rope"),
        (cpu_ops, "rms_norm", "fused rms_norm"),
        (cpu_ops, "add_rms_norm", "fused residual add + rms_norm"),
        (cpu_ops, "silu_and_mul", "fused SiLU-and-mul"),
        (cpu_ops, "rope_", "fused rope (+ q/k norm)"),
        (model_mod.PagedCausalLM, "_rope_tables", "rope tables"),
        (model_mod.PagedCausalLM, "compute_logits", "logits (LM head)"),
        (torch_backend, "write_kv", "write K/V into cache"),
        (base, "write_kv", "write K/V into cache"),
        (cpu_kernel, "attend", "attention: C kernel"),
        (cpu_kernel, "attend_f32", "attention: C kernel"),  # the name before bf16
        (torch_backend, "_prefill_one", "attention: prefill SDPA"),
        (torch_backend.TorchAttentionBackend, "_decode", "attention: decode gather+SDPA"),
        (torch_backend, "_kernel_rows", "attention: plan"),
        (torch_backend.TorchAttentionBackend, "_get_plan", "attention: plan"),
    ]
    saved = []
    for obj, name, label in patches:
        if hasattr(obj, name):
            saved.append((obj, name, getattr(obj, name)))
            setattr(obj, name, _labelled(getattr(obj, name), label))
    # MKL's packed GEMM is a ctypes call, no aten op: label it with its weight's shape
    packed_mm = mkl_pack.PackedMatrix.mm

    def labelled_mm(self, x, bias=None):
        with torch.profiler.record_function(f"{_PACKED_MM}{self.in_features}x{self.out_features}"):
            return packed_mm(self, x, bias)

    saved.append((mkl_pack.PackedMatrix, "mm", packed_mm))
    mkl_pack.PackedMatrix.mm = labelled_mm
    try:
        yield
    finally:
        for obj, name, fn in reversed(saved):
            setattr(obj, name, fn)


def _weight_names(spec) -> dict[tuple[int, int], str]:
    s = spec
    return {
        (s.hidden_size, s.q_size + 2 * s.kv_size): "matmul qkv",
        (s.q_size, s.hidden_size): "matmul o_proj",
        (s.hidden_size, 2 * s.intermediate_size): "matmul gate_up",
        (s.intermediate_size, s.hidden_size): "matmul down",
        (s.hidden_size, s.vocab_size): "logits (LM head)",
    }


_OP_NAMES = {
    "aten::silu_": "SiLU-and-mul",
    "aten::mul_": "SiLU-and-mul",
    "aten::add": "residual add",
    "aten::embedding": "embedding",
}


def _category(ev, weights: dict[tuple[int, int], str]) -> str:
    """The phase an op belongs to: the nearest labelled range above it, else by
    op (and, for a matmul, by its weight's shape)."""
    node = ev
    while node is not None:
        if node.name in _LABELS:
            return node.name
        if node.name.startswith(_PACKED_MM):
            k, n = node.name[len(_PACKED_MM) :].split("x")
            return weights.get((int(k), int(n)), "matmul (MKL packed)")
        node = node.cpu_parent
    matmuls = ("aten::mm", "aten::addmm", "aten::matmul", "mkldnn::_linear_pointwise")
    if ev.name in matmuls and ev.input_shapes:
        for shape in ev.input_shapes[1:]:  # a prepacked weight is [out, in]
            for key in (tuple(shape), tuple(shape)[::-1]):
                if len(key) == 2 and key in weights:
                    return weights[key]
    return _OP_NAMES.get(ev.name, ev.name)


_PACKED_MM = "mkl packed matmul "  # + "{in}x{out}", see `_phase_labels`
_LABELS = {
    "rms_norm",
    "rope",
    "fused rms_norm",
    "fused residual add + rms_norm",
    "fused SiLU-and-mul",
    "fused rope (+ q/k norm)",
    "rope tables",
    "logits (LM head)",
    "write K/V into cache",
    "attention: C kernel",
    "attention: prefill SDPA",
    "attention: decode gather+SDPA",
    "attention: plan",
}


def _profile_one(step: Callable[[], None], spec) -> tuple[float, dict[str, float]]:
    """(wall ms, {category: self CPU ms}) of one profiled step."""
    from torch.profiler import ProfilerActivity, profile

    weights = _weight_names(spec)
    with _phase_labels(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        t0 = time.perf_counter()
        step()
        wall = (time.perf_counter() - t0) * 1e3
    cats: dict[str, float] = {}
    for ev in prof.events():
        labelled = ev.name in _LABELS or ev.name.startswith(_PACKED_MM)
        if ev.cpu_parent is None and not labelled and "::" not in ev.name:
            continue  # not an operator (aten::, mkldnn::) nor a phase: the profiler's own
        key = _category(ev, weights)
        cats[key] = cats.get(key, 0.0) + ev.self_cpu_time_total / 1e3
    return wall, cats


def profile_main(args) -> list[dict]:
    """Per-op table of a decode and a prefill step for each dtype (and kernel setting).

    Every variant is profiled once per round, rounds alternate (`--iters` of them),
    and each op's figure is its median over the rounds: a shared machine's bursts
    land on single rounds, not on one variant."""
    batch = (args.batch or [64])[0]
    variants = []  # (step name, dtype, "kernel/prepack/fused", run, spec)
    models = []
    for d in args.dtype:
        lm = load_model(None, dtype=DTYPES[d], attention_backend="torch")
        models.append(lm.model)
        steps = {
            f"decode b{batch} ctx{args.context}": paged_step(
                lm, batch, args.context, args.block_size
            ),
            f"prefill {args.prefill_len}": prefill_step(lm, args.prefill_len, args.block_size),
        }
        for k, pk, f in engine_switches(args, DTYPES[d]):
            for name, step in steps.items():
                run = _with_settings(step, lm.model, k == "on", pk == "on", f == "on")
                variants.append((name, d, f"{k}/{pk}/{f}", run, lm.spec))
    for _, _, _, run, _ in variants:  # warm-up
        run()
    samples: list[list[tuple[float, dict[str, float]]]] = [[] for _ in variants]
    for _ in range(args.iters):
        for (_, _, _, run, spec), out in zip(variants, samples, strict=True):
            out.append(_profile_one(run, spec))
    results = []
    for (name, d, k, _, _), out in zip(variants, samples, strict=True):
        keys = {c for _, cats in out for c in cats}
        ops = {c: statistics.median(cats.get(c, 0.0) for _, cats in out) for c in keys}
        wall = statistics.median(w for w, _ in out)
        kernel, prepack, fused = k.split("/")
        results.append(
            dict(
                step=name,
                dtype=d,
                kernel=kernel,
                prepack=prepack,
                fused=fused,
                wall_ms=wall,
                ops_ms=ops,
            )
        )
    for m in models:
        m.attention_backend.cpu_kernel = True
        m.use_fused_ops()
    for name in dict.fromkeys(r["step"] for r in results):
        rs = [r for r in results if r["step"] == name]
        cols = [f"{r['dtype']} k:{r['kernel']} p:{r['prepack']} f:{r['fused']}" for r in rs]
        total = {}
        for r in rs:
            for c, ms in r["ops_ms"].items():
                total[c] = total.get(c, 0.0) + ms
        order = sorted(total, key=total.get, reverse=True)
        print(
            f"\n{name} (ms per step, self CPU time, median of {args.iters} alternating "
            f"rounds; threads {args.threads})"
        )
        print(f"{'op':34}" + "".join(f"{c:>21}" for c in cols))
        for c in order:
            if total[c] < 0.05 * len(rs):
                continue
            print(f"{c[:34]:34}" + "".join(f"{r['ops_ms'].get(c, 0.0):21.2f}" for r in rs))
        print(f"{'sum of ops':34}" + "".join(f"{sum(r['ops_ms'].values()):21.2f}" for r in rs))
        print(f"{'wall (profiled, median)':34}" + "".join(f"{r['wall_ms']:21.2f}" for r in rs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "profile": results}, f, indent=2)
    return results


if __name__ == "__main__":
    main()
