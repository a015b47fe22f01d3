"""Quantized weights on the real SmolLM2-135M-Instruct GGUF: `native` keeps the file's Q4_1/Q8_0
blocks, whose values are exactly what the fp32 path dequantizes, so greedy output must equal
fp32's; `native_i16` rounds the activations to int16 and must stay within that rounding; q8_0
requantizes the weights and must stay close."""

from __future__ import annotations

import pytest
import torch

from caramba.infer import GenerateConfig, Generator
from conftest import SMOLLM2
from test_integration_smollm2 import PROMPTS

pytestmark = SMOLLM2


def load(weights: str):
    from caramba.model import quant
    from caramba.model.zoo import load_model

    if quant.library() is None:
        pytest.skip(f"weight kernels {quant.status()}")
    return load_model("smollm2-135m", "float32", "cpu", progress=False, weights=weights).model


@pytest.fixture(scope="module")
def native(smollm2):
    return load("native")


@pytest.fixture(scope="module")
def native_i16(smollm2):
    return load("native_i16")


def greedy(model, tok, n=32):
    cfg = GenerateConfig(max_new_tokens=n, temperature=0.0)
    return [Generator(model, cfg).run([tok.encode(p)]).sequences[0] for p in PROMPTS]


def test_native_blocks_give_the_fp32_greedy_output(smollm2, native):
    head = native.head
    assert head.fmt == "q8_0" and native.layers[0].attn.wqkv.fmt == "q4_1"     # the file's own formats
    assert greedy(native, smollm2.tokenizer) == greedy(smollm2.model, smollm2.tokenizer)


def step_logits(model, ref_model, tok):
    """(model, ref_model) logits of one decode step after a prompt's prefill."""
    ids = torch.tensor([tok.encode(PROMPTS[2])])
    with torch.inference_mode():
        ref_cache, cache = ref_model.new_cache(1, 64), model.new_cache(1, 64)
        ref_model(ids, cache=ref_cache)
        model(ids, cache=cache)
        step = torch.tensor([[42]])
        return model(step, cache=cache), ref_model(step, cache=ref_cache)   # the kernels' path


def test_native_logits_match_fp32(smollm2, native):
    got, ref = step_logits(native, smollm2.model, smollm2.tokenizer)
    # Same values, other summation order: fp32 rounding through 30 layers (tolerance.forward).
    import tolerance as tol
    torch.testing.assert_close(got, ref, **tol.forward(ref, smollm2.model.config))


def test_native_i16_stays_within_its_activations_rounding(smollm2, native_i16):
    """int16 activations move the logits (seen: ~4e-3 of ~25), within the rounding's bound; greedy
    output leaves fp32's only at near ties (docs/decode-speed.md), none in these prompts."""
    import tolerance as tol

    assert native_i16.head.act == native_i16.layers[0].attn.wqkv.act == "i16"
    got, ref = step_logits(native_i16, smollm2.model, smollm2.tokenizer)
    torch.testing.assert_close(got, ref, **tol.rounded_activations(ref, smollm2.model.config, 32767))
    assert (got - ref).abs().max() > tol.forward(ref, smollm2.model.config)["atol"] / 100   # really rounded
    assert greedy(native_i16, smollm2.tokenizer) == greedy(smollm2.model, smollm2.tokenizer)


def test_the_one_call_decode_step_gives_the_torch_paths_greedy_output(smollm2):
    """caramba.model.fast_decode against the torch path it replaces, on real prompts (native
    weights take it too: test_native_blocks_give_the_fp32_greedy_output)."""
    from caramba.model import fast_decode

    if fast_decode.library() is None:
        pytest.skip(f"decode step kernel {fast_decode.status()}")
    model, tok = smollm2.model, smollm2.tokenizer
    cfg = GenerateConfig(max_new_tokens=24, temperature=0.0)
    ids = [tok.encode(p) for p in PROMPTS[1:3]]
    fast = []
    for i in ids:
        gen = Generator(model, cfg)
        fast.append(gen.run([i]).sequences[0])
        assert gen.backend.path == "c"
    model.fast_decode = False
    try:
        assert [Generator(model, cfg).run([i]).sequences[0] for i in ids] == fast
    finally:
        model.fast_decode = True
