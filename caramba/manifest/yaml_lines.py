"""YAML parsing that remembers where every value came from.

pyyaml's plain `safe_load` drops positions, so we compose the node tree ourselves and build the
Python data from it, recording the line of every mapping key and sequence item under its path,
e.g. ('targets', 0, 'runs', 0, 'generate', 'temperature') -> 14. Validation errors then point at
the line to edit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from caramba.errors import UserError

Loc = tuple[str | int, ...]

_MERGE_TAG = "tag:yaml.org,2002:merge"


@dataclass
class Locations:
    """Where each value of a manifest came from: its YAML line, or the --set that replaced it."""

    source: str
    lines: dict[Loc, int]
    overrides: list[tuple[Loc, str]] = field(default_factory=list)  # (path it set, the --set text)

    def where(self, loc: Sequence[str | int]) -> str:
        """'manifest.yaml:LINE', or 'manifest.yaml (from --set ...)' for an overridden value."""
        override = self.override_of(loc)
        if override is not None:
            return f"{self.source} (from --set {override})"
        line = self.line_of(loc)
        return f"{self.source}:{line}" if line else self.source

    def override_of(self, loc: Sequence[str | int]) -> str | None:
        loc = tuple(loc)
        for path, text in reversed(self.overrides):  # the last --set of a path wins
            if loc[: len(path)] == path:
                return text
        return None

    def line_of(self, loc: Sequence[str | int]) -> int | None:
        # A missing field has no line of its own: use the closest enclosing value's.
        loc = tuple(loc)
        while loc and loc not in self.lines:
            loc = loc[:-1]
        return self.lines.get(loc)


def parse_yaml(text: str, source: str) -> tuple[Any, Locations]:
    """Parse one YAML document; YAML errors become UserErrors with file:line."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        lines: dict[Loc, int] = {}
        data = None
        if node is not None:
            lines[()] = node.start_mark.line + 1
            data = _build(loader, node, (), lines, source)
        return data, Locations(source, lines)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f"{source}:{mark.line + 1}" if mark else source
        problem = ", ".join(part for part in (error.context, error.problem) if part)
        raise UserError(f"{where}: YAML syntax error: {problem}") from None
    except yaml.YAMLError as error:  # e.g. a character YAML does not allow
        raise UserError(f"{source}: YAML error: {error}") from None
    finally:
        loader.dispose()


def _build(loader: yaml.SafeLoader, node: yaml.Node, path: Loc, lines: dict[Loc, int], source: str) -> Any:
    if isinstance(node, yaml.MappingNode):
        _reject_duplicate_keys(loader, node, source)
        loader.flatten_mapping(node)  # resolves '<<' merge keys; later keys win
        mapping: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            lines[path + (key,)] = key_node.start_mark.line + 1
            mapping[key] = _build(loader, value_node, path + (key,), lines, source)
        return mapping
    if isinstance(node, yaml.SequenceNode):
        items = []
        for index, item_node in enumerate(node.value):
            lines[path + (index,)] = item_node.start_mark.line + 1
            items.append(_build(loader, item_node, path + (index,), lines, source))
        return items
    return loader.construct_object(node, deep=True)


def _reject_duplicate_keys(loader: yaml.SafeLoader, node: yaml.MappingNode, source: str) -> None:
    # pyyaml keeps the last of duplicate keys silently; in a manifest that hides a mistake.
    first_line: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == _MERGE_TAG:
            continue
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        try:
            if key in first_line:
                raise UserError(f"{source}:{line}: duplicate key {key!r} (first given on line {first_line[key]})")
            first_line[key] = line
        except TypeError:  # an unhashable key such as a list
            raise UserError(f"{source}:{line}: a mapping key must be a plain value, not {key!r}") from None
