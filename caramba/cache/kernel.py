"""The C loops of quant_attend.c: decode-step attention straight from quantized codes.

Built on first use and cached by caramba.kernels (the system C compiler, ctypes, a library
keyed by source, compile command and CPU flags under $CARAMBA_CACHE_DIR/kernels). They run at the
model kernels' instruction set level (caramba.model.isa: the portable reference at scalar, the
vector loops at every other level).

caramba.cache.attend keeps its eager path where these do not apply (GPU, non-fp32 queries,
autograd) and when they are unavailable: CARAMBA_KERNELS=0, no C compiler, or a failed build
(a warning says why, once). `status()` says which, for benchmark records.
"""

from __future__ import annotations

import ctypes

import torch

from caramba import kernel_build, kernels
from caramba.cache.kinds import KindSpec, KVCacheKind, spec_of

# quant_attend.c, the exported loops (it names the library), with the levels' work items (the portable
# reference, the vector loops) and the model kernels' run-time instruction set choice (cpu_isa.c:
# CARAMBA_ISA, caramba.model.isa.use_isa), compiled together (the list: caramba.kernel_build.LIBRARIES)
SOURCES = kernel_build.sources("quant_attend")
SOURCE = SOURCES[0]
FLAGS = kernels.FLAGS
_ARGS = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 5 + [ctypes.c_long] * 2 + [ctypes.c_int] * 2
# zero-point kinds: ... bits, group (0: per-token blocks), parameter row stride, threads
_ZP_ARGS = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 5 + [ctypes.c_long] * 2 + [ctypes.c_int] * 2 + [ctypes.c_long, ctypes.c_int]

# cpu_isa.c's exports (caramba.model.quant.ISA_SIGNATURES's; not imported: the cache imports nothing of the model)
ISA_SIGNATURES = {"isa_name": ([], ctypes.c_char_p), "isa_set": ([ctypes.c_char_p], ctypes.c_int),
                  "isa_available": ([ctypes.c_char_p], ctypes.c_int), "isa_env_error": ([], ctypes.c_int),
                  "isa_amx": ([], ctypes.c_int)}

# library(): the loaded kernels, or None (see the module doc).
_QUANTIZE_ARGS = [ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                  ctypes.c_void_p, ctypes.c_int]
library = kernels.Library(SOURCES, {"key_scores": (_ARGS, None), "value_mix": (_ARGS, None),
                                    "key_scores_zp": (_ZP_ARGS, None), "value_mix_zp": (_ZP_ARGS, None),
                                    "quantize_rows": (_QUANTIZE_ARGS, ctypes.c_long), **ISA_SIGNATURES},
                          "quantized KV caches decode")


def status() -> str:
    """'c' when the kernels are in use, else why not."""
    return library.status()


def usable(x: torch.Tensor) -> bool:
    """Whether the kernels can serve queries / weights x (fp32 on the CPU, no autograd)."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and not x.requires_grad
            and library() is not None)


def quantize_rows(x: torch.Tensor, spec: KindSpec, block: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """caramba.cache.quant.quantize's (codes, parameters) of x [..., D] computed in C (kv_stream.c's
    quantizers, the fused decode step's: the same bits, tests hold them equal), or None where it
    does not apply: not fp32 on the CPU, a kind the step has no quantizer for, or a non-finite
    element (torch's arithmetic decides what NaN and inf become)."""
    D = x.shape[-1]
    if not usable(x) or spec.step is None or not spec.quantized or spec.per_channel or D > 512 \
            or D % block or (D * spec.bits) % 8 or x.numel() == 0:
        return None
    rows = x.numel() // D
    x = x.contiguous()
    codes = torch.empty(*x.shape[:-1], D * spec.bits // 8, dtype=torch.uint8)
    params = torch.empty(*x.shape[:-1], D // block * spec.params, dtype=torch.float16)
    bad = library().quantize_rows(spec.step, x.data_ptr(), rows, D, block, codes.data_ptr(), params.data_ptr(),
                                  torch.get_num_threads())
    if bad:
        return None
    return (codes if spec.packed else codes.view(spec.dtype)), params


def _heads(codes: torch.Tensor) -> tuple[int, int]:
    """(B * H, head stride) of codes [B, H, rows, cols] whose (B, H) merge into one index."""
    B, H = codes.shape[:2]
    if codes.stride(-1) != 1 or (B > 1 and codes.stride(0) != H * codes.stride(1)):
        raise ValueError("kernel codes must be contiguous in their last dim with mergeable batch and head dims")
    return B * H, codes.stride(1)


def _run(fn, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, kind: KVCacheKind | KindSpec, block: int,
         D: int, n: int, width: int) -> torch.Tensor:
    """One kernel call on x [B, H, R, *] (queries or weights) -> [B, H, R, width] float32."""
    kid = spec_of(kind).kernel   # the kind's id in quant_attend.c
    if kid is None:
        raise ValueError(f"kind {spec_of(kind).name} has no C kernel (its KindSpec sets no kernel id); "
                         "read it through caramba.cache.attend's eager path")
    B, H, R = x.shape[:3]
    x, scales = x.contiguous(), scales.float().contiguous()
    out = torch.empty(B, H, R, width, dtype=torch.float32)
    BH, head_stride = _heads(codes)
    fn(x.data_ptr(), codes.data_ptr(), scales.data_ptr(), out.data_ptr(), BH, R, D, block, n,
       head_stride, codes.stride(2), kid, torch.get_num_threads())
    return out


def key_scores(q: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, kind: KVCacheKind | KindSpec,
               block: int) -> torch.Tensor:
    """q [B, H, R, D] (scaled) against keys-major codes [B, H, Dc, n] and scales [B, H, nb, n]
    -> scores [B, H, R, n]."""
    n = codes.shape[-1]
    return _run(library().key_scores, q, codes, scales, kind, block, q.shape[-1], n, n)


def value_mix(p: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, kind: KVCacheKind | KindSpec, block: int,
              dim: int) -> torch.Tensor:
    """Weights p [B, H, R, n] over value codes [B, H, n, Dc] and scales [B, H, nb, n] -> [B, H, R, dim]."""
    return _run(library().value_mix, p, codes, scales, kind, block, dim, p.shape[-1], dim)


def reads_zero_point(stream) -> bool:
    """Whether a zero-point stream's codes can go to key_scores_zp / value_mix_zp: 4- or 2-bit,
    per-token blocks, or per-channel keys (keys-major codes) in groups of a multiple of 16 tokens."""
    spec = stream.spec
    if not (spec.zero_point and spec.bits in (2, 4)) or getattr(stream, "shift", None) is not None:
        return False    # per-row group phases (ChannelQuantStream.set_origins): read through dequant
    return not spec.per_channel or (stream.keys_major and stream.G % 16 == 0)


def _run_zp(fn, x: torch.Tensor, codes: torch.Tensor, params: torch.Tensor, spec: KindSpec, block: int, group: int,
            D: int, n: int, width: int) -> torch.Tensor:
    B, H, R = x.shape[:3]
    x, params = x.contiguous(), params.float().contiguous()
    out = torch.empty(B, H, R, width, dtype=torch.float32)
    BH, head_stride = _heads(codes)
    fn(x.data_ptr(), codes.data_ptr(), params.data_ptr(), out.data_ptr(), BH, R, D, block, n,
       head_stride, codes.stride(2), spec.bits, group, params.shape[-1], torch.get_num_threads())
    return out


def key_scores_zp(q: torch.Tensor, codes: torch.Tensor, params: torch.Tensor, spec: KindSpec, block: int,
                  group: int = 0) -> torch.Tensor:
    """q [B, H, R, D] against keys-major zero-point codes [B, H, Dc, n] -> scores [B, H, R, n].
    params: [B, H, 2 nb, n] (per-token blocks of `block` elements; group=0) or [B, H, 2 D, ng]
    (per-channel groups of `group` tokens covering [0, n))."""
    n = codes.shape[-1]
    return _run_zp(library().key_scores_zp, q, codes, params, spec, block, group, q.shape[-1], n, n)


def value_mix_zp(p: torch.Tensor, codes: torch.Tensor, params: torch.Tensor, spec: KindSpec, block: int,
                 dim: int) -> torch.Tensor:
    """Weights p [B, H, R, n] over per-token zero-point value codes [B, H, n, Dc], params [B, H, 2 nb, n]."""
    return _run_zp(library().value_mix_zp, p, codes, params, spec, block, 0, dim, p.shape[-1], dim)
