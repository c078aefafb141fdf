"""Turns a scheduler step into one model forward over the paged KV cache.

The batch is flat (see attention/base.py): every prefill chunk's tokens, then one
token per decoding sequence. Logits are computed only for the positions that are
sampled: the last token of each chunk that completes a prompt, and every decode
token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.common.core.attention.base import AttentionMetadata
from pagedserve.common.core.block_manager import BlockManager
from pagedserve.common.core.kv_cache import KVCache
from pagedserve.common.core.model import PagedCausalLM
from pagedserve.common.core.scheduler import ScheduledSeq, SchedulerOutput


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [N] int64: rows of the hidden states to sample from
    sampled: list[ScheduledSeq]  # the sequence behind each sampled row


class ModelRunner:
    def __init__(self, model: PagedCausalLM, kv_cache: KVCache, block_manager: BlockManager):
        self.model = model
        self.kv_cache = kv_cache
        self.bm = block_manager
        self.block_size = block_manager.block_size
        self.device = kv_cache.kv.device

    def prepare(self, sched: SchedulerOutput) -> ModelInput:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        sampled: list[ScheduledSeq] = []
        for item in [*sched.prefills, *sched.decodes]:
            seq, start, end = item.seq, item.start, item.start + item.num_new_tokens
            ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += self.bm.slot_mapping(seq.seq_id, start, end)
            query_lens.append(end - start)
            seq_lens.append(end)
            tables.append(self.bm.block_table(seq.seq_id))
            if item.samples:
                sample_rows.append(len(ids) - 1)
                sampled.append(item)
        num_prefill_tokens = sum(query_lens[: len(sched.prefills)])
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            num_prefills=len(sched.prefills),
            num_prefill_tokens=num_prefill_tokens,
            num_decode_tokens=len(sched.decodes),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        return ModelInput(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            meta=meta,
            sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=dev),
            sampled=sampled,
        )

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[torch.Tensor, list[ScheduledSeq]]:
        """Runs the step; returns float32 logits [N, vocab] for the sampled rows."""
        if sched.block_copies:
            self.kv_cache.copy_blocks([(c.src, c.dst) for c in sched.block_copies])
        inp = self.prepare(sched)
        hidden = self.model(inp.input_ids, inp.positions, self.kv_cache, inp.meta)
        if not inp.sampled:
            return torch.empty(0, self.model.spec.vocab_size), []
        logits = self.model.compute_logits(hidden.index_select(0, inp.sample_rows))
        return logits, inp.sampled
