"""kvcache_ggml: llama.cpp's KV cache rebuilt in Python on real ggml (through ggml-python).

Importing the package is light: ggml itself is loaded on first use of `kvcache_ggml.ggml` (the binding layer)
or of a class that needs it.
"""
from __future__ import annotations

from importlib import import_module

from .hparams import (HParams, RopeType, SwaType, is_masked_swa, is_masked_swa_np, llama_relative_position_bucket,
                      llama_relative_position_bucket_np)

__version__ = "0.1.0"

# public names defined in modules imported on first access: name -> module
_LAZY = {
    "KVCells": ".cache.cells",
    "Batch": ".batch",
    "KVCache": ".cache",
    "KVCacheISWA": ".cache.iswa",
    "SWACheckpoints": ".cache.swa_checkpoint",
}

__all__ = ["HParams", "RopeType", "SwaType", "is_masked_swa", "is_masked_swa_np", "llama_relative_position_bucket",
           "llama_relative_position_bucket_np", "__version__", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvcache_ggml' has no attribute {name!r}")
    try:
        value = getattr(import_module(module, __name__), name)
    except (ImportError, AttributeError) as e:
        raise AttributeError(f"kvcache_ggml.{name} is not available: {e}") from e
    globals()[name] = value
    return value
