"""The one config that describes a Llama-family decoder."""

from __future__ import annotations

import json
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
    name: str = "llama"
    extra: dict[str, Any] = field(default_factory=dict)  # provenance (source file, hash, ...)

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """From a transformers config.json (Llama, Mistral, Qwen2 families)."""
        arch = hf.get("model_type", "llama")
        if arch not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"model_type {arch!r} is not supported (supported: llama, mistral, qwen2)")
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
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=bool(hf.get("attention_bias", arch == "qwen2")),
            name=arch,
        )
