"""Saving and restoring the KV cache: llama.cpp's ``state_write``/``state_read``, byte for byte.

The cache's state is a blob that llama.cpp itself writes and reads (``llama_state_seq_get_data`` and
``llama_state_seq_set_data`` of a model whose memory is a plain ``llama_kv_cache`` give exactly this blob, with
nothing before or after it).  :class:`StateMixin` adds the methods to :class:`~kvcache_ggml.cache.KVCache`; the
writers and readers play the roles of llama.cpp's ``llama_io_write_i``/``llama_io_read_i``.

Format
------
Every integer is little-endian (llama.cpp writes host order; every platform it builds for is little-endian)::

    state      := u32 n_stream, stream[n_stream]
    stream     := u32 cell_count, then only when cell_count > 0: cell[cell_count], data
    cell       := i32 pos, u32 n_seq_id, i32 seq_id[n_seq_id]
    data       := u32 v_trans, u32 n_layer, k_layer[n_layer], v_layer[n_layer]
    k_layer    := i32 k_type, u64 k_row_size, u8 k_rows[cell_count * k_row_size]
    v_layer    := i32 v_type, u64 v_row_size, u8 v_rows[cell_count * v_row_size]            (v_trans == 0)
                | i32 v_type, u32 v_el_size, u32 n_embd_v_gqa,
                  u8 v_cols[n_embd_v_gqa * cell_count * v_el_size]                          (v_trans == 1)

- ``n_stream``: the streams of the cache (1 when unified, else ``n_seq_max``); every stream is listed.
- ``cell_count``: the non-empty cells of the stream that are written -- all of them for a whole-cache state, those
  holding the sequence for a single-sequence state -- in ascending cell order.  The cells' indices are not stored:
  a restore packs them.
- ``cell``: the position of the cell and its sequences (ids below the cache's ``n_seq_max``, ascending; for a
  single-sequence state only that sequence, so ``n_seq_id`` is 1).  M-RoPE 2-D positions are not stored (the
  seed does not store them yet).
- ``k_type``/``v_type``: ``enum ggml_type`` of the tensor; ``k_row_size``/``v_row_size``: ``ggml_row_size(type,
  n_embd_k_gqa(il))`` (resp. ``n_embd_v_gqa(il)``); ``v_el_size``: ``ggml_type_size(v_type)``.
- ``k_rows``: row ``i`` is the K row of the ``i``-th written cell.  ``v_cols`` (transposed V): for each channel
  ``j`` in ``[0, n_embd_v_gqa)``, the ``cell_count`` elements of channel ``j`` of the written cells.
- The layers are the cache's kept layers, in order; the K layers of all layers come before the V layers.

A *sequence state file* (``llama_state_seq_save_file``) is ``u32 magic 0x67677371 ('ggsq'), u32 version 2,
u32 n_token, i32 token[n_token]`` followed by a single-sequence state.  A whole-context *session file*
(``llama_state_save_file``; only read here, by :func:`parse_state`) is ``u32 magic 0x6767736e ('ggsn'),
u32 version 9, u32 n_token, i32 token[n_token], u32 len, char arch[len]`` followed by a whole-cache state.

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
state with cells in two streams, and bytes after the state in :meth:`StateMixin.state_load`).
"""
from __future__ import annotations

import ctypes
import mmap
import os
import struct
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Iterable

import numpy as np

from . import _ggml as G
from ._consts import LLAMA_MAX_SEQ
from .hparams import LLAMA_MAX_LAYERS

__all__ = [
    "StateMixin", "StateWriter", "StateReader", "CountingWriter", "BytesWriter", "BufferWriter", "StreamWriter",
    "FileWriter", "BytesReader", "StreamReader", "StateInfo", "StreamState", "LayerState", "CellRange",
    "parse_state", "read_state_file", "save_seq_file", "load_seq_file",
    "STATE_SEQ_MAGIC", "STATE_SEQ_VERSION", "SESSION_MAGIC", "SESSION_VERSION",
]

#: ``LLAMA_STATE_SEQ_MAGIC`` ('ggsq') and ``LLAMA_STATE_SEQ_VERSION`` of llama.h
STATE_SEQ_MAGIC = 0x67677371
STATE_SEQ_VERSION = 2
#: ``LLAMA_SESSION_MAGIC`` ('ggsn') and ``LLAMA_SESSION_VERSION`` of llama.h
SESSION_MAGIC = 0x6767736E
SESSION_VERSION = 9

_U32 = struct.Struct("<I")
_DATA_HDR = struct.Struct("<II")        # v_trans, n_layer
_ROW_HDR = struct.Struct("<iQ")         # type, row size
_COL_HDR = struct.Struct("<iII")        # type, element size, n_embd_v_gqa
_FILE_HDR = struct.Struct("<III")       # magic, version, n_token

# above this many ggml_backend_tensor_get/set calls per layer, rows are gathered/scattered with numpy instead
_CALL_LIMIT = 256
# cells per chunk when writing cells that hold several sequences (bounds a [chunk, n_seq_max] bool matrix)
_META_CHUNK = 1 << 16
_I32_MAX = 2**31 - 1


def _raw(data: Any) -> memoryview:
    """A flat byte view of a bytes-like object (numpy arrays included, which ``bytearray +=`` would broadcast)."""
    mv = memoryview(data)
    return mv if mv.ndim == 1 and mv.format in ("B", "b", "c") else mv.cast("B")


def _magic_text(m: int) -> str:
    return m.to_bytes(4, "big").decode("latin-1")


# ====================================================================================================== writers

class StateWriter:
    """Where a state goes (llama.cpp's ``llama_io_write_i``).

    Subclasses implement :meth:`write` (bytes), :meth:`reserve` (a writable region of the output that the caller
    fills, or None when the writer keeps no data) and :meth:`n_bytes`.  :meth:`write_tensor` copies tensor bytes
    with ``ggml_backend_tensor_get`` straight into the reserved region.
    """

    def write(self, data: Any) -> None:
        raise NotImplementedError

    def reserve(self, n: int) -> np.ndarray | None:
        raise NotImplementedError

    def n_bytes(self) -> int:
        raise NotImplementedError

    def write_tensor(self, t: Any, offset: int, size: int) -> None:
        """Bytes ``[offset, offset + size)`` of tensor ``t``."""
        region = self.reserve(size)
        if region is not None and size:
            G.ggml_backend_tensor_get(t, region.ctypes.data, offset, size)

    def flush(self) -> None:
        """Push what is pending to the destination (a no-op for in-memory writers)."""


class CountingWriter(StateWriter):
    """Counts the bytes only (llama.cpp's ``llama_io_write_dummy``): ``state_size``."""

    def __init__(self) -> None:
        self._n = 0

    def write(self, data: Any) -> None:
        self._n += memoryview(data).nbytes

    def reserve(self, n: int) -> None:
        self._n += n
        return None

    def write_tensor(self, t: Any, offset: int, size: int) -> None:
        self._n += size

    def n_bytes(self) -> int:
        return self._n


class BytesWriter(StateWriter):
    """Appends to a ``bytearray`` (``self.buf``; a new one unless given)."""

    def __init__(self, buf: bytearray | None = None) -> None:
        self.buf = bytearray() if buf is None else buf
        self._start = len(self.buf)

    def write(self, data: Any) -> None:
        self.buf += _raw(data)

    def reserve(self, n: int) -> np.ndarray:
        start = len(self.buf)
        try:
            self.buf.extend(bytes(n))
        except BufferError:
            raise RuntimeError("BytesWriter: a region returned by reserve() is still referenced; drop it before "
                               "writing more") from None
        return np.frombuffer(self.buf, np.uint8, count=n, offset=start)

    def n_bytes(self) -> int:
        return len(self.buf) - self._start

    def getvalue(self) -> bytes:
        return bytes(self.buf[self._start:])


class BufferWriter(StateWriter):
    """Fills a preallocated writable buffer (llama.cpp's ``llama_io_write_buffer``); ValueError when it is full."""

    def __init__(self, buf: Any) -> None:
        self._a = np.frombuffer(buf, np.uint8) if not isinstance(buf, np.ndarray) else buf.reshape(-1).view(np.uint8)
        if not self._a.flags.writeable:
            raise ValueError("BufferWriter needs a writable buffer (bytearray, memoryview, numpy array)")
        self._p = 0

    def _take(self, n: int) -> np.ndarray:
        if n > self._a.size - self._p:
            raise ValueError(f"state buffer too small: writing {n} bytes at offset {self._p}, "
                             f"{self._a.size - self._p} left of {self._a.size}")
        region = self._a[self._p:self._p + n]
        self._p += n
        return region

    def write(self, data: Any) -> None:
        src = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
        self._take(src.size)[...] = src

    def reserve(self, n: int) -> np.ndarray:
        return self._take(n)

    def n_bytes(self) -> int:
        return self._p


class StreamWriter(StateWriter):
    """Writes to a binary file object (llama.cpp's ``llama_io_write_file``).

    Tensor bytes of host buffers go to the file straight from the tensor memory; other data pass through one
    reusable scratch buffer, written out on the next call or on :meth:`flush`.
    """

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self._n = 0
        self._scratch = np.empty(0, np.uint8)
        self._pending = 0

    def _push(self) -> None:
        if self._pending:
            self.f.write(memoryview(self._scratch)[:self._pending])
            self._pending = 0

    def write(self, data: Any) -> None:
        self._push()
        mv = _raw(data)
        self.f.write(mv)
        self._n += mv.nbytes

    def reserve(self, n: int) -> np.ndarray:
        self._push()
        if self._scratch.size < n:
            self._scratch = np.empty(max(n, 2 * self._scratch.size), np.uint8)
        self._pending = n
        self._n += n
        return self._scratch[:n]

    def write_tensor(self, t: Any, offset: int, size: int) -> None:
        if size and _is_host(t):
            self._push()
            self.f.write((ctypes.c_char * size).from_address(G.data_ptr(t) + offset))
            self._n += size
            return
        super().write_tensor(t, offset, size)

    def flush(self) -> None:
        self._push()

    def n_bytes(self) -> int:
        return self._n


class FileWriter(StreamWriter):
    """A :class:`StreamWriter` on a path (opened ``wb``, closed by :meth:`close` / ``with``) or a file object."""

    def __init__(self, path_or_file: str | os.PathLike | BinaryIO) -> None:
        self._own = isinstance(path_or_file, (str, bytes, os.PathLike))
        super().__init__(open(path_or_file, "wb") if self._own else path_or_file)  # noqa: SIM115

    def close(self) -> None:
        self.flush()
        if self._own:
            self.f.close()

    def __enter__(self) -> "FileWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ====================================================================================================== readers

class StateReader:
    """Where a state comes from (llama.cpp's ``llama_io_read_i``).

    Positions are relative to where the reader started.  :meth:`read` returns a uint8 array of exactly ``n`` bytes
    (a view of the source when it is in memory) or raises ``ValueError`` naming what was being read.
    """

    def read(self, n: int, what: str) -> np.ndarray:
        raise NotImplementedError

    def peek(self, n: int) -> np.ndarray:
        """Up to ``n`` bytes from the current position, without consuming them."""
        raise NotImplementedError

    def skip(self, n: int, what: str) -> None:
        raise NotImplementedError

    def tell(self) -> int:
        raise NotImplementedError

    def seek(self, pos: int) -> None:
        raise NotImplementedError

    def remaining(self) -> int:
        raise NotImplementedError

    def n_bytes(self) -> int:
        """Bytes read so far (the current position)."""
        return self.tell()

    def read_to(self, dst: Any, n: int, what: str) -> None:
        """Copy the next ``n`` bytes into the writable buffer ``dst``."""
        np.frombuffer(dst, np.uint8, count=n)[...] = self.read(n, what)

    def u32(self, what: str) -> int:
        return int(self.read(4, what).view("<u4")[0])

    def i32(self, what: str) -> int:
        return int(self.read(4, what).view("<i4")[0])

    def u64(self, what: str) -> int:
        return int(self.read(8, what).view("<u8")[0])

    def _truncated(self, what: str, n: int) -> ValueError:
        return ValueError(f"truncated state: {what} needs {n} bytes at offset {self.tell()}, "
                          f"found {self.remaining()}")


class BytesReader(StateReader):
    """Reads a bytes-like object (bytes, bytearray, memoryview, mmap, numpy array) in place, from ``offset``."""

    def __init__(self, data: Any, offset: int = 0) -> None:
        a = data if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)
        self._a = a.reshape(-1).view(np.uint8)
        if not 0 <= offset <= self._a.size:
            raise ValueError(f"offset {offset} out of range [0, {self._a.size}]")
        self._start = offset
        self._p = offset

    def read(self, n: int, what: str) -> np.ndarray:
        if n > self._a.size - self._p:
            raise self._truncated(what, n)
        view = self._a[self._p:self._p + n]
        self._p += n
        return view

    def peek(self, n: int) -> np.ndarray:
        return self._a[self._p:self._p + n]

    def skip(self, n: int, what: str) -> None:
        if n > self._a.size - self._p:
            raise self._truncated(what, n)
        self._p += n

    def tell(self) -> int:
        return self._p - self._start

    def seek(self, pos: int) -> None:
        if not 0 <= pos <= self._a.size - self._start:
            raise ValueError(f"seek to {pos} outside [0, {self._a.size - self._start}]")
        self._p = self._start + pos

    def remaining(self) -> int:
        return self._a.size - self._p


def _seekable(f: Any) -> bool:
    try:
        return bool(f.seekable())
    except (AttributeError, OSError, ValueError):
        return False


class StreamReader(StateReader):
    """Reads a binary file object (llama.cpp's ``llama_io_read_file``) from its current position.

    A seekable file is read in place (checks seek ahead over the data, then come back).  A non-seekable stream
    (a pipe, a socket) is read to its end first.
    """

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self._mem: BytesReader | None = None
        if _seekable(f):
            self._base = f.tell()
            self._size = f.seek(0, os.SEEK_END) - self._base
            f.seek(self._base)
            self._p = 0
        else:
            self._mem = BytesReader(f.read())

    def read(self, n: int, what: str) -> np.ndarray:
        if self._mem is not None:
            return self._mem.read(n, what)
        if n > self._size - self._p:
            raise self._truncated(what, n)
        out = np.empty(n, np.uint8)
        got = self._fill(out)
        self._p += got
        if got < n:
            raise ValueError(f"truncated state: {what} needs {n} bytes at offset {self._p - got}, the file gave "
                             f"{got}")
        return out

    def _fill(self, out: np.ndarray) -> int:
        mv = memoryview(out)
        got = 0
        readinto = getattr(self.f, "readinto", None)
        while got < out.size:
            if readinto is not None:
                k = readinto(mv[got:])
            else:
                chunk = self.f.read(out.size - got)
                k = len(chunk)
                mv[got:got + k] = chunk
            if not k:
                break
            got += k
        return got

    def peek(self, n: int) -> np.ndarray:
        if self._mem is not None:
            return self._mem.peek(n)
        n = min(n, self._size - self._p)
        out = np.empty(n, np.uint8)
        got = self._fill(out)
        self.f.seek(self._base + self._p)
        return out[:got]

    def skip(self, n: int, what: str) -> None:
        if self._mem is not None:
            return self._mem.skip(n, what)
        if n > self._size - self._p:
            raise self._truncated(what, n)
        self._p += n
        self.f.seek(self._base + self._p)

    def tell(self) -> int:
        return self._mem.tell() if self._mem is not None else self._p

    def seek(self, pos: int) -> None:
        if self._mem is not None:
            return self._mem.seek(pos)
        if not 0 <= pos <= self._size:
            raise ValueError(f"seek to {pos} outside [0, {self._size}]")
        self._p = pos
        self.f.seek(self._base + pos)

    def remaining(self) -> int:
        return self._mem.remaining() if self._mem is not None else self._size - self._p


# ====================================================================================================== parsed form

@dataclass(slots=True)
class LayerState:
    """The headers of one layer of a stream, and where its data lie (offsets from the start of the state)."""

    index: int                          # position among the state's layers
    k_type: int                         # enum ggml_type of K
    k_row_size: int                     # bytes of one K row
    k_offset: int                       # first byte of the K rows
    k_nbytes: int                       # bytes of K data (cell_count * k_row_size)
    v_type: int = -1                    # enum ggml_type of V
    v_row_size: int | None = None       # bytes of one V row (v_trans == 0)
    v_el_size: int | None = None        # bytes of one V element (v_trans == 1)
    n_embd_v_gqa: int | None = None     # V channels (v_trans == 1)
    v_offset: int = 0                   # first byte of the V data
    v_nbytes: int = 0                   # bytes of V data


@dataclass(slots=True)
class CellRange:
    """Consecutive cells of a stream with consecutive positions and the same sequences."""

    pos0: int                           # first position
    pos1: int                           # last position (inclusive)
    seqs: tuple[int, ...]               # the sequences of each of these cells
    n_cells: int                        # how many cells


@dataclass(slots=True)
class StreamState:
    """One stream of a state: its cells and its layers."""

    index: int                                      # stream number
    offset: int                                     # first byte (the cell_count field)
    cell_count: int                                 # cells written
    pos: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))         # int32 [cell_count]
    n_seq_id: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint32))   # uint32 [cell_count]
    seq_ids: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))     # int32, every cell's ids in turn
    v_trans: bool | None = None                     # V transposed (None without cells)
    layers: list[LayerState] = field(default_factory=list)
    nbytes: int = 4                                 # bytes of the stream in the state

    def seq_matrix(self) -> np.ndarray:
        """int32 [cell_count, max n_seq_id]: each cell's sequence ids, padded with -1 (the ubatch layout)."""
        n = self.cell_count
        if n == 0:
            return np.empty((0, 1), np.int32)
        if self.seq_ids.size == n:
            return self.seq_ids.reshape(n, 1)
        counts = self.n_seq_id.astype(np.int64)
        width = max(int(counts.max()), 1)
        out = np.full((n, width), -1, np.int32)
        rows = np.repeat(np.arange(n), counts)
        first = np.cumsum(counts) - counts
        out[rows, np.arange(rows.size) - first[rows]] = self.seq_ids
        return out

    def cell_ranges(self) -> list[CellRange]:
        """The cells compressed into runs of consecutive positions with the same sequences."""
        n = self.cell_count
        if n == 0:
            return []
        mat = self.seq_matrix()
        if mat.shape[1] == 1:
            key = mat[:, 0].astype(np.int64)
        else:
            _, key = np.unique(np.sort(mat, axis=1), axis=0, return_inverse=True)
            key = key.reshape(-1)
        pos = self.pos.astype(np.int64)
        brk = np.flatnonzero((np.diff(pos) != 1) | (np.diff(key) != 0)) + 1
        starts = np.concatenate(([0], brk))
        ends = np.append(brk, n)
        out = []
        for a, b in zip(starts.tolist(), ends.tolist()):
            row = mat[a]
            out.append(CellRange(int(pos[a]), int(pos[b - 1]), tuple(sorted(int(q) for q in row[row >= 0])), b - a))
        return out


@dataclass(slots=True)
class StateInfo:
    """What :func:`parse_state` finds in a state, a sequence state file or a session file."""

    kind: str                                       # "state" (a bare blob), "seq" ('ggsq') or "session" ('ggsn')
    size: int                                       # bytes of the whole input
    offset: int                                     # where the KV state starts
    nbytes: int                                     # bytes of the KV state
    n_stream: int
    streams: list[StreamState]
    trailing: int = 0                               # bytes after the state
    magic: int | None = None                        # file magic (files only)
    version: int | None = None                      # file version (files only)
    tokens: np.ndarray | None = None                # int32 tokens (files only)
    arch: str | None = None                         # model architecture (session files only)

    def to_dict(self) -> dict:
        """A JSON-ready description (tokens, cells as ranges, layers as types and sizes)."""
        d: dict[str, Any] = {"kind": self.kind, "size": self.size, "state_offset": self.offset,
                             "state_nbytes": self.nbytes, "trailing": self.trailing, "n_stream": self.n_stream}
        if self.magic is not None:
            d.update(magic=f"0x{self.magic:08x}", magic_text=_magic_text(self.magic), version=self.version,
                     n_token=int(self.tokens.size), tokens=self.tokens.tolist())
        if self.arch is not None:
            d["arch"] = self.arch
        streams = []
        for st in self.streams:
            sd: dict[str, Any] = {"index": st.index, "offset": st.offset, "nbytes": st.nbytes,
                                  "cell_count": st.cell_count}
            if st.cell_count:
                sd["cells"] = [{"pos": [r.pos0, r.pos1], "seqs": list(r.seqs), "n_cells": r.n_cells}
                               for r in st.cell_ranges()]
                sd["v_trans"] = bool(st.v_trans)
                sd["layers"] = [_layer_dict(L) for L in st.layers]
            streams.append(sd)
        d["streams"] = streams
        return d


def _type_text(t: int) -> str:
    try:
        return G.type_name(t)
    except ValueError:
        return f"type {t}"


def _layer_dict(L: LayerState) -> dict:
    d: dict[str, Any] = {"index": L.index, "k_type": _type_text(L.k_type), "k_row_size": L.k_row_size,
                         "k_nbytes": L.k_nbytes, "v_type": _type_text(L.v_type), "v_nbytes": L.v_nbytes}
    if L.v_row_size is not None:
        d["v_row_size"] = L.v_row_size
    else:
        d.update(v_el_size=L.v_el_size, n_embd_v_gqa=L.n_embd_v_gqa)
    return d


# ====================================================================================================== parsing

@dataclass(slots=True, frozen=True)
class _LayerExpect:
    il: int
    k_type: int
    k_row: int
    v_type: int
    v_row: int
    v_el: int
    n_embd_v: int


@dataclass(slots=True)
class _Expect:
    """What a cache accepts; None fields are not checked."""

    cell_max: int                       # most cells of one stream
    n_seq_id_max: int                   # most sequences of one cell
    seq_hi: int                         # sequence ids must be < seq_hi
    v_trans: bool | None = None
    layers: list[_LayerExpect] | None = None
    seq_stream: np.ndarray | None = None  # whole restore of several streams: stream of each sequence id
    single: bool = False                # single-sequence restore


_PARSE_ONLY = _Expect(cell_max=2**32 - 1, n_seq_id_max=LLAMA_MAX_SEQ, seq_hi=LLAMA_MAX_SEQ)


def _parse_cells(io: StateReader, s: int, n: int, ex: _Expect) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ``n`` cell records of stream ``s``: (pos, n_seq_id, seq_ids).

    Records are variable-length; runs of records with the same n_seq_id are parsed as one structured array, so the
    common case (every cell in one sequence) takes one numpy view.
    """
    pos = np.empty(n, np.int32)
    nsq = np.empty(n, np.uint32)
    parts: list[np.ndarray] = []
    i = 0
    chunk = 1024
    while i < n:
        hdr = io.peek(8)
        if hdr.size < 8:
            io.read(8, f"stream {s} cell {i} (pos, n_seq_id)")
        k = int(hdr[4:8].view("<u4")[0])
        if not 1 <= k <= ex.n_seq_id_max:
            want = "1" if ex.n_seq_id_max == 1 else f"1..{ex.n_seq_id_max}"
            why = " (a single-sequence restore takes cells of one sequence)" if ex.single else ""
            raise ValueError(f"stream {s} cell {i}: n_seq_id is {k}, expected {want}{why}")
        rec = 8 + 4 * k
        m = min(n - i, io.remaining() // rec, chunk)
        if m == 0:
            io.read(rec, f"stream {s} cell {i} (pos, n_seq_id, {k} seq ids)")
        recs = io.peek(m * rec).view(np.dtype([("pos", "<i4"), ("n", "<u4"), ("seq", "<i4", (k,))]))
        same = recs["n"] == k
        if not same.all():
            m = int(np.argmin(same))
            recs = recs[:m]
            chunk = 64
        else:
            chunk = min(chunk * 2, 1 << 20)
        pos[i:i + m] = recs["pos"]
        nsq[i:i + m] = k
        parts.append(np.array(recs["seq"], np.int32).reshape(-1))
        io.skip(m * rec, f"stream {s} cells {i}..{i + m - 1}")
        i += m
    seq_ids = parts[0] if len(parts) == 1 else np.concatenate(parts)
    _check_cells(s, pos, nsq, seq_ids, ex)
    return pos, nsq, seq_ids


def _check_cells(s: int, pos: np.ndarray, nsq: np.ndarray, seq_ids: np.ndarray, ex: _Expect) -> None:
    # INT32_MAX is the "to the end" bound of seq_rm: a cell there could never be removed
    bad = np.flatnonzero((pos < 0) | (pos == _I32_MAX))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"stream {s} cell {i}: pos is {int(pos[i])}, expected in [0, {_I32_MAX})")
    counts = nsq.astype(np.int64)
    cell_of = np.repeat(np.arange(pos.size), counts) if seq_ids.size != pos.size else None
    bad = np.flatnonzero((seq_ids < 0) | (seq_ids >= ex.seq_hi))
    if bad.size:
        j = int(bad[0])
        i = j if cell_of is None else int(cell_of[j])
        raise ValueError(f"stream {s} cell {i}: seq_id is {int(seq_ids[j])}, expected in [0, {ex.seq_hi})")
    if cell_of is not None:
        key = cell_of * LLAMA_MAX_SEQ + seq_ids
        srt = np.sort(key)
        dup = np.flatnonzero(np.diff(srt) == 0)
        if dup.size:
            kk = int(srt[dup[0]])
            raise ValueError(f"stream {s} cell {kk // LLAMA_MAX_SEQ}: seq_id {kk % LLAMA_MAX_SEQ} is listed twice, "
                             f"expected distinct ids")
    if ex.seq_stream is not None:
        owner = ex.seq_stream[seq_ids]
        bad = np.flatnonzero(owner != s)
        if bad.size:
            j = int(bad[0])
            i = j if cell_of is None else int(cell_of[j])
            raise ValueError(f"stream {s} cell {i}: seq_id {int(seq_ids[j])} belongs to stream {int(owner[j])} "
                             f"of this cache, expected a sequence of stream {s}")


def _known_type(t: int, where: str) -> None:
    if not 0 <= t < G.GGML_TYPE_COUNT:
        raise ValueError(f"{where} is {t}, expected a ggml type in [0, {G.GGML_TYPE_COUNT})")
    try:
        G.parse_type(t)
    except ValueError:
        raise ValueError(f"{where} is {t}, which is no ggml type") from None


def _check_eq(where: str, found: int, expected: int, text=None) -> None:
    if found != expected:
        if text is not None:
            raise ValueError(f"{where} is {found} ({text(found)}), expected {expected} ({text(expected)})")
        raise ValueError(f"{where} is {found}, expected {expected}")


def _parse_stream(io: StateReader, s: int, ex: _Expect, base: int = 0) -> StreamState:
    """Read and check stream ``s`` (cells, every layer header, that every layer's data is there).

    The data are skipped: their offsets are recorded.  Offsets are ``io`` positions minus ``base``.
    """
    off0 = io.tell()
    n = io.u32(f"stream {s} cell_count")
    st = StreamState(index=s, offset=off0 - base, cell_count=n)
    if n == 0:
        return st
    if n > ex.cell_max:
        raise ValueError(f"stream {s}: cell_count is {n}, expected at most {ex.cell_max} (the cells of a stream "
                         f"of this cache)")
    if 12 * n > io.remaining():  # a cell takes at least 12 bytes: refuse before allocating for them
        raise ValueError(f"truncated state: stream {s} cell_count {n} needs at least {12 * n} bytes of cells at "
                         f"offset {io.tell()}, found {io.remaining()}")
    st.pos, st.n_seq_id, st.seq_ids = _parse_cells(io, s, n, ex)
    v_trans = io.u32(f"stream {s} v_trans")
    if v_trans not in (0, 1):
        raise ValueError(f"stream {s}: v_trans is {v_trans}, expected 0 or 1")
    if ex.v_trans is not None:
        _check_eq(f"stream {s}: v_trans", v_trans, int(ex.v_trans))
    st.v_trans = bool(v_trans)
    n_layer = io.u32(f"stream {s} n_layer")
    if ex.layers is not None:
        _check_eq(f"stream {s}: n_layer", n_layer, len(ex.layers))
    elif n_layer > LLAMA_MAX_LAYERS:
        raise ValueError(f"stream {s}: n_layer is {n_layer}, expected at most {LLAMA_MAX_LAYERS}")
    layers = [LayerState(index=li, k_type=0, k_row_size=0, k_offset=0, k_nbytes=0) for li in range(n_layer)]
    for li, L in enumerate(layers):
        e = ex.layers[li] if ex.layers is not None else None
        where = f"stream {s} layer {li if e is None else e.il}"
        L.k_type = io.i32(f"{where} k_type")
        if e is not None:
            _check_eq(f"{where}: k_type", L.k_type, e.k_type, _type_text)
        else:
            _known_type(L.k_type, f"{where}: k_type")
        L.k_row_size = io.u64(f"{where} k_row_size")
        if e is not None:
            _check_eq(f"{where}: k_row_size", L.k_row_size, e.k_row)
        L.k_offset, L.k_nbytes = io.tell() - base, n * L.k_row_size
        io.skip(L.k_nbytes, f"{where} K data ({n} rows of {L.k_row_size} bytes)")
    for li, L in enumerate(layers):
        e = ex.layers[li] if ex.layers is not None else None
        where = f"stream {s} layer {li if e is None else e.il}"
        L.v_type = io.i32(f"{where} v_type")
        if e is not None:
            _check_eq(f"{where}: v_type", L.v_type, e.v_type, _type_text)
        else:
            _known_type(L.v_type, f"{where}: v_type")
        if not v_trans:
            L.v_row_size = io.u64(f"{where} v_row_size")
            if e is not None:
                _check_eq(f"{where}: v_row_size", L.v_row_size, e.v_row)
            L.v_nbytes = n * L.v_row_size
            what = f"{where} V data ({n} rows of {L.v_row_size} bytes)"
        else:
            L.v_el_size = io.u32(f"{where} v_el_size")
            _check_eq(f"{where}: v_el_size", L.v_el_size, e.v_el if e is not None else G.type_size(L.v_type))
            L.n_embd_v_gqa = io.u32(f"{where} n_embd_v_gqa")
            if e is not None:
                _check_eq(f"{where}: n_embd_v_gqa", L.n_embd_v_gqa, e.n_embd_v)
            L.v_nbytes = L.n_embd_v_gqa * n * L.v_el_size
            what = f"{where} V data ({L.n_embd_v_gqa} channels of {n} elements of {L.v_el_size} bytes)"
        L.v_offset = io.tell() - base
        io.skip(L.v_nbytes, what)
    st.layers = layers
    st.nbytes = io.tell() - off0
    return st


def _as_u8(data: Any) -> np.ndarray:
    if isinstance(data, np.ndarray):
        return data.reshape(-1).view(np.uint8)
    return np.frombuffer(data, np.uint8)


def parse_state(data: Any) -> StateInfo:
    """Describe a state blob, a sequence state file or a session file (told apart by their first 4 bytes)
    without a cache.  Structural problems raise ``ValueError`` as a restore would."""
    a = _as_u8(data)
    io = BytesReader(a)
    info = StateInfo(kind="state", size=int(a.size), offset=0, nbytes=0, n_stream=0, streams=[])
    if a.size >= 4 and int(a[:4].view("<u4")[0]) in (STATE_SEQ_MAGIC, SESSION_MAGIC):
        magic = io.u32("magic")
        info.kind = "seq" if magic == STATE_SEQ_MAGIC else "session"
        info.magic = magic
        info.version = io.u32("version")
        want = STATE_SEQ_VERSION if magic == STATE_SEQ_MAGIC else SESSION_VERSION
        _check_eq(f"{_magic_text(magic)!r} file version", info.version, want)
        n_token = io.u32("n_token")
        info.tokens = io.read(4 * n_token, f"{n_token} tokens").view("<i4").astype(np.int32)
        if magic == SESSION_MAGIC:
            n_arch = io.u32("arch string length")
            info.arch = io.read(n_arch, "arch string").tobytes().decode("utf-8", "replace")
    info.offset = io.tell()
    n_stream = io.u32("n_stream")
    if not 1 <= n_stream <= LLAMA_MAX_SEQ:
        raise ValueError(f"n_stream is {n_stream}, expected 1..{LLAMA_MAX_SEQ}")
    info.n_stream = n_stream
    info.streams = [_parse_stream(io, s, _PARSE_ONLY, base=info.offset) for s in range(n_stream)]
    info.nbytes = io.tell() - info.offset
    info.trailing = io.remaining()
    return info


def read_state_file(path: str | os.PathLike) -> StateInfo:
    """:func:`parse_state` of a file, memory-mapped (the tensor data are not read)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return parse_state(b"")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            # every array of the result is a copy; the error's traceback (which holds views) must not outlive mm
            error = None
            try:
                info = parse_state(memoryview(mm))
            except ValueError as e:
                error = str(e)
    if error is not None:
        raise ValueError(error)
    return info


# ====================================================================================================== cell ranges

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
    """Whether the CPU can read and write ``t`` in place."""
    return G.is_host(t)


def _host_view(t: Any, nbytes: int) -> np.ndarray | None:
    """The first ``nbytes`` of ``t`` as a writable uint8 array over its memory, or None for a device buffer."""
    if not _is_host(t):
        return None
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(G.data_ptr(t)))


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


# ====================================================================================================== the mixin

def _new_bytes(n: int) -> tuple[bytes, np.ndarray]:
    """A new ``bytes`` of ``n`` (>= 2) bytes and a writable view of its memory, to fill before anyone sees it.

    (CPython: ``PyBytes_FromStringAndSize(NULL, n)`` -- the C API's way to build a bytes object in place; sizes 0
    and 1 would return shared singletons.)
    """
    assert n >= 2
    out = _PyBytes_FromStringAndSize(None, n)
    ptr = ctypes.cast(ctypes.c_char_p(out), ctypes.c_void_p).value
    return out, np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(ptr))


_PyBytes_FromStringAndSize = ctypes.pythonapi.PyBytes_FromStringAndSize
_PyBytes_FromStringAndSize.restype = ctypes.py_object
_PyBytes_FromStringAndSize.argtypes = (ctypes.c_char_p, ctypes.c_ssize_t)


class StateMixin:
    """``state_write``/``state_read`` of :class:`~kvcache_ggml.cache.KVCache` (see the module docstring)."""

    # ------------------------------------------------------------------ public API

    def state_write(self, io: StateWriter, seq_id: int = -1, flags: int = 0) -> int:
        """Write the whole cache (``seq_id`` -1) or one sequence to ``io``; returns the bytes written.

        ``flags`` (``llama_state_seq_flags``) are accepted and ignored, as by llama.cpp's KV cache.
        """
        del flags
        if not -1 <= seq_id < LLAMA_MAX_SEQ:  # the seed writes empty streams for an id no stream holds
            raise ValueError(f"seq_id {seq_id} out of range [0, {LLAMA_MAX_SEQ}) or -1 for all")
        self._check_state_layout(data=not isinstance(io, CountingWriter))
        n0 = io.n_bytes()
        io.write(_U32.pack(self.n_stream))
        for s, cells in enumerate(self.v_cells):
            mask = cells.pos_array >= 0
            if seq_id >= 0:
                mask &= cells.seq_mask(seq_id)
            idxs = np.flatnonzero(mask)
            io.write(_U32.pack(idxs.size))
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
        self._check_seq(seq_id, allow_all=True)
        self._check_state_layout(data=True)
        start = io.tell()
        n_stream = io.u32("n_stream")
        _check_eq("n_stream", n_stream, self.n_stream)
        try:
            # host memory: only the bytes the state does not write are zeroed, stream by stream (below); other
            # buffers are cleared whole (not every backend implements ggml_backend_tensor_memset)
            zero_later = seq_id == -1 and all(_is_host(t) for layer in self.layers for t in (layer.k, layer.v))
            if seq_id == -1:
                self.clear(not zero_later)
            else:
                self.seq_rm(seq_id, -1, -1)
            ex = self._state_expect(seq_id)
            holder = -1
            for s in range(n_stream):
                st = _parse_stream(io, s, ex, base=start)
                if zero_later:
                    self._zero_data_from(s, st.cell_count)
                if st.cell_count == 0:
                    continue
                if seq_id >= 0:
                    if holder >= 0:
                        raise ValueError(f"stream {s}: cell_count is {st.cell_count}, expected 0 (a single-sequence "
                                         f"state has cells in one stream, and stream {holder} had them)")
                    holder = s
                end = io.tell()
                self._restore_stream(io, st, s, seq_id, start)
                io.seek(end)
        except BaseException:
            if seq_id == -1:
                self.clear(True)
            else:
                self.seq_rm(seq_id, -1, -1)
            raise
        return io.tell() - start

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
        out, view = _new_bytes(n)
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
            if seq_id == -1:
                self.clear(True)
            else:
                self.seq_rm(seq_id, -1, -1)
            raise ValueError(f"state is {n} bytes followed by {extra} trailing bytes, expected none")
        return n

    # ------------------------------------------------------------------ writing

    def _check_state_layout(self, data: bool) -> None:
        if self.v_trans and G.blck_size(self.type_v) != 1:
            raise ValueError(f"a transposed V cache of block type {G.type_name(self.type_v)} has no per-element "
                             f"layout to save; use v_trans=False (flash attention) or a V type of block size 1")
        if data and self.hparams.no_alloc:
            raise ValueError("the cache was created with no_alloc: its tensors hold no data to save or restore")

    def _cells_meta(self, cells: Any, idxs: np.ndarray, seq_id: int) -> Iterable[np.ndarray]:
        """The cell records of ``idxs`` (ascending cells), as arrays of little-endian int32."""
        pos = cells.pos_array[idxs]
        n = idxs.size
        if seq_id >= 0:
            if seq_id < self.n_seq_max:
                rec = np.empty((n, 3), "<i4")
                rec[:, 2] = seq_id
                rec[:, 1] = 1
            else:
                rec = np.zeros((n, 2), "<i4")
            rec[:, 0] = pos
            yield rec
            return
        n_words = (self.n_seq_max + 63) // 64
        for a in range(0, n, _META_CHUNK):
            sl = idxs[a:a + _META_CHUNK]
            bits = cells.seq_bits[:n_words, sl].copy()
            if self.n_seq_max % 64:
                bits[n_words - 1] &= np.uint64((1 << (self.n_seq_max % 64)) - 1)
            counts = np.bitwise_count(bits).sum(axis=0, dtype=np.int64)
            p = pos[a:a + _META_CHUNK]
            if (counts == 1).all():
                w = np.argmax(bits != 0, axis=0)
                v = bits[w, np.arange(sl.size)]
                rec = np.empty((sl.size, 3), "<i4")
                rec[:, 0] = p
                rec[:, 1] = 1
                rec[:, 2] = w * 64 + np.frexp(v.astype(np.float64))[1] - 1
                yield rec
                continue
            m = np.unpackbits(np.ascontiguousarray(bits.T).view(np.uint8), axis=1, bitorder="little")
            rows, cols = np.nonzero(m[:, :self.n_seq_max])
            rec_len = 2 + counts
            starts = np.cumsum(rec_len) - rec_len
            out = np.empty(int(rec_len.sum()), "<i4")
            out[starts] = p
            out[starts + 1] = counts
            first = np.cumsum(counts) - counts
            out[starts[rows] + 2 + (np.arange(rows.size) - first[rows])] = cols
            yield out

    def _write_stream_data(self, io: StateWriter, s: int, idxs: np.ndarray) -> None:
        hp = self.hparams
        kv = self.v_cells[s].size()
        runs = _runs(idxs)
        io.write(_DATA_HDR.pack(int(self.v_trans), len(self.layers)))
        for layer in self.layers:
            k = layer.k_stream[s]
            kt = int(G.ttype(k))
            k_row = G.row_size(kt, hp.n_embd_k_gqa(layer.il))
            io.write(_ROW_HDR.pack(kt, k_row))
            _write_cells(io, k, idxs, runs, k_row, 1, kv)
        for layer in self.layers:
            v = layer.v_stream[s]
            vt = int(G.ttype(v))
            n_embd_v = hp.n_embd_v_gqa(layer.il)
            if not self.v_trans:
                v_row = G.row_size(vt, n_embd_v)
                io.write(_ROW_HDR.pack(vt, v_row))
                _write_cells(io, v, idxs, runs, v_row, 1, kv)
            else:
                el = G.type_size(vt)
                io.write(_COL_HDR.pack(vt, el, n_embd_v))
                _write_cells(io, v, idxs, runs, el, n_embd_v, kv)

    # ------------------------------------------------------------------ reading

    def _state_expect(self, seq_id: int) -> _Expect:
        hp = self.hparams
        layers = []
        for layer in self.layers:
            kt, vt = int(G.ttype(layer.k)), int(G.ttype(layer.v))
            n_embd_v = hp.n_embd_v_gqa(layer.il)
            layers.append(_LayerExpect(
                il=layer.il, k_type=kt, k_row=G.row_size(kt, hp.n_embd_k_gqa(layer.il)), v_type=vt,
                v_row=0 if self.v_trans else G.row_size(vt, n_embd_v), v_el=G.type_size(vt), n_embd_v=n_embd_v))
        size = self.get_size()
        if seq_id >= 0:
            # the blob's own sequence id is replaced by seq_id; it only has to be a sequence id at all
            return _Expect(cell_max=size, n_seq_id_max=1, seq_hi=LLAMA_MAX_SEQ, v_trans=self.v_trans,
                           layers=layers, single=True)
        seq_stream = None
        if self.n_stream > 1:
            seq_stream = self.seq_to_stream[:self.n_seq_max]
        return _Expect(cell_max=size, n_seq_id_max=self.n_seq_max, seq_hi=self.n_seq_max, v_trans=self.v_trans,
                       layers=layers, seq_stream=seq_stream)

    def _zero_data_from(self, s: int, n: int) -> None:
        """Zero the data of cells ``n..`` of stream ``s`` in every layer (and transposed V's padding channels) of a
        cache in host memory: with the first ``n`` cells then restored, the data end as after ``clear(true)``."""
        hp = self.hparams
        kv = self.v_cells[s].size()
        for layer in self.layers:
            for t in (layer.k_stream[s], layer.v_stream[s]) if not self.v_trans else (layer.k_stream[s],):
                row = G.nb(t)[1]
                if n < kv:
                    _host_view(t, kv * row)[n * row:] = 0
            if self.v_trans:
                v = layer.v_stream[s]
                el = G.type_size(G.ttype(v))
                n_rows, n_max = hp.n_embd_v_gqa(layer.il), G.ne(v)[0]
                cols = _host_view(v, n_max * kv * el).reshape(n_max, kv * el)
                cols[n_rows:] = 0
                cols[:n_rows, n * el:] = 0

    def _restore_stream(self, io: StateReader, st: StreamState, s: int, seq_id: int, base: int) -> None:
        """Place the (checked) cells of ``st`` and read their rows."""
        n = st.cell_count
        if seq_id == -1:
            strm = s
            idxs = np.arange(n, dtype=np.int64)
            self.v_cells[strm].place(idxs, st.pos, st.seq_matrix())
            self.v_heads[strm] = 0
        else:
            from .batch import BatchAllocator
            strm = self._seq_to_stream_list[seq_id]
            ub = BatchAllocator(self.hparams.n_pos_per_embd()).ubatch_reserve(n, 1)
            ub.seq_id_unq[0] = seq_id
            ub.seq_idx[:] = -1
            ub.seq_idx[seq_id] = 0
            ub.pos[:n] = st.pos
            ub.n_seq_id[:] = 1
            ub.seq_id[:, 0] = seq_id
            sinfo = self.find_slot(ub, False)
            if sinfo.empty():
                cells = self.v_cells[strm]
                raise ValueError(f"stream {strm}: no room for the {n} cells of sequence {seq_id} "
                                 f"({cells.size() - cells.get_used()} of {cells.size()} cells free)")
            self.apply_ubatch(sinfo, ub)
            idxs = sinfo.idxs[0]
        hp = self.hparams
        kv = self.v_cells[strm].size()
        runs = _runs(idxs)
        for layer, L in zip(self.layers, st.layers):
            io.seek(L.k_offset + base)
            _read_cells(io.read(L.k_nbytes, f"layer {layer.il} K data"), layer.k_stream[strm], idxs, runs,
                        L.k_row_size, 1, kv)
        for layer, L in zip(self.layers, st.layers):
            io.seek(L.v_offset + base)
            src = io.read(L.v_nbytes, f"layer {layer.il} V data")
            if not self.v_trans:
                _read_cells(src, layer.v_stream[strm], idxs, runs, L.v_row_size, 1, kv)
            else:
                _read_cells(src, layer.v_stream[strm], idxs, runs, L.v_el_size, hp.n_embd_v_gqa(layer.il), kv)


# ====================================================================================================== files

def save_seq_file(path: str | os.PathLike, kv: Any, seq_id: int, tokens: Any = ()) -> int:
    """``llama_state_seq_save_file``: magic, version, the tokens, then the state of ``seq_id``; returns its size."""
    kv._check_seq(seq_id)
    kv._check_state_layout(data=True)
    toks = np.asarray(tokens)
    if toks.size == 0:
        toks = np.empty(0, np.int32)
    if toks.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {toks.shape}")
    if toks.size and (not np.issubdtype(toks.dtype, np.integer) or toks.min() < -2**31 or toks.max() > _I32_MAX):
        raise ValueError("tokens must be int32 token ids")
    with FileWriter(path) as w:
        w.write(_FILE_HDR.pack(STATE_SEQ_MAGIC, STATE_SEQ_VERSION, toks.size))
        w.write(toks.astype("<i4").tobytes())
        kv.state_write(w, seq_id)
        return w.n_bytes()


def load_seq_file(path: str | os.PathLike, kv: Any, dest_seq_id: int,
                  n_token_capacity: int | None = None) -> np.ndarray:
    """``llama_state_seq_load_file``: restore sequence ``dest_seq_id`` from a sequence state file; returns its
    tokens (int32).  More than ``n_token_capacity`` tokens (when given) or bytes after the state: ``ValueError``."""
    kv._check_seq(dest_seq_id)
    with open(path, "rb") as f:
        io = StreamReader(f)
        magic = io.u32("magic")
        if magic != STATE_SEQ_MAGIC:
            raise ValueError(f"magic is 0x{magic:08x}, expected 0x{STATE_SEQ_MAGIC:08x} ('ggsq', a sequence state "
                             f"file)")
        _check_eq("sequence state file version", io.u32("version"), STATE_SEQ_VERSION)
        n_token = io.u32("n_token")
        if n_token_capacity is not None and n_token > n_token_capacity:
            raise ValueError(f"n_token is {n_token}, expected at most {n_token_capacity} (n_token_capacity)")
        tokens = io.read(4 * n_token, f"{n_token} tokens").view("<i4").astype(np.int32)
        state_start = io.tell()
        n = kv.state_read(io, dest_seq_id)
        extra = io.remaining()
        if extra:
            kv.seq_rm(dest_seq_id, -1, -1)
            raise ValueError(f"state at offset {state_start} is {n} bytes followed by {extra} trailing bytes, "
                             f"expected none")
    return tokens

