"""The package's import graph: the engine imports nothing above it, and no module imports itself
back through others (issue 30). Read from the source with `ast`, so an import inside a function is
an edge like one at the top; only `if TYPE_CHECKING:` blocks (never run) are left out."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "caramba"

# The engine: models, caches, generation, presses, the shared helpers they run on and the hooks
# the layers above fill in (caramba.resolvers).
ENGINE = ("caramba.model", "caramba.cache", "caramba.infer", "caramba.press", "caramba.tokenizer",
          "caramba.kernels", "caramba.gemm", "caramba.threads", "caramba.options", "caramba.resolvers")
# What builds on the engine; the engine never reaches up into it. The package root counts too:
# it wires the autotune in as the default cache resolver.
ABOVE = ("caramba.autotune", "caramba.runners", "caramba.manifest", "caramba.cli", "caramba.cli_eval",
         "caramba.cli_generate", "caramba.bench", "caramba.executors")
ROOT_PACKAGE = "caramba"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _dynamic_import(node: ast.AST) -> str | None:
    """The module a `__import__("x")` or `importlib.import_module("x")` call names, if a literal."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)):
        return None
    func = node.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
    return node.args[0].value if name in ("__import__", "import_module") else None


def _import_nodes(tree: ast.AST):
    """Every Import/ImportFrom in the tree, at any depth, except under `if TYPE_CHECKING:`; a
    dynamic import of a literal name comes as an Import."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif (dynamic := _dynamic_import(node)) is not None:
            yield ast.Import(names=[ast.alias(name=dynamic)])
        stack.extend(ast.iter_child_nodes(node))


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The caramba modules `name` imports. `from pkg import x` counts as pkg.x when that is a
    module, else as pkg; importing a.b.c also runs a and a.b, but those are the package's own
    __init__ and counted only when named."""
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level:   # relative: resolve against this module's package
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names]
        found.update(t for t in targets if t.split(".")[0] == "caramba" and t in known)
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path, iters = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while path:
            nxt = next(iters[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                iters.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                iters.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_graph_is_read():
    """The parser sees what the package really imports (a graph that found nothing would pass)."""
    graph = import_graph()
    assert len(graph) > 50
    assert "caramba.cache.policy" in graph["caramba.infer.config"]
    assert "caramba.infer" in graph["caramba.runners.generate"] or any(
        m.startswith("caramba.infer.") for m in graph["caramba.runners.generate"])


def test_find_cycle_reports_the_modules():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_type_checking_imports_are_not_edges(tmp_path):
    src = tmp_path / "caramba" / "x.py"
    src.parent.mkdir()
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import caramba.y\n"
                   "def f():\n    from caramba import z\n")
    assert set(imports_of("caramba.x", src, {"caramba", "caramba.x", "caramba.y", "caramba.z"})) == {"caramba.z"}


def test_dynamic_and_relative_imports_are_edges(tmp_path):
    src = tmp_path / "caramba" / "p" / "x.py"
    src.parent.mkdir(parents=True)
    src.write_text("import importlib\nfrom . import y\nfrom .. import w\n"
                   "def f():\n    importlib.import_module('caramba.z')\n    return __import__('caramba.v')\n")
    known = {"caramba", "caramba.p", "caramba.p.x", "caramba.p.y", "caramba.w", "caramba.z", "caramba.v"}
    assert imports_of("caramba.p.x", src, known) == {"caramba.p.y", "caramba.w", "caramba.z", "caramba.v"}


@pytest.mark.parametrize("layer", ENGINE)
def test_engine_imports_nothing_above_it(layer):
    graph = import_graph()
    bad = sorted(f"{mod} -> {dep}" for mod, deps in graph.items() if _within(mod, (layer,))
                 for dep in deps if _within(dep, ABOVE) or dep == ROOT_PACKAGE)
    assert not bad, "the engine imports from the layers above it:\n" + "\n".join(bad)


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_decoder_does_not_reach_its_c_backend():
    """The fused C step is a backend the decoders choose (caramba.model.backend): the model's own
    forward never hands off to it, so the decoder module imports neither it nor the chooser."""
    graph = import_graph()
    reach, todo = set(), ["caramba.model.transformer"]
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep not in reach:
                reach.add(dep)
                todo.append(dep)
    assert not reach & {"caramba.model.fast_decode", "caramba.model.backend"}
    assert "caramba.model.fast_decode" in graph["caramba.model.backend"]   # the chooser does reach it
