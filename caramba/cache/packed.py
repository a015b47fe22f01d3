"""A per-head ragged press's layer stored packed: each (row, KV head)'s slots back to back in one store.

AdaKV gives every KV head its own budget. Stored at the widest head's width W_l (caramba.cache.
evict's right-aligned layout) a layer keeps W_l slots per head, most of them holes; here head
(b, h) stores only the layer's slots [shift[b, h], capacity): its survivors, then the room for new
tokens. shift is the head's first survivor (first = W_l - kept) rounded down to `align`: 1 for
per-token kinds (no holes at all), the group G for kinds whose quantization groups run along
tokens (KIVI's per-channel keys), so that a head's groups are the layer's (G-aligned slots, as
the dense layout quantizes them) and every head completes a group at the same step; such a head
keeps fewer than G holes in front. The allocation is, per head, kept + room rounded up to align.

Slot s of head (b, h) lies at store slot org[b, h] + s (org = the head's start in the store
minus its shift). Stores are [total, D] (float kinds, value codes) or [Dc, total] (key codes),
block parameters [nb * params, total] (per-channel kinds: [D * params, total / G]); the
full-precision rings (a residual window, a per-channel group being filled) stay per head, [B,
KVH, n, D], indexed by the layer's slot as caramba.cache.streams' rings are. The fused C step
reads the same store (its Stream's org and store, caramba.model.fast_decode); reading here
gathers each head's slots into a dense [B, KVH, end, D] with the holes zero, the torch path's
reference (PackedLayerKVCache.attend).
"""

from __future__ import annotations

import math

import torch

from caramba.cache.kinds import SCALE_DTYPE, KVCacheTensorConfig
from caramba.cache.quant import dequantize, dequantize_channels, quantize, quantize_channels
from caramba.cache.streams import ChannelQuantStream, QuantStream


class PackedSlots:
    """Where each (row, KV head)'s slots lie in a packed layer's store: org, shift, seg [B, KVH]
    int64 (seg: the store slots the head takes, a multiple of align), the layer's capacity in its
    own slots and the store's size."""

    def __init__(self, shift: torch.Tensor, capacity: int, align: int) -> None:
        self.shift, self.capacity, self.align = shift.to(torch.int64).contiguous(), capacity, align
        self.seg = (capacity - self.shift + align - 1) // align * align
        flat = self.seg.flatten()
        base = (torch.cumsum(flat, 0) - flat).view_as(self.seg)
        self.org = (base - self.shift).contiguous()
        self.total = int(flat.sum())
        B, H = self.shift.shape
        # per head: (row, head, org, shift) as ints, for the slice copies of take_slots
        self.heads = [(b, h, o, sh) for (b, h), o, sh in zip([(b, h) for b in range(B) for h in range(H)],
                                                             self.org.flatten().tolist(), self.shift.flatten().tolist())]

    def index(self, s0: int, s1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(store slots [B, KVH, n] of layer slots [s0, s1), clamped into the store; whether each is stored)."""
        slots = torch.arange(s0, s1, device=self.org.device)
        keep = slots >= self.shift[..., None]
        return (self.org[..., None] + slots).clamp_(0, max(self.total - 1, 0)), keep

    def take_slots(self, src: torch.Tensor, dim: int, s0: int, s1: int, unit: int = 1,
                   channels_first: bool = False) -> torch.Tensor:
        """Layer slots (unit > 1: groups of `unit` slots) [s0, s1) of every head from a store laid
        along `dim` (0: [store, C], 1: [C, store]) -> [B, KVH, s1 - s0, C] ([B, KVH, C, s1 - s0] with
        channels_first, from a dim-1 store), the holes zero. One slice copy per head: each head's
        slots are contiguous in the store (an index_select over all of them measured 5-10x slower at
        3 heads of 4k slots)."""
        B, H = self.shift.shape
        C, n = src.shape[1 - dim], s1 - s0
        out = torch.zeros((B, H, C, n) if channels_first else (B, H, n, C), dtype=src.dtype, device=src.device)
        for b, h, org, shift in self.heads:
            org, lo = org // unit, max(-(-shift // unit) - s0, 0)
            if lo >= n:
                continue
            if channels_first:
                out[b, h, :, lo:] = src[:, org + s0 + lo: org + s1]
            else:
                out[b, h, lo:] = src[org + s0 + lo: org + s1] if dim == 0 else src[:, org + s0 + lo: org + s1].T
        return out

    def group_index(self, g0: int, g1: int, G: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The same for groups [g0, g1) of G slots (org and shift are multiples of G)."""
        groups = torch.arange(g0, g1, device=self.org.device)
        keep = groups * G >= self.shift[..., None]
        return (self.org[..., None] // G + groups).clamp_(0, max(self.total // G - 1, 0)), keep

    def reorder(self, index: torch.Tensor) -> tuple[PackedSlots, torch.Tensor]:
        """(the slots of rows `index`, the old store slot of each new one)."""
        new = PackedSlots(self.shift[index], self.capacity, self.align)
        start = (self.org + self.shift)[index].flatten()            # each new head's first old store slot
        seg = new.seg.flatten()
        within = torch.arange(new.total, device=seg.device) - torch.repeat_interleave(new.org.flatten()
                                                                                     + new.shift.flatten(), seg)
        return new, torch.repeat_interleave(start, seg) + within


class PackedFloatStream:
    quantized = False

    def __init__(self, slots: PackedSlots, H: int, D: int, cfg: KVCacheTensorConfig, device) -> None:
        self.cfg, self.n_heads, self.head_dim, self.slots = cfg, H, D, slots
        self.data = torch.zeros(slots.total, D, dtype=cfg.dtype, device=device)

    def write(self, start: int, x: torch.Tensor, quantized=None) -> None:
        idx, keep = self.slots.index(start, start + x.shape[2])
        self.data[idx[keep]] = x[keep].to(self.data.dtype)

    def read(self, end: int, dtype: torch.dtype) -> torch.Tensor:
        """Layer slots [0, end) of every head: [B, KVH, end, D], the holes zero."""
        return self.slots.take_slots(self.data, 0, 0, end).to(dtype)

    def reset(self) -> None:
        pass

    def take(self, slots: PackedSlots, gather: torch.Tensor, index: torch.Tensor) -> None:
        self.slots, self.data = slots, self.data[gather]

    def tensors(self) -> list[torch.Tensor]:
        return [self.data]


class PackedQuantStream:
    """A per-token kind's codes and block parameters packed (PackedSlots), its ring per head."""

    quantized = True
    note_written = QuantStream.note_written
    fp_start = QuantStream.fp_start
    residual = QuantStream.residual
    read = QuantStream.read       # layer slots [0, end): codes below fp_start, the ring above; holes zero
    reset = QuantStream.reset

    def __init__(self, slots: PackedSlots, H: int, D: int, cfg: KVCacheTensorConfig, device, dtype: torch.dtype,
                 keys_major: bool = False, batch: int = 1) -> None:
        self.cfg, self.n_heads, self.head_dim, self.slots = cfg, H, D, slots
        self.kind, self.spec, self.keys_major = cfg.kind, cfg.kind.spec, keys_major
        self._params(cfg, D)
        width = self.spec.code_width(D)
        self.codes = torch.zeros((width, self.n_store) if keys_major else (self.n_store, width),
                                 dtype=self.spec.dtype, device=device)
        self.scales = torch.zeros(self.n_params, self.n_store // self.step, dtype=SCALE_DTYPE, device=device)
        self.ring = torch.zeros(batch, H, self.ring_n, D, dtype=dtype, device=device) if self.ring_n else None
        self.fp_lo = 0

    def _params(self, cfg: KVCacheTensorConfig, D: int) -> None:
        self.block, self.R = cfg.block_for(D), cfg.residual_len
        self.nb, self.step, self.ring_n = D // self.block, 1, cfg.residual_len
        self.n_params, self.n_store = self.nb * self.spec.params, self.slots.total

    def _put(self, idx: torch.Tensor, codes: torch.Tensor) -> None:
        """codes [n, Dc] into store slots idx [n]."""
        if self.keys_major:
            self.codes[:, idx] = codes.T
        else:
            self.codes[idx] = codes

    def _get(self, s0: int, s1: int) -> torch.Tensor:
        """Codes [B, KVH, s1 - s0, Dc] of layer slots [s0, s1), the holes' zero."""
        return self.slots.take_slots(self.codes, 1 if self.keys_major else 0, s0, s1)

    def _params_at(self, s0: int, s1: int) -> torch.Tensor:
        """Block parameters [B, KVH, n, params] of layer slots [s0, s1) (per-channel kinds: of
        groups [s0, s1)), the holes' zero (a zero scale: the holes read as zeros)."""
        return self.slots.take_slots(self.scales, 1, s0, s1, self.step)

    def write(self, start: int, x: torch.Tensor, quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        end = start + x.shape[2]
        codes, scales = quantized or quantize(x, self.spec, self.block)   # [B, H, T, Dc], [B, H, T, nb * p]
        idx, keep = self.slots.index(start, end)
        self._put(idx[keep], codes[keep])
        self.scales[:, idx[keep]] = scales[keep].T
        if self.R:
            n = min(x.shape[2], self.R)
            ring_slots = torch.arange(end - n, end, device=x.device) % self.R
            self.ring[:, :, ring_slots] = x[:, :, -n:].to(self.ring.dtype)
            self.note_written(start, end)

    def dequant(self, s0: int, s1: int, dtype: torch.dtype) -> torch.Tensor:
        """Layer slots [s0, s1) from the codes: [B, KVH, s1 - s0, D], holes zero."""
        return dequantize(self._get(s0, s1), self._params_at(s0, s1), self.spec, self.block, dtype)

    def dense_view(self, end: int) -> QuantStream:
        """Layer slots [0, end) as a plain QuantStream of `end` slots (codes and parameters copied
        out head by head, holes zero; the ring and its bookkeeping shared): what caramba.cache.attend
        reads in place with the C kernels, a fraction of the bytes of dequantizing every slot."""
        view = QuantStream.__new__(QuantStream)
        view.__dict__.update({k: v for k, v in self.__dict__.items() if k not in ("codes", "scales", "slots")})
        view.codes = self.slots.take_slots(self.codes, 1 if self.keys_major else 0, 0, end,
                                           channels_first=self.keys_major)
        view.scales = self.slots.take_slots(self.scales, 1, 0, end, channels_first=True)
        return view

    def take(self, slots: PackedSlots, gather: torch.Tensor, index: torch.Tensor) -> None:
        self.slots = slots
        self.codes = self.codes[:, gather] if self.keys_major else self.codes[gather]
        self.scales = self.scales[:, gather].contiguous()
        self.codes = self.codes.contiguous()
        if self.ring is not None:
            self.ring = self.ring.index_select(0, index)

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.scales] + ([self.ring] if self.ring is not None else [])


class PackedChannelStream(PackedQuantStream):
    """A per-channel kind (KIVI's keys) packed: groups of G slots, org and shift multiples of G;
    what ChannelQuantStream does (groups quantized once complete, the ring holding the incomplete
    group and the residual window, a rollback refilling its group), per head in one store."""

    shift = None                 # no per-head group phases here: evict leaves such a layer dense
    _phase_rows: tuple = ()
    refills = ChannelQuantStream.refills
    note_written = ChannelQuantStream.note_written
    residual = ChannelQuantStream.residual
    _ring_write = ChannelQuantStream._ring_write

    def _params(self, cfg: KVCacheTensorConfig, D: int) -> None:
        cfg.channel_param_bytes(D)
        self.G = self.block = self.step = cfg.qblock
        self.nb, self.R = 1, cfg.residual_len
        self.size = self.ring_n = 2 * self.G + self.R
        self.n_params, self.n_store = D * self.spec.params, self.slots.total
        self.n_groups = self.slots.capacity // self.G          # in the layer's slots, as ChannelQuantStream's

    def fp_start(self, end: int) -> int:
        return min(end // self.G * self.G, max(end - self.R, self.fp_lo), self.n_groups * self.G)

    def write(self, start: int, x: torch.Tensor, quantized=None) -> None:
        G, T = self.G, x.shape[2]
        end = start + T
        g0 = start // G * G
        if self.refills(start):
            self._ring_write(g0, self.dequant(g0, start, self.ring.dtype))
            self.fp_lo = g0
        q_end = min(end // G * G, self.n_groups * G)
        head = self.residual(g0, start, x.dtype) if q_end > g0 < start else None
        n = min(T, self.size)
        self._ring_write(end - n, x[:, :, T - n:])
        if q_end > g0:
            head = x[:, :, :0] if head is None else head
            full = torch.cat([head, x[:, :, : q_end - start]], dim=2)
            codes, params = quantize_channels(full, self.spec, G)      # [B, H, n, Dc], [B, H, ng, D * p]
            idx, keep = self.slots.index(g0, q_end)
            self._put(idx[keep], codes[keep])
            gidx, gkeep = self.slots.group_index(g0 // G, q_end // G, G)
            self.scales[:, gidx[gkeep]] = params[gkeep].T
        self.note_written(start, end)

    def dense_view(self, end: int) -> ChannelQuantStream:
        """Layer slots [0, end) as a plain ChannelQuantStream (see PackedQuantStream.dense_view):
        whole groups up to the last one `end` completes, within the layer's groups."""
        G = self.G
        groups = min(end // G, self.n_groups)
        view = ChannelQuantStream.__new__(ChannelQuantStream)
        view.__dict__.update({k: v for k, v in self.__dict__.items() if k not in ("codes", "scales", "slots")})
        view.codes = self.slots.take_slots(self.codes, 1 if self.keys_major else 0, 0, end,
                                           channels_first=self.keys_major)
        view.scales = self.slots.take_slots(self.scales, 1, 0, groups, G, channels_first=True)
        return view

    def dequant(self, s0: int, s1: int, dtype: torch.dtype) -> torch.Tensor:
        G = self.G
        g0, g1 = s0 // G * G, -(-s1 // G) * G
        x = dequantize_channels(self._get(g0, g1), self._params_at(g0 // G, g1 // G), self.spec, G, dtype)
        return x[:, :, s0 - g0: s1 - g0]

    def take(self, slots: PackedSlots, gather: torch.Tensor, index: torch.Tensor) -> None:
        G = self.G
        groups = gather.view(-1, G)[:, 0] // G                # segments are whole groups
        self.slots = slots
        self.codes = (self.codes[:, gather] if self.keys_major else self.codes[gather]).contiguous()
        self.scales = self.scales[:, groups].contiguous()
        self.ring = self.ring.index_select(0, index)


def alignment(*cfgs: KVCacheTensorConfig) -> int:
    """Store slots a head's segment is aligned to: the groups along tokens of per-channel kinds."""
    return math.lcm(*[c.qblock if c.quantized and c.spec.per_channel else 1 for c in cfgs])


def make_packed_stream(slots: PackedSlots, B: int, H: int, D: int, cfg: KVCacheTensorConfig, device,
                       dtype: torch.dtype, keys_major: bool = False):
    if not cfg.quantized:
        return PackedFloatStream(slots, H, D, cfg, device)
    cls = PackedChannelStream if cfg.spec.per_channel else PackedQuantStream
    return cls(slots, H, D, cfg, device, dtype, keys_major, B)


__all__ = ["PackedChannelStream", "PackedFloatStream", "PackedQuantStream", "PackedSlots", "alignment",
           "make_packed_stream"]
