"""Model families from HF directories: tiny random GPT-2, Qwen2 and Llama (for contrast) built in
transformers, saved with save_pretrained (safetensors) next to a tiny trained BPE tokenizer, loaded
with caramba's load_model, and compared with transformers logit by logit (fp32, 1e-4) and token by
token (greedy); plus ragged batches, the KV cache, learned positions and rejected configs."""

from __future__ import annotations

import json
import shutil

import pytest
import tokenizers
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import decoders, models, pre_tokenizers, trainers
from typer.testing import CliRunner

from caramba.cli import app
from caramba.errors import UserError
from caramba.infer import GenerateConfig, Generator, generate
from caramba.infer.beam import beam_search
from caramba.infer.contrastive import contrastive_search
from caramba.infer.speculative import SpeculativeConfig, SpeculativeGenerator
from caramba.model.config import ModelConfig
from caramba.model.zoo import load_model
import tolerance as tol
from conftest import hf_model, init_weights_
from test_contrastive import slow_contrastive

N_POS = 48      # GPT-2's learned table: short, so the limit is cheap to reach
N_NEW = 20
SENTENCES = [
    "the cat sat on the mat and looked at the dog",
    "a small model reads a short text and writes another one",
    "caramba loads gpt two and qwen two from saved directories",
    "every token must match the reference, one after the other",
]

# variant -> (family, HF config keywords)
VARIANTS = {
    "gpt2": ("gpt2", {}),
    "gpt2-untied-gelu": ("gpt2", dict(tie_word_embeddings=False, activation_function="gelu", n_inner=96)),
    "gpt2-upcast": ("gpt2", dict(reorder_and_upcast_attn=True, activation_function="gelu_pytorch_tanh")),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen2-untied": ("qwen2", dict(tie_word_embeddings=False)),
    "llama": ("llama", {}),
    "llama-attention-bias": ("llama", dict(attention_bias=True)),
    # Trained sliding windows shorter than the test prompts (24 tokens), so the window binds.
    "mistral-sliding": ("mistral", dict(sliding_window=8)),
    "qwen2-sliding": ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=0)),
    # Only the layers from max_window_layers on slide: a hybrid model (ModelConfig.layer_types).
    "qwen2-hybrid": ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
}


@pytest.fixture(scope="module")
def tokenizer() -> tokenizers.Tokenizer:
    """A byte-level BPE trained on a few sentences (~300 tokens): what a saved dir's tokenizer.json holds."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(SENTENCES, trainer)
    return tok


def build_hf(family: str, vocab: int, seed: int = 0, **kw):
    """A tiny transformers model of the family, with no EOS (so greedy runs run to length)."""
    if family != "gpt2":
        return hf_model(family, seed=seed, vocab_size=vocab, bos_token_id=None, eos_token_id=None, **kw)
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=N_POS,
                        bos_token_id=None, eos_token_id=None, **kw)
    config._attn_implementation = "eager"  # the plain reference path (and the one reorder_and_upcast_attn changes)
    torch.manual_seed(seed)
    return init_weights_(GPT2LMHeadModel(config), seed).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tokenizer):
    """variant -> (the transformers model, its saved directory, caramba's LoadedModel), built once."""
    built = {}

    def get(variant: str):
        if variant not in built:
            family, kw = VARIANTS[variant]
            hf = build_hf(family, tokenizer.get_vocab_size(), **kw)
            path = tmp_path_factory.mktemp(variant)
            hf.save_pretrained(path)
            tokenizer.save(str(path / "tokenizer.json"))
            built[variant] = hf, path, load_model(str(path), progress=False)
        return built[variant]

    return get


def rand_tokens(vocab: int, B: int, T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def hf_greedy(hf, ids: torch.Tensor, n: int = N_NEW) -> list[int]:
    return hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                       pad_token_id=0)[0, ids.shape[1]:].tolist()


# ---- loading and exactness -----------------------------------------------------------------------

@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant):
    hf, path, loaded = saved(variant)
    family, kw = VARIANTS[variant]
    cfg = loaded.model.config
    assert cfg.name == family and loaded.path == path
    assert (loaded.model.embed is None) == hf.config.tie_word_embeddings
    with safe_open(str(path / "model.safetensors"), "pt") as f:  # a tied save holds no lm_head
        assert ("lm_head.weight" in f.keys()) != hf.config.tie_word_embeddings
    if family == "gpt2":
        assert (cfg.norm, cfg.positions, cfg.max_position_embeddings) == ("layer", "learned", N_POS)
        assert cfg.mlp == ("gelu" if kw.get("activation_function") == "gelu" else "gelu_tanh")
        assert cfg.intermediate_size == kw.get("n_inner", 4 * 64)
    else:
        assert (cfg.norm, cfg.positions, cfg.mlp) == ("rms", "rope", "swiglu")
        bias = kw.get("attention_bias", False)
        assert (cfg.qkv_bias, cfg.out_bias) == ((True, False) if family == "qwen2" else (bias, bias))
        assert cfg.sliding_window == kw.get("sliding_window")
    tokens = rand_tokens(cfg.vocab_size, 2, 24)
    with torch.no_grad():
        want = hf(input_ids=tokens, use_cache=False).logits
    torch.testing.assert_close(loaded.model(tokens), want, **tol.forward(want, loaded.model.config))   # caramba vs transformers


def test_gpt2_hub_layout_without_prefix_and_with_mask_buffers(saved, tmp_path):
    """openai-community/gpt2's own file: no `transformer.` prefix, plus old causal-mask buffers."""
    hf, path, loaded = saved("gpt2")
    shutil.copytree(path, tmp_path / "m")
    state = {k.removeprefix("transformer."): v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    state["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, N_POS, N_POS))
    save_file(state, str(tmp_path / "m" / "model.safetensors"))
    tokens = rand_tokens(loaded.model.config.vocab_size, 1, 10)
    torch.testing.assert_close(load_model(str(tmp_path / "m"), progress=False).model(tokens), loaded.model(tokens),
                               atol=0, rtol=0)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_transformers_generate(saved, variant):
    hf, _, loaded = saved(variant)
    prompt = rand_tokens(loaded.model.config.vocab_size, 1, 7, seed=3)
    want = hf_greedy(hf, prompt)
    got = generate(loaded.model, prompt, max_new_tokens=N_NEW, temperature=0)[0, 7:].tolist()
    assert got == want
    assert len(set(got)) > 5  # a varied continuation: a broken position/cache path would show


@pytest.mark.parametrize("variant", ["gpt2", "qwen2-tied", "mistral-sliding"])
def test_left_padded_batch_matches_each_prompt_alone(saved, variant, tokenizer):
    hf, _, loaded = saved(variant)
    rows = [tokenizer.encode(s).ids[:n] for s, n in zip(SENTENCES, (3, 11, 6))]
    got = Generator(loaded.model, GenerateConfig(max_new_tokens=N_NEW, temperature=0)).run(rows).sequences
    assert got == [hf_greedy(hf, torch.tensor([r])) for r in rows]


def test_gpt2_beam_search_matches_transformers(saved):
    hf, _, loaded = saved("gpt2")
    ids = rand_tokens(loaded.model.config.vocab_size, 1, 6, seed=4)
    want = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=3, num_return_sequences=2,
                       max_new_tokens=10, pad_token_id=0)[:, 6:].tolist()
    got = beam_search(loaded.model, ids, max_new_tokens=10, num_beams=3, num_return_sequences=2, temperature=0,
                      eos_token_id=[])
    assert got.sequences[0] == want


def test_gpt2_contrastive_search_matches_the_slow_reference(saved):
    hf, _, loaded = saved("gpt2")
    prompt = rand_tokens(loaded.model.config.vocab_size, 1, 6, seed=8)[0].tolist()
    got = contrastive_search(loaded.model, [prompt], penalty_alpha=0.6, top_k=4, max_new_tokens=8, eos_token_id=[])
    assert got.sequences[0] == slow_contrastive(hf, prompt, 0.6, 4, 8)


# ---- learned positions through the cache -----------------------------------------------------------

def test_gpt2_cached_decode_equals_full_forward(saved):
    _, _, loaded = saved("gpt2")
    model = loaded.model
    tokens = rand_tokens(model.config.vocab_size, 2, 20, seed=5)
    full = model(tokens)
    cache = model.new_cache(2, 32)
    steps = [model(tokens[:, :6], cache=cache)]                  # prefill
    steps += [model(tokens[:, 6:9], cache=cache)]                # a 3-token verify chunk
    steps += [model(tokens[:, t : t + 1], cache=cache) for t in range(9, 20)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, **tol.forward(full, model.config))   # GEMV steps vs one GEMM


def test_gpt2_positions_index_the_learned_table_as_transformers_does(saved):
    """Per-row positions (left padding, later turns) pick rows of wpe exactly as position_ids do."""
    hf, _, loaded = saved("gpt2")
    tokens = rand_tokens(loaded.model.config.vocab_size, 2, 8, seed=6)
    positions = torch.stack([torch.arange(5, 13), torch.arange(30, 38)])
    with torch.no_grad():
        want = hf(input_ids=tokens, position_ids=positions, use_cache=False).logits
    got = loaded.model(tokens, positions)
    torch.testing.assert_close(got, want, **tol.forward(want, loaded.model.config))   # caramba vs transformers
    assert not torch.allclose(got, loaded.model(tokens), atol=1e-2)  # positions really matter


def test_gpt2_multi_turn_equals_a_fresh_generation_on_the_concatenation(saved):
    hf, _, loaded = saved("gpt2")
    turn1, turn2 = [7, 3, 9, 11, 2], [40, 41, 42]
    gen = Generator(loaded.model, GenerateConfig(max_new_tokens=6, temperature=0))
    out1 = gen.run([turn1]).sequences[0]
    out2 = gen.run([turn2]).sequences[0]
    assert out2 == hf_greedy(hf, torch.tensor([turn1 + out1 + turn2]), 6)


@pytest.mark.parametrize("draft", ["layer_skip", "self_int8"])
def test_gpt2_speculative_drafts_built_from_the_target(saved, draft):
    _, _, loaded = saved("gpt2")
    prompt = rand_tokens(loaded.model.config.vocab_size, 1, 7, seed=3).tolist()
    plain = Generator(loaded.model, GenerateConfig(max_new_tokens=N_NEW, temperature=0)).run(prompt).sequences
    cfg = SpeculativeConfig(max_new_tokens=N_NEW, temperature=0, draft=draft, draft_layers=1)
    assert SpeculativeGenerator(loaded.model, None, cfg).run(prompt).sequences == plain


def test_speculative_on_a_sliding_window_model_is_exact_alone_and_refused_in_batches(saved, tokenizer):
    _, _, loaded = saved("mistral-sliding")     # window 8: binds within these prompts + N_NEW
    rows = [tokenizer.encode(s).ids[:n] for s, n in zip(SENTENCES, (6, 10))]
    plain = Generator(loaded.model, GenerateConfig(max_new_tokens=N_NEW, temperature=0)).run(rows).sequences
    cfg = SpeculativeConfig(max_new_tokens=N_NEW, temperature=0, draft="layer_skip", draft_layers=1)
    assert [SpeculativeGenerator(loaded.model, None, cfg).run([r]).sequences[0] for r in rows] == plain
    with pytest.raises(ValueError, match="sliding_window=8.*batch_size: 1"):
        SpeculativeGenerator(loaded.model, None, cfg).run(rows)


def test_gpt2_position_past_n_positions_is_a_clear_error(saved):
    _, _, loaded = saved("gpt2")
    model = loaded.model
    with pytest.raises(ValueError, match=f"position {N_POS} is past .* \\(n_positions={N_POS}\\)"):
        model(torch.zeros(1, N_POS + 1, dtype=torch.long))
    cache = model.new_cache(1, 64)
    model(torch.zeros(1, N_POS, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match=f"n_positions={N_POS}"):
        model(torch.zeros(1, 1, dtype=torch.long), cache=cache)
    assert cache.length == N_POS  # the refused step wrote nothing
    # The Generator refuses up front (before any token streams), and its session stays usable.
    gen = Generator(model, GenerateConfig(max_new_tokens=10, temperature=0, max_seq_len=64))
    with pytest.raises(ValueError, match=f"{N_POS - 4 + 9} new exceed .* \\(n_positions={N_POS}\\)"):
        gen.run([[1] * (N_POS - 4)])
    assert gen.cache.length == 0
    assert len(gen.run([[1] * (N_POS - 10)]).sequences[0]) == 10


# ---- configs that would compute a different model are refused -----------------------------------

def gpt2_dict(**kw) -> dict:
    from transformers import GPT2Config

    return GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, **kw).to_dict()


def qwen2_dict(**kw) -> dict:
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, **kw).to_dict()


def mistral_dict(**kw) -> dict:
    from transformers import MistralConfig

    return MistralConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, **kw).to_dict()


@pytest.mark.parametrize("hf, message", [
    (lambda: gpt2_dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    (lambda: gpt2_dict(scale_attn_weights=False), "scale_attn_weights"),
    (lambda: gpt2_dict(activation_function="relu"), "activation_function 'relu'.*supported: gelu_new"),
    (lambda: {**qwen2_dict(), "model_type": "llama", "mlp_bias": True}, "mlp_bias"),
    (lambda: {**qwen2_dict(), "model_type": "llama", "hidden_act": "gelu"}, "hidden_act 'gelu'"),
    (lambda: {**qwen2_dict(), "model_type": "falcon"}, "supported: llama, mistral, qwen2, qwen3, phi3"),
], ids=["gpt2-layer-idx-scale", "gpt2-unscaled", "gpt2-relu",
        "llama-mlp-bias", "llama-gelu", "unknown-family"])
def test_configs_that_would_compute_a_different_model_are_rejected(hf, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(hf())


@pytest.mark.parametrize("kw", [
    dict(use_sliding_window=True, sliding_window=256, max_window_layers=0),   # the window covers every position
    dict(use_sliding_window=True, sliding_window=64, max_window_layers=4),    # no layer slides
    dict(use_sliding_window=False, sliding_window=64),                        # disabled
], ids=["window-covers-context", "no-sliding-layer", "disabled"])
def test_sliding_window_that_cannot_bind_is_accepted(kw):
    cfg = ModelConfig.from_hf(qwen2_dict(**kw))
    assert cfg.name == "qwen2" and cfg.sliding_window is None


def test_a_window_every_layer_uses_is_the_models_own():
    assert ModelConfig.from_hf(mistral_dict(sliding_window=64)).sliding_window == 64
    assert ModelConfig.from_hf(qwen2_dict(use_sliding_window=True, sliding_window=64,
                                          max_window_layers=0)).sliding_window == 64


def test_rejected_config_in_a_directory_is_a_user_error(saved, tmp_path):
    _, path, _ = saved("gpt2")
    shutil.copytree(path, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "scale_attn_by_inverse_layer_idx": True}))
    with pytest.raises(UserError, match="cannot load model .*scale_attn_by_inverse_layer_idx"):
        load_model(str(tmp_path / "m"), progress=False)


def test_directory_without_tokenizer_is_a_clear_error(saved, tmp_path):
    _, path, _ = saved("qwen2-tied")
    shutil.copytree(path, tmp_path / "m")
    (tmp_path / "m" / "tokenizer.json").unlink()
    with pytest.raises(UserError, match="has no tokenizer.json; save the tokenizer"):
        load_model(str(tmp_path / "m"), progress=False)


# ---- the CLI on a saved GPT-2 directory ----------------------------------------------------------

def test_cli_generate_gpt2_directory_matches_transformers(saved):
    hf, path, _ = saved("gpt2")
    r = CliRunner().invoke(app, ["generate", "the cat sat on", "--model", str(path), "--max-new-tokens",
                                 str(N_NEW), "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["output_ids"] == hf_greedy(hf, torch.tensor([data["prompt_ids"]]))


def test_cli_generate_past_n_positions_exits_2(saved):
    _, path, _ = saved("gpt2")
    r = CliRunner().invoke(app, ["generate", " ".join(SENTENCES), "--model", str(path), "--max-new-tokens",
                                 str(N_POS), "--json"])
    assert r.exit_code == 2 and f"n_positions={N_POS}" in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("dtype, tol", [("bfloat16", 0.15), ("float16", 0.02)])
def test_gpt2_half_precision_is_close_to_fp32(saved, dtype, tol):
    _, path, loaded = saved("gpt2")
    half = load_model(str(path), dtype=dtype, progress=False).model
    tokens = rand_tokens(loaded.model.config.vocab_size, 2, 16, seed=7)
    full = loaded.model(tokens)
    assert (half(tokens).float() - full).abs().mean() < tol * full.abs().mean()
