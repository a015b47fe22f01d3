"""Block-quantized weights (llama.cpp's q8_0, q4_0 and q4_1) and the linear layer that reads them.

`weights` on load_model, the CLI (--weights) and manifests (model.weights) picks the format:
  fp32    the checkpoint's values in the model's dtype (the default);
  q8_0    every projection and the head quantized to llama.cpp's q8_0 (32-element blocks, one fp16
          scale), from any source; a decode step multiplies them with activations quantized to
          q8_0 on the fly, as llama.cpp does (quant_gemv.c, gemv_q8_0_q8);
  q4_0    the same with llama.cpp's q4_0 blocks (32 4-bit codes, one fp16 scale: 4.5 bits);
  native  a GGUF's own blocks kept as they are (the embedded SmolLM2: Q4_1 projections, a Q8_0
          embedding/head; a Q4_K_M file's Q4_K, Q6_K and Q5_0 as the file's bytes: STORED), multiplied with fp32 activations so that the weight values are exactly
          the ones the fp32 path dequantizes: the products differ at the level of fp32 rounding
          (the kernels carry each activation as two int16 codes, exact to 2^-16 of its block's
          power-of-two scale: quant_gemv.c's ACT_SPLIT);
  native_i16  the same blocks times activations rounded to one int16 code per element (error at
          most 1/65534 of the block's largest value, 256x finer than q8's): ~1.2x native's decode
          speed; logits move by up to ~1e-2, so greedy output leaves fp32's at near ties
          (docs/decode-speed.md).
q8_0 and q4_0 keep llama.cpp's block formats but not its rounding rule: each block's scale is the
best of a search (quantize_blocks), which on a checkpoint that was quantized before (SmolLM2's
Q4_1) removes most of the requantization error (docs/decode-speed.md).

Where the level's decode kernels have an x16 kernel for the format (quant_gemv.c's x16_vector:
avx512vnni, and for most formats avx2, avxvnni, avx512 and neon with sdot), QuantLinear holds its
codes row-interleaved (layout 'x16': 16 rows per group, quant_gemv.h), the layout those kernels
read with the rows as vector lanes;
every other reader (dequantize, embedding rows, the prefill GEMM, state_dict) gets row-major codes
back through row_major(). There is one copy of the weights either way.

QuantLinear calls the C kernels for batch-1 decode and other small row counts (<= KERNEL_ROWS) on
the CPU; prefill and larger batches multiply the codes in caramba.model.quant_gemm (an int8 GEMM
on AMX/VNNI for q8 activations, on AVX2 for q4_0's; an int16 GEMM on AVX-512 VNNI for
native_i16's int16 codes, every format including the stored ones, quant_gemm_i16.c; AMX-BF16 for fp32 ones) where
the CPU has one; other devices,
other CPUs and a missing kernel library take the eager path (dequantize, then matmul). All
multiply the same values: where the kernels round activations
(q8 for q8_0 and q4_0, int16 for native_i16) the eager path rounds them by the same rule
(round_activations), so a batch, a long prompt or a machine without a compiler changes only the
fp32 summation order, never the arithmetic.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from caramba import gemm, kernel_build, kernels
from caramba.model import gguf_loader, quant_gemm

WEIGHT_KINDS = ("fp32", "q8_0", "q4_0", "native", "native_i16")
NATIVE_ACT = {"native": "f32", "native_i16": "i16"}   # the native kinds' activations
QUANTIZED = {"q8_0": (-127, 127), "q4_0": (-8, 7)}   # the formats quantize_model makes: their code ranges
QK = 32               # elements per block (both formats)
KERNEL_ROWS = 16      # rows of activations up to which the GEMV kernels beat dequantize + matmul

# the products (quant_gemv.c: the exported functions and the dispatch; the portable reference; the
# x86-64 and AArch64 kernels) and the instruction set choice they dispatch on, compiled together
# (kernels.Library; the first names the library)
# (the list: caramba.kernel_build.LIBRARIES, which setup.py prebuilds at install)
SOURCES = kernel_build.sources("quant_gemv")
_P, _I = ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {
    "gemv_q8_0_q8": ([_P] * 4 + [_I] * 4, _I),
    "gemv_q8_0_f32": ([_P] * 4 + [_I] * 4, _I),
    "gemv_q4_1_f32": ([_P] * 5 + [_I] * 4, _I),
    "gemv_q4_1_q8": ([_P] * 5 + [_I] * 4, _I),
    "gemv_q8_0_i16": ([_P] * 4 + [_I] * 4, _I),
    "gemv_q4_1_i16": ([_P] * 5 + [_I] * 4, _I),
    "quantize_blocks_best": ([_P, ctypes.c_long, _I, _I, _P, _I, _P, _P, _I], None),
    "quantize_activations_q8": ([_P, _I, _I, _P, _P], None),
    "quantize_activations_i16": ([_P, _I, _I, _P, _P], None),
    "split_activations": ([_P, _I, _I, _P, _P], None),
    "embed_rows_q8_0": ([_P, ctypes.c_long, _P, _P, ctypes.c_long, _I, _P], ctypes.c_long),
    "block_sums": ([_I, _P, _P, _I, _P], None),
    "gemv_x16": ([_I] + [_P] * 5 + [_I] * 4, _I),
    "x16_block_sums": ([_I, _P, _P, _I, _P], None),
    "x16_vector": ([_I], _I),
    "embed_rows_q8_0_x16": ([_P, ctypes.c_long, _P, _P, ctypes.c_long, _I, _P], ctypes.c_long),
    "dequantize_rows": ([_I, _I, _P, _P, _P, _I, _I, _I, _P, _I], None),
    "gemv_kq": ([_I] + [_P] * 3 + [_I] * 4, _I),
}
# cpu_isa.c's exports, in every library built with it (caramba.model.isa reads them)
ISA_SIGNATURES = {"isa_name": ([], ctypes.c_char_p), "isa_set": ([ctypes.c_char_p], _I),
                  "isa_available": ([ctypes.c_char_p], _I), "isa_env_error": ([], _I), "isa_amx": ([], _I)}
_SIGNATURES.update(ISA_SIGNATURES)
# library(): the loaded GEMV kernels, or None (CARAMBA_KERNELS=0, no compiler, failed build: one warning).
library = kernels.Library(SOURCES, _SIGNATURES, "quantized weights multiply")


def status() -> str:
    """'c' when the weight kernels are in use, else why not."""
    return library.status()


def check_kind(weights: str) -> str:
    if weights not in WEIGHT_KINDS:
        raise ValueError(f"weights {weights!r} is not a weight format; use one of {', '.join(WEIGHT_KINDS)}")
    return weights


# --- the formats ----------------------------------------------------------------------------------

# The products' format ids (quant_gemv.h's enum; decode_step.c and quant_gemv.c switch on them):
# the decode step's fp32 layouts, the row-major block formats (weight x activation codes), then
# the row-interleaved ones (layout 'x16').
(F32_ROWS, F32_COLS, Q8_0_Q8, Q8_0_F32, Q4_1_F32, Q4_1_Q8, Q4_0_Q8, Q8_0_I16, Q4_1_I16,
 Q8_0_Q8_X16, Q4_0_Q8_X16, Q4_1_Q8_X16, Q8_0_I16_X16, Q4_1_I16_X16, Q8_0_F32_X16, Q4_1_F32_X16,
 Q5_0_I16, Q5_1_I16, Q4_K_I16, Q5_K_I16, Q6_K_I16, Q5_0_F32, Q5_1_F32, Q4_K_F32, Q5_K_F32, Q6_K_F32) = range(26)
# GGUF formats kept as stored, each row the file's blocks [N, row bytes] (quant_gemv_kq.h): name ->
# (elements per block, bytes per block); their products take int16 ('i16') or split int16 ('f32') codes
STORED = {"q5_0": (32, 22), "q5_1": (32, 24), "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210)}
FORMAT_IDS = {("q8_0", "q8", "rows"): Q8_0_Q8, ("q8_0", "f32", "rows"): Q8_0_F32, ("q4_1", "f32", "rows"): Q4_1_F32,
              ("q4_1", "q8", "rows"): Q4_1_Q8, ("q4_0", "q8", "rows"): Q4_0_Q8, ("q8_0", "i16", "rows"): Q8_0_I16,
              ("q4_1", "i16", "rows"): Q4_1_I16, ("q8_0", "q8", "x16"): Q8_0_Q8_X16,
              ("q4_0", "q8", "x16"): Q4_0_Q8_X16, ("q4_1", "q8", "x16"): Q4_1_Q8_X16,
              ("q8_0", "i16", "x16"): Q8_0_I16_X16, ("q4_1", "i16", "x16"): Q4_1_I16_X16,
              ("q8_0", "f32", "x16"): Q8_0_F32_X16, ("q4_1", "f32", "x16"): Q4_1_F32_X16,
              **{(f, "i16", "rows"): Q5_0_I16 + i for i, f in enumerate(STORED)},
              **{(f, "f32", "rows"): Q5_0_F32 + i for i, f in enumerate(STORED)}}

# Layouts of QuantLinear's codes: 'rows' (llama.cpp's, row after row) or 'x16' (groups of X16 rows
# interleaved 4 code bytes at a time, their scales side by side: quant_gemv.h), which the decode
# products read with the rows as vector lanes (quant_gemv.c). x16 is chosen where the level has a
# vector kernel for the format (quant_gemv.c's x16_vector: every format at avx512vnni; the q8
# activations' and q4_1's int16 ones at avx2, avxvnni and avx512; the q8 activations' at neon with
# sdot); elsewhere rows. Either layout holds the same bytes;
# state_dict() gives rows whatever the layout.
LAYOUTS = ("rows", "x16")
DEQUANT_FORMATS = {"q8_0": 0, "q4_0": 1, "q4_1": 2, **{f: 3 + i for i, f in enumerate(STORED)}}   # quant_gemv.c's dequantize_rows
# fp32 bytes of a weight tile that dequantize-then-matmul dequantizes at a time: every projection
# of SmolLM2's but the head, its fused gate|up (7 MB) too, in one (a split one's column slices are
# copied into the output: at 4 MiB that copy was 3% of a 2048-token native prefill); each thread
# keeps one such scratch buffer (_scratch)
DEQUANT_TILE_BYTES = 8 << 20
_scratch = threading.local()
X16 = 16


def default_layout(fmt: str, act: str) -> str:
    """'x16' where (fmt, act) has that layout and the library's level (chosen now) runs a vector
    kernel for it, else 'rows'."""
    lib = library()
    fid = FORMAT_IDS.get((fmt, act, "x16"))
    return "x16" if fid is not None and lib is not None and lib.x16_vector(fid) else "rows"


def interleave(t: torch.Tensor, unit: int) -> torch.Tensor:
    """[N, C] (codes' bytes: unit 4; scales: unit 1) -> [ceil(N/16), C/unit, 16, unit], rows past N zero."""
    N, C = t.shape
    pad = -N % X16
    if pad:
        t = torch.cat([t, t.new_zeros(pad, C)])
    return t.reshape(-1, X16, C // unit, unit).transpose(1, 2).contiguous()


def deinterleave(t: torch.Tensor, N: int) -> torch.Tensor:
    """interleave's inverse: [G, C/unit, 16, unit] -> [N, C] (a new tensor)."""
    G, U, _, unit = t.shape
    return t.transpose(1, 2).reshape(G * X16, U * unit)[:N].contiguous()

# Candidate scales of the search (quant_gemv.c, quantize_blocks_best): f times the scale that
# maps a block's largest element onto the end code. f = 1 is llama.cpp's choice; larger f trade
# clipping nothing for a coarser step that may land on the values better.
SCALE_FACTORS = torch.linspace(0.5, 1.5, 101)


def quantize_blocks(w: torch.Tensor, qmin: int, qmax: int,
                    factors: torch.Tensor = SCALE_FACTORS) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (signed codes int8 [N, K] in [qmin, qmax], scales fp16 [N, K/32]): each
    32-block with the least-squares scale of the best candidate codes (quant_gemv.c explains)."""
    N, K = w.shape
    if K % QK:
        raise ValueError(f"quantized weights need in_features divisible by {QK}, got {K}")
    x = w.detach().float().contiguous()
    f = factors.float().contiguous()
    lib = library()
    if lib is None:
        codes, d = _quantize_blocks_eager(x.reshape(-1, QK), qmin, qmax, f)
    else:
        codes = torch.empty(N, K, dtype=torch.int8)
        d = torch.empty(N * K // QK)
        lib.quantize_blocks_best(x.data_ptr(), N * K // QK, qmin, qmax, f.data_ptr(), len(f), codes.data_ptr(),
                                 d.data_ptr(), torch.get_num_threads())
    return codes.reshape(N, K), d.reshape(N, K // QK).to(torch.float16)


def _quantize_blocks_eager(x: torch.Tensor, qmin: int, qmax: int, f: torch.Tensor,
                           chunk: int = 1 << 14) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_blocks_best in torch (no kernel library), chunk blocks at a time: x [nblocks, 32]."""
    codes, scales = [], []
    refs = (qmax,) if qmin == -qmax else (qmax, qmin)
    for xb in x.split(chunk):
        M = xb.gather(1, xb.abs().argmax(1, keepdim=True))                    # [n, 1] signed
        best = torch.full_like(M, -1.0)
        best_inv = torch.zeros_like(M)
        for qref in refs:
            for fi in f.tolist():
                inv = torch.where(M != 0, qref / (fi * M), torch.zeros_like(M))
                c = torch.round(xb * inv).clamp_(qmin, qmax)
                xc, cc = (xb * c).sum(1, keepdim=True), (c * c).sum(1, keepdim=True)
                score = torch.where(cc > 0, xc * xc / cc.clamp_min(1), torch.zeros_like(xc))
                better = score > best
                best, best_inv = torch.where(better, score, best), torch.where(better, inv, best_inv)
        c = torch.round(xb * best_inv).clamp_(qmin, qmax)
        cc = (c * c).sum(1, keepdim=True)
        scales.append(torch.where(cc > 0, (xb * c).sum(1, keepdim=True) / cc.clamp_min(1), torch.zeros_like(cc)))
        codes.append(c.to(torch.int8))
    return torch.cat(codes), torch.cat(scales)


def quantize_q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (codes int8 [N, K], scales fp16 [N, K/32]), as llama.cpp's quantize_row_q8_0:
    d = max|x| / 127 per block, q = round(x / d). The reference rule the searched scales of
    quantize_blocks (what quantize_model uses) are compared against."""
    N, K = w.shape
    if K % QK:
        raise ValueError(f"quantized weights need in_features divisible by {QK}, got {K}")
    codes, d = _block_codes(w.detach().float().reshape(N, K // QK, QK))
    q = codes.clamp_(-127, 127).to(torch.int8)
    return q.reshape(N, K).contiguous(), d.squeeze(-1).to(torch.float16).contiguous()


ACTIVATION_LEVELS = {"q8": 127, "i16": 32767}   # the kernels' activation codes: levels a side


def round_activations(x: torch.Tensor, act: str) -> torch.Tensor:
    """x [..., K] fp32 rounded to `act` blocks (32 codes, scale max|x| / levels) and back: the
    values the integer kernels multiply (quantize_rows in quant_gemv.c, q8 or int16 codes:
    the same codes and fp32 scales). The eager path of an act='q8' or 'i16' layer multiplies
    these, so a prompt's prefill, a batch of 17 rows and a machine without the kernels compute
    with the activations a decode step uses."""
    codes, d = _block_codes(x.reshape(*x.shape[:-1], -1, QK), ACTIVATION_LEVELS[act])
    return (codes * d).reshape(x.shape)


def _block_codes(blocks: torch.Tensor, levels: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks [..., QK] fp32 -> (codes as floats, scale [..., 1]): d = max|x| / levels, codes x / d
    rounded to nearest even (fp32 arithmetic throughout, as the C rule)."""
    d = blocks.abs().amax(-1, keepdim=True) / levels
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return torch.round(blocks * inv), d


def dequantize_q8_0(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    N, K = q.shape
    return (q.reshape(N, K // QK, QK).float() * d.float().unsqueeze(-1)).reshape(N, K)


def unpack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """codes uint8 [N, K/2] -> [N, K/32, 32] in 0..15 (per block: low nibbles are elements 0..15,
    high nibbles 16..31, ggml's layout)."""
    b = q.reshape(q.shape[0], -1, QK // 2)
    return torch.cat([b & 15, b >> 4], dim=-1)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """unpack_nibbles' inverse: [N, K] in 0..15 -> uint8 [N, K/2]."""
    b = codes.to(torch.uint8).reshape(codes.shape[0], -1, QK)
    return (b[..., :QK // 2] | (b[..., QK // 2:] << 4)).reshape(codes.shape[0], -1).contiguous()


def dequantize_q4_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    N = q.shape[0]
    return (unpack_nibbles(q).float() * d.float().unsqueeze(-1) + m.float().unsqueeze(-1)).reshape(N, -1)


def dequantize_q4_0(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    N = q.shape[0]
    return ((unpack_nibbles(q).float() - 8) * d.float().unsqueeze(-1)).reshape(N, -1)


def dequantize_stored(fmt: str, qs: torch.Tensor) -> torch.Tensor:
    """A stored format's blocks [N, row bytes] -> W [N, K] fp32 (quant_gemv.c's dequantize_rows, or
    gguf's numpy dequantization without the library: the same values)."""
    N = qs.shape[0]
    K = qs.shape[1] // STORED[fmt][1] * STORED[fmt][0]
    lib = library() if qs.is_cpu else None
    if lib is None:
        from gguf import GGMLQuantizationType, quants

        w = quants.dequantize(qs.cpu().numpy(), GGMLQuantizationType[fmt.upper()])
        return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).reshape(N, K).to(qs.device)
    qs = qs.contiguous()
    out = torch.empty(N, K)
    lib.dequantize_rows(DEQUANT_FORMATS[fmt], 0, qs.data_ptr(), None, None, 0, N, K, out.data_ptr(),
                        torch.get_num_threads() if N * K >= 1 << 16 else 1)
    return out


def gguf_blocks(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    """A GGUF tensor's raw bytes [N, bytes per row] -> this module's buffers (codes and scales)."""
    N, K = shape
    nb = K // QK
    if type_name.lower() in STORED:   # kept as the file's blocks, scales and all
        return {"qs": torch.from_numpy(np.ascontiguousarray(data, dtype=np.uint8).reshape(N, -1).copy())}
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(N, nb, -1)
    if type_name == "Q8_0":     # block: d fp16, 32 x int8
        d = raw[:, :, 0:2].copy().view(np.float16).reshape(N, nb)
        q = raw[:, :, 2:].copy().view(np.int8).reshape(N, K)
        return {"qs": torch.from_numpy(q), "d": torch.from_numpy(d)}
    if type_name == "Q4_0":     # block: d fp16, 16 bytes of nibbles
        d = raw[:, :, 0:2].copy().view(np.float16).reshape(N, nb)
        return {"qs": torch.from_numpy(raw[:, :, 2:].copy().reshape(N, K // 2)), "d": torch.from_numpy(d)}
    if type_name == "Q4_1":     # block: d fp16, m fp16, 16 bytes of nibbles
        d = raw[:, :, 0:2].copy().view(np.float16).reshape(N, nb)
        m = raw[:, :, 2:4].copy().view(np.float16).reshape(N, nb)
        q = raw[:, :, 4:].copy().reshape(N, K // 2)
        return {"qs": torch.from_numpy(q), "d": torch.from_numpy(d), "m": torch.from_numpy(m)}
    raise ValueError(f"GGUF type {type_name} has no kernel here (have Q8_0, Q4_0, Q4_1, "
                     f"{', '.join(f.upper() for f in STORED)})")


def q8_0_from_blocks(fmt: str, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """Q5_0 or Q4_0 blocks as Q8_0 ones with the same values (d (q - 16) and d (q - 8) are int8 codes on
    the same scale: exact), or None for another format: what a fused projection whose parts mix
    them with Q8_0 (Gemma 3's Q5_0 q, k beside a Q8_0 v) is held as."""
    if fmt == "q4_0":
        return {"qs": (unpack_nibbles(parts["qs"]).to(torch.int16) - 8).to(torch.int8).reshape(parts["qs"].shape[0], -1),
                "d": parts["d"]}
    if fmt != "q5_0":
        return None
    raw = parts["qs"]
    N = raw.shape[0]
    blk = raw.reshape(N, -1, 22)
    d = blk[:, :, 0:2].contiguous().view(torch.float16).reshape(N, -1)
    qh = blk[:, :, 2:6].to(torch.int64)
    bits = (qh[..., 0] | qh[..., 1] << 8 | qh[..., 2] << 16 | qh[..., 3] << 24).unsqueeze(-1)
    high = ((bits >> torch.arange(32)) & 1).to(torch.int16) << 4
    q = unpack_nibbles(blk[:, :, 6:].reshape(N, -1)).to(torch.int16) + high - 16
    return {"qs": q.to(torch.int8).reshape(N, -1), "d": d}


# --- the layer ------------------------------------------------------------------------------------

def quantize_rows_codes(rows: torch.Tensor, act: str = "q8") -> tuple[torch.Tensor, torch.Tensor] | None:
    """rows [M, K] fp32 contiguous -> (codes [M, K], scales fp32 [M, K/32]) by the decode kernels'
    rule (quant_gemv.c's quantize_activations_q8 / _i16): int8 q8 codes for act 'q8', int16 ones
    for 'i16'; None without their library."""
    qlib = library()
    if qlib is None:
        return None
    M, K = rows.shape
    xq = torch.empty(M, K, dtype=torch.int8 if act == "q8" else torch.int16)
    xd = torch.empty(M, K // QK)
    fn = qlib.quantize_activations_q8 if act == "q8" else qlib.quantize_activations_i16
    fn(rows.data_ptr(), M, K, xq.data_ptr(), xd.data_ptr())
    return xq, xd


class QuantLinear(nn.Module):
    """y = x @ W^T (+ bias) with W [out, in] held as quantized blocks.

    fmt 'q8_0' (codes int8 [N, K], d fp16), 'q4_0' (codes uint8 [N, K/2], d fp16) or 'q4_1'
    (codes uint8 [N, K/2], d and m fp16); act 'q8' rounds activations to q8_0 blocks on every path
    (the kernel's int8 dot products, llama.cpp's way: faster, but adds the activations' rounding);
    'i16' rounds them to int16 blocks (int16 dot products: ~256x less rounding than q8, q8_0 and
    q4_1 only); 'f32' multiplies them as they are, to fp32 rounding (q8_0 and q4_1 only; the
    kernels split each activation into two int16 codes, quant_gemv.c's ACT_SPLIT).
    `embedding(tokens)` reads rows of W, for a head tied to the embeddings.

    fmt 'q5_0', 'q5_1', 'q4_k', 'q5_k' or 'q6_k' (STORED) holds a GGUF tensor's own blocks, scales and
    all, as qs uint8 [N, row bytes] (d and m None), always row-major, with 'f32' or 'i16' activations
    (quant_gemv_kq.h); prefill multiplies them in the int16 GEMM ('i16', where the level has it:
    quant_gemm_i16.c), else dequantizes them a tile at a time.

    qs, d and m come row-major ([N, K or K/2], [N, K/32]); `layout` is how the layer holds them
    ('rows', or 'x16': row-interleaved for the decode kernels; None: default_layout). `row_major()`
    gives them back row-major whatever the layout, and state_dict() holds them so.
    """

    def __init__(self, fmt: str, qs: torch.Tensor, d: torch.Tensor | None, m: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, act: str = "f32", layout: str | None = None) -> None:
        super().__init__()
        stored = fmt in STORED
        if (fmt not in ("q8_0", "q4_0", "q4_1") and not stored) or act not in ("q8", "i16", "f32") \
                or (fmt == "q4_0" and act != "q8") or (stored and act == "q8"):
            raise ValueError(f"no kernel for weights {fmt} with {act} activations")
        if stored and (d is not None or m is not None or qs.dtype != torch.uint8 or qs.dim() != 2
                       or qs.shape[1] % STORED[fmt][1]):
            raise ValueError(f"weights {fmt} are the file's blocks: uint8 [N, a multiple of {STORED[fmt][1]}], "
                             "no d or m")
        if not stored and (m is None) != (fmt != "q4_1"):
            raise ValueError(f"weights {fmt} {'need' if fmt == 'q4_1' else 'have no'} block minimums")
        layout = default_layout(fmt, act) if layout is None else layout
        if layout not in LAYOUTS or (layout == "x16" and (fmt, act, layout) not in FORMAT_IDS):
            raise ValueError(f"no layout {layout!r} for weights {fmt} with {act} activations; "
                             f"use one of {', '.join(LAYOUTS)}")
        self.fmt, self.act, self.layout = fmt, act, layout
        self.out_features = qs.shape[0]
        self.in_features = (qs.shape[1] // STORED[fmt][1] * STORED[fmt][0] if stored
                            else qs.shape[1] * (1 if fmt == "q8_0" else 2))
        if self.in_features % QK:
            raise ValueError(f"quantized weights need in_features divisible by {QK}, got {self.in_features}")
        self.register_buffer("qs", None)
        self.register_buffer("d", None)
        self.register_buffer("m", None)
        self._hold(qs, d, m)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        self._register_state_dict_hook(_rows_in_state_dict)
        self._register_load_state_dict_pre_hook(_rows_from_state_dict, with_module=True)

    def _hold(self, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> None:
        """Keep row-major qs, d, m in this layer's layout (one copy: the row-major ones are dropped)."""
        if d is None:   # a stored format: rows only
            self.qs, self.d, self.m = qs.contiguous(), None, None
            return
        d = d.to(torch.float16)
        m = None if m is None else m.to(torch.float16)
        if self.layout == "x16":
            qs, d = interleave(qs, 4), interleave(d, 1).squeeze(-1)
            m = None if m is None else interleave(m, 1).squeeze(-1)
        self.qs, self.d = qs.contiguous(), d.contiguous()
        self.m = None if m is None else m.contiguous()

    def row_major(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(qs, d, m) row-major: the buffers themselves for 'rows', a fresh copy for 'x16'."""
        if self.layout == "rows":
            return self.qs, self.d, self.m
        N = self.out_features
        m = None if self.m is None else deinterleave(self.m.unsqueeze(-1), N)
        return deinterleave(self.qs, N), deinterleave(self.d.unsqueeze(-1), N), m

    def relayout(self, layout: str) -> QuantLinear:
        """Hold the codes in `layout` from now on ('rows' or 'x16'); returns self."""
        if layout != self.layout:
            if layout not in LAYOUTS or (layout == "x16" and (self.fmt, self.act, layout) not in FORMAT_IDS):
                raise ValueError(f"no layout {layout!r} for weights {self.fmt} with {self.act} activations")
            qs, d, m = self.row_major()
            self.layout = layout
            self._hold(qs, d, m)
        return self

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, act: str = "q8",
                   fmt: str = "q8_0") -> QuantLinear:
        """q8_0 or q4_0 blocks of a float weight [out, in], their scales searched (quantize_blocks)."""
        q, d = quantize_blocks(weight, *QUANTIZED[fmt])
        if fmt == "q4_0":
            q = pack_nibbles(q.to(torch.int16) + 8)
        return cls(fmt, q, d, bias=bias, act=act)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, fmt={self.fmt}, act={self.act}, layout={self.layout}"

    @property
    def weight_t(self) -> torch.Tensor:
        """W^T [in, out] dequantized: what code written for InputMajorLinear reads (a draft's tied
        embedding matrix, say). A fresh fp32 copy, so use it once, not per step."""
        return self.dequantized().t()

    def dequantized(self) -> torch.Tensor:
        """W [out, in] fp32 (the same values whichever path makes them, bit for bit)."""
        out = self._dequantize_rows(0, self.out_features)
        return self._dequantize(*self.row_major()) if out is None else out

    def c_readable(self) -> bool:
        """Whether the C kernels can read the held buffers as they are: on the CPU, contiguous, fp16
        scales (not after a module cast to fp32 ones)."""
        held = tuple(t for t in (self.qs, self.d, self.m) if t is not None)
        return all(t.is_cpu and t.is_contiguous() for t in held) and all(t.dtype == torch.float16 for t in held[1:])

    def _dequantize_rows(self, n0: int, n1: int, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Rows n0..n1-1 of W in one C pass from either layout (into `out`, [n1 - n0, in] fp32, if
        given), or None where the C kernels cannot read the buffers (not loaded, another device, a
        module cast to fp32 scales)."""
        if not self.c_readable():
            return None
        lib = library()
        if lib is None:
            return None
        K = self.in_features
        out = torch.empty(n1 - n0, K) if out is None else out
        lib.dequantize_rows(DEQUANT_FORMATS[self.fmt], self.layout == "x16", self.qs.data_ptr(),
                            None if self.d is None else self.d.data_ptr(),
                            None if self.m is None else self.m.data_ptr(), n0, n1, K, out.data_ptr(),
                            torch.get_num_threads() if (n1 - n0) * K >= 1 << 16 else 1)
        return out

    def _dequantized_product(self, rows: torch.Tensor) -> torch.Tensor | None:
        """rows [M, K] fp32 times W^T (+ bias) through caramba.gemm (oneDNN where it applies),
        W dequantized a tile at a time into a scratch buffer this thread reuses (DEQUANT_TILE_BYTES:
        it stays in cache, and no fresh pages are faulted in per call, which cost ~40% of
        dequantizing into new memory); None where the C kernels cannot read the weight."""
        N, K = self.out_features, self.in_features
        tile = max(1, min(N, DEQUANT_TILE_BYTES // (4 * K)))
        scratch = getattr(_scratch, "buf", None)
        if scratch is None or scratch.numel() < tile * K:
            scratch = _scratch.buf = torch.empty(max(tile * K, DEQUANT_TILE_BYTES // 4))
        if tile == N:
            w = self._dequantize_rows(0, N, scratch[: N * K].view(N, K))
            return None if w is None else gemm.dense(rows, w, self.bias)
        y = torch.empty(rows.shape[0], N)
        for n0 in range(0, N, tile):
            n1 = min(N, n0 + tile)
            w = self._dequantize_rows(n0, n1, scratch[: (n1 - n0) * K].view(n1 - n0, K))
            if w is None:
                return None
            y[:, n0:n1] = gemm.dense(rows, w, None if self.bias is None else self.bias[n0:n1])
        return y

    def _dequantize(self, qs: torch.Tensor, d: torch.Tensor | None, m: torch.Tensor | None) -> torch.Tensor:
        if self.fmt in STORED:
            return dequantize_stored(self.fmt, qs)
        if self.fmt == "q8_0":
            return dequantize_q8_0(qs, d)
        return dequantize_q4_0(qs, d) if self.fmt == "q4_0" else dequantize_q4_1(qs, d, m)

    def embedding(self, tokens: torch.Tensor) -> torch.Tensor:
        """Rows `tokens` of W, dequantized: [*tokens.shape, in_features]."""
        flat = tokens.reshape(-1)
        lib = library() if self.fmt == "q8_0" and flat.is_cpu and self.qs.is_cpu and flat.dtype == torch.int64 else None
        if lib is not None:
            flat = flat.contiguous()
            rows = torch.empty(flat.numel(), self.in_features)
            fn = lib.embed_rows_q8_0_x16 if self.layout == "x16" else lib.embed_rows_q8_0
            bad = fn(flat.data_ptr(), flat.numel(), self.qs.data_ptr(), self.d.data_ptr(),
                     self.out_features, self.in_features, rows.data_ptr())
            if bad:
                raise IndexError(f"token id {int(flat[bad - 1])} is outside the vocabulary 0..{self.out_features - 1}")
        else:   # as F.embedding does: a negative id is an error here too, not a row from the end
            if flat.is_cpu and flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.out_features):
                raise IndexError(f"a token id is outside the vocabulary 0..{self.out_features - 1}")
            rows = self._dequantize(*self._gather(flat))
        return rows.view(*tokens.shape, self.in_features)

    def _gather(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Row-major (qs, d, m) of rows ids [n] of W."""
        if self.layout == "rows":
            return self.qs[ids], None if self.d is None else self.d[ids], None if self.m is None else self.m[ids]
        g, lane = ids // X16, ids % X16
        qs = self.qs[g, :, lane, :].reshape(len(ids), -1)
        return qs, self.d[g, :, lane], None if self.m is None else self.m[g, :, lane]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The decode-step path first, with as few torch ops as possible: at batch 1 each op's
        # dispatch costs about as much as the GEMV of a narrow projection.
        if (x.is_cpu and x.dtype == torch.float32 and x.is_contiguous() and x.shape[-1] == self.in_features
                and (self.d is None or self.d.dtype == torch.float16)
                and not (x.requires_grad and torch.is_grad_enabled())):
            M = x.numel() // self.in_features
            lib = library() if M <= KERNEL_ROWS else None
            if lib is not None:
                return self._kernel(lib, x, M)
        shape = x.shape
        rows = x.reshape(-1, self.in_features).to(torch.float32)
        if rows.is_cpu and not (rows.requires_grad and torch.is_grad_enabled()):
            # Prefill-sized: the codes in an int8 GEMM (q8 activations), an int16 one (i16) or AMX-BF16
            # (fp32) where the CPU has one
            y = self._gemm(rows.contiguous())
            if y is not None:
                return y.to(x.dtype).view(*shape[:-1], self.out_features)
        if self.act in ACTIVATION_LEVELS:
            rows = round_activations(rows, self.act)
        # the scratch tiles are overwritten by the next call: not for a product autograd keeps
        keep = rows.requires_grad and torch.is_grad_enabled()
        y = self._dequantized_product(rows) if rows.is_cpu and not keep else None
        if y is None:
            y = F.linear(rows, self.dequantized().to(x.device), self.bias)
        return y.to(x.dtype).view(*shape[:-1], self.out_features)

    def _gemm(self, rows: torch.Tensor) -> torch.Tensor | None:
        """rows [M, K] fp32 (contiguous, CPU) times this layer's weight^T (+ bias) in caramba.model.quant_gemm,
        or None where no GEMM here applies (no library, no int8 level for q8 activations, no
        avx512vnni level for int16 ones, no AMX-BF16 for fp32 ones): forward then dequantizes and
        calls torch."""
        if not self.c_readable():
            return None
        lib = quant_gemm.library()
        if lib is None:
            return None
        out = self._codes_product(lib, rows)
        if out is not None and self.bias is not None:
            out += self.bias
        return out

    def _codes_product(self, lib: ctypes.CDLL, rows: torch.Tensor) -> torch.Tensor | None:
        """_gemm's product, bias aside: the GEMM that multiplies this layer's codes with rows."""
        # int16 codes (native_i16) in the int16 GEMM, any format, where the level has it (AMX
        # machines keep AMX-BF16 for q8_0 / q4_1 below: which is faster there is not measured)
        if self.act == "i16" and quant_gemm.i16_runs(self.fmt) and (self.fmt in STORED or not lib.gemm_f32_available()):
            q = quantize_rows_codes(rows, "i16")
            return None if q is None else quant_gemm.gemm_i16(self.fmt, *q, self.qs, self.d, self.m, self.out_features,
                                                              x16=self.layout == "x16")
        if self.fmt in STORED:   # no other GEMM reads them: dequantized tiles
            return None
        int8 = self.act == "q8" and self.fmt in quant_gemm.INT8_FORMATS
        if not (lib.gemm_q8_runs(quant_gemm.FORMATS[self.fmt]) if int8 else lib.gemm_f32_available()):
            return None
        if int8:   # the int8 GEMM reads either layout in place
            q = quantize_rows_codes(rows, "q8")
            return None if q is None else quant_gemm.gemm(self.fmt, *q, self.qs, self.d, self.out_features,
                                                          x16=self.layout == "x16")
        # AMX-BF16 reads row-major codes: an x16 layer's are made for the call (one weight's
        # bytes, freed after; a prompt's rows outweigh the copy by far)
        qs, d, m = self.row_major()
        if self.act != "f32":   # q4_1 with q8 or int16 codes: the values those kernels multiply
            rows = round_activations(rows, self.act).contiguous()
        return quant_gemm.gemm_f32(self.fmt, rows, qs, d, m, self.out_features)

    def _kernel(self, lib: ctypes.CDLL, x: torch.Tensor, M: int) -> torch.Tensor:
        N, K = self.out_features, self.in_features
        out = torch.empty(x.shape[:-1] + (N,))
        # Below ~64k weights a thread hand-off costs more than it saves.
        threads = torch.get_num_threads() if N * K >= 1 << 16 else 1
        if self.fmt in STORED:
            failed = lib.gemv_kq(FORMAT_IDS[(self.fmt, self.act, "rows")], x.data_ptr(), self.qs.data_ptr(),
                                 out.data_ptr(), M, N, K, threads)
        elif self.layout == "x16":
            failed = lib.gemv_x16(FORMAT_IDS[(self.fmt, self.act, "x16")], x.data_ptr(), self.qs.data_ptr(),
                                  self.d.data_ptr(), None if self.m is None else self.m.data_ptr(), out.data_ptr(),
                                  M, N, K, threads)
        elif self.fmt == "q8_0":
            fn = getattr(lib, f"gemv_q8_0_{self.act}")
            failed = fn(x.data_ptr(), self.qs.data_ptr(), self.d.data_ptr(), out.data_ptr(), M, N, K, threads)
        else:
            fn = getattr(lib, f"gemv_q4_1_{self.act}")     # q4_0 (act q8 only): no minimums
            failed = fn(x.data_ptr(), self.qs.data_ptr(), self.d.data_ptr(), None if self.m is None else self.m.data_ptr(), out.data_ptr(),
                        M, N, K, threads)
        if failed:
            raise MemoryError("quantized GEMV could not allocate its activation buffer")
        if self.bias is not None:
            out += self.bias
        return out


def _rows_in_state_dict(module: QuantLinear, state: dict, prefix: str, local_metadata) -> None:
    """state_dict() holds the codes row-major, whatever the layout: a saved model loads on any machine."""
    if module.layout != "rows":
        qs, d, m = module.row_major()
        state[prefix + "qs"], state[prefix + "d"] = qs, d
        if m is not None:
            state[prefix + "m"] = m


def _rows_from_state_dict(module: QuantLinear, state: dict, prefix: str, *_args) -> None:
    """load_state_dict() takes row-major codes (state_dict's) into the layer's layout."""
    if module.layout != "rows" and (prefix + "qs") in state and state[prefix + "qs"].dim() == 2:
        m = state.get(prefix + "m")
        qs, d = interleave(state[prefix + "qs"], 4), interleave(state[prefix + "d"].to(torch.float16), 1).squeeze(-1)
        state[prefix + "qs"], state[prefix + "d"] = qs, d
        if m is not None:
            state[prefix + "m"] = interleave(m.to(torch.float16), 1).squeeze(-1)


def relayout(model: nn.Module, layout: str | None = None) -> int:
    """Every QuantLinear of `model` held in `layout` (None: default_layout's choice for each, 'rows'
    where it has no x16 kernel); returns how many changed."""
    changed = 0
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            want = default_layout(mod.fmt, mod.act) if layout is None else layout
            if want == "x16" and (mod.fmt, mod.act, "x16") not in FORMAT_IDS:
                want = "rows"
            if want != mod.layout:
                mod.relayout(want)
                changed += 1
    return changed


# --- whole models ---------------------------------------------------------------------------------

def _float_weight(module: nn.Module) -> torch.Tensor | None:
    """[out, in] of an nn.Linear or an InputMajorLinear-like module, else None."""
    if isinstance(module, nn.Linear):
        return module.weight
    if isinstance(getattr(module, "weight_t", None), torch.Tensor) and not isinstance(module, QuantLinear):
        return module.weight_t.t()
    return None


def quantize_model(model: nn.Module, fmt: str = "q8_0", act: str = "q8") -> int:
    """Replace every projection of `model` (nn.Linear and InputMajorLinear: q|k|v, o, the MLP's, the
    head) whose input width divides into 32-blocks by a `fmt` (q8_0 or q4_0) QuantLinear; the head
    stays q8_0 under q4_0, as llama.cpp keeps its output matrix at higher precision (a 4-bit head
    costs most of a small model's quality). Returns how many."""
    head = getattr(model, "head", None)
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            w = _float_weight(child)
            if w is not None and w.shape[1] % QK == 0:
                kind = "q8_0" if child is head else fmt
                setattr(parent, name, QuantLinear.from_float(w, getattr(child, "bias", None), act=act, fmt=kind))
                count += 1
    return count


def native_from_gguf(model: nn.Module, reader, cfg, act: str = "f32") -> int:
    """Swap in a GGUF's own blocks for the projections and the head of a Llama/Qwen2/Gemma 3 `model`
    loaded from that file (rows unpermuted and fused exactly as the fp32 loader does): Q8_0 and Q4_1
    as QuantLinear's codes, Q5_1, Q4_K, Q5_K and Q6_K as the file's blocks (STORED). A projection
    of Q5_0 or Q4_0 blocks (or mixing them with Q8_0: Gemma 3's q, k beside its v) is held as Q8_0
    with the same values, for speed; a part of any other type (F32, F16, Q2_K, IQ*, ...) keeps
    the projection's fp32 weights, whose values are the file's too. `act`: the activations'
    precision ('f32' or 'i16', QuantLinear). Returns how many were swapped; `model.native_weights`
    says what became of each GGUF tensor (kept: counts by type; as_q8_0: names held as exact Q8_0;
    dequantized: quantized tensors without a kernel here, by name, with their type; unquantized:
    float tensors, by name), for the run's record."""
    tensors = {t.name: t for t in reader.tensors}
    kernels = ("Q8_0", "Q4_1", "Q4_0", *(f.upper() for f in STORED))
    report: dict = {"kept": {}, "as_q8_0": [], "dequantized": {}, "unquantized": []}

    def blocks(name: str, heads: int | None = None) -> tuple[str, dict[str, torch.Tensor]] | None:
        t = tensors.get(name)
        if t is None or t.tensor_type.name not in kernels or len(t.shape) != 2:
            return None
        K, N = (int(v) for v in t.shape)      # gguf lists ne0 (the row length) first
        if K % QK:
            return None
        parts = gguf_blocks(np.asarray(t.data), t.tensor_type.name, (N, K))
        if heads is not None and cfg.name == "llama":   # undo llama.cpp's q/k row permutation
            parts = {k: gguf_loader.unpermute_rows(v, heads) for k, v in parts.items()}
        return t.tensor_type.name, parts

    def fused(names: list[tuple[str, int | None]], bias: torch.Tensor | None) -> QuantLinear | None:
        got = [blocks(n, h) for n, h in names]
        if any(g is None for g in got):
            for n, _ in names:
                t = tensors.get(n)
                if t is None:
                    continue
                kind = t.tensor_type.name
                if kind in ("F32", "F16", "BF16", "F64"):
                    report["unquantized"].append(n)
                else:
                    report["dequantized"][n] = kind
            return None
        types = {g[0] for g in got}
        # Q4_0 and Q5_0 are held as Q8_0 with the same values: the Q8_0 x16 kernels decode them
        # about 3x faster than the Q5_0 row kernel (SmolLM2 Q4_K_M, Zen 4, 1 thread: 56 -> 102 tok/s,
        # llama.cpp 100), at 34 bytes per 32 weights instead of 22 (docs/decode-speed-log.md §18)
        if len(types) > 1 or types & {"Q4_0", "Q5_0"}:
            as_q8 = [g[1] if g[0] == "Q8_0" else q8_0_from_blocks(g[0].lower(), g[1]) for g in got]
            if any(p is None for p in as_q8):
                report["dequantized"].update({n: g[0] for (n, _), g in zip(names, got)})
                return None
            report["as_q8_0"] += [n for (n, _), g in zip(names, got) if g[0] != "Q8_0"]
            report["kept"]["Q8_0"] = report["kept"].get("Q8_0", 0) + sum(g[0] == "Q8_0" for g in got)
            got = [("Q8_0", p) for p in as_q8]
        else:
            report["kept"][got[0][0]] = report["kept"].get(got[0][0], 0) + len(got)
        fmt = got[0][0].lower()
        cat = {k: torch.cat([g[1][k] for g in got]) for k in got[0][1]}
        return QuantLinear(fmt, cat["qs"], cat.get("d"), cat.get("m"), bias=bias, act=act)

    swaps = 0

    def swap(parent: nn.Module, attr: str, new: QuantLinear | None) -> None:
        nonlocal swaps
        if new is not None:
            setattr(parent, attr, new)
            swaps += 1

    for i, layer in enumerate(model.layers):
        p, attn, mlp = f"blk.{i}.", layer.attn, layer.mlp
        swap(attn, "wqkv", fused([(p + "attn_q.weight", cfg.n_heads), (p + "attn_k.weight", cfg.n_kv_heads),
                                  (p + "attn_v.weight", None)], attn.wqkv.bias))
        swap(attn, "wo", fused([(p + "attn_output.weight", None)], attn.wo.bias))
        swap(mlp, "w13", fused([(p + "ffn_gate.weight", None), (p + "ffn_up.weight", None)], None))
        swap(mlp, "w2", fused([(p + "ffn_down.weight", None)], None))
    swap(model, "head", fused([("token_embd.weight" if cfg.tie_embeddings else "output.weight", None)], None))
    model.native_weights = report
    return swaps
