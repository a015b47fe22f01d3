"""Samples a person can inspect (issue 47): an eval record's answers.json keeps each sample's
references, scoring rule, question and context (sha256, head, tail) beside every candidate's
answer, and `caramba report --samples RUN [--failed] [--task T]` shows them side by side."""

from __future__ import annotations

import hashlib
import json

import pytest
from test_eval import LENGTH, eval_manifest, invoke, long_tiny  # noqa: F401  (fixture)

from caramba.evaluation import tasks as task_suite
from caramba.manifest.schema import TaskSettings
from caramba.model.zoo import load_model
from caramba.runners.eval import task_samples

SECTION = f"""\
          candidates: [{{cache_kind: q4_0, qblock: 8, name: q4}}]
          tasks: {{names: [niah_single], lengths: [{LENGTH}], samples: 2}}
"""


@pytest.fixture(scope="module")
def record(tmp_path_factory, long_tiny):  # noqa: F811
    """One tiny eval run's record (a random model: its answers mostly fail)."""
    root = tmp_path_factory.mktemp("samples")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CARAMBA_RUNS_DIR", str(root / "runs"))
        r = invoke("run", eval_manifest(root, long_tiny, SECTION))
    assert r.exit_code == 0, r.output
    return root / "runs" / "ev" / "t" / "kv"


def test_answers_keep_each_samples_references_rule_question_and_context(record, long_tiny):  # noqa: F811
    answers = json.loads((record / "answers.json").read_text())
    assert set(answers) == {"q4", "fp32"}
    tok = load_model(str(long_tiny), progress=False).tokenizer
    samples = task_samples(tok, TaskSettings(names=["niah_single"], lengths=[LENGTH], samples=2))
    for rows in answers.values():
        assert len(rows) == 2
        for row, sample in zip(rows, samples):
            context = tok.decode(sample.context_ids)
            assert (row["task"], row["index"]) == (sample.task, sample.index)
            assert row["references"] == sample.answers and row["references"] and row["metric"] == "all"
            assert row["question"] == tok.decode(sample.question_ids) and row["question"]
            assert row["context"] == {"sha256": hashlib.sha256(context.encode()).hexdigest(),
                                      "tokens": len(sample.context_ids), "head": context[:task_suite.EXCERPT_CHARS],
                                      "tail": context[-task_suite.EXCERPT_CHARS:]}
            # the recorded score is the task's rule applied to the recorded answer
            assert row["score"] == task_suite.score(row["text"], row["references"], row["metric"])


def test_report_samples_shows_references_beside_every_candidates_answer(record):
    answers = json.loads((record / "answers.json").read_text())
    r = invoke("report", "--samples", record)
    assert r.exit_code == 0, r.output
    assert r.output.count("niah_single @ 768") == 2 and "2 of 2 sample(s)" in r.output, r.output
    first = answers["q4"][0]
    assert first["references"][0] in r.output and "references (all)" in r.output
    assert "q4" in r.output and "fp32" in r.output and first["context"]["sha256"][:16] in r.output
    # --json: the samples with each candidate's answer, --failed only those some candidate missed
    data = json.loads(invoke("report", "--samples", record, "--failed", "--json").output)
    missed = [(a["task"], a["index"]) for a in answers["q4"] if a["score"] < 1]
    missed += [(a["task"], a["index"]) for a in answers["fp32"] if a["score"] < 1 and (a["task"], a["index"]) not in missed]
    assert sorted((s["task"], s["index"]) for s in data) == sorted(missed)
    for s in data:
        assert set(s["answers"]) == {"q4", "fp32"} and s["references"]
    # --task filters, and names the tasks when it matches none
    assert "0 of 2" not in invoke("report", "--samples", record, "--task", "niah_single").output
    bad = invoke("report", "--samples", record, "--task", "vt")
    assert bad.exit_code == 2 and "tasks: niah_single" in bad.output
    # not an eval record, or --failed without --samples: exit 2 with the reason
    assert invoke("report", "--samples", record.parent).exit_code == 2
    assert invoke("report", record, "--failed").exit_code == 2
