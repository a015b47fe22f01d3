"""Logits processors against transformers' own, token selection, and the sampling distribution."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from caramba.infer.sampling import (
    SamplingParams,
    process_logits,
    repetition_penalty,
    select_tokens,
    top_k_filter,
    top_p_filter,
)

import tolerance as tol

B, V = 4, 50


def rand_logits(seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return scale * torch.randn(B, V, generator=torch.Generator().manual_seed(seed))


def rand_context(seed: int = 0, T: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """HF takes the context as input_ids [B, T]; caramba as a seen mask [B, V]."""
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed + 100))
    seen = torch.zeros(B, V, dtype=torch.bool).scatter_(1, ids, True)
    return ids, seen


def assert_same_filter(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    finite = ~torch.isinf(theirs)
    torch.testing.assert_close(ours[finite], theirs[finite], **tol.elementwise(theirs[finite], ops=3))   # penalty, temperature: no sums


@pytest.mark.parametrize("penalty", [1.3, 0.7, 2.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_repetition_penalty_matches_hf(penalty, seed):
    logits = rand_logits(seed)
    ids, seen = rand_context(seed)
    expected = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
    got = repetition_penalty(logits, seen, penalty)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert not torch.equal(got, logits)
    torch.testing.assert_close(got[~seen], logits[~seen], rtol=0, atol=0)  # unseen tokens untouched


@pytest.mark.parametrize("k", [1, 3, 10, V, V + 5])
@pytest.mark.parametrize("seed", [0, 1])
def test_top_k_matches_hf(k, seed):
    logits = rand_logits(seed)
    expected = TopKLogitsWarper(top_k=k)(None, logits.clone())
    got = top_k_filter(logits, k)
    assert_same_filter(got, expected)
    assert (~torch.isinf(got)).sum(-1).tolist() == [min(k, V)] * B


@pytest.mark.parametrize("p", [0.05, 0.3, 0.75, 0.9, 0.99])
@pytest.mark.parametrize("seed", [0, 1])
def test_top_p_matches_hf(p, seed):
    logits = rand_logits(seed)
    expected = TopPLogitsWarper(top_p=p)(None, logits.clone())
    got = top_p_filter(logits, p)
    assert_same_filter(got, expected)
    kept = (~torch.isinf(got)).sum(-1)
    assert (kept >= 1).all() and (kept < V).all()


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(top_p_filter(logits, 0.7)).tolist() == [[False, False, True, True]]
    assert torch.isinf(top_p_filter(logits, 0.85)).tolist() == [[False, False, False, True]]
    assert torch.isinf(top_p_filter(logits, 0.97)).tolist() == [[False, False, False, False]]
    assert torch.isinf(top_p_filter(logits, 0.1)).tolist() == [[False, True, True, True]]  # at least one


def test_temperature_matches_hf():
    logits = rand_logits()
    params = SamplingParams(temperature=0.7)
    expected = TemperatureLogitsWarper(0.7)(None, logits.clone())
    torch.testing.assert_close(process_logits(logits, params), expected, **tol.elementwise(expected))   # one division


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_process_logits_applies_hf_order(seed):
    """penalty -> temperature -> top-k -> top-p, exactly as HF's generate() chains them."""
    logits = rand_logits(seed)
    ids, seen = rand_context(seed)
    params = SamplingParams(temperature=0.6, top_k=12, top_p=0.8, repetition_penalty=1.4)
    expected = logits.clone()
    for proc in (RepetitionPenaltyLogitsProcessor(1.4), TemperatureLogitsWarper(0.6), TopKLogitsWarper(12), TopPLogitsWarper(0.8)):
        expected = proc(ids, expected)
    assert_same_filter(process_logits(logits, params, seen), expected)


def test_process_logits_greedy_skips_warpers_but_keeps_the_penalty():
    logits = rand_logits()
    ids, seen = rand_context()
    greedy = SamplingParams(temperature=0.0, top_k=2, top_p=0.1, repetition_penalty=1.5)
    got = process_logits(logits, greedy, seen)
    torch.testing.assert_close(got, repetition_penalty(logits, seen, 1.5), rtol=0, atol=0)   # the same op: exact
    assert not torch.isinf(got).any()
    assert process_logits(logits.half(), SamplingParams()).dtype == torch.float32
    assert torch.equal(process_logits(logits, SamplingParams(top_p=1.0)), logits)


def test_greedy_select_is_argmax():
    logits = rand_logits()
    params = SamplingParams(temperature=0.0)
    assert params.greedy and not SamplingParams(temperature=0.5).greedy
    assert torch.equal(select_tokens(logits, params), logits.argmax(-1))
    assert select_tokens(logits, params).shape == (B,)


def test_sampling_respects_filters():
    logits = rand_logits()
    params = SamplingParams(temperature=1.0, top_k=3)
    rng = torch.Generator().manual_seed(0)
    allowed = logits.topk(3, dim=-1).indices
    for _ in range(50):
        tok = select_tokens(process_logits(logits, params), params, rng)
        assert (allowed == tok[:, None]).any(-1).all()


def test_sampling_draws_match_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    n = 20000
    logits = probs.log().expand(n, -1)  # n independent rows, one draw each
    params = SamplingParams(temperature=1.0)
    draws = select_tokens(process_logits(logits, params), params, torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=5).float() / n
    # 4 standard errors of a binomial proportion
    tol = 4 * (probs * (1 - probs) / n).sqrt()
    assert ((freq - probs).abs() < tol).all(), (freq, probs)


def test_temperature_sharpens_and_flattens_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    n = 20000
    logits = probs.log().expand(n, -1)
    rng = torch.Generator().manual_seed(1)
    for t in (0.5, 2.0):
        params = SamplingParams(temperature=t)
        draws = select_tokens(process_logits(logits, params), params, rng)
        expected = (probs ** (1 / t)) / (probs ** (1 / t)).sum()
        freq = torch.bincount(draws, minlength=3).float() / n
        assert ((freq - expected).abs() < 4 * (expected * (1 - expected) / n).sqrt()).all(), (t, freq, expected)


def test_seeded_draws_are_reproducible():
    logits = rand_logits()
    params = SamplingParams(temperature=1.0)
    a = select_tokens(logits, params, torch.Generator().manual_seed(7))
    b = select_tokens(logits, params, torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
    many = torch.stack([select_tokens(logits, params, torch.Generator().manual_seed(s)) for s in range(20)])
    assert len({tuple(r) for r in many.tolist()}) > 1


def test_top_p_boundary_and_tiny_p_match_hf():
    # Uniform over 4: cumulative mass 0.25, 0.5, 0.75, 1.0 is exact, so p = 0.5 sits on a boundary.
    flat = torch.zeros(1, 4)
    assert (~torch.isinf(top_p_filter(flat, 0.5))).sum() == 2
    assert_same_filter(top_p_filter(flat, 0.5), TopPLogitsWarper(top_p=0.5)(None, flat.clone()))
    # A vanishing p still keeps the top token, even where the float32 cumsum ends just below 1.
    logits = torch.randn(64, V, generator=torch.Generator().manual_seed(4))
    assert (logits.sort(-1).values.softmax(-1).cumsum(-1)[:, -1] < 1).any()  # the case the guard is for
    got = top_p_filter(logits, 1e-9)
    assert (~torch.isinf(got)).sum(-1).tolist() == [1] * logits.shape[0]
    assert torch.equal(got.argmax(-1), logits.argmax(-1))
    assert_same_filter(got, TopPLogitsWarper(top_p=1e-9)(None, logits.clone()))
