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
) -> None:
    """Validate a manifest and run its runs, leaving a record of each under runs/."""
    with _errors_as_exit_codes():
        from caramba.runners import run_manifest

        m = _load(manifest, overrides or [])
        outcome = run_manifest(m, run_ids or [], force=force, dry_run=dry_run, console=out)
        if not dry_run:
            err.print(f"{len(outcome.done)} done, {len(outcome.skipped)} skipped, {len(outcome.failed)} failed")
        if outcome.failed:
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


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
