"""House rule: no function in caramba/ over ~100 lines (issue 30). Read with `ast`, so a method or a
nested function counts on its own; its lines run from the `def` (decorators excluded) to its last
statement, docstring and comments included.

    python tests/test_function_length.py [LIMIT] [PATH ...]   # list functions over LIMIT (default 100)
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "caramba"
LIMIT = 100


def long_functions(limit: int = LIMIT, roots: tuple[Path, ...] = (ROOT,)) -> list[tuple[int, str, str]]:
    """(lines, "path:line", name) of every function longer than `limit` lines, longest first."""
    found = []
    for root in roots:
        for path in sorted(Path(root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > limit:
                        shown = path.relative_to(ROOT.parent) if path.is_relative_to(ROOT.parent) else path
                        found.append((lines, f"{shown}:{node.lineno}", node.name))
    return sorted(found, reverse=True)


def test_long_functions_are_found(tmp_path):
    body = "".join(f"        x{i} = {i}\n" for i in range(LIMIT))
    (tmp_path / "m.py").write_text(f"def short():\n    pass\n\n\nclass C:\n    def long(self):\n{body}"
                                   f"    def at_limit(self):\n{body[:-len(body.splitlines()[-1]) - 1]}")
    assert [(n, name) for n, _, name in long_functions(LIMIT, (tmp_path,))] == [(LIMIT + 1, "long")]


def test_no_function_over_the_limit():
    found = long_functions()
    assert not found, f"functions over {LIMIT} lines (split them):\n" + "\n".join(
        f"  {n:4d} {where} {name}" for n, where, name in found)


if __name__ == "__main__":
    limit = int(sys.argv[1]) if len(sys.argv) > 1 else LIMIT
    for n, where, name in long_functions(limit, tuple(Path(p) for p in sys.argv[2:]) or (ROOT,)):
        print(f"{n:5d}  {where}  {name}")
