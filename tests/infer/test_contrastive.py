"""Contrastive search against a direct, slow implementation: HF's model, no cache, every
candidate scored by a full forward over context + candidate."""

from __future__ import annotations

import pytest
import torch

from caramba.infer.contrastive import contrastive_search
from conftest import caramba_from_hf, hf_model


@pytest.fixture(scope="module")
def pair():
    hf = hf_model()
    return hf, caramba_from_hf(hf)


@torch.no_grad()
def slow_contrastive(hf, prompt: list[int], alpha: float, k: int, n: int, eos: int | None = None,
                     repetition_penalty: float = 1.0) -> list[int]:
    """score(v) = (1 - alpha) * p(v) - alpha * max_j cos(h_v, h_j), recomputed from scratch."""
    seq = list(prompt)
    out: list[int] = []
    for _ in range(n):
        res = hf(input_ids=torch.tensor([seq]), output_hidden_states=True, use_cache=False)
        logits = res.logits[0, -1].float()
        if repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq)))
            vals = logits[seen]
            logits[seen] = torch.where(vals < 0, vals * repetition_penalty, vals / repetition_penalty)
        probs = logits.softmax(-1)
        top_p, top_ids = probs.topk(k)
        context = res.hidden_states[-1][0]                        # [S, D], after the final norm
        scores = []
        for p, v in zip(top_p.tolist(), top_ids.tolist()):
            h = hf(input_ids=torch.tensor([seq + [v]]), output_hidden_states=True, use_cache=False).hidden_states[-1][0, -1]
            sim = torch.nn.functional.cosine_similarity(context, h[None], dim=-1).max()
            scores.append((1 - alpha) * p - alpha * float(sim))
        tok = top_ids[max(range(k), key=lambda i: scores[i])].item()
        seq.append(tok)
        out.append(tok)
        if tok == eos:
            break
    return out


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("alpha,k", [(0.6, 4), (0.3, 2), (0.0, 3), (1.0, 5)])
def test_contrastive_equals_slow_reference(pair, alpha, k):
    hf, ours = pair
    prompt = _prompt(6, int(alpha * 10) + k)
    want = slow_contrastive(hf, prompt, alpha, k, 8)
    got = contrastive_search(ours, [prompt], penalty_alpha=alpha, top_k=k, max_new_tokens=8, eos_token_id=[])
    assert got.sequences[0] == want
    assert got.finish_reasons == ["length"]


def test_contrastive_differs_from_greedy_and_stops_on_eos(pair):
    hf, ours = pair
    prompt = _prompt(5, 11)
    free = slow_contrastive(hf, prompt, 0.6, 4, 8)
    greedy = slow_contrastive(hf, prompt, 0.0, 1, 8)
    assert free != greedy   # the degeneration penalty changed the choice somewhere
    eos = free[3]
    got = contrastive_search(ours, [prompt], penalty_alpha=0.6, top_k=4, max_new_tokens=8, eos_token_id=eos)
    assert got.sequences[0] == free[: free.index(eos) + 1] and got.finish_reasons == ["eos"]
    want = slow_contrastive(hf, prompt, 0.6, 4, 8, repetition_penalty=1.3)
    got = contrastive_search(ours, [prompt], penalty_alpha=0.6, top_k=4, max_new_tokens=8, eos_token_id=[],
                             repetition_penalty=1.3)
    assert got.sequences[0] == want


def test_ragged_batch_equals_prompts_alone(pair):
    _, ours = pair
    prompts = [_prompt(n, n) for n in (3, 9, 6)]
    kw = dict(penalty_alpha=0.5, top_k=3, max_new_tokens=7, eos_token_id=[])
    batch = contrastive_search(ours, prompts, **kw)
    for i, p in enumerate(prompts):
        assert batch.sequences[i] == contrastive_search(ours, [p], **kw).sequences[0]


def test_contrastive_needs_both_settings(pair):
    with pytest.raises(ValueError, match="penalty_alpha"):
        contrastive_search(pair[1], [1, 2], top_k=3)
