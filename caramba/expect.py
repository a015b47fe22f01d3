"""`expect:` blocks: what a run's result must still show when CI re-runs a manifest (--check).

A bound is `NAME OP NUMBER` with OP one of >=, <=, >, <, ==. NAME is a key of result.json's
`summary` (an eval's are dotted: `q4_0.tasks.niah_single.2048`), a top-level key, or a dotted
path (`summary.decode_tok_s_median`). The output hash is
the sha256 of the generated ids of every prompt, in order, as compact JSON.
"""

from __future__ import annotations

import hashlib
import json
import math
import operator
import re
from typing import Any

_OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt, "==": operator.eq}
_BOUND = re.compile(r"^\s*([A-Za-z_][\w.]*)\s*(>=|<=|==|>|<)\s*([-+]?[\d.]+(?:[eE][-+]?\d+)?)\s*$")


def parse_bound(text: str) -> tuple[str, str, float]:
    m = _BOUND.match(text)
    if m is None:
        raise ValueError(f"bound {text!r} is not 'NAME OP NUMBER' (OP: >=, <=, >, <, ==), e.g. 'acceptance_rate >= 0.6'")
    return m.group(1), m.group(2), float(m.group(3))


def output_sha256(result: dict[str, Any]) -> str | None:
    prompts = result.get("prompts")
    if not prompts or any("output_ids" not in p for p in prompts):
        return None
    ids = json.dumps([p["output_ids"] for p in prompts], separators=(",", ":"))
    return hashlib.sha256(ids.encode()).hexdigest()


def lookup(result: dict[str, Any], name: str) -> Any:
    summary = result.get("summary") if isinstance(result.get("summary"), dict) else {}
    if name in summary:   # an eval's dotted names (q4_0.tasks.niah_single.2048) are summary keys
        return summary[name]
    if "." in name:
        value: Any = result
        for part in name.split("."):
            if not isinstance(value, dict) or part not in value:
                return None
            value = value[part]
        return value
    return result.get(name)


def check(result: dict[str, Any], expect) -> list[str]:
    """Every way `result` breaks `expect` (an Expect section), as readable lines; [] if it holds."""
    problems = []
    if expect.output_sha256 is not None:
        actual = output_sha256(result)
        if actual is None:
            problems.append("output_sha256: this run's result has no generated ids to hash")
        elif actual != expect.output_sha256:
            problems.append(f"output_sha256: expected {expect.output_sha256}, got {actual} (the generated ids changed)")
    for text in expect.metrics:
        name, op, bound = parse_bound(text)
        value = lookup(result, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            problems.append(f"{text}: result.json has no number at '{name}'")
        elif not math.isfinite(value):   # inf would pass every lower bound, NaN is no measurement
            problems.append(f"{text}: got {name} = {value}, not a finite number")
        elif not _OPS[op](value, bound):
            problems.append(f"{text}: got {name} = {value:.6g}")
    return problems
