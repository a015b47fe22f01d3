"""A run that another process is doing now is `running` in `caramba report` as in `caramba
status` (issue 46): its lock is held by a live process, so its record-in-progress (a staging
directory, or an older attempt's record without DONE) is no failure. The status of a record is
one function (caramba.runs.record_status), which asks the lock."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from typer.testing import CliRunner

from caramba.cli import app
from caramba.runs import RunDir, record_status
from conftest import write_manifest

RUNS = """\
- id: now
  mode: generate
  generate: {prompts: ["hello"], max_new_tokens: 2}
- id: again
  mode: generate
  generate: {prompts: ["hello"], max_new_tokens: 2}
"""


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def report_states(source) -> dict[str, str]:
    r = invoke("report", source, "--json")
    assert r.exit_code == 0, r.output
    return {row["run"]: row["status"] for row in json.loads(r.stdout)}


def status_states(manifest) -> dict[str, str]:
    r = invoke("status", manifest, "--json")
    assert r.exit_code == 0, r.output
    return {row["run"]: row["state"] for row in json.loads(r.stdout)}


def test_report_shows_runs_in_progress_as_running(tmp_path, monkeypatch):
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "runs"))
    manifest = write_manifest(tmp_path / "m.yaml", RUNS, name="live")
    failed = RunDir("live", "t", "again")   # an older attempt that failed: a record without DONE
    failed.begin()
    failed.log("FAILED: the first attempt")
    failed.abandon()
    failed.release()
    assert report_states(manifest) == {"t/now": "pending", "t/again": "failed"}

    now, again = RunDir("live", "t", "now"), RunDir("live", "t", "again")
    now.begin()       # this process is a worker inside both runs: their locks are held, their
    again.begin()     # records are being built aside
    now.log("step 1")
    try:
        assert status_states(manifest) == {"t/now": "running", "t/again": "running"}
        assert report_states(manifest) == {"t/now": "running", "t/again": "running"}
        assert report_states(tmp_path / "runs" / "live") == {"t/now": "running", "t/again": "running"}
        row = json.loads(invoke("report", manifest, "--json").stdout)[0]
        assert row["detail"] == f"pid {os.getpid()}" and row["metrics"] == {}
    finally:
        now.release()
        again.release()
    # the worker is gone: what it left is an attempt that died, a record without DONE
    assert report_states(manifest) == {"t/now": "failed", "t/again": "failed"}


def test_a_lock_held_by_another_live_process_is_running(tmp_path):
    """A subprocess holds the lock (flock) while the test reads the record."""
    record = RunDir("m", "t", "r", root=tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys\nfrom caramba.runs import RunDir\n"
         f"r = RunDir('m', 't', 'r', root={str(tmp_path)!r})\nr.begin()\nprint('held', flush=True)\nsys.stdin.read()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        status = record_status(record.final)
        assert (status.state, status.detail) == ("running", f"pid {holder.pid}")
        assert record.status().state == "failed"   # the record itself, as the lock's holder sees it
    finally:
        holder.stdin.close()
        holder.wait(30)
    assert record_status(record.final).state == "failed"
