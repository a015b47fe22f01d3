"""The modes: one object per mode, in one registry (lm-evaluation-harness's registry is the model).

A mode is a `Mode` subclass in one module: its name, its settings section (a pydantic model),
its runner, its preflight checks, its resource estimates and its report columns. The module
registers an instance when it is imported (`register(MyMode())`); everything that used to ask
"which mode is this?" asks the registry instead: the manifest schema (the `mode:` values and the
run's sections), `caramba run` (the runner), preflight, the resource checks and `caramba report`.

The registry is one table, caramba.manifest.modes (mode -> section, settings, runner): the five
first modes' sections are registered there with the schema (a manifest validates without loading
a runner) and their modules here add their runners; a mode added later names its own `section`
and `settings` and register() adds them with it. The built-in modes are the modules
caramba.runners imports.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from pydantic import BaseModel

from caramba.manifest import modes as table

if TYPE_CHECKING:   # types only: the registry imports no runner
    from rich.console import Console

    from caramba.manifest import ResolvedRun
    from caramba.model.zoo import LoadedModel
    from caramba.runs import RunDir

KIB = 1024
BASE_RECORD = 16 * KIB   # every record: manifest.yaml, env.json, log.txt and DONE


@dataclass(frozen=True)
class Workload:
    """The most a run holds at once, for the memory preflight: a cache of `length` positions for
    `rows` rows, `weight_copies` copies of the weights; the fields to lower when it does not fit,
    and the run's max_seq_len when that is what sizes the cache (for an "about N fits" hint)."""

    length: int
    rows: int
    rows_field: str
    length_field: str
    weight_copies: int = 1
    max_seq_len: int | None = None
    # other models held beside the run's, as (source, weights): an eval's candidates with their own weights
    extra_models: tuple[tuple[str, str], ...] = ()


class Mode(ABC):
    """One mode. Subclasses set `name` (the manifest's `mode:` value) and define `run` (a subclass
    without it cannot be instantiated, so it cannot be registered); the other hooks have defaults a
    simple mode keeps."""

    name: ClassVar[str]
    section: str | None = None               # the run's key for the settings (default: the schema's)
    settings: type[BaseModel] | None = None  # its pydantic model (idem)
    columns: ClassVar[tuple[str, ...]] = ()  # `caramba report`: the result's summary metrics, in order
    frontier: ClassVar[bool] = False          # `caramba report`: its runs' candidates as a quality-cost frontier

    @abstractmethod
    def run(self, loaded: LoadedModel, settings: Any, seed: int | None, record: RunDir, console: Console,
            **extra: Any) -> dict[str, Any]:
        """Do the run: write extra files through `record.path`, log through `record.log`, and
        return the result (result.json); `extra` holds `draft` (a LoadedModel) when the run has one."""

    def preflight(self, r: ResolvedRun, where: str, sources: Any) -> None:
        """Raise UserError (naming `where` and the field) when `r` cannot succeed; cheap: `sources`
        (caramba.runners.preflight.Sources) reads each model's config and tokenizer once."""

    def uses_task_generator(self, r: ResolvedRun) -> bool:
        """Whether the run's inputs come from caramba's task generator (its version is then part of
        the run's identity: other generators write other prompts)."""
        return False

    def record_bytes(self, r: ResolvedRun) -> int:
        """About how many bytes the run's record takes (the disk preflight; an over-estimate)."""
        return BASE_RECORD + 64 * KIB

    def workload(self, r: ResolvedRun) -> Workload:
        """See Workload; the default reads `max_seq_len` and `batch_size` from the settings."""
        s = r.run.settings
        return Workload(s.max_seq_len, s.batch_size, f"{self.section}.batch_size", f"{self.section}.max_seq_len",
                        max_seq_len=s.max_seq_len)

    def metrics(self, result: dict[str, Any]) -> dict[str, Any]:
        """The numbers `caramba report` shows for one finished run (default: `columns` from the
        result's summary)."""
        summary = result.get("summary") if isinstance(result.get("summary"), dict) else {}
        return {k: summary[k] for k in self.columns if is_number(summary.get(k))}


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def register(mode: Mode) -> Mode:
    """Add `mode` to the registry (with its section, when the registry does not hold that yet);
    returns it. A name registered twice is a ValueError."""
    entry = table.entry(mode.name)
    if entry is not None and entry.runner is not None:
        raise ValueError(f"mode {mode.name!r} is registered already")
    if entry is None:
        if not mode.section or mode.settings is None:
            raise ValueError(f"mode {mode.name!r} needs a section name and a settings model")
        entry = table.register_section(mode.name, mode.section, mode.settings, mode)
    elif mode.section not in (None, entry.section) or mode.settings not in (None, entry.settings):
        raise ValueError(f"mode {mode.name!r}: the schema declares its section as {entry.section!r} with "
                         f"{entry.settings.__name__}")
    mode.section, mode.settings = entry.section, entry.settings
    entry.runner = mode
    return mode


def unregister(name: str) -> None:
    """Remove a mode (and the section it brought; a built-in section stays): a test's throwaway mode."""
    entry = table.entry(name)
    if entry is None or entry.runner is None:
        raise KeyError(name)
    if entry.built_in:
        entry.runner = None
    else:
        table.unregister_section(name)


def modes() -> dict[str, Mode]:
    """Every registered mode by name, the built-in ones included: caramba/runners/__init__.py
    imports them, and Python runs a package's __init__ before any of its modules (this one too)."""
    return {name: e.runner for name, e in table.entries().items() if e.runner is not None}


def get(name: str) -> Mode:
    """The mode called `name`; KeyError when none is registered."""
    entry = table.entry(name)
    if entry is None or entry.runner is None:
        raise KeyError(name)
    return entry.runner


class RunnerTable(MutableMapping):
    """mode name -> its runner, read from the registry (what `MODE_RUNNERS[mode](...)` calls);
    assigning one replaces that mode's runner (a test that makes a run fail)."""

    def __getitem__(self, name: str) -> Callable[..., dict[str, Any]]:
        return get(name).run

    def __setitem__(self, name: str, runner: Callable[..., dict[str, Any]]) -> None:
        get(name).run = runner   # type: ignore[method-assign]

    def __delitem__(self, name: str) -> None:
        raise TypeError("MODE_RUNNERS follows the registry: unregister the mode instead")

    def __iter__(self) -> Iterator[str]:
        return iter(modes())

    def __len__(self) -> int:
        return len(modes())


MODE_RUNNERS = RunnerTable()
