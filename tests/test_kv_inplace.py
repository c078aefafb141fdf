"""In-place KV exports: a KV cache in a /dev/shm file, read by same-host pullers where
it is (kvtransfer/source.py, transport.py), and the prefill worker keeping exported
blocks pinned until the lease ends (prefill_worker/servicer.py, common/core/handoff.py).

Real components throughout: real /dev/shm files, a real second process for a pull, a
real gRPC server for the gRPC path, real workers over loopback gRPC. Random data.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch
from builders import one_torch_thread, started_workers, tiny_checkpoint  # noqa: F401

from pagedserve.common import shm
from pagedserve.common.api.model_config import ModelSpec
from pagedserve.common.core.config import CacheConfig, EngineConfig, SchedulerConfig
from pagedserve.common.core.kv_cache import KVCache, remove_stale_cache_files
from pagedserve.common.runtime.worker import WorkerConfig
from pagedserve.kvtransfer.handle import ExportedKV
from pagedserve.kvtransfer.segment import SHM_DIR, list_segments, remove_stale_segments
from pagedserve.kvtransfer.sinks import CacheSink
from pagedserve.kvtransfer.source import KVSource, StagingFullError, add_kvtransfer_service
from pagedserve.kvtransfer.transport import GrpcTransport, ShmTransport
from pagedserve.kvtransfer.wire import KVTransferError, LeaseNotFoundError, frame_kvchunk
from pagedserve.v1 import kvtransfer_pb2, worker_pb2, worker_pb2_grpc

NUM_BLOCKS, LAYERS, BS, KVH, D = 24, 4, 4, 2, 8


def spec() -> ModelSpec:
    return ModelSpec(
        "llama", 100, KVH * D, 64, LAYERS, KVH, KVH, D, 1e-5, 1e4, None, 256,
        False, False, False, None, (),
    )  # fmt: skip


def shm_cache(seed: int = 0, shm_dir: Path = SHM_DIR) -> KVCache:
    cache = KVCache(spec(), NUM_BLOCKS, BS, torch.float32, "cpu", shm_dir=shm_dir)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(seed)))
    return cache


def my_files() -> list[str]:
    pid = os.getpid()
    return sorted(
        n
        for n in os.listdir(SHM_DIR)
        if n.startswith((f"pagedserve-kv-{pid}-", f"pagedserve-kvcache-{pid}-"))
    )


@pytest.fixture(autouse=True)
def no_file_leaks():
    before = my_files()
    yield
    assert my_files() == before, "a test left /dev/shm files behind"


class Ends:
    """An on_end callback that records its calls (and what the puller could see then)."""

    def __init__(self, source: KVSource | None = None) -> None:
        self.calls: list[str] = []
        self.source = source

    def __call__(self) -> None:
        self.calls.append("end")


# -- the engine core: a cache in a shared file ----------------------------------------


def test_shm_cache_lives_in_a_named_file_until_close():
    cache = shm_cache(1)
    path = cache.shm_path
    assert path is not None and path.parent == SHM_DIR and path.exists()
    assert path.name.startswith(f"pagedserve-kvcache-{os.getpid()}-")
    assert path.stat().st_size >= cache.nbytes
    found = shm.shared_file_of(cache.kv.data_ptr(), cache.nbytes)
    assert found is not None and found[0].path == path and found[1] == 0
    # the file holds the tensor's bytes: what the engine writes, a reader of the file sees
    cache.kv[3, 1, 0].fill_(7.5)
    raw = torch.frombuffer(bytearray(path.read_bytes()[: cache.nbytes]), dtype=torch.float32)
    assert torch.equal(raw.view(cache.kv.shape), cache.kv)
    kv = cache.kv
    cache.close()
    cache.close()  # idempotent
    assert not path.exists()
    assert shm.shared_file_of(kv.data_ptr(), cache.nbytes) is None
    assert float(kv[3, 1, 0, 0, 0, 0]) == 7.5  # the memory stays mapped for the engine


def test_ordinary_memory_cache_is_not_shared():
    cache = KVCache(spec(), NUM_BLOCKS, BS, torch.float32, "cpu")
    assert cache.shm_path is None
    assert shm.shared_file_of(cache.kv.data_ptr(), cache.nbytes) is None
    assert not bool(cache.kv.any())


def test_shm_cache_without_room_falls_back_to_memory_and_says_so(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(shm, "free_bytes", lambda _dir: 4096)  # a full tmpfs
    with caplog.at_level(logging.WARNING, "pagedserve.common.core.kv_cache"):
        cache = KVCache(spec(), NUM_BLOCKS, BS, torch.float32, "cpu", shm_dir=tmp_path)
    assert cache.shm_path is None and list(tmp_path.iterdir()) == []
    assert "ordinary memory" in caplog.text
    cache.kv.normal_()  # usable


def test_stale_cache_files_of_dead_processes_are_removed(tmp_path):
    proc = mp.get_context("spawn").Process(target=os.getpid)
    proc.start()
    proc.join()
    stale = tmp_path / f"pagedserve-kvcache-{proc.pid}-0123456789abcdef"
    stale.write_bytes(b"x")
    mine = tmp_path / f"pagedserve-kvcache-{os.getpid()}-0123456789abcdef"
    mine.write_bytes(b"x")
    other = tmp_path / f"pagedserve-kv-{proc.pid}-lease"  # a segment: not this sweep's
    other.write_bytes(b"x")
    assert remove_stale_cache_files(tmp_path) == [stale.name]
    assert mine.exists() and other.exists()
    assert remove_stale_segments(tmp_path) == [other.name]


# -- kvtransfer: in-place export and pull ---------------------------------------------


def test_in_place_pull_into_permuted_destination_blocks():
    cache = shm_cache(2)
    dst = torch.randn(NUM_BLOCKS, LAYERS, 2, BS, KVH, D)
    src_ids, dst_ids = [7, 3, 4, 5, 19, 0], [11, 2, 20, 9, 10, 1]
    ends = Ends()
    with KVSource() as source:
        handle = source.export(cache.kv, src_ids, num_tokens=23, on_end=ends)
        assert handle.in_place
        assert source.staged_bytes == 0  # nothing copied at export
        assert source.pinned_bytes == len(src_ids) * cache.kv[0].numel() * 4
        assert source.in_place_total == 1
        before = dst.clone()
        result = ShmTransport().pull_into(handle, CacheSink(dst, dst_ids))
        assert result.num_blocks == 6 and result.payload_bytes == source.pinned_bytes
        assert torch.equal(dst[dst_ids], cache.kv[src_ids])
        untouched = [b for b in range(NUM_BLOCKS) if b not in dst_ids]
        assert torch.equal(dst[untouched], before[untouched])
        assert ends.calls == []  # the lease is still open: blocks stay pinned
        assert source.release(handle.lease_id)
        assert ends.calls == ["end"]
        assert not source.release(handle.lease_id)
        assert ends.calls == ["end"]  # exactly once
    cache.close()


def _read_only_rss_kib(path: str) -> int:
    """Rss of this process's read-only shared mappings of `path` (the puller's; the
    exporter's own mapping of its cache is read-write), from /proc/self/smaps."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and ":" not in head[0]:  # lo-hi perms offset dev inode path
            inside = len(head) >= 6 and head[-1] == path and head[1].startswith("r--s")
        elif inside and line.startswith("Rss:"):
            total += int(head[1])
    return total


def test_puller_maps_the_exporters_cache_lazily():
    """A pull maps the exporter's whole cache file but faults in only around what it
    copies: a 16 MiB cache, two 2 KiB blocks pulled; the kernel maps up to 64 KiB around
    each fault of a file mapping, so at most a few hundred KiB (populating every page
    table entry up front cost 0.8 s per GiB of cache on the developers' Xeon, inside
    the first pull)."""
    cache = KVCache(spec(), 8192, BS, torch.float32, "cpu", shm_dir=SHM_DIR)
    transport = ShmTransport()
    try:
        cache.kv[[6000, 7]] = torch.randn(2, *cache.kv.shape[1:])
        found = shm.shared_file_of(cache.kv.data_ptr(), cache.nbytes)
        assert found is not None and cache.nbytes == 16 << 20
        dst = torch.zeros(4, LAYERS, 2, BS, KVH, D)
        with KVSource() as source:
            handle = source.export(cache.kv, [6000, 7], num_tokens=8, on_end=Ends())
            transport.pull_into(handle, CacheSink(dst, [0, 3]))
            assert torch.equal(dst[[0, 3]], cache.kv[[6000, 7]])
            rss = _read_only_rss_kib(str(found[0].path))
            assert 0 < rss <= 512, f"{rss} KiB of the 16384 KiB cache file mapped in"
            assert source.release(handle.lease_id)
    finally:
        transport.close()
        cache.close()


def test_in_place_partial_pulls_block_subset_and_layer_range():
    cache = shm_cache(3)
    src_ids = [5, 6, 7, 2, 13]
    with KVSource() as source:
        handle = source.export(cache.kv, src_ids, num_tokens=20, on_end=Ends())
        shm = ShmTransport()
        sub = shm.pull(handle, block_ids=[7, 5, 13])
        assert torch.equal(sub, cache.kv[[7, 5, 13]])
        layers = shm.pull(handle, block_ids=[6, 7], layers=(1, 3))
        assert torch.equal(layers, cache.kv[[6, 7], 1:3])
        dst = torch.zeros(NUM_BLOCKS, LAYERS, 2, BS, KVH, D)
        shm.pull_into(handle, CacheSink(dst, [4, 8]), block_ids=[2, 13], layers=(2, 4))
        assert torch.equal(dst[[4, 8], 2:4], cache.kv[[2, 13], 2:4])
        assert not bool(dst[[4, 8], :2].any()) and not bool(dst[[0, 1, 2, 3]].any())
        shm.close()
    cache.close()


def test_lease_ends_invalidate_the_descriptor_before_on_end():
    """Release, expiry and close each call on_end once, and only once no puller can start
    a pull of the lease any more (its descriptor is gone)."""
    cache = shm_cache(4)
    now = [0.0]
    seen: list[tuple[str, bool]] = []
    handles: dict[str, ExportedKV] = {}

    def ender(name: str):
        return lambda: seen.append((name, (SHM_DIR / handles[name].shm_name).exists()))

    with KVSource(clock=lambda: now[0]) as source:
        for name, ttl in (("release", 10.0), ("expire", 1.0), ("close", 10.0)):
            handles[name] = source.export(
                cache.kv, [1, 2], num_tokens=8, ttl_s=ttl, on_end=ender(name)
            )
        assert all(h.in_place for h in handles.values())
        source.release(handles["release"].lease_id)
        assert seen == [("release", False)]
        now[0] = 1.0
        assert source.expire() == [handles["expire"].lease_id]
        assert seen[-1] == ("expire", False)
    assert seen == [("release", False), ("expire", False), ("close", False)]
    cache.close()


def test_expiry_calls_on_end_and_counts():
    cache = shm_cache(5)
    now = [0.0]
    ends = Ends()
    with KVSource(clock=lambda: now[0], default_ttl_s=1.0) as source:
        handle = source.export(cache.kv, [0, 9], num_tokens=5, on_end=ends)
        now[0] = 0.5
        assert source.expire() == [] and ends.calls == []
        now[0] = 1.0
        assert source.expire() == [handle.lease_id]
        assert ends.calls == ["end"] and source.expired_total == 1
        with pytest.raises(LeaseNotFoundError):
            ShmTransport().pull(handle)
    assert ends.calls == ["end"]  # close does not end it twice
    cache.close()


def test_pull_of_a_lease_ended_before_it_fails_cleanly():
    cache = shm_cache(6)
    with KVSource() as source:
        handle = source.export(cache.kv, [3, 4], num_tokens=8, on_end=Ends())
        source.release(handle.lease_id)
        with pytest.raises(LeaseNotFoundError, match="gone"):
            ShmTransport().pull(handle)
    cache.close()


class EndingSink(CacheSink):
    """A real cache sink whose copy is interrupted by the lease's end: the exporter
    releases the lease (and a new lease of other data reuses nothing here, but the
    block may be reused) after the puller checked the descriptor and before it copied."""

    def __init__(self, kv, ids, source: KVSource, lease_id: str) -> None:
        super().__init__(kv, ids)
        self.source, self.lease_id = source, lease_id

    def copy_from(self, src, src_map) -> bool:
        assert self.source.release(self.lease_id)
        return super().copy_from(src, src_map)


def test_lease_ended_during_the_pull_fails_cleanly():
    cache = shm_cache(7)
    ends = Ends()
    dst = torch.zeros(NUM_BLOCKS, LAYERS, 2, BS, KVH, D)
    with KVSource() as source:
        handle = source.export(cache.kv, [3, 4, 5], num_tokens=9, on_end=ends)
        sink = EndingSink(dst, [0, 1, 2], source, handle.lease_id)
        with pytest.raises(LeaseNotFoundError, match="ended during the pull"):
            ShmTransport().pull_into(handle, sink)
        assert ends.calls == ["end"]
    cache.close()


def test_staged_instead_past_the_cap_or_for_a_cache_in_ordinary_memory():
    cache = shm_cache(8)
    block = cache.kv[0].numel() * 4
    plain = torch.randn(NUM_BLOCKS, LAYERS, 2, BS, KVH, D)
    ends = Ends()
    with KVSource(max_in_place_bytes=3 * block) as source:
        a = source.export(cache.kv, [0, 1], num_tokens=8, on_end=ends)
        b = source.export(cache.kv, [2, 3], num_tokens=8, on_end=ends)  # 4 blocks > 3
        c = source.export(plain, [2, 3], num_tokens=8, on_end=ends)
        d = source.export(cache.kv, [4], num_tokens=4)  # no on_end: never in place
        assert [h.in_place for h in (a, b, c, d)] == [True, False, False, False]
        assert source.in_place_refused == 1 and source.pinned_bytes == 2 * block
        assert source.staged_bytes > 0
        shm_t = ShmTransport()
        assert torch.equal(shm_t.pull(b), cache.kv[[2, 3]])  # the staged path, unchanged
        assert torch.equal(shm_t.pull(c), plain[[2, 3]])
        for h in (b, c, d):
            source.release(h.lease_id)
        assert ends.calls == []  # staged exports never call on_end
        e = source.export(cache.kv, [5], num_tokens=4, on_end=ends)  # room again
        assert e.in_place
        source.release(a.lease_id)
        source.release(e.lease_id)
        assert ends.calls == ["end", "end"] and source.pinned_bytes == 0
    cache.close()


def test_in_place_leases_count_against_the_lease_cap():
    cache = shm_cache(9)
    with KVSource(max_open_leases=1) as source:
        source.export(cache.kv, [1], num_tokens=4, on_end=Ends())
        with pytest.raises(StagingFullError):
            source.export(cache.kv, [2], num_tokens=4, on_end=Ends())
    cache.close()


def test_grpc_pull_of_an_in_place_lease_is_gathered_and_checksummed():
    cache = shm_cache(10)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    source = KVSource()
    add_kvtransfer_service(server, source)
    port = server.add_insecure_port("127.0.0.1:0")
    source.transfer_address = f"127.0.0.1:{port}"
    server.start()
    transport = GrpcTransport(max_chunk_bytes=1024)  # several chunks per pull
    try:
        ids = [9, 2, 17, 4]
        handle = source.export(cache.kv, ids, num_tokens=13, on_end=Ends())
        assert handle.in_place
        dst = torch.zeros(NUM_BLOCKS, LAYERS, 2, BS, KVH, D)
        result = transport.pull_into(handle, CacheSink(dst, [0, 5, 6, 3]))
        assert result.num_chunks > 1 and result.transport == "grpc"
        assert torch.equal(dst[[0, 5, 6, 3]], cache.kv[ids])
        part = transport.pull(handle, block_ids=[17, 9], layers=(1, 4))
        assert torch.equal(part, cache.kv[[17, 9], 1:4])
        # every chunk is sealed: a bad checksum would fail the pull
        staged = source.get(handle.lease_id)
        chunks = list(staged.chunks())
        assert all(len(p) > 0 for _, p in chunks)
        source.release(handle.lease_id)
        with pytest.raises(LeaseNotFoundError):
            transport.pull(handle)
    finally:
        transport.close()
        server.stop(None).wait()
        source.close()
        cache.close()


@pytest.mark.parametrize("checksum", ["xxh3", "crc32"])
def test_in_place_messages_are_the_staged_messages_byte_for_byte(checksum):
    """PullBlocks of an in-place lease frames each chunk straight from the cache's rows
    (checksummed where they lie, one join): every message must equal the one a staged
    export of the same blocks sends (gathered into a segment, sealed, framed), for the
    whole lease and for a part (blocks out of order, a layer range, odd chunk size)."""
    cache = shm_cache(12)  # units of 256 bytes: chunks of 3 units cut blocks of 8
    ids = [9, 2, 3, 17, 4]  # 2, 3 adjacent: one run of rows across two blocks
    try:
        with KVSource(checksum=checksum, max_chunk_bytes=800) as source:
            in_place = source.export(cache.kv, ids, num_tokens=17, request_id="r", on_end=Ends())
            staged = source.export(cache.kv, ids, num_tokens=17, request_id="r")
            assert in_place.in_place and not staged.in_place
            a, b = source.get(in_place.lease_id), source.get(staged.lease_id)
            for args in [(), ([17, 9, 3], (1, 3), 1300), (None, (2, 4), 512)]:
                got = list(a.messages(*args))
                want = [frame_kvchunk(h, p) for h, p in b.chunks(*args)]
                assert len(got) > 1 and got == want
                # and what `chunks` gives is the same chunk, unframed
                assert [frame_kvchunk(h, p) for h, p in a.chunks(*args)] == want
            with pytest.raises(ValueError, match="not in the lease"):
                a.messages([5])
    finally:
        cache.close()


def _child_pull(handle_bytes: bytes, dst_ids: list[int], conn) -> None:
    """Another process: pull an in-place lease into its own cache, send the blocks back."""
    try:
        handle = ExportedKV.from_proto(kvtransfer_pb2.KVHandle.FromString(handle_bytes))
        dst = torch.zeros(NUM_BLOCKS, LAYERS, 2, BS, KVH, D)
        ShmTransport().pull_into(handle, CacheSink(dst, dst_ids))
        conn.send(dst[dst_ids].numpy().tobytes())
    except BaseException as e:  # reported to the parent
        conn.send(repr(e))


def test_second_process_pulls_in_place():
    cache = shm_cache(11)
    ids, dst_ids = [12, 1, 8], [2, 22, 5]
    with KVSource() as source:
        handle = source.export(cache.kv, ids, num_tokens=10, on_end=Ends())
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=_child_pull, args=(handle.to_proto().SerializeToString(), dst_ids, child)
        )
        proc.start()
        got = parent.recv() if parent.poll(60) else "no answer"
        proc.join(10)
        assert isinstance(got, bytes), got
        blocks = torch.frombuffer(bytearray(got), dtype=torch.float32).view(
            3, LAYERS, 2, BS, KVH, D
        )
        assert torch.equal(blocks, cache.kv[ids])
    cache.close()


def test_descriptor_naming_a_foreign_file_is_refused(tmp_path):
    """A descriptor is parsed as a trust boundary: a cache name outside the rule fails."""
    from pagedserve.kvtransfer.segment import CacheRef

    with pytest.raises(KVTransferError):
        CacheRef.unpack(CacheRef("../etc/passwd", 0, 1, 1).pack())
    ok = CacheRef(f"pagedserve-kvcache-{os.getpid()}-0123456789abcdef", 0, 4, 64)
    assert CacheRef.unpack(ok.pack()) == ok


def test_close_leaves_no_files():
    cache = shm_cache(12)
    source = KVSource()
    ends = Ends()
    for i in range(3):
        source.export(cache.kv, [i], num_tokens=4, on_end=ends)
    source.export(cache.kv, [5], num_tokens=4)  # a staged one too
    assert len([n for n in list_segments() if n.startswith(f"pagedserve-kv-{os.getpid()}-")]) == 4
    source.close()
    cache.close()
    assert ends.calls == ["end"] * 3
    # no_file_leaks checks /dev/shm


# -- the prefill worker: pins kept until the lease ends --------------------------------


def _engine_config(shm_dir: str | None) -> EngineConfig:
    return EngineConfig(
        model=str(tiny_checkpoint("llama")),
        dtype="float32",
        cache=CacheConfig(num_blocks=96, shm_dir=shm_dir),
        scheduler=SchedulerConfig(max_model_len=256),
    )


@pytest.fixture(scope="module")
def workers():
    configs = {
        "pre": WorkerConfig("ip-p0", "prefill", _engine_config(str(SHM_DIR))),
        "dec": WorkerConfig("ip-d0", "decode", _engine_config(None)),
        "dec_grpc": WorkerConfig("ip-d1", "decode", _engine_config(None), kv_transport="grpc"),
    }
    with started_workers(configs) as rts:
        yield rts


def _stub(rt, kind):
    return kind(grpc.insecure_channel(rt.address))


def _prompt(seed: int, n: int = 45) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _request(rid: str, prompt: list[int]):
    from pagedserve.common.api.sampling_params import SamplingParams
    from pagedserve.common.runtime.protocol import sampling_to_pb

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    return worker_pb2.TokenizedRequest(
        request_id=rid, prompt_token_ids=prompt, sampling=sampling_to_pb(params)
    )


def _free_and_pins(rt) -> tuple[int, set[str]]:
    """The block manager's allocatable count and the hand-off's pins, read on the engine
    thread after every command queued before (a posted unpin included)."""
    return rt.loop.call(lambda e: (e.block_manager.num_free_blocks(), set(e.handoff.pinned)))


def _wait_free(rt, free: int) -> tuple[int, set[str]]:
    deadline = time.monotonic() + 10
    got = _free_and_pins(rt)
    while got != (free, set()) and time.monotonic() < deadline:
        time.sleep(0.05)
        got = _free_and_pins(rt)
    return got


def _decode(rt, req, handle):
    msg = worker_pb2.DecodeRequest(request=req)
    msg.kv.CopyFrom(handle)
    tokens, info = [], None
    for step in _stub(rt, worker_pb2_grpc.DecodeStub).Decode(msg, timeout=60):
        if step.HasField("kv_import"):
            info = step.kv_import
        tokens.extend(step.response.token_ids)
    return tokens, info


@pytest.mark.parametrize("which, transport", [("dec", "shm"), ("dec_grpc", "grpc")])
def test_prefill_exports_in_place_and_blocks_return_when_the_lease_ends(workers, which, transport):
    pre, dec = workers["pre"], workers[which]
    assert pre.engine.kv_cache.shm_path is not None
    start, _ = _free_and_pins(pre)
    in_place_before = pre.kv_source.in_place_total
    p = _prompt(21)
    req = _request(f"ip-{which}", p)
    handle = _stub(pre, worker_pb2_grpc.PrefillStub).Prefill(
        worker_pb2.PrefillRequest(request=req), timeout=60
    )
    assert pre.kv_source.in_place_total == in_place_before + 1
    free, pins = _free_and_pins(pre)
    assert pins == {f"lease#{handle.lease_id}"}  # held for the lease, not the request
    assert free == start - len(handle.block_ids)
    tokens, info = _decode(dec, req, handle)
    assert info.transport == transport and info.pulled_blocks == 3 and not info.recomputed
    # same tokens as a prefill on the decode worker itself
    local, local_info = _decode_local(dec, _request(f"ip-{which}-local", p))
    assert local_info.transport == "local" and tokens == local
    assert _wait_free(pre, start) == (start, set())  # released by the decode worker


def _decode_local(rt, req):
    tokens, info = [], None
    for step in _stub(rt, worker_pb2_grpc.DecodeStub).Decode(
        worker_pb2.DecodeRequest(request=req), timeout=60
    ):
        if step.HasField("kv_import"):
            info = step.kv_import
        tokens.extend(step.response.token_ids)
    return tokens, info


def test_unpulled_in_place_lease_expires_and_unpins(workers):
    pre = workers["pre"]
    start, _ = _free_and_pins(pre)
    handle = _stub(pre, worker_pb2_grpc.PrefillStub).Prefill(
        worker_pb2.PrefillRequest(request=_request("ip-exp", _prompt(22)), lease_ttl_ms=300),
        timeout=60,
    )
    assert _free_and_pins(pre)[1] == {f"lease#{handle.lease_id}"}
    assert _wait_free(pre, start) == (start, set())  # the step hook's expiry unpinned
    with pytest.raises(LeaseNotFoundError):
        ShmTransport().pull(ExportedKV.from_proto(handle))


def test_in_place_cap_defaults_to_half_the_cache(workers):
    pre = workers["pre"]
    assert pre.kv_source.max_in_place_bytes == pre.engine.kv_cache.nbytes // 2 > 0
    explicit = WorkerConfig("x", "prefill", kv_max_in_place_bytes=4096)
    assert explicit.in_place_cap_bytes(1 << 30) == 4096
    with pytest.raises(ValueError, match="kv_max_in_place_bytes"):
        WorkerConfig("x", "prefill", kv_max_in_place_bytes=-1)


def test_release_lease_rpc_unpins(workers):
    pre = workers["pre"]
    start, _ = _free_and_pins(pre)
    stub = _stub(pre, worker_pb2_grpc.PrefillStub)
    handle = stub.Prefill(worker_pb2.PrefillRequest(request=_request("ip-rel", _prompt(23))))
    assert _free_and_pins(pre)[1] == {f"lease#{handle.lease_id}"}
    assert stub.ReleaseLease(worker_pb2.ReleaseLeaseRequest(lease_id=handle.lease_id)).released
    assert _free_and_pins(pre) == (start, set())  # the posted unpin ran before this call


def test_prefix_export_in_place_keeps_its_pin_until_release(workers):
    pre = workers["pre"]
    stub = _stub(pre, worker_pb2_grpc.PrefillStub)
    p = _prompt(24, 40)
    first = stub.Prefill(worker_pb2.PrefillRequest(request=_request("ip-pfx", p)))
    stub.ReleaseLease(worker_pb2.ReleaseLeaseRequest(lease_id=first.lease_id))
    start, _ = _free_and_pins(pre)
    handle = stub.ExportPrefix(worker_pb2.ExportPrefixRequest(token_ids=p))
    free, pins = _free_and_pins(pre)
    assert len(pins) == 1 and free == start - len(handle.block_ids)
    blocks = ShmTransport().pull(ExportedKV.from_proto(handle))
    assert torch.equal(blocks, pre.engine.kv_cache.kv[list(handle.block_ids)])
    assert stub.ReleaseLease(worker_pb2.ReleaseLeaseRequest(lease_id=handle.lease_id)).released
    assert _free_and_pins(pre) == (start, set())


def test_caller_gone_before_the_handle_unpins(workers):
    """`_hand_over` for a caller that left: the lease is released, its pin dropped."""
    from pagedserve.prefill_worker.servicer import PrefillServicer

    class LeftContext:  # what gRPC hands a servicer whose caller went away
        def is_active(self) -> bool:
            return False

        def abort(self, code, details):
            raise grpc.RpcError(details)

    pre = workers["pre"]
    start, _ = _free_and_pins(pre)
    handle = _stub(pre, worker_pb2_grpc.PrefillStub).Prefill(
        worker_pb2.PrefillRequest(request=_request("ip-left", _prompt(25)))
    )
    assert _free_and_pins(pre)[1] == {f"lease#{handle.lease_id}"}
    with pytest.raises(grpc.RpcError):
        PrefillServicer(pre)._hand_over(LeftContext(), handle.lease_id)
    assert _free_and_pins(pre) == (start, set())
