"""Prompt reuse on a multi-turn chat workload: prompt tokens decoded and time to first token, with and without the
prefix cache, next to llama-cpp-python with and without its LlamaRAMCache.

The workload (:func:`_workload.chat_workload`): ``--users`` users, ``--turns`` turns each,
round-robin, one shared system prompt of ``--system`` tokens, user messages of ``--user-min``..``--user-max``
tokens, replies of ``--reply`` tokens (forced, so every engine generates the same tokens); each prompt is the whole
history.  Every engine serves the requests one after another (ours: the serving engine, ``n_parallel=1``,
replies forced) on the same random llama
GGUF, with the same threads, cache type and flash attention:

* ours, no prefix cache: every prompt decoded in full;
* ours, PrefixCache: prefixes reused on the device (seq_cp of the system prompt, each user's previous turn);
* ours, PrefixCache with a device cache of ``--small-ctx`` cells and a host tier: sequences evicted to RAM blobs
  and restored;
* llama-cpp-python 0.3.17 (``Llama.create_completion``), without a cache (its one context reuses the prefix it
  holds) and with ``LlamaRAMCache`` (whole-context states keyed by token lists) -- when the oracle is built.

"ideal" is the prompt tokens a perfect prefix cache decodes (each request minus the longest prefix it shares with
anything served before, keeping one token to decode).  The logits column compares each request's first-token
logits with our no-cache run (relative to the largest logit).

    .venv/bin/python benchmarks/bench_prefix.py [--users 4 --turns 4 --system 256] [--type-kv f16] [--json out]
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

from kvcache_ggml.batch import Batch
from kvcache_ggml.prefix import HostParams, PrefixParams
from kvcache_ggml.runtime import Context, Model, make_model
from kvcache_ggml.runtime.modelmaker import ModelSpec
from kvcache_ggml.runtime.tokenizer import Vocab
from kvcache_ggml.serve.engine import Engine, EngineParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "oracle"))
from llama_runner import ORACLE_PY, llama_available  # noqa: E402

from _workload import chat_workload, replay  # noqa: E402 (this folder)

HERE = Path(__file__).resolve().parent


def ideal_decoded(reqs) -> int:
    """Prompt tokens left to decode when every prefix served before is reused (one token always decoded)."""
    seen: list[np.ndarray] = []
    total = 0
    for r in reqs:
        t = np.asarray(r.tokens)
        best = 0
        for s in seen:
            m = min(s.size, t.size)
            neq = np.flatnonzero(s[:m] != t[:m])
            best = max(best, int(neq[0]) if neq.size else m)
        total += t.size - min(best, t.size - 1)
        seen.append(np.concatenate([t, r.reply[:-1]]))
    return total


def ours(path: Path, reqs, a, label: str, prefix: PrefixParams, n_ctx: int) -> dict:
    with Model(path) as m, Context(m, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=512, n_seq_max=a.users + 1,
                                   kv_unified=True, flash_attn=a.flash_attn, type_k=a.type_kv, type_v=a.type_kv,
                                   n_threads=a.threads, n_threads_batch=a.threads) as ctx:
        ctx.decode(Batch(token=np.arange(3, 67, dtype=np.int32)))  # warm-up: graph allocation
        ctx.memory_clear()
        eng = Engine(ctx, Vocab.from_kv(m.gguf_kv), EngineParams(n_parallel=1, warmup=False), prefix)
        t0 = time.perf_counter()
        resp = replay(eng, reqs, keep_logits=True)
        wall = time.perf_counter() - t0
        st = eng.prefix.stats
        note = (f"{st.hits_device} device / {st.hits_host} host hits, {st.evictions} evictions, host peak "
                f"{st.host_bytes_peak / 2**20:.1f} MiB" if prefix.reuse else "")
        eng.prefix.close()
    return {"label": label, "decoded": sum(r.n_decoded for r in resp), "ttft": [r.ttft for r in resp],
            "wall": wall, "note": note, "logits": [r.first_logits for r in resp]}


def llama(path: Path, reqs, a, label: str, cache_bytes: int) -> dict | None:
    if llama_available() is not None:
        return None
    spec = {"model": str(path), "n_ctx": a.n_ctx, "n_batch": 512, "threads": a.threads,
            "flash_attn": a.flash_attn, "type_kv": a.type_kv, "cache_bytes": cache_bytes,
            "requests": [{"tokens": [int(t) for t in r.tokens], "forced": [int(t) for t in r.reply]}
                         for r in reqs]}
    p = subprocess.run([str(ORACLE_PY), str(HERE / "_llama_prefix.py")], input=json.dumps(spec),
                       capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"llama-cpp-python run failed ({p.returncode}): {p.stderr[-2000:]}")
    res = json.loads(p.stdout.strip().splitlines()[-1])
    rq = res["requests"]
    note = ""
    if cache_bytes:
        note = (f"{res['cache_entries_peak']} states, {res['cache_size_peak'] / 2**20:.1f} MiB counted, "
                f"{res['cache_real_bytes_peak'] / 2**20:.1f} MiB held")
    return {"label": label, "decoded": sum(r["decoded"] for r in rq), "ttft": [r["ttft"] for r in rq],
            "wall": sum(r["seconds"] for r in rq), "note": note, "logits": None}


def table(rows: list[dict], n_prompt: int, ideal: int, base_logits: list) -> str:
    head = (f"{'engine':<44} {'decoded':>8} {'of prompt':>9} {'TTFT mean':>9} {'p50':>7} {'p90':>7} "
            f"{'wall s':>7} {'logits':>8}  notes")
    lines = [head, "-" * len(head)]
    for r in rows:
        t = np.asarray(r["ttft"]) * 1e3
        dl = "" if r["logits"] is None else f"{max(_rel(g, b) for g, b in zip(r['logits'], base_logits)):.1e}"
        lines.append(f"{r['label']:<44} {r['decoded']:>8} {r['decoded'] / n_prompt:>9.1%} {t.mean():>7.1f}ms "
                     f"{np.median(t):>5.1f}ms {np.percentile(t, 90):>5.1f}ms {r['wall']:>7.2f} {dl:>8}  "
                     f"{r['note']}")
    lines.append(f"{'ideal (every shared prefix reused)':<44} {ideal:>8} {ideal / n_prompt:>9.1%}")
    return "\n".join(lines)


def _rel(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system", type=int, default=256, help="shared system prompt tokens")
    ap.add_argument("--user-min", type=int, default=24)
    ap.add_argument("--user-max", type=int, default=64)
    ap.add_argument("--reply", type=int, default=16, help="reply tokens per turn")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--type-kv", default="f16", choices=["f16", "f32"])
    ap.add_argument("--weights", default="f32", choices=["f32", "f16"],
                    help="weight type (F16 weights round activations to F16: rounding noise grows to ~1e-3)")
    ap.add_argument("--no-fa", dest="flash_attn", action="store_false", help="mul_mat + soft_max attention")
    ap.add_argument("--n-ctx", type=int, default=0, help="cells (0: room for every conversation)")
    ap.add_argument("--small-ctx", type=int, default=1024, help="cells of the host-tier run's device cache")
    ap.add_argument("--host-mib", type=int, default=256, help="host tier budget of that run")
    ap.add_argument("--no-llama", action="store_true", help="skip llama-cpp-python")
    ap.add_argument("--json", type=Path, help="write the figures here")
    a = ap.parse_args(argv)

    reqs = chat_workload(a.users, a.turns, a.system, user_len=(a.user_min, a.user_max), reply_len=a.reply,
                         vocab=512, seed=0)
    longest = max(len(r.tokens) for r in reqs) + a.reply
    a.n_ctx = a.n_ctx or -(-(longest * (a.users + 1)) // 256) * 256
    n_prompt = sum(len(r.tokens) for r in reqs)
    ideal = ideal_decoded(reqs)
    print(f"workload: {a.users} users x {a.turns} turns, system prompt {a.system} tokens, messages "
          f"{a.user_min}-{a.user_max}, replies {a.reply}: {len(reqs)} requests, {n_prompt} prompt tokens, "
          f"{1 - ideal / n_prompt:.0%} of them shared with earlier requests")
    print(f"model: 4 layers, n_embd 256, 8/4 heads, n_ff 768, n_vocab 512, {a.weights} weights; cache {a.type_kv}, "
          f"{'flash attention' if a.flash_attn else 'no flash attention'}, {a.threads} thread(s), n_ctx {a.n_ctx}")
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(Path(tmp) / "bench.gguf", ModelSpec(layers=4, embd=256, heads=8, heads_kv=4, ff=768,
                                                              vocab=512, type=a.weights, seed=1))
        rows = [ours(path, reqs, a, "kvcache_ggml, no prefix cache", PrefixParams(reuse=False), a.n_ctx),
                ours(path, reqs, a, "kvcache_ggml, PrefixCache", PrefixParams(), a.n_ctx),
                ours(path, reqs, a, f"kvcache_ggml, PrefixCache, {a.small_ctx} cells + host",
                     PrefixParams(host=HostParams(budget=a.host_mib << 20)), a.small_ctx)]
        if not a.no_llama:
            for label, nbytes in (("llama-cpp-python, no cache (context prefix)", 0),
                                  ("llama-cpp-python + LlamaRAMCache (2 GiB)", 2 << 30)):
                r = llama(path, reqs, a, label, nbytes)
                if r is None:
                    print(f"({label}: oracle not built, {llama_available()})")
                    break
                rows.append(r)
    print(table(rows, n_prompt, ideal, rows[0]["logits"]))
    if a.json:
        a.json.write_text(json.dumps({"n_prompt": n_prompt, "ideal": ideal, "rows": [
            {k: v for k, v in r.items() if k != "logits"} for r in rows]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
