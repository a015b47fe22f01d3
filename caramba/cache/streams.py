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

    Rows of a batch may start their groups at their own first slot (set_origins: left padding, a
    press's holes in front), so a padded row's groups hold the tokens they hold alone.
    """

    shift: torch.Tensor | None = None   # per-(row, head) group phase; None: every group at a multiple of G
    _phase_rows: tuple = ()

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
        self.shift: torch.Tensor | None = None   # per-(row, head) group phase (set_origins); None: all 0
        self._phase_rows: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    def set_origins(self, first: torch.Tensor | None) -> None:
        """Start each row's (head's) groups at its first real slot first [B] or [B, H] (left padding,
        a press's holes in front): slot s of a row then lies in virtual slot s + shift, shift =
        -first mod G, and its groups are the virtual slots' [j G, (j + 1) G), so a row behind p
        holes groups its tokens as it does alone (the slots before its first token form groups of
        holes of their own). None, or origins that are all whole groups: the plain layout (one
        phase for every row, the groups at multiples of G). Call it on an empty stream."""
        self._phase_rows = []
        S = self.codes.shape[-1] if self.keys_major else self.codes.shape[2]
        if first is None or not bool((first % self.G).any()):
            self.shift = None
            if self.scales.shape[-1] > S // self.G:   # back to [.., S // G]: the C step's parameter stride
                self.scales = self.scales[..., : S // self.G].contiguous()
            return
        first = first.to(device=self.scales.device, dtype=torch.int64)
        if first.dim() == 1:
            first = first[:, None].expand(-1, self.n_heads)
        self.shift = ((-first) % self.G).contiguous()                       # [B, H] in [0, G)
        self._phases()
        groups = (S + int(self.shift.max())) // self.G                      # a row's last group may end past S
        if groups > self.scales.shape[-1]:
            more = self.scales.new_zeros(*self.scales.shape[:-1], groups - self.scales.shape[-1])
            self.scales = torch.cat([self.scales, more], dim=-1)

    def _phases(self) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """(shift, rows, heads) of each distinct shift: index tensors of the (row, head) pairs it has."""
        if not self._phase_rows and self.shift is not None:
            self._phase_rows = [(int(sh), *(self.shift == sh).nonzero(as_tuple=True))
                                for sh in torch.unique(self.shift).tolist()]
        return self._phase_rows

    def _fp_phase(self, end: int, sh: int) -> int:
        """fp_start of the rows of shift sh: their incomplete group and the residual window."""
        G = self.G
        return max(min((end + sh) // G * G - sh, max(end - self.R, self.fp_lo), self.scales.shape[-1] * G - sh), 0)

    def _ring_rows(self, bi: torch.Tensor, hi: torch.Tensor, a: int, b: int, dtype: torch.dtype) -> torch.Tensor:
        """Slots [a, b) of the (row, head) pairs bi, hi from the ring: [n, b - a, D], zeros below slot 0."""
        slots = torch.arange(max(a, 0), b, device=self.ring.device) % self.size
        x = self.ring[bi, hi][:, slots].to(dtype)
        if a < 0:
            x = torch.cat([x.new_zeros(x.shape[0], -a, x.shape[2]), x], dim=1)
        return x

    def _dequant_rows(self, sh: int, bi: torch.Tensor, hi: torch.Tensor, s0: int, s1: int,
                      dtype: torch.dtype) -> torch.Tensor:
        """Slots [s0, s1) of the pairs of shift sh from their codes (whole groups): [n, s1 - s0, D]."""
        G = self.G
        v0, v1 = (s0 + sh) // G * G, -(-(s1 + sh) // G) * G
        a, b = v0 - sh, v1 - sh
        lo = max(a, 0)
        codes = self.codes[bi, hi, :, lo:b].transpose(-1, -2) if self.keys_major else self.codes[bi, hi, lo:b]
        if lo > a:
            codes = torch.cat([codes.new_zeros(codes.shape[0], lo - a, codes.shape[2]), codes], dim=1)
        params = self.scales[bi, hi, :, v0 // G: v1 // G].transpose(-1, -2)
        return dequantize_channels(codes, params, self.spec, G, dtype)[:, s0 - a: s1 - a]

    def _write_phased(self, start: int, x: torch.Tensor) -> None:
        """write() with per-row group phases: each phase's rows complete their own groups."""
        G, T = self.G, x.shape[2]
        end = start + T
        if self.refills(start):
            self._refill_phased(start)
        jobs = []
        for sh, bi, hi in self._phases():
            g0 = (start + sh) // G * G                                       # virtual slots
            q_end = min((end + sh) // G * G, self.scales.shape[-1] * G)
            if q_end > g0:
                head = self._ring_rows(bi, hi, g0 - sh, start, x.dtype)      # before the ring moves on
                jobs.append((sh, bi, hi, g0, q_end, torch.cat([head, x[bi, hi, :q_end - sh - start]], dim=1)))
        n = min(T, self.size)
        self._ring_write(end - n, x[:, :, T - n:])
        for sh, bi, hi, g0, q_end, full in jobs:
            codes, params = quantize_channels(full, self.spec, G)           # [n, q_end - g0, Dc], [n, ng, D p]
            a, b = g0 - sh, q_end - sh
            lo = max(a, 0)
            if self.keys_major:
                self.codes[bi, hi, :, lo:b] = codes[:, lo - a:].transpose(-1, -2)
            else:
                self.codes[bi, hi, lo:b] = codes[:, lo - a:]
            self.scales[bi, hi, :, g0 // G: q_end // G] = params.transpose(-1, -2)
        self.note_written(start, end)

    def _refill_phased(self, start: int) -> None:
        """A rollback into a quantized group (refills): every phase's ring gets back, from its codes,
        its slots from the lowest phase's group start on that lie in its complete groups."""
        G, starts = self.G, {}
        for sh, bi, hi in self._phases():
            g0 = max((start + sh) // G * G - sh, 0)
            starts[sh] = (g0, start if g0 < start and self.fp_lo > g0 else g0)
        lo = min(g0 for g0, _ in starts.values())
        for sh, bi, hi in self._phases():
            done = starts[sh][1]
            if done > lo:
                slots = torch.arange(lo, done, device=self.ring.device) % self.size
                vals = self._dequant_rows(sh, bi, hi, lo, done, self.ring.dtype)
                self.ring[bi[:, None], hi[:, None], slots[None, :]] = vals
        self.fp_lo = lo

    def _ring_write(self, start: int, x: torch.Tensor) -> None:
        slots = torch.arange(start, start + x.shape[2], device=x.device) % self.size
        self.ring[:, :, slots] = x.to(self.ring.dtype)

    def write(self, start: int, x: torch.Tensor, quantized=None) -> None:
        if self.shift is not None:
            return self._write_phased(start, x)
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
        G = self.G
        for sh in ([0] if self.shift is None else [p[0] for p in self._phases()]):
            g0 = (start + sh) // G * G - sh
            if g0 < start and self.fp_lo > g0:
                return True
        return False

    def note_written(self, start: int, end: int) -> None:
        self.fp_lo = max(min(self.fp_lo, start), end - self.size)

    def fp_start(self, end: int) -> int:
        """Positions [fp_start, end) are read from the ring: the incomplete group and the residual window.
        With per-row phases, the lowest row's (residual then reads the other rows' slots below their
        own from their codes)."""
        if self.shift is not None:
            return min(self._fp_phase(end, sh) for sh, _, _ in self._phases())
        return min(end // self.G * self.G, max(end - self.R, self.fp_lo), self.scales.shape[-1] * self.G)

    def code_slice(self, s0: int, s1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes of positions [s0, s1) (s0 a group start) and the parameters of the groups they
        touch: [B, H, 2 D, ceil((s1 - s0) / G)] (scales, then minimums)."""
        if self.shift is not None:
            raise ValueError("a per-channel stream with per-row group phases has no common code slice; "
                             "read it through dequant (caramba.cache.attend does)")
        if s0 % self.G:
            raise ValueError(f"a per-channel code slice starts at a group boundary; got {s0} (groups of {self.G})")
        codes = self.codes[..., s0:s1] if self.keys_major else self.codes[:, :, s0:s1]
        return codes, self.scales[..., s0 // self.G : -(-s1 // self.G)]

    def dequant(self, s0: int, s1: int, dtype: torch.dtype) -> torch.Tensor:
        """Positions [s0, s1) from the codes (whole groups): [B, H, s1 - s0, D]."""
        if self.shift is not None:
            D = self.ring.shape[-1]
            out = torch.zeros(*self.shift.shape, s1 - s0, D, dtype=dtype, device=self.ring.device)
            for sh, bi, hi in self._phases():
                out[bi, hi] = self._dequant_rows(sh, bi, hi, s0, s1, dtype)
            return out
        G = self.G
        g0, g1 = s0 // G * G, -(-s1 // G) * G
        codes = self.codes[..., g0:g1].transpose(-1, -2) if self.keys_major else self.codes[:, :, g0:g1]
        params = self.scales[..., g0 // G : g1 // G].transpose(-1, -2)
        return dequantize_channels(codes, params, self.spec, G, dtype)[:, :, s0 - g0 : s1 - g0]

    def residual(self, r0: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        slots = torch.arange(r0, end, device=self.codes.device) % self.size
        x = self.ring[:, :, slots].to(dtype)
        if self.shift is not None:    # rows whose complete groups reach past r0 read those slots from codes
            for sh, bi, hi in self._phases():
                fp = min(self._fp_phase(end, sh), end)
                if fp > r0:
                    x[bi, hi, :fp - r0] = self._dequant_rows(sh, bi, hi, r0, fp, dtype)
        return x

    def reset(self) -> None:
        self.fp_lo = 0
        self.set_origins(None)

    def reorder(self, index: torch.Tensor) -> None:
        super().reorder(index)
        if self.shift is not None:
            self.shift, self._phase_rows = self.shift[index].contiguous(), []


def make_stream(B: int, H: int, S: int, D: int, cfg: KVCacheTensorConfig, device, dtype: torch.dtype,
                keys_major: bool = False):
    if cfg.quantized:
        cls = ChannelQuantStream if cfg.spec.per_channel else QuantStream
        return cls(B, H, S, D, cfg, device, dtype, keys_major)
    return FloatStream(B, H, S, D, cfg, device, dtype)
