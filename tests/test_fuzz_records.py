"""Property-based fuzzing of run-directory states (issue 32): whatever a run's lock, staging
(.partial), .old and record entries are (missing, a file, a directory, a FIFO, a link into a
canary directory outside runs/, a dangling link) and however its record's files are damaged,
`status`, `report`, `run`, `run --check` and `run --dry-run` answer with exit 0 or 1 and no
traceback, never block on a FIFO, never touch anything outside runs/, keep the other run's record,
and leave nothing that makes a later run fail once the user's own entry is removed.

Derandomized (a fixed seed, no example database), as tests/test_fuzz_manifest.py."""

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
