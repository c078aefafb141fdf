"""What the prefill and the decode servicers share, so that neither role imports
the other: the gRPC status of a request that failed alone, and pulling a prefix's
blocks from another worker into this one's prefix cache.

Releasing an exporter's lease is `WorkerRuntime.lease_releaser.release` (one path,
off the request's thread, with a deadline).

Where a request is checked (the trust boundary, decided here for both roles):

- Converted once per hop, in one place: `protocol.sampling_from_pb` (the servicers
  call nothing else on the sampling message).
- Validated by one set of rules, `SamplingParams.validate` and `validate_prompt`
  (common/api), applied at the client edge by the router's frontend with the
  router's limits: a bad client request is refused there, before any worker.
- The workers are an internal plane: the servicers check nothing of their own and
  trust the router for policy. They do not trust it for safety: the engine's one
  admission (`LLMEngine._admit`, behind `add_request` and
  `handoff.reserve_import`) applies the same rules against the engine's own model
  (vocabulary, max_model_len, max_n) before taking a block, and the hand-off checks
  what only it reads (first tokens, generator states). A message the router did
  not check (another router version or limits, a direct internal client, a bug)
  thus ends as INVALID_ARGUMENT for that request alone, never as a crash of the
  batch (a token id past the vocabulary would fail the forward of every request in
  it). The cost is a few comparisons per request; the offline `LLM` gets the same
  guarantee from the same code.
- KV handles (a Decode's `kv`, any `prefix`) name where to pull from, so they are
  checked on arrival by kvtransfer/validate.py (names, counts, first tokens, and an
  exporter this worker trusts, common/runtime/peers.py) before anything is reserved,
  opened or dialed; a lease is released only at a trusted address.
"""

from __future__ import annotations

import logging

import grpc

from pagedserve.common.api.outputs import ErrorKind, RequestError
from pagedserve.common.core.engine_loop import EngineBusy
from pagedserve.common.core.handoff import HandoffCalls
from pagedserve.common.runtime.worker import WorkerRuntime
from pagedserve.kvtransfer.handle import ExportedKV
from pagedserve.kvtransfer.segment import check_lease_id
from pagedserve.kvtransfer.sinks import CacheSink
from pagedserve.kvtransfer.validate import HandleError, check_prefix_handle
from pagedserve.kvtransfer.wire import KVTransferError
from pagedserve.v1 import kvtransfer_pb2

logger = logging.getLogger(__name__)

_FAILURE_STATUS = {
    ErrorKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}


def failure_status(error: RequestError) -> grpc.StatusCode:
    """The status of a request that failed alone: INVALID_ARGUMENT when its own
    parameters caused it, INTERNAL otherwise (the message says which and why)."""
    return _FAILURE_STATUS[error.kind]


def import_prefix(
    rt: WorkerRuntime,
    handoff: HandoffCalls,
    rid: str,
    prefix: kvtransfer_pb2.KVHandle,
    prompt: list[int],
    salt: str | None,
) -> int:
    """Pulls another worker's blocks of the prompt's prefix into this worker's prefix cache.

    Best effort: on any failure the blocks are simply computed here. Returns the
    blocks pulled. The exporter's lease is released either way, if it is trusted. The
    pull has a deadline (kv_pull_timeout_s): a hung exporter cannot hold the pinned
    blocks. A handle that breaks kvtransfer/validate.py's rules, or names an exporter
    this worker does not trust, is not pulled at all (nothing reserved, opened or
    dialed); the decode role refuses such a call before it gets here.
    """
    try:
        check_prefix_handle(
            prefix, prompt_len=len(prompt), limits=rt.import_limits, trusted=rt.peers.trusts
        )
    except HandleError as e:
        logger.warning("prefix handle for %s refused, computing it here: %s", rid, e)
        release_if_trusted(rt, prefix)
        return 0
    pin = f"{rid}#prefix"
    try:
        handle = ExportedKV.from_proto(prefix, rid)
        plan = handoff.reserve_prefix_import(pin, prompt[: handle.num_tokens], salt)
        if not plan.block_ids:  # nothing to pull, so nothing was pinned
            return 0
        wanted = handle.block_ids[plan.first_block : plan.first_block + len(plan.block_ids)]
        try:
            rt.kv_transport.pull_into(
                handle,
                CacheSink(rt.engine.kv_cache.kv, plan.block_ids),
                block_ids=wanted,
                timeout=rt.config.kv_pull_timeout_s,
            )
        except BaseException:
            handoff.unpin(pin)  # nothing is cached
            raise
        handoff.commit_prefix_import(pin)
        return len(plan.block_ids)
    except (KVTransferError, ValueError, grpc.RpcError, EngineBusy) as e:
        logger.warning("prefix pull for %s failed, computing it here: %s", rid, e)
        return 0
    finally:
        release_if_trusted(rt, prefix)


def release_if_trusted(rt: WorkerRuntime, handle: kvtransfer_pb2.KVHandle) -> None:
    """Ends a handle's lease at its exporter, only if that is an address this worker
    trusts (common/runtime/peers.py): a forged handle never makes it dial anywhere."""
    try:
        check_lease_id(handle.lease_id)
    except ValueError:
        return
    if rt.peers.trusted_now(handle.transfer_address):
        rt.lease_releaser.release(handle.transfer_address, handle.lease_id)
