"""A numpy forward pass of a Gemma 2 / Gemma 3 GGUF in float64: the reference the Gemma graph is tested against.

No ggml.  :class:`GemmaReference` loads the weights as :class:`~kvcache_ggml.runtime.reference.Reference` does and
the Gemma hyper-parameters as :class:`~kvcache_ggml.runtime.gemma.GemmaParams` resolves them;
:meth:`GemmaReferenceCache.decode` appends tokens of one sequence and returns their logits.  Every cached token is
kept: a token at position ``p`` of a sliding-window layer sees the tokens at ``p - n_swa < p0 <= p`` (the window is
a mask here, not an eviction, so this describes what both of llama.cpp's caches together compute).

One deliberate non-float64 step: the GELU of the FFN goes through float16 as ggml's CPU kernel does (the input
rounded to float16, GELU of that, the result rounded to float16; 0 below -10 and the identity above 10), so that
the reference differs from ggml by rounding only, not by the table's float16 steps.
"""
from __future__ import annotations

from os import PathLike
from typing import Sequence

import numpy as np

from .._gguf import read_kv
from .gemma import GemmaParams
from .reference import Reference, new_tokens

__all__ = ["GemmaReference", "GemmaReferenceCache", "rope_neox", "gelu_ggml"]

_SQRT_2_OVER_PI = 0.79788456080286535587989211986876
_GELU_COEF_A = 0.044715


def rope_neox(x: np.ndarray, pos: np.ndarray, n_rot: int, freq_base: float, freq_scale: float = 1.0) -> np.ndarray:
    """RoPE, NEOX mode: dims (i, i + n_rot/2) of each head rotated by pos*scale*base^(-2i/n_rot).

    x: [n_tokens, n_head, head_dim] (ggml ne [head_dim, n_head, n_tokens]); pos: [n_tokens].
    """
    out = x.astype(np.float64, copy=True)
    half = n_rot // 2
    inv = freq_base ** (-np.arange(half) * 2.0 / n_rot)                  # [n_rot/2]
    theta = freq_scale * pos.astype(np.float64)[:, None] * inv[None, :]  # [n_tokens, n_rot/2]
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    x0, x1 = x[..., :half], x[..., half:n_rot]
    out[..., :half] = x0 * cos - x1 * sin
    out[..., half:n_rot] = x0 * sin + x1 * cos
    return out


def gelu_ggml(x: np.ndarray) -> np.ndarray:
    """ggml's CPU GELU (tanh form) through its float16 table; float64 in and out."""
    xh = x.astype(np.float16).astype(np.float64)
    y = 0.5 * xh * (1.0 + np.tanh(_SQRT_2_OVER_PI * xh * (1.0 + _GELU_COEF_A * xh * xh)))
    y = y.astype(np.float16).astype(np.float64)
    return np.where(x <= -10.0, 0.0, np.where(x >= 10.0, x, y))


class GemmaReference(Reference):
    """A Gemma GGUF as float64 numpy arrays, with its :class:`GemmaParams` (``forward`` as Reference's)."""

    def __init__(self, path: str | PathLike) -> None:
        super().__init__(path)
        self.gemma = GemmaParams.resolve(read_kv(path), self.hparams)

    def cache(self, *, freq_base: float | None = None, freq_scale: float = 1.0) -> "GemmaReferenceCache":
        """An empty float64 cache of one sequence (freq_base/scale: the full-attention layers' RoPE)."""
        return GemmaReferenceCache(self, self.hparams.rope_freq_base_train if freq_base is None else freq_base,
                                   freq_scale)


class GemmaReferenceCache:
    """Positions and, per layer, the RoPE'd K and the V of every token of one sequence, in float64."""

    def __init__(self, ref: GemmaReference, freq_base: float, freq_scale: float) -> None:
        hp = ref.hparams
        self.ref = ref
        self.freq_base = freq_base
        self.freq_scale = freq_scale
        self.pos = np.zeros(0, np.int64)                                                   # [n_cached]
        self.k = [np.zeros((0, hp.n_head_kv(il), hp.n_embd_head_k)) for il in range(hp.n_layer)]  # [n, n_kv, d]
        self.v = [np.zeros((0, hp.n_head_kv(il), hp.n_embd_head_v)) for il in range(hp.n_layer)]

    def __len__(self) -> int:
        return self.pos.shape[0]

    def _rope(self, x: np.ndarray, pos: np.ndarray, il: int) -> np.ndarray:
        hp, gp = self.ref.hparams, self.ref.gemma
        if hp.is_swa(il):
            return rope_neox(x, pos, hp.n_rot, gp.rope_freq_base_swa, gp.rope_freq_scale_swa)
        return rope_neox(x, pos, hp.n_rot, self.freq_base, self.freq_scale)

    def _attend(self, q: np.ndarray, il: int, visible: np.ndarray) -> np.ndarray:
        """Attention of q [n, n_head, d] over the cached K/V of layer il; [n, n_head*d]."""
        hp, gp = self.ref.hparams, self.ref.gemma
        n, n_head, d = q.shape
        kv_of = np.arange(n_head) // (n_head // hp.n_head_kv(il))   # query head -> its key/value head
        s = np.einsum("qhd,khd->hqk", q * gp.attention_scale, self.k[il][:, kv_of])  # [n_head, n, n_all]
        if gp.attn_softcap:
            s = gp.attn_softcap * np.tanh(s / gp.attn_softcap)
        s = np.where(visible[None], s, -np.inf)
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        s /= s.sum(axis=-1, keepdims=True)
        return np.einsum("hqk,khd->qhd", s, self.v[il][:, kv_of]).reshape(n, n_head * d)

    def decode(self, tokens: Sequence[int] | np.ndarray, pos: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
        """Append the tokens (positions default to after the cached ones); float64 [n_tokens, n_vocab] logits."""
        ref = self.ref
        hp, gp, w = ref.hparams, ref.gemma, ref.w
        tok, p = new_tokens(ref.n_vocab, self.pos, tokens, pos)
        n = tok.shape[0]
        d = hp.n_embd_head_k
        all_pos = np.concatenate([self.pos, p])
        causal = all_pos[None, :] <= p[:, None]                                  # [query, key]
        window = causal & (p[:, None] - all_pos[None, :] < hp.n_swa)
        x = ref.tok_embd[tok] * gp.embd_scale                                    # [n, n_embd]
        for il in range(hp.n_layer):
            b = f"blk.{il}."
            n_head, n_head_kv = hp.n_head(il), hp.n_head_kv(il)
            h = ref.rms(x, w[b + "attn_norm.weight"])
            q = (h @ w[b + "attn_q.weight"].T).reshape(n, n_head, d)
            k = (h @ w[b + "attn_k.weight"].T).reshape(n, n_head_kv, d)
            if gp.qk_norm:
                q = ref.rms(q, w[b + "attn_q_norm.weight"])
                k = ref.rms(k, w[b + "attn_k_norm.weight"])
            v = (h @ w[b + "attn_v.weight"].T).reshape(n, n_head_kv, d)
            self.k[il] = np.concatenate([self.k[il], self._rope(k, p, il)])
            self.v[il] = np.concatenate([self.v[il], v])
            att = self._attend(self._rope(q, p, il), il, window if hp.is_swa(il) else causal)
            x = x + ref.rms(att @ w[b + "attn_output.weight"].T, w[b + "post_attention_norm.weight"])
            h = ref.rms(x, w[b + "ffn_norm.weight"])
            ffn = (gelu_ggml(h @ w[b + "ffn_gate.weight"].T) * (h @ w[b + "ffn_up.weight"].T)) @ w[
                b + "ffn_down.weight"].T
            x = x + ref.rms(ffn, w[b + "post_ffw_norm.weight"])
        self.pos = all_pos
        logits = ref.rms(x, w["output_norm.weight"]) @ ref.output.T
        if gp.final_softcap:
            logits = gp.final_softcap * np.tanh(logits / gp.final_softcap)
        return logits
