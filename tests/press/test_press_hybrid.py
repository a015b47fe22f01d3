"""Presses on hybrid models (caramba.cache.hybrid: Gemma 3's and Gemma 2's sliding layers in rings, full layers of
every slot): a press scores and evicts the full layers only, keeps the model's slot numbers (the
rings') and leaves every ring as the unpressed prefill left it. Against the unpressed cache with the
dropped full-layer slots hidden (test_evict's MaskedLayer), on the torch path and the fused C step."""

from __future__ import annotations

import pytest
import torch

import tolerance as tol
from caramba.cache.evict import PackedLayerKVCache, PressedLayerKVCache, held_slots, slot_contents
from caramba.cache.hybrid import HybridKVCache, SlidingLayerKVCache
from caramba.infer import GenerateConfig, Generator
from caramba.infer.decoding_press import DecodingPress
from caramba.infer.pressing import prefill_pressed
from caramba.infer.state import DecodeState
from caramba.model import fast_decode
from caramba.model.backend import CStep, TorchStep
from caramba.press import PressConfig, kept_masks, n_kept, observing, pyramid_budget, score
from caramba.press.select import layer_row, top
from conftest import make_model
from test_evict import MaskedLayer, decode

WINDOW = 8
TYPES = ["sliding", "full", "sliding", "full"]
GEMMA3 = dict(n_layers=4, sliding_window=WINDOW, layer_types=TYPES, rope_local_theta=100.0, qk_norm="head",
              post_norms=True, mlp="geglu", embed_scale=2.0, attn_scale=0.1)
PRESSES = [PressConfig(method="snapkv", ratio=0.5, window_size=4), PressConfig(method="knorm", ratio=0.6),
           PressConfig(method="expected_attention", ratio=0.5, n_sink=2),
           PressConfig(method="pyramidkv", ratio=0.5, window_size=4),
           PressConfig(method="snapkv", ratio=0.5, window_size=4, adaptive=True)]


# Gemma 2: alternating layers, no QK-norm, the attention scores soft-capped (a cap near their size,
# so it bends them: its pressed layers attend through attend_softcapped) and the logits too
GEMMA2 = dict(n_layers=4, sliding_window=WINDOW, layer_types=TYPES, mlp="geglu", post_norms=True, attn_scale=0.3,
              attn_softcap=0.5, final_softcap=5.0)


@pytest.fixture(scope="module", params=["gemma3", "gemma2"])
def model(request):
    return make_model(seed=7, **(GEMMA3 if request.param == "gemma3" else GEMMA2))


def prompt(B: int, S: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 97, (B, S), generator=torch.Generator().manual_seed(seed))


def padding(lengths: list[int], S: int) -> torch.Tensor | None:
    if all(n == S for n in lengths):
        return None
    return torch.arange(S)[None, :] >= torch.tensor([S - n for n in lengths])[:, None]


def observed(model, ids, mask, press, room: int = 16):
    """The unpressed state after an observed prefill, its logits, and the press's kept masks."""
    B, S = ids.shape
    state = DecodeState(model, model.new_cache(B, S + room), backend=TorchStep(model))
    with observing(model, state.cache, press) as seen:
        logits = state.prefill(ids, mask)
    return state, logits, kept_masks(state.cache, seen, press, state.valid_slots()), seen


def pressed(model, ids, mask, press, room: int = 16, backend=None) -> tuple[DecodeState, torch.Tensor]:
    B, S = ids.shape
    state = DecodeState(model, model.new_cache(B, S + room), backend=backend or TorchStep(model))
    return state, prefill_pressed(state, ids, mask, press)


def reference(model, state: DecodeState, kept) -> DecodeState:
    """The unpressed state itself, its full layers hiding their dropped slots (the rings as they are)."""
    for layer, mask in zip(state.cache.layers, kept):
        if mask is not None:
            layer.__class__ = MaskedLayer
            layer.hidden = ~mask
    return state


@pytest.mark.parametrize("press", PRESSES, ids=lambda p: p.describe())
@pytest.mark.parametrize("lengths", [[40], [20, 14]], ids=["past the ring", "padded, within the ring"])
def test_a_press_keeps_the_rings_and_presses_each_full_layer_as_select_does(model, press, lengths):
    S = max(lengths)
    ids, mask = prompt(len(lengths), S), padding(lengths, S)
    plain, want_logits, kept, seen = observed(model, ids, mask, press)
    state, logits = pressed(model, ids, mask, press)
    cache = state.cache
    assert type(cache) is HybridKVCache and cache.pressed_at == S and cache.length == S
    assert cache.max_seq_len == plain.cache.max_seq_len and state.room == plain.room
    torch.testing.assert_close(logits, want_logits, atol=0, rtol=0)             # the prefill saw everything
    assert (state.slot_mask is None) == (mask is None) and state.evicted.tolist() == [0] * len(lengths)
    full = [i for i, t in enumerate(TYPES) if t == "full"]
    for i, (got, src, k) in enumerate(zip(cache.layers, plain.cache.layers, kept)):
        if TYPES[i] == "sliding":                                                # the ring, bit for bit
            assert k is None and type(got) is SlidingLayerKVCache and got is not src
            assert got.length == src.length and got.max_seq_len == src.max_seq_len
            for a, b in zip(got.streams, src.streams):
                assert all(torch.equal(x, y) and x.data_ptr() != y.data_ptr() for x, y in zip(a.tensors(), b.tensors()))
            continue
        assert type(got) in (PressedLayerKVCache, PackedLayerKVCache)
        assert got.offset == S - got.width and got.length == got.width
        keys, values = src.contents(S)
        held_k, held_v = got.contents(got.width) if type(got) is PressedLayerKVCache else \
            (got.k_stream.read(got.width, torch.float32), got.v_stream.read(got.width, torch.float32))
        for b, n in enumerate(lengths):
            real = torch.arange(S - n, S)
            for h in range(k.shape[1]):
                slots = k[b, h].nonzero().flatten()
                assert bool((slots >= S - n).all())                              # no padding kept
                # the survivors, right-aligned in the layer's own slots, in slot order
                torch.testing.assert_close(held_k[b, h, got.width - len(slots):], keys[b, h, slots], atol=0, rtol=0)
                torch.testing.assert_close(held_v[b, h, got.width - len(slots):], values[b, h, slots], atol=0, rtol=0)
            # the press's own choice on this layer's scores: its budget over the full layers' depth
            row = layer_row(seen[i], seen, b, real, keys, values, press)
            n_keep = pyramid_budget(full.index(i), len(full), n, press) if press.method == "pyramidkv" else \
                n_kept(n, press.ratio)
            if not press.adaptive:
                assert torch.equal(k[b][:, real], top(score(row, press), n_keep))
                assert k[b].sum(-1).tolist() == [n_keep] * k.shape[1]
            else:
                assert int(k[b].sum()) == n_keep * k.shape[1]
    # the share kept and the bytes are the full layers'
    share = sum(int(k.sum()) for k in kept if k is not None) / (len(full) * 2 * sum(lengths))
    assert state.kept_share == pytest.approx(share)
    before, after = plain.cache.bytes_by_layer_type(S), cache.bytes_by_layer_type(S)
    assert after["sliding"] == before["sliding"]
    held = sum(int(k.sum()) for k in kept if k is not None) / (len(full) * 2 * len(lengths) * S)
    assert after["full"] == pytest.approx(before["full"] * held, abs=len(full))
    # every token after the press costs what it did
    assert cache.bytes_at(S + 10) - cache.bytes_at(S) == plain.cache.bytes_at(S + 10) - plain.cache.bytes_at(S)


@pytest.mark.parametrize("press", PRESSES, ids=lambda p: p.describe())
@pytest.mark.parametrize("lengths", [[40], [20, 14]], ids=["past the ring", "padded, within the ring"])
def test_greedy_decoding_after_the_press_equals_the_masked_reference(model, press, lengths):
    S = max(lengths)
    ids, mask = prompt(len(lengths), S, seed=1), padding(lengths, S)
    plain, first, kept, _ = observed(model, ids, mask, press, room=24)
    ref = reference(model, plain, kept)
    state, logits = pressed(model, ids, mask, press, room=24)
    want_logits, want = decode(ref, first.argmax(-1), 20)                       # past the rings' wrap
    got_logits, got = decode(state, logits.argmax(-1), 20)
    assert torch.equal(got, want)
    torch.testing.assert_close(torch.stack(got_logits), torch.stack(want_logits),
                               **tol.forward(torch.stack(want_logits), model.config))


def test_the_generator_presses_a_hybrid_model(model):
    ids = prompt(1, 40, seed=2)
    config = GenerateConfig(max_new_tokens=10, temperature=0.0, max_seq_len=64, press="snapkv", press_ratio=0.5,
                            press_window=4)
    model.fast_decode = False
    try:
        got = Generator(model, config).generate(ids)[0, 40:]
    finally:
        del model.fast_decode
    plain, first, kept, _ = observed(model, ids, None, config.cache.press, room=24)
    _, want = decode(reference(model, plain, kept), first.argmax(-1), 9)
    assert got.tolist() == [int(first.argmax(-1))] + want[0].tolist()


@pytest.mark.parametrize("press", [PRESSES[0], PRESSES[4]], ids=["uniform", "per-head (packed)"])
@pytest.mark.parametrize("kind", ["fp32", "q8_0"])
def test_the_c_step_reads_a_pressed_hybrid_cache_as_the_torch_path(model, press, kind):
    if fast_decode.library() is None:
        pytest.skip(f"decode step kernel {fast_decode.status()}")
    ids, mask = prompt(2, 20, seed=3), padding([20, 14], 20)
    runs = []
    for backend in (TorchStep(model), CStep(model, fast_decode.ThreadChoice(fixed=1))):
        state = DecodeState(model, model.new_cache(2, 44, kind), backend=backend)
        logits = prefill_pressed(state, ids, mask, press)
        runs.append((state, logits))
    (ref, first), (fast, _) = runs
    ref_logits, got_logits, t = [], [], first.argmax(-1)
    for _ in range(20):                                                        # past the rings' wrap
        out = ref.step(t)
        ref_logits.append(out)
        got_logits.append(fast.step(t))
        t = out.argmax(-1)
    assert fast.backend.path == "c"
    ref_logits, got_logits = torch.stack(ref_logits), torch.stack(got_logits)
    torch.testing.assert_close(got_logits, ref_logits, **tol.cache_paths(ref_logits, model.config, kind))
    assert torch.equal(got_logits.argmax(-1), ref_logits.argmax(-1))


def test_rollback_keeps_the_survivors_and_refuses_the_pressed_context(model):
    ids = prompt(1, 40, seed=4)
    state, logits = pressed(model, ids, None, PRESSES[0])
    decode(state, logits.argmax(-1), 6)
    state.rollback(torch.tensor([43]))
    assert state.cache.length == 43 and int(state.next_pos) == 43
    with pytest.raises(ValueError, match="pressed context"):
        state.cache.truncate(30)


@pytest.mark.parametrize("method,ratio", [("knorm", 0.0), ("knorm", 0.5), ("snapkv", 0.5), ("expected_attention", 0.0)])
@pytest.mark.parametrize("lengths", [[40], [40, 31]], ids=["one row", "padded"])
def test_decoding_time_compression_presses_the_full_layers_again_as_the_masked_reference(model, method, ratio, lengths):
    """Every INTERVAL steps the full layers keep TARGET tokens per row and head; the reference keeps
    every slot and hides, per full layer and head, the tokens the pressed cache no longer holds
    (followed through each press: survivors move right-aligned to the slots before the press's
    length, in order). The pressed state runs the C step between watched steps where it can."""
    INTERVAL, TARGET, S = 9, 24, max(lengths)
    B, room = len(lengths), 40
    press = PressConfig(method=method, ratio=ratio, window_size=4, n_sink=2, interval=INTERVAL, target=TARGET)
    ids, mask = prompt(B, S, seed=6), padding(lengths, S)
    full = [i for i, t in enumerate(TYPES) if t == "full"]
    state = DecodeState(model, model.new_cache(B, S + room))                      # the C step where it applies
    origin = {i: torch.arange(S + room).expand(B, 2, -1).clone() for i in full}   # each slot's token
    presses = []
    own = state.press

    def press_and_follow(kept, *args, **kwargs):
        old, L = state.cache, state.cache.length
        own(kept, *args, **kwargs)
        for i in full:
            counts = kept[i].sum(-1)
            moved = torch.arange(S + room).expand(B, 2, -1).clone()
            for b in range(B):
                for h in range(2):
                    moved[b, h, L - int(counts[b, h]):L] = origin[i][b, h, :L][kept[i][b, h]]
            origin[i] = moved
        presses.append((old, kept))

    state.press = press_and_follow
    logits = prefill_pressed(state, ids, mask, press) if press.active else state.prefill(ids, mask)
    ref = DecodeState(model, model.new_cache(B, S + room), backend=TorchStep(model))
    ref.prefill(ids, mask)

    def hide() -> None:   # the reference hides the tokens the pressed full layers no longer hold
        L = state.cache.length
        for i in full:
            held = held_slots(state.cache.layers[i], L)
            seen = torch.zeros(B, 2, L, dtype=torch.bool)
            if held is None:
                seen[:] = True
            else:
                for b in range(B):
                    for h in range(2):
                        seen[b, h, origin[i][b, h, :L][held[b, h]]] = True
            ref.cache.layers[i].__class__ = MaskedLayer
            ref.cache.layers[i].hidden = ~seen

    hide()
    dp = DecodingPress(state, press)
    t = logits.argmax(-1)
    for _ in range(30):
        dp.before_step()
        got = state.step(t)
        want = ref.step(t)
        torch.testing.assert_close(got, want, **tol.cache_paths(want, model.config, "fp32"))
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        t = want.argmax(-1)
        if dp.after_step():
            old, kept = presses[-1]
            L = old.length
            for i in full:
                layer = state.cache.layers[i]
                had = held_slots(old.layers[i], L)
                pool = state.valid_slots()[:, None].expand(-1, 2, -1) & (True if had is None else had)
                assert not bool((kept[i] & ~pool).any())                        # only what it held
                assert torch.equal(kept[i].sum(-1), pool.sum(-1).clamp(max=TARGET))
                assert layer.width == TARGET and layer.offset == L - TARGET
                if method == "knorm":                                           # the smallest keys stay
                    norms = slot_contents(old.layers[i], L)[0].norm(dim=-1)
                    for b in range(B):
                        for h in range(2):
                            gone = pool[b, h] & ~kept[i][b, h]
                            if bool(gone.any()):
                                assert norms[b, h][kept[i][b, h]].max() <= norms[b, h][gone].min()
            hide()
    dp.close()
    assert len(presses) == int(press.active) + 30 // INTERVAL
    assert state.cache.pressed_at == state.cache.length - 30 % INTERVAL
    if fast_decode.library() is not None:
        assert "c" in state.backend.path


def test_a_candidates_kinds_take_the_rings_as_a_shared_context_stores_them(model):
    """The eval's shared prefill presses the baseline's cache into a candidate's kinds (a template):
    the full layers' survivors and the rings' slots re-stored in those kinds, the baseline untouched."""
    from caramba.evaluation.task_eval import store_context

    ids, mask = prompt(2, 40, seed=5), padding([40, 31], 40)
    press = PRESSES[0]
    plain, _, kept, _ = observed(model, ids, mask, press)
    source = plain.cache
    before = [[t.clone() for s in layer.streams for t in s.tensors()] for layer in source.layers]
    stored = model.new_cache(2, 56, "q8_0")
    store_context(plain.cache, stored)
    plain.press(kept, model.new_cache(2, 1, "q8_0"))
    for i, (got, want) in enumerate(zip(plain.cache.layers, stored.layers)):
        assert got.k_cfg.kind.value == "q8_0"
        if TYPES[i] == "sliding":
            assert type(got) is SlidingLayerKVCache and got.length == want.length
            for a, b in zip(got.streams, want.streams):
                assert all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors()))
    assert plain.cache.pressed_at == 40 and plain.slot_mask is not None
    for layer, saved in zip(source.layers, before):          # the baseline's cache as it was
        assert all(torch.equal(t, u) for t, u in zip([t for s in layer.streams for t in s.tensors()], saved))


def test_pressed_hybrid_states_step_joined_as_alone(model):
    """An eval's joined answering (caramba.evaluation.joined): pressed hybrid caches, uniform and packed,
    beside an unpressed one, each attended under its own masks."""
    from caramba.evaluation.joined import joinable, step_together

    if model.config.attn_softcap is not None:    # Gemma 2: its candidates answer alone
        assert not joinable(model)
        return
    ids, mask = prompt(2, 20, seed=1), padding([20, 14], 20)

    def states():
        out = [pressed(model, ids, mask, p, room=30) for p in (PRESSES[0], PRESSES[4])]
        plain = DecodeState(model, model.new_cache(2, 50), backend=TorchStep(model))
        return [s for s, _ in out] + [plain], [lg for _, lg in out] + [plain.prefill(ids, mask)]

    (joined, logits), (alone, _) = states(), states()
    tokens = [lg.argmax(-1) for lg in logits]
    for _ in range(12):                                                        # past the rings' wrap
        got = step_together(model, joined, tokens, [None] * 3)
        want = [s.step(t) for s, t in zip(alone, tokens)]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, **tol.forward(w, model.config))
        tokens = [w.argmax(-1) for w in want]


def test_a_later_turns_chunk_reads_the_pressed_full_layers_and_the_rings(model):
    """A chunk longer than the rings' write-first span (a chat's next turn) after the press."""
    ids, mask = prompt(2, 40, seed=8), padding([40, 33], 40)
    press = PRESSES[2]
    plain, _, kept, _ = observed(model, ids, mask, press, room=40)
    ref = reference(model, plain, kept)
    state, _ = pressed(model, ids, mask, press, room=40)
    turn = prompt(2, 20, seed=9)
    want, got = ref.feed(turn), state.feed(turn)
    torch.testing.assert_close(got, want, **tol.forward(want, model.config))
    _, a = decode(ref, want[:, -1].argmax(-1), 8)
    _, b = decode(state, want[:, -1].argmax(-1), 8)
    assert torch.equal(a, b)


@pytest.mark.parametrize("draft", ["prompt_lookup", "layer_skip"])
def test_speculative_decoding_rolls_back_a_pressed_hybrid_target_losslessly(model, draft):
    from caramba.infer.speculative import SpeculativeConfig, SpeculativeGenerator

    row = prompt(1, 20, seed=3)[0].tolist() * 2                                # repeats: drafts are accepted
    settings = dict(max_new_tokens=30, temperature=0.0, press="snapkv", press_ratio=0.5, press_window=4)
    out = SpeculativeGenerator(model, config=SpeculativeConfig(draft=draft, spec_k=6, **settings)).run([row])
    want = Generator(model, GenerateConfig(max_seq_len=128, **settings)).run([row]).sequences[0]
    assert out.sequences[0] == want and out.stats.target_forwards < 30


@pytest.mark.parametrize("kind", ["fp32", "q8_0"])
def test_an_evals_bytes_for_a_pressed_hybrid_candidate_are_its_caches_own(model, kind):
    """The frontier's bytes per token of a pressed candidate (caramba.runners.eval): the rings
    whole, the full layers' kept share, as the pressed cache counts itself."""
    from caramba.runners.eval import cache_bytes, pressed_bytes

    S = 40
    state = DecodeState(model, model.new_cache(1, S, kind), backend=TorchStep(model))
    prefill_pressed(state, prompt(1, S, seed=2), None, PRESSES[1])
    row = cache_bytes(model, kind, S)
    pressed_bytes(row, state.kept_share)
    assert state.kept_share < 0.7
    assert row["bytes_per_token"] == pytest.approx(state.cache.bytes_at(S) / S, abs=0.2)
    assert row["bytes_per_token_by_layer_type"]["sliding"] == pytest.approx(
        state.cache.bytes_by_layer_type(S)["sliding"] / S, abs=0.1)
