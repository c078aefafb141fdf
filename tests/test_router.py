"""The router over real gRPC on loopback, with in-process workers on a tiny checkpoint.

Outputs are compared with the single-process engine (`LLM`) on the same checkpoint;
after every scenario every worker's pool is back to free-or-cached, no lease is
open and `check_integrity()` holds (`Cluster.wait_quiescent`).
"""

from __future__ import annotations

import asyncio
import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from builders import one_torch_thread, tiny_checkpoint  # noqa: F401 (autouse fixture)
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from router_fixtures import (  # noqa: F401
    MAX_MODEL_LEN,
    ROUTER_CONFIG,
    cluster,
    engine_held,
    wait_for,
)

from pagedserve.common.api.outputs import FinishReason
from pagedserve.common.api.sampling_params import InvalidRequestError, SamplingParams
from pagedserve.common.core.llm import LLM
from pagedserve.router.admission import Admission, AdmissionRejected
from pagedserve.router.client import Client, build_request
from pagedserve.router.config import RouterConfig
from pagedserve.router.frontend import check_known_fields
from pagedserve.router.policy import LeastLoadedPolicy, RouteRequest
from pagedserve.router.registry import WorkerRegistry
from pagedserve.router.server import start_router_in_thread
from pagedserve.v1 import generation_pb2 as gen_pb
from pagedserve.v1 import worker_pb2, worker_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
BLOCK = 16
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(
        str(tiny_checkpoint("llama")), dtype="float32", num_blocks=128, max_model_len=MAX_MODEL_LEN
    )


@pytest.fixture(scope="module")
def client(cluster) -> Client:  # noqa: F811
    with cluster.client() as c:
        yield c


def ids(start: int, length: int) -> list[int]:
    """A prompt of distinct-looking ids inside the tiny vocabulary (320)."""
    return [3 + (start + 7 * i) % 310 for i in range(length)]


def reference(llm: LLM, prompt, **sampling):
    return llm.generate([prompt], SamplingParams(**sampling))[0]


def prefill_query_tokens(cluster) -> int:  # noqa: F811
    return sum(w.stats().prefix_query_tokens for w in cluster.pool("prefill"))


def counters(cluster) -> dict[str, int]:  # noqa: F811
    return cluster.router.call(lambda r: dict(r.counters))


# ---- outputs equal the single-process engine's -----------------------------------------


PROMPTS = [
    ids(1000, 20),  # > disagg_min_prompt_tokens: Prefill + KV transfer
    ids(2000, 45),  # partial last block
    ids(3000, 64),  # exactly 4 blocks
    ids(4000, 3),  # short: the decode worker prefills locally
    "The quick brown fox jumps over",
    "Paged attention keeps",
]


@pytest.mark.parametrize("max_tokens", [1, 24])
def test_greedy_outputs_equal_engine_complete_then_streamed(cluster, client, llm, max_tokens):  # noqa: F811
    for k, prompt in enumerate(PROMPTS):
        if isinstance(prompt, list):  # unique per max_tokens, so the first sight is uncached
            prompt = [prompt[0] + max_tokens, *prompt[1:]]
        kwargs = {"token_ids": prompt} if isinstance(prompt, list) else {"prompt": prompt}
        ref = reference(llm, prompt, max_tokens=max_tokens, **GREEDY)
        want = ref.completions[0]
        n_prompt = len(ref.prompt_token_ids)

        (got,) = client.collect(**kwargs, max_tokens=max_tokens, **GREEDY)
        assert got.token_ids == want.token_ids, f"prompt {k}"
        assert got.text == want.text
        assert got.finish_reason is FinishReason.LENGTH
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (n_prompt, max_tokens)
        if isinstance(prompt, list):
            assert got.usage.cached_tokens == 0  # nobody has seen this prompt yet

        streamed = list(client.generate(**kwargs, max_tokens=max_tokens, **GREEDY))
        assert len(streamed) == max_tokens  # one message per step
        assert [t for r in streamed for t in r.token_ids] == want.token_ids
        assert "".join(r.text for r in streamed) == want.text
        assert [r.finish_reason for r in streamed[:-1]] == [0] * (max_tokens - 1)
        last = streamed[-1]
        assert last.finish_reason == gen_pb.FINISH_REASON_LENGTH
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (n_prompt, max_tokens)
        # Seen once: a worker that computed it holds its full blocks (the one the
        # policy picks this time may be the other one, which holds nothing).
        assert last.usage.cached_tokens in (0, (n_prompt - 1) // BLOCK * BLOCK)
        assert len({r.request_id for r in streamed}) == 1
    cluster.wait_quiescent()


@pytest.mark.parametrize("prompt", [ids(5000, 30), ids(5100, 5)], ids=["prefill", "local"])
def test_seeded_n_samples_equal_engine(cluster, client, llm, prompt):  # noqa: F811
    sampling = dict(n=3, temperature=0.9, top_k=40, seed=1234, max_tokens=12, ignore_eos=True)
    ref = reference(llm, prompt, **sampling)
    got = client.collect(token_ids=prompt, request_id="seeded-" + str(len(prompt)), **sampling)
    assert [c.index for c in got] == [0, 1, 2]
    assert [c.token_ids for c in got] == [c.token_ids for c in ref.completions]
    assert len({tuple(c.token_ids) for c in got}) > 1  # really sampled
    for c in got:
        assert (c.usage.prompt_tokens, c.usage.completion_tokens) == (len(prompt), 12)
    cluster.wait_quiescent()


def test_stop_string_and_stop_token_equal_engine(cluster, client, llm):  # noqa: F811
    prompt = "Once upon a time there was"
    free = reference(llm, prompt, max_tokens=40, **GREEDY).completions[0]
    # A 2-character stop string from the middle of the output (no replacement chars).
    k = next(
        i
        for i in range(4, len(free.text) - 2)
        if "\ufffd" not in free.text[i : i + 2] and free.text[i : i + 2].strip()
    )
    stop = free.text[k : k + 2]
    want = reference(llm, prompt, max_tokens=40, stop=[stop], **GREEDY).completions[0]
    (got,) = client.collect(prompt, max_tokens=40, stop=[stop], **GREEDY)
    assert got.finish_reason is FinishReason.STOP and got.stop_string == stop
    assert (got.text, got.token_ids) == (want.text, want.token_ids)
    assert got.text == free.text[: free.text.index(stop)]

    stop_id = free.token_ids[5]
    want = reference(llm, prompt, max_tokens=40, stop_token_ids=[stop_id], **GREEDY)
    (got,) = client.collect(prompt, max_tokens=40, stop_token_ids=[stop_id], **GREEDY)
    assert got.finish_reason is FinishReason.STOP and got.stop_token_id == stop_id
    assert got.token_ids == want.completions[0].token_ids
    assert got.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]
    cluster.wait_quiescent()


def test_messages_use_the_chat_template(cluster, client, llm):  # noqa: F811
    messages = [
        {"role": "system", "content": "You are a fox."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    prompt_ids = llm.engine.apply_chat_template(messages)
    want = reference(llm, prompt_ids, max_tokens=16, **GREEDY).completions[0]
    (got,) = client.collect(messages=messages, max_tokens=16, **GREEDY)
    assert got.token_ids == want.token_ids
    assert got.usage.prompt_tokens == len(prompt_ids)


# ---- load, cancellation, deadlines ------------------------------------------------------


def test_32_concurrent_streams_complete_and_leave_nothing_behind(cluster, client, llm):  # noqa: F811
    prompts = [ids(6000 + 37 * i, 3 + (i * 5) % 60) for i in range(32)]
    refs = llm.generate(prompts, SamplingParams(max_tokens=12, **GREEDY))
    with ThreadPoolExecutor(32) as pool:
        results = list(
            pool.map(lambda p: client.collect(token_ids=p, max_tokens=12, **GREEDY), prompts)
        )
    for (got,), ref in zip(results, refs, strict=True):
        assert got.token_ids == ref.completions[0].token_ids
        assert got.usage.completion_tokens == 12
    cluster.wait_quiescent()
    assert cluster.router.call(lambda r: (r.active_requests, r.admission.inflight)) == (set(), 0)
    assert all(w.inflight == 0 for w in cluster.router.call(lambda r: r.registry.workers()))


def decode_tokens(cluster) -> int:  # noqa: F811
    return sum(w.loop.call(lambda e: e.stats().decode_tokens) for w in cluster.pool("decode"))


def in_engine(workers, request_id: str) -> bool:
    return any(w.loop.call(lambda e: request_id in e.requests) for w in workers)


def test_client_cancel_mid_stream_aborts_on_the_decode_worker(cluster, client):  # noqa: F811
    before = decode_tokens(cluster)
    decode = cluster.pool("decode")
    # Held after 3 decode steps: the request is mid-stream when cancelled, on any machine.
    with engine_held(decode, after_steps=3) as held:
        call = client.generate(
            token_ids=ids(7000, 20), request_id="cancel-me", max_tokens=230, **GREEDY
        )
        for i, _ in enumerate(call):
            if i == 2:
                break
        held.wait()
        assert in_engine(decode, "cancel-me")
        call.cancel()
        # Gone while the engine is held: aborted by the cancel, not run to its end.
        wait_for(lambda: not in_engine(cluster.workers.values(), "cancel-me"), what="abort")
    cluster.wait_quiescent()
    assert decode_tokens(cluster) - before < 230  # stopped early, not run to the end
    wait_for(lambda: cluster.router.call(lambda r: r.active_requests) == set(), what="router")


# Only has to outlast the request's way to its held step (milliseconds; held.wait()
# checks it got there), not any generation: the deadline passes while it is held.
DEADLINE_S = 1.0


def test_deadline_is_propagated(cluster, client):  # noqa: F811
    before = decode_tokens(cluster)
    decode = cluster.pool("decode")
    with engine_held(decode, after_steps=2) as held:
        with pytest.raises(grpc.RpcError) as err:
            client.collect(
                token_ids=ids(7100, 20),
                request_id="deadline-me",
                max_tokens=230,
                timeout=DEADLINE_S,
                **GREEDY,
            )
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        held.wait(0)  # it was on a decode worker, held there, when the deadline passed
        # The worker learnt of the deadline and aborted it: the engine never ran it out.
        wait_for(lambda: not in_engine(decode, "deadline-me"), what="the worker to abort it")
    cluster.wait_quiescent()
    assert decode_tokens(cluster) - before < 230


# ---- routing ----------------------------------------------------------------------------


def test_short_prompt_skips_prefill(cluster, client, llm):  # noqa: F811
    short, long_ = ids(8000, 7), ids(8100, 8)  # disagg_min_prompt_tokens = 8
    q0, c0 = prefill_query_tokens(cluster), counters(cluster)
    (got,) = client.collect(token_ids=short, max_tokens=6, **GREEDY)
    assert got.token_ids == reference(llm, short, max_tokens=6, **GREEDY).completions[0].token_ids
    assert prefill_query_tokens(cluster) == q0  # no prefill worker saw it
    c1 = counters(cluster)
    assert c1["local_prefill_short"] - c0.get("local_prefill_short", 0) == 1
    assert c1.get("prefill_calls", 0) == c0.get("prefill_calls", 0)

    client.collect(token_ids=long_, max_tokens=6, **GREEDY)  # the control: it does
    assert prefill_query_tokens(cluster) == q0 + len(long_)
    assert counters(cluster)["prefill_calls"] == c0.get("prefill_calls", 0) + 1
    cluster.wait_quiescent()


def dropped(cluster, worker_id: str) -> list[str]:  # noqa: F811
    return [
        why
        for wid, why in cluster.router.call(lambda r: list(r.registry.drops))
        if wid == worker_id
    ]


def test_dead_prefill_worker_retry_then_fallback(cluster, client, llm):  # noqa: F811
    # "p-..." sorts before "p0": on a tie the policy picks the doomed workers first.
    cluster.add_worker("p-dead1", "prefill")
    cluster.crash("p-dead1")  # the router still thinks it is alive
    prompt = ids(9000, 40)
    want = reference(llm, prompt, max_tokens=8, **GREEDY).completions[0].token_ids
    c0 = counters(cluster)
    (got,) = client.collect(token_ids=prompt, max_tokens=8, **GREEDY)
    assert got.token_ids == want
    c1 = counters(cluster)
    assert c1["prefill_retries"] - c0.get("prefill_retries", 0) == 1
    assert c1["prefill_calls"] - c0.get("prefill_calls", 0) == 1  # on p0 or p1
    assert not cluster.registered("p-dead1")
    assert dropped(cluster, "p-dead1")[0].startswith("Prefill failed with UNAVAILABLE")

    # Both choices dead: the decode worker prefills locally.
    cluster.add_worker("p-dead2", "prefill")
    cluster.add_worker("p-dead3", "prefill")
    cluster.crash("p-dead2")
    cluster.crash("p-dead3")
    (got,) = client.collect(token_ids=prompt, max_tokens=8, **GREEDY)
    assert got.token_ids == want
    c2 = counters(cluster)
    assert c2["prefill_retries"] - c1["prefill_retries"] == 2
    assert c2["local_prefill_fallback"] - c1.get("local_prefill_fallback", 0) == 1
    assert c2["prefill_calls"] == c1["prefill_calls"]

    # New requests route around the dead: no more retries.
    for i in range(3):
        client.collect(token_ids=ids(9100 + i, 30), max_tokens=4, **GREEDY)
    c3 = counters(cluster)
    assert (c3["prefill_retries"], c3["prefill_calls"]) == (
        c2["prefill_retries"],
        c2["prefill_calls"] + 3,
    )
    cluster.wait_quiescent()


def test_dead_decode_worker_before_streaming_retries_elsewhere(cluster, client, llm):  # noqa: F811
    cluster.add_worker("d-dead", "decode")
    cluster.crash("d-dead")
    prompt = ids(9500, 40)  # prefilled first: the handle's lease must be released
    c0 = counters(cluster)
    (got,) = client.collect(token_ids=prompt, max_tokens=8, **GREEDY)
    assert got.token_ids == reference(llm, prompt, max_tokens=8, **GREEDY).completions[0].token_ids
    c1 = counters(cluster)
    assert c1["decode_retries"] - c0.get("decode_retries", 0) == 1
    wait_for(lambda: counters(cluster)["leases_released"] - c0.get("leases_released", 0) == 1)
    assert dropped(cluster, "d-dead")[0].startswith("Decode failed with UNAVAILABLE")
    cluster.wait_quiescent()


def test_decode_worker_dying_mid_stream_ends_with_unavailable(cluster, client):  # noqa: F811
    dying = cluster.add_worker("d-dying", "decode")
    got = 0
    # Held after 3 steps: it dies mid-stream, not after streaming all 230 tokens.
    with engine_held([dying], after_steps=3), pytest.raises(grpc.RpcError) as err:
        for _ in client.generate(token_ids=ids(9600, 20), max_tokens=230, **GREEDY):
            got += 1
            if got == 3:
                cluster.crash("d-dying")
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "decode worker d-dying" in err.value.details()
    assert 3 <= got < 230
    assert not cluster.registered("d-dying")
    cluster.wait_quiescent()


# ---- bad requests and overload ------------------------------------------------------------


def unknown_field_request() -> gen_pb.GenerateRequest:
    raw = gen_pb.GenerateRequest(prompt="hello").SerializeToString()
    return gen_pb.GenerateRequest.FromString(raw + bytes([0x98, 0x06, 0x05]))  # field 99 = 5


BAD_REQUESTS = [
    (dict(prompt=""), "prompt is empty"),
    (dict(token_ids=[]), "prompt is empty"),
    (dict(token_ids=ids(0, MAX_MODEL_LEN + 1)), "more than max_model_len"),
    (dict(token_ids=ids(0, 200), max_tokens=100), "exceeds max_model_len"),
    (dict(token_ids=[5, 6, 320]), "outside the vocabulary [0, 320)"),
    (dict(prompt="hi", max_tokens=0), "max_tokens must be at least 1"),
    (dict(prompt="hi", temperature=-0.5), "temperature must be >= 0"),
    (dict(prompt="hi", top_p=0.0), "top_p must be in (0, 1]"),
    (dict(prompt="hi", top_p=1.5), "top_p must be in (0, 1]"),
    (dict(prompt="hi", top_k=-2), "top_k must be -1 or 0"),
    (dict(prompt="hi", n=0, temperature=1.0), "n must be between 1 and 16"),
    (dict(prompt="hi", n=17, temperature=1.0), "n must be between 1 and 16"),
    (dict(prompt="hi", n=2, temperature=0.0), "must be 1 when temperature is 0"),
    (dict(prompt="hi", stop_token_ids=[400]), "stop_token_ids[0]"),
    (dict(prompt="hi", stop=[""]), "stop[0] must not be empty"),
    (dict(prompt="hi", logprobs=21), "logprobs must be between 0 and 20"),
    (dict(prompt="hi", min_p=2.0), "min_p must be in [0, 1]"),
    (dict(prompt="hi", repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(messages=[]), "messages is empty"),
    (dict(messages=[{"role": "", "content": "x"}]), "messages[0].role is empty"),
    (dict(prompt="hi", request_id=""), "request_id must not be empty"),
]


def test_bad_requests_are_invalid_argument_and_take_no_block(cluster, client):  # noqa: F811
    before = [w.stats() for w in cluster.workers.values()]
    for kwargs, message in BAD_REQUESTS:
        with pytest.raises(grpc.RpcError) as err:
            client.collect(**kwargs)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, kwargs
        assert message in err.value.details(), (kwargs, err.value.details())
    stub = client.stub
    for req, message in [
        (gen_pb.GenerateRequest(), "no input: set exactly one of prompt, prompt_token_ids"),
        (unknown_field_request(), "unknown field number(s) [99]"),
    ]:
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(req, timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in err.value.details()
    # Nothing reached a worker: no prefix lookups, no blocks.
    after = [w.stats() for w in cluster.workers.values()]
    for b, a in zip(before, after, strict=True):
        assert a.prefix_query_tokens == b.prefix_query_tokens
        assert a.num_free_blocks == a.num_total_blocks
    assert counters(cluster)["invalid"] >= len(BAD_REQUESTS) + 2


def test_both_inputs_are_refused_by_the_client():
    # proto3's oneof cannot carry two inputs; the client refuses before sending.
    with pytest.raises(ValueError, match="exactly one of prompt, messages and token_ids"):
        build_request("hi", token_ids=[1, 2])
    with pytest.raises(TypeError, match="unknown sampling option"):
        build_request("hi", temprature=0.5)


def test_unknown_enum_value_is_named():
    check_known_fields(worker_pb2.DecodeRequest(on_transfer_failure=2))
    with pytest.raises(InvalidRequestError, match="on_transfer_failure has unknown value 7"):
        check_known_fields(worker_pb2.DecodeRequest(on_transfer_failure=7))


def register_by_heartbeat(address: str, workers) -> None:
    with grpc.insecure_channel(address) as ch:
        stub = worker_pb2_grpc.RegistryStub(ch)
        for w in workers:
            stub.Heartbeat(worker_pb2.HeartbeatRequest(stats=w.stats()), timeout=5)


def test_overload_is_resource_exhausted_at_once(cluster):  # noqa: F811
    config = RouterConfig(
        port=0,
        model=cluster.engine_config.model,
        max_model_len=MAX_MODEL_LEN,
        max_inflight=1,
        max_queued=0,
        worker_timeout_s=60,
        disagg_min_prompt_tokens=8,
    )
    with start_router_in_thread(config) as small, Client(small.address, timeout=30) as c:
        register_by_heartbeat(
            small.internal_address, [cluster.workers["p0"], cluster.workers["d0"]]
        )
        # d0 held after its first step: "held" stays in flight, on any machine.
        with engine_held([cluster.workers["d0"]]):
            held = c.generate(token_ids=ids(9700, 20), request_id="held", max_tokens=230, **GREEDY)
            next(held)  # in flight now
            with pytest.raises(grpc.RpcError) as err:
                c.collect(token_ids=ids(9800, 20), request_id="held", max_tokens=4, **GREEDY)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "request_id 'held' is already in flight" in err.value.details()
            with pytest.raises(grpc.RpcError) as err:
                c.collect(token_ids=ids(9800, 20), max_tokens=4, **GREEDY)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "at capacity (1 requests running, 0 queued" in err.value.details()
            held.cancel()
            wait_for(lambda: small.call(lambda r: r.admission.inflight) == 0, what="slot release")
        (got,) = c.collect(token_ids=ids(9800, 20), max_tokens=4, **GREEDY)
        assert got.usage.completion_tokens == 4
        assert small.call(lambda r: r.admission.rejected_total) == 1
    cluster.wait_quiescent()


def test_admission_queue_is_fifo_and_bounded():
    async def scenario():
        adm = Admission(max_inflight=1, max_queued=2)
        await adm.acquire()
        order: list[str] = []

        async def waiter(name: str) -> None:
            await adm.acquire()
            order.append(name)

        a = asyncio.create_task(waiter("a"))
        b = asyncio.create_task(waiter("b"))
        await asyncio.sleep(0)
        assert adm.queued == 2
        with pytest.raises(AdmissionRejected, match="1 requests running, 2 queued"):
            await adm.acquire()
        a.cancel()  # a waiter that leaves frees its queue place
        await asyncio.sleep(0)
        assert adm.queued == 1
        adm.release()  # handed to b, in-flight stays 1
        await b
        assert (order, adm.inflight, adm.queued) == (["b"], 1, 0)
        adm.release()
        assert adm.inflight == 0

    asyncio.run(scenario())


# ---- registry, policy, health, reflection, model info ---------------------------------------


def stats(worker_id: str, pool=worker_pb2.WORKER_POOL_DECODE, **load) -> worker_pb2.WorkerStats:
    return worker_pb2.WorkerStats(
        worker_id=worker_id, pool=pool, address=f"h:{len(worker_id)}", **load
    )


def test_registry_timeout_goodbye_and_mark_down():
    now = [0.0]
    reg = WorkerRegistry(timeout_s=3.0, clock=lambda: now[0])
    changes = []
    reg.listeners.append(lambda: changes.append(len(reg.workers())))
    a = reg.heartbeat(stats("a"))
    reg.heartbeat(stats("b", worker_pb2.WORKER_POOL_PREFILL))
    assert [w.worker_id for w in reg.candidates("decode")] == ["a"]
    assert [w.worker_id for w in reg.candidates("prefill")] == ["b"]
    now[0] = 2.5
    reg.heartbeat(stats("a"))  # a refreshed, b not
    now[0] = 3.1
    assert reg.sweep() == ["b"]
    assert reg.drops[-1] == ("b", "no heartbeat for 3 s")
    a2 = reg.heartbeat(stats("a", worker_pb2.WORKER_POOL_COLOCATED))  # restarted, new record
    assert not reg.mark_down(a, "stale record")  # the old record no longer drops it
    assert reg.candidates("decode") == [a2] and reg.candidates("prefill") == []
    assert reg.mark_down(a2, "UNAVAILABLE")
    assert reg.goodbye("a") is False and reg.workers() == []
    assert changes == [1, 2, 1, 1, 0]
    with pytest.raises(ValueError, match="unknown pool"):
        reg.heartbeat(stats("c", worker_pb2.WORKER_POOL_UNSPECIFIED))


def test_least_loaded_policy_ranks_by_load_then_id():
    reg = WorkerRegistry()
    idle = reg.heartbeat(stats("w2"))
    busy = reg.heartbeat(stats("w0", num_running=3))
    full = reg.heartbeat(stats("w1", kv_usage=0.9))
    tie = reg.heartbeat(stats("w3"))
    policy = LeastLoadedPolicy()
    rank = policy.rank("decode", RouteRequest("r", [1, 2]), reg.workers())
    assert [s.worker.worker_id for s in rank] == ["w2", "w3", "w0", "w1"]  # 0, 0, 3, 3.6
    idle.inflight = 2  # the router's own calls count before the next heartbeat
    rank = policy.rank("decode", RouteRequest("r", [1, 2]), reg.workers())
    assert [s.worker.worker_id for s in rank] == ["w3", "w2", "w0", "w1"]  # 0, 2, 3, 3.6
    assert rank[0].worker is tie
    assert rank[0].inputs == dict(inflight=0.0, running=0.0, waiting=0.0, kv_usage=0.0)
    assert {s.worker.worker_id: s.score for s in rank}["w1"] == pytest.approx(0.9 * 4)
    assert busy.stats.num_running == 3 and full.stats.kv_usage == pytest.approx(0.9)


def test_health_and_reflection(cluster, client):  # noqa: F811
    assert client.health() == SERVING
    assert client.health("pagedserve.prefill") == SERVING
    assert client.health("pagedserve.decode") == SERVING
    with grpc.insecure_channel(cluster.address) as ch:
        db = ProtoReflectionDescriptorDatabase(ch)
        services = set(db.get_services())
        assert {"pagedserve.v1.Generation", "grpc.health.v1.Health"} <= services
        pool = descriptor_pool.DescriptorPool(db)
        gen = pool.FindServiceByName("pagedserve.v1.Generation")
        assert {m.name for m in gen.methods} == {"Generate", "GetModelInfo"}


def test_model_info(cluster, client, llm):  # noqa: F811
    info = client.model_info()
    assert info.model_name == "llama-0"
    assert (info.max_context_len, info.block_size, info.vocab_size) == (MAX_MODEL_LEN, BLOCK, 320)
    assert set(info.eos_token_ids) == llm.engine.eos_token_ids
    assert info.has_chat_template


def test_router_without_template_refuses_messages_and_other_models(tmp_path, cluster):  # noqa: F811
    model = tmp_path / "no-template"
    shutil.copytree(tiny_checkpoint("llama"), model)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    config = RouterConfig(port=0, model=str(model), max_model_len=MAX_MODEL_LEN)
    with start_router_in_thread(config) as bare, Client(bare.address, timeout=10) as c:
        assert not c.model_info().has_chat_template
        with pytest.raises(grpc.RpcError) as err:
            c.collect(messages=[{"role": "user", "content": "hi"}])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "model 'no-template' has no chat template: send a prompt" in err.value.details()
        # A worker of another model (llama-0) is refused.
        with pytest.raises(grpc.RpcError) as err:
            register_by_heartbeat(bare.internal_address, [cluster.workers["p0"]])
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "serves 'llama-0@" in err.value.details()
        assert "this router serves 'no-template'" in err.value.details()
        assert bare.call(lambda r: r.registry.workers()) == []


def test_health_follows_the_pools_and_no_prefill_pool_means_local_prefill(cluster):  # noqa: F811
    config = RouterConfig(
        port=0, model=cluster.engine_config.model, max_model_len=MAX_MODEL_LEN, worker_timeout_s=60
    )
    with start_router_in_thread(config) as bare, Client(bare.address, timeout=10) as c:
        for service in ("", "pagedserve.prefill", "pagedserve.decode"):
            assert c.health(service) == NOT_SERVING
        with pytest.raises(grpc.RpcError) as err:
            c.collect(prompt="hello there, how are you today?", max_tokens=2)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no live decode worker" in err.value.details()

        register_by_heartbeat(bare.internal_address, [cluster.workers["d0"]])
        wait_for(lambda: c.health("") == SERVING, what="health to follow the registry")
        assert c.health("pagedserve.decode") == SERVING
        assert c.health("pagedserve.prefill") == NOT_SERVING
        (got,) = c.collect(token_ids=ids(9900, 40), max_tokens=3, **GREEDY)
        assert got.usage.completion_tokens == 3
        assert bare.call(lambda r: r.counters["local_prefill_fallback"]) == 1

        with grpc.insecure_channel(bare.internal_address) as ch:
            worker_pb2_grpc.RegistryStub(ch).Goodbye(
                worker_pb2.GoodbyeRequest(worker_id="d0"), timeout=5
            )
        wait_for(lambda: c.health("") == NOT_SERVING, what="health after goodbye")
        assert c.health("pagedserve.decode") == NOT_SERVING
    cluster.wait_quiescent()


# ---- the command line ----------------------------------------------------------------------


def test_cli_generate_streams_the_engine_text(cluster, llm, capsys):  # noqa: F811
    from pagedserve import cli

    prompt = "Once upon a time"
    want = reference(llm, prompt, max_tokens=10, **GREEDY).completions[0].text
    argv = ["generate", prompt, "--address", cluster.address, "--max-tokens", "10"]
    assert cli.main([*argv, "--temperature", "0", "--ignore-eos", "-v"]) == 0
    out, err = capsys.readouterr()
    assert out == want + "\n"
    prompt_tokens = len(llm.engine.tokenize(prompt))
    assert f"[length; prompt {prompt_tokens} tokens" in err and "completion 10 tokens]" in err

    assert cli.main(["generate", "hi", "--address", cluster.address, "--top-p", "2"]) == 1
    assert "error: INVALID_ARGUMENT: top_p must be in (0, 1]" in capsys.readouterr().err


def test_cli_chat_keeps_the_conversation(cluster, llm, capsys, monkeypatch):  # noqa: F811
    import io

    from pagedserve import cli

    monkeypatch.setattr("sys.stdin", io.StringIO("Hello fox\n\nWhat next?\n/exit\nignored\n"))
    argv = ["chat", "--address", cluster.address, "--system", "Be brief."]
    assert cli.main([*argv, "--max-tokens", "8", "--temperature", "0", "--ignore-eos"]) == 0
    out = capsys.readouterr().out

    history = [{"role": "system", "content": "Be brief."}]
    expected = ""
    for turn in ("Hello fox", "What next?"):
        history.append({"role": "user", "content": turn})
        ids_ = llm.engine.apply_chat_template(history)
        answer = reference(llm, ids_, max_tokens=8, **GREEDY).completions[0].text
        history.append({"role": "assistant", "content": answer})
        expected += f"assistant> {answer}\n"
    assert out == expected
