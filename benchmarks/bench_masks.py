"""Benchmark of the cache inputs: the kq mask fill, and a one-token decode step with its inputs.

    .venv/bin/python benchmarks/bench_masks.py [--iters N] [--sizes 4096,32768,131072] [--no-oracle]

1. Mask fill (``set_input_kq_mask``, causal, F32) for (n_tokens, n_kv) in {1, 512} x {4096, 32768}, on a cache
   whose n_kv cells all hold the sequence, next to one ``fill(-inf)`` of the same buffer: the memory-bandwidth
   floor of writing the mask.
2. A one-token decode step on a cache half full (one sequence, the tiny model of the oracle), undone with
   ``seq_rm`` each iteration: level 0 = Batch + BatchAllocator.init + init_batch + apply; level 1 = + K/V index
   inputs; level 2 = + kq mask.  Next to llama.cpp's own cache (``OracleCache.time_step``), run in a subprocess
   under the oracle's interpreter, size by size, so that both sides see the same machine load.

Times are the best of 5 runs (per-call averages), in microseconds, on both sides.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from kvcache_ggml import ggml as G
from kvcache_ggml.batch import Batch, BatchAllocator
from kvcache_ggml.cache import KVCache
from kvcache_ggml.hparams import HParams

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "oracle"))
from llama_runner import BUILD_REFERENCE, ORACLE_DIR, ORACLE_PY, ORACLE_SRC  # noqa: E402  (the one place naming it)

FILL_CASES = [(1, 4096), (1, 32768), (512, 4096), (512, 32768)]


class Tiny:
    """The oracle's tiny.gguf: 2 layers, 4 heads of 16, 2 KV heads (n_embd_v_gqa = 32)."""

    hparams = HParams.simple(n_layer=2, n_embd_head=16, n_head=4, n_head_kv=2, n_vocab=64)

    def dev_layer(self, il):
        return None


class HostTensors:
    """Tensors in one CPU buffer, freed together."""

    def __init__(self, specs):
        self.ctx = G.Context.for_tensors(len(specs))
        self.t = [self.ctx.new_tensor(type_, ne, name) for type_, ne, name in specs]
        self.buf = G.BackendBuffer.for_context(self.ctx, G.cpu_buffer_type())

    def close(self):
        self.buf.close()
        self.ctx.close()


REPEATS = 5  # timed runs per measurement; the best one counts (the machine is shared)


def best_of(fn, iters: int, repeats: int = REPEATS) -> float:
    """Best per-call time of ``repeats`` runs of ``iters`` calls, in microseconds."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t0) / iters)
    return best * 1e6


def decode(kv: KVCache, pos: np.ndarray, n_ubatch: int):
    """Place tokens of sequence 0 at ``pos``; returns the context on its last ubatch."""
    ba = BatchAllocator(1)
    n = pos.shape[0]
    ba.init(Batch(token=np.full(n, 3, np.int32), pos=pos.astype(np.int32), seq_id=np.zeros((n, 1), np.int32)),
            64, kv, Tiny.hparams.n_embd, kv.n_seq_max, False)
    ctx = kv.init_batch(ba, n_ubatch)
    while True:
        ctx.apply()
        if ctx.i_cur == len(ctx.ubatches) - 1:
            return ctx
        ctx.next()


# ---------------------------------------------------------------------------------------------- 1. mask fill

def bench_fill(n_tokens: int, n_kv: int, iters: int) -> tuple[float, float]:
    kv = KVCache(Tiny(), kv_size=n_kv, n_seq_max=1)
    try:
        decode(kv, np.arange(n_kv - n_tokens), 4096)
        ctx = decode(kv, np.arange(n_kv - n_tokens, n_kv), n_tokens)
        assert ctx.get_n_kv() == n_kv
        ub = ctx.get_ubatch()
        ts = HostTensors([("f32", (n_kv, n_tokens, 1, 1), "kq_mask")])
        try:
            t = ts.t[0]
            view = G.to_numpy(t)
            t_mask = best_of(lambda: kv.set_input_kq_mask(t, ub, True), iters)
            t_full = best_of(lambda: view.fill(-np.inf), iters)
        finally:
            ts.close()
    finally:
        kv.close()
    return t_mask, t_full


# ---------------------------------------------------------------------------------------------- 2. decode step

def bench_step(kv_size: int, iters: int) -> dict[int, float]:
    """Our one-token decode step on a half-full cache, per level, in microseconds."""
    kv = KVCache(Tiny(), kv_size=kv_size, n_seq_max=1)
    half = kv_size // 2
    try:
        for p0 in range(0, half, 8192):
            decode(kv, np.arange(p0, min(half, p0 + 8192)), 4096)
        token = np.array([3], np.int32)
        pos = np.array([half], np.int32)
        seq = np.zeros((1, 1), np.int32)
        n_embd = Tiny.hparams.n_embd

        n_kv = decode(kv, pos, 512).get_n_kv()
        kv.seq_rm(0, half, -1)
        ts = HostTensors([("f32", (n_kv, 1, 1, 1), "kq_mask"), ("i64", (1,), "k_idxs"),
                          ("i64", (Tiny.hparams.n_embd_v_gqa_max(),), "v_idxs")])
        tm, tk, tv = ts.t

        def step(level: int) -> None:
            ba = BatchAllocator(1)
            ba.init(Batch(token=token, pos=pos, seq_id=seq), 64, kv, n_embd, 1, False)
            ctx = kv.init_batch(ba, 512)
            ctx.apply()
            if level >= 1:
                ub = ctx.get_ubatch()
                ctx.set_input_k_idxs(tk, ub)
                ctx.set_input_v_idxs(tv, ub)
                if level >= 2:
                    ctx.set_input_kq_mask(tm, ub, True)
            kv.seq_rm(0, half, -1)

        try:
            return {level: best_of(lambda: step(level), iters) for level in (0, 1, 2)}
        finally:
            ts.close()
    finally:
        kv.close()


_ORACLE_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import kvoracle
kv_size, iters, model, repeats = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
oc = kvoracle.OracleCache(model, kv_size=kv_size, n_seq_max=1)
half = kv_size // 2
for p0 in range(0, half, 512):  # the oracle keeps the mask of every ubatch of a decode: keep decodes small
    n = min(half, p0 + 512) - p0
    assert not isinstance(oc.decode(list(range(p0, p0 + n)), [[0]] * n, 512), int)
print(json.dumps({lvl: min(oc.time_step(0, half, iters, lvl) for _ in range(repeats)) / 1000.0
                  for lvl in (0, 1, 2)}))
oc.close()
"""


def oracle_missing() -> str | None:
    for p in (ORACLE_PY, ORACLE_DIR / "libkvoracle.so", ORACLE_DIR / "tiny.gguf", ORACLE_SRC / "kvoracle.py"):
        if not p.exists():
            return f"{p} missing (build it with bash {BUILD_REFERENCE})"
    return None


def oracle_step(kv_size: int, iters: int) -> dict[int, float]:
    """llama.cpp's one-token decode step (time_step), per level, in microseconds."""
    env = dict(os.environ, ORACLE_DIR=str(ORACLE_DIR))
    cmd = [str(ORACLE_PY), "-c", _ORACLE_SCRIPT, str(ORACLE_SRC), str(kv_size), str(iters),
           str(ORACLE_DIR / "tiny.gguf"), str(REPEATS)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    if p.returncode != 0:
        raise RuntimeError(f"oracle timing failed (exit {p.returncode}): {p.stderr[-2000:]}")
    return {int(k): v for k, v in json.loads(p.stdout.strip().splitlines()[-1]).items()}


# ---------------------------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=300, help="calls per timed run (default 300)")
    ap.add_argument("--sizes", default="4096,32768,131072", help="kv_size of the decode-step runs")
    ap.add_argument("--no-oracle", action="store_true", help="skip llama.cpp's timings")
    args = ap.parse_args(argv)

    print(f"kq mask fill (causal, F32), best of {REPEATS}, µs per call")
    print(f"| {'n_tokens':>8} | {'n_kv':>6} | {'set_input_kq_mask':>17} | {'fill(-inf)':>10} | {'ratio':>6} |")
    print(f"|{'-' * 10}|{'-' * 8}|{'-' * 19}|{'-' * 12}|{'-' * 8}|")
    for n_tokens, n_kv in FILL_CASES:
        iters = max(5, min(args.iters, (1 << 26) // (n_tokens * n_kv)))
        t_mask, t_full = bench_fill(n_tokens, n_kv, iters)
        print(f"| {n_tokens:>8} | {n_kv:>6} | {t_mask:>17.1f} | {t_full:>10.1f} | {t_mask / t_full:>6.2f} |",
              flush=True)

    why = None if not args.no_oracle else "--no-oracle"
    why = why or oracle_missing()
    print()
    print(f"one-token decode step, cache half full, best of {REPEATS}, µs per step "
          "(L0 bookkeeping, L1 + K/V idxs, L2 + kq mask)")
    print(f"| {'kv_size':>7} | {'ours L0':>8} | {'ours L1':>8} | {'ours L2':>8} | {'llama L0':>8} | {'llama L1':>8} | "
          f"{'llama L2':>8} | {'L2 ratio':>8} |")
    print(f"|{'-' * 9}|" + f"{'-' * 10}|" * 7)
    for kv_size in (int(s) for s in args.sizes.split(",")):
        ours = bench_step(kv_size, args.iters)
        theirs = None if why else oracle_step(kv_size, args.iters)
        cells = [f"{ours[lv]:>8.1f}" for lv in (0, 1, 2)]
        cells += [f"{theirs[lv]:>8.1f}" for lv in (0, 1, 2)] if theirs else [f"{'-':>8}"] * 3
        ratio = f"{ours[2] / theirs[2]:>8.2f}" if theirs else f"{'-':>8}"
        print(f"| {kv_size:>7} | " + " | ".join(cells) + f" | {ratio} |", flush=True)
    if why:
        print(f"(llama.cpp not timed: {why})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
