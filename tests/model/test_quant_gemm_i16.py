"""The int16-activation prefill GEMM (caramba.model.quant_gemm.gemm_i16, quant_gemm_i16.c): native_i16's
blocks (q8_0, q4_0, q4_1, row-major or x16, and the GGUF formats kept as stored: Q5_0, Q5_1, Q4_K,
Q5_K, Q6_K) times int16 activation codes (quant_gemv.c's quantize_activations_i16).

- Every level that runs it gives the portable reference's products bit for bit (integer sums per
  32 elements, Q6_K's per 16, then the same fp32 operations in the same order), with panel tails
  (N not a multiple of 32), register-tile tails (M of 1 to 7 and past), 1 and 2 threads, and x16
  weights read in place.
- The reference is within the worst-case fp32 bound of its chain of fused multiply-adds of the
  float64 product of the same values (the rounded activations are exact codes times scales, the
  weights exact): gamma_n sum |x| (|f q| + |m|), n = the chain's steps plus a few.
- QuantLinear's native_i16 prefill (more than KERNEL_ROWS rows) takes it and agrees with the eager
  path (round_activations, then the dequantized weight's matmul) within both sums' bounds; at a
  level without it (scalar, avx2, avxvnni) it keeps the eager path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from caramba.model import quant, quant_gemm
from caramba.model.quant import STORED, QuantLinear
from test_kquant import HALVES, MINS, gguf_values, random_blocks
from test_quant_prefill import activations, needs_library, skip_reason

U = 2.0 ** -24   # fp32's unit roundoff
FMTS = list(quant_gemm.I16_FORMATS)
# (M, N, K): register tiles of 6 rows and tails of 1..5, panels of 32 rows and tails
SHAPES = [(1, 19, 256), (2, 33, 512), (3, 7, 256), (4, 40, 768), (5, 17, 256), (6, 64, 512), (7, 31, 256),
          (13, 70, 768), (40, 96, 256)]


@pytest.fixture(params=["avx512vnni", "amx"])
def level(request):
    needs_library()
    if not quant_gemm.available(request.param):
        pytest.skip(skip_reason(request.param))
    with quant_gemm.use_level(request.param) as got:
        assert got == request.param
        yield got


def weights(fmt: str, N: int, K: int, seed: int) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """(the weight's buffers qs, d, m; its values [N, K] fp32; the magnitudes |f q| + |m| of its
    terms [N, K]) for random blocks of `fmt`."""
    g = torch.Generator().manual_seed(seed)
    if fmt in STORED:
        raw = random_blocks(fmt, N, K, seed)
        mags = raw.numpy().copy().reshape(N, -1, STORED[fmt][1])
        for a, b in HALVES[fmt]:     # every factor positive, every minimum term added (Q4_K, Q5_K: - dmin m)
            sign = mags[:, :, b - 1]
            mags[:, :, b - 1] = sign & 0x7F if (a, b) != MINS.get(fmt) or fmt == "q5_1" else sign | 0x80
        absw = np.abs(gguf_values(fmt, torch.from_numpy(mags.reshape(N, -1))))
        return {"qs": raw, "d": None, "m": None}, torch.from_numpy(gguf_values(fmt, raw)), torch.from_numpy(absw)
    if fmt == "q8_0":
        q = torch.randint(-127, 128, (N, K), generator=g).to(torch.int8)
        d = (torch.rand(N, K // 32, generator=g) * 0.02).half()
        w = quant.dequantize_q8_0(q, d)
        return {"qs": q, "d": d, "m": None}, w, w.abs()
    codes = torch.randint(0, 16, (N, K), generator=g)
    d = ((torch.rand(N, K // 32, generator=g) - 0.5) * 0.1).half()
    if fmt == "q4_0":
        w = quant.dequantize_q4_0(quant.pack_nibbles(codes), d)
        return {"qs": quant.pack_nibbles(codes), "d": d, "m": None}, w, w.abs()
    m = ((torch.rand(N, K // 32, generator=g) - 0.5) * 0.8).half()
    qs = quant.pack_nibbles(codes)
    return ({"qs": qs, "d": d, "m": m}, quant.dequantize_q4_1(qs, d, m),
            quant.dequantize_q4_1(qs, d.abs(), m.abs()))


def codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    got = quant.quantize_rows_codes(x.contiguous(), "i16")
    assert got is not None
    return got


def gemm(fmt: str, xq, xd, w: dict, N: int, **kw) -> torch.Tensor:
    return quant_gemm.gemm_i16(fmt, xq, xd, w["qs"], w["d"], w["m"], N, **kw)


def steps(fmt: str, K: int) -> int:
    """Rounded operations in one output's chain, with slack: a product, a conversion and an fma
    per group (Q6_K's groups are 16 elements), an fma per block's minimum, the weight's own
    rounding (gguf's fp32 dequantization of d q + m)."""
    groups = K // (16 if fmt == "q6_k" else 32)
    return groups + K // 32 + 4


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def rounded(xq: torch.Tensor, xd: torch.Tensor) -> torch.Tensor:
    """The values the codes stand for, in float64 (exact)."""
    M, K = xq.shape
    return (xq.double().reshape(M, -1, 32) * xd.double().unsqueeze(-1)).reshape(M, K)


def x16(w: dict) -> dict:
    return {"qs": quant.interleave(w["qs"], 4), "d": quant.interleave(w["d"], 1).squeeze(-1),
            "m": None if w["m"] is None else quant.interleave(w["m"], 1).squeeze(-1)}


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_i16_levels_are_the_reference_bit_for_bit(level, fmt, M, N, K):
    assert quant_gemm.i16_runs(fmt), f"{level} leaves {fmt} to torch's path"
    w, _, _ = weights(fmt, N, K, seed=M * 131 + N)
    xq, xd = codes(activations(M, K, seed=K + M))
    ref = gemm(fmt, xq, xd, w, N, reference=True)
    assert not ref.isnan().any()
    for threads in (1, 2):
        assert torch.equal(gemm(fmt, xq, xd, w, N, threads=threads), ref)
    if fmt in ("q8_0", "q4_0", "q4_1"):   # held x16: read in place, the same bits
        assert torch.equal(gemm(fmt, xq, xd, x16(w), N, x16=True), ref)
        assert torch.equal(gemm(fmt, xq, xd, x16(w), N, x16=True, reference=True), ref)


def test_i16_extreme_codes_do_not_overflow(level):
    """Every activation code +-32767 and every weight code at its extreme: the int32 sums stay
    exact (Q6_K's per 16, q8_0's 32 x 32767 x 127), so the vector level still equals the
    reference, which is the float64 product within the bound."""
    M, N, K = 7, 33, 512
    xq = torch.full((M, K), 32767, dtype=torch.int16)
    xq[1::2] = -32767
    xd = torch.full((M, K // 32), 1.0 / 32767)
    for fmt in FMTS:
        w, wv, absw = weights(fmt, N, K, seed=5)
        if fmt == "q8_0":
            w["qs"] = torch.full_like(w["qs"], -127)
            wv, absw = quant.dequantize_q8_0(w["qs"], w["d"]), quant.dequantize_q8_0(w["qs"], w["d"]).abs()
        elif fmt == "q6_k":   # codes 0 (q - 32 = -32), scales -128
            raw = w["qs"].numpy().reshape(N, -1, 210)
            raw[:, :, :192] = 0
            raw[:, :, 192:208] = 0x80
            wv = torch.from_numpy(gguf_values(fmt, w["qs"]))
            absw = wv.abs()
        ref = gemm(fmt, xq, xd, w, N, reference=True)
        assert torch.equal(gemm(fmt, xq, xd, w, N), ref), fmt
        exact = rounded(xq, xd) @ wv.double().t()
        limit = gamma(steps(fmt, K)) * (rounded(xq, xd).abs() @ absw.double().t())
        assert ((ref.double() - exact).abs() <= limit).all(), fmt


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("M,N,K", [(3, 19, 256), (17, 40, 768), (40, 33, 1536)])
def test_i16_reference_is_the_exact_product_within_fp32_rounding(fmt, M, N, K):
    needs_library()
    w, wv, absw = weights(fmt, N, K, seed=N + K)
    xq, xd = codes(activations(M, K, seed=M))
    got = gemm(fmt, xq, xd, w, N, reference=True)
    x = rounded(xq, xd)
    exact = x @ wv.double().t()
    limit = gamma(steps(fmt, K)) * (x.abs() @ absw.double().t())
    assert ((got.double() - exact).abs() <= limit).all()


def native_layer(fmt: str, N: int, K: int, seed: int, layout: str) -> QuantLinear:
    w, _, _ = weights(fmt, N, K, seed)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(seed))
    return QuantLinear(fmt, w["qs"], w["d"], w["m"], bias=bias, act="i16", layout=layout)


LAYERS = [(f, "rows") for f in FMTS if f != "q4_0"] + [("q8_0", "x16"), ("q4_1", "x16")]   # q4_0: q8 activations only


@pytest.mark.parametrize("fmt,layout", LAYERS)
@pytest.mark.parametrize("M", [quant.KERNEL_ROWS + 1, 40])
def test_quantlinear_native_i16_prefill_takes_the_gemm(level, fmt, layout, M):
    """More than KERNEL_ROWS rows: the layer's output is the GEMM's (reference bits) plus its bias,
    and within both fp32 sums' bounds of the eager path it replaced."""
    K, N = 512, 45
    lin = native_layer(fmt, N, K, seed=M, layout=layout)
    if lin.layout != layout:
        pytest.skip(f"no {layout} layout for {fmt} here")
    x = activations(M, K, seed=N)
    with torch.inference_mode():
        got = lin(x)
        with quant_gemm.use_level("scalar"):
            assert not quant_gemm.i16_runs(fmt)
            old = lin(x)
    xq, xd = codes(x)
    qs, d, m = lin.row_major()
    assert torch.equal(got, quant_gemm.gemm_i16(fmt, xq, xd, qs, d, m, N, reference=True) + lin.bias)
    eager = F.linear(quant.round_activations(x, "i16"), lin.dequantized(), lin.bias)
    assert torch.equal(old, eager) or ((old - eager).abs() <= 1e-3 * eager.abs().max()).all()
    _, _, absw = weights(fmt, N, K, seed=M)
    r = rounded(xq, xd)
    limit = (gamma(steps(fmt, K)) + gamma(K + 4)) * (r.abs() @ absw.double().t() + lin.bias.abs().double())
    assert ((got.double() - old.double()).abs() <= limit).all()


@pytest.mark.parametrize("name", ["scalar", "avx2", "avxvnni"])
def test_a_level_without_the_gemm_keeps_the_eager_path(name):
    needs_library()
    lin = native_layer("q6_k", 40, 256, seed=3, layout="rows")
    x = activations(33, 256, seed=4)
    with quant_gemm.use_level(name) as got:
        if got != name:
            pytest.skip(skip_reason(name))
        assert not quant_gemm.i16_runs("q6_k")
        with torch.inference_mode():
            y = lin(x)
    eager = F.linear(quant.round_activations(x, "i16"), lin.dequantized(), lin.bias)
    assert torch.equal(y, lin._dequantized_product(quant.round_activations(x, "i16")))
    assert ((y - eager).abs() <= 1e-4 * eager.abs().max()).all()
