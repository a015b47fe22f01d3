"""KV cache storage: kinds, quantization, per-layer caches, settings and policies, byte accounting.

The kinds are one table (caramba.cache.kinds.KVCacheKind); `kind_names()` lists the names it
accepts and `describe_kinds()` says them in words, for schemas, CLI help and error messages.
"""

from caramba.cache.kinds import KindSpec, KVCacheKind, KVCacheTensorConfig, describe_kinds, kind_names
from caramba.cache.layer import CacheOverflowError, KVCache, LayerKVCache
from caramba.cache.decoupled import DecoupledLayerKVCache
from caramba.cache.policy import CachePolicy, CacheSettings, parse_policy

__all__ = ["CacheOverflowError", "CachePolicy", "CacheSettings", "DecoupledLayerKVCache", "KVCache", "KVCacheKind",
           "KVCacheTensorConfig", "KindSpec", "LayerKVCache", "describe_kinds", "kind_names", "parse_policy"]
