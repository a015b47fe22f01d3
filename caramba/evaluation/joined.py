"""Several decoding states stepped as one batch: the rows of different caches side by side.

An eval's candidates each answer the same samples from their own cache (its kinds, its press),
so one answer token per candidate is one weight pass per candidate. `step_together` runs one
token for every row of several DecodeStates in a single forward: the projections and the MLP
see all the rows at once, and each layer's attention splits the rows back into their states'
caches (`JoinedKVCache`), each attended as its own cache attends, under its own mask (its state's
slot mask and rotary positions). The caches may be of any kinds and layouts (plain, quantized,
rotated, pressed, packed); only the forward is shared.

Each state's bookkeeping (its positions, its slot mask's new slot, its rows' `next_pos`) is
DecodeState.step's own: the states are stepped through a `_Collect` backend that records the
forward each would have run instead of running it, and the forwards recorded are then run
together. A decode step (`step_together`) whose states all step through the fused C step
(caramba.model.fast_decode.CStep) runs the caches it takes as one joined C call
(CStep.step_joined: decode_step.c's decode_step_joined, each cache a segment, up to
fast_decode.JOIN_MAX_ROWS rows, JOIN_MEAN_ROWS a cache): the projections, MLP and head run once
over their rows and each layer's attention per cache, as the C step reads it alone; the caches it
refuses at that step join in one torch forward. Otherwise, and for the questions
(`prefill_together`), the joined forward is the model's torch forward. A
row's logits are those of stepping its state alone, up to float rounding of the batched products
(a greedy answer far from a tie is the same token).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from caramba.infer.state import DecodeState


def joinable(model) -> bool:
    """Whether the model's attention goes through `LayerKVCache.attend` (what JoinedLayer splits):
    not a decoupled (DBA) model's three streams, nor Gemma 2's soft-capped scores (which read
    `update`'s whole cache instead)."""
    cfg = model.config
    return cfg.attention == "standard" and cfg.attn_softcap is None


class JoinedMask:
    """One layer type's attention masks, one (mask or None) per state, passed through the model's
    forward as if it were one mask; JoinedLayer.attend hands each state its own."""

    def __init__(self, masks: list[torch.Tensor | None]) -> None:
        self.masks = masks


class JoinedLayer:
    """Layer i of every state's cache: attend splits q, k, v [N, H, T, D] by the states' rows."""

    observer = None     # no press watches a joined step

    def __init__(self, layers: list, rows: list[int]) -> None:
        self.layers, self.rows = layers, rows

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: JoinedMask, causal: bool) -> torch.Tensor:
        out, a = [], 0
        for layer, n, m in zip(self.layers, self.rows, mask.masks):
            out.append(layer.attend(q[a : a + n], k[a : a + n], v[a : a + n], m, causal))
            a += n
        return torch.cat(out, dim=0)


class JoinedKVCache:
    """The caches of several states as the model's forward sees one: its layers are JoinedLayers,
    its masks JoinedMasks built by each cache from its own state's slot mask."""

    def __init__(self, caches: list, slot_masks: list[torch.Tensor | None]) -> None:
        self.caches, self.slot_masks = caches, slot_masks
        self.rows = [c.batch_size for c in caches]
        self.layers = [JoinedLayer([c.layers[i] for c in caches], self.rows) for i in range(len(caches[0].layers))]

    @property
    def length(self) -> int:            # positions are always passed: only Transformer.forward's default reads it
        return self.caches[0].length

    @property
    def batch_size(self) -> int:
        return sum(self.rows)

    def check_room(self, n_new: int) -> None:
        for c in self.caches:
            c.check_room(n_new)

    def attention_mask(self, B: int, T: int, slot_mask, device: torch.device, window: int | None = None,
                       model_window: int | None = None) -> tuple[JoinedMask, bool]:
        pairs = [c.attention_mask(n, T, m, device, window, model_window)
                 for c, n, m in zip(self.caches, self.rows, self.slot_masks)]
        return self._join(pairs)

    def layer_masks(self, B: int, T: int, slot_mask, device: torch.device, window: int | None,
                    layer_windows: list[int | None]) -> list[tuple[JoinedMask, bool]]:
        per_cache = [c.layer_masks(n, T, m, device, window, layer_windows)
                     for c, n, m in zip(self.caches, self.rows, self.slot_masks)]
        return [self._join([pairs[i] for pairs in per_cache]) for i in range(len(layer_windows))]

    @staticmethod
    def _join(pairs: list[tuple[torch.Tensor | None, bool]]) -> tuple[JoinedMask, bool]:
        causal = {c for _, c in pairs}
        if len(causal) != 1:
            raise ValueError("joined states disagree on a causal mask: join only states past their prefill")
        return JoinedMask([m for m, _ in pairs]), causal.pop()


class _Collect:
    """A backend that records the forward a state asks for and returns placeholder logits."""

    name = path = "joined"

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.call: tuple | None = None

    def __call__(self, tokens, positions=None, cache=None, slot_mask=None, last_only=False, window=None):
        if self.call is not None or not last_only or window is not None:
            raise RuntimeError("a joined feed is one last-only forward per state")
        self.call = (tokens, positions, cache, slot_mask)
        return torch.empty(tokens.shape[0], 1, self.vocab, device=tokens.device)


@torch.inference_mode()
def step_together(model, states: Sequence[DecodeState], tokens: Sequence[torch.Tensor],
                  masks: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
    """DecodeState.step(tokens[i], masks[i]) of every state, as one forward -> each state's
    next-token logits [B_i, V]. Each state's caches and bookkeeping end as its own step leaves them."""
    return _together(model, [lambda s=s, t=t, m=m: s.step(t, m) for s, t, m in zip(states, tokens, masks)], states,
                     steps=True)


@torch.inference_mode()
def prefill_together(model, states: Sequence[DecodeState], tokens: torch.Tensor,
                     mask: torch.Tensor | None) -> list[torch.Tensor]:
    """DecodeState.prefill(tokens, mask) of every state (the same [B, T] tokens: each candidate's
    question), as one forward -> each state's next-token logits [B, V]. T must be one chunk of
    every state's q_chunk."""
    T = tokens.shape[1]
    if any(s.q_chunk is not None and T > s.q_chunk for s in states):
        raise ValueError(f"a joined prefill is one chunk: {T} tokens exceed a state's q_chunk")
    return _together(model, [lambda s=s: s.prefill(tokens, mask) for s in states], states)


def _together(model, feeds: list, states: Sequence[DecodeState], steps: bool = False) -> list[torch.Tensor]:
    """Run each state's feed through a _Collect backend, then the forwards collected as one: where
    every state steps through the fused C step (steps: a decode token each), one joined C step of
    those it takes and one torch forward of the rest (a per-channel cache whose rows group their keys
    from different slots, or one a rollback left to refill: caramba.model.fast_decode.CStep.applies),
    else one torch forward of all. (One refused cache sent the whole join to the torch forward before,
    whose attention over each cache is the slower one.)"""
    calls = []
    for feed, state in zip(feeds, states):
        collect = _Collect(model.config.vocab_size)
        with state.using(collect):
            feed()
        calls.append(collect.call)
    backend = states[0].backend
    if steps and all(getattr(s.backend, "name", None) == "c" and s.backend.model is model for s in states):
        logits = backend.step_joined(calls, partial=True)
        if logits is not None:
            rest = [i for i, x in enumerate(logits) if x is None]
            if rest:
                for i, x in zip(rest, _torch_join(model, [calls[i] for i in rest])):
                    logits[i] = x
            return logits
    return _torch_join(model, calls)


def _torch_join(model, calls: list[tuple]) -> list[torch.Tensor]:
    """The forwards collected (tokens, positions, cache, slot_mask) as one torch forward -> each
    one's last-position logits."""
    ids = torch.cat([c[0] for c in calls], dim=0)
    positions = torch.cat([c[1] for c in calls], dim=0)
    cache = JoinedKVCache([c[2] for c in calls], [c[3] for c in calls])
    logits = model(ids, positions, cache, None, last_only=True)[:, -1]
    return list(logits.split(cache.rows, dim=0))


__all__ = ["JoinedKVCache", "joinable", "prefill_together", "step_together"]
