"""Interleaved sliding-window attention: llama.cpp's ``llama_kv_cache_iswa`` and its memory context.

A model whose layers alternate between full attention and a sliding window (Gemma 2/3 and others) keeps two
:class:`~kvcache_ggml.cache.KVCache` instances: the *base* cache holds the K/V of the non-SWA layers for the whole
context, the *SWA* cache holds the K/V of the SWA layers in few cells -- the window of each sequence plus one
ubatch, padded to 256 (``swa_full`` makes it as large as the base cache).  Both see the same positions of the same
sequences: every sequence operation goes to both, a batch is split once and each ubatch is placed in both (the
SWA cache reuses cells that every sequence's window has left behind, so it never fills up on one sequence).

:class:`KVCacheISWAContext` is what a model graph works with: per layer it hands out the base or the SWA cache's
views and copies (:meth:`~KVCacheISWAContext.get_k` ...), and :meth:`~KVCacheISWAContext.get_base` /
:meth:`~KVCacheISWAContext.get_swa` give each cache's own context for the index and kq-mask inputs (two of each,
as llama.cpp's ``llm_graph_input_attn_kv_iswa``).

State: ``state_write`` writes the base cache's state then the SWA cache's, each in :mod:`kvcache_ggml.cache.state`'s
format (llama.cpp's layout).  With ``flags & STATE_SEQ_FLAGS_PARTIAL_ONLY`` only the SWA cache's part is written or
read: that is what a *checkpoint* for prompt reuse saves (:mod:`kvcache_ggml.cache.swa_checkpoint`).

Errors: as :class:`~kvcache_ggml.cache.KVCache`.  Every argument check runs before either cache changes.  A failed
restore leaves *both* caches as after a failed restore (whole state: both empty; one sequence: that sequence removed
from both).  llama.cpp instead leaves the cache it had not reached yet as it was (a base failure keeps the old SWA
cells, an SWA failure keeps the restored base cells); here the two caches never disagree about a sequence, since
``seq_pos_min``/``seq_pos_max`` answer from the SWA cache alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .. import ggml as G
from ..hparams import SwaType
from .context import KVCacheContext
from .kvcache import KVCache
from .state.io import BytesReader, CountingWriter, StateReader, StateWriter
from .types import KVCacheParams, MemoryStatus, SlotInfo

__all__ = ["KVCacheISWA", "KVCacheISWAParams", "KVCacheISWAContext", "swa_cache_size", "combine_status",
           "STATE_SEQ_FLAGS_PARTIAL_ONLY"]

#: ``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY`` (= ``LLAMA_STATE_SEQ_FLAGS_SWA_ONLY``) of llama.h
STATE_SEQ_FLAGS_PARTIAL_ONLY = 1
_SWA_PAD = 256  # llama.cpp pads the SWA cache to this many cells (ggml-org/llama.cpp#17037)


def swa_cache_size(kv_size: int, n_swa: int, n_seq_max: int, n_ubatch: int, unified: bool,
                   swa_full: bool = False) -> int:
    """Cells per stream of the SWA cache: ``kv_size`` with ``swa_full``, else the window of every sequence sharing
    a stream plus one ubatch, at most ``kv_size``, padded up to a multiple of 256 (so it may exceed ``kv_size``)."""
    if swa_full:
        return kv_size
    need = min(kv_size, n_swa * (n_seq_max if unified else 1) + n_ubatch)
    return -(-need // _SWA_PAD) * _SWA_PAD


def combine_status(s0: MemoryStatus, s1: MemoryStatus) -> MemoryStatus:
    """``llama_memory_status_combine``: the first failure, else SUCCESS when either has an update."""
    for s in (s0, s1):
        if s.is_fail():
            return s
    return MemoryStatus.SUCCESS if MemoryStatus.SUCCESS in (s0, s1) else MemoryStatus.NO_UPDATE


@dataclass(slots=True)
class KVCacheISWAParams:
    """``llama_kv_cache_iswa``'s constructor arguments after the model."""

    type_k: str | int = "f16"        # ggml type of both caches' K
    type_v: str | int = "f16"        # ggml type of both caches' V
    v_trans: bool = True             # store V transposed (the non-flash-attention layout)
    offload: bool = False            # place each layer on model.dev_layer(il) instead of the CPU
    swa_full: bool = False           # the SWA cache as large as the base cache (prompt reuse without checkpoints)
    unified: bool = True             # one stream shared by all sequences; else one stream per sequence
    kv_size: int = 256               # cells per stream of the base cache (the context of a sequence)
    n_seq_max: int = 1               # sequences the caches serve
    n_ubatch: int = 512              # most tokens of one ubatch: the SWA cache holds one beyond the windows
    n_pad: int = 1                   # both caches' sizes must be multiples of this
    filter: Callable[[int], bool] | None = None  # keep layer il at all? (then the SWA flag picks the cache)
    reuse: Callable[[int], int] | None = None    # layer il shares the tensors of layer reuse(il) (>= 0)


class KVCacheISWA:
    """llama.cpp's ``llama_kv_cache_iswa``: a base cache for the non-SWA layers and an SWA cache for the others."""

    def __init__(self, model: Any, params: KVCacheISWAParams | None = None, **kwargs: Any) -> None:
        if params is None:
            params = KVCacheISWAParams(**kwargs)
        elif kwargs:
            raise TypeError(f"pass either params or keyword arguments, not both: {sorted(kwargs)}")
        p = params
        hp = model.hparams
        if SwaType(hp.swa_type) == SwaType.NONE or not hp.is_swa_any():
            raise ValueError(f"the model has no sliding-window layers (swa_type {SwaType(hp.swa_type).name}, "
                             f"{sum(hp.swa_layers)} SWA layers): use KVCache")
        if p.n_ubatch < 1:
            raise ValueError(f"n_ubatch must be >= 1, got {p.n_ubatch}")
        user_filter = p.filter

        def keep(il: int, swa: bool) -> bool:
            return (user_filter is None or bool(user_filter(il))) and hp.is_swa(il) == swa

        self.model = model
        self.hparams = hp
        self.params = p
        self.unified = bool(p.unified)
        size_swa = swa_cache_size(p.kv_size, hp.n_swa, p.n_seq_max, p.n_ubatch, p.unified, p.swa_full)
        common = dict(type_k=p.type_k, type_v=p.type_v, v_trans=p.v_trans, offload=p.offload, unified=p.unified,
                      n_seq_max=p.n_seq_max, n_pad=p.n_pad, reuse=p.reuse)
        self._base: KVCache | None = KVCache(model, KVCacheParams(
            kv_size=p.kv_size, n_swa=0, swa_type=SwaType.NONE, filter=lambda il: keep(il, False), **common))
        try:
            self._swa: KVCache | None = KVCache(model, KVCacheParams(
                kv_size=size_swa, n_swa=hp.n_swa, swa_type=hp.swa_type, filter=lambda il: keep(il, True), **common))
        except BaseException:
            self._base.close()
            self._base = None
            raise
        # the RPC buffers of both caches (the context's check after a compute); each cache checks its own calls
        self.rpc = G.RpcWatch.of(b.ptr for kv in (self._base, self._swa) for b in kv.buffers())

    # ================================================================== a lost RPC server

    @property
    def lost(self) -> G.RpcServerLostError | None:
        """The error of the first of the two caches found to have lost an RPC server, or None."""
        base, swa = self._check_open()
        return base.lost or swa.lost

    def mark_lost(self, endpoints: tuple[str, ...], what: str) -> G.RpcServerLostError:
        """Both caches lost (the sequences have K/V in both); the first error."""
        base, swa = self._check_open()
        err = base.mark_lost(endpoints, what)
        swa.mark_lost(endpoints, what)
        return err

    def set_fast_paths(self, on: bool) -> None:
        """:meth:`KVCache.set_fast_paths` of both caches."""
        for kv in self._check_open():
            kv.set_fast_paths(on)

    # ================================================================== the two caches

    def get_base(self) -> KVCache:
        """The cache of the non-SWA layers."""
        return self._check_open()[0]

    def get_swa(self) -> KVCache:
        """The cache of the SWA layers."""
        return self._check_open()[1]

    def _check_open(self) -> tuple[KVCache, KVCache]:
        if self._base is None or self._swa is None:
            raise ValueError("the cache is closed")
        return self._base, self._swa

    # ================================================================== memory API

    def clear(self, data: bool = True) -> None:
        base, swa = self._check_open()
        base.clear(data)
        swa.clear(data)

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove positions [p0, p1) of ``seq_id`` (every sequence: -1) from both caches; both results and-ed."""
        base, swa = self._check_open()
        res = base.seq_rm(seq_id, p0, p1)
        return swa.seq_rm(seq_id, p0, p1) and res

    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int = -1, p1: int = -1) -> None:
        base, swa = self._check_open()
        # a cross-stream copy of a partial range is refused by a cache when the range ends inside it: the larger
        # cache refuses whatever the smaller one refuses, so it goes first and a refusal changes nothing
        first, second = (base, swa) if base.get_size() >= swa.get_size() else (swa, base)
        first.seq_cp(seq_id_src, seq_id_dst, p0, p1)
        second.seq_cp(seq_id_src, seq_id_dst, p0, p1)

    def seq_keep(self, seq_id: int) -> None:
        base, swa = self._check_open()
        base.seq_keep(seq_id)
        swa.seq_keep(seq_id)

    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        base, swa = self._check_open()
        base.seq_add(seq_id, p0, p1, shift)
        swa.seq_add(seq_id, p0, p1, shift)

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        base, swa = self._check_open()
        base.seq_div(seq_id, p0, p1, d)
        swa.seq_div(seq_id, p0, p1, d)

    def seq_pos_min(self, seq_id: int) -> int:
        """From the SWA cache: the base cache holds a superset of its positions."""
        return self._check_open()[1].seq_pos_min(seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        return self._check_open()[1].seq_pos_max(seq_id)

    def get_can_shift(self) -> bool:
        """Only when both caches can and have the same size (``swa_full``): a small SWA cache has lost the old
        positions a context shift would move into the window."""
        base, swa = self._check_open()
        return base.get_can_shift() and swa.get_can_shift() and base.get_size() == swa.get_size()

    def get_size(self) -> int:
        """Cells per stream of the base cache (the context of a sequence)."""
        return self._check_open()[0].get_size()

    def get_n_stream(self) -> int:
        return self._check_open()[0].get_n_stream()

    def get_used(self, stream: int = -1) -> int:
        """Used cells of the base cache (the one that bounds a sequence's context; the SWA cache reuses the cells
        its window left behind)."""
        return self._check_open()[0].get_used(stream)

    @property
    def n_stream(self) -> int:
        return self.get_n_stream()

    @property
    def n_seq_max(self) -> int:
        return self._check_open()[0].n_seq_max

    @property
    def n_swa(self) -> int:
        """The sliding window of the SWA layers."""
        return self._check_open()[1].n_swa

    def memory_breakdown(self) -> dict[str, int]:
        """Buffer-type name -> bytes of both caches together."""
        base, swa = self._check_open()
        res = dict(base.memory_breakdown())
        for name, n in swa.memory_breakdown().items():
            res[name] = res.get(name, 0) + n
        return res

    def total_size(self) -> int:
        base, swa = self._check_open()
        return base.total_size() + swa.total_size()

    def shift_graph_size(self) -> int:
        """Nodes the larger of the two K-shift graphs needs (each cache shifts in its own graph)."""
        base, swa = self._check_open()
        return max(base.shift_graph_size(), swa.shift_graph_size())

    # ================================================================== preparation API

    def init_batch(self, balloc: Any, n_ubatch: int, embd_all: bool = False) -> "KVCacheISWAContext":
        """Split the batch once and find slots for the same ubatches in both caches (cells unchanged).

        A unified cache first tries the simple split, then, if either cache has no room for it, the equal split;
        separate streams need the equal split.  FAILED_PREPARE when neither fits both caches.
        """
        del embd_all
        base, swa = self._check_open()
        splits = ((True, False), (False, not self.unified)) if self.unified else ((False, True),)
        for simple, sequential in splits:
            ubatches = _split_all(balloc, n_ubatch, simple, sequential)
            if ubatches is None:
                continue
            sinfos_base = base.prepare(ubatches)
            if not sinfos_base:
                continue
            sinfos_swa = swa.prepare(ubatches)
            if not sinfos_swa:
                continue
            assert len(sinfos_base) == len(sinfos_swa)
            return KVCacheISWAContext.batch(self, sinfos_base, sinfos_swa, ubatches)
        return KVCacheISWAContext(MemoryStatus.FAILED_PREPARE)

    def init_full(self) -> "KVCacheISWAContext":
        """A context over both whole caches, to reserve graphs."""
        base, swa = self._check_open()
        return KVCacheISWAContext(None, base.init_full(), swa.init_full())

    def init_update(self, lctx: Any = None, optimize: bool = False) -> "KVCacheISWAContext":
        """Each cache's update (queued stream copies, pending K-shift), applied together."""
        base, swa = self._check_open()
        return KVCacheISWAContext(None, base.init_update(lctx, optimize), swa.init_update(lctx, optimize))

    def has_pending_update(self) -> bool:
        """True when :meth:`init_update` would have something to do in either cache."""
        base, swa = self._check_open()
        return base.has_pending_update() or swa.has_pending_update()

    # ================================================================== state

    def state_write(self, io: StateWriter, seq_id: int = -1, flags: int = 0) -> int:
        """The base cache's state (unless ``flags`` has PARTIAL_ONLY), then the SWA cache's; bytes written."""
        base, swa = self._check_open()
        n = 0 if flags & STATE_SEQ_FLAGS_PARTIAL_ONLY else base.state_write(io, seq_id, flags)
        return n + swa.state_write(io, seq_id, flags)

    def state_read(self, io: StateReader, seq_id: int = -1, flags: int = 0) -> int:
        """Restore what :meth:`state_write` wrote with the same ``flags``; bytes read.

        ``ValueError`` on any problem, with both caches as after a failed restore (module docstring).
        """
        base, swa = self._check_open()
        self.check_seq_state(seq_id, allow_all=True)
        start = io.tell()
        try:
            if not flags & STATE_SEQ_FLAGS_PARTIAL_ONLY:
                base.state_read(io, seq_id, flags)
            swa.state_read(io, seq_id, flags)
        except BaseException:
            self._failed_restore(seq_id)
            raise
        return io.tell() - start

    def state_check(self, io: StateReader, seq_id: int = -1, flags: int = 0) -> int:
        """What :meth:`state_read` checks, changing nothing (the base cache's part, then the SWA cache's); the
        cells of the base cache's part (the SWA cache's, with PARTIAL_ONLY)."""
        base, swa = self._check_open()
        self.check_seq_state(seq_id, allow_all=True)
        n = -1 if flags & STATE_SEQ_FLAGS_PARTIAL_ONLY else base.state_check(io, seq_id)
        n_swa = swa.state_check(io, seq_id)
        return n_swa if n < 0 else n

    def state_size(self, seq_id: int = -1, flags: int = 0) -> int:
        io = CountingWriter()
        self.state_write(io, seq_id, flags)
        return io.n_bytes()

    def state_save(self, seq_id: int = -1, flags: int = 0) -> bytes:
        """The state as ``bytes`` (the base cache's part, unless PARTIAL_ONLY, then the SWA cache's)."""
        base, swa = self._check_open()
        head = b"" if flags & STATE_SEQ_FLAGS_PARTIAL_ONLY else base.state_save(seq_id)
        return head + swa.state_save(seq_id)

    def state_load(self, data: Any, seq_id: int = -1, flags: int = 0) -> int:
        """Restore from a bytes-like object holding exactly one such state; returns its length."""
        io = BytesReader(data)
        n = self.state_read(io, seq_id, flags)
        extra = io.remaining()
        if extra:
            self._failed_restore(seq_id)
            raise ValueError(f"state is {n} bytes followed by {extra} trailing bytes, expected none")
        return n

    def _failed_restore(self, seq_id: int) -> None:
        base, swa = self._check_open()
        for kv in (base, swa):
            if seq_id == -1:
                kv.clear(True)
            else:
                kv.seq_rm(seq_id, -1, -1)

    def check_seq_state(self, seq_id: int, allow_all: bool = False, data: bool = True) -> None:
        """:meth:`KVCache.check_seq_state <kvcache_ggml.cache.KVCache.check_seq_state>` of both caches (what the
        state files check before they touch the file or the caches)."""
        for kv in self._check_open():
            kv.check_seq_state(seq_id, allow_all, data)

    # ================================================================== ownership

    def close(self) -> None:
        """Free both caches (idempotent)."""
        for kv in (self._base, self._swa):
            if kv is not None:
                kv.close()
        self._base = self._swa = None

    @property
    def closed(self) -> bool:
        return self._base is None

    def __enter__(self) -> "KVCacheISWA":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return "<KVCacheISWA closed>"
        return (f"<KVCacheISWA base {self._base.get_size()} cells x {len(self._base.layers)} layers, SWA "
                f"{self._swa.get_size()} cells x {len(self._swa.layers)} layers (n_swa {self.n_swa}), "
                f"{self.get_n_stream()} stream(s)>")


def _split_all(balloc: Any, n_ubatch: int, simple: bool, sequential: bool) -> list[Any] | None:
    """Every ubatch of the batch by one split strategy, or None when the split cannot use every token."""
    balloc.split_reset()
    ubatches = []
    n_tokens = balloc.get_n_tokens()
    while balloc.get_n_used() < n_tokens:
        ub = balloc.split_simple(n_ubatch) if simple else balloc.split_equal(n_ubatch, sequential)
        if ub.n_tokens == 0:
            break
        ubatches.append(ub)
    return ubatches if balloc.get_n_used() == n_tokens else None


class KVCacheISWAContext:
    """llama.cpp's ``llama_kv_cache_iswa_context``: the same ubatches over a base and an SWA cache context."""

    def __init__(self, status: MemoryStatus | None, ctx_base: KVCacheContext | None = None,
                 ctx_swa: KVCacheContext | None = None, ubatches: Sequence[Any] = ()) -> None:
        self.ctx_base = ctx_base                  # the base cache's context (None for an error context)
        self.ctx_swa = ctx_swa                    # the SWA cache's context
        self.ubatches = list(ubatches)            # the ubatches of the batch (both contexts hold the same)
        self.i_next = 0                           # the current ubatch
        if status is None:
            assert ctx_base is not None and ctx_swa is not None
            status = combine_status(ctx_base.get_status(), ctx_swa.get_status())
        self.status = status                      # outcome of the init_* call
        self._is_swa = None
        if ctx_base is not None:
            hp = ctx_base.kv.hparams
            self._is_swa = [hp.is_swa(il) for il in range(hp.n_layer)]  # layer -> True: the SWA cache

    @classmethod
    def batch(cls, kv: KVCacheISWA, sinfos_base: list[SlotInfo], sinfos_swa: list[SlotInfo],
              ubatches: list[Any]) -> "KVCacheISWAContext":
        return cls(None, KVCacheContext(kv.get_base(), sinfos=sinfos_base, ubatches=ubatches),
                   KVCacheContext(kv.get_swa(), sinfos=sinfos_swa, ubatches=ubatches), ubatches)

    # ------------------------------------------------------------------ iteration

    def next(self) -> bool:
        assert self.status == MemoryStatus.SUCCESS
        self.ctx_base.next()
        self.ctx_swa.next()
        self.i_next += 1
        return self.i_next < len(self.ubatches)

    def apply(self) -> bool:
        if self.status.is_fail():
            raise RuntimeError(f"apply() on a failed memory context ({self.status.name})")
        res = self.ctx_base.apply()
        return self.ctx_swa.apply() and res

    def get_status(self) -> MemoryStatus:
        return self.status

    def get_ubatch(self) -> Any:
        assert self.status == MemoryStatus.SUCCESS
        return self.ubatches[self.i_next]

    def get_base(self) -> KVCacheContext:
        """The base cache's context: inputs and views of the non-SWA layers."""
        assert self.status == MemoryStatus.SUCCESS
        return self.ctx_base

    def get_swa(self) -> KVCacheContext:
        """The SWA cache's context: inputs and views of the SWA layers."""
        assert self.status == MemoryStatus.SUCCESS
        return self.ctx_swa

    # ------------------------------------------------------------------ graph_build API, per layer

    def layer_ctx(self, il: int) -> KVCacheContext:
        """The context of the cache holding layer ``il``."""
        return self.ctx_swa if self._is_swa[il] else self.ctx_base

    def is_swa(self, il: int) -> bool:
        return self._is_swa[il]

    def get_k(self, ctx: Any, il: int) -> Any:
        return self.layer_ctx(il).get_k(ctx, il)

    def get_v(self, ctx: Any, il: int) -> Any:
        return self.layer_ctx(il).get_v(ctx, il)

    def cpy_k(self, ctx: Any, k_cur: Any, k_idxs: Any, il: int) -> Any:
        """Store k_cur through ``k_idxs``, which must be the index input of layer il's cache."""
        return self.layer_ctx(il).cpy_k(ctx, k_cur, k_idxs, il)

    def cpy_v(self, ctx: Any, v_cur: Any, v_idxs: Any, il: int) -> Any:
        return self.layer_ctx(il).cpy_v(ctx, v_cur, v_idxs, il)
