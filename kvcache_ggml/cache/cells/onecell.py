"""llama.cpp's one-cell methods of ``llama_kv_cells`` (no ggml), as a mixin of
:class:`~kvcache_ggml.cache.cells.KVCells`.

Each method works on one cell ``i`` with the seed's name and preconditions (asserted).  Most go through the
vectorised methods of :class:`~kvcache_ggml.cache.cells.KVCells`, which keep the derived indices and the change log
in sync; ``pos_set`` and the scalar helpers below update the indices themselves, for the one cell and sequence they
change.  The cache itself uses the vectorised methods; the one-cell methods serve tests, notebooks and code ported
from llama.cpp.  Scalar helpers serve the decode step: ``one_token_slot`` (find_slot's cell for one token),
``seq_rm_last`` (the undo of a step), and over cells a sliding window left behind
(:mod:`kvcache_ggml.cache.swa_step`) ``seq_pos_keys`` (a sequence's position multiset) and ``rm_only`` (rm() of a
cell held by one sequence).  :func:`slot_search_start` is the one home of find_slot's head restart.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..._consts import LLAMA_MAX_SEQ

__all__ = ["CellExt", "OneCellAPI", "bitset_ids", "slot_search_start"]

_BIT = [np.uint64(1 << b) for b in range(64)]


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


class OneCellAPI:
    """The seed's one-cell methods; the host class provides ``_pos``, ``_seq``, ``_ext``, ``_shift``, ``_used``,
    ``_seq_pos``, ``_log``, the memoryviews ``_pos_m`` and ``_seq_m``, and the vectorised methods."""

    __slots__ = ()

    def is_empty(self, i: int) -> bool:
        return bool(self._pos[i] == -1)

    def rm(self, i: int) -> None:
        assert self._pos[i] != -1, f"rm() of empty cell {i}"
        self.rm_many(np.array([i], np.int64))

    def seq_rm(self, i: int, seq_id: int) -> bool:
        """Remove ``seq_id`` from cell ``i``; True when the cell became empty."""
        assert self.seq_has(i, seq_id) and self._pos[i] != -1
        return bool(self.seq_rm_many(np.array([i], np.int64), seq_id).size)

    def seq_keep(self, i: int, seq_id: int) -> bool:
        """Keep only ``seq_id`` in cell ``i``; True when the cell became empty."""
        if self._pos[i] == -1:
            return False
        return bool(self.seq_keep_many(np.array([i], np.int64), seq_id).size)

    def seq_count(self, i: int) -> int:
        assert self._pos[i] != -1, f"seq_count() of empty cell {i}"
        return int(np.bitwise_count(self._seq[:, i]).sum())

    def seq_has(self, i: int, seq_id: int) -> bool:
        assert 0 <= seq_id < LLAMA_MAX_SEQ, f"seq_id {seq_id} out of [0, {LLAMA_MAX_SEQ})"
        return bool(self._seq[seq_id >> 6, i] & _BIT[seq_id & 63])

    def seq_add(self, i: int, seq_id: int) -> None:
        assert self._pos[i] != -1 and not self.seq_has(i, seq_id)
        self.seq_add_many(np.array([i], np.int64), seq_id)

    def seq_get(self, i: int) -> int:
        """The only sequence of cell ``i`` (the cell must hold exactly one)."""
        assert self.seq_count(i) == 1, f"seq_get() of cell {i} with {self.seq_count(i)} sequences"
        return int(self.seq_get_many(np.array([i], np.int64))[0])

    def pos_get(self, i: int) -> int:
        assert self._pos[i] != -1, f"pos_get() of empty cell {i}"
        return int(self._pos[i])

    def ext_get(self, i: int) -> CellExt:
        assert self._pos[i] != -1, f"ext_get() of empty cell {i}"
        return CellExt(int(self._ext[i, 0]), int(self._ext[i, 1]))

    def get_shift(self, i: int) -> int:
        assert self._pos[i] != -1, f"get_shift() of empty cell {i}"
        return int(self._shift[i])

    def pos_in(self, i: int, p0: int, p1: int) -> bool:
        return bool(p0 <= self._pos[i] < p1)

    def pos_set(self, i: int, p: int) -> None:
        assert self._pos[i] == -1 and not self._seq[:, i].any(), f"pos_set() of occupied cell {i}"
        self._pos[i] = p
        self._used.insert(np.array([i], np.int64))

    def ext_set(self, i: int, ext: CellExt | tuple[int, int]) -> None:
        self._ext[i] = (ext.x, ext.y) if isinstance(ext, CellExt) else ext

    def pos_add(self, i: int, d: int) -> bool:
        """Shift the position of cell ``i`` by ``d``; True when it went negative and the cell was emptied."""
        assert self._pos[i] != -1, f"pos_add() of empty cell {i}"
        return bool(self.pos_add_many(np.array([i], np.int64), d).size)

    def pos_div(self, i: int, d: int) -> None:
        assert self._pos[i] != -1, f"pos_div() of empty cell {i}"
        self.pos_div_many(np.array([i], np.int64), d)

    # ------------------------------------------------------------------ scalar helpers of the decode step

    def only_seq(self, i: int) -> int:
        """The only sequence of cell ``i``; -1 when it holds none or several (scalar reads of its words)."""
        seq = self._seq
        v = seq.item(0, i)
        if v and not v & (v - 1):  # one sequence below 64 (the common case), unless the other words hold more
            return -1 if seq.item(1, i) or seq.item(2, i) or seq.item(3, i) else v.bit_length() - 1
        q = -1
        for w in range(4):  # (SEQ_WORDS words)
            v = seq.item(w, i)
            if v:
                if q >= 0 or v & (v - 1):
                    return -1
                q = (w << 6) + v.bit_length() - 1
        return q

    def pos_at(self, i: int) -> int:
        """The position of cell ``i`` (-1: empty), a Python int (the fused decode step's read)."""
        return self._pos_m[i]

    def one_token_cell(self, head: int) -> int:
        """find_slot's cell for one token searched from ``head`` -- the head, or cell 0 after the search's restart --
        if it is free, else -1.  The one home of the one-token placement rule: find_slot's decode path,
        :meth:`one_token_slot` and the fused step come here."""
        head = slot_search_start(head, self._used.n, 1)
        if head >= len(self._pos_m) or self._pos_m[head] >= 0:
            return -1
        return head

    def one_token_slot(self, head: int) -> tuple[int, int] | None:
        """find_slot's cell for one token searched from ``head`` -- the head, or cell 0 when the head is more than two
        cells past the used count (the search's restart) -- if that cell is free: (the cell, used_max_p1() once a
        token is placed there); None when it is occupied or past the end.  (The decode step's query, one call.)"""
        head = self.one_token_cell(head)
        if head < 0:
            return None
        u = self._used
        end = u.end(self._pos, self._pos_m) if u.hi_dirty else u.hi
        return head, (end if end > head else head + 1)

    def seq_rm_last(self, seq_id: int, p0: int, p1: int) -> int | None:
        """Fast path of ``seq_rm_many(find(p0, p1, seq_id), seq_id)`` for the undo of a decode step: when the only
        cell of ``seq_id`` in [p0, p1) holds its largest position and is the cell of its last placement, remove the
        sequence from it with scalar Python and return the cell if it became empty, else -1.  None (nothing done)
        when the cells do not look like that."""
        ms = self._seq_pos.get(seq_id)  # (a sequence without cells has no multiset)
        if ms is None:
            return None
        keys = ms.keys
        p = keys[-1]
        if p < p0 or p >= p1 or ms.counts[-1] != 1 or (len(keys) > 1 and keys[-2] >= p0):
            return None
        # one cell of the sequence holds p: if the hinted cell holds the sequence at p, it is that cell
        i = self._newest.get(seq_id, -1)
        if i < 0 or self._pos_m[i] != p:
            return None
        seq_m, w, bit = self._seq_m, seq_id >> 6, 1 << (seq_id & 63)
        word = seq_m[w, i]
        if not word & bit:
            return None
        keys.pop()  # ms.dec(p) of the largest position, held once
        ms.counts.pop()
        if not keys:
            del self._seq_pos[seq_id]
        word ^= bit
        seq_m[w, i] = word
        self._log.add_one(i, seq_id)
        if word or seq_m[0, i] or seq_m[1, i] or seq_m[2, i] or seq_m[3, i]:  # (SEQ_WORDS words)
            return -1
        self._pos_m[i] = -1
        self._ext_m[i, 0] = 0
        self._ext_m[i, 1] = 0
        self._shift_m[i] = 0
        self._used.erase_one(i)
        return i

    def seq_word(self, w: int, i: int) -> int:
        """Word ``w`` of cell ``i``'s sequence bitset (sequences 64*w .. 64*w + 63), a Python int."""
        return self._seq_m[w, i]

    def seq_words(self) -> memoryview:
        """The sequence bitsets as a read-only-by-convention memoryview [SEQ_WORDS, size] of uint64, for scalar
        reads in a loop (``seq_words()[w, i]`` is ``seq_word(w, i)``).  Valid until ``resize``, which also drops the
        change log: a reader that keeps it takes it again in each new epoch of the log."""
        return self._seq_m

    def seq_pos_keys(self, seq_id: int) -> tuple[list[int], list[int]]:
        """The position multiset of ``seq_id``: its distinct positions ascending and how many cells hold each (the
        cells' own lists: read only); two empty lists when it holds no cell."""
        ms = self._seq_pos.get(seq_id)
        return (ms.keys, ms.counts) if ms is not None else ([], [])

    def rm_only(self, i: int, seq_id: int) -> None:
        """rm() of cell ``i``, which holds ``seq_id`` alone, with scalar Python (the decode step over a cell the
        sliding window left behind)."""
        p = self._pos.item(i)
        assert p >= 0 and self._seq.item(seq_id >> 6, i) == 1 << (seq_id & 63), f"cell {i} is not {seq_id}'s alone"
        ms = self._seq_pos[seq_id]
        ms.dec(p)
        if not ms.keys:  # (no __len__ call)
            del self._seq_pos[seq_id]
        self._seq[seq_id >> 6, i] = 0
        self._pos[i] = -1
        ext = self._ext
        if ext.item(i, 0) or ext.item(i, 1):  # (0 but on M-RoPE models: cheaper to read than to write)
            ext[i] = 0
        self._shift[i] = 0
        self._used.erase_one(i)
        self._log.add_one(i, seq_id)
