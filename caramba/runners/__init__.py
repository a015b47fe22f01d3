"""Run a validated manifest: one record per run under runs/, one small module per mode."""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from rich.console import Console

from caramba.errors import RunError, UserError
from caramba.expect import check as check_expect
from caramba.expect import output_sha256
from caramba.manifest import Manifest, ModelSpec, ResolvedRun, resolved_manifest_yaml
from caramba.model.zoo import LoadedModel, load_model, resolve_device, resolve_source
from caramba.runners.autotune import run_cache_autotune
from caramba.runners.decode_bench import run_decode_bench
from caramba.runners.generate import run_generate
from caramba.runners.speculative import run_speculative
from caramba.runs import RunDir, capture_env

# mode -> runner(loaded model, the mode's settings, seed, record, console) -> result dict
MODE_RUNNERS: dict[str, Callable] = {"generate": run_generate, "decode-bench": run_decode_bench,
                                     "speculative": run_speculative, "cache-autotune": run_cache_autotune}  # speculative also takes draft=LoadedModel


@dataclass
class Outcome:
    done: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    check_failed: list[str] = field(default_factory=list)


def select_runs(manifest: Manifest, only: list[str]) -> list[ResolvedRun]:
    """All runs, or those named by `--run ID` (a run id, or target/run id)."""
    runs = list(manifest.iter_runs())
    if not only:
        return runs
    chosen = [r for r in runs if r.run.id in only or f"{r.target}/{r.run.id}" in only]
    known = {r.run.id for r in runs} | {f"{r.target}/{r.run.id}" for r in runs}
    unknown = [name for name in only if name not in known]
    if unknown:
        raise UserError(f"--run {', '.join(unknown)}: no such run; runs in this manifest: "
                        + ", ".join(f"{r.target}/{r.run.id}" for r in runs))
    return chosen


def run_manifest(manifest: Manifest, only: list[str], force: bool, dry_run: bool, console: Console,
                 check: bool = False) -> Outcome:
    """Run the selected runs (skipping DONE ones unless force); with check, compare each finished
    run's result with its `expect:` block."""
    runs = select_runs(manifest, only)
    for r in runs:  # check every model source before any record is written
        for spec in (r.model, r.draft):
            if spec is not None:
                resolve_source(spec.source)
                resolve_device(spec.device)
    outcome = Outcome()
    models: dict[tuple, LoadedModel] = {}
    resolved_yaml = resolved_manifest_yaml(manifest)
    for r in runs:
        name = f"{r.target}/{r.run.id}"
        record = RunDir(manifest.name, r.target, r.run.id)
        if record.is_done() and not force:
            console.print(f"[dim]skip {name}: already done ({record.path}); --force reruns it[/dim]")
            outcome.skipped.append(name)
            if check:
                _check(r, record, outcome, console)
            continue
        if dry_run:
            console.print(f"would run {name} ({r.run.mode}) on {r.model.source} -> {record.path}")
            continue
        console.rule(f"{name} ({r.run.mode})")
        record.begin(force=force)
        try:
            _run_one(r, record, resolved_yaml, models, console)
        except UserError:
            record.discard()  # bad input found late: leave nothing half-written
            raise
        except RunError as e:
            _fail(record, name, str(e), outcome, console)
        except (KeyboardInterrupt, SystemExit):
            record.log("interrupted")
            raise
        except Exception as e:  # a failed run is reported and the manifest goes on
            record.log(traceback.format_exc())
            _fail(record, name, f"{type(e).__name__}: {e}", outcome, console)
        else:
            outcome.done.append(name)
            console.print(f"[green]done[/green] {name} -> {record.path}")
            if check:
                _check(r, record, outcome, console)
    return outcome


def _check(r: ResolvedRun, record: RunDir, outcome: Outcome, console: Console) -> None:
    name = f"{r.target}/{r.run.id}"
    result = json.loads((record.path / "result.json").read_text())
    if r.run.expect is None:
        digest = output_sha256(result)
        hint = f"; its output_sha256 is {digest}" if digest else ""
        console.print(f"[yellow]check {name}: no expect: block, nothing to compare{hint}[/yellow]")
        return
    problems = check_expect(result, r.run.expect)
    if problems:
        outcome.check_failed.append(name)
        console.print(f"[red]check failed[/red] {name} ({record.path / 'result.json'}):")
        for line in problems:
            console.print(f"  - {line}", highlight=False, soft_wrap=True)
    else:
        console.print(f"[green]check ok[/green] {name}")


def _run_one(r: ResolvedRun, record: RunDir, resolved_yaml: str, models: dict, console: Console) -> None:
    record.write_text("manifest.yaml", resolved_yaml)
    record.write_json("env.json", {**capture_env(r.run.seed, r.model.device), "run": f"{r.target}/{r.run.id}"})
    record.log(f"run {r.target}/{r.run.id} mode={r.run.mode} model={r.model.source} dtype={r.model.dtype}")
    if r.run.seed is not None:
        torch.manual_seed(r.run.seed)
    loaded = _model(r.model, models)
    record.log(f"model {loaded.path} sha256={loaded.content_hash}")
    extra = {}
    if r.draft is not None:  # a speculative run's draft model, loaded beside the target
        draft = load_model(r.draft.source, r.draft.dtype, r.draft.device)
        record.log(f"draft model {draft.path} sha256={draft.content_hash}")
        extra["draft"] = draft
    result = MODE_RUNNERS[r.run.mode](loaded, r.run.settings, r.run.seed, record, console, **extra)
    result["model"] = {**r.model.model_dump(), "path": str(loaded.path), "sha256": loaded.content_hash}
    if r.draft is not None:
        result["draft_model"] = {**r.draft.model_dump(), "path": str(extra["draft"].path), "sha256": extra["draft"].content_hash}
    record.write_json("result.json", result)
    record.finish()


def _model(spec: ModelSpec, models: dict) -> LoadedModel:
    key = (spec.source, spec.dtype, spec.device)
    if key not in models:
        models.clear()  # one model in memory at a time
        models[key] = load_model(spec.source, spec.dtype, spec.device)
    return models[key]


def _fail(record: RunDir, name: str, message: str, outcome: Outcome, console: Console) -> None:
    record.log(f"FAILED: {message}")
    console.print(f"[red]failed[/red] {name}: {message} (log: {record.path / 'log.txt'})")
    outcome.failed.append(name)
