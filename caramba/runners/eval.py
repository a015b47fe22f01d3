"""`mode: eval`: candidate KV caches against a baseline, on a text's perplexity and on
long-context tasks; one result row per candidate (docs/eval.md).

Every candidate sees exactly the same token ids: the perplexity text is tokenized once, and
the task samples are generated once from (task, length, seed, generator version) and recorded
with their sha256, so a record says which prompts its scores come from.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import time
from dataclasses import asdict
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import Progress
from rich.table import Table

from caramba import gemm, threads
from caramba.errors import UserError
from caramba.progress import Steps
from caramba.evaluation import tasks as task_suite
from caramba.evaluation.answer_store import PERPLEXITY_SUBDIR, AnswerStore, baseline_logits_key, perplexity_key
from caramba.evaluation.context_store import ContextStore, model_identity
from caramba.evaluation.evaluate import BaselineLogits, EvalResult, adds_bos, corpus_text, evaluate_cache, evaluate_chunks
from caramba.evaluation.task_eval import JOIN_ROWS, Candidate, CandidateAnswers, answer_tasks
from caramba.manifest import ResolvedRun
from caramba.manifest.schema import EvalSettings, PerplexitySettings, TaskSettings
from caramba.model.backend import arithmetic, choose
from caramba.model.zoo import DTYPES, LoadedModel, inspect_source, load_model, resolve_device, resolve_source
from caramba.runners.generate import check_pressable
from caramba.runners.registry import BASE_RECORD, KIB, Mode, Workload, is_number, register
from caramba.runs import RunDir
from caramba.tokenizer import Tokenizer


def candidates_of(settings: EvalSettings) -> tuple[list[Candidate], Candidate]:
    def build(c) -> Candidate:
        return Candidate(c.label, c.policy(), c.decode_local_window, c.press_config())
    return [build(c) for c in settings.candidates], build(settings.baseline)


def candidate_models(loaded: LoadedModel, settings: EvalSettings) -> dict[str, LoadedModel]:
    """Each candidate's model, by label: the run's, or for a candidate with its own `source:` /
    `weights:` (a weight-format study) that file in that format, loaded once per (file, format)
    with the run's dtype and device. Every one must share the run's tokenizer: the candidates are
    scored on the same token ids."""
    model = loaded.model
    dtype = next(name for name, d in DTYPES.items() if d == model.dtype)
    mine = (str(loaded.path.resolve()), model.weights)
    loaded_by: dict[tuple[str, str], LoadedModel] = {mine: loaded}
    out = {settings.baseline.label: loaded}
    for i, c in enumerate(settings.candidates):
        path = resolve_source(c.source) if c.source is not None else loaded.path
        key = (str(path.resolve()), c.weights or model.weights)
        if key not in loaded_by:
            try:
                other = load_model(str(path), dtype, model.device.type, progress=False, weights=key[1])
            except UserError as e:
                raise UserError(f"eval.candidates[{i}] ({c.label}): {e}") from None
            if not same_vocabulary(other.tokenizer, loaded.tokenizer):
                raise UserError(f"eval.candidates[{i}].source: {path} has another tokenizer than the run's model "
                                f"{loaded.path.name}; a candidate's weights must be another file of the same model")
            loaded_by[key] = other
        out[c.label] = loaded_by[key]
    return out


def same_vocabulary(a: Tokenizer, b: Tokenizer) -> bool:
    return a.vocab_size == b.vocab_size and a.backend.get_vocab(with_added_tokens=True) == \
        b.backend.get_vocab(with_added_tokens=True)


def weight_bytes(model) -> int:
    """The bytes a model's weights hold in memory: every parameter and buffer, tied ones once
    (fp32 weights count their input-major copies too: what the process holds)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type != "meta" and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def perplexity_ids(tokenizer, settings: PerplexitySettings) -> tuple[list[int], int | None]:
    """The scored text's ids (cut to max_tokens) and, for chunks, the BOS id each window starts with."""
    chunks = settings.protocol == "chunks"
    bos = tokenizer.bos_token_id if chunks and adds_bos(tokenizer) else None   # as llama.cpp tokenizes it
    ids = tokenizer.encode(corpus_text(settings.text), add_special_tokens=chunks)
    limit = settings.max_tokens if settings.max_tokens is not None else (None if chunks else 1024)
    ids = ids[:limit] if limit is not None else ids
    if chunks and len(ids) < settings.ctx:
        raise UserError(f"eval.perplexity.ctx={settings.ctx}: the text has only {len(ids)} tokens (after max_tokens); "
                        "use a smaller ctx or a longer text")
    if not chunks and len(ids) < settings.prompt_len + 2:
        raise UserError(f"eval.perplexity.prompt_len={settings.prompt_len}: the text has only {len(ids)} tokens "
                        "(after max_tokens); use a shorter prompt_len or a longer text")
    return ids, bos


def task_samples(tokenizer, settings: TaskSettings) -> list:
    """Every (task, length) cell's samples, in order; a setting the generators refuse is exit 2."""
    samples = []
    for name in settings.names or task_suite.DEFAULT_TASKS:
        for length in settings.lengths:
            try:
                samples += task_suite.make_samples(name, length, settings.samples, settings.seed, tokenizer,
                                                   chat=settings.chat, text_path=settings.text)
            except ValueError as e:
                raise UserError(f"eval.tasks ({name} at {length} tokens): {e}") from None
    return samples


def cache_bytes(model, policy, context: int) -> dict[str, Any]:
    """A candidate's bytes per token, batch 1, at a context of `context` tokens, from the cache's own
    count (KVCache.bytes_at: residual windows included); a hybrid model's (Gemma) also per layer
    type, since its sliding layers' rings stop growing at their window."""
    cache = model.new_cache(1, context if model.config.hybrid else 1, policy)   # rings need their real capacity
    row = {"bytes_per_token": cache.bytes_per_token_at(context), "bytes_context": context}
    if model.config.hybrid:
        split = cache.bytes_by_layer_type(context)
        row["bytes_per_token_by_layer_type"] = {k: round(v / context, 1) for k, v in split.items()}
    return row


def run_eval(loaded: LoadedModel, settings: EvalSettings, seed: int | None, record: RunDir,
             console: Console) -> dict[str, Any]:
    model, tok = loaded.model, loaded.tokenizer
    candidates, baseline = candidates_of(settings)
    models = candidate_models(loaded, settings)
    decoupled = model.config.attention == "decoupled"
    for c in [*candidates, baseline]:
        try:
            c.policy.check_streams(decoupled)
        except ValueError as e:
            raise UserError(f"eval candidate {c.label}: {e}") from None
    ppl_ids = perplexity_ids(tok, settings.perplexity) if settings.perplexity is not None else None
    samples = task_samples(tok, settings.tasks) if settings.tasks is not None else []
    context = round(sum(len(s.prompt_ids) for s in samples) / len(samples)) if samples else \
        settings.perplexity.ctx if settings.perplexity is not None else 1
    rows = {c.label: {"label": c.label, "policy": c.policy.describe(decoupled), "window": c.window,
                      "press": c.press.describe() if c.press is not None and c.press.enabled else None,
                      **cache_bytes(model, c.policy, context), **weights_row(models[c.label])}
            for c in [*candidates, baseline]}
    result: dict[str, Any] = {"mode": "eval", "baseline": baseline.label}
    # written in the background while the eval goes on; `caramba eval` records nothing, keeps nothing
    contexts = ContextStore(record.root, model=model_identity(model, loaded.content_hash), background=True) \
        if record.path is not None else None
    with Progress(console=console, transient=True) as bar:
        if ppl_ids is not None:
            scores = AnswerStore.beside(contexts, PERPLEXITY_SUBDIR) if contexts is not None and contexts.enabled \
                else None
            result["perplexity"] = _perplexity(model, settings.perplexity, *ppl_ids, candidates, baseline, rows, bar,
                                               models, scores, contexts if scores is not None else None)
        if samples:
            result["tasks"] = _tasks(model, tok, settings.tasks, samples, candidates, baseline, rows, record, bar,
                                     contexts, models)
    note = contexts.bound_note() if contexts is not None else None
    if note:
        console.print(f"[yellow]{escape(note)}[/yellow]", soft_wrap=True)
        record.log(note)
    base_bytes, base_weights = rows[baseline.label]["bytes_per_token"], rows[baseline.label]["weight_bytes"]
    for row in rows.values():
        row["bytes_ratio"] = row["bytes_per_token"] / base_bytes
        row["weight_bytes_ratio"] = row["weight_bytes"] / base_weights
        row["bytes_at_context"] = round(row["weight_bytes"] + row["bytes_per_token"] * row["bytes_context"])
        if row.get("decode_tok_s") is None and (row.get("perplexity") or {}).get("decode_tok_s") is not None:
            row["decode_tok_s"] = row["perplexity"]["decode_tok_s"]   # no tasks: the scored steps' speed
    result["candidates"] = list(rows.values())
    result["summary"] = summary(result["candidates"])
    console.print(results_table(result))
    record.log(f"eval: {len(candidates)} candidate(s) against {baseline.label}")
    return result


def weights_row(loaded: LoadedModel) -> dict[str, Any]:
    """A candidate's weights: their format, file and the bytes they hold (run_eval adds
    bytes_at_context, weights + KV cache, once a pressed cache's bytes per token are known)."""
    return {"weights": loaded.model.weights, "source": str(loaded.path), "weight_bytes": weight_bytes(loaded.model)}


def _perplexity(model, s: PerplexitySettings, ids: list[int], bos: int | None, candidates: list[Candidate],
                baseline: Candidate, rows: dict, bar: Progress, models: dict[str, LoadedModel],
                scores: AnswerStore | None = None, contexts: ContextStore | None = None) -> dict:
    """Every candidate's perplexity scores against the baseline's; with `scores`, the ones kept from
    an earlier run with the same ids, settings, models and caches are reused, and only the others
    are scored; with `contexts`, against the baseline's logits kept there by an earlier run (then
    the baseline does not run), or with the baseline in lockstep, its logits then kept."""
    chunks = s.protocol == "chunks"
    setup = {"ctx": s.ctx, "n_chunks": len(ids) // s.ctx, "bos": bos} if chunks else {"prompt_len": s.prompt_len}
    keys = _perplexity_keys(s, ids, bos, candidates, baseline, models, scores) if scores is not None else {}
    found = {c.label: scores.load(keys[c.label]) for c in candidates} if scores is not None else {}
    todo = [c for c in candidates if found.get(c.label) is None]
    seconds, choice, logits_record = 0.0, None, None
    if todo:
        progress = Steps(bar, f"perplexity ({s.protocol})", len(ids) // s.ctx if chunks else len(ids) - s.prompt_len)
        step = lambda done, total: progress.update(done)   # noqa: E731
        policies = [c.policy for c in todo]
        others = [models[c.label].model for c in todo]
        choice = threads.choose() if model.device.type == "cpu" else None   # the cores free now (caramba.threads)
        t0 = time.perf_counter()
        kept, logits_record = _kept_baseline(model, s, ids, bos, baseline, keys, contexts)
        with threads.applied(choice) if choice is not None else contextlib.nullcontext():
            if chunks:
                computed = evaluate_chunks(model, ids, policies, baseline.policy, s.ctx, bos, on_step=step,
                                           models=others, **kept)
            else:
                computed = evaluate_cache(model, ids, policies, baseline.policy, s.prompt_len, on_step=step,
                                          models=others, **kept)
        seconds = time.perf_counter() - t0
        progress.close()
        for c, r in zip(todo, computed):
            found[c.label] = asdict(r)
            if scores is not None:
                scores.save(keys[c.label], found[c.label])
    results = [EvalResult(**found[c.label]) for c in candidates]
    for c, r in zip(candidates, results):
        rows[c.label]["perplexity"] = {k: v for k, v in r.to_dict().items() if k not in ("policy", "bytes_per_token",
                                                                                      "protocol", "baseline_decode_tok_s")}
    r0 = results[0]
    rows[baseline.label]["perplexity"] = {"n_scored": r0.n_scored, "nll": r0.baseline_nll, "ppl": r0.baseline_ppl,
                                          "ppl_stderr": r0.baseline_ppl_stderr, "ppl_ratio": 1.0, "dnll": 0.0,
                                          "kl_mean": 0.0, "kl_max": 0.0, "top1_agreement": 1.0,
                                          "decode_tok_s": r0.baseline_decode_tok_s}
    return {"protocol": s.protocol, "text": s.text or "caramba/data/corpus.txt", "n_tokens": len(ids), **setup,
            "seconds": seconds, "threads": choice.used if choice is not None else None,
            "reused": [c.label for c in candidates if c not in todo], "baseline_logits": logits_record}


def _kept_baseline(model, s: PerplexitySettings, ids: list[int], bos: int | None, baseline: Candidate,
                   keys: dict[str, dict], contexts: ContextStore | None) -> tuple[dict, dict | None]:
    """The baseline's logits from the context store (evaluate_cache's baseline_logits), or a hook
    that keeps them once the baseline has run (its on_baseline), and what the record says of them.
    Kept only while they take at most a quarter of the store's bound (the decode protocol's 512
    scored tokens of SmolLM2: 96 MiB), so that they never push out most of the contexts."""
    n_scored = len(ids) // s.ctx * (s.ctx // 2 - 1) if s.protocol == "chunks" else len(ids) - s.prompt_len
    size = n_scored * model.config.vocab_size * 4
    if contexts is None or not keys or size > contexts.max_bytes // 4:
        return {}, None
    store = ContextStore(contexts.dir.parent, contexts.max_bytes, contexts.model)   # its own counts, the same bound
    key = next(iter(keys.values()))["baseline"]
    t0 = time.perf_counter()
    got = store.load(key)
    record = {"entry": store.path_of(key).name, "reused": got is not None, "kept": False,
              "load_s": time.perf_counter() - t0, "bad": store.bad}
    if got is not None:
        tensors, extra = got
        return {"baseline_logits": BaselineLogits(tensors["logits"], extra.get("decode_tok_s"))}, record

    def keep(b: BaselineLogits) -> None:
        record["kept"] = store.save(key, {"logits": b.logits}, {"decode_tok_s": b.decode_tok_s})
    return {"on_baseline": keep}, record


def _perplexity_keys(s: PerplexitySettings, ids: list[int], bos: int | None, candidates: list[Candidate],
                     baseline: Candidate, models: dict[str, LoadedModel], scores: AnswerStore) -> dict[str, dict]:
    """Each candidate's key in the answer store (answer_store.perplexity_key), whose "baseline" is
    the baseline's logits' key (baseline_logits_key)."""
    # decode: the C step's rows summed as a join sums them (evaluate_cache), not as before
    setup = {"protocol": s.protocol, **({"ctx": s.ctx} if s.protocol == "chunks" else
                                        {"prompt_len": s.prompt_len, "rows": "exact"})}
    held: dict[int, tuple[dict, str]] = {}   # per model: its identity and its decode path

    def identity(m: LoadedModel) -> tuple[dict, str]:   # decode steps take the fused C step where it applies
        if id(m) not in held:
            held[id(m)] = (model_identity(m.model, m.content_hash),   # the path and its kernels' build
                           arithmetic(choose(m.model).name if s.protocol == "decode" else "torch"))
        return held[id(m)]

    base_model, base_path = identity(models[baseline.label])
    base = baseline_logits_key(base_model, ids, bos, setup, baseline.policy, base_path)
    out = {}
    for c in candidates:
        mine, path = identity(models[c.label])
        out[c.label] = perplexity_key(mine, base, c.policy, path)
    return out


def _tasks(model, tok, s: TaskSettings, samples: list, candidates: list[Candidate], baseline: Candidate,
           rows: dict, record: RunDir, bar: Progress, contexts: ContextStore | None,
           models: dict[str, LoadedModel]) -> dict:
    everyone = len(candidates) + 1
    progress = Steps(bar, f"tasks ({len(samples)} samples x {everyone} caches)", len(samples) * everyone)
    answered = lambda _label, _answer: progress.advance()   # noqa: E731
    # the answers beside the contexts, under the same bound: a new candidate costs only its own answers
    answers = AnswerStore.beside(contexts) if contexts is not None and contexts.enabled else None
    t0 = time.perf_counter()
    results, context_s = answer_by_model(model, tok, samples, candidates, baseline, models, contexts, answers,
                                         prefill=s.prefill, q_chunk=s.q_chunk, eos_ids=list(tok.stop_token_ids),
                                         batch_size=s.batch_size, on_answer=answered,
                                         prefill_precision=s.prefill_precision)
    wall_s = time.perf_counter() - t0
    progress.close()
    for r in results:
        rows[r.candidate.label].update(task_metrics(r))
        rows[r.candidate.label]["time"] = r.time()
        if r.candidate.pressed:   # a press keeps a share of the context: its bytes per context token, measured
            row = rows[r.candidate.label]
            row["kept_fraction"] = r.kept_fraction()
            pressed_bytes(row, row["kept_fraction"])
    if record.path is not None:   # every answer beside its sample (references, rule, question): checkable by eye
        about = {(x.task, x.length, x.index): x.describe(tok) for x in samples}
        record.write_json("answers.json", {r.candidate.label: [{**a, **about[a["task"], a["length"], a["index"]]}
                                                               for a in r.to_dict()["answers"]] for r in results})
    return {"names": list(s.names or task_suite.DEFAULT_TASKS), "lengths": s.lengths, "samples": s.samples,
            "seed": s.seed, "chat": s.chat, "q_chunk": s.q_chunk, "batch_size": s.batch_size,
            "prefill_precision": s.prefill_precision,
            # what ran: a decoupled (DBA) model's three streams have no shared-context copy, so "own"
            "prefill": "own" if model.config.attention == "decoupled" else s.prefill,
            "generator_version": task_suite.GENERATOR_VERSION, "prompts_sha256": task_suite.samples_digest(samples),
            "context_prefill_s": context_s, "threads": sorted({n for n in results[0].threads if n is not None}),
            "contexts": contexts.summary() if contexts is not None and contexts.enabled else None,
            "answer_store": {**answers.summary(), "candidates": {
                r.candidate.label: {"reused": r.answers_reused, "computed": len(r.answers) - r.answers_reused}
                for r in results}} if answers is not None else None,
            "time": time_budget(results, context_s, wall_s, contexts)}


def answer_by_model(model, tok, samples: list, candidates: list[Candidate], baseline: Candidate,
                    models: dict[str, LoadedModel], contexts: ContextStore | None, answers: AnswerStore | None,
                    **settings) -> tuple[list[CandidateAnswers], float]:
    """answer_tasks for the candidates on the run's model, then for each other model (a candidate's
    own weights) its candidates, with their contexts prefilled by that model through the baseline's
    cache: a candidate of that model with the baseline's cache serves as its baseline, else one is
    added and its answers dropped. Every store entry (contexts, answers) is keyed by the model that
    computed it.
    The baseline's answers come last, as answer_tasks gives them."""
    groups: dict[int, list[Candidate]] = {}
    for c in candidates:
        groups.setdefault(id(models[c.label].model), []).append(c)
    results, context_s = [], 0.0
    mine = groups.pop(id(model), [])
    for group in groups.values():
        other = models[group[0].label]
        stand_in = next((c for c in group if c.policy == baseline.policy and c.window == baseline.window
                         and not c.pressed), None)
        base = stand_in or Candidate(f"{baseline.label}@{other.model.weights}", baseline.policy, baseline.window)
        rest = [c for c in group if c is not stand_in]
        shown = settings if stand_in is not None or settings.get("on_answer") is None else {
            **settings, "on_answer": _except(base.label, settings["on_answer"])}   # an added baseline is no cache shown
        with _keyed_by([contexts, answers], other):
            got, seconds = answer_tasks(other.model, tok, samples, rest, base, contexts=contexts, answers=answers,
                                        **shown)
        results += [r for r in got if r.candidate is not base or stand_in is not None]
        context_s += seconds
    got, seconds = answer_tasks(model, tok, samples, mine, baseline, contexts=contexts, answers=answers, **settings)
    return results + got, context_s + seconds


def _except(label: str, on_answer):
    return lambda who, answer: None if who == label else on_answer(who, answer)


@contextlib.contextmanager
def _keyed_by(stores: list, loaded: LoadedModel):
    """The stores keyed by another model's identity for a while (their counts carry on)."""
    stores = [s for s in stores if s is not None]
    mine = [s.model for s in stores]
    for store in stores:
        store.model = model_identity(loaded.model, loaded.content_hash)
    try:
        yield
    finally:
        for store, model in zip(stores, mine):
            store.model = model


def time_budget(results: list[CandidateAnswers], context_s: float, wall_s: float,
                contexts: ContextStore | None) -> dict:
    """Where the task answering's seconds went: the shared context prefills (reused ones: reading
    them), writing the context store, every candidate's stores, questions and answers' decode
    steps (per candidate in its row's `time`), and the wall time of it all. Answers reused from the
    answer store cost nothing now: counted apart, with the seconds they took when computed."""
    store = contexts if contexts is not None and contexts.enabled else None
    return {"wall_s": wall_s, "context_prefill_s": context_s,
            "context_save_s": store.save_s if store else 0.0, "context_write_s": store.write_s if store else 0.0,
            "store_s": sum(r.store_s for r in results), "question_s": sum(r.question_s for r in results),
            "decode_s": sum(r.decode_s for r in results),
            "contexts_reused": store.reused if store else 0, "contexts_computed": store.computed if store else None,
            "answers_reused": sum(r.answers_reused for r in results),
            "answers_computed": sum(len(r.answers) - r.answers_reused for r in results),
            "reused_s": sum(r.reused_s for r in results)}


def time_rows(records: list[tuple[str, Any]]) -> list[dict]:
    """`caramba report`'s time budget of finished eval records: per run the perplexity scoring's
    wall time (row "(perplexity)"), its task answering's wall time and shared prefill, per candidate
    its stores, questions and decode steps; the contexts and answers reused from the stores, and
    the seconds the reused answers took when computed."""
    out = []
    for name, path in records:
        try:
            result = json.loads((path / "result.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not isinstance(result, dict) or result.get("mode") != "eval":
            continue
        ppl = result.get("perplexity")
        if isinstance(ppl, dict):
            out.append({"run": name, "cache": "(perplexity)", "prefill_s": None, "store_s": None, "question_s": None,
                        "decode_s": None, "wall_s": ppl.get("seconds"), "contexts_reused": None,
                        "answers_reused": None, "reused_s": None})
        budget = (result.get("tasks") or {}).get("time")
        if not isinstance(budget, dict):
            continue
        out.append({"run": name, "cache": "(all)", "prefill_s": budget.get("context_prefill_s"),
                    "store_s": budget.get("store_s"), "question_s": budget.get("question_s"),
                    "decode_s": budget.get("decode_s"), "wall_s": budget.get("wall_s"),
                    "contexts_reused": budget.get("contexts_reused"), "answers_reused": budget.get("answers_reused"),
                    "reused_s": budget.get("reused_s")})
        for c in result.get("candidates") or []:
            t = c.get("time") or {}
            out.append({"run": name, "cache": c.get("label"), "prefill_s": None, "store_s": t.get("store_s"),
                        "question_s": t.get("question_s"), "decode_s": t.get("decode_s"), "wall_s": t.get("total_s"),
                        "contexts_reused": None, "answers_reused": t.get("answers_reused"),
                        "reused_s": t.get("reused_s")})
    return out


def pressed_bytes(row: dict, kept: float) -> None:
    """A pressed candidate's bytes per context token (cache_bytes' row, updated): the share `kept`
    of what it holds; a hybrid model's press keeps a share of its full layers only (kept is theirs:
    DecodeState.kept_share), its sliding layers' rings stay whole."""
    split = row.get("bytes_per_token_by_layer_type")
    if split:
        split["full"] = round(split["full"] * kept, 1)
        row["bytes_per_token"] = round(split["sliding"] + split["full"], 1)
    else:
        row["bytes_per_token"] = round(row["bytes_per_token"] * kept, 1)


def task_metrics(r: CandidateAnswers) -> dict:
    """A candidate's task scores per cell, their average (every cell weighs the same), the
    average per length, and what answering cost."""
    cells = r.cells()
    flat = [(length, cell["score"]) for per_task in cells.values() for length, cell in per_task.items()]
    lengths = sorted({length for length, _ in flat})
    by_length = {str(n): _mean([v for length, v in flat if length == n]) for n in lengths}
    prefill_s = sum(a.prefill_s for a in r.answers)
    decode_s = sum(a.decode_s for a in r.answers)
    return {"tasks": {name: {str(n): cell for n, cell in per.items()} for name, per in cells.items()},
            "task_avg": _mean([v for _, v in flat]), "task_avg_by_length": by_length,
            "prefill_s": prefill_s, "decode_s": decode_s, "decode_tok_s": r.decode_tok_s()}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


# Per candidate, the numbers `expect:` bounds name as LABEL.NAME (e.g. q4_0.task_avg >= 0.5,
# q4_0.tasks.niah_single.2048 >= 0.8).
SUMMARY_KEYS = ("bytes_per_token", "bytes_ratio", "task_avg", "decode_tok_s")
PERPLEXITY_KEYS = ("ppl", "ppl_ratio", "dnll", "kl_mean", "kl_max", "top1_agreement")


def summary(rows: list[dict]) -> dict[str, float]:
    out: dict[str, float] = {}
    for row in rows:
        label = row["label"]
        for key in SUMMARY_KEYS:
            if row.get(key) is not None:
                out[f"{label}.{key}"] = row[key]
        for key in PERPLEXITY_KEYS:
            if row.get("perplexity", {}).get(key) is not None:
                out[f"{label}.{key}"] = row["perplexity"][key]
        for name, per in row.get("tasks", {}).items():
            for length, cell in per.items():
                out[f"{label}.tasks.{name}.{length}"] = cell["score"]
    return out


def results_table(result: dict) -> Table:
    rows = result["candidates"]
    table = Table(title=_title(result), title_justify="left")
    weighed = len({row.get("weight_bytes") for row in rows}) > 1   # candidates with their own weights
    columns = ["cache", *(["weights", "weights MB"] if weighed else []), "bytes/token", "vs baseline"]
    tasks = result.get("tasks")
    if tasks:
        columns += ["task avg", *(f"@{n}" for n in tasks["lengths"]), "decode tok/s"]
    if result.get("perplexity"):
        columns += ["PPL", "PPL ratio", "mean KL", "top-1 agree"]
    for col in columns:
        table.add_column(col, justify="left" if col == "cache" else "right")
    for row in rows:
        cells = [row["label"], *([row["weights"], f"{row['weight_bytes'] / 2**20:.1f}"] if weighed else []),
                 str(row["bytes_per_token"]), f"{row['bytes_ratio']:.3f}"]
        if tasks:
            cells += [f"{row['task_avg']:.3f}", *(f"{row['task_avg_by_length'].get(str(n), float('nan')):.3f}"
                                                  for n in tasks["lengths"]),
                      f"{row['decode_tok_s']:.1f}" if row.get("decode_tok_s") else ""]
        if result.get("perplexity"):
            p = row["perplexity"]
            stderr = f" +/- {p['ppl_stderr']:.5f}" if p.get("ppl_stderr") is not None else ""
            cells += [f"{p['ppl']:.4f}{stderr}", f"{p['ppl_ratio']:.4f}", f"{p['kl_mean']:.2e}", f"{p['top1_agreement']:.4f}"]
        table.add_row(*(escape(c) for c in cells))
    return table


def _title(result: dict) -> str:
    parts = [f"eval against {result['baseline']}"]
    ppl = result.get("perplexity")
    if ppl is not None:
        n_scored = result["candidates"][0]["perplexity"]["n_scored"]
        parts.append(f"{ppl['n_chunks']} windows of {ppl['ctx']} tokens, {n_scored} tokens scored (second halves)"
                     if ppl["protocol"] == "chunks" else
                     f"{n_scored} tokens scored after a {ppl['prompt_len']}-token prompt")
    tasks = result.get("tasks")
    if tasks is not None:
        parts.append(f"{len(tasks['names'])} tasks x {len(tasks['lengths'])} lengths x {tasks['samples']} samples "
                     f"(95% intervals in result.json), prefill {tasks['prefill']}")
    return escape("; ".join(parts))


def check_eval(r: ResolvedRun, where: str, tok: Tokenizer | None = None, checked: set[str] | None = None,
               config=None) -> None:
    """An eval's texts, candidate streams and context lengths against the model, and its task
    samples generated once at n=1 (a length too short for a task is found here, not mid-run)."""
    from caramba.runners.preflight import Sources, check_text

    tok = tok or Sources().tokenizer(r.model.source)
    checked = set() if checked is None else checked
    s = r.run.eval
    config = config or inspect_source(r.model.source)
    for field, text in (("perplexity.text", s.perplexity and s.perplexity.text), ("tasks.text", s.tasks and s.tasks.text)):
        if text:
            check_text(text, f"{where}: eval.{field}")
    _check_expect_names(r, where)
    for i, c in enumerate([*s.candidates, s.baseline]):
        try:
            c.policy().check_streams(config.attention == "decoupled")
        except ValueError as e:
            field = f"candidates[{i}]" if i < len(s.candidates) else "baseline"
            raise UserError(f"{where}: eval.{field}: {e}") from None
        if c.press_config() is not None:
            check_pressable(c.press_config(), config, f"{where}: eval.candidates[{i}].press")
    if s.tasks is not None and s.tasks.prefill_precision == "bf16" and r.model.device in ("cpu", "auto") \
            and resolve_device(r.model.device).type == "cpu" and not gemm.bf16_native():
        raise UserError(f"{where}: eval.tasks.prefill_precision: bf16 pays where the CPU multiplies bf16 natively "
                        "(AVX-512 BF16 or AMX-BF16, with oneDNN); this one does not (it would run slower than "
                        "fp32): use fp32")
    if s.tasks is not None and s.tasks.prefill_precision == "bf16" and \
            any((c.weights or r.model.weights) != "fp32" for c in [*s.candidates, s.baseline]):
        raise UserError(f"{where}: eval.tasks.prefill_precision: bf16 rounds fp32 weights' products; quantized "
                        "weights (model.weights or a candidate's weights:) prefill through their own GEMM, where it "
                        "would do nothing: use fp32, or fp32 weights")
    try:
        if s.tasks is not None:
            limit = config.max_position_embeddings
            past = [n for n in s.tasks.lengths if n > limit]
            if past:
                raise UserError(f"eval.tasks.lengths: {', '.join(map(str, past))} past the model's trained context "
                                f"of {limit} tokens; use lengths <= {limit}")
            key = f"{r.model.source}\0{s.tasks.model_dump_json()}"
            if key not in checked:
                _check_press_contexts(task_samples(tok, s.tasks.model_copy(update={"samples": 1})), s.candidates)
                checked.add(key)
        if s.perplexity is not None:
            perplexity_ids(tok, s.perplexity)
    except UserError as e:
        raise UserError(f"{where}: {e}") from None


def check_candidate_weights(r: ResolvedRun, where: str, sources) -> None:
    """A candidate's own weights (source:, weights:) load as the run's model would: the file is
    there and whole, keeps blocks if the format is native, and has the run's tokenizer."""
    from caramba.runners.preflight import check_native_source   # lazy: preflight imports the modes

    for i, c in enumerate(r.run.eval.candidates):
        if c.source is None and c.weights is None:
            continue
        field = f"eval.candidates[{i}]"
        source = c.source if c.source is not None else r.model.source
        try:
            path = sources.path(source)
            sources.config(source)
            sources.check_weights(source)
        except UserError as e:
            raise UserError(f"{where}: {field}.source: {e}") from None
        check_native_source(c.weights or r.model.weights, path, source, where, field)
        if c.source is not None and not same_vocabulary(sources.tokenizer(c.source), sources.tokenizer(r.model.source)):
            raise UserError(f"{where}: {field}.source: {c.source!r} has another tokenizer than model.source "
                            f"{r.model.source!r}; a candidate's weights must be another file of the same model")


def _check_expect_names(r: ResolvedRun, where: str) -> None:
    """Each expect: bound on a candidate names a figure this eval will report (LABEL.KEY,
    LABEL.tasks.TASK.LENGTH): a typo is exit 2 now, not a failed check after the whole eval."""
    from caramba.expect import parse_bound

    s = r.run.eval
    labels = [c.label for c in [*s.candidates, s.baseline]]
    keys = [*SUMMARY_KEYS, *(PERPLEXITY_KEYS if s.perplexity is not None else ())]
    if s.tasks is not None:
        keys += [f"tasks.{name}.{n}" for name in s.tasks.names or task_suite.DEFAULT_TASKS for n in s.tasks.lengths]
    else:   # without tasks there is no task score, and no decode speed of answers
        keys = [k for k in keys if k not in ("task_avg", "decode_tok_s")]
    names = [f"{label}.{key}" for label in labels for key in keys]
    for i, text in enumerate(r.run.expect.metrics if r.run.expect is not None else []):
        name = parse_bound(text)[0]
        head = name.split(".")[0]
        if name in names or (head not in labels and head in _RESULT_KEYS):
            continue
        hint = difflib.get_close_matches(name, names, n=1)
        raise UserError(f"{where}: expect.metrics[{i}]: {name!r} is not a figure this eval reports"
                        + (f"; did you mean {hint[0]!r}?" if hint else "")
                        + f" (candidates: {', '.join(labels)}; e.g. {names[0]})")


# The top-level keys of an eval's result.json a bound may name as a dotted path (perplexity.seconds).
_RESULT_KEYS = ("mode", "baseline", "perplexity", "tasks", "candidates", "summary")


def _check_press_contexts(samples: list, candidates: list) -> None:
    """Every task context long enough for every candidate's press."""
    for i, c in enumerate(candidates):
        press = c.press_config()
        if press is None or not samples:
            continue
        short = min(samples, key=lambda s: len(s.context_ids))
        if len(short.context_ids) < press.min_context():
            raise UserError(f"eval.candidates[{i}].press={press.method}: the {short.task} context at {short.length} "
                            f"has {len(short.context_ids)} tokens; the press scores contexts of at least "
                            f"{press.min_context()}: use longer lengths or a smaller press_window / press_sinks")


class EvalMode(Mode):
    """`mode: eval` (and `caramba eval`, its one-off form: caramba.cli_eval)."""

    name = "eval"
    frontier = True
    run = staticmethod(run_eval)

    def preflight(self, r: ResolvedRun, where: str, sources) -> None:
        check_eval(r, where, sources.tokenizer(r.model.source), sources.seen, sources.config(r.model.source))
        check_candidate_weights(r, where, sources)

    def uses_task_generator(self, r: ResolvedRun) -> bool:
        return r.run.eval.tasks is not None

    def record_bytes(self, r: ResolvedRun) -> int:
        s = r.run.settings   # per candidate its scores; answers.json: every answer of every cache
        caches = len(s.candidates) + 1
        answers = len(s.tasks.names or task_suite.DEFAULT_TASKS) * len(s.tasks.lengths) * s.tasks.samples if s.tasks else 0
        return BASE_RECORD + caches * (8 * KIB + answers * (512 + 64 * 128))

    def workload(self, r: ResolvedRun) -> Workload:
        """A batch of samples at a time: the baseline's cache and the candidates' whose answers decode
        joined (up to JOIN_ROWS rows; one candidate's when the batch is too wide to join);
        perplexity: every cache."""
        s = r.run.settings
        lengths = [max(s.tasks.lengths) + 256] if s.tasks else []    # + the question and answer
        if s.perplexity:
            p = s.perplexity
            lengths.append(p.ctx if p.protocol == "chunks" else (p.max_tokens or 1024))
        field = f"{self.section}.tasks.lengths" if s.tasks else f"{self.section}.perplexity.max_tokens"
        if s.tasks:   # the joined candidates include the baseline
            rows = s.tasks.batch_size * max(2, min(len(s.candidates) + 1, JOIN_ROWS // s.tasks.batch_size))
        else:
            rows = len(s.candidates) + 1
        mine = (r.model.source, r.model.weights)   # candidates with their own weights: loaded beside the run's
        extra = dict.fromkeys((c.source or r.model.source, c.weights or r.model.weights) for c in s.candidates
                              if (c.source or r.model.source, c.weights or r.model.weights) != mine)
        return Workload(max(lengths), rows, field, field, extra_models=tuple(extra))

    def metrics(self, result: dict[str, Any]) -> dict[str, Any]:
        """Each candidate's headline numbers (the frontier table has the rest)."""
        summary = result.get("summary") if isinstance(result.get("summary"), dict) else {}
        return {k: v for k, v in summary.items() if k.rpartition(".")[2] in ("task_avg", "ppl_ratio") and is_number(v)}


register(EvalMode())
