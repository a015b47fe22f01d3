"""Eviction (caramba.cache.evict, DecodeState.press) against a reference that keeps the whole
cache and masks the dropped slots in plain softmax attention: a pressed cache must decode exactly
as the full cache would with those slots hidden, for uniform, per-row, per-layer and per-head
budgets, in fp32 and quantized kinds, on the torch path and the fused C step."""

from __future__ import annotations

import pytest
import torch

from caramba.cache import CachePolicy, KVCache, LayerKVCache
from caramba.cache import KVCacheTensorConfig
from caramba.cache.evict import PackedLayerKVCache, PressedKVCache, evict
from caramba.infer.state import DecodeState
import tolerance as tol
from caramba.model import fast_decode
from caramba.model.backend import choose
from caramba.model.fast_decode import ThreadChoice
from conftest import make_model


class MaskedLayer(LayerKVCache):
    """The reference: every slot stays; dropped context slots are hidden per head in a plain
    softmax(q k^T / sqrt(d)) v over the dequantized cache."""

    hidden: torch.Tensor   # [B, KVH, S] True = dropped

    def attend(self, q, k, v, mask, causal):
        return self.attend_softcapped(q, k, v, mask, causal, None)

    def attend_softcapped(self, q, k, v, mask, causal, cap):   # cap: Gemma 2's scores, cap * tanh(s / cap)
        end = self._append(k, v)
        keys, values = self.contents(end, q.dtype)                   # [B, KVH, end, D]
        B, H, T, D = q.shape
        G = H // self.n_kv_heads
        keys, values = keys.repeat_interleave(G, 1), values.repeat_interleave(G, 1)
        scores = q @ keys.transpose(-1, -2) / D**0.5                 # [B, H, T, end]
        if cap is not None:
            scores = torch.tanh(scores / cap) * cap
        allowed = torch.ones(B, H, T, end, dtype=torch.bool)
        if mask is not None:
            allowed &= mask
        if causal:
            allowed &= torch.ones(T, end, dtype=torch.bool).tril(end - T)
        S = self.hidden.shape[-1]
        allowed[..., :S] &= ~self.hidden.repeat_interleave(G, 1)[:, :, None, :]
        return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ values


def reference_state(model, state: DecodeState, kept, policy=None) -> DecodeState:
    """A copy of the state's context in a cache of `policy`, with the un-kept slots hidden."""
    src = state.cache
    target = model.new_cache(src.batch_size, src.max_seq_len, policy or "fp32")
    for layer, mask in zip(target.layers, kept):
        layer.extend(*src.layers[target.layers.index(layer)].contents(src.length))
        layer.__class__ = MaskedLayer
        layer.hidden = ~mask
    ref = DecodeState(model, target)
    ref.next_pos = state.next_pos.clone()
    ref.slot_mask = None if state.slot_mask is None else state.slot_mask.clone()
    return ref


def decode(state: DecodeState, first: torch.Tensor, n: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Greedy: n steps from tokens `first` [B] -> (logits per step, tokens [B, n])."""
    logits, tokens, t = [], [], first
    for _ in range(n):
        out = state.step(t)
        logits.append(out)
        t = out.argmax(-1)
        tokens.append(t)
    return logits, torch.stack(tokens, 1)


def random_kept(L, B, KVH, S, counts, valid=None, seed=0):
    """counts[l][b][h] random kept slots of each layer, row and head (among the valid ones)."""
    g = torch.Generator().manual_seed(seed)
    kept = torch.zeros(L, B, KVH, S, dtype=torch.bool)
    for layer in range(L):
        for b in range(B):
            for h in range(KVH):
                pool = torch.arange(S) if valid is None else valid[b].nonzero().flatten()
                pick = pool[torch.randperm(len(pool), generator=g)[: counts[layer][b][h]]]
                kept[layer, b, h, pick] = True
    return list(kept)


def prefilled(model, B=1, S=24, room=12, lengths=None, policy=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.config.vocab_size, (B, S), generator=g)
    mask = None
    if lengths is not None:
        mask = torch.arange(S)[None, :] >= torch.tensor([S - n for n in lengths])[:, None]
    state = DecodeState(model, model.new_cache(B, S + room, policy or "fp32"))
    logits = state.prefill(tokens, mask)
    return state, logits.argmax(-1)


def check_against_reference(model, state, first, kept, policy=None, steps=8, atol=2e-5, ragged_rows=False):
    ref = reference_state(model, state, kept, policy)
    template = None if policy is None else model.new_cache(state.batch_size, 1, policy)
    state.press(kept, template, ragged_rows=ragged_rows)
    got, got_tokens = decode(state, first, steps)
    want, want_tokens = decode(ref, first, steps)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=atol, rtol=1e-4)
    assert torch.equal(got_tokens, want_tokens)
    return state


@pytest.fixture
def model():
    torch.manual_seed(0)
    m = make_model(seed=3, n_layers=3, n_heads=4, n_kv_heads=2)
    m.fast_decode = False
    return m


def test_uniform_press_matches_masked_full_cache_and_frees_memory(model):
    state, first = prefilled(model)
    L, KVH = model.config.n_layers, model.config.n_kv_heads
    kept = random_kept(L, 1, KVH, 24, [[[10] * KVH]] * L)
    before = state.cache.nbytes
    state = check_against_reference(model, state, first, kept)
    assert type(state.cache) is KVCache and state.cache.length == 10 + 8
    per_token = state.cache.bytes_per_token()
    assert state.cache.nbytes == per_token * (10 + 12)          # kept tokens + the room for new ones
    assert state.cache.nbytes < before
    assert state.next_pos.tolist() == [24 + 8]                  # positions go on from the context's


def test_press_keeps_positions_of_survivors(model):
    """Keeping every slot changes nothing: the same logits as the unpressed cache, bit for bit."""
    state, first = prefilled(model, S=16)
    full, _ = prefilled(model, S=16)
    L, KVH = model.config.n_layers, model.config.n_kv_heads
    state.press([torch.ones(1, KVH, 16, dtype=torch.bool)] * L)
    a, ta = decode(state, first, 6)
    b, tb = decode(full, first, 6)
    assert torch.equal(ta, tb)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5)


def test_rows_keep_different_counts_as_holes_in_front(model):
    lengths = [24, 15]
    state, first = prefilled(model, B=2, lengths=lengths)
    valid = state.valid_slots()
    L, KVH = model.config.n_layers, model.config.n_kv_heads
    kept = random_kept(L, 2, KVH, 24, [[[12] * KVH, [7] * KVH]] * L, valid)
    state = check_against_reference(model, state, first, kept)
    assert type(state.cache) is KVCache
    assert state.slot_mask[:, :12].sum(1).tolist() == [12, 7]
    assert state.slot_mask[1, :5].logical_not().all()


def test_rows_keeping_different_counts_can_allocate_only_their_survivors(model):
    """ragged_rows (a prefill press no decoding-time compression follows): a uniform press on rows
    of different lengths packs the rows, so the shorter row's heads allocate only their survivors
    plus the room, no holes in front; the same logits and tokens as the masked full cache."""
    state, first = prefilled(model, B=2, lengths=[24, 15])
    L, KVH = model.config.n_layers, model.config.n_kv_heads
    counts = [[[12] * KVH, [7] * KVH]] * L
    kept = random_kept(L, 2, KVH, 24, counts, state.valid_slots())
    state = check_against_reference(model, state, first, kept, ragged_rows=True)
    assert isinstance(state.cache, PressedKVCache) and state.slot_mask is None
    assert [type(layer) for layer in state.cache.layers] == [PackedLayerKVCache] * L
    fp32 = KVCacheTensorConfig("fp32")
    assert state.cache.nbytes == per_head_bytes(counts, 12, (fp32, fp32), model.config.head_dim)
    assert state.cache.nbytes < 2 * L * 2 * KVH * (12 + 12) * fp32.bytes_per_token(1, model.config.head_dim)


@pytest.mark.parametrize("layout", ["per_layer", "per_head", "both"])
def test_ragged_budgets_match_masked_full_cache(model, layout):
    L, KVH = model.config.n_layers, model.config.n_kv_heads
    counts = {"per_layer": [[[16] * KVH], [[9] * KVH], [[4] * KVH]],
              "per_head": [[[14, 5]], [[3, 12]], [[9, 9]]],
              "both": [[[20, 2]], [[1, 6]], [[24, 24]]]}[layout]
    state, first = prefilled(model)
    kept = random_kept(L, 1, KVH, 24, counts)
    state = check_against_reference(model, state, first, kept)
    cache = state.cache
    assert isinstance(cache, PressedKVCache)
    widths = [max(c[0]) for c in counts]
    assert [layer.max_seq_len for layer in cache.layers] == [w + 12 for w in widths]   # each layer its own room
    assert cache.length == max(widths) + 8                                      # the model's slot numbers


def test_ragged_budgets_with_padded_rows_and_a_question_chunk(model):
    """Per-head budgets on a left-padded batch, then a multi-token feed (a question) before decoding."""
    L, KVH = model.config.n_layers, model.config.n_kv_heads
    state, _ = prefilled(model, B=2, lengths=[24, 18], room=20)
    valid = state.valid_slots()
    kept = random_kept(L, 2, KVH, 24, [[[10, 4], [6, 2]], [[3, 9], [5, 5]], [[7, 7], [1, 8]]], valid, seed=2)
    ref = reference_state(model, state, kept)
    state.press(kept)
    question = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(9))
    got = state.prefill(question)
    want = ref.prefill(question)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    a, ta = decode(state, got.argmax(-1), 5)
    b, tb = decode(ref, want.argmax(-1), 5)
    assert torch.equal(ta, tb)


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "nf4"])
def test_survivors_stored_quantized_match_the_quantized_full_cache(model, kind):
    """Per-token kinds quantize each token alone, so gathering then quantizing equals quantizing
    then hiding: the pressed quantized cache decodes as the full quantized cache masked."""
    policy = CachePolicy.build(kind)
    L, KVH = model.config.n_layers, model.config.n_kv_heads
    state, first = prefilled(model)
    kept = random_kept(L, 1, KVH, 24, [[[11] * KVH]] * L, seed=4)
    state = check_against_reference(model, state, first, kept, policy, atol=1e-4)
    assert state.cache.layers[0].k_stream.quantized
    assert state.cache.nbytes == state.cache.bytes_per_token() * (11 + 12) + _fixed(state.cache)


def _fixed(cache) -> int:
    """Bytes that do not grow with tokens (none for plain per-token kinds)."""
    return cache.nbytes - cache.bytes_per_token() * cache.max_seq_len


def test_per_channel_keys_regroup_survivors():
    """KIVI keys (per-channel groups along tokens) are requantized over the survivors: the
    pressed cache decodes close to the fp32 pressed cache (within 2-bit rounding), not garbage."""
    model = make_model(seed=3, n_layers=2, n_heads=4, n_kv_heads=2)
    model.fast_decode = False
    L, KVH = 2, 2
    kept = random_kept(L, 1, KVH, 40, [[[20] * KVH]] * L, seed=5)
    a, first = prefilled(model, S=40)
    b, _ = prefilled(model, S=40)
    a.press(kept)
    b.press(kept, model.new_cache(1, 1, CachePolicy.build("q4_0", {"k": "q4_1c"})))
    la, _ = decode(a, first, 1)
    lb, _ = decode(b, first, 1)
    assert b.cache.layers[0].k_stream.spec.per_channel
    assert (la[0] - lb[0]).abs().max() < 0.1 * la[0].abs().max()


def test_press_on_the_c_step_equals_the_torch_path():
    if fast_decode.library() is None:
        pytest.skip(f"decode step kernel {fast_decode.status()}")
    model = make_model(seed=3, n_layers=3, n_heads=4, n_kv_heads=2)
    L, KVH = 3, 2
    runs = {}
    for fast in (True, False):
        model.fast_decode = fast
        state, first = prefilled(model, B=2, lengths=[24, 20])
        kept = random_kept(L, 2, KVH, 24, [[[12] * KVH, [9] * KVH]] * L, state.valid_slots())
        state.press(kept, model.new_cache(2, 1, CachePolicy.build("q8_0")))
        calls = []
        real = fast_decode.step
        fast_decode.step = lambda *a, **k: calls.append(1) or real(*a, **k)
        try:
            logits, tokens = decode(state, first, 8)
        finally:
            fast_decode.step = real
        assert bool(calls) == fast
        runs[fast] = (logits, tokens)
    assert torch.equal(runs[True][1], runs[False][1])
    for a, b in zip(runs[True][0], runs[False][0]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_bad_kept_masks_are_refused(model):
    state, _ = prefilled(model, B=2, lengths=[24, 10])
    L, KVH = model.config.n_layers, model.config.n_kv_heads
    real = state.valid_slots()[:, None, :].expand(2, KVH, 24)
    with pytest.raises(ValueError, match="one kept mask per layer"):
        state.press([real] * (L - 1))
    with pytest.raises(ValueError, match="must be bool"):
        state.press([torch.ones(2, KVH, 23, dtype=torch.bool)] * L)
    with pytest.raises(ValueError, match="padding"):
        state.press([torch.ones(2, KVH, 24, dtype=torch.bool)] * L)


PER_HEAD = [[[14, 5], [3, 9]], [[3, 12], [1, 1]], [[9, 9], [7, 2]]]     # [layer][row][KV head] kept, AdaKV-like


def per_head_bytes(counts, room: int, cfgs, head_dim: int) -> int:
    """What a per-head press must allocate: every (layer, row, KV head)'s kept tokens plus the room,
    at the kinds' bytes per token and head (KVCacheTensorConfig.bytes_per_token)."""
    per_token = sum(c.bytes_per_token(1, head_dim) for c in cfgs)
    return sum((k + room) * per_token for layer in counts for row in layer for k in row)


@pytest.mark.parametrize("kind", ["fp32", "q8_0", "q4_0"])
def test_a_per_head_press_allocates_only_the_kept_tokens_and_room(model, kind):
    """AdaKV's per-head budgets: the cache's allocated bytes after the press are each head's kept
    tokens plus the room, not the widest head's width per layer; it decodes as the full cache
    with the dropped slots hidden (plain attention over the dequantized survivors)."""
    policy = CachePolicy.build(kind)
    L, KVH = model.config.n_layers, model.config.n_kv_heads
    state, first = prefilled(model, B=2, lengths=[24, 18])
    kept = random_kept(L, 2, KVH, 24, PER_HEAD, state.valid_slots(), seed=3)
    # quantized: a new token's code may round the other way when the two attentions sum in other
    # orders (~1e-6 apart), moving later logits by up to a code step's effect (5e-3 seen with q8_0)
    state = check_against_reference(model, state, first, kept, None if kind == "fp32" else policy,
                                    atol=2e-5 if kind == "fp32" else 2e-2)
    cache = state.cache
    assert [type(layer) for layer in cache.layers] == [PackedLayerKVCache] * L
    D = model.config.head_dim
    cfgs = (policy.k, policy.v) if kind != "fp32" else (KVCacheTensorConfig("fp32"),) * 2
    assert cache.nbytes == per_head_bytes(PER_HEAD, 12, cfgs, D)
    dense = sum(2 * KVH * (max(max(r) for r in layer) + 12) for layer in PER_HEAD) * sum(
        c.bytes_per_token(1, D) for c in cfgs)
    assert cache.nbytes < dense                             # the widest head's width, per layer: the old layout


def test_packed_survivors_keep_their_values_and_positions(model):
    """Each head's stored survivors are the source's kept slots, bit for bit, in slot order (keys
    after RoPE: their positions untouched); new tokens take positions from the context's end."""
    state, first = prefilled(model, B=2, lengths=[24, 18])
    L, KVH = model.config.n_layers, model.config.n_kv_heads
    kept = random_kept(L, 2, KVH, 24, PER_HEAD, state.valid_slots(), seed=3)
    source = [layer.contents(24) for layer in state.cache.layers]
    state.press(kept)
    for layer, (keys, values), mask in zip(state.cache.layers, source, kept):
        got_k, got_v = layer.contents(layer.length)
        for b in range(2):
            for h in range(KVH):
                n = int(mask[b, h].sum())
                lo = layer.width - n
                assert torch.equal(got_k[b, h, lo:layer.width], keys[b, h, mask[b, h]])
                assert torch.equal(got_v[b, h, lo:layer.width], values[b, h, mask[b, h]])
                assert not got_k[b, h, :lo].any()
    assert state.next_pos.tolist() == [24, 18]                  # each row's own context length
    decode(state, first, 3)
    assert state.next_pos.tolist() == [27, 21]


def test_per_channel_keys_pack_within_a_group_per_head():
    """KIVI keys (groups of G tokens along the sequence): a head keeps fewer than G holes in front
    so its groups are the dense layout's; the packed cache stores what the dense one stores in
    those slots and decodes the same greedy tokens, in at most G slots more per head than kept + room."""
    model = make_model(seed=3, n_layers=2, n_heads=4, n_kv_heads=2)
    model.fast_decode = False
    policy = CachePolicy.build("q4_1", "k=q4_1c", qblock=16, residual_len=4)
    # rows whose widest heads differ by whole groups (16): their groups start where they do alone, so
    # the layers pack (rows whose origins are not whole groups stay dense: test_press_padded)
    counts = [[[37, 5], [20, 21]], [[40, 9], [1, 24]]]
    runs = {}
    for pack in (True, False):
        state, first = prefilled(model, B=2, S=40, room=24)
        kept = random_kept(2, 2, 2, 40, counts, seed=8)
        cache, mask = evict(state.cache, kept, model.new_cache(2, 1, policy), room=24, pack=pack)
        state.cache, state.slot_mask = cache, mask
        runs[pack] = (cache, *decode(state, first, 20))
    packed, dense = runs[True][0], runs[False][0]
    assert type(packed.layers[0]) is PackedLayerKVCache and type(dense.layers[0]) is not PackedLayerKVCache
    assert torch.equal(runs[True][2], runs[False][2])
    for a, b in zip(packed.layers, dense.layers):
        for x, y in zip(a.contents(a.length), b.contents(b.length)):
            held = (torch.arange(a.width) >= a.first[..., None])[..., None]    # the survivors: the same codes
            assert torch.equal(x[:, :, :a.width] * held, y[:, :, :a.width] * held)
            # the new tokens: the two torch paths' attention sums differ in order (plain SDPA, chunked codes),
            # and a group completed over them may round a code the other way (a 4-bit step, ~1e-3 here)
            torch.testing.assert_close(x[:, :, a.width:], y[:, :, a.width:], atol=1e-2, rtol=1e-2)
    D, G = model.config.head_dim, 16
    rings = sum(t.numel() * t.element_size() for layer in packed.layers for s in layer.streams
                if s.ring is not None for t in [s.ring])
    exact = per_head_bytes(counts, 24, (policy.k, policy.v), D)
    assert exact <= packed.nbytes - rings <= exact + 2 * 2 * 2 * 2 * G * sum(
        c.bytes_per_token(1, D) for c in (policy.k, policy.v))
    assert packed.nbytes < dense.nbytes


@pytest.mark.parametrize("spec", [dict(default="q8_0", residual_len=4),
                                  dict(default="q4_1", overrides="k=q4_1c", qblock=16, residual_len=4)])
def test_a_reordered_packed_layer_holds_its_rows_where_they_went(spec):
    """Beam rows gathered (reordered, repeated) from a packed layer: every store, group parameter
    and ring follows its row, so each new row reads what the old one held."""
    model = make_model(seed=3, n_layers=2, n_heads=4, n_kv_heads=2)
    model.fast_decode = False
    policy = CachePolicy.build(spec.pop("default"), spec.pop("overrides", None), **spec)
    state, first = prefilled(model, B=2, S=40, room=24)
    state.press(random_kept(2, 2, 2, 40, [[[37, 5], [20, 21]], [[40, 9], [1, 24]]], seed=8),   # origins: whole groups
                model.new_cache(2, 1, policy))
    decode(state, first, 5)
    before = [layer.contents(layer.length) for layer in state.cache.layers]
    rows = torch.tensor([1, 0, 1])
    state.reorder(rows)
    for layer, (k, v) in zip(state.cache.layers, before):
        assert type(layer) is PackedLayerKVCache
        got_k, got_v = layer.contents(layer.length)
        assert torch.equal(got_k, k[rows]) and torch.equal(got_v, v[rows])


def test_packed_kivi_keys_roll_back_into_a_completed_group_as_the_dense_layout(monkeypatch, taken):
    """Speculative rollback after a per-head press with KIVI keys: truncating into a group the new
    tokens completed refills it from its codes (ChannelQuantStream's rule), per head in the store;
    the packed and dense layouts then decode the same tokens, on the torch path and on the C step
    (which leaves the refilling step to the torch path)."""
    model = make_model(seed=3, n_layers=2, n_heads=4, n_kv_heads=2)
    policy = CachePolicy.build("q4_1", "k=q4_1c", qblock=8, residual_len=2)
    # rows whose widest heads differ by whole groups (16): their groups start where they do alone, so
    # the layers pack (rows whose origins are not whole groups stay dense: test_press_padded)
    counts = [[[37, 5], [20, 21]], [[40, 9], [1, 24]]]
    runs = {}
    for pack, fast in [(True, False), (False, False)] + [(True, True)] * (fast_decode.library() is not None):
        model.fast_decode = False
        state, first = prefilled(model, B=2, S=40, room=40)
        model.fast_decode = fast
        state.backend = choose(model, ThreadChoice(fixed=1))
        monkeypatch.setattr("caramba.cache.evict.PACK", pack)
        state.press(random_kept(2, 2, 2, 40, counts, seed=8), model.new_cache(2, 1, policy))
        _, tokens = decode(state, first, 30)                    # groups completed past the survivors
        state.rollback(state.next_pos - 25)                     # back into one the ring no longer holds
        assert all(layer.k_stream.refills(layer.length) for layer in state.cache.layers)
        runs[pack, fast] = decode(state, tokens[:, 2], 12)[1], state.cache
        assert (len(taken) > 30) == fast                        # the C step took most steps
    assert type(runs[True, False][1].layers[0]) is PackedLayerKVCache
    for tokens, _ in runs.values():
        assert torch.equal(tokens, runs[False, False][0])


def test_a_pressed_context_cannot_be_rolled_back_into(model):
    state, first = prefilled(model)
    L, KVH = model.config.n_layers, model.config.n_kv_heads
    state.press(random_kept(L, 1, KVH, 24, [[[6, 3]], [[2, 2]], [[5, 1]]]))
    decode(state, first, 3)
    state.cache.truncate(state.cache.length - 2)       # the new tokens: fine
    with pytest.raises(ValueError, match="pressed context"):
        state.cache.truncate(2)


# Ragged budgets over contexts longer than the C step's attention parts (64 slots), so a head's
# holes cover whole parts, end inside one, or leave none: [layer][row][KV head] kept slots of a
# 160-slot context whose row 1 has 20 slots of padding.
# The rows' widest heads differ by whole groups of the KIVI policy (16) in every layer: a row's groups
# then start where they start alone and the layers pack (other origins stay dense: test_press_padded).
RAGGED = {"per_layer": [[[150, 150], [86, 86]], [[70, 70], [38, 38]], [[20, 20], [132, 132]]],
          "per_head": [[[150, 10], [3, 118]], [[64, 68], [1, 100]], [[128, 70], [64, 2]]],
          "per_row": [[[100, 100], [52, 52]]] * 3}     # a uniform press, rows packed (ragged_rows)
POLICIES = {"fp32": CachePolicy.build("fp32"), "q8_0": CachePolicy.build("q8_0"),
            "q4_0 residual_len=8": CachePolicy.build("q4_0", residual_len=8),
            "k=q4_1c,v=q4_1 qblock=16": CachePolicy.build("q4_1", "k=q4_1c", qblock=16),    # KIVI
            "bf16": CachePolicy.build("bf16")}     # 16-bit values in a packed store


def ragged_run(layout: str, policy: str, threads: int, fast: bool, calls: list, rows: list | None = None):
    """A ragged press of a 2-row padded context into `policy`, a 5-token question (one forward,
    T = 5), the rows reordered to `rows` (as beams or an eval's candidates are), then 6 greedy
    steps, on the C step or the torch path -> (logits, tokens, cache, C calls, config)."""
    model = make_model(seed=3, n_layers=3, n_heads=4, n_kv_heads=2)
    model.fast_decode = False
    state, _ = prefilled(model, B=2, S=160, room=24, lengths=[160, 140])
    kept = random_kept(3, 2, 2, 160, RAGGED[layout], state.valid_slots(), seed=6)
    state.press(kept, model.new_cache(2, 1, POLICIES[policy]), ragged_rows=layout == "per_row")
    assert isinstance(state.cache, PressedKVCache)
    assert all(type(layer) is PackedLayerKVCache for layer in state.cache.layers)   # rows or heads differ
    model.fast_decode = fast
    state.backend = choose(model, ThreadChoice(fixed=threads))    # the C step, or the torch path
    before = len(calls)
    question = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(9))
    out = state.prefill(question)
    if rows is not None:     # after a C step: the table it built must follow the rows
        state.reorder(torch.tensor(rows))
        out = out[rows]
    logits, tokens = decode(state, out.argmax(-1), 6)
    return torch.stack([out, *logits]), tokens, state.cache, len(calls) - before, model.config


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("layout", list(RAGGED))
def test_ragged_press_on_the_c_step_equals_the_torch_path(layout, policy, threads, taken):
    check_ragged_c_step(layout, policy, threads, taken)


@pytest.mark.parametrize("policy", ["fp32", "q8_0"])
def test_a_reordered_ragged_cache_is_read_where_its_rows_went(policy, taken):
    """Rows reordered and repeated after the press (each head's first valid slot moves with its row)."""
    check_ragged_c_step("per_head", policy, 2, taken, rows=[1, 0, 1])


def check_ragged_c_step(layout, policy, threads, calls: list, rows=None):
    """(calls: the `taken` fixture's C-step count.) Per-layer and per-head budgets on the fused C step (each layer its own slots and capacity,
    each head reading its own survivors): the torch path's logits within the fp32 forward bound
    (the two differ only in summation order: projections, q.k, softmax sums and p V, over at most
    n_layers * max(dim, hidden) roundings), plus one storage step where a new token's codes can
    round the other way; the same greedy tokens, and the same cache contents."""
    if fast_decode.library() is None:
        pytest.skip(f"decode step kernel {fast_decode.status()}")
    want, want_tokens, ref_cache, torch_calls, config = ragged_run(layout, policy, threads, False, calls, rows)
    got, got_tokens, cache, c_calls, _ = ragged_run(layout, policy, threads, True, calls, rows)
    per_channel = "q4_1c" in policy        # a per-channel group is completed one token at a time
    assert (torch_calls, c_calls) == (0, 6 if per_channel else 7)
    kind = policy.split()[0].split(",")[-1].removeprefix("v=")
    bound = tol.cache_paths(want, config, kind)
    torch.testing.assert_close(got, want, **bound)
    assert torch.equal(got_tokens, want_tokens)
    assert cache.length == ref_cache.length
    for a, b in zip(cache.layers, ref_cache.layers):
        assert a.length == b.length and a.offset == b.offset
        for x, y in zip(a.contents(a.length), b.contents(b.length)):
            torch.testing.assert_close(x, y, **tol.cache_paths(y, config, kind))
