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

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from caramba import threads
from caramba.cache import CachePolicy, KVCache, LayerKVCache
from caramba.cache.hybrid import SlidingLayerKVCache
from caramba.infer.padding import left_pad
from caramba.infer.pressing import observing_all, prefill_pressed
from caramba.infer.decoding_press import DecodingPress
from caramba.infer.evaluate import require_finite
from caramba.infer.state import DecodeState
from caramba.model.backend import Backend, TorchStep, choose
from caramba.press import PressConfig, kept_masks
from caramba.infer.tasks import TaskSample, score

PREFILLS = ("shared", "own")


@dataclass(frozen=True)
class Candidate:
    """One cache to evaluate: its label (names its metrics), policy and an optional window."""

    label: str
    policy: CachePolicy
    window: int | None = None    # sliding-window span over the cache's slots: changes outputs
    press: PressConfig | None = None   # KV eviction of the context before the question (caramba.press)

    @property
    def pressed(self) -> bool:
        return self.press is not None and self.press.active


@dataclass
class Answer:
    task: str
    length: int
    index: int
    output_ids: list[int]
    text: str
    score: float
    prefill_s: float     # the candidate's own work before its first answer token (question; own: context)
    decode_s: float      # the answer's decode steps after the first token (a batch's: shared by its rows)
    steps: int           # decode steps this row took (tokens after the first)


@dataclass
class CandidateAnswers:
    candidate: Candidate
    bytes_per_token: int                              # the candidate's cache, batch 1, all layers
    answers: list[Answer] = field(default_factory=list)
    threads: list[int | None] = field(default_factory=list)   # CPU threads each batch ran on (None: a GPU)
    kept: list[float] = field(default_factory=list)   # per batch: the share of context tokens a press kept

    def kept_fraction(self) -> float:
        """The share of context (layer, head, token) entries the cache kept: 1 without a press."""
        return sum(self.kept) / len(self.kept) if self.kept else 1.0

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
        press = self.candidate.press.describe() if self.candidate.press is not None and self.candidate.press.enabled else None
        return {"label": self.candidate.label, "policy": self.candidate.policy.describe(),
                "window": self.candidate.window, "press": press, "kept_fraction": self.kept_fraction(),
                "bytes_per_token": self.bytes_per_token,
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
        if type(src) is SlidingLayerKVCache:   # a hybrid model's ring: its newest slots, in slot order
            keys, values, first = src.slot_contents(dtype)
            dst.length = first
            dst.extend(keys, values)
        else:
            dst.extend(*src.contents(n, dtype))


def answer_tasks(model, tokenizer, samples: Sequence[TaskSample], candidates: Sequence[Candidate],
                 baseline: Candidate, *, prefill: str = "shared", q_chunk: int | None = 512,
                 eos_ids: Sequence[int] = (), batch_size: int = 1,
                 on_answer: Callable[[str, Answer], None] | None = None) -> tuple[list[CandidateAnswers], float]:
    """Every candidate's answers (the baseline's last) to every sample, and the seconds spent
    prefilling contexts through the baseline. Samples run `batch_size` at a time, left-padded:
    each row attends to its own tokens only (DecodeState's holes), so a row answers as it would
    alone, up to float rounding. See the module doc for the protocol."""
    if prefill not in PREFILLS:
        raise ValueError(f"prefill={prefill!r}: choose one of {', '.join(PREFILLS)}")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    if prefill == "shared" and model.config.attention == "decoupled":
        prefill = "own"   # a decoupled cache's three streams have no shared-context copy yet
    # Bytes per token at the samples' mean length: a hybrid model's rings stop growing at their window.
    mean = max(1, round(sum(len(s.prompt_ids) for s in samples) / max(len(samples), 1)))
    shape = 1 if not model.config.hybrid else mean
    results = [CandidateAnswers(c, model.new_cache(1, shape, c.policy).bytes_per_token_at(mean))
               for c in [*candidates, baseline]]
    context_s = 0.0
    stops = set(eos_ids)
    pad = next(iter(stops), 0)
    device = model.device
    backend = choose(model)     # one for the whole eval: its thread choice carries across batches
    # Batches of samples of similar length: a row shorter than its batch's longest is padding the
    # prefill computes anyway. The answers are put back in the samples' order at the end.
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].context_ids) + len(samples[i].question_ids))
    for first in range(0, len(order), batch_size):
        group = [samples[i] for i in order[first : first + batch_size]]
        # The cores free now (caramba.threads), chosen per batch: a long eval outlives the load it began in.
        choice = threads.choose() if device.type == "cpu" else None
        with threads.applied(choice) if choice is not None else contextlib.nullcontext():
            context_s += _answer_group(model, tokenizer, group, results, baseline, prefill, q_chunk, stops, pad,
                                       on_answer, backend)
        for result in results:
            result.threads.append(choice.used if choice is not None else None)
    for result in results:
        placed = dict(zip(order, result.answers))
        result.answers = [placed[i] for i in range(len(samples))]
    return results, context_s


def _answer_group(model, tokenizer, group: Sequence[TaskSample], results: list[CandidateAnswers], baseline: Candidate,
                  prefill: str, q_chunk: int | None, stops: set[int], pad: int,
                  on_answer: Callable[[str, Answer], None] | None, backend: Backend) -> float:
    """One batch of samples through every cache; returns the seconds of its shared context prefill."""
    device = model.device
    context = left_pad([s.context_ids for s in group], pad, device=device)
    question = left_pad([s.question_ids for s in group], pad, device=device)
    slots = context[0].shape[1] + question[0].shape[1] + max(s.max_new_tokens for s in group)
    base = DecodeState(model, model.new_cache(len(group), slots, baseline.policy), q_chunk, backend)
    # Shared: the candidates' presses watch the one context prefill (observers of equal presses are shared).
    presses = list(dict.fromkeys(r.candidate.press for r in results if r.candidate.pressed)) if prefill == "shared" else []
    t0 = time.perf_counter()
    # observed: the torch path, whose forwards call the presses' observers (the fused C step's do not)
    observed = base.using(TorchStep(model)) if presses else contextlib.nullcontext()
    with observing_all(model, base.cache, presses) as seen, observed:
        _feed(base, *context, baseline.window)
    context_s = time.perf_counter() - t0
    for result in results:
        c = result.candidate
        t0 = time.perf_counter()
        if c is baseline:
            state = base
        elif prefill == "shared":
            state = _shared_context(model, base, c, slots, q_chunk, seen[presses.index(c.press)] if c.pressed else None)
        else:
            state = DecodeState(model, model.new_cache(len(group), slots, c.policy), q_chunk, backend)
            if c.pressed:
                mask = context[1]
                prefill_pressed(state, context[0], None if bool(mask.all()) else mask, c.press)
            else:
                _feed(state, *context, c.window)
        if c.pressed:
            result.kept.append(state.kept_share)
        decoding = DecodingPress(state, c.press) if c.press is not None and c.press.decoding else None
        for answer in _answer(state, tokenizer, group, question, c.window, stops, time.perf_counter() - t0, decoding,
                              c.label):
            result.answers.append(answer)
            if on_answer is not None:
                on_answer(c.label, answer)
    return context_s


def _shared_context(model, base: DecodeState, c: Candidate, slots: int, q_chunk: int | None, seen) -> DecodeState:
    """A candidate's state holding the baseline's context in its own kinds: stored whole, or
    (with a press) only the survivors, chosen from the full-precision context."""
    B = base.batch_size
    state = DecodeState(model, base.cache, q_chunk, base.backend)
    state.next_pos = base.next_pos.clone()
    state.slot_mask = None if base.slot_mask is None else base.slot_mask.clone()
    if c.pressed:
        state.press(kept_masks(base.cache, seen, c.press, base.valid_slots()), model.new_cache(B, 1, c.policy),
                    ragged_rows=not c.press.decoding)
    else:
        state.cache = model.new_cache(B, slots, c.policy)
        state.cache.set_origins(base.row_origins())   # per-channel keys: each row's groups from its first token
        store_context(base.cache, state.cache, model.dtype)
    return state


def _feed(state: DecodeState, tokens: torch.Tensor, mask: torch.Tensor, window: int | None) -> torch.Tensor:
    """Feed [B, T] left-padded tokens -> each row's next-token logits [B, V]."""
    state.cache.window = window
    return state.prefill(tokens, None if bool(mask.all()) else mask)


@torch.inference_mode()
def _answer(state: DecodeState, tokenizer, group: Sequence[TaskSample], question: tuple[torch.Tensor, torch.Tensor],
            window: int | None, stops: set[int], spent: float, decoding: DecodingPress | None = None,
            label: str = "") -> list[Answer]:
    """Greedy: feed the questions, then one token per row until its end-of-reply id or budget; a
    finished row's later slots are holes. The batch's seconds are shared equally among its rows.
    decoding: the candidate's decoding-time compression (press_interval), stepped with the answer."""
    B = len(group)
    t0 = time.perf_counter()
    logits = _feed(state, *question, window)
    prefill_s = spent + time.perf_counter() - t0
    outputs: list[list[int]] = [[] for _ in range(B)]
    active = torch.ones(B, dtype=torch.bool, device=logits.device)
    steps = [0] * B
    t0 = time.perf_counter()
    while True:
        # argmax of NaN logits is a token like any other: an answer from them would be scored as if real
        require_finite(logits[active], f"candidate {label}, {group[0].task} at {group[0].length} tokens")
        tokens = logits.argmax(dim=-1)
        for row, token in enumerate(tokens.tolist()):
            if not active[row]:
                continue
            if token in stops:
                active[row] = False
                continue
            outputs[row].append(token)
            if len(outputs[row]) == group[row].max_new_tokens:
                active[row] = False
            else:
                steps[row] += 1
        if not bool(active.any()):
            break
        if decoding is not None:
            decoding.before_step()
        logits = state.step(tokens, None if bool(active.all()) else active)
        if decoding is not None:
            decoding.after_step(active)
    if decoding is not None:
        decoding.close()
    decode_s = time.perf_counter() - t0
    answers = []
    for sample, out, n in zip(group, outputs, steps):
        text = tokenizer.decode(out, skip_special_tokens=True)
        answers.append(Answer(sample.task, sample.length, sample.index, out, text, score(text, sample.answers, sample.metric),
                              prefill_s / B, decode_s / B, n))
    return answers
