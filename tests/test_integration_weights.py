"""Quantized weights on the real SmolLM2-135M-Instruct GGUF: `native` keeps the file's Q4_1/Q8_0
blocks, whose values are exactly what the fp32 path dequantizes, so greedy output must equal
fp32's; q8_0 requantizes them and must stay close."""

from __future__ import annotations

import pytest
import torch

from caramba.infer import GenerateConfig, Generator
from conftest import SMOLLM2
from test_integration_smollm2 import PROMPTS

pytestmark = SMOLLM2


@pytest.fixture(scope="module")
def native(smollm2):
    from caramba.model import quant
    from caramba.model.zoo import load_model

    if quant.library() is None:
        pytest.skip(f"weight kernels {quant.status()}")
    return load_model("smollm2-135m", "float32", "cpu", progress=False, weights="native").model


def greedy(model, tok, n=32):
    cfg = GenerateConfig(max_new_tokens=n, temperature=0.0)
    return [Generator(model, cfg).run([tok.encode(p)]).sequences[0] for p in PROMPTS]


def test_native_blocks_give_the_fp32_greedy_output(smollm2, native):
    head = native.head
    assert head.fmt == "q8_0" and native.layers[0].attn.wqkv.fmt == "q4_1"     # the file's own formats
    assert greedy(native, smollm2.tokenizer) == greedy(smollm2.model, smollm2.tokenizer)


def test_native_logits_match_fp32(smollm2, native):
    ids = torch.tensor([smollm2.tokenizer.encode(PROMPTS[2])])
    with torch.inference_mode():
        ref_cache, nat_cache = smollm2.model.new_cache(1, 64), native.new_cache(1, 64)
        smollm2.model(ids, cache=ref_cache)
        native(ids, cache=nat_cache)
        step = torch.tensor([[42]])
        ref, got = smollm2.model(step, cache=ref_cache), native(step, cache=nat_cache)   # the kernels' path
    # Same values, other summation order: fp32 rounding through 30 layers (tolerance.forward).
    import tolerance as tol
    torch.testing.assert_close(got, ref, **tol.forward(ref, smollm2.model.config))


def test_the_one_call_decode_step_gives_the_torch_paths_greedy_output(smollm2):
    """caramba.model.fast_decode against the torch path it replaces, on real prompts (native
    weights take it too: test_native_blocks_give_the_fp32_greedy_output)."""
    from caramba.model import fast_decode

    if fast_decode.library() is None:
        pytest.skip(f"decode step kernel {fast_decode.status()}")
    model, tok = smollm2.model, smollm2.tokenizer
    cfg = GenerateConfig(max_new_tokens=24, temperature=0.0)
    ids = [tok.encode(p) for p in PROMPTS[1:3]]
    fast = [Generator(model, cfg).run([i]).sequences[0] for i in ids]
    model.fast_decode = False
    try:
        assert [Generator(model, cfg).run([i]).sequences[0] for i in ids] == fast
    finally:
        model.fast_decode = True
