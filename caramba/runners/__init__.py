"""Run a validated manifest: one record per run under runs/, one module per mode.

The orchestration (select, preflight, run each under its lock, check) is caramba.runners.orchestrate,
re-exported here. The modes are registered in caramba.runners.registry: every module of this
package is imported below, and a mode's module registers its mode (registry.register), so adding
a mode is adding its module here."""

import importlib
import pkgutil

from caramba.runners import registry
from caramba.runners.orchestrate import (NOT_IDENTITY, Outcome, RunTask, TaskResult, command_line, execute,
                                         format_params, make_tasks, run_identity, run_manifest, select_runs)
from caramba.runners.preflight import preflight
from caramba.runners.registry import MODE_RUNNERS  # mode -> runner, read from the registry
from caramba.runs import RunDir, run_hash

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["MODE_RUNNERS", "NOT_IDENTITY", "Outcome", "RunDir", "RunTask", "TaskResult", "command_line", "execute",
           "format_params", "make_tasks", "preflight", "registry", "run_hash", "run_identity", "run_manifest",
           "select_runs"]
