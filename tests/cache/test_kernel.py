"""The C decode-step kernels (caramba.cache.kernel): equal to attention over the dequantized
cache across kinds and awkward shapes, and a clean fallback to the eager path when they are
switched off or cannot be built."""

from __future__ import annotations

import itertools
import os
import shutil
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from caramba import kernels
from caramba.cache import KVCacheKind, KVCacheTensorConfig, LayerKVCache, kernel
from caramba.cache.attend import attend_chunked
import tolerance as tol


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def fresh_library():
    """Forget the loaded library before and after a test that changes how it is found."""
    kernel.library.cache_clear()
    yield
    kernel.library.cache_clear()


def needs_kernels():
    if kernel.library() is None:
        pytest.skip(f"C kernels {kernel.status()}")


# (head_dim, block): whole vectors, one block per head, blocks narrower than a vector, and an
# odd block count whose middle block straddles the two nibble halves of a 4-bit byte.
SHAPES = [(64, 32), (64, 64), (24, 6), (48, 16)]


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "nf4", "q4_0l"])
@pytest.mark.parametrize("D,block", SHAPES)
def test_kernel_equals_sdpa_over_the_dequantized_cache(kind, D, block):
    needs_kernels()
    for (B, KVH, G), T, S in itertools.product([(1, 3, 3), (2, 2, 6)], [1, 3], [5, 300]):
        cfg = KVCacheTensorConfig(kind, qblock=block)
        c = LayerKVCache(B, 320, KVH * D, KVH * D, cfg, cfg, "cpu", KVH)
        c.update(randn(B, KVH, S, D, seed=1), randn(B, KVH, S, D, seed=2))
        q = randn(B, KVH * G, T, D, seed=3)     # G * T query rows per KV head: 18 needs 3 row groups
        with torch.inference_mode():
            got = attend_chunked(q, c.k_stream, c.v_stream, S, None)
            ref = F.scaled_dot_product_attention(q, c.k_stream.read(S, q.dtype), c.v_stream.read(S, q.dtype),
                                                 enable_gqa=True)
        torch.testing.assert_close(got, ref, **tol.attention(ref, D, S), msg=f"B={B} KVH={KVH} G={G} T={T} S={S}")


def test_kernels_read_a_slice_that_does_not_start_at_zero():
    needs_kernels()
    cfg = KVCacheTensorConfig("q8_0", qblock=16)
    c = LayerKVCache(2, 64, 64, 64, cfg, cfg, "cpu", 2)
    c.update(randn(2, 2, 50, 32, seed=1), randn(2, 2, 50, 32, seed=2))
    k_codes, k_scales = c.k_stream.code_slice(7, 41)
    v_codes, v_scales = c.v_stream.code_slice(7, 41)
    q, p = randn(2, 2, 4, 32, seed=3), torch.softmax(randn(2, 2, 4, 34, seed=4), -1)
    keys, values = c.k_stream.read(50, torch.float32)[:, :, 7:41], c.v_stream.read(50, torch.float32)[:, :, 7:41]
    torch.testing.assert_close(kernel.key_scores(q, k_codes, k_scales, KVCacheKind.Q8_0, 16),
                               q @ keys.transpose(-1, -2), **tol.reduction(q @ keys.transpose(-1, -2), 32))
    torch.testing.assert_close(kernel.value_mix(p, v_codes, v_scales, KVCacheKind.Q8_0, 16, 32),
                               p @ values, **tol.reduction(values, 34))   # |p @ v| <= max|v|: p sums to 1


def test_kernels_leave_non_fp32_and_autograd_queries_to_the_eager_path():
    assert not kernel.usable(torch.zeros(2, dtype=torch.bfloat16))
    assert not kernel.usable(torch.zeros(2, requires_grad=True))
    assert not kernel.usable(torch.zeros(2, device="meta"))


def test_switched_off_by_environment(fresh_library, monkeypatch):
    monkeypatch.setenv("CARAMBA_KERNELS", "0")
    assert kernel.library() is None and kernel.status() == "off (CARAMBA_KERNELS=0)"
    cfg = KVCacheTensorConfig("q4_0")
    c = LayerKVCache(1, 16, 32, 32, cfg, cfg, "cpu", 1)
    c.update(randn(1, 1, 9, 32, seed=1), randn(1, 1, 9, 32, seed=2))
    q = randn(1, 2, 1, 32, seed=3)
    ref = F.scaled_dot_product_attention(q, c.k_stream.read(9, q.dtype), c.v_stream.read(9, q.dtype), enable_gqa=True)
    torch.testing.assert_close(attend_chunked(q, c.k_stream, c.v_stream, 9, None), ref, **tol.attention(ref, 32, 9))


def test_a_failed_build_says_so_once_on_stderr_and_falls_back(fresh_library, monkeypatch, tmp_path, capfd):
    monkeypatch.setenv("CARAMBA_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")           # a "compiler" that always fails
    monkeypatch.setattr(kernels, "prebuilt_dir", lambda: tmp_path / "none")   # no installed copy to fall back on
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")         # a filter that would swallow a Python warning
        assert kernel.library() is None and kernel.library() is None
    assert kernel.status() == "unavailable: build failed (false exited with status 1)"
    err = capfd.readouterr().err.splitlines()
    # the run-time build announced before it starts (a plain line: stderr is not a terminal), then why it failed
    assert len(err) == 2 and err[0].startswith("caramba: building caramba's C kernels for this CPU, once: ~"), err
    assert err[1] == ("caramba: warning: quantized KV caches decode through the slower eager path: "
                      "kernels unavailable: build failed (false exited with status 1)")   # one line, once
    assert not list((tmp_path / "kernels").glob("*.so"))      # no half-built library left behind


def test_a_build_error_names_the_compilers_first_error(monkeypatch, tmp_path, capfd):
    """gcc's last line is "compilation terminated.": the reason given is the error before it."""
    needs_kernels()
    monkeypatch.setenv("CARAMBA_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "k.c"
    source.write_text('#include "missing.h"\nint f(void) { return 1; }\n')
    lib, status = kernels.load(source, {}, "a test kernel")
    assert lib is None and "missing.h" in status and "error" in status and "terminated" not in status, status
    assert capfd.readouterr().err.count("caramba: warning: a test kernel through the slower eager path") == 1


def test_the_build_is_cached_per_source_and_cpu(fresh_library, monkeypatch, tmp_path):
    needs_kernels()
    monkeypatch.setenv("CARAMBA_CACHE_DIR", str(tmp_path))
    kernel.library.cache_clear()
    assert kernel.library() is not None
    built = list((tmp_path / "kernels").glob("quant_attend-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    kernel.library.cache_clear()
    assert kernel.library() is not None and built[0].stat().st_mtime_ns == stamp   # reused, not rebuilt


@pytest.mark.parametrize("kind", ["q4_1", "q2_1"])
@pytest.mark.parametrize("D,block", [(64, 32), (64, 64), (48, 16), (32, 8)])
def test_zero_point_kernels_equal_sdpa_over_the_dequantized_cache(kind, D, block, monkeypatch):
    """q4_1 / q2_1 (per-token, zero-point) keys and values through key_scores_zp / value_mix_zp."""
    needs_kernels()
    calls = []
    for name in ("key_scores_zp", "value_mix_zp"):
        fn = getattr(kernel, name)
        monkeypatch.setattr(kernel, name, lambda *a, _fn=fn, _n=name, **k: calls.append(_n) or _fn(*a, **k))
    for (B, KVH, G), T, S in itertools.product([(1, 3, 3), (2, 2, 6)], [1, 3], [5, 300]):
        cfg = KVCacheTensorConfig(kind, qblock=block)
        c = LayerKVCache(B, 320, KVH * D, KVH * D, cfg, cfg, "cpu", KVH)
        c.update(randn(B, KVH, S, D, seed=1) + 1.5, randn(B, KVH, S, D, seed=2) - 0.5)   # offsets: minimums matter
        q = randn(B, KVH * G, T, D, seed=3)
        with torch.inference_mode():
            got = attend_chunked(q, c.k_stream, c.v_stream, S, None)
            ref = F.scaled_dot_product_attention(q, c.k_stream.read(S, q.dtype), c.v_stream.read(S, q.dtype),
                                                 enable_gqa=True)
        torch.testing.assert_close(got, ref, **tol.attention(ref, D, S), msg=f"B={B} KVH={KVH} G={G} T={T} S={S}")
    assert set(calls) == {"key_scores_zp", "value_mix_zp"}


@pytest.mark.parametrize("k_kind,v_kind", [("q4_1c", "q4_1"), ("q2_1c", "q2_1")])
@pytest.mark.parametrize("group,residual_len", [(16, 0), (32, 0), (32, 40)])
def test_per_channel_key_kernel_equals_sdpa_over_the_dequantized_cache(k_kind, v_kind, group, residual_len,
                                                                       monkeypatch):
    """Per-channel keys (groups of 16 or 32 tokens), with the incomplete group and a residual
    window read from full precision, at lengths that end inside a group."""
    needs_kernels()
    calls = []
    fn = kernel.key_scores_zp
    monkeypatch.setattr(kernel, "key_scores_zp", lambda *a, **k: calls.append(a[-1]) or fn(*a, **k))
    D, KVH, G = 64, 2, 3
    for B, S in itertools.product([1, 2], [7, 100, 257]):
        c = LayerKVCache(B, 300, KVH * D, KVH * D, KVCacheTensorConfig(k_kind, group, residual_len),
                         KVCacheTensorConfig(v_kind, group, residual_len), "cpu", KVH)
        k = randn(B, KVH, S, D, seed=4) * torch.linspace(0.2, 5, D) + torch.linspace(-2, 2, D)
        c.update(k[:, :, : S // 2], randn(B, KVH, S // 2, D, seed=5))
        c.update(k[:, :, S // 2 :], randn(B, KVH, S - S // 2, D, seed=6))
        q = randn(B, KVH * G, 2, D, seed=7)
        with torch.inference_mode():
            got = attend_chunked(q, c.k_stream, c.v_stream, S, None)
            ref = F.scaled_dot_product_attention(q, c.k_stream.read(S, q.dtype), c.v_stream.read(S, q.dtype),
                                                 enable_gqa=True)
        torch.testing.assert_close(got, ref, **tol.attention(ref, D, S), msg=f"B={B} S={S}")
    assert group in calls   # the per-channel loop ran (short caches are all full precision)


# --- the instruction set levels (quant_attend.c: the reference at scalar, the vector loops above) ---

U = 2.0 ** -24   # fp32's unit roundoff


def code_values(codes: np.ndarray, spec, D: int) -> np.ndarray:
    """Element values (before offset and scale) of codes [..., Dc, n] (keys-major) -> [..., D, n]:
    q8_0 signed bytes; 4-bit kinds element e in the low nibble of byte e, e + D/2 in the high one;
    zero-point kinds of `bits` element e in bit field e / fw of byte e % fw (quant_attend.c)."""
    if spec.zero_point:
        fw, mask = D * spec.bits // 8, (1 << spec.bits) - 1
        return np.concatenate([(codes >> (spec.bits * f)) & mask for f in range(D // fw)], -2).astype(np.float64)
    if spec.bits == 8:
        return codes.view(np.int8).astype(np.float64)
    u = np.concatenate([codes & 15, codes >> 4], -2)
    return np.asarray(spec.codebook, np.float64)[u] if spec.codebook else u.astype(np.float64)


def attend_case(kind: str, D: int, block: int, n: int, R: int, seed: int):
    """Random queries q [1, 2, R, D], softmax weights p [1, 2, R, n], keys-major key codes and value
    codes (values: [1, 2, n, Dc], transposed from keys-major), their scales or zero-point params,
    and (exact scores, their sum of |terms|, exact values mixed, theirs) in float64."""
    spec = KVCacheKind(kind).spec
    rng = np.random.default_rng(seed)
    Dc = D * spec.bits // 8
    kc = rng.integers(0, 256, (1, 2, Dc, n)).astype(np.uint8)
    vc = rng.integers(0, 256, (1, 2, n, Dc)).astype(np.uint8)
    q = rng.standard_normal((1, 2, R, D)).astype(np.float32)
    p = rng.random((1, 2, R, n)).astype(np.float32)
    kv, vv = code_values(kc, spec, D), code_values(np.swapaxes(vc, -1, -2), spec, D)   # [1, 2, D, n]
    nb, q64, p64 = D // block, q.astype(np.float64), p.astype(np.float64)
    blocks = np.arange(D) // block
    if spec.zero_point and spec.per_channel:   # keys: [2 D, groups of `block` tokens]
        ng = -(-n // block)
        kpar = np.concatenate([rng.uniform(0.01, 0.2, (1, 2, D, ng)), rng.uniform(-1, 1, (1, 2, D, ng))], 2)
        kpar = kpar.astype(np.float32)
        s, m = (kpar[:, :, :D, np.arange(n) // block].astype(np.float64), kpar[:, :, D:, np.arange(n) // block]
                .astype(np.float64))
        scores = np.einsum("bhre,bhet->bhrt", q64, s * kv) + np.einsum("bhre,bhet->bhrt", q64, m)
        smag = np.einsum("bhre,bhet->bhrt", np.abs(q64), np.abs(s * kv) + np.abs(m))
    else:
        kpar = (np.concatenate([rng.uniform(0.01, 0.2, (1, 2, nb, n)), rng.uniform(-1, 1, (1, 2, nb, n))], 2)
                if spec.zero_point else rng.uniform(-0.2, 0.2, (1, 2, nb, n))).astype(np.float32)
        s = kpar[:, :, :nb][:, :, blocks].astype(np.float64)                          # [1, 2, D, n]
        off = kpar[:, :, nb:][:, :, blocks].astype(np.float64) if spec.zero_point else spec.offset * s
        scores = np.einsum("bhre,bhet->bhrt", q64, s * kv + off)
        smag = np.einsum("bhre,bhet->bhrt", np.abs(q64), np.abs(s * kv) + np.abs(off))
    vpar = (np.concatenate([rng.uniform(0.01, 0.2, (1, 2, nb, n)), rng.uniform(-1, 1, (1, 2, nb, n))], 2)
            if spec.zero_point else rng.uniform(-0.2, 0.2, (1, 2, nb, n))).astype(np.float32)
    s = vpar[:, :, :nb][:, :, blocks].astype(np.float64)
    off = vpar[:, :, nb:][:, :, blocks].astype(np.float64) if spec.zero_point else spec.offset * s
    mixed = np.einsum("bhrt,bhet->bhre", p64, s * vv + off)
    vmag = np.einsum("bhrt,bhet->bhre", np.abs(p64), np.abs(s * vv) + np.abs(off))
    return spec, [torch.from_numpy(a) for a in (q, p, kc, vc, kpar, vpar)], scores, smag, mixed, vmag


def attend_levels(spec, q, p, kc, vc, kpar, vpar, block: int, D: int):
    """(scores, values mixed) from quant_attend.c at each level this machine has: {level: (s, v)}."""
    from caramba.model import isa

    out = {}
    for level in [lv for lv in isa.LEVELS if isa.available(lv)]:
        with isa.use_isa(level) as got:
            assert got == level and kernel.library().isa_name().decode() == level
            if spec.zero_point:
                group = block if spec.per_channel else 0
                ks = kernel.key_scores_zp(q, kc, kpar, spec, D if group else block, group)
                vs = kernel.value_mix_zp(p, vc, vpar, spec, block, D) if not spec.per_channel else None
            else:
                ks = kernel.key_scores(q, kc, kpar, spec, block)
                vs = kernel.value_mix(p, vc, vpar, spec, block, D)
        out[level] = (ks, vs)
    return out


@pytest.mark.parametrize("kind,D,block", [("q8_0", 64, 32), ("q4_0", 64, 64), ("nf4", 48, 16), ("q4_0l", 24, 6),
                                          ("q4_1", 64, 32), ("q2_1", 32, 8), ("q4_1c", 64, 16), ("q2_1c", 32, 32)])
@pytest.mark.parametrize("n,R", [(5, 1), (300, 9)])
def test_every_level_is_within_fp32_rounding_of_the_exact_scores_and_vector_levels_agree(kind, D, block, n, R):
    """quant_attend.c at every instruction set level this machine has (caramba.model.isa.use_isa,
    as CARAMBA_ISA does at load): the portable reference at scalar, the vector loops above it.
    Each within fp32 rounding of the exact (float64) scores and mixed values of the same codes:
    (D + n + 16) u of the sum of |terms|; the vector levels (the same code) bit for bit alike.
    Shapes: one tile and a partial vector; 9 query rows (two row groups), 300 positions (two
    tiles); blocks narrower than a vector, one block per head, per-channel groups of 16 and 32."""
    needs_kernels()
    spec, tensors, scores, smag, mixed, vmag = attend_case(kind, D, block, n, R, seed=D + n + R)
    runs = attend_levels(spec, *tensors, block=block, D=D)
    bound = (D + n + 16) * U
    for level, (ks, vs) in runs.items():
        err = np.abs(ks.double().numpy() - scores)
        assert (err <= bound * smag).all(), (level, float((err / smag).max()))
        if vs is not None:
            err = np.abs(vs.double().numpy() - mixed)
            assert (err <= bound * vmag).all(), (level, float((err / vmag).max()))
    vector = [runs[lv] for lv in runs if lv != "scalar"]
    for ks, vs in vector[1:]:
        assert torch.equal(ks, vector[0][0]) and (vs is None or torch.equal(vs, vector[0][1]))


def test_every_kernel_library_builds_where_a_compiler_is():
    """Tests of the C paths skip where no C kernels load; on a machine with a C compiler (every CI
    machine) a library that fails to build must fail the suite here, not turn hundreds of tests
    into skips."""
    import os
    import shutil

    from caramba.runs import kernel_status

    if os.environ.get("CARAMBA_KERNELS") == "0" or not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler, or CARAMBA_KERNELS=0: the eager paths are all there is")
    status = kernel_status()
    assert all(s == "c" for s in status.values()), status


# ---- prebuilt libraries (issue 47: kernels built at install time, caramba/kernel_build.py) ----

from caramba import kernel_build  # noqa: E402

_HASWELL = {"sse4_2", "popcnt", "ssse3", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"}
_ALDER_LAKE = _HASWELL | {"avx_vnni"}
_ZEN4 = _HASWELL | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_vnni", "avx512_bf16"}
_SAPPHIRE_RAPIDS = _ZEN4 | {"avx_vnni", "amx_tile", "amx_int8", "amx_bf16"}


@pytest.mark.parametrize("cpu,expected", [
    (set(), None), ({"sse4_2", "popcnt", "ssse3"}, "x86-64-v2"), (_HASWELL, "avx2"), (_ALDER_LAKE, "avxvnni"),
    (_ZEN4, "avx512"), (_SAPPHIRE_RAPIDS, "amx")])
def test_the_highest_variant_a_cpu_can_run_is_chosen(cpu, expected):
    every = [v.name for v in kernel_build.variants("x86_64")]
    got = kernel_build.choose(cpu, every, "x86_64")
    assert (got.name if got else None) == expected
    # among the variants present only: a wheel built with fewer variants still loads the best it has
    assert kernel_build.choose(_SAPPHIRE_RAPIDS, ["x86-64-v2", "avx2"], "x86_64").name == "avx2"
    assert kernel_build.choose(_HASWELL, ["avx512"], "x86_64") is None


def test_arm_variants_follow_the_cpu_features():
    every = [v.name for v in kernel_build.variants("aarch64")]
    assert kernel_build.choose({"fp", "asimd"}, every, "aarch64").name == "armv8"
    assert kernel_build.choose({"fp", "asimd", "asimddp", "asimdhp"}, every, "aarch64").name == "armv8.2-dotprod"


def test_every_library_module_takes_its_sources_from_the_one_list():
    from caramba import fused
    from caramba.model import fast_decode, quant, quant_gemm

    assert {s[0].stem: s for s in (kernel.SOURCES, [fused.SOURCE], quant.SOURCES, fast_decode.SOURCES,
                                   quant_gemm.SOURCES)} == \
        {name: kernel_build.sources(name) for name in kernel_build.LIBRARIES}


def _cpu() -> set[str]:
    return kernel_build.cpu_features()


def test_cpu_features_read_x86_flags_and_arm_features():
    assert kernel_build.cpu_features("processor\t: 0\nflags\t\t: fpu sse4_2 avx2\n") == {"fpu", "sse4_2", "avx2"}
    assert kernel_build.cpu_features("processor\t: 0\nFeatures\t: fp asimd asimddp\n") == {"fp", "asimd", "asimddp"}


def test_macos_sysctl_features_choose_the_variants_linux_flags_would():
    intel = ("machdep.cpu.features: FPU VME SSE SSE2 SSE3 PCLMULQDQ SSSE3 FMA CX16 SSE4.1 SSE4.2 MOVBE POPCNT AES "
             "AVX1.0 RDRAND F16C\nmachdep.cpu.leaf7_features: RDWRFSGS BMI1 AVX2 SMEP BMI2 ERMS AVX512F AVX512DQ "
             "AVX512CD AVX512BW AVX512VL AVX512VNNI\nmachdep.cpu.brand_string: Intel(R) Xeon(R) W-3245\n")
    every = [v.name for v in kernel_build.variants("x86_64")]
    got = kernel_build.darwin_features(intel)
    assert {"avx", "sse4_2", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "avx512_vnni"} <= got
    # no AVX-512 BF16 on that Xeon: the AVX2 build, as Linux's flags of the same CPU would choose
    assert kernel_build.choose(got, every, "x86_64").name == "avx2"
    assert kernel_build.choose(got | {"avx512_bf16"}, every, "x86_64").name == "avx512"
    apple = ("hw.optional.AdvSIMD: 1\nhw.optional.arm.FEAT_DotProd: 1\nhw.optional.arm.FEAT_FP16: 1\n"
             "hw.optional.arm.FEAT_SME: 0\nhw.optional.floatingpoint: 1\n")
    arm = [v.name for v in kernel_build.variants("aarch64")]
    assert kernel_build.choose(kernel_build.darwin_features(apple), arm, "aarch64").name == "armv8.2-dotprod"
    assert kernel_build.choose(kernel_build.darwin_features(apple.replace("DotProd: 1", "DotProd: 0")), arm,
                               "aarch64").name == "armv8"


def test_a_prebuilt_library_loads_with_no_compiler_and_a_stale_one_is_ignored(monkeypatch, tmp_path, capfd):
    """The best prebuilt variant whose source hash matches is loaded without a compiler; one built
    from other sources (its hash differs) is ignored and the run-time build takes over."""
    needs_kernels()
    chosen = kernel_build.choose(_cpu(), [v.name for v in kernel_build.variants()])
    if chosen is None:
        pytest.skip(f"no prebuilt variant for {kernel_build.machine()}")
    from caramba import fused

    sources = kernel_build.sources("decode_ops")
    digest = kernel_build.source_hash(sources)
    baseline = kernel_build.variants()[0]
    kernel_build.compile_variant(os.environ.get("CC") or shutil.which("cc") or "gcc", "decode_ops", baseline,
                                 tmp_path)   # the baseline, really compiled
    stale = tmp_path / kernel_build.prebuilt_name("decode_ops", chosen.name, "0" * 16)
    stale.write_bytes(b"not a library")   # a higher variant, but stale: never opened
    monkeypatch.setattr(kernels, "prebuilt_dir", lambda: tmp_path)
    assert kernels.prebuilt(sources) == (tmp_path / kernel_build.prebuilt_name("decode_ops", baseline.name, digest),
                                         baseline.name)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("CARAMBA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CARAMBA_KERNELS", raising=False)
    lib, status = kernels.load(sources, fused._SIGNATURES, "test")
    assert lib is not None and status == "c" and kernels.origin["decode_ops"] == f"prebuilt {baseline.name}"
    assert capfd.readouterr().err == ""   # nothing built, nothing said
    # a test build with its own flags never takes the prebuilt copy: it compiles (and here cannot)
    lib, status = kernels.load(sources, fused._SIGNATURES, "test", flags=[*kernels.FLAGS, "-DX"])
    assert lib is None and status.startswith("unavailable: build failed"), status
    # the sources changed since the install: the hash no longer matches, so the run-time build is tried
    for path in tmp_path.glob(f"decode_ops-*-{digest}.so"):
        path.rename(path.with_name(path.name.replace(digest, "f" * 16)))
    assert kernels.prebuilt(sources) is None
    lib, status = kernels.load(sources, fused._SIGNATURES, "test")
    assert lib is None and status.startswith("unavailable: build failed"), status
    assert "caramba: building caramba's C kernels for this CPU, once" in capfd.readouterr().err
