"""llama.cpp's ``llama_kv_cache``: the facade over the cache's parts.

:class:`KVCache` has every public method of the seed, with its name and signature, and delegates each to the part
that owns the state it touches:

* :class:`~.bookkeeping.KVBookkeeping` (``book``) -- cells, heads, sequence-to-stream map, queued stream copies,
  every ``seq_*`` operation, slot search and placement (no ggml);
* :class:`~.tensors.KVTensors` (``tensors``) -- the K/V tensors and the buffers holding them (the one owner of the
  cache's native handles), their views and stores, stream copies; :class:`~.shift.KShift` (``kshift``) builds and
  runs the K-shift graph over them;
* :class:`~.inputs.KVInputs` (``inputs``) -- the graph inputs computed from the cells and a slot;
* :class:`~.state.codec.StateCodec` (``codec``) -- save and restore, byte-compatible with llama.cpp;
* :class:`~.decode_step.CacheStep` (``step``) -- the runtime's fused decode step: placement and inputs in two calls,
  with the results of the general path (no state of its own beyond the last step's cells).

The facade itself orchestrates what spans parts: ``clear`` (cells and data), ``init_batch`` (split, then slots),
``update`` (stream copies, then the K-shift with its input from the cells).

A cache with layers on an RPC server checks, after each of its calls that move K/V data (``clear``, ``update``,
the state API), whether that server was lost (:class:`~kvcache_ggml.ggml.RpcWatch`).  If it was, the call
raises :class:`~kvcache_ggml.ggml.RpcServerLostError`, ``lost`` keeps that error, and every public method
raises it from then on: the data of every sequence is gone (each sequence has K/V in every layer).  Properties,
sizes and :meth:`close` still answer.
"""
from __future__ import annotations

import logging
import operator
from typing import Any, Sequence

import numpy as np

from .. import ggml as G
from ..batch import BatchAllocator, UBatch
from ..cparams import CParams
from ..hparams import HParams, RopeType, SwaType
from .bookkeeping import KVBookkeeping
from .cells.kvcells import KVCells
from .context import KVCacheContext
from .decode_step import CacheStep
from .inputs import KVInputs
from .shift import KShift, ShiftGraph, UpdateContext
from .state.codec import StateCodec
from .state.io import StateReader, StateWriter
from .tensors import KVLayer, KVTensors
from .types import KVCacheParams, MemoryStatus, ModelLike, SlotInfo, StreamCopyInfo

__all__ = ["KVCache"]

log = logging.getLogger("kvcache_ggml.cache")


class KVCache:
    """llama.cpp's ``llama_kv_cache``: cells and heads per stream, K/V tensors per layer."""

    def __init__(self, model: ModelLike, params: KVCacheParams | None = None, **kwargs: Any) -> None:
        if params is None:
            params = KVCacheParams(**kwargs)
        elif kwargs:
            raise TypeError(f"pass either params or keyword arguments, not both: {sorted(kwargs)}")
        params.validate()
        self.model = model                                   # hparams, and dev_layer() with offload
        self.hparams: HParams = model.hparams                # the model's shapes
        self.params = params                                 # the constructor's arguments
        self.book = KVBookkeeping(params, self.hparams.n_pos_per_embd())
        self.tensors = KVTensors(model, params)               # allocates: every check above came first
        self.kshift = KShift(self.tensors)
        self.inputs = KVInputs(self.book, self.hparams, params.v_trans)
        self.codec = StateCodec(self.book, self.tensors)
        self.step = CacheStep(self.book, self.inputs)        # the fused decode step's placement and inputs
        self.rpc = G.RpcWatch.of(b.ptr for b in self.tensors.buffers())  # the buffers on RPC servers, if any
        self.lost: G.RpcServerLostError | None = None        # set when an RPC server of the cache was lost

    # ================================================================== parts' state, read-only views

    @property
    def v_cells(self) -> list[KVCells]:
        """The cells of each stream."""
        return self.book.v_cells

    @property
    def v_heads(self) -> list[int]:
        """Where the next slot search of each stream starts."""
        return self.book.v_heads

    @property
    def seq_to_stream(self) -> np.ndarray:
        """int32 [LLAMA_MAX_SEQ]: the stream of each sequence."""
        return self.book.seq_to_stream

    @property
    def sc_info(self) -> StreamCopyInfo:
        """Stream copies queued for the next update."""
        return self.book.sc_info

    @property
    def n_stream(self) -> int:
        return self.book.n_stream

    @property
    def n_seq_max(self) -> int:
        return self.book.n_seq_max

    @property
    def n_pad(self) -> int:
        return self.book.n_pad

    @property
    def n_swa(self) -> int:
        return self.book.n_swa

    @property
    def swa_type(self) -> SwaType:
        return self.book.swa_type

    @property
    def v_trans(self) -> bool:
        return self.tensors.v_trans

    @property
    def type_k(self) -> int:
        return self.tensors.type_k

    @property
    def type_v(self) -> int:
        return self.tensors.type_v

    @property
    def layers(self) -> list[KVLayer]:
        """The tensors of each kept layer."""
        return self.tensors.layers

    @property
    def map_layer_ids(self) -> dict[int, int]:
        """Model layer -> index in ``layers``."""
        return self.tensors.map_layer_ids

    # ================================================================== memory API

    def clear(self, data: bool = True) -> None:
        self.book.clear()
        if data:
            self.tensors.clear_data()
            self.check_rpc("clear")

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        return self.book.seq_rm(_int(seq_id, "seq_rm", "seq_id"), _int(p0, "seq_rm", "p0"), _int(p1, "seq_rm", "p1"))

    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int = -1, p1: int = -1) -> None:
        self.book.seq_cp(_int(seq_id_src, "seq_cp", "seq_id_src"), _int(seq_id_dst, "seq_cp", "seq_id_dst"),
                         _int(p0, "seq_cp", "p0"), _int(p1, "seq_cp", "p1"))

    def seq_keep(self, seq_id: int) -> None:
        self.book.seq_keep(_int(seq_id, "seq_keep", "seq_id"))

    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        self.book.seq_add(_int(seq_id, "seq_add", "seq_id"), _int(p0, "seq_add", "p0"), _int(p1, "seq_add", "p1"),
                          _int(shift, "seq_add", "shift"))

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        self.book.seq_div(_int(seq_id, "seq_div", "seq_id"), _int(p0, "seq_div", "p0"), _int(p1, "seq_div", "p1"),
                          _int(d, "seq_div", "d"))

    def seq_pos_min(self, seq_id: int) -> int:
        return self.book.seq_pos_min(_int(seq_id, "seq_pos_min", "seq_id"))

    def seq_pos_max(self, seq_id: int) -> int:
        return self.book.seq_pos_max(_int(seq_id, "seq_pos_max", "seq_id"))

    def get_size(self) -> int:
        return self.book.get_size()

    def get_n_stream(self) -> int:
        return self.book.n_stream

    def get_used(self, stream: int = -1) -> int:
        """Cells holding a token in ``stream`` (-1: in every stream); a batch of n tokens for the sequences of a
        stream has a slot when ``get_size() - get_used(stream) >= n``."""
        cells = self.book.v_cells
        stream = _int(stream, "get_used", "stream")
        if stream < 0:
            return sum(c.get_used() for c in cells)
        if stream >= len(cells):
            raise ValueError(f"stream {stream} out of range [0, {len(cells)})")
        return cells[stream].get_used()

    def get_has_shift(self) -> bool:
        return self.book.get_has_shift()

    def get_can_shift(self) -> bool:
        return self.book.get_can_shift()

    def get_n_kv(self, sinfo: SlotInfo) -> int:
        return self.book.get_n_kv(sinfo)

    def total_size(self) -> int:
        return self.tensors.total_size()

    def size_k_bytes(self) -> int:
        return self.tensors.size_k_bytes()

    def size_v_bytes(self) -> int:
        return self.tensors.size_v_bytes()

    def memory_breakdown(self) -> dict[str, int]:
        return self.tensors.memory_breakdown()

    def buffers(self) -> list[G.BackendBuffer]:
        return self.tensors.buffers()

    # ================================================================== preparation API

    def init_batch(self, balloc: BatchAllocator, n_ubatch: int, embd_all: bool = False) -> KVCacheContext:
        """Split the allocator's batch into ubatches and find a slot for each, without changing the cells."""
        del embd_all
        ubatches = self.book.split(balloc, n_ubatch)
        if ubatches is None:
            return KVCacheContext(self, status=MemoryStatus.FAILED_PREPARE)
        sinfos = self.book.prepare(ubatches)
        if not sinfos:
            return KVCacheContext(self, status=MemoryStatus.FAILED_PREPARE)
        return KVCacheContext(self, sinfos=sinfos, ubatches=ubatches)

    def init_full(self) -> KVCacheContext:
        """A context over the whole cache, to reserve graphs."""
        return KVCacheContext.full(self)

    def init_update(self, lctx: UpdateContext | None = None, optimize: bool = False) -> KVCacheContext:
        """A context that applies the queued stream copies and the pending K-shift when applied."""
        del optimize
        return KVCacheContext.update_ctx(self, lctx, self.get_has_shift(), self.book.take_stream_copies())

    def has_pending_update(self) -> bool:
        """True when :meth:`init_update` would have something to do (a pending K-shift or queued stream copies):
        what its context's status says, without making one."""
        return self.book.get_has_shift() or not self.book.sc_info.empty()

    def prepare(self, ubatches: Sequence[UBatch]) -> list[SlotInfo]:
        return self.book.prepare(ubatches)

    def find_slot(self, ubatch: UBatch, cont: bool = False) -> SlotInfo:
        return self.book.find_slot(ubatch, cont)

    def apply_ubatch(self, sinfo: SlotInfo, ubatch: UBatch) -> None:
        self.book.apply_ubatch(sinfo, ubatch)

    def update(self, lctx: UpdateContext | None, do_shift: bool, sc_info: StreamCopyInfo) -> bool:
        """Queued stream copies, then the pending K-shift; True when a K-shift graph was computed.

        ``lctx`` None: the K-shift runs on a temporary scheduler over the cache's devices, freed before
        returning.  A failed K-shift computation is logged and returns False with the shifts kept (as the seed);
        a graph that cannot be allocated raises RuntimeError.
        """
        rope = do_shift and self.hparams.rope_type != RopeType.NONE
        if (not sc_info.empty() or rope) and self.hparams.no_alloc:
            raise RuntimeError("update() moves K/V data, but this cache was created with hparams.no_alloc "
                               "(its tensors have no memory)")
        if rope:
            self.kshift.check(lctx)  # before the copies: a refused update changes nothing
        if not sc_info.empty():
            assert self.n_stream > 1, "stream copy should never happen with a single stream"
            if lctx is not None:
                G.ggml_backend_sched_synchronize(lctx.sched.ptr)  # no graph may still be writing the cache
            self.tensors.copy_streams(sc_info)
            self.check_rpc("update (stream copies)")
        if not do_shift:
            return False
        if not self.get_can_shift():
            raise ValueError("the current KV cache / model configuration does not support K-shift")
        log.debug("applying K-shift")
        if rope:
            if lctx is None:
                with UpdateContext.for_cache(self) as tmp:
                    ok = self.kshift.compute(tmp, self.inputs.set_input_k_shift)
            else:
                ok = self.kshift.compute(lctx, self.inputs.set_input_k_shift)
            self.check_rpc("update (K-shift)", sync=True)
            if not ok:
                return False
        self.book.reset_shift()
        return rope

    # ================================================================== graph_build API

    def get_k(self, ctx: Any, il: int, n_kv: int, sinfo: SlotInfo) -> Any:
        return self.tensors.get_k(ctx, il, n_kv, sinfo)

    def get_v(self, ctx: Any, il: int, n_kv: int, sinfo: SlotInfo) -> Any:
        return self.tensors.get_v(ctx, il, n_kv, sinfo)

    def cpy_k(self, ctx: Any, k_cur: Any, k_idxs: Any, il: int, sinfo: SlotInfo | None = None) -> Any:
        return self.tensors.cpy_k(ctx, k_cur, k_idxs, il, sinfo)

    def cpy_v(self, ctx: Any, v_cur: Any, v_idxs: Any, il: int, sinfo: SlotInfo | None = None) -> Any:
        return self.tensors.cpy_v(ctx, v_cur, v_idxs, il, sinfo)

    def build_input_k_idxs(self, ctx: Any, ubatch: UBatch) -> Any:
        return self.tensors.build_input_k_idxs(ctx, ubatch)

    def build_input_v_idxs(self, ctx: Any, ubatch: UBatch) -> Any:
        return self.tensors.build_input_v_idxs(ctx, ubatch)

    def build_rope_shift(self, cparams: CParams, ctx: Any, cur: Any, shift: Any, factors: Any, freq_base: float,
                         freq_scale: float) -> Any:
        return self.kshift.build_rope_shift(cparams, ctx, cur, shift, factors, freq_base, freq_scale)

    def build_graph_shift(self, ctx: Any, lctx: UpdateContext) -> ShiftGraph:
        return self.kshift.build_graph(ctx, lctx)

    def shift_graph_size(self) -> int:
        return self.kshift.graph_size()

    def shift_context(self) -> G.Context:
        return self.kshift.context()

    # ================================================================== input API

    def set_input_k_idxs(self, dst: Any, ubatch: UBatch, sinfo: SlotInfo) -> None:
        self.inputs.set_input_k_idxs(dst, ubatch, sinfo)

    def set_input_v_idxs(self, dst: Any, ubatch: UBatch, sinfo: SlotInfo) -> None:
        self.inputs.set_input_v_idxs(dst, ubatch, sinfo)

    def set_input_k_shift(self, dst: Any) -> None:
        self.inputs.set_input_k_shift(dst)

    def set_input_kq_mask(self, dst: Any, ubatch: UBatch, causal_attn: bool = True) -> None:
        self.inputs.set_input_kq_mask(dst, ubatch, causal_attn)

    def set_input_pos_bucket(self, dst: Any, ubatch: UBatch) -> None:
        self.inputs.set_input_pos_bucket(dst, ubatch)

    def k_shift(self) -> np.ndarray:
        """int32 [n_stream*kv_size]: what set_input_k_shift writes."""
        return self.inputs.k_shift()

    # ================================================================== state API

    def state_write(self, io: StateWriter, seq_id: int = -1, flags: int = 0) -> int:
        n = self.codec.state_write(io, _int(seq_id, "state_write", "seq_id"), _int(flags, "state_write", "flags"))
        self.check_rpc("state_write")
        return n

    def state_read(self, io: StateReader, seq_id: int = -1, flags: int = 0) -> int:
        try:
            return self.codec.state_read(io, _int(seq_id, "state_read", "seq_id"), _int(flags, "state_read", "flags"))
        finally:
            self.check_rpc("state_read", sync=True)

    def state_check(self, io: StateReader, seq_id: int = -1) -> int:
        """What :meth:`state_read` checks, changing nothing; the state's cells (``StateCodec.state_check``)."""
        return self.codec.state_check(io, _int(seq_id, "state_check", "seq_id"))

    def state_size(self, seq_id: int = -1) -> int:
        return self.codec.state_size(_int(seq_id, "state_size", "seq_id"))

    def state_save(self, seq_id: int = -1) -> bytes:
        data = self.codec.state_save(_int(seq_id, "state_save", "seq_id"))
        self.check_rpc("state_save")
        return data

    def state_load(self, data: Any, seq_id: int = -1) -> int:
        try:
            return self.codec.state_load(data, _int(seq_id, "state_load", "seq_id"))
        finally:
            self.check_rpc("state_load", sync=True)

    def check_seq_state(self, seq_id: int, allow_all: bool = False, data: bool = True) -> None:
        """ValueError unless the state of ``seq_id`` (-1: every sequence, when ``allow_all``) can be saved or
        restored here: a sequence of this cache, a layout with per-row data and (``data``) tensors holding data.
        The state files check it before they touch the file or the cache."""
        self.book.check_seq(_int(seq_id, "check_seq_state", "seq_id"), allow_all)
        self.codec.check_layout(data)

    # ================================================================== the fast paths

    def set_fast_paths(self, on: bool) -> None:
        """Turn the decode step's fast paths of the bookkeeping and the inputs on or off (off: the general code
        alone, with the same results; the equivalence tests compare both).  ``ContextParams.fast_paths`` is the
        runtime's one switch: these, the allocator's and the fused step."""
        self.book.fast = self.inputs.fast = bool(on)

    # ================================================================== a lost RPC server

    def check_rpc(self, what: str, sync: bool = False) -> None:
        """After a call that moved K/V data (``what``): if an RPC server of the cache was lost meanwhile, mark the
        cache lost and raise RpcServerLostError.  One attribute read without RPC layers; one native call with,
        plus a round trip per server with ``sync`` (after writes and computes, which get no answer)."""
        if self.rpc.buffers:
            lost = self.rpc.lost(sync)
            if lost:
                raise self.mark_lost(lost, what)

    def mark_lost(self, endpoints: tuple[str, ...], what: str) -> G.RpcServerLostError:
        """Record that the servers ``endpoints`` were lost during ``what``; from now on every public method raises
        the returned error.  Idempotent (the first error is kept)."""
        if self.lost is None:
            err = G.lost_error("the KV cache", endpoints, f"found after {what}; every sequence of the cache is "
                               f"lost (close it; restore saved state into a new cache)")
            self.lost = err
            for name in _GUARDED:
                setattr(self, name, _raiser(name, err))
        return self.lost

    # ================================================================== ownership

    def close(self) -> None:
        """Free the buffers and contexts (idempotent). The cache is unusable afterwards."""
        self.tensors.close()

    def __enter__(self) -> KVCache:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _raiser(name: str, err: G.RpcServerLostError) -> Any:
    def lost(*args: Any, **kwargs: Any) -> Any:
        raise G.RpcServerLostError(f"{name}: {err}", err.endpoints)
    lost.__name__ = name
    return lost


# what still answers on a lost cache: sizes and shapes (no sequence, no data), close, the checks of the loss
_UNGUARDED = frozenset(("get_size", "get_n_stream", "get_has_shift", "get_can_shift", "total_size", "size_k_bytes",
                        "size_v_bytes", "memory_breakdown", "buffers", "shift_graph_size", "close", "check_rpc",
                        "mark_lost", "set_fast_paths"))
# what raises on a lost cache: every other public method
_GUARDED: tuple[str, ...] = tuple(n for n, v in vars(KVCache).items()
                                  if callable(v) and not n.startswith("_") and n not in _UNGUARDED)


def _int(v: Any, method: str, arg: str) -> int:
    """``v`` as an int: a Python or numpy integer (or a bool), what C++ takes as a llama_seq_id or llama_pos; a
    TypeError naming the argument for anything else (a float such as 1.5 or NaN was taken as a position before)."""
    if type(v) is int:
        return v
    try:
        return operator.index(v)
    except TypeError:
        raise TypeError(f"{method}() {arg} must be an integer, got {v!r}") from None
