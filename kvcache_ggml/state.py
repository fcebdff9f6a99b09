"""Saving and restoring the KV cache, byte-compatible with llama.cpp: the public names in one place.

The code lives in :mod:`kvcache_ggml.cache` (``state_format``: the layout and its checks; ``state_io``: writers
and readers; ``state_codec``: ``state_write``/``state_read``; ``state_files``: sequence state files and
``parse_state``).  ``KVCache.state_write``/``state_read``/``state_save``/``state_load`` are the cache's methods.
"""
from __future__ import annotations

from .cache.state_files import load_seq_file, parse_state, read_state_file, save_seq_file
from .cache.state_format import (SESSION_MAGIC, SESSION_VERSION, STATE_SEQ_MAGIC, STATE_SEQ_VERSION, CellRange,
                                 LayerState, StateInfo, StreamState)
from .cache.state_io import (BufferWriter, BytesReader, BytesWriter, CountingWriter, FileWriter, StateReader,
                             StateWriter, StreamReader, StreamWriter)

__all__ = [
    "StateWriter", "StateReader", "CountingWriter", "BytesWriter", "BufferWriter", "StreamWriter",
    "FileWriter", "BytesReader", "StreamReader", "StateInfo", "StreamState", "LayerState", "CellRange",
    "parse_state", "read_state_file", "save_seq_file", "load_seq_file",
    "STATE_SEQ_MAGIC", "STATE_SEQ_VERSION", "SESSION_MAGIC", "SESSION_VERSION",
]
