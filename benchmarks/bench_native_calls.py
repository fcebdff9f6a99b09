"""Native calls of a decode step, and what one costs through ctypes (the binding layer) and through cffi.

Part 1 counts, per one-token-per-sequence decode step on a reused graph and per step that builds its graph, the C
calls made through the binding layer's table (by function) and the reads of a ``struct ggml_tensor``
(:class:`native_calls.NativeCalls`).

Part 3 times the op calls of a graph build through the ctypes table and through the package's compiled calls
(``G.FAST``, kvcache_ggml/ggml/_fastcalls.py), which build.py builds with cffi's API mode.

Part 2 times the same kinds of call side by side: ctypes as the binding layer declares them; cffi in ABI mode
(``ffi.dlopen`` of the same libraries); cffi in API mode (an extension compiled here, in a temporary folder, against
the vendored ggml headers and linked to the same libraries -- what ``build.py`` would have to build).  Calls:
``ggml_backend_buffer_is_host`` (a pointer in, a bool out), ``ggml_nelements`` (a tensor pointer in), a read of a
tensor's ``ne``, and ``ggml_backend_sched_graph_compute`` of a one-node graph.  Then the per-step saving cffi could
bring: calls per step times the difference.

cffi is optional here (``pip install cffi``; API mode also needs a C compiler and ``python3 build.py``'s
vendor/ headers); without it only part 1 and the ctypes column print.

    .venv/bin/python benchmarks/bench_native_calls.py [--n 200000]
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import timeit
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from native_calls import NativeCalls  # noqa: E402

from kvcache_ggml import ggml as G  # noqa: E402
from kvcache_ggml.ggml._lib import LIB_DIR  # noqa: E402
from kvcache_ggml.batch import Batch  # noqa: E402
from kvcache_ggml.runtime import Context, Model, make_model  # noqa: E402
from kvcache_ggml.runtime.modelmaker import ModelSpec  # noqa: E402

CDEF = """
struct ggml_tensor { int64_t ne[4]; size_t nb[4]; void * data; ...; };
bool ggml_backend_buffer_is_host(void * buffer);
int64_t ggml_nelements(const struct ggml_tensor * tensor);
int ggml_backend_sched_graph_compute(void * sched, void * graph);
"""
CDEF_ABI = """
bool ggml_backend_buffer_is_host(void * buffer);
int64_t ggml_nelements(const void * tensor);
int ggml_backend_sched_graph_compute(void * sched, void * graph);
"""
MODES = {"fa-streams": (True, False), "fa-unified": (True, True), "nofa-streams": (False, False),
         "nofa-unified": (False, True)}


def count_steps(path: Path, n_par: int, fa: bool, unified: bool) -> tuple[NativeCalls, NativeCalls]:
    """Calls of 8 reused-graph steps, and of one step that builds its graph (n_outputs changes)."""
    with Model(path) as m, Context(m, n_ctx=256 * n_par, n_seq_max=n_par, kv_unified=unified, flash_attn=fa,
                                   n_threads=1, n_threads_batch=1) as ctx:
        ctx.decode(Batch(token=np.arange(3, 19, dtype=np.int32)))
        for s in range(1, n_par):
            ctx.memory_seq_cp(0, s, -1, -1)
        seqs = np.arange(n_par, dtype=np.int32)

        def step(i: int, out: int = 1) -> None:
            ctx.decode(Batch(token=np.full(n_par, 5, np.int32), pos=np.full(n_par, 16 + i, np.int32), seq_id=seqs,
                             logits=np.full(n_par, out, np.int8)))
        step(0)
        with NativeCalls() as reused:
            for i in range(1, 9):
                step(i)
        with NativeCalls() as built:
            step(9, out=0)   # no outputs but the last: another topology
    return reused, built


def part_counts(path: Path) -> tuple[float, float]:
    print("C calls and struct reads per decode step (one token per sequence):")
    print(f"{'':>22} {'reused graph':>24} {'graph built':>24}")
    detail, most = None, (0.0, 0.0)
    for n_par in (1, 8):
        for mode, (fa, unified) in MODES.items():
            reused, built = count_steps(path, n_par, fa, unified)
            print(f"{f'{n_par} seq {mode}':>22} {reused.total() / 8:>14.1f} calls {reused.struct_reads / 8:>3.0f} rd"
                  f" {built.total():>14.0f} calls {built.struct_reads:>3.0f} rd")
            detail = detail or (reused, built)
            most = max(most, (reused.total() / 8, reused.struct_reads / 8))
    reused, built = detail
    print("  reused-graph step, by function: "
          + ", ".join(f"{k} {v / 8:g}" for k, v in reused.calls.most_common()))
    print("  graph-building step, most called: "
          + ", ".join(f"{k} {v}" for k, v in built.calls.most_common(8)))
    return most


def _api_module(tmp: Path):
    """The cffi API-mode extension, compiled in tmp (None, with why, when it cannot be built)."""
    from cffi import FFI
    inc = sorted(ROOT.glob("vendor/ggml/ggml_python-*/vendor/ggml/include"))
    if not inc:
        return None, "no vendored ggml headers (run python3 build.py)"
    ffi = FFI()
    ffi.cdef(CDEF)
    ffi.set_source("_ggml_cffi_bench", '#include "ggml.h"\n#include "ggml-backend.h"\n',
                   include_dirs=[str(inc[-1])], library_dirs=[str(LIB_DIR)], libraries=["ggml-base", "ggml"],
                   extra_link_args=[f"-Wl,-rpath,{LIB_DIR}"])
    try:
        so = ffi.compile(tmpdir=str(tmp), verbose=False)
    except Exception as e:  # noqa: BLE001 - no compiler: report and go on
        return None, f"cannot compile the API-mode module: {e}"
    spec = importlib.util.spec_from_file_location("_ggml_cffi_bench", so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, ""


def _one_node_graph():
    """(context, scheduler, graph, tensor, its buffer) of add(a, a) on the CPU, allocated and computed once."""
    ctx = G.Context.for_tensors(8, 8)
    a = ctx.new_tensor("f32", (64,), "a")
    G.ggml_set_input(a)
    out = G.ggml_add(ctx.ptr, a, a)
    g = G.Graph(ctx, 8)
    g.expand(out)
    cpu = G.Backend.cpu(1)
    sched = G.Sched([cpu], graph_size=8)
    sched.alloc_graph(g)
    G.set_tensor(a, np.ones(64, np.float32))
    sched.compute(g)
    return ctx, cpu, sched, g, a


def part_costs(n: int, per_step: tuple[float, float]) -> None:
    """Time each kind of call through ctypes and cffi; ``per_step``: (C calls, struct reads) of a reused-graph
    step, as part 1 counted them."""
    ctx, cpu, sched, g, t = _one_node_graph()
    buf, sp, gp = G.buffer(t), sched.ptr, g.ptr
    addr, gaddr = G.addr(t), G.addr(gp)   # ints, for cffi
    rows: dict[str, dict[str, float]] = {}

    def timed(col: str, row: str, fn) -> None:
        rows.setdefault(row, {})[col] = min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6

    F = G.FUNCTIONS
    is_host, nel, compute = F["ggml_backend_buffer_is_host"], F["ggml_nelements"], F["ggml_backend_sched_graph_compute"]
    timed("ctypes", "buffer_is_host(buf)", lambda: is_host(buf))
    timed("ctypes", "nelements(tensor)", lambda: nel(t))
    timed("ctypes", "ne of a tensor", lambda: G.ne(t))
    timed("ctypes", "sched_graph_compute (1 node)", lambda: compute(sp, gp))
    why = ""
    try:
        from cffi import FFI
        abi = FFI()
        abi.cdef(CDEF_ABI)
        lib = abi.dlopen(str(LIB_DIR / "libggml-base.so"))
        lib_b = abi.dlopen(str(LIB_DIR / "libggml.so"))
        tp, bp, sc, gr = (abi.cast("void *", x) for x in (addr, buf, sp, gaddr))
        timed("cffi ABI", "buffer_is_host(buf)", lambda: lib.ggml_backend_buffer_is_host(bp))
        timed("cffi ABI", "nelements(tensor)", lambda: lib.ggml_nelements(tp))
        timed("cffi ABI", "sched_graph_compute (1 node)", lambda: lib_b.ggml_backend_sched_graph_compute(sc, gr))
        with tempfile.TemporaryDirectory(prefix="cffi_bench_") as tmp:
            mod, why = _api_module(Path(tmp))
            if mod is not None:
                f, L = mod.ffi, mod.lib
                tq, bq, sq, gq = (f.cast("struct ggml_tensor *", addr), f.cast("void *", buf),
                                  f.cast("void *", sp), f.cast("void *", gaddr))
                timed("cffi API", "buffer_is_host(buf)", lambda: L.ggml_backend_buffer_is_host(bq))
                timed("cffi API", "nelements(tensor)", lambda: L.ggml_nelements(tq))
                timed("cffi API", "ne of a tensor", lambda: tuple(tq.ne))
                timed("cffi API", "sched_graph_compute (1 node)", lambda: L.ggml_backend_sched_graph_compute(sq, gq))
    except ImportError:
        why = "cffi is not installed (pip install cffi)"
    cols = ("ctypes", "cffi ABI", "cffi API")
    print(f"\ncost of one call, us (best of 5 x {n}):")
    print(f"{'':>30} " + " ".join(f"{c:>9}" for c in cols))
    for row, v in rows.items():
        print(f"{row:>30} " + " ".join(f"{v[c]:9.3f}" if c in v else f"{'-':>9}" for c in cols))
    if why:
        print(f"({why})")
    if "cffi API" in rows["buffer_is_host(buf)"]:
        d_call = max(rows[r]["ctypes"] - rows[r]["cffi API"]  # the largest saving of any call: an upper bound
                     for r in ("buffer_is_host(buf)", "nelements(tensor)", "sched_graph_compute (1 node)"))
        d_read = rows["ne of a tensor"]["ctypes"] - rows["ne of a tensor"]["cffi API"]
        calls, reads = per_step
        print(f"per reused-graph step of {calls:g} calls and {reads:g} struct reads: cffi API would save at most "
              f"{calls * d_call + reads * d_read:.2f} us")
    sched.close()
    cpu.close()
    ctx.close()


def part_compiled(n: int) -> None:
    """The op calls of a graph build through the binding layer's ctypes table and through its compiled calls
    (``G.FAST``, built by build.py: kvcache_ggml/ggml/_fastcalls.py), the same arguments (ints) on both."""
    if not G.FAST:
        print(f"\n(no compiled calls: {G.WHY_NO_FAST})")
        return
    n = min(n, 20000)  # each call makes a tensor: the context is reset before each repeat
    with G.Context.for_tensors(2) as src, G.Context.for_tensors(n) as ctx:
        c = ctx.ptr
        x, pos = src.new_tensor("f32", (64, 8, 4)), src.new_tensor("i32", (4,))
        calls = {"add (3 args)": ("ggml_add", (c, x, x)),
                 "reshape_3d (5 args)": ("ggml_reshape_3d", (c, x, 64, 4, 8)),
                 "view_4d (10 args)": ("ggml_view_4d", (c, x, 64, 4, 2, 4, 256, 1024, 2048, 0)),
                 "rope_ext (13 args)": ("ggml_rope_ext", (c, x, pos, 0, 64, 0, 4096, 1e4, 1.0, 0.0, 1.0, 32.0, 1.0))}
        print(f"\ngraph-building calls, us (best of 5 x {n}): ctypes table / compiled (G.FAST)")
        for row, (name, args) in calls.items():
            cols = []
            for fn in (G.FUNCTIONS[name], G.FAST[name]):
                cols.append(min(timeit.repeat(lambda: fn(*args), setup=lambda: G.ggml_reset(c), number=n,
                                              repeat=5)) / n * 1e6)
            print(f"{row:>30} {cols[0]:9.3f} {cols[1]:9.3f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=200000, help="calls per timing")
    a = ap.parse_args(argv)
    G.set_log_level(3)
    with tempfile.TemporaryDirectory(prefix="bench_calls_") as tmp:
        path = make_model(Path(tmp) / "tiny.gguf", ModelSpec(layers=2, embd=64, heads=8, heads_kv=4, ff=128,
                                                             vocab=256))
        per_step = part_counts(path)
    part_costs(a.n, per_step)
    part_compiled(a.n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
