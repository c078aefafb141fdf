"""Per-request phase times and prompt-token counts, kept by the engine as plain data.

The engine calls three hooks (all on its own thread): `scheduled` before a step's
forward, `token` for every token appended to a sample, `done` when a request ends
and leaves `engine.requests`. The metrics exporter (common/runtime/metrics.py) reads
`prompt_tokens` at scrape time and drains `finished` after each step into its
histograms; nothing here knows Prometheus.

Phases follow vLLM's request-level metrics (queued -> scheduled -> first token ->
last token), measured on this worker's clock (time.monotonic):

    queue    arrival here -> the first step that computes any of it
    prefill  first step -> first token sampled here
    decode   first token (or, for an imported request, its first step) -> last token
    inference first step -> last token

Decisions:
- A request whose first token came with its KV from a prefill worker (the decode
  role's import) has no prefill phase here (`prefill_s` None); its queue time runs
  until its first step, so it includes the KV pull. A prefill-only request (the
  prefill role hands the sample over after its first token) has no decode phase.
- `prompt_tokens` counts a request's whole prompt, prefix-cache hits included, once,
  when its first token is sampled here (vLLM's `prompt_tokens_total`). An imported
  prompt is not counted again by the decode worker: cluster-wide, each prompt counts
  once, on the worker that prefilled it. The tokens actually computed (hits
  excluded) stay `EngineStats.prefill_tokens`.
- A request that ends before its first step (aborted while waiting or importing)
  leaves no record: it had no phases here.
- `finished` is bounded (oldest dropped) so that an engine without an exporter does
  not grow it forever.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedserve.common.core.scheduler import SchedulerOutput
    from pagedserve.common.core.sequence import Request

MAX_FINISHED = 4096


@dataclass(frozen=True)
class FinishedRequestStats:
    """The phases of one request that ended, in seconds."""

    queue_s: float
    prefill_s: float | None  # None: its first token was imported (decode role)
    decode_s: float | None  # None: handed over after its first token (prefill role), or no token
    inference_s: float
    prompt_tokens: int
    generation_tokens: int


@dataclass
class _Times:
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    imported: bool = False  # the first token arrived before any step here


class RequestStatsLog:
    """What the engine records per request (see the module docstring)."""

    def __init__(self, max_finished: int = MAX_FINISHED) -> None:
        self._times: dict[str, _Times] = {}
        self.finished: deque[FinishedRequestStats] = deque(maxlen=max_finished)
        self.prompt_tokens = 0  # prompts (cached tokens included) prefilled here

    def scheduled(self, sched: SchedulerOutput) -> None:
        """Before a step's forward: stamps the requests it computes for the first time."""
        now = time.monotonic()
        for item in (*sched.prefills, *sched.decodes):
            t = self._times.setdefault(item.seq.request.request_id, _Times())
            if t.scheduled is None:
                t.scheduled = now

    def token(self, req: Request) -> None:
        """A token was appended to one of `req`'s samples (sampled, or imported)."""
        now = time.monotonic()
        t = self._times.setdefault(req.request_id, _Times())
        if t.first_token is None:
            t.first_token = now
            if t.scheduled is None:
                t.imported = True
            else:
                self.prompt_tokens += req.num_prompt_tokens
        t.last_token = now

    def done(self, req: Request) -> None:
        """`req` ended (finished, aborted or failed): records its phases."""
        t = self._times.pop(req.request_id, None)
        if t is None or t.scheduled is None:
            return
        first = t.first_token
        last = t.last_token if t.last_token is not None else t.scheduled
        prefill = None if first is None or t.imported else first - t.scheduled
        decode = None
        if first is not None and not req.prefill_only:
            decode = max(0.0, last - max(first, t.scheduled))
        generated = sum(len(s.output_token_ids) for s in req.seqs)
        self.finished.append(
            FinishedRequestStats(
                queue_s=max(0.0, t.scheduled - req.arrival_time),
                prefill_s=prefill,
                decode_s=decode,
                inference_s=max(0.0, last - t.scheduled),
                prompt_tokens=req.num_prompt_tokens,
                generation_tokens=generated,
            )
        )

    def drain(self) -> Iterable[FinishedRequestStats]:
        """Removes and yields the records so far (call on the engine thread)."""
        while self.finished:
            yield self.finished.popleft()
