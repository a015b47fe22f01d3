"""Prompts in any accepted form -> lists of ids -> one left-padded batch, as every decoding
strategy feeds its rows."""

from __future__ import annotations

import torch


def left_pad(rows: list[list[int]], pad_id: int, width: int | None = None,
             device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, W] padded on the left with pad_id, and mask [B, W] (True on real tokens).
    W defaults to the longest row; an empty row is all padding."""
    width = max(len(r) for r in rows) if width is None else width
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r):] = True
    return ids.to(device), mask.to(device)


def as_rows(input_ids, attention_mask: torch.Tensor | None = None) -> list[list[int]]:
    """Tensor [T] / [B, T] (optionally with a left-padding mask) or (ragged) lists -> lists of ids."""
    if isinstance(input_ids, torch.Tensor):
        tokens = input_ids if input_ids.dim() == 2 else input_ids[None]
        mask = torch.ones_like(tokens, dtype=torch.bool) if attention_mask is None else attention_mask.bool().view(tokens.shape)
        rows = [t[m].tolist() for t, m in zip(tokens.cpu(), mask.cpu())]
    else:
        rows = [list(input_ids)] if input_ids and isinstance(input_ids[0], int) else [list(r) for r in input_ids]
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError("every row needs at least one input token")
    return rows
