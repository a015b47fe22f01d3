"""`caramba report`'s tables: a sweep (a manifest, or its records directory) as one table, eval
runs as their quality-cost frontier, or run records compared side by side. The command's flags and
output checks are in caramba.cli; what each mode reports is its own (caramba.runners.registry)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape

from caramba.bench.frontier import cost_key, frontier_rows, plot_frontier, quality_key
from caramba.bench.report import (CELL_KEY, compare, flat_rows, markdown_table, pivot, plot_sweep, record_dirs,
                                  write_csv)
from caramba.errors import UserError
from caramba.manifest import load_manifest
from caramba.runners import registry, run_hash, run_identity
from caramba.runs import RecordError, RunDir, held_locks, json_text, read_record_json, record_status


def sweep_row(name: str, record: Path, params: dict | None = None, digest: str | None = None,
              mode: str | None = None, locks: set[tuple[int, int, int]] | None = None) -> dict:
    """One run as a row: {run, status, mode, params, metrics, detail}. status as caramba.runs.
    record_status says: done, changed (made with other settings than `digest`, the manifest's),
    damaged (its files no longer match DONE), blocked, running (another process holds its lock),
    failed (an attempt without DONE, or a killed one) or pending. Only a done record's metrics are
    shown: an old or damaged record's numbers are never reported as this run's. params come from
    the manifest when given, else from the record. locks: caramba.runs.held_locks(), read once."""
    status = record_status(record, digest, locks)
    row = {"run": name, "status": status.state, "mode": mode, "params": dict(params or {}), "metrics": {},
           "detail": status.detail}
    if status.state in ("blocked", "pending") or (status.state != "done" and params is not None):
        return row   # a blocked record path may be a link out of runs/: never read through it
    try:
        result = read_record_json(record)
    except RecordError:
        return row
    if not isinstance(result, dict):
        return row
    row["mode"] = result.get("mode") or mode
    if params is None and isinstance(result.get("params"), dict):
        row["params"] = result["params"]
    if status.state == "done":
        row["metrics"] = _metrics(result)
    return row


def _metrics(result: dict) -> dict:
    """The key numbers of a finished run, as its mode reports them (caramba.runners.registry)."""
    name = result.get("mode")
    mode = registry.modes().get(name) if isinstance(name, str) else None
    return mode.metrics(result) if mode is not None else {}


def _on_frontier(row: dict) -> bool:
    """Whether a report row's mode reports its runs as a quality-cost frontier (False for a mode
    not registered here: a record from elsewhere)."""
    mode = registry.modes().get(row.get("mode")) if isinstance(row.get("mode"), str) else None
    return mode is not None and mode.frontier


def report_sweep(source: Path, fmt: str, pivot_key: str | None, metric: str | None, csv_file: Path | None,
                 plot: Path | None, x_key: str | None, overrides: list[str], out: Console, err: Console) -> str | None:
    """A manifest (or its records directory) as one table: a row per run; eval runs as their frontier."""
    from rich.table import Table

    try:
        if source.is_file():
            m = load_manifest(source, overrides)
            records = [(f"{r.target}/{r.run.id}", RunDir(m.name, r.target, r.run.id).final, r.run.params,
                        run_hash(run_identity(r)), r.run.mode) for r in m.iter_runs()]
        else:
            records = [(name, path, None, None, None) for name, path in record_dirs(source)]
        locks = held_locks()   # read once: which runs another process is doing now
        rows = [sweep_row(*record, locks=locks) for record in records]
        if any(_on_frontier(r) for r in rows) and not pivot_key:   # candidates on a quality-cost frontier
            if x_key is not None:   # the frontier's axes are fixed: an --x taken and not used would lie
                raise ValueError(f"--x {x_key}: eval runs are plotted as their quality-cost frontier (bytes per "
                                 "token against quality); --x chooses a sweep plot's axis: drop it, or add --pivot "
                                 "KEY --metric NAME for a table of one metric by a matrix key")
            done = [(row["run"], record[1]) for row, record in zip(rows, records) if row["status"] == "done"]
            return _report_frontier(source, rows, done, fmt, csv_file, plot, out, err)
        metrics = list(dict.fromkeys(k for r in rows for k in r["metrics"]))
        chosen = metric or (metrics[0] if metrics else None)
        if (pivot_key or plot) and chosen is None:
            raise ValueError("no finished run has metrics to pivot or plot yet")
        if chosen is not None and chosen not in metrics and (pivot_key or plot):
            raise ValueError(f"--metric {chosen!r}: not a metric of these runs; metrics: {', '.join(metrics)}")
        table_rows = pivot(rows, pivot_key, chosen) if pivot_key else flat_rows(rows)
        if plot is not None:
            keys = list(dict.fromkeys(k for r in rows for k in r["params"]))
            x = x_key or pivot_key or (keys[0] if keys else None)
            if x is None:
                raise ValueError("--plot needs a matrix key for the x axis (--x); these runs have no params")
            plot_sweep(plot, rows, x, chosen)
            err.print(f"plot: {escape(str(plot))}")
    except (FileNotFoundError, ValueError) as e:
        raise UserError(str(e)) from None
    if csv_file is not None:
        _write_csv(csv_file, table_rows, err)
    if fmt == "json":
        print(json_text(table_rows if pivot_key else rows, indent=2))
        return None
    columns = list(dict.fromkeys(k for r in table_rows for k in r))
    if fmt == "markdown":
        counts = {}
        for r in rows:
            counts[r["status"]] = counts.get(r["status"], 0) + 1
        head = f"### caramba report: {source}" + (f" ({chosen} by {pivot_key})" if pivot_key else "")
        tally = ", ".join(f"{n} {state}" for state, n in counts.items())
        return f"{head}\n\n{len(rows)} run(s): {tally}\n\n" + markdown_table(table_rows, columns)
    title = f"{escape(str(source))}: {len(rows)} run(s)" + (f", {escape(chosen)} by {escape(pivot_key)}" if pivot_key else "")
    table = Table(title=title, title_justify="left")
    for col in columns:
        table.add_column(escape(col), overflow="fold")
    for r in table_rows:
        table.add_row(*(escape(_cell(r.get(col))) for col in columns))
    out.print(table)
    return None


def _write_csv(path: Path, rows: list[dict], err: Console) -> None:
    try:
        write_csv(path, rows)
    except OSError as e:
        raise UserError(f"--csv {path}: {e.strerror}") from None
    err.print(f"csv: {escape(str(path))}")


def _report_frontier(source: Path, rows: list[dict], done: list[tuple[str, Path]], fmt: str,
                     csv_file: Path | None, plot: Path | None, out: Console, err: Console) -> str | None:
    """Eval runs: the runs' status, then one row per candidate of the finished records that match
    the manifest, the Pareto-optimal ones marked. Returns the markdown with --format markdown."""
    from rich.table import Table

    front = frontier_rows(done)
    if plot is not None:
        if not front:
            raise UserError("no finished eval run has candidates to plot yet")
        try:
            plot_frontier(plot, front)
        except ValueError as e:
            raise UserError(str(e)) from None
        err.print(f"plot: {escape(str(plot))}")
    if csv_file is not None:
        _write_csv(csv_file, front, err)
    if fmt == "json":
        print(json_text({"runs": rows, "frontier": front, "time": _eval_time(done)}, indent=2))
        return None
    keys = list(dict.fromkeys(k for r in rows for k in r["params"]))
    status = [{"run": r["run"], "status": r["status"], "mode": r["mode"], **{k: r["params"].get(k) for k in keys}}
              for r in rows]
    lengths = list(dict.fromkeys(k for r in front for k in r if k.startswith("task_avg@")))
    weighed = cost_key(front) == "bytes_at_context"   # candidates with their own weights: a weight-format study
    columns = ["run", "cache", "policy", *(["press"] if any(r.get("press") for r in front) else []),
               *(["weights", "weight_bytes", "bytes_at_context"] if weighed else []), "bytes_per_token", "bytes_ratio",
               "task_avg", *lengths, "ppl_ratio", "kl_mean",
               "decode_tok_s", *(["bench_decode_tok_s"] if any("bench_decode_tok_s" in r for r in front) else [])]
    ordered = [{"pareto": "*" if r["pareto"] else "", **{c: r.get(c) for c in columns}}
               for r in sorted(front, key=lambda r: (r["group"], r[cost_key(front)], r["run"]))]
    title = (f"quality-cost frontier ({len(front)} candidates; * = Pareto-optimal by "
             f"{'bytes held at the context (weights + cache)' if weighed else 'bytes/token'} and "
             f"{quality_key(front) or 'no common quality metric'})")
    time_rows, time_title = _eval_time(done), ("time budget (seconds; (perplexity): its scoring; per candidate: "
                                             "its stores, questions, decode steps)")
    if fmt == "markdown":
        text = f"### caramba report: {source}\n\n" + markdown_table(status)
        text += f"\n\n{title}\n\n" + markdown_table(ordered) if front else ""
        return text + (f"\n\n{time_title}\n\n" + markdown_table(time_rows) if time_rows else "")
    for heading, table_rows in ((f"{source}: {len(rows)} run(s)", status), (title, ordered), (time_title, time_rows)):
        if not table_rows:
            continue
        table = Table(title=escape(heading), title_justify="left")
        for col in table_rows[0]:
            table.add_column("" if col == "pareto" else escape(col), overflow="fold")
        for r in table_rows:
            table.add_row(*(escape(_cell(v)) for v in r.values()))
        out.print(table)
    return None


def _eval_time(done: list[tuple[str, Path]]) -> list[dict]:
    """The eval records' time budget (caramba.runners.eval.time_rows): a row per run, one per candidate."""
    from caramba.runners.eval import time_rows

    return time_rows(done)


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return value if isinstance(value, str) else json_text(value)


def report_compare(run_dirs: list[Path], fmt: str, out: Console) -> str | None:
    """Run record directories side by side (bench cells or generate summaries), deltas against the first."""
    from rich.table import Table

    try:
        rows = compare(list(run_dirs))
    except (FileNotFoundError, ValueError) as e:
        raise UserError(str(e)) from None
    if fmt == "json":
        print(json_text(rows))
        return None
    if fmt == "markdown":
        return f"### caramba report: compared with {run_dirs[0]}\n\n" + markdown_table(rows)
    metrics = [k for k in dict.fromkeys(k for r in rows for k in r) if k not in ("run", *CELL_KEY) and not k.endswith("_delta")]
    pressed = any(r.get("press") not in (None, "none") for r in rows)
    table = Table(title=f"compared with {escape(str(run_dirs[0]))}")
    for col in ("run", "impl", "ctx", "batch", "cache", "plan", *(["press"] if pressed else []), *metrics):
        table.add_column(col)
    for r in rows:
        cells = []
        for m in metrics:
            value, delta = r.get(m), r.get(f"{m}_delta")
            text = "" if value is None else f"{value:.4g}"
            if delta is not None:
                color = "green" if (delta > 0) == (m in ("decode_tok_s", "decode_tok_s_median")) else "red"
                text += f" [{color}]({delta:+.1%})[/{color}]"
            cells.append(text)
        key = (Path(r["run"]).name, r.get("impl"), r.get("prompt_len"), r.get("batch_size"), r.get("cache_kind"),
               r.get("decode_plan") or "", *([r.get("press") or "none"] if pressed else []))
        table.add_row(*(escape(str(v)) for v in key), *cells)
    out.print(table)


def report_samples(run: Path, failed: bool, task: str | None, fmt: str, out: Console) -> None:
    """An eval record's task samples, one table each: the question, references and scoring rule,
    then every candidate's answer and score side by side (answers.json)."""
    from rich.table import Table

    path = run / "answers.json"
    if not path.is_file():
        raise UserError(f"{run}: no answers.json; `caramba report --samples` reads an eval run's record (tasks:)")
    answers = read_record_json(run, "answers.json")
    samples: dict[tuple, dict] = {}   # (task, length, index) -> the sample and each candidate's answer
    for label, rows in answers.items():
        for a in rows:
            sample = samples.setdefault((a["task"], a["length"], a["index"]), {**a, "answers": {}})
            sample["answers"][label] = {"text": a["text"], "score": a["score"]}
    chosen = [s for key, s in sorted(samples.items()) if (task is None or key[0] == task)
              and (not failed or any(v["score"] < 1 for v in s["answers"].values()))]
    if task is not None and not any(key[0] == task for key in samples):
        raise UserError(f"--task {task}: no such task in {path}; tasks: {', '.join(sorted({k[0] for k in samples}))}")
    if fmt == "json":
        print(json_text([{k: s.get(k) for k in ("task", "length", "index", "references", "metric", "question",
                                                 "context", "answers")} for s in chosen], indent=2))
        return
    for s in chosen:
        context = s.get("context") or {}
        table = Table(title=escape(f"{s['task']} @ {s['length']} #{s['index']}"), title_justify="left", show_lines=True)
        table.add_column("candidate", no_wrap=True)
        table.add_column("score", justify="right")
        table.add_column("answer", overflow="fold")
        for label, a in s["answers"].items():
            color = "green" if a["score"] >= 1 else "red" if a["score"] == 0 else "yellow"
            table.add_row(escape(label), f"[{color}]{a['score']:.2f}[/{color}]", escape(a["text"]))
        refs = s.get("references")
        table.caption = escape(f"references ({s.get('metric') or '?'}): {json_text(refs) if refs else '(not recorded)'}")
        table.caption_justify = "left"
        if context:
            out.print(f"[dim]context sha256 {context['sha256'][:16]}, {context['tokens']} tokens: "
                      f"{escape(repr(context['head'][:80]))} ... {escape(repr(context['tail'][-80:]))}[/dim]")
        if s.get("question"):
            out.print(f"[bold]question[/bold] {escape(s['question'].strip())}")
        out.print(table)
    out.print(f"{len(chosen)} of {len(samples)} sample(s)" + (" with a failed answer" if failed else ""))
