"""The one-call decode step (caramba.model.fast_decode, decode_step.c) against the torch path it
stands in for: the same logits and the same cache, for every weight layout and format it reads,
batches, padding and windows; and the torch path wherever it does not apply."""

from __future__ import annotations

import gguf
import pytest
import torch

import tolerance as tol
from caramba import kernels
from caramba.model import fast_decode, quant
from caramba.model.quant import QuantLinear, gguf_blocks
from conftest import make_model


@pytest.fixture(autouse=True)
def needs_kernels():
    if fast_decode.library() is None:
        pytest.skip(f"decode step kernel {fast_decode.status()}")


@pytest.fixture
def taken(monkeypatch):
    """How many forwards went through the C step."""
    calls = []
    real = fast_decode.step

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(fast_decode, "step", counting)
    return calls


def to_q4_1(model, act: str) -> None:
    """Every projection and the head as llama.cpp Q4_1 blocks (gguf's own quantizer)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            w = quant._float_weight(child)
            if w is not None and not isinstance(child, QuantLinear):
                N, K = w.shape
                p = gguf_blocks(gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_1), "Q4_1", (N, K))
                setattr(parent, name, QuantLinear("q4_1", p["qs"], p["d"], p["m"], getattr(child, "bias", None), act=act))


def run_both(model, ids, steps, kind="fp32", **forward_kw):
    """(torch path, C path): logits of a prefill and `steps` teacher-forced decode steps, and the caches."""
    out = []
    for fast in (False, True):
        model.fast_decode = fast
        with torch.inference_mode():
            cache = model.new_cache(ids.shape[0], 40, kind)
            model.fast_decode = False                          # the same prefill for both
            logits = [model(ids, cache=cache, **forward_kw.get("prefill", {}))[:, -1:]]
            model.fast_decode = fast
            for t in steps:
                tok = torch.full((ids.shape[0], 1), t)
                logits.append(model(tok, cache=cache, **forward_kw.get("step", {})))
        out.append((torch.cat(logits, 1), cache))
    return out


def assert_same(ref, got, config, atol_extra: float = 0.0):
    (ref_logits, ref_cache), (got_logits, got_cache) = ref, got
    bound = tol.forward(ref_logits, config)
    torch.testing.assert_close(got_logits, ref_logits, atol=bound["atol"] + atol_extra, rtol=0)
    assert got_cache.length == ref_cache.length
    for a, b in zip(got_cache.layers, ref_cache.layers):
        n = a.length
        for s_got, s_ref in ((a.k_stream, b.k_stream), (a.v_stream, b.v_stream)):
            torch.testing.assert_close(s_got.data[:, :, :n], s_ref.data[:, :, :n],
                                       atol=tol.forward(s_ref.data, config)["atol"] + atol_extra, rtol=0)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("overrides", [{}, {"qkv_bias": True, "tie_embeddings": False}, {"n_kv_heads": 4}])
def test_steps_equal_the_torch_path(batch, threads, overrides, taken):
    torch.set_num_threads(threads)
    model = make_model(seed=1, **overrides)
    ids = torch.randint(0, 97, (batch, 5), generator=torch.Generator().manual_seed(2))
    ref, got = run_both(model, ids, [7, 8, 9, 60, 3])
    assert len(taken) == 5
    assert_same(ref, got, model.config)


@pytest.mark.parametrize("fmt,act", [("q8_0", "f32"), ("q4_1", "f32")])
def test_quantized_weights_with_fp32_activations_equal_the_torch_path(fmt, act, taken):
    model = make_model(seed=3)
    if fmt == "q8_0":
        quant.quantize_model(model, act=act)
    else:
        to_q4_1(model, act)
    ids = torch.tensor([[5, 9, 1, 44, 3]])
    ref, got = run_both(model, ids, [7, 8, 9])
    assert len(taken) == 3
    assert_same(ref, got, model.config)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_quantized_weights_with_q8_activations_follow_the_torch_path(fmt, taken):
    """With q8 activations a sum-order difference can move an activation across a rounding
    boundary of its q8 grid, which shifts it by one step (1/127 of its block's largest value):
    the two paths agree to that, not to fp32 rounding."""
    model = make_model(seed=4)
    if fmt == "q4_1":
        to_q4_1(model, "q8")
    else:
        quant.quantize_model(model, fmt, act="q8")
    ids = torch.tensor([[5, 9, 1, 44, 3]])
    (ref, _), (got, _) = run_both(model, ids, [7, 8])
    assert len(taken) == 2
    assert (got - ref).abs().max() <= 2 / 127 * ref.abs().max()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_padding_and_windows_come_as_a_mask(taken):
    model = make_model(seed=5)
    ids = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(6))
    slot_mask = torch.ones(2, 40, dtype=torch.bool)
    slot_mask[1, :2] = False                                   # row 1 is left-padded by two slots
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 0, 0, 1, 2, 3]])
    out = []
    for fast in (False, True):
        with torch.inference_mode():
            cache = model.new_cache(2, 40)
            model.fast_decode = False
            logits = [model(ids, positions, cache, slot_mask)[:, -1:]]
            model.fast_decode = fast
            for i, t in enumerate([7, 8, 9]):
                pos = positions[:, -1:] + 1 + i
                logits.append(model(torch.full((2, 1), t), pos, cache, slot_mask, window=4))   # a window too
        out.append((torch.cat(logits, 1), cache))
    assert len(taken) == 3
    assert_same(*out, model.config)


def test_positions_past_the_rotary_table_grow_it(taken):
    model = make_model(seed=6)
    ids = torch.tensor([[4, 5, 6]])
    ref, got = run_both(model, ids, [7], prefill={"positions": torch.tensor([[300, 301, 302]])},
                        step={"positions": torch.tensor([[303]])})
    assert len(taken) == 1
    assert_same(ref, got, model.config)


@pytest.mark.parametrize("qblock", [32, 8])
@pytest.mark.parametrize("policy", ["q8_0", "k=q8_0", "v=q8_0"])
def test_q8_0_caches_equal_the_torch_path(policy, qblock, taken):
    """The step reads and writes q8_0 codes itself. Its new tokens' codes are caramba.cache.quant's
    bit for bit (checked where both paths computed the same K and V: layer 0 of an fp32-cache
    step), and the two paths agree to one storage step (a K or V value a rounding apart can sit on
    either side of a code boundary)."""
    from caramba.cache import CachePolicy
    from caramba.cache.quant import quantize

    model = make_model(seed=10)
    policy = CachePolicy.build("fp32" if "=" in policy else policy, policy if "=" in policy else None, qblock=qblock)
    ids = torch.tensor([[5, 9, 1, 44, 3], [7, 7, 2, 90, 61]])
    ref, got = run_both(model, ids, [7, 8, 9], kind=policy)
    assert len(taken) == 3
    (ref_logits, ref_cache), (got_logits, got_cache) = ref, got
    torch.testing.assert_close(got_logits, ref_logits, **tol.cache_paths(ref_logits, model.config, "q8_0"))
    # the quantizer, bit for bit: one step on an fp32 cache and on this policy's, from one prefill
    with torch.inference_mode():
        caches = []
        for kind in ("fp32", policy):
            cache = model.new_cache(2, 40, kind)
            model.fast_decode = False
            model(ids, cache=cache)
            model.fast_decode = True
            model(torch.tensor([[11], [12]]), cache=cache)
            caches.append(cache)
    f32, q8 = caches[0].layers[0], caches[1].layers[0]
    for keys, (fs, qs) in ((True, (f32.k_stream, q8.k_stream)), (False, (f32.v_stream, q8.v_stream))):
        if not qs.quantized:
            continue
        codes, scales = quantize(fs.data[:, :, 5:6], qs.spec, qs.block)        # the new token, slot 5
        got_codes = qs.codes[..., 5:6].transpose(-1, -2) if keys else qs.codes[:, :, 5:6]
        assert torch.equal(got_codes, codes) and torch.equal(qs.scales[..., 5:6].transpose(-1, -2), scales)


@pytest.mark.parametrize("case", ["fp16 cache", "q4_0 cache", "q8_0 window", "rotate_keys", "rotate_values", "prefill", "grad", "switched off",
                                  "bf16 model", "gelu model", "hooked"])
def test_everything_else_takes_the_torch_path(case, taken):
    model = make_model(seed=7, **({"mlp": "gelu", "norm": "layer", "positions": "learned"} if case == "gelu model" else {}))
    if case == "bf16 model":
        model = model.to(torch.bfloat16)
    kind = {"fp16 cache": "fp16", "q4_0 cache": "q4_0"}.get(case, "fp32")
    with torch.inference_mode(case != "grad"):
        if case == "grad":
            model.requires_grad_(True)
        if case == "switched off":
            model.fast_decode = False
        if case == "hooked":                                   # contrastive search reads the norm's output
            model.norm.register_forward_hook(lambda *_: None)
        cache = model.new_cache(1, 16, kind)
        if case in ("rotate_keys", "rotate_values", "q8_0 window"):
            from caramba.cache import CachePolicy
            cache = model.new_cache(1, 16, CachePolicy.build("q8_0", residual_len=4) if case == "q8_0 window"
                                    else CachePolicy.build("fp32", **{case: True}))
        model(torch.tensor([[1, 2, 3]]), cache=cache)
        model(torch.tensor([[4, 5]]) if case == "prefill" else torch.tensor([[4]]), cache=cache)
    assert taken == []


class Subclassed(torch.nn.Linear):
    """A projection the step has no plan slot for (it matches exact types only)."""


def test_a_projection_without_a_kernel_keeps_the_torch_path_until_it_is_swapped(taken):
    model = make_model(seed=8)
    plain = model.layers[1].mlp.w2
    other = Subclassed(plain.in_features, plain.out_features, bias=False).requires_grad_(False)
    other.weight.copy_(plain.weight)
    model.layers[1].mlp.w2 = other
    ids = torch.tensor([[5, 9, 1]])
    for _ in range(2):                                         # the verdict is remembered, not re-raised
        run_both(model, ids, [7])
    assert taken == []
    model.layers[1].mlp.w2 = plain
    run_both(model, ids, [7])
    assert len(taken) == 1


def test_a_swapped_projection_rebuilds_the_plan(taken):
    model = make_model(seed=8)
    ids = torch.tensor([[5, 9, 1]])
    run_both(model, ids, [7])
    quant.quantize_model(model, act="f32")                     # new modules: the old pointers must go
    ref, got = run_both(model, ids, [7, 8])
    assert len(taken) == 3
    assert_same(ref, got, model.config)


def test_portable_build_equals_the_native_one(monkeypatch, tmp_path, taken):
    """The scalar loops (built without -march=native, as on a CPU without AVX2)."""
    monkeypatch.setenv("CARAMBA_CACHE_DIR", str(tmp_path))
    flags = [f for f in kernels.FLAGS if not f.startswith("-march")]
    lib, status = kernels.load(fast_decode.SOURCE, fast_decode._SIGNATURES, "test", flags=flags)
    assert status == "c"
    model = make_model(seed=9)
    to_q4_1(model, "f32")
    ids = torch.tensor([[5, 9, 1, 44]])
    ref, native = run_both(model, ids, [7, 8])
    monkeypatch.setattr(fast_decode, "library", lambda: lib)
    _, portable = run_both(model, ids, [7, 8])
    assert len(taken) == 4
    assert_same(ref, portable, model.config)
    assert_same(native, portable, model.config)
    taken.clear()
    test_q8_0_caches_equal_the_torch_path("q8_0", 32, taken)      # the portable fp16 conversion too


def test_thread_choice_moves_to_one_thread_when_that_is_faster_and_backs_off_when_not(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    choice = fast_decode.ThreadChoice()
    speed = {2: 1.0, 1: 0.1}                          # a busy machine: two threads stall
    used = []
    for _ in range(40):
        n = choice.next()
        used.append(n)
        choice.took(n, speed[n])
    assert used[:15] == [2] * 15 and used[15] == 1    # the first trial, after FIRST_INTERVAL steps
    assert choice.current == 1 and set(used[16:31]) == {1}
    speed = {2: 1.0, 1: 2.0}                          # quiet again: trials of two threads win back
    for _ in range(40):
        n = choice.next()
        choice.took(n, speed[n])
    assert choice.current == 2
    trials = []                                       # and a losing trial doubles the wait for the next
    for i in range(200):
        n = choice.next()
        if n != choice.current:
            trials.append(i)
        choice.took(n, speed[n])
    gaps = [b - a for a, b in zip(trials, trials[1:])]
    assert gaps and all(b > a for a, b in zip(gaps, gaps[1:]))
    pinned = fast_decode.ThreadChoice(fixed=2)
    assert {pinned.next() for _ in range(100)} == {2}
