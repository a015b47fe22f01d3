"""Modes as plugins (caramba.runners.registry): a mode is one module. The throwaway mode below,
registered by this test only, is validated, preflighted, run and reported through `caramba run`
and `caramba report` with no other file touched; the built-in modes answer through the same
registry; registering a mode changes no other run's hash or record."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import Field
from typer.testing import CliRunner

from caramba.cli import app
from caramba.errors import UserError
from caramba.manifest import load_manifest, resolved_run_yaml, schema
from caramba.runners import MODE_RUNNERS, registry, run_hash, run_identity
from caramba.runners.registry import BASE_RECORD, KIB, Mode, Workload
from conftest import write_manifest
from test_cli import write_tiny_model


# ---- the throwaway mode: everything a new mode needs -----------------------------------------
class NextTokenSettings(schema.SettingsModel):
    """Settings of `mode: next-token`: the model's likeliest next tokens after each prompt."""

    prompts: list[str] = Field(min_length=1)
    top: int = Field(3, ge=1)


class NextTokenMode(Mode):
    name = "next-token"
    section = "next"
    settings = NextTokenSettings
    columns = ("n_prompts", "mean_top_prob")

    def run(self, loaded, settings, seed, record, console, **extra):
        rows = []
        for prompt in settings.prompts:
            ids = torch.tensor([loaded.tokenizer.encode(prompt, add_special_tokens=False)])
            with torch.no_grad():
                probs = torch.softmax(loaded.model(ids, last_only=True)[0, -1].float(), -1)
            top = probs.topk(settings.top)
            rows.append({"prompt": prompt, "top_ids": top.indices.tolist(), "top_probs": top.values.tolist()})
        record.log(f"next-token: {len(rows)} prompt(s)")
        console.print(f"next-token: {len(rows)} prompt(s)")
        mean = sum(r["top_probs"][0] for r in rows) / len(rows)
        return {"mode": self.name, "prompts": rows, "summary": {"n_prompts": len(rows), "mean_top_prob": mean}}

    def preflight(self, r, where, sources):
        vocab = sources.config(r.model.source).vocab_size
        if r.run.settings.top > vocab:
            raise UserError(f"{where}: next.top={r.run.settings.top} is more than the model's {vocab} tokens")

    def record_bytes(self, r):
        return BASE_RECORD + KIB * len(r.run.settings.prompts)

    def workload(self, r):   # one forward over the longest prompt (a token per byte at most)
        return Workload(max(len(p.encode()) for p in r.run.settings.prompts), 1, "next.prompts", "next.prompts")
# ---- end of the throwaway mode ---------------------------------------------------------------


@pytest.fixture
def next_token():
    mode = registry.register(NextTokenMode())
    yield mode
    registry.unregister("next-token")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def runs(tmp_path, monkeypatch):
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "runs"))
    return tmp_path / "runs"


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


RUNS = """\
  - id: nt
    mode: next-token
    next:
      prompts: ["hello", "abc"]
      top: {top}
  - id: greedy
    mode: generate
    generate:
      prompts: ["hello"]
      max_new_tokens: 3
"""


def test_a_registered_mode_validates_preflights_runs_and_reports(next_token, tiny_model, runs, tmp_path):
    path = write_manifest(tmp_path / "m.yaml", RUNS.format(top=2), model=tiny_model, name="nt")
    r = invoke("validate", path)
    assert r.exit_code == 0, r.output
    r = invoke("run", path)
    assert r.exit_code == 0, r.output
    record = runs / "nt" / "t" / "nt"
    result = json.loads((record / "result.json").read_text())
    assert (record / "DONE").is_file() and result["mode"] == "next-token"
    assert [len(p["top_ids"]) for p in result["prompts"]] == [2, 2]
    assert "next-token: 2 prompt(s)" in (record / "log.txt").read_text()
    r = invoke("report", path, "--json")
    assert r.exit_code == 0, r.output
    rows = {row["run"]: row for row in json.loads(r.output)}
    assert rows["t/nt"]["status"] == "done"
    assert rows["t/nt"]["metrics"] == {"n_prompts": 2, "mean_top_prob": pytest.approx(result["summary"]["mean_top_prob"])}
    assert set(rows["t/greedy"]["metrics"]) == {"decode_tok_s_median", "prefill_s_median", "new_tokens"}
    assert "skip t/nt: already done" in invoke("run", path).output   # its hash holds on the second run


def test_a_registered_mode_s_errors_name_its_fields(next_token, tiny_model, runs, tmp_path):
    bad = write_manifest(tmp_path / "bad.yaml", RUNS.format(top="many"), model=tiny_model, name="nt")
    r = invoke("validate", bad)
    assert r.exit_code == 2 and "bad.yaml:13: targets[0].runs[0].next.top: 'many' is a string" in r.output, r.output
    r = invoke("run", bad, "--set", "targets.t.runs.nt.next.topp=1")
    assert r.exit_code == 2 and "valid keys: prompts, top; did you mean 'top'?" in r.output, r.output
    too_many = write_manifest(tmp_path / "m.yaml", RUNS.format(top=1000), model=tiny_model, name="nt")
    r = invoke("run", too_many)   # preflight: exit 2 before any record, the greedy run's included
    assert r.exit_code == 2 and "run t/nt: next.top=1000 is more than the model's 259 tokens" in r.output, r.output
    assert not (runs / "nt").exists()


def test_the_mode_is_gone_when_unregistered_and_other_runs_keep_their_hash(tiny_model, runs, tmp_path):
    path = write_manifest(tmp_path / "g.yaml", """\
  - id: greedy
    mode: generate
    generate: {prompts: ["hello"], max_new_tokens: 3}
""", model=tiny_model, name="g")
    (run,) = load_manifest(path).iter_runs()
    m = load_manifest(path)
    before = run_hash(run_identity(run)), resolved_run_yaml(m, "t", "greedy")
    registry.register(NextTokenMode())
    try:
        (again,) = load_manifest(path).iter_runs()
        assert "next" in type(again.run).model_fields and again.run.model_dump().get("next", "absent") == "absent"
        assert (run_hash(run_identity(again)), resolved_run_yaml(load_manifest(path), "t", "greedy")) == before
    finally:
        registry.unregister("next-token")
    r = invoke("validate", write_manifest(tmp_path / "m.yaml", RUNS.format(top=2), model=tiny_model))
    assert r.exit_code == 2 and "'next-token' is not a valid mode" in r.output and "unknown field 'next'" in r.output


def test_the_built_in_modes_answer_through_the_registry():
    modes = registry.modes()
    assert list(schema.MODES) == ["generate", "decode-bench", "speculative", "cache-autotune", "eval"]
    assert set(modes) == set(schema.MODES) == set(MODE_RUNNERS)
    for name, mode in modes.items():
        assert mode.section == schema.section_for(name) and mode.settings is schema.MODE_SETTINGS[name]
        assert MODE_RUNNERS[name] == mode.run
    with pytest.raises(ValueError, match="registered already"):
        registry.register(type(modes["generate"])())
    with pytest.raises(ValueError, match="clashes"):   # a section another mode reads
        registry.register(type("Clash", (NextTokenMode,), {"name": "clash", "section": "bench"})())
    assert "clash" not in registry.modes() and "clash" not in schema.MODES


def test_swapping_a_runner_through_mode_runners_reaches_the_registry(monkeypatch):
    def fake(*args, **kwargs):
        return {}
    monkeypatch.setitem(MODE_RUNNERS, "eval", fake)
    assert registry.get("eval").run is fake
    with pytest.raises(KeyError):
        MODE_RUNNERS["no-such-mode"]


def test_registering_builds_new_models_and_leaves_the_old_ones_as_they_were():
    """One registry (caramba.manifest.modes): registering a mode builds new Run/Target/Manifest
    models from it (pydantic.create_model), never editing a model in place."""
    run_before, manifest_before = schema.Run, schema.Manifest
    fields_before = dict(run_before.model_fields)
    registry.register(NextTokenMode())
    try:
        assert schema.Run is not run_before and "next" in schema.Run.model_fields
        assert list(schema.Run.model_fields).index("next") == list(schema.Run.model_fields).index("expect") - 1
        assert dict(run_before.model_fields) == fields_before and "next" not in run_before.model_fields
        assert "next-token" in schema.MODES and schema.MODE_SECTIONS["next-token"] == "next"
        assert registry.get("next-token").settings is NextTokenSettings
    finally:
        registry.unregister("next-token")
    assert "next" not in schema.Run.model_fields and schema.Manifest is not manifest_before
    assert schema.Manifest.model_json_schema() == manifest_before.model_json_schema()
