"""What a KV cache tensor is stored as: the kind and its settings."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

# The seed docs' short names.
ALIASES = {"q8": "q8_0", "q4": "q4_0"}


class KVCacheKind(str, Enum):
    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    Q8_0 = "q8_0"   # int8 codes, one fp16 scale per block
    Q4_0 = "q4_0"   # 4-bit codes, two per byte, one fp16 scale per block
    NF4 = "nf4"     # 4-bit indexes into the QLoRA NormalFloat codebook, one fp16 absmax per block

    @classmethod
    def parse(cls, value: "KVCacheKind | str") -> "KVCacheKind":
        if isinstance(value, cls):
            return value
        name = str(value).lower()
        try:
            return cls(ALIASES.get(name, name))
        except ValueError:
            valid = ", ".join(k.value for k in cls)
            raise ValueError(f"unknown KV cache kind {value!r}; valid kinds: {valid} (aliases: q8, q4)") from None

    @property
    def quantized(self) -> bool:
        return self in (KVCacheKind.Q8_0, KVCacheKind.Q4_0, KVCacheKind.NF4)

    @property
    def bits(self) -> int:
        return {"fp32": 32, "fp16": 16, "bf16": 16, "q8_0": 8, "q4_0": 4, "nf4": 4}[self.value]


STORAGE_DTYPE = {
    KVCacheKind.FP32: torch.float32,
    KVCacheKind.FP16: torch.float16,
    KVCacheKind.BF16: torch.bfloat16,
    KVCacheKind.Q8_0: torch.int8,
    KVCacheKind.Q4_0: torch.uint8,  # two codes per byte
    KVCacheKind.NF4: torch.uint8,
}
SCALE_DTYPE = torch.float16
SCALE_BYTES = 2


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
    def quantized(self) -> bool:
        return self.kind.quantized

    @property
    def dtype(self) -> torch.dtype:
        return STORAGE_DTYPE[self.kind]

    def bytes_per_element(self) -> float:
        return self.kind.bits / 8

    def block_for(self, head_dim: int) -> int:
        block = min(self.qblock, head_dim)
        if head_dim % block:
            raise ValueError(f"qblock={self.qblock} must divide head_dim={head_dim} (a block never spans two heads)")
        return block

    def bytes_per_token(self, n_heads: int, head_dim: int) -> int:
        """Analytic bytes one token of one batch row occupies (codes + scales), excluding the
        fixed-size residual window."""
        if not self.quantized:
            return n_heads * head_dim * self.kind.bits // 8
        return n_heads * (head_dim * self.kind.bits // 8 + head_dim // self.block_for(head_dim) * SCALE_BYTES)
