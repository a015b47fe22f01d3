"""Preflight's resource checks: the runs directory (a writable directory with room for the
records a manifest will write) and memory (what each run will hold against what the machine has).
Both run before any record is written, so a run that cannot fit exits 2 naming the field to
change instead of failing after earlier runs were recorded.

Estimates, said plainly: a record is its manifest, env.json, log and DONE (16 KiB) plus
result.json (~64 bytes per generated token: id, text, per-token timing; ~2 KiB and the samples per
bench cell; plots). Memory is the weights (the model's parameter count at the width `weights`
and `dtype` give), the KV cache (the cache's own bytes_per_token, on a storage-free meta model,
times max_seq_len and the rows decoded at once) and a bound for activations (one layer's working
set for a prefill of the widest batch, plus the batch's logits). Refused only when that sum is
over MemAvailable: a bound, not a measurement.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from caramba.errors import UserError
from caramba.manifest import ResolvedRun
from caramba.model.transformer import Transformer
from caramba.model.zoo import inspect_source
from caramba.runners import registry
from caramba.runs import entry_kind, runs_root

KIB, MIB, GIB = 1024, 1024**2, 1024**3
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_WEIGHT_BYTES = {"q8_0": 34 / 32, "q4_0": 18 / 32}   # llama.cpp blocks: scale + 32 values


# ---- the runs directory ------------------------------------------------------------------------

def check_runs_dir(manifest_name: str, runs: list[ResolvedRun], root: str | Path | None = None) -> None:
    """UserError (exit 2) when the runs directory is not a directory, cannot be written, holds
    something other than directories on the way to the records, or has less room than the
    records of `runs` need."""
    base = runs_root(root)
    named = "" if root else "$CARAMBA_RUNS_DIR, " if os.environ.get("CARAMBA_RUNS_DIR") else ""
    where = f"{named}the runs directory"
    existing = base
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():   # the runs root, or the first part of its path that exists, is not a directory
        kind = entry_kind(existing)
        raise UserError(f"{where} {base}: {existing} is a {kind}, not a directory; set CARAMBA_RUNS_DIR to a "
                        "directory (or remove it)")
    if not os.access(existing, os.W_OK | os.X_OK):   # EROFS too: access() reports a read-only filesystem
        ro = " (a read-only filesystem)" if _read_only(existing) else ""
        raise UserError(f"{where} {base}: {existing} is not writable{ro}; make it writable or set CARAMBA_RUNS_DIR "
                        "to a directory that is")
    for part in {base / manifest_name, *(base / manifest_name / r.target for r in runs)}:
        kind = entry_kind(part) if os.path.lexists(part) else None
        if kind not in (None, "directory"):
            raise UserError(f"{part} is a {kind}, not a directory of records; caramba will not follow or replace "
                            "it: remove it and run again")
    # Each run's new record (a redo's is built beside the old one, which already has its room);
    # runs that turn out to be skipped are counted too: an over-estimate by design, never a guess low.
    need = sum(record_bytes(r) for r in runs)
    free = shutil.disk_usage(existing).free
    if need > free:
        raise UserError(f"{where} {base} has {_size(free)} free; the {len(runs)} run(s) need about {_size(need)} for "
                        "their records; free some space or set "
                        "CARAMBA_RUNS_DIR to a disk with room")


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        return False


def record_bytes(r: ResolvedRun) -> int:
    """About how many bytes the record of `r` takes (its mode's estimate; see the module's docstring)."""
    return _mode(r).record_bytes(r)


def _size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB" if n >= MIB else f"{n / KIB:.0f} KiB"


# ---- memory ------------------------------------------------------------------------------------

def mem_available() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None where there is no such file)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as file:
            for line in file:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * KIB
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_memory(runs: list[ResolvedRun], configs: dict | None = None, available: int | None = None) -> None:
    """UserError (exit 2) naming the run and the field to lower when a CPU run's estimated
    memory (weights + KV cache + activations) is over what the machine has available.
    `configs`: model source -> ModelConfig (filled from inspect_source, once per source)."""
    configs = {} if configs is None else configs
    available = mem_available() if available is None else available
    if available is None:
        return
    for r in runs:
        if r.model.device not in ("cpu", "auto"):
            continue   # an accelerator's memory is its own; caramba does not size it here
        if r.model.source not in configs:
            configs[r.model.source] = inspect_source(r.model.source)
        if r.draft is not None and r.draft.source not in configs:
            configs[r.draft.source] = inspect_source(r.draft.source)
        need = run_memory(r, configs)
        total = sum(v for v, _ in need.values())
        if total <= available:
            continue
        part, (size, field) = max(need.items(), key=lambda kv: kv[1][0])
        parts = ", ".join(f"{name} {_size(v)}" for name, (v, _) in need.items())
        hint = ""
        max_seq_len = _mode(r).workload(r).max_seq_len
        if part != "weights" and max_seq_len is not None:   # KV and activations grow with max_seq_len
            per_slot = (need["KV cache"][0] + need["activations"][0]) / max_seq_len
            fits = int((available - need["weights"][0]) / per_slot) if available > need["weights"][0] else 0
            hint = f" (at this batch, about {_mode(r).section}.max_seq_len={fits} fits)" if fits >= 2 else ""
        raise UserError(f"run {r.target}/{r.run.id}: needs about {_size(total)} of memory ({parts}), more than the "
                        f"{_size(available)} this machine has available (MemAvailable); the {part} is the largest: "
                        f"lower {field}{hint}")


def run_memory(r: ResolvedRun, configs: dict) -> dict[str, tuple[int, str]]:
    """{part: (bytes, the field that sizes it)} for the weights, KV cache and activations of `r`."""
    cfg = configs[r.model.source]
    params, kv_per_token = _shape_costs(cfg, r.model.dtype)
    weights = _weight_bytes(params, r.model.weights, r.model.dtype)
    work = _mode(r).workload(r)
    length, batch, field, seq_field = work.length, work.rows, work.rows_field, work.length_field
    weights *= work.weight_copies
    kv = kv_per_token * batch * length   # an fp32 cache: the largest kind a run can ask for
    width = cfg.n_heads * cfg.head_dim + 2 * cfg.n_kv_heads * cfg.head_dim + 2 * cfg.intermediate_size + 4 * cfg.dim
    activations = batch * length * width * 4 + batch * cfg.vocab_size * 4 * 2
    sized_by = f"{seq_field} or {field}" if batch > 1 else seq_field   # at batch 1 the length is what to lower
    if r.draft is not None:   # a speculative run's draft model: its weights and its own cache beside the target's
        d_params, d_kv = _shape_costs(configs[r.draft.source], r.draft.dtype)
        weights += _weight_bytes(d_params, r.draft.weights, r.draft.dtype)
        kv += d_kv * batch * length
    for source, kind in work.extra_models:   # held at once with the run's model (an eval's weight candidates)
        if source not in configs:
            configs[source] = inspect_source(source)
        weights += _weight_bytes(_shape_costs(configs[source], r.model.dtype)[0], kind, r.model.dtype)
    return {"KV cache": (int(kv), sized_by), "weights": (int(weights), "model.dtype or model.weights"),
            "activations": (int(activations), sized_by)}


def _weight_bytes(params: int, weights: str, dtype: str) -> float:
    if weights in ("native", "native_i16"):
        return params * 1.2   # a GGUF's own blocks: at most ~8.5 bits a weight, plus the fp32 norms
    return params * _WEIGHT_BYTES.get(weights, _DTYPE_BYTES.get(dtype, 4))


def _mode(r: ResolvedRun) -> registry.Mode:
    return registry.get(r.run.mode)


_SHAPES: dict = {}


def _shape_costs(cfg, dtype: str) -> tuple[int, int]:
    """(parameter count, fp32 KV bytes per token for one row) of a config, from a storage-free
    model on the meta device and its cache's own bytes_per_token."""
    key = (repr(cfg), dtype)
    if key not in _SHAPES:
        with torch.device("meta"):
            model = Transformer(cfg)
            params = sum(p.numel() for p in model.parameters())
            bytes_per_token = model.new_cache(1, 1, "fp32").bytes_per_token()
        _SHAPES[key] = (params, bytes_per_token)
    return _SHAPES[key]
