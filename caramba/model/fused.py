"""Fused elementwise ops for CPU decode steps (decode_ops.c), with torch's ops as the fallback.

At batch 1 every elementwise op of a decode step works on one 576-wide vector, so torch's
per-op dispatch (~5-30 us on a busy 2-core CPU) costs far more than the arithmetic. These run
only where they apply (fp32 on the CPU, no autograd, a few rows: prefill keeps torch's
vectorized ops) and when the kernels can be built (caramba.kernels; CARAMBA_KERNELS=0 turns
them off).
"""

from __future__ import annotations

import ctypes

import torch

from caramba import kernel_build, kernels

(SOURCE,) = kernel_build.sources("decode_ops")   # caramba.kernel_build.LIBRARIES
MAX_ROWS = 16   # beyond this (prefill) torch's vectorized, threaded ops win
_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "rms_norm": ([_P] * 3 + [_L, _I, _F], None),
    "add_rms_norm": ([_P] * 5 + [_L, _I, _F], None),
    "silu_mul": ([_P] * 2 + [_L, _I], None),
    "silu_mul_ref": ([_P] * 2 + [_L, _I], None),   # the portable reference, for tests
    "gelu_mul": ([_P] * 2 + [_L, _I], None),
    "gelu_mul_ref": ([_P] * 2 + [_L, _I], None),
}
# library(): the loaded elementwise kernels, or None.
library = kernels.Library(SOURCE, _SIGNATURES, "decode steps run elementwise ops")


def status() -> str:
    """'c' when the fused kernels are in use, else why not."""
    return library.status()


def applies(x: torch.Tensor) -> bool:
    """Whether x (activations [..., dim]) takes the fused path."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous()
            and not (torch.is_grad_enabled() and x.requires_grad)
            and x.numel() <= MAX_ROWS * x.shape[-1] and library() is not None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    y = torch.empty_like(x)
    library().rms_norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps)
    return y


def add_rms_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + h, rms_norm(x + h)) in one pass; h must be contiguous and shaped like x."""
    s, y = torch.empty_like(x), torch.empty_like(x)
    library().add_rms_norm(x.data_ptr(), h.data_ptr(), weight.data_ptr(), s.data_ptr(), y.data_ptr(),
                           x.numel() // x.shape[-1], x.shape[-1], eps)
    return s, y


def silu_mul(gu: torch.Tensor, hidden: int) -> torch.Tensor:
    """silu(gu[..., :hidden]) * gu[..., hidden:]."""
    y = torch.empty(*gu.shape[:-1], hidden, dtype=gu.dtype)
    library().silu_mul(gu.data_ptr(), y.data_ptr(), gu.numel() // gu.shape[-1], hidden)
    return y


def gelu_mul(gu: torch.Tensor, hidden: int) -> torch.Tensor:
    """gelu_tanh(gu[..., :hidden]) * gu[..., hidden:] (GeGLU)."""
    y = torch.empty(*gu.shape[:-1], hidden, dtype=gu.dtype)
    library().gelu_mul(gu.data_ptr(), y.data_ptr(), gu.numel() // gu.shape[-1], hidden)
    return y
