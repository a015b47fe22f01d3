"""Sweeps in manifests: matrix expansion (product, include, exclude, ids, params), errors that
name the matrix entry's line, --set and --run on sweeps, and what a sweep's record states."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from caramba.errors import UserError
from caramba.manifest import load_manifest, resolved_run_yaml
from caramba.manifest import matrix as matrix_module
from caramba.runners import run_hash, run_identity, select_runs

HEAD = """\
version: 1
name: sw
targets:
  - type: experiment
    name: t
    runs:
      - id: plain
        mode: generate
        generate: {prompts: ["hi"], max_new_tokens: 4}
      - id: sweep
        mode: generate
        generate:
          prompts: ["Hello"]
          max_new_tokens: 8
"""


def sweep(tmp_path: Path, tail: str, head: str = HEAD) -> Path:
    path = tmp_path / "m.yaml"
    path.write_text(head + textwrap.indent(textwrap.dedent(tail), " " * 8))
    return path


def runs_of(path: Path, overrides=()) -> dict:
    return {r.run.id: r for r in load_manifest(path, overrides).iter_runs()}


def line_of(path: Path, text: str) -> int:
    return next(n for n, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def test_product_gives_one_run_per_combination_with_readable_ids_and_params(tmp_path):
    path = sweep(tmp_path, """\
        matrix:
          generate.cache_kind: [fp32, q8_0]
          seed: [0, 1]
          model.source: [/models/a/model.gguf]
        """)
    runs = runs_of(path)
    assert list(runs) == ["plain", "sweep.cache_kind-fp32.seed-0.source-model.gguf",
                          "sweep.cache_kind-fp32.seed-1.source-model.gguf",
                          "sweep.cache_kind-q8_0.seed-0.source-model.gguf",
                          "sweep.cache_kind-q8_0.seed-1.source-model.gguf"]
    r = runs["sweep.cache_kind-q8_0.seed-1.source-model.gguf"]
    assert (r.run.generate.cache_kind, r.run.seed, r.model.source) == ("q8_0", 1, "/models/a/model.gguf")
    assert r.run.params == {"generate.cache_kind": "q8_0", "seed": 1, "model.source": "/models/a/model.gguf"}
    assert r.run.generate.max_new_tokens == 8 and r.run.generate.prompts == ["Hello"]   # the rest as the base run
    assert runs["plain"].run.params is None


def test_exclude_drops_and_include_extends_or_adds_as_github_does(tmp_path):
    path = sweep(tmp_path, """\
        matrix:
          generate.cache_kind: [fp32, q8_0]
          seed: [0, 1]
        exclude:
          - {generate.cache_kind: q8_0, seed: 1}
        include:
          - {generate.cache_kind: fp32, generate.max_new_tokens: 5}   # extends both fp32 combinations
          - {generate.cache_kind: q4_0, seed: 7}                      # matches none: a new one
        """)
    runs = runs_of(path)
    got = {rid: (r.run.generate.cache_kind, r.run.seed, r.run.generate.max_new_tokens)
           for rid, r in runs.items() if rid != "plain"}
    assert got == {"sweep.cache_kind-fp32.seed-0.max_new_tokens-5": ("fp32", 0, 5),
                   "sweep.cache_kind-fp32.seed-1.max_new_tokens-5": ("fp32", 1, 5),
                   "sweep.cache_kind-q8_0.seed-0": ("q8_0", 0, 8),
                   "sweep.cache_kind-q4_0.seed-7": ("q4_0", 7, 8)}
    # an include never overwrites an original matrix value: this one matches nothing, so it is added
    path = sweep(tmp_path, """\
        matrix: {seed: [0, 1]}
        include: [{seed: 2, generate.cache_kind: q8_0}]
        """)
    assert sorted(runs_of(path)) == ["plain", "sweep.seed-0", "sweep.seed-1", "sweep.seed-2.cache_kind-q8_0"]


def test_values_that_slug_alike_still_get_distinct_ids(tmp_path):
    path = sweep(tmp_path, """\
        matrix:
          generate.prompts: [["a"], ["b"]]
          model.source: ["/x/m one", "/x/m_one"]
        """)
    ids = [rid for rid in runs_of(path) if rid != "plain"]
    assert len(set(ids)) == 4 and all(rid.startswith(("sweep.prompts-a-", "sweep.prompts-b-")) for rid in ids)


def test_an_invalid_value_names_the_matrix_line_and_the_expanded_run(tmp_path):
    path = sweep(tmp_path, """\
        matrix:
          generate.cache_kind: [fp32, q9_0]
          seed: [0]
        """)
    with pytest.raises(UserError) as error:
        load_manifest(path)
    message = str(error.value)
    assert f"m.yaml:{line_of(path, 'generate.cache_kind: [fp32')} (matrix run sweep.cache_kind-q9_0.seed-0)" in message
    assert "'q9_0' is not a valid cache_kind" in message and "1 problem" in message
    # a value from an include points at the include's line
    path = sweep(tmp_path, """\
        matrix: {seed: [0]}
        include:
          - {seed: 1, generate.max_new_tokens: 0}
        """)
    with pytest.raises(UserError) as error:
        load_manifest(path)
    assert f"m.yaml:{line_of(path, 'max_new_tokens: 0')} (matrix run sweep.seed-1.max_new_tokens-0)" in str(error.value)


@pytest.mark.parametrize("tail, expected, at", [
    ("matrix:\n  seed: [0]\n  generate.cache_kind: []\n", "needs a non-empty list of values", "cache_kind: []"),
    ("matrix:\n  seed: [0]\n  generate.cache_kin: [fp32]\n", "no 'cache_kin' in targets[0].runs[1].generate",
     "cache_kin: [fp32]"),
    ("matrix: {id: [a, b]}\n", "cannot be swept", "matrix:"),
    ("matrix: [generate.cache_kind]\n", "matrix must map settings paths", "matrix:"),
    ("matrix: {seed: [0, 1]}\nexclude: [{generate.cache_kind: fp32}]\n", "is not a matrix key", "exclude:"),
    ("matrix: {seed: [0]}\nexclude: [{seed: 0}]\n", "drops every combination", "exclude:"),
    ("matrix: {seed: [0]}\nparams: {seed: 0}\n", "gets its params from the matrix", "params:"),
    # YAML 1.2 has no implicit timestamps: a plain 2001-01-01 is a string; an explicit tag is a date
    ("matrix:\n  seed: [!!timestamp 2001-01-01]\n", "is not plain data", "seed: [!!timestamp"),
])
def test_matrix_errors_name_their_line(tmp_path, tail, expected, at):
    path = sweep(tmp_path, tail)
    with pytest.raises(UserError) as error:
        load_manifest(path)
    assert expected in str(error.value)
    assert str(error.value).startswith(f"{path}:{line_of(path, at)}: "), str(error.value)


def test_too_many_runs_are_refused_before_they_are_built(tmp_path, monkeypatch):
    monkeypatch.setattr(matrix_module, "MAX_RUNS", 10)
    path = sweep(tmp_path, "matrix: {seed: [0, 1, 2, 3], generate.max_new_tokens: [1, 2, 3]}\n")
    with pytest.raises(UserError, match="more than 10 runs"):
        load_manifest(path)


def test_set_reaches_every_expanded_run_and_a_swept_key_is_refused(tmp_path):
    path = sweep(tmp_path, "matrix: {seed: [0, 1], generate.max_new_tokens: [3]}\n")
    runs = runs_of(path, ["targets.t.runs.sweep.generate.temperature=0.5"])
    swept = [r for rid, r in runs.items() if rid != "plain"]
    assert [(r.run.generate.temperature, r.run.generate.max_new_tokens) for r in swept] == [(0.5, 3), (0.5, 3)]
    for text in ("targets.t.runs.sweep.generate.max_new_tokens=30", "targets.t.runs.sweep.generate={prompts: [a]}"):
        with pytest.raises(UserError) as error:   # the matrix would overwrite it in every run: never silently
            load_manifest(path, [text])
        assert str(error.value).startswith(f"--set {text}: 'generate.max_new_tokens' is swept by run 'sweep'")
        assert f"m.yaml:{line_of(path, 'matrix: {seed')}" in str(error.value)
        assert "--set targets.t.runs.sweep.matrix.generate.max_new_tokens=[...]" in str(error.value)
    assert runs_of(path, ["targets.t.runs.sweep.matrix.seed=[4]"])   # the sweep's own values may be set
    with pytest.raises(UserError) as error:   # a --set error in an expanded run says where it came from
        load_manifest(path, ["targets.t.runs.sweep.generate.top_p=7"])
    assert "(from --set targets.t.runs.sweep.generate.top_p=7) (matrix run sweep.seed-0.max_new_tokens-3)" in str(error.value)


def test_run_selects_globs_and_a_sweeps_base_id(tmp_path):
    path = sweep(tmp_path, "matrix: {seed: [0, 1], generate.cache_kind: [fp32, q8_0]}\n")
    m = load_manifest(path)
    ids = lambda only: [r.run.id for r in select_runs(m, only)]  # noqa: E731
    assert len(ids(["sweep"])) == 4 and ids(["plain"]) == ["plain"]
    assert ids(["t/sweep.seed-1.*"]) == ["sweep.seed-1.cache_kind-fp32", "sweep.seed-1.cache_kind-q8_0"]
    assert ids(["*q8_0"]) == ["sweep.seed-0.cache_kind-q8_0", "sweep.seed-1.cache_kind-q8_0"]
    with pytest.raises(UserError, match="no such run"):
        select_runs(m, ["swee"])


def test_params_are_not_identity_and_a_records_manifest_reloads_to_the_same_run(tmp_path):
    path = sweep(tmp_path, "matrix: {seed: [0, 1]}\n")
    m = load_manifest(path)
    r = next(r for r in m.iter_runs() if r.run.id == "sweep.seed-1")
    assert "params" not in run_identity(r)["run"]
    text = resolved_run_yaml(m, "t", "sweep.seed-1")
    assert [run["id"] for run in yaml.safe_load(text)["targets"][0]["runs"]] == ["sweep.seed-1"]
    again_path = tmp_path / "again.yaml"
    again_path.write_text(text)
    again = next(load_manifest(again_path).iter_runs())
    assert again.run.params == {"seed": 1} and run_hash(run_identity(again)) == run_hash(run_identity(r))
