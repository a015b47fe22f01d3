"""YAML parsing that remembers where every value came from.

pyyaml's plain `safe_load` drops positions, so we compose the node tree ourselves and build the
Python data from it, recording the line of every mapping key and sequence item under its path,
e.g. ('targets', 0, 'runs', 0, 'generate', 'temperature') -> 14. Validation errors then point at
the line to edit.

Plain scalars are read by the YAML 1.2 core schema, not pyyaml's YAML 1.1 one: `017` is 17 (not
octal 15; `0o17` is octal), `1:30` is the string '1:30' (not sexagesimal 90), `yes`/`no`/`on`/`off`
are strings (only true/false are booleans), `2024-01-01` is a string (no timestamps), `1e3` is
a float. Merge keys (`<<: *base`) are kept, one per mapping.
"""

from __future__ import annotations

from collections.abc import Sequence
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from caramba.errors import UserError

Loc = tuple[str | int, ...]

_MERGE_TAG = "tag:yaml.org,2002:merge"


class CoreLoader(yaml.SafeLoader):
    """pyyaml's safe loader with the YAML 1.2 core schema's implicit types (yaml.org/spec/1.2.2
    section 10.3.2) in place of YAML 1.1's; explicit tags (!!int "017") behave the same way."""

    yaml_implicit_resolvers: dict = {}


def _core_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node)
    sign, digits = (-1, text[1:]) if text.startswith("-") else (1, text.lstrip("+"))
    for prefix, base in (("0o", 8), ("0x", 16)):
        if digits.startswith(prefix):
            return sign * int(digits[2:], base)
    return sign * int(digits, 10)   # leading zeros are decimal: 017 is 17


def _core_float(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> float:
    text = loader.construct_scalar(node).lower()
    if text.lstrip("+-") == ".inf":
        return float("-inf") if text.startswith("-") else float("inf")
    return float("nan") if text == ".nan" else float(text)


for _tag, _pattern, _first in (
        ("bool", r"true|True|TRUE|false|False|FALSE", "tTfF"),
        ("int", r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+", "-+0123456789"),
        ("float", r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?|[-+]?\.(inf|Inf|INF)|\.nan|\.NaN|\.NAN",
         "-+0123456789."),
        ("null", r"~|null|Null|NULL|", ["~", "n", "N", ""]),
        ("merge", r"<<", "<")):
    CoreLoader.add_implicit_resolver(f"tag:yaml.org,2002:{_tag}", re.compile(rf"^(?:{_pattern})$"), list(_first))
CoreLoader.add_constructor("tag:yaml.org,2002:int", _core_int)


# libyaml's emitter when pyyaml has it: a 10,000-run sweep writes a manifest.yaml per run.
_SafeDumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


class CoreDumper(_SafeDumper):  # type: ignore[misc, valid-type]
    """pyyaml's safe dumper, quoting every string that YAML 1.2 or YAML 1.1 would read as another
    type ('1e3', 'yes', '017'), so a record's manifest.yaml reads back the same in both."""


for _first, _resolvers in CoreLoader.yaml_implicit_resolvers.items():
    for _tag, _regexp in _resolvers:
        CoreDumper.add_implicit_resolver(_tag, _regexp, [_first])


def dump_yaml(data: Any) -> str:
    return yaml.dump(data, Dumper=CoreDumper, sort_keys=False, allow_unicode=True)
CoreLoader.add_constructor("tag:yaml.org,2002:float", _core_float)
# What YAML 1.1 would have read differently: named in errors about such a string.
_YAML11_BOOL = re.compile(r"y|Y|yes|Yes|YES|n|N|no|No|NO|on|On|ON|off|Off|OFF")
_YAML11_SEXAGESIMAL = re.compile(r"[-+]?[0-9][0-9_]*(:[0-5]?[0-9])+(\.[0-9_]*)?")


def yaml11_note(value: object) -> str:
    """'' or a note for a string that YAML 1.1 (and many editors' highlighting) reads otherwise."""
    if not isinstance(value, str):
        return ""
    if _YAML11_BOOL.fullmatch(value):
        return (f"; manifests are YAML 1.2, where {value} is the string {value!r}, not a boolean: "
                "write true or false")
    if _YAML11_SEXAGESIMAL.fullmatch(value):
        return (f"; manifests are YAML 1.2, where {value} is the string {value!r}, not a base-60 number: "
                "write the number itself")
    return ""

# What a manifest may cost, checked on the composed node graph before any Python data is built:
# an alias is a reference, so 400 bytes of `&a [*b, *b, ...]` expand to billions of values (the
# "billion laughs"). Real manifests hold hundreds of values and nest a dozen levels deep.
MAX_VALUES = 100_000     # scalars, mappings and lists once every alias is expanded
MAX_DEPTH = 64           # nesting levels
MAX_BYTES = 8 << 20      # manifest text (prompts included)


@dataclass
class Locations:
    """Where each value of a manifest came from: its YAML line, or the --set that replaced it."""

    source: str
    lines: dict[Loc, int]
    overrides: list[tuple[Loc, str]] = field(default_factory=list)  # (path it set, the --set text)
    notes: dict[Loc, str] = field(default_factory=dict)   # a run a matrix made -> "matrix run ID"

    def where(self, loc: Sequence[str | int]) -> str:
        """'manifest.yaml:LINE', or 'manifest.yaml (from --set ...)' for an overridden value; a
        value in a run a matrix made adds '(matrix run ID)'."""
        override = self.override_of(loc)
        if override is not None:
            text = f"{self.source} (from --set {override})"
        else:
            line = self.line_of(loc)
            text = f"{self.source}:{line}" if line else self.source
        note = self.notes.get(tuple(loc)[:4])   # ('targets', t, 'runs', r)
        return f"{text} ({note})" if note else text

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
    """Parse one YAML document; YAML errors become UserErrors with file:line, and a document
    over the bounds above is refused before it is built."""
    if len(text) > MAX_BYTES:
        raise UserError(f"{source}: {len(text)} characters is more than a manifest may hold "
                        f"({MAX_BYTES >> 20} MiB); put long texts in files the manifest names")
    loader = None
    try:
        loader = CoreLoader(text)  # its reader already rejects characters YAML does not allow
        node = loader.get_single_node()
        lines: dict[Loc, int] = {}
        data = None
        if node is not None:
            check_cost(node, source)
            lines[()] = node.start_mark.line + 1
            data = _build(loader, node, (), lines, source)
        return data, Locations(source, lines)
    except yaml.reader.ReaderError as error:  # a NUL or control character
        line = text.count("\n", 0, error.position) + 1
        char = error.character if isinstance(error.character, int) else ord(error.character)
        raise UserError(f"{source}:{line}: character U+{char:04X} is not allowed in YAML; "
                        "remove it (write control characters as escapes in a double-quoted string, e.g. \"\\t\")") from None
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f"{source}:{mark.line + 1}" if mark else source
        problem = ", ".join(part for part in (error.context, error.problem) if part)
        raise UserError(f"{where}: YAML syntax error: {problem}") from None
    except yaml.YAMLError as error:
        raise UserError(f"{source}: YAML error: {error}") from None
    except RecursionError:  # pyyaml's composer recurses once per nesting level
        raise UserError(f"{source}: the YAML nests too deeply (a manifest nests at most {MAX_DEPTH} levels)") from None
    finally:
        if loader is not None:
            loader.dispose()


def parse_value(text: str, source: str) -> Any:
    """One YAML value (a `--set` VALUE), with the same bounds as a manifest; '' is None."""
    data, _ = parse_yaml(text, source)
    return data


def check_cost(root: yaml.Node, source: str) -> None:
    """Refuse alias cycles, nesting deeper than MAX_DEPTH and more than MAX_VALUES values with
    every alias expanded. Each node's expanded size is computed once (iteratively, no recursion),
    so the check itself costs the size of the text, not of the expansion."""
    size: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            on_path.discard(key)
            size[key] = 1 + sum(size[id(child)] for child in _children(node))
            if size[key] > MAX_VALUES:
                raise UserError(f"{source}:{node.start_mark.line + 1}: this value expands to more than {MAX_VALUES:,} "
                                "values (aliases are copied in full); a manifest needs far fewer: remove the aliases")
            continue
        if key in size:
            continue
        if key in on_path:
            raise UserError(f"{source}:{node.start_mark.line + 1}: an alias refers to a value that contains it "
                            "(a recursive alias); a manifest cannot be infinite")
        if len(on_path) >= MAX_DEPTH:
            raise UserError(f"{source}:{node.start_mark.line + 1}: the YAML nests more than {MAX_DEPTH} levels deep")
        on_path.add(key)
        stack.append((node, True))
        for child in _children(node):
            if id(child) in on_path:
                raise UserError(f"{source}:{child.start_mark.line + 1}: an alias refers to a value that contains it "
                                "(a recursive alias); a manifest cannot be infinite")
            if id(child) not in size:
                stack.append((child, False))


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _build(loader: CoreLoader, node: yaml.Node, path: Loc, lines: dict[Loc, int], source: str) -> Any:
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


def _reject_duplicate_keys(loader: CoreLoader, node: yaml.MappingNode, source: str) -> None:
    # pyyaml keeps the last of duplicate keys silently; in a manifest that hides a mistake.
    first_line: dict[Any, int] = {}
    merge_line = None
    for key_node, _ in node.value:
        if key_node.tag == _MERGE_TAG:
            line = key_node.start_mark.line + 1
            if merge_line is not None:
                raise UserError(f"{source}:{line}: a second '<<' merge key in one mapping (the first is on line "
                                f"{merge_line}); merge several mappings with one key: <<: [*first, *second]")
            merge_line = line
            continue
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        try:
            if key in first_line:
                raise UserError(f"{source}:{line}: duplicate key {key!r} (first given on line {first_line[key]})")
            first_line[key] = line
        except TypeError:  # an unhashable key such as a list
            raise UserError(f"{source}:{line}: a mapping key must be a plain value, not {key!r}") from None
