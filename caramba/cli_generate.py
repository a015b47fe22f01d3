"""`caramba generate`: a one-run manifest built from flags, run by the manifest's own runner.

Every engine option is a flag, derived from its one definition (caramba.options): a new
sampling or cache option appears here with its bounds and help without an edit to this file.
The flags, `--set` overrides (paths below the run, e.g. `generate.decode_q_chunk=512` or
`model.dtype=bfloat16`) and the prompt become a manifest with one run; it is validated by the
manifest schema and run by the same runner as `caramba run`, so the CLI and a manifest never
disagree. Nothing is written under runs/: the result is printed (streamed text, or --json).
"""

from __future__ import annotations

import inspect
import types
import typing
from typing import Any, Optional

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape

from caramba.errors import UserError
from caramba.infer.config import DRAFT_KINDS, DraftConfig, GenerateConfig, SpeculativeConfig, flat_paths
from caramba.manifest.schema import option_fields
from caramba.runs import json_text, kernel_builds, kernel_status

# The CLI's own spellings where a short one predates the derived flag (both work).
ALIASES = {"stop_sequences": ["--stop"], "decode_q_chunk": ["--q-chunk"], "decode_local_window": ["--local-window"],
           "spec_k_adaptive": ["--spec-adaptive"]}
# Options the CLI gives another meaning: the draft kind is --speculative (--draft names the draft model).
NOT_FLAGS = {"draft"}
GENERATE_OPTIONS = option_fields(GenerateConfig)
ENGINE_CONFIGS = {"generate": GenerateConfig, "speculative": SpeculativeConfig}   # the engine config each mode checks
DRAFT_OPTIONS = {k: v for k, v in option_fields(DraftConfig).items() if k not in NOT_FLAGS}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _cli_type(annotation: Any) -> Any:
    """The flag's type: the scalar types as they are, list[str] repeatable; anything else (a
    policy mapping, bool-or-'never') is a string parsed as YAML, like a --set value."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    members = [a for a in typing.get_args(annotation) if a is not type(None)] if union else [annotation]
    if len(members) == 1 and members[0] in (bool, int, float, str):
        return members[0]
    if len(members) == 1 and typing.get_origin(members[0]) is list:
        return list[str]
    if all(typing.get_origin(m) is typing.Literal for m in members):
        return str
    return "yaml"


def _option_params() -> list[inspect.Parameter]:
    params = []
    for name, (annotation, field) in {**GENERATE_OPTIONS, **DRAFT_OPTIONS}.items():
        kind = _cli_type(annotation)
        py = str if kind == "yaml" else kind
        default = field.get_default(call_default_factory=True)
        shown = "" if default in (None, [], False) else f" [default: {default}]"
        decls = [flag(name) + (f"/--no-{name.replace('_', '-')}" if py is bool else ""), *ALIASES.get(name, [])]
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=Optional[py],
                                        default=typer.Option(None, *decls, help=(field.description or "") + shown,
                                                             show_default=False)))
    return params


def generate(prompt: str, model: str, dtype: str, device: str, weights: str, seed: int | None, chat: bool, system: str | None,
             as_json: bool, speculative: str | None, draft: str | None, overrides: list[str],
             options: dict[str, Any], out: Console, err: Console) -> None:
    """Build the one-run manifest, validate it, run it and print the result."""
    from caramba.manifest.overrides import apply_overrides
    from caramba.manifest.yaml_lines import parse_value
    from caramba.manifest.schema import Manifest
    from caramba.model.zoo import inspect_source, load_model, resolve_device
    from caramba.runners.lifecycle import Transient
    from caramba.runners.preflight import check_run
    from caramba.runners.registry import get

    given = {k: v for k, v in options.items() if v is not None and v != []}
    for name, (annotation, _) in {**GENERATE_OPTIONS, **DRAFT_OPTIONS}.items():
        if name in given and _cli_type(annotation) == "yaml":
            given[name] = parse_value(given[name], flag(name))
    if system is not None and not chat:
        raise UserError("--system needs --chat")
    drafting = [n for n in given if n in DRAFT_OPTIONS]
    if speculative is None and (drafting or draft is not None):
        raise UserError(f"{', '.join(flag(n) for n in drafting) or '--draft'} need --speculative KIND")
    if speculative is not None:
        if speculative not in DRAFT_KINDS:
            raise UserError(f"--speculative {speculative!r}: choose one of {', '.join(DRAFT_KINDS)}")
        if (speculative == "model") != (draft is not None):
            raise UserError("--speculative model needs --draft SRC (a model with the same tokenizer); "
                            "--draft is only used with --speculative model")
        if "spec_k" in given and "spec_k_max" not in given:
            given["spec_k_max"] = max(16, given["spec_k"])
    mode = "generate" if speculative is None else "speculative"
    section = {"prompts": [prompt], "temperature": 0.0, **given, "chat": chat, "system_prompt": system,
               "stream": not as_json}
    if speculative is not None:
        section |= {"draft": speculative, "baseline": False}
    _check_options(section, mode)
    run = {"id": "generate", "mode": mode, "seed": seed, mode: section}
    if draft is not None:
        run["draft"] = {"source": draft}
    data = {"version": 1, "name": "generate", "defaults": {"model": {"source": model, "dtype": dtype, "device": device, "weights": weights}},
            "targets": [{"type": "experiment", "name": "cli", "runs": [run]}]}
    apply_overrides(data, [_run_path(o, mode) for o in overrides])
    try:
        manifest = Manifest.model_validate(data)
    except ValidationError as e:
        raise UserError("; ".join(_describe(problem) for problem in e.errors(include_url=False))) from None
    (resolved,) = list(manifest.iter_runs())
    for spec in (resolved.model, resolved.draft):
        if spec is not None:
            inspect_source(spec.source)   # path and config: one clear error before loading weights
            resolve_device(spec.device)
    check_run(resolved, mode)   # as caramba run's preflight: the weights whole, the tokenizer in the vocabulary, the mode's own checks
    # --json: stdout holds the one object and stderr only warnings (the runner prints to a quiet console).
    console = Console(quiet=True) if as_json else out
    window = getattr(resolved.run.settings, "decode_local_window", None)
    if as_json and window is not None:
        from caramba.infer.plan import window_warning

        err.print(f"[yellow]warning: {escape(window_warning(window))}[/yellow]")
    loaded = load_model(resolved.model.source, resolved.model.dtype, resolved.model.device, progress=not as_json,
                        weights=resolved.model.weights)
    extra = {}
    if resolved.draft is not None:
        d = resolved.draft
        extra["draft"] = load_model(d.source, d.dtype, d.device, progress=not as_json, weights=d.weights)
    try:
        result = get(mode).run(loaded, resolved.run.settings, resolved.run.seed, Transient(), console, **extra)
    except ValueError as e:   # e.g. the prompt does not fit max_seq_len
        raise UserError(str(e)) from None
    row, summary = result["prompts"][0], result["summary"]
    if as_json:
        m = resolved.model
        print(json_text({**row, "model": {"source": m.source, "path": str(loaded.path), "sha256": loaded.content_hash,
                                           "dtype": m.dtype, "weights": m.weights,
                                           **({"native_weights": loaded.model.native_weights}
                                              if getattr(loaded.model, "native_weights", None) is not None else {})},
                          "cache_kind": summary.get("cache_kind"), "cache_policy": summary.get("cache_policy"),
                          "cache_auto": summary.get("cache_auto"), "kernels": kernel_status(),
                          "kernel_builds": kernel_builds(),
                          **({"speculative": speculative} if speculative else {})}))
        return
    if row.get("beams") is None:
        err.print(f"[dim]{len(row['output_ids'])} tokens, prefill {row['prefill_s'] * 1000:.0f} ms, "
                  f"decode {row['decode_tok_s']:.1f} tok/s, stop: {escape(row['finish_reason'])}[/dim]")
    if speculative:
        err.print(f"[dim]{speculative}: acceptance {row['acceptance_rate']:.2f}, "
                  f"{row['tokens_per_target_forward']:.2f} tokens per target forward[/dim]")


def _check_options(section: dict[str, Any], mode: str) -> None:
    """The engine's own checks, with the failing option named as its flag (pydantic's come later)."""
    from caramba.options import OptionError

    config = ENGINE_CONFIGS[mode]
    engine = {k: v for k, v in section.items() if k in flat_paths(config)}
    try:
        config(**engine)
    except OptionError as e:
        name = e.name.rpartition(".")[2]
        raise UserError(f"{flag(name)} {e.value!r}: {e.why}") from None
    except (ValueError, TypeError) as e:
        raise UserError(str(e).split(": ", 1)[-1]) from None


def _run_path(override: str, mode: str) -> str:
    """--set below the run: 'generate.x=1' / 'model.dtype=...' / 'x=1' (an option of the run's section)."""
    key = override.partition("=")[0].strip()
    head = key.split(".")[0]
    if head in ("model", "draft", "seed", "generate", "speculative", "notes", "expect"):
        return f"targets.0.runs.0.{override.strip()}"
    return f"targets.0.runs.0.{mode}.{override.strip()}"


def _describe(problem: dict) -> str:
    loc = [str(p) for p in problem["loc"]]
    name = loc[-1] if loc else ""
    if loc[:2] == ["defaults", "model"] and len(loc) == 3:        # --model, --dtype, --device, --weights
        where = "--model" if name == "source" else flag(name)
    else:
        where = flag(name) if name in GENERATE_OPTIONS or name in DRAFT_OPTIONS else ".".join(loc[4:]) or "generate"
    return f"{where}: {problem['msg'].removeprefix('Value error, ')}"


OPTION_PARAMS = _option_params()


def signature(weights_help: str) -> inspect.Signature:
    """`caramba generate`'s parameters: the prompt, the model, the run's own flags, then OPTION_PARAMS."""
    def opt(default, *decls, **kw):
        return typer.Option(default, *decls, **kw)

    kw = inspect.Parameter.KEYWORD_ONLY
    fixed = [
        inspect.Parameter("prompt", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str,
                          default=typer.Argument(..., help="The prompt text.")),
        inspect.Parameter("model", kw, annotation=str, default=opt("smollm2-135m", help="smollm2-135m, a .gguf file or an HF directory.")),
        inspect.Parameter("dtype", kw, annotation=str, default=opt("float32", help="float32, bfloat16 or float16.")),
        inspect.Parameter("device", kw, annotation=str, default=opt("cpu", help="cpu, cuda, mps or auto.")),
        inspect.Parameter("weights", kw, annotation=str, default=opt("fp32", help=weights_help)),
        inspect.Parameter("seed", kw, annotation=Optional[int], default=opt(None, help="Sampling seed.")),
        inspect.Parameter("chat", kw, annotation=bool, default=opt(False, "--chat", help="Wrap the prompt in the model's chat template.")),
        inspect.Parameter("system", kw, annotation=Optional[str], default=opt(None, help="System message (with --chat).")),
        inspect.Parameter("as_json", kw, annotation=bool, default=opt(False, "--json", help="Print one JSON object (the run's result row) instead of streaming text.")),
        inspect.Parameter("speculative", kw, annotation=Optional[str], default=opt(None, help="Speculative decoding with this draft: prompt_lookup, self_int8, layer_skip or model (needs --draft).")),
        inspect.Parameter("draft", kw, annotation=Optional[str], default=opt(None, help="The draft model for --speculative model (same forms as --model).")),
        inspect.Parameter("overrides", kw, annotation=Optional[list[str]], default=opt(None, "--set", help="Override a field below the run: generate.decode_q_chunk=512, model.dtype=bfloat16; repeatable.")),
    ]
    return inspect.Signature(fixed + OPTION_PARAMS)
