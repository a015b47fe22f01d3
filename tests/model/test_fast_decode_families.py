"""The fused decode step (decode_step.c) on the newer families' parts against the torch path it stands
in for: QK-norm per head (Qwen3, Gemma 3) and over the projection (OLMo 2), post-norms without
pre-norms (OLMo 2), GeGLU, the queries' scale, the scores' and the logits' soft caps (Gemma 2), and
hybrid sliding/full layers
with their own masks and RoPE bases (Gemma 3), whose sliding layers keep rings (caramba.cache.hybrid)
that the step reads and writes in storage order past their wraps; a RingKVCache (--local-window)
past its wraps too. Tiny random caramba models (conftest), and tiny HF families against transformers
(tests/model/test_new_families.py's): greedy tokens identical through the C path, Gemma 2 included."""

from __future__ import annotations

import pytest
import torch

import tolerance as tol
from caramba import kernels
from caramba.cache import CachePolicy, KVCache, LayerKVCache
from caramba.cache.hybrid import HybridKVCache
from caramba.cache.ring import RingKVCache
from caramba.infer import GenerateConfig, Generator
from caramba.model import backend, fast_decode, quant
from caramba.model.backend import CStep, TorchStep
from conftest import make_model
from test_model_families import hf_greedy, rand_tokens, tokenizer  # noqa: F401
from test_new_families import FAMILIES as HF_FAMILIES
from test_new_families import N_NEW, saved  # noqa: F401

WINDOW = 8
TYPES = ["sliding", "sliding", "full", "sliding"]
PROMPT, STEPS = 6, 34        # 40 slots: five windows, past the rings' WINDOW + 16 slots
# ModelConfig overrides of conftest's tiny model: each family's parts
FAMILIES = {
    "qwen3": dict(qk_norm="head"),
    "olmo2": dict(qk_norm="projection", pre_norms=False, post_norms=True),
    "gemma3": dict(n_layers=4, sliding_window=WINDOW, layer_types=TYPES, rope_local_theta=100.0, qk_norm="head",
                   post_norms=True, mlp="geglu", embed_scale=2.0, attn_scale=0.1),
    # hybrid with one RoPE base (Qwen2/3 past max_window_layers), the logits' soft cap (Gemma 2's, without
    # its attention cap), the queries' scale and GeGLU without QK-norm
    "hybrid capped": dict(n_layers=4, sliding_window=WINDOW, layer_types=["full", "sliding", "sliding", "full"],
                          mlp="geglu", post_norms=True, attn_scale=0.2, final_softcap=5.0),
    # Gemma 2: the scores soft-capped before the softmax (a cap near the scores' size, so it bends them)
    "gemma2": dict(n_layers=4, sliding_window=WINDOW, layer_types=["sliding", "full", "sliding", "full"],
                   mlp="geglu", post_norms=True, attn_scale=0.3, attn_softcap=0.5, final_softcap=5.0),
    "mistral": dict(sliding_window=WINDOW),      # every layer slides: one mask, a plain cache
}


@pytest.fixture(autouse=True)
def needs_kernels():
    if fast_decode.library() is None:
        pytest.skip(f"decode step kernel {fast_decode.status()}")


def bound(ref: torch.Tensor, config, kind: str = "fp32", act: str | None = None) -> float:
    """The two paths' difference: fp32 rounding, a storage step of the cache's kind (a K or V value a
    rounding apart on either side of a code boundary) and with rounded activations one of theirs."""
    atol = tol.cache_paths(ref, config, kind)["atol"]
    return atol + (2 / quant.ACTIVATION_LEVELS[act] * float(ref.abs().max()) if act else 0.0)


def greedy_both(model, ids, steps: int, cache_of, threads: int | None = 1, chunks=None):
    """(torch path, C path, C backend): logits [B, 1 + steps, V] of a prefill (the model's own forward,
    the same for both) and `steps` greedy decode steps, the torch path choosing each token and the C
    path fed the same (so a token it would choose differently shows in its argmax, not as drift), and
    the caches. chunks: feed that many tokens per forward instead (a verify), the torch path's."""
    out = []
    feed = None
    for fast in (False, True):
        step = CStep(model, fast_decode.ThreadChoice(fixed=threads)) if fast else TorchStep(model)
        with torch.inference_mode():
            cache = cache_of(model, ids.shape[0])
            logits = [model(ids, cache=cache)[:, -1:]]
            if feed is None:
                feed = _greedy_feed(step, cache, logits, steps, chunks)
            else:
                logits += [step(t, cache=cache) for t in feed]
        out.append((torch.cat(logits, 1), cache))
    return out[0], out[1], step


def _greedy_feed(step, cache, logits: list, steps: int, chunks) -> list[torch.Tensor]:
    """The torch path's greedy decode (its logits appended): the token chunks it fed."""
    feed, tok = [], logits[-1].argmax(-1)
    for n in chunks or [1] * steps:
        toks = [tok]
        while len(toks) < n:         # a chunk continues greedily from a single step each, as a draft would
            toks.append(step(toks[-1], cache=cache)[:, -1:].argmax(-1))
            cache.truncate(cache.length - 1)
        chunk = torch.cat(toks, 1)
        feed.append(chunk)
        logits.append(step(chunk, cache=cache))
        tok = logits[-1][:, -1:].argmax(-1)
    return feed


def assert_same(ref, got, config, kind: str = "fp32", act: str | None = None) -> None:
    """Logits within bound, the same greedy tokens, and every layer's stored K and V alike (a ring's
    storage slots as they lie)."""
    (ref_logits, ref_cache), (got_logits, got_cache) = ref, got
    atol = bound(ref_logits, config, kind, act)
    torch.testing.assert_close(got_logits, ref_logits, atol=atol, rtol=0)
    assert torch.equal(got_logits.argmax(-1), ref_logits.argmax(-1))
    assert got_cache.length == ref_cache.length
    for a, b in zip(got_cache.layers, ref_cache.layers):
        n = min(a.length, a.max_seq_len)
        for s_got, s_ref in zip(a.streams, b.streams):
            want = s_ref.read(n, torch.float32)
            torch.testing.assert_close(s_got.read(n, torch.float32), want, atol=bound(want, config, kind, act), rtol=0)


def new_cache(kind: str, slots: int = PROMPT + STEPS + 8):
    return lambda model, B: model.new_cache(B, slots, kind)


@pytest.mark.parametrize("weights", ["fp32", "q8_0"])
@pytest.mark.parametrize("kind", ["fp32", "q8_0"])
@pytest.mark.parametrize("family", FAMILIES)
def test_steps_equal_the_torch_path_past_the_window(family, kind, weights, taken):
    model = make_model(seed=1, **FAMILIES[family])
    if weights == "q8_0":
        quant.quantize_model(model, "q8_0")          # q8 activations, as decoding runs them
    ids = torch.randint(0, 97, (2, PROMPT), generator=torch.Generator().manual_seed(2))
    ref, got, step = greedy_both(model, ids, STEPS, new_cache(kind))
    assert step.path == "c" and len(taken) == STEPS
    if model.config.hybrid:   # the rings wrapped
        assert type(got[1]) is HybridKVCache and got[1].length > min(layer.max_seq_len for layer in got[1].layers)
    assert len(set(ref[0].argmax(-1).flatten().tolist())) > 3      # varied tokens: a broken path would show
    assert_same(ref, got, model.config, kind, act="q8" if weights == "q8_0" else None)


@pytest.mark.parametrize("kind", ["fp32", "q8_0"])
@pytest.mark.parametrize("family", ["gemma3", "hybrid capped", "gemma2"])
def test_verify_chunks_through_the_rings_equal_the_torch_path(family, kind, taken):
    """Several new tokens per forward (a speculative verify, up to MAX_ROWS), written before they are
    read: new token t sees its window, the ring's slots it has not overwritten and new tokens 0..t,
    wrapping past the ring's end."""
    model = make_model(seed=3, **FAMILIES[family])
    ids = torch.randint(0, 97, (1, PROMPT), generator=torch.Generator().manual_seed(4))
    chunks = [4, 1, 16, 3, 1, 9, 16, 2]               # 52 new slots: the ring wraps within chunks
    ref, got, step = greedy_both(model, ids, 0, new_cache(kind, 64), chunks=chunks)
    assert step.path == "c" and len(taken) == len(chunks)
    assert_same(ref, got, model.config, kind)


@pytest.mark.parametrize("threads", [2, 3])
def test_a_steps_bits_do_not_depend_on_the_thread_count_past_the_wrap(threads, taken):
    """The attention's parts cut a ring's storage slots as they cut a plain layer's slots."""
    model = make_model(seed=5, **FAMILIES["gemma3"])
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(6))
    runs = []
    for n in (1, threads):
        with torch.inference_mode():
            cache = model.new_cache(2, 128, "q8_0")
            model(ids, cache=cache)
            step = CStep(model, fast_decode.ThreadChoice(fixed=n))
            runs.append(torch.cat([step(torch.full((2, 1), t), cache=cache) for t in range(7, 37)], 1))
    assert len(taken) == 60 and torch.equal(runs[0], runs[1])


def test_a_hybrid_model_on_a_plain_cache_reads_each_layer_types_mask(taken):
    """Every layer holding every slot (no ring): the sliding layers' mask is as wide as the full
    layers' but windowed."""
    model = make_model(seed=7, **FAMILIES["gemma3"])

    def plain(model, B):
        return KVCache([LayerKVCache(B, 64, 32, 32, n_kv_heads=2, **CachePolicy.build("fp32").for_layer(i))
                        for i in range(4)])

    ids = torch.randint(0, 97, (2, PROMPT), generator=torch.Generator().manual_seed(8))
    ref, got, step = greedy_both(model, ids, STEPS, plain)
    assert type(got[1]) is KVCache and step.path == "c" and len(taken) == STEPS
    assert_same(ref, got, model.config)


@pytest.mark.parametrize("kind", ["fp32", "q8_0"])
def test_generation_with_padding_equals_the_torch_path(kind):
    """Left-padded prompts of three lengths (their slot mask indexes each ring by slot % capacity),
    prefill chunks and steps far past the window: the same sequences."""
    model = make_model(seed=9, **FAMILIES["gemma3"])
    rows = [torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 11, 5)]
    config = GenerateConfig(max_new_tokens=40, temperature=0, cache_kind=kind)
    gen = Generator(model, config)
    got = gen.run(rows).sequences
    assert isinstance(gen.backend, CStep) and gen.backend.path == "c"
    model.fast_decode = False
    try:
        want = Generator(model, config).run(rows).sequences
    finally:
        del model.fast_decode
    assert got == want


@pytest.mark.parametrize("kind", ["fp32", "q8_0"])
@pytest.mark.parametrize("max_write", [1, 5])
def test_a_sliding_window_ring_is_read_past_its_wraps(kind, max_write, taken):
    """--local-window's RingKVCache (every layer a ring of window + max_write slots) on a Llama
    model: the step reads its storage under the window's mask and writes slot s at s % capacity,
    for three times the window and more; with max_write 5, forwards of 5 tokens wrap inside."""
    model = make_model(seed=11)
    ids = torch.randint(0, 97, (1, max_write), generator=torch.Generator().manual_seed(12))   # the prefill too

    def ring(model, B):
        return RingKVCache.build(model, B, window=WINDOW, max_write=max_write, spec=kind)

    chunks = [1] * 24 if max_write == 1 else [5, 1, 5, 4, 5, 5, 1]
    ref, got, step = greedy_both(model, ids, 0, ring, chunks=chunks)
    assert step.path == "c" and len(taken) == len(chunks) and got[1].length > 3 * WINDOW
    assert_same(ref, got, model.config, kind)


def test_the_portable_build_computes_the_new_parts(monkeypatch, tmp_path, taken):
    """The scalar loops (built without -march=native: GeGLU's libm gate, the references) on a hybrid
    model past the wrap, against the torch path."""
    monkeypatch.setenv("CARAMBA_CACHE_DIR", str(tmp_path))
    flags = [f for f in kernels.FLAGS if not f.startswith("-march")]
    lib, status = kernels.load(fast_decode.SOURCES, fast_decode._SIGNATURES, "test", flags=flags)
    assert status == "c"
    monkeypatch.setattr(fast_decode, "library", lambda: lib)
    for family in ("gemma3", "olmo2"):
        model = make_model(seed=13, **FAMILIES[family])
        ids = torch.randint(0, 97, (1, PROMPT), generator=torch.Generator().manual_seed(14))
        ref, got, _ = greedy_both(model, ids, 24, new_cache("q8_0"))
        assert_same(ref, got, model.config, "q8_0")
    assert len(taken) == 48


def test_an_attention_soft_cap_changes_what_the_c_step_computes():
    """Gemma 2's cap on the scores is computed in C, not dropped: the same model without it gives
    other logits through the C step, and the capped one takes the C path by default."""
    model = make_model(seed=15, **FAMILIES["gemma2"])
    assert fast_decode.model_applies(model) and isinstance(backend.choose(model), CStep)
    ids = torch.randint(0, 97, (1, PROMPT), generator=torch.Generator().manual_seed(16))
    capped = greedy_both(model, ids, 4, new_cache("fp32"))[1][0]
    model.config.attn_softcap = None
    for layer in model.layers:
        layer.attn.softcap = None
    uncapped = greedy_both(model, ids, 4, new_cache("fp32"))[1][0]
    assert (capped - uncapped).abs().max() > 100 * bound(capped, model.config)


@pytest.mark.parametrize("family", list(HF_FAMILIES))
def test_greedy_through_the_c_step_matches_transformers(saved, family):  # noqa: F811
    """transformers' tiny families, saved and loaded, Gemma 2 included: the C step."""
    hf, loaded = saved(family)
    prompt = rand_tokens(loaded.model.config.vocab_size, 1, 7, seed=3)
    gen = Generator(loaded.model, GenerateConfig(max_new_tokens=N_NEW, temperature=0))
    got = gen.run([prompt[0].tolist()]).sequences[0]
    assert got == hf_greedy(hf, prompt)
    assert gen.backend.path == "c"
