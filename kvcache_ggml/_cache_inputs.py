"""Input half of KVCache: the host tensors a graph reads (llama.cpp's ``set_input_*``), filled with numpy.

Every ``set_input_*`` writes the data of a tensor in host memory exactly as the seed does, checking the tensor
(type, shape for this ubatch, contiguity, host memory) before writing anything; :func:`_host_array` makes those
checks and returns the tensor's data as a numpy array.  Nothing loops in Python over tokens or cells: loops run
over streams or over the distinct sequences of a ubatch.

The kq mask.  Row ``i`` of the mask (``[n_kv, n_tps, 1, n_stream]``, rows in token order) is token ``i``; the
token sees cell ``j`` of the stream of its first sequence when the cell holds that sequence and its position
``p0`` passes the causal test and the sliding window.  Both tests bound ``p0`` to an interval per token,
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

import contextlib
from typing import Any, Iterator

import numpy as np

from . import _ggml as G
from .hparams import SwaType, llama_relative_position_bucket_np

__all__ = ["InputMixin", "ContextInputsMixin"]

_I32_MAX = np.iinfo(np.int32).max
# -inf as the integer that has its bit pattern: masked (True) * this = -inf, visible (False) * this = +0.0
_NEG_INF_BITS = {G.GGMLType.F32: (np.int32, np.int32(-0x00800000)),   # 0xFF800000
                 G.GGMLType.F16: (np.int16, np.int16(-0x0400))}       # 0xFC00
_MASK_TYPES = (G.GGMLType.F32, G.GGMLType.F16)
_ROW_CHUNK = 1 << 16  # mask elements per chunk of rows: the temporaries stay in the CPU cache
_BAND_MAX = 0.25      # build only the differing columns of a group's rows when they span at most this of n_kv

_NP_TYPESTR = {G.GGMLType.F32: "<f4", G.GGMLType.F16: "<f2", G.GGMLType.I32: "<i4", G.GGMLType.I64: "<i8"}
_SEQ_BIT = [np.uint64(1 << b) for b in range(64)]
_ITEMSIZE = {G.GGMLType.F32: 4, G.GGMLType.F16: 2, G.GGMLType.I32: 4, G.GGMLType.I64: 8}


class _HostMemory:
    """Host memory at an address, exposed to numpy through the array interface (no copy, no ownership)."""

    __slots__ = ("__array_interface__",)

    def __init__(self, ptr: int, shape: tuple[int, ...], typestr: str) -> None:
        self.__array_interface__ = {"data": (ptr, False), "shape": shape, "typestr": typestr, "version": 3}


def _buffer_desc(dst: Any) -> str:
    buf = G.buffer(dst)
    if not buf:
        return "no buffer"
    raw = G.ggml_backend_buffer_name(buf)
    return f"buffer {raw.decode('utf-8', 'replace') if raw else '?'!r}"


def _host_array(dst: Any, types: tuple[G.GGMLType, ...], ne: tuple[int, int, int, int]) -> np.ndarray:
    """The data of host tensor ``dst`` as a writable numpy array of shape ``reversed(ne)``.

    ValueError, naming the tensor and its buffer, unless ``dst`` has one of ``types``, exactly ``ne`` elements per
    dimension and a contiguous layout, and lives in host memory (a host buffer, or an allocating context).
    Nothing is written.
    """
    tt, have, nb, buf, ptr = G.header(dst)  # one struct read: this runs for every input of every step
    if tt not in types:
        want = " or ".join(G.type_name(t) for t in types)
        raise ValueError(f"tensor {G.name(dst)!r} is {G.type_name(tt)}, expected {want}")
    if have != tuple(ne):
        raise ValueError(f"tensor {G.name(dst)!r} has ne {have}, expected {tuple(ne)}")
    # the input types are scalar (block size 1): contiguous means each stride is the previous row's bytes
    if nb[0] != _ITEMSIZE[tt] or nb[1] != nb[0] * have[0] or nb[2] != nb[1] * have[1] or nb[3] != nb[2] * have[2]:
        raise ValueError(f"tensor {G.name(dst)!r} is not contiguous (nb {nb}): the inputs are written densely")
    if buf and not G.ggml_backend_buffer_is_host(buf):
        raise ValueError(f"tensor {G.name(dst)!r} is in {_buffer_desc(dst)}, which is not a host buffer: "
                         f"set_input_* writes host memory (allocate the inputs in a CPU buffer)")
    if not ptr:
        raise ValueError(f"tensor {G.name(dst)!r} ({_buffer_desc(dst)}) has no data: allocate it first")
    return np.asarray(_HostMemory(ptr, (have[3], have[2], have[1], have[0]), _NP_TYPESTR[tt]))


def _c_div(a: np.ndarray, b: int) -> np.ndarray:
    """Integer division truncated toward zero, as C does (b > 0)."""
    return np.where(a >= 0, a // b, -((-a) // b))


class InputMixin:
    """``set_input_*`` of llama_kv_cache: K/V destination rows, K-shift, kq mask, relative position buckets."""

    # ------------------------------------------------------------------ index inputs

    def set_input_k_idxs(self, dst: Any, ubatch: Any, sinfo: Any) -> None:
        """I64 [n_tokens]: the row of the (stream-merged) K cache each token is written to."""
        self._check_slot(ubatch, sinfo)
        out = _host_array(dst, (G.GGMLType.I64,), (ubatch.n_tokens, 1, 1, 1)).reshape(-1)
        np.copyto(out, self._token_cells(sinfo))

    def set_input_v_idxs(self, dst: Any, ubatch: Any, sinfo: Any) -> None:
        """I64 [n_tokens] (V rows), or with a transposed V one row per element:
        I64 [n_embd_v_gqa_max*n_tokens], element j of token i at ``strm*kv_size*n_embd + j*kv_size + idx``."""
        self._check_slot(ubatch, sinfo)
        n_tokens = ubatch.n_tokens
        if not self.v_trans:
            out = _host_array(dst, (G.GGMLType.I64,), (n_tokens, 1, 1, 1)).reshape(-1)
            np.copyto(out, self._token_cells(sinfo))
            return
        elem = self._v_elem_offs                                              # [n_embd_v_gqa_max]: j*kv_size
        n_embd = elem.shape[0]
        out = _host_array(dst, (G.GGMLType.I64,), (n_tokens * n_embd, 1, 1, 1)).reshape(n_tokens, n_embd)
        base = self._token_cells(sinfo, stream_stride=self.get_size() * n_embd)  # [n_tokens]
        np.add(base[:, None], elem, out=out)

    def set_input_k_shift(self, dst: Any) -> None:
        """I32 [kv_size*n_stream]: the pending shift of every cell, 0 for empty cells."""
        kv_size = self.get_size()
        out = _host_array(dst, (G.GGMLType.I32,), (kv_size * self.n_stream, 1, 1, 1)).reshape(self.n_stream, -1)
        for s, cells in enumerate(self.v_cells):
            np.copyto(out[s], cells.shift_array)
            out[s][cells.pos_array < 0] = 0

    def k_shift(self) -> np.ndarray:
        """int32 [n_stream*kv_size]: what set_input_k_shift writes."""
        with _host_tensor(G.GGMLType.I32, (self.get_size() * self.n_stream,), "k_shift") as t:
            self.set_input_k_shift(t)
            return G.to_numpy(t, copy=True)

    # ------------------------------------------------------------------ kq mask

    def set_input_kq_mask(self, dst: Any, ubatch: Any, causal_attn: bool = True) -> None:
        """F32 or F16 [n_kv, n_tps, 1, n_stream]: 0 (or the ALiBi bias -|p0 - p1|) where token i may attend
        cell j, -inf elsewhere; n_kv and n_stream are the tensor's."""
        n_tokens = ubatch.n_tokens
        n_kv, _, _, ns = G.ne(dst)
        if ns < 1 or n_tokens % ns:
            raise ValueError(f"kq mask {G.name(dst)!r}: ne[3] = {ns} streams do not split the ubatch's "
                             f"{n_tokens} tokens evenly")
        if n_kv > self.get_size():
            raise ValueError(f"kq mask {G.name(dst)!r}: n_kv = ne[0] = {n_kv} exceeds the cache size "
                             f"{self.get_size()}")
        out = _host_array(dst, _MASK_TYPES, (n_kv, n_tokens // ns, 1, ns))
        if out.size == 0:
            return
        rows = out.reshape(n_tokens, n_kv)  # row i = token i (stream s, token ii of it: i = s*n_tps + ii)
        if n_tokens == 1 and self.swa_type == SwaType.NONE and not self.hparams.use_alibi and not ubatch.is_pos_2d():
            self._mask_one(rows[0], int(ubatch.seq_id[0, 0]), int(ubatch.pos[0]), bool(causal_attn))
            return
        for seq_id, tok in _token_groups(ubatch.seq_id[:, 0]):
            self._mask_group(rows, tok, seq_id, ubatch, bool(causal_attn))

    def _mask_one(self, row: np.ndarray, seq_id: int, p1: int, causal: bool) -> None:
        """The decode step's row: one token, no window, no ALiBi, no 2-D positions -- a few whole-row ops."""
        n_kv = row.shape[0]
        cells = self.v_cells[self._seq_to_stream_list[seq_id]]
        hidden = (cells.seq_bits[seq_id >> 6, :n_kv] & _SEQ_BIT[seq_id & 63]) == 0  # [n_kv]; empty cells too
        if causal:
            hidden |= cells.pos_array[:n_kv] > p1
        # -inf where hidden, +0.0 elsewhere: one integer multiply by the bit pattern of -inf
        itype, neg_inf = _NEG_INF_BITS[G.GGMLType.F32 if row.dtype == np.float32 else G.GGMLType.F16]
        np.multiply(hidden, neg_inf, out=row.view(itype))

    def _mask_group(self, rows: np.ndarray, tok: slice | np.ndarray, seq_id: int, ubatch: Any,
                    causal: bool) -> None:
        """Write the mask rows ``tok`` of the tokens whose first sequence is ``seq_id``."""
        n_tokens, n_kv = rows.shape
        cells = self.v_cells[self._seq_to_stream_list[seq_id]]
        pos = cells.pos_array[:n_kv]                                   # [n_kv]
        word = cells.seq_bits[seq_id >> 6, :n_kv]                       # [n_kv] uint64: the sequence's bits
        other = (word & np.uint64(1 << (seq_id & 63))) == 0              # [n_kv] cell lacks the sequence (or empty)
        p1 = ubatch.pos[:n_tokens][tok]                                 # [T]
        lo, hi = self._window(p1, causal)
        xy1 = ext = None
        if causal and ubatch.is_pos_2d():
            xy1 = (ubatch.pos[2 * n_tokens:3 * n_tokens][tok], ubatch.pos[n_tokens:2 * n_tokens][tok])
            ext = cells.ext_array[:n_kv]
        alibi = bool(self.hparams.use_alibi)
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

    def _window(self, p1: np.ndarray, causal: bool) -> tuple[np.ndarray | None, np.ndarray | None]:
        """int32 [T] bounds ``lo <= p0 <= hi`` of the visible positions of each query position (None: no bound
        beyond p0 >= 0); the causal rule and ``is_masked_swa`` of the cache's window."""
        t, n_swa = self.swa_type, self.n_swa
        if t == SwaType.NONE:
            return None, (p1 if causal else None)
        p = p1.astype(np.int64)
        lo = None
        hi = p if causal else None
        if t == SwaType.STANDARD:          # masked when p1 - p0 >= n_swa
            lo = p - n_swa + 1
        elif t == SwaType.CHUNKED:         # masked when p0 < (p1 / n_swa) * n_swa
            lo = _c_div(p, n_swa) * n_swa
        elif t == SwaType.SYMMETRIC:       # masked when p1 - p0 < -n_swa/2 or > n_swa/2
            half = n_swa // 2
            lo = p - half
            hi = p + half if hi is None else np.minimum(hi, p + half)
        lo = None if int(lo.max()) <= 0 else np.maximum(lo, 0).astype(np.int32)  # lo <= p1 fits int32
        if hi is not None:
            hi = np.minimum(hi, _I32_MAX).astype(np.int32)
        return lo, hi

    # ------------------------------------------------------------------ relative position buckets

    def set_input_pos_bucket(self, dst: Any, ubatch: Any) -> None:
        """I32 [n_kv, n_tokens]: T5's bucket of each (cell, token) pair; -1 stands for an empty cell's position."""
        if self.n_stream != 1:
            raise ValueError(f"set_input_pos_bucket() supports a unified cache (one stream), this one has "
                             f"{self.n_stream}")
        if ubatch.equal_seqs():
            raise ValueError("set_input_pos_bucket() does not take ubatches of equal sequence sets (split_equal, "
                             "split_seq), as llama.cpp: split with split_simple")
        n_tokens = ubatch.n_tokens
        n_kv = G.ne(dst)[0]
        if n_kv > self.get_size():
            raise ValueError(f"pos bucket {G.name(dst)!r}: n_kv = ne[0] = {n_kv} exceeds the cache size "
                             f"{self.get_size()}")
        out = _host_array(dst, (G.GGMLType.I32,), (n_kv, n_tokens, 1, 1)).reshape(n_tokens, n_kv)
        p0 = self.v_cells[0].pos_array[:n_kv]  # empty cells hold -1, the position the seed uses for them
        buckets = llama_relative_position_bucket_np(p0[None, :], ubatch.pos[:n_tokens, None],
                                                    self.hparams.n_rel_attn_bkts, False)
        np.copyto(out, buckets)

    # ------------------------------------------------------------------ helpers

    def _check_slot(self, ubatch: Any, sinfo: Any) -> None:
        n = sinfo.size() * sinfo.n_stream() if not sinfo.empty() else 0
        if ubatch.n_tokens != n:
            raise RuntimeError(f"ubatch of {ubatch.n_tokens} tokens does not match its slot of "
                               f"{sinfo.n_stream()} streams x {sinfo.size() if n else 0} cells")

    def _token_cells(self, sinfo: Any, stream_stride: int | None = None) -> np.ndarray:
        """int64 [n_tokens]: ``strm*stream_stride + cell`` of each token (stride kv_size by default)."""
        stride = self.get_size() if stream_stride is None else stream_stride
        if len(sinfo.idxs) == 1:
            return sinfo.idxs[0] + sinfo.strm[0] * stride
        return np.concatenate([idx + s * stride for s, idx in zip(sinfo.strm, sinfo.idxs)])


# ---------------------------------------------------------------------------------------------- mask kernels

def _token_groups(first: np.ndarray) -> list[tuple[int, slice | np.ndarray]]:
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
        itype, neg_inf = _NEG_INF_BITS[G.GGMLType.F32 if out.dtype == np.float32 else G.GGMLType.F16]
        np.multiply(masked, neg_inf, out=out.view(itype))
        return
    dist = np.abs(pos.astype(np.int64)[None, :] - p1.astype(np.int64)[:, None])
    np.negative(dist, out=dist)
    np.copyto(out, dist, casting="unsafe")
    np.copyto(out, -np.inf, where=np.broadcast_to(masked, out.shape))


# ---------------------------------------------------------------------------------------------- conveniences

@contextlib.contextmanager
def _host_tensor(type_: G.GGMLType, ne: tuple[int, ...], name: str) -> Iterator[Any]:
    """A tensor of ``ne`` in a fresh CPU buffer, freed with its context on exit."""
    ctx = G.Context.for_tensors(1)
    try:
        t = ctx.new_tensor(type_, ne, name)
        buf = G.BackendBuffer.for_context(ctx, G.cpu_buffer_type())
        try:
            yield t
        finally:
            buf.close()
    finally:
        ctx.close()


class ContextInputsMixin:
    """numpy conveniences of KVCacheContext: the inputs of the current ubatch, in tensors of their own."""

    def kq_mask(self, causal: bool = True, type_: str | int = "f32") -> np.ndarray:
        """float [n_stream, n_tokens_per_stream, n_kv]: set_input_kq_mask of the current ubatch (after apply())."""
        ub, sinfo = self._applied_ubatch("kq_mask")
        ns = sinfo.n_stream()
        with _host_tensor(G.parse_type(type_), (self.get_n_kv(), ub.n_tokens // ns, 1, ns), "kq_mask") as t:
            self.kv.set_input_kq_mask(t, ub, causal)
            return G.to_numpy(t, copy=True, ndim=4)[:, 0]

    def k_idxs(self) -> np.ndarray:
        """int64 [n_tokens]: set_input_k_idxs of the current ubatch."""
        ub, sinfo = self._applied_ubatch("k_idxs")
        with _host_tensor(G.GGMLType.I64, (ub.n_tokens,), "k_idxs") as t:
            self.kv.set_input_k_idxs(t, ub, sinfo)
            return G.to_numpy(t, copy=True)

    def v_idxs(self) -> np.ndarray:
        """int64 [n_tokens] or, V transposed, [n_tokens*n_embd_v_gqa_max]: set_input_v_idxs of the ubatch."""
        ub, sinfo = self._applied_ubatch("v_idxs")
        n = ub.n_tokens * (self.kv.hparams.n_embd_v_gqa_max() if self.kv.v_trans else 1)
        with _host_tensor(G.GGMLType.I64, (n,), "v_idxs") as t:
            self.kv.set_input_v_idxs(t, ub, sinfo)
            return G.to_numpy(t, copy=True)

    def k_shift(self) -> np.ndarray:
        """int32 [n_stream*kv_size]: set_input_k_shift of the cache."""
        return self.kv.k_shift()

    def _applied_ubatch(self, what: str) -> tuple[Any, Any]:
        if not self.ubatches:
            raise RuntimeError(f"{what}(): this memory context has no ubatch ({self.status.name}, update or "
                               "full context)")
        if self.i_cur >= len(self.ubatches):
            raise RuntimeError(f"{what}(): the context is past its last ubatch (next() returned False)")
        if self.get_n_kv() == 0:
            raise RuntimeError(f"{what}(): call apply() first (n_kv is 0 until the ubatch is placed)")
        return self.get_ubatch(), self.get_sinfo()
