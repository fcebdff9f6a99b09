"""Cutting a validated batch into ubatches: llama_batch_allocr's split_simple, split_equal and split_seq.

:class:`BatchSplitter` holds the validated batch that :meth:`BatchAllocator.init` commits (every attribute is
declared in its ``__slots__``) and the split state.  Each split method consumes, in each sequence-set group, a prefix
of the group's members, so the number of used members of a group is also the index of its first unused member.
"""

from __future__ import annotations

import logging
from types import MappingProxyType

import numpy as np

from .._consts import SEQ_WORDS
from ._ubatch import _SEQ_IDX_NONE, _TOKEN_ID_VIEWS, UBatch, _decode_arrays, _empty_ubatch, _present_seqs, _print_ubatch

logger = logging.getLogger("kvcache_ggml.batch")
_NO_STATS = MappingProxyType({})  # no batch: no sequence statistics (read-only; init commits a dict)
_NO_OUT_IDS = ()                   # no batch: no output ids (init commits a list)


class BatchSplitter:
    """The validated batch and the split methods over it; :class:`BatchAllocator` validates and fills it."""

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


def seq_groups(seq0: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Tokens grouped by their (only) sequence id ``seq0`` int32 [n]: (the sequence ids present, ascending; the
    stable argsort of ``seq0``; start and size of each sequence's run in that order)."""
    per_seq = np.bincount(seq0)
    useq = per_seq.nonzero()[0]
    gsize = per_seq[useq]
    return useq, seq0.argsort(kind="stable"), gsize.cumsum() - gsize, gsize
