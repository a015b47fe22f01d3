"""Quantized prefill (caramba.model.quant_gemm, quant_gemm.c): QuantLinear with more than
KERNEL_ROWS rows multiplies the codes in an int8 GEMM (q8 activations: q8_0, q4_0) or in AMX-BF16
on exact bf16 pieces (fp32 activations: native's Q4_1 and Q8_0 head) instead of dequantizing.

Every vector level of the int8 GEMM is bit-identical to the portable reference (integer block
sums, then the same fp32 operations in the same order); the reference and the AMX-BF16 product
agree with torch's dequantize-then-matmul within the worst-case rounding bound of an fp32 sum of
their length (both multiply the same values: q8-rounded activations or fp32 ones, exactly
dequantized weights); greedy output is the old path's on a tiny model and on SmolLM2. A level the
machine lacks is skipped with the missing feature named. The amx level also runs as
"amx-emulated": its own code around a software model of the tile instructions (amx_emulate.h),
wherever the CPU has the AVX-512 VNNI that code is written in.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from caramba.infer import GenerateConfig, Generator
from caramba.model import quant, quant_gemm
from caramba.model.quant import QuantLinear
from test_isa import cpu_flags
from conftest import SMOLLM2
from test_quant_weights import models, tiny_gguf  # noqa: F401  (fixtures: a tiny Q4_1/Q8_0 GGUF per weight kind)

U = 2.0 ** -24   # fp32's unit roundoff
SHAPES = [(1, 32, 1), (17, 96, 33), (33, 160, 31), (65, 224, 64), (40, 576, 7), (161, 64, 35)]   # M, K (odd block counts), N




FEATURES = {"avx2": ["avx2", "fma", "f16c"], "avxvnni": ["avx2", "fma", "f16c", "avx_vnni"],
            "avx512vnni": ["avx512f", "avx512bw", "avx512_vnni"], "amx": ["amx_tile", "amx_int8"]}


def needs_library():
    if quant_gemm.library() is None or quant.library() is None:
        pytest.skip(f"kernels {quant_gemm.library.status()} / {quant.status()}")


def skip_reason(level: str) -> str:
    missing = [f for f in FEATURES[level] if f not in cpu_flags()]
    if missing:
        return f"CPU lacks {', '.join(missing)}"
    if level == "amx":
        return "the OS refused AMX's tile state (arch_prctl) or the kernel build lacks AMX"
    return f"the kernel build lacks {level} (the compiler's -march=native target)"


def emulate_amx(monkeypatch) -> None:
    """Swap in the test build whose amx level runs the tile instructions in software
    (amx_emulate.h): the amx level's own packing, strides, tile shapes and epilogues, on any CPU
    with the AVX-512 VNNI those epilogues and the packing are written in."""
    missing = [f for f in FEATURES["avx512vnni"] if f not in cpu_flags()]
    if missing:
        pytest.skip(f"CPU lacks {', '.join(missing)} (the AMX model runs the amx level's AVX-512 code around it)")
    if quant_gemm.amx_emulation() is None:
        pytest.skip(f"the AMX model's build: {quant_gemm.amx_emulation.status()}")
    monkeypatch.setattr(quant_gemm, "library", quant_gemm.amx_emulation)


@pytest.fixture(params=["avx2", "avxvnni", "avx512vnni", "amx", "amx-emulated"])
def level(request, monkeypatch):
    needs_library()
    name = request.param
    if name == "amx-emulated":
        emulate_amx(monkeypatch)
        name = "amx"
    if not quant_gemm.available(name):
        pytest.skip(skip_reason(name))
    with quant_gemm.use_level(name) as got:
        assert got == name
        yield got


def layer(fmt: str, act: str, N: int, K: int, seed: int) -> QuantLinear:
    g = torch.Generator().manual_seed(seed)
    if fmt == "q4_1":
        codes = torch.randint(0, 16, (N, K), generator=g)
        d = torch.rand(N, K // 32, generator=g) * 0.05
        m = -torch.rand(N, K // 32, generator=g) * 0.4
        return QuantLinear("q4_1", quant.pack_nibbles(codes), d.half(), m.half(), act=act)
    lin = QuantLinear.from_float(torch.randn(N, K, generator=g), fmt=fmt, act="q8")
    lin.act = act
    return lin


def activations(M: int, K: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    x[:, :7] *= 30   # outliers, as real activations have
    return x


def bound(x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
    """Worst-case difference of two fp32 evaluations of x @ w^T, each a sum of at most n rounded
    terms of sizes |x| |w| (gamma_n = n u / (1 - n u) per evaluation)."""
    gamma = n * U / (1 - n * U)
    return 2 * gamma * (x.double().abs() @ w.double().abs().t()).float()


def old_path(lin: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    rows = quant.round_activations(x, lin.act) if lin.act in quant.ACTIVATION_LEVELS else x
    return F.linear(rows, lin.dequantized())


# --- the int8 GEMM (q8 activations) ---------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("M,K,N", SHAPES)
def test_int8_levels_are_the_reference_bit_for_bit(level, fmt, M, K, N):
    """Every vector level multiplies both formats, with the same bits as the reference."""
    assert quant_gemm.runs(fmt), f"{level} leaves {fmt} to torch's path"
    lin = layer(fmt, "q8", N, K, seed=M + N)
    xq, xd = quant.quantize_rows_codes(activations(M, K, seed=K), "q8")
    ref = quant_gemm.gemm(fmt, xq, xd, *lin.row_major()[:2], N, reference=True)
    for threads in (1, 2):
        assert torch.equal(quant_gemm.gemm(fmt, xq, xd, *lin.row_major()[:2], N, threads=threads), ref)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("M,K,N", SHAPES)
def test_int8_levels_read_x16_weights_in_place(level, fmt, M, K, N):
    """An x16 layer's codes and scales, read where they lie (no row-major copy), give the bits of
    the row-major reference; so does the reference reading them x16."""
    lin = layer(fmt, "q8", N, K, seed=M + N)
    xq, xd = quant.quantize_rows_codes(activations(M, K, seed=K), "q8")
    ref = quant_gemm.gemm(fmt, xq, xd, *lin.row_major()[:2], N, reference=True)
    lin.relayout("x16")
    assert torch.equal(quant_gemm.gemm(fmt, xq, xd, lin.qs, lin.d, N, reference=True, x16=True), ref)
    for threads in (1, 2):
        assert torch.equal(quant_gemm.gemm(fmt, xq, xd, lin.qs, lin.d, N, threads=threads, x16=True), ref)


@pytest.mark.parametrize("M", [1, 33])
def test_a_layer_cast_to_fp32_scales_keeps_torch_path(M):
    """After module.float() the scales are fp32, which the C kernels cannot read (they read fp16
    bits: a decode row came out 6e5 off): the torch path then multiplies the same values, within
    fp32 rounding of the C products' results."""
    needs_library()
    lin = layer("q8_0", "q8", 40, 96, seed=3)
    x = activations(M, 96, seed=4)
    before = lin(x)
    lin.float()
    assert lin.d.dtype == torch.float32
    limit = bound(quant.round_activations(x, "q8"), lin.dequantized(), 96 + 2 * 3 + 2)
    assert ((lin(x) - before).abs() <= limit).all()


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("M,K,N", SHAPES)
def test_int8_reference_is_dequantize_then_matmul_within_fp32_rounding(fmt, M, K, N):
    """The same values multiplied (q8-rounded activations, dequantized weights): the two differ
    by summation order only, K products and K/32 block terms, each with a scale product."""
    needs_library()
    lin = layer(fmt, "q8", N, K, seed=M * N)
    x = activations(M, K, seed=M)
    xq, xd = quant.quantize_rows_codes(x, "q8")
    assert torch.equal(xq.float() * xd.repeat_interleave(32, 1), quant.round_activations(x, "q8"))   # the same codes
    got = quant_gemm.gemm(fmt, xq, xd, *lin.row_major()[:2], N, reference=True)
    expected = old_path(lin, x)
    limit = bound(quant.round_activations(x, "q8"), lin.dequantized(), K + 2 * (K // 32) + 2)
    assert ((got - expected).abs() <= limit).all(), float(((got - expected).abs() - limit).max())


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("T", [17, 33, 65])
def test_quantlinear_prefill_takes_the_gemm(fmt, T):
    """More than KERNEL_ROWS rows (any leading shape) go through the GEMM where a level runs, with
    the bias added; otherwise through torch; both within the fp32 bound of each other."""
    needs_library()
    lin = layer(fmt, "q8", 45, 96, seed=T)
    lin.bias = torch.nn.Parameter(torch.randn(45), requires_grad=False)
    x = activations(T, 96, seed=T).view(1, T, 96)
    got = lin(x)
    assert got.shape == (1, T, 45)
    if quant_gemm.runs(fmt):
        xq, xd = quant.quantize_rows_codes(x[0], "q8")
        assert torch.equal(got[0], quant_gemm.gemm(fmt, xq, xd, *lin.row_major()[:2], 45) + lin.bias)
    with quant_gemm.use_level("scalar"):
        old = lin(x)
    limit = bound(quant.round_activations(x[0], "q8"), lin.dequantized(), 96 + 8) + 4 * U * lin.bias.abs()
    assert ((got[0] - old[0]).abs() <= limit).all()


# --- AMX-BF16 (fp32 activations) ------------------------------------------------------------------

@pytest.fixture(params=["amx", "amx-emulated"])
def f32_amx(request, monkeypatch):
    """AMX-BF16 for fp32 activations: the CPU's, or the software model of its tiles."""
    needs_library()
    if request.param == "amx-emulated":
        emulate_amx(monkeypatch)
    if not quant_gemm.f32_available():
        missing = [f for f in ("amx_tile", "amx_bf16") if f not in cpu_flags()]
        pytest.skip(f"CPU lacks {', '.join(missing)}" if missing else
                    "the OS refused AMX's tile state, the build lacks AMX-BF16, or the level is capped below amx")


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "q4_0"])
@pytest.mark.parametrize("M,K,N", SHAPES + [(300, 576, 70)])
def test_f32_amx_is_dequantize_then_matmul_within_fp32_rounding(f32_amx, fmt, M, K, N):
    """Exact pieces times exact codes: only the fp32 accumulations round, 3K piece products and
    2K/32 block terms (scale, minimum), against torch's K products of the same values."""
    lin = layer(fmt, "f32", N, K, seed=M + K)
    x = activations(M, K, seed=N)
    w = lin.dequantized()
    n = 3 * K + 2 * (K // 32) + 2
    limit = bound(x, w, n)
    if fmt == "q4_1":   # the minimum's term sums x separately: its own |m| |x| sizes
        limit += bound(x, lin.row_major()[2].float().repeat_interleave(32, 1), n)
    for threads in (1, 2):
        got = quant_gemm.gemm_f32(fmt, x, *lin.row_major(), N, threads=threads)
        assert ((got - old_path(lin, x)).abs() <= limit).all()
        assert ((got - quant_gemm.gemm_f32(fmt, x, *lin.row_major(), N, reference=True)).abs() <= limit).all()


def test_f32_pieces_are_exact(f32_amx):
    """Activations with 24 significant bits and tiny values: the reference and AMX agree with
    float64 within the accumulation bound (a lost piece would be off by 2^-16 relative)."""
    lin = layer("q4_1", "f32", 16, 64, seed=5)
    x = (activations(20, 64, seed=9) * (1 + 2.0 ** -20)) * torch.logspace(-6, 3, 64)
    exact = (x.double() @ lin.dequantized().double().t()).float()
    n = 3 * 64 + 6
    limit = bound(x, lin.dequantized(), n) + bound(x, lin.row_major()[2].float().repeat_interleave(32, 1), n)
    got = quant_gemm.gemm_f32("q4_1", x, *lin.row_major(), 16)
    assert ((got - exact).abs() <= limit).all()


# --- the choice of level --------------------------------------------------------------------------

def test_the_level_is_never_one_the_machine_lacks():
    needs_library()
    got = quant_gemm.level()
    assert got in quant_gemm.LEVELS and quant_gemm.available(got)
    for name, features in FEATURES.items():
        if not set(features) <= cpu_flags():
            assert not quant_gemm.available(name)
    if quant_gemm.f32_available():
        assert {"amx_tile", "amx_bf16"} <= cpu_flags()
    with pytest.raises(ValueError, match="not one of"):
        quant_gemm.available("avx1024")


@pytest.mark.parametrize("asked,expected", [("avx512vnni", "avx512vnni"), ("avxvnni", "avxvnni"), ("avx512", "avx2"),
                                             ("avx2", "avx2"),
                                             ("scalar", "scalar")])
def test_caramba_isa_caps_the_level(asked, expected):
    needs_library()
    if expected != "scalar" and not quant_gemm.available(expected):
        pytest.skip(skip_reason(expected))
    code = "from caramba.model import quant_gemm as q; print(q.level(), q.f32_available())"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "CARAMBA_ISA": asked})
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [expected, "False"]


# --- whole models ---------------------------------------------------------------------------------

def greedy(model, prompt: list[int], n: int = 8) -> list[int]:
    cfg = GenerateConfig(max_new_tokens=n, temperature=0.0)
    return Generator(model, cfg).run([prompt]).sequences[0]


@pytest.mark.parametrize("amx", ["as built", "amx-emulated"])
@pytest.mark.parametrize("weights", ["q8_0", "q4_0", "native", "native_i16"])
def test_tiny_model_greedy_output_is_the_old_paths(models, weights, amx, monkeypatch):  # noqa: F811
    """Through QuantLinear at the level chosen here, and at the amx level's software model (its
    int8 tiles for q8_0 and q4_0, its bf16 ones for native's fp32 activations)."""
    needs_library()
    if amx == "amx-emulated":
        emulate_amx(monkeypatch)
        if quant_gemm.level() != "amx":
            pytest.skip(f"CARAMBA_ISA caps the level at {quant_gemm.level()}")
        assert quant_gemm.f32_available()
    prompt = [(7 * i + 3) % 90 for i in range(40)]    # a 40-token prefill: past KERNEL_ROWS
    new = greedy(models[weights], prompt)
    with quant_gemm.use_level("scalar"):
        assert greedy(models[weights], prompt) == new


def smollm2_model(weights: str):
    from caramba.model.zoo import load_model

    needs_library()
    if quant_gemm.level() == "scalar":
        pytest.skip("no int8 GEMM level here: the prefill is the old path")
    return load_model("smollm2-135m", "float32", "cpu", progress=False, weights=weights).model


@pytest.mark.parametrize("weights", [pytest.param(w, marks=SMOLLM2) for w in ("q8_0", "q4_0", "native", "native_i16")])
def test_smollm2_projections_agree_with_the_old_path_on_real_activations(smollm2, weights):
    """Every projection of the real model, fed the activations a 60-token prefill gives it (the
    old path's), agrees with the old path within the fp32 bound of its sum."""
    from caramba.evaluation.evaluate import corpus_ids

    model = smollm2_model(weights)
    if weights == "native" and not quant_gemm.f32_available():
        pytest.skip("no AMX-BF16 here: native's prefill is the old path")
    if weights == "native_i16" and not (quant_gemm.i16_runs("q4_1") or quant_gemm.f32_available()):
        pytest.skip(f"no int16 GEMM at {quant_gemm.level()}: native_i16's prefill is the old path")
    inputs = {}

    def keep(mod, args, out):
        inputs.setdefault(mod, args[0].detach().clone())

    hooks = [mod.register_forward_hook(keep) for mod in model.modules() if isinstance(mod, QuantLinear)]
    ids = torch.tensor([corpus_ids(smollm2.tokenizer)[:60]])
    with torch.inference_mode(), quant_gemm.use_level("scalar"):
        model(ids)
    for h in hooks:
        h.remove()
    checked = 0
    for lin, x in inputs.items():
        rows = x.reshape(-1, lin.in_features)
        if rows.shape[0] <= quant.KERNEL_ROWS:    # the head of last_only: a decode kernel's row
            continue
        with torch.inference_mode():
            got = lin(rows)
            with quant_gemm.use_level("scalar"):
                old = lin(rows)
        r = quant.round_activations(rows, lin.act) if lin.act in quant.ACTIVATION_LEVELS else rows
        n = (lin.in_features if lin.act == "q8" else 3 * lin.in_features) + 2 * (lin.in_features // 32) + 2
        limit = bound(r, lin.dequantized(), n)
        if lin.m is not None:
            limit += bound(r, lin.row_major()[2].float().repeat_interleave(32, 1), n)
        assert ((got - old).abs() <= limit).all()
        checked += 1
    assert checked >= 4 * model.config.n_layers


@pytest.mark.parametrize("weights", [pytest.param("native_i16", marks=SMOLLM2)])
def test_smollm2_native_i16_prefill_keeps_greedy_output(smollm2, weights):
    """native_i16 (int16 activation codes) through the int16 GEMM (quant_gemm_i16.c): greedy
    output after a 60-token prompt is the old path's (the same rounded activations and weights,
    summed in another fp32 order). Not compared with fp32's: the int16 rounding moves logits by
    up to ~1e-2 (quant.py), enough to flip near ties."""
    from caramba.evaluation.evaluate import corpus_ids

    model = smollm2_model(weights)
    if not quant_gemm.i16_runs("q4_1"):
        pytest.skip(f"no int16 GEMM at {quant_gemm.level()}: native_i16's prefill is the old path")
    prompt = corpus_ids(smollm2.tokenizer)[:60]
    new = greedy(model, prompt, 16)
    with quant_gemm.use_level("scalar"):
        assert greedy(model, prompt, 16) == new


@pytest.mark.parametrize("weights", [pytest.param("native", marks=SMOLLM2)])
def test_smollm2_native_prefill_keeps_greedy_output(smollm2, weights):
    """native (fp32 activations) through AMX-BF16: greedy output after a 60-token prompt is the
    old path's and fp32's. (q8_0 and q4_0 are not compared token by token: their activations'
    q8 rounding turns any change of fp32 summation order into whole q8 steps downstream, so even
    the old path against float64 sums of the same values agrees on only ~93 % of next-token
    argmaxes over 256 corpus positions; the test above checks their products layer by layer.)"""
    from caramba.evaluation.evaluate import corpus_ids

    model = smollm2_model(weights)
    if not quant_gemm.f32_available():
        pytest.skip("no AMX-BF16 here: native's prefill is the old path")
    prompt = corpus_ids(smollm2.tokenizer)[:60]
    new = greedy(model, prompt, 16)
    with quant_gemm.use_level("scalar"):
        assert greedy(model, prompt, 16) == new
    assert greedy(smollm2.model, prompt, 16) == new
