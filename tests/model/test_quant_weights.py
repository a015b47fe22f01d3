"""Quantized weights (caramba.model.quant): the q8_0 / q4_1 formats against gguf's own, the C GEMV
kernels against dequantize + matmul, the eager fallback, and every weight kind through generation,
beam search, speculative decoding and eval on tiny models (a GGUF for `native`)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from caramba.errors import UserError
from caramba.infer import GenerateConfig, Generator
from caramba.infer.beam import beam_search
from caramba.evaluation.evaluate import evaluate_cache
from caramba.infer.speculative import SpeculativeConfig, SpeculativeGenerator
from caramba.model import quant, zoo
from caramba.model.state_dict import fuse_hf_state_dict
from caramba.model.quant import (QuantLinear, dequantize_q4_0, dequantize_q4_1, dequantize_q8_0, gguf_blocks,
                                 quantize_blocks, quantize_q8_0)
import tolerance as tol
from conftest import hf_model, make_model
from test_loaders import read_gguf, write_gguf


def randn(*shape, seed=0, std=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * std


def needs_kernels():
    if quant.library() is None:
        pytest.skip(f"weight kernels {quant.status()}")


@pytest.fixture
def eager(monkeypatch):
    """The dequantize + matmul path, as when the kernels cannot be built."""
    monkeypatch.setattr(quant, "library", lambda: None)


# --- formats --------------------------------------------------------------------------------------

def test_q8_0_round_trip_is_within_half_a_step_and_matches_gguf():
    w = randn(24, 96, seed=1)
    q, d = quantize_q8_0(w)
    back = dequantize_q8_0(q, d)
    step = d.float().repeat_interleave(32, dim=1)
    # half a code step, plus the fp16 rounding of the scale times the largest code (127)
    assert ((back - w).abs() <= step / 2 + 127 * step * torch.finfo(torch.float16).eps).all()
    ours = gguf_blocks(gguf.quants.quantize(w.numpy(), QT.Q8_0), "Q8_0", (24, 96))
    assert torch.equal(ours["d"], d)
    # Round-half-even (torch) and half-away (llama.cpp) may differ on exact ties only: one code.
    assert (ours["qs"].int() - q.int()).abs().max() <= 1
    assert (ours["qs"] != q).float().mean() < 1e-3


@pytest.mark.parametrize("qt", [QT.Q8_0, QT.Q4_0, QT.Q4_1])
def test_gguf_blocks_dequantize_exactly_as_gguf(qt):
    w = randn(10, 64, seed=2).numpy()
    raw = gguf.quants.quantize(w, qt)
    parts = gguf_blocks(raw, qt.name, (10, 64))
    ours = {QT.Q8_0: lambda: dequantize_q8_0(parts["qs"], parts["d"]),
            QT.Q4_0: lambda: dequantize_q4_0(parts["qs"], parts["d"]),
            QT.Q4_1: lambda: dequantize_q4_1(parts["qs"], parts["d"], parts["m"])}[qt]()
    ref = torch.from_numpy(gguf.quants.dequantize(raw, qt).astype(np.float32))
    torch.testing.assert_close(ours, ref, **tol.elementwise(ref, 2))   # d * q + m: two roundings


def block_sse(w: torch.Tensor, back: torch.Tensor) -> torch.Tensor:
    """Squared error per 32-block."""
    return ((back.double() - w.double()) ** 2).reshape(w.shape[0], -1, 32).sum(-1)


@pytest.mark.parametrize("fmt,qt", [("q8_0", QT.Q8_0), ("q4_0", QT.Q4_0)])
def test_searched_scales_never_lose_to_llama_cpps_rule(fmt, qt):
    """Each block's error is at most what llama.cpp's quantizer (one of the candidates, before the
    least-squares refit) leaves, up to the fp16 rounding of the scale; in total clearly less."""
    w = torch.cat([randn(16, 128, seed=8), randn(8, 128, seed=9) ** 3])     # Gaussian and heavy-tailed
    lin = QuantLinear.from_float(w, fmt=fmt)
    ours = block_sse(w, lin.dequantized())
    parts = gguf_blocks(gguf.quants.quantize(w.numpy(), qt), qt.name, tuple(w.shape))
    theirs = block_sse(w, dequantize_q8_0(parts["qs"], parts["d"]) if fmt == "q8_0" else
                       dequantize_q4_0(parts["qs"], parts["d"]))
    # a scale moved by one fp16 ulp (2^-11 relative) moves every value of the block by as much
    slack = (2 * 2.0 ** -11 * lin.dequantized().abs().double()).reshape(24, -1, 32).pow(2).sum(-1) \
        + 2 * (2.0 ** -11) * theirs
    assert (ours <= theirs + slack).all()
    assert ours.sum() < 0.97 * theirs.sum()


def test_searched_scales_land_on_a_coarser_grid():
    """Values that were quantized before (16 levels per block, Q4_1's) requantize to q8_0 with far
    less error than llama.cpp's amax / 127 gives them: a coarser step can hit them."""
    raw = gguf.quants.quantize(randn(32, 256, seed=10).numpy(), QT.Q4_1)
    p = gguf_blocks(raw, "Q4_1", (32, 256))
    w = dequantize_q4_1(p["qs"], p["d"], p["m"])
    q, d = quantize_blocks(w, -127, 127)
    amax_q, amax_d = quantize_q8_0(w)
    assert block_sse(w, dequantize_q8_0(q, d)).sum() < 0.5 * block_sse(w, dequantize_q8_0(amax_q, amax_d)).sum()


@pytest.mark.parametrize("qmin,qmax", [(-127, 127), (-8, 7)])
def test_scale_search_kernel_equals_the_torch_search(monkeypatch, qmin, qmax):
    """C and torch pick among the same candidates; float sums in another order may tip a near tie,
    so the two agree on (almost) every block and to rounding on the error of every one."""
    needs_kernels()
    w = torch.cat([randn(12, 96, seed=13), torch.zeros(1, 96), randn(3, 96, seed=14) * 1e-3])
    q, d = quantize_blocks(w, qmin, qmax)
    monkeypatch.setattr(quant, "library", lambda: None)
    eq, ed = quantize_blocks(w, qmin, qmax)
    assert q.min() >= qmin and q.max() <= qmax and q.dtype == eq.dtype == torch.int8
    assert (q != eq).reshape(-1, 32).any(-1).float().mean() <= 0.1
    ours, eager = block_sse(w, dequantize_q8_0(q, d)), block_sse(w, dequantize_q8_0(eq, ed))
    # a candidate's score is sum(x x) minus its error, in fp32: ties within rounding of sum(x x)
    norms = (w.double() ** 2).reshape(16, -1, 32).sum(-1)
    assert ((ours - eager).abs() <= 64 * torch.finfo(torch.float32).eps * norms).all()
    assert (q[12] == 0).all() and (d[12] == 0).all()         # an all-zero row stays zero


# --- kernels ---------------------------------------------------------------------------------------

def layer(fmt: str, act: str, N: int, K: int, seed: int = 0, bias: bool = False) -> QuantLinear:
    w = randn(N, K, seed=seed).numpy()
    b = randn(N, seed=seed + 9) if bias else None
    if fmt in ("q8_0", "q4_0"):
        return QuantLinear.from_float(torch.from_numpy(w), b, act=act, fmt=fmt)
    p = gguf_blocks(gguf.quants.quantize(w, QT.Q4_1), "Q4_1", (N, K))
    return QuantLinear("q4_1", p["qs"], p["d"], p["m"], bias=b, act=act)


def reference(lin: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x.double(), lin.dequantized().double(),
                                      None if lin.bias is None else lin.bias.double()).float()


def activation_error_bound(lin: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """|W| @ (half a code step of x per element): what rounding the activations to lin.act's
    blocks can move each output by (each x_k moves by at most d_x / 2, d_x = its block's
    max|x| / levels: 127 for q8, 32767 for i16)."""
    xb = x.reshape(x.shape[0], -1, 32)
    levels = quant.ACTIVATION_LEVELS[lin.act]
    half_step = (xb.abs().amax(-1, keepdim=True) / levels / 2).expand_as(xb).reshape(x.shape)
    return half_step.double() @ lin.dequantized().abs().double().t()


# M: one row, and tiles of 4 rows with remainders 3, 2 and none; N odd; K one block, several,
# and 33 (a 32-block factor chunk and one more, an odd count).
# Widths cover every way the kernels cut a row's blocks: fewer than 8 (scalar factors), whole
# groups of 8, 32-block chunks with a short last one (1056: 33 blocks), and a partial last group of
# 8 read as an overlapping one (320, 576, 1376: 10, 18 and 32 + 11 blocks). N = 19 and 40 cut the
# weight rows into calls of 16 with a remainder.
SHAPES = [(1, 7, 32), (3, 33, 96), (11, 5, 64), (6, 9, 1056), (16, 40, 160), (2, 19, 320), (5, 19, 576),
          (9, 17, 1376)]


@pytest.mark.parametrize("fmt,act", [("q8_0", "f32"), ("q4_1", "f32"), ("q8_0", "i16"), ("q4_1", "i16"), ("q8_0", "q8"), ("q4_1", "q8"), ("q4_0", "q8")])
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_kernel_equals_dequantize_then_matmul(fmt, act, M, N, K):
    needs_kernels()
    lin = layer(fmt, act, N, K, seed=M + N, bias=N % 2 == 1)
    x = randn(M, K, seed=3)
    with torch.inference_mode():
        got = lin(x)
    ref = reference(lin, x)
    # fp32 sums in another order (K terms) on values up to sum|w||x|
    atol = tol.reduction(ref, K)["atol"] + 16 * torch.finfo(torch.float32).eps * float(
        (lin.dequantized().abs() @ x.abs().t()).max())
    if act != "f32":
        bound = activation_error_bound(lin, x).float()
        assert ((got - ref).abs() <= bound + atol).all(), float(((got - ref).abs() - bound).max())
        assert (got - ref).abs().max() > 0          # the activations really were quantized
    else:
        torch.testing.assert_close(got, ref, atol=atol, rtol=0)


@pytest.mark.parametrize("fmt,act", [("q8_0", "f32"), ("q4_1", "f32"), ("q8_0", "i16"), ("q4_1", "i16"), ("q8_0", "q8"), ("q4_1", "q8"), ("q4_0", "q8")])
def test_a_rows_product_does_not_depend_on_the_batch_around_it(fmt, act):
    """Rows go through register tiles of up to 4, and a row's arithmetic is the same in every
    tile position and size: batching, a speculative verify or padding never changes a row."""
    needs_kernels()
    lin = layer(fmt, act, 13, 1056, seed=4)
    x = randn(7, 1056, seed=5)
    with torch.inference_mode():
        whole = lin(x)
        for r in range(7):
            assert torch.equal(whole[r], lin(x[r : r + 1])[0]), r
            assert torch.equal(whole[r], lin(x[max(0, r - 2) : r + 1])[-1]), r


@pytest.mark.parametrize("fmt,act", [("q8_0", "f32"), ("q4_1", "f32"), ("q8_0", "i16"), ("q4_1", "i16"), ("q8_0", "q8"), ("q4_1", "q8"), ("q4_0", "q8")])
def test_eager_fallback_and_large_batches_match_the_kernel(monkeypatch, fmt, act):
    """The eager path (no kernel library; more rows than KERNEL_ROWS, as in a prefill or a batch of
    17) multiplies the values the kernel does, q8-rounded activations included: only the fp32
    summation order differs. Before, it took fp32 activations, and a q8_0 model's greedy output
    changed with the batch size (benchmarks/batched_throughput.py --weights q8_0 caught it)."""
    needs_kernels()
    lin = layer(fmt, act, 48, 64, seed=4, bias=True)
    x = randn(quant.KERNEL_ROWS + 1, 64, seed=5)
    # fp32 sums in another order on values up to sum |w||x|, plus the eager path's roundings of
    # the dequantized activation and weight values (each within an eps of the kernel's products)
    atol = 2 * tol.reduction(x, 64)["atol"] / float(x.abs().max()) * float((lin.dequantized().abs() @ x.abs().t()).max())
    with torch.inference_mode():
        rows = torch.cat([lin(x[r : r + 1]) for r in range(len(x))])   # the kernel, one row at a time
        torch.testing.assert_close(lin(x), rows, atol=atol, rtol=0)    # 17 rows: the eager path
        small = x[:6].view(2, 3, 64)
        kernel_out = lin(small)
        monkeypatch.setattr(quant, "library", lambda: None)
        eager_out = lin(small)
    assert kernel_out.shape == eager_out.shape == (2, 3, 48)
    torch.testing.assert_close(kernel_out, eager_out, atol=atol, rtol=0)
    if act == "q8":    # and the rounding is really there: fp32 activations miss by far more
        exact = reference(lin, x[:6])
        assert (eager_out.view(6, 48) - exact).abs().max() > 4 * atol
    if act != "f32":   # i16's rounding is too fine to see this way (near fp32's summation noise)
        seen = []
        real = quant.round_activations
        monkeypatch.setattr(quant, "round_activations", lambda v, a: seen.append(a) or real(v, a))
        with torch.inference_mode():
            lin(small)
        assert seen == [act]


def test_the_eager_path_returns_the_inputs_dtype():
    """A bf16 model's activations skip the kernels (fp32 only) and come back bf16."""
    lin = layer("q8_0", "q8", 8, 64)
    x = randn(2, 64).to(torch.bfloat16)
    with torch.inference_mode():
        y = lin(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), reference(lin, quant.round_activations(x.float(), "q8")),
                               **tol.rounding(torch.bfloat16, reference(lin, x.float())))


@pytest.mark.parametrize("act,dtype", [("q8", torch.int8), ("i16", torch.int16)])
def test_round_activations_is_the_kernels_rule(act, dtype):
    """round_activations gives back exactly the codes times the scales quant_gemv.c's
    quantize_rows makes (q8 and int16)."""
    needs_kernels()
    levels = quant.ACTIVATION_LEVELS[act]
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 128, generator=g) * torch.rand(5, 1, generator=g) * 10
    x[0] = torch.randint(-2 * levels, 2 * levels + 1, (128,), generator=g).float() * 0.5   # ties ...
    x[0, ::32] = levels                                                    # ... at scale 1
    x[1, :32] = 0.0                                                        # an all-zero block
    q, d = torch.empty(5, 128, dtype=dtype), torch.empty(5, 4)
    getattr(quant.library(), f"quantize_activations_{act}")(x.data_ptr(), 5, 128, q.data_ptr(), d.data_ptr())
    want = (q.float().view(5, 4, 32) * d[..., None]).view(5, 128)
    assert torch.equal(quant.round_activations(x, act), want)
    assert (want[0] != x[0]).any()                                         # the ties were rounded


def test_switched_off_by_environment(monkeypatch):
    quant.library.cache_clear()
    monkeypatch.setenv("CARAMBA_KERNELS", "0")
    try:
        assert quant.library() is None and quant.status() == "off (CARAMBA_KERNELS=0)"
        lin = layer("q8_0", "q8", 8, 32)
        x = randn(1, 32)     # without kernels: the same q8-rounded activations, dequantized weights
        want = reference(lin, quant.round_activations(x, "q8"))
        torch.testing.assert_close(lin(x), want, **tol.reduction(x, 32 * 4))
    finally:
        quant.library.cache_clear()


def test_a_wrong_input_width_is_an_error_not_a_wild_read():
    lin = layer("q8_0", "q8", 8, 64)
    with pytest.raises(RuntimeError, match="shape"):
        lin(randn(1, 32))


def test_rejects_what_has_no_kernel():
    with pytest.raises(ValueError, match="divisible by 32"):
        QuantLinear.from_float(randn(4, 48))
    with pytest.raises(ValueError, match="no kernel for weights q4_0 with f32"):
        QuantLinear("q4_0", torch.zeros(4, 16, dtype=torch.uint8), torch.ones(4, 1), act="f32")
    with pytest.raises(ValueError, match="no kernel for weights q4_0 with i16"):
        QuantLinear("q4_0", torch.zeros(4, 16, dtype=torch.uint8), torch.ones(4, 1), act="i16")
    with pytest.raises(ValueError, match="no kernel for weights q2_k"):
        QuantLinear("q2_k", torch.zeros(4, 84, dtype=torch.uint8), None)
    with pytest.raises(ValueError, match="no kernel for weights q5_0 with q8"):   # stored formats: f32 or i16 codes
        QuantLinear("q5_0", torch.zeros(4, 22, dtype=torch.uint8), None, act="q8")
    with pytest.raises(ValueError, match="the file's blocks"):   # stored formats hold their scales in the blocks
        QuantLinear("q5_0", torch.zeros(4, 16, dtype=torch.uint8), torch.ones(4, 1))
    with pytest.raises(ValueError, match="q4_1 need block minimums"):
        QuantLinear("q4_1", torch.zeros(4, 16, dtype=torch.uint8), torch.ones(4, 1))


def test_quantized_head_reads_its_embedding_rows():
    model = make_model(seed=1)
    ref = model.embed_tokens(torch.tensor([[1, 5, 96]]))
    assert quant.quantize_model(model) == 2 * 4 + 1     # wqkv, wo, w13, w2 per layer + the head
    got = model.embed_tokens(torch.tensor([[1, 5, 96]]))
    step = float(model.head.d.float().max())            # one q8_0 step of the largest block
    torch.testing.assert_close(got, ref, atol=step / 2 + 1e-6, rtol=0)
    assert model.dtype == torch.float32 and model.device.type == "cpu"


@pytest.mark.parametrize("kernel", [True, False])
def test_embedding_rows_are_the_dequantized_rows_and_ids_are_checked(monkeypatch, kernel):
    """The q8_0 rows come from one C call (embed_rows_q8_0) or from torch ops: the same values bit
    for bit, and an id outside the vocabulary (negative included, as F.embedding has it) is an
    IndexError, not a read outside the table."""
    if kernel:
        needs_kernels()
    else:
        monkeypatch.setattr(quant, "library", lambda: None)
    head = layer("q8_0", "q8", 50, 96, seed=2)
    ids = torch.tensor([[0, 49, 7], [7, 3, 12]])
    got = head.embedding(ids)
    assert got.shape == (2, 3, 96) and got.dtype == torch.float32
    assert torch.equal(got, head.dequantized()[ids])
    for bad in (50, -1):
        with pytest.raises(IndexError, match="outside the vocabulary"):
            head.embedding(torch.tensor([[3, bad]]))


# --- whole models, every path ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A tiny Llama GGUF with Q4_1 projections and a Q8_0 embedding, like the shipped SmolLM2."""
    hf = hf_model(seed=3, tie_word_embeddings=True)   # the head reads the Q8_0 embedding, as SmolLM2's does
    types = {}
    for i in range(hf.config.num_hidden_layers):
        for t in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            types[f"blk.{i}.{t}.weight"] = QT.Q4_1
    types["token_embd.weight"] = QT.Q8_0
    path = tmp_path_factory.mktemp("qgguf") / "tiny.gguf"
    write_gguf(path, hf, types)
    return path


@pytest.fixture(scope="module")
def models(tiny_gguf):
    """The tiny GGUF as each weight kind, through load_model's hook (the file has no tokenizer,
    which load_model would need)."""
    out = {}
    for w in quant.WEIGHT_KINDS:
        _, cfg, tensors = read_gguf(tiny_gguf)
        model = zoo.build_model(cfg, fuse_hf_state_dict(tensors, cfg), torch.float32, torch.device("cpu"))
        if w != "fp32":
            zoo._quantize_weights(model, w, tiny_gguf, torch.device("cpu"))
        out[w] = model
    return out


@pytest.mark.parametrize("weights,act", [("native", "f32"), ("native_i16", "i16")])
def test_native_keeps_the_files_blocks(models, weights, act):
    native = models[weights]
    for block in native.layers:
        assert block.attn.wqkv.fmt == block.attn.wo.fmt == block.mlp.w13.fmt == block.mlp.w2.fmt == "q4_1"
        assert block.attn.wqkv.act == block.mlp.w2.act == act
    assert native.head.fmt == "q8_0" and native.head.act == act
    # the same weight values as the fp32 load (which dequantized the same file)
    fp32 = models["fp32"]
    for a, b in [(native.layers[0].attn.wqkv.dequantized(), fp32.layers[0].attn.wqkv.weight),
                 (native.layers[1].mlp.w13.dequantized(), fp32.layers[1].mlp.w13.weight_t.t()),
                 (native.head.dequantized(), fp32.head.weight_t.t())]:
        torch.testing.assert_close(a, b, **tol.elementwise(b, 2))


def prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 97, (n,), generator=g).tolist() for n in (6, 3)]


def greedy(model, **kw):
    return Generator(model, GenerateConfig(max_new_tokens=12, temperature=0.0, **kw)).run(prompts()).sequences


@pytest.mark.parametrize("cache_kind", ["fp32", "fp16", "bf16", "q8_0", "q4_0", "nf4"])
@pytest.mark.parametrize("weights", quant.WEIGHT_KINDS)
def test_every_weight_kind_generates_with_every_cache_kind(models, weights, cache_kind, read_path):
    model = models[weights]
    out = greedy(model, cache_kind=cache_kind)
    assert [len(s) for s in out] == [12, 12]
    if weights == "native":   # the same values as fp32: only the summation order differs
        assert out == greedy(models["fp32"], cache_kind=cache_kind)
    # a prompt alone (batch 1) decodes as it does in the batch
    single = Generator(model, GenerateConfig(max_new_tokens=12, temperature=0.0, cache_kind=cache_kind)).run(prompts()[:1])
    assert single.sequences[0] == out[0]


@pytest.mark.parametrize("weights", quant.WEIGHT_KINDS)
def test_every_weight_kind_through_beam_speculative_and_eval(models, weights):
    model = models[weights]
    ids = torch.tensor([prompts()[0]])
    beams = beam_search(model, ids, max_new_tokens=6, num_beams=3, temperature=0, eos_token_id=[]).sequences[0][0]
    assert len(beams) == 6
    if weights == "native":
        ref = beam_search(models["fp32"], ids, max_new_tokens=6, num_beams=3, temperature=0, eos_token_id=[])
        assert beams == ref.sequences[0][0]
    plain = greedy(model)
    for draft in ("prompt_lookup", "layer_skip", "self_int8"):
        kw = {"draft_layers": 1} if draft == "layer_skip" else {}
        spec = SpeculativeGenerator(model, None, SpeculativeConfig(max_new_tokens=12, temperature=0.0, draft=draft, **kw))
        assert spec.run(prompts()).sequences == plain, draft
    ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    (r,) = evaluate_cache(model, ids, ["fp32"], "fp32", prompt_len=10)
    assert r.n_scored == 30 and np.isfinite(r.nll)


def test_q8_0_stays_close_to_fp32_and_q4_0_keeps_an_8_bit_head(models):
    ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    (ref,) = evaluate_cache(models["fp32"], ids, ["fp32"], "fp32", prompt_len=10)
    (q8,) = evaluate_cache(models["q8_0"], ids, ["fp32"], "fp32", prompt_len=10)
    assert abs(q8.nll - ref.nll) < 0.02 * ref.nll
    q4 = models["q4_0"]
    assert q4.layers[0].attn.wqkv.fmt == q4.layers[-1].mlp.w2.fmt == "q4_0" and q4.head.fmt == "q8_0"


def test_native_needs_a_gguf_and_unknown_kinds_are_named(tmp_path):
    from test_cli import write_tiny_model

    d = write_tiny_model(tmp_path / "m")
    with pytest.raises(UserError, match="weights 'native' keeps a GGUF"):
        zoo.load_model(str(d), progress=False, weights="native")
    with pytest.raises(UserError, match="weights 'native_i16' keeps a GGUF"):
        zoo.load_model(str(d), progress=False, weights="native_i16")
    with pytest.raises(UserError, match="weights 'q4' is not supported; use one of fp32, q8_0, q4_0, native, native_i16"):
        zoo.load_model(str(d), progress=False, weights="q4")


def native_and_portable(monkeypatch, tmp_path) -> tuple:
    """quant_gemv.c as the suite loads it, and built without -march=native (the scalar loops a CPU
    without AVX2 gets)."""
    from caramba import kernels

    monkeypatch.setenv("CARAMBA_CACHE_DIR", str(tmp_path))
    portable = [f for f in kernels.FLAGS if not f.startswith("-march")]
    return quant.library(), kernels.load(quant.SOURCES, quant._SIGNATURES, "test", flags=portable)[0]


def test_portable_kernels_equal_the_native_ones(monkeypatch, tmp_path):
    """The scalar loops (built without -march=native, as on a CPU without AVX2) against the same
    reference: both code paths of quant_gemv.c are exercised wherever the suite runs."""
    needs_kernels()
    lib = native_and_portable(monkeypatch, tmp_path)[1]
    assert lib is not None
    monkeypatch.setattr(quant, "library", lambda: lib)
    for fmt, act in [("q8_0", "f32"), ("q4_1", "f32"), ("q8_0", "i16"), ("q4_1", "i16"), ("q8_0", "q8"), ("q4_1", "q8"), ("q4_0", "q8")]:
        lin = layer(fmt, act, 9, 64, seed=11)
        x = randn(3, 64, seed=12)
        ref = reference(lin, x)
        atol = tol.reduction(ref, 64)["atol"] + 16 * torch.finfo(torch.float32).eps * float(
            (lin.dequantized().abs() @ x.abs().t()).max())
        bound = activation_error_bound(lin, x).float() if act != "f32" else 0
        assert ((lin(x) - ref).abs() <= bound + atol).all(), (fmt, act)


def test_activation_codes_are_the_reference_rule_bit_for_bit(monkeypatch, tmp_path):
    """The q8 activations (quantize_rows_codes, AVX2 and portable builds): scale amax / 127 and codes
    x / scale rounded to nearest even, exactly, on values with ties (half-integer multiples of the
    scale), zeros and all-zero blocks."""
    needs_kernels()

    g = torch.Generator().manual_seed(21)
    x = torch.randn(8, 256, generator=g) * torch.rand(8, 1, generator=g) * 10
    x[0] = torch.randint(-254, 255, (256,), generator=g).float() * 0.5     # ties: 127 = amax / scale
    x[1, :64] = 0.0
    x[2, ::3] = 0.0
    d = x.reshape(8, -1, 32).abs().amax(-1) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    want = torch.round(x.reshape(8, -1, 32) * inv[..., None]).to(torch.int8).reshape(8, 256)   # half to even
    for lib in native_and_portable(monkeypatch, tmp_path):
        q, got_d = torch.empty(8, 256, dtype=torch.int8), torch.empty(8, 8)
        lib.quantize_activations_q8(x.data_ptr(), 8, 256, q.data_ptr(), got_d.data_ptr())
        assert torch.equal(got_d, d) and torch.equal(q, want)



def test_split_codes_hold_fp32_activations_to_within_fp32_rounding(monkeypatch, tmp_path):
    """The fp32-activation products (act='f32', the `native` kind) run on two int16 codes per
    element (ACT_SPLIT, AVX2 and portable builds): scale d = 2^e, the power of two with
    amax / 32767 < d, h = round(x / d), l = round((x / d - h) 2^15), so x = d (h + l / 2^15) to
    within d / 2^16 (below amax's own fp32 rounding, as d <= 2 amax / 32767). Bit for bit the rule
    below, on blocks of every magnitude, zeros, ties and an all-zero block."""
    needs_kernels()

    g = torch.Generator().manual_seed(22)
    x = torch.randn(8, 256, generator=g) * torch.logspace(-30, 30, 8)[:, None]
    x[0] = torch.randint(-65534, 65535, (256,), generator=g).float() * 0.5 * 2.0 ** -10   # ties of h
    x[1, :64] = 0.0
    x[2, ::3] = 0.0
    xb = x.reshape(8, -1, 32)
    amax = xb.abs().amax(-1)
    e = torch.frexp(amax / 32767.0).exponent.clamp(min=-100)
    d = torch.where(amax > 0, torch.ldexp(torch.ones_like(amax), e), torch.zeros_like(amax))
    inv = torch.where(amax > 0, torch.ldexp(torch.ones_like(amax), -e), torch.zeros_like(amax))
    scaled = xb * inv[..., None]                              # exact: a power of two
    h = torch.round(scaled)                                   # half to even, as the kernels round
    lo = torch.round((scaled - h) * 32768.0)
    want = torch.cat([h, lo], -1).to(torch.int16).reshape(8, 512)
    real = amax > 0
    unclamped = real & (e > -100)    # below 2^-100 the scale stays there (2^100 stays finite)
    assert (amax[real] / d[real] <= 32767).all() and (amax[unclamped] / d[unclamped] > 16383).all()
    back = d[..., None].double() * (h.double() + lo.double() / 32768)
    assert ((back - xb.double()).abs() <= d[..., None].double() / 65536).all()
    assert ((back - xb.double()).abs() <= xb.abs().amax(-1, keepdim=True).double() * 2.0 ** -24).all()
    for lib in native_and_portable(monkeypatch, tmp_path):
        q, got_d = torch.empty(8, 512, dtype=torch.int16), torch.empty(8, 8)
        lib.split_activations(x.data_ptr(), 8, 256, q.data_ptr(), got_d.data_ptr())
        assert torch.equal(got_d, d) and torch.equal(q, want)
        bad = x.clone()
        bad[3, 40], bad[4, 100] = float("nan"), float("inf")     # blocks 1 and 3 of their rows
        lib.split_activations(bad.data_ptr(), 8, 256, q.data_ptr(), got_d.data_ptr())
        assert got_d[3, 1].isnan() and got_d[4, 3].isnan() and got_d.isnan().sum() == 2


@pytest.mark.parametrize("fmt,act", [("q8_0", "f32"), ("q4_1", "f32"), ("q8_0", "i16"), ("q4_1", "i16"), ("q8_0", "q8"), ("q4_1", "q8"), ("q4_0", "q8")])
def test_a_nan_activation_gives_nan_not_a_number(fmt, act):
    """Integer codes cannot hold a NaN: the kernels give its block a NaN scale instead, so a model
    that overflowed shows it in its logits as the fp32 path would."""
    needs_kernels()
    lin = layer(fmt, act, 5, 64)
    x = randn(2, 64, seed=6)
    x[1, 33] = float("nan")
    with torch.inference_mode():
        y = lin(x)
    assert y[0].isfinite().all() and y[1].isnan().all()


def test_cli_and_manifest_take_weights(tmp_path):
    import json

    from pydantic import ValidationError
    from typer.testing import CliRunner

    from caramba.cli import app
    from caramba.evaluation.evaluate import corpus_text
    from caramba.manifest.schema import ModelSpec
    from test_cli import write_tiny_model

    d = write_tiny_model(tmp_path / "m")
    text = tmp_path / "t.txt"
    text.write_text(corpus_text()[:300])

    def invoke(*args):
        return CliRunner().invoke(app, [str(a) for a in args])

    r = invoke("eval", "--text", text, "--model", d, "--weights", "q8_0", "--prompt-len", "8", "--max-tokens", "30",
               "--cache-kind", "fp32", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["model"]["weights"] == "q8_0"
    bad = invoke("eval", "--text", text, "--model", d, "--weights", "native")
    assert bad.exit_code == 2 and "keeps a GGUF" in bad.output
    # generate: the flag and `--set model.weights=...` both reach the loaded model
    for args in (["--weights", "q4_0"], ["--set", "model.weights=q4_0"]):
        r = invoke("generate", "hello", "--model", d, "--max-new-tokens", "3", "--json", *args)
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["model"]["weights"] == "q4_0"
    bad = invoke("generate", "hello", "--model", d, "--weights", "q4")
    assert bad.exit_code == 2 and "--weights: Input should be" in bad.output and "Traceback" not in bad.output
    assert ModelSpec(weights="q8_0").weights == "q8_0" and ModelSpec().weights == "fp32"
    with pytest.raises(ValidationError, match="weights"):
        ModelSpec(weights="q4")


@pytest.mark.parametrize("fmt,act", [("q8_0", "q8"), ("q4_0", "q8"), ("q4_1", "f32"), ("q4_1", "i16")])
@pytest.mark.parametrize("layout", ["rows", "x16"])
@pytest.mark.parametrize("N", [1, 16, 37])
def test_dequantized_in_c_is_the_torch_path_bit_for_bit(fmt, act, layout, N):
    """QuantLinear.dequantized() (quant_gemv.c's one pass, at 1 and 2 threads, from either layout) gives
    quant.dequantize_*'s values bit for bit."""
    if quant.library() is None:
        pytest.skip(f"no C kernels here ({quant.status()})")
    gen = torch.Generator().manual_seed(N)
    K = 128
    if fmt == "q8_0":
        qs = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=gen)
    else:
        qs = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=gen)
    d = (torch.randn(N, K // 32, generator=gen) * 0.1).half()
    m = (torch.randn(N, K // 32, generator=gen) * 0.1).half() if fmt == "q4_1" else None
    lin = QuantLinear(fmt, qs, d, m, act=act, layout=layout)
    reference = lin._dequantize(*lin.row_major())
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert torch.equal(lin.dequantized(), reference)
    finally:
        torch.set_num_threads(before)


def test_dequantized_of_a_module_cast_to_fp32_scales_takes_the_torch_path():
    """.float() turns a layer's fp16 scales into fp32 buffers, which the C pass does not read."""
    lin = QuantLinear("q8_0", torch.ones(16, 32, dtype=torch.int8), torch.full((16, 1), 0.5).half())
    expected = lin.dequantized()
    lin.float()
    assert lin.d.dtype == torch.float32
    assert torch.equal(lin.dequantized(), expected)


@pytest.mark.parametrize("fmt,act", [("q8_0", "q8"), ("q4_1", "f32"), ("q4_1", "i16")])
def test_dequantized_product_in_tiles_equals_the_whole_weights_product(fmt, act, monkeypatch):
    """Prefill-sized rows with no GEMM for them multiply the weight a tile at a time (a scratch
    buffer reused): F.linear with the whole dequantized weight, tile edges included (a head-sized
    weight spans several tiles; bias sliced with them), within a K-term dot product's rounding
    (torch's GEMM may block a narrower weight differently)."""
    if quant.library() is None:
        pytest.skip(f"no C kernels here ({quant.status()})")
    monkeypatch.setattr(quant, "DEQUANT_TILE_BYTES", 7 * 64 * 4)   # 7 rows of K = 64 a tile
    gen = torch.Generator().manual_seed(3)
    N, K, M = 37, 64, 40
    w = torch.randn(N, K, generator=gen)
    bias = torch.randn(N, generator=gen)
    if fmt == "q8_0":
        lin = QuantLinear.from_float(w, bias, act=act, fmt=fmt)
    else:
        p = gguf_blocks(gguf.quants.quantize(w.numpy(), QT.Q4_1), "Q4_1", (N, K))
        lin = QuantLinear("q4_1", p["qs"], p["d"], p["m"], bias=bias, act=act)
    rows = torch.randn(M, K, generator=gen)
    taken = quant.round_activations(rows, act) if act in quant.ACTIVATION_LEVELS else rows
    expected = torch.nn.functional.linear(taken, lin.dequantized(), bias)
    tiled = lin._dequantized_product(taken)
    assert tiled is not None and tiled.shape == (M, N)
    bound = tol.reduction(expected, K + 1)
    torch.testing.assert_close(tiled, expected, **bound)
    if quant_gemm_runs(lin):
        return   # forward takes a GEMM of its own for these rows here
    torch.testing.assert_close(lin(rows), expected, **bound)
    with torch.enable_grad():   # a product autograd keeps never reads the reused scratch
        x = rows.clone().requires_grad_(True)
        lin(x).sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


def quant_gemm_runs(lin: QuantLinear) -> bool:
    from caramba.model import quant_gemm
    lib = quant_gemm.library()
    if lib is None:
        return False
    if lin.act == "q8" and lin.fmt in quant_gemm.INT8_FORMATS:
        return lib.gemm_isa_name() != b"scalar"
    if lin.act == "i16" and quant_gemm.i16_runs(lin.fmt):
        return True
    return bool(lib.gemm_f32_available())
