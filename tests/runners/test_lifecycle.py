"""The one run lifecycle (caramba.runners.lifecycle): what an attempt leaves for each way it ends."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from caramba.errors import RunError, UserError
from caramba.runners.lifecycle import Attempt, locked, one_off
from caramba.runs import RecordError, RunDir


def _record(tmp_path) -> RunDir:
    return RunDir("m", "t", "r", root=tmp_path)


def test_a_finished_attempt_is_swapped_in_with_done(tmp_path):
    record = _record(tmp_path)
    with locked(record) as mine:
        assert mine
        with Attempt(record) as attempt:
            assert record.path == record.staging
            record.write_json("result.json", {"x": 1})
    assert attempt.where == record.final and record.is_done() and not record.staging.exists()
    assert json.loads((record.final / "DONE").read_text())["files"].keys() == {"result.json"}
    assert record._lock_fd is None   # released


@pytest.mark.parametrize("error, logged", [(RunError("disk said no"), "FAILED: disk said no"),
                                           (ValueError("bad shape"), "FAILED: ValueError: bad shape"),
                                           (KeyboardInterrupt(), "interrupted")])
def test_a_failed_attempt_leaves_its_log_without_done(tmp_path, error, logged):
    record = _record(tmp_path)
    attempt = Attempt(record)
    with pytest.raises(type(error)):
        with attempt:
            record.log("started")
            raise error
    log = (attempt.where / "log.txt").read_text()
    assert attempt.where == record.final and logged in log and "started" in log
    assert not (record.final / "DONE").exists() and record.status().state == "failed"
    assert ("Traceback" in log) == isinstance(error, ValueError)   # a RunError's message says enough


def test_a_failed_redo_keeps_the_finished_record(tmp_path):
    record = _record(tmp_path)
    with Attempt(record):
        record.write_text("result.json", "{}")
    with pytest.raises(RunError), Attempt(record) as attempt:
        raise RunError("no")
    assert attempt.where == record.staging and "FAILED: no" in (record.staging / "log.txt").read_text()
    assert record.is_done()


def test_bad_input_found_late_leaves_nothing(tmp_path):
    record = _record(tmp_path)
    with pytest.raises(UserError), Attempt(record):
        record.write_text("result.json", "{}")
        raise UserError("bad")
    assert not record.final.exists() and not record.staging.exists()


def test_a_refused_done_is_a_failure_too(tmp_path, monkeypatch):
    record = _record(tmp_path)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    with pytest.raises(OSError), Attempt(record) as attempt:
        record.write_text("result.json", "{}")
        monkeypatch.setattr("caramba.runs.atomic_write_text", full)   # DONE's write
    assert "FAILED: OSError" in (attempt.where / "log.txt").read_text() and not (record.final / "DONE").exists()


def test_one_off_records_take_fresh_names(tmp_path, monkeypatch):
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path))
    first = one_off("bench", "cli", "stamp", lambda r: r.write_text("result.json", "{}"))
    second = one_off("bench", "cli", "stamp", lambda r: r.write_text("result.json", "{}"))
    assert (first.final.name, second.final.name) == ("stamp", "stamp-2")
    assert first.is_done() and second.is_done() and first._lock_fd is None and second._lock_fd is None


def test_an_interrupt_as_the_attempt_begins_still_leaves_its_log(tmp_path, monkeypatch):
    """Ctrl-C landing just after begin() made the attempt's directory, before the `with` block was
    entered: the attempt was left without its `interrupted` log (a flaky sweep test caught it)."""
    record = _record(tmp_path)
    begin = RunDir.begin

    def begin_then_ctrl_c(self, force=False):
        begin(self, force)
        raise KeyboardInterrupt
    monkeypatch.setattr(RunDir, "begin", begin_then_ctrl_c)
    attempt = Attempt(record)
    assert not record.staging.exists()   # creating an attempt begins nothing
    with pytest.raises(KeyboardInterrupt), attempt:
        pass
    assert attempt.where == record.final and "interrupted" in (record.final / "log.txt").read_text()
    assert not attempt.begun and record.status().state == "failed"


def test_a_record_that_cannot_be_begun_is_no_attempt(tmp_path, monkeypatch):
    record = _record(tmp_path)
    mkdir = os.mkdir

    def full(path, *args, **kwargs):
        if Path(path) == record.staging:
            raise OSError(28, "No space left on device")
        return mkdir(path, *args, **kwargs)
    monkeypatch.setattr(os, "mkdir", full)
    attempt = Attempt(record)
    with pytest.raises(RecordError, match="cannot create"), attempt:
        pass
    assert not attempt.begun and record.path == record.final and not record.final.exists()
