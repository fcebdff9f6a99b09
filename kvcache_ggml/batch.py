"""Input batches and their split into micro-batches: llama.cpp's ``llama_batch``, ``llama_ubatch`` and
``llama_batch_allocr`` (llama-batch.h/.cpp), on numpy only.

* :class:`Batch` is the caller's input (``llama_batch``): tokens or embeddings with optional positions, sequence ids
  and output flags.  Arrays are converted to their dtype once and validated for shape; values that depend on the
  model (token ids, sequence ids) are checked by :meth:`BatchAllocator.init`.
* :class:`UBatch` is one micro-batch (``llama_ubatch``) as numpy arrays that it owns.
* :class:`BatchAllocator` (``llama_batch_allocr``) validates a batch against a vocabulary and a memory module,
  fills in what the caller left out, and cuts the batch into ubatches with the same three strategies, in the same
  order and with the same output ids as llama.cpp.

Representation.  A token's sequence ids are a row of an int32 [n_tokens, w] array padded with -1, ``w`` the largest
number of ids of any token.  Tokens with the same sequence *set* form a group: each group keeps its member tokens in
batch order and its set as a Python int bitmask.  Batches without coupled sequences (one id per token, the common
case) group by sequence id (bincount and a stable argsort); coupled ones build per-token uint64 bitset words and
group them with a lexsort.

An invariant the splitters rely on: every split method consumes, in each group, a prefix of the group's members
(llama.cpp's splitters always take a group's tokens in batch order), so the number of used members of a group is
also the index of its first unused member.

Speed.  The hot path is a decode step of one token per sequence.  Every numpy call costs about a microsecond, so the
code counts them: C-level methods rather than ``np.`` wrappers, ``np.count_nonzero`` rather than ``any``/``all``
reductions, and the per-sequence grouping computed once per batch and shared by positions, statistics and splits.
No path loops in Python over tokens; loops over sequences or sequence sets (at most a few hundred) are fine.

Errors: ``ValueError`` for bad input (llama.cpp logs and returns false), ``RuntimeError`` for misuse (splitting
without a batch), ``assert`` for internal invariants.  ``LLAMA_BATCH_DEBUG`` (read once per allocator) logs the
batch and every ubatch through ``logging.getLogger("kvcache_ggml.batch")`` at DEBUG level.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ._consts import LLAMA_MAX_SEQ, SEQ_WORDS

__all__ = ["LLAMA_MAX_SEQ", "Batch", "UBatch", "BatchAllocator", "MemoryPositions"]

logger = logging.getLogger("kvcache_ggml.batch")

_I32_MIN = -(2**31)
_I32_MAX = 2**31 - 1
_I8_MIN, _I8_MAX = -128, 127
# numpy >= 2 raises OverflowError when a Python int does not fit the requested dtype (1.x wraps with a warning)
_NUMPY2 = int(np.__version__.split(".")[0]) >= 2


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


# read-only arrays shared where a fresh one would cost more than it protects: the "done" ubatch's empty arrays,
# the seq_idx template, and the allocator's own defaults for one-token batches (ubatches copy what they take)
_SEQ_IDX_NONE = _frozen(np.full(LLAMA_MAX_SEQ, -1, np.int32))
_EMPTY_I32 = _frozen(np.zeros(0, np.int32))
_EMPTY_I8 = _frozen(np.zeros(0, np.int8))
_EMPTY_SEQ = _frozen(np.full((0, 1), -1, np.int32))
_ONE_N_SEQ_ID = _frozen(np.ones(1, np.int32))
_ONE_SEQ0 = _frozen(np.zeros((1, 1), np.int32))
_ONE_OUT = _frozen(np.ones(1, np.int8))


class MemoryPositions(Protocol):
    """What :meth:`BatchAllocator.init` asks of a memory module (``llama_memory_i``): -1 for an empty sequence."""

    def seq_pos_min(self, seq_id: int) -> int: ...

    def seq_pos_max(self, seq_id: int) -> int: ...


# ---------------------------------------------------------------------------------------------------------- input


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


@dataclass(slots=True, eq=False, kw_only=True)
class Batch:
    """The input batch (``llama_batch``), with llama_batch's field names as keyword arguments.

    Exactly one of ``token`` (int [n_tokens]) and ``embd`` (float [n_tokens, n_embd]) is given.  Optional:

    * ``pos``: [n_tokens], or for several positions per embedding (M-RoPE) [n_pos, n_tokens] or flat
      ``pos[d*n_tokens + i]``; missing -> continued from the memory by the allocator.
    * ``seq_id``: per token a list of sequence ids (ragged lists, a 1-D array of one id per token, or a 2-D
      [n_tokens, k] array); missing -> sequence 0.  ``n_seq_id`` (optional, with a 2-D ``seq_id``) says how many
      leading entries of each row count, as in llama_batch.
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

    @property
    def n_pos(self) -> int:
        """Positions given per token (0 when ``pos`` is None)."""
        return 0 if self.pos is None else self.pos.shape[0] // self.n_tokens


# -------------------------------------------------------------------------------------------------------- ubatch


@dataclass(slots=True, eq=False)
class UBatch:
    """One micro-batch (``llama_ubatch``); it owns its arrays.  ``n_tokens == 0`` marks "nothing left"."""

    n_tokens: int                 # total tokens (n_seq_tokens * n_seqs)
    n_seq_tokens: int             # tokens per sequence set
    n_seqs: int                   # sequence sets in the ubatch
    n_seqs_unq: int               # distinct sequence ids in the ubatch
    n_pos: int                    # positions per token/embedding (the allocator's n_pos_per_embd)
    b_equal_seqs: bool            # the sequence sets all have n_seq_tokens tokens (split_equal/split_seq)
    token: np.ndarray | None      # int32 [n_tokens] token ids, or None for embeddings
    embd: np.ndarray | None       # float32 [n_tokens, n_embd] embeddings, or None for tokens
    pos: np.ndarray               # int32 [n_pos*n_tokens] positions, pos[d*n_tokens + i]
    n_seq_id: np.ndarray          # int32 [n_tokens] number of sequence ids of each token
    seq_id: np.ndarray            # int32 [n_tokens, w] sequence ids of each token in order, padded with -1 (w >= 1)
    seq_id_unq: np.ndarray        # int32 [n_seqs_unq] the distinct sequence ids, ascending
    seq_idx: np.ndarray           # int32 [LLAMA_MAX_SEQ] index of each sequence id in seq_id_unq, -1 if absent
    output: np.ndarray            # int8 [n_tokens] output flags (copied from the batch's logits)

    def equal_seqs(self) -> bool:
        return bool(self.b_equal_seqs)

    def is_pos_2d(self) -> bool:
        # M-RoPE: sections 1 and 2 carry the y and x position of image embeddings
        return self.n_pos >= 3


def _empty_ubatch() -> UBatch:
    # "nothing left": its arrays are shared and read-only
    return UBatch(n_tokens=0, n_seq_tokens=0, n_seqs=0, n_seqs_unq=0, n_pos=0, b_equal_seqs=False,
                  token=None, embd=None, pos=_EMPTY_I32, n_seq_id=_EMPTY_I32, seq_id=_EMPTY_SEQ,
                  seq_id_unq=_EMPTY_I32, seq_idx=_SEQ_IDX_NONE, output=_EMPTY_I8)


def _atoi(text: str | None) -> int:
    """C ``atoi``: optional leading spaces and sign, then digits; 0 when there are none."""
    m = re.match(r"\s*([+-]?\d+)", text or "")
    return int(m.group(1)) if m else 0


def _distinct(a: np.ndarray) -> np.ndarray:
    """The distinct values of ``a``, ascending (a sort: numpy 2's hash-based np.unique is far slower here)."""
    a = np.sort(a.reshape(-1))
    if a.shape[0] > 1:
        keep = np.empty(a.shape[0], bool)
        keep[0] = True
        np.not_equal(a[1:], a[:-1], out=keep[1:])
        a = a[keep]
    return a


def _present_seqs(ids: np.ndarray) -> np.ndarray:
    """The distinct sequence ids among ``ids`` (valid ids: 0 <= id < LLAMA_MAX_SEQ), ascending, as int32."""
    return np.bincount(ids.reshape(-1)).nonzero()[0].astype(np.int32)


def _seq_pos_stats(seqs: np.ndarray, pos: np.ndarray) -> tuple[list[int], list[int], list[int], list[int]]:
    """Per distinct sequence (ascending): min and max position and number of distinct positions."""
    # one int64 key per (sequence, position) pair, ordered by sequence then position
    key = (seqs.astype(np.int64) << 32) + (pos.astype(np.int64) - _I32_MIN)
    key = _distinct(key)
    kseq = key >> 32
    start = np.concatenate(([0], (kseq[1:] != kseq[:-1]).nonzero()[0] + 1))
    end = np.concatenate((start[1:], [key.shape[0]]))
    kpos = (key & 0xFFFFFFFF) + _I32_MIN
    return kseq[start].tolist(), kpos[start].tolist(), kpos[end - 1].tolist(), (end - start).tolist()


# ----------------------------------------------------------------------------------------------------- allocator


class BatchAllocator:
    """Sanitises a :class:`Batch`, fills in its missing fields and splits it into :class:`UBatch` es."""

    __slots__ = (
        "n_pos_per_embd", "_debug",
        # the current batch (_batch is None when there is none: before init, after a failed init or
        # ubatch_reserve); the arrays below are read only while it is set
        "_batch", "_n", "_n_vocab", "_n_embd", "_n_seq_max", "_n_outputs", "_has_cpl",
        "_token", "_embd", "_pos_all", "_pos0", "_pos2d", "_n_seq_id", "_seq2d", "_seq0", "_output",
        "_seq_stats", "_seqs", "_grp",
        # sequence-set groups, built on first use by split_equal/split_seq
        "_gid", "_gorder", "_gstart", "_gsize", "_gmask", "_gseq", "_seq2g",
        # split state
        "_used", "_n_used", "_out_ids", "_hint",
    )

    def __init__(self, n_pos_per_embd: int = 1) -> None:
        if int(n_pos_per_embd) < 1:
            raise ValueError(f"n_pos_per_embd = {n_pos_per_embd}, expected >= 1")
        self.n_pos_per_embd = int(n_pos_per_embd)
        self._debug = _atoi(os.environ.get("LLAMA_BATCH_DEBUG"))
        self._n_vocab = self._n_embd = self._n_seq_max = 0
        self._has_cpl = False
        self._token = self._embd = self._pos_all = self._pos0 = self._pos2d = None
        self._n_seq_id = self._seq2d = self._seq0 = self._output = None
        self._seqs = self._grp = None
        self._gid = self._gorder = self._gstart = self._gsize = self._gmask = self._gseq = self._seq2g = None
        self._used = np.zeros(0, bool)
        self._hint = 0
        self._clear()

    # ------------------------------------------------------------------------------------------------ state

    def _clear(self) -> None:
        """Drop the batch: reset what the getters report (the per-batch arrays are replaced by the next init)."""
        self._batch = None
        self._n = 0
        self._n_outputs = 0
        self._seq_stats = {}
        self._n_used = 0
        self._out_ids = []

    def _require_batch(self, what: str) -> None:
        if self._batch is None:
            raise RuntimeError(f"BatchAllocator.{what}: no batch (call init() first; a failed init or "
                               f"ubatch_reserve() drops the batch)")

    # ------------------------------------------------------------------------------------------------ init

    def init(self, batch: Batch, n_vocab: int, memory: MemoryPositions | None, n_embd: int, n_seq_max: int,
             output_all: bool) -> None:
        """Validate ``batch`` and fill in its missing fields (llama_batch_allocr::init).

        Raises ValueError where llama.cpp returns false; the allocator then holds no batch and can be reused.
        """
        self._clear()
        if not isinstance(batch, Batch):
            raise TypeError(f"batch: expected a Batch, got {type(batch).__name__}")
        n = batch.n_tokens
        assert n > 0, "Batch guarantees at least one token"
        npe = self.n_pos_per_embd
        n_seq_max = int(n_seq_max)
        n_vocab = int(n_vocab)

        # -- validation of the input --------------------------------------------------------------------
        if n_seq_max > LLAMA_MAX_SEQ:
            raise ValueError(f"n_seq_max = {n_seq_max} > LLAMA_MAX_SEQ = {LLAMA_MAX_SEQ}")
        if n_seq_max < 1:
            raise ValueError(f"n_seq_max = {n_seq_max}, expected >= 1")

        token = batch.token
        if token is not None:
            # negative ids wrap to huge unsigned values: one comparison covers both ends of [0, n_vocab)
            if n == 1:
                nbad = not 0 <= int(token[0]) < n_vocab
            else:
                nbad = np.count_nonzero(token.view(np.uint32) >= n_vocab) if n_vocab > 0 else n
            if nbad:
                i = int(np.argmax((token < 0) | (token >= n_vocab)))
                raise ValueError(f"invalid token[{i}] = {int(token[i])}: token ids must be in [0, n_vocab={n_vocab})")
        elif batch.embd.shape[1] != n_embd:
            raise ValueError(f"embd: shape {batch.embd.shape}, expected [n_tokens={n}, n_embd={n_embd}]")

        seq2d = batch.seq_id
        if seq2d is None:
            n_seq_id = _ONE_N_SEQ_ID if n == 1 else _filled(n, 1)
            seq2d = _ONE_SEQ0 if n == 1 else np.zeros((n, 1), np.int32)
            has_cpl = False
        else:
            n_seq_id = batch.n_seq_id
            w = seq2d.shape[1]
            has_cpl = w > 1  # Batch trims seq_id to the widest row: w > 1 <=> some token has several ids
            if n == 1 and w == 1:
                nbad = not 0 <= int(seq2d[0, 0]) < n_seq_max
            elif not has_cpl:
                nbad = np.count_nonzero(seq2d.view(np.uint32) >= n_seq_max)
            else:  # every -1 of the padding counts as out of range: subtract them
                nbad = np.count_nonzero(seq2d.view(np.uint32) >= n_seq_max) - (n * w - int(n_seq_id.sum()))
            if nbad:
                bad = (seq2d < 0) | (seq2d >= n_seq_max)
                if has_cpl:
                    bad &= np.arange(w) < n_seq_id[:, None]
                i, k = divmod(int(np.argmax(bad)), w)
                raise ValueError(f"invalid seq_id[{i}][{k}] = {int(seq2d[i, k])}: sequence ids must be in "
                                 f"[0, n_seq_max={n_seq_max})")
        seq0 = seq2d[:, 0]
        # from here on every id is in [0, n_seq_max), so ``seq2d >= 0`` marks exactly the ids (not the padding)

        # the sequences present, ascending (llama.cpp walks all n_seq_max; the absent ones have no effect), and
        # for several sequences without coupling the tokens grouped by sequence, computed once and reused by the
        # positions, the statistics and the splits: grp = (sequence ids, stable argsort of seq0, start and size
        # of each sequence's run in that order)
        grp = None
        if batch.seq_id is None:
            seqs = [0]
        elif has_cpl:
            seqs = _present_seqs(seq2d[seq2d >= 0]).tolist()
        elif n == 1:
            seqs = [int(seq0[0])]
        else:
            per_seq = np.bincount(seq0)
            useq = per_seq.nonzero()[0]
            seqs = useq.tolist()
            if len(seqs) > 1:
                gsize = per_seq[useq]
                grp = (useq, seq0.argsort(kind="stable"), gsize.cumsum() - gsize, gsize)
        # last position of each present sequence in the memory (-1: empty, or no memory)
        mem_max = {s: int(memory.seq_pos_max(s)) for s in seqs} if memory is not None else dict.fromkeys(seqs, -1)

        # -- positions --------------------------------------------------------------------------------------
        # stats[s] = (min, max, number of distinct positions) of sequence s in the batch
        stats: dict[int, tuple[int, int, int]] | None = None
        pos_in = batch.pos
        if pos_in is None:
            if batch.embd is not None and npe > 1:
                # llama.cpp would fill one position per embedding and then read n_pos_per_embd of them
                raise ValueError(f"pos: None, but embeddings with n_pos_per_embd = {npe} need explicit positions "
                                 f"[{npe}, n_tokens={n}]")
            if has_cpl:
                pos0 = self._auto_pos_coupled(n, seqs, mem_max, seq2d, n_seq_id)
            elif grp is None:
                p = mem_max[seqs[0]] + 1
                pos0 = np.arange(p, p + n, dtype=np.int32)
                stats = {seqs[0]: (p, p + n - 1, n)}
            else:
                # each token takes the next position of its sequence: in the grouped order, the j-th token
                # overall, in the run of sequence g that starts at gstart[g], gets base[g] + j - gstart[g]
                _, order, gstart, gsize = grp
                base = [mem_max[s] + 1 for s in seqs]
                pos0 = np.empty(n, np.int32)
                pos0[order] = (np.array(base, np.int64) - gstart).repeat(gsize) + np.arange(n)
                stats = {s: (b, b + c - 1, c) for s, b, c in zip(seqs, base, gsize.tolist())}
            pos_all = pos0
            n_pos_in = 1
        else:
            n_pos_in = pos_in.shape[0] // n
            if n_pos_in != 1 and n_pos_in != npe:
                raise ValueError(f"pos: {n_pos_in} positions per token, expected 1 or n_pos_per_embd = {npe}")
            if batch.embd is not None and npe > 1 and n_pos_in != npe:
                raise ValueError(f"pos: {n_pos_in} position per embedding, expected n_pos_per_embd = {npe} "
                                 f"([{npe}, n_tokens={n}])")
            pos_all = pos_in
            pos0 = pos_in[:n]

        # -- outputs ----------------------------------------------------------------------------------------
        output = batch.logits
        if output is None:
            if n == 1:
                output = _ONE_OUT
            elif output_all:
                output = np.ones(n, np.int8)
            else:
                output = np.zeros(n, np.int8)
                output[-1] = 1
            n_outputs = n if output_all else 1
        else:
            n_outputs = int(output[0] != 0) if n == 1 else int(np.count_nonzero(output))
            if output_all and n_outputs < n:
                logger.warning("init: embeddings required but some input tokens were not marked as outputs -> "
                               "overriding")
                output = np.ones(n, np.int8)
                n_outputs = n

        # -- per-sequence position statistics of given positions -------------------------------------------
        if stats is None:
            if n == 1:
                p = int(pos0[0])
                stats = {s: (p, p, 1) for s in seqs}
            elif grp is None and not has_cpl:
                if not np.count_nonzero(pos0[1:] - pos0[:-1] != 1):  # the usual prompt: consecutive positions
                    stats = {seqs[0]: (int(pos0[0]), int(pos0[-1]), n)}
                else:
                    lo, hi = int(pos0.min()), int(pos0.max())
                    if hi - lo < n:  # the positions fit a range of n: count the distinct ones without sorting
                        cnt = int(np.count_nonzero(np.bincount(pos0 - lo)))
                    else:
                        cnt = int(_distinct(pos0).shape[0])
                    stats = {seqs[0]: (lo, hi, cnt)}
            else:
                if grp is not None:
                    _, order, gstart, gsize = grp
                    ps = pos0[order]
                    step = (ps[1:] - ps[:-1]) == 1
                    step[gstart[1:] - 1] = True  # the step from one sequence's run to the next does not count
                    if not np.count_nonzero(~step):  # every sequence at consecutive positions in batch order
                        stats = {s: (a, b, c) for s, a, b, c in zip(seqs, ps[gstart].tolist(),
                                                                     ps[gstart + gsize - 1].tolist(),
                                                                     gsize.tolist())}
                if stats is None:
                    if has_cpl:
                        useq_l, smin, smax, scnt = _seq_pos_stats(seq2d[seq2d >= 0], pos0.repeat(n_seq_id))
                    else:
                        useq_l, smin, smax, scnt = _seq_pos_stats(seq0, pos0)
                    assert useq_l == seqs
                    stats = {s: (a, b, c) for s, a, b, c in zip(useq_l, smin, smax, scnt)}

        if self._debug > 0:
            self._print_input(batch, pos_all, seqs, seq2d, n_seq_id, output, n_outputs, stats)

        # -- consistency with the memory and within the batch -----------------------------------------------
        for s in seqs:
            lo, hi, cnt = stats[s]
            p0 = mem_max[s]
            if npe > 1:
                # M-RoPE: positions may jump forward, never back (embeddings may repeat the last one)
                if p0 >= 0 and (p0 >= lo if token is not None else p0 > lo):
                    rel = "X < Y" if token is not None else "X <= Y"
                    i = self._first_at(s, lo, pos0, seq2d)
                    raise ValueError(
                        f"the tokens of sequence {s} have inconsistent positions: the memory's last position for "
                        f"sequence {s} is X = {p0}, the batch's first position (token {i}) is Y = {lo}; for M-RoPE "
                        f"it is required that {rel}")
            else:
                if p0 >= 0 and lo != p0 + 1:
                    i = self._first_at(s, lo, pos0, seq2d)
                    raise ValueError(
                        f"the tokens of sequence {s} have inconsistent positions: the memory's last position for "
                        f"sequence {s} is X = {p0}, the batch's first position (token {i}) is Y = {lo}; positions "
                        f"must stay consecutive: Y = X + 1 = {p0 + 1}")
                if hi - lo + 1 > cnt:
                    missing = self._first_missing(s, pos0, seq2d)
                    raise ValueError(f"sequence {s} positions are not continuous: {cnt} distinct positions span "
                                     f"[{lo}, {hi}]; position {missing} is missing")

        if memory is not None and has_cpl:
            # pairs (a, b): a is a later id of a token whose first id is b; ascending, as llama.cpp walks them
            rows = (n_seq_id > 1).nonzero()[0]
            sub = seq2d[rows]
            valid = sub[:, 1:] >= 0
            a = sub[:, 1:][valid]
            b = np.broadcast_to(sub[:, :1], (sub.shape[0], sub.shape[1] - 1))[valid]
            for key in _distinct((a.astype(np.int64) << 16) | b).tolist():
                sa, sb = key >> 16, key & 0xFFFF
                if (memory.seq_pos_min(sa) != memory.seq_pos_min(sb)
                        or memory.seq_pos_max(sa) != memory.seq_pos_max(sb)):
                    raise ValueError(
                        f"sequence {sa} is coupled to {sb} in the input batch, but they have diverged in the "
                        f"memory: [{memory.seq_pos_min(sa)}, {memory.seq_pos_max(sa)}] vs "
                        f"[{memory.seq_pos_min(sb)}, {memory.seq_pos_max(sb)}]")

        # llama.cpp's last check walks the tokens with a per-sequence "current position" that starts at -1 and
        # is never advanced, so it rejects exactly the positions below -1 (first such token, its first sequence).
        # Its companion check (a sequence whose tokens' sets have an empty intersection) cannot fire: every
        # such set contains the sequence itself.
        if min(st[0] for st in stats.values()) < -1:
            i = int(np.argmax(pos0 < -1))
            raise ValueError(f"sequence {int(seq0[i])} positions are decreasing (not allowed): pos[{i}] = "
                             f"{int(pos0[i])} < -1")

        # -- commit -----------------------------------------------------------------------------------------
        self._batch = batch
        self._n = n
        self._n_vocab, self._n_embd, self._n_seq_max = n_vocab, int(n_embd), n_seq_max
        self._n_outputs = n_outputs
        self._has_cpl = has_cpl
        self._token = token
        self._embd = batch.embd
        self._pos_all = pos_all
        self._pos0 = pos0
        self._pos2d = pos_all.reshape(npe, n) if (npe > 1 and n_pos_in == npe and token is None) else None
        self._n_seq_id = n_seq_id
        self._seq2d = seq2d
        self._seq0 = seq0
        self._output = output
        self._seq_stats = stats
        self._seqs = seqs
        self._grp = grp
        self._gorder = None
        self.split_reset()

    @staticmethod
    def _auto_pos_coupled(n: int, seqs: list[int], mem_max: dict[int, int], seq2d: np.ndarray,
                          n_seq_id: np.ndarray) -> np.ndarray:
        """Positions continued from the memory when tokens have several sequences.

        llama.cpp walks the tokens: a token starts at its first sequence's next position and moves all of its
        sequences one past it.  So token i's parent is the last earlier token that has i's first sequence among
        its ids; a token without one (a root) starts at the memory's next position of its first sequence; and
        pos[i] = that start of i's root + i's depth in this forest, found by pointer jumping (log2 n steps)."""
        tok = np.arange(n)
        first = seq2d[:, 0].astype(np.int64)
        # (sequence, token) pairs as sorted keys sequence*n + token
        key = seq2d[seq2d >= 0].astype(np.int64) * n + tok.repeat(n_seq_id)
        key.sort()
        k = key.searchsorted(first * n + tok) - 1  # the last pair before token i's own, in i's first sequence
        prev = key[np.maximum(k, 0)]
        has_parent = (k >= 0) & (prev // n == first)
        jump = np.where(has_parent, prev % n, tok)  # roots point at themselves
        depth = has_parent.astype(np.int64)
        while True:
            nxt = jump[jump]
            if not np.count_nonzero(nxt != jump):
                break
            depth = depth + depth[jump]
            jump = nxt
        start = np.zeros(LLAMA_MAX_SEQ, np.int64)
        start[seqs] = [mem_max[s] + 1 for s in seqs]
        return (start[first[jump]] + depth).astype(np.int32)

    @staticmethod
    def _tokens_of(s: int, seq2d: np.ndarray) -> np.ndarray:
        return (seq2d == s).any(axis=1) if seq2d.shape[1] > 1 else seq2d[:, 0] == s

    def _first_at(self, s: int, p: int, pos0: np.ndarray, seq2d: np.ndarray) -> int:
        """Index of the first token of sequence s at position p (error messages only)."""
        return int(np.argmax(self._tokens_of(s, seq2d) & (pos0 == p)))

    def _first_missing(self, s: int, pos0: np.ndarray, seq2d: np.ndarray) -> int:
        """The smallest position that sequence s lacks between its min and max (error messages only)."""
        have = _distinct(pos0[self._tokens_of(s, seq2d)])
        gaps = np.flatnonzero(np.diff(have) > 1)
        assert gaps.size, "called only for a non-continuous sequence"
        return int(have[gaps[0]]) + 1

    # ------------------------------------------------------------------------------------------------ getters

    def get_batch(self) -> Batch:
        """The batch with every field filled in (positions, sequence ids, output flags)."""
        self._require_batch("get_batch")
        b = object.__new__(Batch)
        b.token, b.embd, b.pos = self._token, self._embd, self._pos_all
        b.n_seq_id, b.seq_id, b.logits, b.n_tokens = self._n_seq_id, self._seq2d, self._output, self._n
        return b

    def get_n_tokens(self) -> int:
        return self._n

    def get_n_outputs(self) -> int:
        return self._n_outputs

    def get_n_used(self) -> int:
        return self._n_used

    def get_out_ids(self) -> np.ndarray:
        """int32 batch indices of the output tokens, in the order the splits produced them."""
        if not self._out_ids:
            return np.zeros(0, np.int32)
        return np.concatenate(self._out_ids).astype(np.int32)

    def seq_pos_min(self, seq_id: int) -> int:
        """Smallest position of sequence ``seq_id`` in the batch, -1 if absent."""
        if not 0 <= seq_id < LLAMA_MAX_SEQ:
            raise ValueError(f"seq_id = {seq_id}, expected in [0, {LLAMA_MAX_SEQ})")
        st = self._seq_stats.get(seq_id)
        return -1 if st is None else st[0]

    def seq_pos_max(self, seq_id: int) -> int:
        """Largest position of sequence ``seq_id`` in the batch, -1 if absent."""
        if not 0 <= seq_id < LLAMA_MAX_SEQ:
            raise ValueError(f"seq_id = {seq_id}, expected in [0, {LLAMA_MAX_SEQ})")
        st = self._seq_stats.get(seq_id)
        return -1 if st is None else st[1]

    # ------------------------------------------------------------------------------------------------ splits

    def split_reset(self) -> None:
        """Mark every token unused and forget the output ids (done by init)."""
        self._require_batch("split_reset")
        self._used = np.zeros(self._n, bool)
        self._n_used = 0
        self._out_ids = []
        self._hint = 0

    def _first_unused(self) -> int:
        """The first unused token (n if none).  Tokens before the hint are used, and stay used until
        split_reset, so the search resumes there."""
        h, n, used = self._hint, self._n, self._used
        if h < n and used[h]:
            free = (~used[h:]).nonzero()[0]
            h = h + int(free[0]) if free.shape[0] else n
            self._hint = h
        return h

    @staticmethod
    def _check_n_ubatch(n_ubatch: int) -> int:
        n_ubatch = int(n_ubatch)
        if n_ubatch < 0:
            raise ValueError(f"n_ubatch = {n_ubatch}, expected >= 0")
        return n_ubatch

    def split_simple(self, n_ubatch: int) -> UBatch:
        """Up to n_ubatch tokens in batch order from the first unused one; sequence sets of any lengths."""
        self._require_batch("split_simple")
        n_ubatch = self._check_n_ubatch(n_ubatch)
        h = self._first_unused()
        if h >= self._n:
            return _empty_ubatch()
        # as llama.cpp: the run after the first unused token is taken whole (always at least one token)
        k = max(1, min(n_ubatch, self._n - h))
        self._used[h:h + k] = True
        self._n_used += k
        seqs = self._seqs
        unq = np.array(seqs, np.int32) if len(seqs) == 1 else None
        return self._ubatch_add(np.arange(h, h + k), k, False, unq)

    def split_equal(self, n_ubatch: int, sequential: bool) -> UBatch:
        """Sequence sets that share no sequence, the same number of tokens from each.

        With ``sequential`` the sets are single sequences with consecutive ids; coupled sequences then make the
        split fail (logged, empty ubatch) as in llama.cpp.
        """
        self._require_batch("split_equal")
        n_ubatch = self._check_n_ubatch(n_ubatch)
        if sequential and self._has_cpl:
            logger.error("split_equal: sequential split is not supported when there are coupled sequences in the "
                         "input batch (you may need to use the -kvu flag)")
            return _empty_ubatch()
        h = self._first_unused()
        n = self._n
        if h >= n:
            return _empty_ubatch()
        if self._grp is None and not self._has_cpl:
            # one sequence: one set whose unused tokens are h.., as many rounds as n_ubatch allows
            k = min(n - h, max(1, n_ubatch))
            self._used[h:h + k] = True
            self._n_used += k
            return self._ubatch_add(np.arange(h, h + k), 1, True, np.array(self._seqs, np.int32))

        self._ensure_groups()
        gorder, gstart, gsize = self._gorder, self._gstart, self._gsize
        used = self._used
        n_used_g = np.bincount(self._gid[used], minlength=gsize.shape[0])
        lo = gstart + n_used_g  # each group's first unused member: its used members are a prefix
        rem = gsize - n_used_g
        rem_l = rem.tolist()

        if not sequential:
            # the token scan meets each group first at the group's first unused token and decides there, so
            # visiting the groups in that order is the same scan
            live = rem.nonzero()[0]
            cand = live[gorder[lo[live]].argsort()].tolist()
            if not self._has_cpl:
                taken = cand[:n_ubatch + 1]  # distinct sequences never overlap
            else:
                gmask = self._gmask
                taken, acc = [], 0
                for g in cand:
                    m = gmask[g]
                    if m & acc:
                        continue
                    taken.append(g)
                    acc |= m
                    if len(taken) > n_ubatch:
                        break
        else:
            # groups are single sequences here.  The scan accepts the first unused token (h), then the first
            # unused token of the next sequence id after the last accepted token, and so on
            seq2g = self._seq2g
            s = int(self._seq0[h])
            t_prev = h
            taken = [seq2g[s]]
            lo_l = lo.tolist()
            while len(taken) <= n_ubatch:
                s += 1
                g = seq2g.get(s)
                if g is None or not rem_l[g]:
                    break
                a = lo_l[g]
                t = int(gorder[a])
                if t <= t_prev:
                    b = a + rem_l[g]
                    k = a + int(gorder[a:b].searchsorted(t_prev, side="right"))
                    if k >= b:
                        break
                    t = int(gorder[k])
                taken.append(g)
                t_prev = t

        n_seqs = len(taken)
        n_rounds = min(min(rem_l[g] for g in taken), max(1, n_ubatch // n_seqs))
        chosen = np.array(taken, np.intp)
        if n_rounds == 1:
            idxs = gorder[lo[chosen]]
        else:
            idxs = gorder[(lo[chosen][:, None] + np.arange(n_rounds)).reshape(-1)]
        used[idxs] = True
        self._n_used += idxs.shape[0]
        if self._has_cpl:
            unq = None
        else:
            unq = self._gseq[chosen]
            if n_seqs > 1:
                unq.sort()
        return self._ubatch_add(idxs, n_seqs, True, unq)

    def split_seq(self, n_ubatch: int) -> UBatch:
        """From the first unused token on, the tokens whose set is a subset of the last accepted one's."""
        self._require_batch("split_seq")
        n_ubatch = self._check_n_ubatch(n_ubatch)
        h = self._first_unused()
        n = self._n
        if h >= n:
            return _empty_ubatch()
        cap = max(1, n_ubatch)
        if not self._has_cpl:
            # the only subset of {s} is {s}: the sequence's unused tokens, which start at h
            s = int(self._seq0[h])
            unq = np.array([s], np.int32)
            if self._grp is None:
                idxs = np.arange(h, min(n, h + cap))
            else:
                self._ensure_groups()
                gorder = self._gorder
                g = self._seq2g[s]
                a = int(self._gstart[g])
                b = a + int(self._gsize[g])
                k = a + int(gorder[a:b].searchsorted(h))
                idxs = gorder[k:min(b, k + cap)]
        else:
            self._ensure_groups()
            gid, used, gmask = self._gid, self._used, self._gmask
            g = int(gid[h])
            unq = None
            parts = [np.array([h], np.intp)]
            taken = 1
            p = h
            while taken < cap:
                # the unused tokens after p whose set is a subset of the current one, in batch order; the first
                # of another group (a strict subset) becomes the current set
                cur = gmask[g]
                ok = np.array([(m & ~cur) == 0 for m in gmask], bool)
                cand = (ok[gid[p + 1:]] & ~used[p + 1:]).nonzero()[0] + (p + 1)
                if cand.shape[0] == 0:
                    break
                change = (gid[cand] != g).nonzero()[0]
                room = cap - taken
                if change.shape[0] == 0 or change[0] >= room:
                    parts.append(cand[:room])
                    taken += min(room, cand.shape[0])
                    break
                e = int(change[0])
                parts.append(cand[:e + 1])
                taken += e + 1
                p = int(cand[e])
                g = int(gid[p])
            idxs = np.concatenate(parts) if len(parts) > 1 else parts[0]
        self._used[idxs] = True
        self._n_used += idxs.shape[0]
        return self._ubatch_add(idxs, 1, True, unq)

    def _ensure_groups(self) -> None:
        """The tokens grouped by sequence set, built on first use (split_simple does not need them).

        Without coupling the groups are init's per-sequence runs.  With coupling each token's set becomes
        uint64 bitset words (a bitwise-or over its ids) and a lexsort of the words groups equal sets, stably;
        each group's set is also kept as a Python int for the overlap and subset tests."""
        if self._gorder is not None:
            return
        n = self._n
        if not self._has_cpl:
            gseq, gorder, gstart, gsize = self._grp
            gid = np.empty(n, np.intp)
            gid[gorder] = np.arange(gsize.shape[0]).repeat(gsize)
            self._gseq = gseq.astype(np.int32)
            self._seq2g = {s: g for g, s in enumerate(self._seqs)}
            self._gmask = None
        else:
            seq2d, cnt = self._seq2d, self._n_seq_id
            vals = seq2d[seq2d >= 0].astype(np.uint64)
            word = (vals >> np.uint64(6)).astype(np.intp)
            bit = np.uint64(1) << (vals & np.uint64(63))
            tok_start = cnt.cumsum() - cnt  # every token has at least one id: no empty segment
            n_words = int(word.max()) + 1
            assert n_words <= SEQ_WORDS
            words = [np.bitwise_or.reduceat(np.where(word == j, bit, np.uint64(0)), tok_start) for j in range(n_words)]
            gorder = np.lexsort(words[::-1])  # stable: a group's members stay in batch order
            keys = np.stack(words)[:, gorder]
            new = np.ones(n, bool)
            new[1:] = (keys[:, 1:] != keys[:, :-1]).any(axis=0)
            gstart = new.nonzero()[0]
            gsize = np.diff(np.append(gstart, n))
            gid = np.empty(n, np.intp)
            gid[gorder] = new.cumsum() - 1
            self._gmask = [sum(int(x) << (64 * j) for j, x in enumerate(col)) for col in keys[:, gstart].T.tolist()]
            self._gseq = None
            self._seq2g = None
        self._gid = gid
        self._gorder = gorder
        self._gstart = gstart
        self._gsize = gsize

    def _ubatch_add(self, idxs: np.ndarray, n_seqs: int, equal_seqs: bool, unq: np.ndarray | None) -> UBatch:
        """Gather the tokens ``idxs`` (n_seqs sets of equal length, in order) into a new UBatch.

        ``unq``: the ubatch's distinct sequence ids (a fresh int32 array, ascending) when the splitter knows them."""
        n_tokens = idxs.shape[0]
        assert n_tokens % n_seqs == 0, f"{n_tokens} tokens do not split into {n_seqs} equal sequence sets"
        npe = self.n_pos_per_embd
        token = self._token[idxs] if self._token is not None else None
        embd = self._embd[idxs] if self._embd is not None else None
        if npe == 1:
            pos = self._pos0[idxs]
        elif self._pos2d is None:
            # text (or single-row positions) under M-RoPE: the same position in every section
            pos = np.tile(self._pos0[idxs], npe)
        else:
            pos = self._pos2d[:, idxs].reshape(-1)
        n_seq_id = self._n_seq_id[idxs]
        output = self._output[idxs]
        seq_id = self._seq2d[idxs]
        if self._has_cpl:
            w = int(n_seq_id.max())
            if w < seq_id.shape[1]:
                seq_id = np.ascontiguousarray(seq_id[:, :w])
            if unq is None:
                unq = _present_seqs(seq_id[seq_id >= 0])
        elif unq is None:
            unq = seq_id[:, 0].copy() if n_tokens == 1 else _present_seqs(seq_id)
        n_unq = unq.shape[0]
        seq_idx = _SEQ_IDX_NONE.copy()
        if n_unq == 1:
            seq_idx[unq[0]] = 0
        else:
            seq_idx[unq] = np.arange(n_unq, dtype=np.int32)
        # output ids, skipping the mask when the batch's outputs are all or nothing
        n_out = self._n_outputs
        if n_out == self._n:
            self._out_ids.append(idxs)
        elif n_out:
            if n_tokens == 1:
                if output[0]:
                    self._out_ids.append(idxs)
            else:
                outs = idxs[output != 0]
                if outs.shape[0]:
                    self._out_ids.append(outs)
        ub = UBatch(n_tokens=n_tokens, n_seq_tokens=n_tokens // n_seqs, n_seqs=n_seqs, n_seqs_unq=n_unq,
                    n_pos=npe, b_equal_seqs=equal_seqs, token=token, embd=embd, pos=pos, n_seq_id=n_seq_id,
                    seq_id=seq_id, seq_id_unq=unq, seq_idx=seq_idx, output=output)
        if self._debug > 0:
            logger.debug("ubatch_add: added ubatch to split:")
            self._print_ubatch(ub)
        return ub

    def ubatch_reserve(self, n_seq_tokens: int, n_seqs: int) -> UBatch:
        """A zero-filled ubatch of n_seqs sequences (ids 0..n_seqs-1) x n_seq_tokens tokens, for graph
        reservation and state loading; the caller fills it.  Drops the current batch."""
        n_seq_tokens, n_seqs = int(n_seq_tokens), int(n_seqs)
        if n_seq_tokens < 0 or not 0 <= n_seqs <= LLAMA_MAX_SEQ:
            raise ValueError(f"ubatch_reserve(n_seq_tokens={n_seq_tokens}, n_seqs={n_seqs}): expected "
                             f"n_seq_tokens >= 0 and n_seqs in [0, {LLAMA_MAX_SEQ}]")
        self._clear()
        n_tokens = n_seq_tokens * n_seqs
        seq_idx = _SEQ_IDX_NONE.copy()
        seq_idx[:n_seqs] = np.arange(n_seqs, dtype=np.int32)
        return UBatch(n_tokens=n_tokens, n_seq_tokens=n_seq_tokens, n_seqs=n_seqs, n_seqs_unq=n_seqs,
                      n_pos=self.n_pos_per_embd, b_equal_seqs=True, token=np.zeros(n_tokens, np.int32), embd=None,
                      pos=np.zeros(n_tokens * self.n_pos_per_embd, np.int32), n_seq_id=np.zeros(n_tokens, np.int32),
                      seq_id=np.full((n_tokens, 1), -1, np.int32), seq_id_unq=np.arange(n_seqs, dtype=np.int32),
                      seq_idx=seq_idx, output=np.zeros(n_tokens, np.int8))

    # ------------------------------------------------------------------------------------------------ debug

    def _print_input(self, batch: Batch, pos_all: np.ndarray, seqs: list[int], seq2d: np.ndarray,
                     n_seq_id: np.ndarray, output: np.ndarray, n_outputs: int,
                     stats: dict[int, tuple[int, int, int]]) -> None:
        n = batch.n_tokens
        unq = np.array(seqs, np.int32)
        seq_idx = _SEQ_IDX_NONE.copy()
        seq_idx[unq] = np.arange(unq.shape[0], dtype=np.int32)
        logger.debug("init: input batch info:")
        self._print_ubatch(UBatch(
            n_tokens=n, n_seq_tokens=1, n_seqs=n, n_seqs_unq=unq.shape[0], n_pos=self.n_pos_per_embd,
            b_equal_seqs=False, token=batch.token, embd=batch.embd, pos=pos_all[:n], n_seq_id=n_seq_id,
            seq_id=seq2d, seq_id_unq=unq, seq_idx=seq_idx, output=output), n_outputs)
        # coupled partners: s -> the first ids of the tokens where s is a later id
        cpl: dict[int, set[int]] = {}
        for k, row in zip(n_seq_id.tolist(), seq2d.tolist()):
            for s in row[1:k]:
                cpl.setdefault(s, set()).add(row[0])
        logger.debug("init:   seq       = [")
        for s in seqs:
            partners = " ".join(str(x) for x in sorted(cpl.get(s, ()))) or "-"
            logger.debug("init:  %4d: pos = [%4d, %4d], cpl = %s", s, stats[s][0], stats[s][1], partners)
        logger.debug("init:   ]")

    def _print_ubatch(self, ub: UBatch, n_outputs: int | None = None) -> None:
        logger.debug("ubatch_print:   equal_seqs   = %d", ub.equal_seqs())
        logger.debug("ubatch_print:   n_tokens     = %d", ub.n_tokens)
        logger.debug("ubatch_print:   n_seq_tokens = %d", ub.n_seq_tokens)
        logger.debug("ubatch_print:   n_seqs       = %d", ub.n_seqs)
        logger.debug("ubatch_print:   n_seqs_unq   = %d", ub.n_seqs_unq)
        logger.debug("ubatch_print:   token      = %s", None if ub.token is None else f"int32[{ub.token.shape[0]}]")
        logger.debug("ubatch_print:   embd       = %s", None if ub.embd is None else f"float32{list(ub.embd.shape)}")
        logger.debug("ubatch_print:   pos        = int32[%d]", ub.pos.shape[0])
        logger.debug("ubatch_print:   seq_id_unq = [ %s]", "".join(f"{s} " for s in ub.seq_id_unq.tolist()))
        logger.debug("ubatch_print:   seq_idx    = [%s]",
                     "".join("." if v < 0 else str(v % 10) for v in ub.seq_idx.tolist()))
        logger.debug("ubatch_print:   n_outputs  = %d", self._n_outputs if n_outputs is None else n_outputs)
        if self._debug > 1:
            width = int(ub.seq_id.max()) + 1 if ub.seq_id.size else 1
            logger.debug("ubatch_print:   token     = [")
            for i in range(ub.n_tokens):
                ids = set(ub.seq_id[i, :int(ub.n_seq_id[i])].tolist())
                mark = "".join(str(s % 10) if s in ids else "." for s in range(width))
                what = f"id = {int(ub.token[i]):6d}" if ub.token is not None else "[embd]"
                logger.debug("ubatch_print:  %4d: %s, pos = %4d, n_seq_id = %2d, seq_id = [%s], output = %d",
                             i, what, int(ub.pos[i]), int(ub.n_seq_id[i]), mark, int(ub.output[i]))
            logger.debug("ubatch_print:   ]")
