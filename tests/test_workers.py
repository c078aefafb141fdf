"""The worker roles over real gRPC on loopback, without Ray or the router.

A prefill worker and decode workers run in this process (each with its engine loop
thread and gRPC server); the test plays the router's part with the generated stubs.
"""

from __future__ import annotations

import time

import grpc
import pytest
import torch
from builders import one_torch_thread, started_workers, tiny_checkpoint  # noqa: F401
from router_fixtures import engine_held, wait_for

from pagedserve.common.api.sampling_params import SamplingParams
from pagedserve.common.core.config import CacheConfig, EngineConfig, SchedulerConfig
from pagedserve.common.core.llm import LLM
from pagedserve.common.runtime.protocol import sampling_to_pb
from pagedserve.common.runtime.worker import WorkerConfig, WorkerRuntime
from pagedserve.v1 import generation_pb2, worker_pb2, worker_pb2_grpc

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def engine_config() -> EngineConfig:
    return EngineConfig(
        model=str(tiny_checkpoint("llama")),
        dtype="float32",  # compared token for token with an fp32 reference
        cache=CacheConfig(num_blocks=96),
        scheduler=SchedulerConfig(max_model_len=256),
    )


@pytest.fixture(scope="module")
def workers():
    ec = engine_config()
    configs = {
        "pre": WorkerConfig("p0", "prefill", ec),  # in-place exports (the default)
        # Staged exports: the copy that the checksum tests corrupt after it was sealed
        # (an in-place lease has no copy of its own; tests/test_kv_inplace.py covers it).
        "pre_staged": WorkerConfig("p1", "prefill", ec, kv_in_place=False),
        "dec": WorkerConfig("d0", "decode", ec),
        "dec_grpc": WorkerConfig("d1", "decode", ec, kv_transport="grpc"),
        "dec_fail": WorkerConfig(
            "d2", "decode", ec, kv_transport="grpc", transfer_failure_policy="fail"
        ),
    }
    with started_workers(configs) as rts:
        yield rts


@pytest.fixture(scope="module")
def reference():
    llm = LLM(str(tiny_checkpoint("llama")), dtype="float32", num_blocks=64, max_model_len=256)
    return lambda p, params=GREEDY: llm.generate([p], params)[0]


def stub(rt: WorkerRuntime, kind):
    return kind(grpc.insecure_channel(rt.address))


def tokenized(rid: str, prompt: list[int], params: SamplingParams = GREEDY):
    return worker_pb2.TokenizedRequest(
        request_id=rid, prompt_token_ids=prompt, sampling=sampling_to_pb(params)
    )


def decode_all(rt: WorkerRuntime, req, kv=None, **kw):
    """(tokens per sample, last step per sample, the first step's KVImport)."""
    msg = worker_pb2.DecodeRequest(request=req, **kw)
    if kv is not None:
        msg.kv.CopyFrom(kv)
    tokens: dict[int, list[int]] = {}
    last: dict[int, generation_pb2.GenerateResponse] = {}
    info = None
    for step in stub(rt, worker_pb2_grpc.DecodeStub).Decode(msg, timeout=30):
        if step.HasField("kv_import"):
            info = step.kv_import
        r = step.response
        tokens.setdefault(r.index, []).extend(r.token_ids)
        last[r.index] = r
    return tokens, last, info


def wait_clean(*rts: WorkerRuntime, leases: bool = True) -> None:
    """Every request ended: blocks back (free or cached), leases gone, invariants hold."""
    deadline = time.monotonic() + 5  # a liveness bound: it ends in milliseconds
    while time.monotonic() < deadline:
        busy = [rt for rt in rts if rt.engine.block_manager.usage() > 0 or rt.engine.requests]
        if leases:
            busy += [rt for rt in rts if rt.kv_source.open_leases]
        if not busy:
            break
        time.sleep(0.05)
    for rt in rts:
        rt.check_integrity()
        assert rt.engine.block_manager.usage() == 0.0 and not rt.engine.requests
        if leases:
            assert rt.kv_source.open_leases == 0


def prompt(seed: int, n: int = 45) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("which, transport", [("dec", "shm"), ("dec_grpc", "grpc")])
def test_prefill_then_decode_equals_one_engine(workers, reference, which, transport):
    p = prompt(1)
    req = tokenized(f"t-{which}", p)
    handle = stub(workers["pre"], worker_pb2_grpc.PrefillStub).Prefill(
        worker_pb2.PrefillRequest(request=req), timeout=30
    )
    assert handle.num_tokens == len(p) and len(handle.block_ids) == 3
    assert len(handle.block_hashes) == 2 and len(handle.first_tokens) == 1
    tokens, last, info = decode_all(workers[which], req, kv=handle)
    ref = reference(p)
    assert tokens[0] == ref.completions[0].token_ids
    assert info.transport == transport and info.pulled_blocks == 3 and not info.recomputed
    assert last[0].finish_reason == generation_pb2.FINISH_REASON_LENGTH
    assert last[0].usage.prompt_tokens == len(p) and last[0].usage.completion_tokens == 20
    wait_clean(workers["pre"], workers[which])


def test_parallel_seeded_samples_across_workers(workers, reference):
    p = prompt(2, 37)
    params = SamplingParams(temperature=0.8, n=3, seed=5, max_tokens=8, ignore_eos=True)
    req = tokenized("t-n3", p, params)
    handle = stub(workers["pre"], worker_pb2_grpc.PrefillStub).Prefill(
        worker_pb2.PrefillRequest(request=req), timeout=30
    )
    assert len(handle.first_tokens) == 3
    tokens, _, _ = decode_all(workers["dec"], req, kv=handle)
    assert [tokens[i] for i in range(3)] == [c.token_ids for c in reference(p, params).completions]
    wait_clean(workers["pre"], workers["dec"])


def test_local_prefill_without_handle(workers, reference):
    p = prompt(3, 20)
    tokens, _, info = decode_all(workers["dec"], tokenized("t-local", p))
    assert info.transport == "local" and tokens[0] == reference(p).completions[0].token_ids
    wait_clean(workers["dec"])


def test_unpulled_lease_expires_and_frees(workers):
    pre = workers["pre"]
    before = pre.kv_source.expired_total
    handle = stub(pre, worker_pb2_grpc.PrefillStub).Prefill(
        worker_pb2.PrefillRequest(request=tokenized("t-exp", prompt(4)), lease_ttl_ms=200),
        timeout=30,
    )
    assert pre.kv_source.open_leases == 1
    deadline = time.monotonic() + 5
    while pre.kv_source.open_leases and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pre.kv_source.open_leases == 0
    assert pre.kv_source.expired_total == before + 1
    assert pre.stats().expired_leases_total == before + 1
    released = stub(pre, worker_pb2_grpc.PrefillStub).ReleaseLease(
        worker_pb2.ReleaseLeaseRequest(lease_id=handle.lease_id)
    )
    assert not released.released
    wait_clean(pre)


def _corrupt(pre: WorkerRuntime, lease_id: str) -> None:
    """Flip bytes of the staged copy after its checksums were computed (`pre` must
    stage its exports: kv_in_place=False)."""
    staged = pre.kv_source.get(lease_id)
    flat = staged.payload.view(-1)
    flat[:8] = flat[:8] + 1.0


@pytest.mark.parametrize("which", ["dec", "dec_grpc"])
def test_corrupted_chunk_is_recomputed(workers, reference, which):
    p = prompt(5)
    req = tokenized(f"t-bad-{which}", p)
    handle = stub(workers["pre_staged"], worker_pb2_grpc.PrefillStub).Prefill(
        worker_pb2.PrefillRequest(request=req), timeout=30
    )
    _corrupt(workers["pre_staged"], handle.lease_id)
    tokens, _, info = decode_all(workers[which], req, kv=handle)
    assert info.recomputed and "checksum" in info.error.lower()
    assert tokens[0] == reference(p).completions[0].token_ids
    wait_clean(workers["pre_staged"], workers[which])


def test_corrupted_chunk_fails_cleanly_under_fail_policy(workers):
    req = tokenized("t-bad-fail", prompt(6))
    handle = stub(workers["pre_staged"], worker_pb2_grpc.PrefillStub).Prefill(
        worker_pb2.PrefillRequest(request=req), timeout=30
    )
    _corrupt(workers["pre_staged"], handle.lease_id)
    with pytest.raises(grpc.RpcError) as err:
        decode_all(workers["dec_fail"], req, kv=handle)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "checksum" in err.value.details().lower()
    wait_clean(workers["pre_staged"], workers["dec_fail"])


def test_cancelled_decode_returns_blocks(workers):
    dec = workers["dec"]
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    call = stub(dec, worker_pb2_grpc.DecodeStub).Decode(
        worker_pb2.DecodeRequest(request=tokenized("t-cancel", prompt(7), params)), timeout=30
    )
    # Held after 3 steps: still running when cancelled, on any machine.
    with engine_held([dec], after_steps=3):
        for got, _step in enumerate(call, start=1):
            if got == 3:
                break
        assert dec.loop.call(lambda e: e.block_manager.usage()) > 0
        call.cancel()
        # Gone while held: aborted by the cancel, not run to its end.
        wait_for(lambda: not dec.loop.call(lambda e: e.requests), what="the abort")
    wait_clean(dec)


@pytest.mark.parametrize(
    "p, params, match",
    [
        ([], GREEDY, "empty"),
        ([5] * 300, GREEDY, "max_model_len"),
        ([5, 999], GREEDY, "vocab"),
        ([5, 6], SamplingParams(temperature=-1), "temperature"),
        ([5, 6], SamplingParams(n=2, temperature=0), "n"),
    ],
)
def test_bad_requests_are_invalid_argument(workers, p, params, match):
    req = tokenized("t-bad-input", p, params)
    with pytest.raises(grpc.RpcError) as err:
        stub(workers["pre"], worker_pb2_grpc.PrefillStub).Prefill(
            worker_pb2.PrefillRequest(request=req), timeout=10
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert match in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        decode_all(workers["dec"], req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    wait_clean(workers["pre"], workers["dec"])


def test_stats_report_load_and_capacity(workers):
    s = stub(workers["dec"], worker_pb2_grpc.WorkerStatusStub).GetStats(
        worker_pb2.GetStatsRequest()
    )
    assert s.worker_id == "d0" and s.pool == worker_pb2.WORKER_POOL_DECODE
    assert s.num_total_blocks == 96 and s.block_size == 16 and s.address == workers["dec"].address


def test_cross_worker_prefix_pull(workers, reference):
    pre, dec = workers["pre"], workers["dec_grpc"]
    p = prompt(8, 53)  # 3 full blocks + 5 tokens
    stub(pre, worker_pb2_grpc.PrefillStub).Prefill(
        worker_pb2.PrefillRequest(request=tokenized("t-hold", p)), timeout=30
    )  # pre now caches p's 3 full blocks (its lease expires or is unused)
    handle = stub(pre, worker_pb2_grpc.PrefillStub).ExportPrefix(
        worker_pb2.ExportPrefixRequest(token_ids=p), timeout=30
    )
    assert handle.num_tokens == 48 and len(handle.block_ids) == 3
    computed_before = dec.engine.stats().prefill_tokens
    tokens, _, info = decode_all(dec, tokenized("t-reuse", p), prefix=handle)
    assert tokens[0] == reference(p).completions[0].token_ids
    # All 3 full blocks were pulled into dec's prefix cache: only the last 5 tokens computed.
    assert dec.engine.stats().prefill_tokens - computed_before == 53 - 48
    with pytest.raises(grpc.RpcError) as err:
        stub(pre, worker_pb2_grpc.PrefillStub).ExportPrefix(
            worker_pb2.ExportPrefixRequest(token_ids=prompt(9, 40)), timeout=10
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    for rt in (pre, dec):
        for lease in list(rt.kv_source._leases):  # the Prefill above was never decoded
            rt.kv_source.release(lease)
    wait_clean(pre, dec)
