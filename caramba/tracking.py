"""The runs a `caramba run` finished, logged to an experiment tracker besides their records: MLflow
(pip extra 'tracking': mlflow-skinny and the SQL store it needs) or Weights & Biases (offline
run files by default). A manifest's `tracking:` or `--track mlflow|wandb` turns it on.

Each run gets its resolved settings as params, its summary's numbers as metrics, its run hash,
env and mode as tags, and its record directory as artifacts; an eval run also gets its
quality-cost frontier, once, as a table (frontier.csv; a W&B Table) and a plot (frontier.png,
where matplotlib is installed). Runs of a sweep (a manifest with a
matrix) are grouped: one MLflow parent run per `caramba run`, or a W&B group, named after the
manifest. Everything is read from the finished records, in the driver, after the runs: workers on
Ray or Slurm need no tracker, and a tracker's failure (not installed, a bad URI, a server down)
fails nothing; `log_runs` returns it as one line for the caller to warn with.

The tracker packages are imported here, on use only: `caramba --help` never loads them.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from caramba.bench.frontier import frontier_rows, plot_frontier
from caramba.bench.report import pyplot, write_csv
from caramba.manifest.schema import TrackingSettings, section_for

EXTRA = "pip install 'caramba[tracking]'"
PARAM_CHARS = 500   # MLflow's oldest stores cap a param's value here; a longer one is cut, marked


@dataclass(frozen=True)
class Finished:
    """A run to log: its name (target/id), record directory, mode and resolved settings."""

    name: str
    record: Path
    mode: str
    settings: dict[str, Any]
    swept: bool   # made by a matrix


def settings_of(resolved) -> dict[str, Any]:
    """A ResolvedRun's settings as its record states them: mode, seed, its section, model, draft."""
    run = resolved.run
    out = {"mode": run.mode, "seed": run.seed, section_for(run.mode): run.settings.model_dump(mode="json"),
           "model": resolved.model.model_dump(mode="json")}
    if resolved.draft is not None:
        out["draft"] = resolved.draft.model_dump(mode="json")
    return out


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}; lists stay whole."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def metrics_of(summary: dict[str, Any]) -> dict[str, float]:
    """The summary's numbers (bools and None left out), flattened, with keys MLflow accepts."""
    return {_key(k): float(v) for k, v in flatten(summary).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _key(name: str) -> str:
    return re.sub(r"[^\w\-. /]", "_", name)


def _text(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= PARAM_CHARS else text[:PARAM_CHARS - 1] + "…"


def _cell(value: Any) -> Any:
    """A frontier value as a W&B Table cell: numbers, text and None as they are, anything else as JSON."""
    return value if value is None or isinstance(value, (int, float, str)) else json.dumps(value)


def _read(record: Path) -> tuple[dict, dict]:
    return (json.loads((record / "result.json").read_text()), json.loads((record / "env.json").read_text()))


def _tags(run: Finished, manifest: str, result: dict, env: dict) -> dict[str, str]:
    tags = {"caramba.manifest": manifest, "caramba.run": run.name, "caramba.mode": run.mode,
            "caramba.run_hash": str(result.get("run_hash")), "caramba.record": str(run.record)}
    for key, value in flatten({k: v for k, v in env.items() if k not in ("params", "libraries")}).items():
        tags[_key(f"caramba.env.{key}")] = _text(value)
    return tags


def frontier_files(run: Finished, where: Path) -> tuple[list[dict], list[Path]]:
    """An eval run's frontier rows, written under `where` as frontier.csv and frontier.png (the plot
    only where matplotlib is installed and the candidates share a quality metric); other modes: none."""
    if run.mode != "eval":
        return [], []
    rows = frontier_rows([(run.name, run.record)])
    if not rows:
        return [], []
    write_csv(where / "frontier.csv", rows)
    files = [where / "frontier.csv"]
    if pyplot(required=False) is not None:
        try:
            files.append(plot_frontier(where / "frontier.png", rows))
        except ValueError:   # no quality metric every candidate has: the table alone says what there is
            pass
    return rows, files


def log_runs(settings: TrackingSettings, manifest: str, runs: list[Finished], root: Path) -> str | None:
    """Log `runs` (finished records under the runs root `root`) to the tracker; None when done,
    else why not, as a line (nothing raised: the records are complete either way)."""
    if not runs:
        return None
    try:
        (_mlflow if settings.backend == "mlflow" else _wandb)(settings, manifest, runs, root)
    except ImportError as e:
        return f"{settings.backend} is not installed ({e.name or e}): {EXTRA}"
    except Exception as e:   # a bad URI, a server down, a full disk: the tracker's failure, not the runs'
        line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"{type(e).__name__}: {line}"
    return None


def mlflow_uri(settings: TrackingSettings, root: Path) -> str:
    """The manifest's URI, else $MLFLOW_TRACKING_URI, else a SQLite store in mlruns/ beside the
    runs root (MLflow 3 keeps its plain-file store in maintenance only)."""
    if settings.uri:
        return settings.uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{(root.absolute().parent / 'mlruns' / 'mlflow.db')}"


def _mlflow(settings: TrackingSettings, manifest: str, runs: list[Finished], root: Path) -> None:
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    logging.getLogger("mlflow").setLevel(logging.WARNING)   # its store's set-up chatter is not caramba's news
    # a server that is down: MLflow retries 7 times with backoff (4 minutes) unless told otherwise
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    uri = mlflow_uri(settings, root)
    if uri.startswith("sqlite:///"):
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    client = MlflowClient(uri)
    name = settings.experiment or manifest
    found = client.get_experiment_by_name(name)
    if found is not None:
        experiment = found.experiment_id
    else:   # the default store keeps its artifacts beside it, not in the working directory
        where = Path(uri.removeprefix("sqlite:///")).parent / "artifacts" if uri.startswith("sqlite:///") else None
        experiment = client.create_experiment(name, artifact_location=where.as_uri() if where else None)
    parent = None
    if any(run.swept for run in runs):
        parent = client.create_run(experiment, run_name=manifest, tags={"caramba.manifest": manifest,
                                                                       "caramba.sweep": "true"}).info.run_id
    now = int(time.time() * 1000)
    for run in runs:
        result, env = _read(run.record)
        tags = _tags(run, manifest, result, env) | ({"mlflow.parentRunId": parent} if parent else {})
        run_id = client.create_run(experiment, run_name=run.name, tags=tags).info.run_id
        params = [Param(_key(k), _text(v)) for k, v in flatten(run.settings).items()]
        metrics = [Metric(k, v, now, 0) for k, v in metrics_of(result.get("summary") or {}).items()]
        for i in range(0, max(len(params), len(metrics)), 100):   # log_batch takes 100 params at a time
            client.log_batch(run_id, metrics=metrics[i:i + 100], params=params[i:i + 100])
        client.log_artifacts(run_id, str(run.record), "record")
        with tempfile.TemporaryDirectory() as tmp:
            if frontier_files(run, Path(tmp))[1]:
                client.log_artifacts(run_id, tmp, "frontier")
        client.set_terminated(run_id)
    if parent:
        client.set_terminated(parent)


def _wandb(settings: TrackingSettings, manifest: str, runs: list[Finished], root: Path) -> None:
    import wandb

    where = Path(settings.dir) if settings.dir else root.absolute().parent
    where.mkdir(parents=True, exist_ok=True)
    group = manifest if any(run.swept for run in runs) else None
    quiet = wandb.Settings(console="off", silent=True, x_disable_stats=True, save_code=False)
    try:
        _wandb_runs(wandb, settings, manifest, runs, where, group, quiet)
    finally:
        wandb.teardown()   # waits for W&B's service to write every run's file (it writes them asynchronously)


def _wandb_runs(wandb, settings: TrackingSettings, manifest: str, runs: list[Finished], where: Path,
                group: str | None, quiet) -> None:
    for run in runs:
        result, env = _read(run.record)
        with wandb.init(project=settings.experiment or manifest, group=group, name=run.name, job_type=run.mode,
                        config={**flatten(run.settings), "caramba": _tags(run, manifest, result, env)}, dir=str(where),
                        mode="offline" if settings.offline else "online", reinit="create_new", settings=quiet) as tracked:
            tracked.summary.update(metrics_of(result.get("summary") or {}))
            record = wandb.Artifact(re.sub(r"[^\w\-.]", "_", f"{manifest}-{run.name}")[:128], type="caramba-record")
            record.add_dir(str(run.record))
            tracked.log_artifact(record)
            with tempfile.TemporaryDirectory() as tmp:
                rows, files = frontier_files(run, Path(tmp))
                if rows:
                    columns = list(dict.fromkeys(k for row in rows for k in row))
                    table = wandb.Table(columns=columns, data=[[_cell(row.get(c)) for c in columns] for row in rows])
                    plots = {"frontier_plot": wandb.Image(str(f)) for f in files if f.suffix == ".png"}
                    tracked.log({"frontier": table, **plots})
