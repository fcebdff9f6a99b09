"""Small value types and rules of the cells (no ggml): :class:`CellExt` (llama.cpp's ``llama_kv_cell_ext``),
:func:`bitset_ids` (the sequence ids of one cell's bitset) and :func:`slot_search_start`, the one home of
find_slot's head restart.  llama.cpp's one-cell methods are :class:`~kvcache_ggml.cache.cells.KVCells`'s own.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["CellExt", "bitset_ids", "slot_search_start"]


def slot_search_start(head: int, n_used: int, n_tokens: int) -> int:
    """Where llama_kv_cache::find_slot starts looking for ``n_tokens`` cells in a stream: at its head, or at cell 0
    when the head is more than ``2 * n_tokens`` cells past the stream's used count (cells freed behind the head).
    The one home of that rule: find_slot and every decode fast path call it."""
    return 0 if head > n_used + 2 * n_tokens else head


@dataclass(slots=True, frozen=True)
class CellExt:
    """The 2-D position of an M-RoPE cell (llama.cpp's ``llama_kv_cell_ext``)."""

    x: int = 0  # column of the token in the image
    y: int = 0  # row of the token in the image

    def is_2d_gt(self, ox: int, oy: int) -> bool:
        """True when this cell comes after ``(ox, oy)`` in row-major order."""
        return self.y > oy or (self.y == oy and self.x > ox)


def bitset_ids(words: np.ndarray) -> list[int]:
    """Ascending sequence ids of one cell's bitset (uint64 [SEQ_WORDS]: word w holds sequences 64w..64w+63)."""
    out = []
    for w, v in enumerate(int(x) for x in words.tolist()):
        while v:
            low = v & -v
            out.append(w * 64 + low.bit_length() - 1)
            v ^= low
    return out
