"""Cell bookkeeping of one KV-cache stream: the counterpart of llama.cpp's ``llama_kv_cells``.

Which cell holds which position of which sequences. No tensors here, and no ggml.

Storage is a set of parallel numpy arrays, one entry per cell:

* ``pos``   int32  -- the position held by the cell, ``-1`` when the cell is empty;
* ``shift`` int32  -- the position change accumulated since the last K-shift;
* ``ext``   int32 [size, 2] -- the 2-D M-RoPE extension ``(x, y)``;
* ``seq``   uint64 [SEQ_WORDS, size] -- a bitset of the sequences that own the cell, word-major so that the
  membership column of one sequence is contiguous.

Two derived indices (:mod:`~kvcache_ggml.cache.cells.index`; llama.cpp's ``used`` set and ``seq_pos``) are kept
in sync with those arrays, and a third record beyond llama.cpp:

* the used range (:class:`UsedRange`) -- a count plus the bounds ``used_min``/``used_max_p1``, re-found lazily with
  a chunked scan when a boundary cell is freed;
* per sequence, the multiset of its positions (:class:`PosMultiset`), so that ``seq_pos_min``/``seq_pos_max`` are
  O(1);
* the change log (:class:`ChangeLog`): every cell whose sequence set changed, which the kq mask rows read
  (``change_log``) to patch themselves instead of being rebuilt.

Who changes the indices:

* whole cells enter and leave both indices through two private helpers, :meth:`KVCells._index_add` and
  :meth:`KVCells._index_remove` (moves, shifts, removals, restores: ``rm_many``, ``seq_keep_many``,
  ``pos_add_many``, ``pos_div_many``, ``set``);
* the mutators of the decode path update them in place for the one sequence they know: :meth:`~KVCells.place`
  and :meth:`~KVCells.place_one` (new cells: the used range and their sequences' multisets),
  :meth:`~KVCells.seq_add_many` / :meth:`~KVCells.seq_rm_many` (one sequence joins or leaves cells: its multiset,
  and the used range for cells left empty);
* in :mod:`~kvcache_ggml.cache.cells.onecell`, ``pos_set`` (the used range) and the scalar helpers of the decode
  step ``seq_rm_last`` and ``rm_only``, each for the one cell and sequence it changes.

:meth:`~KVCells.check_invariants` recomputes both indices from the arrays and reports every disagreement.

Every llama.cpp method has a counterpart with the same name working on one cell
(:mod:`~kvcache_ggml.cache.cells.onecell`).  The cache itself uses the vectorised ``*_many``/``find``/``place``
methods, which give the same result as the per-cell loops of the seed, and on the decode step their scalar variants
(``place_one``, ``seq_rm_last``).
"""
from __future__ import annotations

import numpy as np

from ..._consts import INT32_MAX, LLAMA_MAX_SEQ, SEQ_WORDS
from .index import ChangeLog, PosMultiset, UsedRange
from .onecell import CellExt, OneCellAPI, bitset_ids

__all__ = ["KVCells", "CellExt", "LLAMA_MAX_SEQ", "bitset_ids"]

_ONE = np.uint64(1)
_BIT = [np.uint64(1 << b) for b in range(64)]
_BIT_OF = np.array([1 << (s & 63) for s in range(LLAMA_MAX_SEQ)], np.uint64)  # sequence -> its bit in its word
_FEW = 64  # find() scans backwards for this many cells of a sequence or fewer
assert SEQ_WORDS == 4, "seq_rm_last reads the words of a cell one by one"
_NO_CELLS = np.empty(0, np.int64)
_NO_CELLS.flags.writeable = False


class KVCells(OneCellAPI):
    """The cells of one stream of the cache (llama.cpp's ``llama_kv_cells``); the one-cell methods are
    :class:`~kvcache_ggml.cache.cells.onecell.OneCellAPI`'s."""

    __slots__ = ("_pos", "_shift", "_ext", "_seq", "_has_shift", "_used", "_seq_pos", "_log", "_newest", "_pos_m",
                 "_seq_m", "_shift_m", "_ext_m")

    def __init__(self, size: int = 0) -> None:
        self._pos = np.empty(0, np.int32)                # [size] position, -1 = empty
        self._shift = np.empty(0, np.int32)              # [size] pending K-shift
        self._ext = np.empty((0, 2), np.int32)           # [size, 2] M-RoPE (x, y)
        self._seq = np.empty((SEQ_WORDS, 0), np.uint64)  # [SEQ_WORDS, size] sequence bitset
        self._has_shift = False                          # any pos_add/pos_div since reset_shift()
        self._used = UsedRange()                         # count and bounds of the non-empty cells
        self._seq_pos: dict[int, PosMultiset] = {}      # seq id -> multiset of its positions
        self._log = ChangeLog(0)                         # cells whose sequence set changed
        self._newest: dict[int, int] = {}                # seq id -> cell of its last placement (a hint only)
        # memoryviews of the arrays: the decode step's scalar access, cheaper than numpy's (_views() remakes them)
        self._pos_m = self._seq_m = self._shift_m = self._ext_m = memoryview(b"")
        self.resize(size)

    def _views(self) -> None:
        self._pos_m = memoryview(self._pos)
        self._seq_m = memoryview(self._seq)
        self._shift_m = memoryview(self._shift)
        self._ext_m = memoryview(self._ext)

    # ------------------------------------------------------------------ whole-stream operations

    def reset(self) -> None:
        self._pos.fill(-1)
        self._shift.fill(0)
        self._ext.fill(0)
        self._seq.fill(0)
        self._has_shift = False
        self._used.reset()
        self._seq_pos.clear()
        self._log.drop()
        self._newest.clear()

    def reset_shift(self) -> None:
        self._has_shift = False
        self._shift.fill(0)

    def size(self) -> int:
        return self._pos.shape[0]

    def resize(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"cell count must be >= 0, got {n}")
        self._pos = np.full(n, -1, np.int32)
        self._shift = np.zeros(n, np.int32)
        self._ext = np.zeros((n, 2), np.int32)
        self._seq = np.zeros((SEQ_WORDS, n), np.uint64)
        self._views()
        self._log.max_cells = max(64, n // 8)  # patching more cells than this costs about a rebuild
        self.reset()

    def get_used(self) -> int:
        return self._used.n

    def used_min(self) -> int:
        u = self._used
        return u.first(self._pos) if u.lo_dirty else u.lo

    def used_max_p1(self) -> int:
        u = self._used
        return u.end(self._pos, self._pos_m) if u.hi_dirty else u.hi

    def get_has_shift(self) -> bool:
        return self._has_shift

    @property
    def change_log(self) -> ChangeLog:
        """The cells whose sequence set changed, for readers that keep something derived from the bits (read it
        only: see :class:`~kvcache_ggml.cache.cells.index.ChangeLog`)."""
        return self._log

    # ------------------------------------------------------------------ copies (for roll-back)

    def cp(self, i_or_idxs, n: int | None = None) -> "KVCells":
        """Copy of cells ``[i, i + n)`` or of the cells ``idxs``, as a new, consistent ``KVCells``."""
        idxs = self._as_idxs(i_or_idxs, n)
        assert not self._shift[idxs].any(), "cp() of cells with a pending shift"
        res = KVCells(0)
        res._pos = self._pos[idxs]
        res._shift = np.zeros(idxs.size, np.int32)
        res._ext = self._ext[idxs]
        res._seq = self._seq[:, idxs]
        res._views()
        res._rebuild_indices()
        return res

    def set(self, i_or_idxs, other: "KVCells") -> None:
        """Overwrite cells ``[i, i + len(other))`` or the cells ``idxs`` with the cells of ``other``."""
        idxs = self._as_idxs(i_or_idxs, other.size() if np.isscalar(i_or_idxs) else None)
        if idxs.size != other.size():
            raise ValueError(f"set(): {idxs.size} target cells for {other.size()} source cells")
        self._restore(idxs, other._pos, other._ext, other._seq)

    def _snapshot(self, idxs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Raw copy of cells (pos, ext, seq) -- the light form of cp() that prepare() uses."""
        return self._pos[idxs], self._ext[idxs], self._seq[:, idxs]

    def _restore(self, idxs: np.ndarray, pos: np.ndarray, ext: np.ndarray, seq: np.ndarray) -> None:
        old = idxs[self._pos[idxs] >= 0]
        self._index_remove(old)
        self._pos[idxs] = pos
        self._ext[idxs] = ext
        self._seq[:, idxs] = seq
        self._index_add(idxs[pos >= 0])
        self._log.add(idxs)

    # ------------------------------------------------------------------ sequence positions

    def seq_pos_min(self, seq_id: int) -> int:
        ms = self._seq_pos.get(seq_id)  # (an emptied multiset is deleted: a present one has keys)
        return ms.keys[0] if ms is not None else -1

    def seq_pos_max(self, seq_id: int) -> int:
        ms = self._seq_pos.get(seq_id)
        return ms.keys[-1] if ms is not None else -1

    def seq_pos_bounds(self, seq_id: int) -> tuple[int, int]:
        """(seq_pos_min, seq_pos_max) in one call."""
        ms = self._seq_pos.get(seq_id)
        return (ms.keys[0], ms.keys[-1]) if ms is not None else (-1, -1)

    def seq_pos_within(self, seq_ids: list[int], his: list[int] | None) -> bool:
        """Every sequence of ``seq_ids`` holds cells, all at positions in [0, his[k]] (in [0, inf) when ``his`` is
        None): the kq mask rows of its tokens then need no position test."""
        get = self._seq_pos.get
        for k, s in enumerate(seq_ids):
            ms = get(s)
            if ms is None or ms.keys[0] < 0 or (his is not None and ms.keys[-1] > his[k]):
                return False
        return True

    # ------------------------------------------------------------------ vectorised queries

    @property
    def pos_array(self) -> np.ndarray:
        """[size] int32 positions, -1 for empty cells. Read-only by convention."""
        return self._pos

    @property
    def shift_array(self) -> np.ndarray:
        """[size] int32 pending shifts. Read-only by convention."""
        return self._shift

    @property
    def ext_array(self) -> np.ndarray:
        """[size, 2] int32 (x, y). Read-only by convention."""
        return self._ext

    @property
    def seq_bits(self) -> np.ndarray:
        """[SEQ_WORDS, size] uint64 sequence bitsets. Read-only by convention."""
        return self._seq

    def seq_mask(self, seq_id: int, n: int | None = None) -> np.ndarray:
        """bool [n]: which of the first ``n`` cells hold ``seq_id``."""
        row = self._seq[seq_id >> 6] if n is None else self._seq[seq_id >> 6, :n]
        return (row & _BIT[seq_id & 63]) != 0

    def seq_absent(self, seq_id: int, n: int) -> np.ndarray:
        """bool [n]: which of the first ``n`` cells do not hold ``seq_id`` (empty cells included)."""
        return (self._seq[seq_id >> 6, :n] & _BIT[seq_id & 63]) == 0

    def seq_ids(self) -> list[int]:
        """Ascending ids of the sequences that hold at least one cell."""
        return sorted(self._seq_pos)

    def seq_lists(self, idxs: np.ndarray, n_seq_max: int = LLAMA_MAX_SEQ) -> tuple[np.ndarray, np.ndarray]:
        """The sequences below ``n_seq_max`` of the cells ``idxs``: (count int64 [n], ids int32 [count.sum()]),
        each cell's ids ascending, cell after cell."""
        n_words = (n_seq_max + 63) // 64
        bits = self._seq[:n_words, idxs]                     # a copy [n_words, n]
        if n_seq_max % 64:
            bits[n_words - 1] &= np.uint64((1 << (n_seq_max % 64)) - 1)
        counts = np.bitwise_count(bits).sum(axis=0, dtype=np.int64)
        if (counts == 1).all():
            w = np.argmax(bits != 0, axis=0)
            v = bits[w, np.arange(bits.shape[1])]            # a power of two: exact in float64
            return counts, (w * 64 + np.frexp(v.astype(np.float64))[1] - 1).astype(np.int32)
        m = np.unpackbits(np.ascontiguousarray(bits.T).view(np.uint8), axis=1, bitorder="little")
        return counts, np.nonzero(m[:, :n_seq_max])[1].astype(np.int32)

    def seq_mask_at(self, seq_id: int, idxs: np.ndarray) -> np.ndarray:
        """bool [len(idxs)]: which of the cells ``idxs`` hold ``seq_id``."""
        return (self._seq[seq_id >> 6, idxs] & _BIT[seq_id & 63]) != 0

    def seq_count_many(self, idxs: np.ndarray) -> np.ndarray:
        return np.bitwise_count(self._seq[:, idxs]).sum(axis=0, dtype=np.int32)

    def seq_get_many(self, idxs: np.ndarray) -> np.ndarray:
        """int32: the lowest sequence id of each cell (its only one where seq_count == 1)."""
        words = self._seq[:, idxs]
        w = np.argmax(words != 0, axis=0)
        v = words[w, np.arange(words.shape[1])]
        low = v & (~v + _ONE)  # lowest set bit, a power of two: exact in float64
        return (w * 64 + np.frexp(low.astype(np.float64))[1] - 1).astype(np.int32)

    def seqs_in(self, idxs: np.ndarray) -> list[int]:
        """Sorted ids of the sequences present in any of the cells ``idxs``."""
        words = np.bitwise_or.reduce(self._seq[:, idxs], axis=1) if idxs.size else np.zeros(SEQ_WORDS, np.uint64)
        return bitset_ids(words)

    def find(self, p0: int, p1: int, seq_id: int = -1) -> np.ndarray:
        """int64 indices of the non-empty cells with position in [p0, p1) (and holding ``seq_id`` when >= 0).

        Only the used range is scanned, and nothing when the sequence has no position in [p0, p1).
        """
        p0 = max(p0, 0)
        lo, hi = self.used_min(), self.used_max_p1()
        if seq_id >= 0:
            ms = self._seq_pos.get(seq_id)
            if not ms or p0 > ms.keys[-1] or p1 <= ms.keys[0]:
                return _NO_CELLS
            want = ms.count_in(p0, p1, _FEW)
            if want == 0:
                return _NO_CELLS
            if want <= _FEW:
                return self._find_few(p0, p1, seq_id, want, lo, hi)
        pos = self._pos[lo:hi]
        # empty cells hold -1 < p0; p1 stays strict, as the seed's pos_in (a cell at INT32_MAX is never in range)
        sel = (pos >= p0) if p1 > INT32_MAX else (pos >= p0) & (pos < p1)
        idxs = sel.nonzero()[0]
        if lo:
            idxs += lo
        if seq_id >= 0 and idxs.size:
            idxs = idxs[(self._seq[seq_id >> 6, idxs] & _BIT[seq_id & 63]) != 0]
        return idxs

    def _find_few(self, p0: int, p1: int, seq_id: int, want: int, lo: int, hi: int) -> np.ndarray:
        """The ``want`` cells of ``seq_id`` in [p0, p1), scanning back from the last used cell in growing chunks
        (recent tokens sit near the end): O(1) for the decode pattern, a full scan at worst."""
        pos, row, bit = self._pos, self._seq[seq_id >> 6], _BIT[seq_id & 63]
        if want == 1 and hi > lo and p0 <= pos[hi - 1] < p1 and row[hi - 1] & bit:
            return np.array([hi - 1], np.int64)  # the newest cell: the undo of a decode step
        found, n, step = [], 0, 64
        while hi > lo and n < want:
            a = max(lo, hi - step)
            seg = pos[a:hi]
            idx = ((seg >= p0) & (seg < p1)).nonzero()[0]
            if idx.size:
                idx += a
                idx = idx[(row[idx] & bit) != 0]
                if idx.size:
                    found.append(idx)
                    n += idx.size
            hi, step = a, step * 4
        assert n == want, f"seq {seq_id}: {n} cells in [{p0}, {p1}), its position multiset says {want}"
        if len(found) == 1:
            return found[0]
        return np.concatenate(found[::-1])

    # ------------------------------------------------------------------ vectorised mutators

    def rm_many(self, idxs: np.ndarray) -> None:
        """Empty the (non-empty) cells ``idxs``."""
        self._index_remove(idxs)
        self._clear_cells(idxs)
        self._log.add(idxs)

    def seq_rm_many(self, idxs: np.ndarray, seq_id: int) -> np.ndarray:
        """Remove ``seq_id`` from the cells ``idxs`` (all hold it); returns the cells that became empty."""
        w, bit = seq_id >> 6, _BIT[seq_id & 63]
        ms = self._seq_pos[seq_id]
        if idxs.size == 1:
            i = int(idxs[0])
            ms.dec(int(self._pos[i]))
            self._seq[w, i] &= ~bit
            emptied = idxs if not self._seq[:, i].any() else _NO_CELLS
        else:
            ms.update(self._pos[idxs], -1)
            self._seq[w, idxs] &= ~bit
            emptied = idxs[~self._seq[:, idxs].any(axis=0)]
        if not ms:
            del self._seq_pos[seq_id]
        if emptied.size:
            self._clear_cells(emptied)
            self._used.erase(emptied)
        self._log.add_seq(idxs, seq_id)  # (an emptied cell held only seq_id)
        return emptied

    def seq_keep_many(self, idxs: np.ndarray, seq_id: int) -> np.ndarray:
        """Keep only ``seq_id`` in the (non-empty) cells ``idxs``; returns the cells that became empty."""
        has = self.seq_mask_at(seq_id, idxs)
        # a used cell without any sequence is kept (the seed's release build; only pos_set() alone makes one)
        drop = idxs[~has & self._seq[:, idxs].any(axis=0)]
        keep = idxs[has]
        multi = keep[self.seq_count_many(keep) > 1] if keep.size else keep
        if multi.size:
            self._index_remove(multi)
            self._seq[:, multi] = 0
            self._seq[seq_id >> 6, multi] = _BIT[seq_id & 63]
            self._index_add(multi)
            self._log.add(multi)
        if drop.size:
            self.rm_many(drop)
        return drop

    def seq_add_many(self, idxs: np.ndarray, seq_id: int) -> None:
        """Add ``seq_id`` to the (non-empty) cells ``idxs``, none of which holds it yet."""
        self._seq[seq_id >> 6, idxs] |= _BIT[seq_id & 63]
        self._ms(seq_id).update(self._pos[idxs], +1)
        self._log.add_seq(idxs, seq_id)

    def pos_add_many(self, idxs: np.ndarray, d: int | np.ndarray) -> np.ndarray:
        """Shift the (non-empty) cells ``idxs`` by ``d`` (one value or one per cell); returns the cells emptied
        by a negative position."""
        d = np.asarray(d, np.int32)
        self._index_remove(idxs)
        self._pos[idxs] += d
        self._shift[idxs] += d
        self._has_shift = True
        neg = self._pos[idxs] < 0
        emptied = idxs[neg]
        if emptied.size:
            self._seq[:, emptied] = 0
            self._pos[emptied] = -1
            self._shift[emptied] = 0
            self._log.add(emptied)
        self._index_add(idxs[~neg])
        return emptied

    def pos_div_many(self, idxs: np.ndarray, d: int) -> None:
        """Divide the positions of the (non-empty) cells ``idxs`` by ``d`` (C truncation)."""
        if d == 0:
            raise ValueError("pos_div(): division by zero")
        self._index_remove(idxs)
        old = self._pos[idxs]
        new = (np.trunc(old / d)).astype(np.int32) if d < 0 else old // np.int32(d)
        self._pos[idxs] = new
        self._shift[idxs] += old - new
        self._index_add(idxs)
        self._has_shift = True

    def place(self, idxs: np.ndarray, pos: np.ndarray, seq_ids: np.ndarray, ext: np.ndarray | None = None) -> None:
        """Fill the empty cells ``idxs`` (pos_set + ext_set + seq_add).

        ``seq_ids`` is int32 [n, w]: the sequences of each cell, padded with -1 (the ubatch layout).
        """
        if idxs.size == 1 and seq_ids.shape[1] == 1:
            self.place_one(idxs.item(0), pos.item(0), seq_ids.item(0))
            if ext is not None:
                self._ext[idxs.item(0)] = ext[0]
            return
        self._pos[idxs] = pos
        if ext is not None:
            self._ext[idxs] = ext
        if seq_ids.shape[1] == 1:
            col = seq_ids[:, 0]
            if col.size <= LLAMA_MAX_SEQ:  # up to a decode step of several sequences: Python lists
                cl, il = col.tolist(), idxs.tolist()
                self._used.insert_bounds(min(il), max(il) + 1, len(il))
                if cl.count(cl[0]) < len(cl):
                    self._place_seqs(idxs, col, cl, pos.tolist(), il)
                    return
                self.seq_add_many(idxs, cl[0])
                return
            self._used.insert(idxs)
            first = int(col[0])
            if (col == first).all():
                self.seq_add_many(idxs, first)
                return
        else:
            self._used.insert(idxs)
        for s in np.unique(seq_ids[seq_ids >= 0]).tolist():
            self.seq_add_many(idxs[(seq_ids == s).any(axis=1)], s)

    def _place_seqs(self, idxs: np.ndarray, col: np.ndarray, cl: list[int], pl: list[int], il: list[int]) -> None:
        """place()'s sequences when each cell has one of several (the decode step of several sequences): one bit per
        cell at once, the position multisets with scalar Python.  ``cl``/``pl``/``il``: sequences, positions, cells
        as lists; ``col``: the sequences as an int32 array."""
        bits = _BIT_OF[col]                                   # uint64 [n]: each cell's sequence bit in its word
        if max(cl) < 64:
            self._seq[0, idxs] |= bits
        else:
            self._seq[col >> 6, idxs] |= bits
        newest, seq_pos = self._newest, self._seq_pos
        for s, p, i in zip(cl, pl, il):
            ms = seq_pos.get(s)
            if ms is not None and p > ms.keys[-1]:  # ms.inc(p) past the largest position
                ms.keys.append(p)
                ms.counts.append(1)
            else:
                self._ms(s).inc(p)
            newest[s] = i
        self._log.add_ones(il, cl)  # (single-cell entries: the kq mask rows patch them with scalar Python)

    def place_one(self, i: int, p: int, s: int) -> None:
        """place() of one cell ``i``, position ``p``, sequence ``s`` with scalar Python (the decode step)."""
        self._pos_m[i] = p
        self._used.insert_one(i)
        w, seq_m = s >> 6, self._seq_m
        seq_m[w, i] = seq_m[w, i] | 1 << (s & 63)
        ms = self._seq_pos.get(s)
        if ms is not None and p > ms.keys[-1]:  # ms.inc(p) past the largest position
            ms.keys.append(p)
            ms.counts.append(1)
        else:
            self._ms(s).inc(p)
        self._log.add_one(i, s)
        self._newest[s] = i

    # ------------------------------------------------------------------ consistency

    def _rebuild_indices(self) -> None:
        """Recompute both derived indices from the arrays."""
        self._seq_pos = {}
        used = np.flatnonzero(self._pos >= 0)
        self._used.rebuild(used)
        for s in self.seqs_in(used):
            self._ms(s).update(self._pos[used[self.seq_mask_at(s, used)]], +1)

    def check_invariants(self, where: str = "cells") -> list[str]:
        """Every disagreement between the arrays and the derived indices, recomputed from scratch (empty when the
        cells are consistent); each message starts with ``where``."""
        n = self._pos.shape[0]
        want = {"_pos": (n,), "_shift": (n,), "_ext": (n, 2), "_seq": (SEQ_WORDS, n)}
        errs = [f"{where}: {k} has shape {getattr(self, k).shape}, expected {shape}" for k, shape in want.items()
                if getattr(self, k).shape != shape]
        if errs:
            return errs  # the other checks index the arrays
        pos, shift, bits = self._pos, self._shift, self._seq
        empty, has_seq = pos == -1, bits.any(axis=0)
        errs += [f"{where}: cell {i} has position {pos[i]} (< -1)" for i in np.flatnonzero(pos < -1).tolist()]
        errs += [f"{where}: empty cell {i} holds sequences {bitset_ids(bits[:, i])}"
                 for i in np.flatnonzero(empty & has_seq).tolist()]
        errs += [f"{where}: empty cell {i} has shift {shift[i]} (expected 0)"
                 for i in np.flatnonzero(empty & (shift != 0)).tolist()]
        errs += [f"{where}: cell {i} holds position {pos[i]} but no sequence"
                 for i in np.flatnonzero((pos >= 0) & ~has_seq).tolist()]
        used = np.flatnonzero(pos >= 0)
        errs += self._used.check(used, pos, where)
        for q in sorted(set(self.seqs_in(used)) | set(self._seq_pos)):
            held = pos[used[self.seq_mask_at(q, used)]]
            ms = self._seq_pos.get(q)
            if ms is None:
                errs.append(f"{where}: sequence {q} holds {held.size} cells but has no position multiset")
                continue
            errs += ms.check(held, f"{where}: sequence {q}")
            pmin, pmax = (int(held.min()), int(held.max())) if held.size else (-1, -1)
            if (self.seq_pos_min(q), self.seq_pos_max(q)) != (pmin, pmax):
                errs.append(f"{where}: sequence {q} seq_pos_min/max = {self.seq_pos_min(q)}/{self.seq_pos_max(q)}, "
                            f"its cells give {pmin}/{pmax}")
        shifted = np.flatnonzero(shift != 0)
        if shifted.size and not self._has_shift:
            errs.append(f"{where}: {shifted.size} cells have a pending shift (first: cell {int(shifted[0])}) but "
                        f"has_shift is False")
        return errs

    # ------------------------------------------------------------------ private helpers

    def _as_idxs(self, i_or_idxs, n: int | None) -> np.ndarray:
        if n is not None:
            i = int(i_or_idxs)
            if i < 0 or i + n > self.size():
                raise ValueError(f"cell range [{i}, {i + n}) out of [0, {self.size()})")
            return np.arange(i, i + n, dtype=np.int64)
        idxs = np.asarray(i_or_idxs, dtype=np.int64).reshape(-1)
        if idxs.size and (idxs.min() < 0 or idxs.max() >= self.size()):
            raise ValueError(f"cell index out of [0, {self.size()}): {idxs.min()}..{idxs.max()}")
        return idxs

    def _ms(self, seq_id: int) -> PosMultiset:
        ms = self._seq_pos.get(seq_id)
        if ms is None:
            ms = self._seq_pos[seq_id] = PosMultiset()
        return ms

    def _clear_cells(self, idxs: np.ndarray) -> None:
        if idxs.size == 1:
            i = int(idxs[0])
            self._seq[:, i] = 0
            self._pos[i] = -1
            self._ext[i] = 0
            self._shift[i] = 0
            return
        self._seq[:, idxs] = 0
        self._pos[idxs] = -1
        self._ext[idxs] = 0
        self._shift[idxs] = 0

    def _index_add(self, idxs: np.ndarray) -> None:
        """Enter the (non-empty) cells ``idxs`` into the used set and the position multisets."""
        if not idxs.size:
            return
        self._used.insert(idxs)
        pos = self._pos[idxs]
        seqs = self.seqs_in(idxs)
        if len(seqs) == 1 and idxs.size == 1:
            self._ms(seqs[0]).inc(int(pos[0]))
            return
        for s in seqs:
            self._ms(s).update(pos[self.seq_mask_at(s, idxs)], +1)

    def _index_remove(self, idxs: np.ndarray) -> None:
        """Take the (non-empty) cells ``idxs`` out of the used set and the position multisets."""
        if not idxs.size:
            return
        pos = self._pos[idxs]
        for s in self.seqs_in(idxs):
            ms = self._seq_pos[s]
            ms.update(pos[self.seq_mask_at(s, idxs)], -1)
            if not ms:
                del self._seq_pos[s]
        self._used.erase(idxs)

    def __repr__(self) -> str:
        return f"KVCells(size={self.size()}, used={self._used.n}, seqs={sorted(self._seq_pos)})"
