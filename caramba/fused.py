"""Fused elementwise ops for CPU forwards (decode_ops.c), with torch's ops as the fallback.

At batch 1 every elementwise op of a decode step works on one 576-wide vector, so torch's
per-op dispatch (~5-30 us on a busy 2-core CPU) costs far more than the arithmetic. A prefill's
rows take the same kernels split over torch's thread count: RMSNorm is five passes over the
activations in torch (pow, mean, add, rsqrt, mul), SwiGLU two, RoPE four (a roll, two products,
a sum), where one C pass does each (docs/decode-speed-log.md §29). A row's result is the same
bits whether it is computed alone, in a decode step's few rows or in a prefill's many. These run
only where they apply (fp32 on the CPU, no autograd) and when the kernels can be built
(caramba.kernels; CARAMBA_KERNELS=0 turns them off); `digest()` names the build, for the keys of
results kept by the eval's stores.
"""

from __future__ import annotations

import ctypes

import torch

from caramba import kernel_build, kernels

(SOURCE,) = kernel_build.sources("decode_ops")   # caramba.kernel_build.LIBRARIES
SERIAL_ROWS = 16   # up to this many rows (decode steps) one thread: a parallel region costs more
_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
_SIGNATURES = {   # the single-threaded entries' are decode_step.c's; Python calls the _par ones
    "silu_mul": ([_P] * 2 + [_L, _I], None),       # the vector loop and its portable reference, for tests
    "silu_mul_ref": ([_P] * 2 + [_L, _I], None),
    "gelu_mul": ([_P] * 2 + [_L, _I], None),
    "gelu_mul_ref": ([_P] * 2 + [_L, _I], None),
    "rms_norm_par": ([_P] * 3 + [_L, _I, _F, _I], None),
    "add_rms_norm_par": ([_P] * 5 + [_L, _I, _F, _I], None),
    "glu_par": ([_P] * 2 + [_L, _I, _I, _I], None),
    "rope_rows": ([_P] * 4 + [_L, _I, _I, _L, _I], None),
    "causal_softmax": ([_P, _L, _I, _I, _I, _P, _L, _I], None),
}
# library(): the loaded elementwise kernels, or None.
library = kernels.Library(SOURCE, _SIGNATURES, "forwards run elementwise ops")


def status() -> str:
    """'c' when the fused kernels are in use, else why not."""
    return library.status()


def digest() -> str | None:
    """The loaded build of decode_ops.c (the sha256 of its library's bytes, as caramba.kernels
    records it), or None where the fused ops do not run."""
    return kernels.digests.get("decode_ops") if available() else None


def available() -> bool:
    """Whether the fused kernels run here (built and loaded)."""
    return library() is not None


def applies(x: torch.Tensor) -> bool:
    """Whether x (activations [..., dim]) takes the fused path."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous()
            and not (torch.is_grad_enabled() and x.requires_grad) and available())


def _threads(rows: int) -> int:
    return 1 if rows <= SERIAL_ROWS else torch.get_num_threads()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    y, rows = torch.empty_like(x), x.numel() // x.shape[-1]
    library().rms_norm_par(x.data_ptr(), weight.data_ptr(), y.data_ptr(), rows, x.shape[-1], eps, _threads(rows))
    return y


def add_rms_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + h, rms_norm(x + h)) in one pass; h must be contiguous and shaped like x."""
    s, y, rows = torch.empty_like(x), torch.empty_like(x), x.numel() // x.shape[-1]
    library().add_rms_norm_par(x.data_ptr(), h.data_ptr(), weight.data_ptr(), s.data_ptr(), y.data_ptr(),
                               rows, x.shape[-1], eps, _threads(rows))
    return s, y


def silu_mul(gu: torch.Tensor, hidden: int) -> torch.Tensor:
    """silu(gu[..., :hidden]) * gu[..., hidden:]."""
    return _glu(gu, hidden, 0)


def gelu_mul(gu: torch.Tensor, hidden: int) -> torch.Tensor:
    """gelu_tanh(gu[..., :hidden]) * gu[..., hidden:] (GeGLU)."""
    return _glu(gu, hidden, 1)


def _glu(gu: torch.Tensor, hidden: int, gelu: int) -> torch.Tensor:
    y, rows = torch.empty(*gu.shape[:-1], hidden, dtype=gu.dtype), gu.numel() // gu.shape[-1]
    library().glu_par(gu.data_ptr(), y.data_ptr(), rows, hidden, gelu, _threads(rows))
    return y


def rope_applies(qkv: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether rope_heads takes qkv [B, T, width] (a projection's output) with cos [B, 1, T, D]."""
    return applies(qkv) and cos.dtype == torch.float32 and cos.is_contiguous() and cos.shape[1] == 1


def rope_heads(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, heads: int) -> torch.Tensor:
    """caramba.model.rope.apply_rope of qkv's first `heads` heads: qkv [B, T, width] with heads of
    cos.shape[-1] from its start; cos and signed_sin [B, 1, T, D] -> [B, heads, T, D] (memory [B, T,
    heads, D], as a projection lays its heads out)."""
    B, T, width = qkv.shape
    D = cos.shape[-1]
    sin = signed_sin.expand(B, 1, T, D).contiguous()
    cos = cos.expand(B, 1, T, D).contiguous()
    out = torch.empty(B, T, heads, D, dtype=qkv.dtype)
    library().rope_rows(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), B * T, heads, D, width,
                        _threads(B * T))
    return out.transpose(1, 2)


def causal_softmax(scores: torch.Tensor, rep: int, first: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax in place over scores [rows, end] (contiguous fp32) of a block of queries with `rep`
    rows each (row i: query t = i // rep), query t seeing keys [0, first + t] (and only those its
    mask row [rows // rep, end] (bool) allows): the hidden keys' probabilities are 0
    (caramba.cache.sdpa)."""
    rows, end = scores.shape
    m = None if mask is None else mask.contiguous().view(torch.uint8)
    library().causal_softmax(scores.data_ptr(), rows, end, rep, first, None if m is None else m.data_ptr(),
                             0 if m is None else m.stride(0), _threads(rows))
    return scores
