"""Time per decode step of the default model on CPU: pagedserve (torch backend) vs transformers.

One decode step = every sequence of the batch advances by one token: the model
forward over B new tokens (K/V written into the paged cache, attention over
`--context` cached tokens each) plus the LM head on the B rows. The cache holds
random K/V (attention costs the same whatever the values); block tables are
shuffled, as after a while of serving.

Baseline, in the same run: transformers' forward of one token per sequence with a
`DynamicCache` of the same context length (cropped back after every step), LM
head included, the way `generate` runs a decode step.

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

from pagedserve.common.attention.base import AttentionMetadata
from pagedserve.common.kv_cache import KVCache
from pagedserve.common.loader import LoadedModel, load_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _median_ms(fn: Callable[[], object], iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


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


def paged_step_ms(
    loaded: LoadedModel, batch: int, context: int, block_size: int, iters: int
) -> float:
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

    return _median_ms(step, iters, warmup=3)


def transformers_step_ms(hf, batch: int, context: int, iters: int) -> float:
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

    return _median_ms(step, iters, warmup=2)


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
            ours = paged_step_ms(loaded, b, args.context, args.block_size, args.iters)
            base = transformers_step_ms(hf, b, args.context, args.iters) if hf else None
            rows.append(
                dict(
                    dtype=dname,
                    batch=b,
                    context=args.context,
                    pagedserve_ms=round(ours, 2),
                    transformers_ms=None if base is None else round(base, 2),
                    speedup=None if base is None else round(base / ours, 2),
                    pagedserve_tok_s=round(b / ours * 1e3, 1),
                )
            )
            _print_row(rows[-1], header=len(rows) == 1)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"threads": args.threads, "block_size": args.block_size, "rows": rows}, f, indent=2
            )
    return rows


def _print_row(r: dict, header: bool) -> None:
    if header:
        print(
            f"{'dtype':>5} {'batch':>5} {'ctx':>5} {'pagedserve ms':>14} "
            f"{'transformers ms':>16} {'speedup':>8} {'tok/s':>8}"
        )
    base = "-" if r["transformers_ms"] is None else f"{r['transformers_ms']:.1f}"
    ratio = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
    print(
        f"{r['dtype']:>5} {r['batch']:>5} {r['context']:>5} {r['pagedserve_ms']:>14.1f} "
        f"{base:>16} {ratio:>8} {r['pagedserve_tok_s']:>8.0f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
