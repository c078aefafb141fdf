"""KV-cache waste: paged blocks (the real `BlockManager`) vs contiguous max-length reservation.

    python -m benchmarks.kv_waste [--json PATH] [--requests N] [--seed S]

Three workloads, both allocators side by side on the same pool:

1. The seed example: a 64 x 16-slot pool, max_len 256, four requests served to the end
   of their generation (snapshot), then one 96-token system prompt shared by 3 users.
2. A ShareGPT-like stream (seeded; heavy-tailed lognormal lengths with the vLLM paper's
   means, input ~161 and output ~338 tokens, prompt + output clipped to max_len 2048),
   Poisson arrivals and departures, one token per running sequence per decode step.
   Waste is time-weighted over decode steps: 1 - sum(tokens held) / sum(slots reserved).
   Also reported: peak and mean concurrent sequences each allocator sustains, and a
   block-size sweep (waste vs per-block bookkeeping).
3. Ten requests sharing a 512-token system prompt, prefix caching on vs off.

"Needed" slots are the tokens a sequence holds (prompt + generated so far); "reserved" is
what the allocator set aside for it: max_len for contiguous, whole blocks for paged.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

from benchmarks.contiguous_allocator import ContiguousAllocator, ContiguousAllocatorError
from pagedserve.common.core.block_manager import (
    BlockManager,
    NoFreeBlocksError,
    RequestTooLargeError,
)

VOCAB = 49152  # SmolLM2's, for plausible token ids

# ---------------------------------------------------------------------------- workload 1

W1_NUM_BLOCKS, W1_BLOCK_SIZE, W1_MAX_LEN = 64, 16, 256
W1_REQUESTS = [("r1", 40, 12), ("r2", 17, 3), ("r3", 95, 40), ("r4", 8, 200)]  # (prompt, gen)
W1_SYSTEM_PROMPT = 96
W1_USERS = [("u1", 20, 12), ("u2", 9, 30), ("u3", 33, 5)]  # (user prompt, generated)

# ---------------------------------------------------------------------------- workload 2, 3

POOL_SLOTS = 2048 * 16  # 32768 token slots: 16 contiguous max-length reservations
MAX_LEN = 2048
BLOCK_SIZE = 16
SWEEP_BLOCK_SIZES = (1, 8, 16, 32, 64, 128)
ARRIVAL_RATE = 0.5  # requests per decode step: both allocators stay saturated
# Lognormal sigma (heavy tail) and mu such that the unclipped mean is the paper's mean.
PROMPT_MEAN, PROMPT_SIGMA = 161, 1.0
OUTPUT_MEAN, OUTPUT_SIGMA = 338, 1.0
W3_SYSTEM_PROMPT, W3_REQUESTS = 512, 10


@dataclass
class SnapshotResult:
    """One allocator after serving a fixed set of requests to the end of generation."""

    served: int
    rejected: int
    reserved_slots: int
    needed_slots: int  # distinct token slots: a block shared by prefix caching counts once
    tokens_held: int  # tokens summed over sequences (> needed_slots when blocks are shared)
    free_blocks: int  # pool blocks (of the benchmark's block size) still free
    prefill_tokens: int = 0  # prompt tokens actually computed (after prefix hits)
    prefix_hit_tokens: int = 0

    @property
    def waste_pct(self) -> float:
        return _pct(self.reserved_slots - self.needed_slots, self.reserved_slots)


@dataclass
class StreamResult:
    """One allocator over a stream of arrivals and departures."""

    block_size: int | None  # None: contiguous
    pool_blocks: int | None  # None: contiguous
    served: int = 0
    rejected: int = 0
    preemptions: int = 0
    steps: int = 0  # decode steps with at least one running sequence
    makespan: int = 0  # step at which the last request finished
    peak_concurrent: int = 0
    sum_running: int = 0  # = tokens generated (and kept), one per running sequence per step
    sum_needed: int = 0
    sum_reserved: int = 0

    @property
    def waste_pct(self) -> float:
        return _pct(self.sum_reserved - self.sum_needed, self.sum_reserved)

    @property
    def mean_concurrent(self) -> float:
        return self.sum_running / self.steps if self.steps else 0.0

    @property
    def mean_blocks_per_seq(self) -> float:
        """Block-table entries per running sequence (the per-block bookkeeping)."""
        unit = self.block_size or 1
        return self.sum_reserved / unit / self.sum_running if self.sum_running else 0.0


def _pct(part: float, whole: float) -> float:
    return 100.0 * part / whole if whole else 0.0


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


# ---------------------------------------------------------------------------- snapshots


def serve_paged(
    requests: Sequence[tuple[str, list[int], list[int]]],
    num_blocks: int,
    block_size: int,
    prefix_caching: bool = False,
) -> SnapshotResult:
    """Prefill every request in order (caching its prompt), then decode in lockstep."""
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    admitted, rejected, prefill = [], 0, 0
    for rid, prompt, generated in requests:
        try:
            cached = bm.allocate(rid, prompt)
        except (NoFreeBlocksError, RequestTooLargeError):
            rejected += 1
            continue
        prefill += len(prompt) - cached
        bm.mark_computed(rid, len(prompt))
        admitted.append((rid, generated))
    for step in range(max((len(g) for _, g in admitted), default=0)):
        for rid, generated in admitted:
            if step < len(generated):
                bm.append_tokens(rid, [generated[step]])
                bm.mark_computed(rid, bm.num_tokens(rid))
    bm.check_integrity()
    stats = bm.stats()
    return SnapshotResult(
        served=len(admitted),
        rejected=rejected,
        reserved_slots=stats.num_used * block_size,
        needed_slots=_distinct_slots(bm, [rid for rid, _ in admitted]),
        tokens_held=sum(bm.num_tokens(rid) for rid, _ in admitted),
        free_blocks=bm.num_free_blocks(),
        prefill_tokens=prefill,
        prefix_hit_tokens=stats.prefix_hit_tokens,
    )


def _distinct_slots(bm: BlockManager, seq_ids: Iterable[str]) -> int:
    """Slots holding a token of some sequence, each physical slot counted once."""
    filled: dict[int, int] = {}  # block id -> tokens in it
    for seq_id in seq_ids:
        n = bm.num_tokens(seq_id)
        for i, block_id in enumerate(bm.block_table(seq_id)):
            filled[block_id] = max(
                filled.get(block_id, 0), min(bm.block_size, n - i * bm.block_size)
            )
    return sum(filled.values())


def serve_contiguous(
    requests: Sequence[tuple[str, list[int], list[int]]],
    num_slots: int,
    max_len: int,
    block_size: int,
) -> SnapshotResult:
    alloc = ContiguousAllocator(num_slots, max_len)
    served = rejected = prefill = 0
    for rid, prompt, generated in requests:
        try:
            alloc.allocate(rid, len(prompt))
        except ContiguousAllocatorError:
            rejected += 1
            continue
        alloc.append_tokens(rid, len(generated))
        served += 1
        prefill += len(prompt)
    alloc.check_integrity()
    stats = alloc.stats()
    return SnapshotResult(
        served=served,
        rejected=rejected,
        reserved_slots=stats.reserved_slots,
        needed_slots=stats.used_slots,
        tokens_held=stats.used_slots,
        free_blocks=stats.free_slots // block_size,
        prefill_tokens=prefill,
    )


def run_workload1(seed: int = 0) -> dict:
    """The seed example, and one 96-token system prompt shared by three users."""
    rng = random.Random(seed)
    requests = [(rid, _tokens(rng, p), _tokens(rng, g)) for rid, p, g in W1_REQUESTS]
    slots = W1_NUM_BLOCKS * W1_BLOCK_SIZE
    system = _tokens(rng, W1_SYSTEM_PROMPT)
    users = [(rid, system + _tokens(rng, p), _tokens(rng, g)) for rid, p, g in W1_USERS]
    shared_off = serve_paged(users, W1_NUM_BLOCKS, W1_BLOCK_SIZE, prefix_caching=False)
    shared_on = serve_paged(users, W1_NUM_BLOCKS, W1_BLOCK_SIZE, prefix_caching=True)
    return {
        "contiguous": serve_contiguous(requests, slots, W1_MAX_LEN, W1_BLOCK_SIZE),
        "paged": serve_paged(requests, W1_NUM_BLOCKS, W1_BLOCK_SIZE),
        "shared_contiguous": serve_contiguous(users, slots, W1_MAX_LEN, W1_BLOCK_SIZE),
        "shared_paged_no_cache": shared_off,
        "shared_paged_cache": shared_on,
        "shared_saved_slots": shared_off.reserved_slots - shared_on.reserved_slots,
    }


def run_workload3(seed: int = 0) -> dict:
    """Ten ShareGPT-like requests behind one 512-token system prompt, caching on vs off."""
    rng = random.Random(seed + 3)
    system = _tokens(rng, W3_SYSTEM_PROMPT)
    requests = []
    for i in range(W3_REQUESTS):
        user, out = _sharegpt_lengths(rng, MAX_LEN - W3_SYSTEM_PROMPT)
        requests.append((f"c{i}", system + _tokens(rng, user), _tokens(rng, out)))
    num_blocks = POOL_SLOTS // BLOCK_SIZE
    return {
        "contiguous": serve_contiguous(requests, POOL_SLOTS, MAX_LEN, BLOCK_SIZE),
        "paged_no_cache": serve_paged(requests, num_blocks, BLOCK_SIZE, prefix_caching=False),
        "paged_cache": serve_paged(requests, num_blocks, BLOCK_SIZE, prefix_caching=True),
    }


# ---------------------------------------------------------------------------- workload 2


@dataclass(frozen=True)
class Request:
    rid: str
    arrival: int  # decode step
    prompt_len: int
    output_len: int


def _sharegpt_lengths(rng: random.Random, max_len: int) -> tuple[int, int]:
    """(prompt, output) lengths, heavy-tailed, prompt + output <= max_len."""
    mu_p = _lognormal_mu(PROMPT_MEAN, PROMPT_SIGMA)
    mu_o = _lognormal_mu(OUTPUT_MEAN, OUTPUT_SIGMA)
    prompt = min(max(1, round(rng.lognormvariate(mu_p, PROMPT_SIGMA))), max_len - 1)
    output = min(max(1, round(rng.lognormvariate(mu_o, OUTPUT_SIGMA))), max_len - prompt)
    return prompt, output


def _lognormal_mu(mean: float, sigma: float) -> float:
    return math.log(mean) - sigma**2 / 2


def sharegpt_stream(num_requests: int, seed: int, rate: float = ARRIVAL_RATE) -> list[Request]:
    rng = random.Random(seed)
    arrival, requests = 0.0, []
    for i in range(num_requests):
        arrival += rng.expovariate(rate)
        prompt, output = _sharegpt_lengths(rng, MAX_LEN)
        requests.append(Request(f"q{i}", int(arrival), prompt, output))
    return requests


class PagedBackend:
    """The real BlockManager (prefix caching off: the stream's prompts share nothing).

    Admission keeps a watermark of free blocks (1% of the pool, vLLM v0's default) so
    that a freshly admitted prompt is not preempted by the next step's growth; without
    it the same stream sees ~2.5x more preemptions at the same concurrency.

    The simulator tells it about tokens in batches, each batch ending with the token that
    opens a new block, so its block tables (and the pool's occupancy) at every step are
    exactly those of token-by-token appends, for a fraction of the Python calls.
    """

    def __init__(self, pool_slots: int, block_size: int, watermark: float = 0.01) -> None:
        self.block_size = block_size
        self.bm = BlockManager(pool_slots // block_size, block_size, enable_prefix_caching=False)
        self.watermark_blocks = int(watermark * self.bm.num_blocks)
        self.pool_blocks = self.bm.num_blocks

    def capacity(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size) * self.block_size

    def admit(self, rid: str, prompt_len: int) -> bool:
        blocks = self.capacity(prompt_len) // self.block_size
        if self.bm.num_free_blocks() - blocks < self.watermark_blocks:
            return False
        self.bm.allocate(rid, [0] * prompt_len)
        return True

    def grow(self, rid: str, num_tokens: int) -> bool:
        try:
            self.bm.append_tokens(rid, [0] * num_tokens)
        except NoFreeBlocksError:
            return False
        return True

    def release(self, rid: str, generated: int) -> None:
        self.bm.free(rid)

    def reserved_slots(self) -> int:
        return self.bm.num_used_blocks() * self.block_size


class ContiguousBackend:
    """Max-length reservation, first-fit; a sequence never needs to grow its reservation."""

    block_size = None
    pool_blocks = None

    def __init__(self, pool_slots: int, max_len: int) -> None:
        self.alloc = ContiguousAllocator(pool_slots, max_len)
        self.max_len = max_len
        self._reserved = 0

    def capacity(self, num_tokens: int) -> int:
        return self.max_len

    def admit(self, rid: str, prompt_len: int) -> bool:
        if not self.alloc.can_allocate(prompt_len):
            return False
        self.alloc.allocate(rid, prompt_len)
        self._reserved += self.max_len
        return True

    def grow(self, rid: str, num_tokens: int) -> bool:
        raise AssertionError("a max-length reservation never grows")

    def release(self, rid: str, generated: int) -> None:
        self.alloc.append_tokens(rid, generated)  # checks it all fitted the reservation
        self.alloc.free(rid)
        self._reserved -= self.max_len

    def reserved_slots(self) -> int:
        return self._reserved


@dataclass
class _Run:
    rid: str
    prompt_len: int  # after a preemption: original prompt + tokens generated before it
    output_len: int  # still to generate
    admitted: int  # step of admission; it generates one token per step from then on
    order: int
    capacity: int
    told: int  # tokens the backend has slots for

    def length_at(self, step: int) -> int:
        return self.prompt_len + step - self.admitted + 1

    def finish_step(self) -> int:
        return self.admitted + self.output_len - 1


@dataclass
class _Sim:
    backend: PagedBackend | ContiguousBackend
    result: StreamResult
    waiting: deque = field(default_factory=deque)  # (rid, prompt_len, output_len)
    running: dict = field(default_factory=dict)  # rid -> _Run, in admission order
    heap: list = field(default_factory=list)  # (step, kind 0 grow / 1 finish, order, rid)
    base_sum: int = 0  # sum of (prompt_len - admitted + 1): tokens held = base_sum + step * R
    orders: int = 0

    def schedule(self, run: _Run) -> None:
        grow_step = run.admitted + run.capacity - run.prompt_len  # length would be cap + 1
        if grow_step <= run.finish_step():
            heapq.heappush(self.heap, (grow_step, 0, run.order, run.rid))
        else:
            heapq.heappush(self.heap, (run.finish_step(), 1, run.order, run.rid))

    def admit(self, step: int) -> None:
        """FCFS: admit from the head of the queue while the prompt fits."""
        while self.waiting:
            rid, prompt_len, output_len = self.waiting[0]
            if not self.backend.admit(rid, prompt_len):
                return
            self.waiting.popleft()
            self.orders += 1
            capacity = self.backend.capacity(prompt_len)
            run = _Run(rid, prompt_len, output_len, step, self.orders, capacity, prompt_len)
            self.running[rid] = run
            self.base_sum += prompt_len - step + 1
            self.schedule(run)

    def remove(self, run: _Run, generated: int) -> None:
        self.backend.release(run.rid, generated)
        del self.running[run.rid]
        self.base_sum -= run.prompt_len - run.admitted + 1

    def preempt_latest(self, step: int) -> _Run:
        """Recompute-style preemption of the latest admitted sequence (as vLLM does)."""
        victim = self.running[next(reversed(self.running))]
        generated = step - victim.admitted
        self.remove(victim, generated)
        self.waiting.appendleft(
            (victim.rid, victim.prompt_len + generated, victim.output_len - generated)
        )
        self.result.preemptions += 1
        return victim

    def grow(self, run: _Run, step: int) -> None:
        """The token generated at `step` opens a new block."""
        new_len = run.length_at(step)
        while not self.backend.grow(run.rid, new_len - run.told):
            if self.preempt_latest(step) is run:
                return
        run.told = new_len
        run.capacity = self.backend.capacity(new_len)
        self.schedule(run)

    def pop_events(self, step: int, kind: int) -> Iterable[_Run]:
        while self.heap and self.heap[0][:2] <= (step, kind):
            event_step, _, order, rid = heapq.heappop(self.heap)
            run = self.running.get(rid)
            if run is not None and run.order == order:  # else stale: preempted since
                assert event_step == step, "an event was skipped"
                yield run

    def account(self, step: int) -> None:
        num_running = len(self.running)
        if not num_running:
            return
        r = self.result
        r.steps += 1
        r.sum_running += num_running
        r.peak_concurrent = max(r.peak_concurrent, num_running)
        r.sum_needed += self.base_sum + step * num_running
        r.sum_reserved += self.backend.reserved_slots()


def simulate_stream(
    requests: Sequence[Request], backend: PagedBackend | ContiguousBackend
) -> StreamResult:
    """Decode-step simulation: arrivals, FCFS admission, one token per running sequence
    per step, preemption when a paged pool runs dry, departure when output is done."""
    sim = _Sim(backend, StreamResult(backend.block_size, backend.pool_blocks))
    pending = deque(sorted(requests, key=lambda r: r.arrival))
    step = 0
    while pending or sim.waiting or sim.running:
        if not sim.running and not sim.waiting:
            step = max(step, pending[0].arrival)
        while pending and pending[0].arrival <= step:
            req = pending.popleft()
            sim.waiting.append((req.rid, req.prompt_len, req.output_len))
        sim.admit(step)
        if not sim.running and sim.waiting and not pending:
            raise RuntimeError(f"request {sim.waiting[0][0]} can never be admitted")
        for run in list(sim.pop_events(step, kind=0)):
            if sim.running.get(run.rid) is run:  # not preempted by an earlier grow
                sim.grow(run, step)
        sim.account(step)
        for run in list(sim.pop_events(step, kind=1)):
            sim.remove(run, run.output_len)
            sim.result.served += 1
            sim.result.makespan = step
        step += 1
    if isinstance(backend, PagedBackend):
        backend.bm.check_integrity()
        assert backend.bm.num_free_blocks() == backend.bm.num_blocks
    return sim.result


def run_workload2(num_requests: int, seed: int = 0) -> dict:
    requests = sharegpt_stream(num_requests, seed)
    sweep = {
        bs: simulate_stream(requests, PagedBackend(POOL_SLOTS, bs)) for bs in SWEEP_BLOCK_SIZES
    }
    return {
        "requests": requests,
        "contiguous": simulate_stream(requests, ContiguousBackend(POOL_SLOTS, MAX_LEN)),
        "paged": sweep[BLOCK_SIZE],
        "sweep": sweep,
    }


# ---------------------------------------------------------------------------- report


def _table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    cells = [list(map(str, headers))] + [list(map(str, row)) for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(
            c.rjust(w) if i else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def report_workload1(w1: dict) -> str:
    c, p = w1["contiguous"], w1["paged"]
    n = len(W1_REQUESTS)
    rows = [
        ("requests served", f"{c.served}/{n}", f"{p.served}/{n}"),
        ("requests rejected", c.rejected, p.rejected),
        ("slots reserved", c.reserved_slots, p.reserved_slots),
        ("slots needed", c.needed_slots, p.needed_slots),
        ("waste", f"{c.waste_pct:.0f}%", f"{p.waste_pct:.0f}%"),
        (f"blocks still free (of {W1_NUM_BLOCKS})", c.free_blocks, p.free_blocks),
    ]
    so, sc, cc = w1["shared_paged_no_cache"], w1["shared_paged_cache"], w1["shared_contiguous"]
    shared_rows = [
        ("slots reserved", cc.reserved_slots, so.reserved_slots, sc.reserved_slots),
        ("slots needed (shared once)", cc.needed_slots, so.needed_slots, sc.needed_slots),
        ("tokens held (sum over users)", cc.tokens_held, so.tokens_held, sc.tokens_held),
        ("waste", *(f"{r.waste_pct:.0f}%" for r in (cc, so, sc))),
        ("prefill tokens computed", cc.prefill_tokens, so.prefill_tokens, sc.prefill_tokens),
        ("blocks still free", cc.free_blocks, so.free_blocks, sc.free_blocks),
    ]
    return "\n".join(
        [
            f"Workload 1: pool {W1_NUM_BLOCKS} blocks x {W1_BLOCK_SIZE} slots, max_len "
            f"{W1_MAX_LEN}; requests (prompt, generated) = "
            + ", ".join(f"{r} ({a}, {b})" for r, a, b in W1_REQUESTS),
            _table(("", "contiguous", "paged"), rows),
            "",
            f"Workload 1b: one {W1_SYSTEM_PROMPT}-token system prompt shared by "
            f"{len(W1_USERS)} users",
            _table(("", "contiguous", "paged, no cache", "paged, prefix cache"), shared_rows),
            f"prefix caching saves {w1['shared_saved_slots']} slots "
            f"({w1['shared_saved_slots'] // W1_BLOCK_SIZE} blocks)",
        ]
    )


def report_workload2(w2: dict) -> str:
    c, p = w2["contiguous"], w2["paged"]
    reqs = w2["requests"]
    mean_prompt = sum(r.prompt_len for r in reqs) / len(reqs)
    mean_output = sum(r.output_len for r in reqs) / len(reqs)
    rows = [
        ("requests served", c.served, p.served),
        ("requests rejected", c.rejected, p.rejected),
        (
            "mean slots reserved",
            f"{c.sum_reserved / c.steps:.0f}",
            f"{p.sum_reserved / p.steps:.0f}",
        ),
        ("mean slots needed", f"{c.sum_needed / c.steps:.0f}", f"{p.sum_needed / p.steps:.0f}"),
        ("waste (time-weighted)", f"{c.waste_pct:.1f}%", f"{p.waste_pct:.1f}%"),
        ("peak concurrent seqs", c.peak_concurrent, p.peak_concurrent),
        ("mean concurrent seqs", f"{c.mean_concurrent:.1f}", f"{p.mean_concurrent:.1f}"),
        ("preemptions", c.preemptions, p.preemptions),
        ("decode steps to finish", c.makespan, p.makespan),
    ]
    sweep_rows = [
        (
            bs,
            r.pool_blocks,
            f"{r.waste_pct:.1f}%",
            f"{r.mean_blocks_per_seq:.1f}",
            r.peak_concurrent,
            f"{r.mean_concurrent:.1f}",
            r.preemptions,
        )
        for bs, r in w2["sweep"].items()
    ]
    return "\n".join(
        [
            f"Workload 2: ShareGPT-like stream, {len(reqs)} requests, mean prompt "
            f"{mean_prompt:.0f}, mean output {mean_output:.0f} (clipped to {MAX_LEN}), "
            f"Poisson arrivals {ARRIVAL_RATE}/step; pool {POOL_SLOTS} slots, block {BLOCK_SIZE}",
            _table(("", "contiguous", "paged"), rows),
            f"paged vs contiguous: peak concurrency x{p.peak_concurrent / c.peak_concurrent:.2f}, "
            f"mean concurrency x{p.mean_concurrent / c.mean_concurrent:.2f}, "
            f"waste x{p.waste_pct / c.waste_pct:.3f}, "
            f"finishes in x{p.makespan / c.makespan:.2f} the steps",
            "",
            "Block-size sweep (paged, same pool and stream): waste vs per-block bookkeeping",
            _table(
                (
                    "block",
                    "pool blocks",
                    "waste",
                    "blocks/seq",
                    "peak seqs",
                    "mean seqs",
                    "preempt",
                ),
                sweep_rows,
            ),
        ]
    )


def report_workload3(w3: dict) -> str:
    c, off, on = w3["contiguous"], w3["paged_no_cache"], w3["paged_cache"]
    rows = [
        ("requests served", c.served, off.served, on.served),
        ("slots reserved", c.reserved_slots, off.reserved_slots, on.reserved_slots),
        ("slots needed (shared once)", c.needed_slots, off.needed_slots, on.needed_slots),
        ("tokens held (sum over seqs)", c.tokens_held, off.tokens_held, on.tokens_held),
        ("waste", *(f"{r.waste_pct:.1f}%" for r in (c, off, on))),
        ("prefill tokens computed", c.prefill_tokens, off.prefill_tokens, on.prefill_tokens),
        ("prefix hit tokens", 0, off.prefix_hit_tokens, on.prefix_hit_tokens),
        ("blocks still free", c.free_blocks, off.free_blocks, on.free_blocks),
    ]
    return "\n".join(
        [
            f"Workload 3: {W3_REQUESTS} requests sharing a {W3_SYSTEM_PROMPT}-token system "
            f"prompt (ShareGPT-like user turns), pool {POOL_SLOTS} slots, block {BLOCK_SIZE}",
            _table(("", "contiguous", "paged, no cache", "paged, prefix cache"), rows),
            f"prefix caching: x{off.reserved_slots / on.reserved_slots:.2f} fewer slots, "
            f"x{off.prefill_tokens / on.prefill_tokens:.2f} fewer prefill tokens; "
            f"paged+cache vs contiguous: x{c.reserved_slots / on.reserved_slots:.2f} fewer slots",
        ]
    )


def _to_json(results: dict) -> dict:
    def convert(value):
        if isinstance(value, (SnapshotResult, StreamResult)):
            out = asdict(value)
            for name in ("waste_pct", "mean_concurrent", "mean_blocks_per_seq"):
                if hasattr(value, name):
                    out[name] = getattr(value, name)
            return out
        if isinstance(value, dict):
            return {str(k): convert(v) for k, v in value.items()}
        return value

    w2 = dict(results["workload2"])
    w2["requests"] = {
        "count": len(w2["requests"]),
        "mean_prompt": sum(r.prompt_len for r in w2["requests"]) / len(w2["requests"]),
        "mean_output": sum(r.output_len for r in w2["requests"]) / len(w2["requests"]),
    }
    return convert({**results, "workload2": w2})


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--requests", type=int, default=2000, help="workload 2 stream length")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.requests < 1:
        parser.error("--requests must be at least 1")

    start = time.perf_counter()
    results = {
        "workload1": run_workload1(args.seed),
        "workload2": run_workload2(args.requests, args.seed),
        "workload3": run_workload3(args.seed),
    }
    print(report_workload1(results["workload1"]), end="\n\n")
    print(report_workload2(results["workload2"]), end="\n\n")
    print(report_workload3(results["workload3"]))
    print(f"\n({time.perf_counter() - start:.1f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_to_json(results), f, indent=2)
    return results


if __name__ == "__main__":
    main()
