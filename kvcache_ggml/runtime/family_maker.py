"""Random-weight GGUFs of the llama-graph families that llama.cpp also loads: Llama 3 (``rope_freqs``), Mistral,
Qwen2 / Qwen2.5 (Q/K/V biases) and Qwen3 (Q/K head norms, its own head size) (``make-model --preset NAME``).

:data:`PRESETS` holds each published small model's shape ratios, RoPE and norm settings scaled down to a few layers
and a narrow embedding, with the tensor names and keys llama.cpp reads (``{arch}.attention.key_length`` only where
the head size is not ``n_embd / n_head``).  A Llama 3 spec's ``llama3_rope`` writes ``rope_freqs.weight`` as
convert_hf_to_gguf.py computes it from the HF ``rope_scaling`` (factor, low/high frequency factors, original
context); ``yarn`` writes the YaRN keys of a Qwen ``rope_scaling``.  Vocabulary and storage are the model
maker's (:mod:`~kvcache_ggml.runtime.maker_common`); every weight comes from a seeded numpy generator.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from .maker_common import _add_common_keys, _add_matrix, _checked_spec, check_spec

__all__ = ["FamilySpec", "PRESETS", "make_family_model", "llama3_rope_factors"]

FAMILY_ARCHS = ("llama", "qwen2", "qwen3")


@dataclass(slots=True)
class FamilySpec:
    """Architecture, shape, RoPE and storage of the model to write."""

    arch: str = "qwen2"            # "llama" (Llama 3, Mistral), "qwen2" or "qwen3"
    layers: int = 2                # transformer blocks
    embd: int = 64                 # embedding width (n_embd)
    heads: int = 4                 # query heads
    heads_kv: int = 2              # key/value heads
    head_dim: int = 0              # size of a head; 0 = embd / heads (qwen2 and llama need that)
    ff: int = 128                  # feed-forward width
    vocab: int = 64                # vocabulary size, >= 4
    seed: int = 0                  # numpy seed of the weights
    ctx: int = 4096                # {arch}.context_length
    type: str = "f32"              # ggml type of the matrices (maker_common.WEIGHT_TYPES; norms, biases: f32)
    embd_type: str = ""            # ggml type of token_embd and output ("" = type)
    vocab_from: str = ""           # a GGUF whose tokenizer.* keys to copy ("" = the minimal SPM vocabulary)
    rope_freq_base: float = 10000.0  # {arch}.rope.freq_base
    rms_eps: float = 1e-5          # {arch}.attention.layer_norm_rms_epsilon
    tied: bool = False             # no output.weight: the head is token_embd
    qkv_bias: bool = False         # Q/K/V biases (Qwen2 always has them)
    chat_template: str = ""        # tokenizer.chat_template ("" = none; runtime.chat_templates has the published)
    llama3_rope: tuple[float, float, float, int] | None = None  # (factor, low_freq_factor, high_freq_factor,
    #                                original context) of Llama 3's rope scaling: rope_freqs.weight (llama only)
    yarn: tuple[float, int] | None = None  # (factor, original context): rope.scaling.type yarn, as Qwen's
    #                                config.json rope_scaling converts (None: no scaling keys)

    def check(self) -> None:
        """ValueError naming the first value out of its range."""
        if self.arch not in FAMILY_ARCHS:
            raise ValueError(f"arch must be one of {', '.join(FAMILY_ARCHS)}, got {self.arch!r}")
        check_spec(self, ("layers", "embd", "heads", "heads_kv", "ff", "ctx"), ("embd", "ff"))
        if self.head_dim < 0 or self.dim % 2 or (not self.head_dim and self.embd % self.heads):
            raise ValueError(f"head_dim {self.head_dim} (embd {self.embd}, heads {self.heads}) must give an even "
                             "head size")
        if self.arch != "qwen3" and self.dim * self.heads != self.embd:
            raise ValueError(f"{self.arch} needs heads * head_dim == embd, got {self.heads} * {self.dim}")
        if self.arch == "qwen3" and self.qkv_bias:
            raise ValueError("qwen3 has no Q/K/V biases (llama.cpp's loader refuses them)")
        if self.llama3_rope is not None and self.arch != "llama":
            raise ValueError(f"llama3_rope is for arch llama, not {self.arch}")
        if self.yarn is not None and not (self.yarn[0] > 1 and self.yarn[1] >= 1):
            raise ValueError(f"yarn needs a factor > 1 and an original context >= 1, got {self.yarn}")

    @property
    def dim(self) -> int:
        """The head size."""
        return self.head_dim or self.embd // self.heads


# the published small models' settings, scaled down (head ratios, head-size independence, RoPE base, norm epsilon,
# tied head, biases, rope factors); widths are multiples of 32 so that every block type stores them
PRESETS: dict[str, FamilySpec] = {
    # Qwen2.5-0.5B: 14/2 heads of 64, theta 1e6, eps 1e-6, tied, Q/K/V biases
    "qwen2.5-0.5b": FamilySpec(arch="qwen2", layers=2, embd=224, heads=14, heads_kv=2, ff=1216, ctx=32768,
                               rope_freq_base=1e6, rms_eps=1e-6, tied=True, qkv_bias=True),
    # Qwen3-0.6B: 16/8 heads of 128 (n_head * head size = 2 n_embd), theta 1e6, eps 1e-6, tied, Q/K norms
    "qwen3-0.6b": FamilySpec(arch="qwen3", layers=2, embd=128, heads=8, heads_kv=4, head_dim=32, ff=384,
                             ctx=40960, rope_freq_base=1e6, rms_eps=1e-6, tied=True),
    # Llama 3.2 1B: 32/8 heads of 64, theta 500000, tied, llama3 rope scaling (factor 32, 1, 4, 8192)
    "llama3.2-1b": FamilySpec(arch="llama", layers=2, embd=128, heads=8, heads_kv=2, ff=512, ctx=131072,
                              rope_freq_base=500000.0, rms_eps=1e-5, tied=True, llama3_rope=(32.0, 1.0, 4.0, 8192)),
    # Mistral 7B v0.3: 32/8 heads of 128, theta 1e6, separate output; no window (llama.cpp's llama has none)
    "mistral-7b": FamilySpec(arch="llama", layers=2, embd=128, heads=8, heads_kv=2, ff=448, ctx=32768,
                             rope_freq_base=1e6, rms_eps=1e-5),
}


def llama3_rope_factors(dim: int, base: float, factor: float, low: float, high: float, orig_ctx: int) -> np.ndarray:
    """float32 [dim/2]: the frequency divisors of Llama 3's rope scaling, as convert_hf_to_gguf.py computes them
    (1 for wavelengths under orig_ctx/high, ``factor`` over orig_ctx/low, a smooth mix between)."""
    freqs = 1.0 / (np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    low_wavelen, high_wavelen = orig_ctx / low, orig_ctx / high
    out = []
    for freq in freqs.astype(np.float32):
        wavelen = 2 * math.pi / float(freq)
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (orig_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def _write_keys(writer, gguf, spec: FamilySpec) -> int:
    n_vocab = _add_common_keys(writer, gguf, spec, spec.arch)
    if spec.chat_template:
        writer.add_chat_template(spec.chat_template)
    writer.add_rope_dimension_count(spec.dim)
    if spec.dim * spec.heads != spec.embd:
        writer.add_key_length(spec.dim)
        writer.add_value_length(spec.dim)
    if spec.yarn is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(spec.yarn[0])
        writer.add_rope_scaling_orig_ctx_len(spec.yarn[1])
    return n_vocab


def make_family_model(path: str | Path, spec: FamilySpec | str | None = None, **kwargs) -> Path:
    """Write the model of ``spec`` (a :class:`FamilySpec`, a :data:`PRESETS` name, or keyword arguments of
    FamilySpec; with a preset name, keyword arguments replace its fields) to ``path``."""
    import gguf

    if isinstance(spec, str):
        if spec not in PRESETS:
            raise ValueError(f"preset {spec!r} is not one of {', '.join(PRESETS)}")
        spec, kwargs = replace(PRESETS[spec], **kwargs), {}
    spec = _checked_spec(FamilySpec, spec, kwargs)
    path = Path(path)
    rng = np.random.default_rng(spec.seed)

    def normal(rows: int, cols: int) -> np.ndarray:
        return rng.standard_normal((rows, cols)) * (1.6 / math.sqrt(cols))  # [rows, cols]: activations stay O(1)

    def norm_weight(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)      # [n]

    n_q, n_kv, e = spec.dim * spec.heads, spec.dim * spec.heads_kv, spec.embd
    writer = gguf.GGUFWriter(str(path), spec.arch)
    try:
        n_vocab = _write_keys(writer, gguf, spec)
        etype = spec.embd_type or spec.type
        _add_matrix(writer, gguf, "token_embd.weight", rng.standard_normal((n_vocab, e)), etype)
        if spec.llama3_rope is not None:
            writer.add_tensor("rope_freqs.weight", llama3_rope_factors(spec.dim, spec.rope_freq_base,
                                                                       *spec.llama3_rope))
        for il in range(spec.layers):
            b = f"blk.{il}."
            writer.add_tensor(b + "attn_norm.weight", norm_weight(e))
            for name, rows in (("attn_q", n_q), ("attn_k", n_kv), ("attn_v", n_kv)):
                _add_matrix(writer, gguf, b + name + ".weight", normal(rows, e), spec.type)
                if spec.qkv_bias:
                    writer.add_tensor(b + name + ".bias", (0.5 * rng.standard_normal(rows)).astype(np.float32))
            if spec.arch == "qwen3":
                writer.add_tensor(b + "attn_q_norm.weight", norm_weight(spec.dim))
                writer.add_tensor(b + "attn_k_norm.weight", norm_weight(spec.dim))
            _add_matrix(writer, gguf, b + "attn_output.weight", normal(e, n_q), spec.type)
            writer.add_tensor(b + "ffn_norm.weight", norm_weight(e))
            _add_matrix(writer, gguf, b + "ffn_gate.weight", normal(spec.ff, e), spec.type)
            _add_matrix(writer, gguf, b + "ffn_up.weight", normal(spec.ff, e), spec.type)
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
