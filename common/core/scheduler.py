"""The scheduler: which sequences compute how many tokens in the next step.

It owns the waiting, running and swapped queues and talks to the block manager;
it knows nothing about tensors. The engine turns its output into one model
forward, then reports back (`finish`, `abort`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from pagedserve.common.core.block_manager import BlockCopy, BlockManager
from pagedserve.common.core.config import CacheConfig, SchedulerConfig
from pagedserve.common.core.sequence import Sequence, SequenceStatus


class QueueFullError(RuntimeError):
    """A new request was refused: the waiting queue is at `max_num_waiting_seqs`.

    Not the request's fault (unlike InvalidRequestError): the same request fits on
    a less loaded engine, or here later. Raised before anything was allocated.
    """


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step: compute tokens [start, start + num_new_tokens)."""

    seq: Sequence
    start: int
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the sequence, so its last position is sampled."""
        return self.start + self.num_new_tokens == len(self.seq.token_ids)


@dataclass
class SchedulerOutput:
    prefills: list[ScheduledSeq] = field(default_factory=list)
    decodes: list[ScheduledSeq] = field(default_factory=list)
    block_copies: list[BlockCopy] = field(default_factory=list)  # copy-on-write, before forward
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.prefills) + len(self.decodes)

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes


class Swapper(Protocol):
    """Moves a preempted sequence's KV to host memory and back (preemption_mode="swap")."""

    def swap_out(self, seq_id: str, block_ids: list[int]) -> None: ...

    def swap_in(self, seq_id: str, block_ids: list[int], first_block: int) -> None: ...

    def discard(self, seq_id: str) -> None: ...


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        cache_config: CacheConfig,
        block_manager: BlockManager,
        swapper: Swapper | None = None,
    ) -> None:
        if cache_config.preemption_mode == "swap" and swapper is None:
            raise ValueError("preemption_mode='swap' needs a swapper")
        self.config = config
        self.cache_config = cache_config
        self.bm = block_manager
        self.swapper = swapper
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the tail is the newest
        self.swapped: deque[Sequence] = deque()
        self.num_preemptions = 0
        self._watermark_blocks = int(cache_config.watermark * block_manager.num_blocks)

    # -- queue changes ------------------------------------------------------

    def check_room(self) -> None:
        """Raises QueueFullError when a new request must not join the waiting queue.

        Called by the engine before it records a new request (so a refusal leaves
        nothing behind); `add` itself never refuses, because preempted sequences and
        the samples of an accepted request must always find their place.
        """
        limit = self.config.max_num_waiting_seqs
        if limit is not None and len(self.waiting) >= limit:
            raise QueueFullError(
                f"the waiting queue is full ({len(self.waiting)} sequences waiting, "
                f"max_num_waiting_seqs {limit}): retry later or on another worker"
            )

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose blocks the caller already allocated (forks, imported KV)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out of every queue; its blocks return now."""
        for queue in (self.waiting, self.running, self.swapped):
            if seq in queue:
                queue.remove(seq)
        if self.bm.has_seq(seq.seq_id):
            self.bm.free(seq.seq_id)
        if seq.status is SequenceStatus.SWAPPED and self.swapper is not None:
            self.swapper.discard(seq.seq_id)
        seq.status = SequenceStatus.FINISHED

    def hold(self, seq: Sequence) -> None:
        """Take a sequence out of every queue but keep its blocks (prefill role)."""
        for queue in (self.waiting, self.running, self.swapped):
            if seq in queue:
                queue.remove(seq)
        seq.status = SequenceStatus.FINISHED

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    # -- the step -----------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        # Idea: running sequences go first, oldest first. Each gets its next token
        # (or the next chunk of its prompt); when the pool runs dry the newest
        # running sequence is preempted to make room, never an older one. Swapped
        # sequences come back next, then the token budget and sequence slots that
        # remain admit waiting sequences in arrival order (FCFS). With chunked
        # prefill the last one admitted may take only part of its prompt.
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if out.preempted:  # the pool is under pressure: admit nothing new this step
            return out
        self._swap_in()
        self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        queue = deque(self.running)
        kept: list[Sequence] = []
        while queue:
            seq = queue.popleft()
            if budget <= 0:
                kept.append(seq)
                continue
            if self._has_all_slots(seq):  # a prompt being prefilled in chunks
                n = min(seq.num_uncomputed, budget)
                out.prefills.append(ScheduledSeq(seq, seq.num_computed_tokens, n))
                budget -= n
                kept.append(seq)
                continue
            while not self.bm.can_append(seq.seq_id, 1):
                victim = queue.pop() if queue else seq
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            out.block_copies += self.bm.append_tokens(seq.seq_id, seq.token_ids[-1:])
            out.decodes.append(ScheduledSeq(seq, len(seq.token_ids) - 1, 1))
            budget -= 1
            kept.append(seq)
        self.running = kept
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        chunked = self.config.enable_chunked_prefill
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self._admit(seq):
                break
            n = seq.num_uncomputed
            if n > budget:
                if not chunked and (out.prefills or out.decodes):
                    break  # the whole prompt goes in a later step of its own
                n = budget if chunked else n
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.prefills.append(ScheduledSeq(seq, seq.num_computed_tokens, n))
            budget -= n

    def _has_all_slots(self, seq: Sequence) -> bool:
        """Every token has a slot: the sequence is (still) prefilling, not decoding.

        A decoding sequence's last token is the one just sampled; it gets its slot
        when the step that computes its K/V is scheduled.
        """
        return self.bm.num_tokens(seq.seq_id) == len(seq.token_ids)

    def _admit(self, seq: Sequence) -> bool:
        """Give a waiting sequence its blocks (prefix hits first); False if they do not fit."""
        if self.bm.has_seq(seq.seq_id):
            return True
        salt = seq.request.cache_salt
        if not self.bm.can_allocate(seq.token_ids, salt):
            return False
        cached = self.bm.match_prefix(seq.token_ids, salt)
        bs = self.bm.block_size
        needed = -(-len(seq.token_ids) // bs) - cached // bs
        if self.running and self.bm.num_free_blocks() - needed < self._watermark_blocks:
            return False
        seq.num_computed_tokens = self.bm.allocate(seq.seq_id, seq.token_ids, salt)
        if seq.index == 0 and not seq.output_token_ids:
            seq.request.num_cached_tokens = seq.num_computed_tokens
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.num_preemptions += 1
        out.preempted.append(seq)
        if seq in self.running:
            self.running.remove(seq)
        if self.cache_config.preemption_mode == "swap" and not self._has_all_slots(seq):
            assert self.swapper is not None
            self.swapper.swap_out(seq.seq_id, self.bm.block_table(seq.seq_id))
            self.bm.free(seq.seq_id)
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            return
        # Recompute: drop the KV; the sequence re-enters the waiting queue at the
        # front (it arrived before everything still waiting) with all its tokens
        # so far, and the prefix cache gives most of them back.
        self.bm.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def _swap_in(self) -> None:
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            computed = seq.token_ids[: seq.num_computed_tokens]
            if not self.bm.can_allocate(computed, seq.request.cache_salt):
                return
            self.swapped.popleft()
            cached = self.bm.allocate(seq.seq_id, computed, seq.request.cache_salt)
            assert self.swapper is not None
            self.swapper.swap_in(
                seq.seq_id, self.bm.block_table(seq.seq_id), cached // self.bm.block_size
            )
            self.bm.mark_computed(seq.seq_id, seq.num_computed_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)

    def iter_unfinished(self) -> Iterable[Sequence]:
        yield from self.running
        yield from self.waiting
        yield from self.swapped
