"""The prefill role's gRPC servicer: compute a prompt's KV and export it under a lease.

Requests from concurrent calls are batched by the engine (continuous batching), so
many prompts prefill in one forward. A request runs with `prefill_only`: after the
first token of every sample, its blocks stay allocated until they are staged for
export (one copy, see kvtransfer/source.py), then return to the prefix cache at
once. From then on the lease holds the staged copy, not the blocks, so a slow
decode worker never pins this worker's KV pool; a lease nobody pulls expires after
its TTL and is counted.
"""

from __future__ import annotations

import logging
import queue

import grpc

from pagedserve.common.engine import LLMEngine
from pagedserve.common.engine_loop import EngineFailure
from pagedserve.common.protocol import logprobs_to_pb, sampling_from_pb
from pagedserve.common.sampling_params import InvalidRequestError
from pagedserve.common.sequence import FinishReason, Request, SampleDelta
from pagedserve.common.worker import WorkerRuntime
from pagedserve.kvtransfer.handle import KVLayout
from pagedserve.v1 import kvtransfer_pb2, worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)
POLL_S = 0.1  # how often a waiting handler checks that its caller is still there


def wait_first_tokens(stream, context: grpc.ServicerContext) -> dict[int, SampleDelta]:
    """Reads a prefill-only request's stream to its end; aborts the RPC on failure."""
    firsts: dict[int, SampleDelta] = {}
    while not stream.finished:
        if not context.is_active():
            stream.cancel()
            context.abort(grpc.StatusCode.CANCELLED, "the caller went away")
        try:
            out = stream.get(timeout=POLL_S)
        except queue.Empty:
            continue
        except EngineFailure as e:
            context.abort(grpc.StatusCode.INTERNAL, str(e))
        for d in out.samples:
            if d.finish_reason is FinishReason.ABORT:
                context.abort(grpc.StatusCode.CANCELLED, "the request was aborted")
            firsts.setdefault(d.index, d)
    return firsts


class PrefillServicer(worker_pb2_grpc.PrefillServicer):
    def __init__(self, runtime: WorkerRuntime) -> None:
        self.rt = runtime

    def Prefill(self, request, context):  # noqa: N802 (gRPC method name)
        req = request.request
        rid = req.request_id
        params = sampling_from_pb(req.sampling)
        added: list[Request] = []
        try:
            stream = self.rt.loop.submit(
                rid,
                lambda e: added.append(
                    e.add_request(
                        rid,
                        prompt_token_ids=list(req.prompt_token_ids),
                        params=params,
                        cache_salt=req.cache_salt or None,
                        prefill_only=True,
                    )
                ),
            )
        except InvalidRequestError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            firsts = wait_first_tokens(stream, context)
            held = self.rt.loop.call(lambda e: _held(e, rid))
            handle = kvtransfer_pb2.KVHandle()
            if held is not None:
                table, _hashes, num_tokens, states = held
                ttl = request.lease_ttl_ms / 1000 if request.HasField("lease_ttl_ms") else None
                exported = self.rt.kv_source.export(
                    self.rt.engine.kv_cache.kv,
                    table,
                    num_tokens=num_tokens,
                    request_id=rid,
                    ttl_s=ttl,
                )
                handle = exported.to_proto()
                handle.block_hashes.extend(_hashes)
            else:
                states = {}
                handle.layout.CopyFrom(_layout_pb(KVLayout.of_cache(self.rt.engine.kv_cache.kv)))
                handle.host_id = self.rt.host_id
        finally:
            self.rt.loop.call(lambda e: e.release_held(rid))
        handle.worker_id = self.rt.config.worker_id
        handle.transfer_address = self.rt.address
        handle.cached_tokens = added[0].num_cached_tokens
        for index in sorted(firsts):
            d = firsts[index]
            tok = kvtransfer_pb2.SampledToken(token_id=d.token_ids[0])
            if d.logprobs and d.logprobs[0] is not None:
                tok.logprobs.CopyFrom(logprobs_to_pb(d.logprobs[0]))
            if index in states:
                tok.generator_state = states[index]
            handle.first_tokens.append(tok)
        return handle

    def ReleaseLease(self, request, context):  # noqa: N802
        return worker_pb2.ReleaseLeaseResponse(released=self.rt.kv_source.release(request.lease_id))


def _held(engine: LLMEngine, rid: str):
    """(block table, hashes, tokens, generator states) of a held request, or None."""
    if rid not in engine.held:
        return None
    table, hashes, n = engine.held_blocks(rid)
    states = {
        s.index: bytes(s.generator.get_state().numpy().tobytes())
        for s in engine.held[rid]
        if s.generator is not None
    }
    return table, hashes, n, states


def _layout_pb(lay: KVLayout) -> kvtransfer_pb2.KVLayout:
    return kvtransfer_pb2.KVLayout(
        num_layers=lay.num_layers,
        block_size=lay.block_size,
        num_kv_heads=lay.num_kv_heads,
        head_dim=lay.head_dim,
        dtype=lay.dtype_name,
    )
