"""Run a decode-bench grid: every (prompt length, batch size, cache kind, decode plan, press) cell, for caramba and
optionally the HF reference, with rich progress; rows come back as flat dicts."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from rich.console import Console
from rich.progress import Progress

from caramba.progress import Steps

from caramba.bench.measure import Cell, CellResult, measure_caramba, measure_hf, prompt_batch


@dataclass(frozen=True)
class Grid:
    prompt_lens: Sequence[int] = (128, 512, 2048)
    batch_sizes: Sequence[int] = (1,)
    cache_kinds: Sequence[str] = ("fp32",)
    new_tokens: int = 32
    warmup: int = 1
    repeats: int = 3
    decode_plans: Sequence[str] = ("none",)   # caramba.infer.plan.parse_plan's forms
    presses: Sequence[str] = ("none",)        # caramba.press.PressConfig.parse's forms

    def cells(self) -> list[Cell]:
        return [Cell(L, B, kind, self.new_tokens, plan, press)
                for L, B, kind, plan, press in itertools.product(self.prompt_lens, self.batch_sizes, self.cache_kinds,
                                                                 self.decode_plans, self.presses)]


def run_grid(model, text_ids: list[int], grid: Grid, hf_model=None, progress: bool = True) -> list[dict]:
    """Measure every cell; with hf_model, the same cells through HF generate (batch 1 and the
    model's own cache only: HF has no counterpart of caramba's cache kinds), with the ratio.

    Both models then share this process, so every cell's peak_rss_mb includes the other model's
    weights: rows say so in `peak_rss_includes`, and `cell_rss_mb` (what each cell added) is the
    memory to compare."""
    rows: list[dict] = []
    cells = grid.cells()
    hf_cells = {(c.prompt_len, c.batch_size) for c in cells if c.batch_size == 1} if hf_model is not None else set()
    with Progress(console=Console(stderr=True), disable=not progress) as bar:  # stdout stays clean for --json
        steps = Steps(bar, "decode-bench cells", len(cells) + len(hf_cells))
        hf_rates: dict[tuple[int, int], dict] = {}
        for L, B in sorted(hf_cells):
            steps.describe(f"hf ctx={L} batch={B}")
            ref_cell = Cell(L, B, "hf-default", grid.new_tokens)
            ref = measure_hf(hf_model, ref_cell, prompt_batch(text_ids, L, B), grid.warmup, grid.repeats)
            hf_rates[(L, B)] = {**ref.summary(), "peak_rss_includes": "caramba and HF reference weights"}
            rows.append(hf_rates[(L, B)])
            steps.advance()
        for cell in cells:
            steps.describe(f"caramba {cell.label}")
            result: CellResult = measure_caramba(model, cell, prompt_batch(text_ids, cell.prompt_len, cell.batch_size),
                                                 grid.warmup, grid.repeats)
            row = result.summary()
            if hf_model is not None:
                row["peak_rss_includes"] = "caramba and HF reference weights"
            ref = hf_rates.get((cell.prompt_len, cell.batch_size))
            if ref is not None:
                row["decode_tok_s_vs_hf"] = row["decode_tok_s"] / ref["decode_tok_s"]
                row["ttft_vs_hf"] = row["ttft_s"] / ref["ttft_s"]
            rows.append(row)
            steps.advance()
    return rows
