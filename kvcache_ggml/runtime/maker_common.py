"""What every model maker writes (:mod:`~kvcache_ggml.runtime.modelmaker`: llama, the ``make-model`` command;
:mod:`~kvcache_ggml.runtime.gemma_maker`: Gemma 2/3): the weight types and the checks every spec shares, the
matrices quantized by ggml, the keys every architecture has, and the vocabulary (a minimal SPM one or another
GGUF's tokenizer).  A spec is a ModelSpec, a GemmaSpec or anything with their common fields.
"""
from __future__ import annotations

import numpy as np

from .. import ggml as G

__all__ = ["WEIGHT_TYPES", "check_spec"]

WEIGHT_TYPES = ("f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_K", "q3_K", "q4_K", "q5_K",
                "q6_K", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m", "iq4_nl", "iq4_xs",
                "tq1_0", "tq2_0", "mxfp4")


def check_spec(spec, positive: tuple[str, ...], matrix_widths: tuple[str, ...]) -> None:
    """The checks every model spec shares (ValueError naming the first value out of its range): the fields
    ``positive`` >= 1, a vocabulary of at least 4, heads a multiple of heads_kv, and ``spec.type`` and
    ``spec.embd_type`` WEIGHT_TYPES whose block divides the widths (ggml ne0) of the matrices they store: the
    fields ``matrix_widths`` for ``type``, ``embd`` for ``embd_type``."""
    for name in positive:
        if getattr(spec, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(spec, name)}")
    if spec.vocab < 4:
        raise ValueError(f"vocab must be >= 4 (3 special tokens and a piece), got {spec.vocab}")
    if spec.heads % spec.heads_kv:
        raise ValueError(f"heads {spec.heads} must be a multiple of heads_kv {spec.heads_kv}")
    for key in ("type", "embd_type"):
        t = getattr(spec, key)
        if key == "embd_type" and not t:
            continue
        if t not in WEIGHT_TYPES:
            raise ValueError(f"{key} {t!r} is not one of {', '.join(WEIGHT_TYPES)}")
        block = G.blck_size(t)
        for name in matrix_widths if key == "type" else ("embd",):
            if getattr(spec, name) % block:
                raise ValueError(f"{t} needs {name} to be a multiple of {block}, got {getattr(spec, name)}")


def _file_type(gguf, wtype: str) -> int:
    ft = gguf.LlamaFileType
    name = {"f32": "ALL_F32", "q4_K": "MOSTLY_Q4_K_M", "q3_K": "MOSTLY_Q3_K_M", "q5_K": "MOSTLY_Q5_K_M",
            "mxfp4": "MOSTLY_MXFP4_MOE"}.get(wtype, "MOSTLY_" + wtype.upper())
    return getattr(ft, name, ft.GUESSED)


def _add_matrix(writer, gguf, name: str, w: np.ndarray, wtype: str) -> None:
    """Store w (numpy [rows, cols] = ggml ne [cols, rows]) as wtype, quantized by ggml itself."""
    if wtype == "f32":
        writer.add_tensor(name, w.astype(np.float32))
    elif wtype == "f16":
        writer.add_tensor(name, w.astype(np.float16))
    else:
        q = G.quantize(wtype, w.astype(np.float32), np.ones(w.shape[1], np.float32))  # uint8 [rows, row bytes]
        qtype = gguf.GGMLQuantizationType(int(G.parse_type(wtype)))
        writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)


def _copy_kv(writer, gguf, f, key: str) -> None:
    """Key ``key`` of the GGUFFile f, with its value types."""
    vtype, itype = f.kv_types[key]
    writer.add_key_value(key, f.kv[key], gguf.GGUFValueType(vtype),
                         sub_type=None if itype is None else gguf.GGUFValueType(itype))


def _copy_tokenizer(writer, gguf, path: str) -> int:
    """Every tokenizer.* key of the GGUF at path; returns its vocabulary size."""
    from .._gguf import GGUFFile

    f = GGUFFile(path)
    for key in f.kv:
        if key.startswith("tokenizer."):
            _copy_kv(writer, gguf, f, key)
    n_vocab = len(f.kv.get("tokenizer.ggml.tokens", []))
    if not n_vocab:
        raise ValueError(f"{path}: no tokenizer.ggml.tokens to copy")
    return n_vocab


def _checked_spec(cls: type, spec, kwargs: dict):
    """``spec``, or a ``cls`` from keyword arguments (not both), after its check()."""
    if spec is None:
        spec = cls(**kwargs)
    elif kwargs:
        raise TypeError(f"pass either spec or keyword arguments, not both: {sorted(kwargs)}")
    spec.check()
    return spec


def _add_common_keys(writer, gguf, spec, arch: str, add_vocab=None, name: str = "") -> int:
    """The keys every architecture the maker writes has: name, shape, norm epsilon, RoPE base, file type, vocab
    (``spec``: a ModelSpec or anything with its fields; ``add_vocab(writer, gguf, n_vocab)`` writes the vocabulary
    when no ``vocab_from`` is given, default the minimal SPM one; ``name``: general.name, default
    ``kvcache-ggml-tiny-{arch}``); returns the vocabulary size."""
    writer.add_name(name or f"kvcache-ggml-tiny-{arch}")
    writer.add_context_length(spec.ctx)
    writer.add_embedding_length(spec.embd)
    writer.add_block_count(spec.layers)
    writer.add_feed_forward_length(spec.ff)
    writer.add_head_count(spec.heads)
    writer.add_head_count_kv(spec.heads_kv)
    writer.add_layer_norm_rms_eps(spec.rms_eps)
    writer.add_rope_freq_base(spec.rope_freq_base)
    writer.add_file_type(_file_type(gguf, spec.type))
    if spec.vocab_from:
        return _copy_tokenizer(writer, gguf, spec.vocab_from)
    return (add_vocab or _add_spm_vocab)(writer, gguf, spec.vocab)


def _add_spm_vocab(writer, gguf, n_vocab: int) -> int:
    """<unk>, <s>, </s>, then pieces t0, t1, ... (llama.cpp loads it as an SPM vocabulary)."""
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(n_vocab - 3)])
    writer.add_token_scores([0.0] * n_vocab)
    writer.add_token_types([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
                           + [gguf.TokenType.NORMAL] * (n_vocab - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    return n_vocab
