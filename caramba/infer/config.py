"""Generation settings: small configs composed, each option defined once (caramba.options).

    GenerateConfig
      sampling     SamplingParams (caramba.infer.sampling)  how the next token is chosen
      max_new_tokens
      stop         StopConfig        what ends a row early (eos, stop sequences)
      cache        CacheConfig       how the KV cache stores K and V (caramba.cache.CacheSettings), or
                                     "auto" (the autotune picks), and its size
        auto       AutoCacheConfig   the autotune's gates, speed rounds and plan store
          gates    GateSettings
        press      PressConfig (caramba.press)               KV eviction after the prefill
      plan         DecodePlan (caramba.infer.plan)           chunked forwards, sliding windows
      beam         BeamConfig        beam search (caramba.infer.beam)
      contrastive  ContrastiveConfig contrastive search (caramba.infer.contrastive)
      seed
    SpeculativeConfig
      generate     GenerateConfig    the target's generation settings
      drafting     DraftConfig       the draft, k and its rules

The flat form is a convenience over the tree, as HF users and the seed guide write it:
`GenerateConfig(temperature=0.8, cache_kind="q8_0")`, `config.max_new_tokens`,
`config.seed = 1`, `config.replace(top_k=50)`. A flat name is the option's own (`name` in
caramba.options); `flat_names(GenerateConfig)` lists them, and the manifest's `generate:` section
has the same keys. Sub-configs are frozen: a flat write rebuilds the one it touches, so every
write is checked like a constructor call.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal

from caramba.cache.policy import CachePolicy, CacheSettings
from caramba.options import OptionError, check_options, option, options_of
from caramba.infer.drafts import DRAFT_KINDS
from caramba.infer.plan import DecodePlan
from caramba.press.config import PressConfig
from caramba.infer.sampling import SamplingParams

SPEC_METHODS = ("reject_sampling", "greedy")
MIB = 2**20


@dataclass(frozen=True)
class StopConfig:
    """What ends a row before max_new_tokens."""

    stop_sequences: list[str | list[int]] = option(default_factory=list, schema=list[str],
                                                   help="strings need a tokenizer; id lists keep their last token")
    eos_token_id: int | list[int] | None = option(None, manifest=False,
                                                  help="None: the tokenizer's end-of-reply ids, when there is one")
    pad_token_id: int | None = option(None, manifest=False, help="None: the first eos id, else 0")

    def __post_init__(self) -> None:
        check_options(self)

    def eos_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)


@dataclass(frozen=True)
class GateSettings:
    """The autotune's quality gates (caramba.autotune.gates); names as the seed docs write them."""

    cache_quality_max_delta_nll: float = option(0.05, help="mean NLL increase over the baseline cache, nats/token")
    cache_quality_max_ppl_ratio: float = option(1.05, gt=0, help="PPL ratio to the baseline cache")
    cache_quality_max_mean_kl: float = option(0.02, ge=0, help="mean KL(baseline || candidate), nats")
    cache_quality_needle_max_kl: float = option(0.1, ge=0, help="mean KL on the needle's answer tokens")
    cache_quality_prompt_len: int = option(256, ge=1, help="text tokens prefilled before scoring")
    cache_quality_decode_steps: int = option(32, ge=2, help="text tokens scored one at a time")
    cache_quality_needle_len: int = option(512, ge=32, help="haystack length, tokens")
    cache_quality_needle_depth: float = option(0.25, ge=0, le=1, help="0 = start of the context, 1 = end")

    def __post_init__(self) -> None:
        check_options(self)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class AutoCacheConfig:
    """How the autotune chooses (caramba.autotune): gates, the speed pick and the plan store."""

    gates: GateSettings = field(default_factory=GateSettings)
    benchmark: bool = option(True, name="cache_auto_benchmark",
                             help="time the passing candidates; false: the smallest passing one wins")
    speed_steps: int = option(4, ge=1, name="cache_auto_bench_steps", key="speed_steps",
                              help="timed decode steps per round")
    speed_repeats: int = option(3, ge=3, name="cache_auto_bench_repeats", key="speed_repeats",
                                help="timed rounds; the median counts")
    bench_context: int | None = option(None, ge=1, name="cache_auto_bench_prompt_len",
                                       help="context the candidates are timed at (default: max_seq_len)")
    plan_path: str | None = option(None, name="cache_plan_path", key="plan_path",
                                   help="the plan store (default: cache_plans.json under the runs directory)")
    probe: bool = option(True, name="cache_plan_probe", help="re-run the selection when the stored plan is stale")
    probe_interval_sec: float = option(3600.0, ge=0, name="cache_plan_probe_interval_sec",
                                       help="a plan older than this is stale")
    presses: tuple[str, ...] = option((), name="cache_auto_presses", key="presses",
                                      help="presses the autotune also tries, each alone and with quantized kinds "
                                           "(METHOD@RATIO or METHOD@RATIO/INTERVAL:TARGET, e.g. snapkv@0.5); the gates decide. "
                                           "Default none: the plans stay as they were")

    def __post_init__(self) -> None:
        check_options(self)
        presses = (self.presses,) if isinstance(self.presses, str) else tuple(self.presses)
        for text in presses:
            try:
                PressConfig.parse(text)
            except ValueError as e:
                raise OptionError("cache_auto_presses", text, f"is not a press: {e}") from None
        object.__setattr__(self, "presses", tuple(PressConfig.parse(t).describe() for t in presses
                                                  if PressConfig.parse(t).enabled))

    def press_configs(self) -> list[PressConfig]:
        """The presses the autotune tries (caramba.autotune.candidates)."""
        return [PressConfig.parse(text) for text in self.presses]


@dataclass(frozen=True)
class CacheConfig(CacheSettings):
    """The cache's storage settings (caramba.cache.CacheSettings: cache_kind, cache_policy, qblock,
    ...; `spec()` is the CachePolicy they build) plus its size, budget, autotune and press."""

    max_seq_len: int = option(2048, ge=1, name="max_seq_len", help="cache slots per row: prompt + new tokens")
    budget_mb: float | None = option(None, gt=0, name="cache_budget_mb",
                                     help="MiB for the whole cache; auto picks within it, a named kind must fit it")
    auto: AutoCacheConfig = field(default_factory=AutoCacheConfig)
    press: PressConfig = field(default_factory=PressConfig)   # eviction after the prefill (caramba.press)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.is_auto and self.auto.presses and self.press.enabled:
            raise OptionError("cache_auto_presses", ",".join(self.auto.presses), f"lets the autotune choose the press; "
                              f"drop press={self.press.method} or cache_auto_presses")

    def with_policy(self, policy: CachePolicy, press: str | None = None) -> CacheConfig:
        """These settings with `policy` in place of the kind (what `auto` resolves to); `press`: the
        plan's press (PressConfig.parse's form, from cache_auto_presses) in place of this one."""
        return CacheConfig.of_policy(policy, max_seq_len=self.max_seq_len, budget_mb=self.budget_mb, auto=self.auto,
                                     press=self.press if press is None else PressConfig.parse(press))

    def check_budget(self, nbytes: int) -> None:
        """A named kind with a budget: the cache it builds must fit."""
        if self.budget_mb is not None and nbytes > self.budget_mb * MIB:
            raise ValueError(f"the {self.spec().describe()} cache for max_seq_len={self.max_seq_len} needs "
                             f"{nbytes / MIB:.2f} MiB > cache_budget_mb={self.budget_mb:g}; raise the budget, lower "
                             "max_seq_len or the batch, or use cache_kind='auto' to pick a cache that fits")


@dataclass(frozen=True)
class BeamConfig:
    """Beam search (caramba.infer.beam), HF's meaning of each setting."""

    num_beams: int = option(1, ge=1, help="> 1: beam search (deterministic)")
    num_return_sequences: int = option(1, ge=1, help="beams returned per prompt (<= num_beams)")
    length_penalty: float = option(1.0, help="beam score = sum log p / length ** this")
    early_stopping: bool | str = option(False, choices=(True, False, "never"),
                                        schema=bool | Literal["never"], help="true, false or never (HF's meaning)")

    def __post_init__(self) -> None:
        check_options(self)
        if self.num_return_sequences > self.num_beams:
            raise OptionError("num_return_sequences", self.num_return_sequences,
                              f"exceeds num_beams={self.num_beams}; raise num_beams or lower num_return_sequences")


@dataclass(frozen=True)
class ContrastiveConfig:
    """Contrastive search (caramba.infer.contrastive): with top_k candidates per step."""

    penalty_alpha: float | None = option(None, ge=0, le=1, help="degeneration penalty; set: contrastive search (needs top_k)")

    def __post_init__(self) -> None:
        check_options(self)


@dataclass(frozen=True)
class DraftConfig:
    """Speculative decoding's draft and its k rules (caramba.infer.speculative)."""

    draft: str = option("model", choices=DRAFT_KINDS, help="model (a separate draft model), prompt_lookup, self_int8 or layer_skip")
    spec_k: int = option(4, ge=1, help="tokens drafted per round (the start value when adaptive)")
    spec_k_adaptive: bool = option(False, help="HF's heuristic: all accepted -> k += 2, else k - 1")
    spec_k_max: int = option(16, ge=1, help="upper bound on k")
    spec_method: str = option("reject_sampling", choices=SPEC_METHODS,
                              help="greedy: accept drafts equal to the target's own pick")
    spec_extra_token: bool = option(True, help="a bonus target token when every draft is accepted")
    spec_disable_below_accept: float = option(0.0, ge=0, le=1, help="fall back to plain decoding below this acceptance")
    spec_confidence: float | None = option(None, gt=0, le=1, help="model drafts stop below this draft probability (HF: 0.4)")
    draft_layers: int | None = option(None, ge=1, help="layer_skip: the target's first N layers (default half)")
    lookup_max_ngram: int = option(3, ge=1, help="prompt_lookup: longest n-gram matched")
    lookup_min_ngram: int = option(1, ge=1, help="prompt_lookup: shortest n-gram matched")

    def __post_init__(self) -> None:
        check_options(self)
        if self.spec_k_max < self.spec_k:
            raise OptionError("spec_k_max", self.spec_k_max, f"must be >= spec_k ({self.spec_k})")
        if self.lookup_min_ngram > self.lookup_max_ngram:
            raise OptionError("lookup_min_ngram", self.lookup_min_ngram,
                              f"must be in [1, lookup_max_ngram] (lookup_max_ngram={self.lookup_max_ngram})")


class ConfigError(ValueError):
    """A setting that conflicts with another, named by the config it was given to."""

    def __init__(self, owner: str, detail: str) -> None:
        super().__init__(f"{owner}: {detail}")
        self.detail = detail


class Composed:
    """Flat access over a tree of frozen option dataclasses (see the module doc). A subclass is a
    dataclass whose fields are sub-configs and top-level options."""

    def __init__(self, **kwargs: Any) -> None:
        parts = {f.name: kwargs.pop(f.name) for f in dataclasses.fields(self) if f.name in kwargs}
        for f in dataclasses.fields(self):
            value = parts[f.name] if f.name in parts else (f.default_factory() if f.default is dataclasses.MISSING else f.default)
            object.__setattr__(self, f.name, value)
        self._apply(kwargs)

    def _apply(self, flat: dict[str, Any]) -> None:
        paths = flat_paths(type(self))
        unknown = [name for name in flat if name not in paths]
        if unknown:
            hint = difflib.get_close_matches(unknown[0], list(paths), n=1)
            raise TypeError(f"{type(self).__name__} got an unexpected option {unknown[0]!r}"
                            + (f"; did you mean {hint[0]!r}?" if hint else ""))
        updates = {paths[name]: value for name, value in flat.items()}
        owner = type(self).__name__
        try:
            for name, value in _assign_fields(self, updates).items():
                object.__setattr__(self, name, value)
            self._validate()
        except OptionError as e:   # name it as this (outermost) config: "GenerateConfig.top_k=0 ..."
            raise OptionError(f"{owner}.{e.name.rpartition('.')[2]}", e.value, e.why) from None
        except ConfigError as e:
            raise ConfigError(owner, e.detail) from None
        except ValueError as e:
            raise ConfigError(owner, str(e)) from None

    def _validate(self) -> None:
        check_options(self)

    def __getattr__(self, name: str) -> Any:   # only for names that are not attributes: the flat ones
        path = flat_paths(type(self)).get(name)
        if path is None or name.startswith("_"):
            raise AttributeError(f"{type(self).__name__} has no option {name!r}")
        value = self
        for part in path:
            value = getattr(value, part)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        self._apply({name: value})

    def replace(self, **flat: Any) -> Any:
        """A copy with flat options (or whole sub-configs) changed."""
        return type(self)(**{**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, **flat})

    def to_dict(self) -> dict[str, Any]:
        """Every option by flat name (how records and --json output name them)."""
        return {name: getattr(self, name) for name in flat_names(type(self))}


def _assign_fields(obj: Any, updates: dict[tuple[str, ...], Any]) -> dict[str, Any]:
    """The new values of obj's fields for updates {path: value}: a nested sub-config is rebuilt once
    with all of its updates (so cross-field checks see them together)."""
    direct: dict[str, Any] = {}
    nested: dict[str, dict[tuple[str, ...], Any]] = {}
    for path, value in updates.items():
        if len(path) == 1:
            direct[path[0]] = value
        else:
            nested.setdefault(path[0], {})[path[1:]] = value
    for name, sub in nested.items():
        child = direct.get(name, getattr(obj, name))
        direct[name] = dataclasses.replace(child, **_assign_fields(child, sub))
    return direct


@lru_cache(maxsize=None)
def flat_paths(cls: type) -> dict[str, tuple[str, ...]]:
    """Flat name -> attribute path, over cls's tree of configs: every option by its name (and by
    its section key, where one differs), and every sub-config by its field name."""
    paths: dict[str, tuple[str, ...]] = {}
    opts = {o.attr: o for o in options_of(cls)}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in opts:
            paths[opts[f.name].name] = paths[opts[f.name].key] = (f.name,)
        elif dataclasses.is_dataclass(hints[f.name]):
            paths[f.name] = (f.name,)
            paths.update({flat: (f.name, *path) for flat, path in flat_paths(hints[f.name]).items()})
    return paths


def flat_names(cls: type) -> list[str]:
    """Every option's flat name, in tree order (no section keys, no sub-config names)."""
    names: list[str] = []
    hints = typing.get_type_hints(cls)
    opts = {o.attr: o for o in options_of(cls)}
    for f in dataclasses.fields(cls):
        if f.name in opts:
            names.append(opts[f.name].name)
        elif dataclasses.is_dataclass(hints[f.name]):
            names.extend(flat_names(hints[f.name]))
    return names


@dataclass(init=False, eq=True, repr=True)
class GenerateConfig(Composed):
    """Every generation setting (see the module doc). Keywords are sub-configs or flat options."""

    max_new_tokens: int = option(64, ge=1, help="tokens generated per row at most")
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: StopConfig = field(default_factory=StopConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    plan: DecodePlan = field(default_factory=DecodePlan)
    beam: BeamConfig = field(default_factory=BeamConfig)
    contrastive: ContrastiveConfig = field(default_factory=ContrastiveConfig)
    seed: int | None = option(None, ge=0, le=2**64 - 1, manifest=False, help="sampling seed; None: torch's global RNG")

    def _validate(self) -> None:
        check_options(self)
        eos = tuple(self.stop.eos_ids())
        if self.sampling.eos_token_ids != eos:   # what min_new_tokens suppresses
            object.__setattr__(self, "sampling", dataclasses.replace(self.sampling, eos_token_ids=eos))
        searching = self.beam.num_beams > 1 or self.contrastive.penalty_alpha is not None
        if self.contrastive.penalty_alpha is not None and (self.sampling.top_k is None or self.beam.num_beams > 1):
            raise OptionError("penalty_alpha", self.contrastive.penalty_alpha,
                              "(contrastive search) needs top_k and num_beams=1; set top_k or drop penalty_alpha")
        s = self.sampling
        if searching and (self.stop.stop_sequences or s.min_p is not None or s.temperature not in (0.0, 1.0)
                          or s.top_p is not None):
            raise ValueError("beam and contrastive search are deterministic and stop on EOS / max_new_tokens: "
                             "drop stop_sequences, min_p, top_p and set temperature to 0")
        if self.beam.num_beams > 1 and s.top_k is not None:
            raise OptionError("top_k", s.top_k, "is not used by beam search (only by contrastive search); "
                              "drop top_k or num_beams")
        press = self.cache.press
        if self.cache.is_auto and self.cache.auto.presses and (searching or self.plan.local_window is not None):
            raise OptionError("cache_auto_presses", ",".join(self.cache.auto.presses), "may choose a press, which "
                              "beam/contrastive search and decode_local_window do not take; drop cache_auto_presses")
        if press.enabled and searching:
            raise OptionError("press", press.method, "(KV eviction) runs with greedy, sampled and speculative decoding, "
                              "not beam or contrastive search; drop press or num_beams / penalty_alpha")
        if press.enabled and self.plan.local_window is not None:
            raise OptionError("press", press.method, "(KV eviction) and decode_local_window (a sliding window) are two "
                              "ways of dropping tokens; use one of them")
        if searching and self.plan.local_window is not None:
            raise OptionError("decode_local_window", self.plan.local_window,
                              "(sliding-window attention) is not supported by beam or contrastive search; drop it "
                              "or num_beams / penalty_alpha")

    # The names the engine reads most, kept short.
    @property
    def decode(self) -> DecodePlan:
        return self.plan

    def cache_spec(self) -> CachePolicy:
        return self.cache.spec()

    def eos_ids(self) -> list[int]:
        return self.stop.eos_ids()

    @property
    def search(self) -> str | None:
        """"beam" or "contrastive" when the settings ask for a search instead of sampling/greedy."""
        if self.beam.num_beams > 1:
            return "beam"
        return "contrastive" if self.contrastive.penalty_alpha is not None else None


# Processors that read the generated history, which drafts do not track, and other decoders.
SPEC_UNSUPPORTED = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "no_repeat_ngram_size": 0, "min_new_tokens": 0,
                    "num_beams": 1, "num_return_sequences": 1, "penalty_alpha": None,
                    "decode_local_window": None}   # rejected drafts leave holes a slot window would count


@dataclass(init=False, eq=True, repr=True)
class SpeculativeConfig(Composed):
    """A GenerateConfig for the target plus the draft's settings; flat keywords reach both."""

    generate: GenerateConfig = field(default_factory=GenerateConfig)
    drafting: DraftConfig = field(default_factory=DraftConfig)

    def _validate(self) -> None:
        for name, default in SPEC_UNSUPPORTED.items():
            value = getattr(self.generate, name)
            if value != default:
                raise OptionError(name, value, f"is not supported with speculative decoding; leave it at {default!r} "
                                  "or use plain decoding")
        cache = self.generate.cache
        decoding = [p for p in cache.auto.presses if PressConfig.parse(p).decoding] if cache.is_auto else []
        if decoding:
            raise OptionError("cache_auto_presses", ",".join(decoding), "includes decoding-time compression, which "
                              "speculative decoding does not take; drop the /INTERVAL:TARGET presses")
        if cache.press.decoding:   # a compression inside a verified block would have to be rolled back with it
            raise OptionError("press_interval", cache.press.interval, "(decoding-time compression) is not supported "
                              "with speculative decoding: rejected drafts cannot roll back an eviction; drop "
                              "press_interval (the context press, press_ratio, works) or use plain decoding")
        if not cache.is_auto:
            policy = cache.spec()
            grouped = sorted({c.kind.value for c in (policy.k, policy.v, policy.k_sem, policy.k_geo) if c.kind.spec.per_channel})
            if grouped:   # a rejected draft would leave a group quantized twice: not plain decoding's cache
                raise OptionError("cache_kind", ",".join(grouped), "quantizes groups of tokens per channel, which "
                                  "rejected drafts cannot roll back exactly; use a per-token kind with speculative decoding")

    def __getattr__(self, name: str) -> Any:   # flat options, then GenerateConfig's helpers (eos_ids, decode, ...)
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_"):
                raise
            return getattr(self.generate, name)

    def generate_config(self) -> GenerateConfig:
        """The plain-decoding config with the same generation settings (the baseline)."""
        return self.generate.replace()

