"""Instructions per decode step, ours next to llama.cpp's, by library: a measure a busy machine cannot skew.

Timings on a shared 2-core machine move with the load; the instructions a step executes do not.  This runs the
decode loop of ``bench_runtime`` (one ``--prompt``-token batch, seq_cp, one token per sequence per step) under
``valgrind --tool=callgrind`` twice per side, with ``--steps`` and 3 x ``--steps`` steps, and divides the difference
per library by the extra steps: start-up, imports, model loading and the prompt cancel out.  ``libggml-cpu`` is the
graph compute (the same graph on both sides: see tests/oracle/test_oracle_runtime.py); everything else is host work
(our Python, numpy, the binding layer; llama.cpp's libllama, libc, and the Python of its runner that fills
``llama_batch`` and takes a numpy view of the logits, as ours returns one).

Needs valgrind and the oracle's interpreter (tests/README.md); each run takes a minute or so (imports under
valgrind), so the default is the three configurations of issue 12's figures.

    .venv/bin/python benchmarks/bench_instructions.py [--configs 1:fa-streams,8:nofa-unified,8:fa-streams]
                                                      [--steps 32] [--tiny model.gguf]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "oracle"))  # llama_runner

from bench_runtime import MODELS, MODES  # noqa: E402

from kvcache_ggml.runtime import make_model  # noqa: E402
from llama_runner import ORACLE_PY, llama_available  # noqa: E402

RUNNER = ROOT / "tests" / "oracle" / "llama_runner.py"
OURS = """
import sys, numpy as np
from kvcache_ggml.batch import Batch
from kvcache_ggml.runtime import Context, Model
path, n_par, fa, uni, n_gen, n_prompt = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1", \\
    int(sys.argv[5]), int(sys.argv[6])
with Model(path) as m, Context(m, n_ctx=max(1024, 256 * n_par), n_batch=max(1024, 256 * n_par), n_seq_max=n_par,
                               kv_unified=uni, flash_attn=fa, n_threads=1, n_threads_batch=1) as ctx:
    nv = m.n_vocab
    prompt = np.random.default_rng(0).integers(3, nv, n_prompt).astype(np.int32)
    ctx.decode(Batch(token=prompt, pos=np.arange(n_prompt, dtype=np.int32)))
    for s in range(1, n_par):
        ctx.memory_seq_cp(0, s, -1, -1)
    seqs, flags = np.arange(n_par, dtype=np.int32), np.ones(n_par, np.int8)
    for step in range(n_gen):
        toks = np.array([(7 * step + 3 * s + 5) % nv for s in range(n_par)], np.int32)
        ctx.decode(Batch(token=toks, pos=np.full(n_par, n_prompt + step, np.int32), seq_id=seqs, logits=flags))
"""


def by_library(out: Path) -> collections.Counter:
    """Instructions per shared object of a callgrind output file."""
    text = subprocess.run(["callgrind_annotate", "--threshold=100", str(out)], capture_output=True, text=True,
                          check=True).stdout
    acc: collections.Counter = collections.Counter()
    for line in text.splitlines():
        m = re.match(r"\s*([\d,]+) \(\s*[\d.]+%\)\s+.* \[(.*)\]\s*$", line)
        if m:
            lib = Path(m.group(2)).name.split(".so")[0].removeprefix("lib")
            acc[lib] += int(m.group(1).replace(",", ""))
    return acc


def callgrind(cmd: list[str], tmp: Path, tag: str, stdin: str | None = None) -> collections.Counter:
    out = tmp / f"{tag}.callgrind"
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT))  # no BLAS threads spinning at import
    # cwd=ROOT: ``python -c`` puts the current folder first on sys.path
    p = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *cmd], input=stdin,
                       capture_output=True, text=True, env=env, cwd=ROOT)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} under callgrind failed: {p.stderr[-2000:]}")
    return by_library(out)


def per_step(run, steps: int) -> collections.Counter:
    """(instructions at 3*steps - at steps) / (2*steps), per library."""
    a, b = run(steps), run(3 * steps)
    return collections.Counter({k: (b[k] - a[k]) / (2 * steps) for k in set(a) | set(b)})


def measure(path: Path, n_par: int, mode: str, a: argparse.Namespace, tmp: Path) -> tuple[dict, dict]:
    fa, uni = MODES[mode]
    tag = f"{n_par}-{mode}"

    def ours(n: int) -> collections.Counter:
        return callgrind([sys.executable, "-c", OURS, str(path), str(n_par), str(int(fa)), str(int(uni)), str(n),
                          str(a.prompt)], tmp, f"ours-{tag}-{n}")

    def llama(n: int) -> collections.Counter:
        prompt = list(range(3, 3 + a.prompt))
        spec = {"model": str(path), "params": {"n_ctx": max(1024, 256 * n_par), "n_batch": max(1024, 256 * n_par),
                                               "n_seq_max": n_par, "kv_unified": uni, "flash_attn": fa,
                                               "n_threads": 1},
                "ops": [{"op": "bench", "prompt": prompt, "n_gen": n, "n_par": n_par, "reps": 1}]}
        return callgrind([str(ORACLE_PY), str(RUNNER)], tmp, f"llama-{tag}-{n}", json.dumps(spec))

    return dict(per_step(ours, a.steps)), dict(per_step(llama, a.steps))


def split(c: dict) -> tuple[float, float]:
    """(compute, host) thousands of instructions of one step."""
    compute = sum(v for k, v in c.items() if k.startswith("ggml-cpu"))
    return compute / 1e3, (sum(c.values()) - compute) / 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="1:fa-streams,8:nofa-unified,8:fa-streams",
                    help=f"comma-separated n_par:mode ({', '.join(MODES)})")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tiny", help="a GGUF to use instead of the tiny model of bench_runtime")
    ap.add_argument("--detail", action="store_true", help="print the libraries of each side too")
    a = ap.parse_args(argv)
    why = llama_available() or (None if shutil.which("valgrind") else "valgrind is not installed")
    if why:
        print(f"cannot run: {why}")
        return 1
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_instr_") as tmp:
        path = Path(a.tiny) if a.tiny else make_model(Path(tmp) / "tiny.gguf", MODELS["tiny"])
        for item in a.configs.split(","):
            n_par, mode = item.split(":")
            ours, theirs = measure(path, int(n_par), mode, a, Path(tmp))
            rows.append((f"{n_par} seq {mode}", ours, theirs))
            print(f"  done: {item}", flush=True)
    print("\nthousands of instructions per decode step (tiny model, 1 thread):")
    print(f"{'':>20} {'compute ours':>13} {'llama.cpp':>10} {'host ours':>10} {'llama.cpp':>10} {'step ratio':>11}")
    for name, ours, theirs in rows:
        (co, ho), (ct, ht) = split(ours), split(theirs)
        print(f"{name:>20} {co:13.1f} {ct:10.1f} {ho:10.1f} {ht:10.1f} {(ct + ht) / (co + ho):11.2f}")
        if a.detail:
            for side, c in (("ours", ours), ("llama.cpp", theirs)):
                top = sorted(c.items(), key=lambda kv: -kv[1])[:8]
                print(f"{'':>22}{side}: " + ", ".join(f"{k} {v / 1e3:.1f}" for k, v in top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
