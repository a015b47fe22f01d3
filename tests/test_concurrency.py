"""Two real `caramba run` processes on one manifest: each run is done once, by one of them; the
other skips it (in progress, or already done); every record is complete; nothing crashes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import write_manifest
from test_cli import tiny_model  # noqa: F401  (fixture)

from caramba.runs import DONE, RunDir

ROOT = Path(__file__).resolve().parent.parent
RUN_IDS = ["r0", "r1", "r2", "r3", "r4", "r5"]
FILES = {"manifest.yaml", "env.json", "result.json", "log.txt", DONE}


def manifest_with_runs(path: Path, model: Path) -> Path:
    runs = "".join(f"- id: {i}\n  mode: generate\n  seed: {n}\n  generate: {{prompts: [\"prompt {n}\", \"another one\"], "
                   f"max_new_tokens: 32, temperature: 0.0, stream: false}}\n" for n, i in enumerate(RUN_IDS))
    return write_manifest(path, runs, model=str(model), name="conc")


def start(manifest: Path, runs_dir: Path) -> subprocess.Popen:
    env = {**os.environ, "CARAMBA_RUNS_DIR": str(runs_dir), "PYTHONPATH": str(ROOT), "COLUMNS": "400",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "caramba.cli", "run", str(manifest)], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_two_processes_do_each_run_once(tmp_path, tiny_model):  # noqa: F811
    manifest = manifest_with_runs(tmp_path / "m.yaml", tiny_model)
    procs = [start(manifest, tmp_path / "runs") for _ in range(2)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out
        assert "Traceback" not in out and "error" not in out.lower(), out
    both = "\n".join(outputs)
    records = tmp_path / "runs" / "conc" / "t"
    for run_id in RUN_IDS:
        # done by exactly one process; the other skipped it, as in progress or as already done
        assert both.count(f"done t/{run_id} ") == 1, both
        assert sum(f"skip t/{run_id}:" in out for out in outputs) == 1, both
        assert {p.name for p in (records / run_id).iterdir()} == FILES
        log = (records / run_id / "log.txt").read_text()
        assert log.count(f"run t/{run_id} mode=generate") == 1, log   # one writer: no interleaved attempts
        result = json.loads((records / run_id / "result.json").read_text())
        assert len(result["prompts"]) == 2 and result["output_sha256"]
    assert sorted(p.name for p in records.iterdir() if p.name.startswith(".") and not p.name.endswith(".lock")) == []


def test_a_run_held_by_another_process_is_skipped_and_said(tmp_path, tiny_model):  # noqa: F811
    manifest = manifest_with_runs(tmp_path / "m.yaml", tiny_model)
    holder = RunDir("conc", "t", "r2", root=tmp_path / "runs")
    assert holder.try_lock()   # this process stands in for a `caramba run` busy with r2
    try:
        proc = start(manifest, tmp_path / "runs")
        out = proc.communicate(timeout=600)[0]
    finally:
        holder.release()
    assert proc.returncode == 0, out
    assert f"skip t/r2: another process (pid {os.getpid()}) is running it" in out
    assert "5 done, 0 skipped, 1 left to another process running them, 0 failed" in out
    assert not (tmp_path / "runs" / "conc" / "t" / "r2").exists()
