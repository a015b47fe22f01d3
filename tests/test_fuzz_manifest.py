"""Property-based fuzzing of the manifest loader and the CLI paths that only read (`validate`,
`run --dry-run`): whatever the manifest text and --set overrides, the answer is exit 0 or 2 with
a message (exit 1 from these commands means an unexpected exception reached the top), never a
traceback or a rich MarkupError, and nothing is written under the runs directory.

Derandomized (a fixed seed, no example database) so CI sees the same examples every run."""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from caramba.cli import app
from caramba.errors import UserError
from caramba.manifest import parse_manifest

BASE = {
    "version": 1,
    "name": "fuzz",
    "vars": {"model": "smollm2-135m"},
    "defaults": {"model": {"source": "${model}", "dtype": "float32", "device": "cpu"}},
    "targets": [{"type": "experiment", "name": "t", "runs": [
        {"id": "g", "mode": "generate", "seed": 0,
         "generate": {"prompts": ["hello"], "max_new_tokens": 4, "temperature": 0.0, "top_k": None,
                      "max_seq_len": 64, "cache_kind": "fp32", "batch_size": 1}},
        {"id": "a", "mode": "cache-autotune", "autotune": {"budget_mb": 1.0, "max_seq_len": 64}},
        {"id": "b", "mode": "decode-bench", "bench": {"prompt_lens": [8], "new_tokens": 2, "repeats": 1}},
    ]}],
}
LEAVES = [
    ("version",), ("name",), ("vars", "model"), ("defaults", "model", "source"), ("defaults", "model", "dtype"),
    ("defaults", "model", "device"), ("targets", 0, "name"), ("targets", 0, "type"),
    ("targets", 0, "runs", 0, "id"), ("targets", 0, "runs", 0, "mode"), ("targets", 0, "runs", 0, "seed"),
    ("targets", 0, "runs", 0, "generate", "prompts"), ("targets", 0, "runs", 0, "generate", "max_new_tokens"),
    ("targets", 0, "runs", 0, "generate", "temperature"), ("targets", 0, "runs", 0, "generate", "top_k"),
    ("targets", 0, "runs", 0, "generate", "max_seq_len"), ("targets", 0, "runs", 0, "generate", "cache_kind"),
    ("targets", 0, "runs", 0, "generate", "batch_size"), ("targets", 0, "runs", 0, "generate", "unknown_field"),
    ("targets", 0, "runs", 0, "model"), ("targets", 0, "runs", 1, "autotune", "budget_mb"),
    ("targets", 0, "runs", 1, "autotune", "plan_path"), ("targets", 0, "runs", 1, "autotune", "text"),
    ("targets", 0, "runs", 2, "bench", "prompt_lens"), ("targets", 0, "runs", 2, "bench", "reference"),
    ("targets", 0, "runs", 2, "bench", "cache_kinds"), ("targets", 0, "runs", 2, "bench", "decode_plans"),
]
HOSTILE_TEXT = ["[/INST]", "[/x]", "[bold]hi", "${model}", "${nope}", "", " ", "smollm2-135m", "/dev/zero", "/",
                ".", "..", "../../etc/passwd", "cache_plans.json", "a\\", "\u202e", "🙂", "auto", "q8_0", "nan",
                "a\x00b", "~nouser/x", "x" * 300, "runs/x.json", "\x1b[31mred"]

texts = st.one_of(st.sampled_from(HOSTILE_TEXT), st.text(max_size=24))
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True), texts,
)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(texts, inner, max_size=4)), max_leaves=12)
# Raw YAML-ish text: the characters that make YAML structure, control characters included.
raw_yaml = st.lists(st.sampled_from(list("ab:- \n[]{},&*!|>'\"#%@`\t\x00\x07\x1b\\$") + ["<<: ", "&a ", "*a", "  "]),
                    max_size=60).map("".join)


@st.composite
def manifest_texts(draw) -> str:
    kind = draw(st.sampled_from(["mutated", "mutated", "mutated", "raw", "spliced"]))
    if kind == "raw":
        return draw(raw_yaml)
    data = copy.deepcopy(BASE)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(LEAVES))
        node = data
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = draw(values)
    text = yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
    if kind == "spliced":  # raw YAML dropped into a valid manifest
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(raw_yaml) + text[at:]
    return text


override_paths = st.one_of(st.sampled_from([".".join(map(str, p)) for p in LEAVES] + ["targets.t.runs.g.seed",
                                           "targets.x", "vars.new", "targets.0.runs.9.id"]), texts)
overrides = st.lists(st.builds(lambda p, v: f"{p}={v}", override_paths, st.one_of(texts, raw_yaml)), max_size=2)

# No shrinking: a failure prints the example as found, at once (shrinking can take minutes).
FUZZ = settings(max_examples=200, deadline=None, derandomize=True, database=None, report_multiple_bugs=False,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def workdir():
    with tempfile.TemporaryDirectory() as directory:
        yield Path(directory)


def _files(path: Path) -> list[Path]:
    return [p for p in path.rglob("*")] if path.exists() else []


@FUZZ
@given(text=manifest_texts(), sets=overrides, command=st.sampled_from([["validate"], ["run", "--dry-run"]]))
def test_cli_answers_every_manifest_with_exit_0_or_2_and_writes_nothing(workdir, monkeypatch, text, sets, command):
    runs = workdir / "runs"
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(runs))
    monkeypatch.delenv("CARAMBA_DEBUG", raising=False)
    manifest = workdir / "m.yaml"
    manifest.write_text(text, encoding="utf-8", errors="surrogatepass")
    args = [*command, str(manifest), *[a for s in sets for a in ("--set", s)]]
    result = CliRunner().invoke(app, args)
    assert result.exit_code in (0, 2), (args, text, result.output)
    assert result.exception is None or isinstance(result.exception, SystemExit), (text, result.exception)
    assert "Traceback" not in result.output and "MarkupError" not in result.output, result.output
    if result.exit_code == 2:
        assert result.output.strip().startswith("error:"), result.output
    assert _files(runs) == [], (text, _files(runs))


@FUZZ
@given(text=st.one_of(manifest_texts(), st.text(max_size=200)), sets=overrides)
def test_the_loader_raises_only_user_errors(text, sets):
    try:
        parse_manifest(text, "m.yaml", sets)
    except UserError as e:
        assert str(e).strip()


json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), texts),
                           lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(texts, inner, max_size=3)),
                           max_leaves=10)
store_shapes = st.one_of(
    st.binary(max_size=64),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.builds(lambda plans: json.dumps({"version": 1, "plans": plans}).encode(),
              st.dictionaries(texts, json_values, max_size=3)),
)


@settings(FUZZ, max_examples=80)
@given(content=store_shapes, command=st.sampled_from([["plans", "list"], ["plans", "list", "--json"],
                                                      ["plans", "show", "a"], ["plans", "clear"], ["plans", "clear", "a"]]))
def test_plan_commands_answer_any_store_and_never_touch_a_file_outside_runs(workdir, monkeypatch, content, command):
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(workdir / "runs"))
    outside = workdir / "elsewhere"
    shutil.rmtree(outside, ignore_errors=True)
    outside.mkdir()
    store = outside / "plans.json"
    store.write_bytes(content)
    before = sorted(p.name for p in outside.iterdir())
    result = CliRunner().invoke(app, [*command, "--plan-path", str(store)])
    assert result.exit_code in (0, 2), (content, result.output)
    assert "Traceback" not in result.output and "MarkupError" not in result.output, result.output
    try:
        parsed = json.loads(content)
    except ValueError:
        parsed = None
    if not (isinstance(parsed, dict) and ("plans" in parsed or "version" in parsed)):
        # Not recognizably a plan store: untouched, and nothing created beside it (no lock, no copy).
        assert store.read_bytes() == content and sorted(p.name for p in outside.iterdir()) == before, result.output
    elif command[1] != "clear":  # reading never moves or rewrites
        assert store.read_bytes() == content and not list(outside.glob("*.corrupt-*"))
