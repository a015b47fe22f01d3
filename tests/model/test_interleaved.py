"""Row-interleaved (x16) quantized weights: QuantLinear's layout for the decode kernels (quant_gemv.c).

The layout holds the same bytes as llama.cpp's row-major blocks, regrouped (interleave /
deinterleave are inverses; every reader gets the row-major values back); each level's int32 sums
are the exact sums bit for bit; the products are within fp32 rounding of the exact product of the
same codes (test_isa's bound), the vector kernel bit-identical to the portable reference, and
independent of the thread count and of the rows around a row.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from caramba.model import fast_decode, isa, quant
from caramba.model.quant import QuantLinear
from conftest import make_model
from test_isa import SHAPES, U, exact_product, layer, level, library, ptr, weight_codes  # noqa: F401  (level: fixture)

FORMATS = [("q8_0", "q8"), ("q4_0", "q8"), ("q4_1", "q8"), ("q8_0", "i16"), ("q4_1", "i16"), ("q8_0", "f32"),
           ("q4_1", "f32")]


def x16(lin: QuantLinear) -> QuantLinear:
    return lin.relayout("x16")


# --- the layout ------------------------------------------------------------------------------------

@pytest.mark.parametrize("N", [1, 16, 17, 40, 97])
def test_interleave_round_trips_and_pads_with_zero_rows(N):
    codes = torch.randint(-128, 128, (N, 96), dtype=torch.int8, generator=torch.Generator().manual_seed(N))
    packed = quant.interleave(codes, 4)
    G = -(-N // 16)
    assert packed.shape == (G, 24, 16, 4)
    if N % 16:
        assert not packed[-1, :, N % 16:].any()
    assert torch.equal(packed[0, 5, min(3, N - 1)], codes[min(3, N - 1), 20:24])   # unit 5 of row 3: bytes 20..23
    assert torch.equal(quant.deinterleave(packed, N), codes)


@pytest.mark.parametrize("fmt,act", FORMATS)
@pytest.mark.parametrize("N", [7, 16, 33])
def test_every_reader_sees_the_same_weights_in_either_layout(fmt, act, N):
    """dequantized(), embedding rows (C and torch paths), row_major() and state_dict() give the
    row-major layer's values bit for bit; a state_dict loads into either layout."""
    rows = layer(fmt, act, N, 96, seed=N).relayout("rows")
    inter = layer(fmt, act, N, 96, seed=N).relayout("x16")
    assert inter.layout == "x16" and inter.qs.shape == (-(-N // 16), (96 if fmt == "q8_0" else 48) // 4, 16, 4)
    assert torch.equal(rows.dequantized(), inter.dequantized())
    assert torch.equal(rows.dequantized(), rows._dequantize(*rows.row_major()))   # the C pass is torch's values
    for a, b in zip(rows.row_major(), inter.row_major()):
        assert (a is None and b is None) or torch.equal(a, b)
    ids = torch.tensor([[0, N - 1], [N // 2, 3 % N]])
    assert torch.equal(rows.embedding(ids), inter.embedding(ids))
    assert torch.equal(inter.embedding(ids.int()), rows.embedding(ids))          # int32 ids: the torch path
    state = inter.state_dict()
    assert set(state) == set(rows.state_dict())
    assert all(torch.equal(state[k], v) for k, v in rows.state_dict().items())
    fresh = layer(fmt, act, N, 96, seed=N + 1).relayout("x16")
    fresh.load_state_dict(rows.state_dict())
    assert torch.equal(fresh.qs, inter.qs) and torch.equal(fresh.d, inter.d)
    back = layer(fmt, act, N, 96, seed=N + 1).relayout("rows")
    back.load_state_dict(state)
    assert torch.equal(back.qs, rows.qs)


def test_layout_errors_name_the_field():
    with pytest.raises(ValueError, match="no layout 'x32' for weights q8_0 with f32"):
        layer("q8_0", "f32", 16, 32, seed=0).relayout("x32")
    with pytest.raises(ValueError, match="no layout 'cols'"):
        QuantLinear("q8_0", torch.zeros(4, 32, dtype=torch.int8), torch.ones(4, 1), act="q8", layout="cols")


# The levels with a vector kernel for an X16 format (quant_gemv.c's x16_vector): every format at
# avx512vnni (512 bits); at avx2, avxvnni and avx512 (256 bits) the q8-activation ones and q4_1's
# int16 ones (q8_0's int16 ones would overflow avx2's byte-pair sums).
X16_VECTOR = {"avx512vnni": set(FORMATS), **{name: {f for f in FORMATS if f[1] == "q8" or f[0] == "q4_1"}
                                             for name in ("avx2", "avxvnni", "avx512")}}


def vector_levels(fmt: str, act: str) -> list[str]:
    return [name for name, kinds in X16_VECTOR.items() if (fmt, act) in kinds and isa.available(name)]


def test_the_default_layout_follows_the_kernels_level(level):
    """x16 where the level has a vector kernel for the format, rows elsewhere (a level without one
    would run the slow reference); a process started with CARAMBA_ISA=scalar makes rows layers."""
    lib = library()
    for fmt, act in FORMATS:
        want = "x16" if (fmt, act) in X16_VECTOR.get(level, ()) else "rows"
        assert quant.default_layout(fmt, act) == want, (fmt, act)
        assert lib.x16_vector(quant.FORMAT_IDS[(fmt, act, "x16")]) == (want == "x16")
    assert lib.x16_vector(quant.Q4_0_Q8) == 0   # a row-major format is never x16's
    code = ("from caramba.model import quant; import torch; "
            "print(quant.QuantLinear.from_float(torch.randn(16, 64), fmt='q4_0').layout)")
    env = {**os.environ, isa.ENV: "scalar", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert got.stdout.strip() == "rows"


# --- the integer sums ------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("nb", [1, 5])
def test_x16_block_sums_are_the_exact_sums(level, fmt, nb):
    """The 16 lanes' int32 sums of a group's blocks (q8_0's codes through w + 128 and -128 sum(a);
    q4_0's nibbles with -8 sum(a) folded in) at every level, extremes included, equal the exact
    sums bit for bit."""
    lib = library()
    fid, packed, a, exact = x16_block_case(fmt, nb, seed=nb)
    out = np.zeros((nb, 16), np.int32)
    lib.x16_block_sums(fid, ptr(packed), ptr(a), nb, ptr(out))
    assert np.array_equal(out.astype(np.int64), exact)


def x16_block_case(fmt: str, nb: int, seed: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """One X16 group of nb random blocks (codes' extremes included) and one activation row of q8
    codes: (format id, the packed codes, the codes a [nb, 32], the exact int32 sums [nb, 16])."""
    rng = np.random.default_rng(seed)
    a = rng.integers(-127, 128, (nb, 32)).astype(np.int8)
    a[0, :4] = [127, -127, -127, 127]
    if fmt == "q8_0":
        w = rng.integers(-128, 128, (16, nb * 32)).astype(np.int8)
        w[0, :4] = [-128, 127, -128, 0]
        values = w.astype(np.int64).reshape(16, nb, 32)
    else:
        nib = rng.integers(0, 16, (16, nb, 32))
        nib[0, 0, :3] = [15, 0, 15]
        w = (nib[..., :16] | (nib[..., 16:] << 4)).astype(np.uint8).reshape(16, nb * 16)
        values = nib.astype(np.int64) - (8 if fmt == "q4_0" else 0)
    packed = np.ascontiguousarray(quant.interleave(torch.from_numpy(w), 4).numpy())
    fid = {"q8_0": quant.Q8_0_Q8_X16, "q4_0": quant.Q4_0_Q8_X16, "q4_1": quant.Q4_1_Q8_X16}[fmt]
    return fid, packed, a, np.einsum("rbi,bi->br", values, a.astype(np.int64))


# --- the products ------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,act", FORMATS)
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_x16_products_equal_the_exact_product_within_fp32_rounding(level, fmt, act, M, N, K):
    """Per lane: one rounding of d_w d_x, exact int32 sums (int16 codes: 256 sum(w hi) + sum(w lo))
    converted with at most one rounding, split codes' two sums met by one FMA, an FMA chain of
    nb = K / 32 block terms, q4_1's minimums chain and the bias: within (nb + 12) u of sum |terms|
    (test_isa's bound), at every level (below avx512vnni: the portable reference). f32 activations
    go in as ACT_SPLIT's codes at every level: x to within s / 2^16 per element (test_isa)."""
    lin = x16(layer(fmt, act, N, K, seed=M * N + K))
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(K))
    with torch.inference_mode():
        got = lin(x).double().numpy()
    rows = lin.relayout("rows")
    exact, mag = exact_product(rows, x)
    err = np.abs(got - exact)
    bound = (K // 32 + 12) * U * mag
    if act == "f32":
        c, d, m = weight_codes(rows)
        wmax = np.abs(d[..., None] * c + m[..., None])
        split = 2 * np.abs(x.double().numpy()).reshape(M, -1, 32).max(-1) / 32767 / 2 ** 16
        bound = bound + np.einsum("nbi,mb->mn", wmax, split)
    assert (err <= bound).all(), float((err - bound).max())


@pytest.mark.parametrize("fmt,act", FORMATS)
def test_x16_vector_kernels_are_the_reference_bit_for_bit_at_any_thread_count(fmt, act):
    """Each vector kernel (512 bits at avx512vnni; 256 bits at avx2, avxvnni and avx512) and the
    portable reference make the same FMAs lane by lane, so a machine's level
    never changes a token; 1 and 2 threads split whole groups, so neither does the thread count; a
    row's output is the same in a batch of 1 or 5."""
    lib = library()
    levels = vector_levels(fmt, act)
    if not levels:
        pytest.skip(f"CPU has none of {', '.join(n for n, k in X16_VECTOR.items() if (fmt, act) in k)}: "
                    "the reference is all there is")
    for M, N, K in SHAPES + [(2, 200, 576)]:
        lin = x16(layer(fmt, act, N, K, seed=N + K))
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(M + K))
        outs = {}
        for level_, threads in [(name, t) for name in levels for t in (1, 2)] + [("scalar", 1)]:
            y = torch.empty(M, N)
            with isa.use_isa(level_):
                assert lib.gemv_x16(quant.FORMAT_IDS[(fmt, act, "x16")], x.data_ptr(), lin.qs.data_ptr(),
                                    lin.d.data_ptr(), None if lin.m is None else lin.m.data_ptr(), y.data_ptr(),
                                    M, N, K, threads) == 0
            outs[level_, threads] = y + lin.bias
        ref = outs["scalar", 1]
        for key, y in outs.items():
            assert torch.equal(y, ref), (key, M, N, K)
        with torch.inference_mode():
            assert torch.equal(lin(x[:1]), ref[:1])


@pytest.mark.parametrize("weights,act", [("q8_0", "q8"), ("q4_0", "q8"), ("q4_1", "f32"), ("q4_1", "i16")])
@pytest.mark.parametrize("kernel", ["avx512vnni", "avx2"])
def test_decode_steps_with_x16_weights_equal_the_rows_layout_within_rounding(weights, act, kernel):
    """The C step over x16 layers (every projection shape of the tiny model: 128, 64, 256 and a
    97-row head with a 1-row tail group) against the same model in rows, with the 512-bit and the
    256-bit kernels: the same codes and activation codes, only the fp32 block sums' order differs;
    1 and 2 threads give the same bits."""
    if fast_decode.library() is None or not isa.available(kernel):
        pytest.skip("no decode step kernel" if fast_decode.library() is None else f"CPU lacks {kernel}")
    with isa.use_isa(kernel):
        steps_in_both_layouts(weights, act)


def steps_in_both_layouts(weights: str, act: str) -> None:
    model = make_model(seed=3)
    quant.quantize_model(model, "q4_0" if weights == "q4_1" else weights, act="q8" if weights == "q4_1" else act)
    if weights == "q4_1":   # native's blocks: q4_0's as q4_1 (w = d q + m, m = -8 d)
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, QuantLinear):
                    qs, d, m = child.row_major()
                    fmt, m = ("q4_1", -8 * d.float()) if child.fmt == "q4_0" else (child.fmt, m)
                    setattr(parent, name, QuantLinear(fmt, qs, d, m, bias=child.bias, act=act))
    quant.relayout(model, "x16")
    assert all(m.layout == "x16" for m in model.modules() if isinstance(m, QuantLinear))
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(4))
    runs = []
    for layout, threads in (("x16", 1), ("x16", 2), ("rows", 1)):
        quant.relayout(model, layout)
        model.decode_threads = fast_decode.ThreadChoice(fixed=threads)
        with torch.inference_mode():
            cache = model.new_cache(2, 20)
            model.fast_decode = False
            model(ids, cache=cache)
            model.fast_decode = True
            runs.append(torch.cat([model(torch.full((2, 1), t), cache=cache).reshape(-1) for t in (5, 6)]))
    assert torch.equal(runs[0], runs[1])
    # a summation-order difference may move one q8 activation code by one step: test_fast_decode's bound
    assert (runs[0] - runs[2]).abs().max() <= 2 / quant.ACTIVATION_LEVELS["q8"] * runs[2].abs().max()
