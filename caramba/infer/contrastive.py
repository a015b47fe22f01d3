"""Contrastive search (Su et al. 2022), as HF transformers implemented it before moving it out.

Each step takes the top_k tokens v of the processed distribution p, runs each as a candidate
next token, and picks

    argmax_v  (1 - alpha) * p(v)  -  alpha * max_j cos(h_v, h_j)

where h_v is the candidate's last hidden state (after the final norm) and h_j are those of every
real token already in the row's context. The chosen candidate's forward already holds the next
logits and its K/V, so a step is one forward of B * top_k single tokens.

The hidden states are read with a forward hook on the model's final norm, so the model's own
forward runs unchanged (no copy of it here).
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from caramba.infer.beam import check_deterministic
from caramba.infer.padding import as_rows, left_pad
from caramba.infer.generate import GenerateConfig, GenerationResult
from caramba.infer.sampling import History, process_logits
from caramba.infer.state import DecodeState
from caramba.infer.stops import StopChecker, pad_id_for
from caramba.model.backend import TorchStep


def _with_hidden(model, forward) -> tuple[torch.Tensor, torch.Tensor]:
    """Run forward() -> (its logits, the final norm's output [B, T, D] during it)."""
    captured = []
    handle = model.norm.register_forward_hook(lambda _m, _i, out: captured.append(out))
    try:
        logits = forward()
    finally:
        handle.remove()
    return logits, captured[-1]


@torch.inference_mode()
def contrastive_search(model, input_ids, config: GenerateConfig | None = None, **overrides) -> GenerationResult:
    """Contrastive search over one prompt or a batch of (ragged) prompts; needs penalty_alpha and
    top_k (keyword overrides set GenerateConfig fields)."""
    cfg = (config or GenerateConfig()).replace(**overrides)   # a copy: validated again
    check_deterministic(cfg, "contrastive search")
    if cfg.penalty_alpha is None or cfg.top_k is None:
        raise ValueError("contrastive search needs penalty_alpha (in [0, 1]) and top_k (>= 1); set both")
    if cfg.num_beams != 1:
        raise ValueError("contrastive search keeps one sequence per prompt: set num_beams to 1")
    t0 = time.perf_counter()
    prompts = as_rows(input_ids)
    B, k, N, alpha = len(prompts), cfg.top_k, cfg.max_new_tokens, cfg.penalty_alpha
    stops = StopChecker.for_config(cfg, device=model.device)   # eos only: stop_sequences are refused above
    device, V = model.device, model.config.vocab_size
    params = replace(cfg.sampling, temperature=0.0)   # processors only, no warpers

    ids, mask = left_pad(prompts, pad_id_for(cfg), device=device)
    T = ids.shape[1]
    # Every step feeds its candidates, the last one too (its hidden states score it): T + N slots.
    if T + N > cfg.max_seq_len:
        raise ValueError(f"prompt ({T} tokens) + max_new_tokens={N} exceed max_seq_len={cfg.max_seq_len}")
    # The torch path, chosen: the final norm's output (the hidden states it scores) comes through a
    # forward hook, and the fused C step runs no module's forward.
    state = DecodeState.for_config(model, B, cfg, slots=T + N, backend=TorchStep(model))
    logits, hidden = _with_hidden(model, lambda: state.feed(ids, mask))   # every position's hidden state
    logits = logits[:, -1]                                                  # [B, V]
    context = hidden.float()                                                # [B, S, D] every fed position
    context_mask = mask.clone()                                             # [B, S] which are real tokens
    seen = None
    if cfg.repetition_penalty != 1.0:
        seen = torch.zeros(B, V, dtype=torch.bool, device=device)
        rows, cols = mask.nonzero(as_tuple=True)
        seen[rows, ids[rows, cols]] = True
    history = History(B, V, params, device)
    history.add_context(ids, mask)
    t_first = None

    sequences: list[list[int]] = [[] for _ in range(B)]
    stops.start(B)
    active = torch.ones(B, dtype=torch.bool, device=device)
    expand = torch.arange(B, device=device).repeat_interleave(k)            # [B * k]
    rows = torch.arange(B, device=device)
    steps = 0
    for _ in range(N):
        probs = process_logits(logits, params, seen, history).softmax(dim=-1)
        top_p, top_ids = torch.topk(probs, k, dim=-1)                       # [B, k]
        state.reorder(expand)                                               # every row, k times
        cand_logits, cand_hidden = _with_hidden(model, lambda: state.step(top_ids.reshape(-1)))
        h = cand_hidden[:, -1].float().view(B, k, -1)                        # [B, k, D]
        ctx = context / context.norm(dim=-1, keepdim=True)
        cos = torch.einsum("bsd,bkd->bks", ctx, h / h.norm(dim=-1, keepdim=True))   # [B, k, S]
        cos = cos.masked_fill(~context_mask[:, None, :], -1.0)
        score = (1.0 - alpha) * top_p - alpha * cos.max(dim=-1).values      # [B, k]
        pick = score.argmax(dim=-1)                                         # [B]
        new = top_ids[rows, pick]
        chosen = rows * k + pick                                            # [B] rows of the candidate batch
        state.reorder(chosen)
        logits = cand_logits[chosen]
        context = torch.cat([context, h[rows, pick][:, None]], dim=1)
        context_mask = torch.cat([context_mask, active[:, None]], dim=1)

        for row in active.nonzero().flatten().tolist():
            sequences[row].append(int(new[row]))
        active = stops.update(new, active)
        if seen is not None:
            seen[rows, new] = True
        history.add_generated(new)
        if t_first is None:
            t_first = time.perf_counter()   # prompt + first token, as the Generator times it
        else:
            steps += 1
        if not bool(active.any()):
            break
    t_end = time.perf_counter()
    return GenerationResult(sequences, stops.reasons, t_first - t0, t_end - t_first, steps)


__all__ = ["contrastive_search"]
