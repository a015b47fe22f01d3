"""The cache of decoupled (DBA) attention: semantic keys, geometric keys and values, per layer.

Decoupled attention scores q_sem . k_sem + q_geo . k_geo (caramba.model.decoupled), so its keys
are two streams of different widths that may be stored as different kinds: the geometric keys
(RoPE-rotated, they carry position) are the ones that suffer most from coarse quantization.
The three streams share one `length`, so truncate/reset/reorder move them together.

The attention module hands in keys as one [sem | geo] vector per head (what plain SDPA wants
without a cache); the cache splits them into its two key streams and, for quantized reads, the
query the same way (caramba.cache.attend.attend_pairs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from caramba.cache.attend import attend_pairs
from caramba.cache.kinds import KVCacheTensorConfig
from caramba.cache.layer import CHUNKED_MAX_T, CacheOverflowError, StreamLayerCache, hadamard
from caramba.cache.streams import make_stream


class DecoupledLayerKVCache(StreamLayerCache):
    """k_sem [B, KVH, S, k_sem_dim/KVH], k_geo [.., k_geo_dim/KVH] and v [.., v_dim/KVH] of one
    layer, each stored as its own kind. Widths are totals over the KV heads (as LayerKVCache's).

    rotate_keys: each key stream is multiplied by a Hadamard matrix of its head width before it
    is stored (the query part by the same matrix), which leaves the scores unchanged.
    """

    def __init__(
        self,
        batch_size: int,
        max_seq_len: int,
        k_sem_dim: int,
        k_geo_dim: int,
        v_dim: int,
        k_sem_cfg: KVCacheTensorConfig,
        k_geo_cfg: KVCacheTensorConfig,
        v_cfg: KVCacheTensorConfig,
        device: torch.device | str = "cpu",
        n_kv_heads: int = 1,
        rotate_keys: bool = False,
        dtype: torch.dtype = torch.float32,   # of the full-precision residual windows
    ) -> None:
        if k_sem_dim % n_kv_heads or k_geo_dim % n_kv_heads or v_dim % n_kv_heads:
            raise ValueError(f"k_sem_dim={k_sem_dim}, k_geo_dim={k_geo_dim} and v_dim={v_dim} must divide "
                             f"into {n_kv_heads} heads")
        if min(k_sem_dim, k_geo_dim, v_dim) < 1:
            raise ValueError(f"k_sem_dim={k_sem_dim}, k_geo_dim={k_geo_dim} and v_dim={v_dim} must be >= 1")
        self.batch_size, self.max_seq_len, self.n_kv_heads = batch_size, max_seq_len, n_kv_heads
        self.k_sem_cfg, self.k_geo_cfg, self.v_cfg = k_sem_cfg, k_geo_cfg, v_cfg
        self.sem = k_sem_dim // n_kv_heads   # per-head widths
        geo, hv = k_geo_dim // n_kv_heads, v_dim // n_kv_heads
        self.k_sem_stream = make_stream(batch_size, n_kv_heads, max_seq_len, self.sem, k_sem_cfg, device, dtype,
                                        keys_major=True)
        self.k_geo_stream = make_stream(batch_size, n_kv_heads, max_seq_len, geo, k_geo_cfg, device, dtype,
                                        keys_major=True)
        self.v_stream = make_stream(batch_size, n_kv_heads, max_seq_len, hv, v_cfg, device, dtype)
        # [sem, sem] and [geo, geo], or None
        self.rotations = (hadamard(self.sem, device), hadamard(geo, device)) if rotate_keys else None
        self.length = 0

    @property
    def streams(self) -> tuple:
        return self.k_sem_stream, self.k_geo_stream, self.v_stream

    @property
    def configs(self) -> tuple[KVCacheTensorConfig, ...]:
        return self.k_sem_cfg, self.k_geo_cfg, self.v_cfg

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., sem + geo] -> [..., sem], [..., geo], rotated when rotate_keys is on."""
        sem, geo = x[..., : self.sem], x[..., self.sem :]
        if self.rotations is not None:
            sem, geo = sem @ self.rotations[0].to(x.dtype), geo @ self.rotations[1].to(x.dtype)
        return sem, geo

    def _append(self, k: torch.Tensor, v: torch.Tensor) -> int:
        start, end = self.length, self.length + k.shape[2]
        if end > self.max_seq_len:
            raise CacheOverflowError(f"KV cache holds {self.max_seq_len} tokens; writing {k.shape[2]} more at {start} overflows it")
        k_sem, k_geo = self._split(k)
        self.k_sem_stream.write(start, k_sem)
        self.k_geo_stream.write(start, k_geo)
        self.v_stream.write(start, v)
        self.length = end
        return end

    def _keys(self, end: int, dtype: torch.dtype) -> torch.Tensor:
        """Every cached key as [B, KVH, end, sem + geo] (dequantized, rotation undone)."""
        sem, geo = self.k_sem_stream.read(end, dtype), self.k_geo_stream.read(end, dtype)
        if self.rotations is not None:   # the Hadamard matrices are symmetric and orthogonal
            sem, geo = sem @ self.rotations[0].to(dtype), geo @ self.rotations[1].to(dtype)
        return torch.cat([sem, geo], dim=-1)

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k [B, KVH, T, sem + geo] and v [B, KVH, T, Dv]; return every cached key (as
        [sem | geo]) and value in k's dtype."""
        end = self._append(k, v)
        return self._keys(end, k.dtype), self.v_stream.read(end, v.dtype)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        """Append k, v and attend q [B, H, T, sem + geo] over everything cached -> [B, H, T, Dv],
        with scores (q_sem . k_sem + q_geo . k_geo) / sqrt(sem + geo).

        Short forwards (decode, verification) read each key stream where it lies and add the
        two score matrices before the softmax; prefill reads the prefix once and runs SDPA."""
        end = self._append(k, v)
        if q.shape[2] <= CHUNKED_MAX_T and not causal:
            q_sem, q_geo = self._split(q)
            return attend_pairs([(q_sem, self.k_sem_stream), (q_geo, self.k_geo_stream)], self.v_stream, end, mask,
                                q.shape[-1] ** -0.5)
        keys, values = self._keys(end, q.dtype), self.v_stream.read(end, q.dtype)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal, enable_gqa=True)
