"""The quality-cost frontier of KV-cache policies, from eval records (`caramba report`).

One row per candidate of every finished eval run: bytes per token, quality (the task average,
PPL ratio and KL against its run's baseline) and decode speed. A candidate is on the frontier
(Pareto-optimal) when no other candidate scored on the same prompts (the same task samples and
perplexity text: a sweep's runs over other lengths are other groups) stores fewer or as many
bytes per token at a higher or equal quality, one of them strictly. Quality is the task average where the runs scored
tasks, else the PPL ratio (lower is better). Speed is a second axis, never part of the
frontier: the plot draws it as colour.

Where the candidates of a group hold different weights (a weight-format study: eval candidates
with their own `weights:` / `source:`), bytes per token of KV cache alone would hide what they
save; the cost is then `bytes_at_context`, the bytes a candidate holds at the eval's context:
its weights plus its cache.

Decode speed comes from the eval's own answers (greedy steps at the tasks' context lengths);
when the same manifest has decode-bench runs, a plain cache kind's bench figure (the median
over its cells at the longest context) is added beside it.
"""

from __future__ import annotations

import json
from pathlib import Path

from caramba.bench.report import pyplot, save_figure

QUALITY_KEYS = ("task_avg", "ppl_ratio", "kl_mean")


def frontier_rows(records: list[tuple[str, Path]]) -> list[dict]:
    """Rows of every candidate in these finished eval records, the Pareto-optimal ones marked."""
    rows, bench = [], {}
    for name, path in records:
        result = _result(path)
        if result is None:
            continue
        if result.get("mode") == "decode-bench":
            bench.update(_bench_speeds(result))
            continue
        if result.get("mode") != "eval":
            continue
        group = _prompts(result)
        for c in result.get("candidates") or []:
            ppl = c.get("perplexity") or {}
            by_length = {f"task_avg@{n}": v for n, v in (c.get("task_avg_by_length") or {}).items()}
            rows.append({"run": name, "group": group, "cache": c["label"], "policy": c.get("policy"), "press": c.get("press"),
                         "baseline": c["label"] == result.get("baseline"),
                         "bytes_per_token": c.get("bytes_per_token"), "bytes_ratio": c.get("bytes_ratio"),
                         "weights": c.get("weights"), "weight_bytes": c.get("weight_bytes"),
                         "bytes_at_context": c.get("bytes_at_context"),
                         "task_avg": c.get("task_avg"), "ppl_ratio": ppl.get("ppl_ratio"), "kl_mean": ppl.get("kl_mean"),
                         **by_length, "decode_tok_s": c.get("decode_tok_s")})
    for row in rows:
        if (row["policy"], row["press"]) in bench:
            row["bench_decode_tok_s"] = bench[(row["policy"], row["press"])]
    for group in dict.fromkeys(r["group"] for r in rows):
        mark_pareto([r for r in rows if r["group"] == group])
    return rows


def _prompts(result: dict) -> str:
    """What a candidate's scores are comparable within: the same task prompts and perplexity text."""
    tasks, ppl = result.get("tasks") or {}, result.get("perplexity") or {}
    return "/".join(str(part)[:12] for part in (tasks.get("prompts_sha256"), ppl.get("protocol"), ppl.get("text"),
                                                ppl.get("n_tokens")) if part is not None)


def quality_key(rows: list[dict]) -> str | None:
    """task_avg when every row has it, else ppl_ratio when every row has that."""
    for key in ("task_avg", "ppl_ratio"):
        if rows and all(isinstance(r.get(key), (int, float)) for r in rows):
            return key
    return None


def cost_key(rows: list[dict]) -> str:
    """bytes_per_token (the KV cache's), or bytes_at_context (weights + cache at the eval's context)
    when the rows hold different weights and every row says how many bytes those are."""
    weights = {r.get("weight_bytes") for r in rows}
    if len(weights) > 1 and all(isinstance(r.get("bytes_at_context"), (int, float)) for r in rows):
        return "bytes_at_context"
    return "bytes_per_token"


def mark_pareto(rows: list[dict]) -> None:
    key, cost = quality_key(rows), cost_key(rows)
    sign = -1 if key == "ppl_ratio" else 1    # higher is better for the task average
    for r in rows:
        if key is None:
            r["pareto"] = None
            continue
        q = sign * r[key]
        r["pareto"] = not any(o is not r and o[cost] <= r[cost] and sign * o[key] >= q
                              and (o[cost] < r[cost] or sign * o[key] > q) for o in rows)


def plot_frontier(path: Path, rows: list[dict]) -> Path:
    """Quality against bytes per token, the frontier as a line, decode tok/s as colour (PNG; needs
    matplotlib, the `plots` extra)."""
    plt = pyplot()
    key = quality_key(rows)
    if key is None:
        raise ValueError("no quality metric common to every candidate (task_avg or ppl_ratio) to plot")
    cost = cost_key(rows)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    speeds = [r.get("decode_tok_s") for r in rows]
    coloured = all(isinstance(s, (int, float)) for s in speeds)
    points = ax.scatter([r[cost] for r in rows], [r[key] for r in rows], s=40, zorder=3,
                        c=speeds if coloured else "tab:blue", cmap="viridis")
    if coloured:
        fig.colorbar(points, ax=ax, label="decode tok/s (eval answers)")
    for i, group in enumerate(dict.fromkeys(r["group"] for r in rows)):
        front = sorted((r for r in rows if r["group"] == group and r["pareto"]), key=lambda r: r[cost])
        runs = ", ".join(dict.fromkeys(r["run"] for r in rows if r["group"] == group))
        ax.step([r[cost] for r in front], [r[key] for r in front], where="post", zorder=2,
                color=f"C{(i + 3) % 10}", label=f"frontier: {runs}")
    for r in rows:
        ax.annotate(r["cache"], (r[cost], r[key]), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("KV cache bytes per token (all layers)" if cost == "bytes_per_token" else
                  "bytes held at the eval's context (weights + KV cache)")
    ax.set_ylabel({"task_avg": "task average (RULER-style tasks)", "ppl_ratio": "PPL ratio to baseline"}[key])
    return save_figure(fig, ax, path, dpi=130)


def _result(path: Path) -> dict | None:
    if not (path / "DONE").is_file():
        return None
    try:
        result = json.loads((path / "result.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return result if isinstance(result, dict) else None


def _bench_speeds(result: dict) -> dict[tuple[str, str | None], float]:
    """(cache kind, press or None) -> median decode tok/s of its caramba cells at the longest context."""
    cells = [c for c in result.get("cells") or [] if isinstance(c, dict) and c.get("impl", "caramba") == "caramba"]
    press = lambda c: None if c.get("press", "none") == "none" else c["press"]   # noqa: E731
    out = {}
    for key in {(c.get("cache_kind"), press(c)) for c in cells}:
        mine = [c for c in cells if (c.get("cache_kind"), press(c)) == key and isinstance(c.get("decode_tok_s"), (int, float))]
        if mine:
            longest = max(c["prompt_len"] for c in mine)
            speeds = sorted(c["decode_tok_s"] for c in mine if c["prompt_len"] == longest)
            out[key] = speeds[len(speeds) // 2]
    return out
