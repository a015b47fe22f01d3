"""Running a validated manifest: select its runs, preflight them, and do each one (serially here,
or as a picklable RunTask on an executor's worker) through one lifecycle (caramba.runners.lifecycle:
lock, a record built aside, DONE, swap, release); what a run computes is its mode's
(caramba.runners.registry)."""

from __future__ import annotations

import fnmatch
import json
import os
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape

import caramba
from caramba.errors import RunError, UserError
from caramba.expect import check as check_expect
from caramba.expect import output_sha256
from caramba.evaluation.tasks import GENERATOR_VERSION
from caramba.manifest import Manifest, ModelSpec, ResolvedRun, resolved_run_yaml, schema
from caramba.model.zoo import LoadedModel, load_model
from caramba.runners import registry
from caramba.runners.lifecycle import Attempt, locked
from caramba.runners.preflight import preflight
from caramba.runs import RecordError, RunDir, capture_env, library_versions, read_record_json, run_hash, runs_root


@dataclass
class Outcome:
    done: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    check_failed: list[str] = field(default_factory=list)
    busy: list[str] = field(default_factory=list)   # being run by another process: left to it
    messages: dict[str, str] = field(default_factory=dict)   # why a run failed
    checks: dict[str, list[str]] = field(default_factory=dict)   # why a run failed its check
    seconds: dict[str, float] = field(default_factory=dict)


# Fields of a run that do not change what it computes: editing them keeps its record.
# model/draft: their resolved specs are used instead; params repeat what the settings already say.
NOT_IDENTITY = {"expect", "notes", "model", "draft", "params"}


def run_identity(r: ResolvedRun) -> dict:
    """What a run's record must match to be reused: the run's own fields (mode, seed, settings),
    its resolved model (and draft) spec and the caramba version (and an eval's task generator).
    Nothing of other runs, so editing one run never redoes another."""
    identity = {
        "target": r.target,
        "run": r.run.model_dump(mode="json", exclude=NOT_IDENTITY),
        "model": r.model.model_dump(mode="json"),
        "draft": r.draft.model_dump(mode="json") if r.draft is not None else None,
        "caramba_version": caramba.__version__,
    }
    if registry.get(r.run.mode).uses_task_generator(r):   # other generators write other prompts
        identity["task_generator_version"] = GENERATOR_VERSION
    return identity


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
    """All runs, or those named by `--run`: a run id or target/id, a glob of either
    (`'sweep.*'`, `'t/*seed-1*'`), or a sweep's base id (every run its matrix made)."""
    runs = list(manifest.iter_runs())
    if not only:
        return runs
    def picks(pattern: str, r: ResolvedRun) -> bool:
        names = (r.run.id, f"{r.target}/{r.run.id}")
        swept = r.run.params is not None and any(n.startswith(pattern + ".") for n in names)
        return any(fnmatch.fnmatchcase(n, pattern) for n in names) or swept
    chosen = [r for r in runs if any(picks(p, r) for p in only)]
    unknown = [p for p in only if not any(picks(p, r) for r in runs)]
    if unknown:
        listed = [f"{r.target}/{r.run.id}" for r in runs]
        more = f" ... ({len(listed)} in all; caramba run --dry-run lists them)" if len(listed) > 20 else ""
        raise UserError(f"--run {', '.join(unknown)}: no such run; runs in this manifest: "
                        + ", ".join(listed[:20]) + more)
    return chosen


@dataclass
class RunTask:
    """One run as plain, picklable data: what a worker needs to do it (a pool process, a Ray
    task, a Slurm array task), through the same per-run path as a serial run (lock, hash, a
    record built aside and swapped in)."""

    manifest_name: str
    target: str
    run: dict               # Run.model_dump(mode="json"), validated again by the worker
    model: dict
    draft: dict | None
    digest: str             # the run hash, computed once by the driver
    resolved_yaml: str      # the record's manifest.yaml
    force: bool
    check: bool
    run_info: dict
    root: str               # the runs root, absolute: workers may start elsewhere
    cwd: str                # relative model paths and texts are the driver's

    @property
    def name(self) -> str:
        return f"{self.target}/{self.run['id']}"

    @property
    def model_key(self) -> tuple:
        return (self.model["source"], self.model["dtype"], self.model["device"])

    def resolved(self) -> ResolvedRun:
        draft = ModelSpec.model_validate(self.draft) if self.draft is not None else None
        run = schema.Run.model_validate(self.run)   # the Run of the registry as it stands
        return ResolvedRun(self.target, run, ModelSpec.model_validate(self.model), draft)


@dataclass
class TaskResult:
    """What became of one RunTask: status is done, skipped, failed or busy (another process has it)."""

    name: str
    status: str
    check_failed: bool = False
    message: str = ""
    output: str = ""        # what the run printed (kept for failures and check failures)
    started: float = 0.0    # time.time() in the worker when the run began / ended
    ended: float = 0.0
    pid: int = 0
    dispatched: float = 0.0  # time.time() in the driver when its task was handed over (0: not kept)
    checks: list[str] = field(default_factory=list)   # why it failed its check (--check)


def make_tasks(manifest: Manifest, runs: list[ResolvedRun], force: bool, check: bool, run_info: dict,
               root: str | Path | None = None) -> list[RunTask]:
    base = runs_root(root).absolute()
    return [RunTask(manifest.name, r.target, r.run.model_dump(mode="json"), r.model.model_dump(mode="json"),
                    r.draft.model_dump(mode="json") if r.draft is not None else None, run_hash(run_identity(r)),
                    resolved_run_yaml(manifest, r.target, r.run.id), force, check, run_info, str(base), os.getcwd())
            for r in runs]


def execute(task: RunTask, models: dict, console: Console) -> TaskResult:
    """Do one task in this process, under its lock; the worker side of every executor. Never
    raises for a run that fails (that is a result); KeyboardInterrupt and SystemExit pass."""
    started = time.time()
    outcome = Outcome()
    name = task.name
    if task.cwd and os.path.isdir(task.cwd) and os.getcwd() != task.cwd:
        os.chdir(task.cwd)
    try:
        r = task.resolved()
        record = RunDir(task.manifest_name, task.target, r.run.id, root=task.root)
        with locked(record) as mine:
            if not mine:
                return TaskResult(name, "busy", message=f"another process (pid {record.holder() or '?'}) is running it",
                                  started=started, ended=time.time(), pid=os.getpid())
            _one(r, name, record, task.digest, task.force, task.check, task.resolved_yaml, task.run_info, models,
                 outcome, console)
    except (UserError, RunError, ValueError, OSError) as e:   # found late (input, a record entry, the disk):
        outcome.failed.append(name)                            # this run fails, the sweep goes on
        outcome.messages[name] = str(e)
    except Exception as e:   # anything else is this run's failure too, never a worker's traceback
        outcome.failed.append(name)
        outcome.messages[name] = f"{type(e).__name__}: {e}"
    status = "failed" if name in outcome.failed else "skipped" if name in outcome.skipped else "done"
    return TaskResult(name, status, check_failed=name in outcome.check_failed, message=outcome.messages.get(name, ""),
                      started=started, ended=time.time(), pid=os.getpid(), checks=outcome.checks.get(name, []))


def run_manifest(manifest: Manifest, only: list[str], force: bool, dry_run: bool, console: Console,
                 check: bool = False, overrides: list[str] | None = None, command: str | None = None) -> Outcome:
    """Run the selected runs one after another in this process; with check, compare each
    finished run's result with its `expect:`. (caramba.executors runs them in parallel.)

    Every selected run is checked first (preflight: exit 2, nothing written). A run whose
    finished record matches its hash is skipped unless forced; one whose settings changed since
    its record is redone, said so. A new record is built aside and replaces the old one only
    when complete. A run locked by another `caramba run` is left to it."""
    runs = select_runs(manifest, only)
    preflight(manifest.name, runs)
    outcome = Outcome()
    models: dict[tuple, LoadedModel] = {}
    run_info = {"command": command, "overrides": list(overrides or [])}
    for r in runs:
        name = f"{r.target}/{r.run.id}"
        record = RunDir(manifest.name, r.target, r.run.id)
        digest = run_hash(run_identity(r))
        if dry_run:
            params = f" {escape(format_params(r.run.params))}" if r.run.params else ""
            console.print(f"would {_plan(record, digest, force)} {name} ({r.run.mode}){params} on {escape(r.model.source)} -> {escape(str(record.final))}", soft_wrap=True)
            continue
        started = time.monotonic()
        try:
            with locked(record) as mine:
                if not mine:
                    unchecked = "; not checked" if check else ""
                    console.print(f"[yellow]skip {name}: another process (pid {record.holder() or '?'}) is running it "
                                  f"({escape(str(record.lock_path))}){unchecked}[/yellow]", soft_wrap=True)
                    outcome.busy.append(name)
                    continue
                _one(r, name, record, digest, force, check, resolved_run_yaml(manifest, r.target, r.run.id), run_info,
                     models, outcome, console)
        except (RecordError, OSError) as e:   # an entry of this run's record, or the disk: this run fails
            console.print(f"[red]failed[/red] {escape(name)}: {escape(str(e))}", soft_wrap=True)
            outcome.failed.append(name)
            outcome.messages[name] = str(e)
        finally:
            outcome.seconds[name] = time.monotonic() - started
    return outcome


def format_params(params: dict | None) -> str:
    """{'generate.cache_kind': 'q8_0', 'seed': 1} -> 'generate.cache_kind=q8_0 seed=1'."""
    return " ".join(f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in (params or {}).items())


def _plan(record: RunDir, digest: str, force: bool) -> str:
    status = record.status(digest)
    if status.state == "done":
        return "redo (--force)" if force else "skip"
    return {"changed": "redo (settings changed since the record)", "damaged": f"redo (the record is damaged: {status.detail})",
            "blocked": f"fail ({status.detail})"}.get(status.state, "run")


def _one(r: ResolvedRun, name: str, record: RunDir, digest: str, force: bool, check: bool, resolved_yaml: str,
         run_info: dict, models: dict, outcome: Outcome, console: Console) -> None:
    """One run, under its lock. A record that is done and matches is skipped; one made with other
    settings, or damaged (its files no longer match DONE's digests), is redone, said so."""
    _notices(record, name, console)
    status = record.status(digest)
    if status.state == "done" and not force:
        console.print(f"[dim]skip {escape(name)}: already done ({escape(str(record.final))}); --force reruns it[/dim]", soft_wrap=True)
        outcome.skipped.append(name)
        if check:
            _check(r, record, outcome, console)
        return
    if status.state == "changed":
        console.print(f"[yellow]{escape(name)}: settings changed since the record ({escape(status.detail)}): "
                      "redoing[/yellow]", soft_wrap=True)
    elif status.state == "damaged":
        console.print(f"[yellow]{escape(name)}: the record is damaged ({escape(status.detail)}): redoing[/yellow]", soft_wrap=True)
    elif status.state == "blocked":
        raise RecordError(status.detail)
    console.rule(f"{name} ({r.run.mode})")
    attempt = Attempt(record)   # built aside: the finished record stays until the new one is complete
    try:
        with attempt:
            _notices(record, name, console)   # a .partial that was not caramba's directory, removed by begin()
            _run_one(r, record, resolved_yaml, digest, run_info, models, console)
    except UserError:
        raise
    except (KeyboardInterrupt, SystemExit):
        if record.is_done():
            console.print(f"[yellow]{name} interrupted: the finished record {escape(str(record.final))} is kept; "
                          f"the attempt's log is in {escape(str(attempt.where))}[/yellow]", soft_wrap=True)
        raise
    except Exception:  # a failed run is reported and the manifest goes on
        if not attempt.begun:   # no attempt to report (its directory could not be made): the caller says why
            raise
        kept = f"; the finished record {record.final} is kept" if record.is_done() else ""
        console.print(f"[red]failed[/red] {escape(name)}: {escape(attempt.message)} "
                      f"(log: {escape(str(attempt.where / 'log.txt'))}{kept})", soft_wrap=True)
        outcome.failed.append(name)
        outcome.messages[name] = attempt.message
    else:
        outcome.done.append(name)
        console.print(f"[green]done[/green] {escape(name)} -> {escape(str(record.final))}", soft_wrap=True)
        if check:
            _check(r, record, outcome, console)


def _notices(record: RunDir, name: str, console: Console) -> None:
    for notice in record.notices:
        console.print(f"[yellow]{escape(name)}: {escape(notice)}[/yellow]", soft_wrap=True)
    record.notices.clear()


def _check(r: ResolvedRun, record: RunDir, outcome: Outcome, console: Console) -> None:
    name = f"{r.target}/{r.run.id}"
    try:
        result = read_record_json(record.final)
    except RecordError as e:   # the record went bad after it was verified: a failed check, not a crash
        problems = [str(e)]
        result = None
    if result is not None and not isinstance(result, dict):
        problems, result = [f"{record.final / 'result.json'} is not a JSON object"], None
    if result is None:
        outcome.check_failed.append(name)
        outcome.checks[name] = problems
        console.print(f"[red]check failed[/red] {escape(name)}: {escape(problems[0])}", soft_wrap=True)
        return
    if r.run.expect is None:
        digest = output_sha256(result)
        hint = f"; its output_sha256 is {digest}" if digest else ""
        console.print(f"[yellow]check {name}: no expect: block, nothing to compare{hint}[/yellow]")
        return
    problems = check_expect(result, r.run.expect)
    if problems:
        outcome.check_failed.append(name)
        outcome.checks[name] = problems
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
                                   "run_hash": digest, "params": r.run.params, "command": run_info["command"],
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
    result = registry.get(r.run.mode).run(loaded, r.run.settings, r.run.seed, record, console, **extra)
    result["model"] = {**r.model.model_dump(), "path": str(loaded.path), "sha256": loaded.content_hash}
    if getattr(loaded.model, "native_weights", None) is not None:   # weights native: which GGUF tensors were kept
        result["model"]["native_weights"] = loaded.model.native_weights
    if r.draft is not None:
        result["draft_model"] = {**r.draft.model_dump(), "path": str(extra["draft"].path), "sha256": extra["draft"].content_hash}
    result["output_sha256"] = output_sha256(result)   # what --check compares (None: no generated ids)
    result["run_hash"] = digest
    result["params"] = r.run.params   # a sweep's matrix values (None: not from a matrix)
    result["command"] = run_info["command"]
    result["overrides"] = run_info["overrides"]
    result["versions"] = versions
    record.write_json("result.json", result)


def _model(spec: ModelSpec, models: dict) -> LoadedModel:
    key = (spec.source, spec.dtype, spec.device, spec.weights)
    if key not in models:
        models.clear()  # one model in memory at a time
        models[key] = load_model(spec.source, spec.dtype, spec.device, weights=spec.weights)
    return models[key]
