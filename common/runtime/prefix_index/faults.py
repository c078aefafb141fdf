"""Small tools for the loops that talk to an index backend: retry backoff, quiet logs.

Standard library only (the engine core's publisher uses them without Redis).

Decisions
---------
- A retry delay is measured from the *end* of the failed call: a call that hung for
  its whole socket timeout is not retried at once because its start was long ago.
- Delays grow exponentially from ``base_s`` up to ``cap_s`` and are jittered into
  ``[delay / 2, delay]`` ("equal jitter"), so workers that lost Redis together do not
  come back in lockstep; never shorter than half the nominal delay.
- A loop that fails on every turn logs the first failure of each kind at once, then at
  most one line per ``every_s`` per kind with the number of failures held back.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable


class Backoff:
    """Exponential retry delay with a cap and jitter, measured from the end of a call.

    Usage: ``if backoff.ready(): ok = call(); backoff.succeeded() if ok else backoff.failed()``.
    """

    def __init__(
        self,
        base_s: float,
        cap_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: Callable[[], float] = random.random,
    ) -> None:
        if not base_s > 0 or not cap_s >= base_s:
            raise ValueError(f"need 0 < base_s <= cap_s, got {base_s!r} and {cap_s!r}")
        self.base_s = base_s
        self.cap_s = cap_s
        self.clock = clock
        self.rng = rng
        self.failures = 0  # consecutive failed calls
        self.retry_at = float("-inf")  # clock time before which no call is due

    def ready(self) -> bool:
        return self.clock() >= self.retry_at

    def delay(self) -> float:
        """Seconds until a call is due (0 when it is)."""
        return max(0.0, self.retry_at - self.clock())

    def failed(self) -> float:
        """Record a failed call that has just returned; returns the delay chosen."""
        self.failures += 1
        nominal = min(self.cap_s, self.base_s * 2 ** min(self.failures - 1, 32))
        delay = nominal * (0.5 + 0.5 * self.rng())
        self.retry_at = self.clock() + delay
        return delay

    def succeeded(self) -> None:
        self.failures = 0
        self.retry_at = float("-inf")


class LogLimiter:
    """Logs each kind of message at most once per ``every_s`` seconds."""

    def __init__(
        self,
        logger: logging.Logger,
        every_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.every_s = every_s
        self.clock = clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def log(self, level: int, kind: str, msg: str, *args: object, exc_info: bool = False) -> bool:
        """Log ``msg % args`` unless a ``kind`` line went out less than ``every_s`` ago.

        Returns whether it was logged. A line logged after others were held back says
        how many.
        """
        now = self.clock()
        last = self._last.get(kind)
        if last is not None and now - last < self.every_s:
            self._held[kind] = self._held.get(kind, 0) + 1
            return False
        held = self._held.pop(kind, 0)
        if held:
            msg += f" ({held} more like it in the last {now - last:.0f} s)"  # type: ignore[operator]
        self._last[kind] = now
        self.logger.log(level, msg, *args, exc_info=exc_info)
        return True

    def reset(self, kind: str) -> None:
        """Forget ``kind`` (its condition cleared): its next line is logged at once."""
        self._last.pop(kind, None)
        self._held.pop(kind, None)
