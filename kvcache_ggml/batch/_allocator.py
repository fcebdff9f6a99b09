"""``llama_batch_allocr``: :class:`BatchAllocator` validates a :class:`Batch` against a vocabulary and a memory
module, fills in what the caller left out (positions, sequence ids, output flags), commits the result and cuts it
into ubatches (split_simple, split_equal, split_seq).

``init`` runs its sections in llama.cpp's order, each a method: validation of the input, the sequences present,
positions, outputs, per-sequence position statistics, consistency with the memory and within the batch, commit.
Every section but the commit works on locals, so a failed init leaves no partial batch behind.

The decode step's fast path.  A batch of n tokens of n distinct sequences, one sequence each (one token of one
sequence: the common step), is checked and filled by ``_init_decode`` with scalar Python (a handful of numpy calls
for n > 1), which commits exactly what the general sections would: the same arrays (the caller's where the general
path keeps them), the same positions, statistics and output flags.  Two things differ, neither visible: the
sequence groups that only split_equal and split_seq read are built on their first use (``_ensure_groups``), and a
batch that the general path would reject (or log, or warn about) is not handled there at all -- ``_init_decode``
returns False before changing anything and the general path runs, raising its own error.  The equivalence test
(tests/test_decode_fast_path.py) runs both paths on the same random traces.

The splits.  Each split method consumes, in each sequence-set group, a prefix of the group's members, so the number
of used members of a group is also the index of its first unused member.

One class, as llama.cpp's: the sections, the fast path and the splits all read and write the one committed batch,
so they share its private state instead of passing it between objects (this file is over the 600-line cap for
that, allowed in scripts/check_layout.py).
"""

from __future__ import annotations

import logging
from itertools import repeat
from types import MappingProxyType

import numpy as np

from .._consts import INT32_MAX, LLAMA_MAX_SEQ, SEQ_WORDS
from .._env import env_level
from ._input import Batch, MemoryPositions, _filled
from ._ubatch import (_ONE_N_SEQ_ID, _ONE_OUT, _ONE_SEQ0, _SEQ_IDX_NONE, _TOKEN_ID_VIEWS, _TOKEN_IDS, UBatch,
                      _decode_arrays, _distinct, _empty_ubatch, _present_seqs, _print_ubatch, _seq_pos_stats,
                      seq_groups)

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
_NO_STATS = MappingProxyType({})  # no batch: no sequence statistics (read-only; init commits a dict)
_NO_OUT_IDS = ()                   # no batch: no output ids (init commits a list)
_NEXT = (1).__add__  # m -> m + 1 (NotImplemented for a non-int: then the loop decides)
_TOKEN_ID0 = _TOKEN_IDS[:1]  # the output ids of a one-token batch (a view of _TOKEN_IDS: out_ids_in_order)


def read_debug_env() -> int:
    """Read LLAMA_BATCH_DEBUG again; allocators made from now on use the new level."""
    global _DEBUG
    _DEBUG = env_level("LLAMA_BATCH_DEBUG")
    return _DEBUG


class BatchAllocator:
    """Sanitises a :class:`Batch`, fills in its missing fields and splits it into :class:`UBatch` es.

    One class: init's sections commit the validated batch (every attribute is declared in ``__slots__``) that the
    split methods read and consume, and the decode step's fast paths of both commit and read the same state."""

    __slots__ = (
        # n_pos_per_embd, LLAMA_BATCH_DEBUG's level, and whether init and the splits may take the decode step's
        # fast paths (the equivalence tests turn them off to compare them with the general path)
        "n_pos_per_embd", "_debug", "fast",
        # the current batch (_batch is None when there is none: before init, after a failed init or
        # ubatch_reserve); the arrays below are read only while it is set
        "_batch", "_n", "_n_outputs", "_has_cpl",
        "_token", "_embd", "_pos_all", "_pos0", "_pos2d", "_n_seq_id", "_seq2d", "_seq0", "_output",
        "_seq_stats", "_seqs", "_grp",
        # sequence-set groups, built on first use by split_equal/split_seq
        "_gid", "_gorder", "_gstart", "_gsize", "_gmask", "_gseq", "_seq2g",
        # split state (_used: None until a split marks a token, see _used_mask)
        "_used", "_n_used", "_out_ids", "_hint",
    )

    def __init__(self, n_pos_per_embd: int = 1) -> None:
        npe = int(n_pos_per_embd)
        if npe < 1:
            raise ValueError(f"n_pos_per_embd = {n_pos_per_embd}, expected >= 1")
        self.n_pos_per_embd = npe
        self._debug = _DEBUG if _DEBUG is not None else read_debug_env()
        self.fast = True
        # the batch's fields are set by init (_commit); until then only what _clear sets is read
        self._clear()

    # ------------------------------------------------------------------------------------------------ state

    def _clear(self) -> None:
        """Drop the batch: reset what the getters report (the per-batch arrays are replaced by the next init)."""
        self._batch = None
        self._n = 0
        self._n_outputs = 0
        self._seq_stats = _NO_STATS
        self._n_used = 0
        self._out_ids = _NO_OUT_IDS

    def _require_batch(self, what: str) -> None:
        if self._batch is None:
            raise RuntimeError(f"BatchAllocator.{what}: no batch (call init() first; a failed init or "
                               f"ubatch_reserve() drops the batch)")

    # ------------------------------------------------------------------------------------------------ init

    def init(self, batch: Batch, n_vocab: int, memory: MemoryPositions | None, n_embd: int, n_seq_max: int,
             output_all: bool) -> None:
        """Validate ``batch`` and fill in its missing fields (llama_batch_allocr::init).

        Raises ValueError where llama.cpp returns false; the allocator then holds no batch and can be reused.
        The decode step (n tokens of n distinct sequences) takes a fast path, ``_init_decode``, with the same
        result.
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

    # ---------------------------------------------------------------------------------------- decode fast path

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
        # (_seqs: the ids, ascending)
        if equal_seqs and n > 1 and (seqs != self._seqs or seqs[-1] - seqs[0] != n - 1):
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

    # ------------------------------------------------------------------------------------------------ splits

    def split_reset(self) -> None:
        """Mark every token unused and forget the output ids (done by init)."""
        self._require_batch("split_reset")
        self._used = None
        self._n_used = 0
        self._out_ids = []
        self._hint = 0

    def split_whole(self, n_ubatch: int) -> UBatch | None:
        """``split_reset()`` then ``split_simple(n_ubatch)`` when that split takes the whole batch as a decode step
        (n tokens of n distinct sequences, no coupling, n <= n_ubatch): the ubatch, every token used after it, as
        the two calls leave them; None, with nothing done, for any other batch (or none: the calls then say why)."""
        n = self._n
        if (self._batch is None or type(n_ubatch) is not int or n > n_ubatch or n != len(self._seqs)
                or self._has_cpl or not self.fast):
            return None
        self._used = None
        self._out_ids = []
        self._n_used = self._hint = n
        return self._ubatch_decode(n, False)

    def _first_unused(self) -> int:
        """The first unused token (n if none).  Tokens before the hint are used, and stay used until
        split_reset, so the search resumes there (the decode step's split marks every token used by moving the
        hint past them, without touching ``_used``)."""
        h, n, used = self._hint, self._n, self._used
        if used is not None and h < n and used[h]:
            free = (~used[h:]).nonzero()[0]
            h = h + int(free[0]) if free.shape[0] else n
            self._hint = h
        return h

    def _used_mask(self) -> np.ndarray:
        """bool [n]: the tokens the splits used since the reset, allocated when a split first marks one (None
        before: the decode step's split never needs it)."""
        used = self._used
        if used is None:
            used = self._used = np.zeros(self._n, bool)
        return used

    @staticmethod
    def _check_n_ubatch(n_ubatch: int) -> int:
        n_ubatch = int(n_ubatch)
        if n_ubatch < 0:
            raise ValueError(f"n_ubatch = {n_ubatch}, expected >= 0")
        return n_ubatch

    def split_simple(self, n_ubatch: int) -> UBatch:
        """Up to n_ubatch tokens in batch order from the first unused one; sequence sets of any lengths."""
        if self._batch is None:
            self._require_batch("split_simple")
        if type(n_ubatch) is not int or n_ubatch < 0:
            n_ubatch = self._check_n_ubatch(n_ubatch)
        h = self._first_unused() if self._n_used else 0
        if h >= self._n:
            return _empty_ubatch()
        # as llama.cpp: the run after the first unused token is taken whole (always at least one token)
        k = max(1, min(n_ubatch, self._n - h))
        seqs = self._seqs
        if k == self._n == len(seqs) and not self._has_cpl and self.fast:  # the decode step: one token per sequence
            self._n_used, self._hint = k, k
            return self._ubatch_decode(k, False)
        self._used_mask()[h:h + k] = True
        self._n_used += k
        # one sequence, or the whole batch without coupling: the ubatch has the batch's sequences
        unq = np.array(seqs, np.int32) if len(seqs) == 1 or (k == self._n and not self._has_cpl) else None
        return self._ubatch_span(h, k, k, False, unq)

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
        if n == len(self._seqs) and not self._n_used and n <= n_ubatch and not self._has_cpl and self.fast:
            # the decode step: one token of each of n sequences (n = 1 too).  split_equal takes them all, in batch
            # order, when the scan below would: always, or (sequential) when the ids rise by one in batch order
            if not sequential or n == 1 or self._seq0_rise_by_one():
                self._n_used, self._hint = n, n
                return self._ubatch_decode(n, True)
        if len(self._seqs) == 1 and not self._has_cpl:
            # one sequence: one set whose unused tokens are h.., as many rounds as n_ubatch allows
            k = min(n - h, max(1, n_ubatch))
            self._used_mask()[h:h + k] = True
            self._n_used += k
            return self._ubatch_span(h, k, 1, True, np.array(self._seqs, np.int32))

        self._ensure_groups()
        gorder, gstart, gsize = self._gorder, self._gstart, self._gsize
        used = self._used_mask()
        n_used_g = np.bincount(self._gid[used], minlength=gsize.shape[0])
        lo = gstart + n_used_g  # each group's first unused member: its used members are a prefix
        rem = gsize - n_used_g
        rem_l = rem.tolist()

        if not sequential:
            taken = self._take_disjoint(n_ubatch, lo, rem)
        else:
            taken = self._take_sequential(n_ubatch, h, lo, rem_l)

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

    def _seq0_rise_by_one(self) -> bool:
        """The tokens' sequence ids are consecutive and rising in batch order (s, s + 1, s + 2, ...)."""
        seqs = self._seqs  # (ascending and distinct: consecutive iff they span n - 1)
        return seqs[-1] - seqs[0] == self._n - 1 and self._seq0.tolist() == seqs

    def _take_disjoint(self, n_ubatch: int, lo: np.ndarray, rem: np.ndarray) -> list[int]:
        """split_equal's groups (at most n_ubatch + 1) that share no sequence, in the order of their first unused
        token.  ``lo``/``rem``: each group's first unused member and number of unused members."""
        # the token scan meets each group first at the group's first unused token and decides there, so
        # visiting the groups in that order is the same scan
        live = rem.nonzero()[0]
        cand = live[self._gorder[lo[live]].argsort()].tolist()
        if not self._has_cpl:
            return cand[:n_ubatch + 1]  # distinct sequences never overlap
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
        return taken

    def _take_sequential(self, n_ubatch: int, h: int, lo: np.ndarray, rem_l: list[int]) -> list[int]:
        """split_equal's groups for a sequential split, from the first unused token ``h`` on."""
        # groups are single sequences here.  The scan accepts the first unused token (h), then the first
        # unused token of the next sequence id after the last accepted token, and so on
        gorder, seq2g = self._gorder, self._seq2g
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
        return taken

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
            if len(self._seqs) == 1:
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
            gid, used, gmask = self._gid, self._used_mask(), self._gmask
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
        self._used_mask()[idxs] = True
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
            if self._grp is None:  # several sequences committed by the decode fast path: grouped on first use
                self._grp = seq_groups(self._seq0)
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
            zero = np.uint64(0)
            words = [np.bitwise_or.reduceat(np.where(word == j, bit, zero), tok_start) for j in range(n_words)]
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
        return self._new_ubatch(idxs, n_seqs, equal_seqs, unq, token, embd, pos, self._n_seq_id[idxs],
                                self._seq2d[idxs], self._output[idxs])

    def _ubatch_span(self, h: int, k: int, n_seqs: int, equal_seqs: bool, unq: np.ndarray | None) -> UBatch:
        """_ubatch_add of the consecutive tokens [h, h + k) (split_simple, one sequence, the decode step): copies of
        slices, cheaper than gathers."""
        sl = slice(h, h + k)
        npe = self.n_pos_per_embd
        token = self._token[sl].copy() if self._token is not None else None
        embd = self._embd[sl].copy() if self._embd is not None else None
        if npe == 1:
            pos = self._pos0[sl].copy()
        elif self._pos2d is None:
            pos = np.tile(self._pos0[sl], npe)
        else:
            pos = self._pos2d[:, sl].flatten()
        return self._new_ubatch(np.arange(h, h + k), n_seqs, equal_seqs, unq, token, embd, pos,
                                self._n_seq_id[sl].copy(), self._seq2d[sl].copy(), self._output[sl].copy())

    def _ubatch_decode(self, n: int, equal_seqs: bool) -> UBatch:
        """_ubatch_add of the whole batch when it is a decode step (n tokens, n distinct sequences, no coupling,
        every token unused before): the arrays that only depend on the sequences are shared read-only ones."""
        assert n == self._n and not self._has_cpl
        npe = self.n_pos_per_embd
        seq_id, n_seq_id, unq, seq_idx = _decode_arrays(self._seqs[0] if n == 1 else tuple(self._seq0.tolist()))
        output = self._output
        if output.flags.writeable:  # the caller's flags (the allocator's own defaults are read-only)
            output = output.copy()
        n_out = self._n_outputs
        if n_out == n:
            self._out_ids.append(_TOKEN_ID_VIEWS[n])
        elif n_out:
            self._out_ids.append(output.nonzero()[0])
        pos = self._pos0.copy() if npe == 1 else (np.tile(self._pos0, npe) if self._pos2d is None else
                                                 self._pos_all.copy())
        ub = UBatch(n, 1, n, n, npe, equal_seqs,
                    None if self._token is None else self._token.copy(),
                    None if self._embd is None else self._embd.copy(), pos, n_seq_id, seq_id, unq, seq_idx, output,
                    (self._seqs[0], pos.item(0)) if n == 1 and npe == 1 else None)
        if self._debug > 0:
            logger.debug("ubatch_add: added ubatch to split:")
            _print_ubatch(ub, self._n_outputs, self._debug > 1)
        return ub

    def _new_ubatch(self, idxs: np.ndarray, n_seqs: int, equal_seqs: bool, unq: np.ndarray | None,
                    token: np.ndarray | None, embd: np.ndarray | None, pos: np.ndarray, n_seq_id: np.ndarray,
                    seq_id: np.ndarray, output: np.ndarray) -> UBatch:
        """The UBatch of the tokens ``idxs`` from their gathered fields; records their output ids."""
        n_tokens = idxs.shape[0]
        assert n_tokens % n_seqs == 0, f"{n_tokens} tokens do not split into {n_seqs} equal sequence sets"
        npe = self.n_pos_per_embd
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
            _print_ubatch(ub, self._n_outputs, self._debug > 1)
        return ub

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

