"""Saving and restoring the KV cache: llama.cpp's ``state_write``/``state_read``, byte for byte.

:class:`StateCodec` writes the state of the bookkeeping's cells and the tensor store's rows, and restores them;
the layout is spelled out in :mod:`.format`, the writers and readers are in :mod:`.io`, the state
files in :mod:`.files`.

Restoring
---------
A whole-cache restore empties the cache (cells and data) and fills each stream from its first cell; a
single-sequence restore removes the destination sequence, places its cells as a ubatch would be placed
(``find_slot`` + ``apply_ubatch``, so possibly scattered) and writes their rows.  Before a stream's cells are
placed, the whole stream -- its cells, every layer header, and that the data is all there -- is checked against the
cache.  Every problem raises ``ValueError`` naming the field, the value found and the value expected.  A blob
whose stream count does not match (or is missing) changes nothing; any later failure leaves the cache empty
(whole-cache restore) or the destination sequence removed (single-sequence restore), never half restored.  A
single-sequence restore changes no other sequence (in a sliding-window cache, placing the cells may reuse cells that
another sequence's window has masked, as any decode does).

Deliberate differences from llama.cpp's restore (the format is the same both ways): the whole-cache restore empties
the cache once, up front (llama.cpp empties the whole cache again before each non-empty stream, so a multi-stream
cache keeps only its last non-empty stream, and a state without cells leaves the cache as it was); the
single-sequence restore removes the destination sequence even when the state has no cell for it; and a few values
llama.cpp lets through are refused (``v_trans`` other than 0/1, a position outside ``[0, INT32_MAX)``, a cell without
sequence or listing one twice, in a multi-stream cache a sequence in another sequence's stream, a single-sequence
state with cells in two streams, and bytes after the state in :meth:`StateCodec.state_load`).
"""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from ... import ggml as G
from ..._consts import LLAMA_MAX_SEQ
from ..cells.kvcells import KVCells
from ...hparams import HParams
from ..bookkeeping import KVBookkeeping
from .format import (COL_HDR, DATA_HDR, ROW_HDR, U32, Expect, LayerExpect, StreamState, check_eq,
                           parse_stream)
from .io import BufferWriter, BytesReader, BytesWriter, CountingWriter, StateReader, StateWriter
from ..tensors import KVTensors

__all__ = ["StateCodec"]

# above this many ggml_backend_tensor_get/set calls per layer, rows are gathered/scattered with numpy instead
_CALL_LIMIT = 256
# cells per chunk when writing cells that hold several sequences (bounds a [chunk, n_seq_max] bool matrix)
_META_CHUNK = 1 << 16


class StateCodec:
    """``state_write``/``state_read`` over the bookkeeping's cells and the tensor store's rows."""

    def __init__(self, book: KVBookkeeping, tensors: KVTensors) -> None:
        self.book = book                      # the cells written, and placed on restore
        self.tensors = tensors                # the K/V rows written and read
        self.hparams: HParams = tensors.hparams  # per-layer row widths

    # ------------------------------------------------------------------ public API

    def state_write(self, io: StateWriter, seq_id: int = -1, flags: int = 0) -> int:
        """Write the whole cache (``seq_id`` -1) or one sequence to ``io``; returns the bytes written.

        ``flags`` (``llama_state_seq_flags``) are accepted and ignored, as by llama.cpp's KV cache.
        """
        del flags
        if not -1 <= seq_id < LLAMA_MAX_SEQ:  # the seed writes empty streams for an id no stream holds
            raise ValueError(f"seq_id {seq_id} out of range [0, {LLAMA_MAX_SEQ}) or -1 for all")
        self.check_layout(data=not isinstance(io, CountingWriter))
        n0 = io.n_bytes()
        io.write(U32.pack(self.book.n_stream))
        for s, cells in enumerate(self.book.v_cells):
            mask = cells.pos_array >= 0
            if seq_id >= 0:
                mask &= cells.seq_mask(seq_id)
            idxs = np.flatnonzero(mask)
            io.write(U32.pack(idxs.size))
            if idxs.size == 0:
                continue
            for part in self._cells_meta(cells, idxs, seq_id):
                io.write(part)
            self._write_stream_data(io, s, idxs)
        io.flush()
        return io.n_bytes() - n0

    def state_read(self, io: StateReader, seq_id: int = -1, flags: int = 0) -> int:
        """Restore the whole cache (``seq_id`` -1) or one sequence from ``io``; returns the bytes read.

        Raises ``ValueError`` on any problem; see the module docstring for what a failed restore leaves.
        """
        del flags
        self.book.check_seq(seq_id, allow_all=True)
        self.check_layout(data=True)
        start = io.tell()
        n_stream = io.u32("n_stream")
        check_eq("n_stream", n_stream, self.book.n_stream)
        try:
            # host memory: only the bytes the state does not write are zeroed, stream by stream (below); other
            # buffers are cleared whole (not every backend implements ggml_backend_tensor_memset)
            zero_later = seq_id == -1 and all(_is_host(t) for layer in self.tensors.layers for t in (layer.k, layer.v))
            self._empty(seq_id, data=not zero_later)
            ex = self._state_expect(seq_id)
            holder = -1
            for s in range(n_stream):
                st = parse_stream(io, s, ex, base=start)
                if zero_later:
                    self._zero_data_from(s, st.cell_count)
                if st.cell_count == 0:
                    continue
                if seq_id >= 0:
                    holder = _single_holder(s, st.cell_count, holder)
                end = io.tell()
                self._restore_stream(io, st, s, seq_id, start)
                io.seek(end)
        except BaseException:
            self.undo_restore(seq_id)
            raise
        return io.tell() - start

    def state_check(self, io: StateReader, seq_id: int = -1) -> int:
        """Every check :meth:`state_read` makes before it places cells, changing nothing: the stream count, each
        stream against this cache (cells, layer headers, that every layer's data is there) and, for one sequence,
        cells in one stream only.  Returns the cells the state holds; ``io`` is left after the state.  ValueError as
        :meth:`state_read` (a restore may still find no room for the cells)."""
        self.book.check_seq(seq_id, allow_all=True)
        self.check_layout(data=True)
        start = io.tell()
        check_eq("n_stream", io.u32("n_stream"), self.book.n_stream)
        ex = self._state_expect(seq_id)
        n_cells, holder = 0, -1
        for s in range(self.book.n_stream):
            st = parse_stream(io, s, ex, base=start)
            if st.cell_count and seq_id >= 0:
                holder = _single_holder(s, st.cell_count, holder)
            n_cells += st.cell_count
        return n_cells

    def state_size(self, seq_id: int = -1) -> int:
        """Bytes of :meth:`state_write` (``llama_state_seq_get_size``)."""
        io = CountingWriter()
        self.state_write(io, seq_id)
        return io.n_bytes()

    def state_save(self, seq_id: int = -1) -> bytes:
        """The state of the whole cache or of one sequence, as ``bytes`` (tensor data copied once, into it)."""
        n = self.state_size(seq_id)
        if n < 16:
            small = BytesWriter()
            self.state_write(small, seq_id)
            return small.getvalue()
        out, view = G.new_bytes(n)
        w = BufferWriter(view)
        self.state_write(w, seq_id)
        if w.n_bytes() != n:
            raise RuntimeError(f"state of {w.n_bytes()} bytes, {n} announced")
        return out

    def state_load(self, data: Any, seq_id: int = -1) -> int:
        """Restore from a bytes-like object holding exactly one state; returns its length.

        Trailing bytes are refused (``ValueError``), with the cache left as after a failed restore.
        """
        io = BytesReader(data)
        n = self.state_read(io, seq_id)
        extra = io.remaining()
        if extra:
            self.undo_restore(seq_id)
            raise ValueError(f"state is {n} bytes followed by {extra} trailing bytes, expected none")
        return n

    def undo_restore(self, seq_id: int) -> None:
        """What a failed restore leaves: an empty cache (whole restore) or the sequence removed."""
        self._empty(seq_id, data=True)

    def _empty(self, seq_id: int, data: bool) -> None:
        """Empty the whole cache (``seq_id`` -1, zeroing the data when ``data``) or remove one sequence."""
        if seq_id == -1:
            self.book.clear()
            if data:
                self.tensors.clear_data()
        else:
            self.book.seq_rm(seq_id, -1, -1)

    # ------------------------------------------------------------------ writing

    def check_layout(self, data: bool) -> None:
        """ValueError when this cache's state cannot be written or read (``data``: the K/V rows too)."""
        t = self.tensors
        if t.v_trans and G.blck_size(t.type_v) != 1:
            raise ValueError(f"a transposed V cache of block type {G.type_name(t.type_v)} has no per-element "
                             f"layout to save; use v_trans=False (flash attention) or a V type of block size 1")
        if data and self.hparams.no_alloc:
            raise ValueError("the cache was created with no_alloc: its tensors hold no data to save or restore")

    def _cells_meta(self, cells: KVCells, idxs: np.ndarray, seq_id: int) -> Iterable[np.ndarray]:
        """The cell records of ``idxs`` (ascending cells), as arrays of little-endian int32."""
        pos = cells.pos_array[idxs]
        n, n_seq_max = idxs.size, self.book.n_seq_max
        if seq_id >= 0:
            if seq_id < n_seq_max:
                rec = np.empty((n, 3), "<i4")
                rec[:, 2] = seq_id
                rec[:, 1] = 1
            else:
                rec = np.zeros((n, 2), "<i4")
            rec[:, 0] = pos
            yield rec
            return
        for a in range(0, n, _META_CHUNK):
            counts, ids = cells.seq_lists(idxs[a:a + _META_CHUNK], n_seq_max)
            p = pos[a:a + _META_CHUNK]
            if ids.size == p.size and (counts == 1).all():
                rec = np.empty((p.size, 3), "<i4")
                rec[:, 0] = p
                rec[:, 1] = 1
                rec[:, 2] = ids
                yield rec
                continue
            rec_len = 2 + counts
            starts = np.cumsum(rec_len) - rec_len
            out = np.empty(int(rec_len.sum()), "<i4")
            out[starts] = p
            out[starts + 1] = counts
            rows = np.repeat(np.arange(p.size), counts)
            first = np.cumsum(counts) - counts
            out[starts[rows] + 2 + (np.arange(rows.size) - first[rows])] = ids
            yield out

    def _write_stream_data(self, io: StateWriter, s: int, idxs: np.ndarray) -> None:
        hp, t = self.hparams, self.tensors
        kv = self.book.v_cells[s].size()
        runs = _runs(idxs)
        io.write(DATA_HDR.pack(int(t.v_trans), len(t.layers)))
        for layer in t.layers:
            k = layer.k_stream[s]
            kt = int(G.ttype(k))
            k_row = G.row_size(kt, hp.n_embd_k_gqa(layer.il))
            io.write(ROW_HDR.pack(kt, k_row))
            _write_cells(io, k, idxs, runs, k_row, 1, kv)
        for layer in t.layers:
            v = layer.v_stream[s]
            vt = int(G.ttype(v))
            n_embd_v = hp.n_embd_v_gqa(layer.il)
            if not t.v_trans:
                v_row = G.row_size(vt, n_embd_v)
                io.write(ROW_HDR.pack(vt, v_row))
                _write_cells(io, v, idxs, runs, v_row, 1, kv)
            else:
                el = G.type_size(vt)
                io.write(COL_HDR.pack(vt, el, n_embd_v))
                _write_cells(io, v, idxs, runs, el, n_embd_v, kv)

    # ------------------------------------------------------------------ reading

    def _state_expect(self, seq_id: int) -> Expect:
        hp, book, v_trans = self.hparams, self.book, self.tensors.v_trans
        layers = []
        for layer in self.tensors.layers:
            kt, vt = int(G.ttype(layer.k)), int(G.ttype(layer.v))
            n_embd_v = hp.n_embd_v_gqa(layer.il)
            layers.append(LayerExpect(
                il=layer.il, k_type=kt, k_row=G.row_size(kt, hp.n_embd_k_gqa(layer.il)), v_type=vt,
                v_row=0 if v_trans else G.row_size(vt, n_embd_v), v_el=G.type_size(vt), n_embd_v=n_embd_v))
        size = book.get_size()
        if seq_id >= 0:
            # the blob's own sequence id is replaced by seq_id; it only has to be a sequence id at all
            return Expect(cell_max=size, n_seq_id_max=1, seq_hi=LLAMA_MAX_SEQ, v_trans=v_trans, layers=layers,
                          single=True)
        seq_stream = book.seq_to_stream[:book.n_seq_max] if book.n_stream > 1 else None
        return Expect(cell_max=size, n_seq_id_max=book.n_seq_max, seq_hi=book.n_seq_max, v_trans=v_trans,
                      layers=layers, seq_stream=seq_stream)

    def _zero_data_from(self, s: int, n: int) -> None:
        """Zero the data of cells ``n..`` of stream ``s`` in every layer (and transposed V's padding channels) of a
        cache in host memory: with the first ``n`` cells then restored, the data end as after ``clear(true)``."""
        hp, v_trans = self.hparams, self.tensors.v_trans
        kv = self.book.v_cells[s].size()
        for layer in self.tensors.layers:
            for t in (layer.k_stream[s], layer.v_stream[s]) if not v_trans else (layer.k_stream[s],):
                row = G.nb(t)[1]
                if n < kv:
                    _host_view(t, kv * row)[n * row:] = 0
            if v_trans:
                v = layer.v_stream[s]
                el = G.type_size(G.ttype(v))
                n_rows, n_max = hp.n_embd_v_gqa(layer.il), G.ne(v)[0]
                cols = _host_view(v, n_max * kv * el).reshape(n_max, kv * el)
                cols[n_rows:] = 0
                cols[:n_rows, n * el:] = 0

    def _restore_stream(self, io: StateReader, st: StreamState, s: int, seq_id: int, base: int) -> None:
        """Place the (checked) cells of ``st`` and read their rows."""
        if seq_id == -1:
            strm, idxs = s, self.book.restore_stream(s, st.pos, st.seq_matrix())
        else:
            strm, idxs = self.book.restore_seq(seq_id, st.pos)
        hp, t = self.hparams, self.tensors
        kv = self.book.v_cells[strm].size()
        runs = _runs(idxs)
        for layer, L in zip(t.layers, st.layers):
            io.seek(L.k_offset + base)
            _read_cells(io.read(L.k_nbytes, f"layer {layer.il} K data"), layer.k_stream[strm], idxs, runs,
                        L.k_row_size, 1, kv)
        for layer, L in zip(t.layers, st.layers):
            io.seek(L.v_offset + base)
            src = io.read(L.v_nbytes, f"layer {layer.il} V data")
            if not t.v_trans:
                _read_cells(src, layer.v_stream[strm], idxs, runs, L.v_row_size, 1, kv)
            else:
                _read_cells(src, layer.v_stream[strm], idxs, runs, L.v_el_size, hp.n_embd_v_gqa(layer.il), kv)


def _single_holder(s: int, cell_count: int, holder: int) -> int:
    """Stream ``s`` has cells of a single-sequence state: it is their stream (ValueError if another one had them)."""
    if holder >= 0:
        raise ValueError(f"stream {s}: cell_count is {cell_count}, expected 0 (a single-sequence state has cells in "
                         f"one stream, and stream {holder} had them)")
    return s


def _runs(idxs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs of consecutive cells in ``idxs``: (first position in idxs, first cell, length)."""
    if idxs.size == 0:
        e = np.empty(0, np.int64)
        return e, e, e
    brk = np.flatnonzero(np.diff(idxs) != 1) + 1
    k0 = np.concatenate(([0], brk)).astype(np.int64)
    length = np.diff(np.append(k0, idxs.size))
    return k0, idxs[k0].astype(np.int64), length


def _is_host(t: Any) -> bool:
    """Whether the CPU can read and write ``t`` in place (one place, so that tests can pose as a device)."""
    return G.is_host(t)


def _host_view(t: Any, nbytes: int) -> np.ndarray | None:
    """The first ``nbytes`` of ``t`` as a writable uint8 array over its memory, or None for a device buffer."""
    if not _is_host(t):
        return None
    return G.host_bytes(t, 0, nbytes)


def _write_cells(io: StateWriter, t: Any, idxs: np.ndarray, runs: tuple, unit: int, n_rows: int, kv: int) -> None:
    """For each of ``n_rows`` rows of ``kv * unit`` bytes of ``t``, the ``unit``-byte slots of the cells ``idxs``."""
    cnt = idxs.size
    region = io.reserve(n_rows * cnt * unit)
    if region is None:
        return
    k0, c0, length = runs
    if n_rows * k0.size <= _CALL_LIMIT:
        ptr = region.ctypes.data
        o = 0
        segs = list(zip((c0 * unit).tolist(), (length * unit).tolist()))
        stride = kv * unit
        for j in range(n_rows):
            for off, size in segs:
                G.ggml_backend_tensor_get(t, ptr + o, j * stride + off, size)
                o += size
        return
    span = n_rows * kv * unit
    src = _host_view(t, span)
    if src is None:
        src = np.empty(span, np.uint8)
        G.ggml_backend_tensor_get(t, src.ctypes.data, 0, span)
    src3 = src.reshape(n_rows, kv, unit)
    out3 = region.reshape(n_rows, cnt, unit)
    if k0.size == 1:
        a = int(c0[0])
        out3[...] = src3[:, a:a + cnt, :]
    else:
        np.take(src3, idxs, axis=1, out=out3, mode="clip")


def _read_cells(src: np.ndarray, t: Any, idxs: np.ndarray, runs: tuple, unit: int, n_rows: int, kv: int) -> None:
    """The inverse of :func:`_write_cells`: ``src`` (``n_rows * len(idxs) * unit`` bytes) into the cells' slots."""
    cnt = idxs.size
    k0, c0, length = runs
    if n_rows * k0.size <= _CALL_LIMIT:
        ptr = src.ctypes.data
        stride = kv * unit
        segs = list(zip((k0 * unit).tolist(), (c0 * unit).tolist(), (length * unit).tolist()))
        for j in range(n_rows):
            row = ptr + j * cnt * unit
            for so, do, size in segs:
                G.ggml_backend_tensor_set(t, row + so, j * stride + do, size)
        return
    span = n_rows * kv * unit
    dst = _host_view(t, span)
    host = dst is not None
    if not host:
        dst = np.empty(span, np.uint8)
        G.ggml_backend_tensor_get(t, dst.ctypes.data, 0, span)
    dst3 = dst.reshape(n_rows, kv, unit)
    src3 = src.reshape(n_rows, cnt, unit)
    if k0.size == 1:
        a = int(c0[0])
        dst3[:, a:a + cnt, :] = src3
    else:
        dst3[:, idxs, :] = src3
    if not host:
        G.ggml_backend_tensor_set(t, dst.ctypes.data, 0, span)
