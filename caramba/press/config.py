"""The press settings: which KV eviction method runs after a context is prefilled, and how hard.

A press scores every cached token of every layer and head after the context (a prompt, or an
eval task's context without its question) is prefilled, and keeps the best (1 - ratio) of them
(caramba.press.methods, after NVIDIA's kvpress). The survivors are then stored in the cache's
own kinds, so a press composes with every quantized kind. Defaults are kvpress's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from caramba.options import OptionError, check_options, option
from caramba.press.spec import DECODING_METHODS, METHODS, spec_of


@dataclass(frozen=True)
class PressConfig:
    # choices read the table live; a manifest takes the methods there at import
    method: str | None = option(None, name="press", choices=METHODS,
                                schema=Literal[tuple(METHODS)] | None,  # type: ignore[valid-type]
                                help="KV eviction after the context is prefilled (docs/kv-cache.md#presses)")
    ratio: float = option(0.5, ge=0.0, lt=1.0, name="press_ratio", needs="press",
                          help="fraction of the context's cached tokens a press drops")
    window_size: int = option(64, ge=1, name="press_window", needs="press",
                              help="snapkv/pyramidkv: the last N context queries that score the keys")
    kernel_size: int = option(5, ge=1, name="press_kernel", needs="press",
                              help="snapkv/pyramidkv: width of the average-pooling over the scores (odd; "
                                   "zero-padded at the ends)")
    n_sink: int = option(4, ge=0, name="press_sinks", needs="press",
                         help="streaming_llm: first tokens always kept; expected_attention: first tokens left out of the query statistics")
    n_future_positions: int = option(512, ge=1, name="press_future", needs="press",
                                     help="expected_attention: future positions the query statistics are averaged over")
    beta: float = option(20.0, gt=0.0, name="press_beta", needs="press", help="pyramidkv: how steeply budgets shrink with depth")
    adaptive: bool = option(False, name="press_adaptive", needs="press",
                            help="AdaKV: one budget per layer shared across heads (heads keep different counts)")
    alpha_safeguard: float = option(0.2, ge=0.0, le=1.0, name="press_safeguard", needs="press_adaptive",
                                    help="press_adaptive: share of each head's even budget it always keeps")
    interval: int | None = option(None, ge=1, name="press_interval",
                                  help="decoding-time compression: every N generated tokens, evict down to "
                                       "press_target tokens per head (kvpress's DecodingPress); None: off")
    target: int = option(2048, ge=1, name="press_target", needs="press_interval",
                         help="press_interval: tokens each row keeps per layer and KV head after a decoding-time compression")

    def __post_init__(self) -> None:
        check_options(self)
        if self.method is not None and spec_of(self.method).pooled and self.kernel_size % 2 == 0:
            raise OptionError("press_kernel", self.kernel_size, "must be odd (the pooling keeps each score's position)")
        if self.interval is not None:
            self._check_decoding()

    def _check_decoding(self) -> None:
        """What decoding-time compression can wrap (kvpress's DecodingPress wraps scorer presses)."""
        if self.method is None:
            raise OptionError("press_interval", self.interval, "needs a press method to score with; set press "
                              f"({', '.join(DECODING_METHODS)}) or drop press_interval")
        spec = spec_of(self.method)
        if spec.no_decoding:
            raise OptionError("press_interval", self.interval,
                              f"does not work with press={self.method}: decoding-time compression wraps "
                              f"{', '.join(DECODING_METHODS)} ({self.method}: {spec.no_decoding})")
        if self.adaptive:
            raise OptionError("press_interval", self.interval, "does not work with press_adaptive (AdaKV's per-head "
                              "budgets make the cache ragged, and a ragged cache cannot be pressed again); drop one")
        if spec.window is None and self.interval <= self.window_size:
            raise OptionError("press_interval", self.interval, f"must exceed press_window={self.window_size}: "
                              f"{self.method} scores with the queries of the last press_window generated tokens")

    def min_context(self) -> int:
        """The fewest context tokens this press can score: more than its window of queries."""
        return spec_of(self.method).min_context(self) if self.active else 0

    @property
    def active(self) -> bool:
        """Whether the context is pressed after its prefill."""
        return self.method is not None and self.ratio > 0

    @property
    def decoding(self) -> bool:
        """Whether the cache is compressed while decoding (press_interval)."""
        return self.method is not None and self.interval is not None

    @property
    def enabled(self) -> bool:
        """Whether anything is evicted, after the prefill or while decoding."""
        return self.active or self.decoding

    @classmethod
    def parse(cls, text: str) -> PressConfig:
        """'none', or METHOD@RATIO with an optional ada_ prefix (AdaKV) and an optional
        /INTERVAL:TARGET (decoding-time compression): 'snapkv@0.5', 'ada_tova@0.75', 'knorm@0/64:512'
        (no prefill press; every 64 generated tokens down to 512) -- the form describe() writes
        (decode-bench grids, autotune and eval CLI flags)."""
        word = text.strip().lower()
        if word in ("none", ""):
            return cls()
        method, at, rest = word.partition("@")
        adaptive = method.startswith("ada_")
        method = method.removeprefix("ada_")
        if not at or method not in METHODS:
            raise ValueError(f"press {text!r}: write none or METHOD@RATIO[/INTERVAL:TARGET] (e.g. snapkv@0.5, "
                             f"ada_snapkv@0.5, knorm@0/64:512); methods: {', '.join(METHODS)}")
        ratio, slash, decoding = rest.partition("/")
        try:
            value = float(ratio)
        except ValueError:
            raise ValueError(f"press {text!r}: the ratio after @ must be a number in [0, 1), e.g. snapkv@0.5") from None
        if not slash:
            return cls(method=method, ratio=value, adaptive=adaptive)
        interval, colon, target = decoding.partition(":")
        if not (colon and interval.isdigit() and target.isdigit()):
            raise ValueError(f"press {text!r}: after / write INTERVAL:TARGET, two whole numbers (e.g. knorm@0/64:512: "
                             "every 64 generated tokens, keep 512)")
        return cls(method=method, ratio=value, adaptive=adaptive, interval=int(interval), target=int(target))

    def describe(self) -> str:
        if not self.enabled:
            return "none"
        tail = f"/{self.interval}:{self.target}" if self.decoding else ""
        return f"{'ada_' if self.adaptive else ''}{self.method}@{self.ratio:g}{tail}"


__all__ = ["DECODING_METHODS", "METHODS", "PressConfig"]
