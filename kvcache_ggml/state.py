"""The public name ``kvcache_ggml.state`` (saving and restoring the KV cache, byte-compatible with llama.cpp): the
code lives in :mod:`kvcache_ggml.cache.state`; this module re-exports its public names."""
from __future__ import annotations

from .cache.state import *  # noqa: F403 -- its __all__, the one list of the names
from .cache.state import __all__  # noqa: F401
