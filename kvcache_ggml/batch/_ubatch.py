"""One micro-batch (``llama_ubatch``) and the numpy helpers of the allocator: distinct values, present sequences,
per-sequence position statistics, the grouping of tokens by sequence, and the debug print of a ubatch."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from .._consts import LLAMA_MAX_SEQ
from ._input import _I32_MIN

logger = logging.getLogger("kvcache_ggml.batch")


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
_TOKEN_IDS = _frozen(np.arange(LLAMA_MAX_SEQ))  # batch indices 0..n-1 of a decode step's tokens: _TOKEN_IDS[:n]
_TOKEN_ID_VIEWS = [_TOKEN_IDS[:n] for n in range(LLAMA_MAX_SEQ + 1)]  # ... made once per n (a step takes one)
_DECODE_SETS: dict[int | tuple[int, ...], tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}


def _decode_arrays(ids: int | tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The arrays of a decode ubatch that depend only on its sequences -- token i has the one sequence ids[i], all
    distinct (an int: the one sequence of a one-token ubatch): (seq_id int32 [n, 1], n_seq_id int32 [n] of ones,
    seq_id_unq int32 [n] ascending, seq_idx int32 [LLAMA_MAX_SEQ]), read-only and shared by the ubatches of the
    same sequences (the last 64 sets are kept)."""
    arrs = _DECODE_SETS.get(ids)
    if arrs is None:
        if type(ids) is int:
            ids = (ids,)
        n = len(ids)
        unq = np.array(sorted(ids), np.int32)
        seq_idx = _SEQ_IDX_NONE.copy()
        seq_idx[unq] = np.arange(n, dtype=np.int32)
        arrs = (_frozen(np.array(ids, np.int32).reshape(n, 1)), _frozen(np.ones(n, np.int32)), _frozen(unq),
                _frozen(seq_idx))
        if len(_DECODE_SETS) >= 64:
            _DECODE_SETS.clear()
        _DECODE_SETS[ids if n > 1 else ids[0]] = arrs
    return arrs


@dataclass(slots=True, eq=False)
class UBatch:
    """One micro-batch (``llama_ubatch``); it owns its arrays (a decode step's ubatch shares the read-only ones
    that only depend on its sequences: see ``_decode_arrays``).  ``n_tokens == 0`` marks "nothing left"."""

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
    # a one-token decode ubatch's (sequence, position) as Python ints, the values of its seq_id and pos arrays (the
    # step's placement and mask read them without numpy); None for any other ubatch
    one: tuple[int, int] | None = None

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


def _print_ubatch(ub: UBatch, n_outputs: int, detail: bool) -> None:
    """Log ``ub`` at DEBUG level as llama.cpp's ubatch_print does (``detail``: one line per token too)."""
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
    logger.debug("ubatch_print:   n_outputs  = %d", n_outputs)
    if detail:
        width = int(ub.seq_id.max()) + 1 if ub.seq_id.size else 1
        logger.debug("ubatch_print:   token     = [")
        for i in range(ub.n_tokens):
            ids = set(ub.seq_id[i, :int(ub.n_seq_id[i])].tolist())
            mark = "".join(str(s % 10) if s in ids else "." for s in range(width))
            what = f"id = {int(ub.token[i]):6d}" if ub.token is not None else "[embd]"
            logger.debug("ubatch_print:  %4d: %s, pos = %4d, n_seq_id = %2d, seq_id = [%s], output = %d",
                         i, what, int(ub.pos[i]), int(ub.n_seq_id[i]), mark, int(ub.output[i]))
        logger.debug("ubatch_print:   ]")


def seq_groups(seq0: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Tokens grouped by their (only) sequence id ``seq0`` int32 [n]: (the sequence ids present, ascending; the
    stable argsort of ``seq0``; start and size of each sequence's run in that order)."""
    per_seq = np.bincount(seq0)
    useq = per_seq.nonzero()[0]
    gsize = per_seq[useq]
    return useq, seq0.argsort(kind="stable"), gsize.cumsum() - gsize, gsize
