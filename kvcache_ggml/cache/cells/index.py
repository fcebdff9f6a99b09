"""The derived indices of a stream's cells (no ggml): the used range, the per-sequence position multisets, and the
log of changed cells.

:class:`UsedRange` is llama.cpp's ``used`` set reduced to what the cache asks of it: how many cells are used and
the first and last of them.  :class:`PosMultiset` is llama.cpp's per-sequence ``std::map<llama_pos, int>``.
:class:`ChangeLog` (beyond llama.cpp) lists the cells whose sequence set changed, so that what is derived from the
sequence bits (the kq mask rows of :mod:`kvcache_ggml.cache.mask_rows`) can be patched instead of rebuilt.
:class:`~kvcache_ggml.cache.cells.KVCells` keeps all three in sync with its arrays.
"""
from __future__ import annotations

from bisect import bisect_left

import numpy as np

__all__ = ["ChangeLog", "PosMultiset", "UsedRange", "sorted_counts"]


class PosMultiset:
    """Sorted multiset of positions (llama.cpp's ``std::map<llama_pos, int>``) as two Python lists.

    Appending past the maximum and removing the maximum -- the decode pattern -- are O(1).
    """

    __slots__ = ("keys", "counts")

    def __init__(self) -> None:
        self.keys: list[int] = []    # distinct positions, ascending
        self.counts: list[int] = []  # how many cells hold keys[k]

    def __len__(self) -> int:
        return len(self.keys)

    def inc(self, p: int) -> None:
        keys = self.keys
        if not keys or p > keys[-1]:
            keys.append(p)
            self.counts.append(1)
            return
        k = bisect_left(keys, p)
        if k < len(keys) and keys[k] == p:
            self.counts[k] += 1
        else:
            keys.insert(k, p)
            self.counts.insert(k, 1)

    def count_in(self, p0: int, p1: int, limit: int) -> int:
        """Cells holding a position in [p0, p1); any value above ``limit`` is reported as ``limit + 1``."""
        keys, counts = self.keys, self.counts
        a = bisect_left(keys, p0)
        b = bisect_left(keys, p1, a)
        if b - a > limit:
            return limit + 1
        return sum(counts[a:b])

    def dec(self, p: int) -> None:
        keys = self.keys
        k = len(keys) - 1 if keys and keys[-1] == p else bisect_left(keys, p)
        assert k < len(keys) and keys[k] == p, f"position {p} is not in the multiset"
        self.counts[k] -= 1
        if self.counts[k] == 0:
            del keys[k]
            del self.counts[k]

    def check(self, held: np.ndarray, where: str) -> list[str]:
        """Disagreements with ``held``, the positions of the cells that hold the sequence (with repeats)."""
        errs = []
        malformed = len(self.keys) != len(self.counts) or self.keys != sorted(set(self.keys))
        if malformed or min(self.counts, default=1) <= 0:
            errs.append(f"{where} multiset is malformed (keys {self.keys[:8]}..., counts {self.counts[:8]}...)")
        want_k, want_c = sorted_counts(held)
        have = dict(zip(self.keys, self.counts))
        want = dict(zip(want_k.tolist(), want_c.tolist()))
        if have != want:
            diff = sorted(set(have) ^ set(want) | {p for p in have if have[p] != want.get(p)})[:8]
            errs.append(f"{where} multiset {{pos: count}} disagrees with its cells at positions {diff} (multiset "
                        f"{[have.get(p, 0) for p in diff]}, cells {[want.get(p, 0) for p in diff]})")
        return errs

    def update(self, ps: np.ndarray, sign: int) -> None:
        """Add (sign=+1) or remove (sign=-1) every position of ``ps``, with multiplicity."""
        if ps.size <= 8:
            f = self.inc if sign > 0 else self.dec
            for p in ps.tolist():
                f(p)
            return
        u, c = sorted_counts(ps)
        if not self.keys:
            assert sign > 0, "removing positions from an empty multiset"
            self.keys, self.counts = u.tolist(), c.tolist()
            return
        keys = np.array(self.keys, dtype=np.int64)
        counts = np.array(self.counts, dtype=np.int64)
        k = np.searchsorted(keys, u)
        hit = k < keys.size
        hit[hit] = keys[k[hit]] == u[hit]
        if hit.all():  # no new position: adjust counts in place (every removal takes this path)
            counts[k] += sign * c
            assert (counts >= 0).all(), "removing positions that are not in the multiset"
            keep = counts > 0
            if keep.all():
                self.counts = counts.tolist()
            else:
                self.keys, self.counts = keys[keep].tolist(), counts[keep].tolist()
            return
        assert sign > 0, "removing positions that are not in the multiset"
        counts[k[hit]] += c[hit]
        merged = np.concatenate([keys, u[~hit]])
        order = np.argsort(merged, kind="stable")
        self.keys = merged[order].tolist()
        self.counts = np.concatenate([counts, c[~hit]])[order].tolist()


def sorted_counts(ps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct values of ``ps`` ascending, and how often each occurs (np.unique without its overhead)."""
    s = np.sort(ps.astype(np.int64, copy=False))
    if s.size == 0:
        return s, s
    start = np.empty(s.size, bool)
    start[0] = True
    np.not_equal(s[1:], s[:-1], out=start[1:])
    first = start.nonzero()[0]
    return s[first], np.diff(np.append(first, s.size))


class UsedRange:
    """Count and bounds of the used (non-empty) cells of a stream.

    The bounds are exact, or -- after the first or last used cell was freed -- "dirty": an enclosure of every used
    cell that :meth:`first`/:meth:`end` shrink lazily with a chunked scan of the positions.
    """

    __slots__ = ("n", "lo", "hi", "lo_dirty", "hi_dirty")

    def __init__(self) -> None:
        self.n = 0                 # number of used cells
        self.lo = 0                # first used cell (a lower bound of it while lo_dirty)
        self.hi = 0                # last used cell + 1 (an upper bound while hi_dirty)
        self.lo_dirty = False      # the first used cell was freed: re-scan lazily
        self.hi_dirty = False      # the last used cell was freed: re-scan lazily

    def reset(self) -> None:
        self.n = self.lo = self.hi = 0
        self.lo_dirty = self.hi_dirty = False

    def rebuild(self, used: np.ndarray) -> None:
        """Exact values from the ascending indices of every used cell."""
        self.n = used.size
        self.lo, self.hi = (int(used[0]), int(used[-1]) + 1) if used.size else (0, 0)
        self.lo_dirty = self.hi_dirty = False

    def check(self, used: np.ndarray, pos: np.ndarray, where: str) -> list[str]:
        """Disagreements with ``used``, the ascending indices of the non-empty cells of ``pos``."""
        lo, hi = (int(used[0]), int(used[-1]) + 1) if used.size else (0, 0)
        errs = []
        if self.n != used.size:
            errs.append(f"{where}: used count {self.n} != {used.size} non-empty cells")
        if used.size:
            # a stale (dirty) bound only has to enclose the used cells; a clean one must be exact
            if self.lo > lo or (not self.lo_dirty and self.lo != lo):
                errs.append(f"{where}: stored used_min {self.lo} (stale: {self.lo_dirty}), first used cell {lo}")
            if self.hi < hi or (not self.hi_dirty and self.hi != hi):
                errs.append(f"{where}: stored used_max_p1 {self.hi} (stale: {self.hi_dirty}), last used cell + 1 = "
                            f"{hi}")
        first = self.first(pos) if self.lo_dirty else self.lo
        end = self.end(pos, memoryview(pos)) if self.hi_dirty else self.hi
        if first != lo:
            errs.append(f"{where}: used_min() = {first}, first used cell is {lo}")
        if end != hi:
            errs.append(f"{where}: used_max_p1() = {end}, last used cell + 1 is {hi}")
        return errs

    def insert(self, idxs: np.ndarray) -> None:
        """The (previously empty) cells ``idxs`` became used."""
        if idxs.size == 1:
            lo = int(idxs[0])
            self.insert_bounds(lo, lo + 1, 1)
        else:
            self.insert_bounds(int(idxs.min()), int(idxs.max()) + 1, idxs.size)

    def insert_bounds(self, lo: int, hi: int, n: int) -> None:
        """``n`` (previously empty) cells became used, the first ``lo`` and the last ``hi - 1``."""
        if self.n == 0:
            self.lo, self.hi = lo, hi
            self.lo_dirty = self.hi_dirty = False
        else:
            # exact bounds stay exact; stale (dirty) bounds stay an enclosure of every used cell, and become exact
            # again when a new cell reaches them (no used cell lies beyond it)
            if lo <= self.lo:
                self.lo, self.lo_dirty = lo, False
            if hi >= self.hi:
                self.hi, self.hi_dirty = hi, False
        self.n += n

    def insert_one(self, i: int) -> None:
        """The (previously empty) cell ``i`` became used."""
        if self.n == 0:
            self.lo, self.hi = i, i + 1
            self.lo_dirty = self.hi_dirty = False
        else:
            # a bound the new cell reaches is exact again: no used cell lies beyond it
            if i <= self.lo:
                self.lo, self.lo_dirty = i, False
            if i + 1 >= self.hi:
                self.hi, self.hi_dirty = i + 1, False
        self.n += 1

    def erase_one(self, i: int) -> None:
        """The (previously used) cell ``i`` became empty."""
        self.n -= 1
        assert self.n >= 0
        if self.n == 0:
            self.reset()
            return
        if i <= self.lo:
            self.lo_dirty = True
        if i + 1 >= self.hi:
            self.hi_dirty = True

    def erase(self, idxs: np.ndarray) -> None:
        """The (previously used) cells ``idxs`` became empty."""
        self.n -= idxs.size
        assert self.n >= 0
        if self.n == 0:
            self.reset()
            return
        lo, hi = (int(idxs[0]), int(idxs[0]) + 1) if idxs.size == 1 else (int(idxs.min()), int(idxs.max()) + 1)
        if lo <= self.lo:
            self.lo_dirty = True
        if hi >= self.hi:
            self.hi_dirty = True

    def end(self, pos: np.ndarray, pos_m: memoryview) -> int:
        """The last used cell + 1, shrinking a dirty bound (backward scan of ``pos`` in growing chunks; ``pos_m``,
        a memoryview of it, for the scalar reads)."""
        hi, step = self.hi, 64
        if hi > 1 and pos_m[hi - 2] >= 0 and pos_m[hi - 1] < 0:  # the last cell was freed, the one before is used
            hi -= 1
        else:
            while hi > 0:
                lo = max(0, hi - step)
                nz = (pos[lo:hi] >= 0).nonzero()[0]
                if nz.size:
                    hi = lo + int(nz[-1]) + 1
                    break
                hi, step = lo, step * 4
        self.hi, self.hi_dirty = hi, False
        return hi

    def first(self, pos: np.ndarray) -> int:
        """The first used cell, raising a dirty bound (forward scan of ``pos`` in growing chunks)."""
        lo, step, n = self.lo, 64, pos.shape[0]
        while lo < n:
            up = min(n, lo + step)
            nz = (pos[lo:up] >= 0).nonzero()[0]
            if nz.size:
                lo += int(nz[0])
                break
            lo, step = up, step * 4
        self.lo, self.lo_dirty = lo, False
        return lo


class ChangeLog:
    """The cells whose sequence set changed, in three kinds of entries, for readers that keep something derived
    from the sequence bits (the kq mask rows of :mod:`kvcache_ggml.cache.mask_rows`).

    * ``one_cells``/``one_seqs`` (parallel lists of ints): cell ``one_cells[k]`` gained or lost sequence
      ``one_seqs[k]`` and no other (the decode step's placements and undos);
    * ``seq_changes``: (int64 cells, sequence) -- the cells gained or lost that sequence and no other; the sequence
      is an int, or an int32 array with one sequence per cell;
    * ``arrays``: int64 cells whose sets changed in any way (emptied, restored, ...): every sequence may differ.

    Cells may repeat and entries are not ordered across kinds: a reader recomputes what it derived from the cells'
    current bits.  It keeps the ``epoch`` and how many entries of each kind it has seen, and reads the entries
    logged since.  A new epoch means the entries were dropped in between -- by a wholesale change (a reset), or
    because the array entries grew past ``max_cells`` cells or a list past ``max_entries`` entries (patching would
    then cost about a rebuild) -- and the reader rebuilds.  ``bulk`` counts every entry of the other two kinds and
    every drop: while it stays what a reader saw, only single cells came since (one comparison tells the decode
    step so).  Logging costs an append; nothing is kept for readers that never come.
    """

    __slots__ = ("one_cells", "one_seqs", "seq_changes", "arrays", "n_cells", "epoch", "bulk", "max_cells",
                 "max_entries")

    def __init__(self, max_cells: int, max_entries: int = 512) -> None:
        self.one_cells: list[int] = []              # a cell that gained or lost one sequence...
        self.one_seqs: list[int] = []               # ... that sequence
        self.seq_changes: list[tuple[np.ndarray, int | np.ndarray]] = []  # (cells, their one changed sequence(s))
        self.arrays: list[np.ndarray] = []          # cells changed in any way
        self.n_cells = 0                            # cells in ``seq_changes`` and ``arrays`` (with repeats)
        self.epoch = 0                              # bumped when the entries are dropped
        self.bulk = 0                               # seq_changes and arrays entries and drops, ever
        self.max_cells = max_cells                  # drop the entries beyond this many array cells...
        self.max_entries = max_entries              # ... or this many entries of a kind

    def add_one(self, i: int, seq_id: int) -> None:
        """Cell ``i`` gained or lost sequence ``seq_id``, and nothing else changed in it."""
        cells = self.one_cells
        cells.append(i)
        self.one_seqs.append(seq_id)
        if len(cells) > self.max_entries:
            self.drop()

    def add_ones(self, cells: list[int], seq_ids: list[int]) -> None:
        """:meth:`add_one` of each pair (cells[k], seq_ids[k]): a few cells, each its own sequence."""
        one_cells = self.one_cells
        one_cells += cells
        self.one_seqs += seq_ids
        if len(one_cells) > self.max_entries:
            self.drop()

    def add_seq(self, idxs: np.ndarray, seq_ids: int | np.ndarray) -> None:
        """The cells ``idxs`` (int64) gained or lost sequence ``seq_ids`` (or each its own, int32 array), and
        nothing else changed in them."""
        self.seq_changes.append((idxs, seq_ids))
        self.bulk += 1
        self._count(idxs.size, len(self.seq_changes))

    def add(self, idxs: np.ndarray) -> None:
        """The cells ``idxs`` (int64) changed in any way (any sequence may have joined or left them)."""
        self.arrays.append(idxs)
        self.bulk += 1
        self._count(idxs.size, len(self.arrays))

    def _count(self, n: int, entries: int) -> None:
        self.n_cells += n
        if self.n_cells > self.max_cells or entries > self.max_entries:
            self.drop()

    def drop(self) -> None:
        """Forget the entries: every reader's position becomes stale (a wholesale change, or too many entries)."""
        self.one_cells, self.one_seqs, self.seq_changes, self.arrays = [], [], [], []
        self.n_cells = 0
        self.epoch += 1
        self.bulk += 1
