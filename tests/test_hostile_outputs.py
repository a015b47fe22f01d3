"""Issue 46: results that never lie and records nothing can overwrite. Per class of hostile input a
test that builds the state for real: outputs aimed at records (report --csv/--plot, the step
summary, --junit-xml, convert-dba --out), non-finite logits and metrics, settings that would
silently do nothing, and input files that would fail late."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import write_manifest
from test_cli import write_tiny_model
from typer.testing import CliRunner

from caramba.cli import app
from caramba.runs import record_status


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def flat(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def runs_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "runs"))
    return tmp_path / "runs"


GENERATE = """\
- id: r
  mode: generate
  seed: 0
  generate: {prompts: ["hello"], max_new_tokens: 3, temperature: 0.0, stream: false}
"""


@pytest.fixture
def recorded(tmp_path, runs_dir, tiny_model) -> tuple[Path, Path]:
    """A manifest and its finished record (runs/m/t/r)."""
    manifest = write_manifest(tmp_path / "m.yaml", GENERATE, model=str(tiny_model))
    done = invoke("run", manifest)
    assert done.exit_code == 0, done.output
    record = runs_dir / "m" / "t" / "r"
    assert record_status(record).state == "done"
    return manifest, record


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


# ---- 1. outputs that land on records --------------------------------------------------------------

@pytest.mark.parametrize("how", ["--csv", "--plot", "summary", "--junit-xml", "link", "manifest"])
def test_no_output_lands_on_a_record(recorded, tmp_path, monkeypatch, how):
    manifest, record = recorded
    before, manifest_text = _snapshot(record.parent.parent.parent), manifest.read_bytes()
    target, option = record / "result.json", how
    if how == "--csv":
        r = invoke("report", manifest, "--csv", target)
    elif how == "--plot":
        r = invoke("report", manifest, "--plot", record / "log.txt", "--x", "seed")
        target = record / "log.txt"
    elif how == "summary":
        monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(target))
        r, option = invoke("report", manifest, "--format", "markdown"), "$GITHUB_STEP_SUMMARY"
    elif how == "--junit-xml":
        r = invoke("run", manifest, "--junit-xml", target)
    elif how == "link":   # a path outside that reaches the record through a link
        (tmp_path / "elsewhere").symlink_to(record)
        target, option = tmp_path / "elsewhere" / "result.json", "--csv"
        r = invoke("report", manifest, "--csv", target)
    else:   # the manifest itself is an input, never an output
        target, option = manifest, "--junit-xml"
        r = invoke("run", manifest, "--junit-xml", manifest)
    assert r.exit_code == 2 and option in r.output and str(target) in flat(r.output), r.output
    assert "Traceback" not in r.output
    assert _snapshot(record.parent.parent.parent) == before and manifest.read_bytes() == manifest_text
    assert record_status(record).state == "done"


def test_report_of_records_outside_the_runs_directory_keeps_them_too(recorded, tmp_path, monkeypatch):
    manifest, record = recorded
    moved = tmp_path / "archive"
    record.parent.parent.rename(moved)   # runs/m -> archive: records no longer under the runs root
    before = _snapshot(moved)
    r = invoke("report", moved, "--csv", moved / "t" / "r" / "result.json")
    assert r.exit_code == 2 and "--csv" in r.output and "input" in r.output, r.output
    assert _snapshot(moved) == before
    fine = invoke("report", moved, "--csv", tmp_path / "rows.csv")   # beside them is fine
    assert fine.exit_code == 0 and (tmp_path / "rows.csv").is_file(), fine.output


def test_convert_dba_never_replaces_a_record(recorded, tiny_model):
    manifest, record = recorded
    before = _snapshot(record)
    r = invoke("convert-dba", "--model", tiny_model, "--out", record, "--sem-dim", 2, "--geo-dim", 4, "--force",
               "--calib-tokens", 0)
    assert r.exit_code == 2 and "--out" in r.output and "runs directory" in flat(r.output), r.output
    assert _snapshot(record) == before and record_status(record).state == "done"


# ---- 2. NaN that passes a check ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def overflowing(tmp_path_factory) -> Path:
    """The tiny model with a final norm so large that its logits overflow to inf (NaN after the
    softmax), as a float16 model's do: the state a real overflow leaves."""
    from safetensors.torch import load_file, save_file

    d = write_tiny_model(tmp_path_factory.mktemp("overflow") / "model")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 4096}))
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 1e38
    save_file(tensors, str(d / "model.safetensors"))
    return d


def test_non_finite_logits_fail_the_perplexity_scores_by_name(overflowing, runs_dir):
    r = invoke("eval", "--model", overflowing, "--max-tokens", 48, "--prompt-len", 16, "--json")
    assert r.exit_code == 1 and "NaN or inf" in flat(r.output), r.output
    assert '"top1_agreement": 1.0' not in r.output


def test_non_finite_logits_fail_the_task_answers_by_name(overflowing, runs_dir):
    r = invoke("eval", "--model", overflowing, "--tasks", "niah_single", "--lengths", 768, "--samples", 1,
               "--no-perplexity", "--json")
    assert r.exit_code == 1 and "NaN or inf" in flat(r.output) and "niah_single" in r.output, r.output


def test_an_expect_bound_on_a_nan_metric_fails_the_check(tmp_path, runs_dir, overflowing):
    manifest = write_manifest(tmp_path / "e.yaml", """\
- id: e
  mode: eval
  eval:
    candidates: [{cache_kind: q8_0, name: q8}]
    perplexity: {max_tokens: 48, prompt_len: 16}
  expect: {metrics: ["q8.top1_agreement >= 0.99", "q8.kl_max <= 0.01"]}
""", model=str(overflowing))
    r = invoke("run", manifest, "--check")
    assert r.exit_code == 1 and "NaN or inf" in flat(r.output), r.output
    assert not (runs_dir / "m" / "t" / "e" / "DONE").exists()


# ---- 3. settings that silently do nothing ------------------------------------------------------------

def _needing() -> list[tuple[str, str, object]]:
    """Every option that acts only with another (OptionInfo.needs), with a value away from its default."""
    from caramba.options import options_of
    from caramba.press import PressConfig

    out = []
    for o in options_of(PressConfig):
        if o.info.needs is None:
            continue
        d = o.default()
        value = True if isinstance(d, bool) else d + 2 if isinstance(d, int) else d / 2
        out.append((o.name, o.info.needs, value))
    return out


def test_the_table_covers_every_press_setting():
    names = {name for name, _, _ in _needing()}
    assert {"press_ratio", "press_window", "press_kernel", "press_sinks", "press_future", "press_beta",
            "press_adaptive", "press_safeguard", "press_target"} <= names


@pytest.mark.parametrize("name, needed, value", _needing())
def test_a_setting_without_the_one_it_needs_is_refused(tmp_path, runs_dir, tiny_model, name, needed, value):
    manifest = write_manifest(tmp_path / "m.yaml", f"""\
- id: r
  mode: generate
  generate: {{prompts: ["hello"], max_new_tokens: 3, temperature: 0.0, {name}: {json.dumps(value)}}}
""", model=str(tiny_model))
    r = invoke("validate", manifest)
    assert r.exit_code == 2 and name in r.output and f"without {needed}" in flat(r.output), r.output
    flag = "--" + name.replace("_", "-")
    cli = invoke("generate", "hi", "--model", tiny_model, "--max-new-tokens", 2,
                 *([flag] if value is True else [flag, value]))
    assert cli.exit_code == 2 and name in cli.output and "Traceback" not in cli.output, cli.output
    assert not runs_dir.exists()


def test_a_press_setting_of_an_eval_candidate_without_a_press_is_refused(tmp_path, runs_dir, tiny_model):
    manifest = write_manifest(tmp_path / "m.yaml", """\
- id: e
  mode: eval
  eval:
    candidates: [{cache_kind: q8_0, press_ratio: 0.25}]
    tasks: {names: [niah_single], lengths: [128], samples: 1}
""", model=str(tiny_model))
    r = invoke("validate", manifest)
    assert r.exit_code == 2 and "press_ratio" in r.output and "without press" in flat(r.output), r.output


def test_a_sweep_over_a_press_setting_without_a_press_is_refused(tmp_path, runs_dir, tiny_model):
    manifest = write_manifest(tmp_path / "m.yaml", """\
- id: s
  mode: generate
  generate: {prompts: ["hello"], max_new_tokens: 3, temperature: 0.0}
  matrix: {generate.press_ratio: [0.1, 0.5]}
""", model=str(tiny_model))
    r = invoke("run", manifest)
    assert r.exit_code == 2 and "press_ratio" in r.output, r.output
    assert not runs_dir.exists()


def test_system_prompt_without_chat_is_still_refused(tmp_path, tiny_model):
    manifest = write_manifest(tmp_path / "m.yaml", """\
- id: r
  mode: generate
  generate: {prompts: ["hello"], max_new_tokens: 3, system_prompt: "be brief"}
""", model=str(tiny_model))
    r = invoke("validate", manifest)
    assert r.exit_code == 2 and "system_prompt" in r.output and "without chat" in flat(r.output), r.output


def test_the_pivot_label_keeps_a_decimal_value_whole(tmp_path, runs_dir, tiny_model):
    manifest = write_manifest(tmp_path / "m.yaml", """\
- id: s
  mode: generate
  generate: {prompts: ["hello there, a prompt"], max_new_tokens: 3, temperature: 0.0, stream: false, press: knorm}
  matrix: {generate.press_ratio: [0.1, 0.25], seed: [0, 1]}
""", model=str(tiny_model))
    assert invoke("run", manifest).exit_code == 0
    rows = json.loads(invoke("report", manifest, "--json", "--pivot", "generate.press_ratio",
                             "--metric", "new_tokens").stdout)
    assert [r["runs"] for r in rows] == ["t/s", "t/s"], rows
    by_seed = json.loads(invoke("report", manifest, "--json", "--pivot", "seed", "--metric", "new_tokens").stdout)
    assert sorted(r["runs"] for r in by_seed) == ["t/s.press_ratio-0.1", "t/s.press_ratio-0.25"], by_seed



# ---- 4. failures that come late ------------------------------------------------------------------------

def _nothing_under(runs_dir: Path) -> None:
    left = list(runs_dir.rglob("*")) if runs_dir.exists() else []
    assert left == [], left


def _two_runs(tmp_path: Path, model: Path, body: str) -> Path:
    """A good run first, then `body`: the bad one must stop the manifest before the good one is recorded."""
    import textwrap

    good = '- id: good\n  mode: generate\n  generate: {prompts: ["hi"], max_new_tokens: 2, temperature: 0.0}\n'
    return write_manifest(tmp_path / "m.yaml", good + textwrap.dedent(body), model=str(model))


def test_a_truncated_weights_file_fails_in_preflight(tmp_path, runs_dir, tiny_model):
    import shutil

    cut = tmp_path / "cut"
    shutil.copytree(tiny_model, cut)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    manifest = _two_runs(tmp_path, tiny_model, f"""\
        - id: bad
          mode: generate
          model: {{source: "{cut}"}}
          generate: {{prompts: ["hi"], max_new_tokens: 2}}
        """)
    r = invoke("run", manifest)
    assert r.exit_code == 2 and "truncated" in r.output and "run t/bad: model" in flat(r.output), r.output
    _nothing_under(runs_dir)
    for command in (["generate", "hi", "--model", cut, "--max-new-tokens", 2],
                    ["bench", "--model", cut, "--prompt-lens", 8, "--new-tokens", 2, "--repeats", 1],
                    ["eval", "--model", cut, "--max-tokens", 48, "--prompt-len", 16]):
        one = invoke(*command)
        assert one.exit_code == 2 and "truncated" in one.output and "Traceback" not in one.output, (command, one.output)
    _nothing_under(runs_dir)


@pytest.fixture
def latin1(tmp_path) -> Path:
    path = tmp_path / "latin1.txt"
    path.write_bytes("Un caf\u00e9 tr\u00e8s fort, s'il vous pla\u00eet. ".encode("latin-1") * 40)
    return path


def test_a_text_that_is_not_utf8_fails_in_preflight_naming_the_field(tmp_path, runs_dir, tiny_model, latin1):
    manifest = _two_runs(tmp_path, tiny_model, f"""\
        - id: bad
          mode: eval
          eval:
            candidates: [{{cache_kind: q8_0}}]
            perplexity: {{max_tokens: 48, prompt_len: 16, text: "{latin1}"}}
        """)
    r = invoke("run", manifest)
    assert r.exit_code == 2 and "eval.perplexity.text" in r.output and "not UTF-8" in flat(r.output), r.output
    _nothing_under(runs_dir)
    for command in (["eval", "--model", tiny_model, "--text", latin1, "--max-tokens", 48, "--prompt-len", 16],
                    ["bench", "--model", tiny_model, "--text", latin1, "--prompt-lens", 8, "--new-tokens", 2,
                     "--repeats", 1]):
        one = invoke(*command)
        assert one.exit_code == 2 and "--text" in one.output and "not UTF-8" in flat(one.output), (command, one.output)
        assert "Traceback" not in one.output
    _nothing_under(runs_dir)


@pytest.mark.parametrize("field, line", [("notes", 'notes: "odd \\ud800 text"'),
                                         ("expect.output_sha256", 'expect: {output_sha256: "\\udc80"}')])
def test_a_lone_surrogate_is_refused_by_validate(tmp_path, runs_dir, tiny_model, field, line):
    manifest = write_manifest(tmp_path / "m.yaml", GENERATE + f"  {line}\n", model=str(tiny_model))
    number = next(i for i, text in enumerate(manifest.read_text().splitlines(), 1) if text.strip() == line)
    r = invoke("validate", manifest)
    assert r.exit_code == 2 and f"m.yaml:{number}" in r.output and field in r.output, r.output
    assert "surrogate" in r.output
    run = invoke("run", manifest)
    assert run.exit_code == 2, run.output
    _nothing_under(runs_dir)


def test_a_label_typo_in_expect_is_found_before_the_eval_runs(tmp_path, runs_dir, tiny_model, monkeypatch):
    import caramba.runners.eval as eval_runner

    ran = []
    monkeypatch.setattr(eval_runner, "evaluate_cache", lambda *a, **k: ran.append(1))
    manifest = _two_runs(tmp_path, tiny_model, """\
        - id: e
          mode: eval
          eval:
            candidates: [{cache_kind: q8_0, name: q8}]
            perplexity: {max_tokens: 48, prompt_len: 16}
          expect: {metrics: ["q8.kl_mean <= 1", "q9.kl_mean <= 1"]}
        """)
    r = invoke("run", manifest, "--check")
    assert r.exit_code == 2 and "q9.kl_mean" in r.output and "did you mean 'q8.kl_mean'" in flat(r.output), r.output
    assert ran == []
    _nothing_under(runs_dir)


def test_generate_refuses_a_tokenizer_past_the_models_vocabulary(tmp_path, runs_dir):
    from safetensors.torch import load_file, save_file

    model = write_tiny_model(tmp_path / "small_vocab")   # weights of 200 tokens, a tokenizer of 259
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": 200}))
    tensors = load_file(str(model / "model.safetensors"))
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"][:200].contiguous()
    save_file(tensors, str(model / "model.safetensors"))
    r = invoke("generate", "\u20ac 5", "--model", model, "--max-new-tokens", 2)   # \u20ac: bytes e2 82 ac, ids >= 200
    assert r.exit_code == 2 and "its tokenizer has ids up to 258" in flat(r.output), r.output
    assert "Traceback" not in r.output and "RuntimeError" not in r.output


def test_bench_refuses_a_context_shorter_than_a_press_window(runs_dir, tiny_model):
    r = invoke("bench", "--model", tiny_model, "--prompt-lens", 16, "--presses", "none,snapkv@0.5", "--new-tokens", 2,
               "--repeats", 1)
    assert r.exit_code == 2 and "--presses" in r.output and "snapkv" in r.output, r.output
    assert "Traceback" not in r.output
    _nothing_under(runs_dir)


# ---- 5. reports ------------------------------------------------------------------------------------------

def test_bench_shows_which_press_each_row_measured(runs_dir, tiny_model):
    r = CliRunner().invoke(app, ["bench", "--model", str(tiny_model), "--prompt-lens", "24", "--presses",
                                 "none,knorm@0.5", "--new-tokens", "2", "--warmup", "0", "--repeats", "1"],
                           env={"COLUMNS": "250"})
    assert r.exit_code == 0, r.output
    header = next(line for line in r.output.splitlines() if "impl" in line and "ctx" in line)
    assert " press " in header, header
    assert "knorm@0.5" in r.output and "none" in r.output


@pytest.mark.parametrize("flag, value", [("--prompt-lens", "16,16"), ("--batch-sizes", "1,2,1"),
                                         ("--cache-kinds", "q8_0,Q8_0"), ("--presses", "knorm@0.5,knorm@0.50"),
                                         ("--decode-plans", "none;none")])
def test_bench_refuses_a_grid_value_listed_twice(runs_dir, tiny_model, flag, value):
    r = invoke("bench", "--model", tiny_model, flag, value, "--new-tokens", 2, "--repeats", 1)
    assert r.exit_code == 2 and flag in r.output and "listed twice" in r.output, r.output
    _nothing_under(runs_dir)


def test_report_x_with_eval_runs_is_refused_not_ignored(tmp_path, runs_dir, tiny_model):
    manifest = write_manifest(tmp_path / "e.yaml", """\
- id: e
  mode: eval
  eval:
    candidates: [{cache_kind: q8_0, name: q8}]
    perplexity: {max_tokens: 40, prompt_len: 16}
""", model=str(tiny_model))
    assert invoke("run", manifest).exit_code == 0
    assert invoke("report", manifest).exit_code == 0
    r = invoke("report", manifest, "--x", "seed")
    assert r.exit_code == 2 and "--x" in r.output and "frontier" in r.output, r.output


def test_press_kernel_help_says_the_scores_are_averaged():
    r = CliRunner().invoke(app, ["generate", "--help"], env={"COLUMNS": "300"})
    line = flat(r.output)
    at = line.index("--press-kernel")
    assert "average-pooling" in line[at:at + 200] and "max-pooling" not in line
