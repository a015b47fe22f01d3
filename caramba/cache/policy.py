"""A cache policy: how every layer's K and V are stored.

`CachePolicy.build(kind="q4_0", policy="k=q8_0", ...)` is what generation, eval and the CLI use:
`policy` names the kind of individual streams and `kind` covers the streams it does not name.
Standard attention caches the streams `k` and `v`; decoupled (DBA) attention caches `k_sem`,
`k_geo` and `v` (caramba.cache.decoupled). A policy is built before the model is known, so
which family it names is checked when a model builds its cache (`check_streams`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from caramba.cache.kinds import KVCacheKind, KVCacheTensorConfig

STREAMS = ("k", "v")
DECOUPLED_STREAMS = ("k_sem", "k_geo", "v")
ALL_STREAMS = ("k", "k_sem", "k_geo", "v")
# The geometric (RoPE) keys carry position; left unnamed they are never stored below this.
K_GEO_FLOOR = KVCacheKind.Q8_0


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
    unknown = [name for name in policy if name not in ALL_STREAMS]
    if unknown:
        raise ValueError(f"cache_policy names unknown stream(s) {', '.join(map(repr, unknown))}; streams: "
                         f"{', '.join(STREAMS)} (standard attention) or {', '.join(DECOUPLED_STREAMS)} (decoupled/DBA)")
    if "k" in policy and ("k_sem" in policy or "k_geo" in policy):
        raise ValueError("cache_policy names both k (standard attention) and k_sem/k_geo (decoupled/DBA); "
                         "a model has one or the other: name the streams of the model you run")
    return {name: KVCacheKind.parse(kind).value for name, kind in policy.items()}


@dataclass(frozen=True)
class CachePolicy:
    k: KVCacheTensorConfig = field(default_factory=KVCacheTensorConfig)
    v: KVCacheTensorConfig = field(default_factory=KVCacheTensorConfig)
    rotate_keys: bool = False
    fp16_prefix_layers: int = 0   # the first N layers keep K and V in fp16
    # Decoupled (DBA) models: semantic and geometric key streams (None: as `k`, and k_geo
    # never below q8_0 unless named; see `build`).
    k_sem: KVCacheTensorConfig | None = None
    k_geo: KVCacheTensorConfig | None = None
    named: tuple[str, ...] = ()   # the streams the policy named explicitly (checked per model)
    # Values stored Hadamard-rotated, the attention output rotated back (caramba.cache.layer);
    # standard attention only.
    rotate_values: bool = False

    def __post_init__(self) -> None:
        if self.fp16_prefix_layers < 0:
            raise ValueError(f"cache_fp16_prefix_layers={self.fp16_prefix_layers} must be >= 0")
        if self.k_sem is None:
            object.__setattr__(self, "k_sem", self.k)
        if self.k_geo is None:
            floor = KVCacheTensorConfig(K_GEO_FLOOR, self.k.qblock, self.k.residual_len)
            object.__setattr__(self, "k_geo", floor if 0 < self.k.kind.bits < K_GEO_FLOOR.bits else self.k)

    @classmethod
    def build(cls, kind: KVCacheKind | str = "fp32", policy: str | dict[str, Any] | None = None, qblock: int = 32,
              residual_len: int = 0, rotate_keys: bool = False, fp16_prefix_layers: int = 0,
              rotate_values: bool = False) -> "CachePolicy":
        """`kind` for every stream the policy does not name; an unnamed k_geo is kept at >= q8_0
        when `kind` is 4-bit (positional geometry), unless the policy names it."""
        named = parse_policy(policy)
        default = KVCacheKind.parse(kind).value
        cfgs = {name: KVCacheTensorConfig(named.get(name, default), qblock, residual_len) for name in ALL_STREAMS}
        return cls(cfgs["k"], cfgs["v"], rotate_keys, fp16_prefix_layers,
                   k_sem=cfgs["k_sem"], k_geo=cfgs["k_geo"] if "k_geo" in named else None,
                   named=tuple(n for n in ALL_STREAMS if n in named), rotate_values=rotate_values)

    @classmethod
    def of(cls, spec: "CachePolicy | KVCacheKind | str") -> "CachePolicy":
        return spec if isinstance(spec, CachePolicy) else cls.build(spec)

    def check_streams(self, decoupled: bool) -> None:
        """Raise if the policy names streams the model (standard or decoupled) does not have."""
        if decoupled and self.rotate_values:
            raise ValueError("rotate_values is implemented for standard attention caches only, not decoupled (DBA) ones")
        streams = DECOUPLED_STREAMS if decoupled else STREAMS
        foreign = [n for n in self.named if n not in streams]
        if foreign:
            what = "a decoupled (DBA)" if decoupled else "a standard-attention"
            raise ValueError(f"cache_policy names {', '.join(foreign)}, which {what} model does not cache; "
                             f"its streams are {', '.join(streams)}")

    def for_layer(self, i: int) -> tuple[KVCacheTensorConfig, KVCacheTensorConfig, bool]:
        """(k config, v config, rotate keys) of layer i (`values_rotated(i)`: rotate values)."""
        if i < self.fp16_prefix_layers:
            fp16 = KVCacheTensorConfig("fp16")
            return fp16, fp16, False
        return self.k, self.v, self.rotate_keys

    def values_rotated(self, i: int) -> bool:
        """Whether layer i stores its values Hadamard-rotated (not the fp16 prefix layers)."""
        return self.rotate_values and i >= self.fp16_prefix_layers

    def for_decoupled_layer(self, i: int) -> tuple[KVCacheTensorConfig, KVCacheTensorConfig, KVCacheTensorConfig, bool]:
        """(k_sem, k_geo, v configs, rotate keys) of layer i of a decoupled model."""
        if i < self.fp16_prefix_layers:
            fp16 = KVCacheTensorConfig("fp16")
            return fp16, fp16, fp16, False
        return self.k_sem, self.k_geo, self.v, self.rotate_keys

    def describe(self, decoupled: bool = False) -> str:
        """Short name: 'q8_0', 'k=q8_0,v=q4_0', plus the settings that differ from the defaults.
        decoupled: name the kinds of k_sem, k_geo and v when they differ."""
        cfgs = [self.k_sem, self.k_geo, self.v] if decoupled else [self.k, self.v]
        streams = DECOUPLED_STREAMS if decoupled else STREAMS
        kinds = [c.kind.value for c in cfgs]
        name = kinds[0] if len(set(kinds)) == 1 else ",".join(f"{n}={k}" for n, k in zip(streams, kinds))
        quantized = any(c.quantized for c in cfgs)
        blocks = {c.qblock for c in cfgs if c.quantized}
        qblock = (f"qblock={blocks.pop()}" if blocks != {32} else "") if len(blocks) == 1 else \
            "qblock=" + ",".join(f"{n}:{c.qblock}" for n, c in zip(streams, cfgs) if c.quantized) if blocks else ""
        extras = [qblock,
                  f"residual_len={self.k.residual_len}" if quantized and self.k.residual_len else "",
                  "rotate_keys" if self.rotate_keys else "",
                  "rotate_values" if self.rotate_values else "",
                  f"fp16_prefix_layers={self.fp16_prefix_layers}" if self.fp16_prefix_layers else ""]
        return " ".join([name] + [e for e in extras if e])

    def to_dict(self) -> dict[str, Any]:
        """k and v always; k_sem and k_geo when the policy names one of them (a DBA policy)."""
        dba = {"k_sem": self.k_sem.kind.value, "k_geo": self.k_geo.kind.value} \
            if {"k_sem", "k_geo"} & set(self.named) else {}
        return {"k": self.k.kind.value, "v": self.v.kind.value, **dba, "qblock": self.k.qblock,
                "residual_len": self.k.residual_len, "rotate_keys": self.rotate_keys,
                "cache_fp16_prefix_layers": self.fp16_prefix_layers,
                **({"rotate_values": True} if self.rotate_values else {})}
