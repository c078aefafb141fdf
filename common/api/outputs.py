"""What a request produces, as plain data: finish reasons, per-token logprobs, the
deltas a step reports, usage, a request's failure of its own, and one sample's whole
`Completion`.

Torch-free, so the router, the client and the offline `LLM` share one definition of
each (the protobuf side is `common/runtime/protocol.py`, the one place that maps them).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass
class TokenLogprobs:
    token_id: int  # the chosen token
    logprob: float  # its logprob
    top: list[tuple[int, float]]  # the `logprobs` most likely (id, logprob), descending


class FinishReason(str, enum.Enum):
    LENGTH = "length"  # max_tokens or max_model_len reached
    STOP = "stop"  # a stop string or stop token id matched
    EOS = "eos"  # the model's end-of-sequence token
    ABORT = "abort"  # the client cancelled, or the request failed


class ErrorKind(str, enum.Enum):
    """Why one request failed on its own (the servicers map it to a gRPC status)."""

    INVALID_ARGUMENT = "invalid_argument"  # its own parameters made the step fail for it
    INTERNAL = "internal"  # a fault while serving it (detokenizer, stop strings, ...)


@dataclass(frozen=True)
class RequestError:
    """A request that failed alone: it ended (finish reason ABORT) and returned its
    blocks; every other request of the step went on. `message` says what failed and why."""

    kind: ErrorKind
    message: str


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class SampleDelta:
    """What one sample of a request produced since the last report."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs | None]
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    completion_tokens: int = 0  # tokens this sample generated so far, in all


@dataclass(frozen=True)
class RequestOutput:
    """One step's news about one request (a streaming chunk)."""

    request_id: str
    samples: list[SampleDelta]
    finished: bool
    usage: Usage | None = None  # set once the whole request has finished
    error: RequestError | None = None  # the request failed alone (finished is True)


@dataclass
class Completion:
    """One sample of a finished request: what the offline `LLM` returns and what the
    client assembles from a stream (the one definition of both)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    usage: Usage | None = None  # the client: the request's usage, from the last message
    num_messages: int = 0  # the client: streamed responses this sample arrived in

    @property
    def stop_string(self) -> str | None:
        return self.stop_reason if isinstance(self.stop_reason, str) else None

    @property
    def stop_token_id(self) -> int | None:
        return self.stop_reason if isinstance(self.stop_reason, int) else None
