"""The families that differ from Llama where KV-cache research lives, from HF directories: tiny
random Gemma 2 (soft caps, alternating sliding layers, query scale), Gemma 3 (hybrid sliding/full
layers with their own RoPE bases, QK-norm, four norms, GeGLU, scaled embeddings), Qwen3 (QK-norm per
head), Phi-3 (fused qkv and gate|up) and OLMo 2 (post-norms only, QK-norm over the projection),
built offline from transformers' config classes, saved with save_pretrained and loaded with
caramba's load_model: logits within the fp32 bound and greedy tokens identical to transformers,
through the cache (prefill, verify chunks, single steps) with windows that bind."""

from __future__ import annotations

import pytest
import torch

from caramba.infer import GenerateConfig, Generator, generate
from caramba.model.config import ModelConfig
from caramba.model.zoo import load_model
import tolerance as tol
from conftest import init_weights_
from test_model_families import SENTENCES, hf_greedy, rand_tokens, tokenizer  # noqa: F401

WINDOW = 8          # shorter than the prompts below, so every sliding layer's window binds
N_NEW = 20
SIZES = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
NO_SPECIAL = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _gemma2(vocab):
    from transformers import Gemma2Config, Gemma2ForCausalLM
    return Gemma2ForCausalLM(Gemma2Config(vocab_size=vocab, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                          attn_logit_softcapping=2.0, final_logit_softcapping=15.0,
                                          tie_word_embeddings=False,  # tied, the scaled input embedding wins: one token repeats
                                          **SIZES, **NO_SPECIAL))


def _gemma3(vocab):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    return Gemma3ForCausalLM(Gemma3TextConfig(vocab_size=vocab, sliding_window=WINDOW,
                                              layer_types=["sliding_attention", "sliding_attention",
                                                           "full_attention", "sliding_attention"],
                                              **SIZES, **NO_SPECIAL))


def _qwen3(vocab):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, tie_word_embeddings=False, **SIZES, **NO_SPECIAL))


def _phi3(vocab):
    from transformers import Phi3Config, Phi3ForCausalLM
    return Phi3ForCausalLM(Phi3Config(vocab_size=vocab, original_max_position_embeddings=256, **SIZES, **NO_SPECIAL))


def _olmo2(vocab):
    from transformers import Olmo2Config, Olmo2ForCausalLM
    return Olmo2ForCausalLM(Olmo2Config(vocab_size=vocab, **SIZES, **NO_SPECIAL))


FAMILIES = {"gemma2": _gemma2, "gemma3": _gemma3, "qwen3": _qwen3, "phi3": _phi3, "olmo2": _olmo2}


def build_hf(family: str, vocab: int, seed: int = 0):
    torch.manual_seed(seed)
    model = FAMILIES[family](vocab)
    model.config._attn_implementation = "eager"   # the plain reference path (soft caps need it)
    init_weights_(model, seed)
    if family.startswith("gemma"):   # Gemma stores w of a (1 + w) norm: keep the scales near 1 as trained ones are
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.sub_(1.0)
            # Scaled by sqrt(dim) = 8, random embeddings outweigh the post-normed layers' outputs
            # and one token repeats; trained Gemma embeddings are small for that reason.
            model.model.embed_tokens.weight.div_(8.0)
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tokenizer):  # noqa: F811
    built = {}

    def get(family: str):
        if family not in built:
            hf = build_hf(family, tokenizer.get_vocab_size())
            path = tmp_path_factory.mktemp(family)
            hf.save_pretrained(path)
            tokenizer.save(str(path / "tokenizer.json"))
            built[family] = hf, load_model(str(path), progress=False)
        return built[family]

    return get


def test_configs_say_what_each_family_is(saved):
    cfgs = {f: saved(f)[1].model.config for f in FAMILIES}
    g3 = cfgs["gemma3"]
    assert (g3.mlp, g3.qk_norm, g3.pre_norms, g3.post_norms) == ("geglu", "head", True, True)
    assert g3.layer_types == ["sliding", "sliding", "full", "sliding"] and g3.hybrid and g3.sliding_window == WINDOW
    assert (g3.rope_theta, g3.rope_local_theta, g3.embed_scale) == (1e6, 1e4, 8.0)
    assert g3.attn_scale == 256 ** -0.5 and g3.attn_softcap is None
    g2 = cfgs["gemma2"]
    assert (g2.attn_softcap, g2.final_softcap, g2.attn_scale, g2.qk_norm) == (2.0, 15.0, 24 ** -0.5, None)
    assert g2.layer_types == ["sliding", "full", "sliding", "full"] and g2.rope_local_theta is None
    assert (cfgs["qwen3"].qk_norm, cfgs["olmo2"].qk_norm) == ("head", "projection")
    assert (cfgs["olmo2"].pre_norms, cfgs["olmo2"].post_norms) == (False, True)
    assert cfgs["phi3"].mlp == "swiglu" and cfgs["phi3"].qk_norm is None


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(saved, family):
    hf, loaded = saved(family)
    tokens = rand_tokens(loaded.model.config.vocab_size, 2, 24)    # 3x the window
    with torch.no_grad():
        want = hf(input_ids=tokens, use_cache=False).logits
    torch.testing.assert_close(loaded.model(tokens), want, **tol.forward(want, loaded.model.config))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_transformers_generate(saved, family):
    hf, loaded = saved(family)
    prompt = rand_tokens(loaded.model.config.vocab_size, 1, 7, seed=3)
    want = hf_greedy(hf, prompt)
    got = generate(loaded.model, prompt, max_new_tokens=N_NEW, temperature=0)[0, 7:].tolist()
    assert got == want
    assert len(set(got)) > 5   # a varied continuation: a broken position or cache path would show


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_cached_decode_equals_the_full_forward_past_the_window(saved, family):
    """Prefill, a verify chunk, then single steps: every sliding layer's window binds in each."""
    _, loaded = saved(family)
    model = loaded.model
    tokens = rand_tokens(model.config.vocab_size, 2, 30, seed=5)
    full = model(tokens)
    cache = model.new_cache(2, 32)
    steps = [model(tokens[:, :12], cache=cache), model(tokens[:, 12:16], cache=cache)]
    steps += [model(tokens[:, t:t + 1], cache=cache) for t in range(16, 30)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, **tol.forward(full, model.config))


@pytest.mark.parametrize("family", ["gemma3", "olmo2"])
def test_left_padded_batch_matches_each_prompt_alone(saved, family, tokenizer):  # noqa: F811
    hf, loaded = saved(family)
    rows = [tokenizer.encode(s).ids[:n] for s, n in zip(SENTENCES, (3, 11, 6))]
    got = Generator(loaded.model, GenerateConfig(max_new_tokens=N_NEW, temperature=0)).run(rows).sequences
    assert got == [hf_greedy(hf, torch.tensor([r])) for r in rows]


def test_a_window_that_does_not_bind_changes_nothing(saved):
    """The window is real: the same weights with full attention everywhere differ past it, not before."""
    _, loaded = saved("gemma3")
    model = loaded.model
    tokens = rand_tokens(model.config.vocab_size, 1, 20, seed=7)
    hybrid = model(tokens)
    cfg = model.config
    model.config = ModelConfig.from_dict({**cfg.__dict__, "sliding_window": 10 ** 6})
    try:
        wide = model(tokens)
    finally:
        model.config = cfg
    torch.testing.assert_close(hybrid[:, :WINDOW], wide[:, :WINDOW], atol=0, rtol=0)
    assert not torch.allclose(hybrid[:, WINDOW + 2:], wide[:, WINDOW + 2:])


@pytest.mark.parametrize("hf, problem", [
    ({"model_type": "gemma3_text", "hidden_activation": "silu"}, "hidden_activation"),
    ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, "bidirectional"),
    ({"model_type": "gemma3_text", "layer_types": ["sliding_attention"]}, "layer_types"),
    ({"model_type": "phi3", "rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
     "longrope"),
    ({"model_type": "phi3", "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
])
def test_configs_it_would_compute_differently_are_refused(hf, problem):
    base = dict(vocab_size=64, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=96,
                head_dim=16, sliding_window=WINDOW)
    with pytest.raises(ValueError, match=problem):
        ModelConfig.from_hf({**base, **hf})
