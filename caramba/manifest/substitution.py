"""`${name}` substitution from the manifest's `vars` into every string value.

A string that is exactly `${name}` takes the var's typed value (so `max_new_tokens: ${n}` gets an
int); inside a longer string the var is written as text. Values of `vars` are taken literally.
`$${` is a literal `${` (a prompt may say `$${name}` to mean the text `${name}`).
"""

from __future__ import annotations

import re
from typing import Any

from caramba.errors import UserError
from caramba.manifest.hints import did_you_mean, format_loc
from caramba.manifest.yaml_lines import Loc, Locations

_REFERENCE = re.compile(r"\$\{([^}]*)\}")
# `$${` (an escaped `${`) or a reference; scanning both in one pass keeps `$${a}` from matching `${a}`.
_TOKEN = re.compile(r"\$(\$\{)|\$\{([^}]*)\}")


def substitute_vars(data: dict[str, Any], locations: Locations) -> dict[str, Any]:
    """A copy of `data` with every `${name}` replaced; undefined names are one UserError."""
    variables = data.get("vars") or {}
    if not isinstance(variables, dict):
        return data  # validation reports the malformed vars section
    problems: list[str] = []

    def substitute(value: Any, path: Loc) -> Any:
        if isinstance(value, dict):
            return {key: substitute(item, path + (key,)) for key, item in value.items()}
        if isinstance(value, list):
            return [substitute(item, path + (index,)) for index, item in enumerate(value)]
        if not isinstance(value, str):
            return value
        whole = _REFERENCE.fullmatch(value)
        if whole and whole[1] in variables:
            return variables[whole[1]]

        def replace(match: re.Match[str]) -> str:
            if match[1]:
                return match[1]   # `$${` -> `${`
            name = match[2]
            if name in variables:
                return _as_text(variables[name])
            defined = f"defined vars: {', '.join(variables)}" if variables else "no vars are defined"
            problems.append(
                f"{locations.where(path)}: {format_loc(path)}: undefined var {name!r} in {value!r}; "
                f"{defined}{did_you_mean(name, variables)}"
            )
            return match[0]

        return _TOKEN.sub(replace, value)

    result = {key: value if key == "vars" else substitute(value, (key,)) for key, value in data.items()}
    if problems:
        raise UserError("\n".join(problems))
    return result


def escape_vars(data: dict[str, Any]) -> dict[str, Any]:
    """`data` (substituted) with every `${` written `$${` outside `vars`, so that reading it back
    (a record's manifest.yaml) gives the same strings instead of substituting them again."""

    def escape(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: escape(item) for key, item in value.items()}
        if isinstance(value, list):
            return [escape(item) for item in value]
        return value.replace("${", "$${") if isinstance(value, str) else value

    return {key: value if key == "vars" else escape(value) for key, value in data.items()}


def _as_text(value: Any) -> str:
    if isinstance(value, bool):  # YAML spelling, so the text reads back as the same bool
        return "true" if value else "false"
    return str(value)
