"""Prefix-aware routing over the global prefix index, with real workers, gRPC and Redis.

Two clusters of 2 prefill + 2 decode in-process workers on the tiny checkpoint: one
with the embedded index (hosted by the router, workers publish over gRPC), one on a
real redis-server (workers publish to Redis and register there too). Outputs are
compared with the single-process engine; what each worker computed is read from its
engine's counters (`prefill_tokens`: prompt tokens computed, hits excluded).

Prompts are seeded random ids (`prompt(seed, n)`), so no two tests share a block.
"""

from __future__ import annotations

import collections
import dataclasses
import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from builders import one_torch_thread, tiny_checkpoint  # noqa: F401 (autouse fixture)
from fixtures_redis import RedisServer
from router_fixtures import MAX_MODEL_LEN, ROUTER_CONFIG, Cluster, tiny_engine_config, wait_for

from pagedserve.common.api.sampling_params import SamplingParams
from pagedserve.common.core.llm import LLM
from pagedserve.common.runtime.prefix_index.worker_registry import (
    RedisWorkerRegistry,
    RegistryPublisher,
)
from pagedserve.common.runtime.worker import WorkerRuntime
from pagedserve.router.config import PrefixRouting
from pagedserve.router.cost import TransferEstimator
from pagedserve.router.frontend import ResolvedRequest
from pagedserve.router.policy import PrefixAwarePolicy, PrefixMatch, RoundRobinPolicy, RouteRequest
from pagedserve.router.prefix import PrefixLookup
from pagedserve.router.registry import WorkerRegistry
from pagedserve.router.routing import Routing
from pagedserve.router.server import Router, RouterHandle, start_router_in_thread
from pagedserve.v1 import generation_pb2 as gen_pb
from pagedserve.v1 import kvtransfer_pb2, worker_pb2, worker_pb2_grpc

BLOCK = 16
DISAGG_MIN = 32
GREEDY = dict(temperature=0.0, ignore_eos=True)
INDEX_TTL_S = 1.0
# Prefill is priced slow enough (100 tokens/s) that pulling 3-4 blocks always beats
# computing them, whatever the ExportPrefix latency measured on a busy test machine.
ROUTER = dataclasses.replace(
    ROUTER_CONFIG,
    disagg_min_prompt_tokens=DISAGG_MIN,
    worker_timeout_s=2.0,
    prefix=PrefixRouting(prefill_tokens_per_s=100.0),
)


# ---- clusters ---------------------------------------------------------------------------


def start_prefix_cluster(redis_url: str | None, pools: dict[str, int]) -> Cluster:
    """Router + workers publishing to the router's embedded index, or to Redis."""
    engine = tiny_engine_config()
    config = dataclasses.replace(ROUTER, model=engine.model, redis_url=redis_url)
    cluster = Cluster(start_router_in_thread(config), engine)
    try:
        for pool, count in pools.items():
            for i in range(count):
                add_worker(cluster, f"{pool[0]}{i}", pool)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def add_worker(cluster: Cluster, worker_id: str, pool: str, **overrides) -> WorkerRuntime:
    redis_url = cluster.router.router.config.redis_url
    where = {"redis_url": redis_url} if redis_url else {"index_address": cluster.internal_address}
    return cluster.add_worker(worker_id, pool, index_ttl_s=INDEX_TTL_S, **where, **overrides)


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    """A redis-server of this module's own (the registry keys are not namespaced)."""
    server = RedisServer(tmp_path_factory.mktemp("redis-prefix-routing"))
    server.start()
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def embedded_cluster():
    c = start_prefix_cluster(None, {"prefill": 2, "decode": 2})
    yield c
    c.stop()


@pytest.fixture(scope="module")
def redis_cluster(redis_url):
    c = start_prefix_cluster(redis_url, {"prefill": 2, "decode": 2})
    yield c
    c.stop()


@pytest.fixture(params=["embedded", "redis"])
def cluster(request) -> Cluster:
    return request.getfixturevalue(f"{request.param}_cluster")


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(
        str(tiny_checkpoint("llama")), dtype="float32", num_blocks=128, max_model_len=MAX_MODEL_LEN
    )


# ---- helpers ----------------------------------------------------------------------------


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 313) for _ in range(n)]


def reference(llm: LLM, ids: list[int], max_tokens: int) -> list[int]:
    out = llm.generate([ids], SamplingParams(max_tokens=max_tokens, **GREEDY))[0]
    return out.completions[0].token_ids


def generate(cluster_or_router, ids: list[int], max_tokens: int = 4, salt: str = "") -> list[int]:
    from pagedserve.router.client import Client

    with Client(cluster_or_router.address, timeout=60) as c:
        (got,) = c.collect(token_ids=ids, max_tokens=max_tokens, cache_salt=salt, **GREEDY)
    return got.token_ids


def serve_directly(rt: WorkerRuntime, ids: list[int], max_tokens: int = 1, salt: str = ""):
    """Runs a request on one worker (local prefill + decode), bypassing the router: puts
    the prompt (and the output) in that worker's prefix cache. Returns the output ids."""
    req = worker_pb2.TokenizedRequest(
        request_id=f"direct-{random.getrandbits(48):x}",
        prompt_token_ids=ids,
        sampling=gen_pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        cache_salt=salt,
    )
    with grpc.insecure_channel(rt.address) as ch:
        steps = worker_pb2_grpc.DecodeStub(ch).Decode(
            worker_pb2.DecodeRequest(request=req), timeout=30
        )
        return [t for s in steps for t in s.response.token_ids]


def computed(rt: WorkerRuntime) -> int:
    """Prompt tokens this worker's engine computed so far (prefix-cache hits excluded)."""
    return rt.loop.call(lambda e: e.stats().prefill_tokens)


def computed_by(cluster: Cluster) -> dict[str, int]:
    return {wid: computed(rt) for wid, rt in cluster.workers.items()}


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def cached(rt: WorkerRuntime) -> set[bytes]:
    return set(rt.loop.call(lambda e: e.block_manager.cached_hashes()))


def chain(rt: WorkerRuntime, ids: list[int], salt: str | None = None) -> list[bytes]:
    """The block hashes the router computes for `ids` (all full blocks but the last token's)."""
    from pagedserve.common.api.hashing import block_hashes

    return block_hashes(ids[:-1], BLOCK, rt.engine.model_id, salt)


def index_of(router: RouterHandle):
    return router.call(lambda r: r.prefix.index())


def indexed_truly(cluster: Cluster) -> bool:
    """The index holds exactly every worker's cached hashes."""
    index = index_of(cluster.router)
    return index is not None and all(
        index.worker_hashes(wid) == cached(rt) for wid, rt in cluster.workers.items()
    )


def wait_indexed(cluster: Cluster, timeout: float = 10.0) -> None:
    wait_for(lambda: indexed_truly(cluster), timeout, "the index to equal the workers' caches")


def wait_idle_view(router: RouterHandle) -> None:
    """Until the router's view of every worker (heartbeat stats) shows no load."""

    def idle(r) -> bool:
        return all(
            not (w.inflight or w.stats.num_running or w.stats.num_waiting or w.stats.kv_usage)
            for w in r.registry.workers()
        )

    wait_for(lambda: router.call(idle), 10.0, "the router to see every worker idle")


def counters(router: RouterHandle) -> dict[str, int]:
    return router.call(lambda r: dict(r.counters))


def counted(before: dict[str, int], after: dict[str, int], name: str) -> int:
    return after.get(name, 0) - before.get(name, 0)


def seed_prefix(cluster: Cluster, worker_id: str, ids: list[int], salt: str = "") -> None:
    """Put `ids` in one worker's cache and wait until the index (and the router) know it."""
    serve_directly(cluster.workers[worker_id], ids, salt=salt)
    wait_indexed(cluster)
    wait_idle_view(cluster.router)


# ---- routing ----------------------------------------------------------------------------


def test_requests_sharing_a_system_prompt_land_where_the_prefix_is(cluster, llm):
    system = prompt(101 + len(cluster.address), 64)  # 4 full blocks
    # p1 holds the system prompt; least-loaded alone would pick p0 (ties go to the lower id).
    seed_prefix(cluster, "p1", system + prompt(102, 6))
    for i in range(3):
        ids = system + prompt(110 + i, 40)  # 40 new tokens >= DISAGG_MIN: a Prefill call
        before, c0 = computed_by(cluster), counters(cluster.router)
        assert generate(cluster, ids, max_tokens=5) == reference(llm, ids, 5)
        # Only p1 computed, and only the question: 64 tokens were its cache hits.
        assert delta(before, computed_by(cluster)) == {"p1": len(ids) - 64}
        c1 = counters(cluster.router)
        assert counted(c0, c1, "prefill_calls") == 1
        assert counted(c0, c1, "prefix_exports") == 0
        wait_idle_view(cluster.router)
    cluster.wait_quiescent()


def test_the_benchmark_switches_the_policy_the_router_routes_with(embedded_cluster):
    """benchmarks/prefix_routing.py compares policies on one router: each phase must
    route with its own (setting `Router.policy` alone changed nothing after the split)."""
    from benchmarks.prefix_routing import set_policy

    router = embedded_cluster.router
    default = router.call(lambda r: r.routing.policy)
    baseline = RoundRobinPolicy()
    try:
        set_policy(router, baseline)
        assert router.call(lambda r: r.routing.policy) is baseline
        ids = prompt(151, 40)
        got = router.call(
            lambda r: [r.pick("decode", r.route_request(resolved(ids)), set()) for _ in "ab"]
        )
        assert [s.inputs for s in got] == [{"turn": 0.0}, {"turn": 1.0}]  # round-robin's own
    finally:
        set_policy(router, default)


def resolved(ids: list[int]) -> ResolvedRequest:
    return ResolvedRequest("bench", ids, None, None)  # type: ignore[arg-type]


def test_second_chat_turn_lands_on_the_decode_worker_holding_the_first(cluster, llm):
    turn1 = prompt(201 + len(cluster.address), 45)
    answer = serve_directly(cluster.workers["d1"], turn1, max_tokens=12)  # d1 served turn 1
    assert answer == reference(llm, turn1, 12)
    wait_indexed(cluster)
    wait_idle_view(cluster.router)
    turn2 = turn1 + answer + prompt(202, 9)  # the conversation so far + the new message
    d1 = cluster.workers["d1"]
    hit = d1.loop.call(lambda e: e.block_manager.match_prefix(turn2))
    assert hit == (len(turn1) + len(answer) - 1) // BLOCK * BLOCK  # all but the last token
    (best,) = cluster.router.call(lambda r: r.preview("decode", turn2))[:1]
    assert (best.worker.worker_id, best.compute_tokens) == ("d1", len(turn2) - hit)

    before, c0 = computed_by(cluster), counters(cluster.router)
    assert generate(cluster, turn2, max_tokens=6) == reference(llm, turn2, 6)
    # Served by d1 without a Prefill call, computing only what it did not hold.
    assert delta(before, computed_by(cluster)) == {"d1": len(turn2) - hit}
    c1 = counters(cluster.router)
    assert counted(c0, c1, "prefill_calls") == 0
    assert counted(c0, c1, "local_prefill_cached") == 1
    assert counted(c0, c1, "prefix_exports") == 0
    cluster.wait_quiescent()


def test_cross_worker_pull_comes_from_the_holder_and_equals_recompute(cluster, llm):
    system = prompt(301 + len(cluster.address), 64)
    seed_prefix(cluster, "p1", system + prompt(302, 3))
    holder = cluster.workers["p1"]
    exports: list[int] = []
    real_export = holder.kv_source.export

    def spy(kv, table, **kw):  # the holder's real export, counted
        exports.append(len(table))
        return real_export(kv, table, **kw)

    holder.kv_source.export = spy
    try:
        ids = system + prompt(303, 10)  # 10 new tokens: a decode worker prefills locally
        before, c0 = computed_by(cluster), counters(cluster.router)
        assert generate(cluster, ids, max_tokens=6) == reference(llm, ids, 6)
    finally:
        del holder.kv_source.export
    assert exports == [4]  # p1 exported the 4 blocks of the system prompt
    c1 = counters(cluster.router)
    assert counted(c0, c1, "prefix_exports") == 1
    assert counted(c0, c1, "prefix_export_blocks") == 4
    assert counted(c0, c1, "prefill_calls") == 0
    # One decode worker pulled them and computed only the rest.
    ((target, n),) = delta(before, computed_by(cluster)).items()
    assert target.startswith("d") and n == len(ids) - 64
    assert set(chain(holder, system + [0])) <= cached(cluster.workers[target])
    cluster.wait_quiescent()


def test_cache_salt_isolates_tenants(redis_cluster, llm):
    cluster = redis_cluster
    system = prompt(401, 64)
    seed_prefix(cluster, "p1", system + prompt(402, 5), salt="tenant-a")
    ids = system + prompt(403, 40)
    scored = cluster.router.call(lambda r: r.preview("prefill", ids, "tenant-b"))
    assert [s.inputs["own_blocks"] for s in scored] == [0.0, 0.0]  # nothing shared
    # What is asserted is reuse, not placement: which worker runs a request whose prefix
    # is worth a 5 ms pull is a near tie (p1 computes 40 tokens; p0 pulls 4 blocks from
    # p1, then computes the same 40: cost 40 vs ~40.5 tokens), which a heartbeat showing
    # the least load on p1 rightly tips. Placement on the holder has its own tests above.
    before, c0 = computed_by(cluster), counters(cluster.router)
    assert generate(cluster, ids, max_tokens=4, salt="tenant-b") == reference(llm, ids, 4)
    computed_b = delta(before, computed_by(cluster))
    assert sum(computed_b.values()) == len(ids)  # tenant a's blocks unused: all computed
    assert counted(c0, counters(cluster.router), "prefix_exports") == 0  # and none pulled
    wait_idle_view(cluster.router)

    before, c0 = computed_by(cluster), counters(cluster.router)
    assert generate(cluster, ids, max_tokens=4, salt="tenant-a") == reference(llm, ids, 4)
    computed_a = delta(before, computed_by(cluster))
    assert sum(computed_a.values()) == len(ids) - 64  # tenant a's 64 cached tokens reused,
    pulled = counted(c0, counters(cluster.router), "prefix_exports")
    assert (computed_a, pulled) in (({"p1": 40}, 0), ({"p0": 40}, 1))  # on p1, or pulled
    cluster.wait_quiescent()


# ---- several routers, liveness ----------------------------------------------------------


@pytest.fixture
def second_router(redis_cluster):
    """Another router replica on the same Redis: it knows the workers only from Redis."""
    config = dataclasses.replace(
        ROUTER,
        model=redis_cluster.engine_config.model,
        redis_url=redis_cluster.router.router.config.redis_url,
        registry_poll_s=0.1,
    )
    router = start_router_in_thread(config)
    yield router
    router.stop()


def test_two_router_replicas_see_the_same_index_and_route_alike(redis_cluster, second_router, llm):
    cluster, other = redis_cluster, second_router
    wait_for(lambda: other.live_worker_ids() == sorted(cluster.workers), what="replica's view")
    system = prompt(501, 48)
    seed_prefix(cluster, "d1", system + prompt(502, 4))
    wait_idle_view(other)
    ids = system + prompt(503, 12)
    for role, want in (("decode", ("d1", 12, 3.0, None)), ("prefill", ("p0", 12, 0.0, "d1"))):
        # Scores differ only by what each router measured itself (ExportPrefix latency).
        views = [
            [
                (
                    s.worker.worker_id,
                    s.compute_tokens,
                    s.inputs["own_blocks"],
                    s.inputs.get("pull_from"),
                )
                for s in r.call(lambda x, role=role: x.preview(role, ids))
            ]
            for r in (cluster.router, other)
        ]
        assert views[0] == views[1]
        assert views[0][0] == want  # decode: d1 holds it; prefill: p0 would pull from d1
    # Through the replica: the same decision as the first router (d1, local prefill).
    before = computed_by(cluster)
    assert generate(other, ids, max_tokens=4) == reference(llm, ids, 4)
    assert delta(before, computed_by(cluster)) == {"d1": len(ids) - 48}
    cluster.wait_quiescent()


def test_worker_killed_without_goodbye_leaves_the_index_within_its_ttl(
    redis_cluster, second_router
):
    cluster, other = redis_cluster, second_router
    doomed = add_worker(cluster, "d-doomed", "decode")
    serve_directly(doomed, prompt(601, 40))
    wait_indexed(cluster)
    wait_for(lambda: "d-doomed" in other.live_worker_ids(), what="the replica to see it")
    index = index_of(cluster.router)
    assert "d-doomed" in index.workers() and index.worker_hashes("d-doomed")
    cluster.crash("d-doomed")  # no goodbye: its heartbeats just stop
    # Gone from the index once its TTL lapsed (+ one heartbeat of another worker to reap).
    wait_for(lambda: "d-doomed" not in index.workers(), INDEX_TTL_S + 1.0, "TTL reaping")
    wait_for(lambda: not index.worker_hashes("d-doomed"), 2.0, "its entries to go")
    # And from both routers' registries (no fresh stats for worker_timeout_s).
    for router in (cluster.router, other):
        wait_for(lambda r=router: "d-doomed" not in r.live_worker_ids(), 5.0, "registry drop")


def test_an_idle_worker_the_index_forgot_publishes_its_list_at_its_next_heartbeat(cluster):
    """A worker whose heartbeat came late (a loaded host) is reaped: the index drops its
    entries. Its next heartbeat must bring them back even if it caches nothing new
    (before, only its next batch of events did, so an idle worker stayed invisible)."""
    seed_prefix(cluster, "p0", prompt(651 + len(cluster.address), 40))
    p0 = cluster.workers["p0"]
    assert cached(p0)
    resyncs = p0.index_sync.publisher.stats.resyncs
    index = index_of(cluster.router)
    index.remove_worker("p0")  # what reaping does to a lapsed worker
    wait_indexed(cluster)
    assert index.worker_hashes("p0") == cached(p0)
    assert p0.index_sync.publisher.stats.resyncs == resyncs + 1


# ---- outages, gaps, stale entries -------------------------------------------------------


def lose_evictions(rt: WorkerRuntime) -> None:
    """Evict the worker's cached blocks and lose the events that say so, as if their
    batch never reached the index: the index keeps claiming those blocks (stale) and
    the worker's next batch starts past what the index expects (a gap)."""

    def run(engine) -> None:
        engine.block_manager.evict()
        publisher = rt.index_sync.publisher
        publisher.add(engine.block_manager.drain_events())  # numbered ...
        publisher._pending.clear()  # ... and lost in transit

    rt.loop.call(run)


def test_event_gap_resyncs_and_stale_entries_cost_a_recompute(cluster, llm):
    system = prompt(701 + len(cluster.address), 64)
    seed_prefix(cluster, "p1", system + prompt(702, 2))
    p1 = cluster.workers["p1"]
    resyncs = p1.index_sync.publisher.stats.resyncs
    lose_evictions(p1)
    index = index_of(cluster.router)
    assert set(chain(p1, system + [0])) <= index.worker_hashes("p1")  # stale claims
    assert not cached(p1)

    # The index sends the request to p1, which recomputes everything: same answer.
    ids = system + prompt(703, 40)
    before = computed_by(cluster)
    assert generate(cluster, ids, max_tokens=5) == reference(llm, ids, 5)
    assert delta(before, computed_by(cluster)) == {"p1": len(ids)}
    # p1's next batch revealed the gap: it resynced; the index equals every cache again.
    wait_indexed(cluster)
    assert p1.index_sync.publisher.stats.resyncs == resyncs + 1
    assert index.worker_state("p1").needs_resync is False

    # A stale claim met by ExportPrefix: NOT_FOUND, and the puller computes it all.
    other_system = prompt(705 + len(cluster.address), 64)  # no decode worker holds it
    seed_prefix(cluster, "p1", other_system + prompt(706, 2))
    lose_evictions(p1)
    ids = other_system + prompt(704, 8)
    before, c0 = computed_by(cluster), counters(cluster.router)
    assert generate(cluster, ids, max_tokens=5) == reference(llm, ids, 5)
    assert counted(c0, counters(cluster.router), "prefix_export_missing") == 1
    ((target, n),) = delta(before, computed_by(cluster)).items()
    assert target.startswith("d") and n == len(ids)
    cluster.wait_quiescent()


def test_redis_outage_routes_by_load_then_the_index_repopulates(redis_server_factory, llm):
    server = redis_server_factory.start()
    cluster = start_prefix_cluster(server.url, {"prefill": 1, "decode": 1})
    try:
        ids = prompt(801, 50)
        assert generate(cluster, ids) == reference(llm, ids, 4)
        wait_indexed(cluster)
        server.stop()
        c0 = counters(cluster.router)
        for i in range(3):  # serving continues, by load only
            ids = prompt(810 + i, 40)
            assert generate(cluster, ids) == reference(llm, ids, 4)
        c1 = counters(cluster.router)
        assert counted(c0, c1, "index_unavailable") >= 1
        assert counted(c0, c1, "index_skipped") >= 1 and counted(c0, c1, "index_lookups") == 0
        server.start()  # empty: the workers' publishers resync by themselves
        wait_indexed(cluster, timeout=15.0)
        assert all(index_of(cluster.router).worker_hashes(w) for w in cluster.workers)
        wait_for(lambda: cluster.router.call(lambda r: r.prefix.clock() >= r.prefix.retry_at))
        c2 = counters(cluster.router)
        assert generate(cluster, ids) == reference(llm, ids, 4)
        assert counted(c2, counters(cluster.router), "index_lookups") == 1
        cluster.wait_quiescent()
    finally:
        cluster.stop()


# ---- the policy and the Redis worker registry, without a cluster -------------------------


def wstats(worker_id: str, pool=worker_pb2.WORKER_POOL_DECODE, **load) -> worker_pb2.WorkerStats:
    return worker_pb2.WorkerStats(
        worker_id=worker_id, pool=pool, address=f"h:{len(worker_id)}", block_size=BLOCK, **load
    )


def test_prefix_policy_trades_cached_blocks_against_load_and_plans_pulls():
    reg = WorkerRegistry()
    a, b = reg.heartbeat(wstats("a")), reg.heartbeat(wstats("b"))
    config = PrefixRouting(
        load_weight=64.0,
        prefill_tokens_per_s=1000.0,
        transfer_bytes_per_s=1e9,
        transfer_overhead_s=0.005,
        pull=False,
    )
    match = PrefixMatch(BLOCK, 9, {"b": 8}, [(b, 8)])  # b holds 8 of the 9 blocks
    rr = RouteRequest("r", list(range(150)), None, match)
    policy = PrefixAwarePolicy(config, estimator=TransferEstimator(config, 1024))
    ranked = policy.rank("decode", rr, [a, b])
    assert [(s.worker.worker_id, s.compute_tokens, s.score) for s in ranked] == [
        ("b", 22, 22.0),
        ("a", 150, 150.0),
    ]
    b.inflight = 2  # 22 + 2 * 64 = 150: a tie, which goes to the lower id
    assert [s.worker.worker_id for s in policy.rank("decode", rr, [a, b])] == ["a", "b"]
    b.inflight = 3
    # With pulls: a takes b's 8 blocks (128 tokens: 5 ms + 131 us to move, 128 ms to compute).
    config = dataclasses.replace(config, pull=True)
    policy = PrefixAwarePolicy(config, estimator=TransferEstimator(config, 1024))
    best = policy.rank("decode", rr, [a, b])[0]
    assert (best.worker, best.compute_tokens, best.pull.holder, best.pull.blocks) == (a, 22, b, 8)
    assert best.score == pytest.approx(22 + (0.005 + 128 * 1024 / 1e9) * 1000)
    assert best.inputs["pull_from"] == "b" and best.inputs["own_blocks"] == 0.0
    # A link too slow for it: computing is cheaper, so no pull is planned.
    slow_link = dataclasses.replace(config, pull=True, transfer_bytes_per_s=1e6)
    slow = PrefixAwarePolicy(slow_link, estimator=TransferEstimator(slow_link, 1024))
    assert slow.rank("decode", rr, [a])[0].pull is None
    # No index answer (Redis down): every candidate computes everything; load decides.
    blind = RouteRequest("r", list(range(150)))
    assert [s.compute_tokens for s in policy.rank("decode", blind, [a, b])] == [150, 150]


def test_round_robin_policy_takes_turns():
    reg = WorkerRegistry()
    ws = [reg.heartbeat(wstats(w)) for w in ("w1", "w0", "w2")]
    rr, policy = RouteRequest("r", [1, 2]), RoundRobinPolicy()
    firsts = [policy.rank("decode", rr, ws)[0].worker.worker_id for _ in range(4)]
    assert firsts == ["w0", "w1", "w2", "w0"]


def test_router_reads_the_redis_worker_registry(redis_server_factory):
    server = redis_server_factory.start()
    model = str(tiny_checkpoint("llama"))
    router = Router(dataclasses.replace(ROUTER, model=model, redis_url=server.url))
    router.redis_registry = RedisWorkerRegistry(server.url)
    router.registry.listeners.clear()  # not started: no health service to update
    worker = RegistryPublisher(server.url, "w1", ttl_s=5.0)
    name = f"{router.frontend.model_name}@0123456789abcdef"
    stats = wstats("w1", model_name=name, timestamp_unix_ms=1000)
    assert worker.beat(stats.SerializeToString())
    RegistryPublisher(server.url, "x1", 5.0).beat(
        wstats("x1", model_name="other-model@00", timestamp_unix_ms=1).SerializeToString()
    )
    router.poll_redis_registry()
    assert [w.worker_id for w in router.registry.workers()] == ["w1"]  # not another model's
    seen = router.registry.get("w1").last_seen
    router.poll_redis_registry()  # the same stats again: no news, not refreshed
    assert router.registry.get("w1").last_seen == seen
    server.stop()  # unreachable: the last view is kept
    router.poll_redis_registry()
    assert router.counters["registry_unavailable"] == 1 and router.registry.get("w1")
    assert worker.beat(stats.SerializeToString()) is False
    server.start()
    worker.goodbye()  # a tombstone: dropped at the next read
    router.poll_redis_registry()
    assert router.registry.workers() == [] and router.registry.drops[-1] == ("w1", "goodbye")
    router.redis_registry.close()


def test_blocks_a_worker_is_computing_count_for_routing_but_not_for_pulls():
    reg = WorkerRegistry()
    a = reg.heartbeat(wstats("a", model_name="m@1"))
    b = reg.heartbeat(wstats("b", model_name="m@1"))
    lookup = PrefixLookup(ROUTER, reg)
    ids = prompt(901, 70)  # 4 full blocks before the last token
    hashes = lookup.chain(ids, None)
    assert len(hashes) == 4
    index = lookup.index()
    index.heartbeat("a", 10.0)
    index.heartbeat("b", 10.0)
    index.resync("b", hashes[:2], 0)  # b holds 2 blocks
    match = lookup.match(ids, None)
    assert (match.blocks, [(w.worker_id, n) for w, n in match.holders]) == ({"b": 2}, [("b", 2)])
    release = lookup.reserve("a", hashes)  # a request is computing the whole chain on a
    match = lookup.match(ids, None)
    assert match.blocks == {"a": 4, "b": 2} and [w for w, _ in match.holders] == [b]
    release()
    assert lookup.match(ids, None).blocks == {"b": 2} and a.worker_id not in lookup._pending


def test_transfer_estimate_follows_recent_exports_and_forgets_old_ones():
    now = [0.0]
    config = PrefixRouting(transfer_overhead_s=0.005, transfer_bytes_per_s=1e9)
    est = TransferEstimator(config, 1000.0, clock=lambda: now[0])
    assert est.transfer_s(100) == pytest.approx(0.005 + 100 * 1000 / 1e9)
    for s in (0.010, 0.900, 0.020):  # one slow export among quick ones
        est.observe_export(s)
    assert est.overhead_s == pytest.approx(0.020)  # the median
    now[0] = 31.0  # nothing measured for longer than the window: the configured value
    assert est.overhead_s == pytest.approx(0.005)
    est.observe_layout(
        kvtransfer_pb2.KVLayout(
            num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype="float16"
        )
    )
    assert est.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2  # 22.5 KiB: the default model's


def test_a_full_cache_makes_duplicating_a_prefix_cost_its_evictions():
    reg = WorkerRegistry()
    full = dict(num_total_blocks=64, num_free_blocks=64, num_cached_blocks=64)
    holder = reg.heartbeat(wstats("h", num_running=1, **full))
    other = reg.heartbeat(wstats("o", **full))  # its cache is full of other prefixes
    roomy = reg.heartbeat(wstats("r", num_total_blocks=64, num_free_blocks=64))
    config = PrefixRouting(load_weight=64.0, evict_weight=0.5, pull=False)
    policy = PrefixAwarePolicy(config)
    match = PrefixMatch(BLOCK, 16, {"h": 16}, [(holder, 16)])
    rr = RouteRequest("r", list(range(16 * BLOCK + 20)), None, match)
    scores = {s.worker.worker_id: s.score for s in policy.rank("decode", rr, [holder, other])}
    # o computes 276 tokens and evicts 16 blocks (0.5 * 256 = 128); h computes 20, load 64.
    assert scores == {"h": 20 + 64, "o": 276 + 128}
    assert policy.rank("decode", rr, [roomy])[0].inputs["evicts_blocks"] == 0.0


def test_a_hot_prefix_moves_by_a_pull_while_its_holder_prefills_a_cold_prompt():
    """Issue 13: the holder's queued prefill tokens count as the wait they cause."""
    reg = WorkerRegistry()
    full = dict(num_total_blocks=64, num_free_blocks=64, num_cached_blocks=64)
    holder = reg.heartbeat(wstats("h", **full))
    other = reg.heartbeat(wstats("o", **full))
    config = PrefixRouting(
        load_weight=64.0,
        evict_weight=0.5,
        prefill_tokens_per_s=1000.0,
        transfer_bytes_per_s=1e9,
        transfer_overhead_s=0.005,
    )
    now = [0.0]
    policy = PrefixAwarePolicy(
        config, estimator=TransferEstimator(config, 1024), clock=lambda: now[0]
    )
    hot = PrefixMatch(BLOCK, 16, {"h": 16}, [(holder, 16)])
    warm = RouteRequest("warm", list(range(16 * BLOCK + 20)), None, hot)
    pull_cost = 20 + (0.005 + 256 * 1024 / 1e9) * 1000 + 0.5 * 256  # + 16 evicted blocks

    def ranked(rr):
        return [
            (s.worker.worker_id, s.compute_tokens, s.pull and s.pull.holder.worker_id, s.score)
            for s in policy.rank("decode", rr, [holder, other])
        ]

    # Idle holder: it keeps the warm request (a pull would evict 16 blocks on o).
    assert ranked(warm) == [("h", 20, None, 20.0), ("o", 20, "h", pytest.approx(pull_cost))]
    # A cold 300-token prompt: nobody holds it; a tie on cost and occupancy, to h.
    cold = RouteRequest("cold", list(range(1000, 1300)), None, PrefixMatch(BLOCK, 18, {}, []))
    choice = policy.rank("decode", cold, [holder, other])[0]
    assert (choice.worker, choice.compute_tokens) == (holder, 300)
    policy.assigned(holder, 300)
    holder.inflight = 1  # the dispatcher's call to h is open
    # Its 300 tokens are queued ahead of anything h gets now: the warm request pulls to o.
    assert ranked(warm) == [("o", 20, "h", pytest.approx(pull_cost)), ("h", 20, None, 384.0)]
    now[0] = 0.2  # 200 of the 300 tokens computed at 1000 tokens/s: still worth the pull
    assert ranked(warm)[0][:3] == ("o", 20, "h")
    now[0] = 0.3  # drained: h has only its one request in flight, it keeps the hot prefix
    assert ranked(warm) == [("h", 20, None, 84.0), ("o", 20, "h", pytest.approx(pull_cost))]
    # Queued tokens add up over decisions and drain from the last one.
    policy.assigned(holder, 300)
    now[0] = 0.35
    policy.assigned(holder, 20)
    assert policy.backlog.tokens(holder) == pytest.approx(250 + 20)
    assert policy.backlog.tokens(other) == 0.0
    # No call of this router open on h any more: nothing of ours is queued there.
    holder.inflight = 0
    assert policy.backlog.tokens(holder) == 0.0
    assert ranked(warm)[0] == ("h", 20, None, 20.0)


def test_routing_tells_the_policy_which_worker_computes_a_prompt():
    reg = WorkerRegistry()
    a, b = (reg.heartbeat(wstats(w, model_name="m@1")) for w in ("a", "b"))
    p = reg.heartbeat(wstats("p", pool=worker_pb2.WORKER_POOL_PREFILL, model_name="m@1"))
    config = dataclasses.replace(ROUTER, disagg_min_prompt_tokens=64)
    now = [0.0]
    policy = PrefixAwarePolicy(config.prefix, clock=lambda: now[0])
    routing = Routing(
        config, policy, reg, PrefixLookup(config, reg), collections.Counter(), ThreadPoolExecutor(1)
    )

    def request(n: int) -> tuple[ResolvedRequest, RouteRequest]:
        ids = list(range(n))
        match = PrefixMatch(BLOCK, (n - 1) // BLOCK, {}, [])
        return ResolvedRequest("r", ids, None, None), RouteRequest("r", ids, None, match)

    def queued() -> dict[str, float]:
        return {w.worker_id: policy.backlog.tokens(w) for w in (a, b, p)}

    short, rr = request(40)  # under disagg_min_prompt_tokens: prefilled where it decodes
    choice = routing.pick("decode", rr, set())
    assert choice.worker is a and queued() == {"a": 0.0, "b": 0.0, "p": 0.0}  # only ranked
    assert routing.disaggregate(short, choice) is False
    a.inflight = 1  # the dispatcher's Decode call (dispatch.py)
    assert queued() == {"a": 40.0, "b": 0.0, "p": 0.0}
    # The next one goes to b (a has 40 tokens queued), and b computes it.
    choice = routing.pick("decode", rr, set())
    assert choice.worker is b and routing.disaggregate(short, choice) is False
    b.inflight = 1
    assert queued() == {"a": 40.0, "b": 40.0, "p": 0.0}
    # A long prompt is prefilled on p: p computes it, the decode worker only imports it.
    long, rr = request(100)
    assert routing.disaggregate(long, routing.pick("decode", rr, set())) is True
    assert routing.pick("prefill", rr, set()).worker is p
    p.inflight = 1
    routing.pick("decode", rr, set())  # ranked again after the Prefill
    assert queued() == {"a": 40.0, "b": 40.0, "p": 100.0}
