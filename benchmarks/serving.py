"""Serving benchmark: colocated vs disaggregated workers under load, through the public API.

    python -m benchmarks.serving                          # default model, both configs
    python -m benchmarks.serving --model /path/to/ckpt    # any local checkpoint (quick check)
    python -m benchmarks.serving --concurrency 4          # fixed concurrency instead of a rate
    python -m benchmarks.serving --json serving.json
    python -m benchmarks.serving --api openai             # through the OpenAI HTTP API

A load generator on the router's public gRPC API (`pagedserve.v1.Generation/Generate`,
server-streaming). Every request is a prompt of seeded random token ids with
`ignore_eos` and `temperature=0`, so each produces exactly `max_tokens` tokens.

Two configurations with the same number of workers, each brought up with `Cluster`
(a private local Ray, the router in this process, worker actors, one torch thread each):

- colocated:     P + D workers in the decode pool, no prefill pool: every worker
                 prefills its own requests and decodes them (the router prefills
                 locally when no prefill worker is live; `disagg_min_prompt_tokens`
                 is set beyond any prompt as well).
- disaggregated: P prefill + D decode workers (default 1 + 1); every prompt is
                 prefilled on the prefill pool and its KV shipped to the decode worker
                 (`--disagg-min-prompt-tokens`, default 0: no local prefill).

Each configuration runs the same seeded phases, one after another:

- sharegpt:     ShareGPT-like lengths (heavy-tailed lognormals with the vLLM paper's
                means, 161 input / 338 output tokens, clipped to [4, 1024]) scaled by
                `--length-scale` (default 0.1: this CPU decodes ~5-10 tokens/s per
                sequence), Poisson arrivals at `--request-rate`.
- decode:       the decode-heavy stream alone: short prompts, long outputs, Poisson
                arrivals at `--short-rate` (the no-interference baseline).
- interference: the very same stream plus a long prompt every `--long-every-s`
                seconds (`--long-prompt-len` tokens, a few output tokens).

The metrics are `vllm bench serve`'s (vllm/benchmarks/serve.py, calculate_metrics):

- TTFT: request sent -> first streamed chunk with tokens.
- E2E latency: request sent -> the last chunk with tokens.
- TPOT per request: (E2E - TTFT) / (output tokens - 1), for requests with > 1 token.
- ITL: every gap between consecutive chunks with tokens, pooled over all requests.
- request / output / total token throughput: completed requests, output tokens,
  input + output tokens over the phase's duration (first send -> last completion).
- goodput: completed requests meeting every SLO given (TTFT, TPOT, E2E; a request
  with a single output token counts TPOT 0) per second.
Statistics are mean, p50 and p99 (numpy's linear-interpolation percentiles).

The expected win of disaggregation on a CPU is ITL isolation: a long prompt prefilled
on a colocated worker stalls every decode step of that worker for the whole prefill,
while a decode worker never prefills. The benchmark prints, per configuration, the
decode stream's p99 ITL with interference over without (target: disaggregated within
1.5x), and disaggregated / colocated ratios of the main figures.

The load generator runs in the driver, next to the router (Cluster puts it there):
one thread per request on the synchronous client, timestamps taken on receipt. The
router's worker timeout is raised to `--worker-timeout-s` (30 s): a worker's heartbeat
waits for its running engine step, and a long prefill on a loaded CPU outlasts the
3 s default (seen here: a busy prefill worker dropped from routing).

Bounded: a fixed number of requests per phase, and `--phase-timeout-s` after which
a phase stops sending and cancels what is still running (counted as failed).
Under `--concurrency N` the ShareGPT and decode-stream requests are sent as soon as
fewer than N of them are in flight (vLLM's max_concurrency with an infinite rate,
or with `--request-rate` both apply); the long prompts of the interference phase keep
their own clock and are not counted against N.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields

import grpc
import numpy as np

from benchmarks.openai_client import open_client  # issue 12: --api openai
from pagedserve.router.client import Client
from pagedserve.v1 import generation_pb2 as gen_pb

# ShareGPT as the vLLM paper reports it (mean input / output tokens).
SHAREGPT_MEAN_INPUT = 161
SHAREGPT_MEAN_OUTPUT = 338
# Lognormal shapes: heavy right tails like ShareGPT's (a few very long prompts and
# answers); the location is chosen so the untruncated mean is the paper's.
SHAREGPT_SIGMA_INPUT = 1.0
SHAREGPT_SIGMA_OUTPUT = 0.9
SHAREGPT_CLIP = (4, 1024)  # before scaling; vLLM's ShareGPT sampler also drops < 4
ISOLATION_TARGET = 1.5  # decode p99 ITL with / without interference, disaggregated
MS = 1000.0


# -- workload ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestSpec:
    kind: str  # "sharegpt" | "short" (the decode stream) | "long" (interference)
    prompt_token_ids: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class Arrival:
    at_s: float  # seconds after the phase starts
    spec: RequestSpec
    gated: bool = True  # counted against --concurrency (the long prompts are not)


@dataclass(frozen=True)
class Phase:
    name: str
    arrivals: tuple[Arrival, ...]


def poisson_arrivals(n: int, rate: float | None, rng: random.Random) -> list[float]:
    """Send times of `n` requests: exponential gaps at `rate` req/s; all at 0 when
    `rate` is None (an infinite rate: everything at once, gated by concurrency)."""
    if rate is None:
        return [0.0] * n
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 req/s, got {rate}")
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def random_prompt(n: int, vocab_size: int, rng: random.Random) -> tuple[int, ...]:
    """`n` random token ids, above the low ids where tokenizers keep special tokens.
    Distinct random prompts share no prefix: nothing comes from a prefix cache."""
    lo = min(100, vocab_size // 4)
    return tuple(rng.randrange(lo, vocab_size) for _ in range(n))


def _lognormal_length(rng: random.Random, mean: float, sigma: float) -> int:
    mu = math.log(mean) - sigma * sigma / 2  # E[lognormal] = exp(mu + sigma^2 / 2)
    lo, hi = SHAREGPT_CLIP
    return int(min(hi, max(lo, round(rng.lognormvariate(mu, sigma)))))


def sharegpt_like(
    n: int, scale: float, vocab_size: int, max_len: int, rng: random.Random
) -> list[RequestSpec]:
    """ShareGPT-like requests: heavy-tailed input/output lengths, means 161/338 before
    `scale`; at least 4 prompt and 2 output tokens (so TPOT is defined), and prompt +
    output within `max_len`."""
    if not 0 < scale <= 1:
        raise ValueError(f"length scale must be in (0, 1], got {scale}")
    if max_len < 6:
        raise ValueError(f"max_len must fit 4 prompt + 2 output tokens, got {max_len}")
    out = []
    for _ in range(n):
        prompt_len = max(
            4, round(scale * _lognormal_length(rng, SHAREGPT_MEAN_INPUT, SHAREGPT_SIGMA_INPUT))
        )
        output_len = max(
            2, round(scale * _lognormal_length(rng, SHAREGPT_MEAN_OUTPUT, SHAREGPT_SIGMA_OUTPUT))
        )
        output_len = min(output_len, max_len - 4)
        prompt_len = min(prompt_len, max_len - output_len)
        out.append(RequestSpec("sharegpt", random_prompt(prompt_len, vocab_size, rng), output_len))
    return out


@dataclass(frozen=True)
class WorkloadConfig:
    seed: int = 0
    # sharegpt phase
    num_prompts: int = 12
    request_rate: float | None = 0.5
    length_scale: float = 0.1
    # decode stream (both the decode and the interference phases)
    num_short: int = 16
    short_rate: float | None = 0.8
    short_prompt_len: int = 16
    short_output_len: int = 32
    # interference
    # How often the interference shows in p99: a long prompt stalls each sequence
    # decoding on its worker once, so with W colocated workers about
    # ITL / (W * long_every_s) of the stream's gaps are stalls (~130 ms / (2 * 2.5 s)
    # = 2.6% here): well above the 1% a p99 sees. A period much longer than ~6 s
    # would hide the stalls from p99 entirely.
    long_prompt_len: int = 384
    long_output_len: int = 4
    long_every_s: float = 2.5

    def __post_init__(self) -> None:
        for name in ("num_prompts", "num_short", "short_prompt_len", "long_prompt_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("short_output_len", "long_output_len"):
            if getattr(self, name) < 2:
                raise ValueError(
                    f"{name} must be >= 2 (TPOT needs 2 tokens), got {getattr(self, name)}"
                )
        if not self.long_every_s > 0:
            raise ValueError(f"long_every_s must be > 0, got {self.long_every_s}")


def build_phases(
    cfg: WorkloadConfig, vocab_size: int, max_len: int, names: Sequence[str]
) -> list[Phase]:
    """The seeded phases by name ("sharegpt", "decode", "interference"). The decode and
    interference phases share the very same decode stream (prompts and send times)."""
    for need, what in (
        (cfg.short_prompt_len + cfg.short_output_len, "short prompt + output"),
        (cfg.long_prompt_len + cfg.long_output_len, "long prompt + output"),
    ):
        if need > max_len:
            raise ValueError(f"{what} = {need} tokens exceeds the model's context {max_len}")
    rng = random.Random(cfg.seed)
    share = sharegpt_like(cfg.num_prompts, cfg.length_scale, vocab_size, max_len, rng)
    share_at = poisson_arrivals(cfg.num_prompts, cfg.request_rate, rng)
    short_at = poisson_arrivals(cfg.num_short, cfg.short_rate, rng)
    stream = tuple(
        Arrival(
            t,
            RequestSpec(
                "short", random_prompt(cfg.short_prompt_len, vocab_size, rng), cfg.short_output_len
            ),
        )
        for t in short_at
    )
    # Long prompts at a steady period, offset by half a period, while the stream runs
    # (at least one, even when the stream is sent all at once).
    span = max(short_at)
    longs = tuple(
        Arrival(
            cfg.long_every_s * (k + 0.5),
            RequestSpec(
                "long", random_prompt(cfg.long_prompt_len, vocab_size, rng), cfg.long_output_len
            ),
            gated=False,
        )
        for k in range(max(1, math.ceil(span / cfg.long_every_s - 0.5)))
    )
    phases = {
        "sharegpt": Phase(
            "sharegpt", tuple(Arrival(t, s) for t, s in zip(share_at, share, strict=True))
        ),
        "decode": Phase("decode", stream),
        "interference": Phase("interference", tuple(sorted(stream + longs, key=lambda a: a.at_s))),
    }
    unknown = sorted(set(names) - set(phases))
    if unknown:
        raise ValueError(f"unknown phase(s) {unknown}; known: {sorted(phases)}")
    return [phases[n] for n in names]


# -- metrics (vllm bench serve's definitions) ---------------------------------------------


@dataclass
class RequestRecord:
    """One request as the client saw it; times are time.perf_counter() seconds."""

    kind: str
    prompt_len: int
    max_tokens: int
    start: float | None = None  # None: never sent (the phase's time cap came first)
    chunk_times: list[float] = field(default_factory=list)  # receipt of chunks with tokens
    output_tokens: int = 0
    error: str | None = None

    @property
    def success(self) -> bool:
        return self.error is None and self.start is not None and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        assert self.start is not None and self.chunk_times
        return self.chunk_times[0] - self.start

    @property
    def latency(self) -> float:
        """E2E: sent -> the last chunk with tokens (vLLM's most_recent_timestamp - st)."""
        assert self.start is not None and self.chunk_times
        return self.chunk_times[-1] - self.start

    @property
    def itl(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t[:-1], t[1:], strict=True)]

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); None with fewer than 2 tokens."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class SLO:
    """Service-level objectives for goodput, in ms; None = not constrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def met_by(self, r: RequestRecord) -> bool:
        checks = (
            (self.ttft_ms, r.ttft),
            (self.tpot_ms, r.tpot or 0.0),  # vLLM: TPOT 0 for a single-token output
            (self.e2e_ms, r.latency),
        )
        return all(slo is None or value * MS <= slo for slo, value in checks)

    @property
    def empty(self) -> bool:
        return self.ttft_ms is None and self.tpot_ms is None and self.e2e_ms is None


@dataclass(frozen=True)
class Stat:
    """mean / p50 / p99 / max in milliseconds over `n` values (vLLM reports no max;
    here it shows the longest stall)."""

    n: int
    mean: float
    p50: float
    p99: float
    max: float

    @staticmethod
    def of(seconds: Sequence[float]) -> Stat | None:
        if not seconds:
            return None
        a = np.asarray(seconds, dtype=np.float64) * MS
        p50, p99 = np.percentile(a, [50, 99])
        return Stat(len(a), float(a.mean()), float(p50), float(p99), float(a.max()))


@dataclass(frozen=True)
class Metrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    duration_s: float
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output tokens) / s
    good_requests: int | None  # None without SLOs
    goodput: float | None  # good requests / s
    ttft: Stat | None
    tpot: Stat | None
    itl: Stat | None
    e2e: Stat | None


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: SLO) -> Metrics:
    """vLLM's calculate_metrics over `records` (throughputs over `duration_s`)."""
    if not duration_s > 0:
        raise ValueError(f"duration must be > 0 s, got {duration_s}")
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    good = None if slo.empty else sum(1 for r in ok if slo.met_by(r))
    return Metrics(
        completed=len(ok),
        failed=len(records) - len(ok),
        total_input=total_in,
        total_output=total_out,
        duration_s=duration_s,
        request_throughput=len(ok) / duration_s,
        output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        good_requests=good,
        goodput=None if good is None else good / duration_s,
        ttft=Stat.of([r.ttft for r in ok]),
        tpot=Stat.of([t for r in ok if (t := r.tpot) is not None]),
        itl=Stat.of([g for r in ok for g in r.itl]),
        e2e=Stat.of([r.latency for r in ok]),
    )


# -- the load generator -------------------------------------------------------------------


@dataclass
class PhaseRun:
    name: str
    records: list[RequestRecord]
    duration_s: float  # first send slot -> last completion
    loadavg_1m: float  # the machine's load average when the phase started

    def metrics(self, slo: SLO, kind: str | None = None) -> Metrics:
        recs = [r for r in self.records if kind is None or r.kind == kind]
        return summarize(recs, self.duration_s, slo)


def _stream(
    client: Client, spec: RequestSpec, record: RequestRecord, calls: dict, timeout_s: float
) -> None:
    record.start = time.perf_counter()
    try:
        call = client.generate(
            token_ids=spec.prompt_token_ids,
            max_tokens=spec.max_tokens,
            temperature=0.0,
            ignore_eos=True,
            timeout=timeout_s,
        )
        calls[id(record)] = call
        for resp in call:
            if resp.token_ids:
                record.chunk_times.append(time.perf_counter())
                record.output_tokens += len(resp.token_ids)
            if resp.finish_reason == gen_pb.FINISH_REASON_ABORT:
                record.error = "ABORT: the server ended the request"
    except grpc.RpcError as e:
        record.error = f"{e.code().name}: {e.details()}"
    finally:
        calls.pop(id(record), None)


def run_phase(
    address: str,
    phase: Phase,
    *,
    concurrency: int | None = None,
    timeout_s: float = 120.0,
) -> PhaseRun:
    """Sends `phase`'s requests at their times (gated ones at most `concurrency` in
    flight), one thread per request, and returns what each saw. After `timeout_s`
    nothing more is sent and whatever still runs is cancelled (recorded as failed)."""
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    loadavg = os.getloadavg()[0]
    records = [
        RequestRecord(a.spec.kind, len(a.spec.prompt_token_ids), a.spec.max_tokens)
        for a in phase.arrivals
    ]
    calls: dict[int, grpc.Future] = {}
    threads: list[threading.Thread] = []
    lock = threading.Lock()
    slots = threading.BoundedSemaphore(concurrency) if concurrency else None
    stop = threading.Event()
    with open_client(address) as client:  # "http://..." = the OpenAI HTTP API
        t0 = time.perf_counter()
        deadline = t0 + timeout_s

        def send(i: int, gated: bool) -> None:
            def body() -> None:
                try:
                    _stream(
                        client,
                        phase.arrivals[i].spec,
                        records[i],
                        calls,
                        max(0.1, deadline - time.perf_counter()),
                    )
                finally:
                    if gated and slots is not None:
                        slots.release()

            t = threading.Thread(target=body, name=f"{phase.name}-{i}", daemon=True)
            with lock:
                threads.append(t)
            t.start()

        def dispatch(gated: bool) -> None:
            for i, a in enumerate(phase.arrivals):
                if a.gated != gated:
                    continue
                if stop.wait(max(0.0, t0 + a.at_s - time.perf_counter())):
                    return
                if gated and slots is not None:
                    while not slots.acquire(timeout=0.05):
                        if stop.is_set():
                            return
                send(i, gated)

        dispatchers = [
            threading.Thread(target=dispatch, args=(g,), daemon=True) for g in (True, False)
        ]
        for d in dispatchers:
            d.start()
        _join_until(dispatchers, deadline, stop)
        while True:
            with lock:
                pending = [t for t in threads if t.is_alive()]
            if not pending or time.perf_counter() > deadline:
                break
            pending[0].join(timeout=max(0.0, deadline - time.perf_counter()))
        duration = time.perf_counter() - t0
        stop.set()
        for call in list(calls.values()):
            call.cancel()  # aborts the request on every worker
        for d in dispatchers:
            d.join()
        with lock:
            for t in threads:
                t.join(timeout=10.0)
    for r in records:
        if r.start is None:
            r.error = "not sent: the phase's time cap came first"
    return PhaseRun(phase.name, records, duration, loadavg)


def _join_until(threads: list[threading.Thread], deadline: float, stop: threading.Event) -> None:
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.perf_counter()))
    if any(t.is_alive() for t in threads):
        stop.set()


def warm_up(address: str, num_workers: int, long_prompt_len: int, vocab_size: int) -> None:
    """A few requests per worker, long and short, before anything is measured (first
    forwards allocate buffers and are slow)."""
    rng = random.Random(-1)
    specs = [
        RequestSpec("long", random_prompt(long_prompt_len, vocab_size, rng), 2)
        for _ in range(num_workers)
    ]
    specs += [
        RequestSpec("short", random_prompt(16, vocab_size, rng), 8) for _ in range(2 * num_workers)
    ]
    run = run_phase(
        address, Phase("warm-up", tuple(Arrival(0.0, s) for s in specs)), timeout_s=120.0
    )
    failed = [r.error for r in run.records if not r.success]
    if failed:
        raise RuntimeError(f"warm-up requests failed: {failed}")


# -- configurations -----------------------------------------------------------------------


@dataclass(frozen=True)
class ServingConfig:
    name: str
    num_prefill: int
    num_decode: int
    disagg_min_prompt_tokens: int

    @property
    def num_workers(self) -> int:
        return self.num_prefill + self.num_decode


NEVER_DISAGGREGATE = 1 << 30  # beyond any prompt


def serving_configs(
    num_prefill: int, num_decode: int, disagg_min_prompt_tokens: int = 0
) -> list[ServingConfig]:
    """Colocated (all workers decode and prefill locally) and disaggregated, with the
    same total number of workers."""
    if num_prefill < 1 or num_decode < 1:
        raise ValueError(
            f"need >= 1 prefill and >= 1 decode worker, got {num_prefill}, {num_decode}"
        )
    return [
        ServingConfig("colocated", 0, num_prefill + num_decode, NEVER_DISAGGREGATE),
        ServingConfig("disaggregated", num_prefill, num_decode, disagg_min_prompt_tokens),
    ]


def measure_config(
    address: str,
    phases: Sequence[Phase],
    *,
    concurrency: int | None,
    timeout_s: float,
    progress: Callable[[str], None] = lambda _m: None,
) -> dict[str, PhaseRun]:
    """Runs the phases one after another against a router at `address`."""
    runs = {}
    for phase in phases:
        progress(f"  phase {phase.name}: {len(phase.arrivals)} requests")
        runs[phase.name] = run_phase(address, phase, concurrency=concurrency, timeout_s=timeout_s)
        failed = sum(1 for r in runs[phase.name].records if not r.success)
        progress(
            f"  phase {phase.name}: done in {runs[phase.name].duration_s:.1f} s, {failed} failed"
        )
    return runs


def phase_metrics(runs: dict[str, PhaseRun], slo: SLO) -> dict[str, Metrics]:
    """The columns of a configuration's table: every phase over all its requests, and
    the interference phase's decode stream alone ("interference/short")."""
    out = {name: run.metrics(slo) for name, run in runs.items()}
    if "interference" in runs:
        out["interference/short"] = runs["interference"].metrics(slo, kind="short")
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def isolation_ratio(metrics: dict[str, Metrics]) -> float | None:
    """The decode stream's p99 ITL with long-prompt interference over without."""
    base, interf = metrics.get("decode"), metrics.get("interference/short")
    if base is None or interf is None or base.itl is None or interf.itl is None:
        return None
    return _ratio(interf.itl.p99, base.itl.p99)


OVERLAP_CLASSES = ("during a long prefill", "during a long decode", "clear of long prompts")


def itl_by_overlap(run: PhaseRun) -> dict[str, Stat | None]:
    """The decode stream's ITL gaps split by what a long prompt was doing meanwhile.

    A long request is "prefilling" from its send to its first token (queueing, the
    prefill, and in the disaggregated case the KV transfer) and "decoding" from its
    first to its last token. A gap counts as during a long prefill when it overlaps
    any prefill window, else as during a long decode when it overlaps a decode window,
    else as clear. Colocated stalls show up in the first class; a decode worker that
    slows down because the long sequences join its batch, in the second.
    """
    longs = [r for r in run.records if r.kind == "long" and r.success]
    prefill = [(r.start, r.chunk_times[0]) for r in longs]
    decode = [(r.chunk_times[0], r.chunk_times[-1]) for r in longs]
    gaps: dict[str, list[float]] = {c: [] for c in OVERLAP_CLASSES}
    for r in run.records:
        if r.kind != "short" or not r.success:
            continue
        for a, b in zip(r.chunk_times[:-1], r.chunk_times[1:], strict=True):
            if any(a < e and b > s for s, e in prefill):
                gaps[OVERLAP_CLASSES[0]].append(b - a)
            elif any(a < e and b > s for s, e in decode):
                gaps[OVERLAP_CLASSES[1]].append(b - a)
            else:
                gaps[OVERLAP_CLASSES[2]].append(b - a)
    return {c: Stat.of(g) for c, g in gaps.items()}


COMPARED = (  # (label, phase, metric path), disaggregated / colocated
    ("sharegpt output tok/s", "sharegpt", "output_throughput"),
    ("sharegpt TTFT p50", "sharegpt", "ttft.p50"),
    ("sharegpt TTFT p99", "sharegpt", "ttft.p99"),
    ("sharegpt TPOT mean", "sharegpt", "tpot.mean"),
    ("sharegpt ITL p99", "sharegpt", "itl.p99"),
    ("sharegpt E2E p50", "sharegpt", "e2e.p50"),
    ("decode-stream ITL p99, no interference", "decode", "itl.p99"),
    ("decode-stream ITL p99, interference", "interference/short", "itl.p99"),
    ("decode-stream ITL max, interference", "interference/short", "itl.max"),
    ("decode-stream TPOT mean, interference", "interference/short", "tpot.mean"),
    ("decode-stream TTFT p99, interference", "interference/short", "ttft.p99"),
)


def _get(m: Metrics | None, path: str) -> float | None:
    v: object = m
    for part in path.split("."):
        if v is None:
            return None
        v = getattr(v, part)
    return v  # type: ignore[return-value]


def compare(results: dict[str, dict[str, Metrics]]) -> dict:
    """Per configuration the isolation ratio; across the two, disaggregated / colocated."""
    out: dict = {"isolation_p99_itl": {c: isolation_ratio(m) for c, m in results.items()}}
    if {"colocated", "disaggregated"} <= set(results):
        colo, dis = results["colocated"], results["disaggregated"]
        out["disaggregated_over_colocated"] = {
            label: {
                "colocated": _get(colo.get(phase), path),
                "disaggregated": _get(dis.get(phase), path),
                "ratio": _ratio(_get(dis.get(phase), path), _get(colo.get(phase), path)),
            }
            for label, phase, path in COMPARED
        }
    return out


# -- output -------------------------------------------------------------------------------


def _fmt(v: float | int | None, digits: int = 1) -> str:
    if v is None:
        return "–"
    if isinstance(v, int):
        return str(v)
    return f"{v:.{digits}f}"


def config_table(metrics: dict[str, Metrics], runs: dict[str, PhaseRun]) -> str:
    cols = list(metrics)
    rows: list[tuple[str, list[str]]] = [
        ("completed / failed", [f"{m.completed} / {m.failed}" for m in metrics.values()]),
        (
            "input / output tokens",
            [f"{m.total_input} / {m.total_output}" for m in metrics.values()],
        ),
        ("duration s", [_fmt(m.duration_s) for m in metrics.values()]),
        ("load average at start", [_fmt(runs[c.split("/")[0]].loadavg_1m) for c in cols]),
        ("request throughput req/s", [_fmt(m.request_throughput, 3) for m in metrics.values()]),
        ("output throughput tok/s", [_fmt(m.output_throughput) for m in metrics.values()]),
        (
            "total token throughput tok/s",
            [_fmt(m.total_token_throughput) for m in metrics.values()],
        ),
        (
            "goodput req/s (good requests)",
            [
                "–" if m.goodput is None else f"{m.goodput:.3f} ({m.good_requests})"
                for m in metrics.values()
            ],
        ),
    ]
    for name in ("ttft", "tpot", "itl", "e2e"):
        for stat in ("mean", "p50", "p99", "max"):
            rows.append(
                (
                    f"{name.upper()} {stat} ms",
                    [_fmt(_get(m, f"{name}.{stat}")) for m in metrics.values()],
                )
            )
    head = "| metric | " + " | ".join(cols) + " |\n| --- |" + " ---: |" * len(cols) + "\n"
    return head + "\n".join(f"| {label} | " + " | ".join(vals) + " |" for label, vals in rows)


def comparison_table(cmp: dict) -> str:
    lines = [
        "| decode p99 ITL, interference / none | ratio | within 1.5x |",
        "| --- | ---: | --- |",
    ]
    for c, r in cmp["isolation_p99_itl"].items():
        lines.append(
            f"| {c} | {_fmt(r, 2)}x | {'–' if r is None else ('yes' if r <= ISOLATION_TARGET else 'no')} |"
        )
    if "disaggregated_over_colocated" in cmp:
        lines += [
            "",
            "| metric | colocated | disaggregated | disagg / colo |",
            "| --- | ---: | ---: | ---: |",
        ]
        for label, v in cmp["disaggregated_over_colocated"].items():
            unit = "" if "tok/s" in label else " ms"
            lines.append(
                f"| {label}{unit} | {_fmt(v['colocated'])} | {_fmt(v['disaggregated'])} | {_fmt(v['ratio'], 2)}x |"
            )
    return "\n".join(lines)


def overlap_table(by_config: dict[str, dict[str, Stat | None]]) -> str:
    lines = [
        "| config | decode-stream gaps (interference phase) | n | mean ms | p50 ms | p99 ms | max ms |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c, classes in by_config.items():
        for cls, st in classes.items():
            vals = (
                ["0", "–", "–", "–", "–"]
                if st is None
                else [str(st.n), _fmt(st.mean), _fmt(st.p50), _fmt(st.p99), _fmt(st.max)]
            )
            lines.append(f"| {c} | {cls} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def workload_summary(phases: Sequence[Phase]) -> dict[str, dict]:
    out = {}
    for p in phases:
        by_kind: dict[str, list[RequestSpec]] = {}
        for a in p.arrivals:
            by_kind.setdefault(a.spec.kind, []).append(a.spec)
        out[p.name] = {
            kind: {
                "requests": len(specs),
                "mean_input": float(np.mean([len(s.prompt_token_ids) for s in specs])),
                "mean_output": float(np.mean([s.max_tokens for s in specs])),
                "max_input": max(len(s.prompt_token_ids) for s in specs),
                "max_output": max(s.max_tokens for s in specs),
            }
            for kind, specs in by_kind.items()
        }
        out[p.name]["send_span_s"] = max(a.at_s for a in p.arrivals)
    return out


# -- the command --------------------------------------------------------------------------


# The help of the workload flags (one a WorkloadConfig field) that need one.
WORKLOAD_HELP = {
    "num_prompts": "sharegpt phase requests",
    "request_rate": "sharegpt phase, req/s (Poisson); 'inf' = all at once",
    "length_scale": "ShareGPT lengths times this (1 = the paper's 161/338 means)",
    "num_short": "decode-stream requests",
    "short_rate": "decode stream req/s (Poisson); 'inf' = all at once",
    "long_every_s": "one long prompt per this many seconds",
}


def build_parser() -> argparse.ArgumentParser:
    d = WorkloadConfig()  # every field a number, never None: its type is the flag's
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.serving", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model", default=None, help="local HF checkpoint dir (default: SmolLM2-135M)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument(
        "--prefill", type=int, default=1, help="prefill workers of the disaggregated config"
    )
    p.add_argument(
        "--decode", type=int, default=1, help="decode workers of the disaggregated config"
    )
    p.add_argument(
        "--configs",
        nargs="+",
        default=["colocated", "disaggregated"],
        choices=["colocated", "disaggregated"],
        help="which configurations, run in this order",
    )
    p.add_argument(
        "--phases",
        nargs="+",
        default=["sharegpt", "decode", "interference"],
        choices=["sharegpt", "decode", "interference"],
    )
    p.add_argument(
        "--disagg-min-prompt-tokens",
        type=int,
        default=0,
        help="disaggregated: prompts shorter than this prefill on the decode worker",
    )
    p.add_argument("--threads-per-worker", type=int, default=1, help="torch threads per worker")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=2048,
        help="per request (prompt + output), at most the model's",
    )
    p.add_argument("--kv-cache-mib", type=int, default=256, help="KV cache per worker")
    p.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="at most this many requests in flight (long prompts excepted)",
    )
    for f in fields(WorkloadConfig):  # --num-prompts etc.: WorkloadConfig's defaults
        default = getattr(d, f.name)
        flag = "--" + f.name.replace("_", "-")
        p.add_argument(flag, type=type(default), default=default, help=WORKLOAD_HELP.get(f.name))
    p.add_argument(
        "--slo-ttft-ms", type=float, default=3000.0, help="goodput SLO on TTFT (<= 0: none)"
    )
    p.add_argument(
        "--slo-tpot-ms", type=float, default=300.0, help="goodput SLO on TPOT (<= 0: none)"
    )
    p.add_argument("--slo-e2e-ms", type=float, default=None, help="goodput SLO on E2E latency")
    p.add_argument(
        "--phase-timeout-s", type=float, default=120.0, help="cap per phase; then cancel"
    )
    p.add_argument("--json", default=None, metavar="PATH")
    # issue 12: http
    p.add_argument(
        "--api",
        choices=["grpc", "openai"],
        default="grpc",
        help="drive the router's gRPC API or its OpenAI HTTP API (/v1/completions)",
    )
    p.add_argument(
        "--worker-timeout-s",
        type=float,
        default=30.0,
        help="router drops a worker after this long without a heartbeat",
    )
    p.add_argument("--log-level", default="WARNING")
    return p


def _model_max_len(model_dir: os.PathLike) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        return int(json.load(f).get("max_position_embeddings", 1 << 30))


def _rate(v: float | None) -> float | None:
    return None if v is None or math.isinf(v) else v


def workload_from_args(args: argparse.Namespace) -> WorkloadConfig:
    """The WorkloadConfig of the parsed flags; a rate of 'inf' (all at once) is None."""
    values = {f.name: getattr(args, f.name) for f in fields(WorkloadConfig)}
    for name in ("request_rate", "short_rate"):
        values[name] = _rate(values[name])
    return WorkloadConfig(**values)


def _slo_value(v: float | None) -> float | None:
    return None if v is None or v <= 0 else v


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads_per_worker))
    from pagedserve.common.core.config import CacheConfig, EngineConfig, SchedulerConfig
    from pagedserve.common.core.loader import resolve_model_dir
    from pagedserve.launch import Cluster, ClusterSpec

    t_start = time.monotonic()

    def progress(msg: str) -> None:
        print(f"[{time.monotonic() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    wl = workload_from_args(args)
    slo = SLO(
        _slo_value(args.slo_ttft_ms), _slo_value(args.slo_tpot_ms), _slo_value(args.slo_e2e_ms)
    )
    model_dir = resolve_model_dir(args.model, progress=progress)
    max_model_len = min(args.max_model_len, _model_max_len(model_dir))
    engine = EngineConfig(
        model=str(model_dir),
        dtype=args.dtype,
        cache=CacheConfig(kv_cache_bytes=args.kv_cache_mib << 20),
        scheduler=SchedulerConfig(max_model_len=max_model_len),
        num_threads=args.threads_per_worker,
    )
    by_name = {
        c.name: c for c in serving_configs(args.prefill, args.decode, args.disagg_min_prompt_tokens)
    }
    configs = [by_name[n] for n in dict.fromkeys(args.configs)]  # in the order given
    phases: list[Phase] | None = None
    results: dict[str, dict[str, Metrics]] = {}
    runs_by_config: dict[str, dict[str, PhaseRun]] = {}
    for cfg in configs:
        spec = ClusterSpec(
            model=str(model_dir),
            num_prefill=cfg.num_prefill,
            num_decode=cfg.num_decode,
            engine=engine,
            router_port=0,
            internal_port=0,
            num_cpus=os.cpu_count(),
            disagg_min_prompt_tokens=cfg.disagg_min_prompt_tokens,
            log_level=args.log_level,
            # A worker's heartbeat reads its stats on the engine loop, so it waits for
            # the running step: a long prefill on this loaded CPU can outlast the 3 s
            # default and get a busy worker dropped from routing.
            worker_timeout_s=args.worker_timeout_s,
            router_http_port=0 if args.api == "openai" else None,  # the HTTP API, any port
            router_options={"max_model_len": max_model_len},
        )
        progress(f"{cfg.name}: {cfg.num_prefill} prefill + {cfg.num_decode} decode worker(s)")
        with Cluster(spec) as cluster:
            cluster.start(progress=progress, timeout_s=600)
            with Client(cluster.address, timeout=30) as c:
                info = c.model_info()
            if phases is None:
                phases = build_phases(wl, info.vocab_size, info.max_context_len, args.phases)
            progress(f"{cfg.name}: warming up")
            address = cluster.address  # issue 12: http
            if args.api == "openai":
                address = f"http://{cluster.router.router.http.address}"
            warm_up(address, cfg.num_workers, wl.long_prompt_len, info.vocab_size)
            runs = measure_config(
                address,
                phases,
                concurrency=args.concurrency,
                timeout_s=args.phase_timeout_s,
                progress=progress,
            )
            counters = cluster.router.call(lambda r: dict(r.counters))
        progress(f"{cfg.name}: router counters {counters}")
        runs_by_config[cfg.name] = runs
        results[cfg.name] = phase_metrics(runs, slo)
    assert phases is not None
    cmp = compare(results)
    overlap = {
        c: itl_by_overlap(r["interference"])
        for c, r in runs_by_config.items()
        if "interference" in r
    }
    cmp["interference_itl_by_overlap"] = {
        c: {cls: None if st is None else asdict(st) for cls, st in v.items()}
        for c, v in overlap.items()
    }
    report(args, info.model_name, wl, slo, phases, results, runs_by_config, cmp)
    if args.json:
        write_json(args.json, args, info.model_name, wl, slo, phases, results, runs_by_config, cmp)
    progress("done")
    return 0


def report(args, model_name, wl, slo, phases, results, runs_by_config, cmp) -> None:
    summary = workload_summary(phases)
    print(
        f"\nmodel {model_name}, dtype {args.dtype}, {args.threads_per_worker} torch thread(s) per worker, "
        f"{os.cpu_count()} CPU cores"
    )
    if "sharegpt" in summary:
        s = summary["sharegpt"]["sharegpt"]
        print(
            f"sharegpt: {s['requests']} requests, lengths scaled by {wl.length_scale} from ShareGPT's means "
            f"{SHAREGPT_MEAN_INPUT}/{SHAREGPT_MEAN_OUTPUT} for this CPU: mean input {s['mean_input']:.1f} "
            f"(max {s['max_input']}), output {s['mean_output']:.1f} (max {s['max_output']}) tokens, "
            f"{'all at once' if wl.request_rate is None else f'Poisson {wl.request_rate} req/s'}"
        )
    print(
        f"decode stream: {wl.num_short} requests of {wl.short_prompt_len} -> {wl.short_output_len} tokens, "
        f"{'all at once' if wl.short_rate is None else f'Poisson {wl.short_rate} req/s'}; interference: "
        f"+ a {wl.long_prompt_len} -> {wl.long_output_len} token prompt every {wl.long_every_s} s"
    )
    if args.concurrency:
        print(f"concurrency cap: {args.concurrency} (long prompts not counted)")
    print(f"SLOs for goodput: TTFT {slo.ttft_ms} ms, TPOT {slo.tpot_ms} ms, E2E {slo.e2e_ms} ms")
    for name, metrics in results.items():
        print(f"\n### {name}\n")
        print(config_table(metrics, runs_by_config[name]))
    print("\n### comparison\n")
    print(comparison_table(cmp))
    if cmp["interference_itl_by_overlap"]:
        print()
        print(
            overlap_table(
                {
                    c: {cls: None if d is None else Stat(**d) for cls, d in v.items()}
                    for c, v in cmp["interference_itl_by_overlap"].items()
                }
            )
        )
    print()


def write_json(path, args, model_name, wl, slo, phases, results, runs_by_config, cmp) -> None:
    doc = {
        "benchmark": "serving",
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
        "model": model_name,
        "args": vars(args),
        "workload": {"config": asdict(wl), "phases": workload_summary(phases)},
        "slo_ms": asdict(slo),
        "results": {
            c: {
                phase: asdict(m) | {"loadavg_1m": runs_by_config[c][phase.split("/")[0]].loadavg_1m}
                for phase, m in metrics.items()
            }
            for c, metrics in results.items()
        },
        "comparison": cmp,
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
