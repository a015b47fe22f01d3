"""Scores -> kept masks: which cached (layer, row, KV head, slot) a press keeps.

Budgets are kvpress's (caramba.press.budget, the method's MethodSpec.budget): a row of L real
tokens keeps n_kept = max(1, int(L * (1 - ratio))) per KV head (kvpress.utils.compute_n_kept);
pyramidkv gives layer i its pyramid budget (PyramidKVPress.get_layer_budget); with `adaptive`
(AdaKVPress) each head first keeps its best int(n_kept * alpha_safeguard) (at least 1), then the
layer keeps its KVH * n_kept best scores over all heads together, so heads keep different counts.
Ties break towards the later slot (kvpress leaves them to torch.topk, whose order among equal
values is unspecified).

A hybrid cache (caramba.cache.hybrid) is scored in its full layers only (caramba.press.observe.
pressed_layers): kept_masks gives None for each sliding layer (its ring is kept whole), and
pyramidkv's pyramid runs over the full layers in depth order (layer 0 of the pyramid is the first
full layer, the last full layer its top). A pressed hybrid cache (decoding-time compression after
a press) is scored in the model's slot numbers: a row's slots are those its full layer still holds.

Rows are scored alone: a row's real slots (the `valid` mask; rows are left-padded) are gathered in
order, so a padded batch row keeps what the row alone keeps, and padding is never kept.
"""

from __future__ import annotations

import torch

from caramba.cache.evict import held_slots, slot_contents
from caramba.cache.layer import KVCache
from caramba.press.budget import n_kept, pyramid_budget
from caramba.press.config import PressConfig
from caramba.press.methods import Row
from caramba.press.observe import LayerObservation, Observations, check_cache, pressed_layers, window_of
from caramba.press.spec import score, spec_of


def top(scores: torch.Tensor, n: int) -> torch.Tensor:
    """Bool mask of the n highest of scores' last dim; among equal scores the later index wins."""
    order = torch.sort(scores.flip(-1), dim=-1, descending=True, stable=True).indices[..., :n]
    last = scores.shape[-1] - 1
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, last - order, True)


def adaptive(scores: torch.Tensor, n: int, alpha: float) -> torch.Tensor:
    """AdaKV over one row's heads: scores [KVH, L], n per head on average -> kept [KVH, L]."""
    n_safe = int(n * alpha)
    if alpha > 0:
        n_safe = max(1, n_safe) if n > 0 else 0
    scores = scores.masked_fill(top(scores, n_safe), float("inf"))   # each head's safeguard
    return top(scores.flatten(), scores.shape[0] * n).view(scores.shape)


def layer_row(obs: LayerObservation, observations: Observations, b: int, slots: torch.Tensor,
              keys: torch.Tensor, values: torch.Tensor, press: PressConfig) -> Row:
    """Row b of one layer: its real slots' keys and values and its observation."""
    row = Row(keys[b][:, slots], values[b][:, slots], obs.n_heads, inv_freq=observations.inv_freq)
    if obs.window:
        row.window_q = obs.window_q[b]
    if obs.observes == "attention":
        row.attn_sum = obs.attn_sum[b][:, slots]
    if obs.observes == "queries":
        row.q_mean, row.q_cov = query_statistics(obs, b, slots, press.n_sink)
    return row


def query_statistics(obs: LayerObservation, b: int, slots: torch.Tensor, n_sink: int):
    """Row b's pre-RoPE query mean [H, D] and population covariance [H, D, D] (float64)."""
    count, total, outer = int(obs.q_count[b]), obs.q_sum[b], obs.q_outer[b]
    if n_sink == 0 and int(obs.first_slot[b]) == int(slots[0]):   # the row's first token (observe.py)
        first = obs.first_q[b]
        count, total, outer = count + 1, total + first, outer + first[:, :, None] * first[:, None, :]
    if not obs.partial and count != len(slots) - n_sink:
        raise ValueError(f"row {b}: the press saw {count} context queries after the sinks, expected "
                         f"{len(slots) - n_sink}; a pressed batch must be left-padded (real tokens last)")
    if count == 0:
        raise ValueError(f"row {b}: the press saw no queries to take statistics from")
    mean = total / count
    return mean, outer / count - mean[:, :, None] * mean[:, None, :]


def check_row(press: PressConfig, b: int, length: int, tail_real: bool) -> None:
    """A row too short for the method, or a window over padding: a clear error (kvpress asserts)."""
    if spec_of(press.method).sinks and length <= press.n_sink:
        raise ValueError(f"row {b} has {length} tokens; press {press.method} needs more than "
                         f"press_sinks={press.n_sink}")
    window = window_of(press)
    if window and length <= window:
        raise ValueError(f"row {b} has {length} tokens; press {press.method} needs more than its window of "
                         f"{window} (press_window={press.window_size})" if window > 1 else
                         f"row {b} has {length} tokens; press {press.method} needs at least 2")
    if window and not tail_real:
        raise ValueError(f"row {b}: the last {window} slots are not all real tokens; a pressed batch must be "
                         "left-padded (real tokens last)")


def kept_masks(cache: KVCache, observations: Observations | None, press: PressConfig,
               valid: torch.Tensor | None = None, target: int | None = None,
               rows: torch.Tensor | None = None) -> list[torch.Tensor | None]:
    """Per layer, [B, KVH, S] bool (True = keep) for the S = cache.length slots the context filled
    (None: a hybrid cache's sliding layer, which a press keeps whole).

    observations: what `observing` collected over that prefill (None for knorm, keydiff and
    streaming_llm, which score the cache alone). valid [B, >= S]: True where a slot is a real
    token (DecodeState.valid_slots()); None: all are. target: decoding-time compression (caramba.
    infer.decoding_press): each row keeps min(its length, target) tokens per head instead of the
    ratio's share; rows [B] bool: which rows are scored (the others keep every real slot)."""
    check_cache(cache)
    S, B = cache.length, cache.batch_size
    device = cache.layers[0].k.device
    valid = _check_valid(valid, B, S).to(device)
    scoring = press.active or (target is not None and press.method is not None)
    if scoring:
        _check_press(press, observations, cache, S)
        spec = spec_of(press.method)
    scored = pressed_layers(cache)
    n_scored = sum(scored)
    masks: list[torch.Tensor | None] = []
    for i, layer in enumerate(cache.layers):
        if not scored[i]:
            masks.append(None)
            continue
        depth = sum(scored[:i])                                         # its place among the pressed layers
        keys, values = slot_contents(layer, S)                          # dequantized, rotations undone
        held = held_slots(layer, S)                                     # a pressed layer's (hybrid): its own
        if held is not None and not bool((held == held[:, :1]).all()):
            raise ValueError(f"layer {i} keeps different slots per KV head (press_adaptive, pyramidkv): a cache so "
                             "pressed cannot be pressed again")
        out = torch.zeros(B, layer.n_kv_heads, S, dtype=torch.bool, device=keys.device)
        for b in range(B):
            slots = (valid[b] if held is None else valid[b] & held[b, 0]).nonzero().flatten()
            if not scoring or not len(slots) or (rows is not None and not bool(rows[b])) or \
                    (target is not None and len(slots) <= target):
                out[b][:, slots] = True
                continue
            W = window_of(press)
            check_row(press, b, len(slots), bool(valid[b, S - W:].all()) if W else True)
            obs = observations[i] if observations is not None else None
            row = layer_row(obs, observations, b, slots, keys, values, press) if obs is not None else \
                Row(keys[b][:, slots], values[b][:, slots], 0)
            n = target if target is not None else spec.budget(depth, n_scored, len(slots), press)
            if target is not None:
                row.budget = n   # streaming_llm prunes to the count, not the ratio
            scores = score(row, press)
            kept = adaptive(scores, n, press.alpha_safeguard) if press.adaptive else top(scores, n)
            out[b][:, slots] = kept
        masks.append(out)
    return masks


def _check_valid(valid, B: int, S: int) -> torch.Tensor:
    if valid is None:
        return torch.ones(B, S, dtype=torch.bool)
    if valid.dtype != torch.bool or valid.dim() != 2 or valid.shape[0] != B or valid.shape[1] < S:
        raise ValueError(f"valid must be a bool tensor [batch={B}, >= {S} slots]; got {valid.dtype} "
                         f"{list(valid.shape)}")
    return valid[:, :S]


def _check_press(press: PressConfig, observations, cache: KVCache, S: int) -> None:
    if not isinstance(press, PressConfig):
        raise TypeError(f"press must be a PressConfig, not {type(press).__name__}")
    spec = spec_of(press.method)   # PressConfig checked the kernel
    if not spec.needs_observation:
        return
    if observations is None:
        raise ValueError(f"press {press.method} scores with what the prefill computed: prefill the context "
                         "inside caramba.press.observing(model, cache, press) and pass its observations")
    if observations.press.method != press.method or len(observations) != len(cache.layers):
        raise ValueError(f"the observations were collected for press {observations.press.method} over "
                         f"{len(observations)} layers, not {press.method} over {len(cache.layers)}")
    if spec.observes == "queries" and observations.press.n_sink != press.n_sink:
        raise ValueError(f"the observations skipped {observations.press.n_sink} sinks, the press "
                         f"{press.n_sink}: observe with the same press")
    if window_of(observations.press) != window_of(press):
        raise ValueError("the observations kept another window size than this press's: observe with the same press")
    seen = {obs.length for obs in observations.layers if obs is not None}
    if seen != {S}:
        raise ValueError(f"the observers saw {sorted(seen)} slots but the cache holds {S}: the whole context "
                         "must be prefilled inside `observing`, and nothing else")


__all__ = ["adaptive", "kept_masks", "n_kept", "pyramid_budget", "top"]
