"""The debug levels llama.cpp reads from its environment (``LLAMA_KV_CACHE_DEBUG``, ``LLAMA_BATCH_DEBUG``), read
as it reads them: ``getenv`` then C's ``atoi``.  Imports nothing of ggml (cells and batches use it)."""
from __future__ import annotations

import os
import re

__all__ = ["atoi", "env_level"]

_ATOI = re.compile(r"[ \t\n\v\f\r]*([+-]?[0-9]+)")  # (ASCII only: C's isspace and isdigit in the "C" locale)


def atoi(text: str | None) -> int:
    """C's ``atoi``: leading whitespace, a sign, then the digits that follow; 0 where there are none ("--5", "x",
    "²", "٣") or no text at all."""
    if not text:
        return 0
    m = _ATOI.match(text)
    return int(m.group(1)) if m else 0


def env_level(name: str) -> int:
    """The environment variable ``name`` as llama.cpp reads a debug level: ``atoi(getenv(name))``, 0 when unset."""
    return atoi(os.environ.get(name))
