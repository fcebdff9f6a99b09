"""A random-weight Gemma 2 / Gemma 3 GGUF that llama.cpp also loads (``make-model --arch gemma2|gemma3``).

The file has the architecture's keys -- the sliding window and its pattern period, the SWA layers' RoPE base, the
logit soft-capping values (Gemma 2 always; Gemma 3 only with a final cap), an explicit head size
(``attention.key_length``/``value_length``, which Gemma does not tie to ``embd / heads``) -- and its tensors:
llama's, plus per layer ``post_attention_norm`` and ``post_ffw_norm`` (and ``attn_q_norm``, ``attn_k_norm`` for
Gemma 3).  Gemma 2 always ties the output to ``token_embd``; Gemma 3 writes ``output.weight`` unless ``tied``.
The vocabulary is the model maker's minimal SPM one or another GGUF's (``vocab_from``); the matrices take any of the
model maker's weight types (``embd_type`` for the embeddings and output).  Every weight comes from a seeded numpy
generator.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .maker_common import _add_common_keys, _add_matrix, _checked_spec, check_spec

__all__ = ["GemmaSpec", "make_gemma_model"]


@dataclass(slots=True)
class GemmaSpec:
    """Shape, sliding window and storage of the Gemma model to write."""

    arch: str = "gemma2"           # "gemma2" or "gemma3"
    layers: int = 4                # transformer blocks
    embd: int = 64                 # embedding width (n_embd)
    heads: int = 4                 # query heads
    heads_kv: int = 2              # key/value heads
    head_dim: int = 32             # size of a head (attention.key_length = value_length); Gemma: != embd/heads
    ff: int = 128                  # feed-forward width
    vocab: int = 64                # vocabulary size, >= 4
    seed: int = 0                  # numpy seed of the weights
    ctx: int = 8192                # {arch}.context_length
    type: str = "f32"              # ggml type of the matrices (maker_common.WEIGHT_TYPES; norms are always f32)
    embd_type: str = ""            # ggml type of token_embd and output ("" = type)
    vocab_from: str = ""           # a GGUF whose tokenizer.* keys to copy ("" = the minimal SPM vocabulary of `vocab`)
    n_swa: int = 16                # sliding window of the SWA layers; 0 (Gemma 3 only): no window at all
    swa_period: int = 2            # every swa_period-th layer attends to everything, the others slide
    rope_freq_base: float = 1e6    # RoPE base of the full-attention layers
    rope_freq_base_swa: float = 1e4  # RoPE base of the SWA layers
    attn_softcap: float = 50.0     # Gemma 2: attention logit soft-capping
    final_softcap: float = 30.0    # output logit soft-capping (Gemma 3: 0 writes no key)
    rms_eps: float = 1e-6          # {arch}.attention.layer_norm_rms_epsilon
    tied: bool = True              # Gemma 3: no output.weight (Gemma 2 is always tied)

    def check(self) -> None:
        """ValueError naming the first value out of its range."""
        if self.arch not in ("gemma2", "gemma3"):
            raise ValueError(f"arch must be 'gemma2' or 'gemma3', got {self.arch!r}")
        check_spec(self, ("layers", "embd", "heads", "heads_kv", "head_dim", "ff", "ctx", "swa_period"),
                   ("embd", "ff", "head_dim"))
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even (RoPE pairs)")
        if self.n_swa < 0 or (self.n_swa == 0 and self.arch == "gemma2"):
            raise ValueError(f"n_swa must be >= 1 for gemma2 and >= 0 for gemma3, got {self.n_swa}")


def _write_keys(writer, gguf, spec: GemmaSpec) -> int:
    """The file's keys; returns the vocabulary size."""
    n_vocab = _add_common_keys(writer, gguf, spec, spec.arch)
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    if spec.n_swa > 0:
        writer.add_sliding_window(spec.n_swa)
        writer.add_sliding_window_pattern(spec.swa_period)
        writer.add_rope_freq_base_swa(spec.rope_freq_base_swa)
    if spec.arch == "gemma2":
        writer.add_attn_logit_softcapping(spec.attn_softcap)
    if spec.arch == "gemma2" or spec.final_softcap:
        writer.add_final_logit_softcapping(spec.final_softcap)
    return n_vocab


def make_gemma_model(path: str | Path, spec: GemmaSpec | None = None, **kwargs) -> Path:
    """Write the Gemma model described by ``spec`` (or by keyword arguments of :class:`GemmaSpec`) to ``path``."""
    import gguf

    spec = _checked_spec(GemmaSpec, spec, kwargs)
    path = Path(path)
    rng = np.random.default_rng(spec.seed)

    def normal(rows: int, cols: int) -> np.ndarray:
        # numpy [rows, cols]; std 1.6/sqrt(fan_in) keeps activations O(1) through the blocks
        return rng.standard_normal((rows, cols)) * (1.6 / math.sqrt(cols))

    def norm_weight(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)  # [n]

    n_q, n_kv = spec.head_dim * spec.heads, spec.head_dim * spec.heads_kv
    writer = gguf.GGUFWriter(str(path), spec.arch)
    try:
        n_vocab = _write_keys(writer, gguf, spec)
        etype = spec.embd_type or spec.type
        # embeddings of std 1/sqrt(embd): scaled by sqrt(embd) in the graph, the first norm sees O(1) values
        _add_matrix(writer, gguf, "token_embd.weight",
                    rng.standard_normal((n_vocab, spec.embd)) / math.sqrt(spec.embd), etype)
        for il in range(spec.layers):
            b = f"blk.{il}."
            writer.add_tensor(b + "attn_norm.weight", norm_weight(spec.embd))
            _add_matrix(writer, gguf, b + "attn_q.weight", normal(n_q, spec.embd), spec.type)
            _add_matrix(writer, gguf, b + "attn_k.weight", normal(n_kv, spec.embd), spec.type)
            _add_matrix(writer, gguf, b + "attn_v.weight", normal(n_kv, spec.embd), spec.type)
            if spec.arch == "gemma3":
                writer.add_tensor(b + "attn_q_norm.weight", norm_weight(spec.head_dim))
                writer.add_tensor(b + "attn_k_norm.weight", norm_weight(spec.head_dim))
            _add_matrix(writer, gguf, b + "attn_output.weight", normal(spec.embd, n_q), spec.type)
            writer.add_tensor(b + "post_attention_norm.weight", norm_weight(spec.embd))
            writer.add_tensor(b + "ffn_norm.weight", norm_weight(spec.embd))
            _add_matrix(writer, gguf, b + "ffn_gate.weight", normal(spec.ff, spec.embd), spec.type)
            _add_matrix(writer, gguf, b + "ffn_up.weight", normal(spec.ff, spec.embd), spec.type)
            _add_matrix(writer, gguf, b + "ffn_down.weight", normal(spec.embd, spec.ff), spec.type)
            writer.add_tensor(b + "post_ffw_norm.weight", norm_weight(spec.embd))
        writer.add_tensor("output_norm.weight", norm_weight(spec.embd))
        if spec.arch == "gemma3" and not spec.tied:
            _add_matrix(writer, gguf, "output.weight", normal(n_vocab, spec.embd), etype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return path
