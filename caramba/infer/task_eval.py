"""Long-context task samples (caramba.infer.tasks) answered through candidate KV caches.

Every candidate answers exactly the same samples. Per sample:
1. The context (everything before the question) is prefilled once, in chunks of `q_chunk`
   tokens, through the baseline's cache.
2. prefill="shared" (the default): each candidate stores that context's keys and values in its
   own kinds (quantized on write, rotated, with its full-precision residual window), as HF's
   QuantizedCache and kvpress apply compression to what a full-precision prefill computed.
   prefill="own": each candidate prefills the context itself, exactly as `generate` does (every
   chunk after the first then reads the earlier chunks' stored, compressed keys); one prefill
   per candidate instead of one per sample.
3. The question is fed through the candidate's cache, the answer decoded greedily (up to the
   task's budget or an end-of-reply id) and scored as RULER scores it (`tasks.score`).
The baseline answers last, from the cache that holds the context.

Scores per (task, length) come with a 95% Wilson interval over the samples: a mean of n
per-sample scores in [0, 1] treated as a proportion, which, unlike the normal interval, does
not collapse to zero width when every sample scored 1 (or 0).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from caramba.cache import CachePolicy, KVCache, LayerKVCache
from caramba.infer.state import DecodeState
from caramba.infer.tasks import TaskSample, score

PREFILLS = ("shared", "own")


@dataclass(frozen=True)
class Candidate:
    """One cache to evaluate: its label (names its metrics), policy and an optional window."""

    label: str
    policy: CachePolicy
    window: int | None = None    # sliding-window span over the cache's slots: changes outputs


@dataclass
class Answer:
    task: str
    length: int
    index: int
    output_ids: list[int]
    text: str
    score: float
    prefill_s: float     # the candidate's own work before its first answer token (question; own: context)
    decode_s: float      # the answer's decode steps after the first token
    steps: int           # decode steps taken (tokens after the first)


@dataclass
class CandidateAnswers:
    candidate: Candidate
    bytes_per_token: int                              # the candidate's cache, batch 1, all layers
    answers: list[Answer] = field(default_factory=list)

    def cells(self) -> dict[str, dict[int, dict]]:
        """task -> length -> {score, n, ci_low, ci_high}: the mean score of the cell's samples."""
        grouped: dict[tuple[str, int], list[float]] = {}
        for a in self.answers:
            grouped.setdefault((a.task, a.length), []).append(a.score)
        out: dict[str, dict[int, dict]] = {}
        for (task, length), scores in grouped.items():
            mean = sum(scores) / len(scores)
            low, high = wilson(mean, len(scores))
            out.setdefault(task, {})[length] = {"score": mean, "n": len(scores), "ci_low": low, "ci_high": high}
        return out

    def decode_tok_s(self) -> float | None:
        steps, seconds = sum(a.steps for a in self.answers), sum(a.decode_s for a in self.answers)
        return steps / seconds if seconds > 0 else None

    def to_dict(self) -> dict:
        return {"label": self.candidate.label, "policy": self.candidate.policy.describe(),
                "window": self.candidate.window, "bytes_per_token": self.bytes_per_token,
                "answers": [asdict(a) for a in self.answers]}


def wilson(mean: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion `mean` observed over n samples (95% with z=1.96)."""
    if n < 1:
        raise ValueError("a confidence interval needs at least one sample")
    centre = (mean + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(max(mean * (1 - mean), 0.0) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def store_context(source: KVCache, target: KVCache, dtype: torch.dtype = torch.float32) -> None:
    """Write the source cache's slots into the (empty) target in the target's own kinds."""
    if target.length:
        raise ValueError("store_context needs an empty target cache")
    n = source.length
    for src, dst in zip(source.layers, target.layers):
        if not (isinstance(src, LayerKVCache) and isinstance(dst, LayerKVCache)):
            raise ValueError("prefill: shared needs standard attention caches; use prefill: own")
        dst.extend(*src.contents(n, dtype))


def answer_tasks(model, tokenizer, samples: Sequence[TaskSample], candidates: Sequence[Candidate],
                 baseline: Candidate, *, prefill: str = "shared", q_chunk: int | None = 512,
                 eos_ids: Sequence[int] = (), on_answer: Callable[[str, Answer], None] | None = None,
                 ) -> tuple[list[CandidateAnswers], float]:
    """Every candidate's answers (the baseline's last) to every sample, and the seconds spent
    prefilling contexts through the baseline. See the module doc for the protocol."""
    if prefill not in PREFILLS:
        raise ValueError(f"prefill={prefill!r}: choose one of {', '.join(PREFILLS)}")
    if prefill == "shared" and model.config.attention == "decoupled":
        prefill = "own"   # a decoupled cache's three streams have no shared-context copy yet
    everyone = [*candidates, baseline]
    results = [CandidateAnswers(c, model.new_cache(1, 1, c.policy).bytes_per_token()) for c in everyone]
    context_s = 0.0
    stops = set(eos_ids)
    for sample in samples:
        slots = len(sample.context_ids) + len(sample.question_ids) + sample.max_new_tokens
        base = DecodeState(model, model.new_cache(1, slots, baseline.policy), q_chunk)
        t0 = time.perf_counter()
        _feed(base, sample.context_ids, baseline.window)
        context_s += time.perf_counter() - t0
        for result in results:
            c = result.candidate
            t0 = time.perf_counter()
            if c is baseline:
                state = base
            else:
                state = DecodeState(model, model.new_cache(1, slots, c.policy), q_chunk)
                if prefill == "shared":
                    store_context(base.cache, state.cache, model.dtype)
                    state.next_pos += base.cache.length
                else:
                    _feed(state, sample.context_ids, c.window)
            answer = _answer(state, tokenizer, sample, c.window, stops, time.perf_counter() - t0)
            result.answers.append(answer)
            if on_answer is not None:
                on_answer(c.label, answer)
    return results, context_s


def _feed(state: DecodeState, ids: list[int], window: int | None) -> torch.Tensor:
    state.cache.window = window
    tokens = torch.tensor([ids], dtype=torch.long, device=state.model.device)
    return state.prefill(tokens)


@torch.inference_mode()
def _answer(state: DecodeState, tokenizer, sample: TaskSample, window: int | None, stops: set[int],
            spent: float) -> Answer:
    """Greedy: feed the question, then one token at a time until an end-of-reply id or the budget."""
    t0 = time.perf_counter()
    logits = _feed(state, sample.question_ids, window)
    prefill_s = spent + time.perf_counter() - t0
    out: list[int] = []
    t0 = time.perf_counter()
    steps = 0
    while True:
        token = int(logits[0].argmax())
        if token in stops:
            break
        out.append(token)
        if len(out) == sample.max_new_tokens:
            break
        logits = state.step(torch.tensor([token], device=state.model.device))
        steps += 1
    decode_s = time.perf_counter() - t0
    text = tokenizer.decode(out, skip_special_tokens=True)
    return Answer(sample.task, sample.length, sample.index, out, text, score(text, sample.answers),
                  prefill_s, decode_s, steps)
