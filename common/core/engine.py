"""The engine: one process serving many requests at once over the paged KV cache.

`add_request` validates and queues; each `step` schedules, runs one forward,
samples, and reports per-request deltas; `abort_request` ends a request at once.
Every request that ends - finished, aborted, failed - returns every block it
held in the same call. The engine is single-threaded by design: whoever drives
it (the offline `LLM`, a worker's loop) calls these methods from one thread.

The prefill/decode hand-off (keeping a prefill-only request's blocks for export,
importing a prompt's K/V, pinning blocks another thread copies) is `self.handoff`
(handoff.py): this module only tells it when a sample is held or a request aborted.

Fault isolation: a request can only fail itself. Whatever goes wrong in the per-request
part of a step - sampling, logprobs, detokenizing, stop-string matching - is charged to
the request it happened in: that request ends with `RequestOutput.error` set (and
finish reason ABORT), its blocks return, and every other request of the batch gets its
token as if nothing happened. A failed batched sampler call is retried one request at a
time (each request's rows, with its seeded generators rewound) to find the culprit. Only
a fault in the scheduler or the model forward raises out of `step()`, for the caller to
fail everything in flight.

Size: a little over the ~500-line mark: add / step / abort / stats, plus the
per-request fault isolation of a step (a failed sample ends only its request), which
belongs to `step`. The prefill/decode hand-off lives in handoff.py.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from pagedserve.common.api.limits import ConfigError
from pagedserve.common.api.outputs import (
    ErrorKind,
    FinishReason,
    RequestError,
    RequestOutput,
    SampleDelta,
    TokenLogprobs,
    Usage,
)
from pagedserve.common.api.sampling_params import (
    InvalidRequestError,
    SamplingParams,
    validate_prompt,
)
from pagedserve.common.core.block_manager import BlockManager
from pagedserve.common.core.config import EngineConfig, resolve_dtype
from pagedserve.common.core.detokenizer import IncrementalDetokenizer
from pagedserve.common.core.handoff import KVHandoff
from pagedserve.common.core.kv_cache import KVCache, num_blocks_for_budget
from pagedserve.common.core.loader import LoadedModel, load_model
from pagedserve.common.core.model_runner import ModelRunner
from pagedserve.common.core.request_stats import RequestStatsLog
from pagedserve.common.core.sampler import SampleOutput, Sampler, make_generator
from pagedserve.common.core.scheduler import ScheduledSeq, Scheduler
from pagedserve.common.core.sequence import Request, Sequence, SequenceStatus, make_seq_id

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for logs and the metrics exporter (plain data, no Prometheus here)."""

    num_running: int
    num_waiting: int
    num_swapped: int
    num_blocks: int
    num_free_blocks: int
    kv_usage: float  # fraction of blocks held by sequences
    num_preemptions: int  # total since start: the real capacity alarm
    prefill_tokens: int  # total prompt tokens computed (cache hits excluded)
    decode_tokens: int  # total tokens generated
    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_steps: int
    last_step_tokens: int
    last_step_s: float
    step_s_total: float  # wall time inside step(), summed
    forward_s_total: float  # of which in the model forward + logits


class HostSwapper:
    """Keeps preempted sequences' KV in host memory (preemption_mode="swap")."""

    def __init__(self, kv_cache: KVCache) -> None:
        self.kv_cache = kv_cache
        self.store: dict[str, torch.Tensor] = {}

    def swap_out(self, seq_id: str, block_ids: list[int]) -> None:
        self.store[seq_id] = self.kv_cache.read_blocks(block_ids).to("cpu", copy=True)

    def swap_in(self, seq_id: str, block_ids: list[int], first_block: int) -> None:
        data = self.store.pop(seq_id)
        if first_block < len(block_ids):
            dev = self.kv_cache.kv.device
            self.kv_cache.write_blocks(block_ids[first_block:], data[first_block:].to(dev))

    def discard(self, seq_id: str) -> None:
        self.store.pop(seq_id, None)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None):
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if config.seed is not None:
            # As `vllm serve --seed`: the process's global torch RNG, which every
            # sampled row without a request `seed` draws from. Process-wide: engines in
            # one process share it (a worker process has one engine).
            torch.manual_seed(config.seed)
        self.dtype_name = resolve_dtype(config.dtype, config.device)
        dtype = _DTYPES[self.dtype_name]
        self.loaded = loaded or load_model(
            config.model,
            dtype=dtype,
            device=config.device,
            attention_backend=config.attention_backend,
            fp32_gemm=config.fp32_gemm,
        )
        self.model = self.loaded.model
        self.tokenizer = self.loaded.tokenizer
        self.spec = spec = self.loaded.spec
        self.model_id = self.loaded.model_id
        cc = config.cache
        num_blocks = cc.num_blocks or num_blocks_for_budget(
            spec, cc.block_size, dtype, cc.kv_cache_bytes
        )
        self.max_model_len = config.scheduler.max_model_len or spec.max_model_len
        if num_blocks * cc.block_size < self.max_model_len:
            raise ConfigError(
                f"the KV cache holds {num_blocks} blocks x {cc.block_size} tokens = "
                f"{num_blocks * cc.block_size} tokens, less than max_model_len "
                f"{self.max_model_len}: raise kv_cache_bytes/num_blocks or lower max_model_len"
            )
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %s)",
            num_blocks,
            cc.block_size,
            num_blocks * cc.block_size,
            num_blocks * spec.kv_bytes_per_block(cc.block_size, dtype) / 2**20,
            self.dtype_name,
        )
        self.block_manager = BlockManager(
            num_blocks, cc.block_size, self.model_id, cc.enable_prefix_caching
        )
        self.kv_cache = KVCache(
            spec, num_blocks, cc.block_size, dtype, config.device, shm_dir=cc.shm_dir
        )
        swapper = HostSwapper(self.kv_cache) if cc.preemption_mode == "swap" else None
        self.scheduler = Scheduler(config.scheduler, cc, self.block_manager, swapper)
        self.runner = ModelRunner(self.model, self.kv_cache, self.block_manager)
        self.eos_token_ids = set(spec.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.sampler = Sampler(self.eos_token_ids)  # masks EOS under a request's min_tokens
        self.requests: dict[str, Request] = {}
        # The prefill/decode KV hand-off (held, importing, pinned; see handoff.py).
        self.handoff = KVHandoff(self)
        # Requests with news that no step produced (imported first tokens).
        self._touched: dict[str, Request] = {}
        self.last_step_was_empty = False
        self._prefill_tokens = 0
        self._decode_tokens = 0
        self._num_steps = 0
        self._last_step_tokens = 0
        self._last_step_s = 0.0
        self._step_s = 0.0
        self._forward_s = 0.0
        self.request_stats = RequestStatsLog()  # per-request phases, for the exporter

    # -- requests -------------------------------------------------------------

    def tokenize(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt).input_ids)

    def apply_chat_template(self, messages: Seq[dict[str, str]]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("this model has no chat template: send a prompt instead")
        text = self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=True
        )
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def add_request(
        self,
        request_id: str | None = None,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        *,
        prompt_token_ids: Seq[int] | None = None,
        cache_salt: str | None = None,
        prefill_only: bool = False,
    ) -> Request:
        """Validates and queues a request; raises InvalidRequestError before taking any block.

        prefill_only: stop after the first token of every sample and keep the blocks
        (`handoff.held`, until `handoff.export_end`); the decode role continues the
        request elsewhere.
        """
        params = params or SamplingParams()
        if (prompt is None) == (prompt_token_ids is None):
            raise InvalidRequestError("give exactly one of prompt and prompt_token_ids")
        request_id = request_id or uuid.uuid4().hex
        ids = self.tokenize(prompt) if prompt is not None else list(prompt_token_ids or [])
        req = self._admit(request_id, ids, params, cache_salt, prefill_only=prefill_only)
        seq = self._new_sequence(req, 0, list(ids))
        self._register(req)
        self.scheduler.add(seq)
        return req

    def _admit(
        self,
        request_id: str,
        ids: list[int],
        params: SamplingParams,
        cache_salt: str | None,
        **flags: bool,
    ) -> Request:
        """A new Request, validated and with room in the queue, not yet registered: the
        one admission of `add_request` and `handoff.reserve_import`. Raises
        InvalidRequestError or QueueFullError before anything is held."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight")
        self.handoff.check_new_id(request_id)
        self._validate(ids, params)
        self.scheduler.check_room()
        return Request(request_id, ids, params, cache_salt, **flags)

    def _register(self, req: Request, *, report_now: bool = False) -> None:
        """The request is in flight; report_now: its news goes out with the next step
        even if no step computes it (an import's first tokens)."""
        self.requests[req.request_id] = req
        if report_now:
            self._touched[req.request_id] = req

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        """The engine's own door, whoever calls (offline `LLM`, a worker's servicer): the
        same `common/api` checks the router runs at the client edge. See
        `pagedserve.common.runtime.servicer_support` for where sampling parameters are
        trusted and why this one check stays."""
        params.validate(
            vocab_size=self.spec.vocab_size,
            max_n=self.config.limits.max_n,
            max_logprobs=self.config.limits.max_logprobs,
        )
        validate_prompt(
            ids,
            vocab_size=self.spec.vocab_size,
            max_model_len=self.max_model_len,
            max_tokens=params.max_tokens,
        )

    def _new_sequence(self, req: Request, index: int, token_ids: list[int]) -> Sequence:
        detok = IncrementalDetokenizer(
            self.tokenizer,
            req.prompt_token_ids,
            req.params.stop,
            min_tokens=req.params.min_tokens,
        )
        seq = Sequence(
            seq_id=make_seq_id(req.request_id, index),
            request=req,
            index=index,
            token_ids=token_ids,
            detokenizer=detok,
            generator=make_generator(req.params.seed, index),
        )
        req.seqs.append(seq)
        return seq

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Ends a request now; its blocks are back before this returns."""
        self.handoff.drop(request_id)
        req = self.requests.get(request_id)
        if req is None:
            return None
        for seq in req.seqs:
            if not seq.is_finished:
                try:
                    self._finish(seq, FinishReason.ABORT)
                except Exception:  # its held-back text is lost; its blocks are back
                    logger.exception("flushing the text of aborted %s failed", seq.seq_id)
        req.forked = True  # no fork will happen any more
        return self._collect([req])[0]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- the step ---------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        touched = list(self._touched.values())
        self._touched.clear()
        self.last_step_was_empty = sched.is_empty and not touched
        if sched.is_empty:
            return self._collect(touched)
        self.request_stats.scheduled(sched)
        t_fwd = time.perf_counter()
        logits, sampled = self.runner.execute(sched)
        self._forward_s += time.perf_counter() - t_fwd
        for item in [*sched.prefills, *sched.decodes]:
            item.seq.num_computed_tokens = item.start + item.num_new_tokens
            self.block_manager.mark_computed(item.seq.seq_id, item.seq.num_computed_tokens)
        self._prefill_tokens += sum(i.num_new_tokens for i in sched.prefills)
        self._decode_tokens += len(sampled)
        for req in self._sample(logits, sampled):
            if req not in touched:
                touched.append(req)
        self._num_steps += 1
        self._last_step_tokens = sched.num_batched_tokens
        self._last_step_s = time.perf_counter() - t0
        self._step_s += self._last_step_s
        return self._collect(touched)

    def _sample(self, logits: torch.Tensor, sampled: list[ScheduledSeq]) -> list[Request]:
        """Sample every row and append the tokens; returns the requests with news.

        Per-request faults fail only their request (see the module doc)."""
        rows, seqs = self._fork_samples(sampled)
        if not seqs:
            return []
        if len(rows) != len(sampled):
            logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
        results = self._sample_isolated(logits, seqs)
        touched: dict[str, Request] = {}
        for seq, result in zip(seqs, results, strict=True):
            req = seq.request
            touched[req.request_id] = req
            if req.error is not None or result is None or seq.is_finished:
                continue  # failed in sampling, or a sibling sample failed it just now
            try:
                self._append_token(seq, *result)
            except Exception as e:
                self._fail_request(
                    req,
                    ErrorKind.INTERNAL,
                    f"internal error while detokenizing or matching stop strings for this "
                    f"request: {type(e).__name__}: {e}",
                )
        return list(touched.values())

    def _fork_samples(self, sampled: list[ScheduledSeq]) -> tuple[list[int], list[Sequence]]:
        """(logits row, sequence) of everything to sample this step.

        A request with n > 1 prefilled its prompt once as sample 0; now the other
        samples fork from it (sharing every block) and draw from the same logits row."""
        rows: list[int] = []
        seqs: list[Sequence] = []
        for row, item in enumerate(sampled):
            seq = item.seq
            rows.append(row)
            seqs.append(seq)
            req = seq.request
            if req.params.n > 1 and not req.forked:
                req.forked = True
                for index in range(1, req.params.n):
                    child = self._new_sequence(req, index, list(seq.token_ids))
                    child.num_computed_tokens = seq.num_computed_tokens
                    self.block_manager.fork(seq.seq_id, child.seq_id)
                    self.scheduler.add_running(child)
                    rows.append(row)
                    seqs.append(child)
        return rows, seqs

    def _run_sampler(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleOutput:
        """The sampler over `seqs`' rows; a token outside the row is a sampler failure."""
        out = self.sampler(
            logits,
            [s.request.params for s in seqs],
            [s.generator for s in seqs],
            [s.output_token_ids for s in seqs],
            [s.request.prompt_token_ids for s in seqs],
        )
        vocab = logits.shape[1]
        bad = [t for t in out.token_ids if not 0 <= t < vocab]
        if bad:
            raise IndexError(f"the sampler drew token ids {bad} outside [0, {vocab})")
        return out

    def _sample_isolated(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> list[tuple[int, TokenLogprobs | None] | None]:
        """(token, logprobs) per sequence; None where its request failed (and was ended).

        One batched sampler call; if it raises, the seeded generators are rewound (a
        failed call may have drawn from some) and each request's rows are sampled on
        their own, so only the requests whose own rows fail are failed."""
        states = [(s.generator, s.generator.get_state()) for s in seqs if s.generator]
        try:
            out = self._run_sampler(logits, seqs)
            return list(zip(out.token_ids, out.logprobs, strict=True))
        except Exception as e:
            logger.warning(
                "sampling a batch of %d rows failed (%s: %s); sampling request by request",
                len(seqs),
                type(e).__name__,
                e,
            )
        for generator, state in states:
            generator.set_state(state)
        results: list[tuple[int, TokenLogprobs | None] | None] = [None] * len(seqs)
        by_request: dict[str, list[int]] = {}
        for i, seq in enumerate(seqs):
            by_request.setdefault(seq.request.request_id, []).append(i)
        for idx in by_request.values():
            group = [seqs[i] for i in idx]
            sub = logits.index_select(0, torch.tensor(idx, device=logits.device))
            try:
                out = self._run_sampler(sub, group)
            except Exception as e:
                self._fail_request(group[0].request, *self._sampling_failure(sub, group, e))
                continue
            for i, token, lp in zip(idx, out.token_ids, out.logprobs, strict=True):
                results[i] = (token, lp)
        return results

    def _sampling_failure(
        self, logits: torch.Tensor, seqs: list[Sequence], error: Exception
    ) -> tuple[ErrorKind, str]:
        """Whose fault: if plain greedy sampling of the same rows works, the request's
        own sampling parameters made it fail (INVALID_ARGUMENT: the client can change
        them); otherwise the rows themselves cannot be sampled (INTERNAL)."""
        what = f"{type(error).__name__}: {error}"
        try:
            self.sampler(
                logits,
                [SamplingParams(temperature=0)] * len(seqs),
                [None] * len(seqs),
                [[] for _ in seqs],
                [[] for _ in seqs],
            )
        except Exception:
            return ErrorKind.INTERNAL, f"internal error while sampling this request: {what}"
        p = seqs[0].request.params
        knobs = (
            f"temperature={p.temperature}, top_p={p.top_p}, top_k={p.top_k}, "
            f"min_p={p.min_p}, repetition_penalty={p.repetition_penalty}, "
            f"logprobs={p.logprobs}, seed={p.seed}"
        )
        return (
            ErrorKind.INVALID_ARGUMENT,
            f"sampling failed with this request's parameters ({knobs}): {what}; "
            f"other requests were not affected: change these parameters and retry",
        )

    def _fail_request(self, req: Request, kind: ErrorKind, message: str) -> None:
        """Ends `req` alone: every sample finishes (ABORT), its blocks return now,
        `error` goes out with its last output. The detokenizer is not flushed: it may
        be what failed."""
        logger.warning("request %s failed (%s): %s", req.request_id, kind.value, message)
        if req.error is None:
            req.error = RequestError(kind, message)
        for seq in req.seqs:
            if not seq.is_finished:
                seq.finish_reason = FinishReason.ABORT
                self.scheduler.finish(seq)
        self.handoff.release_held(req.request_id)  # prefill role: samples handed over
        req.forked = True  # no fork will happen any more

    def _append_token(self, seq: Sequence, token: int, lp: TokenLogprobs | None) -> None:
        params = seq.request.params
        self.request_stats.token(seq.request)
        seq.token_ids.append(token)
        seq.pending_token_ids.append(token)
        seq.logprobs.append(lp)
        seq.pending_logprobs.append(lp)
        assert seq.detokenizer is not None
        seq.pending_text += seq.detokenizer.add(token)
        if seq.detokenizer.stop_reason is not None:
            seq.stop_reason = seq.detokenizer.stop_reason
            self._finish(seq, FinishReason.STOP)
        elif token in params.stop_token_ids:
            seq.stop_reason = token
            self._finish(seq, FinishReason.STOP)
        elif not params.ignore_eos and token in self.eos_token_ids:
            self._finish(seq, FinishReason.EOS)
        elif (
            len(seq.output_token_ids) >= params.max_tokens
            or len(seq.token_ids) >= self.max_model_len
        ):
            self._finish(seq, FinishReason.LENGTH)
        elif seq.request.prefill_only:
            self.handoff.hold(seq)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Ends one sample; its blocks return even when flushing its text raises."""
        seq.finish_reason = reason
        try:
            if seq.detokenizer is not None:  # release held-back text ("" after a stop string)
                seq.pending_text += seq.detokenizer.flush()
        finally:
            self.scheduler.finish(seq)

    def _collect(self, reqs: list[Request]) -> list[RequestOutput]:
        outputs = []
        for req in reqs:
            samples = []
            for seq in req.seqs:
                if seq.finish_reported or not (
                    seq.pending_token_ids or seq.pending_text or seq.is_finished
                ):
                    continue
                seq.finish_reported = seq.is_finished
                samples.append(
                    SampleDelta(
                        index=seq.index,
                        token_ids=seq.pending_token_ids,
                        text=seq.pending_text,
                        logprobs=seq.pending_logprobs,
                        finish_reason=seq.finish_reason if seq.is_finished else None,
                        stop_reason=seq.stop_reason if seq.is_finished else None,
                        completion_tokens=len(seq.output_token_ids),
                    )
                )
                seq.pending_token_ids, seq.pending_text, seq.pending_logprobs = [], "", []
            finished = req.is_finished
            usage = None
            if finished:
                usage = Usage(
                    prompt_tokens=req.num_prompt_tokens,
                    completion_tokens=sum(len(s.output_token_ids) for s in req.seqs),
                    cached_tokens=req.num_cached_tokens,
                )
                self.requests.pop(req.request_id, None)
                self.request_stats.done(req)
            error = req.error if finished else None
            outputs.append(RequestOutput(req.request_id, samples, finished, usage, error))
        return outputs

    # -- introspection ------------------------------------------------------------

    def stats(self) -> EngineStats:
        bm = self.block_manager.stats()
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_swapped=len(self.scheduler.swapped),
            num_blocks=self.block_manager.num_blocks,
            num_free_blocks=self.block_manager.num_free_blocks(),
            kv_usage=self.block_manager.usage(),
            num_preemptions=self.scheduler.num_preemptions,
            prefill_tokens=self._prefill_tokens,
            decode_tokens=self._decode_tokens,
            prefix_query_tokens=bm.prefix_query_tokens,
            prefix_hit_tokens=bm.prefix_hit_tokens,
            num_steps=self._num_steps,
            last_step_tokens=self._last_step_tokens,
            last_step_s=self._last_step_s,
            step_s_total=self._step_s,
            forward_s_total=self._forward_s,
        )

    def check_integrity(self) -> None:
        """Block manager invariants, plus: every live sequence's blocks are in use."""
        self.block_manager.check_integrity()
        for seq in self.scheduler.iter_unfinished():
            if seq.status is SequenceStatus.RUNNING:
                assert self.block_manager.has_seq(seq.seq_id), f"{seq.seq_id} runs without blocks"
        if not self.requests and self.handoff.is_idle():
            assert self.block_manager.usage() == 0.0, "no request in flight, yet blocks in use"
