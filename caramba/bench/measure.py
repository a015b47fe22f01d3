"""Measure one decode-bench cell: prefill latency, per-token decode latency, memory, cache bytes.

A cell is (prompt length, batch size, cache kind, new tokens). Each cell is warmed up, then
repeated; every repeat times the first token (prefill, TTFT) and each later token separately,
so percentiles come from real per-token samples rather than an average.

Peak RSS is per cell: Linux lets a process reset its high-water mark (/proc/self/clear_refs,
"5"), so VmHWM after the cell is that cell's peak. Where that is not possible the process-wide
peak is reported and flagged as such. RSS is the whole process's: everything resident when the
cell starts counts (the weights, and with an HF reference loaded beside the model, its weights
too), so each cell also reports `cell_rss_mb`, its peak above the RSS it started from: what the
cell itself added (cache, activations), comparable between caramba and HF in one process.
Memory is in MiB (2^20 bytes), as /proc reports it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from caramba.infer import CacheConfig, GenerateConfig, Generator
from caramba.model.backend import ThreadChoice
from caramba.press import PressConfig
from caramba.infer.plan import parse_plan, quiet_window


@dataclass(frozen=True)
class Cell:
    prompt_len: int
    batch_size: int
    cache_kind: str
    new_tokens: int
    decode_plan: str = "none"   # caramba.infer.plan.parse_plan's form: none, auto, chunk=N, window=W
    press: str = "none"         # caramba.press.PressConfig.parse's form: none, snapkv@0.5, ada_tova@0.25

    @property
    def label(self) -> str:
        plan = "" if self.decode_plan == "none" else f" plan={self.decode_plan}"
        press = "" if self.press == "none" else f" press={self.press}"
        return f"ctx={self.prompt_len} batch={self.batch_size} cache={self.cache_kind}{plan}{press}"


@dataclass
class CellResult:
    cell: Cell
    impl: str                                   # "caramba" or "hf"
    ttft_s: list[float] = field(default_factory=list)            # one per repeat
    token_latency_s: list[float] = field(default_factory=list)   # every decode step, all repeats
    peak_rss_mb: float | None = None            # MiB, the whole process's resident set at its peak
    peak_rss_scope: str = "cell"                # "cell" or "process" (could not reset the mark)
    cell_rss_mb: float | None = None            # MiB the cell added above the RSS it started from
    cuda_max_allocated_mb: float | None = None
    cache_bytes: int | None = None
    plan: dict | None = None                    # the resolved decode plan (caramba only)
    decode_step: str | None = None              # the path caramba's steps took: "c", "torch" or both (caramba.model.backend)

    def summary(self) -> dict:
        c, lat = self.cell, sorted(self.token_latency_s)
        ttft = statistics.median(self.ttft_s)
        step = statistics.median(lat) if lat else float("nan")
        return {
            "impl": self.impl, **asdict(c),
            "ttft_s": ttft,
            "prefill_tok_s": c.prompt_len * c.batch_size / ttft,
            "decode_p50_ms": 1000 * percentile(lat, 50),
            "decode_p90_ms": 1000 * percentile(lat, 90),
            "decode_p99_ms": 1000 * percentile(lat, 99),
            "decode_tok_s": c.batch_size / step,
            "peak_rss_mb": self.peak_rss_mb,
            "peak_rss_scope": self.peak_rss_scope,
            "cell_rss_mb": self.cell_rss_mb,
            "cuda_max_allocated_mb": self.cuda_max_allocated_mb,
            "cache_bytes": self.cache_bytes,
            # What the plan resolved to; exact=False: a window changed outputs.
            **({f"plan_{k}": self.plan[k] for k in ("q_chunk", "window", "ring")} | {"exact": self.plan["exact"]}
               if self.plan else {}),
            **({"decode_step": self.decode_step} if self.decode_step else {}),
            "repeats": len(self.ttft_s),
            "decode_samples": len(lat),
        }


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile of already sorted values (numpy's default method)."""
    if not sorted_values:
        return float("nan")
    pos = (len(sorted_values) - 1) * q / 100
    lo, hi = int(pos), min(int(pos) + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def prompt_batch(text_ids: list[int], prompt_len: int, batch_size: int) -> list[list[int]]:
    """batch_size prompts of exactly prompt_len real-text tokens (rows start at different offsets
    so they are not identical; the text is repeated when it is shorter than needed)."""
    if not text_ids:
        raise ValueError("the bench text tokenized to nothing")
    need = prompt_len + batch_size * 7
    ids = (text_ids * (need // len(text_ids) + 1))[:need]
    return [ids[7 * r : 7 * r + prompt_len] for r in range(batch_size)]


class PeakMemory:
    """Peak RSS (and CUDA max allocated) over a block of work."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rss_mb: float | None = None
        self.start_mb: float | None = None
        self.scope = "cell"
        self.cuda_mb: float | None = None

    def __enter__(self) -> "PeakMemory":
        self.start_mb = _proc_status_mb("VmRSS:")
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            self.scope = "process"
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc) -> None:
        self.rss_mb = _proc_status_mb("VmHWM:")
        if self.rss_mb is None:
            import resource

            self.rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
            self.scope = "process"
        if self.device.type == "cuda":
            self.cuda_mb = torch.cuda.max_memory_allocated(self.device) / 2**20


    @property
    def added_mb(self) -> float | None:
        """Peak above the RSS at the start (None where only a process-wide peak is known)."""
        if self.scope != "cell" or self.rss_mb is None or self.start_mb is None:
            return None
        return max(0.0, self.rss_mb - self.start_mb)


def _proc_status_mb(field_name: str) -> float | None:
    """A /proc/self/status memory field (kB there, i.e. KiB) in MiB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_tokens(steps: Iterator, device: torch.device) -> tuple[float, list[float]]:
    """Drive a token iterator; return (time to first token, latency of every later token)."""
    t0 = time.perf_counter()
    stamps = []
    for _ in steps:
        sync_device(device)
        stamps.append(time.perf_counter())
    if not stamps:
        raise RuntimeError("the generator produced no tokens")
    return stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:])]


def measure_caramba(model, cell: Cell, prompts: list[list[int]], warmup: int, repeats: int) -> CellResult:
    plan, press = parse_plan(cell.decode_plan), PressConfig.parse(cell.press)
    config = GenerateConfig(max_new_tokens=cell.new_tokens, temperature=0.0, eos_token_id=None,
                            max_seq_len=cell.prompt_len + cell.new_tokens, cache_kind=cell.cache_kind,
                            decode_plan=plan.plan, decode_q_chunk=plan.q_chunk, decode_local_window=plan.local_window,
                            cache=CacheConfig(kind=cell.cache_kind, press=press))

    decode_threads = ThreadChoice()   # the C step's thread choice carries from the warm-up to the repeats

    def one() -> tuple[float, list[float], Generator]:
        with quiet_window():   # the runner warns once; cells carry exact=False
            gen = Generator(model, config, decode_threads=decode_threads)
        ttft, lat = timed_tokens(gen.generate_iter(prompts), model.device)
        return ttft, lat, gen

    def inspect(gen: Generator, result: CellResult) -> None:
        result.cache_bytes, result.plan, result.decode_step = gen.cache.nbytes, gen.plan.to_dict(), gen.backend.path

    return _measure("caramba", cell, one, warmup, repeats, model.device, inspect)


def measure_hf(hf_model, cell: Cell, prompts: list[list[int]], warmup: int, repeats: int) -> CellResult:
    """The same cell through HF `generate`, timing each token with a streamer callback."""
    from transformers.generation.streamers import BaseStreamer

    device = hf_model.device
    x = torch.tensor(prompts, device=device)

    class Stamps(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.calls = 0

        def put(self, value) -> None:
            self.calls += 1
            if self.calls > 1:  # the first put() is the prompt itself
                sync_device(device)
                self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    def one() -> tuple[float, list[float], None]:
        s = Stamps()
        t0 = time.perf_counter()
        with torch.inference_mode():
            hf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=cell.new_tokens,
                              min_new_tokens=cell.new_tokens, do_sample=False, pad_token_id=0, streamer=s)
        return s.times[0] - t0, [b - a for a, b in zip(s.times, s.times[1:])], None

    if cell.batch_size > 1:
        raise ValueError("HF streamers only support batch size 1; run the HF reference at batch 1")
    return _measure("hf", cell, one, warmup, repeats, device)


def _measure(impl: str, cell: Cell, one: Callable, warmup: int, repeats: int, device: torch.device,
             inspect: Callable | None = None) -> CellResult:
    """inspect(last generator, result): fills what only the generator knows (cache bytes, plan)."""
    for _ in range(warmup):
        one()
    result = CellResult(cell, impl)
    with PeakMemory(device) as peak:
        for _ in range(repeats):
            ttft, lat, gen = one()
            result.ttft_s.append(ttft)
            result.token_latency_s.extend(lat)
    result.peak_rss_mb, result.peak_rss_scope, result.cuda_max_allocated_mb = peak.rss_mb, peak.scope, peak.cuda_mb
    result.cell_rss_mb = peak.added_mb
    if inspect is not None:
        inspect(gen, result)
    return result
