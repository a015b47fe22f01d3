"""The one config that describes a Llama-family decoder."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class ModelConfig:
    vocab_size: int = 49152
    dim: int = 576                 # hidden size
    n_layers: int = 30
    n_heads: int = 9
    n_kv_heads: int = 3            # < n_heads: grouped-query attention
    head_dim: int = 64
    intermediate_size: int = 1536  # SwiGLU hidden width
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "linear"|"llama3", "factor": ..., ...}
    max_position_embeddings: int = 8192
    tie_embeddings: bool = True
    qkv_bias: bool = False         # Qwen2-style checkpoints carry q/k/v biases
    # Family variations (defaults: Llama). GPT-2: "layer", "gelu_tanh", "learned", both biases.
    norm: str = "rms"              # "rms" (RMSNorm) | "layer" (LayerNorm with bias)
    mlp: str = "swiglu"            # "swiglu" | "gelu_tanh" | "gelu" (fc -> GELU -> proj)
    positions: str = "rope"        # "rope" | "learned" (a table of max_position_embeddings rows)
    out_bias: bool = False         # bias on the attention output projection
    mlp_bias: bool = False         # biases on the GELU MLP's fc and proj
    # Trained sliding-window attention (Mistral; Qwen2 when every layer slides): each query sees
    # the newest `sliding_window` slots up to its own, in every layer. None: full attention.
    sliding_window: int | None = None
    # "standard" or "decoupled" (DBA, caramba.model.decoupled): per head, a semantic query/key
    # path of sem_dim without RoPE plus a geometric one of geo_dim with RoPE; values stay head_dim.
    attention: str = "standard"
    sem_dim: int = 0               # per head (query and KV heads alike); decoupled only
    geo_dim: int = 0               # per head, even (RoPE pairs); decoupled only
    name: str = "llama"
    extra: dict[str, Any] = field(default_factory=dict)  # provenance (source file, hash, ...)

    def __post_init__(self) -> None:
        _check_sizes(self)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        _check_attention(self)
        for name, allowed in (("norm", ("rms", "layer")), ("mlp", ("swiglu", "gelu_tanh", "gelu")),
                              ("positions", ("rope", "learned"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r}: use one of {', '.join(allowed)}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"ModelConfig.sliding_window={self.sliding_window} must be >= 1 or None")
        if self.mlp_bias and self.mlp == "swiglu":
            raise ValueError("ModelConfig.mlp_bias needs a GELU mlp (the fused SwiGLU projection has no bias)")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """From a transformers config.json (Llama, Mistral, Qwen2 and GPT-2 families).

        Settings this model cannot compute exactly (a sliding window that can bind, GPT-2's
        per-layer attention scaling, ...) raise ValueError rather than load a different model."""
        if not isinstance(hf, dict):
            raise ValueError(f"must hold a JSON object (model_type, hidden_size, ...), not a {type(hf).__name__}")
        arch = hf.get("model_type", "llama")
        if arch == "gpt2":
            return cls(**_gpt2_fields(hf))
        if arch not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"model_type {arch!r} is not supported (supported: llama, mistral, qwen2, gpt2)")
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
            _hf_size(hf, key)
        for key in ("num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window"):
            if hf.get(key) is not None:
                _hf_size(hf, key)
        window = _check_llama_family(arch, hf)
        n_heads = hf["num_attention_heads"]
        dim = hf["hidden_size"]
        scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
        if scaling is not None:
            scaling = dict(scaling)
            scaling["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
            if scaling["rope_type"] == "default":
                scaling = None
        theta = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            vocab_size=hf["vocab_size"],
            dim=dim,
            n_layers=hf["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=hf.get("head_dim") or dim // n_heads,
            intermediate_size=hf["intermediate_size"],
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=_hf_float(theta, "rope_theta"),
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=bool(hf.get("attention_bias", arch == "qwen2")),
            out_bias=arch == "llama" and bool(hf.get("attention_bias", False)),  # Llama's biases q, k, v and o
            sliding_window=window,
            name=arch,
        )


# HF activation names -> ModelConfig.mlp. The tanh forms (gelu_new is GPT-2's) are one function.
GELU_ACTIVATIONS = {
    "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_python_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh", "gelu_accurate": "gelu_tanh", "gelu": "gelu", "gelu_python": "gelu",
}


def _check_llama_family(arch: str, hf: dict[str, Any]) -> int | None:
    """Refuse what caramba would compute differently; return the sliding window every layer uses
    (None: full attention, or a window no position can reach past)."""
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act {act!r} is not supported for {arch} (its MLP is SwiGLU: silu)")
    if hf.get("mlp_bias"):
        raise ValueError("mlp_bias: true is not supported (the fused gate|up projection has no bias)")
    # Qwen2 / Mistral sliding-window layers attend to the last `sliding_window` keys only; with
    # full attention that is the same model only while no position can reach past the window.
    window = hf.get("sliding_window")
    if arch == "qwen2" and not hf.get("use_sliding_window", False):
        window = None
    if window is None or window >= hf.get("max_position_embeddings", 2048):
        return None
    layer_types = hf.get("layer_types")
    if layer_types is None:  # Qwen2 slides from max_window_layers on, Mistral everywhere
        first = hf.get("max_window_layers", 0) if arch == "qwen2" else 0
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(hf["num_hidden_layers"])]
    if "sliding_attention" not in layer_types:
        return None
    if "full_attention" in layer_types:
        raise ValueError(f"sliding_window={window} is used by some layers of this {arch} model and not by others; "
                         "caramba applies one window to every layer, so it would compute a different model past "
                         f"{window} tokens. Set use_sliding_window: false (or sliding_window: null) in config.json "
                         "if the model was trained without it.")
    return int(window)


def _gpt2_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """GPT-2: learned positions, LayerNorm, GELU MLP, biases everywhere, no RoPE."""
    if not hf.get("scale_attn_weights", True):
        raise ValueError("scale_attn_weights: false is not supported (caramba scales scores by 1/sqrt(head_dim))")
    if hf.get("scale_attn_by_inverse_layer_idx", False):
        raise ValueError("scale_attn_by_inverse_layer_idx: true is not supported (caramba scales every layer's "
                         "scores by 1/sqrt(head_dim) only)")
    # reorder_and_upcast_attn only makes HF's eager attention compute in float32: the same function.
    act = hf.get("activation_function", "gelu_new")
    if act not in GELU_ACTIVATIONS:
        raise ValueError(f"activation_function {act!r} is not supported for gpt2 "
                         f"(supported: {', '.join(GELU_ACTIVATIONS)})")
    dim, n_heads = _hf_size(hf, "n_embd"), _hf_size(hf, "n_head")
    for key in ("vocab_size", "n_layer", "n_positions"):
        _hf_size(hf, key)
    if hf.get("n_inner") is not None:
        _hf_size(hf, "n_inner")
    if dim % n_heads:
        raise ValueError(f"n_embd={dim} is not a multiple of n_head={n_heads}")
    return dict(
        vocab_size=hf["vocab_size"], dim=dim, n_layers=hf["n_layer"], n_heads=n_heads, n_kv_heads=n_heads,
        head_dim=dim // n_heads, intermediate_size=hf.get("n_inner") or 4 * dim,
        norm_eps=hf.get("layer_norm_epsilon", 1e-5), max_position_embeddings=hf["n_positions"],
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), qkv_bias=True, out_bias=True, mlp_bias=True,
        norm="layer", mlp=GELU_ACTIVATIONS[act], positions="learned", name="gpt2",
    )


def _check_attention(cfg: ModelConfig) -> None:
    """The attention switch and the decoupled (DBA) widths."""
    if cfg.attention not in ("standard", "decoupled"):
        raise ValueError(f"ModelConfig.attention={cfg.attention!r}: use standard or decoupled")
    if cfg.attention == "standard":
        if cfg.sem_dim or cfg.geo_dim:
            raise ValueError("ModelConfig.sem_dim/geo_dim are for attention: decoupled; drop them or set it")
        return
    if cfg.sem_dim < 1 or cfg.geo_dim < 2 or cfg.geo_dim % 2:
        raise ValueError(f"attention: decoupled needs sem_dim >= 1 and an even geo_dim >= 2 (per head); "
                         f"got sem_dim={cfg.sem_dim}, geo_dim={cfg.geo_dim}")
    if getattr(cfg, "positions", "rope") != "rope":
        raise ValueError("attention: decoupled needs RoPE positions (its geometric path is rotary)")
    if cfg.geo_dim > cfg.head_dim:   # its pairs turn at head_dim's RoPE frequencies
        raise ValueError(f"geo_dim={cfg.geo_dim} must be <= head_dim={cfg.head_dim}")


# Upper bounds far past any real checkpoint (the largest today: ~256k vocabulary, hidden size
# ~25k, ~130 layers, 10M positions): a config past them is a typo or a hostile file, and some of
# these sizes allocate before any weight is read (the RoPE table covers max_position_embeddings).
SIZE_LIMITS = {
    "vocab_size": 1 << 24, "dim": 1 << 16, "n_layers": 1024, "n_heads": 1024, "n_kv_heads": 1024,
    "head_dim": 1 << 13, "intermediate_size": 1 << 19, "max_position_embeddings": 1 << 24,
}
_HF_LIMITS = {  # transformers' names for the same sizes
    "vocab_size": "vocab_size", "hidden_size": "dim", "n_embd": "dim", "num_hidden_layers": "n_layers",
    "n_layer": "n_layers", "num_attention_heads": "n_heads", "n_head": "n_heads", "num_key_value_heads": "n_kv_heads",
    "head_dim": "head_dim", "intermediate_size": "intermediate_size", "n_inner": "intermediate_size",
    "max_position_embeddings": "max_position_embeddings", "n_positions": "max_position_embeddings",
    "sliding_window": "max_position_embeddings",
}


def _size_problem(value: Any, limit: int) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return f"must be a positive integer, not {type(value).__name__} {value!r}"
    if value < 1:
        return "must be a positive integer"
    if value > limit:
        return f"is absurdly large (at most {limit:,})"
    return None


def _hf_float(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key}={value!r} must be a number")
    return float(value)


def _hf_size(hf: dict[str, Any], key: str) -> int:
    """hf[key] as a size, or ValueError naming the config.json field (KeyError when absent)."""
    value = hf[key]
    problem = _size_problem(value, SIZE_LIMITS[_HF_LIMITS[key]])
    if problem:
        raise ValueError(f"{key}={value!r} {problem}")
    return value


def _check_sizes(cfg: ModelConfig) -> None:
    for name, limit in SIZE_LIMITS.items():
        problem = _size_problem(getattr(cfg, name), limit)
        if problem:
            raise ValueError(f"ModelConfig.{name}={getattr(cfg, name)!r} {problem}")
    for name in ("sem_dim", "geo_dim"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= SIZE_LIMITS["head_dim"]:
            raise ValueError(f"ModelConfig.{name}={value!r} must be an integer from 0 to {SIZE_LIMITS['head_dim']}")
    if cfg.sliding_window is not None:
        problem = _size_problem(cfg.sliding_window, SIZE_LIMITS["max_position_embeddings"])
        if problem:
            raise ValueError(f"ModelConfig.sliding_window={cfg.sliding_window!r} {problem}")
    for name in ("norm_eps", "rope_theta"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"ModelConfig.{name}={value!r} must be a finite number > 0")
