"""The runtime's fused decode step: a step that computes the previous graph again, in a few calls.

:meth:`Context.decode` of a batch of n tokens of n distinct sequences, every one an output, usually ends up
computing the graph of the step before (same ubatch shape, same ``n_kv``, same streams: llama.cpp's graph reuse).
The general path gets there through the allocator's init and split (a UBatch), the cache's ``init_batch`` (a
SlotInfo and a KVCacheContext), ``apply``, the graph key, ``set_inputs`` and the logits' reordering -- about fifty
Python calls.  :class:`FusedStep` takes the same step in a dozen:

1. ``BatchAllocator.init_step``: the batch's validation and its one split, the allocator left as the general path
   leaves it, no UBatch;
2. ``CacheStep.place``: each token on its stream's free head cell, only if the slot and ``n_kv`` are the previous
   graph's (else nothing changes and the general path runs);
3. the graph's host views: tokens, positions, output rows, then ``CacheStep.fill`` for the K/V rows and the mask;
4. one C call to compute, one copy of the logits (rows already in batch order).

Every check comes before the first change to the cache; a step that fails one takes the general path, which gives
the same errors.  ``tests/test_fused_step.py`` compares two runtimes, one with ``Context.fused`` set to None, on
random traces: logits, output ids, cells, heads, the allocator's getters and state blobs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from .. import ggml as G
from ..batch import Batch, BatchAllocator
from ..cache import KVCache
from ..cparams import CParams

if TYPE_CHECKING:
    from .graph import DecoderGraph

__all__ = ["FusedStep", "StepHost"]

_SUCCESS = int(G.Status.SUCCESS)
_perf = time.perf_counter


@dataclass(slots=True, frozen=True)
class StepHost:
    """What the context that owns a fused step gives it: its callbacks, nothing to reach into (a graph names the
    scheduler it is allocated in)."""

    iota: np.ndarray                                     # int32 0..n_batch-1, read-only: a step's output ids
    use_threads: Callable[[int], None]                   # set the CPU threads for a graph of n tokens
    fail_compute: Callable[[int, Any], None]             # (status, (seq, pos) per token): undo the step, raise
    check_rpc: Callable[[str, Any], None] | None         # after a compute: raise if an RPC server died (None: none)
    set_outputs: Callable[[np.ndarray, np.ndarray], None]  # the step's logits and output ids, into the context


class FusedStep:
    """The fused decode step of one :class:`~.context.Context` (llama graphs over a plain KVCache), which owns it
    and gives it the parts it works with."""

    def __init__(self, kv: KVCache, balloc: BatchAllocator, cparams: CParams, n_vocab: int, times: Any,
                 host: StepHost) -> None:
        book = kv.book
        self.host = host                                        # the owner's scheduler and callbacks
        self.balloc = balloc                                    # validates and splits the batch
        self.step = kv.step                                     # placement and inputs
        self.n_vocab = n_vocab
        # the sequence ids the allocator accepts: those of the cache (the general path's allocator takes any id
        # below LLAMA_MAX_SEQ in a unified cache, then the cache refuses the others; the fused one leaves them to it)
        self.n_seq_max = book.n_seq_max
        # what the batch's positions continue: the one stream's cells (their seq_pos_max without the id check: the
        # ids are in range), else the bookkeeping (the stream of each sequence)
        self.memory = book.v_cells[0] if book.n_stream == 1 else book
        self.n_ubatch = cparams.n_ubatch
        self.equal_seqs = book.n_stream > 1                     # split_equal (several streams) or split_simple
        self.causal = bool(cparams.causal_attn)
        self.times = times
        self.timed = not cparams.no_perf                        # time the phases (no_perf off)
        self.n_steps = 0                                        # steps taken by this path (tests, notebooks)
        self._iota1 = host.iota[:1]                             # the output ids of a one-token step (read-only)
        self._graph: DecoderGraph | None = None                 # the last graph found with host views of all
        self._tok_m = self._pos_m = self._out_m = memoryview(b"")  # ... memoryviews of its token, position and
        #                                                           output-row inputs, and the compute's arguments
        self._args: tuple[int, int] = (0, 0)

    def __call__(self, batch: Batch, g: DecoderGraph) -> np.ndarray | None:
        """Decode ``batch`` by computing ``g`` again; its logits [n, n_vocab], or None (nothing done) when the
        step is not one the fused path takes."""
        if g is not self._graph:  # (a graph's views are set when it is first filled, then kept)
            if any(v is None for v in (g.kv_views, g.tokens_h, g.pos_h, g.out_ids_h, g.logits_h)):
                return None
            self._graph = g
            self._tok_m, self._pos_m, self._out_m = (memoryview(v) for v in (g.tokens_h, g.pos_h, g.out_ids_h))
            self._args = (g.sched, g.graph.ptr)
        if not self.step.ready():
            return None
        if batch.n_tokens == 1:
            return self._one(batch, g)
        key = g.key
        timed = self.timed
        t0 = t1 = t2 = 0.0
        if timed:
            t0 = _perf()
        try:
            got = self.balloc.init_step(batch, self.n_vocab, self.memory, self.n_seq_max, self.n_ubatch,
                                        self.equal_seqs)
        except ValueError:  # an invalid batch: the general path raises its own error
            return None
        if got is None:
            return None
        seqs, pos = got
        n = len(seqs)
        if n != key.n_tokens or n != key.n_outputs or key.n_stream != (n if self.equal_seqs else 1):
            return None
        if timed:
            t1 = _perf()
        if not self.step.place(seqs, pos, key.n_kv, key.s0, key.s1):
            return None
        if timed:
            t2 = _perf()
        g.tokens_h[...] = batch.token
        g.pos_h[...] = pos if batch.pos is None else batch.pos  # (an array copies faster than a list converts)
        g.out_ids_h[...] = g.out_rows
        self.step.fill(g.kv_views, seqs, pos, self.causal)
        return self._compute(g, n, seqs, pos, t0, t1, t2)

    def forget(self, g: DecoderGraph) -> None:
        """``g`` is allocated again or dropped (the context's graph cache): its views are no longer valid."""
        if g is self._graph:
            self._graph = None
            self._tok_m = self._pos_m = self._out_m = memoryview(b"")
            self._args = (0, 0)

    def _one(self, batch: Batch, g: DecoderGraph) -> np.ndarray | None:
        """The step of one token (the same as above without lists)."""
        key = g.key
        if key.n_tokens != 1 or key.n_outputs != 1:
            return None
        timed = self.timed
        t0 = t1 = t2 = 0.0
        if timed:
            t0 = _perf()
        try:
            got = self.balloc.init_step_one(batch, self.n_vocab, self.memory, self.n_seq_max)
        except ValueError:  # an invalid batch: the general path raises its own error
            return None
        if got is None:
            return None
        s, p = got
        if timed:
            t1 = _perf()
        step = self.step
        if not step.place_one(s, p, key.n_kv, key.s0, key.s1):
            return None
        if timed:
            t2 = _perf()
        self._tok_m[0] = batch.token.item(0)  # (memoryviews: scalar writes a few times cheaper than numpy's)
        self._pos_m[0] = p
        self._out_m[0] = 0
        step.fill_one(g.kv_views, s, p, self.causal)
        return self._compute(g, 1, s, p, t0, t1, t2)

    def _compute(self, g: DecoderGraph, n: int, seqs: Any, pos: Any, t0: float, t1: float, t2: float) -> np.ndarray:
        """Compute ``g`` (its inputs filled), take its logits and account the step (its phases' times, when timed:
        ``t0``..``t2`` the starts of the batch, bookkeeping and inputs phases).  ``seqs``/``pos``: the tokens'
        sequences and positions (lists, or the one token's ints), for the clean-up of a failed compute."""
        timed = self.timed
        t3 = _perf() if timed else 0.0
        host = self.host
        host.use_threads(n)
        status = G.ggml_backend_sched_graph_compute(*self._args)
        if status != _SUCCESS:
            host.fail_compute(status, zip(seqs, pos) if n > 1 else [(seqs, pos)])
        logits = g.logits_h.copy()
        if host.check_rpc is not None:
            host.check_rpc("decode", zip(seqs, pos) if n > 1 else [(seqs, pos)])
        host.set_outputs(logits, self._iota1 if n == 1 else host.iota[:n])
        tm = self.times
        if timed:
            tm.batch += t1 - t0
            tm.bookkeeping += t2 - t1
            tm.inputs += t3 - t2
            tm.compute += _perf() - t3
        tm.n_decode += 1
        tm.n_ubatch += 1
        tm.n_graph_reused += 1
        tm.n_tokens += n
        self.n_steps += 1
        return logits

