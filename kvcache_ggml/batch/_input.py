"""The caller's input batch (``llama_batch``): :class:`Batch`, its arrays converted to their dtype once and
validated for shape.  Values that depend on the model (token ids, sequence ids) are checked by
:meth:`BatchAllocator.init`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .._consts import LLAMA_MAX_SEQ

_I32_MIN = -(2**31)
_I32_MAX = 2**31 - 1
_I8_MIN, _I8_MAX = -128, 127
_I32 = np.dtype(np.int32)  # numpy keeps one instance of each native dtype: ``a.dtype is _I32`` is the fast test
_I8 = np.dtype(np.int8)
# numpy >= 2 raises OverflowError when a Python int does not fit the requested dtype (1.x wraps with a warning)
_NUMPY2 = int(np.__version__.split(".")[0]) >= 2


def _int_array(name: str, value: Any) -> np.ndarray:
    """``value`` as an int32 array (no copy when it already is one); ValueError for non-integers or overflow."""
    if isinstance(value, np.ndarray):
        arr = value
    else:
        arr = np.asarray(value)
        if arr.dtype.kind == "i" and _NUMPY2:  # Python ints: numpy checks the int32 range while converting
            try:
                return np.asarray(value, dtype=np.int32)
            except OverflowError as e:
                raise ValueError(f"{name}: {e}: does not fit int32 [{_I32_MIN}, {_I32_MAX}]") from None
    if arr.dtype == np.int32:
        return arr
    kind = arr.dtype.kind
    if kind not in "iu":
        if arr.size == 0 and kind == "f":  # np.asarray([]) is float64
            return arr.astype(np.int32)
        raise ValueError(f"{name}: expected integers, got dtype {arr.dtype}")
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < _I32_MIN or hi > _I32_MAX:
            bad = lo if lo < _I32_MIN else hi
            raise ValueError(f"{name}: value {bad} does not fit int32 [{_I32_MIN}, {_I32_MAX}]")
    return arr.astype(np.int32)


def _filled(n: int, value: int) -> np.ndarray:
    out = np.empty(n, np.int32)
    out.fill(value)
    return out


_ONES: dict[int, np.ndarray] = {}  # n -> read-only int32 [n] of ones: the n_seq_id of n tokens of one id each


def _ones(n: int) -> np.ndarray:
    """A read-only int32 [n] of ones, shared (made once per n up to LLAMA_MAX_SEQ: the decode step's n_seq_id)."""
    out = _ONES.get(n)
    if out is None:
        out = _filled(n, 1)
        out.flags.writeable = False
        if n <= LLAMA_MAX_SEQ:
            _ONES[n] = out
    return out


def _seq_id_rows(value: Any, n_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-token lists of sequence ids -> (int32 [n, w] padded with -1, int32 n_seq_id [n])."""
    arr = None
    if isinstance(value, np.ndarray):
        arr = value
    else:
        try:
            arr = np.asarray(value)
        except ValueError:  # ragged lists: one row per token, padded below
            arr = None
        if arr is not None and arr.dtype == object:
            arr = None
    if arr is not None:
        arr = _int_array("seq_id", arr)
        if arr.ndim == 1:
            arr = arr.reshape(-1, 1)
        if arr.ndim != 2 or arr.shape[0] != n_tokens or arr.shape[1] == 0:
            raise ValueError(f"seq_id: shape {arr.shape}, expected [n_tokens={n_tokens}] or "
                             f"[n_tokens={n_tokens}, n_seq_id >= 1]")
        return arr, _filled(n_tokens, arr.shape[1])
    # ragged Python input: Python objects that have to be read one by one anyway
    rows = list(value)
    if len(rows) != n_tokens:
        raise ValueError(f"seq_id: {len(rows)} entries, expected one per token (n_tokens={n_tokens})")
    rows = [[r] if isinstance(r, (int, np.integer)) else list(r) for r in rows]
    counts = np.fromiter((len(r) for r in rows), np.int32, n_tokens)
    if np.count_nonzero(counts == 0):
        i = int(np.argmax(counts == 0))
        raise ValueError(f"seq_id[{i}]: empty, expected at least one sequence id per token")
    w = int(counts.max())
    flat = _int_array("seq_id", [s for r in rows for s in r])
    out = np.full((n_tokens, w), -1, np.int32)
    out[np.arange(w) < counts[:, None]] = flat
    return out, counts


class MemoryPositions(Protocol):
    """What :meth:`BatchAllocator.init` asks of a memory module (``llama_memory_i``): -1 for an empty sequence."""

    def seq_pos_min(self, seq_id: int) -> int: ...

    def seq_pos_max(self, seq_id: int) -> int: ...

@dataclass(slots=True, eq=False, kw_only=True)
class Batch:
    """The input batch (``llama_batch``), with llama_batch's field names as keyword arguments.

    Exactly one of ``token`` (int [n_tokens]) and ``embd`` (float [n_tokens, n_embd]) is given.  Optional:

    * ``pos``: [n_tokens], or for several positions per embedding (M-RoPE) [n_pos, n_tokens] or flat
      ``pos[d*n_tokens + i]``; missing -> continued from the memory by the allocator.
    * ``seq_id``: per token a list of sequence ids (ragged lists, a 1-D array of one id per token, or a 2-D
      [n_tokens, k] array); missing -> sequence 0.  ``n_seq_id`` (optional, with a 2-D ``seq_id``) says how many
      leading entries of each row count, as in llama_batch; missing -> filled in (for one id per token: a shared
      read-only array of ones).
    * ``logits``: output flags [n_tokens] (bool or int8); missing -> decided by the allocator.

    Numpy arrays of the right dtype are referenced, not copied.
    """

    token: np.ndarray | None = None     # int32 [n_tokens] token ids, or None for embeddings
    embd: np.ndarray | None = None      # float32 [n_tokens, n_embd] input embeddings, or None for tokens
    pos: np.ndarray | None = None       # int32 flat [n_pos*n_tokens], pos[d*n_tokens + i]; None -> auto
    n_seq_id: np.ndarray | None = None  # int32 [n_tokens] number of sequence ids per token; None with seq_id
    seq_id: np.ndarray | None = None    # int32 [n_tokens, w] sequence ids per token, padded with -1; None -> seq 0
    logits: np.ndarray | None = None    # int8 [n_tokens] output flags; None -> auto
    n_tokens: int = field(init=False)   # number of tokens (rows of token/embd)

    def __post_init__(self) -> None:
        if self._is_plain_tokens():
            return
        if (self.token is None) == (self.embd is None):
            raise ValueError("Batch: give exactly one of token= and embd=")
        if self.token is not None:
            tok = _int_array("token", self.token)
            if tok.ndim != 1:
                raise ValueError(f"token: shape {tok.shape}, expected [n_tokens]")
            self.token = tok
            n = tok.shape[0]
        else:
            emb = self.embd if isinstance(self.embd, np.ndarray) else np.asarray(self.embd)
            if emb.dtype.kind not in "fiu":
                raise ValueError(f"embd: expected numbers, got dtype {emb.dtype}")
            if emb.ndim != 2 or emb.shape[1] == 0:
                raise ValueError(f"embd: shape {emb.shape}, expected [n_tokens, n_embd]")
            self.embd = emb if emb.dtype == np.float32 else emb.astype(np.float32)
            n = emb.shape[0]
        if n == 0:
            raise ValueError("Batch: n_tokens = 0, expected at least one token")
        self.n_tokens = n

        if self.pos is not None:
            pos = _int_array("pos", self.pos)
            if pos.ndim == 2 and pos.shape[1] == n and pos.shape[0] >= 1:
                pos = pos.reshape(-1)
            if pos.ndim != 1 or pos.shape[0] == 0 or pos.shape[0] % n:
                raise ValueError(f"pos: shape {pos.shape}, expected [n_tokens={n}], [n_pos, n_tokens={n}] "
                                 f"or [n_pos*n_tokens]")
            self.pos = pos

        if self.seq_id is None:
            if self.n_seq_id is not None:
                raise ValueError("n_seq_id given without seq_id")
        else:
            rows, counts = _seq_id_rows(self.seq_id, n)
            if self.n_seq_id is not None:
                cnt = _int_array("n_seq_id", self.n_seq_id)
                if cnt.shape != (n,):
                    raise ValueError(f"n_seq_id: shape {cnt.shape}, expected [n_tokens={n}]")
                w = rows.shape[1]
                bad = (cnt < 1) | (cnt > w)
                if np.count_nonzero(bad):
                    i = int(np.argmax(bad))
                    raise ValueError(f"n_seq_id[{i}] = {int(cnt[i])}, expected in [1, {w}] (columns of seq_id)")
                if np.count_nonzero(cnt != w):  # keep the counted ids, pad with -1, trim to the widest row
                    wmax = int(cnt.max())
                    rows = np.where(np.arange(wmax) < cnt[:, None], rows[:, :wmax], np.int32(-1))
                counts = cnt
            self.seq_id = rows
            self.n_seq_id = counts

        if self.logits is not None:
            lg = self.logits if isinstance(self.logits, np.ndarray) else np.asarray(self.logits)
            if lg.dtype != np.int8:
                if lg.dtype.kind == "b":
                    lg = lg.astype(np.int8)
                else:
                    lg = _int_array("logits", lg)
                    if lg.size and (int(lg.min()) < _I8_MIN or int(lg.max()) > _I8_MAX):
                        raise ValueError(f"logits: values must fit int8 [{_I8_MIN}, {_I8_MAX}]")
                    lg = lg.astype(np.int8)
            if lg.shape != (n,):
                raise ValueError(f"logits: shape {lg.shape}, expected [n_tokens={n}]")
            self.logits = lg

    def _is_plain_tokens(self) -> bool:
        """Fast path (the decode step's batch): int32 numpy tokens [n], positions [n] or None, sequence ids [n] or
        [n, 1] or None, int8 flags [n] or None, no n_seq_id.  Sets what the general path would (the same arrays,
        ``seq_id`` as [n, 1], a fresh ``n_seq_id`` of ones) and returns True; False leaves everything to it."""
        tok, pos, seq, lg = self.token, self.pos, self.seq_id, self.logits
        if type(tok) is not np.ndarray or tok.dtype is not _I32 or tok.ndim != 1 or self.embd is not None:
            return False
        n = tok.shape[0]
        if n == 0 or self.n_seq_id is not None:
            return False
        if pos is not None and (type(pos) is not np.ndarray or pos.dtype is not _I32 or pos.shape != (n,)):
            return False
        if lg is not None and (type(lg) is not np.ndarray or lg.dtype is not _I8 or lg.shape != (n,)):
            return False
        if seq is not None:
            if type(seq) is not np.ndarray or seq.dtype is not _I32:
                return False
            shape = seq.shape
            if shape == (n,):
                seq = self.seq_id = seq.reshape(n, 1)
            elif shape != (n, 1):
                return False
            self.n_seq_id = _ones(n)  # (read-only, shared: filled in, not the caller's)
        self.n_tokens = n
        return True

    @property
    def n_pos(self) -> int:
        """Positions given per token (0 when ``pos`` is None)."""
        return 0 if self.pos is None else self.pos.shape[0] // self.n_tokens
