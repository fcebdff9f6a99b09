"""Value objects of the cache: parameters, slots, queued stream copies, memory status (no ggml).

These are shared by every part of the cache (bookkeeping, tensor store, inputs, state codec) and by its users,
so they live apart from all of them.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from .._consts import LLAMA_MAX_SEQ
from ..hparams import HParams, SwaType

__all__ = ["MemoryStatus", "ModelLike", "KVCacheParams", "SlotInfo", "StreamCopyInfo"]


class MemoryStatus(enum.IntEnum):
    """llama.cpp's ``llama_memory_status``."""

    SUCCESS = 0
    NO_UPDATE = 1
    FAILED_PREPARE = 2
    FAILED_COMPUTE = 3

    def is_fail(self) -> bool:
        return self in (MemoryStatus.FAILED_PREPARE, MemoryStatus.FAILED_COMPUTE)


class ModelLike(Protocol):
    """What the cache needs from a model: its hyper-parameters and, with ``offload``, each layer's device."""

    hparams: HParams

    def dev_layer(self, il: int) -> Any: ...


@dataclass(slots=True)
class KVCacheParams:
    """The seed constructor's arguments after the model."""

    type_k: str | int = "f16"        # ggml type of the K cache ("f16", "q8_0", ... or the enum value)
    type_v: str | int = "f16"        # ggml type of the V cache
    v_trans: bool = True             # store V transposed (the non-flash-attention layout)
    offload: bool = False            # place each layer on model.dev_layer(il) instead of the CPU
    unified: bool = True             # one stream shared by all sequences; else one stream per sequence
    kv_size: int = 256               # cells per stream
    n_seq_max: int = 1               # number of sequences the cache serves
    n_pad: int = 1                   # kv_size must be a multiple of this; n_kv is padded to max(n_pad, 256)
    n_swa: int = 0                   # sliding-window size
    swa_type: SwaType = SwaType.NONE  # sliding-window rule
    filter: Callable[[int], bool] | None = None  # keep layer il in this cache?
    reuse: Callable[[int], int] | None = None    # layer il shares the tensors of layer reuse(il) (>= 0)

    def validate(self) -> None:
        """ValueError naming the value and the limit for arguments the seed would reject or abort on."""
        if self.kv_size <= 0:
            raise ValueError(f"kv_size must be > 0, got {self.kv_size}")
        if self.n_pad <= 0 or self.kv_size % self.n_pad != 0:
            raise ValueError(f"kv_size {self.kv_size} must be a multiple of n_pad {self.n_pad}")
        if not 1 <= self.n_seq_max <= LLAMA_MAX_SEQ:
            raise ValueError(f"n_seq_max {self.n_seq_max} out of [1, {LLAMA_MAX_SEQ}]")
        if self.n_swa < 0:
            raise ValueError(f"n_swa must be >= 0, got {self.n_swa}")
        if SwaType(self.swa_type) == SwaType.CHUNKED and self.n_swa == 0:
            raise ValueError("swa_type CHUNKED needs n_swa > 0, got 0")

    @property
    def n_stream(self) -> int:
        """Streams of the cache: one when unified, else one per sequence."""
        return 1 if self.unified else int(self.n_seq_max)


@dataclass(slots=True)
class SlotInfo:
    """Where one ubatch goes: per stream used by the ubatch, the cells of its tokens (``slot_info``)."""

    s0: int = LLAMA_MAX_SEQ                                   # first stream of the ubatch
    s1: int = 0                                               # last stream of the ubatch
    strm: list[int] = field(default_factory=list)             # stream of each sequence set
    idxs: list[np.ndarray] = field(default_factory=list)      # int64 [n_tokens_per_stream] cells, per stream
    cell: int = -1  # find_slot's one-token slot in one stream: its cell as an int (no numpy to read); else -1

    def n_stream(self) -> int:
        return len(self.strm)

    def size(self) -> int:
        assert len(self.idxs) == len(self.strm)
        return len(self.idxs[0])

    def head(self) -> int:
        assert len(self.idxs) == 1 and len(self.idxs[0]) > 0
        return int(self.idxs[0][0])

    def is_contiguous(self) -> bool:
        """One stream whose cells are consecutive."""
        if len(self.idxs) != 1:
            return False
        idx = self.idxs[0]
        return idx.size == 0 or int(idx[-1]) - int(idx[0]) + 1 == idx.size and bool((np.diff(idx) == 1).all())

    def empty(self) -> bool:
        return len(self.idxs) == 0

    def resize(self, n: int) -> None:
        self.strm = [0] * n
        self.idxs = [np.empty(0, np.int64) for _ in range(n)]
        self.cell = -1


@dataclass(slots=True)
class StreamCopyInfo:
    """Whole-stream copies queued by cross-stream ``seq_cp`` for the next update."""

    ssrc: list[int] = field(default_factory=list)  # source stream of each copy
    sdst: list[int] = field(default_factory=list)  # destination stream of each copy

    def empty(self) -> bool:
        assert len(self.ssrc) == len(self.sdst)
        return not self.ssrc
