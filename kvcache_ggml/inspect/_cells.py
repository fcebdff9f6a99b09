"""Inspection: a cache's cells as data (:func:`cells_table`, :func:`format_cells`) and as the seed's text map
(:func:`cell_map`)."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .._consts import SEQ_WORDS
from ..cache.cells.kvcells import KVCells
from ..cache.cells.onecell import bitset_ids


#: one row of :func:`cells_table`
CELL_DTYPE = np.dtype([
    ("stream", np.int32),                     # stream of the cell
    ("cell", np.int32),                       # index of the cell in its stream
    ("pos", np.int32),                        # position, -1 when empty
    ("shift", np.int32),                      # pending K-shift
    ("n_seq", np.int32),                      # number of sequences holding the cell
    ("seq", np.int32),                        # lowest sequence id of the cell, -1 when none
    ("seq_mask", np.uint64),                  # bitmask of sequences 0..63 (bit q = sequence q)
    ("seq_bits", np.uint64, (SEQ_WORDS,)),    # the whole bitset, word w holding sequences 64w..64w+63
    ("ext_x", np.int32),                      # M-RoPE column
    ("ext_y", np.int32),                      # M-RoPE row
])

# ============================================================================================== cells as data

def _streams(kv: Any) -> tuple[list[KVCells], list[int] | None]:
    """(cells of each stream, head of each stream or None) of a KVCache or a bare KVCells."""
    if isinstance(kv, KVCells):
        return [kv], None
    cells = getattr(kv, "v_cells", None)
    if cells is None:
        from ..cache.iswa import KVCacheISWA

        also = " (an iSWA cache: pass its get_base() or get_swa())" if isinstance(kv, KVCacheISWA) else ""
        raise TypeError(f"expected a KVCache or KVCells, got {type(kv).__name__}{also}")
    return list(cells), list(kv.v_heads)


def cells_table(kv: Any) -> np.ndarray:
    """Structured array (:data:`CELL_DTYPE`) with one row per stream and cell, streams in order."""
    streams, _ = _streams(kv)
    parts = []
    for s, cells in enumerate(streams):
        n = cells.size()
        t = np.zeros(n, CELL_DTYPE)
        idx = np.arange(n, dtype=np.int64)
        t["stream"] = s
        t["cell"] = idx
        t["pos"] = cells.pos_array
        t["shift"] = cells.shift_array
        t["ext_x"] = cells.ext_array[:, 0]
        t["ext_y"] = cells.ext_array[:, 1]
        t["seq_bits"] = cells.seq_bits.T
        t["seq_mask"] = cells.seq_bits[0]
        if n:
            t["n_seq"] = cells.seq_count_many(idx)
            t["seq"] = np.where(t["n_seq"] > 0, cells.seq_get_many(idx), -1)
        else:
            t["seq"] = -1
        parts.append(t)
    return np.concatenate(parts) if parts else np.zeros(0, CELL_DTYPE)


def format_cells(table: np.ndarray, columns: Sequence[str] = ("stream", "cell", "pos", "shift", "seqs"),
                 used_only: bool = True) -> str:
    """A :func:`cells_table` as aligned text: the given fields, plus ``seqs`` (the sequence ids of each cell, from
    its bitset); only the non-empty cells unless ``used_only`` is False."""
    rows = table[table["pos"] >= 0] if used_only else table
    for c in columns:
        if c != "seqs" and c not in CELL_DTYPE.names:
            raise ValueError(f"unknown column {c!r}; columns: {', '.join(CELL_DTYPE.names)}, seqs")
    body = [[",".join(map(str, bitset_ids(r["seq_bits"]))) if c == "seqs" else str(r[c]) for c in columns]
            for r in rows]
    widths = [max([len(c)] + [len(b[j]) for b in body]) for j, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


def cell_map(kv: Any, positions: bool = False) -> str:
    """Text map of every stream, as the seed's debug dump: a header line, then one character per cell ('.' empty,
    the sequence id, 'M' for several; 256 cells a line) and, with ``positions``, each cell's position."""
    from ..cache import cell_map_text, cell_pos_text

    streams, heads = _streams(kv)
    out = []
    for s, cells in enumerate(streams):
        head = "" if heads is None else f", head = {heads[s]:5d}"
        out.append(f"stream[{s}]: n = {cells.used_max_p1():5d}, used = {cells.get_used():5d}{head}, "
                   f"size = {cells.size():5d}")
        out.append(cell_map_text(cells))
        if positions:
            out.append(cell_pos_text(cells))
        for q in cells.seq_ids():
            out.append(f"stream[{s}] min[{q}] = {cells.seq_pos_min(q):5d}, max[{q}] = {cells.seq_pos_max(q):5d}")
    return "\n".join(out)
