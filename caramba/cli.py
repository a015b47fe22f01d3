"""The `caramba` command line. Each command's docstring is its --help.

Exit codes: 0 ok, 1 a run failed, 2 bad input (manifest, option, missing file). Errors are a
short message on stderr; set CARAMBA_DEBUG=1 to see the traceback of an unexpected one.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from caramba.errors import CarambaError, UserError

app = typer.Typer(
    help="caramba: run LLM inference experiments from YAML manifests.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


@contextmanager
def _errors_as_exit_codes():
    try:
        yield
    except CarambaError as e:
        err.print(f"[red]error:[/red] {e}", soft_wrap=True)
        raise typer.Exit(e.exit_code) from None
    except KeyboardInterrupt:
        err.print("[yellow]interrupted[/yellow]: completed runs are kept; unfinished ones have no DONE marker")
        raise typer.Exit(130) from None
    except typer.Exit:
        raise
    except Exception as e:
        if os.environ.get("CARAMBA_DEBUG"):
            raise
        err.print(f"[red]error:[/red] {type(e).__name__}: {e} (CARAMBA_DEBUG=1 shows the traceback)", soft_wrap=True)
        raise typer.Exit(1) from None


def _load(manifest: Path, overrides: list[str]):
    from caramba.manifest import load_manifest

    return load_manifest(manifest, overrides)


@app.command()
def run(
    manifest: Annotated[Path, typer.Argument(help="The manifest YAML file.")],
    run_ids: Annotated[Optional[list[str]], typer.Option("--run", help="Only this run (id or target/id); repeatable.")] = None,
    overrides: Annotated[Optional[list[str]], typer.Option("--set", help="Override a field: targets.NAME.runs.ID.generate.temperature=0.7")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Validate and list the runs, write nothing.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Rerun runs that already have a DONE record.")] = False,
    check: Annotated[bool, typer.Option("--check", help="Compare each run's result with its expect: block; exit 1 on drift.")] = False,
) -> None:
    """Validate a manifest and run its runs, leaving a record of each under runs/.

    With --check, every selected run's result (fresh, or the DONE record being skipped) is
    compared with the run's `expect:` block; a drift is printed and the exit code is 1."""
    with _errors_as_exit_codes():
        from caramba.runners import run_manifest

        m = _load(manifest, overrides or [])
        outcome = run_manifest(m, run_ids or [], force=force, dry_run=dry_run, console=out, check=check)
        if not dry_run:
            checked = f", {len(outcome.check_failed)} failed their check" if check else ""
            err.print(f"{len(outcome.done)} done, {len(outcome.skipped)} skipped, {len(outcome.failed)} failed{checked}")
        if outcome.failed or outcome.check_failed:
            raise typer.Exit(1)


@app.command()
def validate(
    manifest: Annotated[Path, typer.Argument(help="The manifest YAML file.")],
    overrides: Annotated[Optional[list[str]], typer.Option("--set", help="Override a field before validating.")] = None,
) -> None:
    """Check a manifest against the schema without running anything."""
    with _errors_as_exit_codes():
        m = _load(manifest, overrides or [])
        runs = list(m.iter_runs())
        out.print(f"[green]ok[/green] {manifest}: {len(runs)} run(s): " + ", ".join(f"{r.target}/{r.run.id}" for r in runs))


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="The prompt text.")],
    model: Annotated[str, typer.Option(help="smollm2-135m, a .gguf file or an HF directory.")] = "smollm2-135m",
    dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float16.")] = "float32",
    device: Annotated[str, typer.Option(help="cpu, cuda, mps or auto.")] = "cpu",
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 64,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy.")] = 0.0,
    top_k: Annotated[Optional[int], typer.Option(min=1)] = None,
    top_p: Annotated[Optional[float], typer.Option(min=0.0, max=1.0)] = None,
    repetition_penalty: Annotated[float, typer.Option(min=0.0)] = 1.0,
    seed: Annotated[Optional[int], typer.Option()] = None,
    cache_kind: Annotated[str, typer.Option(help="fp32, fp16 or bf16.")] = "fp32",
    max_seq_len: Annotated[int, typer.Option(min=1)] = 2048,
    stop: Annotated[Optional[list[str]], typer.Option(help="A stop sequence; repeatable.")] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap the prompt in the model's chat template.")] = False,
    system: Annotated[Optional[str], typer.Option(help="System message (with --chat).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of streaming text.")] = False,
) -> None:
    """Generate a continuation of PROMPT, streaming it to the terminal."""
    with _errors_as_exit_codes():
        from caramba.infer import GenerateConfig, Generator
        from caramba.model.zoo import load_model
        from caramba.prompting import completion_text, encode_prompt
        from caramba.tokenizer import StreamDecoder

        if system is not None and not chat:
            raise UserError("--system needs --chat")
        try:
            config = GenerateConfig(
                max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                repetition_penalty=repetition_penalty, stop_sequences=list(stop or []),
                max_seq_len=max_seq_len, seed=seed, cache_kind=cache_kind,
            )
        except ValueError as e:
            raise UserError(str(e).replace("GenerateConfig.", "--").replace("_", "-")) from None
        loaded = load_model(model, dtype, device, progress=not as_json)
        tok = loaded.tokenizer
        prompt_ids = encode_prompt(tok, prompt, chat, system)
        generator = Generator(loaded.model, config, tokenizer=tok)
        on_token = None
        if not as_json:
            decoder = StreamDecoder(tok, skip_special_tokens=True)
            out.print(f"[bold]{prompt}[/bold]", end="")
            on_token = lambda _row, t: out.out(decoder.step(t), end="")  # noqa: E731
        try:
            result = generator.run([prompt_ids], on_token=on_token)
        except ValueError as e:  # e.g. the prompt does not fit max_seq_len
            raise UserError(str(e)) from None
        ids = result.sequences[0]
        if as_json:
            print(json.dumps({
                "prompt": prompt,
                "prompt_ids": prompt_ids,
                "output_ids": ids,
                "text": completion_text(tok, ids, config.stop_sequences),
                "finish_reason": result.finish_reasons[0],
                "prefill_s": result.prefill_s,
                "decode_s": result.decode_s,
                "decode_tok_s": result.decode_tok_s,
                "model": {"source": model, "path": str(loaded.path), "sha256": loaded.content_hash, "dtype": dtype},
                "cache_kind": config.cache_kind,
            }))
        else:
            out.out(decoder.flush())
            err.print(f"[dim]{len(ids)} tokens, prefill {result.prefill_s * 1000:.0f} ms, "
                      f"decode {result.decode_tok_s:.1f} tok/s, stop: {result.finish_reasons[0]}[/dim]")


def _int_list(text: str, option: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{option} takes comma-separated integers, e.g. 128,512,2048 (got {text!r})") from None


@app.command()
def bench(
    model: Annotated[str, typer.Option(help="smollm2-135m, a .gguf file or an HF directory.")] = "smollm2-135m",
    dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float16.")] = "float32",
    device: Annotated[str, typer.Option(help="cpu, cuda, mps or auto.")] = "cpu",
    prompt_lens: Annotated[str, typer.Option(help="Context lengths, comma-separated.")] = "128,512,2048",
    batch_sizes: Annotated[str, typer.Option(help="Batch sizes, comma-separated.")] = "1",
    cache_kinds: Annotated[str, typer.Option(help="KV cache kinds, comma-separated.")] = "fp32",
    new_tokens: Annotated[int, typer.Option(help="Tokens generated per repeat (first = prefill).")] = 32,
    warmup: Annotated[int, typer.Option(help="Unmeasured runs per cell.")] = 1,
    repeats: Annotated[int, typer.Option(help="Measured runs per cell.")] = 3,
    reference: Annotated[str, typer.Option(help="none, or hf: the same cells through transformers.")] = "none",
    text: Annotated[Optional[Path], typer.Option(help="Prompt text file (default: the bundled corpus).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the cells as JSON.")] = False,
) -> None:
    """Measure prefill and decode latency, throughput and memory over a grid of cells.

    The record (result.json, cells.csv, plots) goes to runs/bench/cli/<UTC time>/."""
    with _errors_as_exit_codes():
        import time

        from pydantic import ValidationError

        from caramba.manifest.schema import BenchSettings
        from caramba.model.zoo import load_model
        from caramba.runners.decode_bench import run_decode_bench
        from caramba.runs import RunDir, capture_env

        try:
            settings = BenchSettings(
                prompt_lens=_int_list(prompt_lens, "--prompt-lens"), batch_sizes=_int_list(batch_sizes, "--batch-sizes"),
                cache_kinds=[k.strip() for k in cache_kinds.split(",") if k.strip()], new_tokens=new_tokens,
                warmup=warmup, repeats=repeats, reference=reference, text=str(text) if text else None,
            )
        except ValidationError as e:
            problems = "; ".join(f"--{'-'.join(str(p) for p in x['loc'][:1]).replace('_', '-')}: {x['msg']}" for x in e.errors())
            raise UserError(problems) from None
        loaded = load_model(model, dtype, device, progress=not as_json)
        record = RunDir("bench", "cli", time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
        record.begin()
        record.write_json("env.json", capture_env(None, device))
        record.write_json("settings.json", {"model": model, "dtype": dtype, "device": device, **settings.model_dump()})
        result = run_decode_bench(loaded, settings, None, record, err if as_json else out)
        result["model"] = {"source": model, "path": str(loaded.path), "sha256": loaded.content_hash, "dtype": dtype}
        record.write_json("result.json", result)
        record.finish()
        if as_json:
            print(json.dumps(result["cells"]))
        err.print(f"record: {record.path}")


@app.command()
def report(
    run_dirs: Annotated[list[Path], typer.Argument(help="Run record directories; the first is the baseline.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the comparison as JSON.")] = False,
) -> None:
    """Compare finished runs (bench cells or generate summaries) side by side, with deltas
    against the first."""
    with _errors_as_exit_codes():
        from rich.table import Table

        from caramba.bench.report import compare

        try:
            rows = compare(list(run_dirs))
        except FileNotFoundError as e:
            raise UserError(str(e)) from None
        if as_json:
            print(json.dumps(rows))
            return
        metrics = [k for k in dict.fromkeys(k for r in rows for k in r) if k not in ("run", "impl", "prompt_len", "batch_size", "cache_kind") and not k.endswith("_delta")]
        table = Table(title=f"compared with {run_dirs[0]}")
        for col in ("run", "impl", "ctx", "batch", "cache", *metrics):
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
            table.add_row(Path(r["run"]).name, str(r.get("impl")), str(r.get("prompt_len")), str(r.get("batch_size")),
                          str(r.get("cache_kind")), *cells)
        out.print(table)


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
