"""The decode role's gRPC servicer: import a prompt's KV, join the batch, stream tokens.

With a KVHandle the worker allocates the prompt's blocks (its own prefix-cache hits
first), pulls only the missing blocks from the exporter by block table (shared
memory on one host, gRPC chunks across hosts), releases the lease and joins the
continuous batch. Without one it prefills the prompt itself (conditional
disaggregation: short prompts, or no prefill worker available).

A failed import (checksum mismatch, broken stream, expired lease) is handled by
policy: recompute the prompt here (default; the client sees no error) or fail the
request with UNAVAILABLE.
"""

from __future__ import annotations

import logging
import queue

import grpc
import torch

from pagedserve.common.engine import ImportPlan
from pagedserve.common.engine_loop import EngineFailure, RequestStream
from pagedserve.common.protocol import delta_to_pb, logprobs_from_pb, sampling_from_pb
from pagedserve.common.sampling_params import InvalidRequestError
from pagedserve.common.scheduler import QueueFullError
from pagedserve.common.sequence import Request
from pagedserve.common.worker import WorkerRuntime
from pagedserve.kvtransfer.handle import ExportedKV
from pagedserve.kvtransfer.sinks import CacheSink
from pagedserve.kvtransfer.wire import KVTransferError
from pagedserve.prefill_worker.servicer import import_prefix, release_lease
from pagedserve.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)
POLL_S = 0.1  # how often a streaming handler checks that its caller is still there


class DecodeServicer(worker_pb2_grpc.DecodeServicer):
    def __init__(self, runtime: WorkerRuntime) -> None:
        self.rt = runtime

    def Decode(self, request, context):  # noqa: N802 (gRPC method name)
        req = request.request
        rid = req.request_id
        params = sampling_from_pb(req.sampling)
        prompt = list(req.prompt_token_ids)
        salt = req.cache_salt or None
        info = worker_pb2.KVImport(transport="local")
        added: list[Request | ImportPlan] = []
        try:
            if request.HasField("kv"):
                kv = request.kv
                firsts = {i: t.token_id for i, t in enumerate(kv.first_tokens)}
                lps = {
                    i: logprobs_from_pb(t.logprobs)
                    for i, t in enumerate(kv.first_tokens)
                    if t.HasField("logprobs")
                }
                states = {
                    i: torch.frombuffer(bytearray(t.generator_state), dtype=torch.uint8)
                    for i, t in enumerate(kv.first_tokens)
                    if t.generator_state
                }
                stream = self.rt.loop.submit(
                    rid,
                    lambda e: added.append(
                        e.reserve_import(
                            rid,
                            prompt,
                            params,
                            firsts,
                            first_logprobs=lps,
                            generator_states=states,
                            cache_salt=salt,
                            cached_tokens=kv.cached_tokens,
                        )
                    ),
                )
            else:
                if request.HasField("prefix"):
                    import_prefix(self.rt, rid, request.prefix, prompt, req.cache_salt)
                stream = self.rt.loop.submit(
                    rid,
                    lambda e: added.append(
                        e.add_request(rid, prompt_token_ids=prompt, params=params, cache_salt=salt)
                    ),
                )
        except InvalidRequestError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except QueueFullError as e:  # overloaded, not a bad request: the router goes elsewhere
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        context.add_callback(stream.cancel)
        if request.HasField("kv"):
            plan = added[0]
            assert isinstance(plan, ImportPlan)
            info = self._import(rid, request, plan, context)
            cached = request.kv.cached_tokens
        else:
            cached = None  # known once the request is admitted: read at the end
        yield from self._stream(rid, len(prompt), stream, info, context, cached, added)

    def _import(self, rid: str, request, plan: ImportPlan, context) -> worker_pb2.KVImport:
        kv = request.kv
        bs = self.rt.engine.block_manager.block_size
        info = worker_pb2.KVImport(transport="none", reused_blocks=plan.local_hit_tokens // bs)
        try:
            if plan.recompute:
                info.transport, info.recomputed = "local", True
                return info
            if not plan.block_ids:
                return info
            handle = ExportedKV.from_proto(kv, rid)
            wanted = handle.block_ids[plan.first_block : plan.first_block + len(plan.block_ids)]
            sink = CacheSink(self.rt.engine.kv_cache.kv, plan.block_ids)
            result = self.rt.kv_transport.pull_into(
                handle, sink, block_ids=wanted, timeout=context.time_remaining()
            )
            info.transport = result.transport
            info.pulled_blocks = result.num_blocks
            info.pulled_bytes = result.payload_bytes
            self.rt.loop.call(lambda e: e.commit_import(rid))
        except (KVTransferError, ValueError, grpc.RpcError) as exc:
            e = f"{type(exc).__name__}: {exc}"
            fail = request.on_transfer_failure == worker_pb2.TRANSFER_FAILURE_POLICY_FAIL or (
                request.on_transfer_failure == worker_pb2.TRANSFER_FAILURE_POLICY_UNSPECIFIED
                and self.rt.config.transfer_failure_policy == "fail"
            )
            logger.warning(
                "KV import of %s failed (%s): %s", rid, "fail" if fail else "recompute", e
            )
            self.rt.loop.call(lambda eng: eng.cancel_import(rid, recompute=not fail))
            if fail:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"KV import failed: {e}")
            info.transport, info.recomputed, info.error = "local", True, e
        finally:
            if kv.lease_id:
                release_lease(kv.transfer_address, kv.lease_id)
        return info

    def _stream(self, rid, prompt_len, stream: RequestStream, info, context, cached, added):
        first = True
        while not stream.finished:
            if not context.is_active():
                stream.cancel()
                return
            try:
                out = stream.get(timeout=POLL_S)
            except queue.Empty:
                continue
            except EngineFailure as e:
                context.abort(grpc.StatusCode.INTERNAL, str(e))
            for d in out.samples:
                hits = added[0].num_cached_tokens if cached is None else cached
                step = worker_pb2.DecodeStep(response=delta_to_pb(rid, d, prompt_len, hits))
                if first:
                    step.kv_import.CopyFrom(info)
                    first = False
                yield step

    def Abort(self, request, context):  # noqa: N802
        known = self.rt.loop.call(lambda e: request.request_id in e.requests)
        self.rt.loop.abort(request.request_id)
        return worker_pb2.AbortResponse(aborted=known)
