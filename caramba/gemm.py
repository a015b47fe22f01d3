"""The fp32 GEMM of the torch path's projections on the CPU: oneDNN's where it applies, else torch's.

torch's CPU wheels run F.linear / matmul on fp32 through MKL's sgemm. On the AMD EPYC (Zen 5,
AVX-512) this was measured on, oneDNN's fp32 GEMM (torch.ops.mkldnn._linear_pointwise, the op
torch.compile's CPU backend emits for linears, bundled with every torch that has mkldnn) ran
SmolLM2-135M's projections 1.7-4x faster at every row count from 8 to 4096, one thread, alternated
in one process (docs/decode-speed.md §9, "Prefill against HF transformers"): [4096, 576] x [576, 3072] in 80 ms
against 150 ms. It is the same fp32 arithmetic in another summation order: outputs agree to
rounding (tests/tolerance.py), not bit for bit.

`dense(x, weight, bias)` takes it for fp32 CPU inputs of at least MIN_ROWS rows that need no
autograd (decode steps of one row keep torch's GEMV; the fused C step does not come here at all);
otherwise F.linear. `CARAMBA_ONEDNN=0` turns it off (torch's GEMM everywhere: the A/B switch).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

ENV = "CARAMBA_ONEDNN"
MIN_ROWS = 8   # measured down to 8 rows (a speculative verify's width); below, torch's GEMV/GEMM

_available: bool | None = None


def available() -> bool:
    """Whether oneDNN's linear can be called (torch built with mkldnn, not switched off)."""
    global _available
    if _available is None:
        _available = (os.environ.get(ENV, "1") != "0" and torch.backends.mkldnn.is_available()
                      and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    return _available


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x @ weight.T goes to oneDNN: fp32 on the CPU, enough rows, no autograd, and a weight
    that is a whole matrix or its transpose (oneDNN took minutes over a column slice's transpose,
    weight_t[:, :n].t(), where F.linear takes milliseconds)."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.numel() >= MIN_ROWS * x.shape[-1] > 0 and weight.device.type == "cpu"
            and (weight.is_contiguous() or weight.t().is_contiguous())
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and available())


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias): x [..., in], weight [out, in] (a transposed view of an
    input-major [in, out] matrix is fine) -> [..., out]."""
    if not applies(x, weight) or (bias is not None and bias.dtype != torch.float32):
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    if not rows.is_contiguous():
        rows = rows.contiguous()
    out = torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [None], "")
    return out.view(*x.shape[:-1], weight.shape[0])


def linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """module(x) for a projection: a plain nn.Linear without hooks goes through `dense`; any
    other module (a QuantLinear, a hooked one) is called as it is."""
    if type(module) is torch.nn.Linear and not (module._forward_hooks or module._forward_pre_hooks):
        return dense(x, module.weight, module.bias)
    return module(x)
