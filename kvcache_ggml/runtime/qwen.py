"""Qwen2 / Qwen2.5 and Qwen3 GGUFs: llama.cpp's ``llm_build_qwen2`` and ``llm_build_qwen3`` over one KVCache.

Both are llama's graph (:mod:`kvcache_ggml.runtime.graph`, the fused decode step included) with NEOX RoPE and no
frequency factors; Qwen2 adds a bias to each of Q, K and V (llama.cpp's loader takes them when the file has them),
Qwen3 an RMS norm of every Q and K head before RoPE (``attn_q_norm`` / ``attn_k_norm``, required) and a head size
of its own (``attention.key_length``, not ``n_embd / n_head``).  Qwen2's Q and output matrices are square
(``n_embd = n_head * head size``), as its loader creates them.
"""
from __future__ import annotations

from dataclasses import replace
from os import PathLike
from typing import Any

from ..hparams import RopeType
from .model import RUNTIME as _LLAMA_RUNTIME
from .model import Model

__all__ = ["QWEN_ARCHS", "QwenModel", "RUNTIME"]

QWEN_ARCHS = ("qwen2", "qwen3")


class QwenModel(Model):
    """A Qwen2 / Qwen3 GGUF: llama's tensors plus Q/K/V biases (Qwen2) or Q/K head norms (Qwen3)."""

    ARCHS = QWEN_ARCHS
    ROPE_TYPE = RopeType.NEOX
    NAMES_ATTN_OUT = False   # llm_build_qwen2 / _qwen3 leave the attention's output unnamed

    def __init__(self, path: str | PathLike, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        hp = self.hparams
        if hp.arch == "qwen2" and hp.n_embd_head_k * hp.n_head(0) != hp.n_embd:
            self.close()
            raise ValueError(f"{self.path}: qwen2 needs n_head * head size == n_embd, got {hp.n_head(0)} * "
                             f"{hp.n_embd_head_k} != {hp.n_embd}")

    def extra_layer_tensors(self) -> tuple[str, ...]:
        return ("attn_q_norm", "attn_k_norm") if self.hparams.arch == "qwen3" else ()

    def optional_layer_tensors(self) -> tuple[str, ...]:
        # Qwen3's loader creates no biases: a file with some is refused (Model: "not supported")
        return super().optional_layer_tensors() if self.hparams.arch == "qwen2" else ()


# how the runtime serves Qwen2 and Qwen3 (kvcache_ggml.runtime.arch's registry): llama's memory and graph
RUNTIME = replace(_LLAMA_RUNTIME, model_class=QwenModel)
