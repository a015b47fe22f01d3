"""The manifest schema: what a manifest may say, checked by pydantic.

Every model forbids unknown fields, so a typo is an error instead of a silently ignored setting.
Only registered modes are accepted. A run's settings sections (`generate:`, `bench:`, ...) are
`Run` fields, one per mode in the registry of modes (caramba.manifest.modes), whose first five
sections are caramba.manifest.sections' (a manifest validates without loading any runner); a mode
added later brings its own through caramba.runners.registry.register.

`Run`, `Target` and `Manifest` are built from that registry (pydantic.create_model) and built
again when it changes, so read them from this module when they are used (`schema.Manifest`):
a name imported once keeps the models of that moment.
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, create_model, field_validator, model_serializer, model_validator

from caramba.expect import parse_bound
from caramba.manifest import modes
from caramba.manifest.base import MAX_BATCH, Prompt, SafeId, SettingsModel, first_duplicate, option_fields
from caramba.manifest.modes import MODE_SECTIONS, MODE_SETTINGS, register_section, section_for, unregister_section
from caramba.manifest.sections import (CANDIDATE_CACHE_OPTIONS, BenchSettings, CacheAutotuneSettings, EvalCandidate,
                                       EvalSettings, GenerateSettings, PerplexitySettings, SpeculativeSettings,
                                       TaskSettings)
from caramba.model import quant

_VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class ModelSpec(SettingsModel):
    """Which weights to load and how."""

    source: str = "smollm2-135m"  # the embedded default, a .gguf file or an HF directory
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: Literal["cpu", "cuda", "mps", "auto"] = "cpu"
    # fp32: the checkpoint's values; q8_0 / q4_0: llama.cpp's 8- / 4-bit blocks (any source); native:
    # a GGUF's own blocks (Q8_0, Q4_0/1, Q5_0/1, Q4_K, Q5_K, Q6_K; same values as fp32); native_i16: those times int16
    # activations (faster, logits up to ~1e-2 off). See caramba.model.quant.
    weights: Literal[quant.WEIGHT_KINDS] = "fp32"


class Expect(SettingsModel):
    """What a run's result must show for `caramba run --check` (CI reproducibility)."""

    output_sha256: str | None = None   # sha256 of the generated ids (greedy runs): see --check output
    metrics: list[str] = []            # e.g. "decode_tok_s_median >= 5", "acceptance_rate >= 0.6"

    @field_validator("metrics")
    @classmethod
    def _parse_bounds(cls, metrics: list[str]) -> list[str]:
        for text in metrics:
            parse_bound(text)
        return metrics


class _RunBase(SettingsModel):
    """What every Run model does (its fields: _run_fields)."""

    @model_validator(mode="after")
    def _settings_for_mode(self) -> _RunBase:
        section = section_for(self.mode)
        if getattr(self, section) is None:
            raise ValueError(f"mode {self.mode!r} needs a '{section}:' section with its settings")
        for other_mode, other_entry in modes.entries().items():
            other = other_entry.section
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
        for entry in modes.entries().values():
            if not entry.built_in and entry.section in data and data[entry.section] is None:
                del data[entry.section]
        return data

    @property
    def settings(self) -> BaseModel:
        """The settings section of this run's mode."""
        return getattr(self, section_for(self.mode))


def _run_fields() -> dict[str, Any]:
    """Run's fields, in the order records list them: its own, with one `SECTION: Settings | None`
    per registered mode (registration order) between draft and expect."""
    names = tuple(modes.entries())
    sections = {e.section: (e.settings | None, None) for e in modes.entries().values()}
    fields = {
        "id": (SafeId, ...),
        "mode": (Literal[names] if names else str, ...),   # type: ignore[valid-type]
        "seed": (int | None, Field(None, ge=0, le=2**64 - 1)),  # the range torch.manual_seed accepts
        "model": (ModelSpec | None, None),  # fields given here override the defaults' model
        "draft": (ModelSpec | None, None),  # speculative with draft: model; fields not given follow the run's model
        **sections,
        "expect": (Expect | None, None),
        "notes": (str | None, None),
        # A sweep's values for this run (set by matrix expansion, caramba.manifest.matrix; None otherwise).
        "params": (dict[str, Any] | None, None),
    }
    assert set(fields) - set(sections) == set(modes.RUN_FIELDS)
    return fields


class _TargetBase(SettingsModel):
    """What every Target model does (its fields: _models)."""

    @field_validator("runs", check_fields=False)
    @classmethod
    def _unique_run_ids(cls, runs: list) -> list:
        duplicate = first_duplicate(run.id for run in runs)
        if duplicate is not None:
            raise ValueError(f"duplicate run id {duplicate!r}: run ids must be unique within a target")
        return runs


class RayExecutor(SettingsModel):
    """Resources of each run's Ray task (`caramba run --executor ray`)."""

    num_cpus: float = Field(1, gt=0, description="CPUs per run; also its torch threads")
    num_gpus: float = Field(0, ge=0, description="GPUs per run (fractions share a GPU)")


class SlurmExecutor(SettingsModel):
    """Resources of each run's Slurm array task (`caramba run --executor slurm`, via submitit)."""

    partition: str | None = None
    time_min: int = Field(60, ge=1, description="time limit of one run's task, minutes")
    cpus: int = Field(1, ge=1, description="CPUs per task; also its torch threads")
    gpus: int = Field(0, ge=0, description="GPUs per task")
    array_parallelism: int | None = Field(None, ge=1, description="at most this many tasks at once (default: --jobs)")


class ExecutorSettings(SettingsModel):
    """Where runs go when the command line picks an executor; no part of any run's identity."""

    ray: RayExecutor = Field(default_factory=RayExecutor)
    slurm: SlurmExecutor = Field(default_factory=SlurmExecutor)


class TrackingSettings(SettingsModel):
    """Where `caramba run` also logs each run it finishes (caramba.tracking); no part of any run's
    identity, and a tracker that fails costs no record."""

    backend: Literal["mlflow", "wandb"] = Field("mlflow", description="the tracker (pip extra 'tracking')")
    uri: str | None = Field(None, description="MLflow tracking URI (default $MLFLOW_TRACKING_URI, else "
                                              "sqlite:///mlruns/mlflow.db beside the runs dir)")
    dir: str | None = Field(None, description="W&B: where its run files go (default: beside the runs dir)")
    experiment: str | None = Field(None, description="MLflow experiment / W&B project (default: the manifest's name)")
    offline: bool = Field(True, description="W&B: offline run files (`wandb sync` uploads them); false logs online")


class Defaults(SettingsModel):
    model: ModelSpec = Field(default_factory=ModelSpec)


@dataclass(frozen=True)
class ResolvedRun:
    """One run with the model it will actually use (defaults merged with the run's override)."""

    target: str
    run: Run
    model: ModelSpec
    draft: ModelSpec | None = None  # a speculative run's draft model, resolved like `model`


class _ManifestBase(SettingsModel):
    """What every Manifest model does (its fields: _models)."""

    @field_validator("name", check_fields=False)
    @classmethod
    def _not_the_plan_store(cls, name: str) -> str:
        # runs/<name>/ would shadow the cache plan store (runs/cache_plans.json) and its lock.
        if name.startswith("cache_plans.json"):
            raise ValueError(f"{name!r} is the cache plan store's file name under runs/; name the manifest otherwise")
        return name

    @field_validator("vars", mode="before", check_fields=False)
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

    @field_validator("targets", check_fields=False)
    @classmethod
    def _unique_target_names(cls, targets: list) -> list:
        duplicate = first_duplicate(target.name for target in targets)
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


if typing.TYPE_CHECKING:   # names for annotations and checkers: the models are _models()'s
    Run = _RunBase
    Target = _TargetBase
    Manifest = _ManifestBase
    MODES: tuple[str, ...]
    Mode: Any

_RUN_DOC = """One run. Its settings sections (one per registered mode, each `None` unless the run's mode
    reads it) are added between `draft` and `expect` by register_section."""
_built: dict[str, Any] = {}   # the models of registry version _built["version"]


def _models() -> dict[str, Any]:
    """Run, Target and Manifest (and MODES, Mode) for the registry as it stands: built on first
    use and again after each registration, never changed in place."""
    if _built.get("version") == modes.version():
        return _built
    run = create_model("Run", __base__=_RunBase, __module__=__name__, __doc__=_RUN_DOC, **_run_fields())
    target = create_model("Target", __base__=_TargetBase, __module__=__name__, type=(Literal["experiment"], ...),
                          name=(SafeId, ...), runs=(list[run], Field(min_length=1)))
    manifest = create_model(
        "Manifest", __base__=_ManifestBase, __module__=__name__, version=(Literal[1], ...), name=(SafeId, ...),
        vars=(dict[str, str | int | float | bool], {}), defaults=(Defaults, Field(default_factory=Defaults)),
        targets=(list[target], Field(min_length=1)),
        executor=(ExecutorSettings, Field(default_factory=ExecutorSettings)),   # where runs go (docs/sweeps.md)
        tracking=(TrackingSettings | None, None))   # a tracker each finished run is logged to (docs/sweeps.md)
    names = tuple(modes.entries())
    _built.clear()
    _built.update(version=modes.version(), Run=run, Target=target, Manifest=manifest, MODES=names,
                  Mode=Literal[names] if names else str)
    return _built


def __getattr__(name: str) -> Any:
    """schema.Run, .Target, .Manifest, .MODES (the registered modes' names) and .Mode (the type of
    Run.mode), as the registry stands now."""
    if name in ("Run", "Target", "Manifest", "MODES", "Mode"):
        return _models()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def annotation_at(loc: Sequence[str | int]) -> Any:
    """The schema type at a location in a manifest (field names and list indexes), or None
    when the location is not in the schema. Used to name valid fields and values in errors."""
    annotation: Any = _models()["Manifest"]
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


__all__ = ["CANDIDATE_CACHE_OPTIONS", "MAX_BATCH", "MODES", "MODE_SECTIONS", "MODE_SETTINGS", "BenchSettings",
           "CacheAutotuneSettings", "Defaults", "EvalCandidate", "EvalSettings", "ExecutorSettings", "Expect",
           "GenerateSettings", "Manifest", "Mode", "ModelSpec", "PerplexitySettings", "Prompt", "RayExecutor",
           "ResolvedRun", "Run", "SafeId", "SettingsModel", "SlurmExecutor", "SpeculativeSettings", "Target",
           "TaskSettings", "TrackingSettings", "annotation_at", "option_fields", "register_section", "section_for",
           "unregister_section"]
