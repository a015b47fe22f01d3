"""The attention mask of a forward over cache slots: causal, minus padding, within a window.

A KV cache builds the mask of each forward itself (KVCache.attention_mask), since only it knows
where its keys lie: a ring buffer (caramba.cache.ring) stores slot s at s % capacity, so its keys
come in storage order, not slot order. A forward without a cache calls `attention_mask` with
start=0 and no key_slots.
"""

from __future__ import annotations

import torch


def narrowest(a: int | None, b: int | None) -> int | None:
    """The tighter of two sliding windows, either of which may be None (no window)."""
    if a is None:
        return b
    return a if b is None else min(a, b)


def attention_mask(B: int, T: int, start: int, slot_mask: torch.Tensor | None, device: torch.device,
                   window: int | None = None,
                   key_slots: torch.Tensor | None = None) -> tuple[torch.Tensor | None, bool]:
    """(mask [B, 1, T, n] bool (True = attend), causal) for T queries at slots [start, start + T).

    Causal over slots, minus padding slots (slot_mask [B, >= S]: True where a slot is a real
    token) and, with a window, slots `window` or more before the query. key_slots [n]: the slot
    each stored key holds (a ring buffer's storage order; None: slots [0, S)). Returns
    (None, causal) when SDPA can do it alone."""
    S = start + T
    windowed = window is not None and S > window   # some query has a slot out of its reach
    if slot_mask is None and key_slots is None and not windowed:
        if T == 1:
            return None, False          # one new token sees every cached slot
        if start == 0:
            return None, True           # plain causal prefill
    q_slot = torch.arange(start, S, device=device)[:, None]
    k_slot = (torch.arange(S, device=device) if key_slots is None else key_slots)[None, :]
    mask = k_slot <= q_slot
    if windowed:
        mask = mask & (k_slot > q_slot - window)
    mask = mask.expand(B, T, k_slot.shape[1])
    if slot_mask is not None:
        # slot_mask is indexed by slot % its width (a ring buffer's is as wide as the ring).
        valid = slot_mask[:, :S] if key_slots is None else slot_mask[:, key_slots % slot_mask.shape[1]]
        # A padding query sees only itself, so no softmax row is empty (NaN); its output is unused.
        mask = (mask & valid[:, None, :]) | (k_slot == q_slot)
    return mask.unsqueeze(1), False     # [B, 1, T, n]
