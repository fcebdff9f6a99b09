"""The cache's share of a decode step, next to llama.cpp's own cache, measured side by side in one run.

One step: a batch of one token per sequence -> ``BatchAllocator.init`` -> ``init_batch`` -> ``apply`` (every
ubatch), undone with ``seq_rm`` of each sequence's new position.  As in llama.cpp's loop, each step makes a new
allocator and reuses one batch, filled before the loop (llama.cpp's ``llama_batch`` is initialised once).  Levels:
L0 that bookkeeping alone; L1 + the K/V index inputs; L2 + the kq mask (F32).  Cases per cache size (cells per
stream, each stream half full):

* ``1``  -- one sequence (llama.cpp: the oracle's ``time_step``);
* ``8``  -- eight sequences in one unified stream, one token each;
* ``8s`` -- eight sequences, one stream each (``kv_unified=False``).

llama.cpp's side runs in the oracle's interpreter (scripts/build_reference.sh) with ``_oracle_step.cpp``: its n-sequence step
(and a mask-free fill), built on first use against the oracle's llama.cpp.  Each side takes the best of
``--repeats`` timed runs of ``--iters`` steps per round, over ``--rounds`` rounds that alternate ours and
llama.cpp's; the table gives the best per-step time, the spread of all runs ((worst - best) / best) and the ratio
ours / llama.cpp (below 1: faster).  Both sides run on the same CPU (``--no-pin``: any).  ``--general`` times our
general paths instead (every fast path off).

    .venv/bin/python benchmarks/bench_step.py [--sizes 4096,32768,131072] [--cases 1,8,8s] [--iters 300]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

# nothing in a step calls BLAS; numpy's OpenBLAS threads would otherwise spin after import on the CPU both sides
# are pinned to (llama.cpp's interpreter inherits this too)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _oracle import oracle_timings, pin, step_lib  # noqa: E402

from kvcache_ggml import ggml as G  # noqa: E402
from kvcache_ggml.batch import Batch, BatchAllocator  # noqa: E402
from kvcache_ggml.cache import KVCache  # noqa: E402
from kvcache_ggml.hparams import HParams  # noqa: E402

CASES = {"1": (1, True), "8": (8, True), "8s": (8, False)}  # name -> (sequences, unified)
LEVELS = (0, 1, 2)
PHASES = ("BatchAllocator()", "init", "init_batch", "apply", "k/v idxs", "kq mask", "undo (seq_rm)")


class Tiny:  # the oracle's tiny.gguf shape: 2 layers, 4 heads of 16, 2 KV heads
    hparams = HParams.simple(n_layer=2, n_embd_head=16, n_head=4, n_head_kv=2, n_vocab=64)

    def dev_layer(self, il):
        return None


def _runs(fn, iters: int, repeats: int) -> list[float]:
    """Seconds per call of ``repeats`` timed runs of ``iters`` calls (after a warm-up)."""
    for _ in range(min(iters, 20)):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        out.append((time.perf_counter() - t0) / iters)
    return out


class OurCase:
    """Our cache of one case, filled, with its input tensors; :meth:`step` is the timed step."""

    def __init__(self, kv_size: int, n_seq: int, unified: bool, general: bool) -> None:
        self.kv = kv = KVCache(Tiny(), kv_size=kv_size, n_seq_max=n_seq, unified=unified)
        self.general = general
        if general:
            kv.book.fast = kv.inputs.fast = False
        per = kv_size // 2 // n_seq if unified else kv_size // 2
        for s in range(n_seq):
            for p0 in range(0, per, 8192):
                n = min(per - p0, 8192)
                self._decode(np.full(n, 3, np.int32), np.arange(p0, p0 + n, dtype=np.int32), np.full(n, s, np.int32))
        self.per = per
        self.n_seq = n_seq
        self.n_seq_max = kv.n_seq_max
        self.token = np.full(n_seq, 3, np.int32)
        self.pos = np.full(n_seq, per, np.int32)
        self.seq = np.arange(n_seq, dtype=np.int32)
        self.out = np.ones(n_seq, np.int8)
        self.batch = Batch(token=self.token, pos=self.pos, seq_id=self.seq, logits=self.out)  # reused every step
        ctx = self._decode(self.token, self.pos, self.seq)
        n_kv, ns = ctx.get_n_kv(), ctx.get_sinfo().n_stream()
        self._undo()
        self.gctx = G.Context.for_tensors(3)
        self.tm = self.gctx.new_tensor("f32", (n_kv, n_seq // ns, 1, ns), "kq_mask")
        self.tk = self.gctx.new_tensor("i64", (n_seq,), "k_idxs")
        self.tv = self.gctx.new_tensor("i64", (n_seq * Tiny.hparams.n_embd_v_gqa_max(),), "v_idxs")
        self.buf = G.BackendBuffer.for_context(self.gctx, G.cpu_buffer_type())

    def _allocator(self) -> BatchAllocator:
        ba = BatchAllocator(1)
        if self.general:
            ba.fast = False
        return ba

    def _decode(self, token, pos, seq):
        ba = self._allocator()
        ba.init(Batch(token=token, pos=pos, seq_id=seq), 64, self.kv, 64, self.kv.n_seq_max, False)
        ctx = self.kv.init_batch(ba, 8192)
        while True:
            ctx.apply()
            if ctx.i_cur == len(ctx.ubatches) - 1:
                return ctx  # on its last ubatch
            ctx.next()

    def _undo(self) -> None:
        for s in range(self.n_seq):
            self.kv.seq_rm(s, self.per, -1)

    def stepper(self, level: int) -> Callable[[], None]:
        """The timed step at ``level``: a closure over locals, as llama.cpp's loop is a C++ loop over its locals (no
        attribute lookups, level tests or helper frames of the harness inside the step)."""
        kv, batch, tk, tv, tm = self.kv, self.batch, self.tk, self.tv, self.tm
        n_seq_max, per, general, seqs = self.n_seq_max, self.per, self.general, range(self.n_seq)
        init_batch, seq_rm = kv.init_batch, kv.seq_rm

        def step() -> None:
            ba = BatchAllocator(1)  # (llama.cpp's loop: a new allocator each step)
            if general:
                ba.fast = False
            ba.init(batch, 64, kv, 64, n_seq_max, False)
            ctx = init_batch(ba, 512)
            while True:
                ctx.apply()
                if level:
                    ub = ctx.get_ubatch()
                    ctx.set_input_k_idxs(tk, ub)
                    ctx.set_input_v_idxs(tv, ub)
                    if level > 1:
                        ctx.set_input_kq_mask(tm, ub, True)
                if not ctx.next():
                    break
            for s in seqs:
                seq_rm(s, per, -1)

        return step

    def phases(self, iters: int) -> list[float]:
        """Seconds per step of each phase of a level-2 step (PHASES), timed one by one inside the step."""
        clock = time.perf_counter
        acc = [0.0] * len(PHASES)
        for _ in range(iters):
            t = [clock()]
            ba = self._allocator()
            t.append(clock())
            ba.init(self.batch, 64, self.kv, 64, self.kv.n_seq_max, False)
            t.append(clock())
            ctx = self.kv.init_batch(ba, 512)
            t.append(clock())
            ctx.apply()
            t.append(clock())
            ub = ctx.get_ubatch()
            ctx.set_input_k_idxs(self.tk, ub)
            ctx.set_input_v_idxs(self.tv, ub)
            t.append(clock())
            ctx.set_input_kq_mask(self.tm, ub, True)
            t.append(clock())
            self._undo()
            t.append(clock())
            for k in range(len(PHASES)):
                acc[k] += t[k + 1] - t[k]
        return [a / iters for a in acc]

    def close(self) -> None:
        self.buf.close()
        self.gctx.close()
        self.kv.close()


ORACLE_SCRIPT = r"""
import ctypes as C
import numpy as np
lib = C.CDLL(STEP_LIB)
lib.kvo_time_step_multi.restype = C.c_double
lib.kvo_time_step_multi.argtypes = [C.c_void_p, C.c_int, np.ctypeslib.ndpointer(np.int32, flags="C"), C.c_int, C.c_int]
lib.kvo_fill.argtypes = [C.c_void_p, C.c_int, C.c_int, C.c_int, C.c_int]
res = {}
for name, kv_size, n_seq, unified, iters in CASES:
    oc = kvoracle.OracleCache(MODEL, "f16", "f16", True, unified, kv_size, n_seq if not unified else max(n_seq, 2))
    per = kv_size // 2 // n_seq if unified else kv_size // 2
    for s in range(n_seq):
        for p0 in range(0, per, 512):
            assert lib.kvo_fill(oc.h, s, p0, min(512, per - p0), 512) == 0
    pos = np.full(n_seq, per, np.int32)
    runs = {}
    for lvl in LEVELS:
        if n_seq == 1:  # the anchor's own loop
            runs[lvl] = [oc.time_step(0, per, iters, lvl) * 1e-9 for _ in range(REPEATS)]
        else:
            runs[lvl] = [lib.kvo_time_step_multi(oc.h, n_seq, pos, iters, lvl) * 1e-9 for _ in range(REPEATS)]
        assert min(runs[lvl]) > 0, "the oracle's step failed"
    res[f"{name}/{kv_size}"] = runs
    oc.close()
print(json.dumps(res))
"""


def oracle_runs(cases: list[tuple[str, int, int, bool, int]], repeats: int) -> dict | None:
    """llama.cpp's runs per case (name, cells, sequences, unified, steps per run), or None without the oracle."""
    lib = step_lib()
    if lib is None:
        return None
    script = (f"CASES = {cases!r}\nREPEATS = {repeats}\nLEVELS = {LEVELS!r}\n"
              f"STEP_LIB = {str(lib)!r}\n" + ORACLE_SCRIPT)
    res = oracle_timings(script, timeout=3600)
    return {k: {int(lvl): v for lvl, v in d.items()} for k, d in res.items()} if res else None


def print_phases(sizes: list[int], names: list[str], a: argparse.Namespace) -> int:
    """Our per-phase split of a level-2 step, µs (per phase the best of ``repeats`` runs)."""
    print(f"our decode step by phase, µs (best of {a.repeats} runs of --iters steps per phase)"
          + (" -- our general paths" if a.general else ""))
    print("| cells | case | " + " | ".join(PHASES) + " | sum |")
    print("|" + "---|" * (len(PHASES) + 3))
    for kv_size in sizes:
        for name in names:
            n_seq, unified = CASES[name]
            case = OurCase(kv_size, n_seq, unified, a.general)
            try:
                case.phases(20)
                runs = [case.phases(max(20, a.iters // n_seq)) for _ in range(a.repeats)]
            finally:
                case.close()
            best = [min(r[k] for r in runs) * 1e6 for k in range(len(PHASES))]
            print(f"| {kv_size} | {name} | " + " | ".join(f"{b:.1f}" for b in best) + f" | {sum(best):.1f} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4096,32768,131072", help="cells per stream")
    ap.add_argument("--cases", default="1,8,8s", help=f"of {sorted(CASES)}")
    ap.add_argument("--iters", type=int, default=300, help="steps per timed run (divided by 8 for 8 sequences)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per round")
    ap.add_argument("--rounds", type=int, default=2, help="rounds, alternating ours and llama.cpp's")
    ap.add_argument("--general", action="store_true", help="time our general paths (every fast path off)")
    ap.add_argument("--no-oracle", action="store_true", help="skip llama.cpp's side")
    ap.add_argument("--json", help="also write the runs (seconds) to this file")
    ap.add_argument("--phases", action="store_true", help="print our per-phase split of a level-2 step instead")
    ap.add_argument("--no-pin", action="store_true", help="let both sides run on any CPU (default: both on the first)")
    a = ap.parse_args(argv)
    pin(1, a.no_pin)
    sizes = [int(s) for s in a.sizes.split(",")]
    names = a.cases.split(",")
    if a.phases:
        return print_phases(sizes, names, a)
    ours: dict[str, dict[int, list[float]]] = {}
    theirs: dict[str, dict[int, list[float]]] = {}
    for kv_size in sizes:
        for rnd in range(a.rounds):
            for name in names:
                n_seq, unified = CASES[name]
                iters = max(20, a.iters // n_seq)
                case = OurCase(kv_size, n_seq, unified, a.general)
                try:
                    for lvl in LEVELS:
                        runs = _runs(case.stepper(lvl), iters, a.repeats)
                        ours.setdefault(f"{name}/{kv_size}", {}).setdefault(lvl, []).extend(runs)
                finally:
                    case.close()
            if not a.no_oracle:
                got = oracle_runs([(n, kv_size, *CASES[n], max(20, a.iters // CASES[n][0])) for n in names],
                                  a.repeats)
                for k, d in (got or {}).items():
                    for lvl, runs in d.items():
                        theirs.setdefault(k, {}).setdefault(lvl, []).extend(runs)
    if not theirs and not a.no_oracle:
        print("(llama.cpp oracle not built, or its step library did not build: showing our times only)")
    print(f"one decode step of the cache, µs (best of {a.rounds}x{a.repeats} runs; spread = (worst - best) / best)"
          + (" -- our general paths" if a.general else ""))
    print(f"| {'cells':>6} | {'case':>4} | {'level':<11} | {'ours':>7} | {'spread':>6} | {'llama.cpp':>9} | "
          f"{'spread':>6} | {'ratio':>5} |")
    print("|" + "|".join("-" * w for w in (8, 6, 13, 9, 8, 11, 8, 7)) + "|")
    label = {0: "bookkeeping", 1: "+ idx", 2: "+ idx, mask"}
    for kv_size in sizes:
        for name in names:
            k = f"{name}/{kv_size}"
            for lvl in LEVELS:
                mine, ref = ours[k][lvl], theirs.get(k, {}).get(lvl)
                b = min(mine)
                cells = [f"{b * 1e6:7.1f}", f"{(max(mine) - b) / b:6.0%}"]
                if ref:
                    r = min(ref)
                    cells += [f"{r * 1e6:9.1f}", f"{(max(ref) - r) / r:6.0%}", f"{b / r:5.2f}"]
                else:
                    cells += [f"{'-':>9}", f"{'-':>6}", f"{'-':>5}"]
                print(f"| {kv_size:>6} | {name:>4} | {label[lvl]:<11} | " + " | ".join(cells) + " |", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"ours": ours, "llama.cpp": theirs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
