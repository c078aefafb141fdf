"""Runs an engine on a thread of its own, for servers whose handlers run on others.

Every engine call happens on the loop thread, so the engine needs no locks:
handlers send commands (closures over the engine) through a queue and read their
request's outputs from a queue of its own. When there is work the loop steps;
otherwise it sleeps on the command queue.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

from pagedserve.common.api.outputs import RequestError, RequestOutput
from pagedserve.common.core.engine import LLMEngine

logger = logging.getLogger(__name__)
T = TypeVar("T")


class EngineFailure(RuntimeError):
    """The engine raised while this request was in flight; the request was aborted."""


class RequestFailed(EngineFailure):
    """This request failed on its own (see `RequestError`); the engine and every other
    request went on. `error.kind` says whether its parameters caused it."""

    def __init__(self, error: RequestError) -> None:
        super().__init__(error.message)
        self.error = error


class EngineBusy(TimeoutError):
    """The engine loop did not run a command in time; see `EngineLoop.call`."""


class _Command:
    """One `EngineLoop.call`: runs on the loop thread unless its caller gave up first.

    States: pending -> running -> done, or abandoned (by the caller, on timeout) before
    or while it runs. The lock makes "the caller gave up" and "the loop started it"
    exclusive, so exactly one of: the caller gets the result, the command is skipped,
    or its result is handed to `on_abandon`.
    """

    def __init__(
        self,
        fn: Callable[[LLMEngine], T],
        on_abandon: Callable[[LLMEngine, T], None] | None,
    ) -> None:
        self.fn = fn
        self.on_abandon = on_abandon
        self.future: Future = Future()
        self._lock = threading.Lock()
        self._state = "pending"

    def run(self, engine: LLMEngine) -> None:
        with self._lock:
            if self._state == "abandoned" and self.on_abandon is not None:
                return  # nobody waits for it, and it would take state: skip it
            started_abandoned = self._state == "abandoned"
            self._state = "running"
        ok, result, error = True, None, None
        try:
            result = self.fn(engine)
        except BaseException as e:  # handed to the caller
            ok, error = False, e
        with self._lock:
            abandoned = started_abandoned or self._state == "abandoned"
            self._state = "done"
            if not abandoned:
                if ok:
                    self.future.set_result(result)
                else:
                    self.future.set_exception(error)
                return
        if ok and self.on_abandon is not None:
            try:
                self.on_abandon(engine, result)
            except Exception:
                logger.exception("undoing an abandoned engine command failed")

    def abandon(self) -> bool:
        """The caller gives up; False when the result is already there."""
        with self._lock:
            if self._state == "done":
                return False
            self._state = "abandoned"
            return True


class RequestStream:
    """The outputs of one request, in order; ends after the output with finished=True."""

    def __init__(self, request_id: str, loop: EngineLoop) -> None:
        self.request_id = request_id
        self._loop = loop
        self._queue: queue.Queue[RequestOutput | BaseException] = queue.Queue()
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put(item)

    def get(self, timeout: float | None = None) -> RequestOutput:
        """Next output; raises queue.Empty on timeout, RequestFailed if the request failed
        alone (its last output's deltas are dropped: the caller reports the error),
        EngineFailure if the engine failed under every request."""
        item = self._queue.get(timeout=timeout)
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.error is not None:
            self.finished = True
            raise RequestFailed(item.error)
        if item.finished:
            self.finished = True
        return item

    def __iter__(self) -> Iterator[RequestOutput]:
        while not self.finished:
            yield self.get()

    def cancel(self) -> None:
        """Aborts the request unless it already finished; its blocks return at once."""
        if not self.finished:
            self._loop.abort(self.request_id)


class EngineLoop:
    def __init__(self, engine: LLMEngine, name: str = "engine-loop") -> None:
        self.engine = engine
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.step_hooks: list[Callable[[LLMEngine], None]] = []  # run after every step
        # Tests' fault injection (kvtransfer/faults.py fault_step, wired by the worker
        # runtime): called after every step that ran requests; it may sleep (a slow
        # engine) or return `released()`: until that is True the loop steps nothing but
        # still runs commands, so a request in flight stays in flight and can be read,
        # aborted or timed out meanwhile.
        self.step_gate: Callable[[], Callable[[], bool] | None] | None = None
        self._held: Callable[[], bool] | None = None

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._commands.put(lambda: None)
        self._thread.join(timeout)

    # -- called from any thread ---------------------------------------------------

    def call(
        self,
        fn: Callable[[LLMEngine], T],
        timeout: float | None = 30.0,
        *,
        on_abandon: Callable[[LLMEngine, T], None] | None = None,
    ) -> T:
        """Runs fn(engine) on the loop thread and returns its result (or raises its error).

        Raises EngineBusy when `timeout` passes first. The loop cannot be interrupted,
        so a command may still be queued or running then. A command that takes state
        (a request, held or importing blocks, a pin) passes `on_abandon`: it then
        either never runs (the caller gave up before it started) or, if it was already
        running, `on_abandon(engine, its result)` undoes it on the loop thread right
        after, so nothing it took outlives a caller that is gone. Without `on_abandon`
        the command runs anyway: fine for reads, and wanted for releases.
        """
        cmd = _Command(fn, on_abandon)
        self._commands.put(lambda: cmd.run(self.engine))
        try:
            return cmd.future.result(timeout)
        except FutureTimeout:
            if cmd.abandon():
                raise EngineBusy(
                    f"the engine did not run the command within {timeout} s (overloaded or stuck)"
                ) from None
            return cmd.future.result()  # it finished just as we gave up

    def submit(
        self,
        request_id: str,
        add: Callable[[LLMEngine], object],
        *,
        timeout: float | None = 30.0,
        undo: Callable[[LLMEngine], object] | None = None,
    ) -> RequestStream:
        """Runs add(engine) (which must add `request_id`) and returns the request's stream.

        Errors from `add` (InvalidRequestError, say) are raised here, in the caller;
        EngineBusy after `timeout`, and then the request is never added, or is undone
        at once: `undo(engine)` (default: abort it; an import passes cancel_import).
        """
        stream = RequestStream(request_id, self)

        def register(engine: LLMEngine) -> None:
            add(engine)
            self._streams[request_id] = stream

        def abandoned(engine: LLMEngine, _result: None) -> None:
            self._streams.pop(request_id, None)
            if undo is not None:
                undo(engine)
            else:
                engine.abort_request(request_id)

        self.call(register, timeout, on_abandon=abandoned)
        return stream

    def post(self, fn: Callable[[LLMEngine], object]) -> None:
        """Runs fn(engine) on the loop thread soon, without waiting (any thread, the loop
        thread included: a step hook may post). For releases that must not block their
        caller, e.g. a KV lease ending on a gRPC thread or in a step hook; errors are
        logged. Commands run in the order they were queued."""

        def run() -> None:
            try:
                fn(self.engine)
            except Exception:
                logger.exception("posted engine command failed")

        self._commands.put(run)

    def abort(self, request_id: str) -> None:
        def run() -> None:
            out = self.engine.abort_request(request_id)
            stream = self._streams.pop(request_id, None)
            if stream is not None and out is not None:
                stream.put(out)

        self._commands.put(run)

    # -- the loop thread ------------------------------------------------------------

    def _drain_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.05 if block else 0)
        except queue.Empty:
            return
        while True:
            cmd()
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        idle = True
        while not self._stop.is_set():
            self._drain_commands(block=idle or not self.engine.has_unfinished_requests())
            if not self.engine.has_unfinished_requests():
                idle = True
                self._after_step()
                continue
            if self._held is not None:
                if not self._held():
                    idle = True  # commands only, polled every 50 ms (as an idle loop)
                    self._after_step()
                    continue
                self._held = None
            try:
                outputs = self.engine.step()
            except Exception as e:
                # A per-request fault never gets here (the engine ends that request alone,
                # with RequestOutput.error): this is the scheduler or the model forward
                # failing under the whole batch. Fail what is in flight, keep serving.
                logger.exception("engine step failed; aborting %d requests", len(self._streams))
                self._fail_all(e)
                continue
            # Nothing was runnable (requests waiting on a KV import, say): wait for a command.
            idle = self.engine.last_step_was_empty
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue
                stream.put(out)
                if out.finished:
                    del self._streams[out.request_id]
            if self.step_gate is not None and not idle:
                self._held = self.step_gate()
            self._after_step()

    def _after_step(self) -> None:
        for hook in self.step_hooks:
            try:
                hook(self.engine)
            except Exception:
                logger.exception("step hook failed")

    def _fail_all(self, error: Exception) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort_request(request_id)
            stream.put(EngineFailure(f"engine step failed: {error}"))
        self._streams.clear()
