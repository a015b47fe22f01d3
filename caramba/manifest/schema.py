"""The manifest schema: what a manifest may say, checked by pydantic.

Every model forbids unknown fields, so a typo is an error instead of a silently ignored setting.
Only registered modes are accepted. A run's settings sections (`generate:`, `bench:`, ...) are
`Run` fields built from the table of mode sections below: the five first modes' sections are
declared here (a manifest validates without loading any runner); a mode added later brings its
own through caramba.runners.registry.register, which calls register_section.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import types
import typing
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, create_model, field_validator,
                      model_serializer, model_validator)
from pydantic.fields import FieldInfo

from caramba.autotune.select import AutotuneSettings
from caramba.infer.config import CacheConfig, DraftConfig, GenerateConfig, SpeculativeConfig
from caramba.infer.plan import DecodePlan
from caramba.manifest.yaml_lines import yaml11_note
from caramba.model import quant
from caramba.options import only_with, options_of
from caramba.press.config import PressConfig

# mode -> the run's key for its settings section, in the order modes were registered (which is
# the order `Run`'s fields, error messages and records list them). Filled by register_section.
MODE_SECTIONS: dict[str, str] = {}
MODE_SETTINGS: dict[str, type] = {}   # mode -> its settings model
MODES: tuple[str, ...] = ()           # the registered modes' names (reassigned by register_section)
Mode: Any = None                      # Literal[*MODES]: the type of `Run.mode` (idem)
# Sections every run's record lists, null when unused, since manifests began: kept so that the
# run hashes of existing records hold. A section registered later is listed only by its own runs,
# so adding a mode changes no other run's hash or record.
_LISTED_WHEN_UNUSED = ("generate", "bench", "speculative", "autotune", "eval")


def section_for(mode: str) -> str:
    return MODE_SECTIONS.get(mode, mode)

# Names become directories under runs/, so they must not contain '/' or start with '.'.
_SAFE_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
_VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _safe_id(value: str) -> str:
    if not _SAFE_ID.fullmatch(value):
        raise ValueError(
            f"{value!r} is not a safe identifier: use letters, digits, '-', '_' and '.' "
            "(not first); it names a directory under runs/"
        )
    return value


SafeId = Annotated[str, AfterValidator(_safe_id)]
# Rows decoded at once: past this a batch is a typo (its cache and activations grow with it; the
# memory preflight sizes what a run needs against the machine).
MAX_BATCH = 1024
Prompt = Annotated[str, Field(min_length=1)]


class _Model(BaseModel):
    # NaN and inf pass every `ge`/`le` check (or fail later mid-run); no manifest float means them.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_coercion(cls, value: Any, info: ValidationInfo) -> Any:
        """Booleans are true/false only: pydantic would take the string 'yes' (a string in YAML
        1.2) or the number 1 as True, True as the number 1 (`max_new_tokens: true`), and the
        strings '017' or '1_000' as numbers."""
        kinds = _plain_types(cls.model_fields[info.field_name].annotation)
        if bool in kinds and str not in kinds and isinstance(value, str):
            note = yaml11_note(value) or ": write true or false"
            raise ValueError(f"{value!r} is not a boolean{note}")
        if bool in kinds and not kinds & {int, float} and isinstance(value, (int, float)) and not isinstance(value, bool):
            raise ValueError(f"{value!r} is a number, not a boolean: write true or false")
        if isinstance(value, str) and str not in kinds and kinds & {int, float}:
            note = yaml11_note(value) or ": write the number without quotes"
            raise ValueError(f"{value!r} is a string, not a number{note}")
        if isinstance(value, bool) and bool not in kinds and kinds & {int, float}:
            raise ValueError(f"{str(value).lower()} is a boolean, not a number; write a number")
        return value


# The base of a mode's settings section (and every manifest model): unknown fields are errors,
# no NaN or inf, no silent bool/number coercion.
SettingsModel = _Model


def _plain_types(annotation: Any) -> set[Any]:
    """The plain types an annotation admits (bool | None -> {bool, NoneType}); Annotated unwrapped."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _plain_types(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return set().union(*(_plain_types(a) for a in typing.get_args(annotation)))
    if origin is Literal:
        return {type(choice) for choice in typing.get_args(annotation)}
    return {annotation} if isinstance(annotation, type) else set()


class ModelSpec(_Model):
    """Which weights to load and how."""

    source: str = "smollm2-135m"  # the embedded default, a .gguf file or an HF directory
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: Literal["cpu", "cuda", "mps", "auto"] = "cpu"
    # fp32: the checkpoint's values; q8_0 / q4_0: llama.cpp's 8- / 4-bit blocks (any source); native:
    # a GGUF's own Q4_1/Q8_0 blocks (same values as fp32); native_i16: those blocks times int16
    # activations (faster, logits up to ~1e-2 off). See caramba.model.quant.
    weights: Literal[quant.WEIGHT_KINDS] = "fp32"


def option_fields(config: type, *, keys: bool = False, defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """The pydantic fields of every manifest option in an engine config's tree (caramba.options):
    bounds, choices and help come from the one definition. keys: a section's own spellings."""
    fields: dict[str, Any] = {}
    hints = typing.get_type_hints(config)
    opts = {o.attr: o for o in options_of(config)}
    for f in dataclasses.fields(config):
        if f.name not in opts:
            if dataclasses.is_dataclass(hints[f.name]):
                fields.update(option_fields(hints[f.name], keys=keys, defaults=defaults))
            continue
        opt = opts[f.name]
        info = opt.info
        if not info.manifest:
            continue
        name = opt.key if keys else opt.name
        annotation = info.schema
        if annotation is None and info.choices is not None:
            annotation = Literal[info.choices]   # type: ignore[valid-type]
            annotation = annotation | None if opt.default() is None else annotation
        annotation = annotation or opt.type
        if info.required:   # X | None in the engine (None: no limit), but a section must give it
            members = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
            annotation, default = members[0], ...
        else:
            default = (defaults or {}).get(name, opt.default())
        bounds = {k: getattr(info, k) for k in ("ge", "gt", "le", "lt", "multiple_of") if getattr(info, k) is not None}
        field = Field(default_factory=f.default_factory, description=info.help, **bounds) \
            if f.default_factory is not dataclasses.MISSING else Field(default, description=info.help, **bounds)
        fields[name] = (annotation, field)
    return fields


@functools.cache
def _option_names(config: type, keys: bool = False) -> tuple[str, ...]:
    """The names option_fields gives: once per config (validating a run builds its engine config,
    and building fields each time cost a sweep of 10,000 runs most of its validation)."""
    return tuple(option_fields(config, keys=keys))


def _engine_error(error: Exception) -> ValueError:
    """An engine config's error as a manifest error: without the config's name (the location says where)."""
    message = str(error)
    for owner in ("GenerateConfig", "SpeculativeConfig", "AutotuneSettings"):
        message = message.removeprefix(f"{owner}: ").removeprefix(f"{owner}.")
    return ValueError(message)


# A section's own settings that act only with another of them, as OptionInfo.needs is for the
# engine's options (checked there, for the library and every CLI too).
_SECTION_NEEDS = {"system_prompt": "chat"}


class _GenerateSection(_Model):
    """What a `generate` run needs besides the engine's GenerateConfig options (derived below)."""

    prompts: list[Prompt] = Field(min_length=1)

    @field_validator("stop_sequences", check_fields=False)
    @classmethod
    def _no_empty_stop(cls, stops: list) -> list:
        for i, stop in enumerate(stops):
            if not stop:   # '' matches after any token: every row would end after its first
                raise ValueError(f"stop_sequences[{i}] is empty, which would end every generation after one "
                                 "token; remove it (or give the text that should end a reply)")
        return stops

    def engine_config(self, seed: int | None = None, eos_token_id: int | list[int] | None = None) -> GenerateConfig:
        """The engine config of these settings (the manifest's option keys are its flat names)."""
        options = {name: getattr(self, name) for name in _option_names(GenerateConfig)}
        return GenerateConfig(**options, seed=seed, eos_token_id=eos_token_id)

    @model_validator(mode="after")
    def _engine_accepts(self) -> Any:
        for name, needed in _SECTION_NEEDS.items():   # the engine's options check their own (OptionInfo.needs)
            if getattr(self, name) is not None and not getattr(self, needed):
                raise ValueError(f"{name}: {only_with(name, needed)}")
        try:   # cross-field rules live in the engine config: one place for library, CLI and manifests
            self.engine_config()
        except (ValueError, TypeError) as e:
            raise _engine_error(e) from None
        return self


GenerateSettings = create_model(
    "GenerateSettings", __base__=_GenerateSection, __module__=__name__,
    __doc__="Settings of a `generate` run: prompts, how to present them, and every GenerateConfig option.",
    **option_fields(GenerateConfig),
    chat=(bool, Field(False, description="render prompts through the model's chat template")),
    system_prompt=(str | None, Field(None, description="the system message (with chat: true)")),
    batch_size=(int, Field(1, ge=1, le=MAX_BATCH, description="prompts run in batches of this many, left-padded")),
    stream=(bool, Field(True, description="print tokens as they come when running interactively")))


class BenchSettings(_Model):
    """Settings of a `decode-bench` run: a grid of cells, each warmed up and repeated."""

    prompt_lens: list[Annotated[int, Field(ge=1)]] = Field([128, 512, 2048], min_length=1)
    batch_sizes: list[Annotated[int, Field(ge=1, le=MAX_BATCH)]] = Field([1], min_length=1)
    cache_kinds: list[str] = Field(["fp32"], min_length=1)
    # Decode plans: "none", "auto", "chunk=N" (fixed q_chunk), "window=W" or "chunk=N,window=W"
    # (a window changes outputs), e.g. ["none", "chunk=512"]. See docs/decode-plans.md.
    decode_plans: list[str] = Field(["none"], min_length=1)
    # KV eviction after each cell's prefill: "none" or METHOD@RATIO (ada_ prefix: AdaKV), e.g.
    # ["none", "snapkv@0.5"]. See docs/kv-cache.md#presses.
    presses: list[str] = Field(["none"], min_length=1)
    new_tokens: int = Field(32, ge=2)       # >= 2: the first token is prefill, the rest decode
    warmup: int = Field(1, ge=0)
    repeats: int = Field(3, ge=1)
    reference: Literal["none", "hf"] = "none"  # hf: the same cells through transformers' generate
    text: str | None = None                 # prompt text file; default: caramba's bundled corpus
    plots: bool = True                      # PNG plots (needs matplotlib)

    @field_validator("cache_kinds")
    @classmethod
    def _known_kinds(cls, kinds: list[str]) -> list[str]:
        from caramba.cache import KVCacheKind

        return [KVCacheKind.parse(kind).value for kind in kinds]

    @field_validator("presses")
    @classmethod
    def _known_presses(cls, presses: list[str]) -> list[str]:
        return [PressConfig.parse(text).describe() for text in presses]

    @field_validator("decode_plans")
    @classmethod
    def _known_plans(cls, plans: list[str]) -> list[str]:
        from caramba.infer.plan import parse_plan

        for text in plans:
            parse_plan(text)
        return plans

    @field_validator("prompt_lens", "batch_sizes", "cache_kinds", "decode_plans", "presses")
    @classmethod
    def _distinct(cls, values: list) -> list:
        # after the checks above: two spellings of one setting (Q8_0 and q8_0) are one value too
        duplicate = _first_duplicate(values)
        if duplicate is not None:
            raise ValueError(f"{duplicate!r} is listed twice: every cell would be measured twice under one name "
                             "(as an eval refuses a repeated length); list each value once")
        return values


class _SpeculativeSection(GenerateSettings):  # type: ignore[misc, valid-type]
    baseline: bool = True  # also decode the prompts plainly in the same run and record the speedup

    @property
    def wants_draft_model(self) -> bool:
        """Whether the run needs a `draft:` model spec beside its model."""
        return self.draft == "model"

    def engine_config(self, seed: int | None = None, eos_token_id: int | list[int] | None = None) -> SpeculativeConfig:
        options = {name: getattr(self, name) for name in _option_names(SpeculativeConfig)}
        return SpeculativeConfig(**options, seed=seed, eos_token_id=eos_token_id)


# A manifest names its draft model in the run's `draft:` spec, so the draft kind defaults to
# prompt lookup here (the library's SpeculativeGenerator defaults to a draft model it is given).
SpeculativeSettings = create_model(
    "SpeculativeSettings", __base__=_SpeculativeSection, __module__=__name__,
    __doc__="Settings of a `speculative` run: the generate settings plus the draft and its k rules.",
    **option_fields(DraftConfig, defaults={"draft": "prompt_lookup"}))


class _AutotuneSection(_Model):
    text: str | None = None   # gate text file; default: caramba's bundled corpus

    def engine_settings(self) -> AutotuneSettings:
        return AutotuneSettings(**{key: getattr(self, key) for key in _option_names(AutotuneSettings, keys=True)})

    @model_validator(mode="after")
    def _engine_accepts(self) -> Any:
        try:
            self.engine_settings()
        except (ValueError, TypeError) as e:
            raise _engine_error(e) from None
        return self


CacheAutotuneSettings = create_model(
    "CacheAutotuneSettings", __base__=_AutotuneSection, __module__=__name__,
    __doc__="Settings of a `cache-autotune` run (docs/autotune.md; defaults as caramba.autotune's).",
    **option_fields(AutotuneSettings, keys=True))


# The cache settings an eval candidate takes: CacheConfig's and its press's (not the cache's size
# or budget, which the eval sizes per sample), and the sliding window. Derived from their one
# definition, so a new CacheConfig option reaches eval candidates with no edit here.
_SIZED_BY_EVAL = ("max_seq_len", "cache_budget_mb")
CANDIDATE_CACHE_OPTIONS = (*(o.name for o in options_of(CacheConfig) if o.name not in _SIZED_BY_EVAL),
                           *(o.name for o in options_of(PressConfig)))
_LABEL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class _CandidateSection(_Model):
    name: str | None = Field(None, description="the candidate's label in the result (default: from its settings)")

    @field_validator("name")
    @classmethod
    def _label(cls, name: str | None) -> str | None:
        if name is not None and not _LABEL.fullmatch(name):
            raise ValueError(f"{name!r}: a candidate name is letters, digits and '_' (it names metrics, "
                             "e.g. 'q4_rot.tasks.niah_single.2048 >= 0.8' in expect:)")
        return name

    def cache_config(self) -> CacheConfig:
        opts = {o.name: o.attr for o in options_of(CacheConfig)}
        press = {o.name: o.attr for o in options_of(PressConfig)}
        return CacheConfig(**{opts[name]: getattr(self, name) for name in CANDIDATE_CACHE_OPTIONS if name in opts},
                           press=PressConfig(**{attr: getattr(self, name) for name, attr in press.items()}))

    def press_config(self) -> PressConfig | None:
        """The candidate's press (caramba.press), or None without one."""
        press = self.cache_config().press
        return press if press.enabled else None

    def policy(self):
        """The CachePolicy (caramba.cache) these settings build."""
        return self.cache_config().spec()

    @property
    def label(self) -> str:
        """The given name, or the policy's short description as a metric-safe word (q4_0_rotate_keys)."""
        if self.name is not None:
            return self.name
        policy, press = self.policy(), self.press_config()
        text = policy.describe(decoupled=bool({"k_sem", "k_geo"} & set(policy.named)))
        text += (f"_window{self.decode_local_window}" if self.decode_local_window else "")
        return re.sub(r"\W+", "_", text + (f"_{press.describe()}" if press else "")).strip("_")

    @model_validator(mode="after")
    def _engine_accepts(self) -> Any:
        if self.cache_kind == "auto":
            raise ValueError("cache_kind: auto is not a candidate: name a kind (mode: cache-autotune picks one)")
        try:
            self.cache_config()
        except (ValueError, TypeError) as e:
            raise _engine_error(e) from None
        return self


_CACHE_OPTION_FIELDS = option_fields(CacheConfig)
EvalCandidate = create_model(
    "EvalCandidate", __base__=_CandidateSection, __module__=__name__,
    __doc__="One KV cache an eval scores: every cache setting a generate run takes, and a name.",
    **{name: _CACHE_OPTION_FIELDS[name] for name in CANDIDATE_CACHE_OPTIONS},
    decode_local_window=option_fields(DecodePlan)["decode_local_window"])


class PerplexitySettings(_Model):
    """Scoring a text through each cache (caramba.infer.evaluate: the protocols of `caramba eval`)."""

    protocol: Literal["decode", "chunks"] = Field("decode", description="decode: prefill prompt_len tokens, then "
                                                  "score token by token; chunks: llama-perplexity's windows of ctx")
    prompt_len: int = Field(256, ge=1, description="decode: tokens prefilled before token-by-token scoring")
    ctx: int = Field(512, ge=4, multiple_of=2, description="chunks: window size (llama-perplexity -c)")
    max_tokens: int | None = Field(None, ge=2, description="the text's first N tokens (default: 1024 for decode, "
                                                           "the whole text for chunks)")
    text: str | None = Field(None, description="text file to score (default: caramba's bundled corpus)")


class TaskSettings(_Model):
    """Long-context tasks (caramba.infer.tasks, RULER's generated categories), answered greedily."""

    names: list[str] | None = Field(None, min_length=1, description="tasks to run (default: the whole suite)")
    lengths: list[Annotated[int, Field(ge=64)]] = Field([1024, 2048], min_length=1,
                                                        description="context lengths in the model's tokens")
    samples: int = Field(8, ge=1, description="samples per task and length")
    seed: int = Field(0, ge=0, description="the samples' seed: same seed, same prompts")
    chat: bool = Field(True, description="render prompts with the model's chat template")
    text: str | None = Field(None, description="the essay haystack's text file (default: caramba's bundled corpus)")
    prefill: Literal["shared", "own"] = Field("shared", description="shared: the context is prefilled once and each "
                                              "candidate stores it in its kinds; own: each candidate prefills it")
    q_chunk: int = Field(512, ge=1, description="tokens per prefill forward")
    batch_size: int = Field(8, ge=1, description="samples answered together (left-padded rows; each answers as "
                                                 "it would alone, up to float rounding)")

    @field_validator("names")
    @classmethod
    def _known_tasks(cls, names: list[str] | None) -> list[str] | None:
        from caramba.infer.tasks import task_names

        known = task_names()
        for name in names or []:
            if name not in known:
                hint = difflib.get_close_matches(name, known, n=1)
                raise ValueError(f"unknown task {name!r}" + (f"; did you mean {hint[0]!r}?" if hint else "")
                                 + f" (tasks: {', '.join(known)})")
        duplicate = _first_duplicate(names or [])
        if duplicate is not None:
            raise ValueError(f"task {duplicate!r} is listed twice")
        return names

    @field_validator("lengths")
    @classmethod
    def _distinct_lengths(cls, lengths: list[int]) -> list[int]:
        if len(set(lengths)) != len(lengths):
            raise ValueError("a context length is listed twice")
        return lengths


class EvalSettings(_Model):
    """Settings of an `eval` run: candidate caches against a baseline, scored on a text's
    perplexity and/or long-context tasks (docs/eval.md)."""

    candidates: list[EvalCandidate] = Field(min_length=1)   # type: ignore[valid-type]
    baseline: EvalCandidate = Field(default_factory=lambda: EvalCandidate())  # type: ignore[valid-type]
    perplexity: PerplexitySettings | None = None
    tasks: TaskSettings | None = None

    @model_validator(mode="after")
    def _something_to_score(self) -> EvalSettings:
        if self.perplexity is None and self.tasks is None:
            raise ValueError("an eval scores perplexity: and/or tasks:; give one of them (e.g. tasks: {})")
        labels = [c.label for c in self.candidates] + [self.baseline.label]
        duplicate = _first_duplicate(labels)
        if duplicate is not None:
            raise ValueError(f"two candidates (or a candidate and the baseline) are both labelled {duplicate!r}; "
                             "give one of them a name:")
        if self.perplexity is not None and any(c.decode_local_window for c in [*self.candidates, self.baseline]):
            raise ValueError("perplexity scores full-attention caches; a candidate with decode_local_window "
                             "is scored on tasks only: drop perplexity: or the window")
        if self.perplexity is not None and any(c.press_config() for c in self.candidates):
            raise ValueError("perplexity scores every cached token; a candidate with a press (KV eviction) is scored "
                             "on tasks only: drop perplexity: or the press")
        if self.baseline.press_config() is not None:
            raise ValueError("baseline: the baseline is the reference every candidate is compared with; it takes no "
                             "press: give the press to a candidate")
        for c in self.candidates:
            if c.press_config() is not None and c.decode_local_window:
                raise ValueError(f"candidate {c.label}: a press (KV eviction) and decode_local_window (a sliding "
                                 "window) are two ways of dropping tokens; use one of them")
        return self


class Expect(_Model):
    """What a run's result must show for `caramba run --check` (CI reproducibility)."""

    output_sha256: str | None = None   # sha256 of the generated ids (greedy runs): see --check output
    metrics: list[str] = []            # e.g. "decode_tok_s_median >= 5", "acceptance_rate >= 0.6"

    @field_validator("metrics")
    @classmethod
    def _parse_bounds(cls, metrics: list[str]) -> list[str]:
        from caramba.expect import parse_bound

        for text in metrics:
            parse_bound(text)
        return metrics


class Run(_Model):
    """One run. Its settings sections (one per registered mode, each `None` unless the run's mode
    reads it) are added between `draft` and `expect` by register_section."""

    id: SafeId
    mode: str   # Literal[*MODES], set by register_section
    seed: int | None = Field(None, ge=0, le=2**64 - 1)  # the range torch.manual_seed accepts
    model: ModelSpec | None = None  # fields given here override the defaults' model
    draft: ModelSpec | None = None  # speculative with draft: model; fields not given follow the run's model
    expect: Expect | None = None
    notes: str | None = None
    # A sweep's values for this run (set by matrix expansion, caramba.manifest.matrix; None otherwise).
    params: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _settings_for_mode(self) -> Run:
        section = section_for(self.mode)
        if getattr(self, section) is None:
            raise ValueError(f"mode {self.mode!r} needs a '{section}:' section with its settings")
        for other_mode in MODES:
            other = section_for(other_mode)
            if other != section and getattr(self, other, None) is not None:
                raise ValueError(f"'{other}:' is the section of mode {other_mode!r}, but this run's mode is {self.mode!r}")
        wants_draft = bool(getattr(self.settings, "wants_draft_model", False))
        if wants_draft and self.draft is None:
            raise ValueError("speculative.draft: model needs a 'draft:' model spec beside 'model:' "
                             "(e.g. draft: {source: path/to/small.gguf}), or another draft kind")
        if self.draft is not None and not wants_draft:
            raise ValueError("'draft:' is only used by mode: speculative with speculative.draft: model; remove it")
        return self

    @model_serializer(mode="wrap")
    def _unused_sections(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        for section in MODE_SECTIONS.values():
            if section not in _LISTED_WHEN_UNUSED and section in data and data[section] is None:
                del data[section]
        return data

    @property
    def settings(self) -> BaseModel:
        """The settings section of this run's mode."""
        return getattr(self, section_for(self.mode))


class Target(_Model):
    type: Literal["experiment"]
    name: SafeId
    runs: list[Run] = Field(min_length=1)

    @field_validator("runs")
    @classmethod
    def _unique_run_ids(cls, runs: list[Run]) -> list[Run]:
        duplicate = _first_duplicate(run.id for run in runs)
        if duplicate is not None:
            raise ValueError(f"duplicate run id {duplicate!r}: run ids must be unique within a target")
        return runs


class RayExecutor(_Model):
    """Resources of each run's Ray task (`caramba run --executor ray`)."""

    num_cpus: float = Field(1, gt=0, description="CPUs per run; also its torch threads")
    num_gpus: float = Field(0, ge=0, description="GPUs per run (fractions share a GPU)")


class SlurmExecutor(_Model):
    """Resources of each run's Slurm array task (`caramba run --executor slurm`, via submitit)."""

    partition: str | None = None
    time_min: int = Field(60, ge=1, description="time limit of one run's task, minutes")
    cpus: int = Field(1, ge=1, description="CPUs per task; also its torch threads")
    gpus: int = Field(0, ge=0, description="GPUs per task")
    array_parallelism: int | None = Field(None, ge=1, description="at most this many tasks at once (default: --jobs)")


class ExecutorSettings(_Model):
    """Where runs go when the command line picks an executor; no part of any run's identity."""

    ray: RayExecutor = Field(default_factory=RayExecutor)
    slurm: SlurmExecutor = Field(default_factory=SlurmExecutor)


class TrackingSettings(_Model):
    """Where `caramba run` also logs each run it finishes (caramba.tracking); no part of any run's
    identity, and a tracker that fails costs no record."""

    backend: Literal["mlflow", "wandb"] = Field("mlflow", description="the tracker (pip extra 'tracking')")
    uri: str | None = Field(None, description="MLflow tracking URI (default $MLFLOW_TRACKING_URI, else "
                                              "sqlite:///mlruns/mlflow.db beside the runs dir)")
    dir: str | None = Field(None, description="W&B: where its run files go (default: beside the runs dir)")
    experiment: str | None = Field(None, description="MLflow experiment / W&B project (default: the manifest's name)")
    offline: bool = Field(True, description="W&B: offline run files (`wandb sync` uploads them); false logs online")


class Defaults(_Model):
    model: ModelSpec = Field(default_factory=ModelSpec)


@dataclass(frozen=True)
class ResolvedRun:
    """One run with the model it will actually use (defaults merged with the run's override)."""

    target: str
    run: Run
    model: ModelSpec
    draft: ModelSpec | None = None  # a speculative run's draft model, resolved like `model`


class Manifest(_Model):
    version: Literal[1]
    name: SafeId
    vars: dict[str, str | int | float | bool] = {}
    defaults: Defaults = Field(default_factory=Defaults)
    targets: list[Target] = Field(min_length=1)
    executor: ExecutorSettings = Field(default_factory=ExecutorSettings)   # where runs go (docs/sweeps.md)
    tracking: TrackingSettings | None = None   # a tracker each finished run is logged to (docs/sweeps.md)

    @field_validator("name")
    @classmethod
    def _not_the_plan_store(cls, name: str) -> str:
        # runs/<name>/ would shadow the cache plan store (runs/cache_plans.json) and its lock.
        if name.startswith("cache_plans.json"):
            raise ValueError(f"{name!r} is the cache plan store's file name under runs/; name the manifest otherwise")
        return name

    @field_validator("vars", mode="before")
    @classmethod
    def _scalar_vars(cls, value: Any) -> Any:
        # Checked up front so a bad var gets one clear error instead of one per union member.
        if not isinstance(value, dict):
            return value
        for name, var in value.items():
            if not isinstance(name, str) or not _VAR_NAME.fullmatch(name):
                raise ValueError(f"var name {name!r} must be letters, digits and '_' (not starting with a digit)")
            if not isinstance(var, (str, int, float, bool)):
                raise ValueError(f"var {name!r} must be a string, number or bool (got {type(var).__name__})")
        return value

    @field_validator("targets")
    @classmethod
    def _unique_target_names(cls, targets: list[Target]) -> list[Target]:
        duplicate = _first_duplicate(target.name for target in targets)
        if duplicate is not None:
            raise ValueError(f"duplicate target name {duplicate!r}: target names must be unique")
        return targets

    def model_for(self, run: Run) -> ModelSpec:
        """The defaults' model with the fields the run gives on top."""
        if run.model is None:
            return self.defaults.model
        given = {name: getattr(run.model, name) for name in run.model.model_fields_set}
        return self.defaults.model.model_copy(update=given)

    def draft_for(self, run: Run) -> ModelSpec | None:
        """A speculative run's draft model: its fields on top of the run's resolved model."""
        if run.draft is None:
            return None
        given = {name: getattr(run.draft, name) for name in run.draft.model_fields_set}
        return self.model_for(run).model_copy(update=given)

    def iter_runs(self) -> Iterator[ResolvedRun]:
        for target in self.targets:
            for run in target.runs:
                yield ResolvedRun(target=target.name, run=run, model=self.model_for(run), draft=self.draft_for(run))


def register_section(mode: str, section: str, settings: type[BaseModel]) -> None:
    """Accept `mode: MODE` with its settings under `section:` in every manifest validated from now
    on. caramba.runners.registry.register calls this for a mode the table does not hold yet."""
    taken = {s: m for m, s in MODE_SECTIONS.items()}
    if mode in MODE_SECTIONS or (section in taken and taken[section] != mode):
        raise ValueError(f"mode {mode!r} (section {section!r}) clashes with a registered mode")
    if section in Run.model_fields:
        raise ValueError(f"{section!r} is a field of every run; choose another section name for mode {mode!r}")
    MODE_SECTIONS[mode] = section
    MODE_SETTINGS[mode] = settings
    _rebuild_runs()


def unregister_section(mode: str) -> None:
    """Forget a mode registered by register_section (a test's throwaway mode)."""
    MODE_SECTIONS.pop(mode)
    MODE_SETTINGS.pop(mode)
    _rebuild_runs()


def _rebuild_runs() -> None:
    """Run's fields from the table: its own, then one `SECTION: Settings | None` per mode, in
    registration order; then the models that hold runs are rebuilt around the new Run. (pydantic
    has no public way to add a field to a class in place; its field table and model_rebuild do it,
    and every `from ... import Run` keeps seeing the one class.)"""
    global MODES, Mode
    MODES = tuple(MODE_SECTIONS)
    Mode = Literal[MODES] if MODES else str   # type: ignore[valid-type]
    own = {name: f for name, f in Run.__pydantic_fields__.items() if name not in _section_fields}
    _section_fields.clear()
    _section_fields.update(MODE_SECTIONS.values())
    fields: dict[str, FieldInfo] = {}
    for name, info in own.items():
        if name == "mode":
            info = FieldInfo.from_annotation(Mode)
        if name == "expect":   # the sections go between draft and expect, as records list them
            fields.update({section: FieldInfo.from_annotated_attribute(MODE_SETTINGS[m] | None, None)
                           for m, section in MODE_SECTIONS.items()})
        fields[name] = info
    Run.__pydantic_fields__ = fields
    for model in (Run, Target, Manifest):
        model.model_rebuild(force=True)


_section_fields: set[str] = set()   # the Run fields that are sections now


def _first_duplicate(values: Iterable[str]) -> str | None:
    seen: set[str] = set()
    for value in values:
        if value in seen:
            return value
        seen.add(value)
    return None


def annotation_at(loc: Sequence[str | int]) -> Any:
    """The schema type at a location in a manifest (field names and list indexes), or None
    when the location is not in the schema. Used to name valid fields and values in errors."""
    annotation: Any = Manifest
    for key in loc:
        annotation = _unwrap(annotation)
        origin = typing.get_origin(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            field = annotation.model_fields.get(key) if isinstance(key, str) else None
            if field is None:
                return None
            annotation = field.annotation
        elif origin is list and isinstance(key, int):
            annotation = typing.get_args(annotation)[0]
        elif origin is dict:
            annotation = typing.get_args(annotation)[1]
        else:
            return None
    return _unwrap(annotation)


def _unwrap(annotation: Any) -> Any:
    """Strip Annotated[...] and `X | None` down to X."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(members) == 1:
            return _unwrap(members[0])
    return annotation


# The sections of the first five modes: part of the schema itself (see _LISTED_WHEN_UNUSED).
for _mode, _section, _settings in (("generate", "generate", GenerateSettings), ("decode-bench", "bench", BenchSettings),
                                   ("speculative", "speculative", SpeculativeSettings),
                                   ("cache-autotune", "autotune", CacheAutotuneSettings), ("eval", "eval", EvalSettings)):
    MODE_SECTIONS[_mode], MODE_SETTINGS[_mode] = _section, _settings
_rebuild_runs()
