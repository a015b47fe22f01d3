"""Logits processors and token selection, matching HF transformers' processors of the same name.

Every function takes and returns logits [B, V]; `process_logits` applies them in HF's order
(repetition penalty, then temperature, top-k, top-p), so speculative decoding can apply the
exact same transform to the target's and the draft's logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0          # 0 = greedy
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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


def process_logits(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None) -> torch.Tensor:
    logits = logits.float()
    if params.repetition_penalty != 1.0 and seen is not None:
        logits = repetition_penalty(logits, seen, params.repetition_penalty)
    if params.greedy:
        return logits
    if params.temperature != 1.0:
        logits = logits / params.temperature
    if params.top_k is not None:
        logits = top_k_filter(logits, params.top_k)
    if params.top_p is not None and params.top_p < 1.0:
        logits = top_p_filter(logits, params.top_p)
    return logits


def select_tokens(logits: torch.Tensor, params: SamplingParams, rng: torch.Generator | None = None) -> torch.Tensor:
    """Processed logits [B, V] -> token ids [B]: argmax when greedy, else a draw from softmax."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=rng).squeeze(-1)
