"""Small helpers that make manifest error messages point at the fix."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence


def did_you_mean(word: object, choices: Iterable[object]) -> str:
    """"; did you mean 'x'?" (or 'x' or 'y') for the closest choices, or "" when nothing is close."""
    close = difflib.get_close_matches(str(word), [str(choice) for choice in choices], n=2)
    return f"; did you mean {' or '.join(map(repr, close))}?" if close else ""


def format_loc(loc: Sequence[str | int]) -> str:
    """('targets', 0, 'runs', 0, 'seed') -> 'targets[0].runs[0].seed'."""
    text = ""
    for key in loc:
        text += f"[{key}]" if isinstance(key, int) else f".{key}" if text else str(key)
    return text or "(top level)"
