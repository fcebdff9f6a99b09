"""The decode step's fast path through :meth:`BatchAllocator.init`: a batch of n tokens of n distinct sequences, one
sequence each (one token of one sequence: the common step).

:meth:`DecodeInit._init_decode` checks and fills such a batch with scalar Python (a handful of numpy calls for
n > 1) and commits exactly what the general sections would: the same arrays (the caller's where the general path keeps
them), the same positions, statistics and output flags.  Two things differ, neither visible: the sequence groups
that only split_equal and split_seq read are built on their first use (:meth:`BatchSplitter._ensure_groups`), and
a batch that the general path would reject (or log, or warn about) is not handled here at all -- ``_init_decode``
returns False before changing anything and the general path runs, raising its own error.  The equivalence test
(tests/test_decode_fast_path.py) runs both paths on the same random traces.
"""
from __future__ import annotations

from itertools import repeat

import numpy as np

from .._consts import INT32_MAX, LLAMA_MAX_SEQ
from ._input import Batch, MemoryPositions
from ._ubatch import _ONE_N_SEQ_ID, _ONE_OUT, _ONE_SEQ0, _TOKEN_ID_VIEWS, _TOKEN_IDS

_NEXT = (1).__add__  # m -> m + 1 (NotImplemented for a non-int: then the loop decides)
_TOKEN_ID0 = _TOKEN_IDS[:1]  # the output ids of a one-token batch (a view of _TOKEN_IDS: out_ids_in_order)



class DecodeInit:
    """The decode step's fast path of :class:`~._allocator.BatchAllocator` (a mixin: its methods read and commit the
    allocator's own state, as its general sections do)."""

    __slots__ = ()

    def _init_decode(self, batch: Batch, n_vocab: int, memory: MemoryPositions | None, n_seq_max: int,
                     output_all: bool) -> bool:
        """Validate, fill and commit a decode batch (n tokens, n distinct sequences, one each); False when ``batch``
        is not one, or would be rejected: the general path then decides."""
        if batch.token is None or self.n_pos_per_embd != 1 or not 1 <= n_seq_max <= LLAMA_MAX_SEQ:
            return False
        try:
            if batch.n_tokens == 1:
                return self._init_one(batch, n_vocab, memory, n_seq_max, output_all) is not None
            return self._init_many(batch, n_vocab, memory, n_seq_max, output_all) is not None
        except BaseException:  # the memory raised: no batch, as after the general path's failure
            self._clear()
            raise

    def _init_one(self, batch: Batch, n_vocab: int, memory: MemoryPositions | None, n_seq_max: int,
                  output_all: bool) -> tuple[int, int] | None:
        """_init_decode of one token, with scalar Python: (its sequence, its position), or None."""
        if not 0 <= batch.token.item(0) < n_vocab:
            return None
        seq2d = batch.seq_id
        if seq2d is None:
            seq2d, n_seq_id, s = _ONE_SEQ0, _ONE_N_SEQ_ID, 0
        else:
            if seq2d.shape[1] != 1:
                return None
            s, n_seq_id = seq2d.item(0), batch.n_seq_id
            if not 0 <= s < n_seq_max:
                return None
        m = -1 if memory is None else memory.seq_pos_max(s)
        pos_all = batch.pos
        if pos_all is None:
            p = m + 1
            if p > INT32_MAX:
                return None
            pos_all = pos0 = np.array([p], np.int32)
        else:
            if len(pos_all) != 1:  # (1-D)
                return None
            pos0, p = pos_all, pos_all.item(0)  # (shape (1,): the whole array)
        if p < -1 or (m >= 0 and p != m + 1):  # (the general path's errors)
            return None
        output = batch.logits
        if output is None:
            output, n_outputs = _ONE_OUT, 1
        else:
            n_outputs = int(output.item(0) != 0)
            if output_all and not n_outputs:
                return None  # the general path warns and overrides
        self._commit(batch, pos_all, pos0, seq2d, seq2d[0], n_seq_id, False, [s], None, {s: (p, p, 1)}, output,
                     n_outputs)  # (seq2d[0]: seq2d[:, 0] of its one row)
        return s, p

    def _init_many(self, batch: Batch, n_vocab: int, memory: MemoryPositions | None, n_seq_max: int,
                   output_all: bool) -> tuple[list[int], list[int]] | None:
        """_init_decode of n > 1 tokens: Python lists of at most n_seq_max values, a few numpy calls; (each token's
        sequence, each token's position) as lists, or None."""
        n, token, seq2d = batch.n_tokens, batch.token, batch.seq_id
        if seq2d is None or seq2d.shape[1] != 1 or n > n_seq_max:
            return None
        ids = seq2d.reshape(n).tolist()
        seqs = sorted(ids)
        if seqs[0] < 0 or seqs[-1] >= n_seq_max or len(set(ids)) != n:
            return None
        tl = token.tolist()  # (a few tokens: min/max of a list cost less than a numpy comparison and count)
        if min(tl) < 0 or max(tl) >= n_vocab:
            return None
        # the memory's last position of each token's sequence
        mems = [-1] * n if memory is None else list(map(memory.seq_pos_max, ids))
        pos_all = batch.pos
        if pos_all is None:
            plist = [m + 1 for m in mems]
            if max(plist) > INT32_MAX:
                return None
            pos_all = pos0 = np.array(plist, np.int32)
        else:
            if pos_all.shape[0] != n:
                return None
            pos0 = pos_all  # (shape (n,): the whole array)
            plist = pos0.tolist()
        # each sequence continues the memory, and no position is below -1 (else: the general path's errors); the
        # common case, every position the next of its sequence, in one list comparison
        if list(map(_NEXT, mems)) != plist:
            for m, p in zip(mems, plist):
                if p < -1 or (m >= 0 and p != m + 1):
                    return None
        output = batch.logits
        if output is None:
            if output_all:
                output, n_outputs = np.ones(n, np.int8), n
            else:
                output = np.zeros(n, np.int8)
                output[-1] = 1
                n_outputs = 1
        else:
            n_outputs = n - output.tolist().count(0)
            if output_all and n_outputs < n:
                return None  # the general path warns and overrides
        self._commit(batch, pos_all, pos0, seq2d, seq2d[:, 0], batch.n_seq_id, False, seqs, None,
                     dict(zip(ids, zip(plist, plist, repeat(1)))), output, n_outputs)  # (each sequence: (p, p, 1))
        return ids, plist

    def init_step(self, batch: Batch, n_vocab: int, memory: MemoryPositions, n_seq_max: int, n_ubatch: int,
                  equal_seqs: bool) -> tuple[list[int], list[int]] | None:
        """``init`` and the whole split of a decode step whose every token is an output, for the runtime's fused step
        that makes no UBatch: the allocator ends as after ``init`` and the one split (``split_equal(n_ubatch, True)``
        with ``equal_seqs``, else ``split_simple(n_ubatch)``) that takes every token.  Returns each token's sequence
        and position, or None when the batch is not such a step or the split would differ; the allocator may then hold
        the batch (``init`` starts again).  A one-token batch: :meth:`init_step_one`."""
        if (not (self.fast and self._debug <= 0 and type(batch) is Batch) or batch.token is None
                or self.n_pos_per_embd != 1):
            return None
        if batch.n_tokens == 1:
            got = self.init_step_one(batch, n_vocab, memory, n_seq_max)
            return None if got is None else ([got[0]], [got[1]])
        try:
            got = self._init_many(batch, n_vocab, memory, n_seq_max, False)
        except BaseException:  # the memory raised: no batch, as after the general path's failure
            self._clear()
            raise
        n = batch.n_tokens
        if got is None or self._n_outputs != n or n > n_ubatch:
            return None
        seqs, pos = got
        # split_equal's sequential scan takes them all only when the ids are consecutive and rise in batch order
        if equal_seqs and n > 1 and (seqs != self._seqs or seqs[-1] - seqs[0] != n - 1):  # (_seqs: the ids, ascending)
            return None
        self._n_used = self._hint = n  # (the split of one sequence in split_equal marks its token in a mask instead)
        self._out_ids.append(_TOKEN_ID_VIEWS[n])
        return seqs, pos

    def init_step_one(self, batch: Batch, n_vocab: int, memory: MemoryPositions,
                      n_seq_max: int) -> tuple[int, int] | None:
        """:meth:`init_step` of a one-token batch: the token's (sequence, position), or None -- call ``init``
        then."""
        if (not self.fast or self._debug > 0 or type(batch) is not Batch or batch.n_tokens != 1
                or batch.token is None or self.n_pos_per_embd != 1):
            return None
        try:
            got = self._init_one(batch, n_vocab, memory, n_seq_max, False)
        except BaseException:  # the memory raised: no batch, as after the general path's failure
            self._clear()
            raise
        if got is None or not self._n_outputs:
            return None
        self._n_used = self._hint = 1
        self._out_ids.append(_TOKEN_ID0)
        return got
