"""What a press scores with, collected while the context is prefilled (chunk by chunk).

`observing(model, cache, press)` installs one observer per layer cache (the attention calls it
before it attends, caramba.cache.layer.StreamLayerCache.observer) and yields `Observations`. Each
layer keeps only what its method needs (its MethodSpec, caramba.press.spec), never the [T, S]
attention of the whole context:
- a window (snapkv / pyramidkv: press_window; tova: 1): the post-RoPE queries of the last slots;
- observes="attention" (observed_attention): the attention each key received, summed over every
  context query (softmax in fp32 under the forward's own mask, from q and the cache's keys);
- observes="queries" (expected_attention): sums of the pre-RoPE queries and of their outer
  products (float64), from each row's token n_sink on, so the mean and covariance need no list;
- neither (streaming_llm, knorm, keydiff): nothing (they score the cached keys and values alone).

A hybrid model's cache (caramba.cache.hybrid: Gemma 2/3) is pressed in its full layers only, so
only they are observed: each full layer's own queries (its window of the last context queries, its
attention, its statistics), which see the whole context as a plain model's layers do. The sliding
layers get no observer (Observations holds None for them): their queries see only their window,
and their rings are never scored.

Left padding: a padding query attends only to itself (caramba.cache.mask), so it adds attention
to its own padding slot only, and a query's mask row counts the real slots it sees (its position
+ 1), which is how the query statistics skip padding and sinks without knowing the slot mask.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from caramba.cache.evict import PackedLayerKVCache, PressedLayerKVCache
from caramba.cache.hybrid import HybridKVCache
from caramba.cache.layer import KVCache, LayerKVCache
from caramba.model.rope import apply_rope, rope_inv_freq
from caramba.press.config import PressConfig
from caramba.press.spec import spec_of

Q_BLOCK = 256   # queries per block of the observed attention: bounds its [H, block, S] scratch


def window_of(press: PressConfig) -> int:
    """How many of the last queries the method scores with (0: none)."""
    return 0 if press.method is None else spec_of(press.method).window_of(press)


class LayerObservation:
    """One layer's observer: called with (q, k, v, cos, sin, mask, causal) of every chunk."""

    def __init__(self, layer: LayerKVCache, press: PressConfig, n_heads: int, start: int = 0) -> None:
        self.layer, self.press, self.n_heads = layer, press, n_heads
        self.length = start                           # slots observed (this chunk's included)
        self.partial = start > 0                      # decoding: only the queries from `start` on
        self.window = window_of(press)
        self.observes = spec_of(press.method).observes if press.method else None   # what else it collects
        self.window_q: torch.Tensor | None = None     # [B, H, <=W, D] post-RoPE, last slots
        self.attn_sum: torch.Tensor | None = None     # [B, H, max_seq_len] fp32
        self.q_count: torch.Tensor | None = None      # [B] queries in the statistics
        self.q_sum: torch.Tensor | None = None        # [B, H, D] float64, pre-RoPE
        self.q_outer: torch.Tensor | None = None      # [B, H, D, D] float64
        self.first_q: torch.Tensor | None = None      # [B, H, D] n_sink=0: the last self-only query
        self.first_slot: torch.Tensor | None = None   # [B] its slot (-1: none yet)

    @torch.no_grad()
    def __call__(self, q, k, v, cos, sin, mask, causal) -> None:
        # called before the chunk is appended; in the model's slot numbers (a pressed layer's are offset)
        start, T = self.layer.length + getattr(self.layer, "offset", 0), q.shape[2]
        if start != self.length:
            raise RuntimeError(f"a press observer saw slots [{start}, {start + T}) after {self.length}: a forward "
                               "ran past it (keep every context forward inside `observing`)")
        self.length = start + T
        if self.window:
            q_win = q.float() if self.window_q is None else torch.cat([self.window_q, q.float()], dim=2)
            self.window_q = q_win[:, :, -self.window:].clone()
        if self.observes == "attention":
            self._observe_attention(q, k, start, mask, causal)
        elif self.observes == "queries":
            self._observe_queries(q, cos, sin, start, mask, causal)

    def _observe_attention(self, q, k, start, mask, causal) -> None:
        B, H, T, D = q.shape
        n = start + T
        keys = k.float() if start == 0 else torch.cat([self.layer.contents(start)[0], k.float()], dim=2)
        KVH = keys.shape[1]
        if self.attn_sum is None:
            self.attn_sum = torch.zeros(B, H, self.layer.max_seq_len, dtype=torch.float32, device=q.device)
        qg = q.float().view(B, KVH, H // KVH, T, D)
        for a in range(0, T, Q_BLOCK):
            b = min(a + Q_BLOCK, T)
            logits = qg[:, :, :, a:b] @ keys[:, :, None].transpose(-1, -2) / math.sqrt(D)   # [B, KVH, G, t, n]
            allowed = _allowed(mask, causal, start, a, b, n, q.device)
            if allowed is not None:
                logits = logits.masked_fill(~allowed[:, :, None], float("-inf"))
            self.attn_sum[:, :, :n] += logits.softmax(dim=-1).sum(dim=3).view(B, H, n)

    def _observe_queries(self, q, cos, sin, start, mask, causal) -> None:
        B, H, T, D = q.shape
        pre = (q if cos is None else apply_rope(q, cos, -sin)).double()   # the inverse rotation
        seen = _seen(mask, causal, start, T, B, q.device)                 # [B, T] real slots each query sees
        n_sink = self.press.n_sink
        if self.q_sum is None:
            self.q_count = torch.zeros(B, dtype=torch.long, device=q.device)
            self.q_sum = torch.zeros(B, H, D, dtype=torch.float64, device=q.device)
            self.q_outer = torch.zeros(B, H, D, D, dtype=torch.float64, device=q.device)
            self.first_q = torch.zeros(B, H, D, dtype=torch.float64, device=q.device)
            self.first_slot = torch.full((B,), -1, dtype=torch.long, device=q.device)
        # A query that sees more than n_sink real slots is a real token at position >= n_sink; a
        # padding query sees itself only. seen == 1 is also a row's first real token (position 0):
        # with n_sink = 0 it counts, and under left padding it is the row's last self-only query.
        take = seen > max(n_sink, 1)
        w = pre * take[:, None, :, None]
        self.q_count += take.sum(dim=1)
        self.q_sum += w.sum(dim=2)
        self.q_outer += torch.einsum("bhtd,bhte->bhde", w, pre)
        if n_sink == 0:
            alone = seen == 1
            rows = alone.any(dim=1)
            if bool(rows.any()):
                last = (alone * torch.arange(1, T + 1, device=q.device)).argmax(dim=1)   # [B]
                pick = pre[torch.arange(B, device=q.device), :, last]                   # [B, H, D]
                self.first_q[rows] = pick[rows]
                self.first_slot[rows] = start + last[rows]


def _allowed(mask, causal, start, a, b, n, device) -> torch.Tensor | None:
    """[B or 1, 1, t, n] which keys queries [a, b) of the chunk attend to (None: all)."""
    if mask is not None:
        return mask[:, :, a:b]
    if not causal:
        return None
    q_slot = torch.arange(start + a, start + b, device=device)[:, None]
    return (torch.arange(n, device=device)[None, :] <= q_slot)[None, None]


def _seen(mask, causal, start, T, B, device) -> torch.Tensor:
    """[B, T] how many slots each query of the chunk attends to (its own included)."""
    if mask is not None:
        return mask[:, 0].sum(dim=-1).expand(B, T)
    if causal:
        return (torch.arange(start + 1, start + T + 1, device=device))[None].expand(B, T)
    return torch.full((B, T), start + T, device=device)


class Observations:
    """Every layer's observation of one context prefill, plus what scoring needs of the model."""

    def __init__(self, layers: list[LayerObservation | None], press: PressConfig, inv_freq: torch.Tensor | None) -> None:
        self.layers, self.press = layers, press
        self.inv_freq = inv_freq      # [D/2] RoPE frequencies (expected_attention); None: no RoPE

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> LayerObservation:
        return self.layers[i]


def pressed_layers(cache: KVCache) -> list[bool]:
    """Which layers a press scores and evicts: every layer, but a hybrid cache's full layers only
    (its sliding layers' rings hold no more than their window already)."""
    if isinstance(cache, HybridKVCache):
        return [not ring for ring in cache.sliding]
    return [True] * len(cache.layers)


def check_cache(cache: KVCache) -> None:
    """A press needs plain layer caches in slot order (not a ring buffer, not DBA's streams); a
    hybrid cache's full layers (caramba.cache.hybrid), pressed already or not."""
    if cache.window is not None:
        raise ValueError(f"a press needs a cache without a sliding window (this one has window={cache.window})")
    scored = [layer for layer, p in zip(cache.layers, pressed_layers(cache)) if p]
    # a pressed hybrid cache's full layers hold their survivors offset to the model's slot numbers
    kinds = (LayerKVCache, PressedLayerKVCache, PackedLayerKVCache) if isinstance(cache, HybridKVCache) \
        else (LayerKVCache,)
    if cache.key_slots(cache.length + 1) is not None or not all(type(layer) in kinds for layer in scored):
        kinds = sorted({type(layer).__name__ for layer in scored})
        raise ValueError(f"a press scores plain K/V layer caches in slot order; this cache has {', '.join(kinds)} "
                         "(decoupled/DBA and ring caches are not supported)")


@contextmanager
def observing(model, cache: KVCache, press: PressConfig, decoding: bool = False):
    """Observe the context prefill that follows into `cache` for `press` -> Observations.

    Every forward of the context must run inside (the observers check that they saw every slot),
    through the model's own forward: the fused C step calls no observer, so the decoder feeding
    the context chooses the torch path for it (caramba.model.backend.TorchStep; DecodeState.using).
    decoding=True: the cache may hold tokens already; the observers watch the decode steps that
    follow (decoding-time compression scores with their queries only)."""
    if not isinstance(press, PressConfig):
        raise TypeError(f"press must be a PressConfig, not {type(press).__name__}")
    check_cache(cache)
    if cache.length and not decoding:
        raise ValueError(f"observing needs an empty cache (it holds {cache.length} tokens): a press scores "
                         "the whole context, from its first token")
    cfg = model.config
    inv_freq = rope_inv_freq(cfg).to(model.device) if cfg.positions == "rope" else None
    layers = [LayerObservation(layer, press, cfg.n_heads, cache.length) if p else None
              for layer, p in zip(cache.layers, pressed_layers(cache))]
    for layer, obs in zip(cache.layers, layers):
        if obs is not None:
            layer.observer = obs
    try:
        yield Observations(layers, press, inv_freq)
    finally:
        for layer, obs in zip(cache.layers, layers):
            if obs is not None:
                layer.observer = None


__all__ = ["LayerObservation", "Observations", "check_cache", "observing", "pressed_layers", "window_of"]
