"""The cache's inputs: the host tensors a graph reads (llama.cpp's ``set_input_*``), filled with numpy.

:class:`KVInputs` computes every input from the bookkeeping (the cells of each stream) and a ubatch's slot: the K
and V destination rows, the pending K-shift of every cell, the kq mask (kernels in :mod:`.masks`) and T5's
relative position buckets.  Every ``set_input_*`` writes the data of a tensor in host memory exactly as the seed
does, checking the tensor (type, shape for this ubatch, contiguity, host memory) before writing anything;
:func:`host_array` makes those checks and returns the tensor's data as a numpy array.  Nothing loops in Python
over tokens or cells: loops run over streams or over the distinct sequences of a ubatch.

Fast paths (the same bytes): the numpy view of a tensor's data is kept for the next call on the same memory
(``_host``: the runtime fills the same input tensors step after step), and a mask whose tokens need no window,
ALiBi or 2-D test is copied from ready rows patched with the cells' changes (:mod:`.mask_rows`) instead of being
built over all ``n_kv`` cells.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from .. import ggml as G
from ..batch import UBatch
from ..hparams import HParams, SwaType, llama_relative_position_bucket_np
from .._consts import LLAMA_MAX_SEQ
from .bookkeeping import KVBookkeeping
from .mask_rows import MaskRows
from .masks import mask_decode_row, mask_group, token_groups
from .types import SlotInfo

__all__ = ["KVInputs", "host_array", "host_tensor"]

_MASK_TYPES = (G.GGMLType.F32, G.GGMLType.F16)
_I64 = (G.GGMLType.I64,)
_NP_TYPESTR = {G.GGMLType.F32: "<f4", G.GGMLType.F16: "<f2", G.GGMLType.I32: "<i4", G.GGMLType.I64: "<i8"}
_ITEMSIZE = {G.GGMLType.F32: 4, G.GGMLType.F16: 2, G.GGMLType.I32: 4, G.GGMLType.I64: 8}


@dataclass(slots=True)
class _Entry:
    """What KVInputs keeps of one input tensor."""

    words: memoryview     # a live view of the leading words of the tensor's struct
    word_bytes: bytes     # their bytes when ``header`` was read: the entry holds while they are the same
    header: tuple         # G.header(tensor): type, ne, nb, buffer, data
    views: dict           # shape -> (types, ne, checked numpy view) served by _host
    tensor: Any           # the tensor handle (kept alive: its id stays its own)


@dataclass(slots=True)
class _Last:
    """The tensor a set_input_* wrote last, served again while the same tensor comes for as many tokens with the
    same struct words (a decode loop: no entry lookup, no shape key)."""

    tensor: Any           # the input tensor handle (None: nothing written yet)
    n_tokens: int         # the ubatch size it was written for
    words: Any            # its entry's live words ...
    word_bytes: Any       # ... and their bytes then
    view: Any             # its checked data view (numpy)
    view_m: Any           # a memoryview of it, for scalar writes


def _no_last() -> _Last:
    return _Last(None, -1, None, None, None, None)


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


def host_array(dst: Any, types: tuple[G.GGMLType, ...], ne: tuple[int, int, int, int],
               header: tuple | None = None) -> np.ndarray:
    """The data of host tensor ``dst`` as a writable numpy array of shape ``reversed(ne)``.

    ValueError, naming the tensor and its buffer, unless ``dst`` has one of ``types``, exactly ``ne`` elements per
    dimension and a contiguous layout, and lives in host memory (a host buffer, or an allocating context).
    Nothing is written.  ``header``: ``G.header(dst)`` when the caller has read it already.
    """
    tt, have, nb, buf, ptr = header or G.header(dst)  # one struct read: this runs for every input of every step
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


class KVInputs:
    """``set_input_*`` of llama_kv_cache: K/V destination rows, K-shift, kq mask, relative position buckets."""

    def __init__(self, book: KVBookkeeping, hparams: HParams, v_trans: bool) -> None:
        self.book = book                              # the cells the inputs are computed from
        self.hparams = hparams                        # ALiBi, relative buckets, V width
        self.v_trans = bool(v_trans)                  # V stored transposed: one index per V element
        self.kv_size = book.get_size()                # cells per stream
        # offset of element j of a transposed V row in its stream: the per-step v_idxs input adds it to each cell
        self._v_elem_offs = np.arange(hparams.n_embd_v_gqa_max(), dtype=np.int64) * self.kv_size
        self._v_stream_stride = self.kv_size * hparams.n_embd_v_gqa_max()  # ... and streams this far apart
        # one token's cell base in a 0-d array (set through its memoryview): np.add of two arrays skips the
        # conversion of a Python int, about half the cost of the call
        self._v_base0 = np.zeros((), np.int64)
        self._v_base0_m = memoryview(self._v_base0)
        # several tokens: each token's cell base [LLAMA_MAX_SEQ, 1] (scalar writes through the memoryview), added to
        # the element offsets in one call
        self._v_bases = np.zeros((LLAMA_MAX_SEQ, 1), np.int64)
        self._v_bases_m = memoryview(self._v_bases)
        self.mask_rows = MaskRows(book)               # ready kq-mask rows, patched step to step
        # per input tensor (by the id of its handle, an int object): a live view of its struct's leading words, their
        # bytes when its header was read, the header, its checked data views (shape -> (types, ne, view)), and
        # the handle object itself (kept alive: its id stays its own; another object of the same address -- a
        # graph rebuilt in a reset context -- gets an entry of its own, its header read again)
        self._tensors: dict[int, _Entry] = {}
        # the mask rows need no window, ALiBi (nor, per ubatch, 2-D positions): ready rows may serve them
        self._plain = book.swa_type == SwaType.NONE and not hparams.use_alibi
        self.fast = True  # fast paths on (the equivalence tests turn them off to compare with the full build)
        # per set_input_* (k_idxs, v_idxs, kq mask): the tensor it wrote last, for how many tokens, the live view of
        # its struct's words and their bytes then, and its checked data view -- served again while the same tensor
        # comes for as many tokens with the same words (a decode loop: no entry lookup, no shape key)
        self._last: list[_Last] = [_no_last(), _no_last(), _no_last()]

    def _entry(self, dst: Any) -> _Entry:
        """The cache entry of tensor ``dst``: its header (``G.header``) read again only when the words of its
        struct changed since (a runtime fills the same input tensors step after step: one numpy call then)."""
        ent = self._tensors.get(id(dst))  # (the entry keeps dst alive: its id stays its own)
        if ent is not None and ent.tensor is dst and ent.words.tobytes() == ent.word_bytes:
            return ent
        words = memoryview(G.header_words(dst)).cast("B")  # (bytes: its tobytes is half numpy's)
        if len(self._tensors) >= 64:
            self._tensors.clear()
        ent = self._tensors[id(dst)] = _Entry(words, words.tobytes(), G.header(dst), {}, dst)
        return ent

    def _host(self, dst: Any, types: tuple[G.GGMLType, ...], ne: tuple[int, int, int, int],
              shape: tuple[int, ...], ent: _Entry | None = None) -> np.ndarray:
        """host_array(dst, types, ne) reshaped to ``shape``, the view kept while the tensor's header stays the same
        (type, shape, strides, buffer and data pointer: everything host_array checks).  ``ent``: ``_entry(dst)``
        when the caller has it."""
        ent = ent or self._entry(dst)
        hit = ent.views.get(shape)
        if hit is not None and hit[0] is types and hit[1] == ne:
            return hit[2]
        view = host_array(dst, types, ne, ent.header).reshape(shape)
        ent.views[shape] = (types, ne, view)
        return view

    def _last_view(self, role: int, dst: Any, n_tokens: int, view_of: Any) -> _Last:
        """``_last[role]``, with ``view_of(dst, n_tokens)`` (a checked numpy view) -- served again while set_input_*
        ``role`` gets the tensor of its last call, for as many tokens, with its struct's words unchanged.  The
        set_input_* make the same test inline first (a decode loop's every step) and come here when it fails."""
        last = self._last[role]
        if last.tensor is dst and last.n_tokens == n_tokens and last.words.tobytes() == last.word_bytes:
            return last
        view = view_of(dst, n_tokens)
        ent = self._tensors[id(dst)]  # (just read by _host)
        last = self._last[role] = _Last(dst, n_tokens, ent.words, ent.word_bytes, view, memoryview(view))
        return last

    # ------------------------------------------------------------------ index inputs

    def set_input_k_idxs(self, dst: Any, ubatch: UBatch, sinfo: SlotInfo) -> None:
        """I64 [n_tokens]: the row of the (stream-merged) K cache each token is written to."""
        n = ubatch.n_tokens
        if n == 1 and sinfo.cell >= 0:  # one token, one cell (fill_k_idxs, inline: every step)
            last = self._last[0]
            if last.tensor is not dst or last.n_tokens != 1 or last.words.tobytes() != last.word_bytes:
                last = self._last_view(0, dst, 1, self.k_idxs_view)
            last.view_m[0] = sinfo.cell + sinfo.strm[0] * self.kv_size
            return
        self._check_slot(ubatch, sinfo)
        self.fill_k_idxs(self._last_view(0, dst, n, self.k_idxs_view).view, ubatch, sinfo)

    def k_idxs_view(self, dst: Any, n_tokens: int) -> np.ndarray:
        """The data of the k_idxs input ``dst`` of a ubatch of ``n_tokens``, checked, as int64 [n_tokens]."""
        return self._host(dst, _I64, (n_tokens, 1, 1, 1), (n_tokens,))

    def fill_k_idxs(self, out: np.ndarray, ubatch: UBatch, sinfo: SlotInfo) -> None:
        """set_input_k_idxs into ``out``, a :meth:`k_idxs_view` of the ubatch's tensor."""
        n_tokens = ubatch.n_tokens
        if n_tokens == 1 and len(sinfo.strm) == 1 and sinfo.idxs and len(sinfo.idxs[0]) == 1:  # one sequence's step
            out[0] = sinfo.idxs[0].item(0) + sinfo.strm[0] * self.kv_size
            return
        self._check_slot(ubatch, sinfo)
        out[...] = self._token_cells(sinfo)

    def set_input_v_idxs(self, dst: Any, ubatch: UBatch, sinfo: SlotInfo) -> None:
        """I64 [n_tokens] (V rows), or with a transposed V one row per element:
        I64 [n_embd_v_gqa_max*n_tokens], element j of token i at ``strm*kv_size*n_embd + j*kv_size + idx``."""
        n = ubatch.n_tokens
        if n == 1 and sinfo.cell >= 0:  # one token, one cell (fill_v_idxs, inline: every step)
            last = self._last[1]
            if last.tensor is not dst or last.n_tokens != 1 or last.words.tobytes() != last.word_bytes:
                last = self._last_view(1, dst, 1, self.v_idxs_view)
            self.write_v_idxs_one(last.view, sinfo.cell, sinfo.strm[0])
            return
        self._check_slot(ubatch, sinfo)
        self.fill_v_idxs(self._last_view(1, dst, n, self.v_idxs_view).view, ubatch, sinfo)

    @property
    def n_v_elems(self) -> int:
        """Indices per token in a v_idxs input: n_embd_v_gqa_max with a transposed V, else 1."""
        return self._v_elem_offs.shape[0] if self.v_trans else 1

    def write_v_idxs_one(self, out: np.ndarray, cell: int, strm: int) -> None:
        """The v_idxs of one token in ``cell`` of stream ``strm`` into ``out`` (int64 [n_v_elems]): the cell's row,
        or with a transposed V element j at ``strm*kv_size*n_embd + j*kv_size + cell``.  The one home of that rule:
        set_input_v_idxs, fill_v_idxs and the fused decode step call it."""
        if self.v_trans:
            self._v_base0_m[()] = cell + strm * self._v_stream_stride  # (a 0-d array: no Python int to convert)
            np.add(self._v_elem_offs, self._v_base0, out)
        else:
            out[0] = cell + strm * self.kv_size

    def write_v_idxs_rows(self, rows: np.ndarray, cells: list[int], strms: list[int]) -> None:
        """Transposed V: the v_idxs of tokens in ``cells`` (of streams ``strms``) into ``rows``, int64
        [n_tokens, n_embd_v_gqa_max] (a view of the input), in one numpy call after a scalar write per token."""
        stride, base_m = self._v_stream_stride, self._v_bases_m
        n = len(cells)
        for j in range(n):
            base_m[j, 0] = cells[j] + strms[j] * stride
        np.add(self._v_bases[:n], self._v_elem_offs, rows)

    def v_idxs_view(self, dst: Any, n_tokens: int) -> np.ndarray:
        """The data of the v_idxs input ``dst`` of a ubatch of ``n_tokens``, checked, as int64 [n_tokens] (or
        [n_tokens*n_embd_v_gqa_max] with a transposed V)."""
        n = n_tokens * (self._v_elem_offs.shape[0] if self.v_trans else 1)
        return self._host(dst, _I64, (n, 1, 1, 1), (n,))

    def fill_v_idxs(self, out: np.ndarray, ubatch: UBatch, sinfo: SlotInfo) -> None:
        """set_input_v_idxs into ``out``, a :meth:`v_idxs_view` of the ubatch's tensor."""
        n_tokens = ubatch.n_tokens
        one = n_tokens == 1 and len(sinfo.strm) == 1 and sinfo.idxs and len(sinfo.idxs[0]) == 1  # one sequence's step
        if not one:
            self._check_slot(ubatch, sinfo)
        if one:
            self.write_v_idxs_one(out, sinfo.idxs[0].item(0), sinfo.strm[0])
            return
        if not self.v_trans:
            out[...] = self._token_cells(sinfo)
            return
        elem = self._v_elem_offs                                              # [n_embd_v_gqa_max]: j*kv_size
        n_embd = elem.shape[0]
        base = np.asarray(self._token_cells(sinfo, stream_stride=self._v_stream_stride), np.int64)  # [n_tokens]
        np.add(base[:, None], elem, out=out.reshape(n_tokens, n_embd))

    def set_input_k_shift(self, dst: Any) -> None:
        """I32 [kv_size*n_stream]: the pending shift of every cell, 0 for empty cells."""
        ns = self.book.n_stream
        out = host_array(dst, (G.GGMLType.I32,), (self.kv_size * ns, 1, 1, 1)).reshape(ns, -1)
        for s, cells in enumerate(self.book.v_cells):
            np.copyto(out[s], cells.shift_array)
            out[s][cells.pos_array < 0] = 0

    def k_shift(self) -> np.ndarray:
        """int32 [n_stream*kv_size]: what set_input_k_shift writes."""
        with host_tensor(G.GGMLType.I32, (self.kv_size * self.book.n_stream,), "k_shift") as t:
            self.set_input_k_shift(t)
            return G.to_numpy(t, copy=True)

    # ------------------------------------------------------------------ kq mask

    def set_input_kq_mask(self, dst: Any, ubatch: UBatch, causal_attn: bool = True) -> None:
        """F32 or F16 [n_kv, n_tps, 1, n_stream]: 0 (or the ALiBi bias -|p0 - p1|) where token i may attend
        cell j, -inf elsewhere; n_kv and n_stream are the tensor's."""
        n = ubatch.n_tokens
        last = self._last[2]
        if last.tensor is not dst or last.n_tokens != n or last.words.tobytes() != last.word_bytes:
            last = self._last_view(2, dst, n, self.kq_mask_view)
        rows = last.view
        one = ubatch.one
        if one is not None and self._plain and self.fast and rows.shape[1]:  # fill_kq_mask's decode row
            if self.mask_rows.write_one(rows, one[0], one[1], causal_attn):  # (its truth value only)
                return
        self.fill_kq_mask(rows, ubatch, causal_attn)

    def kq_mask_view(self, dst: Any, n_tokens: int) -> np.ndarray:
        """The data of the kq mask input ``dst`` of a ubatch of ``n_tokens``, checked, as [n_tokens, n_kv] (row i =
        token i: stream s, token ii of it, i = s*n_tps + ii)."""
        ent = self._entry(dst)
        n_kv, _, _, ns = ent.header[1]
        if ns < 1 or n_tokens % ns:
            raise ValueError(f"kq mask {G.name(dst)!r}: ne[3] = {ns} streams do not split the ubatch's "
                             f"{n_tokens} tokens evenly")
        if n_kv > self.kv_size:
            raise ValueError(f"kq mask {G.name(dst)!r}: n_kv = ne[0] = {n_kv} exceeds the cache size "
                             f"{self.kv_size}")
        return self._host(dst, _MASK_TYPES, (n_kv, n_tokens // ns, 1, ns), (n_tokens, n_kv), ent)

    def fill_kq_mask(self, rows: np.ndarray, ubatch: UBatch, causal_attn: bool = True) -> None:
        """set_input_kq_mask into ``rows``, a :meth:`kq_mask_view` of the ubatch's tensor."""
        n_tokens = ubatch.n_tokens
        if rows.size == 0:
            return
        plain = self._plain and not ubatch.is_pos_2d()  # no window, ALiBi or 2-D positions
        if plain and self.fast:  # ready rows (the decode step), unless a token needs its positions tested
            if n_tokens == 1:
                if self.mask_rows.write_one(rows, ubatch.seq_id.item(0), ubatch.pos.item(0), bool(causal_attn)):
                    return
            elif n_tokens <= LLAMA_MAX_SEQ and self.mask_rows.write(
                    rows, ubatch.seq_id[:, 0].tolist(), ubatch.pos[:n_tokens].tolist(), bool(causal_attn)):
                return
        book, alibi = self.book, bool(self.hparams.use_alibi)
        stream_of = book.stream_of
        if n_tokens == 1 and plain:
            seq_id = int(ubatch.seq_id[0, 0])
            mask_decode_row(rows[0], book.v_cells[stream_of[seq_id]], seq_id, int(ubatch.pos[0]), bool(causal_attn))
            return
        for seq_id, tok in token_groups(ubatch.seq_id[:, 0]):
            mask_group(rows, tok, book.v_cells[stream_of[seq_id]], seq_id, ubatch, bool(causal_attn), book.n_swa,
                       book.swa_type, alibi)

    # ------------------------------------------------------------------ relative position buckets

    def set_input_pos_bucket(self, dst: Any, ubatch: UBatch) -> None:
        """I32 [n_kv, n_tokens]: T5's bucket of each (cell, token) pair; -1 stands for an empty cell's position."""
        if self.book.n_stream != 1:
            raise ValueError(f"set_input_pos_bucket() supports a unified cache (one stream), this one has "
                             f"{self.book.n_stream}")
        if ubatch.equal_seqs():
            raise ValueError("set_input_pos_bucket() does not take ubatches of equal sequence sets (split_equal, "
                             "split_seq), as llama.cpp: split with split_simple")
        n_tokens = ubatch.n_tokens
        n_kv = G.ne(dst)[0]
        if n_kv > self.kv_size:
            raise ValueError(f"pos bucket {G.name(dst)!r}: n_kv = ne[0] = {n_kv} exceeds the cache size "
                             f"{self.kv_size}")
        out = host_array(dst, (G.GGMLType.I32,), (n_kv, n_tokens, 1, 1)).reshape(n_tokens, n_kv)
        p0 = self.book.v_cells[0].pos_array[:n_kv]  # empty cells hold -1, the position the seed uses for them
        buckets = llama_relative_position_bucket_np(p0[None, :], ubatch.pos[:n_tokens, None],
                                                    self.hparams.n_rel_attn_bkts, False)
        np.copyto(out, buckets)

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _check_slot(ubatch: UBatch, sinfo: SlotInfo) -> None:
        """RuntimeError unless the ubatch's tokens are its slot's cells (n_stream x size)."""
        if ubatch.n_tokens == (len(sinfo.strm) * len(sinfo.idxs[0]) if sinfo.idxs else 0):
            return
        size = sinfo.size() if sinfo.idxs else 0
        raise RuntimeError(f"ubatch of {ubatch.n_tokens} tokens does not match its slot of "
                           f"{sinfo.n_stream()} streams x {size} cells")

    def _token_cells(self, sinfo: SlotInfo, stream_stride: int | None = None) -> np.ndarray | list[int]:
        """int64 [n_tokens]: ``strm*stream_stride + cell`` of each token (stride kv_size by default); a list of ints
        for one token per stream."""
        stride = self.kv_size if stream_stride is None else stream_stride
        if len(sinfo.idxs) == 1:
            return sinfo.idxs[0] + sinfo.strm[0] * stride if sinfo.strm[0] else sinfo.idxs[0]
        if len(sinfo.idxs[0]) == 1:  # one token per stream (the decode step): Python ints (numpy converts on write)
            return [idx.item(0) + s * stride for s, idx in zip(sinfo.strm, sinfo.idxs)]
        cells = np.concatenate(sinfo.idxs)
        cells += np.repeat(np.multiply(sinfo.strm, stride, dtype=np.int64), len(sinfo.idxs[0]))
        return cells


@contextlib.contextmanager
def host_tensor(type_: G.GGMLType, ne: tuple[int, ...], name: str) -> Iterator[Any]:
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
