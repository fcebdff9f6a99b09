"""``python -m kvcache_ggml parity``: the command line of backend parity."""
from __future__ import annotations

import argparse
import logging
import sys
import time


from ._bench import BenchConfig, bench_table, run_bench
from ._compare import _check_types, run_parity
from ._config import ParityConfig


_ALL = "cpu,rpc,cuda,metal,vulkan"


def main(argv: list[str]) -> int:
    summary = sys.modules[__package__].__doc__.split("\n\n")[0]  # the package docstring's first paragraph
    ap = argparse.ArgumentParser(prog="python -m kvcache_ggml parity", description=summary)
    ap.add_argument("--backends", default=None,
                    help=f"backends to compare with the CPU; a named backend that cannot run (not built, no device) "
                         f"fails the run (default: {_ALL}, each skipped when unavailable)")
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
            types = _check_types(args.types.split(","), ParityConfig())
            rows, skipped = run_bench((args.backends or _ALL).split(","), types,
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
    named = args.backends is not None
    backends = (args.backends if named else _ALL).split(",")
    cfg = ParityConfig(seed=args.seed, n_threads=args.threads)
    try:
        report = run_parity(backends, args.types.split(","), cfg, rpc_spec=args.rpc,
                            split=args.split, log=say)
    except (ValueError, RuntimeError) as e:
        print(f"parity: error: {e}", file=sys.stderr)
        return 2
    if not args.quiet:
        print(f"\nparity against the CPU: seed {cfg.seed}, {cfg.n_layer} layers, head {cfg.n_embd_head}, "
              f"n_head_kv {list(cfg.n_head_kv)}, caches of {cfg.kv_size_unified} cells (1 stream) and "
              f"{cfg.kv_size_streams} cells x 3 streams; {time.perf_counter() - t0:.1f} s\n")
    print(report.table())
    if named and report.skipped:
        print(f"parity: FAIL: named backend(s) {', '.join(b for b, _ in report.skipped)} could not run",
              file=sys.stderr)
        return 1
    return 0 if report.passed else 1
