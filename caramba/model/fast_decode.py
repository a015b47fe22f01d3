"""The decode step of a Llama-family model as one C call (decode_step.c), on the CPU.

A batch-1 decode step through torch spends nearly as long dispatching ~300 small ops as reading
the weights (docs/decode-speed.md). Where it applies, Transformer.forward hands the step to
`step`, which runs every layer, the final norm and the head in one parallel region, reading the
weights in the layouts the model holds (fp32 nn.Linear / InputMajorLinear, or QuantLinear's
blocks) and writing K and V into the cache as the torch path does.

It applies to one new token per row (padding and sliding windows come as the cache's mask) on
an fp32 model with RMSNorm, RoPE and SwiGLU, projections of the kinds above, and a KVCache of
plain layers whose streams are fp32, per-token q8_0 / q4_0 / q4_0l / nf4 / q4_1 / q2_1 (with or
without a residual window) or per-channel q4_1c / q2_1c keys, stored rotated or not (rotate_keys,
rotate_values). The step writes the new token's codes with caramba.cache.quant's arithmetic, bit
for bit, completes per-channel groups, and keeps the streams' rings and their bookkeeping as the
torch path does (kv_stream.c). Everything else takes the torch path, which stays the reference
(tests compare the two): per-channel values, ring-buffer caches, fp16/bf16 caches, and a step
that must first refill a per-channel group a rollback went into. `model.fast_decode = False` or
CARAMBA_KERNELS=0 turns it off. The thread count starts from torch's, which a Generator sets
from the cores free (caramba.threads), and adapts to a busy machine (ThreadChoice;
`model.decode_threads = ThreadChoice(fixed=n)` or CARAMBA_THREADS=n pins it).
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from caramba import kernels, threads
from caramba.cache.layer import KVCache, LayerKVCache
from caramba.cache.ring import RingKVCache, RingLayerKVCache
from caramba.cache.kinds import KVCacheKind
from caramba.cache.streams import ChannelQuantStream, FloatStream, QuantStream
from caramba.model import quant
from caramba.model.layers import MLP, Attention, InputMajorLinear, RMSNorm
from caramba.model.step_abi import LayerPlan, Lin, StepArgs, Stream

# the step (decode_step.c) and the files it calls, compiled together: each shares what the
# others use through its header (decode_step.h, kv_stream.h, decode_ops.h, quant_gemv.h, cpu_isa.h)
SOURCES = [Path(__file__).with_name(name) for name in
           ("decode_step.c", "kv_stream.c", "decode_ops.c", "quant_gemv.c", "cpu_isa.c")]
MAX_ROWS = 16        # beyond this the torch path's GEMMs win
_P, _I = ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {"decode_step": ([_P], _I), "step_linear": ([_P, _P, _I, _P, _I], _I), "step_abi_layout": ([_P], _I),
               "quantize_kv": ([_I, _P, _I, _I, _I, _P, _P], None), "kv_nf4_tables": ([_P, _P], None),
               **quant.ISA_SIGNATURES}
library = kernels.Library(SOURCES, _SIGNATURES, "decode steps run through torch's ops")

# decode_step.c's cache stream kinds: KindSpec.step, the ids caramba/cache/kinds.h gives the C side
KV_FP32 = KVCacheKind.FP32.spec.step
TOKEN_KINDS = {k: k.spec.step for k in KVCacheKind
               if k.spec.step is not None and k.spec.quantized and not k.spec.per_channel}
CHANNEL_KINDS = {k: k.spec.step for k in KVCacheKind if k.spec.step is not None and k.spec.per_channel}   # keys only

# decode_step.c's projection formats (quant_gemv.h's ids, kept in caramba.model.quant)
from caramba.model.quant import (F32_COLS, F32_ROWS, Q4_0_Q8, Q4_0_Q8_X16, Q4_1_F32, Q4_1_F32_X16,  # noqa: E402,F401
                                 Q4_1_I16, Q4_1_I16_X16, Q4_1_Q8, Q4_1_Q8_X16, Q8_0_F32, Q8_0_F32_X16, Q8_0_I16,
                                 Q8_0_I16_X16, Q8_0_Q8, Q8_0_Q8_X16)
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
    elif type(module) is quant.QuantLinear and (module.out_features, module.in_features) == (n, k) \
            and module.qs.device.type == "cpu":
        fmt, tensors = _QUANT_FORMATS[(module.fmt, module.act, module.layout)], [module.qs, module.d, module.m]
    else:
        return None
    tensors.append(bias)
    return Lin(fmt, n, k, *(None if t is None else t.data_ptr() for t in tensors)), [t for t in tensors if t is not None]


class _Plan:
    """The model's weights as decode_step.c reads them: a LayerPlan per layer and the head's Lin."""

    usable = True

    def __init__(self, model, modules: list) -> None:
        cfg = model.config
        self.registrations = _registrations
        self.hooks = _hook_dicts(modules)
        self.layers, keep = (LayerPlan * len(model.layers))(), []
        qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
        for plan, layer in zip(self.layers, model.layers):
            a, m = layer.attn, layer.mlp
            plan.attn_norm, plan.mlp_norm = layer.attn_norm.weight.data_ptr(), layer.mlp_norm.weight.data_ptr()
            keep += [layer.attn_norm.weight, layer.mlp_norm.weight]
            for name, mod, n, k in (("qkv", a.wqkv, qkv, cfg.dim), ("o", a.wo, cfg.dim, cfg.n_heads * cfg.head_dim),
                                    ("w13", m.w13, 2 * cfg.intermediate_size, cfg.dim),
                                    ("w2", m.w2, cfg.dim, cfg.intermediate_size)):
                got = _linear(mod, n, k)
                if got is None:
                    raise _NoKernel
                setattr(plan, name, got[0])
                keep += got[1]
        head = _linear(model.head, cfg.vocab_size, cfg.dim)
        if head is None:
            raise _NoKernel
        self.head = head[0]
        self.keep = keep + head[1] + [model.norm.weight]   # the pointers stay valid while the plan lives
        self.pointers = [t.data_ptr() for t in self.keep]


class _NoKernel(Exception):
    pass


def _module_list(model) -> list:
    """Every module whose forward the C step stands in for."""
    return [model.head, model.norm] + [m for layer in model.layers
                                       for m in (layer, layer.attn, layer.mlp, layer.attn_norm, layer.mlp_norm,
                                                 layer.attn.wqkv, layer.attn.wo, layer.mlp.w13, layer.mlp.w2)]


# Every submodule, parameter or buffer registered anywhere in the process (module swaps such as
# quantize_model's included) counts here, so a cached plan knows in O(1) that it may be stale.
_registrations = 0


def _count_registration(*_args) -> None:
    global _registrations
    _registrations += 1


torch_module.register_module_module_registration_hook(_count_registration)
torch_module.register_module_parameter_registration_hook(_count_registration)
torch_module.register_module_buffer_registration_hook(_count_registration)


def _plan(model) -> _Plan | None:
    """The cached plan, rebuilt after any registration (a swapped module) or when the weights moved
    (.to()); None when the weights have no kernel or a forward hook is set on a module the step
    stands in for (contrastive search reads the final norm's output through one)."""
    plan = model.__dict__.get("_fast_plan")
    if plan is None or plan.registrations != _registrations or (
            plan.pointers[0] != plan.keep[0].data_ptr() or plan.pointers[-1] != plan.keep[-1].data_ptr()):
        # remembered until a module or the weights change (a swap registers; .to() moves them)
        if not model_applies(model):
            plan = _Unusable(model, [])
        else:
            modules = _module_list(model)
            try:
                plan = _Plan(model, modules)
            except _NoKernel:
                plan = _Unusable(model, modules)
        model._fast_plan = plan
    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks or any(plan.hooks):
        return None
    return plan if plan.usable else None


class _Unusable:
    """A model the step cannot compute (another architecture, dtype or device) or whose weights it
    cannot read (a projection of another kind); its final norm's weight tells a .to() apart."""

    usable = False

    def __init__(self, model, modules: list) -> None:
        self.registrations = _registrations
        self.hooks = _hook_dicts(modules)
        self.keep = [model.norm.weight]
        self.pointers = [model.norm.weight.data_ptr()]


def _hook_dicts(modules: list) -> list:
    """The (live) forward-hook dicts of the modules: non-empty once a hook is registered."""
    return [d for m in modules for d in (m._forward_hooks, m._forward_pre_hooks)]


def model_applies(model) -> bool:
    """Whether the model's architecture is one decode_step.c computes (not its weights' formats)."""
    cfg = model.config
    if (cfg.norm, cfg.mlp, cfg.positions, cfg.attention) != ("rms", "swiglu", "rope", "standard") \
            or model.dtype != torch.float32 or model.device.type != "cpu" or cfg.head_dim > 512 \
            or cfg.n_heads // cfg.n_kv_heads > 64:
        return False
    layer = model.layers[0]
    return type(layer.attn) is Attention and type(layer.mlp) is MLP and type(layer.attn_norm) is RMSNorm \
        and type(model.norm) is RMSNorm


def _stream_kind(stream, keys: bool, head_dim: int) -> int | None:
    """decode_step.c's kind of a cache stream (kv_stream.c), or None (the torch path): fp32 values,
    per-token q8_0 / q4_0 / q4_0l / nf4 / q4_1 / q2_1 codes (with or without a residual window), or
    per-channel q4_1c / q2_1c keys; codes in the layout the stream's role gives them."""
    if stream.head_dim != head_dim:
        return None
    if type(stream) is FloatStream:
        return KV_FP32 if _fp32(stream.data) else None
    if type(stream) is QuantStream:
        kind = TOKEN_KINDS.get(stream.kind)
    elif type(stream) is ChannelQuantStream and keys:
        kind = CHANNEL_KINDS.get(stream.kind)
    else:
        return None
    if kind is None or stream.keys_major != keys or stream.codes.device.type != "cpu" \
            or not (stream.codes.is_contiguous() and stream.scales.is_contiguous() and _fp32(stream.ring)):
        return None
    return kind


class _Layout:
    """What decode_step.c takes of a cache: per layer, K then V, (stream, kind, rotation or None);
    the streams whose full-precision ring the step keeps up (`ringed`) and the per-channel ones.
    `table` holds decode_step.c's Streams once _stream_table has built them, `bound` the
    (stream, attribute, tensor) they point into and `fp_slots` the (index, stream) of the entries
    whose r0 moves with every step."""

    def __init__(self, streams: list[tuple], heads: int, head_dim: int) -> None:
        self.streams, self.heads, self.head_dim = streams, heads, head_dim
        self.ringed = [s for s, kind, _ in streams if kind != KV_FP32 and s.ring is not None]
        self.channels = [s for s, kind, _ in streams if kind in CHANNEL_KINDS.values()]
        self.table: ctypes.Array | None = None    # of step_abi.Stream
        self.bound: list[tuple] = []
        self.fp_slots: list[tuple] = []


def _cache_layout(cache) -> _Layout | None:
    """The cache's _Layout when the step can read and write every layer of it, else None. Decided
    once per cache: its layer types, kinds and rotations are fixed when it is built."""
    if "_fast_decode_layout" not in cache.__dict__:
        cache._fast_decode_layout = _scan_layout(cache)
    return cache._fast_decode_layout


def _scan_layout(cache) -> _Layout | None:
    if any(type(layer) not in (LayerKVCache, RingLayerKVCache) for layer in cache.layers):
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
    return _Layout(streams, H, D)


def _stream_table(layout: _Layout, slot: int, T: int = 1) -> ctypes.Array:
    """decode_step.c's Streams (kv_stream.h) for a step writing slots [slot, slot + T).
    Built once per set of tensors (a reorder replaces them): a step only moves each quantized
    stream's r0 (its fp_start) on, after the rings' bookkeeping (note_written: the step writes
    their new tokens). Rebuilding the table each step cost ~0.13 ms of Python per token."""
    if layout.table is None or any(getattr(s, name) is not t for s, name, t in layout.bound):
        _build_table(layout)
    table, end = layout.table, slot + T
    for s in layout.ringed:
        s.note_written(slot, end)
    for i, s in layout.fp_slots:
        table[i].r0 = s.fp_start(end)
    return table


def _build_table(layout: _Layout) -> None:
    table, bound, fp_slots = (Stream * len(layout.streams))(), [], []
    for i, (s, kind, rotation) in enumerate(layout.streams):
        rot = None if rotation is None else rotation.data_ptr()
        if kind == KV_FP32:           # its values, read as a ring of every slot
            table[i] = Stream(KV_FP32, s.data.data_ptr(), None, 1, s.data.data_ptr(), s.data.shape[2], 0, rot)
            bound.append((s, "data", s.data))
            continue
        ring = s.ring
        fp_slots.append((i, s))
        table[i] = Stream(kind, s.codes.data_ptr(), s.scales.data_ptr(), s.block,
                          None if ring is None else ring.data_ptr(), 0 if ring is None else ring.shape[2], 0, rot)
        bound += [(s, "codes", s.codes), (s, "scales", s.scales), (s, "ring", ring)]
    layout.table, layout.bound, layout.fp_slots = table, bound, fp_slots


def applies(model, tokens: torch.Tensor, cache, mask: torch.Tensor | None, causal: bool) -> bool:
    """Whether this forward is a step decode_step.c can take. mask, causal: the cache's attention
    mask for it (KVCache.attention_mask: None, or [B, 1, T, slots] in slot order). Causal without
    a mask is a first chunk into an empty cache, which the step's own rule gives: new token t sees
    the cached slots and new tokens 0..t."""
    B, T = tokens.shape
    if B * T > MAX_ROWS or not getattr(model, "fast_decode", True):
        return False
    if mask is None and causal != (T > 1):
        return False
    if mask is not None and (causal or mask.dtype != torch.bool or tuple(mask.shape) != (B, 1, T, cache.length + T)):
        return False
    if type(cache) not in (KVCache, RingKVCache) or torch.is_grad_enabled() and model.norm.weight.requires_grad:
        return False
    # A sliding window's ring holds slot s at s % capacity: until it first wraps, storage order is
    # slot order and the step (which writes slot `length` and reads slots below it, masked by the
    # window) is exact. After that it would need ring addressing in decode_step.c: the torch path.
    if type(cache) is RingKVCache and cache.length + T > cache.capacity:
        return False
    layout = _cache_layout(cache)
    if layout is None or (layout.heads, layout.head_dim) != (model.config.n_kv_heads, model.config.head_dim) \
            or cache.batch_size != B or any(s.refills(cache.length) for s in layout.channels) \
            or T > 1 and layout.channels:      # a per-channel group is completed one token at a time
        return False
    if library() is None:
        return False
    return _plan(model) is not None


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


def step(model, tokens: torch.Tensor, positions: torch.Tensor | None, cache: KVCache,
         mask: torch.Tensor | None, last_only: bool = False) -> torch.Tensor:
    """logits [B, T, vocab] ([B, 1, vocab] with last_only) of T new tokens per row, their K and V
    appended to the cache; mask [B, 1, T, slots] (True: attend) or None, as `applies` took it."""
    cfg = model.config
    B, T = tokens.shape
    slot = cache.length
    cache.check_room(T)
    if positions is None:
        positions = torch.arange(slot, slot + T).expand(B, T)
    positions = positions.reshape(B * T).to(torch.int64).contiguous()
    table = model._rope
    if table is None or table.cos.shape[0] <= int(positions.max()) or table.cos.device != model.device:
        model.rotary(positions[:, None])          # grows the table; its rows are read in C
        table = model._rope
    x = model.embed_tokens(tokens).reshape(B * T, cfg.dim).contiguous()   # read only
    logits = torch.empty(B, 1 if last_only else T, cfg.vocab_size)
    plan = model._fast_plan          # as applies() just checked it
    if mask is not None:
        mask = mask.contiguous()
    streams = _stream_table(cache._fast_decode_layout, slot, T)     # as applies() just found it
    choice = model.__dict__.setdefault("decode_threads", ThreadChoice())
    threads = choice.next(B * T)
    args = StepArgs(cfg.n_layers, ctypes.addressof(plan.layers), ctypes.addressof(plan.head), model.norm.weight.data_ptr(),
                    ctypes.addressof(streams), x.data_ptr(), logits.data_ptr(), B * T, T, int(last_only), cfg.dim,
                    cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.intermediate_size, cache.max_seq_len, slot,
                    positions.data_ptr(), None if mask is None else mask.data_ptr(), table.cos.data_ptr(),
                    table.sin.data_ptr(), cfg.norm_eps, threads)
    t0 = time.perf_counter()
    failed = library().decode_step(ctypes.byref(args))
    choice.took(threads, time.perf_counter() - t0, B * T)
    if failed == 1:
        raise MemoryError("the fused decode step could not allocate its scratch")
    if failed:
        raise ValueError(f"decode_step.c refused the shapes (code {failed}); fast_decode.applies should have")
    for layer in cache.layers:
        layer.length = slot + T
    return logits
