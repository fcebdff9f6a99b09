"""Ready kq-mask rows, patched from the cells' change log instead of rebuilt (beyond llama.cpp; no ggml).

llama.cpp writes every mask row over all ``n_kv`` cells on every step.  Without a sliding window, ALiBi or 2-D
positions, the row of a token of sequence ``s`` at position ``p1`` hides cell ``j`` unless the cell holds ``s``
and (causal attention) ``pos[j] <= p1``.  When ``p1`` is at least ``s``'s largest position in the cells -- always so
on a decode step, whose token was just placed at the sequence's next position -- the position test hides nothing
the sequence test does not, and the row depends on the sequence bits alone: -inf where the cell lacks ``s``
(empty cells included), +0.0 where it holds it.

:class:`MaskRows` keeps such a row per (stream, sequence) -- in one block per stream and mask type, as the integer
bit patterns of the mask's float type -- and brings it up to date from the stream's change log
(:class:`~kvcache_ggml.cache.cells.index.ChangeLog`, ``KVCells.change_log``): a cell that gained or lost one sequence is
recomputed in that sequence's row only (scalar Python for the decode step's single cells), other changed cells in
every row of the block at once, and cells beyond what the rows cover yet are computed when ``n_kv`` grows.  A
dropped log (a reset, or more changes than patching pays for) empties the block; rows are then rebuilt as tokens
need them.  Memory is bounded (``budget`` bytes per block; the least recently used row gives way).

A decode loop sends the same tokens step after step.  The rows of the last one-token write and of the last
multi-stream write are kept once more in token order (:class:`_TokenRows`), each patched from its stream's log, so
that such a step's mask is one copy of ``n_tokens x n_kv`` values after a few scalar patches.

:meth:`KVInputs.set_input_kq_mask` uses it when every token of the ubatch qualifies and builds the mask in full
(:mod:`.masks`) otherwise, with the same bytes (tests/test_decode_fast_path.py compares both on random traces).
"""
from __future__ import annotations

import numpy as np

from .._consts import LLAMA_MAX_SEQ
from .bookkeeping import KVBookkeeping
from .cells.index import ChangeLog
from .cells.kvcells import KVCells
from .masks import NEG_INF_BITS

__all__ = ["MaskRows"]

_BUDGET = 64 << 20       # bytes of ready rows per block (stream and mask type)
_PATCH_MAX = 0.125       # patch at most this share of the covered cells; beyond, rebuild the rows that are needed
_FEW = 16                # changes of at most this many cells are patched with scalar Python


class _Block:
    """The ready rows of one stream for one mask type: row r is the mask row of sequence ``seqs[r]`` over the
    cells [0, n_valid), as of the first ``n_ones``, ``n_seq_changes`` and ``n_arrays`` entries of the stream's
    change log in its epoch ``epoch``, its ``bulk`` count then ``bulk``."""

    __slots__ = ("cells", "log", "itype", "neg", "cap", "rows", "frows", "seqs", "row_of", "row_map", "used",
                 "n_valid", "epoch", "bulk", "n_ones", "n_seq_changes", "n_arrays", "tick", "rows_m", "neg_i", "seq_m")

    def __init__(self, cells: KVCells, ftype: np.dtype, budget: int) -> None:
        self.cells = cells                                  # the stream's cells
        self.log = cells.change_log                         # ... and their change log
        self.itype, self.neg = NEG_INF_BITS[ftype]          # integer type with the mask's bit pattern, -inf in it
        self.cap = max(1, budget // (cells.size() * ftype.itemsize))  # rows the budget allows
        self.rows = np.empty((min(self.cap, 8), cells.size()), self.itype)  # [n_rows, size] bit patterns
        self.frows = self.rows.view(ftype)                  # the same as the mask's floats (0 and -inf): copied out
        self.rows_m = memoryview(self.rows)                 # the same for scalar writes (the decode step's patch)
        self.neg_i = int(self.neg)                          # -inf's bit pattern as a Python int
        self.seq_m = cells.seq_words()                      # the cells' sequence bits (taken again each epoch)
        self.seqs: list[int] = []                           # sequence of each row
        self.row_of: dict[int, int] = {}                    # sequence -> its row
        self.row_map = np.full(LLAMA_MAX_SEQ, -1, np.int32)  # the same as an array (-1: no row)
        self.used: list[int] = []                           # tick of each row's last use (LRU)
        self.n_valid = 0                                    # rows are exact over cells [0, n_valid)
        self.epoch = -1                                     # the log's epoch the rows belong to (none yet)
        self.bulk = -1                                      # the log's bulk count the rows reflect (none yet)
        self.n_ones = 0                                     # log entries the rows reflect: single cells,...
        self.n_seq_changes = 0                              # ... cells of one changed sequence,...
        self.n_arrays = 0                                   # ... and cells changed in any way
        self.tick = 0                                       # writes so far (a row's last use is one of them)

    def sync(self, n_kv: int) -> None:
        """Bring every row up to date over cells [0, max(n_valid, n_kv)), for a new write."""
        self.tick += 1
        log = self.log
        if log.bulk == self.bulk:  # single cells only since (the decode step): each in its sequence's row only
            one_cells = log.one_cells
            n_ones = len(one_cells)
            if n_ones > self.n_ones:
                if self.seqs:
                    row_of, seq_m, rows_m, n_valid = self.row_of, self.seq_m, self.rows_m, self.n_valid
                    one_seqs = log.one_seqs
                    for k in range(self.n_ones, n_ones):  # (inline: the decode step's two or so changes)
                        s = one_seqs[k]
                        r = row_of.get(s)
                        if r is not None:
                            i = one_cells[k]
                            if i < n_valid:
                                rows_m[r, i] = 0 if seq_m[s >> 6, i] >> (s & 63) & 1 else self.neg_i
                self.n_ones = n_ones
        else:
            if log.epoch != self.epoch:
                self.epoch = log.epoch
                self.seq_m = self.cells.seq_words()  # (a resize, which makes new arrays, starts an epoch)
                self.clear(n_kv)
            elif self.seqs and not self._patch(log):
                self.clear(n_kv)
            self.bulk = log.bulk
            self.n_ones, self.n_seq_changes, self.n_arrays = len(log.one_cells), len(log.seq_changes), len(log.arrays)
        if n_kv > self.n_valid:
            if self.seqs:
                self._fill(slice(self.n_valid, n_kv))
            self.n_valid = n_kv

    def _patch(self, log: ChangeLog) -> bool:
        """Recompute what the entries logged since those seen changed: a single (cell, sequence) change touches that
        sequence's row only (scalar Python: the decode step), cells of one changed sequence each its row, other
        changes every row.  False when so many cells changed that rebuilding the rows pays."""
        n_ones, n_seq, n_arrays = self.n_ones, self.n_seq_changes, self.n_arrays
        n = self.n_valid
        bits, rows, neg = self.cells.seq_bits, self.rows, self.neg
        if len(log.arrays) > n_arrays:
            arrays = log.arrays[n_arrays:]
            ch = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
            ch = ch[ch < n]
            if ch.size > _PATCH_MAX * n:
                return False
            if ch.size:
                self._fill(ch)
        one_cells, one_seqs = log.one_cells[n_ones:], log.one_seqs[n_ones:]
        for idxs, s in log.seq_changes[n_seq:]:
            if idxs.size <= _FEW:  # a few cells: with the single ones below
                one_cells += idxs.tolist()
                one_seqs += [s] * idxs.size if type(s) is int else s.tolist()
            elif type(s) is int:
                r = self.row_of.get(s)
                if r is not None:
                    cols = idxs[idxs < n]
                    rows[r, cols] = ((bits[s >> 6, cols] & np.uint64(1 << (s & 63))) == 0) * neg
            else:  # one sequence per cell
                r = self.row_map[s]
                sel = (r >= 0) & (idxs < n)
                cols, s = idxs[sel], s[sel]
                rows[r[sel], cols] = (((bits[s >> 6, cols] >> (s & 63).astype(np.uint64)) & 1) == 0) * neg
        row_of = self.row_of
        pairs = zip(one_seqs, one_cells) if len(one_cells) < 4 else dict.fromkeys(zip(one_seqs, one_cells))
        for s, i in pairs:  # (each (sequence, cell) once: an undone step's cells come back)
            r = row_of.get(s)
            if r is not None and i < n:
                rows[r, i] = 0 if bits.item(s >> 6, i) >> (s & 63) & 1 else neg
        return True

    def clear(self, n_kv: int) -> None:
        """Forget every row; rows added next cover [0, n_kv)."""
        if self.seqs:
            self.row_map[self.seqs] = -1
        self.seqs, self.row_of, self.used = [], {}, []
        self.n_valid = n_kv

    def row(self, seq_id: int) -> int | None:
        """The row of ``seq_id`` (after :meth:`sync`), built over [0, n_valid) if it has none; None when the
        budget's rows all serve the current write (``tick``)."""
        r = self.row_of.get(seq_id)
        if r is None:
            r = self._new_row(seq_id)
            if r is None:
                return None
        self.used[r] = self.tick
        return r

    def _new_row(self, seq_id: int) -> int | None:
        n_rows = len(self.seqs)
        if n_rows < self.cap:
            r = n_rows
            if r == self.rows.shape[0]:  # grow the storage (doubling, up to the budget)
                grown = np.empty((min(self.cap, 2 * r), self.rows.shape[1]), self.itype)
                grown[:r] = self.rows
                self.rows, self.frows, self.rows_m = grown, grown.view(self.frows.dtype), memoryview(grown)
            self.seqs.append(seq_id)
            self.used.append(0)
        else:  # the least recently used row gives way, unless it serves the current write too
            r = self.used.index(min(self.used))
            if self.used[r] == self.tick:
                return None
            del self.row_of[self.seqs[r]]
            self.row_map[self.seqs[r]] = -1
            self.seqs[r] = seq_id
        self.row_of[seq_id] = r
        self.row_map[seq_id] = r
        n = self.n_valid
        hidden = self.cells.seq_absent(seq_id, n)                      # [n_valid] bool
        np.multiply(hidden, self.neg, out=self.rows[r, :n])
        return r

    def _fill(self, cols: np.ndarray | slice) -> None:
        """Recompute the columns ``cols`` (cells) of every row from the sequence bits."""
        bits = self.cells.seq_bits                                     # [SEQ_WORDS, size] uint64
        n_rows = len(self.seqs)
        seqs = np.array(self.seqs, np.int64)
        words = seqs >> 6                                               # [n_rows]
        bit = (np.uint64(1) << (seqs & 63).astype(np.uint64))[:, None]  # [n_rows, 1]
        if isinstance(cols, slice):
            hidden = (bits[words, cols] & bit) == 0                     # [n_rows, width]
            np.multiply(hidden, self.neg, out=self.rows[:n_rows, cols])
        else:
            hidden = (bits[words[:, None], cols[None, :]] & bit) == 0   # [n_rows, n_cols]
            self.rows[:n_rows, cols] = hidden * self.neg


class _TokenRows:
    """The mask rows of the tokens of the last one-token write, or of the last multi-stream write, row i = token i's
    (the row of its sequence in its stream) over cells [0, n_valid): while the same tokens come again (a decode
    loop) each row is patched from its stream's change log and the write is one copy, instead of a block lookup, a
    sync and a copy per token.  A token's row follows the first ``n_ones[i]`` single-cell entries of its stream's
    log, whose ``bulk`` count was ``bulk[i]``; any other change since rebuilds that row from the sequence bits.  The
    cells of a stream are one object for the cache's life (KVBookkeeping makes them once), so their logs are too."""

    __slots__ = ("seqs", "ftype", "rows", "frows", "rows_m", "neg", "neg_i", "n_valid", "cells", "logs", "seq_m",
                 "bulk", "n_ones", "last_out")

    def __init__(self, seqs: list[int], cells: list[KVCells], out: np.ndarray) -> None:
        n_kv = out.shape[1]
        itype, self.neg = NEG_INF_BITS[out.dtype]
        self.seqs = seqs                                     # sequence of each token (row)
        self.ftype = out.dtype                               # the mask's float type
        self.rows = np.empty((len(seqs), cells[0].size()), itype)  # [n_tokens, size] bit patterns
        self.frows = self.rows.view(out.dtype)               # the same as floats
        self.frows[:, :n_kv] = out                           # a mask just written: the rows as of the logs now
        self.rows_m = memoryview(self.rows)                  # scalar patches
        self.neg_i = int(self.neg)                           # -inf's bit pattern as a Python int
        self.n_valid = n_kv                                  # rows are exact over cells [0, n_valid)
        self.cells = cells                                   # each token's stream cells...
        self.logs = [c.change_log for c in cells]            # ... their change logs
        self.seq_m = [c.seq_words() for c in cells]          # ... their sequence bits (taken again each epoch)
        self.bulk = [log.bulk for log in self.logs]          # each row's log position: bulk count...
        self.n_ones = [len(log.one_cells) for log in self.logs]  # ... and single-cell entries seen
        # the last ``out`` written whose rows are one span of ``rows``: (out, a byte view of it, the same bytes of
        # rows) -- the next write to it is a byte copy (memoryview: no numpy dispatch)
        self.last_out: tuple = (None, None, None)

    def write(self, out: np.ndarray, pos: list[int], causal: bool) -> bool:
        """Bring every row up to date over [0, n_kv) and copy the rows into ``out`` [n_tokens, n_kv] -- False
        (``out`` unwritten) when a token at ``pos`` needs its positions tested (as :meth:`MaskRows.write`)."""
        bulk, n_ones = self.bulk, self.n_ones
        i = 0
        for log, s, cells, p in zip(self.logs, self.seqs, self.cells, pos):
            lo, hi = cells.seq_pos_bounds(s)
            if lo < 0 or (causal and hi > p):  # (rows patched so far stay exact)
                return False
            if log.bulk != bulk[i]:
                self._rebuild(i)
            else:
                m = len(log.one_cells)
                if m > n_ones[i]:  # (the decode step's one or two single cells per stream)
                    self._patch(i, s, log, m)
            i += 1
        return self._copy(out)

    def write_one(self, out: np.ndarray, p: int, causal: bool) -> bool:
        """:meth:`write` of the one token of a one-token write (the decode step of one sequence), without the loop
        over tokens."""
        s = self.seqs[0]
        lo, hi = self.cells[0].seq_pos_bounds(s)
        if lo < 0 or (causal and hi > p):
            return False
        log = self.logs[0]
        if log.bulk != self.bulk[0]:
            self._rebuild(0)
        else:
            m = len(log.one_cells)
            if m > self.n_ones[0]:
                self._patch(0, s, log, m)
        return self._copy(out)

    def _patch(self, i: int, s: int, log: ChangeLog, m: int) -> None:
        """Row i (sequence ``s``) from its log's single-cell entries [n_ones[i], m), newest first, each cell once (an
        undone step and the next one log the same cell twice: the row follows the cell's current bits either
        way)."""
        k = self.n_ones[i]
        if m == k + 1:  # one new entry (a decode loop's placement)
            c = log.one_cells[k]
            if log.one_seqs[k] == s and c < self.n_valid:
                self.rows_m[i, c] = 0 if self.seq_m[i][s >> 6, c] >> (s & 63) & 1 else self.neg_i
            self.n_ones[i] = m
            return
        one_cells, one_seqs, seq_m, rows_m = log.one_cells, log.one_seqs, self.seq_m[i], self.rows_m
        n_valid, w, sh, done = self.n_valid, s >> 6, s & 63, -1
        for k in range(m - 1, k - 1, -1):
            c = one_cells[k]
            if c != done and one_seqs[k] == s and c < n_valid:
                rows_m[i, c] = 0 if seq_m[w, c] >> sh & 1 else self.neg_i
                done = c
        self.n_ones[i] = m

    def _copy(self, out: np.ndarray) -> bool:
        """Extend the rows over [n_valid, n_kv) if ``out`` [n_tokens, n_kv] reaches further, then copy them there."""
        last = self.last_out
        if last[0] is out:  # the mask view of the last write (a decode loop): as wide, the rows cover it already
            last[1][:] = last[2]
            return True
        n_kv = out.shape[1]
        n_valid = self.n_valid
        if n_kv > n_valid:
            for i, (cells, s) in enumerate(zip(self.cells, self.seqs)):
                np.multiply(cells.seq_absent(s, n_kv)[n_valid:], self.neg, out=self.rows[i, n_valid:n_kv])
            self.n_valid = n_kv
        out[...] = self.frows[:, :n_kv]
        if len(self.seqs) == 1 or n_kv == self.rows.shape[1]:  # the rows' first n_kv columns are one span
            if out.flags.c_contiguous:  # (the inputs' views are)
                self.last_out = (out, memoryview(out).cast("B"), memoryview(self.rows).cast("B")[:out.nbytes])
        return True

    def _rebuild(self, i: int) -> None:
        """Row i from its sequence's bits, after a change other than single cells (or a dropped log)."""
        cells, log, s = self.cells[i], self.logs[i], self.seqs[i]
        self.seq_m[i] = cells.seq_words()
        np.multiply(cells.seq_absent(s, self.n_valid), self.neg, out=self.rows[i, :self.n_valid])
        self.bulk[i], self.n_ones[i] = log.bulk, len(log.one_cells)


class MaskRows:
    """The ready rows of every stream, per mask type; :meth:`write_one` and :meth:`write` fill a mask from them.

    Both return False (the caller then builds the mask in full) when a causal token's position is below its
    sequence's largest one (the row needs the position test), when a sequence holds a cell at position -1 (a token
    placed there: the cell is empty to llama.cpp, and the position multisets may disagree with the bits) or no cell,
    or when the tokens need more rows than the budget holds."""

    def __init__(self, book: KVBookkeeping, budget: int = _BUDGET) -> None:
        self.book = book                                  # the cells the rows are derived from
        self.budget = budget                              # bytes per block
        self._blocks: dict[tuple[int, np.dtype], _Block] = {}  # (stream, mask type) -> rows
        self._one: _TokenRows | None = None               # the row of the last write_one's token
        self._tokens: _TokenRows | None = None            # the rows of the last multi-stream write's tokens

    def held(self) -> dict:
        """What the ready rows hold now (tests and notebooks: which paths served): ``blocks`` -- (stream, mask type)
        pairs with rows; ``one`` and ``tokens`` -- the sequences of the kept token rows of the last one-token write
        and of the last multi-stream write (None: none), and whether their next write to the same mask is a byte
        copy (``one_copy``, ``tokens_copy``)."""
        one, tok = self._one, self._tokens
        return {"blocks": sorted((s, np.dtype(t).name) for s, t in self._blocks),
                "one": None if one is None else list(one.seqs), "one_copy": one is not None and
                one.last_out[0] is not None, "tokens": None if tok is None else list(tok.seqs),
                "tokens_copy": tok is not None and tok.last_out[0] is not None}

    def write_one(self, rows: np.ndarray, seq_id: int, p1: int, causal: bool) -> bool:
        """Fill the mask ``rows`` [1, n_kv] (float32 or float16) of one token of ``seq_id`` at position ``p1``."""
        one = self._one  # (the same sequence and type step after step: its row patched from the log, one copy)
        if one is not None and one.seqs[0] == seq_id and one.ftype is rows.dtype:
            return one.write_one(rows, p1, causal)
        book = self.book
        strm = book.stream_of[seq_id]
        cells = book.v_cells[strm]
        lo, hi = cells.seq_pos_bounds(seq_id)
        if lo < 0 or (causal and hi > p1):  # (lo -1: no cell, or a cell at -1)
            return False
        n_kv = rows.shape[1]
        block = self._block(strm, rows.dtype, n_kv)
        r = block.row(seq_id)  # (never None: the least recently used row served an earlier write)
        rows[0] = block.frows[r, :n_kv]
        self._one = _TokenRows([seq_id], [cells], rows)
        return True

    def write(self, rows: np.ndarray, seq_ids: list[int], pos: list[int], causal: bool) -> bool:
        """Fill the mask rows ``rows`` [n_tokens, n_kv] (float32 or float16) of tokens of sequences ``seq_ids`` at
        positions ``pos``."""
        book = self.book
        if book.n_stream != 1:
            return self._write_streams(rows, seq_ids, pos, causal)
        if not book.v_cells[0].seq_pos_within(seq_ids, pos if causal else None):
            return False
        out = rows
        n_kv = out.shape[1]
        block = self._block(0, rows.dtype, n_kv)
        rs = list(map(block.row_of.get, seq_ids))
        if None in rs:  # some row has to be built
            rs = [block.row(s) for s in seq_ids]
            if None in rs:
                return False
        else:
            used, tick = block.used, block.tick
            for r in rs:
                used[r] = tick
        frows = block.frows
        for i, r in enumerate(rs):  # (np.take would first copy every row of the strided [:, :n_kv] view)
            out[i] = frows[r, :n_kv]
        return True

    def _write_streams(self, out: np.ndarray, seq_ids: list[int], pos: list[int], causal: bool) -> bool:
        """:meth:`write` over several streams: the rows of the last such write again (:class:`_TokenRows`) when the
        same tokens come, else each token's row from its sequence's stream block, each block synced once."""
        tokens = self._tokens
        if tokens is not None and tokens.seqs == seq_ids and tokens.ftype is out.dtype:
            return tokens.write(out, pos, causal)
        book = self.book
        stream_of, v_cells = book.stream_of, book.v_cells
        for s, p in zip(seq_ids, pos):
            lo, hi = v_cells[stream_of[s]].seq_pos_bounds(s)
            if lo < 0 or (causal and hi > p):  # (lo -1: no cell, or a cell at -1)
                return False
        if not self._write_blocks(out, seq_ids):
            return False
        self._tokens = _TokenRows(list(seq_ids), [v_cells[stream_of[s]] for s in seq_ids], out)
        return True

    def _write_blocks(self, out: np.ndarray, seq_ids: list[int]) -> bool:
        """Each token's row of ``out`` from its sequence's stream block."""
        book = self.book
        stream_of, v_cells = book.stream_of, book.v_cells
        n_kv = out.shape[1]
        ftype = out.dtype
        synced = {}
        for i, s in enumerate(seq_ids):
            st = stream_of[s]
            block = synced.get(st)
            if block is None:
                block = synced[st] = self._block(st, ftype, n_kv)
            r = block.row_of.get(s)
            if r is None:
                r = block.row(s)
                if r is None:
                    return False
            else:
                block.used[r] = block.tick
            out[i] = block.frows[r, :n_kv]
        return True

    def _block(self, strm: int, ftype: np.dtype, n_kv: int) -> _Block:
        """The rows of stream ``strm`` for masks of ``ftype``, synced over at least [0, n_kv)."""
        block = self._blocks.get((strm, ftype))
        if block is None or block.cells is not self.book.v_cells[strm]:
            block = self._blocks[(strm, ftype)] = _Block(self.book.v_cells[strm], ftype, self.budget)
        block.sync(n_kv)
        return block
