"""Save/restore throughput of the KV-cache state next to a plain copy of the same size.

    .venv/bin/python benchmarks/bench_state.py [--gib 1.0] [--repeat 3] [--json]

A cache of about ``--gib`` GiB (32 layers of 1024-wide f16 K and V, as a 7B-class model with 8 KV heads of 128)
full of one sequence, with V transposed (the default) and not, is

- saved with ``state_save`` (a new ``bytes``), against ``bytes(memoryview(b))`` (a new ``bytes`` copy);
- written with ``state_write`` into an existing buffer (``BufferWriter``) and to /dev/null (``FileWriter``), and
  restored with ``state_load`` (which first empties the cache, data included, as llama.cpp does), all three against
  ``np.copyto`` between two existing buffers (a warm memcpy).

``ratio`` is the operation's MB/s over its baseline's (1.0 = as fast as one copy); each operation alternates with
its baseline.  A new 1 GiB object costs page faults that dominate on some machines (both sides of the first
comparison pay them).  Figures are best of ``--repeat`` (allocating ones: of ``min(repeat, 2)``, to stay under a
minute).
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time

import numpy as np

from kvcache_ggml.batch import Batch, BatchAllocator
from kvcache_ggml.cache import KVCache, MemoryStatus
from kvcache_ggml.hparams import HParams
from kvcache_ggml.cache.state import BufferWriter, FileWriter

N_LAYER, N_EMBD_HEAD, N_HEAD_KV = 32, 128, 8
BYTES_PER_CELL = N_LAYER * 2 * N_EMBD_HEAD * N_HEAD_KV * 2   # K + V, f16


class Model:
    hparams = HParams.simple(n_layer=N_LAYER, n_embd_head=N_EMBD_HEAD, n_head=32, n_head_kv=N_HEAD_KV)

    def dev_layer(self, il):
        return None


def best(fn, repeat):
    times = []
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        r = fn()
        times.append(time.perf_counter() - t0)
        del r
    return min(times)


def full_cache(kv_size: int, v_trans: bool) -> KVCache:
    kv = KVCache(Model(), kv_size=kv_size, v_trans=v_trans)
    for buf in kv.buffers():
        buf.clear(0x3C)  # non-zero data
    ba = BatchAllocator(1)
    ba.init(Batch(token=np.zeros(kv_size, np.int32), pos=np.arange(kv_size), seq_id=[[0]] * kv_size), 64, kv,
            4096, 1, False)
    ctx = kv.init_batch(ba, kv_size)
    assert ctx.get_status() == MemoryStatus.SUCCESS
    ctx.apply()
    return kv


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="cache size in GiB (default: %(default)s)")
    ap.add_argument("--repeat", type=int, default=2, help="runs per figure, best kept (default: %(default)s)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args(argv)
    kv_size = max(256, int(args.gib * (1 << 30)) // BYTES_PER_CELL // 256 * 256)
    rep_alloc = min(args.repeat, 2)

    # each operation alternates with its baseline, so that both see the same machine (shared hosts drift)
    times: dict[str, dict[str, tuple[float, float]]] = {}
    target = None
    nbytes = 0
    for v_trans in (True, False):
        kv = full_cache(kv_size, v_trans)
        t0 = time.perf_counter()
        blob = kv.state_save()
        first = time.perf_counter() - t0
        nbytes = len(blob)
        src = np.frombuffer(blob, np.uint8)
        if target is None:
            target = np.ones(nbytes, np.uint8)

        def to_buffer():
            kv.state_write(BufferWriter(target))

        def to_devnull():
            with FileWriter("/dev/null") as w:
                kv.state_write(w)

        def memcpy():
            np.copyto(target, src)
        r: dict[str, tuple[float, float]] = {}
        t_save = best(kv.state_save, rep_alloc - 1) if rep_alloc > 1 else first
        r["save"] = (min(first, t_save), best(lambda: bytes(memoryview(blob)), rep_alloc))
        for op, fn in (("buffer", to_buffer), ("file", to_devnull), ("load", lambda: kv.state_load(blob))):
            pairs = [(best(fn, 1), best(memcpy, 1)) for _ in range(args.repeat)]
            r[op] = (min(p[0] for p in pairs), min(p[1] for p in pairs))
        to_buffer()  # the restored cache writes the same state
        assert np.array_equal(target, src)
        times["v_trans" if v_trans else "v_rows"] = r
        del kv, blob, src
        gc.collect()

    mb = nbytes / 1e6
    report = {"cache_bytes": nbytes, "kv_size": kv_size, "n_layer": N_LAYER}
    for name, r in times.items():
        report[name] = {op: {"MBps": round(mb / t), "baseline_MBps": round(mb / tb), "ratio": round(tb / t, 2)}
                        for op, (t, tb) in r.items()}
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"state of {nbytes / (1 << 30):.2f} GiB ({kv_size} cells x {N_LAYER} layers, f16 K and V), "
          f"best of {args.repeat}")
    labels = {"save": ("state_save -> new bytes", "bytes copy"), "buffer": ("state_write -> BufferWriter", "memcpy"),
              "file": ("state_write -> /dev/null", "memcpy"), "load": ("state_load <- bytes", "memcpy")}
    for name in times:
        for op in ("save", "buffer", "file", "load"):
            e = report[name][op]
            label, base = labels[op]
            print(f"  {name:8s}  {label:28s} {e['MBps']:6d} MB/s   {base:10s} {e['baseline_MBps']:6d} MB/s   "
                  f"ratio {e['ratio']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
