"""Pre-allocated KV cache: one `LayerKVCache` per layer, grouped in a `KVCache` for the model.

Storage is [batch, kv_heads, max_seq_len, head_dim] per stream (caramba.cache.streams), allocated once. Slots are
filled left to right; `length` is how many are valid. Rolling back (`truncate`) only moves
`length`, so speculative decoding never recomputes what it keeps.
"""

from __future__ import annotations

import torch

from caramba.cache.attend import attend_chunked
from caramba.cache.kinds import KVCacheTensorConfig
from caramba.cache.mask import attention_mask, narrowest
from caramba.cache.quant import quantize
from caramba.cache.sdpa import attention, softcapped_attention
from caramba.cache.streams import make_stream

# Queries per step up to which a quantized cache is read in chunks (decode, speculative
# verification); longer forwards (prefill) dequantize the prefix once and use SDPA.
CHUNKED_MAX_T = 16


class CacheOverflowError(ValueError):
    """Writing past max_seq_len: raised before any work is done."""


def hadamard(n: int, device=None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The orthonormal Sylvester-Hadamard matrix [n, n]; symmetric, so it is its own inverse."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"rotate_keys / rotate_values need a power-of-two head_dim; got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n**0.5).to(device=device, dtype=dtype)


class StreamLayerCache:
    """What every layer cache does the same way over its streams (caramba.cache.streams), which
    share one `length`: a subclass sets `streams`, `configs`, `batch_size`, `length`."""

    streams: tuple
    configs: tuple[KVCacheTensorConfig, ...]
    # Called by the attention before it attends, with (q, k, v, cos, sin, mask, causal): a press
    # collecting what it scores with during a context prefill (caramba.press). None: nobody.
    observer = None

    @property
    def quantized(self) -> bool:
        return any(s.quantized for s in self.streams)

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {n}")
        self.length = n

    def set_origins(self, first: torch.Tensor | None) -> None:
        """Each row's (KV head's) first real slot, first [B] or [B, KVH] (None: 0): where a kind whose
        quantization groups run along tokens (per-channel keys, caramba.cache.streams.
        ChannelQuantStream.set_origins) starts a row's groups, so a row behind holes groups its
        tokens as it does alone. Set on an empty layer; the other kinds ignore it."""
        for s in self.streams:
            if hasattr(s, "set_origins"):
                s.set_origins(first)

    def reset(self) -> None:
        self.length = 0
        for s in self.streams:
            s.reset()

    def reorder(self, index: torch.Tensor) -> None:
        """Gather batch rows (beam search, dropping finished rows)."""
        for s in self.streams:
            s.reorder(index)
        self.batch_size = int(index.numel())

    @property
    def nbytes(self) -> int:
        """Bytes allocated: codes, scales, values and residual windows of every stream."""
        return sum(t.numel() * t.element_size() for s in self.streams for t in s.tensors())

    def bytes_per_token(self) -> int:
        """Bytes one token occupies in this layer, over the whole batch (analytic; the fixed
        residual windows are not per-token and are left out: bytes_at counts them)."""
        return self.batch_size * sum(c.bytes_per_token(s.n_heads, s.head_dim) for c, s in zip(self.configs, self.streams))

    def bytes_at(self, tokens: int) -> int:
        """Bytes this layer holds for a context of `tokens`: every token's codes or values, plus the
        full-precision copies a quantized kind's residual window keeps of the newest of them (a
        window longer than the context keeps every token twice: no cheaper than full precision)."""
        total = self.bytes_per_token() * tokens
        for s in self.streams:
            R = getattr(s, "R", 0)
            if R:
                total += self.batch_size * s.n_heads * s.head_dim * s.ring.element_size() * min(tokens, R)
        return total


class LayerKVCache(StreamLayerCache):
    """K and V of one layer, each stored as its own kind (KVCacheTensorConfig).

    rotate_keys: keys are multiplied by a per-head Hadamard matrix before they are stored and
    queries by the same matrix before q.k, which leaves q.k unchanged (the matrix is orthogonal)
    but spreads outlier channels across the block, so 4-bit keys lose less.
    rotate_values: values are stored multiplied by a per-head Hadamard matrix H and the attention
    output is multiplied by H again (sum_i p_i (v_i H) = (sum_i p_i v_i) H, and H H = I). llama.cpp
    does both by default for quantized K and V (its attn_rot_k / attn_rot_v; docs/kv-cache.md).
    """

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
        rotate_keys: bool = False,
        dtype: torch.dtype = torch.float32,   # of the full-precision residual window
        rotate_values: bool = False,
    ) -> None:
        if k_dim % n_kv_heads or v_dim % n_kv_heads:
            raise ValueError(f"k_dim={k_dim} and v_dim={v_dim} must divide into {n_kv_heads} heads")
        self.batch_size, self.max_seq_len, self.n_kv_heads = batch_size, max_seq_len, n_kv_heads
        self.k_cfg, self.v_cfg = k_cfg, v_cfg
        self.k_dim, self.v_dim, self.device, self.dtype = k_dim, v_dim, device, dtype
        hk, hv = k_dim // n_kv_heads, v_dim // n_kv_heads
        self.k_stream = make_stream(batch_size, n_kv_heads, max_seq_len, hk, k_cfg, device, dtype, keys_major=True)
        self.v_stream = make_stream(batch_size, n_kv_heads, max_seq_len, hv, v_cfg, device, dtype)
        # [hk, hk]: any orthogonal matrix works (benchmarks/kv_quality.py's key_order=pairs sets a
        # permutation); `unrotation` is its inverse, the transpose (the Hadamard matrix's own).
        self.rotation = self.unrotation = hadamard(hk, device) if rotate_keys else None
        self.v_rotation = hadamard(hv, device) if rotate_values else None   # [hv, hv]
        self.length = 0

    @property
    def k(self) -> torch.Tensor:
        """The stored K: values for float kinds, codes for quantized ones."""
        return self.k_stream.data if not self.k_stream.quantized else self.k_stream.codes

    @property
    def v(self) -> torch.Tensor:
        return self.v_stream.data if not self.v_stream.quantized else self.v_stream.codes

    def _append(self, k: torch.Tensor, v: torch.Tensor) -> int:
        """Write k, v at the next slots; return how many slots attention reads ([0, end))."""
        start, end = self.length, self.length + k.shape[2]
        if end > self.max_seq_len:
            raise CacheOverflowError(f"KV cache holds {self.max_seq_len} tokens; writing {k.shape[2]} more at {start} overflows it")
        self._store(start, k, v)
        self.length = end
        return end

    def _store(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [B, KVH, T, D] into storage slots [start, start + T)."""
        if self.rotation is not None:
            k = k @ self.rotation.to(k.dtype)
        if self.v_rotation is not None:
            v = v @ self.v_rotation.to(v.dtype)
        ks, vs = self.k_stream, self.v_stream
        if ks.quantized and vs.quantized and (ks.kind, ks.block) == (vs.kind, vs.block) and k.shape == v.shape \
                and not ks.spec.per_channel:
            # One quantize call for both: a decode step is dominated by per-op overhead.
            codes, scales = quantize(torch.cat([k, v], dim=1), ks.spec, ks.block)
            H = k.shape[1]
            ks.write(start, k, (codes[:, :H], scales[:, :H]))
            vs.write(start, v, (codes[:, H:], scales[:, H:]))
        else:
            ks.write(start, k)
            vs.write(start, v)

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v [B, kv_heads, T, head_dim]; return every cached K and V in k's dtype
        (dequantized, and with the key and value rotations undone)."""
        return self.contents(self._append(k, v), k.dtype)

    def contents(self, end: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of slots [0, end) as values [B, KVH, end, D], rotations undone: what another
        cache stores in its own kind when it takes this one's context (caramba.evaluation.task_eval)."""
        keys, values = self.k_stream.read(end, dtype), self.v_stream.read(end, dtype)
        if self.rotation is not None:
            keys = keys @ self.unrotation.to(dtype)
        if self.v_rotation is not None:
            values = values @ self.v_rotation.to(dtype)
        return keys, values

    def like(self, batch_size: int, max_seq_len: int) -> LayerKVCache:
        """An empty plain layer of this one's kinds and rotations with its own batch and slots."""
        return LayerKVCache(batch_size, max_seq_len, self.k_dim, self.v_dim, self.k_cfg, self.v_cfg, self.device,
                            self.n_kv_heads, rotate_keys=self.rotation is not None, dtype=self.dtype,
                            rotate_values=self.v_rotation is not None)

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append k, v [B, KVH, T, D] values (stored in this cache's kinds) without attending."""
        self._append(k, v)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        """Append k, v and attend q [B, H, T, D] over everything cached -> [B, H, T, Dv].

        The new tokens are read back from the cache like the old ones, so a T-token forward
        gives what T one-token forwards give (speculative verification relies on it)."""
        if not self.quantized and self.rotation is None and self.v_rotation is None:
            k, v = self.update(k, v)                                       # [B, KVH, S, D]
            return attention(q, k, v, mask, causal)
        end = self._append(k, v)
        if self.rotation is not None:
            q = q @ self.rotation.to(q.dtype)
        if q.shape[2] <= CHUNKED_MAX_T and not causal:
            out = attend_chunked(q, self.k_stream, self.v_stream, end, mask)
        else:
            keys, values = self.k_stream.read(end, q.dtype), self.v_stream.read(end, q.dtype)   # prefill: once
            out = attention(q, keys, values, mask, causal)
        return out if self.v_rotation is None else out @ self.v_rotation.to(out.dtype)

    def attend_softcapped(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                          causal: bool, cap: float) -> torch.Tensor:
        """attend() with the scores soft-capped before the softmax (Gemma 2): no fused kernel
        computes that, so every cached K and V is read back and the scores are materialized."""
        keys, values = self.update(k, v)
        return softcapped_attention(q, keys, values, mask, causal, cap)

    @property
    def streams(self) -> tuple:
        return self.k_stream, self.v_stream

    @property
    def configs(self) -> tuple[KVCacheTensorConfig, ...]:
        return self.k_cfg, self.v_cfg


class KVCache:
    """The model's cache: one LayerKVCache per layer, advanced together."""

    # Sliding-window attention span in slots (caramba.infer.plan): each query sees the `window`
    # newest slots up to its own. None: every slot. It changes outputs; set it only on purpose.
    window: int | None = None

    def __init__(self, layers: list[LayerKVCache]) -> None:
        self.layers = layers

    def key_slots(self, end: int) -> torch.Tensor | None:
        """Which slot each stored key holds once `end` slots are written, in storage order;
        None when storage is slot order [0, end) (a ring buffer, caramba.cache.ring, is not)."""
        return None

    def attention_mask(self, B: int, T: int, slot_mask: torch.Tensor | None, device: torch.device,
                       window: int | None = None, model_window: int | None = None) -> tuple[torch.Tensor | None, bool]:
        """(mask [B, 1, T, n] | None, causal) for a forward that writes T slots after `length`
        (caramba.cache.mask.attention_mask), over the keys as this cache stores them.

        window: a span the caller asks for; it must agree with this cache's own `window` when
        both are set. model_window: the model's trained sliding window, which binds as well.
        slot_mask [B, >= S]: True where a slot is a real token."""
        if self.window is not None and window not in (None, self.window):
            raise ValueError(f"window={window} disagrees with the cache's window={self.window}")
        start = self.length
        span = narrowest(self.window if window is None else window, model_window)
        return attention_mask(B, T, start, slot_mask, device, span, self.key_slots(start + T))

    def layer_masks(self, B: int, T: int, slot_mask: torch.Tensor | None, device: torch.device,
                    window: int | None, layer_windows: list[int | None]) -> list[tuple[torch.Tensor | None, bool]]:
        """attention_mask per layer, each with its own trained window (layer_windows[i]: a hybrid
        model's sliding layers have one, its full layers none); built once per distinct window."""
        built: dict[int | None, tuple[torch.Tensor | None, bool]] = {}
        for w in dict.fromkeys(layer_windows):
            built[w] = self.attention_mask(B, T, slot_mask, device, window, w)
        return [built[w] for w in layer_windows]

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

    def set_origins(self, first: torch.Tensor | None) -> None:
        """Each row's first real slot [B] (StreamLayerCache.set_origins) on every layer that numbers
        its slots as the model does (not a ring's, whose slot s lies at s % capacity)."""
        for layer in self.layers:
            if type(layer) is LayerKVCache:
                layer.set_origins(first)

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

    def bytes_at(self, tokens: int) -> int:
        """Bytes holding a context of `tokens`, residual windows included (a hybrid cache's rings stop
        growing: caramba.cache.hybrid). The one count a frontier's and an eval's byte axis read."""
        return sum(layer.bytes_at(tokens) for layer in self.layers)

    def bytes_per_token_at(self, tokens: int) -> int:
        """bytes_at(tokens) / tokens, rounded: the byte axis of a frontier at that context length."""
        return round(self.bytes_at(tokens) / max(tokens, 1))
