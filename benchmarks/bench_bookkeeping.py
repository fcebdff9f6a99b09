"""Bookkeeping cost of kvcache_ggml next to llama.cpp's own cache, measured side by side in one run.

Per kv_size (4096, 32768, 131072) and sequence count (1, 8), cache half full:
* 1-token decode step: Batch -> BatchAllocator.init -> init_batch -> apply, undone with seq_rm (llama.cpp:
  ``OracleCache.time_step(level=0)``, the same loop in C++);
* 512-token prompt: the same for a 512-token batch, undone with seq_rm (llama.cpp's figure comes from the
  oracle shim's decode, which also builds and copies out each ubatch's kq mask: an upper bound, marked *);
* seq_rm / seq_cp / seq_add over a whole sequence (each undone: cp+rm, add+add back, rm after cp).

Prints one table with our time, llama.cpp's and the ratio (ours / theirs; below 1 is faster).

    .venv/bin/python benchmarks/bench_bookkeeping.py [--sizes 4096,32768] [--iters 300]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _oracle import oracle_timings  # noqa: E402

from kvcache_ggml.batch import Batch, BatchAllocator  # noqa: E402
from kvcache_ggml.cache import KVCache  # noqa: E402
from kvcache_ggml.hparams import HParams  # noqa: E402


class Tiny:  # the oracle's tiny.gguf shape: 2 layers, 4 heads of 16, 2 KV heads
    hparams = HParams.simple(n_layer=2, n_embd_head=16, n_head=4, n_head_kv=2, n_vocab=64)

    def dev_layer(self, il):
        return None


def best_of(fn, iters: int, repeat: int = 3) -> float:
    """Best mean time per call in seconds over ``repeat`` runs of ``iters`` calls."""
    for _ in range(min(iters, 20)):
        fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t0) / iters)
    return best


def filled_cache(kv_size: int, n_seq: int) -> tuple[KVCache, BatchAllocator, list[int]]:
    """A unified cache, half full, the half shared evenly by n_seq sequences; returns next position per seq."""
    kv = KVCache(Tiny(), kv_size=kv_size, n_seq_max=max(n_seq, 2), type_k="f16", type_v="f16")
    ba = BatchAllocator(1)
    per_seq = kv_size // 2 // n_seq
    for s in range(n_seq):
        for p0 in range(0, per_seq, 512):
            n = min(512, per_seq - p0)
            ba.init(Batch(token=np.full(n, 3), pos=np.arange(p0, p0 + n), seq_id=np.full(n, s)), 64, kv, 64,
                    kv.n_seq_max, False)
            ctx = kv.init_batch(ba, 512)
            while True:
                ctx.apply()
                if not ctx.next():
                    break
    return kv, ba, [per_seq] * n_seq


def ours(kv_size: int, n_seq: int, iters: int) -> dict[str, float]:
    kv, ba, nxt = filled_cache(kv_size, n_seq)
    p = nxt[0]
    tok1, pos1, seq1, out1 = np.array([3], np.int32), np.array([p], np.int32), np.zeros(1, np.int32), np.ones(1, np.int8)

    def step():
        ba.init(Batch(token=tok1, pos=pos1, seq_id=seq1, logits=out1), 64, kv, 64, kv.n_seq_max, False)
        kv.init_batch(ba, 512).apply()
        kv.seq_rm(0, p, -1)

    tok512, pos512 = np.full(512, 3, np.int32), np.arange(p, p + 512, dtype=np.int32)
    seq512 = np.zeros(512, np.int32)

    def prompt():
        ba.init(Batch(token=tok512, pos=pos512, seq_id=seq512), 64, kv, 64, kv.n_seq_max, False)
        kv.init_batch(ba, 512).apply()
        kv.seq_rm(0, p, -1)

    def rm_cp():
        kv.seq_cp(0, n_seq, -1, -1)
        kv.seq_rm(n_seq, -1, -1)

    def add():
        kv.seq_add(0, -1, -1, 1)
        kv.seq_add(0, -1, -1, -1)

    res = {"step": best_of(step, iters), "prompt512": best_of(prompt, max(iters // 10, 5))}
    res["seq_cp+seq_rm"] = best_of(rm_cp, max(iters // 10, 5))
    res["seq_add x2"] = best_of(add, max(iters // 10, 5))
    kv.close()
    return res


ORACLE_SCRIPT = """
import numpy as np
res = {}
for kv_size, n_seq in CASES:
    oc = kvoracle.OracleCache(MODEL, "f16", "f16", True, True, kv_size, max(n_seq, 2))
    per = kv_size // 2 // n_seq
    for s in range(n_seq):
        for p0 in range(0, per, 512):
            n = min(512, per - p0)
            oc.decode(list(range(p0, p0 + n)), [[s]] * n, 512)
    step = min(oc.time_step(0, per, ITERS, 0) for _ in range(3)) * 1e-9
    def best(fn, iters):
        b = 1e9
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            b = min(b, (time.perf_counter() - t0) / iters)
        return b
    def prompt():
        oc.decode(list(range(per, per + 512)), [[0]] * 512, 512)
        oc.seq_rm(0, per, -1)
    def rm_cp():
        oc.seq_cp(0, n_seq, -1, -1)
        oc.seq_rm(n_seq, -1, -1)
    def add():
        oc.seq_add(0, -1, -1, 1)
        oc.seq_add(0, -1, -1, -1)
    it = max(ITERS // 10, 5)
    res[f"{kv_size}/{n_seq}"] = {"step": step, "prompt512": best(prompt, it), "seq_cp+seq_rm": best(rm_cp, it),
                                 "seq_add x2": best(add, it)}
    oc.close()
print(json.dumps(res))
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="4096,32768,131072")
    ap.add_argument("--seqs", default="1,8")
    ap.add_argument("--iters", type=int, default=300)
    a = ap.parse_args(argv)
    cases = [(int(s), int(n)) for s in a.sizes.split(",") for n in a.seqs.split(",")]
    theirs = oracle_timings(f"CASES = {cases!r}\nITERS = {a.iters}\n" + ORACLE_SCRIPT) or {}
    if not theirs:
        print("(llama.cpp oracle not built: bash scripts/build_reference.sh — showing our times only)")
    print(f"{'kv_size':>8} {'seqs':>4} {'operation':<15} {'ours µs':>10} {'llama.cpp µs':>13} {'ratio':>7}")
    for kv_size, n_seq in cases:
        mine = ours(kv_size, n_seq, a.iters)
        ref = theirs.get(f"{kv_size}/{n_seq}", {})
        for op, t in mine.items():
            r = ref.get(op)
            rs = f"{r * 1e6:13.1f} {t / r:7.2f}" if r else f"{'-':>13} {'-':>7}"
            mark = "*" if r and op == "prompt512" else ""
            print(f"{kv_size:>8} {n_seq:>4} {op:<15} {t * 1e6:10.1f} {rs}{mark}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
