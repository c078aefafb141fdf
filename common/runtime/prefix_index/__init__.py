"""The global prefix-hash index: which worker holds which KV blocks.

- ``base``: the :class:`PrefixIndex` interface, the wire events
  (:class:`IndexEvent`, :class:`EventBatch`), :class:`IndexUnavailableError`.
- ``embedded``: the in-process backend (single machine, no Redis).
- ``redis``: the Redis backend (several router replicas share it). Imported
  lazily by :func:`open_prefix_index`, so nothing here imports ``redis`` unless
  a Redis URL is configured.
- ``publisher``: the worker side: numbers block-manager events, batches them,
  resyncs from the full list when the index asks or comes back.
- ``connection``: the one way to connect to Redis (timeouts, health checks, client
  names) and to read its errors (every ``redis.RedisError`` is an
  :class:`IndexUnavailableError`). Imports ``redis``.
- ``faults``: retry backoff measured from the end of a failed call, rate-limited logs.
- ``worker_registry``: workers' stats in Redis, read by every router replica.
"""

from __future__ import annotations

from typing import Any

from pagedserve.common.runtime.prefix_index.base import (
    HASH_SIZE,
    ApplyResult,
    EventBatch,
    EventKind,
    IndexEvent,
    IndexUnavailableError,
    PrefixIndex,
    WorkerIndexState,
)
from pagedserve.common.runtime.prefix_index.embedded import EmbeddedPrefixIndex
from pagedserve.common.runtime.prefix_index.publisher import IndexPublisher, PublisherStats

__all__ = [
    "HASH_SIZE",
    "ApplyResult",
    "EmbeddedPrefixIndex",
    "EventBatch",
    "EventKind",
    "IndexEvent",
    "IndexPublisher",
    "IndexUnavailableError",
    "PrefixIndex",
    "PublisherStats",
    "WorkerIndexState",
    "open_prefix_index",
]


def open_prefix_index(url: str | None, namespace: str, **options: Any) -> PrefixIndex:
    """The Redis index at ``url``, or an embedded one when ``url`` is None or empty."""
    if not url:
        return EmbeddedPrefixIndex(namespace)
    from pagedserve.common.runtime.prefix_index.redis import RedisPrefixIndex

    return RedisPrefixIndex(url, namespace, **options)
