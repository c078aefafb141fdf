"""A KV handle from a caller, checked before anything is reserved, opened or dialed.

A decode worker's Decode call (and a Prefill's or Decode's `prefix`) carries a
`pagedserve.v1.KVHandle` that names where to pull KV from and what it holds. Whoever
can reach the worker writes it, so everything in it is checked here, in one place,
before the engine reserves a block, a file under the shm dir is opened or an address
is dialed (ReleaseLease included):

- the source: `transfer_address` must be one this worker trusts (its own, a
  registered live worker of its model, a configured peer: the caller's `trusted`),
  else `UntrustedSourceError` (gRPC FAILED_PRECONDITION). Checked last: it may wait
  for a fresh peer list from the registry.
- the names: `lease_id` and `shm_name` follow the exporter's naming rule
  (segment.check_segment_name), so no path separator, "..", or foreign file.
- the counts: the layout is this worker's; `num_tokens` is the prompt's (a prefix:
  whole blocks of it); exactly ceil(num_tokens / block_size) distinct block ids; at
  most one block hash per full block.
- the first tokens: one per sample (`n`), each inside the vocabulary (a token id
  past it would fail the forward of every request in the batch).

Everything else raises `HandleError` (gRPC INVALID_ARGUMENT). A handle without a lease
(every sample ended on its first token at the prefill worker) pulls nothing, so it
may name no blocks and its address is not checked: nothing is dialed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.kvtransfer.handle import KVLayout
from pagedserve.kvtransfer.segment import check_lease_id, check_segment_name
from pagedserve.v1 import kvtransfer_pb2


class HandleError(Exception):
    """A KV handle this worker will not import from (INVALID_ARGUMENT)."""


class UntrustedSourceError(HandleError):
    """A KV handle naming an exporter this worker does not trust (FAILED_PRECONDITION)."""


@dataclass(frozen=True)
class ImportLimits:
    """What this worker can import: its cache layout, its vocabulary, its model."""

    layout: KVLayout
    vocab_size: int
    model: str  # the engine's model id, named in refusals


def check_handle(
    handle: kvtransfer_pb2.KVHandle,
    *,
    prompt_len: int,
    num_samples: int,
    limits: ImportLimits,
    trusted: Callable[[str], bool],
) -> None:
    """The KV handle of a Decode call for a prompt of `prompt_len` tokens and `n` samples."""
    _check_first_tokens(handle, num_samples, limits.vocab_size)
    if not handle.lease_id:
        if handle.block_ids or handle.shm_name or handle.num_tokens or handle.block_hashes:
            raise HandleError(
                f"KV handle without a lease names {len(handle.block_ids)} blocks, "
                f"{handle.num_tokens} tokens and segment {handle.shm_name[:80]!r}: "
                "nothing can be pulled without a lease"
            )
        return
    if handle.num_tokens != prompt_len:
        raise HandleError(
            f"KV handle holds {handle.num_tokens} tokens, the request's prompt has {prompt_len}"
        )
    _check_leased(handle, limits, trusted)


def check_prefix_handle(
    handle: kvtransfer_pb2.KVHandle,
    *,
    prompt_len: int,
    limits: ImportLimits,
    trusted: Callable[[str], bool],
) -> None:
    """A `prefix` handle (ExportPrefix's answer): whole blocks of the prompt's head."""
    if handle.first_tokens:
        raise HandleError(
            f"a prefix handle carries no first tokens, got {len(handle.first_tokens)}"
        )
    if not handle.lease_id:
        raise HandleError("a prefix handle needs a lease id")
    bs = limits.layout.block_size
    if not 0 < handle.num_tokens <= prompt_len or handle.num_tokens % bs:
        raise HandleError(
            f"prefix handle holds {handle.num_tokens} tokens: expected whole blocks of "
            f"{bs} tokens, at most the prompt's {prompt_len}"
        )
    _check_leased(handle, limits, trusted)


def _check_first_tokens(handle: kvtransfer_pb2.KVHandle, num_samples: int, vocab_size: int) -> None:
    if len(handle.first_tokens) != num_samples:
        raise HandleError(
            f"KV handle carries {len(handle.first_tokens)} first tokens, the request has "
            f"n={num_samples} samples: expected one per sample"
        )
    bad = [(i, t.token_id) for i, t in enumerate(handle.first_tokens) if t.token_id >= vocab_size]
    if bad:
        i, token = bad[0]
        raise HandleError(
            f"first token of sample {i} is {token}, outside the vocabulary [0, {vocab_size})"
        )


def _check_leased(
    handle: kvtransfer_pb2.KVHandle, limits: ImportLimits, trusted: Callable[[str], bool]
) -> None:
    """Names, layout and counts of a handle with a lease, then its source."""
    try:
        check_lease_id(handle.lease_id)
        if handle.shm_name:
            check_segment_name(handle.shm_name, handle.lease_id)
    except ValueError as e:
        raise HandleError(f"KV handle refused: {e}") from None
    _check_layout(handle, limits.layout)
    bs = limits.layout.block_size
    blocks = -(-handle.num_tokens // bs)
    if len(handle.block_ids) != blocks:
        raise HandleError(
            f"KV handle names {len(handle.block_ids)} blocks for {handle.num_tokens} tokens: "
            f"expected ceil({handle.num_tokens} / {bs}) = {blocks}"
        )
    if len(set(handle.block_ids)) != len(handle.block_ids):
        raise HandleError("KV handle names a block id twice")
    if len(handle.block_hashes) > handle.num_tokens // bs:
        raise HandleError(
            f"KV handle has {len(handle.block_hashes)} block hashes for "
            f"{handle.num_tokens // bs} full blocks"
        )
    _check_source(handle.transfer_address, limits.model, trusted)


def _check_layout(handle: kvtransfer_pb2.KVHandle, mine: KVLayout) -> None:
    if not handle.HasField("layout"):
        raise HandleError(f"KV handle of lease {handle.lease_id!r} has no layout")
    lay = handle.layout
    theirs = (lay.num_layers, lay.block_size, lay.num_kv_heads, lay.head_dim, lay.dtype)
    ours = (mine.num_layers, mine.block_size, mine.num_kv_heads, mine.head_dim, mine.dtype_name)
    if theirs != ours:
        names = "(layers, block_size, kv_heads, head_dim, dtype)"
        raise HandleError(
            f"KV handle's blocks are {names} = {_short(theirs)}, this worker's are {ours}"
        )


def _check_source(address: str, model: str, trusted: Callable[[str], bool]) -> None:
    if not address or not trusted(address):
        raise UntrustedSourceError(
            f"KV handle names transfer address {address[:120]!r}, which is not a registered "
            f"live worker of model {model!r} (nor this worker or a configured peer): not "
            "pulled"
        )


def _short(values: tuple) -> tuple:
    return tuple(v[:40] if isinstance(v, str) else v for v in values)
