"""The prefix cache's index of the context's sequences: :class:`SeqIndex` holds one :class:`SeqEntry` per sequence
it knows, each registered in a :class:`~kvcache_ggml.prefix.tree.RadixTree` with its tokens, and runs every memory
operation that changes cells -- calling the context's own operation, then cutting each affected entry back to the
prefix the operation cannot have touched.

:class:`~kvcache_ggml.prefix.core.PrefixCache` owns one and works through its public methods (the requests, reuse,
eviction); :func:`~kvcache_ggml.prefix.audit.check` reads its entries and tree.

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

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ..cache import KVCacheISWA
from ..inspect import cells_table
from .policy import Retention
from .tree import RadixTree, as_tokens

__all__ = ["SeqEntry", "SeqIndex", "memory_cells"]

_POS_MAX = 2**31 - 1


@dataclass(slots=True, eq=False)
class SeqEntry:
    """A sequence of the cache that the prefix cache indexes."""

    seq_id: int                      # the cache's sequence id
    stream: int                      # the stream holding it
    tokens: np.ndarray               # int32 [n]: token p sits at position p, in the cell a fresh decode would fill
    clean: bool = True               # no cell of the sequence lies beyond ``tokens`` (decoding more extends them)
    active: bool = True              # a request owns it (never evicted); False once released
    last_used: int = 0               # tick of its last use
    retention: Retention = field(default_factory=Retention)  # how strongly it is kept once released
    since: float = 0.0               # clock time the retention started

    def __repr__(self) -> str:
        state = "active" if self.active else "parked"
        return f"<seq {self.seq_id} (stream {self.stream}) {self.tokens.size} tokens, {state}" \
               f"{'' if self.clean else ', tail'}>"


def _clamp(p0: int, p1: int) -> tuple[int, int]:
    return max(p0, 0), (_POS_MAX if p1 < 0 else p1)


def memory_cells(kv: Any) -> np.ndarray:
    """The :func:`cells_table` of the cache of ``kv`` that holds every position: an iSWA memory's base cache (its
    SWA cache holds each sequence's window only, shared by the same sequences), else ``kv`` itself."""
    return cells_table(kv.get_base() if isinstance(kv, KVCacheISWA) else kv)


def _has_seq(t: np.ndarray, s: int) -> np.ndarray:
    """bool [rows]: the cells of a :func:`cells_table` holding sequence s."""
    return (t["seq_bits"][:, s // 64] >> np.uint64(s % 64)) & np.uint64(1) != 0


def _bit(words: np.ndarray, s: int) -> bool:
    return bool((int(words[s // 64]) >> (s % 64)) & 1)


class SeqIndex:
    """The entries of a context's sequences 0..n_seq-1, in a radix tree, kept in step with the cells.

    ``seq_rm``, ``seq_cp``, ``seq_keep``, ``seq_add``, ``seq_div``, ``context_shift``, ``clear`` and ``state_load``
    take the same arguments and raise the same errors as the context's ``memory_*``."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx                                 # the runtime Context whose cells are indexed
        self.n_seq = int(ctx.cparams.n_seq_max)        # sequence ids 0..n_seq-1
        self.unified = ctx.kv.get_n_stream() == 1      # one stream for every sequence
        self.tree = RadixTree()                        # the entries with tokens, by their tokens
        self.seqs: dict[int, SeqEntry] = {}            # sequence id -> its entry
        self.tick = 0                                  # use counter: entries' and blobs' last_used

    # ------------------------------------------------------------------ sequences and tokens

    def stream_of(self, seq_id: int) -> int:
        """The stream holding sequence ``seq_id`` (0 in a unified cache)."""
        return 0 if self.unified else seq_id

    def check_seq(self, seq_id: int) -> None:
        """ValueError unless ``seq_id`` is one of the indexed sequence ids."""
        if not 0 <= seq_id < self.n_seq:
            raise ValueError(f"seq_id {seq_id} out of range [0, {self.n_seq})")

    def check_tokens(self, tokens: Any) -> np.ndarray:
        """int32 [n] token ids, each below the model's vocabulary size (ValueError otherwise)."""
        toks = as_tokens(tokens)
        if toks.size and (int(toks[0]) if toks.size == 1 else int(toks.max())) >= self.ctx.n_vocab:
            raise ValueError(f"token id {int(toks.max())} out of range [0, n_vocab={self.ctx.n_vocab})")
        return toks

    # ------------------------------------------------------------------ entries

    def adopt(self, s: int) -> SeqEntry:
        """A parked entry for sequence ``s``, found in the cache without one (content unknown: nothing indexed)."""
        e = SeqEntry(s, self.stream_of(s), np.zeros(0, np.int32), clean=False, active=False, last_used=self.tick)
        self.seqs[s] = e
        return e

    def set_tokens(self, e: SeqEntry, tokens: np.ndarray) -> None:
        """``e`` now holds ``tokens`` (registered in the tree again)."""
        if e in self.tree:
            self.tree.remove(e, e.tokens)
        e.tokens = tokens
        if tokens.size:
            self.tree.insert(e, tokens)

    def append(self, e: SeqEntry, more: np.ndarray) -> None:
        """``e`` now also holds ``more`` after its tokens."""
        old = e.tokens
        e.tokens = np.concatenate([old, more])
        if old.size:
            self.tree.extend(e, old, more)
        else:
            self.tree.insert(e, e.tokens)

    def drop(self, e: SeqEntry) -> None:
        """Forget ``e`` (its cells are the caller's business)."""
        if e in self.tree:
            self.tree.remove(e, e.tokens)
        del self.seqs[e.seq_id]

    def cut(self, s: int, p: int) -> None:
        """The entry of sequence ``s`` (if any) keeps its tokens below position ``p``; ``clean`` recomputed, and a
        parked entry whose sequence has no cell left goes."""
        e = self.seqs.get(s)
        if e is None:
            return
        if p < e.tokens.size:
            self.set_tokens(e, e.tokens[:p].copy())
        self._settle(e)

    def truncate(self, e: SeqEntry, n: int) -> None:
        """Cut the sequence of ``e`` (cells and entry) to its first n tokens."""
        if self.ctx.memory_seq_pos_max(e.seq_id) >= n:
            self.ctx.memory_seq_rm(e.seq_id, n, -1)
        if n < e.tokens.size:
            self.set_tokens(e, e.tokens[:n].copy())
        e.clean = self.ctx.memory_seq_pos_max(e.seq_id) + 1 == e.tokens.size

    def stream_copy(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Cross-stream seq_cp of the cells only (the entries are the caller's), with the queued buffer copy made
        at once (a state saved before the next decode would otherwise hold the destination's old data)."""
        self.ctx.memory_seq_cp(src, dst, p0, p1)
        self.ctx.kv.init_update(None, False).apply()

    # ------------------------------------------------------------------ memory operations

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        a, b = _clamp(p0, p1)
        ranges = self._ranges(seq_id)
        ok = self.ctx.memory_seq_rm(seq_id, p0, p1)
        for s, (lo, hi) in ranges.items():
            if a < b and lo <= hi and a <= hi and lo < b:
                self.cut(s, a)
        return ok

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        a, b = _clamp(p0, p1)
        moved = self._movers(seq_id, a, b)
        self.ctx.memory_seq_add(seq_id, p0, p1, delta)
        if delta != 0:
            for s in moved:
                self.cut(s, max(0, a + min(delta, 0)))

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        a, b = _clamp(p0, p1)
        moved = self._movers(seq_id, a, b)
        self.ctx.memory_seq_div(seq_id, p0, p1, d)
        if d != 1:
            for s in moved:
                self.cut(s, a // d)

    def seq_keep(self, seq_id: int) -> None:
        self.ctx.memory_seq_keep(seq_id)
        stream = self.stream_of(seq_id)
        for s in [s for s, e in self.seqs.items() if e.stream == stream and s != seq_id]:
            self.cut(s, 0)

    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int = -1, p1: int = -1) -> None:
        if seq_id_src == seq_id_dst:
            self.ctx.memory_seq_cp(seq_id_src, seq_id_dst, p0, p1)
            return
        if self.stream_of(seq_id_src) != self.stream_of(seq_id_dst):
            self.stream_copy(seq_id_src, seq_id_dst, p0, p1)
            src = self.seqs.get(seq_id_src)
            dst = self._entry_for(seq_id_dst)
            self.set_tokens(dst, src.tokens.copy() if src is not None else dst.tokens[:0])
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
            self.set_tokens(dst, src.tokens[:n].copy() if n else dst.tokens[:0])
            self._settle(dst)
        else:
            self.cut(seq_id_dst, max(a, slo))

    def context_shift(self, seq_id: int, n_keep: int, n_discard: int) -> None:
        moved = self._movers(seq_id, n_keep + n_discard, _POS_MAX) if n_keep >= 0 and n_discard >= 1 else []
        self.ctx.context_shift(seq_id, n_keep, n_discard)
        for s in set(moved) | {seq_id}:
            self.cut(s, n_keep)

    def clear(self, data: bool = True) -> None:
        self.ctx.memory_clear(data)
        for s in list(self.seqs):
            self.cut(s, 0)

    def state_load(self, data: Any, seq_id: int = -1, tokens: Any = None) -> int:
        """Restore the whole cache (``seq_id`` -1) or one sequence from a blob.  ``tokens``: the tokens the
        restored sequence holds (a token list for one sequence; a dict seq_id -> tokens for the whole cache), to
        index it again; a sequence restored without them is cached but not indexed."""
        whole = seq_id == -1
        if not whole:
            self.check_seq(seq_id)
        try:
            return self.ctx.state_set_data(data) if whole else self.ctx.state_seq_set_data(data, seq_id)
        finally:
            targets = list(range(self.n_seq)) if whole else [seq_id]
            given = (tokens or {}) if whole else ({seq_id: tokens} if tokens is not None else {})
            for s in targets:
                if s in self.seqs:
                    self.cut(s, 0)
                if self.ctx.memory_seq_pos_max(s) >= 0:
                    self._vouch(self._entry_for(s), given.get(s))

    # ------------------------------------------------------------------ helpers

    def _ranges(self, *seq_ids: int) -> dict[int, tuple[int, int]]:
        """(seq_pos_min, seq_pos_max) of the given sequences (all indexed ones for -1), before an operation."""
        ids = list(self.seqs) if seq_ids == (-1,) else list(seq_ids)
        return {s: (self.ctx.memory_seq_pos_min(s), self.ctx.memory_seq_pos_max(s)) for s in ids}

    def _movers(self, seq_id: int, a: int, b: int) -> list[int]:
        """The sequences whose cells move when ``seq_id``'s cells in [a, b) move: it and, in a unified cache, every
        sequence sharing one of those cells (a cell has one position for all its sequences)."""
        self.check_seq(seq_id)
        lo, hi = self.ctx.memory_seq_pos_min(seq_id), self.ctx.memory_seq_pos_max(seq_id)
        if a >= b or hi < lo or hi < a or lo >= b:
            return []
        if not self.unified:
            return [seq_id]
        t = memory_cells(self.ctx.kv)
        rows = t[(t["pos"] >= a) & (t["pos"] < b) & _has_seq(t, seq_id)]
        words = (np.bitwise_or.reduce(rows["seq_bits"], axis=0) if rows.size
                 else np.zeros(t["seq_bits"].shape[1], np.uint64))
        return [s for s in range(self.n_seq) if s == seq_id or _bit(words, s)]

    def _settle(self, e: SeqEntry) -> None:
        """Recompute ``clean``; a parked entry whose sequence is gone goes."""
        pmax = self.ctx.memory_seq_pos_max(e.seq_id)
        e.clean = pmax + 1 == e.tokens.size
        if pmax < 0 and not e.active:
            self.drop(e)

    def _vouch(self, e: SeqEntry, tokens: Sequence[int] | None) -> None:
        """Index the restored sequence of ``e`` as holding ``tokens`` when its positions are exactly 0..n-1."""
        if tokens is None:
            return
        toks = self.check_tokens(tokens)
        s = e.seq_id
        if toks.size and self.ctx.memory_seq_pos_min(s) == 0 and self.ctx.memory_seq_pos_max(s) == toks.size - 1:
            self.set_tokens(e, toks.copy())
        self._settle(e)

    def _entry_for(self, s: int) -> SeqEntry:
        return self.seqs.get(s) or self.adopt(s)
