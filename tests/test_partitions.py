"""Network partitions between real processes in network namespaces (tests/netns.py).

The router, a prefill worker and a decode worker run as subprocesses, each in a
namespace of its own, linked pairwise by veths on 192.0.2.0/24 (TEST-NET-1):

    router r 192.0.2.1 ---- 192.0.2.2 p (prefill, advertises 192.0.2.2)
    router r 192.0.2.5 ---- 192.0.2.6 d (decode)
    prefill p 192.0.2.9 ---- 192.0.2.10 d

KV crosses the p-d link through the gRPC transport: inside d, 192.0.2.2 is a local
address where this test's fault-injecting TCP proxy listens (netns.Forwarder), and
the proxy dials p over the p-d link; so a test can cut that link, shape it (tbf), or
delay / blackhole / reset the KV connections. The router reaches p and d over their
own links; this process reaches the router through a forwarder into r.

Each row: a request in flight meets the fault, then the network is restored. The
request completes with the greedy tokens of the engine alone, or ends no later than
its deadline with UNAVAILABLE / DEADLINE_EXCEEDED and a message naming the worker;
afterwards both workers are registered again, hold no block and no lease (a
ReleaseLease lost in the partition may end by its TTL: that is what TTLs are for),
pass `check_integrity()`, and the router's index equals their caches.

Skipped where `ip netns add` is refused (not root, no CAP_NET_ADMIN).
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import pytest
from builders import tiny_checkpoint
from netns import ControlledProcess, End, NetLab
from router_fixtures import MAX_MODEL_LEN, ROUTER_CONFIG, wait_for

from pagedserve.common.api.sampling_params import SamplingParams
from pagedserve.common.core.llm import LLM
from pagedserve.router.client import Client

pytestmark = pytest.mark.slow

GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPT_LEN = 200  # ~100 KB of KV: a transfer a 1 Mbit/s link takes about a second for
MAX_TOKENS = 8
DEADLINE_S = 6.0
SLACK_S = 2.0
WORKER_TIMEOUT_S = 3.0
INDEX_TTL_S = 2.0
LEASE_TTL_S = 4.0
KV_PULL_TIMEOUT_S = 2.5  # > the 1.5 s a chunk is held in TRANSFER_WINDOW
ROUTER_PORT = 50051  # inside r's namespace: nothing else is there
ROUTER_INTERNAL_PORT = 50052  # its internal listener (Registry, PrefixIndex)
PREFILL_PORT = 50061  # p's, and the KV proxy's inside d
TRANSFER_WINDOW = "delay_chunk_ms=1500"  # the prefill worker holds each chunk this long
STREAM_WINDOW = "delay_rpc=Decode.step:300"  # the decode worker streams this slowly

WORKER_MAIN = r"""
import json, sys
import torch
torch.set_num_threads(1)
from pagedserve.common.core.config import CacheConfig, EngineConfig, SchedulerConfig
from pagedserve.common.runtime.worker import WorkerConfig
from pagedserve.kvtransfer import faults
from pagedserve.worker import start_worker

c = json.loads(sys.argv[1])
engine = EngineConfig(
    model=c.pop("model"), dtype="float32", cache=CacheConfig(num_blocks=128),
    scheduler=SchedulerConfig(max_model_len=c.pop("max_model_len")), num_threads=1,
)
rt = start_worker(WorkerConfig(engine=engine, **c))
print("READY", rt.address, flush=True)
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    try:
        if cmd == "state":  # integrity checked, then blocks in use, leases, cached hashes
            rt.check_integrity()
            usage = rt.loop.call(lambda e: e.block_manager.usage())
            hashes = rt.loop.call(lambda e: e.block_manager.cached_hashes())
            out = {"usage": usage, "leases": rt.kv_source.open_leases,
                   "hashes": sorted(h.hex() for h in hashes)}
        elif cmd == "faults":  # PAGEDSERVE_FAULTS syntax; empty: off
            spec = faults.FaultSpec.parse(arg) if arg else None
            faults.install(faults.FaultInjector(spec) if spec else None)
            out = {}
        elif cmd == "counts":  # what the injector did so far ("chunks": entered the hook)
            out = dict(faults.active().counts) if faults.active() else {}
        print("STATE", json.dumps(out), flush=True)
    except Exception as e:
        print("ERROR", repr(e).replace("\n", " "), flush=True)
rt.stop(grace=0.5)
"""

ROUTER_MAIN = r"""
import json, sys
from pagedserve.router.config import RouterConfig
from pagedserve.router.server import start_router_in_thread

router = start_router_in_thread(RouterConfig(**json.loads(sys.argv[1])))
print("READY", router.address, flush=True)

def index(r):
    ix = r.prefix.index()
    return {w: sorted(h.hex() for h in ix.worker_hashes(w)) for w in ix.workers()}

def inflight(r, wid):
    w = r.registry.get(wid)
    return 0 if w is None else w.inflight

for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    try:
        if cmd == "live":
            out = router.live_worker_ids()
        elif cmd == "index":
            out = router.call(index)
        elif cmd == "inflight":
            out = router.call(lambda r: inflight(r, arg))
        print("STATE", json.dumps(out), flush=True)
    except Exception as e:
        print("ERROR", repr(e).replace("\n", " "), flush=True)
router.stop()
"""


# ---- the lab ---------------------------------------------------------------------------------


@dataclass
class Lab:
    net: NetLab
    router: ControlledProcess
    client_address: str
    workers: dict[str, ControlledProcess]
    kv_proxy: object  # netns.Forwarder on the p-d path
    p_d: End  # p's end of the p-d link (the KV path)
    d_r: End  # d's end of the r-d link (the token stream)

    def client(self) -> Client:
        return Client(self.client_address)


@pytest.fixture(scope="module")
def lab():
    net = NetLab.create(f"ps{os.getpid() % 100000}")
    try:
        r, p, d = net.add_ns("r"), net.add_ns("p"), net.add_ns("d")
        rp = net.link(r, "192.0.2.1", p, "192.0.2.2")
        rd = net.link(r, "192.0.2.5", d, "192.0.2.6")
        pd = net.link(p, "192.0.2.9", d, "192.0.2.10")
        model = str(tiny_checkpoint("llama"))
        router_config = dict(
            host="0.0.0.0",  # inside r: its loopback and its two links only
            port=ROUTER_PORT,
            internal_host="0.0.0.0",  # the workers reach it over their links
            internal_port=ROUTER_INTERNAL_PORT,
            model=model,
            max_model_len=MAX_MODEL_LEN,
            worker_timeout_s=WORKER_TIMEOUT_S,
            disagg_min_prompt_tokens=8,
            max_inflight=ROUTER_CONFIG.max_inflight,
        )
        router = net.start(r, ROUTER_MAIN, router_config)
        router.wait_ready()
        # The KV path: d dials p's advertised 192.0.2.2, local in d, where the proxy is.
        net.add_local(d, rp.b.address)
        kv_proxy = net.forward(d, (rp.b.address, PREFILL_PORT), d, (pd.a.address, PREFILL_PORT))
        common = dict(
            model=model,
            max_model_len=MAX_MODEL_LEN,
            host="0.0.0.0",  # inside its namespace: its loopback and its links only
            index_ttl_s=INDEX_TTL_S,
            heartbeat_interval_s=0.2,
            kv_transport="grpc",
            lease_ttl_s=LEASE_TTL_S,
            # A pull that stalls (a cut link, a silent exporter) gives up this early and
            # the decode worker recomputes the prompt: well within the client's deadline.
            kv_pull_timeout_s=KV_PULL_TIMEOUT_S,
        )
        workers = {
            "p0": net.start(
                p,
                WORKER_MAIN,
                dict(
                    common, worker_id="p0", pool="prefill", port=PREFILL_PORT,
                    advertise_host=rp.b.address,
                    registry_address=f"{rp.a.address}:{ROUTER_INTERNAL_PORT}",
                    index_address=f"{rp.a.address}:{ROUTER_INTERNAL_PORT}",
                ),
            ),
            "d0": net.start(
                d,
                WORKER_MAIN,
                dict(
                    common, worker_id="d0", pool="decode", advertise_host=rd.b.address,
                    registry_address=f"{rd.a.address}:{ROUTER_INTERNAL_PORT}",
                    index_address=f"{rd.a.address}:{ROUTER_INTERNAL_PORT}",
                ),
            ),
        }  # fmt: skip
        for w in workers.values():
            w.wait_ready()
        front = net.forward(None, ("127.0.0.1", 0), r, ("127.0.0.1", ROUTER_PORT))
        address = "{}:{}".format(*front.address)
        lab = Lab(net, router, address, workers, kv_proxy, pd.a, rd.b)
        wait_registered(lab)
        yield lab
    finally:
        net.close()


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(
        str(tiny_checkpoint("llama")), dtype="float32", num_blocks=64, max_model_len=MAX_MODEL_LEN
    )


def wait_registered(lab: Lab, timeout: float = 60.0) -> None:
    wait_for(lambda: set(lab.workers) <= set(lab.router.command("live")), timeout, "both workers")


def clean(lab: Lab) -> bool:
    index = lab.router.command("index")
    for wid, w in lab.workers.items():
        s = w.command("state")  # check_integrity() inside the worker
        if s["usage"] or s["leases"] or index.get(wid, []) != s["hashes"]:
            return False
    return set(index) <= set(lab.workers)


def router_inflight(lab: Lab, worker_id: str) -> int:
    return lab.router.command(f"inflight {worker_id}")


# ---- one request -----------------------------------------------------------------------------


@dataclass
class Outcome:
    tokens: list[int]
    code: grpc.StatusCode
    details: str
    seconds: float


def run_request(lab: Lab, ids: list[int], during: Callable[[threading.Event], None]) -> Outcome:
    """Streams `ids`; `during(first_token)` runs meanwhile (it injects the fault)."""
    first = threading.Event()
    result: dict = {}

    def run() -> None:
        tokens: list[int] = []
        t0 = time.monotonic()
        try:
            with lab.client() as c:
                for r in c.generate(
                    token_ids=ids, max_tokens=MAX_TOKENS, timeout=DEADLINE_S, **GREEDY
                ):
                    tokens += r.token_ids
                    first.set()
            result["o"] = Outcome(tokens, grpc.StatusCode.OK, "", time.monotonic() - t0)
        except grpc.RpcError as e:
            result["o"] = Outcome(tokens, e.code(), e.details() or "", time.monotonic() - t0)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    during(first)
    thread.join(DEADLINE_S + SLACK_S)
    assert not thread.is_alive(), f"the call outlived its {DEADLINE_S} s deadline"
    return result["o"]


# ---- the table -------------------------------------------------------------------------------


def in_transfer(lab: Lab) -> None:
    """Until the decode worker is pulling: p0 holds its first chunk (TRANSFER_WINDOW)
    now, and for 1.5 s, time enough to inject the fault meanwhile."""
    wait_for(lambda: router_inflight(lab, "d0") == 1, 20, "the decode call")
    wait_for(lambda: lab.workers["p0"].command("counts").get("chunks", 0) >= 1, 20, "the pull")


def cut_kv_link_in_transfer(lab: Lab, first: threading.Event) -> Callable[[], None]:
    in_transfer(lab)
    lab.net.down(lab.p_d)
    return lambda: lab.net.up(lab.p_d)


def cut_router_link_in_stream(lab: Lab, first: threading.Event) -> Callable[[], None]:
    assert first.wait(20), "no first token"
    lab.net.down(lab.d_r)
    return lambda: lab.net.up(lab.d_r)


def slow_kv_link(lab: Lab, first: threading.Event) -> Callable[[], None]:
    return lambda: None  # shaped before the request (test_partition)


def proxy_delay(lab: Lab, first: threading.Event) -> Callable[[], None]:
    return lambda: None  # set before the request (test_partition)


def blackhole_in_transfer(lab: Lab, first: threading.Event) -> Callable[[], None]:
    in_transfer(lab)
    lab.kv_proxy.blackhole.set()
    return lab.kv_proxy.blackhole.clear


def reset_in_transfer(lab: Lab, first: threading.Event) -> Callable[[], None]:
    in_transfer(lab)
    lab.kv_proxy.reset()
    return lambda: None


@dataclass(frozen=True)
class Row:
    name: str
    fault: Callable[[Lab, threading.Event], Callable[[], None]]  # returns the restore
    # None: completes with the reference tokens; else the status, naming the worker.
    expect: grpc.StatusCode | None = None
    p_faults: str = ""  # each worker's fault injection for this row (faults.py syntax)
    d_faults: str = ""
    xfail: str | None = None  # the branch (and fix) this row waits for

    def param(self):
        marks = [pytest.mark.xfail(strict=True, reason=self.xfail)] if self.xfail else []
        return pytest.param(self, id=self.name, marks=marks)


ROWS = [
    # The pull stalls; after kv_pull_timeout_s the decode worker recomputes the prompt.
    Row("link_cut_mid_transfer", cut_kv_link_in_transfer, p_faults=TRANSFER_WINDOW),
    # d's heartbeats stop: the router drops it and ends the silent stream naming it.
    Row("link_cut_mid_stream", cut_router_link_in_stream, grpc.StatusCode.UNAVAILABLE,
        d_faults=STREAM_WINDOW),
    Row("slow_link_tbf_1mbit", slow_kv_link),
    Row("proxy_delay_100ms", proxy_delay),
    Row("proxy_loss_mid_transfer", blackhole_in_transfer, p_faults=TRANSFER_WINDOW),
    # The pull fails at once; the decode worker recomputes.
    Row("proxy_reset_mid_transfer", reset_in_transfer, p_faults=TRANSFER_WINDOW),
]  # fmt: skip


@pytest.mark.parametrize("row", [r.param() for r in ROWS])
def test_partition(lab, llm, row):
    # From a known state, whatever the previous row left (an xfail row stops early).
    wait_registered(lab)
    wait_for(lambda: clean(lab), LEASE_TTL_S + INDEX_TTL_S + 10, "a clean start")
    ids = [random.Random(row.name).randrange(3, 313) for _ in range(PROMPT_LEN)]
    want = llm.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, **GREEDY))[0]
    want = want.completions[0].token_ids
    lab.workers["p0"].command(f"faults {row.p_faults}")
    lab.workers["d0"].command(f"faults {row.d_faults}")
    if row.fault is slow_kv_link:
        lab.net.shape(lab.p_d, "1mbit", "32kbit", "400ms")
    if row.fault is proxy_delay:
        lab.kv_proxy.delay_s = 0.1
    restores: list[Callable[[], None]] = []
    try:
        out = run_request(lab, ids, lambda first: restores.append(row.fault(lab, first)))
    finally:
        for restore in restores:
            restore()
        lab.net.unshape(lab.p_d)
        lab.kv_proxy.delay_s = 0.0
        lab.kv_proxy.blackhole.clear()
        lab.workers["p0"].command("faults ")
        lab.workers["d0"].command("faults ")
    assert out.seconds <= DEADLINE_S + SLACK_S
    assert out.code == (row.expect or grpc.StatusCode.OK), f"{out.code}: {out.details}"
    if row.expect is None:
        assert out.tokens == want
    else:  # what streamed before is right, and the message says which worker failed
        assert out.tokens == want[: len(out.tokens)]
        assert any(w in out.details for w in lab.workers), f"no worker named: {out.details!r}"
    wait_registered(lab)
    wait_for(lambda: clean(lab), LEASE_TTL_S + INDEX_TTL_S + 10, "both workers clean, index true")
