"""What a puller needs to know about exported blocks, and which machine it is on.

`ExportedKV` is the transfer-relevant part of the `pagedserve.v1.KVHandle` message
(the rest, first tokens, block hashes, cached tokens, worker id, is the prefill
worker's to fill in); `to_proto` / `from_proto` convert.
"""

from __future__ import annotations

import functools
import socket
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from pagedserve.kvtransfer.wire import DTYPE_CODES

if TYPE_CHECKING:
    from pagedserve.v1 import kvtransfer_pb2


@functools.cache
def local_host_id() -> str:
    """This machine's id: hostname + kernel boot id.

    Two processes with the same host id see the same /dev/shm (in practice: same
    machine, same boot). A container with its own hostname gets its own id and
    falls back to gRPC, which is the safe direction to be wrong in.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{socket.gethostname()}/{boot}"


@dataclass(frozen=True)
class KVLayout:
    """Shape and dtype of one block: [num_layers, 2, block_size, num_kv_heads, head_dim]."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of_cache(cls, kv: torch.Tensor) -> KVLayout:
        """The layout of a block-major cache tensor [num_blocks, num_layers, 2, bs, kvh, d]."""
        if kv.ndim != 6 or kv.shape[2] != 2:
            raise ValueError(
                f"kv must be [num_blocks, L, 2, block_size, kvh, head_dim], got {tuple(kv.shape)}"
            )
        _, L, _, bs, kvh, hd = kv.shape
        return cls(L, bs, kvh, hd, kv.dtype)

    @property
    def unit_shape(self) -> tuple[int, int, int]:
        return (self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """'float16' -> torch.float16, for the dtypes the wire format carries."""
    for dtype in DTYPE_CODES:
        if str(dtype).removeprefix("torch.") == name:
            return dtype
    raise ValueError(
        f"unknown KV dtype {name!r}: expected one of {[str(d)[6:] for d in DTYPE_CODES]}"
    )


@dataclass(frozen=True)
class ExportedKV:
    """A block set exported under a lease: where it is and what it holds."""

    lease_id: str
    request_id: str
    host_id: str  # the exporter's machine (local_host_id() there)
    transfer_address: str  # host:port of the exporter's KVTransfer service ("" if none yet)
    shm_name: str  # /dev/shm segment with the staged copy; "" when staged privately
    block_ids: tuple[int, ...]  # the exporter's block ids, in sequence order
    num_tokens: int
    layout: KVLayout
    expires_unix_ms: int  # wall clock, so it means the same on every host
    # The exporter's own knowledge, not on the wire (from_proto leaves it False): the
    # lease's blocks are read in place from the exporter's cache, which must keep them
    # pinned until the lease ends (KVSource.export's `on_end` says when).
    in_place: bool = False

    def expired(self, now_unix_ms: int | None = None) -> bool:
        now = int(time.time() * 1000) if now_unix_ms is None else now_unix_ms
        return now >= self.expires_unix_ms

    def with_address(self, transfer_address: str) -> ExportedKV:
        return replace(self, transfer_address=transfer_address)

    def to_proto(self) -> kvtransfer_pb2.KVHandle:
        """A KVHandle with the transfer fields set (the caller adds the rest)."""
        from pagedserve.v1 import kvtransfer_pb2

        lay = self.layout
        return kvtransfer_pb2.KVHandle(
            host_id=self.host_id,
            transfer_address=self.transfer_address,
            shm_name=self.shm_name,
            lease_id=self.lease_id,
            lease_expires_unix_ms=self.expires_unix_ms,
            block_ids=self.block_ids,
            num_tokens=self.num_tokens,
            layout=kvtransfer_pb2.KVLayout(
                num_layers=lay.num_layers,
                block_size=lay.block_size,
                num_kv_heads=lay.num_kv_heads,
                head_dim=lay.head_dim,
                dtype=lay.dtype_name,
            ),
        )

    @classmethod
    def from_proto(cls, handle: kvtransfer_pb2.KVHandle, request_id: str = "") -> ExportedKV:
        """The transfer fields of a KVHandle; ValueError if its layout is missing."""
        if not handle.HasField("layout"):
            raise ValueError(f"KVHandle of lease {handle.lease_id!r} has no layout")
        lay = handle.layout
        return cls(
            lease_id=handle.lease_id,
            request_id=request_id,
            host_id=handle.host_id,
            transfer_address=handle.transfer_address,
            shm_name=handle.shm_name,
            block_ids=tuple(handle.block_ids),
            num_tokens=handle.num_tokens,
            layout=KVLayout(
                lay.num_layers,
                lay.block_size,
                lay.num_kv_heads,
                lay.head_dim,
                dtype_from_name(lay.dtype),
            ),
            expires_unix_ms=handle.lease_expires_unix_ms,
        )
