"""Executors: where the runs of `caramba run` go. One run = one task.

- local, serial (the default): caramba.runners.run_manifest, in this process.
- local with --jobs N: caramba.executors.pool, N worker processes on this machine.
- ray: caramba.executors.ray, each run a Ray task (the `caramba[ray]` extra).
- slurm: caramba.executors.slurm, each run a Slurm array task through submitit (`caramba[slurm]`).

Every executor hands its workers RunTasks and gets TaskResults back (caramba.runners); a worker
does a run through the same per-run path as a serial run (caramba.runners.lifecycle): its lock,
its hash, a record built aside and swapped in, so a killed worker leaves no DONE and a rerun redoes exactly that run.
caramba.executors.common drives them all (progress, Ctrl-C, the summary).
"""

from __future__ import annotations

import importlib.util

from caramba.errors import UserError
from caramba.executors.common import Executor

EXECUTORS = ("local", "ray", "slurm")
# executor -> (the module it needs, the extra that installs it)
_NEEDS = {"ray": ("ray", "caramba[ray]"), "slurm": ("submitit", "caramba[slurm]")}


def require(name: str) -> None:
    """UserError (exit 2) naming the extra when an executor's library is not installed."""
    if name not in EXECUTORS:
        raise UserError(f"--executor {name!r}: choose one of {', '.join(EXECUTORS)}")
    module, extra = _NEEDS.get(name, (None, None))
    if module is not None and importlib.util.find_spec(module) is None:
        raise UserError(f"--executor {name} needs {module}, which is not installed: pip install '{extra}'")


def make_executor(name: str, jobs: int | None, settings, ray_address: str | None = None) -> Executor:
    """The executor for `caramba run --executor NAME`; `settings` is the manifest's executor: block."""
    require(name)
    if name == "ray":
        from caramba.executors.ray import RayExecutor  # lazy: ray is an optional extra

        return RayExecutor(settings.ray, ray_address, jobs)
    if name == "slurm":
        from caramba.executors.slurm import SlurmExecutor  # lazy: submitit is an optional extra

        return SlurmExecutor(settings.slurm, jobs)
    from caramba.executors.pool import PoolExecutor  # lazy: only the executor a run chose

    return PoolExecutor(jobs or 1)
