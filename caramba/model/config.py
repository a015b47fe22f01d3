"""The one config that describes a decoder: Llama and the families that differ from it in parts
(GPT-2, Qwen2/3, Mistral, Phi-3, OLMo 2, Gemma 2/3), each part a field, never a forked model."""

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
    mlp: str = "swiglu"            # "swiglu" | "geglu" (gate through tanh GELU: Gemma) | "gelu_tanh" | "gelu" (fc -> GELU -> proj)
    positions: str = "rope"        # "rope" | "learned" (a table of max_position_embeddings rows)
    out_bias: bool = False         # bias on the attention output projection
    mlp_bias: bool = False         # biases on the GELU MLP's fc and proj
    # Trained sliding-window attention (Mistral; Qwen2 when every layer slides): each query sees
    # the newest `sliding_window` slots up to its own, in every layer. None: full attention.
    sliding_window: int | None = None
    # Hybrid attention (Gemma 2/3): per layer "sliding" (the window above) or "full". None: every
    # layer alike (sliding_window, if set, binds in all of them).
    layer_types: list[str] | None = None
    rope_local_theta: float | None = None   # RoPE base of the sliding layers (Gemma 3: 1e4); None: rope_theta
    # Parts of the newer families, each off by default (Llama):
    qk_norm: str | None = None     # RMSNorm of queries and keys before RoPE: "head" (per head: Qwen3,
                                   # Gemma 3) or "projection" (over all heads' width: OLMo 2)
    pre_norms: bool = True         # norm before attention and MLP (OLMo 2 has none)
    post_norms: bool = False       # norm of the attention and MLP outputs before the residual (Gemma, OLMo 2)
    embed_scale: float | None = None    # embeddings times this (Gemma: sqrt(dim), in the model's dtype)
    attn_scale: float | None = None     # scores' scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_softcap: float | None = None   # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # the same on the logits (Gemma 2)
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
        for name, allowed in (("norm", ("rms", "layer")), ("mlp", ("swiglu", "geglu", "gelu_tanh", "gelu")),
                              ("positions", ("rope", "learned")), ("qk_norm", (None, "head", "projection"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r}: use one of {', '.join(allowed)}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"ModelConfig.sliding_window={self.sliding_window} must be >= 1 or None")
        if self.mlp_bias and self.mlp in ("swiglu", "geglu"):
            raise ValueError("ModelConfig.mlp_bias needs a GELU mlp (the fused gate|up projection has no bias)")
        _check_hybrid(self)

    def is_sliding(self, layer: int) -> bool:
        """Whether `layer` attends within sliding_window (every layer does when layer_types is None)."""
        if self.sliding_window is None:
            return False
        return self.layer_types is None or self.layer_types[layer] == "sliding"

    def layer_window(self, layer: int) -> int | None:
        """The trained window that binds in `layer` (None: full attention)."""
        return self.sliding_window if self.is_sliding(layer) else None

    @property
    def hybrid(self) -> bool:
        """Sliding and full layers side by side: masks, RoPE tables and cache rings differ per layer type."""
        return self.sliding_window is not None and self.layer_types is not None \
            and len(set(self.layer_types)) > 1

    @property
    def score_scale(self) -> float:
        """The attention scores' scale: attn_scale, or 1 / sqrt(head_dim)."""
        return self.head_dim ** -0.5 if self.attn_scale is None else self.attn_scale

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """From a transformers config.json (Llama, Mistral, Qwen2/3, Phi-3, OLMo 2, Gemma 2/3 and GPT-2).

        Settings this model cannot compute exactly (a sliding window that can bind, GPT-2's
        per-layer attention scaling, ...) raise ValueError rather than load a different model."""
        if not isinstance(hf, dict):
            raise ValueError(f"must hold a JSON object (model_type, hidden_size, ...), not a {type(hf).__name__}")
        arch = hf.get("model_type", "llama")
        if arch == "gpt2":
            return cls(**_gpt2_fields(hf))
        if arch in ("gemma2", "gemma3", "gemma3_text"):
            return cls(**_gemma_fields(arch, hf))
        if arch not in LLAMA_LIKE:
            raise ValueError(f"model_type {arch!r} is not supported (supported: {', '.join(SUPPORTED_HF)})")
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
            _hf_size(hf, key)
        for key in ("num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window"):
            if hf.get(key) is not None:
                _hf_size(hf, key)
        window, layer_types = _check_llama_family(arch, hf)
        n_heads = hf["num_attention_heads"]
        dim = hf["hidden_size"]
        scaling, theta = _hf_rope(hf.get("rope_scaling") or hf.get("rope_parameters"), hf.get("rope_theta"))
        if (scaling or {}).get("partial_rotary_factor", 1.0) != 1.0 or hf.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial_rotary_factor < 1 is not supported (caramba rotates every pair of a head)")
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
            # Llama, Qwen3 and OLMo 2 bias q, k, v and o alike
            out_bias=arch in ("llama", "qwen3", "olmo2") and bool(hf.get("attention_bias", False)),
            sliding_window=window,
            layer_types=layer_types,
            qk_norm={"qwen3": "head", "olmo2": "projection"}.get(arch),
            pre_norms=arch != "olmo2",
            post_norms=arch == "olmo2",
            name=arch,
        )


# Families whose config.json reads like Llama's (with the parts from_hf names per family).
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2")
SUPPORTED_HF = (*LLAMA_LIKE, "gemma2", "gemma3", "gemma3_text", "gpt2")


def _hf_rope(params: dict | None, theta: Any) -> tuple[dict | None, float]:
    """(rope_scaling or None, rope_theta) from config.json's rope_scaling / rope_parameters."""
    scaling = None
    if params is not None:
        if not isinstance(params, dict):
            raise ValueError(f"rope_scaling / rope_parameters must be an object, not {params!r}")
        scaling = dict(params)
        scaling["rope_type"] = scaling.pop("rope_type", scaling.pop("type", "default"))
        own = scaling.pop("rope_theta", None)
        theta = theta if theta is not None else own
        if scaling["rope_type"] not in ("default", "linear", "llama3"):
            raise ValueError(f"rope type {scaling['rope_type']!r} is not supported (supported: default, linear, llama3)")
        if scaling["rope_type"] == "default" and scaling.get("partial_rotary_factor", 1.0) == 1.0:
            scaling = None
    return scaling, _hf_float(theta if theta is not None else 10000.0, "rope_theta")


def _gemma_fields(arch: str, hf: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2 and 3: (1 + w) RMSNorms (folded into the weights when they load: state_dict), four
    norms per layer, GeGLU, scaled embeddings, the query pre-attention scalar, sliding and full
    layers side by side (Gemma 3: each with its own RoPE base; QK-norm), Gemma 2's soft-capping."""
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        _hf_size(hf, key)
    for key in ("num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window"):
        if hf.get(key) is not None:
            _hf_size(hf, key)
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if GELU_ACTIVATIONS.get(act) != "gelu_tanh":
        raise ValueError(f"hidden_activation {act!r} is not supported for {arch} (its MLP is GeGLU with tanh GELU)")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention: true is not supported (caramba decodes causally)")
    n, dim, n_heads = hf["num_hidden_layers"], hf["hidden_size"], hf["num_attention_heads"]
    gemma3 = arch != "gemma2"
    layer_types = hf.get("layer_types")
    if layer_types is None:   # transformers' defaults: Gemma 2 alternates, Gemma 3 has every 6th layer full
        every = 2 if not gemma3 else int(hf.get("sliding_window_pattern") or 6)
        layer_types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    if not isinstance(layer_types, list) or len(layer_types) != n \
            or not set(layer_types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types must list sliding_attention / full_attention for each of the {n} layers")
    params = hf.get("rope_parameters") or {}
    full = params.get("full_attention", params) if isinstance(params, dict) else params
    local = params.get("sliding_attention", {}) if isinstance(params, dict) else {}
    scaling, theta = _hf_rope(full if full else hf.get("rope_scaling"), hf.get("rope_theta") or (1e6 if gemma3 else None))
    local_scaling, local_theta = _hf_rope(local or None, hf.get("rope_local_base_freq") or (1e4 if gemma3 else theta))
    if local_scaling is not None:
        raise ValueError("rope scaling of the sliding layers is not supported (only of the full ones)")
    window = hf.get("sliding_window")
    soft = {k: _hf_float(hf[k], k) if hf.get(k) is not None else None
            for k in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar")}
    head_dim = hf.get("head_dim") or dim // n_heads
    return dict(
        vocab_size=hf["vocab_size"], dim=dim, n_layers=n, n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads, head_dim=head_dim,
        intermediate_size=hf["intermediate_size"], norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta, rope_scaling=scaling, max_position_embeddings=hf.get("max_position_embeddings", 8192),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), qkv_bias=bool(hf.get("attention_bias", False)),
        out_bias=bool(hf.get("attention_bias", False)), mlp="geglu", sliding_window=window,
        layer_types=None if window is None else ["sliding" if t == "sliding_attention" else "full" for t in layer_types],
        rope_local_theta=local_theta if gemma3 and local_theta != theta else None,
        qk_norm="head" if gemma3 else None, post_norms=True, embed_scale=float(dim) ** 0.5,
        attn_scale=(soft["query_pre_attn_scalar"] or head_dim) ** -0.5,
        attn_softcap=soft["attn_logit_softcapping"], final_softcap=soft["final_logit_softcapping"],
        name="gemma2" if not gemma3 else "gemma3",
    )


# HF activation names -> ModelConfig.mlp. The tanh forms (gelu_new is GPT-2's) are one function.
GELU_ACTIVATIONS = {
    "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_python_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh", "gelu_accurate": "gelu_tanh", "gelu": "gelu", "gelu_python": "gelu",
}


def _check_llama_family(arch: str, hf: dict[str, Any]) -> tuple[int | None, list[str] | None]:
    """Refuse what caramba would compute differently; return the sliding window and, where only
    some layers slide (Qwen2/3 from max_window_layers on), each layer's type (None: all alike)."""
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act {act!r} is not supported for {arch} (its MLP is SwiGLU: silu)")
    if hf.get("mlp_bias"):
        raise ValueError("mlp_bias: true is not supported (the fused gate|up projection has no bias)")
    # Sliding-window layers attend to the last `sliding_window` keys only; with full attention that
    # is the same model only while no position can reach past the window.
    window = hf.get("sliding_window")
    if arch in ("qwen2", "qwen3") and not hf.get("use_sliding_window", False):
        window = None
    if window is None or window >= hf.get("max_position_embeddings", 2048):
        return None, None
    layer_types = hf.get("layer_types")
    if layer_types is None:  # Qwen2/3 slide from max_window_layers on, Mistral and Phi-3 everywhere
        first = hf.get("max_window_layers", 0) if arch in ("qwen2", "qwen3") else 0
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(hf["num_hidden_layers"])]
    if not isinstance(layer_types, list) or len(layer_types) != hf["num_hidden_layers"] \
            or not set(layer_types) <= {"sliding_attention", "full_attention"}:
        raise ValueError("layer_types must list sliding_attention / full_attention for every layer")
    if "sliding_attention" not in layer_types:
        return None, None
    if "full_attention" not in layer_types:
        return int(window), None
    return int(window), ["sliding" if t == "sliding_attention" else "full" for t in layer_types]


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


def _check_hybrid(cfg: ModelConfig) -> None:
    """Per-layer attention types, their RoPE base and the remaining scalar parts."""
    if cfg.layer_types is not None:
        if not isinstance(cfg.layer_types, list) or len(cfg.layer_types) != cfg.n_layers \
                or not set(cfg.layer_types) <= {"sliding", "full"}:
            raise ValueError(f"ModelConfig.layer_types must list 'sliding' or 'full' for each of the {cfg.n_layers} layers")
        if cfg.sliding_window is None:
            raise ValueError("ModelConfig.layer_types needs a sliding_window for its sliding layers")
    if cfg.rope_local_theta is not None and cfg.layer_types is None:
        raise ValueError("ModelConfig.rope_local_theta is the sliding layers' RoPE base: it needs layer_types")
    for name in ("rope_local_theta", "embed_scale", "attn_scale", "attn_softcap", "final_softcap"):
        value = getattr(cfg, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            raise ValueError(f"ModelConfig.{name}={value!r} must be a finite number > 0 or None")
    if (cfg.qk_norm or cfg.post_norms or not cfg.pre_norms) and cfg.norm != "rms":
        raise ValueError("ModelConfig.qk_norm / post_norms / pre_norms: false go with norm: rms")


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
