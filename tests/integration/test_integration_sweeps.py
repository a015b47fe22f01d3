"""manifests/sweep.yaml on the real model: two of its runs serially and with --jobs 2 give
byte-identical greedy output_ids (the workers run 1 thread each, the serial run torch's default)."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import SMOLLM2
from typer.testing import CliRunner

from caramba.cli import app

pytestmark = SMOLLM2
ROOT = Path(__file__).resolve().parents[2]
PICK = "kv.cache_kind-q8_0.prompts-The*"   # both seeds of one cache kind and prompt set


def outputs(records: Path) -> dict:
    found = {d.name: [p["output_ids"] for p in json.loads((d / "result.json").read_text())["prompts"]]
             for d in records.iterdir() if d.is_dir() and not d.name.startswith(".")}
    assert len(found) == 2 and all(len(ids) == 2 for ids in found.values()), found
    return found


def test_sweep_outputs_match_serial_and_pool(tmp_path, monkeypatch, smollm2):
    runs = {}
    for name, args in (("serial", []), ("pool", ["--jobs", "2"])):
        monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / name))
        result = CliRunner().invoke(app, ["run", str(ROOT / "manifests" / "sweep.yaml"), "--run", PICK, *args])
        assert result.exit_code == 0, result.output
        runs[name] = outputs(tmp_path / name / "sweep" / "cache")
    assert runs["serial"] == runs["pool"]
