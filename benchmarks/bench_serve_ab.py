"""bench_serve.py's chat workload with both servers up at once, alternating run by run.

    python benchmarks/bench_serve_ab.py [--users 1] [--rounds 16] [--turns 3] [--system 300] [--reply 32]

bench_serve.py runs one server after the other, each run on freshly started servers; on this shared 2-core machine
runs of the same code differ by more than 10 %, more than the gaps it is meant to show.  Here ours and llama-server
(the same GGUF and flags as bench_serve.py) are started once per user count and warmed, then ``--rounds`` rounds
each run the workload on both, in alternating order (ours first in even rounds), with a new seed per round: new
conversations, while the caches keep what the earlier rounds left (a server in its steady state).  A slow spell of
the machine then falls on both servers alike.

Per server: output tokens/s (median of the rounds); TTFT p50 / p90 over all requests; the reply after its first
token, p50 per request (``decode``); the server process's CPU seconds per round (user + system, from ``/proc``:
Linux only); and the ratios ours / llama-server.  ``--variant ARGS`` adds a third server in the same rounds, ours
with those options added ("ours+", its ratio "ratio+"): a change measured against ours and llama-server at once.

``--spec``: bench_serve.py's speculative workload instead (``--spec`` there), with six servers up at once: each of
ours and llama-server without drafts, with ``-md`` and with prompt lookup.  Every round runs each server once, in a
rotating order, on prompts of its own (made as bench_serve.py makes them, fewer tries each), the same for the six
servers: no request repeats an earlier one, so neither a server's cache nor a draft model's helps.  The speedup of
a mode is the median over the rounds of its tokens/s over the same server's without drafts in that round.
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import (CHATML, GPT2_VOCAB, LLAMA_SERVER, SPEC_MODES, add_chat_args, add_spec_args,  # noqa: E402
                         free_port, make_bench_model, partial_utf8_tokens, run_workload, server_cmd, spec_answers,
                         spec_flags, spec_post, stop, wait_ready, warm_request)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads); NaN where /proc cannot say."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def rounds(kinds: list[str], model: Path, users: int, a: argparse.Namespace, log: Path,
           bias: dict[str, float]) -> dict[str, dict[str, list[float]]]:
    """Both servers up, ``a.rounds`` alternating rounds; per server its per-round and per-request figures."""
    procs, urls = {}, {}
    res = {k: {"tok/s": [], "ttft": [], "decode": [], "cpu": []} for k in kinds}
    with open(log, "ab") as out:
        try:
            for kind in kinds:
                procs[kind], urls[kind] = start(lambda port, kind=kind: ab_cmd(kind, model, port, a, users), out)
            for kind in kinds:
                wait_ready(urls[kind], procs[kind])
                warm_request(urls[kind], bias)
            for r in range(a.rounds):
                for kind in (kinds if r % 2 == 0 else kinds[::-1]):
                    c0 = cpu_seconds(procs[kind].pid)
                    run = run_workload(urls[kind], users, a, seed=100 + r, bias=bias)
                    d = res[kind]
                    d["cpu"].append(cpu_seconds(procs[kind].pid) - c0)
                    if run.errors:
                        print(f"  {kind}: {len(run.errors)} errors, e.g. {run.errors[0]}")
                    d["tok/s"].append(sum(s.completion for s in run.samples) / run.wall)
                    d["ttft"] += [s.ttft for s in run.samples]
                    d["decode"] += [s.seconds - s.ttft for s in run.samples]
        finally:
            stop(procs.values())
    return res


def ab_cmd(kind: str, model: Path, port: int, a: argparse.Namespace, users: int) -> list[str]:
    """bench_serve's command for ``kind``; "ours+" is ours with ``--variant``'s options added."""
    if kind == "ours+":
        return server_cmd("ours", model, port, a, users) + shlex.split(a.variant)
    return server_cmd(kind, model, port, a, users)


def start(cmd: Callable[[int], list[str]], out: IO[bytes]) -> tuple[subprocess.Popen, str]:
    """A server started with the command ``cmd(port)`` on a free port; (its process, its URL)."""
    port = free_port()
    return subprocess.Popen(cmd(port), stdout=out, stderr=subprocess.STDOUT), f"http://127.0.0.1:{port}"


def spec_main(a: argparse.Namespace, kinds: list[str], log: Path) -> int:
    """The speculative rows with every server up at once, alternating (see the module docstring)."""
    from _spec_models import spec_models, spec_prompts

    tmp = Path(tempfile.gettempdir())
    target, draft = spec_models(tmp / "kvcache_bench_spec_target.gguf", tmp / "kvcache_bench_spec_draft.gguf",
                                GPT2_VOCAB, CHATML)
    bias = partial_utf8_tokens(target)
    keys = [(k, m) for k in kinds for m in SPEC_MODES]
    print(f"target {target.name}, draft {draft.name}; --draft-max {a.spec_draft_max}, -md --draft-p-min "
          f"{a.spec_p_min}; replies {a.spec_reply} tokens; -t {a.threads}; {a.rounds} rounds, every server up")
    print(f"{'users':>5} {'server':>6} {'mode':>6} {'tok/s':>8} {'speedup':>8}")
    for users in a.users:
        pool = spec_prompts(target, users * a.rounds, a.spec_reply, [int(t) for t in bias], tries=2)
        tok_s: dict = {key: [] for key in keys}
        with open(log, "ab") as out:
            servers = {key: start(lambda port, key=key: server_cmd(key[0], target, port, a, users)
                                  + spec_flags(key[0], key[1], draft, a), out) for key in keys}
            try:
                for proc, url in servers.values():
                    wait_ready(url, proc)
                    spec_post(url, {"prompt": [400, 401, 402], "max_tokens": 4, "temperature": 0})  # (warm-up)
                for r in range(a.rounds):
                    prompts = pool[r * users:(r + 1) * users]
                    for key in keys[r % len(keys):] + keys[:r % len(keys)]:
                        tok_s[key].append(spec_answers(servers[key][1], prompts, a, bias)[0])
            finally:
                stop(p for p, _ in servers.values())
        for kind, mode in keys:
            ratios = [t / b for t, b in zip(tok_s[(kind, mode)], tok_s[(kind, "none")])]
            print(f"{users:>5} {kind:>6} {mode:>6} {statistics.median(tok_s[(kind, mode)]):>8.1f} "
                  f"{statistics.median(ratios):>7.2f}x", flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", type=int, nargs="+", default=[1])
    ap.add_argument("--rounds", type=int, default=16)
    add_chat_args(ap)
    ap.add_argument("--variant", default="", metavar="ARGS",
                    help="a third server, ours with these options added (\"ours+\"), in the same rounds: e.g. "
                         "--variant=--no-fa-tiles")
    ap.add_argument("--spec", action="store_true", help="the speculative workload instead (see above)")
    add_spec_args(ap)
    a = ap.parse_args()
    kinds = ["ours", "llama"]
    if not LLAMA_SERVER.exists():
        print(f"({LLAMA_SERVER} missing: bash scripts/build_reference.sh --server; our rows only)")
        kinds = ["ours"]
    log = Path(tempfile.gettempdir()) / "bench_serve.log"
    if a.spec:
        return spec_main(a, kinds, log)
    if a.variant:
        kinds.insert(1, "ours+")
    model = make_bench_model(a.model)
    bias = partial_utf8_tokens(model)
    print(f"model {model.name}; -c {a.n_ctx} -b {a.batch} -ub {a.ubatch} -t {a.threads} -fa on -kvu; {a.turns} turns, "
          f"system ~{a.system} tokens, replies {a.reply} tokens; {a.rounds} alternating rounds; servers' output in "
          f"{log}")
    print(f"{'users':>5} {'server':>6} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p90':>9} {'decode p50':>11} {'CPU/round':>10}")
    for users in a.users:
        res = rounds(kinds, model, users, a, log, bias)
        row = {}
        for kind in kinds:
            d = res[kind]
            row[kind] = (statistics.median(d["tok/s"]), float(np.percentile(d["ttft"], 50)),
                         float(np.percentile(d["ttft"], 90)), float(np.percentile(d["decode"], 50)),
                         statistics.median(d["cpu"]))
            t, p50, p90, dec, cpu = row[kind]
            print(f"{users:>5} {kind:>6} {t:>8.1f} {p50 * 1e3:>7.1f}ms {p90 * 1e3:>7.1f}ms {dec * 1e3:>9.1f}ms "
                  f"{cpu:>9.3f}s", flush=True)
        for kind, name in (("ours", "ratio"), ("ours+", "ratio+")):
            if kind in row and "llama" in row:
                o, l = row[kind], row["llama"]
                print(f"{users:>5} {name:>6} {o[0] / l[0]:>7.2f}x {o[1] / l[1]:>8.2f}x {o[2] / l[2]:>8.2f}x "
                      f"{o[3] / l[3]:>10.2f}x {o[4] / l[4]:>9.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
