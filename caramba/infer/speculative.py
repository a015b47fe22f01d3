"""Speculative decoding: a cheap draft proposes k tokens, the target checks them in one forward.

Lossless (Leviathan et al. 2023; Chen et al. 2023). A draft token x ~ q is accepted with
probability min(1, p(x) / q(x)), in order; the first rejected position is resampled from
norm(max(0, p - q)); when all k are accepted a bonus token comes from the target's next
distribution (`spec_extra_token`). p and q pass through the same logits processors
(repetition penalty, temperature, top-k, top-p), so every emitted token is distributed exactly
as plain sampling from the target. Greedy decoding accepts a draft iff it is the target's
argmax, so the output equals plain greedy decoding token for token. `spec_method="greedy"`
with sampling draws the target's token at every position and accepts drafts that equal it
(also exact, lower acceptance). Rejected tokens leave both caches by truncation, never by
recomputation.

Batches: each row drafts its own k, accepts its own prefix and stops on its own; rows keep
their own cache lengths and positions (DecodeState), so no row waits for the slowest.

Draft length, per row: fixed `spec_k`, or with `spec_k_adaptive` HF's heuristic (all drafts
accepted: k += 2, else k = max(1, k - 1); at most `spec_k_max`). `spec_confidence` stops a
model draft early once its probability for the token it drew falls below the threshold (HF's
rule: the unsure token is kept, then drafting stops). `spec_disable_below_accept`: when a
row's acceptance over its last SPEC_ACCEPT_WINDOW drafting rounds (fewer right after a start
or a probe) is below the threshold, the row decodes plainly for SPEC_PROBE_INTERVAL target
steps, then drafts again (a probe) with a fresh window.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from caramba import threads
from caramba.cache import hybrid
from caramba.cache.layer import CacheOverflowError
from caramba.infer.drafts import (
    ModelDraft, PromptLookupDraft, check_vocab, int8_self_draft, layer_skip_draft,
)
from caramba.infer.config import SpeculativeConfig
from caramba.infer.generate import GenerationResult
from caramba.infer.padding import as_rows, left_pad
from caramba.infer.sampling import process_logits, select_tokens
from caramba.infer.pressing import prefill_pressed
from caramba.infer.state import DecodeState
from caramba.infer.stops import StopChecker, pad_id_for
from caramba.model.backend import ThreadChoice, choose

SPEC_ACCEPT_WINDOW = 4    # drafting rounds per row that spec_disable_below_accept averages over
SPEC_PROBE_INTERVAL = 16  # plain target steps before a disabled row drafts again


@dataclass
class SpeculativeStats:
    proposed: int = 0                 # draft tokens put to the target
    accepted: int = 0                 # of those, accepted
    target_forwards: int = 0          # verify forwards after the prefill (one per round)
    draft_forwards: int = 0
    k_history: list[list[int]] = field(default_factory=list)   # per row: k chosen each round (0 = plain step)
    row_forwards: list[int] = field(default_factory=list)      # per row: target forwards it took part in
    row_tokens: list[int] = field(default_factory=list)        # per row: tokens those forwards produced
    row_proposed: list[int] = field(default_factory=list)      # per row: draft tokens proposed
    row_accepted: list[int] = field(default_factory=list)      # per row: of those, accepted

    @classmethod
    def for_rows(cls, B: int) -> SpeculativeStats:
        return cls(k_history=[[] for _ in range(B)], row_forwards=[0] * B, row_tokens=[0] * B,
                   row_proposed=[0] * B, row_accepted=[0] * B)

    def add_round(self, r: int, k: int, proposed: int, accepted: int, gained: int) -> None:
        """Row r's part of one verify round: k asked of the draft, drafts proposed and accepted,
        tokens the row gained."""
        self.proposed += proposed
        self.accepted += accepted
        self.row_proposed[r] += proposed
        self.row_accepted[r] += accepted
        self.k_history[r].append(k)
        self.row_forwards[r] += 1
        self.row_tokens[r] += gained

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_target_forward(self) -> float:
        """Mean tokens a row gains per verify forward (1.0 = plain decoding)."""
        forwards = sum(self.row_forwards)
        return sum(self.row_tokens) / forwards if forwards else 0.0

    def as_dict(self) -> dict:
        return {
            "proposed": self.proposed, "accepted": self.accepted, "acceptance_rate": self.acceptance_rate,
            "target_forwards": self.target_forwards, "draft_forwards": self.draft_forwards,
            "tokens_per_target_forward": self.tokens_per_target_forward, "k_history": self.k_history,
        }


@dataclass
class SpeculativeResult(GenerationResult):
    stats: SpeculativeStats


class SpeculativeGenerator:
    """SpeculativeGenerator(target_model, draft_model=None, config, tokenizer=None).

    draft_model is a caramba Transformer for config.draft == "model"; the other drafts are
    built from the target (self_int8, layer_skip) or need no model (prompt_lookup). Each
    run() / generate() starts a fresh context.
    """

    def __init__(self, target_model, draft_model=None, config: SpeculativeConfig | None = None, tokenizer=None) -> None:
        self.config = config or SpeculativeConfig()
        self.target = target_model
        self.tokenizer = tokenizer
        self.stops = StopChecker.for_config(self.config, tokenizer, target_model.device, owner="SpeculativeGenerator")
        self.pad_id = pad_id_for(self.config)
        self.draft = self._make_draft(draft_model)
        self.stats = SpeculativeStats()
        self.rows: DecodeState | None = None   # the target's decoding state after the last call
        self.plan = None                     # the decode plan (ResolvedPlan) of the last call
        self.rng: torch.Generator | None = None
        self.threads: threads.Choice | None = None    # CPU threads of the last run (caramba.threads)
        self.decode_threads = ThreadChoice()         # the target's C step thread choice, kept across runs

    def _make_draft(self, draft_model):
        cfg = self.config
        if draft_model is not None and cfg.draft != "model":
            raise ValueError(f"a draft_model is only used with draft='model' (draft={cfg.draft!r})")
        if cfg.draft == "model":
            if draft_model is None:
                raise ValueError("draft='model' needs a draft_model (or choose draft='prompt_lookup', 'self_int8' or 'layer_skip')")
            check_vocab(self.target, draft_model)
            return ModelDraft(draft_model)
        if cfg.draft == "prompt_lookup":
            return PromptLookupDraft(cfg.lookup_max_ngram, cfg.lookup_min_ngram)
        if cfg.draft == "self_int8":
            return ModelDraft(int8_self_draft(self.target), "self_int8")
        return ModelDraft(layer_skip_draft(self.target, cfg.draft_layers), "layer_skip")

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens over the last call."""
        return self.stats.acceptance_rate

    # ---- public API -------------------------------------------------------------------------

    def generate(self, input_ids, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T] (or ragged lists) -> [B, T + N] like Generator.generate: the input, then the
        new tokens, right-padded with the pad id where a row stopped early."""
        rows = as_rows(input_ids, attention_mask)
        result = self.run(rows)
        tokens, _ = left_pad(rows, self.pad_id)
        width = max(len(s) for s in result.sequences)
        out = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        for i, seq in enumerate(result.sequences):
            out[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        return torch.cat([tokens, out], dim=1)

    def run(self, input_ids, attention_mask: torch.Tensor | None = None,
            on_token: Callable[[int, int], None] | None = None) -> SpeculativeResult:
        """Generate; per-row tokens, finish reasons, timings and stats (also kept in .stats).
        on_token(row, token_id) is called as tokens are accepted (for streaming). On a CPU it runs
        on the threads caramba.threads chooses (kept in .threads), chosen before the clock starts."""
        if self.target.device.type != "cpu":
            return self._run(input_ids, attention_mask, on_token)
        self.threads = threads.choose()
        with threads.applied(self.threads):
            return self._run(input_ids, attention_mask, on_token)

    def _run(self, input_ids, attention_mask: torch.Tensor | None, on_token) -> SpeculativeResult:
        cfg = self.config
        rows = as_rows(input_ids, attention_mask)
        B, device = len(rows), self.target.device
        width = max(len(r) for r in rows)
        self._check_fits(B, width)
        if cfg.seed is not None:
            self.rng = torch.Generator(device=device).manual_seed(cfg.seed)
        sampling = cfg.sampling
        # kept for inspection; its backend read from the target as it is now (caramba.model.backend)
        target = self.rows = DecodeState.for_config(self.target, B, cfg, backend=choose(self.target, self.decode_threads))
        self.plan = target.resolve(cfg.decode, width)   # the prefill and long verifications run in chunks
        self.draft.start(B, cfg.max_seq_len, cfg.cache_spec())
        stats = self.stats = SpeculativeStats.for_rows(B)
        seen = None
        if cfg.repetition_penalty != 1.0:
            seen = torch.zeros(B, self.target.config.vocab_size, dtype=torch.bool, device=device)
            for r, ids in enumerate(rows):
                seen[r, ids] = True

        contexts = [list(r) for r in rows]
        sequences: list[list[int]] = [[] for _ in range(B)]
        self.stops.start(B)
        active = [True] * B

        def emit(r: int, tokens: list[int]) -> None:
            for tok in tokens[: cfg.max_new_tokens - len(sequences[r])]:
                sequences[r].append(tok)
                contexts[r].append(tok)
                if seen is not None:
                    seen[r, tok] = True
                if on_token is not None:
                    on_token(r, tok)
                if self.stops.check(r, tok) is not None:
                    active[r] = False
                    return
            if len(sequences[r]) >= cfg.max_new_tokens:
                active[r] = False

        t0 = time.perf_counter()
        tokens, mask = left_pad(rows, self.pad_id, width, device)
        if cfg.cache.press.active:   # the target's context is pressed; the drafts keep their own caches whole
            logits = prefill_pressed(target, tokens, mask, cfg.cache.press)
        else:
            logits = target.prefill(tokens, mask)
        first = select_tokens(process_logits(logits, sampling, seen), sampling, self.rng).tolist()
        for r in range(B):
            emit(r, [first[r]])
        t_first = time.perf_counter()

        ks = [cfg.spec_k] * B
        windows = [deque(maxlen=SPEC_ACCEPT_WINDOW) for _ in range(B)]
        plain_left = [0] * B
        bonus = 1 if cfg.spec_extra_token else 0
        while any(active):
            if target.room < 1:
                raise CacheOverflowError(f"the batch's per-row acceptance used all max_seq_len={cfg.max_seq_len} cache slots "
                                         "(rejected slots stay as holes until every row passes them); raise max_seq_len")
            want = [0 if not active[r] or plain_left[r] else
                    max(min(ks[r], cfg.max_new_tokens - len(sequences[r]) - bonus, target.room - 1), 0) for r in range(B)]
            drafts = [[] for _ in range(B)]
            q = None
            if any(want):
                drafts, q = self.draft.propose(contexts, want, self._picker(seen, B), self.pad_id, cfg.spec_confidence)
            block = [[contexts[r][-1], *drafts[r]] if active[r] else [] for r in range(B)]
            W = max(len(b) for b in block)
            tokens, mask = left_pad(block, self.pad_id, W, device)
            n_before = target.next_pos.clone()
            logits = target.feed(tokens, mask)                           # [B, W, V]
            stats.target_forwards += 1
            accepted, extra = self._verify(logits, block, drafts, q, seen)
            for r in range(B):
                if not block[r]:
                    continue
                n_draft, a = len(drafts[r]), accepted[r]
                before = len(sequences[r])
                emit(r, drafts[r][:a] + ([extra[r]] if extra[r] is not None else []))
                gained = len(sequences[r]) - before
                n_before[r] += gained  # the pending token and the accepted drafts stay cached
                stats.add_round(r, want[r], n_draft, a, gained)
                self._adapt(r, n_draft, a, want[r], ks, windows, plain_left)
            target.rollback(n_before)
        t_end = time.perf_counter()
        stats.draft_forwards = self.draft.forwards
        return SpeculativeResult(sequences, list(self.stops.reasons), t_first - t0, t_end - t_first, stats.target_forwards, stats)

    def _check_fits(self, B: int, width: int) -> None:
        """Refuse a batch of prompts (the longest `width` tokens) the cache or the model's sliding
        window cannot take exactly."""
        cfg = self.config
        if width + cfg.max_new_tokens - 1 > cfg.max_seq_len:
            raise CacheOverflowError(f"{width} prompt + {cfg.max_new_tokens} new tokens exceed max_seq_len={cfg.max_seq_len}; "
                                     "raise max_seq_len or shorten the prompt / max_new_tokens")
        window = self.target.config.sliding_window
        if self.target.config.hybrid and cfg.spec_k_max > hybrid.SLACK:
            raise ValueError(f"spec_k_max={cfg.spec_k_max}: a hybrid model's sliding-layer rings can give back at most "
                             f"{hybrid.SLACK} rejected drafts (caramba.cache.hybrid.SLACK); set spec_k_max <= {hybrid.SLACK}")
        if B > 1 and window is not None and width + cfg.max_new_tokens - 1 > window:
            # Rejected drafts leave masked holes in a row's slots, and a slot window counts them.
            raise ValueError(f"speculative decoding of a batch is not exact on a model with a sliding window "
                             f"(sliding_window={window}) once the window binds: run the prompts one at a time "
                             "(batch_size: 1) or use plain decoding")

    # ---- one round --------------------------------------------------------------------------

    def _picker(self, seen: torch.Tensor | None, B: int):
        """The draft's sampling rule for one round: the target's processors, with the tokens
        drafted so far counted as seen (repetition penalty)."""
        cfg, sampling = self.config, self.config.sampling
        running = None if seen is None else seen.clone()

        def pick(logits: torch.Tensor):
            processed = process_logits(logits, sampling, running)        # [B, V]
            if sampling.greedy:
                tok, q = processed.argmax(dim=-1), None
                conf = processed.softmax(-1).gather(-1, tok[:, None])[:, 0] if cfg.spec_confidence is not None else None
            else:
                q = processed.softmax(dim=-1)
                tok = torch.multinomial(q, 1, generator=self.rng)[:, 0]
                conf = q.gather(-1, tok[:, None])[:, 0]
            if running is not None:
                running[torch.arange(B, device=tok.device), tok] = True
            return tok, q, conf

        return pick

    def _verify(self, logits: torch.Tensor, block: list[list[int]], drafts: list[list[int]], q: torch.Tensor | None,
                seen: torch.Tensor | None) -> tuple[list[int], list[int | None]]:
        """Per row: how many drafts are accepted, and the token that follows them (a correction
        or the bonus; None when all were accepted and spec_extra_token is off)."""
        cfg, sampling = self.config, self.config.sampling
        B, W, V = logits.shape
        K = max(len(d) for d in drafts)
        device = logits.device
        # Row r's block sits in the last len(block[r]) columns; position j scores the token after
        # block[r][j], i.e. draft j + 1 (j < n) or the bonus (j = n).
        cols = torch.tensor([[W - max(len(b), 1) + min(j, max(len(b) - 1, 0)) for j in range(K + 1)] for b in block], device=device)
        p_logits = logits.gather(1, cols[:, :, None].expand(B, K + 1, V))     # [B, K + 1, V]
        D = torch.zeros(B, K, dtype=torch.long, device=device)
        for r, d in enumerate(drafts):
            D[r, : len(d)] = torch.tensor(d, dtype=torch.long)
        n = torch.tensor([len(d) for d in drafts], device=device)
        valid = torch.arange(K, device=device)[None] < n[:, None]               # [B, K]
        seen_at = None
        if seen is not None:  # context + the drafts before each position
            seen_at = seen[:, None].repeat(1, K + 1, 1)
            for r, d in enumerate(drafts):
                for j, tok in enumerate(d):
                    seen_at[r, j + 1 :, tok] = True
            seen_at = seen_at.view(B * (K + 1), V)
        processed = process_logits(p_logits.reshape(B * (K + 1), V), sampling, seen_at).view(B, K + 1, V)

        if sampling.greedy or cfg.spec_method == "greedy":
            if sampling.greedy:
                picks = processed.argmax(dim=-1)                                 # [B, K + 1]
            else:
                picks = torch.multinomial(processed.softmax(-1).view(-1, V), 1, generator=self.rng).view(B, K + 1)
            match = (D == picks[:, :K]) & valid
            accepted = match.long().cumprod(dim=1).sum(dim=1).tolist()
            extra = [int(picks[r, a]) for r, a in enumerate(accepted)]
        else:
            p = processed.softmax(dim=-1)                                         # [B, K + 1, V]
            p_d = p[:, :K].gather(-1, D[..., None])[..., 0]
            q_d = q[:, :K].gather(-1, D[..., None])[..., 0] if q is not None else torch.ones_like(p_d)
            u = torch.rand(B, K, generator=self.rng, device=device)
            match = (u * q_d < p_d) & valid                                      # accept w.p. min(1, p/q)
            a = match.long().cumprod(dim=1).sum(dim=1)                         # [B] accepted per row
            rows = torch.arange(B, device=device)
            dist = p[rows, a]                                                     # [B, V]
            if K:  # rows that rejected draft a + 1 sample the residual norm(max(0, p - q)) there
                at = a.clamp(max=K - 1)
                q_a = q[rows, at] if q is not None else F.one_hot(D[rows, at], V).to(dist.dtype)
                residual = (dist - q_a).clamp(min=0)
                use = (a < n) & (residual.sum(dim=-1) > 0)
                dist = torch.where(use[:, None], residual, dist)
            extra = torch.multinomial(dist, 1, generator=self.rng)[:, 0].tolist()
            accepted = a.tolist()
        for r, a in enumerate(accepted):
            if a == len(drafts[r]) and a > 0 and not cfg.spec_extra_token:
                extra[r] = None
        return accepted, extra

    def _adapt(self, r: int, n_draft: int, a: int, k_used: int, ks: list[int], windows, plain_left: list[int]) -> None:
        cfg = self.config
        if k_used == 0:  # a plain step (fallback, or no room / budget to draft)
            plain_left[r] = max(plain_left[r] - 1, 0)
            return
        if n_draft == 0:  # the draft had nothing to propose (prompt lookup without a match)
            return
        if cfg.spec_k_adaptive:
            ks[r] = min(ks[r] + 2, cfg.spec_k_max) if a == n_draft else max(1, ks[r] - 1)
        if cfg.spec_disable_below_accept > 0:
            windows[r].append((a, n_draft))
            if sum(x for x, _ in windows[r]) / sum(y for _, y in windows[r]) < cfg.spec_disable_below_accept:
                plain_left[r] = SPEC_PROBE_INTERVAL
                windows[r].clear()


__all__ = ["SPEC_ACCEPT_WINDOW", "SPEC_PROBE_INTERVAL", "SpeculativeConfig", "SpeculativeGenerator",
           "SpeculativeResult", "SpeculativeStats"]
