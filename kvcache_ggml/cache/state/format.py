"""The KV-cache state blob: its layout, its parsed form, and the checks a restore makes on it.

The cache's state is a blob that llama.cpp itself writes and reads (``llama_state_seq_get_data`` and
``llama_state_seq_set_data`` of a model whose memory is a plain ``llama_kv_cache`` give exactly this blob, with
nothing before or after it).

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

The files that hold a state (sequence state files, session files) are described in :mod:`.files`.

:func:`parse_stream` reads and checks one stream against what a cache expects (:class:`Expect`) without touching
the data; :mod:`.files` describes whole files with it, :mod:`.codec` restores from it.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ... import ggml as G
from ..._consts import INT32_MAX, LLAMA_MAX_SEQ
from ...hparams import LLAMA_MAX_LAYERS
from .io import StateReader

__all__ = ["LayerState", "CellRange", "StreamState", "StateInfo", "LayerExpect", "Expect", "PARSE_ONLY",
           "parse_stream", "check_eq", "type_text", "magic_text", "STATE_SEQ_MAGIC", "STATE_SEQ_VERSION",
           "SESSION_MAGIC", "SESSION_VERSION"]

#: ``LLAMA_STATE_SEQ_MAGIC`` ('ggsq') and ``LLAMA_STATE_SEQ_VERSION`` of llama.h
STATE_SEQ_MAGIC = 0x67677371
STATE_SEQ_VERSION = 2
#: ``LLAMA_SESSION_MAGIC`` ('ggsn') and ``LLAMA_SESSION_VERSION`` of llama.h
SESSION_MAGIC = 0x6767736E
SESSION_VERSION = 9

U32 = struct.Struct("<I")
DATA_HDR = struct.Struct("<II")        # v_trans, n_layer
ROW_HDR = struct.Struct("<iQ")         # type, row size
COL_HDR = struct.Struct("<iII")        # type, element size, n_embd_v_gqa
FILE_HDR = struct.Struct("<III")       # magic, version, n_token


def magic_text(m: int) -> str:
    return m.to_bytes(4, "big").decode("latin-1")


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
            d.update(magic=f"0x{self.magic:08x}", magic_text=magic_text(self.magic), version=self.version,
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


def type_text(t: int) -> str:
    try:
        return G.type_name(t)
    except ValueError:
        return f"type {t}"


def _layer_dict(L: LayerState) -> dict:
    d: dict[str, Any] = {"index": L.index, "k_type": type_text(L.k_type), "k_row_size": L.k_row_size,
                         "k_nbytes": L.k_nbytes, "v_type": type_text(L.v_type), "v_nbytes": L.v_nbytes}
    if L.v_row_size is not None:
        d["v_row_size"] = L.v_row_size
    else:
        d.update(v_el_size=L.v_el_size, n_embd_v_gqa=L.n_embd_v_gqa)
    return d


# ====================================================================================================== parsing

@dataclass(slots=True, frozen=True)
class LayerExpect:
    il: int
    k_type: int
    k_row: int
    v_type: int
    v_row: int
    v_el: int
    n_embd_v: int


@dataclass(slots=True)
class Expect:
    """What a cache accepts; None fields are not checked."""

    cell_max: int                       # most cells of one stream
    n_seq_id_max: int                   # most sequences of one cell
    seq_hi: int                         # sequence ids must be < seq_hi
    v_trans: bool | None = None
    layers: list[LayerExpect] | None = None
    seq_stream: np.ndarray | None = None  # whole restore of several streams: stream of each sequence id
    single: bool = False                # single-sequence restore


PARSE_ONLY = Expect(cell_max=2**32 - 1, n_seq_id_max=LLAMA_MAX_SEQ, seq_hi=LLAMA_MAX_SEQ)


def _parse_cells(io: StateReader, s: int, n: int, ex: Expect) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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


def _check_cells(s: int, pos: np.ndarray, nsq: np.ndarray, seq_ids: np.ndarray, ex: Expect) -> None:
    # INT32_MAX is the "to the end" bound of seq_rm: a cell there could never be removed
    bad = np.flatnonzero((pos < 0) | (pos == INT32_MAX))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"stream {s} cell {i}: pos is {int(pos[i])}, expected in [0, {INT32_MAX})")
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


def check_eq(where: str, found: int, expected: int, text=None) -> None:
    if found != expected:
        if text is not None:
            raise ValueError(f"{where} is {found} ({text(found)}), expected {expected} ({text(expected)})")
        raise ValueError(f"{where} is {found}, expected {expected}")


def parse_stream(io: StateReader, s: int, ex: Expect, base: int = 0) -> StreamState:
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
        check_eq(f"stream {s}: v_trans", v_trans, int(ex.v_trans))
    st.v_trans = bool(v_trans)
    n_layer = io.u32(f"stream {s} n_layer")
    if ex.layers is not None:
        check_eq(f"stream {s}: n_layer", n_layer, len(ex.layers))
    elif n_layer > LLAMA_MAX_LAYERS:
        raise ValueError(f"stream {s}: n_layer is {n_layer}, expected at most {LLAMA_MAX_LAYERS}")
    layers = [LayerState(index=li, k_type=0, k_row_size=0, k_offset=0, k_nbytes=0) for li in range(n_layer)]
    for li, L in enumerate(layers):
        e = ex.layers[li] if ex.layers is not None else None
        where = f"stream {s} layer {li if e is None else e.il}"
        L.k_type = io.i32(f"{where} k_type")
        if e is not None:
            check_eq(f"{where}: k_type", L.k_type, e.k_type, type_text)
        else:
            _known_type(L.k_type, f"{where}: k_type")
        L.k_row_size = io.u64(f"{where} k_row_size")
        if e is not None:
            check_eq(f"{where}: k_row_size", L.k_row_size, e.k_row)
        L.k_offset, L.k_nbytes = io.tell() - base, n * L.k_row_size
        io.skip(L.k_nbytes, f"{where} K data ({n} rows of {L.k_row_size} bytes)")
    for li, L in enumerate(layers):
        e = ex.layers[li] if ex.layers is not None else None
        where = f"stream {s} layer {li if e is None else e.il}"
        L.v_type = io.i32(f"{where} v_type")
        if e is not None:
            check_eq(f"{where}: v_type", L.v_type, e.v_type, type_text)
        else:
            _known_type(L.v_type, f"{where}: v_type")
        if not v_trans:
            L.v_row_size = io.u64(f"{where} v_row_size")
            if e is not None:
                check_eq(f"{where}: v_row_size", L.v_row_size, e.v_row)
            L.v_nbytes = n * L.v_row_size
            what = f"{where} V data ({n} rows of {L.v_row_size} bytes)"
        else:
            L.v_el_size = io.u32(f"{where} v_el_size")
            check_eq(f"{where}: v_el_size", L.v_el_size, e.v_el if e is not None else G.type_size(L.v_type))
            L.n_embd_v_gqa = io.u32(f"{where} n_embd_v_gqa")
            if e is not None:
                check_eq(f"{where}: n_embd_v_gqa", L.n_embd_v_gqa, e.n_embd_v)
            L.v_nbytes = L.n_embd_v_gqa * n * L.v_el_size
            what = f"{where} V data ({L.n_embd_v_gqa} channels of {n} elements of {L.v_el_size} bytes)"
        L.v_offset = io.tell() - base
        io.skip(L.v_nbytes, what)
    st.layers = layers
    st.nbytes = io.tell() - off0
    return st
