"""caramba.cache.hybrid: a hybrid model's sliding layers keep a ring of their window (plus SLACK),
its full layers every slot. Against the model's own forward without a cache (the reference: every
key, masked by each layer's window): long prompts read before they write, decode steps and verify
chunks write first, quantized and mixed kinds, rollbacks, and bytes computed independently."""

from __future__ import annotations

import pytest
import torch

from caramba.cache import CachePolicy, KVCache, LayerKVCache
from caramba.cache.hybrid import SLACK, HybridKVCache, SlidingLayerKVCache
from caramba.infer import GenerateConfig, Generator
from caramba.model.transformer import Transformer
import tolerance as tol
from conftest import init_weights_, tiny_config

WINDOW = 8
TYPES = ["sliding", "sliding", "full", "sliding"]


@pytest.fixture(scope="module")
def model() -> Transformer:
    cfg = tiny_config(n_layers=4, sliding_window=WINDOW, layer_types=TYPES, rope_local_theta=100.0,
                      qk_norm="head", post_norms=True, mlp="geglu", embed_scale=2.0)
    return init_weights_(Transformer(cfg), seed=1).eval().requires_grad_(False)


def tokens(n: int, B: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 97, (B, n), generator=torch.Generator().manual_seed(seed))


def test_the_cache_of_a_hybrid_model_rings_its_sliding_layers(model):
    cache = model.new_cache(2, 200)
    assert type(cache) is HybridKVCache and cache.max_seq_len == 200
    assert [type(layer) for layer in cache.layers] == [SlidingLayerKVCache, SlidingLayerKVCache, LayerKVCache,
                                                       SlidingLayerKVCache]
    assert [layer.max_seq_len for layer in cache.layers] == [WINDOW + SLACK] * 2 + [200] + [WINDOW + SLACK]
    assert [layer.max_seq_len for layer in model.new_cache(1, 10).layers] == [10] * 4   # no ring past the cache


@pytest.mark.parametrize("chunks", [
    [60],                      # one prompt longer than the ring: read, then write the newest
    [5, 30, 3, 40],            # prompts after a wrap, chunks that write first (<= SLACK + 1) and read first
    [1] * 40,                  # single steps through several wraps
    [17, 17, 18, 20],          # SLACK + 1 writes first; one more reads first
])
@pytest.mark.parametrize("kind", ["fp32", "q8_0"])
def test_chunks_through_the_rings_equal_the_reference_forward(model, chunks, kind):
    ids = tokens(sum(chunks), B=2)
    cache = model.new_cache(2, 128, kind)
    got, at = [], 0
    for n in chunks:
        got.append(model(ids[:, at:at + n], cache=cache))
        at += n
    got = torch.cat(got, dim=1)
    if kind == "fp32":
        want = model(ids)       # no cache: every key, each layer's window
    else:                       # the same kind held for every slot, no ring
        plain = KVCache([LayerKVCache(2, 128, 32, 32, n_kv_heads=2, **CachePolicy.build(kind).for_layer(i))
                         for i in range(4)])
        want = torch.cat([model(ids[:, a:a + n], cache=plain)
                          for a, n in zip([sum(chunks[:i]) for i in range(len(chunks))], chunks)], dim=1)
    torch.testing.assert_close(got, want, **tol.cache_paths(want, model.config, kind))


def test_a_ring_holds_no_more_than_window_plus_slack_whatever_the_context(model):
    cache = model.new_cache(1, 1000)
    ring = cache.layers[0]
    before = ring.nbytes
    model(tokens(300), cache=cache)
    assert ring.nbytes == before and ring.length == 300 and ring.max_seq_len == WINDOW + SLACK


def test_bytes_at_a_context_are_the_rings_plus_the_full_layers_slots(model):
    """Computed here from the shapes: 3 rings of WINDOW + SLACK slots, one full layer of every slot."""
    per_slot = {"fp32": 2 * 2 * 16 * 4, "q8_0": 2 * 2 * (16 + 2)}   # K and V, 2 heads of 16 (q8_0: codes + fp16 scale)
    for kind, slot in per_slot.items():
        cache = model.new_cache(1, 4096, kind)
        assert cache.bytes_at(4096) == 3 * (WINDOW + SLACK) * slot + 4096 * slot
        assert cache.bytes_by_layer_type(4096) == {"sliding": 3 * (WINDOW + SLACK) * slot, "full": 4096 * slot}
        assert cache.bytes_at(5) == 4 * 5 * slot     # before the rings fill: every layer per token
    # quantizing only the full layers changes exactly the full layers' bytes
    mixed = model.new_cache(1, 4096, CachePolicy.build("q8_0", sliding_kind="fp32"))
    assert mixed.bytes_by_layer_type(4096) == {"sliding": 3 * (WINDOW + SLACK) * per_slot["fp32"],
                                               "full": 4096 * per_slot["q8_0"]}
    assert [layer.k_cfg.kind.value for layer in mixed.layers] == ["fp32", "fp32", "q8_0", "fp32"]


def test_rollback_within_the_slack_matches_and_further_is_refused(model):
    ids = tokens(60)
    cache = model.new_cache(1, 128)
    model(ids[:, :50], cache=cache)
    model(ids[:, 50:60], cache=cache)          # a verify chunk of 10
    cache.truncate(52)                         # 8 rejected: within SLACK
    again = model(ids[:, 52:60], cache=cache)
    want = model(ids)[:, 52:60]
    torch.testing.assert_close(again, want, **tol.forward(want, model.config))
    with pytest.raises(ValueError, match="roll back at most"):
        cache.truncate(60 - SLACK - 5)


def test_generation_through_the_rings_equals_a_full_length_cache(model):
    """Greedy tokens, 3 prompts of different lengths (left padding), far past the window."""
    rows = [tokens(n, seed=i)[0].tolist() for i, n in enumerate((5, 23, 11))]
    got = Generator(model, GenerateConfig(max_new_tokens=40, temperature=0)).run(rows).sequences
    want = []
    for row in rows:
        ids = torch.tensor([row])
        for _ in range(40):
            ids = torch.cat([ids, model(ids)[:, -1:].argmax(-1)], dim=1)
        want.append(ids[0, len(row):].tolist())
    assert got == want


def test_a_ring_refuses_kinds_that_need_slot_order(model):
    with pytest.raises(ValueError, match="per-channel"):
        model.new_cache(1, 100, "q4_1c")
    with pytest.raises(ValueError, match="residual"):
        model.new_cache(1, 100, CachePolicy.build("q8_0", residual_len=4))
    assert type(model.new_cache(1, 100, CachePolicy.build("q8_0", residual_len=4, sliding_kind="fp16"))) is HybridKVCache


@pytest.mark.parametrize("n", [20, 60])   # before and after the rings wrap
def test_a_shared_context_stored_into_another_hybrid_cache_continues_alike(model, n):
    """The eval's shared prefill (task_eval.store_context) copies a ring's slots in slot order."""
    from caramba.evaluation.task_eval import store_context

    ids = tokens(n + 5)
    source = model.new_cache(1, 128)
    model(ids[:, :n], cache=source)
    target = model.new_cache(1, 128)
    store_context(source, target)
    assert target.length == n
    got = torch.cat([model(ids[:, t:t + 1], cache=target) for t in range(n, n + 5)], dim=1)
    want = model(ids)[:, n:]
    torch.testing.assert_close(got, want, **tol.forward(want, model.config))


def test_a_press_on_a_hybrid_model_presses_its_full_layers_only(model):
    """tests/press/test_press_hybrid.py has the rest: rings bit for bit, masks, decoding, the C step."""
    from caramba.infer.pressing import check_pressable, prefill_pressed
    from caramba.infer.state import DecodeState
    from caramba.press import PressConfig

    press = PressConfig(method="snapkv", ratio=0.5, window_size=4)
    check_pressable(model, press)
    state = DecodeState(model, model.new_cache(1, 64))
    prefill_pressed(state, tokens(40), None, press)
    assert type(state.cache) is HybridKVCache and state.cache.pressed_at == 40 and state.cache.length == 40
    assert [type(layer) is SlidingLayerKVCache for layer in state.cache.layers] == [t == "sliding" for t in TYPES]
    check_pressable(model, PressConfig(method="knorm", ratio=0.0, interval=8, target=16))   # decoding-time too


# ---- every decoding path over the rings -----------------------------------------------------------

def _greedy_reference(model, row: list[int], n: int) -> list[int]:
    ids = torch.tensor([row])
    for _ in range(n):
        ids = torch.cat([ids, model(ids)[:, -1:].argmax(-1)], dim=1)
    return ids[0, len(row):].tolist()


@pytest.mark.parametrize("draft", ["prompt_lookup", "layer_skip", "self_int8"])
def test_speculative_decoding_is_lossless_past_the_window(model, draft):
    from caramba.infer.speculative import SpeculativeConfig, SpeculativeGenerator

    row = tokens(20, seed=3)[0].tolist() * 2     # repeats, so prompt lookup drafts something
    gen = SpeculativeGenerator(model, config=SpeculativeConfig(max_new_tokens=40, temperature=0.0, draft=draft,
                                                              spec_k=6, spec_k_adaptive=True))
    out = gen.run([row])
    assert out.sequences[0] == _greedy_reference(model, row, 40)
    assert out.stats.target_forwards < 40     # drafts were accepted: rollbacks went through the rings


def test_speculative_refuses_drafts_longer_than_the_rings_slack(model):
    from caramba.infer.speculative import SpeculativeConfig, SpeculativeGenerator

    gen = SpeculativeGenerator(model, config=SpeculativeConfig(max_new_tokens=8, temperature=0.0,
                                                              draft="prompt_lookup", spec_k_max=SLACK + 4))
    with pytest.raises(ValueError, match="spec_k_max"):
        gen.run([tokens(10)[0].tolist()])


def test_beam_search_through_the_rings_equals_a_full_length_cache(model):
    from caramba.infer.beam import beam_search

    ids = tokens(12, seed=4)
    ringed = beam_search(model, ids, max_new_tokens=30, num_beams=3, num_return_sequences=2, temperature=0,
                         eos_token_id=[], max_seq_len=64)
    full = model.new_cache
    try:   # the same search with every layer holding every slot: no ring
        model.new_cache = lambda b, n, kind="fp32": KVCache(
            [LayerKVCache(b, n, 32, 32, n_kv_heads=2, **CachePolicy.of(kind).for_layer(i)) for i in range(4)])
        plain = beam_search(model, ids, max_new_tokens=30, num_beams=3, num_return_sequences=2, temperature=0,
                            eos_token_id=[], max_seq_len=64)
    finally:
        model.new_cache = full
    assert ringed.sequences == plain.sequences


@pytest.mark.parametrize("plan", [dict(decode_plan="auto", decode_bucket_short=16, decode_q_chunk=16),
                                  dict(decode_plan="fixed", decode_q_chunk=7),
                                  dict(decode_plan="fixed", decode_local_window=12)], ids=["auto", "chunk", "window"])
def test_decode_plans_run_on_the_rings(model, plan):
    row = tokens(70, seed=6)[0].tolist()
    cfg = GenerateConfig(max_new_tokens=20, temperature=0, max_seq_len=128, **plan)
    got = Generator(model, cfg).run([row]).sequences[0]
    if "decode_local_window" in plan:   # a decode window changes outputs by design: it must still run
        assert len(got) == 20
    else:
        assert got == _greedy_reference(model, row, 20)


def test_autotune_candidates_address_the_rings_only_on_hybrid_models(model):
    from caramba.autotune.candidates import default_candidates
    from conftest import make_model

    hybrid = default_candidates(model)
    assert any(c.policy.sliding_kind == "fp16" for c in hybrid)
    assert all(c.policy.sliding_kind is not None for c in hybrid if c.policy.k.kind.spec.per_channel)
    for c in hybrid:    # every candidate builds a ring cache, and its bytes count the rings
        model.new_cache(1, 64, c.policy)
    assert not any(c.policy.sliding_kind for c in default_candidates(make_model()))
