"""JUnit XML for `caramba run --check --junit-xml PATH`: one <testcase> per run, so CI systems
(GitHub, GitLab, Jenkins) show each run as a test. A run that failed is an <error> (it did not
produce a result), a run whose result breaks its `expect:` block a <failure> with the check's
message, a run left to another process <skipped>."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from caramba.runs import atomic_write_text


@dataclass
class Case:
    name: str                 # target/run id
    status: str               # done, skipped (already done), failed, busy, cancelled
    seconds: float = 0.0
    message: str = ""         # why it failed
    checks: list[str] = field(default_factory=list)   # why it failed its check


def junit_xml(suite: str, cases: list[Case]) -> str:
    """The XML text of one <testsuite> named `suite` (the manifest) inside <testsuites>."""
    failures = sum(bool(c.checks) for c in cases)
    errors = sum(c.status in ("failed", "cancelled") for c in cases)
    skipped = sum(c.status == "busy" for c in cases)
    seconds = sum(c.seconds for c in cases)
    root = ET.Element("testsuites", name="caramba", tests=str(len(cases)), failures=str(failures),
                      errors=str(errors), skipped=str(skipped), time=f"{seconds:.3f}")
    suite_el = ET.SubElement(root, "testsuite", name=suite, tests=str(len(cases)), failures=str(failures),
                             errors=str(errors), skipped=str(skipped), time=f"{seconds:.3f}")
    for c in cases:
        target, _, run_id = c.name.partition("/")
        case = ET.SubElement(suite_el, "testcase", classname=f"{suite}.{target}", name=run_id or c.name,
                             time=f"{c.seconds:.3f}")
        if c.status in ("failed", "cancelled"):
            message = c.message or ("cancelled before it finished" if c.status == "cancelled" else "the run failed")
            ET.SubElement(case, "error", message=_line(message), type=f"run {c.status}").text = _clean(message)
        elif c.status == "busy":
            ET.SubElement(case, "skipped", message=_line(c.message or "another process is running it"))
        if c.checks:
            ET.SubElement(case, "failure", message=_line(c.checks[0]), type="check failed").text = _clean("\n".join(c.checks))
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


# Characters XML 1.0 cannot hold at all (a run's message may quote a control character).
_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _clean(text: str) -> str:
    return _NOT_XML.sub("\ufffd", text)


def _line(text: str) -> str:
    """An attribute's text: the first line, bounded (the element's text holds all of it)."""
    first = text.strip().splitlines()[0] if text.strip() else text
    return _clean(first[:500])


def write_junit(path: Path, suite: str, cases: list[Case]) -> None:
    atomic_write_text(path, junit_xml(suite, cases))
