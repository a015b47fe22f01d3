"""The one-call decode step (caramba.model.fast_decode, decode_step.c) against the torch path it
stands in for: the same logits and the same cache, for every weight layout and format it reads,
batches, padding and windows; and the torch path wherever it does not apply. Each test builds
the backends explicitly (caramba.model.backend): TorchStep for the reference, CStep for the C step."""

from __future__ import annotations

import gguf
import pytest
import torch

import tolerance as tol
from caramba import kernels
from caramba.model import fast_decode, quant
from caramba.model.backend import CStep, TorchStep
from caramba.model.quant import QuantLinear, gguf_blocks
from conftest import make_model


@pytest.fixture(autouse=True)
def needs_kernels():
    if fast_decode.library() is None:
        pytest.skip(f"decode step kernel {fast_decode.status()}")


def to_q4_1(model, act: str) -> None:
    """Every projection and the head as llama.cpp Q4_1 blocks (gguf's own quantizer)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            w = quant._float_weight(child)
            if w is not None and not isinstance(child, QuantLinear):
                N, K = w.shape
                p = gguf_blocks(gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_1), "Q4_1", (N, K))
                setattr(parent, name, QuantLinear("q4_1", p["qs"], p["d"], p["m"], getattr(child, "bias", None), act=act))


def backend(model, fast: bool, threads: int | None = None):
    """The C step (pinned to `threads`) or the torch path, chosen explicitly."""
    return CStep(model, fast_decode.ThreadChoice(fixed=threads)) if fast else TorchStep(model)


def run_both(model, ids, steps, kind="fp32", max_len=40, **forward_kw):
    """(torch path, C path): logits of a prefill and `steps` teacher-forced decode steps, and the caches."""
    out = []
    for fast in (False, True):
        step = backend(model, fast)
        with torch.inference_mode():
            cache = model.new_cache(ids.shape[0], max_len, kind)
            logits = [model(ids, cache=cache, **forward_kw.get("prefill", {}))[:, -1:]]   # the same prefill for both
            for t in steps:
                tok = torch.full((ids.shape[0], 1), t)
                logits.append(step(tok, cache=cache, **forward_kw.get("step", {})))
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


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("mlp", ["swiglu", "geglu"])
def test_an_mlp_held_row_major_is_read_as_rows_and_equals_the_torch_path(batch, mlp, taken):
    """load_model holds a CPU model's gate|up row-major (InputMajorLinear.hold_row_major): the step
    reads it as an nn.Linear's rows, and both paths agree with each other and with the input-major
    model they came from."""
    model = make_model(seed=4, mlp=mlp)
    ids = torch.randint(0, 97, (batch, 5), generator=torch.Generator().manual_seed(5))
    before, _ = run_both(model, ids, [7, 8, 9])
    for layer in model.layers:
        layer.mlp.w13.hold_row_major()
    plan = fast_decode._Plan(model)
    assert {p.w13.fmt for p in plan.layers} == {quant.F32_ROWS}
    taken.clear()
    ref, got = run_both(model, ids, [7, 8, 9])
    assert len(taken) == 3
    assert_same(ref, got, model.config)
    assert_same(before, got, model.config)


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


@pytest.mark.parametrize("fmt,act", [("q8_0", "q8"), ("q4_0", "q8"), ("q4_1", "q8"), ("q8_0", "i16"), ("q4_1", "i16")])
def test_quantized_weights_with_rounded_activations_follow_the_torch_path(fmt, act, taken):
    """With rounded activations a sum-order difference can move an activation across a rounding
    boundary of its grid, which shifts it by one step (1/127 or 1/32767 of its block's largest
    value): the two paths agree to that, not to fp32 rounding."""
    model = make_model(seed=4)
    if fmt == "q4_1":
        to_q4_1(model, act)
    else:
        quant.quantize_model(model, fmt, act=act)
    ids = torch.tensor([[5, 9, 1, 44, 3]])
    (ref, _), (got, _) = run_both(model, ids, [7, 8])
    assert len(taken) == 2
    step = 2 / quant.ACTIVATION_LEVELS[act] * ref.abs().max()
    assert (got - ref).abs().max() <= step + tol.forward(ref, model.config)["atol"]
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("weights", ["q8_0", "fp32"])
@pytest.mark.parametrize("name", [None, "q4_0", "k=q4_1c,v=q4_1 qblock=4"])
def test_a_steps_bits_do_not_depend_on_the_thread_count(name, weights, taken):
    """The attention splits the cache into fixed parts of ATT_PART (64) slots, not one share per
    thread, and every product splits its outputs (rows, or bands of an input-major weight's
    columns), never a sum: so 1, 2 and 3 threads give the same bits. ThreadChoice switches counts
    mid-generation, and with q8 activations a summation-order difference can cross a rounding
    boundary (SmolLM2 q8_0: logits moved by up to 0.74 when the split followed the threads), so
    this is what keeps a run reproducible. The tiny model's vocabulary (97) is narrower than a
    band, so the fp32 case also runs a wide input-major head: 1000 columns, uneven bands."""
    from caramba.cache import CachePolicy

    policy = CachePolicy.build(**POLICIES[name]) if name else CachePolicy.build("fp32")
    model = make_model(seed=8)
    if weights == "q8_0":
        quant.quantize_model(model, "q8_0", act="q8")
    else:
        assert type(model.head).__name__ == "InputMajorLinear"
        wide = torch.randn(model.config.dim, 1000, generator=torch.Generator().manual_seed(10)) * 0.1
        model.head.weight_t = torch.nn.Parameter(wide, requires_grad=False)
        model.config.vocab_size = 1000
    ids = torch.randint(0, 97, (2, 150), generator=torch.Generator().manual_seed(9))   # three parts and more
    runs = []
    for threads in (1, 2, 3):
        step = backend(model, True, threads)
        with torch.inference_mode():
            cache = model.new_cache(2, 160, policy)
            model(ids, cache=cache)                            # the same prefill for all: the torch path
            steps = [step(torch.full((2, 1), t), cache=cache) for t in (7, 8, 9)]
            steps.append(step(torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]), cache=cache))   # a verify
        runs.append(torch.cat(steps, 1))
    per_channel_keys = name is not None and "q4_1c" in name    # a verify into them takes the torch path
    assert len(taken) == (9 if per_channel_keys else 12)
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])


@pytest.mark.parametrize("weights", ["fp32", "q8_0", "q4_1"])
def test_a_rows_step_bits_do_not_depend_on_the_batch_around_it(weights, taken):
    """A row of a batch goes through the same arithmetic wherever it lands: the fp32 register
    tiles (two token rows per pass over an input-major band, four per pass over [N, K] rows, a
    single row for the odd one out) and the block formats' tiles sum a row in one fixed order.
    Batches of 2, 5 and 8 copies of one sequence, every token through the C step from an empty
    cache, give the same bits in every row. The block formats give batch 1's bits too; fp32 [N, K]
    weights at batch 1 take dot_f32 (four accumulators a row: a single-accumulator tile measured
    ~2% slower there), so fp32 batch 1 is within fp32 rounding of the rest, and with exact_rows
    the same bits. The fp32 head is
    widened to 1003 input-major columns: bands with a scalar tail."""
    model = make_model(seed=12)
    if weights == "q8_0":
        quant.quantize_model(model, "q8_0", act="q8")
    elif weights == "q4_1":
        to_q4_1(model, act="f32")
    else:
        wide = torch.randn(model.config.dim, 1003, generator=torch.Generator().manual_seed(13)) * 0.1
        model.head.weight_t = torch.nn.Parameter(wide, requires_grad=False)
        model.config.vocab_size = 1003
    step = backend(model, True, threads=2)
    tokens = [5, 17, 3, 88, 41, 9]
    runs = {}
    for batch in (1, 2, 5, 8):
        with torch.inference_mode():
            cache = model.new_cache(batch, 16)
            runs[batch] = torch.cat([step(torch.full((batch, 1), t), cache=cache) for t in tokens], 1)
    assert len(taken) == 4 * len(tokens)
    alone = runs[2][0] if weights == "fp32" else runs[1][0]
    for batch in (2, 5, 8):
        for row in range(batch):
            assert torch.equal(runs[batch][row], alone), f"batch {batch}, row {row}"
    bound = tol.forward(runs[1], model.config)
    torch.testing.assert_close(runs[2][:1], runs[1], atol=bound["atol"], rtol=0)
    exact = CStep(model, fast_decode.ThreadChoice(fixed=2), exact_rows=True)   # batch 1 summed as a batch's rows
    with torch.inference_mode():
        cache = model.new_cache(1, 16)
        assert torch.equal(torch.cat([exact(torch.full((1, 1), t), cache=cache) for t in tokens], 1), runs[2][:1])


@pytest.mark.parametrize("name", [None, "q4_0l rotated", "k=q4_1c,v=q4_1 qblock=4", "k=q2_1c,v=q2_1 qblock=4 residual_len=3"])
def test_padding_and_windows_come_as_a_mask(name, taken):
    """Also for quantized caches: the 6-token prompt and 3 steps complete a per-channel group of 4."""
    from caramba.cache import CachePolicy

    policy = CachePolicy.build(**POLICIES[name]) if name else CachePolicy.build("fp32")
    model = make_model(seed=5)
    ids = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(6))
    slot_mask = torch.ones(2, 40, dtype=torch.bool)
    slot_mask[1, :2] = False                                   # row 1 is left-padded by two slots
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 0, 0, 1, 2, 3]])
    out = []
    for fast in (False, True):
        step = backend(model, fast)
        with torch.inference_mode():
            cache = model.new_cache(2, 40, policy)
            logits = [model(ids, positions, cache, slot_mask)[:, -1:]]
            for i, t in enumerate([7, 8, 9]):
                pos = positions[:, -1:] + 1 + i
                logits.append(step(torch.full((2, 1), t), pos, cache, slot_mask, window=4))   # a window too
        out.append((torch.cat(logits, 1), cache))
    assert len(taken) == 3
    if name:
        assert_same_cache_kind(*out, model.config, policy)
    else:
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
    (ref_logits, _), (got_logits, _) = ref, got
    torch.testing.assert_close(got_logits, ref_logits, **tol.cache_paths(ref_logits, model.config, "q8_0"))
    # the quantizer, bit for bit: one step on an fp32 cache and on this policy's, from one prefill
    with torch.inference_mode():
        caches = []
        for kind in ("fp32", policy):
            cache = model.new_cache(2, 40, kind)
            model(ids, cache=cache)
            backend(model, True)(torch.tensor([[11], [12]]), cache=cache)
            caches.append(cache)
    f32, q8 = caches[0].layers[0], caches[1].layers[0]
    for keys, (fs, qs) in ((True, (f32.k_stream, q8.k_stream)), (False, (f32.v_stream, q8.v_stream))):
        if not qs.quantized:
            continue
        codes, scales = quantize(fs.data[:, :, 5:6], qs.spec, qs.block)        # the new token, slot 5
        got_codes = qs.codes[..., 5:6].transpose(-1, -2) if keys else qs.codes[:, :, 5:6]
        assert torch.equal(got_codes, codes) and torch.equal(qs.scales[..., 5:6].transpose(-1, -2), scales)


# Caches the step reads and writes itself beyond fp32 and q8_0: CachePolicy.build keywords. The
# 5-token prompt plus STEPS completes per-channel key groups of 4 (several times) and of 16.
POLICIES = {
    "q4_0": dict(kind="q4_0"),
    "q4_0l qblock=4": dict(kind="q4_0l", qblock=4),
    "k=q4_0": dict(kind="fp32", policy="k=q4_0"),
    "q4_1 qblock=8": dict(kind="q4_1", qblock=8),
    "k=q4_1c,v=q4_1 qblock=16": dict(kind="q4_1", policy="k=q4_1c", qblock=16),   # the best 4-bit policy shipped
    "k=q4_1c,v=q4_1 qblock=4": dict(kind="q4_1", policy="k=q4_1c", qblock=4),
    "k=q2_1c,v=q2_1 qblock=4 residual_len=3": dict(kind="q2_1", policy="k=q2_1c", qblock=4, residual_len=3),
    "q2_1 qblock=8 residual_len=2": dict(kind="q2_1", qblock=8, residual_len=2),
    "q8_0 residual_len=4": dict(kind="q8_0", residual_len=4),
    "fp32 rotated": dict(kind="fp32", rotate_keys=True, rotate_values=True),
    "q4_0l rotated": dict(kind="q4_0l", rotate_keys=True, rotate_values=True),           # llama.cpp's q4_0 cache
    "k=q4_1c,v=q4_1 qblock=4 rotated": dict(kind="q4_1", policy="k=q4_1c", qblock=4, rotate_keys=True,
                                            rotate_values=True),
    "nf4": dict(kind="nf4"),
    "nf4 qblock=4 residual_len=3": dict(kind="nf4", qblock=4, residual_len=3),
    "nf4 rotated": dict(kind="nf4", rotate_keys=True, rotate_values=True),
    "k=nf4,v=q4_0 qblock=8": dict(kind="q4_0", policy="k=nf4", qblock=8),
    # 16-bit float streams: each new K and V rounded as torch's copy rounds it, read back widened
    "fp16": dict(kind="fp16"),
    "bf16": dict(kind="bf16"),
    "k=bf16,v=q4_1 qblock=8": dict(kind="q4_1", policy="k=bf16", qblock=8),
    "bf16 rotated": dict(kind="bf16", rotate_keys=True, rotate_values=True),
}
STEPS = list(range(7, 21))


def assert_same_cache_kind(ref, got, config, policy):
    """The two paths of a quantized cache agree to one storage step (tol.cache_paths): a K or V value
    a rounding apart, or a rotation summed in another order, can sit on either side of a code
    boundary. Every stream reads back the same, and the rings' bookkeeping moved alike."""
    (ref_logits, ref_cache), (got_logits, got_cache) = ref, got
    coarsest = max((c.kind.value for c in (policy.k, policy.v)), key=tol.STORAGE_STEP.get)
    torch.testing.assert_close(got_logits, ref_logits, **tol.cache_paths(ref_logits, config, coarsest))
    assert got_cache.length == ref_cache.length
    for a, b in zip(got_cache.layers, ref_cache.layers):
        for s_got, s_ref in ((a.k_stream, b.k_stream), (a.v_stream, b.v_stream)):
            want = s_ref.read(b.length, torch.float32)
            torch.testing.assert_close(s_got.read(a.length, torch.float32), want,
                                       **tol.cache_paths(want, config, s_ref.cfg.kind.value))
            assert getattr(s_got, "fp_lo", None) == getattr(s_ref, "fp_lo", None)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("name", POLICIES)
def test_4_and_2_bit_windowed_and_rotated_caches_equal_the_torch_path(name, batch, taken):
    from caramba.cache import CachePolicy

    policy = CachePolicy.build(**POLICIES[name])
    model = make_model(seed=11)
    ids = torch.randint(0, 97, (batch, 5), generator=torch.Generator().manual_seed(12))
    ref, got = run_both(model, ids, STEPS, kind=policy)
    assert len(taken) == len(STEPS)
    assert_same_cache_kind(ref, got, model.config, policy)


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q4_0l", "q4_1", "q2_1", "nf4"])
@pytest.mark.parametrize("heads", [(2, 2, 64), (6, 2, 64), (8, 2, 64), (5, 1, 64), (6, 2, 32)])
def test_values_read_straight_from_their_codes_equal_the_torch_path_and_the_reference(kind, heads, taken):
    """Whole 16-slot chunks of coded values go from their codes to every query head's multiply-add
    (kv_stream.c's value_codes: 1 to 5 heads a KV head, in groups of 3; 32 or 16 columns a pass;
    32-wide 2-bit heads fall back to decoded rows), and the softmax weights take a vector exp: the
    torch path's logits within a storage step, and the scalar level's (libm's expf, rows decoded one
    by one) too."""
    from caramba.cache import CachePolicy
    from caramba.model import isa

    n_heads, n_kv, head_dim = heads
    policy = CachePolicy.build(kind=kind)
    model = make_model(seed=14, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim)
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(15))   # 40 slots: 2 whole chunks
    ref, got = run_both(model, ids, STEPS[:6], kind=policy, max_len=48)
    assert len(taken) == 6
    assert_same_cache_kind(ref, got, model.config, policy)
    with isa.use_isa("scalar"):
        _, scalar = run_both(model, ids, STEPS[:6], kind=policy, max_len=48)
    assert_same_cache_kind(scalar, got, model.config, policy)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", ["q4_1 k=q4_1c qblock=8", "q2_1 k=q2_1c qblock=16"])
def test_per_channel_keys_over_many_groups_equal_the_torch_path(name, threads, taken):
    """Per-channel key scores take the groups' factors 8 groups at a time (kv_stream.c): 140
    positions make full and partial sets of 8 groups, groups of one and two slot vectors, and with
    two threads a group split between them."""
    from caramba.cache import CachePolicy

    torch.set_num_threads(threads)
    kind, keys, qblock = name.split()
    policy = CachePolicy.build(kind, keys, qblock=int(qblock.removeprefix("qblock=")))
    model = make_model(seed=17)
    ids = torch.randint(0, 97, (1, 5), generator=torch.Generator().manual_seed(18))
    steps = [int(t) for t in torch.randint(0, 97, (135,), generator=torch.Generator().manual_seed(19))]
    ref, got = run_both(model, ids, steps, kind=policy, max_len=144)
    assert len(taken) == len(steps)
    assert_same_cache_kind(ref, got, model.config, policy)



@pytest.mark.parametrize("name", [None, "nf4 qblock=4 residual_len=3"])
def test_a_reordered_cache_is_read_where_its_rows_went(name, taken):
    """Beam and contrastive search reorder the cache's rows into new tensors: the step's table of
    stream pointers, built once per cache, is rebuilt (with the rings' positions) when they move."""
    from caramba.cache import CachePolicy

    policy = None if name is None else CachePolicy.build(**POLICIES[name])
    model = make_model(seed=21)
    ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(22))
    out = []
    for fast in (False, True):
        step = backend(model, fast)
        with torch.inference_mode():
            cache = model.new_cache(2, 40, policy or "fp32")
            logits = [model(ids, cache=cache)[:, -1:]]
            for t, rows in ((7, None), (8, [1, 0]), (9, [1, 1]), (10, None), (11, [0, 1])):
                if rows is not None:
                    cache.reorder(torch.tensor(rows))
                logits.append(step(torch.full((2, 1), t), cache=cache))
        out.append((torch.cat(logits, 1), cache))
    assert len(taken) == 5
    if policy is None:
        assert_same(*out, model.config)
    else:
        assert_same_cache_kind(*out, model.config, policy)

# per-token streams only: a per-channel group is completed one token at a time (those take the torch path)
CHUNK_POLICIES = [None, "q4_0", "q4_0l rotated", "q2_1 qblock=8 residual_len=2", "q8_0 residual_len=4",
                  "nf4 qblock=4 residual_len=3", "nf4 rotated", "fp16", "bf16"]


def run_chunks(model, ids, chunks, policy, fast, slot_mask=None, positions=None, window=None):
    """Logits of a forward per chunk of new tokens [B, n] (the first into the empty cache; with
    last_only every other chunk, as a prefill asks), and the cache."""
    step = backend(model, fast)
    out = []
    with torch.inference_mode():
        cache = model.new_cache(ids.shape[0], 40, policy)
        for i, (a, b) in enumerate(chunks):
            pos = None if positions is None else positions[:, a:b]
            logits = step(ids[:, a:b], pos, cache, slot_mask, last_only=i % 2 == 1, window=window)
            out.append(logits if i % 2 else logits[:, -1:])    # last_only: [B, 1, V]
            if i % 2 == 0:
                out.append(logits[:, :-1])
    return torch.cat(out, 1), cache


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("name", CHUNK_POLICIES)
def test_several_new_tokens_per_row_equal_the_torch_path(name, batch, threads, taken):
    """A verify of k + 1 drafted tokens (or a short chunk) through the step: new token t of a row
    sees the row's cache and its new tokens 0..t, written where the torch path writes them."""
    from caramba.cache import CachePolicy

    torch.set_num_threads(threads)

    policy = CachePolicy.build(**POLICIES[name]) if name else CachePolicy.build("fp32")
    model = make_model(seed=13)
    ids = torch.randint(0, 97, (batch, 16), generator=torch.Generator().manual_seed(14))
    chunks = [(0, 5), (5, 8), (8, 9), (9, 13), (13, 16)]      # 5 into the empty cache, then 3, 1, 4, 3
    ref = run_chunks(model, ids, chunks, policy, fast=False)
    got = run_chunks(model, ids, chunks, policy, fast=True)
    assert len(taken) == len(chunks)
    if name:
        assert_same_cache_kind(ref, got, model.config, policy)
    else:
        assert_same(ref, got, model.config)


def test_several_new_tokens_with_padding_and_a_window(taken):
    model = make_model(seed=15)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(16))
    slot_mask = torch.ones(2, 40, dtype=torch.bool)
    slot_mask[1, :3] = False                                   # row 1 is left-padded by three slots
    positions = torch.tensor([list(range(12)), [0, 0, 0] + list(range(9))])
    chunks = [(0, 6), (6, 9), (9, 12)]
    ref = run_chunks(model, ids, chunks, "fp32", False, slot_mask, positions, window=5)
    got = run_chunks(model, ids, chunks, "fp32", True, slot_mask, positions, window=5)
    assert len(taken) == 3
    assert_same(ref, got, model.config)


def test_several_new_tokens_into_per_channel_keys_take_the_torch_path(taken):
    from caramba.cache import CachePolicy

    model = make_model(seed=17)
    policy = CachePolicy.build(**POLICIES["k=q4_1c,v=q4_1 qblock=4"])
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(18))
    ref = run_chunks(model, ids, [(0, 5), (5, 8), (8, 9)], policy, fast=False)
    got = run_chunks(model, ids, [(0, 5), (5, 8), (8, 9)], policy, fast=True)
    assert len(taken) == 1                                     # the one-token step only
    assert_same_cache_kind(ref, got, model.config, policy)


@pytest.mark.parametrize("name", [n for n in POLICIES if "rotated" not in n])
def test_the_step_writes_the_codes_of_caramba_quantizers(name):
    """Bit for bit where both paths quantize the same K and V: layer 0 (its K and V do not depend
    on the cache) of steps on an fp32 cache and on this policy's, from one prefill. Per-channel
    keys: every group, including those the step completed; rings: exact copies; fp16 / bf16
    streams: torch's conversion of the fp32 values."""
    from caramba.cache import CachePolicy
    from caramba.cache.quant import quantize, quantize_channels

    policy = CachePolicy.build(**POLICIES[name])
    model = make_model(seed=13)
    ids = torch.tensor([[5, 9, 1, 44, 3], [7, 7, 2, 90, 61]])
    caches = []
    with torch.inference_mode():
        for kind in ("fp32", policy):
            cache = model.new_cache(2, 40, kind)
            model(ids, cache=cache)
            step = backend(model, True)
            for t in STEPS:
                step(torch.tensor([[t], [t + 30]]), cache=cache)
            caches.append(cache)
    f32, qc = caches[0].layers[0], caches[1].layers[0]
    n = qc.length
    checked = 0
    for keys, fs, qs in ((True, f32.k_stream, qc.k_stream), (False, f32.v_stream, qc.v_stream)):
        x = fs.data[:, :, :n]
        if not qs.quantized:
            assert torch.equal(qs.data[:, :, :n].view(torch.int16), x.to(qs.data.dtype).view(torch.int16))
            checked += qs.data.dtype != torch.float32
            continue
        if qs.spec.per_channel:
            m = n // qs.G * qs.G
            codes, params = quantize_channels(x[:, :, :m], qs.spec, qs.G)
            got_params = qs.scales[..., : m // qs.G]
        else:
            m = n
            codes, params = quantize(x, qs.spec, qs.block)
            got_params = qs.scales[..., :n]
        got_codes = qs.codes[..., :m].transpose(-1, -2) if keys else qs.codes[:, :, :m]
        assert torch.equal(got_codes, codes) and torch.equal(got_params.transpose(-1, -2), params)
        if qs.ring is not None:
            r0 = qs.fp_start(n)
            assert r0 < n and torch.equal(qs.residual(r0, n, torch.float32), x[:, :, r0:])
        checked += 1
    assert checked


def test_a_rollback_into_a_quantized_group_refills_through_the_torch_path(taken):
    """A step whose write must first refill a per-channel group from its codes (the ring no longer
    holds it) goes to the torch path; the steps after it take the C step again."""
    from caramba.cache import CachePolicy

    policy = CachePolicy.build("q4_1", "k=q4_1c", qblock=4)
    model = make_model(seed=14)
    ids = torch.tensor([[5, 9, 1, 44, 3]])
    out = []
    for fast in (False, True):
        step = backend(model, fast)
        with torch.inference_mode():
            cache = model.new_cache(1, 40, policy)
            model(ids, cache=cache)
            logits = [step(torch.tensor([[t]]), cache=cache) for t in range(7, 19)]   # slots 5..16
            cache.truncate(10)             # into group [8, 12), whose head the ring (8 slots) no longer holds
            assert cache.layers[0].k_stream.refills(10)
            logits += [step(torch.tensor([[t]]), cache=cache) for t in range(30, 34)]
        out.append((torch.cat(logits, 1), cache))
    assert len(taken) == 12 + 3
    assert_same_cache_kind(*out, model.config, policy)


KV_KINDS = {kind.value: kid for kind, kid in {**fast_decode.TOKEN_KINDS, **fast_decode.CHANNEL_KINDS}.items()}


def quantizer_inputs(spec) -> torch.Tensor:
    """[208, 32] (a codebook kind: [272, 32]): random values over many magnitudes; rows whose block
    scale comes out as exactly 1/8 and whose other elements are multiples of 1/16, so that x / scale
    (+ the kind's shift) lands exactly on code boundaries (a codebook's: its midpoints, their float32
    neighbours and its levels, times 1/8); ties of magnitude, zeros, signed zeros, fp16 subnormal
    scales, values near the fp16 range."""
    g = torch.Generator().manual_seed(15)
    span = 0.125 * spec.half_range / (1 + 2**-10)    # the block range whose scale rounds to 1/8
    edges = torch.randint(-64, 65, (64, 32), generator=g) * 0.0625
    if spec.zero_point:                              # minimum -1 (exact in fp16), maximum -1 + span
        edges = edges.clamp(-1.0, -1.0 + span)
        edges[:, 0], edges[:, 1] = -1.0, -1.0 + span
    else:                                            # the peak (mid-tread: negative, so the scale is +1/8)
        edges = edges.clamp(-span, span)
        edges[:, 0] = -span if spec.mid_tread else span
    if spec.levels is not None:
        # The peak `span` gives scale 1/8, so y = x / scale is exact: x on a midpoint (times 1/8) is a tie
        # (the lower code), its float32 neighbours either side, and the inner levels.
        mids = spec.midpoints
        on = torch.cat([mids, torch.nextafter(mids, torch.full_like(mids, 2.0)),
                        torch.nextafter(mids, torch.full_like(mids, -2.0)), spec.levels[1:-1]])   # [59]
        ties = on[torch.randint(0, on.numel(), (64, 32), generator=g)] * 0.125
        ties[:8, 1:] = on[torch.arange(8 * 31) % on.numel()].reshape(8, 31) * 0.125   # every one, in order
        sign = torch.where(torch.arange(64) % 2 == 0, 1.0, -1.0)
        ties[:32, 0] = span * sign[:32]                                     # the peak, either sign: blocks of 32
        ties[32:, 0::2] = span * sign[32:, None]                            # and in every pair: blocks of 8 and 2
        edges = torch.cat([edges, ties])
    rows = [torch.randn(64, 32, generator=g) * 10.0 ** torch.randint(-6, 5, (64, 1), generator=g),
            torch.randint(-16, 17, (32, 32), generator=g) * 0.125,
            torch.randint(-3, 4, (32, 32), generator=g) * 2.0 ** -20,
            torch.tensor([[0.5, -0.5] * 16, [-0.5, 0.5] * 16, [0.0] * 32, [-0.0, 0.0] * 16, [3e4, -2e4] * 16,
                          [1e-8, -1e-8] * 16, [2.0] * 32, [-7.0] * 32,
                          # a block's lowest or highest a zero of either sign, the first of them +0 or -0
                          [0.0, -0.0, 1.0, 2.0] * 8, [-0.0, 0.0, 1.0, 2.0] * 8, [-1.0, -0.0, 0.0, -2.0] * 8,
                          [-1.0, 0.0, -0.0, -2.0] * 8, [0.0] * 16 + [-0.0] * 16, [-0.0] * 16 + [0.0] * 16,
                          [0.0, 3.0] * 16, [-0.0, -3.0] * 16]),
            edges]
    return torch.cat(rows)


@pytest.mark.parametrize("kind", KV_KINDS)
def test_the_steps_quantizers_are_caramba_quantizers_bit_for_bit(kind, lib=None):
    """decode_step.c's quantizers (quantize_kv: what the step writes) against caramba.cache.quant's
    torch reference (quantize itself takes these quantizers on the CPU: test_kv_quant holds it to
    the reference too)."""
    from caramba.cache.kinds import spec_of
    from caramba.cache.quant import quantize_channels, unpack_codes
    from caramba.cache.quant import quantize_reference as quantize

    lib = lib or fast_decode.library()
    spec = spec_of(kind)
    x = quantizer_inputs(spec)
    for block in (32, 8, 2):
        if spec.per_channel:     # a row is one channel's group of `block` tokens
            xr = x[:, :block].contiguous()
            codes, params = quantize_channels(xr.T, spec, block)                 # [block, 8 rows / 2], [1, 2 rows]
            want_codes, want_params = codes.T, params.reshape(2, -1).T           # [rows, block] packed, [rows, 2]
            D, qb = block, block
        else:
            xr, D, qb = x, 32, block
            want_codes, want_params = quantize(xr, spec, qb)
        u = torch.empty(xr.shape[0], D, dtype=torch.uint8)
        p = torch.empty(xr.shape[0], D // qb * spec.params, dtype=torch.float16)
        lib.quantize_kv(KV_KINDS[kind], xr.data_ptr(), xr.shape[0], D, qb, u.data_ptr(), p.data_ptr())
        if spec.per_channel:
            want_codes = unpack_codes(want_codes.T.contiguous(), spec.bits).T      # unpacked along the channels
        elif spec.packed:
            want_codes = unpack_codes(want_codes, spec.bits)
        got = u.view(torch.int8) if spec.dtype == torch.int8 else u
        assert torch.equal(got, want_codes), (kind, block)
        assert torch.equal(p.view(torch.int16), want_params.contiguous().view(torch.int16)), (kind, block)


def test_the_nf4_tables_are_the_kinds_codebook_and_midpoints(lib=None):
    """kv_stream.c hard-codes nf4's levels and midpoints: they must be KindSpec's float32 values, bit
    for bit."""
    from caramba.cache.kinds import KVCacheKind

    lib = lib or fast_decode.library()
    spec = KVCacheKind.NF4.spec
    levels, mids = torch.empty(16), torch.empty(15)
    lib.kv_nf4_tables(levels.data_ptr(), mids.data_ptr())
    assert torch.equal(levels.view(torch.int32), spec.levels.view(torch.int32))
    assert torch.equal(mids.view(torch.int32), spec.midpoints.view(torch.int32))


@pytest.mark.parametrize("case", ["per-channel values", "long prefill", "grad"])
def test_forwards_the_step_cannot_take_go_to_the_torch_path(case, taken):
    """A CStep hands every forward it cannot compute to the model's own forward, and says so."""
    from caramba.cache import CachePolicy

    model = make_model(seed=7)
    kind = {"per-channel values": CachePolicy.build("fp32", "v=q4_1c", qblock=4)}.get(case, "fp32")
    with torch.inference_mode(case != "grad"):
        if case == "grad":
            model.requires_grad_(True)
        step = CStep(model)
        cache = model.new_cache(1, 16, kind)
        cache = model.new_cache(1, 40, kind) if case == "long prefill" else cache
        ref = model.new_cache(1, 40, kind) if case == "long prefill" else None
        ids = torch.arange(fast_decode.MAX_ROWS + 1)[None] if case == "long prefill" else torch.tensor([[1, 2, 3]])
        got = step(ids, cache=cache)
        if ref is not None:
            torch.testing.assert_close(got, model(ids, cache=ref), atol=0, rtol=0)   # the same forward
        if case != "long prefill":
            step(torch.tensor([[4]]), cache=cache)
    assert taken == []
    assert step.path == "torch" if case != "long prefill" else step.path == "c"   # a long prefill is no step


@pytest.mark.parametrize("case", ["switched off", "kernels off", "bf16 model", "gelu model"])
def test_choose_gives_the_torch_path_where_the_step_cannot_run(case, monkeypatch):
    from caramba.model import backend

    model = make_model(seed=7, **({"mlp": "gelu", "norm": "layer", "positions": "learned"} if case == "gelu model" else {}))
    if case == "bf16 model":
        model = model.to(torch.bfloat16)
    if case == "switched off":
        model.fast_decode = False
    if case == "kernels off":                                  # the library loads nothing, and says why
        monkeypatch.setenv("CARAMBA_KERNELS", "0")
        fast_decode.library.cache_clear()
    try:
        chosen = backend.choose(model)
        assert isinstance(chosen, TorchStep) and chosen.path == "torch"
        if case != "switched off":
            with pytest.raises(fast_decode.Unsupported, match="CARAMBA_KERNELS=0" if case == "kernels off" else "fp32"):
                CStep(model)
    finally:
        monkeypatch.undo()
        fast_decode.library.cache_clear()                      # loaded again for the tests after
    if case == "switched off":
        del model.fast_decode
        assert isinstance(backend.choose(model), CStep)


def test_quantized_scales_cast_to_fp32_get_the_torch_path():
    """model.float() turns a QuantLinear's fp16 scales into fp32 ones, which the step would read as
    fp16 bits: it refuses the projection instead, and choose() gives the torch path."""
    from caramba.model.backend import choose

    model = make_model(seed=8)
    quant.quantize_model(model, "q8_0", act="q8")
    assert isinstance(choose(model), CStep)
    model.float()
    with pytest.raises(fast_decode.Unsupported, match="projection"):
        CStep(model)
    assert isinstance(choose(model), TorchStep)


class Subclassed(torch.nn.Linear):
    """A projection the step has no plan slot for (it matches exact types only)."""


def test_a_projection_without_a_kernel_gets_the_torch_path_until_it_is_swapped(taken):
    from caramba.model.backend import choose

    model = make_model(seed=8)
    plain = model.layers[1].mlp.w2
    other = Subclassed(plain.in_features, plain.out_features, bias=False).requires_grad_(False)
    other.weight.copy_(plain.weight)
    model.layers[1].mlp.w2 = other
    with pytest.raises(fast_decode.Unsupported, match="projection"):
        CStep(model)
    assert isinstance(choose(model), TorchStep)
    model.layers[1].mlp.w2 = plain
    assert isinstance(choose(model), CStep)                    # a backend chosen after the swap
    ref, got = run_both(model, torch.tensor([[5, 9, 1]]), [7])
    assert len(taken) == 1
    assert_same(ref, got, model.config)


def test_a_backend_built_after_a_swap_reads_the_new_weights(taken):
    model = make_model(seed=8)
    ids = torch.tensor([[5, 9, 1]])
    run_both(model, ids, [7])
    quant.quantize_model(model, act="f32")                     # new modules: a new backend reads them
    ref, got = run_both(model, ids, [7, 8])
    assert len(taken) == 3
    assert_same(ref, got, model.config)


def test_a_generator_chooses_its_backend_when_a_session_starts(taken):
    """A Generator's session reads the model as it is then: after quantize_model and reset() it
    decodes the quantized weights (as the torch path does), through the C step."""
    from caramba.infer import GenerateConfig, Generator

    config = GenerateConfig(max_new_tokens=6, temperature=0.0, eos_token_id=None, max_seq_len=32)
    model = make_model(seed=8)
    gen = Generator(model, config)
    gen.generate([5, 9, 1])
    assert isinstance(gen.backend, CStep) and gen.backend.path == "c" and len(taken) == 6   # the short prompt too
    quant.quantize_model(model, act="f32")                     # exact activations: the paths agree to fp32 rounding
    gen.reset()
    got = gen.generate([5, 9, 1])
    assert gen.backend.path == "c" and len(taken) == 12
    model.fast_decode = False                                  # the torch path, on the same weights
    ref = Generator(model, config).generate([5, 9, 1])
    assert len(taken) == 12
    assert torch.equal(got, ref)


def test_portable_build_equals_the_native_one(monkeypatch, tmp_path, taken):
    """The scalar loops (built without -march=native, as on a CPU without AVX2)."""
    monkeypatch.setenv("CARAMBA_CACHE_DIR", str(tmp_path))
    flags = [f for f in kernels.FLAGS if not f.startswith("-march")]
    lib, status = kernels.load(fast_decode.SOURCES, fast_decode._SIGNATURES, "test", flags=flags)
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
    for kind in KV_KINDS:                                          # and the quantizers of every kind
        test_the_steps_quantizers_are_caramba_quantizers_bit_for_bit(kind, lib)
    test_the_nf4_tables_are_the_kinds_codebook_and_midpoints(lib)
    for name in ("q4_0l rotated", "k=q4_1c,v=q4_1 qblock=4", "k=q2_1c,v=q2_1 qblock=4 residual_len=3",
                 "nf4 qblock=4 residual_len=3"):
        taken.clear()
        test_4_and_2_bit_windowed_and_rotated_caches_equal_the_torch_path(name, 2, taken)
        if "rotated" not in name:
            test_the_step_writes_the_codes_of_caramba_quantizers(name)


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


def test_thread_choice_ignores_steps_while_one_thread_is_asked(monkeypatch):
    """caramba.threads sets torch's count per session: steps run at one thread while torch says 1
    are no trial of the count in use (a crash once: such a step was compared with a mean never
    taken), and when torch's count comes back the choice goes on where it was."""
    asked = {"n": 2}
    monkeypatch.setattr(torch, "get_num_threads", lambda: asked["n"])
    choice = fast_decode.ThreadChoice()
    for _ in range(5):
        n = choice.next(rows=4)
        choice.took(n, 1.0, rows=4)
    asked["n"] = 1
    for rows in (1, 4, 9):                            # rows never timed at 2 threads too
        assert choice.next(rows=rows) == 1
        choice.took(1, 0.01, rows=rows)
    assert choice.current == 2 and set(choice.means) == {4} and choice.means[4] == 1.0
    asked["n"] = 2
    assert choice.next(rows=4) == 2


@pytest.mark.parametrize("kind", ["fp32", "q8_0", "bf16"])
def test_a_sliding_window_ring_takes_the_step_across_its_wraps(kind, taken):
    """`--local-window W` decodes through a ring of W + max_write slots. Until the ring first wraps
    its storage order is slot order; after, the step reads its storage under the window's mask
    (over storage order) and writes slot s at s % capacity (Stream.wrap). Logits equal the torch
    path's all along, across the wrap (tests/model/test_fast_decode_families.py: for longer)."""
    from caramba.cache.ring import RingKVCache

    model = make_model(seed=21)
    ids = torch.randint(0, 97, (1, 5), generator=torch.Generator().manual_seed(22))
    steps = torch.randint(0, 97, (10,), generator=torch.Generator().manual_seed(23)).tolist()
    window, max_write = 5, 5                                   # capacity 10: the 6th step writes slot 10
    out = []
    for fast in (False, True):
        step = backend(model, fast)
        with torch.inference_mode():
            cache = RingKVCache.build(model, 1, window=window, max_write=max_write, spec=kind)
            logits = [model(ids, cache=cache)[:, -1:]]            # the same prefill for both
            for t in steps:
                logits.append(step(torch.tensor([[t]]), cache=cache))
        out.append(torch.cat(logits, 1))
    assert len(taken) == len(steps)                          # slots 5..14: the ring wraps at 10
    # q8_0: both paths quantize alike; a bf16 value an fp32 rounding apart can round one bf16 step apart
    bound = tol.cache_paths(out[0], model.config, "bf16" if kind == "bf16" else "fp32")
    torch.testing.assert_close(out[1], out[0], atol=bound["atol"], rtol=0)
