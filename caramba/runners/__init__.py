"""Run a validated manifest: one record per run under runs/, one small module per mode."""

from __future__ import annotations

import json
import shlex
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from rich.console import Console
from rich.markup import escape

import caramba
from caramba.errors import RunError, UserError
from caramba.expect import check as check_expect
from caramba.expect import output_sha256
from caramba.manifest import Manifest, ModelSpec, ResolvedRun, resolved_manifest_yaml
from caramba.model.zoo import LoadedModel, load_model
from caramba.runners.autotune import run_cache_autotune
from caramba.runners.decode_bench import run_decode_bench
from caramba.runners.generate import run_generate
from caramba.runners.preflight import preflight
from caramba.runners.speculative import run_speculative
from caramba.runs import RunDir, capture_env, library_versions, run_hash

# mode -> runner(loaded model, the mode's settings, seed, record, console) -> result dict
MODE_RUNNERS: dict[str, Callable] = {"generate": run_generate, "decode-bench": run_decode_bench,
                                     "speculative": run_speculative, "cache-autotune": run_cache_autotune}  # speculative also takes draft=LoadedModel


@dataclass
class Outcome:
    done: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    check_failed: list[str] = field(default_factory=list)
    busy: list[str] = field(default_factory=list)   # being run by another process: left to it


# Fields of a run that do not change what it computes: editing them keeps its record.
NOT_IDENTITY = {"expect", "notes", "model", "draft"}   # model/draft: their resolved specs are used instead


def run_identity(r: ResolvedRun) -> dict:
    """What a run's record must match to be reused: the run's own fields (mode, seed, settings),
    its resolved model (and draft) spec and the caramba version. Nothing of other runs, so
    editing one run never redoes another."""
    return {
        "target": r.target,
        "run": r.run.model_dump(mode="json", exclude=NOT_IDENTITY),
        "model": r.model.model_dump(mode="json"),
        "draft": r.draft.model_dump(mode="json") if r.draft is not None else None,
        "caramba_version": caramba.__version__,
    }


def command_line(manifest_path: str, only: list[str], overrides: list[str], force: bool, check: bool) -> str:
    """The `caramba run` command that asks for this run again, as a shell would take it."""
    args = ["caramba", "run", str(manifest_path)]
    for name in only:
        args += ["--run", name]
    for text in overrides:
        args += ["--set", text]
    args += ["--force"] * force + ["--check"] * check
    return shlex.join(args)


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
                 check: bool = False, overrides: list[str] | None = None, command: str | None = None) -> Outcome:
    """Run the selected runs; with check, compare each finished run's result with its `expect:`.

    Every selected run is checked first (preflight: exit 2, nothing written). A run whose
    finished record matches its hash is skipped unless forced; one whose settings changed since
    its record is redone, said so. A new record is built aside and replaces the old one only
    when complete. A run locked by another `caramba run` is left to it."""
    runs = select_runs(manifest, only)
    preflight(manifest.name, runs)
    outcome = Outcome()
    models: dict[tuple, LoadedModel] = {}
    resolved_yaml = resolved_manifest_yaml(manifest)
    run_info = {"command": command, "overrides": list(overrides or [])}
    for r in runs:
        name = f"{r.target}/{r.run.id}"
        record = RunDir(manifest.name, r.target, r.run.id)
        digest = run_hash(run_identity(r))
        if dry_run:
            console.print(f"would {_plan(record, digest, force)} {name} ({r.run.mode}) on {escape(r.model.source)} -> {escape(str(record.final))}", soft_wrap=True)
            continue
        if not record.try_lock():
            unchecked = "; not checked" if check else ""
            console.print(f"[yellow]skip {name}: another process (pid {record.holder() or '?'}) is running it "
                          f"({escape(str(record.lock_path))}){unchecked}[/yellow]", soft_wrap=True)
            outcome.busy.append(name)
            continue
        try:
            _one(r, name, record, digest, force, check, resolved_yaml, run_info, models, outcome, console)
        finally:
            record.release()
    return outcome


def _plan(record: RunDir, digest: str, force: bool) -> str:
    if not record.is_done():
        return "run"
    if record.recorded_hash() == digest:
        return "redo (--force)" if force else "skip"
    return "redo (settings changed since the record)"


def _one(r: ResolvedRun, name: str, record: RunDir, digest: str, force: bool, check: bool, resolved_yaml: str,
         run_info: dict, models: dict, outcome: Outcome, console: Console) -> None:
    """One run, under its lock."""
    if record.is_done():
        recorded = record.recorded_hash()
        if recorded == digest and not force:
            console.print(f"[dim]skip {escape(name)}: already done ({escape(str(record.final))}); --force reruns it[/dim]", soft_wrap=True)
            outcome.skipped.append(name)
            if check:
                _check(r, record, outcome, console)
            return
        if recorded != digest:
            why = ("the record has no run hash (made by an older caramba)" if recorded is None
                   else f"run hash {recorded[:12]} -> {digest[:12]}")
            console.print(f"[yellow]{escape(name)}: settings changed since the record ({escape(why)}): redoing[/yellow]", soft_wrap=True)
    console.rule(f"{name} ({r.run.mode})")
    record.begin(force=True)   # built aside: the finished record stays until the new one is complete
    try:
        _run_one(r, record, resolved_yaml, digest, run_info, models, console)
    except UserError:
        record.discard()  # bad input found late: leave nothing half-written
        raise
    except RunError as e:
        _fail(record, name, str(e), outcome, console)
    except (KeyboardInterrupt, SystemExit):
        record.log("interrupted")
        where = record.abandon()
        if record.is_done():
            console.print(f"[yellow]{name} interrupted: the finished record {escape(str(record.final))} is kept; "
                          f"the attempt's log is in {escape(str(where))}[/yellow]", soft_wrap=True)
        raise
    except Exception as e:  # a failed run is reported and the manifest goes on
        record.log(traceback.format_exc())
        _fail(record, name, f"{type(e).__name__}: {e}", outcome, console)
    else:
        outcome.done.append(name)
        console.print(f"[green]done[/green] {escape(name)} -> {escape(str(record.final))}", soft_wrap=True)
        if check:
            _check(r, record, outcome, console)


def _check(r: ResolvedRun, record: RunDir, outcome: Outcome, console: Console) -> None:
    name = f"{r.target}/{r.run.id}"
    result = json.loads((record.final / "result.json").read_text())
    if r.run.expect is None:
        digest = output_sha256(result)
        hint = f"; its output_sha256 is {digest}" if digest else ""
        console.print(f"[yellow]check {name}: no expect: block, nothing to compare{hint}[/yellow]")
        return
    problems = check_expect(result, r.run.expect)
    if problems:
        outcome.check_failed.append(name)
        console.print(f"[red]check failed[/red] {escape(name)} ({escape(str(record.final / 'result.json'))}):")
        for line in problems:
            console.print(f"  - {escape(line)}", highlight=False, soft_wrap=True)
    else:
        console.print(f"[green]check ok[/green] {name}")


def _run_one(r: ResolvedRun, record: RunDir, resolved_yaml: str, digest: str, run_info: dict, models: dict,
             console: Console) -> None:
    record.write_text("manifest.yaml", resolved_yaml)
    versions = {"caramba": caramba.__version__, **library_versions()}
    record.write_json("env.json", {**capture_env(r.run.seed, r.model.device), "run": f"{r.target}/{r.run.id}",
                                   "run_hash": digest, "command": run_info["command"],
                                   "overrides": run_info["overrides"], "libraries": versions})
    record.log(f"run {r.target}/{r.run.id} mode={r.run.mode} model={r.model.source} dtype={r.model.dtype} weights={r.model.weights}")
    if r.run.seed is not None:
        torch.manual_seed(r.run.seed)
    loaded = _model(r.model, models)
    record.log(f"model {loaded.path} sha256={loaded.content_hash}")
    extra = {}
    if r.draft is not None:  # a speculative run's draft model, loaded beside the target
        draft = load_model(r.draft.source, r.draft.dtype, r.draft.device, weights=r.draft.weights)
        record.log(f"draft model {draft.path} sha256={draft.content_hash}")
        extra["draft"] = draft
    result = MODE_RUNNERS[r.run.mode](loaded, r.run.settings, r.run.seed, record, console, **extra)
    result["model"] = {**r.model.model_dump(), "path": str(loaded.path), "sha256": loaded.content_hash}
    if r.draft is not None:
        result["draft_model"] = {**r.draft.model_dump(), "path": str(extra["draft"].path), "sha256": extra["draft"].content_hash}
    result["output_sha256"] = output_sha256(result)   # what --check compares (None: no generated ids)
    result["run_hash"] = digest
    result["command"] = run_info["command"]
    result["overrides"] = run_info["overrides"]
    result["versions"] = versions
    record.write_json("result.json", result)
    record.finish()


def _model(spec: ModelSpec, models: dict) -> LoadedModel:
    key = (spec.source, spec.dtype, spec.device, spec.weights)
    if key not in models:
        models.clear()  # one model in memory at a time
        models[key] = load_model(spec.source, spec.dtype, spec.device, weights=spec.weights)
    return models[key]


def _fail(record: RunDir, name: str, message: str, outcome: Outcome, console: Console) -> None:
    record.log(f"FAILED: {message}")
    where = record.abandon()
    kept = f"; the finished record {record.final} is kept" if record.is_done() else ""
    console.print(f"[red]failed[/red] {escape(name)}: {escape(message)} (log: {escape(str(where / 'log.txt'))}{kept})", soft_wrap=True)
    outcome.failed.append(name)
