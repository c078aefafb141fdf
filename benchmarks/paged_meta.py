"""The attention metadata of a synthetic engine step, for the step benchmarks
(decode_step, step_overhead): what the engine's model runner would build for these
sequences, over a cache whose blocks are handed out in a shuffled order (as a cache
that has served for a while hands them out, not one contiguous run)."""

from __future__ import annotations

import itertools
import random

import torch

from pagedserve.common.core.attention.base import AttentionMetadata


def paged_metadata(
    q_lens: list[int], ctxs: list[int], block_size: int, num_blocks: int, seed: int = 0
) -> AttentionMetadata:
    """Sequences of `q_lens` new tokens on `ctxs` cached ones (sequence i attends to
    its first ctxs[i] + q_lens[i] tokens), prefills (q_len > 1) first as the runner
    orders them, each given the next ceil(len / block_size) blocks of
    `range(num_blocks)` shuffled by `seed`."""
    blocks = list(range(num_blocks))
    random.Random(seed).shuffle(blocks)
    tables, slots, used = [], [], 0
    for q, c in zip(q_lens, ctxs, strict=True):
        n = -(-(c + q) // block_size)
        if used + n > num_blocks:
            raise ValueError(f"{num_blocks} blocks cannot hold these sequences")
        table = blocks[used : used + n]
        used += n
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(c, c + q)]
    seq_lens = [q + c for q, c in zip(q_lens, ctxs, strict=True)]
    return metadata(q_lens, seq_lens, tables, slots, sum(1 for q in q_lens if q > 1))


def metadata(
    q_lens: list[int],
    seq_lens: list[int],
    tables: list[list[int]],
    slots: list[int],
    num_prefills: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """AttentionMetadata of a flat batch (its `num_prefills` prefill sequences first),
    given each sequence's block table and each new token's slot; tables padded with 0."""
    width = max(map(len, tables))
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(
            [0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=device
        ),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(
            [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device
        ),
        num_prefills=num_prefills,
        num_prefill_tokens=sum(q_lens[:num_prefills]),
        num_decode_tokens=len(q_lens) - num_prefills,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=list(q_lens),
        seq_lens_cpu=list(seq_lens),
    )
