"""A hybrid model's cache (Gemma 2/3): sliding layers keep a ring of their window, full layers every slot.

In Gemma 3, 5 of every 6 layers attend only to the newest `sliding_window` (512) slots. Their
cache is a ring (SlidingLayerKVCache) of window + SLACK storage slots, slot s stored at s % capacity,
so its bytes stay flat however long the context grows; the full layers are plain LayerKVCaches. Both
count `length` in slots (rotary positions keep growing), and the cache builds each layer type's
attention mask over its own storage order (`layer_masks`).

A forward of T new tokens into a ring:
- T <= SLACK + 1 (decode steps, speculative verification): write, then read the ring, like every
  other cache (the new token at slot s overwrites slot s - capacity, which no query of the forward
  can see);
- longer (a prompt's chunks): attend over the ring as it was plus the new tokens read back in the
  ring's kind (quantized, rotated, as a write and read would give them), then store the newest
  capacity of them. So a prompt of any length needs no more than the window.

SLACK is the room a rollback needs (speculative decoding truncates rejected drafts: the slots it
gives back must not have been overwritten). truncate refuses to go back further. 16 is the fused
step's most token rows (caramba.model.fast_decode.MAX_ROWS): 3% of Gemma 3's window.

A press (caramba.press, caramba.cache.evict) presses the full layers only: they are what grows
with the context, while a ring already holds no more than its window and its storage slots are
numbered by the slots (s % capacity), so dropping ring slots would save nothing and break that
numbering. A pressed hybrid cache (`pressed_at`: the context's slots when it was pressed) keeps
the model's slot numbers, which are the rings' (its length, room and new tokens' slots are the
unpressed cache's): its full layers are a ragged press's layers (PressedLayerKVCache /
PackedLayerKVCache: each head's survivors in order, right-aligned before pressed_at, then the new
tokens), whose slot i is the model's i + offset, offset = pressed_at - the layer's width. The
full layers' mask is the model's over slots [0, length + T) with the context's slots all allowed
(each full layer masks its own holes per head: caramba.cache.evict), the rings' mask is as before;
the decoding state's slot mask (left padding) stays, in the same slot numbers.
"""

from __future__ import annotations

import torch

from caramba.cache.layer import KVCache, LayerKVCache
from caramba.cache.mask import attention_mask, narrowest
from caramba.cache.sdpa import attention

SLACK = 16


def _offset(layer) -> int:
    """The model's slot of the layer's slot 0: a pressed full layer's offset (caramba.cache.evict), else 0."""
    return getattr(layer, "offset", 0)


def ring_slots(end: int, capacity: int, device) -> torch.Tensor | None:
    """The slot each storage slot of a ring holds once slots [0, end) are written (None: storage
    order is still slot order)."""
    if end <= capacity:
        return None
    i = torch.arange(capacity, device=device)
    return end - 1 - (end - 1 - i) % capacity


class SlidingLayerKVCache(LayerKVCache):
    """A sliding layer's K and V in a ring of window + SLACK storage slots (max_seq_len is the
    ring's capacity, `length` counts slots)."""

    window: int = 0

    def writes_first(self, T: int) -> bool:
        """Whether a forward of T tokens writes the ring before reading it (else reads, then writes):
        when it overwrites no slot a query of it can see, or nothing at all."""
        return T <= self.max_seq_len - self.window + 1 or self.length + T <= self.max_seq_len

    def _append(self, k: torch.Tensor, v: torch.Tensor) -> int:
        """Write k, v [B, KVH, T, D] at slots [length, length + T) modulo the capacity (only the
        newest capacity of them when T is longer); return the storage slots to read."""
        start, T, C = self.length, k.shape[2], self.max_seq_len
        skip = max(0, T - C)
        at, n = (start + skip) % C, T - skip
        first = min(n, C - at)
        self._store(at, k[:, :, skip:skip + first], v[:, :, skip:skip + first])
        if first < n:
            self._store(0, k[:, :, skip + first:], v[:, :, skip + first:])
        self.length = start + T
        return min(self.length, C)

    def _read_then_write(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the ring as it is, then of the new tokens as the ring's kind gives them
        back ([B, KVH, stored + T, D], rotations undone); the new tokens are then written."""
        old_k, old_v = self.contents(min(self.length, self.max_seq_len), k.dtype)
        scratch = self.like(k.shape[0], k.shape[2])   # the same kinds and rotations: a write and a read
        scratch._append(k, v)
        new_k, new_v = scratch.contents(k.shape[2], k.dtype)
        keys, values = torch.cat([old_k, new_k], dim=2), torch.cat([old_v, new_v], dim=2)   # copies: the old may be views
        self._append(k, v)
        return keys, values

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.writes_first(k.shape[2]):
            return super().update(k, v)
        return self._read_then_write(k, v)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               causal: bool) -> torch.Tensor:
        if self.writes_first(k.shape[2]):
            return super().attend(q, k, v, mask, causal)
        keys, values = self._read_then_write(k, v)
        return attention(q, keys, values, mask, causal)

    def slot_contents(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(K, V, first): the slots the ring holds, [first, length), in slot order (rotations undone):
        what another ring of the model takes when it is given this one's context."""
        n = min(self.length, self.max_seq_len)
        keys, values = self.contents(n, dtype)
        slots = ring_slots(self.length, self.max_seq_len, keys.device)
        if slots is not None:
            order = slots.argsort()
            keys, values = keys[:, :, order], values[:, :, order]
        return keys, values, self.length - n

    def key_slots(self, start: int, T: int, device) -> torch.Tensor | None:
        """The slot of each key a forward of T tokens at `start` reads, in the order it reads them."""
        if self.writes_first(T):
            return ring_slots(start + T, self.max_seq_len, device)
        old = ring_slots(start, self.max_seq_len, device)
        if old is None:
            return None     # the ring as written so far, then the new tokens: slots [0, start + T)
        return torch.cat([old, torch.arange(start, start + T, device=device)])

    def like(self, batch_size: int, max_seq_len: int) -> LayerKVCache:
        return LayerKVCache(batch_size, max_seq_len, self.k_dim, self.v_dim, self.k_cfg, self.v_cfg, self.device,
                            self.n_kv_heads, rotate_keys=self.rotation is not None, dtype=self.dtype,
                            rotate_values=self.v_rotation is not None)


class HybridKVCache(KVCache):
    """Per layer a SlidingLayerKVCache (where `sliding[i]`) or a LayerKVCache holding max_seq_len slots."""

    def __init__(self, layers: list[LayerKVCache], sliding: list[bool], window: int) -> None:
        for layer, ring in zip(layers, sliding):
            if type(layer) is not LayerKVCache:
                raise ValueError(f"a hybrid cache needs standard attention layers; got {type(layer).__name__}")
            if ring:
                for stream in layer.streams:
                    if getattr(stream, "spec", None) is not None and stream.spec.per_channel:
                        raise ValueError(f"a sliding layer's ring cannot hold a per-channel kind ({stream.kind.value}): "
                                         "its token groups assume storage order is slot order; use a per-token kind "
                                         "for the sliding layers (cache_sliding_kind)")
                    if getattr(stream, "R", 0):
                        raise ValueError("a sliding layer's ring cannot keep a full-precision residual window "
                                         "(residual_len > 0): set residual_len: 0, or cache_sliding_kind: fp32 / fp16")
                layer.__class__ = SlidingLayerKVCache
                layer.window = window
        if all(sliding):
            raise ValueError("a hybrid cache needs at least one full-attention layer")
        super().__init__(layers)
        self.sliding, self.model_window = list(sliding), window
        self._full = next(layer for layer, ring in zip(layers, sliding) if not ring)
        self.pressed_at: int | None = None   # the context's slots when a press left the full layers ragged

    @classmethod
    def pressed(cls, layers: list[LayerKVCache], sliding: list[bool], window: int, at: int) -> HybridKVCache:
        """A pressed hybrid cache (caramba.cache.evict): rings (SlidingLayerKVCache) where `sliding`,
        a ragged press's layers elsewhere, pressed after `at` slots."""
        self = cls.__new__(cls)
        KVCache.__init__(self, layers)
        self.sliding, self.model_window = list(sliding), window
        self._full = next(layer for layer, ring in zip(layers, sliding) if not ring)
        self.pressed_at = at
        return self

    @property
    def length(self) -> int:
        return self._full.length + _offset(self._full)

    @property
    def max_seq_len(self) -> int:
        return self._full.max_seq_len + _offset(self._full)

    def attention_mask(self, B: int, T: int, slot_mask: torch.Tensor | None, device: torch.device,
                       window: int | None = None, model_window: int | None = None) -> tuple[torch.Tensor | None, bool]:
        """The full layers' mask (layer_masks gives each layer its own)."""
        if self.pressed_at is None:
            return super().attention_mask(B, T, slot_mask, device, window, model_window)
        if self.window is not None and window not in (None, self.window):
            raise ValueError(f"window={window} disagrees with the cache's window={self.window}")
        return self._full_mask(B, T, slot_mask, device, narrowest(self.window if window is None else window,
                                                                   model_window))

    def _full_mask(self, B: int, T: int, slot_mask: torch.Tensor | None, device: torch.device,
                   span: int | None) -> tuple[torch.Tensor | None, bool]:
        """The full layers' mask over slots [0, length + T). Pressed: spelled out (each pressed layer
        maps it onto its own slots), the context's slots all allowed (its holes are each layer's)."""
        start = self.length
        if self.pressed_at is None:
            return attention_mask(B, T, start, slot_mask, device, span)
        if slot_mask is not None:
            slot_mask = slot_mask.clone()
            slot_mask[:, :self.pressed_at] = True
        mask, _ = attention_mask(B, T, start, slot_mask, device, span)
        if mask is None:
            q_slot = torch.arange(start, start + T, device=device)[:, None]
            mask = (torch.arange(start + T, device=device)[None, :] <= q_slot).expand(B, 1, T, start + T)
        return mask, False

    def layer_masks(self, B: int, T: int, slot_mask: torch.Tensor | None, device: torch.device,
                    window: int | None, layer_windows: list[int | None]) -> list[tuple[torch.Tensor | None, bool]]:
        """Full layers: over slots [0, length + T); sliding layers: over their ring, as it reads."""
        if self.window is not None and window not in (None, self.window):
            raise ValueError(f"window={window} disagrees with the cache's window={self.window}")
        span = self.window if window is None else window
        start = self.length
        full = self._full_mask(B, T, slot_mask, device, span)
        ring = next(layer for layer in self.layers if type(layer) is SlidingLayerKVCache)
        local = attention_mask(B, T, start, slot_mask, device, narrowest(span, self.model_window),
                               ring.key_slots(start, T, device))
        return [local if s else full for s in self.sliding]

    def truncate(self, n: int) -> None:
        """Roll back to n slots: the rings can give back at most their SLACK slots (older ones may be
        overwritten already)."""
        ring = next(layer for layer in self.layers if type(layer) is SlidingLayerKVCache)
        room = ring.max_seq_len - ring.window
        if self.length - n > room and self.length > ring.max_seq_len:
            raise ValueError(f"a hybrid cache's sliding-layer rings can roll back at most {room} slots; "
                             f"asked to go from {self.length} to {n}")
        for layer in self.layers:
            layer.truncate(n - _offset(layer))

    def bytes_at(self, tokens: int) -> int:
        """Bytes holding a context of `tokens`: each full layer's per token, each ring's up to its capacity."""
        return sum(self.bytes_by_layer_type(tokens).values())

    def bytes_by_layer_type(self, tokens: int) -> dict[str, int]:
        """bytes_at split into the sliding layers' rings and the full layers. Pressed: a full layer
        holds its survivors' share of the context's first min(tokens, pressed_at) slots, then every
        token after them."""
        out = {"sliding": 0, "full": 0}
        for layer, ring in zip(self.layers, self.sliding):
            if ring:
                out["sliding"] += layer.bytes_at(min(tokens, layer.max_seq_len))
            elif self.pressed_at is None:
                out["full"] += layer.bytes_at(tokens)
            else:
                P = self.pressed_at
                held = min(tokens, P) * self.held_share(layer) + max(0, tokens - P)
                out["full"] += round(layer.bytes_per_token() * held)
        return out

    def held_share(self, layer) -> float:
        """The share of the context's (row, KV head, slot) entries a pressed full layer holds."""
        B, H, P = layer.batch_size, layer.n_kv_heads, self.pressed_at
        if getattr(layer, "first", None) is not None:            # packed: each head's survivors from `first` on
            held = int((layer.width - layer.first).sum())
        elif getattr(layer, "valid", None) is not None:
            held = int(layer.valid.sum())
        else:
            held = B * H * layer.width
        return held / max(B * H * P, 1)
