"""Bench outputs (CSV, JSON, PNG plots) and the comparison of run records behind `caramba report`."""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path

from caramba.runs import DONE, STAGING, RecordError, atomic_write_text, entry_kind, record_damage

CELL_KEY = ("impl", "prompt_len", "batch_size", "cache_kind", "decode_plan", "press")
COMPARED = ("ttft_s", "decode_tok_s", "decode_p50_ms", "decode_p99_ms", "peak_rss_mb", "cache_bytes")


def write_csv(path: Path, rows: list[dict]) -> None:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(path, buf.getvalue())


def pyplot(required: bool = True):
    """matplotlib's pyplot on the Agg backend; without matplotlib (the `plots` extra) a ValueError
    saying how to get it, or None when not required."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if required:
            raise ValueError("plots need matplotlib: pip install 'caramba[plots]'") from None
        return None
    return plt


def save_figure(fig, ax, path: Path, dpi: int = 120) -> Path:
    """Grid, legend and layout, then the PNG written atomically (a reader never sees half of it)."""
    import matplotlib.pyplot as plt

    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=dpi)
    plt.close(fig)
    tmp.replace(path)
    return path


def write_plots(directory: Path, rows: list[dict]) -> list[Path]:
    """decode tok/s vs context and memory vs context, one line per (impl, cache kind, batch).
    Needs matplotlib (the `plots` extra); returns [] without it."""
    plt = pyplot(required=False)
    if plt is None:
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
        written.append(save_figure(fig, ax, directory / name))
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
    if os.path.lexists(run_dir / DONE) and (damage := record_damage(run_dir)) is not None:
        raise ValueError(f"{run_dir} is a damaged record, its numbers are not shown: {damage}")
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
    # A record from before presses has no "press": its cells were unpressed.
    return tuple(json.dumps(row.get(k, "none" if k == "press" else None), sort_keys=True) for k in CELL_KEY)


# ---- one table across a sweep (`caramba report MANIFEST` or `caramba report runs/NAME`) ----------

def record_dirs(directory: Path) -> list[tuple[str, Path]]:
    """(target/run, record directory) of every run record under a manifest's records directory
    (runs/<manifest name>), in name order; hidden entries (locks, attempts being built) are not runs."""
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} is not a directory of run records (runs/<manifest name>)")
    found = []
    # Not through links: a target that is a link is not read; a run that is one is listed (blocked).
    for target in sorted(p for p in directory.iterdir() if _kind(p) == "directory" and not p.name.startswith(".")):
        runs = {p.name: p for p in target.iterdir()
                if _kind(p) in ("directory", "symbolic link") and not p.name.startswith(".")}
        for p in target.glob(f".*{STAGING}"):   # a worker killed mid-attempt left only its staging directory
            runs.setdefault(p.name[1:-len(STAGING)], target / p.name[1:-len(STAGING)])
        found += [(f"{target.name}/{name}", runs[name]) for name in sorted(runs)]
    if not found:
        raise FileNotFoundError(f"{directory} is not a run record (no result.json) and holds none "
                                f"(expected {directory}/<target>/<run id>/result.json)")
    return found


def _kind(path: Path) -> str | None:
    try:
        return entry_kind(path)
    except RecordError:
        return None


def flat_rows(rows: list[dict]) -> list[dict]:
    """Rows with params and metrics as columns (for the table and CSV); `note` says why a run
    that is not done shows no metrics."""
    notes = any(r.get("detail") for r in rows)
    return [{"run": r["run"], "status": r["status"], "mode": r["mode"], **r["params"], **r["metrics"],
             **({"note": r.get("detail", "")} if notes else {})} for r in rows]


def pivot(rows: list[dict], key: str, metric: str) -> list[dict]:
    """One row per sweep and combination of the other params, one column per value of `key`
    holding `metric` (empty where that run is not done). Two sweeps with the same params stay
    two rows: a run goes to the first row of its target and params whose cell for its value is
    still free, so rows never merge runs of different sweeps; `runs` names each row's runs."""
    if not any(key in r["params"] for r in rows):
        keys = sorted({k for r in rows for k in r["params"]})
        raise ValueError(f"--pivot {key!r} is not a matrix key of these runs; keys: {', '.join(keys) or 'none'}")
    table: dict[str, list[tuple[dict, list[str]]]] = {}
    for r in rows:
        if key not in r["params"]:
            continue
        others = {k: v for k, v in r["params"].items() if k != key}
        target = r["run"].split("/", 1)[0]
        column = f"{metric} @ {key}={_text(r['params'][key])}"
        groups = table.setdefault(json.dumps([target, others], sort_keys=True), [])
        free = next((g for g in groups if column not in g[0]), None)
        if free is None:
            free = ({**others}, [])
            groups.append(free)
        free[0][column] = r["metrics"].get(metric)
        free[1].append(r["run"])
    return [{"runs": _common_name(names, key), **cells} for groups in table.values() for cells, names in groups]


def _common_name(names: list[str], key: str) -> str:
    """What a row's runs share: their ids up to the pivoted key's part (`.press_ratio-0.1`:
    caramba.manifest.matrix names it by its last component, or the whole key with '_' for '.'),
    never cut at a '.' inside a value (0.1 is not `press_ratio-0`); else the sweep's base id."""
    if len(names) == 1:
        return names[0]
    prefix = os.path.commonprefix(names)
    start = prefix.find("/") + 1
    for label in (key.rsplit(".", 1)[-1], key.replace(".", "_")):
        cut = prefix.rfind(f".{label}-")
        if cut >= start:
            return prefix[:cut]
    cut = prefix.find(".", start)   # ids cut to a hash, or records from elsewhere: the base id
    return prefix[:cut] if cut > start else prefix.rstrip(".-_") or names[0]


def markdown_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """A GitHub-flavoured Markdown table (`|` and newlines in cells escaped)."""
    columns = columns or list(dict.fromkeys(k for r in rows for k in r))

    def cell(value) -> str:
        if value is None:
            text = ""
        elif isinstance(value, float):
            text = f"{value:.4g}"
        else:
            text = value if isinstance(value, str) else json.dumps(value)
        return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def plot_sweep(path: Path, rows: list[dict], x: str, metric: str) -> Path:
    """`metric` against matrix key `x`, one line per combination of the other params (PNG; needs
    matplotlib, the `plots` extra)."""
    plt = pyplot()
    series: dict[str, list[tuple]] = {}
    for r in rows:
        if x in r["params"] and _number(r["metrics"].get(metric)):
            label = " ".join(f"{k}={_text(v)}" for k, v in r["params"].items() if k != x) or metric
            series.setdefault(label, []).append((r["params"][x], r["metrics"][metric]))
    if not series:
        raise ValueError(f"no run has both matrix key {x!r} and metric {metric!r} to plot")
    values = list(dict.fromkeys(v for points in series.values() for v, _ in points))
    numeric = all(_number(v) for v in values)
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, points in sorted(series.items()):
        points.sort(key=lambda p: p[0] if numeric else values.index(p[0]))
        xs = [p[0] if numeric else values.index(p[0]) for p in points]
        ax.plot(xs, [p[1] for p in points], marker="o", label=label)
    if not numeric:
        ax.set_xticks(range(len(values)), [_text(v) for v in values])
    ax.set_xlabel(x)
    ax.set_ylabel(metric)
    return save_figure(fig, ax, path)
