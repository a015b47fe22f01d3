"""`caramba run --jobs N`: N worker processes on this machine (spawned, not forked: torch's
threads do not survive a fork). Each worker is pinned to its share of the cores (cores/N, never
N x all cores) with as many torch threads, keeps the last model it loaded, and takes the next
run from one queue; runs are queued grouped by model, so a worker's next run usually needs the
model it has. A worker that dies mid-run fails that run (its record has no DONE) and is
replaced; the other runs go on."""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import time

from caramba.executors.common import Executor
from caramba.runners import RunTask, TaskResult


def core_shares(jobs: int) -> list[list[int]]:
    """The cores each of `jobs` workers is pinned to: this process's cores split evenly (one
    core each, shared round-robin, when there are more workers than cores)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    per = max(1, len(cores) // jobs)
    return [[cores[(i * per + k) % len(cores)] for k in range(per)] for i in range(jobs)]


def _worker(cores: list[int], tasks, results) -> None:
    from caramba.executors.signals import SIGNALS, stop_once  # lazy: the worker process's own

    for signum in SIGNALS:   # a hang-up of the terminal, or the driver's terminate(), stops the run as Ctrl-C does
        signal.signal(signum, stop_once)
    # The driver's cancel() sends SIGINT: heard even when the sweep was started with SIGINT ignored
    # (a shell without job control runs background jobs so, and children inherit it).
    signal.signal(signal.SIGINT, stop_once)
    try:
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cores)
        import torch

        from caramba.executors.common import run_in_worker  # lazy: the engine loads in the worker, not the driver

        torch.set_num_threads(len(cores))
        models: dict = {}
        while True:
            task = tasks.get()
            if task is None:
                return
            results.put(("start", os.getpid(), task.name))
            results.put(("end", os.getpid(), run_in_worker(task, models)))
    except KeyboardInterrupt:   # Ctrl-C reaches the whole process group: the run abandoned its record
        return


class PoolExecutor(Executor):
    name = "local pool"

    def __init__(self, jobs: int):
        self.jobs = jobs
        self._ctx = multiprocessing.get_context("spawn")
        self._workers: dict[int, tuple[multiprocessing.Process, list[int]]] = {}   # pid -> (process, cores)
        self._current: dict[int, str] = {}   # pid -> the run it is doing
        self._left = 0

    def start(self, tasks: list[RunTask]) -> None:
        self._tasks, self._results = self._ctx.Queue(), self._ctx.Queue()
        order = sorted(range(len(tasks)), key=lambda i: (tasks[i].model_key, i))   # grouped by model, stable
        for i in order:
            self._tasks.put(tasks[i])
        self._left = len(tasks)
        shares = core_shares(min(self.jobs, len(tasks)) or 1)
        for cores in shares:
            self._tasks.put(None)   # one stop sign per worker
            self._spawn(cores)

    def _spawn(self, cores: list[int]) -> None:
        process = self._ctx.Process(target=_worker, args=(cores, self._tasks, self._results), daemon=True)
        process.start()
        self._workers[process.pid] = (process, cores)

    def poll(self, timeout: float) -> list[TaskResult]:
        out = []
        deadline = time.monotonic() + timeout
        while True:
            try:
                message = self._results.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            kind, pid, payload = message
            if kind == "start":
                self._current[pid] = payload
            else:
                self._current.pop(pid, None)
                self._left -= 1
                out.append(payload)
        return out + self._reap()

    def _reap(self) -> list[TaskResult]:
        """Fail the run of each worker that died, and put a new worker in its place."""
        out = []
        for pid, (process, cores) in list(self._workers.items()):
            if process.is_alive() or process.exitcode == 0:
                continue
            del self._workers[pid]
            name = self._current.pop(pid, None)
            if name is not None:
                self._left -= 1
                out.append(TaskResult(name, "failed", message=f"worker pid {pid} died (exit code {process.exitcode}) "
                                      "during the run; its record has no DONE, so a rerun redoes it",
                                      ended=0.0, pid=pid))
            if self._left > 0:
                self._spawn(cores)
        return out

    def running(self) -> set[str] | None:
        return set(self._current.values())

    def cancel(self) -> None:
        self._left = 0   # nothing more to replace a stopped worker for
        for process, _ in self._workers.values():   # a worker interrupted mid-run abandons its record
            if process.is_alive():
                os.kill(process.pid, signal.SIGINT)
        for process, _ in self._workers.values():
            process.join(timeout=10)

    def close(self) -> None:
        for process, _ in self._workers.values():
            process.join(timeout=5 if process.is_alive() and self._left <= 0 else 0.1)
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
        for q in (getattr(self, "_tasks", None), getattr(self, "_results", None)):
            if q is not None:
                q.cancel_join_thread()
                q.close()
