"""The docs hold together: every relative link and #anchor in README.md and docs/*.md resolves
(GitHub's heading slugs), and every `docs/<file>.md` or `docs/<file>.md §N` a code comment cites
exists, with a numbered section N in that file. A moved section or a renamed file fails here,
not in a reader's browser."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE = [p for d in ("caramba", "benchmarks", "tests") for p in sorted((ROOT / d).rglob("*"))
        if p.suffix in (".py", ".c", ".h") and "__pycache__" not in p.parts]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup and link targets dropped, lower case, spaces to
    hyphens, letters, digits, hyphens and underscores kept."""
    text = re.sub(r"`|\*\*|\*|_(?=\w)", lambda m: "_" if m.group(0).startswith("_") else "", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text).strip().lower()
    return "".join("-" if ch == " " else ch for ch in text
                   if ch in " -_" or unicodedata.category(ch)[0] in "LMN")


def headings(path: Path) -> list[str]:
    out, fence = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        m = None if fence else re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if m:
            out.append(m.group(2))
    return out


def anchors(path: Path) -> set[str]:
    """Each heading's slug, repeats numbered -1, -2, ... as GitHub numbers them."""
    seen: dict[str, int] = {}
    result = set()
    for heading in headings(path):
        s = slug(heading)
        n = seen.get(s, 0)
        seen[s] = n + 1
        result.add(s if n == 0 else f"{s}-{n}")
    return result


def links(path: Path) -> list[str]:
    """Markdown link targets outside code blocks and code spans."""
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return [m.group(1) for m in re.finditer(r"!?\[[^\]]*\]\(([^)\s]+)\)", text)]


def test_the_slug_rules():
    assert slug("10. AMD EPYC Zen 5 (AVX-512 VNNI, no AMX): the four goals") == \
        "10-amd-epyc-zen-5-avx-512-vnni-no-amx-the-four-goals"
    assert slug("`press_window` and **bold** [link](x.md)") == "press_window-and-bold-link"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(doc):
    broken = []
    for target in links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):      # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"missing file: {target}")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"missing anchor: {target}")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)


def test_code_comments_cite_docs_and_sections_that_exist():
    broken = []
    for path in CODE:
        text = path.read_text(encoding="utf-8", errors="replace")
        for m in re.finditer(r"docs/([A-Za-z0-9_.-]+\.md)(?: §(\d+))?", text):
            doc = ROOT / "docs" / m.group(1)
            where = f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
            if not doc.exists():
                broken.append(f"{where}: {m.group(0)} (no such file)")
            elif m.group(2) and not any(re.match(rf"{m.group(2)}\.\s", h) for h in headings(doc)):
                broken.append(f"{where}: {m.group(0)} (no section {m.group(2)} there)")
    assert not broken, "\n".join(broken)
