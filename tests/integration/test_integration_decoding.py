"""Beam search and the added processors on the real SmolLM2-135M-Instruct against HF transformers."""

from __future__ import annotations

import pytest
import torch

from conftest import SMOLLM2
from test_integration_smollm2 import PROMPTS, reference  # noqa: F401  (a fixture)

pytestmark = SMOLLM2

BEAM_SETTINGS = [
    dict(num_beams=4, num_return_sequences=2),
    dict(num_beams=3, early_stopping=True, length_penalty=0.8, num_return_sequences=3),
    dict(num_beams=4, early_stopping="never", length_penalty=1.5, num_return_sequences=2),
    dict(num_beams=2, no_repeat_ngram_size=3, repetition_penalty=1.1, num_return_sequences=2),
]


@pytest.mark.parametrize("prompt,kw", list(zip(PROMPTS, BEAM_SETTINGS)))
def test_beam_search_equals_hf(smollm2, reference, prompt, kw):
    from caramba.infer import beam_search

    hf, tok = reference
    eos = tok.eos_token_id
    ids = tok.encode(prompt)
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=24, do_sample=False, eos_token_id=eos,
                          pad_token_id=eos, return_dict_in_generate=True, output_scores=True, **kw)
    want = []
    for s in out.sequences[:, len(ids):].tolist():
        want.append(s[: s.index(eos) + 1] if eos in s else s)
    got = beam_search(smollm2.model, [ids], max_new_tokens=24, temperature=0, eos_token_id=eos, **kw)
    assert got.sequences[0] == want, f"{prompt!r}\nours: {[tok.decode(s) for s in got.sequences[0]]}\nHF: {[tok.decode(s) for s in want]}"
    assert got.scores[0] == pytest.approx(out.sequences_scores.tolist(), abs=1e-4)


def test_greedy_with_processors_equals_hf(smollm2, reference):
    from caramba.infer import GenerateConfig, Generator

    hf, tok = reference
    kw = dict(no_repeat_ngram_size=3, min_new_tokens=40, repetition_penalty=1.1)
    for prompt in PROMPTS[2:]:
        ids = tok.encode(prompt)
        x = torch.tensor([ids])
        with torch.inference_mode():
            want = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=48, do_sample=False,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id, **kw)[0, len(ids):].tolist()
        cfg = GenerateConfig(max_new_tokens=48, temperature=0.0, eos_token_id=tok.eos_token_id, **kw)
        assert Generator(smollm2.model, cfg).run([ids]).sequences[0] == want
