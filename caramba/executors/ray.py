"""`caramba run --executor ray`: each run a Ray task with the manifest's executor.ray resources
(num_cpus, num_gpus). `ray.init()` starts a local Ray unless --ray-address names a cluster to
join. Workers write the records themselves, under the runs root as the driver sees it: on a
cluster that directory must be shared storage mounted at the same path on every node (and
CARAMBA_CACHE_DIR, the converted-model cache, is best left on each node's local disk). Ray keeps
its worker processes, and each keeps the last model it loaded, so a node loads a model once."""

from __future__ import annotations

import os
import time

import ray

from caramba.executors.common import Executor, run_in_worker
from caramba.runners import RunTask, TaskResult

_MODELS: dict = {}   # per Ray worker process: the model of its last run, reused by the next


def _run_task(task: RunTask, threads: int) -> TaskResult:
    return run_in_worker(task, _MODELS, threads)


class RayExecutor(Executor):
    name = "ray"

    def __init__(self, settings, address: str | None, jobs: int | None):
        self.settings, self.address, self.jobs = settings, address, jobs
        self._refs: dict = {}   # ObjectRef -> run name
        self._started_ray = False

    def start(self, tasks: list[RunTask]) -> None:
        if not ray.is_initialized():
            options = {"address": self.address} if self.address else {}
            if not self.address and self.jobs:   # a local Ray sized for --jobs runs at once
                options["num_cpus"] = self.jobs * self.settings.num_cpus
            # Workers inherit the driver's environment (PYTHONPATH, CARAMBA_*); no dashboard, quiet logs.
            ray.init(**options, include_dashboard=False, log_to_driver=False, configure_logging=False,
                     runtime_env={"env_vars": {k: v for k, v in os.environ.items() if k.startswith("CARAMBA_")}})
            self._started_ray = True
        remote = ray.remote(_run_task).options(num_cpus=self.settings.num_cpus, num_gpus=self.settings.num_gpus,
                                              max_retries=0)
        threads = max(1, int(self.settings.num_cpus))
        order = sorted(tasks, key=lambda t: t.model_key)   # grouped by model, like the local pool
        self._refs = {remote.remote(task, threads): task.name for task in order}

    def poll(self, timeout: float) -> list[TaskResult]:
        if not self._refs:
            time.sleep(timeout)
            return []
        ready, _ = ray.wait(list(self._refs), num_returns=len(self._refs), timeout=timeout, fetch_local=True)
        out = []
        for ref in ready:
            name = self._refs.pop(ref)
            try:
                out.append(ray.get(ref))
            except ray.exceptions.RayError as e:   # the worker died (killed, out of memory) or the task was cancelled
                out.append(TaskResult(name, "failed", message=f"Ray task failed ({type(e).__name__}): "
                                      f"{str(e).splitlines()[0] if str(e) else ''}; the run's record has no DONE, "
                                      "so a rerun redoes it"))
        return out

    def cancel(self) -> None:
        for ref in list(self._refs):
            ray.cancel(ref, force=False)   # a running task gets KeyboardInterrupt: it abandons its record

    def close(self) -> None:
        if self._started_ray:
            ray.shutdown()
