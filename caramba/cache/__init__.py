"""KV cache storage: kinds, per-layer caches and byte accounting."""

from caramba.cache.kinds import KVCacheKind, KVCacheTensorConfig
from caramba.cache.layer import CacheOverflowError, KVCache, LayerKVCache

__all__ = ["CacheOverflowError", "KVCache", "KVCacheKind", "KVCacheTensorConfig", "LayerKVCache"]
