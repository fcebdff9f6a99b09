"""The public name ``kvcache_ggml.iswa`` (KVCacheISWA, llama.cpp's llama_kv_cache_iswa).

The code lives in :mod:`kvcache_ggml.cache.iswa`; this module re-exports its public names."""
from __future__ import annotations

from .cache.iswa import *  # noqa: F403 -- its __all__, the one list of the names
from .cache.iswa import __all__  # noqa: F401
