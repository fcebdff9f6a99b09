"""Reading HParams fields from a GGUF file with the `gguf` package (key names as llama.cpp's llama-arch.cpp)."""
from __future__ import annotations

from os import PathLike
from typing import Any


def _require(kv: dict[str, Any], key: str, path: str) -> Any:
    if key not in kv:
        raise ValueError(f"{path}: GGUF key {key!r} is missing")
    return kv[key]


def _scalar_or_layers(kv: dict[str, Any], key: str, n_layer: int, default: Any, path: str) -> Any:
    v = kv.get(key, default)
    if isinstance(v, list) and len(v) != n_layer:
        raise ValueError(f"{path}: GGUF key {key!r} has {len(v)} entries, expected {n_layer} (block_count)")
    return v


def read_kv(path: str | PathLike) -> dict[str, Any]:
    """Every key/value pair of the GGUF header, values as Python scalars, strings or lists."""
    try:
        from gguf import GGUFReader
    except ImportError as e:  # the `test` extra installs it
        raise ImportError("reading GGUF files needs the `gguf` package: pip install gguf") from e
    reader = GGUFReader(str(path))
    out: dict[str, Any] = {}
    for name, fld in reader.fields.items():
        if name.startswith("GGUF."):
            continue  # header fields of the file format itself
        out[name] = fld.contents()
    return out


def read_hparams_fields(path: str | PathLike) -> dict[str, Any]:
    """The HParams keyword arguments of a llama-family GGUF model."""
    from .hparams import RopeType, SwaType, _NEOX_ARCHS, _NO_ROPE_ARCHS

    p = str(path)
    kv = read_kv(path)
    arch = _require(kv, "general.architecture", p)
    a = f"{arch}."
    n_layer = int(_require(kv, a + "block_count", p))
    n_embd = int(_require(kv, a + "embedding_length", p))
    n_head = _scalar_or_layers(kv, a + "attention.head_count", n_layer, None, p)
    if n_head is None:
        raise ValueError(f"{p}: GGUF key {a + 'attention.head_count'!r} is missing")
    n_head_kv = _scalar_or_layers(kv, a + "attention.head_count_kv", n_layer, n_head, p)
    n_head0 = n_head[0] if isinstance(n_head, list) else n_head
    if n_head0 <= 0 and a + "attention.key_length" not in kv:
        raise ValueError(f"{p}: head_count of layer 0 is {n_head0}; need > 0 or an explicit key_length")
    n_embd_head_k = int(kv.get(a + "attention.key_length", n_embd // max(n_head0, 1)))
    n_embd_head_v = int(kv.get(a + "attention.value_length", n_embd_head_k))
    scale = float(kv.get(a + "rope.scaling.factor", kv.get(a + "rope.scale_linear", 0.0)))
    n_swa = int(kv.get(a + "attention.sliding_window", 0))
    pattern = kv.get(a + "attention.sliding_window_pattern")
    fields: dict[str, Any] = dict(
        arch=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_embd_head_k=n_embd_head_k,
        n_embd_head_v=n_embd_head_v,
        n_head_arr=n_head,
        n_head_kv_arr=n_head_kv,
        n_rot=int(kv.get(a + "rope.dimension_count", n_embd_head_k)),
        rope_type=(RopeType.NONE if arch in _NO_ROPE_ARCHS else
                   RopeType.NEOX if arch in _NEOX_ARCHS else RopeType.NORM),
        rope_freq_base_train=float(kv.get(a + "rope.freq_base", 10000.0)),
        rope_freq_scale_train=1.0 if scale == 0.0 else 1.0 / scale,
        n_ctx_train=int(_require(kv, a + "context_length", p)),
        n_swa=n_swa,
        swa_type=SwaType.STANDARD if n_swa > 0 else SwaType.NONE,
        f_norm_rms_eps=float(kv.get(a + "attention.layer_norm_rms_epsilon", 1e-5)),
        n_rel_attn_bkts=int(kv.get(a + "attention.relative_buckets_count", 0)),
    )
    if n_swa > 0:
        if isinstance(pattern, list):
            fields["swa_layers"] = _scalar_or_layers(kv, a + "attention.sliding_window_pattern", n_layer, None, p)
        elif pattern is not None:
            fields["swa_pattern_period"] = int(pattern)
        else:
            fields["swa_layers"] = True
    if a + "vocab_size" in kv:
        fields["n_vocab"] = int(kv[a + "vocab_size"])
    elif "tokenizer.ggml.tokens" in kv:
        fields["n_vocab"] = len(kv["tokenizer.ggml.tokens"])
    return fields
