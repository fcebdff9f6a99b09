"""Inspection: a from-scratch consistency check of a cache's bookkeeping (:func:`check_invariants`)."""
from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from .. import _ggml as G
from .._consts import SEQ_WORDS
from ..cells import KVCells
from ._cells import _seq_list, _streams


# ============================================================================================== invariants

def check_invariants(kv: Any) -> list[str]:
    """Every disagreement between the cells' arrays and the indices derived from them, recomputed from scratch;
    an empty list when the cache is consistent.

    Checked per stream: array shapes; empty cells (position -1) hold no sequence and no shift; used cells hold a
    position >= 0 and at least one sequence, and only sequences mapped to their stream; the used count and the
    used bounds (the raw, possibly stale enclosure and the values ``used_min``/``used_max_p1`` return -- which
    resolves a stale bound, as any caller would); each sequence's position multiset, min and max; the has_shift
    flag; the head within ``[0, size]``.  Per cache: one head per stream, equal sizes, the K/V tensor shapes.
    """
    streams, heads = _streams(kv)
    errors: list[str] = []
    if heads is not None and len(heads) != len(streams):
        errors.append(f"{len(heads)} heads for {len(streams)} streams")
    seq_to_stream = getattr(kv, "_seq_to_stream_list", None)
    for s, cells in enumerate(streams):
        where = f"stream {s}"
        errs = _check_arrays(cells, where)
        if not errs:  # the other checks index the arrays
            errs = (_check_cells(cells, where, s, seq_to_stream) + _check_used(cells, where)
                    + _check_seq_pos(cells, where) + _check_shift(cells, where))
        if heads is not None and s < len(heads) and not 0 <= heads[s] <= cells.size():
            errs.append(f"{where}: head {heads[s]} out of [0, {cells.size()}]")
        errors += errs
    if heads is not None:
        errors += _check_cache(kv, streams)
    return errors


def _check_arrays(cells: KVCells, where: str) -> list[str]:
    n = cells._pos.shape[0]
    want = {"_pos": (n,), "_shift": (n,), "_ext": (n, 2), "_seq": (SEQ_WORDS, n)}
    return [f"{where}: {name} has shape {getattr(cells, name).shape}, expected {shape}"
            for name, shape in want.items() if getattr(cells, name).shape != shape]


def _check_cells(cells: KVCells, where: str, strm: int, seq_to_stream: list[int] | None) -> list[str]:
    pos, shift, bits = cells._pos, cells._shift, cells._seq
    errs = []
    empty = pos == -1
    has_seq = bits.any(axis=0)
    for i in np.flatnonzero(pos < -1).tolist():
        errs.append(f"{where}: cell {i} has position {pos[i]} (< -1)")
    for i in np.flatnonzero(empty & has_seq).tolist():
        errs.append(f"{where}: empty cell {i} holds sequences {_seq_list(bits[:, i])}")
    for i in np.flatnonzero(empty & (shift != 0)).tolist():
        errs.append(f"{where}: empty cell {i} has shift {shift[i]} (expected 0)")
    for i in np.flatnonzero((pos >= 0) & ~has_seq).tolist():
        errs.append(f"{where}: cell {i} holds position {pos[i]} but no sequence")
    if seq_to_stream is not None:
        present = np.bitwise_or.reduce(bits, axis=1) if bits.shape[1] else np.zeros(SEQ_WORDS, np.uint64)
        for q in _seq_list(present):
            if q >= len(seq_to_stream):
                errs.append(f"{where}: sequence {q} is held but the cache maps only {len(seq_to_stream)} sequences")
            elif seq_to_stream[q] != strm:
                errs.append(f"{where}: sequence {q} is held here but maps to stream {seq_to_stream[q]}")
    return errs


def _check_used(cells: KVCells, where: str) -> list[str]:
    used = np.flatnonzero(cells._pos >= 0)
    lo, hi = (int(used[0]), int(used[-1]) + 1) if used.size else (0, 0)
    errs = []
    if cells._n_used != used.size:
        errs.append(f"{where}: used count {cells._n_used} != {used.size} non-empty cells")
    if used.size:
        # a stale (dirty) bound only has to enclose the used cells; a clean one must be exact
        if cells._used_lo > lo or (not cells._lo_dirty and cells._used_lo != lo):
            errs.append(f"{where}: stored used_min {cells._used_lo} (stale: {cells._lo_dirty}), first used "
                        f"cell {lo}")
        if cells._used_hi < hi or (not cells._hi_dirty and cells._used_hi != hi):
            errs.append(f"{where}: stored used_max_p1 {cells._used_hi} (stale: {cells._hi_dirty}), last used "
                        f"cell + 1 = {hi}")
    if cells.used_min() != lo:
        errs.append(f"{where}: used_min() = {cells.used_min()}, first used cell is {lo}")
    if cells.used_max_p1() != hi:
        errs.append(f"{where}: used_max_p1() = {cells.used_max_p1()}, last used cell + 1 is {hi}")
    return errs


def _check_seq_pos(cells: KVCells, where: str) -> list[str]:
    pos, bits = cells._pos, cells._seq
    used = np.flatnonzero(pos >= 0)
    want: dict[int, Counter] = {}
    for q in cells.seqs_in(used):
        held = used[cells.seq_mask_at(q, used)]
        want[q] = Counter(pos[held].tolist())
    errs = []
    for q in sorted(set(want) | set(cells._seq_pos)):
        ms = cells._seq_pos.get(q)
        w = want.get(q, Counter())
        if ms is None:
            errs.append(f"{where}: sequence {q} holds {sum(w.values())} cells but has no position multiset")
            continue
        if len(ms.keys) != len(ms.counts) or ms.keys != sorted(set(ms.keys)) or any(c <= 0 for c in ms.counts):
            errs.append(f"{where}: sequence {q} multiset is malformed (keys {ms.keys[:8]}..., counts "
                        f"{ms.counts[:8]}...)")
        have = Counter(dict(zip(ms.keys, ms.counts)))
        if have != w:
            diff = sorted(set(have) ^ set(w) | {p for p in have if have[p] != w.get(p)})[:8]
            errs.append(f"{where}: sequence {q} multiset {{pos: count}} disagrees with its cells at positions "
                        f"{diff} (multiset {[have.get(p, 0) for p in diff]}, cells {[w.get(p, 0) for p in diff]})")
        pmin, pmax = (min(w), max(w)) if w else (-1, -1)
        if (cells.seq_pos_min(q), cells.seq_pos_max(q)) != (pmin, pmax):
            errs.append(f"{where}: sequence {q} seq_pos_min/max = {cells.seq_pos_min(q)}/{cells.seq_pos_max(q)}, "
                        f"its cells give {pmin}/{pmax}")
    return errs


def _check_shift(cells: KVCells, where: str) -> list[str]:
    shifted = np.flatnonzero(cells._shift != 0)
    if shifted.size and not cells._has_shift:
        return [f"{where}: {shifted.size} cells have a pending shift (first: cell {int(shifted[0])}) but "
                f"has_shift is False"]
    return []


def _check_cache(kv: Any, streams: list[KVCells]) -> list[str]:
    errs = []
    sizes = {c.size() for c in streams}
    if len(sizes) > 1:
        errs.append(f"streams have different sizes {sorted(sizes)}")
    if len(streams) != kv.n_stream:
        errs.append(f"{len(streams)} streams, n_stream = {kv.n_stream}")
    size = streams[0].size() if streams else 0
    for layer in getattr(kv, "layers", []):
        for t in (layer.k, layer.v):
            ne = G.ne(t)
            if ne[1] != size or ne[2] != kv.n_stream:
                errs.append(f"tensor {G.name(t)} has ne {ne}: expected ne[1] = {size} cells and ne[2] = "
                            f"{kv.n_stream} streams")
    if kv.get_has_shift() != any(c._has_shift for c in streams):
        errs.append("get_has_shift() disagrees with the streams' flags")
    return errs
