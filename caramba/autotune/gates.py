"""Quality gates: what a candidate cache costs against the model dtype's full-precision cache.

Two measurements, both on real text: teacher-forced scoring of the text through the cache
(caramba.evaluation.evaluate: dNLL, PPL ratio, mean KL) and the needle in a haystack
(caramba.autotune.needle). The gates fail closed: a measurement that raises fails its candidate
with the error as the reason, and a NaN fails every threshold it is compared with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from caramba.autotune.candidates import Candidate
from caramba.autotune.needle import baseline_answer, build_haystack, needle_scores
from caramba.cache import CachePolicy
from caramba.infer.config import GateSettings
from caramba.evaluation.evaluate import evaluate_cache

@dataclass
class GateResult:
    dnll: float | None = None
    ppl_ratio: float | None = None
    kl_mean: float | None = None
    kl_max: float | None = None
    top1_agreement: float | None = None
    needle_kl: float | None = None
    needle_match: bool | None = None
    passed: bool = False
    why: list[str] = field(default_factory=list)   # the failed gates (empty when passed)

    def to_dict(self) -> dict:
        return asdict(self)


def run_gates(model, tokenizer, text_ids: Sequence[int], candidates: Sequence[Candidate], baseline: CachePolicy,
              settings: GateSettings, on_step: Callable[[str, int, int], None] | None = None
              ) -> tuple[dict[str, GateResult], dict]:
    """Gate every candidate -> (verdict per candidate name, what the needle test was: code, depth,
    the baseline's answer and whether it found the code). on_step(phase, done, total) reports progress."""
    s = settings
    n_text = s.cache_quality_prompt_len + s.cache_quality_decode_steps
    if len(text_ids) < n_text:
        raise ValueError(f"the gate text has {len(text_ids)} tokens; cache_quality_prompt_len + "
                         f"cache_quality_decode_steps = {n_text}: use a longer text or smaller settings")
    candidates = list(candidates)
    text_step = (lambda done, total: on_step("text", done, total)) if on_step else None
    text = _isolated(lambda cs: evaluate_cache(model, list(text_ids[:n_text]), [c.policy for c in cs], baseline,
                                               s.cache_quality_prompt_len, on_step=text_step,
                                               presses=[c.press for c in cs]), candidates)
    haystack = build_haystack(tokenizer, list(text_ids), s.cache_quality_needle_len, s.cache_quality_needle_depth)
    info = {"code": haystack.code, "context_tokens": len(haystack.ids), "depth_tokens": haystack.depth_tokens}
    if on_step:   # the bar (and its clock) shows while the needle's long prefills run
        on_step("needle", 0, 1)
    try:
        answer = baseline_answer(model, haystack.ids, baseline, haystack.answer_len)
    except Exception as e:  # no reference answer: every candidate fails the needle gate
        needle = [e] * len(candidates)
    else:
        info["baseline_answer"] = tokenizer.decode(answer)
        info["baseline_found"] = info["baseline_answer"].strip() == haystack.code
        needle = _isolated(lambda cs: needle_scores(model, haystack, answer, [c.policy for c in cs], baseline,
                                                    [c.press for c in cs]), candidates)
    if on_step:
        on_step("needle", 1, 1)
    return {c.name: _verdict(t, n, s) for c, t, n in zip(candidates, text, needle)}, info


def _isolated(measure: Callable[[list[Candidate]], list], candidates: list[Candidate]) -> list:
    """measure(candidates) in one lockstep pass; if it raises, each candidate alone, so one failing
    candidate fails itself only. An error is returned in place of its candidate's result."""
    try:
        return list(measure(candidates))
    except Exception:
        out = []
        for p in candidates:
            try:
                out.append(measure([p])[0])
            except Exception as e:
                out.append(e)
        return out


def _verdict(text, needle, s: GateSettings) -> GateResult:
    r = GateResult()
    for name, value in (("text scoring", text), ("needle", needle)):
        if isinstance(value, Exception):
            r.why.append(f"{name} gate error: {type(value).__name__}: {value}")
    if not isinstance(text, Exception):
        r.dnll, r.ppl_ratio, r.kl_mean, r.kl_max, r.top1_agreement = (text.dnll, text.ppl_ratio, text.kl_mean,
                                                                      text.kl_max, text.top1_agreement)
        _check(r, "dNLL", r.dnll, s.cache_quality_max_delta_nll)
        _check(r, "PPL ratio", r.ppl_ratio, s.cache_quality_max_ppl_ratio)
        _check(r, "mean KL", r.kl_mean, s.cache_quality_max_mean_kl)
    if not isinstance(needle, Exception):
        r.needle_kl, r.needle_match = needle["kl_mean"], needle["match"]
        _check(r, "needle KL", r.needle_kl, s.cache_quality_needle_max_kl)
        if not r.needle_match:
            r.why.append("needle: greedy answer differs from the baseline's")
    r.passed = not r.why
    return r


def _check(r: GateResult, name: str, value: float, limit: float) -> None:
    if not value <= limit:  # NaN fails too
        r.why.append(f"{name} {value:.4g} > {limit:g}")
