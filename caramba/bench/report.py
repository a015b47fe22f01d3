"""Bench outputs (CSV, JSON, PNG plots) and the comparison of run records behind `caramba report`."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from caramba.runs import atomic_write_text

CELL_KEY = ("impl", "prompt_len", "batch_size", "cache_kind", "decode_plan")
COMPARED = ("ttft_s", "decode_tok_s", "decode_p50_ms", "decode_p99_ms", "peak_rss_mb", "cache_bytes")


def write_csv(path: Path, rows: list[dict]) -> None:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(path, buf.getvalue())


def write_plots(directory: Path, rows: list[dict]) -> list[Path]:
    """decode tok/s vs context and memory vs context, one line per (impl, cache kind, batch).
    Needs matplotlib (the `plots` extra); returns [] without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    series: dict[str, list[dict]] = {}
    for row in rows:
        plan = "" if row.get("decode_plan", "none") == "none" else f" {row['decode_plan']}"
        series.setdefault(f"{row['impl']} {row['cache_kind']}{plan} b={row['batch_size']}", []).append(row)
    written = []
    for name, metric, ylabel in (
        ("decode_tok_s.png", "decode_tok_s", "decode tokens/s"),
        ("memory.png", "peak_rss_mb", "peak RSS (MiB)"),
        ("cache_bytes.png", "cache_bytes", "KV cache (MiB)"),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, points in sorted(series.items()):
            points = sorted((p for p in points if p.get(metric) is not None), key=lambda p: p["prompt_len"])
            if not points:
                continue
            scale = 2**20 if metric == "cache_bytes" else 1
            ax.plot([p["prompt_len"] for p in points], [p[metric] / scale for p in points], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (prompt tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        tmp = directory / f".{name}.tmp.png"
        fig.savefig(tmp, dpi=120)
        plt.close(fig)
        tmp.replace(directory / name)
        written.append(directory / name)
    return written


def load_rows(run_dir: Path) -> list[dict]:
    """Comparable rows of a run record: bench cells, or a generate run's summary. A record that is
    not one (no result.json, not JSON, another shape) is a ValueError naming the file."""
    result_file = run_dir / "result.json"
    if not result_file.is_file():  # also refuses a FIFO or device, which would block or never end
        raise FileNotFoundError(f"{run_dir} has no result.json (not a finished run record)")
    try:
        result = json.loads(result_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{result_file} is not valid JSON ({e})") from None
    if not isinstance(result, dict):
        raise ValueError(f"{result_file} is not a run result (a JSON object with cells or a summary)")
    if "cells" in result:
        cells = result["cells"]
        if not (isinstance(cells, list) and all(isinstance(c, dict) for c in cells)):
            raise ValueError(f"{result_file}: cells is not a list of objects")
        return cells
    summary = result.get("summary") if isinstance(result.get("summary"), dict) else {}
    return [{"impl": "caramba", "prompt_len": None, "batch_size": None, "cache_kind": summary.get("cache_kind"),
             **{k: v for k, v in summary.items() if _number(v)}}]


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def compare(run_dirs: list[Path]) -> list[dict]:
    """One row per (cell, run) with each metric's relative change against the first run."""
    base = {_key(r): r for r in load_rows(run_dirs[0])}
    out = []
    for run_dir in run_dirs:
        for row in load_rows(run_dir):
            ref = base.get(_key(row))
            entry = {"run": str(run_dir), **{k: row.get(k) for k in CELL_KEY}}
            for metric in COMPARED + ("decode_tok_s_median",):
                if not _number(row.get(metric)):
                    continue
                entry[metric] = row[metric]
                if ref is not None and _number(ref.get(metric)) and ref[metric] and run_dir != run_dirs[0]:
                    entry[f"{metric}_delta"] = row[metric] / ref[metric] - 1
            out.append(entry)
    return out


def _key(row: dict) -> tuple:
    # Cell keys come from a file: make them hashable whatever their JSON type.
    return tuple(json.dumps(row.get(k), sort_keys=True) for k in CELL_KEY)
