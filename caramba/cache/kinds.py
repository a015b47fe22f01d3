"""What a KV cache tensor is stored as: the kind and its settings."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch


class KVCacheKind(str, Enum):
    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"

    @classmethod
    def parse(cls, value: "KVCacheKind | str") -> "KVCacheKind":
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            valid = ", ".join(k.value for k in cls)
            raise ValueError(f"unknown KV cache kind {value!r}; valid kinds: {valid}") from None


STORAGE_DTYPE = {
    KVCacheKind.FP32: torch.float32,
    KVCacheKind.FP16: torch.float16,
    KVCacheKind.BF16: torch.bfloat16,
}


@dataclass(frozen=True)
class KVCacheTensorConfig:
    """How one cached stream (K or V) is stored."""

    kind: KVCacheKind | str = KVCacheKind.FP32

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", KVCacheKind.parse(self.kind))

    @property
    def dtype(self) -> torch.dtype:
        return STORAGE_DTYPE[self.kind]

    def bytes_per_element(self) -> float:
        return torch.tensor([], dtype=self.dtype).element_size()
