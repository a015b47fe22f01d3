"""Autoregressive generation with a pre-allocated KV cache.

`Generator` is stateful: each `generate()` continues from what is cached, so a multi-turn
session only prefills the new tokens. `generate()` (the function) is the stateless shortcut.

Batches of ragged prompts are left-padded. Every cache slot carries a validity bit
(`slot_mask`), and every row its own rotary positions (caramba.infer.state), so padding, rows
that finished early and later turns never leak into another token's attention: greedy output
per row equals running that prompt alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from caramba import resolvers, threads
from caramba.cache import KVCache
from caramba.cache.layer import CacheOverflowError
from caramba.infer.config import GenerateConfig
from caramba.infer.decoding_press import DecodingPress
from caramba.infer.padding import left_pad
from caramba.infer.plan import ResolvedPlan, warn_window
from caramba.infer.sampling import History, process_logits, select_tokens
from caramba.infer.pressing import prefill_pressed
from caramba.infer.state import DecodeState
from caramba.infer.stops import StopChecker, pad_id_for
from caramba.model.backend import Backend, ThreadChoice, choose


@dataclass
class GenerationResult:
    sequences: list[list[int]]     # new token ids per row (ending with EOS when it stopped on one)
    finish_reasons: list[str]      # per row: "eos" | "stop_sequence" | "length"
    prefill_s: float               # prompt forward + first token
    decode_s: float                # every later token
    decode_steps: int              # forward passes after the prefill

    @property
    def n_generated(self) -> int:
        return sum(len(s) for s in self.sequences)

    @property
    def decode_tok_s(self) -> float:
        """Tokens produced by the decode steps (every row's tokens after its first) per second."""
        after_first = sum(max(len(s) - 1, 0) for s in self.sequences)
        return after_first / self.decode_s if self.decode_s > 0 else 0.0


class Generator:
    """A stateful generation session over `model` (see the module doc). `cache_resolver` picks the
    cache for `cache_kind="auto"` on first use; None: the default registered in caramba.resolvers
    (caramba.autotune's: the stored plan first, else a fresh selection).

    Each session (the first generate() after construction or reset()) chooses its decoding backend
    from the model as it is then (caramba.model.backend.choose: the fused C step where it applies,
    `model.fast_decode = False` for the torch path); `decode_threads` is the C step's thread choice,
    kept across sessions (pass one to share it between Generators: a benchmark's repeats)."""

    def __init__(self, model, config: GenerateConfig | None = None, device: torch.device | str | None = None, tokenizer=None,
                 cache_resolver: resolvers.CacheResolver | None = None, decode_threads: ThreadChoice | None = None) -> None:
        self.config = config or GenerateConfig()
        self.cache_resolver = cache_resolver
        self.decode_threads = ThreadChoice() if decode_threads is None else decode_threads
        self.tokenizer = tokenizer
        self.model = model if device is None else model.to(device)
        self.device = self.model.device
        self.stops = StopChecker.for_config(self.config, tokenizer, self.device)
        self.pad_id = pad_id_for(self.config)
        if self.config.num_beams > 1 or self.config.penalty_alpha is not None:
            raise ValueError("the Generator samples or decodes greedily: use caramba.infer.beam_search for "
                             "num_beams > 1 and contrastive_search for penalty_alpha")
        self.rng: torch.Generator | None = None
        self.plan: ResolvedPlan | None = None   # the decode plan the last call ran with
        self.cache_auto: dict | None = None      # what cache_kind="auto" resolved to (None: not auto)
        self.decoding: DecodingPress | None = None   # the last turn's decoding-time compression (press_interval)
        if self.config.decode_local_window is not None:
            warn_window(self.config.decode_local_window)
        self.reset()

    def reset(self) -> None:
        """Forget the conversation: the next generate() starts from an empty cache."""
        self.state: DecodeState | None = None         # cache, slot mask, positions, pending token
        self.seen: torch.Tensor | None = None         # [B, V] tokens in context (repetition penalty)
        self.history: History | None = None           # n-grams, token counts, tokens this turn
        self.threads: threads.Choice | None = None     # CPU threads this session runs on (caramba.threads)
        if self.config.seed is not None:
            self.rng = torch.Generator(device=self.device).manual_seed(self.config.seed)

    @property
    def cache(self) -> KVCache | None:
        return None if self.state is None else self.state.cache

    @property
    def backend(self) -> Backend | None:
        """The session's decoding backend (its `path` says which path the steps took)."""
        return None if self.state is None else self.state.backend

    @property
    def has_holes(self) -> bool:
        return self.state is not None and self.state.has_holes

    # ---- public API -------------------------------------------------------------------------

    def generate(self, input_ids, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T] (or ragged lists) -> [B, T + N]: this call's input followed by the new tokens,
        right-padded with the pad id where a row stopped early (HF's convention)."""
        tokens, mask = self._as_batch(input_ids, attention_mask)
        result = self.run(tokens, mask)
        width = max(len(s) for s in result.sequences)
        out = torch.full((tokens.shape[0], width), self.pad_id, dtype=torch.long)
        for i, seq in enumerate(result.sequences):
            out[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        return torch.cat([tokens.cpu(), out], dim=1)

    def generate_iter(self, input_ids, attention_mask: torch.Tensor | None = None) -> Iterator:
        """Stream tokens: ints for a single row; for a batch, a list per step with None for
        rows that have finished. The input is checked and the threads chosen now, before the
        caller's first next() (a benchmark's clock): that one runs the prefill."""
        tokens, mask = self._as_batch(input_ids, attention_mask)
        self._cpu_threads()
        return self._ids(tokens, mask)

    def _ids(self, tokens: torch.Tensor, mask: torch.Tensor) -> Iterator:
        single = tokens.shape[0] == 1
        for step_tokens, active in self._steps(tokens, mask):
            ids = [t if a else None for t, a in zip(step_tokens.tolist(), active.tolist())]
            yield ids[0] if single else ids

    def run(self, input_ids, attention_mask: torch.Tensor | None = None,
            on_token: Callable[[int, int], None] | None = None) -> GenerationResult:
        """Generate and return per-row tokens, finish reasons and timings.
        on_token(row, token_id) is called as each token is produced (for streaming)."""
        tokens, mask = self._as_batch(input_ids, attention_mask)
        B = tokens.shape[0]
        sequences: list[list[int]] = [[] for _ in range(B)]
        self._cpu_threads()
        t0 = time.perf_counter()
        t_first = None
        steps = 0
        for step_tokens, active in self._steps(tokens, mask):
            if t_first is None:
                t_first = time.perf_counter()
            else:
                steps += 1
            for row in active.nonzero().flatten().tolist():
                tok = int(step_tokens[row])
                sequences[row].append(tok)
                if on_token is not None:
                    on_token(row, tok)
        t_end = time.perf_counter()
        return GenerationResult(sequences, list(self.stops.reasons), t_first - t0, t_end - t_first, steps)

    # ---- the loop ---------------------------------------------------------------------------

    def _steps(self, tokens: torch.Tensor, mask: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield (tokens [B], active [B]) per generated position; inactive rows are padding."""
        B = tokens.shape[0]
        state = self._start_turn(B)
        try:
            if self._cpu_threads() is None:
                yield from self._turn(state, tokens, mask)
                return
            with threads.applied(self.threads):     # prefill and steps alike; torch's count restored after
                yield from self._turn(state, tokens, mask)
        finally:   # a decoding-time press's observers off and the C step back, even if the caller stopped early
            if self.decoding is not None:
                self.decoding.close()

    def _cpu_threads(self) -> threads.Choice | None:
        """The CPU thread count of this session, chosen once from the cores free when it starts
        (caramba.threads; ~50 ms of sampling, taken before run() starts its clock); None on a GPU."""
        if self.threads is None and self.device.type == "cpu":
            self.threads = threads.choose()
        return self.threads

    def _turn(self, state: DecodeState, tokens: torch.Tensor, mask: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        cfg = self.config
        B = tokens.shape[0]
        n_input = tokens.shape[1]
        tokens, mask = state.with_pending(tokens, mask)  # the last turn's final token goes in first
        T = tokens.shape[1]
        # The final sampled token is never fed, so the turn needs T + max_new_tokens - 1 slots.
        # Checked before the pending token is consumed, so an overflow leaves the session intact.
        state.check_room(T + cfg.max_new_tokens - 1)
        self.plan = state.resolve(cfg.decode, T)
        if self.history is not None:   # this turn's input; the pending token is in it already
            self.history.n_new = 0
            self.history.add_context(tokens[:, T - n_input:], mask[:, T - n_input:])

        self._track_seen(tokens, mask)
        if cfg.cache.press.active and state.cache.length == 0:
            # The first turn's prompt is the context a press compresses; later turns add theirs whole.
            logits = prefill_pressed(state, tokens, mask, cfg.cache.press)
        else:
            logits = self._forward(tokens, mask)
        active = torch.ones(B, dtype=torch.bool, device=self.device)
        self.stops.start(B)
        # Decoding-time compression (press_interval): every N steps the cache is pressed to a target.
        self.decoding = DecodingPress(state, cfg.cache.press) if cfg.cache.press.decoding else None
        for step in range(cfg.max_new_tokens):
            new = select_tokens(process_logits(logits, cfg.sampling, self.seen, self.history), cfg.sampling, self.rng)
            new = torch.where(active, new, torch.full_like(new, self.pad_id))
            yield new, active
            was_active = active
            active = self.stops.update(new, active)
            self._track_seen(new[:, None], was_active[:, None])
            if self.history is not None:
                self.history.add_generated(new, was_active)
            if not bool(active.any()) or step == cfg.max_new_tokens - 1:
                # Rows whose last token is real keep it pending for the next turn.
                state.pending, state.pending_mask = new, was_active
                return
            if self.decoding is not None:
                self.decoding.before_step()
            logits = self._forward(new[:, None], was_active[:, None])
            if self.decoding is not None:
                self.decoding.after_step(was_active)

    def _forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Feed tokens [B, T] (mask: which are real) -> logits of each row's next token [B, V].
        The prefill and every decode step go through here."""
        return self.state.prefill(tokens, mask)

    def _start_turn(self, B: int) -> DecodeState:
        if self.state is None:
            if self.config.cache.is_auto:   # chosen above the engine, on first use (caramba.resolvers)
                resolve = self.cache_resolver or resolvers.cache_resolver()
                policy, self.cache_auto = resolve(self.model, self.tokenizer, self.config.cache, B)
                press = (self.cache_auto or {}).get("press")   # the plan's press (cache_auto_presses), if any
                self.config = self.config.replace(cache=self.config.cache.with_policy(policy, press))
            cfg, V = self.config, self.model.config.vocab_size
            self.state = DecodeState.for_config(self.model, B, cfg, backend=choose(self.model, self.decode_threads))
            if cfg.repetition_penalty != 1.0:
                self.seen = torch.zeros(B, V, dtype=torch.bool, device=self.device)
            if cfg.min_new_tokens or cfg.no_repeat_ngram_size or cfg.frequency_penalty or cfg.presence_penalty:
                self.history = History(B, V, cfg.sampling, self.device)
        elif self.state.batch_size != B:
            raise ValueError(f"this session holds {self.state.batch_size} rows; got {B} (call reset() first)")
        return self.state

    def _track_seen(self, tokens: torch.Tensor, mask: torch.Tensor) -> None:
        if self.seen is not None:
            # Mark real tokens only: every write is True, so duplicate ids cannot race (a scatter_
            # of the mask let a padding slot sharing a real token's id unmark it, in any order on GPU).
            rows, cols = mask.nonzero(as_tuple=True)
            self.seen[rows, tokens[rows, cols]] = True

    # ---- input handling ---------------------------------------------------------------------

    def _as_batch(self, input_ids, attention_mask) -> tuple[torch.Tensor, torch.Tensor]:
        """Tensor [T] / [B, T] or (ragged) lists -> left-padded ids [B, T] and bool mask."""
        if isinstance(input_ids, torch.Tensor):
            tokens = input_ids if input_ids.dim() == 2 else input_ids[None]
            mask = torch.ones_like(tokens, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
            if mask.dim() == 1:
                mask = mask[None]
        else:
            rows = [list(input_ids)] if input_ids and isinstance(input_ids[0], int) else [list(r) for r in input_ids]
            tokens, mask = left_pad(rows, self.pad_id)
        if bool((mask[:, :-1] & ~mask[:, 1:]).any()):  # a real token followed by padding
            raise ValueError("attention_mask must be left-padded (padding before each row's tokens); "
                             "use padding_side='left' or pass ragged lists of ids")
        if tokens.shape[1] == 0 or not bool(mask.any(dim=1).all()):
            if self.state is None or self.state.pending is None:
                raise ValueError("every row needs at least one input token")
        return tokens.to(self.device), mask.to(self.device)


def generate(model, input_ids, config: GenerateConfig | None = None, tokenizer=None,
             cache_resolver: resolvers.CacheResolver | None = None, **overrides) -> torch.Tensor:
    """Stateless generation: [B, T] -> [B, T + N]. Keyword overrides set GenerateConfig fields."""
    config = GenerateConfig(**overrides) if config is None else config.replace(**overrides)
    return Generator(model, config, tokenizer=tokenizer, cache_resolver=cache_resolver).generate(input_ids)


__all__ = ["CacheOverflowError", "GenerateConfig", "GenerationResult", "Generator", "generate"]
