"""Tensor storage of KVCache: K and V per kept layer, one ggml context and one backend buffer per buffer type.

As the seed's constructor: contexts are created per buffer type and allocated in buffer-type-name order; each
kept layer has ``cache_k_l{il}`` ``[n_embd_k_gqa, kv_size, n_stream]`` and ``cache_v_l{il}``
``[n_embd_v_gqa (the maximum over layers when V is transposed), kv_size, n_stream]`` plus one 2-D view per stream.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _ggml as G

log = logging.getLogger("kvcache_ggml.cache")

_MiB = 1024.0 * 1024.0


@dataclass(slots=True)
class KVLayer:
    """The tensors of one kept layer (llama.cpp's ``kv_layer``)."""

    il: int                     # model layer index
    k: Any                      # TensorP [n_embd_k_gqa, kv_size, n_stream]
    v: Any                      # TensorP [n_embd_v_gqa, kv_size, n_stream]
    k_stream: list[Any]         # per stream, TensorP view [n_embd_k_gqa, kv_size]
    v_stream: list[Any]         # per stream, TensorP view [n_embd_v_gqa, kv_size]


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


class TensorMixin:
    """Allocation, sizes and ownership of the K/V tensors (the seed constructor's second half)."""

    def _init_tensors(self) -> None:
        hp, p = self.hparams, self.params
        kv_size, ns = p.kv_size, self.n_stream
        type_k, type_v = G.parse_type(p.type_k), G.parse_type(p.type_v)
        self.type_k, self.type_v = type_k, type_v
        self.layers: list[KVLayer] = []
        self.map_layer_ids: dict[int, int] = {}
        self._ctxs_bufs: list[_CtxBuf] = []
        # offset of element j of a transposed V row in its stream: the per-step v_idxs input adds it to each cell
        self._v_elem_offs = np.arange(hp.n_embd_v_gqa_max(), dtype=np.int64) * kv_size

        # plan first: every check before any native allocation
        plan: list[tuple[int, int, str, int, int]] = []  # (il, buft, dev_name, n_embd_k_gqa, n_embd_v_gqa)
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
            plan.append((il, buft, dev_name, hp.n_embd_k_gqa(il), n_embd_v))
        kept = {il for il, *_ in plan}
        reuse_map: dict[int, int] = {}
        if p.reuse is not None:
            for il in range(hp.n_layer):
                il_reuse = p.reuse(il)
                if il_reuse < 0:
                    continue
                if p.filter is not None and not p.filter(il):
                    continue
                if il_reuse not in kept:
                    raise ValueError(f"layer {il} reuses layer {il_reuse}, which has no tensors in this cache "
                                     f"(kept layers: {sorted(kept)})")
                reuse_map[il] = il_reuse

        n_layer_kv = hp.n_layer_kv()
        ctx_of: dict[int, _CtxBuf] = {}
        try:
            for il, buft, dev_name, n_embd_k, n_embd_v in plan:
                cb = ctx_of.get(buft)
                if cb is None:
                    mem = 2 * (1 + ns) * n_layer_kv * G.ggml_tensor_overhead()
                    cb = ctx_of[buft] = _CtxBuf(buft, G.buft_name(buft), G.Context(mem, no_alloc=True), None)
                k = G.new_tensor(cb.ctx.ptr, type_k, (n_embd_k, kv_size, ns), f"cache_k_l{il}")
                v = G.new_tensor(cb.ctx.ptr, type_v, (n_embd_v, kv_size, ns), f"cache_v_l{il}")
                knb, vnb = G.nb(k), G.nb(v)
                k_stream = [G.ggml_view_2d(cb.ctx.ptr, k, n_embd_k, kv_size, knb[1], s * knb[2]) for s in range(ns)]
                v_stream = [G.ggml_view_2d(cb.ctx.ptr, v, n_embd_v, kv_size, vnb[1], s * vnb[2]) for s in range(ns)]
                self.map_layer_ids[il] = len(self.layers)
                self.layers.append(KVLayer(il, k, v, k_stream, v_stream))
            for il, il_reuse in reuse_map.items():
                log.debug("- layer %3d: reuse layer %d, is_swa = %d", il, il_reuse, hp.is_swa(il))
                self.map_layer_ids[il] = self.map_layer_ids[il_reuse]

            for cb in sorted(ctx_of.values(), key=lambda c: c.buft_name):
                if hp.no_alloc:
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
                self._ctxs_bufs.append(cb)
        except BaseException:
            for cb in ctx_of.values():
                if cb.buf is not None:
                    cb.buf.close()
                cb.ctx.close()
            self._ctxs_bufs = []
            raise

        mk, mv = self.size_k_bytes(), self.size_v_bytes()
        log.info("size = %7.2f MiB (%6u cells, %3d layers, %2u/%u seqs), K (%s): %7.2f MiB, V (%s): %7.2f MiB",
                 (mk + mv) / _MiB, kv_size, len(self.layers), self.n_seq_max, ns, G.type_name(type_k), mk / _MiB,
                 G.type_name(type_v), mv / _MiB)

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

    def _clear_buffers(self) -> None:
        for cb in self._ctxs_bufs:
            cb.buf.clear(0)

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

    def _layer(self, il: int) -> KVLayer:
        ikv = self.map_layer_ids.get(il)
        if ikv is None:
            raise ValueError(f"layer {il} has no KV tensors in this cache (kept: {sorted(self.map_layer_ids)})")
        return self.layers[ikv]
