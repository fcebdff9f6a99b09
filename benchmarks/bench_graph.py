"""Benchmarks of KVCache's graph half on the CPU backend; prints one table.

Parts (each a function returning rows, so parts can be added):
- graph build: get_k + get_v + cpy_k + cpy_v per layer (the ops a model graph asks the cache for);
- K-shift: ``update(do_shift=True)`` per layer (build, allocate and compute the rope graph), next to one
  read+write pass over that layer's K bytes (``np.copyto``), as a ratio.

Run: ``.venv/bin/python benchmarks/bench_graph.py``.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcache_ggml import ggml as G  # noqa: E402
from kvcache_ggml.cache import UpdateContext  # noqa: E402
from kvcache_ggml.cache import KVCache, SlotInfo, StreamCopyInfo  # noqa: E402
from kvcache_ggml.cparams import CParams, ContextParams  # noqa: E402
from kvcache_ggml.hparams import HParams, RopeType  # noqa: E402


@dataclass(slots=True)
class Row:
    """One line of the table."""

    part: str          # which benchmark
    case: str          # its configuration
    time_us: float     # measured time per layer, microseconds
    ref_us: float      # reference time per layer (0: none)
    note: str = ""     # what the reference is


class Model:
    def __init__(self, n_layer: int, n_embd_head: int, n_head_kv: int, rope_type: RopeType = RopeType.NEOX):
        self.hparams = HParams.simple(n_layer=n_layer, n_embd_head=n_embd_head, n_head=4 * n_head_kv,
                                      n_head_kv=n_head_kv, rope_type=rope_type)

    def dev_layer(self, il: int):
        return None


def best_of(fn: Callable[[], float], reps: int) -> float:
    """The smallest of reps timings (fn returns seconds)."""
    return min(fn() for _ in range(reps))


def _n_threads() -> int:
    return max(1, os.cpu_count() or 1)


# ---------------------------------------------------------------------------------------------- graph build

def bench_graph_build(n_layer: int = 32, n_tokens: int = 512, reps: int = 20) -> list[Row]:
    rows = []
    for v_trans in (False, True):
        kv = KVCache(Model(n_layer, 128, 8), kv_size=4096, v_trans=v_trans, type_k="f16", type_v="f16")
        hp = kv.hparams
        sinfo = SlotInfo(s0=0, s1=0, strm=[0], idxs=[np.arange(n_tokens, dtype=np.int64)])
        ub = SimpleNamespace(n_tokens=n_tokens)

        def once() -> float:
            with G.Context.for_tensors(16 + 16 * n_layer) as ctx:
                k_idxs, v_idxs = kv.build_input_k_idxs(ctx, ub), kv.build_input_v_idxs(ctx, ub)
                curs = [(G.new_tensor(ctx, "f32", (hp.n_embd_head_k, hp.n_head_kv(il), n_tokens)),
                         G.new_tensor(ctx, "f32", (hp.n_embd_head_v, hp.n_head_kv(il), n_tokens)))
                        for il in range(n_layer)]
                t0 = time.perf_counter()
                for il, (k_cur, v_cur) in enumerate(curs):
                    kv.get_k(ctx, il, 4096, sinfo)
                    kv.get_v(ctx, il, 4096, sinfo)
                    kv.cpy_k(ctx, k_cur, k_idxs, il, sinfo)
                    kv.cpy_v(ctx, v_cur, v_idxs, il, sinfo)
                return time.perf_counter() - t0

        t = best_of(once, reps) / n_layer
        rows.append(Row("graph build", f"get_k+get_v+cpy_k+cpy_v, v_trans={v_trans}", t * 1e6, 0.0))
        kv.close()
    return rows


# ---------------------------------------------------------------------------------------------- K-shift

def bench_kshift(n_layer: int = 4, kv_size: int = 4096, n_embd_head: int = 128, n_head_kv: int = 8,
                 reps: int = 5) -> list[Row]:
    rows = []
    rng = np.random.default_rng(0)
    for type_k in ("f32", "f16", "q8_0"):
        model = Model(n_layer, n_embd_head, n_head_kv)
        kv = KVCache(model, kv_size=kv_size, type_k=type_k, type_v="f16")
        cp = CParams.from_hparams(model.hparams, ContextParams(n_threads=_n_threads()))
        n = kv_size // 2
        kv.v_cells[0].place(np.arange(n), np.arange(n), np.zeros((n, 1), np.int32))
        for layer in kv.layers:
            raw = G.to_numpy(layer.k).view(np.uint8)
            if G.is_quantized(G.ttype(layer.k)):  # valid q8_0 blocks: scale 1/64, int8 values
                blocks = raw.reshape(-1, 34)
                blocks[:, 2:] = rng.integers(-127, 128, blocks[:, 2:].shape).astype(np.int8).view(np.uint8)
                blocks[:, :2] = np.float16(1 / 64).reshape(1).view(np.uint8)
            else:
                vals = G.to_numpy(layer.k)
                vals[...] = rng.standard_normal(vals.shape).astype(vals.dtype)
        kv.seq_add(0, 0, n, 3)
        with UpdateContext.for_cache(kv, cp) as lctx:
            def once() -> float:
                t0 = time.perf_counter()
                kv.update(lctx, True, StreamCopyInfo())
                return time.perf_counter() - t0
            t_shift = best_of(once, reps) / n_layer

        src = G.to_numpy(kv.layers[0].k, copy=True).view(np.uint8)
        dst = np.empty_like(src)

        def copy_once() -> float:
            t0 = time.perf_counter()
            np.copyto(dst, src)
            return time.perf_counter() - t0
        t_copy = best_of(copy_once, reps * 4)
        mib = src.nbytes / 2**20
        rows.append(Row("K-shift", f"{type_k}, {kv_size} cells x {n_head_kv}x{n_embd_head} ({mib:.1f} MiB/layer), "
                        f"{cp.n_threads} threads", t_shift * 1e6, t_copy * 1e6, "np.copyto of the layer's K"))
        kv.close()
    return rows


# ---------------------------------------------------------------------------------------------- table

def print_table(rows: list[Row]) -> None:
    head = f"{'part':<12} {'case':<62} {'us/layer':>10} {'ref us':>9} {'ratio':>7}  reference"
    print(head)
    print("-" * len(head))
    for r in rows:
        ref = f"{r.ref_us:9.1f}" if r.ref_us else f"{'-':>9}"
        ratio = f"{r.time_us / r.ref_us:7.2f}" if r.ref_us else f"{'-':>7}"
        print(f"{r.part:<12} {r.case:<62} {r.time_us:10.1f} {ref} {ratio}  {r.note}")


PARTS: list[Callable[[], list[Row]]] = [bench_graph_build, bench_kshift]


def main() -> None:
    print(G.summary_lines()[0])
    rows: list[Row] = []
    for part in PARTS:
        rows += part()
    print_table(rows)


if __name__ == "__main__":
    main()
