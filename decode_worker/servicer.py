"""The decode role's gRPC servicer: import a prompt's KV, join the batch, stream tokens.

With a KVHandle the worker allocates the prompt's blocks (its own prefix-cache hits
first), pulls only the missing blocks from the exporter by block table (shared
memory on one host, gRPC chunks across hosts), releases the lease and joins the
continuous batch. Without one it prefills the prompt itself (conditional
disaggregation: short prompts, or no prefill worker available).

The pull writes into this engine's blocks from the handler thread, so a cancel,
deadline or Abort during it must not free them: the engine keeps them pinned until
the handler commits or cancels the import (common/core/handoff.py); the cancel only
aborts the request on the engine thread and stops the pull at the next chunk.

A failed import (checksum mismatch, broken stream, expired lease) is handled by
policy: recompute the prompt here (default; the client sees no error) or fail the
request with UNAVAILABLE.

A handle is checked first (kvtransfer/validate.py), before the engine reserves a
block, a segment is opened or its address dialed: one that breaks the rules (names,
counts, first tokens, layout) is refused INVALID_ARGUMENT, one from an exporter this
worker does not trust (common/runtime/peers.py) FAILED_PRECONDITION. Not recomputed:
a handle the router did not produce is a bug or an attack, and either way the caller
should hear of it. Its lease is released only at a trusted address.
"""

from __future__ import annotations

import logging
import queue
import threading

import grpc
import torch

from pagedserve.common.api.sampling_params import InvalidRequestError
from pagedserve.common.core.engine_loop import (
    EngineBusy,
    EngineFailure,
    RequestFailed,
    RequestStream,
)
from pagedserve.common.core.handoff import HandedOver, HandoffCalls, ImportPlan
from pagedserve.common.core.scheduler import QueueFullError
from pagedserve.common.core.sequence import Request
from pagedserve.common.runtime.protocol import delta_to_pb, logprobs_from_pb, sampling_from_pb
from pagedserve.common.runtime.servicer_support import (
    failure_status,
    import_prefix,
    release_if_trusted,
)
from pagedserve.common.runtime.worker import WorkerRuntime
from pagedserve.kvtransfer.faults import fault_point
from pagedserve.kvtransfer.handle import ExportedKV
from pagedserve.kvtransfer.sinks import CacheSink
from pagedserve.kvtransfer.validate import (
    HandleError,
    UntrustedSourceError,
    check_handle,
    check_prefix_handle,
)
from pagedserve.kvtransfer.wire import (
    ChunkHeader,
    KVSink,
    KVTransferError,
    TransferCancelled,
    tensor_view,
)
from pagedserve.v1 import kvtransfer_pb2, worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)
POLL_S = 0.1  # how often a streaming handler checks that its caller is still there


class DecodeServicer(worker_pb2_grpc.DecodeServicer):
    def __init__(self, runtime: WorkerRuntime) -> None:
        self.rt = runtime
        self.handoff = HandoffCalls(runtime.loop, runtime.config.engine_call_timeout_s)

    def Decode(self, request, context):  # noqa: N802 (gRPC method name)
        fault_point("Decode", self.rt.config.worker_id, self.rt.address)  # tests: faults.py
        req = request.request
        rid = req.request_id
        params = sampling_from_pb(req.sampling)
        prompt = list(req.prompt_token_ids)
        salt = req.cache_salt or None
        info = worker_pb2.KVImport(transport="local")
        added: list[Request] = []
        plan: ImportPlan | None = None
        timeout = self.rt.config.engine_call_timeout_s
        self._check_handles(request, len(prompt), params.n, context)
        try:
            if request.HasField("kv"):
                kv = request.kv
                stream, plan = self.handoff.reserve_import(
                    rid, prompt, params, handed_over_from_pb(kv), salt
                )
            else:
                if request.HasField("prefix"):
                    import_prefix(self.rt, self.handoff, rid, request.prefix, prompt, salt)
                stream = self.rt.loop.submit(
                    rid,
                    lambda e: added.append(
                        e.add_request(rid, prompt_token_ids=prompt, params=params, cache_salt=salt)
                    ),
                    timeout=timeout,
                )
        except (InvalidRequestError, EngineBusy, QueueFullError) as e:
            if request.HasField("kv"):  # no import will pull it
                release_if_trusted(self.rt, request.kv)
            if isinstance(e, EngineBusy):
                context.abort(grpc.StatusCode.UNAVAILABLE, f"decode worker busy: {e}")
            if isinstance(e, QueueFullError):  # overloaded: the router goes elsewhere
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        cancelled = threading.Event()

        def on_rpc_end() -> None:
            # On gRPC's thread. The abort itself runs on the engine thread, which owns
            # the blocks; during an import it leaves them pinned until `_import` is done
            # writing (handoff.reserve_import), and `cancelled` stops the pull at the next
            # chunk.
            cancelled.set()
            stream.cancel()

        if not context.add_callback(on_rpc_end):  # the RPC already ended
            on_rpc_end()
        if plan is not None:
            info = self._import(rid, request, plan, context, cancelled)
            cached = request.kv.cached_tokens
        else:
            cached = None  # known once the request is admitted: read at the end
        yield from self._stream(rid, len(prompt), stream, info, context, cached, added)

    def _check_handles(self, request, prompt_len: int, n: int, context) -> None:
        """Refuses (aborts the call) a KV or prefix handle that breaks validate.py's rules.

        The prefix handle is read only without `kv` (as Decode uses it)."""
        trusted = self.rt.peers.trusts
        handle = request.kv if request.HasField("kv") else None
        try:
            if handle is not None:
                check_handle(
                    handle,
                    prompt_len=prompt_len,
                    num_samples=n,
                    limits=self.rt.import_limits,
                    trusted=trusted,
                )
            elif request.HasField("prefix"):
                handle = request.prefix
                check_prefix_handle(
                    handle, prompt_len=prompt_len, limits=self.rt.import_limits, trusted=trusted
                )
        except HandleError as e:
            assert handle is not None
            release_if_trusted(self.rt, handle)
            untrusted = isinstance(e, UntrustedSourceError)
            code = (
                grpc.StatusCode.FAILED_PRECONDITION
                if untrusted
                else grpc.StatusCode.INVALID_ARGUMENT
            )
            logger.warning("KV handle of %s refused: %s", request.request.request_id, e)
            context.abort(code, str(e))

    def _import(
        self, rid: str, request, plan: ImportPlan, context, cancelled: threading.Event
    ) -> worker_pb2.KVImport:
        """Pulls the plan's blocks, then commits (or cancels) the import on the engine thread.

        Every path ends the import with commit_import or cancel_import: they release the
        pin that keeps the blocks from being reused while this thread writes them.
        """
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
            sink = StopOnCancel(CacheSink(self.rt.engine.kv_cache.kv, plan.block_ids), cancelled)
            deadline = min(context.time_remaining(), self.rt.config.kv_pull_timeout_s)
            try:
                result = self.rt.kv_transport.pull_into(
                    handle, sink, block_ids=wanted, timeout=deadline
                )
            except BaseException as exc:
                if not isinstance(exc, (KVTransferError, ValueError, grpc.RpcError)):
                    self.handoff.cancel_import(rid, recompute=False)
                raise
            info.transport = result.transport
            info.pulled_blocks = result.num_blocks
            info.pulled_bytes = result.payload_bytes
            self.handoff.commit_import(rid)
        except (KVTransferError, ValueError, grpc.RpcError) as exc:
            e = f"{type(exc).__name__}: {exc}"
            fail = request.on_transfer_failure == worker_pb2.TRANSFER_FAILURE_POLICY_FAIL or (
                request.on_transfer_failure == worker_pb2.TRANSFER_FAILURE_POLICY_UNSPECIFIED
                and self.rt.config.transfer_failure_policy == "fail"
            )
            if cancelled.is_set():
                logger.info("KV import of %s stopped: the request ended (%s)", rid, e)
            else:
                logger.warning(
                    "KV import of %s failed (%s): %s", rid, "fail" if fail else "recompute", e
                )
            self.handoff.cancel_import(rid, recompute=not fail)
            if fail:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"KV import failed: {e}")
            info.transport, info.recomputed, info.error = "local", True, e
        finally:
            release_if_trusted(self.rt, kv)
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
            except RequestFailed as e:  # this request alone: its parameters, or INTERNAL
                context.abort(failure_status(e.error), str(e))
            except EngineFailure as e:
                context.abort(grpc.StatusCode.INTERNAL, str(e))
            for d in out.samples:
                hits = added[0].num_cached_tokens if cached is None else cached
                step = worker_pb2.DecodeStep(response=delta_to_pb(rid, d, prompt_len, hits))
                if first:
                    step.kv_import.CopyFrom(info)
                    first = False
                fault_point("Decode.step", self.rt.config.worker_id, self.rt.address)  # tests
                yield step

    def Abort(self, request, context):  # noqa: N802
        # Safe during an import: the blocks stay pinned until `_import` is done writing.
        known = self.rt.loop.call(
            lambda e: request.request_id in e.requests, self.rt.config.engine_call_timeout_s
        )
        self.rt.loop.abort(request.request_id)
        return worker_pb2.AbortResponse(aborted=known)


class StopOnCancel:
    """A sink that refuses further chunks once its request ended (a chunk-boundary stop).

    Stops a pull whose request was cancelled or timed out early; the blocks are not
    freed until the pull returned (see DecodeServicer._import), whatever this does.
    """

    def __init__(self, sink: KVSink, cancelled: threading.Event) -> None:
        self.sink = sink
        self.cancelled = cancelled

    def bind(self, header: ChunkHeader) -> None:
        self._check()
        self.sink.bind(header)
        self._header = header

    def write_units(self, unit_start: int, data: torch.Tensor) -> None:
        self._check()
        self.sink.write_units(unit_start, data)

    def write_unit_bytes(self, unit_start: int, count: int, buf: memoryview) -> None:
        """Forwards a gRPC chunk's raw bytes (KVSink in kvtransfer/wire.py), as a tensor
        view when the wrapped sink takes tensors only."""
        self._check()
        write = getattr(self.sink, "write_unit_bytes", None)
        if write is not None:
            write(unit_start, count, buf)
            return
        h = self._header
        self.sink.write_units(unit_start, tensor_view(buf, h.dtype, (count, *h.unit_shape)))

    def _check(self) -> None:
        if self.cancelled.is_set():
            raise TransferCancelled("the request ended (cancelled or past its deadline)")


def handed_over_from_pb(kv: kvtransfer_pb2.KVHandle) -> HandedOver:
    """What the prefill role handed over besides the K/V, read off its KVHandle."""
    firsts = list(enumerate(kv.first_tokens))
    return HandedOver(
        first_tokens={i: t.token_id for i, t in firsts},
        first_logprobs={
            i: logprobs_from_pb(t.logprobs) for i, t in firsts if t.HasField("logprobs")
        },
        generator_states={i: t.generator_state for i, t in firsts if t.generator_state},
        cached_tokens=kv.cached_tokens,
    )
