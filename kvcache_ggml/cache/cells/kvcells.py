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
* ``pos_set`` (the used range) and the scalar helpers of the decode step ``seq_rm_last`` and ``rm_only``, each for
  the one cell and sequence it changes.

:meth:`~KVCells.check_invariants` recomputes both indices from the arrays and reports every disagreement.

Every llama.cpp method has a counterpart with the same name working on one cell (``is_empty`` .. ``pos_div``), with
the seed's preconditions asserted; most go through the vectorised methods.  The cache itself uses the vectorised
``*_many``/``find``/``place`` methods, which give the same result as the per-cell loops of the seed, and on the
decode step their scalar variants (``place_one``, ``seq_rm_last``, ``one_token_slot``, ``rm_only``).

One class, as llama.cpp's: the arrays and the indices derived from them change together, so every method that
changes one sees the private helpers that keep the other in sync (this file is over the 600-line cap for that,
allowed in scripts/check_layout.py).  Scalar reads of the decode step go through memoryviews of the arrays
(``_pos_m``, ``_seq_m``, ...), cheaper than numpy's item access.
"""
from __future__ import annotations

import numpy as np

from ..._consts import INT32_MAX, LLAMA_MAX_SEQ, SEQ_WORDS
from .index import ChangeLog, PosMultiset, UsedRange
from .onecell import CellExt, bitset_ids, slot_search_start

__all__ = ["KVCells", "CellExt", "LLAMA_MAX_SEQ", "bitset_ids"]

_ONE = np.uint64(1)
_BIT = [np.uint64(1 << b) for b in range(64)]
_BIT_OF = np.array([1 << (s & 63) for s in range(LLAMA_MAX_SEQ)], np.uint64)  # sequence -> its bit in its word
_FEW = 64  # find() scans backwards for this many cells of a sequence or fewer
assert SEQ_WORDS == 4, "seq_rm_last reads the words of a cell one by one"
_NO_CELLS = np.empty(0, np.int64)
_NO_CELLS.flags.writeable = False


class KVCells:
    """The cells of one stream of the cache (llama.cpp's ``llama_kv_cells``): the parallel arrays, the derived
    indices that private helpers keep in sync with them, llama.cpp's one-cell methods, their vectorised
    counterparts and the scalar helpers of the decode step, in one class (see the module docstring)."""

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
        res.assign(self._pos[idxs], self._ext[idxs], self._seq[:, idxs])
        return res

    def assign(self, pos: np.ndarray, ext: np.ndarray, seq: np.ndarray) -> None:
        """Take the arrays (int32 [n] positions, int32 [n, 2] extensions, uint64 [SEQ_WORDS, n] bitsets; owned from
        now on) as the cells, without a pending shift, and rebuild the derived indices from them (cp()'s copy)."""
        self._pos = pos
        self._shift = np.zeros(pos.shape[0], np.int32)
        self._ext = ext
        self._seq = seq
        self._views()
        self._rebuild_indices()

    def set(self, i_or_idxs, other: "KVCells") -> None:
        """Overwrite cells ``[i, i + len(other))`` or the cells ``idxs`` with the cells of ``other``."""
        idxs = self._as_idxs(i_or_idxs, other.size() if np.isscalar(i_or_idxs) else None)
        if idxs.size != other.size():
            raise ValueError(f"set(): {idxs.size} target cells for {other.size()} source cells")
        self.restore(idxs, other.pos_array, other.ext_array, other.seq_bits)

    def snapshot(self, idxs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Raw copy of cells (pos, ext, seq) -- the light form of cp() that prepare() uses; :meth:`restore` puts
        it back."""
        return self._pos[idxs], self._ext[idxs], self._seq[:, idxs]

    def restore(self, idxs: np.ndarray, pos: np.ndarray, ext: np.ndarray, seq: np.ndarray) -> None:
        """Overwrite the cells ``idxs`` with ``pos``/``ext``/``seq`` (a :meth:`snapshot` of them), keeping the
        derived indices and the change log in sync."""
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

    # ------------------------------------------------------------------ llama.cpp's one-cell methods

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
