"""caramba.cache.sdpa: a fresh causal prefill's attention in query blocks through oneDNN's GEMM
agrees with torch's SDPA to fp32 rounding, and everything else goes to SDPA itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from caramba import fused, gemm
from caramba.cache import sdpa
import tolerance as tol

U = 2.0 ** -24   # fp32's unit roundoff
needs_onednn = pytest.mark.skipif(not gemm.available(), reason="torch built without mkldnn, or CARAMBA_ONEDNN=0")


@pytest.fixture(autouse=True)
def small_thresholds(request, monkeypatch):
    """The arithmetic at small sizes: the thresholds (where the blocks win on speed) lowered,
    except where a test checks them."""
    if "thresholds" not in request.node.name:
        monkeypatch.setattr(sdpa, "MIN_TOKENS", 64)
        monkeypatch.setattr(sdpa, "MIN_CHUNK", 64)


@pytest.fixture(autouse=True, params=["c", "torch"])
def softmax(request, monkeypatch):
    """Every test with the blocks' mask and softmax in one C pass (caramba.fused) and with torch's
    masked_fill and softmax (where the kernels cannot be built)."""
    if request.param == "torch":
        monkeypatch.setattr(fused, "available", lambda: False)
    elif not fused.available():
        pytest.skip(f"fused kernels {fused.status()}")
    return request.param


@needs_onednn
def test_the_thresholds_send_short_prompts_and_short_chunks_to_sdpa():
    """A prompt takes the blocks from MIN_TOKENS queries, a chunk after cached keys from MIN_CHUNK."""
    def applies(T, S):
        q, k = torch.randn(1, 4, T, 8), torch.randn(1, 2, S, 8)
        mask = None if T == S else torch.ones(T, S, dtype=torch.bool).tril(S - T)[None, None]
        return sdpa.blocked_applies(q, k, k, mask, T == S)
    m, c = sdpa.MIN_TOKENS, sdpa.MIN_CHUNK
    assert [applies(m - 1, m - 1), applies(m, m)] == [False, True]
    assert [applies(c - 1, c + 100), applies(c, c + 100)] == [False, True]


def exact(q, k, v):
    """Causal grouped-query attention in float64, the T queries the last of the S keys' slots:
    the reference both fp32 results are held to."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    s = q.double() @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    T, S = q.shape[2], k.shape[2]
    s = s.masked_fill(~torch.ones(T, S, dtype=torch.bool).tril(S - T), float("-inf"))
    return torch.softmax(s, -1) @ v


@needs_onednn
@pytest.mark.parametrize("B,H,KVH,T,D", [(1, 9, 3, 64, 64), (2, 4, 2, 129, 16), (1, 6, 6, 300, 32), (1, 8, 1, 257, 8)])
def test_blocked_causal_attention_is_sdpa_within_rounding(B, H, KVH, T, D):
    """Blocks that end inside the last one, one KV head for all, as many as the queries; the
    queries and keys strided views of a fused q|k|v projection as the model makes them."""
    g = torch.Generator().manual_seed(T * H + D)
    qkv = torch.randn(B, T, H + 2 * KVH, D, generator=g).transpose(1, 2)      # [B, heads, T, D], strided
    q, k, v = qkv[:, :H], qkv[:, H:H + KVH], qkv[:, H + KVH:]
    assert sdpa.blocked_applies(q, k, v, None, True)
    got = sdpa.attention(q, k, v, None, True)
    want = exact(q, k, v)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    # a softmax-weighted mean of values: each output's error is a few roundings of the scores'
    # sums (D terms, scaled by the values' size) and of the mean over T keys
    bound = (D + T + 8) * U * v.abs().amax()
    assert (got.double() - want).abs().max() <= bound
    assert (ref.double() - want).abs().max() <= bound
    assert got.shape == ref.shape and got.dtype == torch.float32


@needs_onednn
@pytest.mark.parametrize("T,S", [(64, 200), (130, 130 + 512), (300, 301)])
def test_a_chunk_after_the_cached_ones_takes_the_blocks_too(T, S):
    """T queries at the end of S keys, the mask a chunked prefill builds (causal, offset by the
    cached chunks): the blocks see each query's keys up to its own slot."""
    g = torch.Generator().manual_seed(T + S)
    q, k, v = torch.randn(2, 6, T, 32, generator=g), torch.randn(2, 2, S, 32, generator=g), torch.randn(2, 2, S, 32, generator=g)
    mask = torch.ones(T, S, dtype=torch.bool).tril(S - T).expand(2, 1, T, S)
    assert sdpa.causal_offset(mask, False, T, S) == (S - T, False)
    assert sdpa.blocked_applies(q, k, v, mask, False)
    got = sdpa.attention(q, k, v, mask, False)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    bound = (32 + S + 8) * U * v.abs().amax()
    want = exact(q, k, v)
    assert (got.double() - want).abs().max() <= bound and (ref.double() - want).abs().max() <= bound


@needs_onednn
@pytest.mark.parametrize("batch_of_mask", [2, 1])
def test_left_padded_rows_and_windows_take_the_blocks_with_their_mask(batch_of_mask):
    """The mask a padded batch's chunk gets (a padding query sees only itself) and a sliding
    window's, both hiding only what causal attention would show: applied block by block."""
    T, S, W = 100, 160, 40
    g = torch.Generator().manual_seed(7)
    q, k, v = torch.randn(2, 4, T, 16, generator=g), torch.randn(2, 2, S, 16, generator=g), torch.randn(2, 2, S, 16, generator=g)
    q_slot, k_slot = torch.arange(S - T, S)[:, None], torch.arange(S)[None, :]
    causal = (k_slot <= q_slot).expand(2, T, S)
    valid = torch.ones(2, S, dtype=torch.bool)
    valid[1, :70] = False                                        # row 1: 70 slots of left padding
    mask = ((causal & valid[:, None, :]) | (k_slot == q_slot)) & (k_slot > q_slot - W)
    mask = mask.unsqueeze(1)[:batch_of_mask]
    assert sdpa.causal_offset(mask, False, T, S) == (S - T, True)
    got = sdpa.attention(q, k, v, mask, False)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(got, ref, atol=(16 + S + 8) * 2 * U * float(v.abs().amax()), rtol=0)


@pytest.mark.parametrize("case", ["a later key", "a query seeing nothing", "mask of SDPA's causal", "not causal", "short",
                                  "cached", "grad", "float64", "switched off"])
def test_everything_else_goes_to_sdpa(case, monkeypatch):
    q, k, v = torch.randn(1, 4, 80, 16), torch.randn(1, 2, 80, 16), torch.randn(1, 2, 80, 16)
    mask, causal = None, True
    if case in ("a later key", "a query seeing nothing"):
        mask = torch.ones(80, 80, dtype=torch.bool).tril().expand(1, 1, 80, 80).clone()
        if case == "a later key":
            mask[..., 5, 6] = True
        else:
            mask[..., 5, :] = False
        causal = False
    elif case == "mask of SDPA's causal":   # a mask and is_causal together: SDPA's business
        mask = torch.ones(1, 1, 80, 80, dtype=torch.bool).tril()
    elif case == "not causal":
        causal = False
    elif case == "short":
        q, k, v = q[:, :, :sdpa.MIN_TOKENS - 1], k[:, :, :sdpa.MIN_TOKENS - 1], v[:, :, :sdpa.MIN_TOKENS - 1]
    elif case == "cached":   # queries after tokens already in a cache: not a fresh prefill's square
        q = q[:, :, 40:]
    elif case == "grad":
        q.requires_grad_(True)
    elif case == "float64":
        q, k, v = q.double(), k.double(), v.double()
    else:
        monkeypatch.setattr(gemm, "_available", False)
    assert not sdpa.blocked_applies(q, k, v, mask, causal)
    calls = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    sdpa.attention(q, k, v, mask, causal)
    assert calls == [1]


@needs_onednn
def test_a_prefill_takes_the_blocked_path_and_decodes_as_before(tiny, monkeypatch):
    """The model's prompt (no cache, into a fresh cache, and in chunks of 64 into a cache) goes
    through the blocks; its logits stay within rounding of SDPA's."""
    model = tiny(seed=4, max_position_embeddings=512)
    ids = torch.randint(0, model.config.vocab_size, (2, 150), generator=torch.Generator().manual_seed(5))
    taken = []
    real = sdpa.blocked_applies
    monkeypatch.setattr(sdpa, "blocked_applies", lambda *a: taken.append(real(*a)) or taken[-1])
    with torch.inference_mode():
        got = model(ids)
        cache = model.new_cache(2, 160)
        cached = model(ids, cache=cache)
        cache = model.new_cache(2, 160)
        chunks = torch.cat([model(ids[:, i:i + 64], cache=cache) for i in range(0, 150, 64)], 1)
        n = len(taken)
        monkeypatch.setattr(sdpa, "blocked_applies", lambda *a: False)
        want = model(ids)
    L = model.config.n_layers   # calls: 2 prompts whole and 3 chunks, each once per layer
    assert n == 5 * L and all(taken[:4 * L]) and not any(taken[4 * L:])   # the last chunk: 22 queries, SDPA
    bound = tol.forward(want, model.config)
    torch.testing.assert_close(got, want, **bound)
    torch.testing.assert_close(cached, want, **bound)
    torch.testing.assert_close(chunks, want, **bound)


def test_transposed_keys_reach_sdpa_with_contiguous_rows(monkeypatch):
    """Keys read back transposed (a keys-major q8_0 stream's codes, converted): SDPA gets them
    (and values alike) with their last dim contiguous, which its fused CPU kernel needs (else it
    falls back to its math path), and the output is the contiguous keys' bit for bit."""
    q, k, v = torch.randn(2, 6, 40, 16), torch.randn(2, 2, 16, 120).transpose(-1, -2), torch.randn(2, 2, 120, 16)
    mask = torch.rand(2, 1, 40, 120) > 0.3
    mask[..., 0] = True
    strides = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: strides.append((k.stride(-1), v.stride(-1))) or real(q, k, v, **kw))
    got = sdpa.attention(q, k, v, mask, False)
    assert strides == [(1, 1)] and k.stride(-1) != 1
    assert torch.equal(got, sdpa.attention(q, k.contiguous(), v, mask, False))


def test_a_quantized_caches_question_hands_sdpa_contiguous_keys(monkeypatch):
    """A question over a quantized cache (more than CHUNKED_MAX_T tokens: its keys and values read
    back whole) reaches SDPA with contiguous rows, whatever layout the stream keeps its codes in."""
    from caramba.cache import LayerKVCache
    from caramba.cache.kinds import KVCacheTensorConfig
    from caramba.cache.layer import CHUNKED_MAX_T

    cfg = KVCacheTensorConfig("q8_0", 32, 0)
    layer = LayerKVCache(2, 128, 64, 64, cfg, cfg, torch.device("cpu"), 2)
    layer.extend(torch.randn(2, 2, 60, 32), torch.randn(2, 2, 60, 32))
    assert layer.k_stream.keys_major
    T = CHUNKED_MAX_T + 4
    strides = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: strides.append((k.stride(-1), v.stride(-1))) or real(q, k, v, **kw))
    mask = torch.ones(2, 1, T, 60 + T, dtype=torch.bool).tril(60)
    layer.attend(torch.randn(2, 4, T, 32), torch.randn(2, 2, T, 32), torch.randn(2, 2, T, 32), mask, False)
    assert strides == [(1, 1)]
