"""Run records: atomic writes, the DONE marker, skip/force, logs and environment capture."""

from __future__ import annotations

import json
import os

import pytest

import caramba
from caramba import runs
from caramba.errors import RunError
from caramba.runs import RunDir, atomic_write_json, atomic_write_text, capture_env, runs_root


def test_atomic_write_replaces_and_leaves_no_temp_files(tmp_path):
    target = tmp_path / "result.json"
    atomic_write_json(target, {"a": 1})
    atomic_write_json(target, {"a": 2, "text": "é"})
    assert json.loads(target.read_text(encoding="utf-8")) == {"a": 2, "text": "é"}
    assert os.listdir(tmp_path) == ["result.json"]


def test_failed_write_keeps_old_file_and_no_temp(tmp_path, monkeypatch):
    target = tmp_path / "log.json"
    atomic_write_text(target, "old\n")

    def crash(fd):  # fail after the new text is written to the temp file, before the rename
        raise KeyboardInterrupt

    monkeypatch.setattr(runs.os, "fsync", crash)
    with pytest.raises(KeyboardInterrupt):
        atomic_write_text(target, "new and much longer text\n")
    assert target.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["log.json"]


def test_unserialisable_json_touches_nothing(tmp_path):
    with pytest.raises(TypeError):
        atomic_write_json(tmp_path / "result.json", {"bad": object()})
    assert os.listdir(tmp_path) == []


def test_runs_root_argument_env_default(tmp_path, monkeypatch):
    monkeypatch.delenv("CARAMBA_RUNS_DIR", raising=False)
    assert str(runs_root()) == "runs"
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "env"))
    assert runs_root() == tmp_path / "env"
    assert runs_root(tmp_path / "arg") == tmp_path / "arg"
    assert RunDir("quickstart", "hello", "greedy").path == tmp_path / "env" / "quickstart" / "hello" / "greedy"


def test_done_is_written_last(tmp_path, monkeypatch):
    renamed = []
    real_replace = os.replace

    def recording_replace(src, dst):
        renamed.append(os.path.basename(dst))
        real_replace(src, dst)

    monkeypatch.setattr(runs.os, "replace", recording_replace)
    run = RunDir("m", "t", "r", root=tmp_path)
    run.begin()
    run.write_text("manifest.yaml", "version: 1\n")
    run.write_json("env.json", {"seed": 0})
    run.write_json("result.json", {"tokens": [1, 2]})
    assert not run.is_done()
    run.finish()
    assert renamed == ["manifest.yaml", "env.json", "result.json", "DONE"]
    assert run.is_done()
    done = json.loads((run.path / "DONE").read_text())
    assert done["finished_utc"].endswith("+00:00")
    import hashlib

    assert done["files"] == {name: hashlib.sha256((run.path / name).read_bytes()).hexdigest()
                             for name in ("manifest.yaml", "env.json", "result.json")}


def test_crash_before_finish_leaves_an_incomplete_run_that_is_redone(tmp_path):
    run = RunDir("m", "t", "r", root=tmp_path)
    run.begin()
    run.write_json("result.json", {"partial": True})
    # ... the process dies here: no finish(), so no DONE.
    assert not run.is_done()
    run.begin()  # a rerun clears the leftovers without needing force
    assert list(run.path.iterdir()) == []


def test_done_run_needs_force(tmp_path):
    run = RunDir("m", "t", "r", root=tmp_path)
    run.begin()
    run.write_json("result.json", {"v": 1})
    run.finish()
    with pytest.raises(RunError, match="--force"):
        run.begin()
    assert run.is_done()  # the refused begin left the record intact
    run.begin(force=True)
    assert run.is_done()  # forced: the new record is built aside, the finished one stays until it is complete
    assert list(run.path.iterdir()) == [] and run.path != run.final
    assert json.loads((run.final / "result.json").read_text()) == {"v": 1}
    run.write_json("result.json", {"v": 2})
    run.finish()
    assert run.path == run.final and json.loads((run.final / "result.json").read_text()) == {"v": 2}
    assert sorted(p.name for p in run.final.parent.iterdir()) == [".r.lock", "r"]  # no staging or old copy left


def test_log_appends_timestamped_lines(tmp_path):
    run = RunDir("m", "t", "r", root=tmp_path)
    run.begin()
    run.log("loading model")
    run.log("token 1\ntoken 2")
    lines = (run.path / "log.txt").read_text().splitlines()
    assert [line.split(" ", 1)[1] for line in lines] == ["loading model", "token 1", "token 2"]
    assert all(line.split(" ", 1)[0].endswith("+00:00") for line in lines)


@pytest.mark.parametrize("bad", ["", ".", "..", "a/b"])
def test_run_dir_rejects_unsafe_names(tmp_path, bad):
    with pytest.raises(ValueError):
        RunDir("m", "t", bad, root=tmp_path)


def test_capture_env_keys_and_json(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not a git repository: git state is None, not an error
    env = capture_env(seed=3, device="cpu")
    expected = {
        "timestamp_utc", "caramba_version", "python", "platform", "machine", "cpu_model", "logical_cores",
        "load_average", "seed", "device", "git", "torch_version", "torch_threads", "cuda_version", "gpu",
        "kernel_isa", "decode_step", "heap",
    }  # fmt: skip
    assert expected <= env.keys()
    assert env["kernel_isa"] in ("scalar", "avx2", "avxvnni", "avx512", "avx512vnni") or env["kernel_isa"].startswith("eager")
    assert env["decode_step"] == "c" or env["decode_step"].startswith(("off", "unavailable"))
    # a CPU run's record says what was done to malloc's thresholds (caramba.model.heap)
    assert env["heap"].startswith(("glibc: mmap threshold", "off", "left alone")), env["heap"]
    # every C library's status, by what it runs (an install without kernels must show in the record)
    assert set(env["kernels"]) == {"decode_step", "quant_weights", "quant_prefill", "kv_attention", "decode_ops"}
    assert env["kernels"]["decode_step"] == env["decode_step"]
    # each loaded library says where it came from: this tree's run-time build, or an install's prebuilt variant
    loaded = {name for name, status in env["kernels"].items() if status == "c"}
    assert loaded and len(env["kernel_builds"]) >= len(loaded - {"decode_ops"})
    assert all(o == "built here" or o.startswith("prebuilt ") for o in env["kernel_builds"].values()), env["kernel_builds"]
    assert all(s == "c" or s.startswith(("off", "unavailable")) for s in env["kernels"].values()), env["kernels"]
    assert env["caramba_version"] == caramba.__version__
    assert env["seed"] == 3
    assert env["git"] is None
    assert json.loads(json.dumps(env)) == env


def test_capture_env_git_state(tmp_path, monkeypatch):
    def fake_git(*args):
        return {"rev-parse": "abc123", "status": " M caramba/runs.py"}[args[0]]

    monkeypatch.setattr(runs, "_git", fake_git)
    assert capture_env(seed=None, device="cpu")["git"] == {"sha": "abc123", "dirty": True}
