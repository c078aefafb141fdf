"""A fault-injection switch for tests: off unless configured, seeded, reproducible.

Configured from the environment of a worker process (a Ray actor gets it through its
runtime_env), read once at import:

    PAGEDSERVE_FAULTS="drop_chunk=0.1,delay_chunk_ms=200,delay_rpc=Decode:500,seed=3"

or, in-process, by `install(FaultInjector(FaultSpec(...)))` (what tests with several
workers in one process do; `only=` then picks one worker by id or address).

It is consulted at three points, each a one-line hook:
- `fault_chunk(message, where)`: every framed KV chunk a KVTransfer.PullBlocks
  stream sends (kvtransfer/source.py), `where` = the exporter's transfer address. It
  may drop the chunk (the puller sees a short stream), corrupt one payload byte (a
  checksum mismatch), truncate it (a malformed message) or delay it.
- `fault_point("Prefill" | "Decode", worker_id, address)`: the entry of a worker's
  Prefill / Decode RPC (prefill_worker/, decode_worker/servicer.py);
- `fault_point("Decode.step", worker_id, address)`: before each DecodeStep a Decode
  stream yields.
- `fault_step(worker_id, address)`: after each engine step that ran requests, once
  its outputs went to their streams (common/core/engine_loop.py, wired per worker in
  common/runtime/worker.py). `delay_rpc=Engine.step:MS` makes every step that much
  slower (the test suite's slow mode, README "Development"). A gate on ENGINE_STEP
  (`skip=n-1`: after the n-th step) holds the engine *without blocking its loop*: it
  keeps running commands (reads, aborts, new requests) but steps nothing until
  `release()`. A request in flight there stays in flight, whatever the machine's speed.

Besides delays, a test can hold a point with a `Gate` (`injector.pause(point)`):
the first thread that reaches it (after `skip` others passed) blocks until
`release()`, and the test learns which worker it was (`gate.where`). A held thread
gives up after `max_hold_s`, so a forgotten gate cannot hang a worker for good.

Decisions are drawn from one `random.Random(seed)` under a lock, in the order the
chunks pass: the same spec and the same traffic give the same faults. This module
imports nothing from the roles (it sits in kvtransfer/, which knows no role).
"""

from __future__ import annotations

import collections
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

ENV = "PAGEDSERVE_FAULTS"
CHUNK = "chunk"  # the point name of the chunk hook (for pause())
ENGINE_STEP = "Engine.step"  # the point name of the engine-step hook
_PROBABILITIES = ("drop_chunk", "corrupt_chunk", "truncate_chunk")


@dataclass(frozen=True)
class FaultSpec:
    """What to inject. Probabilities are per chunk, in [0, 1]; delays in ms."""

    drop_chunk: float = 0.0
    corrupt_chunk: float = 0.0
    truncate_chunk: float = 0.0
    delay_chunk_ms: float = 0.0
    delay_rpc: dict[str, float] = field(default_factory=dict)  # point -> ms
    only: str | None = None  # a worker id or transfer address; None = every worker
    seed: int = 0

    def __post_init__(self) -> None:
        for name in _PROBABILITIES:
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        delays = [self.delay_chunk_ms, *self.delay_rpc.values()]
        if any(d < 0 for d in delays):
            raise ValueError(f"delays must be >= 0 ms, got {delays}")

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        """`key=value` pairs separated by commas; `delay_rpc=POINT:MS` may repeat.

        Raises ValueError naming the bad item."""
        values: dict[str, object] = {}
        delays: dict[str, float] = {}
        for item in filter(None, (s.strip() for s in text.split(","))):
            key, sep, value = item.partition("=")
            try:
                if not sep:
                    raise ValueError("expected key=value")
                if key == "delay_rpc":
                    point, _, ms = value.partition(":")
                    delays[point] = float(ms)
                elif key in (*_PROBABILITIES, "delay_chunk_ms"):
                    values[key] = float(value)
                elif key == "seed":
                    values[key] = int(value)
                elif key == "only":
                    values[key] = value
                else:
                    raise ValueError(f"unknown key {key!r}")
            except ValueError as e:
                raise ValueError(f"{ENV}: bad item {item!r}: {e}") from None
        return cls(delay_rpc=delays, **values)  # type: ignore[arg-type]

    def applies(self, where: tuple[str, ...]) -> bool:
        return self.only is None or self.only in where


class Gate:
    """Holds the first thread reaching `point` (after `skip` passed) until `release()`."""

    def __init__(self, point: str, only: str | None, skip: int, max_hold_s: float) -> None:
        self.point = point
        self.only = only
        self.skip = skip
        self.max_hold_s = max_hold_s
        self.reached = threading.Event()
        self.where: tuple[str, ...] = ()  # the names of the worker that reached it
        self._open = threading.Event()

    def wait(self, timeout: float = 10.0) -> tuple[str, ...]:
        """Until a thread is held here; returns its worker's names. AssertionError on timeout."""
        if not self.reached.wait(timeout):
            raise AssertionError(f"nothing reached {self.point!r} within {timeout} s")
        return self.where

    def release(self) -> None:
        self._open.set()

    def _hold(self, where: tuple[str, ...]) -> None:
        self.where = where
        self.reached.set()
        if not self._open.wait(self.max_hold_s):
            logger.warning("fault gate at %s held %.0f s: released", self.point, self.max_hold_s)

    def _hold_later(self, where: tuple[str, ...]) -> Callable[[], bool]:
        """Marks the gate reached; returns `released()` for a caller that polls it
        instead of blocking (the engine loop). After `max_hold_s` it reads True."""
        self.where = where
        self.reached.set()
        end = time.monotonic() + self.max_hold_s

        def released() -> bool:
            if self._open.is_set():
                return True
            if time.monotonic() < end:
                return False
            logger.warning("fault gate at %s held %.0f s: released", self.point, self.max_hold_s)
            self._open.set()
            return True

        return released


class FaultInjector:
    """Applies a FaultSpec at the hook points, plus the gates tests set."""

    def __init__(self, spec: FaultSpec | None = None, max_hold_s: float = 60.0) -> None:
        self.spec = spec or FaultSpec()
        self.max_hold_s = max_hold_s
        self.counts: collections.Counter[str] = collections.Counter()
        self._rng = random.Random(self.spec.seed)
        self._lock = threading.Lock()
        self._gates: list[Gate] = []

    def pause(self, point: str, only: str | None = None, skip: int = 0) -> Gate:
        """A gate on `point` ("Prefill", "Decode", "Decode.step", CHUNK or ENGINE_STEP)."""
        gate = Gate(point, only, skip, self.max_hold_s)
        with self._lock:
            self._gates.append(gate)
        return gate

    def withdraw(self, gate: Gate) -> None:
        """Releases `gate`, and takes it off its point if nothing reached it yet."""
        with self._lock:
            if gate in self._gates:
                self._gates.remove(gate)
        gate.release()

    def release_all(self) -> None:
        with self._lock:
            gates, self._gates = self._gates, []
        for g in gates:
            g.release()

    def point(self, point: str, where: tuple[str, ...]) -> None:
        """An RPC or step hook: delay per the spec, then wait at a gate set on it."""
        ms = self.spec.delay_rpc.get(point, 0.0) if self.spec.applies(where) else 0.0
        if ms:
            self.counts[f"delay:{point}"] += 1
            time.sleep(ms / 1000)
        gate = self._take_gate(point, where)
        if gate is not None:
            gate._hold(where)

    def step(self, where: tuple[str, ...]) -> Callable[[], bool] | None:
        """The engine-step hook: delay per the spec; a gate set on ENGINE_STEP is
        returned as `released()`, for the loop to poll (it must not block)."""
        ms = self.spec.delay_rpc.get(ENGINE_STEP, 0.0) if self.spec.applies(where) else 0.0
        if ms:
            time.sleep(ms / 1000)  # no counter: a step hook runs often, and unlocked
        gate = self._take_gate(ENGINE_STEP, where)
        return None if gate is None else gate._hold_later(where)

    def chunk(self, message: bytes, where: tuple[str, ...]) -> tuple[bytes, ...]:
        """The messages to send in place of one framed chunk (none: dropped)."""
        gate = self._take_gate(CHUNK, where)
        if gate is not None:
            gate._hold(where)
        spec = self.spec
        if not spec.applies(where):
            return (message,)
        with self._lock:
            draws = {name: self._rng.random() < getattr(spec, name) for name in _PROBABILITIES}
            self.counts["chunks"] += 1
        if spec.delay_chunk_ms:
            time.sleep(spec.delay_chunk_ms / 1000)
        if draws["drop_chunk"]:
            self.counts["drop_chunk"] += 1
            return ()
        if draws["corrupt_chunk"]:
            self.counts["corrupt_chunk"] += 1
            corrupted = bytearray(message)
            corrupted[-1] ^= 0xFF  # the last payload byte: framing intact, checksum not
            message = bytes(corrupted)
        if draws["truncate_chunk"]:
            self.counts["truncate_chunk"] += 1
            message = message[: len(message) // 2]
        return (message,)

    def _take_gate(self, point: str, where: tuple[str, ...]) -> Gate | None:
        with self._lock:
            for g in self._gates:
                if g.point == point and (g.only is None or g.only in where):
                    if g.skip > 0:
                        g.skip -= 1
                        return None
                    self._gates.remove(g)
                    return g
        return None


def _from_env() -> FaultInjector | None:
    text = os.environ.get(ENV, "").strip()
    if not text:
        return None
    injector = FaultInjector(FaultSpec.parse(text))
    logger.warning("fault injection is ON (%s=%r)", ENV, text)
    return injector


_active: FaultInjector | None = _from_env()


def active() -> FaultInjector | None:
    return _active


def install(injector: FaultInjector | None) -> FaultInjector | None:
    """Makes `injector` the process's (None = off); returns the previous one."""
    global _active
    previous, _active = _active, injector
    return previous


def fault_point(point: str, *where: str) -> None:
    """Hook at an RPC entry or a stream step; a no-op unless an injector is installed."""
    if _active is not None:
        _active.point(point, where)


def fault_step(*where: str) -> Callable[[], bool] | None:
    """Hook after an engine step: None to go on, or `released()`: step again once it is
    True, running commands meanwhile (EngineLoop.step_gate). A no-op unless installed."""
    if _active is None:
        return None
    return _active.step(where)


def fault_chunk(message: bytes, *where: str) -> tuple[bytes, ...]:
    """Hook on a sent KV chunk: `yield from fault_chunk(message, address)`."""
    if _active is None:
        return (message,)
    return _active.chunk(message, where)
