"""Rotary position embeddings in HF's half-rotation convention, with linear/llama3 scaling."""

from __future__ import annotations

import math

import torch

from caramba.model.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """The rotary frequencies; local: a hybrid model's sliding layers' (rope_local_theta, unscaled)."""
    d = cfg.head_dim
    theta = cfg.rope_local_theta if local and cfg.rope_local_theta is not None else cfg.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = {} if local else cfg.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if kind == "factors":  # GGUF's rope_freqs tensor: per-frequency divisors
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: linear, llama3, factors)")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_ctx = s.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryTable:
    """cos/sin for every position up to max_positions, computed once in float32."""

    def __init__(self, cfg: ModelConfig, max_positions: int, device: torch.device | str = "cpu",
                 local: bool = False) -> None:
        inv_freq = rope_inv_freq(cfg, local).to(device)
        freqs = torch.arange(max_positions, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, head_dim]
        self.cos = emb.cos()
        # sin with the first half negated: rotate_half(x) * sin == x.roll(half) * signed_sin,
        # which saves the chunk/neg/cat of rotate_half on every call (bit-identical result).
        half = emb.shape[-1] // 2
        self.sin = torch.cat([-emb[:, :half].sin(), emb[:, half:].sin()], dim=-1)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin [B, 1, T, head_dim]."""
        if positions.max() >= self.cos.shape[0]:
            raise ValueError(f"position {int(positions.max())} is past the rotary table ({self.cos.shape[0]})")
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's x * cos + rotate_half(x) * sin, with sin's first half pre-negated (RotaryTable)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
