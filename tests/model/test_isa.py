"""The quantized products at every instruction set level this machine has (cpu_isa.c, caramba.model.isa).

Each level's int32 block sums against the portable reference, bit for bit; each level's products
against an exact (float64) product of the same codes, within fp32 rounding of a sum of K / 32 block
terms; every vector level bit-identical to avx2 (so a machine's choice never changes a token);
the dispatch never picks a level the CPU lacks and honours CARAMBA_ISA. A level the CPU lacks is
skipped with the missing feature named.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from caramba.model import fast_decode, isa, quant
from caramba.model.backend import CStep
from caramba.model.quant import QuantLinear, gguf_blocks
from conftest import make_model

# each level's features as /proc/cpuinfo names them (on top of the levels below it)
FEATURES = {"scalar": [], "avx2": ["avx2", "fma", "f16c"], "avxvnni": ["avx2", "fma", "f16c", "avx_vnni"],
            "avx512": ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"],
            "avx512vnni": ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"],
            "neon": ["asimd", "asimddp"]}   # ARM's (its /proc/cpuinfo "Features"; tests/model/test_cross_arm.py runs it)
U = 2.0 ** -24   # fp32's unit roundoff


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):   # x86's, ARM's
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def library():
    lib = quant.library()
    if lib is None:
        pytest.skip(f"weight kernels {quant.status()}")
    return lib


@pytest.fixture(params=isa.LEVELS)
def level(request):
    """Each level, where this machine has it; the products run at it inside the test."""
    name = request.param
    library()
    if not isa.available(name):
        missing = [f for f in FEATURES[name] if f not in cpu_flags()]
        pytest.skip(f"CPU lacks {', '.join(missing)}" if missing else f"the kernel build lacks {name} "
                    "(the compiler's -march=native target)")
    with isa.use_isa(name) as got:
        assert got == name
        yield name


def ptr(a: np.ndarray) -> int:
    return a.ctypes.data_as(ctypes.c_void_p).value


# --- the integer sums ----------------------------------------------------------------------------

def random_blocks(kind: int, n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(weights, activations, exact int64 sums) of n blocks, codes over their whole ranges,
    extremes included: q8_0 weights -128..127 (a GGUF may hold -128), q8 activations -127..127
    (the kernels' rounding never makes -128), int16 ones -32767..32767, nibbles 0..15."""
    rng = np.random.default_rng(seed)
    if kind in (0, 2):
        w = rng.integers(-128, 128, (n, 32)).astype(np.int8)
        w[0, :4] = [-128, 127, -128, 0]
        wide = w.astype(np.int64)
    else:
        nib = rng.integers(0, 16, (n, 32))
        nib[0, :3] = [15, 0, 15]
        w = (nib[:, :16] | (nib[:, 16:] << 4)).astype(np.uint8)
        wide = nib.astype(np.int64)
    top = 127 if kind < 2 else 32767
    a = rng.integers(-top, top + 1, (n, 32)).astype(np.int8 if kind < 2 else np.int16)
    a[0, :4] = [top, -top, -top, top]
    return w, a, (wide * a.astype(np.int64)).sum(1)


@pytest.mark.parametrize("kind", [0, 1, 2, 3], ids=["q8_0xq8", "q4xq8", "q8_0xi16", "q4xi16"])
@pytest.mark.parametrize("n", [1, 2, 7, 18])
def test_block_sums_are_the_references_bit_for_bit(level, kind, n):
    """The int32 sum of each block's products through the level's primitives (vpdpbusd, vpdpwssd,
    maddubs/madd, the 512-bit pairs with an odd block alone) equals the exact sum."""
    lib = library()
    w, a, exact = random_blocks(kind, n, seed=kind * 100 + n)
    out = np.zeros(n, np.int32)
    lib.block_sums(kind, ptr(w), ptr(a), n, ptr(out))
    assert np.array_equal(out.astype(np.int64), exact)


@pytest.mark.parametrize("mode", ["q8", "i16", "split"])
def test_activation_codes_are_the_same_at_every_level(level, mode):
    lib = library()
    x = torch.randn(3, 96 * 32, generator=torch.Generator().manual_seed(1)).numpy()
    x[0, :32] *= 1e-30                                   # a tiny block: its power-of-two scale stays finite
    x[1, 32:64] = 0.0
    width = 2 if mode == "split" else 1
    codes = [np.zeros((3, 96 * 32 * width), np.int8 if mode == "q8" else np.int16) for _ in range(2)]
    scales = [np.zeros((3, 96), np.float32) for _ in range(2)]
    fn = {"q8": lib.quantize_activations_q8, "i16": lib.quantize_activations_i16, "split": lib.split_activations}[mode]
    fn(ptr(x), 3, 96 * 32, ptr(codes[0]), ptr(scales[0]))
    with isa.use_isa("scalar"):
        fn(ptr(x), 3, 96 * 32, ptr(codes[1]), ptr(scales[1]))
    assert np.array_equal(codes[0], codes[1]) and np.array_equal(scales[0].view(np.int32), scales[1].view(np.int32))


# --- the products ----------------------------------------------------------------------------------

FORMATS = [("q8_0", "q8"), ("q4_0", "q8"), ("q4_1", "q8"), ("q8_0", "i16"), ("q4_1", "i16"), ("q8_0", "f32"),
           ("q4_1", "f32")]
# blocks per row: 1, an odd 3, 18 (SmolLM2's 576), 49 (a 32-block factor chunk and an odd 17);
# N cuts the rows into calls of 16 with a remainder; M: one row, a tile of 4 and one of 1
SHAPES = [(1, 7, 32), (5, 19, 96), (1, 33, 576), (3, 17, 1568)]


def layer(fmt: str, act: str, N: int, K: int, seed: int) -> QuantLinear:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=gen)
    bias = torch.randn(N, generator=gen)
    if fmt in ("q8_0", "q4_0"):
        return QuantLinear.from_float(w, bias, act=act, fmt=fmt)
    p = gguf_blocks(gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_1), "Q4_1", (N, K))
    return QuantLinear("q4_1", p["qs"], p["d"], p["m"], bias=bias, act=act)


def weight_codes(lin: QuantLinear) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes [N, nb, 32] as float64, scales d [N, nb], offsets m [N, nb]) with w = d c + m."""
    N, K = lin.out_features, lin.in_features
    qs, d, m = lin.row_major()
    d = d.double().numpy()
    if lin.fmt == "q8_0":
        return qs.numpy().astype(np.float64).reshape(N, K // 32, 32), d, np.zeros_like(d)
    q = qs.numpy().reshape(N, K // 32, 16)
    codes = np.concatenate([q & 15, q >> 4], -1).astype(np.float64)
    return codes, d, (-8.0 * d if lin.fmt == "q4_0" else m.double().numpy())


def exact_product(lin: QuantLinear, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(the product in float64 of the weights with the activations as the kernels take them: their
    q8 / int16 codes, or x itself for f32; the sum of |terms| it adds, for the rounding bound)."""
    lib = library()
    M, K = x.shape
    c, d, m = weight_codes(lin)
    xn = x.numpy()
    if lin.act == "f32":
        a, dx = xn.astype(np.float64).reshape(M, K // 32, 32), np.ones((M, K // 32))
    else:
        codes = np.zeros((M, K), np.int8 if lin.act == "q8" else np.int16)
        dx32 = np.zeros((M, K // 32), np.float32)
        (lib.quantize_activations_q8 if lin.act == "q8" else lib.quantize_activations_i16)(
            ptr(np.ascontiguousarray(xn)), M, K, ptr(codes), ptr(dx32))
        a, dx = codes.astype(np.float64).reshape(M, K // 32, 32), dx32.astype(np.float64)
    sums = np.einsum("nbi,mbi->mnb", c, a)                     # per block, exact in float64
    mags = np.einsum("nbi,mbi->mnb", np.abs(c), np.abs(a))
    asum = a.sum(-1)                                           # [M, nb]
    y = (d[None] * dx[:, None] * sums + m[None] * dx[:, None] * asum[:, None]).sum(-1)
    mag = (np.abs(d[None] * dx[:, None]) * mags + np.abs(m[None] * dx[:, None] * asum[:, None])).sum(-1)
    bias = lin.bias.double().numpy()
    return y + bias, mag + np.abs(bias)


@pytest.mark.parametrize("fmt,act", FORMATS)
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_products_equal_the_exact_product_within_fp32_rounding(level, fmt, act, M, N, K):
    """Every level against the exact product of the same codes. The fp32 arithmetic: one rounding
    for each block factor d_w d_x, and sums of at most nb = K / 32 block terms per lane (FMA chains,
    two chains' sum, an 8-lane horizontal sum, the minimums and the bias): each output is within
    (nb + 12) u of sum |terms|, u = 2^-24. The f32 products carry x as two int16 codes at vector
    levels (ACT_SPLIT), x to within s / 2^16 per element, s < 2 max|x_block| / 32767."""
    lin = layer(fmt, act, N, K, seed=M * N + K)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(K))
    with torch.inference_mode():
        got = lin(x).double().numpy()
    exact, mag = exact_product(lin, x)
    bound = (K // 32 + 12) * U * mag
    if act == "f32" and level != "scalar":
        c, d, m = weight_codes(lin)
        wmax = np.abs(d[..., None] * c + m[..., None]).reshape(N, K)
        split = (2 * np.abs(x.double().numpy()).reshape(M, -1, 32).max(-1) / 32767 / 2 ** 16)   # [M, nb]
        bound = bound + np.einsum("nbi,mb->mn", wmax.reshape(N, K // 32, 32), split)
    err = np.abs(got - exact)
    assert (err <= bound).all(), float((err - bound).max())


@pytest.mark.parametrize("fmt,act", FORMATS)
def test_vector_levels_are_bit_identical_to_avx2(level, fmt, act):
    """Each vector level sums the same exact int32 lanes in the same order as avx2 (the 512-bit
    levels two blocks per vector, in avx2's even and odd accumulators' lanes): the same bits, so
    a machine's level never changes a generated token."""
    if level == "scalar" or not isa.available("avx2"):
        pytest.skip("the scalar reference sums in another order" if level == "scalar" else "CPU lacks avx2")
    for M, N, K in SHAPES:
        lin = layer(fmt, act, N, K, seed=N + K)
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(M + K))
        with torch.inference_mode():
            got = lin(x)
            with isa.use_isa("avx2"):
                want = lin(x)
        assert torch.equal(got, want), (M, N, K)


@pytest.mark.parametrize("weights", ["q8_0", "q4_0", "q4_1"])
def test_decode_steps_are_bit_identical_at_every_vector_level(level, weights):
    """The fused decode step (decode_step.c includes the same kernels) at each vector level gives
    avx2's logits bit for bit (a batch of 3: each row a tile row)."""
    if level == "scalar" or not isa.available("avx2"):
        pytest.skip("the scalar reference sums in another order" if level == "scalar" else "CPU lacks avx2")
    if fast_decode.library() is None:
        pytest.skip(f"decode step kernel {fast_decode.status()}")
    model = make_model(seed=3)
    if weights == "q4_1":
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                w = quant._float_weight(child)
                if w is not None and not isinstance(child, QuantLinear):
                    p = gguf_blocks(gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_1), "Q4_1", tuple(w.shape))
                    setattr(parent, name, QuantLinear("q4_1", p["qs"], p["d"], p["m"], getattr(child, "bias", None)))
    else:
        quant.quantize_model(model, weights, act="q8")
    ids = torch.randint(0, 97, (3, 12), generator=torch.Generator().manual_seed(4))
    runs = []
    for name in (level, "avx2"):
        with isa.use_isa(name), torch.inference_mode():
            cache = model.new_cache(3, 20)
            model(ids, cache=cache)                        # the torch path's prefill
            step = CStep(model)
            steps = [step(torch.full((3, 1), t), cache=cache) for t in (5, 6)]
            assert step.path == "c"
        runs.append(torch.cat([s.reshape(-1) for s in steps]))
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("kind, qblock", [("q4_0", 32), ("q4_0", 16), ("q4_1", 32), ("nf4", 32), ("nf4", 16),
                                          ("q2_1", 32), ("q4_0l", 32), ("q8_0", 32)])
def test_attention_over_codes_is_bit_identical_at_every_vector_level(level, kind, qblock):
    """The key scores and values read straight from a quantized cache's codes (kv_stream.c; at the
    avx512 levels 16 codes a permute, kv_codes.h) give avx2's logits and cache bit for bit: SmolLM2's
    head shapes (head_dim 64, 3 query heads a KV head), a context of 150 tokens, two steps."""
    if level == "scalar" or not isa.available("avx2"):
        pytest.skip("the scalar reference sums in another order" if level == "scalar" else "CPU lacks avx2")
    if fast_decode.library() is None:
        pytest.skip(f"decode step kernel {fast_decode.status()}")
    from caramba.cache import CachePolicy

    model = make_model(seed=5, head_dim=64, n_heads=6, n_kv_heads=2)
    ids = torch.randint(0, 97, (2, 150), generator=torch.Generator().manual_seed(6))
    runs = []
    for name in (level, "avx2"):
        with isa.use_isa(name), torch.inference_mode():
            cache = model.new_cache(2, 160, CachePolicy.build(kind, qblock=qblock))
            model(ids, cache=cache)
            step = CStep(model)
            steps = [step(torch.full((2, 1), t), cache=cache) for t in (5, 6)]
            assert step.path == "c"
        runs.append(torch.cat([s.reshape(-1) for s in steps]))
    assert torch.equal(runs[0], runs[1])


# --- the choice ------------------------------------------------------------------------------------

def test_the_choice_is_the_best_level_the_cpu_has_and_never_one_it_lacks():
    library()
    flags = cpu_flags()
    for name in isa.LEVELS:
        if isa.available(name):
            assert all(f in flags for f in FEATURES[name]) or not flags, name
    best = [name for name in isa.LEVELS if isa.available(name)][-1]
    assert isa.kernel_isa() == best or os.environ.get(isa.ENV)
    for name in isa.LEVELS:   # asking for a level never gives one above it, nor one the machine lacks
        with isa.use_isa(name) as got:
            assert isa.available(got) and isa.LEVELS.index(got) <= isa.LEVELS.index(name)
            assert isa.kernel_isa() == got == isa.resolve(name)   # cpu_isa.c's fallback, as isa.py says it
            if got != "scalar":   # within the asked level's family: never an x86 level for neon, nor neon for one
                assert (got in isa.ARM_LEVELS) == (name in isa.ARM_LEVELS)
    with pytest.raises(ValueError, match="not one of"):
        isa.available("avx9000")


def run_isa(env_value: str) -> subprocess.CompletedProcess:
    env = {**os.environ, isa.ENV: env_value}
    code = ("import warnings; warnings.simplefilter('always'); from caramba.model import isa, fast_decode; "
            "fast_decode.library(); print(isa.kernel_isa(), fast_decode.library().isa_name().decode())")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900,
                          cwd=Path(__file__).resolve().parents[2])


@pytest.mark.parametrize("asked", ["scalar", "avx2", "avx512vnni", "neon"])
def test_caramba_isa_forces_a_level_in_every_library(asked):
    library()
    run = run_isa(asked)
    assert run.returncode == 0, run.stderr
    got = run.stdout.split()
    want = asked if isa.available(asked) else None
    assert got[0] == got[1]                                   # the weight kernels and the decode step agree
    if want:
        assert got[0] == want
    else:   # the best level below it in its family (another family's level: scalar)
        assert isa.LEVELS.index(got[0]) < isa.LEVELS.index(asked) and isa.available(got[0])
        assert got[0] == isa.resolve(asked)


def test_an_unknown_caramba_isa_warns_and_runs_the_best_level():
    library()
    run = run_isa("avx1024")
    assert run.returncode == 0, run.stderr
    assert "CARAMBA_ISA='avx1024' is not an instruction set level" in run.stderr
    assert run.stdout.split()[0] == [name for name in isa.LEVELS if isa.available(name)][-1]


def test_amx_is_asked_for_and_refusal_is_no_crash():
    """AMX counts only with the CPU's flags and the OS's leave (arch_prctl); asking never kills
    the process (llama.cpp's prefill died with SIGILL on this VM)."""
    library()
    got = isa.amx()
    assert isinstance(got, bool)
    if not {"amx_tile", "amx_int8"} <= cpu_flags():
        assert not got
