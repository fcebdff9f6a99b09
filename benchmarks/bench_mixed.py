"""A serving step that mixes generating requests with a prompt chunk: one graph, or two, ours and llama.cpp's.

    .venv/bin/python benchmarks/bench_mixed.py [--models serve,real] [--n-gen 8] [--context 400]
                                               [--sizes 16 32 64 128 256] [--reps 9] [--threads 2]

The step of a continuous-batching server while a new request reads its prompt: ``--n-gen`` sequences of
``--context`` tokens each generate one token, and a new sequence reads a chunk of N tokens (last token output).
llama-server and the engine decode the two together in one batch; two graphs (the generating tokens, then the
prompt chunk) are measured beside it, since ggml's CPU flash attention tiles a graph of 64 or more tokens in 64-row
tiles (docs/serving.md, "One graph or two": faster here, not in the server, so the engine keeps one graph).  Unified
cache, flash attention, F16 cache, ``--threads`` threads on both sides, the same GGUF.

Columns (median ms of ``--reps`` steps, the sides alternating step by step so that a busy machine slows them
alike, each after ``--quiet-ms`` of sleep): llama.cpp with one batch (``llama_decode`` alone) and with two; ours with one graph and two
(``Context.decode`` calls, batch building and logits included); the ratio of ours with two graphs to llama.cpp with
one.  After each step its tokens are removed again (``seq_rm``), so every step sees the same cache.

Models, made by the model maker: ``serve`` (bench_serve.py's: 4 layers, n_embd 256, 8/4 heads, Q8_0, GPT-2
vocabulary) and ``real`` (bench_runtime.py's: 12 layers, n_embd 768, 12/4 heads, Q4_0, about 110M parameters).
Without the reference (``scripts/build_reference.sh``) only our columns are printed.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "oracle"))  # llama_runner

from kvcache_ggml.batch import Batch  # noqa: E402
from kvcache_ggml.runtime import Context, load_model, make_model  # noqa: E402
from llama_runner import LlamaSession, llama_available  # noqa: E402

NEW_SEQ = 15  # the sequence reading the prompt chunk


def model_path(name: str, tmp: Path) -> Path:
    if name == "serve":
        from bench_serve import make_bench_model
        return make_bench_model(tmp / "serve.gguf")
    from bench_runtime import MODELS
    path = tmp / f"{name}.gguf"
    make_model(path, MODELS[name])
    return path


def step_batches(n_gen: int, context: int, n: int, vocab: int, rng: np.random.Generator) -> tuple[dict, dict]:
    """(the generating requests' batch, the prompt chunk's batch) as token, pos, seq and logits lists."""
    dec = {"tokens": rng.integers(3, vocab, n_gen).tolist(), "pos": [context] * n_gen, "seq": list(range(n_gen)),
           "logits": [1] * n_gen}
    new = {"tokens": rng.integers(3, vocab, n).tolist(), "pos": list(range(n)), "seq": [NEW_SEQ] * n,
           "logits": [0] * (n - 1) + [1]}
    return dec, new


def joined(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in a}


def as_batch(b: dict) -> Batch:
    return Batch(token=np.array(b["tokens"], np.int32), pos=np.array(b["pos"], np.int32),
                 seq_id=np.array(b["seq"], np.int32), logits=np.array(b["logits"], np.int8))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="serve,real")
    ap.add_argument("--n-gen", type=int, default=8)
    ap.add_argument("--context", type=int, default=400)
    ap.add_argument("--sizes", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quiet-ms", type=float, default=25.0,
                    help="sleep before each timed step (the other side's OpenMP workers spin for ~10 ms after it)")
    a = ap.parse_args()
    if not 1 <= a.n_gen < NEW_SEQ:
        ap.error(f"--n-gen must be in [1, {NEW_SEQ})")
    why = llama_available()
    if why:
        print(f"(llama.cpp not available: {why}; our columns only)")
    params = dict(n_ctx=8192, n_batch=2048, n_ubatch=512, n_seq_max=NEW_SEQ + 1, kv_unified=True, flash_attn=True,
                  type_k="f16", type_v="f16", n_threads=a.threads, n_threads_batch=a.threads)
    llama_params = dict(n_ctx=8192, n_batch=2048, n_ubatch=512, n_seq_max=NEW_SEQ + 1, kv_unified=True,
                        flash_attn=True, n_threads=a.threads, n_threads_batch=a.threads)
    print(f"{a.n_gen} sequences of {a.context} tokens generate one token each while sequence {NEW_SEQ} reads N "
          f"prompt tokens; unified F16 cache, flash attention, {a.threads} threads; median ms of {a.reps} steps")
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.models.split(","):
            path = model_path(name, Path(tmp))
            rng = np.random.default_rng(0)
            with load_model(path) as model, Context(model, **params) as ctx:
                vocab = int(model.n_vocab)
                session = None if why else LlamaSession(str(path), llama_params)
                try:
                    for s in range(a.n_gen):  # every generating sequence's context, on both sides
                        toks = rng.integers(3, vocab, a.context).tolist()
                        b = {"tokens": toks, "pos": list(range(a.context)), "seq": [s] * a.context,
                             "logits": [0] * (a.context - 1) + [1]}
                        ctx.decode(as_batch(b))
                        if session is not None:
                            session.op({"op": "bench_batches", "batches": [b]})
                    undo = [[NEW_SEQ, -1, -1]] + [[s, a.context, -1] for s in range(a.n_gen)]
                    print(f"\nmodel {name} ({path.stat().st_size >> 20} MiB)")
                    print(f"{'N':>5} {'llama 1':>9} {'llama 2':>9} {'ours 1':>9} {'ours 2':>9} {'ours 2 / llama 1':>17}")
                    for n in a.sizes:
                        t = {k: [] for k in ("l1", "l2", "o1", "o2")}
                        for _ in range(a.reps + 1):  # (the first of each is a warm-up, not counted)
                            dec, new = step_batches(a.n_gen, a.context, n, vocab, rng)
                            for key, batches in (("o1", [joined(dec, new)]), ("o2", [dec, new])):
                                time.sleep(a.quiet_ms / 1e3)
                                t0 = time.perf_counter()
                                for b in batches:
                                    ctx.decode(as_batch(b))
                                t[key].append(time.perf_counter() - t0)
                                for args in undo:
                                    ctx.memory_seq_rm(*args)
                            if session is not None:
                                for key, batches in (("l1", [joined(dec, new)]), ("l2", [dec, new])):
                                    time.sleep(a.quiet_ms / 1e3)
                                    ans = session.op({"op": "bench_batches", "batches": batches, "undo": undo})
                                    t[key] += ans["times"]
                        med = {k: 1e3 * statistics.median(v[1:]) if v else float("nan") for k, v in t.items()}
                        print(f"{n:5d} {med['l1']:9.2f} {med['l2']:9.2f} {med['o1']:9.2f} {med['o2']:9.2f} "
                              f"{med['o2'] / med['l1']:16.2f}x", flush=True)
                finally:
                    if session is not None:
                        session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
