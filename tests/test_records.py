"""Records a researcher can trust: a record matches the run it claims to be (run hash), a redo
never costs the finished record, files follow the umask, result.json says how it was made,
and a bad run is caught before anything is written (preflight)."""

from __future__ import annotations

import hashlib
import json
import os
import stat

import pytest
from test_cli import invoke, tiny_model  # noqa: F401  (fixture)

import caramba
import caramba.runners as runners
from caramba.expect import output_sha256
from caramba.runs import DONE, RunDir, run_hash

RUNS = """\
- id: a
  mode: generate
  seed: 0
  generate: {prompts: ["hello", "a longer prompt"], max_new_tokens: 6, temperature: 0.0, batch_size: 2}
- id: b
  mode: generate
  seed: 1
  generate: {prompts: ["hi"], max_new_tokens: 5, temperature: 0.0}
- id: c
  mode: generate
  generate: {prompts: ["bye"], max_new_tokens: 4, temperature: 0.0}
"""


@pytest.fixture
def setup(tmp_path, monkeypatch, tiny_model):  # noqa: F811
    from conftest import write_manifest

    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "runs"))
    manifest = write_manifest(tmp_path / "m.yaml", RUNS, model=str(tiny_model), name="rec")
    return manifest, tmp_path / "runs" / "rec" / "t"


def flat(output: str) -> str:
    """The console output with rich's line wrapping undone."""
    return " ".join(output.split())


def stamps(records, *ids):
    return {i: (records / i / DONE).read_text() for i in ids}


def result(records, run_id):
    return json.loads((records / run_id / "result.json").read_text())


# ---- identity --------------------------------------------------------------------------------

def test_unchanged_runs_are_skipped(setup):
    manifest, records = setup
    assert invoke("run", manifest).exit_code == 0
    before = stamps(records, "a", "b", "c")
    again = invoke("run", manifest)
    assert again.exit_code == 0 and again.output.count("skip t/") == 3
    assert stamps(records, "a", "b", "c") == before


def test_changed_setting_is_redone_and_said(setup):
    manifest, records = setup
    assert invoke("run", manifest).exit_code == 0
    before = stamps(records, "a", "b", "c")
    old_hash = result(records, "b")["run_hash"]
    # The case: a --force with an override, then a plain run: the record must follow the manifest.
    forced = invoke("run", manifest, "--run", "b", "--force", "--set", "targets.t.runs.b.generate.temperature=0.7")
    assert forced.exit_code == 0, forced.output
    assert result(records, "b")["run_hash"] != old_hash
    plain = invoke("run", manifest)
    assert plain.exit_code == 0, plain.output
    assert "t/b: settings changed since the record" in plain.output and "redoing" in plain.output
    assert result(records, "b")["run_hash"] == old_hash
    assert "temperature: 0.0" in (records / "b" / "manifest.yaml").read_text()
    # a and c were never touched: editing run b is not a change of theirs
    assert stamps(records, "a", "c") == {k: before[k] for k in ("a", "c")}


def test_unrelated_run_changed_keeps_the_others(setup):
    manifest, records = setup
    assert invoke("run", manifest).exit_code == 0
    before = stamps(records, "a", "b", "c")
    r = invoke("run", manifest, "--set", "targets.t.runs.c.generate.max_new_tokens=3")
    assert r.exit_code == 0, r.output
    assert "skip t/a" in r.output and "skip t/b" in r.output and "t/c: settings changed" in r.output
    assert stamps(records, "a", "b") == {k: before[k] for k in ("a", "b")}
    assert all(len(p["output_ids"]) == 3 for p in result(records, "c")["prompts"])


def test_expect_and_notes_are_not_part_of_the_identity(setup):
    manifest, records = setup
    assert invoke("run", manifest, "--run", "a").exit_code == 0
    before = stamps(records, "a")
    r = invoke("run", manifest, "--run", "a", "--set", "targets.t.runs.a.notes=checked by hand")
    assert r.exit_code == 0 and "skip t/a" in r.output
    assert stamps(records, "a") == before


def test_record_without_a_hash_is_redone(setup):
    manifest, records = setup
    assert invoke("run", manifest, "--run", "a").exit_code == 0
    env = json.loads((records / "a" / "env.json").read_text())
    del env["run_hash"]   # as an older caramba wrote it
    (records / "a" / "env.json").write_text(json.dumps(env))
    done = json.loads((records / "a" / DONE).read_text())   # an intact record, only without the hash
    done["files"]["env.json"] = hashlib.sha256((records / "a" / "env.json").read_bytes()).hexdigest()
    (records / "a" / DONE).write_text(json.dumps(done))
    r = invoke("run", manifest, "--run", "a")
    assert r.exit_code == 0 and "no run hash" in r.output and "redoing" in r.output
    assert "run_hash" in json.loads((records / "a" / "env.json").read_text())


def test_run_hash_covers_model_seed_settings_and_version(monkeypatch):
    from caramba.manifest.loader import parse_manifest

    def digest(text):
        return [run_hash(runners.run_identity(r)) for r in parse_manifest(text, "m.yaml").iter_runs()]

    base = ("version: 1\nname: m\ntargets:\n  - type: experiment\n    name: t\n    runs:\n"
            "      - {id: a, mode: generate, seed: 0, generate: {prompts: [x], temperature: 0.0}}\n"
            "      - {id: b, mode: generate, generate: {prompts: [y]}}\n")
    a, b = digest(base)
    assert digest(base.replace("seed: 0", "seed: 1"))[0] != a
    assert digest(base.replace("[x]", "[z]"))[0] != a
    assert digest(base.replace("name: m\n", "name: m\ndefaults: {model: {dtype: float16}}\n"))[0] != a
    assert digest(base.replace("[y]", "[w]")) == [a, digest(base.replace("[y]", "[w]"))[1]]   # b's edit: a unchanged
    monkeypatch.setattr(caramba, "__version__", "99.0")
    assert digest(base)[0] != a


# ---- a redo never costs the finished record ---------------------------------------------------

@pytest.mark.parametrize("how", ["interrupt", "crash"])
def test_failed_force_keeps_the_finished_record(setup, monkeypatch, how):
    manifest, records = setup
    assert invoke("run", manifest, "--run", "a").exit_code == 0
    files = {p.name: p.read_bytes() for p in (records / "a").iterdir()}
    real = runners.MODE_RUNNERS["generate"]

    def dies_midway(loaded, settings, seed, record, console):
        real(loaded, settings, seed, record, console)   # the work is done, the record not yet written
        record.write_json("result.json", {"partial": True})
        raise KeyboardInterrupt if how == "interrupt" else RuntimeError("simulated crash")

    monkeypatch.setitem(runners.MODE_RUNNERS, "generate", dies_midway)
    r = invoke("run", manifest, "--run", "a", "--force")
    assert r.exit_code == (130 if how == "interrupt" else 1)
    assert {p.name: p.read_bytes() for p in (records / "a").iterdir()} == files   # byte for byte
    assert f"the finished record {records / 'a'} is kept" in flat(r.output)
    monkeypatch.setitem(runners.MODE_RUNNERS, "generate", real)
    again = invoke("run", manifest, "--run", "a")
    assert again.exit_code == 0 and "skip t/a" in again.output   # still the valid record of this run
    redo = invoke("run", manifest, "--run", "a", "--force")
    assert redo.exit_code == 0
    assert sorted(p.name for p in records.iterdir()) == [".a.lock", "a"]   # the failed attempt is cleared


def test_swap_cut_in_half_is_completed_under_the_lock(tmp_path):
    run = RunDir("m", "t", "r", root=tmp_path)
    run.begin()
    run.write_json("result.json", {"v": 1})
    run.finish()
    run.release()
    os.rename(run.final, run.final.parent / ".r.old")   # the crash: old moved away, new not yet in
    again = RunDir("m", "t", "r", root=tmp_path)
    assert again.try_lock()
    assert again.is_done() and json.loads((again.final / "result.json").read_text()) == {"v": 1}


# ---- files follow the umask ---------------------------------------------------------------------

@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_record_files_follow_the_umask(setup, umask, mode):
    manifest, records = setup
    old = os.umask(umask)
    try:
        assert invoke("run", manifest, "--run", "a").exit_code == 0
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (records / "a").iterdir()}
    assert modes == dict.fromkeys(["manifest.yaml", "env.json", "result.json", "log.txt", "DONE"], mode)


# ---- result.json says how it was made ---------------------------------------------------------

def test_result_json_records_hash_command_overrides_and_versions(setup):
    manifest, records = setup
    r = invoke("run", manifest, "--run", "a", "--set", "targets.t.runs.a.generate.max_new_tokens=4")
    assert r.exit_code == 0, r.output
    res = result(records, "a")
    assert res["output_sha256"] == output_sha256(res) and len(res["output_sha256"]) == 64
    assert res["overrides"] == ["targets.t.runs.a.generate.max_new_tokens=4"]
    assert res["command"] == f"caramba run {manifest} --run a --set targets.t.runs.a.generate.max_new_tokens=4"
    env = json.loads((records / "a" / "env.json").read_text())
    assert res["run_hash"] == env["run_hash"]
    assert (env["command"], env["overrides"], env["libraries"]) == (res["command"], res["overrides"], res["versions"])
    versions = res["versions"]
    assert versions["caramba"] == caramba.__version__
    assert {"torch", "transformers", "tokenizers", "gguf", "numpy"} <= versions.keys()
    import tokenizers
    assert versions["tokenizers"] == tokenizers.__version__


def test_check_uses_the_recorded_output_sha256(setup):
    manifest, records = setup
    assert invoke("run", manifest, "--run", "a").exit_code == 0
    digest = result(records, "a")["output_sha256"]
    expect = f"targets.t.runs.a.expect={{output_sha256: {digest}}}"
    r = invoke("run", manifest, "--run", "a", "--check", "--set", expect)
    assert r.exit_code == 0 and "check ok t/a" in r.output and "skip t/a" in r.output   # expect: not identity


# ---- preflight: nothing is written when any run cannot succeed --------------------------------

def test_prompt_past_max_seq_len_in_run_2_of_3_exits_2_and_writes_nothing(setup, tmp_path):
    manifest, _ = setup
    # "hi" is 2 byte tokens: 2 + 40 - 1 = 41 cache positions > 32
    r = invoke("run", manifest, "--set", "targets.t.runs.b.generate.max_new_tokens=40",
               "--set", "targets.t.runs.b.generate.max_seq_len=32")
    assert r.exit_code == 2, r.output
    assert "run t/b" in r.output and "generate.max_new_tokens=40" in r.output and "max_seq_len=32" in r.output
    assert "Traceback" not in r.output
    assert not (tmp_path / "runs").exists()


def test_prompt_that_just_fits_passes_preflight(setup):
    manifest, records = setup
    # 2 prompt tokens + 31 new - 1 (the last token is never cached) = 32 positions: fits exactly
    r = invoke("run", manifest, "--run", "b", "--set", "targets.t.runs.b.generate.max_new_tokens=31",
               "--set", "targets.t.runs.b.generate.max_seq_len=32")
    assert r.exit_code == 0, r.output
    assert len(result(records, "b")["prompts"][0]["output_ids"]) <= 31


def test_too_long_run_id_exits_2_and_writes_nothing(setup, tmp_path):
    manifest, _ = setup
    manifest.write_text(manifest.read_text().replace("- id: c", f"- id: {'c' * 300}"))
    r = invoke("run", manifest)
    assert r.exit_code == 2 and "too long" in r.output and "id" in r.output, r.output
    assert not (tmp_path / "runs").exists()


def test_missing_bench_text_exits_2_and_writes_nothing(setup, tmp_path, tiny_model):  # noqa: F811
    from conftest import write_manifest

    manifest, _ = setup
    write_manifest(manifest, RUNS + "- {id: d, mode: decode-bench, bench: {text: /nonexistent.txt}}\n",
                   model=str(tiny_model), name="rec")
    r = invoke("run", manifest)
    assert r.exit_code == 2 and "run t/d" in r.output and "bench.text" in r.output, r.output
    assert not (tmp_path / "runs").exists()


# ---- locks and unique names -------------------------------------------------------------------

def test_a_locked_run_is_left_to_its_holder(setup):
    manifest, records = setup
    holder = RunDir("rec", "t", "b")
    assert holder.try_lock()   # stands in for another caramba run (flock: per open file, so this works in-process)
    try:
        r = invoke("run", manifest)
        assert r.exit_code == 0, r.output
        assert f"skip t/b: another process (pid {os.getpid()})" in r.output
        assert "1 left to another process" in r.output
        assert (records / "a" / DONE).exists() and not (records / "b").exists()
    finally:
        holder.release()
    assert invoke("run", manifest).exit_code == 0 and (records / "b" / DONE).exists()


def test_unique_names_never_collide(tmp_path):
    first = RunDir.unique("bench", "cli", "20260101T000000Z", root=tmp_path)
    second = RunDir.unique("bench", "cli", "20260101T000000Z", root=tmp_path)
    assert first.final.name == "20260101T000000Z" and second.final.name == "20260101T000000Z-2"
    for record in (first, second):
        record.begin()
        record.write_json("result.json", {})
        record.finish()
        record.release()
    third = RunDir.unique("bench", "cli", "20260101T000000Z", root=tmp_path)
    assert third.final.name == "20260101T000000Z-3"


def test_bench_commands_in_the_same_second_write_two_records(tiny_model, tmp_path, monkeypatch):  # noqa: F811
    import time

    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setattr(time, "strftime", lambda fmt, t=None: "20260101T000000Z")   # the same second, twice
    args = ["bench", "--model", tiny_model, "--prompt-lens", "8", "--new-tokens", "2", "--warmup", "0",
            "--repeats", "1", "--json"]
    assert invoke(*args).exit_code == 0 and invoke(*args).exit_code == 0
    names = sorted(p.name for p in (tmp_path / "runs" / "bench" / "cli").iterdir() if not p.name.startswith("."))
    assert names == ["20260101T000000Z", "20260101T000000Z-2"]
    assert all((tmp_path / "runs" / "bench" / "cli" / n / DONE).exists() for n in names)


def test_dry_run_says_what_would_happen(setup):
    manifest, _ = setup
    assert invoke("run", manifest, "--run", "a", "--run", "b").exit_code == 0
    r = invoke("run", manifest, "--dry-run", "--set", "targets.t.runs.b.seed=7")
    assert r.exit_code == 0, r.output
    out = flat(r.output)
    assert "would skip t/a" in out and "would redo (settings changed since the record) t/b" in out
    assert "would run t/c" in out


def test_draft_with_another_vocabulary_fails_preflight(tiny_model, tmp_path, monkeypatch):  # noqa: F811
    import importlib
    import shutil
    import types

    from caramba.errors import UserError
    from caramba.manifest.loader import parse_manifest

    pf = importlib.import_module("caramba.runners.preflight")   # the package re-exports the function
    draft = shutil.copytree(tiny_model, tmp_path / "draft")
    text = (f"version: 1\nname: m\ndefaults: {{model: {{source: '{tiny_model}'}}}}\ntargets:\n"
            "  - type: experiment\n    name: t\n    runs:\n"
            f"      - {{id: s, mode: speculative, draft: {{source: '{draft}'}}, speculative: {{prompts: [hi], draft: model}}}}\n")
    runs = list(parse_manifest(text).iter_runs())
    real = pf._Sources.tokenizer
    other = types.SimpleNamespace(vocab_size=100)   # a draft whose tokenizer is not the target's
    monkeypatch.setattr(pf._Sources, "tokenizer", lambda self, source: other if source == str(draft) else real(self, source))
    largest = pf._Sources.largest_id   # its ids fit the draft's own embedding rows: only the vocabularies differ
    monkeypatch.setattr(pf._Sources, "largest_id", lambda self, source: 99 if source == str(draft) else largest(self, source))
    with pytest.raises(UserError, match=r"run t/s: draft.source .* vocabulary of 100 tokens, the model 259"):
        pf.preflight("m", runs)
