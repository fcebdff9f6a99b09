"""Per-architecture parts of the runtime: which model class loads a GGUF, which memory and which graph a
:class:`~kvcache_ggml.runtime.context.Context` builds for it (llama.cpp's switches on ``arch`` in
``llama_model::load_tensors``, ``create_memory`` and ``build_graph``).

* ``llama``: :class:`~kvcache_ggml.runtime.model.Model`, one :class:`~kvcache_ggml.cache.KVCache`, the graph of
  :mod:`kvcache_ggml.runtime.graph`;
* ``gemma2``, ``gemma3``: :class:`~kvcache_ggml.runtime.gemma.GemmaModel`, a
  :class:`~kvcache_ggml.cache.iswa.KVCacheISWA`, the graph of :mod:`kvcache_ggml.runtime.gemma`;
* ``qwen2``, ``qwen3``: :class:`~kvcache_ggml.runtime.qwen.QwenModel`, llama's memory and graph (Q/K/V biases,
  Q/K head norms);
* ``phi3``: :class:`~kvcache_ggml.runtime.phi3.Phi3Model`, one KVCache, the graph of :mod:`kvcache_ggml.runtime.phi3`
  (fused QKV and gate/up, LongRoPE factors).

The registry names, per architecture, the module whose ``RUNTIME`` (an :class:`ArchRuntime`) serves it, and imports
that module on first use (as ``python -m kvcache_ggml`` imports a command's module).  The registry imports no model
module: ``Model(path)`` dispatches through it to the class of the file's architecture, and ``GemmaModel``'s module
imports ``Model``, so the model modules depend on the registry and not the other way round.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from os import PathLike
from typing import Any, Callable

__all__ = ["ArchRuntime", "runtime_for", "load_model", "supported_archs", "unsupported_arch"]


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


# general.architecture -> the module of this package whose RUNTIME serves it
_MODULES: dict[str, str] = {"llama": ".model", "gemma2": ".gemma", "gemma3": ".gemma", "qwen2": ".qwen",
                            "qwen3": ".qwen", "phi3": ".phi3"}


def supported_archs() -> tuple[str, ...]:
    return tuple(_MODULES)


def runtime_for(arch: str) -> ArchRuntime:
    """The runtime of architecture ``arch`` (ValueError naming the supported ones)."""
    module = _MODULES.get(arch)
    if module is None:
        raise ValueError(f"architecture {arch!r} is not supported (supported: {', '.join(_MODULES)})")
    return import_module(module, __package__).RUNTIME


def unsupported_arch(path: str | PathLike) -> str | None:
    """Why ``Model(path)`` would refuse the GGUF's architecture (runtime_for's message), or None: what the
    commands check before they load (``generate``, ``serve``: a usage error, exit status 2)."""
    from .._gguf import read_kv

    arch = str(read_kv(path).get("general.architecture"))
    if arch in _MODULES:
        return None
    return f"architecture {arch!r} is not supported (supported: {', '.join(_MODULES)})"


def load_model(path: str | PathLike, **kwargs: Any) -> Any:
    """``Model(path, **kwargs)``: the model class of the GGUF's ``general.architecture`` loads it (an alias kept
    for the code that used it).  (``Model`` is the llama runtime's model class.)"""
    return runtime_for("llama").model_class(path, **kwargs)
