"""Symmetric per-token block quantization of the KV cache: q8_0, q4_0 and nf4.

A block is `block` consecutive elements of one head's vector ([..., head_dim] -> [..., nb, block]),
so a block never spans two heads. Scales are computed in float32, rounded UP to fp16 (so no
value clips) and the codes are computed with the stored fp16 scale: dequantization uses exactly
the scale the codes were made with.

Uniform kinds are mid-rise quantizers symmetric about zero: code c stands for (c + 1/2) * scale
(q8_0, c in [-128, 127], scale = absmax/127.5) or (u - 7.5) * scale (q4_0, u in [0, 15], scale =
absmax/7.5). Both extremes +-absmax are exact, every one of the 2^bits levels is used, and every
element's error is at most scale/2. (llama.cpp's q4_0 steps by absmax/8 with levels -8..7 and
clips the opposite sign's extreme to +7: an error up to a full step there. Zero is not a level
here, which costs nothing for K and V vectors.)
"""

from __future__ import annotations

import torch

from caramba.cache.kinds import KVCacheKind

# QLoRA's NormalFloat-4 codebook (Dettmers et al. 2023, bitsandbytes), ascending.
NF4_CODEBOOK = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230850219727, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
])
_NF4_MIDPOINTS = (NF4_CODEBOOK[1:] + NF4_CODEBOOK[:-1]) / 2
HALF_RANGE = {KVCacheKind.Q8_0: 127.5, KVCacheKind.Q4_0: 7.5, KVCacheKind.NF4: 1.0}


def quantize(x: torch.Tensor, kind: KVCacheKind, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> codes [..., D] int8 (q8_0) or [..., D/2] uint8 (4-bit, two per byte),
    scales [..., D/block] fp16."""
    xb = x.float().unflatten(-1, (-1, block))                      # [..., nb, block]
    # Nearest-rounding to fp16 moves a value by <= 2^-11 relative; scaling by 1 + 2^-10 first
    # lands at or above the exact scale, so |x| / scale never leaves the code range.
    scales = (xb.abs().amax(-1) * ((1 + 2**-10) / HALF_RANGE[kind])).to(torch.float16)   # [..., nb]
    y = xb / scales.float().clamp_min(1e-30).unsqueeze(-1)         # an all-zero block gets codes 0
    if kind is KVCacheKind.Q8_0:
        return y.floor_().clamp_(-128, 127).to(torch.int8).flatten(-2), scales
    if kind is KVCacheKind.Q4_0:
        u = (y + 8).floor_().clamp_(0, 15).to(torch.uint8)        # [0, 15]
    elif kind is KVCacheKind.NF4:
        u = torch.bucketize(y.contiguous(), _NF4_MIDPOINTS.to(y.device)).to(torch.uint8)  # nearest code
    else:
        raise ValueError(f"{kind.value} is not a quantized kind")
    return pack_nibbles(u.flatten(-2)), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, kind: KVCacheKind, block: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of quantize: [..., D] in dtype."""
    values = code_values(codes, kind, dtype)                       # [..., D] unscaled
    return (values.unflatten(-1, (-1, block)) * scales.to(dtype).unsqueeze(-1)).flatten(-2)


def code_values(codes: torch.Tensor, kind: KVCacheKind, dtype: torch.dtype) -> torch.Tensor:
    """The value each code stands for, before the block scale."""
    if kind is KVCacheKind.Q8_0:
        return codes.to(dtype) + 0.5
    u = unpack_nibbles(codes)
    if kind is KVCacheKind.Q4_0:
        return u.to(dtype) - 7.5
    return NF4_CODEBOOK.to(device=codes.device, dtype=dtype)[u.long()]


def pack_nibbles(u: torch.Tensor) -> torch.Tensor:
    """[..., D] values in [0, 15] -> [..., D/2] bytes: element i in the low nibble of byte i,
    element i + D/2 in its high nibble (unpacking is then two whole-tensor ops and a cat)."""
    half = u.shape[-1] // 2
    return u[..., :half] | (u[..., half:] << 4)


def unpack_nibbles(packed: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """[..., D/2] bytes -> [..., D] values in [0, 15] (along `dim`)."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=dim)
