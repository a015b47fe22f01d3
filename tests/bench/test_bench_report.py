"""Bench CSV/JSON/plots and run comparison."""

from __future__ import annotations

import csv
import json

import pytest

from caramba.bench.report import compare, write_csv, write_plots


def rows(rate: float) -> list[dict]:
    return [
        {"impl": "caramba", "prompt_len": L, "batch_size": 1, "cache_kind": "fp32", "new_tokens": 8,
         "ttft_s": 0.01 * L, "decode_tok_s": rate / L ** 0.1, "decode_p50_ms": 5.0, "decode_p99_ms": 7.0,
         "peak_rss_mb": 100.0 + L, "cache_bytes": 1024 * L}
        for L in (16, 64, 256)
    ]


def record(tmp_path, name: str, cells: list[dict]):
    d = tmp_path / name
    d.mkdir()
    (d / "result.json").write_text(json.dumps({"mode": "decode-bench", "cells": cells}))
    return d


def test_csv_round_trips(tmp_path):
    write_csv(tmp_path / "cells.csv", rows(20.0))
    with open(tmp_path / "cells.csv") as f:
        back = list(csv.DictReader(f))
    assert [int(r["prompt_len"]) for r in back] == [16, 64, 256]
    assert not list(tmp_path.glob(".*tmp*"))


def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    written = write_plots(tmp_path, rows(20.0))
    assert {p.name for p in written} == {"decode_tok_s.png", "memory.png", "cache_bytes.png"}
    assert all(p.stat().st_size > 1000 for p in written)


def test_compare_reports_relative_deltas(tmp_path):
    a, b = record(tmp_path, "a", rows(20.0)), record(tmp_path, "b", rows(25.0))
    table = compare([a, b])
    later = [r for r in table if r["run"] == str(b)]
    assert len(table) == 6 and len(later) == 3
    assert all(r["decode_tok_s_delta"] == pytest.approx(0.25) for r in later)
    assert all("decode_tok_s_delta" not in r for r in table if r["run"] == str(a))


def test_compare_needs_finished_records(tmp_path):
    with pytest.raises(FileNotFoundError, match="result.json"):
        compare([tmp_path])
