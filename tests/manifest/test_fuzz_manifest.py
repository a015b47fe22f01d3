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


# ---- YAML 1.2 scalars: each written as a plain scalar, with the value the core schema gives it --
# (built with its meaning, so the expected value comes from the generator, not from a resolver)
decimal_ints = st.builds(lambda sign, zeros, n: (f"{sign}{'0' * zeros}{n}", -n if sign == "-" else n),
                         st.sampled_from(["", "+", "-"]), st.integers(0, 3), st.integers(0, 2**70))
radix_ints = st.one_of(st.integers(0, 2**40).map(lambda n: (f"0o{n:o}", n)),
                       st.integers(0, 2**40).map(lambda n: (f"0x{n:x}", n)), st.integers(0, 2**40).map(lambda n: (f"0x{n:X}", n)))
floats_12 = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False).map(lambda x: (repr(x), x)),
    st.builds(lambda m, e: (f"{m}e{e}", float(f"{m}e{e}")), st.integers(0, 999), st.integers(-30, 30)),
    st.sampled_from([(".inf", float("inf")), ("-.Inf", float("-inf")), ("+.INF", float("inf")), (".5", 0.5), ("1.", 1.0)]))
# What YAML 1.1 reads as a bool, a base-60 number, a date, an int with '_' or a binary: strings in 1.2.
strings_12 = st.one_of(
    st.sampled_from("y Y yes Yes YES n N no No NO on On ON off Off OFF".split()),
    st.builds(lambda h, m, s: f"{h}:{m:02d}" + (f":{s:02d}" if s is not None else ""),
              st.integers(0, 99), st.integers(0, 59), st.none() | st.integers(0, 59)),
    st.dates().map(str), st.integers(1000, 99999).map(lambda n: f"{n // 1000}_{n % 1000:03d}"),
    st.integers(0, 255).map(lambda n: f"0b{n:b}"))
bools_12 = st.sampled_from([("true", True), ("True", True), ("TRUE", True), ("false", False), ("False", False),
                            ("FALSE", False)])
nulls_12 = st.sampled_from([("~", None), ("null", None), ("Null", None), ("NULL", None), ("", None)])


@FUZZ
@given(case=st.one_of(decimal_ints, radix_ints, floats_12, bools_12, nulls_12, strings_12.map(lambda s: (s, s))))
def test_plain_scalars_read_as_yaml_1_2(case):
    from caramba.manifest.yaml_lines import parse_yaml

    text, expected = case
    value = parse_yaml(f"a: {text}\n", "m.yaml")[0]["a"]
    assert type(value) is type(expected) and value == expected, (text, value, expected)


@FUZZ
@given(case=st.one_of(decimal_ints, floats_12, bools_12, strings_12.map(lambda s: (s, s))),
       field=st.sampled_from(["seed", "generate.max_new_tokens", "generate.stream", "generate.temperature",
                              "generate.cache_kind"]))
def test_a_scalar_in_any_field_is_its_yaml_1_2_value_or_an_error_naming_its_line(case, field):
    text, expected = case
    data = copy.deepcopy(BASE)
    run = data["targets"][0]["runs"][0]
    *parents, leaf = field.split(".")
    node = run
    for key in parents:
        node = node[key]
    node[leaf] = "@@"
    source = yaml.safe_dump(data, sort_keys=False).replace("'@@'", text)
    line = next(n for n, row in enumerate(source.splitlines(), 1) if f"{leaf}: {text}" in row)
    try:
        m = parse_manifest(source, "m.yaml")
    except UserError as e:
        assert f"m.yaml:{line}: targets[0].runs[0].{field}: " in str(e), (text, str(e))
        return
    got = m.targets[0].runs[0]
    for key in field.split("."):
        got = getattr(got, key)
    assert not isinstance(expected, str) or field.endswith("cache_kind"), (text, got)   # a string never became a number or bool
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731 (an exact 2.0 fits an int field)
    assert got == expected and (type(got) is type(expected) or number(got) and number(expected)), (text, got)
