"""The `caramba` command line. Each command's docstring is its --help.

Exit codes: 0 ok, 1 a run failed, 2 bad input (manifest, option, missing file). Errors are a
short message on stderr; set CARAMBA_DEBUG=1 to see the traceback of an unexpected one.
"""

from __future__ import annotations

import inspect
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


# The model options every command that loads a model shares.
ModelOption = Annotated[str, typer.Option(help="smollm2-135m, a .gguf file or an HF directory.")]
DtypeOption = Annotated[str, typer.Option(help="float32, bfloat16 or float16.")]
DeviceOption = Annotated[str, typer.Option(help="cpu, cuda, mps or auto.")]

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
        from caramba.runners import command_line, run_manifest

        m = _load(manifest, overrides or [])
        command = command_line(str(manifest), run_ids or [], overrides or [], force, check)
        outcome = run_manifest(m, run_ids or [], force=force, dry_run=dry_run, console=out, check=check,
                               overrides=overrides or [], command=command)
        if not dry_run:
            checked = f", {len(outcome.check_failed)} failed their check" if check else ""
            busy = f", {len(outcome.busy)} left to another process running them" if outcome.busy else ""
            err.print(f"{len(outcome.done)} done, {len(outcome.skipped)} skipped{busy}, {len(outcome.failed)} failed{checked}")
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


def _generate(prompt: str, model: str, dtype: str, device: str, seed: Optional[int], chat: bool, system: Optional[str],
              as_json: bool, speculative: Optional[str], draft: Optional[str], overrides: Optional[list[str]],
              **options) -> None:
    """Generate a continuation of PROMPT, streaming it to the terminal (greedy unless --temperature).

    Every option of a manifest's generate: section is a flag here, with '-' for '_'. --set reaches
    anything else below the run: model.dtype=bfloat16, or an option as decode_q_chunk=512.

    The flags become a one-run manifest, checked and run like `caramba run`'s; nothing is written."""
    with _errors_as_exit_codes():
        from caramba.cli_generate import generate

        generate(prompt, model, dtype, device, seed, chat, system, as_json, speculative, draft, overrides or [],
                 options, out, err)


def _register_generate() -> None:
    from caramba.cli_generate import OPTION_PARAMS

    def opt(default, *decls, **kw):
        return typer.Option(default, *decls, **kw)

    kw = inspect.Parameter.KEYWORD_ONLY
    fixed = [
        inspect.Parameter("prompt", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str,
                          default=typer.Argument(..., help="The prompt text.")),
        inspect.Parameter("model", kw, annotation=str, default=opt("smollm2-135m", help="smollm2-135m, a .gguf file or an HF directory.")),
        inspect.Parameter("dtype", kw, annotation=str, default=opt("float32", help="float32, bfloat16 or float16.")),
        inspect.Parameter("device", kw, annotation=str, default=opt("cpu", help="cpu, cuda, mps or auto.")),
        inspect.Parameter("seed", kw, annotation=Optional[int], default=opt(None, help="Sampling seed.")),
        inspect.Parameter("chat", kw, annotation=bool, default=opt(False, "--chat", help="Wrap the prompt in the model's chat template.")),
        inspect.Parameter("system", kw, annotation=Optional[str], default=opt(None, help="System message (with --chat).")),
        inspect.Parameter("as_json", kw, annotation=bool, default=opt(False, "--json", help="Print one JSON object (the run's result row) instead of streaming text.")),
        inspect.Parameter("speculative", kw, annotation=Optional[str], default=opt(None, help="Speculative decoding with this draft: prompt_lookup, self_int8, layer_skip or model (needs --draft).")),
        inspect.Parameter("draft", kw, annotation=Optional[str], default=opt(None, help="The draft model for --speculative model (same forms as --model).")),
        inspect.Parameter("overrides", kw, annotation=Optional[list[str]], default=opt(None, "--set", help="Override a field below the run: generate.decode_q_chunk=512, model.dtype=bfloat16; repeatable.")),
    ]
    _generate.__signature__ = inspect.Signature(fixed + OPTION_PARAMS)
    app.command("generate")(_generate)


_register_generate()


def _int_list(text: str, option: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{option} takes comma-separated integers, e.g. 128,512,2048 (got {text!r})") from None


@app.command()
def bench(
    model: ModelOption = "smollm2-135m",
    dtype: DtypeOption = "float32",
    device: DeviceOption = "cpu",
    prompt_lens: Annotated[str, typer.Option(help="Context lengths, comma-separated.")] = "128,512,2048",
    batch_sizes: Annotated[str, typer.Option(help="Batch sizes, comma-separated.")] = "1",
    cache_kinds: Annotated[str, typer.Option(help="KV cache kinds, comma-separated.")] = "fp32",
    decode_plans: Annotated[str, typer.Option(help="Decode plans, ';'-separated: none, auto, chunk=N, window=W, chunk=N,window=W.")] = "none",
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
        import time

        from pydantic import ValidationError

        from caramba.manifest.schema import BenchSettings
        from caramba.model.zoo import load_model
        from caramba.runners.decode_bench import run_decode_bench
        from caramba import __version__ as caramba_version
        from caramba.runs import RunDir, capture_env, library_versions

        try:
            settings = BenchSettings(
                prompt_lens=_int_list(prompt_lens, "--prompt-lens"), batch_sizes=_int_list(batch_sizes, "--batch-sizes"),
                cache_kinds=[k.strip() for k in cache_kinds.split(",") if k.strip()], new_tokens=new_tokens,
                decode_plans=[p.strip() for p in decode_plans.split(";") if p.strip()],
                warmup=warmup, repeats=repeats, reference=reference, text=str(text) if text else None,
            )
        except ValidationError as e:
            problems = "; ".join(f"--{'-'.join(str(p) for p in x['loc'][:1]).replace('_', '-')}: {x['msg']}" for x in e.errors())
            raise UserError(problems) from None
        loaded = load_model(model, dtype, device, progress=not as_json)
        # Unique even for two benches started in the same second: the second gets <time>-2.
        record = RunDir.unique("bench", "cli", time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
        try:
            record.begin()
            record.write_json("env.json", capture_env(None, device))
            record.write_json("settings.json", {"model": model, "dtype": dtype, "device": device, **settings.model_dump()})
            result = run_decode_bench(loaded, settings, None, record, err if as_json else out)
            result["model"] = {"source": model, "path": str(loaded.path), "sha256": loaded.content_hash, "dtype": dtype}
            result["versions"] = {"caramba": caramba_version, **library_versions()}
            record.write_json("result.json", result)
            record.finish()
        except BaseException:
            record.abandon()   # the attempt's files (log.txt) stay, without DONE
            raise
        finally:
            record.release()
        if as_json:
            print(json.dumps(result["cells"]))
        err.print(f"record: {record.final}")


@app.command()
def report(
    run_dirs: Annotated[list[Path], typer.Argument(help="Run record directories; the first is the baseline.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the comparison as JSON.")] = False,
) -> None:
    """Compare finished runs (bench cells or generate summaries) side by side, with deltas
    against the first."""
    with _errors_as_exit_codes():
        from rich.table import Table

        from caramba.bench.report import CELL_KEY, compare

        try:
            rows = compare(list(run_dirs))
        except FileNotFoundError as e:
            raise UserError(str(e)) from None
        if as_json:
            print(json.dumps(rows))
            return
        metrics = [k for k in dict.fromkeys(k for r in rows for k in r) if k not in ("run", *CELL_KEY) and not k.endswith("_delta")]
        table = Table(title=f"compared with {run_dirs[0]}")
        for col in ("run", "impl", "ctx", "batch", "cache", "plan", *metrics):
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
                          str(r.get("cache_kind")), str(r.get("decode_plan") or ""), *cells)
        out.print(table)


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
        from caramba.infer.evaluate import corpus_ids
        from caramba.model.dba_convert import CALIBRATION_START, check_dims, convert_loaded
        from caramba.model.zoo import load_model

        if out_dir.exists() and not force:
            raise UserError(f"--out {out_dir} exists; pass --force to replace it or choose another directory")
        if calib_text is not None and not calib_text.is_file():
            raise UserError(f"--calib-text {calib_text}: no such file")
        loaded = load_model(model, "float32", "cpu")
        try:
            check_dims(loaded.model.config, sem_dim, geo_dim)
        except ValueError as e:
            raise UserError(str(e)) from None
        ids = corpus_ids(loaded.tokenizer, calib_text)
        calibration = ids[:calib_tokens] if calib_text is not None else ids[CALIBRATION_START:][:calib_tokens]
        if calib_tokens and len(calibration) < min(calib_tokens, 64):
            raise UserError(f"the calibration text has only {len(calibration)} usable tokens; give a longer --calib-text")
        conv = convert_loaded(loaded, sem_dim, geo_dim, out_dir, calibration)
        cfg = conv.config
        out.print(f"[green]wrote[/green] {out_dir}: sem_dim={cfg.sem_dim}, geo_dim={cfg.geo_dim} per head, "
                  f"{len(calibration)} calibration tokens, SVD keeps {conv.sem_energy:.1%} of the semantic forms' energy")
        sizes = []
        for kind in ("fp16", "q8_0", "q4_0"):
            dba, qblock = _cache_bytes_per_token(cfg, kind)
            std, _ = _cache_bytes_per_token(loaded.model.config, kind, qblock)
            sizes.append(f"{kind}{f' (qblock {qblock})' if qblock != 32 else ''} {dba} (standard {std})")
        out.print("cache bytes/token (all layers, batch 1): " + ", ".join(sizes))


def _cache_bytes_per_token(cfg, kind: str, qblock: int | None = None) -> tuple[int, int]:
    """(bytes_per_token, qblock) of a 1-slot cache built on the meta device (no storage), with
    the largest qblock <= 32 that divides every stream's width when none is given."""
    import torch

    from caramba.cache import CachePolicy
    from caramba.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(cfg)
        for qb in [qblock] if qblock else [32, 16, 8, 4, 2]:
            try:
                return model.new_cache(1, 1, CachePolicy.build(kind, qblock=qb)).bytes_per_token(), qb
            except ValueError:
                continue
    raise ValueError(f"no qblock divides the cache streams of sem_dim={cfg.sem_dim}, geo_dim={cfg.geo_dim}")


@app.command("eval")
def eval_cache(
    text: Annotated[Optional[Path], typer.Option(help="Text file to score (default: caramba's bundled corpus).")] = None,
    model: ModelOption = "smollm2-135m",
    dtype: DtypeOption = "float32",
    device: DeviceOption = "cpu",
    cache_kind: Annotated[Optional[list[str]], typer.Option(help="Candidate cache kind; repeatable.")] = None,
    cache_policy: Annotated[Optional[list[str]], typer.Option(help="Candidate per-stream policy, e.g. k=q8_0,v=q4_0; repeatable.")] = None,
    baseline: Annotated[str, typer.Option(help="The reference cache kind.")] = "fp32",
    qblock: Annotated[int, typer.Option(min=2, help="Elements per quantization block (candidates).")] = 32,
    residual_len: Annotated[int, typer.Option(min=0, help="Newest tokens kept in full precision (candidates).")] = 0,
    rotate_keys: Annotated[bool, typer.Option("--rotate-keys", help="Hadamard-rotate keys (candidates).")] = False,
    cache_fp16_prefix_layers: Annotated[int, typer.Option(min=0, help="First N layers in fp16 (candidates).")] = 0,
    protocol: Annotated[str, typer.Option(help="decode: prefill --prompt-len tokens, then score token by token "
                                               "through the cache; chunks: llama-perplexity's non-overlapping "
                                               "--ctx windows, each scored on its second half.")] = "decode",
    ctx: Annotated[int, typer.Option(min=4, help="Window size of --protocol chunks (llama-perplexity -c).")] = 512,
    prompt_len: Annotated[int, typer.Option(min=1, help="Tokens prefilled before token-by-token scoring (decode).")] = 256,
    max_tokens: Annotated[Optional[int], typer.Option(min=2, help="Use only the text's first N tokens "
                                                      "(default: 1024 for decode, the whole text for chunks).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
) -> None:
    """Score a text through the KV cache: NLL/PPL of each candidate cache, and
    KL(baseline || candidate) and top-1 agreement against the baseline cache.

    --protocol decode (default): the first --prompt-len tokens are prefilled; each later token is
    fed one at a time through the cache, as generation does. --protocol chunks --ctx 512: as
    llama.cpp's perplexity tool, with the PPL's standard error. Candidates: each --cache-kind and
    --cache-policy (default q8_0)."""
    with _errors_as_exit_codes():
        from rich.progress import Progress
        from rich.table import Table

        from caramba.cache import CachePolicy
        from caramba.infer.evaluate import adds_bos, corpus_text, evaluate_cache, evaluate_chunks
        from caramba.model.zoo import load_model

        if text is not None and not text.is_file():
            raise UserError(f"--text {text}: no such file")
        if protocol not in ("decode", "chunks"):
            raise UserError(f"--protocol {protocol!r}: choose decode or chunks")
        if protocol == "chunks" and ctx % 2:
            raise UserError(f"--ctx {ctx}: must be even (windows are scored on their second half)")
        specs = [("kind", k) for k in cache_kind or []] + [("policy", p) for p in cache_policy or []]
        try:
            candidates = [CachePolicy.build(kind=v, qblock=qblock, residual_len=residual_len, rotate_keys=rotate_keys,
                                            fp16_prefix_layers=cache_fp16_prefix_layers) if how == "kind" else
                          CachePolicy.build(policy=v, qblock=qblock, residual_len=residual_len, rotate_keys=rotate_keys,
                                            fp16_prefix_layers=cache_fp16_prefix_layers)
                          for how, v in specs or [("kind", "q8_0")]]
            base = CachePolicy.build(baseline)
        except ValueError as e:
            raise UserError(f"--cache-kind/--cache-policy/--baseline: {e}") from None
        loaded = load_model(model, dtype, device, progress=not as_json)
        try:   # stream names against the model: k/v (standard) or k_sem/k_geo/v (decoupled)
            for policy in [base, *candidates]:
                policy.check_streams(loaded.model.config.attention == "decoupled")
        except ValueError as e:
            raise UserError(f"--cache-policy/--baseline: {e}") from None
        chunks = protocol == "chunks"
        tok = loaded.tokenizer
        # chunks: the text as llama.cpp tokenizes it, with BOS when the model adds one
        bos = tok.bos_token_id if chunks and adds_bos(tok) else None
        ids = tok.encode(corpus_text(text), add_special_tokens=chunks)
        if max_tokens is None and not chunks:
            max_tokens = 1024
        if max_tokens is not None:
            ids = ids[:max_tokens]
        if chunks and len(ids) < ctx:
            raise UserError(f"--ctx {ctx}: the text has only {len(ids)} tokens (after --max-tokens); "
                            f"use a smaller --ctx or a longer text")
        if not chunks and len(ids) < prompt_len + 2:
            raise UserError(f"--prompt-len {prompt_len}: the text has only {len(ids)} tokens (after --max-tokens); "
                            f"use a shorter prompt or a longer text")
        with Progress(transient=True, disable=as_json) as bar:
            task = bar.add_task("scoring", total=len(ids) // ctx if chunks else len(ids) - prompt_len)
            step = lambda done, total: bar.update(task, completed=done)   # noqa: E731
            if chunks:
                results = evaluate_chunks(loaded.model, ids, candidates, base, ctx, bos, on_step=step)
            else:
                results = evaluate_cache(loaded.model, ids, candidates, base, prompt_len, on_step=step)
        n_scored = results[0].n_scored
        setup = ({"ctx": ctx, "n_chunks": len(ids) // ctx, "bos": bos} if chunks else {"prompt_len": prompt_len})
        if as_json:
            print(json.dumps({"model": {"source": model, "sha256": loaded.content_hash, "dtype": dtype},
                              "text": str(text) if text else "caramba/data/corpus.txt", "n_tokens": len(ids),
                              "protocol": protocol, **setup, "baseline": base.describe(),
                              "results": [r.to_dict() for r in results]}))
            return
        r0 = results[0]
        if chunks:
            title = (f"{len(ids) // ctx} windows of {ctx} tokens, {n_scored} tokens scored (second halves); "
                     f"baseline {base.describe()} PPL {r0.baseline_ppl:.4f} +/- {r0.baseline_ppl_stderr:.5f}")
        else:
            title = (f"{n_scored} tokens scored after a {prompt_len}-token prompt; "
                     f"baseline {base.describe()} PPL {r0.baseline_ppl:.4f}")
        table = Table(title=title)
        for col in ("cache", "bytes/token", "PPL", "dNLL", "mean KL", "max KL", "top-1 agree"):
            table.add_column(col)
        for r in results:
            ppl = f"{r.ppl:.4f}" + (f" +/- {r.ppl_stderr:.5f}" if r.ppl_stderr is not None else "")
            table.add_row(r.policy, str(r.bytes_per_token), ppl, f"{r.dnll:+.5f}", f"{r.kl_mean:.2e}",
                          f"{r.kl_max:.2e}", f"{r.top1_agreement:.4f}")
        out.print(table)


@app.command()
def autotune(
    budget_mb: Annotated[float, typer.Option(help="MiB for the whole KV cache (all layers, K+V, the batch).")],
    model: ModelOption = "smollm2-135m",
    dtype: DtypeOption = "float32",
    device: DeviceOption = "cpu",
    max_seq_len: Annotated[int, typer.Option(min=2, help="Context length the cache is sized and timed for.")] = 2048,
    batch_size: Annotated[int, typer.Option(min=1, help="Rows the cache is sized and timed for.")] = 1,
    text: Annotated[Optional[Path], typer.Option(help="Gate text file (default: caramba's bundled corpus).")] = None,
    plan_path: Annotated[Optional[Path], typer.Option(help="The plan store (default: runs/cache_plans.json).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Measure again even when a fresh plan is stored.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object with chosen and candidates.")] = False,
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

        if text is not None and not text.is_file():
            raise UserError(f"--text {text}: no such file")
        loaded = load_model(model, dtype, device, progress=not as_json)
        settings = AutotuneSettings(budget_mb=budget_mb, max_seq_len=max_seq_len, batch_size=batch_size)
        result = run_tuned(loaded, settings, err if as_json else out, text, plan_path, force, quiet=as_json)
        if as_json:
            print(json.dumps(result.to_dict()))
            return
        print_candidates(out, result)
        out.print(f"chosen: [bold]{result.chosen['name']}[/bold] ({result.chosen['bytes'] / 2**20:.2f} MiB); "
                  f"plan {result.key_id} in {result.plan_path}")


plans_app = typer.Typer(help="The stored cache plans (runs/cache_plans.json).", no_args_is_help=True)
app.add_typer(plans_app, name="plans")
PlanPathOption = Annotated[Optional[Path], typer.Option("--plan-path", help="The plan store (default: runs/cache_plans.json).")]


def _plan_store(plan_path: Path | None):
    from caramba.autotune import PlanStore

    return PlanStore(plan_path, notice=lambda message: err.print(f"[yellow]warning:[/yellow] {message}", soft_wrap=True))


@plans_app.command("list")
def plans_list(plan_path: PlanPathOption = None, as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """One line per stored plan: id, model, machine, settings, the chosen cache, age."""
    with _errors_as_exit_codes():
        from rich.table import Table

        store = _plan_store(plan_path)
        plans = store.all()
        if as_json:
            print(json.dumps(plans))
            return
        table = Table(title=f"{len(plans)} plan(s) in {store.path}", title_justify="left")
        for col in ("id", "model", "dtype", "device", "max_seq_len", "batch", "budget MB", "chosen", "created"):
            table.add_column(col, no_wrap=col == "id", overflow="fold")
        for pid, p in plans.items():
            k = p["key"]
            table.add_row(pid, k["model_sha256"][:12], k["dtype"], f"{k['device']} ({k['device_name']})",
                          str(k["max_seq_len"]), str(k["batch_size"]), f"{k['budget_mb']:g}", p["chosen"]["name"],
                          p["created_utc"])
        out.print(table)


@plans_app.command("show")
def plans_show(plan_id: Annotated[str, typer.Argument(help="A plan id (or its first characters).")],
               plan_path: PlanPathOption = None) -> None:
    """Print one plan as JSON: its key, the chosen cache and every candidate's bytes, gates and speed."""
    with _errors_as_exit_codes():
        plans = _plan_store(plan_path).all()
        found = [p for pid, p in plans.items() if pid.startswith(plan_id)]
        if len(found) != 1:
            raise UserError(f"plan id {plan_id!r} matches {len(found)} plans; `caramba plans list` shows the ids")
        print(json.dumps(found[0], indent=2))


@plans_app.command("clear")
def plans_clear(plan_ids: Annotated[Optional[list[str]], typer.Argument(help="Plan ids to drop (default: all).")] = None,
                plan_path: PlanPathOption = None) -> None:
    """Drop stored plans (all of them, or the ids given); the next autotune measures again."""
    with _errors_as_exit_codes():
        store = _plan_store(plan_path)
        gone = store.remove(plan_ids or None)
        if plan_ids and not gone:
            raise UserError(f"no plan matches {', '.join(plan_ids)}; `caramba plans list` shows the ids")
        err.print(f"removed {len(gone)} plan(s) from {store.path}")


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
