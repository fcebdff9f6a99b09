"""A llama.cpp-style runtime on the cache: model loading, decoding with a ggml graph per ubatch, a numpy reference.

* :class:`~kvcache_ggml.runtime.model.Model` -- a llama GGUF in ggml backend buffers (``llama_model``);
  :class:`~kvcache_ggml.runtime.gemma.GemmaModel` for Gemma 2/3, :class:`~kvcache_ggml.runtime.phi3.Phi3Model` for
  Phi-3; ``Model(path)`` (and :func:`~kvcache_ggml.runtime.arch.load_model`) picks the class of a file's
  architecture (``docs/models.md``);
* :class:`~kvcache_ggml.runtime.context.Context` -- a KV cache and a scheduler; ``decode(batch)`` as ``llama_decode``;
* :func:`~kvcache_ggml.runtime.modelmaker.make_model` -- a random-weight llama GGUF (``make-model``);
* :class:`~kvcache_ggml.runtime.reference.Reference` -- a float64 numpy forward pass of the same file;
* :class:`~kvcache_ggml.runtime.tokenizer.Vocab` -- text <-> ids from the GGUF's vocabulary (``llama_vocab``);
* :func:`~kvcache_ggml.runtime.memory.kv_memory_plan` -- the KV cache's bytes before allocation;
* :class:`~kvcache_ggml.runtime.trace.NodeTrace` -- every named node's value, to compare with llama.cpp's;
  :class:`~kvcache_ggml.runtime.trace.NodeList` -- every node's op, type, shape and strides.
"""
from __future__ import annotations

from .._lazy import lazy_exports

_LAZY = {
    "Model": ".model",
    "Context": ".context",
    "ContextParams": "..cparams",
    "DecodeError": ".context",
    "make_model": ".modelmaker",
    "ModelSpec": ".modelmaker",
    "Reference": ".reference",
    "Vocab": ".tokenizer",
    "kv_memory_plan": ".memory",
    "NodeTrace": ".trace",
    "NodeList": ".trace",
    "load_model": ".arch",
    "GemmaModel": ".gemma",
    "GemmaReference": ".gemma_reference",
    "Phi3Model": ".phi3",
    "Phi3Reference": ".phi3_reference",
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
