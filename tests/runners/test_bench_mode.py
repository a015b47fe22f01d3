"""decode-bench mode, `caramba bench`, `caramba report` and `run --check` on a tiny model."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from caramba.cli import app
from caramba.expect import output_sha256, parse_bound
from conftest import write_manifest
from test_cli import write_tiny_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def runs(tmp_path, monkeypatch):
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "runs"))
    return tmp_path / "runs"


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def manifest(tmp_path, tiny_model, expect: str = "") -> str:
    path = tmp_path / "m.yaml"
    write_manifest(path, f"""\
      - id: grid
        mode: decode-bench
        bench:
          prompt_lens: [8, 16]
          batch_sizes: [1, 2]
          cache_kinds: [fp32, fp16]
          new_tokens: 4
          warmup: 0
          repeats: 2
      - id: greedy
        mode: generate
        generate:
          prompts: ["hello", "abc"]
          max_new_tokens: 5
          temperature: 0.0
{expect}""", model=tiny_model, name="benchy")
    return str(path)


def test_decode_bench_run_writes_cells_csv_and_plots(tmp_path, tiny_model, runs):
    r = invoke("run", manifest(tmp_path, tiny_model), "--run", "grid")
    assert r.exit_code == 0, r.output
    record = runs / "benchy" / "t" / "grid"
    result = json.loads((record / "result.json").read_text())
    cells = result["cells"]
    assert len(cells) == 8 and {c["cache_kind"] for c in cells} == {"fp32", "fp16"}
    by_kind = {(c["prompt_len"], c["batch_size"], c["cache_kind"]): c for c in cells}
    # fp16 stores half the bytes of fp32, for the same cell
    assert by_kind[(16, 2, "fp16")]["cache_bytes"] * 2 == by_kind[(16, 2, "fp32")]["cache_bytes"]
    assert all(c["decode_samples"] == 2 * 3 for c in cells)
    assert (record / "cells.csv").read_text().count("\n") == 9
    pytest.importorskip("matplotlib")
    assert {"decode_tok_s.png", "memory.png", "cache_bytes.png"} <= {p.name for p in record.iterdir()}


def test_bench_settings_reject_unknown_cache_kind(tmp_path, tiny_model, runs):
    path = manifest(tmp_path, tiny_model)
    r = invoke("run", path, "--set", "targets.t.runs.grid.bench.cache_kinds=[fp32, q9]")
    assert r.exit_code == 2 and "valid kinds" in r.output and "cache_kinds" in r.output


def test_section_must_match_mode(tmp_path, tiny_model, runs):
    path = manifest(tmp_path, tiny_model)
    r = invoke("run", path, "--set", "targets.t.runs.greedy.bench={repeats: 1}")
    assert r.exit_code == 2 and "'bench:' is the section of mode 'decode-bench'" in r.output


def test_bench_command_json_and_report(tiny_model, runs):
    args = ["bench", "--model", tiny_model, "--prompt-lens", "8,12", "--cache-kinds", "fp32",
            "--new-tokens", "3", "--warmup", "0", "--repeats", "1", "--json"]
    first = invoke(*args)
    assert first.exit_code == 0, first.output
    cells = json.loads(first.stdout)
    assert [c["prompt_len"] for c in cells] == [8, 12]
    records = sorted((runs / "bench" / "cli").iterdir())
    assert (records[-1] / "DONE").exists()
    copy = shutil.copytree(records[-1], runs / "copy-of-record")
    rep = invoke("report", records[-1], copy, "--json")
    rows = json.loads(rep.stdout)
    assert len(rows) == 4 and rows[2]["decode_tok_s_delta"] == 0.0
    table = invoke("report", records[-1])
    assert table.exit_code == 0 and "compared with" in table.output


def test_bench_command_bad_lists_exit_2(tiny_model, runs):
    r = invoke("bench", "--model", tiny_model, "--prompt-lens", "8,x")
    assert r.exit_code == 2 and "--prompt-lens" in r.output


def test_report_on_missing_record_exits_2(tmp_path):
    r = invoke("report", tmp_path)
    assert r.exit_code == 2 and "result.json" in r.output


def test_check_passes_then_reports_drift(tmp_path, tiny_model, runs):
    path = manifest(tmp_path, tiny_model)
    first = invoke("run", path, "--run", "greedy", "--check")
    assert first.exit_code == 0 and "no expect: block" in first.output
    result = json.loads((runs / "benchy" / "t" / "greedy" / "result.json").read_text())
    digest = output_sha256(result)
    assert digest in first.output

    good = f"""        expect:
          output_sha256: "{digest}"
          metrics: ["n_prompts == 2", "new_tokens >= 10"]
"""
    ok = invoke("run", manifest(tmp_path, tiny_model, good), "--run", "greedy", "--check", "--force")
    assert ok.exit_code == 0 and "check ok" in ok.output, ok.output

    bad = good.replace(digest, "0" * 64).replace("new_tokens >= 10", "new_tokens >= 11")
    drift = invoke("run", manifest(tmp_path, tiny_model, bad), "--run", "greedy", "--check")
    assert drift.exit_code == 1
    assert "generated ids changed" in drift.output and "new_tokens >= 11: got new_tokens = 10" in drift.output


def test_bad_bound_is_a_manifest_error(tmp_path, tiny_model, runs):
    bad = """        expect:
          metrics: ["acceptance_rate about 0.6"]
"""
    r = invoke("validate", manifest(tmp_path, tiny_model, bad))
    assert r.exit_code == 2 and "NAME OP NUMBER" in r.output and "m.yaml:" in r.output


def test_parse_bound():
    assert parse_bound("acceptance_rate >= 0.6") == ("acceptance_rate", ">=", 0.6)
    assert parse_bound("summary.x<1e-3") == ("summary.x", "<", 1e-3)
    with pytest.raises(ValueError):
        parse_bound(">= 3")
