"""The fused decode step's parts (decode_step.c): its argument structs against the compiler's
layout, and each SIMD loop against its portable reference (*_ref), which the scalar instruction
set level runs (caramba.model.isa.use_isa("scalar")): the fp32 products straight, within fp32
rounding of the exact product; whole steps through the references against the torch path."""

from __future__ import annotations

import ctypes

import pytest
import torch

from caramba.model import fast_decode, isa
from caramba.model.step_abi import Lin, layout
from conftest import make_model
from test_fast_decode import POLICIES, assert_same, assert_same_cache_kind, run_both

U = 2.0 ** -24   # fp32's unit roundoff


@pytest.fixture(autouse=True)
def lib():
    lib = fast_decode.library()
    if lib is None:
        pytest.skip(f"decode step kernel {fast_decode.status()}")
    return lib


def test_the_structs_are_the_compilers_layout(lib):
    """step_abi's ctypes Structures and decode_step.h's structs: the same sizes and offsets."""
    out = (ctypes.c_int64 * 64)()
    n = lib.step_abi_layout(out)
    assert list(out[:n]) == layout()


def product(lib, fmt: int, w: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, threads: int = 1,
            row_exact: bool = False):
    """step_linear: y = x W^T (+ bias) with W [N, K] given as F32_ROWS, or W^T [K, N] as F32_COLS;
    row_exact: one row summed as the batch tiles sum it (StepArgs.row_exact)."""
    M, K = x.shape
    N = w.shape[0] if fmt == fast_decode.F32_ROWS else w.shape[1]
    y = torch.full((M, N), float("nan"))
    L = Lin(fmt, N, K, w.data_ptr(), None, None, None if bias is None else bias.data_ptr())
    assert lib.step_linear(ctypes.byref(L), x.data_ptr(), M, y.data_ptr(), int(row_exact), threads) == 0
    return y


SHAPES = [(1, 37, 576), (1, 64, 70), (1, 61, 9), (2, 37, 99), (3, 130, 64), (4, 9, 3), (5, 4133, 40)]


def levels() -> list[str]:
    return [level for level in ("scalar", "avx2", "avx512") if isa.resolve(level) == level]


@pytest.mark.parametrize("fmt", ["rows", "cols"])
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_fp32_products_at_each_level_are_the_exact_product_within_rounding(lib, fmt, M, N, K):
    """Reference and vector loops (row pairs and their tiles, input-major bands and their tails)
    each within K u sum|w x| of the float64 product, which bounds any summation order; and so
    within twice that of each other; avx512's one-row input-major loop gives avx2's bits, and each
    level's one-row input-major loop the bits of that row in a batch, as is any row alone with
    row_exact (the [N, K] rows' too). N over COLS_CHUNK / threads crosses bands."""
    g = torch.Generator().manual_seed(M * N + K)
    w = torch.randn(N, K, generator=g)
    x = torch.randn(M, K, generator=g)
    bias = torch.randn(N, generator=g) if N % 2 else None
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    bound = (K + 1) * U * (x.double().abs() @ w.double().abs().T + (0 if bias is None else bias.double().abs()))
    f = fast_decode.F32_ROWS if fmt == "rows" else fast_decode.F32_COLS
    weights = w if fmt == "rows" else w.T.contiguous()
    got = {}
    for level in levels():
        with isa.use_isa(level):
            for threads in (1, 2):
                y = product(lib, f, weights, x, bias, threads)
                assert ((y.double() - exact).abs() <= bound).all(), (level, threads, float((y.double() - exact).abs().max()))
                if threads == 1:
                    got[level] = y
                else:
                    assert torch.equal(y, got[level]), "a product's bits do not depend on the thread count"
            if fmt == "cols" and M > 1 and level != "scalar":   # the one-row loops: that row's bits in a batch
                assert torch.equal(product(lib, f, weights, x[:1], bias, 1), got[level][:1]), level
            for r in {0, M - 1} if M > 1 else ():   # row_exact: a row alone, its bits in the batch (rows too)
                assert torch.equal(product(lib, f, weights, x[r : r + 1], bias, 2, row_exact=True),
                                   got[level][r : r + 1]), (level, r)
    if "avx2" in got:
        assert ((got["scalar"].double() - got["avx2"].double()).abs() <= 2 * bound).all()
    if "avx512" in got:   # the same loops (rows) or the same per-column arithmetic, 16 lanes (cols)
        assert torch.equal(got["avx512"], got["avx2"])


# (N, K): odd N (with a bias) and not, under and over a column block (256) and a k block (64), K
# off the 16s and each remainder of the quads; K = 1100 takes the row tiles through blocks of k
# (step_linear.c's ROWS_KB, ROWS_L1X: from 6 rows a tile) in groups of 32 row pairs, and a tail
TILE_SHAPES = [(301, 133), (37, 70), (9, 67), (530, 64), (16, 20), (151, 1100)]


@pytest.mark.parametrize("fmt", ["rows", "cols"])
@pytest.mark.parametrize("N,K", TILE_SHAPES)
def test_avx512_batch_tiles_for_every_row_count(lib, fmt, N, K):
    """The avx512 levels' batch loops (rows: tiles of 2 weight rows x up to 8 token rows, whole or
    by blocks of k; cols: register tiles of up to 8 token rows x 32 columns over blocks of 64 k
    and 256 columns) for
    M = 2..33, so every split into tiles and every tail: within K u sum|w x| of the float64
    product, the scalar reference within twice that; the same bits at 1 and 2 threads, as the avx2
    level's (the same arithmetic per output), and (cols; rows with row_exact) a row's bits alone."""
    if isa.resolve("avx512") != "avx512":
        pytest.skip("no avx512 level here")
    g = torch.Generator().manual_seed(N * K)
    w = torch.randn(N, K, generator=g)
    rows = torch.randn(33, K, generator=g)
    bias = torch.randn(N, generator=g) if N % 2 else None
    f = fast_decode.F32_ROWS if fmt == "rows" else fast_decode.F32_COLS
    weights = w if fmt == "rows" else w.T.contiguous()
    for M in range(2, 34):
        x = rows[:M]
        exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
        bound = (K + 1) * U * (x.double().abs() @ w.double().abs().T + (0 if bias is None else bias.double().abs()))
        with isa.use_isa("scalar"):
            ref = product(lib, f, weights, x, bias)
        with isa.use_isa("avx2"):
            avx2 = product(lib, f, weights, x, bias)
        with isa.use_isa("avx512"):
            got = product(lib, f, weights, x, bias)
            assert ((got.double() - exact).abs() <= bound).all(), (M, float((got.double() - exact).abs().max()))
            assert ((got.double() - ref.double()).abs() <= 2 * bound).all(), M
            assert torch.equal(product(lib, f, weights, x, bias, 2), got), M
            assert torch.equal(got, avx2), M
            if fmt == "cols":
                assert torch.equal(product(lib, f, weights, x[M - 1:], bias), got[M - 1:]), M
            assert torch.equal(product(lib, f, weights, x[M - 1:], bias, row_exact=True), got[M - 1:]), M


@pytest.mark.parametrize("name", ["fp32", "q4_1 qblock=8", "k=q4_1c,v=q4_1 qblock=4", "nf4 qblock=4 residual_len=3",
                                  "q4_0l rotated"])
@pytest.mark.parametrize("batch", [1, 3])
def test_steps_through_the_references_equal_the_torch_path(name, batch, taken):  # noqa: F811
    """A whole step at the scalar level (every loop's reference: fp32 products, scores, value
    mixing, the weight products) against the torch path, as the vector steps are tested."""
    from caramba.cache import CachePolicy

    if isa.resolve("avx2") != "avx2":
        pytest.skip("without AVX2 every test already runs the references")
    policy = CachePolicy.build(**POLICIES[name]) if name != "fp32" else CachePolicy.build("fp32")
    model = make_model(seed=21)
    ids = torch.randint(0, 97, (batch, 5), generator=torch.Generator().manual_seed(22))
    steps = list(range(7, 15))
    with isa.use_isa("scalar"):
        ref, got = run_both(model, ids, steps, kind=policy)
    assert len(taken) == len(steps)
    if name == "fp32":
        assert_same(ref, got, model.config)
    else:
        assert_same_cache_kind(ref, got, model.config, policy)


def test_the_projection_formats_are_quant_gemv_hs():
    """fast_decode's format ids are the enum of quant_gemv.h that decode_step.c and quant_gemv.c
    switch on."""
    import re
    from pathlib import Path

    text = (Path(fast_decode.__file__).with_name("quant_gemv.h")).read_text()
    enum = {name: int(v) for name, v in re.findall(r"\b(F32_\w+|Q\d_[\dK]_\w+) = (\d+)", text)}
    assert enum and all(getattr(fast_decode, name) == v for name, v in enum.items())
    assert set(fast_decode._QUANT_FORMATS.values()) | {fast_decode.F32_ROWS, fast_decode.F32_COLS} == set(enum.values())


def _rounding_cases() -> torch.Tensor:
    """fp32 inputs where a rounding to fp16 or bf16 can go wrong: random bit patterns (NaNs among
    them), each also made a tie of either format (both parities) and a bit either side of one;
    zeros, infinities, the formats' largest values and the inputs that round past them, their
    subnormals and fp32's."""
    g = torch.Generator().manual_seed(31)
    raw = torch.randint(-2**31, 2**31 - 1, (2048,), generator=g, dtype=torch.int64)
    rows = [raw]
    for keep, low in ((0xffff0000, (0x8000, 0x7fff, 0x8001)), (0xffffe000, (0x1000, 0x0fff, 0x1001))):
        rows += [(raw & keep) | v for v in low]
    bits = torch.cat(rows).to(torch.int32)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 65504.0, 65519.99, 65520.0, -65520.0,
                            2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-14, 1e-40, -1e-45, 3.3895e38, 3.3961e38,
                            torch.finfo(torch.float32).max, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-11])
    return torch.cat([bits.view(torch.float32), special])


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_a_16_bit_stream_rounds_new_tokens_as_torch_does(lib, kind):
    """What the step stores of a new K or V in an fp16 or bf16 stream and reads back: torch's copy
    into that dtype, rounded to nearest even, at the scalar level (fp32_to_fp16_ref) and with the
    conversion instruction: the same values, zeros' signs included, and NaN for NaN."""
    kid = fast_decode.FLOAT_KINDS[{"fp16": torch.float16, "bf16": torch.bfloat16}[kind]]
    x = _rounding_cases()
    want = x.to({"fp16": torch.float16, "bf16": torch.bfloat16}[kind]).float()
    nan = want.isnan()
    assert nan.any() and (want[~nan] == 0).any() and want.isinf().any()
    for level in ("scalar", "avx2") if isa.resolve("avx2") == "avx2" else ("scalar",):
        got = torch.empty_like(x)
        with isa.use_isa(level):
            lib.kv_round_floats(kid, x.data_ptr(), x.numel(), got.data_ptr())
        assert torch.equal(got.isnan(), nan), level
        assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32)), level


@pytest.mark.parametrize("kind", [*fast_decode.TOKEN_KINDS, *fast_decode.CHANNEL_KINDS], ids=str)
def test_the_quantizers_write_the_same_bits_through_their_references(lib, kind):
    """kv_stream.c's fp16 rounding by the conversion instruction and by fp32_to_fp16_ref (the
    scalar level), over scales from fp16's subnormals to near its overflow: the same codes and
    block parameters, bit for bit (integer results)."""
    if isa.resolve("avx2") != "avx2":
        pytest.skip("CPU lacks avx2: the reference is all there is")
    kid = kind.spec.step
    D, qb = 64, 64 if kind.spec.per_channel else 16
    g = torch.Generator().manual_seed(kid)
    x = torch.cat([torch.randn(8, D, generator=g) * s for s in (1e-7, 3e-5, 1e-2, 1.0, 300.0, 6e4)]).contiguous()
    np_ = (2 if kind.spec.zero_point else 1) * (D // qb)
    out = {}
    for level in ("scalar", "avx2"):
        u = torch.zeros(x.shape[0], D, dtype=torch.uint8)
        p = torch.zeros(x.shape[0], np_, dtype=torch.int16)
        with isa.use_isa(level):
            lib.quantize_kv(kid, x.data_ptr(), x.shape[0], D, qb, u.data_ptr(), p.data_ptr())
        out[level] = (u, p)
    assert torch.equal(out["scalar"][0], out["avx2"][0]) and torch.equal(out["scalar"][1], out["avx2"][1])
