"""The prefill role's gRPC servicer: compute a prompt's KV and export it under a lease.

Requests from concurrent calls are batched by the engine (continuous batching), so
many prompts prefill in one forward. A request runs with `prefill_only`: after the
first token of every sample, its blocks stay allocated until they are exported under
a lease (kvtransfer/source.py), in one of two ways:

- *In place*, the default (WorkerConfig.kv_in_place: this worker's cache is then a
  shared-memory file, CacheConfig.shm_dir): nothing is copied; same-host pullers read
  the blocks out of the cache, and the blocks stay pinned (the lease's pin,
  handoff.lease_pin_id) until the lease ends: released by the puller, expired, ended
  here for a caller that left (`_hand_over`), or at close; KVSource's `on_end` then
  unpins on the engine thread. The pinned bytes are capped
  (WorkerConfig.kv_max_in_place_bytes), so slow pullers hold at most that much of the
  pool; a gRPC puller of such a lease is served from the cache, checksummed per chunk.
- *Staged*, past that cap, with a cache in ordinary memory (kv_transport "grpc", a GPU,
  no room in /dev/shm, kv_in_place=False): one copy into a segment, after which the
  blocks return to the prefix cache at once and the lease holds the copy, so a slow
  decode worker never pins this worker's pool.

A lease nobody pulls expires after its TTL and is counted.
"""

from __future__ import annotations

import logging
import queue
import uuid

import grpc

from pagedserve.common.api.outputs import FinishReason, SampleDelta
from pagedserve.common.api.sampling_params import InvalidRequestError
from pagedserve.common.core.engine_loop import EngineBusy, EngineFailure, RequestFailed
from pagedserve.common.core.handoff import ExportPlan, HandoffCalls, lease_pin_id
from pagedserve.common.core.scheduler import QueueFullError
from pagedserve.common.core.sequence import Request
from pagedserve.common.runtime.protocol import logprobs_to_pb, sampling_from_pb
from pagedserve.common.runtime.servicer_support import failure_status, import_prefix
from pagedserve.common.runtime.worker import WorkerRuntime
from pagedserve.kvtransfer.faults import fault_point
from pagedserve.kvtransfer.source import StagingFullError
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
        except RequestFailed as e:
            context.abort(failure_status(e.error), str(e))
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
        self.handoff = HandoffCalls(runtime.loop, runtime.config.engine_call_timeout_s)

    def Prefill(self, request, context):  # noqa: N802 (gRPC method name)
        fault_point("Prefill", self.rt.config.worker_id, self.rt.address)  # tests: faults.py
        req = request.request
        rid = req.request_id
        params = sampling_from_pb(req.sampling)
        prompt = list(req.prompt_token_ids)
        salt = req.cache_salt or None
        if request.HasField("prefix"):
            import_prefix(self.rt, self.handoff, rid, request.prefix, prompt, salt)
        added: list[Request] = []
        try:
            # A submit that times out is never added, or aborted at once (EngineLoop.call):
            # no prefill-only request is left holding blocks nobody will release.
            stream = self.rt.loop.submit(
                rid,
                lambda e: added.append(
                    e.add_request(
                        rid,
                        prompt_token_ids=prompt,
                        params=params,
                        cache_salt=salt,
                        prefill_only=True,
                    )
                ),
                timeout=self.rt.config.engine_call_timeout_s,
            )
        except InvalidRequestError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineBusy as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"prefill worker busy: {e}")
        except QueueFullError as e:  # overloaded, not a bad request: the router goes elsewhere
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        try:
            firsts = wait_first_tokens(stream, context)
            # The export copies the blocks on this thread: export_begin pins them, so that
            # an abort meanwhile cannot hand them to another sequence before the copy. It
            # also pins them for the lease (an in-place export keeps that pin until the
            # lease ends); a staged or failed export drops it in export_end.
            lease_id = uuid.uuid4().hex
            lease_pin = lease_pin_id(lease_id)
            in_place = False
            plan = self.handoff.export_begin(rid, lease_pin)
            handle = kvtransfer_pb2.KVHandle()
            states = {}  # every sample ended on its first token: nothing to hand over
            if plan is not None:
                exported = self._export(context, plan, rid, request, lease_id, lease_pin)
                in_place = exported.in_place
                handle = exported.to_proto()
                handle.block_hashes.extend(plan.block_hashes)
                states = plan.generator_states
        finally:  # runs even if we time out waiting (a release is wanted late too)
            self.handoff.export_end(rid, unpin=None if in_place else lease_pin)
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
        if handle.lease_id:
            self._hand_over(context, handle.lease_id)
        return handle

    def _hand_over(self, context, lease_id: str) -> None:
        """A caller that went away (cancelled, past its deadline) while we prefilled will
        never see this handle, so nobody would pull or release its lease: end it now
        instead of holding the blocks until the TTL. (A caller that leaves in the instant
        after this check still leaves the lease to its TTL.)"""
        if not context.is_active():
            self.rt.kv_source.release(lease_id)
            context.abort(grpc.StatusCode.CANCELLED, "the caller left before the KV handle")

    def _export(self, context, plan: ExportPlan, rid: str, request, lease_id: str, pin: str):
        """Export the plan's blocks under lease `lease_id` (its TTL from `request`, or the
        worker's); RESOURCE_EXHAUSTED when staging is at its cap. The blocks are pinned
        under `pin`: if the export is in place (the handle says so) that pin must stay
        until the lease ends, when KVSource's on_end drops it; else the caller drops it."""
        ttl = request.lease_ttl_ms / 1000 if request.HasField("lease_ttl_ms") else None
        try:
            return self.rt.kv_source.export(
                self.rt.engine.kv_cache.kv,
                plan.block_ids,
                num_tokens=plan.num_tokens,
                request_id=rid,
                lease_id=lease_id,
                ttl_s=ttl,
                on_end=lambda: self.handoff.unpin_later(pin),
            )
        except StagingFullError as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))

    def ExportPrefix(self, request, context):  # noqa: N802
        """Cross-worker reuse: stage the cached blocks of a prefix for another worker."""
        pin = f"export-{uuid.uuid4().hex}"
        salt = request.cache_salt or None
        try:
            plan = self.handoff.export_prefix_begin(pin, list(request.token_ids), salt)
        except EngineBusy as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"worker busy: {e}")
        if plan is None:
            context.abort(grpc.StatusCode.NOT_FOUND, "no block of this prefix is cached here")
        in_place = False
        try:
            exported = self._export(context, plan, pin, request, uuid.uuid4().hex, pin)
            in_place = exported.in_place  # then the lease's end unpins
        finally:
            if not in_place:
                self.handoff.unpin(pin)
        handle = exported.to_proto()
        handle.worker_id = self.rt.config.worker_id
        handle.transfer_address = self.rt.address
        self._hand_over(context, handle.lease_id)
        return handle

    def ReleaseLease(self, request, context):  # noqa: N802
        return worker_pb2.ReleaseLeaseResponse(released=self.rt.kv_source.release(request.lease_id))
