"""One cached stream (K or V) of one layer: [batch, heads, max_seq_len, head_dim] slots.

`FloatStream` keeps the values in fp32/fp16/bf16. `QuantStream` keeps codes and fp16 scales
(caramba.cache.quant, laid out as the kind's spec says) plus, optionally, the newest
`residual_len` tokens in full precision in a ring buffer indexed by position % residual_len.
"""

from __future__ import annotations

import torch

from caramba.cache.kinds import SCALE_DTYPE, KVCacheTensorConfig
from caramba.cache.quant import dequantize, dequantize_channels, quantize, quantize_channels


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
    """Codes + fp16 block scales [B, H, nb, S] (zero-point kinds: then the minimums, [B, H, 2 nb, S]). With `keys_major` the codes are stored
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
        self.scales = torch.zeros(B, H, self.nb * self.spec.params, S, dtype=SCALE_DTYPE, device=device)
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
            self.note_written(start, end)

    def note_written(self, start: int, end: int) -> None:
        """The ring's bookkeeping after [start, end) was written (here, or by the C decode step,
        caramba.model.fast_decode): it re-validates those positions and overwrote the ring slots of
        positions < end - R."""
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


class ChannelQuantStream(QuantStream):
    """A per-channel kind (KIVI's keys): a block is G = qblock consecutive tokens of one channel.

    Group g covers positions [g G, (g + 1) G) and is quantized once all of them are written; until
    then they live in full precision in a ring of 2G + residual_len slots (slot p % size), the
    residual window included, and are read from there. Codes are stored like QuantStream's
    (packed along the head dim); parameters are [B, H, D * params, S // G] (a trailing partial
    group of max_seq_len stays in the ring). A rollback (`truncate`) into a group that was
    already quantized re-reads the group's surviving positions from the ring while it still holds
    them (up to G + residual_len positions back), otherwise from their codes, which are then
    quantized a second time when the group completes again.
    """

    def __init__(self, B: int, H: int, S: int, D: int, cfg: KVCacheTensorConfig, device, dtype: torch.dtype,
                 keys_major: bool = False) -> None:
        self.cfg, self.n_heads, self.head_dim = cfg, H, D
        self.kind, self.spec, self.keys_major = cfg.kind, cfg.kind.spec, keys_major
        self.G = self.block = cfg.qblock
        cfg.channel_param_bytes(D)   # checks that the byte accounting is whole
        self.nb = 1
        self.R = cfg.residual_len
        self.size = 2 * self.G + self.R
        code_width = self.spec.code_width(D)
        shape = (B, H, code_width, S) if keys_major else (B, H, S, code_width)
        self.codes = torch.zeros(shape, dtype=self.spec.dtype, device=device)
        self.scales = torch.zeros(B, H, D * self.spec.params, S // self.G, dtype=SCALE_DTYPE, device=device)
        self.ring = torch.zeros(B, H, self.size, D, dtype=dtype, device=device)
        self.fp_lo = 0

    def _ring_write(self, start: int, x: torch.Tensor) -> None:
        slots = torch.arange(start, start + x.shape[2], device=x.device) % self.size
        self.ring[:, :, slots] = x.to(self.ring.dtype)

    def write(self, start: int, x: torch.Tensor, quantized=None) -> None:
        G, T = self.G, x.shape[2]
        end = start + T
        g0 = start // G * G                      # first position of the group being completed
        if self.refills(start):                  # rolled back into a quantized group: refill its head
            self._ring_write(g0, self.dequant(g0, start, self.ring.dtype))
            self.fp_lo = g0
        q_end = min(end // G * G, self.scales.shape[-1] * G)   # groups that are complete (and have room)
        head = self.residual(g0, start, x.dtype) if q_end > g0 < start else None   # before the ring moves on
        n = min(T, self.size)
        self._ring_write(end - n, x[:, :, T - n :])
        if q_end > g0:
            head = x[:, :, :0] if head is None else head
            full = torch.cat([head, x[:, :, : q_end - start]], dim=2)          # [B, H, q_end - g0, D]
            codes, params = quantize_channels(full, self.spec, G)
            if self.keys_major:
                self.codes[..., g0:q_end] = codes.transpose(-1, -2)
            else:
                self.codes[:, :, g0:q_end] = codes
            self.scales[..., g0 // G : q_end // G] = params.transpose(-1, -2)
        self.note_written(start, end)

    def refills(self, start: int) -> bool:
        """Whether a write at `start` must first refill the ring from codes: a rollback went into a
        group that was already quantized (the C decode step leaves such a write to this class)."""
        g0 = start // self.G * self.G
        return g0 < start and self.fp_lo > g0

    def note_written(self, start: int, end: int) -> None:
        self.fp_lo = max(min(self.fp_lo, start), end - self.size)

    def fp_start(self, end: int) -> int:
        """Positions [fp_start, end) are read from the ring: the incomplete group and the residual window."""
        return min(end // self.G * self.G, max(end - self.R, self.fp_lo), self.scales.shape[-1] * self.G)

    def code_slice(self, s0: int, s1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes of positions [s0, s1) (s0 a group start) and the parameters of the groups they
        touch: [B, H, 2 D, ceil((s1 - s0) / G)] (scales, then minimums)."""
        if s0 % self.G:
            raise ValueError(f"a per-channel code slice starts at a group boundary; got {s0} (groups of {self.G})")
        codes = self.codes[..., s0:s1] if self.keys_major else self.codes[:, :, s0:s1]
        return codes, self.scales[..., s0 // self.G : -(-s1 // self.G)]

    def dequant(self, s0: int, s1: int, dtype: torch.dtype) -> torch.Tensor:
        """Positions [s0, s1) from the codes (whole groups): [B, H, s1 - s0, D]."""
        G = self.G
        g0, g1 = s0 // G * G, -(-s1 // G) * G
        codes = self.codes[..., g0:g1].transpose(-1, -2) if self.keys_major else self.codes[:, :, g0:g1]
        params = self.scales[..., g0 // G : g1 // G].transpose(-1, -2)
        return dequantize_channels(codes, params, self.spec, G, dtype)[:, :, s0 - g0 : s1 - g0]

    def residual(self, r0: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        slots = torch.arange(r0, end, device=self.codes.device) % self.size
        return self.ring[:, :, slots].to(dtype)


def make_stream(B: int, H: int, S: int, D: int, cfg: KVCacheTensorConfig, device, dtype: torch.dtype,
                keys_major: bool = False):
    if cfg.quantized:
        cls = ChannelQuantStream if cfg.spec.per_channel else QuantStream
        return cls(B, H, S, D, cfg, device, dtype, keys_major)
    return FloatStream(B, H, S, D, cfg, device, dtype)
