"""A sliding-window KV cache as a ring buffer: memory stays flat however long generation runs.

With a window of W slots, a query at slot s reads only slots (s - W, s]. A forward that writes
T new slots therefore needs the W - 1 slots before its first one plus its own T: a ring of
`capacity = window + max_write` slots is enough, with slot s stored at s % capacity. `length`
keeps counting slots (rotary positions keep growing), so generation is no longer bounded by a
max_seq_len; every forward may write at most `max_write` slots (the decode plan's q_chunk).

Attention reads the ring in storage order and the cache's attention mask (KVCache.attention_mask)
is built over `key_slots` (the slot each stored key holds): a softmax does not care in which
order its keys come. So float and quantized
kinds (chunked code reads over storage ranges, caramba.cache.attend) work unchanged. Not
supported: a quantized kind's full-precision residual window (it assumes storage order is slot
order) and layers other than LayerKVCache (e.g. decoupled attention).
"""

from __future__ import annotations

import torch

from caramba.cache.layer import CacheOverflowError, KVCache, LayerKVCache


class RingLayerKVCache(LayerKVCache):
    """A LayerKVCache of `max_seq_len` = capacity storage slots, written modulo the capacity."""

    max_write: int = 0   # most slots one forward may write (set by RingKVCache)

    def _append(self, k: torch.Tensor, v: torch.Tensor) -> int:
        start, T, C = self.length, k.shape[2], self.max_seq_len
        if T > self.max_write:
            raise CacheOverflowError(f"a ring-buffer cache takes at most {self.max_write} tokens per forward "
                                     f"(window + {self.max_write} = {C} slots); got {T}: feed them in chunks "
                                     f"of <= {self.max_write} (the decode plan's q_chunk)")
        at = start % C
        first = min(T, C - at)           # a write that reaches the end of the ring wraps to slot 0
        self._store(at, k[:, :, :first], v[:, :, :first])
        if first < T:
            self._store(0, k[:, :, first:], v[:, :, first:])
        self.length = start + T
        return min(self.length, C)       # storage slots attention reads


class RingKVCache(KVCache):
    """Every layer a RingLayerKVCache; `window` and `max_write` fix the capacity."""

    def __init__(self, layers: list[LayerKVCache], window: int, max_write: int) -> None:
        for layer in layers:
            if type(layer) is not LayerKVCache:
                raise ValueError(f"a ring-buffer cache needs standard attention layers; got {type(layer).__name__}")
            for stream in (layer.k_stream, layer.v_stream):
                if getattr(stream, "spec", None) is not None and stream.spec.per_channel:
                    raise ValueError(f"a ring-buffer cache cannot hold a per-channel kind ({stream.kind.value}): its "
                                     "token groups assume storage order is slot order; use a per-token kind")
                if getattr(stream, "R", 0):
                    raise ValueError("a ring-buffer cache cannot keep a quantized kind's full-precision residual "
                                     "window (residual_len > 0); set residual_len: 0 or turn the ring off")
            if layer.max_seq_len != window + max_write:
                raise ValueError(f"ring layers must hold window + max_write = {window + max_write} slots")
            layer.__class__ = RingLayerKVCache   # same storage, ring addressing
            layer.max_write = max_write
        super().__init__(layers)
        self.window, self.max_write = window, max_write

    @classmethod
    def build(cls, model, batch_size: int, window: int, max_write: int, spec) -> RingKVCache:
        """A ring for `model` (anything with new_cache(batch, slots, spec)) of window + max_write slots."""
        return cls(model.new_cache(batch_size, window + max_write, spec).layers, window, max_write)

    @property
    def capacity(self) -> int:
        return self.window + self.max_write

    def check_room(self, n_new: int) -> None:
        """Any number of tokens fits over time; each forward's size is checked as it writes."""

    def key_slots(self, end: int) -> torch.Tensor | None:
        C = self.capacity
        if end <= C:
            return None                  # nothing overwritten yet: storage order is slot order
        i = torch.arange(C, device=self.layers[0].k.device)
        return end - 1 - (end - 1 - i) % C   # the newest slot < end stored at i

    def truncate(self, n: int) -> None:
        """Roll back to n slots. Only the last max_write slots can go: older ones are needed by
        the window of the next token, and theirs may already be overwritten."""
        if not self.length - self.max_write <= n <= self.length:
            raise ValueError(f"a ring-buffer cache of {self.length} slots can roll back at most max_write="
                             f"{self.max_write} of them (to >= {max(self.length - self.max_write, 0)}); got {n}")
        super().truncate(n)
