"""tests/ mirrors caramba/: every module's tests are found by its name (tests/<package>/test_<module>.py)
or through conftest.COVERED_BY, which names the file that covers it; shared helpers (conftest,
tolerance, test_cli) import by bare name from any folder (pyproject's pytest pythonpath)."""

from __future__ import annotations

from pathlib import Path

from conftest import COVERED_BY

ROOT = Path(__file__).resolve().parents[1]


def caramba_modules() -> list[str]:
    return sorted(".".join(p.relative_to(ROOT).with_suffix("").parts) for p in (ROOT / "caramba").rglob("*.py")
                  if p.name not in ("__init__.py", "__main__.py"))


def all_test_files() -> list[Path]:
    return sorted((ROOT / "tests").rglob("test_*.py"))


def test_every_module_has_tests_a_newcomer_finds():
    named = {p.stem[len("test_"):] for p in all_test_files()}
    lost = [m for m in caramba_modules() if m.rsplit(".", 1)[1] not in named and m not in COVERED_BY]
    assert not lost, f"modules with no test_<module>.py and no line in tests/conftest.py COVERED_BY: {lost}"


def test_covered_by_names_real_modules_and_files():
    modules = set(caramba_modules())
    assert not [m for m in COVERED_BY if m not in modules], "COVERED_BY names modules that no longer exist"
    assert not [f for f in COVERED_BY.values() if not (ROOT / f).is_file()], "COVERED_BY names missing test files"
    named = {p.stem[len("test_"):] for p in all_test_files()}
    assert not [m for m in COVERED_BY if m.rsplit(".", 1)[1] in named], \
        "COVERED_BY lines for modules that now have a test file of their own: drop them"


def test_test_files_mirror_the_package():
    """A test file in tests/<folder>/ sits in a folder named after a caramba package (or integration/,
    for the real-model tests), and test file names are unique (pytest imports them by bare name)."""
    packages = {p.name for p in (ROOT / "caramba").iterdir() if (p / "__init__.py").is_file()}
    folders = {p.parent.name for p in all_test_files() if p.parent != ROOT / "tests"}
    assert folders <= packages | {"integration"}, folders - packages
    stems = [p.stem for p in all_test_files()]
    assert len(stems) == len(set(stems))
