"""A numpy forward pass of a Phi-3 GGUF in float64: the reference the Phi-3 graph is tested against.

No ggml.  :class:`Phi3Reference` loads the weights as :class:`~kvcache_ggml.runtime.reference.Reference` does and
cuts the fused matrices into llama's: ``attn_qkv``'s rows into Q, K and V, ``ffn_up``'s into the gate (first half)
and up (second half), so that llama's float64 decode serves.  What Phi-3 adds is in the RoPE
(:class:`Phi3ReferenceCache`): NEOX over the first ``n_rot`` dims, divided by the LongRoPE factors of the context
(long when ``n_ctx_seq`` exceeds the original context, short otherwise) and the result multiplied by the attention
factor, which also multiplies a K rotated again by a context shift (llama.cpp's K-shift passes it too).
"""
from __future__ import annotations

from os import PathLike

import numpy as np

from .reference import Reference, ReferenceCache, rope_norm

__all__ = ["Phi3Reference", "Phi3ReferenceCache"]


class Phi3Reference(Reference):
    """A Phi-3 GGUF as float64 numpy arrays with llama's tensor names; ``n_ctx_seq`` picks the LongRoPE factors."""

    def __init__(self, path: str | PathLike, n_ctx_seq: int) -> None:
        super().__init__(path)
        hp, w = self.hparams, self.w
        e, d = hp.n_embd, hp.n_embd_head_k
        for il in range(hp.n_layer):
            b = f"blk.{il}."
            n_gqa = d * hp.n_head_kv(il)
            qkv = w.pop(b + "attn_qkv.weight")                              # [n_embd + 2*n_gqa, n_embd]
            w[b + "attn_q.weight"], w[b + "attn_k.weight"], w[b + "attn_v.weight"] = (
                qkv[:e], qkv[e:e + n_gqa], qkv[e + n_gqa:])
            up = w.pop(b + "ffn_up.weight")                                 # [2*n_ff, n_embd]
            w[b + "ffn_gate.weight"], w[b + "ffn_up.weight"] = up[:up.shape[0] // 2], up[up.shape[0] // 2:]
        orig = hp.n_ctx_orig_yarn or hp.n_ctx_train
        self.rope_freqs = w.get("rope_factors_long.weight" if n_ctx_seq > orig else "rope_factors_short.weight")
        self.attn_factor = float(np.float32(hp.rope_attn_factor))   # multiplies every RoPE'd value

    def cache(self, *, freq_base: float | None = None, freq_scale: float = 1.0) -> "Phi3ReferenceCache":
        return Phi3ReferenceCache(self, self.hparams.rope_freq_base_train if freq_base is None else freq_base,
                                  freq_scale)


class Phi3ReferenceCache(ReferenceCache):
    """llama's float64 cache with Phi-3's RoPE (partial NEOX, LongRoPE factors, attention factor)."""

    def copy(self) -> "Phi3ReferenceCache":
        c = Phi3ReferenceCache(self.ref, self.freq_base, self.freq_scale)
        c.pos = self.pos.copy()
        c.k = [k.copy() for k in self.k]
        c.v = [v.copy() for v in self.v]
        return c

    def _rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        ref = self.ref
        out = rope_norm(x, pos, ref.hparams.n_rot, self.freq_base, self.freq_scale, ref.rope_freqs, neox=True)
        out[..., :ref.hparams.n_rot] *= ref.attn_factor   # ggml's rope scales what it rotates (mscale)
        return out
