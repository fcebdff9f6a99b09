"""Backend parity: the deterministic trace replayed through the cache's own API on one placement, in this
process (:func:`replay`) or in a child process (:func:`replay_isolated`)."""
from __future__ import annotations

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import ggml as G
from ..backends import PlacedModel, PlacementError
from ..batch import Batch, BatchAllocator
from ..cache import KVCache, MemoryStatus
from ._config import _N_VOCAB, Capture, ParityConfig, Target, tolerance


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

class TraceReplay:
    """One replay of the trace on one placement, recording into a Capture: ``new_cache`` makes the trace's caches
    on the placement, each step method runs one part of the trace (tests build scenarios from them); ``close``
    frees its backends."""

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
    r = TraceReplay(cfg, pm, cap.type, cap)
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
