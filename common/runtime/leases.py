"""Ending an exporter's KV lease early: the one ReleaseLease call, and the workers' releaser.

A lease holds an exporter's staged copy of a prompt's K/V until it is pulled and
released, or until its TTL. Two parties end leases early: a decode worker once its
pull is over (or will never happen), through `LeaseReleaser`, on a few threads of
its own; and the router, for a handle nobody will pull, on its asyncio loop. Both
send `release_lease`, so the RPC, its message and its deadline are written once.

Best effort everywhere: a lease nobody releases expires after its TTL, and
ReleaseLease is idempotent (`released` is False when it had ended already).

Torch-free (grpc and the generated stubs only; the channel cache is passed in), so
the router imports it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Awaitable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Protocol

import grpc

from pagedserve.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)
# A deadline on every release, so that a peer that never answers cannot hold a thread.
DEFAULT_RELEASE_TIMEOUT_S = 5.0


def release_lease(
    channel: grpc.Channel | grpc.aio.Channel, lease_id: str, timeout_s: float
) -> worker_pb2.ReleaseLeaseResponse | Awaitable[worker_pb2.ReleaseLeaseResponse]:
    """Asks the exporter behind `channel` to end `lease_id`, with a deadline.

    On a grpc channel: the response (raises grpc.RpcError); on a grpc.aio channel: an
    awaitable of it (raises grpc.aio.AioRpcError)."""
    return worker_pb2_grpc.PrefillStub(channel).ReleaseLease(
        worker_pb2.ReleaseLeaseRequest(lease_id=lease_id), timeout=timeout_s
    )


class Channels(Protocol):
    """Where the releaser gets its channels (kvtransfer's ChannelCache)."""

    def use(self, address: str) -> AbstractContextManager[grpc.Channel]: ...

    def close(self) -> None: ...


class LeaseReleaser:
    """Sends ReleaseLease to exporters off the request path, on a few shared threads.

    Every call has a deadline, so a hung exporter costs one thread for `timeout_s` at
    most, and at most `max_pending` releases wait; beyond that they are dropped
    (logged) rather than queued without bound. The releaser owns `channels` (an LRU
    `ChannelCache`) and closes it with itself.
    """

    def __init__(
        self,
        channels: Channels,
        *,
        timeout_s: float = DEFAULT_RELEASE_TIMEOUT_S,
        max_threads: int = 4,
        max_pending: int = 1024,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.max_pending = max_pending
        self.channels = channels
        self._executor = ThreadPoolExecutor(max_threads, thread_name_prefix="release-lease")
        self._pending = 0
        self._lock = threading.Lock()

    def release(self, address: str, lease_id: str) -> Future[grpc.StatusCode]:
        """Asks `address` to end `lease_id`; the future holds the call's status code."""
        with self._lock:
            if self._pending >= self.max_pending:
                logger.warning("dropping release of lease %s: too many pending", lease_id)
                done: Future[grpc.StatusCode] = Future()
                done.set_result(grpc.StatusCode.RESOURCE_EXHAUSTED)
                return done
            self._pending += 1
        try:
            return self._executor.submit(self._release, address, lease_id)
        except RuntimeError:  # closed: the worker is shutting down
            with self._lock:
                self._pending -= 1
            done = Future()
            done.set_result(grpc.StatusCode.CANCELLED)
            return done

    def _release(self, address: str, lease_id: str) -> grpc.StatusCode:
        try:
            with self.channels.use(address) as channel:
                release_lease(channel, lease_id, self.timeout_s)
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            logger.info("releasing lease %s at %s failed: %s", lease_id, address, e.code())
            return e.code()
        except ValueError as e:  # the channel was closed under us (shutdown)
            logger.info("releasing lease %s at %s failed: %s", lease_id, address, e)
            return grpc.StatusCode.CANCELLED
        finally:
            with self._lock:
                self._pending -= 1

    @property
    def pending(self) -> int:
        """Releases asked for and not ended yet (0: every one asked for has been sent)."""
        with self._lock:
            return self._pending

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.channels.close()
