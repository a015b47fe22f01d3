"""The decoder: cached decode == full forward, HF parity (Llama incl. RoPE scaling, Qwen2), dtypes."""

from __future__ import annotations

import json

import pytest
import torch

from caramba.infer import generate
from caramba.model.config import ModelConfig
from caramba.model.rope import RotaryTable, rope_inv_freq
import tolerance as tol
from conftest import TINY, caramba_from_hf, hf_logits, hf_model, make_model, tiny_config

V = TINY["vocab_size"]

LINEAR = {"rope_type": "linear", "factor": 4.0}
# original context 32 with head_dim 16 puts one frequency in each llama3 band (kept, blended, slowed).
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}

VARIANTS = {
    "gqa": {},
    "mha": {"n_kv_heads": 4},
    "mqa": {"n_kv_heads": 1},
    "qkv_bias": {"qkv_bias": True},
    "untied": {"tie_embeddings": False},
    "rope_linear": {"rope_scaling": LINEAR},
    "rope_llama3": {"rope_scaling": LLAMA3},
}


def rand_tokens(B: int, T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def assert_logits_close(a: torch.Tensor, b: torch.Tensor, config=None) -> None:
    """Two forwards of the same model (or caramba vs transformers): equal up to fp32 rounding."""
    torch.testing.assert_close(a.float(), b.float(), **tol.forward(b.float(), config or tiny_config()))


# ---- the test models are fit for purpose ----------------------------------------------------------

def test_tiny_model_greedy_output_is_diverse(model):
    out = generate(model, rand_tokens(3, 6), max_new_tokens=24, temperature=0, max_seq_len=64)
    new = out[:, 6:]
    for row in new.tolist():
        assert len(set(row)) >= 8, f"greedy output is nearly one repeated token: {row}"
    assert new[0].tolist() != new[1].tolist() != new[2].tolist()
    logits = model(rand_tokens(1, 8))
    assert logits.std() > 1.0  # spread out, so argmax ties and fp noise do not decide tokens


# ---- cached decode equals a full forward ---------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_token_by_token_decode_matches_full_forward(variant):
    model = make_model(**VARIANTS[variant])
    tokens = rand_tokens(2, 16)
    full = model(tokens)                               # [2, 16, V], no cache
    cache = model.new_cache(2, 32)
    steps = [model(tokens[:, :5], cache=cache)]        # prefill
    assert cache.length == 5
    for t in range(5, 16):
        steps.append(model(tokens[:, t : t + 1], cache=cache))
    assert cache.length == 16
    assert_logits_close(torch.cat(steps, dim=1), full)


@pytest.mark.parametrize("variant", ["gqa", "mha", "qkv_bias", "rope_llama3"])
def test_chunked_verify_decode_matches_full_forward(variant):
    """Several tokens at once on a warm cache (speculative verification) use the causal mask."""
    model = make_model(**VARIANTS[variant])
    tokens = rand_tokens(2, 19, seed=3)
    full = model(tokens)
    cache = model.new_cache(2, 24)
    outs, start = [], 0
    for n in (3, 4, 1, 5, 2, 4):
        outs.append(model(tokens[:, start : start + n], cache=cache))
        start += n
    assert start == 19 and cache.length == 19
    assert_logits_close(torch.cat(outs, dim=1), full)


def test_last_only_returns_the_final_position(model):
    tokens = rand_tokens(2, 7)
    full = model(tokens)
    last = model(tokens, last_only=True)
    assert last.shape == (2, 1, V)
    assert_logits_close(last, full[:, -1:])


def test_rope_is_relative_so_shifted_positions_give_the_same_logits(model):
    tokens = rand_tokens(1, 10)
    base = model(tokens)
    shifted = model(tokens, positions=torch.arange(37, 47)[None])
    assert_logits_close(shifted, base)
    # ...but positions are really used: a non-uniform shift changes the logits.
    scrambled = model(tokens, positions=torch.tensor([[0, 1, 2, 3, 4, 9, 10, 11, 12, 13]]))
    assert (scrambled[:, 5:] - base[:, 5:]).abs().max() > 1e-2
    assert_logits_close(scrambled[:, :5], base[:, :5])


def test_rotary_table_grows_past_max_position_embeddings():
    model = make_model(max_position_embeddings=8)
    tokens = rand_tokens(1, 20)
    full = model(tokens)
    cache = model.new_cache(1, 20)
    model(tokens[:, :4], cache=cache)
    inc = torch.cat([model(tokens[:, t : t + 1], cache=cache) for t in range(4, 20)], dim=1)
    assert_logits_close(inc, full[:, 4:])


def test_rotary_table_rejects_positions_past_its_end():
    table = RotaryTable(tiny_config(), 8)
    with pytest.raises(ValueError, match="rotary table"):
        table(torch.tensor([[8]]), torch.float32)


# ---- architecture variants -----------------------------------------------------------------------

def test_gqa_model_has_fewer_kv_projections_than_mha():
    gqa, mha = make_model(n_kv_heads=2), make_model(n_kv_heads=4)
    assert gqa.layers[0].attn.wqkv.weight.shape == (64 + 2 * 32, 64)
    assert mha.layers[0].attn.wqkv.weight.shape == (64 + 2 * 64, 64)
    assert gqa.new_cache(1, 8).layers[0].k.shape == (1, 2, 8, 16)


def test_qkv_bias_is_applied():
    model = make_model(qkv_bias=True)
    tokens = rand_tokens(1, 6)
    with_bias = model(tokens)
    for layer in model.layers:
        layer.attn.wqkv.bias.zero_()
    assert (model(tokens) - with_bias).abs().max() > 1e-2


def test_untied_head_uses_lm_head_not_the_embedding():
    model = make_model(tie_embeddings=False)
    assert model.embed is not None and model.head.weight_t.data_ptr() != model.embed.weight.data_ptr()
    tokens = rand_tokens(1, 6)
    before = model(tokens)
    model.head.weight_t.mul_(2.0)
    assert_logits_close(model(tokens), before * 2.0)
    tied = make_model(tie_embeddings=True)
    assert tied.embed is None and "embed.weight" not in tied.state_dict()
    # tied: the embedding of token i is column i of the head
    assert torch.equal(tied.embed_tokens(torch.tensor([[3]]))[0, 0], tied.head.weight_t[:, 3])


def test_config_validation_and_round_trip():
    with pytest.raises(ValueError, match="n_heads=6 is not a multiple of n_kv_heads=4"):
        tiny_config(n_heads=6, n_kv_heads=4)
    with pytest.raises(ValueError, match="model_type 'falcon' is not supported"):
        ModelConfig.from_hf({"model_type": "falcon"})
    with pytest.raises(ValueError, match="ModelConfig.norm='batch': use one of rms, layer"):
        tiny_config(norm="batch")
    with pytest.raises(ValueError, match="mlp_bias needs a GELU mlp"):
        tiny_config(mlp_bias=True)
    for cfg in (tiny_config(rope_scaling=LLAMA3, qkv_bias=True),
                tiny_config(norm="layer", mlp="gelu", positions="learned", qkv_bias=True, out_bias=True, mlp_bias=True)):
        assert ModelConfig.from_dict(json.loads(cfg.to_json())) == cfg


def test_unknown_rope_type_is_rejected():
    with pytest.raises(ValueError, match="'yarn' is not supported"):
        rope_inv_freq(tiny_config(rope_scaling={"rope_type": "yarn", "factor": 2.0}))


# ---- RoPE scaling -------------------------------------------------------------------------------

@pytest.mark.parametrize("scaling", [LINEAR, LLAMA3], ids=["linear", "llama3"])
def test_rope_scaling_changes_logits(scaling):
    default, scaled = make_model(), make_model(rope_scaling=scaling)
    tokens = rand_tokens(1, 24)
    a, b = default(tokens), scaled(tokens)
    assert_logits_close(a[:, 0], b[:, 0])                 # position 0 is never rotated
    assert (a[:, 8:] - b[:, 8:]).abs().max() > 1e-2


def test_llama3_scaling_keeps_high_frequencies_and_slows_low_ones():
    base = rope_inv_freq(tiny_config())
    scaled = rope_inv_freq(tiny_config(rope_scaling=LLAMA3))
    assert torch.equal(scaled[0], base[0])                        # wavelength 6.3 < 8: kept
    assert base[1] / 8 < scaled[1] < base[1]                      # wavelength 20: blended
    torch.testing.assert_close(scaled[2:], base[2:] / 8, **tol.elementwise(base, ops=2))   # wavelength > 32: slowed 8x
    torch.testing.assert_close(rope_inv_freq(tiny_config(rope_scaling=LINEAR)), base / 4, **tol.elementwise(base, ops=2))


# ---- parity with transformers ---------------------------------------------------------------------

@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"num_key_value_heads": 4},
        {"num_key_value_heads": 1},
        {"tie_word_embeddings": True},
        {"rope_scaling": LINEAR},
        {"rope_scaling": LLAMA3},
        {"rope_theta": 500.0, "rope_scaling": LLAMA3, "num_key_value_heads": 1},
    ],
    ids=["gqa", "mha", "mqa", "tied", "rope_linear", "rope_llama3", "llama3_theta500_mqa"],
)
def test_matches_transformers_llama(overrides):
    hf = hf_model("llama", **overrides)
    ours = caramba_from_hf(hf)
    if "rope_scaling" in overrides:
        assert ours.config.rope_scaling["rope_type"] == overrides["rope_scaling"]["rope_type"]
    assert ours.config.tie_embeddings == overrides.get("tie_word_embeddings", False)
    tokens = rand_tokens(2, 40, seed=5)  # past the llama3 original context of 32
    expected = hf_logits(hf, tokens)
    assert_logits_close(ours(tokens), expected)
    # and through the cache, one token at a time after a prefill
    cache = ours.new_cache(2, 40)
    inc = [ours(tokens[:, :10], cache=cache)] + [ours(tokens[:, t : t + 1], cache=cache) for t in range(10, 40)]
    assert_logits_close(torch.cat(inc, dim=1), expected)


def test_rope_scaled_hf_models_differ_from_unscaled():
    """Guards the parity test above: the scaled reference really is a different function."""
    tokens = rand_tokens(1, 40, seed=5)
    plain = hf_logits(hf_model("llama"), tokens)
    for scaling in (LINEAR, LLAMA3):
        assert (hf_logits(hf_model("llama", rope_scaling=scaling), tokens) - plain).abs().max() > 1e-2


def test_matches_transformers_qwen2_with_qkv_bias():
    hf = hf_model("qwen2")
    ours = caramba_from_hf(hf)
    assert ours.config.qkv_bias and ours.config.name == "qwen2"
    assert ours.layers[0].attn.wqkv.bias is not None
    tokens = rand_tokens(2, 20, seed=7)
    expected = hf_logits(hf, tokens)
    assert_logits_close(ours(tokens), expected)
    cache = ours.new_cache(2, 20)
    inc = [ours(tokens[:, :6], cache=cache)] + [ours(tokens[:, t : t + 1], cache=cache) for t in range(6, 20)]
    assert_logits_close(torch.cat(inc, dim=1), expected)


# ---- dtypes ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,tol", [(torch.float16, 0.02), (torch.bfloat16, 0.08)], ids=["fp16", "bf16"])
def test_half_precision_forward_is_close_to_fp32(dtype, tol):
    ref = make_model()
    half = make_model(dtype=dtype)
    assert half.dtype == dtype and half.head.weight_t.dtype == dtype
    tokens = rand_tokens(2, 12)
    expected = ref(tokens)
    got = half(tokens)
    assert got.dtype == dtype
    scale = expected.abs().max()
    assert (got.float() - expected).abs().max() / scale < tol
    agree = (got.float().argmax(-1) == expected.argmax(-1)).float().mean()
    assert agree >= 0.9
    # cached decode works in that dtype too
    cache = half.new_cache(2, 12)
    inc = [half(tokens[:, :4], cache=cache)] + [half(tokens[:, t : t + 1], cache=cache) for t in range(4, 12)]
    assert (torch.cat(inc, 1).float() - expected).abs().max() / scale < tol


def test_an_mlp_held_row_major_keeps_its_values_and_says_so():
    """InputMajorLinear.hold_row_major changes where the weight's memory runs, not its values: the
    state dict is the same, the logits agree to fp32 rounding, and the model's identity (the keys
    of kept results) changes with the summation order."""
    from caramba.evaluation.context_store import model_identity

    model = make_model(seed=0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    identity = model_identity(model, "x")
    ids = torch.randint(0, 97, (2, 70), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        before = model(ids)
        for layer in model.layers:
            layer.mlp.w13.hold_row_major()
            layer.mlp.w13.hold_row_major()   # twice: a no-op
        after = model(ids)
    w13 = model.layers[0].mlp.w13
    assert w13.layout == "rows" and w13.weight_t.t().is_contiguous() and model.head.layout is None
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert model_identity(model, "x") != identity
    torch.testing.assert_close(after, before, atol=tol.forward(before, model.config)["atol"], rtol=0)
