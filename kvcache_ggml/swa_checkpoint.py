"""The public name ``kvcache_ggml.swa_checkpoint`` (checkpoints of the SWA cache for prompt reuse).

The code lives in :mod:`kvcache_ggml.cache.swa_checkpoint`; this module re-exports its public names."""
from __future__ import annotations

from .cache.swa_checkpoint import *  # noqa: F403 -- its __all__, the one list of the names
from .cache.swa_checkpoint import __all__  # noqa: F401
