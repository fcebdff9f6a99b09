"""The cache's bookkeeping: which cell of which stream holds which position of which sequences.

:class:`KVBookkeeping` is the cell half of llama.cpp's ``llama_kv_cache``: the cells
(:class:`~kvcache_ggml.cache.cells.KVCells`) and the head of every stream, the sequence-to-stream map, the stream copies
queued by cross-stream ``seq_cp``, every ``seq_*`` operation, and the slot search and placement of ubatches
(``find_slot``, ``apply_ubatch``, ``prepare``).  It holds no tensor and imports no ggml: it can be used and tested
on its own, and the tensor store, the inputs and the state codec read it.

Errors follow three tiers: ``assert`` for internal invariants, ``RuntimeError`` for a caller bug (a call the seed
reaches only through a broken caller, such as an ubatch whose layout does not fit the streams), ``ValueError`` for
bad input (an out-of-range sequence id, a cache-sized batch that can never fit, a shift on an M-RoPE model).
Every check runs before any change: a failed call leaves the cells exactly as they were.

The decode step (one token per sequence) takes fast paths with the same results: ``prepare`` of one ubatch places
nothing, ``apply_ubatch`` on empty cells places with scalar Python (``place_free``), and ``seq_rm`` of a
sequence's newest cell (the undo of a step) removes it without a search (``KVCells.seq_rm_last``).
tests/test_decode_fast_path.py runs them next to the general paths on random traces.
"""
from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

from .._consts import INT32_MAX, LLAMA_MAX_SEQ
from .._env import env_level
from ..batch import BatchAllocator, UBatch
from ..hparams import SwaType, is_masked_swa_np
from .cells.kvcells import KVCells
from .cells.onecell import slot_search_start
from .celltext import cell_map_text, cell_pos_text
from .swa_step import WrapStats, place_over, rolls_back_clean, slot_run
from .types import KVCacheParams, SlotInfo, StreamCopyInfo

__all__ = ["KVBookkeeping"]

log = logging.getLogger("kvcache_ggml.cache")


class KVBookkeeping:
    """Cells and heads per stream, sequence-to-stream map, queued stream copies (no tensors, no ggml)."""

    def __init__(self, params: KVCacheParams, n_pos_per_embd: int = 1) -> None:
        params.validate()
        self.n_seq_max = int(params.n_seq_max)        # sequences the cache serves
        self.kv_size = int(params.kv_size)            # cells per stream
        self.n_stream = params.n_stream               # 1 when unified, else n_seq_max
        self.n_pad = int(params.n_pad)                # n_kv is padded to max(n_pad, 256)
        n_pad_cur = max(self.n_pad, 256)
        self.n_pad_cur = n_pad_cur                    # ... that is, to this
        self.n_swa = int(params.n_swa)                # sliding-window size
        self.swa_type = SwaType(params.swa_type)      # sliding-window rule
        self.no_swa = self.swa_type == SwaType.NONE   # no window: a found cell is always empty
        self.n_pos_per_embd = int(n_pos_per_embd)     # positions per token (M-RoPE: 4); shifts need 1
        self.v_heads: list[int] = [0] * self.n_stream                              # next search start, per stream
        self.v_cells: list[KVCells] = [KVCells(params.kv_size) for _ in range(self.n_stream)]  # per stream
        # sequence -> stream; every sequence maps to stream 0 of a unified cache
        self.seq_to_stream = (np.zeros(LLAMA_MAX_SEQ, np.int32) if self.n_stream == 1
                              else np.arange(self.n_stream, dtype=np.int32))
        self.stream_of: list[int] = self.seq_to_stream.tolist()  # the same, for scalar lookups
        self.n_seq_ids = len(self.stream_of)           # sequence ids of the memory API: [0, n_seq_ids)
        self.sc_info = StreamCopyInfo()                # whole-stream copies queued for the next update
        self.debug = env_level("LLAMA_KV_CACHE_DEBUG")  # the seed's debug level
        self.fast = True  # decode fast paths on (the equivalence tests turn them off to compare)
        self.wrap_stats = WrapStats()  # how often the scalar paths over a wrapped window served
        # read-only 0..kv_size-1: the one-cell slot of a decode step is a view of it (cheaper than a new array)
        self._cell_ids = np.arange(self.kv_size, dtype=np.int64)
        self._cell_ids.flags.writeable = False
        self._cell_col = self._cell_ids.reshape(-1, 1)  # [kv_size, 1]: row i, cell i's one-cell slot (an int index)

    # ================================================================== memory API

    def clear(self) -> None:
        """Empty every stream and reset its head (the data are the tensor store's)."""
        for s in range(self.n_stream):
            self.v_cells[s].reset()
            self.v_heads[s] = 0

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove positions [p0, p1) of ``seq_id`` (of every sequence when -1). Always True, as the seed."""
        if not 0 <= seq_id < self.n_seq_ids:
            self.check_seq(seq_id, allow_all=True)
        p0, p1 = (0 if p0 < 0 else p0), (INT32_MAX if p1 < 0 else p1)  # _clamp_range, inlined: a decode step's undo
        if seq_id >= 0:
            strm = self.stream_of[seq_id]
            cells = self.v_cells[strm]
            if self.fast:  # the undo of a decode step: the sequence's newest cell is found without a search
                i = cells.seq_rm_last(seq_id, p0, p1)
                if i is not None:
                    if 0 <= i < self.v_heads[strm]:  # (the freed cell is below the head: _lower_head)
                        self.v_heads[strm] = i
                    return True
            idxs = cells.find(p0, p1, seq_id)
            emptied = cells.seq_rm_many(idxs, seq_id) if idxs.size else idxs
            self._lower_head(strm, emptied)
        else:
            for strm, cells in enumerate(self.v_cells):
                idxs = cells.find(p0, p1)
                if idxs.size:
                    cells.rm_many(idxs)
                self._lower_head(strm, idxs)
        return True

    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int = -1, p1: int = -1) -> None:
        """Copy positions [p0, p1) of ``seq_id_src`` into ``seq_id_dst``: within a stream only the cells change;
        across streams only whole sequences can be copied (the destination stream is replaced by the source's cells
        of ``seq_id_src``, and a buffer copy is queued for the next update)."""
        self.check_seq(seq_id_src)
        self.check_seq(seq_id_dst)
        s0 = self.stream_of[seq_id_src]
        s1 = self.stream_of[seq_id_dst]
        if s0 == s1:
            if seq_id_src == seq_id_dst:
                return
            p0, p1 = _clamp_range(p0, p1)
            cells = self.v_cells[s0]
            idxs = cells.find(p0, p1, seq_id_src)
            # cells that already hold the destination keep it once (the seed's release build counts them twice)
            idxs = idxs[~cells.seq_mask_at(seq_id_dst, idxs)]
            if idxs.size:
                cells.seq_add_many(idxs, seq_id_dst)
            return

        size = self.get_size()
        if (0 < p0 and p0 + 1 < size) or (0 < p1 and p1 + 1 < size):
            raise ValueError(f"seq_cp() across streams copies whole sequences only: got range [{p0}, {p1}) "
                             f"(use p0 <= 0 and p1 < 0 or p1 >= {size - 1})")
        self.sc_info.ssrc.append(s0)
        self.sc_info.sdst.append(s1)
        src, dst = self.v_cells[s0], self.v_cells[s1]
        dst.reset()
        idxs = np.flatnonzero(src.seq_mask(seq_id_src) & (src.pos_array >= 0))
        if idxs.size:
            shift = src.shift_array[idxs]
            dst.place(idxs, src.pos_array[idxs] - shift, np.full((idxs.size, 1), seq_id_dst, np.int32))
            shifted = shift != 0
            if shifted.any():
                dst.pos_add_many(idxs[shifted], shift[shifted])
            dst.ext_array[idxs] = src.ext_array[idxs]
        self.v_heads[s1] = self.v_heads[s0]

    def seq_keep(self, seq_id: int) -> None:
        """Remove every sequence but ``seq_id`` from its stream."""
        self.check_seq(seq_id)
        strm = self.stream_of[seq_id]
        cells = self.v_cells[strm]
        idxs = np.flatnonzero(cells.pos_array >= 0)
        emptied = cells.seq_keep_many(idxs, seq_id) if idxs.size else idxs
        self._lower_head(strm, emptied)

    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        """Add ``shift`` to positions [p0, p1) of ``seq_id``; cells pushed below 0 are freed."""
        self.check_seq(seq_id)
        self.check_shiftable("seq_add")
        if shift == 0:
            return
        if not -INT32_MAX - 1 <= shift <= INT32_MAX:
            raise ValueError(f"seq_add() shift {shift} does not fit a llama_pos (int32)")
        p0, p1 = _clamp_range(p0, p1)
        if p0 == p1:
            return
        strm = self.stream_of[seq_id]
        cells = self.v_cells[strm]
        idxs = cells.find(p0, p1, seq_id)
        emptied = cells.pos_add_many(idxs, shift) if idxs.size else idxs
        self.v_heads[strm] = int(emptied[0]) if emptied.size else 0

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        """Divide positions [p0, p1) of ``seq_id`` by ``d`` (integer division)."""
        self.check_seq(seq_id)
        self.check_shiftable("seq_div")
        if d == 1:
            return
        if not 1 <= d <= INT32_MAX:
            raise ValueError(f"seq_div() divisor must be in [1, {INT32_MAX}], got {d}")
        p0, p1 = _clamp_range(p0, p1)
        if p0 == p1:
            return
        cells = self.v_cells[self.stream_of[seq_id]]
        idxs = cells.find(p0, p1, seq_id)
        if idxs.size:
            cells.pos_div_many(idxs, d)

    def seq_pos_min(self, seq_id: int) -> int:
        self.check_seq(seq_id)
        return self.v_cells[self.stream_of[seq_id]].seq_pos_min(seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        if not 0 <= seq_id < self.n_seq_ids:
            self.check_seq(seq_id)
        return self.v_cells[self.stream_of[seq_id]].seq_pos_max(seq_id)

    def get_size(self) -> int:
        return self.v_cells[self.stream_of[0]].size()

    def get_n_stream(self) -> int:
        return self.n_stream

    def get_has_shift(self) -> bool:
        for c in self.v_cells:  # (a loop: no generator to make every step)
            if c.get_has_shift():
                return True
        return False

    def get_can_shift(self) -> bool:
        return True

    def get_n_kv(self, sinfo: SlotInfo) -> int:
        """Cells the attention must read for this slot: used range padded to max(n_pad, 256), capped at size
        (of the slot's streams, the one that uses most: the padding is monotone)."""
        strm = sinfo.strm
        if len(strm) == 1:
            return self.padded_n_kv(self.v_cells[strm[0]].used_max_p1())
        v_cells = self.v_cells
        return self.padded_n_kv(max([v_cells[s].used_max_p1() for s in strm])) if strm else 0

    def padded_n_kv(self, used: int) -> int:
        """``used`` cells padded to max(n_pad, 256) (GGML_PAD: a true multiple for powers of two), capped at size."""
        n_pad_cur = self.n_pad_cur
        n = (used + n_pad_cur - 1) & ~(n_pad_cur - 1)
        if n < n_pad_cur:  # (no min/max calls: every step comes here)
            n = n_pad_cur
        return n if n < self.kv_size else self.kv_size

    # ================================================================== preparation API

    def split(self, balloc: BatchAllocator, n_ubatch: int) -> list[UBatch] | None:
        """The ubatches of the allocator's batch (``init_batch``'s split), or None when some tokens stay unused.

        A unified cache splits simply; a multi-stream cache into ubatches of equal sequence sets.  A ubatch with
        more tokens per stream than the cache has cells can never fit: ValueError.
        """
        if self.n_stream == 1 and self.fast:  # the decode step's one ubatch (too big for the cache: split below)
            ub = balloc.split_whole(n_ubatch)
            if ub is not None and ub.n_tokens <= self.kv_size:
                return [ub]
        balloc.split_reset()
        ubatches = []
        n_tokens = balloc.get_n_tokens()
        # the seed splits until an empty ubatch; once every token is used the next split is empty for sure
        while balloc.get_n_used() < n_tokens:
            ub = balloc.split_simple(n_ubatch) if self.n_stream == 1 else balloc.split_equal(n_ubatch, True)
            if ub.n_tokens == 0:
                break
            ubatches.append(ub)
        if balloc.get_n_used() < n_tokens:
            return None
        size = self.kv_size
        for ub in ubatches:
            per_stream = ub.n_tokens // (ub.n_seqs_unq if self.n_stream > 1 else 1)
            if per_stream > size:
                raise ValueError(f"a ubatch of {per_stream} tokens per stream can never fit a cache of "
                                 f"{size} cells (n_ubatch={n_ubatch})")
        return ubatches

    def take_stream_copies(self) -> StreamCopyInfo:
        """The queued stream copies, handed over to an update (the queue starts empty again)."""
        sc_info, self.sc_info = self.sc_info, StreamCopyInfo()
        return sc_info

    def requeue_stream_copies(self, sc_info: StreamCopyInfo) -> None:
        """Put copies back in front of the queue after a failed update (a whole-stream copy is idempotent)."""
        self.sc_info.ssrc[:0] = sc_info.ssrc
        self.sc_info.sdst[:0] = sc_info.sdst

    def reset_shift(self) -> None:
        """Forget the pending shifts of every stream (the K-shift has been applied to the data)."""
        for cells in self.v_cells:
            cells.reset_shift()

    def prepare(self, ubatches: Sequence[UBatch]) -> list[SlotInfo]:
        """Find a slot for each ubatch as if the previous ones were placed; the cells end as they began.

        Returns one SlotInfo per ubatch, or [] when one does not fit.  As in the seed, the purge that
        ``apply_ubatch`` makes to keep sequences contiguous is not rolled back, and each head is restored from
        the saved head of the same *index* in the slot (``v_heads[strm[s]] = old[s]``).
        """
        first = None
        if len(ubatches) == 1 and (self.no_swa or self.fast):  # the decode step: nothing to place without SWA...
            first = self.find_slot(ubatches[0], False)
            if not first.idxs:
                return []
            # ... nor with SWA when the slot is empty or its placement and roll-back change nothing
            if self.no_swa or rolls_back_clean(self, first, ubatches[0]):
                if self.n_stream > 1 and (first.strm[0] != 0 or first.strm[-1] != len(first.strm) - 1):  # (else no-op)
                    self._restore_heads(first, list(self.v_heads))
                return [first]
        res: list[SlotInfo] = []
        states = []
        success = True
        last = len(ubatches) - 1
        for k, ub in enumerate(ubatches):
            sinfo = self.find_slot(ub, False) if first is None else first
            if not sinfo.idxs:  # (sinfo.empty())
                success = False
                break
            res.append(sinfo)
            # without SWA every found cell is empty; with SWA a found cell may hold a masked token
            if k == last and (self.no_swa or
                              all(not (self.v_cells[st].pos_array[idx] >= 0).any()
                                  for st, idx in zip(sinfo.strm, sinfo.idxs))):
                # the last ubatch lands on empty cells only: placing it and rolling it back changes no cell
                if not states:  # it is the only one (the decode step): nothing was placed, only heads to restore
                    if sinfo.strm[0] != 0 or sinfo.strm[-1] != len(sinfo.strm) - 1:  # (streams 0, 1, ...: no-op)
                        self._restore_heads(sinfo, list(self.v_heads))
                    return res
                states.append((sinfo, list(self.v_heads), None))
                break
            heads_old = list(self.v_heads)
            saved = [self.v_cells[st].snapshot(idx) for st, idx in zip(sinfo.strm, sinfo.idxs)]
            states.append((sinfo, heads_old, saved))
            self.apply_ubatch(sinfo, ub)
        for sinfo, heads_old, saved in reversed(states):
            if saved is not None:
                for s, (st, idx) in enumerate(zip(sinfo.strm, sinfo.idxs)):
                    self.v_cells[st].restore(idx, *saved[s])
            self._restore_heads(sinfo, heads_old)
        return res if success else []

    def _restore_heads(self, sinfo: SlotInfo, heads_old: list[int]) -> None:
        """prepare's roll-back of the heads, as the seed does it: each stream of the slot gets the saved head of the
        same *index* in the slot (a no-op when the slot's streams are 0, 1, ...)."""
        for s, st in enumerate(sinfo.strm):
            self.v_heads[st] = heads_old[s]

    def find_slot(self, ubatch: UBatch, cont: bool = False) -> SlotInfo:
        """Cells for the ubatch's tokens, per stream, from each stream's head; empty SlotInfo when none."""
        if self.debug > 0:
            self._debug_dump(ubatch)
        n_tokens = ubatch.n_tokens
        if self.n_stream == 1:  # every sequence is in stream 0
            i = self.v_cells[0].one_token_cell(self.v_heads[0]) if n_tokens == 1 and not cont else -1
            if i >= 0:  # the decode step: the free head cell (always usable), found in one call
                return SlotInfo(0, 0, [0], [self._cell_col[i]], i)
            idx = self._slot_in(0, n_tokens, cont)
            return SlotInfo() if idx is None else SlotInfo(0, 0, [0], [idx], idx.item(0) if n_tokens == 1 else -1)
        if n_tokens % ubatch.n_seqs_unq:
                raise RuntimeError(f"ubatch of {n_tokens} tokens is not split evenly over {ubatch.n_seqs_unq} "
                                   "sequences (use split_equal with a multi-stream cache)")
        n_tokens //= ubatch.n_seqs_unq
        seqs = ubatch.seq_id_unq.tolist()
        # the first token of each stream's run: its sequence ids must be exactly that stream's sequence
        firsts, counts = ubatch.seq_id[::n_tokens, 0].tolist(), ubatch.n_seq_id[::n_tokens].tolist()
        strms, idxs = [], []
        stream_of, slot_in = self.stream_of, self._slot_in
        for s, seq_id in enumerate(seqs):
            if counts[s] != 1 or firsts[s] != seq_id:
                raise RuntimeError(f"token {s * n_tokens} of the ubatch must belong to sequence {seq_id} alone")
            strm = stream_of[seq_id]
            idx = slot_in(strm, n_tokens, cont)
            if idx is None:
                return SlotInfo()
            strms.append(strm)
            idxs.append(idx)
        return SlotInfo(min(strms), max(strms), strms, idxs, idx.item(0) if n_tokens == 1 and len(seqs) == 1 else -1)

    def _slot_in(self, strm: int, n_tokens: int, cont: bool) -> np.ndarray | None:
        """find_slot in one stream: ``n_tokens`` cells from its head (int64), or None when there is no room."""
        cells = self.v_cells[strm]
        # the decode step: the head cell (after find_slot's restart at 0) is free, always usable
        i = cells.one_token_cell(self.v_heads[strm]) if n_tokens == 1 and not cont else -1
        if i >= 0:
            return self._cell_col[i]
        head_cur = slot_search_start(self.v_heads[strm], cells.get_used(), n_tokens)
        if n_tokens > self.kv_size:
            log.error("find_slot: n_tokens = %d > size = %d", n_tokens, self.kv_size)
            return None
        if self.fast and not cont:  # a few cells from the head, usable (free, or left behind by the window)?
            h = slot_run(self, cells, head_cur, n_tokens)
            if h is not None:
                return self._cell_ids[h:h + n_tokens]
        return (self._scan_cont if cont else self._scan)(cells, head_cur, n_tokens)

    def apply_ubatch(self, sinfo: SlotInfo, ubatch: UBatch) -> None:
        """Write the ubatch's positions and sequences into the slot's cells, then purge and move the heads."""
        assert ubatch.n_tokens == len(sinfo.strm) * len(sinfo.idxs[0]), "the ubatch does not fill its slot"
        is_2d = ubatch.n_pos >= 3  # (ubatch.is_pos_2d(), inline: every step comes here)
        if self.fast and not is_2d and (self.place_free(sinfo, ubatch) or place_over(self, sinfo, ubatch)):
            return
        n = sinfo.size()
        seq_pos_max_rm: dict[int, int] = {}
        nt = ubatch.n_tokens
        for s, (st, idx) in enumerate(zip(sinfo.strm, sinfo.idxs)):
            cells = self.v_cells[st]
            occ = idx[cells.pos_array[idx] >= 0] if idx.size > 1 or cells.pos_array[idx[0]] >= 0 else idx[:0]
            if occ.size:
                assert (cells.seq_count_many(occ) == 1).all(), "overwriting a cell shared by several sequences"
                seqs = cells.seq_get_many(occ)
                pos = cells.pos_array[occ]
                for q in np.unique(seqs).tolist():
                    m = int(pos[seqs == q].max())
                    seq_pos_max_rm[q] = max(seq_pos_max_rm.get(q, -1), m)
                cells.rm_many(occ)
            sl = slice(s * n, (s + 1) * n)
            ext = None
            if is_2d:
                ext = np.stack([ubatch.pos[2 * nt + s * n: 2 * nt + (s + 1) * n],
                                ubatch.pos[nt + s * n: nt + (s + 1) * n]], axis=1)
            cells.place(idx, ubatch.pos[sl], ubatch.seq_id[sl], ext)
        for q in sorted(seq_pos_max_rm):
            if q >= len(self.stream_of):
                raise RuntimeError(f"overwritten cell holds sequence {q} >= {len(self.stream_of)}")
            cells = self.v_cells[self.stream_of[q]]
            pmin = cells.seq_pos_min(q)
            if pmin <= seq_pos_max_rm[q]:
                log.debug("purging positions [%d, %d] of sequence %d from KV cache", pmin, seq_pos_max_rm[q], q)
                self.seq_rm(q, pmin, seq_pos_max_rm[q] + 1)
        for st, idx in zip(sinfo.strm, sinfo.idxs):
            self.v_heads[st] = int(idx[-1]) + 1

    def place_free(self, sinfo: SlotInfo, ubatch: UBatch) -> bool:
        """apply_ubatch's fast path (no 2-D positions): with every cell of the slot empty (always without SWA), place
        the tokens (the decode step: scalar Python) and move the heads; False, nothing done, if one is occupied."""
        v_cells = self.v_cells
        i, one = sinfo.cell, ubatch.one
        if i >= 0 and one is not None:  # one token (of one sequence) in one stream
            st = sinfo.strm[0]
            if v_cells[st].pos_at(i) >= 0:
                return False
            v_cells[st].place_one(i, one[1], one[0])
            self.v_heads[st] = i + 1
            return True
        if len(sinfo.idxs[0]) != 1:
            for st, idx in zip(sinfo.strm, sinfo.idxs):
                if np.count_nonzero(v_cells[st].pos_array[idx] >= 0):
                    return False
            n = len(sinfo.idxs[0])
            for s, (st, idx) in enumerate(zip(sinfo.strm, sinfo.idxs)):
                v_cells[st].place(idx, ubatch.pos[s * n:(s + 1) * n], ubatch.seq_id[s * n:(s + 1) * n])
                self.v_heads[st] = idx.item(-1) + 1
            return True
        cells = [idx.item(0) for idx in sinfo.idxs]
        for st, c in zip(sinfo.strm, cells):  # (a loop: no generator to make every step)
            if v_cells[st].pos_array.item(c) >= 0:
                return False
        if ubatch.seq_id.shape[1] != 1:  # coupled sequences
            for s, (st, idx) in enumerate(zip(sinfo.strm, sinfo.idxs)):
                v_cells[st].place(idx, ubatch.pos[s:s + 1], ubatch.seq_id[s:s + 1])
        else:
            for st, i, p, q in zip(sinfo.strm, cells, ubatch.pos.tolist(), ubatch.seq_id.reshape(-1).tolist()):
                v_cells[st].place_one(i, p, q)
        for st, i in zip(sinfo.strm, cells):
            self.v_heads[st] = i + 1
        return True

    # ================================================================== restore (the state codec's placements)

    def restore_stream(self, strm: int, pos: np.ndarray, seq_ids: np.ndarray) -> np.ndarray:
        """Fill the first cells of the (empty) stream ``strm`` with ``pos`` int32 [n] and ``seq_ids`` int32
        [n, w] (-1 padded), head at 0; returns the cells, int64 [n]."""
        idxs = np.arange(pos.shape[0], dtype=np.int64)
        self.v_cells[strm].place(idxs, pos, seq_ids)
        self.v_heads[strm] = 0
        return idxs

    def restore_seq(self, seq_id: int, pos: np.ndarray) -> tuple[int, np.ndarray]:
        """Place the cells of sequence ``seq_id`` at positions ``pos`` int32 [n] as a ubatch of them would be
        placed (slot search from the head, then apply); returns (stream, cells int64 [n]).

        ValueError when the stream has no room; the cells are then unchanged.
        """
        n = pos.shape[0]
        strm = self.stream_of[seq_id]
        ub = BatchAllocator(self.n_pos_per_embd).ubatch_reserve(n, 1)
        ub.seq_id_unq[0] = seq_id
        ub.seq_idx[:] = -1
        ub.seq_idx[seq_id] = 0
        ub.pos[:n] = pos
        ub.n_seq_id[:] = 1
        ub.seq_id[:, 0] = seq_id
        sinfo = self.find_slot(ub, False)
        if sinfo.empty():
            cells = self.v_cells[strm]
            raise ValueError(f"stream {strm}: no room for the {n} cells of sequence {seq_id} "
                             f"({cells.size() - cells.get_used()} of {cells.size()} cells free)")
        self.apply_ubatch(sinfo, ub)
        return strm, sinfo.idxs[0]

    # ================================================================== consistency

    def check_invariants(self) -> list[str]:
        """Every inconsistency of the cells (:meth:`KVCells.check_invariants` per stream), of the heads and of the
        sequence-to-stream map, recomputed from scratch; empty when consistent."""
        errs: list[str] = []
        if len(self.v_heads) != len(self.v_cells) or len(self.v_cells) != self.n_stream:
            errs.append(f"{len(self.v_heads)} heads and {len(self.v_cells)} streams, n_stream = {self.n_stream}")
        sizes = sorted({c.size() for c in self.v_cells})
        if len(sizes) > 1:
            errs.append(f"streams have different sizes {sizes}")
        if self.stream_of != self.seq_to_stream.tolist():
            errs.append("the sequence-to-stream list and array disagree")
        for s, cells in enumerate(self.v_cells):
            where = f"stream {s}"
            errs += cells.check_invariants(where)
            if s < len(self.v_heads) and not 0 <= self.v_heads[s] <= cells.size():
                errs.append(f"{where}: head {self.v_heads[s]} out of [0, {cells.size()}]")
            for q in cells.seq_ids():
                if q >= len(self.stream_of):
                    errs.append(f"{where}: sequence {q} is held but the cache maps only {len(self.stream_of)}")
                elif self.stream_of[q] != s:
                    errs.append(f"{where}: sequence {q} is held here but maps to stream {self.stream_of[q]}")
        return errs

    # ================================================================== private helpers


    def check_seq(self, seq_id: int, allow_all: bool = False) -> None:
        """ValueError unless ``seq_id`` is a sequence of this cache (or -1 for all, when allowed)."""
        n = len(self.stream_of)
        if allow_all and seq_id == -1:
            return
        if not 0 <= seq_id < n:
            extra = " or -1 for all" if allow_all else ""
            raise ValueError(f"seq_id {seq_id} out of range [0, {n}){extra}")

    def check_shiftable(self, what: str) -> None:
        """ValueError when positions cannot be shifted: the model has several positions per embedding."""
        n_pos = self.n_pos_per_embd
        if n_pos != 1:
            raise ValueError(f"{what}() is only supported for n_pos_per_embd() == 1, this model has {n_pos}")

    def _lower_head(self, strm: int, emptied: np.ndarray) -> None:
        """If cells were freed below the head, start the next search at the first of them."""
        if emptied.size and emptied[0] < self.v_heads[strm]:
            self.v_heads[strm] = int(emptied[0])

    def _usable(self, cells: KVCells, lo: int, hi: int) -> np.ndarray:
        """bool [hi - lo]: cells that a new token may take -- empty, or one sequence's cell masked by the SWA."""
        pos = cells.pos_array[lo:hi]
        usable = pos < 0
        if self.swa_type == SwaType.NONE or usable.all():
            return usable
        occ = np.flatnonzero(~usable) + lo
        single = occ[cells.seq_count_many(occ) == 1]
        if single.size:
            seqs = cells.seq_get_many(single)
            uniq = np.unique(seqs)
            pmax = np.array([cells.seq_pos_max(int(q)) for q in uniq.tolist()], np.int64)
            p1 = pmax[np.searchsorted(uniq, seqs)] + 1
            masked = is_masked_swa_np(self.n_swa, self.swa_type, cells.pos_array[single].astype(np.int64), p1)
            usable[single[masked] - lo] = True
        return usable

    def _scan(self, cells: KVCells, head: int, n_tokens: int) -> np.ndarray | None:
        """First ``n_tokens`` usable cells in circular order from ``head`` (the seed's one-by-one search)."""
        size = self.kv_size
        hi = min(size, head + n_tokens)
        if hi - head == n_tokens:
            u = self._usable(cells, head, hi)
            if u.all():
                return np.arange(head, hi, dtype=np.int64)
        u = self._usable(cells, 0, size)
        found = np.concatenate([np.flatnonzero(u[head:]) + head, np.flatnonzero(u[:head])])
        if found.size < n_tokens:
            return None
        return found[:n_tokens].astype(np.int64, copy=False)

    def _scan_cont(self, cells: KVCells, head: int, n_tokens: int) -> np.ndarray | None:
        """First window of ``n_tokens`` consecutive usable cells (the seed's contiguous search)."""
        size = cells.size()
        u = self._usable(cells, 0, size)
        n_tested = 0
        while True:
            if head + n_tokens > size:
                n_tested += size - head
                head = 0
                if n_tested >= size:
                    return None
                continue
            win = u[head:head + n_tokens]
            bad = np.flatnonzero(~win)
            if not bad.size:
                return np.arange(head, head + n_tokens, dtype=np.int64)
            k = int(bad[0]) + 1
            head += k
            n_tested += k
            if n_tested >= size:
                return None

    def _debug_dump(self, ubatch: UBatch) -> None:
        """The seed's LLAMA_KV_CACHE_DEBUG report, through logging."""
        full = (self.debug == 2 and self.n_swa > 0) or self.debug > 2
        for s in range(ubatch.n_seqs_unq):
            strm = self.stream_of[int(ubatch.seq_id_unq[s])]
            cells = self.v_cells[strm]
            log.debug("find_slot: stream[%d], n = %5d, used = %5d, head = %5d, size = %5d, n_swa = %5d", strm,
                      cells.used_max_p1(), cells.get_used(), self.v_heads[strm], self.get_size(), self.n_swa)
            if full:
                log.debug("\n%s", cell_map_text(cells))
                log.debug("\n%s", cell_pos_text(cells))
            for q in cells.seq_ids():
                log.debug("find_slot: stream[%d] min[%d] = %5d, max[%d] = %5d", strm, q, cells.seq_pos_min(q), q,
                          cells.seq_pos_max(q))


def _clamp_range(p0: int, p1: int) -> tuple[int, int]:
    """The seed's convention: p0 < 0 means 0, p1 < 0 means +infinity."""
    return (0 if p0 < 0 else p0), (INT32_MAX if p1 < 0 else p1)
