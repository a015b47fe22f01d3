"""A model with its KV cache, where every batch row keeps its own length.

The cache writes all rows at the same slots, so when rows advance by different amounts (rows
of a speculative batch accept different numbers of drafted tokens) the slots a row does not
keep become holes: `slot_mask` marks them invalid, every row has its own rotary positions, and
the shared tail nobody keeps is cut with `truncate`. Attention then sees, per row, exactly the
tokens of that row in order, so outputs equal running each row alone. Nothing is recomputed.
"""

from __future__ import annotations

import torch

from caramba.infer.plan import run_chunks


class RowCache:
    def __init__(self, model, batch_size: int, max_seq_len: int, cache_spec="fp32", q_chunk: int | None = None) -> None:
        self.model = model
        self.q_chunk = q_chunk  # longer feeds (prefill, verification) run in chunks (caramba.infer.plan)
        self.cache = model.new_cache(batch_size, max_seq_len, cache_spec)  # a kind or a CachePolicy
        device = model.device
        self.slot_mask = torch.zeros(batch_size, max_seq_len, dtype=torch.bool, device=device)  # [B, S]
        self.n = torch.zeros(batch_size, dtype=torch.long, device=device)  # [B] real tokens cached per row
        self.has_holes = False  # any invalid slot below cache.length

    @property
    def room(self) -> int:
        """Slots left before max_seq_len."""
        return self.cache.max_seq_len - self.cache.length

    @torch.inference_mode()
    def feed(self, tokens: torch.Tensor, mask: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Append tokens [B, T] (mask [B, T]: which are real; the rest become holes).
        Returns logits [B, T, V] ([B, 1, V] with last_only)."""
        start, T = self.cache.length, tokens.shape[1]
        positions = (self.n[:, None] + mask.long().cumsum(dim=1) - 1).clamp(min=0)  # holes: unused
        self.slot_mask[:, start : start + T] = mask
        self.has_holes = self.has_holes or not bool(mask.all())
        self.n += mask.long().sum(dim=1)
        slot_mask = self.slot_mask if self.has_holes else None
        return run_chunks(lambda a, b, last: self.model(tokens[:, a:b], positions[:, a:b], self.cache, slot_mask, last_only=last),
                          T, self.q_chunk, last_only)

    def keep(self, n_keep: torch.Tensor) -> None:
        """Keep each row's first n_keep [B] real tokens; later ones become holes, and the slots
        past the last one any row keeps are truncated away."""
        L = self.cache.length
        valid = self.slot_mask[:, :L]                                   # [B, L] view
        valid &= valid.long().cumsum(dim=1) <= n_keep.to(valid.device)[:, None]
        used = valid.any(dim=0).nonzero()
        length = int(used[-1]) + 1 if len(used) else 0
        self.cache.truncate(length)
        self.slot_mask[:, length:] = False
        self.n = valid.sum(dim=1)
        self.has_holes = not bool(valid[:, :length].all())

    def row_slots(self, row: int) -> torch.Tensor:
        """Cache slot indices [n] of a row's real tokens, in order (for inspecting the cache)."""
        return self.slot_mask[row, : self.cache.length].nonzero().flatten()
