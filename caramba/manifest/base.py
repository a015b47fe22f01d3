"""What every manifest model is built on: the strict base model (unknown fields are errors, no NaN
or inf, no silent bool/number coercion), the manifest fields derived from the engine's options
(caramba.options), and the small types and checks the run model and the mode sections share."""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from caramba.manifest.yaml_lines import yaml11_note
from caramba.options import options_of

# Names become directories under runs/, so they must not contain '/' or start with '.'.
_SAFE_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")


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


# The base of a mode's settings section (and every manifest model): unknown fields are errors,
# no NaN or inf, no silent bool/number coercion.
class SettingsModel(BaseModel):
    # NaN and inf pass every `ge`/`le` check (or fail later mid-run); no manifest float means them.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_coercion(cls, value: Any, info: ValidationInfo) -> Any:
        """Booleans are true/false only: pydantic would take the string 'yes' (a string in YAML
        1.2) or the number 1 as True, True as the number 1 (`max_new_tokens: true`), and the
        strings '017' or '1_000' as numbers."""
        kinds = plain_types(cls.model_fields[info.field_name].annotation)
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



def plain_types(annotation: Any) -> set[Any]:
    """The plain types an annotation admits (bool | None -> {bool, NoneType}); Annotated unwrapped."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return plain_types(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return set().union(*(plain_types(a) for a in typing.get_args(annotation)))
    if origin is Literal:
        return {type(choice) for choice in typing.get_args(annotation)}
    return {annotation} if isinstance(annotation, type) else set()



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
def option_names(config: type, keys: bool = False) -> tuple[str, ...]:
    """The names option_fields gives: once per config (validating a run builds its engine config,
    and building fields each time cost a sweep of 10,000 runs most of its validation)."""
    return tuple(option_fields(config, keys=keys))


def engine_error(error: Exception) -> ValueError:
    """An engine config's error as a manifest error: without the config's name (the location says where)."""
    message = str(error)
    for owner in ("GenerateConfig", "SpeculativeConfig", "AutotuneSettings"):
        message = message.removeprefix(f"{owner}: ").removeprefix(f"{owner}.")
    return ValueError(message)


def first_duplicate(values: Iterable[str]) -> str | None:
    seen: set[str] = set()
    for value in values:
        if value in seen:
            return value
        seen.add(value)
    return None
