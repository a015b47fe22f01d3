"""caramba's C kernels on ARM: built with the aarch64 cross compiler and run under qemu-aarch64.

Every kernel library builds for ARMv8.2-A (+dotprod) without a warning; the instruction set
choice there is the portable level (no x86 level is ever picked, AMX is absent, nothing SIGILLs);
and the portable references the x86 vector kernels are tested against give, on ARM, the exact
int32 block sums, the x86 build's activation codes bit for bit, and products within fp32
rounding of the exact product (test_isa's bound). There are no NEON kernels yet: on an ARM
machine the products run these references. Skipped, naming the packages, where the cross
compiler or the emulator is missing (CI installs neither).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cross_arch
import tolerance as tol
from caramba.cache import KVCacheKind, KVCacheTensorConfig, LayerKVCache
from caramba.cache import kernel as cache_kernel
from caramba.model import fast_decode, fused, quant, quant_gemm
from test_isa import FORMATS, SHAPES, U, exact_product, layer, random_blocks

pytestmark = pytest.mark.skipif(cross_arch.missing() is not None, reason=str(cross_arch.missing()))

LIBRARIES = {"quant_gemv": quant.SOURCES, "decode_step": fast_decode.SOURCES, "quant_gemm": quant_gemm.SOURCES,
             "quant_attend": [cache_kernel.SOURCE], "decode_ops": [fused.SOURCE]}
GEMV = {("q8_0", "q8"): "gemv_q8_0_q8", ("q8_0", "f32"): "gemv_q8_0_f32", ("q4_1", "f32"): "gemv_q4_1_f32",
        ("q4_1", "q8"): "gemv_q4_1_q8", ("q4_0", "q8"): "gemv_q4_1_q8", ("q8_0", "i16"): "gemv_q8_0_i16", ("q4_1", "i16"): "gemv_q4_1_i16"}


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """Every library compiled for aarch64 once: name -> (path, the compiler's result)."""
    where = tmp_path_factory.mktemp("aarch64")
    return {name: (where / f"{name}.so", cross_arch.compile_library(sources, where / f"{name}.so"))
            for name, sources in LIBRARIES.items()}


def emulated(builds, name: str):
    path, built = builds[name]
    if built.returncode:
        pytest.fail(f"the aarch64 build of {name} failed:\n{built.stderr}")
    return cross_arch.ArmLibrary.load(path)


@pytest.fixture(scope="module")
def arm(builds):
    """quant_gemv.c + cpu_isa.c (the products and the level choice), under the emulator."""
    lib = emulated(builds, "quant_gemv")
    yield lib
    lib.close()


@pytest.mark.parametrize("name", LIBRARIES)
def test_every_kernel_library_builds_for_aarch64_without_warnings(builds, name):
    built = builds[name][1]
    assert built.returncode == 0 and "warning" not in built.stderr, built.stderr


def test_the_level_chosen_on_arm_is_the_portable_one(arm):
    assert arm.call("isa_name", ret="s") == "scalar"
    for name in ("avx2", "avxvnni", "avx512", "avx512vnni"):
        assert arm.call("isa_available", name.encode() + b"\0") == 0
    assert arm.call("isa_amx") == 0       # AMX's OS permission is asked on x86-64 Linux only


@pytest.mark.parametrize("kind", [0, 1, 2, 3], ids=["q8_0xq8", "q4xq8", "q8_0xi16", "q4xi16"])
def test_block_sums_on_arm_are_exact(arm, kind):
    w, a, exact = random_blocks(kind, 18, seed=kind)
    out = np.zeros(18, np.int32)
    arm.call("block_sums", kind, w, a, 18, out, ret="v")
    assert np.array_equal(out.astype(np.int64), exact)


@pytest.mark.parametrize("fn,wide", [("quantize_activations_q8", np.int8), ("quantize_activations_i16", np.int16)])
def test_activation_codes_on_arm_are_the_x86_ones_bit_for_bit(arm, fn, wide):
    x = torch.randn(3, 96 * 32, generator=torch.Generator().manual_seed(1)).numpy()
    x[0, :32] *= 1e-30
    x[1, 32:64] = 0.0
    codes = [np.zeros((3, 96 * 32), wide) for _ in range(2)]
    scales = [np.zeros((3, 96), np.float32) for _ in range(2)]
    getattr(quant.library(), fn)(x.ctypes.data, 3, 96 * 32, codes[0].ctypes.data, scales[0].ctypes.data)
    arm.call(fn, x, 3, 96 * 32, codes[1], scales[1], ret="v")
    assert np.array_equal(codes[0], codes[1]) and np.array_equal(scales[0].view(np.int32), scales[1].view(np.int32))


@pytest.mark.parametrize("fmt,act", FORMATS)
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_products_on_arm_equal_the_exact_product_within_fp32_rounding(arm, fmt, act, M, N, K):
    """The portable products, as an ARM machine runs them, within test_isa's bound for the
    scalar level: (nb + 12) u of the sum of |terms| (the block factors' rounding, nb block terms
    per output, the minimums and the bias)."""
    if quant.library() is None:
        pytest.skip(f"weight kernels {quant.status()} (the exact product quantizes x with them)")
    lin = layer(fmt, act, N, K, seed=M * N + K)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(K))
    out = np.zeros((M, N), np.float32)
    qs, d, m = lin.row_major()      # the gemv_* exports take row-major blocks
    mins = [m.numpy()] if fmt == "q4_1" else [0] if fmt == "q4_0" else []   # q4_0: no minimums (NULL)
    args = [x.numpy(), qs.numpy(), d.numpy(), *mins]
    assert arm.call(GEMV[(fmt, act)], *args, out, M, N, K, 2) == 0
    exact, mag = exact_product(lin, x)
    err = np.abs(out.astype(np.float64) + lin.bias.double().numpy() - exact)
    assert (err <= (K // 32 + 12) * U * mag).all(), float((err - (K // 32 + 12) * U * mag).max())


@pytest.fixture(scope="module")
def arm_cache(builds):
    """quant_attend.c (the quantized caches' decode kernels), under the emulator."""
    lib = emulated(builds, "quant_attend")
    yield lib
    lib.close()


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "nf4", "q4_0l"])
def test_cache_kernels_on_arm_equal_the_dequantized_cache(arm_cache, kind):
    """key_scores and value_mix (quant_attend.c's portable loops on ARM) against q K^T and p V over
    the dequantized cache, within fp32 rounding of a D- or S-term sum (tests/tolerance.py)."""
    B, H, S, D, block = 2, 2, 50, 32, 16
    cfg = KVCacheTensorConfig(kind, qblock=block)
    c = LayerKVCache(B, 64, H * D, H * D, cfg, cfg, "cpu", H)
    gen = torch.Generator().manual_seed(1)
    c.update(torch.randn(B, H, S, D, generator=gen), torch.randn(B, H, S, D, generator=gen))
    q, p = torch.randn(B, H, 4, D, generator=gen), torch.softmax(torch.randn(B, H, 4, S, generator=gen), -1)
    keys, values = c.k_stream.read(S, torch.float32), c.v_stream.read(S, torch.float32)
    kid = KVCacheKind.parse(kind).spec.kernel
    for fn, x, (codes, scales), want, scale, terms in (
            ("key_scores", q, c.k_stream.code_slice(0, S), q @ keys.transpose(-1, -2), q @ keys.transpose(-1, -2), D),
            ("value_mix", p, c.v_stream.code_slice(0, S), p @ values, values, S)):    # |p V| <= max|V|
        codes, scales = codes.contiguous(), scales.float().contiguous()
        out = np.zeros(tuple(want.shape), np.float32)
        # as caramba.cache.kernel._run calls it: (x, codes, scales, out, B*H, rows, D, block, slots,
        # head stride, row stride, kind id, threads)
        arm_cache.call(fn, x.numpy(), codes.numpy(), scales.numpy(), out, B * H, 4, D, block, S,
                       codes.stride(1), codes.stride(2), kid, 2, ret="v")
        torch.testing.assert_close(torch.from_numpy(out), want, **tol.reduction(scale, terms))
