"""Hostile and absurd input: one clear error (exit 2), bounded in time and memory, nothing written.

One test (or a parametrized family) per class of input from issue 13: YAML alias bombs, recursive
aliases and deep nesting, control characters, non-finite floats and huge seeds, bad model sources
(FIFOs included, under a timeout), chat templates that include, divide by zero or loop forever,
text that looks like rich markup, JSON output with NaN, and the plan store's confinement."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import pytest
from test_cli import write_tiny_model
from typer.testing import CliRunner

from caramba import chat_template
from caramba.autotune.plans import PlanStore, default_plan_path
from caramba.cli import app, json_text
from caramba.errors import UserError
from caramba.manifest import load_manifest, parse_manifest
from caramba.model.zoo import inspect_source, load_model, resolve_source
from caramba.tokenizer import Tokenizer

MANIFEST = """\
version: 1
name: m
targets:
  - type: experiment
    name: t
    runs:
      - id: r
        mode: generate
        seed: 0
        generate:
          prompts: ["hello"]
          max_new_tokens: 4
          temperature: 0.0
"""


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def within(seconds: float, function, *args):
    """function(*args) in a daemon thread: fails the test instead of hanging it (a FIFO would block)."""
    outcome: dict = {}

    def target():
        try:
            outcome["value"] = function(*args)
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            outcome["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{function.__name__} still running after {seconds} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def files_under(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()] if path.exists() else []


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def runs_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "runs"))
    return tmp_path / "runs"


# ---- YAML -----------------------------------------------------------------------------------

def _bomb(levels: int = 9) -> str:
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def test_alias_bomb_is_refused_in_bounded_time_and_memory():
    text = _bomb()   # 9 ** 9 = 387M strings once expanded, from under 600 bytes
    assert len(text) < 600
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(UserError, match=r"m.yaml:\d+: this value expands to more than 100,000 values"):
            parse_manifest(text, "m.yaml")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - started < 5
    assert peak < 20 * 2**20


def test_alias_bomb_in_a_set_value_is_refused(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text(MANIFEST)
    value = "[" + ",".join(["&a0 [1,1,1,1,1,1,1,1,1]"] + [f"&a{i} [" + ",".join([f"*a{i-1}"] * 9) + "]" for i in range(1, 9)]) + "]"
    with pytest.raises(UserError, match="expands to more than"):
        load_manifest(path, [f"targets.t.runs.r.notes={value}"])


@pytest.mark.parametrize("text, message", [
    ("a: &a [*a]\n", "recursive alias"),
    ("a: &a {b: *a}\n", "recursive alias"),
    ("a: &x {<<: *x}\n", "recursive alias"),
    ("[" * 5000 + "]" * 5000, "nests too deeply"),
    ("a: " + "[" * 100 + "]" * 100 + "\n", "nests more than 64 levels"),
])
def test_recursive_aliases_and_deep_nesting_are_one_error(text, message):
    with pytest.raises(UserError, match=message):
        parse_manifest(text, "m.yaml")


@pytest.mark.parametrize("char", ["\x00", "\x07", "\x1b", "\ufffe"])
def test_control_characters_name_the_line_and_character(char):
    text = MANIFEST.replace('prompts: ["hello"]', f'prompts: ["hel{char}lo"]')
    with pytest.raises(UserError) as caught:
        parse_manifest(text, "m.yaml")
    assert str(caught.value).startswith(f"m.yaml:11: character U+{ord(char):04X} is not allowed")


def test_manifest_paths_that_are_not_regular_files(tmp_path):
    fifo = tmp_path / "m.yaml"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/zero"), tmp_path):
        with pytest.raises(UserError, match="not a regular file|is a directory"):
            within(10, load_manifest, path)
    big = tmp_path / "big.yaml"
    big.write_bytes(b"# " + b"x" * (9 << 20))
    with pytest.raises(UserError, match="more than 8 MiB"):
        load_manifest(big)
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"version: 1\nname: caf\xe9\n")
    with pytest.raises(UserError, match="latin.yaml:2: the manifest is not UTF-8"):
        load_manifest(latin)


@pytest.mark.parametrize("old, new, field", [
    ("temperature: 0.0", "temperature: .nan", "temperature: Input should be a finite number"),
    ("temperature: 0.0", "temperature: .inf", "temperature: Input should be a finite number"),
    ("temperature: 0.0", "temperature: -.inf", "temperature"),
    ("seed: 0", "seed: 1180591620717411303424", "seed: Input should be less than or equal to 18446744073709551615"),
])
def test_non_finite_floats_and_huge_seeds_fail_validation(old, new, field):
    with pytest.raises(UserError, match=f"m.yaml:\\d+: targets\\[0\\].runs\\[0\\].(generate.)?{field}"):
        parse_manifest(MANIFEST.replace(old, new), "m.yaml")


def test_a_seed_at_torchs_limit_is_accepted():
    parse_manifest(MANIFEST.replace("seed: 0", f"seed: {2**64 - 1}"), "m.yaml")


# ---- model sources --------------------------------------------------------------------------

BASE = dict(model_type="llama", vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
            intermediate_size=64)


def _model_dir(tmp_path: Path, name: str, config=None, raw: str | None = None, fifo: bool = False) -> str:
    path = tmp_path / name
    path.mkdir()
    if fifo:
        os.mkfifo(path / "config.json")
    elif raw is not None:
        (path / "config.json").write_text(raw)
    elif config is not None:
        (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").write_bytes(b"\0" * 8)
    return str(path)


@pytest.mark.parametrize("name, kwargs, message", [
    ("nocfg", {}, "directory without config.json"),
    ("list", {"raw": "[1, 2]"}, "config.json: must hold a JSON object .* not a list"),
    ("notjson", {"raw": "{oops"}, "config.json is not valid JSON"),
    ("zeroheads", {"config": {**BASE, "num_attention_heads": 0}}, "config.json: num_attention_heads=0 must be a positive integer"),
    ("negative", {"config": {**BASE, "hidden_size": -5}}, "config.json: hidden_size=-5 must be a positive integer"),
    ("string", {"config": {**BASE, "hidden_size": "32"}}, "config.json: hidden_size='32' must be a positive integer, not str"),
    ("absurd", {"config": {**BASE, "vocab_size": 10**12}}, "config.json: vocab_size=1000000000000 is absurdly large"),
    ("theta", {"config": {**BASE, "rope_theta": "x"}}, "config.json: rope_theta='x' must be a number"),
    ("fifo", {"fifo": True}, "config.json is not a regular file"),
])
def test_bad_model_directories_name_the_file_and_field(tmp_path, name, kwargs, message):
    source = _model_dir(tmp_path, name, **kwargs)
    for check in (inspect_source, lambda s: load_model(s, progress=False)):
        with pytest.raises(UserError, match=message):
            within(20, check, source)


def test_model_sources_that_are_not_files_or_directories(tmp_path):
    fifo = tmp_path / "m.gguf"
    os.mkfifo(fifo)
    for source, message in ((str(fifo), "not a regular file or directory"), ("/dev/zero", "not a regular file or directory"),
                            ("", "is empty"), ("   ", "is empty")):
        with pytest.raises(UserError, match=message):
            within(10, resolve_source, source)


def test_weights_that_do_not_match_the_config_are_a_user_error(tiny_model, tmp_path):
    import shutil

    copy = tmp_path / "model"
    shutil.copytree(tiny_model, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(UserError, match="weights do not match the config: wrong shape"):
        load_model(str(copy), progress=False)


def test_a_bad_model_source_is_reported_once_and_writes_nothing(tmp_path, runs_dir):
    source = _model_dir(tmp_path, "zero", {**BASE, "num_attention_heads": 0})
    manifest = tmp_path / "m.yaml"
    manifest.write_text(MANIFEST.replace("targets:", f"defaults:\n  model: {{source: {source!r}}}\ntargets:")
                        + "      - id: r2\n        mode: generate\n        generate: {prompts: [hi]}\n")
    r = invoke("run", manifest)
    assert r.exit_code == 2, r.output
    assert r.output.count("num_attention_heads=0") == 1 and "Traceback" not in r.output
    assert files_under(runs_dir) == []


# ---- chat templates -------------------------------------------------------------------------

def _render(template: str):
    tok = Tokenizer.__new__(Tokenizer)   # only what apply_chat_template reads
    tok.chat_template, tok._template, tok.source = template, None, "model.gguf"
    tok.bos_token_id = tok.eos_token_id = tok._pad_token_id = tok.unk_token_id = None
    return tok.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("template, message", [
    ("{% include 'other.jinja' %}", "must be self-contained"),
    ("{% import 'x' as y %}{{ y }}", "must be self-contained"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{{ 'a' * 10**9 }}", "a sequence of 1 x 1000000000"),
    ("{{ 2 ** 99999999 }}", "an exponent"),
    ("{{ 'x' | center(10**9) }}", "an argument of 1000000000"),
    ("{{ '%999999999d' % 1 }}", "a format width"),
    ("{% set s = 'a' * 1000000 %}{{ s | replace('a', s) }}", "replace"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
    ("{% for i in range(100000) %}{{ 'abcdefghij' * 100 }}{% endfor %}", "output past"),
    # The deadline rides on sys.settrace, which a debugger or coverage already holds.
    pytest.param("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                 "rendering took over", marks=pytest.mark.skipif(sys.gettrace() is not None, reason="a tracer is active")),
    ("{{ raise_exception('no system role') }}", "rejected the messages: no system role"),
])
def test_chat_templates_are_bounded(template, message, monkeypatch):
    monkeypatch.setattr(chat_template, "TEMPLATE_SECONDS", 0.5)
    started = time.perf_counter()
    with pytest.raises(UserError, match=f"chat template of model.gguf .*{message}"):
        within(30, _render, template)
    assert time.perf_counter() - started < 10


def test_a_normal_template_still_renders():
    assert _render("{% for m in messages %}<{{ m.role }}>{{ m.content | tojson }}{% endfor %}") == '<user>"hi"'


# ---- text is not markup ---------------------------------------------------------------------

@pytest.mark.parametrize("text", ["[/INST]", "[/x]", "[bold]hi", "[red]x[/red]", "a\\"])
def test_user_text_is_printed_verbatim(tmp_path, monkeypatch, text):
    # In an error (a --set path), in a path that is printed, in a plan store's contents. Wide enough
    # that no table cell wraps the text, whatever $COLUMNS the machine running the tests has.
    import caramba.cli

    monkeypatch.setattr(caramba.cli.out, "width", 400)
    r = invoke("validate", tmp_path / "m.yaml", "--set", f"targets.{text}=1")
    assert r.exit_code == 2 and "MarkupError" not in r.output and "Traceback" not in r.output
    name = text.replace("/", "_").replace("\\", "_")
    path = tmp_path / f"{name}.yaml"
    path.write_text(MANIFEST)
    r = invoke("validate", path, "--set", f"targets.t.runs.{text}.seed=1")
    assert r.exit_code == 2 and f"no item with id {text!r}" in r.output.replace("\n", "")
    r = invoke("validate", path)
    assert r.exit_code == 0 and str(path) in r.output.replace("\n", "")
    store = tmp_path / "plans.json"
    store.write_text(json.dumps({"version": 1, "plans": {"abc": {
        "key": {"model_sha256": text, "dtype": text, "device": "cpu", "device_name": text, "max_seq_len": 8,
                "batch_size": 1, "budget_mb": 1.0}, "chosen": {"name": text}, "candidates": [], "created_utc": text}}}))
    r = invoke("plans", "list", "--plan-path", store)
    assert r.exit_code == 0 and r.output.count(text) >= 3, r.output


# ---- JSON output ----------------------------------------------------------------------------

def _strict_json(text: str):
    def refuse(constant):
        raise AssertionError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_json_output_has_no_nan_or_infinity(tmp_path):
    assert _strict_json(json_text({"score": float("nan"), "x": [float("-inf"), 1.5], "ok": 1})) == \
        {"score": None, "x": [None, 1.5], "ok": 1}
    store = tmp_path / "plans.json"
    store.write_text('{"version": 1, "plans": {"abc": {"key": {"budget_mb": Infinity}, "chosen": {"name": "q8_0"}, '
                     '"candidates": [{"gates": {"dnll": NaN}}], "created_utc": "now", "created_unix": NaN}}}')
    for command in (["plans", "list", "--json"], ["plans", "show", "abc"]):
        r = invoke(*command, "--plan-path", store)
        assert r.exit_code == 0, r.output
        assert "q8_0" in r.stdout and _strict_json(r.stdout)


# ---- the plan store stays where it belongs --------------------------------------------------

def test_listing_any_file_as_a_plan_store_changes_nothing(tmp_path):
    victim = tmp_path / "notes.txt"
    victim.write_text("my notes\n")
    for command in (["plans", "list"], ["plans", "show", "x"], ["plans", "clear"]):
        r = invoke(*command, "--plan-path", victim)
        assert r.exit_code in (0, 2) and "Traceback" not in r.output, r.output
    assert victim.read_text() == "my notes\n" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("kind", ["text", "binary", "json-list", "directory", "fifo"])
def test_writing_never_moves_a_file_that_is_not_a_plan_store(tmp_path, runs_dir, kind):
    path = tmp_path / "elsewhere" / "settings.json"
    path.parent.mkdir()
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.write_bytes({"text": b"keep me", "binary": bytes(range(256)), "json-list": b"[1, 2]"}[kind])
    before = sorted(p.name for p in path.parent.iterdir())
    store = PlanStore(path)
    assert within(10, store.all) == {}
    with pytest.raises(UserError, match="is not a plan store.*will not overwrite it"):
        within(10, store.put, {"k": 1}, {"chosen": {"name": "q8_0"}, "candidates": []})
    assert not list(path.parent.glob("*.corrupt-*"))
    assert path.exists() and before == sorted(p.name for p in path.parent.iterdir())   # no lock left either


@pytest.mark.parametrize("content", [bytes(range(256)), b"[]", b'{"version": 1, "plans": []}', b"{oops"])
def test_a_damaged_store_under_runs_is_set_aside(runs_dir, content):
    path = default_plan_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    notices: list[str] = []
    store = PlanStore(notice=notices.append)
    assert store.all() == {} and len(notices) == 1 and path.read_bytes() == content   # reading moves nothing
    store.put({"k": 1}, {"chosen": {"name": "q8_0"}, "candidates": []})
    [aside] = path.parent.glob(f"{path.name}.corrupt-*")
    assert aside.read_bytes() == content and list(store.all()) != []


def test_no_manifest_name_collides_with_the_default_store(runs_dir):
    name = default_plan_path().name
    assert name == "cache_plans.json"   # the product's documented place: runs/cache_plans.json
    for taken in (name, f"{name}.lock"):
        with pytest.raises(UserError, match="cache plan store's file name"):
            parse_manifest(MANIFEST.replace("name: m", f"name: {taken}"), "m.yaml")


def test_a_manifest_plan_path_outside_runs_is_refused_before_anything_is_written(tmp_path, runs_dir, tiny_model):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    manifest = tmp_path / "m.yaml"
    manifest.write_text(f"""\
version: 1
name: m
defaults:
  model: {{source: "{tiny_model}"}}
targets:
  - type: experiment
    name: t
    runs:
      - id: tune
        mode: cache-autotune
        autotune: {{budget_mb: 1, max_seq_len: 64, plan_path: "{victim}"}}
""")
    for command in (["validate", manifest], ["run", manifest], ["run", manifest, "--dry-run"]):
        r = invoke(*command)
        assert r.exit_code == 2 and "autotune.plan_path" in r.output and "outside the runs" in r.output, r.output
    assert victim.read_text() == "keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["m.yaml", "victim.txt"]
    inside = str(runs_dir / "plans" / "p.json")
    assert parse_manifest(manifest.read_text().replace(str(victim), inside), "m.yaml")


def test_clearing_an_empty_plan_id_is_refused(tmp_path):
    store = PlanStore(tmp_path / "plans.json")
    store.put({"k": 1}, {"chosen": {"name": "a"}, "candidates": []})
    for ids in ([""], ["  "], ["", "zzz"]):
        r = invoke("plans", "clear", *ids, "--plan-path", tmp_path / "plans.json")
        assert r.exit_code == 2 and "empty plan id" in r.output
        with pytest.raises(ValueError, match="empty plan id"):
            store.remove(ids)
    assert len(store.all()) == 1


@pytest.mark.parametrize("content", [b"\xff\xfe", b"[1]", b'{"cells": 3}', b'{"cells": [1]}',
                                     b'{"summary": {"decode_tok_s": "fast", "ttft_s": NaN}}'])
def test_report_answers_any_result_file(tmp_path, content):
    run = tmp_path / "[bold]run"
    run.mkdir()
    (run / "result.json").write_bytes(content)
    for extra in ([], ["--json"]):
        r = invoke("report", run, run, *extra)
        assert r.exit_code in (0, 2) and "Traceback" not in r.output, r.output
        if r.exit_code == 2:
            assert "result.json" in r.output
        elif extra:
            _strict_json(r.stdout)
