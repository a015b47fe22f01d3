"""The decode step of a Llama-family model as one C call (decode_step.c), on the CPU.

A batch-1 decode step through torch spends nearly as long dispatching ~300 small ops as reading
the weights (docs/decode-speed.md). Where it applies, a CStep (the backend below) hands the
forward to `step`, which runs every layer, the final norm and the head in one parallel region, reading the
weights in the layouts the model holds (fp32 nn.Linear / InputMajorLinear, or QuantLinear's
blocks) and writing K and V into the cache as the torch path does.

It applies to up to MAX_ROWS new token rows (padding and sliding windows come as the cache's
mask) on an fp32 model with RMSNorm, RoPE and SwiGLU or GeGLU, projections of the kinds above,
and a KVCache of plain layers whose streams are fp32, fp16, bf16, per-token q8_0 / q4_0 / q4_0l /
nf4 / q4_1 / q2_1 (with or without a residual window) or per-channel q4_1c / q2_1c keys, stored
rotated or not (rotate_keys, rotate_values). The step writes the new token's codes with
caramba.cache.quant's arithmetic, bit for bit (fp16 / bf16 values rounded as torch's copy rounds
them), completes per-channel groups, and keeps the streams' rings and their bookkeeping as the
torch path does (kv_stream.c). Everything else takes the torch path, which stays the reference
(tests compare the two): per-channel values, and a step that must first refill a per-channel
group a rollback went into.

The newer families' parts (caramba.model.config) are computed too: QK-norm per head or over the
projection (Qwen3, Gemma 3, OLMo 2), post-norms and no pre-norms (Gemma, OLMo 2), GeGLU, the
queries' scale (Gemma's query_pre_attn_scalar), and hybrid models' sliding layers with their own
mask and RoPE base (Gemma 3); the scaled embeddings and the logits' soft cap are applied here
around the call (model.embed_tokens, model.cap_logits); Gemma 2's attention soft cap is applied to
the scores in C, as softcapped_attention does. Ring caches are read in their storage order, across
their wraps: a RingKVCache (--local-window) and a HybridKVCache's sliding layers (caramba.cache.hybrid), per-token kinds
without a residual window as those caches hold.

The step is a backend (caramba.model.backend): `CStep(model)` reads the model's weights once, when
it is built, and whoever drives decoding builds and owns it (a DecodeState, so the Generator and
every other decoder; backend.choose picks it or the torch path). The decoder's own forward never
comes here. A model changed afterwards (quantize_model, .to(), a module swap) needs a new CStep.
The thread count starts from torch's, which a Generator sets from the cores free
(caramba.threads), and adapts to a busy machine (ThreadChoice, owned by the CStep;
`CStep(model, ThreadChoice(fixed=n))` or CARAMBA_THREADS=n pins it).

A joined step (`CStep.step_joined`, `step_joined`: caramba.evaluation.joined's candidates) takes one
decode token for the rows of several caches in one call (decode_step.c's decode_step_joined): each
cache a segment with its own streams, slot, masks and positions, checked as `applies` checks a
single step, up to JOIN_MAX_ROWS rows in all (JOIN_MEAN_ROWS a cache); the projections, MLP and
head run once over all the rows. Its logits are each cache's own step's up to the rounding of a
product over more rows (bit for bit one step of a single cache holding the same rows); with
`CStep(exact_rows=True)` bit for bit: a lone row's fp32 [N, K] products are then summed as a
batch's tiles sum each row (the perplexity protocol's lockstep, caramba.evaluation.evaluate).
`step_joined(..., stepwise=True)` takes up to MAX_ROWS consecutive tokens of each cache's one row
(a teacher-forced text), fed as that many steps would feed them (decode_step.h's
StepArgs.stepwise): with exact rows each token's logits and the cache are its steps' bit for bit,
while the weights are read once for all of them. Caches with a ring, a residual window or per-
channel keys are not taken that way (their boundaries move from one token to the next).

A ragged press's PressedKVCache (caramba.cache.evict: per-layer and per-head budgets) is read
too: each layer its own width, each head only its run of survivors, in place, from a dense layer
or a packed one (caramba.cache.packed: each Stream gets the store's size and each row and head's
origin in it).
"""

from __future__ import annotations

import ctypes
import time

import torch
from torch import nn

from caramba import kernel_build, kernels, threads
from caramba.cache.evict import PackedLayerKVCache, PressedKVCache, PressedLayerKVCache
from caramba.cache.hybrid import HybridKVCache, SlidingLayerKVCache
from caramba.cache.packed import PackedChannelStream, PackedFloatStream, PackedQuantStream
from caramba.cache.layer import KVCache, LayerKVCache
from caramba.cache.ring import RingKVCache, RingLayerKVCache
from caramba.cache.kinds import KVCacheKind
from caramba.cache.streams import ChannelQuantStream, FloatStream, QuantStream
from caramba.model import quant
from caramba.model.layers import MLP, Attention, InputMajorLinear, RMSNorm
from caramba.model.step_abi import LayerPlan, Lin, StepArgs, Stream

# the step (decode_step.c) and the files it calls, compiled together: each shares what the
# others use through its header (decode_step.h, step_linear.h, kv_stream.h, decode_ops.h, quant_gemv.h,
# cpu_isa.h); the quantized products' files are quant.SOURCES (cpu_isa.c among them)
SOURCES = kernel_build.sources("decode_step")   # caramba.kernel_build.LIBRARIES: one list, setup.py's too
MAX_ROWS = 16        # beyond this the torch path's GEMMs win
# A joined step (step_joined) takes up to JOIN_MAX_ROWS rows in all, JOIN_MEAN_ROWS a cache on average:
# beyond, the torch join's GEMMs and batched attention win. SmolLM2-135M, mixed kinds, Zen 4, joined C
# / torch join since the attention reads values straight from their codes: 2 threads at 1024 tokens
# of context, 9 caches of 4 rows 0.71, 4 of 8 0.78, 9 of 8 0.88, 2 of 16 0.89, 4 of 16 1.01, 1 of 32
# 1.05 (at 2048: 4 of 8 0.88, 9 of 8 0.90); 1 thread at 1024: 24 of 1 0.59, 4 of 8 0.93, 9 of 8 1.01
JOIN_MAX_ROWS, JOIN_MEAN_ROWS = 72, 8
_P, _I = ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {"decode_step": ([_P], _I), "decode_step_joined": ([_P, _I], _I),
               "step_linear": ([_P, _P, _I, _P, _I, _I], _I), "step_abi_layout": ([_P], _I),
               "quantize_kv": ([_I, _P, _I, _I, _I, _P, _P], None), "kv_nf4_tables": ([_P, _P], None),
               "kv_round_floats": ([_I, _P, _I, _P], None),
               **quant.ISA_SIGNATURES}
library = kernels.Library(SOURCES, _SIGNATURES, "decode steps run through torch's ops")

# decode_step.c's cache stream kinds: KindSpec.step, the ids caramba/cache/kinds.h gives the C side
KV_FP32 = KVCacheKind.FP32.spec.step
FLOAT_KINDS = {k.spec.dtype: k.spec.step for k in KVCacheKind if k.spec.step is not None and not k.spec.quantized}
TOKEN_KINDS = {k: k.spec.step for k in KVCacheKind
               if k.spec.step is not None and k.spec.quantized and not k.spec.per_channel}
CHANNEL_KINDS = {k: k.spec.step for k in KVCacheKind if k.spec.step is not None and k.spec.per_channel}   # keys only

# decode_step.c's projection formats (quant_gemv.h's ids, kept in caramba.model.quant)
from caramba.model.quant import (F32_COLS, F32_ROWS, Q4_0_Q8, Q4_0_Q8_X16, Q4_1_F32, Q4_1_F32_X16,  # noqa: E402,F401
                                 Q4_1_I16, Q4_1_I16_X16, Q4_1_Q8, Q4_1_Q8_X16, Q4_K_F32, Q4_K_I16, Q5_0_F32, Q5_0_I16,
                                 Q5_1_F32, Q5_1_I16, Q5_K_F32, Q5_K_I16, Q6_K_F32, Q6_K_I16, Q8_0_F32, Q8_0_F32_X16,
                                 Q8_0_I16, Q8_0_I16_X16, Q8_0_Q8, Q8_0_Q8_X16)
_QUANT_FORMATS = quant.FORMAT_IDS   # (fmt, act, layout) -> id


def status() -> str:
    """'c' when the fused decode step is available, else why not."""
    return library.status()


def _fp32(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous())


def _linear(module: nn.Module, n: int, k: int) -> tuple[Lin, list[torch.Tensor]] | None:
    """A projection as the step reads it (decode_step.h's Lin) and the tensors it points into, or
    None when the step has no kernel for it."""
    bias = getattr(module, "bias", None)
    if not _fp32(bias):
        return None
    if type(module) is nn.Linear and _fp32(module.weight) and tuple(module.weight.shape) == (n, k):
        fmt, tensors = F32_ROWS, [module.weight, None, None]
    elif type(module) is InputMajorLinear and _fp32(module.weight_t) and tuple(module.weight_t.shape) == (k, n):
        fmt, tensors = F32_COLS, [module.weight_t, None, None]
    elif type(module) is InputMajorLinear and module.layout == "rows" and _fp32(module.weight_t.t()) \
            and tuple(module.weight_t.shape) == (k, n):   # held row-major (InputMajorLinear.hold_row_major)
        fmt, tensors = F32_ROWS, [module.weight_t.t(), None, None]
    elif type(module) is quant.QuantLinear and (module.out_features, module.in_features) == (n, k) \
            and module.c_readable():   # not after a cast of its fp16 scales to fp32, say
        fmt, tensors = _QUANT_FORMATS[(module.fmt, module.act, module.layout)], [module.qs, module.d, module.m]
    else:
        return None
    tensors.append(bias)
    return Lin(fmt, n, k, *(None if t is None else t.data_ptr() for t in tensors)), [t for t in tensors if t is not None]


def _norms(layer) -> dict[str, nn.Module | None]:
    """A block's norms by LayerPlan field (None, or nn.Identity: the block has none)."""
    attn = layer.attn
    return {"attn_norm": layer.attn_norm, "mlp_norm": layer.mlp_norm, "q_norm": getattr(attn, "q_norm", None),
            "k_norm": getattr(attn, "k_norm", None), "post_attn_norm": getattr(layer, "post_attn_norm", None),
            "post_mlp_norm": getattr(layer, "post_mlp_norm", None)}


def _norm_weight(norm: nn.Module | None, eps: float) -> torch.Tensor | None:
    """An RMSNorm's weight as the step reads it (the model's eps, every norm's in C), None for no
    norm; raises _NoKernel for any other module."""
    if norm is None or type(norm) is nn.Identity:
        return None
    if type(norm) is not RMSNorm or norm.eps != eps or not _fp32(norm.weight):
        raise _NoKernel
    return norm.weight


class _Plan:
    """The model's weights as decode_step.c reads them: a LayerPlan per layer and the head's Lin,
    read once (raises _NoKernel when a projection or norm has no kernel). `sliding`: which layers
    are a hybrid model's sliding ones (their own mask and rotary tables)."""

    def __init__(self, model) -> None:
        cfg = model.config
        self.layers, keep = (LayerPlan * len(model.layers))(), []
        self.sliding = [cfg.hybrid and cfg.is_sliding(i) for i in range(len(model.layers))]
        for plan, layer, sliding in zip(self.layers, model.layers, self.sliding):
            keep += self._layer(plan, layer, cfg)
            plan.qk_whole, plan.sliding = cfg.qk_norm == "projection", sliding
        head = _linear(model.head, cfg.vocab_size, cfg.dim)
        if head is None:
            raise _NoKernel
        self.head = head[0]
        self.keep = keep + head[1] + [model.norm.weight]   # the pointers stay valid while the plan lives

    @staticmethod
    def _layer(plan: LayerPlan, layer, cfg) -> list[torch.Tensor]:
        """Fill one LayerPlan's norms and projections; the tensors it points into."""
        keep = []
        for name, norm in _norms(layer).items():
            weight = _norm_weight(norm, cfg.norm_eps)
            if weight is not None:
                setattr(plan, name, weight.data_ptr())
                keep.append(weight)
        a, m = layer.attn, layer.mlp
        qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
        for name, mod, n, k in (("qkv", a.wqkv, qkv, cfg.dim), ("o", a.wo, cfg.dim, cfg.n_heads * cfg.head_dim),
                                ("w13", m.w13, 2 * cfg.intermediate_size, cfg.dim),
                                ("w2", m.w2, cfg.dim, cfg.intermediate_size)):
            got = _linear(mod, n, k)
            if got is None:
                raise _NoKernel
            setattr(plan, name, got[0])
            keep += got[1]
        return keep


class _NoKernel(Exception):
    pass


def model_applies(model) -> bool:
    """Whether the model's architecture is one decode_step.c computes (not its weights' formats):
    a Llama-family decoder with any of the newer families' parts (Gemma 2's attention soft cap too)."""
    cfg = model.config
    if (cfg.norm, cfg.positions, cfg.attention) != ("rms", "rope", "standard") or cfg.mlp not in ("swiglu", "geglu") \
            or model.dtype != torch.float32 or model.device.type != "cpu" \
            or cfg.head_dim > 512 or cfg.n_heads // cfg.n_kv_heads > 64:
        return False
    layer = model.layers[0]
    norms = (*_norms(layer).values(), model.norm)
    return type(layer.attn) is Attention and type(layer.mlp) is MLP and type(model.norm) is RMSNorm \
        and all(n is None or type(n) in (RMSNorm, nn.Identity) for n in norms)


def _stream_kind(stream, keys: bool, head_dim: int) -> int | None:
    """decode_step.c's kind of a cache stream (kv_stream.c), or None (the torch path): fp32, fp16 or
    bf16 values, per-token q8_0 / q4_0 / q4_0l / nf4 / q4_1 / q2_1 codes (with or without a residual window), or
    per-channel q4_1c / q2_1c keys; codes in the layout the stream's role gives them."""
    if stream.head_dim != head_dim:
        return None
    if type(stream) in (FloatStream, PackedFloatStream):
        data = stream.data
        return FLOAT_KINDS.get(data.dtype) if data.device.type == "cpu" and data.is_contiguous() else None
    if type(stream) in (QuantStream, PackedQuantStream):
        kind = TOKEN_KINDS.get(stream.kind)
    elif type(stream) in (ChannelQuantStream, PackedChannelStream) and keys:
        kind = CHANNEL_KINDS.get(stream.kind)
    else:
        return None
    if kind is None or stream.keys_major != keys or stream.codes.device.type != "cpu" \
            or not (stream.codes.is_contiguous() and stream.scales.is_contiguous() and _fp32(stream.ring)):
        return None
    return kind


PRESSED = (PressedLayerKVCache, PackedLayerKVCache)   # a ragged press's layers: their own slots
RINGS = (RingLayerKVCache, SlidingLayerKVCache)       # slot s at storage slot s % capacity (Stream.wrap)


class _Layout:
    """What decode_step.c takes of a cache: per layer, K then V, (stream, kind, rotation or None);
    each layer (`layers`: its slots are the model's minus its offset, a ragged press's; `wraps`: a
    ring's capacity, else 0); the streams whose full-precision ring the step keeps up (`ringed`)
    and the per-channel ones, each with its layer's offset. `table` holds decode_step.c's Streams
    once _stream_table has built them, `bound` the (object, attribute, tensor) they point into and
    `fp_slots` the (index, stream, offset) of the entries whose r0 moves with every step."""

    def __init__(self, streams: list[tuple], layers: list, heads: int, head_dim: int) -> None:
        self.streams, self.layers, self.heads, self.head_dim = streams, layers, heads, head_dim
        self.wraps = [layer.max_seq_len if type(layer) in RINGS else 0 for layer in layers]
        offsets = [_offset(layer) for layer in layers for _ in (0, 1)]
        self.ringed = [(s, o) for (s, kind, _), o in zip(streams, offsets) if kind not in FLOAT_KINDS.values() and s.ring is not None]
        self.channels = [(s, o) for (s, kind, _), o in zip(streams, offsets) if kind in CHANNEL_KINDS.values()]
        self.table: ctypes.Array | None = None    # of step_abi.Stream
        self.bound: list[tuple] = []
        self.fp_slots: list[tuple] = []
        self.firsts: list[torch.Tensor | None] = []   # per layer: _first_valid, which the table points into


def _cache_layout(cache) -> _Layout | None:
    """The cache's _Layout when the step can read and write every layer of it, else None. Decided
    once per cache: its layer types, kinds and rotations are fixed when it is built."""
    if "_fast_decode_layout" not in cache.__dict__:
        cache._fast_decode_layout = _scan_layout(cache)
    return cache._fast_decode_layout


def _offset(layer) -> int:
    """The model's slot of the layer's slot 0 (a ragged press's layers are narrower than the model's)."""
    return layer.offset if type(layer) in PRESSED else 0


def _first_valid(layer) -> torch.Tensor | None:
    """int64 [B, KVH]: each row and head's first valid slot of a ragged press's layer (its
    survivors lie right-aligned in [first, width): caramba.cache.evict), or None when every slot
    is valid; False when the valid slots are not one run below width (the torch path)."""
    if type(layer) is PackedLayerKVCache:
        return layer.first
    valid = layer.valid if type(layer) is PressedLayerKVCache else None
    if valid is None:
        return None
    first = layer.width - valid.sum(dim=-1)
    run = torch.arange(layer.width, device=valid.device) >= first[..., None]
    return first.to(torch.int64).contiguous() if bool((run == valid).all()) else False


def _scan_layout(cache) -> _Layout | None:
    # a pressed hybrid cache's full layers are a ragged press's, offset to its rings' slot numbers
    kinds = PRESSED if type(cache) is PressedKVCache else (LayerKVCache, *RINGS, *PRESSED) \
        if type(cache) is HybridKVCache else (LayerKVCache, *RINGS)
    if any(type(layer) not in kinds or _first_valid(layer) is False for layer in cache.layers):
        return None
    streams = []
    H, D = cache.layers[0].n_kv_heads, cache.layers[0].k_stream.head_dim
    for layer in cache.layers:
        if layer.n_kv_heads != H:
            return None
        for stream, keys, rotation in ((layer.k_stream, True, layer.rotation), (layer.v_stream, False, layer.v_rotation)):
            kind = _stream_kind(stream, keys, D)
            if kind is None or not _fp32(rotation) or rotation is not None and tuple(rotation.shape) != (D, D):
                return None
            streams.append((stream, kind, rotation))
    return _Layout(streams, list(cache.layers), H, D)


def _stream_table(layout: _Layout, slot: int, T: int = 1) -> ctypes.Array:
    """decode_step.c's Streams (kv_stream.h) for a step writing the model's slots [slot, slot + T)
    (each layer's own: minus its offset). Built once per set of tensors (a reorder replaces them):
    a step only moves each quantized stream's r0 (its fp_start) on, after the rings' bookkeeping
    (note_written: the step writes their new tokens). Rebuilding the table each step cost ~0.13 ms
    of Python per token."""
    if layout.table is None or any(getattr(s, name) is not t for s, name, t in layout.bound):
        _build_table(layout)
    table, end = layout.table, slot + T
    for s, off in layout.ringed:
        s.note_written(slot - off, end - off)
    for i, s, off in layout.fp_slots:
        table[i].r0 = s.fp_start(end - off)
    return table


def _build_table(layout: _Layout) -> None:
    table, bound, fp_slots = (Stream * len(layout.streams))(), [], []
    firsts = [_first_valid(layer) for layer in layout.layers]    # the table points into these: kept on the layout
    for i, (s, kind, rotation) in enumerate(layout.streams):
        layer, first = layout.layers[i // 2], firsts[i // 2]
        rot = None if rotation is None else rotation.data_ptr()
        packed = type(layer) is PackedLayerKVCache
        own = (layer.max_seq_len, _offset(layer), None if first is None else first.data_ptr(),
               layer.org.data_ptr() if packed else None, layer.slots.total if packed else 0, layout.wraps[i // 2])
        if i % 2 == 0 and type(layer) is PressedLayerKVCache:    # a reorder replaces valid
            bound.append((layer, "valid", layer.valid))
        if i % 2 == 0 and packed:                                # ... and a packed layer's slots
            bound += [(layer, "first", layer.first), (layer, "slots", layer.slots)]
        if kind in FLOAT_KINDS.values():   # its values, read as a ring of every slot (a packed store's: org + slot)
            n = s.data.shape[0] if packed else s.data.shape[2]   # fp16 / bf16 ones: in codes, no ring
            ring = s.data.data_ptr() if kind == KV_FP32 else None
            table[i] = Stream(kind, s.data.data_ptr(), None, 1, ring, n, 0, rot, *own)
            bound.append((s, "data", s.data))
            continue
        ring = s.ring
        fp_slots.append((i, s, own[1]))
        table[i] = Stream(kind, s.codes.data_ptr(), s.scales.data_ptr(), s.block,
                          None if ring is None else ring.data_ptr(), 0 if ring is None else ring.shape[2], 0, rot, *own)
        bound += [(s, "codes", s.codes), (s, "scales", s.scales), (s, "ring", ring)]
    layout.table, layout.bound, layout.fp_slots, layout.firsts = table, bound, fp_slots, firsts


class ThreadChoice:
    """How many threads the next step runs with: torch's count, unless one thread measures faster.

    Each of the step's ~150 barriers waits for the slowest thread; on a machine busier than its
    cores (another job on a 2-core box) a waiting thread's peer is often descheduled for a whole
    scheduler slice, and a step that takes 10 ms alone took over a second on two threads
    (measured), where one thread stayed near its quiet speed. So the step times itself: every
    `interval` steps it tries the count it is not using, keeps whichever was faster (a running
    mean of recent steps of as many token rows against the trial: a verify of 9 tokens takes longer
    than a step of one), and doubles the interval each time the trial loses, up to MAX_INTERVAL,
    so a settled choice costs almost nothing. `fixed` (or CARAMBA_THREADS) pins a count; the
    count it adapts from is torch's, which caramba.threads sets from the cores free."""

    FIRST_INTERVAL, MAX_INTERVAL = 16, 1024

    def __init__(self, fixed: int | None = None) -> None:
        self.fixed = fixed
        self.current: int | None = None      # the count in use; None until the first step
        self.means: dict[int, float] = {}    # rows -> running mean of recent steps' seconds at `current`
        self.interval = self.FIRST_INTERVAL
        self.countdown = self.FIRST_INTERVAL
        self.adapting = False                # whether the last next() chose (False: pinned, or one thread asked)

    def next(self, rows: int = 1) -> int:
        """The thread count for a step of `rows` token rows."""
        fixed = self.fixed if self.fixed is not None else threads.explicit()    # CARAMBA_THREADS pins it too
        wanted = torch.get_num_threads() if fixed is None else fixed
        # Pinned, or one thread asked (caramba.threads sets torch's count per session): nothing to
        # choose, and such a step's time says nothing about the counts being compared.
        self.adapting = fixed is None and wanted > 1
        if not self.adapting:
            return wanted
        if self.current not in (1, wanted):      # first step, or torch's count changed
            self.current, self.means = wanted, {}
        self.countdown -= 1
        if self.countdown <= 0 and rows in self.means:
            return 1 if self.current != 1 else wanted        # a trial of the other count
        return self.current

    def took(self, threads: int, seconds: float, rows: int = 1) -> None:
        """Record a step's time at `threads`."""
        if self.current is None or not self.adapting:
            return
        mean = self.means.get(rows)
        if threads == self.current:
            self.means[rows] = seconds if mean is None else 0.8 * mean + 0.2 * seconds
            return
        # a trial: switch when it beat the running mean by a clear margin, else back off
        if seconds < 0.8 * mean:
            self.current, self.means, self.interval = threads, {rows: seconds}, self.FIRST_INTERVAL
        else:
            self.interval = min(2 * self.interval, self.MAX_INTERVAL)
        self.countdown = self.interval


def _rope_table(model, positions: torch.Tensor, local: bool = False):
    """The model's rotary table covering the positions (local: the sliding layers' own), grown
    first where it does not; its rows are read in C."""
    name = "_rope_local" if local else "_rope"
    table = getattr(model, name)
    if table is None or table.cos.shape[0] <= int(positions.max()) or table.cos.device != model.device:
        model.rotary(positions[:, None], local=local)
        table = getattr(model, name)
    return table


def _step_args(model, plan: _Plan, cache: KVCache, x: torch.Tensor, logits: torch.Tensor, positions: torch.Tensor,
               masks: tuple, T: int, last_only: bool, tables: tuple, threads: int,
               row_exact: bool, stepwise: bool = False) -> tuple[StepArgs, list]:
    """decode_step.c's StepArgs of one cache's rows (x [M, dim], logits, positions [M] int64,
    masks contiguous or None, tables: the rotary tables, the local ones or None, row_exact: CStep's
    exact_rows, stepwise: StepArgs.stepwise) and what they point
    into that the caller does not hold (the cache's Streams). The cache's streams are noted written
    (_stream_table): the step must follow."""
    cfg = model.config
    slot, (table, local), (mask, mask_local) = cache.length, tables, masks
    streams = _stream_table(cache._fast_decode_layout, slot, T)     # as CStep.applies just found it
    q_factor = model.layers[0].attn.q_factor
    args = StepArgs(
        n_layers=cfg.n_layers, layers=ctypes.addressof(plan.layers), head=ctypes.addressof(plan.head),
        final_norm=model.norm.weight.data_ptr(), streams=ctypes.addressof(streams), x=x.data_ptr(),
        logits=logits.data_ptr(), M=x.shape[0], T=T, last_only=int(last_only), dim=cfg.dim, n_heads=cfg.n_heads,
        n_kv=cfg.n_kv_heads, head_dim=cfg.head_dim, hidden=cfg.intermediate_size,
        max_seq=slot + T if type(cache) is RingKVCache else cache.max_seq_len, slot=slot,
        positions=positions.data_ptr(), mask=None if mask is None else mask.data_ptr(),
        mask_local=None if mask_local is None else mask_local.data_ptr(), cos=table.cos.data_ptr(),
        ssin=table.sin.data_ptr(), cos_local=None if local is None else local.cos.data_ptr(),
        ssin_local=None if local is None else local.sin.data_ptr(), eps=cfg.norm_eps,
        q_factor=1.0 if q_factor is None else q_factor, nthreads=threads, gelu=int(cfg.mlp == "geglu"),
        softcap=cfg.attn_softcap or 0.0, row_exact=int(row_exact), stepwise=int(stepwise))
    return args, [streams]


def _tables(model, positions: torch.Tensor) -> tuple:
    """The rotary tables (and the sliding layers' own, or None) covering the positions."""
    local = _rope_table(model, positions, local=True) if model.config.rope_local_theta is not None else None
    return _rope_table(model, positions), local


def _check(failed: int) -> None:
    if failed == 1:
        raise MemoryError("the fused decode step could not allocate its scratch")
    if failed:
        raise ValueError(f"decode_step.c refused the shapes (code {failed}); CStep.applies should have")


def step(model, tokens: torch.Tensor, positions: torch.Tensor | None, cache: KVCache,
         masks: tuple, last_only: bool = False, *, plan: _Plan, choice: ThreadChoice,
         row_exact: bool = False) -> torch.Tensor:
    """logits [B, T, vocab] ([B, 1, vocab] with last_only) of T new tokens per row, their K and V
    appended to the cache; masks: the full layers' and the sliding layers' attention masks
    [B, 1, T, slots] (True: attend) or None each, as CStep.applies took them; plan: the model's
    weights (CStep's), choice: the thread count's (CStep's), row_exact: its exact_rows."""
    cfg = model.config
    B, T = tokens.shape
    slot = cache.length
    cache.check_room(T)
    if positions is None:
        positions = torch.arange(slot, slot + T).expand(B, T)
    positions = positions.reshape(B * T).to(torch.int64).contiguous()
    x = model.embed_tokens(tokens).reshape(B * T, cfg.dim).contiguous()   # read only
    logits = torch.empty(B, 1 if last_only else T, cfg.vocab_size)
    masks = tuple(None if m is None else m.contiguous() for m in masks)
    threads = choice.next(B * T)
    args, keep = _step_args(model, plan, cache, x, logits, positions, masks, T, last_only,
                            _tables(model, positions), threads, row_exact)
    t0 = time.perf_counter()
    failed = library().decode_step(ctypes.byref(args))
    choice.took(threads, time.perf_counter() - t0, B * T)
    _check(failed)
    for layer in cache.layers:
        layer.length = slot + T - _offset(layer)
    return model.cap_logits(logits)


def step_joined(model, calls: list[tuple], *, plan: _Plan, choice: ThreadChoice,
                row_exact: bool = False, stepwise: bool = False) -> list[torch.Tensor]:
    """One decode token for the rows of several caches in one C call (decode_step_joined): calls
    are (tokens [B_i, 1], positions [B_i, 1] or None, cache, masks) with masks as `step` takes them
    (CStep.step_joined checked every one); each cache's K and V appended as `step` appends them ->
    each call's logits [B_i, vocab]. The projections, MLP and head run once over all the rows.
    stepwise: each call's tokens are [1, T] (one T for all), fed as T steps (StepArgs.stepwise) ->
    logits [1, T, vocab] each."""
    cfg = model.config
    T = calls[0][0].shape[1]
    rows, slots = [c[0].numel() for c in calls], [c[2].length for c in calls]
    positions = [(torch.arange(slot, slot + T).expand(B // T, T) if p is None else p).reshape(B).to(torch.int64)
                 for B, slot, (_, p, _, _) in zip(rows, slots, calls)]
    every = torch.cat(positions).contiguous()     # one array: each segment's rows a view into it
    tables = _tables(model, every)
    x = model.embed_tokens(torch.cat([c[0].reshape(-1) for c in calls])).reshape(sum(rows), cfg.dim).contiguous()
    logits = torch.empty(sum(rows), cfg.vocab_size)
    threads = choice.next(sum(rows))
    segs, keep, at = (StepArgs * len(calls))(), [], 0
    for i, (B, (_, _, cache, masks)) in enumerate(zip(rows, calls)):
        masks = tuple(None if m is None else m.contiguous() for m in masks)
        segs[i], held = _step_args(model, plan, cache, x[at:at + B], logits[at:at + B], every[at:at + B], masks, T,
                                   not stepwise, tables, threads, row_exact, stepwise)
        keep += [masks, held]
        at += B
    t0 = time.perf_counter()
    failed = library().decode_step_joined(segs, len(calls))
    choice.took(threads, time.perf_counter() - t0, sum(rows))
    _check(failed)
    for slot, (_, _, cache, _) in zip(slots, calls):
        for layer in cache.layers:
            layer.length = slot + T - _offset(layer)
    out = model.cap_logits(logits).split(rows, dim=0)
    return [x.view(1, T, -1) for x in out] if stepwise else list(out)


class Unsupported(ValueError):
    """A model decode_step.c cannot compute: CStep(model) refuses it (backend.choose then picks
    the torch path)."""


class CStep:
    """The fused C step as a decoding backend (caramba.model.backend): called like the model, it
    takes every forward decode_step.c can compute (`applies`) and gives the others to the model's
    own forward, the torch path. Its plan holds the model's weights as they are when it is built:
    after changing the model (quantize_model, .to(), a module swap) build a new one. Its steps
    run no module's forward, so forward hooks see none of them: a caller that needs them (the
    contrastive search reads the final norm's output) uses backend.TorchStep.

    exact_rows: a single token row's fp32 [N, K] products summed as a batch's tiles sum each row
    (StepArgs.row_exact), so that every row's logits are the same bits whether it steps alone or
    joined with other rows (step_joined); a scoring protocol's (caramba.evaluation.evaluate), whose
    kept scores a later candidate alone must match. Off, a lone row takes dot_f32's four
    accumulators, 3-4% faster (one row of SmolLM2, Zen 4) and within fp32 rounding of that."""

    name = "c"

    def __init__(self, model, threads: ThreadChoice | None = None, exact_rows: bool = False) -> None:
        if library() is None:
            raise Unsupported(f"the fused decode step is unavailable: {status()}")
        if not model_applies(model):
            raise Unsupported("decode_step.c computes fp32 Llama-family models on the CPU (RMSNorm, RoPE, SwiGLU or "
                              "GeGLU, standard attention): use the torch path "
                              "(caramba.model.backend.TorchStep)")
        try:
            self.plan = _Plan(model)
        except _NoKernel:
            raise Unsupported("a projection or norm of this model is of a kind decode_step.c cannot read (fp32 "
                              "nn.Linear, InputMajorLinear or CPU QuantLinear; RMSNorm at the model's eps): use the "
                              "torch path") from None
        self.model = model
        self.threads = ThreadChoice() if threads is None else threads
        self.exact_rows = exact_rows
        self.steps = {"c": 0, "torch": 0}     # forwards of up to MAX_ROWS token rows, by the path taken

    @property
    def path(self) -> str:
        """Which path the steps took: 'c', 'torch', or both with their counts."""
        c, t = self.steps["c"], self.steps["torch"]
        return "torch" if t and not c else "c" if not t else f"c ({c} steps), torch ({t})"

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, cache: KVCache | None = None,
                 slot_mask: torch.Tensor | None = None, last_only: bool = False, window: int | None = None) -> torch.Tensor:
        """The model's forward (Transformer.forward's arguments and logits), through decode_step.c
        where it applies."""
        B, T = tokens.shape
        if cache is not None and B * T <= MAX_ROWS:
            cache.check_room(T)
            masks = self.masks(B, T, cache, slot_mask, tokens.device, window)
            if masks is not None and self.applies(tokens, cache, masks):
                self.steps["c"] += 1
                masks = tuple(None if pair is None else pair[0] for pair in masks)
                return step(self.model, tokens, positions, cache, masks, last_only, plan=self.plan, choice=self.threads,
                            row_exact=self.exact_rows)
            self.steps["torch"] += 1
        return self.model(tokens, positions, cache, slot_mask, last_only=last_only, window=window)

    def step_joined(self, calls: list[tuple], partial: bool = False,
                    stepwise: bool = False) -> list[torch.Tensor | None] | None:
        """One decode token for several caches' rows in one C call (caramba.evaluation.joined): calls
        are the forwards each state asked for, (tokens [B_i, 1], positions, cache, slot_mask), each
        a last-only step of its own cache -> each one's logits [B_i, vocab], its cache written as
        `__call__` writes it; None (nothing done) unless every one is a step decode_step.c takes,
        of distinct caches, up to JOIN_MAX_ROWS rows in all and JOIN_MEAN_ROWS a cache on average.
        partial: those it takes join, and each other call's place holds None (its caller steps it
        alone: a cache the C step refuses at this step); None only when it takes none.
        stepwise: each call's tokens are T consecutive tokens of one row, [1, T] (one T for all, at
        most MAX_ROWS), fed as T steps would feed them (StepArgs.stepwise: with exact_rows each
        token's logits are its step's, bit for bit) -> logits [1, T, vocab] each; the join's row
        limits do not apply (the torch join is no alternative: it is not those bits). Caches with a
        ring, a residual window or per-channel keys are not taken."""
        def fits(taken: list) -> bool:
            return stepwise or sum(c[0].shape[0] for c in taken) <= min(JOIN_MAX_ROWS, JOIN_MEAN_ROWS * len(taken))

        if len({id(c[2]) for c in calls}) < len(calls) or not partial and not fits(calls) \
                or len({c[0].shape[1] for c in calls}) > 1:
            return None
        checked = [self._joinable(*call, stepwise=stepwise) for call in calls]   # every one first: nothing is written before
        taken = [c for c in checked if c is not None]
        if not taken or len(taken) < len(calls) and not partial or not fits(taken):
            return None
        self.steps["c"] += len(taken)
        got = iter(step_joined(self.model, taken, plan=self.plan, choice=self.threads, row_exact=self.exact_rows,
                               stepwise=stepwise))
        return [None if c is None else next(got) for c in checked]

    def _joinable(self, tokens: torch.Tensor, positions, cache, slot_mask, stepwise: bool = False) -> tuple | None:
        """A call of step_joined's with its masks as the C step reads them, or None: not one it takes."""
        B, T = tokens.shape
        if cache is None or (T != 1 if not stepwise else B != 1):
            return None
        cache.check_room(T)
        masks = self.masks(B, T, cache, slot_mask, tokens.device, None)
        if masks is None or not self.applies(tokens, cache, masks):
            return None
        if stepwise and T > 1 and not _steps_alike(_cache_layout(cache)):
            return None
        return tokens, positions, cache, tuple(None if pair is None else pair[0] for pair in masks)

    def masks(self, B: int, T: int, cache, slot_mask: torch.Tensor | None, device: torch.device,
              window: int | None) -> tuple | None:
        """The (mask, causal) of the full layers and of the sliding ones (None: the model has none), as
        the model builds them per layer (Transformer.layer_masks); None when layers of one type differ."""
        model, sliding = self.model, self.plan.sliding
        if not model.config.hybrid:
            return model.cache_mask(B, T, cache, slot_mask, device, window), None
        per_layer = model.layer_masks(B, T, cache, slot_mask, device, window)
        full, local = per_layer[sliding.index(False)], per_layer[sliding.index(True)]
        if any(pair is not (local if s else full) for pair, s in zip(per_layer, sliding)):
            return None
        return full, local

    def applies(self, tokens: torch.Tensor, cache, masks: tuple) -> bool:
        """Whether this forward is a step decode_step.c can take. masks: `masks`' (mask, causal) of
        each layer type (KVCache.attention_mask: None, or [B, 1, T, slots] in the order the layers
        store their slots)."""
        B, T = tokens.shape
        model = self.model
        if B * T > MAX_ROWS or type(cache) not in (KVCache, RingKVCache, PressedKVCache, HybridKVCache) \
                or torch.is_grad_enabled() and model.norm.weight.requires_grad:
            return False
        # A ring writes each forward's tokens before it reads (a longer one: the torch path, whose ring
        # reads first or refuses it).
        if type(cache) is RingKVCache and T > cache.max_write \
                or any(type(layer) is SlidingLayerKVCache and not layer.writes_first(T) for layer in cache.layers):
            return False
        layout = _cache_layout(cache)
        if layout is None or (layout.heads, layout.head_dim) != (model.config.n_kv_heads, model.config.head_dim) \
                or cache.batch_size != B or any(s.refills(cache.length - off) for s, off in layout.channels) \
                or T > 1 and layout.channels \
                or any(s.shift is not None for s, _ in layout.channels):   # a per-channel group is completed
            return False   # one token at a time, at the same slot for every row (per-row phases: the torch path)
        return all(pair is None or _mask_fits(*pair, B, T, [w for w, s in zip(layout.wraps, self.plan.sliding)
                                                                if s == local], cache.length)
                   for pair, local in zip(masks, (False, True)))


def _steps_alike(layout: _Layout) -> bool:
    """Whether a chunk can be fed as its steps (StepArgs.stepwise): no ring (its later tokens would
    overwrite slots its earlier ones read), no residual window (its boundary moves each step) and
    no per-channel group."""
    return not any(layout.wraps) and not layout.ringed and not layout.channels


def _mask_fits(mask: torch.Tensor | None, causal: bool, B: int, T: int, wraps: list[int], length: int) -> bool:
    """Whether the step reads a mask as the layers of one type need it: over each layer's slots
    [0, length + T) (a ring's storage slots: the first min(length + T, capacity)). None (no mask)
    and causal is a first chunk into an empty cache, which the step's own rule gives: new token t
    sees the cached slots and new tokens 0..t; a ring past its wrap always has a mask."""
    widths = {min(length + T, w) if w else length + T for w in wraps}
    if mask is None:
        return causal == (T > 1) and widths <= {length + T}
    return not causal and mask.dtype == torch.bool and len(widths) == 1 \
        and tuple(mask.shape) == (B, 1, T, widths.pop())
