"""`--set KEY.PATH=VALUE` overrides, applied to the parsed YAML before vars and validation.

Grammar:
    KEY.PATH=VALUE
    KEY.PATH  dot-separated segments from the top of the manifest. A segment addresses a mapping
              key, or a list item by integer index; items of `targets` and `runs` may also be
              addressed by their `name` / `id`.
    VALUE     parsed as YAML: 0.7 is a float, true a bool, [a, b] a list, {k: v} a mapping,
              '0.7' (quoted) a string, nothing at all is null.

Examples:
    targets.hello.runs.greedy.generate.temperature=0.7
    targets.0.runs.0.generate.prompts=["Once upon a time", "Hello"]
    defaults.model.dtype=bfloat16
    vars.model=/path/model.gguf

A path must exist in the manifest, except that its last segments may name schema fields the
manifest leaves out (e.g. `...greedy.model.dtype=bfloat16` on a run without a `model:` section);
validation then checks the value like any other. Keys containing '.' cannot be addressed.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from caramba.errors import UserError
from caramba.manifest.hints import did_you_mean, format_loc
from caramba.manifest.schema import annotation_at
from caramba.manifest.yaml_lines import Loc, parse_value

# Lists whose items can be addressed by name, and the field that names them.
_NAMED_ITEMS = {"targets": "name", "runs": "id"}

_EXAMPLE = "e.g. --set targets.hello.runs.greedy.generate.temperature=0.7"


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> list[tuple[Loc, str]]:
    """Apply each override to `data` in order; return the path each one set, with its text."""
    return [_apply(data, text) for text in overrides]


def _apply(data: dict[str, Any], text: str) -> tuple[Loc, str]:
    key_path, sep, raw_value = text.partition("=")
    segments = key_path.strip().split(".")
    if not sep or not all(segments):
        raise UserError(f"--set {text!r}: expected KEY.PATH=VALUE, {_EXAMPLE}")
    try:  # bounded like a manifest: a VALUE can hold an alias bomb too
        value = parse_value(raw_value, f"--set {text!r}")
    except UserError as error:
        raise UserError(f"{error}; the value is parsed as YAML: quote it to keep it a string") from None

    return set_path(data, segments, value, f"--set {text}"), text


def set_path(data: Any, segments: Sequence[str], value: Any, label: str, root: Loc = ()) -> Loc:
    """Set the value at `segments` below `data` (which sits at `root` in the manifest), by the
    rules above; errors start with `label`. Returns the path set, from the manifest's top.
    A sweep's `matrix:` sets its values through this too (root: the run)."""
    node: Any = data
    path: Loc = tuple(root)
    for position, segment in enumerate(segments):
        if isinstance(node, list):
            key: str | int = _list_index(node, segment, path, label)
        elif isinstance(node, dict):
            key = segment
            if key not in node:
                _check_new_key(path, key, node, label)
                if position < len(segments) - 1:
                    node[key] = {}  # an optional section the manifest leaves out
        else:
            raise UserError(f"{label}: {format_loc(path)} is a single value, it has no {segment!r}")
        if position == len(segments) - 1:
            node[key] = value
        node = node[key]
        path += (key,)
    return path


def _list_index(items: list[Any], segment: str, path: Loc, label: str) -> int:
    if segment.isdigit():
        if int(segment) < len(items):
            return int(segment)
        raise UserError(f"{label}: index {segment} is out of range, {format_loc(path)} has {len(items)} item(s)")
    id_field = _NAMED_ITEMS.get(path[-1]) if path else None
    if id_field is None:
        raise UserError(f"{label}: {format_loc(path)} is a list; address its items by index 0..{len(items) - 1}")
    names = [item.get(id_field) for item in items if isinstance(item, dict)]
    if segment in names:
        return names.index(segment)
    raise UserError(
        f"{label}: no item with {id_field} {segment!r} in {format_loc(path)}; "
        f"valid: {', '.join(map(str, names))} (or an index 0..{len(items) - 1}){did_you_mean(segment, names)}"
    )


def _check_new_key(path: Loc, key: str, mapping: dict[str, Any], label: str) -> None:
    """A key the manifest lacks may be added only where the schema has such a field (or any key, for vars)."""
    annotation = annotation_at(path)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        valid = list(annotation.model_fields)
        if key in valid:
            return
    elif typing.get_origin(annotation) is dict:
        return
    else:
        valid = list(mapping)
    where = f"in {format_loc(path)}" if path else "at the top level"
    raise UserError(f"{label}: no {key!r} {where}; valid keys: {', '.join(valid)}{did_you_mean(key, valid)}")
