"""One batch's decoding state: the model's KV cache plus what every strategy keeps beside it.

Every decoder (Generator, beam and contrastive search, speculative decoding and its model
drafts) feeds tokens through a `DecodeState`:
- `feed` writes a [B, T] chunk at the next T cache slots; `mask` says which tokens are real.
  The others (left padding, rows that finished, a speculative batch's shorter rows) become
  holes: `slot_mask` marks them invalid and every row has its own rotary positions
  (`next_pos`), so attention sees, per row, exactly that row's tokens in order and a row's
  output equals running it alone. Long feeds run in chunks of `q_chunk` (caramba.infer.plan).
- `prefill` / `step`: the logits of each row's next token after a chunk / after one token.
- `rollback` keeps each row's first n real tokens (rejected drafts), `reorder` gathers rows
  (beams follow their source), `pending` holds the last sampled token of a turn that is not
  yet in the cache (the Generator's next turn feeds it first).

`slot_mask` stays None while every slot below `cache.length` is a real token: a dense batch
writes and gathers no mask and the model takes its unmasked fast path.

The forwards run through the state's `backend` (caramba.model.backend): by default the fused C
step where it applies (backend.choose, from the model as it is when the state is built), or what
the caller passes (TorchStep where module forwards must run: the contrastive search's hook, a
press's observed prefill, which `using` scopes).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from caramba.cache import KVCache
from caramba.cache.evict import evict
from caramba.cache.layer import CacheOverflowError
from caramba.cache.ring import RingKVCache
from caramba.infer.plan import DecodePlan, ResolvedPlan, has_residual_window, run_chunks
from caramba.model.backend import Backend, choose


class DecodeState:
    def __init__(self, model, cache: KVCache, q_chunk: int | None = None, backend: Backend | None = None) -> None:
        self.model, self.cache = model, cache
        self.backend = choose(model) if backend is None else backend   # runs every feed's forwards
        self.q_chunk = q_chunk          # longer feeds (prefill, verification) run in chunks
        self.ring = isinstance(cache, RingKVCache)
        B, device = cache.batch_size, model.device
        self.slot_mask: torch.Tensor | None = None   # [B, width] True where a slot is a real token; None: all are
        self.next_pos = torch.zeros(B, dtype=torch.long, device=device)  # [B] real tokens cached = next position
        self.pending: torch.Tensor | None = None       # [B] a sampled token not yet in the cache
        self.pending_mask: torch.Tensor | None = None  # [B] which rows have one
        self.kept_share: float | None = None           # after a press: the share of context entries kept
        self.evicted = torch.zeros(B, dtype=torch.long, device=device)   # [B] tokens a press dropped

    @classmethod
    def for_config(cls, model, batch_size: int, config, slots: int | None = None,
                   backend: Backend | None = None) -> DecodeState:
        """The cache a GenerateConfig describes: with decode_local_window, a ring buffer where
        the cache supports one (generation is then not bounded by max_seq_len), else a plain
        cache of `slots` (default max_seq_len) slots that masks to the window."""
        window = config.decode_local_window
        if window is not None:
            try:
                ring = RingKVCache.build(model, batch_size, window, config.decode.max_write(), config.cache_spec())
                return cls(model, ring, backend=backend)
            except ValueError:
                pass  # e.g. a residual window: the plain cache below, the plan records ring=False
        cache = model.new_cache(batch_size, config.max_seq_len if slots is None else slots, config.cache_spec())
        config.cache.check_budget(cache.nbytes)   # a named kind with cache_budget_mb must fit it
        cache.window = window
        return cls(model, cache, backend=backend)

    @property
    def batch_size(self) -> int:
        return self.cache.batch_size

    @property
    def has_holes(self) -> bool:
        """Whether any slot below cache.length is not a real token of its row."""
        return self.slot_mask is not None

    @property
    def room(self) -> int:
        """Slots left before the cache's max_seq_len."""
        return self.cache.max_seq_len - self.cache.length

    def resolve(self, plan: DecodePlan, input_len: int) -> ResolvedPlan:
        """The decode plan for an input of input_len tokens on this cache; feeds then use its q_chunk."""
        resolved = plan.resolve(input_len, has_residual_window(self.cache), self.cache.max_write if self.ring else None)
        self.q_chunk = resolved.q_chunk
        return resolved

    def check_room(self, n_new: int) -> None:
        """Raise CacheOverflowError, before any forward, when n_new more tokens do not fit the
        cache or (GPT-2) the learned position table, which a ring cache does not lift."""
        self.cache.check_room(n_new)
        wpe = getattr(self.model, "wpe", None)
        if wpe is not None and int(self.next_pos.max()) + n_new > wpe.num_embeddings:
            raise CacheOverflowError(
                f"{int(self.next_pos.max())} positions used + {n_new} new exceed this model's learned position "
                f"table (n_positions={wpe.num_embeddings}); shorten the prompt or lower max_new_tokens")

    def with_pending(self, tokens: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens/mask [B, T] with the pending token (if any) in front; the pending token stays
        until `feed` writes it, so a failed check leaves the state as it was."""
        if self.pending is None:
            return tokens, mask
        return torch.cat([self.pending[:, None], tokens], dim=1), torch.cat([self.pending_mask[:, None], mask], dim=1)

    # ---- forwards ---------------------------------------------------------------------------

    @torch.inference_mode()
    def feed(self, tokens: torch.Tensor, mask: torch.Tensor | None = None, last_only: bool = False) -> torch.Tensor:
        """Write tokens [B, T] at the next T slots and run the model over them. mask [B, T]:
        which tokens are real (None: all). -> logits [B, T, V] ([B, 1, V] with last_only)."""
        self.pending = self.pending_mask = None   # whatever was pending is in this feed or dropped
        T = tokens.shape[1]
        if self.cache.length == 0 and not self.ring:
            # each row's groups of tokens (per-channel keys) start at its first real token, as alone
            self.cache.set_origins(None if mask is None else _leading_holes(mask.bool()))
        if mask is None:
            # Out of place: positions may be a view of the old next_pos.
            positions = self.next_pos[:, None] if T == 1 else self.next_pos[:, None] + torch.arange(T, device=tokens.device)
            self.next_pos = self.next_pos + T
        else:
            positions = (self.next_pos[:, None] + mask.long().cumsum(dim=1) - 1).clamp(min=0)  # padding's: unused
            if self.slot_mask is None and not bool(mask.all()):
                self._start_mask()
            self.next_pos += mask.long().sum(dim=1)

        def run(a: int, b: int, last: bool) -> torch.Tensor:
            if self.slot_mask is not None:   # marked chunk by chunk: a ring's mask is too narrow for a long input
                self._mark(self.cache.length, b - a, True if mask is None else mask[:, a:b])
            return self.backend(tokens[:, a:b], positions[:, a:b], self.cache, self.slot_mask, last_only=last)

        return run_chunks(run, T, self.q_chunk, last_only)

    def prefill(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Feed [B, T] tokens -> logits of each row's next token [B, V]."""
        return self.feed(tokens, mask, last_only=True)[:, -1]

    def step(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Feed one token per row (tokens [B], mask [B] or None) -> next-token logits [B, V]."""
        return self.feed(tokens[:, None], None if mask is None else mask[:, None], last_only=True)[:, -1]

    @contextmanager
    def using(self, backend: Backend):
        """The feeds inside run through `backend` (a press's observed prefill: TorchStep, whose
        forwards call the cache's observers); the state's own backend after."""
        own, self.backend = self.backend, backend
        try:
            yield self
        finally:
            self.backend = own

    # ---- editing ----------------------------------------------------------------------------

    @torch.inference_mode()
    def rollback(self, n_keep: torch.Tensor) -> None:
        """Keep each row's first n_keep [B] real tokens; later ones become holes, and the slots
        past the last one any row keeps are truncated away. Nothing is recomputed."""
        if self.ring:
            raise ValueError("rollback needs a plain cache (a ring buffer keeps only its last max_write slots)")
        valid = self.valid_slots()                                        # [B, L]
        slots = n_keep.to(valid.device) - self.evicted                    # a press's dropped tokens hold no slot
        valid &= valid.long().cumsum(dim=1) <= slots[:, None]
        used = valid.any(dim=0).nonzero()
        length = int(used[-1]) + 1 if len(used) else 0
        self.cache.truncate(length)
        self.next_pos = valid.sum(dim=1) + self.evicted
        if bool(valid[:, :length].all()):
            self.slot_mask = None
        else:
            if self.slot_mask is None:
                self._start_mask()
            self.slot_mask[:, :length] = valid[:, :length]
            self.slot_mask[:, length:] = False

    @torch.inference_mode()
    def press(self, kept: list[torch.Tensor], template: KVCache | None = None, ragged_rows: bool = False) -> None:
        """Keep only the slots `kept` marks (per layer [B, KVH, cache.length], True = keep: a
        press's choice, caramba.press) in a new cache of the template's kinds (default: this
        cache's), with this cache's remaining room after them (caramba.cache.evict; ragged_rows:
        rows keeping different counts packed, for a cache that will not be pressed again). Rows
        keep their positions: the next token of each row is still at next_pos. A hybrid cache:
        kept is None for its sliding layers (kept whole); kept_share counts its full layers; its
        slot numbers, so the slot mask, stay."""
        if self.ring:
            raise ValueError("a press needs a plain cache, not a sliding-window ring (drop decode_local_window)")
        valid = self.valid_slots()
        pressed = [mask for mask in kept if mask is not None]
        for i, mask in enumerate(kept):
            if mask is not None and mask.dtype == torch.bool and mask.shape[-1:] == valid.shape[-1:] and \
                    bool((mask & ~valid[:, None, :]).any()):
                raise ValueError(f"the kept mask of layer {i} keeps padding slots")
        room = self.cache.max_seq_len - self.cache.length
        real = valid.sum() * len(pressed) * self.cache.layers[0].n_kv_heads
        self.kept_share = float(sum(int(m.sum()) for m in pressed) / max(int(real), 1))
        self.cache, self.slot_mask = evict(self.cache, kept, template, room, ragged_rows=ragged_rows,
                                           slot_mask=self.slot_mask)
        # Tokens each row no longer holds a slot for: rollback counts tokens, the cache holds survivors.
        # Recounted, not added to: a second press (decoding-time compression) sees the first's holes gone.
        self.evicted = self.next_pos - self.valid_slots().sum(dim=1)

    @torch.inference_mode()
    def reorder(self, index: torch.Tensor) -> None:
        """Rows become rows `index` [B'] of the old batch (B' may differ: beams, candidates)."""
        self.cache.reorder(index)
        self.next_pos, self.evicted = self.next_pos[index], self.evicted[index]
        if self.slot_mask is not None:
            self.slot_mask = self.slot_mask[index]
        if self.pending is not None:
            self.pending, self.pending_mask = self.pending[index], self.pending_mask[index]

    # ---- inspection -------------------------------------------------------------------------

    def valid_slots(self) -> torch.Tensor:
        """[B, cache.length] True where a slot holds a real token of its row (a copy; plain caches)."""
        L = self.cache.length
        if self.slot_mask is None:
            return torch.ones(self.batch_size, L, dtype=torch.bool, device=self.next_pos.device)
        return self.slot_mask[:, :L].clone()

    def row_origins(self) -> torch.Tensor | None:
        """[B] each row's first real slot (the holes in front of it), None when every row starts at 0:
        where a cache of per-channel keys starts the row's groups (KVCache.set_origins)."""
        return None if self.slot_mask is None else _leading_holes(self.valid_slots())

    def row_slots(self, row: int) -> torch.Tensor:
        """Cache slot indices [n] of a row's real tokens, in order (for inspecting the cache)."""
        return self.valid_slots()[row].nonzero().flatten()

    # ---- slot mask --------------------------------------------------------------------------

    def _start_mask(self) -> None:
        """The first hole: a mask where every slot written so far is real."""
        width = self.cache.capacity if self.ring else self.cache.max_seq_len
        self.slot_mask = torch.zeros(self.batch_size, width, dtype=torch.bool, device=self.next_pos.device)
        self.slot_mask[:, : min(self.cache.length, width)] = True

    def _mark(self, start: int, n: int, valid: torch.Tensor | bool) -> None:
        if self.ring:   # slot s is stored at s % capacity
            slots = torch.arange(start, start + n, device=self.slot_mask.device)
            self.slot_mask[:, slots % self.slot_mask.shape[1]] = valid
        else:
            self.slot_mask[:, start : start + n] = valid


def _leading_holes(real: torch.Tensor) -> torch.Tensor | None:
    """[B] how many slots precede each row's first real one (real [B, S], True = a token), None when
    no row has any."""
    lead = (~real).long().cumprod(dim=1).sum(dim=1)
    return lead if bool(lead.any()) else None


__all__ = ["DecodeState"]
