"""The added logits processors against HF transformers' processors of the same name, and wired
through the Generator (greedy output equal to HF generate with the same settings)."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from caramba.infer import GenerateConfig, Generator, SamplingParams, process_logits
from caramba.infer.sampling import History, frequency_presence_penalty, min_new_tokens, min_p_filter, no_repeat_ngram
import tolerance as tol
from conftest import caramba_from_hf, hf_model

V = 97


def _logits(B: int = 4, seed: int = 0) -> torch.Tensor:
    return 3 * torch.randn(B, V, generator=torch.Generator().manual_seed(seed))


def _ids(B: int, L: int, high: int, seed: int = 0) -> torch.Tensor:
    """Ids from a small range, so n-grams repeat."""
    return torch.randint(0, high, (B, L), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("p", [0.0, 0.05, 0.3, 0.9, 1.0])
def test_min_p_equals_hf(p):
    logits = _logits()
    assert torch.equal(min_p_filter(logits, p), MinPLogitsWarper(p)(None, logits))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("L", [1, 3, 12, 30])
def test_no_repeat_ngram_equals_hf(n, L):
    ids = _ids(3, L, high=5, seed=n * 100 + L)
    logits = _logits(3)
    assert torch.equal(no_repeat_ngram(logits, ids.tolist(), n), NoRepeatNGramLogitsProcessor(n)(ids, logits))


@pytest.mark.parametrize("generated", [0, 2, 3, 5])
def test_min_new_tokens_equals_hf(generated):
    prompt_len, eos = 4, [7, 11]
    ids = _ids(2, prompt_len + generated, high=V)
    logits = _logits(2)
    want = MinNewTokensLengthLogitsProcessor(prompt_len, 3, eos)(ids, logits)
    assert torch.equal(min_new_tokens(logits, generated, 3, tuple(eos)), want)


def test_frequency_presence_formula():
    logits = _logits(2)
    counts = torch.zeros(2, V)
    counts[0, 5], counts[0, 9], counts[1, 5] = 3, 1, 2
    out = frequency_presence_penalty(logits, counts, 0.5, 0.25)
    want = logits.clone()
    want[0, 5] -= 0.5 * 3 + 0.25
    want[0, 9] -= 0.5 * 1 + 0.25
    want[1, 5] -= 0.5 * 2 + 0.25
    torch.testing.assert_close(out, want, **tol.elementwise(logits, ops=2))   # x - a - b vs x - (a + b)


def test_history_counts_only_generated_tokens():
    params = SamplingParams(frequency_penalty=1.0, no_repeat_ngram_size=2)
    h = History(2, V, params)
    h.add_context(torch.tensor([[0, 3, 4], [5, 5, 6]]), torch.tensor([[False, True, True], [True, True, True]]))
    h.add_generated(torch.tensor([4, 8]), torch.tensor([True, False]))
    assert h.ids == [[3, 4, 4], [5, 5, 6]]
    assert h.counts[0, 4] == 1 and h.counts.sum() == 1 and h.n_new == 1
    h.reorder(torch.tensor([1, 1]))
    assert h.ids == [[5, 5, 6], [5, 5, 6]] and h.counts.sum() == 0


def test_process_logits_chain_equals_hf_order():
    """Every processor at once, in HF's order, against an HF LogitsProcessorList."""
    ids = _ids(3, 14, high=6, seed=3)
    logits = _logits(3, seed=3)
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.3, min_p=0.05,
                            min_new_tokens=5, no_repeat_ngram_size=2, eos_token_ids=(2,))
    seen = torch.zeros(3, V, dtype=torch.bool)
    seen.scatter_(1, ids, True)
    hist = History(3, V, params)
    hist.add_context(ids, torch.ones_like(ids, dtype=torch.bool))
    hist.n_new = 2
    hf = LogitsProcessorList([
        RepetitionPenaltyLogitsProcessor(1.3), NoRepeatNGramLogitsProcessor(2),
        MinNewTokensLengthLogitsProcessor(12, 5, [2]), TemperatureLogitsWarper(0.7), TopKLogitsWarper(20),
        TopPLogitsWarper(0.9), MinPLogitsWarper(0.05),
    ])
    # elementwise only (penalty, temperature, filters): a few roundings of values up to |logits| / 0.7
    torch.testing.assert_close(process_logits(logits, params, seen, hist), hf(ids, logits.clone()),
                               **tol.elementwise(logits / 0.7, ops=3))


def test_process_logits_without_history_is_the_old_call():
    logits = _logits()
    params = SamplingParams(temperature=0.5, top_k=10, no_repeat_ngram_size=2, min_new_tokens=3, eos_token_ids=(1,))
    old = SamplingParams(temperature=0.5, top_k=10)
    assert torch.equal(process_logits(logits, params), process_logits(logits, old))


@pytest.fixture(scope="module")
def pair():
    hf = hf_model()
    return hf, caramba_from_hf(hf)


@pytest.mark.parametrize("kw", [dict(no_repeat_ngram_size=2), dict(no_repeat_ngram_size=1), dict(min_new_tokens=6),
                                dict(repetition_penalty=1.2, no_repeat_ngram_size=3, min_new_tokens=4)])
def test_generator_greedy_with_processors_equals_hf(pair, kw):
    hf, ours = pair
    prompt = _ids(1, 7, high=V, seed=5)
    plain = Generator(ours, GenerateConfig(max_new_tokens=12, temperature=0, eos_token_id=[])).run(prompt).sequences[0]
    eos = plain[2]   # so min_new_tokens has an EOS to hold back
    want = hf.generate(prompt, do_sample=False, max_new_tokens=12, eos_token_id=eos, pad_token_id=eos, **kw)[0, 7:].tolist()
    if eos in want:
        want = want[: want.index(eos) + 1]
    got = Generator(ours, GenerateConfig(max_new_tokens=12, temperature=0, eos_token_id=eos, **kw)).run(prompt).sequences[0]
    assert got == want


def test_generator_frequency_penalty_equals_manual_loop(pair):
    _, ours = pair
    prompt = _ids(1, 5, high=V, seed=6)[0].tolist()
    cfg = GenerateConfig(max_new_tokens=10, temperature=0, eos_token_id=[], frequency_penalty=0.8, presence_penalty=0.4)
    got = Generator(ours, cfg).run([prompt]).sequences[0]
    seq, counts, want = list(prompt), torch.zeros(V), []
    for _ in range(10):
        logits = ours(torch.tensor([seq]))[0, -1] - 0.8 * counts - 0.4 * (counts > 0).float()
        tok = int(logits.argmax())
        counts[tok] += 1
        seq.append(tok)
        want.append(tok)
    assert got == want
    plain = Generator(ours, GenerateConfig(max_new_tokens=10, temperature=0, eos_token_id=[])).run([prompt]).sequences[0]
    assert got != plain


def test_generator_multi_turn_keeps_ngram_context(pair):
    _, ours = pair
    cfg = GenerateConfig(max_new_tokens=4, temperature=0, eos_token_id=[], no_repeat_ngram_size=2)
    gen = Generator(ours, cfg)
    first = gen.run([[5, 6, 7]]).sequences[0]
    second = gen.run([[8, 9]]).sequences[0]
    # The whole conversation (both turns, pending token included once) holds no repeated bigram.
    convo = [5, 6, 7] + first + [8, 9] + second
    bigrams = list(zip(convo, convo[1:]))
    assert len(bigrams) == len(set(bigrams))
    assert gen.history.ids[0] == convo   # the pending token went in once
    assert gen.history.n_new == len(second)


def test_generator_refuses_search_settings(pair):
    with pytest.raises(ValueError, match="beam_search"):
        Generator(pair[1], GenerateConfig(num_beams=2))
    with pytest.raises(ValueError, match="contrastive_search"):
        Generator(pair[1], GenerateConfig(penalty_alpha=0.5, top_k=3))
