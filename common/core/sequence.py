"""Requests, their sequences, and what a step reports about them.

A request with `n` parallel samples owns `n` sequences. It starts as one sequence
(sample 0) that prefills the prompt once; when the first tokens are sampled the
other samples are forked from it, sharing every prompt block by reference, and
diverge by copy-on-write.

Token bookkeeping of one sequence:

    token_ids:  [ prompt ................ | output ........ ]
    [0, num_computed_tokens)           K/V already in the cache
    [num_computed_tokens, len)         still to compute (the whole uncached prompt
                                       while waiting; the last sampled token while
                                       decoding)
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from pagedserve.common.api.outputs import (
    FinishReason,
    RequestError,
    TokenLogprobs,
)
from pagedserve.common.api.sampling_params import SamplingParams
from pagedserve.common.core.detokenizer import IncrementalDetokenizer


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: str
    request: Request
    index: int  # which of the request's n samples
    token_ids: list[int]
    detokenizer: IncrementalDetokenizer | None
    generator: torch.Generator | None
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    # Deltas not yet reported to the caller.
    pending_token_ids: list[int] = field(default_factory=list)
    pending_text: str = ""
    pending_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finish_reported: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.request.num_prompt_tokens :]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    seqs: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (usage)
    forked: bool = False  # the n > 1 samples have been forked from sample 0
    prefill_only: bool = False  # prefill role: hold the blocks after the first token
    error: RequestError | None = None  # set when this request failed on its own

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        """Every sample finished (or, in the prefill role, was handed over)."""
        return all(s.is_finished for s in self.seqs) and (self.forked or self.params.n == 1)


def make_seq_id(request_id: str, index: int) -> str:
    return f"{request_id}#{index}"


def total_output_tokens(seqs: Seq[Sequence]) -> int:
    return sum(len(s.output_token_ids) for s in seqs)
