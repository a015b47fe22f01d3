"""Decoupled Bottleneck Attention (DBA): a semantic path without RoPE and a geometric path with it.

Per head, the query and key are [sem | geo]: sem_dim semantic channels that are never rotated
(what a token is) and geo_dim geometric channels rotated by RoPE (where it is). Scores add the
two paths before one softmax, which is just a dot product of the concatenated vectors:

    score = (q_sem . k_sem + q_geo . k_geo) / sqrt(sem_dim + geo_dim)

The scale is the usual 1/sqrt(d_k) of that concatenated width (sum of sem_dim + geo_dim
unit-variance products); a converted checkpoint folds any other scale into its query weights
(caramba.model.dba_convert). Values keep head_dim per head, grouped-query heads share KV heads as
in standard attention. Without a cache this is one SDPA call; the cache
(caramba.cache.decoupled.DecoupledLayerKVCache) stores k_sem, k_geo and v as three streams.

The geometric path's RoPE turns its pairs at head_dim's geo_dim/2 fastest frequencies
theta^(-2i/head_dim), i < geo_dim/2, in HF's half-rotation layout over geo_dim, so a checkpoint
converted from a standard model keeps those pairs' exact rotations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from caramba.cache import CachePolicy, DecoupledLayerKVCache, KVCache
from caramba.model.config import ModelConfig
from caramba.gemm import linear
from caramba.model.rope import apply_rope


class DecoupledAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.sem, self.qk_dim = cfg.sem_dim, cfg.sem_dim + cfg.geo_dim
        # Rows: every query head's [sem | geo], every KV head's [sem | geo], then the values.
        self.qk_width = (cfg.n_heads + cfg.n_kv_heads) * self.qk_dim
        self.wqkv = nn.Linear(cfg.dim, self.qk_width + cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=getattr(cfg, "out_bias", False))
        pairs = list(range(cfg.geo_dim // 2))
        self._cols = pairs + [p + cfg.head_dim // 2 for p in pairs]   # of the head_dim-wide rotary table
        self._index: dict[torch.device, torch.Tensor] = {}

    def _geo_index(self, device: torch.device) -> torch.Tensor:
        index = self._index.get(device)
        if index is None:
            index = self._index[device] = torch.tensor(self._cols, device=device)
        return index

    def forward(self, x, cos, sin, cache, mask: torch.Tensor | None, causal: bool):
        B, T, _ = x.shape
        H, KVH = self.n_heads, self.n_kv_heads
        qkv = linear(self.wqkv, x)
        qk = qkv[..., : self.qk_width].view(B, T, H + KVH, self.qk_dim).transpose(1, 2)    # [B, H+KVH, T, sem+geo]
        v = qkv[..., self.qk_width :].view(B, T, KVH, self.head_dim).transpose(1, 2)       # [B, KVH, T, D]
        index = self._geo_index(cos.device)
        geo = apply_rope(qk[..., self.sem :], cos.index_select(-1, index), sin.index_select(-1, index))
        q, k = torch.cat([qk[..., : self.sem], geo], dim=-1).split([H, KVH], dim=1)
        if cache is not None:
            y = cache.attend(q, k, v, mask, causal)                  # appends k (as k_sem, k_geo) and v
        else:   # SDPA's default scale is 1/sqrt(q.shape[-1]) = 1/sqrt(sem + geo)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
        return linear(self.wo, y.transpose(1, 2).reshape(B, T, H * self.head_dim))


def decoupled_cache(cfg: ModelConfig, batch_size: int, max_seq_len: int, policy: CachePolicy,
                    device: torch.device, dtype: torch.dtype) -> KVCache:
    """One DecoupledLayerKVCache per layer, as the policy says (k_sem, k_geo, v per layer)."""
    policy.check_streams(decoupled=True)
    kvh = cfg.n_kv_heads
    layers = []
    for i in range(cfg.n_layers):
        layers.append(DecoupledLayerKVCache(batch_size, max_seq_len, kvh * cfg.sem_dim, kvh * cfg.geo_dim,
                                            kvh * cfg.head_dim, device=device, n_kv_heads=kvh, dtype=dtype,
                                            **policy.for_decoupled_layer(i)))
    return KVCache(layers)
