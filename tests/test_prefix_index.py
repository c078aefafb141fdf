"""The prefix index: one suite over the embedded and the Redis backend (real redis-server).

Backend-specific tests (one round trip, shared view of two router replicas,
outage and restart, URLs with ACL users and TLS) follow the shared suite.
"""

from __future__ import annotations

import hashlib
import random
import subprocess
import sys
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import pytest
import redis

from pagedserve.common.runtime.prefix_index import (
    HASH_SIZE,
    ApplyResult,
    EmbeddedPrefixIndex,
    EventBatch,
    EventKind,
    IndexEvent,
    IndexPublisher,
    IndexUnavailableError,
    PrefixIndex,
    WorkerIndexState,
    open_prefix_index,
)
from pagedserve.common.runtime.prefix_index.redis import RedisPrefixIndex, redact_url

pytest_plugins = ["fixtures_redis"]

# "redis-chunked" runs the shared suite with tiny script budgets, so every split
# path (apply pieces, chunked resync, stepwise draining) is exercised.
BACKENDS = ["embedded", "redis", "redis-chunked"]


def h(i: int, tag: str = "") -> bytes:
    """A deterministic 16-byte block hash."""
    return hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=HASH_SIZE).digest()


CHAIN = [h(i) for i in range(8)]


def stored(*hashes: bytes) -> list[IndexEvent]:
    return [IndexEvent.stored(x) for x in hashes]


def removed(*hashes: bytes) -> list[IndexEvent]:
    return [IndexEvent.removed(x) for x in hashes]


def batch(worker: str, seq: int, events: Iterable[IndexEvent]) -> EventBatch:
    return EventBatch(worker, seq, tuple(events))


def join(
    index: PrefixIndex, worker: str, hashes: Iterable[bytes] = (), ttl_s: float = 60.0
) -> None:
    """A worker's hello: heartbeat, then its full list at seq 0."""
    index.heartbeat(worker, ttl_s)
    index.resync(worker, list(hashes), 0)


def wait_until(predicate, timeout_s: float = 10.0) -> bool:
    """Poll ``predicate`` until it holds (behaviour, not timing: the bound only stops a hang)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def delete_namespace(index: RedisPrefixIndex) -> None:
    client = index._redis
    keys = list(client.scan_iter(match=index.key_pattern, count=1000))
    if keys:
        client.delete(*keys)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def make_index(backend: str, request: pytest.FixtureRequest, unique_namespace: str) -> Iterator:
    """``make(namespace=None)`` -> an index client; clients of one namespace share a store."""
    created: list[PrefixIndex] = []
    embedded: dict[str, EmbeddedPrefixIndex] = {}

    def make(namespace: str | None = None) -> PrefixIndex:
        ns = namespace or unique_namespace
        if backend == "embedded":
            index: PrefixIndex = embedded.setdefault(ns, EmbeddedPrefixIndex(ns))
        else:
            budget = 2 if backend == "redis-chunked" else 2048
            url = request.getfixturevalue("redis_server")
            index = RedisPrefixIndex(url, ns, max_hashes_per_call=budget)
        created.append(index)
        return index

    yield make
    for index in created:
        if isinstance(index, RedisPrefixIndex):
            delete_namespace(index)
        index.close()


@pytest.fixture
def index(make_index) -> PrefixIndex:
    return make_index()


@pytest.fixture
def redis_index(redis_server: str, unique_namespace: str) -> Iterator:
    """``make(**options)`` -> a RedisPrefixIndex on this test's namespace; teardown empties
    the namespace and closes every index made."""
    created: list[RedisPrefixIndex] = []

    def make(**options) -> RedisPrefixIndex:
        created.append(RedisPrefixIndex(redis_server, unique_namespace, **options))
        return created[-1]

    yield make
    for index in created:
        delete_namespace(index)
        index.close()


@pytest.fixture
def redis_client(redis_server: str) -> Iterator[redis.Redis]:
    """A plain client of the session's server, to look at the keys directly."""
    client = redis.Redis.from_url(redis_server)
    yield client
    client.close()


# -- building blocks ----------------------------------------------------------


@dataclass(frozen=True)
class BlockStored:
    """Same name and fields as the block manager's event (published by class name)."""

    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    block_id: int


@dataclass(frozen=True)
class BlockRemoved:
    block_hash: bytes
    block_id: int


class ToyCache:
    """An LRU set of block hashes that reports changes like the block manager does."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._blocks: OrderedDict[bytes, int] = OrderedDict()
        self._events: list[object] = []
        self._next_id = 0

    def store(self, hashes: Sequence[bytes]) -> None:
        for i, block_hash in enumerate(hashes):
            if block_hash in self._blocks:
                self._blocks.move_to_end(block_hash)
                continue
            if len(self._blocks) == self.capacity:
                old, block_id = self._blocks.popitem(last=False)
                self._events.append(BlockRemoved(old, block_id))
            self._blocks[block_hash] = self._next_id
            parent = hashes[i - 1] if i else None
            self._events.append(BlockStored(block_hash, parent, (i,), self._next_id))
            self._next_id += 1

    def evict(self, block_hash: bytes) -> None:
        self._events.append(BlockRemoved(block_hash, self._blocks.pop(block_hash)))

    def drain_events(self) -> list[object]:
        events, self._events = self._events, []
        return events

    def cached_hashes(self) -> list[bytes]:
        return list(self._blocks)


class LossyLink(PrefixIndex):
    """Delivers a publisher's batches to an index, dropping the calls it is told to."""

    def __init__(self, inner: PrefixIndex, drop_calls: set[int]):
        self.inner = inner
        self.drop_calls = drop_calls
        self.calls = 0

    def apply_many(self, batches: Sequence[EventBatch]) -> list[ApplyResult]:
        self.calls += 1
        if self.calls in self.drop_calls:
            return [ApplyResult.APPLIED] * len(batches)  # lost on the way; sender unaware
        return self.inner.apply_many(batches)

    def apply(self, batch: EventBatch) -> ApplyResult:
        return self.apply_many([batch])[0]

    def resync(self, worker_id, block_hashes, next_seq):
        self.inner.resync(worker_id, block_hashes, next_seq)

    def remove_worker(self, worker_id):
        self.inner.remove_worker(worker_id)

    def heartbeat(self, worker_id, ttl_s):
        return self.inner.heartbeat(worker_id, ttl_s)

    def match(self, block_hashes):
        return self.inner.match(block_hashes)

    def workers(self):
        return self.inner.workers()

    def reap(self):
        return self.inner.reap()

    def worker_hashes(self, worker_id):
        return self.inner.worker_hashes(worker_id)

    def worker_state(self, worker_id):
        return self.inner.worker_state(worker_id)


# -- the shared suite: store / remove / match ---------------------------------


def test_match_counts_leading_blocks_per_worker(index: PrefixIndex) -> None:
    join(index, "A", CHAIN[:4])
    join(index, "B", CHAIN[:2])
    join(index, "C", CHAIN[1:4])  # lacks block 0: holds no leading block
    join(index, "D", [CHAIN[0], CHAIN[1], CHAIN[3]])  # hole at block 2
    join(index, "E")  # live, holds nothing

    assert index.match(CHAIN) == {"A": 4, "B": 2, "C": 0, "D": 2, "E": 0}
    assert index.match(CHAIN[:1]) == {"A": 1, "B": 1, "C": 0, "D": 1, "E": 0}
    assert index.match(CHAIN[1:]) == {"A": 3, "B": 1, "C": 3, "D": 1, "E": 0}
    assert index.match([]) == {"A": 0, "B": 0, "C": 0, "D": 0, "E": 0}
    assert index.match([h(99)]) == {"A": 0, "B": 0, "C": 0, "D": 0, "E": 0}
    assert index.workers() == ["A", "B", "C", "D", "E"]


def test_match_without_workers_is_empty(index: PrefixIndex) -> None:
    assert index.match(CHAIN) == {}
    assert index.workers() == []


def test_events_store_and_remove_in_order(index: PrefixIndex) -> None:
    join(index, "A")
    result = index.apply(batch("A", 0, stored(*CHAIN[:4])))
    assert result is ApplyResult.APPLIED
    assert index.match(CHAIN) == {"A": 4}
    assert index.worker_state("A") == WorkerIndexState(next_seq=4, needs_resync=False)

    # Removing block 2 cuts the match there, though A still holds block 3.
    assert index.apply(batch("A", 4, removed(CHAIN[2]))) is ApplyResult.APPLIED
    assert index.match(CHAIN) == {"A": 2}
    assert index.worker_hashes("A") == {CHAIN[0], CHAIN[1], CHAIN[3]}

    # Within one batch the last event on a hash wins.
    events = [*stored(CHAIN[2]), *removed(CHAIN[2]), *removed(CHAIN[3]), *stored(CHAIN[3])]
    assert index.apply(batch("A", 5, events)) is ApplyResult.APPLIED
    assert index.worker_hashes("A") == {CHAIN[0], CHAIN[1], CHAIN[3]}
    assert index.worker_state("A") == WorkerIndexState(next_seq=9, needs_resync=False)


def test_removal_in_the_middle_cuts_only_that_worker(index: PrefixIndex) -> None:
    join(index, "A", CHAIN[:4])
    join(index, "B", CHAIN[:4])
    index.apply(batch("A", 0, removed(CHAIN[1])))
    assert index.match(CHAIN) == {"A": 1, "B": 4}
    index.apply(batch("A", 1, removed(CHAIN[0])))
    assert index.match(CHAIN) == {"A": 0, "B": 4}
    # Removing a hash the worker never held changes nothing.
    assert index.apply(batch("B", 0, removed(h(42)))) is ApplyResult.APPLIED
    assert index.match(CHAIN) == {"A": 0, "B": 4}


def test_duplicate_and_overlapping_batches(index: PrefixIndex) -> None:
    join(index, "A")
    assert index.apply(batch("A", 0, stored(*CHAIN[:3]))) is ApplyResult.APPLIED
    # Re-sent batch (a retry after a lost reply): ignored.
    assert index.apply(batch("A", 0, stored(*CHAIN[:3]))) is ApplyResult.DUPLICATE
    assert index.apply(batch("A", 1, removed(CHAIN[0]))) is ApplyResult.DUPLICATE
    assert index.worker_hashes("A") == set(CHAIN[:3])
    # Overlap: seq 1-2 were applied already, only seq 3-4 are new (so the two
    # removals at seq 1-2, which are not what A sent there, are skipped).
    overlap = [*removed(CHAIN[0]), *removed(CHAIN[1]), *stored(CHAIN[3]), *stored(CHAIN[4])]
    assert index.apply(batch("A", 1, overlap)) is ApplyResult.APPLIED
    assert index.worker_hashes("A") == set(CHAIN[:5])
    assert index.worker_state("A") == WorkerIndexState(next_seq=5, needs_resync=False)
    assert index.apply(batch("A", 5, [])) is ApplyResult.DUPLICATE  # empty: nothing new


def test_gap_marks_resync_and_resync_restores_truth(index: PrefixIndex) -> None:
    join(index, "A")
    join(index, "B", CHAIN[:2])
    index.apply(batch("A", 0, stored(*CHAIN[:3])))
    # seq 3..4 are lost; seq 5 arrives.
    assert index.apply(batch("A", 5, removed(CHAIN[0]))) is ApplyResult.GAP
    assert index.worker_state("A") == WorkerIndexState(next_seq=3, needs_resync=True)
    # Until the resync, A's batches are ignored, even the one that fills the gap.
    assert index.apply(batch("A", 3, removed(CHAIN[2]))) is ApplyResult.RESYNC_PENDING
    assert index.worker_hashes("A") == set(CHAIN[:3])

    truth = [CHAIN[1], CHAIN[2], h(100)]
    index.resync("A", truth, 9)
    assert index.worker_hashes("A") == set(truth)
    assert index.worker_state("A") == WorkerIndexState(next_seq=9, needs_resync=False)
    assert index.match(CHAIN) == {"A": 0, "B": 2}
    assert index.apply(batch("A", 9, stored(CHAIN[0]))) is ApplyResult.APPLIED
    assert index.match(CHAIN) == {"A": 3, "B": 2}
    assert index.worker_hashes("B") == set(CHAIN[:2])  # B untouched throughout


def test_unknown_worker_must_resync_first(index: PrefixIndex) -> None:
    index.heartbeat("A", 60)
    assert index.worker_state("A") is None
    assert index.apply(batch("A", 0, stored(CHAIN[0]))) is ApplyResult.GAP
    assert index.worker_state("A") == WorkerIndexState(next_seq=0, needs_resync=True)
    assert index.worker_hashes("A") == set()
    index.resync("A", [CHAIN[0]], 1)
    assert index.match(CHAIN) == {"A": 1}


def test_resync_replaces_entries_wholesale(index: PrefixIndex) -> None:
    join(index, "A", CHAIN[:6])
    join(index, "B", CHAIN[:6])
    index.resync("A", CHAIN[:2] + [h(7, "other")], 40)
    assert index.worker_hashes("A") == {CHAIN[0], CHAIN[1], h(7, "other")}
    assert index.match(CHAIN) == {"A": 2, "B": 6}
    index.resync("A", [], 41)
    assert index.worker_hashes("A") == set()
    assert index.match(CHAIN) == {"A": 0, "B": 6}


def test_remove_worker_drops_everything(index: PrefixIndex) -> None:
    join(index, "A", CHAIN[:4])
    join(index, "B", CHAIN[:2])
    index.remove_worker("A")
    assert index.match(CHAIN) == {"B": 2}
    assert index.workers() == ["B"]
    assert index.worker_hashes("A") == set()
    assert index.worker_state("A") is None
    # A late batch from the departed worker is a gap, not a resurrection.
    assert index.apply(batch("A", 0, stored(CHAIN[0]))) is ApplyResult.GAP
    assert index.match(CHAIN) == {"B": 2}
    index.remove_worker("never-seen")  # no error


def test_lapsed_heartbeat_hides_then_reaps_worker(index: PrefixIndex) -> None:
    join(index, "A", CHAIN[:4], ttl_s=0.3)
    join(index, "B", CHAIN[:2], ttl_s=60)
    assert index.match(CHAIN) == {"A": 4, "B": 2}

    assert wait_until(lambda: "A" not in index.match(CHAIN))
    assert index.match(CHAIN) == {"B": 2}
    # B's next heartbeat reaps A: its entries are gone without any goodbye.
    index.heartbeat("B", 60)
    assert index.worker_hashes("A") == set()
    assert index.worker_state("A") is None
    assert index.workers() == ["B"]
    assert index.worker_hashes("B") == set(CHAIN[:2])
    assert index.reap() == []


def test_heartbeat_says_when_the_index_needs_the_full_list(index: PrefixIndex) -> None:
    """heartbeat() answers True while the index holds no usable list of the worker
    (unknown, removed, reaped, or awaiting its resync), so an idle worker, which has no
    batch whose GAP would tell it, still learns that it must resync."""
    assert index.heartbeat("A", 60) is True  # first contact
    index.resync("A", CHAIN[:2], 0)
    assert index.heartbeat("A", 60) is False
    assert index.apply(batch("A", 5, stored(CHAIN[3]))) is ApplyResult.GAP
    assert index.heartbeat("A", 60) is True  # still waiting for its resync
    index.resync("A", CHAIN[:3], 6)
    assert index.heartbeat("A", 60) is False
    index.remove_worker("A")
    assert index.heartbeat("A", 60) is True
    join(index, "B", CHAIN[:1], ttl_s=0.3)
    assert wait_until(lambda: "B" not in index.match(CHAIN))
    assert index.heartbeat("B", 60) is True  # lapsed: reaped by its own late heartbeat
    assert index.worker_hashes("B") == set()


def test_heartbeat_extends_liveness(index: PrefixIndex) -> None:
    join(index, "A", CHAIN[:1], ttl_s=60)
    index.heartbeat("A", 0.2)  # a shorter TTL replaces the longer one
    assert wait_until(lambda: index.workers() == [])
    assert index.worker_hashes("A") == set()


def test_reap_returns_lapsed_workers(index: PrefixIndex) -> None:
    join(index, "A", CHAIN[:2], ttl_s=0.2)
    join(index, "B", CHAIN[:2], ttl_s=0.2)
    join(index, "C", CHAIN[:2], ttl_s=60)
    assert wait_until(lambda: index.match(CHAIN) == {"C": 2})
    assert index.reap() == ["A", "B"]
    assert index.reap() == []


def test_namespaces_isolate_models(make_index) -> None:
    llama, qwen = (
        make_index("llama-" + uuid.uuid4().hex[:8]),
        make_index("qwen-" + uuid.uuid4().hex[:8]),
    )
    join(llama, "A", CHAIN[:4])
    join(qwen, "A", CHAIN[:1])
    join(qwen, "B", CHAIN[:3])
    assert llama.match(CHAIN) == {"A": 4}
    assert qwen.match(CHAIN) == {"A": 1, "B": 3}
    qwen.remove_worker("A")
    assert llama.worker_hashes("A") == set(CHAIN[:4])
    assert llama.workers() == ["A"]


def test_two_clients_share_one_view(make_index) -> None:
    router_1, router_2 = make_index(), make_index()
    join(router_1, "A", CHAIN[:4])
    router_1.apply(batch("A", 0, removed(CHAIN[3])))
    assert router_2.match(CHAIN) == {"A": 3}
    join(router_2, "B", CHAIN[:1])
    assert router_1.match(CHAIN) == {"A": 3, "B": 1}
    router_2.remove_worker("A")
    assert router_1.workers() == ["B"]


def test_concurrent_writers_and_readers(index: PrefixIndex) -> None:
    workers = [f"w{i}" for i in range(4)]
    for worker in workers:
        join(index, worker)
    errors: list[BaseException] = []
    stop = threading.Event()

    def write(worker: str) -> None:
        try:
            seq = 0
            for i in range(60):
                events = stored(h(i, worker), h(i + 1000, worker)) + removed(h(i + 1000, worker))
                assert index.apply(batch(worker, seq, events)) is ApplyResult.APPLIED
                seq += len(events)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    def read() -> None:
        try:
            while not stop.is_set():
                assert set(index.match([h(0, "w0"), h(1, "w0")])) == set(workers)
        except BaseException as exc:
            errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(w,)) for w in workers]
    for thread in writers:
        thread.start()
    for thread in writers:
        thread.join()
    stop.set()
    reader.join()
    assert errors == []
    for worker in workers:
        assert index.worker_hashes(worker) == {h(i, worker) for i in range(60)}
        assert index.worker_state(worker) == WorkerIndexState(next_seq=180, needs_resync=False)
    assert index.match([h(i, "w2") for i in range(70)]) == {"w0": 0, "w1": 0, "w2": 60, "w3": 0}


def test_bad_input_is_rejected_with_a_clear_message(index: PrefixIndex) -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        index.match([b"short"])
    with pytest.raises(TypeError, match="must be bytes"):
        index.match(["not bytes"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="worker id"):
        index.heartbeat("", 1.0)
    with pytest.raises(ValueError, match="whitespace"):
        index.resync("a b", [], 0)
    with pytest.raises(ValueError, match="ttl_s"):
        index.heartbeat("A", 0)
    with pytest.raises(ValueError, match="next_seq"):
        index.resync("A", [], -1)
    with pytest.raises(TypeError, match="EventBatch"):
        index.apply([IndexEvent.stored(CHAIN[0])])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="16 bytes"):
        index.resync("A", [b"x" * 15], 0)


# -- the publisher, over both backends ----------------------------------------


def test_publisher_first_flush_publishes_the_full_list(index: PrefixIndex) -> None:
    cache = ToyCache(capacity=16)
    cache.store(CHAIN[:3])
    publisher = IndexPublisher(index, "w0", cache.cached_hashes, ttl_s=60)
    assert publisher.publish(cache.drain_events()) is True
    assert publisher.stats.resyncs == 1
    assert index.worker_hashes("w0") == set(CHAIN[:3])
    assert index.worker_state("w0") == WorkerIndexState(next_seq=3, needs_resync=False)

    cache.store(CHAIN[:6])
    assert publisher.publish(cache.drain_events()) is True
    assert index.match(CHAIN) == {"w0": 6}
    assert index.worker_state("w0") == WorkerIndexState(next_seq=6, needs_resync=False)
    assert publisher.stats.resyncs == 1
    assert publisher.stats.batches == 1


def test_publisher_splits_batches_and_follows_evictions(index: PrefixIndex) -> None:
    cache = ToyCache(capacity=4)
    publisher = IndexPublisher(index, "w0", cache.cached_hashes, ttl_s=60, max_batch_events=3)
    assert publisher.flush() is True  # hello: empty list
    cache.store(CHAIN)  # 8 stores, 4 evictions of blocks 0..3
    events = cache.drain_events()
    assert len(events) == 12
    assert publisher.publish(events) is True
    assert publisher.stats.batches == 4  # 12 events, 3 per batch
    assert index.worker_hashes("w0") == set(CHAIN[4:])
    assert index.match(CHAIN) == {"w0": 0}
    assert index.match(CHAIN[4:]) == {"w0": 4}
    assert index.worker_state("w0") == WorkerIndexState(next_seq=12, needs_resync=False)


def test_publisher_resyncs_after_lost_batches(make_index) -> None:
    index = make_index()
    rng = random.Random(7)
    link = LossyLink(index, drop_calls={3, 9, 10, 17})
    cache = ToyCache(capacity=12)
    publisher = IndexPublisher(link, "w0", cache.cached_hashes, ttl_s=60)
    universe = [h(i, "lossy") for i in range(40)]
    for _ in range(30):
        start = rng.randrange(len(universe) - 6)
        cache.store(universe[start : start + rng.randrange(1, 6)])
        if rng.random() < 0.3:
            cache.evict(rng.choice(cache.cached_hashes()))
        publisher.publish(cache.drain_events())
    # The last call was delivered, so every loss has been noticed and repaired.
    assert link.calls not in link.drop_calls
    assert index.worker_hashes("w0") == set(cache.cached_hashes())
    assert index.worker_state("w0") == WorkerIndexState(publisher.next_seq, needs_resync=False)
    assert publisher.stats.resyncs == 1 + 3  # hello + one per detected loss (9 and 10 in a row)


def test_publisher_rejoins_after_being_reaped(index: PrefixIndex) -> None:
    cache = ToyCache(capacity=8)
    cache.store(CHAIN[:4])
    publisher = IndexPublisher(index, "w0", cache.cached_hashes, ttl_s=60)
    publisher.publish(cache.drain_events())
    index.remove_worker("w0")  # as if reaped after a long pause
    cache.store(CHAIN[4:6])
    assert publisher.publish(cache.drain_events()) is True
    assert index.worker_hashes("w0") == set(CHAIN[:6])
    assert index.match(CHAIN) == {"w0": 6}
    assert publisher.stats.resyncs == 2


def test_publisher_tick_heartbeats_when_due(index: PrefixIndex) -> None:
    now = [0.0]
    cache = ToyCache(capacity=8)
    publisher = IndexPublisher(
        index, "w0", cache.cached_hashes, ttl_s=0.5, heartbeat_every_s=100, clock=lambda: now[0]
    )
    assert publisher.tick() is True  # resync + heartbeat
    assert index.workers() == ["w0"]
    assert wait_until(lambda: index.workers() == [])  # no heartbeat due on the fake clock
    now[0] = 100.0
    assert publisher.tick() is True  # heartbeat due; the reaped worker is told to resync
    cache.store(CHAIN[:2])
    assert publisher.publish(cache.drain_events()) is True
    assert index.workers() == ["w0"]
    assert index.match(CHAIN) == {"w0": 2}


def test_idle_publisher_forgotten_by_the_index_resyncs_at_its_next_heartbeat(
    index: PrefixIndex,
) -> None:
    now = [0.0]
    cache = ToyCache(capacity=8)
    cache.store(CHAIN[:4])
    publisher = IndexPublisher(
        index, "w0", cache.cached_hashes, ttl_s=60, heartbeat_every_s=1, clock=lambda: now[0]
    )
    assert publisher.publish(cache.drain_events()) is True
    index.remove_worker("w0")  # reaped after a late heartbeat; w0 caches nothing new
    assert publisher.tick() is True  # no heartbeat due: it cannot know yet
    assert index.worker_hashes("w0") == set()
    now[0] = 1.0
    assert publisher.tick() is True  # the heartbeat says "unknown": full list at once
    assert index.worker_hashes("w0") == set(CHAIN[:4])
    assert index.match(CHAIN) == {"w0": 4}
    assert publisher.stats.resyncs == 2
    now[0] = 2.0
    assert publisher.tick() is True  # known again: a plain heartbeat
    assert publisher.stats.resyncs == 2


def test_publisher_goodbye_leaves_the_index(index: PrefixIndex) -> None:
    cache = ToyCache(capacity=8)
    cache.store(CHAIN[:3])
    publisher = IndexPublisher(index, "w0", cache.cached_hashes, ttl_s=60)
    publisher.publish(cache.drain_events())
    assert publisher.goodbye() is True
    assert index.match(CHAIN) == {}
    assert index.worker_hashes("w0") == set()


def test_publisher_rejects_unknown_events(index: PrefixIndex) -> None:
    publisher = IndexPublisher(index, "w0", list)
    with pytest.raises(TypeError, match="cannot publish a dict"):
        publisher.add([{"block_hash": CHAIN[0]}])
    with pytest.raises(ValueError, match="max_batch_events"):
        IndexPublisher(index, "w0", list, max_batch_events=0)


# -- wire format ---------------------------------------------------------------


def test_event_batch_round_trips_through_bytes() -> None:
    original = EventBatch("prefill-0", 2**40 + 3, tuple(stored(*CHAIN[:3]) + removed(CHAIN[1])))
    data = original.to_bytes()
    assert EventBatch.from_bytes(data) == original
    assert original.seq_end == 2**40 + 7
    assert len(data) == 4 + 1 + 8 + 2 + 4 + len("prefill-0") + 4 * (1 + HASH_SIZE)
    assert EventBatch.from_bytes(EventBatch("w", 0, ()).to_bytes()).events == ()


def test_event_batch_rejects_bad_bytes() -> None:
    data = EventBatch("w", 0, tuple(stored(CHAIN[0]))).to_bytes()
    with pytest.raises(ValueError, match="too short"):
        EventBatch.from_bytes(data[:5])
    with pytest.raises(ValueError, match="magic"):
        EventBatch.from_bytes(b"XXXX" + data[4:])
    with pytest.raises(ValueError, match="length"):
        EventBatch.from_bytes(data[:-1])
    bad_kind = bytearray(data)
    bad_kind[-HASH_SIZE - 1] = 9
    with pytest.raises(ValueError, match="unknown kind 9"):
        EventBatch.from_bytes(bytes(bad_kind))
    with pytest.raises(ValueError, match="seq_start"):
        EventBatch("w", -1, ())
    with pytest.raises(TypeError, match="IndexEvent"):
        EventBatch("w", 0, (CHAIN[0],))  # type: ignore[arg-type]
    assert IndexEvent(2, CHAIN[0]).kind is EventKind.REMOVED


# -- Redis only ----------------------------------------------------------------


def commandstats(client: redis.Redis) -> dict[str, int]:
    return {name: stats["calls"] for name, stats in client.info("commandstats").items()}


def test_redis_match_is_one_round_trip(redis_server: str, redis_index, redis_client) -> None:
    index = redis_index()
    index.load_scripts()
    join(index, "A", CHAIN[:5])
    join(index, "B", CHAIN[:2])
    probe = redis_client
    before = commandstats(probe)  # also opens probe's connection before MONITOR starts
    marker = f"end-{uuid.uuid4().hex}"
    with redis.Redis.from_url(redis_server).monitor() as monitor:
        assert index.match(CHAIN) == {"A": 5, "B": 2}
        probe.echo(marker)
        seen = []
        while marker not in (entry := monitor.next_command())["command"]:
            seen.append(entry)
    after = commandstats(probe)

    from_clients = [e["command"].split()[0].upper() for e in seen if e["client_type"] != "lua"]
    in_script = [e["command"].split()[0].upper() for e in seen if e["client_type"] == "lua"]
    assert from_clients == ["EVALSHA"]
    # Registry + 2 liveness checks, then blocks 0..5: block 5 is held by nobody, so
    # the walk stops there and blocks 6 and 7 are never read.
    assert in_script == ["SMEMBERS", "EXISTS", "EXISTS"] + ["SMEMBERS"] * 6
    assert after["cmdstat_evalsha"] - before["cmdstat_evalsha"] == 1


def namespace_keys(client: redis.Redis, index: RedisPrefixIndex) -> set[str]:
    """Every key of the index's namespace, as read by `client`."""
    return {k.decode() for k in client.scan_iter(match=index.key_pattern)}


def keys_of_only_b(p: str, hashes: Sequence[bytes]) -> set[str]:
    """The keys of a namespace (key prefix `p`) where worker B alone holds `hashes`:
    what test_redis_storage_layout spells out, once every other worker is gone."""
    return {
        *(f"{p}h:{x.hex()}" for x in hashes),
        f"{p}w:B",
        f"{p}m:B",
        f"{p}alive:B",
        f"{p}workers",
    }


def test_redis_storage_layout(redis_index, redis_client, unique_namespace: str) -> None:
    index, client = redis_index(), redis_client
    join(index, "A", CHAIN[:2])
    join(index, "B", CHAIN[1:2])
    p = f"ps:{{{unique_namespace}}}:"
    assert namespace_keys(client, index) == {
        f"{p}h:{CHAIN[0].hex()}",
        f"{p}h:{CHAIN[1].hex()}",
        f"{p}w:A",
        f"{p}w:B",
        f"{p}m:A",
        f"{p}m:B",
        f"{p}alive:A",
        f"{p}alive:B",
        f"{p}workers",
    }
    assert client.smembers(f"{p}h:{CHAIN[1].hex()}") == {b"A", b"B"}
    assert client.hgetall(f"{p}m:A") == {b"next": b"0", b"resync": b"0"}
    assert 0 < client.pttl(f"{p}alive:A") <= 60_000
    index.remove_worker("A")
    assert namespace_keys(client, index) == keys_of_only_b(p, CHAIN[1:2])


def test_redis_outage_raises_then_publishers_repopulate(redis_server_factory) -> None:
    server = redis_server_factory.start()
    router = RedisPrefixIndex(server.url, "outage", socket_timeout_s=0.2)
    caches = {w: ToyCache(capacity=16) for w in ("w0", "w1")}
    publishers = {
        w: IndexPublisher(RedisPrefixIndex(server.url, "outage"), w, c.cached_hashes, ttl_s=60)
        for w, c in caches.items()
    }
    caches["w0"].store(CHAIN[:4])
    caches["w1"].store(CHAIN[:2])
    for w in publishers:
        assert publishers[w].publish(caches[w].drain_events()) is True
    assert router.match(CHAIN) == {"w0": 4, "w1": 2}

    server.stop()
    with pytest.raises(IndexUnavailableError, match="unavailable during match"):
        router.match(CHAIN)
    assert router.is_available() is False
    late_router = RedisPrefixIndex(server.url, "outage", socket_timeout_s=0.2)  # starts while down
    with pytest.raises(IndexUnavailableError):
        late_router.workers()
    caches["w0"].store(CHAIN[:6])
    assert publishers["w0"].publish(caches["w0"].drain_events()) is False  # w0 notices
    assert publishers["w0"].needs_resync

    server.start()  # same port, empty: nothing was persisted
    assert router.is_available() is True
    assert router.match(CHAIN) == {}
    caches["w1"].store(CHAIN[:3])  # w1 never noticed the outage: its next batch is a gap
    for w in publishers:
        assert publishers[w].publish(caches[w].drain_events()) is True
        assert publishers[w].stats.resyncs == 2
    assert router.match(CHAIN) == {"w0": 6, "w1": 3}
    assert late_router.workers() == ["w0", "w1"]
    for w, cache in caches.items():
        assert router.worker_hashes(w) == set(cache.cached_hashes())
    for index in [router, late_router, *(p.index for p in publishers.values())]:
        index.close()


def test_redis_url_with_acl_user_and_password(redis_server: str, unique_namespace: str) -> None:
    admin = redis.Redis.from_url(redis_server)
    user, password = f"ps-{uuid.uuid4().hex[:8]}", "s3cret-pw"
    admin.acl_setuser(
        user,
        enabled=True,
        passwords=[f"+{password}"],
        keys=["ps:*"],
        commands=["+@read", "+@write", "+@scripting", "+ping", "+client|setname"],
    )
    port = redis_server.rsplit(":", 1)[1].split("/")[0]
    good = RedisPrefixIndex(f"redis://{user}:{password}@127.0.0.1:{port}/0", unique_namespace)
    bad_url = f"redis://{user}:wrong@127.0.0.1:{port}/0"
    bad = RedisPrefixIndex(bad_url, unique_namespace)
    try:
        join(good, "A", CHAIN[:3])
        assert good.match(CHAIN) == {"A": 3}
        assert good.url == f"redis://{user}:***@127.0.0.1:{port}/0"
        with pytest.raises(IndexUnavailableError, match="AuthenticationError") as info:
            bad.match(CHAIN)
        assert "wrong" not in str(info.value)
    finally:
        delete_namespace(good)
        good.close()
        bad.close()
        admin.acl_deluser(user)
        admin.close()


def test_redis_over_tls(redis_server_factory) -> None:
    server = redis_server_factory.start(tls=True)
    assert server.url.startswith("rediss://")
    index = open_prefix_index(server.url, "tls")
    assert isinstance(index, RedisPrefixIndex)
    join(index, "A", CHAIN[:2])
    assert index.match(CHAIN) == {"A": 2}
    index.close()
    # Without the CA the server's certificate is refused.
    insecure = RedisPrefixIndex(server.url.split("?")[0], "tls")
    with pytest.raises(IndexUnavailableError):
        insecure.match(CHAIN)
    insecure.close()


def test_redis_constructor_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="redis url"):
        RedisPrefixIndex("http://127.0.0.1:6379", "ns")
    with pytest.raises(ValueError, match="braces"):
        RedisPrefixIndex("redis://127.0.0.1:1", "a{b}")
    with pytest.raises(ValueError, match="non-empty"):
        RedisPrefixIndex("redis://127.0.0.1:1", "")
    assert redact_url("rediss://u:p@h:1/0") == "rediss://u:***@h:1/0"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"
    assert isinstance(open_prefix_index(None, "ns"), EmbeddedPrefixIndex)


# -- with the real block manager (the index itself does not import it) ----------


def test_publisher_with_the_block_manager_and_router_hashes(make_index) -> None:
    from pagedserve.common.api.hashing import block_hashes
    from pagedserve.common.core.block_manager import BlockManager

    index = make_index()
    manager = BlockManager(num_blocks=6, block_size=4, model_id="tiny")
    publisher = IndexPublisher(index, "prefill-0", manager.cached_hashes, ttl_s=60)
    prompt = list(range(100, 117))  # 4 full blocks + 1 token
    manager.allocate("a", prompt)
    manager.mark_computed("a", len(prompt))
    assert publisher.publish(manager.drain_events()) is True

    # The router hashes the next turn's tokens exactly as the worker did.
    next_turn = prompt + [7, 8, 9, 10, 11]
    assert index.match(block_hashes(next_turn, 4, "tiny")) == {"prefill-0": 4}
    assert index.match(block_hashes(next_turn, 4, "tiny", cache_salt="tenant-b")) == {
        "prefill-0": 0
    }
    assert index.match(block_hashes(next_turn, 4, "other-model")) == {"prefill-0": 0}

    # Another prompt needs 5 blocks: 3 of a's cached blocks are evicted (tail first).
    manager.free("a")
    other = list(range(500, 520))
    manager.allocate("b", other)
    manager.mark_computed("b", len(other))
    assert publisher.publish(manager.drain_events()) is True
    assert index.worker_hashes("prefill-0") == set(manager.cached_hashes())
    assert index.match(block_hashes(next_turn, 4, "tiny")) == {"prefill-0": 1}
    assert index.match(block_hashes(other, 4, "tiny")) == {"prefill-0": 5}


def test_redis_large_lists_move_in_bounded_steps(
    redis_index, redis_client, unique_namespace: str
) -> None:
    index, probe = redis_index(max_hashes_per_call=100), redis_client
    p = f"ps:{{{unique_namespace}}}:"
    old = [h(i, "old") for i in range(1000)]
    new = old[750:] + [h(i, "new") for i in range(250)]  # 500 hashes, 250 kept

    def scripts_run(action) -> int:
        before = commandstats(probe).get("cmdstat_evalsha", 0)
        action()
        return commandstats(probe)["cmdstat_evalsha"] - before

    index.load_scripts()  # so no call below is a NOSCRIPT miss
    index.heartbeat("A", 60)
    # begin (nothing to drain) + 10 chunks of 100.
    assert scripts_run(lambda: index.resync("A", old, 0)) == 1 + 10
    assert index.worker_hashes("A") == set(old)
    # begin drains 100 of the 1000 old hashes, 9 more drain steps, 5 chunks of 100.
    assert scripts_run(lambda: index.resync("A", new, 5)) == 1 + 9 + 5
    assert index.worker_hashes("A") == set(new)
    assert index.match(old[:1]) == {"A": 0}
    assert index.match(new[:300]) == {"A": 300}
    assert index.worker_state("A") == WorkerIndexState(next_seq=5, needs_resync=False)

    # A dies: B's heartbeats reap it at once and unlink its 500 hashes 100 at a time.
    index.heartbeat("B", 60)
    index.resync("B", new[:3], 0)
    index.heartbeat("A", 0.2)
    assert wait_until(lambda: index.match(new) == {"B": 3})
    index.heartbeat("B", 60)
    assert index.worker_hashes("A") == set()
    assert probe.smembers(f"{p}draining") == {b"A"}
    assert probe.scard(f"{p}old:A") == 400
    for left in (300, 200, 100, 0):
        index.heartbeat("B", 60)
        assert probe.scard(f"{p}old:A") == left
    assert namespace_keys(probe, index) == keys_of_only_b(p, new[:3])
    # A big apply is split into pieces of 100 events with consecutive numbers.
    events = stored(*old[:250])
    assert scripts_run(lambda: index.apply(batch("B", 0, events))) == 3
    assert index.worker_state("B") == WorkerIndexState(next_seq=250, needs_resync=False)
    assert index.match(old) == {"B": 250}


def test_redis_timeout_is_unavailable(redis_server_factory) -> None:
    server = redis_server_factory.start()
    index = RedisPrefixIndex(server.url, "paused", socket_timeout_s=0.1)
    join(index, "A", CHAIN[:2])
    admin = server.client()
    admin.execute_command("CLIENT", "PAUSE", 600, "ALL")  # no answers for 0.6 s
    with pytest.raises(IndexUnavailableError, match="TimeoutError"):
        index.match(CHAIN)  # gives up after 2 x 0.1 s
    assert wait_until(index.is_available)
    assert index.match(CHAIN) == {"A": 2}
    admin.close()
    index.close()


def test_embedded_path_does_not_import_redis() -> None:
    """Engine core rule: only prefix_index/redis.py imports redis, and only when asked for."""
    code = (
        "import sys\n"
        "from pagedserve.common.runtime.prefix_index import open_prefix_index, IndexPublisher\n"
        "open_prefix_index(None, 'm').match([])\n"
        "print('redis' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
