"""`mode: cache-autotune` and `cache_kind: auto`: the autotune with progress bars, its table and records."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.markup import escape
from rich.progress import Progress, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from caramba.autotune import AutotuneResult, AutotuneSettings, NoCandidateError, autotune
from caramba.autotune.gates import GateResult
from caramba.bench.report import write_csv
from caramba.infer.config import CacheConfig
from caramba.manifest.schema import CacheAutotuneSettings, GenerateSettings
from caramba.model.zoo import LoadedModel
from caramba.options import options_of
from caramba.press import PressConfig
from caramba.autotune.plans import is_under
from caramba.errors import UserError
from caramba.runners.registry import Mode, is_number, register
from caramba.runs import RunDir, runs_root

PHASES = {"text": "gates: scoring the text", "needle": "gates: needle in a haystack", "speed": "speed: decode rounds"}


@contextmanager
def progress_bars(console: Console, disable: bool = False) -> Iterator:
    """A progress(phase, done, total) callback drawing one bar per phase."""
    tasks: dict[str, Any] = {}
    with Progress(*Progress.get_default_columns(), TimeElapsedColumn(), console=console, disable=disable) as bar:
        def progress(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(PHASES.get(phase, phase), total=total)
            bar.update(tasks[phase], completed=done, total=total)
        yield progress


def run_tuned(loaded: LoadedModel, settings: AutotuneSettings, console: Console, text: str | None = None,
              plan_path: str | None = None, force: bool = False, quiet: bool = False) -> AutotuneResult:
    """autotune() with progress bars on `console` and notices (a corrupt plan file moved aside) on
    stderr; on no candidate, the table first."""
    stderr = Console(stderr=True, highlight=False)
    notice = lambda message: stderr.print(f"[yellow]warning:[/yellow] {escape(message)}", soft_wrap=True)  # noqa: E731
    try:
        with progress_bars(console, disable=quiet) as progress:
            return autotune(loaded, settings, text, plan_path, force, progress, notice)
    except NoCandidateError as e:
        if not quiet:
            print_candidates(console, e.result)
        raise


def manifest_plan_path(plan_path: str | None, field: str) -> Path | None:
    """A manifest's plan store (`autotune.plan_path`, `generate.cache_plan_path`), which must lie under
    the runs root: what a manifest writes stays there (the command line's --plan-path may name any
    file: the user typed it). UserError otherwise, before anything is read or written."""
    if plan_path is None:
        return None
    root = runs_root()
    path = Path(plan_path).expanduser()
    if not is_under(path, root) or path.resolve() == root.resolve():
        raise UserError(f"{field} {plan_path!r} is outside the runs directory {root}; what a "
                        f"manifest writes stays there: give a path such as '{root / 'plans.json'}', or leave "
                        "plan_path out for the default store (`caramba autotune --plan-path` may name any file)")
    return path


def run_cache_autotune(loaded: LoadedModel, settings: CacheAutotuneSettings, seed: int | None, record: RunDir,
                       console: Console) -> dict[str, Any]:
    result = run_tuned(loaded, settings.engine_settings(), console, settings.text,
                       manifest_plan_path(settings.plan_path, "autotune.plan_path"))
    print_candidates(console, result)
    write_csv(record.path / "candidates.csv", candidate_rows(result))
    record.log(f"plan {result.key_id} ({result.status}) in {result.plan_path}: chose {result.chosen['name']}")
    return {"mode": "cache-autotune", **result.to_dict()}


def resolve_cache_auto(loaded: LoadedModel, settings: GenerateSettings, record: RunDir,
                       console: Console) -> tuple[GenerateSettings, dict | None]:
    """`cache_kind: auto`: the settings with the plan's cache policy in place of `auto` (the stored
    plan for this model, machine, max_seq_len, batch_size and the cache_* autotune options, or a
    fresh selection), and what it resolved to for the record. Other settings pass through."""
    if settings.cache_kind != "auto":
        return settings, None
    cache = settings.engine_config().cache
    result = run_tuned(loaded, AutotuneSettings.for_cache(cache, settings.batch_size), console,
                       plan_path=manifest_plan_path(cache.auto.plan_path, "cache_plan_path"))
    policy, press = result.chosen_policy(), result.chosen_press()
    name = result.chosen["name"]
    record.log(f"cache_kind auto -> {name} (plan {result.key_id}, {result.status}, {result.plan_path})")
    console.print(f"[dim]cache_kind auto -> {name} (plan {result.key_id}, {result.status})[/dim]")
    info = {"resolved": name, "policy": policy.to_dict(), "bytes": result.chosen["bytes"], "press": press,
            "plan_key_id": result.key_id, "plan_status": result.status, "plan_path": str(result.plan_path)}
    resolved = cache.with_policy(policy, press)
    update = {opt.name: getattr(resolved, opt.attr) for opt in options_of(CacheConfig)}
    update.update({opt.name: getattr(resolved.press, opt.attr) for opt in options_of(PressConfig)})
    return settings.model_copy(update=update), info


def candidate_rows(result: AutotuneResult) -> list[dict]:
    """One flat row per candidate (the CSV)."""
    rows = []
    for c in result.candidates:
        g = c["gates"] or {}
        rows.append({"name": c["name"], "bytes": c["bytes"], "fits": c["fits"],
                     **{k: g.get(k) for k in GateResult.__dataclass_fields__ if k not in ("passed", "why")},
                     "decode_tok_s": (c["speed"] or {}).get("decode_tok_s"), "verdict": c["verdict"],
                     "why": "; ".join(c["why"]), "press": c.get("press"),
                     "kept_bytes": c.get("kept_bytes", c["bytes"])})
    return rows


def print_candidates(console, result: AutotuneResult) -> None:
    """Print the candidates table; piped output (logs, CI) is not bound to rich's 80-column guess."""
    if not console.is_terminal:  # rich guesses 80 columns for a pipe; the table needs more
        console = Console(file=console.file, width=max(console.width, 132), no_color=console.no_color)
    console.print(candidates_table(result))


def candidates_table(result: AutotuneResult) -> Group:
    """The candidates as a table (a row each), then one line per candidate that did not win
    saying why: reasons are long, and in a column they squeeze the numbers on narrow terminals."""
    k = result.key
    needle = result.needle or {}
    found = {True: "found", False: "missed", None: "n/a"}[needle.get("baseline_found")]
    table = Table(title=f"cache autotune: max_seq_len={k['max_seq_len']} batch={k['batch_size']} "
                        f"budget={k['budget_mb']:g} MiB; plan {result.key_id} ({result.status}); "
                        f"needle: baseline {found} the code", title_justify="left")
    for col in ("#", "candidate", "MiB", "dNLL", "PPL ratio", "mean KL", "needle KL", "needle", "tok/s", "verdict"):
        table.add_column(col, justify="left" if col in ("candidate", "verdict") else "right",
                         overflow="fold", no_wrap=col != "candidate")
    reasons = []
    for i, c in enumerate(result.candidates, 1):
        g = c["gates"] or {}
        speed = c["speed"]["decode_tok_s"] if c["speed"] else None
        color = {"chosen": "green", "passed": "", "over budget": "dim", "failed gates": "red", "failed speed": "red"}.get(c["verdict"], "")
        verdict = f"[{color}]{c['verdict']}[/{color}]" if color else c["verdict"]
        table.add_row(str(i), c["name"] + (" (baseline)" if c.get("baseline") else ""), f"{c['bytes'] / 2**20:.2f}",
                      _num(g.get("dnll"), "+.4f"), _num(g.get("ppl_ratio"), ".4f"), _num(g.get("kl_mean"), ".2e"),
                      _num(g.get("needle_kl"), ".2e"),
                      {True: "match", False: "differs", None: ""}[g.get("needle_match")],
                      _num(speed, ".1f"), verdict)
        if c["why"]:
            reasons.append(Text(f"#{i} {c['name']}: " + "; ".join(c["why"]), style="dim" if c["verdict"] != "chosen" else ""))
    return Group(table, *reasons)


def _num(value: float | None, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


class CacheAutotuneMode(Mode):
    """`mode: cache-autotune`: the record holds the choice, every candidate and candidates.csv."""

    name = "cache-autotune"
    columns = ("chosen", "chosen_bytes", "chosen_dnll", "chosen_kl_mean", "chosen_ppl_ratio")
    run = staticmethod(run_cache_autotune)

    def metrics(self, result: dict[str, Any]) -> dict[str, Any]:
        chosen = result.get("chosen") if isinstance(result.get("chosen"), dict) else {}
        out = {"chosen": chosen.get("name"), "chosen_bytes": chosen.get("bytes")}
        for part in (chosen, *(v for v in chosen.values() if isinstance(v, dict))):
            for key in ("dnll", "kl_mean", "ppl_ratio"):
                if is_number(part.get(key)):
                    out[f"chosen_{key}"] = part[key]
        return {k: v for k, v in out.items() if v is not None}


register(CacheAutotuneMode())
