"""`caramba convert-dba`: a standard RoPE checkpoint converted into decoupled (DBA) attention
(caramba.model.dba_convert), with progress bars and the cache bytes per token it saves."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from caramba.errors import UserError


def convert(out_dir: Path, sem_dim: int, geo_dim: int, model: str, calib_text: Path | None, calib_tokens: int,
            force: bool, out: Console, err: Console) -> None:
    """Check the flags, convert, and print what was written and each cache kind's bytes per token."""
    from caramba.evaluation.evaluate import corpus_ids
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
    phases = {"calibrate": f"calibration pass ({len(calibration)} tokens)", "layers": "SVD of each layer's heads",
              "write": f"writing {out_dir}"}
    with _progress(err) as progress:
        conv = convert_loaded(loaded, sem_dim, geo_dim, out_dir, calibration, on_step=progress(phases))
    cfg = conv.config
    out.print(f"[green]wrote[/green] {escape(str(out_dir))}: sem_dim={cfg.sem_dim}, geo_dim={cfg.geo_dim} per head, "
              f"{len(calibration)} calibration tokens, SVD keeps {conv.sem_energy:.1%} of the semantic forms' energy")
    sizes = []
    for kind in ("fp16", "q8_0", "q4_0"):
        dba, qblock = cache_bytes_per_token(cfg, kind)
        std, _ = cache_bytes_per_token(loaded.model.config, kind, qblock)
        sizes.append(f"{kind}{f' (qblock {qblock})' if qblock != 32 else ''} {dba} (standard {std})")
    out.print("cache bytes/token (all layers, batch 1): " + ", ".join(sizes))


@contextmanager
def _progress(console: Console):
    """progress(descriptions) -> an on_step(phase, done, total) callback drawing one rich bar per
    phase, with elapsed time, for commands that would otherwise be silent for minutes."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=False) as bar:
        tasks: dict[str, int] = {}

        def for_phases(descriptions: dict[str, str]):
            def step(phase: str, done: int, total: int) -> None:
                if phase not in tasks:
                    tasks[phase] = bar.add_task(descriptions.get(phase, phase), total=total)
                bar.update(tasks[phase], completed=done, total=total)
            return step

        yield for_phases


def cache_bytes_per_token(cfg, kind: str, qblock: int | None = None) -> tuple[int, int]:
    """(bytes_per_token, qblock) of a 1-slot cache built on the meta device (no storage), with
    the largest qblock <= 32 that divides every stream's width when none is given."""
    import torch

    from caramba.cache import CacheSettings
    from caramba.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(cfg)
        for qb in [qblock] if qblock else [32, 16, 8, 4, 2]:
            try:
                return model.new_cache(1, 1, CacheSettings(kind, qblock=qb).spec()).bytes_per_token(), qb
            except ValueError:
                continue
    raise ValueError(f"no qblock divides the cache streams of sem_dim={cfg.sem_dim}, geo_dim={cfg.geo_dim}")
