"""What a user sets for a :class:`~kvcache_ggml.runtime.Context`: :class:`RuntimeParams` (llama.cpp's
``llama_context_params`` plus the cache types, with llama.cpp's defaults)."""
from __future__ import annotations

from dataclasses import dataclass

from .. import ggml as G
from .._consts import LLAMA_MAX_SEQ
from ..cparams import ContextParams, RopeScalingType

__all__ = ["RuntimeParams"]


@dataclass(slots=True)
class RuntimeParams:
    """What a user sets for a context (``llama_context_params`` plus the cache types), llama.cpp's defaults."""

    n_ctx: int = 512                  # context size in tokens, all sequences together; 0 = the model's n_ctx_train
    n_batch: int = 2048               # most tokens one decode() accepts (capped at n_ctx)
    n_ubatch: int = 512               # most tokens one graph computes
    n_seq_max: int = 1                # sequences the context serves (1..256)
    kv_unified: bool = False          # one cache stream shared by all sequences; else one stream per sequence
    flash_attn: bool = True           # ggml_flash_attn_ext over a non-transposed V; else mul_mat + soft_max
    type_k: str = "f16"               # ggml type of the K cache
    type_v: str = "f16"               # ggml type of the V cache
    n_threads: int = 4                # CPU threads for one-token graphs (and the K-shift)
    n_threads_batch: int = 4          # CPU threads for graphs of several tokens
    rope_scaling_type: int = -1       # llama_rope_scaling_type; -1 = the model's
    rope_freq_base: float = 0.0       # RoPE base; 0 = the model's
    rope_freq_scale: float = 0.0      # RoPE scale; 0 = the model's
    yarn_ext_factor: float = -1.0     # YaRN extrapolation mix; negative = the model's
    yarn_attn_factor: float = -1.0    # YaRN magnitude scale; negative = the model's
    yarn_beta_fast: float = -1.0      # YaRN low correction dim; negative = the model's
    yarn_beta_slow: float = -1.0      # YaRN high correction dim; negative = the model's
    yarn_orig_ctx: int = 0            # YaRN original context; 0 = the model's
    offload_kqv: bool = True          # K/V of layer il on the model's dev_layer(il) (the CPU by default)
    fa_cast_f32_kv: bool = False      # cast an F32 K/V cache to F16 before flash attention, as llama.cpp does
    graph_reuse: bool = True          # compute the previous graph again when its topology fits the ubatch
    graph_cache: int = 16             # small graphs kept by topology, each allocated in its own scheduler, so a
    #                                   step of a shape seen before computes its graph without building it (0: the
    #                                   previous graph alone, as llama.cpp); GraphCache
    graph_cache_tokens: int = 32      # graphs of at most this many tokens are kept (the decode steps)
    swa_full: bool = True             # sliding-window models: a full-size SWA cache (llama.cpp's default)
    no_perf: bool = True              # no host timings: StepTimes keeps its counts, its seconds stay 0 (llama.cpp's
    #                                   default; False measures each phase of each step)
    fast_paths: bool = True           # the decode step's fast paths (allocator, bookkeeping, inputs, fused step);
    #                                   False: the general code alone, the same results (the equivalence tests)

    def context_params(self) -> ContextParams:
        return ContextParams(n_ctx=self.n_ctx, n_batch=self.n_batch, n_ubatch=self.n_ubatch,
                             n_seq_max=self.n_seq_max, n_threads=self.n_threads,
                             n_threads_batch=self.n_threads_batch,
                             rope_scaling_type=RopeScalingType(self.rope_scaling_type),
                             rope_freq_base=self.rope_freq_base, rope_freq_scale=self.rope_freq_scale,
                             yarn_ext_factor=self.yarn_ext_factor, yarn_attn_factor=self.yarn_attn_factor,
                             yarn_beta_fast=self.yarn_beta_fast, yarn_beta_slow=self.yarn_beta_slow,
                             yarn_orig_ctx=self.yarn_orig_ctx, flash_attn=self.flash_attn,
                             offload_kqv=self.offload_kqv, kv_unified=self.kv_unified, no_perf=self.no_perf)

    def check(self) -> None:
        for name in ("n_batch", "n_ubatch", "n_seq_max", "n_threads", "n_threads_batch", "graph_cache_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.graph_cache < 0:
            raise ValueError(f"graph_cache must be >= 0, got {self.graph_cache}")
        if self.n_ctx < 0:
            raise ValueError(f"n_ctx must be >= 0 (0: the model's training context), got {self.n_ctx}")
        if self.n_seq_max > LLAMA_MAX_SEQ:
            raise ValueError(f"n_seq_max must be <= {LLAMA_MAX_SEQ}, got {self.n_seq_max}")
        G.parse_type(self.type_k)
        G.parse_type(self.type_v)
