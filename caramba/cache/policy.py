"""A cache policy: how every layer's K and V are stored.

`CachePolicy.build(kind="q4_0", policy="k=q8_0", ...)` is what generation, eval and the CLI use:
`policy` names the kind of individual streams and `kind` covers the streams it does not name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from caramba.cache.kinds import KVCacheKind, KVCacheTensorConfig

STREAMS = ("k", "v")


def parse_policy(policy: str | dict[str, Any] | None) -> dict[str, str]:
    """'k=q8_0,v=q4_0' or {'k': 'q8_0'} -> {'k': 'q8_0', 'v': ...} (kinds checked)."""
    if policy is None:
        return {}
    if isinstance(policy, str):
        items: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in policy.split(","))):
            name, sep, kind = part.partition("=")
            if not sep:
                raise ValueError(f"cache_policy {policy!r}: expected stream=kind pairs like 'k=q8_0,v=q4_0'")
            items[name.strip()] = kind.strip()
        policy = items
    unknown = [name for name in policy if name not in STREAMS]
    if unknown:
        raise ValueError(f"cache_policy names unknown stream(s) {', '.join(map(repr, unknown))}; streams: {', '.join(STREAMS)}")
    return {name: KVCacheKind.parse(kind).value for name, kind in policy.items()}


@dataclass(frozen=True)
class CachePolicy:
    k: KVCacheTensorConfig = field(default_factory=KVCacheTensorConfig)
    v: KVCacheTensorConfig = field(default_factory=KVCacheTensorConfig)
    rotate_keys: bool = False
    fp16_prefix_layers: int = 0   # the first N layers keep K and V in fp16

    def __post_init__(self) -> None:
        if self.fp16_prefix_layers < 0:
            raise ValueError(f"cache_fp16_prefix_layers={self.fp16_prefix_layers} must be >= 0")

    @classmethod
    def build(cls, kind: KVCacheKind | str = "fp32", policy: str | dict[str, Any] | None = None, qblock: int = 32,
              residual_len: int = 0, rotate_keys: bool = False, fp16_prefix_layers: int = 0) -> "CachePolicy":
        kinds = {name: KVCacheKind.parse(kind).value for name in STREAMS} | parse_policy(policy)
        cfgs = {name: KVCacheTensorConfig(kinds[name], qblock, residual_len) for name in STREAMS}
        return cls(cfgs["k"], cfgs["v"], rotate_keys, fp16_prefix_layers)

    @classmethod
    def of(cls, spec: "CachePolicy | KVCacheKind | str") -> "CachePolicy":
        return spec if isinstance(spec, CachePolicy) else cls.build(spec)

    def for_layer(self, i: int) -> tuple[KVCacheTensorConfig, KVCacheTensorConfig, bool]:
        """(k config, v config, rotate keys) of layer i."""
        if i < self.fp16_prefix_layers:
            fp16 = KVCacheTensorConfig("fp16")
            return fp16, fp16, False
        return self.k, self.v, self.rotate_keys

    def describe(self) -> str:
        """Short name: 'q8_0', 'k=q8_0,v=q4_0', plus the settings that differ from the defaults."""
        name = self.k.kind.value if self.k.kind == self.v.kind else f"k={self.k.kind.value},v={self.v.kind.value}"
        quantized = self.k.quantized or self.v.quantized
        extras = [f"qblock={self.k.qblock}" if quantized and self.k.qblock != 32 else "",
                  f"residual_len={self.k.residual_len}" if quantized and self.k.residual_len else "",
                  "rotate_keys" if self.rotate_keys else "",
                  f"fp16_prefix_layers={self.fp16_prefix_layers}" if self.fp16_prefix_layers else ""]
        return " ".join([name] + [e for e in extras if e])

    def to_dict(self) -> dict[str, Any]:
        return {"k": self.k.kind.value, "v": self.v.kind.value, "qblock": self.k.qblock,
                "residual_len": self.k.residual_len, "rotate_keys": self.rotate_keys,
                "cache_fp16_prefix_layers": self.fp16_prefix_layers}
