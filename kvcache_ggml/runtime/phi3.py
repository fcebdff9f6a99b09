"""Phi-3 / Phi-3.5 / Phi-4-mini GGUFs: llama.cpp's ``llm_build_phi3`` over one KVCache.

What differs from the llama graph (:mod:`kvcache_ggml.runtime.graph`):

- Q, K and V come from one fused matrix, ``attn_qkv`` [n_embd, n_embd + 2*n_embd_gqa]: its output is cut into
  three views (Q at 0, K at n_embd, V at n_embd + n_embd_gqa floats of each row), as llama.cpp cuts it, so the
  RoPE reads a strided view and the V store copies one;
- the FFN's gate and up are one matrix, ``ffn_up`` [n_embd, 2*n_ff]: ``ggml_swiglu`` of its output is
  silu(first half) * second half;
- NEOX RoPE over the first ``n_rot`` dims of a head (Phi-4-mini rotates 3/4 of each head), with LongRoPE's
  frequency factors when the file has them: ``rope_factors_long`` when a sequence's context (n_ctx_seq) exceeds
  the original context (``rope.scaling.original_context_length``), else ``rope_factors_short``; the RoPE'd Q and
  K are scaled by ``rope.scaling.attn_factor`` (folded into the context's yarn_attn_factor, as llama.cpp does);
- Q is multiplied by 1/sqrtf(head size) after RoPE and the attention's own scale is 1;
- the sliding window llama.cpp reads for phi3 is switched off, as llama.cpp switches it off (one KVCache).

The fused decode step (:mod:`~kvcache_ggml.runtime.fused_step`) is llama's graph only: Phi-3 takes the plain path.
"""
from __future__ import annotations

from dataclasses import dataclass
from os import PathLike
from typing import Any

import numpy as np

from .. import ggml as G
from ..cache import KVCache, KVCacheParams
from ..hparams import RopeType
from .arch import ArchRuntime
from .graph import (_F16, _F32, DecoderGraph, GraphKey, _attention, _new_input, _rms_norm, build_token_inputs,
                    graph_capacity, graph_key, set_inputs)
from .model import Model

__all__ = ["PHI3_ARCHS", "Phi3Layer", "Phi3Model", "build_phi3", "RUNTIME"]

PHI3_ARCHS = ("phi3",)
_LAYER = ("attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down")
_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


@dataclass(slots=True)
class Phi3Layer:
    """The tensors of one Phi-3 block (ggml ``ne`` order)."""

    attn_norm: Any    # F32 [n_embd]
    wqkv: Any         # [n_embd, n_embd + 2*n_embd_gqa]: Q, K, V rows one after the other
    wo: Any           # [n_embd, n_embd]
    ffn_norm: Any     # F32 [n_embd]
    ffn_up: Any       # [n_embd, 2*n_ff]: gate rows, then up rows
    ffn_down: Any     # [n_ff, n_embd]


class Phi3Model(Model):
    """A Phi-3 GGUF: fused QKV and gate/up matrices, optional LongRoPE factors (shared by every layer)."""

    ARCHS = PHI3_ARCHS
    ROPE_TYPE = RopeType.NEOX
    PARTIAL_ROPE = True

    def __init__(self, path: str | PathLike, **kwargs: Any) -> None:
        self.rope_long: Any = None     # F32 [n_rot/2] LongRoPE factors beyond the original context, or None
        self.rope_short: Any = None    # F32 [n_rot/2] LongRoPE factors within it, or None
        super().__init__(path, **kwargs)

    def layer_tensors(self) -> tuple[str, ...]:
        return _LAYER

    def optional_tensors(self) -> tuple[str, ...]:
        # llama.cpp's phi3 loader takes no rope_freqs: the LongRoPE pair instead
        return ("output.weight",) + _FACTORS

    def optional_layer_tensors(self) -> tuple[str, ...]:
        return ()

    def _bind_layers(self) -> None:
        t = self.tensors
        self.rope_long, self.rope_short = (t.get(n) for n in _FACTORS)
        self.layers = [Phi3Layer(*(t[f"blk.{il}.{n}.weight"] for n in _LAYER)) for il in range(self.hparams.n_layer)]

    def _check_shapes(self) -> None:
        hp = self.hparams
        e = hp.n_embd
        if hp.n_embd_head_k * hp.n_head(0) != e:
            raise ValueError(f"{self.path}: phi3 needs n_head * head size == n_embd, got {hp.n_head(0)} * "
                             f"{hp.n_embd_head_k} != {e}")
        n_vocab = G.ne(self.tok_embd)[1]
        want: dict[str, tuple[int, ...]] = {"token_embd.weight": (e, n_vocab), "output_norm.weight": (e,)}
        if self.output is not self.tok_embd:
            want["output.weight"] = (e, n_vocab)
        for name in _FACTORS:
            if name in self.tensors:
                want[name] = (hp.n_rot // 2,)
        for il in range(hp.n_layer):
            b = f"blk.{il}."
            n_ff = G.ne(self.layers[il].ffn_down)[0]
            want.update({b + "attn_norm.weight": (e,), b + "ffn_norm.weight": (e,),
                         b + "attn_qkv.weight": (e, e + 2 * hp.n_embd_k_gqa(il)), b + "attn_output.weight": (e, e),
                         b + "ffn_up.weight": (e, 2 * n_ff), b + "ffn_down.weight": (n_ff, e)})
        for name, ne in want.items():
            have = G.ne(self.tensors[name])
            if have[:len(ne)] != ne or any(d != 1 for d in have[len(ne):]):
                raise ValueError(f"{self.path}: tensor {name} has ne {have}, expected {ne}")

    def n_ctx_orig(self) -> int:
        """The context LongRoPE's factors switch at (llama.cpp's hparams.n_ctx_orig_yarn)."""
        hp = self.hparams
        return hp.n_ctx_orig_yarn or hp.n_ctx_train

    def get_rope_factors(self, cparams: Any, il: int) -> Any:
        """llama_model::get_rope_factors: the long factors when a sequence's context exceeds the original one."""
        del il
        return self.rope_long if cparams.n_ctx_seq > self.n_ctx_orig() else self.rope_short

    def close(self) -> None:
        super().close()
        self.rope_long = self.rope_short = None


def create_memory(model: Any, params: KVCacheParams, n_ubatch: int, swa_full: bool) -> KVCache:
    """One KVCache: llama.cpp turns Phi-3's sliding window off."""
    del n_ubatch, swa_full
    return KVCache(model, params)


# ====================================================================================================== graph

def build_phi3(ctx: G.Context, model: Any, cparams: Any, mctx: Any, ubatch: Any, key: GraphKey, *,
               flash_attn: bool, fa_cast_f32_kv: bool = False) -> DecoderGraph:
    """Build the Phi-3 graph of ``ubatch`` (after ``mctx.apply()``) in ``ctx``, node for node as llm_build_phi3."""
    hp = model.hparams
    c, nm = ctx.ptr, ctx.node_namer()
    eps = hp.f_norm_rms_eps
    tokens, embd, inp_l, pos, out_ids = build_token_inputs(c, nm, model, key)
    k_idxs = mctx.build_input_k_idxs(ctx, ubatch)                              # I64 [n_tokens]
    v_idxs = mctx.build_input_v_idxs(ctx, ubatch)                              # I64 [n_tokens(*n_embd_v_gqa)]
    G.set_name(k_idxs, "inp_k_idxs")
    G.set_name(v_idxs, "inp_v_idxs")
    kq_mask = _new_input(c, _F32, (key.n_kv, key.n_tokens // key.n_stream, 1, key.n_stream), "")
    mask = G.ggml_cast(c, kq_mask, _F16) if flash_attn else kq_mask          # flash attention takes an F16 mask
    G.set_name(kq_mask, "inp_kq_mask")
    inputs = (pos, k_idxs, v_idxs, mask)

    graph = G.Graph(ctx, graph_capacity(hp.n_layer))
    for il in range(hp.n_layer):
        lw = model.layers[il]
        residual = inp_l
        cur = nm(_rms_norm(c, nm, inp_l, lw.attn_norm, eps, il), "attn_norm", il)   # [n_embd, n_tokens]
        cur = _self_attention(ctx, graph, model, cparams, mctx, il, cur, inputs, flash_attn, fa_cast_f32_kv)
        cur = G.ggml_mul_mat(c, lw.wo, cur)                                    # [n_embd, n_tokens]
        if il == hp.n_layer - 1:
            cur = G.ggml_get_rows(c, cur, out_ids)                              # [n_embd, n_outputs]
            residual = G.ggml_get_rows(c, residual, out_ids)                    # [n_embd, n_outputs]
        cur = G.ggml_add(c, cur, residual)                                      # [n_embd, n]
        residual = cur
        cur = nm(_rms_norm(c, nm, cur, lw.ffn_norm, eps, il), "ffn_norm", il)
        cur = nm(G.ggml_mul_mat(c, lw.ffn_up, cur), "ffn_up", il)             # [2*n_ff, n]
        cur = nm(G.ggml_swiglu(c, cur), "ffn_swiglu", il)                      # [n_ff, n]
        cur = nm(G.ggml_mul_mat(c, lw.ffn_down, cur), "ffn_out", il)          # [n_embd, n]
        inp_l = nm(G.ggml_add(c, residual, cur), "l_out", il)                 # [n_embd, n]

    cur = nm(_rms_norm(c, nm, inp_l, model.output_norm, eps, -1), "result_norm")  # [n_embd, n_outputs]
    logits = nm(G.ggml_mul_mat(c, model.output, cur), "result_output")         # [n_vocab, n_outputs]
    G.ggml_set_output(logits)
    graph.expand(logits)
    return DecoderGraph(key, graph, tokens, embd, pos, out_ids, k_idxs, v_idxs, kq_mask, logits)


def _self_attention(ctx: G.Context, graph: G.Graph, model: Any, cparams: Any, mctx: Any, il: int, cur: Any,
                    inputs: tuple[Any, Any, Any, Any], flash_attn: bool, fa_cast_f32_kv: bool) -> Any:
    """Q/K/V of layer il from the fused matrix, RoPE'd, stored and attended over the cache; [n_embd, n_tokens]
    before the output matrix.  ``inputs``: positions, k_idxs, v_idxs and the attention's mask."""
    hp, c, nm = model.hparams, ctx.ptr, ctx.node_namer()
    pos, k_idxs, v_idxs, mask = inputs
    d, n_tokens, e = hp.n_embd_head_k, G.ne(cur)[1], hp.n_embd
    n_head, n_head_kv, n_gqa = hp.n_head(il), hp.n_head_kv(il), hp.n_embd_k_gqa(il)
    qkv = nm(G.ggml_mul_mat(c, model.layers[il].wqkv, cur), "wqkv", il)    # [n_embd + 2*n_gqa, n_tokens]
    row, f32 = G.nb(qkv)[1], 4
    q = G.ggml_view_3d(c, qkv, d, n_head, n_tokens, d * f32, row, 0)                     # [d, n_head, n_tok]
    k = G.ggml_view_3d(c, qkv, d, n_head_kv, n_tokens, d * f32, row, f32 * e)             # [d, n_head_kv, n_tok]
    v = G.ggml_view_3d(c, qkv, d, n_head_kv, n_tokens, d * f32, row, f32 * (e + n_gqa))   # [d, n_head_kv, n_tok]
    rope = (G.addr(model.get_rope_factors(cparams, il)), hp.n_rot, int(hp.rope_type), cparams.n_ctx_orig_yarn,
            model.get_rope_freq_base(cparams, il), model.get_rope_freq_scale(cparams, il), cparams.yarn_ext_factor,
            cparams.yarn_attn_factor, cparams.yarn_beta_fast, cparams.yarn_beta_slow)
    q = nm(G.ggml_rope_ext(c, q, pos, *rope), "Qcur", il)
    k = nm(G.ggml_rope_ext(c, k, pos, *rope), "Kcur", il)
    nm(v, "Vcur", il)
    q = nm(G.ggml_scale(c, q, float(np.float32(1.0) / np.sqrt(np.float32(d)))), "Qcur", il)
    # as build_attn: q, v, k first, then the stores into the cache
    graph.expand(q)
    graph.expand(v)
    graph.expand(k)
    graph.expand(mctx.cpy_k(ctx, k, k_idxs, il))
    graph.expand(mctx.cpy_v(ctx, v, v_idxs, il))
    k_all = mctx.get_k(ctx, il)        # [d, n_head_kv, n_kv, ns]
    v_all = mctx.get_v(ctx, il)        # [d, n_head_kv, n_kv, ns] or transposed [n_kv, n_head_kv, d, ns]
    cur = _attention(c, nm, q, k_all, v_all, mask, 1.0, flash_attn, fa_cast_f32_kv, il)  # [d*n_head, n_tokens]
    graph.expand(nm(cur, "kqv_out", il))
    return cur


# how the runtime serves Phi-3 (kvcache_ggml.runtime.arch's registry): one KVCache, the graph above, llama's inputs
RUNTIME = ArchRuntime(Phi3Model, create_memory, graph_capacity, graph_key, build_phi3, set_inputs)
