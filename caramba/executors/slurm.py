"""`caramba run --executor slurm`: each run a Slurm array task through submitit, with the
manifest's executor.slurm resources (partition, time_min, cpus, gpus, array_parallelism). Logs
go to `<runs root>/<manifest>/.submitit/`, one `<job id>_<task>_log.out/.err` pair per task. Records are
written by the tasks, so the runs root must be on storage the nodes share.

Where there is no Slurm (no `sbatch`), submitit's local executor runs the same tasks as local
processes, at most --jobs at a time; that is how the tests exercise this path."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import submitit

from caramba.executors.common import Executor, run_in_worker
from caramba.executors.pool import core_shares
from caramba.runners import RunTask, TaskResult


def _run_task(task: RunTask, threads: int) -> TaskResult:
    return run_in_worker(task, {}, threads)


class SlurmExecutor(Executor):
    name = "slurm"

    def __init__(self, settings, jobs: int | None):
        self.settings, self.jobs = settings, jobs
        self.cluster = "slurm" if shutil.which("sbatch") else "local"
        self.name = "slurm" if self.cluster == "slurm" else "submitit local (no sbatch here)"
        self._jobs: dict = {}       # submitit Job -> run name
        self._waiting: list[RunTask] = []
        self._submitted: dict[str, float] = {}   # run -> when its task was submitted

    def start(self, tasks: list[RunTask]) -> None:
        s = self.settings
        folder = Path(tasks[0].root) / tasks[0].manifest_name / ".submitit"   # <job id>_<task>_log.out/.err
        self._executor = submitit.AutoExecutor(folder=folder, cluster=self.cluster)
        self._executor.update_parameters(timeout_min=s.time_min, cpus_per_task=s.cpus, gpus_per_node=s.gpus,
                                         name=f"caramba-{tasks[0].manifest_name}", slurm_partition=s.partition,
                                         slurm_array_parallelism=s.array_parallelism or self.jobs or 256)
        self._threads = s.cpus
        if self.cluster == "local":   # local processes share this machine: cores/--jobs threads each, at most
            self._threads = min(s.cpus, max(1, len(core_shares(s.array_parallelism or self.jobs or 1)[0])))
        order = sorted(tasks, key=lambda t: t.model_key)
        if self.cluster == "slurm":   # one array job; Slurm runs array_parallelism of it at once
            jobs = self._executor.map_array(_run_task, order, [self._threads] * len(order))
            self._submitted = dict.fromkeys((t.name for t in order), time.time())
            self._jobs = dict(zip(jobs, (t.name for t in order)))
        else:   # local processes: at most --jobs at a time (one each by default)
            self._waiting = list(order)
            self._fill()

    def _fill(self) -> None:
        limit = self.settings.array_parallelism or self.jobs or 1
        while self._waiting and len(self._jobs) < limit:
            task = self._waiting.pop(0)
            self._jobs[self._executor.submit(_run_task, task, self._threads)] = task.name
            self._submitted[task.name] = time.time()

    def poll(self, timeout: float) -> list[TaskResult]:
        deadline = time.monotonic() + timeout
        out: list[TaskResult] = []
        while not out and time.monotonic() < deadline:
            for job in [j for j in self._jobs if j.done()]:
                name = self._jobs.pop(job)
                try:
                    result = job.result()
                    result.dispatched = self._submitted.get(name, 0.0)
                    out.append(result)
                except Exception as e:   # the task died (killed, timed out, node failure)
                    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                    out.append(TaskResult(name, "failed", message=f"Slurm task {job.job_id} failed: {first[:200]} "
                                          f"(log: {job.paths.stderr}); its record has no DONE, so a rerun redoes it"))
            self._fill()
            if not out:
                time.sleep(0.1)
        return out

    def cancel(self) -> str | None:
        """Local tasks are stopped; tasks on a Slurm cluster are left to `scancel`: they may sit
        in the queue for hours, and cancelling them is the user's call (and needs the controller,
        which a terminal hang-up may not reach). The command is returned for the driver to print."""
        self._waiting = []
        if self.cluster != "slurm":
            for job in self._jobs:
                job.cancel(check=False)
            return None
        ids = sorted({str(job.job_id).split("_")[0] for job in self._jobs})
        if not ids:
            return None
        return (f"{len(self._jobs)} Slurm task(s) are still queued or running and write their records when done; "
                f"to stop them: scancel {' '.join(ids)}")
