"""The public name ``kvcache_ggml.cells`` (the cells of one stream, no ggml).

The code lives in :mod:`kvcache_ggml.cache.cells`; this module re-exports its public names."""
from __future__ import annotations

from .cache.cells import *  # noqa: F403 -- its __all__, the one list of the names
from .cache.cells import __all__  # noqa: F401
