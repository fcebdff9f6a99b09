"""Inspection: a from-scratch consistency check of a cache's bookkeeping (:func:`check_invariants`)."""
from __future__ import annotations

from typing import Any

from .. import ggml as G
from ..cache.cells.kvcells import KVCells


def check_invariants(kv: Any) -> list[str]:
    """Every disagreement between the cells' arrays and the indices derived from them, recomputed from scratch;
    an empty list when the cache is consistent.

    A bare :class:`KVCells`: :meth:`KVCells.check_invariants`.  A cache: its bookkeeping's
    (:meth:`KVBookkeeping.check_invariants`: every stream's cells, heads, sequence-to-stream map), plus the K/V
    tensor shapes and the cache's has_shift flag.
    """
    if isinstance(kv, KVCells):
        return kv.check_invariants("stream 0")
    book = getattr(kv, "book", None)
    if book is None:
        raise TypeError(f"expected a KVCache or KVCells, got {type(kv).__name__}")
    errs = book.check_invariants()
    size = kv.get_size()
    for layer in kv.layers:
        for t in (layer.k, layer.v):
            ne = G.ne(t)
            if ne[1] != size or ne[2] != kv.n_stream:
                errs.append(f"tensor {G.name(t)} has ne {ne}: expected ne[1] = {size} cells and ne[2] = "
                            f"{kv.n_stream} streams")
    if kv.get_has_shift() != any(c.get_has_shift() for c in kv.v_cells):
        errs.append("get_has_shift() disagrees with the streams' flags")
    return errs
