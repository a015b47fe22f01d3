"""Decode plans: how long forwards are cut into query chunks, and whether attention is windowed.

q_chunk: a T-token forward (a prefill, a speculative verification) runs q_chunk tokens at a
time, each chunk writing its keys and values to the cache before the next one reads them. Peak
activations ([B, T, 2 * ffn] in the MLP, [B, H, T, S] attention scores where SDPA materializes
them) are bounded by the chunk instead of the prompt. A chunk's queries see the cache below them
plus themselves causally, the same keys the unchunked forward gives them, so outputs are the same
up to float rounding (different matmul shapes). One exception, recorded as exact=False: a
quantized kind's full-precision residual window holds the newest residual_len tokens *of each
chunk*, where the unchunked prefill holds the prompt's last residual_len.

local_window: sliding-window attention, each query sees the `window` newest slots up to its own.
It CHANGES OUTPUTS (the model was not trained that way), so it is never turned on by a plan on
its own: only an explicit decode_local_window sets it, the resolved plan says exact=False, and
the Generator warns. With a window the cache can be a ring buffer (caramba.cache.ring).

Plans: none = one forward per call (the unchunked path); fixed = decode_q_chunk / decode_local_window
as given; auto = by prompt length: up to bucket_short unchunked, up to bucket_mid chunks of
AUTO_CHUNK_MID, longer chunks of AUTO_CHUNK_LONG (benchmarks/prefill_memory.py measured them).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch

from caramba.options import OptionError, check_options, option

PLANS = ("auto", "fixed", "none")
# Chunk sizes auto picks above bucket_short (docs/decode-plans.md has the measurements). Long
# prompts: 512, the knee on SmolLM2 at 4096 tokens (256 cut the peak little further for +31%
# prefill time). Mid prompts: 1024, so at most two chunks up to 2048 tokens (a prompt that fits
# one chunk runs unchunked): no forward runs more than 1024 tokens, or 512 past bucket_mid.
AUTO_CHUNK_MID = 1024
AUTO_CHUNK_LONG = 512


class LocalWindowWarning(UserWarning):
    """Sliding-window attention is on: outputs differ from full attention."""


@dataclass(frozen=True)
class ResolvedPlan:
    """What one call actually runs with (recorded in run records and --json output)."""

    plan: str                # the plan it came from: auto | fixed | none
    prompt_len: int          # the input length it was resolved for
    q_chunk: int | None      # tokens per forward; None = the whole input at once
    window: int | None       # sliding-window span in slots; None = full attention
    ring: bool = False       # the cache is a ring buffer (memory flat past the window)
    exact: bool = True       # outputs equal plan none's (up to float rounding)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class DecodePlan:
    plan: str = option("none", choices=PLANS, name="decode_plan", help="auto, fixed or none: chunk long forwards")
    bucket_short: int = option(512, ge=1, name="decode_bucket_short",
                               help="auto: prompts up to this many tokens run unchunked")
    bucket_mid: int = option(2048, ge=1, name="decode_bucket_mid",
                             help="auto: up to this many in chunks of 1024, then 512")
    q_chunk: int | None = option(None, ge=1, name="decode_q_chunk",
                                 help="tokens per forward (fixed; overrides auto's sizes); same outputs")
    local_window: int | None = option(None, ge=1, name="decode_local_window",
                                      help="sliding-window attention span: CHANGES OUTPUTS")

    def __post_init__(self) -> None:
        check_options(self)
        if self.bucket_mid < self.bucket_short:
            raise OptionError("decode_bucket_mid", self.bucket_mid, "must be >= decode_bucket_short")
        if self.plan == "none" and (self.q_chunk is not None or self.local_window is not None):
            raise OptionError("decode_plan", self.plan, "runs unchunked with full attention, but decode_q_chunk / "
                              "decode_local_window are set: use decode_plan: fixed (or auto)")

    def resolve(self, prompt_len: int, residual_window: bool = False, ring_max_write: int | None = None) -> ResolvedPlan:
        """The chunk and window for an input of prompt_len tokens. residual_window: the cache
        keeps a quantized kind's full-precision residual window (chunking is then not exact).
        ring_max_write: the cache is a ring buffer taking at most this many tokens per forward."""
        window = self.local_window
        if self.plan == "none":
            q_chunk = None
        elif self.plan == "fixed":
            q_chunk = self.q_chunk
        elif prompt_len <= self.bucket_short:
            q_chunk = None
        else:
            q_chunk = self.q_chunk or (AUTO_CHUNK_MID if prompt_len <= self.bucket_mid else AUTO_CHUNK_LONG)
        if ring_max_write is not None:
            q_chunk = min(q_chunk or ring_max_write, ring_max_write)
        if q_chunk is not None and q_chunk >= prompt_len:
            q_chunk = None                   # one chunk: the plain path
        chunked = q_chunk is not None
        return ResolvedPlan(self.plan, prompt_len, q_chunk, window, ring=ring_max_write is not None,
                            exact=window is None and not (chunked and residual_window))

    def max_write(self) -> int | None:
        """The most tokens a windowed ring cache must take per forward: q_chunk, or the window."""
        if self.local_window is None:
            return None
        return self.q_chunk or self.local_window


def has_residual_window(cache) -> bool:
    """Whether any stream of the cache keeps a quantized kind's full-precision residual window."""
    return any(getattr(stream, "R", 0) for layer in cache.layers for stream in layer.streams)


def window_warning(window: int) -> str:
    return (f"decode_local_window={window}: sliding-window attention changes outputs (each token sees only "
            f"the {window} newest cache slots)")


def warn_window(window: int) -> None:
    warnings.warn(window_warning(window), LocalWindowWarning, stacklevel=3)


@contextmanager
def quiet_window() -> Iterator[None]:
    """Without the LocalWindowWarning: for callers that print their own warning line."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LocalWindowWarning)
        yield


def run_chunks(feed: Callable[[int, int, bool], torch.Tensor], T: int, q_chunk: int | None,
               last_only: bool) -> torch.Tensor:
    """The one place a forward is cut into chunks. feed(a, b, last_only) runs input columns
    [a, b) through the model (writing the cache) and returns its logits; chunks run in order,
    so each sees every earlier one in the cache. -> [B, T, V] logits, or [B, 1, V] with last_only
    (earlier chunks then compute their last position only and it is dropped)."""
    if q_chunk is None or T <= q_chunk:
        return feed(0, T, last_only)
    parts = []
    for a in range(0, T, q_chunk):
        out = feed(a, min(a + q_chunk, T), last_only)
        if not last_only:
            parts.append(out)
    return out if last_only else torch.cat(parts, dim=1)


def forward_chunked(model, tokens: torch.Tensor, positions: torch.Tensor | None = None, cache=None,
                    slot_mask: torch.Tensor | None = None, last_only: bool = False,
                    q_chunk: int | None = None) -> torch.Tensor:
    """model(tokens, positions, cache, slot_mask, last_only) in chunks of q_chunk tokens.
    slot_mask must already mark all T new slots (not a ring buffer's: see Generator)."""
    T = tokens.shape[1]

    def feed(a: int, b: int, last: bool) -> torch.Tensor:
        pos = None if positions is None else positions[:, a:b]
        return model(tokens[:, a:b], pos, cache, slot_mask, last_only=last)

    if cache is None and q_chunk is not None and T > q_chunk:
        raise ValueError("chunked forwards need a cache to carry keys from one chunk to the next")
    return run_chunks(feed, T, q_chunk, last_only)


def parse_plan(text: str) -> DecodePlan:
    """A decode plan from a short spec: "none", "auto", "chunk=N", "window=W", "chunk=N,window=W"
    (chunk/window alone mean fixed; "auto,chunk=N" sets auto's chunk size)."""
    name, fields = None, {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        key, eq, value = part.partition("=")
        if not eq and key in PLANS and name is None:
            name = key
        elif eq and key in ("chunk", "window") and key not in fields and value.isdigit():
            fields[key] = int(value)
        else:
            raise ValueError(f"decode plan {text!r}: use none, auto, chunk=N, window=W or chunk=N,window=W")
    return DecodePlan(name or ("fixed" if fields else "none"), q_chunk=fields.get("chunk"),
                      local_window=fields.get("window"))
