"""One definition per option: an engine setting is a dataclass field made with `option()`.

The field carries its bounds, its help and the name users write for it. From that one definition:
- the config checks its own values (`check_options`, called from `__post_init__`);
- the flat keyword form finds it (`GenerateConfig(temperature=0.8, cache_kind="q8_0")`:
  caramba.infer.config);
- the manifest derives its pydantic fields (caramba.manifest.schema) and `caramba generate`
  its help (caramba.cli), so neither holds a copy.

`name` is the option's flat spelling where it differs from the field's (`DecodePlan.q_chunk` is
`decode_q_chunk` in a manifest and in GenerateConfig's keywords); `key` is the spelling of a
manifest section that predates the flat one (the autotune section's `speed_steps`).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Iterator
from dataclasses import MISSING, dataclass
from functools import lru_cache
from typing import Any


@dataclass(frozen=True)
class OptionInfo:
    help: str = ""
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    multiple_of: int | None = None
    choices: tuple | None = None      # allowed values (besides None when the default is None)
    name: str | None = None           # the flat spelling (default: the field name)
    key: str | None = None            # a manifest section's own spelling (default: the flat name)
    manifest: bool = True             # False: engine-only (set by the runner, e.g. eos ids)
    required: bool = False            # a manifest section must give it (the engine may take None)
    schema: Any = None                # the manifest's type where it is narrower than the engine's
    needs: str | None = None          # the option (flat name) without which this one does nothing

    def problem(self, value: Any) -> str | None:
        """Why value is not allowed, or None."""
        if value is None or isinstance(value, bool):
            return None
        if self.choices is not None and value not in self.choices:
            return f"must be one of {', '.join(map(str, self.choices))}"
        if not isinstance(value, (int, float)):
            return None
        if isinstance(value, float) and not math.isfinite(value):
            return "must be a finite number"
        if self.multiple_of and value % self.multiple_of:
            return f"must be a multiple of {self.multiple_of}"
        low = f">= {self.ge:g}" if self.ge is not None else f"> {self.gt:g}" if self.gt is not None else None
        high = f"<= {self.le:g}" if self.le is not None else f"< {self.lt:g}" if self.lt is not None else None
        ok = ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
              and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))
        if ok:
            return None
        why = f"must be {low} and {high}" if low and high else f"must be {low or high}"
        return why + (f" ({self.help})" if self.help else "")


def option(default: Any = MISSING, *, default_factory: Any = MISSING, help: str = "", **info: Any) -> Any:
    """A dataclass field with its OptionInfo (see the module doc)."""
    meta = {"option": OptionInfo(help=help, **info)}
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True)
class Option:
    """One option of a config class: its field, info and resolved type."""

    field: dataclasses.Field
    info: OptionInfo
    type: Any

    @property
    def attr(self) -> str:
        return self.field.name

    @property
    def name(self) -> str:
        return self.info.name or self.field.name

    @property
    def key(self) -> str:
        return self.info.key or self.name

    def default(self) -> Any:
        f = self.field
        return f.default_factory() if f.default is MISSING else f.default


@lru_cache(maxsize=None)
def options_of(cls: type) -> tuple[Option, ...]:
    """The option fields of a config dataclass, in order."""
    hints = typing.get_type_hints(cls)
    return tuple(Option(f, f.metadata["option"], hints[f.name]) for f in dataclasses.fields(cls) if "option" in f.metadata)


class OptionError(ValueError):
    """A setting out of its bounds; `name` is the option's flat spelling."""

    def __init__(self, name: str, value: Any, why: str) -> None:
        super().__init__(f"{name}={value!r} {why}")
        self.name, self.value, self.why = name, value, why


def check_options(config: Any) -> None:
    """Raise OptionError for the first option of `config` outside its bounds, or set (away from its
    default) while the option it needs (OptionInfo.needs) is off: a setting that silently does
    nothing would make identical runs look different in records and sweeps."""
    opts = options_of(type(config))
    for opt in opts:
        value = getattr(config, opt.attr)
        why = opt.info.problem(value)
        if why:
            raise OptionError(opt.name, value, why)
    needs = [opt for opt in opts if opt.info.needs is not None]
    if needs:
        values = {opt.name: getattr(config, opt.attr) for opt in opts}
        for opt in needs:
            if values[opt.info.needs] in (None, False) and values[opt.name] != opt.default():
                raise OptionError(opt.name, values[opt.name], only_with(opt.name, opt.info.needs))


def only_with(name: str, needed: str) -> str:
    """Why `name` is refused while `needed` is off."""
    return (f"does nothing without {needed}: set {needed} or drop {name} (in a sweep, exclude: the "
            f"combinations without {needed})")


def iter_values(config: Any) -> Iterator[tuple[Option, Any]]:
    for opt in options_of(type(config)):
        yield opt, getattr(config, opt.attr)
