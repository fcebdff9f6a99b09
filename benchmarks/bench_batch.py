"""Host cost of ``BatchAllocator.init`` (and one split) on the batch shapes a runtime feeds it, no cache involved.

The memory module is a plain dict of last positions, so the figures are the allocator's own work: the 1-token
decode step (the hot path: positions given or continued from the memory), a decode step of 8 sequences at once,
a 512-token prompt, and a coupled batch (tokens shared by two sequences).

    .venv/bin/python benchmarks/bench_batch.py [--iters 20000]

Prints one line per case: the best mean microseconds per call over a few runs.  To compare two trees, run it once
with each on PYTHONPATH.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from kvcache_ggml.batch import Batch, BatchAllocator


class Positions:
    """A memory module reduced to what init asks: each sequence's smallest and largest position (-1: empty)."""

    def __init__(self, last: dict[int, int]) -> None:
        self.last = last

    def seq_pos_min(self, seq_id: int) -> int:
        return 0 if self.last.get(seq_id, -1) >= 0 else -1

    def seq_pos_max(self, seq_id: int) -> int:
        return self.last.get(seq_id, -1)


def best_us(fn, iters: int, repeat: int = 5) -> float:
    for _ in range(min(iters, 200)):
        fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t0) / iters)
    return best * 1e6


def cases(iters: int) -> dict[str, float]:
    ba = BatchAllocator(1)
    mem = Positions({s: 99 for s in range(8)})
    b1 = Batch(token=np.array([3], np.int32), pos=np.array([100], np.int32), seq_id=np.zeros(1, np.int32),
               logits=np.ones(1, np.int8))
    b1_auto = Batch(token=np.array([3], np.int32))
    b8 = Batch(token=np.full(8, 3, np.int32), pos=np.full(8, 100, np.int32), seq_id=np.arange(8, dtype=np.int32))
    b512 = Batch(token=np.full(512, 3, np.int32), pos=np.arange(100, 612, dtype=np.int32),
                 seq_id=np.zeros(512, np.int32))
    bcpl = Batch(token=np.full(64, 3, np.int32), pos=np.arange(100, 164, dtype=np.int32), seq_id=[[0, 1]] * 64)
    out = {}
    out["init 1 token (pos, seq_id, logits given)"] = best_us(lambda: ba.init(b1, 64, mem, 64, 8, False), iters)
    out["init 1 token (all auto)"] = best_us(lambda: ba.init(b1_auto, 64, mem, 64, 8, False), iters)
    out["init 1 token + split_equal"] = best_us(
        lambda: (ba.init(b1, 64, mem, 64, 8, False), ba.split_equal(512, False)), iters)
    out["init 8 tokens, 8 sequences"] = best_us(lambda: ba.init(b8, 64, mem, 64, 8, False), iters)
    out["init 8 tokens + split_equal"] = best_us(
        lambda: (ba.init(b8, 64, mem, 64, 8, False), ba.split_equal(512, False)), iters)
    out["init 512-token prompt"] = best_us(lambda: ba.init(b512, 64, mem, 64, 8, False), max(1, iters // 10))
    out["init 64 tokens coupled to 2 sequences"] = best_us(lambda: ba.init(bcpl, 64, mem, 64, 8, False),
                                                          max(1, iters // 10))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20000)
    args = ap.parse_args(argv)
    for name, us in cases(args.iters).items():
        print(f"{name:42s} {us:8.2f} µs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
