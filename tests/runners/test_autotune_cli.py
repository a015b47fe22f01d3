"""`caramba autotune`, `caramba plans` and `cache_kind: auto` end to end on a tiny HF-layout model:
exit codes, JSON output, run records, and that `auto` resolves through the stored plan."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from caramba.cli import app
from conftest import write_manifest
from test_cli import write_tiny_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def autotune_json(tiny_model, plans, *extra):
    r = invoke("autotune", "--model", tiny_model, "--budget-mb", 1, "--max-seq-len", 64, "--plan-path", plans, "--json", *extra)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_autotune_json_then_reuse_then_plans_commands(tiny_model, tmp_path):
    plans = tmp_path / "plans.json"
    first = autotune_json(tiny_model, plans)
    assert first["status"] == "measured" and set(first) >= {"chosen", "candidates", "key", "key_id", "needle"}
    assert first["chosen"]["verdict"] == "chosen" and first["chosen"] in first["candidates"]
    assert {"bytes", "gates", "speed", "verdict", "why"} <= set(first["candidates"][1])
    assert first["key"]["max_seq_len"] == 64 and first["key"]["budget_mb"] == 1
    again = autotune_json(tiny_model, plans)
    assert again["status"] == "reused" and again["chosen"] == first["chosen"]
    forced = autotune_json(tiny_model, plans, "--force")
    assert forced["status"] == "forced" and forced["key_id"] == first["key_id"]

    listed = invoke("plans", "list", "--plan-path", plans)
    assert listed.exit_code == 0 and first["key_id"] in listed.output
    shown = invoke("plans", "show", first["key_id"][:8], "--plan-path", plans)
    assert shown.exit_code == 0 and json.loads(shown.stdout)["chosen"] == forced["chosen"]
    assert invoke("plans", "show", "zzzz", "--plan-path", plans).exit_code == 2
    cleared = invoke("plans", "clear", "--plan-path", plans)
    assert cleared.exit_code == 0 and "removed 1 plan" in cleared.output
    assert json.loads(invoke("plans", "list", "--json", "--plan-path", plans).stdout) == {}


def test_autotune_table_and_exit_codes(tiny_model, tmp_path):
    plans = tmp_path / "plans.json"
    table = invoke("autotune", "--model", tiny_model, "--budget-mb", 1, "--max-seq-len", 64, "--plan-path", plans)
    assert table.exit_code == 0, table.output
    assert "chosen:" in table.output and "q8_0" in table.output and "cache autotune" in table.output
    tiny = invoke("autotune", "--model", tiny_model, "--budget-mb", 0.0001, "--max-seq-len", 64, "--plan-path", plans)
    assert tiny.exit_code == 2
    assert "no cache fits the budget" in tiny.output and "Traceback" not in tiny.output
    missing = invoke("autotune", "--model", tiny_model, "--budget-mb", 1, "--text", tmp_path / "nope.txt")
    assert missing.exit_code == 2 and "no such file" in missing.output
    assert invoke("autotune", "--model", tiny_model).exit_code == 2   # --budget-mb is required


def test_corrupt_plan_file_is_reported_by_the_cli(tiny_model, tmp_path):
    plans = tmp_path / "plans.json"
    plans.write_text("{oops")
    r = invoke("plans", "list", "--plan-path", plans)
    assert r.exit_code == 0 and "corrupt" in r.output
    # Listing reports the file and changes nothing: no rename, no lock file beside it.
    assert plans.read_text() == "{oops" and sorted(p.name for p in tmp_path.iterdir()) == ["plans.json"]


def test_generate_cache_kind_auto(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "runs"))
    small = invoke("generate", "hi", "--model", tiny_model, "--cache-kind", "q8_0", "--cache-budget-mb", 0.0001)
    assert small.exit_code == 2 and "cache_budget_mb" in small.output   # a named kind must fit its budget
    clash = invoke("generate", "hi", "--model", tiny_model, "--cache-kind", "auto", "--cache-budget-mb", 1, "--rotate-keys")
    assert clash.exit_code == 2
    r = invoke("generate", "hi", "--model", tiny_model, "--cache-kind", "auto", "--cache-budget-mb", 1,
               "--max-seq-len", 64, "--max-new-tokens", 4, "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    plan = json.loads((tmp_path / "runs" / "cache_plans.json").read_text())["plans"][out["cache_auto"]["plan_key_id"]]
    assert out["cache_auto"]["resolved"] == plan["chosen"]["name"]
    assert out["cache_policy"] == plan["chosen"]["policy"]


def test_manifest_cache_autotune_then_cache_kind_auto_reuses_its_plan(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "runs"))
    manifest = tmp_path / "m.yaml"
    write_manifest(manifest, """\
      - id: tune
        mode: cache-autotune
        autotune: {budget_mb: 0.5, max_seq_len: 96, cache_plan_probe_interval_sec: 600}
      - id: gen
        mode: generate
        generate:
          prompts: ["hello", "world"]
          max_new_tokens: 4
          temperature: 0.0
          batch_size: 1
          max_seq_len: 96
          cache_kind: auto
          cache_budget_mb: 0.5
      - id: spec
        mode: speculative
        speculative:
          prompts: ["hello hello hello"]
          max_new_tokens: 4
          temperature: 0.0
          max_seq_len: 96
          cache_kind: auto
          cache_budget_mb: 0.5
""", model=tiny_model, name="auto")
    r = invoke("run", manifest)
    assert r.exit_code == 0, r.output
    records = tmp_path / "runs" / "auto" / "t"
    tune = json.loads((records / "tune" / "result.json").read_text())
    assert tune["mode"] == "cache-autotune" and tune["status"] == "measured"
    assert (records / "tune" / "candidates.csv").read_text().startswith("name,bytes,fits,")
    gen = json.loads((records / "gen" / "result.json").read_text())
    auto = gen["summary"]["cache_auto"]
    assert auto["plan_status"] == "reused" and auto["plan_key_id"] == tune["key_id"]
    assert auto["resolved"] == tune["chosen"]["name"] and gen["summary"]["cache_policy"] == tune["chosen"]["policy"]
    assert "cache_kind auto ->" in (records / "gen" / "log.txt").read_text()
    spec = json.loads((records / "spec" / "result.json").read_text())
    assert spec["summary"]["cache_auto"]["resolved"] == tune["chosen"]["name"]
    assert spec["summary"]["cache_auto"]["plan_status"] == "reused"


@pytest.mark.parametrize("generate, code, message", [
    ("{prompts: [hi], cache_kind: auto, cache_budget_mb: 0}", 2, "cache_budget_mb"),
    ("{prompts: [hi], cache_kind: q8_0, cache_budget_mb: .nan}", 2, "cache_budget_mb"),
    ("{prompts: [hi], cache_kind: auto, cache_budget_mb: 4, rotate_keys: true}", 2, "chooses rotate_keys itself"),
    ("{prompts: [hi], cache_kind: auto, cache_quality_max_mean_kl: -1}", 2, "cache_quality_max_mean_kl"),
    ("{prompts: [hi], cache_kind: auto, cache_auto_presses: [snap]}", 2, "cache_auto_presses"),
    ("{prompts: [hi], cache_kind: auto, cache_auto_presses: [knorm@0.5], press: tova}", 2, "cache_auto_presses"),
    ("{prompts: [hi], cache_kind: auto, cache_auto_presses: [knorm@0.5, snapkv@0/80:256]}", 0, "ok"),
    # As the seed guide writes them: auto with no budget picks among every candidate; a budget with a
    # named kind is a bound the built cache is checked against.
    ("{prompts: [hi], cache_kind: auto}", 0, "ok"),
    ("{prompts: [hi], cache_kind: q8_0, cache_budget_mb: 4}", 0, "ok"),
])
def test_auto_settings_are_validated(tmp_path, generate, code, message):
    manifest = tmp_path / "m.yaml"
    write_manifest(manifest, f"""\
      - id: g
        mode: generate
        generate: {generate}
""", name="v")
    r = invoke("validate", manifest)
    assert r.exit_code == code and message in r.output, r.output


def test_cache_autotune_section_is_required_and_checked(tmp_path):
    manifest = tmp_path / "m.yaml"
    write_manifest(manifest, """\
      - id: a
        mode: cache-autotune
        autotune: {budget_mb: 0, max_seq_len: 1}
""", name="v")
    r = invoke("validate", manifest)
    assert r.exit_code == 2 and "budget_mb" in r.output and "max_seq_len" in r.output


def test_autotune_reports_a_corrupt_plan_file_and_keeps_it(tiny_model, tmp_path):
    plans = tmp_path / "plans.json"
    plans.write_text('{"version": 1, "plans": []}')
    result = autotune_json(tiny_model, plans)
    aside = list(tmp_path.glob("plans.json.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_text() == '{"version": 1, "plans": []}'
    assert result["status"] == "measured" and list(json.loads(plans.read_text())["plans"]) == [result["key_id"]]


def test_autotune_presses_flag_adds_press_candidates(tiny_model, tmp_path):
    plans = tmp_path / "plans.json"
    result = autotune_json(tiny_model, plans, "--presses", "knorm@0.5,none")
    pressed = {c["name"]: c for c in result["candidates"] if c.get("press")}
    assert set(pressed) == {"fp32+knorm@0.5", "q8_0+knorm@0.5", "k=q8_0,v=q4_0 rotate_keys+knorm@0.5"}
    assert all(c["kept_bytes"] * 2 == c["bytes"] and c["gates"] is not None for c in pressed.values())
    assert result["key"]["candidates"][-3:] == list(pressed)
    bad = invoke("autotune", "--model", tiny_model, "--budget-mb", 1, "--plan-path", tmp_path / "other.json",
                 "--presses", "knorm")
    assert bad.exit_code == 2 and "--presses" in bad.output and "METHOD@RATIO" in bad.output
    assert "Traceback" not in bad.output and not (tmp_path / "other.json").exists()
    help_text = CliRunner().invoke(app, ["autotune", "--help"], env={"COLUMNS": "200"}).output
    assert "--presses" in help_text and "METHOD@RATIO/INTERVAL:TARGET" in help_text


def test_manifest_cache_autotune_with_presses(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "runs"))
    manifest = tmp_path / "m.yaml"
    write_manifest(manifest, """\
      - id: tune
        mode: cache-autotune
        autotune: {budget_mb: 1, max_seq_len: 64, presses: [knorm@0.5]}
""", model=tiny_model, name="autop")
    r = invoke("run", manifest)
    assert r.exit_code == 0, r.output
    records = tmp_path / "runs" / "autop" / "t" / "tune"
    tune = json.loads((records / "result.json").read_text())
    assert any(c.get("press") == "knorm@0.5" for c in tune["candidates"])
    csv = (records / "candidates.csv").read_text().splitlines()
    assert csv[0].endswith(",press,kept_bytes") and any(",knorm@0.5," in line for line in csv)
