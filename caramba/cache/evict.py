"""Eviction: a cache that keeps only some of another cache's slots (a press's choice, caramba.press).

`evict` takes, per layer, a kept mask [B, KVH, S] over the source's slots and builds a new cache
holding just those tokens, in slot order, stored in a template's kinds (the source's own, or a
quantized candidate's: evict, then keep the survivors quantized), with `room` free slots after
them for the tokens still to come. The allocation is the kept tokens plus that room: a press
frees memory for real.

Keys are stored after RoPE, so a survivor keeps its position; new tokens take their positions
from the decoding state (DecodeState.next_pos), not from the slot they land in.

Two layouts:
- uniform (every layer and KV head of a row keeps as many tokens; rows may differ): plain
  layers of W = the most any row keeps; a row keeping fewer has holes in front, which the
  decoding state's slot mask marks like left padding. The fused C step reads it as it is. A
  prefill press that no decoding-time compression follows (evict(ragged_rows=True)) sends rows
  of different counts the ragged way instead, so the shorter rows allocate no holes.
- ragged (per-layer budgets such as PyramidKV, per-head ones such as AdaKV): layer l numbers
  its slots W_l + t (the t-th new token), W_l its widest head's count, and maps the model's slot
  numbers (W + t) to its own. Each head's survivors lie right-aligned, in [first, W_l). Chosen
  per layer at evict time:
  - packed (PackedLayerKVCache, caramba.cache.packed) where some row or head keeps fewer than
    the widest (AdaKV, rows of different lengths): each (row, KV head) allocates only its slots
    from `first` on, back to back in one store per stream, so the allocation is each head's kept
    tokens plus the room. Kinds whose quantization groups run along tokens (KIVI's per-channel
    keys, groups of G) start a head's slots at `first` rounded down to G, so its groups are the
    dense layout's and complete at the same step for every head: fewer than G holes per head.
    Its torch path gathers each head's slots into plain attention (the reference);
  - dense (PressedLayerKVCache) where every head of the layer keeps W_l (PyramidKV on one row):
    a plain layer of W_l + room slots, nothing to pack (and evict(pack=False) / PACK = False
    keeps every ragged layer so: the layout before packing, for comparisons). Holes, if any,
    sit in front behind a per-head validity mask.
  The fused C step reads both in place, each head only its run of survivors (its first valid
  slot and, packed, its origin in the store: fast_decode), so neither layout reads holes.

A hybrid cache (caramba.cache.hybrid: Gemma 2/3) is pressed in its full layers only (kept[l] is
None for a sliding layer): each full layer becomes a ragged layer as above, its slots offset by
the context's length minus its width, so the model's slot numbers stay the rings' (HybridKVCache.
pressed). The rings are copied as they are (in the template's sliding kinds where those differ:
their slots re-stored, as caramba.evaluation.task_eval.store_context does), and the decoding state's
slot mask, in those same slot numbers, stays. A pressed hybrid cache can be pressed again
(decoding-time compression): kept masks are in the model's slot numbers (held_slots,
slot_contents: what a pressed layer holds, where the model numbers it), each full layer rebuilt
from its own survivors.
"""

from __future__ import annotations

from collections.abc import Sequence

import copy

import torch

from caramba.cache.attend import attend_chunked
from caramba.cache.hybrid import HybridKVCache, SlidingLayerKVCache
from caramba.cache.layer import CHUNKED_MAX_T, KVCache, LayerKVCache
from caramba.cache.packed import PackedSlots, alignment, make_packed_stream
from caramba.cache.sdpa import softcapped_attention

__all__ = ["PackedLayerKVCache", "PressedKVCache", "PressedLayerKVCache", "evict", "held_slots", "kept_counts",
           "slot_contents"]


def kept_counts(kept: Sequence[torch.Tensor]) -> torch.Tensor:
    """[L, B, KVH] how many slots each layer, row and KV head keeps."""
    return torch.stack([k.sum(dim=-1) for k in kept])


# Whether a ragged press packs the layers whose heads keep different counts (PackedLayerKVCache);
# False keeps every layer at its widest head's width (benchmarks/press_speed.py's "+dense" compares).
PACK = True


@torch.inference_mode()
def evict(source: KVCache, kept: Sequence[torch.Tensor | None], template: KVCache | None = None,
          room: int = 0, dtype: torch.dtype = torch.float32,
          pack: bool | None = None, ragged_rows: bool = False,
          slot_mask: torch.Tensor | None = None) -> tuple[KVCache, torch.Tensor | None]:
    """(cache, slot_mask): the source's kept slots (kept[l] [B, KVH, S], S = source.length) in the
    template's kinds (default: the source's), with `room` free slots after them. slot_mask
    [B, W + room] marks a uniform cache's real slots (None: all of them, or a ragged cache,
    whose layers hold their own masks). pack: whether ragged layers may be packed (None: PACK).
    ragged_rows: rows keeping different counts go the ragged way, packed (no holes in front of
    the shorter rows), where otherwise they stay uniform with holes; a ragged cache cannot be
    pressed again, so a press followed by decoding-time compression leaves it False.
    A HybridKVCache source: its full layers pressed (kept None for its sliding layers), its rings
    copied, and `slot_mask` (the source's, in the slot numbers it keeps) returned as it is."""
    if isinstance(source, HybridKVCache):
        return _evict_hybrid(source, kept, template, room, dtype, pack), slot_mask
    layers = source.layers
    S, B = source.length, source.batch_size
    template = source if template is None else template
    if len(kept) != len(layers) or len(template.layers) != len(layers):
        raise ValueError(f"evict needs one kept mask per layer ({len(layers)}); got {len(kept)} masks and a "
                         f"template of {len(template.layers)} layers")
    for i, (layer, mask) in enumerate(zip([*layers, *template.layers], [*kept, *kept])):
        if type(layer) is not LayerKVCache:
            raise ValueError(f"eviction needs standard attention caches; layer {i % len(layers)} is "
                             f"{type(layer).__name__} (sliding-window rings, decoupled attention and pressed caches are not)")
        if mask.dtype != torch.bool or tuple(mask.shape) != (B, layer.n_kv_heads, S):
            raise ValueError(f"kept mask of layer {i % len(layers)} must be bool [{B}, {layer.n_kv_heads}, {S}]; "
                             f"got {mask.dtype} {tuple(mask.shape)}")
    counts = kept_counts(kept)                                   # [L, B, KVH]
    packs = PACK if pack is None else pack
    rows_alike = counts[:1, :1, :1] if ragged_rows and packs else counts[:1, :, :1]
    uniform = bool((counts == rows_alike).all())
    width = int(counts.max()) if counts.numel() else 0
    built = []
    for i, (src, tpl, mask) in enumerate(zip(layers, template.layers, kept)):
        w = width if uniform else int(counts[i].max())
        keys, values, valid = _gather(src, mask, S, w, dtype)
        first = w - counts[i]                                    # [B, KVH]: each head's first survivor
        align = alignment(tpl.k_cfg, tpl.v_cfg)
        # Each row's groups along tokens (per-channel keys) start at its widest head's first survivor,
        # where they start when the row is pressed alone (slot 0 of its own widest layer). A packed
        # store starts them at multiples of G for every row: a layer whose rows need other origins
        # stays dense (set_origins), and the fused C step leaves it to the torch path.
        origin = (w - counts[i].max(dim=-1, keepdim=True).values).expand_as(first)    # [B, KVH]
        phased = bool((origin % align).any())
        if not uniform and packs and bool((first >= align).any()) and not phased:   # holes a packed store leaves out
            layer = PackedLayerKVCache.build(tpl, B, w, room, first, width - w, align)
        else:
            layer = tpl.like(B, w + room)
            layer.set_origins(origin if phased else None)
        layer.extend(keys, values)
        if not uniform and type(layer) is LayerKVCache:
            layer = PressedLayerKVCache.adopt(layer, width - w, None if bool(valid.all()) else valid)
        built.append(layer)
    if not uniform:
        return PressedKVCache(built), None
    rows = counts[0, :, 0]                                       # [B]
    if bool((rows == width).all()):
        return KVCache(built), None
    slot_mask = torch.zeros(B, width + room, dtype=torch.bool, device=rows.device)
    slot_mask[:, :width] = torch.arange(width, device=rows.device)[None, :] >= (width - rows)[:, None]
    return KVCache(built), slot_mask


def held_slots(layer: LayerKVCache, S: int) -> torch.Tensor | None:
    """[B, KVH, S] which of the model's slots [0, S) a pressed layer holds (its holes and the slots
    before its offset not); None for a plain layer, which holds all of them."""
    if type(layer) not in (PressedLayerKVCache, PackedLayerKVCache):
        return None
    B, H, off = layer.batch_size, layer.n_kv_heads, layer.offset
    own = torch.arange(S - off, device=layer.k.device)                      # this layer's slots
    if type(layer) is PackedLayerKVCache:
        held = own >= layer.first[..., None]
    else:
        held = torch.ones(B, H, S - off, dtype=torch.bool, device=own.device)
        if layer.valid is not None:
            held[..., :layer.width] = layer.valid
    return torch.cat([torch.zeros(B, H, off, dtype=torch.bool, device=own.device), held], dim=-1)


def slot_contents(layer: LayerKVCache, S: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [B, KVH, S, D] of the model's slots [0, S) (rotations undone): a pressed layer's own
    slots after its offset, zeros where it holds nothing (held_slots says where)."""
    off = getattr(layer, "offset", 0)
    keys, values = layer.contents(S - off, dtype)
    if not off:
        return keys, values
    return torch.nn.functional.pad(keys, (0, 0, off, 0)), torch.nn.functional.pad(values, (0, 0, off, 0))


def _evict_hybrid(source: HybridKVCache, kept: Sequence[torch.Tensor | None], template: KVCache | None, room: int,
                  dtype: torch.dtype, pack: bool | None) -> HybridKVCache:
    """The hybrid cache whose full layers keep their kept slots (ragged layers, offset to the
    source's slot numbers) and whose rings are the source's, copied."""
    S, B = source.length, source.batch_size
    template = source if template is None else template
    if len(kept) != len(source.layers) or len(template.layers) != len(source.layers) or \
            getattr(template, "sliding", None) != source.sliding:
        raise ValueError(f"evict needs one kept mask per layer ({len(source.layers)}, None for each sliding layer) "
                         "and a template of the same model's hybrid cache")
    packs = PACK if pack is None else pack
    built: list[LayerKVCache] = []
    for i, (src, tpl, mask, ring) in enumerate(zip(source.layers, template.layers, kept, source.sliding)):
        if ring:
            if mask is not None:
                raise ValueError(f"layer {i} is a sliding layer's ring: a press keeps it whole (its kept mask must "
                                 "be None)")
            built.append(_copy_ring(src, tpl, dtype))
            continue
        held = (LayerKVCache, PressedLayerKVCache, PackedLayerKVCache)   # pressed already: pressed again
        if type(src) not in held or type(tpl) not in held:
            raise ValueError(f"eviction needs standard attention caches; full layer {i} is {type(src).__name__}")
        if mask is None or mask.dtype != torch.bool or tuple(mask.shape) != (B, src.n_kv_heads, S):
            raise ValueError(f"kept mask of full layer {i} must be bool [{B}, {src.n_kv_heads}, {S}]; got "
                             f"{None if mask is None else (mask.dtype, tuple(mask.shape))}")
        had = held_slots(src, S)
        if had is not None and bool((mask & ~had).any()):
            raise ValueError(f"the kept mask of full layer {i} keeps slots the layer no longer holds")
        counts = mask.sum(dim=-1)                                    # [B, KVH]
        w = int(counts.max()) if counts.numel() else 0
        off = getattr(src, "offset", 0)                              # the mask over this layer's own slots
        keys, values, valid = _gather(src, mask[..., off:], S - off, w, dtype)
        first = w - counts
        align = alignment(tpl.k_cfg, tpl.v_cfg)
        if packs and bool((first >= align).any()):
            layer = PackedLayerKVCache.build(tpl, B, w, room, first, S - w, align)
            layer.extend(keys, values)
        else:
            layer = tpl.like(B, w + room)
            layer.extend(keys, values)
            layer = PressedLayerKVCache.adopt(layer, S - w, None if bool(valid.all()) else valid)
        built.append(layer)
    cache = HybridKVCache.pressed(built, source.sliding, source.model_window, S)
    cache.window = source.window
    return cache


def _copy_ring(src: SlidingLayerKVCache, tpl: LayerKVCache, dtype: torch.dtype) -> SlidingLayerKVCache:
    """A copy of a ring in the template's kinds: its storage as it is where the kinds and rotations
    agree, else its slots re-stored in the template's."""
    B = src.batch_size
    same = (src.k_cfg, src.v_cfg, src.rotation is None, src.v_rotation is None) == \
        (tpl.k_cfg, tpl.v_cfg, tpl.rotation is None, tpl.v_rotation is None)
    if same:
        ring = copy.copy(src)
        rows = torch.arange(B, device=src.k.device)
        ring.k_stream, ring.v_stream = copy.copy(src.k_stream), copy.copy(src.v_stream)
        for stream in ring.streams:
            stream.reorder(rows)                                     # index_select: a copy of every tensor
        ring.observer = None
        return ring
    ring = tpl.like(B, src.max_seq_len)
    ring.__class__ = SlidingLayerKVCache
    ring.window = src.window
    keys, values, first = src.slot_contents(dtype)
    ring.length = first
    ring.extend(keys, values)
    return ring


def _gather(layer: LayerKVCache, mask: torch.Tensor, S: int, width: int, dtype: torch.dtype):
    """The kept slots of one layer, right-aligned in `width` slots per row and head: (keys
    [B, KVH, width, D], values, valid [B, KVH, width]); the holes in front are zeros."""
    keys, values = layer.contents(S, dtype)
    slots = torch.arange(S, device=mask.device).expand_as(mask)
    # Dropped slots sort first (-1), kept ones after in slot order: the last `width` columns are
    # each head's survivors, right-aligned, behind as many dropped slots as it keeps fewer.
    order, index = torch.sort(torch.where(mask, slots, -1), dim=-1, stable=True)
    order, index = order[..., S - width:], index[..., S - width:]
    valid = order >= 0
    pick = index[..., None]
    keys = keys.gather(2, pick.expand(-1, -1, -1, keys.shape[-1])) * valid[..., None]
    values = values.gather(2, pick.expand(-1, -1, -1, values.shape[-1])) * valid[..., None]
    return keys, values, valid


class PressedLayerKVCache(LayerKVCache):
    """A layer of a ragged pressed cache: its first `width` slots are the survivors (per head:
    valid [B, KVH, width], None when every one is real), then new tokens. The model numbers
    slots as the widest layer does; this layer's slot i is the model's slot i + offset."""

    offset: int = 0
    valid: torch.Tensor | None = None
    width: int = 0

    @classmethod
    def adopt(cls, layer: LayerKVCache, offset: int, valid: torch.Tensor | None) -> PressedLayerKVCache:
        layer.__class__ = cls   # same storage, the model's slot numbers mapped to its own
        layer.offset, layer.valid, layer.width = offset, valid, layer.length
        return layer

    def truncate(self, n: int) -> None:
        if n < self.width:
            raise ValueError(f"cannot roll back into a pressed context ({self.width} survivors in this layer); "
                             f"got {n}")
        super().truncate(n)

    def reset(self) -> None:
        raise ValueError("a pressed cache cannot be reset; build a new cache")

    def reorder(self, index: torch.Tensor) -> None:
        super().reorder(index)
        if self.valid is not None:
            self.valid = self.valid[index]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               causal: bool) -> torch.Tensor:
        """As LayerKVCache.attend, with the model's mask [B, 1, T, offset + end] (PressedKVCache
        always gives one) mapped onto this layer's slots (its slot i is the model's i + offset)
        and each head's holes masked. The C decode step reads the same (fast_decode)."""
        B, H, T, _ = q.shape
        end, layer_mask = self._append_masked(k, v, mask, causal, B, T)
        KVH = self.n_kv_heads
        if self.rotation is not None:
            q = q @ self.rotation.to(q.dtype)
        if T <= CHUNKED_MAX_T:
            out = attend_chunked(q, self.k_stream, self.v_stream, end, layer_mask)
        else:
            keys, values = self.k_stream.read(end, q.dtype), self.v_stream.read(end, q.dtype)
            out = torch.nn.functional.scaled_dot_product_attention(
                q, keys, values, attn_mask=layer_mask.repeat_interleave(H // KVH, dim=1), enable_gqa=True)
        return out if self.v_rotation is None else out @ self.v_rotation.to(out.dtype)

    def _append_masked(self, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool, B: int,
                       T: int) -> tuple[int, torch.Tensor]:
        """Append k, v; (end, the model's mask mapped onto this layer's slots [B, KVH, T, end],
        each head's holes masked)."""
        if mask is None or causal:
            raise ValueError("a pressed layer needs an explicit mask (PressedKVCache.attention_mask)")
        end = self._append(k, v)
        layer_mask = mask[..., self.offset:].expand(B, self.n_kv_heads, T, end)
        if self.valid is not None:
            layer_mask = torch.cat([layer_mask[..., :self.width] & self.valid[:, :, None, :],
                                    layer_mask[..., self.width:]], dim=-1)
        return end, layer_mask

    def attend_softcapped(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                          causal: bool, cap: float) -> torch.Tensor:
        """attend() with the scores soft-capped (Gemma 2): this layer's slots (each head's, as
        stored: rotated queries meet rotated keys) under the mapped mask, scores materialized."""
        B, H, T, _ = q.shape
        end, layer_mask = self._append_masked(k, v, mask, causal, B, T)
        if self.rotation is not None:
            q = q @ self.rotation.to(q.dtype)
        keys, values = self.k_stream.read(end, q.dtype), self.v_stream.read(end, q.dtype)   # [B, KVH, end, D]
        out = softcapped_attention(q, keys, values, layer_mask.repeat_interleave(H // self.n_kv_heads, dim=1),
                                   False, cap)
        return out if self.v_rotation is None else out @ self.v_rotation.to(out.dtype)


class PackedLayerKVCache(PressedLayerKVCache):
    """A ragged press's layer whose heads keep different counts, stored packed (caramba.cache.
    packed): head (b, h) allocates only its slots from shift[b, h] on (its survivors, then the
    room), not the widest head's width. In the model's slot numbers it is a PressedLayerKVCache
    (offset, width; first [B, KVH]: each head's first survivor, the slots before it holes);
    `attend` gathers each head's slots and runs plain attention over them, the reference the
    fused C step (which reads the store in place) is tested against."""

    first: torch.Tensor

    @classmethod
    def build(cls, template: LayerKVCache, B: int, width: int, room: int, first: torch.Tensor, offset: int,
              align: int) -> PackedLayerKVCache:
        """An empty packed layer of template's kinds and rotations: B rows, `width` + room slots of
        its own, heads' first survivors first [B, KVH]; segments aligned to `align` slots."""
        self = cls.__new__(cls)
        for name in ("n_kv_heads", "k_cfg", "v_cfg", "k_dim", "v_dim", "device", "dtype", "rotation", "unrotation",
                     "v_rotation"):
            setattr(self, name, getattr(template, name))
        self.batch_size, self.max_seq_len, self.length = B, width + room, 0
        self.offset, self.width, self.valid = offset, width, None
        self.first = first.to(torch.int64).contiguous()
        self.slots = PackedSlots(first // align * align, width + room, align)
        H = self.n_kv_heads
        self.k_stream = make_packed_stream(self.slots, B, H, self.k_dim // H, self.k_cfg, self.device, self.dtype,
                                           keys_major=True)
        self.v_stream = make_packed_stream(self.slots, B, H, self.v_dim // H, self.v_cfg, self.device, self.dtype)
        return self

    @property
    def org(self) -> torch.Tensor:
        return self.slots.org

    def _append_masked(self, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool, B: int,
                       T: int) -> tuple[int, torch.Tensor]:
        """As PressedLayerKVCache's, each head's slots before its first survivor masked."""
        if mask is None or causal:
            raise ValueError("a pressed layer needs an explicit mask (PressedKVCache.attention_mask)")
        end = self._append(k, v)
        held = torch.arange(end, device=mask.device) >= self.first[..., None]  # [B, KVH, end]
        return end, mask[..., self.offset:].expand(B, self.n_kv_heads, T, end) & held[:, :, None, :]

    def reorder(self, index: torch.Tensor) -> None:
        slots, gather = self.slots.reorder(index)
        for s in self.streams:
            s.take(slots, gather, index)
        self.slots, self.first, self.batch_size = slots, self.first[index].contiguous(), int(index.numel())

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               causal: bool) -> torch.Tensor:
        """Attention over each head's slots copied out of the store (keys and values as stored,
        rotated or not, as LayerKVCache.attend reads them), the model's mask mapped onto this
        layer's slots and each head's holes masked: quantized codes read in place in chunks for
        decode-sized forwards (PressedLayerKVCache's read), else SDPA over the dequantized slots."""
        B, H, T, _ = q.shape
        end, layer_mask = self._append_masked(k, v, mask, causal, B, T)
        if self.rotation is not None:
            q = q @ self.rotation.to(q.dtype)
        if self.quantized and T <= CHUNKED_MAX_T:
            # codes read where they lie (caramba.cache.attend), from each head's slots copied out
            views = [s.dense_view(end) if s.quantized else _FloatView(s.read(end, s.data.dtype)) for s in self.streams]
            out = attend_chunked(q, *views, end, layer_mask)
        else:
            keys, values = self.k_stream.read(end, q.dtype), self.v_stream.read(end, q.dtype)   # [B, KVH, end, D]
            out = torch.nn.functional.scaled_dot_product_attention(
                q, keys, values, attn_mask=layer_mask.repeat_interleave(H // self.n_kv_heads, dim=1), enable_gqa=True)
        return out if self.v_rotation is None else out @ self.v_rotation.to(out.dtype)


class _FloatView:
    """A float stream's slots [B, KVH, end, D] as caramba.cache.attend reads a FloatStream."""

    quantized = False

    def __init__(self, data: torch.Tensor) -> None:
        self.data, self.n_heads = data, data.shape[1]


class PressedKVCache(KVCache):
    """Layers of different widths after a ragged press (PressedLayerKVCache); lengths, room and
    masks are in the model's slot numbers: the widest layer's."""

    def __init__(self, layers: list[PressedLayerKVCache]) -> None:
        super().__init__(layers)

    @property
    def length(self) -> int:
        first = self.layers[0]
        return first.length + first.offset

    @property
    def max_seq_len(self) -> int:
        first = self.layers[0]
        return first.max_seq_len + first.offset

    def truncate(self, n: int) -> None:
        for layer in self.layers:
            layer.truncate(n - layer.offset)

    def attention_mask(self, B: int, T: int, slot_mask: torch.Tensor | None, device: torch.device,
                       window: int | None = None, model_window: int | None = None) -> tuple[torch.Tensor, bool]:
        if window is not None or self.window is not None or model_window is not None:
            raise ValueError("a pressed cache with per-layer or per-head budgets has no sliding window")
        mask, causal = super().attention_mask(B, T, slot_mask, device)
        if mask is None:   # spelled out: each layer maps it onto its own slots
            start = self.length
            q_slot = torch.arange(start, start + T, device=device)[:, None]
            mask = (torch.arange(start + T, device=device)[None, :] <= q_slot).expand(B, 1, T, start + T)
        return mask, False
