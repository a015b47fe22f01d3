"""Budget-aware KV cache selection: candidates, budget filter, quality gates, speed pick, plans."""

from caramba.autotune.candidates import Candidate, cache_nbytes, default_candidates, policy_from_dict
from caramba.autotune.gates import GateResult, GateSettings
from caramba.autotune.plans import PlanStore, default_plan_path
from caramba.autotune.select import AutotuneResult, AutotuneSettings, NoCandidateError, autotune

__all__ = ["AutotuneResult", "AutotuneSettings", "Candidate", "GateResult", "GateSettings", "NoCandidateError",
           "PlanStore", "autotune", "cache_nbytes", "default_candidates", "default_plan_path",
           "policy_from_dict"]
