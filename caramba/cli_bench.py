"""`caramba bench`: one `decode-bench` run from flags, kept as a one-off record.

The flags are a manifest's `bench:` section (BenchSettings validates them, each error named as
its flag); the run is the mode's own runner, through the one run lifecycle
(caramba.runners.lifecycle.one_off): a fresh record under runs/bench/cli/<UTC time>/
(<UTC time>-2, ... when another bench started in the same second), built aside, DONE last.
The record holds env.json, settings.json (the flags), result.json, cells.csv, plots and log.txt.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape

from caramba.errors import UserError
from caramba.runs import json_text


def int_list(text: str, option: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{option} takes comma-separated integers, e.g. 128,512,2048 (got {text!r})") from None


def bench_settings(prompt_lens: str, batch_sizes: str, cache_kinds: str, decode_plans: str, text: str | None,
                   **rest: Any):
    """The flags as BenchSettings; a value it refuses is a UserError naming the flag."""
    from caramba.manifest.schema import BenchSettings

    try:
        return BenchSettings(
            prompt_lens=int_list(prompt_lens, "--prompt-lens"), batch_sizes=int_list(batch_sizes, "--batch-sizes"),
            cache_kinds=[k.strip() for k in cache_kinds.split(",") if k.strip()],
            decode_plans=[p.strip() for p in decode_plans.split(";") if p.strip()], text=text, **rest)
    except ValidationError as e:
        problems = "; ".join(f"--{'-'.join(str(p) for p in x['loc'][:1]).replace('_', '-')}: {x['msg']}" for x in e.errors())
        raise UserError(problems) from None


# The mode's field names as this command's flags, in its error messages.
_FLAG_NAMES = {"bench.presses": "--presses", "bench.text": "--text", "bench.prompt_lens": "--prompt-lens"}


def check_bench(model: dict[str, str], settings) -> None:
    """The run's preflight, as `caramba run` does it for a decode-bench run (the model's files,
    a press's window against the contexts, the text file): exit 2 before the model loads and
    before a record is made."""
    from caramba.manifest.schema import ModelSpec, ResolvedRun, Run
    from caramba.runners.preflight import check_run

    run = Run(id="bench", mode="decode-bench", bench=settings)
    try:
        spec = ModelSpec(**model)
    except ValidationError as e:
        raise UserError("; ".join(f"--{x['loc'][0]}: {x['msg']}" for x in e.errors())) from None
    try:
        check_run(ResolvedRun("cli", run, spec), "bench")
    except UserError as e:
        message = str(e).removeprefix("bench: ")
        for field, name in _FLAG_NAMES.items():
            message = message.replace(field, name)
        raise UserError(message) from None


def bench(model: dict[str, str], settings, as_json: bool, out: Console, err: Console) -> None:
    """Load the model, run the grid into a one-off record, print the cells (--json) and where the record is."""
    from caramba import __version__ as caramba_version
    from caramba.model.zoo import load_model
    from caramba.runners.lifecycle import one_off
    from caramba.runners.registry import get
    from caramba.runs import capture_env, library_versions

    check_bench(model, settings)
    loaded = load_model(model["source"], model["dtype"], model["device"], progress=not as_json, weights=model["weights"])
    result: dict[str, Any] = {}

    def write(record) -> None:
        record.write_json("env.json", capture_env(None, model["device"]))
        record.write_json("settings.json", {"model": model["source"], "dtype": model["dtype"], "device": model["device"],
                                            "weights": model["weights"], **settings.model_dump()})
        result.update(get("decode-bench").run(loaded, settings, None, record, err if as_json else out))
        result["model"] = {"source": model["source"], "path": str(loaded.path), "sha256": loaded.content_hash,
                           "dtype": model["dtype"], "weights": model["weights"]}
        result["versions"] = {"caramba": caramba_version, **library_versions()}
        record.write_json("result.json", result)

    record = one_off("bench", "cli", time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()), write)
    if as_json:
        print(json_text(result["cells"]))
    err.print(f"record: {escape(str(record.final))}")
