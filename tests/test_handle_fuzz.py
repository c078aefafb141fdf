"""Forged KV, fuzzed: the wire parser fed arbitrary and mutated bytes, and forged KV
handles sent to a real decode worker over gRPC (issue 11, item 4).

- The parser (kvtransfer/wire.py, `unframe_kvchunk` + `ChunkAssembler` into a
  `CacheSink`) raises only `KVTransferError`, with a message, whatever it is fed, and
  never writes outside the transfer's destination blocks (a canary: every other block
  of the cache is byte-identical afterwards). Bytes that survive the checksum are
  exactly the sent ones.
- A forged handle (kvtransfer/validate.py) is refused before anything is reserved,
  opened or dialed: INVALID_ARGUMENT for broken names, counts, tokens or layout,
  FAILED_PRECONDITION for an exporter the worker does not trust; the worker's pool is
  all free afterwards and a genuine request still works.
- The trusted exporters come from the router's heartbeat answers (registered, live,
  same model), refreshed on demand when a handle names one not seen yet.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from builders import one_torch_thread  # noqa: F401
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from router_fixtures import ROUTER_CONFIG, start_cluster, tiny_engine_config, wait_for

from pagedserve.common.runtime.peers import TrustedPeers
from pagedserve.common.runtime.worker import WorkerConfig, WorkerRuntime
from pagedserve.kvtransfer.handle import ExportedKV, KVLayout
from pagedserve.kvtransfer.segment import segment_name
from pagedserve.kvtransfer.sinks import CacheSink
from pagedserve.kvtransfer.transport import ShmTransport
from pagedserve.kvtransfer.validate import (
    HandleError,
    ImportLimits,
    UntrustedSourceError,
    check_handle,
    check_prefix_handle,
)
from pagedserve.kvtransfer.wire import (
    _FIXED,
    ChunkAssembler,
    KVTransferError,
    TransferSpec,
    encode_chunks,
    frame_kvchunk,
    seal,
    unframe_kvchunk,
)
from pagedserve.router.registry import WorkerRegistry
from pagedserve.v1 import generation_pb2, kvtransfer_pb2, worker_pb2, worker_pb2_grpc
from pagedserve.worker import start_worker

# ---- (a) the wire parser ---------------------------------------------------------------

L, BS, KVH, HD, NB = 2, 4, 2, 8, 12
SRC_IDS = (11, 12, 13)  # the exporter's ids, as the chunks name them
TARGET = [7, 2, 5]  # where the transfer lands in the destination cache
OTHERS = [b for b in range(NB) if b not in TARGET]
UNIT_BYTES = BS * KVH * HD * 2  # float16
SPEC = TransferSpec(SRC_IDS, 0, L, torch.float16, (BS, KVH, HD))


def _blocks() -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    return torch.randn(len(SRC_IDS), L, 2, BS, KVH, HD, generator=g).to(torch.float16)


BLOCKS = _blocks()


def _messages(kind: str) -> list[bytes]:
    """The transfer as framed KVChunk messages: 2 units per chunk, 6 chunks."""
    chunks = encode_chunks(
        BLOCKS,
        block_ids=SRC_IDS,
        num_tokens=10,
        request_id="fuzz",
        max_chunk_bytes=2 * UNIT_BYTES,
        checksum=kind,
    )
    return [frame_kvchunk(c.header_bytes, c.payload) for c in chunks]


MESSAGES = {kind: _messages(kind) for kind in ("crc32", "xxh3")}


def _receive(messages: list[bytes]) -> tuple[torch.Tensor, KVTransferError | None]:
    """Feeds `messages` to a fresh assembler over a canary cache, as a pull does; returns
    the cache and the error (None: the transfer completed). Any other exception fails."""
    cache = torch.randn(NB, L, 2, BS, KVH, HD, generator=torch.Generator().manual_seed(3))
    cache = cache.to(torch.float16)
    before = cache[OTHERS].clone()
    asm = ChunkAssembler(CacheSink(cache, TARGET), SPEC)
    error = None
    try:
        for message in messages:
            asm.add(*unframe_kvchunk(message))
        asm.finish()
    except KVTransferError as e:
        asm.abort()
        error = e
        assert str(e), "a refusal names what is wrong"
    assert torch.equal(cache[OTHERS].view(torch.int16), before.view(torch.int16)), (
        "a write landed outside the transfer's destination blocks"
    )
    return cache, error


def _assert_exact_if_complete(cache: torch.Tensor, error: KVTransferError | None) -> None:
    if error is None:
        got = cache[TARGET].view(torch.int16)
        assert torch.equal(got, BLOCKS.view(torch.int16)), "a completed pull must be exact"


def test_the_unmutated_transfer_completes_exactly():
    for messages in MESSAGES.values():
        cache, error = _receive(messages)
        assert error is None
        _assert_exact_if_complete(cache, error)


FUZZ_PARSER = settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))


@FUZZ_PARSER
@given(st.lists(st.binary(max_size=600), min_size=1, max_size=4))
def test_arbitrary_bytes_are_refused_cleanly(garbage):
    _, error = _receive(garbage)
    assert error is not None


@st.composite
def mutated_streams(draw) -> list[bytes]:
    """The valid stream with bytes flipped, cut, added or replaced, or chunks dropped,
    repeated or reordered (what a flaky link or a careless peer delivers)."""
    messages = list(MESSAGES[draw(st.sampled_from(sorted(MESSAGES)))])
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(messages) - 1))
        m = bytearray(messages[i])
        how = draw(st.sampled_from(["flip", "cut", "grow", "splice", "drop", "repeat", "swap"]))
        if not m and how in ("flip", "cut", "splice"):  # cut to nothing before
            how = "grow"
        if how == "flip":
            pos = draw(st.integers(0, len(m) - 1))
            m[pos] ^= draw(st.integers(1, 255))
        elif how == "cut":
            m = m[: draw(st.integers(0, len(m) - 1))]
        elif how == "grow":
            m += draw(st.binary(min_size=1, max_size=64))
        elif how == "splice":
            pos = draw(st.integers(0, len(m) - 1))
            m[pos : pos + 8] = draw(st.binary(min_size=1, max_size=8))
        if how == "drop":
            del messages[i]
        elif how == "repeat":
            messages.insert(i, messages[i])
        elif how == "swap":
            j = draw(st.integers(0, len(messages) - 1))
            messages[i], messages[j] = messages[j], messages[i]
        else:
            messages[i] = bytes(m)
        if not messages:
            break
    return messages


@FUZZ_PARSER
@given(mutated_streams())
def test_mutated_streams_are_refused_or_exact(messages):
    _assert_exact_if_complete(*_receive(messages))


# The fixed header's fields and their widths (wire._FIXED: "<4sHBBIHHHHHHIIIIIIIIQ").
_FIELD_BITS = [0, 16, 8, 8, 32, 16, 16, 16, 16, 16, 16, 32, 32, 32, 32, 32, 32, 32, 32]


@st.composite
def resealed_streams(draw) -> list[bytes]:
    """Chunks whose fixed header fields a malicious sender rewrote and sealed again with
    a valid checksum: only the parser's own consistency checks stand in the way."""
    messages = list(MESSAGES["crc32"])
    for _ in range(draw(st.integers(1, 2))):
        i = draw(st.integers(0, len(messages) - 1))
        header, payload = (bytes(x) for x in unframe_kvchunk(messages[i]))
        fields = list(_FIXED.unpack_from(header))
        f = draw(st.integers(1, len(_FIELD_BITS) - 1))
        bits = _FIELD_BITS[f]
        fields[f] = draw(
            st.one_of(
                st.integers(0, (1 << bits) - 1),
                st.integers(max(0, fields[f] - 3), min((1 << bits) - 1, fields[f] + 3)),
            )
        )
        rest = header[_FIXED.size :]
        if draw(st.booleans()):  # and the variable part (request id, block ids) too
            rest = draw(st.binary(max_size=40))
        forged = _FIXED.pack(*fields) + rest
        if fields[3] in (0, 1):  # a known checksum kind: the forger seals it properly
            forged, _ = seal(forged, payload)
        messages[i] = frame_kvchunk(forged, payload)
    return messages


@FUZZ_PARSER
@given(resealed_streams())
def test_resealed_headers_never_write_outside_the_target_blocks(messages):
    _assert_exact_if_complete(*_receive(messages))


def test_two_chunks_claiming_the_same_units_are_refused():
    """A sender that seals its own headers places chunk 1's units over chunk 0's: the
    unit count adds up, but units 2-3 were never written. Refused, not imported."""
    messages = list(MESSAGES["crc32"])
    header, payload = (bytes(x) for x in unframe_kvchunk(messages[1]))
    fields = list(_FIXED.unpack_from(header))
    fields[16] = 0  # unit_start: chunk 0's units
    forged, _ = seal(_FIXED.pack(*fields) + header[_FIXED.size :], payload)
    messages[1] = frame_kvchunk(forged, payload)
    _, error = _receive(messages)
    assert error is not None and "already delivered" in str(error)


# ---- shared-memory names: refused before anything is opened --------------------------


@pytest.mark.parametrize(
    "name",
    ["../outside", "../../etc/passwd", "/dev/shm/x", "pagedserve-kv-1-../outside", "a/b", ".."],
)
def test_shm_transport_opens_only_the_lease_segment_inside_its_dir(tmp_path, name):
    shm = tmp_path / "shm"
    shm.mkdir()
    (tmp_path / "outside").write_bytes(b"\0" * 4096)
    handle = _exported(lease_id="lease1", shm_name=name)
    with pytest.raises(ValueError, match="segment"):
        ShmTransport(shm).pull(handle)


def test_shm_transport_refuses_a_planted_link_out_of_its_dir(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    (tmp_path / "outside").write_bytes(b"\0" * 4096)
    name = segment_name(os.getpid(), "lease1")
    (shm / name).symlink_to(tmp_path / "outside")
    with pytest.raises(ValueError, match="resolves outside"):
        ShmTransport(shm).pull(_exported(lease_id="lease1", shm_name=name))


def _exported(lease_id: str, shm_name: str) -> ExportedKV:
    return ExportedKV(
        lease_id=lease_id,
        request_id="",
        host_id="here",
        transfer_address="",
        shm_name=shm_name,
        block_ids=(0,),
        num_tokens=1,
        layout=KVLayout(L, BS, KVH, HD, torch.float16),
        expires_unix_ms=2**62,
    )


# ---- (b) forged handles: the validator, then a real decode worker ----------------------

PROMPT_LEN = 10
LIMITS = ImportLimits(KVLayout(L, BS, KVH, HD, torch.float32), vocab_size=100, model="m@1")
GOOD_ADDRESS = "127.0.0.1:9"  # the one trusted address of the pure validator tests


def genuine_handle(
    limits: ImportLimits, prompt_len: int, address: str, n: int = 1
) -> kvtransfer_pb2.KVHandle:
    """A handle as a prefill worker would send it (nothing behind it: it is never pulled)."""
    bs = limits.layout.block_size
    lease = uuid.uuid4().hex
    handle = ExportedKV(
        lease_id=lease,
        request_id="",
        host_id="another-host",
        transfer_address=address,
        shm_name=segment_name(4321, lease),
        block_ids=tuple(range(100, 100 + -(-prompt_len // bs))),
        num_tokens=prompt_len,
        layout=limits.layout,
        expires_unix_ms=int(time.time() * 1000) + 60_000,
    ).to_proto()
    handle.block_hashes.extend(bytes([i]) * 16 for i in range(prompt_len // bs))
    for i in range(n):
        handle.first_tokens.add(token_id=i + 1)
    return handle


U32 = (1 << 32) - 1
BAD_NAMES = [
    "../../etc/passwd",
    "/dev/shm/x",
    "..",
    "pagedserve-kv-1-../../x",
    "pagedserve-kv--lease",
    "pagedserve-kv-12345678901-x",
    "x\n",
]


def _not(pattern: str):
    return lambda s: not re.fullmatch(pattern, s)


@st.composite
def forgeries(draw, limits: ImportLimits, prompt_len: int) -> tuple[list[str], object]:
    """(kinds of forgery applied, a function forging a genuine handle in place)."""
    bs = limits.layout.block_size
    blocks = -(-prompt_len // bs)
    steps = []
    kinds = draw(
        st.lists(
            st.sampled_from(
                ["address", "shm", "lease", "tokens", "blocks", "first", "layout", "hashes"]
            ),
            min_size=1,
            max_size=3,
            unique=True,
        )
    )
    for kind in kinds:
        if kind == "address":
            address = draw(
                st.one_of(
                    st.text(max_size=40),
                    st.builds("10.{}.{}.{}:{}".format, *[st.integers(0, 255)] * 3, st.integers()),
                ).filter(lambda a: a != GOOD_ADDRESS)
            )
            steps.append(lambda h, a=address: setattr(h, "transfer_address", a))
        elif kind == "shm":
            name = draw(
                st.one_of(st.sampled_from(BAD_NAMES), st.text(min_size=1, max_size=60)).filter(
                    _not(r"pagedserve-kv-\d{1,10}-[0-9a-f]{32}")
                )
            )
            steps.append(lambda h, n=name: setattr(h, "shm_name", n))
        elif kind == "lease":
            lease = draw(
                st.one_of(
                    st.sampled_from(["", "../x", "pool-1", "a" * 129, "lease\n", "a/b"]),
                    st.text(max_size=140),
                ).filter(lambda s: not re.fullmatch(r"[A-Za-z0-9_-]{1,128}", s) or s == "pool-1")
            )
            steps.append(lambda h, x=lease: setattr(h, "lease_id", x))
        elif kind == "tokens":
            tokens = draw(st.integers(0, U32).filter(lambda t: t != prompt_len))
            steps.append(lambda h, t=tokens: setattr(h, "num_tokens", t))
        elif kind == "blocks":
            ids = draw(
                st.one_of(
                    st.lists(st.integers(0, U32), max_size=12).filter(lambda b: len(b) != blocks),
                    st.lists(st.integers(0, U32), min_size=1, max_size=1).map(
                        lambda b: b * blocks if blocks > 1 else b * 2
                    ),
                )
            )
            steps.append(lambda h, b=ids: (h.ClearField("block_ids"), h.block_ids.extend(b)))
        elif kind == "first":
            tokens = draw(
                st.one_of(
                    st.lists(st.integers(limits.vocab_size, U32), min_size=1, max_size=1),
                    st.lists(st.integers(0, 5), min_size=2, max_size=40),
                    st.just([]),
                )
            )
            steps.append(lambda h, t=tokens: _set_first(h, t))
        elif kind == "layout":
            field = draw(st.sampled_from(["num_layers", "block_size", "num_kv_heads", "head_dim"]))
            value = draw(st.integers(0, U32).filter(lambda v, f=field: v != _layout(limits, f)))
            dtype = draw(st.sampled_from(["", "float16", "int8", "../x"]))
            if draw(st.booleans()):
                steps.append(lambda h: h.ClearField("layout"))
            elif draw(st.booleans()):
                steps.append(lambda h, d=dtype: setattr(h.layout, "dtype", d))
            else:
                steps.append(lambda h, f=field, v=value: setattr(h.layout, f, v))
        elif kind == "hashes":
            extra = draw(st.integers(1, 100))
            steps.append(lambda h, k=extra: h.block_hashes.extend([b"\0" * 16] * (k + blocks)))
    return kinds, lambda h: [step(h) for step in steps]


def _set_first(handle: kvtransfer_pb2.KVHandle, tokens: list[int]) -> None:
    handle.ClearField("first_tokens")
    for t in tokens:
        handle.first_tokens.add(token_id=t)


def _layout(limits: ImportLimits, field: str) -> int:
    return getattr(limits.layout, field)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(forgeries(LIMITS, PROMPT_LEN))
def test_the_validator_refuses_every_forgery_before_asking_who_sent_it(forgery):
    kinds, forge = forgery
    handle = genuine_handle(LIMITS, PROMPT_LEN, GOOD_ADDRESS)
    check_handle(handle, prompt_len=PROMPT_LEN, num_samples=1, limits=LIMITS, trusted=_trust)
    forge(handle)
    asked: list[str] = []

    def trusted(address: str) -> bool:
        asked.append(address)
        return address == GOOD_ADDRESS

    with pytest.raises(HandleError) as refused:
        check_handle(handle, prompt_len=PROMPT_LEN, num_samples=1, limits=LIMITS, trusted=trusted)
    if kinds == ["address"]:
        assert isinstance(refused.value, UntrustedSourceError)
        assert "not a registered live worker of model 'm@1'" in str(refused.value)
    else:  # broken structure is found first: the source is never even looked up
        assert not isinstance(refused.value, UntrustedSourceError) and asked == []


def _trust(address: str) -> bool:
    return address == GOOD_ADDRESS


def test_the_validator_checks_prefix_handles_by_their_own_rules():
    prefix = genuine_handle(LIMITS, 8, GOOD_ADDRESS, n=0)  # whole blocks, no first tokens
    check_prefix_handle(prefix, prompt_len=PROMPT_LEN, limits=LIMITS, trusted=_trust)
    for forge, message in [
        (lambda h: h.first_tokens.add(token_id=1), "no first tokens"),
        (lambda h: setattr(h, "num_tokens", 9), "whole blocks"),
        (lambda h: setattr(h, "shm_name", "../../etc/passwd"), "segment name"),
        (lambda h: setattr(h, "transfer_address", "10.0.0.1:1"), "not a registered"),
    ]:
        forged = kvtransfer_pb2.KVHandle()
        forged.CopyFrom(prefix)
        forge(forged)
        with pytest.raises(HandleError, match=message):
            check_prefix_handle(forged, prompt_len=PROMPT_LEN, limits=LIMITS, trusted=_trust)


@pytest.fixture(scope="module")
def decoder():
    """A standalone decode worker (no registry): it trusts only itself."""
    rt = start_worker(WorkerConfig("fuzz-d", "decode", tiny_engine_config(num_blocks=32)))
    yield rt
    rt.stop(grace=0.2)


def worker_limits(rt: WorkerRuntime) -> ImportLimits:
    engine = rt.engine
    return ImportLimits(
        KVLayout.of_cache(engine.kv_cache.kv), engine.spec.vocab_size, engine.model_id
    )


def prompt_of(rt: WorkerRuntime, length: int = 20, seed: int = 0) -> list[int]:
    vocab = rt.engine.spec.vocab_size
    return [(seed * 31 + 7 * i + 3) % vocab for i in range(length)]


def request(rid: str, prompt: list[int], max_tokens: int = 4) -> worker_pb2.TokenizedRequest:
    sampling = generation_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    sampling.ignore_eos = True
    return worker_pb2.TokenizedRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling)


def decode(rt: WorkerRuntime, msg: worker_pb2.DecodeRequest) -> list[worker_pb2.DecodeStep]:
    with grpc.insecure_channel(rt.address) as ch:
        return list(worker_pb2_grpc.DecodeStub(ch).Decode(msg, timeout=30))


def assert_pool_all_free(rt: WorkerRuntime) -> None:
    def state(e):
        bm = e.block_manager
        return len(e.requests), bm.num_free_blocks(), bm.num_blocks

    requests, free, total = rt.loop.call(state)
    assert (requests, free) == (0, total), "a refused handle must not reserve anything"
    assert rt.kv_source.open_leases == 0
    rt.check_integrity()


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_forged_handles_are_refused_by_a_real_decode_worker(decoder, data):
    rt = decoder
    limits = worker_limits(rt)
    prompt = prompt_of(rt)
    kinds, forge = data.draw(forgeries(limits, len(prompt)))
    handle = genuine_handle(limits, len(prompt), rt.address)
    forge(handle)
    msg = worker_pb2.DecodeRequest(request=request("forged", prompt), kv=handle)
    with pytest.raises(grpc.RpcError) as refused:
        decode(rt, msg)
    code = refused.value.code()
    if kinds == ["address"]:
        assert code == grpc.StatusCode.FAILED_PRECONDITION, refused.value.details()
        assert "not a registered live worker" in refused.value.details()
    else:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert_pool_all_free(rt)


@pytest.fixture
def stranger() -> Iterator[tuple[str, list[str]]]:
    """A gRPC server nobody registered, recording every call it gets (and answering
    UNIMPLEMENTED): what a forged handle would make a worker dial."""
    calls: list[str] = []

    class Record(grpc.GenericRpcHandler):
        def service(self, handler_call_details):
            calls.append(handler_call_details.method)
            return None

    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((Record(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", calls
    server.stop(0).wait()


def assert_never_dialed(calls: list[str], rt: WorkerRuntime) -> None:
    # A release would go out on the lease releaser's threads: once what the handlers
    # posted to the engine loop ran, and every release asked for ended, any dial made
    # has reached the stranger (its handler records the call before answering).
    rt.loop.call(lambda e: None)
    wait_for(lambda: rt.lease_releaser.pending == 0, 10, "the lease releases to end")
    assert calls == [], "a forged handle made the worker dial its address"


def test_handles_from_a_stranger_are_never_dialed(decoder, stranger):
    """Decode refuses a KV or prefix handle from an unregistered address without
    pulling from it or releasing its lease there; Prefill ignores such a prefix handle
    (computes the prompt itself) without dialing either."""
    rt, (address, calls) = decoder, stranger
    prompt = prompt_of(rt, seed=1)
    limits = worker_limits(rt)
    for field, handle in [
        ("kv", genuine_handle(limits, len(prompt), address)),
        ("prefix", genuine_handle(limits, 16, address, n=0)),
    ]:
        msg = worker_pb2.DecodeRequest(request=request(f"stranger-{field}", prompt))
        getattr(msg, field).CopyFrom(handle)
        with pytest.raises(grpc.RpcError) as refused:
            decode(rt, msg)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert address in refused.value.details()
    prefill = worker_pb2.PrefillRequest(request=request("stranger-prefill", prompt))
    prefill.prefix.CopyFrom(genuine_handle(limits, 16, address, n=0))
    with grpc.insecure_channel(rt.address) as ch:
        handle = worker_pb2_grpc.PrefillStub(ch).Prefill(prefill, timeout=30)
    assert handle.cached_tokens == 0  # nothing imported: the prompt was computed here
    rt.kv_source.release(handle.lease_id)
    assert_never_dialed(calls, rt)
    wait_for(lambda: rt.loop.call(lambda e: e.block_manager.usage()) == 0, 10, "blocks back")
    rt.check_integrity()


def test_a_prefix_handle_naming_a_path_is_refused(decoder):
    prompt = prompt_of(decoder, seed=1)
    prefix = genuine_handle(worker_limits(decoder), 16, decoder.address, n=0)
    prefix.shm_name = "../../etc/passwd"
    msg = worker_pb2.DecodeRequest(request=request("forged-prefix", prompt), prefix=prefix)
    with pytest.raises(grpc.RpcError) as refused:
        decode(decoder, msg)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "../../etc/passwd" in refused.value.details()
    assert_pool_all_free(decoder)


def test_after_the_forgeries_genuine_requests_still_work(decoder):
    """Its own export comes back through Decode (its own address is trusted), and a
    plain request prefills locally: both complete, and the pool is clean again."""
    rt = decoder
    prompt = prompt_of(rt, seed=2)
    with grpc.insecure_channel(rt.address) as ch:
        handle = worker_pb2_grpc.PrefillStub(ch).Prefill(
            worker_pb2.PrefillRequest(request=request("own", prompt)), timeout=30
        )
    assert handle.transfer_address == rt.address and handle.lease_id
    steps = decode(rt, worker_pb2.DecodeRequest(request=request("own", prompt), kv=handle))
    assert steps[0].kv_import.transport in ("shm", "grpc", "none")
    assert not steps[0].kv_import.recomputed
    assert sum(len(s.response.token_ids) for s in steps) == 4
    steps = decode(rt, worker_pb2.DecodeRequest(request=request("plain", prompt)))
    assert sum(len(s.response.token_ids) for s in steps) == 4
    wait_for(lambda: rt.loop.call(lambda e: e.block_manager.usage()) == 0, 10, "blocks back")
    assert rt.kv_source.open_leases == 0
    rt.check_integrity()


# ---- the trusted exporters: the router's live peers -----------------------------------


def test_the_registry_answers_the_live_workers_of_exactly_the_model():
    now = [0.0]
    registry = WorkerRegistry(timeout_s=5.0, clock=lambda: now[0])

    def beat(wid: str, address: str, model: str = "m@1") -> None:
        registry.heartbeat(
            worker_pb2.WorkerStats(
                worker_id=wid,
                pool=worker_pb2.WORKER_POOL_PREFILL,
                address=address,
                model_name=model,
            )
        )

    def peers(model: str = "m@1") -> list[tuple[str, str]]:
        return [(p.worker_id, p.transfer_address) for p in registry.live_peers(model).peers]

    beat("p0", "h:1")
    beat("d0", "h:2")
    beat("x0", "h:3", model="m@2")  # the same name, another revision: other KV
    assert peers() == [("d0", "h:2"), ("p0", "h:1")]
    assert peers("m@2") == [("x0", "h:3")]
    beat("p0", "h:9")  # restarted on a new port: the old address is gone
    registry.goodbye("d0")
    assert peers() == [("p0", "h:9")]
    now[0] = 10.0
    beat("x0", "h:3", model="m@2")
    registry.sweep()  # p0 fell silent
    assert peers() == []


def test_trusted_peers_of_a_standalone_worker():
    peers = TrustedPeers("h:1", "m@1", configured=["h:2"], has_registry=False)
    assert peers.trusts("h:1") and peers.trusts("h:2")
    assert not peers.trusts("h:3")  # no registry to ask: refused at once
    peers.set_live(["h:3"])
    assert peers.trusts("h:3")


@pytest.fixture(scope="module")
def registered():
    """A router and one decode worker whose heartbeats come rarely (30 s): whatever the
    worker learns after its first beat, it learns from beats on demand."""
    c = start_cluster(ROUTER_CONFIG, {}, tiny_engine_config(num_blocks=32))
    try:
        c.heartbeat_interval_s = 30.0
        c.add_worker("d0", "decode", kv_transport="grpc")
        yield c
    finally:
        c.stop()


def registry_call(router: str, method: str, message):
    with grpc.insecure_channel(router) as ch:
        return getattr(worker_pb2_grpc.RegistryStub(ch), method)(message, timeout=5)


def register_ghost(router: str, address: str, wid: str, model: str):
    """Registers a worker at `address` where nothing listens (the test plays it)."""
    stats = worker_pb2.WorkerStats(
        worker_id=wid, pool=worker_pb2.WORKER_POOL_PREFILL, address=address, model_name=model
    )
    return registry_call(router, "Heartbeat", worker_pb2.HeartbeatRequest(stats=stats))


def test_a_worker_pulls_only_from_the_registered_live_workers_of_its_model(registered):
    c = registered
    rt = c.workers["d0"]
    model = rt.engine.model_id
    wait_for(lambda: rt.peers.live == {rt.address}, 10, "the first heartbeat's answer")
    prompt = prompt_of(rt, seed=3)
    ghost = "127.0.0.1:1"  # registered below; nothing listens there
    other = "127.0.0.1:2"  # registered below, but serving another revision of the model

    def decode_from(address: str, rid: str) -> list[worker_pb2.DecodeStep]:
        handle = genuine_handle(worker_limits(rt), len(prompt), address)
        handle.first_tokens[0].token_id = prompt[0]
        return decode(rt, worker_pb2.DecodeRequest(request=request(rid, prompt), kv=handle))

    with pytest.raises(grpc.RpcError) as refused:
        decode_from(ghost, "before")
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"'{ghost}', which is not a registered live worker of model '{model}'" in (
        refused.value.details()
    )
    answer = register_ghost(c.internal_address, ghost, "ghost", model)
    assert {p.transfer_address for p in answer.peers} == {ghost, rt.address}
    register_ghost(c.internal_address, other, "other", model.split("@")[0] + "@another-revision")
    # Trusted now (learned by a beat on demand: the next regular one is 30 s away), so it
    # is pulled from; nothing answers there, and the prompt is recomputed.
    steps = decode_from(ghost, "after")
    assert steps[0].kv_import.recomputed and ghost in steps[0].kv_import.error
    assert rt.peers.live == {ghost, rt.address}
    with pytest.raises(grpc.RpcError) as refused:
        decode_from(other, "other")
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # The ghost leaves. Until the worker's next beat it stays trusted (peers.py); the
    # next refusal asks for a beat, and from then on the ghost is refused too.
    registry_call(c.internal_address, "Goodbye", worker_pb2.GoodbyeRequest(worker_id="ghost"))
    with pytest.raises(grpc.RpcError):
        decode_from(other, "other-again")
    assert rt.peers.live == {rt.address}
    with pytest.raises(grpc.RpcError) as refused:
        decode_from(ghost, "gone")
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    c.wait_quiescent()


def test_router_treats_an_untrusted_handle_refusal_as_a_worker_failure():
    """FAILED_PRECONDITION (a decode worker's peer list lags the registry) may move the
    request to another worker, and reaches the client as UNAVAILABLE, not INTERNAL."""
    import grpc

    from pagedserve.router.failures import Failure
    from pagedserve.router.registry import WorkerInfo
    from pagedserve.v1 import worker_pb2

    w = WorkerInfo("d0", "decode", "127.0.0.1:1", worker_pb2.WorkerStats(), 0.0)
    f = Failure(grpc.StatusCode.FAILED_PRECONDITION, "not a registered live worker", "decode", w)
    assert f.kind() == "failed"
    assert f.abort(0).code == grpc.StatusCode.UNAVAILABLE
    assert "not a registered live worker" in f.abort(0).message
