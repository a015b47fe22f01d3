"""Decode speed of each candidate cache at the target context length, prefill excluded.

The context (real text, `max_seq_len - steps` tokens per row) is prefilled once into the baseline
cache; each candidate's cache is then filled from it through `LayerKVCache.update`, its own write
path (quantization, key rotation, residual window), so no candidate pays or times a prefill.
Candidates are measured in alternating rounds (one untimed warm-up round, then `repeats` timed
ones) so that a load change on a shared machine hits all of them alike; each round times `steps`
greedy decode steps, and a candidate's speed is the median over its rounds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from caramba.bench.measure import prompt_batch, sync_device
from caramba.cache import CachePolicy, KVCache
from caramba.cache.evict import evict
from caramba.infer.decoding_press import DecodingPress
from caramba.infer.pressing import observing_all
from caramba.infer.state import DecodeState
from caramba.model.backend import Backend, choose
from caramba.press import PressConfig, kept_masks, n_kept


@torch.inference_mode()
def measure_speed(model, policies: Sequence[CachePolicy], baseline: CachePolicy, text_ids: list[int],
                  batch_size: int, max_seq_len: int, steps: int = 8, repeats: int = 3, warmup: int = 1,
                  on_round: Callable[[int, int], None] | None = None, context: int | None = None,
                  presses: Sequence[PressConfig | None] | None = None) -> list[dict]:
    """Per policy: {"decode_tok_s" (median), "samples" (tok/s per timed round), "context", "steps",
    "error"}. context: tokens already cached when timing starts (default and at most max_seq_len - steps).
    A policy whose decode raises gets decode_tok_s None and the error, and is not timed again.
    presses: per policy, a press (or None): its cache holds the context's survivors (see _Pressed)."""
    if max_seq_len < 2:
        raise ValueError(f"max_seq_len={max_seq_len}: the speed phase needs room for a context and a decode step")
    steps = min(steps, max_seq_len - 1)
    context = max_seq_len - steps if context is None else min(context, max_seq_len - steps)
    presses = [p if p is not None and p.enabled else None for p in (presses or [None] * len(policies))]
    tokens = torch.tensor(prompt_batch(text_ids, context, batch_size), device=model.device)   # [B, context]
    source = model.new_cache(batch_size, max_seq_len, baseline)
    watched = list(dict.fromkeys(p for p in presses if p is not None))
    with observing_all(model, source, watched) as seen:   # the presses score what this prefill shows them
        # through the model's own forward (the torch path), whose attention calls the observers
        first = model(tokens, cache=source, last_only=True)[:, -1].argmax(-1)                # [B]
    kept = {p: _kept(source, seen[watched.index(p)], p) for p in watched}
    forward = choose(model)     # the backend a Generator would decode with (caramba.model.backend)
    samples: list[list[float]] = [[] for _ in policies]
    errors: list[str | None] = [None for _ in policies]
    rounds = warmup + repeats
    for r in range(rounds):
        for i, policy in enumerate(policies):
            if errors[i] is not None:
                continue
            try:
                press = presses[i]
                if press is None:
                    rate = _decode_rate(forward, _filled(model, policy, source, batch_size, max_seq_len), first, steps)
                else:
                    rate = _pressed_rate(forward, policy, source, kept[press], press, first, steps)
            except Exception as e:   # fails this candidate only
                errors[i] = f"speed error: {type(e).__name__}: {e}"
                continue
            if r >= warmup:
                samples[i].append(rate)
        if on_round:
            on_round(r + 1, rounds)
    return [{"decode_tok_s": statistics.median(s) if err is None else None, "samples": s, "context": context,
             "steps": steps, "error": err} for s, err in zip(samples, errors)]


def _kept(source: KVCache, seen, press: PressConfig) -> list[torch.Tensor]:
    """What the press keeps of the context, as decoding meets it: the prefill press's survivors;
    with decoding-time compression, the target it compresses to (the size its cache returns to
    every interval), scored from the context's observations."""
    if not press.decoding:
        return kept_masks(source, seen, press)
    target = min(press.target, n_kept(source.length, press.ratio)) if press.active else press.target
    return kept_masks(source, seen, press, target=target)


def _pressed_rate(forward: Backend, policy: CachePolicy, source: KVCache, kept, press: PressConfig,
                  first: torch.Tensor, steps: int) -> float:
    """Tokens per second over `steps` greedy decode steps on the survivors, stored in `policy`'s
    kinds (caramba.cache.evict); decoding-time compression runs if its interval falls inside."""
    B, model = source.batch_size, forward.model
    state = DecodeState(model, model.new_cache(B, 1, policy), backend=forward)
    state.cache, state.slot_mask = evict(source, kept, state.cache, source.max_seq_len - source.length)
    state.next_pos = torch.full((B,), source.length, dtype=torch.long, device=first.device)
    decoding = DecodingPress(state, press) if press.decoding else None
    token = first
    sync_device(model.device)
    t0 = time.perf_counter()
    try:
        for _ in range(steps):
            if decoding is not None:
                decoding.before_step()
            token = state.step(token).argmax(-1)
            if decoding is not None:
                decoding.after_step()
    finally:
        if decoding is not None:
            decoding.close()
    sync_device(model.device)
    return steps * B / (time.perf_counter() - t0)


def _filled(model, policy: CachePolicy, source: KVCache, batch_size: int, max_seq_len: int) -> KVCache:
    """A new cache of `policy` holding the source cache's tokens (written through its own path)."""
    cache = model.new_cache(batch_size, max_seq_len, policy)
    n = source.length
    for dst, src in zip(cache.layers, source.layers):
        dst.update(src.k[:, :, :n], src.v[:, :, :n])   # [B, KVH, n, D]: the baseline stores plain values
    return cache


def _decode_rate(forward: Backend, cache: KVCache, first: torch.Tensor, steps: int) -> float:
    """Tokens per second over `steps` greedy decode steps from the cache's current length."""
    token = first
    device = forward.model.device
    sync_device(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        token = forward(token[:, None], cache=cache, last_only=True)[:, -1].argmax(-1)
    sync_device(device)
    return steps * token.shape[0] / (time.perf_counter() - t0)
