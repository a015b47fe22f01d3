"""One cached stream (K or V) of one layer: [batch, heads, max_seq_len, head_dim] slots.

`FloatStream` keeps the values in fp32/fp16/bf16. `QuantStream` keeps codes and fp16 scales
(caramba.cache.quant, laid out as the kind's spec says) plus, optionally, the newest
`residual_len` tokens in full precision in a ring buffer indexed by position % residual_len.
"""

from __future__ import annotations

import torch

from caramba.cache.kinds import SCALE_DTYPE, KVCacheTensorConfig
from caramba.cache.quant import dequantize, quantize


class FloatStream:
    quantized = False

    def __init__(self, B: int, H: int, S: int, D: int, cfg: KVCacheTensorConfig, device, dtype: torch.dtype) -> None:
        self.cfg, self.n_heads, self.head_dim = cfg, H, D
        self.data = torch.zeros(B, H, S, D, dtype=cfg.dtype, device=device)

    def write(self, start: int, x: torch.Tensor) -> None:
        self.data[:, :, start : start + x.shape[2]] = x

    def read(self, end: int, dtype: torch.dtype) -> torch.Tensor:
        return self.data[:, :, :end].to(dtype)

    def reset(self) -> None:
        pass

    def reorder(self, index: torch.Tensor) -> None:
        self.data = self.data.index_select(0, index)

    def tensors(self) -> list[torch.Tensor]:
        return [self.data]


class QuantStream:
    """Codes + fp16 block scales [B, H, nb, S]. With `keys_major` the codes are stored
    [B, H, D_codes, S] (the layout q @ K^T streams through row by row), otherwise [B, H, S, D_codes]
    (the layout p @ V wants). Scales are position-major either way: they multiply score rows."""

    quantized = True

    def __init__(self, B: int, H: int, S: int, D: int, cfg: KVCacheTensorConfig, device, dtype: torch.dtype,
                 keys_major: bool = False) -> None:
        self.cfg, self.n_heads, self.head_dim = cfg, H, D
        self.kind, self.block, self.R = cfg.kind, cfg.block_for(D), cfg.residual_len
        self.spec = cfg.kind.spec   # resolved once: write and read paths take it as is
        self.nb, self.keys_major = D // self.block, keys_major
        code_width = self.spec.code_width(D)
        shape = (B, H, code_width, S) if keys_major else (B, H, S, code_width)
        self.codes = torch.zeros(shape, dtype=self.spec.dtype, device=device)
        self.scales = torch.zeros(B, H, self.nb, S, dtype=SCALE_DTYPE, device=device)
        # Full-precision copies of the newest tokens: slot p % R holds position p.
        self.ring = torch.zeros(B, H, self.R, D, dtype=dtype, device=device) if self.R else None
        self.fp_lo = 0  # positions >= fp_lo (and < the length) still have their ring copy intact

    def write(self, start: int, x: torch.Tensor, quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Store x [B, H, T, D] at [start, start + T); `quantized`: its (codes, scales), if already made."""
        end = start + x.shape[2]
        codes, scales = quantized or quantize(x, self.spec, self.block)   # [B, H, T, Dc], [B, H, T, nb]
        if self.keys_major:
            self.codes[..., start:end] = codes.transpose(-1, -2)
        else:
            self.codes[:, :, start:end] = codes
        self.scales[..., start:end] = scales.transpose(-1, -2)
        if self.R:
            n = min(x.shape[2], self.R)
            slots = torch.arange(end - n, end, device=x.device) % self.R
            self.ring[:, :, slots] = x[:, :, -n:].to(self.ring.dtype)
            # Writing [start, end) re-validates it and overwrites the ring slots of positions < end - R.
            self.fp_lo = max(min(self.fp_lo, start), end - self.R)

    def fp_start(self, end: int) -> int:
        """Positions [fp_start, end) are read from the full-precision ring, the rest from codes."""
        return max(self.fp_lo, end - self.R, 0) if self.R else end

    def code_slice(self, s0: int, s1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes (in the storage layout) and scales [B, H, nb, n] of positions [s0, s1)."""
        codes = self.codes[..., s0:s1] if self.keys_major else self.codes[:, :, s0:s1]
        return codes, self.scales[..., s0:s1]

    def dequant(self, s0: int, s1: int, dtype: torch.dtype) -> torch.Tensor:
        """Positions [s0, s1) from the codes: [B, H, s1 - s0, D]."""
        codes, scales = self.code_slice(s0, s1)
        if self.keys_major:
            codes = codes.transpose(-1, -2)
        return dequantize(codes, scales.transpose(-1, -2), self.spec, self.block, dtype)

    def residual(self, r0: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """Positions [r0, end) from the ring: [B, H, end - r0, D]."""
        slots = torch.arange(r0, end, device=self.codes.device) % self.R
        return self.ring[:, :, slots].to(dtype)

    def read(self, end: int, dtype: torch.dtype) -> torch.Tensor:
        r0 = self.fp_start(end)
        x = self.dequant(0, r0, dtype)
        return torch.cat([x, self.residual(r0, end, dtype)], dim=2) if r0 < end else x

    def reset(self) -> None:
        self.fp_lo = 0

    def reorder(self, index: torch.Tensor) -> None:
        self.codes = self.codes.index_select(0, index)
        self.scales = self.scales.index_select(0, index)
        if self.ring is not None:
            self.ring = self.ring.index_select(0, index)

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.scales] + ([self.ring] if self.ring is not None else [])


def make_stream(B: int, H: int, S: int, D: int, cfg: KVCacheTensorConfig, device, dtype: torch.dtype,
                keys_major: bool = False):
    if cfg.quantized:
        return QuantStream(B, H, S, D, cfg, device, dtype, keys_major)
    return FloatStream(B, H, S, D, cfg, device, dtype)
