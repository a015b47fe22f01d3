"""The one registry of modes: mode name -> its settings section (the run's key and its pydantic
model) and, once caramba.runners has registered it, its runner (a caramba.runners.registry.Mode).
lm-evaluation-harness's registry is the model: one table, filled by registration.

The manifest schema builds `Run` from this table (caramba.manifest.schema), so a manifest
validates without loading any runner: the five first modes' sections (caramba.manifest.sections)
are registered below, with the schema; a mode added later registers its section with its runner
(caramba.runners.registry.register). Nothing here touches pydantic's internals: the schema builds
new models when the table changes (see `version`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from caramba.manifest.sections import BUILT_IN

# A run's own keys, which no mode's section may take (caramba.manifest.schema builds Run with them).
RUN_FIELDS = ("id", "mode", "seed", "model", "draft", "expect", "notes", "params")


@dataclass
class ModeEntry:
    """One mode: its section's key and model, and its runner once registered."""

    section: str
    settings: type[BaseModel]
    runner: Any = None      # caramba.runners.registry.Mode; None until the runners layer registers it
    # Declared with the schema: every run's record lists its section (null when unused) since
    # manifests began, kept so that the run hashes of existing records hold; the section stays when
    # its runner is unregistered. A section registered later is listed only by its own runs, so
    # adding a mode changes no other run's hash or record.
    built_in: bool = False


_TABLE: dict[str, ModeEntry] = {}   # in registration order: the order Run's fields, errors and records list them
_version = [0]                      # bumped on every change: the schema rebuilds its models when it moves


def register_section(mode: str, section: str, settings: type[BaseModel], runner: Any = None, *,
                     built_in: bool = False) -> ModeEntry:
    """Accept `mode: MODE` with its settings under `section:` in every manifest validated from now
    on (with its runner, when given). ValueError when the mode or the section is taken."""
    taken = {e.section: m for m, e in _TABLE.items()}
    if mode in _TABLE or (section in taken and taken[section] != mode):
        raise ValueError(f"mode {mode!r} (section {section!r}) clashes with a registered mode")
    if section in RUN_FIELDS:
        raise ValueError(f"{section!r} is a field of every run; choose another section name for mode {mode!r}")
    _TABLE[mode] = entry = ModeEntry(section, settings, runner, built_in)
    _version[0] += 1
    return entry


def unregister_section(mode: str) -> None:
    """Forget a mode registered by register_section (a test's throwaway mode)."""
    del _TABLE[mode]
    _version[0] += 1


def entry(mode: str) -> ModeEntry | None:
    """The registered mode called `mode`, or None."""
    return _TABLE.get(mode)


def entries() -> dict[str, ModeEntry]:
    """Every registered mode, in registration order."""
    return dict(_TABLE)


def version() -> int:
    """A number that changes whenever the table does."""
    return _version[0]


def section_for(mode: str) -> str:
    """The run's key for a mode's settings (the mode's own name when it is not registered)."""
    found = _TABLE.get(mode)
    return found.section if found is not None else mode


class _Column(Mapping):
    """mode -> one field of its entry, read from the table (MODE_SECTIONS, MODE_SETTINGS)."""

    def __init__(self, field: str) -> None:
        self._field = field

    def __getitem__(self, mode: str) -> Any:
        return getattr(_TABLE[mode], self._field)

    def __iter__(self) -> Iterator[str]:
        return iter(_TABLE)

    def __len__(self) -> int:
        return len(_TABLE)


MODE_SECTIONS: Mapping[str, str] = _Column("section")             # mode -> the run's key for its settings
MODE_SETTINGS: Mapping[str, type[BaseModel]] = _Column("settings")  # mode -> its settings model

for _mode, _section, _settings in BUILT_IN:
    register_section(_mode, _section, _settings, built_in=True)
