"""caramba's C kernels on ARM: built with the aarch64 cross compiler and run under qemu-aarch64.

Every kernel library builds for ARMv8.2-A (+dotprod) without a warning. The instruction set choice
there is ARM's `neon` level (cpu_isa.c: ASIMD, and in a +dotprod build ASIMDDP, from the kernel's
hwcaps): no x86 level is ever picked, AMX is absent, CARAMBA_ISA caps it, and a +dotprod build on
a CPU without the dot product (qemu's cortex-a72) runs the portable level rather than SIGILL. At
neon the row-major quantized products (quant_gemv.c: q8_0, q4_0, q4_1 with q8, int16 or fp32
activations) equal the x86 build's avx2 products bit for bit, with 1 and 2 threads, both with sdot
(the +dotprod build) and without it (an ARMv8.0-A build on cortex-a72: widening multiplies); the
activation codes equal x86's; the int32 block sums are exact. At the portable level the products
are within fp32 rounding of the exact product (test_isa's bound). The x16 layout's q8-activation
formats have a neon kernel in a +dotprod build (sdot by lane), bit-identical to the x86
reference; without the dot product, and for the int16 activations, x16 layers run the reference
(and are made 'rows'). The aarch64 variants a cross-built wheel carries (setup.py with
CARAMBA_KERNEL_ARCH=aarch64: kernel_build.VARIANTS, built by kernel_build's compile_object +
link_variant) are AArch64 ELFs that run at neon on the least CPU each is chosen for (armv8 on a
Cortex-A72), their products avx2's bit for bit. Only correctness is tested here: the emulator's
speed says nothing of an ARM CPU's. Skipped, naming the packages, where the cross compiler or the
emulator is missing (CI installs neither).
"""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import cross_arch
import tolerance as tol
from caramba import kernel_build
from caramba.cache import KVCacheKind, KVCacheTensorConfig, LayerKVCache
from caramba.cache import kernel as cache_kernel
from caramba import fused
from caramba.model import fast_decode, isa, quant, quant_gemm
from test_interleaved import x16_block_case
from test_isa import FORMATS, SHAPES, U, exact_product, layer, random_blocks

pytestmark = pytest.mark.skipif(cross_arch.missing() is not None, reason=str(cross_arch.missing()))

LIBRARIES = {"quant_gemv": quant.SOURCES, "decode_step": fast_decode.SOURCES, "quant_gemm": quant_gemm.SOURCES,
             "quant_attend": cache_kernel.SOURCES, "decode_ops": [fused.SOURCE]}
GEMV = {("q8_0", "q8"): "gemv_q8_0_q8", ("q8_0", "f32"): "gemv_q8_0_f32", ("q4_1", "f32"): "gemv_q4_1_f32",
        ("q4_1", "q8"): "gemv_q4_1_q8", ("q4_0", "q8"): "gemv_q4_1_q8", ("q8_0", "i16"): "gemv_q8_0_i16", ("q4_1", "i16"): "gemv_q4_1_i16"}


X86_LEVELS = [name for name in isa.LEVELS if name not in ("scalar", *isa.ARM_LEVELS)]


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """Every library compiled for aarch64 once: name -> (path, the compiler's result); and
    quant_gemv's library for ARMv8.0-A (no dot product) as "quant_gemv_plain"."""
    where = tmp_path_factory.mktemp("aarch64")
    built = {name: (where / f"{name}.so", cross_arch.compile_library(sources, where / f"{name}.so"))
             for name, sources in LIBRARIES.items()}
    plain = where / "quant_gemv_plain.so"
    built["quant_gemv_plain"] = (plain, cross_arch.compile_library(quant.SOURCES, plain, cross_arch.PLAIN_TARGET))
    return built


def emulated(builds, name: str, cpu: str | None = None, env: dict[str, str] | None = None):
    path, built = builds[name]
    if built.returncode:
        pytest.fail(f"the aarch64 build of {name} failed:\n{built.stderr}")
    return cross_arch.ArmLibrary.load(path, cpu, env)


@pytest.fixture(scope="module")
def arm(builds):
    """quant_gemv.c + cpu_isa.c (the products and the level choice), under the emulator."""
    lib = emulated(builds, "quant_gemv")
    yield lib
    lib.close()


@pytest.fixture(scope="module")
def arm_plain(builds):
    """The same built for ARMv8.0-A (no sdot: the widening-multiply dot products), run on a
    Cortex-A72 (qemu's, which lacks the dot product)."""
    lib = emulated(builds, "quant_gemv_plain", cpu="cortex-a72")
    yield lib
    lib.close()


def set_level(lib, name: str) -> str:
    """Run `lib`'s products at `name` (or its fallback); the level now in force."""
    lib.call("isa_set", name.encode() + b"\0")
    return lib.call("isa_name", ret="s")


@pytest.fixture(params=["neon", "scalar"])
def level(request, arm):
    """The +dotprod build at neon, then at the portable level (put back to neon after)."""
    assert set_level(arm, request.param) == request.param
    yield request.param
    set_level(arm, "neon")


@pytest.mark.parametrize("name", LIBRARIES)
def test_every_kernel_library_builds_for_aarch64_without_warnings(builds, name):
    built = builds[name][1]
    assert built.returncode == 0 and "warning" not in built.stderr, built.stderr


def test_the_level_chosen_on_arm_is_neon_and_never_an_x86_one(arm):
    assert arm.call("isa_name", ret="s") == "neon"      # qemu's `max` CPU has ASIMD and the dot product
    assert arm.call("isa_available", b"neon\0") == 1 and arm.call("isa_available", b"scalar\0") == 1
    for name in X86_LEVELS:
        assert arm.call("isa_available", name.encode() + b"\0") == 0
        assert set_level(arm, name) == "scalar"          # a wish for an x86 level falls to scalar, not neon
    assert set_level(arm, "neon") == "neon"
    assert np.int64(arm.call("isa_set", b"avx1024\0")).astype(np.int32) == -1     # an int: x0's low 32 bits
    assert arm.call("isa_name", ret="s") == "neon"
    assert arm.call("isa_amx") == 0       # AMX's OS permission is asked on x86-64 Linux only


def test_the_decode_steps_library_chooses_neon_too(builds):
    """decode_step.c's library carries quant_gemv.c: its quantized projections run at neon."""
    lib = emulated(builds, "decode_step")
    try:
        assert lib.call("isa_name", ret="s") == "neon"
    finally:
        lib.close()


@pytest.mark.parametrize("asked,got", [("scalar", "scalar"), ("neon", "neon"), ("avx512vnni", "scalar"),
                                       ("avx1024", "neon")])
def test_caramba_isa_caps_the_level_on_arm(builds, asked, got):
    """CARAMBA_ISA read when the library loads: scalar caps it, an x86 level runs scalar, a name
    that is no level runs the best (and isa_env_error says so)."""
    lib = emulated(builds, "quant_gemv", env={"CARAMBA_ISA": asked})
    try:
        assert lib.call("isa_name", ret="s") == got
        assert lib.call("isa_env_error") == (asked == "avx1024")
    finally:
        lib.close()


@pytest.mark.parametrize("build,cpu,got", [("quant_gemv", "cortex-a72", "scalar"), ("quant_gemv", "neoverse-n1", "neon"),
                                           ("quant_gemv_plain", "cortex-a72", "neon")])
def test_neon_needs_the_cpus_dot_product_only_where_the_build_uses_it(builds, build, cpu, got):
    """A +dotprod build on a CPU without ASIMDDP (Cortex-A72) runs the portable level, never an
    sdot that would SIGILL; an ARMv8.0-A build runs neon there (widening multiplies)."""
    lib = emulated(builds, build, cpu=cpu)
    try:
        assert lib.call("isa_name", ret="s") == got
        assert lib.call("isa_available", b"neon\0") == (got == "neon")
    finally:
        lib.close()


@pytest.mark.parametrize("kind", [0, 1, 2, 3], ids=["q8_0xq8", "q4xq8", "q8_0xi16", "q4xi16"])
def test_block_sums_on_arm_are_exact(arm, arm_plain, level, kind):
    """Through neon's sdot / widening multiplies (both builds) and the references."""
    w, a, exact = random_blocks(kind, 18, seed=kind)
    for lib in (arm, arm_plain) if level == "neon" else (arm,):
        out = np.zeros(18, np.int32)
        lib.call("block_sums", kind, w, a, 18, out, ret="v")
        assert np.array_equal(out.astype(np.int64), exact)


@pytest.mark.parametrize("fn,wide,width", [("quantize_activations_q8", np.int8, 1),
                                           ("quantize_activations_i16", np.int16, 1), ("split_activations", np.int16, 2)])
def test_activation_codes_on_arm_are_the_x86_ones_bit_for_bit(arm, level, fn, wide, width):
    x = torch.randn(3, 96 * 32, generator=torch.Generator().manual_seed(1)).numpy()
    x[0, :32] *= 1e-30
    x[1, 32:64] = 0.0
    x[2, 64:96] *= 1e4
    codes = [np.zeros((3, 96 * 32 * width), wide) for _ in range(2)]
    scales = [np.zeros((3, 96), np.float32) for _ in range(2)]
    getattr(quant.library(), fn)(x.ctypes.data, 3, 96 * 32, codes[0].ctypes.data, scales[0].ctypes.data)
    arm.call(fn, x, 3, 96 * 32, codes[1], scales[1], ret="v")
    assert np.array_equal(codes[0], codes[1]) and np.array_equal(scales[0].view(np.int32), scales[1].view(np.int32))


def gemv_args(fmt: str, act: str, M: int, N: int, K: int) -> tuple:
    """(the layer, x, the gemv_* export's buffer arguments) of test_isa's layer for a shape."""
    lin = layer(fmt, act, N, K, seed=M * N + K)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(K))
    qs, d, m = lin.row_major()      # the gemv_* exports take row-major blocks
    mins = [m.numpy()] if fmt == "q4_1" else [0] if fmt == "q4_0" else []   # q4_0: no minimums (NULL)
    return lin, x, [x.numpy(), qs.numpy(), d.numpy(), *mins]


@pytest.mark.parametrize("fmt,act", FORMATS)
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_products_on_arm_at_the_portable_level_equal_the_exact_product_within_fp32_rounding(arm, fmt, act, M, N, K):
    """The portable products, as an ARM machine without neon runs them, within test_isa's bound
    for the scalar level: (nb + 12) u of the sum of |terms| (the block factors' rounding, nb block
    terms per output, the minimums and the bias)."""
    if quant.library() is None:
        pytest.skip(f"weight kernels {quant.status()} (the exact product quantizes x with them)")
    lin, x, args = gemv_args(fmt, act, M, N, K)
    out = np.zeros((M, N), np.float32)
    assert set_level(arm, "scalar") == "scalar"
    try:
        assert arm.call(GEMV[(fmt, act)], *args, out, M, N, K, 2) == 0
    finally:
        set_level(arm, "neon")
    exact, mag = exact_product(lin, x)
    err = np.abs(out.astype(np.float64) + lin.bias.double().numpy() - exact)
    assert (err <= (K // 32 + 12) * U * mag).all(), float((err - (K // 32 + 12) * U * mag).max())


@pytest.mark.parametrize("build", ["dotprod", "plain"])
@pytest.mark.parametrize("fmt,act", FORMATS)
@pytest.mark.parametrize("threads", [1, 2])
def test_neon_products_are_avx2s_bit_for_bit(arm, arm_plain, build, fmt, act, threads):
    """neon sums avx2's exact int32 lanes into avx2's accumulators in avx2's order (quant_gemv.c),
    so every row-major format's product on ARM is the x86 avx2 product bit for bit, for test_isa's
    shapes (1, 3, 18 and 49 blocks a row: the scalar, masked and whole minimum groups; odd N; tiles
    of 1 to 4 activation rows), with sdot or widening multiplies."""
    lib = arm if build == "dotprod" else arm_plain
    assert lib.call("isa_name", ret="s") == "neon"
    for M, N, K in SHAPES:
        assert_avx2s_product(lib, fmt, act, M, N, K, threads)


def assert_avx2s_product(lib, fmt: str, act: str, M: int, N: int, K: int, threads: int) -> None:
    """The emulated library's gemv_* product of test_isa's layer equals the x86 build's at avx2 bit
    for bit (skips where the x86 side cannot run)."""
    lib_x86 = quant.library()
    if lib_x86 is None or not isa.available("avx2"):
        pytest.skip(f"weight kernels {quant.status()}" if lib_x86 is None else "this CPU lacks avx2 (the x86 side)")
    _, _, args = gemv_args(fmt, act, M, N, K)
    got, want = np.zeros((M, N), np.float32), np.zeros((M, N), np.float32)
    assert lib.call(GEMV[(fmt, act)], *args, got, M, N, K, threads) == 0
    ptrs = [a.ctypes.data if isinstance(a, np.ndarray) else None for a in args]
    with isa.use_isa("avx2"):
        assert getattr(lib_x86, GEMV[(fmt, act)])(*ptrs, want.ctypes.data, M, N, K, threads) == 0
    assert np.array_equal(got.view(np.int32), want.view(np.int32)), (fmt, act, M, N, K, np.abs(got - want).max())


X16_Q8 = [("q8_0", "q8"), ("q4_0", "q8"), ("q4_1", "q8")]


def test_x16_layers_on_arm_only_where_sdot_runs_them(arm, arm_plain):
    """neon has an x16 kernel for the q8-activation formats in a +dotprod build (sdot's indexed
    form), none without the dot product, and none for the int16 ones: quant.default_layout makes
    x16 layers exactly where x16_vector says so."""
    for (fmt, act, layout), fid in quant.FORMAT_IDS.items():
        if layout == "x16":
            assert arm.call("x16_vector", fid) == (act == "q8"), (fmt, act)
            assert arm_plain.call("x16_vector", fid) == 0, (fmt, act)
    assert set_level(arm, "scalar") == "scalar"
    try:
        assert arm.call("x16_vector", quant.Q4_0_Q8_X16) == 0
    finally:
        set_level(arm, "neon")


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_x16_block_sums_on_arm_are_exact(arm, fmt):
    """sdot by lane over a group's units, q4_0's -8 sum(a) folded in: the exact int32 sums."""
    nb = 5
    fid, packed, a, exact = x16_block_case(fmt, nb, seed=3)
    out = np.zeros((nb, 16), np.int32)
    arm.call("x16_block_sums", fid, packed, a, nb, out, ret="v")
    assert np.array_equal(out.astype(np.int64), exact)


@pytest.mark.parametrize("fmt,act", X16_Q8)
@pytest.mark.parametrize("threads", [1, 2])
def test_x16_neon_products_are_the_reference_bit_for_bit(arm, fmt, act, threads):
    """neon's x16 kernel makes the reference's FMAs lane for lane: its products equal the x86
    build's portable x16 reference (and so every x86 kernel's) bit for bit, for test_isa's shapes
    plus a 200-row, 576-wide one (a masked tail group), with 1 and 2 threads."""
    lib_x86 = quant.library()
    if lib_x86 is None:
        pytest.skip(f"weight kernels {quant.status()}")
    assert arm.call("isa_name", ret="s") == "neon"
    fid = quant.FORMAT_IDS[(fmt, act, "x16")]
    for M, N, K in SHAPES + [(2, 200, 576)]:
        lin = layer(fmt, act, N, K, seed=M * N + K).relayout("x16")
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(K)).numpy()
        mins = lin.m.numpy() if lin.m is not None else 0
        got, want = np.zeros((M, N), np.float32), np.zeros((M, N), np.float32)
        assert arm.call("gemv_x16", fid, x, lin.qs.numpy(), lin.d.numpy(), mins, got, M, N, K, threads) == 0
        with isa.use_isa("scalar"):
            assert lib_x86.gemv_x16(fid, x.ctypes.data, lin.qs.data_ptr(), lin.d.data_ptr(),
                                    None if lin.m is None else lin.m.data_ptr(), want.ctypes.data, M, N, K, 1) == 0
        assert np.array_equal(got.view(np.int32), want.view(np.int32)), (M, N, K, np.abs(got - want).max())


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


@pytest.mark.parametrize("build", ["dotprod", "plain"])
@pytest.mark.parametrize("act", ["f32", "i16"])
@pytest.mark.parametrize("fmt", list(quant.STORED))
def test_stored_gguf_formats_on_arm_are_the_x86_reference_bit_for_bit(arm, arm_plain, build, fmt, act):
    """The stored GGUF formats (quant_gemv_kq.h: Q5_0 .. Q6_K) at neon and at ARM's scalar level give
    the x86 reference's products bit for bit (tests/model/test_kquant.py's shapes: row tails, tiles of 1 to
    4 rows, 1 and 2 threads), so every level on either family does."""
    from test_kquant import activations, random_blocks, shapes

    lib_x86 = quant.library()
    if lib_x86 is None:
        pytest.skip(f"weight kernels {quant.status()}")
    lib = arm if build == "dotprod" else arm_plain
    fid = quant.FORMAT_IDS[(fmt, act, "rows")]
    for i, (M, N, K) in enumerate(shapes(fmt)):
        raw = random_blocks(fmt, N, K, 500 + i).numpy()
        x = activations(M, K, 600 + i).numpy()
        want = np.zeros((M, N), np.float32)
        with isa.use_isa("scalar"):
            assert lib_x86.gemv_kq(fid, x.ctypes.data, raw.ctypes.data, want.ctypes.data, M, N, K, 1) == 0
        for name in ("neon", "scalar"):
            assert set_level(lib, name) == name
            got = np.zeros((M, N), np.float32)
            assert lib.call("gemv_kq", fid, x, raw, got, M, N, K, 1 + i % 2) == 0
            assert np.array_equal(got.view(np.int32), want.view(np.int32)), (name, M, N, K, np.abs(got - want).max())
        set_level(lib, "neon")


EM_AARCH64 = 183    # the ELF header's e_machine for AArch64


@pytest.fixture(scope="module")
def arm_variants(tmp_path_factory):
    """quant_gemv in each aarch64 variant a cross-built wheel carries (kernel_build.VARIANTS), built
    as setup.py builds it (kernel_build.compile_variant: compile_object + link_variant, the variant's
    -march) with the cross compiler: variant name -> library."""
    where = tmp_path_factory.mktemp("aarch64-variants")

    def build(v):
        try:
            return kernel_build.compile_variant(cross_arch.CC, "quant_gemv", v, where)
        except subprocess.CalledProcessError as e:
            return f"quant_gemv [{v.name}] did not build for aarch64:\n{e.stderr}"

    with ThreadPoolExecutor() as pool:     # the variants side by side, a core each where there are two
        built = dict(zip([v.name for v in kernel_build.variants("aarch64")],
                         pool.map(build, kernel_build.variants("aarch64"))))
    for result in built.values():
        if isinstance(result, str):
            pytest.fail(result)
    return built


# variant -> (the emulated CPU: the least one its kernel_build.Variant.needs allows, whether its
# neon has the x16 kernel, which needs sdot: the dot-product variant's -march is in force)
VARIANT_CPUS = {"armv8": ("cortex-a72", 0), "armv8.2-dotprod": ("neoverse-n1", 1)}


def test_every_aarch64_variant_is_tested():
    assert sorted(VARIANT_CPUS) == sorted(v.name for v in kernel_build.variants("aarch64"))


@pytest.mark.parametrize("variant", VARIANT_CPUS)
def test_the_aarch64_variants_setup_py_builds_run_and_equal_x86(arm_variants, variant):
    """Each prebuilt variant of a cross-built wheel is an AArch64 ELF, named as caramba.kernels looks
    it up, and runs on the least CPU it is chosen for (armv8 on a Cortex-A72, without the dot
    product) at neon, its products equal to the x86 avx2 build's bit for bit."""
    path = arm_variants[variant]
    assert path.name == kernel_build.prebuilt_name("quant_gemv", variant,
                                                   kernel_build.source_hash(kernel_build.sources("quant_gemv")))
    header = path.read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and header[4] == 2, header           # a 64-bit ELF
    assert int.from_bytes(header[18:20], "little") == EM_AARCH64, header
    cpu, x16 = VARIANT_CPUS[variant]
    lib = cross_arch.ArmLibrary.load(path, cpu)
    try:
        assert lib.call("isa_name", ret="s") == "neon"
        assert lib.call("x16_vector", quant.Q4_0_Q8_X16) == x16
        for fmt, act in FORMATS:      # every row-major format, at test_isa's largest shape, 2 threads
            assert_avx2s_product(lib, fmt, act, *SHAPES[-1], 2)
    finally:
        lib.close()
