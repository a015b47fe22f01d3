"""`mode: decode-bench`: a grid of measured cells, written as JSON, CSV and PNG plots."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from caramba.bench.grid import Grid, run_grid
from caramba.bench.report import write_csv, write_plots
from caramba.errors import UserError
from caramba.infer.plan import parse_plan
from caramba.manifest import ResolvedRun
from caramba.manifest.schema import BenchSettings
from caramba.model.zoo import LoadedModel
from caramba.press import PressConfig
from caramba.runners.generate import check_pressable
from caramba.runners.registry import BASE_RECORD, KIB, Mode, Workload, is_number, register
from caramba.runs import RunDir

CORPUS = Path(__file__).resolve().parent.parent / "data" / "corpus.txt"


def bench_text_ids(loaded: LoadedModel, text_file: str | None) -> list[int]:
    path = Path(text_file) if text_file else CORPUS
    if not path.is_file():
        raise UserError(f"bench text file {path} does not exist; set bench.text to a text file")
    return loaded.tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False)


def load_hf_reference(loaded: LoadedModel):
    """The same weights through transformers, as the reference implementation."""
    try:
        import transformers
    except ImportError:
        raise UserError("reference: hf needs transformers: pip install -e '.[test]'") from None
    transformers.utils.logging.disable_progress_bar()   # its loading bars would land in the bench output
    transformers.utils.logging.set_verbosity_error()
    path = loaded.path
    kwargs = {"dtype": loaded.model.dtype}
    if path.is_file():  # a GGUF: transformers dequantizes it on its own
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kwargs)
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    return hf.eval().to(loaded.model.device)


def run_decode_bench(loaded: LoadedModel, settings: BenchSettings, seed: int | None, record: RunDir, console: Console) -> dict[str, Any]:
    grid = Grid(settings.prompt_lens, settings.batch_sizes, settings.cache_kinds, settings.new_tokens,
                settings.warmup, settings.repeats, settings.decode_plans, settings.presses)
    windows = [p for p in settings.decode_plans if parse_plan(p).local_window is not None]
    if windows:
        record.log(f"warning: decode plans {', '.join(windows)} use sliding-window attention, which changes outputs")
        console.print(f"[yellow]warning: decode plans {', '.join(windows)} use sliding-window attention, "
                      "which changes outputs (cells show exact=False)[/yellow]")
    if settings.reference == "hf":
        console.print("[dim]loading the same weights through transformers (the reference)...[/dim]")
    hf = load_hf_reference(loaded) if settings.reference == "hf" else None
    rows = run_grid(loaded.model, bench_text_ids(loaded, settings.text), grid, hf_model=hf)
    write_csv(record.path / "cells.csv", rows)
    plots = write_plots(record.path, rows) if settings.plots else []
    if settings.plots and not plots:
        record.log("plots skipped: matplotlib is not installed (pip install matplotlib)")
    console.print(cells_table(rows))
    record.log(f"{len(rows)} cells measured; plots: {', '.join(p.name for p in plots) or 'none'}")
    return {"mode": "decode-bench", "cells": rows, "plots": [p.name for p in plots]}


def cells_table(rows: list[dict]) -> Table:
    shared = any(r.get("peak_rss_includes") for r in rows)
    note = "; peak RSS counts both models (one process): compare 'cell MiB', what each cell added" if shared else ""
    table = Table(title=f"decode-bench (medians; latency per decode step{note})")
    pressed = any(r.get("press", "none") != "none" for r in rows)   # rows that differ only by their press
    for col in ("impl", "ctx", "batch", "cache", "plan", *(["press"] if pressed else []), "TTFT ms", "prefill tok/s",
                "p50 ms", "p90 ms", "p99 ms", "decode tok/s", "vs HF", "peak RSS MiB", "cell MiB", "cache MiB"):
        table.add_column(col, justify="left" if col in ("impl", "cache", "plan", "press") else "right")
    for r in rows:
        ratio = r.get("decode_tok_s_vs_hf")
        table.add_row(
            r["impl"], str(r["prompt_len"]), str(r["batch_size"]), r["cache_kind"], r.get("decode_plan", "none"),
            *([r.get("press", "none")] if pressed else []),
            f"{1000 * r['ttft_s']:.1f}",
            f"{r['prefill_tok_s']:.0f}", f"{r['decode_p50_ms']:.1f}", f"{r['decode_p90_ms']:.1f}", f"{r['decode_p99_ms']:.1f}",
            f"{r['decode_tok_s']:.1f}", f"{ratio:.2f}x" if ratio else "", f"{r['peak_rss_mb']:.0f}",
            f"{r['cell_rss_mb']:.0f}" if r.get("cell_rss_mb") is not None else "",
            f"{r['cache_bytes'] / 2**20:.1f}" if r.get("cache_bytes") is not None else "",
        )
    return table


class DecodeBenchMode(Mode):
    """`mode: decode-bench` (and `caramba bench`, its one-off form: caramba.cli_bench)."""

    name = "decode-bench"
    columns = ("decode_tok_s", "ttft_s", "peak_rss_mb", "cache_bytes")
    run = staticmethod(run_decode_bench)

    def record_bytes(self, r: ResolvedRun) -> int:
        s = r.run.settings   # ~2 KiB and the samples per cell, and the plots
        cells = len(s.prompt_lens) * len(s.batch_sizes) * len(s.cache_kinds) * len(s.decode_plans) * len(s.presses)
        cells *= 2 if s.reference == "hf" else 1
        return BASE_RECORD + cells * (2 * KIB + 24 * s.repeats * s.new_tokens) + (_PLOTS if s.plots else 0)

    def preflight(self, r: ResolvedRun, where: str, sources) -> None:
        s = r.run.settings
        for text in s.presses:
            press = PressConfig.parse(text)
            if press.enabled:
                check_pressable(press, sources.config(r.model.source), f"{where}: {self.section}.presses")
                if min(s.prompt_lens) < press.min_context():
                    raise UserError(f"{where}: {self.section}.presses: {text} scores contexts of at least "
                                    f"{press.min_context()} tokens; prompt_lens has {min(s.prompt_lens)}: use longer "
                                    "prompts or another press")

    def workload(self, r: ResolvedRun) -> Workload:
        s = r.run.settings   # with reference: hf, transformers' copy of the model beside ours
        return Workload(max(s.prompt_lens) + s.new_tokens, max(s.batch_sizes), f"{self.section}.batch_sizes",
                        f"{self.section}.prompt_lens", weight_copies=2 if s.reference == "hf" else 1)

    def metrics(self, result: dict[str, Any]) -> dict[str, Any]:
        """One row per run: the cells' median speed and latency, their peak memory."""
        cells = [c for c in result.get("cells") or [] if isinstance(c, dict)]
        out = {}
        for key, how in (("decode_tok_s", statistics.median), ("ttft_s", statistics.median), ("peak_rss_mb", max),
                         ("cache_bytes", max)):
            values = [c[key] for c in cells if is_number(c.get(key))]
            if values:
                out[key] = how(values)
        return out


_PLOTS = 3 * 150 * KIB
register(DecodeBenchMode())
