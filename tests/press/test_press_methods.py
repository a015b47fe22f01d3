"""Presses' kept tokens (caramba.press) against a plain-torch reference of every method.

The reference takes the model's own q, k, v of one unchunked forward (its attention inputs,
projected and rotated here with an independent RoPE), builds the full eager attention [H, S, S]
in fp32 and applies kvpress's formulas and top-k rules; caramba's path prefills in chunks smaller
than the context through the observers and must keep exactly the same (layer, head, slot)s.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import make_model
from caramba.infer.pressing import press_masks
from caramba.press import METHODS, PressConfig, kept_masks, n_kept, observing, pyramid_budget

S, WINDOW, CHUNK = 96, 16, 24


@pytest.fixture(scope="module")
def model():
    return make_model(seed=3)


@pytest.fixture(scope="module")
def ids():
    # Distinct tokens: a repeated token has the same layer-0 key norm at every position (RoPE
    # keeps norms), an exact tie whose order is the tie rule's (test_ties_keep_the_later_slot).
    return torch.randperm(97, generator=torch.Generator().manual_seed(7))[:S][None]


def press_of(method: str, ratio: float = 0.5, **kw) -> PressConfig:
    return PressConfig(**{"method": method, "ratio": ratio, "window_size": WINDOW, **kw})


# ---- the reference --------------------------------------------------------------------------

def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def rope_cos_sin(cfg, positions):
    D = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2).float() / D))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


@torch.no_grad()
def reference_qkv(model, ids):
    """Per layer (pre-RoPE q [H, S, D], post-RoPE q, post-RoPE k [KVH, S, D], v) of one
    unchunked forward of the single row ids [1, S]."""
    cfg, inputs = model.config, []
    hooks = [layer.attn.register_forward_pre_hook(lambda mod, args: inputs.append(args[0]))
             for layer in model.layers]
    try:
        model(ids)
    finally:
        for h in hooks:
            h.remove()
    H, KVH, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    cos, sin = rope_cos_sin(cfg, torch.arange(ids.shape[1]))
    out = []
    for layer, x in zip(model.layers, inputs):
        qkv = layer.attn.wqkv(x[0]).view(ids.shape[1], H + 2 * KVH, D).transpose(0, 1)
        q, k, v = qkv[:H], qkv[H:H + KVH], qkv[H + KVH:]
        out.append((q, q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v))
    return out


def attention(q, k):
    """Full causal softmax attention [H, S, S] in fp32, GQA heads sharing KV heads in order."""
    H, L, D = q.shape
    k = k.repeat_interleave(H // k.shape[0], dim=0)
    logits = q @ k.transpose(1, 2) / math.sqrt(D)
    causal = torch.ones(L, L, dtype=torch.bool).triu(1)
    return logits.masked_fill(causal, float("-inf")).softmax(dim=-1, dtype=torch.float32)


def group_mean(x, kvh):
    return x.view(kvh, -1, x.shape[-1]).mean(dim=1)


def reference_scores(method, press, layer, cfg):
    """kvpress's scores [KVH, L] (forced tokens: +inf) from the full attention."""
    q_pre, q, k, v = layer
    KVH, L, D = k.shape
    if method == "knorm":
        return -k.norm(dim=-1)
    if method == "keydiff":
        anchor = F.normalize(k, dim=-1).mean(dim=1, keepdim=True)
        return -F.cosine_similarity(k, anchor, dim=-1)
    A = attention(q, k)
    if method in ("snapkv", "pyramidkv"):
        W, ks = press.window_size, press.kernel_size
        s = A[:, -W:, : L - W].mean(dim=1)
        s = F.avg_pool1d(s[None], ks, stride=1, padding=ks // 2)[0]
        return torch.cat([group_mean(s, KVH), torch.full((KVH, W), float("inf"))], dim=1)
    if method == "tova":
        s = A[:, -1, : L - 1].mean(dim=0, keepdim=True).expand(KVH, -1)
        return torch.cat([s, torch.full((KVH, 1), float("inf"))], dim=1)
    if method == "observed_attention":
        return group_mean(A.sum(dim=1) / torch.arange(L, 0, -1), KVH)
    if method == "expected_attention":
        n_sink = press.n_sink
        qs = q_pre[:, n_sink:]
        mu = qs.mean(dim=1)
        centered = qs - mu[:, None]
        cov = centered.transpose(1, 2) @ centered / qs.shape[1]
        cos, sin = rope_cos_sin(cfg, torch.arange(L, L + press.n_future_positions))
        # R_p x = x cos_p + rotate_half(x) sin_p, as a matrix: the columns are R_p applied to e_j.
        eye = torch.eye(D)
        rot = torch.stack([(eye * c + rotate_half(eye) * s_).T for c, s_ in zip(cos, sin)]).mean(dim=0)
        mu, cov = mu @ rot.T, rot @ cov @ rot.T
        kk = k[:, n_sink:].repeat_interleave(q.shape[0] // KVH, dim=0)
        s = kk @ mu[:, :, None] / math.sqrt(D)
        s = s[..., 0] + torch.einsum("hnd,hde,hne->hn", kk, cov, kk) / D / 2
        s = group_mean(s.softmax(dim=-1), KVH) * v[:, n_sink:].norm(dim=-1)
        return torch.cat([torch.full((KVH, n_sink), float("inf")), s], dim=1)
    raise AssertionError(method)


def reference_budget(press, layer_idx, n_layers, L):
    """PyramidKV's budget (KVCache-Factory's pyramid, kvpress's always-compress variant)."""
    if press.method != "pyramidkv":
        return max(1, int(L * (1 - press.ratio)))
    W, beta = press.window_size, press.beta
    total = L * (1 - press.ratio)                   # per layer on average, besides the window
    lo = total / beta
    hi = 2 * total - lo
    if hi >= L - W:
        hi = L - W
        lo = 2 * total - hi
    if not (L >= hi >= lo >= W):
        return max(1, round(L * (1 - press.ratio)))
    return round(hi - layer_idx * (hi - lo) / (n_layers - 1))


def top(scores, n):
    """Bool mask of the n best of scores [..., L] by (score, index): ties go to the later index."""
    flat = scores.reshape(-1, scores.shape[-1])
    kept = torch.zeros_like(flat, dtype=torch.bool)
    for r, row in enumerate(flat.tolist()):
        for j in sorted(range(len(row)), key=lambda j: (row[j], j), reverse=True)[:n]:
            kept[r, j] = True
    return kept.view(scores.shape)


def reference_kept(model, ids, press):
    cfg, layers = model.config, reference_qkv(model, ids)
    out = []
    for i, layer in enumerate(layers):
        L = layer[2].shape[1]
        n = reference_budget(press, i, len(layers), L)
        if press.method == "streaming_llm":
            kept = torch.zeros(cfg.n_kv_heads, L, dtype=torch.bool)
            kept[:, : press.n_sink] = True
            kept[:, L - (n - press.n_sink):] = True
            out.append(kept)
            continue
        scores = reference_scores(press.method, press, layer, cfg)
        if press.adaptive:    # AdaKVPress: per-head safeguard, then one bottom-k over all heads
            safe = max(1, int(n * press.alpha_safeguard))
            scores = scores.masked_fill(top(scores, safe), float("inf"))
            out.append(top(scores.flatten(), scores.shape[0] * n).view(scores.shape))
        else:
            out.append(top(scores, n))
    return out


# ---- kept masks against the reference -------------------------------------------------------

@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75])
@pytest.mark.parametrize("method", METHODS)
def test_chunked_observer_keeps_what_the_full_attention_reference_keeps(model, ids, method, ratio):
    press = press_of(method, ratio)
    got = press_masks(model, ids, press, q_chunk=CHUNK)
    want = reference_kept(model, ids, press)
    assert len(got) == len(want) == model.config.n_layers
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == (1, model.config.n_kv_heads, S)
        assert torch.equal(g[0], w), f"layer {i}: {int((g[0] != w).sum())} slots differ"


@pytest.mark.parametrize("method", ["snapkv", "knorm", "expected_attention", "observed_attention"])
def test_adakv_matches_reference_and_keeps_its_budget(model, ids, method):
    press = press_of(method, 0.6, adaptive=True)
    got = press_masks(model, ids, press, q_chunk=CHUNK)
    want = reference_kept(model, ids, press)
    n = n_kept(S, 0.6)
    ragged = False
    for g, w in zip(got, want):
        assert torch.equal(g[0], w)
        counts = g[0].sum(dim=-1)
        assert int(counts.sum()) == model.config.n_kv_heads * n       # the layer's budget, shared
        assert int(counts.min()) >= max(1, int(n * press.alpha_safeguard))   # the safeguard
        ragged |= len(set(counts.tolist())) > 1
    assert ragged, "AdaKV gave every head the same count in every layer"


def test_pyramid_budgets_fall_with_depth_and_keep_the_total():
    press = PressConfig(method="pyramidkv", ratio=0.5)
    for L in (1024, 2048, 4096):
        budgets = [pyramid_budget(i, 30, L, press) for i in range(30)]
        assert budgets == sorted(budgets, reverse=True) and budgets[0] > budgets[-1]
        assert min(budgets) >= press.window_size and max(budgets) <= L
        assert abs(sum(budgets) - 30 * L * (1 - press.ratio)) <= 30    # rounding, one token a layer
    # Too short for a pyramid above the window: snapkv's budget (kvpress's fallback).
    assert pyramid_budget(0, 30, 100, press) == 50 == pyramid_budget(29, 30, 100, press)


def test_pyramidkv_layers_keep_their_budgets(model, ids):
    press = press_of("pyramidkv", 0.5)
    got = press_masks(model, ids, press, q_chunk=CHUNK)
    for i, g in enumerate(got):
        assert g[0].sum(dim=-1).tolist() == [pyramid_budget(i, len(got), S, press)] * model.config.n_kv_heads


@pytest.mark.parametrize("ratio", [0.1, 0.5, 0.9])
def test_streaming_llm_keeps_sinks_and_the_most_recent(model, ids, ratio):
    press = press_of("streaming_llm", ratio, n_sink=3)
    n = int(S * (1 - ratio))
    want = torch.zeros(S, dtype=torch.bool)
    want[:3] = True
    want[S - (n - 3):] = True
    for g in press_masks(model, ids, press, q_chunk=CHUNK):
        assert g[0].nonzero()[:, 1].unique().tolist() == want.nonzero().flatten().tolist()
        assert bool((g[0] == want).all())


def test_ties_keep_the_later_slot():
    from caramba.press.select import adaptive, top as select_top

    scores = torch.tensor([[1.0, 2.0, 1.0, 2.0, 1.0], [3.0, 3.0, 3.0, 0.0, 0.0]])
    assert select_top(scores, 3).tolist() == [[False, True, False, True, True], [True, True, True, False, False]]
    assert torch.equal(select_top(scores, 3), top(scores, 3))
    # AdaKV: each head's best (safeguard), then the best 2 * 2 over both heads, ties to the later index.
    kept = adaptive(scores, 2, 0.5)
    assert kept.tolist() == [[False, False, False, True, False], [True, True, True, False, False]]
    assert torch.equal(kept, top(scores.masked_fill(top(scores, 1), float("inf")).flatten(), 4).view(2, 5))


def test_inactive_press_keeps_every_real_slot(model, ids):
    for press in (PressConfig(), PressConfig(method="snapkv", ratio=0.0)):
        assert all(bool(g.all()) for g in press_masks(model, ids, press, q_chunk=CHUNK))


# ---- batches, chunking, the decode step -----------------------------------------------------

@pytest.mark.parametrize("method,n_sink", [(m, 4) for m in METHODS] + [("expected_attention", 0)])
def test_left_padded_rows_keep_what_each_row_keeps_alone(model, method, n_sink):
    g = torch.Generator().manual_seed(11)
    lengths = (S, 70, 41)
    rows = [torch.randint(0, 97, (L,), generator=g) for L in lengths]
    ids = torch.zeros(len(rows), S, dtype=torch.long)
    mask = torch.zeros(len(rows), S, dtype=torch.bool)
    for b, r in enumerate(rows):
        ids[b, S - len(r):], mask[b, S - len(r):] = r, True
    press = press_of(method, 0.5, n_sink=n_sink)
    batched = press_masks(model, ids, press, q_chunk=CHUNK, mask=mask)
    for b, r in enumerate(rows):
        alone = press_masks(model, r[None], press, q_chunk=CHUNK)
        for layer, (got, want) in enumerate(zip(batched, alone)):
            assert not bool(got[b][:, ~mask[b]].any()), "a padding slot was kept"
            assert torch.equal(got[b][:, mask[b]], want[0]), f"row {b} layer {layer}"


@pytest.mark.parametrize("method", ["snapkv", "observed_attention", "expected_attention"])
def test_chunk_size_does_not_change_the_kept_tokens(model, ids, method):
    """q_chunk 1 runs every token as a one-token step, which the C decode step would take and
    no observer would see: press_masks feeds the context through the torch path."""
    press = press_of(method, 0.5)
    whole = press_masks(model, ids, press, q_chunk=None)
    for q_chunk in (1, 7):
        assert all(torch.equal(a, b) for a, b in zip(whole, press_masks(model, ids, press, q_chunk=q_chunk)))


def test_observing_restores_the_cache_and_leaves_the_model_alone(model):
    cache = model.new_cache(1, 32)
    with observing(model, cache, press_of("snapkv")):
        assert all(layer.observer is not None for layer in cache.layers)
    assert all(layer.observer is None for layer in cache.layers)
    assert "fast_decode" not in model.__dict__


def test_a_prefill_through_the_c_step_is_not_observed_and_is_refused(model, ids):
    """The fused C step calls no observer: a decoder observing its prefill chooses the torch path
    (DecodeState.using(TorchStep)); one that does not is told, not given a silently wrong press."""
    from caramba.infer.state import DecodeState
    from caramba.model import backend, fast_decode

    if fast_decode.library() is None:
        pytest.skip(f"decode step kernel {fast_decode.status()}")
    press = press_of("snapkv", 0.5)
    state = DecodeState(model, model.new_cache(1, S), q_chunk=8, backend=backend.CStep(model))
    with observing(model, state.cache, press) as obs:
        state.prefill(ids)                          # 8-token chunks: every one a C step
    assert state.backend.path == "c"
    with pytest.raises(ValueError, match="inside `observing`"):
        kept_masks(state.cache, obs, press, state.valid_slots())
    state = DecodeState(model, model.new_cache(1, S), q_chunk=8, backend=backend.CStep(model))
    with observing(model, state.cache, press) as obs, state.using(backend.TorchStep(model)):
        state.prefill(ids)
    assert state.backend.path == "c" and isinstance(state.backend, backend.CStep)   # its own again after
    want = press_masks(model, ids, press, q_chunk=8)
    assert all(torch.equal(a, b) for a, b in zip(kept_masks(state.cache, obs, press, state.valid_slots()), want))


# ---- bad input ------------------------------------------------------------------------------

def prefilled(model, ids, press):
    from caramba.infer.state import DecodeState

    state = DecodeState(model, model.new_cache(1, S + 8), q_chunk=CHUNK)
    with observing(model, state.cache, press) as obs:
        state.prefill(ids)
    return state, obs


def test_context_shorter_than_the_window_is_refused(model):
    with pytest.raises(ValueError, match="press_window=16"):
        press_masks(model, torch.arange(10)[None], press_of("snapkv"))
    with pytest.raises(ValueError, match="press_sinks=4"):
        press_masks(model, torch.arange(4)[None], press_of("streaming_llm"))
    with pytest.raises(ValueError, match="tova needs at least 2"):
        press_masks(model, torch.arange(1)[None], press_of("tova"))


def test_bad_settings_and_inputs_are_named(model, ids):
    with pytest.raises(ValueError, match="press_kernel=4 must be odd"):
        press_masks(model, ids, press_of("snapkv", kernel_size=4))
    with pytest.raises(ValueError, match="context_ids must be integer token ids"):
        press_masks(model, ids.float(), press_of("knorm"))
    with pytest.raises(ValueError, match="mask must be a bool tensor"):
        press_masks(model, ids, press_of("knorm"), mask=torch.ones(1, S))
    with pytest.raises(ValueError, match="q_chunk=0"):
        press_masks(model, ids, press_of("knorm"), q_chunk=0)
    with pytest.raises(TypeError, match="PressConfig"):
        press_masks(model, ids, {"method": "knorm"})
    with pytest.raises(ValueError, match="press_ratio"):
        PressConfig(method="knorm", ratio=1.0)


def test_kept_masks_refuses_observations_that_do_not_fit(model, ids):
    state, obs = prefilled(model, ids, press_of("snapkv"))
    with pytest.raises(ValueError, match="observing"):
        kept_masks(state.cache, None, press_of("snapkv"))
    with pytest.raises(ValueError, match="collected for press snapkv"):
        kept_masks(state.cache, obs, press_of("tova"))
    with pytest.raises(ValueError, match="another window size"):
        kept_masks(state.cache, obs, press_of("snapkv", window_size=8))
    with pytest.raises(ValueError, match=r"valid must be a bool tensor \[batch=1"):
        kept_masks(state.cache, obs, press_of("snapkv"), valid=torch.ones(1, S))
    state.prefill(ids[:, :4])   # a forward outside `observing`: the observers never saw it
    with pytest.raises(ValueError, match="saw \\[96\\] slots but the cache holds 100"):
        kept_masks(state.cache, obs, press_of("snapkv"))
    # Methods that score the cache alone need no observation.
    assert kept_masks(state.cache, None, press_of("knorm"))[0].shape == (1, 2, S + 4)


def test_window_over_padding_is_refused(model):
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, -3:] = False    # right padding: the window would score padding queries
    with pytest.raises(ValueError, match="left-padded"):
        press_masks(model, ids, press_of("snapkv"), mask=mask)


def test_unsupported_caches_are_refused(model):
    from caramba.cache.ring import RingKVCache

    cache = model.new_cache(1, 16)
    cache.window = 8
    with pytest.raises(ValueError, match="sliding window"):
        with observing(model, cache, press_of("knorm")):
            pass
    ring = RingKVCache.build(model, 1, 8, 4, "fp32")
    with pytest.raises(ValueError, match="ring caches are not supported|sliding window"):
        with observing(model, ring, press_of("knorm")):
            pass
    dba = make_model(attention="decoupled", sem_dim=8, geo_dim=8)
    with pytest.raises(ValueError, match="decoupled/DBA and ring caches are not supported"):
        press_masks(dba, torch.arange(20)[None], press_of("knorm"))
    full = model.new_cache(1, 16)
    full.layers[0].length = full.layers[1].length = 3
    with pytest.raises(ValueError, match="needs an empty cache"):
        with observing(model, full, press_of("knorm")):
            pass
