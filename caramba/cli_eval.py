"""`caramba eval`: a one-run `mode: eval` manifest built from flags, run by the manifest's runner.

The flags name what a manifest's `eval:` section says: candidates (--cache-kind, --cache-policy
and the cache settings they share), the baseline, the perplexity protocol and the tasks
(--tasks, --lengths, --samples). `--set` reaches anything else below the run
(`--set eval.tasks.prefill=own`). Nothing is written under runs/: the table, or --json, is
printed. A manifest with `mode: eval` does the same and keeps a record.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import typer
from pydantic import ValidationError
from rich.console import Console

from caramba.errors import UserError
from caramba.runs import json_text

# Cache settings every candidate shares, as flags (CacheConfig's names).
SHARED_CACHE_OPTIONS = ("qblock", "residual_len", "rotate_keys", "rotate_values", "cache_fp16_prefix_layers")


def _cache_option(name: str):
    """CacheConfig's definition of the option spelled `name` (caramba.options)."""
    from caramba.infer.config import CacheConfig
    from caramba.options import options_of

    return next(o for o in options_of(CacheConfig) if o.name == name)


def candidate_params() -> list[inspect.Parameter]:
    """`caramba eval`'s flags for the cache settings its candidates share, from CacheConfig's one
    definition: their help, lower bound and default (the rest is checked by CacheConfig itself)."""
    params = []
    for name in SHARED_CACHE_OPTIONS:
        opt = _cache_option(name)
        decls = [f"--{name.replace('_', '-')}"] if opt.type is bool else []
        help = opt.info.help[:1].upper() + opt.info.help[1:]
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=opt.type,
                                        default=typer.Option(opt.default(), *decls, min=opt.info.ge,
                                                             help=f"{help} (every candidate).")))
    return params


def eval_command(model: dict[str, str], text: Path | None, kinds: list[str], policies: list[str], baseline: str,
                 shared: dict[str, Any], *, presses: list[str] = (), perplexity: bool, protocol: str, ctx: int,
                 prompt_len: int, max_tokens: int | None, tasks: str | None, lengths: str, samples: int, seed: int,
                 overrides: list[str], as_json: bool, out: Console, err: Console) -> None:
    """`caramba eval`: the flags checked (each error naming its flag), the one-run manifest built and run."""
    from caramba.cli_bench import int_list

    check_flags(text, protocol, ctx, shared, kinds, policies, baseline)
    if not perplexity and tasks is None:
        raise UserError("--no-perplexity leaves nothing to score: add --tasks all (or a list of tasks)")
    press_settings = press_flags(presses, perplexity, tasks)
    ppl = {"protocol": protocol, "ctx": ctx, "prompt_len": prompt_len, "max_tokens": max_tokens,
           "text": str(text) if text else None} if perplexity else None
    task_settings = None
    if tasks is not None:
        names = None if tasks.strip() == "all" else [t.strip() for t in tasks.split(",") if t.strip()]
        task_settings = {"names": names, "lengths": int_list(lengths, "--lengths"), "samples": samples,
                         "seed": seed, "text": str(text) if text else None}
    manifest = eval_manifest(model, kinds, policies, baseline, shared, ppl, task_settings, overrides, press_settings)
    run_eval_command(manifest, as_json, out, err)


def press_flags(presses: list[str], perplexity: bool, tasks: str | None) -> list[dict[str, Any]]:
    """Each --press as a candidate's press settings (PressConfig's flat names); errors name the flag."""
    from caramba.options import OptionError, options_of
    from caramba.press import PressConfig

    out = []
    for text in presses:
        try:
            press = PressConfig.parse(text)
        except OptionError as e:
            raise UserError(f"--press {text}: {e.name}={e.value!r} {e.why}") from None
        except ValueError as e:
            raise UserError(f"--press {text}: {e}") from None
        if not press.enabled:
            continue
        defaults = PressConfig()
        out.append({o.name: getattr(press, o.attr) for o in options_of(PressConfig)
                    if getattr(press, o.attr) != getattr(defaults, o.attr) or o.name == "press"})
    if out and (perplexity or tasks is None):
        raise UserError("--press: a press compresses a task's context before its question, so it is scored on "
                        "--tasks only: add --tasks (e.g. --tasks all) and --no-perplexity")
    return out


def check_flags(text: Path | None, protocol: str, ctx: int, shared: dict[str, Any], kinds: list[str],
                policies: list[str], baseline: str) -> None:
    """The flags' own errors, each naming its flag, before a manifest is built."""
    from caramba.cache import CacheSettings
    from caramba.infer.config import CacheConfig
    from caramba.options import OptionError, options_of

    if text is not None:
        from caramba.runners.preflight import check_text

        check_text(text, "--text")
    if protocol not in ("decode", "chunks"):
        raise UserError(f"--protocol {protocol!r}: choose decode or chunks")
    if protocol == "chunks" and ctx % 2:
        raise UserError(f"--ctx {ctx}: must be even (windows are scored on their second half)")
    attrs = {o.name: o.attr for o in options_of(CacheConfig)}
    settings = {attrs[name]: value for name, value in shared.items()}
    try:
        CacheConfig(**settings)
    except OptionError as e:
        raise UserError(f"--{e.name.replace('_', '-')} {e.value!r}: {e.why}") from None
    if "auto" in [*kinds, baseline]:
        raise UserError("--cache-kind/--baseline auto: eval scores named kinds; mode cache-autotune "
                        "(caramba autotune) picks one")
    try:
        for kind in kinds:
            CacheSettings(kind=kind, **settings)
        for policy in policies:
            CacheSettings(policy=policy, **settings)
        CacheSettings(kind=baseline)
    except ValueError as e:
        raise UserError(f"--cache-kind/--cache-policy/--baseline: {e}") from None


def eval_manifest(model: dict[str, str], kinds: list[str], policies: list[str], baseline: str,
                  shared: dict[str, Any], perplexity: dict[str, Any] | None, tasks: dict[str, Any] | None,
                  overrides: list[str], presses: list[dict[str, Any]] = ()):
    """The one-run manifest of these flags, validated. presses: each on every candidate, and
    alone (on the baseline's kind)."""
    from caramba.manifest.overrides import apply_overrides
    from caramba.manifest.schema import Manifest

    candidates = [{"cache_kind": k, **shared} for k in kinds]
    candidates += [{"cache_policy": p, **shared} for p in policies]
    candidates = candidates or [{"cache_kind": "q8_0", **shared}]
    candidates += [{**c, **p} for p in presses for c in [*candidates, {"cache_kind": baseline}]]
    # A candidate of the baseline's own kind (to see what --weights costs, say) keeps its name; the baseline is renamed.
    same = any(c.get("cache_kind") == baseline and not c.get("cache_policy") and "press" not in c for c in candidates)
    section = {"candidates": candidates, "baseline": {"cache_kind": baseline, **({"name": "baseline"} if same else {})},
               "perplexity": perplexity, "tasks": tasks}
    data = {"version": 1, "name": "eval", "defaults": {"model": model},
            "targets": [{"type": "experiment", "name": "cli", "runs": [{"id": "eval", "mode": "eval", "eval": section}]}]}
    apply_overrides(data, [f"targets.0.runs.0.{o.strip()}" for o in overrides])
    try:
        return Manifest.model_validate(data)
    except ValidationError as e:
        raise UserError("; ".join(f"{'.'.join(str(p) for p in problem['loc'][4:]) or 'eval'}: "
                                  f"{problem['msg'].removeprefix('Value error, ')}"
                                  for problem in e.errors(include_url=False))) from None


# The runner's field names as this command's flags, in its error messages.
_FLAG_NAMES = {"eval.perplexity.prompt_len=": "--prompt-len ", "eval.perplexity.ctx=": "--ctx ",
               "eval.perplexity.max_tokens": "--max-tokens", "eval.perplexity.text": "--text",
               "eval.tasks.lengths": "--lengths", "eval.tasks.text": "--text"}


def _as_flags(message: str) -> str:
    for field, flag in _FLAG_NAMES.items():
        message = message.replace(field, flag)
    return message


def run_eval_command(manifest, as_json: bool, out: Console, err: Console) -> None:
    from caramba.model.zoo import load_model, resolve_device
    from caramba.runners.eval import run_eval
    from caramba.runners.preflight import check_run
    from caramba.runners.lifecycle import Transient

    (resolved,) = list(manifest.iter_runs())
    resolve_device(resolved.model.device)
    try:
        check_run(resolved, "eval")   # as caramba run's preflight (check_eval among its checks)
    except UserError as e:
        raise UserError(_as_flags(str(e).removeprefix("eval: "))) from None
    m = resolved.model
    loaded = load_model(m.source, m.dtype, m.device, progress=not as_json, weights=m.weights)
    console = Console(quiet=True) if as_json else out   # --json: stdout holds the one object
    result = run_eval(loaded, resolved.run.eval, resolved.run.seed, Transient(), console)
    if not as_json:
        return
    model = {"source": m.source, "path": str(loaded.path), "sha256": loaded.content_hash, "dtype": m.dtype,
             "weights": m.weights}
    ppl = result.get("perplexity")
    legacy = {}
    if ppl is not None:   # the shape `caramba eval --json` has printed since before mode: eval
        rows = [r for r in result["candidates"] if r["label"] != result["baseline"]]
        legacy = {**ppl, "baseline": next(r["policy"] for r in result["candidates"] if r["label"] == result["baseline"]),
                  "results": [{"policy": r["policy"], "bytes_per_token": r["bytes_per_token"], "protocol": ppl["protocol"],
                               **r["perplexity"]} for r in rows]}
    print(json_text({**result, **legacy, "model": model}))
