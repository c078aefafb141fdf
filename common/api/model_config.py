"""What the model needs to know about a checkpoint, parsed once from its HF config.

`ModelSpec` is the single place where a Hugging Face `config.json` (or a
`PretrainedConfig`) is read and checked. Everything downstream (the model, the
KV cache, the engine's block budget, the block hashes) reads the spec, never the
raw config, so an unsupported checkpoint fails here, at load time, with a message
that names the offending field.

Supported: the Llama family as `transformers` writes it —
  llama, mistral   plain GQA decoder (Mistral's sliding window only caps the length)
  qwen2            + q/k/v projection biases
  qwen3            + RMSNorm over each q and k head before RoPE
RoPE types: default, linear, llama3.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class UnsupportedModelError(ValueError):
    """A checkpoint this package cannot run (architecture, feature or shape)."""


SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelSpec:
    """The shape and numerics of a Llama-family decoder."""

    architecture: str  # "llama" | "mistral" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None, or {"rope_type": "linear"|"llama3", ...}
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (qwen2 always; llama if attention_bias)
    qk_norm: bool  # qwen3: RMSNorm over each head of q and k before RoPE
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    o_proj_bias: bool = False  # llama/qwen3 with attention_bias=True also bias o_proj
    mlp_bias: bool = False  # llama's mlp_bias: biases on gate/up/down
    sliding_window: int | None = None  # mistral: attention window; caps max_model_len

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_q_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise UnsupportedModelError(f"{name} must be a positive int, got {value!r}")
        if self.num_q_heads % self.num_kv_heads != 0:
            raise UnsupportedModelError(
                f"num_q_heads ({self.num_q_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise UnsupportedModelError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not (self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps)):
            raise UnsupportedModelError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise UnsupportedModelError(f"rope_theta must be > 0, got {self.rope_theta}")
        _check_rope_scaling(self.rope_scaling)
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise UnsupportedModelError(f"sliding_window must be > 0, got {self.sliding_window}")

    # ---- derived sizes ----------------------------------------------------------

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def q_size(self) -> int:
        return self.num_q_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def max_model_len(self) -> int:
        """Longest sequence this model computes exactly.

        Sliding-window attention is not implemented: with a window, sequences are
        capped at the window, where full attention and windowed attention agree.
        """
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V of one token over all layers."""
        itemsize = dtype.itemsize  # torch.dtype.itemsize: no tensor, no torch import here
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one KV block takes in the cache (all layers, K and V)."""
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        return block_size * self.kv_bytes_per_token(dtype)

    def digest(self) -> str:
        """A stable hex digest of every field (independent of dtype and process)."""
        canon = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"), default=list)
        return hashlib.sha256(canon.encode()).hexdigest()

    # ---- parsing ------------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, cfg: Any) -> ModelSpec:
        """Parse a `transformers` config object or a `config.json` dict.

        Both the 4.x layout (`rope_theta`, `rope_scaling`) and the 5.x layout
        (`rope_parameters`) are accepted.
        """
        d = _config_dict(cfg)
        arch = d.get("model_type")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {arch!r} (model_type in config.json); "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        _reject_unsupported_features(arch, d)
        hidden = _req(d, "hidden_size")
        n_q = _req(d, "num_attention_heads")
        n_kv = d.get("num_key_value_heads") or n_q
        head_dim = d.get("head_dim") or hidden // n_q
        rope_theta, rope_scaling = _parse_rope(d)
        attention_bias = bool(d.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=_req(d, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_req(d, "intermediate_size"),
            num_layers=_req(d, "num_hidden_layers"),
            num_q_heads=n_q,
            num_kv_heads=n_kv,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_req(d, "max_position_embeddings"),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # qwen2 always biases q/k/v and never o_proj; llama/mistral/qwen3 follow
            # `attention_bias` for all four projections.
            attention_bias=True if arch == "qwen2" else attention_bias,
            qk_norm=arch == "qwen3",
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_eos_ids(d.get("eos_token_id")),
            o_proj_bias=False if arch == "qwen2" else attention_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            sliding_window=_sliding_window(arch, d),
        )


def _config_dict(cfg: Any) -> dict:
    if isinstance(cfg, Mapping):
        return dict(cfg)
    to_dict = getattr(cfg, "to_dict", None)
    if to_dict is None:
        raise TypeError(f"expected a transformers config or a dict, got {type(cfg).__name__}")
    return to_dict()


def _req(d: dict, key: str) -> Any:
    if d.get(key) is None:
        raise UnsupportedModelError(f"config is missing required field {key!r}")
    return d[key]


def _eos_ids(eos: Any) -> tuple[int, ...]:
    if eos is None:
        return ()
    if isinstance(eos, int):
        return (eos,)
    return tuple(int(e) for e in eos)


def _reject_unsupported_features(arch: str, d: dict) -> None:
    quant = d.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "unknown") if isinstance(quant, Mapping) else quant
        raise UnsupportedModelError(
            f"quantized checkpoints are not supported (quantization_config: quant_method "
            f"{method!r}); pagedserve loads float32/float16/bfloat16 weights"
        )
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only 'silu')")
    if d.get("pretraining_tp", 1) not in (1, None):
        raise UnsupportedModelError("pretraining_tp > 1 is not supported")
    partial = (d.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise UnsupportedModelError(f"partial_rotary_factor {partial} is not supported")


def _sliding_window(arch: str, d: dict) -> int | None:
    window = d.get("sliding_window")
    if window is None:
        return None
    if arch in ("qwen2", "qwen3"):
        # Qwen applies the window only with use_sliding_window (and only from
        # layer max_window_layers on); the released models leave it off.
        if not d.get("use_sliding_window", False):
            return None
        layer_types = d.get("layer_types") or []
        if all(t == "full_attention" for t in layer_types) and layer_types:
            return None
    return int(window)


def _parse_rope(d: dict) -> tuple[float, dict | None]:
    """Returns (theta, scaling) from either the 4.x or the 5.x config layout."""
    params = d.get("rope_parameters")
    if isinstance(params, Mapping) and "rope_theta" in params:
        params = dict(params)
        theta = float(params.pop("rope_theta"))
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "default":
            return theta, None
        params["rope_type"] = rope_type
        params.pop("type", None)
        return theta, params
    if isinstance(params, Mapping):
        raise UnsupportedModelError(
            f"per-layer-type rope_parameters are not supported (got keys {sorted(params)})"
        )
    theta = float(d.get("rope_theta", 10000.0))
    scaling = d.get("rope_scaling")
    if not scaling:
        return theta, None
    scaling = dict(scaling)
    rope_type = scaling.pop("type", None) or scaling.get("rope_type", "default")
    if rope_type == "default":
        return theta, None
    scaling["rope_type"] = rope_type
    if rope_type == "llama3":
        scaling.setdefault("original_max_position_embeddings", d.get("max_position_embeddings"))
    return theta, scaling


def _check_rope_scaling(scaling: dict | None) -> None:
    if scaling is None:
        return
    rope_type = scaling.get("rope_type")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope scaling type {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    needed = {
        "linear": ("factor",),
        "llama3": (
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ),
    }.get(rope_type, ())
    missing = [k for k in needed if scaling.get(k) is None]
    if missing:
        raise UnsupportedModelError(f"rope scaling {rope_type!r} is missing {missing}")
