"""Records on a hostile filesystem (issue 32): every state is built for real (symlinks out of the
runs directory to a canary file whose bytes are checked afterwards, FIFOs from os.mkfifo, files
and directories swapped, a read-only mount, a full tmpfs) and each test shows exit 2 or a named
failed run, nothing outside runs/ touched, and the other runs recorded.

Classes: entries that are not what they should be (a lock, .partial, .old or record path that is a
link, a directory, a FIFO or a file); damaged records (DONE's digests); the filesystem failing
(CARAMBA_RUNS_DIR naming a file, a read-only or full disk, a run too big for memory); reports that
never show a stale or damaged record's numbers."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
from test_cli import invoke, tiny_model  # noqa: F401  (fixture)
from test_hostile import within

import caramba.runners as runners
from caramba.runners import resources
from caramba.runs import DONE, RecordError, RunDir, read_record_file

RUNS = """\
- id: a
  mode: generate
  seed: 0
  generate: {prompts: ["hello"], max_new_tokens: 4, temperature: 0.0, stream: false}
- id: b
  mode: generate
  seed: 1
  generate: {prompts: ["hi there"], max_new_tokens: 4, temperature: 0.0, stream: false}
  expect: {metrics: ["new_tokens == 4"]}
- id: c
  mode: generate
  generate: {prompts: ["bye"], max_new_tokens: 4, temperature: 0.0, stream: false}
"""
CANARY = b"the canary: caramba must never write here\n"


@pytest.fixture
def world(tmp_path, monkeypatch, tiny_model):  # noqa: F811
    """(manifest, records dir runs/rec/t, outside dir holding canary.txt and a canary directory)."""
    from conftest import write_manifest

    runs = tmp_path / "runs"
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(runs))
    monkeypatch.delenv("CARAMBA_DEBUG", raising=False)
    outside = tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "canary.txt").write_bytes(CANARY)
    (outside / "dir" / "keep.txt").write_bytes(CANARY)
    manifest = write_manifest(tmp_path / "m.yaml", RUNS, model=str(tiny_model), name="rec")
    return manifest, runs / "rec" / "t", outside


def snapshot(outside: Path) -> dict:
    return {str(p.relative_to(outside)): (p.read_bytes() if p.is_file() else None) for p in sorted(outside.rglob("*"))}


def flat(text: str) -> str:
    return " ".join(text.split())


def make(path: Path, kind: str, outside: Path) -> None:
    """Put an entry of `kind` at `path` (its parent made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "link-file":
        path.symlink_to(outside / "canary.txt")
    elif kind == "link-dir":
        path.symlink_to(outside / "dir", target_is_directory=True)
    elif kind == "dangling":
        path.symlink_to(outside / "nothing-here")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        (path / "inner").mkdir(parents=True)
    elif kind == "file":
        path.write_bytes(b"not what belongs here\n")
    else:
        raise AssertionError(kind)


def states(manifest) -> dict[str, str]:
    r = invoke("status", manifest, "--json")
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    return {row["run"]: row["state"] for row in json.loads(r.stdout)}


# ---- entries that are not what they should be ---------------------------------------------------

BLOCKING = [(".b.lock", kind) for kind in ("link-file", "link-dir", "dangling", "fifo", "dir")] + \
           [("b", kind) for kind in ("link-file", "link-dir", "dangling", "fifo", "file")]


@pytest.mark.parametrize("entry, kind", BLOCKING)
def test_a_lock_or_record_path_that_is_not_ours_fails_that_run_by_name(world, entry, kind):
    manifest, records, outside = world
    make(records / entry, kind, outside)
    before = snapshot(outside)
    r = within(120, invoke, "run", manifest)
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    text = flat(r.output)
    assert "failed t/b: " in text and str(records / entry) in text, text
    assert "2 done, 0 skipped, 1 failed" in text
    assert (records / "a" / DONE).is_file() and (records / "c" / DONE).is_file()
    assert snapshot(outside) == before and (outside / "canary.txt").read_bytes() == CANARY
    assert states(manifest)["t/b"] == "blocked"
    report = invoke("report", manifest, "--json")
    assert report.exit_code == 0 and {r["run"]: r["status"] for r in json.loads(report.stdout)}["t/b"] == "blocked"
    # once the entry is gone, the run is done: caramba left nothing behind that blocks a redo
    os.unlink(records / entry) if kind != "dir" else shutil.rmtree(records / entry)
    again = invoke("run", manifest)
    assert again.exit_code == 0 and "1 done, 2 skipped" in again.output, again.output
    assert snapshot(outside) == before


@pytest.mark.parametrize("entry", [".b.partial", ".b.old"])
@pytest.mark.parametrize("kind", ["link-file", "link-dir", "dangling", "fifo", "file", "dir"])
def test_scratch_entries_of_any_kind_are_removed_and_the_run_is_done(world, entry, kind):
    manifest, records, outside = world
    make(records / entry, kind, outside)
    before = snapshot(outside)
    r = within(120, invoke, "run", manifest)
    assert r.exit_code == 0 and "3 done" in r.output, r.output
    if kind != "dir":   # a directory is what caramba puts there: removed without a word
        assert f"removed {records / entry}" in flat(r.output)
    assert not os.path.lexists(records / entry)
    assert sorted(p.name for p in records.iterdir()) == [".a.lock", ".b.lock", ".c.lock", "a", "b", "c"]
    assert snapshot(outside) == before   # the link was removed, never what it points to


def test_a_half_swapped_old_link_never_becomes_the_record(world):
    manifest, records, outside = world
    make(records / ".b.old", "link-dir", outside)   # the state _recover() renames into place for a real .old
    assert invoke("run", manifest).exit_code == 0
    assert entry_is_dir(records / "b") and (records / "b" / DONE).is_file()
    assert sorted(p.name for p in (outside / "dir").iterdir()) == ["keep.txt"]


def entry_is_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


@pytest.mark.parametrize("parent", ["rec", "rec/t"])
@pytest.mark.parametrize("kind", ["link-dir", "file"])
def test_a_manifest_or_target_directory_that_is_not_one_exits_2(world, parent, kind):
    manifest, records, outside = world
    make(records.parent.parent / parent, kind, outside)
    before = snapshot(outside)
    r = invoke("run", manifest)
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert str(records.parent.parent / parent) in flat(r.output) and "not a directory of records" in flat(r.output)
    assert snapshot(outside) == before


@pytest.mark.parametrize("entry, kind", [("b", "link-dir"), (".b.lock", "fifo"), (".b.partial", "file")])
def test_under_jobs_a_bad_entry_is_a_named_failed_run_not_a_worker_traceback(world, entry, kind):
    manifest, records, outside = world
    make(records / entry, kind, outside)
    before = snapshot(outside)
    r = within(300, invoke, "run", manifest, "--jobs", "2")
    assert "Traceback" not in r.output, r.output
    if entry == ".b.partial":
        assert r.exit_code == 0 and "3 done" in r.output, r.output
    else:
        assert r.exit_code == 1 and "2 done, 0 skipped, 1 failed" in r.output, r.output
        assert "failed t/b" in r.output and str(records / entry) in flat(r.output), r.output
    assert (records / "a" / DONE).is_file() and (records / "c" / DONE).is_file()
    assert snapshot(outside) == before


def test_lock_and_record_files_are_opened_without_following_links(tmp_path):
    outside = tmp_path / "canary.txt"
    outside.write_bytes(CANARY)
    record = RunDir("m", "t", "r", root=tmp_path / "runs")
    record.begin()
    record.write_json("result.json", {"v": 1})
    record.finish()
    record.release()
    (record.final / "result.json").unlink()
    (record.final / "result.json").symlink_to(outside)
    with pytest.raises(RecordError, match="symbolic link"):
        read_record_file(record.final / "result.json")
    assert record.status().state == "damaged" and "symbolic link" in record.status().detail
    os.unlink(record.lock_path)
    record.lock_path.symlink_to(outside)
    with pytest.raises(RecordError, match=r"the lock .*\.r\.lock is a symbolic link"):
        RunDir("m", "t", "r", root=tmp_path / "runs").try_lock()
    assert outside.read_bytes() == CANARY


def test_a_lock_that_is_a_hard_link_to_a_file_outside_is_never_truncated(world):
    manifest, records, outside = world
    records.mkdir(parents=True)
    os.link(outside / "canary.txt", records / ".b.lock")   # same filesystem: lstat sees a plain file
    r = invoke("run", manifest)
    assert r.exit_code == 1 and "failed t/b" in r.output and "hard link" in flat(r.output), r.output
    assert (outside / "canary.txt").read_bytes() == CANARY
    assert (records / "a" / DONE).is_file() and (records / "c" / DONE).is_file()
    assert states(manifest)["t/b"] == "blocked"


# ---- damaged records ----------------------------------------------------------------------------

def _truncate(path: Path, outside: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _link(path: Path, outside: Path) -> None:
    path.unlink()
    path.symlink_to(outside / "canary.txt")


def _fifo(path: Path, outside: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _edit(path: Path, outside: Path) -> None:
    result = json.loads(path.read_text())
    result["summary"]["new_tokens"] = 4000   # a plausible, valid edit: only the digest can tell
    path.write_text(json.dumps(result))


def _old_done(path: Path, outside: Path) -> None:
    (path.parent / DONE).write_text("2026-01-01T00:00:00+00:00\n")   # DONE as an older caramba wrote it


@pytest.mark.parametrize("damage", [_truncate, _link, _fifo, _edit, _old_done, lambda p, o: p.unlink()],
                         ids=["truncated", "symlink", "fifo", "edited", "old-done", "missing"])
def test_a_damaged_record_is_never_done_and_is_redone(world, damage):
    manifest, records, outside = world
    assert invoke("run", manifest).exit_code == 0
    damage(records / "b" / "result.json", outside)
    before = snapshot(outside)
    assert states(manifest) == {"t/a": "done", "t/b": "damaged", "t/c": "done"}
    report = within(60, invoke, "report", manifest, "--json")
    rows = {row["run"]: row for row in json.loads(report.stdout)}
    assert rows["t/b"]["status"] == "damaged" and rows["t/b"]["metrics"] == {} and rows["t/a"]["metrics"]
    dry = invoke("run", manifest, "--dry-run")
    assert "would redo (the record is damaged" in flat(dry.output)
    checked = within(120, invoke, "run", manifest, "--check")
    assert checked.exit_code == 0 and "Traceback" not in checked.output, checked.output
    assert "t/b: the record is damaged" in flat(checked.output) and "check ok t/b" in checked.output
    assert "1 done, 2 skipped" in checked.output
    assert states(manifest)["t/b"] == "done" and snapshot(outside) == before


def test_check_on_a_record_damaged_after_it_was_verified_is_a_failed_check(world, monkeypatch):
    manifest, records, outside = world
    assert invoke("run", manifest).exit_code == 0
    real = runners.RunDir.status

    def damaged_after_the_look(self, digest=None):   # the file is truncated between the look and the read
        status = real(self, digest)
        if self.final.name == "b":
            (self.final / "result.json").write_text('{"summary": {"new_tok')
        return status

    monkeypatch.setattr(runners.RunDir, "status", damaged_after_the_look)
    junit = records.parent.parent.parent / "junit.xml"
    r = invoke("run", manifest, "--check", "--junit-xml", junit)
    assert r.exit_code == 1 and "Traceback" not in r.output and "JSONDecodeError" not in r.output, r.output
    assert "check failed t/b" in flat(r.output) and "is not valid JSON" in flat(r.output)
    assert 'name="b"' in junit.read_text() and "is not valid JSON" in junit.read_text()


def test_report_of_record_directories_refuses_a_damaged_one(world):
    manifest, records, outside = world
    assert invoke("run", manifest).exit_code == 0
    _edit(records / "b" / "result.json", outside)
    r = invoke("report", records / "a", records / "b")
    assert r.exit_code == 2 and "damaged record" in flat(r.output) and str(records / "b") in flat(r.output)


# ---- reports that never lie ---------------------------------------------------------------------

def test_report_marks_changed_records_and_hides_their_old_metrics(world):
    manifest, records, outside = world
    assert invoke("run", manifest).exit_code == 0
    edited = ["--set", "targets.t.runs.b.generate.max_new_tokens=3"]
    rows = {r["run"]: r for r in json.loads(invoke("report", manifest, "--json", *edited).stdout)}
    assert rows["t/b"]["status"] == "changed" and rows["t/b"]["metrics"] == {}
    assert rows["t/a"]["status"] == "done" and rows["t/a"]["metrics"]["new_tokens"] == 4
    markdown = invoke("report", manifest, "--format", "markdown", *edited)
    line = next(x for x in markdown.stdout.splitlines() if x.startswith("| t/b |"))
    assert "| changed |" in line and "| 4 |" not in line   # the stale new_tokens=4 is not shown as current
    assert states_with(manifest, edited)["t/b"] == "changed"


def states_with(manifest, extra) -> dict:
    return {row["run"]: row["state"] for row in json.loads(invoke("status", manifest, "--json", *extra).stdout)}


def test_pivot_keeps_two_sweeps_with_the_same_params_apart(tmp_path, monkeypatch, tiny_model):  # noqa: F811
    from conftest import write_manifest

    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "runs"))
    sweep = """\
- id: {name}
  mode: generate
  generate: {{prompts: ["hi"], max_new_tokens: {n}, temperature: 0.0, stream: false}}
  matrix: {{seed: [0, 1]}}
"""
    manifest = write_manifest(tmp_path / "m.yaml", sweep.format(name="short", n=2) + sweep.format(name="long", n=5),
                              model=str(tiny_model), name="two")
    assert invoke("run", manifest).exit_code == 0
    rows = json.loads(invoke("report", manifest, "--json", "--pivot", "seed", "--metric", "new_tokens").stdout)
    assert rows == [{"runs": "t/short", "new_tokens @ seed=0": 2, "new_tokens @ seed=1": 2},
                    {"runs": "t/long", "new_tokens @ seed=0": 5, "new_tokens @ seed=1": 5}]


@pytest.mark.parametrize("option", ["--csv", "--plot"])
def test_report_output_into_a_missing_directory_exits_2_naming_it(world, option):
    manifest, records, outside = world
    assert invoke("run", manifest).exit_code == 0
    target = outside / "no-such-dir" / "out.csv"
    r = invoke("report", manifest, option, target)
    assert r.exit_code == 2 and str(target) in flat(r.output) and ".tmp" not in r.output, r.output
    assert not (outside / "no-such-dir").exists()


# ---- the filesystem fails -----------------------------------------------------------------------

def test_runs_dir_naming_a_file_exits_2_with_the_path(world, monkeypatch):
    manifest, records, outside = world
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(outside / "canary.txt"))
    for command in (["run", manifest], ["run", manifest, "--jobs", "2"]):
        r = invoke(*command)
        assert r.exit_code == 2 and "Traceback" not in r.output, r.output
        assert f"{outside / 'canary.txt'} is a file, not a directory" in flat(r.output)
    assert (outside / "canary.txt").read_bytes() == CANARY


def _mount(*args: str) -> tuple[bool, str]:
    try:
        done = subprocess.run(["mount", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return False, str(e)
    return done.returncode == 0, done.stderr.strip()


@pytest.fixture
def tmpfs(tmp_path):
    """A factory: tmpfs(size, ro=False) -> a fresh tmpfs mount point, unmounted afterwards; the
    test is skipped (with the reason) where this process may not mount (not root, no
    CAP_SYS_ADMIN, no mount binary). Root ignores chmod, so a read-only or full directory must
    be a real mount to mean anything here."""
    mounted: list[Path] = []

    def make_tmpfs(size: str, ro: bool = False) -> Path:
        point = tmp_path / f"mnt-{uuid.uuid4().hex[:8]}"
        point.mkdir()
        ok, why = _mount("-t", "tmpfs", "-o", f"size={size}" + (",ro" if ro else ""), "tmpfs", str(point))
        if not ok:
            pytest.skip(f"cannot mount a tmpfs here ({why or 'mount failed'}): needs root or CAP_SYS_ADMIN")
        mounted.append(point)
        return point

    yield make_tmpfs
    for point in reversed(mounted):
        subprocess.run(["umount", "-l", str(point)], capture_output=True, timeout=30)


def test_a_read_only_runs_dir_exits_2_before_anything(world, monkeypatch, tmpfs):
    manifest, records, outside = world
    point = tmpfs("1m", ro=True)
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(point / "runs"))
    r = invoke("run", manifest)
    assert r.exit_code == 2 and "read-only filesystem" in flat(r.output) and str(point) in flat(r.output), r.output


def test_a_runs_dir_without_room_exits_2_before_anything(world, monkeypatch, tmpfs):
    manifest, records, outside = world
    point = tmpfs("32k")   # three records need about 3 x 17 KiB
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(point))
    r = invoke("run", manifest)
    assert r.exit_code == 2 and "free" in r.output and "CARAMBA_RUNS_DIR" in r.output, r.output
    assert list(point.iterdir()) == []


def test_a_disk_that_fills_mid_run_fails_that_run_by_path_and_the_others_go_on(world, monkeypatch, tmpfs):
    manifest, records, outside = world
    point = tmpfs("1m")
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(point / "runs"))
    real = runners.MODE_RUNNERS["generate"]

    def fills_the_disk(loaded, settings, seed, record, console):
        result = real(loaded, settings, seed, record, console)
        if record.final.name == "b":   # another process fills the disk while b runs
            filler = point / "filler"
            with open(filler, "wb") as file:
                try:
                    while True:
                        file.write(b"\0" * 65536)
                except OSError:
                    pass
            result["pad"] = "x" * 200_000   # more than is left: result.json cannot be written
        return result

    real_write = runners.RunDir.write_json

    def write_then_free(self, name, obj):
        try:
            return real_write(self, name, obj)
        finally:
            if (point / "filler").exists() and name == "result.json":
                (point / "filler").unlink()   # the disk has room again for the other runs

    monkeypatch.setitem(runners.MODE_RUNNERS, "generate", fills_the_disk)
    monkeypatch.setattr(runners.RunDir, "write_json", write_then_free)
    r = invoke("run", manifest)
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    text = flat(r.output)
    assert "failed t/b" in text and "No space left on device" in text and "result.json" in text, text
    assert "2 done, 0 skipped, 1 failed" in text
    runs = point / "runs" / "rec" / "t"
    assert (runs / "a" / DONE).is_file() and (runs / "c" / DONE).is_file() and not (runs / "b" / DONE).exists()
    assert not list(runs.rglob("*.tmp"))   # no temp file left behind
    monkeypatch.setitem(runners.MODE_RUNNERS, "generate", real)
    again = invoke("run", manifest)
    assert again.exit_code == 0 and "1 done, 2 skipped" in again.output, again.output


def test_a_read_only_target_directory_fails_its_runs_by_path_and_the_others_go_on(tmp_path, monkeypatch, tmpfs,
                                                                                  tiny_model):  # noqa: F811
    """EROFS after preflight: the runs directory is writable, one target's directory is a
    read-only bind mount (root ignores chmod; a mount is what makes it read-only for root)."""
    runs = tmp_path / "runs"
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(runs))
    manifest = tmp_path / "m.yaml"
    run = '{id: r, mode: generate, generate: {prompts: ["hi"], max_new_tokens: 3, temperature: 0.0, stream: false}}'
    manifest.write_text(f"version: 1\nname: ro\ndefaults:\n  model: {{source: \"{tiny_model}\"}}\ntargets:\n"
                        f"  - {{type: experiment, name: frozen, runs: [{run}]}}\n"
                        f"  - {{type: experiment, name: open, runs: [{run}]}}\n")
    frozen = runs / "ro" / "frozen"
    frozen.mkdir(parents=True)
    tmpfs("1m")   # skips (with the reason) where this process cannot mount
    ok, why = _mount("--bind", str(frozen), str(frozen))
    assert ok, why
    try:
        ok, why = _mount("-o", "remount,bind,ro", str(frozen))
        assert ok, why
        r = invoke("run", manifest)
    finally:
        subprocess.run(["umount", str(frozen)], capture_output=True, timeout=30)
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    text = flat(r.output)
    assert "failed frozen/r" in text and "Read-only file system" in text and str(frozen) in text, text
    assert (runs / "ro" / "open" / "r" / DONE).is_file() and "1 done, 0 skipped, 1 failed" in text
    again = invoke("run", manifest)   # writable again: nothing was left that blocks the redo
    assert again.exit_code == 0 and "1 done, 1 skipped" in again.output, again.output


# ---- memory -------------------------------------------------------------------------------------

def test_a_run_too_big_for_memory_exits_2_naming_the_field(world, monkeypatch):
    manifest, records, outside = world
    r = invoke("run", manifest, "--set", "targets.t.runs.b.generate.max_seq_len=200000000")
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    text = flat(r.output)
    assert "run t/b: needs about" in text and "MemAvailable" in text and "lower generate.max_seq_len" in text
    assert not records.exists()
    monkeypatch.setattr(resources, "mem_available", lambda: 1 * 2**20)   # a machine with 1 MiB free
    r = invoke("run", manifest)
    assert r.exit_code == 2 and "run t/a: needs about" in flat(r.output), r.output


def test_the_kv_estimate_is_what_the_cache_allocates(tiny):
    from caramba.model.config import ModelConfig

    model = tiny()
    cfg: ModelConfig = model.config
    params, per_token = resources._shape_costs(cfg, "float32")
    assert params == sum(p.numel() for p in model.parameters())
    for batch, length in ((1, 16), (3, 40)):
        assert per_token * batch * length == model.new_cache(batch, length, "fp32").nbytes


def test_done_lists_the_digest_of_every_file_it_vouches_for(world):
    manifest, records, outside = world
    assert invoke("run", manifest, "--run", "a").exit_code == 0
    done = json.loads((records / "a" / DONE).read_text())
    assert set(done["files"]) == {"manifest.yaml", "env.json", "result.json"}
    for name, digest in done["files"].items():
        assert hashlib.sha256((records / "a" / name).read_bytes()).hexdigest() == digest


def test_report_of_a_records_directory_never_reads_through_a_link(world):
    manifest, records, outside = world
    assert invoke("run", manifest).exit_code == 0
    shutil.copytree(records / "b", outside / "elsewhere")   # a finished-looking record outside runs/
    shutil.rmtree(records / "b")
    (records / "b").symlink_to(outside / "elsewhere", target_is_directory=True)
    before = snapshot(outside)
    rows = {r["run"]: r for r in json.loads(invoke("report", records.parent, "--json").stdout)}
    assert rows["t/b"]["status"] == "blocked" and rows["t/b"]["metrics"] == {} and rows["t/b"]["mode"] is None
    assert rows["t/a"]["status"] == "done" and rows["t/a"]["metrics"]
    assert snapshot(outside) == before


def test_a_run_killed_before_its_swap_is_failed_in_status_and_both_reports(world):
    manifest, records, outside = world
    assert invoke("run", manifest, "--run", "a").exit_code == 0
    attempt = RunDir("rec", "t", "b")
    attempt.begin()   # the worker starts b ...
    attempt.log("loading model")
    attempt.release()   # ... and is killed: no swap, only .b.partial is left
    assert states(manifest) == {"t/a": "done", "t/b": "failed", "t/c": "pending"}
    for source in (manifest, records.parent):
        rows = {r["run"]: r["status"] for r in json.loads(invoke("report", source, "--json").stdout)}
        assert rows["t/b"] == "failed" and rows["t/a"] == "done", rows


def test_a_speculative_runs_draft_model_counts_in_its_memory(tiny_model):  # noqa: F811
    from caramba.manifest import parse_manifest
    from caramba.model.zoo import inspect_source

    text = f"""\
version: 1
name: m
defaults:
  model: {{source: "{tiny_model}"}}
targets:
  - type: experiment
    name: t
    runs:
      - id: plain
        mode: speculative
        speculative: {{prompts: ["hi"], max_new_tokens: 4, draft: prompt_lookup, max_seq_len: 64}}
      - id: drafted
        mode: speculative
        draft: {{source: "{tiny_model}"}}
        speculative: {{prompts: ["hi"], max_new_tokens: 4, draft: model, max_seq_len: 64}}
"""
    plain, drafted = parse_manifest(text, "m.yaml").iter_runs()
    configs = {str(tiny_model): inspect_source(str(tiny_model))}
    a, b = resources.run_memory(plain, configs), resources.run_memory(drafted, configs)
    assert b["weights"][0] == 2 * a["weights"][0] and b["KV cache"][0] == 2 * a["KV cache"][0]
