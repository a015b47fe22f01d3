"""The manifest schema: what a manifest may say, checked by pydantic.

Every model forbids unknown fields, so a typo is an error instead of a silently ignored setting.
Only modes that are built are accepted; a new mode adds its name to `Mode` and its settings
section to `Run`.
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

Mode = Literal["generate", "decode-bench", "speculative", "cache-autotune"]
MODES: tuple[str, ...] = typing.get_args(Mode)
# The settings section each mode reads (a mode whose section has its own name is left out).
MODE_SECTIONS: dict[str, str] = {"decode-bench": "bench", "cache-autotune": "autotune"}


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
Prompt = Annotated[str, Field(min_length=1)]


class _Model(BaseModel):
    # NaN and inf pass every `ge`/`le` check (or fail later mid-run); no manifest float means them.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ModelSpec(_Model):
    """Which weights to load and how."""

    source: str = "smollm2-135m"  # the embedded default, a .gguf file or an HF directory
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: Literal["cpu", "cuda", "mps", "auto"] = "cpu"


class GenerateSettings(_Model):
    """Settings of a `generate` run."""

    prompts: list[Prompt] = Field(min_length=1)
    max_new_tokens: int = Field(64, ge=1)
    temperature: float = Field(1.0, ge=0)  # 0 means greedy
    top_k: int | None = Field(None, ge=1)
    top_p: float | None = Field(None, gt=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    min_p: float | None = Field(None, ge=0, le=1)
    min_new_tokens: int = Field(0, ge=0)
    no_repeat_ngram_size: int = Field(0, ge=0)      # 0 = off
    frequency_penalty: float = 0.0                  # OpenAI-style, on generated tokens
    presence_penalty: float = 0.0
    num_beams: int = Field(1, ge=1)                 # > 1: beam search
    num_return_sequences: int = Field(1, ge=1)      # beams returned per prompt (<= num_beams)
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    penalty_alpha: float | None = Field(None, ge=0, le=1)   # contrastive search (needs top_k)
    stop_sequences: list[str] = []
    max_seq_len: int = Field(2048, ge=1)
    # auto: the stored cache plan for this model, machine, max_seq_len, batch_size and
    # cache_budget_mb (docs/autotune.md), or a fresh selection when there is none
    cache_kind: Literal["fp32", "fp16", "bf16", "q8_0", "q4_0", "nf4", "q8", "q4", "auto"] = "fp32"
    cache_budget_mb: float | None = Field(None, gt=0)  # cache_kind: auto only; MiB for the whole cache
    # k/v (standard attention) or k_sem/k_geo/v (decoupled/DBA models); checked against the model at run time
    cache_policy: dict[Literal["k", "v", "k_sem", "k_geo"], Literal["fp32", "fp16", "bf16", "q8_0", "q4_0", "nf4", "q8", "q4"]] | None = None
    qblock: int = Field(32, ge=2, multiple_of=2)  # elements per quantization block (clipped to head_dim)
    residual_len: int = Field(0, ge=0)          # newest tokens also kept in full precision
    rotate_keys: bool = False                   # Hadamard-rotate keys before quantizing them
    cache_fp16_prefix_layers: int = Field(0, ge=0)  # the first N layers keep an fp16 cache
    # Decode plan (docs/decode-plans.md): chunked forwards keep outputs; a local window changes them.
    decode_plan: Literal["auto", "fixed", "none"] = "none"
    decode_bucket_short: int = Field(512, ge=1)     # auto: prompts up to this run unchunked
    decode_bucket_mid: int = Field(2048, ge=1)      # auto: longer prompts use the long chunk size
    decode_q_chunk: int | None = Field(None, ge=1)  # tokens per forward (fixed; overrides auto's sizes)
    decode_local_window: int | None = Field(None, ge=1)  # sliding-window attention span: CHANGES OUTPUTS
    chat: bool = False  # render prompts through the model's chat template
    system_prompt: str | None = None
    batch_size: int = Field(1, ge=1)  # prompts run in batches of this many, left-padded
    stream: bool = True  # print tokens as they come when running interactively

    @model_validator(mode="after")
    def _system_prompt_needs_chat(self) -> GenerateSettings:
        if self.system_prompt is not None and not self.chat:
            raise ValueError("system_prompt is only used with chat: true; set chat: true or drop it")
        return self

    @model_validator(mode="after")
    def _decode_plan_agrees(self) -> GenerateSettings:
        from caramba.infer.plan import DecodePlan

        DecodePlan(self.decode_plan, self.decode_bucket_short, self.decode_bucket_mid, self.decode_q_chunk,
                   self.decode_local_window)   # its ValueError names the field
        if self.decode_local_window is not None and (self.num_beams > 1 or self.penalty_alpha is not None):
            raise ValueError("decode_local_window (sliding-window attention) is not supported by beam or "
                             "contrastive search; drop it or num_beams / penalty_alpha")
        return self

    @model_validator(mode="after")
    def _auto_cache_needs_budget(self) -> GenerateSettings:
        if (self.cache_kind == "auto") != (self.cache_budget_mb is not None):
            raise ValueError("cache_kind: auto needs cache_budget_mb (MiB for the whole KV cache), and "
                             "cache_budget_mb is only used with cache_kind: auto")
        chosen = {"cache_policy": None, "qblock": 32, "residual_len": 0, "rotate_keys": False, "cache_fp16_prefix_layers": 0}
        clash = [name for name, default in chosen.items() if self.cache_kind == "auto" and getattr(self, name) != default]
        if clash:
            raise ValueError(f"cache_kind: auto chooses {', '.join(clash)} itself; drop them or name a cache_kind")
        return self

    @model_validator(mode="after")
    def _search_settings_agree(self) -> GenerateSettings:
        if self.num_return_sequences > self.num_beams:
            raise ValueError(f"num_return_sequences={self.num_return_sequences} exceeds num_beams={self.num_beams}; "
                             "raise num_beams or lower num_return_sequences")
        if self.penalty_alpha is not None and (self.top_k is None or self.num_beams > 1):
            raise ValueError("penalty_alpha (contrastive search) needs top_k and num_beams: 1; set top_k or drop penalty_alpha")
        if (self.num_beams > 1 or self.penalty_alpha is not None) and (self.stop_sequences or self.min_p is not None
                                                                       or self.temperature not in (0.0, 1.0) or self.top_p is not None):
            raise ValueError("beam and contrastive search are deterministic and stop on EOS / max_new_tokens: "
                             "drop stop_sequences, min_p, top_p and set temperature to 0")
        if self.num_beams > 1 and self.top_k is not None:
            raise ValueError("top_k is not used by beam search (only by contrastive search); drop top_k or num_beams")
        return self


class BenchSettings(_Model):
    """Settings of a `decode-bench` run: a grid of cells, each warmed up and repeated."""

    prompt_lens: list[Annotated[int, Field(ge=1)]] = Field([128, 512, 2048], min_length=1)
    batch_sizes: list[Annotated[int, Field(ge=1)]] = Field([1], min_length=1)
    cache_kinds: list[str] = Field(["fp32"], min_length=1)
    # Decode plans: "none", "auto", "chunk=N" (fixed q_chunk), "window=W" or "chunk=N,window=W"
    # (a window changes outputs), e.g. ["none", "chunk=512"]. See docs/decode-plans.md.
    decode_plans: list[str] = Field(["none"], min_length=1)
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

    @field_validator("decode_plans")
    @classmethod
    def _known_plans(cls, plans: list[str]) -> list[str]:
        from caramba.infer.plan import parse_plan

        for text in plans:
            parse_plan(text)
        return plans


class SpeculativeSettings(GenerateSettings):
    """Settings of a `speculative` run: the generate settings, the draft and its k rules
    (caramba.infer.speculative.SpeculativeConfig has the same names)."""

    draft: Literal["prompt_lookup", "self_int8", "layer_skip", "model"] = "prompt_lookup"  # model: the run's `draft:`
    spec_k: int = Field(4, ge=1)
    spec_k_adaptive: bool = False
    spec_k_max: int = Field(16, ge=1)
    spec_method: Literal["reject_sampling", "greedy"] = "reject_sampling"
    spec_extra_token: bool = True
    spec_disable_below_accept: float = Field(0.0, ge=0, le=1)
    spec_confidence: float | None = Field(None, gt=0, le=1)
    draft_layers: int | None = Field(None, ge=1)  # layer_skip: the target's first N layers (default half)
    lookup_max_ngram: int = Field(3, ge=1)
    lookup_min_ngram: int = Field(1, ge=1)
    baseline: bool = True  # also decode the prompts plainly in the same run and record the speedup

    @model_validator(mode="after")
    def _k_bounds(self) -> SpeculativeSettings:
        if self.spec_k_max < self.spec_k:
            raise ValueError(f"spec_k_max ({self.spec_k_max}) must be >= spec_k ({self.spec_k})")
        if self.lookup_min_ngram > self.lookup_max_ngram:
            raise ValueError(f"lookup_min_ngram ({self.lookup_min_ngram}) must be <= lookup_max_ngram ({self.lookup_max_ngram})")
        return self


class CacheAutotuneSettings(_Model):
    """Settings of a `cache-autotune` run (docs/autotune.md; defaults as caramba.autotune's)."""

    budget_mb: float = Field(gt=0)              # MiB for the whole KV cache: all layers, K+V, the batch
    max_seq_len: int = Field(2048, ge=2)
    batch_size: int = Field(1, ge=1)
    cache_quality_max_delta_nll: float = 0.05   # mean NLL increase over the baseline cache, nats/token
    cache_quality_max_ppl_ratio: float = Field(1.05, gt=0)
    cache_quality_max_mean_kl: float = Field(0.02, ge=0)   # mean KL(baseline || candidate), nats
    cache_quality_needle_max_kl: float = Field(0.1, ge=0)  # mean KL on the needle's answer tokens
    cache_quality_prompt_len: int = Field(256, ge=1)       # text tokens prefilled before scoring
    cache_quality_decode_steps: int = Field(32, ge=2)      # text tokens scored one at a time
    cache_quality_needle_len: int = Field(512, ge=32)      # haystack length, tokens
    cache_quality_needle_depth: float = Field(0.25, ge=0, le=1)   # 0 = start of the context, 1 = end
    speed_steps: int = Field(4, ge=1)           # timed decode steps per round
    speed_repeats: int = Field(3, ge=3)         # timed rounds; the median counts
    cache_plan_probe: bool = True               # re-run the selection when the stored plan is stale
    cache_plan_probe_interval_sec: float = Field(3600, ge=0)
    plan_path: str | None = None                # default: cache_plans.json under the runs root
    text: str | None = None                     # gate text file; default: caramba's bundled corpus


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
    id: SafeId
    mode: Mode
    seed: int | None = Field(None, ge=0, le=2**64 - 1)  # the range torch.manual_seed accepts
    model: ModelSpec | None = None  # fields given here override the defaults' model
    draft: ModelSpec | None = None  # speculative with draft: model; fields not given follow the run's model
    generate: GenerateSettings | None = None
    bench: BenchSettings | None = None
    speculative: SpeculativeSettings | None = None
    autotune: CacheAutotuneSettings | None = None
    expect: Expect | None = None
    notes: str | None = None

    @model_validator(mode="after")
    def _settings_for_mode(self) -> Run:
        section = section_for(self.mode)
        if getattr(self, section) is None:
            raise ValueError(f"mode {self.mode!r} needs a '{section}:' section with its settings")
        for other_mode in MODES:
            other = section_for(other_mode)
            if other != section and getattr(self, other, None) is not None:
                raise ValueError(f"'{other}:' is the section of mode {other_mode!r}, but this run's mode is {self.mode!r}")
        wants_draft = self.mode == "speculative" and self.speculative.draft == "model"
        if wants_draft and self.draft is None:
            raise ValueError("speculative.draft: model needs a 'draft:' model spec beside 'model:' "
                             "(e.g. draft: {source: path/to/small.gguf}), or another draft kind")
        if self.draft is not None and not wants_draft:
            raise ValueError("'draft:' is only used by mode: speculative with speculative.draft: model; remove it")
        return self

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
