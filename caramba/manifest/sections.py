"""The settings sections of the five first modes (`generate:`, `bench:`, `speculative:`,
`autotune:`, `eval:`): pydantic models, most of their fields derived from the engine's configs
(caramba.options), so a manifest, the library and the CLI take one set of options. They are
registered in caramba.manifest.modes; a mode added later brings its own section model."""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, create_model, field_validator, model_validator

from caramba.autotune.select import AutotuneSettings
from caramba.cache import KVCacheKind
from caramba.infer.config import CacheConfig, DraftConfig, GenerateConfig, SpeculativeConfig
from caramba.infer.plan import DecodePlan, parse_plan
from caramba.evaluation.tasks import task_names
from caramba.manifest.base import (MAX_BATCH, Prompt, SettingsModel, engine_error, first_duplicate, option_fields,
                                   option_names)
from caramba.options import only_with, options_of
from caramba.model import quant
from caramba.press.config import PressConfig

# A section's own settings that act only with another of them, as OptionInfo.needs is for the
# engine's options (checked there, for the library and every CLI too).
_SECTION_NEEDS = {"system_prompt": "chat"}


class _GenerateSection(SettingsModel):
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
        options = {name: getattr(self, name) for name in option_names(GenerateConfig)}
        return GenerateConfig(**options, seed=seed, eos_token_id=eos_token_id)

    @model_validator(mode="after")
    def _engine_accepts(self) -> Any:
        for name, needed in _SECTION_NEEDS.items():   # the engine's options check their own (OptionInfo.needs)
            if getattr(self, name) is not None and not getattr(self, needed):
                raise ValueError(f"{name}: {only_with(name, needed)}")
        try:   # cross-field rules live in the engine config: one place for library, CLI and manifests
            self.engine_config()
        except (ValueError, TypeError) as e:
            raise engine_error(e) from None
        return self


GenerateSettings = create_model(
    "GenerateSettings", __base__=_GenerateSection, __module__=__name__,
    __doc__="Settings of a `generate` run: prompts, how to present them, and every GenerateConfig option.",
    **option_fields(GenerateConfig),
    chat=(bool, Field(False, description="render prompts through the model's chat template")),
    system_prompt=(str | None, Field(None, description="the system message (with chat: true)")),
    batch_size=(int, Field(1, ge=1, le=MAX_BATCH, description="prompts run in batches of this many, left-padded")),
    stream=(bool, Field(True, description="print tokens as they come when running interactively")))


class BenchSettings(SettingsModel):
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
        return [KVCacheKind.parse(kind).value for kind in kinds]

    @field_validator("presses")
    @classmethod
    def _known_presses(cls, presses: list[str]) -> list[str]:
        return [PressConfig.parse(text).describe() for text in presses]

    @field_validator("decode_plans")
    @classmethod
    def _known_plans(cls, plans: list[str]) -> list[str]:
        for text in plans:
            parse_plan(text)
        return plans

    @field_validator("prompt_lens", "batch_sizes", "cache_kinds", "decode_plans", "presses")
    @classmethod
    def _distinct(cls, values: list) -> list:
        # after the checks above: two spellings of one setting (Q8_0 and q8_0) are one value too
        duplicate = first_duplicate(values)
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
        options = {name: getattr(self, name) for name in option_names(SpeculativeConfig)}
        return SpeculativeConfig(**options, seed=seed, eos_token_id=eos_token_id)


# A manifest names its draft model in the run's `draft:` spec, so the draft kind defaults to
# prompt lookup here (the library's SpeculativeGenerator defaults to a draft model it is given).
SpeculativeSettings = create_model(
    "SpeculativeSettings", __base__=_SpeculativeSection, __module__=__name__,
    __doc__="Settings of a `speculative` run: the generate settings plus the draft and its k rules.",
    **option_fields(DraftConfig, defaults={"draft": "prompt_lookup"}))


class _AutotuneSection(SettingsModel):
    text: str | None = None   # gate text file; default: caramba's bundled corpus

    def engine_settings(self) -> AutotuneSettings:
        return AutotuneSettings(**{key: getattr(self, key) for key in option_names(AutotuneSettings, keys=True)})

    @model_validator(mode="after")
    def _engine_accepts(self) -> Any:
        try:
            self.engine_settings()
        except (ValueError, TypeError) as e:
            raise engine_error(e) from None
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


class _CandidateSection(SettingsModel):
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
        """The given name, or the policy's short description as a metric-safe word (q4_0_rotate_keys;
        an eval candidate's own weights after it: fp32_weights_q4_0, fp32_SmolLM2_Q6_K_native)."""
        if self.name is not None:
            return self.name
        policy, press = self.policy(), self.press_config()
        text = policy.describe(decoupled=bool({"k_sem", "k_geo"} & set(policy.named)))
        text += (f"_window{self.decode_local_window}" if self.decode_local_window else "")
        text += f"_{press.describe()}" if press else ""
        source, weights = getattr(self, "source", None), getattr(self, "weights", None)
        text += f"_{Path(source).stem}" if source else ""
        text += (f"_{weights}" if source else f"_weights_{weights}") if weights else ""
        return re.sub(r"\W+", "_", text).strip("_")

    @model_validator(mode="after")
    def _engine_accepts(self) -> Any:
        if self.cache_kind == "auto":
            raise ValueError("cache_kind: auto is not a candidate: name a kind (mode: cache-autotune picks one)")
        try:
            self.cache_config()
        except (ValueError, TypeError) as e:
            raise engine_error(e) from None
        return self


_CACHE_OPTION_FIELDS = option_fields(CacheConfig)
EvalCandidate = create_model(
    "EvalCandidate", __base__=_CandidateSection, __module__=__name__,
    __doc__="One KV cache an eval scores: every cache setting a generate run takes, and a name.",
    **{name: _CACHE_OPTION_FIELDS[name] for name in CANDIDATE_CACHE_OPTIONS},
    decode_local_window=option_fields(DecodePlan)["decode_local_window"],
    # A weight-format study: the candidate's own weights (a model beside the run's, same tokenizer).
    source=(str | None, Field(None, description="another file of the run's model to load for this candidate (a "
                                                "K-quant GGUF; the same tokenizer); default: the run's model.source")),
    weights=(Literal[quant.WEIGHT_KINDS] | None, Field(None, description="this candidate's weight format "
                                                                         "(as model.weights); default: the run's")))


class PerplexitySettings(SettingsModel):
    """Scoring a text through each cache (caramba.evaluation.evaluate: the protocols of `caramba eval`)."""

    protocol: Literal["decode", "chunks"] = Field("decode", description="decode: prefill prompt_len tokens, then "
                                                  "score token by token; chunks: llama-perplexity's windows of ctx")
    prompt_len: int = Field(256, ge=1, description="decode: tokens prefilled before token-by-token scoring")
    ctx: int = Field(512, ge=4, multiple_of=2, description="chunks: window size (llama-perplexity -c)")
    max_tokens: int | None = Field(None, ge=2, description="the text's first N tokens (default: 1024 for decode, "
                                                           "the whole text for chunks)")
    text: str | None = Field(None, description="text file to score (default: caramba's bundled corpus)")


class TaskSettings(SettingsModel):
    """Long-context tasks (caramba.evaluation.tasks, RULER's generated categories), answered greedily."""

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
    prefill_precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="the shared context prefill's projections: fp32, or bf16 products (about twice as "
                            "fast where the CPU has AVX-512 BF16 or AMX; answers may differ: docs/eval.md)")
    batch_size: int = Field(8, ge=1, description="samples answered together (left-padded rows; each answers as "
                                                 "it would alone, up to float rounding)")

    @field_validator("names")
    @classmethod
    def _known_tasks(cls, names: list[str] | None) -> list[str] | None:
        known = task_names()
        for name in names or []:
            if name not in known:
                hint = difflib.get_close_matches(name, known, n=1)
                raise ValueError(f"unknown task {name!r}" + (f"; did you mean {hint[0]!r}?" if hint else "")
                                 + f" (tasks: {', '.join(known)})")
        duplicate = first_duplicate(names or [])
        if duplicate is not None:
            raise ValueError(f"task {duplicate!r} is listed twice")
        return names

    @field_validator("lengths")
    @classmethod
    def _distinct_lengths(cls, lengths: list[int]) -> list[int]:
        if len(set(lengths)) != len(lengths):
            raise ValueError("a context length is listed twice")
        return lengths

    @model_validator(mode="after")
    def _bf16_is_the_shared_prefills(self) -> TaskSettings:
        if self.prefill_precision == "bf16" and self.prefill == "own":
            raise ValueError("prefill_precision: bf16 applies to the shared context prefill; with prefill: own each "
                             "candidate prefills as generate does (fp32): use prefill: shared or fp32")
        return self


class EvalSettings(SettingsModel):
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
        duplicate = first_duplicate(labels)
        if duplicate is not None:
            raise ValueError(f"two candidates (or a candidate and the baseline) are both labelled {duplicate!r}; "
                             "give one of them a name:")
        if self.perplexity is not None and any(c.decode_local_window for c in [*self.candidates, self.baseline]):
            raise ValueError("perplexity scores full-attention caches; a candidate with decode_local_window "
                             "is scored on tasks only: drop perplexity: or the window")
        if self.perplexity is not None and any(c.press_config() for c in self.candidates):
            raise ValueError("perplexity scores every cached token; a candidate with a press (KV eviction) is scored "
                             "on tasks only: drop perplexity: or the press")
        if self.baseline.source is not None or self.baseline.weights is not None:
            raise ValueError("baseline: the baseline runs the run's own model; set model.source / model.weights "
                             "for it, and source: / weights: on the candidates that load other weights")
        if self.baseline.press_config() is not None:
            raise ValueError("baseline: the baseline is the reference every candidate is compared with; it takes no "
                             "press: give the press to a candidate")
        for c in self.candidates:
            if c.press_config() is not None and c.decode_local_window:
                raise ValueError(f"candidate {c.label}: a press (KV eviction) and decode_local_window (a sliding "
                                 "window) are two ways of dropping tokens; use one of them")
        return self



# (mode, section, settings) of the first five modes, in the order records list their sections.
BUILT_IN = (("generate", "generate", GenerateSettings), ("decode-bench", "bench", BenchSettings),
            ("speculative", "speculative", SpeculativeSettings), ("cache-autotune", "autotune", CacheAutotuneSettings),
            ("eval", "eval", EvalSettings))
