"""The memory operations of :class:`~kvcache_ggml.prefix.core.PrefixCache`: each calls the context's own operation,
then cuts every affected entry back to the prefix the operation cannot have touched.

The rule is one number per operation, the *first position that may have changed* for a sequence; the entry keeps
its tokens below it (a cell below it still holds exactly what a fresh decode of those tokens leaves):

==============================  =======================================================================
operation                       first position that may have changed
==============================  =======================================================================
``seq_rm(s, p0, p1)``           ``p0`` (when the sequence has a cell in [p0, p1))
``seq_add(s, p0, p1, d)``       ``p0`` for d > 0; ``max(0, p0 + d)`` for d < 0 (cells land there, twice)
``seq_div(s, p0, p1, d)``       ``p0 // d`` (the lowest position a divided cell lands on)
``seq_cp(src, dst, p0, p1)``    dst: ``max(p0, min position of src in range)``; an empty dst copied from
                                position 0 takes src's tokens below ``p1``; across streams dst becomes src
``seq_keep(s)``                 every other sequence of the stream: 0 (gone)
``context_shift(s, k, n)``      ``k``
``clear()``, whole restore      every sequence: 0
``state_load(blob, s)``         ``s``: 0, or the tokens the caller vouches for
==============================  =======================================================================

A sequence with no cell in the range is left alone (``seq_pos_min/max`` before the call tell).  After the cut the
entry is *clean* when the sequence has no cell beyond its tokens (``seq_pos_max + 1 == n``); only a clean entry
grows when more tokens are decoded into its sequence.  A failing operation raises before changing the cache (the
context's contract), so the entries stay as they were -- except a failed restore, which empties its target and is
followed by the same cut.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..inspect import cells_table

__all__ = ["MemoryOpsMixin"]

_POS_MAX = 2**31 - 1


def _clamp(p0: int, p1: int) -> tuple[int, int]:
    return max(p0, 0), (_POS_MAX if p1 < 0 else p1)


def _has_seq(t: np.ndarray, s: int) -> np.ndarray:
    """bool [rows]: the cells of a :func:`cells_table` holding sequence s."""
    return (t["seq_bits"][:, s // 64] >> np.uint64(s % 64)) & np.uint64(1) != 0


def _bit(words: np.ndarray, s: int) -> bool:
    return bool((int(words[s // 64]) >> (s % 64)) & 1)


class MemoryOpsMixin:
    """``seq_rm``, ``seq_cp``, ``seq_keep``, ``seq_add``, ``seq_div``, ``context_shift``, ``clear`` and
    ``state_load`` through the prefix cache (same arguments and errors as the context's ``memory_*``)."""

    ctx: Any
    seqs: dict

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        a, b = _clamp(p0, p1)
        ranges = self._ranges(seq_id)
        ok = self.ctx.memory_seq_rm(seq_id, p0, p1)
        for s, (lo, hi) in ranges.items():
            if a < b and lo <= hi and a <= hi and lo < b:
                self._cut(s, a)
        return ok

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        a, b = _clamp(p0, p1)
        moved = self._movers(seq_id, a, b)
        self.ctx.memory_seq_add(seq_id, p0, p1, delta)
        if delta != 0:
            for s in moved:
                self._cut(s, max(0, a + min(delta, 0)))

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        a, b = _clamp(p0, p1)
        moved = self._movers(seq_id, a, b)
        self.ctx.memory_seq_div(seq_id, p0, p1, d)
        if d != 1:
            for s in moved:
                self._cut(s, a // d)

    def seq_keep(self, seq_id: int) -> None:
        self.ctx.memory_seq_keep(seq_id)
        stream = self._stream_of(seq_id)
        for s in [s for s, e in self.seqs.items() if e.stream == stream and s != seq_id]:
            self._cut(s, 0)

    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int = -1, p1: int = -1) -> None:
        if seq_id_src == seq_id_dst:
            self.ctx.memory_seq_cp(seq_id_src, seq_id_dst, p0, p1)
            return
        if self._stream_of(seq_id_src) != self._stream_of(seq_id_dst):
            self._stream_copy(seq_id_src, seq_id_dst, p0, p1)
            src = self.seqs.get(seq_id_src)
            dst = self._entry_for(seq_id_dst)
            self._set_tokens(dst, src.tokens.copy() if src is not None else dst.tokens[:0])
            self._settle(dst)
            return
        a, b = _clamp(p0, p1)
        ranges = self._ranges(seq_id_src, seq_id_dst)
        (slo, shi), (dlo, dhi) = ranges[seq_id_src], ranges[seq_id_dst]
        self.ctx.memory_seq_cp(seq_id_src, seq_id_dst, p0, p1)
        if not (a < b and slo <= shi and a <= shi and slo < b):
            return  # no cell copied
        if dhi < 0:  # dst was empty: it now holds src's cells in [a, b)
            src = self.seqs.get(seq_id_src)
            dst = self._entry_for(seq_id_dst)
            n = min(src.tokens.size, b) if src is not None and a == 0 else 0
            self._set_tokens(dst, src.tokens[:n].copy() if n else dst.tokens[:0])
            self._settle(dst)
        else:
            self._cut(seq_id_dst, max(a, slo))

    def context_shift(self, seq_id: int, n_keep: int, n_discard: int) -> None:
        moved = self._movers(seq_id, n_keep + n_discard, _POS_MAX) if n_keep >= 0 and n_discard >= 1 else []
        self.ctx.context_shift(seq_id, n_keep, n_discard)
        for s in set(moved) | {seq_id}:
            self._cut(s, n_keep)

    def clear(self, data: bool = True) -> None:
        self.ctx.memory_clear(data)
        for s in list(self.seqs):
            self._cut(s, 0)

    def state_load(self, data: Any, seq_id: int = -1, tokens: Any = None) -> int:
        """Restore the whole cache (``seq_id`` -1) or one sequence from a blob.  ``tokens``: the tokens the
        restored sequence holds (a token list for one sequence; a dict seq_id -> tokens for the whole cache), to
        index it again; a sequence restored without them is cached but not indexed."""
        whole = seq_id == -1
        if not whole:
            self._check_seq(seq_id)
        try:
            return self.ctx.state_set_data(data) if whole else self.ctx.state_seq_set_data(data, seq_id)
        finally:
            targets = list(range(self.n_seq)) if whole else [seq_id]
            given = (tokens or {}) if whole else ({seq_id: tokens} if tokens is not None else {})
            for s in targets:
                e = self.seqs.get(s)
                if e is not None:
                    self._cut(s, 0)
                if self.ctx.memory_seq_pos_max(s) >= 0:
                    e = self.seqs.get(s) or self._adopt(s)
                    self._vouch(e, given.get(s))

    # ------------------------------------------------------------------ helpers

    def _ranges(self, *seq_ids: int) -> dict[int, tuple[int, int]]:
        """(seq_pos_min, seq_pos_max) of the given sequences (all indexed ones for -1), before an operation."""
        ids = list(self.seqs) if seq_ids == (-1,) else list(seq_ids)
        return {s: (self.ctx.memory_seq_pos_min(s), self.ctx.memory_seq_pos_max(s)) for s in ids}

    def _movers(self, seq_id: int, a: int, b: int) -> list[int]:
        """The sequences whose cells move when ``seq_id``'s cells in [a, b) move: it and, in a unified cache, every
        sequence sharing one of those cells (a cell has one position for all its sequences)."""
        self._check_seq(seq_id)
        lo, hi = self.ctx.memory_seq_pos_min(seq_id), self.ctx.memory_seq_pos_max(seq_id)
        if a >= b or hi < lo or hi < a or lo >= b:
            return []
        if not self.unified:
            return [seq_id]
        t = cells_table(self.ctx.kv)
        rows = t[(t["pos"] >= a) & (t["pos"] < b) & _has_seq(t, seq_id)]
        words = np.bitwise_or.reduce(rows["seq_bits"], axis=0) if rows.size else np.zeros(t["seq_bits"].shape[1], np.uint64)
        return [s for s in range(self.n_seq) if s == seq_id or _bit(words, s)]

    def _cut(self, s: int, p: int) -> None:
        """The entry of sequence ``s`` keeps its tokens below position ``p``."""
        e = self.seqs.get(s)
        if e is None:
            return
        if p < e.tokens.size:
            self._set_tokens(e, e.tokens[:p].copy())
        self._settle(e)

    def _settle(self, e: Any) -> None:
        """Recompute ``clean``; a parked entry whose sequence is gone goes."""
        pmax = self.ctx.memory_seq_pos_max(e.seq_id)
        e.clean = pmax + 1 == e.tokens.size
        if pmax < 0 and not e.active:
            self._drop_entry(e)

    def _truncate_seq(self, e: Any, n: int) -> None:
        """Cut the sequence of ``e`` (cells and entry) to its first n tokens."""
        if self.ctx.memory_seq_pos_max(e.seq_id) >= n:
            self.ctx.memory_seq_rm(e.seq_id, n, -1)
        if n < e.tokens.size:
            self._set_tokens(e, e.tokens[:n].copy())
        e.clean = self.ctx.memory_seq_pos_max(e.seq_id) + 1 == e.tokens.size

    def _vouch(self, e: Any, tokens: Sequence[int] | None) -> None:
        """Index the restored sequence of ``e`` as holding ``tokens`` when its positions are exactly 0..n-1."""
        if tokens is None:
            return
        toks = self._tokens(tokens)
        s = e.seq_id
        if toks.size and self.ctx.memory_seq_pos_min(s) == 0 and self.ctx.memory_seq_pos_max(s) == toks.size - 1:
            self._set_tokens(e, toks.copy())
        self._settle(e)

    def _entry_for(self, s: int) -> Any:
        return self.seqs.get(s) or self._adopt(s)

    def _stream_copy(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Cross-stream seq_cp, with the queued buffer copy made at once (a state saved before the next decode
        would otherwise hold the destination's old data)."""
        self.ctx.memory_seq_cp(src, dst, p0, p1)
        self.ctx.kv.init_update(None, False).apply()
