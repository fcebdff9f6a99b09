"""Gemma 2 and Gemma 3: llama.cpp's ``llm_build_gemma2_iswa`` / ``llm_build_gemma3`` over :class:`KVCacheISWA`.

What differs from the llama graph (:mod:`kvcache_ggml.runtime.graph`):

- the token embeddings are scaled by ``sqrtf(n_embd)``;
- layers alternate between a sliding window and full attention (``{arch}.attention.sliding_window`` and the
  pattern period ``{arch}.attention.sliding_window_pattern``: Gemma 2 defaults to a window of 4096 every other
  layer, Gemma 3 to every layer but each 6th when the window key is present); the SWA layers use their own RoPE
  base (``{arch}.rope.freq_base_swa``) and the NEOX RoPE;
- Gemma 3 RMS-normalizes each Q and K head (``attn_q_norm``, ``attn_k_norm``) before RoPE;
- Q is multiplied by ``f_attention_scale`` (1/sqrt(head size), or 1/sqrt(n_embd/n_head) for the 27B models) and
  the attention's own scale is 1;
- Gemma 2 caps the attention logits, ``c*tanh(x/c)`` with ``{arch}.attn_logit_softcapping`` (50), and the output
  logits with ``{arch}.final_logit_softcapping`` (30); Gemma 3 caps the output only when the key is present;
- the attention output and the FFN output are RMS-normalized again (``post_attention_norm``, ``post_ffw_norm``)
  before their residual adds; the FFN is GELU-gated (``ggml_geglu_split``).

The memory is a :class:`~kvcache_ggml.cache.iswa.KVCacheISWA` when the model has SWA layers (a plain KVCache for a
Gemma 3 without a window); the graph then has two sets of K/V index and kq-mask inputs, one per cache, and each
layer reads and writes the cache that holds it.  Float constants are computed in float32 as llama.cpp does.
"""
from __future__ import annotations

from dataclasses import dataclass
from os import PathLike
from typing import Any, NamedTuple

import numpy as np

from .. import ggml as G
from .._gguf import read_kv
from ..cache import KVCache, KVCacheParams
from ..cache.iswa import KVCacheISWA, KVCacheISWAContext, KVCacheISWAParams
from ..hparams import HParams, RopeType, SwaType
from .arch import ArchRuntime
from .graph import _F16, _F32, DecoderGraph, _attention, _rms_norm, build_token_inputs, set_inputs
from .model import Model

__all__ = ["GemmaParams", "GemmaModel", "GemmaLayer", "GemmaShape", "ISWAGraphKey", "ISWAGraph", "create_memory",
           "graph_capacity", "graph_key", "build_gemma", "set_gemma_inputs", "GEMMA_ARCHS", "RUNTIME"]

GEMMA_ARCHS = ("gemma2", "gemma3")
_NODES_PER_LAYER = 80    # an upper bound of the tensors one Gemma layer creates (about 60 without flash attention)
_NODES_FIXED = 96        # inputs of both caches, embeddings, output head and soft-capping
_LLM_TYPE_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # n_layer of the 27B models (another attention scale)


def _f32(x: float) -> float:
    return float(np.float32(x))


@dataclass(slots=True)
class GemmaParams:
    """The Gemma hyper-parameters beyond :class:`~kvcache_ggml.hparams.HParams` (llama.cpp's hparams loading)."""

    arch: str                   # "gemma2" or "gemma3"
    embd_scale: float           # sqrtf(n_embd): the token embeddings are multiplied by it
    attention_scale: float      # f_attention_scale: Q is multiplied by it (the kq scale is 1)
    attn_softcap: float         # attention logits -> c*tanh(logits/c) with this c (Gemma 2); 0: none
    final_softcap: float        # output logits capped the same way; 0: none
    qk_norm: bool               # Q and K heads RMS-normalized before RoPE (Gemma 3)
    rope_freq_base_swa: float   # RoPE base of the SWA layers
    rope_freq_scale_swa: float  # RoPE scale of the SWA layers

    @classmethod
    def resolve(cls, kv: dict[str, Any], hp: HParams) -> "GemmaParams":
        """Read the Gemma keys of a GGUF header and set ``hp``'s sliding-window fields as llama.cpp does."""
        arch = hp.arch
        if arch not in GEMMA_ARCHS:
            raise ValueError(f"architecture {arch!r} is not a Gemma ({', '.join(GEMMA_ARCHS)})")
        a = f"{arch}."
        window = kv.get(a + "attention.sliding_window")
        pattern = kv.get(a + "attention.sliding_window_pattern")
        period = int(pattern) if isinstance(pattern, (int, np.integer)) else None  # an array: the default period
        swa_base = kv.get(a + "rope.freq_base_swa")
        if arch == "gemma2":
            hp.n_swa = int(window) if window is not None else 4096
            hp.swa_type = SwaType.STANDARD
            hp.set_swa_pattern(period if period is not None else 2)
            base_swa = float(swa_base) if swa_base is not None else hp.rope_freq_base_train
            scale_swa = hp.rope_freq_scale_train
            attn_cap = float(kv.get(a + "attn_logit_softcapping", 50.0))
            final_cap = float(kv.get(a + "final_logit_softcapping", 30.0))
        else:
            if window is not None and int(window) > 0:
                hp.n_swa, hp.swa_type = int(window), SwaType.STANDARD
                hp.set_swa_pattern(period if period is not None else 6)
            else:
                hp.n_swa, hp.swa_type = 0, SwaType.NONE
                hp.swa_layers = (False,) * hp.n_layer
            base_swa = float(swa_base) if swa_base is not None else 10000.0  # llama_hparams' default
            scale_swa = 1.0
            attn_cap = 0.0
            final_cap = float(kv.get(a + "final_logit_softcapping", 0.0))
        if hp.n_layer == _LLM_TYPE_27B_LAYERS[arch]:
            scale = np.float32(1.0) / np.sqrt(np.float32(hp.n_embd // hp.n_head(0)))
        else:
            scale = np.float32(1.0) / np.sqrt(np.float32(hp.n_embd_head_k))
        return cls(arch=arch, embd_scale=float(np.sqrt(np.float32(hp.n_embd))), attention_scale=float(scale),
                   attn_softcap=_f32(attn_cap), final_softcap=_f32(final_cap), qk_norm=arch == "gemma3",
                   rope_freq_base_swa=_f32(base_swa), rope_freq_scale_swa=_f32(scale_swa))


@dataclass(slots=True)
class GemmaLayer:
    """The tensors a Gemma layer has beyond llama's (ggml ``ne`` order)."""

    post_attention_norm: Any   # F32 [n_embd]
    post_ffw_norm: Any         # F32 [n_embd]
    attn_q_norm: Any           # F32 [n_embd_head_k] (Gemma 3) or None
    attn_k_norm: Any           # F32 [n_embd_head_k] (Gemma 3) or None


class GemmaModel(Model):
    """A Gemma 2 / Gemma 3 GGUF: the llama tensors plus the post-norms (and Q/K norms), :class:`GemmaParams`."""

    ARCHS = GEMMA_ARCHS
    ROPE_TYPE = RopeType.NEOX

    def __init__(self, path: str | PathLike, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        try:
            self.gemma = GemmaParams.resolve(read_kv(self.path), self.hparams)
            t = self.tensors
            self.gemma_layers = [GemmaLayer(*(t.get(f"blk.{il}.{n}.weight") for n in (
                "post_attention_norm", "post_ffw_norm", "attn_q_norm", "attn_k_norm")))
                for il in range(self.hparams.n_layer)]
            self._check_gemma_shapes()
        except BaseException:
            self.close()
            raise

    def extra_layer_tensors(self) -> tuple[str, ...]:
        extra = ("post_attention_norm", "post_ffw_norm")
        return extra + ("attn_q_norm", "attn_k_norm") if self.hparams.arch == "gemma3" else extra

    def _check_gemma_shapes(self) -> None:
        hp = self.hparams
        for il, gl in enumerate(self.gemma_layers):
            want = {"post_attention_norm": (gl.post_attention_norm, hp.n_embd),
                    "post_ffw_norm": (gl.post_ffw_norm, hp.n_embd)}
            if self.gemma.qk_norm:
                want.update(attn_q_norm=(gl.attn_q_norm, hp.n_embd_head_k), attn_k_norm=(gl.attn_k_norm,
                                                                                        hp.n_embd_head_k))
            for name, (t, n) in want.items():
                if G.ne(t) != (n, 1, 1, 1):
                    raise ValueError(f"{self.path}: tensor blk.{il}.{name}.weight has ne {G.ne(t)}, expected ({n},)")

    def get_rope_freq_base(self, cparams: Any, il: int) -> float:
        return self.gemma.rope_freq_base_swa if self.hparams.is_swa(il) else float(cparams.rope_freq_base)

    def get_rope_freq_scale(self, cparams: Any, il: int) -> float:
        return self.gemma.rope_freq_scale_swa if self.hparams.is_swa(il) else float(cparams.rope_freq_scale)

    def close(self) -> None:
        super().close()
        self.gemma_layers = []


class GemmaShape:
    """The hyper-parameters of a Gemma GGUF as llama.cpp loads them, without weights: what a
    :class:`~kvcache_ggml.cache.iswa.KVCacheISWA` needs of a model (every layer on the CPU)."""

    def __init__(self, path: str | PathLike) -> None:
        self.hparams = HParams.from_gguf(path)
        self.gemma = GemmaParams.resolve(read_kv(path), self.hparams)

    def dev_layer(self, il: int) -> None:
        return None


# ====================================================================================================== memory

def create_memory(model: Any, params: KVCacheParams, n_ubatch: int, swa_full: bool) -> KVCache | KVCacheISWA:
    """llama_model::create_memory: the iSWA pair for a model with SWA layers, else one KVCache."""
    hp = model.hparams
    if SwaType(hp.swa_type) == SwaType.NONE:
        return KVCache(model, params)
    return KVCacheISWA(model, KVCacheISWAParams(
        type_k=params.type_k, type_v=params.type_v, v_trans=params.v_trans, offload=params.offload,
        swa_full=swa_full, unified=params.unified, kv_size=params.kv_size, n_seq_max=params.n_seq_max,
        n_ubatch=n_ubatch, n_pad=params.n_pad, filter=params.filter, reuse=params.reuse))


def _caches(mctx: Any) -> tuple[Any, Any]:
    """(base context, SWA context) of an iSWA context; a plain cache's context twice."""
    if isinstance(mctx, KVCacheISWAContext):
        return mctx.get_base(), mctx.get_swa()
    return mctx, mctx


# ====================================================================================================== graph

class ISWAGraphKey(NamedTuple):
    """Everything a Gemma graph's topology depends on (both caches' n_kv)."""

    n_tokens: int      # tokens of the ubatch
    n_outputs: int     # output tokens of the ubatch
    n_kv: int          # cells the attention of the non-SWA layers reads
    n_kv_swa: int      # cells the attention of the SWA layers reads
    n_stream: int      # streams of the kq masks (1 with a unified cache, else the ubatch's sequences)
    s0: int            # first cache stream of the slot
    s1: int            # last cache stream of the slot
    embd_input: bool   # the ubatch carries embeddings rather than token ids


@dataclass(slots=True)
class ISWAGraph(DecoderGraph):
    """A decoder graph with the SWA cache's inputs too (the base cache's are DecoderGraph's)."""

    k_idxs_swa: Any = None     # I64 [n_tokens] SWA cache row of each token's K (None: one cache)
    v_idxs_swa: Any = None     # I64 [n_tokens(*n_embd_v_gqa)] destinations of V in the SWA cache
    kq_mask_swa: Any = None    # F32 [n_kv_swa, n_tokens/n_stream, 1, n_stream]


def graph_capacity(n_layer: int) -> int:
    return _NODES_PER_LAYER * n_layer + _NODES_FIXED


def graph_key(mctx: Any, ubatch: Any, n_outputs: int, kv_unified: bool) -> ISWAGraphKey:
    base, swa = _caches(mctx)
    sinfo = base.get_sinfo()
    return ISWAGraphKey(ubatch.n_tokens, n_outputs, base.get_n_kv(), swa.get_n_kv(),
                        1 if kv_unified else ubatch.n_seqs_unq, sinfo.s0, sinfo.s1, ubatch.token is None)


def _softcap(c: int, x: Any, cap: float) -> Any:
    """cap * tanh(x / cap), with 1/cap in float32 as llama.cpp computes it."""
    x = G.ggml_scale(c, x, _f32(np.float32(1.0) / np.float32(cap)))
    return G.ggml_scale(c, G.ggml_tanh(c, x), cap)


def _cache_inputs(ctx: G.Context, cctx: Any, ubatch: Any, n_kv: int, key: ISWAGraphKey, tag: str,
                  flash_attn: bool) -> tuple[Any, Any, Any, Any]:
    """k_idxs, v_idxs, the kq mask and the mask the attention takes (F16 for flash attention) of one cache."""
    k_idxs = cctx.build_input_k_idxs(ctx, ubatch)                              # I64 [n_tokens]
    v_idxs = cctx.build_input_v_idxs(ctx, ubatch)                              # I64 [n_tokens(*n_embd_v_gqa)]
    G.set_name(k_idxs, "inp_k_idxs" + tag)
    G.set_name(v_idxs, "inp_v_idxs" + tag)
    mask = G.new_tensor(ctx.ptr, _F32, (n_kv, key.n_tokens // key.n_stream, 1, key.n_stream))
    G.ggml_set_input(mask)                                                     # [n_kv, n_tps, 1, n_stream]
    cast = G.ggml_cast(ctx.ptr, mask, _F16) if flash_attn else mask
    G.set_name(mask, "self_kq_mask" + tag)  # after the cast, as llama.cpp names it: the cast node is " (copy)"
    return k_idxs, v_idxs, mask, cast


def build_gemma(ctx: G.Context, model: Any, cparams: Any, mctx: Any, ubatch: Any, key: ISWAGraphKey, *,
                flash_attn: bool, fa_cast_f32_kv: bool = False) -> ISWAGraph:
    """Build the Gemma graph of ``ubatch`` (after ``mctx.apply()``) in ``ctx``; ``key`` from :func:`graph_key`."""
    hp, gp = model.hparams, model.gemma
    c, nm = ctx.ptr, ctx.node_namer()
    eps = hp.f_norm_rms_eps
    tokens, embd, inp_l, pos, out_ids = build_token_inputs(c, nm, model, key)
    # Gemma 3 scales token embeddings only (not embeddings given as input)
    scale = 1.0 if key.embd_input and gp.arch == "gemma3" else gp.embd_scale
    inp_l = nm(G.ggml_scale(c, inp_l, scale), "inp_scaled")
    base, swa = _caches(mctx)
    k_idxs, v_idxs, kq_mask, mask = _cache_inputs(ctx, base, ubatch, key.n_kv, key, "", flash_attn)
    k_idxs_swa = v_idxs_swa = kq_mask_swa = None
    mask_swa = mask
    if swa is not base:
        k_idxs_swa, v_idxs_swa, kq_mask_swa, mask_swa = _cache_inputs(ctx, swa, ubatch, key.n_kv_swa, key, "_swa",
                                                                      flash_attn)

    graph = G.Graph(ctx, graph_capacity(hp.n_layer))
    for il in range(hp.n_layer):
        lw, gl = model.layers[il], model.gemma_layers[il]
        is_swa = swa is not base and hp.is_swa(il)
        cur = nm(_rms_norm(c, nm, inp_l, lw.attn_norm, eps, il), "attn_norm", il)  # [n_embd, n_tokens]
        cur = _self_attention(ctx, graph, model, cparams, il, cur, pos, swa if is_swa else base,
                              (k_idxs_swa, v_idxs_swa, mask_swa) if is_swa else (k_idxs, v_idxs, mask),
                              flash_attn, fa_cast_f32_kv)                      # [d*n_head, n_tokens]
        cur = nm(G.ggml_mul_mat(c, lw.wo, cur), "attn_out", il)               # [n_embd, n_tokens]
        if il == hp.n_layer - 1:
            cur = G.ggml_get_rows(c, cur, out_ids)                              # [n_embd, n_outputs]
            inp_l = G.ggml_get_rows(c, inp_l, out_ids)                          # [n_embd, n_outputs]
        cur = nm(_rms_norm(c, nm, cur, gl.post_attention_norm, eps, il), "attn_post_norm", il)
        sa_out = nm(G.ggml_add(c, cur, inp_l), "sa_out", il)                   # [n_embd, n]
        cur = nm(_rms_norm(c, nm, sa_out, lw.ffn_norm, eps, il), "ffn_norm", il)
        up = G.ggml_mul_mat(c, lw.ffn_up, cur)                                  # [n_ff, n]
        gate = G.ggml_mul_mat(c, lw.ffn_gate, cur)                              # [n_ff, n]
        cur = nm(G.ggml_mul_mat(c, lw.ffn_down, G.ggml_geglu_split(c, gate, up)), "ffn_out", il)  # [n_embd, n]
        cur = nm(_rms_norm(c, nm, cur, gl.post_ffw_norm, eps, -1), "ffn_post_norm")
        inp_l = nm(G.ggml_add(c, cur, sa_out), "l_out", il)                   # [n_embd, n]

    cur = nm(_rms_norm(c, nm, inp_l, model.output_norm, eps, -1), "result_norm")  # [n_embd, n_outputs]
    logits = G.ggml_mul_mat(c, model.output, cur)                               # [n_vocab, n_outputs]
    if gp.final_softcap:
        logits = _softcap(c, logits, gp.final_softcap)
    G.set_name(logits, "result_output")
    G.ggml_set_output(logits)
    graph.expand(logits)
    return ISWAGraph(key, graph, tokens, embd, pos, out_ids, k_idxs, v_idxs, kq_mask, logits,
                     k_idxs_swa=k_idxs_swa, v_idxs_swa=v_idxs_swa, kq_mask_swa=kq_mask_swa)


def _self_attention(ctx: G.Context, graph: G.Graph, model: Any, cparams: Any, il: int, cur: Any, pos: Any,
                    cctx: Any, inputs: tuple[Any, Any, Any], flash_attn: bool, fa_cast_f32_kv: bool) -> Any:
    """Q/K/V of layer il from cur [n_embd, n_tokens], stored into and attended over the cache of context
    ``cctx`` (``inputs``: its k_idxs, v_idxs and attention mask); [d*n_head, n_tokens] before the output matrix."""
    hp, gp, c, nm = model.hparams, model.gemma, ctx.ptr, ctx.node_namer()
    lw, gl = model.layers[il], model.gemma_layers[il]
    d, n_tokens, eps = hp.n_embd_head_k, G.ne(cur)[1], hp.f_norm_rms_eps
    k_idxs, v_idxs, mask = inputs
    q = G.ggml_reshape_3d(c, G.ggml_mul_mat(c, lw.wq, cur), d, hp.n_head(il), n_tokens)     # [d, n_head, n_tok]
    k = G.ggml_reshape_3d(c, G.ggml_mul_mat(c, lw.wk, cur), d, hp.n_head_kv(il), n_tokens)  # [d, n_head_kv, n_tok]
    v = G.ggml_reshape_3d(c, G.ggml_mul_mat(c, lw.wv, cur), d, hp.n_head_kv(il), n_tokens)  # [d, n_head_kv, n_tok]
    # (no frequency factors: a NULL tensor, 0 as the binding layer passes it)
    rope = (0, hp.n_rot, int(hp.rope_type), cparams.n_ctx_orig_yarn, model.get_rope_freq_base(cparams, il),
            model.get_rope_freq_scale(cparams, il), cparams.yarn_ext_factor, cparams.yarn_attn_factor,
            cparams.yarn_beta_fast, cparams.yarn_beta_slow)
    if gp.qk_norm:
        q = nm(_rms_norm(c, nm, q, gl.attn_q_norm, eps, il), "Qcur_normed", il)  # [d, n_head, n_tokens]
    q = nm(G.ggml_rope_ext(c, q, pos, *rope), "Qcur", il)
    if gp.qk_norm:
        k = nm(_rms_norm(c, nm, k, gl.attn_k_norm, eps, il), "Kcur_normed", il)  # [d, n_head_kv, n_tokens]
    k = nm(G.ggml_rope_ext(c, k, pos, *rope), "Kcur", il)
    q = G.ggml_scale(c, q, gp.attention_scale)
    # as build_attn with iSWA inputs: q, k, v first, then the stores into this layer's cache
    graph.expand(q)
    graph.expand(k)
    graph.expand(v)
    graph.expand(cctx.cpy_k(ctx, k, k_idxs, il))
    graph.expand(cctx.cpy_v(ctx, v, v_idxs, il))
    k_all = cctx.get_k(ctx, il)        # [d, n_head_kv, n_kv, ns]
    v_all = cctx.get_v(ctx, il)        # [d, n_head_kv, n_kv, ns] or transposed [n_kv, n_head_kv, d, ns]
    cur = _attention(c, nm, q, k_all, v_all, mask, 1.0, flash_attn, fa_cast_f32_kv, il, softcap=gp.attn_softcap)
    graph.expand(nm(cur, "kqv_out", il))
    return cur


def set_gemma_inputs(g: ISWAGraph, mctx: Any, ubatch: Any, causal_attn: bool = True) -> None:
    """Fill the inputs of a Gemma graph: tokens, positions, outputs and the base cache's (as the llama graph),
    then the SWA cache's."""
    base, swa = _caches(mctx)
    set_inputs(g, base, ubatch, causal_attn)
    if swa is not base:
        swa.set_input_k_idxs(g.k_idxs_swa, ubatch)
        swa.set_input_v_idxs(g.v_idxs_swa, ubatch)
        swa.set_input_kq_mask(g.kq_mask_swa, ubatch, causal_attn)


# how the runtime serves Gemma 2 and 3 (kvcache_ggml.runtime.arch's registry): the iSWA pair, the graph above
RUNTIME = ArchRuntime(GemmaModel, create_memory, graph_capacity, graph_key, build_gemma, set_gemma_inputs, iswa=True)
