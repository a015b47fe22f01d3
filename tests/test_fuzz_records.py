"""Property-based fuzzing of run-directory states (issue 32): whatever a run's lock, staging
(.partial), .old and record entries are (missing, a file, a directory, a FIFO, a link into a
canary directory outside runs/, a dangling link) and however its record's files are damaged,
`status`, `report`, `run`, `run --check` and `run --dry-run` answer with exit 0 or 1 and no
traceback, never block on a FIFO, never touch anything outside runs/, keep the other run's record,
and leave nothing that makes a later run fail once the user's own entry is removed.

Derandomized (a fixed seed, no example database), as tests/manifest/test_fuzz_manifest.py."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cli import invoke, write_tiny_model
from test_fuzz_manifest import FUZZ
from test_hostile import within

from caramba.runs import DONE

RUNS = """\
- id: a
  mode: generate
  generate: {prompts: ["hello"], max_new_tokens: 3, temperature: 0.0, stream: false}
- id: b
  mode: generate
  generate: {prompts: ["hi"], max_new_tokens: 3, temperature: 0.0, stream: false}
  expect: {metrics: ["new_tokens == 3"]}
"""
CANARY = b"outside runs/: never written\n"
ENTRY = ["absent", "file", "dir", "fifo", "link-file", "link-dir", "dangling"]
RECORD = ["valid", "absent", "incomplete", "file", "fifo", "link-file", "link-dir", "dangling"]
DAMAGE = ["none", "truncated", "garbage", "missing", "fifo", "link", "dir"]
COMMANDS = [["status", "--json"], ["report", "--json"], ["report", "--format", "markdown"], ["run"],
            ["run", "--check"], ["run", "--dry-run"], ["run", "--force"]]


@pytest.fixture(scope="module")
def world():
    """(base dir, manifest, a finished runs/ to copy per example)."""
    from conftest import write_manifest

    with tempfile.TemporaryDirectory() as directory:
        base = Path(directory)
        model = write_tiny_model(base / "model")
        manifest = write_manifest(base / "m.yaml", RUNS, model=str(model), name="fz")
        os.environ["CARAMBA_RUNS_DIR"] = str(base / "template")
        try:
            assert invoke("run", manifest).exit_code == 0
        finally:
            del os.environ["CARAMBA_RUNS_DIR"]
        yield base, manifest, base / "template"


def put(path: Path, kind: str, outside: Path) -> None:
    """Replace whatever is at `path` by an entry of `kind`."""
    if os.path.lexists(path):
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    if kind in ("absent", "none", "missing"):
        return
    if kind in ("file", "garbage"):
        path.write_bytes(b"\x00not json{")
    elif kind == "dir":
        (path / "junk").mkdir(parents=True)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind in ("link-file", "link"):
        path.symlink_to(outside / "canary.txt")
    elif kind == "link-dir":
        path.symlink_to(outside / "dir", target_is_directory=True)
    elif kind == "dangling":
        path.symlink_to(outside / "missing")
    else:
        raise AssertionError(kind)


def snapshot(outside: Path) -> dict:
    return {str(p.relative_to(outside)): (p.read_bytes() if p.is_file() and not p.is_symlink() else None)
            for p in sorted(outside.rglob("*"))}


@settings(FUZZ, max_examples=60)
@given(lock=st.sampled_from(ENTRY), partial=st.sampled_from(ENTRY), old=st.sampled_from(ENTRY),
       record=st.sampled_from(RECORD), result=st.sampled_from(DAMAGE), done=st.sampled_from(DAMAGE),
       command=st.sampled_from(COMMANDS))
def test_any_run_directory_state_gets_an_answer_and_touches_nothing_outside(world, monkeypatch, lock, partial, old,
                                                                           record, result, done, command):
    base, manifest, template = world
    work = Path(tempfile.mkdtemp(dir=base))
    runs, outside = work / "runs", work / "outside"
    shutil.copytree(template, runs, symlinks=True)
    (outside / "dir").mkdir(parents=True)
    (outside / "canary.txt").write_bytes(CANARY)
    (outside / "dir" / "keep.txt").write_bytes(CANARY)
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(runs))
    monkeypatch.delenv("CARAMBA_DEBUG", raising=False)
    records = runs / "fz" / "t"
    a_done = (records / "a" / DONE).read_bytes()
    for entry, kind in ((".b.lock", lock), (".b.partial", partial), (".b.old", old)):
        put(records / entry, kind, outside)
    if record == "incomplete":
        (records / "b" / DONE).unlink()
    elif record != "valid":
        put(records / "b", record, outside)
    if record == "valid":
        put(records / "b" / "result.json", result, outside) if result != "truncated" else \
            (records / "b" / "result.json").write_bytes((records / "b" / "result.json").read_bytes()[:40])
        put(records / "b" / DONE, done, outside) if done not in ("none", "truncated") else None
    before = snapshot(outside)
    args = [*command[:1], str(manifest), *command[1:]]

    r = within(120, invoke, *args)
    assert r.exit_code in (0, 1), (args, r.output)
    assert "Traceback" not in r.output and "Error:" not in r.output.replace("RecordError", ""), r.output
    assert snapshot(outside) == before, (args, r.output)
    if "--force" not in command:
        assert (records / "a" / DONE).read_bytes() == a_done   # the other run's record is kept
    assert (records / "a" / DONE).is_file()
    if command[0] == "run" and "--dry-run" not in command and r.exit_code == 1:
        assert "t/b" in r.output, r.output   # a failure names its run

    # The user removes their own entries (a lock or record path that is not caramba's); then the run is done.
    for entry in (".b.lock", "b"):
        path = records / entry
        if os.path.lexists(path) and (path.is_symlink() or not (path.is_dir() if entry == "b" else path.is_file())):
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    again = within(120, invoke, "run", str(manifest))
    assert again.exit_code == 0 and "Traceback" not in again.output, again.output
    assert (records / "b" / DONE).is_file() and snapshot(outside) == before
    shutil.rmtree(work)


# ---- outputs aimed at records (issue 46) ------------------------------------------------------

OUTPUTS = [["report", "--csv"], ["report", "--plot"], ["report", "--format", "markdown"], ["run", "--junit-xml"]]
# Where the output is aimed: every one but "outside" reaches into the runs directory or the manifest.
AIMS = ["record-file", "record-new-file", "runs-root", "lock", "partial", "link-into-runs", "dotdot", "manifest",
        "outside"]


def aim(kind: str, runs: Path, outside: Path, manifest: Path) -> Path:
    records = runs / "fz" / "t"
    if kind == "link-into-runs":
        (outside / "to-runs").symlink_to(records / "b", target_is_directory=True)
        return outside / "to-runs" / "result.json"
    return {"record-file": records / "b" / "result.json", "record-new-file": records / "b" / "new.out",
            "runs-root": runs / "out.csv", "lock": records / ".b.lock", "partial": records / ".b.partial",
            "dotdot": outside / ".." / "runs" / "fz" / "t" / "a" / DONE, "manifest": manifest,
            "outside": outside / "out.file"}[kind]


def record_files(runs: Path) -> dict:
    """Every record's files and bytes (locks left out: taking one writes its holder)."""
    return {str(p.relative_to(runs)): p.read_bytes() for p in sorted(runs.rglob("*"))
            if p.is_file() and not p.name.endswith(".lock")}


@settings(FUZZ, max_examples=40)
@given(output=st.sampled_from(OUTPUTS), where=st.sampled_from(AIMS))
def test_no_output_path_reaches_a_record(world, monkeypatch, output, where):
    base, template_manifest, template = world
    work = Path(tempfile.mkdtemp(dir=base))
    runs, outside = work / "runs", work / "outside"
    shutil.copytree(template, runs, symlinks=True)
    outside.mkdir()
    manifest = work / "m.yaml"
    shutil.copy(template_manifest, manifest)
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(runs))
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    path = aim(where, runs, outside, manifest)
    before, text = record_files(runs), manifest.read_bytes()
    if output[-1] == "markdown":
        monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(path))
        option, args = "$GITHUB_STEP_SUMMARY", [*output[:1], str(manifest), *output[1:]]
    else:
        option, args = output[-1], [output[0], str(manifest), output[1], str(path)]

    r = within(120, invoke, *args)
    assert "Traceback" not in r.output, r.output
    if where == "outside":
        assert r.exit_code in (0, 2) if option == "--plot" else r.exit_code == 0, (args, r.output)
        assert option == "--plot" or path.is_file()
    else:
        assert r.exit_code == 2 and option in r.output, (args, r.output)
    assert record_files(runs) == before and manifest.read_bytes() == text, (args, r.output)
    shutil.rmtree(work)


# ---- metric values an expect: bound compares (issue 46) --------------------------------------------

METRIC_VALUES = st.one_of(st.sampled_from([float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1.0]),
                          st.floats(allow_nan=True, allow_infinity=True), st.integers(-10, 10))


@settings(FUZZ, max_examples=300)
@given(value=METRIC_VALUES, op=st.sampled_from([">=", "<=", ">", "<", "=="]),
       bound=st.sampled_from(["0", "-0.0", "0.5", "1", "1e308", "-1e308"]), place=st.sampled_from(["summary", "top"]))
def test_a_non_finite_metric_never_passes_a_bound(value, op, bound, place):
    import math
    import operator

    from caramba.expect import check
    from caramba.manifest.schema import Expect

    result = {"summary": {"q.kl_max": value}} if place == "summary" else {"kl_max": value}
    name = "q.kl_max" if place == "summary" else "kl_max"
    problems = check(result, Expect(metrics=[f"{name} {op} {bound}"]))
    ops = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt, "==": operator.eq}
    holds = math.isfinite(value) and ops[op](value, float(bound))
    assert (problems == []) == holds, (value, op, bound, problems)
    if not math.isfinite(value):
        assert "not a finite number" in problems[0]


@settings(FUZZ, max_examples=100)
@given(value=st.sampled_from([float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e30]),
       row=st.integers(0, 3), column=st.integers(0, 15), candidate=st.booleans())
def test_logits_with_a_non_finite_value_are_never_scored(value, row, column, candidate):
    """One NaN or inf anywhere in the baseline's or a candidate's logits stops the scoring, naming
    the cache; -0.0 and large finite values are scored (KL >= 0, agreement within [0, 1])."""
    import math

    import torch

    from caramba.evaluation.evaluate import NonFiniteLogits, _Score

    g = torch.Generator().manual_seed(row * 16 + column)
    logits = torch.randn(4, 16, generator=g)
    base, cand = logits.clone(), logits + 0.01 * torch.randn(4, 16, generator=g)
    (cand if candidate else base)[row, column] = value
    targets = torch.zeros(4, dtype=torch.long)
    scores = [_Score("fp32"), _Score("q4_0")]
    lb, lc = torch.log_softmax(base, -1), torch.log_softmax(cand, -1)
    if math.isfinite(value):
        scores[0].add(lb, lb, targets)
        scores[1].add(lc, lb, targets)
        assert scores[1].kl >= 0 and 0 <= scores[1].agree <= scores[1].n and math.isfinite(scores[1].kl_max)
        return
    with pytest.raises(NonFiniteLogits, match="q4_0" if candidate else "fp32"):
        scores[0].add(lb, lb, targets)
        scores[1].add(lc, lb, targets)
