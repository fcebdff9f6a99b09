"""Graph half of KVCache: the views and copies a model graph uses, and the update (stream copies, K-shift).

Every method builds ggml ops in a caller's context, the same ops with the same shapes, strides and offsets as the
seed.  Shapes are written in ggml ``ne`` order (fastest dimension first).  Checks that ggml would turn into a
process abort (GGML_ASSERT) run first and raise ``ValueError`` naming the values.

The seed's ``llama_context`` becomes an :class:`UpdateContext`: the scheduler the K-shift graph runs on and the
context parameters; ``update(None, ...)`` builds a temporary one over the devices holding the cache and frees it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from . import _ggml as G
from .cparams import CParams
from .hparams import RopeType

log = logging.getLogger("kvcache_ggml.cache")

_I32, _I64, _F32 = G.GGMLType.I32, G.GGMLType.I64, G.GGMLType.F32
_SHIFT_AS_NEOX = (RopeType.MROPE, RopeType.IMROPE)  # shifted with a plain NEOX rotation over the whole head
_TENSORS_PER_SHIFT_LAYER = 4  # view, cast, rope, cpy (quantized); view and rope otherwise
_BLOCKS = {t: (G.type_size(t), G.blck_size(t)) for t in G.GGMLType}  # type -> (bytes per block, elements)


def _ctx_ptr(ctx: Any) -> int:
    """The ggml_context pointer of a G.Context or of a raw handle."""
    return G.handle(ctx, "a ggml context")


@dataclass(slots=True)
class UpdateContext:
    """What ``KVCache.update`` runs on: the seed's ``llama_context`` reduced to its scheduler and parameters."""

    sched: G.Sched                        # scheduler over the backends holding the cache (CPU last)
    cparams: CParams                      # RoPE / YaRN settings and n_threads of the K-shift
    graph_size: int = G.GGML_DEFAULT_GRAPH_SIZE  # node capacity the scheduler was created with
    owned: tuple = ()                     # handles this object created and frees in close() (sched, backends)

    @classmethod
    def for_cache(cls, kv: Any, cparams: CParams | None = None) -> "UpdateContext":
        """A scheduler over the devices holding ``kv``'s buffers plus the CPU, owned by the returned object."""
        cparams = cparams if cparams is not None else CParams.from_hparams(kv.hparams)
        backends: list[G.Backend] = []
        try:
            seen: set[int] = set()
            for buf in kv.buffers():
                dev = G.ggml_backend_buft_get_device(buf.buft)
                if not dev or dev in seen or G.ggml_backend_dev_type(dev) == G.DeviceType.CPU:
                    continue
                seen.add(dev)
                backends.append(G.Backend(G.ggml_backend_dev_init(dev, None)))
            backends.append(G.Backend.cpu())
            graph_size = max(G.GGML_DEFAULT_GRAPH_SIZE, kv.shift_graph_size())
            sched = G.Sched(backends, graph_size=graph_size)
        except BaseException:
            for b in backends:
                b.close()
            raise
        return cls(sched, cparams, graph_size, (sched, *backends))

    def close(self) -> None:
        """Free what this object created (the scheduler before its backends); a caller's scheduler stays."""
        for h in self.owned:
            h.close()
        self.owned = ()

    def __enter__(self) -> "UpdateContext":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(slots=True)
class ShiftGraph:
    """The K-shift graph (the seed's llm_graph_result for it): one rope per kept layer and its input."""

    graph: G.Graph                        # in the caller's context
    k_shift: Any                          # TensorP I32 [kv_size*n_stream]: pending shift of each cell (input)


class GraphMixin:
    """get_k/get_v/cpy_k/cpy_v, the index inputs, the K-shift graph and update() of llama_kv_cache."""

    # ------------------------------------------------------------------ views of the cache

    def get_k(self, ctx: Any, il: int, n_kv: int, sinfo: Any) -> Any:
        """K of layer il for the streams s0..s1 of the slot: view [n_embd_head_k, n_head_kv, n_kv, ns]."""
        k = self._layer(il).k                          # [n_embd_k_gqa, kv_size, n_stream]
        hp, tk = self.hparams, G.ttype(k)
        kv_size, n_embd_k_gqa = self.get_size(), hp.n_embd_k_gqa(il)
        ns = self._n_stream_of(sinfo, n_kv)
        stream = _row_size(tk, n_embd_k_gqa * kv_size)
        return G.ggml_view_4d(_ctx_ptr(ctx), k, hp.n_embd_head_k, hp.n_head_kv(il), n_kv, ns,
                              _row_size(tk, hp.n_embd_head_k), _row_size(tk, n_embd_k_gqa), stream,
                              stream * sinfo.s0)

    def get_v(self, ctx: Any, il: int, n_kv: int, sinfo: Any) -> Any:
        """V of layer il for the slot's streams.

        Not transposed: view [n_embd_head_v, n_head_kv, n_kv, ns].  Transposed: view [n_kv, n_head_kv,
        n_embd_head_v, ns] over the cache's [kv_size, n_embd_v_gqa] planes (nb1 > nb2).
        """
        v = self._layer(il).v                          # [n_embd_v_gqa(_max when transposed), kv_size, n_stream]
        hp, tv = self.hparams, G.ttype(v)
        kv_size, n_embd_v_gqa = self.get_size(), G.ne(v)[0]
        assert n_embd_v_gqa >= hp.n_embd_v_gqa(il)  # [TAG_V_CACHE_VARIABLE] transposed: the widest layer's
        ns = self._n_stream_of(sinfo, n_kv)
        stream = _row_size(tv, n_embd_v_gqa * kv_size)
        if not self.v_trans:
            return G.ggml_view_4d(_ctx_ptr(ctx), v, hp.n_embd_head_v, hp.n_head_kv(il), n_kv, ns,
                                  _row_size(tv, hp.n_embd_head_v), _row_size(tv, n_embd_v_gqa), stream,
                                  stream * sinfo.s0)
        return G.ggml_view_4d(_ctx_ptr(ctx), v, n_kv, hp.n_head_kv(il), hp.n_embd_head_v, ns,
                              _row_size(tv, kv_size * hp.n_embd_head_v), _row_size(tv, kv_size), stream,
                              stream * sinfo.s0)

    # ------------------------------------------------------------------ stores into the cache

    def cpy_k(self, ctx: Any, k_cur: Any, k_idxs: Any, il: int, sinfo: Any = None) -> Any:
        """Store k_cur F32 [n_embd_head, n_head, n_tokens] into rows k_idxs I64 [n_tokens] of layer il's K.

        The indices are global over the streams (stream * kv_size + cell).  Returns the set_rows node, a view
        [n_embd_k_gqa, kv_size(*n_stream)] of the cache.
        """
        del sinfo  # the indices carry the slot
        c = _ctx_ptr(ctx)
        k = self._layer(il).k                          # [n_embd_k_gqa, kv_size, n_stream]
        ne_cur, nb_cur = G.ne(k_cur), G.nb(k_cur)
        n_embd_head, n_head, n_tokens, _ = ne_cur
        n_embd_gqa = n_embd_head * n_head
        _check_rows_source("k_cur", k_cur, ne_cur, nb_cur, self.hparams.n_embd_k_gqa(il), il)
        _check_idxs("k_idxs", k_idxs, n_tokens)
        k_cur = G.ggml_view_2d(c, k_cur, n_embd_gqa, n_tokens, nb_cur[2], 0)  # [n_embd_gqa, n_tokens]
        if self.n_stream > 1:
            # the indices are global: one row space over every stream
            k = G.ggml_reshape_2d(c, k, n_embd_gqa, self.get_size() * self.n_stream)  # [n_embd_gqa, kv_size*n_s]
        return G.ggml_set_rows(c, k, k_cur, k_idxs)

    def cpy_v(self, ctx: Any, v_cur: Any, v_idxs: Any, il: int, sinfo: Any = None) -> Any:
        """Store v_cur F32 [n_embd_head, n_head, n_tokens] into layer il's V at v_idxs.

        Not transposed: one row per token, v_idxs I64 [n_tokens].  Transposed: one single-element row per value,
        v_idxs I64 [n_tokens*n_embd_v_gqa_max], the values padded to the cache width [TAG_V_CACHE_VARIABLE].
        """
        del sinfo
        c = _ctx_ptr(ctx)
        hp = self.hparams
        v = self._layer(il).v                          # [n_embd_v_gqa(_max), kv_size, n_stream]
        ne_cur, nb_cur = G.ne(v_cur), G.nb(v_cur)
        n_embd_head, n_head, n_tokens, _ = ne_cur
        n_embd_gqa = n_embd_head * n_head
        if not self.v_trans:
            _check_rows_source("v_cur", v_cur, ne_cur, nb_cur, hp.n_embd_v_gqa(il), il)
            _check_idxs("v_idxs", v_idxs, n_tokens)
            v_cur = G.ggml_view_2d(c, v_cur, n_embd_gqa, n_tokens, nb_cur[2], 0)  # [n_embd_gqa, n_tokens]
            if self.n_stream > 1:
                v = G.ggml_reshape_2d(c, v, n_embd_gqa, self.get_size() * self.n_stream)  # [n_embd_gqa, kv*n_s]
            return G.ggml_set_rows(c, v, v_cur, v_idxs)

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
        v_view = G.ggml_reshape_2d(c, v, 1, width * self.get_size() * self.n_stream)  # [1, nelements(v)]
        v_cur = G.ggml_reshape_2d(c, v_cur, 1, width * n_tokens)                     # [1, n_embd_v_gqa*n_tokens]
        return G.ggml_set_rows(c, v_view, v_cur, v_idxs)

    # ------------------------------------------------------------------ index inputs

    def build_input_k_idxs(self, ctx: Any, ubatch: Any) -> Any:
        """Input I64 [n_tokens]: the cache row of each token (filled by set_input_k_idxs)."""
        k_idxs = G.new_tensor(_ctx_ptr(ctx), _I64, (ubatch.n_tokens,))
        G.ggml_set_input(k_idxs)
        return k_idxs

    def build_input_v_idxs(self, ctx: Any, ubatch: Any) -> Any:
        """Input I64 [n_tokens] (or [n_tokens*n_embd_v_gqa_max] when V is transposed): where each V value goes."""
        n = ubatch.n_tokens * (self.hparams.n_embd_v_gqa_max() if self.v_trans else 1)
        v_idxs = G.new_tensor(_ctx_ptr(ctx), _I64, (n,))
        G.ggml_set_input(v_idxs)
        return v_idxs

    # ------------------------------------------------------------------ K-shift

    def build_rope_shift(self, cparams: CParams, ctx: Any, cur: Any, shift: Any, factors: Any,
                         freq_base: float, freq_scale: float) -> Any:
        """Rotate cur [n_embd_head_k, n_head_kv, n_rows] by shift I32 [n_rows] (only the first n_rot dims).

        F16/F32: in place.  Quantized: cast to F32, rope, copy back into cur.
        """
        hp = self.hparams
        n_rot = hp.n_rot
        rope_type = RopeType(hp.rope_type)
        if rope_type in _SHIFT_AS_NEOX:
            rope_type = RopeType.NEOX  # M-RoPE: rotate the whole head with the NEOX pairing
        if rope_type not in (RopeType.NORM, RopeType.NEOX):
            raise ValueError(f"K-shift supports NORM, NEOX, MROPE and IMROPE rope types, not {rope_type.name}")
        if n_rot % 2 or n_rot > G.ne(cur)[0]:
            raise ValueError(f"n_rot={n_rot} must be even and <= n_embd_head_k={G.ne(cur)[0]} for the K-shift")
        c = _ctx_ptr(ctx)
        args = (shift, factors, n_rot, int(rope_type), cparams.n_ctx_orig_yarn, freq_base, freq_scale,
                cparams.yarn_ext_factor, cparams.yarn_attn_factor, cparams.yarn_beta_fast, cparams.yarn_beta_slow)
        if G.is_quantized(G.ttype(cur)):
            tmp = G.ggml_cast(c, cur, _F32)              # [n_embd_head_k, n_head_kv, n_rows] F32
            tmp = G.ggml_rope_ext(c, tmp, *args)         # same shape, rotated
            return G.ggml_cpy(c, tmp, cur)               # back into the cache, re-quantized
        return G.ggml_rope_ext_inplace(c, cur, *args)    # [n_embd_head_k, n_head_kv, n_rows], in the cache

    def shift_graph_size(self) -> int:
        """Nodes (and leafs) the K-shift graph needs."""
        return _TENSORS_PER_SHIFT_LAYER * len(self.layers) + 8

    def shift_context(self) -> G.Context:
        """A no_alloc context large enough for build_graph_shift (the caller owns and frees it)."""
        return G.Context.for_tensors(1 + _TENSORS_PER_SHIFT_LAYER * len(self.layers), self.shift_graph_size())

    def build_graph_shift(self, ctx: G.Context, lctx: UpdateContext) -> ShiftGraph:
        """The K-shift graph in ctx: every kept layer's K rotated by its cell's pending shift."""
        hp, cparams = self.hparams, lctx.cparams
        n_stream, size = self.n_stream, self.get_size()
        k_shift = G.new_tensor(ctx.ptr, _I32, (size * n_stream,), "k_shift")  # I32 [kv_size*n_stream]
        G.ggml_set_input(k_shift)
        graph = G.Graph(ctx, self.shift_graph_size())
        for layer in self.layers:
            il = layer.il
            tk = G.ttype(layer.k)
            freq_base, freq_scale, factors = self._rope_params(cparams, il)
            k = G.ggml_view_3d(ctx.ptr, layer.k, hp.n_embd_head_k, hp.n_head_kv(il), size * n_stream,
                               _row_size(tk, hp.n_embd_head_k), _row_size(tk, hp.n_embd_k_gqa(il)), 0)
            # k: [n_embd_head_k, n_head_kv, kv_size*n_stream]
            graph.expand(self.build_rope_shift(cparams, ctx, k, k_shift, factors, freq_base, freq_scale))
        return ShiftGraph(graph, k_shift)

    def _rope_params(self, cparams: CParams, il: int) -> tuple[float, float, Any]:
        """(freq_base, freq_scale, factors) of layer il: the model's when it defines them, else llama.cpp's rule."""
        m, hp = self.model, self.hparams
        swa = hp.is_swa(il)
        get_base = getattr(m, "get_rope_freq_base", None)
        get_scale = getattr(m, "get_rope_freq_scale", None)
        get_factors = getattr(m, "get_rope_factors", None)
        if get_base is not None:
            base = get_base(cparams, il)
        else:
            base = getattr(hp, "rope_freq_base_train_swa", cparams.rope_freq_base) if swa else cparams.rope_freq_base
        if get_scale is not None:
            scale = get_scale(cparams, il)
        else:
            scale = (getattr(hp, "rope_freq_scale_train_swa", cparams.rope_freq_scale) if swa
                     else cparams.rope_freq_scale)
        factors = get_factors(cparams, il) if get_factors is not None else None
        return float(base), float(scale), factors

    # ------------------------------------------------------------------ update

    def update(self, lctx: UpdateContext | None, do_shift: bool, sc_info: Any) -> bool:
        """Queued stream copies, then the pending K-shift; True when a K-shift graph was computed.

        ``lctx`` None: the K-shift runs on a temporary scheduler over the cache's devices, freed before
        returning.  A failed K-shift computation is logged and returns False with the shifts kept (as the seed);
        a graph that cannot be allocated raises RuntimeError.
        """
        updated = False
        needs_data = not sc_info.empty() or (do_shift and self.hparams.rope_type != RopeType.NONE)
        if needs_data and self.hparams.no_alloc:
            raise RuntimeError("update() moves K/V data, but this cache was created with hparams.no_alloc "
                               "(its tensors have no memory)")
        if do_shift and self.hparams.rope_type != RopeType.NONE:
            self._check_kshift(lctx)  # before the copies: a refused update changes nothing
        if not sc_info.empty():
            assert self.n_stream > 1, "stream copy should never happen with a single stream"
            if lctx is not None:
                G.ggml_backend_sched_synchronize(lctx.sched.ptr)  # no graph may still be writing the cache
            self._copy_streams(sc_info)
        if do_shift:
            if not self.get_can_shift():
                raise ValueError("the current KV cache / model configuration does not support K-shift")
            log.debug("applying K-shift")
            if self.hparams.rope_type != RopeType.NONE:
                if lctx is None:
                    with UpdateContext.for_cache(self) as tmp:
                        ok = self._compute_shift(tmp)
                else:
                    ok = self._compute_shift(lctx)
                if not ok:
                    return updated
                updated = True
            for cells in self.v_cells:
                cells.reset_shift()
        return updated

    def _copy_streams(self, sc_info: Any) -> None:
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

    def _check_kshift(self, lctx: UpdateContext | None) -> None:
        """ValueError/RuntimeError for a K-shift this cache cannot compute (ggml would abort), before any work."""
        hp = self.hparams
        rope_type = RopeType(hp.rope_type)
        if rope_type not in (RopeType.NORM, RopeType.NEOX, *_SHIFT_AS_NEOX):
            raise ValueError(f"K-shift supports NORM, NEOX, MROPE and IMROPE rope types, not {rope_type.name}")
        if hp.n_rot % 2 or hp.n_rot > hp.n_embd_head_k:
            raise ValueError(f"n_rot={hp.n_rot} must be even and <= n_embd_head_k={hp.n_embd_head_k} for the "
                             f"K-shift")
        if self.type_k == G.GGMLType.BF16:
            raise ValueError("K-shift of a bf16 K cache: ggml's rope supports F32/F16 (and quantized types through "
                             "F32), not bf16")
        if lctx is not None and self.shift_graph_size() > lctx.graph_size:
            raise RuntimeError(f"the K-shift graph needs {self.shift_graph_size()} nodes; the scheduler was created "
                               f"for {lctx.graph_size}")

    def _compute_shift(self, lctx: UpdateContext) -> bool:
        """Build, allocate and compute the K-shift graph on lctx's scheduler; False when the compute fails."""
        need = self.shift_graph_size()
        if need > lctx.graph_size:
            raise RuntimeError(f"the K-shift graph needs {need} nodes; the scheduler was created for "
                               f"{lctx.graph_size}")
        sched = lctx.sched
        sched.reset()
        with self.shift_context() as ctx:
            try:
                sg = self.build_graph_shift(ctx, lctx)
                if not G.ggml_backend_sched_alloc_graph(sched.ptr, sg.graph.ptr):
                    raise RuntimeError(f"failed to allocate the K-shift compute graph ({len(self.layers)} layers, "
                                       f"{sg.graph.n_nodes} nodes) on backends "
                                       f"{', '.join(b.name for b in sched.backends)}")
                self.set_input_k_shift(sg.k_shift)
                for b in sched.backends:
                    if b.is_cpu:
                        b.set_n_threads(lctx.cparams.n_threads)
                status = G.ggml_backend_sched_graph_compute(sched.ptr, sg.graph.ptr)
            finally:
                sched.reset()  # drop the scheduler's references to the graph before its context is freed
        if status != G.Status.SUCCESS:
            log.error("failed to compute K-shift (status %s)", G.Status(status).name)
            return False
        return True

    # ------------------------------------------------------------------ helpers

    def _n_stream_of(self, sinfo: Any, n_kv: int) -> int:
        """Streams s0..s1 of a slot, checked against the cache (a view past the buffer would read garbage)."""
        if not 0 <= sinfo.s0 <= sinfo.s1 < self.n_stream:
            raise ValueError(f"slot streams [{sinfo.s0}, {sinfo.s1}] out of the cache's [0, {self.n_stream})")
        if not 0 < n_kv <= self.get_size():
            raise ValueError(f"n_kv={n_kv} out of range (0, kv_size={self.get_size()}]")
        return sinfo.s1 - sinfo.s0 + 1


def _row_size(tt: int, n: int) -> int:
    """ggml_row_size from a table of block sizes (a whole number of blocks, else ValueError)."""
    size, blck = _BLOCKS[tt]
    if n % blck:
        raise ValueError(f"{n} elements of type {G.type_name(tt)} are not a whole number of {blck}-element blocks")
    return size * n // blck


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
