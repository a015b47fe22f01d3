"""The `caramba` command line. Each command's docstring is its --help.

Exit codes: 0 ok, 1 a run failed, 2 bad input (manifest, option, missing file). Errors are a
short message on stderr; set CARAMBA_DEBUG=1 to see the traceback of an unexpected one.
"""

from __future__ import annotations

import inspect
import math
import os
import sys
from contextlib import contextmanager
from functools import cached_property
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperCommand
from typer.models import CommandInfo

from caramba.cli_dba import cache_bytes_per_token as _cache_bytes_per_token  # noqa: F401  (tests use the old name)
from caramba.errors import CarambaError, UserError
from caramba.runs import json_text

app = typer.Typer(
    help="caramba: run LLM inference experiments from YAML manifests.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
# Piped output (CI logs) is not bound to rich's 80-column guess: tables get room to stay readable.
# ($COLUMNS, when set, still wins: rich reads it.)
_PIPE_WIDTH = None if "COLUMNS" in os.environ else 160
out = Console(highlight=False, width=None if sys.stdout.isatty() else _PIPE_WIDTH)
err = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else _PIPE_WIDTH)


@contextmanager
def _errors_as_exit_codes():
    try:
        yield
    except CarambaError as e:
        err.print(f"[red]error:[/red] {escape(str(e))}", soft_wrap=True)  # user text is not markup
        raise typer.Exit(e.exit_code) from None
    except KeyboardInterrupt as e:   # Ctrl-C, or SIGTERM/SIGHUP during `caramba run` (caramba.executors.signals)
        from caramba.executors.signals import exit_code

        how = f"terminated by {e.args[0]}" if getattr(e, "signum", None) else "interrupted"
        err.print(f"[yellow]{how}[/yellow]: completed runs are kept; unfinished ones have no DONE marker")
        raise typer.Exit(exit_code(e)) from None
    except typer.Exit:
        raise
    except Exception as e:
        if os.environ.get("CARAMBA_DEBUG"):
            raise
        err.print(f"[red]error:[/red] {type(e).__name__}: {escape(str(e))} (CARAMBA_DEBUG=1 shows the traceback)", soft_wrap=True)
        raise typer.Exit(1) from None


def _load(manifest: Path, overrides: list[str]):
    from caramba.manifest import load_manifest

    return load_manifest(manifest, overrides)


class _DerivedFlags(TyperCommand):
    """A command whose flags are derived from the engine's option definitions (generate's from
    GenerateConfig, eval's from CacheConfig), which import torch (~2 s): `caramba --help` lists it
    by its help alone, and the whole command is built (`build`) when it parses its arguments, to
    run or to print its own --help, or is asked for its flags."""

    build: Callable[[], TyperCommand]

    @cached_property
    def whole(self) -> TyperCommand:
        return self.build()

    @property
    def params(self) -> list:
        return self.whole.params

    @params.setter
    def params(self, value: list) -> None:   # the stand-in's own (none): the whole command's replace them
        pass

    def make_context(self, info_name, args, parent=None, **extra):
        return self.whole.make_context(info_name, args, parent, **extra)


def _command_with_derived_flags(name: str, signature: Callable[[], inspect.Signature]):
    """app.command(name) for a function taking its derived flags as **kwargs: signature() gives
    its whole signature (importing the engine), called only when the command is built."""
    def register(function):
        def build() -> TyperCommand:
            def command(**kwargs):
                return function(**kwargs)

            command.__signature__ = signature()
            info = CommandInfo(name, callback=command, help=inspect.getdoc(function))
            return typer.main.get_command_from_info(info, pretty_exceptions_short=app.pretty_exceptions_short,
                                                    rich_markup_mode=app.rich_markup_mode)

        stand_in = type(f"{function.__name__}_command", (_DerivedFlags,), {"build": staticmethod(build)})
        app.command(name, cls=stand_in, help=inspect.getdoc(function))(lambda: None)   # never run: whole's is
        return function
    return register


# The model options every command that loads a model shares.
ModelOption = Annotated[str, typer.Option(help="smollm2-135m, a .gguf file or an HF directory.")]
DtypeOption = Annotated[str, typer.Option(help="float32, bfloat16 or float16.")]
DeviceOption = Annotated[str, typer.Option(help="cpu, cuda, mps or auto.")]
WeightsOption = Annotated[str, typer.Option(help="fp32, q8_0 or q4_0 (llama.cpp's 8- and 4-bit blocks), native (a GGUF's own blocks) or native_i16 (the same, int16-rounded activations: ~1.2x faster, not exact).")]

@app.command()
def run(
    manifest: Annotated[Path, typer.Argument(help="The manifest YAML file.")],
    run_ids: Annotated[Optional[list[str]], typer.Option("--run", help="Only these runs: an id, target/id, a glob ('sweep.*') or a sweep's base id; repeatable.")] = None,
    overrides: Annotated[Optional[list[str]], typer.Option("--set", help="Override a field: targets.NAME.runs.ID.generate.temperature=0.7")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Validate and list the runs (a sweep's expanded), write nothing.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Rerun runs that already have a DONE record.")] = False,
    check: Annotated[bool, typer.Option("--check", help="Compare each run's result with its expect: block; exit 1 on drift.")] = False,
    executor: Annotated[str, typer.Option(help="local (this machine), ray (pip extra 'ray') or slurm (pip extra 'slurm': submitit).")] = "local",
    jobs: Annotated[Optional[int], typer.Option("--jobs", min=1, help="Runs at once: local worker processes (each with cores/N threads), or the most tasks ray/slurm run at once.")] = None,
    ray_address: Annotated[Optional[str], typer.Option(help="Join this Ray cluster (default: start a local Ray).")] = None,
    junit_xml: Annotated[Optional[Path], typer.Option("--junit-xml", help="Also write JUnit XML here: one testcase per run, a failed check as its failure (for CI).")] = None,
    track: Annotated[Optional[str], typer.Option("--track", help="Also log each run finished to mlflow or wandb (pip extra 'tracking'; settings in the manifest's tracking:); off: not even the manifest's.")] = None,
) -> None:
    """Validate a manifest and run its runs, leaving a record of each under runs/.

    A run with a matrix: runs once per combination (docs/sweeps.md). With --jobs N (or
    --executor ray/slurm) runs go to parallel workers, each run one task; a failed run does not
    stop the others, and a summary table ends the sweep. With --check, every selected run's
    result (fresh, or the DONE record being skipped) is compared with the run's `expect:` block;
    a drift is printed and the exit code is 1. --junit-xml PATH writes every selected run as a
    JUnit testcase (CI systems show each run as a test)."""
    from caramba.executors.signals import interrupt_on_signals

    with _errors_as_exit_codes(), interrupt_on_signals():
        from caramba.executors import require
        from caramba.runners import command_line, run_manifest

        require(executor)
        if ray_address and executor != "ray":
            raise UserError("--ray-address is for --executor ray")
        if junit_xml is not None:
            _check_output_path(junit_xml, "--junit-xml", [manifest])
        m = _load(manifest, overrides or [])
        tracking = _tracking(m, track)
        command = command_line(str(manifest), run_ids or [], overrides or [], force, check)
        if dry_run or (executor == "local" and (jobs or 1) == 1):
            outcome = run_manifest(m, run_ids or [], force=force, dry_run=dry_run, console=out, check=check,
                                   overrides=overrides or [], command=command)
            if dry_run:
                from caramba.runners import select_runs

                err.print(f"{len(select_runs(m, run_ids or []))} run(s); nothing written")
                return
            checked = f", {len(outcome.check_failed)} failed their check" if check else ""
            busy = f", {len(outcome.busy)} left to another process running them" if outcome.busy else ""
            took = f" in {sum(outcome.seconds.values()):.1f}s" if outcome.seconds else ""
            err.print(f"{len(outcome.done)} done, {len(outcome.skipped)} skipped{busy}, {len(outcome.failed)} failed{checked}{took}")
            failed, done = outcome.failed or outcome.check_failed, outcome.done
            if junit_xml is not None:
                _write_junit(junit_xml, m, run_ids or [], _serial_cases(outcome))
        else:
            failed, done = _run_parallel(m, run_ids or [], force, check, overrides or [], command, executor, jobs,
                                         ray_address, junit_xml)
        _track(m, tracking, run_ids or [], done)
        if failed:
            raise typer.Exit(1)


def _tracking(m, track: str | None):
    """The tracker runs are logged to: the manifest's tracking:, its backend replaced by --track."""
    from caramba.manifest.schema import TrackingSettings

    if track not in (None, "mlflow", "wandb", "off"):
        raise UserError(f"--track {track}: use mlflow, wandb or off")
    if track is None or track == "off":
        return m.tracking if track is None else None
    return (m.tracking or TrackingSettings()).model_copy(update={"backend": track})


def _track(m, settings, run_ids: list[str], done: list[str]) -> None:
    """The runs this command finished, logged to the tracker from their records; a tracker that
    fails is one warning (the records are complete, the runs done)."""
    if settings is None or not done:
        return
    from caramba import tracking
    from caramba.runners import select_runs
    from caramba.runs import RunDir, runs_root

    finished = [tracking.Finished(f"{r.target}/{r.run.id}", RunDir(m.name, r.target, r.run.id).final, r.run.mode,
                                  tracking.settings_of(r), r.run.params is not None)
                for r in select_runs(m, run_ids) if f"{r.target}/{r.run.id}" in done]
    problem = tracking.log_runs(settings, m.name, finished, runs_root())
    if problem:
        err.print(f"[yellow]warning: tracking ({settings.backend}) failed; the runs and their records are done: "
                  f"{escape(problem)}[/yellow]", soft_wrap=True)
    else:
        err.print(f"tracked {len(finished)} run(s) in {settings.backend}")


def _check_output_path(path: Path, option: str, inputs: Sequence[Path] = ()) -> None:
    """An output file the user named: its directory must exist and take files, and it must not
    land on a record (_outside_records); exit 2 otherwise (before any work, naming the path the
    user gave)."""
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise UserError(f"{option} {path}: is a directory; give a file path")
    _outside_records(path, option, inputs)
    if not parent.is_dir():
        raise UserError(f"{option} {path}: the directory {parent} does not exist; create it or choose another path")
    if not os.access(parent, os.W_OK):
        raise UserError(f"{option} {path}: the directory {parent} is not writable")


def _outside_records(path: Path, option: str, inputs: Sequence[Path] = ()) -> None:
    """The one guard for everything caramba writes outside a record (report --csv/--plot, the
    step summary, --junit-xml, convert-dba --out): never under the runs directory, where only
    records are written, nor onto this command's inputs (a manifest, a records directory given
    to report). Links are followed: a path that reaches a record through one is refused too."""
    from caramba.runs import runs_root

    def real(p: Path) -> Path:
        try:
            return p.resolve()
        except (OSError, RuntimeError):   # a loop of links: as written
            return p.absolute()

    target = real(path)
    root = runs_root()
    if target.is_relative_to(real(root)):
        raise UserError(f"{option} {path}: inside the runs directory {root}, where only run records are written "
                        "(a file there could replace or damage one); choose a path outside it")
    for given in inputs:
        if target.is_relative_to(real(given)):
            raise UserError(f"{option} {path}: this would write over {given}, an input of this command "
                            "(a manifest, or records being read); choose a path outside it")


def _serial_cases(outcome) -> dict:
    from caramba.junit import Case

    cases = {}
    for status, names in (("done", outcome.done), ("skipped", outcome.skipped), ("failed", outcome.failed),
                          ("busy", outcome.busy)):
        for name in names:
            cases[name] = Case(name, status, outcome.seconds.get(name, 0.0), outcome.messages.get(name, ""),
                               outcome.checks.get(name, []))
    return cases


def _write_junit(path: Path, m, run_ids: list[str], cases: dict) -> None:
    from caramba.junit import Case, write_junit
    from caramba.runners import select_runs

    names = [f"{r.target}/{r.run.id}" for r in select_runs(m, run_ids)]
    try:
        write_junit(path, m.name, [cases.get(n) or Case(n, "cancelled") for n in names])
    except OSError as e:
        raise UserError(f"--junit-xml {path}: {e.strerror}") from None
    err.print(f"junit: {escape(str(path))}")


def _run_parallel(m, run_ids, force, check, overrides, command, executor, jobs, ray_address,
                  junit_xml=None) -> tuple[bool, list[str]]:
    from caramba.executors import make_executor
    from caramba.executors.common import run_sweep
    from caramba.junit import Case
    from caramba.runners import make_tasks, preflight, select_runs

    runs = select_runs(m, run_ids)
    preflight(m.name, runs)   # every run checked before any record is written
    tasks = make_tasks(m, runs, force, check, {"command": command, "overrides": overrides})
    result = run_sweep(make_executor(executor, jobs, m.executor, ray_address), tasks, out)
    checked = f", {len(result.check_failed)} failed their check" if check else ""
    busy = f", {len(result.names('busy'))} left to another process running them" if result.names("busy") else ""
    err.print(f"{len(result.names('done'))} done, {len(result.names('skipped'))} skipped{busy}, "
              f"{len(result.names('failed'))} failed{checked}")
    if junit_xml is not None:
        _write_junit(junit_xml, m, run_ids, {n: Case(n, r.status, max(0.0, r.ended - r.started) if r.ended else 0.0,
                                                     r.message, r.checks) for n, r in result.results.items()})
    return bool(result.names("failed") or result.check_failed), result.names("done")


@app.command()
def status(
    manifest: Annotated[Path, typer.Argument(help="The manifest YAML file.")],
    run_ids: Annotated[Optional[list[str]], typer.Option("--run", help="Only these runs (ids, target/id or globs).")] = None,
    overrides: Annotated[Optional[list[str]], typer.Option("--set", help="Override a field, as for run.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print a list of {run, state, record, detail, params}.")] = False,
) -> None:
    """Where each run of a manifest stands: done, changed (its record was made with other
    settings: the next run redoes it), damaged (its files no longer match the digests in DONE:
    the next run redoes it), blocked (its record path or lock is a link, a FIFO or a file
    caramba will not use: remove it), running (another process holds its lock), failed (an
    attempt without DONE, or a killed one) or pending. Reads records and locks; takes no lock."""
    with _errors_as_exit_codes():
        from rich.table import Table

        from caramba.executors.state import STATES, held_locks, run_state
        from caramba.runners import run_hash, run_identity, select_runs
        from caramba.runs import RunDir

        m = _load(manifest, overrides or [])
        locks = held_locks()
        runs = select_runs(m, run_ids or [])
        states = [(r, run_state(RunDir(m.name, r.target, r.run.id), run_hash(run_identity(r)), locks)) for r in runs]
        if as_json:
            print(json_text([{"run": f"{r.target}/{r.run.id}", "state": s.state, "record": str(s.record),
                              "detail": s.detail, "params": r.run.params} for r, s in states], indent=2))
            return
        table = Table(title=f"{escape(m.name)}: {len(runs)} run(s)", title_justify="left")
        for col in ("run", "state", "detail"):
            table.add_column(col, overflow="fold")
        colors = {"done": "green", "changed": "yellow", "damaged": "red", "blocked": "red", "running": "cyan",
                  "failed": "red", "pending": "dim"}
        for r, s in states:
            table.add_row(escape(f"{r.target}/{r.run.id}"), f"[{colors[s.state]}]{s.state}[/{colors[s.state]}]",
                          escape(s.detail))
        out.print(table)
        counts = {state: sum(s.state == state for _, s in states) for state in STATES}
        out.print(", ".join(f"{n} {state}" for state, n in counts.items()))


@app.command()
def validate(
    manifest: Annotated[Path, typer.Argument(help="The manifest YAML file.")],
    overrides: Annotated[Optional[list[str]], typer.Option("--set", help="Override a field before validating.")] = None,
) -> None:
    """Check a manifest against the schema without running anything."""
    with _errors_as_exit_codes():
        m = _load(manifest, overrides or [])
        runs = list(m.iter_runs())
        out.print(f"[green]ok[/green] {escape(str(manifest))}: {len(runs)} run(s): "
                  + escape(", ".join(f"{r.target}/{r.run.id}" for r in runs)))


def _generate_signature() -> inspect.Signature:
    # lazy: the flags come from GenerateConfig, which imports torch (~2 s); `caramba --help` needs none of it
    from caramba.cli_generate import signature

    return signature(WeightsOption.__metadata__[0].help)


@_command_with_derived_flags("generate", _generate_signature)
def _generate(prompt: str, model: str, dtype: str, device: str, weights: str, seed: Optional[int], chat: bool, system: Optional[str],
              as_json: bool, speculative: Optional[str], draft: Optional[str], overrides: Optional[list[str]],
              **options) -> None:
    """Generate a continuation of PROMPT, streaming it to the terminal (greedy unless --temperature).

    Every option of a manifest's generate: section is a flag here, with '-' for '_'. --set reaches
    anything else below the run: model.dtype=bfloat16, or an option as decode_q_chunk=512.

    The flags become a one-run manifest, checked and run like `caramba run`'s; nothing is written."""
    with _errors_as_exit_codes():
        from caramba.cli_generate import generate

        generate(prompt, model, dtype, device, weights, seed, chat, system, as_json, speculative, draft, overrides or [],
                 options, out, err)


@app.command()
def bench(
    model: ModelOption = "smollm2-135m",
    dtype: DtypeOption = "float32",
    device: DeviceOption = "cpu",
    weights: WeightsOption = "fp32",
    prompt_lens: Annotated[str, typer.Option(help="Context lengths, comma-separated.")] = "128,512,2048",
    batch_sizes: Annotated[str, typer.Option(help="Batch sizes, comma-separated.")] = "1",
    cache_kinds: Annotated[str, typer.Option(help="KV cache kinds, comma-separated.")] = "fp32",
    decode_plans: Annotated[str, typer.Option(help="Decode plans, ';'-separated: none, auto, chunk=N, window=W, chunk=N,window=W.")] = "none",
    presses: Annotated[str, typer.Option(help="KV presses, comma-separated: none, METHOD@RATIO, ada_METHOD@RATIO, METHOD@RATIO/INTERVAL:TARGET (decoding-time compression) (e.g. none,snapkv@0.5,knorm@0/64:512).")] = "none",
    new_tokens: Annotated[int, typer.Option(help="Tokens generated per repeat (first = prefill).")] = 32,
    warmup: Annotated[int, typer.Option(help="Unmeasured runs per cell.")] = 1,
    repeats: Annotated[int, typer.Option(help="Measured runs per cell.")] = 3,
    reference: Annotated[str, typer.Option(help="none, or hf: the same cells through transformers.")] = "none",
    text: Annotated[Optional[Path], typer.Option(help="Prompt text file (default: the bundled corpus).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the cells as JSON.")] = False,
) -> None:
    """Measure prefill and decode latency, throughput and memory over a grid of cells.

    The record (result.json, cells.csv, plots) goes to runs/bench/cli/<UTC time>/ (<UTC time>-2, ...
    when another bench started in the same second)."""
    with _errors_as_exit_codes():
        from caramba.cli_bench import bench as run_bench
        from caramba.cli_bench import bench_settings

        settings = bench_settings(prompt_lens, batch_sizes, cache_kinds, decode_plans, str(text) if text else None,
                                  new_tokens=new_tokens, warmup=warmup, repeats=repeats, reference=reference,
                                  presses=[p.strip() for p in presses.split(",") if p.strip()])
        run_bench({"source": model, "dtype": dtype, "device": device, "weights": weights}, settings, as_json, out, err)


@app.command()
def report(
    run_dirs: Annotated[list[Path], typer.Argument(help="A manifest (or its records directory runs/NAME): one row per run. Or run record directories: compared with the first.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the rows as JSON (a sweep: a list of {run, params, metrics}).")] = False,
    pivot_key: Annotated[Optional[str], typer.Option("--pivot", help="Put this matrix key's values across the columns (of --metric).")] = None,
    metric: Annotated[Optional[str], typer.Option(help="The metric for --pivot and --plot (default: the runs' first).")] = None,
    csv_file: Annotated[Optional[Path], typer.Option("--csv", help="Also write the rows to this CSV file.")] = None,
    plot: Annotated[Optional[Path], typer.Option(help="Write a PNG of --metric against matrix key --x (needs matplotlib).")] = None,
    x_key: Annotated[Optional[str], typer.Option("--x", help="The matrix key on the plot's x axis (default: --pivot, else the first).")] = None,
    overrides: Annotated[Optional[list[str]], typer.Option("--set", help="Override a field of the manifest, as for run.")] = None,
    fmt: Annotated[str, typer.Option("--format", help="table, json or markdown (markdown is also appended to $GITHUB_STEP_SUMMARY when that is set).")] = "table",
    samples: Annotated[bool, typer.Option("--samples", help="An eval run's record: each task sample's question and references, every candidate's answer and score beside them.")] = False,
    failed: Annotated[bool, typer.Option("--failed", help="With --samples: only samples some candidate did not answer fully.")] = False,
    task: Annotated[Optional[str], typer.Option("--task", help="With --samples: only this task's samples.")] = None,
) -> None:
    """A sweep as one table: every run of a manifest as a row, its matrix values as columns, then
    the key metrics of its mode (decode tok/s, prefill, peak memory, cache bytes, acceptance,
    speedup, the autotuned cache). Only finished records that match the manifest show metrics:
    a run whose record was made with other settings is `changed`, one whose files no longer
    match DONE's digests `damaged`, one whose worker died `failed`. Given run record directories
    instead, compares them (bench cells or generate summaries) side by side, with deltas
    against the first. With --samples RUN (an eval run's record), its task samples, for a person
    to check the scores by eye."""
    with _errors_as_exit_codes():
        if fmt not in ("table", "json", "markdown"):
            raise UserError(f"--format {fmt!r}: choose table, json or markdown")
        fmt = "json" if as_json else fmt
        if samples or failed or task is not None:
            if not samples or len(run_dirs) != 1 or fmt == "markdown":
                raise UserError("--failed and --task go with --samples RUN: one eval run's record, as a table or --json")
            from caramba.cli_report import report_samples

            report_samples(run_dirs[0], failed, task, fmt, out)
            return
        for path, option in ((csv_file, "--csv"), (plot, "--plot")):
            if path is not None:
                _check_output_path(path, option, run_dirs)
        summary = os.environ.get("GITHUB_STEP_SUMMARY") if fmt == "markdown" else None
        if summary:
            _check_output_path(Path(summary), "$GITHUB_STEP_SUMMARY", run_dirs)
        from caramba.cli_report import report_compare, report_sweep

        single = run_dirs[0] if len(run_dirs) == 1 else None
        if single is not None and (single.is_file() or not (single / "result.json").exists()):
            text = report_sweep(single, fmt, pivot_key, metric, csv_file, plot, x_key, overrides or [], out, err)
        else:
            text = report_compare(run_dirs, fmt, out)
        if text is not None:   # markdown
            sys.stdout.write(text)
            if summary:
                try:
                    with open(summary, "a", encoding="utf-8") as file:
                        file.write(text + "\n")
                except OSError as e:
                    raise UserError(f"$GITHUB_STEP_SUMMARY {summary}: {e.strerror}") from None


@app.command("convert-dba")
def convert_dba(
    out_dir: Annotated[Path, typer.Option("--out", help="Directory to write (config.json, model.safetensors, tokenizer).")],
    sem_dim: Annotated[int, typer.Option(min=1, help="Semantic (no-RoPE) query/key channels per head.")],
    geo_dim: Annotated[int, typer.Option(min=2, help="Geometric (RoPE) channels per head: even, kept exact.")],
    model: Annotated[str, typer.Option(help="The standard model: smollm2-135m, a .gguf file or an HF directory.")] = "smollm2-135m",
    calib_text: Annotated[Optional[Path], typer.Option(help="Calibration text for the SVD's input statistics (default: caramba's corpus from token 2048 on, which no eval window in the docs reaches).")] = None,
    calib_tokens: Annotated[int, typer.Option(min=0, help="Calibration tokens (0: no data, weigh inputs by the norm weights only).")] = 2048,
    force: Annotated[bool, typer.Option("--force", help="Replace --out if it exists.")] = False,
) -> None:
    """Convert a standard RoPE checkpoint into decoupled (DBA) attention: per head, the
    --geo-dim/2 fastest RoPE pairs keep exact RoPE (geometric path); the slower rest lose it and
    are compressed to --sem-dim channels by a truncated SVD of each head's query-key form,
    weighted by the attention inputs' statistics on calibration text (semantic path).

    The result loads like any model: caramba generate/eval --model DIR. docs/kv-cache.md says
    what is approximated."""
    with _errors_as_exit_codes():
        from caramba.cli_dba import convert

        _outside_records(out_dir, "--out")   # --force replaces it: never a record
        convert(out_dir, sem_dim, geo_dim, model, calib_text, calib_tokens, force, out, err)


def _eval_signature() -> inspect.Signature:
    """eval_cache's flags with the candidates' shared cache settings after --press."""
    # lazy: those flags come from CacheConfig, which imports torch (~2 s); `caramba --help` needs none of it
    from caramba.cli_eval import candidate_params

    params = [p.replace(kind=p.KEYWORD_ONLY) for p in inspect.signature(eval_cache, eval_str=True).parameters.values()
              if p.kind != p.VAR_KEYWORD]
    at = [p.name for p in params].index("press") + 1
    return inspect.Signature(params[:at] + candidate_params() + params[at:])


@_command_with_derived_flags("eval", _eval_signature)
def eval_cache(
    text: Annotated[Optional[Path], typer.Option(help="Text file to score (default: caramba's bundled corpus).")] = None,
    model: ModelOption = "smollm2-135m",
    dtype: DtypeOption = "float32",
    device: DeviceOption = "cpu",
    weights: WeightsOption = "fp32",
    cache_kind: Annotated[Optional[list[str]], typer.Option(help="Candidate cache kind; repeatable.")] = None,
    cache_policy: Annotated[Optional[list[str]], typer.Option(help="Candidate per-stream policy, e.g. k=q8_0,v=q4_0; repeatable.")] = None,
    baseline: Annotated[str, typer.Option(help="The reference cache kind.")] = "fp32",
    press: Annotated[Optional[list[str]], typer.Option(
        "--press", help="A KV press as candidates too: on every candidate's kind and alone on the baseline's; "
                        "METHOD@RATIO (snapkv@0.5, ada_tova@0.25) or METHOD@RATIO/INTERVAL:TARGET (decoding-time "
                        "compression, knorm@0/64:512); repeatable; needs --tasks (docs/kv-cache.md#presses).")] = None,
    perplexity: Annotated[bool, typer.Option("--perplexity/--no-perplexity",
                                             help="Score the text's perplexity (--protocol).")] = True,
    protocol: Annotated[str, typer.Option(help="decode: prefill --prompt-len tokens, then score token by token "
                                               "through the cache; chunks: llama-perplexity's non-overlapping "
                                               "--ctx windows, each scored on its second half.")] = "decode",
    ctx: Annotated[int, typer.Option(min=4, help="Window size of --protocol chunks (llama-perplexity -c).")] = 512,
    prompt_len: Annotated[int, typer.Option(min=1, help="Tokens prefilled before token-by-token scoring (decode).")] = 256,
    max_tokens: Annotated[Optional[int], typer.Option(min=2, help="Use only the text's first N tokens "
                                                      "(default: 1024 for decode, the whole text for chunks).")] = None,
    tasks: Annotated[Optional[str], typer.Option(help="Long-context tasks to answer: 'all' or a comma list "
                                                      "(niah_single,vt,...; docs/eval.md).")] = None,
    lengths: Annotated[str, typer.Option(help="Context lengths of --tasks in the model's tokens, comma-separated.")] = "1024,2048",
    samples: Annotated[int, typer.Option(min=1, help="Samples per task and length.")] = 8,
    seed: Annotated[int, typer.Option(min=0, help="Seed of the task samples.")] = 0,
    overrides: Annotated[Optional[list[str]], typer.Option("--set", help="Override a field below the run, e.g. eval.tasks.prefill=own.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
    **shared,   # the cache settings every candidate shares (--qblock, ...): _eval_signature
) -> None:
    """Score candidate KV caches against a baseline cache: a text's NLL/PPL, KL(baseline ||
    candidate) and top-1 agreement, and with --tasks the long-context task suite (RULER's
    retrieval, tracing and aggregation tasks), as a one-run `mode: eval` manifest.

    --protocol decode (default): the first --prompt-len tokens are prefilled; each later token is
    fed one at a time through the cache, as generation does. --protocol chunks --ctx 512: as
    llama.cpp's perplexity tool, with the PPL's standard error. Candidates: each --cache-kind and
    --cache-policy (default q8_0). `caramba eval --tasks all --no-perplexity` runs the task suite;
    `--press snapkv@0.5` adds each candidate pressed and the press alone (the task's context is
    pressed before its question)."""
    with _errors_as_exit_codes():
        from caramba.cli_eval import SHARED_CACHE_OPTIONS, eval_command

        shared = {name: shared[name] for name in SHARED_CACHE_OPTIONS}   # in one order, whatever order they were typed in
        eval_command({"source": model, "dtype": dtype, "device": device, "weights": weights}, text, cache_kind or [],
                     cache_policy or [], baseline, shared, presses=press or [], perplexity=perplexity, protocol=protocol, ctx=ctx,
                     prompt_len=prompt_len, max_tokens=max_tokens, tasks=tasks, lengths=lengths, samples=samples,
                     seed=seed, overrides=overrides or [], as_json=as_json, out=out, err=err)


@app.command()
def autotune(
    budget_mb: Annotated[float, typer.Option(help="MiB for the whole KV cache (all layers, K+V, the batch).")],
    model: ModelOption = "smollm2-135m",
    dtype: DtypeOption = "float32",
    device: DeviceOption = "cpu",
    weights: WeightsOption = "fp32",
    max_seq_len: Annotated[int, typer.Option(min=2, help="Context length the cache is sized and timed for.")] = 2048,
    batch_size: Annotated[int, typer.Option(min=1, help="Rows the cache is sized and timed for.")] = 1,
    text: Annotated[Optional[Path], typer.Option(help="Gate text file (default: caramba's bundled corpus).")] = None,
    plan_path: Annotated[Optional[Path], typer.Option(help="The plan store (default: runs/cache_plans.json). A file that is not a plan store is never overwritten.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Measure again even when a fresh plan is stored.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object with chosen and candidates.")] = False,
    presses: Annotated[str, typer.Option(help="KV presses to try as candidates too, comma-separated, each alone and "
                                              "with q8_0 / q4_0 (keys q8_0, rotated): METHOD@RATIO or METHOD@RATIO/INTERVAL:TARGET "
                                              "(e.g. snapkv@0.5,knorm@0/64:512). Default none.")] = "none",
) -> None:
    """Choose the KV cache for a memory budget: budget filter, quality gates, speed pick.

    Candidates over the budget are dropped; the rest are scored against the model dtype's
    full-precision cache on real text (dNLL, PPL ratio, mean KL, needle in a haystack) and the
    passing ones timed at the target context; the fastest wins (ties: fewer bytes). The choice is
    stored in the plan file and reused by later runs and by `cache_kind: auto`. Exit 2 when nothing
    fits the budget or passes the gates. See docs/autotune.md."""
    with _errors_as_exit_codes():
        from caramba.autotune import AutotuneSettings
        from caramba.model.zoo import load_model
        from caramba.runners.autotune import print_candidates, run_tuned

        if text is not None:
            from caramba.runners.preflight import check_text

            check_text(text, "--text")
        if not (math.isfinite(budget_mb) and budget_mb > 0):
            raise UserError(f"--budget-mb {budget_mb}: give a finite number of MiB > 0")
        try:   # checked before the model loads
            settings = AutotuneSettings(budget_mb=budget_mb, max_seq_len=max_seq_len, batch_size=batch_size,
                                        presses=tuple(p.strip() for p in presses.split(",") if p.strip()))
        except ValueError as e:
            raise UserError(f"--presses: {e}") from None
        loaded = load_model(model, dtype, device, progress=not as_json, weights=weights)
        result = run_tuned(loaded, settings, err if as_json else out, text, plan_path, force, quiet=as_json)
        if as_json:
            print(json_text(result.to_dict()))
            return
        print_candidates(out, result)
        out.print(f"chosen: [bold]{escape(result.chosen['name'])}[/bold] ({result.chosen['bytes'] / 2**20:.2f} MiB); "
                  f"plan {result.key_id} in {escape(str(result.plan_path))}")


plans_app = typer.Typer(help="The stored cache plans (runs/cache_plans.json).", no_args_is_help=True)
app.add_typer(plans_app, name="plans")
PlanPathOption = Annotated[Optional[Path], typer.Option("--plan-path", help="The plan store (default: runs/cache_plans.json).")]


def _plan_store(plan_path: Path | None):
    from caramba.autotune import PlanStore

    return PlanStore(plan_path, notice=lambda message: err.print(f"[yellow]warning:[/yellow] {escape(message)}", soft_wrap=True))


@plans_app.command("list")
def plans_list(plan_path: PlanPathOption = None, as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """One line per stored plan: id, model, machine, settings, the chosen cache, age."""
    with _errors_as_exit_codes():
        from rich.table import Table

        store = _plan_store(plan_path)
        plans = store.all()
        if as_json:
            print(json_text(plans))
            return
        table = Table(title=f"{len(plans)} plan(s) in {escape(str(store.path))}", title_justify="left")
        for col in ("id", "model", "dtype", "device", "max_seq_len", "batch", "budget MiB", "chosen", "created"):
            table.add_column(col, no_wrap=col == "id", overflow="fold")
        for pid, p in plans.items():
            k = p["key"]
            cells = (pid, str(k.get("model_sha256"))[:12], k.get("dtype"), f"{k.get('device')} ({k.get('device_name')})",
                     k.get("max_seq_len"), k.get("batch_size"), _g(k.get("budget_mb")), p["chosen"].get("name"),
                     p.get("created_utc"))
            table.add_row(*(escape(str(c)) for c in cells))  # the store is a file: its text is not markup
        out.print(table)


def _g(value) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) else str(value)


@plans_app.command("show")
def plans_show(plan_id: Annotated[str, typer.Argument(help="A plan id (or its first characters).")],
               plan_path: PlanPathOption = None) -> None:
    """Print one plan as JSON: its key, the chosen cache and every candidate's bytes, gates and speed."""
    with _errors_as_exit_codes():
        plans = _plan_store(plan_path).all()
        found = [p for pid, p in plans.items() if pid.startswith(plan_id)]
        if len(found) != 1:
            raise UserError(f"plan id {plan_id!r} matches {len(found)} plans; `caramba plans list` shows the ids")
        print(json_text(found[0], indent=2))


@plans_app.command("clear")
def plans_clear(plan_ids: Annotated[Optional[list[str]], typer.Argument(help="Plan ids to drop (default: all).")] = None,
                plan_path: PlanPathOption = None) -> None:
    """Drop stored plans (all of them, or the ids given); the next autotune measures again."""
    with _errors_as_exit_codes():
        if plan_ids is not None and not all(i.strip() for i in plan_ids):
            raise UserError("an empty plan id would match every plan; give ids from `caramba plans list`, "
                            "or no id to clear them all")
        store = _plan_store(plan_path)
        gone = store.remove(plan_ids or None)
        if plan_ids and not gone:
            raise UserError(f"no plan matches {', '.join(plan_ids)}; `caramba plans list` shows the ids")
        err.print(f"removed {len(gone)} plan(s) from {escape(str(store.path))}")


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
