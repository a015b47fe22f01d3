"""The fused decode step's C structs (caramba/model/decode_step.h, kv_stream.h) as ctypes Structures.

decode_step.c takes one StepArgs; its weights come as LayerPlans and a head Lin, its cache as
Streams (each layer's K, then V). Field for field the C structs: every field 8 bytes but
StepArgs' eps and q_factor (floats), nthreads and gelu (int32s), softcap (a float) and row_exact
(an int32), three pairs of 4-byte fields, so neither side pads differently.
tests/model/test_step_parts.py checks sizes and offsets against the compiler's (step_abi_layout).
"""

from __future__ import annotations

import ctypes

_P, _L = ctypes.c_void_p, ctypes.c_int64


class Lin(ctypes.Structure):
    """A projection: format (fast_decode's F32_ROWS ... Q4_1_I16), N outputs, K inputs, the weights
    or codes, fp16 scales and minimums, bias (0: none)."""
    _fields_ = [("fmt", _L), ("N", _L), ("K", _L), ("w", _P), ("d", _P), ("m", _P), ("bias", _P)]


class LayerPlan(ctypes.Structure):
    """A layer's norms (0: none) and projections; QK-norm per head or over the whole projections
    (qk_whole), and whether it is a hybrid model's sliding layer (its own mask and rotary tables)."""
    _fields_ = [("attn_norm", _P), ("mlp_norm", _P), ("qkv", Lin), ("o", Lin), ("w13", Lin), ("w2", Lin),
                ("q_norm", _P), ("k_norm", _P), ("post_attn_norm", _P), ("post_mlp_norm", _P),
                ("qk_whole", _L), ("sliding", _L)]


class Stream(ctypes.Structure):
    """One layer's K or V: kind (KindSpec.step), codes (KV_FP32: the values), fp16 parameters,
    block (per-channel kinds: tokens per group), fp32 ring and its slots, r0 (positions below it
    are read from codes), rotation [D, D] (0: none); the layer's own slots: capacity, the model's
    slot of its slot 0 (offset), and each cache row and head's first valid slot (int64
    [rows, n_kv], 0: none), which a ragged press gives (caramba.cache.evict); a packed store's
    (caramba.cache.packed) store slot of each cache row and head's slot 0 (int64 [rows, n_kv], 0:
    the regular [rows, n_kv, slots] layout) and its size in slots; a ring cache's capacity (wrap:
    slot s stored at s % wrap; 0: no ring)."""
    _fields_ = [("kind", _L), ("codes", _P), ("params", _P), ("block", _L), ("ring", _P), ("ring_n", _L),
                ("r0", _L), ("rot", _P), ("slots", _L), ("offset", _L), ("first", _P), ("org", _P), ("store", _L),
                ("wrap", _L)]


class StepArgs(ctypes.Structure):
    _fields_ = [("n_layers", _L), ("layers", _P), ("head", _P), ("final_norm", _P), ("streams", _P), ("x", _P),
                ("logits", _P), ("M", _L), ("T", _L), ("last_only", _L), ("dim", _L), ("n_heads", _L),
                ("n_kv", _L), ("head_dim", _L), ("hidden", _L), ("max_seq", _L), ("slot", _L),
                ("positions", _P), ("mask", _P), ("mask_local", _P), ("cos", _P), ("ssin", _P), ("cos_local", _P),
                ("ssin_local", _P), ("eps", ctypes.c_float), ("q_factor", ctypes.c_float),
                ("nthreads", ctypes.c_int32), ("gelu", ctypes.c_int32), ("softcap", ctypes.c_float),
                ("row_exact", ctypes.c_int32), ("stepwise", _L)]


def layout() -> list[int]:
    """What step_abi_layout in C reports, computed from these Structures: the sizes of Lin,
    LayerPlan, Stream and StepArgs, StepArgs' field offsets in order, then LayerPlan's from qkv on
    and Stream's from r0 on."""
    return ([ctypes.sizeof(t) for t in (Lin, LayerPlan, Stream, StepArgs)]
            + [getattr(StepArgs, name).offset for name, _ in StepArgs._fields_]
            + [getattr(LayerPlan, name).offset for name, _ in LayerPlan._fields_[2:]]
            + [getattr(Stream, name).offset for name, _ in Stream._fields_[6:]])
