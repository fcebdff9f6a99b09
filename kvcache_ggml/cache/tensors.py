"""The cache's tensor store: K and V per kept layer, one ggml context and one backend buffer per buffer type.

:class:`KVTensors` is the one owner of the cache's native handles.  As the seed's constructor: contexts are created
per buffer type and allocated in buffer-type-name order; each kept layer has ``cache_k_l{il}``
``[n_embd_k_gqa, kv_size, n_stream]`` and ``cache_v_l{il}`` ``[n_embd_v_gqa (the maximum over layers when V is
transposed), kv_size, n_stream]`` plus one 2-D view per stream.  The views and stores a model graph uses
(``get_k``/``get_v``/``cpy_k``/``cpy_v``) and whole-stream copies work on these tensors; the K-shift graph is in
:mod:`.shift`.

Every graph method builds ggml ops in a caller's context, the same ops with the same shapes, strides and offsets as
the seed.  Shapes are written in ggml ``ne`` order (fastest dimension first).  Checks that ggml would turn into a
process abort (GGML_ASSERT) run first and raise ``ValueError`` naming the values.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any


from .. import ggml as G
from ..batch import UBatch
from ..hparams import HParams
from .types import KVCacheParams, ModelLike, SlotInfo, StreamCopyInfo

__all__ = ["KVTensors", "KVLayer"]

log = logging.getLogger("kvcache_ggml.cache")

_MiB = 1024.0 * 1024.0
_I32, _I64, _F32 = G.GGMLType.I32, G.GGMLType.I64, G.GGMLType.F32


@dataclass(slots=True)
class KVLayer:
    """The tensors of one kept layer (llama.cpp's ``kv_layer``)."""

    il: int                     # model layer index
    k: Any                      # tensor [n_embd_k_gqa, kv_size, n_stream]
    v: Any                      # tensor [n_embd_v_gqa, kv_size, n_stream]
    k_stream: list[Any]         # per stream, view [n_embd_k_gqa, kv_size]
    v_stream: list[Any]         # per stream, view [n_embd_v_gqa, kv_size]


@dataclass(slots=True)
class _CtxBuf:
    """One buffer type's ggml context (tensor metadata) and backend buffer (tensor data)."""

    buft: int                   # ggml_backend_buffer_type_t
    buft_name: str              # its name, the sort key
    ctx: G.Context              # holds the K/V tensors and their stream views
    buf: G.BackendBuffer | None  # the data (a dummy buffer of size 0 when hparams.no_alloc)


def _dev_ptr(dev: Any) -> int:
    """A ggml_backend_dev_t from what ``model.dev_layer`` returns: a raw handle or an object with ``.ptr``."""
    return G.handle(dev, "a ggml device from model.dev_layer()")


class KVTensors:
    """K/V tensors of the kept layers and the buffers holding them (the seed constructor's second half)."""

    def __init__(self, model: ModelLike, params: KVCacheParams) -> None:
        self.model = model                            # what dev_layer() places each layer on (with offload)
        self.hparams: HParams = model.hparams         # layer shapes
        self.kv_size = int(params.kv_size)            # cells per stream
        self.n_stream = params.n_stream               # streams (the tensors' ne[2])
        self.v_trans = bool(params.v_trans)           # V stored transposed
        self.type_k = G.parse_type(params.type_k)     # ggml type of K
        self.type_v = G.parse_type(params.type_v)     # ggml type of V
        self.layers: list[KVLayer] = []               # kept layers, in model order
        self.map_layer_ids: dict[int, int] = {}       # model layer -> index in layers (reused layers too)
        self._ctxs_bufs: list[_CtxBuf] = []           # per buffer type, in name order: the native handles
        self._allocate(params)

    # ------------------------------------------------------------------ allocation

    def _allocate(self, p: KVCacheParams) -> None:
        """Plan every layer (all checks before any native allocation), then create and allocate the tensors."""
        plan = self._plan_layers(p)
        reuse_map = self._plan_reuse(p, {il for il, *_ in plan})
        ctx_of: dict[int, _CtxBuf] = {}
        try:
            self._create_tensors(plan, ctx_of)
            for il, il_reuse in reuse_map.items():
                log.debug("- layer %3d: reuse layer %d, is_swa = %d", il, il_reuse, self.hparams.is_swa(il))
                self.map_layer_ids[il] = self.map_layer_ids[il_reuse]
            for cb in sorted(ctx_of.values(), key=lambda c: c.buft_name):
                self._allocate_buffer(cb)
                self._ctxs_bufs.append(cb)
        except BaseException:
            for cb in ctx_of.values():
                if cb.buf is not None:
                    cb.buf.close()
                cb.ctx.close()
            self._ctxs_bufs = []
            self.layers, self.map_layer_ids = [], {}
            raise
        mk, mv = self.size_k_bytes(), self.size_v_bytes()
        log.info("size = %7.2f MiB (%6u cells, %3d layers, %2u/%u seqs), K (%s): %7.2f MiB, V (%s): %7.2f MiB",
                 (mk + mv) / _MiB, self.kv_size, len(self.layers), p.n_seq_max, self.n_stream,
                 G.type_name(self.type_k), mk / _MiB, G.type_name(self.type_v), mv / _MiB)

    def _plan_layers(self, p: KVCacheParams) -> list[tuple[int, int, int, int]]:
        """(il, buffer type, n_embd_k_gqa, n_embd_v_gqa) of every kept layer, placed by ``dev_layer``."""
        hp = self.hparams
        plan: list[tuple[int, int, int, int]] = []
        if self.v_trans and hp.is_n_embd_v_gqa_variable():
            log.warning("the V embeddings have different sizes across layers and FA is not enabled - "
                        "padding V cache to %d", hp.n_embd_v_gqa_max())
        for il in range(hp.n_layer):
            if not hp.has_kv(il):
                log.debug("layer %3d: does not have KV cache", il)
                continue
            if p.filter is not None and not p.filter(il):
                log.debug("layer %3d: filtered", il)
                continue
            buft, dev_name = G.cpu_buffer_type(), "CPU"
            if p.offload:
                dev = _dev_ptr(self.model.dev_layer(il))
                buft = G.ggml_backend_dev_buffer_type(dev)
                dev_name = G.ggml_backend_dev_name(dev).decode()
            log.debug("layer %3d: dev = %s", il, dev_name)
            n_embd_v = hp.n_embd_v_gqa_max() if self.v_trans else hp.n_embd_v_gqa(il)
            plan.append((il, buft, hp.n_embd_k_gqa(il), n_embd_v))
        return plan

    def _plan_reuse(self, p: KVCacheParams, kept: set[int]) -> dict[int, int]:
        """Layer -> the kept layer whose tensors it shares; ValueError when that layer is not kept."""
        reuse_map: dict[int, int] = {}
        if p.reuse is None:
            return reuse_map
        for il in range(self.hparams.n_layer):
            il_reuse = p.reuse(il)
            if il_reuse < 0:
                continue
            if p.filter is not None and not p.filter(il):
                continue
            if il_reuse not in kept:
                raise ValueError(f"layer {il} reuses layer {il_reuse}, which has no tensors in this cache "
                                 f"(kept layers: {sorted(kept)})")
            reuse_map[il] = il_reuse
        return reuse_map

    def _create_tensors(self, plan: list[tuple[int, int, int, int]], ctx_of: dict[int, _CtxBuf]) -> None:
        """K, V and their per-stream views of every planned layer, in one context per buffer type."""
        kv_size, ns = self.kv_size, self.n_stream
        mem = 2 * (1 + ns) * self.hparams.n_layer_kv() * G.ggml_tensor_overhead()
        for il, buft, n_embd_k, n_embd_v in plan:
            cb = ctx_of.get(buft)
            if cb is None:
                cb = ctx_of[buft] = _CtxBuf(buft, G.buft_name(buft), G.Context(mem, no_alloc=True), None)
            k = G.new_tensor(cb.ctx.ptr, self.type_k, (n_embd_k, kv_size, ns), f"cache_k_l{il}")
            v = G.new_tensor(cb.ctx.ptr, self.type_v, (n_embd_v, kv_size, ns), f"cache_v_l{il}")
            knb, vnb = G.nb(k), G.nb(v)
            k_stream = [G.ggml_view_2d(cb.ctx.ptr, k, n_embd_k, kv_size, knb[1], s * knb[2]) for s in range(ns)]
            v_stream = [G.ggml_view_2d(cb.ctx.ptr, v, n_embd_v, kv_size, vnb[1], s * vnb[2]) for s in range(ns)]
            self.map_layer_ids[il] = len(self.layers)
            self.layers.append(KVLayer(il, k, v, k_stream, v_stream))

    def _allocate_buffer(self, cb: _CtxBuf) -> None:
        """The backend buffer of one context, zeroed (a dummy one of size 0 with ``hparams.no_alloc``)."""
        if self.hparams.no_alloc:
            # a dummy buffer so that a scheduler does not try to allocate the cache
            cb.buf = G.BackendBuffer(G.ggml_backend_buft_alloc_buffer(cb.buft, 0))
            for t in cb.ctx.tensors():
                G.set_buffer(t, cb.buf.ptr)
        else:
            ptr = G.ggml_backend_alloc_ctx_tensors_from_buft(cb.ctx.ptr, cb.buft)
            if not ptr:
                raise MemoryError(f"failed to allocate buffer for kv cache on {cb.buft_name}")
            cb.buf = G.BackendBuffer(ptr)
        log.info("%10s KV buffer size = %8.2f MiB", cb.buf.name, cb.buf.size / _MiB)
        cb.buf.clear(0)

    # ------------------------------------------------------------------ sizes

    def total_size(self) -> int:
        """Bytes of every backend buffer of the cache."""
        return sum(cb.buf.size for cb in self._ctxs_bufs)

    def size_k_bytes(self) -> int:
        return sum(G.nbytes(layer.k) for layer in self.layers)

    def size_v_bytes(self) -> int:
        return sum(G.nbytes(layer.v) for layer in self.layers)

    def memory_breakdown(self) -> dict[str, int]:
        """Buffer-type name -> bytes (with ``no_alloc``, the bytes the tensors would take)."""
        res: dict[str, int] = {}
        for cb in self._ctxs_bufs:
            if self.hparams.no_alloc:
                n = G.ggml_backend_alloc_ctx_tensors_from_buft_size(cb.ctx.ptr, cb.buft)
            else:
                n = cb.buf.size
            res[cb.buft_name] = res.get(cb.buft_name, 0) + n
        return res

    def buffers(self) -> list[G.BackendBuffer]:
        """The backend buffers, one per buffer type, in buffer-type-name order."""
        return [cb.buf for cb in self._ctxs_bufs]

    def clear_data(self) -> None:
        """Zero every buffer (``clear(data=true)``)."""
        for cb in self._ctxs_bufs:
            cb.buf.clear(0)

    # ------------------------------------------------------------------ views of the cache

    def get_k(self, ctx: Any, il: int, n_kv: int, sinfo: SlotInfo) -> Any:
        """K of layer il for the streams s0..s1 of the slot: view [n_embd_head_k, n_head_kv, n_kv, ns]."""
        k = self.layer(il).k                          # [n_embd_k_gqa, kv_size, n_stream]
        hp, tk = self.hparams, G.ttype(k)
        kv_size, n_embd_k_gqa = self.kv_size, hp.n_embd_k_gqa(il)
        ns = self._n_stream_of(sinfo, n_kv)
        stream = G.row_size(tk, n_embd_k_gqa * kv_size)
        return G.ggml_view_4d(_ctx_ptr(ctx), k, hp.n_embd_head_k, hp.n_head_kv(il), n_kv, ns,
                              G.row_size(tk, hp.n_embd_head_k), G.row_size(tk, n_embd_k_gqa), stream,
                              stream * sinfo.s0)

    def get_v(self, ctx: Any, il: int, n_kv: int, sinfo: SlotInfo) -> Any:
        """V of layer il for the slot's streams.

        Not transposed: view [n_embd_head_v, n_head_kv, n_kv, ns].  Transposed: view [n_kv, n_head_kv,
        n_embd_head_v, ns] over the cache's [kv_size, n_embd_v_gqa] planes (nb1 > nb2).
        """
        v = self.layer(il).v                          # [n_embd_v_gqa(_max when transposed), kv_size, n_stream]
        hp, tv = self.hparams, G.ttype(v)
        kv_size, n_embd_v_gqa = self.kv_size, G.ne(v)[0]
        assert n_embd_v_gqa >= hp.n_embd_v_gqa(il)  # [TAG_V_CACHE_VARIABLE] transposed: the widest layer's
        ns = self._n_stream_of(sinfo, n_kv)
        stream = G.row_size(tv, n_embd_v_gqa * kv_size)
        if not self.v_trans:
            return G.ggml_view_4d(_ctx_ptr(ctx), v, hp.n_embd_head_v, hp.n_head_kv(il), n_kv, ns,
                                  G.row_size(tv, hp.n_embd_head_v), G.row_size(tv, n_embd_v_gqa), stream,
                                  stream * sinfo.s0)
        return G.ggml_view_4d(_ctx_ptr(ctx), v, n_kv, hp.n_head_kv(il), hp.n_embd_head_v, ns,
                              G.row_size(tv, kv_size * hp.n_embd_head_v), G.row_size(tv, kv_size), stream,
                              stream * sinfo.s0)

    # ------------------------------------------------------------------ stores into the cache

    def cpy_k(self, ctx: Any, k_cur: Any, k_idxs: Any, il: int, sinfo: SlotInfo | None = None) -> Any:
        """Store k_cur F32 [n_embd_head, n_head, n_tokens] into rows k_idxs I64 [n_tokens] of layer il's K.

        The indices are global over the streams (stream * kv_size + cell).  Returns the set_rows node, a view
        [n_embd_k_gqa, kv_size(*n_stream)] of the cache.
        """
        del sinfo  # the indices carry the slot
        c = _ctx_ptr(ctx)
        k = self.layer(il).k                          # [n_embd_k_gqa, kv_size, n_stream]
        ne_cur, nb_cur = G.ne(k_cur), G.nb(k_cur)
        n_embd_head, n_head, n_tokens, _ = ne_cur
        n_embd_gqa = n_embd_head * n_head
        _check_rows_source("k_cur", k_cur, ne_cur, nb_cur, self.hparams.n_embd_k_gqa(il), il)
        _check_idxs("k_idxs", k_idxs, n_tokens)
        k_cur = G.ggml_view_2d(c, k_cur, n_embd_gqa, n_tokens, nb_cur[2], 0)  # [n_embd_gqa, n_tokens]
        if self.n_stream > 1:
            # the indices are global: one row space over every stream
            k = G.ggml_reshape_2d(c, k, n_embd_gqa, self.kv_size * self.n_stream)  # [n_embd_gqa, kv_size*n_s]
        return G.ggml_set_rows(c, k, k_cur, k_idxs)

    def cpy_v(self, ctx: Any, v_cur: Any, v_idxs: Any, il: int, sinfo: SlotInfo | None = None) -> Any:
        """Store v_cur F32 [n_embd_head, n_head, n_tokens] into layer il's V at v_idxs.

        Not transposed: one row per token, v_idxs I64 [n_tokens].  Transposed: one single-element row per value,
        v_idxs I64 [n_tokens*n_embd_v_gqa_max], the values padded to the cache width [TAG_V_CACHE_VARIABLE].
        """
        del sinfo
        c = _ctx_ptr(ctx)
        hp = self.hparams
        v = self.layer(il).v                          # [n_embd_v_gqa(_max), kv_size, n_stream]
        ne_cur, nb_cur = G.ne(v_cur), G.nb(v_cur)
        n_embd_head, n_head, n_tokens, _ = ne_cur
        n_embd_gqa = n_embd_head * n_head
        if not self.v_trans:
            _check_rows_source("v_cur", v_cur, ne_cur, nb_cur, hp.n_embd_v_gqa(il), il)
            _check_idxs("v_idxs", v_idxs, n_tokens)
            v_cur = G.ggml_view_2d(c, v_cur, n_embd_gqa, n_tokens, nb_cur[2], 0)  # [n_embd_gqa, n_tokens]
            if self.n_stream > 1:
                v = G.ggml_reshape_2d(c, v, n_embd_gqa, self.kv_size * self.n_stream)  # [n_embd_gqa, kv*n_s]
            return G.ggml_set_rows(c, v, v_cur, v_idxs)

        if G.blck_size(self.type_v) != 1:  # (ggml_row_size asserts in the seed's reshape below: one value, no block)
            raise ValueError(f"a transposed V cache of block type {G.type_name(self.type_v)} cannot be written: its "
                             f"values go one at a time (llama.cpp: V cache quantization requires flash_attn)")
        width = G.ne(v)[0]                             # n_embd_v_gqa_max [TAG_V_CACHE_VARIABLE]
        _check_rows_source("v_cur", v_cur, ne_cur, nb_cur, width, il, padded=True)
        _check_idxs("v_idxs", v_idxs, n_tokens * width)
        if nb_cur[0] * n_embd_gqa == nb_cur[2]:        # F32: row_size(n_embd_gqa) == nb2, dims 0..2 merge
            v_cur = G.ggml_reshape_2d(c, v_cur, n_embd_gqa, n_tokens)  # [n_embd_gqa, n_tokens]
        else:
            v_cur = G.ggml_cont_2d(c, v_cur, n_embd_gqa, n_tokens)     # [n_embd_gqa, n_tokens], contiguous
        if n_embd_gqa < width:
            # [TAG_V_CACHE_VARIABLE] pad the values to the cache's (maximum) width
            v_cur = G.ggml_pad(c, v_cur, width - n_embd_gqa, 0, 0, 0)  # [n_embd_v_gqa_max, n_tokens]
        # the transposed layout takes one element per row: idxs address single values
        v_view = G.ggml_reshape_2d(c, v, 1, width * self.kv_size * self.n_stream)  # [1, nelements(v)]
        v_cur = G.ggml_reshape_2d(c, v_cur, 1, width * n_tokens)                     # [1, n_embd_v_gqa*n_tokens]
        return G.ggml_set_rows(c, v_view, v_cur, v_idxs)

    # ------------------------------------------------------------------ index inputs

    def build_input_k_idxs(self, ctx: Any, ubatch: UBatch) -> Any:
        """Input I64 [n_tokens]: the cache row of each token (filled by set_input_k_idxs)."""
        k_idxs = G.new_tensor(_ctx_ptr(ctx), _I64, (ubatch.n_tokens,))
        G.ggml_set_input(k_idxs)
        return k_idxs

    def build_input_v_idxs(self, ctx: Any, ubatch: UBatch) -> Any:
        """Input I64 [n_tokens] (or [n_tokens*n_embd_v_gqa_max] when V is transposed): where each V value goes."""
        n = ubatch.n_tokens * (self.hparams.n_embd_v_gqa_max() if self.v_trans else 1)
        v_idxs = G.new_tensor(_ctx_ptr(ctx), _I64, (n,))
        G.ggml_set_input(v_idxs)
        return v_idxs

    # ------------------------------------------------------------------ stream copies

    def copy_streams(self, sc_info: StreamCopyInfo) -> None:
        """Whole-stream copies of every layer's K and V, in queue order (all checked before the first)."""
        pairs = list(zip(sc_info.ssrc, sc_info.sdst))
        for ssrc, sdst in pairs:
            if not (0 <= ssrc < self.n_stream and 0 <= sdst < self.n_stream) or ssrc == sdst:
                raise ValueError(f"stream copy {ssrc} -> {sdst}: need two different streams in [0, {self.n_stream})")
        for ssrc, sdst in pairs:
            log.debug("copying KV buffer: stream %d to stream %d", ssrc, sdst)
            for layer in self.layers:
                G.ggml_backend_tensor_copy(layer.k_stream[ssrc], layer.k_stream[sdst])
                G.ggml_backend_tensor_copy(layer.v_stream[ssrc], layer.v_stream[sdst])

    # ------------------------------------------------------------------ ownership

    def close(self) -> None:
        """Free the buffers and contexts (idempotent). The cache is unusable afterwards."""
        for cb in self._ctxs_bufs:
            cb.buf.close()
            cb.ctx.close()
        self._ctxs_bufs = []
        self.layers = []
        self.map_layer_ids = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def layer(self, il: int) -> KVLayer:
        """The tensors model layer ``il`` uses (its own, or those of the layer it reuses)."""
        ikv = self.map_layer_ids.get(il)
        if ikv is None:
            raise ValueError(f"layer {il} has no KV tensors in this cache (kept: {sorted(self.map_layer_ids)})")
        return self.layers[ikv]

    def _n_stream_of(self, sinfo: SlotInfo, n_kv: int) -> int:
        """Streams s0..s1 of a slot, checked against the cache (a view past the buffer would read garbage)."""
        if not 0 <= sinfo.s0 <= sinfo.s1 < self.n_stream:
            raise ValueError(f"slot streams [{sinfo.s0}, {sinfo.s1}] out of the cache's [0, {self.n_stream})")
        if not 0 < n_kv <= self.kv_size:
            raise ValueError(f"n_kv={n_kv} out of range (0, kv_size={self.kv_size}]")
        return sinfo.s1 - sinfo.s0 + 1


def _ctx_ptr(ctx: Any) -> int:
    """The ggml_context pointer of a G.Context or of a raw handle."""
    return G.handle(ctx, "a ggml context")


def _check_rows_source(what: str, cur: Any, ne: tuple, nb: tuple, width: int, il: int,
                       padded: bool = False) -> None:
    """cur must be F32 with mergeable dims 0 and 1 and fit the cache width (exactly, or at most when padded)."""
    if G.ttype(cur) != _F32:
        raise ValueError(f"{what} of layer {il} must be F32 (ggml_set_rows), got {G.type_name(G.ttype(cur))}")
    if 4 * ne[0] != nb[1] or nb[0] != 4:
        raise ValueError(f"{what} of layer {il}: heads must be packed (nb {nb} for ne {ne})")
    n_embd_gqa = ne[0] * ne[1]
    if n_embd_gqa > width if padded else n_embd_gqa != width:
        raise ValueError(f"{what} of layer {il} has {n_embd_gqa} values per token; the cache row holds {width}")


def _check_idxs(what: str, idxs: Any, n: int) -> None:
    t = G.ttype(idxs)
    if t not in (_I64, _I32) or G.ne(idxs) != (n, 1, 1, 1):
        raise ValueError(f"{what} must be I64/I32 [{n}], got {G.type_name(t)} {G.ne(idxs)}")
