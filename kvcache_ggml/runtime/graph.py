"""The decoder graph of one ubatch: llama.cpp's ``llm_build_llama`` with the KV cache inputs of ``build_attn``.

:func:`build_decoder` builds, in a caller's no_alloc context, embeddings -> per layer (RMS norm, Q/K/V, RoPE, store
K/V into the cache, attention over the cache with the kq mask, output projection, SwiGLU FFN) -> output norm and
head for the output tokens only.  :func:`set_inputs` fills the graph's inputs for a ubatch.  Shapes are in ggml
``ne`` order.  The topology depends only on :class:`GraphKey`, so a graph can be computed again for the next
ubatch with the same key after :func:`set_inputs` (llama.cpp's graph reuse).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from .. import ggml as G

__all__ = ["GraphKey", "DecoderGraph", "graph_key", "build_decoder", "build_token_inputs", "set_inputs",
           "graph_capacity"]

_F32, _F16, _I32 = G.GGMLType.F32, G.GGMLType.F16, G.GGMLType.I32
_GGML_PREC_F32 = 10      # enum ggml_prec: GGML_PREC_F32
_NODES_PER_LAYER = 64    # an upper bound of the tensors one layer creates (about 45 with flash attention off)
_NODES_FIXED = 64        # inputs, embeddings, output head


class GraphKey(NamedTuple):
    """Everything the graph's topology depends on; equal keys -> the same graph serves both ubatches."""

    n_tokens: int      # tokens of the ubatch
    n_outputs: int     # output tokens of the ubatch
    n_kv: int          # cache cells the attention reads
    n_stream: int      # streams of the kq mask (1 with a unified cache, else the ubatch's sequences)
    s0: int            # first cache stream of the slot
    s1: int            # last cache stream of the slot
    embd_input: bool   # the ubatch carries embeddings rather than token ids


@dataclass(slots=True)
class DecoderGraph:
    """A built graph, its input / output tensors and, once allocated, numpy views of the small ones."""

    key: GraphKey         # what the topology was built for
    graph: G.Graph        # in the caller's context
    tokens: Any           # I32 [n_tokens] token ids (None with embeddings input)
    embd: Any             # F32 [n_embd, n_tokens] input embeddings (None with token input)
    pos: Any              # I32 [n_tokens] positions
    out_ids: Any          # I32 [n_outputs] ubatch rows of the output tokens
    k_idxs: Any           # I64 [n_tokens] cache row of each token's K
    v_idxs: Any           # I64 [n_tokens] (or [n_tokens*n_embd_v_gqa] with a transposed V) destinations of V
    kq_mask: Any          # F32 [n_kv, n_tokens/n_stream, 1, n_stream]
    logits: Any           # F32 [n_vocab, n_outputs]
    tokens_h: np.ndarray | None = None   # int32 [n_tokens] host view of tokens (None: none, or not host memory)
    embd_h: np.ndarray | None = None     # float32 [n_tokens*n_embd] host view of embd
    pos_h: np.ndarray | None = None      # int32 [n_tokens] host view of pos
    out_ids_h: np.ndarray | None = None  # int32 [n_outputs] host view of out_ids
    logits_h: np.ndarray | None = None   # float32 [n_outputs, n_vocab] host view of the logits
    out_rows: np.ndarray | None = None   # int32 [n_outputs] 0..n_outputs-1: out_ids when every token is an output
    kv_views: tuple | None = None        # the memory context's input_views of k_idxs, v_idxs, kq_mask (first fill)
    sched: int = 0                       # the ggml_backend_sched_t it is allocated in (0: not yet)

    def map_inputs(self) -> None:
        """After the scheduler allocated the graph (its tensors keep their memory while the graph is reused):
        numpy views of the token/embd/pos/out_ids inputs and of the logits in host memory (None for a tensor
        that is absent, empty or not in a host buffer: set_inputs then copies with ggml_backend_tensor_set and
        read_logits with ggml_backend_tensor_get)."""
        self.tokens_h, self.embd_h, self.pos_h, self.out_ids_h = (
            _host_view(t) for t in (self.tokens, self.embd, self.pos, self.out_ids))
        view = _host_view(self.logits)
        self.logits_h = None if view is None else view.reshape(self.key.n_outputs, -1)
        n_out = self.key.n_outputs
        self.out_rows = np.arange(n_out, dtype=np.int32) if n_out == self.key.n_tokens else None

    def read_logits(self, dst: np.ndarray) -> None:
        """Copy the logits into ``dst``, float32 C-contiguous [n_outputs, n_vocab] (after the compute)."""
        if self.logits_h is not None:
            dst[...] = self.logits_h  # (a slice assignment: no np.copyto dispatch)
        else:
            G.get_into(self.logits, dst)


def _host_view(t: Any) -> np.ndarray | None:
    return None if t is None else G.host_flat(t)


def graph_capacity(n_layer: int) -> int:
    """Tensors (and graph nodes) one decoder graph may need."""
    return _NODES_PER_LAYER * n_layer + _NODES_FIXED


def graph_key(mctx: Any, ubatch: Any, n_outputs: int, kv_unified: bool) -> GraphKey:
    sinfo = mctx.get_sinfo()
    return GraphKey(ubatch.n_tokens, n_outputs, mctx.get_n_kv(), 1 if kv_unified else ubatch.n_seqs_unq,
                    sinfo.s0, sinfo.s1, ubatch.token is None)


def _rms_norm(c: int, nm: Any, x: Any, weight: Any, eps: float, il: int) -> Any:
    """x [n, m] normalized over ne0 and scaled by weight [n] (build_norm: "norm", then the caller's name)."""
    return G.ggml_mul(c, nm(G.ggml_rms_norm(c, x, eps), "norm", il), weight)


def _new_input(c: int, type_: Any, ne: tuple[int, ...], name: str) -> Any:
    t = G.new_tensor(c, type_, ne, name)
    G.ggml_set_input(t)
    return t


def build_token_inputs(c: int, nm: Any, model: Any, key: Any) -> tuple[Any, Any, Any, Any, Any]:
    """The ubatch's inputs: tokens (or embeddings), positions and output rows; and the embeddings they give.

    Returns (tokens I32 [n_tokens] or None, embd F32 [n_embd, n_tokens] or None, the embeddings F32
    [n_embd, n_tokens], pos I32 [n_tokens], out_ids I32 [n_outputs]).
    """
    n_tokens = key.n_tokens
    tokens = embd = None
    if key.embd_input:
        embd = _new_input(c, _F32, (model.hparams.n_embd, n_tokens), "inp_embd")  # [n_embd, n_tokens]
        inp_l = embd
    else:
        tokens = _new_input(c, _I32, (n_tokens,), "inp_tokens")                # [n_tokens]
        inp_l = nm(G.ggml_get_rows(c, model.tok_embd, tokens), "embd")        # [n_embd, n_tokens] F32
    pos = _new_input(c, _I32, (n_tokens,), "inp_pos")                          # [n_tokens]
    out_ids = _new_input(c, _I32, (key.n_outputs,), "inp_out_ids")             # [n_outputs]
    return tokens, embd, inp_l, pos, out_ids


def build_decoder(ctx: G.Context, model: Any, cparams: Any, mctx: Any, ubatch: Any, key: GraphKey, *,
                  flash_attn: bool, fa_cast_f32_kv: bool = False) -> DecoderGraph:
    """Build the graph of ``ubatch`` (after ``mctx.apply()``) in ``ctx``; ``key`` from :func:`graph_key`."""
    hp = model.hparams
    c, nm = ctx.ptr, ctx.node_namer()
    n_tokens = key.n_tokens
    d = hp.n_embd_head_k
    kq_scale = 1.0 / math.sqrt(float(d))

    tokens, embd, inp_l, pos, out_ids = build_token_inputs(c, nm, model, key)
    k_idxs = mctx.build_input_k_idxs(ctx, ubatch)                              # I64 [n_tokens]
    v_idxs = mctx.build_input_v_idxs(ctx, ubatch)                              # I64 [n_tokens(*n_embd_v_gqa)]
    G.set_name(k_idxs, "inp_k_idxs")
    G.set_name(v_idxs, "inp_v_idxs")
    kq_mask = _new_input(c, _F32, (key.n_kv, n_tokens // key.n_stream, 1, key.n_stream), "")
    mask = G.ggml_cast(c, kq_mask, _F16) if flash_attn else kq_mask          # flash attention takes an F16 mask
    G.set_name(kq_mask, "inp_kq_mask")  # after the cast, as llama.cpp names it: the cast node is " (copy)"

    graph = G.Graph(ctx, graph_capacity(hp.n_layer))
    for il in range(hp.n_layer):
        lw = model.layers[il]
        n_head, n_head_kv = hp.n_head(il), hp.n_head_kv(il)
        inp_sa = inp_l
        cur = nm(_rms_norm(c, nm, inp_l, lw.attn_norm, hp.f_norm_rms_eps, il), "attn_norm", il)  # [n_embd, n_tok]

        rope = (G.addr(model.get_rope_factors(cparams, il)), hp.n_rot, int(hp.rope_type), cparams.n_ctx_orig_yarn,
                model.get_rope_freq_base(cparams, il), model.get_rope_freq_scale(cparams, il),
                cparams.yarn_ext_factor, cparams.yarn_attn_factor, cparams.yarn_beta_fast, cparams.yarn_beta_slow)
        q, k, v = _qkv(c, nm, lw, cur, pos, rope, (d, n_head, n_head_kv), hp.f_norm_rms_eps, il)

        # as build_attn: q, v, k first (keeps the graph's order), then the stores into the cache
        graph.expand(q)
        graph.expand(v)
        graph.expand(k)
        graph.expand(mctx.cpy_k(ctx, k, k_idxs, il))
        graph.expand(mctx.cpy_v(ctx, v, v_idxs, il))
        k_all = mctx.get_k(ctx, il)        # [d, n_head_kv, n_kv, ns]
        v_all = mctx.get_v(ctx, il)        # [d, n_head_kv, n_kv, ns] or transposed [n_kv, n_head_kv, d, ns]
        cur = _attention(c, nm, q, k_all, v_all, mask, kq_scale, flash_attn, fa_cast_f32_kv, il)  # [d*n_head, n_tok]
        graph.expand(nm(cur, "kqv_out", il))
        cur = G.ggml_mul_mat(c, lw.wo, cur)                                    # [n_embd, n_tokens]
        if model.NAMES_ATTN_OUT:
            nm(cur, "attn_out", il)

        if il == hp.n_layer - 1:
            cur = G.ggml_get_rows(c, cur, out_ids)                              # [n_embd, n_outputs]
            inp_sa = G.ggml_get_rows(c, inp_sa, out_ids)                        # [n_embd, n_outputs]
        ffn_inp = nm(G.ggml_add(c, cur, inp_sa), "ffn_inp", il)                # [n_embd, n]
        cur = nm(_rms_norm(c, nm, ffn_inp, lw.ffn_norm, hp.f_norm_rms_eps, il), "ffn_norm", il)
        up = nm(G.ggml_mul_mat(c, lw.ffn_up, cur), "ffn_up", il)               # [n_ff, n]
        gate = nm(G.ggml_mul_mat(c, lw.ffn_gate, cur), "ffn_gate", il)         # [n_ff, n]
        cur = nm(G.ggml_swiglu_split(c, gate, up), "ffn_swiglu", il)           # [n_ff, n]
        cur = nm(G.ggml_mul_mat(c, lw.ffn_down, cur), "ffn_out", il)           # [n_embd, n]
        inp_l = nm(G.ggml_add(c, cur, ffn_inp), "l_out", il)                   # [n_embd, n]

    cur = nm(_rms_norm(c, nm, inp_l, model.output_norm, hp.f_norm_rms_eps, -1), "result_norm")  # [n_embd, n_out]
    logits = nm(G.ggml_mul_mat(c, model.output, cur), "result_output")         # [n_vocab, n_outputs]
    G.ggml_set_output(logits)
    graph.expand(logits)
    return DecoderGraph(key, graph, tokens, embd, pos, out_ids, k_idxs, v_idxs, kq_mask, logits)


def _qkv(c: int, nm: Any, lw: Any, cur: Any, pos: Any, rope: tuple, heads: tuple[int, int, int], eps: float,
         il: int) -> tuple[Any, Any, Any]:
    """Q, K and V of one layer from cur [n_embd, n_tokens], RoPE'd: the projections, their biases when the layer
    has them (Qwen2; llm_build_llama's optional ones), the RMS norm of every Q and K head when the layer has one
    (Qwen3: before RoPE), as llm_build_llama / _qwen2 / _qwen3 name their nodes.  ``heads``: (d, n_head,
    n_head_kv); ``rope``: ggml_rope_ext's arguments after the positions.  Returns q [d, n_head, n_tokens] and k, v
    [d, n_head_kv, n_tokens]."""
    d, n_head, n_head_kv = heads
    n_tokens = G.ne(cur)[1]
    out = []
    for w, b, name in ((lw.wq, lw.bq, "Qcur"), (lw.wk, lw.bk, "Kcur"), (lw.wv, lw.bv, "Vcur")):
        x = nm(G.ggml_mul_mat(c, w, cur), name, il)                            # [d*heads, n_tokens]
        if b is not None:
            x = nm(G.ggml_add(c, x, b), name, il)
        out.append(x)
    q = G.ggml_reshape_3d(c, out[0], d, n_head, n_tokens)                     # [d, n_head, n_tokens]
    k = G.ggml_reshape_3d(c, out[1], d, n_head_kv, n_tokens)                  # [d, n_head_kv, n_tokens]
    v = nm(G.ggml_reshape_3d(c, out[2], d, n_head_kv, n_tokens), "Vcur", il)  # [d, n_head_kv, n_tokens]
    if lw.attn_q_norm is not None:
        q = nm(_rms_norm(c, nm, q, lw.attn_q_norm, eps, il), "Qcur_normed", il)
    q = nm(G.ggml_rope_ext(c, q, pos, *rope), "Qcur", il)                      # [d, n_head, n_tokens]
    if lw.attn_k_norm is not None:
        k = nm(_rms_norm(c, nm, k, lw.attn_k_norm, eps, il), "Kcur_normed", il)
    k = nm(G.ggml_rope_ext(c, k, pos, *rope), "Kcur", il)                      # [d, n_head_kv, n_tokens]
    return q, k, v


def _attention(c: int, nm: Any, q: Any, k: Any, v: Any, mask: Any, kq_scale: float, flash_attn: bool,
               fa_cast_f32_kv: bool, il: int, softcap: float = 0.0) -> Any:
    """Multi-head attention of q [d, n_head, n_tokens] over the cache views k and v (build_attn_mha).

    ``softcap`` > 0 caps the logits as softcap*tanh(kq/softcap) before the softmax (Gemma 2).
    Returns [d*n_head, n_tokens] with the tokens of stream s at rows s*n_tps .. (s+1)*n_tps - 1.
    """
    v_trans = G.nb(v)[1] > G.nb(v)[2]
    ns = G.ne(k)[3]
    qne, qnb = G.ne(q), G.nb(q)
    # split the tokens into the streams: [d, n_head, n_tps, ns]
    q = G.ggml_view_4d(c, q, qne[0], qne[1], qne[2] // ns, ns, qnb[1], qnb[2], qnb[3] // ns, 0)
    q = G.ggml_permute(c, q, 0, 2, 1, 3)                                        # [d, n_tps, n_head, ns]
    k = G.ggml_permute(c, k, 0, 2, 1, 3)                                        # [d, n_kv, n_head_kv, ns]
    v = G.ggml_permute(c, v, 0, 2, 1, 3)   # [d, n_kv, n_head_kv, ns] or transposed [n_kv, d, n_head_kv, ns]

    if flash_attn:
        if v_trans:
            v = G.ggml_transpose(c, v)                                          # [d, n_kv, n_head_kv, ns]
        if fa_cast_f32_kv:  # llama.cpp casts an F32 K/V to F16 before flash attention
            if G.ttype(k) == _F32:
                k = G.ggml_cast(c, k, _F16)
            if G.ttype(v) == _F32:
                v = G.ggml_cast(c, v, _F16)
        cur = G.ggml_flash_attn_ext(c, q, k, v, mask, kq_scale, 0.0, softcap)   # [d, n_head, n_tps, ns]
        nm(cur, "__fattn__", il)
        G.ggml_flash_attn_ext_set_prec(cur, _GGML_PREC_F32)
        ne = G.ne(cur)
        return G.ggml_reshape_2d(c, cur, ne[0] * ne[1], ne[2] * ne[3])         # [d*n_head, n_tokens]

    kq = nm(G.ggml_mul_mat(c, k, q), "kq", il)                                 # [n_kv, n_tps, n_head, ns]
    G.ggml_mul_mat_set_prec(kq, _GGML_PREC_F32)
    if softcap:  # as llm_graph_context::build_attn_mha: kq/softcap, tanh, *softcap
        kq = nm(G.ggml_scale(c, kq, float(np.float32(1.0) / np.float32(softcap))), "kq_scaled_1", il)
        kq = nm(G.ggml_tanh(c, kq), "kq_tanh", il)
        kq = nm(G.ggml_scale(c, kq, softcap), "kq_scaled_2", il)
    kq = nm(G.ggml_soft_max_ext(c, kq, mask, kq_scale, 0.0), "kq_soft_max", il)  # [n_kv, n_tps, n_head, ns]
    if not v_trans:
        v = nm(G.ggml_cont(c, G.ggml_transpose(c, v)), "v_cont", il)           # [n_kv, d, n_head_kv, ns]
    kqv = nm(G.ggml_mul_mat(c, v, kq), "kqv", il)                              # [d, n_tps, n_head, ns]
    cur = G.ggml_permute(c, kqv, 0, 2, 1, 3)                                    # [d, n_head, n_tps, ns]
    ne = G.ne(cur)
    return G.ggml_cont_2d(c, cur, ne[0] * ne[1], ne[2] * ne[3])                 # [d*n_head, n_tokens]


def set_inputs(g: DecoderGraph, mctx: Any, ubatch: Any, causal_attn: bool = True) -> None:
    """Fill the graph's inputs for ``ubatch`` (the current ubatch of ``mctx``, applied)."""
    n_tokens = ubatch.n_tokens
    if g.tokens is not None:
        _put(g.tokens, g.tokens_h, ubatch.token)                                # [n_tokens]
    else:
        _put(g.embd, g.embd_h, ubatch.embd.reshape(-1))                          # [n_tokens*n_embd]
    _put(g.pos, g.pos_h, ubatch.pos if ubatch.n_pos == 1 else ubatch.pos[:n_tokens])
    if g.key.n_outputs:
        out = g.out_rows
        if out is None:
            out = np.flatnonzero(ubatch.output[:n_tokens]).astype(np.int32)
        _put(g.out_ids, g.out_ids_h, out)
    views = g.kv_views
    if views is None:  # checked once per graph: its tensors keep their memory while it is computed again
        views = g.kv_views = mctx.input_views(g.k_idxs, g.v_idxs, g.kq_mask, n_tokens)
    mctx.fill_inputs(views, ubatch, causal_attn)


def _put(t: Any, view: np.ndarray | None, data: np.ndarray) -> None:
    """Write data into input t: through its host view when there is one, else with G.set_tensor."""
    if view is not None:
        view[...] = data
    else:
        G.set_tensor(t, data)
