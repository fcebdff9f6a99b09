"""A decoding context: llama.cpp's ``llama_context`` for a llama model over :class:`~kvcache_ggml.cache.KVCache`.

``Context(model, params)`` resolves the parameters (:class:`~kvcache_ggml.cparams.ContextParams` -> ``CParams``),
creates the KV cache (``v_trans = not flash_attn``, ``kv_size = n_ctx_seq``), a backend scheduler over the devices
holding the model (CPU last), one graph context reused across steps and the small graphs kept per shape
(:mod:`.graph_cache`).
:meth:`Context.decode` follows ``llama_decode``: validate and auto-fill the batch, apply pending memory updates
(stream copies, K-shift), split and place the ubatches, then per ubatch ``apply()`` and one ggml graph; the logits
of the output tokens come back in batch order.

Host time is accounted per phase in :class:`StepTimes` (batch validation and splits, cache bookkeeping, memory
updates, input setting, graph build, compute).
"""
from __future__ import annotations

import os
import time
from os import PathLike
from typing import Any, Sequence

import numpy as np

from .. import ggml as G
from ..cache import UpdateContext
from .._consts import LLAMA_MAX_SEQ
from ..batch import Batch, BatchAllocator
from ..cache import KVCache, KVCacheParams, Memory, MemoryStatus
from ..cparams import ContextParams, CParams
from ..cache.state.files import load_seq_file, save_seq_file
from .step_times import StepTimes, TimedSplits
from .arch import runtime_for
from .fused_step import FusedStep, StepHost
from .graph import DecoderGraph
from .graph_cache import GraphCache

__all__ = ["Context", "DecodeError", "StepTimes"]

_perf = time.perf_counter
_no_clock = float  # the clock of a context with no_perf: float() is 0.0, a C call as cheap as a clock
_SUCCESS = int(G.Status.SUCCESS)


class DecodeError(RuntimeError):
    """A failed :meth:`Context.decode`; ``code`` is what ``llama_decode`` returns in that case.

    1: no memory slot for the batch; -1: invalid batch; -2: memory or allocation failure; -3: compute failure.
    """

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"decode failed ({code}): {message}")
        self.code = code


class Context:
    """A KV cache, a scheduler and the last graph over a :class:`~kvcache_ggml.runtime.model.Model`."""

    def __init__(self, model: Any, params: ContextParams | None = None, **kwargs: Any) -> None:
        if params is None:
            params = ContextParams(**kwargs)
        elif kwargs:
            raise TypeError(f"pass either params or keyword arguments, not both: {sorted(kwargs)}")
        if getattr(model, "closed", False):
            raise ValueError("the model is closed")
        self.model = model
        self.params = params
        hp = model.hparams
        self.cparams: CParams = CParams.from_hparams(hp, params)
        self.n_vocab = int(model.n_vocab)
        self.times = StepTimes()
        self._rt = runtime_for(hp.arch)                   # the architecture's memory and graph
        self.kv: Memory | None = None                      # a KVCache, or a KVCacheISWA (sliding windows)
        self._sched: G.Sched | None = None
        self._backends: list[G.Backend] = []
        self._gctx: G.Context | None = None                # the graph context of graphs the cache does not keep
        self._graphs: GraphCache | None = None             # small graphs kept by key, each in its own scheduler
        self._prev: DecoderGraph | None = None             # the graph of the last ubatch while still allocated
        self._eval_fn: Any = None                          # the eval callback set on every scheduler, or None
        try:
            self.kv = self._rt.create_memory(model, KVCacheParams(
                type_k=params.type_k, type_v=params.type_v, v_trans=not params.flash_attn,
                offload=params.offload_kqv, unified=params.kv_unified, kv_size=self.cparams.n_ctx_seq,
                n_seq_max=self.cparams.n_seq_max, n_pad=1, n_swa=hp.n_swa, swa_type=hp.swa_type),
                self.cparams.n_ubatch, params.swa_full)
            cap = max(self._rt.capacity(hp.n_layer), self.kv.shift_graph_size())
            self._graph_size = cap
            devs = list(model.devices()) if hasattr(model, "devices") else []
            for dev in devs:
                if G.ggml_backend_dev_type(dev) != G.DeviceType.CPU:
                    self._backends.append(G.Backend(G.ggml_backend_dev_init(dev, None)))
            self._cpu = G.Backend.cpu(params.n_threads)
            self._backends.append(self._cpu)
            offload_ops = len(self._backends) > 1 and self.cparams.op_offload
            self._sched = G.Sched(self._backends, graph_size=cap, parallel=False, op_offload=offload_ops)
            self._gctx = G.Context.for_tensors(cap, cap)
            self._offload_ops = offload_ops
            self._graphs = GraphCache(params.graph_cache if params.graph_reuse else 0, params.graph_cache_tokens,
                                      cap, self._new_sched)
            self._lctx = UpdateContext(self._sched, self.cparams, cap, owned=())
        except BaseException:
            self.close()
            raise
        self.balloc = BatchAllocator(hp.n_pos_per_embd())
        self.logits = np.zeros((0, self.n_vocab), np.float32)   # [n_outputs, n_vocab] of the last decode
        self.output_ids = np.zeros(0, np.int32)                  # batch index -> logits row (-1: no output);
        #                                                          read-only when every token is an output
        # what decode() reads every step, resolved once
        self._clock = _no_clock if self.cparams.no_perf else _perf  # the phases' clock (no_perf: always 0.0)
        self._splits = TimedSplits(self.balloc, self._clock)    # the allocator, its splits timed
        self._n_embd = int(hp.n_embd)
        self._balloc_seq_max = LLAMA_MAX_SEQ if params.kv_unified else self.cparams.n_seq_max
        self._iota = np.arange(self.cparams.n_batch, dtype=np.int32)  # read-only 0..n_batch-1: output_ids
        self._iota.flags.writeable = False                       # of a batch whose every token is an output
        self._n_threads_set = 0                                  # what the CPU backend was last set to (0: unknown)
        self._multi_stream = not params.kv_unified and self.cparams.n_seq_max > 1  # a stream per sequence
        # a lost RPC server (docs/parity.md, "A dead RPC server"): the weights' RPC buffers; whether any of this
        # context's buffers is on an RPC server (then each compute is followed by one failure-count read)
        self._rpc = G.RpcWatch.of(b.ptr for b in model.buffers()) if hasattr(model, "buffers") else G.RpcWatch((), 0)
        self._watching = self._rpc.active or self.kv.rpc.active
        if self._watching:  # no kept graphs: each one's scheduler allocates on the RPC server, and ggml's allocator
            self._graphs.capacity = 0  # goes on with a NULL buffer when a lost server fails the allocation
        self._lost: G.RpcServerLostError | None = None           # set when a server of the weights or the cache died
        if not params.fast_paths:  # the one switch of every decode fast path
            self.balloc.fast = False
            self.kv.set_fast_paths(False)
        # the decode step that computes the last graph again (None: general path only): llama graphs over a plain
        # KVCache with graph reuse, given the scheduler and the callbacks it needs
        self.fused: FusedStep | None = None
        if params.fast_paths and self._rt.fused and type(self.kv) is KVCache and params.graph_reuse:
            self.fused = FusedStep(self.kv, self.balloc, self.cparams, self.n_vocab, self.times, StepHost(
                self._iota, self._use_threads, self._fail_compute,
                self.check_rpc if self._watching else None, self._set_step_outputs))

    # ------------------------------------------------------------------ decode

    def decode(self, batch: Batch) -> np.ndarray:
        """Decode ``batch`` (llama_decode); float32 [n_outputs, n_vocab] logits of its output tokens, batch order.

        Raises :class:`DecodeError` where llama_decode returns non-zero (``code`` is that value).
        """
        kv, tm, balloc = self.kv, self.times, self.balloc
        if kv is None:
            raise ValueError("the context is closed")
        if self._lost is not None or kv.lost is not None:
            err = self._lost or kv.lost
            raise G.RpcServerLostError(f"decode: {err}", err.endpoints)
        if self.fused is not None:
            prev = self._prev
            if prev is not None:  # the step of a decode loop: the last graph again
                logits = self.fused(batch, prev)
                if logits is not None:
                    return logits
            g = self._kept_for(batch)  # a step of another shape: the graph kept for it, if any
            if g is not None and g is not prev:
                logits = self.fused(batch, g)
                if logits is not None:
                    self._prev = self._graphs.get(g.key)  # (now the most recently used)
                    tm.n_graph_kept += 1
                    return logits
        t0 = self._clock()
        try:
            balloc.init(batch, self.n_vocab, kv, self._n_embd, self._balloc_seq_max, False)
        except ValueError as e:
            raise DecodeError(-1, f"invalid batch: {e}") from None
        n_tokens_all = balloc.get_n_tokens()
        n_outputs_all = balloc.get_n_outputs()
        if n_tokens_all > self.cparams.n_batch:
            raise DecodeError(-1, f"batch of {n_tokens_all} tokens exceeds n_batch = {self.cparams.n_batch}")
        tm.batch += self._clock() - t0
        tm.n_decode += 1

        if kv.has_pending_update():
            self._memory_update(False)
        mctx = self._init_batch(kv, n_tokens_all)

        logits = np.empty((n_outputs_all, self.n_vocab), np.float32)  # rows in split order
        row = 0
        while True:
            ubatch = mctx.get_ubatch()
            t0 = self._clock()
            mctx.apply()
            tm.bookkeeping += self._clock() - t0
            if n_outputs_all == n_tokens_all:
                n_outputs = ubatch.n_tokens
            else:
                n_outputs = int(np.count_nonzero(ubatch.output[:ubatch.n_tokens]))
            self._process_ubatch(mctx, ubatch, n_outputs,
                                 logits if n_outputs == n_outputs_all else logits[row:row + n_outputs])
            row += n_outputs
            if not mctx.next():
                break
        t0 = self._clock()
        self._set_outputs(logits, n_tokens_all)
        tm.compute += self._clock() - t0
        tm.n_tokens += n_tokens_all
        return self.logits

    def _kept_for(self, batch: Batch) -> DecoderGraph | None:
        """The kept graph a step of one token per sequence of ``batch`` would compute, if any (GraphCache.for_step;
        the fused step checks the rest)."""
        s0 = s1 = 0
        if self._multi_stream and batch.seq_id is not None:  # one stream per sequence: the ids name them
            ids = batch.seq_id[:, 0]
            s0, s1 = int(ids.min()), int(ids.max())
        return self._graphs.for_step(batch.n_tokens, s0, s1)

    def _set_step_outputs(self, logits: np.ndarray, output_ids: np.ndarray) -> None:
        """The fused step's outputs: its logits (rows in batch order) and output ids."""
        self.logits, self.output_ids = logits, output_ids

    def _init_batch(self, kv: Any, n_tokens_all: int) -> Any:
        """Split the batch and find its slots (init_batch), once more after an optimizing update if it failed."""
        tm, splits = self.times, self._splits
        did_optimize = False
        while True:
            t0 = self._clock()
            splits.seconds = 0.0
            try:
                mctx = kv.init_batch(splits, self.cparams.n_ubatch, False)
            except ValueError as e:
                raise DecodeError(1, str(e)) from None
            finally:
                tm.batch += splits.seconds
                tm.bookkeeping += self._clock() - t0 - splits.seconds
            status = mctx.get_status()
            if status == MemoryStatus.SUCCESS:
                return mctx
            if status == MemoryStatus.FAILED_PREPARE and not did_optimize:
                did_optimize = True
                if self._memory_update(True):
                    continue
            raise DecodeError(1, f"no memory slot for a batch of {n_tokens_all} tokens "
                                 f"({status.name}; cache of {kv.get_size()} cells per stream)")

    def _set_outputs(self, logits: np.ndarray, n_tokens_all: int) -> None:
        """``self.logits`` in batch order and ``self.output_ids`` from the rows in split order."""
        balloc = self.balloc
        if balloc.out_ids_in_order():  # the decode step whose every token is an output: rows in batch order
            self.logits, self.output_ids = logits, self._iota[:n_tokens_all]
            return
        out_ids = balloc.get_out_ids()                       # batch index of each row, in split order
        n = len(out_ids)
        iota = self._iota[:n]
        # every token an output, rows in batch order (bytes compared: a few times cheaper than array_equal)
        if n == n_tokens_all and out_ids.tobytes() == iota.tobytes():
            self.logits, self.output_ids = logits, iota
            return
        order = np.argsort(out_ids, kind="stable")
        self.logits = logits[order]
        self.output_ids = np.full(n_tokens_all, -1, np.int32)
        self.output_ids[out_ids[order]] = iota

    def _process_ubatch(self, mctx: Any, ubatch: Any, n_outputs: int, dst: np.ndarray) -> None:
        """Build (or reuse), fill and compute the graph of one applied ubatch; its logits rows into ``dst``."""
        tm = self.times
        t0 = self._clock()
        key = self._rt.graph_key(mctx, ubatch, n_outputs, self.params.kv_unified)
        g = self._prev
        if g is not None and self.params.graph_reuse and g.key == key:
            tm.n_graph_reused += 1
        else:
            g = self._graphs.get(key)
            if g is not None:  # built for an earlier step of this shape and still allocated in its scheduler
                self._prev = g
                tm.n_graph_reused += 1
                tm.n_graph_kept += 1
            else:
                g = self._build(mctx, ubatch, key)
        t1 = self._clock()
        tm.build += t1 - t0
        self._rt.set_inputs(g, mctx, ubatch, self.cparams.causal_attn)
        t2 = self._clock()
        tm.inputs += t2 - t1
        self._use_threads(ubatch.n_tokens)
        status = G.ggml_backend_sched_graph_compute(g.sched, g.graph.ptr)
        if status != _SUCCESS:
            self._fail_compute(status, self._ubatch_tokens(ubatch))
        if n_outputs:
            g.read_logits(dst)
        if self._watching:
            self.check_rpc("decode", self._ubatch_tokens(ubatch))
        tm.compute += self._clock() - t2
        tm.n_ubatch += 1

    def _build(self, mctx: Any, ubatch: Any, key: Any) -> Any:
        """A new graph for ``key``: kept by the graph cache in a scheduler of its own when small, else built in the
        reset graph context and allocated by the reset main scheduler."""
        self._prev = None

        def make(gctx: G.Context) -> DecoderGraph:
            return self._rt.build(gctx, self.model, self.cparams, mctx, ubatch, key,
                                  flash_attn=self.params.flash_attn, fa_cast_f32_kv=self.params.fa_cast_f32_kv)

        try:
            if self._graphs.keeps(key):
                kept = self._graphs.build(key, make, self._forget_graph)
                g, g.sched = kept.graph, kept.sched.ptr
            else:
                self._sched.reset()
                G.ggml_reset(self._gctx.ptr)
                g = make(self._gctx)
                self._sched.alloc_graph(g.graph)
                g.sched = self._sched.ptr
        except MemoryError as e:
            self._fail_alloc(e, self._ubatch_tokens(ubatch))
        g.map_inputs()
        self._prev = g
        return g

    def _new_sched(self) -> G.Sched:
        """A scheduler over this context's backends, with its eval callback (a kept graph's)."""
        sched = G.Sched(self._backends, graph_size=self._graph_size, parallel=False, op_offload=self._offload_ops)
        if self._eval_fn is not None:
            sched.set_eval_callback(self._eval_fn)
        return sched

    def _forget_graph(self, g: DecoderGraph) -> None:
        """``g`` is evicted from the graph cache: the fused step must not keep its views."""
        if self.fused is not None:
            self.fused.forget(g)

    def _use_threads(self, n_tokens: int) -> None:
        """Set the CPU backend's threads for a graph of ``n_tokens`` (n_threads for one, else n_threads_batch),
        with a C call only when they change."""
        n_threads = self.cparams.n_threads if n_tokens == 1 else self.cparams.n_threads_batch
        if n_threads != self._n_threads_set:
            self._cpu.set_n_threads(n_threads)
            self._n_threads_set = n_threads

    @staticmethod
    def _ubatch_tokens(ubatch: Any) -> Any:
        """(sequence, position) of each token of ``ubatch``."""
        return zip(ubatch.seq_id[:ubatch.n_tokens, 0].tolist(), ubatch.pos[:ubatch.n_tokens].tolist())

    def _undo_ubatch(self, tokens: Any) -> None:
        """Remove a failed ubatch's positions from the cache: each sequence's from its smallest one, as
        llama_decode (``tokens``: (sequence, position) of each token)."""
        pos_min: dict[int, int] = {}
        for s, p in tokens:
            pos_min[s] = min(pos_min.get(s, 2**31 - 1), p)
        for s, p in sorted(pos_min.items()):
            self._kv().seq_rm(s, p, -1)

    def _fail_alloc(self, err: MemoryError, tokens: Any) -> None:
        """After a graph could not be allocated: undo the ubatch in the cache and raise (RpcServerLostError where an
        RPC server of the context died, else DecodeError -2, llama_decode's allocation failure)."""
        tokens = list(tokens)
        if self._watching:
            self.check_rpc("decode", tokens)
        self._undo_ubatch(tokens)
        raise DecodeError(-2, f"graph allocation failed: {err}")

    def _fail_compute(self, status: int, tokens: Any) -> None:
        """After a failed compute: forget the graph, undo the ubatch in the cache and raise (RpcServerLostError
        where an RPC server of the context died, else DecodeError)."""
        self._prev = None
        tokens = list(tokens)
        if self._watching:
            self.check_rpc("decode", tokens)
        self._undo_ubatch(tokens)
        code = -2 if status == G.Status.ALLOC_FAILED else 2 if status == G.Status.ABORTED else -3
        raise DecodeError(code, f"graph compute returned {G.Status(status).name}")

    def check_rpc(self, what: str, tokens: Any = ()) -> None:
        """After a compute (``what``; ``tokens``: (sequence, position) of its ubatch): if an RPC server holding
        weights or K/V of this context was lost, mark the context lost (and the cache, when its K/V were there;
        else undo the ubatch in the intact cache, as a failed decode does) and raise RpcServerLostError."""
        kv = self._kv()
        weights = self._rpc.lost()
        cache = kv.rpc.lost() if kv.lost is None else ()
        if not weights and not cache:
            return
        self._prev = None
        if cache:
            kv.mark_lost(cache, what)
            detail = "the KV cache had layers there and is lost too"
        else:
            self._undo_ubatch(tokens)
            detail = ("the KV cache is intact (its layers are elsewhere, the failed ubatch undone): save its "
                      "sequences with state_get_data / state_seq_get_data and restore them into a new context")
        self._lost = G.lost_error("the context", tuple(dict.fromkeys(weights + cache)),
                                  f"found after {what}; it cannot compute any more; {detail}")
        raise self._lost

    def _memory_update(self, optimize: bool) -> bool:
        """Apply queued stream copies and a pending K-shift (llama_context::memory_update)."""
        t0 = self._clock()
        try:
            mctx = self._kv().init_update(self._lctx, optimize)
            if mctx.get_status() != MemoryStatus.SUCCESS:
                return False
            self._prev = None          # the update runs on the scheduler: the last graph is gone
            self._n_threads_set = 0    # and a K-shift sets the CPU backend's threads
            try:
                mctx.apply()
            except G.RpcServerLostError as e:
                self._lost = e
                raise
            return True
        finally:
            self.times.update += self._clock() - t0

    def set_eval_callback(self, fn: Any) -> None:
        """Observe graph nodes as they are computed (llama.cpp's ``cb_eval``): ``fn(tensor, ask) -> bool``, see
        :meth:`kvcache_ggml.ggml.Sched.set_eval_callback`; None removes it.  :class:`~.trace.NodeTrace` uses it."""
        if self._sched is None:
            raise ValueError("the context is closed")
        self._eval_fn = fn
        for sched in (self._sched, *self._graphs.scheds()):
            sched.set_eval_callback(fn)

    # ------------------------------------------------------------------ outputs

    def get_logits_ith(self, i: int) -> np.ndarray:
        """float32 [n_vocab]: logits of batch token i of the last decode (negative i counts from the end)."""
        if i < 0:
            j = len(self.logits) + i
            if not 0 <= j < len(self.logits):
                raise ValueError(f"output index {i} out of range for {len(self.logits)} outputs")
            return self.logits[j]
        if not 0 <= i < len(self.output_ids) or self.output_ids[i] < 0:
            raise ValueError(f"batch token {i} has no logits (outputs of the last decode: "
                             f"{np.flatnonzero(self.output_ids >= 0).tolist()})")
        return self.logits[self.output_ids[i]]

    def node_backends(self) -> list[tuple[str, str, str]]:
        """(node name, op name, backend name) of every node of the graph the last decode computed, as the scheduler
        assigned them (``ggml_backend_sched_get_tensor_backend``): which device really ran each op, e.g. that the
        attention of a layer placed on a GPU did not fall back to the CPU.  [] before the first decode."""
        g = self._prev
        if g is None:
            return []
        out = []
        for t in g.graph.nodes():  # (in the scheduler the graph is allocated in: a kept graph has its own)
            be = G.ggml_backend_sched_get_tensor_backend(g.sched, t) or 0
            out.append((G.name(t), G.op(t).name, G.ggml_backend_name(be).decode() if be else ""))
        return out

    # ------------------------------------------------------------------ memory API (llama_memory_*)

    def memory_clear(self, data: bool = True) -> None:
        self._kv().clear(data)

    def memory_seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        return self._kv().seq_rm(seq_id, p0, p1)

    def memory_seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int = -1, p1: int = -1) -> None:
        self._kv().seq_cp(seq_id_src, seq_id_dst, p0, p1)

    def memory_seq_keep(self, seq_id: int) -> None:
        self._kv().seq_keep(seq_id)

    def memory_seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        self._kv().seq_add(seq_id, p0, p1, delta)

    def memory_seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        self._kv().seq_div(seq_id, p0, p1, d)

    def memory_seq_pos_min(self, seq_id: int) -> int:
        return self._kv().seq_pos_min(seq_id)

    def memory_seq_pos_max(self, seq_id: int) -> int:
        return self._kv().seq_pos_max(seq_id)

    def memory_can_shift(self) -> bool:
        return self._kv().get_can_shift()

    def memory_update(self) -> bool:
        """Apply queued stream copies and a pending K-shift now rather than at the next decode (what a decode
        starts with, ``llama_context::memory_update`` without the defragmentation); whether anything ran."""
        return self._memory_update(False)

    def context_shift(self, seq_id: int, n_keep: int, n_discard: int) -> None:
        """llama.cpp's context-shift recipe: drop positions [n_keep, n_keep + n_discard) of ``seq_id`` and move
        the later ones back by n_discard (the K-shift runs at the next decode)."""
        if n_keep < 0 or n_discard < 1:
            raise ValueError(f"context_shift needs n_keep >= 0 and n_discard >= 1, got {n_keep}, {n_discard}")
        if not self.memory_can_shift():  # llama.cpp's callers ask llama_memory_can_shift first; its update aborts
            raise RuntimeError("context_shift: this memory cannot shift positions (an iSWA cache whose sliding-"
                               "window part is smaller than the whole cache: use swa_full)")
        n_past = self.memory_seq_pos_max(seq_id) + 1
        if n_keep + n_discard > n_past:
            raise ValueError(f"n_keep + n_discard = {n_keep + n_discard} exceeds the {n_past} positions of "
                             f"sequence {seq_id}")
        self.memory_seq_rm(seq_id, n_keep, n_keep + n_discard)
        self.memory_seq_add(seq_id, n_keep + n_discard, n_past, -n_discard)

    # ------------------------------------------------------------------ state (llama_state_seq_*)

    def state_seq_get_data(self, seq_id: int) -> bytes:
        """The state blob of one sequence (llama_state_seq_get_data: the cache's state_write, nothing else)."""
        return self._kv().state_save(seq_id)

    def state_seq_set_data(self, data: Any, dest_seq_id: int) -> int:
        """Restore one sequence from a blob of :meth:`state_seq_get_data`; returns its size (ValueError if bad)."""
        return self._kv().state_load(data, dest_seq_id)

    def state_get_data(self) -> bytes:
        """The whole cache's state blob (the memory part of llama_state_get_data)."""
        return self._kv().state_save(-1)

    def state_set_data(self, data: Any) -> int:
        return self._kv().state_load(data, -1)

    def state_seq_save_file(self, path: str | PathLike, seq_id: int, tokens: Sequence[int] = ()) -> int:
        """llama_state_seq_save_file: magic, version, tokens, then the sequence's state; returns the file size."""
        return save_seq_file(path, self._kv(), seq_id, np.asarray(tokens, np.int32))

    def state_seq_load_file(self, path: str | PathLike, dest_seq_id: int,
                            n_token_capacity: int | None = None) -> np.ndarray:
        """llama_state_seq_load_file: restore ``dest_seq_id``; returns the file's tokens (int32)."""
        return load_seq_file(path, self._kv(), dest_seq_id, n_token_capacity)

    # ------------------------------------------------------------------ info and ownership

    def n_ctx(self) -> int:
        return self.cparams.n_ctx

    def n_ctx_seq(self) -> int:
        return self.cparams.n_ctx_seq

    def _kv(self) -> Memory:
        if self.kv is None:
            raise ValueError("the context is closed")
        return self.kv

    def close(self) -> None:
        """Free the graph context, the scheduler, the backends and the cache (idempotent)."""
        self._prev = None
        if self._graphs is not None:
            self._graphs.close()
            self._graphs = None
        if self._gctx is not None:
            self._gctx.close()
            self._gctx = None
        if self._sched is not None:
            self._sched.close()
            self._sched = None
        for b in self._backends:
            b.close()
        self._backends = []
        if self.kv is not None:
            self.kv.close()
            self.kv = None

    @property
    def closed(self) -> bool:
        return self.kv is None

    @property
    def last_graph(self) -> DecoderGraph | None:
        """The graph of the last decode (its key, inputs and host views; what the next step of the same shape
        computes again), or None after a memory update, a failure or before the first decode.  For inspection."""
        return self._prev

    @property
    def kept_graphs(self) -> list:
        """The keys of the graphs kept per shape (GraphCache), least recently used first.  For inspection."""
        return [] if self._graphs is None else self._graphs.keys()

    @property
    def cpu_only(self) -> bool:
        """Whether the CPU backend alone computes this context's graphs (no GPU, RPC or other device)."""
        return len(self._backends) == 1

    @property
    def lost(self) -> G.RpcServerLostError | None:
        """Why this context cannot compute any more (an RPC server of its weights or cache died), or None."""
        return self._lost

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def default_threads() -> int:
    """min(4, cores): llama.cpp's default of 4 threads, bounded by the machine."""
    return max(1, min(4, os.cpu_count() or 1))
