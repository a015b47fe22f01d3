"""KV cache storage: kinds, quantization, per-layer caches, policies and byte accounting."""

from caramba.cache.kinds import KVCacheKind, KVCacheTensorConfig
from caramba.cache.layer import CacheOverflowError, KVCache, LayerKVCache
from caramba.cache.decoupled import DecoupledLayerKVCache
from caramba.cache.policy import CachePolicy, parse_policy

__all__ = ["CacheOverflowError", "CachePolicy", "DecoupledLayerKVCache", "KVCache", "KVCacheKind", "KVCacheTensorConfig", "LayerKVCache",
           "parse_policy"]
