"""Which KV exporters a worker trusts: the addresses it pulls KV handles from.

A KV handle names the address to pull from, and whoever can reach the worker writes
it; a worker pulls only from (kvtransfer/validate.py asks `trusts`):

- its own address;
- the registered, live workers of its model, as the router's Registry answered the
  latest heartbeat (`HeartbeatResponse.peers`, which covers workers the router knows
  from Redis too). The latest list replaces the previous one; when a heartbeat
  fails the last list is kept (the router may be restarting; its workers have not
  changed for that);
- `WorkerConfig.trusted_peers`, configured addresses;
- the other worker runtimes of this very process serving the same model (they share
  this process's memory: nothing is gained by distrusting them). This is what lets
  workers built without a registry (tests, one process) hand KV to each other.

A worker without a registry (standalone) has only the last three: a handle from any
other address is refused.

An address missing from the list may belong to a worker that registered after this
worker's last heartbeat (the router routes to it at once): `trusts` then asks the
heartbeat thread for a beat now and waits for its answer (`refresh_timeout_s` at
most) before refusing. Requests coalesce: every caller waiting when a beat starts is
answered by it, and beats on demand are at least `MIN_BEAT_GAP_S` apart, so a flood of
forged handles costs the router at most one heartbeat per gap. The other way round,
a peer that left stays trusted until this worker's next beat (at most the heartbeat
interval, or the next beat on demand): it was a registered worker of the model a
moment ago, and what it exported then is what the router handed over.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

MIN_BEAT_GAP_S = 0.05

# address -> model id of every runtime of this process that is serving (see above).
_IN_PROCESS: dict[str, str] = {}
_IN_PROCESS_LOCK = threading.Lock()


class TrustedPeers:
    """The addresses one worker pulls KV from, and the on-demand beats that refresh them."""

    def __init__(
        self,
        own_address: str,
        model: str,
        configured: Iterable[str] = (),
        *,
        has_registry: bool,
        refresh_timeout_s: float = 2.0,
    ) -> None:
        self.own_address = own_address
        self.model = model
        self.configured = frozenset(configured)
        self.has_registry = has_registry
        self.refresh_timeout_s = refresh_timeout_s
        self._live: frozenset[str] = frozenset()
        self._cond = threading.Condition()
        self._started = 0  # heartbeats begun
        self._finished = 0  # heartbeats ended (answered or failed); beats are sequential
        self._wanted = False  # a caller waits for a beat
        self._last_end = float("-inf")

    # -- what is trusted -------------------------------------------------------------

    @property
    def live(self) -> frozenset[str]:
        """Transfer addresses of the registry's latest answer."""
        return self._live

    def set_live(self, addresses: Iterable[str]) -> None:
        """The registry's latest list of live peers (replaces the previous one)."""
        self._live = frozenset(a for a in addresses if a)

    def trusted_now(self, address: str) -> bool:
        """Whether `address` is trusted, from what is known now (never waits)."""
        if address == self.own_address or address in self.configured or address in self._live:
            return True
        with _IN_PROCESS_LOCK:
            return _IN_PROCESS.get(address) == self.model

    def trusts(self, address: str) -> bool:
        """`trusted_now`, else (with a registry) after one fresh heartbeat's answer."""
        if self.trusted_now(address):
            return True
        if not self.has_registry or not self._wait_fresh_beat():
            return False
        return self.trusted_now(address)

    # -- in-process runtimes ---------------------------------------------------------

    def serving(self) -> None:
        """This worker is serving: the runtimes of this process trust its address."""
        with _IN_PROCESS_LOCK:
            _IN_PROCESS[self.own_address] = self.model

    def stopped(self) -> None:
        with _IN_PROCESS_LOCK:
            if _IN_PROCESS.get(self.own_address) == self.model:
                del _IN_PROCESS[self.own_address]

    # -- beats on demand -------------------------------------------------------------

    def _wait_fresh_beat(self) -> bool:
        """Asks for a beat and waits until one that began after this call ended."""
        deadline = time.monotonic() + self.refresh_timeout_s
        with self._cond:
            target = self._started + 1
            self._wanted = True
            self._cond.notify_all()
            while self._finished < target:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def wait_next_beat(self, interval_s: float, stop: threading.Event) -> None:
        """The heartbeat thread, between beats: returns after `interval_s`, at once when
        a caller wants a beat (no sooner than MIN_BEAT_GAP_S after the last), or soon
        after `stop` is set (checked every 0.1 s)."""
        due = time.monotonic() + interval_s
        with self._cond:
            while not stop.is_set():
                now = time.monotonic()
                if self._wanted:
                    due = min(due, self._last_end + MIN_BEAT_GAP_S)
                if now >= due:
                    return
                self._cond.wait(min(due - now, 0.1))

    def beat_started(self) -> None:
        with self._cond:
            self._started += 1
            self._wanted = False

    def beat_finished(self) -> None:
        with self._cond:
            self._finished += 1
            self._last_end = time.monotonic()
            self._cond.notify_all()
