"""The KV cache: llama.cpp's ``llama_kv_cache`` and ``llama_kv_cache_context``.

:class:`KVCache` owns, per stream, the cells (:class:`~kvcache_ggml.cells.KVCells`) and the head, and per kept
layer the K and V tensors.  This module holds the constructor and the bookkeeping half (sequence operations, slot
search, ubatch placement, preparation with roll-back, memory contexts); the graph, input and state halves live in
their own modules and are mixed into the same class, as the seed keeps them in one class.

Errors follow three tiers: ``assert`` for internal invariants, ``RuntimeError`` for a caller bug (a call the seed
reaches only through a broken caller, such as an ubatch whose layout does not fit the streams), ``ValueError`` for
bad input (an out-of-range sequence id, a cache-sized batch that can never fit, a K-shift on an M-RoPE model).
Every check runs before any change: a failed call leaves the cache exactly as it was.
"""
from __future__ import annotations

import enum
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from ._consts import LLAMA_MAX_SEQ
from .cells import KVCells
from .hparams import SwaType, is_masked_swa_np

__all__ = ["KVCache", "KVCacheParams", "KVCacheContext", "SlotInfo", "StreamCopyInfo", "MemoryStatus"]

log = logging.getLogger("kvcache_ggml.cache")

_POS_MAX = np.iinfo(np.int32).max


class MemoryStatus(enum.IntEnum):
    """llama.cpp's ``llama_memory_status``."""

    SUCCESS = 0
    NO_UPDATE = 1
    FAILED_PREPARE = 2
    FAILED_COMPUTE = 3

    def is_fail(self) -> bool:
        return self in (MemoryStatus.FAILED_PREPARE, MemoryStatus.FAILED_COMPUTE)


class ModelLike(Protocol):
    """What the cache needs from a model: its hyper-parameters and, with ``offload``, each layer's device."""

    hparams: Any

    def dev_layer(self, il: int) -> Any: ...


@dataclass(slots=True)
class KVCacheParams:
    """The seed constructor's arguments after the model."""

    type_k: str | int = "f16"        # ggml type of the K cache ("f16", "q8_0", ... or the enum value)
    type_v: str | int = "f16"        # ggml type of the V cache
    v_trans: bool = True             # store V transposed (the non-flash-attention layout)
    offload: bool = False            # place each layer on model.dev_layer(il) instead of the CPU
    unified: bool = True             # one stream shared by all sequences; else one stream per sequence
    kv_size: int = 256               # cells per stream
    n_seq_max: int = 1               # number of sequences the cache serves
    n_pad: int = 1                   # kv_size must be a multiple of this; n_kv is padded to max(n_pad, 256)
    n_swa: int = 0                   # sliding-window size
    swa_type: SwaType = SwaType.NONE  # sliding-window rule
    filter: Callable[[int], bool] | None = None  # keep layer il in this cache?
    reuse: Callable[[int], int] | None = None    # layer il shares the tensors of layer reuse(il) (>= 0)


@dataclass(slots=True)
class SlotInfo:
    """Where one ubatch goes: per stream used by the ubatch, the cells of its tokens (``slot_info``)."""

    s0: int = LLAMA_MAX_SEQ                                   # first stream of the ubatch
    s1: int = 0                                               # last stream of the ubatch
    strm: list[int] = field(default_factory=list)             # stream of each sequence set
    idxs: list[np.ndarray] = field(default_factory=list)      # int64 [n_tokens_per_stream] cells, per stream

    def n_stream(self) -> int:
        return len(self.strm)

    def size(self) -> int:
        assert len(self.idxs) == len(self.strm)
        return len(self.idxs[0])

    def head(self) -> int:
        assert len(self.idxs) == 1 and len(self.idxs[0]) > 0
        return int(self.idxs[0][0])

    def is_contiguous(self) -> bool:
        """One stream whose cells are consecutive."""
        if len(self.idxs) != 1:
            return False
        idx = self.idxs[0]
        return idx.size == 0 or int(idx[-1]) - int(idx[0]) + 1 == idx.size and bool((np.diff(idx) == 1).all())

    def empty(self) -> bool:
        return len(self.idxs) == 0

    def resize(self, n: int) -> None:
        self.strm = [0] * n
        self.idxs = [np.empty(0, np.int64) for _ in range(n)]


@dataclass(slots=True)
class StreamCopyInfo:
    """Whole-stream copies queued by cross-stream ``seq_cp`` for the next update."""

    ssrc: list[int] = field(default_factory=list)  # source stream of each copy
    sdst: list[int] = field(default_factory=list)  # destination stream of each copy

    def empty(self) -> bool:
        assert len(self.ssrc) == len(self.sdst)
        return not self.ssrc


from ._cache_tensors import TensorMixin  # noqa: E402  (the mixins need the value objects above)
from ._cache_graph import GraphMixin  # noqa: E402
from ._cache_inputs import ContextInputsMixin, InputMixin  # noqa: E402
from .state import StateMixin  # noqa: E402


class KVCache(TensorMixin, GraphMixin, InputMixin, StateMixin):
    """llama.cpp's ``llama_kv_cache``: cells and heads per stream, K/V tensors per layer."""

    def __init__(self, model: ModelLike, params: KVCacheParams | None = None, **kwargs: Any) -> None:
        if params is None:
            params = KVCacheParams(**kwargs)
        elif kwargs:
            raise TypeError(f"pass either params or keyword arguments, not both: {sorted(kwargs)}")
        p = params
        if p.kv_size <= 0:
            raise ValueError(f"kv_size must be > 0, got {p.kv_size}")
        if p.n_pad <= 0 or p.kv_size % p.n_pad != 0:
            raise ValueError(f"kv_size {p.kv_size} must be a multiple of n_pad {p.n_pad}")
        if not 1 <= p.n_seq_max <= LLAMA_MAX_SEQ:
            raise ValueError(f"n_seq_max {p.n_seq_max} out of [1, {LLAMA_MAX_SEQ}]")
        if p.n_swa < 0:
            raise ValueError(f"n_swa must be >= 0, got {p.n_swa}")
        swa_type = SwaType(p.swa_type)
        if swa_type == SwaType.CHUNKED and p.n_swa == 0:
            raise ValueError("swa_type CHUNKED needs n_swa > 0, got 0")

        self.model = model
        self.hparams = model.hparams
        self.params = p
        self.v_trans = bool(p.v_trans)
        self.n_seq_max = int(p.n_seq_max)
        self.n_stream = 1 if p.unified else self.n_seq_max
        self.n_pad = int(p.n_pad)
        self.n_swa = int(p.n_swa)
        self.swa_type = swa_type

        self.v_heads: list[int] = [0] * self.n_stream
        self.v_cells: list[KVCells] = [KVCells(p.kv_size) for _ in range(self.n_stream)]
        # sequence -> stream; every sequence maps to stream 0 of a unified cache
        self.seq_to_stream = (np.zeros(LLAMA_MAX_SEQ, np.int32) if self.n_stream == 1
                              else np.arange(self.n_stream, dtype=np.int32))
        self._seq_to_stream_list: list[int] = self.seq_to_stream.tolist()
        self.sc_info = StreamCopyInfo()

        dbg = os.environ.get("LLAMA_KV_CACHE_DEBUG")
        self.debug = int(dbg) if dbg and dbg.lstrip("-").isdigit() else 0

        self._init_tensors()

    # ================================================================== memory API

    def clear(self, data: bool = True) -> None:
        for s in range(self.n_stream):
            self.v_cells[s].reset()
            self.v_heads[s] = 0
        if data:
            self._clear_buffers()

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove positions [p0, p1) of ``seq_id`` (of every sequence when -1). Always True, as the seed."""
        self._check_seq(seq_id, allow_all=True)
        p0, p1 = _clamp_range(p0, p1)
        if seq_id >= 0:
            strm = self._seq_to_stream_list[seq_id]
            cells = self.v_cells[strm]
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
        """Copy positions [p0, p1) of ``seq_id_src`` into ``seq_id_dst``.

        Within a stream only the cells change.  Across streams only whole sequences can be copied: the destination
        stream is replaced by the source's cells of ``seq_id_src`` and a buffer copy is queued for the next update.
        """
        self._check_seq(seq_id_src)
        self._check_seq(seq_id_dst)
        s0 = self._seq_to_stream_list[seq_id_src]
        s1 = self._seq_to_stream_list[seq_id_dst]
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
        self._check_seq(seq_id)
        strm = self._seq_to_stream_list[seq_id]
        cells = self.v_cells[strm]
        idxs = np.flatnonzero(cells.pos_array >= 0)
        emptied = cells.seq_keep_many(idxs, seq_id) if idxs.size else idxs
        self._lower_head(strm, emptied)

    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        """Add ``shift`` to positions [p0, p1) of ``seq_id``; cells pushed below 0 are freed."""
        self._check_seq(seq_id)
        self._check_shiftable("seq_add")
        if shift == 0:
            return
        if not -_POS_MAX - 1 <= shift <= _POS_MAX:
            raise ValueError(f"seq_add() shift {shift} does not fit a llama_pos (int32)")
        p0, p1 = _clamp_range(p0, p1)
        if p0 == p1:
            return
        strm = self._seq_to_stream_list[seq_id]
        cells = self.v_cells[strm]
        idxs = cells.find(p0, p1, seq_id)
        emptied = cells.pos_add_many(idxs, shift) if idxs.size else idxs
        self.v_heads[strm] = int(emptied[0]) if emptied.size else 0

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        """Divide positions [p0, p1) of ``seq_id`` by ``d`` (integer division)."""
        self._check_seq(seq_id)
        self._check_shiftable("seq_div")
        if d == 1:
            return
        if not 1 <= d <= _POS_MAX:
            raise ValueError(f"seq_div() divisor must be in [1, {_POS_MAX}], got {d}")
        p0, p1 = _clamp_range(p0, p1)
        if p0 == p1:
            return
        cells = self.v_cells[self._seq_to_stream_list[seq_id]]
        idxs = cells.find(p0, p1, seq_id)
        if idxs.size:
            cells.pos_div_many(idxs, d)

    def seq_pos_min(self, seq_id: int) -> int:
        self._check_seq(seq_id)
        return self.v_cells[self._seq_to_stream_list[seq_id]].seq_pos_min(seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        self._check_seq(seq_id)
        return self.v_cells[self._seq_to_stream_list[seq_id]].seq_pos_max(seq_id)

    def get_size(self) -> int:
        return self.v_cells[self._seq_to_stream_list[0]].size()

    def get_n_stream(self) -> int:
        return self.n_stream

    def get_has_shift(self) -> bool:
        return any(c.get_has_shift() for c in self.v_cells)

    def get_can_shift(self) -> bool:
        return True

    def get_n_kv(self, sinfo: SlotInfo) -> int:
        """Cells the attention must read for this slot: used range padded to max(n_pad, 256), capped at size."""
        n_pad_cur = max(self.n_pad, 256)
        res = 0
        for s in sinfo.strm:
            cells = self.v_cells[s]
            used = cells.used_max_p1()
            padded = (used + n_pad_cur - 1) & ~(n_pad_cur - 1)  # GGML_PAD: a true multiple for powers of two
            res = max(res, min(cells.size(), max(n_pad_cur, padded)))
        return res

    # ================================================================== preparation API

    def init_batch(self, balloc: Any, n_ubatch: int, embd_all: bool = False) -> "KVCacheContext":
        """Split the allocator's batch into ubatches and find a slot for each, without changing the cells."""
        del embd_all
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
            return KVCacheContext(self, status=MemoryStatus.FAILED_PREPARE)
        size = self.get_size()
        for ub in ubatches:
            per_stream = ub.n_tokens // (ub.n_seqs_unq if self.n_stream > 1 else 1)
            if per_stream > size:
                raise ValueError(f"a ubatch of {per_stream} tokens per stream can never fit a cache of "
                                 f"{size} cells (n_ubatch={n_ubatch})")
        sinfos = self.prepare(ubatches)
        if not sinfos:
            return KVCacheContext(self, status=MemoryStatus.FAILED_PREPARE)
        return KVCacheContext(self, sinfos=sinfos, ubatches=ubatches)

    def init_full(self) -> "KVCacheContext":
        """A context over the whole cache, to reserve graphs."""
        return KVCacheContext.full(self)

    def init_update(self, lctx: Any = None, optimize: bool = False) -> "KVCacheContext":
        """A context that applies the queued stream copies and the pending K-shift when applied."""
        del optimize
        sc_info, self.sc_info = self.sc_info, StreamCopyInfo()
        return KVCacheContext.update_ctx(self, lctx, self.get_has_shift(), sc_info)

    def prepare(self, ubatches: Sequence[Any]) -> list[SlotInfo]:
        """Find a slot for each ubatch as if the previous ones were placed; the cells end as they began.

        Returns one SlotInfo per ubatch, or [] when one does not fit.  As in the seed, the purge that
        ``apply_ubatch`` makes to keep sequences contiguous is not rolled back, and each head is restored from
        the saved head of the same *index* in the slot (``v_heads[strm[s]] = old[s]``).
        """
        res: list[SlotInfo] = []
        states = []
        success = True
        last = len(ubatches) - 1
        for k, ub in enumerate(ubatches):
            sinfo = self.find_slot(ub, False)
            if sinfo.empty():
                success = False
                break
            res.append(sinfo)
            heads_old = list(self.v_heads)
            # without SWA every found cell is empty; with SWA a found cell may hold a masked token
            if k == last and (self.swa_type == SwaType.NONE or
                              all(not (self.v_cells[st].pos_array[idx] >= 0).any()
                                  for st, idx in zip(sinfo.strm, sinfo.idxs))):
                # the last ubatch lands on empty cells only: placing it and rolling it back changes no cell
                states.append((sinfo, heads_old, None))
                break
            saved = [self.v_cells[st]._snapshot(idx) for st, idx in zip(sinfo.strm, sinfo.idxs)]
            states.append((sinfo, heads_old, saved))
            self.apply_ubatch(sinfo, ub)
        for sinfo, heads_old, saved in reversed(states):
            for s, (st, idx) in enumerate(zip(sinfo.strm, sinfo.idxs)):
                if saved is not None:
                    self.v_cells[st]._restore(idx, *saved[s])
                self.v_heads[st] = heads_old[s]
        return res if success else []

    def find_slot(self, ubatch: Any, cont: bool = False) -> SlotInfo:
        """Cells for the ubatch's tokens, per stream, from each stream's head; empty SlotInfo when none."""
        if self.debug > 0:
            self._debug_dump(ubatch)
        n_tokens = ubatch.n_tokens
        n_seqs = 1
        if self.n_stream > 1:
            if n_tokens % ubatch.n_seqs_unq:
                raise RuntimeError(f"ubatch of {n_tokens} tokens is not split evenly over {ubatch.n_seqs_unq} "
                                   "sequences (use split_equal with a multi-stream cache)")
            n_seqs = ubatch.n_seqs_unq
            n_tokens //= n_seqs
        res = SlotInfo()
        for s in range(n_seqs):
            seq_id = int(ubatch.seq_id_unq[s])
            if self.n_stream > 1:
                t = s * n_tokens
                if ubatch.n_seq_id[t] != 1 or ubatch.seq_id[t, 0] != seq_id:
                    raise RuntimeError(f"token {t} of the ubatch must belong to sequence {seq_id} alone")
            strm = self._seq_to_stream_list[seq_id]
            cells = self.v_cells[strm]
            head_cur = self.v_heads[strm]
            if head_cur > cells.get_used() + 2 * n_tokens:
                head_cur = 0
            if n_tokens > cells.size():
                log.error("find_slot: n_tokens = %d > size = %d", n_tokens, cells.size())
                return SlotInfo()
            idx = (self._scan_cont if cont else self._scan)(cells, head_cur, n_tokens)
            if idx is None:
                return SlotInfo()
            res.s0 = min(res.s0, strm)
            res.s1 = max(res.s1, strm)
            res.strm.append(strm)
            res.idxs.append(idx)
        return res

    def apply_ubatch(self, sinfo: SlotInfo, ubatch: Any) -> None:
        """Write the ubatch's positions and sequences into the slot's cells, then purge and move the heads."""
        assert ubatch.n_tokens == sinfo.n_stream() * sinfo.size()
        n = sinfo.size()
        seq_pos_max_rm: dict[int, int] = {}
        is_2d = ubatch.is_pos_2d()
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
            if q >= len(self._seq_to_stream_list):
                raise RuntimeError(f"overwritten cell holds sequence {q} >= {len(self._seq_to_stream_list)}")
            cells = self.v_cells[self._seq_to_stream_list[q]]
            pmin = cells.seq_pos_min(q)
            if pmin <= seq_pos_max_rm[q]:
                log.debug("purging positions [%d, %d] of sequence %d from KV cache", pmin, seq_pos_max_rm[q], q)
                self.seq_rm(q, pmin, seq_pos_max_rm[q] + 1)
        for st, idx in zip(sinfo.strm, sinfo.idxs):
            self.v_heads[st] = int(idx[-1]) + 1

    # ================================================================== private helpers

    def _check_seq(self, seq_id: int, allow_all: bool = False) -> None:
        n = len(self._seq_to_stream_list)
        if allow_all and seq_id == -1:
            return
        if not 0 <= seq_id < n:
            extra = " or -1 for all" if allow_all else ""
            raise ValueError(f"seq_id {seq_id} out of range [0, {n}){extra}")

    def _check_shiftable(self, what: str) -> None:
        n_pos = self.hparams.n_pos_per_embd()
        if n_pos != 1:
            raise ValueError(f"{what}() is only supported for n_pos_per_embd() == 1, this model has {n_pos}")

    def _lower_head(self, strm: int, emptied: np.ndarray) -> None:
        """If cells were freed below the head, start the next search at the first of them."""
        if emptied.size:
            first = int(emptied[0])
            if first < self.v_heads[strm]:
                self.v_heads[strm] = first

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
        size = cells.size()
        if n_tokens == 1 and head < size and cells.pos_array[head] < 0:
            return np.array([head], np.int64)  # the decode step: the head cell is free (empty is always usable)
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

    def _debug_dump(self, ubatch: Any) -> None:
        """The seed's LLAMA_KV_CACHE_DEBUG report, through logging."""
        full = (self.debug == 2 and self.n_swa > 0) or self.debug > 2
        for s in range(ubatch.n_seqs_unq):
            strm = self._seq_to_stream_list[int(ubatch.seq_id_unq[s])]
            cells = self.v_cells[strm]
            log.debug("find_slot: stream[%d], n = %5d, used = %5d, head = %5d, size = %5d, n_swa = %5d", strm,
                      cells.used_max_p1(), cells.get_used(), self.v_heads[strm], self.get_size(), self.n_swa)
            if full:
                log.debug("\n%s", cell_map_text(cells))
                log.debug("\n%s", cell_pos_text(cells))
            for q in sorted(cells._seq_pos):
                log.debug("find_slot: stream[%d] min[%d] = %5d, max[%d] = %5d", strm, q, cells.seq_pos_min(q), q,
                          cells.seq_pos_max(q))


class KVCacheContext(ContextInputsMixin):
    """llama.cpp's ``llama_kv_cache_context``: the ubatches of one batch and their slots, or an update."""

    def __init__(self, kv: KVCache | None, *, status: MemoryStatus = MemoryStatus.SUCCESS,
                 sinfos: list[SlotInfo] | None = None, ubatches: list[Any] | None = None) -> None:
        self.status = status                       # outcome of the init_* call
        self.kv = kv                               # the cache this context works on
        self.sinfos = sinfos or []                 # slot of each ubatch
        self.ubatches = ubatches or []             # the ubatches of the batch
        self.i_cur = 0                             # current ubatch
        self.n_kv = 0                              # cells the current ubatch attends to (after apply())
        self.lctx: Any = None                      # update: what the K-shift graph runs on
        self.do_shift = False                      # update: apply the pending K-shift
        self.sc_info = StreamCopyInfo()            # update: stream copies to perform

    @classmethod
    def full(cls, kv: KVCache) -> "KVCacheContext":
        ctx = cls(kv)
        ctx.n_kv = kv.get_size()
        ns = kv.get_n_stream()
        ctx.sinfos = [SlotInfo(s0=0, s1=ns - 1, strm=list(range(ns)),
                               idxs=[np.zeros(1, np.int64) for _ in range(ns)])]
        return ctx

    @classmethod
    def update_ctx(cls, kv: KVCache, lctx: Any, do_shift: bool, sc_info: StreamCopyInfo) -> "KVCacheContext":
        status = MemoryStatus.SUCCESS if do_shift or not sc_info.empty() else MemoryStatus.NO_UPDATE
        ctx = cls(kv, status=status)
        ctx.lctx, ctx.do_shift, ctx.sc_info = lctx, do_shift, sc_info
        return ctx

    # ------------------------------------------------------------------ iteration

    def next(self) -> bool:
        assert self.status == MemoryStatus.SUCCESS
        self.i_cur += 1
        return self.i_cur < len(self.ubatches)

    def apply(self) -> bool:
        if self.status.is_fail():
            raise RuntimeError(f"apply() on a failed memory context ({self.status.name})")
        if not self.ubatches:
            try:
                self.kv.update(self.lctx, self.do_shift, self.sc_info)
            except Exception:
                # queue the stream copies again (a whole-stream copy is idempotent): a later update makes them
                self.kv.sc_info.ssrc[:0] = self.sc_info.ssrc
                self.kv.sc_info.sdst[:0] = self.sc_info.sdst
                raise
            return True
        self.kv.apply_ubatch(self.sinfos[self.i_cur], self.ubatches[self.i_cur])
        self.n_kv = self.kv.get_n_kv(self.sinfos[self.i_cur])
        return True

    def get_status(self) -> MemoryStatus:
        return self.status

    def get_ubatch(self) -> Any:
        assert self.status == MemoryStatus.SUCCESS
        return self.ubatches[self.i_cur]

    def get_n_kv(self) -> int:
        return self.n_kv

    def get_sinfo(self) -> SlotInfo:
        return self.sinfos[self.i_cur]

    # ------------------------------------------------------------------ graph_build API (delegates)

    def get_k(self, ctx: Any, il: int) -> Any:
        return self.kv.get_k(ctx, il, self.n_kv, self.sinfos[self.i_cur])

    def get_v(self, ctx: Any, il: int) -> Any:
        return self.kv.get_v(ctx, il, self.n_kv, self.sinfos[self.i_cur])

    def cpy_k(self, ctx: Any, k_cur: Any, k_idxs: Any, il: int) -> Any:
        return self.kv.cpy_k(ctx, k_cur, k_idxs, il, self.sinfos[self.i_cur])

    def cpy_v(self, ctx: Any, v_cur: Any, v_idxs: Any, il: int) -> Any:
        return self.kv.cpy_v(ctx, v_cur, v_idxs, il, self.sinfos[self.i_cur])

    def build_input_k_idxs(self, ctx: Any, ubatch: Any) -> Any:
        return self.kv.build_input_k_idxs(ctx, ubatch)

    def build_input_v_idxs(self, ctx: Any, ubatch: Any) -> Any:
        return self.kv.build_input_v_idxs(ctx, ubatch)

    # ------------------------------------------------------------------ input API (delegates)

    def set_input_k_shift(self, dst: Any) -> None:
        self.kv.set_input_k_shift(dst)

    def set_input_k_idxs(self, dst: Any, ubatch: Any) -> None:
        self.kv.set_input_k_idxs(dst, ubatch, self.sinfos[self.i_cur])

    def set_input_v_idxs(self, dst: Any, ubatch: Any) -> None:
        self.kv.set_input_v_idxs(dst, ubatch, self.sinfos[self.i_cur])

    def set_input_kq_mask(self, dst: Any, ubatch: Any, causal_attn: bool = True) -> None:
        self.kv.set_input_kq_mask(dst, ubatch, causal_attn)

    def set_input_pos_bucket(self, dst: Any, ubatch: Any) -> None:
        self.kv.set_input_pos_bucket(dst, ubatch)


def cell_map_text(cells: KVCells) -> str:
    """One character per cell: '.' empty, the sequence id when one, 'M' when several; 256 cells a line."""
    pos = cells.pos_array
    out = []
    for start in range(0, cells.size(), 256):
        idx = np.arange(start, min(start + 256, cells.size()))
        occ = idx[pos[idx] >= 0]
        chars = np.full(idx.size, ".", dtype=object)
        if occ.size:
            cnt = cells.seq_count_many(occ)
            seq = cells.seq_get_many(occ)
            chars[occ - start] = np.where(cnt == 1, seq.astype(str), "M")
        out.append("".join(chars.tolist()) + (" *" if idx.size == 256 else ""))
    return "\n".join(out)


def cell_pos_text(cells: KVCells) -> str:
    """The position of each cell in a 5-wide column ('.' when empty), 64 cells a line."""
    pos = cells.pos_array
    words = [(str(p) if p >= 0 else ".").ljust(5) for p in pos.tolist()]
    lines = []
    for start in range(0, len(words), 64):
        chunk = words[start:start + 64]
        line = ""
        for k, w in enumerate(chunk):
            line += w + (" *" if (start + k) % 256 == 255 else "")
        lines.append(line)
    return "\n".join(lines)


def _clamp_range(p0: int, p1: int) -> tuple[int, int]:
    """The seed's convention: p0 < 0 means 0, p1 < 0 means +infinity."""
    return (0 if p0 < 0 else p0), (_POS_MAX if p1 < 0 else p1)
