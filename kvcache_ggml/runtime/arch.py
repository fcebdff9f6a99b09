"""Per-architecture parts of the runtime: which model class loads a GGUF, which memory and which graph a
:class:`~kvcache_ggml.runtime.context.Context` builds for it (llama.cpp's switches on ``arch`` in
``llama_model::load_tensors``, ``create_memory`` and ``build_graph``).

* ``llama``: :class:`~kvcache_ggml.runtime.model.Model`, one :class:`~kvcache_ggml.cache.KVCache`, the graph of
  :mod:`kvcache_ggml.runtime.graph`;
* ``gemma2``, ``gemma3``: :class:`~kvcache_ggml.runtime.gemma.GemmaModel`, a
  :class:`~kvcache_ggml.cache.iswa.KVCacheISWA`, the graph of :mod:`kvcache_ggml.runtime.gemma`.
"""
from __future__ import annotations

from dataclasses import dataclass
from os import PathLike
from typing import Any, Callable

from ..cache import KVCache, KVCacheParams
from . import graph as _llama

__all__ = ["ArchRuntime", "runtime_for", "load_model", "supported_archs"]


@dataclass(frozen=True, slots=True)
class ArchRuntime:
    """How the runtime serves one architecture."""

    model_class: type                    # loads the GGUF: Model or a subclass
    create_memory: Callable[..., Any]    # (model, KVCacheParams, n_ubatch, swa_full) -> KVCache | KVCacheISWA
    capacity: Callable[[int], int]       # tensors (and graph nodes) of one decoder graph for n_layer layers
    graph_key: Callable[..., Any]        # (mctx, ubatch, n_outputs, kv_unified) -> the graph's topology key
    build: Callable[..., Any]            # (ctx, model, cparams, mctx, ubatch, key, *, flash_attn, fa_cast_f32_kv)
    set_inputs: Callable[..., None]      # (graph, mctx, ubatch, causal_attn)
    iswa: bool = False                   # create_memory makes a KVCacheISWA when the model has SWA layers
    fused: bool = False                  # graph and set_inputs are graph.py's: the fused decode step applies


def _plain_memory(model: Any, params: KVCacheParams, n_ubatch: int, swa_full: bool) -> KVCache:
    del n_ubatch, swa_full
    return KVCache(model, params)


def _llama_runtime() -> ArchRuntime:
    from .model import Model
    return ArchRuntime(Model, _plain_memory, _llama.graph_capacity, _llama.graph_key, _llama.build_decoder,
                       _llama.set_inputs, fused=True)


def _gemma_runtime() -> ArchRuntime:
    from . import gemma
    return ArchRuntime(gemma.GemmaModel, gemma.create_memory, gemma.graph_capacity, gemma.graph_key,
                       gemma.build_gemma, gemma.set_gemma_inputs, iswa=True)


_FACTORIES: dict[str, Callable[[], ArchRuntime]] = {"llama": _llama_runtime, "gemma2": _gemma_runtime,
                                                    "gemma3": _gemma_runtime}


def supported_archs() -> tuple[str, ...]:
    return tuple(_FACTORIES)


def runtime_for(arch: str) -> ArchRuntime:
    """The runtime of architecture ``arch`` (ValueError naming the supported ones)."""
    factory = _FACTORIES.get(arch)
    if factory is None:
        raise ValueError(f"architecture {arch!r} is not supported (supported: {', '.join(_FACTORIES)})")
    return factory()


def load_model(path: str | PathLike, **kwargs: Any) -> Any:
    """``Model(path, **kwargs)``: the model class of the GGUF's ``general.architecture`` loads it (an alias kept
    for the code that used it)."""
    from .model import Model
    return Model(path, **kwargs)
