"""The fp32 GEMM of the torch path's projections on the CPU: oneDNN's where it applies, else torch's.

torch's CPU wheels run F.linear / matmul on fp32 through MKL's sgemm. On the AMD EPYC (Zen 5,
AVX-512) this was measured on, oneDNN's fp32 GEMM (torch.ops.mkldnn._linear_pointwise, the op
torch.compile's CPU backend emits for linears, bundled with every torch that has mkldnn) ran
SmolLM2-135M's projections 1.7-4x faster at every row count from 8 to 4096, one thread, alternated
in one process (docs/decode-speed-log.md §9, "Prefill against HF transformers"): [4096, 576] x [576, 3072] in 80 ms
against 150 ms. It is the same fp32 arithmetic in another summation order: outputs agree to
rounding (tests/tolerance.py), not bit for bit.

`dense(x, weight, bias)` takes it for fp32 CPU inputs of at least MIN_ROWS rows that need no
autograd (decode steps of one row keep torch's GEMV; the fused C step does not come here at all);
otherwise F.linear. `CARAMBA_ONEDNN=0` turns it off (torch's GEMM everywhere: the A/B switch).

An input-major weight (InputMajorLinear's [in, out], passed as its transposed view) is what
oneDNN's AVX-512 kernels read at about the speed of a row-major one (7.9 against 7.4 ms for
[512, 576] x [576, 3072], one thread, Zen 5), but its AVX2 kernels at 0.59x (25.2 against 14.9
ms, ONEDNN_MAX_CPU_ISA=AVX2 on the same CPU). Where oneDNN runs below AVX-512 (an x86 CPU without
it, or capped), a projection of at least TRANSPOSE_MIN_ROWS rows takes a row-major copy of the
weight for the call: 0.8 ms for those 7 MB, so 16.1 ms in all. Not attention's probabilities times
its values ([n, end] x [end, 64], the values transposed): there the transposed read was 25-35%
faster than a copy and the product, at both levels and every length from 128 to 4096 keys (Zen 4,
two threads).
"""

from __future__ import annotations

import contextlib
import os
import platform

import torch
import torch.nn.functional as F

from caramba import kernels

ENV = "CARAMBA_ONEDNN"
MIN_ROWS = 8   # measured down to 8 rows (a speculative verify's width); below, torch's GEMV/GEMM
# rows from which a transposed weight is copied row-major first, where oneDNN runs at AVX2: the copy
# (0.8 ms for 7 MB) against 0.02 ms a row lost to the transposed read breaks even near 40 rows
TRANSPOSE_MIN_ROWS = 64

_available: bool | None = None


def available() -> bool:
    """Whether oneDNN's linear can be called (torch built with mkldnn, not switched off)."""
    global _available
    if _available is None:
        _available = (os.environ.get(ENV, "1") != "0" and torch.backends.mkldnn.is_available()
                      and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    return _available


_copy_transposed: bool | None = None


def copy_transposed() -> bool:
    """Whether oneDNN's fp32 GEMM runs below AVX-512 here (an x86-64 CPU without AVX-512 F/BW/VL,
    or ONEDNN_MAX_CPU_ISA / DNNL_MAX_CPU_ISA naming a lower level), where a transposed weight is
    worth a row-major copy. Unmeasured elsewhere (ARM): never there."""
    global _copy_transposed
    if _copy_transposed is None:
        flags = kernels.cpu_flags().split()
        x86 = platform.machine().lower() in ("x86_64", "amd64")
        cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL").upper()
        avx512 = all(f in flags for f in ("avx512f", "avx512bw", "avx512vl")) and (
            cap == "ALL" or "AVX512" in cap or "AMX" in cap or "AVX10" in cap)
        _copy_transposed = x86 and not avx512
    return _copy_transposed


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x @ weight.T goes to oneDNN: fp32 on the CPU, enough rows, no autograd, and a weight
    that is a whole matrix or its transpose (oneDNN took minutes over a column slice's transpose,
    weight_t[:, :n].t(), where F.linear takes milliseconds)."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.numel() >= MIN_ROWS * x.shape[-1] > 0 and weight.device.type == "cpu"
            and (weight.is_contiguous() or weight.t().is_contiguous())
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and available())


# While bf16_products() is on: each weight's bfloat16 copy, by the weight's storage and layout.
_bf16_weights: dict[tuple, torch.Tensor] | None = None


@contextlib.contextmanager
def bf16_products():
    """Within: dense() multiplies a projection's fp32 operands as bfloat16 (each weight rounded once, kept
    for the block; the activations per call; oneDNN accumulates in fp32 and writes bf16, as
    torch.autocast's products do) and returns fp32, the bias added in fp32. Half the fp32 GEMM's
    time where the CPU multiplies bf16 natively (AVX-512 BF16, AMX-BF16): [2048, 576] x [576, 3072]
    in 37 ms against 76 ms, one thread, Zen 4. Inputs and outputs keep 8 mantissa bits, so results
    differ from fp32's (an eval's tasks.prefill_precision: bf16 records it and measures what it
    changes)."""
    global _bf16_weights
    outer, _bf16_weights = _bf16_weights, {} if _bf16_weights is None else _bf16_weights
    try:
        yield
    finally:
        _bf16_weights = outer


def bf16_native() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX-512 BF16 or AMX-BF16) and oneDNN is on:
    where bf16_products() pays; elsewhere oneDNN emulates it, slower than fp32."""
    flags = kernels.cpu_flags().split()
    return available() and ("avx512_bf16" in flags or "amx_bf16" in flags)


def _bf16_weight(weight: torch.Tensor) -> torch.Tensor:
    key = (weight.untyped_storage().data_ptr(), weight.storage_offset(), tuple(weight.shape), weight.stride())
    if key not in _bf16_weights:
        _bf16_weights[key] = weight.to(torch.bfloat16)   # keeps the layout: a transposed view stays one
    return _bf16_weights[key]


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
          projection: bool = True) -> torch.Tensor:
    """F.linear(x, weight, bias): x [..., in], weight [out, in] (a transposed view of an
    input-major [in, out] matrix is fine) -> [..., out]. projection: `weight` is a model's weight
    (rounded to bf16 once inside bf16_products); False for products of activations (attention's
    scores and values), which stay fp32 there."""
    if not applies(x, weight) or (bias is not None and bias.dtype != torch.float32):
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    if not rows.is_contiguous():
        rows = rows.contiguous()
    if _bf16_weights is not None and projection:
        out = torch.ops.mkldnn._linear_pointwise(rows.to(torch.bfloat16), _bf16_weight(weight), None, "none",
                                                 [None], "").float()
        out = out if bias is None else out + bias
        return out.view(*x.shape[:-1], weight.shape[0])
    if projection and not weight.is_contiguous() and rows.shape[0] >= TRANSPOSE_MIN_ROWS and copy_transposed():
        weight = weight.contiguous()
    out = torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [None], "")
    return out.view(*x.shape[:-1], weight.shape[0])


def linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """module(x) for a projection: a plain nn.Linear without hooks goes through `dense`; any
    other module (a QuantLinear, a hooked one) is called as it is."""
    if type(module) is torch.nn.Linear and not (module._forward_hooks or module._forward_pre_hooks):
        return dense(x, module.weight, module.bias)
    return module(x)
