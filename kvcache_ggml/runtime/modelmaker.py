"""``python -m kvcache_ggml make-model OUT.gguf``: a random-weight llama GGUF that llama.cpp also loads.

The file has the llama architecture's keys and tensors (``token_embd``, per layer ``attn_norm``, ``attn_q/k/v``,
``attn_output``, ``ffn_norm``, ``ffn_gate/up/down``, then ``output_norm`` and ``output``) and a minimal SPM
vocabulary (``<unk>``, ``<s>``, ``</s>``, then plain pieces ``t0``, ``t1``, ...).  Norm weights stay F32; the
matrices are F32, F16 or Q8_0.  Nothing is downloaded: every weight comes from a seeded numpy generator.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["ModelSpec", "make_model", "main"]

_WEIGHT_TYPES = ("f32", "f16", "q8_0")
_Q8_0_BLOCK = 32  # elements per Q8_0 block: a quantized matrix needs rows that are a multiple of this


@dataclass(slots=True)
class ModelSpec:
    """Shape and storage of the model to write."""

    layers: int = 2          # transformer blocks
    embd: int = 64           # embedding width (n_embd)
    heads: int = 4           # query heads; the head size is embd / heads
    heads_kv: int = 2        # key/value heads (grouped-query attention when < heads)
    ff: int = 128            # feed-forward width (n_ff)
    vocab: int = 64          # vocabulary size, >= 4 (three special tokens + pieces)
    seed: int = 0            # numpy seed of the weights
    ctx: int = 4096          # llama.context_length (the training context)
    type: str = "f32"        # storage of the matrices: f32, f16 or q8_0 (norms are always f32)
    rope_freq_base: float = 10000.0  # llama.rope.freq_base
    rms_eps: float = 1e-5    # llama.attention.layer_norm_rms_epsilon
    tied: bool = False       # no output.weight: the head is token_embd (llama.cpp's tied embeddings)

    def check(self) -> None:
        """ValueError naming the first value out of its range."""
        for name in ("layers", "embd", "heads", "heads_kv", "ff", "ctx"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.vocab < 4:
            raise ValueError(f"vocab must be >= 4 (3 special tokens and a piece), got {self.vocab}")
        if self.embd % self.heads:
            raise ValueError(f"embd {self.embd} must be a multiple of heads {self.heads}")
        if self.heads % self.heads_kv:
            raise ValueError(f"heads {self.heads} must be a multiple of heads_kv {self.heads_kv}")
        if (self.embd // self.heads) % 2:
            raise ValueError(f"the head size embd/heads = {self.embd // self.heads} must be even (RoPE pairs)")
        if self.type not in _WEIGHT_TYPES:
            raise ValueError(f"type {self.type!r} is not one of {', '.join(_WEIGHT_TYPES)}")
        if self.type == "q8_0":
            for name in ("embd", "ff"):
                if getattr(self, name) % _Q8_0_BLOCK:
                    raise ValueError(f"q8_0 needs {name} to be a multiple of {_Q8_0_BLOCK}, got {getattr(self, name)}")

    @property
    def head_dim(self) -> int:
        return self.embd // self.heads


def _file_type(gguf, wtype: str) -> int:
    ft = gguf.LlamaFileType
    return {"f32": ft.ALL_F32, "f16": ft.MOSTLY_F16, "q8_0": ft.MOSTLY_Q8_0}[wtype]


def _add_matrix(writer, gguf, name: str, w: np.ndarray, wtype: str) -> None:
    """Store w (numpy [rows, cols] = ggml ne [cols, rows]) as wtype."""
    if wtype == "f32":
        writer.add_tensor(name, w.astype(np.float32))
    elif wtype == "f16":
        writer.add_tensor(name, w.astype(np.float16))
    else:
        q = gguf.quants.quantize(w.astype(np.float32), gguf.GGMLQuantizationType.Q8_0)  # uint8 [rows, bytes]
        writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)


def _checked_spec(cls: type, spec, kwargs: dict):
    """``spec``, or a ``cls`` from keyword arguments (not both), after its check()."""
    if spec is None:
        spec = cls(**kwargs)
    elif kwargs:
        raise TypeError(f"pass either spec or keyword arguments, not both: {sorted(kwargs)}")
    spec.check()
    return spec


def _add_common_keys(writer, gguf, spec, arch: str) -> None:
    """The keys every architecture the maker writes has: name, shape, norm epsilon, RoPE base, file type, vocab
    (``spec``: a ModelSpec or anything with its fields)."""
    writer.add_name(f"kvcache-ggml-tiny-{arch}")
    writer.add_context_length(spec.ctx)
    writer.add_embedding_length(spec.embd)
    writer.add_block_count(spec.layers)
    writer.add_feed_forward_length(spec.ff)
    writer.add_head_count(spec.heads)
    writer.add_head_count_kv(spec.heads_kv)
    writer.add_layer_norm_rms_eps(spec.rms_eps)
    writer.add_rope_freq_base(spec.rope_freq_base)
    writer.add_file_type(_file_type(gguf, spec.type))
    _add_vocab(writer, gguf, spec.vocab)


def _add_vocab(writer, gguf, n_vocab: int) -> None:
    """A minimal SPM vocabulary: <unk>, <s>, </s>, then plain pieces t0, t1, ..."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(n_vocab - 3)]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores([0.0] * n_vocab)
    writer.add_token_types([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
                           + [gguf.TokenType.NORMAL] * (n_vocab - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)


def make_model(path: str | Path, spec: ModelSpec | None = None, **kwargs) -> Path:
    """Write the model described by ``spec`` (or by keyword arguments of :class:`ModelSpec`) to ``path``."""
    import gguf

    spec = _checked_spec(ModelSpec, spec, kwargs)
    path = Path(path)
    rng = np.random.default_rng(spec.seed)

    def normal(rows: int, cols: int, fan_in: int) -> np.ndarray:
        # numpy [rows, cols]; std 1.6/sqrt(fan_in) keeps activations O(1) through the blocks
        return rng.standard_normal((rows, cols)) * (1.6 / math.sqrt(fan_in))

    def norm_weight() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(spec.embd)).astype(np.float32)  # [n_embd]

    writer = gguf.GGUFWriter(str(path), "llama")
    try:
        _add_common_keys(writer, gguf, spec, "llama")
        writer.add_rope_dimension_count(spec.head_dim)

        n_kv = spec.head_dim * spec.heads_kv
        # unit-variance embeddings: the first RMS norm sees O(1) values
        _add_matrix(writer, gguf, "token_embd.weight", rng.standard_normal((spec.vocab, spec.embd)), spec.type)
        for il in range(spec.layers):
            b = f"blk.{il}."
            writer.add_tensor(b + "attn_norm.weight", norm_weight())
            _add_matrix(writer, gguf, b + "attn_q.weight", normal(spec.embd, spec.embd, spec.embd), spec.type)
            _add_matrix(writer, gguf, b + "attn_k.weight", normal(n_kv, spec.embd, spec.embd), spec.type)
            _add_matrix(writer, gguf, b + "attn_v.weight", normal(n_kv, spec.embd, spec.embd), spec.type)
            _add_matrix(writer, gguf, b + "attn_output.weight", normal(spec.embd, spec.embd, spec.embd), spec.type)
            writer.add_tensor(b + "ffn_norm.weight", norm_weight())
            _add_matrix(writer, gguf, b + "ffn_gate.weight", normal(spec.ff, spec.embd, spec.embd), spec.type)
            _add_matrix(writer, gguf, b + "ffn_up.weight", normal(spec.ff, spec.embd, spec.embd), spec.type)
            _add_matrix(writer, gguf, b + "ffn_down.weight", normal(spec.embd, spec.ff, spec.ff), spec.type)
        writer.add_tensor("output_norm.weight", norm_weight())
        if not spec.tied:
            _add_matrix(writer, gguf, "output.weight", normal(spec.vocab, spec.embd, spec.embd), spec.type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return path


def main(argv: list[str]) -> int:
    d = ModelSpec()
    ap = argparse.ArgumentParser(prog="python -m kvcache_ggml make-model",
                                 description="Write a random-weight llama (or Gemma) GGUF that llama.cpp also loads.")
    ap.add_argument("out", help="output .gguf path")
    ap.add_argument("--layers", type=int, default=d.layers, help="transformer blocks (default %(default)s)")
    ap.add_argument("--embd", type=int, default=d.embd, help="embedding width (default %(default)s)")
    ap.add_argument("--heads", type=int, default=d.heads, help="query heads (default %(default)s)")
    ap.add_argument("--heads-kv", type=int, default=d.heads_kv, help="key/value heads (default %(default)s)")
    ap.add_argument("--ff", type=int, default=d.ff, help="feed-forward width (default %(default)s)")
    ap.add_argument("--vocab", type=int, default=d.vocab, help="vocabulary size (default %(default)s)")
    ap.add_argument("--seed", type=int, default=d.seed, help="weight seed (default %(default)s)")
    ap.add_argument("--ctx", type=int, default=d.ctx, help="training context length (default %(default)s)")
    ap.add_argument("--type", choices=_WEIGHT_TYPES, default=d.type, help="matrix storage (default %(default)s)")
    ap.add_argument("--tied", action="store_true", help="no output.weight: the head reuses token_embd")
    ap.add_argument("--arch", choices=("llama", "gemma2", "gemma3"), default="llama",
                    help="architecture (default %(default)s); gemma: head size embd/heads, every other layer slides")
    ap.add_argument("--n-swa", type=int, default=16, help="gemma: sliding window (default %(default)s)")
    a = ap.parse_args(argv)
    spec = ModelSpec(layers=a.layers, embd=a.embd, heads=a.heads, heads_kv=a.heads_kv, ff=a.ff, vocab=a.vocab,
                     seed=a.seed, ctx=a.ctx, type=a.type, tied=a.tied)
    try:
        if a.arch != "llama":
            from .gemma_maker import GemmaSpec, make_gemma_model
            out = make_gemma_model(a.out, GemmaSpec(
                arch=a.arch, layers=a.layers, embd=a.embd, heads=a.heads, heads_kv=a.heads_kv,
                head_dim=spec.head_dim, ff=a.ff, vocab=a.vocab, seed=a.seed, ctx=a.ctx, type=a.type, n_swa=a.n_swa,
                tied=a.tied or a.arch == "gemma2"))
        else:
            out = make_model(a.out, spec)
    except ValueError as e:
        ap.error(str(e))
    print(out)
    return 0
