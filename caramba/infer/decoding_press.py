"""Decoding-time compression: every `press_interval` generated tokens, score the cache with the
press's method and evict down to `press_target` tokens per row, layer and KV head.

kvpress's DecodingPress (kvpress/presses/decoding_press.py), in caramba's terms:
- the count is of decode steps since the last compression (the prefill is not counted; the
  prefill press, if `press_ratio` > 0, has run already: kvpress's PrefillDecodingPress). When it
  reaches the interval, the cache (context survivors and generated tokens alike, the step's own
  token included) is scored and each row keeps min(its length, target) tokens per head, the
  count kvpress's ratio search aims at;
- what the method scores with comes from the decode steps just before the compression, as
  kvpress's buffer of hidden states: snapkv the queries of the last `press_window` steps, tova
  the last one, expected_attention the statistics of the last min(interval, 256) steps (kvpress's
  default buffer); knorm, keydiff and streaming_llm score the keys and values alone.
- Where caramba differs: the watched queries keep the RoPE positions they were computed at
  (kvpress re-rotates the buffered hidden states at the current step's position), and
  expected_attention's statistics skip no buffered tokens (kvpress drops the buffer's first
  n_sink, which are not sinks).

Cost: the C decode step calls no observer, so a query-scoring method decodes its watched steps on
the torch path (the state feeds them through TorchStep meanwhile); the other steps, and every step of
the key/value methods, keep the C step. Each compression scores every row and rebuilds the cache
(caramba.cache.evict) with uniform budgets, which the C step reads as it is. Survivors keep their
RoPE positions; new tokens continue at each row's next position (DecodeState.next_pos), and
DecodeState.evicted counts the dropped tokens.

Hybrid models (Gemma 2/3, caramba.cache.hybrid): each compression presses the full layers only,
as a prefill press does; their rings keep their window. A pressed hybrid cache keeps the model's
slot numbers (the rings'), so a second compression scores what each full layer still holds there
(caramba.cache.evict.held_slots).
"""

from __future__ import annotations

import contextlib

import torch

from caramba.infer.pressing import check_pressable
from caramba.infer.state import DecodeState
from caramba.model.backend import TorchStep
from caramba.press import PressConfig, kept_masks, observing
from caramba.press.observe import window_of
from caramba.press.spec import spec_of

BUFFER = 256   # kvpress's hidden_states_buffer_size: decode steps expected_attention's statistics span


def watched_steps(press: PressConfig) -> int:
    """Decode steps before each compression whose queries the method scores with (0: none)."""
    if spec_of(press.method).observes == "queries":   # statistics over kvpress's buffer
        return min(press.interval, BUFFER)
    return window_of(press)


class DecodingPress:
    """One turn's decoding-time compression on `state`: call `before_step()` before each decode
    step's forward and `after_step(active)` after it (active [B]: which rows fed a real token)."""

    def __init__(self, state: DecodeState, press: PressConfig) -> None:
        if not press.decoding:
            raise ValueError("DecodingPress needs a press with press_interval set")
        check_pressable(state.model, press)   # what a model cannot press: refused, with the reason
        self.state, self.press = state, press
        self.steps = 0                       # decode steps since the last compression
        self.watch = watched_steps(press)
        self.compressions = 0
        self.watched: torch.Tensor | None = None   # [B] rows that fed a real token at every watched step
        self._observing: contextlib.ExitStack | None = None
        self._seen = None

    def before_step(self) -> None:
        if self.watch and self._observing is None and self.steps >= self.press.interval - self.watch:
            self._observing = contextlib.ExitStack()
            self._seen = self._observing.enter_context(
                observing(self.state.model, self.state.cache, self.press, decoding=True))
            # the observers see only the model's own forward, never the fused C step
            self._observing.enter_context(self.state.using(TorchStep(self.state.model)))
            self.watched = torch.ones(self.state.batch_size, dtype=torch.bool, device=self.state.next_pos.device)

    def after_step(self, active: torch.Tensor | None = None) -> bool:
        """Count the step; compress when the interval is reached -> whether it compressed."""
        self.steps += 1
        if self.watched is not None and active is not None:
            self.watched &= active.to(self.watched.device)
        if self.steps < self.press.interval:
            return False
        self.compress()
        return True

    @torch.inference_mode()
    def compress(self) -> None:
        """Score the cache and keep `target` tokens per row and head. A row that skipped a watched
        step (it finished: its last slots are holes) is not scored by a query method and keeps its
        tokens."""
        state = self.state
        try:
            kept = kept_masks(state.cache, self._seen, self.press, state.valid_slots(), target=self.press.target,
                              rows=self.watched)
        finally:
            self.close()
        state.press(kept)
        self.steps = 0
        self.compressions += 1

    def close(self) -> None:
        """Stop observing (the C step comes back); idempotent, called at the end of a turn too."""
        if self._observing is not None:
            stack, self._observing, self._seen, self.watched = self._observing, None, None, None
            stack.close()


__all__ = ["BUFFER", "DecodingPress", "watched_steps"]
