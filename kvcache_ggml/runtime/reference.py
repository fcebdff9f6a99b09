"""A numpy forward pass of a llama GGUF in float64: the reference the runtime's logits are tested against.

No ggml.  :meth:`Reference.forward` encodes a whole sequence from scratch with causal attention over positions
(token i sees token j when pos[j] <= pos[i]).  :class:`ReferenceCache` keeps one sequence's K/V in float64 so that
decoding can go on step by step and a context shift (``seq_rm`` + ``seq_add`` with the K rotation) can be replayed:
after a shift the kept tokens' K/V still carry what the discarded tokens contributed in the deeper layers, so a
shifted cache equals a re-encoding at the new positions only for a one-layer model.  Weights are read with the
``gguf`` package and dequantized once.
"""
from __future__ import annotations

import math
from os import PathLike
from typing import Sequence

import numpy as np

from ..hparams import HParams, RopeType

__all__ = ["Reference", "ReferenceCache", "rope_norm"]


def rope_norm(x: np.ndarray, pos: np.ndarray, n_rot: int, freq_base: float, freq_scale: float = 1.0,
              factors: np.ndarray | None = None, neox: bool = False,
              yarn: tuple[int, float, float] | None = None) -> np.ndarray:
    """RoPE, llama's NORM mode: dims (2i, 2i+1) of each head rotated by pos*scale*base^(-2i/n_rot)/factor_i
    (``neox``: NEOX mode, dims (i, i + n_rot/2), as Qwen's).  ``yarn`` = (original context, beta_fast,
    beta_slow): YaRN, the dims between the two correction dims ramping from the scaled angle to the unscaled one,
    every rotation multiplied by 1 + 0.1 ln(1/scale) (what llama.cpp's attention factor and ggml's rope give).

    x: [n_tokens, n_head, head_dim] (ggml ne [head_dim, n_head, n_tokens]); pos: [n_tokens].
    """
    out = x.astype(np.float64, copy=True)
    i = np.arange(0, n_rot, 2)
    inv = freq_base ** (-i / n_rot)                                      # [n_rot/2]
    if factors is not None:
        inv = inv / np.asarray(factors, np.float64)
    theta = freq_scale * pos.astype(np.float64)[:, None] * inv[None, :]  # [n_tokens, n_rot/2]
    mscale = 1.0
    if yarn is not None:
        n_orig, beta_fast, beta_slow = yarn

        def corr_dim(n_turns: float) -> float:   # the dim whose wavelength fits n_turns times in n_orig
            return n_rot * math.log(n_orig / (n_turns * 2 * math.pi)) / (2 * math.log(freq_base))

        low, high = max(0.0, math.floor(corr_dim(beta_fast))), min(n_rot - 1.0, math.ceil(corr_dim(beta_slow)))
        ramp = 1 - np.clip((i / 2 - low) / max(0.001, high - low), 0, 1)   # 1: unscaled angle, 0: scaled one
        theta = theta * (1 - ramp) + (theta / freq_scale) * ramp
        mscale = 1.0 + 0.1 * math.log(1.0 / freq_scale) if freq_scale < 1 else 1.0
    cos, sin = mscale * np.cos(theta)[:, None, :], mscale * np.sin(theta)[:, None, :]
    first, second = (slice(0, n_rot // 2), slice(n_rot // 2, n_rot)) if neox else (slice(0, n_rot, 2),
                                                                                    slice(1, n_rot, 2))
    x0, x1 = x[..., first], x[..., second]
    out[..., first] = x0 * cos - x1 * sin
    out[..., second] = x0 * sin + x1 * cos
    return out


class Reference:
    """The model of a GGUF file as float64 numpy arrays (numpy layout: [rows, cols] = ggml ne [cols, rows])."""

    def __init__(self, path: str | PathLike) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize

        from .._gguf import GGUFFile

        self.hparams = HParams.from_gguf(path)
        hp = self.hparams
        f = GGUFFile(path)
        w: dict[str, np.ndarray] = {}
        for t in f.tensors.values():
            qt = GGMLQuantizationType(t.type)
            block, size = GGML_QUANT_SIZES[qt]
            rows = int(np.prod(t.ne[1:], dtype=np.int64))
            raw = np.asarray(f.data(t.name, rows * (t.ne[0] // block) * size)).reshape(rows, -1)
            a = dequantize(raw, qt)
            w[t.name] = np.asarray(a, np.float64).reshape(tuple(reversed(t.ne)))
        self.w = w
        self.tok_embd = w["token_embd.weight"]                 # [n_vocab, n_embd]
        self.output = w.get("output.weight", self.tok_embd)    # [n_vocab, n_embd]
        self.rope_freqs = w.get("rope_freqs.weight")           # [n_rot/2] or None
        # YaRN's (original context, beta_fast, beta_slow) when the file's scaling type is yarn (llama.cpp's
        # defaults for the llama, Qwen and Gemma loaders), else None; the scale is the caller's freq_scale
        a = hp.arch + "."
        self.yarn = ((int(f.kv.get(a + "rope.scaling.original_context_length", hp.n_ctx_train)), 32.0, 1.0)
                     if f.kv.get(a + "rope.scaling.type") == "yarn" else None)
        self.n_vocab = self.output.shape[0]
        self.eps = float(hp.f_norm_rms_eps)

    def rms(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * weight

    def project(self, h: np.ndarray, name: str, il: int) -> np.ndarray:
        """Q, K or V (``name``: ``blk.{il}.attn_q`` ...) of h [n, n_embd] as [n, heads, d]: the matrix, the bias
        when the file has one (Qwen2), the RMS norm of every head when the file has ``attn_q_norm`` /
        ``attn_k_norm`` (Qwen3)."""
        hp, w = self.hparams, self.w
        x = h @ w[name + ".weight"].T
        if name + ".bias" in w:
            x = x + w[name + ".bias"]
        heads = hp.n_head(il) if name.endswith("_q") else hp.n_head_kv(il)
        x = x.reshape(h.shape[0], heads, -1)
        if name + "_norm.weight" in w:
            x = self.rms(x, w[name + "_norm.weight"])
        return x

    def forward(self, tokens: Sequence[int] | np.ndarray, pos: Sequence[int] | np.ndarray | None = None, *,
                freq_base: float | None = None, freq_scale: float = 1.0) -> np.ndarray:
        """float64 [n_tokens, n_vocab]: the logits of every token of one sequence, encoded from scratch."""
        return self.cache(freq_base=freq_base, freq_scale=freq_scale).decode(tokens, pos)

    def cache(self, *, freq_base: float | None = None, freq_scale: float = 1.0) -> "ReferenceCache":
        """An empty float64 KV cache of one sequence over these weights."""
        return ReferenceCache(self, self.hparams.rope_freq_base_train if freq_base is None else freq_base,
                              freq_scale)


class ReferenceCache:
    """What llama.cpp's KV cache holds for one sequence, in float64: per cached token its position and, per layer,
    its RoPE'd K and its V.  :meth:`seq_add` rotates the K of the moved tokens by the shift, as the K-shift does
    (for NORM RoPE a rotation by ``delta`` of K at position p is K at position p + delta)."""

    def __init__(self, ref: Reference, freq_base: float, freq_scale: float) -> None:
        hp = ref.hparams
        self.ref = ref
        self.freq_base = freq_base
        self.freq_scale = freq_scale
        self.pos = np.zeros(0, np.int64)                                                   # [n_cached]
        self.k = [np.zeros((0, hp.n_head_kv(il), hp.n_embd_head_k)) for il in range(hp.n_layer)]  # [n, n_kv, d]
        self.v = [np.zeros((0, hp.n_head_kv(il), hp.n_embd_head_v)) for il in range(hp.n_layer)]

    def copy(self) -> "ReferenceCache":
        """An independent copy (seq_cp of the whole sequence)."""
        c = ReferenceCache(self.ref, self.freq_base, self.freq_scale)
        c.pos = self.pos.copy()
        c.k = [k.copy() for k in self.k]
        c.v = [v.copy() for v in self.v]
        return c

    def __len__(self) -> int:
        return self.pos.shape[0]

    def _rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        hp = self.ref.hparams
        return rope_norm(x, pos, hp.n_rot, self.freq_base, self.freq_scale, self.ref.rope_freqs,
                         hp.rope_type == RopeType.NEOX, self.ref.yarn)

    def seq_rm(self, p0: int = -1, p1: int = -1) -> None:
        """Forget the cached tokens at positions [p0, p1) (negative: open end)."""
        keep = ~_in_range(self.pos, p0, p1)
        self.pos = self.pos[keep]
        self.k = [k[keep] for k in self.k]
        self.v = [v[keep] for v in self.v]

    def seq_add(self, p0: int, p1: int, delta: int) -> None:
        """Move the cached tokens at positions [p0, p1) by delta, rotating their K; those moved below 0 go.

        As llama.cpp's K-shift, the rotation runs over every cached K, by 0 where a token did not move: with YaRN
        that scales each K by the rotation's magnitude factor once more (one seq_add here is one K-shift there,
        i.e. a decode or memory update comes between two)."""
        sel = _in_range(self.pos, p0, p1)
        if not sel.any() or delta == 0:
            return
        self.pos = self.pos.copy()
        self.pos[sel] += delta
        shift = np.where(sel, delta, 0)
        for il, k in enumerate(self.k):
            self.k[il] = self._rope(k, shift)
        gone = self.pos < 0
        if gone.any():
            self.pos = self.pos[~gone]
            self.k = [k[~gone] for k in self.k]
            self.v = [v[~gone] for v in self.v]

    def seq_div(self, p0: int, p1: int, d: int) -> None:
        """Divide the positions [p0, p1) by d and rotate each K as llama.cpp's K-shift does after seq_div.

        llama.cpp records the pending shift of a divided cell as ``old - new`` (llama_kv_cells::pos_div), the
        opposite sign of seq_add's ``new - old``: the K rotation moves away from the new position.  This model
        does the same, so that it describes what llama.cpp (and kvcache_ggml) compute.
        """
        sel = _in_range(self.pos, p0, p1)
        if not sel.any() or d == 1:
            return
        self.pos = self.pos.copy()
        new = self.pos[sel] // d
        shift = np.zeros_like(self.pos)          # every K rotated, by 0 where unmoved (as seq_add)
        shift[sel] = self.pos[sel] - new
        self.pos[sel] = new
        for il, k in enumerate(self.k):
            self.k[il] = self._rope(k, shift)

    def decode(self, tokens: Sequence[int] | np.ndarray, pos: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
        """Append the tokens (positions default to after the cached ones); float64 [n_tokens, n_vocab] logits.

        Each token attends to the cached and new tokens whose position is <= its own (the causal kq mask)."""
        ref = self.ref
        hp = ref.hparams
        w = ref.w
        tok, p = new_tokens(ref.n_vocab, self.pos, tokens, pos)
        n = tok.shape[0]
        d = hp.n_embd_head_k
        all_pos = np.concatenate([self.pos, p])
        visible = all_pos[None, :] <= p[:, None]                   # [query, key]
        x = ref.tok_embd[tok]                                      # [n, n_embd]
        for il in range(hp.n_layer):
            b = f"blk.{il}."
            n_head, n_head_kv = hp.n_head(il), hp.n_head_kv(il)
            h = ref.rms(x, w[b + "attn_norm.weight"])
            q, k, v = (ref.project(h, b + name, il) for name in ("attn_q", "attn_k", "attn_v"))
            q = self._rope(q, p)                                   # [n, n_head, d]
            k = self._rope(k, p)                                   # [n, n_head_kv, d]
            self.k[il] = np.concatenate([self.k[il], k])
            self.v[il] = np.concatenate([self.v[il], v])
            kv_of = np.arange(n_head) // (n_head // n_head_kv)   # query head -> its key/value head
            s = np.einsum("qhd,khd->hqk", q, self.k[il][:, kv_of]) / np.sqrt(d)  # [n_head, n, n_all]
            s = np.where(visible[None], s, -np.inf)
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            s /= s.sum(axis=-1, keepdims=True)
            att = np.einsum("hqk,khd->qhd", s, self.v[il][:, kv_of]).reshape(n, n_head * d)
            x = x + att @ w[b + "attn_output.weight"].T
            h = ref.rms(x, w[b + "ffn_norm.weight"])
            g = h @ w[b + "ffn_gate.weight"].T
            u = h @ w[b + "ffn_up.weight"].T
            x = x + (g / (1.0 + np.exp(-g)) * u) @ w[b + "ffn_down.weight"].T
        self.pos = all_pos
        return ref.rms(x, w["output_norm.weight"]) @ ref.output.T


def new_tokens(n_vocab: int, cached: np.ndarray, tokens: Sequence[int] | np.ndarray,
               pos: Sequence[int] | np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """int64 token ids and positions of a decode, checked; positions default to after the ``cached`` ones."""
    tok = np.asarray(tokens, np.int64)
    n = tok.shape[0]
    start = int(cached.max()) + 1 if cached.size else 0
    p = np.arange(start, start + n) if pos is None else np.asarray(pos, np.int64)
    if p.shape != (n,):
        raise ValueError(f"pos has shape {p.shape}, expected [{n}]")
    if n == 0 or tok.min() < 0 or tok.max() >= n_vocab:
        raise ValueError(f"tokens must be a non-empty list of ids in [0, {n_vocab})")
    return tok, p


def _in_range(pos: np.ndarray, p0: int, p1: int) -> np.ndarray:
    lo = 0 if p0 < 0 else p0
    return (pos >= lo) & ((pos < p1) if p1 >= 0 else True)
