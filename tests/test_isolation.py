"""A request can only fail itself.

Greedy requests run in the same batch as one request whose per-request path fails:
its sampling, its detokenizing, its stop-string matching, its final flush. Only that
request ends, with its reason (`RequestOutput.error`: INVALID_ARGUMENT when its own
parameters made it fail, INTERNAL otherwise); every other request produces exactly the
tokens it produces alone, every block returns, `check_integrity()` holds. Then the same
through real prefill and decode workers over gRPC on loopback.

The faults are injected by test-only stand-ins, named as such: `FaultInjectionSampler`
(the engine's real sampler, raising after it has drawn, for rows carrying a marker
seed, as the old sampler raised "index ... is out of bounds" on some parameters) and
`FaultInjectionDetokenizer` (the real detokenizer, raising in one chosen method). The
parameter combination that really used to crash the sampler is run as it is.
"""

from __future__ import annotations

import threading

import grpc
import pytest
import torch
from builders import one_torch_thread, started_workers, tiny_checkpoint  # noqa: F401
from router_fixtures import engine_held, wait_for
from test_workers import tokenized, wait_clean

from pagedserve.common.api.outputs import ErrorKind, FinishReason, RequestOutput
from pagedserve.common.api.sampling_params import SamplingParams
from pagedserve.common.core.config import CacheConfig, EngineConfig, SchedulerConfig
from pagedserve.common.core.detokenizer import IncrementalDetokenizer
from pagedserve.common.core.engine import LLMEngine
from pagedserve.common.core.llm import LLM, RequestFailedError
from pagedserve.common.core.sampler import Sampler
from pagedserve.common.runtime.worker import WorkerConfig, WorkerRuntime
from pagedserve.v1 import worker_pb2, worker_pb2_grpc

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
FAULT_SEED = 424242  # the marker FaultInjectionSampler fails on
# Sampled with a seed: its tokens must not change when a neighbour's sampling fails.
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True)
# Used to raise "index V is out of bounds" inside step() (tiny penalty, then tiny
# temperature: l / T overflowed to inf, inf - inf = NaN weights): it must now sample.
USED_TO_CRASH = SamplingParams(
    temperature=1e-30, top_p=0.5, repetition_penalty=1e-30, max_tokens=24, ignore_eos=True
)


class FaultInjectionSampler(Sampler):
    """FAULT INJECTION (test only): the real sampler, which then raises when a row's
    request has seed FAULT_SEED, after the batch's seeded generators have drawn.
    `fault_batches` records the rows of every call it failed."""

    def __init__(self) -> None:
        self.fault_batches: list[int] = []

    def __call__(self, logits, params, generators, output_token_ids, prompt_token_ids):
        out = super().__call__(logits, params, generators, output_token_ids, prompt_token_ids)
        if any(p.seed == FAULT_SEED for p in params):
            self.fault_batches.append(len(params))
            raise IndexError(f"index {logits.shape[1]} is out of bounds (injected fault)")
        return out


class FaultInjectionDetokenizer(IncrementalDetokenizer):
    """FAULT INJECTION (test only): the real detokenizer whose `method` raises on its
    `after`-th call."""

    def __init__(self, real: IncrementalDetokenizer, method: str, after: int = 3) -> None:
        self.__dict__.update(real.__dict__)
        self._fault_method, self._fault_calls, self._fault_after = method, 0, after
        real_method = getattr(self, method)

        def faulty(*args, **kwargs):
            self._fault_calls += 1
            if self._fault_calls >= self._fault_after:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected fault")
            return real_method(*args, **kwargs)

        setattr(self, method, faulty)


def inject_detokenizer_fault(engine: LLMEngine, request_id: str, method: str, after=3) -> None:
    for seq in engine.requests[request_id].seqs:
        seq.detokenizer = FaultInjectionDetokenizer(seq.detokenizer, method, after)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (int(k),), generator=g).tolist() for k in range(9, 9 + n)]


def engine_config(**sched) -> EngineConfig:
    return EngineConfig(
        model=str(tiny_checkpoint("llama")),
        dtype="float32",
        cache=CacheConfig(num_blocks=96),
        scheduler=SchedulerConfig(max_model_len=256, **sched),
    )


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(config=engine_config())


@pytest.fixture(scope="module")
def alone(llm):
    """Tokens of each (prompt, params) run alone in the engine, memoized."""
    memo: dict[tuple, list[int]] = {}

    def run(prompt: list[int], params: SamplingParams) -> list[int]:
        key = (tuple(prompt), repr(params))
        if key not in memo:
            memo[key] = llm.generate([prompt], params)[0].completions[0].token_ids
        return memo[key]

    return run


def run_all(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def tokens_of(outs: list[RequestOutput], index: int = 0) -> list[int]:
    return [t for o in outs for d in o.samples if d.index == index for t in d.token_ids]


def assert_pool_clean(engine: LLMEngine) -> None:
    engine.check_integrity()
    assert not engine.requests and not engine.handoff.held
    assert engine.block_manager.usage() == 0.0
    assert engine.block_manager.num_free_blocks() == engine.block_manager.num_blocks


def add_batch(engine: LLMEngine, ps: list[list[int]], faulty: SamplingParams) -> None:
    """ps[0] with SEEDED, ps[1] faulty, the rest greedy, all in one batch."""
    for i, p in enumerate(ps):
        params = SEEDED if i == 0 else faulty if i == 1 else GREEDY
        engine.add_request(f"r{i}", prompt_token_ids=p, params=params)


def assert_neighbours_unaffected(outs, ps, alone) -> None:
    for i, p in enumerate(ps):
        if i == 1:
            continue
        assert outs[f"r{i}"][-1].error is None
        expected = alone(p, SEEDED if i == 0 else GREEDY)
        assert tokens_of(outs[f"r{i}"]) == expected, f"r{i} changed by r1's failure"


# -- engine ------------------------------------------------------------------------------


def test_params_that_used_to_crash_the_step_now_sample(llm, alone) -> None:
    engine = llm.engine
    ps = prompts(4, seed=1)
    add_batch(engine, ps, USED_TO_CRASH)
    outs = run_all(engine)  # raised out of step() before the sampler fix
    assert outs["r1"][-1].error is None
    assert len(tokens_of(outs["r1"])) == 24
    assert all(0 <= t < engine.spec.vocab_size for t in tokens_of(outs["r1"]))
    assert_neighbours_unaffected(outs, ps, alone)
    assert_pool_clean(engine)


def test_sampler_fault_fails_only_its_request(llm, alone) -> None:
    engine = llm.engine
    ps = prompts(4, seed=2)
    faulty = SamplingParams(temperature=0.8, seed=FAULT_SEED, max_tokens=24, ignore_eos=True)
    real = engine.sampler
    engine.sampler = fault = FaultInjectionSampler()
    try:
        add_batch(engine, ps, faulty)
        outs = run_all(engine)
    finally:
        engine.sampler = real
    assert fault.fault_batches == [4, 1]  # the whole batch, then r1's row on its own
    last = outs["r1"][-1]
    assert last.finished and last.error is not None
    assert last.error.kind is ErrorKind.INVALID_ARGUMENT  # greedy works on its rows
    assert "out of bounds (injected fault)" in last.error.message
    assert "seed=424242" in last.error.message and "change these parameters" in last.error.message
    assert [d.finish_reason for d in last.samples] == [FinishReason.ABORT]
    assert tokens_of(outs["r1"]) == []  # it never got a token
    # The seeded neighbour's generator was rewound after the failed batched call.
    assert_neighbours_unaffected(outs, ps, alone)
    assert_pool_clean(engine)


@pytest.mark.parametrize(
    "method, kind",
    [("add", "detokenizing"), ("_find_stop", "stop strings"), ("flush", "at finish")],
)
def test_detokenizer_and_stop_string_faults_fail_only_their_request(
    llm, alone, method, kind
) -> None:
    engine = llm.engine
    ps = prompts(4, seed=3)
    faulty = SamplingParams(temperature=0, max_tokens=6, stop=["never-matches"], ignore_eos=True)
    add_batch(engine, ps, faulty)
    inject_detokenizer_fault(engine, "r1", method, after=1 if method == "flush" else 3)
    outs = run_all(engine)
    last = outs["r1"][-1]
    assert last.finished and last.error is not None, kind
    assert last.error.kind is ErrorKind.INTERNAL
    assert "detokenizing or matching stop strings" in last.error.message
    assert "UnicodeDecodeError" in last.error.message and "injected fault" in last.error.message
    expected_tokens = 6 if method == "flush" else 3  # the token whose text failed included
    assert tokens_of(outs["r1"]) == alone(ps[1], faulty)[:expected_tokens]
    assert_neighbours_unaffected(outs, ps, alone)
    assert_pool_clean(engine)


def test_parallel_samples_fail_together_and_prefill_role_frees_held_blocks(llm) -> None:
    engine = llm.engine
    ps = prompts(3, seed=4)
    engine.sampler, real = FaultInjectionSampler(), engine.sampler
    try:
        engine.add_request(
            "n3",
            prompt_token_ids=ps[0],
            params=SamplingParams(temperature=0.8, n=3, seed=FAULT_SEED, max_tokens=8),
        )
        engine.add_request(
            "pf",
            prompt_token_ids=ps[1],
            params=SamplingParams(temperature=0.8, n=2, seed=FAULT_SEED, max_tokens=8),
            prefill_only=True,
        )
        engine.add_request("ok", prompt_token_ids=ps[2], params=GREEDY, prefill_only=True)
        outs = run_all(engine)
    finally:
        engine.sampler = real
    for rid, n in (("n3", 3), ("pf", 2)):
        assert (
            outs[rid][-1].error is not None
            and outs[rid][-1].error.kind is ErrorKind.INVALID_ARGUMENT
        )
        assert sorted(d.index for d in outs[rid][-1].samples) == list(range(n))
    assert outs["ok"][-1].error is None and len(tokens_of(outs["ok"])) == 1
    assert list(engine.handoff.held) == ["ok"]  # the healthy prefill-only request is held
    engine.handoff.export_end("ok")
    assert_pool_clean(engine)


def test_llm_reports_the_failure_for_that_prompt_only(llm, alone) -> None:
    ps = prompts(3, seed=5)
    faulty = SamplingParams(temperature=0.8, seed=FAULT_SEED, max_tokens=24, ignore_eos=True)
    llm.engine.sampler, real = FaultInjectionSampler(), llm.engine.sampler
    try:
        results = llm.generate(ps, [GREEDY, faulty, GREEDY])
    finally:
        llm.engine.sampler = real
    assert [r.error is None for r in results] == [True, False, True]
    assert results[1].error.kind is ErrorKind.INVALID_ARGUMENT
    assert results[1].completions[0].finish_reason is FinishReason.ABORT
    with pytest.raises(RequestFailedError, match="invalid_argument.*injected fault"):
        results[1].raise_for_error()
    for i in (0, 2):
        assert results[i].raise_for_error().completions[0].token_ids == alone(ps[i], GREEDY)
    assert_pool_clean(llm.engine)


# -- workers over gRPC ------------------------------------------------------------------


@pytest.fixture(scope="module")
def workers():
    ec = engine_config()
    prefill, decode = WorkerConfig("iso-p", "prefill", ec), WorkerConfig("iso-d", "decode", ec)
    with started_workers({"pre": prefill, "dec": decode}) as rts:
        for rt in rts.values():  # swapped on the loop thread, before any request
            rt.loop.call(lambda e: setattr(e, "sampler", FaultInjectionSampler()))
        yield rts


def decode_stub(rt: WorkerRuntime):
    return worker_pb2_grpc.DecodeStub(grpc.insecure_channel(rt.address))


@pytest.mark.parametrize("fault", ["sampler", "detokenizer"])
def test_decode_worker_fails_one_stream_and_finishes_the_other(workers, alone, fault) -> None:
    dec = workers["dec"]
    ps = prompts(2, seed=6)
    good = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    bad = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    good_in_flight: list[bool] = []  # at the bad request's fault: was "good" running?
    if fault == "sampler":
        bad = SamplingParams(temperature=0.8, seed=FAULT_SEED, max_tokens=40, ignore_eos=True)
        sampler = dec.engine.sampler
        sampler.fault_batches.clear()
    else:

        def hook(engine: LLMEngine) -> None:  # FAULT INJECTION, once the request is in
            if "bad" in engine.requests and not good_in_flight:
                inject_detokenizer_fault(engine, "bad", "add", after=2)
                good_in_flight.append("good" in engine.requests)

        dec.loop.step_hooks.append(hook)
    errors: list[grpc.RpcError] = []

    def run_bad() -> None:
        try:
            for _ in decode_stub(dec).Decode(
                worker_pb2.DecodeRequest(request=tokenized("bad", ps[1], bad)), timeout=30
            ):
                pass
        except grpc.RpcError as e:
            errors.append(e)

    # "good" held after its first step until "bad" is in the engine: the two share the
    # next batch on any machine (200 tokens could otherwise end before "bad" arrives).
    with engine_held([dec]) as held:
        good_stream = decode_stub(dec).Decode(
            worker_pb2.DecodeRequest(request=tokenized("good", ps[0], good)), timeout=30
        )
        first = next(good_stream)  # "good" is in the batch before "bad" arrives
        got = list(first.response.token_ids)
        held.wait()
        t = threading.Thread(target=run_bad)
        t.start()
        wait_for(lambda: dec.loop.call(lambda e: "bad" in e.requests), what="bad to arrive")
    for step in good_stream:
        got += step.response.token_ids
    t.join(30)
    if fault == "detokenizer":
        dec.loop.step_hooks.remove(hook)
    else:  # the batched call held both rows, then "bad" failed alone
        good_in_flight.append(sampler.fault_batches == [2, 1])
    assert good_in_flight == [True], "the two requests never shared a batch"
    assert got == alone(ps[0], good)
    assert len(errors) == 1
    if fault == "sampler":
        assert errors[0].code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "injected fault" in errors[0].details()
        assert "change these parameters" in errors[0].details()
    else:
        assert errors[0].code() == grpc.StatusCode.INTERNAL
        assert "detokenizing or matching stop strings" in errors[0].details()
    wait_clean(dec)


def test_prefill_worker_returns_invalid_argument_and_keeps_no_blocks(workers) -> None:
    pre = workers["pre"]
    stub = worker_pb2_grpc.PrefillStub(grpc.insecure_channel(pre.address))
    bad = SamplingParams(temperature=0.8, n=2, seed=FAULT_SEED, max_tokens=8)
    with pytest.raises(grpc.RpcError) as err:
        stub.Prefill(worker_pb2.PrefillRequest(request=tokenized("pbad", prompts(1)[0], bad)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "injected fault" in err.value.details()
    ok = stub.Prefill(
        worker_pb2.PrefillRequest(request=tokenized("pok", prompts(1, seed=9)[0], GREEDY))
    )
    assert len(ok.first_tokens) == 1
    stub.ReleaseLease(worker_pb2.ReleaseLeaseRequest(lease_id=ok.lease_id))
    wait_clean(pre)
