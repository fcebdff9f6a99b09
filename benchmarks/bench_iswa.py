"""Decode-step bookkeeping of the iSWA cache pair next to llama.cpp's llama_kv_cache_iswa, side by side in one run.

One sequence of a Gemma 2-shaped model (4 layers, every other one sliding), base cache of 4096 cells, SWA cache of
256 (window 8 or 64, ubatch 64): one-token decode steps (BatchAllocator.init -> init_batch -> apply, kept) while the
SWA cache still has empty cells, then once it has wrapped (every step overwrites a cell the window left behind:
prepare places and rolls back, apply purges the old position).  llama.cpp's figure is the same loop in C++
(tests/oracle/kv_oracle_iswa.cpp, ``kvi_time_steps``), built against the oracle when it is there.

    .venv/bin/python benchmarks/bench_iswa.py [--steps 400]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvcache_ggml.batch import Batch, BatchAllocator
from kvcache_ggml.cache.iswa import KVCacheISWA
from kvcache_ggml.runtime.gemma import GemmaShape
from kvcache_ggml.runtime.gemma_maker import GemmaSpec, make_gemma_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "oracle"))
from llama_runner import ORACLE_DIR, ORACLE_PY  # noqa: E402  (the one place naming the reference)


def ours(model: Path, pos0: int, n: int) -> float:
    """Seconds per step of n steps from pos0 (after pos0 warm-up steps from 0)."""
    mem = KVCacheISWA(GemmaShape(model), kv_size=4096, n_ubatch=64, v_trans=False)
    hp = mem.hparams

    def step(p: int) -> None:
        ba = BatchAllocator(1)
        ba.init(Batch(token=np.array([3], np.int32), pos=np.array([p], np.int32), seq_id=np.array([0], np.int32)),
                64, mem, hp.n_embd, 1, False)
        ctx = mem.init_batch(ba, 512)
        ctx.apply()

    for p in range(pos0):
        step(p)
    t0 = time.perf_counter()
    for p in range(pos0, pos0 + n):
        step(p)
    dt = (time.perf_counter() - t0) / n
    mem.close()
    return dt


def theirs(model: Path, pos0: int, n: int) -> float | None:
    """llama.cpp's seconds per step, or None without the oracle."""
    if not ORACLE_PY.exists():
        return None
    lib = ORACLE_DIR / "libkvoracle_iswa.so"
    if not lib.exists():
        return None
    ops = [["time", 0, 0, pos0]] if pos0 else []
    ops.append(["time", 0, pos0, n])
    spec = {"lib": str(lib), "model": str(model), "dump": False, "ops": ops,
            "cache": {"kv_size": 4096, "n_seq_max": 1, "unified": True, "n_ubatch": 64, "v_trans": False}}
    p = subprocess.run([str(ORACLE_PY), str(ROOT / "tests" / "oracle" / "replay_iswa.py")], input=json.dumps(spec),
                       capture_output=True, text=True, check=True)
    return json.loads(p.stdout.splitlines()[-1])["r"] * 1e-9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=400, help="timed steps per row (default %(default)s)")
    a = ap.parse_args()
    print(f"{'one-token decode step':44s} {'ours µs':>9s} {'llama.cpp µs':>13s} {'ratio':>7s}")
    with tempfile.TemporaryDirectory() as tmp:
        for n_swa in (8, 64):
            model = make_gemma_model(Path(tmp) / f"g{n_swa}.gguf", GemmaSpec(arch="gemma2", n_swa=n_swa))
            for label, pos0 in (("SWA cache filling", 0), ("SWA cache wrapped", 600)):
                n = min(a.steps, 200) if pos0 == 0 else a.steps
                us = ours(model, pos0, n) * 1e6
                t = theirs(model, pos0, n)
                row = f"{f'window {n_swa}, {label}':44s} {us:9.1f}"
                print(row + (f" {t * 1e6:13.1f} {us / (t * 1e6):7.2f}" if t else f" {'-':>13s} {'-':>7s}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
