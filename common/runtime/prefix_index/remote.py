"""The publishing half of a PrefixIndex, over gRPC to the router's embedded index
(served on the router's internal listener, never its public port).

Workers run in other processes (Ray actors) than the router that holds the embedded
index; this client lets their IndexPublisher call `apply`, `resync`, `heartbeat`
and `remove_worker` there exactly as it would on Redis. Matching is the router's
job, so the read side (`match`, `workers`, ...) is not offered here.

An edge module (gRPC): the engine core never imports it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import grpc

from pagedserve.common.runtime.prefix_index.base import (
    ApplyResult,
    EventBatch,
    IndexUnavailableError,
    PrefixIndex,
    WorkerIndexState,
)
from pagedserve.common.runtime.tls import channel
from pagedserve.v1 import index_pb2, index_pb2_grpc

RESULT_CODES = {r: i for i, r in enumerate(ApplyResult)}  # wire code <-> ApplyResult
RESULTS_BY_CODE = dict(enumerate(ApplyResult))


class RemotePrefixIndex(PrefixIndex):
    def __init__(
        self,
        address: str,
        timeout_s: float = 2.0,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        """address: the router's internal listener; credentials: its mutual TLS
        (common/runtime/tls.py internal_channel_credentials), None = plaintext."""
        self.address = address
        self.timeout_s = timeout_s
        self._channel = channel(address, credentials)
        self._stub = index_pb2_grpc.PrefixIndexStub(self._channel)

    def _call(self, method, request):
        try:
            return method(request, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise IndexUnavailableError(
                f"prefix index at {self.address} unreachable: {e.code().name}"
            ) from e

    def apply(self, batch: EventBatch) -> ApplyResult:
        return self.apply_many([batch])[0]

    def apply_many(self, batches: Sequence[EventBatch]) -> list[ApplyResult]:
        req = index_pb2.IndexApplyRequest(batches=[b.to_bytes() for b in batches])
        resp = self._call(self._stub.Apply, req)
        return [RESULTS_BY_CODE[c] for c in resp.results]

    def resync(self, worker_id: str, block_hashes: Iterable[bytes], next_seq: int) -> None:
        req = index_pb2.IndexResyncRequest(
            worker_id=worker_id, block_hashes=list(block_hashes), next_seq=next_seq
        )
        self._call(self._stub.Resync, req)

    def heartbeat(self, worker_id: str, ttl_s: float) -> bool:
        req = index_pb2.IndexHeartbeatRequest(worker_id=worker_id, ttl_s=ttl_s)
        return self._call(self._stub.Heartbeat, req).resync_needed

    def remove_worker(self, worker_id: str) -> None:
        self._call(self._stub.RemoveWorker, index_pb2.IndexRemoveWorkerRequest(worker_id=worker_id))

    def _read_side(self, *_args: object) -> None:
        raise NotImplementedError(
            "RemotePrefixIndex only publishes; match on the router's index instead"
        )

    def match(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        self._read_side()
        return {}

    def workers(self) -> list[str]:
        self._read_side()
        return []

    def reap(self) -> list[str]:
        self._read_side()
        return []

    def worker_hashes(self, worker_id: str) -> set[bytes]:
        self._read_side()
        return set()

    def worker_state(self, worker_id: str) -> WorkerIndexState | None:
        self._read_side()
        return None

    def close(self) -> None:
        self._channel.close()


class PrefixIndexServicer(index_pb2_grpc.PrefixIndexServicer):
    """Serves an in-process index (the router's embedded one) to remote publishers.

    Async methods: the router runs grpc.aio; the embedded index is in-memory and fast.
    """

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index

    async def Apply(self, request, context):  # noqa: N802 (gRPC method name)
        try:
            batches = [EventBatch.from_bytes(b) for b in request.batches]
        except (ValueError, TypeError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad event batch: {e}")
        results = self.index.apply_many(batches)
        return index_pb2.IndexApplyResponse(results=[RESULT_CODES[r] for r in results])

    async def Resync(self, request, context):  # noqa: N802
        self.index.resync(request.worker_id, list(request.block_hashes), request.next_seq)
        return index_pb2.IndexResyncResponse()

    async def Heartbeat(self, request, context):  # noqa: N802
        need = self.index.heartbeat(request.worker_id, request.ttl_s)
        return index_pb2.IndexHeartbeatResponse(resync_needed=need)

    async def RemoveWorker(self, request, context):  # noqa: N802
        self.index.remove_worker(request.worker_id)
        return index_pb2.IndexRemoveWorkerResponse()
