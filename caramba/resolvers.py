"""What the engine leaves to the layers above it, and who does it: today, the cache for
`cache_kind="auto"`.

The engine (caramba.model, cache, infer) imports nothing from caramba.autotune, which builds on it.
A Generator whose config says `cache_kind="auto"` asks a resolver for the cache policy on first
use: the one it was given (`Generator(model, config, cache_resolver=...)`), else the default
registered here. caramba's package root registers caramba.autotune's (the stored plan first, else
a fresh selection), so `Generator(model, GenerateConfig(cache_kind="auto"))` runs the autotune
while the engine names no module above it. No torch here: the package root imports this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from caramba.cache import CachePolicy
    from caramba.infer.config import CacheConfig


class CacheResolver(Protocol):
    def __call__(self, model, tokenizer, cache: CacheConfig, batch_size: int) -> tuple[CachePolicy, dict[str, Any]]:
        """The policy to build for `cache` (kind "auto": its budget, max_seq_len and tuning
        settings) at `batch_size` rows, and what was chosen, for the record (`Generator.cache_auto`).
        `tokenizer` may be None (the model's own, if any, is the resolver's to find)."""
        ...


_cache_resolver: CacheResolver | None = None


def set_cache_resolver(resolver: CacheResolver | None) -> CacheResolver | None:
    """Make `resolver` the default for Generators given none; returns the one it replaces."""
    global _cache_resolver
    previous, _cache_resolver = _cache_resolver, resolver
    return previous


def cache_resolver() -> CacheResolver:
    """The default resolver for `cache_kind="auto"`."""
    if _cache_resolver is None:
        raise ValueError("cache_kind='auto' needs a cache resolver and none is registered: pass "
                         "Generator(..., cache_resolver=...) or register one with caramba.resolvers.set_cache_resolver, "
                         "or name a cache_kind")
    return _cache_resolver


__all__ = ["CacheResolver", "cache_resolver", "set_cache_resolver"]
