"""Races and leaks on the worker side, over real gRPC on loopback (no Ray, no router).

- A cancel (or deadline, or Abort) during a KV import must not free blocks the
  handler thread is still writing: they could already belong to another sequence.
- A command whose caller timed out waiting for the engine loop must not leave
  blocks behind in `held`, `importing` or `pinned`.
- KV staging is capped: past the cap an export fails with RESOURCE_EXHAUSTED.
- Internal RPCs (PullBlocks, ReleaseLease, the prefix-import pull) have deadlines, so
  a peer that never answers cannot hold a thread and blocks; release threads and
  channels are bounded.

Slow or stuck peers are made deterministic with Events: a transport wrapper whose
sink blocks until the test releases it, an engine command that waits on an Event,
a real gRPC server whose handlers block.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import replace

import grpc
import pytest
import torch
from builders import one_torch_thread, tiny_checkpoint  # noqa: F401

from pagedserve.common.api.sampling_params import SamplingParams
from pagedserve.common.core.config import CacheConfig, EngineConfig, SchedulerConfig
from pagedserve.common.core.engine import LLMEngine
from pagedserve.common.core.engine_loop import EngineBusy, EngineLoop
from pagedserve.common.core.handoff import HandedOver
from pagedserve.common.core.llm import LLM
from pagedserve.common.runtime.leases import LeaseReleaser
from pagedserve.common.runtime.protocol import sampling_to_pb
from pagedserve.common.runtime.worker import WorkerConfig, WorkerRuntime
from pagedserve.kvtransfer import faults
from pagedserve.kvtransfer.handle import ExportedKV
from pagedserve.kvtransfer.segment import segment_name
from pagedserve.kvtransfer.source import SERVICE_NAME
from pagedserve.kvtransfer.transport import (
    ChannelCache,
    GrpcTransport,
    KVTransport,
)
from pagedserve.kvtransfer.wire import KVTransferError
from pagedserve.v1 import kvtransfer_pb2, worker_pb2, worker_pb2_grpc
from pagedserve.worker import start_worker

MAX_LEN = 64


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def engine_config(num_blocks: int = 64) -> EngineConfig:
    return EngineConfig(
        model=str(tiny_checkpoint("llama")),
        dtype="float32",  # outputs are compared token for token with an fp32 reference
        cache=CacheConfig(num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_model_len=MAX_LEN),
    )


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def tokenized(rid: str, p: list[int], params: SamplingParams) -> worker_pb2.TokenizedRequest:
    return worker_pb2.TokenizedRequest(
        request_id=rid, prompt_token_ids=p, sampling=sampling_to_pb(params)
    )


def prefill_stub(rt: WorkerRuntime) -> worker_pb2_grpc.PrefillStub:
    return worker_pb2_grpc.PrefillStub(grpc.insecure_channel(rt.address))


def decode_stub(rt: WorkerRuntime) -> worker_pb2_grpc.DecodeStub:
    return worker_pb2_grpc.DecodeStub(grpc.insecure_channel(rt.address))


def decode(rt: WorkerRuntime, msg: worker_pb2.DecodeRequest, timeout: float = 30):
    """(sample 0's tokens, the KVImport of the first step)."""
    tokens: list[int] = []
    info = None
    for step in decode_stub(rt).Decode(msg, timeout=timeout):
        if step.HasField("kv_import"):
            info = step.kv_import
        tokens.extend(step.response.token_ids)
    return tokens, info


def wait_clean(*rts: WorkerRuntime) -> None:
    """Every request ended: no request, held, importing or pinned state, pools free,
    leases released, invariants hold."""

    def busy(rt: WorkerRuntime) -> bool:
        e = rt.engine
        return bool(
            e.block_manager.usage() > 0
            or e.requests
            or not e.handoff.is_idle()
            or rt.kv_source.open_leases
        )

    deadline = time.monotonic() + 10
    while any(busy(rt) for rt in rts) and time.monotonic() < deadline:
        time.sleep(0.05)
    for rt in rts:
        rt.check_integrity()
        e = rt.engine
        h = e.handoff
        assert (e.requests, h.held, h.importing, h.pinned) == ({}, {}, {}, set())
        assert e.block_manager.usage() == 0.0
        assert rt.kv_source.open_leases == 0


@pytest.fixture(scope="module")
def reference():
    llm = LLM(str(tiny_checkpoint("llama")), dtype="float32", num_blocks=64, max_model_len=MAX_LEN)
    return lambda p, n: llm.generate([p], greedy(n))[0].completions[0].token_ids


@pytest.fixture(scope="module")
def prefill_worker():
    rt = start_worker(WorkerConfig("race-p", "prefill", engine_config()))
    yield rt
    rt.stop(grace=0.2)


def export(pre: WorkerRuntime, rid: str, p: list[int], params: SamplingParams):
    return prefill_stub(pre).Prefill(
        worker_pb2.PrefillRequest(request=tokenized(rid, p, params)), timeout=30
    )


# -- 1. cancel during a KV import ------------------------------------------------------


class GatedTransport(KVTransport):
    """Wraps a worker's real transport: a pull stops before its first chunk reaches the
    sink until the test calls `release`, then goes on. Counts units written after."""

    name = "gated"

    def __init__(self, inner: KVTransport) -> None:
        self.inner = inner
        self.entered = threading.Event()
        self._release = threading.Event()
        self.done = threading.Event()
        self.units_written = 0

    def release(self) -> None:
        self._release.set()

    def pull_into(self, handle, sink, block_ids=None, layers=None, *, timeout=None):
        gate = self

        class GatedSink:
            def bind(self, header):
                gate.entered.set()
                assert gate._release.wait(30), "the test never released the pull"
                sink.bind(header)

            def write_units(self, unit_start, data):
                sink.write_units(unit_start, data)
                gate.units_written += data.shape[0]

        try:
            return self.inner.pull_into(handle, GatedSink(), block_ids, layers, timeout=timeout)
        finally:
            self.done.set()


@pytest.mark.parametrize("how", ["cancel", "deadline", "abort_rpc"])
def test_cancel_during_import_never_frees_blocks_being_written(prefill_worker, reference, how):
    """Blocks of an import ended mid-pull stay out of the pool until the pull is over.

    The decode pool is 6 blocks. Request D fills and frees blocks 0-2 first, so that
    A's import gets blocks 3-5 and only block 2 stays in the free list (0 and 1 are
    cached). A ends (client cancel, client deadline, or the Abort RPC) while its pull
    is held. Then B (3 blocks) prefills: were A's blocks freed when A ended, B would
    get 2, 5, 4, and the pull, released after B's prefill, would overwrite B's K/V.
    B's greedy output must stay exact.
    """
    dec = start_worker(WorkerConfig("race-d", "decode", engine_config(num_blocks=6)))
    try:
        pre = prefill_worker
        d_prompt, a_prompt, b_prompt = prompt(11, 40), prompt(12, 45), prompt(13, 40)
        tokens, _ = decode(
            dec, worker_pb2.DecodeRequest(request=tokenized("D", d_prompt, greedy(8)))
        )
        assert tokens == reference(d_prompt, 8)

        gate = GatedTransport(dec.kv_transport)
        dec.kv_transport = gate
        a_params = greedy(16)
        handle = export(pre, "A", a_prompt, a_params)
        msg = worker_pb2.DecodeRequest(request=tokenized("A", a_prompt, a_params), kv=handle)
        call = decode_stub(dec).Decode(msg, timeout=1.0 if how == "deadline" else 30)
        consumer = threading.Thread(target=lambda: list(_ignore_end(call)), daemon=True)
        consumer.start()
        assert gate.entered.wait(10), "the import never started"
        if how == "cancel":
            call.cancel()
        elif how == "abort_rpc":
            decode_stub(dec).Abort(worker_pb2.AbortRequest(request_id="A"), timeout=10)
        deadline = time.monotonic() + 10
        while "A" in dec.engine.requests and time.monotonic() < deadline:
            time.sleep(0.02)  # the abort ran on the engine thread
        assert "A" not in dec.engine.requests

        # Hold the engine right after B's prefill until the held pull is over.
        b_prefilled = threading.Event()

        def hold_after_prefill(engine: LLMEngine) -> None:
            req = engine.requests.get("B")
            if req is not None and req.seqs[0].output_token_ids and not b_prefilled.is_set():
                b_prefilled.set()
                assert gate.done.wait(30)

        dec.loop.step_hooks.append(hold_after_prefill)
        result: dict[str, list[int]] = {}
        b = threading.Thread(
            target=lambda: result.update(
                b=decode(
                    dec, worker_pb2.DecodeRequest(request=tokenized("B", b_prompt, greedy(8)))
                )[0]
            ),
            daemon=True,
        )
        b.start()
        assert b_prefilled.wait(10), "B never prefilled"
        gate.release()
        b.join(30)
        consumer.join(10)
        assert result["b"] == reference(b_prompt, 8)
        if how != "abort_rpc":  # the RPC ended: its pull stops at the next chunk
            assert gate.units_written == 0, "the pull went on writing after its RPC ended"
        wait_clean(dec, pre)
    finally:
        dec.stop(grace=0.2)


def _ignore_end(call) -> Iterator[object]:
    try:
        yield from call
    except grpc.RpcError as e:
        assert e.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)


class GatedSource:
    """Wraps a worker's KVSource: `export` waits until the test calls `release`."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.entered = threading.Event()
        self._release = threading.Event()

    def release(self) -> None:
        self._release.set()

    def export(self, *args, **kwargs):
        self.entered.set()
        assert self._release.wait(30), "the test never released the export"
        return self._inner.export(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def test_abort_during_export_never_frees_blocks_being_copied(prefill_worker, reference):
    """The exporter copies a held request's blocks on the handler thread; an Abort
    arriving meanwhile must not free them to another sequence before the copy.

    Pool of 6: D fills and frees blocks 0-2 first, so A's prompt lands in 3-5 and only
    block 2 stays free. A is aborted while its export waits. C then prefills: were
    A's blocks freed at the abort, C would reuse block 5 (A's partial last block) and
    the export would copy C's K/V as A's. A's handle, decoded elsewhere, must give
    A's exact greedy output."""
    pre = start_worker(WorkerConfig("race-e", "prefill", engine_config(num_blocks=6)))
    try:
        d_prompt, a_prompt, c_prompt = prompt(14, 40), prompt(15, 45), prompt(16, 40)
        decode(pre, worker_pb2.DecodeRequest(request=tokenized("D", d_prompt, greedy(8))))
        gate = GatedSource(pre.kv_source)
        pre.kv_source = gate
        result: dict[str, kvtransfer_pb2.KVHandle] = {}
        a = threading.Thread(
            target=lambda: result.update(a=export(pre, "A", a_prompt, greedy(8))), daemon=True
        )
        a.start()
        assert gate.entered.wait(10), "the export never started"
        worker_pb2_grpc.DecodeStub(grpc.insecure_channel(pre.address)).Abort(
            worker_pb2.AbortRequest(request_id="A"), timeout=10
        )
        deadline = time.monotonic() + 10
        while pre.engine.handoff.held and time.monotonic() < deadline:
            time.sleep(0.02)  # the abort ran on the engine thread
        assert not pre.engine.handoff.held
        c_tokens, _ = decode(
            pre, worker_pb2.DecodeRequest(request=tokenized("C", c_prompt, greedy(4)))
        )
        assert c_tokens == reference(c_prompt, 4)
        gate.release()
        a.join(30)
        pre.kv_source = gate._inner
        msg = worker_pb2.DecodeRequest(request=tokenized("A", a_prompt, greedy(8)), kv=result["a"])
        a_tokens, info = decode(prefill_worker, msg)
        assert not info.recomputed and info.pulled_blocks == 3
        assert a_tokens == reference(a_prompt, 8)
        wait_clean(pre, prefill_worker)
    finally:
        pre.stop(grace=0.2)


def test_prefill_caller_gone_before_the_handle_releases_its_lease_at_once():
    """A router whose Prefill call ends (client cancel, deadline) while the worker is
    still exporting never receives the handle, so it can neither pull nor release the
    lease. The worker notices the call is gone and releases the lease itself, instead
    of holding the blocks for the whole TTL (600 s here)."""
    pre = start_worker(WorkerConfig("race-g", "prefill", engine_config(), lease_ttl_s=600))
    try:
        gate = GatedSource(pre.kv_source)
        pre.kv_source = gate
        call = prefill_stub(pre).Prefill.future(
            worker_pb2.PrefillRequest(request=tokenized("G", prompt(21, 40), greedy(8))),
            timeout=30,
        )
        assert gate.entered.wait(10), "the export never started"
        call.cancel()  # the caller leaves while the blocks are being staged
        gate.release()
        deadline = time.monotonic() + 10
        while gate._inner.open_leases and time.monotonic() < deadline:
            time.sleep(0.02)
        assert gate._inner.open_leases == 0, "the lease waits for its TTL"
        pre.kv_source = gate._inner
        wait_clean(pre)
    finally:
        pre.stop(grace=0.2)


# -- 2. a caller that gave up on the engine loop leaves nothing behind ------------------


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(engine_config())


@contextmanager
def loop_of(engine: LLMEngine) -> Iterator[EngineLoop]:
    loop = EngineLoop(engine).start()
    try:
        yield loop
    finally:
        loop.stop()


@contextmanager
def blocked(loop: EngineLoop) -> Iterator[None]:
    """The engine loop runs a command that waits until the block exits."""
    entered, release = threading.Event(), threading.Event()

    def block(_engine: LLMEngine) -> None:
        entered.set()
        release.wait(30)

    t = threading.Thread(target=lambda: loop.call(block, timeout=60), daemon=True)
    t.start()
    assert entered.wait(10)
    try:
        yield
    finally:
        release.set()
        t.join(10)


def assert_engine_clean(loop: EngineLoop) -> None:
    e = loop.engine
    loop.call(lambda eng: eng.check_integrity())
    state = loop.call(
        lambda eng: (eng.requests, eng.handoff.held, eng.handoff.importing, eng.handoff.pinned)
    )
    assert state == ({}, {}, {}, set())
    assert loop.call(lambda eng: eng.block_manager.usage()) == 0.0
    assert not loop._streams
    assert e.block_manager.num_free_blocks() == e.block_manager.num_blocks


def test_call_abandoned_before_it_runs_never_runs(engine):
    ran = []
    with loop_of(engine) as loop:
        with blocked(loop), pytest.raises(EngineBusy, match="did not run the command"):
            loop.call(
                lambda e: ran.append(e.handoff.reserve_prefix_import("p", prompt(1, 40), None)),
                timeout=0.1,
                on_abandon=lambda e, _r: e.handoff.unpin("p"),
            )
        assert_engine_clean(loop)
    assert ran == []


def test_call_abandoned_while_running_is_undone(engine):
    """A slow command that took blocks: its caller times out, on_abandon gives them back."""
    go, taken = threading.Event(), threading.Event()
    undone = []

    def slow_reserve(e: LLMEngine):
        plan = e.handoff.reserve_prefix_import("p", prompt(2, 40), None)
        taken.set()
        go.wait(30)
        return plan

    def undo(e: LLMEngine, plan) -> None:
        undone.append(plan)
        e.handoff.unpin("p")

    with loop_of(engine) as loop:
        threading.Timer(0.3, go.set).start()
        with pytest.raises(EngineBusy):
            loop.call(slow_reserve, timeout=0.1, on_abandon=undo)
        assert taken.is_set()
        loop.call(lambda e: None)  # after the slow command and its undo
        assert len(undone) == 1 and undone[0].block_ids
        assert_engine_clean(loop)


def test_call_that_finished_returns_its_result(engine):
    with loop_of(engine) as loop:
        assert loop.call(lambda e: 7, timeout=5, on_abandon=lambda e, r: None) == 7


def test_a_held_engine_runs_commands_but_steps_nothing_until_released(engine):
    """The fault injector's ENGINE_STEP gate (what tests/router_fixtures.engine_held
    sets): after the n-th step the loop steps nothing, yet reads and aborts still run."""
    injector = faults.FaultInjector()
    previous = faults.install(injector)
    gate = injector.pause(faults.ENGINE_STEP, only="w", skip=2)  # after the 3rd step
    try:
        with loop_of(engine) as loop:
            loop.step_gate = lambda: faults.fault_step("w")
            add = lambda e: e.add_request("r", prompt_token_ids=prompt(5, 20), params=greedy(30))  # noqa: E731
            stream = loop.submit("r", add)
            assert gate.wait() == ("w",)
            got = [len(stream.get(timeout=10).samples[0].token_ids) for _ in range(3)]
            assert got == [1, 1, 1]  # one token a step, then held
            generated = lambda e: len(e.requests["r"].seqs[0].output_token_ids)  # noqa: E731
            assert loop.call(generated) == 3  # a command runs while held
            assert stream._queue.empty()  # and no step ran: nothing more came out
            loop.submit("s", lambda e: e.add_request("s", prompt_token_ids=[5], params=greedy(2)))
            assert loop.call(generated) == 3  # a new request does not start a step either
            gate.release()
            assert sum(len(o.samples[0].token_ids) for o in stream) == 27  # the rest
            loop.abort("s")
            loop.call(lambda e: None)
    finally:
        faults.install(previous)


@pytest.mark.parametrize("when", ["queued", "running"])
@pytest.mark.parametrize("kind", ["prefill", "import", "plain"])
def test_submit_abandoned_leaves_no_request(engine, kind, when):
    """A submit whose caller timed out: never added (queued), or undone (running):
    aborted, or for an import cancelled, which also ends its pin."""
    p = prompt(3, 40)
    go = threading.Event()
    adds = {
        "prefill": lambda e: e.add_request(
            "r", prompt_token_ids=p, params=greedy(4), prefill_only=True
        ),
        "import": lambda e: e.handoff.reserve_import("r", p, greedy(4), HandedOver({0: 5})),
        "plain": lambda e: e.add_request("r", prompt_token_ids=p, params=greedy(4)),
    }
    undo = (lambda e: e.handoff.cancel_import("r", recompute=False)) if kind == "import" else None

    def add(e: LLMEngine) -> None:
        adds[kind](e)
        if when == "running":
            go.wait(30)  # a slow command: it took its blocks, its caller gives up

    with loop_of(engine) as loop:
        gate = blocked(loop) if when == "queued" else _nothing()
        with gate, pytest.raises(EngineBusy):
            loop.submit("r", add, timeout=0.1, undo=undo)
        go.set()
        loop.call(lambda e: None)  # after the abandoned command
        assert_engine_clean(loop)


@contextmanager
def _nothing() -> Iterator[None]:
    yield


@pytest.fixture(scope="module")
def impatient():
    """A worker whose handlers give up on its engine loop after 0.3 s."""
    rt = start_worker(WorkerConfig("race-i", "decode", engine_config(), engine_call_timeout_s=0.3))
    yield rt
    rt.stop(grace=0.2)


def test_rpcs_that_time_out_on_a_busy_loop_leave_nothing(impatient, prefill_worker):
    """Prefill, ExportPrefix, Decode with a KV handle, Decode with a prefix: each one's
    engine command times out (UNAVAILABLE); after the loop moves on, no request, held,
    importing or pinned state is left, and every exporter's lease was released."""
    rt, pre = impatient, prefill_worker
    cached = prompt(21, 40)
    decode(rt, worker_pb2.DecodeRequest(request=tokenized("warm", cached, greedy(2))))
    kv = export(pre, "imp-kv", prompt(22, 40), greedy(4))
    decode(pre, worker_pb2.DecodeRequest(request=tokenized("pre-warm", cached, greedy(2))))
    prefix = prefill_stub(pre).ExportPrefix(
        worker_pb2.ExportPrefixRequest(token_ids=cached), timeout=10
    )
    assert prefix.lease_id and pre.kv_source.open_leases == 2
    calls = {
        "prefill": lambda: prefill_stub(rt).Prefill(
            worker_pb2.PrefillRequest(request=tokenized("imp-p", prompt(23, 40), greedy(4))),
            timeout=10,
        ),
        "export": lambda: prefill_stub(rt).ExportPrefix(
            worker_pb2.ExportPrefixRequest(token_ids=cached), timeout=10
        ),
        "import": lambda: decode(
            rt,
            worker_pb2.DecodeRequest(request=tokenized("imp-kv", prompt(22, 40), greedy(4)), kv=kv),
            timeout=10,
        ),
        "prefix": lambda: decode(
            rt,
            worker_pb2.DecodeRequest(
                request=tokenized("imp-x", cached + [7], greedy(4)), prefix=prefix
            ),
            timeout=10,
        ),
    }
    with blocked(rt.loop):
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, name
            assert "busy" in err.value.details(), name
    wait_clean(rt, pre)


def test_import_with_a_corrupt_generator_state_is_invalid_argument(prefill_worker):
    """A KV handle whose seeded generator state is not one (a bad internal message):
    the Decode ends with INVALID_ARGUMENT naming it, nothing is held and the
    exporter's lease is released at once (not left to its TTL)."""
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=4, ignore_eos=True)
    p = prompt(41, 40)
    kv = export(prefill_worker, "gs", p, seeded)
    assert kv.first_tokens[0].generator_state and prefill_worker.kv_source.open_leases == 1
    kv.first_tokens[0].generator_state = b"not a generator state"
    with pytest.raises(grpc.RpcError) as err:
        decode(prefill_worker, worker_pb2.DecodeRequest(request=tokenized("gs", p, seeded), kv=kv))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "generator state of sample 0" in err.value.details()
    wait_clean(prefill_worker)


# -- 3. KV staging is capped ------------------------------------------------------------


def test_export_past_the_lease_cap_is_resource_exhausted(prefill_worker):
    rt = start_worker(WorkerConfig("race-cap", "prefill", engine_config(), kv_max_open_leases=1))
    try:
        first = export(rt, "cap-1", prompt(31, 40), greedy(4))
        with pytest.raises(grpc.RpcError) as err:
            export(rt, "cap-2", prompt(32, 40), greedy(4))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "1 leases open, at most 1" in err.value.details()
        assert rt.kv_source.refused_total == 1
        assert rt.engine.handoff.held == {}  # the refused request's blocks went back
        prefill_stub(rt).ReleaseLease(worker_pb2.ReleaseLeaseRequest(lease_id=first.lease_id))
        export(rt, "cap-3", prompt(33, 40), greedy(4))  # room again
        for lease in list(rt.kv_source._leases):
            rt.kv_source.release(lease)
        wait_clean(rt)
    finally:
        rt.stop(grace=0.2)


def test_worker_start_removes_stale_segments_of_dead_exporters(tmp_path):
    dead_pid = 2**22 + 12345  # above the default pid_max: never a live process
    stale = tmp_path / segment_name(dead_pid, "abc")
    stale.write_bytes(b"x" * 4096)
    live = tmp_path / segment_name(1, "still-mine")  # pid 1 is alive
    live.write_bytes(b"y")
    rt = WorkerRuntime(
        WorkerConfig("race-stale", "prefill", engine_config(), kv_shm_dir=str(tmp_path))
    )
    try:
        assert not stale.exists() and live.exists()
        assert rt.kv_source.shm_dir == tmp_path
    finally:
        rt.kv_source.close()


def test_staging_cap_defaults_to_half_the_free_shm(tmp_path):
    cfg = WorkerConfig("w", "prefill", engine_config())
    assert cfg.staging_cap_bytes() >= 64 << 20
    assert replace(cfg, kv_max_staged_bytes=5 << 20).staging_cap_bytes() == 5 << 20
    with pytest.raises(ValueError, match="kv_max_staged_bytes"):
        replace(cfg, kv_max_staged_bytes=0)


# -- 4. internal RPCs against a peer that never answers ---------------------------------


class HungPeer:
    """A real gRPC server whose PullBlocks and ReleaseLease handlers never answer
    (until teardown)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls: list[str] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))

        def hang(name):
            def handler(request, context):
                self.calls.append(name)
                self.release.wait(30)
                context.abort(grpc.StatusCode.UNAVAILABLE, "hung peer released")

            return handler

        def hang_stream(request, context):
            self.calls.append("PullBlocks")
            self.release.wait(30)
            context.abort(grpc.StatusCode.UNAVAILABLE, "hung peer released")
            yield b""

        self.server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    SERVICE_NAME,
                    {
                        "PullBlocks": grpc.unary_stream_rpc_method_handler(
                            hang_stream,
                            request_deserializer=kvtransfer_pb2.PullRequest.FromString,
                        )
                    },
                ),
                grpc.method_handlers_generic_handler(
                    "pagedserve.v1.Prefill",
                    {
                        "ReleaseLease": grpc.unary_unary_rpc_method_handler(
                            hang("ReleaseLease"),
                            request_deserializer=worker_pb2.ReleaseLeaseRequest.FromString,
                            response_serializer=worker_pb2.ReleaseLeaseResponse.SerializeToString,
                        )
                    },
                ),
            )
        )
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"
        self.server.start()

    def close(self) -> None:
        self.release.set()
        self.server.stop(0.5).wait()


@pytest.fixture
def hung_peer() -> Iterator[HungPeer]:
    peer = HungPeer()
    yield peer
    peer.close()


def to_hung(handle: kvtransfer_pb2.KVHandle, peer: HungPeer) -> kvtransfer_pb2.KVHandle:
    """The same handle, served (never) by the hung peer over gRPC."""
    moved = kvtransfer_pb2.KVHandle()
    moved.CopyFrom(handle)
    moved.transfer_address = peer.address
    moved.shm_name = ""
    moved.host_id = "another-host"
    return moved


def test_pull_from_a_hung_peer_ends_at_the_transport_deadline(hung_peer, prefill_worker):
    handle = export(prefill_worker, "hung-t", prompt(41, 40), greedy(4))
    prefill_worker.kv_source.release(handle.lease_id)
    client = GrpcTransport(timeout_s=0.3)
    try:
        with pytest.raises(KVTransferError, match="DEADLINE_EXCEEDED"):
            client.pull(ExportedKV.from_proto(to_hung(handle, hung_peer)))
    finally:
        client.close()
    assert hung_peer.calls == ["PullBlocks"]


def test_release_to_a_hung_peer_ends_at_its_deadline_on_bounded_threads(hung_peer):
    before = set(threading.enumerate())
    releaser = LeaseReleaser(ChannelCache(), timeout_s=0.3, max_threads=2)
    try:
        done = [releaser.release(hung_peer.address, f"lease-{i}") for i in range(6)]
        new = set(threading.enumerate()) - before
        assert len([t for t in new if t.name.startswith("release-lease")]) <= 2
        assert {f.result(10) for f in done} == {grpc.StatusCode.DEADLINE_EXCEEDED}
        assert len(releaser.channels) == 1
    finally:
        releaser.close()


def test_channel_cache_evicts_least_recently_used_and_closes_it():
    cache = ChannelCache(max_channels=2)
    with cache.use("127.0.0.1:1") as first:
        pass
    with cache.use("127.0.0.1:2"), cache.use("127.0.0.1:1"):
        pass
    with cache.use("127.0.0.1:3") as third:  # evicts :2, the least recently used
        assert cache.addresses() == ["127.0.0.1:1", "127.0.0.1:3"]
    with cache.use("127.0.0.1:4"):  # evicts :1, not in use: closed now
        assert cache.addresses() == ["127.0.0.1:3", "127.0.0.1:4"]
    with pytest.raises(ValueError, match="closed"):
        first.unary_unary("/x/y")(b"", timeout=1)
    with pytest.raises(grpc.RpcError):  # still open (nobody listens there)
        third.unary_unary("/x/y")(b"", timeout=1)
    cache.close()


def test_channel_cache_closes_a_channel_evicted_in_use_when_its_user_is_done():
    cache = ChannelCache(max_channels=1)
    with cache.use("127.0.0.1:1") as busy:
        with cache.use("127.0.0.1:2"):  # evicts :1, which is in use
            assert cache.addresses() == ["127.0.0.1:2"]
        with pytest.raises(grpc.RpcError):  # not closed under its user
            busy.unary_unary("/x/y")(b"", timeout=1)
    with pytest.raises(ValueError, match="closed"):
        busy.unary_unary("/x/y")(b"", timeout=1)
    cache.close()


@pytest.fixture(scope="module")
def patient_decoder():
    """A decode worker that pulls over gRPC with a 0.5 s deadline on every pull."""
    cfg = WorkerConfig(
        "race-g",
        "decode",
        engine_config(),
        kv_transport="grpc",
        kv_pull_timeout_s=0.5,
        release_lease_timeout_s=0.3,
    )
    rt = start_worker(cfg)
    yield rt
    rt.stop(grace=0.2)


def test_decode_import_from_a_hung_peer_recomputes_after_the_pull_deadline(
    hung_peer, patient_decoder, prefill_worker, reference
):
    rt, pre = patient_decoder, prefill_worker
    p = prompt(42, 40)
    handle = export(pre, "hung-d", p, greedy(8))
    pre.kv_source.release(handle.lease_id)
    rt.peers.set_live([hung_peer.address])  # as the registry answers: a live peer, hung
    msg = worker_pb2.DecodeRequest(
        request=tokenized("hung-d", p, greedy(8)), kv=to_hung(handle, hung_peer)
    )
    tokens, info = decode(rt, msg, timeout=20)  # the client's deadline is far off
    assert info.recomputed and "DEADLINE_EXCEEDED" in info.error
    assert tokens == reference(p, 8)
    wait_clean(rt, pre)


def test_prefix_import_from_a_hung_peer_computes_locally_after_the_deadline(
    hung_peer, patient_decoder, prefill_worker, reference
):
    rt, pre = patient_decoder, prefill_worker
    p = prompt(43, 40)
    decode(pre, worker_pb2.DecodeRequest(request=tokenized("hung-warm", p, greedy(2))))
    prefix = prefill_stub(pre).ExportPrefix(worker_pb2.ExportPrefixRequest(token_ids=p), timeout=10)
    pre.kv_source.release(prefix.lease_id)
    rt.peers.set_live([hung_peer.address])  # as the registry answers: a live peer, hung
    msg = worker_pb2.DecodeRequest(
        request=tokenized("hung-x", p, greedy(8)), prefix=to_hung(prefix, hung_peer)
    )
    tokens, _ = decode(rt, msg, timeout=20)
    assert tokens == reference(p, 8)
    assert "PullBlocks" in hung_peer.calls
    wait_clean(rt, pre)
