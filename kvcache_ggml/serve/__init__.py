"""An OpenAI-compatible HTTP server on the runtime (``python -m kvcache_ggml serve``).

The foundation layer is pure Python (numpy and jinja2, no HTTP, no ggml): :mod:`.protocol` (requests parsed and
validated once into typed objects, responses in OpenAI's JSON shapes, errors in OpenAI's error shape), :mod:`.chat`
(chat templates rendered as transformers renders them), :mod:`.sampling` (llama.cpp's sampler chain on numpy
logits) and :mod:`.text` (streamed text that holds back what could be the start of a stop string).
"""
