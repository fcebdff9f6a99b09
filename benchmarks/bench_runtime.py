"""Prompt and decode throughput of the runtime next to llama.cpp's (llama-cpp-python 0.3.17), side by side.

The same tiny random llama GGUF, the same threads, context size, cache types and batches on both sides:

* prompt: one ``--prompt``-token batch in sequence 0 (last token output), best of ``--reps``;
* decode: the prompt copied into ``--n-par`` sequences with seq_cp, then ``--n-gen`` steps of one token per
  sequence (every token an output), best of ``--reps``.

Prints tokens/s for both and the ratio (ours / llama.cpp; 1.0 = as fast), then our host time per decode step split
into batch splitting, cache bookkeeping, memory updates, input setting, graph build and compute.  llama.cpp runs
in the oracle's interpreter (``/tmp/kvoracle/venv``, see tests/README.md); without it only our figures print.

    .venv/bin/python benchmarks/bench_runtime.py [--threads 1] [--n-ctx 1024] [--n-par 1,4] [--wtype q4_K]
                                                 [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvcache_ggml.batch import Batch
from kvcache_ggml.runtime import Context, Model, make_model
from kvcache_ggml.runtime.llama_runner import llama_available, run_llama
from kvcache_ggml.runtime.modelmaker import ModelSpec


def ours(path: Path, a: argparse.Namespace, n_par: int, prompt: list[int]) -> dict:
    """The runner's ``bench`` op, on our runtime."""
    best_p = best_g = float("inf")
    split = None
    with Model(path) as m, Context(m, n_ctx=a.n_ctx, n_batch=a.n_ctx, n_ubatch=512, n_seq_max=max(n_par, 1),
                                   kv_unified=a.unified, flash_attn=a.flash_attn, type_k=a.type_kv,
                                   type_v=a.type_kv, n_threads=a.threads, n_threads_batch=a.threads) as ctx:
        n_vocab = m.n_vocab
        for _ in range(a.reps):
            ctx.memory_clear(True)
            n = len(prompt)
            t0 = time.perf_counter()
            ctx.decode(Batch(token=np.array(prompt, np.int32), pos=np.arange(n, dtype=np.int32)))
            best_p = min(best_p, time.perf_counter() - t0)
            for s in range(1, n_par):
                ctx.memory_seq_cp(0, s, -1, -1)
            ctx.times.reset()
            seqs = np.arange(n_par, dtype=np.int32)
            flags = np.ones(n_par, np.int8)
            t0 = time.perf_counter()
            for step in range(a.n_gen):
                toks = np.array([(7 * step + 3 * s + 5) % n_vocab for s in range(n_par)], np.int32)
                ctx.decode(Batch(token=toks, pos=np.full(n_par, n + step, np.int32), seq_id=seqs, logits=flags))
            dt = time.perf_counter() - t0
            if dt < best_g:
                best_g = dt
                split = ctx.times.as_dict()
    return {"prompt_s": best_p, "gen_s": best_g, "split": split}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n-ctx", type=int, default=1024)
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    ap.add_argument("--n-gen", type=int, default=64, help="decode steps")
    ap.add_argument("--n-par", default="1,4", help="comma-separated sequence counts")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--type-kv", default="f16", help="K and V cache type (llama.cpp's default f16)")
    ap.add_argument("--no-flash-attn", dest="flash_attn", action="store_false")
    ap.add_argument("--unified", action="store_true", help="one cache stream for all sequences")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=128)
    ap.add_argument("--wtype", default="f32", help="weight type of the matrices (q4_0, q4_K, q6_K, ...)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    a = ap.parse_args(argv)
    spec = ModelSpec(layers=a.layers, embd=a.embd, heads=8, heads_kv=4, ff=2 * a.embd, vocab=256, type=a.wtype)
    prompt = np.random.default_rng(0).integers(3, spec.vocab, a.prompt).tolist()
    why = llama_available()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_runtime_") as tmp:
        path = make_model(Path(tmp) / "tiny.gguf", spec)
        print(f"model: {spec.layers} layers, n_embd {spec.embd}, heads {spec.heads}/{spec.heads_kv}, ff {spec.ff}, "
              f"vocab {spec.vocab} ({a.wtype}); n_ctx {a.n_ctx}, K/V {a.type_kv}, flash attention "
              f"{'on' if a.flash_attn else 'off'}, {'unified' if a.unified else 'per-sequence streams'}, "
              f"{a.threads} thread(s); prompt {a.prompt}, {a.n_gen} decode steps, best of {a.reps}")
        for n_par in (int(x) for x in a.n_par.split(",")):
            mine = ours(path, a, n_par, prompt)
            theirs = None
            if why is None:
                spec_l = {"model": str(path), "params": {"n_ctx": a.n_ctx, "n_batch": a.n_ctx, "n_ubatch": 512,
                                                         "n_seq_max": max(n_par, 1), "kv_unified": a.unified,
                                                         "flash_attn": a.flash_attn, "type_k": a.type_kv,
                                                         "type_v": a.type_kv, "n_threads": a.threads},
                          "ops": [{"op": "bench", "prompt": prompt, "n_gen": a.n_gen, "n_par": n_par,
                                   "reps": a.reps}]}
                out = run_llama(spec_l)
                if "abort" in out[-1]:
                    print(f"llama.cpp run failed: {out[-1]}", file=sys.stderr)
                else:
                    theirs = out[0]
            results.append({"n_par": n_par, "ours": mine, "llama": theirs})
    if why:
        print(f"(llama.cpp not run: {why})")

    print(f"\n{'':>24} {'ours tok/s':>12} {'llama.cpp':>12} {'ratio':>7}")
    for r in results:
        n_par, mine, theirs = r["n_par"], r["ours"], r["llama"]
        rows = [("prompt", a.prompt / mine["prompt_s"], theirs and a.prompt / theirs["prompt_s"]),
                (f"decode x{n_par} seq", n_par * a.n_gen / mine["gen_s"],
                 theirs and n_par * a.n_gen / theirs["gen_s"])]
        for name, o, t in rows:
            ratio = f"{o / t:7.2f}" if t else "      -"
            print(f"{name + f' (n_par {n_par})':>24} {o:12.0f} {(t or 0):12.0f} {ratio}")
    print("\nour host time per decode step (us):")
    cols = ("batch", "bookkeeping", "update", "inputs", "build", "compute")
    print(f"{'':>12} " + " ".join(f"{c:>11}" for c in cols) + f" {'total':>9} {'reused':>7}")
    for r in results:
        sp = r["ours"]["split"]
        steps = a.n_gen
        vals = [sp[c] / steps * 1e6 for c in cols]
        print(f"{'n_par ' + str(r['n_par']):>12} " + " ".join(f"{v:11.1f}" for v in vals)
              + f" {sum(vals):9.1f} {sp['n_graph_reused']:>3}/{sp['n_ubatch']}")
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
