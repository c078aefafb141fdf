"""Conversions between the wire messages (pagedserve.v1 protobuf) and the engine's types.

Shared by the router, the client and both worker roles, so that a request means the
same thing on every hop; the one home of the FinishReason <-> protobuf map. Only
protobuf message classes and `common/api` types are used here (no gRPC, no torch),
so the router and the client import it freely.
"""

from __future__ import annotations

from pagedserve.common.api.outputs import FinishReason, SampleDelta, TokenLogprobs, Usage
from pagedserve.common.api.sampling_params import SamplingParams
from pagedserve.v1 import generation_pb2 as gen_pb

_FINISH_TO_PB = {
    None: gen_pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.LENGTH: gen_pb.FINISH_REASON_LENGTH,
    FinishReason.STOP: gen_pb.FINISH_REASON_STOP,
    FinishReason.EOS: gen_pb.FINISH_REASON_EOS,
    FinishReason.ABORT: gen_pb.FINISH_REASON_ABORT,
}
FINISH_FROM_PB = {v: k for k, v in _FINISH_TO_PB.items()}


def sampling_from_pb(msg: gen_pb.SamplingParams) -> SamplingParams:
    """Unset optional fields take SamplingParams' defaults (documented in the .proto).

    Converts, does not validate: see `servicer_support` for where requests are checked."""
    d = SamplingParams()
    return SamplingParams(
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else d.max_tokens,
        temperature=msg.temperature if msg.HasField("temperature") else d.temperature,
        top_p=msg.top_p if msg.HasField("top_p") else d.top_p,
        top_k=msg.top_k if msg.HasField("top_k") else d.top_k,
        min_p=msg.min_p if msg.HasField("min_p") else d.min_p,
        repetition_penalty=(
            msg.repetition_penalty if msg.HasField("repetition_penalty") else d.repetition_penalty
        ),
        seed=msg.seed if msg.HasField("seed") else None,
        stop=list(msg.stop),
        stop_token_ids=list(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        n=msg.n if msg.HasField("n") else d.n,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        presence_penalty=(
            msg.presence_penalty if msg.HasField("presence_penalty") else d.presence_penalty
        ),
        frequency_penalty=(
            msg.frequency_penalty if msg.HasField("frequency_penalty") else d.frequency_penalty
        ),
        min_tokens=msg.min_tokens if msg.HasField("min_tokens") else d.min_tokens,
    )


def sampling_to_pb(p: SamplingParams) -> gen_pb.SamplingParams:
    msg = gen_pb.SamplingParams(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        repetition_penalty=p.repetition_penalty,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        n=p.n,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        min_tokens=p.min_tokens,
    )
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    return msg


def logprobs_to_pb(lp: TokenLogprobs) -> gen_pb.TokenLogprobs:
    return gen_pb.TokenLogprobs(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top=[gen_pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
    )


def logprobs_from_pb(msg: gen_pb.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(
        token_id=msg.token_id,
        logprob=msg.logprob,
        top=[(t.token_id, t.logprob) for t in msg.top],
    )


def delta_to_pb(
    request_id: str, d: SampleDelta, prompt_tokens: int, cached_tokens: int
) -> gen_pb.GenerateResponse:
    """One sample's delta; its last message (finish_reason set) carries its usage."""
    msg = gen_pb.GenerateResponse(
        request_id=request_id,
        index=d.index,
        token_ids=d.token_ids,
        text=d.text,
        logprobs=[logprobs_to_pb(lp) for lp in d.logprobs if lp is not None],
        finish_reason=_FINISH_TO_PB[d.finish_reason],
    )
    if d.finish_reason is FinishReason.STOP:
        if isinstance(d.stop_reason, str):
            msg.stop_string = d.stop_reason
        elif isinstance(d.stop_reason, int):
            msg.stop_token_id = d.stop_reason
    if d.finish_reason is not None:
        msg.usage.CopyFrom(usage_to_pb(Usage(prompt_tokens, d.completion_tokens, cached_tokens)))
    return msg


def usage_from_pb(msg: gen_pb.Usage) -> Usage:
    return Usage(msg.prompt_tokens, msg.completion_tokens, msg.cached_tokens)


def usage_to_pb(u: Usage) -> gen_pb.Usage:
    return gen_pb.Usage(
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        cached_tokens=u.cached_tokens,
    )
