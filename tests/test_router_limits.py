"""The router's bounds: internal calls that end, retries that stop, queues and channel
maps that do not grow, and input limits (issue 10, section 2).

Everything runs over real gRPC on loopback. Misbehaving workers are real gRPC servers
registered by heartbeat like any worker, whose Decode/Prefill handlers hang or fail on
purpose (`FakeWorker`: the only way to make a worker hang or fail its batch on demand);
the workers that serve are real in-process workers on the tiny checkpoint.
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent import futures

import grpc
import pytest
from builders import one_torch_thread, tiny_checkpoint  # noqa: F401 (autouse fixture)
from router_fixtures import MAX_MODEL_LEN, tiny_engine_config, wait_for

from pagedserve.common.api.limits import ConfigError
from pagedserve.common.api.sampling_params import SamplingParams
from pagedserve.common.core.config import EngineConfig, SchedulerConfig
from pagedserve.common.core.engine import LLMEngine
from pagedserve.common.core.scheduler import QueueFullError
from pagedserve.common.runtime.grpc_options import SERVER_OPTIONS
from pagedserve.common.runtime.worker import WorkerConfig, WorkerRuntime
from pagedserve.router.client import Client, explain
from pagedserve.router.config import PrefixRouting, RouterConfig
from pagedserve.router.server import RouterHandle, start_router_in_thread
from pagedserve.v1 import generation_pb2 as gen_pb
from pagedserve.v1 import kvtransfer_pb2, worker_pb2, worker_pb2_grpc
from pagedserve.worker import start_worker

GREEDY = dict(temperature=0.0, ignore_eos=True)
MODEL = "llama-0"  # the tiny checkpoint's name, as the router serves it


def ids(start: int, length: int) -> list[int]:
    return [3 + (start + 7 * i) % 310 for i in range(length)]


def router_config(**overrides: object) -> RouterConfig:
    base = dict(
        port=0,
        model=str(tiny_checkpoint("llama")),
        max_model_len=MAX_MODEL_LEN,
        worker_timeout_s=60.0,
        disagg_min_prompt_tokens=8,
        prefix=PrefixRouting(enabled=False),  # least loaded, ties by worker id
    )
    return RouterConfig(**{**base, **overrides})  # type: ignore[arg-type]


def heartbeat(address: str, stats: worker_pb2.WorkerStats) -> None:
    with grpc.insecure_channel(address) as ch:
        worker_pb2_grpc.RegistryStub(ch).Heartbeat(
            worker_pb2.HeartbeatRequest(stats=stats), timeout=5
        )


def goodbye(address: str, worker_id: str) -> None:
    with grpc.insecure_channel(address) as ch:
        worker_pb2_grpc.RegistryStub(ch).Goodbye(
            worker_pb2.GoodbyeRequest(worker_id=worker_id), timeout=5
        )


def counter(router: RouterHandle, name: str) -> int:
    return router.call(lambda r: r.counters[name])


class FakeWorker(worker_pb2_grpc.DecodeServicer, worker_pb2_grpc.PrefillServicer):
    """A gRPC server that registers as a worker and misbehaves as told.

    Decode: `fail` aborts with that (code, message); otherwise it streams `steps`
    one-token steps, then hangs until released (or its caller cancels).
    Prefill: hangs until released (or its caller cancels).
    """

    def __init__(
        self,
        worker_id: str,
        pool: int = worker_pb2.WORKER_POOL_DECODE,
        steps: int = 0,
        fail: tuple[grpc.StatusCode, str] | None = None,
    ) -> None:
        self.worker_id, self.pool, self.steps, self.fail = worker_id, pool, steps, fail
        self.calls = 0
        self.cancelled = threading.Event()  # a call of ours was cancelled by the router
        self.release = threading.Event()
        self.server = grpc.server(futures.ThreadPoolExecutor(8), options=SERVER_OPTIONS)
        worker_pb2_grpc.add_DecodeServicer_to_server(self, self.server)
        worker_pb2_grpc.add_PrefillServicer_to_server(self, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()
        self._beating = threading.Event()

    def stats(self) -> worker_pb2.WorkerStats:
        return worker_pb2.WorkerStats(
            worker_id=self.worker_id,
            pool=self.pool,
            address=self.address,
            model_name=f"{MODEL}@fake",
            block_size=16,
            num_total_blocks=128,
            num_free_blocks=128,
        )

    def register(self, router: str) -> None:
        heartbeat(router, self.stats())

    def beat_until_stopped(self, router: str, every_s: float = 0.1) -> None:
        """Heartbeats from a thread until `stop_beating` (the link is 'cut')."""

        def run() -> None:
            while not self._beating.wait(every_s):
                heartbeat(router, self.stats())

        self.register(router)
        threading.Thread(target=run, daemon=True).start()

    def stop_beating(self) -> None:
        self._beating.set()

    def _hang(self, context) -> None:
        context.add_callback(self.cancelled.set)
        while not self.release.wait(0.05) and context.is_active():
            pass

    def Decode(self, request, context):  # noqa: N802
        self.calls += 1
        if self.fail is not None:
            context.abort(*self.fail)
        rid = request.request.request_id
        for i in range(self.steps):
            yield worker_pb2.DecodeStep(
                response=gen_pb.GenerateResponse(request_id=rid, token_ids=[7 + i], text="x")
            )
        self._hang(context)

    def Prefill(self, request, context):  # noqa: N802
        self.calls += 1
        self._hang(context)
        return kvtransfer_pb2.KVHandle()

    def stop(self) -> None:
        self.stop_beating()
        self.release.set()
        self.server.stop(0).wait()


@pytest.fixture
def fakes():
    made: list[FakeWorker] = []

    def make(*args, **kwargs) -> FakeWorker:
        made.append(FakeWorker(*args, **kwargs))
        return made[-1]

    yield make
    for f in made:
        f.stop()


@pytest.fixture(scope="module")
def real_decode():
    """A real decode worker (no heartbeats of its own: tests register its stats)."""
    rt = start_worker(WorkerConfig(worker_id="d0", pool="decode", engine=tiny_engine_config()))
    yield rt
    rt.stop(grace=0.5)


def quiescent(rt: WorkerRuntime) -> None:
    wait_for(
        lambda: rt.loop.call(lambda e: (e.block_manager.usage(), list(e.requests))) == (0, []),
        what="every request to end and its blocks to return",
    )
    rt.check_integrity()


def router_is_clean(router: RouterHandle) -> None:
    wait_for(
        lambda: router.call(lambda r: (r.active_requests, r.admission.inflight)) == (set(), 0),
        what="the router to forget the request",
    )
    assert router.call(lambda r: [w.inflight for w in r.registry.workers()]) == [0] * len(
        router.live_worker_ids()
    )


# ---- Decode streams end within a bound, naming the worker -------------------------------
# The fakes hang until the bound fires, on any machine. Where a real worker serves too,
# the short idle bounds (0.3-0.5 s) are only liveness limits for it: its messages come
# milliseconds apart (20 ms with the slow mode's delay).


def test_hung_decode_before_any_token_ends_unavailable_naming_the_worker(fakes):
    hung = fakes("d-hung")
    with start_router_in_thread(router_config(decode_idle_timeout_s=0.5)) as router:
        hung.register(router.internal_address)
        with Client(router.address, timeout=30) as c, pytest.raises(grpc.RpcError) as err:
            c.collect(token_ids=ids(100, 5), max_tokens=4, **GREEDY)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        details = err.value.details()
        # Nothing was streamed: it would have moved, but no other decode worker exists.
        assert "no live decode worker left to serve the request (tried ['d-hung'])" in details
        assert f"decode worker d-hung ({hung.address}): sent nothing for 0.5 s" in details
        assert "decode_idle_timeout_s" in details
        assert hung.cancelled.wait(5)  # the worker's call was cancelled, not left open
        assert hung.calls == 1
        drops = router.call(lambda r: list(r.registry.drops))
        assert drops[-1][0] == "d-hung" and drops[-1][1].startswith("Decode stalled: sent nothing")
        hint = explain(err.value, router.address)
        assert "router is up" in hint and "is a router running" not in hint
        router_is_clean(router)


def test_hung_decode_before_any_token_moves_to_another_worker(fakes, real_decode):
    hung = fakes("d-a")  # sorts before d0: on a tie it is chosen first
    with start_router_in_thread(router_config(decode_idle_timeout_s=0.5)) as router:
        hung.register(router.internal_address)
        heartbeat(router.internal_address, real_decode.stats())
        with Client(router.address, timeout=30) as c:
            (got,) = c.collect(token_ids=ids(200, 5), max_tokens=4, **GREEDY)
        assert got.usage.completion_tokens == 4
        assert hung.calls == 1 and hung.cancelled.wait(5)
        assert counter(router, "decode_retries") == 1
        router_is_clean(router)
    quiescent(real_decode)


def test_hung_decode_mid_stream_ends_unavailable_naming_the_worker(fakes):
    hung = fakes("d-hung", steps=2)
    with start_router_in_thread(router_config(decode_idle_timeout_s=0.5)) as router:
        hung.register(router.internal_address)
        got = []
        with Client(router.address, timeout=30) as c, pytest.raises(grpc.RpcError) as err:
            for r in c.generate(token_ids=ids(300, 5), max_tokens=50, **GREEDY):
                got.append(r.token_ids[0])
        assert got == [7, 8]  # what was streamed reached the client; then no move
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert err.value.details() == (
            f"decode worker d-hung ({hung.address}) (after 2 streamed messages): "
            "sent nothing for 0.5 s (decode_idle_timeout_s): stream cancelled"
        )
        assert hung.cancelled.wait(5) and hung.calls == 1
        router_is_clean(router)


def test_stream_of_a_worker_dropped_for_missing_heartbeats_ends_naming_it(fakes):
    """The reported outage: the link to the decode worker is cut mid-stream; the router
    drops it ("no heartbeat") and the client's stream must end too, not hang."""
    config = router_config(worker_timeout_s=1.0, decode_idle_timeout_s=600, decode_drop_grace_s=0.3)
    hung = fakes("d-cut", steps=1)
    with start_router_in_thread(config) as router:
        hung.beat_until_stopped(router.internal_address)
        with Client(router.address, timeout=60) as c, pytest.raises(grpc.RpcError) as err:
            for _ in c.generate(token_ids=ids(400, 5), max_tokens=50, **GREEDY):
                hung.stop_beating()  # the first token arrived; now the link goes quiet
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert err.value.details() == (
            f"decode worker d-cut ({hung.address}) (after 1 streamed messages): the worker "
            "left the registry (no heartbeat for 1 s) and sent nothing for 0.3 s after "
            "(decode_drop_grace_s): stream cancelled"
        )
        assert hung.cancelled.wait(5)
        router_is_clean(router)


# ---- retries: at most once, never for the request's own fault ---------------------------


@pytest.mark.parametrize(
    ("code", "calls"), [(grpc.StatusCode.INTERNAL, 2), (grpc.StatusCode.INVALID_ARGUMENT, 1)]
)
def test_a_batch_failure_is_retried_at_most_once_a_bad_request_never(fakes, code, calls):
    """INTERNAL (the batch failed): the first choice and one retry. INVALID_ARGUMENT (the
    request's own fault): no retry. Neither is the worker's death: all stay routable."""
    failing = [fakes(f"d-{i}", fail=(code, "engine step failed: boom")) for i in range(3)]
    with start_router_in_thread(router_config()) as router:
        for f in failing:
            f.register(router.internal_address)
        with Client(router.address, timeout=30) as c, pytest.raises(grpc.RpcError) as err:
            c.collect(token_ids=ids(500, 5), max_tokens=4, **GREEDY)
        assert err.value.code() == code
        assert sum(f.calls for f in failing) == calls
        assert counter(router, "decode_retries") == calls - 1
        last = [f for f in failing if f.calls][-1]
        assert err.value.details() == (
            f"decode worker {last.worker_id} ({last.address}): engine step failed: boom"
        )
        assert set(router.live_worker_ids()) == {"d-0", "d-1", "d-2"}
        router_is_clean(router)


def test_a_prefill_past_its_bound_falls_back_to_local_prefill(fakes, real_decode):
    slow = fakes("p-slow", pool=worker_pb2.WORKER_POOL_PREFILL)
    with start_router_in_thread(router_config(prefill_timeout_s=0.5)) as router:
        slow.register(router.internal_address)
        heartbeat(router.internal_address, real_decode.stats())
        with Client(router.address, timeout=30) as c:
            (got,) = c.collect(token_ids=ids(700, 20), max_tokens=3, **GREEDY)  # >= 8: Prefill
        assert got.usage.completion_tokens == 3
        assert slow.calls == 1 and slow.cancelled.wait(5)
        assert counter(router, "prefill_retries") == 1
        assert counter(router, "local_prefill_fallback") == 1
        router_is_clean(router)
    quiescent(real_decode)


# ---- a full worker answers RESOURCE_EXHAUSTED; the router goes elsewhere ----------------


def test_waiting_queue_bound_refuses_before_holding_anything():
    engine = LLMEngine(engine_config(num_blocks=128, max_waiting=2))
    params = SamplingParams(max_tokens=2, **GREEDY)
    engine.add_request("a", prompt_token_ids=ids(1, 5), params=params)
    engine.add_request("b", prompt_token_ids=ids(2, 5), params=params)
    with pytest.raises(QueueFullError, match=r"2 sequences waiting, max_num_waiting_seqs 2"):
        engine.add_request("c", prompt_token_ids=ids(3, 5), params=params)
    assert set(engine.requests) == {"a", "b"}
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("c", prompt_token_ids=ids(3, 5), params=params)  # room again
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.usage() == 0
    engine.check_integrity()
    with pytest.raises(ConfigError, match="max_num_waiting_seqs must be >= 1 or None"):
        SchedulerConfig(max_num_waiting_seqs=0)


def engine_config(num_blocks: int, max_waiting: int | None) -> EngineConfig:
    scheduler = SchedulerConfig(max_model_len=MAX_MODEL_LEN, max_num_waiting_seqs=max_waiting)
    return dataclasses.replace(tiny_engine_config(num_blocks=num_blocks), scheduler=scheduler)


def fill(rt: WorkerRuntime) -> None:
    """Makes `rt`'s pool full and one request wait: a held prefill-only request takes 13
    of the 16 blocks, then a 100-token prompt (7 blocks) cannot be admitted."""
    hold = SamplingParams(max_tokens=8, **GREEDY)  # > 1: a finished sample is not held
    rt.loop.call(
        lambda e: e.add_request(
            "hold", prompt_token_ids=ids(1, 200), params=hold, prefill_only=True
        )
    )
    wait_for(lambda: rt.loop.call(lambda e: "hold" in e.handoff.held), what="the held request")
    rt.loop.call(
        lambda e: e.add_request("waiter", prompt_token_ids=ids(2, 100), params=SamplingParams())
    )


def unfill(rt: WorkerRuntime) -> None:
    rt.loop.call(lambda e: (e.handoff.export_end("hold"), e.abort_request("waiter")))
    quiescent(rt)


@pytest.fixture
def small_worker():
    """Real decode workers with a 16-block pool, as `small_worker(id, **WorkerConfig)`."""
    made: list[WorkerRuntime] = []

    def make(worker_id: str, max_waiting: int | None = 1024, **overrides) -> WorkerRuntime:
        engine = engine_config(num_blocks=16, max_waiting=max_waiting)
        cfg = WorkerConfig(worker_id=worker_id, pool="decode", engine=engine, **overrides)
        made.append(start_worker(cfg))
        return made[-1]

    yield make
    for rt in made:
        rt.stop(grace=0.5)


def test_full_waiting_queue_is_resource_exhausted_and_the_request_moves(small_worker):
    full = small_worker("d-full", max_waiting=1)
    room = small_worker("d-room")
    with start_router_in_thread(router_config()) as router:
        heartbeat(router.internal_address, full.stats())  # idle when it reported: chosen first
        fill(full)
        with Client(router.address, timeout=30) as c:
            with pytest.raises(grpc.RpcError) as err:
                c.collect(token_ids=ids(800, 5), max_tokens=3, **GREEDY)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert err.value.details() == (
                "every live decode worker is full (refused by ['d-full']): retry later"
            )
            assert router.live_worker_ids() == ["d-full"]  # full is not down

            heartbeat(router.internal_address, room.stats())
            (got,) = c.collect(token_ids=ids(800, 5), max_tokens=3, **GREEDY)
            assert got.usage.completion_tokens == 3
        assert counter(router, "decode_refused") == 2
        assert counter(router, "decode_retries") == 0  # a refusal is not a retry
        assert full.loop.call(lambda e: [s.request.request_id for s in e.scheduler.waiting]) == [
            "waiter"
        ]
        router_is_clean(router)
    unfill(full)
    quiescent(room)


def test_worker_out_of_rpc_threads_is_resource_exhausted_and_the_request_moves(small_worker):
    busy = small_worker("d-busy", max_rpc_threads=1)
    room = small_worker("d-room")
    idle = busy.stats()  # what the router will see: chosen first (d-busy < d-room)
    fill(busy)
    # The one RPC thread is taken by a Decode that waits for blocks.
    with grpc.insecure_channel(busy.address) as ch:
        waiting = worker_pb2_grpc.DecodeStub(ch).Decode(
            worker_pb2.DecodeRequest(
                request=worker_pb2.TokenizedRequest(
                    request_id="blocked", prompt_token_ids=ids(3, 100)
                )
            ),
            timeout=30,
        )
        wait_for(lambda: busy.loop.call(lambda e: "blocked" in e.requests), what="blocked")
        with start_router_in_thread(router_config()) as router:
            heartbeat(router.internal_address, idle)
            heartbeat(router.internal_address, room.stats())
            with Client(router.address, timeout=30) as c:
                (got,) = c.collect(token_ids=ids(900, 5), max_tokens=3, **GREEDY)
            assert got.usage.completion_tokens == 3
            assert counter(router, "decode_refused") == 1
            router_is_clean(router)
        waiting.cancel()
    unfill(busy)
    wait_for(lambda: busy.loop.call(lambda e: list(e.requests)) == [], what="blocked to end")
    quiescent(room)


# ---- channels of departed workers are closed ---------------------------------------------


def test_channels_of_departed_workers_are_closed(fakes, real_decode):
    config = router_config(decode_idle_timeout_s=0.3)
    gone = fakes("d-gone")
    with start_router_in_thread(config) as router:
        gone.register(router.internal_address)
        with Client(router.address, timeout=30) as c, pytest.raises(grpc.RpcError):
            c.collect(token_ids=ids(1000, 5), max_tokens=3, **GREEDY)  # opens the channel
        # The stalled worker was marked down and its call ended: channel closed.
        assert router.call(lambda r: sorted(r._channels)) == []
        assert counter(router, "channels_closed") == 1

        # A worker restarted by Ray on a new port: the old address's channel goes.
        heartbeat(router.internal_address, real_decode.stats())
        with Client(router.address, timeout=30) as c:
            c.collect(token_ids=ids(1001, 5), max_tokens=2, **GREEDY)
        old = router.call(lambda r: r._channels[real_decode.address])
        moved = real_decode.stats()
        moved.address = gone.address  # any other address
        heartbeat(router.internal_address, moved)
        assert router.call(lambda r: sorted(r._channels)) == []
        wait_for(lambda: old._channel.closed(), what="the old channel to close")
        # A clean goodbye with no call open closes nothing more (nothing was opened).
        goodbye(router.internal_address, "d0")
        assert counter(router, "channels_closed") == 2
    quiescent(real_decode)


# ---- input limits --------------------------------------------------------------------------

LIMITS = dict(
    max_request_id_bytes=32,
    max_cache_salt_bytes=64,
    max_prompt_bytes=4096,
    max_messages=4,
)
BAD_INPUTS = [
    (
        dict(prompt="hi", request_id="r" * 33),
        "request_id is 33 bytes (UTF-8), more than the limit of 32",
    ),
    (dict(prompt="hi", request_id="é" * 17), "request_id is 34 bytes (UTF-8)"),
    (
        dict(prompt="hi", cache_salt="s" * 65),
        "cache_salt is 65 bytes (UTF-8), more than the limit of 64",
    ),
    (dict(prompt="x" * 4097), "prompt is 4097 bytes (UTF-8), more than the limit of 4096"),
    (
        dict(messages=[{"role": "user", "content": "hi"}] * 5),
        "messages has 5 turns, more than the limit of 4 (RouterConfig.max_messages)",
    ),
    (
        dict(messages=[{"role": "user", "content": "y" * 2045}] * 2),
        "messages hold 4098 bytes of roles and contents (UTF-8), more than the limit of 4096",
    ),
]


def test_input_limits_are_invalid_argument_and_touch_nothing(real_decode):
    with start_router_in_thread(router_config(**LIMITS)) as router:
        heartbeat(router.internal_address, real_decode.stats())
        before = real_decode.stats()
        with Client(router.address, timeout=30) as c:
            for kwargs, message in BAD_INPUTS:
                with pytest.raises(grpc.RpcError) as err:
                    c.collect(**kwargs)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, kwargs
                assert message in err.value.details(), (message, err.value.details())
                assert explain(err.value, router.address) == ""
            # At the limits exactly: accepted.
            (ok,) = c.collect(
                prompt="hi", request_id="r" * 32, cache_salt="s" * 64, max_tokens=1, **GREEDY
            )
            assert ok.usage.completion_tokens == 1
        assert counter(router, "invalid") == len(BAD_INPUTS)
        after = real_decode.stats()
        assert after.prefix_query_tokens - before.prefix_query_tokens == ok.usage.prompt_tokens
        router_is_clean(router)
    quiescent(real_decode)


def test_bad_utf8_is_invalid_argument_and_oversized_requests_are_refused_unparsed():
    with start_router_in_thread(router_config(**LIMITS)) as router:
        good = gen_pb.GenerateRequest(prompt="héllo").SerializeToString()
        bad = good.replace("é".encode(), b"\xff\xfe")
        with grpc.insecure_channel(router.address) as ch:
            raw = ch.unary_stream(
                "/pagedserve.v1.Generation/Generate",
                request_serializer=lambda b: b,
                response_deserializer=gen_pb.GenerateResponse.FromString,
            )
            with pytest.raises(grpc.RpcError) as err:
                list(raw(bad, timeout=10))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "String field had bad UTF-8" in err.value.details()
            assert "must be valid UTF-8" in err.value.details()
            assert counter(router, "invalid") == 1

            limit = router.call(lambda r: r.frontend.max_request_bytes())
            huge = gen_pb.GenerateRequest(prompt="hi", cache_salt="s" * limit)
            with pytest.raises(grpc.RpcError) as err:
                list(raw(huge.SerializeToString(), timeout=10))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "larger than max" in err.value.details()
            assert "larger than the router accepts" in explain(err.value, router.address)
            assert counter(router, "requests") == 1  # the huge one never reached the handler
        router_is_clean(router)


def test_tokenizing_and_hashing_run_off_the_event_loop(real_decode, monkeypatch):
    import pagedserve.router.routing as routing_mod

    seen: dict[str, str] = {}

    def on_thread(name: str, fn):
        def spy(*args):
            seen[name] = threading.current_thread().name
            return fn(*args)

        return spy

    monkeypatch.setattr(routing_mod, "hash_chain", on_thread("hash", routing_mod.hash_chain))
    with start_router_in_thread(router_config(prefix=PrefixRouting())) as router:
        heartbeat(router.internal_address, real_decode.stats())
        frontend = router.call(lambda r: r.frontend)
        monkeypatch.setattr(frontend, "tokenize", on_thread("tokenize", frontend.tokenize))
        with Client(router.address, timeout=30) as c:
            c.collect(prompt="The quick brown fox jumps over the lazy dog", max_tokens=1)
    assert seen["tokenize"].startswith("router-frontend")
    assert seen["hash"].startswith("router-frontend")
    quiescent(real_decode)


def test_client_hint_says_what_happened():
    with Client("127.0.0.1:1", timeout=5) as c, pytest.raises(grpc.RpcError) as err:
        c.collect(prompt="hi")
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert explain(err.value, "127.0.0.1:1") == (
        "cannot reach the router at 127.0.0.1:1: is one running? (`pagedserve up`)"
    )


def test_router_config_refuses_nonsense_bounds():
    for name in ("decode_idle_timeout_s", "prefill_timeout_s", "decode_drop_grace_s"):
        with pytest.raises(ConfigError, match=f"{name} must be > 0"):
            RouterConfig(**{name: 0})
    with pytest.raises(ConfigError, match="max_messages must be >= 1"):
        RouterConfig(max_messages=0)
