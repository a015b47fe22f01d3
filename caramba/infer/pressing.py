"""A press in a decoding state: prefill a context while the press watches, then keep what it chose.

The context's tokens go through the model as in any prefill (DecodeState.prefill) with the
press's observers on the cache (caramba.press.observing): queries of the last window, attention
received, query statistics, whatever the method scores with. Then every layer's tokens are
scored (caramba.press.kept_masks) and the cache is rebuilt with the survivors only
(DecodeState.press, caramba.cache.evict), in the cache's own kinds or a template's. The logits
the prefill returns were computed over the whole context: the first new token sees everything,
the later ones the survivors (kvpress's protocol). press_masks does the same on a fresh fp32 cache
and returns the kept masks (what the benchmark and a caller without a decoding state use).

A hybrid model (Gemma 2/3, caramba.cache.hybrid) is pressed in its full layers only: only they are
observed and scored, the pressed cache keeps the model's slot numbers (the rings'), and the sliding
layers' rings carry over untouched (the kept masks hold None for them; DecodeState.kept_share is the full
layers' share). Decoding-time compression presses the full layers again, in the model's slot
numbers. Gemma 2's soft-capped attention reads a pressed layer through its attend_softcapped (its
own slots under the mapped mask), as the uncapped attention reads its attend.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from caramba.cache import KVCache
from caramba.infer.state import DecodeState
from caramba.model.backend import TorchStep
from caramba.press import PressConfig, kept_masks, observing


def check_pressable(model, press: PressConfig) -> None:
    """Refuse, before any work, a press the model cannot take."""
    if model.config.attention == "decoupled":
        raise ValueError(f"press={press.method}: presses score standard attention's keys; a decoupled (DBA) model's "
                         "three streams have no press yet: drop press or use a standard-attention model")


@torch.inference_mode()
def press_masks(model, context_ids: torch.Tensor, press: PressConfig, q_chunk: int | None = 512,
                mask: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Per layer, [B, KVH, S] bool (True = keep) for context_ids [B, S] (left-padded where mask
    [B, S], True = real token, says so), prefilled in chunks of q_chunk tokens (None: one)."""
    if context_ids.dim() != 2 or context_ids.dtype not in (torch.long, torch.int32, torch.int64):
        raise ValueError(f"context_ids must be integer token ids [batch, tokens]; got {context_ids.dtype} "
                         f"{list(context_ids.shape)}")
    B, S = context_ids.shape
    if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (B, S)):
        raise ValueError(f"mask must be a bool tensor [{B}, {S}] (True = real token); got {mask.dtype} "
                         f"{list(mask.shape)}")
    if q_chunk is not None and q_chunk < 1:
        raise ValueError(f"q_chunk={q_chunk} must be >= 1 or None")
    # the torch path: its forwards call the observers (the fused C step's do not)
    state = DecodeState(model, model.new_cache(B, S, "fp32"), q_chunk=q_chunk, backend=TorchStep(model))
    with observing(model, state.cache, press) as observations:
        state.prefill(context_ids.to(model.device), None if mask is None else mask.to(model.device))
    return kept_masks(state.cache, observations, press, state.valid_slots())


@torch.inference_mode()
def prefill_pressed(state: DecodeState, tokens: torch.Tensor, mask: torch.Tensor | None, press: PressConfig,
                    template: KVCache | None = None) -> torch.Tensor:
    """Prefill tokens [B, T] (mask: which are real) and press the cache -> next-token logits [B, V]."""
    check_pressable(state.model, press)
    # the torch path: its forwards call the observers (the fused C step's do not)
    with observing(state.model, state.cache, press) as seen, state.using(TorchStep(state.model)):
        logits = state.prefill(tokens, mask)
    # rows of different lengths keep different counts: packed, unless decoding compression presses again
    state.press(kept_masks(state.cache, seen, press, state.valid_slots()), template, ragged_rows=not press.decoding)
    return logits


class _Both:
    """Two observers of one layer, called in turn."""

    def __init__(self, first, second) -> None:
        self.first, self.second = first, second

    def __call__(self, *args) -> None:
        self.first(*args)
        self.second(*args)


@contextlib.contextmanager
def observing_all(model, cache: KVCache, presses: Sequence[PressConfig]):
    """One context prefill watched by several presses (an eval's candidates share the context
    prefill) -> each press's observations, in order."""
    for press in presses:
        check_pressable(model, press)
    with contextlib.ExitStack() as stack:
        seen = []
        for press in presses:
            before = [layer.observer for layer in cache.layers]
            seen.append(stack.enter_context(observing(model, cache, press)))
            for layer, earlier in zip(cache.layers, before):
                if earlier is not None:
                    layer.observer = _Both(earlier, layer.observer)
        yield seen


__all__ = ["check_pressable", "observing_all", "prefill_pressed"]
