"""Saving and restoring the KV cache, byte-compatible with llama.cpp: the public names in one place.

==========  ======================================================================================
module      owns
==========  ======================================================================================
``format``  the state layout, its parsed form (StateInfo ...) and its checks
``io``      state writers and readers
``codec``   ``StateCodec``: ``state_write``/``state_read`` of one cache
``files``   sequence state files, ``parse_state``
``cli``     ``python -m kvcache_ggml inspect``: a state file's streams, cells and layers
==========  ======================================================================================

``KVCache.state_write``/``state_read``/``state_save``/``state_load`` are the cache's methods.
"""
from __future__ import annotations

from .files import SeqFile, check_seq_data, load_seq_file, parse_state, read_state_file, save_seq_file
from .format import (SESSION_MAGIC, SESSION_VERSION, STATE_SEQ_MAGIC, STATE_SEQ_VERSION, CellRange, LayerState,
                     StateInfo, StreamState)
from .io import (BufferWriter, BytesReader, BytesWriter, CountingWriter, FileWriter, StateReader, StateWriter,
                 StreamReader, StreamWriter)

__all__ = [
    "StateWriter", "StateReader", "CountingWriter", "BytesWriter", "BufferWriter", "StreamWriter",
    "FileWriter", "BytesReader", "StreamReader", "StateInfo", "StreamState", "LayerState", "CellRange",
    "parse_state", "read_state_file", "save_seq_file", "load_seq_file", "SeqFile", "check_seq_data",
    "STATE_SEQ_MAGIC", "STATE_SEQ_VERSION", "SESSION_MAGIC", "SESSION_VERSION",
]
