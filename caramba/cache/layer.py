"""Pre-allocated KV cache: one `LayerKVCache` per layer, grouped in a `KVCache` for the model.

Storage is [batch, kv_heads, max_seq_len, head_dim] per stream, allocated once. Slots are
filled left to right; `length` is how many are valid. Rolling back (`truncate`) only moves
`length`, so speculative decoding never recomputes what it keeps.
"""

from __future__ import annotations

import torch

from caramba.cache.kinds import KVCacheTensorConfig


class CacheOverflowError(ValueError):
    """Writing past max_seq_len: raised before any work is done."""


class LayerKVCache:
    def __init__(
        self,
        batch_size: int,
        max_seq_len: int,
        k_dim: int,
        v_dim: int,
        k_cfg: KVCacheTensorConfig,
        v_cfg: KVCacheTensorConfig,
        device: torch.device | str = "cpu",
        n_kv_heads: int = 1,
    ) -> None:
        if k_dim % n_kv_heads or v_dim % n_kv_heads:
            raise ValueError(f"k_dim={k_dim} and v_dim={v_dim} must divide into {n_kv_heads} heads")
        self.batch_size, self.max_seq_len, self.n_kv_heads = batch_size, max_seq_len, n_kv_heads
        self.k_cfg, self.v_cfg = k_cfg, v_cfg
        self.k = torch.zeros(batch_size, n_kv_heads, max_seq_len, k_dim // n_kv_heads, dtype=k_cfg.dtype, device=device)
        self.v = torch.zeros(batch_size, n_kv_heads, max_seq_len, v_dim // n_kv_heads, dtype=v_cfg.dtype, device=device)
        self.length = 0

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v [B, kv_heads, T, head_dim]; return every cached K and V in k's dtype."""
        start, end = self.length, self.length + k.shape[2]
        if end > self.max_seq_len:
            raise CacheOverflowError(f"KV cache holds {self.max_seq_len} tokens; writing {k.shape[2]} more at {start} overflows it")
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        self.length = end
        return self.k[:, :, :end].to(k.dtype), self.v[:, :, :end].to(v.dtype)

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {n}")
        self.length = n

    def reset(self) -> None:
        self.length = 0

    def reorder(self, index: torch.Tensor) -> None:
        """Gather batch rows (beam search, dropping finished rows)."""
        self.k = self.k.index_select(0, index)
        self.v = self.v.index_select(0, index)
        self.batch_size = self.k.shape[0]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def bytes_per_token(self) -> int:
        """Bytes one token occupies in this layer, over the whole batch."""
        return self.nbytes // self.max_seq_len


class KVCache:
    """The model's cache: one LayerKVCache per layer, advanced together."""

    def __init__(self, layers: list[LayerKVCache]) -> None:
        self.layers = layers

    @property
    def length(self) -> int:
        return self.layers[0].length

    @property
    def max_seq_len(self) -> int:
        return self.layers[0].max_seq_len

    @property
    def batch_size(self) -> int:
        return self.layers[0].batch_size

    def check_room(self, n_new: int) -> None:
        if self.length + n_new > self.max_seq_len:
            raise CacheOverflowError(
                f"{self.length} cached + {n_new} new tokens exceed max_seq_len={self.max_seq_len}; "
                "raise max_seq_len or shorten the prompt / max_new_tokens"
            )

    def truncate(self, n: int) -> None:
        for layer in self.layers:
            layer.truncate(n)

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()

    def reorder(self, index: torch.Tensor) -> None:
        for layer in self.layers:
            layer.reorder(index)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def bytes_per_token(self) -> int:
        return sum(layer.bytes_per_token() for layer in self.layers)
