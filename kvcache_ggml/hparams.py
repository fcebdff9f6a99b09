"""Model hyper-parameters: the part of llama.cpp's `llama_hparams` the KV cache reads.

Semantics follow llama-hparams.h/.cpp of llama.cpp; as in the seed, one `n_embd_head_k`/`n_embd_head_v` serves
every layer, while head counts and the SWA flag are per layer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum
from os import PathLike
from typing import Any, Sequence

import numpy as np

from ._gguf import read_kv

LLAMA_MAX_LAYERS = 512  # llama-hparams.h
_INT32_MAX = 2**31 - 1
_REL_POS_MAX_DISTANCE = 128  # llama_relative_position_bucket's max_distance


class RopeType(IntEnum):
    """enum llama_rope_type (llama.h); the non-negative values are ggml's GGML_ROPE_TYPE_* modes."""
    NONE = -1
    NORM = 0
    NEOX = 2  # GGML_ROPE_TYPE_NEOX
    MROPE = 8  # GGML_ROPE_TYPE_MROPE
    VISION = 24  # GGML_ROPE_TYPE_VISION
    IMROPE = 40  # GGML_ROPE_TYPE_IMROPE


class SwaType(IntEnum):
    """enum llama_swa_type (llama-hparams.h)."""
    NONE = 0
    STANDARD = 1  # key masked when p1 - p0 >= n_swa
    CHUNKED = 2  # key masked when it lies before the query's chunk of n_swa positions
    SYMMETRIC = 3  # key masked when |p1 - p0| > n_swa / 2


# llama_model_rope_type() for the architectures from_gguf knows; others default to NORM
_NEOX_ARCHS = frozenset({
    "falcon", "grok", "dbrx", "bert", "stablelm", "bitnet", "qwen", "qwen2", "qwen2moe", "qwen3", "qwen3moe",
    "olmo2", "olmoe", "phi2", "phi3", "phimoe", "plamo", "gemma", "gemma2", "gemma3", "gemma3n", "starcoder2",
    "openelm", "gptneox", "codeshell", "orion", "nemotron", "exaone", "minicpm3", "seed_oss", "smallthinker",
})
_NO_ROPE_ARCHS = frozenset({"gpt2", "gptj", "mpt", "refact", "bloom", "mamba", "mamba2", "t5", "t5encoder", "jais"})


def _check_layer(il: int, n_layer: int) -> None:
    if not 0 <= il < n_layer:
        raise ValueError(f"layer index il={il} out of range [0, n_layer={n_layer})")


# ---- the sliding-window rule (llama_hparams::is_masked_swa): its one scalar form and its one vectorised form; every
# caller -- the mask, the slot search over cells a window left behind, the checked public functions -- uses these

_STANDARD, _CHUNKED, _SYMMETRIC = int(SwaType.STANDARD), int(SwaType.CHUNKED), int(SwaType.SYMMETRIC)


def swa_masked(swa_type: int, n_swa: int, p0: int, p1: int) -> bool:
    """Whether the key at position ``p0`` is outside the window of the query at ``p1``, for ints and unchecked
    (p0, p1 >= 0; CHUNKED needs n_swa > 0)."""
    if swa_type == _STANDARD:
        return p1 - p0 >= n_swa
    if swa_type == _CHUNKED:
        return p0 < (p1 // n_swa) * n_swa
    if swa_type == _SYMMETRIC:
        half = n_swa >> 1
        return p1 - p0 < -half or p1 - p0 > half
    return False


def swa_bounds(swa_type: int, n_swa: int, p1: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The window of each query position ``p1`` as bounds: int64 ``lo``, ``hi`` such that a key at ``p0`` is
    inside exactly when ``lo <= p0 <= hi`` (None: no bound on that side).  Unchecked, as :func:`swa_masked`; the
    chunk of a negative position is C's (division truncated toward zero)."""
    p = np.asarray(p1, dtype=np.int64)
    if swa_type == SwaType.STANDARD:
        return p - n_swa + 1, None
    if swa_type == SwaType.CHUNKED:
        return np.where(p >= 0, p // n_swa, -((-p) // n_swa)) * n_swa, None
    if swa_type == SwaType.SYMMETRIC:
        half = n_swa >> 1
        return p - half, p + half
    return None, None


def _check_swa(n_swa: int, swa_type: SwaType | int) -> SwaType:
    swa_type = SwaType(swa_type)
    if swa_type == SwaType.CHUNKED and n_swa <= 0:
        raise ValueError(f"CHUNKED sliding window needs n_swa > 0, got {n_swa}")
    return swa_type


def is_masked_swa(n_swa: int, swa_type: SwaType | int, p0: int, p1: int) -> bool:
    """Whether the key at position p0 is outside the sliding window of the query at position p1 (checked)."""
    if p0 < 0 or p1 < 0:
        raise ValueError(f"positions must be >= 0, got p0={p0}, p1={p1}")
    return swa_masked(_check_swa(n_swa, swa_type), n_swa, p0, p1)


def is_masked_swa_np(n_swa: int, swa_type: SwaType | int, p0: np.ndarray, p1: int | np.ndarray) -> np.ndarray:
    """is_masked_swa over arrays (broadcast p0 against p1); a bool array (checked)."""
    p0 = np.asarray(p0, dtype=np.int64)
    p1 = np.asarray(p1, dtype=np.int64)
    if (p0 < 0).any() or (p1 < 0).any():
        raise ValueError(f"positions must be >= 0, got min p0={p0.min(initial=0)}, min p1={p1.min(initial=0)}")
    shape = np.broadcast_shapes(p0.shape, p1.shape)
    lo, hi = swa_bounds(_check_swa(n_swa, swa_type), n_swa, p1)
    masked = np.zeros(shape, dtype=bool)
    if lo is not None:
        masked |= p0 < lo
    if hi is not None:
        masked |= p0 > hi
    return masked


@dataclass(slots=True)
class HParams:
    n_layer: int  # number of transformer layers
    n_embd: int  # embedding width
    n_embd_head_k: int  # dimension of a key head (d_k), all layers
    n_embd_head_v: int  # dimension of a value head (d_v), all layers
    n_head_arr: tuple[int, ...]  # query heads, per layer
    n_head_kv_arr: tuple[int, ...]  # key/value heads, per layer (0: layer without attention)
    n_rot: int  # number of rotated dimensions of a head (RoPE)
    rope_type: RopeType = RopeType.NORM  # RoPE variant; NONE for models without RoPE
    rope_freq_base_train: float = 10000.0  # RoPE base frequency
    rope_freq_scale_train: float = 1.0  # RoPE frequency scale (1 / linear scaling factor)
    rope_scaling_type_train: int = 1  # {arch}.rope.scaling.type, enum llama_rope_scaling_type (1: linear, 2: yarn)
    n_ctx_train: int = 4096  # context size the model was trained on
    n_swa: int = 0  # sliding window size (0: none)
    swa_type: SwaType = SwaType.NONE  # how the window masks
    swa_layers: tuple[bool, ...] = ()  # per layer: True = SWA layer; () = all dense
    n_layer_kv_from_start: int = -1  # >= 0: only the first n layers have a KV cache; -1: all layers
    use_alibi: bool = False  # ALiBi position bias instead of RoPE
    n_rel_attn_bkts: int = 0  # relative attention buckets (T5); 0 = none
    n_vocab: int = 0  # vocabulary size (0: unknown)
    f_norm_rms_eps: float = 1e-5  # RMS norm epsilon
    no_alloc: bool = False  # create tensors without allocating their data
    arch: str = field(default="llama")  # general.architecture of the model
    n_ctx_orig_yarn: int = 0  # {arch}.rope.scaling.original_context_length (0: absent, n_ctx_train serves)
    rope_attn_factor: float = 1.0  # {arch}.rope.scaling.attn_factor: RoPE'd Q and K scaled by it (Phi-3 LongRoPE)

    def __post_init__(self) -> None:
        if not 1 <= self.n_layer <= LLAMA_MAX_LAYERS:
            raise ValueError(f"n_layer={self.n_layer} out of range [1, {LLAMA_MAX_LAYERS}]")
        self.n_head_arr = self._per_layer("n_head_arr", self.n_head_arr, int)
        self.n_head_kv_arr = self._per_layer("n_head_kv_arr", self.n_head_kv_arr, int)
        self.swa_layers = self._per_layer("swa_layers", self.swa_layers or (False,) * self.n_layer, bool)
        for name in ("n_embd", "n_embd_head_k", "n_embd_head_v", "n_rot", "n_ctx_train", "n_swa",
                     "n_rel_attn_bkts", "n_vocab"):
            v = getattr(self, name)
            if not 0 <= v <= _INT32_MAX:
                raise ValueError(f"{name}={v} out of range [0, {_INT32_MAX}]")
        for name, arr in (("n_head_arr", self.n_head_arr), ("n_head_kv_arr", self.n_head_kv_arr)):
            bad = [(il, v) for il, v in enumerate(arr) if not 0 <= v <= _INT32_MAX]
            if bad:
                raise ValueError(f"{name}[{bad[0][0]}]={bad[0][1]} out of range [0, {_INT32_MAX}]")
        if self.n_rot > self.n_embd_head_k:
            raise ValueError(f"n_rot={self.n_rot} exceeds n_embd_head_k={self.n_embd_head_k}")
        if not -1 <= self.n_layer_kv_from_start <= self.n_layer:
            raise ValueError(f"n_layer_kv_from_start={self.n_layer_kv_from_start} out of range "
                             f"[-1, n_layer={self.n_layer}]")
        self.rope_type = RopeType(self.rope_type)
        self.swa_type = SwaType(self.swa_type)
        if self.swa_type == SwaType.CHUNKED and self.n_swa == 0 and any(self.swa_layers):
            raise ValueError("swa_type=CHUNKED needs n_swa > 0 (the chunk size), got n_swa=0")

    def _per_layer(self, name: str, values: int | Sequence, kind: type) -> tuple:
        if isinstance(values, (int, bool, np.integer)):
            return (kind(values),) * self.n_layer
        out = tuple(kind(v) for v in values)
        if len(out) != self.n_layer:
            raise ValueError(f"{name} has {len(out)} entries, expected one per layer (n_layer={self.n_layer})")
        return out

    # ---- constructors ----------------------------------------------------------------------------------------

    @classmethod
    def simple(cls, n_layer: int, n_embd_head: int, n_head: int | Sequence[int], n_head_kv: int | Sequence[int],
               *, n_embd_head_v: int | None = None, n_rot: int | None = None, n_embd: int | None = None,
               **kwargs) -> "HParams":
        """A model with n_layer layers of heads of n_embd_head dims; n_embd defaults to n_head * n_embd_head."""
        first_n_head = n_head if isinstance(n_head, int) else n_head[0]
        return cls(n_layer=n_layer,
                   n_embd=n_embd if n_embd is not None else first_n_head * n_embd_head,
                   n_embd_head_k=n_embd_head,
                   n_embd_head_v=n_embd_head if n_embd_head_v is None else n_embd_head_v,
                   n_head_arr=n_head, n_head_kv_arr=n_head_kv,  # type: ignore[arg-type]
                   n_rot=n_embd_head if n_rot is None else n_rot, **kwargs)

    @classmethod
    def from_gguf(cls, path: str | PathLike, **overrides) -> "HParams":
        """Read the llama-family hyper-parameters of a GGUF model file (keys `{arch}.block_count`, ...).

        SWA: `{arch}.attention.sliding_window` > 0 gives swa_type STANDARD with every layer SWA, unless
        `{arch}.attention.sliding_window_pattern` gives the per-layer flags (array) or the pattern period (int).
        """
        fields = _gguf_fields(path)
        fields.update(overrides)
        n_pattern = fields.pop("swa_pattern_period", None)
        hp = cls(**fields)
        if n_pattern is not None and "swa_layers" not in overrides:
            hp.set_swa_pattern(n_pattern)
        return hp

    # ---- per-layer queries (llama-hparams.cpp) ---------------------------------------------------------------

    def n_head(self, il: int = 0) -> int:
        _check_layer(il, self.n_layer)
        return self.n_head_arr[il]

    def n_head_kv(self, il: int = 0) -> int:
        _check_layer(il, self.n_layer)
        return self.n_head_kv_arr[il]

    def n_gqa(self, il: int = 0) -> int:
        """Query heads per key/value head (0 for a layer without key/value heads)."""
        n_head_kv = self.n_head_kv(il)
        return 0 if n_head_kv == 0 else self.n_head(il) // n_head_kv

    def n_embd_k_gqa(self, il: int = 0) -> int:
        """Key width across all key/value heads of layer il."""
        return self.n_embd_head_k * self.n_head_kv(il)

    def n_embd_v_gqa(self, il: int = 0) -> int:
        """Value width across all key/value heads of layer il."""
        return self.n_embd_head_v * self.n_head_kv(il)

    def is_n_embd_k_gqa_variable(self) -> bool:
        return any(self.n_embd_k_gqa(il) != self.n_embd_k_gqa(0) for il in range(self.n_layer))

    def is_n_embd_v_gqa_variable(self) -> bool:
        return any(self.n_embd_v_gqa(il) != self.n_embd_v_gqa(0) for il in range(self.n_layer))

    def n_embd_k_gqa_max(self) -> int:
        return max(self.n_embd_k_gqa(il) for il in range(self.n_layer))

    def n_embd_v_gqa_max(self) -> int:
        return max(self.n_embd_v_gqa(il) for il in range(self.n_layer))

    def has_kv(self, il: int) -> bool:
        """Whether layer il has a KV cache: all layers, or the first n_layer_kv_from_start when that is >= 0."""
        _check_layer(il, self.n_layer)
        if self.n_layer_kv_from_start >= 0:
            return il < self.n_layer_kv_from_start
        return True

    def n_layer_kv(self) -> int:
        """Number of layers with a KV cache."""
        return sum(self.has_kv(il) for il in range(self.n_layer))

    def is_swa(self, il: int) -> bool:
        _check_layer(il, self.n_layer)
        return self.swa_layers[il]

    def is_swa_any(self) -> bool:
        return any(self.swa_layers)

    def set_swa_pattern(self, n_pattern: int, dense_first: bool = False) -> None:
        """Every n_pattern-th layer dense, the others SWA (n_pattern 0: all SWA, 1: all dense); as llama.cpp."""
        if n_pattern < 0:
            raise ValueError(f"n_pattern={n_pattern} must be >= 0")
        if dense_first:
            flags = (n_pattern == 0 or il % n_pattern != 0 for il in range(self.n_layer))
        else:
            flags = (n_pattern == 0 or il % n_pattern < n_pattern - 1 for il in range(self.n_layer))
        self.swa_layers = tuple(flags)

    def n_pos_per_embd(self) -> int:
        """Positions per token: 4 for M-RoPE / interleaved M-RoPE, else 1."""
        return 4 if self.rope_type in (RopeType.MROPE, RopeType.IMROPE) else 1

    # ---- sliding-window masks (llama-hparams.h) ---------------------------------------------------------------

    is_masked_swa = staticmethod(is_masked_swa)  # llama_hparams::is_masked_swa
    is_masked_swa_np = staticmethod(is_masked_swa_np)


# ---- HParams.from_gguf: the GGUF keys ------------------------------------------------------------------------

def _require(kv: dict[str, Any], key: str, path: str) -> Any:
    if key not in kv:
        raise ValueError(f"{path}: GGUF key {key!r} is missing")
    return kv[key]


def _scalar_or_layers(kv: dict[str, Any], key: str, n_layer: int, default: Any, path: str) -> Any:
    v = kv.get(key, default)
    if isinstance(v, list) and len(v) != n_layer:
        raise ValueError(f"{path}: GGUF key {key!r} has {len(v)} entries, expected {n_layer} (block_count)")
    return v


# llama_rope_scaling_type_from_string: {arch}.rope.scaling.type -> enum llama_rope_scaling_type
_ROPE_SCALING_TYPES = {"none": 0, "linear": 1, "yarn": 2, "longrope": 3}


def _rope_scaling_type(kv: dict[str, Any], a: str, path: str) -> int:
    """The file's RoPE scaling type ("linear" when absent, as llama.cpp's loader); ValueError for one llama.cpp
    does not know (its loader asserts)."""
    name = str(kv.get(a + "rope.scaling.type", "linear"))
    if name not in _ROPE_SCALING_TYPES:
        raise ValueError(f"{path}: rope scaling type {name!r} is unknown (known: {', '.join(_ROPE_SCALING_TYPES)})")
    return _ROPE_SCALING_TYPES[name]


def _gguf_fields(path: str | PathLike) -> dict[str, Any]:
    """The HParams keyword arguments of a llama-family GGUF model (:meth:`HParams.from_gguf`)."""
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
        rope_scaling_type_train=_rope_scaling_type(kv, a, p),
        n_ctx_train=int(_require(kv, a + "context_length", p)),
        n_swa=n_swa,
        swa_type=SwaType.STANDARD if n_swa > 0 else SwaType.NONE,
        f_norm_rms_eps=float(kv.get(a + "attention.layer_norm_rms_epsilon", 1e-5)),
        n_rel_attn_bkts=int(kv.get(a + "attention.relative_buckets_count", 0)),
        n_ctx_orig_yarn=int(kv.get(a + "rope.scaling.original_context_length", 0)),
        rope_attn_factor=float(kv.get(a + "rope.scaling.attn_factor", 1.0)),
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


def _rel_bucket_params(n_buckets: int, bidirectional: bool) -> tuple[int, int]:
    if n_buckets < 0:
        raise ValueError(f"n_buckets={n_buckets} must be >= 0")
    half = n_buckets >> 1 if bidirectional else n_buckets
    max_exact = half >> 1
    if max_exact < 1:
        raise ValueError(f"n_buckets={n_buckets} too small: need >= {4 if bidirectional else 2} "
                         f"(bidirectional={bidirectional}) for llama.cpp's bucket formula")
    return half, max_exact


def llama_relative_position_bucket(x: int, y: int, n_buckets: int, bidirectional: bool) -> int:
    """T5's relative position bucket of key position x for query position y, as llama.cpp computes it.

    The large-distance branch uses llama.cpp's mixed precision: a float log of a double ratio, a float product,
    a double division and a float floor.
    """
    n, max_exact = _rel_bucket_params(n_buckets, bidirectional)
    rel = x - y
    bucket = 0
    if bidirectional:
        bucket += n if rel > 0 else 0
        rel = abs(rel)
    else:
        rel = -min(rel, 0)
    if rel < max_exact:
        return bucket + rel
    log_f = np.float32(math.log(float(np.float32(rel / max_exact))))  # logf(1.0 * rel / max_exact)
    prod_f = np.float32(log_f * np.float32(n - max_exact))  # float * (uint64 -> float)
    large = float(np.floor(np.float32(max_exact + float(prod_f) / math.log(_REL_POS_MAX_DISTANCE / max_exact))))
    return bucket + min(int(large), n - 1)


def llama_relative_position_bucket_np(x: np.ndarray | int, y: np.ndarray | int, n_buckets: int,
                                      bidirectional: bool) -> np.ndarray:
    """llama_relative_position_bucket over arrays (x and y broadcast); int32 array."""
    n, max_exact = _rel_bucket_params(n_buckets, bidirectional)
    rel = np.asarray(x, dtype=np.int64) - np.asarray(y, dtype=np.int64)
    if bidirectional:
        bucket = np.where(rel > 0, n, 0)
        rel = np.abs(rel)
    else:
        bucket = np.zeros_like(rel)
        rel = -np.minimum(rel, 0)
    with np.errstate(divide="ignore"):
        ratio_f = (rel / max_exact).astype(np.float32)
        log_f = np.log(ratio_f.astype(np.float64)).astype(np.float32)
    prod_f = (log_f * np.float32(n - max_exact)).astype(np.float32)
    with np.errstate(invalid="ignore"):
        large_f = np.floor((max_exact + prod_f.astype(np.float64) / math.log(_REL_POS_MAX_DISTANCE / max_exact))
                           .astype(np.float32))
        large = np.minimum(np.where(rel < max_exact, 0, large_f).astype(np.int64), n - 1)
    return (bucket + np.where(rel < max_exact, rel, large)).astype(np.int32)
