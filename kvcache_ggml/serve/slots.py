"""llama-server's slot actions over the engine: a sequence's cache saved to a file and restored later.

A *slot* here is a sequence of the context, ``0 .. n_parallel + parked - 1`` (a request is not pinned to one: it
names the one it prefers with ``id_slot``, which the engine's admission takes when that sequence serves no
request).  The actions run on the engine's thread between two steps (:meth:`Engine.call`):

* :func:`save_slot` -- ``llama_state_seq_save_file`` of the sequence with the tokens the prefix cache indexes for
  it (cells beyond them are dropped first, so that the file's tokens are its cells, as in llama-server's);
* :func:`restore_slot` -- the whole file checked against the cache before anything changes (header, tokens, every
  stream, layer and type, no trailing bytes: :func:`~kvcache_ggml.cache.state.check_seq_data`); then parked
  sequences of its stream are evicted for room, the sequence's old content goes, the cells are loaded, and the
  sequence is parked in the prefix cache's index holding the file's tokens, so that the next request whose prompt
  extends them reuses them (``cached_tokens``);
* :func:`erase_slot` -- the sequence's cells and its entry go.

A sequence serving a request raises :class:`SlotBusy` (the HTTP side waits and asks again, as llama-server defers
the task until the slot is idle).  Bad input -- a slot id out of range, a file that is missing, corrupt, truncated or
from another model or cache type -- raises ValueError before anything changes.
"""
from __future__ import annotations

import os
import time
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..cache.state.files import check_seq_data

__all__ = ["SlotBusy", "SlotResult", "check_filename", "slot_path", "save_slot", "restore_slot", "erase_slot",
           "slots_info"]

_FORBIDDEN = set(':*?"<>|/\\') | {"\u2215", "\u2216", "\uff0e", "\ufffd", "\ufeff"}


class SlotBusy(Exception):
    """The sequence serves a request: the action waits until it is done."""


@dataclass(slots=True)
class SlotResult:
    """What a slot action did, in llama-server's JSON (:meth:`to_json`)."""

    action: str                      # "save", "restore" or "erase"
    id_slot: int                     # the sequence
    filename: str = ""               # save/restore: the file's name in the slot directory
    n_tokens: int = 0                # tokens saved, restored or erased
    n_bytes: int = 0                 # save: bytes written; restore: bytes read
    t_ms: float = 0.0                # save/restore: milliseconds the action took

    def to_json(self) -> dict[str, Any]:
        if self.action == "save":
            return {"id_slot": self.id_slot, "filename": self.filename, "n_saved": self.n_tokens,
                    "n_written": self.n_bytes, "timings": {"save_ms": self.t_ms}}
        if self.action == "restore":
            return {"id_slot": self.id_slot, "filename": self.filename, "n_restored": self.n_tokens,
                    "n_read": self.n_bytes, "timings": {"restore_ms": self.t_ms}}
        return {"id_slot": self.id_slot, "n_erased": self.n_tokens}


def check_filename(name: Any) -> str:
    """``name`` if it is a plain file name (llama.cpp's ``fs_validate_filename`` without subdirectories: no path
    separator, no ``..``, no control or reserved character, no leading/trailing space, no trailing dot, at most 255
    bytes); ValueError naming the rule it breaks."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"the filename must be a non-empty string, got {name!r}")
    if len(name.encode("utf-8", "surrogatepass")) > 255:
        raise ValueError(f"the filename has {len(name.encode('utf-8', 'surrogatepass'))} bytes; the limit is 255")
    for c in name:
        o = ord(c)
        if o <= 0x1F or 0x7F <= o <= 0x9F or 0xD800 <= o <= 0xDFFF or c in _FORBIDDEN:
            raise ValueError(f"invalid filename {name!r}: {unicodedata.name(c, hex(o))} is not allowed (a slot file "
                             "is a plain name in --slot-save-path, without a path)")
    if name[0] == " " or name[-1] in " .":
        raise ValueError(f"invalid filename {name!r}: it starts or ends with a space or ends with a dot")
    if ".." in name:
        raise ValueError(f"invalid filename {name!r}: '..' is not allowed")
    return name


def slot_path(directory: Path, name: Any) -> Path:
    """The file ``name`` (checked by :func:`check_filename`) inside ``directory``, never outside it."""
    path = directory / check_filename(name)
    if path.resolve().parent != directory.resolve():
        raise ValueError(f"invalid filename {name!r}: it leads outside the slot directory")
    return path


def _check_slot(eng: Any, s: Any) -> int:
    n = eng.prefix.n_seq
    if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < n:
        raise ValueError(f"invalid slot id {s!r}: the slots are 0 .. {n - 1} (--parallel + --parked sequences)")
    e = eng.prefix.seqs.get(s)
    if e is not None and e.active:
        raise SlotBusy(f"slot {s} serves a request")
    return s


def save_slot(eng: Any, s: int, path: Path, filename: str) -> SlotResult:
    """Save sequence ``s`` with its indexed tokens to ``path`` (written whole, then renamed into place)."""
    t0 = time.perf_counter()
    pc, ctx = eng.prefix, eng.ctx
    _check_slot(eng, s)
    e = pc.seqs.get(s)
    tokens = e.tokens.copy() if e is not None else np.zeros(0, np.int32)
    if ctx.memory_seq_pos_max(s) >= tokens.size:
        pc.seq_rm(s, int(tokens.size), -1)  # cells the index does not vouch for are not saved
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        n = ctx.state_seq_save_file(tmp, s, tokens)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return SlotResult("save", s, filename, int(tokens.size), int(n), (time.perf_counter() - t0) * 1e3)


def restore_slot(eng: Any, s: int, path: Path, filename: str) -> SlotResult:
    """Restore sequence ``s`` from ``path`` and park it holding the file's tokens.  ValueError for a missing or bad
    file, with nothing changed; for a cache without room even after evicting every parked sequence of the stream,
    with ``s`` emptied."""
    t0 = time.perf_counter()
    pc, ctx = eng.prefix, eng.ctx
    _check_slot(eng, s)
    try:
        data = np.frombuffer(path.read_bytes(), np.uint8)
    except OSError as err:
        raise ValueError(f"cannot read slot file {filename!r}: {err.strerror or err}") from None
    try:
        info = check_seq_data(data, ctx.kv, s, eng.n_ctx_seq)
    except ValueError as err:
        raise ValueError(f"slot file {filename!r} does not fit this server's cache: {err}") from None
    stream = pc.stream_of(s)
    if not pc.claim({stream: info.n_cells}, keep=[s]):
        if s in pc.seqs:
            pc.evict(s, keep=False)
        else:
            ctx.memory_seq_rm(s, -1, -1)
        if not pc.claim({stream: info.n_cells}):
            kv = ctx.kv
            raise ValueError(f"no room for the {info.n_cells} cells of {filename!r}: stream {stream} has "
                             f"{kv.get_size() - kv.get_used(stream)} of {kv.get_size()} cells free with every "
                             "parked sequence evicted")
    pc.state_load(data[info.state_offset:], s, info.tokens)
    e = pc.seqs.get(s)
    if e is not None:  # the most recently used parked sequence: evicted last
        pc.index.tick += 1
        e.last_used = pc.index.tick
    return SlotResult("restore", s, filename, int(info.tokens.size), info.n_bytes, (time.perf_counter() - t0) * 1e3)


def erase_slot(eng: Any, s: int) -> SlotResult:
    """Remove sequence ``s``'s cells and its entry; the tokens it held are ``n_erased``."""
    pc = eng.prefix
    _check_slot(eng, s)
    e = pc.seqs.get(s)
    n = int(e.tokens.size) if e is not None else 0
    if e is not None:
        pc.evict(s, keep=False)
    eng.ctx.memory_seq_rm(s, -1, -1)
    return SlotResult("erase", s, n_tokens=n)


def slots_info(eng: Any) -> list[dict[str, Any]]:
    """``GET /slots``: one object per sequence, llama-server's ``id``, ``n_ctx``, ``speculative`` (the engine has a
    drafter) and ``is_processing``, with ``n_tokens`` (tokens the prefix cache indexes for it) and ``parked``."""
    pc = eng.prefix
    out = []
    for s in range(pc.n_seq):
        e = pc.seqs.get(s)
        out.append({"id": s, "n_ctx": eng.n_ctx_seq, "speculative": eng.drafter is not None,
                    "is_processing": bool(e is not None and e.active),
                    "n_tokens": int(e.tokens.size) if e is not None else 0,
                    "parked": bool(e is not None and not e.active)})
    return out
