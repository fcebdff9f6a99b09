"""The decode step over cells a sliding window left behind: scalar fast paths of find_slot, prepare and apply.

Once a sliding-window cache has wrapped, every decode step lands on occupied cells: the cell to fill holds an old
position that the window masks.  llama.cpp's ``find_slot`` accepts such a cell (one sequence, masked by the window
at that sequence's ``seq_pos_max + 1``), ``prepare`` places the ubatch and rolls the slot's cells back, and
``apply_ubatch`` removes the old cell's sequence, places the token and purges positions the removal would leave
below the sequence's range.  For a slot of a few cells these functions do the same with scalar Python:

* :func:`slot_run` -- the slot search when the cells from the head are all usable (then they are the slot);
* :func:`rolls_back_clean` -- whether prepare's placement and roll-back change nothing (no purge, no pending shift
  lost), so that prepare need place nothing;
* :func:`place_over` -- apply_ubatch of one sequence per token over cells each held by one sequence of the stream.

Each answers "not for me" (None or False, nothing changed) for anything unusual, and the caller takes the general
path.  ``WrapStats`` counts how often they served (tests/test_decode_fast_path.py checks that they do).  They work on
the bookkeeping through :class:`WrapBook`, the part of it they read and call
(:class:`~kvcache_ggml.cache.bookkeeping.KVBookkeeping`, which calls them, implements it).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ..hparams import SwaType, swa_masked
from .cells.kvcells import KVCells

if TYPE_CHECKING:
    from ..batch import UBatch
    from .types import SlotInfo

__all__ = ["WrapBook", "WrapStats", "place_over", "rolls_back_clean", "slot_run"]

log = logging.getLogger("kvcache_ggml.cache")

_FEW = 16  # slots of at most this many cells per stream take the scalar paths
_CHUNKED = int(SwaType.CHUNKED)


@dataclass(slots=True)
class WrapStats:
    """How often the scalar paths served (the equivalence tests check that they are taken)."""

    found: int = 0   # slots found by slot_run with some cell occupied
    kept: int = 0    # prepares over occupied cells that placed nothing (rolls_back_clean)
    placed: int = 0  # apply_ubatch over occupied cells by place_over


class WrapBook(Protocol):
    """What the scalar paths read and call of the bookkeeping (:class:`~.bookkeeping.KVBookkeeping`)."""

    kv_size: int              # cells per stream
    swa_type: SwaType         # the sliding-window rule
    n_swa: int                # the sliding-window size
    n_seq_ids: int            # sequence ids: [0, n_seq_ids)
    stream_of: list[int]      # sequence -> stream
    v_cells: list[KVCells]    # the cells, per stream
    v_heads: list[int]        # the next search start, per stream
    wrap_stats: WrapStats     # how often the scalar paths served

    def place_free(self, sinfo: SlotInfo, ubatch: UBatch) -> bool: ...

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool: ...


def slot_run(book: WrapBook, cells: KVCells, head: int, n: int) -> int | None:
    """find_slot's search in one stream (not contiguous) when its ``n`` cells from the head are all usable --
    empty, or held by one sequence at a position the window masks at that sequence's largest position + 1: their
    first cell (the slot is the run).  None when some cell of the run is not usable (then the search goes on
    beyond it: the general path's).  ``head`` is the search start after the seed's reset to 0."""
    size = book.kv_size
    if head >= size:
        head = 0  # (the seed: a search from the end wraps to the start having tested nothing)
    if head + n > size or n > _FEW:
        return None
    pos = cells.pos_array
    swa_type, n_swa = book.swa_type, book.n_swa
    if n == 1:  # (the decode step of one sequence: no loop)
        p = pos.item(head)
        if p < 0:
            return head
        if not swa_type or (swa_type == _CHUNKED and n_swa <= 0):
            return None
        q = cells.only_seq(head)
        if q < 0 or not swa_masked(swa_type, n_swa, p, cells.seq_pos_max(q) + 1):
            return None
        book.wrap_stats.found += 1
        return head
    occupied = False
    for i in range(head, head + n):
        p = pos.item(i)
        if p < 0:
            continue
        if not swa_type or (swa_type == _CHUNKED and n_swa <= 0):
            return None
        q = cells.only_seq(i)
        if q < 0 or not swa_masked(swa_type, n_swa, p, cells.seq_pos_max(q) + 1):
            return None
        occupied = True
    if occupied:
        book.wrap_stats.found += 1
    return head


def _occupied(book: WrapBook, sinfo: SlotInfo) -> list[tuple[KVCells, int, int, int]] | None:
    """(cells, cell, its only sequence, its position) of each occupied cell of the slot, or None when the slot is
    too large or some occupied cell holds several sequences or one of another stream."""
    out = []
    stream_of, n_ids = book.stream_of, book.n_seq_ids
    for st, idx in zip(sinfo.strm, sinfo.idxs):
        if len(idx) > _FEW:
            return None
        cells = book.v_cells[st]
        pos = cells.pos_array
        for i in (idx.tolist() if len(idx) > 1 else (idx.item(0),)):
            p = pos.item(i)
            if p >= 0:
                q = cells.only_seq(i)
                if q < 0 or q >= n_ids or stream_of[q] != st:
                    return None
                out.append((cells, i, q, p))
    return out


def _new_min(cells: KVCells, q: int, removed: list[int]) -> int:
    """seq_pos_min of ``q`` once the cells at positions ``removed`` leave it (-1 when none is left)."""
    keys, counts = cells.seq_pos_keys(q)
    k = 0
    while k < len(keys):
        left = counts[k] - removed.count(keys[k])
        if left > 0:
            return keys[k]
        k += 1
    return -1


def rolls_back_clean(book: WrapBook, sinfo: SlotInfo, ubatch: UBatch) -> bool:
    """True when prepare's apply_ubatch of ``ubatch`` at ``sinfo`` and the roll-back of the slot's cells leave every
    cell as it was: the slot's cells are empty, or -- one sequence per token -- each occupied one holds one
    sequence of its stream with no pending shift (the roll-back does not restore a shift) and apply's purge would
    remove nothing (every sequence that loses a cell keeps no position at or below the largest it lost)."""
    strm, idxs = sinfo.strm, sinfo.idxs
    if len(idxs[0]) == 1 and ubatch.seq_id.shape[1] == 1:  # one cell per stream (one token per stream)
        if len(strm) == 1:
            got = _one_clean(book, strm[0], idxs[0].item(0), ubatch.seq_id.item(0), ubatch.pos.item(0))
        else:
            got = 0
            for st, idx, q, p in zip(strm, idxs, ubatch.seq_id.reshape(-1).tolist(), ubatch.pos.tolist()):
                one = _one_clean(book, st, idx.item(0), q, p)
                if one < 0:
                    return False
                got |= one
        if got > 0:
            book.wrap_stats.kept += 1
        return got >= 0
    occ = _occupied(book, sinfo)
    if occ is None:
        return False
    if not occ:
        return True
    if ubatch.seq_id.shape[1] != 1:
        return False
    removed: dict[int, list[int]] = {}
    for cells, i, q, p in occ:
        if cells.shift_array.item(i):
            return False
        removed.setdefault(q, []).append(p)
    # a token of q placed at or below the largest position q loses would be q's new minimum: a purge
    lowest: dict[int, int] = {}
    for q, p in zip(ubatch.seq_id[:, 0].tolist(), ubatch.pos[:ubatch.n_tokens].tolist()):
        if q in removed and p < lowest.get(q, p + 1):
            lowest[q] = p
    for q, ps in removed.items():
        pmax = max(ps)
        if lowest.get(q, pmax + 1) <= pmax:
            return False
        pmin = _new_min(book.v_cells[book.stream_of[q]], q, ps)
        if 0 <= pmin <= pmax:
            return False
    book.wrap_stats.kept += 1
    return True


def _one_clean(book: WrapBook, st: int, i: int, tok_seq: int, tok_pos: int) -> int:
    """rolls_back_clean of the one cell ``i`` that stream ``st`` gives the token (``tok_seq``, ``tok_pos``), with
    scalar Python: 0 when the cell is empty, 1 when occupied but clean, -1 when not clean.  (The token is the only
    one of its stream that can be of the cell's sequence: one stream, or one sequence per stream.)"""
    cells = book.v_cells[st]
    p = cells.pos_array.item(i)
    if p < 0:
        return 0
    q = cells.only_seq(i)
    if q < 0 or q >= book.n_seq_ids or book.stream_of[q] != st or cells.shift_array.item(i):
        return -1
    keys, counts = cells.seq_pos_keys(q)  # (p is one of them: keys[0] <= p)
    # purged: a position of q at or below p besides the cell's, or q's new token at or below p
    if keys[0] < p or counts[0] > 1 or (tok_seq == q and tok_pos <= p):
        return -1
    return 1


def place_over(book: WrapBook, sinfo: SlotInfo, ubatch: UBatch) -> bool:
    """apply_ubatch (one sequence per token, 1-D positions) when some cell of the slot is occupied: each occupied
    cell -- one sequence of its stream -- is emptied, the tokens placed (``place_free``), then every sequence
    that lost a cell is purged up to the largest position it lost, and the heads set, as the seed does.  False,
    with nothing done, for a slot it does not serve."""
    if ubatch.seq_id.shape[1] != 1:
        return False
    if len(sinfo.idxs[0]) == 1:  # one cell per stream (one token per stream)
        if len(sinfo.strm) == 1:
            return _place_one_over(book, sinfo.strm[0], sinfo.idxs[0].item(0), ubatch)
        return _place_each_over(book, sinfo, ubatch)
    occ = _occupied(book, sinfo)
    if not occ:  # (an empty slot is place_free's, which declined it)
        return False
    rm_max: dict[int, int] = {}
    for cells, i, q, p in occ:
        cells.rm_only(i, q)
        if p > rm_max.get(q, -1):
            rm_max[q] = p
    placed = book.place_free(sinfo, ubatch)
    assert placed, "the slot's cells were emptied"
    purged = False
    for q in sorted(rm_max) if len(rm_max) > 1 else rm_max:
        pmax = rm_max[q]
        pmin = book.v_cells[book.stream_of[q]].seq_pos_min(q)
        if pmin <= pmax:
            log.debug("purging positions [%d, %d] of sequence %d from KV cache", pmin, pmax, q)
            book.seq_rm(q, pmin, pmax + 1)
            purged = True
    if purged:  # the heads move after the purge, as in the seed
        for st, idx in zip(sinfo.strm, sinfo.idxs):
            book.v_heads[st] = idx.item(-1) + 1
    book.wrap_stats.placed += 1
    return True


def _place_one_over(book: WrapBook, st: int, i: int, ubatch: UBatch) -> bool:
    """place_over of a one-cell slot (cell ``i`` of stream ``st``, occupied) with scalar Python."""
    cells = book.v_cells[st]
    p = cells.pos_array.item(i)
    q = cells.only_seq(i) if p >= 0 else -1
    if q < 0 or q >= book.n_seq_ids or book.stream_of[q] != st:
        return False
    cells.rm_only(i, q)
    cells.place_one(i, ubatch.pos.item(0), ubatch.seq_id.item(0))
    pmin = cells.seq_pos_min(q)
    if pmin <= p:
        log.debug("purging positions [%d, %d] of sequence %d from KV cache", pmin, p, q)
        book.seq_rm(q, pmin, p + 1)
    book.v_heads[st] = i + 1
    book.wrap_stats.placed += 1
    return True


def _place_each_over(book: WrapBook, sinfo: SlotInfo, ubatch: UBatch) -> bool:
    """place_over of one cell per stream (the decode step of several streams), some occupied: stream by stream
    (a sequence and its purge stay in its stream), after every cell was checked."""
    v_cells, stream_of, n_ids = book.v_cells, book.stream_of, book.n_seq_ids
    olds = []
    for st, idx in zip(sinfo.strm, sinfo.idxs):
        cells = v_cells[st]
        i = idx.item(0)
        p = cells.pos_array.item(i)
        q = -1
        if p >= 0:
            q = cells.only_seq(i)
            if q < 0 or q >= n_ids or stream_of[q] != st:
                return False
        olds.append((cells, i, q, p))
    v_heads = book.v_heads
    for st, (cells, i, q, p), s, p_new in zip(sinfo.strm, olds, ubatch.seq_id.reshape(-1).tolist(),
                                                ubatch.pos.tolist()):
        if q >= 0:
            cells.rm_only(i, q)
        cells.place_one(i, p_new, s)
        if q >= 0:
            pmin = cells.seq_pos_min(q)
            if pmin <= p:
                log.debug("purging positions [%d, %d] of sequence %d from KV cache", pmin, p, q)
                book.seq_rm(q, pmin, p + 1)
        v_heads[st] = i + 1
    book.wrap_stats.placed += 1
    return True
