"""The fused decode-step ops (caramba.model.fused, decode_ops.c) against torch's, and the model's
decode steps with and without them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from caramba.model import fused
import tolerance as tol
from conftest import make_model


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(autouse=True)
def needs_kernels():
    if fused.library() is None:
        pytest.skip(f"decode kernels {fused.status()}")


def test_ops_equal_torch():
    x, h, w = randn(3, 1, 96, seed=1) * 4, randn(3, 1, 96, seed=2), randn(96, seed=3)
    ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))      # transformers' LlamaRMSNorm
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-5), ref, **tol.reduction(ref, 96))
    s, y = fused.add_rms_norm(x, h, w, 1e-5)
    assert torch.equal(s, x + h)
    torch.testing.assert_close(y, F.rms_norm(x + h, (96,), w, 1e-5), **tol.reduction(y, 96))
    gu = randn(2, 1, 2 * 40, seed=4) * 3
    ref = F.silu(gu[..., :40]) * gu[..., 40:]
    torch.testing.assert_close(fused.silu_mul(gu, 40), ref, **tol.elementwise(ref, 4))


def test_silu_mul_is_within_a_few_ulp_of_exact_everywhere():
    """decode_ops.c's vector exp (AVX2) and libm's (the scalar tail, portable builds) over the
    whole range a gate meets, element by element against float64: exp's ~2 ulp plus the add,
    divide and multiply stay within a few eps of each value (or 1e-36 absolute: results below
    that, gates under -88, may flush to zero); a wrong coefficient, range reduction or exponent
    would be off by 1e-4 or more somewhere."""
    g = torch.cat([torch.linspace(-110, 110, 4001), randn(995, seed=5) * 4])   # 8k + 4: vectors and a tail
    u = randn(g.numel(), seed=6)
    got = fused.silu_mul(torch.cat([g, u]).reshape(1, 1, -1), g.numel()).flatten().double()
    exact = g.double() * torch.sigmoid(g.double()) * u.double()
    err = (got - exact).abs()
    assert (err <= 8 * torch.finfo(torch.float32).eps * exact.abs() + 1e-36).all(), float((err / exact.abs()).max())


def test_applies_only_to_small_fp32_cpu_inference():
    assert fused.applies(torch.zeros(1, 1, 64))
    assert not fused.applies(torch.zeros(1, fused.MAX_ROWS + 1, 64))          # prefill: torch's ops
    assert not fused.applies(torch.zeros(1, 1, 64, dtype=torch.bfloat16))
    assert not fused.applies(torch.zeros(1, 1, 64, requires_grad=True))
    assert not fused.applies(torch.zeros(1, 64, 2).transpose(1, 2))           # not contiguous


def test_decode_steps_equal_the_unfused_model(monkeypatch):
    model = make_model(seed=2)
    model.fast_decode = False          # the torch path's steps, where these ops are used
    ids = torch.tensor([[5, 9, 1, 44, 3]])

    def steps():
        with torch.inference_mode():
            cache = model.new_cache(1, 32)
            out = [model(ids, cache=cache)]
            for t in (7, 8, 9):
                out.append(model(torch.tensor([[t]]), cache=cache))
        return torch.cat(out, dim=1)

    got = steps()
    monkeypatch.setattr(fused, "applies", lambda x: False)
    ref = steps()
    torch.testing.assert_close(got, ref, **tol.forward(ref, model.config))
