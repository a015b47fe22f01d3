"""Prefill-sized products of q8_0 / q4_0 weights as an int8 GEMM (quant_gemm.c).

QuantLinear (caramba.model.quant) multiplies more than KERNEL_ROWS activation rows here when its
activations are q8-rounded (act='q8': weights q8_0 and q4_0): the rows are quantized to q8 blocks
by the decode kernels' own rule (quant_gemv.c's quantize_activations_q8: the codes a decode step
multiplies), and their int8 codes meet the weight's codes in AMX tiles, AVX-512 VNNI or AVX-VNNI
dot products, or in AVX2's vpmaddubsw (q4_0's nibbles) and vpmaddwd (q8_0's codes widened to int16).
The values multiplied are the ones torch's dequantize-then-matmul path multiplies
(round_activations times the dequantized weight); only the fp32 summation order differs.

native_i16's layers (int16 activation codes, quant_gemv.c's quantize_activations_i16) take gemm_i16
(quant_gemm_i16.c): q8_0, q4_0 and q4_1 blocks in either layout and the GGUF formats kept as stored
(Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), their codes widened to int16 a 32-row panel at a time and
multiplied in AVX-512 VNNI's vpdpwssd (avx512vnni and amx levels; below, torch's path).

    level()            the level the GEMM runs at here: 'amx', 'avx512vnni', 'avxvnni', 'avx2', or 'scalar'
                       (then QuantLinear keeps torch's path, faster than the portable
                       reference), or why no library loaded
    runs('q4_0')       whether that level multiplies the format (q8_0 and q4_0 at every vector level)
    available('amx')   whether this CPU, its OS (AMX's tile state) and the build have a level
    use_level('avx512vnni')   a lower level for a while (tests, A/B timings)
    amx_emulation      a test build of the library with AMX's tiles modelled in software
    i16_runs('q6_k')   whether the level multiplies the format with int16 codes (gemm_i16)

CARAMBA_ISA caps the level as it does the decode kernels' (caramba.model.isa): avx512vnni leaves
AMX out; avxvnni runs that level; avx512 (no VNNI) and avx2 run the avx2 level; scalar leaves this
GEMM out.
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager
from typing import Iterator

import torch

from caramba import kernel_build, kernels

LEVELS = ("scalar", "avx2", "avxvnni", "avx512vnni", "amx")
FORMATS = {"q8_0": 0, "q4_0": 1, "q4_1": 2}
INT8_FORMATS = ("q8_0", "q4_0")   # gemm_q8's weights (q4_1's minimums need the block sums of x: gemm_f32)
# gemm_i16's weights (quant_gemm_i16.c's I16_* ids): QuantLinear's row-major blocks and the GGUF
# formats kept as stored (caramba.model.quant.STORED)
I16_FORMATS = {"q8_0": 0, "q4_0": 1, "q4_1": 2, "q5_0": 3, "q5_1": 4, "q4_k": 5, "q5_k": 6, "q6_k": 7}
# with cpu_isa.c: the CPU checks (AMX and the OS's permission) and fp16 conversion the decode kernels use
SOURCES = kernel_build.sources("quant_gemm")   # caramba.kernel_build.LIBRARIES
_P, _I = ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {
    "gemm_q8": ([_I, _P, _P, _I, _I, _P, _P, _I, _I, _P, _I], _I),
    "gemm_q8_ref": ([_I, _P, _P, _I, _I, _P, _P, _I, _I, _P], None),
    "gemm_f32": ([_I, _P, _I, _I, _P, _P, _P, _I, _P, _I], _I),
    "gemm_f32_ref": ([_I, _P, _I, _I, _P, _P, _P, _I, _P], None),
    "gemm_f32_available": ([], _I),
    "gemm_isa_name": ([], ctypes.c_char_p),
    "gemm_isa_set": ([ctypes.c_char_p], _I),
    "gemm_isa_available": ([ctypes.c_char_p], _I),
    "gemm_q8_runs": ([_I], _I),
    "gemm_i16": ([_I, _P, _P, _I, _I, _P, _P, _P, _I, _I, _P, _I], _I),
    "gemm_i16_ref": ([_I, _P, _P, _I, _I, _P, _P, _P, _I, _I, _P], None),
    "gemm_i16_runs": ([_I], _I),
}
library = kernels.Library(SOURCES, _SIGNATURES, "quantized prefill (int8 GEMM)")
# a test build whose amx level runs AMX's tile instructions in a software model (amx_emulate.h):
# its packing, strides and epilogues, checked on an AVX-512 VNNI CPU without AMX (never for speed)
amx_emulation = kernels.Library(SOURCES, _SIGNATURES, "quantized prefill, AMX modelled in software",
                                [*kernels.FLAGS, "-DCARAMBA_AMX_EMULATE"])


def level() -> str:
    lib = library()
    return lib.gemm_isa_name().decode() if lib is not None else f"eager ({library.status()})"


def runs(fmt: str) -> bool:
    """Whether the level in force multiplies `fmt`'s codes with q8 activations (q8_0 and q4_0
    at avx2 and above; none at scalar); else QuantLinear keeps torch's path."""
    lib = library()
    return bool(lib and fmt in FORMATS and lib.gemm_q8_runs(FORMATS[fmt]))


def available(name: str) -> bool:
    _check(name)
    lib = library()
    return bool(lib and lib.gemm_isa_available(name.encode()))


def _check(name: str) -> None:
    if name not in LEVELS:
        raise ValueError(f"int8 GEMM level {name!r} is not one of {', '.join(LEVELS)}")


@contextmanager
def use_level(name: str) -> Iterator[str]:
    """Run the GEMM at `name` (or the best level below it here) inside the block; yields the
    level in force. Not while a product runs on another thread."""
    _check(name)
    lib = library()
    if lib is None:
        yield level()
        return
    before = lib.gemm_isa_name()
    try:
        lib.gemm_isa_set(name.encode())
        yield lib.gemm_isa_name().decode()
    finally:
        lib.gemm_isa_set(before)


def gemm(fmt: str, xq: torch.Tensor, xd: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, N: int,
         reference: bool = False, threads: int | None = None, x16: bool = False) -> torch.Tensor:
    """out [M, N] fp32 = (xq, xd) q8 rows times the (qs, d) q8_0 or q4_0 weight^T, at the library's level or
    with the portable reference (`reference`); `x16`: qs and d held row-interleaved (a QuantLinear's
    'x16' layout), read in place. The library must be loaded."""
    if fmt not in INT8_FORMATS:
        raise ValueError(f"the int8 GEMM takes {' or '.join(INT8_FORMATS)} weights, not {fmt}")
    lib = library()
    M, K = xq.shape
    out = torch.empty(M, N)
    args = (FORMATS[fmt], xq.data_ptr(), xd.data_ptr(), M, K, qs.data_ptr(), d.data_ptr(), int(x16), N,
            out.data_ptr())
    if reference:
        lib.gemm_q8_ref(*args)
    elif lib.gemm_q8(*args, torch.get_num_threads() if threads is None else threads):
        raise MemoryError("quantized prefill GEMM could not allocate its packing buffers")
    return out


def gemm_f32(fmt: str, x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, N: int,
             reference: bool = False, threads: int | None = None) -> torch.Tensor:
    """out [M, N] fp32 = fp32 rows x [M, K] times the (qs, d, m) weight^T: AMX-BF16 on x's exact
    bf16 pieces where f32_available(), else (or with `reference`) the portable reference."""
    lib = library()
    M, K = x.shape
    out = torch.empty(M, N)
    args = (FORMATS[fmt], x.data_ptr(), M, K, qs.data_ptr(), d.data_ptr(), None if m is None else m.data_ptr(), N,
            out.data_ptr())
    if reference:
        lib.gemm_f32_ref(*args)
    elif lib.gemm_f32(*args, torch.get_num_threads() if threads is None else threads):
        raise MemoryError("quantized prefill GEMM could not allocate its packing buffers")
    return out


def f32_available() -> bool:
    """Whether fp32-activation layers (native's) run on AMX-BF16 here (else torch's path)."""
    lib = library()
    return bool(lib and lib.gemm_f32_available())


def i16_runs(fmt: str) -> bool:
    """Whether the level in force multiplies `fmt`'s blocks with int16 activation codes (avx512vnni
    and amx: every I16_FORMATS format; below, QuantLinear keeps torch's path)."""
    lib = library()
    return bool(lib and fmt in I16_FORMATS and lib.gemm_i16_runs(I16_FORMATS[fmt]))


def gemm_i16(fmt: str, xq: torch.Tensor, xd: torch.Tensor, qs: torch.Tensor, d: torch.Tensor | None,
             m: torch.Tensor | None, N: int, reference: bool = False, threads: int | None = None,
             x16: bool = False) -> torch.Tensor:
    """out [M, N] fp32 = (xq int16 [M, K], xd fp32 [M, K/32]) activation codes (quant_gemv.c's
    quantize_activations_i16) times the weight^T: (qs, d, m) row-major q8_0 / q4_0 / q4_1 blocks,
    or a stored format's file blocks qs (d, m None); `x16`: q8_0 / q4_0 / q4_1 held row-interleaved
    (a QuantLinear's 'x16' layout), read in place; at the library's level or with the portable
    reference (`reference`). The library must be loaded."""
    if fmt not in I16_FORMATS:
        raise ValueError(f"the int16 GEMM takes {', '.join(I16_FORMATS)} weights, not {fmt}")
    lib = library()
    M, K = xq.shape
    out = torch.empty(M, N)
    args = (I16_FORMATS[fmt], xq.data_ptr(), xd.data_ptr(), M, K, qs.data_ptr(), None if d is None else d.data_ptr(),
            None if m is None else m.data_ptr(), int(x16), N, out.data_ptr())
    if reference:
        lib.gemm_i16_ref(*args)
    elif lib.gemm_i16(*args, torch.get_num_threads() if threads is None else threads):
        raise MemoryError("quantized prefill GEMM could not allocate its packing buffers")
    return out
