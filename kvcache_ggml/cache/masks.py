"""The kq mask, computed with numpy from a stream's cells (no ggml): the kernels of ``set_input_kq_mask``.

Row ``i`` of the mask (``[n_kv, n_tps, 1, n_stream]``, rows in token order) is token ``i``; the
token sees cell ``j`` of the stream of its first sequence when the cell holds that sequence and its position
``p0`` passes the causal test and the sliding window.  (A cell holding the sequence at position -1 -- a token
placed at -1, which llama.cpp accepts -- is empty to llama.cpp and hidden: the kernels add ``pos < 0`` to the
test when the sequence's smallest position is negative.)  Both tests bound ``p0`` to an interval per token,
``lo <= p0 <= hi`` (causal: ``hi = p1``; STANDARD: ``lo = p1 - n_swa + 1``; CHUNKED: ``lo`` the start of the
chunk of ``p1``; SYMMETRIC: ``|p1 - p0| <= n_swa / 2``), which is what ``is_masked_swa`` decides cell by cell.
With M-RoPE a causal token also hides the cells of its own position that come after it in 2-D order.  Tokens
are grouped by first sequence id (a few groups at most); each group builds a bool ``masked [rows, n_kv]`` with
broadcast compares, in row chunks that stay in cache, and writes it with one integer multiply: -inf is the bit
pattern 0xFF800000 (F32) or 0xFC00 (F16), and 0 is all zero bits.  A group of several tokens first writes the
row its tokens share to all its rows (a broadcast copy, as fast as a fill) and then builds only the span of
columns where they differ -- for a prefill, the cells of the ubatch itself -- unless that span is most of the row.
"""
from __future__ import annotations

import numpy as np

from .._consts import INT32_MAX
from ..batch import UBatch
from ..hparams import SwaType, swa_bounds
from .cells.kvcells import KVCells

__all__ = ["NEG_INF_BITS", "mask_decode_row", "mask_group", "window", "token_groups"]

# -inf as the integer that has its bit pattern, per float dtype: masked (True) * this = -inf, visible * this = +0.0
NEG_INF_BITS = {np.dtype(np.float32): (np.int32, np.int32(-0x00800000)),   # 0xFF800000
                np.dtype(np.float16): (np.int16, np.int16(-0x0400))}       # 0xFC00
_ROW_CHUNK = 1 << 16  # mask elements per chunk of rows: the temporaries stay in the CPU cache
_BAND_MAX = 0.25      # build only the differing columns of a group's rows when they span at most this of n_kv


def mask_decode_row(row: np.ndarray, cells: KVCells, seq_id: int, p1: int, causal: bool) -> None:
    """The decode step's row [n_kv]: one token, no window, no ALiBi, no 2-D positions -- a few whole-row ops."""
    n_kv = row.shape[0]
    hidden = cells.seq_absent(seq_id, n_kv)              # [n_kv] bool; empty cells too
    if cells.seq_pos_min(seq_id) < 0:                    # cells at position -1 are empty to llama.cpp
        hidden |= cells.pos_array[:n_kv] < 0
    if causal:
        hidden |= cells.pos_array[:n_kv] > p1
    # -inf where hidden, +0.0 elsewhere: one integer multiply by the bit pattern of -inf
    itype, neg_inf = NEG_INF_BITS[row.dtype]
    np.multiply(hidden, neg_inf, out=row.view(itype))


def mask_group(rows: np.ndarray, tok: slice | np.ndarray, cells: KVCells, seq_id: int, ubatch: UBatch,
               causal: bool, n_swa: int, swa_type: SwaType, alibi: bool) -> None:
    """Write the mask rows ``tok`` of ``rows`` [n_tokens, n_kv]: the tokens whose first sequence is ``seq_id``."""
    n_tokens, n_kv = rows.shape
    pos = cells.pos_array[:n_kv]                                   # [n_kv]
    other = cells.seq_absent(seq_id, n_kv)                         # [n_kv] cell lacks the sequence (or empty)
    if cells.seq_pos_min(seq_id) < 0:                              # cells at position -1 are empty to llama.cpp
        other |= pos < 0
    p1 = ubatch.pos[:n_tokens][tok]                                # [T]
    lo, hi = window(p1, causal, n_swa, swa_type)
    xy1 = ext = None
    if causal and ubatch.is_pos_2d():
        xy1 = (ubatch.pos[2 * n_tokens:3 * n_tokens][tok], ubatch.pos[n_tokens:2 * n_tokens][tok])
        ext = cells.ext_array[:n_kv]
    cols = slice(0, n_kv)
    if p1.shape[0] > 1 and not alibi:
        base, band = _band(pos, other, lo, hi)
        if band is not None:
            # every row: the cells all tokens see or none does; then only the columns where they differ
            _put(rows, tok, 0, p1.shape[0], slice(0, n_kv), base[None, :], pos, p1, False)
            cols = band
    width = cols.stop - cols.start
    if width == 0:
        return
    pos_c, other_c = pos[cols], other[cols]
    step = max(1, _ROW_CHUNK // width)
    for a in range(0, p1.shape[0], step):
        b = min(p1.shape[0], a + step)
        masked = _masked(pos_c, other_c, p1[a:b], None if lo is None else lo[a:b],
                         None if hi is None else hi[a:b])
        if xy1 is not None:
            _mask_2d(masked, pos_c, ext[cols], p1[a:b], xy1[0][a:b], xy1[1][a:b])
        _put(rows, tok, a, b, cols, masked, pos_c, p1[a:b], alibi)


def window(p1: np.ndarray, causal: bool, n_swa: int,
           swa_type: SwaType) -> tuple[np.ndarray | None, np.ndarray | None]:
    """int32 [T] bounds ``lo <= p0 <= hi`` of the visible positions of each query position (None: no bound
    beyond p0 >= 0): the causal rule and ``is_masked_swa`` of the window."""
    if swa_type == SwaType.NONE:
        return None, (p1 if causal else None)
    p = p1.astype(np.int64)
    lo, hi_w = swa_bounds(swa_type, n_swa, p)  # the window rule (hparams.py)
    hi = p if causal else None
    if hi_w is not None:
        hi = hi_w if hi is None else np.minimum(hi, hi_w)
    lo = None if lo is None or int(lo.max()) <= 0 else np.maximum(lo, 0).astype(np.int32)  # lo <= p1 fits int32
    if hi is not None:
        hi = np.minimum(hi, INT32_MAX).astype(np.int32)
    return lo, hi


def token_groups(first: np.ndarray) -> list[tuple[int, slice | np.ndarray]]:
    """(seq_id, rows) per distinct first sequence id of the tokens; rows a slice when they are consecutive."""
    n = first.shape[0]
    s0 = int(first[0])
    if n == 1 or not np.count_nonzero(first != s0):
        return [(s0, slice(0, n))]
    uniq, inv = np.unique(first, return_inverse=True)
    order = np.argsort(inv, kind="stable")
    bounds = np.cumsum(np.bincount(inv))
    groups: list[tuple[int, slice | np.ndarray]] = []
    for g, rows in enumerate(np.split(order, bounds[:-1])):
        r0, r1 = int(rows[0]), int(rows[-1])
        groups.append((int(uniq[g]), slice(r0, r1 + 1) if r1 - r0 + 1 == rows.size else rows))
    return groups


def _band(pos: np.ndarray, other: np.ndarray, lo: np.ndarray | None,
          hi: np.ndarray | None) -> tuple[np.ndarray, slice | None]:
    """Split a group's mask into what all its tokens share and where they differ.

    Returns (base, cols): ``base`` bool [n_kv] hides a cell from every token (other sequence, or outside every
    token's window); outside ``cols`` every token sees exactly the cells that ``base`` does not hide.  ``cols``
    (the span of the cells some tokens see and others do not, or at their own position, where the M-RoPE rule
    may hide them) is None when it covers more than ``_BAND_MAX`` of the row, or when no token has a bound (one
    row then serves them all): the rows are built whole.
    """
    if lo is None and hi is None:
        return other, None
    base = other
    differ = None
    if hi is not None:
        base = base | (pos > int(hi.max()))
        differ = pos >= int(hi.min())
    if lo is not None:
        base = base | (pos < int(lo.min()))
        left = pos < int(lo.max())
        differ = left if differ is None else differ | left
    idx = np.flatnonzero(differ & ~base)
    if not idx.size:
        return base, slice(0, 0)
    c0, c1 = int(idx[0]), int(idx[-1]) + 1
    if c1 - c0 > _BAND_MAX * pos.shape[0]:
        return base, None
    return base, slice(c0, c1)


def _put(rows: np.ndarray, tok: slice | np.ndarray, a: int, b: int, cols: slice, masked: np.ndarray,
         pos: np.ndarray, p1: np.ndarray, alibi: bool) -> None:
    """Write group rows [a, b) (rows ``tok[a:b]`` of the mask), columns ``cols``, from ``masked`` [b - a or 1, w]
    (one row: the same for every token, unless ALiBi makes the values differ)."""
    n_out = b - a if alibi else masked.shape[0]
    if isinstance(tok, slice) and n_out == b - a:
        _write_rows(rows[tok.start + a:tok.start + b, cols], masked, pos, p1, alibi)
        return
    block = np.empty((n_out, cols.stop - cols.start), rows.dtype)
    _write_rows(block, masked, pos, p1, alibi)
    if isinstance(tok, slice):
        rows[tok.start + a:tok.start + b, cols] = block
    else:
        rows[tok[a:b], cols] = block


def _masked(pos: np.ndarray, other: np.ndarray, p1: np.ndarray, lo: np.ndarray | None,
            hi: np.ndarray | None) -> np.ndarray:
    """bool [T, n_kv] (or [1, n_kv] when the same for every token): cell hidden from the token."""
    if hi is None and lo is None:
        return other[None, :]
    if hi is not None:
        masked = np.greater(pos, hi[:, None])                          # [T, n_kv]: future (or right of window)
        masked |= other
    else:
        masked = np.broadcast_to(other, (p1.shape[0], pos.shape[0])).copy()
    if lo is not None:
        masked |= np.less(pos, lo[:, None])                           # left of the window
    return masked


def _mask_2d(masked: np.ndarray, pos: np.ndarray, ext: np.ndarray, p1: np.ndarray, x1: np.ndarray,
             y1: np.ndarray) -> None:
    """M-RoPE: hide the visible cells at the token's own position that come after it in 2-D (row-major) order."""
    r, c = np.nonzero(~masked & (pos == p1[:, None]))
    if not r.size:
        return
    ex, ey = ext[c, 0], ext[c, 1]
    gt = (ey > y1[r]) | ((ey == y1[r]) & (ex > x1[r]))                 # llama_kv_cell_ext::is_2d_gt
    masked[r[gt], c[gt]] = True


def _write_rows(out: np.ndarray, masked: np.ndarray, pos: np.ndarray, p1: np.ndarray, alibi: bool) -> None:
    """out [T, n_kv] float: -inf where masked, else 0 or -|p0 - p1|."""
    if not alibi:
        itype, neg_inf = NEG_INF_BITS[out.dtype]
        np.multiply(masked, neg_inf, out=out.view(itype))
        return
    dist = np.abs(pos.astype(np.int64)[None, :] - p1.astype(np.int64)[:, None])
    np.negative(dist, out=dist)
    np.copyto(out, dist, casting="unsafe")
    np.copyto(out, -np.inf, where=np.broadcast_to(masked, out.shape))
