"""Beam search with HF transformers' scoring, candidate count, length normalisation and stopping.

Per prompt, `num_beams` running beams are kept. Each step scores every (beam, token) pair by the
beam's summed log-probability plus the token's (after the logits processors), keeps the best
K = max(2, 1 + n_eos) * num_beams candidates, and
- moves candidates that end (EOS, or the last allowed token) into the finished set when they rank
  among the top num_beams, scored sum / new_len ** length_penalty;
- continues with the best num_beams candidates that did not end: the cache rows are gathered by
  source beam (`KVCache.reorder`), so a beam's past follows it.
Search stops as HF's does: early_stopping=True once num_beams hypotheses are finished; False once
the best running beam, scored at its current length, cannot beat the worst finished one; "never"
scores it at the best reachable length instead (max_new_tokens when length_penalty > 0).

The search is deterministic (HF's beam search with do_sample=False): the sampling warpers
(temperature, top-k, top-p, min-p) do not apply; repetition, frequency/presence, no-repeat-ngram
and min-new-tokens processors do, on the log-probabilities, as HF applies them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from caramba.infer.config import GenerateConfig
from caramba.infer.padding import as_rows, left_pad
from caramba.infer.sampling import History, process_logits
from caramba.infer.state import DecodeState
from caramba.infer.stops import StopChecker, pad_id_for

NEG = -1.0e9   # HF's "never chosen" score offset


@dataclass
class BeamResult:
    sequences: list[list[list[int]]]   # [prompt][k]: new token ids, best first (num_return_sequences each)
    scores: list[list[float]]          # [prompt][k]: sum of log-probs / new_len ** length_penalty
    finish_reasons: list[list[str]]    # [prompt][k]: "eos" | "length"
    steps: int                         # forward passes after the prefill
    elapsed_s: float


def check_deterministic(cfg: GenerateConfig, what: str) -> None:
    """Beam and contrastive search are deterministic; sampling settings would be silently ignored."""
    if cfg.temperature not in (0.0, 1.0) or cfg.top_p not in (None, 1.0) or cfg.min_p is not None:
        raise ValueError(f"{what} is deterministic: drop temperature/top_p/min_p (set temperature to 0 or 1)")
    if cfg.stop_sequences:
        raise ValueError(f"{what} stops on EOS and max_new_tokens only: drop stop_sequences")
    if cfg.decode_local_window is not None:
        raise ValueError(f"{what} does not support decode_local_window (sliding-window attention); drop it")


@torch.inference_mode()
def beam_search(model, input_ids, config: GenerateConfig | None = None, **overrides) -> BeamResult:
    """Beam search over one prompt or a batch of (ragged) prompts; keyword overrides set
    GenerateConfig fields (num_beams, length_penalty, early_stopping, num_return_sequences, ...)."""
    cfg = (config or GenerateConfig()).replace(**overrides)   # a copy: validated again
    check_deterministic(cfg, "beam search")
    if cfg.top_k is not None:
        raise ValueError("beam search does not use top_k (only contrastive search does); drop it")
    t0 = time.perf_counter()
    prompts = as_rows(input_ids)
    B, nb, N = len(prompts), cfg.num_beams, cfg.max_new_tokens
    stops = StopChecker.for_config(cfg, device=model.device)   # eos only: stop_sequences are refused above
    pad_id = pad_id_for(cfg)
    device = model.device
    params = replace(cfg.sampling, temperature=0.0)   # processors only, no warpers

    state, logits, seen, history = _prefill(model, cfg, prompts, pad_id, params)
    search = _Search(cfg, B, max(2, 1 + len(stops.eos_ids)) * nb, pad_id, device)
    batch_offset = torch.arange(B, device=device)[:, None] * nb
    steps = 0
    for step in range(N):
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        log_probs = process_logits(log_probs, params, seen, history)                         # [B * nb, V]
        keep_src = search.advance(log_probs, step, stops)
        if keep_src is None:
            break

        # Gather every per-row state by source beam, then feed each beam's new token.
        index = (keep_src + batch_offset).flatten()                                          # [B * nb]
        state.reorder(index)
        if seen is not None:
            seen = seen[index]
        history.reorder(index)
        new = search.running[:, :, step].flatten()                                           # [B * nb]
        if seen is not None:
            seen[torch.arange(B * nb, device=device), new] = True
        history.add_generated(new)
        logits = state.step(new)
        steps += 1

    sequences, scores, reasons = search.best(cfg.num_return_sequences, stops)
    return BeamResult(sequences, scores, reasons, steps, time.perf_counter() - t0)


def _prefill(model, cfg: GenerateConfig, prompts: list[list[int]], pad_id: int, params
             ) -> tuple[DecodeState, torch.Tensor, torch.Tensor | None, History]:
    """The prompts prefilled and every row copied to its num_beams beams: (the decode state, the
    next-token logits [B * nb, V], the tokens seen per beam (repetition penalty) or None, and the
    processors' history)."""
    B, nb, N = len(prompts), cfg.num_beams, cfg.max_new_tokens
    device, V = model.device, model.config.vocab_size
    ids, mask = left_pad(prompts, pad_id, device=device)
    T = ids.shape[1]
    if T + N - 1 > cfg.max_seq_len:
        raise ValueError(f"prompt ({T} tokens) + max_new_tokens={N} exceed max_seq_len={cfg.max_seq_len}")
    # The prompt runs once per prompt (in chunks, as the decode plan says), then every row is
    # copied to its num_beams beams. The final token is never fed: T + N - 1 slots.
    state = DecodeState.for_config(model, B, cfg, slots=T + N - 1)
    state.resolve(cfg.decode, T)
    logits = state.prefill(ids, mask)                                                            # [B, V]
    expand = torch.arange(B, device=device).repeat_interleave(nb)                                # [B * nb]
    state.reorder(expand)
    logits = logits[expand]
    seen = None
    if cfg.repetition_penalty != 1.0:
        seen = torch.zeros(B * nb, V, dtype=torch.bool, device=device)
        rows, cols = mask[expand].nonzero(as_tuple=True)
        seen[rows, ids[expand][rows, cols]] = True
    history = History(B * nb, V, params, device)
    history.add_context(ids[expand], mask[expand])
    return state, logits, seen, history


class _Search:
    """The hypotheses of B prompts: nb running beams each (tokens [B, nb, N] and summed
    log-probabilities), nb finished ones (tokens, normalised scores, lengths, whether the slot
    holds one) and whether a running beam can still beat the finished ones."""

    def __init__(self, cfg: GenerateConfig, B: int, K: int, pad_id: int, device: torch.device) -> None:
        nb, N = cfg.num_beams, cfg.max_new_tokens
        self.cfg, self.B, self.nb, self.N, self.K = cfg, B, nb, N, K   # K: candidates kept per prompt
        self.top_nb = torch.arange(K, device=device) < nb         # [K] only these may become finished
        self.running = torch.full((B, nb, N), pad_id, dtype=torch.long, device=device)
        self.running_scores = torch.zeros(B, nb, device=device)
        self.running_scores[:, 1:] = NEG                           # beams start identical: expand only the first
        self.done = torch.full((B, nb, N), pad_id, dtype=torch.long, device=device)
        self.done_scores = torch.full((B, nb), NEG, device=device)
        self.done_len = torch.zeros(B, nb, dtype=torch.long, device=device)
        self.is_done = torch.zeros(B, nb, dtype=torch.bool, device=device)
        self.improvable = torch.ones(B, 1, dtype=torch.bool, device=device)

    def advance(self, log_probs: torch.Tensor, step: int, stops: StopChecker) -> torch.Tensor | None:
        """Extend the beams by one token from the processed log-probabilities [B * nb, V]: the
        source beam of each new running beam [B, nb], or None when the search is over."""
        B, nb, N, K = self.B, self.nb, self.N, self.K
        V = log_probs.shape[-1]
        totals = (log_probs.view(B, nb, V) + self.running_scores[:, :, None]).view(B, nb * V)
        cand_scores, flat = torch.topk(totals, K)                                            # [B, K]
        src_beam, cand_tok = flat // V, flat % V
        cand = torch.take_along_dim(self.running, src_beam[:, :, None], dim=1)               # [B, K, N]
        cand[:, :, step] = cand_tok
        ends = stops.is_eos(cand_tok)
        if step == N - 1:
            ends = torch.ones_like(ends)

        # Continue with the best num_beams candidates that did not end.
        live_scores = cand_scores + ends.to(torch.float32) * NEG
        keep = torch.topk(live_scores, nb)[1]                                                # [B, nb]
        self.running = torch.take_along_dim(cand, keep[:, :, None], dim=1)
        self.running_scores = torch.take_along_dim(live_scores, keep, dim=1)
        keep_src = torch.take_along_dim(src_beam, keep, dim=1)

        self._finish(cand, cand_scores, ends & self.top_nb[None, :], step)
        if not self._open(ends, step):
            return None
        return keep_src

    def _finish(self, cand: torch.Tensor, cand_scores: torch.Tensor, just_done: torch.Tensor, step: int) -> None:
        """Finished candidates among the top num_beams replace worse finished hypotheses."""
        cfg, nb = self.cfg, self.nb
        final = cand_scores / ((step + 1) ** cfg.length_penalty)
        full = torch.all(self.is_done, dim=-1, keepdim=True) & (cfg.early_stopping is True)
        final += full.to(torch.float32) * NEG
        final += (~self.improvable).to(torch.float32) * NEG
        final += (~just_done) * NEG
        merged = torch.cat((self.done_scores, final), dim=1)
        best = torch.topk(merged, nb)[1]
        self.done = torch.take_along_dim(torch.cat((self.done, cand), dim=1), best[:, :, None], dim=1)
        self.done_scores = torch.take_along_dim(merged, best, dim=1)
        cand_len = torch.full_like(just_done, step + 1, dtype=torch.long)
        self.done_len = torch.take_along_dim(torch.cat((self.done_len, cand_len), dim=1), best, dim=1)
        self.is_done = torch.take_along_dim(torch.cat((self.is_done, just_done), dim=1), best, dim=1)

    def _open(self, ends: torch.Tensor, step: int) -> bool:
        """Whether the search goes on: a running beam can still beat the worst finished hypothesis."""
        cfg = self.cfg
        best_len = self.N if (cfg.early_stopping == "never" and cfg.length_penalty > 0.0) else step + 1
        best_running = self.running_scores[:, :1] / (best_len ** cfg.length_penalty)
        worst_done = torch.where(self.is_done, torch.min(self.done_scores, dim=1, keepdim=True)[0], NEG)
        self.improvable = self.improvable & torch.any(best_running > worst_done, dim=-1, keepdim=True)
        open_beams = not (bool(torch.all(self.is_done)) and cfg.early_stopping is True)
        return bool(torch.any(self.improvable)) and open_beams and not bool(torch.all(ends))

    def best(self, R: int, stops: StopChecker) -> tuple[list[list[list[int]]], list[list[float]], list[list[str]]]:
        """The R best finished hypotheses per prompt: tokens, scores and finish reasons."""
        sequences, scores, reasons = [], [], []
        for b in range(self.B):
            seqs = [self.done[b, k, : int(self.done_len[b, k])].tolist() for k in range(R)]
            sequences.append(seqs)
            scores.append([float(self.done_scores[b, k]) for k in range(R)])
            reasons.append(["eos" if s and s[-1] in stops.eos_set else "length" for s in seqs])
        return sequences, scores, reasons


__all__ = ["BeamResult", "beam_search", "check_deterministic"]
