"""An OpenAI-compatible HTTP server on the runtime (``python -m kvcache_ggml serve``); docs/serving.md.

Layers, each its own module, from the wire in:

* :mod:`.app` -- the ASGI app (starlette): endpoints, authentication, body limits, server-sent events; it turns a
  request into a :class:`~.request.Job` and the job's events into OpenAI's JSON through :mod:`.formatters` (one
  for chat completions, one for completions);
* :mod:`.engine` -- the one serving loop: one thread owns the context and its
  :class:`~kvcache_ggml.prefix.PrefixCache`; each step is ``plan`` (admission, the batch under a token budget, room
  claimed), ``execute`` (one batch of every running request's next token and chunks of waiting prompts) and
  ``update`` (sampling, text, events); other threads send it messages and read its published snapshot;
  :mod:`.request` -- a request, its states (checked transitions) and its events; :mod:`.results` -- typed logprobs
  and usage; :mod:`.slots` -- llama-server's slot actions (a sequence saved to a file, restored, erased), run on
  the engine's thread;
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
    "Job": ".request",
    "Event": ".request",
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
