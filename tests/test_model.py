"""The paged model against `transformers`, token for token (fp32, greedy).

Tiny random checkpoints (tests/builders.py): llama (6 q / 2 kv heads), llama3
(Llama-3 rope scaling, tied embeddings, 8 q / 2 kv), qwen2 (q/k/v biases, MHA),
qwen3 (q/k norm, 9 q / 3 kv). Block size 8 with prompts of 3, 16 and 21 tokens:
lengths that end mid-block and on a block boundary, all prefilled in one batch and
decoded together. Block ids come from a shuffled free list, so no table is
contiguous.
"""

from __future__ import annotations

import builders
import pytest
import torch
from builders import (
    PagedSession,
    hf_greedy,
    load_hf,
    one_torch_thread,  # noqa: F401 (autouse fixture)
    tiny_checkpoint,
)
from transformers import DynamicCache

from pagedserve.common.core.attention.base import AttentionMetadata
from pagedserve.common.core.kv_cache import KVCache
from pagedserve.common.core.loader import load_model
from pagedserve.common.core.model import can_prepack

ARCHS = ["llama", "llama3", "qwen2", "qwen3"]
NEW_TOKENS = 64


def _prompt(n: int, salt: int) -> list[int]:
    return [3 + (i * 37 + salt * 11) % (builders.TINY_VOCAB - 3) for i in range(n)]


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request):
    """(arch, paged model, transformers model) per tiny architecture."""
    path = tiny_checkpoint(request.param)
    return request.param, load_model(str(path)).model, load_hf(path)


def test_batched_greedy_matches_transformers_generate(tiny):
    arch, model, hf = tiny
    prompts = {"a": _prompt(3, 1), "b": _prompt(16, 2), "c": _prompt(21, 3)}
    sess = PagedSession(model, num_blocks=64, block_size=8, seed=1)
    for name, p in prompts.items():
        sess.add(name, p)
    sess.greedy(list(prompts), NEW_TOKENS)
    for name, p in prompts.items():
        ours = sess.seqs[name].tokens[len(p) :]
        assert len(ours) == NEW_TOKENS
        assert ours == hf_greedy(hf, p, NEW_TOKENS), f"{arch} prompt {name}"


def test_prefix_cache_hit_matches_transformers(tiny):
    """Prompts whose leading blocks are already cached prefill only their suffix:
    one after the donor finished (2 cached blocks, 5 new tokens), one in the very
    step the donor writes the shared block, one with all but its last token cached.
    """
    arch, model, hf = tiny
    bs = 8
    donor = _prompt(19, 4)
    later = donor[:16] + _prompt(5, 5)
    sess = PagedSession(model, num_blocks=96, block_size=bs, seed=2)
    sess.add("donor", donor)
    sess.greedy(["donor"], 4)
    sess.add_with_prefix("later", later, "donor", n_blocks=2)
    almost = donor[:17]
    sess.add_with_prefix("almost", almost, "donor", n_blocks=2)  # 1 new token, fresh block
    # "same_step" reuses block 0 of "writer", which is computed in the same step
    writer = _prompt(12, 6)
    same_step = writer[:8] + _prompt(9, 7)
    sess.add("writer", writer)
    sess._ensure_blocks(sess.seqs["writer"], len(writer))
    sess.add_with_prefix("same_step", same_step, "writer", n_blocks=1)
    sess.seqs["writer"].num_computed = 0
    assert sess.seqs["later"].block_table[:2] == sess.seqs["donor"].block_table[:2]

    sess.greedy(["later", "almost", "writer", "same_step"], NEW_TOKENS)
    for name, prompt in [("later", later), ("almost", almost), ("same_step", same_step)]:
        ours = sess.seqs[name].tokens[len(prompt) :]
        assert ours == hf_greedy(hf, prompt, NEW_TOKENS), f"{arch} {name}"


def test_copy_on_write_fork_matches_transformers(tiny):
    """Fork mid-block: the child shares full blocks, gets a copy of the partial one,
    then takes a different token; parent and child decode together, each exact."""
    arch, model, hf = tiny
    prompt = _prompt(13, 8)
    sess = PagedSession(model, num_blocks=64, block_size=8, seed=3)
    sess.add("parent", prompt)
    sess.greedy(["parent"], 6)  # 18 computed + 1 pending token: block 3 is partial
    parent = sess.seqs["parent"]
    child = sess.fork("parent", "child")
    assert child.block_table[:2] == parent.block_table[:2]
    assert child.block_table[2] != parent.block_table[2]
    child.tokens[-1] = (parent.tokens[-1] + 1) % builders.TINY_VOCAB  # diverge
    parent_prefix, child_prefix = list(parent.tokens), list(child.tokens)
    sess.greedy(["parent", "child"], NEW_TOKENS, prefill=False)
    for name, prefix in [("parent", parent_prefix), ("child", child_prefix)]:
        ours = sess.seqs[name].tokens[len(prefix) :]
        assert ours == hf_greedy(hf, prefix, NEW_TOKENS), f"{arch} {name}"


def test_paged_kv_equals_transformers_dynamic_cache(tiny):
    """K (after RoPE) and V written through the block tables, block by block."""
    arch, model, hf = tiny
    bs = 8
    prompts = {"x": _prompt(21, 9), "y": _prompt(8, 10)}
    sess = PagedSession(model, num_blocks=32, block_size=bs, seed=4)
    for name, p in prompts.items():
        sess.add(name, p)
    sess.step(list(prompts), [])
    for name, p in prompts.items():
        cache = DynamicCache(config=hf.config)
        with torch.inference_mode():
            hf(torch.tensor([p]), cache=cache, use_cache=True)
        table = sess.seqs[name].block_table
        for layer in range(model.spec.num_layers):
            k_ref = cache.layers[layer].keys[0].transpose(0, 1)  # [seq, kvh, d]
            v_ref = cache.layers[layer].values[0].transpose(0, 1)
            k_cache, v_cache = sess.kv_cache.layer(layer)
            for j, block in enumerate(table):
                rows = slice(j * bs, min(len(p), (j + 1) * bs))
                n = rows.stop - rows.start
                torch.testing.assert_close(k_cache[block, :n], k_ref[rows], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(v_cache[block, :n], v_ref[rows], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_logits_close_to_fp32(dtype):
    path = tiny_checkpoint("qwen3")
    prompt = _prompt(20, 11)
    logits = {}
    for dt in (torch.float32, dtype):
        sess = PagedSession(load_model(str(path), dtype=dt).model, num_blocks=16, block_size=8)
        sess.add("s", prompt)
        out = sess.step(["s"], [])["s"]
        assert out.dtype == torch.float32
        logits[dt] = out
    ref, got = logits[torch.float32], logits[dtype]
    rel = float((got - ref).norm() / ref.norm())
    assert rel < 0.05, f"{dtype} logits relative error {rel:.3f}"
    assert int(got.argmax()) == int(ref.argmax())


# torch's bf16 matmul on the CPU is oneDNN too (reordering the weight on every
# call), and the logits came out bit-identical here; another CPU's oneDNN may pick
# different kernels for the two layouts (fp32 sums in another order, an output
# rounding apart now and then), so the bound is 1% of the logits, still far below
# what a wrong weight gives (checked below with a flipped matrix).
PREPACK_REL_TOL = 0.01


# fp32: oneDNN and MKL sum in other orders; relative differences of ~1e-6 are
# rounding, a wrong or stale weight moves the logits by far more than 1e-4
PREPACK_REL_TOL_FP32 = 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases (fused)
def test_prepacked_weights_match_torch_matmuls(arch, dtype):
    """bf16 and fp32 on CPU: the packed matrices (model.can_prepack: in fp32 MKL's
    packed GEMM or oneDNN, measured at load, tests/test_fp32_gemm.py forces each;
    oneDNN in bf16) against torch's own matmul on the same weights; a
    weight changed in place is picked up by `prepack_weights()`; False drops the copies."""
    model = load_model(str(tiny_checkpoint(arch)), dtype=dtype).model
    if not can_prepack(dtype, model.device):
        pytest.skip(f"no oneDNN {dtype} on this CPU")
    tol = PREPACK_REL_TOL if dtype == torch.bfloat16 else PREPACK_REL_TOL_FP32
    assert len(model.layers[0].packed) == 4 and model.lm_head_packed is not None

    def logits() -> torch.Tensor:
        sess = PagedSession(model, num_blocks=16, block_size=8)
        sess.add("s", _prompt(20, 11))
        return sess.step(["s"], [])["s"]

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    packed = logits()
    assert model.prepack_weights(False) is False
    assert model.layers[0].packed == {} and model.lm_head_packed is None
    plain = logits()
    assert rel(packed, plain) < tol
    assert int(packed.argmax()) == int(plain.argmax())

    with torch.no_grad():
        model.layers[1].down_proj.mul_(-1.0)
    changed = logits()
    assert rel(changed, plain) > 10 * PREPACK_REL_TOL  # the change matters
    assert model.prepack_weights() is True
    assert rel(logits(), changed) < tol


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_backend_gives_the_same_greedy_tokens(arch):
    """The model over the Triton kernels (interpreted on CPU) vs the torch backend:
    batched prefill, then a prefix-cache hit prefilled in the same step as two
    decodes, then decode; 17 tokens for the first two sequences, 13 for the third."""
    pytest.importorskip("pagedserve.common.core.attention.triton_backend")
    path = tiny_checkpoint(arch)
    tokens = {}
    for backend in ("torch", "triton"):
        sess = PagedSession(load_model(str(path), attention_backend=backend).model, 32, 8, 6)
        sess.add("a", _prompt(13, 12))
        sess.add("b", _prompt(5, 13))
        sess.greedy(["a", "b"], 4)
        sess.add_with_prefix("c", _prompt(13, 12)[:8] + _prompt(3, 14), "a", n_blocks=1)
        for name, row in sess.step(["c"], ["a", "b"]).items():  # prefill + decode mixed
            sess.seqs[name].tokens.append(int(row.argmax()))
        sess.greedy(["a", "b", "c"], 12, prefill=False)
        tokens[backend] = {name: seq.tokens for name, seq in sess.seqs.items()}
    assert tokens["triton"] == tokens["torch"]


# ---- bad input ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama():
    return load_model(str(tiny_checkpoint("llama"))).model


def _one_prefill(n: int) -> AttentionMetadata:
    return builders.make_metadata([n], [n], [[0, 1]], list(range(n)), 1)


def test_mismatched_positions_are_rejected(llama):
    cache = KVCache(llama.spec, 4, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="equal-length 1-D"):
        llama(torch.tensor([1, 2, 3]), torch.tensor([0, 1]), cache, _one_prefill(3))


def test_token_count_must_match_metadata(llama):
    cache = KVCache(llama.spec, 4, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="got 3 tokens but the metadata describes 4"):
        llama(torch.tensor([1, 2, 3]), torch.arange(3), cache, _one_prefill(4))


def test_out_of_vocab_token_is_rejected(llama):
    cache = KVCache(llama.spec, 4, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 320\)"):
        llama(torch.tensor([1, 320]), torch.arange(2), cache, _one_prefill(2))


def test_kv_cache_of_another_model_is_rejected(llama):
    other = load_model(str(tiny_checkpoint("qwen3"))).spec
    cache = KVCache(other, 4, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="does not fit the model"):
        llama(torch.tensor([1, 2]), torch.arange(2), cache, _one_prefill(2))


def test_kv_cache_dtype_must_match(llama):
    cache = KVCache(llama.spec, 4, 8, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="KV cache dtype torch.bfloat16"):
        llama(torch.tensor([1, 2]), torch.arange(2), cache, _one_prefill(2))


# ---- the default model ---------------------------------------------------------------

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain in two sentences why the sky is blue.",
]


@pytest.fixture(scope="module")
def smollm():
    """SmolLM2-135M-Instruct, paged (fp32) and transformers, from the cached checkpoint."""
    loaded = load_model()
    return loaded, load_hf(loaded.source_dir)


@pytest.mark.slow
def test_default_model_chat_greedy_matches_transformers(smollm):
    loaded, hf = smollm
    from pagedserve.common.api.tokenizer import encode_chat

    prompts = {
        f"chat{i}": encode_chat(loaded.tokenizer, [{"role": "user", "content": text}])
        for i, text in enumerate(CHAT_PROMPTS)
    }
    sess = PagedSession(loaded.model, num_blocks=64, block_size=16, seed=5)
    for name, p in prompts.items():
        sess.add(name, p)
    n_new = 40
    sess.greedy(list(prompts), n_new)
    for name, p in prompts.items():
        ours = sess.seqs[name].tokens[len(p) :]
        assert ours == hf_greedy(hf, p, n_new), name
    answer = loaded.tokenizer.decode(sess.seqs["chat0"].tokens[len(prompts["chat0"]) :])
    assert "Paris" in answer
