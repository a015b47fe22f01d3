"""Logits processors and token selection, matching HF transformers' processors of the same name.

Every function takes and returns logits [B, V]; `process_logits` applies them in HF's order
(repetition penalty, frequency/presence penalties, no-repeat n-gram, min new tokens, then the
sampling warpers temperature, top-k, top-p, min-p), so speculative decoding can apply the exact
same transform to the target's and the draft's logits.

The processors that read more than a seen-token mask (n-grams, token counts, how many tokens
this turn produced) take a `History`; without one they are skipped, which keeps
`process_logits(logits, params, seen)` working for callers that track only `seen`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from caramba.options import check_options, option


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen from the logits (the processors below, in HF's order).
    Adding a processor: its option here and its function below (manifest keys and `caramba
    generate --set generate.NAME=...` follow from the option)."""

    temperature: float = option(1.0, ge=0, help="0 = greedy")
    top_k: int | None = option(None, ge=1, help="keep the k most likely tokens")
    top_p: float | None = option(None, gt=0, le=1, help="keep the smallest set reaching this mass")
    repetition_penalty: float = option(1.0, gt=0, help="CTRL-style; 1 = off")
    min_p: float | None = option(None, ge=0, le=1, help="drop tokens below min_p x the top token's probability")
    min_new_tokens: int = option(0, ge=0, help="no EOS before this many new tokens")
    no_repeat_ngram_size: int = option(0, ge=0, help="never repeat an n-gram of this size; 0 = off")
    frequency_penalty: float = option(0.0, help="OpenAI-style: minus this x the token's count so far")
    presence_penalty: float = option(0.0, help="OpenAI-style: minus this once a token was generated")
    eos_token_ids: tuple[int, ...] = ()   # what min_new_tokens suppresses (GenerateConfig sets it)

    def __post_init__(self) -> None:
        check_options(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_history(self) -> bool:
        """Whether a processor reads more than the seen-token mask (a History)."""
        return bool(self.min_new_tokens or self.no_repeat_ngram_size or self.frequency_penalty or self.presence_penalty)


def repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style: a seen token's logit is divided by `penalty` if positive, multiplied if negative.

    seen [B, V] bool marks the tokens already in each row's context (prompt and output).
    """
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalised, logits)


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    k = min(k, logits.shape[-1])
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability mass reaches p (at least one)."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= (1 - p)
    remove[..., -1:] = False
    return logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))


def min_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Drop tokens whose probability is below p times the top token's (HF MinPLogitsWarper)."""
    probs = logits.softmax(dim=-1)
    remove = probs < p * probs.amax(dim=-1, keepdim=True)
    remove.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)   # the top token always stays
    return logits.masked_fill(remove, float("-inf"))


def frequency_presence_penalty(logits: torch.Tensor, counts: torch.Tensor, frequency: float, presence: float) -> torch.Tensor:
    """OpenAI-style: logit[v] -= frequency * c[v] + presence * (c[v] > 0), where counts c [B, V]
    is how often v was generated so far (output tokens only, as OpenAI and vLLM count)."""
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def no_repeat_ngram(logits: torch.Tensor, ids: list[list[int]], n: int) -> torch.Tensor:
    """Ban every token that would complete an n-gram already in the row's context (HF
    NoRepeatNGramLogitsProcessor; ids [B][L] are each row's real tokens, prompt included)."""
    banned = torch.zeros(logits.shape, dtype=torch.bool)
    for row, seq in enumerate(ids):
        if len(seq) < n:
            continue
        prefix = seq[len(seq) - n + 1:]
        for i in range(len(seq) - n + 1):
            if seq[i : i + n - 1] == prefix:
                banned[row, seq[i + n - 1]] = True
    return logits.masked_fill(banned.to(logits.device), float("-inf"))


def min_new_tokens(logits: torch.Tensor, n_new: int, minimum: int, eos: tuple[int, ...]) -> torch.Tensor:
    """Forbid end-of-sequence until `minimum` tokens were generated (HF MinNewTokensLengthLogitsProcessor)."""
    if n_new >= minimum or not eos:
        return logits
    logits = logits.clone()
    logits[:, list(eos)] = float("-inf")
    return logits


class History:
    """Per row, what the context-dependent processors read: the real tokens so far (prompt and
    output, for no_repeat_ngram_size), how often each token was generated (frequency and
    presence penalties), and how many tokens this turn has generated (min_new_tokens)."""

    def __init__(self, batch: int, vocab_size: int, params: SamplingParams, device: torch.device | str = "cpu") -> None:
        self.ids: list[list[int]] | None = [[] for _ in range(batch)] if params.no_repeat_ngram_size else None
        wants_counts = params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
        self.counts = torch.zeros(batch, vocab_size, device=device) if wants_counts else None   # [B, V]
        self.n_new = 0

    def add_context(self, tokens: torch.Tensor, mask: torch.Tensor) -> None:
        """Prompt tokens [B, T] (mask: which are real): context for n-grams, not counted as output."""
        if self.ids is not None:
            for row, (t, m) in enumerate(zip(tokens.tolist(), mask.tolist())):
                self.ids[row].extend(tok for tok, real in zip(t, m) if real)

    def add_generated(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """One generated token per row, tokens [B] (mask [B]: rows that really produced one)."""
        mask = torch.ones_like(tokens, dtype=torch.bool) if mask is None else mask
        self.n_new += 1
        if self.ids is not None:
            for row, (tok, real) in enumerate(zip(tokens.tolist(), mask.tolist())):
                if real:
                    self.ids[row].append(tok)
        if self.counts is not None:
            rows = mask.nonzero().flatten()
            self.counts[rows, tokens[rows]] += 1

    def reorder(self, index: torch.Tensor) -> None:
        """Gather rows (beam search)."""
        if self.ids is not None:
            self.ids = [list(self.ids[i]) for i in index.tolist()]
        if self.counts is not None:
            self.counts = self.counts.index_select(0, index.to(self.counts.device))


def process_logits(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None,
                   history: History | None = None) -> torch.Tensor:
    logits = logits.float()
    if params.repetition_penalty != 1.0 and seen is not None:
        logits = repetition_penalty(logits, seen, params.repetition_penalty)
    if history is not None:
        if history.counts is not None:
            logits = frequency_presence_penalty(logits, history.counts, params.frequency_penalty, params.presence_penalty)
        if params.no_repeat_ngram_size and history.ids is not None:
            logits = no_repeat_ngram(logits, history.ids, params.no_repeat_ngram_size)
        if params.min_new_tokens:
            logits = min_new_tokens(logits, history.n_new, params.min_new_tokens, params.eos_token_ids)
    if params.greedy:
        return logits
    if params.temperature != 1.0:
        logits = logits / params.temperature
    if params.top_k is not None:
        logits = top_k_filter(logits, params.top_k)
    if params.top_p is not None and params.top_p < 1.0:
        logits = top_p_filter(logits, params.top_p)
    if params.min_p is not None:
        logits = min_p_filter(logits, params.min_p)
    return logits


def select_tokens(logits: torch.Tensor, params: SamplingParams, rng: torch.Generator | None = None) -> torch.Tensor:
    """Processed logits [B, V] -> token ids [B]: argmax when greedy, else a draw from softmax."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=rng).squeeze(-1)
