"""Load a manifest: parse YAML (keeping lines), apply --set overrides, substitute vars, validate.

Every problem becomes a UserError whose message has one line per problem in the form
`manifest.yaml:LINE: targets[0].runs[0].generate.temperature: <what is wrong and how to fix it>`.
"""

from __future__ import annotations

import copy
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from caramba.errors import UserError
from caramba.runs import runs_root
from caramba.manifest.hints import did_you_mean, format_loc
from caramba.manifest.matrix import expand_matrices
from caramba.manifest.overrides import apply_overrides
from caramba.manifest import schema
from caramba.manifest.schema import annotation_at
from caramba.manifest.substitution import escape_vars, substitute_vars
from caramba.manifest.yaml_lines import MAX_BYTES, Locations, dump_yaml, parse_yaml, yaml11_note

if TYPE_CHECKING:   # annotations: the model itself is read from the schema when used
    from caramba.manifest.schema import Manifest


def load_manifest(path: str | Path, overrides: Sequence[str] = ()) -> Manifest:
    """Read, override (`--set` strings, see caramba.manifest.overrides) and validate a manifest file."""
    source = str(path)
    try:
        # A FIFO would block on open and /dev/zero never ends: only regular files, read bounded.
        if not Path(path).is_file():
            what = "a directory" if Path(path).is_dir() else "not a regular file"
            if not Path(path).exists():
                raise FileNotFoundError
            raise UserError(f"{source}: is {what}; give the manifest's YAML file")
        with open(path, "rb") as file:
            raw = file.read(MAX_BYTES + 1)
        if len(raw) > MAX_BYTES:
            raise UserError(f"{source}: more than {MAX_BYTES >> 20} MiB is not a manifest; "
                            "put long texts in files the manifest names")
        text = raw.decode("utf-8")
    except FileNotFoundError:
        raise UserError(f"{source}: manifest file not found") from None
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        raise UserError(f"{source}:{line}: the manifest is not UTF-8 text ({error.reason} at byte {error.start})") from None
    except OSError as error:
        raise UserError(f"{source}: cannot read manifest: {error.strerror or error}") from None
    return parse_manifest(text, source, overrides)


def parse_manifest(text: str, source: str = "<manifest>", overrides: Sequence[str] = ()) -> Manifest:
    """Like load_manifest, from YAML text; `source` names it in error messages."""
    data, locations = parse_yaml(text, source)
    if data is None:
        raise UserError(f"{source}:1: the manifest is empty; start from manifests/quickstart.yaml")
    if not isinstance(data, dict):
        raise UserError(
            f"{locations.where(())}: the top level must be a mapping (version:, name:, targets:, ...), "
            f"not a {type(data).__name__}"
        )
    locations.overrides = apply_overrides(data, overrides)
    _check_encodable(data, (), locations)
    data = substitute_vars(data, locations)
    data = expand_matrices(data, locations)   # after --set and vars: a sweep expands what they made
    try:
        manifest = schema.Manifest.model_validate(data)   # the schema as the registry of modes stands
    except ValidationError as error:
        # In file order, so the message reads top to bottom like the manifest.
        errors = sorted(error.errors(include_url=False), key=lambda e: locations.line_of(e["loc"]) or 0)
        problems = [_describe(problem, locations) for problem in errors]
        count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
        raise UserError(f"invalid manifest {source} ({count}):\n" + "\n".join(problems)) from None
    _check_written_paths(manifest, locations, source)
    return manifest


def _check_encodable(value: Any, loc: tuple, locations: Locations) -> None:
    """No string of the manifest holds a lone surrogate ("\\ud800" in a double-quoted YAML
    string): it is not text, and writing the record (UTF-8) would fail after the run's lock."""
    if isinstance(value, dict):
        for key, item in value.items():
            _check_encodable(key, loc, locations)
            _check_encodable(item, (*loc, key), locations)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_encodable(item, (*loc, i), locations)
    elif isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise UserError(f"{locations.where(loc)}: {format_loc(loc)}: {value[e.start]!r} at character "
                            f"{e.start} is a lone surrogate, not a character; write the character itself "
                            "(or its \\U escape)") from None


def _check_written_paths(manifest: Manifest, locations: Locations, source: str) -> None:
    """What a manifest writes stays under the runs root: today that is `autotune.plan_path` (the
    command line's --plan-path may name any file; the user typed it there)."""
    root = runs_root()
    problems = []
    for t, target in enumerate(manifest.targets):
        for r, run in enumerate(target.runs):
            plan_path = run.autotune.plan_path if run.autotune is not None else None
            if plan_path is None:
                continue
            try:
                inside = root.resolve() in Path(plan_path).expanduser().resolve().parents
            except (OSError, ValueError, RuntimeError):  # a NUL, '~nouser', a loop of symlinks
                inside = False
            if not inside:
                loc = ("targets", t, "runs", r, "autotune", "plan_path")
                problems.append(f"{locations.where(loc)}: {format_loc(loc)}: {plan_path!r} is outside the runs "
                                f"directory {root}; a manifest writes only there: give a path such as "
                                f"'{root / 'plans.json'}', or leave plan_path out for the default store")
    if problems:
        count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
        raise UserError(f"invalid manifest {source} ({count}):\n" + "\n".join(problems))


def resolved_manifest_yaml(manifest: Manifest) -> str:
    """The manifest as it runs (overrides and vars applied, defaults filled in), for run records.

    Each run's `model` is written as the effective spec (defaults merged with its override), so
    the record says exactly which model ran and loading it again gives the same runs.
    """
    data = manifest.model_dump(mode="json")
    for target_data, target in zip(data["targets"], manifest.targets):
        for run_data, run in zip(target_data["runs"], target.runs):
            run_data["model"] = manifest.model_for(run).model_dump(mode="json")
    return dump_yaml(escape_vars(data))


def resolved_run_yaml(manifest: Manifest, target: str, run_id: str) -> str:
    """resolved_manifest_yaml of the one run (a record's manifest.yaml): loading it gives that
    run again, with its params; a sweep's records do not each repeat the whole sweep."""
    owner, run, data = _run_index(manifest)[target, run_id]
    run_data = {**run.model_dump(mode="json"), "model": manifest.model_for(run).model_dump(mode="json")}
    data = copy.deepcopy(data)
    data["targets"] = [{**owner.model_dump(mode="json", exclude={"runs"}), "runs": [run_data]}]
    data = {key: data[key] for key in schema.Manifest.model_fields}   # in schema order, as resolved_manifest_yaml
    return dump_yaml(escape_vars(data))


_INDEXES: list[tuple[Manifest, dict]] = []   # the last manifests asked about: a sweep asks once per run


def _run_index(manifest: Manifest) -> dict[tuple[str, str], tuple]:
    """(target, run id) -> (target, run, the manifest's data without targets), built once per
    manifest: a lookup per run keeps writing a 10,000-run sweep's tasks linear."""
    for known, index in _INDEXES:
        if known is manifest:
            return index
    top = manifest.model_dump(mode="json", exclude={"targets"})
    index = {(t.name, r.id): (t, r, top) for t in manifest.targets for r in t.runs}
    _INDEXES[:] = [*_INDEXES[-3:], (manifest, index)]
    return index


def _describe(problem: dict[str, Any], locations: Locations) -> str:
    """One pydantic error as `where: field.path: message`."""
    loc = tuple(problem["loc"])
    field = loc[-1] if loc else None
    kind = problem["type"]
    if kind == "extra_forbidden":
        valid = _fields_at(loc[:-1])
        message = f"unknown field {field!r}; valid fields: {', '.join(valid)}{did_you_mean(field, valid)}"
    elif kind == "missing":
        message = f"missing required field {field!r}"
    elif kind == "literal_error":
        choices = [str(choice) for choice in typing.get_args(annotation_at(loc))]
        message = (
            f"{problem['input']!r} is not a valid {field}; valid {field} values: {', '.join(choices)}"
            f"{did_you_mean(problem['input'], choices)}"
        )
    elif kind == "value_error":  # our own validators: the message already says what to do
        message = problem["msg"].removeprefix("Value error, ")
    else:   # a 1:30 or an `on` that YAML 1.1 (and an editor's highlighting) reads otherwise says so
        message = f"{problem['msg']} (got {_short(problem['input'])}){yaml11_note(problem['input'])}"
    return f"{locations.where(loc)}: {format_loc(loc)}: {message}"


def _fields_at(loc: tuple[str | int, ...]) -> list[str]:
    annotation = annotation_at(loc)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return list(annotation.model_fields)
    return []


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
