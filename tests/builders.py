"""Builders for tests: tiny random checkpoints, a tiny tokenizer, a paged greedy loop.

Checkpoints are real Hugging Face directories written with `save_pretrained`
from a seeded config, so both `transformers` and `pagedserve.common.core.loader` load
the very same bytes. They are built once per process (lru-cached) under one
temp dir that is removed at exit.

Every parameter is re-drawn from a seeded generator (norm weights around 1,
biases non-zero, weights with std 0.15): `transformers`' own init leaves biases
at 0 and norms at 1, which would hide a wrong bias or norm, and its 0.02 std gives
near-tied logits, where greedy parity would hinge on rounding.

`PagedSession` is a minimal engine for tests: a shuffled free list of blocks
(so block tables are never contiguous), sequences with block tables, and
`step()` that builds `AttentionMetadata` for a flat batch of prefill chunks
then decode tokens.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import random
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from benchmarks.paged_meta import metadata as make_metadata  # noqa: F401 (tests import it here)
from pagedserve.common.core.kv_cache import KVCache
from pagedserve.common.core.model import PagedCausalLM


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models on 1 thread: with 2 threads on 2 shared cores, OpenMP barriers
    made these tests ~10x slower (measured: 64 greedy steps 1.8 s vs 0.2 s).
    Import it into a test module to apply it there; restored after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- tokenizer ----------------------------------------------------------------------

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the key value cache in fixed size blocks.",
    "What is the capital of France? The capital of France is Paris.",
    "Once upon a time there was a little model that served many requests.",
    "def add(a, b):\n    return a + b\n",
] * 4


def tiny_tokenizer(vocab_size: int = 300):
    """A byte-level BPE trained in memory, with ChatML specials and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


# ---- tiny checkpoints --------------------------------------------------------------

TINY_VOCAB = 320  # >= the tiny tokenizer's 300 ids

# Llama-3 style rope scaling: config.json's rope_parameters (transformers 5's name).
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
_WIDTH_64 = dict(hidden_size=64, intermediate_size=128)  # the small tiny models' widths

# name -> (model_type, config overrides). Group sizes 3, 4, 1 and 3 (9 q over 3 kv).
TINY_ARCHS: dict[str, tuple[str, dict]] = {
    "llama": (
        "llama",
        dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, intermediate_size=160),
    ),
    "llama3": (  # Llama-3 style rope scaling, tied embeddings, 4-way GQA
        "llama",
        dict(
            **_WIDTH_64,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=True,
            rope_parameters=_LLAMA3_ROPE,
        ),
    ),
    "qwen2": ("qwen2", dict(**_WIDTH_64, num_attention_heads=4, num_key_value_heads=4)),
    "qwen3": (
        "qwen3",
        dict(**_WIDTH_64, num_attention_heads=9, num_key_value_heads=3, head_dim=16),
    ),
}


def tiny_config(arch: str):
    """A seeded-size transformers config for `arch` (a key of TINY_ARCHS)."""
    from transformers import AutoConfig

    if arch not in TINY_ARCHS:
        raise KeyError(f"unknown tiny arch {arch!r}; choose from {sorted(TINY_ARCHS)}")
    model_type, overrides = TINY_ARCHS[arch]
    base = dict(
        vocab_size=TINY_VOCAB,
        num_hidden_layers=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    base.update(overrides)
    if "rope_parameters" in base:
        base.pop("rope_theta")
    return AutoConfig.for_model(model_type, **base)


@functools.cache
def _root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="pagedserve-tiny-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


@functools.cache
def tiny_checkpoint(arch: str, seed: int = 0) -> Path:
    """Path of a saved tiny random checkpoint (+ tokenizer); built once per process."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _randomize(model, seed)
    out = _root() / f"{arch}-{seed}"
    model.save_pretrained(str(out))
    tiny_tokenizer().save_pretrained(str(out))
    return out


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.2 * noise)
        elif name.endswith(".bias"):
            p.copy_(0.2 * noise)
        else:
            p.copy_(0.15 * noise)


def load_hf(path: Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers `generate`, greedy, EOS ignored (exactly max_new_tokens tokens).

    EOS is disabled by `eos_token_id = None` on the model's own generation config
    (generate() refills None fields of a passed config from it), not by
    `min_new_tokens`, which masks the EOS logit and so changes the argmax where
    EOS would win.
    """
    gen_cfg = hf_model.generation_config
    saved = gen_cfg.eos_token_id
    gen_cfg.eos_token_id = None
    ids = torch.tensor([prompt])
    try:
        with torch.inference_mode():
            out = hf_model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
            )
    finally:
        gen_cfg.eos_token_id = saved
    new = out[0, len(prompt) :].tolist()
    assert len(new) == max_new_tokens, f"generate stopped after {len(new)} tokens"
    return new


# ---- a minimal paged engine --------------------------------------------------------


@dataclass
class PagedSeq:
    tokens: list[int]
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache


class PagedSession:
    """Sequences over a KV cache with a shuffled free list; runs greedy steps."""

    def __init__(
        self,
        model: PagedCausalLM,
        num_blocks: int = 64,
        block_size: int = 8,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.kv_cache = KVCache(model.spec, num_blocks, block_size, model.dtype, model.device)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.seqs: dict[str, PagedSeq] = {}

    # -- blocks --
    def _ensure_blocks(self, seq: PagedSeq, num_tokens: int) -> None:
        while len(seq.block_table) * self.block_size < num_tokens:
            if not self.free:
                raise RuntimeError("PagedSession: out of KV blocks")
            seq.block_table.append(self.free.pop())

    def add(self, seq_id: str, tokens: list[int]) -> PagedSeq:
        self.seqs[seq_id] = PagedSeq(list(tokens))
        return self.seqs[seq_id]

    def add_with_prefix(
        self, seq_id: str, tokens: list[int], donor: str, n_blocks: int
    ) -> PagedSeq:
        """A sequence whose first `n_blocks` full blocks are `donor`'s (a prefix-cache hit)."""
        d = self.seqs[donor]
        assert tokens[: n_blocks * self.block_size] == d.tokens[: n_blocks * self.block_size]
        seq = self.add(seq_id, tokens)
        seq.block_table = d.block_table[:n_blocks]
        seq.num_computed = n_blocks * self.block_size
        return seq

    def fork(self, src: str, dst: str) -> PagedSeq:
        """Copy-on-write fork: share full blocks, copy the partial last block."""
        s = self.seqs[src]
        assert s.num_computed == len(s.tokens) - 1, "fork after a step, before the next"
        child = PagedSeq(list(s.tokens), list(s.block_table), s.num_computed)
        if s.num_computed % self.block_size:
            new_block = self.free.pop()
            self.kv_cache.copy_blocks([(child.block_table[-1], new_block)])
            child.block_table[-1] = new_block
        self.seqs[dst] = child
        return child

    # -- steps --
    def step(self, prefill: list[str], decode: list[str]) -> dict[str, torch.Tensor]:
        """One forward: every uncomputed token of `prefill` seqs, 1 token of `decode` seqs.

        Returns the float32 logits of each sequence's last token.
        """
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        q_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        for name in [*prefill, *decode]:
            seq = self.seqs[name]
            start, end = seq.num_computed, len(seq.tokens)
            if name in decode:
                assert end - start == 1, f"{name} has {end - start} new tokens, not 1"
            self._ensure_blocks(seq, end)
            for p in range(start, end):
                ids.append(seq.tokens[p])
                positions.append(p)
                block = seq.block_table[p // self.block_size]
                slots.append(block * self.block_size + p % self.block_size)
            q_lens.append(end - start)
            seq_lens.append(end)
            tables.append(seq.block_table)
        meta = make_metadata(q_lens, seq_lens, tables, slots, len(prefill), self.model.device)
        dev = self.model.device
        hidden = self.model(
            torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), self.kv_cache, meta
        )
        last_rows = meta.query_start_loc[1:].long() - 1
        logits = self.model.compute_logits(hidden[last_rows])
        for name in [*prefill, *decode]:
            self.seqs[name].num_computed = len(self.seqs[name].tokens)
        return dict(zip([*prefill, *decode], logits, strict=True))

    def greedy(self, names: list[str], max_new_tokens: int, prefill: bool = True) -> None:
        """Prefill `names` together (if asked), then decode all together, appending argmax."""
        pending = list(names) if prefill else []
        for _ in range(max_new_tokens):
            logits = self.step(pending, [n for n in names if n not in pending])
            for name, row in logits.items():
                self.seqs[name].tokens.append(int(row.argmax()))
            pending = []

    def block_kv(self, name: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every computed position of `name`: [seq, kvh, d] each."""
        seq = self.seqs[name]
        k_cache, v_cache = self.kv_cache.layer(layer)
        n = seq.num_computed
        pos = torch.arange(n)
        blocks = torch.tensor(seq.block_table)[pos // self.block_size]
        return k_cache[blocks, pos % self.block_size], v_cache[blocks, pos % self.block_size]


@contextlib.contextmanager
def fresh_library(load, monkeypatch, cache_dir):
    """A compiled library's `load` (a functools.cache'd loader: cpu_kernel.load,
    cpu_ops.load) with its memo cleared and the build cache in `cache_dir`, for a
    test that builds, disables or breaks it; the memo is cleared again after."""
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(cache_dir))
    load.cache_clear()
    try:
        yield cache_dir
    finally:
        load.cache_clear()


def bf16_paths_agree(outs, ref_outs, near_tie: float, tol: float) -> int:
    """Two bf16 runs' greedy outputs (`RequestOutput`s with logprobs, same prompts) token
    by token: each chosen token's logprob within `tol` of the reference's; where the
    tokens differ, the reference's top two must be closer than `near_tie` (a near-tie
    may go either way) and that sequence's comparison stops. Returns how many tokens
    were compared, for the caller to bound from below."""
    compared = 0
    for a, b in zip(outs, ref_outs, strict=True):
        for ta, tb, la, lb in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs, strict=True):
            top = [lp for _, lp in lb.top]
            if ta != tb:
                assert top[0] - top[1] < near_tie, f"{a.token_ids} vs {b.token_ids}"
                break
            assert abs(la.logprob - lb.logprob) <= tol
            compared += 1
    return compared


@contextlib.contextmanager
def started_workers(configs: dict) -> Iterator[dict]:
    """Worker runtimes (`pagedserve.worker.start_worker`) of `configs`, by the same keys;
    all stopped on exit (also those started before one that failed to start)."""
    from pagedserve.worker import start_worker

    rts: dict = {}
    try:
        for name, config in configs.items():
            rts[name] = start_worker(config)
        yield rts
    finally:
        for rt in rts.values():
            rt.stop(grace=0.2)
