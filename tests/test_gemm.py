"""caramba.gemm: the torch path's projections through oneDNN agree with F.linear to rounding,
and everything it cannot take (few rows, autograd, other dtypes, hooked modules) goes to torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tolerance as tol
from caramba import gemm

needs_onednn = pytest.mark.skipif(not gemm.available(), reason="torch built without mkldnn, or CARAMBA_ONEDNN=0")


@pytest.fixture
def off(monkeypatch):
    monkeypatch.setattr(gemm, "_available", False)


@needs_onednn
@pytest.mark.parametrize("rows", [8, 33, 512])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("copy", [False, True], ids=["transposed", "row-major copy"])
def test_dense_agrees_with_f_linear(rows, bias, copy, monkeypatch):
    """Either way an input-major weight goes in (as its transposed view, or copied row-major first
    where oneDNN runs at AVX2: gemm.copy_transposed), within fp32 rounding of F.linear."""
    monkeypatch.setattr(gemm, "_copy_transposed", copy)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(2, rows, 96, generator=g)
    w_t = torch.randn(96, 160, generator=g)            # input-major, as InputMajorLinear stores it
    b = torch.randn(160, generator=g) if bias else None
    with torch.inference_mode():
        assert gemm.applies(x, w_t.t())
        got, want = gemm.dense(x, w_t.t(), b), F.linear(x, w_t.t(), b)
    assert got.shape == want.shape == (2, rows, 160)
    torch.testing.assert_close(got, want, **tol.rounding(torch.float32, want, 96))


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_products_multiply_the_rounded_operands_and_return_fp32(bias):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 64, 96, generator=g)
    w_t = torch.randn(96, 160, generator=g)
    b = torch.randn(160, generator=g) if bias else None
    with torch.inference_mode():
        fp32 = gemm.dense(x, w_t.t(), b)
        with gemm.bf16_products():
            got = gemm.dense(x, w_t.t(), b)
            again = gemm.dense(x[:, :32], w_t.t(), b)
            assert len(gemm._bf16_weights) == 1        # the weight rounded once for the block
        after = gemm.dense(x, w_t.t(), b)
    assert gemm._bf16_weights is None and got.dtype == torch.float32 and got.shape == fp32.shape
    # the product of the bf16-rounded operands, accumulated in fp32, written as bf16 (then the bias)
    product = F.linear(x.bfloat16().float(), w_t.t().bfloat16().float())
    want = product.bfloat16().float() + (b if bias else 0)
    near = {"atol": tol.rounding(torch.float32, product, 96)["atol"] + tol.rounding(torch.bfloat16, product)["atol"],
            "rtol": 0.0}
    torch.testing.assert_close(got, want, **near)
    torch.testing.assert_close(again, got[:, :32], **near)
    # not fp32's: off by bf16's rounding of the inputs, and fp32 again after the block, bit for bit
    assert (got - fp32).abs().max() > tol.rounding(torch.float32, want, 96)["atol"]
    torch.testing.assert_close(got, fp32, **tol.rounding(torch.bfloat16, want, 2 * 96))
    assert torch.equal(after, fp32)
    # products of activations (attention's scores and values: projection=False) stay fp32 in the block
    with torch.inference_mode(), gemm.bf16_products():
        assert torch.equal(gemm.dense(x, w_t.t(), b, projection=False), fp32) and not gemm._bf16_weights


@needs_onednn
def test_dense_takes_strided_rows():
    x = torch.randn(64, 2 * 96)[:, :96]                 # a split's half: rows not contiguous
    w = torch.randn(40, 96)
    with torch.inference_mode():
        want = F.linear(x, w)
        torch.testing.assert_close(gemm.dense(x, w), want, **tol.rounding(torch.float32, want, 96))


@pytest.mark.parametrize("flags,cap,want", [
    ("fpu avx2 fma avx512f avx512bw avx512vl", None, False),        # oneDNN's AVX-512 reads the view as fast
    ("fpu avx2 fma avx512f avx512bw avx512vl", "AVX2", True),       # capped below it
    ("fpu avx2 fma avx512f avx512bw avx512vl", "AVX512_CORE_VNNI", False),
    ("fpu avx2 fma", None, True),                                   # an AVX2-only CPU (Zen 3)
    ("fpu avx2 fma avx512f", None, True),                           # AVX-512 F alone is not oneDNN's avx512_core
])
def test_a_transposed_weight_is_copied_where_onednn_runs_below_avx512(monkeypatch, flags, cap, want):
    monkeypatch.setattr(gemm, "_copy_transposed", None)
    monkeypatch.setattr(gemm.kernels, "cpu_flags", lambda: f"flags : {flags}")
    monkeypatch.setattr(gemm.platform, "machine", lambda: "x86_64")
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    if cap:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    assert gemm.copy_transposed() is want
    monkeypatch.setattr(gemm, "_copy_transposed", None)
    monkeypatch.setattr(gemm.platform, "machine", lambda: "aarch64")   # unmeasured on ARM: never
    assert gemm.copy_transposed() is False


def test_what_dense_leaves_to_torch():
    w = torch.randn(40, 96, requires_grad=True)
    few = torch.randn(1, gemm.MIN_ROWS - 1, 96)
    many = torch.randn(1, 64, 96)
    assert not gemm.applies(few, w.detach())                              # a decode step's rows
    assert not gemm.applies(many, w)                                      # autograd needs the product
    assert not gemm.applies(many.double(), w.detach().double())           # fp32 only
    sliced = torch.randn(96, 80)[:, :40].t()                              # neither a matrix nor its transpose
    assert not gemm.applies(many, sliced)
    y = gemm.dense(many, w)                                               # F.linear: differentiable
    y.sum().backward()
    assert w.grad is not None


def test_switched_off_is_torch_exactly(off):
    x, w = torch.randn(64, 96), torch.randn(40, 96)
    with torch.inference_mode():
        assert torch.equal(gemm.dense(x, w), F.linear(x, w))


def test_linear_calls_hooked_and_other_modules():
    lin = nn.Linear(96, 40)
    seen = []
    lin.register_forward_hook(lambda _m, _i, out: seen.append(out))
    with torch.inference_mode():
        gemm.linear(lin, torch.randn(64, 96))
        assert len(seen) == 1                                            # the hook still fires
        seq = nn.Sequential(nn.Linear(96, 40))
        x = torch.randn(64, 96)
        assert torch.equal(gemm.linear(seq, x), seq(x))                  # not an nn.Linear: called as is
