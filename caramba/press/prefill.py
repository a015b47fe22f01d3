"""The kept masks of one context: prefill it into a fresh fp32 cache while observing, then select.

What the benchmark and a caller without a decoding state of its own use; a decoder that presses its
own cache calls `observing` around its prefill and `kept_masks` after it (caramba.press)."""

from __future__ import annotations

import torch

from caramba.press.config import PressConfig
from caramba.press.observe import observing
from caramba.press.select import kept_masks


@torch.inference_mode()
def press_masks(model, context_ids: torch.Tensor, press: PressConfig, q_chunk: int | None = 512,
                mask: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Per layer, [B, KVH, S] bool (True = keep) for context_ids [B, S] (left-padded where mask
    [B, S], True = real token, says so), prefilled in chunks of q_chunk tokens (None: one)."""
    from caramba.infer.state import DecodeState   # the engine's state imports presses, not the reverse
    from caramba.model.backend import TorchStep

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


__all__ = ["press_masks"]
