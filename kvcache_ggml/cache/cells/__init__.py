"""The cells of one KV-cache stream (llama.cpp's ``llama_kv_cells``): which cell holds which position of which
sequences.  No tensors here, and no ggml.

==============  ========================================================================================
module          owns
==============  ========================================================================================
``kvcells``     :class:`KVCells`: the cell arrays, llama.cpp's one-cell methods, the vectorised methods the
                cache uses and the scalar helpers of the decode step, in one class
``onecell``     :class:`CellExt`, :func:`bitset_ids`, :func:`slot_search_start` (the head restart)
``index``       the derived indices: the used range, the per-sequence position multisets, the change log
==============  ========================================================================================
"""
from __future__ import annotations

from ..._consts import LLAMA_MAX_SEQ
from .index import ChangeLog, PosMultiset, UsedRange
from .kvcells import KVCells
from .onecell import CellExt, bitset_ids, slot_search_start

__all__ = ["KVCells", "CellExt", "LLAMA_MAX_SEQ", "bitset_ids", "slot_search_start", "ChangeLog",
           "PosMultiset", "UsedRange"]
