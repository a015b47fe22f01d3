"""Manifest loading: schema, line-numbered errors, vars and --set overrides."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from caramba.errors import UserError
from caramba.manifest import Manifest, ModelSpec, load_manifest, resolved_manifest_yaml

QUICKSTART = """\
version: 1
name: quickstart
vars: {model: smollm2-135m}
defaults:
  model: {source: "${model}", dtype: float32}
targets:
  - type: experiment
    name: hello
    runs:
      - id: greedy
        mode: generate
        seed: 0
        generate:
          prompts: ["The capital of France is"]
          max_new_tokens: 32
          temperature: 0.0
          cache_kind: fp32
"""
TEMPERATURE_LINE = 16


def write(tmp_path: Path, text: str, name: str = "m.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def edited(old: str, new: str) -> str:
    assert old in QUICKSTART
    return QUICKSTART.replace(old, new)


def load_error(path: Path, overrides: list[str] | None = None) -> str:
    with pytest.raises(UserError) as caught:
        load_manifest(path, overrides or [])
    return str(caught.value)


def test_quickstart_validates(tmp_path):
    manifest = load_manifest(write(tmp_path, QUICKSTART))
    assert isinstance(manifest, Manifest)
    [resolved] = manifest.iter_runs()
    assert resolved.target == "hello"
    assert resolved.run.id == "greedy"
    assert resolved.run.generate.temperature == 0.0
    assert resolved.run.generate.max_new_tokens == 32
    assert resolved.model == ModelSpec(source="smollm2-135m", dtype="float32", device="cpu")


def test_unknown_field_has_line_and_did_you_mean(tmp_path):
    path = write(tmp_path, edited("temperature: 0.0", "temprature: 0.0"))
    message = load_error(path)
    assert f"{path}:{TEMPERATURE_LINE}: targets[0].runs[0].generate.temprature: unknown field 'temprature'" in message
    assert "valid fields: prompts, max_new_tokens, temperature" in message
    assert "did you mean 'temperature'?" in message


def test_bad_value_names_field_path_and_line(tmp_path):
    path = write(tmp_path, edited("temperature: 0.0", "temperature: -1"))
    message = load_error(path)
    assert (
        f"{path}:{TEMPERATURE_LINE}: targets[0].runs[0].generate.temperature: "
        "Input should be greater than or equal to 0 (got -1)"
    ) in message


def test_all_problems_in_one_error(tmp_path):
    path = write(tmp_path, edited("temperature: 0.0", "temperature: -1\n          top_p: 2"))
    message = load_error(path)
    assert "(2 problems)" in message
    assert f"{path}:{TEMPERATURE_LINE}: " in message
    assert f"{path}:{TEMPERATURE_LINE + 1}: targets[0].runs[0].generate.top_p" in message


def test_unknown_mode_lists_valid_modes(tmp_path):
    path = write(tmp_path, edited("mode: generate", "mode: speculate"))
    message = load_error(path)
    assert f"{path}:11: targets[0].runs[0].mode: 'speculate' is not a valid mode; valid mode values: generate" in message


def test_mode_needs_its_settings_section(tmp_path):
    text = QUICKSTART.split("        generate:")[0]
    message = load_error(write(tmp_path, text))
    assert "mode 'generate' needs a 'generate:' section" in message


def test_duplicate_run_ids(tmp_path):
    path = write(tmp_path, QUICKSTART + "      - {id: greedy, mode: generate, generate: {prompts: [hi]}}\n")
    message = load_error(path)
    assert f"{path}:9: targets[0].runs: duplicate run id 'greedy'" in message


def test_unsafe_run_id(tmp_path):
    message = load_error(write(tmp_path, edited("id: greedy", "id: ../escape")))
    assert "targets[0].runs[0].id: '../escape' is not a safe identifier" in message


def test_missing_required_field_points_at_parent(tmp_path):
    path = write(tmp_path, edited('          prompts: ["The capital of France is"]\n', ""))
    message = load_error(path)
    assert f"{path}:13: targets[0].runs[0].generate.prompts: missing required field 'prompts'" in message


def test_undefined_var_names_it_and_its_line(tmp_path):
    path = write(tmp_path, edited('"${model}"', '"${modle}"'))
    message = load_error(path)
    assert f"{path}:5: defaults.model.source: undefined var 'modle'" in message
    assert "did you mean 'model'?" in message


def test_var_typed_substitution(tmp_path):
    text = edited("vars: {model: smollm2-135m}", "vars: {model: smollm2-135m, n: 7, t: 0.5, topic: France}")
    text = text.replace("max_new_tokens: 32", "max_new_tokens: ${n}").replace("temperature: 0.0", "temperature: ${t}")
    text = text.replace("capital of France", "capital of ${topic} (${n})")
    [resolved] = load_manifest(write(tmp_path, text)).iter_runs()
    assert resolved.run.generate.max_new_tokens == 7
    assert resolved.run.generate.temperature == 0.5
    assert resolved.run.generate.prompts == ["The capital of France (7) is"]


def test_run_model_override_merges_with_defaults(tmp_path):
    text = edited("        seed: 0\n", "        seed: 0\n        model: {dtype: bfloat16}\n")
    text = text.replace("dtype: float32}", "dtype: float32, device: auto}")
    manifest = load_manifest(write(tmp_path, text))
    [resolved] = manifest.iter_runs()
    assert resolved.model == ModelSpec(source="smollm2-135m", dtype="bfloat16", device="auto")
    # The record carries the effective model, and loading it again gives the same runs.
    again = load_manifest(write(tmp_path, resolved_manifest_yaml(manifest), "resolved.yaml"))
    assert [r.model for r in again.iter_runs()] == [resolved.model]
    assert [r.run.generate for r in again.iter_runs()] == [resolved.run.generate]


def test_set_by_name_and_by_index(tmp_path):
    path = write(tmp_path, QUICKSTART)
    manifest = load_manifest(
        path,
        [
            "targets.hello.runs.greedy.generate.temperature=0.7",
            "targets.0.runs.0.generate.max_new_tokens=5",
            "defaults.model.dtype=bfloat16",
            "vars.model=/models/x.gguf",
            "targets.hello.runs.greedy.model.device=auto",  # a section the manifest leaves out
        ],
    )
    [resolved] = manifest.iter_runs()
    assert resolved.run.generate.temperature == 0.7
    assert resolved.run.generate.max_new_tokens == 5
    assert resolved.model == ModelSpec(source="/models/x.gguf", dtype="bfloat16", device="auto")
    assert yaml.safe_load(resolved_manifest_yaml(manifest))["defaults"]["model"]["source"] == "/models/x.gguf"


def test_set_value_typing(tmp_path):
    path = write(tmp_path, QUICKSTART)
    [resolved] = load_manifest(
        path,
        [
            "targets.hello.runs.greedy.generate.prompts=[a, 'b: c']",
            "targets.hello.runs.greedy.generate.chat=true",
            "targets.hello.runs.greedy.notes='0.7'",
            "targets.hello.runs.greedy.generate.stop_sequences=[]",
        ],
    ).iter_runs()
    assert resolved.run.generate.prompts == ["a", "b: c"]
    assert resolved.run.generate.chat is True
    assert resolved.run.notes == "0.7"
    assert resolved.run.generate.stop_sequences == []


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("targets.hello.runs.gredy.seed=1", "no item with id 'gredy' in targets[0].runs; valid: greedy"),
        ("targets.3.name=x", "index 3 is out of range, targets has 1 item(s)"),
        ("tragets.0.name=x", "no 'tragets' at the top level; valid keys: version, name, vars, defaults, targets"),
        ("targets.hello.runs.greedy.generate.temprature=1", "did you mean 'temperature'?"),
        ("targets.hello.runs.greedy.seed.x=1", "targets[0].runs[0].seed is a single value"),
        ("temperature", "expected KEY.PATH=VALUE"),
    ],
)
def test_bad_set_path(tmp_path, override, expected):
    message = load_error(write(tmp_path, QUICKSTART), [override])
    assert f"--set {override}" in message or f"--set {override!r}" in message
    assert expected in message


def test_error_from_set_value_names_the_override(tmp_path):
    override = "targets.hello.runs.greedy.generate.temperature=-1"
    path = write(tmp_path, QUICKSTART)
    message = load_error(path, [override])
    assert f"{path} (from --set {override}): targets[0].runs[0].generate.temperature" in message


def test_yaml_syntax_error_has_line(tmp_path):
    path = write(tmp_path, edited("max_new_tokens: 32", "max_new_tokens: [32"))
    message = load_error(path)
    assert message.startswith(f"{path}:")
    assert "YAML syntax error" in message
    line = int(message.split(":")[1])
    assert 15 <= line <= 16  # pyyaml reports the unclosed list where it notices it


def test_duplicate_yaml_key_has_line(tmp_path):
    path = write(tmp_path, edited("seed: 0", "seed: 0\n        seed: 1"))
    assert load_error(path) == f"{path}:13: duplicate key 'seed' (first given on line 12)"


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    assert "manifest file not found" in load_error(path)


def test_empty_file(tmp_path):
    path = write(tmp_path, "# nothing here\n")
    assert load_error(path).startswith(f"{path}:1: the manifest is empty")


def test_top_level_must_be_mapping(tmp_path):
    path = write(tmp_path, "- a\n- b\n")
    assert load_error(path).startswith(f"{path}:1: the top level must be a mapping")


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[2] / "manifests").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_manifest_validates(path):
    from caramba.manifest import parse_manifest

    m = parse_manifest(path.read_text(encoding="utf-8"), str(path))
    assert m.targets and all(t.runs for t in m.targets if getattr(t, "runs", None) is not None)
