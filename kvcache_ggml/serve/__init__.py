"""An OpenAI-compatible HTTP server on the runtime (``python -m kvcache_ggml serve``); docs/serving.md.

Layers, each its own module, from the wire in:

* :mod:`.app` -- the ASGI app (starlette): endpoints, authentication, body limits, server-sent events; it turns a
  request into a :class:`~.engine.Job` and the job's events into OpenAI's JSON;
* :mod:`.engine` -- one thread owns the context and its :class:`~kvcache_ggml.prefix.PrefixCache`; each step is one
  batch of every running request's next token and chunks of waiting prompts (continuous batching, chunked prefill);
* :mod:`.protocol` (requests parsed and validated once into typed objects; responses and errors in OpenAI's
  shapes), :mod:`.chat` (chat templates rendered as transformers renders them, in jinja2's sandbox),
  :mod:`.sampling` (llama.cpp's sampler chain on numpy logits) and :mod:`.text` (streamed text, UTF-8 safe, stop
  strings held back): pure Python, no HTTP, no ggml;
* :mod:`.cli` -- the command line, on uvicorn.
"""
from __future__ import annotations

from .._lazy import lazy_exports

_LAZY = {
    "Engine": ".engine",
    "EngineParams": ".engine",
    "Job": ".engine",
    "Event": ".engine",
    "QueueFull": ".engine",
    "Service": ".app",
    "make_app": ".app",
    "ChatTemplate": ".chat",
    "Sampler": ".sampling",
    "TextStream": ".text",
    "SamplingParams": ".protocol",
    "RequestError": ".protocol",
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
