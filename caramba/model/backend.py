"""How a decoder runs the model's forwards: its own torch forward, or the fused C decode step.

The decoder (caramba.model.transformer) has one forward, the torch path, which stays the
reference. The fused C step (caramba.model.fast_decode.CStep) is a backend that whoever drives
decoding chooses and owns, as gpt-fast chooses torch.compile: a DecodeState picks one when it is
built (so the Generator, speculative, beam and batched decoding, the eval's task runner), and so
do the cache-quality evaluation and the autotune's timing. Explicit rather than hidden in the
forward: a backend reads the model as it is when it is built, so nothing watches the model for
changes (no process-wide hooks, no comparing weight addresses), and a caller that needs every
module's forward (a forward hook, a press's observers) simply takes TorchStep.

A backend is called like the model: backend(tokens, positions, cache, slot_mask, last_only=,
window=) -> logits. After changing the model (quantize_model, .to(), a module swap) build a new
one: a CStep reads the weights where they were when it was built. A Generator builds its backend
when a session starts, so a Generator over a changed model (after reset()) is right.

Switches: `model.fast_decode = False` (read here, by `choose`, and nowhere else) or
CARAMBA_KERNELS=0 (no C library at all) make `choose` return the torch path.
"""

from __future__ import annotations

from typing import Protocol

import torch

from caramba import fused, kernels
from caramba.model import fast_decode, isa
from caramba.model.fast_decode import CStep, ThreadChoice


class Backend(Protocol):
    name: str      # "c" or "torch": the path this backend takes where it can
    path: str      # the path its steps took so far ("c", "torch" or both with counts), for records

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, cache=None,
                 slot_mask: torch.Tensor | None = None, last_only: bool = False,
                 window: int | None = None) -> torch.Tensor: ...


class TorchStep:
    """Every forward through the model's own (torch) forward: the reference path."""

    name = path = "torch"

    def __init__(self, model) -> None:
        self.model = model

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, cache=None,
                 slot_mask: torch.Tensor | None = None, last_only: bool = False,
                 window: int | None = None) -> torch.Tensor:
        return self.model(tokens, positions, cache, slot_mask, last_only=last_only, window=window)


def arithmetic(path: str) -> str:
    """What a decode path's logits depend on besides the model and its inputs, for the keys of kept
    results (caramba.evaluation's stores): the path ("c" or "torch"), torch's CPU capability (its
    own kernels: the prefills, the torch path) and, for the C step, which machine code of
    decode_step.c runs (the sha256 of the loaded library's bytes) at which level. Two builds on one
    CPU round differently (a wheel's prebuilt library and one built here: a q4_0 cache's PPL over 44
    tokens 45.6446 and 45.7342), so a runs/ directory shared between them must not hand one's
    results to the other as its own; a source edit that compiles to the same bytes (a comment)
    keeps what was kept. Either path's forwards of many rows (a prefill) take caramba.fused's
    elementwise kernels where they run, so their build is named too."""
    parts = [path, f"torch {torch.backends.cpu.get_cpu_capability()}"]
    if fused.digest() is not None:
        parts.append(f"decode_ops {fused.digest()}")
    if path == "c" and fast_decode.library() is not None:
        parts += [f"decode_step {kernels.digests.get('decode_step', '?')}", isa.kernel_isa()]
    return ", ".join(parts)


def choose(model, threads: ThreadChoice | None = None, exact_rows: bool = False) -> Backend:
    """The fused C step where the model allows it (model.fast_decode, True by default), the C
    library loads (CARAMBA_KERNELS=0 or no compiler: it does not) and decode_step.c computes the
    model (fp32 Llama-family on the CPU, projections it can read); else the torch path. threads:
    the C step's thread choice (default: a fresh ThreadChoice; pass one to keep it across sessions);
    exact_rows: CStep's (a row's bits the same alone and joined)."""
    if getattr(model, "fast_decode", True) and fast_decode.library() is not None:
        try:
            return CStep(model, threads, exact_rows)
        except fast_decode.Unsupported:
            pass
    return TorchStep(model)


__all__ = ["Backend", "CStep", "ThreadChoice", "TorchStep", "arithmetic", "choose"]
