"""Sweeps: a run's `matrix:` expands into one run per combination of its values.

    - id: sweep
      mode: generate
      generate: {prompts: ["Hello"], max_new_tokens: 16}
      matrix:                       # settings paths below the run, as --set addresses them
        generate.cache_kind: [fp32, q8_0]
        seed: [0, 1]
      exclude: [{generate.cache_kind: q8_0, seed: 1}]       # drop combinations that match
      include: [{generate.cache_kind: q4_0, seed: 0}]       # add one (or extend matching ones)

`include`/`exclude` follow GitHub Actions: excludes drop every combination matching all their
keys; an include whose matrix keys match existing combinations adds its other keys to each of
them, otherwise it is a new combination. Each value is set on a copy of the run through the
`--set` machinery (caramba.manifest.overrides.set_path), so a matrix key reaches exactly what
`--set targets.T.runs.ID.<key>=...` would. The expanded run's id is the base id with one
`.key-value` part per matrix key (`sweep.cache_kind-q8_0.seed-1`), and its `params` holds the
values, which the record repeats in result.json. Runs are expanded after --set and ${vars}, and
before validation: an error in an expanded run names the matrix entry's file:line and the run.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import re
from typing import Any

from caramba.errors import UserError
from caramba.manifest.hints import format_loc
from caramba.manifest.overrides import set_path
from caramba.manifest.yaml_lines import Loc, Locations

SWEEP_KEYS = ("matrix", "include", "exclude")
# A manifest states its runs; 10,000 is far past any sweep a machine (or a cluster day) finishes.
MAX_RUNS = 10_000
_NOT_SWEPT = {"id", "params", *SWEEP_KEYS}   # keys a matrix cannot set
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def expand_matrices(data: dict[str, Any], locations: Locations) -> dict[str, Any]:
    """`data` with every run that has a matrix replaced by its expanded runs; `locations` is
    updated in place (lines and --set paths follow each run to its new index)."""
    targets = data.get("targets")
    if not isinstance(targets, list) or not any(
            isinstance(t, dict) and isinstance(t.get("runs"), list) and
            any(isinstance(r, dict) and set(r) & set(SWEEP_KEYS) for r in t["runs"]) for t in targets):
        return data
    data = dict(data)
    data["targets"] = targets = [dict(t) if isinstance(t, dict) else t for t in targets]
    total = 0
    for t, target in enumerate(targets):
        if not isinstance(target, dict) or not isinstance(target.get("runs"), list):
            continue
        expanded: list[tuple[int, dict, list[tuple[Loc, Loc]], str | None]] = []   # (old index, run, moved lines, note)
        for j, run in enumerate(target["runs"]):
            base: Loc = ("targets", t, "runs", j)
            # A run without a matrix keeps any params it states (a record's manifest.yaml reloads so).
            if not isinstance(run, dict) or not set(run) & set(SWEEP_KEYS):
                expanded.append((j, run, [], None))
                continue
            if "params" in run:
                loc = base + ("params",)
                raise UserError(f"{locations.where(loc)}: {format_loc(loc)}: a run with a matrix gets its params "
                                "from the matrix; remove params:")
            combos = _combinations(run, base, locations)
            _check_overrides(run, combos, base, locations, target.get("name", t))
            total += len(combos)
            if total > MAX_RUNS:
                raise _too_many(locations, base)
            ids = _run_ids(run.get("id"), [combo for combo, _ in combos])
            for (combo, lines), run_id in zip(combos, ids):
                expanded.append((j, *_apply(run, combo, lines, run_id, base, locations)))
        target["runs"] = [run for _, run, _, _ in expanded]
        _move_locations(locations, t, expanded)
    return data


def _combinations(run: dict, base: Loc, locations: Locations) -> list[tuple[dict[str, Any], dict[str, Loc]]]:
    """The run's combinations (key -> value) in order, each with where each key's value was given."""
    matrix = run.get("matrix") or {}
    if not isinstance(matrix, dict):
        raise _error(locations, base + ("matrix",), "matrix must map settings paths to lists of values, "
                     "e.g. matrix: {generate.cache_kind: [fp32, q8_0], seed: [0, 1]}")
    for key, values in matrix.items():
        loc = base + ("matrix", key)
        _check_key(key, loc, locations)
        if not isinstance(values, list) or not values:
            raise _error(locations, loc, f"matrix key {key!r} needs a non-empty list of values, e.g. [a, b] "
                         f"(got {_short(values)})")
        for value in values:
            _check_value(value, loc, locations)
    entries = {}
    for kind in ("include", "exclude"):
        given = run.get(kind) or []
        if not isinstance(given, list) or not all(isinstance(e, dict) and e for e in given):
            raise _error(locations, base + (kind,), f"{kind} must be a list of mappings from settings paths to "
                         f"values, e.g. {kind}: [{{generate.cache_kind: q4_0, seed: 0}}]")
        for i, entry in enumerate(given):
            for key, value in entry.items():
                _check_key(key, base + (kind, i, key), locations)
                _check_value(value, base + (kind, i, key), locations)
        entries[kind] = given
    for i, entry in enumerate(entries["exclude"]):
        unknown = [k for k in entry if k not in matrix]
        if unknown:
            raise _error(locations, base + ("exclude", i), f"exclude names {', '.join(map(repr, unknown))}, which "
                         f"is not a matrix key ({', '.join(matrix) or 'none'}); an exclude can only drop combinations")
    if not matrix and not entries["include"]:
        raise _error(locations, base + ("matrix",), "a sweep needs a matrix: (or include:) with at least one value")

    keys = list(matrix)
    size = 1
    for values in matrix.values():
        size *= len(values)
    if size > MAX_RUNS:   # before building any of them
        raise _too_many(locations, base)
    combos = []
    for values in itertools.product(*(matrix[k] for k in keys)) if keys else []:
        combo = dict(zip(keys, values))
        if any(all(_same(combo[k], v) for k, v in e.items()) for e in entries["exclude"]):
            continue
        combos.append((combo, {k: base + ("matrix", k) for k in keys}))
    originals = len(combos)
    for i, entry in enumerate(entries["include"]):
        where = {k: base + ("include", i, k) for k in entry}
        matched = False
        for combo, lines in combos[:originals]:   # GitHub: never overwrite an original matrix value
            if all(_same(combo[k], v) for k, v in entry.items() if k in matrix):
                for k, v in entry.items():
                    if k not in matrix:
                        combo[k], lines[k] = v, where[k]
                matched = True
        if not matched:
            combos.append((dict(entry), where))
    if not combos:
        raise _error(locations, base + ("exclude",), "exclude drops every combination of the matrix: nothing to run")
    return combos


def _check_overrides(run: dict, combos: list, base: Loc, locations: Locations, target: Any) -> None:
    """A --set below the run on a path the sweep sets would be overwritten by every combination:
    refused, naming the key, instead of listed in records as an override that never applied."""
    swept = {key: lines[key] for combo, lines in combos for key in combo}
    for path, text in locations.overrides:
        if path[:len(base)] != base or len(path) == len(base) or path[len(base)] in SWEEP_KEYS:
            continue
        below = ".".join(map(str, path[len(base):]))
        for key, given in swept.items():
            if below == key or below.startswith(key + ".") or key.startswith(below + "."):
                raise UserError(
                    f"--set {text}: {key!r} is swept by run {run.get('id')!r}'s matrix ({locations.where(given)}), "
                    f"which sets it in every run it makes; change the sweep's values instead, e.g. --set "
                    f"targets.{target}.runs.{run.get('id')}.matrix.{key}=[...]")


def _apply(run: dict, combo: dict[str, Any], lines: dict[str, Loc], run_id: str, base: Loc,
           locations: Locations) -> tuple[dict, list[tuple[Loc, Loc]], str]:
    """A copy of `run` with the combination's values set, its id and params; the moved lines."""
    new = {k: copy.deepcopy(v) for k, v in run.items() if k not in SWEEP_KEYS}
    moved: list[tuple[Loc, Loc]] = []   # (path set, below the run) -> where its value was given
    for key, value in combo.items():
        label = f"{locations.where(lines[key])}: matrix key {key!r} in run {run.get('id')!r}"
        path = set_path(new, key.split("."), copy.deepcopy(value), label, root=base)
        moved.append((path[len(base):], lines[key]))
    new["id"] = run_id
    new["params"] = copy.deepcopy(combo)
    note = f"matrix run {new['id']}"
    return new, moved, note


def _move_locations(locations: Locations, t: int, expanded: list) -> None:
    """Renumber the target's runs in lines and --set paths; a value set by a matrix points at
    the matrix entry; a note names the expanded run in every message about it."""
    prefix: Loc = ("targets", t, "runs")
    n = len(prefix)
    old_lines = {loc: line for loc, line in locations.lines.items() if loc[:n] == prefix and len(loc) > n}
    for loc in old_lines:
        del locations.lines[loc]
    # Each old run's lines below it, without its sweep keys (an expanded run has none): a run a
    # matrix makes copies its base run's few lines, not the matrix's values (linear in the runs).
    by_run: dict[int, list[tuple[Loc, int]]] = {}
    for loc, line in old_lines.items():
        if len(loc) == n + 1 or loc[n + 1] not in SWEEP_KEYS:
            by_run.setdefault(loc[n], []).append((loc[n + 1:], line))
    old_overrides = locations.overrides
    locations.overrides = [(p, s) for p, s in old_overrides if not (p[:n] == prefix and len(p) > n)]
    for k, (j, _run, moved, note) in enumerate(expanded):
        for below, line in by_run.get(j, ()):
            if not any(below[1:][:len(path)] == path for path, _ in moved):
                locations.lines[prefix + (k,) + below] = line
        for path, given in moved:
            line = _line_in(old_lines, given)
            if line is not None:
                locations.lines[prefix + (k,) + path] = line
        for p, s in old_overrides:   # a --set below the run, unless a matrix value replaced it
            if p[:n] == prefix and len(p) > n and p[n] == j and \
                    not any(p[n + 1:][:len(path)] == path for path, _ in moved):
                locations.overrides.append((prefix + (k,) + p[n + 1:], s))
        if note:
            locations.notes[prefix + (k,)] = note


def _line_in(lines: dict[Loc, int], loc: Loc) -> int | None:
    while loc and loc not in lines:   # the closest enclosing value's line, as Locations.line_of
        loc = loc[:-1]
    return lines.get(loc)


def _run_ids(base: Any, combos: list[dict[str, Any]]) -> list[str]:
    """One id per combination: the base id and a `.key-value` part per key. Values that differ
    get parts that differ: a path's last component, or as many components as tell it apart
    (models/a/x and models/b/x: a_x, b_x), else a hash."""
    slugs: dict[str, dict[str, str]] = {}   # key -> value (as JSON) -> its slug
    for key in dict.fromkeys(k for combo in combos for k in combo):
        values = {_json(combo[key]): combo[key] for combo in combos if key in combo}
        slugs[key] = _distinct_slugs(values)
    ids = []
    for combo in combos:
        leaves = [key.rsplit(".", 1)[-1] for key in combo]
        parts = []
        for key, leaf in zip(combo, leaves):
            label = leaf if leaves.count(leaf) == 1 else key.replace(".", "_")
            parts.append(f"{label}-{slugs[key][_json(combo[key])]}")
        text = ".".join([str(base), *parts])
        if len(text) > 120:   # a readable head and a hash that keeps it unique and fit for a directory name
            text = text[:100].rstrip(".-") + "-" + _digest(combo)
        ids.append(text)
    return ids


def _distinct_slugs(values: dict[str, Any]) -> dict[str, str]:
    """value (as JSON) -> slug, with different values never sharing a slug."""
    slugs = {text: _slug(value) for text, value in values.items()}
    for components in range(2, 6):   # paths that end alike: more of each path, from the end
        clashing = _clashes(slugs)
        if not clashing:
            return slugs
        for text in clashing:
            if isinstance(values[text], str):
                slugs[text] = _slug(values[text], components)
    for text in _clashes(slugs):   # still alike (a/b and a/b/, 'a b' and 'a_b'): a hash tells them apart
        slugs[text] = f"{slugs[text][:31]}-{_digest(values[text])[:8]}"
    return slugs


def _clashes(slugs: dict[str, str]) -> list[str]:
    count: dict[str, int] = {}
    for slug in slugs.values():
        count[slug] = count.get(slug, 0) + 1
    return [text for text, slug in slugs.items() if count[slug] > 1]


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _slug(value: Any, components: int = 1) -> str:
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):
        tail = "_".join(value.rstrip("/").split("/")[-components:]) or value   # a model path: its last part(s)
        slug = _UNSAFE.sub("_", tail).strip("._") or "x"
        return slug[:40] if slug == tail else slug[:31] + "-" + _digest(value)[:8]
    if isinstance(value, list) and value and isinstance(value[0], (str, int, float)):   # e.g. prompts: its first, and a hash
        head = _UNSAFE.sub("_", str(value[0])).strip("._")[:20].rstrip("._-")
        return f"{head}-{_digest(value)[:8]}" if head else "h" + _digest(value)[:10]
    return "h" + _digest(value)[:10]   # a mapping, a list of lists


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b or (isinstance(a, (int, float)) and isinstance(b, (int, float))
                                              and not isinstance(a, bool) and not isinstance(b, bool) and a == b)


def _check_key(key: Any, loc: Loc, locations: Locations) -> None:
    if not isinstance(key, str) or not all(key.split(".")):
        raise _error(locations, loc, f"matrix key {key!r} must be a settings path below the run, "
                     "e.g. generate.cache_kind, model.source or seed")
    if key.split(".")[0] in _NOT_SWEPT:
        raise _error(locations, loc, f"matrix key {key!r} cannot be swept: ids and params are made from the "
                     "matrix, and a matrix does not nest")


def _check_value(value: Any, loc: Loc, locations: Locations) -> None:
    try:   # the values go into run ids and result.json: plain YAML data only (no dates, no sets)
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        raise _error(locations, loc, f"matrix value {_short(value)} is not plain data (strings, numbers, "
                     "booleans, lists, mappings); quote it to make it a string") from None


def _too_many(locations: Locations, base: Loc) -> UserError:
    return UserError(f"{locations.where(base + ('matrix',))}: the matrices expand to more than {MAX_RUNS:,} runs; "
                     "split the sweep into several manifests")


def _error(locations: Locations, loc: Loc, message: str) -> UserError:
    return UserError(f"{locations.where(loc)}: {format_loc(loc)}: {message}")


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
