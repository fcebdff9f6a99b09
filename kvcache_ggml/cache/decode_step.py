"""The decode step in two calls: place one token per sequence, then fill its inputs (beyond llama.cpp; no ggml).

The general step goes through five layers and their objects: ``split`` (a UBatch), ``prepare``/``find_slot`` (a
SlotInfo), a KVCacheContext, ``apply_ubatch``, ``get_n_kv``, then ``set_input_*`` per input.  For the common step
-- n tokens of n distinct sequences, each at its sequence's next position, each landing on the free cell at its
stream's head -- the result of all that is a handful of facts: which cell each token takes, the ``n_kv`` the graph
reads, and the inputs of those cells.  :class:`CacheStep` computes them directly from the bookkeeping:

* :meth:`CacheStep.place` checks that the step is that simple case *and* that its slot and ``n_kv`` are those of
  the graph the caller wants to compute again (llama.cpp's graph reuse), then places the tokens exactly as
  ``apply_ubatch`` would (the same cells, positions, bits, heads, used range and change log); anything else
  returns None with nothing changed, and the caller takes the general path;
* :meth:`CacheStep.fill` writes the K/V destination rows and the kq mask rows into a graph's input views
  (:meth:`KVCacheContext.input_views`), as ``fill_inputs`` would.

What "simple" excludes: a sliding window, ALiBi (the mask rows need the positions), a cache whose fast paths are
off, a head cell that is occupied or too close to the end (the slot search would scan), and several tokens in one
stream that do not fit from the head on.  ``tests/test_fused_step.py`` runs a runtime with this step next to one
without it on random traces and compares logits, cells, heads, inputs and state blobs after every decode.
"""
from __future__ import annotations

import numpy as np

from ..hparams import SwaType
from .bookkeeping import KVBookkeeping
from .cells.onecell import slot_search_start
from .inputs import KVInputs
from .masks import mask_decode_row

__all__ = ["CacheStep"]


class CacheStep:
    """The cache's side of the fused decode step (see the module docstring): :meth:`place`, then :meth:`fill`."""

    def __init__(self, book: KVBookkeeping, inputs: KVInputs) -> None:
        self.book = book                        # the cells, heads and streams the step places into
        self.inputs = inputs                    # the mask rows and the V layout the step fills from
        self.kv_size = book.kv_size             # cells per stream
        # no window and no ALiBi: a placed token's mask row depends on the sequence bits alone (mask_rows.py)
        self.plain = book.swa_type == SwaType.NONE and not inputs.hparams.use_alibi
        self.strms: list[int] = []              # the stream of each token of the last place()
        self.cells: list[int] = []              # the cell of each token of the last place()
        self.strm_one = self.cell_one = -1      # the stream and cell of the token of the last place_one()
        self._k_idxs: np.ndarray | None = None  # the k_idxs view fill_one last wrote, and memoryviews of it and
        self._k_m = self._v_m = memoryview(b"")  # of the v_idxs view beside it
        # (n, v_idxs, v_idxs as [n, n_embd] with a transposed V) of the last fill
        self._v_rows: tuple = (0, None, None)

    def ready(self) -> bool:
        """The fused step may run now: plain masks, fast paths on (the equivalence tests turn them off), and no
        pending update (stream copies or a K-shift: the general path applies it first)."""
        book = self.book
        if not (self.plain and book.fast and self.inputs.fast) or book.sc_info.ssrc:
            return False
        for c in book.v_cells:
            if c.get_has_shift():
                return False
        return True

    # ------------------------------------------------------------------ placement

    def place_one(self, s: int, p: int, n_kv: int, s0: int, s1: int) -> bool:
        """:meth:`place` of one token (sequence ``s``, position ``p``), without lists."""
        book = self.book
        st = book.stream_of[s]
        if st != s0 or st != s1:
            return False
        c = book.v_cells[st]
        got = c.one_token_slot(book.v_heads[st])  # (find_slot's cell: the free head, or cell 0 after a restart)
        if got is None or book.padded_n_kv(got[1]) != n_kv:
            return False
        h = got[0]
        c.place_one(h, p, s)
        book.v_heads[st] = h + 1
        self.strm_one, self.cell_one = st, h
        return True

    def place(self, seqs: list[int], pos: list[int], n_kv: int, s0: int, s1: int) -> bool:
        """Place token k (sequence ``seqs[k]``, position ``pos[k]``) on the free head cell of its stream, as
        split + prepare + apply_ubatch would, when the slot's streams are [s0, s1] and the cells to attend after
        placing are ``n_kv``; False, with nothing changed, otherwise.

        The caller has validated the batch: distinct sequences of this cache, ``pos[k]`` =
        ``seq_pos_max(seqs[k]) + 1``, for several streams ``seqs`` rising by one (split_equal's order), no
        pending update."""
        book = self.book
        if book.n_stream == 1:
            return self._place_unified(seqs, pos, n_kv, s0, s1)
        v_cells, v_heads = book.v_cells, book.v_heads
        strms = [book.stream_of[s] for s in seqs]
        if min(strms) != s0 or max(strms) != s1:
            return False
        cells, used = [], 0
        for st in strms:
            got = v_cells[st].one_token_slot(v_heads[st])  # (find_slot's cell: the free head, or 0 after a restart)
            if got is None:
                return False
            cells.append(got[0])
            if got[1] > used:
                used = got[1]
        if book.padded_n_kv(used) != n_kv:
            return False
        for st, s, p, i in zip(strms, seqs, pos, cells):
            v_cells[st].place_one(i, p, s)
            v_heads[st] = i + 1
        self.strms, self.cells = strms, cells
        return True

    def _place_unified(self, seqs: list[int], pos: list[int], n_kv: int, s0: int, s1: int) -> bool:
        """place() in a one-stream cache: the tokens take the cells head, head + 1, ... in batch order."""
        book = self.book
        n = len(seqs)
        c = book.v_cells[0]
        h = slot_search_start(book.v_heads[0], c.get_used(), n)
        if s0 or s1 or h + n > self.kv_size or np.count_nonzero(c.pos_array[h:h + n] >= 0):
            return False
        if book.padded_n_kv(max(c.used_max_p1(), h + n)) != n_kv:
            return False
        cells = list(range(h, h + n))
        for i, s, p in zip(cells, seqs, pos):
            c.place_one(i, p, s)
        book.v_heads[0] = h + n
        self.strms, self.cells = [0] * n, cells
        return True

    # ------------------------------------------------------------------ inputs

    def fill_one(self, views: tuple[np.ndarray, np.ndarray, np.ndarray], s: int, p: int, causal: bool) -> None:
        """:meth:`fill` of the one token of the last :meth:`place_one` (sequence ``s``, position ``p``)."""
        k_idxs, v_idxs, mask = views
        if k_idxs is not self._k_idxs:  # (memoryviews: scalar writes a few times cheaper than numpy's)
            self._k_idxs, self._k_m, self._v_m = k_idxs, memoryview(k_idxs), memoryview(v_idxs)
        st, i = self.strm_one, self.cell_one
        size = self.kv_size
        self._k_m[0] = row = i + st * size
        inputs = self.inputs
        if inputs.v_trans:  # one index per V element
            inputs.write_v_idxs_one(v_idxs, i, st)
        else:
            self._v_m[0] = row
        if not inputs.mask_rows.write_one(mask, s, p, causal):
            mask_decode_row(mask[0], self.book.v_cells[st], s, p, causal)

    def fill(self, views: tuple[np.ndarray, np.ndarray, np.ndarray], seqs: list[int], pos: list[int],
             causal: bool) -> None:
        """The k_idxs, v_idxs and kq-mask inputs of the tokens of the last :meth:`place` into ``views``
        (:meth:`KVCacheContext.input_views` of the graph), the bytes ``fill_inputs`` writes."""
        k_idxs, v_idxs, mask = views
        size, strms, cells = self.kv_size, self.strms, self.cells
        n = len(cells)
        inputs = self.inputs
        if k_idxs is not self._k_idxs:  # (memoryviews: scalar writes a few times cheaper than numpy's)
            self._k_idxs, self._k_m, self._v_m = k_idxs, memoryview(k_idxs), memoryview(v_idxs)
        if self._v_rows[0] != n or self._v_rows[1] is not v_idxs:  # v_idxs as [n, n_embd]
            self._v_rows = (n, v_idxs, v_idxs.reshape(n, inputs.n_v_elems) if inputs.v_trans else None)
        k_m = self._k_m
        for j in range(n):
            k_m[j] = cells[j] + strms[j] * size
        if inputs.v_trans:  # one index per V element
            inputs.write_v_idxs_rows(self._v_rows[2], cells, strms)
        else:
            v_idxs[...] = k_idxs
        if inputs.mask_rows.write(mask, seqs, pos, causal):
            return
        v_cells, stream_of = self.book.v_cells, self.book.stream_of
        for k, (s, p) in enumerate(zip(seqs, pos)):  # the full build, row by row (one token per sequence)
            mask_decode_row(mask[k], v_cells[stream_of[s]], s, p, causal)
