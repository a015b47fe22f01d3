"""Experiment tracking (caramba.tracking), for real and offline: a tiny sweep run with `--track
mlflow` is read back with MLflow's own client from the default store beside the runs dir; with
`tracking: {backend: wandb}` from W&B's offline run files; a tracker that fails leaves the runs
done with one warning; `caramba --help` loads no tracker."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import write_manifest
from test_cli import invoke, tiny_model  # noqa: F401  (fixture)
from test_eval import SECTION, eval_manifest, long_tiny  # noqa: F401  (fixture)

RUNS = """\
- id: kv
  mode: generate
  generate: {prompts: ["hello"], max_new_tokens: 3}
  matrix:
    generate.cache_kind: [fp32, q8_0]
"""
NAMES = {"t/kv.cache_kind-fp32", "t/kv.cache_kind-q8_0"}


@pytest.fixture
def sweep(tmp_path, monkeypatch, tiny_model):  # noqa: F811
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return write_manifest(tmp_path / "m.yaml", RUNS, model=str(tiny_model), name="sw")


def result_of(tmp_path: Path, name: str) -> dict:
    return json.loads((tmp_path / "runs" / "sw" / name / "result.json").read_text())


def test_a_sweep_tracked_in_mlflow_reads_back_with_mlflows_client(sweep, tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    r = invoke("run", sweep, "--track", "mlflow")
    assert r.exit_code == 0 and "tracked 2 run(s) in mlflow" in r.output and "warning" not in r.output, r.output
    store = tmp_path / "mlruns" / "mlflow.db"   # the default: beside the runs dir
    client = MlflowClient(f"sqlite:///{store}")
    experiment = client.get_experiment_by_name("sw")
    found = {run.info.run_name: run for run in client.search_runs([experiment.experiment_id])}
    assert set(found) == NAMES | {"sw"}
    parent = found["sw"].info.run_id   # the sweep's parent run
    for name in NAMES:
        run, result = found[name], result_of(tmp_path, name)
        assert run.info.status == "FINISHED" and run.data.tags["mlflow.parentRunId"] == parent
        assert run.data.params["generate.cache_kind"] == name.rsplit("-", 1)[1]
        assert run.data.params["generate.max_new_tokens"] == "3" and run.data.params["mode"] == "generate"
        assert run.data.params["model.source"] == result["model"]["source"]
        assert run.data.metrics["new_tokens"] == result["summary"]["new_tokens"] == 3
        assert run.data.metrics["decode_tok_s_median"] == pytest.approx(result["summary"]["decode_tok_s_median"])
        assert run.data.tags["caramba.run_hash"] == result["run_hash"]
        assert run.data.tags["caramba.env.decode_step"] == json.loads(
            (tmp_path / "runs" / "sw" / name / "env.json").read_text())["decode_step"]
        artifacts = {f.path for f in client.list_artifacts(run.info.run_id, "record")}
        assert {"record/result.json", "record/env.json", "record/manifest.yaml", "record/DONE"} <= artifacts


def test_a_tracker_that_fails_leaves_the_runs_done_with_one_warning(sweep, tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    sweep.write_text(sweep.read_text() + "tracking: {backend: mlflow, uri: 'http://127.0.0.1:9'}\n")  # no server
    # --track off: not even the manifest's tracker (and the kernels are built before the timing below)
    first = invoke("run", sweep, "--track", "off")
    assert first.exit_code == 0 and "2 done" in first.output and "tracked" not in first.output \
        and "warning" not in first.output, first.output
    started = time.monotonic()
    r = invoke("run", sweep, "--force")
    assert r.exit_code == 0, r.output
    assert r.output.count("warning: tracking (mlflow) failed") == 1 and "2 done" in r.output, r.output
    assert time.monotonic() - started < 60   # not MLflow's 4 minutes of retries
    for name in NAMES:
        assert (tmp_path / "runs" / "sw" / name / "DONE").is_file()
    # a URI no tracker knows: the same
    r = invoke("run", sweep, "--force", "--set", "tracking.uri=nosuchscheme://nowhere")
    assert r.exit_code == 0 and r.output.count("warning: tracking (mlflow) failed") == 1, r.output
    bad = invoke("run", sweep, "--track", "neptune")
    assert bad.exit_code == 2 and "--track neptune" in bad.output


def _wandb_records(path: Path) -> list:
    """The records of a W&B offline run file (`wandb sync` reads the same): LevelDB's log format,
    32 KiB blocks of chunks with a 7-byte header (crc, length, type), after a 7-byte file header."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, chunk, out = 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:   # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):   # a full record, or a record's last chunk
            out.append(pb.Record.FromString(chunk))
            chunk = b""
    return out


def test_a_sweep_tracked_in_wandb_offline_reads_back_from_its_run_files(sweep, tmp_path):
    pytest.importorskip("wandb")
    sweep.write_text(sweep.read_text() + f"tracking: {{backend: wandb, dir: '{tmp_path / 'wb'}'}}\n")
    r = invoke("run", sweep)
    assert r.exit_code == 0 and "tracked 2 run(s) in wandb" in r.output and "warning" not in r.output, r.output
    files = sorted((tmp_path / "wb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2
    seen = {}
    for path in files:
        records = _wandb_records(path)
        (run,) = [rec.run for rec in records if rec.WhichOneof("record_type") == "run"]
        config = {item.key: json.loads(item.value_json) for item in run.config.update}
        summary = {item.key: json.loads(item.value_json) for rec in records
                   if rec.WhichOneof("record_type") == "summary" for item in rec.summary.update if item.key}
        artifacts = [rec.artifact for rec in records if rec.WhichOneof("record_type") == "artifact"]
        seen[run.display_name] = (run, config, summary, artifacts)
    assert set(seen) == NAMES
    for name, (run, config, summary, artifacts) in seen.items():
        result = result_of(tmp_path, name)
        assert run.project == "sw" and run.run_group == "sw"   # the sweep's group
        assert config["generate.cache_kind"] == name.rsplit("-", 1)[1] and config["mode"] == "generate"
        assert config["caramba"]["caramba.run_hash"] == result["run_hash"]
        assert summary["new_tokens"] == 3
        assert summary["decode_tok_s_median"] == pytest.approx(result["summary"]["decode_tok_s_median"])
        (artifact,) = artifacts
        assert artifact.type == "caramba-record"
        assert {"result.json", "env.json", "manifest.yaml"} <= {c.path for c in artifact.manifest.contents}


def test_the_cli_loads_no_tracker_until_asked():
    code = "import sys; from caramba.cli import app; print(sorted(m for m in ('mlflow', 'wandb') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_an_eval_runs_frontier_is_logged_once_as_a_table_and_a_plot(tmp_path, monkeypatch, long_tiny):  # noqa: F811
    """The frontier `caramba report` draws for an eval record, logged with the run: MLflow gets
    frontier.csv (the report's rows) and frontier.png; W&B offline gets one Table in the run's history."""
    pytest.importorskip("mlflow")
    pytest.importorskip("matplotlib")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    manifest = eval_manifest(tmp_path, long_tiny, SECTION)
    r = invoke("run", manifest, "--track", "mlflow")
    assert r.exit_code == 0 and "tracked 1 run(s) in mlflow" in r.output and "warning" not in r.output, r.output
    report = invoke("report", manifest, "--format", "json")
    assert report.exit_code == 0, report.output
    front = json.loads(report.output)["frontier"]
    assert len(front) == 3 and "fp32" in {row["cache"] for row in front}   # the baseline and both candidates
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("ev").experiment_id])
    assert {f.path for f in client.list_artifacts(run.info.run_id, "frontier")} == \
        {"frontier/frontier.csv", "frontier/frontier.png"}
    table = Path(client.download_artifacts(run.info.run_id, "frontier/frontier.csv", str(tmp_path / "dl")))
    import csv

    logged = list(csv.DictReader(table.open()))
    assert [(row["run"], row["cache"], float(row["bytes_per_token"])) for row in logged] == \
        [(row["run"], row["cache"], float(row["bytes_per_token"])) for row in front]

    pytest.importorskip("wandb")
    manifest.write_text(manifest.read_text() + f"tracking: {{backend: wandb, dir: '{tmp_path / 'wb'}'}}\n")
    r = invoke("run", manifest, "--force")   # done runs are skipped, and skipped runs are not logged again
    assert r.exit_code == 0 and "tracked 1 run(s) in wandb" in r.output and "warning" not in r.output, r.output
    (media,) = (tmp_path / "wb" / "wandb").glob("offline-run-*/files/media")
    (table_file,) = media.glob("table/frontier_*.table.json")
    (plot_file,) = media.glob("images/frontier_plot_*.png")
    table = json.loads(table_file.read_text())
    rows = [dict(zip(table["columns"], row)) for row in table["data"]]
    assert [(row["cache"], row["bytes_per_token"]) for row in rows] == [(row["cache"], row["bytes_per_token"]) for row in front]
    assert plot_file.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
