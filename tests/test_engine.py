"""The engine: continuous batching, prefix caching, preemption, parallel sampling.

Reference outputs come from `transformers` greedy `generate` on the same tiny
random checkpoints (fp32), or from the same engine running one request alone.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from builders import hf_greedy, load_hf, one_torch_thread, tiny_checkpoint  # noqa: F401

from pagedserve.common.api.limits import ConfigError
from pagedserve.common.api.outputs import FinishReason
from pagedserve.common.api.sampling_params import InvalidRequestError, SamplingParams
from pagedserve.common.core.config import CacheConfig, EngineConfig, SchedulerConfig
from pagedserve.common.core.engine import LLMEngine
from pagedserve.common.core.handoff import HandedOver
from pagedserve.common.core.llm import LLM

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 60) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, 300, (k,), generator=g).tolist() for k in lens]


def make_llm(arch: str = "llama", **kw) -> LLM:
    # Exact token parity with transformers is a float32 property: never leave it to
    # `auto`, which is bf16 on CPUs with bf16 units (tests/test_bf16.py covers bf16).
    kw.setdefault("dtype", "float32")
    kw.setdefault("num_blocks", 128)
    kw.setdefault("max_model_len", 256)
    return LLM(str(tiny_checkpoint(arch)), **kw)


def assert_pool_clean(llm: LLM) -> None:
    eng = llm.engine
    eng.check_integrity()
    assert eng.block_manager.usage() == 0.0
    assert eng.block_manager.num_free_blocks() == eng.block_manager.num_blocks


@pytest.fixture(scope="module")
def hf_refs():
    """transformers greedy continuations, memoized per (arch, prompt, n)."""
    models: dict[str, object] = {}
    memo: dict[tuple, list[int]] = {}

    def ref(arch: str, prompt: list[int], n: int) -> list[int]:
        key = (arch, tuple(prompt), n)
        if key not in memo:
            if arch not in models:
                models[arch] = load_hf(tiny_checkpoint(arch))
            memo[key] = hf_greedy(models[arch], prompt, n)
        return memo[key]

    return ref


# -- greedy parity ---------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_concurrent_greedy_equals_transformers_and_alone(arch, hf_refs):
    ps = prompts(8, seed=1)
    llm = make_llm(arch)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    together = llm.generate(ps, params)
    for p, res in zip(ps, together, strict=True):
        assert res.completions[0].token_ids == hf_refs(arch, p, 64)
        assert res.completions[0].finish_reason is FinishReason.LENGTH
        assert res.usage.prompt_tokens == len(p) and res.usage.completion_tokens == 64
    alone = [llm.generate([p], params)[0].completions[0].token_ids for p in ps[:3]]
    assert alone == [r.completions[0].token_ids for r in together[:3]]
    assert_pool_clean(llm)


def test_chunked_prefill_matches_unchunked(hf_refs):
    ps = prompts(4, seed=2, lo=40, hi=90)
    llm = make_llm(max_num_batched_tokens=32)  # every prompt spans several chunks
    out = llm.generate(ps, GREEDY)
    assert [r.completions[0].token_ids for r in out] == [hf_refs("llama", p, 24) for p in ps]
    assert llm.engine.stats().num_steps > 24  # prompts really were split over steps
    assert_pool_clean(llm)


# -- preemption ----------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_greedy_outputs(mode, hf_refs):
    ps = prompts(6, seed=3, lo=20, hi=40)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    # 6 sequences of up to 80 tokens need up to 30 blocks of 16; the pool has 12.
    llm = make_llm(num_blocks=12, max_model_len=160, preemption_mode=mode)
    out = llm.generate(ps, params)
    assert [r.completions[0].token_ids for r in out] == [hf_refs("llama", p, 40) for p in ps]
    assert llm.engine.stats().num_preemptions > 0
    assert_pool_clean(llm)


# -- prefix caching --------------------------------------------------------------------


def test_prefix_cache_prefills_only_the_remainder(hf_refs):
    llm = make_llm()
    shared = prompts(1, seed=4, lo=48, hi=49)[0]  # exactly 3 blocks of 16
    first, second = shared + [7, 8, 9, 10, 11], shared + [21, 22]
    out1 = llm.generate([first], GREEDY)[0]
    before = llm.engine.stats().prefill_tokens
    out2 = llm.generate([second], GREEDY)[0]
    assert llm.engine.stats().prefill_tokens - before == 2  # only the 2 new tokens
    assert out2.usage.cached_tokens == 48
    assert out1.usage.cached_tokens == 0
    assert out2.completions[0].token_ids == hf_refs("llama", second, 24)
    assert_pool_clean(llm)


def test_full_prompt_hit_still_computes_last_token(hf_refs):
    llm = make_llm()
    p = prompts(1, seed=5, lo=32, hi=33)[0]  # exactly 2 blocks
    llm.generate([p], GREEDY)
    before = llm.engine.stats().prefill_tokens
    out = llm.generate([p], GREEDY)[0]
    assert out.usage.cached_tokens == 16  # the last block is recomputed to get logits
    assert llm.engine.stats().prefill_tokens - before == 16
    assert out.completions[0].token_ids == hf_refs("llama", p, 24)


def test_cache_salt_isolates(hf_refs):
    llm = make_llm()
    p = prompts(1, seed=6, lo=40, hi=41)[0]
    eng = llm.engine
    eng.add_request("a", prompt_token_ids=p, params=GREEDY, cache_salt="tenant-a")
    while eng.has_unfinished_requests():
        eng.step()
    req = eng.add_request("b", prompt_token_ids=p, params=GREEDY, cache_salt="tenant-b")
    while eng.has_unfinished_requests():
        eng.step()
    assert req.num_cached_tokens == 0
    req = eng.add_request("c", prompt_token_ids=p, params=GREEDY, cache_salt="tenant-a")
    while eng.has_unfinished_requests():
        eng.step()
    assert req.num_cached_tokens == 32


# -- parallel sampling -----------------------------------------------------------------


def test_parallel_samples_share_prompt_blocks_and_are_reproducible():
    llm = make_llm()
    eng = llm.engine
    p = prompts(1, seed=7, lo=40, hi=41)[0]  # 2 full blocks + 8 tokens
    params = SamplingParams(temperature=1.0, n=4, seed=1234, max_tokens=12, ignore_eos=True)
    eng.add_request("par", prompt_token_ids=p, params=params)
    eng.step()  # prefill once, fork 4 samples from it
    bm = eng.block_manager
    tables = [bm.block_table(f"par#{i}") for i in range(4)]
    assert all(t == tables[0] for t in tables)
    assert [bm.block_ref_count(b) for b in tables[0]] == [4, 4, 4]
    assert bm.num_used_blocks() == 3
    eng.step()  # first decode: each sample copies the shared partial block (COW)
    tables = [bm.block_table(f"par#{i}") for i in range(4)]
    assert all(t[:2] == tables[0][:2] for t in tables)
    assert len({t[2] for t in tables}) == 4
    assert bm.num_used_blocks() == 2 + 4
    while eng.has_unfinished_requests():
        eng.step()
    eng.check_integrity()
    again = make_llm().generate([p], params)[0]
    again2 = make_llm().generate([p], params)[0]
    samples = [c.token_ids for c in again.completions]
    assert samples == [c.token_ids for c in again2.completions]
    assert len({tuple(s) for s in samples}) > 1  # the samples differ from one another
    assert again.usage.completion_tokens == 4 * 12


# -- stopping and aborting ----------------------------------------------------------------


def test_stop_token_ids_and_max_tokens():
    llm = make_llm()
    p = prompts(1, seed=8)[0]
    full = llm.generate([p], GREEDY)[0].completions[0].token_ids
    stop_at = next(i for i in range(3, 24) if full[i] not in full[:i])
    out = llm.generate(
        [p], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[full[stop_at]])
    )[0].completions[0]
    assert out.token_ids == full[: stop_at + 1]
    assert out.finish_reason is FinishReason.STOP and out.stop_reason == full[stop_at]
    short = llm.generate([p], SamplingParams(temperature=0, max_tokens=5))[0].completions[0]
    assert short.token_ids == full[:5] and short.finish_reason is FinishReason.LENGTH
    assert_pool_clean(llm)


def test_stop_string_is_excluded_from_text():
    llm = make_llm()
    p = prompts(1, seed=9)[0]
    full = llm.generate([p], GREEDY)[0].completions[0]
    tok = llm.engine.tokenizer
    # A stop string that spans two tokens: the tail of token 4's text and the head of token 5's.
    t4 = tok.decode(full.token_ids[4:5])
    t5 = tok.decode(full.token_ids[5:6])
    stop = t4[-1:] + t5[:1]
    expected = full.text[: full.text.find(stop)]
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=24, stop=[stop]))[0]
    c = out.completions[0]
    assert c.finish_reason is FinishReason.STOP and c.stop_reason == stop
    assert c.text == expected
    assert stop not in c.text
    assert_pool_clean(llm)


def test_eos_finishes(tmp_path: Path):
    src = tiny_checkpoint("llama")
    llm = make_llm()
    p = prompts(1, seed=10)[0]
    full = llm.generate([p], GREEDY)[0].completions[0].token_ids
    k = next(i for i in range(2, 24) if full[i] not in full[:i] and full[i] != 2)
    # The same weights, but a config whose EOS is the token greedy emits at step k.
    ck = tmp_path / "eos"
    shutil.copytree(src, ck)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((ck / name).read_text())
        cfg["eos_token_id"] = full[k]
        (ck / name).write_text(json.dumps(cfg))
    eos_llm = LLM(str(ck), dtype="float32", num_blocks=64, max_model_len=256)
    out = eos_llm.generate([p], SamplingParams(temperature=0, max_tokens=24))[0].completions[0]
    assert out.token_ids == full[: k + 1] and out.finish_reason is FinishReason.EOS
    ignored = eos_llm.generate([p], GREEDY)[0].completions[0]
    assert ignored.token_ids == full


def test_abort_mid_flight_returns_blocks():
    llm = make_llm()
    eng = llm.engine
    ps = prompts(3, seed=11, lo=30, hi=50)
    for i, p in enumerate(ps):
        eng.add_request(f"r{i}", prompt_token_ids=p, params=GREEDY)
    eng.step()
    eng.step()
    used_before = eng.block_manager.num_used_blocks()
    out = eng.abort_request("r1")
    assert out.finished and out.samples[0].finish_reason is FinishReason.ABORT
    assert eng.block_manager.num_used_blocks() < used_before
    assert not eng.block_manager.has_seq("r1#0")
    eng.check_integrity()
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.abort_request("r1") is None
    assert_pool_clean(llm)


def test_streaming_deltas_concatenate_to_the_result():
    llm = make_llm()
    ps = prompts(3, seed=12)
    chunks: dict[str, list[int]] = {}
    finals = 0
    for out in llm.stream(ps, GREEDY):
        for d in out.samples:
            chunks.setdefault(out.request_id, []).extend(d.token_ids)
        finals += out.finished
    assert finals == 3
    assert sorted(chunks.values()) == sorted(
        r.completions[0].token_ids for r in llm.generate(ps, GREEDY)
    )


# -- disaggregation at the engine level -------------------------------------------------


def test_prefill_only_then_import_equals_one_engine(hf_refs):
    """The prefill role holds the prompt's blocks; the decode role imports their K/V."""
    pre, dec = make_llm().engine, make_llm().engine
    p = prompts(1, seed=13, lo=45, hi=46)[0]
    pre.add_request("x", prompt_token_ids=p, params=GREEDY, prefill_only=True)
    outs = []
    while pre.has_unfinished_requests():
        outs += pre.step()
    (first,) = outs[-1].samples
    assert first.finish_reason is None and len(first.token_ids) == 1
    export = pre.handoff.export_begin("x")
    assert export is not None
    table, hashes, n = export.block_ids, export.block_hashes, export.num_tokens
    assert n == len(p) and len(table) == 3 and len(hashes) == 2
    data = pre.kv_cache.read_blocks(table)
    plan = dec.handoff.reserve_import("x", p, GREEDY, HandedOver({0: first.token_ids[0]}))
    assert plan.first_block == 0 and len(plan.block_ids) == 3 and not plan.recompute
    dec.kv_cache.write_blocks(plan.block_ids, data)
    dec.handoff.commit_import("x")
    assert pre.handoff.export_end("x") == 1
    pre.check_integrity()
    tokens = []  # the decode role reports every token, the imported first one included
    while dec.has_unfinished_requests():
        for out in dec.step():
            for d in out.samples:
                tokens += d.token_ids
    assert tokens == hf_refs("llama", p, 24)
    dec.check_integrity()
    assert dec.block_manager.usage() == 0.0


# -- bad input -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, params, match",
    [
        (dict(prompt_token_ids=[]), GREEDY, "empty"),
        (dict(prompt_token_ids=[5] * 300), GREEDY, "max_model_len"),
        (dict(prompt_token_ids=[5, 6]), SamplingParams(max_tokens=0), "max_tokens"),
        (dict(prompt_token_ids=[5, 6]), SamplingParams(temperature=-1), "temperature"),
        (dict(prompt_token_ids=[5, 6]), SamplingParams(top_p=0), "top_p"),
        (dict(prompt_token_ids=[5, 6]), SamplingParams(top_p=1.5), "top_p"),
        (dict(prompt_token_ids=[5, 6]), SamplingParams(top_k=-2), "top_k"),
        (dict(prompt_token_ids=[5, 6]), SamplingParams(n=0), "n"),
        (dict(prompt_token_ids=[5, 6]), SamplingParams(n=17), "n"),
        (dict(prompt_token_ids=[5, 6]), SamplingParams(n=2, temperature=0), "n"),
        (dict(prompt_token_ids=[5, 320]), GREEDY, "vocab"),
        (dict(prompt_token_ids=[5, -1]), GREEDY, "vocab"),
        (dict(), GREEDY, "exactly one"),
        (dict(prompt="hi", prompt_token_ids=[5]), GREEDY, "exactly one"),
    ],
)
def test_bad_requests_rejected_before_any_block(kwargs, params, match):
    llm = make_llm()
    eng = llm.engine
    with pytest.raises(InvalidRequestError, match=match):
        eng.add_request("bad", params=params, **kwargs)
    assert not eng.has_unfinished_requests()
    assert eng.block_manager.num_used_blocks() == 0
    assert eng.stats().prefix_query_tokens == 0


def test_duplicate_request_id_rejected():
    eng = make_llm().engine
    eng.add_request("dup", prompt_token_ids=[5, 6], params=GREEDY)
    with pytest.raises(InvalidRequestError, match="already in flight"):
        eng.add_request("dup", prompt_token_ids=[5, 6], params=GREEDY)


def test_pool_smaller_than_max_model_len_is_a_config_error():
    with pytest.raises(ConfigError, match="max_model_len"):
        make_llm(num_blocks=4, max_model_len=256)


def test_engine_config_dataclass_path():
    cfg = EngineConfig(
        model=str(tiny_checkpoint("qwen2")),
        dtype="float32",
        cache=CacheConfig(block_size=8, num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=2, max_model_len=128),
    )
    eng = LLMEngine(cfg)
    for i, p in enumerate(prompts(5, seed=14, lo=5, hi=20)):
        eng.add_request(f"q{i}", prompt_token_ids=p, params=GREEDY)
    eng.step()
    assert eng.stats().num_running == 2 and eng.stats().num_waiting == 3  # max_num_seqs
    while eng.has_unfinished_requests():
        eng.step()
    eng.check_integrity()


def _prefill_on(pre: LLMEngine, rid: str, p: list[int], params: SamplingParams):
    """Runs the prefill role; returns ({index: first token}, its export, or None)."""
    pre.add_request(rid, prompt_token_ids=p, params=params, prefill_only=True)
    firsts: dict[int, int] = {}
    while pre.has_unfinished_requests():
        for out in pre.step():
            for d in out.samples:
                firsts[d.index] = d.token_ids[0]
    return firsts, pre.handoff.export_begin(rid)


def _drain(eng: LLMEngine) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            for d in out.samples:
                tokens.setdefault(d.index, []).extend(d.token_ids)
    return tokens


def test_seeded_parallel_samples_continue_exactly_after_import():
    params = SamplingParams(temperature=0.9, n=3, seed=77, max_tokens=10, ignore_eos=True)
    p = prompts(1, seed=15, lo=37, hi=38)[0]
    one = make_llm().generate([p], params)[0]
    pre, dec = make_llm().engine, make_llm().engine
    firsts, export = _prefill_on(pre, "s", p, params)
    states = export.generator_states
    plan = dec.handoff.reserve_import("s", p, params, HandedOver(firsts, generator_states=states))
    dec.kv_cache.write_blocks(plan.block_ids, pre.kv_cache.read_blocks(export.block_ids))
    dec.handoff.commit_import("s")
    pre.handoff.export_end("s")
    got = _drain(dec)
    assert [got[i] for i in range(3)] == [c.token_ids for c in one.completions]
    dec.check_integrity()
    pre.check_integrity()


def test_import_reuses_local_prefix_and_first_token_can_finish():
    pre, dec = make_llm().engine, make_llm().engine
    p = prompts(1, seed=16, lo=40, hi=41)[0]
    dec.add_request("warm", prompt_token_ids=p[:32] + [9, 9], params=GREEDY)
    _drain(dec)  # the decode role now caches p's first 2 blocks
    firsts, _ = _prefill_on(pre, "y", p, GREEDY)
    plan = dec.handoff.reserve_import("y", p, GREEDY, HandedOver(firsts))
    assert plan.local_hit_tokens == 32 and plan.first_block == 2 and len(plan.block_ids) == 1
    dec.handoff.cancel_import("y", recompute=True)  # pretend the pull failed: recompute locally
    got = _drain(dec)[0]
    assert got == make_llm().generate([p], GREEDY)[0].completions[0].token_ids
    pre.handoff.export_end("y")
    # max_tokens=1: the first token ends the request; nothing is imported or held.
    one = SamplingParams(temperature=0, max_tokens=1)
    firsts, export = _prefill_on(pre, "z", p, one)
    assert export is None and "z" not in pre.handoff.held
    plan = dec.handoff.reserve_import("z", p, one, HandedOver(firsts))
    assert plan.block_ids == [] and not plan.recompute
    out = dec.step()
    assert out[0].finished and out[0].samples[0].finish_reason is FinishReason.LENGTH
    assert out[0].samples[0].token_ids == [firsts[0]]
    for eng in (pre, dec):
        eng.check_integrity()
        assert eng.block_manager.usage() == 0.0


def test_import_with_a_bad_generator_state_is_refused_before_any_block():
    dec = make_llm().engine
    params = SamplingParams(temperature=0.9, n=2, seed=3, max_tokens=4, ignore_eos=True)
    handed = HandedOver({0: 5, 1: 6}, generator_states={1: b"junk"})
    with pytest.raises(InvalidRequestError, match="generator state of sample 1"):
        dec.handoff.reserve_import("g", [7] * 20, params, handed)
    assert not dec.requests and dec.handoff.is_idle()
    assert dec.block_manager.usage() == 0.0
    dec.check_integrity()


def test_request_id_is_refused_while_an_aborted_export_still_copies():
    """A request aborted during its export copy leaves the export pin until the copier
    ends it: a new request by that id must not be admitted meanwhile (its own export
    would take, and its end release, the pin the first copy still relies on)."""
    pre = make_llm().engine
    p = prompts(1, seed=17, lo=40, hi=41)[0]
    pre.add_request("A", prompt_token_ids=p, params=GREEDY, prefill_only=True)
    _drain(pre)
    export = pre.handoff.export_begin("A")
    assert export is not None
    pre.abort_request("A")  # an Abort RPC during the copy: the held sample ends
    assert not pre.handoff.held and pre.block_manager.usage() > 0  # pinned
    with pytest.raises(InvalidRequestError, match="'A' is still being exported"):
        pre.add_request("A", prompt_token_ids=p, params=GREEDY, prefill_only=True)
    assert pre.handoff.export_end("A") == 0  # the copier is done
    assert pre.block_manager.usage() == 0.0
    pre.add_request("A", prompt_token_ids=p, params=GREEDY, prefill_only=True)
    _drain(pre)
    assert pre.handoff.export_end("A") == 1
    pre.check_integrity()
    assert pre.block_manager.usage() == 0.0


def test_engine_seed_makes_unseeded_sampling_repeatable():
    """EngineConfig.seed (`--seed`) seeds what rows without a request seed draw from."""
    prompt = list(range(5, 30))
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)

    def sampled(seed: int) -> list[int]:
        llm = make_llm(dtype="float32", num_blocks=64, max_model_len=256, seed=seed)
        torch.rand(3)  # whatever ran in the process before does not matter
        llm = make_llm(dtype="float32", num_blocks=64, max_model_len=256, seed=seed)
        return llm.generate([prompt], params)[0].completions[0].token_ids

    assert sampled(7) == sampled(7)
    assert sampled(7) != sampled(8)
