"""The selection pipeline: budget filter -> quality gates -> speed pick -> plan.

`autotune(loaded, settings)` returns the stored plan for the same key when there is one (and it is
not stale under probing), else measures: every candidate's bytes for (batch, max_seq_len); those
over the budget are dropped (none left: a UserError naming the smallest size and what to change);
the rest are gated against the model dtype's full-precision cache, which passes as the
reference; the passing ones are timed, and the fastest wins, where candidates within
`speed_tie` of the fastest count as tied and the one with the fewest bytes among them wins.

With `cache_auto_presses`, each press is a candidate too, alone and on quantized kinds
(candidates.PRESSED_KINDS): gated with the text's prompt (and the needle's haystack) as the
context it presses, timed on the survivors. Its `bytes` are what it allocates before the press
(the prefill needs them; the budget filter uses them), its `kept_bytes` what it holds after
(candidates.kept_slots), which the tie-break compares.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from caramba.autotune.candidates import (Candidate, baseline_policy, cache_nbytes, default_candidates, kept_slots,
                                         policy_from_dict)
from caramba.autotune.gates import run_gates
from caramba.autotune.plans import PlanStore, is_stale, key_id
from caramba.autotune.speed import measure_speed
from caramba.cache import CachePolicy
from caramba.errors import UserError
from caramba.infer.config import AutoCacheConfig, CacheConfig, Composed
from caramba.evaluation.evaluate import corpus_text
from caramba.options import option
from caramba.runs import cpu_model

MIB = 2**20
Progress = Callable[[str, int, int], None]   # (phase, done, total); phases: text, needle, speed


@dataclass(init=False, eq=True, repr=True)
class AutotuneSettings(Composed):
    """What the selection is for (budget, shape) and how it chooses (`tuning`: gates, speed, plans).
    Keywords are flat, by name or by the cache-autotune section's key (`speed_steps`, `gates`)."""

    budget_mb: float | None = option(None, gt=0, required=True,
                                     help="MiB for the whole KV cache: all layers, K+V, the batch (None: no limit)")
    max_seq_len: int = option(2048, ge=2, help="context length the cache is sized and timed for")
    batch_size: int = option(1, ge=1, help="rows the cache is sized and timed for")
    tuning: AutoCacheConfig = field(default_factory=AutoCacheConfig)
    speed_tie: float = 0.03            # within 3% of the fastest counts as a tie: fewer bytes wins

    @classmethod
    def for_cache(cls, cache: CacheConfig, batch_size: int = 1) -> AutotuneSettings:
        """What resolving `cache_kind="auto"` for this cache and batch selects for."""
        return cls(budget_mb=cache.budget_mb, max_seq_len=max(cache.max_seq_len, 2), batch_size=batch_size,
                   tuning=cache.auto)


@dataclass
class AutotuneResult:
    key: dict[str, Any]
    chosen: dict | None                # the chosen candidate's report (None: none passed)
    candidates: list[dict]             # every candidate: name, policy, bytes, fits, gates, speed, verdict, why
    status: str                        # "measured", "reused", "probed" (stale plan re-measured) or "forced"
    plan_path: Path
    needle: dict | None = None         # the needle test: code, depth, the baseline's answer, found or not
    created_utc: str | None = None

    @property
    def key_id(self) -> str:
        return key_id(self.key)

    def chosen_policy(self) -> CachePolicy:
        if self.chosen is None:
            raise UserError(no_pass_message(self))
        return policy_from_dict(self.chosen["policy"])

    def chosen_press(self) -> str | None:
        """The chosen candidate's press (PressConfig.parse's form), None without one."""
        if self.chosen is None:
            raise UserError(no_pass_message(self))
        return self.chosen.get("press")

    def to_dict(self) -> dict:
        return {"key_id": self.key_id, "key": self.key, "status": self.status, "plan_path": str(self.plan_path),
                "created_utc": self.created_utc, "needle": self.needle, "chosen": self.chosen,
                "candidates": self.candidates}


class NoCandidateError(UserError):
    """Nothing fits the budget, or nothing in budget passes the gates; `result` has the table."""

    def __init__(self, message: str, result: AutotuneResult) -> None:
        super().__init__(message)
        self.result = result


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return cpu_model() or "unknown cpu"
    return device.type


def plan_key(loaded, settings: AutotuneSettings, text: str, candidates: list[Candidate]) -> dict[str, Any]:
    """What a plan depends on: the weights, the machine, the settings and the gate text."""
    model = loaded.model
    return {
        "model_sha256": loaded.content_hash, "dtype": str(model.dtype).removeprefix("torch."),
        "weights": getattr(model, "weights", "fp32"),   # a plan timed on fp32 weights is not one for q8_0
        "device": model.device.type, "device_name": device_name(model.device), "torch": torch.__version__,
        "max_seq_len": settings.max_seq_len, "batch_size": settings.batch_size, "budget_mb": settings.budget_mb,
        "gates": settings.gates.to_dict(), "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "candidates": [c.name for c in candidates],
    }


def autotune(loaded, settings: AutotuneSettings, text_path: str | Path | None = None,
             plan_path: str | Path | None = None, force: bool = False, progress: Progress | None = None,
             notice: Callable[[str], None] | None = None) -> AutotuneResult:
    """The plan for (loaded model, settings): reused from the store, or measured and stored.
    Raises NoCandidateError (a UserError) when nothing fits the budget or passes the gates."""
    model = loaded.model
    text = corpus_text(text_path)
    candidates = default_candidates(model, settings.tuning.press_configs())
    key = plan_key(loaded, settings, text, candidates)
    store = PlanStore(plan_path or settings.tuning.plan_path, notice)
    entry = None if force else store.get(key)
    if entry is not None and not is_stale(entry, settings.tuning.probe, settings.tuning.probe_interval_sec):
        return AutotuneResult(key, entry["chosen"], entry["candidates"], "reused", store.path, entry.get("needle"),
                              entry["created_utc"])
    status = "forced" if force else ("probed" if entry is not None else "measured")
    reports, needle = _measure(model, loaded.tokenizer, text, candidates, settings, progress)
    chosen = next((r for r in reports if r["verdict"] == "chosen"), None)
    result = AutotuneResult(key, chosen, reports, status, store.path, needle)
    if not any(r["fits"] for r in reports):
        raise NoCandidateError(no_fit_message(model, settings, reports), result)
    if chosen is None:
        raise NoCandidateError(no_pass_message(result), result)
    result.created_utc = store.put(key, {"chosen": chosen, "candidates": reports, "needle": needle})["created_utc"]
    return result


def _measure(model, tokenizer, text: str, candidates: list[Candidate], s: AutotuneSettings,
             progress: Progress | None) -> tuple[list[dict], dict | None]:
    """Every candidate's report (bytes, gates, speed, verdict and why) and the needle test's info."""
    reports = [_sized(model, c, s) for c in candidates]
    fitting = [(c, r) for c, r in zip(candidates, reports) if r["fits"]]
    if not fitting:
        return reports, None
    ids = tokenizer.encode(text, add_special_tokens=False)
    needle = _gate(model, tokenizer, ids, fitting, s, progress)
    passing = [(c, r) for c, r in fitting if not r["verdict"]]
    if passing and s.tuning.benchmark:
        _speed_pick(model, ids, passing, s, progress)
    elif passing:   # cache_auto_benchmark off: the smallest passing cache
        for _, r in passing:
            r["verdict"], r["why"] = "passed", r["why"] or ["not timed (cache_auto_benchmark: false)"]
        best = min((r for _, r in passing), key=lambda r: r.get("kept_bytes", r["bytes"]))
        best["verdict"], best["why"] = "chosen", ["the fewest bytes of those passing (not timed)"]
    return reports, needle


def _sized(model, c: Candidate, s: AutotuneSettings) -> dict:
    """The candidate's report with its bytes and the budget's verdict."""
    nbytes = cache_nbytes(model, s.batch_size, s.max_seq_len, c.policy)
    fits = s.budget_mb is None or nbytes <= int(s.budget_mb * MIB)
    report = {"name": c.name, "policy": c.policy.to_dict(), "baseline": c.baseline, "bytes": nbytes, "fits": fits,
              "gates": None, "speed": None, "verdict": "" if fits else "over budget",
              "why": [] if fits else [f"{nbytes / MIB:.2f} MiB > budget {s.budget_mb:g} MiB"]}
    if c.press is not None:   # bytes: what is allocated before the press (the budget); kept_bytes: after it
        report["press"] = c.press.describe()
        report["kept_bytes"] = cache_nbytes(model, s.batch_size, kept_slots(c.press, s.max_seq_len), c.policy)
    return report


def _gate(model, tokenizer, ids: list[int], fitting: list, s: AutotuneSettings, progress) -> dict | None:
    """Gate the fitting candidates (the baseline passes as the reference); the needle info."""
    gated = [c for c, _ in fitting if not c.baseline]
    verdicts, needle = {}, None
    if gated:
        try:
            verdicts, needle = run_gates(model, tokenizer, ids, gated, baseline_policy(model), s.gates, progress)
        except ValueError as e:   # the text or settings cannot make a gate: bad input
            raise UserError(f"quality gates: {e}") from None
    for c, r in fitting:
        if c.baseline:
            r["why"] = ["the full-precision reference the gates compare with"]
            continue
        g = verdicts[c.name]
        r["gates"] = g.to_dict()
        if not g.passed:
            r["verdict"], r["why"] = "failed gates", g.why
    return needle


def _speed_pick(model, ids: list[int], passing: list, s: AutotuneSettings, progress) -> None:
    """Time the passing candidates and mark the fastest "chosen" (ties: fewer bytes)."""
    speeds = measure_speed(model, [c.policy for c, _ in passing], baseline_policy(model), ids, s.batch_size,
                           s.max_seq_len, s.tuning.speed_steps, s.tuning.speed_repeats, context=s.tuning.bench_context,
                           on_round=(lambda done, total: progress("speed", done, total)) if progress else None,
                           presses=[c.press for c, _ in passing])
    for (_, r), speed in zip(passing, speeds):
        r["speed"] = speed
        r["verdict"], r["why"] = ("passed", r["why"]) if speed["error"] is None else ("failed speed", [speed["error"]])
    timed = [r for _, r in passing if r["verdict"] == "passed"]
    if not timed:
        return
    fastest = max(r["speed"]["decode_tok_s"] for r in timed)
    tied = [r for r in timed if r["speed"]["decode_tok_s"] >= fastest * (1 - s.speed_tie)]
    best = min(tied, key=lambda r: (r.get("kept_bytes", r["bytes"]), -r["speed"]["decode_tok_s"]))
    best["verdict"] = "chosen"
    for r in timed:
        if r is not best:
            why = "slower" if r not in tied else f"within {s.speed_tie:.0%} of the fastest but more bytes"
            r["why"] = [f"{why} than {best['name']}"]


def no_fit_message(model, s: AutotuneSettings, reports: list[dict]) -> str:
    smallest = min(reports, key=lambda r: r["bytes"])
    policy = policy_from_dict(smallest["policy"])
    budget = int(s.budget_mb * MIB)
    fix = [f"raise the budget to at least {_mib_up(smallest['bytes']):g} MiB (--budget-mb / budget_mb)"]
    max_len = _largest(lambda n: cache_nbytes(model, s.batch_size, n, policy) <= budget, s.max_seq_len)
    if max_len >= 2:
        fix.append(f"lower max_seq_len to {max_len} or less")
    max_batch = _largest(lambda b: cache_nbytes(model, b, s.max_seq_len, policy) <= budget, s.batch_size)
    if max_batch >= 1:
        fix.append(f"lower batch_size to {max_batch} or less")
    return (f"no cache fits the budget of {s.budget_mb:g} MiB at max_seq_len={s.max_seq_len}, "
            f"batch_size={s.batch_size}: the smallest candidate, {smallest['name']}, needs "
            f"{smallest['bytes']} bytes ({smallest['bytes'] / MIB:.6g} MiB). To fix: " + "; or ".join(fix))


def _mib_up(nbytes: int) -> float:
    """nbytes in MiB, rounded up to 4 decimals (a budget of that size holds nbytes)."""
    return math.ceil(nbytes / MIB * 1e4) / 1e4


def no_pass_message(result: AutotuneResult) -> str:
    failed = [f"{r['name']}: {'; '.join(r['why'])}" for r in result.candidates if r["verdict"].startswith("failed")]
    over = [r["name"] for r in result.candidates if r["verdict"] == "over budget"]
    return ("no candidate within the budget passes the quality gates (" + " | ".join(failed) + ")"
            + (f"; over budget: {', '.join(over)}" if over else "")
            + ". Raise the budget so a more precise cache fits, or relax the cache_quality_* thresholds")


def _largest(fits: Callable[[int], bool], upper: int) -> int:
    """The largest n in [1, upper) with fits(n) (fits is monotone decreasing); 0 when none."""
    lo, hi = 0, upper   # fits(lo) holds (or lo = 0), fits(hi) fails
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


__all__ = ["AutotuneResult", "AutotuneSettings", "NoCandidateError", "autotune", "plan_key"]
