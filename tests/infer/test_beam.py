"""Beam search against HF transformers' beam search on tiny random models (same weights)."""

from __future__ import annotations

import pytest
import torch

from caramba.infer import GenerateConfig
from caramba.infer.beam import beam_search
import tolerance as tol
from conftest import caramba_from_hf, hf_model, make_model

N = 10
HIT_EOS: list[bool] = []


@pytest.fixture(scope="module")
def pair():
    hf = hf_model()
    return hf, caramba_from_hf(hf)


def _prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 97, (1, n), generator=torch.Generator().manual_seed(seed))


def _hf_beams(hf, ids, eos, mask=None, **kw):
    eos_list = [eos] if isinstance(eos, int) else eos
    out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=N, eos_token_id=eos, pad_token_id=eos_list[0],
                      return_dict_in_generate=True, output_scores=True, **kw)
    seqs = []
    for s in out.sequences[:, ids.shape[1]:].tolist():
        ends = [i for i, t in enumerate(s) if t in eos_list]
        seqs.append(s[: ends[0] + 1] if ends else s)
    return seqs, out.sequences_scores.tolist()


def score_bound(scores: list[float], model) -> float:
    """Beam scores computed two ways (HF's forwards or a padded batch against ours): each sums N
    log-probs of a forward whose sums ran in another order."""
    return tol.rounding(torch.float32, max(abs(s) for s in scores), tol.forward_n(model.config) * N)["atol"]


def _eos_on_the_way(ours, ids, at: int) -> int:
    """A token the best beam emits at step `at` without an EOS: an EOS id beams will really meet."""
    free = beam_search(ours, ids, max_new_tokens=N, num_beams=3, temperature=0, eos_token_id=[])
    return free.sequences[0][0][at]


SETTINGS = [
    dict(num_beams=2),
    dict(num_beams=3, early_stopping=True),
    dict(num_beams=4, length_penalty=0.5, num_return_sequences=3),
    dict(num_beams=3, early_stopping="never", length_penalty=2.0, num_return_sequences=2),
    dict(num_beams=3, early_stopping="never", length_penalty=-1.0),
    dict(num_beams=4, length_penalty=0.0, num_return_sequences=4, no_repeat_ngram_size=2),
    dict(num_beams=3, repetition_penalty=1.3, min_new_tokens=4),
]


@pytest.mark.parametrize("kw", SETTINGS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
@pytest.mark.parametrize("seed", [1, 2])
def test_beam_search_equals_hf(pair, kw, seed):
    hf, ours = pair
    ids = _prompt(5 + seed, seed)
    eos = _eos_on_the_way(ours, ids, at=2)
    want_seqs, want_scores = _hf_beams(hf, ids, eos, **kw)
    got = beam_search(ours, ids, max_new_tokens=N, eos_token_id=eos, temperature=0, **kw)
    assert got.sequences[0] == want_seqs
    assert got.scores[0] == pytest.approx(want_scores, abs=score_bound(want_scores, ours))
    HIT_EOS.append(any(s[-1] == eos for s in got.sequences[0]))


def test_beam_search_two_eos_ids_keeps_more_candidates(pair):
    hf, ours = pair
    ids = _prompt(7, 3)
    eos = [_eos_on_the_way(ours, ids, at=1), _eos_on_the_way(ours, ids, at=3)]
    want_seqs, want_scores = _hf_beams(hf, ids, eos, num_beams=3, num_return_sequences=3)
    got = beam_search(ours, ids, max_new_tokens=N, eos_token_id=eos, temperature=0, num_beams=3, num_return_sequences=3)
    assert got.sequences[0] == want_seqs
    assert got.scores[0] == pytest.approx(want_scores, abs=score_bound(want_scores, ours))


def test_ragged_batch_equals_prompts_alone(pair):
    """Left padding must not change any prompt's beams (each prompt alone is the HF-checked case)."""
    _, ours = pair
    prompts = [_prompt(n, n)[0].tolist() for n in (3, 8, 5)]
    eos = _eos_on_the_way(ours, torch.tensor([prompts[1]]), at=2)
    kw = dict(max_new_tokens=N, eos_token_id=eos, temperature=0, num_beams=3, num_return_sequences=2)
    batch = beam_search(ours, prompts, **kw)
    for i, p in enumerate(prompts):
        alone = beam_search(ours, [p], **kw)
        assert batch.sequences[i] == alone.sequences[0]
        assert batch.scores[i] == pytest.approx(alone.scores[0], abs=score_bound(alone.scores[0], ours))


@pytest.mark.parametrize("kind,extra", [("fp16", {}), ("bf16", {}), ("q8_0", {}), ("q4_0", {}), ("nf4", {}),
                                        ("k=q8_0,v=q4_0", {}), ("q4_0", {"residual_len": 4}),
                                        ("q8_0", {"rotate_keys": True, "cache_fp16_prefix_layers": 1})])
def test_every_cache_kind_reorders(kind, extra):
    """Beam search on a cache kind equals a run that recomputes every beam from scratch on the
    same kind: a reorder that mixed up rows would change the beams' logits."""
    model = make_model()
    ids = _prompt(6, 4)
    kw = dict(max_new_tokens=8, eos_token_id=[], temperature=0, num_beams=3, num_return_sequences=3, **extra)
    if "=" in kind:
        kw["cache_policy"] = kind
    else:
        kw["cache_kind"] = kind
    got = beam_search(model, ids, **kw)
    # Rescore each returned beam alone on a fresh cache of the same kind, fed as beam search feeds
    # it (the prompt in one forward, then one token at a time): only the reorders differ.
    cfg = GenerateConfig(**{k: v for k, v in kw.items() if k in ("cache_kind", "cache_policy", *extra)})
    T = ids.shape[1]
    for seq, score in zip(got.sequences[0], got.scores[0]):
        cache = model.new_cache(1, T + len(seq), cfg.cache_spec())
        with torch.inference_mode():
            logits = [model(ids, None, cache, last_only=True)[:, -1]]
            for tok in seq[:-1]:
                logits.append(model(torch.tensor([[tok]]), None, cache)[:, -1])
        logp = torch.log_softmax(torch.stack(logits, dim=1).float(), dim=-1)
        total = logp[0, torch.arange(len(seq)), torch.tensor(seq)].sum() / len(seq)
        assert float(total) == pytest.approx(score, abs=1e-4)


def test_beam_rejects_sampling_settings(model):
    with pytest.raises(ValueError, match="deterministic"):
        beam_search(model, [1, 2, 3], num_beams=2, temperature=0.7)
    with pytest.raises(ValueError, match="top_k"):
        beam_search(model, [1, 2, 3], num_beams=2, top_k=5)
    with pytest.raises(ValueError, match="num_return_sequences"):
        GenerateConfig(num_beams=2, num_return_sequences=3)


def test_some_settings_returned_eos_hypotheses():
    """Guards the HF comparisons above: EOS-finished beams must be among what they compared."""
    if not HIT_EOS:
        pytest.skip("runs after test_beam_search_equals_hf")
    assert sum(HIT_EOS) >= 3, HIT_EOS
