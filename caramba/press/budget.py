"""How many tokens a press keeps: kvpress's budgets, per row, layer and KV head."""

from __future__ import annotations


def n_kept(length: int, ratio: float) -> int:
    """Tokens a head keeps of `length` at compression `ratio` (kvpress's compute_n_kept)."""
    if ratio >= 1.0:
        return 0
    return max(1, int(length * (1 - ratio)))


def ratio_budget(layer: int, n_layers: int, length: int, press) -> int:
    """Every layer keeps the ratio's share (every method but pyramidkv)."""
    return n_kept(length, press.ratio)


def pyramid_budget(layer: int, n_layers: int, length: int, press) -> int:
    """PyramidKV's tokens per head for `layer` of n_layers at a `length`-token context: budgets
    fall linearly from the first layer to the last (steepness beta) and sum to what snapkv keeps;
    where the pyramid does not fit, snapkv's budget (floored to 1). kvpress's formula, rounding
    included (Python's round, half to even)."""
    W = press.window_size
    max_capacity = W + length * (1 - press.ratio)
    min_num = (max_capacity - W) / press.beta
    max_num = (max_capacity - W) * 2 - min_num
    if max_num >= length - W:
        max_num = length - W
        min_num = (max_capacity - W) * 2 - max_num
    if not (length >= max_num >= min_num >= W):
        return max(1, round(length * (1 - press.ratio)))
    steps = (max_num - min_num) / (n_layers - 1) if n_layers > 1 else 0.0
    return round(max_num - layer * steps)


__all__ = ["n_kept", "pyramid_budget", "ratio_budget"]
