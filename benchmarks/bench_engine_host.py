"""The serving engine's host work per one-token step: the CPU its thread spends outside ggml's compute.

On two cores the engine's Python shares the CPU with ggml's threads, the event loop and the clients, and on a GPU it
is the step's throughput limit; this measures it without HTTP.  One request at a time on ``bench_serve.py``'s model
(made there on first use), as the 1-user chat has them: a prompt (a 300-word shared system prompt, then words of
its own), ``--reply`` tokens greedy with ``ignore_eos`` and a ``logit_bias`` on 300 ids, while the cache keeps the
earlier requests' sequences (the shared prompt's node in the prefix tree has other entries below it).  Per decode
step: the thread's CPU time (``time.thread_time``) of ``Engine.step`` less that of ggml's compute call, and the parts
(plan, the decode's host side, update, publish).  The medians over ``--requests`` requests, and the host work's
ratio to the compute's wall time.

    .venv/bin/python benchmarks/bench_engine_host.py [--requests 12] [--reply 200] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import WORDS, make_bench_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--reply", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", type=Path, default=Path(tempfile.gettempdir()) / "kvcache_bench_serve.gguf")
    a = ap.parse_args()

    import kvcache_ggml.runtime.fused_step as fused_step
    from kvcache_ggml.serve.app import _Api
    from kvcache_ggml.serve.cli import open_service, parse_args
    from kvcache_ggml.serve.request import Job
    from kvcache_ggml.serve.sampling import Sampler
    from kvcache_ggml.serve.text import TextStream

    model_path = make_bench_model(a.model)
    sa = parse_args(["--model", str(model_path), "-c", "8192", "-np", "1", "-t", str(a.threads), "-fa", "on",
                     "-kvu", "--parked", "4"])
    model, ctx, svc = open_service(sa)
    try:
        eng, api = svc.engine, _Api(svc)
        eng.warm_up()
        cpu = time.thread_time
        spent: Counter[str] = Counter()

        def timed(obj, name: str, label: str) -> None:
            fn = getattr(obj, name)

            def wrapper(*args, **kw):
                t = cpu()
                try:
                    return fn(*args, **kw)
                finally:
                    spent[label] += cpu() - t
            setattr(obj, name, wrapper)

        ggml = fused_step.G
        compute_fn = ggml.ggml_backend_sched_graph_compute
        wall = [0.0]

        class Timed:  # ggml's module with the compute call timed (CPU and wall)
            def __getattr__(self, k):
                return getattr(ggml, k)

            def ggml_backend_sched_graph_compute(self, *args):
                t, w = cpu(), time.perf_counter()
                try:
                    return compute_fn(*args)
                finally:
                    spent["compute"] += cpu() - t
                    wall[0] += time.perf_counter() - w

        fused_step.G = Timed()
        for name in ("plan", "execute", "update", "_publish"):
            timed(eng, name, name)
        rng = np.random.default_rng(0)
        system = " ".join(rng.choice(WORDS, 300))
        bias = {int(i): -100.0 for i in rng.choice(len(api.vocab.tokens), 300, replace=False)}
        host, parts, ratio = [], [], []
        for r in range(a.requests + 1):
            body = {"model": svc.model_name, "prompt": system + " " + " ".join(rng.choice(WORDS, 40)),
                    "max_tokens": a.reply, "temperature": 0, "ignore_eos": True, "logit_bias": bias}
            req = api.completion.parse(body)
            sp = req.sampling
            job = Job(api.completion.prompt(req), Sampler(sp, api.n_vocab, api.eog),
                      TextStream(api.vocab, sp.stop), lambda ev: None, max_tokens=sp.max_tokens)
            eng.submit(job)
            eng.step()  # (the prompt)
            spent.clear()
            wall[0], per = 0.0, []
            while eng._running:
                before = spent["compute"]
                t = cpu()
                eng.step()
                per.append(cpu() - t - (spent["compute"] - before))
            if r == 0:
                continue  # (the first request warms the paths up)
            host.append(statistics.median(per))
            parts.append({k: v / len(per) for k, v in spent.items()})
            ratio.append(sum(per) / wall[0])
        med = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
        print(f"model {model_path.name}, -t {a.threads}; {a.requests} requests of {a.reply} tokens, one at a time")
        print(f"host CPU per one-token step (median of the requests' medians): {statistics.median(host) * 1e6:.0f} us"
              f" (requests: {min(host) * 1e6:.0f}-{max(host) * 1e6:.0f} us); host / compute wall: "
              f"{statistics.median(ratio):.2f}")
        print("  per step, CPU:  " + ", ".join(f"{k} {med[k] * 1e6:.0f} us" for k in
                                              ("plan", "execute", "compute", "update", "_publish")))
        print("  (execute includes compute: the decode's host side is their difference)")
    finally:
        ctx.close()
        model.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
