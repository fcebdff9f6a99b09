"""Backend parity: replay one deterministic trace on every available backend and compare with the CPU.

``python -m kvcache_ggml parity [--backends cpu,rpc,cuda,metal,vulkan] [--types f16,q8_0]``

The trace (tokens per sequence and all K/V/Q data drawn from the seed) runs on a cache of each type in two layouts
-- one unified stream of four sequences, and three streams of one sequence each -- through the cache's own API, with
every graph computed on a scheduler over the placement's backends:

* ``write``: random K/V rows stored into the slots the cache finds (``cpy_k``/``cpy_v`` graphs); the written rows of
  every layer, read back from the backend's buffers;
* ``inputs``: every input tensor as the scheduler received it -- ``k_idxs``, ``v_idxs``, the kq mask (F32, and F16
  through the context), ``k_shift``;
* ``attn``: an attention over ``get_k``/``get_v`` with the mask, per layer, computed where the layer lives;
* ``seq_ops``: ``seq_rm``, ``seq_cp``, ``seq_keep``, ``seq_add``, ``seq_div`` -- the cells, and that no buffer changed;
* ``kshift``: every layer's K after ``update()`` applied the pending shifts (RoPE on the backend);
* ``stream_copy``: the buffers after a cross-stream ``seq_cp`` and ``update()``; the copied stream must equal its
  source bit for bit on the backend itself;
* ``state``: ``state_save`` then ``state_load`` into a fresh cache on the same placement (whole cache and one
  sequence): saving the restored cache must give the same bytes; its cells and buffers are compared with the CPU.

Errors: ``exact`` checks must match the CPU bit for bit (the reported figure is the largest absolute difference);
``nmse`` checks report the normalised mean squared error ``sum((x - ref)^2) / sum(ref^2)`` of the values
(dequantized for quantized types) and pass under the limit of :func:`tolerance`.  CPU against RPC must give 0
everywhere: the RPC server runs the same CPU code.  Each backend replays in a child process (a ggml abort fails its
row as CRASH); ``--bench`` times a model-sized cache on each backend instead.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import pickle
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from . import _ggml as G
from .backends import (BackendNotBuiltError, PlacedModel, Placement, PlacementError, backend_status,
                       local_rpc_server)
from .batch import Batch, BatchAllocator
from .cache import KVCache, MemoryStatus
from .hparams import HParams, RopeType

__all__ = ["CHECKS", "BACKENDS", "ParityConfig", "Tolerance", "tolerance", "Target", "make_target", "Capture",
           "replay", "CheckResult", "ParityRow", "ParityReport", "compare", "run_parity", "replay_isolated",
           "ReplayCrash", "crash_row", "BenchConfig", "BenchRow",
           "bench", "bench_table", "run_bench", "main"]

CHECKS: tuple[str, ...] = ("write", "inputs", "attn", "seq_ops", "kshift", "stream_copy", "state")
BACKENDS: tuple[str, ...] = ("cpu", "rpc", "cuda", "metal", "vulkan")
_N_VOCAB = 32


# ============================================================================================== configuration

@dataclass(slots=True, frozen=True)
class ParityConfig:
    """The model and trace every backend replays."""

    seed: int = 0                                  # the whole trace (positions, sequences, data) follows from it
    n_layer: int = 4                               # layers of the toy model
    n_embd_head: int = 32                          # head size of K and V (a q8_0 block)
    n_head: int = 4                                # query heads
    n_head_kv: tuple[int, ...] = (2, 1, 2, 2)      # K/V heads per layer (varied: exercises the V padding)
    kv_size_unified: int = 64                      # cells of the unified cache (one stream, 4 sequences)
    kv_size_streams: int = 32                      # cells per stream of the multi-stream cache (3 streams)
    n_ubatch: int = 8                              # tokens per ubatch
    n_threads: int = 1                             # CPU threads of every scheduler
    rope_freq_base: float = 10000.0                # RoPE base of the K-shift

    def hparams(self) -> HParams:
        return HParams.simple(n_layer=self.n_layer, n_embd_head=self.n_embd_head, n_head=self.n_head,
                              n_head_kv=self.n_head_kv, n_rot=self.n_embd_head, rope_type=RopeType.NEOX,
                              rope_freq_base_train=self.rope_freq_base, n_vocab=_N_VOCAB)


@dataclass(slots=True, frozen=True)
class Tolerance:
    """How one check compares a backend with the CPU."""

    metric: str   # "exact" (bits equal; figure = max |difference|) or "nmse" (figure = normalised MSE)
    limit: float  # largest figure that passes (0 for exact)


def tolerance(check: str, type_: str | int) -> Tolerance:
    """Per check and cache type: copies, cells and inputs exact; RoPE, attention and quantized data by NMSE.

    F32 -> F16/BF16 conversion is correctly rounded on every backend, so written rows of float caches are exact;
    quantizers may round a value differently (q8_0: one step is 1/127 of a block's maximum), hence the NMSE.
    """
    q = G.is_quantized(type_)
    if check in ("inputs", "seq_ops"):
        return Tolerance("exact", 0.0)
    if check == "write":
        return Tolerance("nmse", 1e-4) if q else Tolerance("exact", 0.0)
    if check in ("kshift", "stream_copy", "state", "attn"):
        return Tolerance("nmse", 1e-4 if q else 1e-5)
    raise ValueError(f"unknown check {check!r}; checks: {', '.join(CHECKS)}")


# ============================================================================================== targets

@dataclass(slots=True, frozen=True)
class Target:
    """A backend to compare with the CPU, as a placement of the toy model's layers."""

    name: str              # "cpu", "rpc", "cuda", ...
    placement: Placement   # where the layers go
    label: str             # what the table prints: "layers 2-3 on rpc://127.0.0.1:PORT"


def _layers_label(layer_map: list[str]) -> str:
    groups: list[tuple[int, int, str]] = []
    for il, spec in enumerate(layer_map):
        if groups and groups[-1][2] == spec:
            groups[-1] = (groups[-1][0], il, spec)
        else:
            groups.append((il, il, spec))
    return ", ".join(f"{'layer' if a == b else 'layers'} {a if a == b else f'{a}-{b}'} on {s}"
                     for a, b, s in groups)


def make_target(name: str, n_layer: int, rpc_spec: str | None = None, split: str = "auto") -> Target:
    """The placement for backend ``name``: "cpu" all on the CPU; "rpc" (needs ``rpc_spec``) and the GPUs either
    half of the layers (the last ones, llama.cpp's n_gpu_layers) or all of them (``split`` "half"/"all"; "auto":
    half for RPC, all for GPUs).  BackendNotBuiltError / DeviceNotFoundError when the backend cannot be used."""
    key = name.strip().lower()
    if key not in BACKENDS:
        raise PlacementError(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}")
    if key == "cpu":
        return Target("cpu", Placement.cpu(), "all on CPU")
    st = backend_status(key)
    if not st.built:
        raise BackendNotBuiltError(f"{key}: {st.reason}")
    if key == "rpc":
        if rpc_spec is None:
            raise PlacementError("rpc: no server given (rpc_spec)")
        device = rpc_spec
    else:
        if st.reason:
            raise PlacementError(f"{key}: {st.reason}")
        device = key
    half = split == "half" or (split == "auto" and key == "rpc")
    placement = (Placement.split([device], n_gpu_layers=n_layer // 2 + 1) if half else Placement.single(device))
    return Target(key, placement, "")


# ============================================================================================== capture

@dataclass(slots=True)
class Item:
    """One recorded array of a replay."""

    check: str          # which check compares it
    label: str          # where it comes from: "A.ub0 k_idxs", "kshift K l2", ...
    type: int           # ggml type of the data (raw quantized rows for quantized types)
    data: np.ndarray    # the data as read back from the backend
    metric: str         # "exact" or "nmse"


@dataclass(slots=True)
class Capture:
    """Everything one replay recorded, in trace order."""

    target: str                                         # backend name
    type: str                                           # cache type
    layer_map: list[str] = field(default_factory=list)  # device spec of each layer
    items: list[Item] = field(default_factory=list)     # recorded arrays
    failures: list[str] = field(default_factory=list)   # self-consistency failures (check: what)
    seconds: float = 0.0                                # replay time

    def add(self, check: str, label: str, type_: int, data: np.ndarray, metric: str | None = None) -> None:
        m = metric or tolerance(check, self.type).metric
        self.items.append(Item(check, label, int(type_), np.array(data, copy=True), m))

    def fail(self, check: str, what: str) -> None:
        self.failures.append(f"{check}: {what}")


def _cells(kv: KVCache) -> np.ndarray:
    """int64 [n_stream, 3 + SEQ_WORDS, kv_size]: pos, shift, head, sequence bitsets of every stream."""
    out = []
    for s, c in enumerate(kv.v_cells):
        rows = [c.pos_array.astype(np.int64), c.shift_array.astype(np.int64),
                np.full(c.size(), kv.v_heads[s], np.int64)]
        rows += [w.view(np.int64) for w in c.seq_bits]
        out.append(np.stack(rows))
    return np.stack(out)


def _kv_arrays(kv: KVCache) -> list[tuple[str, int, np.ndarray]]:
    """(name, type, raw data) of every layer's K and V, read from the backend."""
    res = []
    for layer in kv.layers:
        res.append((f"K l{layer.il}", G.ttype(layer.k), G.to_numpy(layer.k, copy=True)))
        res.append((f"V l{layer.il}", G.ttype(layer.v), G.to_numpy(layer.v, copy=True)))
    return res


def _v_channels(kv: KVCache, raw: np.ndarray) -> np.ndarray:
    """V data as [n_stream, kv_size, row] (quantized: row bytes) whatever its layout."""
    ns, size = kv.n_stream, kv.get_size()
    if kv.v_trans:  # memory is [stream][channel][cell]
        return np.ascontiguousarray(raw.reshape(ns, -1, size).transpose(0, 2, 1))
    return raw.reshape(ns, size, -1)


# ============================================================================================== graphs

def _attention(ctx: G.Context, mctx: Any, kv: KVCache, il: int, q: Any, mask: Any, n_stream: int) -> Any:
    """llama.cpp's build_attn_mha without flash attention: softmax(K^T Q * scale + mask) V, per stream."""
    c = ctx.ptr
    hp = kv.hparams
    k = mctx.get_k(ctx, il)                                    # [E, n_head_kv, n_kv, ns]
    v = mctx.get_v(ctx, il)                                    # [n_kv, n_head_kv, E_v, ns] (transposed)
    ne_q, nb_q = G.ne(q), G.nb(q)
    q4 = G.ggml_view_4d(c, q, ne_q[0], ne_q[1], ne_q[2] // n_stream, n_stream, nb_q[1], nb_q[2],
                        nb_q[2] * ne_q[2] // n_stream, 0)       # [E, n_head, n_tps, ns]
    q4 = G.ggml_permute(c, q4, 0, 2, 1, 3)                     # [E, n_tps, n_head, ns]
    k = G.ggml_permute(c, k, 0, 2, 1, 3)                       # [E, n_kv, n_head_kv, ns]
    v = G.ggml_permute(c, v, 0, 2, 1, 3)
    kq = G.ggml_mul_mat(c, k, q4)                              # [n_kv, n_tps, n_head, ns]
    kq = G.ggml_soft_max_ext(c, kq, mask, 1.0 / math.sqrt(hp.n_embd_head_k), 0.0)
    if not kv.v_trans:
        if G.is_quantized(G.ttype(v)):
            v = G.ggml_cast(c, v, G.GGMLType.F32)              # [E_v, n_kv, n_head_kv, ns]
        v = G.ggml_cont(c, G.ggml_transpose(c, v))             # [n_kv, E_v, n_head_kv, ns]
    kqv = G.ggml_mul_mat(c, v, kq)                             # [E_v, n_tps, n_head, ns]
    out = G.ggml_cont(c, G.ggml_permute(c, kqv, 0, 2, 1, 3))   # [E_v, n_head, n_tps, ns]
    G.ggml_set_output(out)
    return out


def _values(item: Item) -> np.ndarray:
    t = G.GGMLType(item.type)
    if G.is_quantized(t):
        return G.dequantize(item.data, t).astype(np.float64)
    if t == G.GGMLType.BF16:
        return (item.data.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return item.data.astype(np.float64)


@dataclass(slots=True)
class _Step:
    """One ubatch's graph as a model would build it for the cache: store K/V of every layer, then attend."""

    graph: G.Graph                        # cpy_k/cpy_v of every layer, then the attention outputs
    mctx: Any                             # the KVCacheContext of the ubatch (after apply())
    k_idxs: Any                           # input I64: destination rows of K
    v_idxs: Any                           # input I64: destination rows (or elements) of V
    mask: Any                             # input F32 [n_kv, n_tps, 1, n_stream]
    data: list[tuple[Any, np.ndarray]]    # (input tensor, float32 values): q, k_cur and v_cur of every layer
    outs: list[tuple[int, Any]]           # (layer, attention output F32 [E_v, n_head, n_tps, n_stream])

    @staticmethod
    def room(kv: KVCache) -> tuple[int, int]:
        """(tensors, graph nodes) the context needs."""
        return 8 + 24 * len(kv.layers), 32 * len(kv.layers) + 64

    @classmethod
    def build(cls, ctx: G.Context, kv: KVCache, mctx: Any, rng: np.random.Generator) -> "_Step":
        hp = kv.hparams
        ub, sinfo = mctx.get_ubatch(), mctx.get_sinfo()
        n_tokens, ns, n_kv = ub.n_tokens, sinfo.n_stream(), mctx.get_n_kv()
        E, Ev = hp.n_embd_head_k, hp.n_embd_head_v
        k_idxs = mctx.build_input_k_idxs(ctx, ub)
        v_idxs = mctx.build_input_v_idxs(ctx, ub)
        q = ctx.new_tensor("f32", (E, hp.n_head(), n_tokens), "q")
        mask = ctx.new_tensor("f32", (n_kv, n_tokens // ns, 1, ns), "kq_mask")
        G.ggml_set_input(q)
        G.ggml_set_input(mask)
        graph = G.Graph(ctx, cls.room(kv)[1])
        data = [(q, rng.standard_normal((n_tokens, hp.n_head(), E), np.float32))]
        for layer in kv.layers:
            il, h = layer.il, hp.n_head_kv(layer.il)
            k_cur = ctx.new_tensor("f32", (E, h, n_tokens), f"k_cur_l{il}")
            v_cur = ctx.new_tensor("f32", (Ev, h, n_tokens), f"v_cur_l{il}")
            G.ggml_set_input(k_cur)
            G.ggml_set_input(v_cur)
            data.append((k_cur, rng.standard_normal((n_tokens, h, E), np.float32)))
            data.append((v_cur, rng.standard_normal((n_tokens, h, Ev), np.float32)))
            graph.expand(mctx.cpy_k(ctx, k_cur, k_idxs, il))
            graph.expand(mctx.cpy_v(ctx, v_cur, v_idxs, il))
        outs = [(layer.il, _attention(ctx, mctx, kv, layer.il, q, mask, ns)) for layer in kv.layers]
        for _, o in outs:
            graph.expand(o)
        return cls(graph, mctx, k_idxs, v_idxs, mask, data, outs)

    def fill(self) -> None:
        """Write every input (after the scheduler allocated the graph)."""
        ub = self.mctx.get_ubatch()
        for t, a in self.data:
            G.set_tensor(t, a)
        self.mctx.set_input_k_idxs(self.k_idxs, ub)
        self.mctx.set_input_v_idxs(self.v_idxs, ub)
        self.mctx.set_input_kq_mask(self.mask, ub, True)


# ============================================================================================== the trace

class _Replay:
    """One replay of the trace on one placement; records into a Capture."""

    def __init__(self, cfg: ParityConfig, pm: PlacedModel, type_: str, cap: Capture) -> None:
        self.cfg, self.pm, self.type, self.cap = cfg, pm, type_, cap
        self.hp = pm.hparams
        self.v_trans = G.blck_size(type_) == 1  # quantized V needs the flash-attention layout, as in llama.cpp
        self.be = pm.backends(n_threads=cfg.n_threads)

    def close(self) -> None:
        self.be.close()

    def new_cache(self, layout: str) -> KVCache:
        cfg = self.cfg
        if layout == "unified":
            return KVCache(self.pm, offload=True, type_k=self.type, type_v=self.type, v_trans=self.v_trans,
                           kv_size=cfg.kv_size_unified, n_seq_max=4, unified=True)
        return KVCache(self.pm, offload=True, type_k=self.type, type_v=self.type, v_trans=self.v_trans,
                       kv_size=cfg.kv_size_streams, n_seq_max=3, unified=False)

    def rng(self, *key: int) -> np.random.Generator:
        return np.random.default_rng([self.cfg.seed, *key])

    # ------------------------------------------------------------------ steps

    def counts(self, key: int, n_seq: int, lo: int, hi: int) -> dict[int, int]:
        """New tokens per sequence for a batch: lo..hi-1 each, drawn from the seed."""
        return {s: int(n) for s, n in enumerate(self.rng(key, 999).integers(lo, hi, n_seq))}

    def decode(self, kv: KVCache, tag: str, seq_tokens: dict[int, int], key: int) -> None:
        """One batch: seq_tokens[s] new tokens of sequence s (positions continued by the allocator)."""
        seqs = np.concatenate([np.full(n, s, np.int32) for s, n in seq_tokens.items()])
        ba = BatchAllocator(1)
        ba.init(Batch(token=np.full(seqs.size, 1, np.int32), seq_id=seqs[:, None]), _N_VOCAB, kv,
                self.hp.n_embd, kv.n_seq_max, False)
        mctx = kv.init_batch(ba, self.cfg.n_ubatch)
        if mctx.get_status() != MemoryStatus.SUCCESS:
            raise RuntimeError(f"parity trace {tag}: the batch does not fit the cache ({mctx.get_status().name})")
        i = 0
        while True:
            mctx.apply()
            self.ubatch(kv, mctx, f"{tag}.ub{i}", self.rng(key, i))
            i += 1
            if not mctx.next():
                break

    def ubatch(self, kv: KVCache, mctx: Any, tag: str, rng: np.random.Generator) -> None:
        """Store random K/V for the ubatch and attend over the cache, in one graph on the scheduler."""
        cap = self.cap
        sinfo = mctx.get_sinfo()
        with G.Context.for_tensors(*_Step.room(kv)) as ctx:
            step = _Step.build(ctx, kv, mctx, rng)

            def fill() -> None:
                step.fill()
                # what the scheduler receives (the allocator may reuse input memory once the graph has run)
                cap.add("inputs", f"{tag} k_idxs", G.GGMLType.I64, G.to_numpy(step.k_idxs, copy=True), "exact")
                cap.add("inputs", f"{tag} v_idxs", G.GGMLType.I64, G.to_numpy(step.v_idxs, copy=True), "exact")
                cap.add("inputs", f"{tag} kq_mask", G.GGMLType.F32, G.to_numpy(step.mask, copy=True), "exact")

            self.be.compute(step.graph, fill)
            for il, o in step.outs:
                cap.add("attn", f"{tag} attn l{il}", G.GGMLType.F32, G.to_numpy(o, copy=True), "nmse")
            self.be.reset()
        cap.add("inputs", f"{tag} kq_mask f16", G.GGMLType.F16, mctx.kq_mask(True, "f16"), "exact")
        # the rows this ubatch wrote, per layer
        cells = np.concatenate([s * kv.get_size() + idx for s, idx in zip(sinfo.strm, sinfo.idxs)])
        for name, t, raw in _kv_arrays(kv):
            rows = (_v_channels(kv, raw) if name[0] == "V" else raw).reshape(kv.n_stream * kv.get_size(), -1)
            cap.add("write", f"{tag} {name}", t, rows[cells])

    def buffers(self, kv: KVCache, check: str, tag: str) -> list[tuple[str, int, np.ndarray]]:
        arrays = _kv_arrays(kv)
        for name, t, raw in arrays:
            self.cap.add(check, f"{tag} {name}", t, raw, tolerance(check, self.type).metric)
        return arrays

    def cells(self, kv: KVCache, check: str, tag: str) -> None:
        self.cap.add(check, f"{tag} cells", G.GGMLType.I64, _cells(kv), "exact")

    def update(self, kv: KVCache, tag: str) -> None:
        self.cap.add("inputs", f"{tag} k_shift", G.GGMLType.I32, kv.k_shift(), "exact")
        before = _kv_arrays(kv) if kv.get_has_shift() else None
        uctx = self.be.update_context(hparams=self.hp)
        mctx = kv.init_update(uctx)
        if mctx.get_status() == MemoryStatus.SUCCESS:
            mctx.apply()
        if before is not None and all(a.tobytes() == b.tobytes()
                                      for (n, _, a), (_, _, b) in zip(before, _kv_arrays(kv)) if n[0] == "K"):
            self.cap.fail("kshift", f"{tag}: cells had pending shifts but update() left every K as it was")

    def unchanged(self, before: list, kv: KVCache, check: str, what: str) -> None:
        for (name, _, a), (_, _, b) in zip(before, _kv_arrays(kv)):
            if a.tobytes() != b.tobytes():
                self.cap.fail(check, f"{what} changed {name}")

    def state(self, kv: KVCache, layout: str, tag: str, seq: int) -> None:
        """Whole-cache and one-sequence save/restore into fresh caches; resaving must give the same bytes."""
        for sid in (-1, seq):
            blob = kv.state_save(sid)
            with self.new_cache(layout) as fresh:
                fresh.state_load(blob, sid)
                again = fresh.state_save(sid)
                if again != blob:
                    self.cap.fail("state", f"{tag} seq {sid}: restored cache saves {len(again)} bytes that differ "
                                           f"from the {len(blob)} saved")
                self.cells(fresh, "state", f"{tag} seq {sid}")
                self.buffers(fresh, "state", f"{tag} seq {sid}")

    # ------------------------------------------------------------------ the two layouts

    def run_unified(self) -> None:
        with self.new_cache("unified") as kv:
            self.decode(kv, "U1", self.counts(1, 4, 4, 9), 1)
            before = _kv_arrays(kv)
            kv.seq_rm(1, 2, 4)
            kv.seq_cp(0, 3, 0, 3)
            kv.seq_add(2, 1, -1, 3)
            kv.seq_div(0, 4, -1, 2)
            kv.seq_rm(-1, 9, -1)
            self.cells(kv, "seq_ops", "U2")
            self.unchanged(before, kv, "seq_ops", "seq_rm/seq_cp/seq_add/seq_div")
            self.update(kv, "U3")
            self.cells(kv, "kshift", "U3")
            self.buffers(kv, "kshift", "U3")
            self.decode(kv, "U4", self.counts(4, 4, 1, 5), 4)
            self.state(kv, "unified", "U5", 2)
            before = _kv_arrays(kv)
            kv.seq_keep(0)
            self.cells(kv, "seq_ops", "U6")
            self.unchanged(before, kv, "seq_ops", "seq_keep")
            self.decode(kv, "U7", {0: 2}, 7)

    def run_streams(self) -> None:
        with self.new_cache("streams") as kv:
            self.decode(kv, "S1", self.counts(11, 3, 3, 9), 11)
            kv.seq_cp(0, 2)
            kv.seq_add(1, 2, -1, 2)
            self.cells(kv, "seq_ops", "S2")
            self.update(kv, "S3")
            arrays = self.buffers(kv, "stream_copy", "S3")
            for layer, (nk, _, k), (nv, _, v) in zip(kv.layers, arrays[0::2], arrays[1::2]):
                for name, raw in ((nk, k), (nv, v)):
                    per = raw.reshape(kv.n_stream, -1)
                    if per[2].tobytes() != per[0].tobytes():
                        self.cap.fail("stream_copy", f"S3 {name}: stream 2 differs from its source stream 0")
            self.cells(kv, "kshift", "S3")
            self.decode(kv, "S4", self.counts(14, 3, 1, 4), 14)
            self.state(kv, "streams", "S5", 1)


def replay(cfg: ParityConfig, target: Target, type_: str, *, allow_remote: bool = False) -> Capture:
    """Run the whole trace for one cache type on one target; everything it recorded, in order."""
    t0 = time.perf_counter()
    pm = PlacedModel(cfg.hparams(), target.placement, allow_remote=allow_remote)
    cap = Capture(target.name, G.type_name(G.parse_type(type_)), pm.layer_map())
    r = _Replay(cfg, pm, cap.type, cap)
    try:
        r.run_unified()
        r.run_streams()
    finally:
        r.close()
    cap.seconds = time.perf_counter() - t0
    return cap


class ReplayCrash(RuntimeError):
    """A replay process died -- a ggml abort (GGML_ASSERT) in a backend, or a Python error: the backend fails."""


def replay_isolated(cfg: ParityConfig, target: Target, type_: str, *, allow_remote: bool = False,
                    timeout: float = 600.0) -> Capture:
    """:func:`replay` in a child process, so that a ggml abort in a backend fails that backend instead of killing
    this process.  A PlacementError of the child is raised again here; a crash raises ReplayCrash naming the
    failed assertion (or the last line of the traceback)."""
    with tempfile.TemporaryDirectory(prefix="kvcache_parity_") as d:
        out = Path(d) / "capture.pickle"
        code = "import sys; from kvcache_ggml.parity import _replay_child; sys.exit(_replay_child(sys.argv[1]))"
        try:
            # GGML_NO_BACKTRACE: an abort prints its message without attaching gdb (slow, pages of output)
            proc = subprocess.run([sys.executable, "-c", code, str(out)], input=pickle.dumps(
                (cfg, target, type_, allow_remote)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout,
                env=dict(os.environ, GGML_NO_BACKTRACE="1"))
        except subprocess.TimeoutExpired:
            raise ReplayCrash(f"{target.name} {type_}: the replay did not finish within {timeout:g} s") from None
        if proc.returncode == 0:
            return pickle.loads(out.read_bytes())
        if proc.returncode == _CHILD_PLACEMENT_ERROR:
            raise pickle.loads(out.read_bytes())
        err = proc.stderr.decode("utf-8", "replace").splitlines()
        why = next((ln.strip() for ln in err if _GGML_ABORT_LINE.search(ln)), None)  # "ops.cpp:6005: fatal error"
        if why is None:
            why = next((ln.strip() for ln in reversed(err) if ln.strip() and not ln.startswith((" ", "#"))),
                       "no message")
        how = (f"killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
               else f"exited with code {proc.returncode}")
        raise ReplayCrash(f"{target.name} {type_}: the replay process {how}: {why}")


_CHILD_PLACEMENT_ERROR = 3
_GGML_ABORT_LINE = re.compile(r"\S+\.(?:c|cc|cpp|cu|m|mm):\d+: \S")  # how ggml_abort reports: file:line: message


def _replay_child(out_path: str) -> int:
    """Entry of :func:`replay_isolated`'s child: arguments pickled on stdin, the Capture pickled to out_path."""
    logging.getLogger("kvcache_ggml.cache").setLevel(logging.ERROR)
    cfg, target, type_, allow_remote = pickle.loads(sys.stdin.buffer.read())
    try:
        cap = replay(cfg, target, type_, allow_remote=allow_remote)
    except PlacementError as e:
        Path(out_path).write_bytes(pickle.dumps(e))
        return _CHILD_PLACEMENT_ERROR
    Path(out_path).write_bytes(pickle.dumps(cap))
    return 0


# ============================================================================================== comparison

@dataclass(slots=True)
class CheckResult:
    """One check of one backend and type."""

    metric: str          # "exact" or "nmse" (of the arrays compared by the tolerance's metric)
    error: float         # largest figure over the compared arrays (nan: nothing compared)
    limit: float         # tolerance
    passed: bool         # error within the limit, every exact array equal, no self-consistency failure
    n_arrays: int        # arrays compared
    notes: list[str] = field(default_factory=list)  # what failed

    def cell(self) -> str:
        if self.n_arrays == 0:
            return "-" if self.passed else "CRASH"
        fig = "0" if self.error == 0 else f"{self.error:.1e}"
        return fig if self.passed else f"FAIL {fig}"


@dataclass(slots=True)
class ParityRow:
    """A backend and type against the CPU."""

    backend: str                          # "rpc", "cuda", ...
    type: str                             # cache type
    placement: str                        # where the layers were
    checks: dict[str, CheckResult]        # check -> result
    seconds: float                        # replay time on the backend

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks.values())


def _item_error(a: Item, b: Item) -> tuple[float, bool]:
    """(figure, equal bits) of backend item a against CPU item b."""
    if a.data.shape != b.data.shape or a.data.dtype != b.data.dtype:
        return math.inf, False
    same = a.data.tobytes() == b.data.tobytes()
    if a.metric == "exact":
        if same:
            return 0.0, True
        x, y = _values(a), _values(b)
        both = (x == y) | (np.isnan(x) & np.isnan(y))
        with np.errstate(invalid="ignore"):  # -inf - -inf where the masks agree
            d = np.abs(np.where(both, 0.0, x - y))
        return float(np.nan_to_num(d, nan=math.inf).max()), False
    if same:
        return 0.0, True
    x, y = _values(a), _values(b)
    den = float(np.sum(y * y))
    num = float(np.sum((x - y) ** 2))
    return (num / den if den > 0 else (0.0 if num == 0 else math.inf)), False


def crash_row(target: Target, type_: str, layer_map: list[str], message: str) -> ParityRow:
    """The row of a backend whose replay died: every check failed, with the reason."""
    checks = {c: CheckResult(tolerance(c, type_).metric, math.nan, tolerance(c, type_).limit, False, 0, [message])
              for c in CHECKS}
    return ParityRow(target.name, type_, _layers_label(layer_map) if layer_map else target.placement.describe(),
                     checks, 0.0)


def compare(got: Capture, ref: Capture) -> ParityRow:
    """Every check of a backend's capture against the CPU's."""
    if [(i.check, i.label) for i in got.items] != [(i.check, i.label) for i in ref.items]:
        raise RuntimeError(f"the {got.target} replay recorded a different trace than the CPU's "
                           f"({len(got.items)} vs {len(ref.items)} arrays)")
    results: dict[str, CheckResult] = {}
    for check in CHECKS:
        tol = tolerance(check, got.type)
        pairs = [(a, b) for a, b in zip(got.items, ref.items) if a.check == check]
        res = CheckResult(tol.metric, 0.0 if pairs else math.nan, tol.limit, True, len(pairs))
        for a, b in pairs:
            err, same = _item_error(a, b)
            if a.metric == "exact":
                if not same:
                    res.passed = False
                    res.notes.append(f"{a.label}: differs (max |diff| {err:.3g})")
                if tol.metric == "exact":
                    res.error = max(res.error, err)
            else:
                res.error = max(res.error, err)
                if not err <= tol.limit:
                    res.passed = False
                    res.notes.append(f"{a.label}: nmse {err:.3g} > {tol.limit:g}")
        for f in got.failures:
            if f.startswith(check + ":"):
                res.passed = False
                res.notes.append(f)
        results[check] = res
    return ParityRow(got.target, got.type, _layers_label(got.layer_map), results, got.seconds)


@dataclass(slots=True)
class ParityReport:
    """Rows (backend x type) and the backends skipped, with the reason."""

    config: ParityConfig                                          # the trace
    rows: list[ParityRow] = field(default_factory=list)           # compared backends
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (backend, reason)
    reference_seconds: dict[str, float] = field(default_factory=dict)  # type -> CPU replay time

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.rows)

    def table(self) -> str:
        """backend x check -> max error, as a Markdown table, then the skipped backends and the failures."""
        head = ["backend", "type", *CHECKS, "time", "result"]
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        for r in self.rows:
            crashed = all(c.n_arrays == 0 and not c.passed for c in r.checks.values())
            cells = [r.backend, r.type, *(r.checks[c].cell() for c in CHECKS),
                     "-" if crashed else f"{r.seconds:.1f} s", "CRASH" if crashed else "PASS" if r.passed else "FAIL"]
            lines.append("| " + " | ".join(cells) + " |")
        for name, reason in self.skipped:
            lines.append("| " + " | ".join([name, "-", *("skip" for _ in CHECKS), "-", "SKIPPED"]) + " |")
        out = ["\n".join(lines), ""]
        placements = sorted({(r.backend, r.placement) for r in self.rows if r.placement})
        out += [f"placement {b}: {p}" for b, p in placements]
        out += [f"skipped {name}: {reason}" for name, reason in self.skipped]
        types = sorted({r.type for r in self.rows})
        out.append("tolerances: " + "; ".join(f"{t}: {_tolerance_text(t)}" for t in types))
        for r in self.rows:
            notes = {n for c in CHECKS for n in r.checks[c].notes}
            if len(notes) == 1 and all(r.checks[c].notes for c in CHECKS):  # one cause for all: a crash
                out.append(f"CRASH {r.backend} {r.type}: {notes.pop()}")
                continue
            for c in CHECKS:
                for n in r.checks[c].notes[:5]:
                    out.append(f"FAIL {r.backend} {r.type} {c}: {n}")
        return "\n".join(out)


def _tolerance_text(type_: str) -> str:
    parts = []
    for c in CHECKS:
        tol = tolerance(c, type_)
        parts.append(f"{c} exact" if tol.metric == "exact" else f"{c} nmse <= {tol.limit:g}")
    return ", ".join(parts)


def _check_types(types: Sequence[str], cfg: ParityConfig) -> list[str]:
    out = []
    for t in types:
        tt = G.parse_type(t.strip())  # ValueError naming the valid ones
        if cfg.n_embd_head % G.blck_size(tt):
            raise ValueError(f"cache type {t!r}: its block of {G.blck_size(tt)} elements does not divide the head "
                             f"size {cfg.n_embd_head}")
        out.append(G.type_name(tt))
    return out


def run_parity(backends: Sequence[str], types: Sequence[str], cfg: ParityConfig = ParityConfig(), *,
               rpc_spec: str | None = None, split: str = "auto", isolate: bool = True,
               log: Callable[[str], None] | None = None) -> ParityReport:
    """Compare every backend of ``backends`` with the CPU on caches of ``types``.

    "rpc" uses the server ``rpc_spec`` ("rpc://127.0.0.1:PORT"), or starts a loopback one for the run.  "cpu"
    replays the CPU against itself (a determinism check).  Backends that cannot run are reported as skipped.
    ``isolate``: each backend replays in a child process (:func:`replay_isolated`); a crash fails its row.
    """
    say = log or (lambda s: None)
    types = _check_types(types, cfg)
    report = ParityReport(cfg)
    names = [b.strip().lower() for b in backends if b.strip()]
    for b in names:
        if b not in BACKENDS:
            raise ValueError(f"unknown backend {b!r}; known: {', '.join(BACKENDS)}")
    with contextlib.ExitStack() as stack:
        targets: list[Target] = []
        for b in dict.fromkeys(names):
            try:
                spec = None
                if b == "rpc":
                    st = backend_status("rpc")
                    if not st.built:
                        raise BackendNotBuiltError(f"rpc: {st.reason}")
                    if rpc_spec is None:
                        server = stack.enter_context(local_rpc_server(threads=cfg.n_threads))
                        say(f"started a loopback RPC server at {server.spec}")
                        spec = server.spec
                    else:
                        spec = rpc_spec
                targets.append(make_target(b, cfg.n_layer, spec, split))
            except PlacementError as e:
                reason = str(e).partition(": ")[2] if str(e).startswith(b + ":") else str(e)
                report.skipped.append((b, reason))
                say(f"skipping {b}: {reason}")
        for t in types:
            cpu = make_target("cpu", cfg.n_layer)
            try:
                ref = replay_isolated(cfg, cpu, t) if isolate else replay(cfg, cpu, t)
            except ReplayCrash as e:
                say(f"cpu {t}: the reference replay crashed: {e}")
                report.rows += [crash_row(target, t, [], f"the CPU reference crashed: {e}") for target in targets]
                continue
            report.reference_seconds[t] = ref.seconds
            say(f"cpu {t}: reference replay, {len(ref.items)} arrays in {ref.seconds:.1f} s")
            for target in targets:
                try:
                    got = replay_isolated(cfg, target, t) if isolate else replay(cfg, target, t)
                    row = compare(got, ref)
                except PlacementError as e:
                    report.skipped.append((target.name, str(e)))
                    say(f"skipping {target.name}: {e}")
                    continue
                except ReplayCrash as e:
                    row = crash_row(target, t, [], str(e))
                    say(f"{target.name} {t}: CRASH: {e}")
                    report.rows.append(row)
                    continue
                report.rows.append(row)
                say(f"{target.name} {t}: {'PASS' if row.passed else 'FAIL'} in {got.seconds:.1f} s")
    # a backend skipped at resolve time is listed once even with several types
    seen: set[str] = set()
    report.skipped = [(b, r) for b, r in report.skipped if not (b in seen or seen.add(b))]
    return report


# ============================================================================================== benchmarks

@dataclass(slots=True, frozen=True)
class BenchConfig:
    """A model-sized cache for timing the graph half on a backend (llama-3-8B-like attention shapes)."""

    n_layer: int = 32              # layers, all on the backend
    n_embd_head: int = 128         # head size
    n_head: int = 32               # query heads
    n_head_kv: int = 8             # K/V heads
    kv_size: int = 4096            # cells (one sequence)
    n_prompt: int = 512            # tokens of the prompt ubatch
    reps: int = 5                  # timings per figure (the best is kept)
    n_threads: int = 4             # CPU threads


@dataclass(slots=True)
class BenchRow:
    """One timing."""

    backend: str    # "cpu", "cuda", ...
    type: str       # cache type
    op: str         # what was timed
    ms: float       # best time, milliseconds
    note: str = ""  # throughput or size


def _fill_cells(kv: KVCache, n: int, start: int = 0) -> None:
    """Bookkeeping only: positions start..n-1 of sequence 0 placed as a decode would (no tensor data)."""
    ba = BatchAllocator(1)
    for p0 in range(start, n, 4096):
        k = min(4096, n - p0)
        ba.init(Batch(token=np.ones(k, np.int32), pos=np.arange(p0, p0 + k, dtype=np.int32),
                      seq_id=np.zeros((k, 1), np.int32)), _N_VOCAB, kv, kv.hparams.n_embd, kv.n_seq_max, False)
        mctx = kv.init_batch(ba, 4096)
        while True:
            mctx.apply()
            if not mctx.next():
                break


def bench(target: Target, type_: str, bc: BenchConfig = BenchConfig()) -> list[BenchRow]:
    """Time a prompt ubatch (store + attention), a decode step over a full cache, the K-shift of every cell and
    state save/load of the whole cache, on ``target``'s placement."""
    hp = HParams.simple(n_layer=bc.n_layer, n_embd_head=bc.n_embd_head, n_head=bc.n_head, n_head_kv=bc.n_head_kv,
                        n_rot=bc.n_embd_head, rope_type=RopeType.NEOX, n_vocab=_N_VOCAB)
    pm = PlacedModel(hp, target.placement)
    tname = G.type_name(G.parse_type(type_))
    rows: list[BenchRow] = []
    rng = np.random.default_rng(0)

    probe = np.empty(16, np.uint8)

    def barrier() -> None:
        # an RPC backend computes graphs asynchronously (its synchronize is a no-op): a read waits for them
        for layer in (kv.layers[0], kv.layers[-1]):
            G.ggml_backend_tensor_get(layer.k, probe.ctypes.data, 0, probe.size)

    def best(fn: Callable[[], None]) -> float:
        times = []
        for _ in range(bc.reps):
            t0 = time.perf_counter()
            fn()
            barrier()
            times.append(time.perf_counter() - t0)
        return 1e3 * min(times)

    with pm.backends(n_threads=bc.n_threads) as be, \
            KVCache(pm, offload=True, type_k=tname, type_v=tname, v_trans=G.blck_size(tname) == 1,
                    kv_size=bc.kv_size, n_seq_max=1) as kv:
        size_mib = kv.total_size() / 2**20

        def step_ms(n_tokens: int, label: str) -> None:
            ba = BatchAllocator(1)
            p0 = kv.seq_pos_max(0) + 1
            ba.init(Batch(token=np.ones(n_tokens, np.int32), pos=np.arange(p0, p0 + n_tokens, dtype=np.int32),
                          seq_id=np.zeros((n_tokens, 1), np.int32)), _N_VOCAB, kv, hp.n_embd, 1, False)
            mctx = kv.init_batch(ba, n_tokens)
            mctx.apply()

            def once() -> None:
                with G.Context.for_tensors(*_Step.room(kv)) as ctx:
                    step = _Step.build(ctx, kv, mctx, rng)
                    be.compute(step.graph, step.fill)
                    be.reset()

            once()  # warm-up: first-use allocations, kernel loading
            rows.append(BenchRow(target.name, tname, label, best(once), f"n_kv {mctx.get_n_kv()}"))

        n_prompt = min(bc.n_prompt, bc.kv_size // 2)
        step_ms(n_prompt, f"prompt ubatch ({n_prompt} tokens): store + attention, {bc.n_layer} layers")
        _fill_cells(kv, bc.kv_size - 1, kv.seq_pos_max(0) + 1)
        step_ms(1, f"decode step (1 token, full cache): store + attention, {bc.n_layer} layers")
        uctx = be.update_context(hparams=hp)

        def shift() -> None:
            kv.seq_add(0, 0, -1, 1)
            kv.init_update(uctx).apply()

        shift()
        rows.append(BenchRow(target.name, tname, f"K-shift of all {bc.kv_size} cells, {bc.n_layer} layers",
                             best(shift), f"K {kv.size_k_bytes() / 2**20:.0f} MiB"))
        blob = kv.state_save()
        ms = best(lambda: kv.state_save())
        rows.append(BenchRow(target.name, tname, "state_save (whole cache)", ms,
                             f"{len(blob) / 2**30 / (ms / 1e3):.2f} GiB/s of {size_mib:.0f} MiB"))
        ms = best(lambda: kv.state_load(blob))
        rows.append(BenchRow(target.name, tname, "state_load (whole cache)", ms,
                             f"{len(blob) / 2**30 / (ms / 1e3):.2f} GiB/s"))
    return rows


def bench_table(rows: Sequence[BenchRow]) -> str:
    lines = ["| backend | type | operation | best ms | note |", "|---|---|---|---|---|"]
    lines += [f"| {r.backend} | {r.type} | {r.op} | {r.ms:.2f} | {r.note} |" for r in rows]
    return "\n".join(lines)


def run_bench(backends: Sequence[str], types: Sequence[str], bc: BenchConfig = BenchConfig(), *,
              rpc_spec: str | None = None, log: Callable[[str], None] | None = None
              ) -> tuple[list[BenchRow], list[tuple[str, str]]]:
    """:func:`bench` on every backend (all layers on it; "cpu" is the baseline); (rows, skipped backends)."""
    say = log or (lambda s: None)
    rows: list[BenchRow] = []
    skipped: list[tuple[str, str]] = []
    with contextlib.ExitStack() as stack:
        for b in dict.fromkeys(x.strip().lower() for x in backends if x.strip()):
            try:
                spec = None
                if b == "rpc":
                    spec = rpc_spec or stack.enter_context(local_rpc_server(threads=bc.n_threads)).spec
                target = make_target(b, bc.n_layer, spec, "all")
            except PlacementError as e:
                skipped.append((b, str(e)))
                say(f"skipping {b}: {e}")
                continue
            for t in types:
                t0 = time.perf_counter()
                rows += bench(target, t, bc)
                say(f"bench {b} {t}: {time.perf_counter() - t0:.1f} s")
    return rows, skipped


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcache_ggml parity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="cpu,rpc,cuda,metal,vulkan",
                    help="backends to compare with the CPU (default: %(default)s); unavailable ones are skipped")
    ap.add_argument("--types", default="f16,q8_0", help="cache types (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="trace seed (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per scheduler (default: %(default)s)")
    ap.add_argument("--rpc", default=None, metavar="rpc://127.0.0.1:PORT",
                    help="use this RPC server instead of starting a loopback one")
    ap.add_argument("--split", choices=("auto", "half", "all"), default="auto",
                    help="layers on the backend: half (the last ones) or all; auto: half for RPC, all for GPUs")
    ap.add_argument("--bench", action="store_true",
                    help="instead of the parity trace, time a model-sized cache on each backend (all layers on it)")
    ap.add_argument("--bench-kv-size", type=int, default=BenchConfig.kv_size, help="cells (default: %(default)s)")
    ap.add_argument("--bench-layers", type=int, default=BenchConfig.n_layer, help="layers (default: %(default)s)")
    ap.add_argument("--bench-reps", type=int, default=BenchConfig.reps, help="timings per figure (default: "
                                                                                 "%(default)s)")
    ap.add_argument("--quiet", action="store_true", help="print only the table")
    args = ap.parse_args(argv)
    if args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    say = None if args.quiet else (lambda s: print(s, flush=True))
    logging.getLogger("kvcache_ggml.cache").setLevel(logging.ERROR)  # the toy model's V padding warning
    t0 = time.perf_counter()
    if args.bench:
        if args.bench_kv_size < 256 or args.bench_layers < 1 or args.bench_reps < 1:
            ap.error("--bench-kv-size must be >= 256, --bench-layers and --bench-reps >= 1")
        bc = BenchConfig(n_layer=args.bench_layers, kv_size=args.bench_kv_size, reps=args.bench_reps,
                         n_threads=args.threads)
        try:
            rows, skipped = run_bench(args.backends.split(","), _check_types(args.types.split(","), ParityConfig()),
                                      bc, rpc_spec=args.rpc, log=say)
        except (ValueError, RuntimeError) as e:
            print(f"parity --bench: error: {e}", file=sys.stderr)
            return 2
        if not args.quiet:
            print(f"\nbenchmark: {bc.n_layer} layers, head {bc.n_embd_head}, {bc.n_head}/{bc.n_head_kv} heads, "
                  f"{bc.kv_size} cells, {bc.n_threads} CPU thread(s), best of {bc.reps}; "
                  f"{time.perf_counter() - t0:.1f} s\n")
        print(bench_table(rows))
        for name, reason in skipped:
            print(f"skipped {name}: {reason}")
        return 0
    cfg = ParityConfig(seed=args.seed, n_threads=args.threads)
    try:
        report = run_parity(args.backends.split(","), args.types.split(","), cfg, rpc_spec=args.rpc,
                            split=args.split, log=say)
    except (ValueError, RuntimeError) as e:
        print(f"parity: error: {e}", file=sys.stderr)
        return 2
    if not args.quiet:
        print(f"\nparity against the CPU: seed {cfg.seed}, {cfg.n_layer} layers, head {cfg.n_embd_head}, "
              f"n_head_kv {list(cfg.n_head_kv)}, caches of {cfg.kv_size_unified} cells (1 stream) and "
              f"{cfg.kv_size_streams} cells x 3 streams; {time.perf_counter() - t0:.1f} s\n")
    print(report.table())
    return 0 if report.passed else 1
