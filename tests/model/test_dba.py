"""Decoupled bottleneck attention (DBA): the attention against a direct computation, its
three-stream cache on every kind (sync, truncate/reset/reorder, bytes), generation, cache
policies, and the conversion from a standard checkpoint (exact without compression, loadable
from disk with it)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from caramba.cache import CachePolicy, DecoupledLayerKVCache, KVCacheTensorConfig, parse_policy
from caramba.infer import GenerateConfig, Generator
from caramba.infer.beam import beam_search
from caramba.infer.speculative import SpeculativeConfig, SpeculativeGenerator
from caramba.model.config import ModelConfig
from caramba.model.dba_convert import check_dims, convert_state, input_moments
from caramba.model.native import is_native_dir, read_native, save_native
from caramba.model.zoo import build_model, load_model
import tolerance
from conftest import TINY, make_model, tiny_config

ALL_KINDS = ["fp32", "fp16", "bf16", "q8_0", "q4_0", "nf4"]
V = TINY["vocab_size"]
SEM, GEO = 8, 8            # per head; TINY's head_dim is 16
DBA = dict(attention="decoupled", sem_dim=SEM, geo_dim=GEO)


def dba_model(seed: int = 0, **overrides):
    return make_model(seed=seed, **{**DBA, **overrides})


def tokens(B: int, T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---- the attention --------------------------------------------------------------------------------

def direct_attention(attn, x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """softmax((q_sem.k_sem + q_geo.k_geo) / sqrt(sem + geo)) @ v, written out from the weights:
    own RoPE angles, explicit GQA head mapping, causal mask, no SDPA, no cache."""
    B, T, _ = x.shape
    H, KVH, D, s, g = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.sem_dim, cfg.geo_dim
    w = x @ attn.wqkv.weight.T
    q = w[..., : H * (s + g)].view(B, T, H, s + g)
    k = w[..., H * (s + g) : (H + KVH) * (s + g)].view(B, T, KVH, s + g)
    v = w[..., (H + KVH) * (s + g) :].view(B, T, KVH, D)
    pos = torch.arange(T, dtype=torch.float64)
    freqs = cfg.rope_theta ** (-torch.arange(0, g // 2, dtype=torch.float64) * 2 / D)   # head_dim's fastest
    ang = (pos[:, None] * freqs[None]).float()                                          # [T, g/2]
    cos, sin = ang.cos()[None, :, None], ang.sin()[None, :, None]

    def rot(t):  # pairs (j, j + g/2)
        a, b = t[..., : g // 2], t[..., g // 2 :]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    qs, qg, ks, kg = q[..., :s], rot(q[..., s:]), k[..., :s], rot(k[..., s:])
    out = torch.empty(B, T, H, D)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for h in range(H):
        kv = h // (H // KVH)
        scores = (qs[:, :, h] @ ks[:, :, kv].transpose(1, 2) + qg[:, :, h] @ kg[:, :, kv].transpose(1, 2)) / math.sqrt(s + g)
        p = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        out[:, :, h] = p @ v[:, :, kv]
    return attn.wo(out.reshape(B, T, H * D))


def test_attention_without_and_with_a_full_precision_cache_equals_the_direct_computation():
    model = dba_model()
    attn, cfg = model.layers[0].attn, model.config
    x = randn(2, 11, cfg.dim, seed=3)
    expected = direct_attention(attn, x, cfg)
    cos, sin = model.rotary(torch.arange(11).expand(2, 11))
    torch.testing.assert_close(attn(x, cos, sin, None, None, True), expected, **tolerance.forward(expected, cfg))
    cache = model.new_cache(2, 16).layers[0]
    assert isinstance(cache, DecoupledLayerKVCache)
    torch.testing.assert_close(attn(x, cos, sin, cache, None, True), expected, **tolerance.forward(expected, cfg))
    # Token by token through the chunked read path (T=1: per-stream scores added before softmax).
    cache.reset()
    steps = [attn(x[:, t : t + 1], cos[:, :, t : t + 1], sin[:, :, t : t + 1], cache, None, False) for t in range(11)]
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, **tolerance.forward(expected, cfg))


def test_wqkv_layout_and_scale():
    model = dba_model(sem_dim=6, geo_dim=4)
    attn = model.layers[0].attn
    H, KVH, D = TINY["n_heads"], TINY["n_kv_heads"], TINY["head_dim"]
    assert attn.wqkv.weight.shape == ((H + KVH) * 10 + KVH * D, TINY["dim"])
    assert attn.wo.weight.shape == (TINY["dim"], H * D)     # values keep head_dim


# a cache of `kind` vs no cache: the cache rounds every K/V to its dtype, so the bound is the dtype's eps
# times a margin (fp16: 2e-2 ~ 20 eps, bf16: 1e-1 ~ 13 eps; fp32: only the forward's own rounding)
@pytest.mark.parametrize("kind, tol", [("fp32", 1e-4), ("fp16", 2e-2), ("bf16", 1e-1)])
def test_incremental_decode_equals_full_forward(kind, tol):
    model = dba_model()
    t = tokens(2, 14, seed=1)
    full = model(t)
    cache = model.new_cache(2, 20, kind)
    steps = [model(t[:, :5], cache=cache)] + [model(t[:, i : i + 1], cache=cache) for i in range(5, 14)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=tol, rtol=tol)
    # A multi-token forward after a prefix (speculative verification) equals the single steps.
    cache.truncate(9)
    torch.testing.assert_close(model(t[:, 9:14], cache=cache), full[:, 9:14], atol=tol, rtol=tol)


@pytest.mark.parametrize("kind, tol", [("q8_0", 0.02), ("q4_0", 0.5), ("nf4", 0.5)])
def test_quantized_caches_stay_close_and_decode_equals_verify(kind, tol):
    model = dba_model(std=0.1)      # a tamer model: the default tiny one amplifies any error
    t = tokens(1, 14, seed=2)
    full = model(t)
    cache = model.new_cache(1, 20, CachePolicy.build(kind, qblock=8))
    model(t[:, :8], cache=cache)
    steps = torch.cat([model(t[:, i : i + 1], cache=cache) for i in range(8, 14)], dim=1)
    assert 0 < float((steps - full[:, 8:]).abs().max() / full.abs().max()) < tol
    cache.truncate(8)
    torch.testing.assert_close(model(t[:, 8:14], cache=cache), steps, **tolerance.cache_paths(steps, model.config, kind))


# ---- the cache ------------------------------------------------------------------------------------

def decoupled_cache(kinds, B=3, S=12, rotate=False, residual_len=0):
    k_sem, k_geo, v = (KVCacheTensorConfig(k, qblock=4, residual_len=residual_len) for k in kinds)
    return DecoupledLayerKVCache(B, S, 2 * SEM, 2 * GEO, 2 * 16, k_sem, k_geo, v, "cpu", n_kv_heads=2,
                                 rotate_keys=rotate)


@pytest.mark.parametrize("kinds", [(k, k, k) for k in ALL_KINDS] + [("q4_0", "q8_0", "nf4"), ("fp16", "q4_0", "q8_0")])
def test_streams_stay_in_sync(kinds):
    """truncate/reset/reorder move k_sem, k_geo and v together; reads after them equal a fresh
    cache fed the same tokens."""
    k, v = randn(3, 2, 10, SEM + GEO, seed=4), randn(3, 2, 10, 16, seed=5)
    cache = decoupled_cache(kinds)
    cache.update(k[:, :, :6], v[:, :, :6])
    cache.truncate(4)
    assert cache.length == 4
    keys, values = cache.update(k[:, :, 4:10], v[:, :, 4:10])
    fresh = decoupled_cache(kinds)
    f_keys, f_values = fresh.update(k, v)
    assert keys.shape == (3, 2, 10, SEM + GEO) and values.shape == (3, 2, 10, 16)
    assert torch.equal(keys, f_keys) and torch.equal(values, f_values)
    index = torch.tensor([2, 0])
    cache.reorder(index)
    assert cache.batch_size == 2 and all(s.tensors()[0].shape[0] == 2 for s in cache.streams)
    cache.truncate(7)
    keys2, values2 = cache.update(k[index][:, :, 7:8], v[index][:, :, 7:8])
    assert torch.equal(keys2, f_keys[index][:, :, :8]) and torch.equal(values2, f_values[index][:, :, :8])
    cache.reset()
    assert cache.length == 0
    keys3, _ = cache.update(k[index][:, :, :2], v[index][:, :, :2])
    assert torch.equal(keys3, f_keys[index][:, :, :2])
    with pytest.raises(ValueError, match="cannot truncate"):
        cache.truncate(5)


@pytest.mark.parametrize("kinds", [("q8_0", "q8_0", "q8_0"), ("q4_0", "q8_0", "q4_0"), ("nf4", "fp16", "q8_0")])
@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("residual_len", [0, 3])
def test_chunked_read_equals_dequantize_then_sdpa(kinds, rotate, residual_len, read_path, monkeypatch):
    """The short-forward path (each key stream read where it lies, scores added) equals SDPA over
    the dequantized [sem | geo] keys, in small chunks too."""
    import caramba.cache.attend as attend

    monkeypatch.setattr(attend, "READ_CHUNK", 4)
    k, v = randn(3, 2, 11, SEM + GEO, seed=6), randn(3, 2, 11, 16, seed=7)
    q = randn(3, 4, 2, SEM + GEO, seed=8)
    a = decoupled_cache(kinds, rotate=rotate, residual_len=residual_len)
    b = decoupled_cache(kinds, rotate=rotate, residual_len=residual_len)
    a.update(k[:, :, :9], v[:, :, :9])
    keys, values = b.update(k, v)
    mask = torch.ones(3, 1, 2, 11, dtype=torch.bool)
    mask[0, :, :, 3] = False
    mask[:, :, 0, 10] = False
    got = a.attend(q, k[:, :, 9:], v[:, :, 9:], mask, False)
    expected = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(got, expected, **tolerance.attention(expected, q.shape[-1], 11))


def test_overflow_and_widths_are_checked():
    cache = decoupled_cache(("fp32",) * 3, S=4)
    with pytest.raises(ValueError, match="overflows"):
        cache.update(randn(3, 2, 5, SEM + GEO), randn(3, 2, 5, 16))
    assert cache.length == 0
    with pytest.raises(ValueError, match="must divide into 2 heads"):
        DecoupledLayerKVCache(1, 4, 3, 4, 4, *(KVCacheTensorConfig(),) * 3, n_kv_heads=2)


@pytest.mark.parametrize("spec", ["fp32", "fp16", "q8_0", "q4_0", "nf4", "k_sem=q4_0,k_geo=q8_0,v=nf4"])
@pytest.mark.parametrize("residual_len", [0, 4])
def test_bytes_per_token_formula_equals_allocation(spec, residual_len):
    model = dba_model()
    policy = CachePolicy.build("fp16", spec, qblock=8, residual_len=residual_len) if "=" in spec else \
        CachePolicy.build(spec, qblock=8, residual_len=residual_len)
    B, S = 2, 24
    cache = model.new_cache(B, S, policy)
    kvh, L = TINY["n_kv_heads"], TINY["n_layers"]

    def stream_bytes(cfg, width):   # bits per element + one fp16 scale per block, per token and head
        scales = width // min(8, width) * 2 if cfg.quantized else 0
        return width * cfg.kind.bits // 8 + scales

    per_token = B * L * kvh * (stream_bytes(policy.k_sem, SEM) + stream_bytes(policy.k_geo, GEO)
                               + stream_bytes(policy.v, TINY["head_dim"]))
    assert cache.bytes_per_token() == per_token
    ring = sum(B * kvh * residual_len * w * 4 for cfg, w in ((policy.k_sem, SEM), (policy.k_geo, GEO),
                                                              (policy.v, TINY["head_dim"])) if cfg.quantized)
    assert cache.nbytes == S * per_token + L * ring


def test_seed_table_on_paper():
    """docs/kv-cache.md: standard d=2048 (16 heads of 128) vs DBA sem=128, geo=256 in total (one
    KV head of 384 key channels), values at full width: K+V bytes per token and layer."""
    std = ModelConfig(dim=2048, n_layers=1, n_heads=16, n_kv_heads=16, head_dim=128, vocab_size=8)
    dba = ModelConfig(dim=2048, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=2048, sem_dim=128, geo_dim=256,
                      attention="decoupled", vocab_size=8)
    from caramba.model.transformer import Transformer

    with torch.device("meta"):
        assert Transformer(std).new_cache(1, 1, "fp16").bytes_per_token() == 8192
        assert Transformer(dba).new_cache(1, 1, "fp16").bytes_per_token() == 768 + 4096
        assert Transformer(dba).new_cache(1, 1, "q8_0").bytes_per_token() == 408 + 2176


# ---- policies -------------------------------------------------------------------------------------

def test_policy_streams_and_the_geometric_floor():
    p = CachePolicy.build("q4_0")
    assert (p.k_sem.kind.value, p.k_geo.kind.value, p.v.kind.value) == ("q4_0", "q8_0", "q4_0")
    assert CachePolicy.build("nf4").k_geo.kind.value == "q8_0"
    assert CachePolicy.build("fp16").k_geo.kind.value == "fp16"
    assert CachePolicy.build("q8_0").k_geo.kind.value == "q8_0"
    explicit = CachePolicy.build("q4_0", "k_geo=q4_0")
    assert explicit.k_geo.kind.value == "q4_0"
    mixed = CachePolicy.build("fp16", {"k_sem": "q4_0", "v": "q8"})
    assert (mixed.k_sem.kind.value, mixed.k_geo.kind.value, mixed.v.kind.value) == ("q4_0", "fp16", "q8_0")
    assert p.describe(decoupled=True) == "k_sem=q4_0,k_geo=q8_0,v=q4_0"
    assert p.describe() == "q4_0"
    assert CachePolicy.build("q8_0").describe(decoupled=True) == "q8_0"
    assert mixed.to_dict()["k_sem"] == "q4_0" and "k_sem" not in CachePolicy.build("q4_0", "k=q8_0").to_dict()
    layer0 = CachePolicy.build("q4_0", fp16_prefix_layers=1).stream_configs(0, decoupled=True)
    assert [c.kind.value for c in layer0] == ["fp16"] * 3


def test_policy_errors_name_the_streams_that_exist(model):
    with pytest.raises(ValueError, match=r"unknown stream\(s\) 'q'.*k, v \(standard.*k_sem, k_geo, v"):
        parse_policy("q=q8_0")
    with pytest.raises(ValueError, match="both k .* and k_sem/k_geo"):
        parse_policy("k=q8_0,k_geo=q8_0")
    with pytest.raises(ValueError, match="names k_sem, which a standard-attention model does not cache; its streams are k, v"):
        model.new_cache(1, 4, CachePolicy.build("fp32", "k_sem=q8_0"))
    with pytest.raises(ValueError, match="names k, which a decoupled \\(DBA\\) model does not cache; its streams are k_sem, k_geo, v"):
        dba_model().new_cache(1, 4, CachePolicy.build("fp32", "k=q8_0"))
    gen = Generator(dba_model(), GenerateConfig(max_new_tokens=2, cache_policy="k=q8_0"))
    with pytest.raises(ValueError, match="k_sem, k_geo, v"):
        gen.generate([[1, 2, 3]])


def test_config_validation():
    with pytest.raises(ValueError, match="attention='sparse'"):
        tiny_config(attention="sparse")
    with pytest.raises(ValueError, match="sem_dim/geo_dim are for attention: decoupled"):
        tiny_config(sem_dim=8)
    with pytest.raises(ValueError, match="even geo_dim"):
        tiny_config(attention="decoupled", sem_dim=8, geo_dim=7)
    with pytest.raises(ValueError, match="sem_dim >= 1"):
        tiny_config(attention="decoupled", sem_dim=0, geo_dim=8)
    with pytest.raises(ValueError, match="geo_dim=18 must be <= head_dim=16"):
        tiny_config(attention="decoupled", sem_dim=4, geo_dim=18)
    cfg = tiny_config(**DBA)
    assert ModelConfig.from_dict(json.loads(cfg.to_json())) == cfg


# ---- generation -----------------------------------------------------------------------------------

@torch.no_grad()
def greedy_without_cache(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


POLICIES = {"fp32": {}, "q8_0": {"cache_kind": "q8_0"}, "q4_0": {"cache_kind": "q4_0"}, "nf4": {"cache_kind": "nf4"},
            "mixed": {"cache_kind": "q4_0", "cache_policy": {"k_geo": "fp16", "v": "q8_0"}, "qblock": 8}}


@pytest.mark.parametrize("name", list(POLICIES))
def test_generation_on_every_kind(prompts, name):
    model = dba_model()
    cfg = GenerateConfig(max_new_tokens=8, temperature=0.0, max_seq_len=32, **POLICIES[name])
    batched = Generator(model, cfg).run(prompts).sequences
    alone = [Generator(model, cfg).run([p]).sequences[0] for p in prompts]
    assert batched == alone                                    # padding-safe on this kind
    if name == "fp32":
        assert batched == [greedy_without_cache(model, p, 8) for p in prompts]
    if name == "mixed":
        cache = model.new_cache(1, 4, cfg.cache_spec())
        assert [s.cfg.kind.value for s in cache.layers[0].streams] == ["q4_0", "fp16", "q8_0"]


def test_multi_turn_beams_and_speculative_rollback(prompts):
    from test_kv_quant import manual_session

    model = dba_model()
    turns = [[7, 3, 9, 11, 2], [40, 41, 42]]
    gen = Generator(model, GenerateConfig(max_new_tokens=6, temperature=0.0, max_seq_len=40, cache_kind="q4_0"))
    assert [gen.run([t]).sequences[0] for t in turns] == manual_session(model, CachePolicy.build("q4_0"), turns, 6)
    cfg = GenerateConfig(max_new_tokens=6, temperature=0.0, max_seq_len=40, cache_kind="q8_0")
    plain = Generator(model, cfg).generate(prompts)
    spec = SpeculativeGenerator(model, config=SpeculativeConfig(max_new_tokens=6, temperature=0.0, max_seq_len=40,
                                                                cache_kind="q8_0", draft="self_int8"))
    assert torch.equal(spec.generate(prompts), plain)   # truncate after rejections keeps every stream in step
    assert spec.stats.proposed > 0
    beams = beam_search(model, prompts[:2], GenerateConfig(max_new_tokens=5, max_seq_len=40, cache_kind="q4_0"),
                        num_beams=3)
    assert len(beams.sequences) == 2


# ---- conversion -----------------------------------------------------------------------------------

# TINY's 8 RoPE pairs: 0-3 turn at theta^(-2i/16), 4-7 are slowed 1e30-fold (they never turn), so
# dropping their rotation changes nothing and an uncompressed conversion must be exact.
STILL = {"rope_scaling": {"rope_type": "factors", "factors": [1.0] * 4 + [1e30] * 4}}


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("calibrated", [False, True])
def test_uncompressed_conversion_reproduces_the_logits(bias, calibrated):
    source = make_model(qkv_bias=bias, **STILL)
    t = tokens(2, 30, seed=9)
    moments = input_moments(source, tokens(1, 64, seed=10)) if calibrated else None
    conv = convert_state(source.config, source.state_dict(), sem_dim=8, geo_dim=8, moments=moments)
    assert conv.sem_energy == pytest.approx(1.0)
    dba = build_model(conv.config, conv.state, torch.float32, torch.device("cpu"))
    assert dba.config.attention == "decoupled"
    torch.testing.assert_close(dba(t), source(t), **tolerance.forward(source(t), source.config))   # same function, refactored weights
    # Through a cache, token by token, too.
    cache = dba.new_cache(2, 30, "fp32")
    steps = torch.cat([dba(t[:, :10], cache=cache)] + [dba(t[:, i : i + 1], cache=cache) for i in range(10, 30)], dim=1)
    torch.testing.assert_close(steps, source(t), **tolerance.forward(source(t), source.config))


def test_dropping_rope_on_turning_pairs_changes_the_model():
    """With ordinary RoPE the semantic pairs do turn: the conversion is then an approximation."""
    source = make_model()
    conv = convert_state(source.config, source.state_dict(), sem_dim=8, geo_dim=8)
    dba = build_model(conv.config, conv.state, torch.float32, torch.device("cpu"))
    t = tokens(1, 30, seed=11)
    assert float((dba(t) - source(t)).abs().max()) > 1e-2


def test_whitening_beats_weight_space_svd():
    """Compressed, the SVD weighted by the inputs' statistics is closer on those inputs."""
    source = make_model(**STILL)
    t = tokens(2, 48, seed=12)
    ref = torch.log_softmax(source(t), -1)

    def kl(moments):
        conv = convert_state(source.config, source.state_dict(), sem_dim=3, geo_dim=8, moments=moments)
        lp = torch.log_softmax(build_model(conv.config, conv.state, torch.float32, torch.device("cpu"))(t), -1)
        return float((ref.exp() * (ref - lp)).sum(-1).mean())

    assert kl(input_moments(source, t)) < kl(None)


def test_compressed_conversion_saves_loads_and_generates(tmp_path):
    from test_cli import write_tiny_model

    src = write_tiny_model(tmp_path / "src")
    loaded = load_model(str(src))
    from caramba.model.dba_convert import convert_loaded

    calibration = loaded.tokenizer.encode("the quick brown fox jumps over the lazy dog " * 8)
    conv = convert_loaded(loaded, sem_dim=2, geo_dim=4, out=tmp_path / "dba", calibration=calibration)
    assert is_native_dir(tmp_path / "dba") and not is_native_dir(src)
    again = load_model(str(tmp_path / "dba"))
    cfg = again.model.config
    assert (cfg.attention, cfg.sem_dim, cfg.geo_dim) == ("decoupled", 2, 4)
    t = torch.tensor([calibration[:20]])
    in_memory = build_model(conv.config, conv.state, torch.float32, torch.device("cpu"))
    assert torch.equal(again.model(t), in_memory(t))
    assert again.tokenizer.encode("hello") == loaded.tokenizer.encode("hello")
    out = Generator(again.model, GenerateConfig(max_new_tokens=5, temperature=0.0, cache_kind="q4_0")).generate([calibration[:6]])
    assert out.shape == (1, 11)
    # The same through save_native/read_native directly.
    save_native(tmp_path / "copy", conv.config, conv.state, loaded.tokenizer)
    cfg2, state2, _ = read_native(tmp_path / "copy")
    assert cfg2.sem_dim == 2 and torch.equal(state2["layers.0.attn.wqkv.weight"], conv.state["layers.0.attn.wqkv.weight"])


def test_conversion_input_checks():
    cfg = tiny_config()
    with pytest.raises(ValueError, match="--geo-dim 7"):
        check_dims(cfg, 4, 7)
    with pytest.raises(ValueError, match="--geo-dim 16"):
        check_dims(cfg, 4, 16)
    with pytest.raises(ValueError, match=r"--sem-dim 9: need 1..8"):
        check_dims(cfg, 9, 8)
    with pytest.raises(ValueError, match="already uses decoupled"):
        check_dims(tiny_config(**DBA), 4, 8)


def test_convert_dba_cli(tmp_path):
    from test_cli import invoke, write_tiny_model

    src = write_tiny_model(tmp_path / "src")
    corpus = tmp_path / "calib.txt"
    corpus.write_text("a few words of calibration text, repeated. " * 10)
    res = invoke("convert-dba", "--model", src, "--sem-dim", 2, "--geo-dim", 4, "--out", tmp_path / "dba",
                 "--calib-text", corpus)
    assert res.exit_code == 0, res.output
    assert "wrote" in res.output and "bytes/token" in res.output
    res = invoke("convert-dba", "--model", src, "--sem-dim", 2, "--geo-dim", 4, "--out", tmp_path / "dba")
    assert res.exit_code == 2 and "--force" in res.output
    res = invoke("convert-dba", "--model", src, "--sem-dim", 9, "--geo-dim", 4, "--out", tmp_path / "x",
                 "--calib-tokens", 0)
    assert res.exit_code == 2 and "--sem-dim 9" in res.output and not (tmp_path / "x").exists()
    res = invoke("generate", "hello", "--model", tmp_path / "dba", "--max-new-tokens", 3, "--cache-policy",
                 "k_sem=q4_0,k_geo=q8_0,v=q4_0", "--json")
    assert res.exit_code == 0, res.output
    res = invoke("generate", "hello", "--model", tmp_path / "dba", "--max-new-tokens", 3, "--cache-policy", "k=q8_0")
    assert res.exit_code == 2 and "k_sem, k_geo, v" in res.output


@pytest.mark.parametrize("kind, residual_len", [("fp32", 0), ("q4_0", 0), ("q4_0", 4)])
def test_auto_batch_row_cost_counts_the_decoupled_cache(kind, residual_len):
    from caramba.infer.batched import row_cost_bytes

    model = dba_model()
    cfg = GenerateConfig(max_seq_len=48, cache_kind=kind, qblock=8, residual_len=residual_len)
    assert row_cost_bytes(model, cfg, prompt_len=10)["cache_bytes"] == model.new_cache(1, 48, cfg.cache_spec()).nbytes


def test_eval_cli_on_a_converted_model(tmp_path):
    from test_cli import invoke, write_tiny_model

    src = write_tiny_model(tmp_path / "src")
    text = tmp_path / "t.txt"
    text.write_text("some text to score, a few dozen bytes long at least. " * 3)
    assert invoke("convert-dba", "--model", src, "--sem-dim", 4, "--geo-dim", 4, "--out", tmp_path / "dba",
                  "--calib-text", text).exit_code == 0
    res = invoke("eval", "--model", tmp_path / "dba", "--text", text, "--prompt-len", 8, "--max-tokens", 24,
                 "--cache-kind", "q4_0", "--json")
    assert res.exit_code == 0, res.output
    result = json.loads(res.output)["results"][0]
    assert result["policy"] == "k_sem=q4_0,k_geo=q8_0,v=q4_0"
    res = invoke("eval", "--model", src, "--text", text, "--prompt-len", 8, "--cache-policy", "k_sem=q8_0")
    assert res.exit_code == 2 and "its streams are k, v" in res.output


def test_convert_dba_summary_picks_a_qblock_that_divides_every_stream():
    from caramba.cli import _cache_bytes_per_token

    cfg = tiny_config(head_dim=64, attention="decoupled", sem_dim=16, geo_dim=48)   # 48 = 1.5 blocks of 32
    kvh, L = TINY["n_kv_heads"], TINY["n_layers"]
    assert _cache_bytes_per_token(cfg, "q8_0") == (L * kvh * ((16 + 2) + (48 + 3 * 2) + (64 + 4 * 2)), 16)
    assert _cache_bytes_per_token(cfg, "fp16") == (L * kvh * 2 * 128, 32)
