"""ModelSpec parsing, KV cache arithmetic and storage, checkpoint loading and its errors."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import builders
import pytest
import torch
from builders import (
    one_torch_thread,  # noqa: F401 (autouse fixture)
    tiny_checkpoint,
    tiny_config,
    tiny_tokenizer,
)
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from pagedserve.common.api import checkpoint
from pagedserve.common.api.checkpoint import DEFAULT_MODEL
from pagedserve.common.api.model_config import ModelSpec, UnsupportedModelError
from pagedserve.common.api.tokenizer import encode_chat
from pagedserve.common.core import loader
from pagedserve.common.core.kv_cache import KVCache, num_blocks_for_budget
from pagedserve.common.core.loader import load_model, resolve_model_dir

# SmolLM2-135M's config.json, in part (tests override fields: {**SMOLLM_CONFIG, ...}).
SMOLLM_CONFIG = {
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


# ---- ModelSpec ------------------------------------------------------------------------


def test_spec_from_config_dict_smollm2_shape():
    spec = ModelSpec.from_hf_config(SMOLLM_CONFIG)
    assert (spec.architecture, spec.num_layers, spec.num_q_heads, spec.num_kv_heads) == (
        "llama",
        30,
        9,
        3,
    )
    assert (spec.head_dim, spec.group_size, spec.rope_theta) == (64, 3, 100000.0)
    assert spec.tie_word_embeddings and not spec.attention_bias and not spec.qk_norm
    assert spec.eos_token_ids == (2,) and spec.rope_scaling is None
    # DESIGN.md: 22.5 KiB per token in fp16, 360 KiB per 16-token block
    assert spec.kv_bytes_per_token(torch.float16) == 23040
    assert spec.kv_bytes_per_block(16, torch.float16) == 368640
    assert spec.kv_bytes_per_block(16, torch.float32) == 737280


@pytest.mark.parametrize(
    "arch, expect",
    [
        ("llama", dict(attention_bias=False, qk_norm=False, num_kv_heads=2, head_dim=16)),
        ("qwen2", dict(attention_bias=True, o_proj_bias=False, qk_norm=False, num_kv_heads=4)),
        ("qwen3", dict(attention_bias=False, qk_norm=True, num_q_heads=9, head_dim=16)),
    ],
)
def test_spec_from_transformers_config_objects(arch, expect):
    spec = ModelSpec.from_hf_config(tiny_config(arch))
    assert spec.architecture == arch
    for field, value in expect.items():
        assert getattr(spec, field) == value, field


def test_llama3_rope_scaling_in_both_config_layouts():
    v5 = ModelSpec.from_hf_config(tiny_config("llama3"))  # rope_parameters
    v4 = ModelSpec.from_hf_config(  # rope_theta + rope_scaling with the old "type" key
        {
            **SMOLLM_CONFIG,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        }
    )
    for spec in (v4, v5):
        assert spec.rope_theta == 500000.0
        assert spec.rope_scaling["rope_type"] == "llama3"
        assert spec.rope_scaling["factor"] == 8.0


def test_mistral_window_caps_max_model_len_and_qwen_window_needs_opt_in():
    mistral = AutoConfig.for_model("mistral", sliding_window=256, max_position_embeddings=1024)
    assert ModelSpec.from_hf_config(mistral).max_model_len == 256
    qwen2 = AutoConfig.for_model("qwen2", sliding_window=256, max_position_embeddings=1024)
    assert ModelSpec.from_hf_config(qwen2).max_model_len == 1024


def test_spec_digest_is_stable_and_field_sensitive():
    a = ModelSpec.from_hf_config(SMOLLM_CONFIG)
    b = ModelSpec.from_hf_config(dict(SMOLLM_CONFIG))
    c = ModelSpec.from_hf_config({**SMOLLM_CONFIG, "rope_theta": 10000.0})
    assert a.digest() == b.digest() != c.digest()


@pytest.mark.parametrize(
    "override, message",
    [
        ({"model_type": "gpt2"}, "unsupported architecture 'gpt2'"),
        ({"model_type": None}, "unsupported architecture None"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"num_key_value_heads": 4}, r"num_q_heads \(9\) must be a multiple of num_kv_heads \(4\)"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling type 'yarn'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "missing"),
        ({"vocab_size": None}, "missing required field 'vocab_size'"),
        ({"head_dim": 63, "hidden_size": 567}, "head_dim must be even"),
    ],
)
def test_unsupported_configs_are_named(override, message):
    with pytest.raises(UnsupportedModelError, match=message):
        ModelSpec.from_hf_config({**SMOLLM_CONFIG, **override})


# ---- KV cache ---------------------------------------------------------------------------


def test_num_blocks_for_budget():
    spec = ModelSpec.from_hf_config(SMOLLM_CONFIG)
    assert num_blocks_for_budget(spec, 16, torch.float16, 4 << 30) == (4 << 30) // 368640
    assert num_blocks_for_budget(spec, 16, torch.float16, 368640) == 1
    with pytest.raises(ValueError, match="one block of 16 tokens needs 368640 bytes"):
        num_blocks_for_budget(spec, 16, torch.float16, 368639)


def _filled_cache(num_blocks: int = 6) -> KVCache:
    spec = ModelSpec.from_hf_config(tiny_config("qwen3"))
    cache = KVCache(spec, num_blocks, 4, torch.float32, "cpu")
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(0)))
    return cache


def test_kv_cache_layout_and_layer_views():
    cache = _filled_cache()
    # block-major: [blocks, layers, 2, block_size, kv_heads, head_dim]
    assert tuple(cache.kv.shape) == (6, 2, 2, 4, 3, 16)
    k, v = cache.layer(1)
    assert k.shape == v.shape == (6, 4, 3, 16)
    assert torch.equal(k[5], cache.kv[5, 1, 0]) and torch.equal(v[2], cache.kv[2, 1, 1])
    # one block (every layer's K and V) is one contiguous run of bytes_per_block
    assert cache.kv[3].is_contiguous()
    assert cache.kv[3].numel() * cache.kv.element_size() == cache.bytes_per_block
    assert k.stride(0) == cache.kv[3].numel()
    assert cache.nbytes == 6 * cache.bytes_per_block


def test_kv_cache_layer_views_are_made_once_and_follow_a_replaced_kv():
    """`layer` hands out the same two views every call (made once: the forward asks per
    layer per step), writes through them land in `kv`, views made under inference mode
    are ordinary tensors, and a replaced `kv` gets views of its own."""
    cache = _filled_cache()
    with torch.inference_mode():
        k, v = cache.layer(1)
    assert not k.is_inference() and not v.is_inference()
    assert cache.layer(1)[0] is k and cache.layer(1)[1] is v and cache.layer(-1)[0] is k
    k[2, 1].fill_(7.0)
    assert torch.equal(cache.kv[2, 1, 0, 1], torch.full((3, 16), 7.0))
    cache.kv = torch.zeros_like(cache.kv)
    k2, _ = cache.layer(1)
    assert k2 is not k and k2.data_ptr() == cache.kv[:, 1, 0].data_ptr() and not k2.any()


def test_copy_blocks_copies_every_layer_and_reads_before_writing():
    cache = _filled_cache()
    before = cache.kv.clone()
    cache.copy_blocks([(0, 1), (1, 2)])  # 1 is both a dst and a src: src read first
    assert torch.equal(cache.kv[1], before[0])
    assert torch.equal(cache.kv[2], before[1])
    untouched = [0, 3, 4, 5]
    assert torch.equal(cache.kv[untouched], before[untouched])


def test_read_write_blocks_round_trip_between_caches():
    src, dst = _filled_cache(), _filled_cache()
    dst.kv.zero_()
    data = src.read_blocks([4, 1])
    assert tuple(data.shape) == (2, 2, 2, 4, 3, 16) and data.is_contiguous()
    dst.write_blocks([0, 5], data)
    assert torch.equal(dst.kv[0], src.kv[4])
    assert torch.equal(dst.kv[5], src.kv[1])
    assert int(dst.kv[1:5].count_nonzero()) == 0


def test_kv_cache_bad_input():
    cache = _filled_cache()
    with pytest.raises(ValueError, match=r"block ids \[6\] out of range \[0, 6\)"):
        cache.copy_blocks([(6, 0)])
    with pytest.raises(ValueError, match="duplicate destination"):
        cache.copy_blocks([(0, 2), (1, 2)])
    with pytest.raises(ValueError, match="data shape"):
        cache.write_blocks([0], torch.zeros(2, 2, 2, 4, 3, 16))
    with pytest.raises(ValueError, match="num_blocks must be > 0"):
        KVCache(cache.spec, 0, 4, torch.float32, "cpu")


# ---- loading ----------------------------------------------------------------------------


def test_load_tiny_checkpoint_identity_and_eos():
    path = tiny_checkpoint("llama")
    a = load_model(str(path))
    b = load_model(str(path), dtype=torch.bfloat16)
    other_weights = load_model(str(tiny_checkpoint("llama", seed=1)))
    assert a.model_id == b.model_id  # dtype-independent
    assert a.model_id.startswith("llama-0@") and len(a.model_id.split("@")[1]) == 16
    assert other_weights.model_id.split("@")[1] != a.model_id.split("@")[1]
    assert a.source_dir == path and a.spec.eos_token_ids == (2,)
    assert a.model.embed_tokens.dtype == torch.float32
    assert b.model.layers[0].qkv_proj.dtype == torch.bfloat16
    assert a.tokenizer.chat_template == builders.CHAT_TEMPLATE


def test_fused_weights_hold_the_checkpoint_tensors():
    path = tiny_checkpoint("qwen2")
    tensors = load_file(str(path / "model.safetensors"))
    layer = load_model(str(path)).model.layers[1]
    q, k, v = (tensors[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(layer.qkv_proj, torch.cat([q, k, v]).t())  # stored [in, out]
    qb, kb, vb = (tensors[f"model.layers.1.self_attn.{p}_proj.bias"] for p in "qkv")
    assert torch.equal(layer.qkv_bias, torch.cat([qb, kb, vb]))
    gate, up = (tensors[f"model.layers.1.mlp.{p}_proj.weight"] for p in ("gate", "up"))
    assert torch.equal(layer.gate_up_proj, torch.cat([gate, up]).t())


def _copy_checkpoint(tmp_path: Path, arch: str = "llama") -> Path:
    dst = tmp_path / f"copy-{arch}"
    shutil.copytree(tiny_checkpoint(arch), dst)
    return dst


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_generation_config_eos_ids_are_added(tmp_path):
    ckpt = _copy_checkpoint(tmp_path)
    _edit_json(ckpt / "generation_config.json", eos_token_id=[2, 7])
    assert load_model(str(ckpt)).spec.eos_token_ids == (2, 7)


def test_unsupported_architecture_fails_at_load(tmp_path):
    ckpt = _copy_checkpoint(tmp_path)
    _edit_json(ckpt / "config.json", model_type="gpt2")
    with pytest.raises(UnsupportedModelError, match="unsupported architecture 'gpt2'"):
        load_model(str(ckpt))


def _rewrite_weights(ckpt: Path, edit) -> None:
    tensors = load_file(str(ckpt / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(ckpt / "model.safetensors"))


def test_missing_extra_and_misshapen_tensors_are_named(tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"
    ckpt = _copy_checkpoint(tmp_path)
    _rewrite_weights(ckpt, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=f"checkpoint lacks 1 tensors, e.g. \\['{name}'\\]"):
        load_model(str(ckpt))
    _rewrite_weights(ckpt, lambda t: t.update({name: torch.zeros(32, 96)}))
    load_model(str(ckpt))  # complete again
    _rewrite_weights(ckpt, lambda t: t.update({"model.layers.2.mlp.up_proj.weight": t[name] + 1}))
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.2.mlp.up_proj.weight'"):
        load_model(str(ckpt))
    _rewrite_weights(
        ckpt,
        lambda t: (
            t.pop("model.layers.2.mlp.up_proj.weight"),
            t.update({name: torch.zeros(8, 96)}),
        ),
    )
    with pytest.raises(ValueError, match=r"has shape \(8, 96\), expected \(32, 96\)"):
        load_model(str(ckpt))


def test_bad_paths_dtypes_devices_and_backends(tmp_path):
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache"):
        load_model("HuggingFaceTB/SmolLM2-360M-no-such-model")
    with pytest.raises(FileNotFoundError, match="never downloads"):
        load_model("not a path or an id")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_model(str(tmp_path))
    path = str(tiny_checkpoint("llama"))
    with pytest.raises(ValueError, match="dtype torch.int8 is not supported"):
        load_model(path, dtype=torch.int8)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            load_model(path, device="cuda")
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        load_model(path, attention_backend="flash")
    ckpt = _copy_checkpoint(tmp_path)
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(str(ckpt))


def test_head_dim_the_triton_kernels_cannot_run_fails_at_load(tmp_path):
    pytest.importorskip("pagedserve.common.core.attention.triton_backend")
    ckpt = tmp_path / "wide-heads"
    ckpt.mkdir()  # the check precedes any weight read: a config is enough
    (ckpt / "config.json").write_text(
        json.dumps({**SMOLLM_CONFIG, "hidden_size": 4608, "head_dim": 512})
    )
    with pytest.raises(ValueError, match="backend 'triton' cannot run this model: head_dim 512"):
        load_model(str(ckpt), attention_backend="triton")


# ---- the default model's cache -------------------------------------------------------------


@pytest.mark.slow
def test_default_checkpoint_cache_is_a_plain_hf_dir():
    path = resolve_model_dir(None)
    assert path == resolve_model_dir(DEFAULT_MODEL) == resolve_model_dir("default")
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama" and config["num_key_value_heads"] == 3
    assert (path / "model.safetensors").is_file()
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == 2
    tok = loader.load_tokenizer(path)
    ids = encode_chat(tok, [{"role": "user", "content": "Hi"}])
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")


def test_cache_is_published_atomically_and_reused(tmp_path, monkeypatch):
    """The cache protocol, with the 25 s dequantization replaced by copying a tiny
    checkpoint: concurrent first loads both get a complete dir, later loads convert
    nothing, and no temp dir is left behind. (The real conversion runs in
    test_model's default-model test whenever the cache is cold.)"""
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    calls = []
    both_inside = threading.Barrier(2, timeout=60)  # 60 s: a liveness bound

    def slow_copy(gguf: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        if len(calls) <= 2:
            both_inside.wait()  # both first loads are inside the conversion at once
        for f in tiny_checkpoint("llama").iterdir():
            shutil.copy(f, out_dir / f.name)

    monkeypatch.setattr(loader, "_convert_gguf", slow_copy)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(resolve_model_dir(None)))
               for _ in range(2)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dest = tmp_path / "models" / DEFAULT_MODEL
    assert results == [dest, dest] and len(calls) == 2
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [DEFAULT_MODEL]
    assert (dest / "model.safetensors").is_file()
    assert resolve_model_dir(None) == dest and len(calls) == 2  # cached: no conversion
    _edit_json(dest / checkpoint._SOURCE_MARKER, gguf_bytes=1)  # a different GGUF
    assert resolve_model_dir(None) == dest and len(calls) == 3  # rebuilt


# ---- tokenizer ------------------------------------------------------------------------------


def test_encode_chat_applies_the_template():
    tok = tiny_tokenizer()
    ids = encode_chat(tok, [{"role": "user", "content": "hello world"}])
    assert (
        ids == tok("<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    )
    with pytest.raises(ValueError, match="message 0 must be a dict with 'role' and 'content'"):
        encode_chat(tok, [{"text": "hi"}])
    with pytest.raises(ValueError, match="must not be empty"):
        encode_chat(tok, [])
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        encode_chat(tok, [{"role": "user", "content": "hi"}])


def test_tied_lm_head_is_the_embedding():
    model = load_model(str(tiny_checkpoint("llama3"))).model  # tie_word_embeddings
    assert torch.equal(model.lm_head, model.embed_tokens.t())
    hidden = torch.randn(3, model.spec.hidden_size)
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ model.embed_tokens.t())


def _hub_cache(tmp_path: Path, repo_id: str, revision: str = "main") -> Path:
    """A Hugging Face hub cache holding the tiny checkpoint as `repo_id`, laid out
    as huggingface_hub lays it out (refs/<revision> -> snapshots/<commit>)."""
    cache = tmp_path / "hub"
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(tiny_checkpoint("llama"), repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / revision).write_text(commit)
    return cache


def test_model_by_hub_id_from_the_local_cache(tmp_path, monkeypatch):
    cache = _hub_cache(tmp_path, "TinyOrg/tiny-llama")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    path = loader.resolve_model_dir("TinyOrg/tiny-llama")
    assert path.parent.parent.name == "models--TinyOrg--tiny-llama"
    assert loader.resolve_model_dir("TinyOrg/tiny-llama@main") == path
    by_id = load_model("TinyOrg/tiny-llama")
    assert by_id.model_id.startswith("TinyOrg/tiny-llama@")
    assert by_id.model_id.split("@")[-1] == load_model(str(path)).model_id.split("@")[-1]
    with pytest.raises(FileNotFoundError, match=f"local Hugging Face cache \\({cache}\\)"):
        loader.resolve_model_dir("TinyOrg/other-model")
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache"):
        loader.resolve_model_dir("TinyOrg/tiny-llama@v2")


def test_hub_cache_location_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert checkpoint.hub_cache_dir() == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert checkpoint.hub_cache_dir() == tmp_path / "elsewhere"


def test_quantized_checkpoint_is_refused_before_loading_weights(tmp_path):
    ckpt = _copy_checkpoint(tmp_path)
    _edit_json(ckpt / "config.json", quantization_config={"quant_method": "awq", "bits": 4})
    with pytest.raises(UnsupportedModelError, match="quantized checkpoints are not supported.*awq"):
        load_model(str(ckpt))
