"""Budget-aware KV cache selection: candidates, budget filter, quality gates, speed pick, plans.

The plan store (caramba.autotune.plans) needs no torch; the rest is imported on first use, so
`caramba plans list` does not pay torch's ~2 s import."""

from importlib import import_module
from typing import Any

from caramba.autotune.plans import PlanStore, default_plan_path

_LAZY = {"Candidate": "candidates", "cache_nbytes": "candidates", "default_candidates": "candidates",
         "policy_from_dict": "candidates", "GateResult": "gates", "GateSettings": "gates",
         "AutotuneResult": "select", "AutotuneSettings": "select", "NoCandidateError": "select", "autotune": "select"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f"caramba.autotune.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AutotuneResult", "AutotuneSettings", "Candidate", "GateResult", "GateSettings", "NoCandidateError",
           "PlanStore", "autotune", "cache_nbytes", "default_candidates", "default_plan_path",
           "policy_from_dict"]
