"""What a KV cache tensor is stored as: the kinds, one table of them, and a stream's settings.

Every kind is one row of `KVCacheKind` below: a `KindSpec` saying how many bits an element
takes, the storage dtype and, for a quantized kind, its code range, how a code maps to a value
(uniform levels, or a codebook) and the id of its C kernel path. Everything else reads the spec:
quantize / dequantize (caramba.cache.quant), the eager and C decode paths (caramba.cache.attend,
caramba.cache.kernel), the stream layout (caramba.cache.streams), byte accounting, and the names
the manifest schema and the CLI accept (`kind_names()`).

How to add a quantized kind
---------------------------
1. caramba/cache/kinds.py (this file): one member in `KVCacheKind`, e.g.

       Q6_0 = KindSpec("q6_0", bits=8, dtype=torch.int8, code_range=(-32, 31))

   A uniform kind is fixed by its code range [lo, hi]: code c stands for (c - (lo + hi)/2) *
   scale with scale = absmax / ((hi - lo)/2), a mid-rise quantizer symmetric about zero whose
   extremes are exact. With `mid_tread=True` zero is a level instead (llama.cpp's q4_0): code c
   stands for (c - z) * scale, z = (lo + hi + 1)/2, and the scale is signed, -x_m / (z - lo)
   with x_m the block's element of largest magnitude, so x_m is exact (code lo) and the other
   sign reaches hi - z steps (an element there may clip by up to one step). A codebook kind gives `codebook` (ascending, hi - lo + 1 values, max |v| =
   the value absmax maps to) and codes index it. `zero_point=True`: asymmetric levels m + u *
   scale (each block stores an fp16 scale and minimum). `per_channel=True`: a block is qblock
   consecutive tokens of one channel (KIVI's keys; caramba.cache.streams.ChannelQuantStream).
   bits=4 kinds are packed two codes per byte (uint8 codes in [0, 15]), bits=2 four per byte;
   bits=8 kinds store one code per byte. `aliases` adds short names.
2. tests/cache/test_kv_quant.py: its kind lists come from this table (error bound for uniform kinds,
   update, rollback, reorder, batches, byte accounting); pin a few of the new kind's codes in
   test_codes_match_reference_formulas.

Without `kernel=` the kind decodes through the eager path (caramba.cache.attend). For the C fast
path also give it `kernel=N` and handle KIND id N in caramba/cache/quant_attend_vec.c's
`code_vector` and quant_attend_ref.c's `code_value` (the scalar reference). Zero-point kinds (4- or 2-bit, per token, or per channel for keys in groups of a
multiple of 16 tokens) take the C loops key_scores_zp / value_mix_zp without a kernel id. The
one-call CPU decode step (caramba.model.fast_decode) reads and writes caches itself: a kind it
should take needs `step=N` (the next free id) and, where its quantizer or code values are new, a
branch in caramba/model/kv_stream.c; without one the step falls back to the torch path.

The C kernels read this table from caramba/cache/kinds.h (ids, bits, offsets, code ranges,
codebooks), which caramba/cache/kinds_c.py generates: after changing a row, run
`python -m caramba.cache.kinds_c` (tests/cache/test_kinds_header.py fails while the header is stale).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

SCALE_DTYPE = torch.float16
SCALE_BYTES = 2

# QLoRA's NormalFloat-4 codebook (Dettmers et al. 2023, bitsandbytes), ascending.
NF4_LEVELS = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230850219727, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
)


@dataclass(frozen=True, eq=False)
class KindSpec:
    """One cache kind. Fields are what a table row gives; the rest is derived once, here.

    code_range: [lo, hi] of the stored codes; None for a float kind (values stored as `dtype`).
    codebook: the value of code u (ascending, one per code); None: uniform levels c + offset.
    kernel: the kind's id in quant_attend_vec.c / quant_attend_ref.c, or None (decode reads it through the eager path).
    step: the kind's id among the fused decode step's cache streams (caramba/model/kv_stream.c),
      or None (a step over a cache of this kind takes the torch path). Ids are dense from 0.
    mid_tread: uniform levels with an exact zero and a signed scale (see the module doc).
    zero_point: asymmetric uniform levels: code u stands for m + u * scale with m the block's
      minimum (rounded down to fp16) and scale = (max - m) / hi; a block stores scale and m.
    per_channel: a block is `qblock` consecutive *tokens* of one channel (KIVI's keys), not
      `qblock` elements of one vector; a group is quantized once its qblock tokens are written.
    """

    name: str
    bits: int
    dtype: torch.dtype
    code_range: tuple[int, int] | None = None
    codebook: tuple[float, ...] | None = None
    kernel: int | None = None
    step: int | None = None
    aliases: tuple[str, ...] = ()
    mid_tread: bool = False
    zero_point: bool = False
    per_channel: bool = False
    # Derived (see __post_init__).
    quantized: bool = field(init=False)
    packed: bool = field(init=False)          # several codes per byte (bits < 8)
    per_byte: int = field(init=False)         # codes per byte: 1, 2 (4-bit) or 4 (2-bit)
    params: int = field(init=False)           # fp16 numbers per block: scale (and the minimum)
    offset: float = field(init=False)         # uniform kinds: code c stands for (c + offset) * scale
    shift: float = field(init=False)          # quantize: code = floor(x / scale + shift)
    half_range: float = field(init=False)     # absmax / scale: the largest |value| of a code
    levels: torch.Tensor | None = field(init=False, repr=False)     # codebook as float32 [n]
    midpoints: torch.Tensor | None = field(init=False, repr=False)  # between neighbouring levels: nearest-code bounds

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        quantized = self.code_range is not None
        set_(self, "quantized", quantized)
        set_(self, "packed", quantized and self.bits < 8)
        set_(self, "per_byte", 8 // self.bits if quantized else 1)
        set_(self, "params", 2 if self.zero_point else 1)
        set_(self, "levels", None)
        set_(self, "midpoints", None)
        set_(self, "offset", 0.0)
        set_(self, "shift", 0.0)
        set_(self, "half_range", 0.0)
        if not quantized:
            if self.codebook is not None or self.kernel is not None or self.zero_point or self.per_channel:
                raise ValueError(f"kind {self.name}: a float kind (no code_range) takes no codebook, kernel, "
                                 "zero_point or per_channel")
            if self.step is not None and self.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise ValueError(f"kind {self.name}: the fused decode step reads fp32, fp16 and bf16 float streams "
                                 "only (no step=)")
            if torch.empty(0, dtype=self.dtype).element_size() * 8 != self.bits:
                raise ValueError(f"kind {self.name}: bits={self.bits} is not the size of {self.dtype}")
            return
        lo, hi = self.code_range
        if self.bits not in (2, 4, 8):
            raise ValueError(f"kind {self.name}: quantized kinds store 8-, 4- or 2-bit codes; got bits={self.bits}")
        top = (1 << self.bits) - 1
        if self.packed and not (self.dtype == torch.uint8 and 0 <= lo < hi <= top):
            raise ValueError(f"kind {self.name}: {self.bits}-bit codes are packed as uint8 nibbles (4-bit) or bit "
                             f"pairs (2-bit): dtype must be torch.uint8 and code_range within [0, {top}]; "
                             f"got {self.dtype}, {self.code_range}")
        if self.zero_point and (self.mid_tread or self.codebook is not None or lo != 0):
            raise ValueError(f"kind {self.name}: zero_point kinds are uniform codes from 0 (no mid_tread, no codebook)")
        if self.kernel is not None and (self.zero_point or self.per_channel or self.bits == 2):
            raise ValueError(f"kind {self.name}: the C kernels read 8- and 4-bit per-token scales only; "
                             "a zero_point, per_channel or 2-bit kind decodes through the eager path (no kernel=)")
        if not self.packed and not (self.dtype in (torch.int8, torch.uint8)
                                    and torch.iinfo(self.dtype).min <= lo < hi <= torch.iinfo(self.dtype).max):
            raise ValueError(f"kind {self.name}: code_range {self.code_range} must fit the storage dtype {self.dtype} "
                             "(torch.int8 or torch.uint8)")
        if self.zero_point:
            # Asymmetric: code u stands for min + u * scale; offset/shift unused.
            set_(self, "half_range", float(hi))
        elif self.codebook is None and self.mid_tread:
            # Zero is level z; the largest-magnitude element is level lo (the scale takes its sign).
            z = (lo + hi + 1) // 2
            set_(self, "offset", float(-z))
            set_(self, "shift", z + 0.5)
            set_(self, "half_range", float(z - lo))
        elif self.codebook is None:
            # Symmetric mid-rise levels: both extremes are +-absmax and every code is used.
            set_(self, "offset", -(lo + hi) / 2)
            set_(self, "shift", 0.5 + (lo + hi) / 2)
            set_(self, "half_range", (hi - lo) / 2)
        else:
            if self.mid_tread:
                raise ValueError(f"kind {self.name}: mid_tread is for uniform levels, not a codebook")
            if len(self.codebook) != hi - lo + 1 or list(self.codebook) != sorted(self.codebook):
                raise ValueError(f"kind {self.name}: codebook needs {hi - lo + 1} ascending values (one per code)")
            if lo != 0:
                raise ValueError(f"kind {self.name}: codebook codes index it from 0; code_range must start at 0")
            levels = torch.tensor(self.codebook, dtype=torch.float32)
            set_(self, "levels", levels)
            set_(self, "midpoints", (levels[1:] + levels[:-1]) / 2)
            set_(self, "half_range", float(levels.abs().max()))

    @property
    def reads_dequantized(self) -> bool:
        """Decode reads this kind by dequantizing a chunk and one matmul (zero-point, per-channel
        and 2-bit kinds), not by folding scales into the score rows."""
        return self.zero_point or self.per_channel or self.bits == 2

    def code_width(self, head_dim: int) -> int:
        """Bytes of codes per head vector of head_dim elements."""
        return head_dim // self.per_byte


class KVCacheKind(str, Enum):
    """The cache kinds, by name: `KVCacheKind.FP16 == "fp16"`, `KVCacheKind.parse("q8")`.
    Each member's `spec` is its KindSpec; this class body is the one table of kinds."""

    FP32 = KindSpec("fp32", bits=32, dtype=torch.float32, step=0)
    FP16 = KindSpec("fp16", bits=16, dtype=torch.float16, step=9)
    BF16 = KindSpec("bf16", bits=16, dtype=torch.bfloat16, step=10)
    # int8 codes c in [-128, 127] standing for (c + 1/2) * scale, one fp16 scale per block
    Q8_0 = KindSpec("q8_0", bits=8, dtype=torch.int8, code_range=(-128, 127), kernel=0, step=1, aliases=("q8",))
    # 4-bit codes u in [0, 15] standing for (u - 7.5) * scale, two per byte
    Q4_0 = KindSpec("q4_0", bits=4, dtype=torch.uint8, code_range=(0, 15), kernel=1, step=2, aliases=("q4",))
    # 4-bit indexes into the QLoRA NormalFloat codebook, one fp16 absmax per block
    NF4 = KindSpec("nf4", bits=4, dtype=torch.uint8, code_range=(0, 15), codebook=NF4_LEVELS, kernel=2, step=4)
    # llama.cpp's q4_0: 4-bit codes u standing for (u - 8) * scale, scale = -x_m/8 (x_m: the
    # block's largest-magnitude element, exact); zero is a level
    Q4_0L = KindSpec("q4_0l", bits=4, dtype=torch.uint8, code_range=(0, 15), mid_tread=True, kernel=3, step=3)
    # Zero-point (asymmetric) kinds, KIVI's (Liu et al. 2024): per token (values) and per channel
    # over groups of qblock tokens (keys); each block stores an fp16 scale and minimum.
    Q4_1 = KindSpec("q4_1", bits=4, dtype=torch.uint8, code_range=(0, 15), zero_point=True, step=5)
    Q4_1C = KindSpec("q4_1c", bits=4, dtype=torch.uint8, code_range=(0, 15), zero_point=True, per_channel=True,
                     step=7)
    Q2_1 = KindSpec("q2_1", bits=2, dtype=torch.uint8, code_range=(0, 3), zero_point=True, step=6)
    Q2_1C = KindSpec("q2_1c", bits=2, dtype=torch.uint8, code_range=(0, 3), zero_point=True, per_channel=True,
                      step=8)

    spec: KindSpec

    def __new__(cls, spec: KindSpec) -> "KVCacheKind":
        member = str.__new__(cls, spec.name)
        member._value_ = spec.name
        member.spec = spec
        return member

    @classmethod
    def parse(cls, value: "KVCacheKind | str") -> "KVCacheKind":
        if isinstance(value, cls):
            return value
        name = str(value).lower()
        try:
            return cls(ALIASES.get(name, name))
        except ValueError:
            raise ValueError(f"unknown KV cache kind {value!r}; valid kinds: {describe_kinds()}") from None

    @property
    def quantized(self) -> bool:
        return self.spec.quantized

    @property
    def bits(self) -> int:
        return self.spec.bits


# Short names (the seed docs' q8, q4) -> kind names, from the table.
ALIASES = {alias: kind.value for kind in KVCacheKind for alias in kind.spec.aliases}


def kind_names(aliases: bool = True, quantized_only: bool = False) -> tuple[str, ...]:
    """Every name KVCacheKind.parse accepts (lower case), table order, then the aliases:
    ('fp32', 'fp16', 'bf16', 'q8_0', 'q4_0', 'nf4', 'q8', 'q4')."""
    kinds = [k for k in KVCacheKind if k.spec.quantized or not quantized_only]
    return tuple(k.value for k in kinds) + (tuple(a for k in kinds for a in k.spec.aliases) if aliases else ())


def describe_kinds(quantized_only: bool = False) -> str:
    """The kinds for an error message or help text: 'fp32, fp16, ..., nf4 (aliases: q8, q4)'."""
    kinds = [k for k in KVCacheKind if k.spec.quantized or not quantized_only]
    text = ", ".join(k.value for k in kinds)
    short = [a for k in kinds for a in k.spec.aliases]
    return f"{text} (aliases: {', '.join(short)})" if short else text


def spec_of(kind: "KVCacheKind | KindSpec | str") -> KindSpec:
    """The KindSpec of a kind given as a spec, a KVCacheKind or a name."""
    return kind if isinstance(kind, KindSpec) else KVCacheKind.parse(kind).spec


@dataclass(frozen=True)
class KVCacheTensorConfig:
    """How one cached stream (K or V) is stored.

    qblock: elements per quantization block (quantized kinds); clipped to the head size, since
    a block never spans two heads. residual_len: the newest tokens also kept in full precision
    and read from there (KIVI / HF QuantizedCache's residual window).
    """

    kind: KVCacheKind | str = KVCacheKind.FP32
    qblock: int = 32
    residual_len: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", KVCacheKind.parse(self.kind))
        if self.qblock < 2 or self.qblock % 2:
            raise ValueError(f"qblock={self.qblock} must be an even number >= 2")
        if self.residual_len < 0:
            raise ValueError(f"residual_len={self.residual_len} must be >= 0")

    @property
    def spec(self) -> KindSpec:
        return self.kind.spec

    @property
    def quantized(self) -> bool:
        return self.kind.spec.quantized

    @property
    def dtype(self) -> torch.dtype:
        return self.kind.spec.dtype

    def bytes_per_element(self) -> float:
        return self.kind.spec.bits / 8

    def block_for(self, head_dim: int) -> int:
        if self.kind.spec.per_channel:
            return self.qblock   # tokens per group: not bounded by the head size
        block = min(self.qblock, head_dim)
        if head_dim % block:
            raise ValueError(f"qblock={self.qblock} must divide head_dim={head_dim} (a block never spans two heads)")
        return block

    def bytes_per_token(self, n_heads: int, head_dim: int) -> int:
        """Analytic bytes one token of one batch row occupies (codes + scales), excluding the
        fixed-size residual window."""
        spec = self.kind.spec
        if not spec.quantized:
            return n_heads * head_dim * spec.bits // 8
        if spec.per_channel:   # one group of qblock tokens stores head_dim * params fp16 numbers
            return n_heads * (spec.code_width(head_dim) + self.channel_param_bytes(head_dim))
        return n_heads * (spec.code_width(head_dim) + head_dim // self.block_for(head_dim) * SCALE_BYTES * spec.params)

    def channel_param_bytes(self, head_dim: int) -> int:
        """Per-channel kinds: bytes of block parameters per token and head (qblock must divide
        head_dim * params * 2 so that a token's share is whole)."""
        total = head_dim * self.kind.spec.params * SCALE_BYTES
        if total % self.qblock:
            raise ValueError(f"qblock={self.qblock} must divide {total} for {self.kind.value} on head_dim={head_dim} "
                             "(a group of qblock tokens stores head_dim fp16 scales and minimums)")
        return total // self.qblock
