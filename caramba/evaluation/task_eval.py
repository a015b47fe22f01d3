"""Long-context task samples (caramba.evaluation.tasks) answered through candidate KV caches.

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

Joined answers (join=True): the candidates' questions and decode steps for a batch run as one
forward over every candidate's rows, each layer attending each candidate's rows through its own
cache (caramba.evaluation.joined), up to _join_rows rows; a candidate with decoding-time compression
answers alone, and where the fused C step would step each candidate (the CPU), fewer than
JOIN_MIN_C caches answer one at a time. The decode steps join across batches too: the joined
candidates' questioned states of consecutive batches wait in a wave (up to WAVE_FORWARDS forwards
of the join's rows) and decode together, each step in forwards of up to the join's rows, so a
candidate left answering alone (the one added to a finished frontier, the others' answers stored;
a 2-bit cache's answers that run to their budget) still steps its batches side by side. The
answers are those of one candidate at a time (the tests hold them equal); a joined step's seconds
are split equally among its candidates.

The context store (caramba.evaluation.context_store): with `contexts`, a batch's shared prefill (the
baseline's context KV, the rows' positions and padding, every press's kept masks) is read from
the store when an entry holds it, verified, and written there when it is computed. The answer
store (caramba.evaluation.answer_store): with `answers`, a candidate whose answers to a batch are
stored does not store, question or decode; the batch's context is prefilled (or read) only when
some candidate still answers, and the joined path joins only those. Each answer says whether its
context and it itself were reused; each candidate's `time()` where its seconds went now, and apart
what its reused answers took when computed.

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

from caramba import gemm, threads
from caramba.cache import CachePolicy, KVCache, LayerKVCache
from caramba.cache.hybrid import SlidingLayerKVCache
from caramba.evaluation import answer_store, context_store
from caramba.evaluation.answer_store import AnswerStore
from caramba.evaluation.context_store import ContextStore, ids_sha256, model_identity
from caramba.infer.batched import free_memory_bytes
from caramba.infer.padding import left_pad
from caramba.infer.pressing import observing_all, prefill_pressed
from caramba.infer.decoding_press import DecodingPress
from caramba.evaluation.evaluate import require_finite
from caramba.evaluation.joined import joinable, prefill_together, step_together
from caramba.infer.state import DecodeState
from caramba.model.backend import Backend, TorchStep, arithmetic, choose
from caramba.model.fast_decode import JOIN_MAX_ROWS, JOIN_MEAN_ROWS, MAX_ROWS
from caramba.press import PressConfig, kept_masks
from caramba.evaluation.tasks import TaskSample, score
from caramba.version import __version__

PREFILLS = ("shared", "own")
PRECISIONS = ("fp32", "bf16")   # the shared context prefill's products (caramba.gemm.bf16_products)


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
    context_reused: bool = False   # its context's prefill came from the context store (caramba.evaluation.context_store)
    answer_reused: bool = False    # read from the answer store (caramba.evaluation.answer_store): its timings are its first run's


@dataclass
class CandidateAnswers:
    candidate: Candidate
    bytes_per_token: int                              # the candidate's cache, batch 1, all layers
    answers: list[Answer] = field(default_factory=list)
    threads: list[int | None] = field(default_factory=list)   # CPU threads each batch ran on (None: a GPU)
    kept: list[float] = field(default_factory=list)   # per batch: the share of context tokens a press kept
    store_s: float = 0.0      # seconds building its context (shared: stored in its kinds or pressed; own: prefilled)
    question_s: float = 0.0   # seconds feeding its questions
    decode_s: float = 0.0     # seconds of its answers' decode steps (a joined step's: split among its candidates)
    joined: int = 0           # batches whose answers it decoded joined with other candidates' (caramba.evaluation.joined)
    answers_reused: int = 0   # answers read from the answer store: no seconds spent on them now
    reused_s: float = 0.0     # the seconds those answers took when they were computed

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
                "bytes_per_token": self.bytes_per_token, "time": self.time(),
                "answers": [asdict(a) for a in self.answers]}

    def time(self) -> dict:
        """Where its seconds went now: its context store, its questions, its answers' decode steps;
        apart, the answers reused from the answer store and the seconds they took when computed."""
        return {"store_s": self.store_s, "question_s": self.question_s, "decode_s": self.decode_s,
                "total_s": self.store_s + self.question_s + self.decode_s, "joined_batches": self.joined,
                "answers_reused": self.answers_reused, "answers_computed": len(self.answers) - self.answers_reused,
                "reused_s": self.reused_s}


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


# The most rows (candidates x samples, of one batch or of a wave of them) one joined answer step
# decodes (caramba.evaluation.joined); a batch of samples this many rows or wider answers one
# candidate at a time.
JOIN_ROWS = 32
# The most cache bytes a wave holds waiting (its states' caches): a WAVE_SHARE of the memory free
# when the wave starts, at most WAVE_BYTES (a lone fp32 candidate's 32 batches of 8k-token contexts
# would otherwise hold ~12 GB at once on SmolLM2-135M). 8 candidates' batches of 8 rows at 1024
# tokens are ~1.3 GB a batch: two a wave decoded in 8.6 s, one at a time in 9.0-9.2.
WAVE_BYTES, WAVE_SHARE = 4 << 30, 4
# A wave holds up to this many joined forwards' rows (each step cuts its rows still answering into
# forwards of the join's rows): the entries still answering when the others are done (a 2-bit cache's
# answers running to their budget) step their batches side by side instead of each alone.
WAVE_FORWARDS = 4
# The fewest candidates worth joining where each would step alone through the fused C step and the
# joined step is the torch forward (more than JOIN_MEAN_ROWS rows a cache): one C step per candidate
# beat it for two (1.25x the time at batch 2 on SmolLM2-135M, one thread) and lost to it from four
# (0.76x; nine: 0.52x). Where the joined C step takes the rows (fast_decode.step_joined: up to
# JOIN_MEAN_ROWS a cache, JOIN_MAX_ROWS in all) two join: 0.88x one C step each at one row a cache,
# 0.68x at two (1024-token contexts, one thread).
JOIN_MIN_C = 4


def answer_tasks(model, tokenizer, samples: Sequence[TaskSample], candidates: Sequence[Candidate],
                 baseline: Candidate, *, prefill: str = "shared", q_chunk: int | None = 512,
                 eos_ids: Sequence[int] = (), batch_size: int = 1,
                 on_answer: Callable[[str, Answer], None] | None = None, join: bool = True,
                 contexts: ContextStore | None = None, answers: AnswerStore | None = None,
                 prefill_precision: str = "fp32") -> tuple[list[CandidateAnswers], float]:
    """Every candidate's answers (the baseline's last) to every sample, and the seconds spent
    prefilling contexts through the baseline. Samples run `batch_size` at a time, left-padded:
    each row attends to its own tokens only (DecodeState's holes), so a row answers as it would
    alone, up to float rounding. join: the candidates' answers to a batch decoded together, up to
    _join_rows rows a step (caramba.evaluation.joined; False: one candidate at a time). contexts: where
    shared prefills are kept between runs (caramba.evaluation.context_store); answers: where each
    candidate's answers to each batch are (caramba.evaluation.answer_store). prefill_precision "bf16":
    the shared context prefill's projections multiply in bfloat16 (caramba.gemm.bf16_products), on
    the torch path. See the module doc."""
    if prefill not in PREFILLS:
        raise ValueError(f"prefill={prefill!r}: choose one of {', '.join(PREFILLS)}")
    if prefill_precision not in PRECISIONS or (prefill_precision != "fp32" and prefill != "shared"):
        raise ValueError(f"prefill_precision={prefill_precision!r}: choose one of {', '.join(PRECISIONS)} "
                         "(bf16 with prefill='shared' only)")
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
    channel_group = math.lcm(*(_channel_group(model, c) for c in [*candidates, baseline]))
    wave = _Wave(model, tokenizer, stops)
    with contexts.writing() if contexts is not None else contextlib.nullcontext():
        for group in _batches(samples, batch_size, channel_group):
            # The cores free now (caramba.threads), chosen per batch: a long eval outlives the load it began in.
            choice = threads.choose() if device.type == "cpu" else None
            with threads.applied(choice) if choice is not None else contextlib.nullcontext():
                context_s += _answer_group(model, tokenizer, group, results, baseline, prefill, q_chunk, stops,
                                           pad, on_answer, backend, join, contexts if prefill == "shared" else None,
                                           answers if answers is not None and answers.enabled else None,
                                           prefill_precision, wave)
            for result in results:
                result.threads.append(choice.used if choice is not None else None)
        choice = threads.choose() if device.type == "cpu" and wave.pending else None
        with threads.applied(choice) if choice is not None else contextlib.nullcontext():
            wave.flush()
    for result in results:   # the samples' order (a wave's answers arrive after later batches' stored ones)
        placed: dict[tuple, list[Answer]] = {}
        for a in result.answers:
            placed.setdefault((a.task, a.length, a.index), []).append(a)
        result.answers = [placed[(s.task, s.length, s.index)].pop(0) for s in samples]
    return results, context_s


def _channel_group(model, c: Candidate) -> int:
    """The tokens a candidate's per-channel key group spans (KIVI), 1 where it has none. Its groups
    run along each row's tokens from the row's first one, so the holes a left-padded question leaves
    after a shorter row's context would shift them (the rows would answer unlike the same samples
    alone), and rows that begin at different slots modulo the group step on the torch path."""
    probe = model.new_cache(1, 1, c.policy)
    return math.lcm(1, *(cfg.qblock for layer in probe.layers for cfg in getattr(layer, "configs", ())
                         if cfg.spec.per_channel))


def _batches(samples: Sequence[TaskSample], batch_size: int, channel_group: int = 1) -> list[list[TaskSample]]:
    """The samples in batches of up to batch_size, each answered as one: samples of similar prompt
    length together (a row shorter than its batch's longest is padding the prefill computes anyway).
    With per-channel keys (channel_group > 1: the lcm of the candidates' groups) a batch is cut
    where its questions' lengths or its contexts' lengths modulo the group change (_aligned_runs),
    so the samples are ordered by those first."""
    def key(i: int) -> tuple[int, ...]:
        context, question = len(samples[i].context_ids), len(samples[i].question_ids)
        return (question, context % channel_group, context + question) if channel_group > 1 \
            else (context + question,)
    order = sorted(range(len(samples)), key=key)
    out: list[list[TaskSample]] = []
    for first in range(0, len(order), batch_size):
        batch = [samples[i] for i in order[first : first + batch_size]]
        out += _aligned_runs(batch, channel_group) if channel_group > 1 else [batch]
    return out


def _aligned_runs(batch: list[TaskSample], channel_group: int) -> list[list[TaskSample]]:
    """A batch cut into runs of samples whose questions have one length (no holes between a row's
    context and its question) and whose contexts' lengths agree modulo channel_group: left-padded to
    the longest, every row then begins at a multiple of the group, where the cache's groups begin, so
    the fused C step takes its steps. Rows that begin elsewhere (their own phases) step on the torch
    path, which reads their codes back in full every step: kv-frontier.yaml at 8 samples, 2048
    tokens (Zen 4, 2 threads), a joined step of nine caches' 8 rows with two such caches among them
    took 1.21 s, one of 72 rows all in the C step 0.41-0.48 s (docs/eval.md)."""
    runs: list[list[TaskSample]] = []
    for sample in batch:
        last = runs[-1][-1] if runs else None
        if last is not None and len(last.question_ids) == len(sample.question_ids) \
                and (len(last.context_ids) - len(sample.context_ids)) % channel_group == 0:
            runs[-1].append(sample)
        else:
            runs.append([sample])
    return runs


def _answer_group(model, tokenizer, group: Sequence[TaskSample], results: list[CandidateAnswers], baseline: Candidate,
                  prefill: str, q_chunk: int | None, stops: set[int], pad: int,
                  on_answer: Callable[[str, Answer], None] | None, backend: Backend, join: bool,
                  contexts: ContextStore | None, answers: AnswerStore | None, precision: str, wave: _Wave) -> float:
    """One batch of samples through every cache whose answers the answer store does not hold;
    returns the seconds of its shared context prefill (none when every answer was stored). The
    joined candidates' answers are questioned here and decoded in `wave` with other batches'."""
    device = model.device
    context = left_pad([s.context_ids for s in group], pad, device=device)
    question = left_pad([s.question_ids for s in group], pad, device=device)
    slots = context[0].shape[1] + question[0].shape[1] + max(s.max_new_tokens for s in group)
    # Shared: the candidates' presses watch the one context prefill (observers of equal presses are shared).
    # Every candidate's, reused or not: the prefill (its path, its context store entry) is a fresh run's.
    presses = list(dict.fromkeys(r.candidate.press for r in results if r.candidate.pressed)) if prefill == "shared" else []
    path = _prefill_path(backend, bool(presses), *context[0].shape, q_chunk, precision) if prefill == "shared" else None
    joined = _joined_plan(model, results, len(group), backend, join)
    keys = {id(r): _answer_key(model, answers, group, r.candidate, baseline, prefill, q_chunk, stops, pad, path,
                               backend, j) for r, j in zip(results, joined)} if answers is not None else {}

    def emit(result: CandidateAnswers, got: list[Answer]) -> None:
        result.answers.extend(got)
        if on_answer is not None:
            for answer in got:
                on_answer(result.candidate.label, answer)

    todo = _take_stored(results, joined, answers, keys, group, tokenizer, emit)
    # The baseline's context: for the candidates still answering from it (shared), or for its own answers.
    if not (todo and (prefill == "shared" or any(r.candidate is baseline for r, _ in todo))):
        base, kept, context_s, reused = None, [], 0.0, False
    else:
        base, kept, context_s, reused = _context(model, group, context, slots, baseline, presses, q_chunk, backend,
                                                 pad, contexts, precision)

    def build(result: CandidateAnswers) -> tuple[DecodeState, float]:
        """A candidate's state holding the context, and the seconds that took (its store)."""
        c = result.candidate
        t0 = time.perf_counter()
        if c is baseline:
            state = base
        elif prefill == "shared":
            state = _shared_context(model, base, c, slots, q_chunk, kept[presses.index(c.press)] if c.pressed else None)
        else:
            state = DecodeState(model, model.new_cache(len(group), slots, c.policy), q_chunk, backend)
            if c.pressed:
                mask = context[1]
                prefill_pressed(state, context[0], None if bool(mask.all()) else mask, c.press)
            else:
                _feed(state, *context, c.window)
        spent = time.perf_counter() - t0
        result.store_s += spent
        if c.pressed:
            result.kept.append(state.kept_share)
        return state, spent

    def record(result: CandidateAnswers, got: list[Answer], seconds: tuple[float, float, float], j: bool,
               kept: float | None) -> None:
        """Its answers, recorded and kept in the answer store (atomically: a crash loses no whole entry);
        seconds: what they took (store, question, decode); kept: its press's share kept of this batch."""
        for answer in got:
            answer.context_reused = reused
        emit(result, got)
        if answers is None:
            return
        t0 = time.perf_counter()
        store_s, question_s, decode_s = seconds
        body = {"answers": [{k: v for k, v in asdict(a).items() if k != "answer_reused"} for a in got],
                "store_s": store_s, "question_s": question_s, "decode_s": decode_s, "joined": j,
                "kept": kept if result.candidate.pressed else None}
        key = keys[id(result)]
        answers.save(key, body)
        answers.computed += 1
        answers.computed_keys.append(answers.path_of(key).stem)
        answers.save_s += time.perf_counter() - t0

    def alone(result: CandidateAnswers) -> None:
        before = _seconds(result)
        state, spent = build(result)
        kept = state.kept_share
        got = _answer_one(result, state, spent, tokenizer, group, question, stops)
        record(result, got, tuple(now - then for now, then in zip(_seconds(result), before)), False, kept)

    # The candidates still answering on the joined path, a chunk of up to `limit` rows at a time,
    # the baseline (which the others' stores read) in the last; the rest one at a time, first.
    together = [r for r, j in todo if j]
    solo = [r for r, j in todo if not j]
    for result in [r for r in solo if r.candidate is not baseline]:
        alone(result)
    limit = _join_rows(backend, len(group))
    per = limit // len(group)
    for first in range(0, len(together), per):
        chunk = together[first : first + per]
        wave.add(_questioned(model, chunk, [build(r) for r in chunk], group, question, record), limit)
    for result in [r for r in solo if r.candidate is baseline]:
        alone(result)
    return context_s


def _take_stored(results: list[CandidateAnswers], joined: list[bool], answers: AnswerStore | None, keys: dict,
                 group: Sequence[TaskSample], tokenizer, emit) -> list[tuple[CandidateAnswers, bool]]:
    """The candidates' answers the answer store holds, emitted as reused; the (candidate, joined)
    pairs still to answer."""
    todo = []
    for result, j in zip(results, joined):
        stored = _stored(answers, keys[id(result)], group, tokenizer) if answers is not None else None
        if stored is None:
            todo.append((result, j))
            continue
        result.answers_reused += len(stored["answers"])
        result.reused_s += stored["store_s"] + stored["question_s"] + stored["decode_s"]
        if result.candidate.pressed and stored["kept"] is not None:
            result.kept.append(stored["kept"])
        emit(result, stored["answers"])
    return todo


def _joined_plan(model, results: list[CandidateAnswers], rows: int, backend: Backend, join: bool) -> list[bool]:
    """Per candidate, whether it answers a batch of `rows` samples on the joined path: those whose
    answers can share a forward, in chunks of up to _join_rows rows, when there are at least the
    fewest worth joining (a short last chunk answers one at a time). Planned over every candidate,
    reused ones included, so a candidate's path (part of its answers' key) does not depend on
    which others the answer store holds."""
    per = _join_rows(backend, rows) // rows
    fewest = JOIN_MIN_C if backend.name == "c" and rows > JOIN_MEAN_ROWS else 2
    joint = [r for r in results if join and per >= fewest and _joins(model, r.candidate)]
    if len(joint) < fewest:
        joint = []
    short = len(joint) % per if per else 0
    if 0 < short < fewest:
        joint = joint[: len(joint) - short]
    return [any(r is j for j in joint) for r in results]


def _join_rows(backend: Backend, rows: int) -> int:
    """The most rows one joined step of batches of `rows` rows a candidate takes: the joined C
    step's (fast_decode.step_joined) where it takes them, else the torch forward's JOIN_ROWS."""
    return JOIN_MAX_ROWS if backend.name == "c" and rows <= JOIN_MEAN_ROWS else JOIN_ROWS


def _seconds(result: CandidateAnswers) -> tuple[float, float, float]:
    return result.store_s, result.question_s, result.decode_s


def _joins(model, c: Candidate) -> bool:
    """Whether a candidate's answers may decode joined with others': a standard-attention model
    (caramba.evaluation.joined), no decoding-time compression (which presses its state between steps)."""
    return joinable(model) and not (c.press is not None and c.press.enabled and c.press.decoding)


# ---- the shared context: prefilled, or reused from the context store ---------------------------

def _storable(model, baseline: Candidate) -> bool:
    """Whether the baseline's context cache can be kept as it is: plain float layers, unrotated
    (its values are its contents, restored bit for bit)."""
    if model.config.hybrid or model.config.attention != "standard":
        return False
    probe = model.new_cache(1, 1, baseline.policy)
    return type(probe) is KVCache and all(type(layer) is LayerKVCache and not layer.quantized
                                          and layer.rotation is None and layer.v_rotation is None
                                          for layer in probe.layers)


def _prefill_path(backend: Backend, observed: bool, B: int, T: int, q_chunk: int | None,
                  precision: str = "fp32") -> str:
    """Which path the context prefill's forwards take: the fused C step only for a chunk of at most
    its MAX_ROWS token rows (a short last chunk), and never while presses observe; bf16 products
    on the torch path only ("torch+bf16": part of the stores' keys)."""
    if precision == "bf16":
        return "torch+bf16"
    sizes = [T] if q_chunk is None or T <= q_chunk else [min(q_chunk, T - a) for a in range(0, T, q_chunk)]
    return "c" if backend.name == "c" and not observed and any(B * n <= MAX_ROWS for n in sizes) else "torch"


def _context_key(model, contexts: ContextStore, group: Sequence[TaskSample], context: tuple, baseline: Candidate,
                 q_chunk: int | None, path: str, pad: int) -> dict:
    return {"format": context_store.FORMAT, "model": contexts.model or model_identity(model, ""),
            "caramba": __version__, "torch": torch.__version__,
            "contexts": [ids_sha256(s.context_ids) for s in group],
            "pad": pad, "width": int(context[0].shape[1]),
            "baseline": {"policy": repr(baseline.policy), "window": baseline.window},
            "q_chunk": q_chunk, "path": arithmetic(path)}   # the path and the build of its kernels


def _context(model, group: Sequence[TaskSample], context: tuple, slots: int, baseline: Candidate,
             presses: list[PressConfig], q_chunk: int | None, backend: Backend, pad: int,
             contexts: ContextStore | None, precision: str = "fp32") -> tuple[DecodeState, list, float, bool]:
    """(the baseline's state holding the batch's context, each press's kept masks, seconds, whether
    it came from the context store). A stored entry is used when it holds every press's masks;
    otherwise the context is prefilled (watched by the presses; its projections in bf16 with
    precision "bf16") and the entry written."""
    B, T = context[0].shape
    key = None
    if contexts is not None and contexts.enabled and _storable(model, baseline):
        key = _context_key(model, contexts, group, context, baseline, q_chunk,
                           _prefill_path(backend, bool(presses), B, T, q_chunk, precision), pad)
    want = [repr(p) for p in presses]
    t0 = time.perf_counter()
    stored: dict[str, list] = {}
    if key is not None:
        got = contexts.load(key)
        if got is not None:
            base, stored = _restore(model, *got, B, T, slots, baseline, q_chunk, backend)
            if base is not None and all(w in stored for w in want):
                contexts.reused += 1
                contexts.reused_keys.append(contexts.path_of(key).stem)
                contexts.load_s += time.perf_counter() - t0
                return base, [stored[w] for w in want], time.perf_counter() - t0, True
            if base is None:
                contexts.bad.append(f"{contexts.path_of(key).name}: its tensors do not fit the batch")
    base = DecodeState(model, model.new_cache(B, slots, baseline.policy), q_chunk, backend)
    # observed or bf16: the torch path, whose forwards call the presses' observers and caramba.gemm
    # (the fused C step's do neither)
    bf16 = precision == "bf16"
    observed = base.using(TorchStep(model)) if presses or bf16 else contextlib.nullcontext()
    with observing_all(model, base.cache, presses) as seen, observed, \
            gemm.bf16_products() if bf16 else contextlib.nullcontext():
        _feed(base, *context, baseline.window)
    kept = [kept_masks(base.cache, s, p, base.valid_slots()) for s, p in zip(seen, presses)]
    context_s = time.perf_counter() - t0
    if key is not None:
        contexts.computed += 1
        contexts.computed_keys.append(contexts.path_of(key).stem)
        t1 = time.perf_counter()
        _save(contexts, key, base, {**stored, **dict(zip(want, kept))})
        contexts.save_s += time.perf_counter() - t1
    return base, kept, context_s, False


def _save(contexts: ContextStore, key: dict, base: DecodeState, kept: dict[str, list]) -> None:
    L = base.cache.length
    tensors = {"next_pos": base.next_pos}
    if base.slot_mask is not None:
        tensors["slot_mask"] = base.slot_mask[:, :L]
    for i, layer in enumerate(base.cache.layers):
        tensors[f"k.{i}"], tensors[f"v.{i}"] = layer.k_stream.data[:, :, :L], layer.v_stream.data[:, :, :L]
    names = list(kept)
    for j, name in enumerate(names):
        for i, mask in enumerate(kept[name]):
            tensors[f"kept.{j}.{i}"] = mask
    contexts.save(key, tensors, {"presses": names})


def _restore(model, tensors: dict, extra: dict, B: int, T: int, slots: int, baseline: Candidate, q_chunk: int | None,
             backend: Backend) -> tuple[DecodeState | None, dict[str, list]]:
    """The stored context as a state (None when its tensors do not fit) and the presses' masks."""
    cache = model.new_cache(B, slots, baseline.policy)
    n = len(cache.layers)
    try:
        for i, layer in enumerate(cache.layers):
            k, v = tensors[f"k.{i}"], tensors[f"v.{i}"]
            if tuple(k.shape[:3]) != (B, layer.n_kv_heads, T) or k.dtype != layer.k_stream.data.dtype \
                    or v.dtype != layer.v_stream.data.dtype:
                return None, {}
            layer.extend(k.to(model.device), v.to(model.device))
        next_pos = tensors["next_pos"]
        masks = {name: [tensors[f"kept.{j}.{i}"].to(model.device) for i in range(n)]
                 for j, name in enumerate(extra.get("presses", []))}
    except (KeyError, RuntimeError, ValueError):
        return None, {}
    state = DecodeState(model, cache, q_chunk, backend)
    cache.window = baseline.window
    state.next_pos = next_pos.to(model.device)
    if "slot_mask" in tensors:
        state.slot_mask = torch.zeros(B, cache.max_seq_len, dtype=torch.bool, device=model.device)
        state.slot_mask[:, :T] = tensors["slot_mask"].to(model.device)
    return state, masks


# ---- a candidate's answers to a batch, reused from the answer store --------------------------

def _answer_key(model, answers: AnswerStore, group: Sequence[TaskSample], c: Candidate, baseline: Candidate,
                prefill: str, q_chunk: int | None, stops: set[int], pad: int, path: str | None, backend: Backend,
                joined: bool) -> dict:
    """What a candidate's answers to a batch depend on (caramba.evaluation.answer_store): not its
    label, nor the samples' references and rule (a reused answer is scored again, `_stored`)."""
    press = c.press if c.press is not None and c.press.enabled else None
    return {"format": answer_store.FORMAT, "model": answers.model or model_identity(model, ""),
            "caramba": __version__, "torch": torch.__version__,
            "samples": [{"task": s.task, "length": s.length, "index": s.index, "context": ids_sha256(s.context_ids),
                         "question": ids_sha256(s.question_ids), "max_new_tokens": s.max_new_tokens} for s in group],
            "pad": pad, "eos": sorted(stops), "prefill": prefill, "q_chunk": q_chunk,
            "candidate": {"baseline": c is baseline, "policy": repr(c.policy), "window": c.window,
                          "press": repr(press) if press is not None else None},
            # the shared context every candidate's store reads: the baseline's cache, prefilled on `path`
            "baseline": {"policy": repr(baseline.policy), "window": baseline.window,
                         "path": arithmetic(path) if path is not None else None},
            "backend": arithmetic(backend.name), "joined": joined}


def _stored(answers: AnswerStore, key: dict, group: Sequence[TaskSample], tokenizer) -> dict | None:
    """The entry for `key` with its answers as Answers (flagged reused), or None. Each answer's
    text and score are made again from its ids, by the tokenizer and the scoring rule of now."""
    t0 = time.perf_counter()
    body = answers.load(key)
    if body is None:
        return None
    try:
        got = [Answer(**{**a, "answer_reused": True}) for a in body["answers"]]
        fits = [(a.task, a.length, a.index) for a in got] == [(s.task, s.length, s.index) for s in group]
        fits = fits and "kept" in body and all(isinstance(body[k], (int, float))
                                                for k in ("store_s", "question_s", "decode_s"))
    except (KeyError, TypeError):
        fits = False
    if not fits:
        answers.discard(key, "its answers do not fit the batch")
        return None
    for answer, sample in zip(got, group):
        answer.text = tokenizer.decode(answer.output_ids, skip_special_tokens=True)
        answer.score = score(answer.text, sample.answers, sample.metric)
    answers.reused += 1
    answers.reused_keys.append(answers.path_of(key).stem)
    answers.load_s += time.perf_counter() - t0
    return {**body, "answers": got}


def _shared_context(model, base: DecodeState, c: Candidate, slots: int, q_chunk: int | None, kept) -> DecodeState:
    """A candidate's state holding the baseline's context in its own kinds: stored whole, or
    (with a press) only the survivors the press chose from the full-precision context (kept)."""
    B = base.batch_size
    state = DecodeState(model, base.cache, q_chunk, base.backend)
    state.next_pos = base.next_pos.clone()
    state.slot_mask = None if base.slot_mask is None else base.slot_mask.clone()
    if c.pressed:
        state.press(kept, model.new_cache(B, 1, c.policy), ragged_rows=not c.press.decoding)
    else:
        state.cache = model.new_cache(B, slots, c.policy)
        state.cache.set_origins(base.row_origins())   # per-channel keys: each row's groups from its first token
        store_context(base.cache, state.cache, model.dtype)
    return state


def _feed(state: DecodeState, tokens: torch.Tensor, mask: torch.Tensor, window: int | None) -> torch.Tensor:
    """Feed [B, T] left-padded tokens -> each row's next-token logits [B, V]."""
    state.cache.window = window
    return state.prefill(tokens, None if bool(mask.all()) else mask)


# ---- answers --------------------------------------------------------------------------------

class _Rows:
    """One candidate's greedy answers to a batch, row by row: its outputs, which rows still run,
    the decode steps each took."""

    def __init__(self, group: Sequence[TaskSample], device) -> None:
        self.group = group
        self.outputs: list[list[int]] = [[] for _ in group]
        self.active = torch.ones(len(group), dtype=torch.bool, device=device)
        self.steps = [0] * len(group)

    def take(self, logits: torch.Tensor, stops: set[int], label: str) -> torch.Tensor:
        """The next token of every row from its logits [B, V]; rows reaching an end-of-reply id
        or their budget stop."""
        # argmax of NaN logits is a token like any other: an answer from them would be scored as if real
        require_finite(logits[self.active], f"candidate {label}, {self.group[0].task} at {self.group[0].length} tokens")
        tokens = logits.argmax(dim=-1)
        for row, token in enumerate(tokens.tolist()):
            if not self.active[row]:
                continue
            if token in stops:
                self.active[row] = False
                continue
            self.outputs[row].append(token)
            if len(self.outputs[row]) == self.group[row].max_new_tokens:
                self.active[row] = False
            else:
                self.steps[row] += 1
        return tokens

    @property
    def running(self) -> bool:
        return bool(self.active.any())

    @property
    def mask(self) -> torch.Tensor | None:
        return None if bool(self.active.all()) else self.active

    def answers(self, tokenizer, prefill_s: float, decode_s: float) -> list[Answer]:
        """The batch's answers, scored; its seconds shared equally among its rows."""
        B = len(self.group)
        out = []
        for sample, ids, n in zip(self.group, self.outputs, self.steps):
            text = tokenizer.decode(ids, skip_special_tokens=True)
            out.append(Answer(sample.task, sample.length, sample.index, ids, text,
                              score(text, sample.answers, sample.metric), prefill_s / B, decode_s / B, n))
        return out


def _answer_one(result: CandidateAnswers, state: DecodeState, spent: float, tokenizer, group: Sequence[TaskSample],
                question: tuple[torch.Tensor, torch.Tensor], stops: set[int]) -> list[Answer]:
    """One candidate's answers alone, with its decoding-time compression if its press has it;
    spent: the seconds its store took."""
    c = result.candidate
    decoding = DecodingPress(state, c.press) if c.press is not None and c.press.decoding else None
    answers, question_s, decode_s = _answer(state, tokenizer, group, question, c.window, stops, spent, decoding,
                                            c.label)
    result.question_s += question_s
    result.decode_s += decode_s
    return answers


@torch.inference_mode()
def _answer(state: DecodeState, tokenizer, group: Sequence[TaskSample], question: tuple[torch.Tensor, torch.Tensor],
            window: int | None, stops: set[int], spent: float = 0.0, decoding: DecodingPress | None = None,
            label: str = "") -> tuple[list[Answer], float, float]:
    """Greedy: feed the questions, then one token per row until its end-of-reply id or budget; a
    finished row's later slots are holes. -> (answers, the questions' seconds, the decode steps').
    spent: the candidate's seconds before its question (its store), in each answer's prefill_s.
    decoding: the candidate's decoding-time compression (press_interval), stepped with the answer."""
    t0 = time.perf_counter()
    logits = _feed(state, *question, window)
    question_s = time.perf_counter() - t0
    rows = _Rows(group, logits.device)
    t0 = time.perf_counter()
    while True:
        tokens = rows.take(logits, stops, label)
        if not rows.running:
            break
        if decoding is not None:
            decoding.before_step()
        logits = state.step(tokens, rows.mask)
        if decoding is not None:
            decoding.after_step(rows.active)
    if decoding is not None:
        decoding.close()
    decode_s = time.perf_counter() - t0
    return rows.answers(tokenizer, spent + question_s, decode_s), question_s, decode_s


@dataclass
class _Pending:
    """One candidate's answers to one batch, its questions fed, waiting for its wave's decode steps."""

    result: CandidateAnswers
    state: DecodeState
    group: Sequence[TaskSample]
    logits: torch.Tensor                 # [B, V] after its question (then after its last step)
    store_s: float
    question_s: float
    done: Callable                       # _answer_group's record(result, answers, seconds, joined, kept)
    kept: float | None = None            # its press's share kept (the state's, as built)
    decode_s: float = 0.0
    rows: _Rows | None = None


class _Wave:
    """Joined answers of consecutive batches decoded together: every candidate's rows of every batch
    in it (up to WAVE_FORWARDS forwards of the join's rows, _join_rows) step together, each token in
    forwards of up to the join's rows (caramba.evaluation.joined). A candidate that is the only one
    left answering a batch (the one new candidate of a finished frontier) thus still decodes its
    batches side by side, not one batch at a time."""

    def __init__(self, model, tokenizer, stops: set[int]) -> None:
        self.model, self.tokenizer, self.stops = model, tokenizer, stops
        self.pending: list[_Pending] = []
        self.rows = 0      # the most rows a forward of the entries held takes (0: none held)
        self.bytes = min(WAVE_BYTES, free_memory_bytes(model.device) // WAVE_SHARE)

    def add(self, entries: list[_Pending], rows: int = JOIN_ROWS) -> None:
        """Entries joining the wave; rows: the most rows a forward of them takes (_join_rows). The
        wave holds up to WAVE_FORWARDS such forwards' rows and its bytes of caches."""
        held = [*self.pending, *entries]
        limit = min(rows, self.rows) if self.pending else rows
        if self.pending and (sum(len(p.group) for p in held) > WAVE_FORWARDS * limit
                             or sum(p.state.cache.nbytes for p in held) > self.bytes):
            self.flush()
            limit = rows
        self.pending += entries
        self.rows = limit

    def flush(self) -> None:
        pending, rows, self.pending, self.rows = self.pending, self.rows, [], 0
        if not pending:
            return
        _decode_joined(self.model, pending, self.stops, rows)
        for p in pending:
            result = p.result
            result.question_s += p.question_s
            result.decode_s += p.decode_s
            result.joined += 1
            got = p.rows.answers(self.tokenizer, p.store_s + p.question_s, p.decode_s)
            p.done(result, got, (p.store_s, p.question_s, p.decode_s), True, p.kept)


@torch.inference_mode()
def _questioned(model, results: list[CandidateAnswers], built: list[tuple[DecodeState, float]],
                group: Sequence[TaskSample], question: tuple[torch.Tensor, torch.Tensor], done: Callable) -> list[_Pending]:
    """Several candidates' questions to one batch fed, joined (one forward, each through its own
    cache) when they are one chunk of q_chunk, else one at a time; a joined forward's seconds split
    equally among them. built: each candidate's state and its store's seconds."""
    states = [state for state, _ in built]
    n = len(states)
    tokens, mask = question
    t0 = time.perf_counter()
    if all(s.q_chunk is None or tokens.shape[1] <= s.q_chunk for s in states):
        for result, state in zip(results, states):
            state.cache.window = result.candidate.window
        logits = prefill_together(model, states, tokens, None if bool(mask.all()) else mask)
        question_s = [(time.perf_counter() - t0) / n] * n
    else:
        logits, question_s = [], []
        for result, state in zip(results, states):
            t0 = time.perf_counter()
            logits.append(_feed(state, *question, result.candidate.window))
            question_s.append(time.perf_counter() - t0)
    return [_Pending(r, state, group, x, spent, q, done, state.kept_share)
            for r, (state, spent), x, q in zip(results, built, logits, question_s)]


@torch.inference_mode()
def _decode_joined(model, pending: list[_Pending], stops: set[int], rows: int = JOIN_ROWS) -> None:
    """Greedy answers of every pending entry: each step decodes the rows of the entries still
    answering, in order, in forwards of up to `rows` rows (an entry alone in one steps alone); a
    forward's seconds are split equally among the entries in it."""
    for p in pending:
        p.rows = _Rows(p.group, p.logits.device)
    live, widths = list(range(len(pending))), [len(p.group) for p in pending]
    while True:
        tokens = {}
        for i in live:   # choosing the tokens is decoding too: its own seconds, as the forwards' below
            t0 = time.perf_counter()
            tokens[i] = pending[i].rows.take(pending[i].logits, stops, pending[i].result.candidate.label)
            pending[i].decode_s += time.perf_counter() - t0
        live = [i for i in live if pending[i].rows.running]
        if not live:
            break
        for part in _forwards(live, widths, rows):
            t0 = time.perf_counter()
            if len(part) == 1:
                (i,) = part
                out = [pending[i].state.step(tokens[i], pending[i].rows.mask)]
            else:
                out = step_together(model, [pending[i].state for i in part], [tokens[i] for i in part],
                                    [pending[i].rows.mask for i in part])
            dt = time.perf_counter() - t0
            for i, x in zip(part, out):
                pending[i].logits = x
                pending[i].decode_s += dt / len(part)


def _forwards(live: list[int], widths: list[int], rows: int) -> list[list[int]]:
    """The entries `live` (in order) cut into runs of at most `rows` rows (widths[i]: entry i's), one
    forward each; an entry wider than `rows` is a run of its own."""
    parts: list[list[int]] = []
    used = 0
    for i in live:
        if parts and used + widths[i] <= rows:
            parts[-1].append(i)
            used += widths[i]
        else:
            parts.append([i])
            used = widths[i]
    return parts
