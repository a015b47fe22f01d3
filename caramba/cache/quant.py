"""Symmetric per-token block quantization of the KV cache: every quantized kind of the table
(caramba.cache.kinds), read from its spec: q8_0, q4_0 and nf4 today.

A block is `block` consecutive elements of one head's vector ([..., head_dim] -> [..., nb, block]),
so a block never spans two heads. Scales are computed in float32, rounded UP to fp16 (so no
value clips) and the codes are computed with the stored fp16 scale: dequantization uses exactly
the scale the codes were made with.

Uniform kinds are mid-rise quantizers symmetric about zero: code c stands for (c + 1/2) * scale
(q8_0, c in [-128, 127], scale = absmax/127.5) or (u - 7.5) * scale (q4_0, u in [0, 15], scale =
absmax/7.5). Both extremes +-absmax are exact, every one of the 2^bits levels is used, and every
element's error is at most scale/2. (llama.cpp's q4_0 steps by absmax/8 with levels -8..7 and
clips the opposite sign's extreme to +7: an error up to a full step there. Zero is not a level
here.) `q4_0l` is llama.cpp's: mid-tread, zero a level (see caramba.cache.kinds); measured
better on SmolLM2's K and V (docs/kv-cache.md).
"""

from __future__ import annotations

import torch

from caramba.cache import kernel
from caramba.cache.kinds import KindSpec, KVCacheKind, spec_of

NF4_CODEBOOK = KVCacheKind.NF4.spec.levels   # float32 [16], ascending


def quantize(x: torch.Tensor, kind: KVCacheKind | KindSpec | str, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> codes [..., D] (8-bit kinds) or [..., D / per_byte] uint8 (4-bit: two per
    byte, 2-bit: four), block parameters [..., D/block * params] fp16: the scales, then (zero-point
    kinds) the minimums."""
    spec = spec_of(kind)
    if not spec.quantized:
        raise ValueError(f"{spec.name} is not a quantized kind")
    # kv_stream.c's quantizer gives the same bits faster (x [8, 3, 1024, 64], block 32, Zen 4, ms at
    # 2 / 1 threads, C vs torch): nf4 2.7 / 5.2 vs 18.7 / 36.8 (torch's bucketize, a binary search per
    # element), the packed uniform kinds 1.2-1.5 / 1.9-2.9 vs 5.4-9.0 / 4.2-6.8 (its AVX2 blocks; the
    # packing is a pass more in torch); q8_0, unpacked, 0.8 / 1.7 vs 1.0 / 1.4: torch's.
    fast = kernel.quantize_rows(x, spec, block) if spec.packed else None
    return fast if fast is not None else quantize_reference(x, spec, block)


def quantize_reference(x: torch.Tensor, kind: KVCacheKind | KindSpec | str, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize in torch's ops: the reference the C quantizers are held to, and every device's path."""
    spec = spec_of(kind)
    codes, params = _block_codes(x.float().unflatten(-1, (-1, block)), spec)   # [..., nb, block], [..., nb * p]
    codes = codes.flatten(-2)
    return (pack_codes(codes, spec.bits) if spec.packed else codes), params


def _round_down_fp16(x: torch.Tensor) -> torch.Tensor:
    """x as fp16, rounded toward -inf (so a block's minimum never rises above its elements)."""
    h = x.to(torch.float16)
    return torch.where(h.float() > x, torch.nextafter(h, torch.full_like(h, float("-inf"))), h)


def _block_codes(xb: torch.Tensor, spec: KindSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Float blocks xb [..., nb, block] -> unpacked codes [..., nb, block] (spec.dtype) and the
    fp16 block parameters [..., nb * params]."""
    if spec.zero_point:
        # + 0: an extreme of zero is +0 (which zero a reduction meets first is its order's: the C
        # quantizers' and other CPUs' differ)
        mins = _round_down_fp16(xb.amin(-1) + 0.0)
        # Rounded up so that min + hi * scale >= max: no element clips.
        scales = ((xb.amax(-1) + 0.0 - mins.float()) * ((1 + 2**-10) / spec.half_range)).to(torch.float16)
        safe = scales.float()
        safe = torch.where(safe == 0, torch.full_like(safe, 1e-30), safe)
        y = (xb - mins.float().unsqueeze(-1)) / safe.unsqueeze(-1)
        codes = (y + 0.5).floor_().clamp_(*spec.code_range).to(spec.dtype)
        return codes, torch.cat([scales, mins], dim=-1)
    if spec.mid_tread:   # signed: the largest-magnitude element lands on the lowest code, exactly
        peak = xb.gather(-1, xb.abs().argmax(-1, keepdim=True))[..., 0]
        scales = (peak * (-(1 + 2**-10) / spec.half_range)).to(torch.float16)
    else:
        # Nearest-rounding to fp16 moves a value by <= 2^-11 relative; scaling by 1 + 2^-10 first
        # lands at or above the exact scale, so |x| / scale never leaves the code range.
        scales = (xb.abs().amax(-1) * ((1 + 2**-10) / spec.half_range)).to(torch.float16)   # [..., nb]
    # An all-zero block gets codes 0 (mid-rise) or the zero level (mid-tread).
    safe = scales.float()
    safe = torch.where(safe == 0, torch.full_like(safe, 1e-30), safe)
    y = xb / safe.unsqueeze(-1)
    if spec.levels is None:    # uniform levels: the nearest is floor(y + shift), clamped for rounding
        if spec.shift:
            y = y + spec.shift
        codes = y.floor_().clamp_(*spec.code_range).to(spec.dtype)
    else:                      # a codebook: the nearest level
        codes = torch.bucketize(y.contiguous(), spec.midpoints.to(y.device)).to(spec.dtype)
    return codes, scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, kind: KVCacheKind | KindSpec | str, block: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of quantize: [..., D] in dtype."""
    spec = spec_of(kind)
    values = code_values(codes, spec, dtype).unflatten(-1, (-1, block))      # [..., nb, block] unscaled
    if spec.zero_point:
        s, m = scales.to(dtype).chunk(2, dim=-1)
        return (values * s.unsqueeze(-1) + m.unsqueeze(-1)).flatten(-2)
    return (values * scales.to(dtype).unsqueeze(-1)).flatten(-2)


def quantize_channels(x: torch.Tensor, kind: KVCacheKind | KindSpec | str, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (KIVI keys): x [..., T, D] with T a multiple of `group` -> codes [..., T, D /
    per_byte] (packed along D like quantize's) and parameters [..., T/group, D * params] fp16:
    each block is `group` consecutive tokens of one channel."""
    spec = spec_of(kind)
    T = x.shape[-2]
    if T % group:
        raise ValueError(f"{T} tokens do not fill groups of {group}")
    xg = x.float().unflatten(-2, (T // group, group)).transpose(-1, -2)       # [..., ng, D, group]
    codes, params = _block_codes(xg, spec)                                     # [..., ng, D, group], [..., ng, D*p]
    codes = codes.transpose(-1, -2).flatten(-3, -2)                            # [..., T, D]
    return (pack_codes(codes, spec.bits) if spec.packed else codes), params


def dequantize_channels(codes: torch.Tensor, params: torch.Tensor, kind: KVCacheKind | KindSpec | str, group: int,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of quantize_channels: [..., T, D] in dtype."""
    spec = spec_of(kind)
    values = code_values(codes, spec, dtype)                                   # [..., T, D]
    T, D = values.shape[-2:]
    p = params.to(dtype).unflatten(-1, (spec.params, D)).repeat_interleave(group, dim=-3)   # [..., T, params, D]
    if spec.zero_point:
        return values * p[..., 0, :] + p[..., 1, :]
    return values * p[..., 0, :]


def code_values(codes: torch.Tensor, kind: KVCacheKind | KindSpec | str, dtype: torch.dtype) -> torch.Tensor:
    """The value each code stands for, before the block scale (and minimum)."""
    spec = spec_of(kind)
    u = unpack_codes(codes, spec.bits) if spec.packed else codes
    if spec.levels is not None:
        return spec.levels.to(device=codes.device, dtype=dtype)[u.long()]
    return u.to(dtype) + spec.offset


def pack_codes(u: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., D] codes of `bits` (4 or 2) -> [..., D * bits / 8] bytes: with k = 8 / bits codes
    per byte, element i + j * D/k sits in bit field j of byte i (4-bit: pack_nibbles)."""
    if bits == 4:
        return pack_nibbles(u)
    k = 8 // bits
    parts = u.chunk(k, dim=-1)
    out = parts[0].clone()
    for j in range(1, k):
        out |= parts[j] << (bits * j)
    return out


def unpack_codes(packed: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """Inverse of pack_codes (along `dim`)."""
    if bits == 4:
        return unpack_nibbles(packed, dim)
    mask = (1 << bits) - 1
    return torch.cat([(packed >> (bits * j)) & mask for j in range(8 // bits)], dim=dim)


def pack_nibbles(u: torch.Tensor) -> torch.Tensor:
    """[..., D] values in [0, 15] -> [..., D/2] bytes: element i in the low nibble of byte i,
    element i + D/2 in its high nibble (unpacking is then two whole-tensor ops and a cat)."""
    half = u.shape[-1] // 2
    return u[..., :half] | (u[..., half:] << 4)


def unpack_nibbles(packed: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """[..., D/2] bytes -> [..., D] values in [0, 15] (along `dim`)."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=dim)
