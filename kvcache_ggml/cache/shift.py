"""The K-shift graph of the tensor store, and what it runs on.

When positions of cells change (``seq_add``, ``seq_div``), the keys cached for them were rotated for the old
positions: the K-shift rotates every kept layer's K by each cell's pending shift, with the same ``rope_ext`` ops as
the seed (F16/F32 in place; a quantized K through an F32 cast and a copy back).  :class:`KShift` builds and runs
that graph over a :class:`~kvcache_ggml.cache.tensors.KVTensors`; the shift of each cell comes from the
bookkeeping through a callback that fills the graph's ``k_shift`` input.

The seed's ``llama_context`` becomes an :class:`UpdateContext`: the scheduler the K-shift graph runs on and the
context parameters; ``update(None, ...)`` builds a temporary one over the devices holding the cache and frees it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from .. import ggml as G
from ..cparams import CParams, layer_rope_freq
from ..hparams import HParams, RopeType
from .tensors import KVTensors, _ctx_ptr

__all__ = ["KShift", "ShiftGraph", "UpdateContext"]

log = logging.getLogger("kvcache_ggml.cache")

_I32, _F32 = G.GGMLType.I32, G.GGMLType.F32
_SHIFT_AS_NEOX = (RopeType.MROPE, RopeType.IMROPE)  # shifted with a plain NEOX rotation over the whole head
_TENSORS_PER_SHIFT_LAYER = 4  # view, cast, rope, cpy (quantized); view and rope otherwise


class CacheLike(Protocol):
    """What :meth:`UpdateContext.for_cache` needs: the cache's (or tensor store's) buffers and model shape."""

    hparams: HParams

    def buffers(self) -> list[G.BackendBuffer]: ...

    def shift_graph_size(self) -> int: ...


@dataclass(slots=True)
class UpdateContext:
    """What ``KVCache.update`` runs on: the seed's ``llama_context`` reduced to its scheduler and parameters."""

    sched: G.Sched                        # scheduler over the backends holding the cache (CPU last)
    cparams: CParams                      # RoPE / YaRN settings and n_threads of the K-shift
    graph_size: int = G.GGML_DEFAULT_GRAPH_SIZE  # node capacity the scheduler was created with
    owned: tuple = ()                     # handles this object created and frees in close() (sched, backends)

    @classmethod
    def for_cache(cls, kv: CacheLike, cparams: CParams | None = None) -> "UpdateContext":
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
    k_shift: Any                          # I32 [kv_size*n_stream]: pending shift of each cell (input)


class KShift:
    """Builds and computes the K-shift graph of a tensor store."""

    def __init__(self, tensors: KVTensors) -> None:
        self.tensors = tensors                # the K tensors to rotate
        self.model = tensors.model            # may define get_rope_freq_base/scale, get_rope_factors per layer
        self.hparams = tensors.hparams        # rope type, n_rot, head sizes

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
        args = (shift, G.addr(factors), n_rot, int(rope_type), cparams.n_ctx_orig_yarn, freq_base, freq_scale,
                cparams.yarn_ext_factor, cparams.yarn_attn_factor, cparams.yarn_beta_fast, cparams.yarn_beta_slow)
        if G.is_quantized(G.ttype(cur)):
            tmp = G.ggml_cast(c, cur, _F32)              # [n_embd_head_k, n_head_kv, n_rows] F32
            tmp = G.ggml_rope_ext(c, tmp, *args)         # same shape, rotated
            return G.ggml_cpy(c, tmp, cur)               # back into the cache, re-quantized
        return G.ggml_rope_ext_inplace(c, cur, *args)    # [n_embd_head_k, n_head_kv, n_rows], in the cache

    def graph_size(self) -> int:
        """Nodes (and leafs) the K-shift graph needs."""
        return _TENSORS_PER_SHIFT_LAYER * len(self.tensors.layers) + 8

    def context(self) -> G.Context:
        """A no_alloc context large enough for build_graph (the caller owns and frees it)."""
        return G.Context.for_tensors(1 + _TENSORS_PER_SHIFT_LAYER * len(self.tensors.layers), self.graph_size())

    def build_graph(self, ctx: G.Context, lctx: UpdateContext) -> ShiftGraph:
        """The K-shift graph in ctx: every kept layer's K rotated by its cell's pending shift."""
        hp, cparams, t = self.hparams, lctx.cparams, self.tensors
        rows = t.kv_size * t.n_stream
        k_shift = G.new_tensor(ctx.ptr, _I32, (rows,), "k_shift")  # I32 [kv_size*n_stream]
        G.ggml_set_input(k_shift)
        graph = G.Graph(ctx, self.graph_size())
        for layer in t.layers:
            il = layer.il
            tk = G.ttype(layer.k)
            freq_base, freq_scale, factors = self.rope_params(cparams, il)
            k = G.ggml_view_3d(ctx.ptr, layer.k, hp.n_embd_head_k, hp.n_head_kv(il), rows,
                               G.row_size(tk, hp.n_embd_head_k), G.row_size(tk, hp.n_embd_k_gqa(il)), 0)
            # k: [n_embd_head_k, n_head_kv, kv_size*n_stream]
            graph.expand(self.build_rope_shift(cparams, ctx, k, k_shift, factors, freq_base, freq_scale))
        return ShiftGraph(graph, k_shift)

    def rope_params(self, cparams: CParams, il: int) -> tuple[float, float, Any]:
        """(freq_base, freq_scale, factors) of layer il: the model's when it defines them, else llama.cpp's rule."""
        m = self.model
        get_base = getattr(m, "get_rope_freq_base", None)
        get_scale = getattr(m, "get_rope_freq_scale", None)
        get_factors = getattr(m, "get_rope_factors", None)
        base, scale = layer_rope_freq(self.hparams, cparams, il)
        if get_base is not None:
            base = get_base(cparams, il)
        if get_scale is not None:
            scale = get_scale(cparams, il)
        factors = get_factors(cparams, il) if get_factors is not None else None
        return float(base), float(scale), factors

    def check(self, lctx: UpdateContext | None) -> None:
        """ValueError/RuntimeError for a K-shift this cache cannot compute (ggml would abort), before any work."""
        hp = self.hparams
        rope_type = RopeType(hp.rope_type)
        if rope_type not in (RopeType.NORM, RopeType.NEOX, *_SHIFT_AS_NEOX):
            raise ValueError(f"K-shift supports NORM, NEOX, MROPE and IMROPE rope types, not {rope_type.name}")
        if hp.n_rot % 2 or hp.n_rot > hp.n_embd_head_k:
            raise ValueError(f"n_rot={hp.n_rot} must be even and <= n_embd_head_k={hp.n_embd_head_k} for the "
                             f"K-shift")
        if self.tensors.type_k == G.GGMLType.BF16:
            raise ValueError("K-shift of a bf16 K cache: ggml's rope supports F32/F16 (and quantized types through "
                             "F32), not bf16")
        if lctx is not None and self.graph_size() > lctx.graph_size:
            raise RuntimeError(f"the K-shift graph needs {self.graph_size()} nodes; the scheduler was created "
                               f"for {lctx.graph_size}")

    def compute(self, lctx: UpdateContext, set_input_k_shift: Callable[[Any], None]) -> bool:
        """Build, allocate and compute the K-shift graph on lctx's scheduler, its input filled by
        ``set_input_k_shift``; False when the compute fails."""
        need = self.graph_size()
        if need > lctx.graph_size:
            raise RuntimeError(f"the K-shift graph needs {need} nodes; the scheduler was created for "
                               f"{lctx.graph_size}")
        sched = lctx.sched
        sched.reset()
        with self.context() as ctx:
            try:
                sg = self.build_graph(ctx, lctx)
                if not G.ggml_backend_sched_alloc_graph(sched.ptr, sg.graph.ptr):
                    raise RuntimeError(f"failed to allocate the K-shift compute graph ({len(self.tensors.layers)} "
                                       f"layers, {sg.graph.n_nodes} nodes) on backends "
                                       f"{', '.join(b.name for b in sched.backends)}")
                set_input_k_shift(sg.k_shift)
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
