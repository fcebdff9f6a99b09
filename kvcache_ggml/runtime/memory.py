"""What a context's KV cache will take, before it is allocated: bytes per token x cells, per buffer type.

:func:`kv_memory_plan` resolves the context parameters as :class:`~kvcache_ggml.runtime.context.Context` does
(``n_ctx = 0`` is the model's ``n_ctx_train``, padded to 256; one stream per sequence unless unified) and sums, per
buffer type holding layers' K/V, the bytes one cell takes: ``row_size(type_k, n_embd_k_gqa) +
row_size(type_v, n_embd_v_gqa)`` over those layers.  The same arithmetic as llama.cpp's
``llama_kv_cache: size = ... MiB (... cells, ... layers, ...)`` line, printed before the buffers exist.  A
sliding-window model whose runtime keeps an iSWA cache pair (:mod:`kvcache_ggml.runtime.arch`) has a line per
buffer type and cache: the base cache's layers over the context, the SWA layers over the SWA cache's cells
(:func:`~kvcache_ggml.cache.iswa.swa_cache_size`), as llama.cpp prints one size line per cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import ggml as G
from ..cparams import ContextParams, CParams
from ..hparams import SwaType
from ..cache.iswa import swa_cache_size
from .arch import runtime_for

__all__ = ["KVMemoryLine", "KVMemoryPlan", "kv_memory_plan"]


@dataclass(slots=True)
class KVMemoryLine:
    """The K/V of the layers in one buffer type (and, for an iSWA pair, one of its caches)."""

    buft: str              # buffer type name ("CPU", "CUDA0", ...)
    cache: str             # "" (the one cache), or "base" / "SWA" (the iSWA pair's caches)
    layers: int            # layers whose K/V it holds
    bytes_per_token: int   # K + V bytes of one cell over those layers
    cells: int             # cells per stream x streams

    @property
    def total(self) -> int:
        return self.bytes_per_token * self.cells


@dataclass(slots=True)
class KVMemoryPlan:
    """The cache a context will allocate."""

    n_ctx: int                   # resolved context size (tokens, all sequences)
    kv_size: int                 # cells per stream
    n_stream: int                # streams
    lines: list[KVMemoryLine]    # per buffer type (and cache)

    @property
    def total(self) -> int:
        return sum(line.total for line in self.lines)

    def describe(self, type_k: str, type_v: str) -> list[str]:
        out = [f"KV cache: n_ctx {self.n_ctx} = {self.n_stream} stream(s) x {self.kv_size} cells, K {type_k} / "
               f"V {type_v}: {self.total / 2**20:.2f} MiB"]
        out += [f"  {ln.buft}{f' ({ln.cache} cache)' if ln.cache else ''}: {ln.layers} layers x "
                f"{ln.bytes_per_token} B/token x {ln.cells} cells = {ln.total / 2**20:.2f} MiB" for ln in self.lines]
        return out


def kv_memory_plan(model: Any, params: ContextParams) -> KVMemoryPlan:
    """The KV memory a :class:`Context` over ``model`` with ``params`` will allocate."""
    hp = model.hparams
    cp = CParams.from_hparams(hp, params)  # checks params
    n_stream = 1 if params.kv_unified else cp.n_seq_max
    tk, tv = G.parse_type(params.type_k), G.parse_type(params.type_v)
    cpu = G.ggml_backend_dev_by_type(int(G.DeviceType.CPU))
    # (cache name, cells per stream) of each layer: the iSWA pair puts the SWA layers in the small cache
    cache_of = [("", cp.n_ctx_seq)] * hp.n_layer
    if runtime_for(hp.arch).iswa and SwaType(hp.swa_type) != SwaType.NONE and hp.is_swa_any():
        n_swa_cells = swa_cache_size(cp.n_ctx_seq, hp.n_swa, cp.n_seq_max, cp.n_ubatch, params.kv_unified,
                                     params.swa_full)
        cache_of = [("SWA", n_swa_cells) if hp.is_swa(il) else ("base", cp.n_ctx_seq) for il in range(hp.n_layer)]
    per: dict[tuple[str, str, int], list[int]] = {}
    for il in range(hp.n_layer):
        dev = model.dev_layer(il) if params.offload_kqv else cpu
        name = G.buft_name(G.ggml_backend_dev_buffer_type(dev))
        b = G.row_size(tk, hp.n_embd_k_gqa(il)) + G.row_size(tv, hp.n_embd_v_gqa(il))
        acc = per.setdefault((name, *cache_of[il]), [0, 0])
        acc[0] += 1
        acc[1] += b
    lines = [KVMemoryLine(name, cache, n, b, cells * n_stream) for (name, cache, cells), (n, b) in per.items()]
    lines.sort(key=lambda ln: ln.cache == "SWA")  # the base cache first, as llama.cpp prints them
    return KVMemoryPlan(cp.n_ctx, cp.n_ctx_seq, n_stream, lines)
