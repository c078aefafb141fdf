"""Prefix-aware routing on a shared-prefix workload: hit rate, TTFT, tokens computed.

    python -m benchmarks.prefix_routing [--model default] [--json PATH] [--redis-url URL]
    python -m benchmarks.prefix_routing --system-tokens 256 --questions 6   # quick shape

The workload (seeded; token ids drawn at random from the vocabulary, no text):

- `--system-prompts` system prompts of `--system-tokens` tokens, each followed by
  `--questions` questions of 24-40 tokens: requests sharing a prefix;
- `--chats` conversations of `--turns` turns: a 48-token first message, then each turn
  sends the whole conversation so far (previous prompt + the answer) + 16 new tokens.

Jobs (a question, or a whole conversation) are shuffled and run by `--concurrency`
closed-loop clients through the router's public gRPC API, `--max-tokens` greedy
tokens each. The defaults are issue 6's shape, for which its targets are stated: 8
system prompts of 512 tokens x 32 questions + 4 chats x 3 turns (268 requests per
policy; ~17 minutes for the four policies on a 2-core CPU with the default model).
The quick shape, 8 x 256 tokens x 6 questions (60 requests, ~6 minutes), reuses each
prefix only ~6 times: there no routing can reach 3x round-robin's TTFT, since even
the oracle computes a third of round-robin's prompt tokens (2.7-3.0x fewer) and every
step has a fixed cost besides (benchmarks/NOTES.md, "prefix_routing at issue 6's
shape").

The cluster: a router in this process (its index on Redis: a private redis-server is
started unless `--redis-url` is given) and `--workers` colocated workers, each its
own process (1 torch thread, `--blocks-per-worker` KV blocks, by default four system
prompts' worth: a worker cannot hold all eight, the cluster can, so routing decides
the hit rate). The same
workers serve every policy in turn, their caches emptied in between:

- round-robin:   each request to the next worker;
- least-loaded:  the router's load-only policy;
- prefix-aware:  the default policy (index match vs load, cross-worker pulls);
- oracle:        one worker with an unbounded cache (`--oracle-blocks`), all requests:
                 the best hit rate any routing could reach (its TTFT is one worker's).

Per policy: prefix-cache hit rate in tokens (1 - prompt tokens computed / prompt
tokens, over the whole cluster: a pulled prefix counts as not computed), prompt
tokens computed (the engines' counters), tokens pulled from other workers, TTFT
(client side: request sent -> first streamed message) mean and p99, and the router's
added latency (arrival -> routing decision: validation, hashing, the index lookup
and ranking) p50 and p99 under that load. An idle measurement of the routing
decision alone against the populated Redis index follows (`route idle`). Targets
(issue 6): hit rate within 10% of the oracle, mean TTFT >= 3x better than
round-robin, router p50 <= 2 ms.

Where TTFT goes (issue 13), per policy, mean ms per request (`phase_split`): route
(router), export (ExportPrefix calls), worker (Decode call -> first step), and within
it the worker's prefix pull, the engine queue and the first step (the engines' own
per-request phases), plus cold vs warm requests and the warm ones whose first step
also computed someone's cold prefill. Measuring wraps a few of the router's and the
workers' methods inside this benchmark's own processes (`install_probe`,
`_recorded_phases`, `_timed_prefix_imports`); nothing is changed elsewhere.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import random
import shutil
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

BLOCK_SIZE = 16


# ---- the workload -------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    systems: list[list[int]]
    questions: list[tuple[int, list[int]]]  # (system prompt index, question ids)
    chats: list[list[list[int]]]  # per chat: the new tokens of each turn

    def jobs(self, seed: int) -> list[tuple[str, int]]:
        jobs = [("question", i) for i in range(len(self.questions))]
        jobs += [("chat", i) for i in range(len(self.chats))]
        random.Random(seed).shuffle(jobs)
        return jobs


def build_workload(args: argparse.Namespace, vocab: int) -> Workload:
    rng = random.Random(args.seed)
    low = 1000 if vocab > 2000 else 3  # skip the special and byte tokens of real vocabularies

    def ids(n: int) -> list[int]:
        return [rng.randrange(low, vocab - 1) for _ in range(n)]

    systems = [ids(args.system_tokens) for _ in range(args.system_prompts)]
    questions = [
        (s, ids(rng.randint(24, 40)))
        for s in range(args.system_prompts)
        for _ in range(args.questions)
    ]
    chats = [[ids(48)] + [ids(16) for _ in range(args.turns - 1)] for _ in range(args.chats)]
    return Workload(systems, questions, chats)


# ---- worker processes ---------------------------------------------------------------------


def _timed_prefix_imports() -> list[float]:
    """Times every prefix pull of this worker process (`import_prefix`: the Decode
    handler's pull of a prefix from its holder, before the request enters the engine)."""
    import pagedserve.decode_worker.servicer as servicer

    times: list[float] = []
    pull = servicer.import_prefix

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return pull(*args, **kwargs)
        finally:
            times.append(time.perf_counter() - t0)

    servicer.import_prefix = timed
    return times


def _recorded_phases(log) -> list[tuple[str, float, float | None, int]]:
    """Records, per request ending on this engine, (request id, queue s, prefill s, tokens
    of its first step: its own and those of the requests computed with it), by wrapping
    the engine's RequestStatsLog hooks (the engine thread calls them)."""
    records: list[tuple[str, float, float | None, int]] = []
    step_tokens: dict[str, int] = {}
    scheduled, done = log.scheduled, log.done

    def on_scheduled(sched) -> None:
        for item in (*sched.prefills, *sched.decodes):
            step_tokens.setdefault(item.seq.request.request_id, sched.num_batched_tokens)
        scheduled(sched)

    def on_done(req) -> None:
        t = log._times.get(req.request_id)
        done(req)
        tokens = step_tokens.pop(req.request_id, 0)
        if t is not None and t.scheduled is not None:
            first = None if t.first_token is None else t.first_token - t.scheduled
            records.append((req.request_id, t.scheduled - req.arrival_time, first, tokens))

    log.scheduled, log.done = on_scheduled, on_done
    return records


def _worker_main(conn, config) -> None:
    """A worker in its own process, driven by commands on `conn`."""
    import torch

    from pagedserve.worker import start_worker

    torch.set_num_threads(1)
    pulls = _timed_prefix_imports()
    rt = start_worker(config)
    phases = _recorded_phases(rt.engine.request_stats)
    conn.send(rt.address)
    while True:
        cmd = conn.recv()
        if cmd == "stats":
            s = rt.loop.call(lambda e: e.stats())
            conn.send({"prefill_tokens": s.prefill_tokens, "preemptions": s.num_preemptions})
        elif cmd == "phases":  # the engine's per-request phases and the pulls, since last asked
            done = rt.loop.call(lambda e: phases[:])
            conn.send((done, pulls[:]))
            rt.loop.call(lambda e: phases.clear())
            pulls.clear()
        elif cmd == "evict":
            conn.send(rt.loop.call(lambda e: e.block_manager.evict()))
        elif cmd == "stop":
            rt.stop(grace=0.5)
            conn.send(True)
            return


class WorkerProcess:
    def __init__(self, config) -> None:
        ctx = mp.get_context("spawn")
        self.config = config
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, config), daemon=True)
        self.proc.start()
        self.address: str | None = None

    def ready(self, timeout: float = 300.0) -> str:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"worker {self.config.worker_id} did not start in {timeout} s")
        self.address = self.conn.recv()
        return self.address

    def ask(self, cmd: str):
        self.conn.send(cmd)
        return self.conn.recv()

    def stop(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(EOFError, BrokenPipeError, OSError):
                self.ask("stop")
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()


def total_computed(workers: list[WorkerProcess]) -> int:
    return sum(w.ask("stats")["prefill_tokens"] for w in workers)


# ---- redis ----------------------------------------------------------------------------------


@contextlib.contextmanager
def private_redis() -> Iterator[str]:
    """A redis-server on a free loopback port, nothing persisted; stopped at exit."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server not found: install it or pass --redis-url")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = Path(tempfile.mkdtemp(prefix="bench-redis-"))
    subprocess.run(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
         "no", "--daemonize", "yes", "--dir", str(workdir),
         "--pidfile", str(workdir / "redis.pid"), "--logfile", str(workdir / "redis.log")],
        check=True,
    )  # fmt: skip
    import redis

    from pagedserve.common.runtime.prefix_index.connection import client_name, connect_redis

    url = f"redis://127.0.0.1:{port}/0"
    client = connect_redis(url, name=client_name("bench"))  # the one Redis set-up
    for _ in range(200):
        with contextlib.suppress(redis.ConnectionError):
            if client.ping():
                break
        time.sleep(0.02)
    try:
        yield url
    finally:
        with contextlib.suppress(redis.ConnectionError):
            client.shutdown(nosave=True)
        shutil.rmtree(workdir, ignore_errors=True)


# ---- running a phase ----------------------------------------------------------------------


@dataclass
class Row:
    policy: str
    workers: int
    requests: int = 0
    prompt_tokens: int = 0
    computed_tokens: int = 0
    pulled_tokens: int = 0
    hit_rate: float = 0.0
    ttft_mean_ms: float = 0.0
    ttft_p50_ms: float = 0.0
    ttft_p99_ms: float = 0.0
    route_p50_ms: float = 0.0
    route_p99_ms: float = 0.0
    index_lookups: int = 0
    preemptions: int = 0
    wall_s: float = 0.0
    ttfts_ms: list[float] = field(default_factory=list, repr=False)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def run_jobs(address: str, workload: Workload, args) -> tuple[list[tuple[int, float]], float]:
    """Runs every job with `concurrency` closed-loop clients; [(prompt tokens, ttft s)]."""
    from pagedserve.router.client import Client

    jobs = workload.jobs(args.seed)
    lock = threading.Lock()
    records: list[tuple[int, float]] = []
    local = threading.local()

    def request(ids: list[int]) -> list[int]:
        if not hasattr(local, "client"):
            local.client = Client(address, timeout=600)
        t0 = time.perf_counter()
        first, out = None, []
        for resp in local.client.generate(
            token_ids=ids, max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True
        ):
            if first is None:
                first = time.perf_counter() - t0
            out += resp.token_ids
        with lock:
            records.append((len(ids), first or 0.0))
        return out

    def run(job: tuple[str, int]) -> None:
        kind, i = job
        if kind == "question":
            s, q = workload.questions[i]
            request(workload.systems[s] + q)
            return
        conversation: list[int] = []
        for new in workload.chats[i]:
            conversation += new
            conversation += request(conversation)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        list(pool.map(run, jobs))
    return records, time.perf_counter() - t0


def _clients_main(conn, address: str, workload: Workload, args) -> None:
    conn.send(run_jobs(address, workload, args))


def run_clients(address: str, workload: Workload, args) -> tuple[list[tuple[int, float]], float]:
    """`run_jobs` in a process of its own: the clients' Python threads do not compete
    with the router's event loop for this process's GIL (which would add up to a
    switch interval, 5 ms, to every routing decision that waits on Redis)."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_clients_main, args=(child, address, workload, args), daemon=True)
    proc.start()
    try:
        return conn.recv()
    finally:
        proc.join(10)


# ---- where TTFT goes ------------------------------------------------------------------------


@dataclass
class Probe:
    """Per-request timings on the router (installed by `install_probe`, on its loop).

    decisions: request id -> (worker, prompt tokens the policy expects it to compute,
    blocks it plans to pull, the worker's load then); exports: request id -> ExportPrefix
    seconds; worker: request id -> seconds from the Decode call to its first step (the
    worker's pull + queue + prefill + the step's way back).
    """

    decisions: dict[str, tuple[str, int, int, float]] = field(default_factory=dict)
    exports: dict[str, float] = field(default_factory=dict)
    worker: dict[str, float] = field(default_factory=dict)

    def take(self) -> Probe:
        out = Probe(dict(self.decisions), dict(self.exports), dict(self.worker))
        for records in (self.decisions, self.exports, self.worker):
            records.clear()
        return out


def install_probe(r) -> Probe:
    """Wraps the router's `routing.pick`, `dispatcher._export_prefix` and the Decode
    stream relay (instance attributes: nothing outside this process changes)."""
    probe = Probe()
    pick, export, relay = r.routing.pick, r.dispatcher._export_prefix, r.decode_streams.relay

    def timed_pick(role, rr, exclude):
        scored = pick(role, rr, exclude)
        if scored is not None and role == "decode":
            compute = scored.compute_tokens
            probe.decisions[rr.request_id] = (
                scored.worker.worker_id,
                len(rr.prompt_token_ids) if compute is None else compute,
                scored.pull.blocks if scored.pull else 0,
                float(scored.inputs.get("load", scored.worker.inflight)),
            )
        return scored

    async def timed_export(ctx, scored):
        t0 = time.perf_counter()
        try:
            return await export(ctx, scored)
        finally:
            probe.exports[ctx.request.request_id] = time.perf_counter() - t0

    async def timed_relay(worker, req, timeout):
        t0 = time.perf_counter()
        async with contextlib.aclosing(relay(worker, req, timeout)) as steps:
            async for step in steps:
                probe.worker.setdefault(req.request.request_id, time.perf_counter() - t0)
                yield step

    r.routing.pick = timed_pick
    r.dispatcher._export_prefix = timed_export
    r.decode_streams.relay = timed_relay
    return probe


def set_policy(router, policy) -> None:
    """The policy the router routes with (Routing holds its own reference)."""

    def swap(r) -> None:
        r.policy = r.routing.policy = policy

    router.call(swap)


COLD_TOKENS = 128  # a request computing at least this many prompt tokens is "cold"


def phase_split(probe: Probe, worker_phases, ttfts_ms: list[float], routes: list[float]) -> dict:
    """Mean ms per request of each part of TTFT, and the requests per worker.

    route: arrival -> decision (router); export: the ExportPrefix call (router, over all
    requests, 0 where none); worker: the Decode call -> its first step back; within
    it (the engines' and pulls' own clocks): pull (the worker's import of a prefix),
    queue (arrival in the engine -> first step computing it), prefill (that step ->
    first token); other: TTFT - route - export - worker (the client, gRPC, tokenizing,
    admission). Then the same TTFT over cold (>= COLD_TOKENS to compute) and warm
    requests, and each worker's share of the requests and of the computed tokens.
    """
    n = max(1, len(ttfts_ms))
    records = {rid: (q, p, tokens) for rid, q, p, tokens in worker_phases[0]}
    queue = [q for q, _, _ in records.values()]
    prefill = [p for _, p, _ in records.values() if p is not None]
    pulls = worker_phases[1]

    def mean_ms(values, count=None) -> float:
        values = list(values)
        return round(1000 * sum(values) / max(1, count or len(values)), 1)

    split = {
        "ttft": round(statistics.fmean(ttfts_ms), 1) if ttfts_ms else 0.0,
        "route": mean_ms(routes),
        "export": mean_ms(probe.exports.values(), n),
        "worker": mean_ms(probe.worker.values()),
        "pull": mean_ms(pulls, n),
        "queue": mean_ms(queue),
        "prefill": mean_ms(prefill),
    }
    split["other"] = round(split["ttft"] - split["route"] - split["export"] - split["worker"], 1)
    cold = [rid for rid, d in probe.decisions.items() if d[1] >= COLD_TOKENS]
    warm = [rid for rid in probe.decisions if rid not in cold]
    split["cold_requests"] = len(cold)
    split["worker_cold"] = mean_ms(probe.worker[r] for r in cold if r in probe.worker)
    split["worker_warm"] = mean_ms(probe.worker[r] for r in warm if r in probe.worker)
    # Warm requests whose first step also computed someone's cold prefill (>= COLD_TOKENS
    # more than their own), against those whose step did not.
    shared = [
        r for r in warm if r in records and records[r][2] - probe.decisions[r][1] >= COLD_TOKENS
    ]
    alone = [r for r in warm if r in records and r not in shared]
    split["warm_behind_cold"] = len(shared)
    split["prefill_warm_behind_cold"] = mean_ms(records[r][1] or 0.0 for r in shared)
    split["prefill_warm_alone"] = mean_ms(records[r][1] or 0.0 for r in alone)
    per_worker: dict[str, list[int]] = {}
    for wid, compute, _, _ in probe.decisions.values():
        counts = per_worker.setdefault(wid, [0, 0])
        counts[0] += 1
        counts[1] += compute
    split["per_worker"] = {w: per_worker[w] for w in sorted(per_worker)}
    split["pulls"] = sum(1 for d in probe.decisions.values() if d[2])
    return split


def worker_phases(workers: list[WorkerProcess]) -> tuple[list, list[float]]:
    """Every worker's engine phases [(queue s, prefill s)] and pull times since last asked."""
    phases: list = []
    pulls: list[float] = []
    for w in workers:
        p, t = w.ask("phases")
        phases += p
        pulls += t
    return phases, pulls


def run_phase(
    name: str, router, workers: list[WorkerProcess], workload, args, probe: Probe
) -> tuple[Row, dict]:
    """One policy's run: its row and where its TTFT went (`phase_split`)."""
    computed0 = total_computed(workers)
    pre0 = sum(w.ask("stats")["preemptions"] for w in workers)
    c0 = router.call(lambda r: dict(r.counters))
    router.call(lambda r: r.route_latencies.clear())
    worker_phases(workers)
    router.call(lambda r: probe.take())
    records, wall = run_clients(router.address, workload, args)
    c1 = router.call(lambda r: dict(r.counters))
    routes = router.call(lambda r: list(r.route_latencies))
    phases = worker_phases(workers)
    taken = router.call(lambda r: probe.take())
    row = Row(name, len(workers), requests=len(records), wall_s=round(wall, 2))
    row.prompt_tokens = sum(n for n, _ in records)
    row.computed_tokens = total_computed(workers) - computed0
    row.preemptions = sum(w.ask("stats")["preemptions"] for w in workers) - pre0
    blocks = c1.get("prefix_export_blocks", 0) - c0.get("prefix_export_blocks", 0)
    row.pulled_tokens = blocks * BLOCK_SIZE
    row.index_lookups = c1.get("index_lookups", 0) - c0.get("index_lookups", 0)
    row.hit_rate = round(1 - row.computed_tokens / row.prompt_tokens, 4)
    row.ttfts_ms = [t * 1000 for _, t in records]
    row.ttft_mean_ms = round(statistics.fmean(row.ttfts_ms), 1)
    row.ttft_p50_ms = round(percentile(row.ttfts_ms, 50), 1)
    row.ttft_p99_ms = round(percentile(row.ttfts_ms, 99), 1)
    row.route_p50_ms = round(percentile(routes, 50) * 1000, 3)
    row.route_p99_ms = round(percentile(routes, 99) * 1000, 3)
    print(f"  {name}: {row.requests} requests in {row.wall_s} s", flush=True)
    return row, phase_split(taken, phases, row.ttfts_ms, routes)


def reset_caches(router, workers: list[WorkerProcess]) -> None:
    """Empty every worker's prefix cache and wait until the index shows it."""
    for w in workers:
        w.ask("evict")
    index = router.call(lambda r: r.prefix.index())
    deadline = time.monotonic() + 20
    while index is not None and time.monotonic() < deadline:
        if not any(index.worker_hashes(w.config.worker_id) for w in workers):
            break
        time.sleep(0.05)
    # Let the router's load view settle (heartbeats after the last requests).
    time.sleep(2 * workers[0].config.heartbeat_interval_s + 0.2)


def idle_route_latency(router, workload: Workload, repeats: int = 3) -> tuple[float, float]:
    """The routing decision alone (hashes + index match + ranking), on the router's loop,
    for every prompt of the workload against the populated index; (p50, p99) in ms."""
    from pagedserve.router.frontend import ResolvedRequest

    prompts = [workload.systems[s] + q for s, q in workload.questions]

    def measure(r) -> list[float]:
        out = []
        for _ in range(repeats):
            for ids in prompts:
                t0 = time.perf_counter()
                rr = r.route_request(ResolvedRequest("bench", ids, None, None))
                r.pick("decode", rr, set())
                out.append(time.perf_counter() - t0)
        return out

    times = router.call(measure, timeout=120)
    return percentile(times, 50) * 1000, percentile(times, 99) * 1000


# ---- main -----------------------------------------------------------------------------------


def engine_config(args, model_dir: str, num_blocks: int):
    from pagedserve.common.core.config import CacheConfig, EngineConfig, SchedulerConfig

    return EngineConfig(
        model=model_dir,
        dtype=args.dtype,
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_model_len=args.max_model_len),
        num_threads=1,
    )


def start_workers(router, args, model_dir, count, num_blocks, redis_url, prefix) -> list:
    from pagedserve.common.runtime.worker import WorkerConfig

    workers = [
        WorkerProcess(
            WorkerConfig(
                worker_id=f"{prefix}{i}",
                pool="colocated",
                engine=engine_config(args, model_dir, num_blocks),
                registry_address=router.internal_address,
                heartbeat_interval_s=0.25,
                redis_url=redis_url,
                index_ttl_s=10.0,
            )
        )
        for i in range(count)
    ]
    for w in workers:
        w.ready()
    want = {w.config.worker_id for w in workers}
    while not want <= set(router.live_worker_ids()):
        time.sleep(0.05)
    return workers


def router_config(args, model_dir: str, redis_url: str | None):
    from pagedserve.router.config import PrefixRouting, RouterConfig

    return RouterConfig(
        port=0,
        model=model_dir,
        max_model_len=args.max_model_len,
        max_inflight=1024,
        max_queued=1024,
        worker_timeout_s=30.0,
        # Colocated workers only: every prompt is prefilled where it is decoded.
        disagg_min_prompt_tokens=1 << 20,
        redis_url=redis_url,
        prefix=PrefixRouting(prefill_tokens_per_s=args.prefill_tokens_per_s),
    )


def warm_up(router, args) -> None:
    """One request per worker (first forwards are slow), outside any measurement."""
    from pagedserve.router.client import Client
    from pagedserve.router.policy import RoundRobinPolicy

    policy = router.call(lambda r: r.routing.policy)
    set_policy(router, RoundRobinPolicy())
    with Client(router.address, timeout=600) as c:
        for i in range(len(router.live_worker_ids())):
            c.collect(token_ids=[3 + i] * 40, max_tokens=2, temperature=0.0)
    set_policy(router, policy)


def run(args: argparse.Namespace, redis_url: str) -> dict:
    from pagedserve.common.core.loader import resolve_model_dir
    from pagedserve.router.policy import LeastLoadedPolicy, RoundRobinPolicy
    from pagedserve.router.server import start_router_in_thread

    model_dir = str(resolve_model_dir(args.model, progress=print))
    rows: list[Row] = []
    splits: dict[str, dict] = {}  # policy -> phase_split

    print("oracle: one worker, unbounded cache ...", flush=True)
    config = router_config(args, model_dir, None)
    oracle_router = start_router_in_thread(
        replace(config, prefix=replace(config.prefix, enabled=False))  # least-loaded
    )
    vocab = oracle_router.router.frontend.vocab_size
    workload = build_workload(args, vocab)
    try:
        oracle = start_workers(oracle_router, args, model_dir, 1, args.oracle_blocks, None, "o")
        try:
            probe = oracle_router.call(install_probe)
            warm_up(oracle_router, args)
            reset_caches(oracle_router, oracle)
            name = "oracle (1 worker, unbounded cache)"
            row, splits[name] = run_phase(name, oracle_router, oracle, workload, args, probe)
            rows.append(row)
        finally:
            for w in oracle:
                w.stop()
    finally:
        oracle_router.stop()

    print(f"{args.workers} workers, index on {redact(redis_url)} ...", flush=True)
    router = start_router_in_thread(router_config(args, model_dir, redis_url))
    idle = (0.0, 0.0)
    try:
        workers = start_workers(
            router, args, model_dir, args.workers, args.blocks_per_worker, redis_url, "w"
        )
        try:
            probe = router.call(install_probe)
            warm_up(router, args)
            prefix_policy = router.call(lambda r: r.routing.policy)
            for name, policy in (
                ("round-robin", RoundRobinPolicy()),
                ("least-loaded", LeastLoadedPolicy()),
                ("prefix-aware", prefix_policy),
            ):
                reset_caches(router, workers)
                set_policy(router, policy)
                row, splits[name] = run_phase(name, router, workers, workload, args, probe)
                rows.append(row)
            idle = idle_route_latency(router, workload)
        finally:
            for w in workers:
                w.stop()
    finally:
        router.stop()
    return summarize(rows, splits, idle, args, model_dir)


def redact(url: str) -> str:
    from pagedserve.common.runtime.prefix_index.redis import redact_url

    return redact_url(url)


def summarize(
    rows: list[Row], splits: dict[str, dict], idle: tuple[float, float], args, model_dir: str
) -> dict:
    by = {r.policy.split(" ")[0]: r for r in rows}
    pa, rr, oracle = by["prefix-aware"], by["round-robin"], by["oracle"]
    ratios = {
        "hit_rate_prefix_aware_over_oracle": round(pa.hit_rate / oracle.hit_rate, 3),
        "ttft_mean_round_robin_over_prefix_aware": round(rr.ttft_mean_ms / pa.ttft_mean_ms, 2),
        "ttft_mean_least_loaded_over_prefix_aware": round(
            by["least-loaded"].ttft_mean_ms / pa.ttft_mean_ms, 2
        ),
        "computed_round_robin_over_prefix_aware": round(
            rr.computed_tokens / max(1, pa.computed_tokens), 2
        ),
    }
    return {
        "config": {k: v for k, v in vars(args).items() if k != "json"} | {"model_dir": model_dir},
        "rows": [{k: v for k, v in asdict(r).items() if k != "ttfts_ms"} for r in rows],
        "splits": splits,
        "route_idle_p50_ms": round(idle[0], 3),
        "route_idle_p99_ms": round(idle[1], 3),
        "ratios": ratios,
    }


def print_table(result: dict) -> None:
    cols = [
        ("policy", "policy", "<34"),
        ("requests", "reqs", ">5"),
        ("prompt_tokens", "prompt tok", ">10"),
        ("computed_tokens", "computed", ">9"),
        ("hit_rate", "hit rate", ">8"),
        ("pulled_tokens", "pulled", ">7"),
        ("ttft_mean_ms", "TTFT mean ms", ">12"),
        ("ttft_p99_ms", "TTFT p99 ms", ">11"),
        ("route_p50_ms", "route p50 ms", ">12"),
        ("route_p99_ms", "route p99 ms", ">12"),
        ("preemptions", "preempt", ">7"),
        ("wall_s", "wall s", ">7"),
    ]
    print()
    print("  ".join(f"{title:{fmt}}" for _, title, fmt in cols))
    for row in result["rows"]:
        cells = []
        for key, _, fmt in cols:
            value = row[key]
            if key == "hit_rate":
                value = f"{value:.1%}"
            cells.append(f"{value:{fmt}}")
        print("  ".join(cells))
    print_split(result["splits"])
    r = result["ratios"]
    print()
    print(
        f"hit rate prefix-aware / oracle: {r['hit_rate_prefix_aware_over_oracle']:.3f}"
        "  (target >= 0.9)"
    )
    print(
        f"TTFT mean round-robin / prefix-aware: {r['ttft_mean_round_robin_over_prefix_aware']:.2f}x"
        f"  (target >= 3x); least-loaded / prefix-aware: "
        f"{r['ttft_mean_least_loaded_over_prefix_aware']:.2f}x"
    )
    print(
        f"prompt tokens computed, round-robin / prefix-aware: "
        f"{r['computed_round_robin_over_prefix_aware']:.2f}x"
    )
    print(
        f"router decision with the Redis index, idle: p50 {result['route_idle_p50_ms']:.3f} ms, "
        f"p99 {result['route_idle_p99_ms']:.3f} ms  (target p50 <= 2 ms)"
    )


def print_split(splits: dict[str, dict]) -> None:
    """Where TTFT went, mean ms per request (see `phase_split`)."""
    keys = ["ttft", "route", "export", "worker", "pull", "queue", "prefill", "other"]
    print()
    print("TTFT split, mean ms per request (worker = pull + queue + prefill + the way back;")
    print("cold = the policy expected >= 128 prompt tokens to compute)")
    head = ["policy".ljust(34)] + [k.rjust(7) for k in keys]
    head += ["cold n".rjust(6), "wkr cold".rjust(8), "wkr warm".rjust(8), "pulls".rjust(5)]
    print("  ".join(head))
    for name, sp in splits.items():
        cells = [name[:34].ljust(34)] + [f"{sp[k]:>7.1f}" for k in keys]
        cells += [f"{sp['cold_requests']:>6}", f"{sp['worker_cold']:>8.1f}"]
        cells += [f"{sp['worker_warm']:>8.1f}", f"{sp['pulls']:>5}"]
        print("  ".join(cells))
    print("warm requests whose first step also computed a cold prefill: n, their prefill ms;")
    print("the other warm requests' prefill ms:")
    for name, sp in splits.items():
        print(
            f"  {name}: {sp['warm_behind_cold']}, {sp['prefill_warm_behind_cold']:.1f};"
            f" {sp['prefill_warm_alone']:.1f}"
        )
    print("requests / prompt tokens to compute, per worker:")
    for name, sp in splits.items():
        shares = ", ".join(f"{w} {n}/{t}" for w, (n, t) in sp["per_worker"].items())
        print(f"  {name}: {shares}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: the default model)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--system-prompts", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--questions", type=int, default=32, help="per system prompt")
    p.add_argument("--chats", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument(
        "--blocks-per-worker",
        type=int,
        default=None,
        help="KV blocks per worker (default: four system prompts' worth)",
    )
    p.add_argument("--oracle-blocks", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=430.0,
        help="the router's estimate of a worker's prefill speed (measured here: the "
        "default model in fp32 on one thread, 512-token prompts)",
    )
    p.add_argument("--redis-url", default=None, help="default: start a private redis-server")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.blocks_per_worker is None:
        args.blocks_per_worker = 4 * -(-args.system_tokens // BLOCK_SIZE)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.redis_url:
        result = run(args, args.redis_url)
    else:
        with private_redis() as url:
            result = run(args, url)
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
