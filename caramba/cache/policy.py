"""How every layer's K and V are stored: the settings users write, and the per-stream form they build.

`CacheSettings` holds the storage options, each defined once with `option()` (caramba.options):
`cache_kind`, `cache_policy`, `qblock`, `residual_len`, `rotate_keys`, `rotate_values`,
`cache_fp16_prefix_layers`. Generation's `CacheConfig` (caramba.infer.config) is a CacheSettings
plus the cache's size, budget, autotune and press, so the manifest, the CLI and the library read
these options from here. `CacheSettings.spec()` is the one place the settings become a
`CachePolicy`, the per-stream, per-layer form `model.new_cache` takes; `CacheSettings.of_policy`
is its inverse (what `cache_kind: auto` resolves to, and how a plan's stored policy is read back).
`CachePolicy.build(kind, policy, **settings)` is the short form of `CacheSettings(...).spec()`.

`cache_policy` names the kind of individual streams and `cache_kind` covers the streams it does not
name. Standard attention caches the streams `k` and `v`; decoupled (DBA) attention caches `k_sem`,
`k_geo` and `v` (caramba.cache.decoupled). A policy is built before the model is known, so which
family it names is checked when a model builds its cache (`check_streams`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from caramba.cache.kinds import KVCacheKind, KVCacheTensorConfig, kind_names
from caramba.options import OptionError, check_options, option, options_of

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


KIND_CHOICES = kind_names()   # the kind table's names and aliases (caramba.cache.kinds)
# The keys every stored policy has had (CachePolicy.to_dict: runs/cache_plans.json, result.json). A
# setting added since is stored only when it differs from its default, so the plans and run hashes
# written before it existed stay valid.
STORED_ALWAYS = ("qblock", "residual_len", "rotate_keys", "cache_fp16_prefix_layers")


@dataclass(frozen=True)
class CacheSettings:
    """How every layer's K and V are stored, as users write it; `spec()` builds the CachePolicy.

    A new storage setting is one `option()` field here plus the code it changes: `spec()` (per-stream
    storage) or, for a per-layer rule, a CachePolicy field of the same name, which `spec()` carries
    over, `describe` names and `to_dict` / `of_policy` store and restore with no further edit."""

    kind: str = option("fp32", name="cache_kind", choices=(*KIND_CHOICES, "auto"),
                       help="auto: the stored plan, or a fresh autotune selection (docs/autotune.md)")
    policy: str | dict[str, str] | None = option(
        None, name="cache_policy",
        schema=dict[Literal[ALL_STREAMS], Literal[KIND_CHOICES]] | str | None,   # type: ignore[valid-type]
        help="per-stream kinds, e.g. k=q8_0,v=q4_0 (k/v, or k_sem/k_geo/v on decoupled models)")
    qblock: int = option(32, ge=2, multiple_of=2, help="elements per quantization block (clipped to head_dim)")
    residual_len: int = option(0, ge=0, help="newest tokens also kept in full precision")
    rotate_keys: bool = option(False, help="Hadamard-rotate keys before quantizing them")
    rotate_values: bool = option(False, help="Hadamard-rotate values before quantizing them (the output is "
                                             "rotated back); with rotate_keys, llama.cpp's default for quantized caches")
    fp16_prefix_layers: int = option(0, ge=0, name="cache_fp16_prefix_layers", help="the first N layers keep an fp16 cache")
    sliding_kind: str | None = option(None, name="cache_sliding_kind", choices=KIND_CHOICES,
                                      help="hybrid models (Gemma): the sliding-window layers' kind (default: as the "
                                           "others), e.g. quantize the full layers and keep the rings fp16")

    def __post_init__(self) -> None:
        if self.sliding_kind is not None:
            object.__setattr__(self, "sliding_kind", KVCacheKind.parse(self.sliding_kind).value)
        if str(self.kind).lower() != "auto":
            object.__setattr__(self, "kind", KVCacheKind.parse(self.kind).value)   # aliases, enum members
        check_options(self)
        if not self.is_auto:
            self.spec()   # a bad policy fails here, not at the first generate()
            return
        clash = [opt.name for opt in options_of(CacheSettings)
                 if opt.attr != "kind" and getattr(self, opt.attr) != opt.default()]
        if clash:
            raise OptionError("cache_kind", "auto", f"chooses {', '.join(clash)} itself; drop them or name a cache_kind")

    @property
    def is_auto(self) -> bool:
        """cache_kind='auto': the layer above the engine picks the policy (caramba.resolvers)."""
        return self.kind == "auto"

    def spec(self) -> CachePolicy:
        """The CachePolicy these settings describe (what model.new_cache takes): `kind` for every
        stream `policy` does not name; an unnamed k_geo is kept at >= q8_0 when `kind` is 4-bit
        (positional geometry)."""
        if self.is_auto:
            raise ValueError("cache_kind='auto' is resolved when the cache is built (the Generator's cache resolver, "
                             "caramba.resolvers)")
        named = parse_policy(self.policy)
        streams = {name: KVCacheTensorConfig(named.get(name, self.kind), self.qblock, self.residual_len)
                   for name in ALL_STREAMS}
        if "k_geo" not in named:
            streams["k_geo"] = None   # CachePolicy applies the k_geo floor
        return CachePolicy(**streams, named=tuple(n for n in ALL_STREAMS if n in named),
                           **{name: getattr(self, name) for name in _CARRIED})

    @classmethod
    def of_policy(cls, policy: CachePolicy, **keep: Any) -> Any:
        """The settings that build `policy` (what `cache_kind: auto` resolves to); `keep`: the other
        fields of a subclass (CacheConfig's max_seq_len, ...)."""
        return cls.from_dict(policy.to_dict(), **keep)

    @classmethod
    def from_dict(cls, d: dict[str, Any], **keep: Any) -> Any:
        """Inverse of CachePolicy.to_dict (how plans store a policy), naming streams only where they
        differ from `v`'s kind, so a uniform policy fits standard and decoupled (DBA) models alike."""
        keys = ("k_sem", "k_geo") if "k_sem" in d else ("k",)
        named = {name: d[name] for name in keys if d[name] != d["v"]}
        stored = {opt.attr: d.get(opt.name, opt.default()) for opt in options_of(CacheSettings)
                  if opt.attr not in ("kind", "policy")}
        return cls(kind=d["v"], policy=named or None, **stored, **keep)


@dataclass(frozen=True)
class CachePolicy:
    """The built form of CacheSettings: each stream's storage (kind, qblock, residual_len) and the
    per-layer rules, as `model.new_cache` reads them (`for_layer`, `for_decoupled_layer`: each layer's
    keyword arguments)."""

    k: KVCacheTensorConfig = field(default_factory=KVCacheTensorConfig)
    v: KVCacheTensorConfig = field(default_factory=KVCacheTensorConfig)
    rotate_keys: bool = False
    fp16_prefix_layers: int = 0   # the first N layers keep K and V in fp16
    # Decoupled (DBA) models: semantic and geometric key streams (None: as `k`, and k_geo
    # never below q8_0 unless named; see CacheSettings.spec).
    k_sem: KVCacheTensorConfig | None = None
    k_geo: KVCacheTensorConfig | None = None
    named: tuple[str, ...] = ()   # the streams the policy named explicitly (checked per model)
    # Values stored Hadamard-rotated, the attention output rotated back (caramba.cache.layer);
    # standard attention only.
    rotate_values: bool = False
    sliding_kind: str | None = None   # a hybrid model's sliding layers' kind, K and V (None: as the others)

    def __post_init__(self) -> None:
        if self.fp16_prefix_layers < 0:
            raise ValueError(f"cache_fp16_prefix_layers={self.fp16_prefix_layers} must be >= 0")
        if self.k_sem is None:
            object.__setattr__(self, "k_sem", self.k)
        if self.k_geo is None:
            floor = KVCacheTensorConfig(K_GEO_FLOOR, self.k.qblock, self.k.residual_len)
            object.__setattr__(self, "k_geo", floor if 0 < self.k.kind.bits < K_GEO_FLOOR.bits else self.k)

    @classmethod
    def build(cls, kind: KVCacheKind | str = "fp32", policy: str | dict[str, Any] | None = None,
              **settings: Any) -> "CachePolicy":
        """`CacheSettings(kind=kind, policy=policy, **settings).spec()`: settings by field name
        (qblock, residual_len, rotate_keys, rotate_values, fp16_prefix_layers)."""
        return CacheSettings(kind=kind, policy=policy, **settings).spec()

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

    def for_layer(self, i: int, sliding: bool = False) -> dict[str, Any]:
        """Layer i's keyword arguments for LayerKVCache (its streams' storage and the per-layer
        rules): model.new_cache passes them as they are, so a new per-layer setting is its option
        (CacheSettings), its rule here and the code it changes in the layer. sliding: the layer is
        a hybrid model's sliding-window layer (its kind: sliding_kind, where set)."""
        if i < self.fp16_prefix_layers:
            fp16 = KVCacheTensorConfig("fp16")
            return {"k_cfg": fp16, "v_cfg": fp16, "rotate_keys": False, "rotate_values": False}
        if sliding and self.sliding_kind is not None:
            ring = KVCacheTensorConfig(self.sliding_kind, self.k.qblock)
            rotate = ring.quantized and self.rotate_keys, ring.quantized and self.rotate_values
            return {"k_cfg": ring, "v_cfg": ring, "rotate_keys": rotate[0], "rotate_values": rotate[1]}
        return {"k_cfg": self.k, "v_cfg": self.v, "rotate_keys": self.rotate_keys, "rotate_values": self.rotate_values}

    def for_decoupled_layer(self, i: int) -> dict[str, Any]:
        """Layer i's keyword arguments for DecoupledLayerKVCache (k_sem, k_geo and v streams)."""
        if i < self.fp16_prefix_layers:
            fp16 = KVCacheTensorConfig("fp16")
            return {"k_sem_cfg": fp16, "k_geo_cfg": fp16, "v_cfg": fp16, "rotate_keys": False}
        return {"k_sem_cfg": self.k_sem, "k_geo_cfg": self.k_geo, "v_cfg": self.v, "rotate_keys": self.rotate_keys}

    def stream_configs(self, i: int, decoupled: bool = False) -> list[KVCacheTensorConfig]:
        """Layer i's stream storage in order (k, v; or k_sem, k_geo, v)."""
        options = self.for_decoupled_layer(i) if decoupled else self.for_layer(i)
        return [value for value in options.values() if isinstance(value, KVCacheTensorConfig)]

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
        extras = [qblock, f"residual_len={self.k.residual_len}" if quantized and self.k.residual_len else "",
                  *(opt.attr if value is True else f"{opt.attr}={value}"
                    for opt, value in self._settings() if value != opt.default())]
        return " ".join([name] + [e for e in extras if e])

    def _settings(self) -> list[tuple[Any, Any]]:
        """(option, value) of each CacheSettings option this policy keeps as it is, in its order."""
        return [(opt, getattr(self, opt.attr)) for opt in options_of(CacheSettings) if opt.attr in _CARRIED]

    def to_dict(self) -> dict[str, Any]:
        """k and v always; k_sem and k_geo when the policy names one of them (a DBA policy); then the
        settings by option name (STORED_ALWAYS always, a later one where it is not its default)."""
        dba = {"k_sem": self.k_sem.kind.value, "k_geo": self.k_geo.kind.value} \
            if {"k_sem", "k_geo"} & set(self.named) else {}
        settings = sorted(self._settings(), key=lambda setting: setting[0].name not in STORED_ALWAYS)
        return {"k": self.k.kind.value, "v": self.v.kind.value, **dba, "qblock": self.k.qblock,
                "residual_len": self.k.residual_len,
                **{opt.name: value for opt, value in settings if opt.name in STORED_ALWAYS or value != opt.default()}}


# The settings a CachePolicy keeps as they are (its fields named like CacheSettings'); the others
# (kind, policy, qblock, residual_len) become its per-stream configs.
_CARRIED = tuple(f.name for f in fields(CacheSettings) if f.name in {g.name for g in fields(CachePolicy)})
