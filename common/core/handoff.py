"""The prefill/decode KV hand-off: the one interface the servicers drive.

Two sides, one phase per engine trip:

- `KVHandoff` lives on the engine thread (`engine.handoff`; the engine owns it and
  calls `hold` / `drop` / `release_held`). It keeps the hand-off's state:
  `held` (prefill role: samples whose first token is sampled and whose blocks stay
  until exported), `importing` (decode role: samples whose blocks are allocated
  while their K/V is written), `pinned` (pins: a sequence that only keeps blocks
  alive while another thread copies out of or writes into them).
- `HandoffCalls` is what a servicer's handler thread holds: each method is exactly
  one trip to the engine thread (`EngineLoop.call` / `submit`), and every method
  that takes state carries its own undo for a caller that gave up waiting
  (`on_abandon`), so no servicer has to remember it.

The phases:

    prefill role     submit (prefill_only) -> first tokens -> export_begin -> copy -> export_end
    decode role      reserve_import -> pull -> commit_import | cancel_import
    prefix export    export_prefix_begin -> copy -> unpin

An export *in place* (kvtransfer/source.py: the prefill worker's cache is in shared
memory and the decode side reads the blocks where they are) does not copy at export:
its blocks stay pinned until the lease ends. `export_begin(request_id, lease_pin)`
then also pins them under the lease's own pin (`lease_pin_id`), taken before the lease
exists so that no end of the lease can come before it; `export_end(request_id,
unpin=lease_pin)` drops it at once when the export was staged after all, and the
lease's end (release, expiry, close: KVSource's `on_end`) drops it otherwise, through
`HandoffCalls.unpin_later` (EngineLoop.post: the end may come on a gRPC thread or in
the engine's own step hook). A prefix export keeps its pin the same way.
    prefix import    reserve_prefix_import -> pull -> commit_prefix_import | unpin

The guarantee every phase keeps: blocks another thread copies (export) or writes
(import) are pinned from the `begin`/`reserve` to the `end`/`commit`/`cancel`; an
abort meanwhile (cancel, deadline, Abort RPC, a failed step) ends the request's
samples at once, but the pin keeps the blocks from being handed to another sequence
until the copy or the write is over.

The engine and this module are one component split in two files: `KVHandoff` uses
the engine's private helpers (`_admit`, `_new_sequence`, `_append_token`) so that a
request is admitted, and its first tokens are checked, exactly as `add_request` and
`step` do it.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import torch

from pagedserve.common.api.outputs import FinishReason, TokenLogprobs
from pagedserve.common.api.sampling_params import InvalidRequestError, SamplingParams
from pagedserve.common.core.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from pagedserve.common.core.engine import LLMEngine
    from pagedserve.common.core.engine_loop import EngineLoop, RequestStream

T = TypeVar("T")


def import_pin_id(request_id: str) -> str:
    """The pin holding an imported request's blocks while its K/V is written."""
    return f"{request_id}#import"


def export_pin_id(request_id: str) -> str:
    """The pin holding a held request's blocks while they are copied out."""
    return f"{request_id}#export"


def lease_pin_id(lease_id: str) -> str:
    """The pin holding an in-place lease's blocks until the lease ends."""
    return f"lease#{lease_id}"


@dataclass(frozen=True)
class ExportPlan:
    """What to copy out (see `KVHandoff.export_begin`); the blocks are pinned until its end."""

    block_ids: list[int]  # this engine's blocks holding the K/V, in block-table order
    block_hashes: list[bytes]  # prefix-cache hashes of the full blocks (request exports)
    num_tokens: int  # tokens with K/V in those blocks
    generator_states: dict[int, bytes]  # sample index -> its seeded generator's state


@dataclass(frozen=True)
class HandedOver:
    """What the prefill role hands the decode role besides the K/V, by sample index."""

    first_tokens: dict[int, int]  # every sample's first token, sampled by the prefill role
    first_logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)
    generator_states: dict[int, bytes] = field(default_factory=dict)  # seeded samples
    cached_tokens: int = 0  # prompt tokens the prefill role found cached (usage)


@dataclass(frozen=True)
class ImportPlan:
    """Where imported K/V must be written (see `KVHandoff.reserve_import`)."""

    block_ids: list[int]  # this engine's blocks to fill, in block-table order
    first_block: int  # index of block_ids[0] in the prompt's block table
    local_hit_tokens: int  # prompt tokens found in this engine's own prefix cache
    recompute: bool  # no room now: the prompt will be prefilled here instead


class KVHandoff:
    """The hand-off's state and its phases, on the engine thread (see the module doc)."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self._bm = engine.block_manager
        self.held: dict[str, list[Sequence]] = {}
        self.importing: dict[str, list[Sequence]] = {}
        self.pinned: set[str] = set()

    # -- for the engine ----------------------------------------------------------------

    def hold(self, seq: Sequence) -> None:
        """Prefill role: the sample continues elsewhere; keep its blocks until exported."""
        self._engine.scheduler.hold(seq)
        self.held.setdefault(seq.request.request_id, []).append(seq)

    def release_held(self, request_id: str) -> int:
        """Frees the blocks a prefill-only request kept; returns how many sequences."""
        seqs = self.held.pop(request_id, [])
        for seq in seqs:
            self._bm.free(seq.seq_id)
        return len(seqs)

    def drop(self, request_id: str) -> None:
        """The request is aborted: its held and importing samples end now. Pins stay,
        for their copier or writer to end (`export_end`, `commit_import`, ...)."""
        self.release_held(request_id)
        for seq in self.importing.pop(request_id, []):
            self._bm.free(seq.seq_id)
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = FinishReason.ABORT

    def check_new_id(self, request_id: str) -> None:
        """InvalidRequestError unless nothing of a request by this id is left here: held
        samples, or the pin of a copy or a write still running after it was aborted
        (a new request by that id would take, and its end release, that same pin)."""
        if request_id in self.held:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight")
        for pin, what in ((export_pin_id, "exported"), (import_pin_id, "imported")):
            if pin(request_id) in self.pinned:
                raise InvalidRequestError(
                    f"request id {request_id!r} is still being {what} (an earlier request by "
                    f"that id was aborted while its KV was copied): retry shortly"
                )

    def is_idle(self) -> bool:
        return not (self.held or self.importing or self.pinned)

    # -- the prefill role: export a held request's prompt K/V --------------------------

    def export_begin(self, request_id: str, lease_pin: str | None = None) -> ExportPlan | None:
        """Pins the held request's prompt blocks for the copy; None if nothing is held
        (every sample ended on its first token, or the request was aborted).

        An abort during the copy releases the held samples, but the pin keeps the blocks
        from being reused, and overwritten, until `export_end`. `lease_pin`: pin them
        under that id too, for an in-place export (the module docstring)."""
        seqs = self.held.get(request_id)
        if not seqs:
            return None
        seq = seqs[0]
        n = seq.num_computed_tokens
        table = self._bm.block_table(seq.seq_id)[: -(-n // self._bm.block_size)]
        hashes = self._bm.seq_block_hashes(seq.seq_id)
        for pin in (export_pin_id(request_id), lease_pin):
            if pin is not None:
                self._bm.fork(seq.seq_id, pin)
                self.pinned.add(pin)
        states = {s.index: generator_state(s.generator) for s in seqs if s.generator}
        return ExportPlan(table, hashes, n, states)

    def export_end(self, request_id: str, unpin: str | None = None) -> int:
        """The copy is over (or never happened): the held samples and the pin end, and
        pin `unpin` if given (a lease pin whose export was staged, or failed).
        Idempotent; returns how many held samples were released."""
        released = self.release_held(request_id)
        self.unpin(export_pin_id(request_id))
        if unpin is not None:
            self.unpin(unpin)
        return released

    # -- prefix export: pin a cached prefix while it is copied out ---------------------

    def export_prefix_begin(
        self, pin_id: str, token_ids: Seq[int], cache_salt: str | None
    ) -> ExportPlan | None:
        """Pins the longest cached chain of full blocks of token_ids; None if none is
        cached. End it with `unpin(pin_id)`."""
        if not self._bm.acquire_cached_prefix(pin_id, token_ids, cache_salt):
            return None
        self.pinned.add(pin_id)
        table = self._bm.block_table(pin_id)
        return ExportPlan(table, [], len(table) * self._bm.block_size, {})

    def unpin(self, pin_id: str) -> None:
        """Ends a pin (idempotent): its blocks return, cached where they were computed."""
        if pin_id in self.pinned:
            self.pinned.discard(pin_id)
            self._bm.free(pin_id)

    # -- the decode role: continue a request whose prompt K/V was computed elsewhere ----

    def reserve_import(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        handed: HandedOver,
        cache_salt: str | None = None,
    ) -> ImportPlan:
        """Starts a request whose prompt K/V was computed by the prefill role.

        Admitted (validated, refused when the queue is full) as `add_request` does.
        handed.first_tokens maps every sample index to the first token the prefill
        role sampled; they are reported (and checked for EOS/stop/length) as this engine's
        own first output. The prompt's blocks are allocated, local prefix hits first;
        the caller writes the K/V of `plan.block_ids` (the rest of the block table
        from `plan.first_block` on), then calls `commit_import`, or `cancel_import`.
        When the pool cannot hold the prompt now, the samples wait to be prefilled
        here instead (plan.recompute) and nothing needs importing.
        """
        eng = self._engine
        ids = list(prompt_token_ids)
        pin = import_pin_id(request_id)
        req = eng._admit(request_id, ids, params, cache_salt, forked=True)  # not yet in
        first_tokens = handed.first_tokens
        if sorted(first_tokens) != list(range(params.n)):
            raise InvalidRequestError(
                f"an imported request needs the first token of each of its n={params.n} samples"
            )
        req.num_cached_tokens = handed.cached_tokens
        seqs = [eng._new_sequence(req, i, list(ids)) for i in range(params.n)]
        for seq in seqs:
            state = handed.generator_states.get(seq.index)
            if state is not None and seq.generator is not None:
                set_generator_state(seq.generator, state, seq.index)
        eng._register(req, report_now=True)  # the first tokens go out with the next step
        if not self._bm.can_allocate(ids, cache_salt):
            for seq in seqs:
                eng._append_token(seq, first_tokens[seq.index], None)
                if not seq.is_finished:
                    eng.scheduler.add(seq)
            return ImportPlan([], 0, 0, recompute=True)
        # The blocks are allocated under a pin that only the writer's commit_import or
        # cancel_import releases, and each sample forks from it. The writer fills them
        # from another thread: an abort meanwhile (client cancel, deadline, Abort RPC,
        # a failed step) frees the samples, but the blocks stay pinned until the writer
        # is done, so they are never handed to another sequence while being written.
        local = self._bm.allocate(pin, ids, cache_salt)
        self.pinned.add(pin)
        for seq in seqs:
            self._bm.fork(pin, seq.seq_id)
        first = local // self._bm.block_size
        plan = ImportPlan(self._bm.block_table(pin)[first:], first, local, recompute=False)
        for seq in seqs:  # may finish (and free) samples whose first token ends them
            lp = handed.first_logprobs.get(seq.index)
            eng._append_token(seq, first_tokens[seq.index], lp)
        live = [s for s in seqs if not s.is_finished]
        if not live:
            self.unpin(pin)  # nothing will be written
            return ImportPlan([], 0, local, recompute=False)
        self.importing[request_id] = live
        return plan

    def commit_import(self, request_id: str) -> None:
        """The imported K/V is in place: the samples join the running batch.

        A request aborted during its import has no samples left: its blocks, never
        marked computed (so never cached), return to the pool with the pin.
        """
        for seq in self.importing.pop(request_id, []):
            seq.num_computed_tokens = seq.num_prompt_tokens
            self._bm.mark_computed(seq.seq_id, seq.num_prompt_tokens)
            self._engine.scheduler.add_running(seq)
        self.unpin(import_pin_id(request_id))

    def cancel_import(self, request_id: str, recompute: bool) -> None:
        """The import failed or was abandoned: recompute the prompt here, or drop the request.

        Also ends the writer's pin (see reserve_import): call it only once nothing
        writes into the plan's blocks any more.
        """
        for seq in self.importing.pop(request_id, []):
            self._bm.free(seq.seq_id)
            if recompute:
                seq.num_computed_tokens = 0
                self._engine.scheduler.add(seq)
        self.unpin(import_pin_id(request_id))
        if not recompute:
            self._engine.abort_request(request_id)

    # -- prefix import: write a prefix into this engine's prefix cache -----------------

    def reserve_prefix_import(
        self, pin_id: str, prefix_token_ids: Seq[int], cache_salt: str | None
    ) -> ImportPlan:
        """Allocates blocks for a prefix's full blocks (local hits first) to import into,
        so that the request that needs them, arriving next, hits them.

        Then write plan.block_ids and call `commit_prefix_import` (the blocks enter the
        prefix cache) or `unpin` (nothing is cached). Nothing to import (all cached
        here already), or no room: an empty plan, no pin kept.
        """
        bs = self._bm.block_size
        ids = list(prefix_token_ids)[: len(prefix_token_ids) // bs * bs]
        if not ids or not self._bm.can_allocate(ids, cache_salt):
            return ImportPlan([], 0, 0, recompute=True)
        local = self._bm.allocate(pin_id, ids, cache_salt)
        first = local // bs
        plan = ImportPlan(self._bm.block_table(pin_id)[first:], first, local, False)
        if not plan.block_ids:  # cached here already: nothing to write, no pin kept
            self._bm.free(pin_id)
        else:
            self.pinned.add(pin_id)
        return plan

    def commit_prefix_import(self, pin_id: str) -> None:
        self._bm.mark_computed(pin_id, self._bm.num_tokens(pin_id))
        self.unpin(pin_id)


def generator_state(generator: torch.Generator) -> bytes:
    """A seeded generator's state as bytes (what the wire carries)."""
    return bytes(generator.get_state().numpy().tobytes())


def set_generator_state(generator: torch.Generator, state: bytes, index: int) -> None:
    """Restores `generator_state`'s bytes; InvalidRequestError if they are not one."""
    try:
        generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    except (RuntimeError, ValueError) as e:
        raise InvalidRequestError(
            f"the generator state of sample {index} is not a generator state ({e})"
        ) from e


class HandoffCalls:
    """The hand-off as a handler thread drives it: one engine trip per method.

    `timeout` bounds each trip (EngineBusy past it, see `EngineLoop.call`). Every
    method that takes state undoes it if its caller gave up waiting; the ends
    (`export_end`, `unpin`, `commit_*`, `cancel_import`) run even then, late: a
    release is wanted late too.
    """

    def __init__(self, loop: EngineLoop, timeout: float | None) -> None:
        self.loop = loop
        self.timeout = timeout

    def export_begin(self, request_id: str, lease_pin: str | None = None) -> ExportPlan | None:
        return self.loop.call(
            lambda e: e.handoff.export_begin(request_id, lease_pin),
            self.timeout,
            on_abandon=lambda e, _plan: e.handoff.export_end(request_id, lease_pin),
        )

    def export_end(self, request_id: str, unpin: str | None = None) -> None:
        self.loop.call(lambda e: e.handoff.export_end(request_id, unpin), self.timeout)

    def unpin_later(self, pin_id: str) -> None:
        """Ends a pin on the engine thread without waiting (EngineLoop.post): for an
        in-place lease's end, which may come on any thread, the engine's included."""
        self.loop.post(lambda e: e.handoff.unpin(pin_id))

    def export_prefix_begin(
        self, pin_id: str, token_ids: list[int], cache_salt: str | None
    ) -> ExportPlan | None:
        return self._pinning(pin_id, lambda h: h.export_prefix_begin(pin_id, token_ids, cache_salt))

    def unpin(self, pin_id: str) -> None:
        self.loop.call(lambda e: e.handoff.unpin(pin_id), self.timeout)

    def reserve_import(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        handed: HandedOver,
        cache_salt: str | None = None,
    ) -> tuple[RequestStream, ImportPlan]:
        """`KVHandoff.reserve_import` and the request's stream; abandoned: cancelled."""
        plans: list[ImportPlan] = []
        stream = self.loop.submit(
            request_id,
            lambda e: plans.append(
                e.handoff.reserve_import(request_id, prompt_token_ids, params, handed, cache_salt)
            ),
            timeout=self.timeout,
            undo=lambda e: e.handoff.cancel_import(request_id, recompute=False),
        )
        return stream, plans[0]

    def commit_import(self, request_id: str) -> None:
        self.loop.call(lambda e: e.handoff.commit_import(request_id), self.timeout)

    def cancel_import(self, request_id: str, recompute: bool) -> None:
        self.loop.call(lambda e: e.handoff.cancel_import(request_id, recompute), self.timeout)

    def reserve_prefix_import(
        self, pin_id: str, prefix_token_ids: list[int], cache_salt: str | None
    ) -> ImportPlan:
        return self._pinning(
            pin_id, lambda h: h.reserve_prefix_import(pin_id, prefix_token_ids, cache_salt)
        )

    def commit_prefix_import(self, pin_id: str) -> None:
        self.loop.call(lambda e: e.handoff.commit_prefix_import(pin_id), self.timeout)

    def _pinning(self, pin_id: str, take: Callable[[KVHandoff], T]) -> T:
        """take(handoff) on the engine thread, which may take the pin `pin_id`; undone
        (unpinned) if the caller gave up waiting."""
        return self.loop.call(
            lambda e: take(e.handoff),
            self.timeout,
            on_abandon=lambda e, _result: e.handoff.unpin(pin_id),
        )
