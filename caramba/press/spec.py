"""The press methods as one table: a `MethodSpec` per method, the only place a method is described.

What derives from it: the press option's choices and parse (caramba.press.config), the shortest
context a press scores, what the observers collect over the context (caramba.press.observe), what
a row is scored with and how many tokens it keeps (caramba.press.select), which methods
decoding-time compression wraps and which decode steps it watches (caramba.infer.decoding_press).
A new method is its scorer (caramba.press.methods, or anywhere) and one entry in SPECS.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from caramba.press import methods
from caramba.press.budget import pyramid_budget, ratio_budget

OBSERVERS = ("attention", "queries")   # what caramba.press.observe collects besides a window of queries


@dataclass(frozen=True)
class MethodSpec:
    """One press method: its scorer and the traits the rest of the press reads."""

    scorer: Callable[..., torch.Tensor]          # (Row, press) -> scores [KVH, L]; +inf: always kept
    window: int | None = 0                       # the last queries it scores with: 0 none, None press_window
    observes: str | None = None                  # also collected: "attention" received (H2O), "queries" statistics
    sinks: bool = False                          # the first press_sinks tokens are special: a row needs more
    pooled: bool = False                         # average-pools its scores over press_kernel (odd)
    budget: Callable[..., int] = ratio_budget    # (layer, n_layers, length, press) -> tokens kept per head
    no_decoding: str | None = None               # why decoding-time compression cannot wrap it (None: it can)

    def __post_init__(self) -> None:
        if self.observes not in (None, *OBSERVERS):
            raise ValueError(f"observes={self.observes!r}: one of {', '.join(OBSERVERS)} or None")

    def window_of(self, press) -> int:
        """How many of the last queries it scores with (0: none)."""
        return press.window_size if self.window is None else self.window

    def min_context(self, press) -> int:
        """The fewest context tokens it scores: more than its window and its sinks."""
        return max(self.window_of(press), press.n_sink if self.sinks else 0) + 1

    @property
    def needs_observation(self) -> bool:
        """Whether it scores with what the prefill computed, not the cache alone."""
        return self.window != 0 or self.observes is not None


SPECS: dict[str, MethodSpec] = {
    "streaming_llm": MethodSpec(methods.streaming_llm, sinks=True),
    "knorm": MethodSpec(methods.knorm),
    "snapkv": MethodSpec(methods.snapkv, window=None, pooled=True),
    "tova": MethodSpec(methods.tova, window=1),
    "observed_attention": MethodSpec(methods.observed_attention, observes="attention",
                                     no_decoding="it sums the attention of every query since the context began"),
    "expected_attention": MethodSpec(methods.expected_attention, observes="queries", sinks=True),
    "pyramidkv": MethodSpec(methods.pyramidkv, window=None, pooled=True, budget=pyramid_budget,
                            no_decoding="its per-layer budgets make the cache ragged"),
    "keydiff": MethodSpec(methods.keydiff),
}


class Names:
    """The table's method names (those `keep` takes), read live: a method added to SPECS is one."""

    def __init__(self, keep: Callable[[MethodSpec], bool] = lambda spec: True) -> None:
        self.keep = keep

    def __iter__(self) -> Iterator[str]:
        return (name for name, spec in SPECS.items() if self.keep(spec))

    def __contains__(self, name: object) -> bool:
        return name in SPECS and self.keep(SPECS[name])

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return repr(tuple(self))


METHODS = Names()
DECODING_METHODS = Names(lambda spec: spec.no_decoding is None)


def spec_of(method: str) -> MethodSpec:
    try:
        return SPECS[method]
    except KeyError:
        raise ValueError(f"unknown press method {method!r}; methods: {', '.join(METHODS)}") from None


def score(row: methods.Row, press) -> torch.Tensor:
    """Scores [KVH, L] of one row's tokens under press.method (+inf: always kept)."""
    return spec_of(press.method).scorer(row, press)


__all__ = ["DECODING_METHODS", "METHODS", "MethodSpec", "Names", "SPECS", "score", "spec_of"]
