"""Autoregressive generation with a pre-allocated KV cache.

`Generator` is stateful: each `generate()` continues from what is cached, so a multi-turn
session only prefills the new tokens. `generate()` (the function) is the stateless shortcut.

Batches of ragged prompts are left-padded. Every cache slot carries a validity bit
(`slot_mask`), and every row its own rotary positions, so padding, rows that finished early
and later turns never leak into another token's attention: greedy output per row equals
running that prompt alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from caramba.cache import KVCache
from caramba.cache.layer import CacheOverflowError
from caramba.cache.ring import RingKVCache
from caramba.infer.config import GenerateConfig
from caramba.infer.padding import left_pad
from caramba.infer.plan import ResolvedPlan, has_residual_window, run_chunks, warn_window
from caramba.infer.sampling import History, process_logits, select_tokens


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
    def __init__(self, model, config: GenerateConfig | None = None, device: torch.device | str | None = None, tokenizer=None) -> None:
        self.config = config or GenerateConfig()
        self.tokenizer = tokenizer
        if self.config.eos_token_id is None and tokenizer is not None:
            # Every end-of-reply id the model declares (eos, eot, ...), not only eos.
            stops = list(getattr(tokenizer, "stop_token_ids", ()) or [tokenizer.eos_token_id])
            self.config.eos_token_id = [i for i in stops if i is not None] or None
        self.model = model if device is None else model.to(device)
        self.device = self.model.device
        eos = self.config.eos_ids()
        self.pad_id = self.config.pad_token_id if self.config.pad_token_id is not None else (eos[0] if eos else 0)
        self._stop_strings = [s for s in self.config.stop_sequences if isinstance(s, str)]
        self._stop_ids = [list(s) for s in self.config.stop_sequences if not isinstance(s, str)]
        if self._stop_strings and tokenizer is None:
            raise ValueError("string stop_sequences need a tokenizer: Generator(..., tokenizer=tok)")
        if self.config.num_beams > 1 or self.config.penalty_alpha is not None:
            raise ValueError("the Generator samples or decodes greedily: use caramba.infer.beam_search for "
                             "num_beams > 1 and contrastive_search for penalty_alpha")
        self.rng: torch.Generator | None = None
        self.plan: ResolvedPlan | None = None   # the decode plan the last call ran with
        self.cache_auto: dict | None = None      # what cache_kind="auto" resolved to (None: not auto)
        if self.config.decode_local_window is not None:
            warn_window(self.config.decode_local_window)
        self.reset()

    def reset(self) -> None:
        """Forget the conversation: the next generate() starts from an empty cache."""
        self.cache: KVCache | None = None
        self.slot_mask: torch.Tensor | None = None   # [B, max_seq_len] True where a slot is a real token
        self.has_holes = False                        # any False slot below cache.length
        self.next_pos: torch.Tensor | None = None     # [B] rotary position of each row's next token
        self.seen: torch.Tensor | None = None         # [B, V] tokens in context (repetition penalty)
        self.pending: torch.Tensor | None = None      # [B] last sampled token, not yet in the cache
        self.pending_mask: torch.Tensor | None = None  # [B] which rows have one
        self.history: History | None = None           # n-grams, token counts, tokens this turn
        if self.config.seed is not None:
            self.rng = torch.Generator(device=self.device).manual_seed(self.config.seed)

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
        rows that have finished."""
        tokens, mask = self._as_batch(input_ids, attention_mask)
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
        return GenerationResult(sequences, list(self._finish_reasons), t_first - t0, t_end - t_first, steps)

    # ---- the loop ---------------------------------------------------------------------------

    def _steps(self, tokens: torch.Tensor, mask: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield (tokens [B], active [B]) per generated position; inactive rows are padding."""
        cfg = self.config
        B = tokens.shape[0]
        self._start_turn(B)
        n_input = tokens.shape[1]
        if self.pending is not None:  # the last turn's final token goes in before the new input
            tokens = torch.cat([self.pending[:, None], tokens], dim=1)
            mask = torch.cat([self.pending_mask[:, None], mask], dim=1)
        T = tokens.shape[1]
        # The final sampled token is never fed, so the turn needs T + max_new_tokens - 1 slots.
        # Checked before the pending token is consumed, so an overflow leaves the session intact.
        self.cache.check_room(T + cfg.max_new_tokens - 1)
        self._check_positions(T + cfg.max_new_tokens - 1)
        self.pending = self.pending_mask = None
        ring = isinstance(self.cache, RingKVCache)
        self.plan = cfg.decode.resolve(T, has_residual_window(self.cache), self.cache.max_write if ring else None)
        if self.history is not None:   # this turn's input; the pending token is in it already
            self.history.n_new = 0
            self.history.add_context(tokens[:, T - n_input:], mask[:, T - n_input:])

        self._track_seen(tokens, mask)
        logits = self._forward(tokens, mask)
        active = torch.ones(B, dtype=torch.bool, device=self.device)
        reasons = ["length"] * B
        self._finish_reasons = reasons
        recent: list[list[int]] = [[] for _ in range(B)]
        eos = torch.tensor(cfg.eos_ids(), dtype=torch.long, device=self.device)
        for step in range(cfg.max_new_tokens):
            new = select_tokens(process_logits(logits, cfg.sampling, self.seen, self.history), cfg.sampling, self.rng)
            new = torch.where(active, new, torch.full_like(new, self.pad_id))
            yield new, active
            was_active = active
            if len(eos):
                hit_eos = torch.isin(new, eos) & active
                for row in hit_eos.nonzero().flatten().tolist():
                    reasons[row] = "eos"
                active = active & ~hit_eos
            if self._stop_strings or self._stop_ids:
                active = self._check_stops(new, active, recent, reasons)
            self._track_seen(new[:, None], was_active[:, None])
            if self.history is not None:
                self.history.add_generated(new, was_active)
            if not bool(active.any()) or step == cfg.max_new_tokens - 1:
                # Rows whose last token is real keep it pending for the next turn.
                self.pending, self.pending_mask = new, was_active
                return
            logits = self._forward(new[:, None], was_active[:, None])

    @torch.inference_mode()
    def _forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Feed tokens [B, T] (mask: which are real) at the next slots; logits of the last [B, V]."""
        T = tokens.shape[1]
        positions = self.next_pos[:, None] + mask.long().cumsum(dim=1) - 1
        positions = positions.clamp(min=0)  # padding's position is unused; keep it a valid index
        self.has_holes = self.has_holes or not bool(mask.all())
        self.next_pos += mask.long().sum(dim=1)
        slot_mask = self.slot_mask if self.has_holes else None

        def feed(a: int, b: int, last: bool) -> torch.Tensor:
            # Mark each chunk's slots as it runs: a ring's slot_mask (slot % capacity) is too
            # narrow to hold a long input's all at once.
            start = self.cache.length
            if isinstance(self.cache, RingKVCache):
                slots = torch.arange(start, start + b - a, device=self.device)
                self.slot_mask[:, slots % self.slot_mask.shape[1]] = mask[:, a:b]
            else:
                self.slot_mask[:, start : start + b - a] = mask[:, a:b]
            return self.model(tokens[:, a:b], positions[:, a:b], self.cache, slot_mask, last_only=last)

        return run_chunks(feed, T, self.plan.q_chunk, last_only=True)[:, -1]

    def _check_positions(self, n_new: int) -> None:
        """A learned position table (GPT-2) ends at n_positions: say so before the first token
        streams, not at the step that crosses it. A ring cache does not lift this bound."""
        wpe = getattr(self.model, "wpe", None)
        if wpe is not None and int(self.next_pos.max()) + n_new > wpe.num_embeddings:
            raise CacheOverflowError(
                f"{int(self.next_pos.max())} positions used + {n_new} new exceed this model's learned position "
                f"table (n_positions={wpe.num_embeddings}); shorten the prompt or lower max_new_tokens")

    def _start_turn(self, B: int) -> None:
        if self.cache is None:
            cfg = self.config
            self.cache = self._new_cache(B)
            width = self.cache.capacity if isinstance(self.cache, RingKVCache) else cfg.max_seq_len
            self.slot_mask = torch.zeros(B, width, dtype=torch.bool, device=self.device)
            self.next_pos = torch.zeros(B, dtype=torch.long, device=self.device)
            if cfg.repetition_penalty != 1.0:
                self.seen = torch.zeros(B, self.model.config.vocab_size, dtype=torch.bool, device=self.device)
            if cfg.min_new_tokens or cfg.no_repeat_ngram_size or cfg.frequency_penalty or cfg.presence_penalty:
                self.history = History(B, self.model.config.vocab_size, cfg.sampling, self.device)
        elif self.cache.batch_size != B:
            raise ValueError(f"this session holds {self.cache.batch_size} rows; got {B} (call reset() first)")

    def _new_cache(self, B: int) -> KVCache:
        """The cache: with a window, a ring buffer where the cache supports one (then generation
        is not bounded by max_seq_len), else a plain cache that masks to the window."""
        if self.config.cache.is_auto:   # the autotune's choice, on first use (caramba.infer.autocache)
            from caramba.infer.autocache import resolve

            self.config, self.cache_auto = resolve(self.model, self.tokenizer, self.config, B)
        cfg = self.config
        window = cfg.decode_local_window
        if window is not None:
            try:
                return RingKVCache.build(self.model, B, window, cfg.decode.max_write(), cfg.cache_spec())
            except ValueError:
                pass  # e.g. a residual window: the plain cache below, plan records ring=False
        cache = self.model.new_cache(B, cfg.max_seq_len, cfg.cache_spec())
        cfg.cache.check_budget(cache.nbytes)
        cache.window = window
        return cache

    def _track_seen(self, tokens: torch.Tensor, mask: torch.Tensor) -> None:
        if self.seen is not None:
            # Mark real tokens only: every write is True, so duplicate ids cannot race (a scatter_
            # of the mask let a padding slot sharing a real token's id unmark it, in any order on GPU).
            rows, cols = mask.nonzero(as_tuple=True)
            self.seen[rows, tokens[rows, cols]] = True

    def _check_stops(self, new: torch.Tensor, active: torch.Tensor, recent: list[list[int]], reasons: list[str]) -> torch.Tensor:
        longest = max([len(s) for s in self._stop_strings] + [len(s) for s in self._stop_ids] + [1])
        keep = longest + 8  # enough trailing tokens to contain any stop sequence
        active = active.clone()
        for row in active.nonzero().flatten().tolist():
            recent[row].append(int(new[row]))
            del recent[row][:-keep]
            ids = recent[row]
            hit = any(len(ids) >= len(s) and ids[-len(s):] == s for s in self._stop_ids)
            if not hit and self._stop_strings:
                text = self.tokenizer.decode(ids)
                hit = any(s in text for s in self._stop_strings)
            if hit:
                active[row] = False
                reasons[row] = "stop_sequence"
        return active

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
            if self.pending is None:
                raise ValueError("every row needs at least one input token")
        return tokens.to(self.device), mask.to(self.device)


def generate(model, input_ids, config: GenerateConfig | None = None, tokenizer=None, **overrides) -> torch.Tensor:
    """Stateless generation: [B, T] -> [B, T + N]. Keyword overrides set GenerateConfig fields."""
    config = GenerateConfig(**overrides) if config is None else config.replace(**overrides)
    return Generator(model, config, tokenizer=tokenizer).generate(input_ids)


__all__ = ["CacheOverflowError", "GenerateConfig", "GenerationResult", "Generator", "generate"]
