"""The interface every parallel executor implements, and the driver that runs a sweep on one:
one rich progress display (done / running / failed / pending, ETA), a line per finished run,
Ctrl-C cancelling what is pending, and the summary table."""

from __future__ import annotations

import io
import statistics
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from caramba.executors.state import held_locks, lock_held
from caramba.runners import RunTask, TaskResult, execute
from caramba.runs import LOCK, RunDir


def run_in_worker(task: RunTask, models: dict, threads: int | None = None) -> TaskResult:
    """One task in a worker process (a pool worker, a Ray or Slurm task): with `threads` torch
    threads when given; what the run printed is kept with a failure (or a failed check)."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    buffer = io.StringIO()
    result = execute(task, models, Console(file=buffer, width=160, highlight=False, color_system=None))
    if result.status == "failed" or result.check_failed:
        result.output = buffer.getvalue()[-4000:]
    return result


class Executor(ABC):
    """Runs RunTasks somewhere. The driver calls start() once, poll() until every task has a
    result, and cancel() on Ctrl-C; close() always."""

    name = "executor"

    @abstractmethod
    def start(self, tasks: list[RunTask]) -> None: ...

    @abstractmethod
    def poll(self, timeout: float) -> list[TaskResult]:
        """Results of the tasks finished since the last call (waiting up to `timeout` s for one)."""

    def running(self) -> set[str] | None:
        """Names of the runs in progress, when the executor knows; None: read their locks."""
        return None

    def cancel(self) -> str | None:
        """Drop the tasks not started; interrupt the running ones (their records keep no DONE).
        Returns what the user must still do, if anything (e.g. the scancel command)."""

    def close(self) -> None:
        """Release workers and connections."""


@dataclass
class SweepOutcome:
    results: dict[str, TaskResult] = field(default_factory=dict)
    cancelled: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    def names(self, status: str) -> list[str]:
        return [n for n, r in self.results.items() if r.status == status]

    @property
    def check_failed(self) -> list[str]:
        return [n for n, r in self.results.items() if r.check_failed]

    def overhead_s(self) -> list[float]:
        """Per-task overhead: the gaps between one worker's consecutive runs (the time from one
        run's end to the next one starting there: result hand-back, dispatch, the task's setup;
        the model stays loaded)."""
        by_pid: dict[int, list[TaskResult]] = {}
        for r in self.results.values():
            if r.pid and r.started:
                by_pid.setdefault(r.pid, []).append(r)
        gaps = []
        for runs in by_pid.values():
            runs.sort(key=lambda r: r.started)
            gaps += [b.started - a.ended for a, b in zip(runs, runs[1:])]
        return gaps


def run_sweep(executor: Executor, tasks: list[RunTask], console: Console) -> SweepOutcome:
    """Run every task on `executor`, showing progress on `console`; KeyboardInterrupt cancels the
    rest and is raised again after the summary."""
    outcome = SweepOutcome()
    pending = {t.name: t for t in tasks}
    began = time.monotonic()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("ETA"), TimeRemainingColumn())
    interrupted: KeyboardInterrupt | None = None
    with Progress(*columns, console=console, transient=False) as progress:
        bar = progress.add_task(_counts(outcome, 0, len(tasks)), total=len(tasks))
        try:
            for result in _already_done(tasks):   # a resumed sweep dispatches only what is left
                del pending[result.name]
                outcome.results[result.name] = result
            if outcome.results:
                progress.console.print(f"[dim]skip {len(outcome.results)} run(s) already done (their records match "
                                       "their settings); --force reruns them[/dim]")
                progress.update(bar, completed=len(outcome.results), description=_counts(outcome, 0, len(pending)))
            if pending:
                executor.start(list(pending.values()))
            while pending:
                for result in executor.poll(0.5):
                    if result.name not in pending:
                        continue
                    del pending[result.name]
                    outcome.results[result.name] = result
                    progress.console.print(_line(result), soft_wrap=True, highlight=False)
                    if result.output and (result.status == "failed" or result.check_failed):
                        progress.console.print(escape(result.output.rstrip()), highlight=False, soft_wrap=True)
                running = _running(executor, pending.values())
                progress.update(bar, completed=len(outcome.results),
                                description=_counts(outcome, running, len(pending) - running))
        except KeyboardInterrupt as e:   # Ctrl-C, SIGTERM or SIGHUP (caramba.executors.signals)
            interrupted = e
            how = f"terminated by {e.args[0]}" if getattr(e, "signum", None) else "interrupted"
            progress.console.print(f"[yellow]{how}: cancelling {len(pending)} unfinished run(s)[/yellow]")
            note = executor.cancel()
            if note:
                progress.console.print(f"[yellow]{escape(note)}[/yellow]", soft_wrap=True)
            outcome.cancelled = list(pending)
        finally:
            executor.close()
    outcome.wall_s = time.monotonic() - began
    print_summary(outcome, tasks, console, executor.name)
    if interrupted is not None:
        raise interrupted
    return outcome


def _already_done(tasks: list[RunTask]) -> list[TaskResult]:
    """Runs whose finished record matches their hash: skipped here, as a worker would, without a
    task (with --force or --check they go to the workers, which redo or check them)."""
    out = []
    for t in tasks:
        if t.force or t.check:
            continue
        record = RunDir(t.manifest_name, t.target, t.run["id"], root=t.root)
        if record.status(t.digest).state == "done":
            out.append(TaskResult(t.name, "skipped", message="already done"))
    return out


def _running(executor: Executor, unfinished) -> int:
    known = executor.running()
    if known is not None:
        return len(known)
    locks = held_locks()
    return sum(lock_held(Path(t.root) / t.manifest_name / t.target / f".{t.run['id']}{LOCK}", locks) for t in unfinished)


def _counts(outcome: SweepOutcome, running: int, pending: int) -> str:
    done = len(outcome.names("done")) + len(outcome.names("skipped"))
    failed = len(outcome.names("failed"))
    return f"done {done} · running {running} · failed {failed} · pending {pending}"


def _line(r: TaskResult) -> str:
    took = f" ({r.ended - r.started:.1f}s)" if r.ended else ""
    if r.status == "done":
        text = f"[green]done[/green] {escape(r.name)}{took}"
    elif r.status == "skipped":
        text = f"[dim]skip {escape(r.name)}: already done[/dim]"
    elif r.status == "busy":
        text = f"[yellow]skip {escape(r.name)}: {escape(r.message)}[/yellow]"
    else:
        text = f"[red]failed[/red] {escape(r.name)}{took}: {escape(r.message)}"
    return text + (" [red](check failed)[/red]" if r.check_failed else "")


def print_summary(outcome: SweepOutcome, tasks: list[RunTask], console: Console, executor: str) -> None:
    table = Table(title=f"{len(tasks)} run(s) on {executor} in {outcome.wall_s:.1f}s", title_justify="left")
    for col in ("run", "status", "seconds", "note"):
        table.add_column(col, overflow="fold")
    for t in tasks:
        r = outcome.results.get(t.name)
        if r is None:
            table.add_row(escape(t.name), "[yellow]cancelled[/yellow]", "", "no DONE: a rerun does it")
            continue
        status = {"done": "[green]done[/green]", "failed": "[red]failed[/red]", "busy": "[yellow]busy[/yellow]"}.get(
            r.status, r.status) + (" [red]check failed[/red]" if r.check_failed else "")
        took = f"{r.ended - r.started:.1f}" if r.ended and r.status in ("done", "failed") else ""
        table.add_row(escape(t.name), status, took, escape(r.message[:200]))
    console.print(table)
    starts = [r.started - r.dispatched for r in outcome.results.values() if r.dispatched and r.started]
    if starts:   # a task per process (submitit): its start-up (process, imports) before the run begins
        console.print(f"task start on {executor}: median {statistics.median(starts):.1f} s from submission to the run "
                      f"starting ({len(starts)} tasks; the model is loaded inside the run)")
    gaps = outcome.overhead_s()
    if gaps:
        console.print(f"per-task overhead on {executor}: median {statistics.median(gaps) * 1e3:.0f} ms between a "
                      f"worker's consecutive runs ({len(gaps)} gaps, model kept loaded)")
