"""KV cache: layout, update/truncate/reset, overflow, byte accounting, kinds, half-precision storage."""

from __future__ import annotations

import pytest
import torch

from caramba.cache import CacheOverflowError, KVCache, KVCacheKind, KVCacheTensorConfig, LayerKVCache
from caramba.infer import GenerateConfig, Generator
import tolerance as tol
from conftest import TINY, make_model

V = TINY["vocab_size"]
KINDS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def layer_cache(kind: str = "fp32", B: int = 2, S: int = 10, heads: int = 2, head_dim: int = 4) -> LayerKVCache:
    cfg = KVCacheTensorConfig(kind)
    return LayerKVCache(B, S, heads * head_dim, heads * head_dim, cfg, cfg, "cpu", heads)


def kv(B: int = 2, heads: int = 2, T: int = 3, head_dim: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, heads, T, head_dim, generator=g), torch.randn(B, heads, T, head_dim, generator=g)


def tokens(B: int, T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


# ---- LayerKVCache --------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_layer_cache_layout(kind):
    c = layer_cache(kind, B=3, S=7, heads=2, head_dim=5)
    assert c.k.shape == c.v.shape == (3, 2, 7, 5)           # [B, kv_heads, max_seq_len, head_dim]
    assert c.k.dtype == c.v.dtype == KINDS[kind]
    assert c.length == 0 and c.max_seq_len == 7 and c.batch_size == 3


def test_layer_cache_rejects_widths_that_do_not_split_into_heads():
    cfg = KVCacheTensorConfig("fp32")
    with pytest.raises(ValueError, match="must divide into 3 heads"):
        LayerKVCache(1, 4, 8, 8, cfg, cfg, "cpu", 3)


def test_update_appends_and_returns_the_whole_prefix():
    c = layer_cache()
    k1, v1 = kv(T=3, seed=1)
    k, v = c.update(k1, v1)
    assert c.length == 3 and k.shape == (2, 2, 3, 4)
    assert torch.equal(k, k1) and torch.equal(v, v1)
    k2, v2 = kv(T=2, seed=2)
    k, v = c.update(k2, v2)
    assert c.length == 5 and k.shape == v.shape == (2, 2, 5, 4)
    assert torch.equal(k, torch.cat([k1, k2], dim=2)) and torch.equal(v, torch.cat([v1, v2], dim=2))
    assert torch.equal(c.k[:, :, :5], k) and not c.k[:, :, 5:].any()   # written in place, rest untouched


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_update_stores_in_the_kind_and_returns_in_the_input_dtype(kind):
    c = layer_cache(kind)
    k1, v1 = kv(T=3)
    k, v = c.update(k1, v1)
    assert c.k.dtype == KINDS[kind] and k.dtype == v.dtype == torch.float32
    assert torch.equal(k, k1.to(KINDS[kind]).float())        # rounded once, to the storage dtype
    assert torch.equal(v, v1.to(KINDS[kind]).float())


def test_overflow_raises_and_leaves_the_cache_unchanged():
    c = layer_cache(S=5)
    c.update(*kv(T=4))
    k_before, v_before = c.k.clone(), c.v.clone()
    with pytest.raises(CacheOverflowError, match="holds 5 tokens"):
        c.update(*kv(T=2, seed=9))
    assert c.length == 4
    assert torch.equal(c.k, k_before) and torch.equal(c.v, v_before)
    c.update(*kv(T=1, seed=9))  # exactly full is fine
    assert c.length == 5
    assert issubclass(CacheOverflowError, ValueError)


def test_truncate_and_reset():
    c = layer_cache()
    k1, v1 = kv(T=6, seed=1)
    c.update(k1, v1)
    c.truncate(4)
    assert c.length == 4
    k2, v2 = kv(T=2, seed=2)
    k, _ = c.update(k2, v2)                                   # overwrites slots 4, 5
    assert torch.equal(k, torch.cat([k1[:, :, :4], k2], dim=2))
    with pytest.raises(ValueError, match="cannot truncate a cache of 6 tokens to 7"):
        c.truncate(7)
    with pytest.raises(ValueError):
        c.truncate(-1)
    c.reset()
    assert c.length == 0
    k, _ = c.update(k2, v2)
    assert torch.equal(k, k2)


def test_reorder_gathers_batch_rows():
    c = layer_cache(B=3)
    k1, v1 = kv(B=3, T=2)
    c.update(k1, v1)
    c.reorder(torch.tensor([2, 0]))
    assert c.batch_size == 2 and c.k.shape[0] == 2
    assert torch.equal(c.k[:, :, :2], k1[[2, 0]]) and torch.equal(c.v[:, :, :2], v1[[2, 0]])


# ---- byte accounting -----------------------------------------------------------------------------

@pytest.mark.parametrize("kind,size", [("fp32", 4), ("fp16", 2), ("bf16", 2)])
def test_nbytes_is_exact(kind, size):
    model = make_model(n_layers=3)
    B, S = 2, 11
    cache = model.new_cache(B, S, kind)
    kvh, hd = model.config.n_kv_heads, model.config.head_dim
    assert KVCacheTensorConfig(kind).bytes_per_element() == size
    assert cache.layers[0].nbytes == B * kvh * S * hd * 2 * size
    assert cache.nbytes == B * kvh * S * hd * 2 * size * 3
    assert cache.bytes_per_token() == B * kvh * hd * 2 * size * 3
    assert cache.nbytes == sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.k, layer.v))


# ---- kinds ---------------------------------------------------------------------------------------

def test_kind_parse():
    assert KVCacheKind.parse("FP16") is KVCacheKind.FP16
    assert KVCacheKind.parse(KVCacheKind.BF16) is KVCacheKind.BF16
    assert KVCacheTensorConfig("bf16").dtype == torch.bfloat16
    with pytest.raises(ValueError) as e:
        KVCacheKind.parse("q3_k")
    assert "'q3_k'" in str(e.value) and "fp32, fp16, bf16" in str(e.value)
    with pytest.raises(ValueError, match="valid kinds"):
        KVCacheTensorConfig("int8")
    with pytest.raises(ValueError, match="valid kinds"):
        make_model().new_cache(1, 4, "nope")
    with pytest.raises(ValueError, match="valid kinds: fp32"):
        GenerateConfig(cache_kind="fp8")


# ---- the model's cache ---------------------------------------------------------------------------

def test_model_cache_layers_advance_together(model):
    cache = model.new_cache(2, 9)
    assert isinstance(cache, KVCache) and len(cache.layers) == TINY["n_layers"]
    model(tokens(2, 4), cache=cache)
    assert cache.length == 4 and all(layer.length == 4 for layer in cache.layers)
    assert cache.max_seq_len == 9 and cache.batch_size == 2


def test_model_forward_overflow_raises_before_touching_the_cache(model):
    cache = model.new_cache(1, 6)
    model(tokens(1, 4), cache=cache)
    snapshot = [(layer.k.clone(), layer.v.clone()) for layer in cache.layers]
    with pytest.raises(CacheOverflowError, match="4 cached \\+ 3 new tokens exceed max_seq_len=6"):
        model(tokens(1, 3, seed=1), cache=cache)
    assert cache.length == 4
    for layer, (k, v) in zip(cache.layers, snapshot):
        assert layer.length == 4 and torch.equal(layer.k, k) and torch.equal(layer.v, v)


def test_truncate_rolls_back_as_if_the_tokens_were_never_seen(model):
    """Speculative decoding's rollback: decode after truncate == decode that never had the tokens."""
    prefix, rejected, accepted = tokens(2, 6, seed=1), tokens(2, 4, seed=2), tokens(2, 5, seed=3)

    clean = model.new_cache(2, 20)
    model(prefix, cache=clean)
    expected = torch.cat([model(accepted[:, t : t + 1], cache=clean) for t in range(5)], dim=1)

    cache = model.new_cache(2, 20)
    model(prefix, cache=cache)
    model(rejected, cache=cache)                     # a draft that gets rejected
    model(rejected[:, :1], cache=cache)
    assert cache.length == 11
    cache.truncate(6)
    assert all(layer.length == 6 for layer in cache.layers)
    got = torch.cat([model(accepted[:, t : t + 1], cache=cache) for t in range(5)], dim=1)
    torch.testing.assert_close(got, expected, **tol.forward(expected, model.config))
    # and a chunked (verify) forward after a rollback
    cache.truncate(6)
    torch.testing.assert_close(model(accepted, cache=cache), expected, **tol.forward(expected, model.config))


def test_reset_starts_over(model):
    x = tokens(1, 5)
    cache = model.new_cache(1, 8)
    first = model(x, cache=cache)
    model(tokens(1, 3, seed=4), cache=cache)
    cache.reset()
    assert cache.length == 0
    torch.testing.assert_close(model(x, cache=cache), first, **tol.forward(first, model.config))


@pytest.mark.parametrize("kind,tol", [("fp16", 0.02), ("bf16", 0.08)])
def test_half_precision_cache_logits_are_close_to_fp32(model, kind, tol):
    x = tokens(2, 16, seed=6)
    ref, half = model.new_cache(2, 16, "fp32"), model.new_cache(2, 16, kind)
    assert half.layers[0].k.dtype == KINDS[kind]
    a = [model(x[:, :4], cache=ref)] + [model(x[:, t : t + 1], cache=ref) for t in range(4, 16)]
    b = [model(x[:, :4], cache=half)] + [model(x[:, t : t + 1], cache=half) for t in range(4, 16)]
    a, b = torch.cat(a, 1), torch.cat(b, 1)
    assert b.dtype == torch.float32                   # the model's dtype, not the cache's
    err = (a - b).abs().max() / a.abs().max()
    assert 0 < err < tol                              # really rounded, and only slightly
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_generation_with_half_precision_cache_is_close_to_fp32(model, kind):
    prompt = tokens(1, 6, seed=8)
    steps = {}
    for k in ("fp32", kind):
        gen = Generator(model, GenerateConfig(max_new_tokens=12, temperature=0, max_seq_len=32, cache_kind=k))
        seen_logits = []
        real_forward = gen._forward
        gen._forward = lambda t, m, f=real_forward, log=seen_logits: log.append(f(t, m)) or log[-1]
        out = gen.generate(prompt)
        assert gen.cache.layers[0].k.dtype == KINDS[k]
        steps[k] = (out, torch.stack(seen_logits))
    out32, logits32 = steps["fp32"]
    outh, logitsh = steps[kind]
    # compare the first-step logits (same context for both) and how long the outputs agree
    # one rounding of K/V to half precision: bf16 eps (7.8e-3) x |logits| (~6) ~ 0.05, so 0.1 is two such steps
    torch.testing.assert_close(logitsh[0], logits32[0], atol=0.1, rtol=0.05)
    agree = int((out32[0] == outh[0]).long().cumprod(0).sum())
    assert agree >= 6 + 6, f"{kind} cache diverged from fp32 after {agree - 6} tokens"


# ---- the attention mask ----------------------------------------------------------------------

def _dense_mask(q_slots, k_slots, window=None, valid=None):
    """[B or 1, 1, T, n] by the definition: causal over slots, within the window, real slots only
    (a query always sees itself)."""
    q, k = torch.tensor(q_slots)[:, None], torch.tensor(k_slots)[None, :]
    mask = k <= q
    if window is not None:
        mask &= k > q - window
    if valid is not None:
        mask = (mask & valid[:, k_slots][:, None, :]) | (k == q)
    return (mask if mask.dim() == 3 else mask[None]).unsqueeze(1)


def test_cache_builds_the_mask_over_its_slots(model):
    cache = model.new_cache(2, 20)
    model(tokens(2, 5), cache=cache)
    assert cache.attention_mask(2, 1, None, "cpu") == (None, False)       # one token sees every slot
    valid = torch.tensor([[True] * 8, [False, False] + [True] * 6])     # row 1: left padding
    mask, causal = cache.attention_mask(2, 3, valid, "cpu")
    assert not causal and torch.equal(mask, _dense_mask([5, 6, 7], list(range(8)), valid=valid))
    mask, _ = cache.attention_mask(2, 3, None, "cpu", model_window=4)   # the model's window binds
    assert torch.equal(mask, _dense_mask([5, 6, 7], list(range(8)), window=4).expand(2, -1, -1, -1))
    cache.window = 3
    mask, _ = cache.attention_mask(2, 3, None, "cpu", model_window=4)   # the narrower one
    assert torch.equal(mask, _dense_mask([5, 6, 7], list(range(8)), window=3).expand(2, -1, -1, -1))
    with pytest.raises(ValueError, match="window=5 disagrees with the cache's window=3"):
        cache.attention_mask(2, 1, None, "cpu", window=5)
    with pytest.raises(ValueError, match="disagrees"):
        model(tokens(2, 1), cache=cache, window=5)


def test_ring_cache_masks_keys_in_storage_order(model):
    from caramba.cache.ring import RingKVCache
    W, max_write = 4, 2
    ring = RingKVCache.build(model, 1, W, max_write, "fp32")          # 6 storage slots
    for t in range(9):
        model(tokens(1, 1, seed=t), cache=ring)
    # Slots 0..8 are written; queries at slots 9 and 10 go to storage 3 and 4, so storage i then
    # holds the newest slot s < 11 with s % 6 == i: [6, 7, 8, 9, 10, 5].
    mask, causal = ring.attention_mask(1, 2, None, "cpu")
    assert not causal and torch.equal(mask, _dense_mask([9, 10], [6, 7, 8, 9, 10, 5], window=W))
    with torch.inference_mode():   # and the model's forward over the ring gives the plain cache's logits
        plain = model.new_cache(1, 16)
        plain.window = W
        ids = torch.cat([tokens(1, 1, seed=t) for t in range(9)], dim=1)
        model(ids, cache=plain)
        nxt = tokens(1, 2, seed=20)
        torch.testing.assert_close(model(nxt, cache=ring), model(nxt, cache=plain), atol=1e-5, rtol=1e-5)
