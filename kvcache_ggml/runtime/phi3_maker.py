"""Random-weight Phi-3 GGUFs that llama.cpp also loads (``make-model --preset phi3-mini-4k|phi3.5-mini|phi4-mini``).

The file has what convert_hf_to_gguf.py's ``Phi3MiniModel`` writes: ``token_embd``, per layer ``attn_norm``,
``attn_qkv`` (Q, K, V rows stacked), ``attn_output``, ``ffn_norm``, ``ffn_up`` (gate rows, then up rows),
``ffn_down``, then ``output_norm`` and ``output`` (absent when tied, as Phi-4-mini's); ``phi3.rope.dimension_count``
(``partial_rotary_factor * n_embd / n_head``), ``phi3.attention.sliding_window`` (what the HF config says, 0 when
absent; llama.cpp switches it off either way); with LongRoPE, ``phi3.rope.scaling.original_context_length``,
``phi3.rope.scaling.attn_factor`` (sqrt(1 + ln(ctx/orig) / ln(orig)), the converter's formula) and the shared
``rope_factors_long`` / ``rope_factors_short`` [n_rot/2] tensors.  :data:`PHI3_PRESETS` scales the published small
models down (their head ratios, partial rotation, tied head, window key; context and original context divided by
16, so that a test's n_ctx of 512 already takes the long factors).  Vocabulary and storage are the model maker's
(:mod:`~kvcache_ggml.runtime.maker_common`), a small SPM vocabulary shaped as Phi-3's (byte pieces, then plain
pieces, then Phi-3's added tokens: ``<|endoftext|>`` the EOS, ``<|user|>``, ``<|assistant|>``, ``<|end|>`` ...);
every weight comes from a seeded numpy generator.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from .maker_common import _add_common_keys, _add_matrix, _checked_spec, check_spec

__all__ = ["Phi3Spec", "PHI3_PRESETS", "PHI3_SPECIAL", "make_phi3_model", "longrope_factors", "longrope_attn_factor"]


@dataclass(slots=True)
class Phi3Spec:
    """Shape, RoPE and storage of the Phi-3 model to write."""

    layers: int = 2                # transformer blocks
    embd: int = 96                 # embedding width (n_embd = heads * head size)
    heads: int = 4                 # query heads
    heads_kv: int = 4              # key/value heads
    ff: int = 256                  # feed-forward width (ffn_up holds 2*ff rows)
    rot_pct: float = 1.0           # partial_rotary_factor: n_rot = int(rot_pct * embd) // heads
    vocab: int = 320               # vocabulary size, >= 271 (3 special, 256 byte, 11 added tokens, a piece)
    seed: int = 0                  # numpy seed of the weights
    ctx: int = 4096                # phi3.context_length (max_position_embeddings)
    orig_ctx: int = 0              # original_max_position_embeddings with LongRoPE; 0 = no rope scaling
    sliding_window: int = 0        # phi3.attention.sliding_window as written (llama.cpp ignores it)
    type: str = "f32"              # ggml type of the matrices (maker_common.WEIGHT_TYPES; norms, factors: f32)
    embd_type: str = ""            # ggml type of token_embd and output ("" = type)
    vocab_from: str = ""           # a GGUF whose tokenizer.* keys to copy ("" = the minimal SPM vocabulary)
    rope_freq_base: float = 10000.0  # phi3.rope.freq_base
    rms_eps: float = 1e-5          # phi3.attention.layer_norm_rms_epsilon
    tied: bool = False             # no output.weight: the head is token_embd
    chat_template: str = ""        # tokenizer.chat_template ("" = none)
    name: str = ""                 # general.name ("" = kvcache-ggml-tiny-phi3; llama.cpp gives the special tokens of
    #                                a model named phi3 / phi-3 the RSTRIP attribute, and looks up </s> for it)

    def check(self) -> None:
        """ValueError naming the first value out of its range."""
        check_spec(self, ("layers", "embd", "heads", "heads_kv", "ff", "ctx"), ("embd", "ff"))
        if self.embd % self.heads or (self.embd // self.heads) % 2:
            raise ValueError(f"embd {self.embd} / heads {self.heads} must give an even head size")
        if not 0 < self.rot_pct <= 1 or self.n_rot % 2 or self.n_rot < 2:
            raise ValueError(f"rot_pct {self.rot_pct} must give an even n_rot in [2, head size], got {self.n_rot}")
        if self.orig_ctx < 0 or self.orig_ctx > self.ctx:
            raise ValueError(f"orig_ctx must be in [0, ctx={self.ctx}], got {self.orig_ctx}")

    @property
    def head_dim(self) -> int:
        """The size of a head (embd / heads)."""
        return self.embd // self.heads

    @property
    def n_rot(self) -> int:
        """Rotated dims of a head, as the converter computes them."""
        return int(self.rot_pct * self.embd) // self.heads


# Phi-3-mini-4k-instruct: 32/32 heads of 96, sliding_window 2047, no rope scaling; Phi-3.5-mini-instruct: the same
# shape with LongRoPE (131072 over 4096) and sliding_window 262144; Phi-4-mini-instruct: 24/8 heads of 128, 3/4 of
# each head rotated, LongRoPE, tied, sliding_window null (0), named as its GGUF (no "phi3" in the name: llama.cpp
# then sets no RSTRIP, and its gpt-4o vocabulary has no </s>).  Context lengths divided by 16.
PHI3_PRESETS: dict[str, Phi3Spec] = {
    "phi3-mini-4k": Phi3Spec(layers=2, embd=96, heads=4, heads_kv=4, ff=256, ctx=256, sliding_window=127),
    "phi3.5-mini": Phi3Spec(layers=2, embd=96, heads=4, heads_kv=4, ff=256, ctx=8192, orig_ctx=256,
                            sliding_window=16384),
    "phi4-mini": Phi3Spec(layers=2, embd=192, heads=6, heads_kv=2, ff=256, rot_pct=0.75, ctx=8192, orig_ctx=256,
                          tied=True, name="kvcache-ggml-tiny Phi 4 Mini"),
}


def longrope_attn_factor(ctx: int, orig_ctx: int) -> float:
    """convert_hf_to_gguf.py's attention factor of LongRoPE: sqrt(1 + ln(ctx/orig) / ln(orig)) (1 unscaled)."""
    scale = ctx / orig_ctx
    return math.sqrt(1 + math.log(scale) / math.log(orig_ctx)) if scale > 1.0 else 1.0


def longrope_factors(n_rot: int, ctx: int, orig_ctx: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 [n_rot/2] (long, short): frequency divisors shaped as the published ones (short near 1, long rising
    from 1 to about ctx/orig over the dims)."""
    t = np.arange(n_rot // 2, dtype=np.float64) / max(n_rot // 2 - 1, 1)
    long = 1.0 + (ctx / orig_ctx - 1.0) * t ** 2
    short = 1.0 + 1.5 * t ** 3
    return long.astype(np.float32), short.astype(np.float32)


# Phi-3's added tokens (ids 32000.. of its vocabulary), all CONTROL; <|endoftext|> is its EOS, <|end|> ends a turn
PHI3_SPECIAL = ("<|endoftext|>", "<|assistant|>", "<|placeholder1|>", "<|placeholder2|>", "<|placeholder3|>",
                "<|placeholder4|>", "<|system|>", "<|end|>", "<|placeholder5|>", "<|placeholder6|>", "<|user|>")


def _add_phi3_vocab(writer, gguf, n_vocab: int) -> int:
    """A small SPM vocabulary shaped as Phi-3's: <unk>, <s>, </s>, the 256 byte pieces <0x00> .. <0xFF> (any text
    tokenizes, as llama.cpp's byte fallback needs), pieces t0, t1, ... (scores falling with the index), then Phi-3's
    added tokens (llama.cpp's loader looks them up for a model named phi3); EOS is <|endoftext|>."""
    n_pieces = n_vocab - 3 - 256 - len(PHI3_SPECIAL)
    if n_pieces < 1:
        raise ValueError(f"a phi3 vocabulary needs >= {260 + len(PHI3_SPECIAL)} tokens, got {n_vocab}")
    T = gguf.TokenType
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
                          + [f"t{i}" for i in range(n_pieces)] + list(PHI3_SPECIAL))
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(n_pieces)] + [0.0] * len(PHI3_SPECIAL))
    writer.add_token_types([T.UNKNOWN, T.CONTROL, T.USER_DEFINED] + [T.BYTE] * 256 + [T.NORMAL] * n_pieces
                           + [T.CONTROL] * len(PHI3_SPECIAL))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(n_vocab - len(PHI3_SPECIAL))
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    return n_vocab


def _write_keys(writer, gguf, spec: Phi3Spec) -> int:
    n_vocab = _add_common_keys(writer, gguf, spec, "phi3", _add_phi3_vocab, spec.name)
    writer.add_rope_dimension_count(spec.n_rot)
    writer.add_sliding_window(spec.sliding_window)
    if spec.orig_ctx:
        writer.add_rope_scaling_orig_ctx_len(spec.orig_ctx)
        writer.add_rope_scaling_attn_factors(longrope_attn_factor(spec.ctx, spec.orig_ctx))
    if spec.chat_template:
        writer.add_chat_template(spec.chat_template)
    return n_vocab


def make_phi3_model(path: str | Path, spec: Phi3Spec | str | None = None, **kwargs) -> Path:
    """Write the Phi-3 model of ``spec`` (a :class:`Phi3Spec`, a :data:`PHI3_PRESETS` name -- keyword arguments
    then replace its fields -- or keyword arguments of Phi3Spec) to ``path``."""
    import gguf

    if isinstance(spec, str):
        if spec not in PHI3_PRESETS:
            raise ValueError(f"preset {spec!r} is not one of {', '.join(PHI3_PRESETS)}")
        spec, kwargs = replace(PHI3_PRESETS[spec], **kwargs), {}
    spec = _checked_spec(Phi3Spec, spec, kwargs)
    path = Path(path)
    rng = np.random.default_rng(spec.seed)

    def normal(rows: int, cols: int) -> np.ndarray:
        return rng.standard_normal((rows, cols)) * (1.6 / math.sqrt(cols))  # [rows, cols]: activations stay O(1)

    def norm_weight(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)      # [n]

    e, n_kv = spec.embd, spec.embd // spec.heads * spec.heads_kv
    writer = gguf.GGUFWriter(str(path), "phi3")
    try:
        n_vocab = _write_keys(writer, gguf, spec)
        etype = spec.embd_type or spec.type
        _add_matrix(writer, gguf, "token_embd.weight", rng.standard_normal((n_vocab, e)), etype)
        if spec.orig_ctx:
            long, short = longrope_factors(spec.n_rot, spec.ctx, spec.orig_ctx)
            writer.add_tensor("rope_factors_long.weight", long)
            writer.add_tensor("rope_factors_short.weight", short)
        for il in range(spec.layers):
            b = f"blk.{il}."
            writer.add_tensor(b + "attn_norm.weight", norm_weight(e))
            _add_matrix(writer, gguf, b + "attn_qkv.weight", normal(e + 2 * n_kv, e), spec.type)
            _add_matrix(writer, gguf, b + "attn_output.weight", normal(e, e), spec.type)
            writer.add_tensor(b + "ffn_norm.weight", norm_weight(e))
            _add_matrix(writer, gguf, b + "ffn_up.weight", normal(2 * spec.ff, e), spec.type)
            _add_matrix(writer, gguf, b + "ffn_down.weight", normal(e, spec.ff), spec.type)
        writer.add_tensor("output_norm.weight", norm_weight(e))
        if not spec.tied:
            _add_matrix(writer, gguf, "output.weight", normal(n_vocab, e), etype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return path
