"""Per-step software cost of small engine steps on the CPU (fp32, 1 torch thread).

A model with SmolLM2-135M's layer structure (30 layers, 9 query / 3 KV heads of 64)
but hidden and intermediate widths of 64 and a 512-token vocabulary: its weights are
~1 MB, so a step's time is the Python, views, dispatch and wrapper work of the real
model's step (plus attention over the real context, which still runs). Thread CPU
time per step (time descheduled by other processes does not count), median and
minimum, for decode at batch 1 and 8 over 287 cached tokens and a 32-token prefill on
256 cached tokens, each with a fresh metadata object as the engine builds it; then
the fused small ops' wrappers per call at one row (SmolLM2 widths).

`--real` runs the same steps on SmolLM2-135M itself (weights read each step).
`--save PATH` writes the steps' logits, to compare two trees bit for bit.

Compare two trees by running this from each in turn (the shared host's load moves):
    PYTHONPATH=/work/main python -m benchmarks.step_overhead --save main.pt
    PYTHONPATH=. python -m benchmarks.step_overhead --save branch.pt
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.paged_meta import paged_metadata
from pagedserve.common.api.model_config import ModelSpec
from pagedserve.common.core import cpu_ops
from pagedserve.common.core.attention import get_attention_backend
from pagedserve.common.core.kv_cache import KVCache
from pagedserve.common.core.loader import load_model
from pagedserve.common.core.model import PagedCausalLM

BLOCK = 16
TINY = ModelSpec(
    architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=64,
    num_layers=30, num_q_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
    rope_theta=10000.0, rope_scaling=None, max_position_embeddings=2048,
    tie_word_embeddings=False, attention_bias=False, qk_norm=False,
    bos_token_id=None, eos_token_ids=(0,),
)  # fmt: skip


def _model(real: bool) -> tuple[PagedCausalLM, ModelSpec]:
    if real:
        loaded = load_model(None, dtype=torch.float32, attention_backend="torch")
        return loaded.model, loaded.spec
    model = PagedCausalLM(TINY, get_attention_backend("torch", "cpu"), torch.float32, "cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    model.prepack_weights()
    return model, TINY


def _step(model, spec, cache, q_lens, ctxs):
    ids = torch.randint(1, min(spec.vocab_size, 512), (sum(q_lens),))
    pos = torch.cat([torch.arange(c, c + q) for q, c in zip(q_lens, ctxs, strict=True)])
    last = len(q_lens) == 1 and q_lens[0] > 1  # a prefill: logits of its last row

    def step() -> torch.Tensor:
        hidden = model(ids, pos, cache, paged_metadata(q_lens, ctxs, BLOCK, cache.num_blocks))
        return model.compute_logits(hidden[-1:] if last else hidden)

    return step


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--real", action="store_true", help="SmolLM2-135M, not the tiny widths")
    ap.add_argument("--save", help="write the steps' logits here (torch.save)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, spec = _model(args.real)
    cache = KVCache(spec, 8 * 19 + 40, BLOCK, torch.float32, "cpu")
    cache.kv.normal_()
    steps = {
        "decode b1 @287": _step(model, spec, cache, [1], [287]),
        "decode b8 @287": _step(model, spec, cache, [1] * 8, [287] * 8),
        "prefill 32 @256": _step(model, spec, cache, [32], [256]),
    }
    logits = {name: fn() for name, fn in steps.items()}  # also the warm-up
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.iters):
        for name, fn in steps.items():
            t0 = time.thread_time_ns()
            fn()
            times[name].append((time.thread_time_ns() - t0) / 1e6)
    for name, ts in times.items():
        print(f"{name}: {statistics.median(ts):.2f} ms (min {min(ts):.2f}), thread CPU")
    lib = cpu_ops.load()
    if lib is not None:
        x, y, w = torch.randn(1, 576), torch.randn(1, 576), torch.randn(576)
        gate_up, qkv = torch.randn(1, 3072), torch.randn(1, 960)
        qk, cos, sin = qkv[:, :768].view(1, 12, 64), torch.randn(1, 1, 64), torch.randn(1, 1, 64)
        ops = {
            "add_rms_norm": lambda: cpu_ops.add_rms_norm(lib, x, y, w, 1e-5),
            "rms_norm": lambda: cpu_ops.rms_norm(lib, x, w, 1e-5),
            "silu_and_mul": lambda: cpu_ops.silu_and_mul(lib, gate_up),
            "rope_ (q+k)": lambda: cpu_ops.rope_(lib, qk, cos, sin),
        }
        per_call: dict[str, list[float]] = {name: [] for name in ops}
        for _ in range(30):
            for name, fn in ops.items():
                t0 = time.thread_time_ns()
                for _ in range(200):
                    fn()
                per_call[name].append((time.thread_time_ns() - t0) / 200 / 1e3)
        for name, ts in per_call.items():
            print(f"{name} at 1 row: {statistics.median(ts):.1f} us (min {min(ts):.1f})")
    if args.save:
        torch.save(logits, args.save)


if __name__ == "__main__":
    main()
