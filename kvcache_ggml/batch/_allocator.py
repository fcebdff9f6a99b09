"""``llama_batch_allocr::init``: :class:`BatchAllocator` validates a :class:`Batch` against a vocabulary and a
memory module, fills in what the caller left out (positions, sequence ids, output flags) and commits the result
to the :class:`BatchSplitter` it extends.

``init`` runs its sections in llama.cpp's order, each a method: validation of the input, the sequences present,
positions, outputs, per-sequence position statistics, consistency with the memory and within the batch, commit.
Every section but the commit works on locals, so a failed init leaves no partial batch behind.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from .._consts import LLAMA_MAX_SEQ
from ._decode import DecodeInit
from ._input import Batch, MemoryPositions, _filled
from ._split import BatchSplitter, seq_groups
from ._ubatch import (_ONE_N_SEQ_ID, _ONE_OUT, _ONE_SEQ0, _SEQ_IDX_NONE, _TOKEN_IDS, UBatch, _atoi, _distinct,
                      _present_seqs, _print_ubatch, _seq_pos_stats)

logger = logging.getLogger("kvcache_ggml.batch")

# the tokens grouped by sequence when a batch has several sequences and no coupling: (sequence ids, stable argsort
# of the first sequence ids, start and size of each sequence's run in that order); None otherwise
_Groups = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None
# per present sequence: (smallest position, largest position, number of distinct positions) in the batch
_Stats = dict[int, tuple[int, int, int]]

# LLAMA_BATCH_DEBUG's level, read once per process by the first allocator (llama.cpp reads it in each allocator's
# constructor; os.environ.get costs a microsecond, a twentieth of a decode step that builds its allocator);
# read_debug_env() reads it again
_DEBUG: int | None = None


def read_debug_env() -> int:
    """Read LLAMA_BATCH_DEBUG again; allocators made from now on use the new level."""
    global _DEBUG
    _DEBUG = _atoi(os.environ.get("LLAMA_BATCH_DEBUG"))
    return _DEBUG


class BatchAllocator(BatchSplitter, DecodeInit):
    """Sanitises a :class:`Batch`, fills in its missing fields and splits it into :class:`UBatch` es."""

    __slots__ = ()

    def __init__(self, n_pos_per_embd: int = 1) -> None:
        npe = int(n_pos_per_embd)
        if npe < 1:
            raise ValueError(f"n_pos_per_embd = {n_pos_per_embd}, expected >= 1")
        self.n_pos_per_embd = npe
        self._debug = _DEBUG if _DEBUG is not None else read_debug_env()
        self.fast = True
        # the batch's fields are set by init (_commit); until then only what _clear sets is read
        self._clear()

    # ------------------------------------------------------------------------------------------------ init

    def init(self, batch: Batch, n_vocab: int, memory: MemoryPositions | None, n_embd: int, n_seq_max: int,
             output_all: bool) -> None:
        """Validate ``batch`` and fill in its missing fields (llama_batch_allocr::init).

        Raises ValueError where llama.cpp returns false; the allocator then holds no batch and can be reused.
        The decode step (n tokens of n distinct sequences) takes a fast path, :meth:`._decode.DecodeInit._init_decode`,
        with the same result.
        """
        # the fast path commits everything _clear resets, or changes nothing (it clears if the memory raises)
        if (self.fast and self._debug <= 0 and type(batch) is Batch and type(n_vocab) is int
                and type(n_seq_max) is int and type(n_embd) is int
                and self._init_decode(batch, n_vocab, memory, n_seq_max, output_all)):
            return
        self._clear()
        if not isinstance(batch, Batch):
            raise TypeError(f"batch: expected a Batch, got {type(batch).__name__}")
        n_seq_max = int(n_seq_max)
        n_vocab = int(n_vocab)
        n_embd = int(n_embd)
        seq2d, n_seq_id, has_cpl = self._validate(batch, n_vocab, n_embd, n_seq_max)
        seq0 = seq2d[:, 0]  # int32 [n] each token's first sequence id
        seqs, grp = self._sequences(batch, seq2d, seq0, has_cpl)
        # last position of each present sequence in the memory (-1: empty, or no memory)
        if memory is None:
            mem_max = dict.fromkeys(seqs, -1)
        elif len(seqs) == 1:
            mem_max = {seqs[0]: int(memory.seq_pos_max(seqs[0]))}
        else:
            mem_max = {s: int(memory.seq_pos_max(s)) for s in seqs}
        pos_all, pos0, stats = self._positions(batch, seqs, grp, mem_max, seq2d, n_seq_id, has_cpl)
        output, n_outputs = self._outputs(batch, output_all)
        if stats is None:  # positions given by the caller
            stats = self._statistics(pos0, seqs, grp, seq2d, n_seq_id, has_cpl)
        if self._debug > 0:
            self._print_input(batch, pos_all, seqs, seq2d, n_seq_id, output, n_outputs, stats)
        self._check_consistency(batch, memory, seqs, mem_max, stats, pos0, seq2d, n_seq_id, has_cpl)
        self._commit(batch, pos_all, pos0, seq2d, seq0, n_seq_id, has_cpl, seqs, grp, stats, output, n_outputs)

    # -- validation of the input --------------------------------------------------------------------------

    @staticmethod
    def _validate(batch: Batch, n_vocab: int, n_embd: int,
                  n_seq_max: int) -> tuple[np.ndarray, np.ndarray, bool]:
        """Check n_seq_max, the token ids (or the embedding width) and the sequence ids.

        Returns the sequence ids (int32 [n, w], padded with -1; sequence 0 when the batch has none), their count
        per token (int32 [n]) and whether some token has several ids (coupled sequences)."""
        n = batch.n_tokens
        if n_seq_max > LLAMA_MAX_SEQ:
            raise ValueError(f"n_seq_max = {n_seq_max} > LLAMA_MAX_SEQ = {LLAMA_MAX_SEQ}")
        if n_seq_max < 1:
            raise ValueError(f"n_seq_max = {n_seq_max}, expected >= 1")

        token = batch.token
        if token is not None:
            # negative ids wrap to huge unsigned values: one comparison covers both ends of [0, n_vocab)
            if n == 1:
                nbad = not 0 <= token.item(0) < n_vocab
            else:
                nbad = np.count_nonzero(token.view(np.uint32) >= n_vocab) if n_vocab > 0 else n
            if nbad:
                i = int(np.argmax((token < 0) | (token >= n_vocab)))
                raise ValueError(f"invalid token[{i}] = {int(token[i])}: token ids must be in [0, n_vocab={n_vocab})")
        elif batch.embd.shape[1] != n_embd:
            raise ValueError(f"embd: shape {batch.embd.shape}, expected [n_tokens={n}, n_embd={n_embd}]")

        seq2d = batch.seq_id
        if seq2d is None:
            if n == 1:
                return _ONE_SEQ0, _ONE_N_SEQ_ID, False
            return np.zeros((n, 1), np.int32), _filled(n, 1), False
        n_seq_id = batch.n_seq_id
        w = seq2d.shape[1]
        has_cpl = w > 1  # Batch trims seq_id to the widest row: w > 1 <=> some token has several ids
        if n == 1 and w == 1:
            nbad = not 0 <= seq2d.item(0) < n_seq_max
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
        # from here on every id is in [0, n_seq_max), so ``seq2d >= 0`` marks exactly the ids (not the padding)
        return seq2d, n_seq_id, has_cpl

    @staticmethod
    def _sequences(batch: Batch, seq2d: np.ndarray, seq0: np.ndarray, has_cpl: bool) -> tuple[list[int], _Groups]:
        """The sequences present, ascending (llama.cpp walks all n_seq_max; the absent ones have no effect), and
        for several sequences without coupling the tokens grouped by sequence (see ``_Groups``), computed once
        and reused by the positions, the statistics and the splits."""
        if batch.seq_id is None:
            return [0], None
        if has_cpl:
            return _present_seqs(seq2d[seq2d >= 0]).tolist(), None
        if seq2d.shape[0] == 1:
            return [seq2d.item(0)], None
        grp = seq_groups(seq0)
        seqs = grp[0].tolist()
        return seqs, (grp if len(seqs) > 1 else None)

    # -- positions ----------------------------------------------------------------------------------------

    def _positions(self, batch: Batch, seqs: list[int], grp: _Groups, mem_max: dict[int, int], seq2d: np.ndarray,
                   n_seq_id: np.ndarray, has_cpl: bool) -> tuple[np.ndarray, np.ndarray, _Stats | None]:
        """The positions: the caller's (checked for shape), or each sequence continued from the memory.

        Returns all positions (int32 [n_pos*n]), the first row (int32 [n]) and, for positions filled in here
        without coupling, the per-sequence statistics that come with them (None otherwise)."""
        n = batch.n_tokens
        npe = self.n_pos_per_embd
        pos_in = batch.pos
        if pos_in is not None:
            n_pos_in = pos_in.shape[0] // n
            if n_pos_in != 1 and n_pos_in != npe:
                raise ValueError(f"pos: {n_pos_in} positions per token, expected 1 or n_pos_per_embd = {npe}")
            if batch.embd is not None and npe > 1 and n_pos_in != npe:
                raise ValueError(f"pos: {n_pos_in} position per embedding, expected n_pos_per_embd = {npe} "
                                 f"([{npe}, n_tokens={n}])")
            return pos_in, pos_in[:n], None
        if batch.embd is not None and npe > 1:
            # llama.cpp would fill one position per embedding and then read n_pos_per_embd of them
            raise ValueError(f"pos: None, but embeddings with n_pos_per_embd = {npe} need explicit positions "
                             f"[{npe}, n_tokens={n}]")
        if has_cpl:
            pos0 = self._auto_pos_coupled(n, seqs, mem_max, seq2d, n_seq_id)
            return pos0, pos0, None
        if grp is None:
            p = mem_max[seqs[0]] + 1
            pos0 = np.arange(p, p + n, dtype=np.int32)
            return pos0, pos0, {seqs[0]: (p, p + n - 1, n)}
        # each token takes the next position of its sequence: in the grouped order, the j-th token
        # overall, in the run of sequence g that starts at gstart[g], gets base[g] + j - gstart[g]
        _, order, gstart, gsize = grp
        base = [mem_max[s] + 1 for s in seqs]
        pos0 = np.empty(n, np.int32)
        pos0[order] = (np.array(base, np.int64) - gstart).repeat(gsize) + np.arange(n)
        return pos0, pos0, {s: (b, b + c - 1, c) for s, b, c in zip(seqs, base, gsize.tolist())}

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

    # -- outputs ------------------------------------------------------------------------------------------

    @staticmethod
    def _outputs(batch: Batch, output_all: bool) -> tuple[np.ndarray, int]:
        """The output flags (int8 [n]) and their count: the caller's (all of them when ``output_all``), else the
        last token only (every token when ``output_all``)."""
        n = batch.n_tokens
        output = batch.logits
        if output is None:
            if n == 1:
                return _ONE_OUT, 1
            if output_all:
                return np.ones(n, np.int8), n
            output = np.zeros(n, np.int8)
            output[-1] = 1
            return output, 1
        n_outputs = int(output.item(0) != 0) if n == 1 else int(np.count_nonzero(output))
        if output_all and n_outputs < n:
            logger.warning("init: embeddings required but some input tokens were not marked as outputs -> "
                           "overriding")
            return np.ones(n, np.int8), n
        return output, n_outputs

    # -- per-sequence position statistics of given positions ----------------------------------------------

    @staticmethod
    def _statistics(pos0: np.ndarray, seqs: list[int], grp: _Groups, seq2d: np.ndarray, n_seq_id: np.ndarray,
                    has_cpl: bool) -> _Stats:
        """Per present sequence: smallest and largest position and number of distinct positions."""
        n = pos0.shape[0]
        if n == 1:
            p = pos0.item(0)
            return {seqs[0]: (p, p, 1)} if len(seqs) == 1 else {s: (p, p, 1) for s in seqs}
        if grp is None and not has_cpl:
            if not np.count_nonzero(pos0[1:] - pos0[:-1] != 1):  # the usual prompt: consecutive positions
                return {seqs[0]: (int(pos0[0]), int(pos0[-1]), n)}
            lo, hi = int(pos0.min()), int(pos0.max())
            if hi - lo < n:  # the positions fit a range of n: count the distinct ones without sorting
                cnt = int(np.count_nonzero(np.bincount(pos0 - lo)))
            else:
                cnt = int(_distinct(pos0).shape[0])
            return {seqs[0]: (lo, hi, cnt)}
        if grp is not None:
            _, order, gstart, gsize = grp
            ps = pos0[order]
            step = (ps[1:] - ps[:-1]) == 1
            step[gstart[1:] - 1] = True  # the step from one sequence's run to the next does not count
            if not np.count_nonzero(~step):  # every sequence at consecutive positions in batch order
                return {s: (a, b, c) for s, a, b, c in zip(seqs, ps[gstart].tolist(), ps[gstart + gsize - 1].tolist(),
                                                           gsize.tolist())}
        if has_cpl:
            useq_l, smin, smax, scnt = _seq_pos_stats(seq2d[seq2d >= 0], pos0.repeat(n_seq_id))
        else:
            useq_l, smin, smax, scnt = _seq_pos_stats(seq2d[:, 0], pos0)
        assert useq_l == seqs
        return {s: (a, b, c) for s, a, b, c in zip(useq_l, smin, smax, scnt)}

    # -- consistency with the memory and within the batch -------------------------------------------------

    def _check_consistency(self, batch: Batch, memory: MemoryPositions | None, seqs: list[int],
                           mem_max: dict[int, int], stats: _Stats, pos0: np.ndarray, seq2d: np.ndarray,
                           n_seq_id: np.ndarray, has_cpl: bool) -> None:
        """Each sequence continues the memory and has no gap; coupled sequences agree in the memory."""
        mrope = self.n_pos_per_embd > 1
        tokens = batch.token is not None
        lowest = 0
        for s in seqs:
            lo, hi, cnt = stats[s]
            if lo < lowest:
                lowest = lo
            p0 = mem_max[s]
            if mrope:
                # M-RoPE: positions may jump forward, never back (embeddings may repeat the last one)
                if p0 >= 0 and (p0 >= lo if tokens else p0 > lo):
                    rel = "X < Y" if tokens else "X <= Y"
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
            self._check_coupled(memory, seq2d, n_seq_id)
        # llama.cpp's last check walks the tokens with a per-sequence "current position" that starts at -1 and
        # is never advanced, so it rejects exactly the positions below -1 (first such token, its first sequence).
        # Its companion check (a sequence whose tokens' sets have an empty intersection) cannot fire: every
        # such set contains the sequence itself.
        if lowest < -1:
            i = int(np.argmax(pos0 < -1))
            raise ValueError(f"sequence {int(seq2d[i, 0])} positions are decreasing (not allowed): pos[{i}] = "
                             f"{int(pos0[i])} < -1")

    @staticmethod
    def _check_coupled(memory: MemoryPositions, seq2d: np.ndarray, n_seq_id: np.ndarray) -> None:
        """Sequences coupled in the batch have the same position range in the memory."""
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

    # -- commit -------------------------------------------------------------------------------------------

    def _commit(self, batch: Batch, pos_all: np.ndarray, pos0: np.ndarray, seq2d: np.ndarray, seq0: np.ndarray,
                n_seq_id: np.ndarray, has_cpl: bool, seqs: list[int], grp: _Groups, stats: _Stats,
                output: np.ndarray, n_outputs: int) -> None:
        """Make the validated batch current and reset the splits."""
        n = batch.n_tokens
        npe = self.n_pos_per_embd
        token = batch.token
        self._batch = batch
        self._n = n
        self._n_outputs = n_outputs
        self._has_cpl = has_cpl
        self._token = token
        self._embd = batch.embd
        self._pos_all = pos_all
        self._pos0 = pos0
        # several positions per embedding (M-RoPE images): one row per section
        self._pos2d = pos_all.reshape(npe, n) if (npe > 1 and pos_all.shape[0] == npe * n and token is None) else None
        self._n_seq_id = n_seq_id
        self._seq2d = seq2d
        self._seq0 = seq0
        self._output = output
        self._seq_stats = stats
        self._seqs = seqs
        self._grp = grp
        self._gorder = None
        # split_reset() without its check: the batch was just set
        self._used = None
        self._n_used = 0
        self._out_ids = []
        self._hint = 0

    # ------------------------------------------------------------------------------------------------ getters

    @property
    def debug(self) -> int:
        """LLAMA_BATCH_DEBUG as read when the allocator was made (0: no logging; 1: each batch; 2: and its tokens)."""
        return self._debug

    def has_split_groups(self) -> bool:
        """Whether the current batch has its sequence groups built (the general split's); a batch committed by the
        decode fast path has none until a split needs them."""
        return self._grp is not None or self._gorder is not None

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

    def out_ids_in_order(self) -> bool:
        """True when :meth:`get_out_ids` is 0..n_tokens-1 and every token is used: the decode step's one split of
        a batch whose every token is an output (False does not mean they are not; get_out_ids tells)."""
        o = self._out_ids  # (only the decode split records a view of _TOKEN_IDS: all n tokens, all used)
        return len(o) == 1 and o[0].base is _TOKEN_IDS

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
                     stats: _Stats) -> None:
        """Log the filled-in input batch and each sequence's position range and coupled partners."""
        n = batch.n_tokens
        unq = np.array(seqs, np.int32)
        seq_idx = _SEQ_IDX_NONE.copy()
        seq_idx[unq] = np.arange(unq.shape[0], dtype=np.int32)
        logger.debug("init: input batch info:")
        _print_ubatch(UBatch(
            n_tokens=n, n_seq_tokens=1, n_seqs=n, n_seqs_unq=unq.shape[0], n_pos=self.n_pos_per_embd,
            b_equal_seqs=False, token=batch.token, embd=batch.embd, pos=pos_all[:n], n_seq_id=n_seq_id,
            seq_id=seq2d, seq_id_unq=unq, seq_idx=seq_idx, output=output), n_outputs, self._debug > 1)
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

