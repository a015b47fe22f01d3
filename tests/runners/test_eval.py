"""`mode: eval` end to end on a tiny model, and the task engine (caramba.evaluation.task_eval) under it:
records, resume, sweeps, --check bounds, errors before anything runs, and the shared-prefill
protocol against its definition."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from caramba.cache import CachePolicy
from caramba.cli import app
from caramba.evaluation import tasks as task_suite
from caramba.evaluation.task_eval import Candidate, _batches, answer_tasks, store_context, wilson
from caramba.model.zoo import load_model
from test_cli import invoke, write_tiny_model

LENGTH = 768   # tokens of a task context: bytes of the tiny model's byte-level tokenizer


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory) -> Path:
    """The CLI tests' tiny byte-level model, with room for contexts of a few thousand tokens."""
    d = write_tiny_model(tmp_path_factory.mktemp("tiny-long") / "model")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 4096}))
    return d


@pytest.fixture(scope="module")
def loaded(long_tiny):
    return load_model(str(long_tiny), progress=False)


def eval_manifest(tmp_path: Path, model: Path, section: str, extra: str = "") -> Path:
    path = tmp_path / "e.yaml"
    path.write_text(f"""\
version: 1
name: ev
defaults:
  model: {{source: "{model}"}}
targets:
  - type: experiment
    name: t
    runs:
      - id: kv
        mode: eval
{extra}        eval:
{section}""")
    return path


SECTION = f"""\
          candidates: [{{cache_kind: q8_0, qblock: 8}}, {{cache_kind: q4_0, qblock: 8, rotate_keys: true, name: q4r}}]
          perplexity: {{prompt_len: 16, max_tokens: 64}}
          tasks: {{names: [niah_single], lengths: [{LENGTH}], samples: 2}}
"""


def test_eval_run_records_every_candidate_then_skips_and_checks(tmp_path, monkeypatch, long_tiny, loaded):
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "runs"))
    manifest = eval_manifest(tmp_path, long_tiny, SECTION, extra="""\
        expect:
          metrics: ["q4r.bytes_ratio < 0.3", "fp32.tasks.niah_single.768 >= 0", "q8_0_qblock_8.kl_mean >= 0"]
""")
    r = invoke("run", manifest)
    assert r.exit_code == 0, r.output
    # not a terminal (a CI log): progress comes as lines, the last at the whole
    assert "perplexity (decode): 48/48" in r.output and "caches): 6/6" in r.output, r.output
    record = tmp_path / "runs" / "ev" / "t" / "kv"
    assert (record / "DONE").is_file()
    result = json.loads((record / "result.json").read_text())
    labels = [c["label"] for c in result["candidates"]]
    assert labels == ["q8_0_qblock_8", "q4r", "fp32"] and result["baseline"] == "fp32"
    by = {c["label"]: c for c in result["candidates"]}
    assert by["fp32"]["bytes_ratio"] == 1.0 and by["q4r"]["bytes_per_token"] < by["q8_0_qblock_8"]["bytes_per_token"]
    for c in result["candidates"]:
        cell = c["tasks"]["niah_single"][str(LENGTH)]
        assert cell["n"] == 2 and 0 <= cell["ci_low"] <= cell["score"] <= cell["ci_high"] <= 1
        assert c["decode_s"] >= 0 and c["perplexity"]["n_scored"] == 48
    assert by["fp32"]["perplexity"]["kl_mean"] == 0 and by["q4r"]["perplexity"]["kl_mean"] > 0
    tasks = result["tasks"]
    assert tasks["generator_version"] == task_suite.GENERATOR_VERSION and len(tasks["prompts_sha256"]) == 64
    assert result["summary"]["q4r.tasks.niah_single.768"] == by["q4r"]["tasks"]["niah_single"]["768"]["score"]
    answers = json.loads((record / "answers.json").read_text())
    assert set(answers) == set(labels) and all(len(a) == 2 for a in answers.values())
    # the time budget and the context store: computed this time, reused by a forced rerun
    budget = tasks["time"]
    assert budget["wall_s"] >= budget["context_prefill_s"] > 0 and budget["decode_s"] > 0
    assert budget["contexts_computed"] == 1 and budget["contexts_reused"] == 0 and tasks["contexts"]["bad"] == []
    assert all(c["time"]["decode_s"] > 0 and c["time"]["store_s"] >= 0 for c in result["candidates"])
    assert not any(a["context_reused"] for a in answers["q4r"])
    logits_entry = result["perplexity"]["baseline_logits"]["entry"]   # the baseline's perplexity logits beside them
    contexts_kept = [p.name for p in (tmp_path / "runs" / ".context-cache").glob("*.safetensors") if p.name != logits_entry]
    assert len(contexts_kept) == 1 == len(tasks["contexts"]["computed_keys"])   # both samples in one batch
    # the answer store: one entry per cache and batch, written as they were computed
    stored_answers = tmp_path / "runs" / ".context-cache" / "answers"
    assert len(list(stored_answers.glob("*.json"))) == 3 and tasks["answer_store"]["computed"] == 3
    assert budget["answers_computed"] == 6 and budget["answers_reused"] == 0 and budget["reused_s"] == 0
    assert tasks["answer_store"]["candidates"]["q4r"] == {"reused": 0, "computed": 2}
    report = invoke("report", manifest)
    assert report.exit_code == 0 and "time budget" in report.output, report.output
    timed = json.loads(invoke("report", manifest, "--format", "json").stdout)["time"]
    assert [t["cache"] for t in timed] == ["(perplexity)", "(all)", *labels] and timed[1]["contexts_reused"] == 0
    assert timed[0]["wall_s"] == result["perplexity"]["seconds"] > 0
    timed = timed[1:]
    assert timed[0]["prefill_s"] == budget["context_prefill_s"] and timed[1]["decode_s"] == by[labels[0]]["time"]["decode_s"]
    assert "time budget" in invoke("report", manifest, "--format", "markdown").stdout
    # a forced rerun: every answer from the answer store, so no context is needed; the same scores
    assert invoke("run", manifest, "--force").exit_code == 0
    same = json.loads((record / "result.json").read_text())
    assert same["tasks"]["time"]["answers_reused"] == 6 and same["tasks"]["time"]["answers_computed"] == 0
    assert same["tasks"]["time"]["contexts_reused"] == same["tasks"]["time"]["contexts_computed"] == 0
    assert same["tasks"]["time"]["context_prefill_s"] == 0 and same["tasks"]["time"]["reused_s"] > 0
    assert all(c["time"]["total_s"] == 0 and c["time"]["answers_reused"] == 2 for c in same["candidates"])
    assert all(a["answer_reused"] for a in json.loads((record / "answers.json").read_text())["q4r"])
    assert {c["label"]: c["tasks"] for c in same["candidates"]} == {c["label"]: c["tasks"] for c in result["candidates"]}
    timed = json.loads(invoke("report", manifest, "--format", "json").stdout)["time"][1:]
    assert timed[0]["answers_reused"] == 6 and [t["answers_reused"] for t in timed[1:]] == [2, 2, 2]
    # without the answers, the contexts: reused from the context store
    shutil.rmtree(stored_answers)
    assert invoke("run", manifest, "--force").exit_code == 0
    rerun = json.loads((record / "result.json").read_text())
    assert rerun["tasks"]["time"]["contexts_reused"] == 1 and rerun["tasks"]["contexts"]["computed"] == 0
    entry = contexts_kept[0].removesuffix(".safetensors")
    assert tasks["contexts"]["computed_keys"] == [entry] == rerun["tasks"]["contexts"]["reused_keys"]
    assert all(a["context_reused"] for a in json.loads((record / "answers.json").read_text())["q4r"])
    assert {c["label"]: c["tasks"] for c in rerun["candidates"]} == {c["label"]: c["tasks"] for c in result["candidates"]}
    # a corrupted entry: found bad, recomputed, the same answers
    stored = tmp_path / "runs" / ".context-cache" / f"{entry}.safetensors"
    data = bytearray(stored.read_bytes())
    data[-5] ^= 0xFF
    stored.write_bytes(bytes(data))
    shutil.rmtree(stored_answers)
    assert invoke("run", manifest, "--force").exit_code == 0
    healed = json.loads((record / "result.json").read_text())
    assert healed["tasks"]["contexts"]["computed_keys"] == [entry] and healed["tasks"]["contexts"]["reused"] == 0
    assert healed["tasks"]["contexts"]["bad"] == [f"{entry}.safetensors: checksum mismatch"]
    assert {c["label"]: c["tasks"] for c in healed["candidates"]} == {c["label"]: c["tasks"] for c in result["candidates"]}
    assert stored.read_bytes() != bytes(data)
    # a second run skips the record; --check holds the bounds
    again = invoke("run", manifest, "--check")
    assert again.exit_code == 0 and "skip" in again.output and "check ok" in again.output, again.output
    # a bound the result breaks fails the check, naming the metric
    broken = invoke("run", manifest, "--check", "--set", "targets.t.runs.kv.expect.metrics=['q4r.bytes_ratio > 0.9']")
    assert broken.exit_code != 0 and "q4r.bytes_ratio" in broken.output
    # one more candidate in the manifest: every context reused, the others' answers unchanged; reused
    # unless their path changed (on the C step 3 caches answer one at a time, 4 joined: JOIN_MIN_C)
    more = SECTION.replace("name: q4r}]", "name: q4r}, {cache_kind: q4_1, qblock: 8}]")
    assert more != SECTION
    added = invoke("run", eval_manifest(tmp_path, long_tiny, more), "--force")
    assert added.exit_code == 0, added.output
    grown = json.loads((record / "result.json").read_text())
    assert grown["tasks"]["contexts"]["reused"] == 1 and grown["tasks"]["contexts"]["computed"] == 0
    # perplexity: the old candidates' scores kept, only the new one scored, against the baseline's
    # logits kept by the first run (the baseline does not run again)
    assert grown["perplexity"]["reused"] == ["q8_0_qblock_8", "q4r"] and grown["perplexity"]["seconds"] > 0
    assert result["perplexity"]["baseline_logits"] | {"load_s": 0} == {"entry": logits_entry, "reused": False,
                                                                       "kept": True, "load_s": 0, "bad": []}
    assert grown["perplexity"]["baseline_logits"] | {"load_s": 0} == {"entry": logits_entry, "reused": True,
                                                                      "kept": False, "load_s": 0, "bad": []}
    assert {c["label"]: c["perplexity"] for c in grown["candidates"] if c["label"] != "q4_1_qblock_8"} == \
        {c["label"]: c["perplexity"] for c in result["candidates"]}
    # three caches of 2 rows joined already (on the C step too: the joined C step takes them), so the
    # old answers keep their keys
    old = {"reused": 2, "computed": 0}
    assert grown["tasks"]["answer_store"]["candidates"] == {
        "q8_0_qblock_8": old, "q4r": old, "q4_1_qblock_8": {"reused": 0, "computed": 2}, "fp32": old}
    assert [c["label"] for c in grown["candidates"]] == ["q8_0_qblock_8", "q4r", "q4_1_qblock_8", "fp32"]
    old_tasks = {c["label"]: c["tasks"] for c in result["candidates"]}
    assert {c["label"]: c["tasks"] for c in grown["candidates"] if c["label"] in old_tasks} == old_tasks
    # and one more: only it answers, on either path; the record says so
    most = more.replace("{cache_kind: q4_1, qblock: 8}]", "{cache_kind: q4_1, qblock: 8}, {cache_kind: q4_0, qblock: 8}]")
    assert invoke("run", eval_manifest(tmp_path, long_tiny, most), "--force").exit_code == 0
    fifth = json.loads((record / "result.json").read_text())["tasks"]
    assert fifth["answer_store"]["candidates"] == {**{c: {"reused": 2, "computed": 0} for c in grown["tasks"]["answer_store"]
                                                      ["candidates"]}, "q4_0_qblock_8": {"reused": 0, "computed": 2}}
    assert fifth["time"]["answers_reused"] == 8 and fifth["time"]["answers_computed"] == 2
    assert fifth["answer_store"]["computed"] == 1 and fifth["answer_store"]["reused"] == 4
    # a kept perplexity score that no longer verifies is scored again, never trusted
    kept = tmp_path / "runs" / ".context-cache" / "perplexity"
    for entry in kept.glob("*.json"):
        entry.write_text(entry.read_text().replace('"nll":', '"nll": 1e9, "x":', 1))
    assert invoke("run", eval_manifest(tmp_path, long_tiny, most), "--force").exit_code == 0
    rescored = json.loads((record / "result.json").read_text())
    assert rescored["perplexity"]["reused"] == [] and all(1e8 > c["perplexity"]["nll"] > 0 for c in rescored["candidates"])
    # against the kept baseline logits, the scores the first run's lockstep gave, bit for bit
    assert rescored["perplexity"]["baseline_logits"]["reused"]
    untimed = lambda run: {c["label"]: {k: v for k, v in c["perplexity"].items() if k != "decode_tok_s"}  # noqa: E731
                           for c in run["candidates"] if c["label"] in ("q8_0_qblock_8", "q4r")}
    assert untimed(rescored) == untimed(result)
    # kept baseline logits that no longer verify: found bad, the baseline run again and its logits kept anew
    logits_file = tmp_path / "runs" / ".context-cache" / logits_entry
    data = bytearray(logits_file.read_bytes())
    data[-3] ^= 0xFF
    logits_file.write_bytes(bytes(data))
    for entry in kept.glob("*.json"):
        entry.unlink()
    assert invoke("run", eval_manifest(tmp_path, long_tiny, most), "--force").exit_code == 0
    healed = json.loads((record / "result.json").read_text())["perplexity"]["baseline_logits"]
    assert healed["bad"] == [f"{logits_entry}: checksum mismatch"] and not healed["reused"] and healed["kept"]
    assert logits_file.read_bytes() != bytes(data)


def test_same_prompts_for_every_candidate_and_reproducible_from_the_record(tmp_path, monkeypatch, long_tiny):
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "runs"))
    sweep = SECTION + """\
        matrix:
          eval.tasks.prefill: [shared, own]
"""
    manifest = eval_manifest(tmp_path, long_tiny, sweep)
    r = invoke("run", manifest)
    assert r.exit_code == 0, r.output
    runs = sorted((tmp_path / "runs" / "ev" / "t").iterdir())
    results = [json.loads((d / "result.json").read_text()) for d in runs if not d.name.startswith(".")]
    assert len(results) == 2
    digests = {r["tasks"]["prompts_sha256"] for r in results}
    assert len(digests) == 1   # the same samples whatever the protocol
    # and the digest is what the generators give again for the recorded settings (made anew, not
    # handed back from the samples this process kept)
    tok = load_model(str(long_tiny), progress=False).tokenizer
    monkeypatch.setattr(task_suite, "_memo", task_suite._Memo(0))
    again = task_suite.make_samples("niah_single", LENGTH, 2, 0, tok, chat=True)
    assert task_suite.samples_digest(again) == digests.pop()
    report = invoke("report", manifest)
    assert report.exit_code == 0 and "frontier" in report.output and "q4r" in report.output, report.output


def test_a_run_takes_its_preflights_samples_and_makes_only_the_others(tmp_path, monkeypatch, long_tiny):
    """`caramba run` preflights every run (each cell's first sample) and runs them in one process:
    a run's first sample is the preflight's, made once; a run with another seed gets its own; and
    each run's prompts are what a fresh process makes."""
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "runs"))
    made, real = [], task_suite._make_sample

    def counting(spec, length, seed, index, *rest):
        made.append((seed, index))
        return real(spec, length, seed, index, *rest)

    monkeypatch.setattr(task_suite, "_make_sample", counting)
    sweep = f"""\
          candidates: [{{cache_kind: q8_0, qblock: 8}}]
          tasks: {{names: [niah_single], lengths: [{LENGTH}], samples: 2}}
        matrix:
          eval.tasks.seed: [0, 1]
"""
    r = invoke("run", eval_manifest(tmp_path, long_tiny, sweep))
    assert r.exit_code == 0, r.output
    # the preflight: each run's sample 0; the runs: only their sample 1 (was 0, 1 again each)
    assert made == [(0, 0), (1, 0), (0, 1), (1, 1)]
    records = [d for d in (tmp_path / "runs" / "ev" / "t").iterdir() if not d.name.startswith(".")]
    digests = {json.loads((d / "result.json").read_text())["tasks"]["seed"]:
               json.loads((d / "result.json").read_text())["tasks"]["prompts_sha256"] for d in records}
    tok = load_model(str(long_tiny), progress=False).tokenizer
    monkeypatch.setattr(task_suite, "_memo", task_suite._Memo(0))   # a fresh process's samples
    assert digests == {seed: task_suite.samples_digest(task_suite.make_samples("niah_single", LENGTH, 2, seed, tok))
                       for seed in (0, 1)}
    assert digests[0] != digests[1]


@pytest.mark.parametrize("section, message", [
    ("          candidates: [{cache_kind: q8_0}]\n", "perplexity: and/or tasks:"),
    ("          candidates: [{cache_kind: auto}]\n          tasks: {}\n", "not a candidate"),
    ("          candidates: [{cache_kind: q8_0}, {cache_kind: q8_0}]\n          tasks: {}\n", "both labelled"),
    ("          candidates: [{cache_kind: q8_0}]\n          tasks: {names: [niah_singel]}\n", "did you mean"),
    ("          candidates: [{cache_kind: q8_0, name: 'a-b'}]\n          tasks: {}\n", "candidate name"),
    ("          candidates: [{cache_kind: q8_0, decode_local_window: 64}]\n          perplexity: {}\n", "window"),
    ("          candidates: [{cache_kind: q8_0}]\n          tasks: {lengths: [999999]}\n", "trained context"),
    ("          candidates: [{cache_kind: q8_0}]\n          tasks: {lengths: [64], names: [niah_single]}\n",
     "eval.tasks"),
    ("          candidates: [{cache_kind: q8_0}]\n          perplexity: {text: /nonexistent.txt}\n", "no such file"),
])
def test_bad_eval_settings_exit_2_before_anything_runs(tmp_path, monkeypatch, long_tiny, section, message):
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "runs"))
    r = invoke("run", eval_manifest(tmp_path, long_tiny, section))
    assert r.exit_code == 2 and message in r.output, r.output
    assert "Traceback" not in r.output and not (tmp_path / "runs" / "ev").exists()


def test_cli_eval_runs_the_task_suite(long_tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.chdir(tmp_path)
    r = invoke("eval", "--model", long_tiny, "--tasks", "niah_single", "--lengths", str(LENGTH), "--samples", "1",
               "--no-perplexity", "--cache-kind", "q8_0", "--qblock", "8", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert [c["label"] for c in out["candidates"]] == ["q8_0_qblock_8", "fp32"] and "perplexity" not in out
    assert out["tasks"]["contexts"] is None and not list(tmp_path.rglob("*.safetensors"))   # keeps nothing
    assert invoke("eval", "--model", long_tiny, "--no-perplexity").exit_code == 2
    bad = invoke("eval", "--model", long_tiny, "--tasks", "nope", "--no-perplexity")
    assert bad.exit_code == 2 and "unknown task" in bad.output


# ---- the engine -----------------------------------------------------------------------------

def _samples(loaded, n=2):
    return task_suite.make_samples("niah_single", LENGTH, n, 0, loaded.tokenizer, chat=True)


def test_a_baseline_kind_candidate_answers_exactly_as_the_baseline(loaded):
    """shared prefill stores the baseline's own values again: the same kind answers bit for bit alike."""
    fp32 = CachePolicy.build("fp32")
    results, _ = answer_tasks(loaded.model, loaded.tokenizer, _samples(loaded), [Candidate("copy", fp32)],
                              Candidate("fp32", fp32))
    copy, base = results
    assert [a.output_ids for a in copy.answers] == [a.output_ids for a in base.answers]
    assert all(a.output_ids for a in base.answers)


@torch.inference_mode()
def test_answers_equal_a_cache_free_greedy_reference(loaded):
    """The greedy answer through the cache (context, then question, then one token at a time) is
    what re-running the whole sequence without a cache picks at every step."""
    model = loaded.model
    (sample,) = _samples(loaded, 1)
    results, _ = answer_tasks(model, loaded.tokenizer, [sample], [], Candidate("fp32", CachePolicy.build("fp32")),
                              q_chunk=100)
    ids = sample.context_ids + sample.question_ids
    expected = []
    for _ in range(len(results[0].answers[0].output_ids)):
        logits = model(torch.tensor([ids + expected]))[0, -1]
        expected.append(int(logits.argmax()))
    assert results[0].answers[0].output_ids == expected


@torch.inference_mode()
def test_shared_prefill_quantizes_the_baselines_values(loaded):
    """A candidate's stored context is the baseline's K/V written in its kinds: layer 0's keys
    (computed from embeddings alone, so equal under either protocol) quantize to the same codes
    as a prefill through the candidate's own cache, and later layers read the baseline's values."""
    model = loaded.model
    (sample,) = _samples(loaded, 1)
    ids = torch.tensor([sample.context_ids])
    q8 = CachePolicy.build("q8_0", qblock=8)
    base, own, shared = (model.new_cache(1, ids.shape[1], p) for p in (CachePolicy.build("fp32"), q8, q8))
    model(ids, cache=base, last_only=True)
    model(ids, cache=own, last_only=True)
    store_context(base, shared)
    assert shared.length == own.length == ids.shape[1]
    assert torch.equal(shared.layers[0].k, own.layers[0].k) and torch.equal(shared.layers[0].v, own.layers[0].v)
    k_base, _ = base.layers[-1].contents(base.length)
    k_shared, _ = shared.layers[-1].contents(shared.length)
    step = k_base.abs().amax() / 127   # q8_0: at most half a step of the block's scale off, bounded by the largest
    assert (k_shared - k_base).abs().max() <= step


def test_wilson_interval():
    assert wilson(1.0, 8)[1] == 1.0 and 0.6 < wilson(1.0, 8)[0] < 0.7   # all 8 right: not a zero-width interval
    low, high = wilson(0.5, 100)
    assert math.isclose(low, 0.4038, abs_tol=1e-3) and math.isclose(high, 0.5962, abs_tol=1e-3)
    with pytest.raises(ValueError):
        wilson(0.5, 0)


# ---- the frontier ---------------------------------------------------------------------------

def _record(path: Path, result: dict) -> tuple[str, Path]:
    path.mkdir(parents=True)
    (path / "result.json").write_text(json.dumps(result))
    (path / "DONE").write_text("")
    return path.name, path


def _candidate(label, nbytes, avg, policy=None, tok_s=10.0):
    return {"label": label, "policy": policy or label, "bytes_per_token": nbytes, "bytes_ratio": nbytes / 100,
            "task_avg": avg, "task_avg_by_length": {"2048": avg}, "decode_tok_s": tok_s,
            "perplexity": {"ppl_ratio": 1 + (1 - avg), "kl_mean": 1 - avg}}


def test_frontier_marks_the_pareto_optimal_candidates_within_comparable_runs(tmp_path):
    from caramba.bench.frontier import frontier_rows, plot_frontier

    tasks = {"prompts_sha256": "a" * 64}
    eval_a = _record(tmp_path / "a", {"mode": "eval", "baseline": "fp32", "tasks": tasks, "candidates": [
        _candidate("fp32", 100, 0.9), _candidate("q8_0", 50, 0.9), _candidate("q4_0", 25, 0.5),
        _candidate("bad", 60, 0.4), _candidate("tie", 50, 0.9)]})
    other = _record(tmp_path / "b", {"mode": "eval", "baseline": "fp32", "tasks": {"prompts_sha256": "b" * 64},
                                     "candidates": [_candidate("nf4", 25, 0.1)]})
    bench = _record(tmp_path / "c", {"mode": "decode-bench", "cells": [
        {"impl": "caramba", "cache_kind": "q8_0", "prompt_len": 512, "decode_tok_s": 99.0},
        {"impl": "caramba", "cache_kind": "q8_0", "prompt_len": 2048, "decode_tok_s": 42.0}]})
    unfinished = tmp_path / "d"
    unfinished.mkdir()
    (unfinished / "result.json").write_text(json.dumps({"mode": "eval", "candidates": [_candidate("x", 1, 1.0)]}))
    rows = frontier_rows([eval_a, other, bench, ("d", unfinished)])
    pareto = {r["cache"]: r["pareto"] for r in rows}
    # fp32 is beaten by q8_0 (fewer bytes, same score); "bad" by q8_0; the tie at 50 bytes dominates neither
    assert pareto == {"fp32": False, "q8_0": True, "q4_0": True, "bad": False, "tie": True, "nf4": True}
    assert next(r for r in rows if r["cache"] == "q8_0")["bench_decode_tok_s"] == 42.0
    assert next(r for r in rows if r["cache"] == "q4_0")["task_avg@2048"] == 0.5
    pytest.importorskip("matplotlib")
    assert plot_frontier(tmp_path / "f.png", rows).stat().st_size > 1000


def test_a_new_task_generator_makes_an_eval_record_stale(monkeypatch, long_tiny, tmp_path):
    """Other generators write other prompts: the record of an eval with tasks is not reused."""
    import caramba.runners.orchestrate as runners
    from caramba.manifest.loader import load_manifest

    (run,) = load_manifest(eval_manifest(tmp_path, long_tiny, SECTION)).iter_runs()
    before = runners.run_hash(runners.run_identity(run))
    monkeypatch.setattr(runners, "GENERATOR_VERSION", runners.GENERATOR_VERSION + 1)
    assert runners.run_hash(runners.run_identity(run)) != before


def test_batched_answers_equal_one_sample_at_a_time(loaded):
    """Left-padded rows of different context and question lengths, some stopping early: each row
    answers as it does alone (greedy on the tiny model, whose logits are far from ties)."""
    samples = task_suite.make_samples("niah_single", LENGTH, 3, 0, loaded.tokenizer, chat=True)
    samples += task_suite.make_samples("niah_multivalue", 1100, 2, 1, loaded.tokenizer, chat=True)
    assert len({len(s.context_ids) for s in samples}) > 1 and len({len(s.question_ids) for s in samples}) > 1
    q8, fp32 = Candidate("q8", CachePolicy.build("q8_0", qblock=8)), Candidate("fp32", CachePolicy.build("fp32"))
    # per-channel keys (KIVI, with a residual window): a batch is cut into runs of one question length
    # (holes between a context and its question would shift the key groups) whose rows begin at a group
    kivi = Candidate("kivi", CachePolicy.build(policy={"k": "q2_1c", "v": "q2_1"}, qblock=16, residual_len=8))
    eos = [int(loaded.tokenizer.eos_token_id)] if loaded.tokenizer.eos_token_id is not None else []
    alone, _ = answer_tasks(loaded.model, loaded.tokenizer, samples, [q8, kivi], fp32, eos_ids=eos, batch_size=1)
    batched, _ = answer_tasks(loaded.model, loaded.tokenizer, samples, [q8, kivi], fp32, eos_ids=eos, batch_size=4)
    for a, b in zip(alone, batched):
        assert [x.output_ids for x in a.answers] == [x.output_ids for x in b.answers]
        assert [x.steps for x in a.answers] == [x.steps for x in b.answers]


def test_per_channel_batches_hold_rows_that_begin_at_a_group():
    """With per-channel keys (groups of 8 tokens) a batch's rows share a question length and a context
    length modulo 8, so that left-padded each begins at a multiple of 8 (where the C step reads the
    groups); the samples are ordered so that such rows fill whole batches. Without, by prompt length."""
    def sample(i: int, context: int, question: int) -> task_suite.TaskSample:
        return task_suite.TaskSample("t", 64, i, [1] * context, [2] * question, ["x"], 4, "")

    samples = [sample(i, 40 + 8 * i + i % 2, 3) for i in range(8)]
    assert [[s.index for s in g] for g in _batches(samples, 4, 8)] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert [[s.index for s in g] for g in _batches(samples, 4)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    mixed = [sample(0, 48, 3), sample(1, 56, 3), sample(2, 64, 4), sample(3, 65, 4), sample(4, 73, 4)]
    assert [[s.index for s in g] for g in _batches(mixed, 8, 8)] == [[0, 1], [2], [3, 4]]


def test_an_interrupted_sweep_resumes_with_exactly_the_unfinished_eval_runs(tmp_path, monkeypatch, long_tiny):
    """Ctrl-C in the middle of a task sweep: the finished run keeps its record, the interrupted one
    has none, and the next `caramba run` skips the first and redoes the second."""
    import caramba.runners.eval as eval_runner

    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "runs"))
    manifest = eval_manifest(tmp_path, long_tiny, SECTION + """\
        matrix:
          eval.tasks.seed: [0, 1]
""")
    real = eval_runner.answer_tasks

    tok = load_model(str(long_tiny), progress=False).tokenizer
    seed_1 = task_suite.samples_digest(task_suite.make_samples("niah_single", LENGTH, 2, 1, tok, chat=True))

    def interrupt_seed_1(model, tokenizer, samples, *args, **kwargs):
        if task_suite.samples_digest(samples) == seed_1:
            raise KeyboardInterrupt
        return real(model, tokenizer, samples, *args, **kwargs)
    monkeypatch.setattr(eval_runner, "answer_tasks", interrupt_seed_1)
    r = invoke("run", manifest)
    assert r.exit_code == 130, r.output
    records = tmp_path / "runs" / "ev" / "t"
    assert (records / "kv.seed-0" / "DONE").is_file() and not (records / "kv.seed-1" / "DONE").exists()
    monkeypatch.setattr(eval_runner, "answer_tasks", real)
    resumed = invoke("run", manifest)
    assert resumed.exit_code == 0 and "skip t/kv.seed-0" in resumed.output, resumed.output
    assert (records / "kv.seed-1" / "DONE").is_file()


def test_steps_print_a_line_per_tenth_where_the_bar_cannot_draw():
    import io

    from rich.console import Console
    from rich.progress import Progress

    from caramba.progress import Steps

    out = io.StringIO()
    with Progress(console=Console(file=out, force_terminal=False)) as bar:
        steps = Steps(bar, "work", 20)
        for _ in range(20):
            steps.advance()
    lines = [line for line in out.getvalue().splitlines() if line.startswith("work:")]
    assert [line.split()[1] for line in lines] == [f"{2 * i}/20" for i in range(1, 11)]


def test_cli_eval_press_adds_pressed_candidates_and_the_press_alone(long_tiny):
    r = invoke("eval", "--model", long_tiny, "--tasks", "niah_single", "--lengths", str(LENGTH), "--samples", "1",
               "--no-perplexity", "--cache-kind", "q8_0", "--qblock", "8", "--press", "knorm@0.5",
               "--press", "streaming_llm@0/8:600", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    by = {c["label"]: c for c in out["candidates"]}
    assert list(by) == ["q8_0_qblock_8", "q8_0_qblock_8_knorm_0_5", "fp32_knorm_0_5",
                        "q8_0_qblock_8_streaming_llm_0_8_600", "fp32_streaming_llm_0_8_600", "fp32"]
    assert by["q8_0_qblock_8_knorm_0_5"]["press"] == "knorm@0.5" and by["fp32"]["press"] is None
    assert by["fp32_knorm_0_5"]["kept_fraction"] == pytest.approx(0.5, abs=0.01)
    assert by["fp32_streaming_llm_0_8_600"]["press"] == "streaming_llm@0/8:600"
    for args, message in [(("--press", "snap"), "--press snap"), (("--press", "knorm@0.5/3"), "INTERVAL:TARGET"),
                          (("--press", "pyramidkv@0.5/80:64"), "press_interval"),
                          (("--press", "knorm@0.5", "--perplexity"), "--tasks")]:
        bad = invoke("eval", "--model", long_tiny, "--tasks", "niah_single", "--no-perplexity", *args)
        assert bad.exit_code == 2 and message in bad.output and "Traceback" not in bad.output, bad.output
    help_text = CliRunner().invoke(app, ["eval", "--help"], env={"COLUMNS": "200"}).output
    assert "--press" in help_text and "METHOD@RATIO/INTERVAL:TARGET" in help_text


@pytest.mark.skipif(not __import__("caramba.gemm").gemm.available(), reason="torch without oneDNN's linear")
def test_bf16_prefill_rounds_the_shared_contexts_products_and_keys_them_apart(loaded, tmp_path):
    """prefill_precision bf16: the baseline's context K/V come from bf16 products (off fp32's by bf16
    rounding, not more), stored under their own key; the answers are scored as usual."""
    import tolerance as tol
    from safetensors.torch import load_file

    from caramba.evaluation.context_store import DIRNAME, ContextStore, model_identity

    fp32 = CachePolicy.build("fp32")
    samples = _samples(loaded, 1)
    store = ContextStore(tmp_path, model=model_identity(loaded.model, "tiny"))
    kept = {}
    for precision in ("fp32", "bf16"):
        before = set((tmp_path / DIRNAME).glob("*.safetensors"))
        results, _ = answer_tasks(loaded.model, loaded.tokenizer, samples, [], Candidate("fp32", fp32),
                                  contexts=store, prefill_precision=precision)
        assert all(a.output_ids for a in results[0].answers)
        (entry,) = set((tmp_path / DIRNAME).glob("*.safetensors")) - before    # a new entry: keyed apart
        kept[precision] = load_file(entry)
    k32, k16 = kept["fp32"]["k.1"], kept["bf16"]["k.1"]
    assert not torch.equal(k32, k16)
    torch.testing.assert_close(k16, k32, **tol.forward(k32, loaded.model.config, torch.bfloat16))
    with pytest.raises(ValueError, match="bf16 with prefill='shared' only"):
        answer_tasks(loaded.model, loaded.tokenizer, samples, [], Candidate("fp32", fp32), prefill="own",
                     prefill_precision="bf16")


def test_bf16_prefill_is_recorded_and_refused_where_the_cpu_lacks_bf16(tmp_path, monkeypatch, long_tiny):
    from caramba import gemm

    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "runs"))
    section = f"          candidates: [{{cache_kind: q8_0}}]\n          tasks: {{names: [niah_single], " \
              f"lengths: [{LENGTH}], samples: 1, prefill_precision: bf16}}\n"
    monkeypatch.setattr(gemm, "bf16_native", lambda: False)
    r = invoke("run", eval_manifest(tmp_path, long_tiny, section))
    assert r.exit_code == 2 and "eval.tasks.prefill_precision" in r.output and "AVX-512 BF16" in r.output, r.output
    assert not (tmp_path / "runs" / "ev").exists()
    own = invoke("run", eval_manifest(tmp_path, long_tiny, section.replace("samples: 1,", "samples: 1, prefill: own,")))
    assert own.exit_code == 2 and "prefill: shared" in own.output, own.output
    monkeypatch.setattr(gemm, "bf16_native", lambda: True)
    quantized = invoke("run", eval_manifest(tmp_path, long_tiny, section.replace("{cache_kind: q8_0}",
                                                                                 "{cache_kind: q8_0, weights: q8_0}")))
    assert quantized.exit_code == 2 and "quantized weights" in quantized.output, quantized.output
    assert not (tmp_path / "runs" / "ev").exists()
    monkeypatch.setattr(gemm, "bf16_native", lambda: True)
    r = invoke("run", eval_manifest(tmp_path, long_tiny, section))
    assert r.exit_code == 0, r.output
    result = json.loads((tmp_path / "runs" / "ev" / "t" / "kv" / "result.json").read_text())
    assert result["tasks"]["prefill_precision"] == "bf16"
