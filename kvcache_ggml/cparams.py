"""Context parameters: what a user sets (llama.cpp's ``llama_context_params``) and what a context resolves them to
(``llama_cparams``).

:class:`ContextParams` is the one parameter object of a :class:`~kvcache_ggml.runtime.context.Context`: the fields
of ``llama_context_params`` this project honours, with llama.cpp's names, defaults and "unset" sentinels (0 for the
sizes and RoPE base/scale, negative for the YaRN factors, UNSPECIFIED for the enums), then a few settings of this
project's own runtime (graph reuse and caching, the fast paths).  :meth:`ContextParams.check` validates them all.
:meth:`CParams.from_hparams` resolves them against the model's hyper-parameters the way the ``llama_context``
constructor does.  Hyper-parameters that this project's :class:`~kvcache_ggml.hparams.HParams` does not carry (YaRN
settings, the training RoPE scaling type) take the values llama.cpp's model loader gives a GGUF file without those
keys.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np

from ._consts import LLAMA_MAX_SEQ

__all__ = ["AttentionType", "CParams", "ContextParams", "RopeScalingType", "GGML_DEFAULT_N_THREADS"]

#: ggml.h's default thread count, llama_context_default_params' n_threads and n_threads_batch
GGML_DEFAULT_N_THREADS = 4

_N_CTX_PAD = 256  # llama_context pads n_ctx (and n_ctx_seq) to a multiple of this


class RopeScalingType(IntEnum):
    """enum llama_rope_scaling_type (llama.h)."""
    UNSPECIFIED = -1
    NONE = 0
    LINEAR = 1
    YARN = 2
    LONGROPE = 3


class AttentionType(IntEnum):
    """enum llama_attention_type (llama.h)."""
    UNSPECIFIED = -1
    CAUSAL = 0
    NON_CAUSAL = 1


@dataclass(slots=True)
class ContextParams:
    """What a user sets for a context: ``llama_context_params`` with llama_context_default_params(), then this
    project's runtime settings.  Validated by :meth:`check` (a Context checks them before it allocates)."""

    n_ctx: int = 512                  # context size in tokens, all sequences together; 0 = the model's n_ctx_train
    n_batch: int = 2048               # logical batch: most tokens one decode() accepts (capped at n_ctx if causal)
    n_ubatch: int = 512               # physical batch: most tokens one graph computes; 0 = n_batch
    n_seq_max: int = 1                # sequences the context serves (1..256)
    n_threads: int = GGML_DEFAULT_N_THREADS        # CPU threads for one-token graphs (and the K-shift)
    n_threads_batch: int = GGML_DEFAULT_N_THREADS  # CPU threads for graphs of several tokens
    rope_scaling_type: RopeScalingType = RopeScalingType.UNSPECIFIED  # UNSPECIFIED = the model's
    attention_type: AttentionType = AttentionType.UNSPECIFIED          # UNSPECIFIED = the model's (causal)
    rope_freq_base: float = 0.0       # RoPE base frequency; 0 = the model's
    rope_freq_scale: float = 0.0      # RoPE frequency scale; 0 = the model's
    yarn_ext_factor: float = -1.0     # YaRN extrapolation mix; negative = the model's
    yarn_attn_factor: float = -1.0    # YaRN magnitude scale; negative = the model's
    yarn_beta_fast: float = -1.0      # YaRN low correction dim; negative = the model's
    yarn_beta_slow: float = -1.0      # YaRN high correction dim; negative = the model's
    yarn_orig_ctx: int = 0            # YaRN original context; 0 = the model's
    type_k: str = "f16"               # ggml type of the K cache
    type_v: str = "f16"               # ggml type of the V cache
    embeddings: bool = False          # extract embeddings (resolved into CParams; the runtime returns logits)
    offload_kqv: bool = True          # K/V of layer il on the model's dev_layer(il) (the CPU by default)
    flash_attn: bool = True           # ggml_flash_attn_ext over a non-transposed V; else mul_mat + soft_max
    #                                   (llama.cpp's default, AUTO, enables it where supported)
    no_perf: bool = True              # no host timings: StepTimes keeps its counts, its seconds stay 0 (False
    #                                   measures each phase of each step)
    op_offload: bool = True           # offload host-tensor ops to the device (with a device backend)
    swa_full: bool = True             # sliding-window models: a full-size SWA cache
    kv_unified: bool = False          # one cache stream shared by all sequences; else one stream per sequence
    # -- this project's runtime, not in llama_context_params
    fa_cast_f32_kv: bool = False      # cast an F32 K/V cache to F16 before flash attention, as llama.cpp does
    graph_reuse: bool = True          # compute the previous graph again when its topology fits the ubatch
    graph_cache: int = 16             # small graphs kept by topology, each allocated in its own scheduler, so a
    #                                   step of a shape seen before computes its graph without building it (0: the
    #                                   previous graph alone, as llama.cpp); GraphCache
    graph_cache_tokens: int = 32      # graphs of at most this many tokens are kept (the decode steps)
    fast_paths: bool = True           # the decode step's fast paths (allocator, bookkeeping, inputs, fused step);
    #                                   False: the general code alone, the same results (the equivalence tests)

    def check(self) -> None:
        """ValueError naming the first field out of its range (nothing is changed)."""
        for name in ("n_batch", "n_seq_max", "n_threads", "n_threads_batch", "graph_cache_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name, why in (("n_ctx", "0: the model's training context"), ("n_ubatch", "0: n_batch"),
                          ("yarn_orig_ctx", "0: the model's"), ("rope_freq_base", "0: the model's"),
                          ("rope_freq_scale", "0: the model's"), ("graph_cache", "0: the previous graph alone")):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 ({why}), got {getattr(self, name)}")
        if self.n_seq_max > LLAMA_MAX_SEQ:
            raise ValueError(f"n_seq_max must be <= {LLAMA_MAX_SEQ}, got {self.n_seq_max}")
        for name, enum in (("rope_scaling_type", RopeScalingType), ("attention_type", AttentionType)):
            if getattr(self, name) not in set(enum):
                raise ValueError(f"{name} must be one of {[int(e) for e in enum]} ({enum.__name__}), "
                                 f"got {getattr(self, name)!r}")
        from .ggml import parse_type  # the binding's table of type names (no ggml call)
        for name in ("type_k", "type_v"):
            try:
                parse_type(getattr(self, name))
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None


@dataclass(slots=True)
class CParams:
    """llama.cpp's ``llama_cparams`` (llama-cparams.h): the resolved per-context settings.

    The defaults are what :meth:`from_hparams` gives for ``ContextParams()`` and a model with llama.cpp's default
    hyper-parameters (n_ctx_train 4096, RoPE base 10000, no scaling).
    """

    n_ctx: int = 512                      # context size used during inference (multiple of 256)
    n_ctx_seq: int = 512                  # context of one sequence (n_ctx, or n_ctx / n_seq_max padded to 256)
    n_batch: int = 512                    # logical batch size
    n_ubatch: int = 512                   # physical batch size
    n_seq_max: int = 1                    # sequences served
    n_threads: int = GGML_DEFAULT_N_THREADS        # threads for generation, and for the K-shift graph
    n_threads_batch: int = GGML_DEFAULT_N_THREADS  # threads for batch processing
    rope_freq_base: float = 10000.0       # RoPE base frequency (non-SWA layers)
    rope_freq_scale: float = 1.0          # RoPE frequency scale (non-SWA layers)
    n_ctx_orig_yarn: int = 4096           # original context of YaRN (the training context unless set)
    yarn_ext_factor: float = 0.0          # YaRN extrapolation mix (0: no YaRN ramp)
    yarn_attn_factor: float = 1.0         # YaRN magnitude scale (with llama.cpp's mscale compensation folded in)
    yarn_beta_fast: float = 32.0          # YaRN low correction dim
    yarn_beta_slow: float = 1.0           # YaRN high correction dim
    embeddings: bool = False              # extract embeddings
    causal_attn: bool = True              # causal attention
    offload_kqv: bool = True              # KQV ops and the KV cache on the device
    flash_attn: bool = True               # flash attention
    no_perf: bool = True                  # no performance timings
    warmup: bool = False                  # warm-up run in progress
    op_offload: bool = True               # offload host-tensor ops to the device
    kv_unified: bool = False              # one KV stream shared by all sequences

    @classmethod
    def from_hparams(cls, hparams: Any, params: ContextParams | None = None) -> "CParams":
        """Resolve ``params`` against the model, as the llama_context constructor does."""
        p = params if params is not None else ContextParams()
        p.check()
        _check_cache_types(p, hparams)
        h = _ModelRope.of(hparams)
        c = cls()
        c.n_seq_max = max(1, p.n_seq_max)
        c.n_threads, c.n_threads_batch = p.n_threads, p.n_threads_batch
        c.yarn_ext_factor = p.yarn_ext_factor if p.yarn_ext_factor >= 0 else h.yarn_ext_factor
        c.yarn_attn_factor = p.yarn_attn_factor if p.yarn_attn_factor >= 0 else h.yarn_attn_factor
        c.yarn_beta_fast = p.yarn_beta_fast if p.yarn_beta_fast >= 0 else h.yarn_beta_fast
        c.yarn_beta_slow = p.yarn_beta_slow if p.yarn_beta_slow >= 0 else h.yarn_beta_slow
        c.embeddings, c.offload_kqv, c.no_perf, c.warmup = p.embeddings, p.offload_kqv, p.no_perf, False
        c.n_ctx = p.n_ctx if p.n_ctx != 0 else h.n_ctx_train
        c.rope_freq_base = p.rope_freq_base if p.rope_freq_base != 0 else h.rope_freq_base_train
        c.rope_freq_scale = p.rope_freq_scale if p.rope_freq_scale != 0 else h.rope_freq_scale_train
        c.n_ctx_orig_yarn = (p.yarn_orig_ctx if p.yarn_orig_ctx != 0 else
                             h.n_ctx_orig_yarn if h.n_ctx_orig_yarn != 0 else h.n_ctx_train)
        _resolve_yarn(c, p, h)
        c.causal_attn = (h.causal_attn if p.attention_type == AttentionType.UNSPECIFIED else
                         p.attention_type == AttentionType.CAUSAL)
        c.flash_attn = p.flash_attn
        c.n_batch = min(c.n_ctx, p.n_batch) if c.causal_attn else p.n_batch
        c.n_ubatch = min(c.n_batch, p.n_ubatch if p.n_ubatch != 0 else p.n_batch)
        c.op_offload, c.kv_unified = p.op_offload, p.kv_unified
        _resolve_ctx_sizes(c)
        return c


def _check_cache_types(p: ContextParams, hparams: Any) -> None:
    """llama_init_from_model's refusals of the K/V cache types: a quantized V needs flash attention (a transposed V
    is written one value at a time, which no block type holds: llama.cpp's release build writes nothing, its debug
    build asserts), and a block type's size must divide the head size the cache is viewed in."""
    from .ggml import blck_size, is_quantized, type_name

    if is_quantized(p.type_v) and not p.flash_attn:
        raise ValueError(f"V cache quantization requires flash_attn (type_v {type_name(p.type_v)})")
    for which, t in (("k", p.type_k), ("v", p.type_v)):
        head, blck = getattr(hparams, f"n_embd_head_{which}", None), blck_size(t)
        if isinstance(head, int) and head % blck:
            raise ValueError(f"{which.upper()} cache type {type_name(t)} with block size {blck} does not divide "
                             f"n_embd_head_{which}={head}")


@dataclass(slots=True)
class _ModelRope:
    """The model hyper-parameters from_hparams reads, with llama.cpp's loader defaults for missing ones."""

    n_ctx_train: int                      # training context
    n_ctx_orig_yarn: int                  # YaRN original context (loader: n_ctx_train unless in the GGUF)
    rope_freq_base_train: float           # training RoPE base
    rope_freq_scale_train: float          # training RoPE scale
    rope_scaling_type_train: RopeScalingType  # training scaling type (loader default: "linear")
    rope_attn_factor: float               # extra attention factor (1.0)
    rope_yarn_log_mul: float              # DeepSeek-style mscale_all_dims (0.0: none)
    yarn_ext_factor: float                # -1.0: not set
    yarn_attn_factor: float               # 1.0
    yarn_beta_fast: float                 # 32.0
    yarn_beta_slow: float                 # 1.0
    causal_attn: bool                     # True
    arch: str                             # architecture name

    @classmethod
    def of(cls, hp: Any) -> "_ModelRope":
        n_ctx_train = int(getattr(hp, "n_ctx_train", 0))
        return cls(n_ctx_train=n_ctx_train,
                   n_ctx_orig_yarn=int(getattr(hp, "n_ctx_orig_yarn", n_ctx_train)),
                   rope_freq_base_train=float(getattr(hp, "rope_freq_base_train", 10000.0)),
                   rope_freq_scale_train=float(getattr(hp, "rope_freq_scale_train", 1.0)),
                   rope_scaling_type_train=RopeScalingType(getattr(hp, "rope_scaling_type_train",
                                                                   RopeScalingType.LINEAR)),
                   rope_attn_factor=float(getattr(hp, "rope_attn_factor", 1.0)),
                   rope_yarn_log_mul=float(getattr(hp, "rope_yarn_log_mul", 0.0)),
                   yarn_ext_factor=float(getattr(hp, "yarn_ext_factor", -1.0)),
                   yarn_attn_factor=float(getattr(hp, "yarn_attn_factor", 1.0)),
                   yarn_beta_fast=float(getattr(hp, "yarn_beta_fast", 32.0)),
                   yarn_beta_slow=float(getattr(hp, "yarn_beta_slow", 1.0)),
                   causal_attn=bool(getattr(hp, "causal_attn", True)),
                   arch=str(getattr(hp, "arch", "")))


def _f32(x: float) -> float:
    """Round to float32, as llama.cpp's float arithmetic does at each step."""
    return float(np.float32(x))


def _mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1.0 else _f32(0.1 * mscale * _f32(math.log(scale)) + 1.0)


def _resolve_yarn(c: CParams, p: ContextParams, h: _ModelRope) -> None:
    """Scaling type, YaRN ext factor and the attention factor (mscale and its ggml compensation)."""
    scaling = RopeScalingType(p.rope_scaling_type)
    if scaling == RopeScalingType.UNSPECIFIED:
        scaling = h.rope_scaling_type_train
    if scaling == RopeScalingType.NONE:
        c.rope_freq_scale = 1.0  # never scale without a scaling type
    if c.yarn_ext_factor < 0:
        c.yarn_ext_factor = 1.0 if scaling == RopeScalingType.YARN else 0.0
    if c.yarn_ext_factor != 0:
        factor = _f32(1.0 / c.rope_freq_scale)
        if h.rope_yarn_log_mul != 0:
            mscale_all = h.rope_yarn_log_mul
            mscale = mscale_all if h.arch == "deepseek2" and mscale_all != 1.0 else 1.0
            c.yarn_attn_factor = _f32(_mscale(factor, mscale) / _mscale(factor, mscale_all))
        else:
            c.yarn_attn_factor = _mscale(factor, 1.0)
        # ggml's rope multiplies by 1 + 0.1 ln(1/freq_scale) when ext_factor != 0: cancel it here
        c.yarn_attn_factor = _f32(c.yarn_attn_factor * _f32(1.0 / _f32(1.0 + 0.1 * _f32(math.log(factor)))))
    c.yarn_attn_factor = _f32(c.yarn_attn_factor * h.rope_attn_factor)


def _resolve_ctx_sizes(c: CParams) -> None:
    """n_ctx padded to 256; n_ctx_seq per sequence (padded) unless unified, n_ctx rounded to a whole split."""
    c.n_ctx = -(-c.n_ctx // _N_CTX_PAD) * _N_CTX_PAD
    if c.kv_unified:
        c.n_ctx_seq = c.n_ctx
        return
    c.n_ctx_seq = -(-(c.n_ctx // c.n_seq_max) // _N_CTX_PAD) * _N_CTX_PAD
    if c.n_ctx_seq == 0:
        raise ValueError(f"n_ctx_seq == 0 (n_ctx {c.n_ctx}, n_seq_max {c.n_seq_max})")
    c.n_ctx = c.n_ctx_seq * c.n_seq_max


def layer_rope_freq(hparams: Any, cparams: CParams, il: int) -> tuple[float, float]:
    """(freq_base, freq_scale) of layer ``il`` (llama_model::get_rope_freq_base/scale): a sliding-window layer
    uses the model's SWA training values when it has them, every other layer the context's."""
    if hparams.is_swa(il):
        return (float(getattr(hparams, "rope_freq_base_train_swa", cparams.rope_freq_base)),
                float(getattr(hparams, "rope_freq_scale_train_swa", cparams.rope_freq_scale)))
    return float(cparams.rope_freq_base), float(cparams.rope_freq_scale)
