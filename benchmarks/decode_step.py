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

    python -m benchmarks.decode_step                      # fp32 and bf16, batch 1 8 32
    python -m benchmarks.decode_step --dtype bf16 --batch 32 --context 512 --json out.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable

import torch

from pagedserve.common.core.attention.base import AttentionMetadata
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


def _decode_meta(batch: int, context: int, block_size: int, num_blocks: int) -> AttentionMetadata:
    """B decode sequences, each with `context` cached tokens + 1 new, shuffled blocks."""
    blocks = list(range(num_blocks))
    random.Random(0).shuffle(blocks)
    per_seq = -(-(context + 1) // block_size)
    tables = [blocks[i * per_seq : (i + 1) * per_seq] for i in range(batch)]
    slots = [t[context // block_size] * block_size + context % block_size for t in tables]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=torch.full((batch,), context + 1, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        num_prefills=0,
        num_prefill_tokens=0,
        num_decode_tokens=batch,
        max_query_len=1,
        max_seq_len=context + 1,
        query_lens_cpu=[1] * batch,
        seq_lens_cpu=[context + 1] * batch,
    )


def paged_step(
    loaded: LoadedModel, batch: int, context: int, block_size: int
) -> Callable[[], None]:
    model, spec = loaded.model, loaded.spec
    per_seq = -(-(context + 1) // block_size)
    cache = KVCache(spec, batch * per_seq + 1, block_size, model.dtype, "cpu")
    cache.kv.normal_()
    ids = torch.randint(17, spec.vocab_size, (batch,))
    positions = torch.full((batch,), context, dtype=torch.int64)

    def step() -> None:
        meta = _decode_meta(batch, context, block_size, cache.num_blocks)  # new each step
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


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES))
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=256, help="cached tokens per sequence")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-baseline", action="store_true", help="skip transformers")
    ap.add_argument("--json", help="write the rows as JSON to this path")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    rows = []
    for dname in args.dtype:
        dtype = DTYPES[dname]
        loaded = load_model(None, dtype=dtype, attention_backend="torch")
        hf = None
        if not args.no_baseline:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(str(loaded.source_dir), dtype=dtype).eval()
        for b in args.batch:
            fns = [paged_step(loaded, b, args.context, args.block_size)]
            if hf is not None:
                fns.append(transformers_step(hf, b, args.context))
            (ours, ours_min), *base = _interleaved_ms(fns, args.iters, warmup=2)
            row = dict(
                dtype=dname,
                batch=b,
                context=args.context,
                pagedserve_ms=round(ours, 2),
                pagedserve_min_ms=round(ours_min, 2),
                transformers_ms=None,
                transformers_min_ms=None,
                speedup=None,
                pagedserve_tok_s=round(b / ours * 1e3, 1),
            )
            if base:
                ((ref, ref_min),) = base
                row.update(
                    transformers_ms=round(ref, 2),
                    transformers_min_ms=round(ref_min, 2),
                    speedup=round(ref / ours, 2),
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
            f"{'dtype':>5} {'batch':>5} {'ctx':>5} {'pagedserve ms (min)':>20} "
            f"{'transformers ms (min)':>22} {'speedup':>8} {'tok/s':>7}"
        )
    ours = f"{r['pagedserve_ms']:.1f} ({r['pagedserve_min_ms']:.1f})"
    base = "-"
    if r["transformers_ms"] is not None:
        base = f"{r['transformers_ms']:.1f} ({r['transformers_min_ms']:.1f})"
    ratio = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
    print(
        f"{r['dtype']:>5} {r['batch']:>5} {r['context']:>5} {ours:>20} {base:>22} "
        f"{ratio:>8} {r['pagedserve_tok_s']:>7.0f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
