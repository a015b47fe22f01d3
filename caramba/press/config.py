"""The press settings: which KV eviction method runs after a context is prefilled, and how hard.

A press scores every cached token of every layer and head after the context (a prompt, or an
eval task's context without its question) is prefilled, and keeps the best (1 - ratio) of them
(caramba.press.methods, after NVIDIA's kvpress). The survivors are then stored in the cache's
own kinds, so a press composes with every quantized kind. Defaults are kvpress's.
"""

from __future__ import annotations

from dataclasses import dataclass

from caramba.options import OptionError, check_options, option

METHODS = ("streaming_llm", "knorm", "snapkv", "tova", "observed_attention", "expected_attention", "pyramidkv",
           "keydiff")


@dataclass(frozen=True)
class PressConfig:
    method: str | None = option(None, name="press", choices=METHODS,
                                help="KV eviction after the context is prefilled (docs/kv-cache.md#presses)")
    ratio: float = option(0.5, ge=0.0, lt=1.0, name="press_ratio",
                          help="fraction of the context's cached tokens a press drops")
    window_size: int = option(64, ge=1, name="press_window",
                              help="snapkv/pyramidkv: the last N context queries that score the keys")
    kernel_size: int = option(5, ge=1, name="press_kernel",
                              help="snapkv/pyramidkv: width of the max-pooling over the scores (odd)")
    n_sink: int = option(4, ge=0, name="press_sinks",
                         help="streaming_llm: first tokens always kept; expected_attention: first tokens left out of the query statistics")
    n_future_positions: int = option(512, ge=1, name="press_future",
                                     help="expected_attention: future positions the query statistics are averaged over")
    beta: float = option(20.0, gt=0.0, name="press_beta", help="pyramidkv: how steeply budgets shrink with depth")
    adaptive: bool = option(False, name="press_adaptive",
                            help="AdaKV: one budget per layer shared across heads (heads keep different counts)")
    alpha_safeguard: float = option(0.2, ge=0.0, le=1.0, name="press_safeguard",
                                    help="press_adaptive: share of each head's even budget it always keeps")

    def __post_init__(self) -> None:
        check_options(self)
        if self.method in ("snapkv", "pyramidkv") and self.kernel_size % 2 == 0:
            raise OptionError("press_kernel", self.kernel_size, "must be odd (the pooling keeps each score's position)")

    def min_context(self) -> int:
        """The fewest context tokens this press can score: more than its window of queries."""
        if not self.active:
            return 0
        return {"snapkv": self.window_size + 1, "pyramidkv": self.window_size + 1, "tova": 2,
                "streaming_llm": self.n_sink + 1, "expected_attention": self.n_sink + 1}.get(self.method, 1)

    @property
    def active(self) -> bool:
        return self.method is not None and self.ratio > 0

    @classmethod
    def parse(cls, text: str) -> PressConfig:
        """'none', or METHOD@RATIO with an optional ada_ prefix (AdaKV): 'snapkv@0.5', 'ada_tova@0.75' --
        the form describe() writes (decode-bench grids, CLI flags)."""
        word = text.strip().lower()
        if word in ("none", ""):
            return cls()
        method, at, ratio = word.partition("@")
        adaptive = method.startswith("ada_")
        method = method.removeprefix("ada_")
        if not at or method not in METHODS:
            raise ValueError(f"press {text!r}: write none or METHOD@RATIO (e.g. snapkv@0.5, ada_snapkv@0.5); "
                             f"methods: {', '.join(METHODS)}")
        try:
            value = float(ratio)
        except ValueError:
            raise ValueError(f"press {text!r}: the ratio after @ must be a number in [0, 1), e.g. snapkv@0.5") from None
        return cls(method=method, ratio=value, adaptive=adaptive)

    def describe(self) -> str:
        if not self.active:
            return "none"
        return f"{'ada_' if self.adaptive else ''}{self.method}@{self.ratio:g}"


__all__ = ["METHODS", "PressConfig"]
