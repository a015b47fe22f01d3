"""`mode: eval` with candidates that carry their own weights (source:, weights:): a weight-format
study scored against the run's model on the same token ids, each candidate answering as a run
of its own model would."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from runners.test_eval import LENGTH, eval_manifest, long_tiny  # noqa: F401  (a fixture)
from test_cli import invoke


SECTION = f"""\
          candidates: [{{weights: q8_0}}, {{weights: q4_0, cache_kind: q8_0, qblock: 8}}, {{cache_kind: q4_0, qblock: 8}}]
          perplexity: {{prompt_len: 16, max_tokens: 64}}
          tasks: {{names: [niah_single], lengths: [{LENGTH}], samples: 2}}
"""


def _result(tmp_path: Path) -> tuple[dict, dict]:
    record = tmp_path / "runs" / "ev" / "t" / "kv"
    return (json.loads((record / "result.json").read_text()), json.loads((record / "answers.json").read_text()))


def test_weight_candidates_score_as_runs_of_their_own_model(tmp_path, monkeypatch, long_tiny):
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "runs"))
    r = invoke("run", eval_manifest(tmp_path, long_tiny, SECTION))
    assert r.exit_code == 0, r.output
    result, answers = _result(tmp_path)
    by = {c["label"]: c for c in result["candidates"]}
    assert list(by) == ["fp32_weights_q8_0", "q8_0_qblock_8_weights_q4_0", "q4_0_qblock_8", "fp32"]
    assert set(answers) == set(by)   # the q4_0 weights' stand-in baseline answered, and is not reported
    assert [by[k]["weights"] for k in by] == ["q8_0", "q4_0", "fp32", "fp32"]
    assert by["q8_0_qblock_8_weights_q4_0"]["weight_bytes"] < by["fp32_weights_q8_0"]["weight_bytes"] \
        < by["fp32"]["weight_bytes"] == by["q4_0_qblock_8"]["weight_bytes"]
    assert by["fp32"]["weight_bytes_ratio"] == 1.0
    # every answer computed: none taken from another model's entry in the answer store
    assert result["tasks"]["time"]["answers_reused"] == 0
    for c in by.values():
        assert c["bytes_at_context"] == round(c["weight_bytes"] + c["bytes_per_token"] * c["bytes_context"])
        assert c["perplexity"]["decode_tok_s"] > 0
    assert by["fp32_weights_q8_0"]["perplexity"]["kl_mean"] > 0 and by["fp32_weights_q8_0"]["bytes_ratio"] == 1.0
    # rerun: every answer from the answer store, each under the model that gave it, the same
    manifest = tmp_path / "e.yaml"
    assert invoke("run", manifest, "--force").exit_code == 0
    rerun, rerun_answers = _result(tmp_path)
    assert rerun["tasks"]["time"]["answers_computed"] == 0 and rerun_answers == {
        label: [{**a, "answer_reused": True} for a in got] for label, got in rerun_answers.items()}
    assert {k: [a["text"] for a in v] for k, v in rerun_answers.items()} == \
        {k: [a["text"] for a in v] for k, v in answers.items()}
    # the report: the weights beside the caches, the frontier by what each holds at the context
    report = invoke("report", manifest)
    assert report.exit_code == 0 and "weights + cache" in report.output, report.output
    front = {r["cache"]: r for r in json.loads(invoke("report", manifest, "--format", "json").stdout)["frontier"]}
    assert front["q8_0_qblock_8_weights_q4_0"]["weights"] == "q4_0"
    smallest = min(front.values(), key=lambda r: r["bytes_at_context"])
    assert smallest["cache"] == "q8_0_qblock_8_weights_q4_0" and smallest["pareto"]

    # The same eval run on q8_0 weights: its baseline is what the q8_0-weights candidate was
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "runs-q8"))
    alone = eval_manifest(tmp_path, long_tiny, SECTION.replace("{weights: q8_0}, {weights: q4_0, cache_kind: q8_0, "
                                                               "qblock: 8}, ", ""))
    alone.write_text(alone.read_text().replace(f'source: "{long_tiny}"', f'source: "{long_tiny}", weights: q8_0'))
    r = invoke("run", alone)
    assert r.exit_code == 0, r.output
    record = tmp_path / "runs-q8" / "ev" / "t" / "kv"
    q8 = json.loads((record / "result.json").read_text())
    q8_answers = json.loads((record / "answers.json").read_text())
    base = next(c for c in q8["candidates"] if c["label"] == "fp32")
    assert base["weights"] == "q8_0" and base["weight_bytes"] == by["fp32_weights_q8_0"]["weight_bytes"]
    assert by["fp32_weights_q8_0"]["perplexity"]["nll"] == pytest.approx(q8["candidates"][0]["perplexity"]["baseline_nll"],
                                                                          rel=1e-6)
    assert [a["text"] for a in answers["fp32_weights_q8_0"]] == [a["text"] for a in q8_answers["fp32"]]
    assert by["fp32_weights_q8_0"]["tasks"] == base["tasks"]


def test_a_candidates_weights_must_share_the_runs_tokenizer_and_load(tmp_path, monkeypatch, long_tiny):
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "runs"))
    other = tmp_path / "other"
    shutil.copytree(long_tiny, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[:2]
    vocab[first], vocab[second] = vocab[second], vocab[first]      # same size, other ids
    (other / "tokenizer.json").write_text(json.dumps(tok))
    section = f"""\
          candidates: [{{source: "{other}", name: theirs}}]
          perplexity: {{prompt_len: 16, max_tokens: 64}}
"""
    r = invoke("run", eval_manifest(tmp_path, long_tiny, section))
    assert r.exit_code == 2 and "eval.candidates[0].source" in r.output and "tokenizer" in r.output, r.output
    assert not (tmp_path / "runs" / "ev").exists()
    for bad, words in ((f'{{source: "{tmp_path / "nowhere"}"}}', "eval.candidates[0].source"),
                       ("{weights: native}", "eval.candidates[0].weights")):
        r = invoke("run", eval_manifest(tmp_path, long_tiny, section.replace(f'{{source: "{other}", name: theirs}}', bad)))
        assert r.exit_code == 2 and words in r.output, (bad, r.output)
    r = invoke("run", eval_manifest(tmp_path, long_tiny, section + "          baseline: {weights: q8_0}\n"))
    assert r.exit_code == 2 and "baseline" in r.output and "model.weights" in r.output, r.output


def test_the_memory_preflight_counts_each_candidates_own_weights(tmp_path, long_tiny):
    from caramba.errors import UserError
    from caramba.manifest import parse_manifest
    from caramba.model.zoo import inspect_source
    from caramba.runners import resources

    plain = eval_manifest(tmp_path, long_tiny, SECTION.replace("{weights: q8_0}, {weights: q4_0, cache_kind: q8_0, "
                                                               "qblock: 8}, ", ""))
    plain_run = next(parse_manifest(plain.read_text(), "p.yaml").iter_runs())
    weighed_run = next(parse_manifest(eval_manifest(tmp_path, long_tiny, SECTION).read_text(), "w.yaml").iter_runs())
    configs = {str(long_tiny): inspect_source(str(long_tiny))}
    base = resources.run_memory(plain_run, configs)["weights"][0]
    both = resources.run_memory(weighed_run, configs)["weights"][0]
    assert both == pytest.approx(base * (1 + (34 / 32) / 4 + (18 / 32) / 4), rel=1e-6)   # + q8_0's and q4_0's copies
    need = sum(v for v, _ in resources.run_memory(weighed_run, configs).values())
    with pytest.raises(UserError, match="needs about .* more than the"):   # exit 2 before anything loads
        resources.check_memory([weighed_run], configs, available=need - 1)
    resources.check_memory([weighed_run], configs, available=need)
