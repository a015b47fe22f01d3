"""The package's import graph: the engine imports nothing above it, and no module imports itself
back through others (issues 30, 45). Read from the source with `ast`, so an import inside a function
is an edge like one at the top (it runs too, only later); only `if TYPE_CHECKING:` blocks (never
run) are left out. Importing a.b.c runs a/__init__ and a/b/__init__ first, so those are edges too,
but for the importer's own packages (Python has run them before the importer itself).

An import inside a function is allowed where it keeps `caramba --help` (or another light command)
from loading torch and the engine: the CLI's command modules import what a command runs when it
runs, and anywhere else such an import carries a `# lazy: <why>` comment, on its line or alone on
the line above."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "caramba"

# The engine: models, caches, generation, presses, the shared helpers they run on and the hooks
# the layers above fill in (caramba.resolvers).
ENGINE = ("caramba.model", "caramba.cache", "caramba.infer", "caramba.press", "caramba.tokenizer",
          "caramba.kernels", "caramba.gemm", "caramba.fused", "caramba.threads", "caramba.options", "caramba.resolvers")
# What builds on the engine; the engine never reaches up into it. The package root counts too:
# it wires the autotune in as the default cache resolver.
ABOVE = ("caramba.evaluation", "caramba.autotune", "caramba.runners", "caramba.manifest", "caramba.cli", "caramba.cli_eval",
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


def _imports_every_submodule(node: ast.AST) -> bool:
    """`pkgutil.iter_modules(__path__)`: a package's __init__ that imports each of its modules."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "iter_modules"
            and len(node.args) == 1 and isinstance(node.args[0], ast.Name) and node.args[0].id == "__path__")


def _import_nodes(tree: ast.AST, local: bool = False):
    """(node, inside a function) for every Import/ImportFrom in the tree, at any depth, except
    under `if TYPE_CHECKING:`; a dynamic import of a literal name comes as an Import, and a
    package's `pkgutil.iter_modules(__path__)` as an ImportFrom of '*' at level 1."""
    stack = [(tree, local)]
    while stack:
        node, inside = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend((n, inside) for n in node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, inside
        elif (dynamic := _dynamic_import(node)) is not None:
            yield ast.Import(names=[ast.alias(name=dynamic)], lineno=node.lineno), inside
        elif _imports_every_submodule(node):
            yield ast.ImportFrom(module=None, names=[ast.alias(name="*")], level=1, lineno=node.lineno), inside
        inside = inside or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        stack.extend((n, inside) for n in ast.iter_child_nodes(node))


def _ancestors(name: str) -> list[str]:
    """The packages whose __init__ importing `name` runs: caramba.a.b -> [caramba, caramba.a]."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _targets(name: str, is_pkg: bool, node: ast.Import | ast.ImportFrom, known: set[str]) -> list[str]:
    """The caramba modules one import statement names. `from pkg import x` counts as pkg.x when
    that is a module, else as pkg; `from pkg import *` of iter_modules as each module of pkg."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        if node.level:   # relative: resolve against this module's package
            base = name.split(".") if is_pkg else name.split(".")[:-1]
            base = base[:len(base) - node.level + 1]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        if [a.name for a in node.names] == ["*"] and node.module is None:
            targets = [m for m in known if m.rsplit(".", 1)[0] == source and m != source]
        else:
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names]
    return [t for t in targets if t.split(".")[0] == "caramba" and t in known]


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The caramba modules importing `name` runs: those it names and the packages above them (their
    __init__ runs first), but for `name`'s own packages, which Python has run before `name`."""
    is_pkg = path.name == "__init__.py"
    own = set(_ancestors(name)) | ({name} if is_pkg else set())
    found: set[str] = set()
    for node, _ in _import_nodes(ast.parse(path.read_text(), filename=str(path))):
        for target in _targets(name, is_pkg, node, known):
            found.add(target)
            found.update(p for p in _ancestors(target) if p in known and p not in own)
    found.discard(name)
    return found


# The CLI's command modules: each command imports what it runs when it runs, so that `caramba
# --help` (and the light commands) load neither torch nor the engine; a local import is their rule.
LAZY_MODULES = ("caramba.cli", "caramba.cli_bench", "caramba.cli_dba", "caramba.cli_eval", "caramba.cli_generate",
                "caramba.cli_report")
LAZY_MARK = "# lazy:"
# Modules whose local imports predate the rule and belong to other work (issue 45): to be moved
# to the top or marked by their owners. Shrinks only.
NOT_YET_MARKED = ("caramba.evaluation.tasks", "caramba.runners.eval")


def unmarked_local_imports(name: str, path: Path, known: set[str]) -> list[str]:
    """`path:line: statement` for each import of a caramba module inside a function without a
    `# lazy:` comment on its line or alone on the line above."""
    lines = path.read_text().splitlines()
    tree = ast.parse("\n".join(lines), filename=str(path))
    where = "/".join(name.split(".")) + ("/__init__.py" if path.name == "__init__.py" else ".py")
    return [f"{where}:{node.lineno}: {lines[node.lineno - 1].strip()}"
            for node, inside in _import_nodes(tree)
            if inside and _targets(name, path.name == "__init__.py", node, known)
            and LAZY_MARK not in lines[node.lineno - 1]
            and not (node.lineno > 1 and lines[node.lineno - 2].strip().startswith(LAZY_MARK))]


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per group of modules that import each other (strongly connected component), so
    that every such group is reported at once."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in sorted(graph):   # Tarjan's algorithm, iterative
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    cycles.append(find_cycle({m: graph.get(m, set()) & group for m in sorted(group)}))
    return cycles


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
    assert find_cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}) == [
        ["a", "b", "a"], ["c", "d", "e", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_type_checking_imports_are_not_edges(tmp_path):
    src = tmp_path / "caramba" / "x.py"
    src.parent.mkdir()
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import caramba.y\n"
                   "def f():\n    from caramba import z\n")
    assert set(imports_of("caramba.x", src, {"caramba", "caramba.x", "caramba.y", "caramba.z"})) == {"caramba.z"}


def test_importing_a_module_runs_its_packages(tmp_path):
    """import caramba.p.q.m runs caramba.p and caramba.p.q too; the importer's own packages
    (caramba, and caramba.r for caramba.r.x) have run before it and are no edge."""
    src = tmp_path / "caramba" / "r" / "x.py"
    src.parent.mkdir(parents=True)
    src.write_text("def f():\n    from caramba.p.q import m\n    import caramba.r.y\n")
    known = {"caramba", "caramba.p", "caramba.p.q", "caramba.p.q.m", "caramba.r", "caramba.r.x", "caramba.r.y"}
    assert imports_of("caramba.r.x", src, known) == {"caramba.p", "caramba.p.q", "caramba.p.q.m", "caramba.r.y"}


def test_a_package_that_imports_each_module_has_them_as_edges(tmp_path):
    src = tmp_path / "caramba" / "p" / "__init__.py"
    src.parent.mkdir(parents=True)
    src.write_text("import importlib, pkgutil\nfor m in pkgutil.iter_modules(__path__):\n"
                   "    importlib.import_module(f'{__name__}.{m.name}')\n")
    known = {"caramba", "caramba.p", "caramba.p.a", "caramba.p.b", "caramba.p.b.c"}
    assert imports_of("caramba.p", src, known) == {"caramba.p.a", "caramba.p.b"}


def test_local_imports_are_marked(tmp_path):
    src = tmp_path / "caramba" / "x.py"
    src.parent.mkdir()
    src.write_text("import caramba.y\ndef f():\n    import caramba.z   # lazy: keeps --help free of torch\n"
                   "    import json\n    from caramba import y\n    # lazy: keeps --help free of torch\n"
                   "    return __import__('caramba.z').f()\n")
    known = {"caramba", "caramba.x", "caramba.y", "caramba.z"}
    assert unmarked_local_imports("caramba.x", src, known) == ["caramba/x.py:5: from caramba import y"]


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
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_local_imports_only_where_they_keep_the_cli_light():
    """A function-local import that is not the CLI's is marked `# lazy: <why>` (see above)."""
    mods = modules()
    known = set(mods)
    bad = [line for name, path in mods.items() if name not in LAZY_MODULES + NOT_YET_MARKED
           for line in unmarked_local_imports(name, path, known)]
    assert not bad, "function-local imports without a `# lazy:` reason (move them to the top):\n" + "\n".join(bad)
    cleaned = [name for name in NOT_YET_MARKED if not unmarked_local_imports(name, mods[name], known)]
    assert not cleaned, f"{cleaned}: no unmarked local import left; take them off NOT_YET_MARKED"


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
