"""Soak: load held above capacity, with cancellations, deadlines and bad requests.

    python -m benchmarks.soak                         # default model, 3 minutes
    python -m benchmarks.soak --minutes 10 --concurrency 24 --json soak.json
    python -m benchmarks.soak --model /path/to/ckpt --requests 400   # a count, not a time

Brings up a cluster (a private local Ray, the router in this process, prefill and
decode worker actors: `pagedserve.launch.Cluster`) and drives the public gRPC API
from `--concurrency` client threads, each sending one request after another for
`--minutes` (or until `--requests` have been sent). Each request is drawn, seeded:

- greedy:    temperature 0, ignore_eos; its tokens are checked against the same
             model run alone in this process (an `LLM`, float32), so a request
             that another request disturbed shows up as a wrong output;
- sampled:   temperature 0.8 with a seed, n = 1 or 2 (not checked, must finish);
- cancelled: cancelled by the client after a random number of streamed chunks;
- deadline:  a random deadline of 0.2 - 8 s (finishes or DEADLINE_EXCEEDED);
- bad:       a request the API must refuse (prompt past max_model_len, max_tokens
             0, temperature -1, n past the limit, top_p 0): INVALID_ARGUMENT.

Outcomes are counted as the user sees them. Clean: completed, cancelled (by us),
deadline exceeded (when we set one), RESOURCE_EXHAUSTED (admission: the load is
above capacity on purpose), INVALID_ARGUMENT for a bad request. Anything else —
another status, INVALID_ARGUMENT for a good request, a bad request accepted, a
greedy output that differs from the engine alone — is counted and printed.

After the load: every worker's KV pool must be free-or-cached (no block with a
reference), no lease open, `check_integrity()` true. Resident memory (VmRSS) of the
driver (router) and of every worker process is read after the warm-up and at the
end: flat means within 10 %. Float32 throughout (`--dtype`): exact greedy agreement
is a float32 property.

`run_soak` is also what tests/test_soak.py runs, for a bounded count of requests on
in-process workers, asserting counts (never times).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import grpc

from pagedserve.router.client import Client

KINDS = ("greedy", "sampled", "cancelled", "deadline", "bad")
DEFAULT_MIX = {"greedy": 4, "sampled": 2, "cancelled": 2, "deadline": 1, "bad": 1}
CLEAN = {
    "completed",
    "cancelled",
    "deadline_exceeded",
    "resource_exhausted",
    "invalid_argument_expected",
}


@dataclass(frozen=True)
class SoakRequest:
    kind: str
    prompt: tuple[int, ...]
    sampling: dict
    cancel_after: int | None = None  # chunks received before the client cancels
    deadline_s: float | None = None


@dataclass
class WorkerProbe:
    """What the soak needs to know of one worker, however it runs."""

    name: str
    pid: int
    kv_in_use: Callable[[], float]  # fraction of blocks with a reference
    open_leases: Callable[[], int]
    check_integrity: Callable[[], None]  # raises when broken


@dataclass
class SoakResult:
    sent: int = 0
    outcomes: Counter = field(default_factory=Counter)  # outcome -> count
    by_kind: dict = field(default_factory=dict)  # kind -> Counter of outcomes
    wrong_outputs: int = 0
    unclean: list[str] = field(default_factory=list)  # first few, for the report
    duration_s: float = 0.0
    output_tokens: int = 0
    leaked: dict = field(default_factory=dict)  # worker -> kv fraction still in use
    open_leases: dict = field(default_factory=dict)  # worker -> leases open
    integrity_errors: dict = field(default_factory=dict)
    rss_start_mib: dict = field(default_factory=dict)  # process -> MiB
    rss_end_mib: dict = field(default_factory=dict)

    @property
    def num_unclean(self) -> int:
        return sum(n for o, n in self.outcomes.items() if o not in CLEAN) + self.wrong_outputs

    def rss_growth(self) -> dict[str, float]:
        return {
            p: self.rss_end_mib[p] / self.rss_start_mib[p]
            for p in self.rss_start_mib
            if p in self.rss_end_mib and self.rss_start_mib[p] > 0
        }


def draw_request(
    rng: random.Random, vocab_size: int, max_model_len: int, mix: dict[str, int]
) -> SoakRequest:
    kind = rng.choices(list(mix), weights=list(mix.values()))[0]
    prompt = tuple(rng.randrange(3, vocab_size) for _ in range(rng.randint(4, 48)))
    max_tokens = rng.randint(4, 24)
    if kind == "greedy":
        return SoakRequest(
            kind, prompt, dict(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        )
    if kind == "sampled":
        sampling = dict(temperature=0.8, seed=rng.randrange(1 << 30), max_tokens=max_tokens)
        return SoakRequest(kind, prompt, {**sampling, "n": rng.choice((1, 2))})
    if kind == "cancelled":
        sampling = dict(temperature=0.0, max_tokens=max_tokens + 8, ignore_eos=True)
        return SoakRequest(kind, prompt, sampling, cancel_after=rng.randint(0, 6))
    if kind == "deadline":
        sampling = dict(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return SoakRequest(kind, prompt, sampling, deadline_s=rng.uniform(0.2, 8.0))
    bad = rng.choice(
        [
            ("prompt", dict(max_tokens=4)),
            ("max_tokens", dict(max_tokens=0)),
            ("temperature", dict(temperature=-1.0, max_tokens=4)),
            ("n", dict(n=10_000, max_tokens=4)),
            ("top_p", dict(top_p=0.0, max_tokens=4)),
        ]
    )
    if bad[0] == "prompt":
        prompt = tuple(rng.randrange(3, vocab_size) for _ in range(max_model_len + 1))
    return SoakRequest(kind, prompt, bad[1])


def _outcome(req: SoakRequest, code: grpc.StatusCode | None) -> str:
    if code is None:
        return "accepted_bad" if req.kind == "bad" else "completed"
    if code == grpc.StatusCode.CANCELLED and req.cancel_after is not None:
        return "cancelled"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and req.deadline_s is not None:
        return "deadline_exceeded"
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return "resource_exhausted"
    if code == grpc.StatusCode.INVALID_ARGUMENT and req.kind == "bad":
        return "invalid_argument_expected"
    return code.name.lower()


def send(client: Client, req: SoakRequest) -> tuple[str, list[int], str]:
    """Runs one request; (outcome, tokens of sample 0, error detail)."""
    tokens: list[int] = []
    call = client.generate(token_ids=req.prompt, timeout=req.deadline_s or 120.0, **req.sampling)
    chunks = 0
    try:
        for r in call:
            if r.index == 0:
                tokens += r.token_ids
            chunks += 1
            if req.cancel_after is not None and chunks > req.cancel_after:
                call.cancel()
        if req.cancel_after is not None and chunks > req.cancel_after:
            return "cancelled", tokens, ""
        return _outcome(req, None), tokens, ""
    except grpc.RpcError as e:
        return _outcome(req, e.code()), tokens, f"{e.code().name}: {e.details()}"


def run_soak(
    address: str,
    *,
    vocab_size: int,
    max_model_len: int,
    concurrency: int,
    duration_s: float | None = None,
    num_requests: int | None = None,
    seed: int = 0,
    mix: dict[str, int] | None = None,
    reference: Callable[[list[tuple[tuple[int, ...], dict]]], list[list[int]]] | None = None,
) -> SoakResult:
    """Sends requests from `concurrency` threads until `duration_s` has passed or
    `num_requests` were sent (at least one bound must be given)."""
    assert duration_s is not None or num_requests is not None
    mix = mix or DEFAULT_MIX
    result = SoakResult(by_kind={k: Counter() for k in mix})
    lock = threading.Lock()
    rng = random.Random(seed)
    t0 = time.monotonic()
    greedy_checks: list[tuple[SoakRequest, list[int]]] = []

    def next_request() -> SoakRequest | None:
        with lock:
            if num_requests is not None and result.sent >= num_requests:
                return None
            if duration_s is not None and time.monotonic() - t0 >= duration_s:
                return None
            result.sent += 1
            return draw_request(rng, vocab_size, max_model_len, mix)

    def client_thread() -> None:
        backoff = random.Random()  # jitter only: what is sent stays seeded
        with Client(address) as client:
            while (req := next_request()) is not None:
                outcome, tokens, detail = send(client, req)
                with lock:
                    result.outcomes[outcome] += 1
                    result.by_kind[req.kind][outcome] += 1
                    result.output_tokens += len(tokens)
                    if outcome not in CLEAN and len(result.unclean) < 10:
                        result.unclean.append(f"{req.kind}: {outcome} {detail}")
                    if req.kind == "greedy" and outcome == "completed":
                        greedy_checks.append((req, tokens))
                if outcome == "resource_exhausted":  # a polite client backs off, then goes on
                    time.sleep(backoff.uniform(0.25, 1.0))

    threads = [threading.Thread(target=client_thread, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result.duration_s = time.monotonic() - t0
    if reference is not None and greedy_checks:
        # One batched call: the engine's greedy output does not depend on its batch.
        expected = reference([(req.prompt, req.sampling) for req, _ in greedy_checks])
        for (req, tokens), want in zip(greedy_checks, expected, strict=True):
            if tokens != want:
                result.wrong_outputs += 1
                if len(result.unclean) < 10:
                    result.unclean.append(
                        f"greedy: wrong output for a {len(req.prompt)}-token prompt"
                    )
    return result


def inspect_workers(
    result: SoakResult, workers: Sequence[WorkerProbe], timeout_s: float = 30.0
) -> None:
    """Waits (bounded) for every pool to drain, then records what is still held."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if all(w.kv_in_use() == 0 and w.open_leases() == 0 for w in workers):
            break
        time.sleep(0.2)
    for w in workers:
        if (used := w.kv_in_use()) != 0:
            result.leaked[w.name] = used
        if (leases := w.open_leases()) != 0:
            result.open_leases[w.name] = leases
        try:
            w.check_integrity()
        except Exception as e:  # reported, not raised: the report shows every worker
            result.integrity_errors[w.name] = repr(e)


def rss_mib(pid: int) -> float:
    """Resident set size of a process on this machine, in MiB (Linux /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def read_rss(processes: dict[str, int]) -> dict[str, float]:
    return {name: round(rss_mib(pid), 1) for name, pid in processes.items()}


def report(result: SoakResult, mix: dict[str, int]) -> str:
    lines = [
        f"sent {result.sent} requests in {result.duration_s:.0f} s "
        f"({result.output_tokens} output tokens streamed)",
        "",
        "| kind | sent | " + " | ".join(sorted(result.outcomes)) + " |",
        "| --- | --- | " + " | ".join("---" for _ in result.outcomes) + " |",
    ]
    for kind in mix:
        c = result.by_kind[kind]
        cells = " | ".join(str(c.get(o, 0)) for o in sorted(result.outcomes))
        lines.append(f"| {kind} | {sum(c.values())} | {cells} |")
    lines += [
        "",
        f"clean outcomes: {sum(n for o, n in result.outcomes.items() if o in CLEAN)}; "
        f"unclean: {result.num_unclean} (wrong greedy outputs: {result.wrong_outputs})",
        f"blocks still held: {result.leaked or 'none'}; open leases: "
        f"{result.open_leases or 'none'}; integrity errors: {result.integrity_errors or 'none'}",
        "",
        "| process | RSS after warm-up (MiB) | RSS at end (MiB) | end / start |",
        "| --- | --- | --- | --- |",
    ]
    growth = result.rss_growth()
    for p in result.rss_start_mib:
        lines.append(
            f"| {p} | {result.rss_start_mib[p]} | {result.rss_end_mib.get(p, '-')} | "
            f"{growth.get(p, float('nan')):.3f} |"
        )
    for u in result.unclean:
        lines.append(f"unclean: {u}")
    return "\n".join(lines)


def machine() -> str:
    """CPU model, core count and the flags that matter for dtype and kernels."""
    from benchmarks.attention import cpu_name
    from pagedserve.common.core.config import cpuinfo_flags

    wanted = ("avx512f", "avx512_bf16", "amx_bf16", "avx2")
    flags = " ".join(f for f in wanted if f in cpuinfo_flags()) or "none of " + "/".join(wanted)
    return f"{cpu_name()}, {os.cpu_count()} cores, flags: {flags}"


def to_json(result: SoakResult) -> dict:
    """The result as plain JSON types (asdict would turn each Counter into a Counter of
    its (key, value) pairs)."""
    data = asdict(result)
    data["outcomes"] = dict(result.outcomes)
    data["by_kind"] = {kind: dict(c) for kind, c in result.by_kind.items()}
    data["num_unclean"] = result.num_unclean
    data["rss_growth"] = result.rss_growth()
    return data


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="local checkpoint dir (default: SmolLM2-135M)")
    p.add_argument("--minutes", type=float, default=3.0, help="how long to send (default 3)")
    p.add_argument("--requests", type=int, default=None, help="stop after this many instead")
    p.add_argument("--concurrency", type=int, default=16, help="client threads (default 16)")
    p.add_argument(
        "--max-inflight",
        type=int,
        default=8,
        help="router admission: requests running at once (default 8, below --concurrency, "
        "so that the load is above capacity and some requests are refused)",
    )
    p.add_argument("--max-queued", type=int, default=4, help="router admission queue (4)")
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--kv-cache-mib", type=int, default=256)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the result here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import ray

    from pagedserve.common.api.sampling_params import SamplingParams
    from pagedserve.common.core.config import CacheConfig, EngineConfig, SchedulerConfig
    from pagedserve.common.core.llm import LLM
    from pagedserve.common.core.loader import resolve_model_dir
    from pagedserve.launch import Cluster, ClusterSpec
    from pagedserve.v1 import worker_pb2

    model_dir = str(resolve_model_dir(args.model, progress=print))
    engine = EngineConfig(
        model=model_dir,
        dtype=args.dtype,
        cache=CacheConfig(kv_cache_bytes=args.kv_cache_mib << 20),
        scheduler=SchedulerConfig(max_model_len=args.max_model_len),
        num_threads=1,
    )
    alone = LLM(model_dir, dtype=args.dtype, num_blocks=64, max_model_len=args.max_model_len)

    def reference(requests: list[tuple[tuple[int, ...], dict]]) -> list[list[int]]:
        prompts = [list(p) for p, _ in requests]
        params = [SamplingParams(**sampling) for _, sampling in requests]
        return [o.completions[0].token_ids for o in alone.generate(prompts, params)]

    spec = ClusterSpec(
        model=model_dir,
        num_prefill=args.prefill,
        num_decode=args.decode,
        engine=engine,
        router_port=0,
        internal_port=0,
        num_cpus=os.cpu_count(),
        worker_timeout_s=30.0,
        log_level="WARNING",
        router_options={
            "max_model_len": args.max_model_len,
            "max_inflight": args.max_inflight,
            "max_queued": args.max_queued,
        },
    )
    with Cluster(spec) as cluster:
        cluster.start(progress=print)
        with Client(cluster.address, timeout=30) as c:
            info = c.model_info()
        actors = {f"prefill-{i}": a for i, a in enumerate(cluster.prefill)}
        actors |= {f"decode-{i}": a for i, a in enumerate(cluster.decode)}

        def probe(name: str, actor) -> WorkerProbe:
            def stats() -> worker_pb2.WorkerStats:
                return worker_pb2.WorkerStats.FromString(ray.get(actor.stats.remote()))

            return WorkerProbe(
                name,
                ray.get(actor.pid.remote()),
                kv_in_use=lambda: stats().kv_usage,
                open_leases=lambda: ray.get(actor.open_leases.remote()),
                check_integrity=lambda: ray.get(actor.check_integrity.remote()),
            )

        probes = [probe(n, a) for n, a in actors.items()]
        processes = {"router (driver)": os.getpid()} | {p.name: p.pid for p in probes}
        common = dict(
            vocab_size=info.vocab_size,
            max_model_len=args.max_model_len,
            concurrency=args.concurrency,
            reference=reference,
        )
        print("warming up ...")
        run_soak(cluster.address, num_requests=4 * args.concurrency, seed=args.seed + 1, **common)
        rss_start = read_rss(processes)
        print(f"soaking for {args.requests or f'{args.minutes} min'} ...")
        result = run_soak(
            cluster.address,
            duration_s=None if args.requests else args.minutes * 60,
            num_requests=args.requests,
            seed=args.seed,
            **common,
        )
        inspect_workers(result, probes)
        result.rss_start_mib, result.rss_end_mib = rss_start, read_rss(processes)
    print()
    print(f"machine: {machine()}")
    print(report(result, DEFAULT_MIX))
    if args.json:
        data = to_json(result) | {"args": vars(args), "machine": machine()}
        with open(args.json, "w") as f:
            json.dump(data, f, indent=2, default=str)
    flat = all(g <= 1.10 for g in result.rss_growth().values())
    print(f"resident memory flat after warm-up (within 10 %): {'yes' if flat else 'NO'}")
    clean = result.num_unclean == 0 and not (
        result.leaked or result.open_leases or result.integrity_errors
    )
    return 0 if clean else 1


if __name__ == "__main__":
    raise SystemExit(main())
