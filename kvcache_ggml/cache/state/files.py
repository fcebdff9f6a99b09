"""llama.cpp's state files, and a cache-free description of any state.

A *sequence state file* (``llama_state_seq_save_file``) is ``u32 magic 0x67677371 ('ggsq'), u32 version 2,
u32 n_token, i32 token[n_token]`` followed by a single-sequence state.  A whole-context *session file*
(``llama_state_save_file``; only read here, by :func:`parse_state`) is ``u32 magic 0x6767736e ('ggsn'),
u32 version 9, u32 n_token, i32 token[n_token], u32 len, char arch[len]`` followed by a whole-cache state.
The state itself is described in :mod:`.format`.
"""
from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..._consts import INT32_MAX, LLAMA_MAX_SEQ
from .format import (FILE_HDR, PARSE_ONLY, SESSION_MAGIC, SESSION_VERSION, STATE_SEQ_MAGIC, STATE_SEQ_VERSION,
                           StateInfo, check_eq, magic_text, parse_stream)
from .io import BytesReader, FileWriter, StateReader, StreamReader

if TYPE_CHECKING:
    from ..kvcache import KVCache

__all__ = ["parse_state", "read_state_file", "save_seq_file", "load_seq_file", "SeqFile", "check_seq_data"]


@dataclass(slots=True)
class SeqFile:
    """A sequence state file checked against a cache (:func:`check_seq_data`)."""

    tokens: np.ndarray               # int32 [n_token]: the tokens the file names
    state_offset: int                # where the state starts (after magic, version and the tokens)
    n_cells: int                     # cells the state holds (the base cache's, for an iSWA cache)
    n_bytes: int                     # the file's size (header, tokens and state; nothing trails)


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
        check_eq(f"{magic_text(magic)!r} file version", info.version, want)
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
    info.streams = [parse_stream(io, s, PARSE_ONLY, base=info.offset) for s in range(n_stream)]
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


def save_seq_file(path: str | os.PathLike, kv: KVCache, seq_id: int, tokens: Any = ()) -> int:
    """``llama_state_seq_save_file``: magic, version, the tokens, then the state of ``seq_id``; returns its size."""
    kv.check_seq_state(seq_id)
    toks = np.asarray(tokens)
    if toks.size == 0:
        toks = np.empty(0, np.int32)
    if toks.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {toks.shape}")
    if toks.size and (not np.issubdtype(toks.dtype, np.integer) or toks.min() < -2**31 or toks.max() > INT32_MAX):
        raise ValueError("tokens must be int32 token ids")
    with FileWriter(path) as w:
        w.write(FILE_HDR.pack(STATE_SEQ_MAGIC, STATE_SEQ_VERSION, toks.size))
        w.write(toks.astype("<i4").tobytes())
        kv.state_write(w, seq_id)
        return w.n_bytes()


def load_seq_file(path: str | os.PathLike, kv: KVCache, dest_seq_id: int,
                  n_token_capacity: int | None = None) -> np.ndarray:
    """``llama_state_seq_load_file``: restore sequence ``dest_seq_id`` from a sequence state file; returns its
    tokens (int32).  More than ``n_token_capacity`` tokens (when given) or bytes after the state: ``ValueError``."""
    kv.check_seq_state(dest_seq_id)
    with open(path, "rb") as f:
        io = StreamReader(f)
        tokens = _read_seq_header(io, n_token_capacity)
        state_start = io.tell()
        n = kv.state_read(io, dest_seq_id)
        extra = io.remaining()
        if extra:
            kv.seq_rm(dest_seq_id, -1, -1)  # what a failed restore of one sequence leaves
            raise ValueError(f"state at offset {state_start} is {n} bytes followed by {extra} trailing bytes, "
                             f"expected none")
    return tokens


def check_seq_data(data: Any, kv: Any, dest_seq_id: int, n_token_capacity: int | None = None) -> SeqFile:
    """Every check :func:`load_seq_file` makes, on a file's bytes and without changing ``kv`` (a ``Memory``):
    the header, the tokens (at most ``n_token_capacity``), the state against the cache (``state_check``) and no
    trailing bytes.  ValueError naming the problem; a restore of the checked bytes can then only lack room."""
    kv.check_seq_state(dest_seq_id)
    io = BytesReader(_as_u8(data))
    tokens = _read_seq_header(io, n_token_capacity)
    start = io.tell()
    n_cells = kv.state_check(io, dest_seq_id)
    extra = io.remaining()
    if extra:
        raise ValueError(f"state at offset {start} is {io.tell() - start} bytes followed by {extra} trailing "
                         f"bytes, expected none")
    return SeqFile(tokens, start, int(n_cells), io.tell())


def _read_seq_header(io: StateReader, n_token_capacity: int | None) -> np.ndarray:
    """A sequence state file's magic, version and tokens (ValueError on a mismatch or too many tokens)."""
    magic = io.u32("magic")
    if magic != STATE_SEQ_MAGIC:
        raise ValueError(f"magic is 0x{magic:08x}, expected 0x{STATE_SEQ_MAGIC:08x} ('ggsq', a sequence state "
                         f"file)")
    check_eq("sequence state file version", io.u32("version"), STATE_SEQ_VERSION)
    n_token = io.u32("n_token")
    if n_token_capacity is not None and n_token > n_token_capacity:
        raise ValueError(f"n_token is {n_token}, expected at most {n_token_capacity} (n_token_capacity)")
    return io.read(4 * n_token, f"{n_token} tokens").view("<i4").astype(np.int32)
