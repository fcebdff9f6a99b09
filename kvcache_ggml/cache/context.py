"""llama.cpp's ``llama_kv_cache_context``: the ubatches of one batch and their slots, or an update.

A context is what ``init_batch``/``init_full``/``init_update`` return: the model's graph code iterates its
ubatches (``apply``/``next``), asks it for the K/V views and stores of the current ubatch and fills the inputs
through it.  The numpy conveniences (``kq_mask``, ``k_idxs``, ``v_idxs``, ``k_shift``) give the inputs of the
current ubatch in tensors of their own, for tests and notebooks.

A context works on its cache through :class:`ContextCache`, the part of it that it reads and calls
(:class:`~kvcache_ggml.cache.KVCache`, which makes the contexts, implements it).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .. import ggml as G
from ..batch import UBatch
from .inputs import host_tensor
from .types import MemoryStatus, SlotInfo, StreamCopyInfo

if TYPE_CHECKING:
    from ..hparams import HParams
    from .bookkeeping import KVBookkeeping
    from .inputs import KVInputs
    from .shift import UpdateContext
    from .tensors import KVTensors

__all__ = ["ContextCache", "KVCacheContext"]

_NO_COPIES = StreamCopyInfo((), ())  # the stream copies of a batch or full context: none (shared, read-only)


class ContextCache(Protocol):
    """What a context reads and calls of its cache (:class:`~kvcache_ggml.cache.KVCache`)."""

    book: KVBookkeeping    # cells, heads, slots: apply_ubatch, get_n_kv, the stream copies
    tensors: KVTensors     # the K/V views and stores of the graph_build API
    inputs: KVInputs       # the set_input_* of the input API
    hparams: HParams

    @property
    def v_trans(self) -> bool: ...

    def get_size(self) -> int: ...

    def get_n_stream(self) -> int: ...

    def update(self, lctx: UpdateContext | None, do_shift: bool, sc_info: StreamCopyInfo) -> bool: ...


class KVCacheContext:
    """The ubatches of one batch and their slots (or an update's stream copies and K-shift) over a cache."""

    __slots__ = ("status", "kv", "sinfos", "ubatches", "i_cur", "n_kv", "lctx", "do_shift", "sc_info")  # (one a step)

    def __init__(self, kv: ContextCache | None, *, status: MemoryStatus = MemoryStatus.SUCCESS,
                 sinfos: list[SlotInfo] | None = None, ubatches: list[UBatch] | None = None) -> None:
        self.status = status                       # outcome of the init_* call
        self.kv = kv                               # the cache this context works on
        self.sinfos = sinfos or []                 # slot of each ubatch
        self.ubatches = ubatches or []             # the ubatches of the batch
        self.i_cur = 0                             # current ubatch
        self.n_kv = 0                              # cells the current ubatch attends to (after apply())
        self.lctx: UpdateContext | None = None     # update: what the K-shift graph runs on
        self.do_shift = False                      # update: apply the pending K-shift
        self.sc_info = _NO_COPIES                  # update: stream copies to perform (update_ctx sets them)

    @classmethod
    def full(cls, kv: ContextCache) -> KVCacheContext:
        """A context over the whole cache (every stream, n_kv = kv_size), to reserve graphs."""
        ctx = cls(kv)
        ctx.n_kv = kv.get_size()
        ns = kv.get_n_stream()
        ctx.sinfos = [SlotInfo(s0=0, s1=ns - 1, strm=list(range(ns)),
                               idxs=[np.zeros(1, np.int64) for _ in range(ns)])]
        return ctx

    @classmethod
    def update_ctx(cls, kv: ContextCache, lctx: UpdateContext | None, do_shift: bool,
                   sc_info: StreamCopyInfo) -> KVCacheContext:
        """An update: the stream copies and the K-shift, or NO_UPDATE when there is nothing to do."""
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
        if self.status is not MemoryStatus.SUCCESS and self.status.is_fail():
            raise RuntimeError(f"apply() on a failed memory context ({self.status.name})")
        kv = self.kv
        if not self.ubatches:
            try:
                kv.update(self.lctx, self.do_shift, self.sc_info)
            except Exception:
                kv.book.requeue_stream_copies(self.sc_info)  # a later update makes them
                raise
            return True
        sinfo = self.sinfos[self.i_cur]
        kv.book.apply_ubatch(sinfo, self.ubatches[self.i_cur])
        self.n_kv = kv.book.get_n_kv(sinfo)
        return True

    def get_status(self) -> MemoryStatus:
        return self.status

    def get_ubatch(self) -> UBatch:
        assert self.status == MemoryStatus.SUCCESS
        return self.ubatches[self.i_cur]

    def get_n_kv(self) -> int:
        return self.n_kv

    def get_sinfo(self) -> SlotInfo:
        return self.sinfos[self.i_cur]

    # ------------------------------------------------------------------ graph_build API

    def get_k(self, ctx: Any, il: int) -> Any:
        return self.kv.tensors.get_k(ctx, il, self.n_kv, self.sinfos[self.i_cur])

    def get_v(self, ctx: Any, il: int) -> Any:
        return self.kv.tensors.get_v(ctx, il, self.n_kv, self.sinfos[self.i_cur])

    def cpy_k(self, ctx: Any, k_cur: Any, k_idxs: Any, il: int) -> Any:
        return self.kv.tensors.cpy_k(ctx, k_cur, k_idxs, il, self.sinfos[self.i_cur])

    def cpy_v(self, ctx: Any, v_cur: Any, v_idxs: Any, il: int) -> Any:
        return self.kv.tensors.cpy_v(ctx, v_cur, v_idxs, il, self.sinfos[self.i_cur])

    def build_input_k_idxs(self, ctx: Any, ubatch: UBatch) -> Any:
        return self.kv.tensors.build_input_k_idxs(ctx, ubatch)

    def build_input_v_idxs(self, ctx: Any, ubatch: UBatch) -> Any:
        return self.kv.tensors.build_input_v_idxs(ctx, ubatch)

    # ------------------------------------------------------------------ input API

    def set_input_k_shift(self, dst: Any) -> None:
        self.kv.inputs.set_input_k_shift(dst)

    def set_input_k_idxs(self, dst: Any, ubatch: UBatch) -> None:
        self.kv.inputs.set_input_k_idxs(dst, ubatch, self.sinfos[self.i_cur])

    def set_input_v_idxs(self, dst: Any, ubatch: UBatch) -> None:
        self.kv.inputs.set_input_v_idxs(dst, ubatch, self.sinfos[self.i_cur])

    def set_input_kq_mask(self, dst: Any, ubatch: UBatch, causal_attn: bool = True) -> None:
        self.kv.inputs.set_input_kq_mask(dst, ubatch, causal_attn)

    def set_input_pos_bucket(self, dst: Any, ubatch: UBatch) -> None:
        self.kv.inputs.set_input_pos_bucket(dst, ubatch)

    def input_views(self, k_idxs: Any, v_idxs: Any, kq_mask: Any, n_tokens: int) -> tuple[Any, Any, Any]:
        """The data of a graph's k_idxs, v_idxs and kq mask inputs for ubatches of ``n_tokens``, checked as
        set_input_* checks them: a runtime that computes the same graph again (its tensors keep their memory)
        fills them every step with :meth:`fill_inputs`, without reading the tensors again."""
        inputs = self.kv.inputs
        return (inputs.k_idxs_view(k_idxs, n_tokens), inputs.v_idxs_view(v_idxs, n_tokens),
                inputs.kq_mask_view(kq_mask, n_tokens))

    def fill_inputs(self, views: tuple[Any, Any, Any], ubatch: UBatch, causal_attn: bool = True) -> None:
        """set_input_k_idxs, set_input_v_idxs and set_input_kq_mask of the current ubatch into :meth:`input_views`
        of its graph's tensors."""
        inputs, sinfo = self.kv.inputs, self.sinfos[self.i_cur]
        inputs.fill_k_idxs(views[0], ubatch, sinfo)
        if inputs.v_trans:
            inputs.fill_v_idxs(views[1], ubatch, sinfo)
        else:  # V rows are the K rows (the same cells, the same stream stride)
            views[1][...] = views[0]
        inputs.fill_kq_mask(views[2], ubatch, causal_attn)

    # ------------------------------------------------------------------ numpy conveniences

    def kq_mask(self, causal: bool = True, type_: str | int = "f32") -> np.ndarray:
        """float [n_stream, n_tokens_per_stream, n_kv]: set_input_kq_mask of the current ubatch (after apply())."""
        ub, sinfo = self._applied_ubatch("kq_mask")
        ns = sinfo.n_stream()
        with host_tensor(G.parse_type(type_), (self.get_n_kv(), ub.n_tokens // ns, 1, ns), "kq_mask") as t:
            self.kv.inputs.set_input_kq_mask(t, ub, causal)
            return G.to_numpy(t, copy=True, ndim=4)[:, 0]

    def k_idxs(self) -> np.ndarray:
        """int64 [n_tokens]: set_input_k_idxs of the current ubatch."""
        ub, sinfo = self._applied_ubatch("k_idxs")
        with host_tensor(G.GGMLType.I64, (ub.n_tokens,), "k_idxs") as t:
            self.kv.inputs.set_input_k_idxs(t, ub, sinfo)
            return G.to_numpy(t, copy=True)

    def v_idxs(self) -> np.ndarray:
        """int64 [n_tokens] or, V transposed, [n_tokens*n_embd_v_gqa_max]: set_input_v_idxs of the ubatch."""
        ub, sinfo = self._applied_ubatch("v_idxs")
        n = ub.n_tokens * (self.kv.hparams.n_embd_v_gqa_max() if self.kv.v_trans else 1)
        with host_tensor(G.GGMLType.I64, (n,), "v_idxs") as t:
            self.kv.inputs.set_input_v_idxs(t, ub, sinfo)
            return G.to_numpy(t, copy=True)

    def k_shift(self) -> np.ndarray:
        """int32 [n_stream*kv_size]: set_input_k_shift of the cache."""
        return self.kv.inputs.k_shift()

    def _applied_ubatch(self, what: str) -> tuple[UBatch, SlotInfo]:
        if not self.ubatches:
            raise RuntimeError(f"{what}(): this memory context has no ubatch ({self.status.name}, update or "
                               "full context)")
        if self.i_cur >= len(self.ubatches):
            raise RuntimeError(f"{what}(): the context is past its last ubatch (next() returned False)")
        if self.get_n_kv() == 0:
            raise RuntimeError(f"{what}(): call apply() first (n_kv is 0 until the ubatch is placed)")
        return self.get_ubatch(), self.get_sinfo()
