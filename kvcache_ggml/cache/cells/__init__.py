"""The cells of one KV-cache stream (llama.cpp's ``llama_kv_cells``): which cell holds which position of which
sequences.  No tensors here, and no ggml.

==============  ========================================================================================
module          owns
==============  ========================================================================================
``kvcells``     :class:`KVCells`: the cell arrays and the vectorised methods the cache uses
``onecell``     llama.cpp's one-cell methods (:class:`OneCellAPI`, a mixin of KVCells), the scalar helpers
                of the decode step, :func:`slot_search_start` (the head restart)
``index``       the derived indices: the used range, the per-sequence position multisets, the change log
==============  ========================================================================================
"""
from __future__ import annotations

from ..._consts import LLAMA_MAX_SEQ
from .index import ChangeLog, PosMultiset, UsedRange
from .kvcells import KVCells
from .onecell import CellExt, OneCellAPI, bitset_ids, slot_search_start

__all__ = ["KVCells", "CellExt", "OneCellAPI", "LLAMA_MAX_SEQ", "bitset_ids", "slot_search_start", "ChangeLog",
           "PosMultiset", "UsedRange"]
