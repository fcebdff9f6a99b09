"""Decode (and prompt) throughput of the runtime next to llama.cpp's (llama-cpp-python 0.3.17), side by side.

Two models, made by the model maker on each run (or passed with ``--tiny`` / ``--real``):

* ``tiny``: negligible compute (2 layers, n_embd 64, 8/4 heads, ff 128, vocabulary 256, F32) -- the host's cost of
  a step decides;
* ``real``: a llama of about 110M parameters (12 layers, n_embd 768, 12/4 heads, ff 2048, Q4_0, tied embeddings,
  the GPT-2 vocabulary of tests/data/vocab) -- a real model's step.

Each configuration (sequences x unified / per-sequence streams x flash attention on / off) runs on both sides with
the same file, threads, context, cache types and batches: one ``--prompt``-token batch in sequence 0 (last token
output), seq_cp to the other sequences, then ``--n-gen`` steps of one token per sequence (every token an output).
Our runs and llama.cpp's alternate (llama.cpp in a :class:`LlamaSession` in the oracle's interpreter), best of
``--reps`` each, so a busy machine slows both alike: our prompt, llama.cpp's, our steps, llama.cpp's, each turn
after ``--quiet-ms`` of sleep (a side's OpenMP workers spin for about 10 ms after its last graph; a turn started at
once would share the two CPUs with them -- the turn after a side's steps loses up to a tenth); each side does so in
``--sessions`` fresh sessions (our Context, llama.cpp's runner process: one process can run the same steps half
again as slow as the next one) and the best of all runs counts.  The sessions are rounds over all configurations
(session 1 of each, then session 2, ...), so that one of this machine's slow spells, which last about a minute,
falls on one session of several configurations rather than on every session of one.

Columns: tokens/s of the decode steps for both and the ratio (ours / llama.cpp, 1.0 = as fast), including building
each step's batch and taking its logits into numpy on both sides (ours: the array ``decode`` returns; llama.cpp's:
a view of its logits buffer, no copy); ``core``: the same ratio for the decode call alone
(``Context.decode`` / ``llama_decode``); ``cpu``: the ratio of the steps' CPU time of the calling thread (what a busy
machine skews least; with more than one thread it leaves out the other threads' share); ``prompt``: the ratio for
the prompt batch; ``paired``: the median over all runs of the ratio of one of our runs to the llama.cpp run that
follows it (a slow spell of the machine slows both runs of a pair, where it can leave one side without a fast
best).  Both sides run on the same CPUs (``--no-pin``: any CPU), both contexts without performance
timings (``no_perf``, llama.cpp's default).  Then our host time per step split into batch splitting, cache
bookkeeping, memory updates, input setting, graph build and compute (with the logits read back), from two more runs
of a context that times them (``no_perf=False``), and the C calls and tensor-struct reads per step.
``--alternate`` makes step k decode sequences 0..k % n_par only, so the batch's shape changes at every step, as in a
serving loop: llama.cpp, which reuses only the previous graph, builds every step's graph; ours computes the graph it
keeps for that shape (runtime/graph_cache.py; the mode shows ``/alt``).  ``--no-graph-reuse`` turns graph reuse off on both sides (ours ``graph_reuse=False``, llama.cpp's
``LLAMA_GRAPH_REUSE_DISABLE=1``; the mode shows ``/build``): every step builds, allocates and fills its graph, as
the first step after a prompt does, so the table compares a step that builds its graph.

    .venv/bin/python benchmarks/bench_runtime.py [--models tiny,real] [--n-par 1,4,8] [--modes fa-streams,...]
                                                 [--threads 1] [--real-threads 2] [--reps 3] [--sessions 5]
                                                 [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

# nothing in a decode step calls BLAS; numpy's OpenBLAS threads only spin for a moment after import, on a core both
# sides need while models are made and loaded (llama.cpp's session inherits this too)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from native_calls import NativeCalls  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "oracle"))  # llama_runner
from _oracle import pin  # noqa: E402

from kvcache_ggml import ggml as G  # noqa: E402
from kvcache_ggml.batch import Batch  # noqa: E402
from kvcache_ggml.runtime import Context, Model, make_model  # noqa: E402
from llama_runner import LlamaSession, llama_available  # noqa: E402
from kvcache_ggml.runtime.modelmaker import ModelSpec  # noqa: E402

GPT2_VOCAB = ROOT / "tests" / "data" / "vocab" / "ggml-vocab-gpt-2.gguf"
MODELS = {
    "tiny": ModelSpec(layers=2, embd=64, heads=8, heads_kv=4, ff=128, vocab=256, type="f32"),
    "real": ModelSpec(layers=12, embd=768, heads=12, heads_kv=4, ff=2048, type="q4_0", tied=True,
                      vocab_from=str(GPT2_VOCAB)),
}
MODES = {"fa-streams": (True, False), "fa-unified": (True, True), "nofa-streams": (False, False),
         "nofa-unified": (False, True)}
PHASES = ("batch", "bookkeeping", "update", "inputs", "build", "compute")


@dataclass(slots=True)
class Config:
    """One line of the table."""

    model: str           # key of MODELS
    path: Path           # its GGUF
    n_par: int           # sequences decoding together
    mode: str            # key of MODES
    threads: int         # CPU threads (both sides)
    n_ctx: int           # context size, all sequences together
    n_gen: int           # decode steps of one run
    reuse: bool = True   # graph reuse on (off: every step builds its graph, on both sides)
    alternate: bool = False  # step k decodes sequences 0..k % n_par: the shape changes every step (serving)

    @property
    def label(self) -> str:
        return self.mode + ("" if self.reuse else "/build") + ("/alt" if self.alternate else "")

    def n_tokens(self) -> int:
        """Tokens decoded by the n_gen steps."""
        if not self.alternate:
            return self.n_par * self.n_gen
        return sum(1 + k % self.n_par for k in range(self.n_gen))

    def params(self) -> dict:
        fa, unified = MODES[self.mode]
        return dict(n_ctx=self.n_ctx, n_batch=self.n_ctx, n_ubatch=512, n_seq_max=self.n_par, kv_unified=unified,
                    flash_attn=fa, type_k="f16", type_v="f16")


@dataclass(slots=True)
class Result:
    """Best runs of one configuration (seconds) and our figures of the best decode run."""

    prompt_s: float = float("inf")          # ours: the prompt batch
    gen_s: float = float("inf")             # ours: the n_gen steps with their batches
    decode_s: float = float("inf")          # ours: the Context.decode calls of those steps
    cpu_s: float = float("inf")             # ours: this thread's CPU time of those steps
    split: dict = field(default_factory=dict)  # ours: StepTimes of the best decode run of a timed context
    calls: float = 0.0                      # ours: C calls per step
    reads: float = 0.0                      # ours: tensor struct reads per step
    llama: dict | None = None               # llama.cpp's best prompt_s, gen_s, decode_s (None: not run)
    pairs: list = field(default_factory=list)  # tokens/s ours / llama.cpp of each run and the llama.cpp run after it


def our_prompt(ctx: Context, prompt: np.ndarray, cfg: Config, res: Result) -> None:
    """The runner's ``bench_prompt`` op on our runtime: a clear cache, the prompt in sequence 0 (last token output),
    copied to every sequence.  Keeps the best prompt time in ``res``."""
    ctx.memory_clear(True)
    t0 = time.perf_counter()
    ctx.decode(Batch(token=prompt, pos=np.arange(len(prompt), dtype=np.int32)))
    res.prompt_s = min(res.prompt_s, time.perf_counter() - t0)
    for s in range(1, cfg.n_par):
        ctx.memory_seq_cp(0, s, -1, -1)


def our_steps(ctx: Context, n_prompt: int, cfg: Config) -> tuple[float, float, float]:
    """The runner's ``bench_steps`` op on our runtime: ``n_gen`` steps of one token per sequence, every token an
    output.  Their wall, decode-call and thread CPU seconds."""
    n_vocab, n_par = ctx.n_vocab, cfg.n_par
    seqs = np.arange(n_par, dtype=np.int32)
    flags = np.ones(n_par, np.int8)
    pos = np.full(n_par, n_prompt, np.int32)
    ctx.times.reset()
    spent = 0.0
    t0, c0 = time.perf_counter(), time.thread_time()
    for step in range(cfg.n_gen):
        m = 1 + step % n_par if cfg.alternate else n_par
        toks = np.array([(7 * step + 3 * s + 5) % n_vocab for s in range(m)], np.int32)
        b = Batch(token=toks, pos=pos[:m].copy(), seq_id=seqs[:m], logits=flags[:m])
        t1 = time.perf_counter()
        ctx.decode(b)
        spent += time.perf_counter() - t1
        pos[:m] += 1
    return time.perf_counter() - t0, spent, time.thread_time() - c0


def one_run(ctx: Context, session: LlamaSession | None, prompt: np.ndarray, cfg: Config, res: Result,
            quiet: float) -> None:
    """One run of each side, in turns: our prompt, llama.cpp's, our steps, llama.cpp's, each after ``quiet``
    seconds of sleep (the other side's OpenMP workers spin on for about 10 ms after its last graph: started at
    once, a turn would share the two CPUs with them).  The best figures are kept in ``res``, llama.cpp's steps'
    time over ours in ``res.pairs``."""
    time.sleep(quiet)
    our_prompt(ctx, prompt, cfg, res)
    theirs: dict = {}
    if session is not None:
        time.sleep(quiet)
        theirs = session.op({"op": "bench_prompt", "prompt": prompt.tolist(), "n_par": cfg.n_par})
    time.sleep(quiet)
    wall, spent, cpu = our_steps(ctx, len(prompt), cfg)
    res.cpu_s = min(res.cpu_s, cpu)
    if wall < res.gen_s:
        res.gen_s, res.decode_s = wall, spent
    if not ctx.cparams.no_perf and (not res.split or wall < res.split["wall"]):
        res.split = dict(ctx.times.as_dict(), wall=wall)
    if session is None:
        return
    time.sleep(quiet)
    theirs.update(session.op({"op": "bench_steps", "n_par": cfg.n_par, "n_prompt": len(prompt), "n": cfg.n_gen,
                              "alternate": cfg.alternate}))
    best = res.llama or {"prompt_s": float("inf"), "gen_s": float("inf"), "cpu_s": float("inf")}
    best["prompt_s"] = min(best["prompt_s"], theirs["prompt_s"])
    best["cpu_s"] = min(best["cpu_s"], theirs["cpu_s"])
    if theirs["gen_s"] < best["gen_s"]:
        best["gen_s"], best["decode_s"] = theirs["gen_s"], theirs["decode_s"]
    res.llama = best
    res.pairs.append(theirs["gen_s"] / wall)


def count_calls(ctx: Context, cfg: Config, res: Result, steps: int = 8) -> None:
    """C calls and struct reads per one-token-per-sequence step, after the timed runs (graph reused)."""
    seqs = np.arange(cfg.n_par, dtype=np.int32)
    pos = np.array([ctx.memory_seq_pos_max(s) + 1 for s in range(cfg.n_par)], np.int32)  # (--alternate: uneven)
    batches = [Batch(token=np.full(cfg.n_par, 7, np.int32), pos=pos + i,
                     seq_id=seqs, logits=np.ones(cfg.n_par, np.int8)) for i in range(steps)]
    ctx.decode(batches[0])
    with NativeCalls() as nc:
        for b in batches[1:]:
            ctx.decode(b)
    res.calls, res.reads = nc.total() / (steps - 1), nc.struct_reads / (steps - 1)


def run_config(model: Model, cfg: Config, a: argparse.Namespace, with_llama: bool, res: Result) -> None:
    """Both sides' best runs of one configuration in one fresh session each (our Context, llama.cpp's runner
    process), alternating; the best figures are kept in ``res``."""
    prompt = np.random.default_rng(0).integers(3, model.n_vocab, a.prompt).astype(np.int32)
    session = None
    if with_llama:
        session = LlamaSession(str(cfg.path), dict(cfg.params(), n_threads=cfg.threads),
                               None if cfg.reuse else {"LLAMA_GRAPH_REUSE_DISABLE": "1"})
    try:
        with Context(model, n_threads=cfg.threads, n_threads_batch=cfg.threads, graph_reuse=cfg.reuse,
                     **cfg.params()) as ctx:
            for _ in range(a.reps):
                one_run(ctx, session, prompt, cfg, res, a.quiet_ms / 1e3)
            count_calls(ctx, cfg, res)
        # the phase split from a context that times them (no_perf off: a few clock reads per step more than the
        # timed runs above, which run as llama.cpp's context does, without them)
        with Context(model, n_threads=cfg.threads, n_threads_batch=cfg.threads, no_perf=False,
                     graph_reuse=cfg.reuse, **cfg.params()) as ctx:
            scratch = Result()
            for _ in range(2):
                one_run(ctx, None, prompt, cfg, scratch, a.quiet_ms / 1e3)
            res.split = scratch.split
    finally:
        if session is not None:
            session.close()


def _ratio(o: float, t: float | None) -> str:
    return f"{t / o:7.2f}" if t else "      -"   # o, t are seconds: tokens/s ours / llama.cpp = t / o


def print_tables(rows: list[tuple[Config, Result]]) -> None:
    print(f"\n{'model':>5} {'seqs':>4} {'mode':>13} {'thr':>3} {'ours tok/s':>11} {'llama tok/s':>11} "
          f"{'ratio':>7} {'paired':>7} {'core':>7} {'cpu':>7} {'prompt':>7}")
    for cfg, r in rows:
        n_tok = cfg.n_tokens()
        ll = r.llama or {}
        print(f"{cfg.model:>5} {cfg.n_par:>4} {cfg.label:>13} {cfg.threads:>3} {n_tok / r.gen_s:11.0f} "
              f"{(n_tok / ll['gen_s']) if ll else 0:11.0f} {_ratio(r.gen_s, ll.get('gen_s'))} "
              f"{statistics.median(r.pairs) if r.pairs else float('nan'):7.2f} "
              f"{_ratio(r.decode_s, ll.get('decode_s'))} {_ratio(r.cpu_s, ll.get('cpu_s'))} "
              f"{_ratio(r.prompt_s, ll.get('prompt_s'))}")
    print("\nour host time per decode step (us), C calls and tensor struct reads per step:")
    print(f"{'':>24} " + " ".join(f"{c:>11}" for c in PHASES) + f" {'total':>9} {'reused':>8} {'calls':>6} "
          f"{'reads':>6}")
    for cfg, r in rows:
        sp = r.split
        vals = [sp[c] / cfg.n_gen * 1e6 for c in PHASES]
        print(f"{cfg.model + ' ' + str(cfg.n_par) + ' ' + cfg.label:>24} " + " ".join(f"{v:11.1f}" for v in vals)
              + f" {sum(vals):9.1f} {sp['n_graph_reused']:>4}/{sp['n_ubatch']:<3} {r.calls:6.1f} {r.reads:6.1f}")


def model_path(name: str, a: argparse.Namespace, tmp: Path) -> Path:
    given = getattr(a, name)
    if given:
        return Path(given)
    t0 = time.perf_counter()
    path = make_model(tmp / f"{name}.gguf", MODELS[name])
    print(f"({name} model made in {time.perf_counter() - t0:.1f} s)", flush=True)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,real", help="comma-separated: tiny, real")
    ap.add_argument("--tiny", help="use this GGUF as the tiny model")
    ap.add_argument("--real", help="use this GGUF as the real model")
    ap.add_argument("--n-par", default="1,4,8", help="comma-separated sequence counts")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated: {', '.join(MODES)}")
    ap.add_argument("--threads", type=int, default=1, help="threads of the tiny model")
    ap.add_argument("--real-threads", type=int, default=2, help="threads of the real model")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    ap.add_argument("--n-gen", type=int, default=192, help="decode steps (the real model: a quarter)")
    ap.add_argument("--quiet-ms", type=float, default=30.0,
                    help="sleep before each timed turn of either side, so that the other side's OpenMP workers, "
                         "which spin about 10 ms after a graph, have gone quiet (default 30)")
    ap.add_argument("--reps", type=int, default=3,
                    help="runs of each side per configuration and session (best kept)")
    ap.add_argument("--sessions", type=int, default=5,
                    help="fresh sessions of each side per configuration, in rounds over all configurations (a "
                         "process's speed varies from one to the next)")
    ap.add_argument("--no-pin", action="store_true",
                    help="leave both sides free to run on any CPU (by default they share the same THREADS CPUs)")
    ap.add_argument("--no-graph-reuse", action="store_true",
                    help="every step builds its graph on both sides (ours: graph_reuse=False; llama.cpp: "
                         "LLAMA_GRAPH_REUSE_DISABLE=1): the cost of a step that builds its graph, side by side")
    ap.add_argument("--alternate", action="store_true",
                    help="step k decodes sequences 0..k %% n_par only: the batch's shape changes every step, as in a "
                         "serving loop (llama.cpp then builds every step's graph; ours keeps a graph per shape)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    a = ap.parse_args(argv)
    G.set_log_level(3)  # warnings and errors only, as llama.cpp's side (not CPU_REPACK's line per tensor)
    why = llama_available()
    rows: list[tuple[Config, Result]] = []
    with tempfile.TemporaryDirectory(prefix="bench_runtime_") as tmp:
        for name in a.models.split(","):
            path = model_path(name, a, Path(tmp))
            threads = a.threads if name == "tiny" else a.real_threads
            n_gen = a.n_gen if name == "tiny" else max(4, a.n_gen // 4)
            pin(threads, a.no_pin)
            mine = [(Config(name, path, n_par, mode, threads, max(1024, 256 * n_par), n_gen, not a.no_graph_reuse,
                            a.alternate),
                     Result()) for n_par in (int(x) for x in a.n_par.split(",")) for mode in a.modes.split(",")]
            with Model(path) as m:
                # sessions outermost: a slow spell of the machine (they last a minute or so) then touches one
                # session of several configurations instead of every session of one
                for i in range(a.sessions):
                    for cfg, res in mine:
                        run_config(m, cfg, a, why is None, res)
                    print(f"  done: {name}, session {i + 1} of {a.sessions} of every configuration", flush=True)
            rows += mine
            print_tables(mine)
    if why:
        print(f"(llama.cpp not run: {why})")
    if a.json:
        a.json.write_text(json.dumps([{"model": c.model, "n_par": c.n_par, "mode": c.mode, "reuse": c.reuse,
                                       "threads": c.threads,
                                       "ours": {"prompt_s": r.prompt_s, "gen_s": r.gen_s, "decode_s": r.decode_s,
                                                "cpu_s": r.cpu_s, "split": r.split, "calls": r.calls,
                                                "reads": r.reads, "pairs": r.pairs},
                                       "llama": r.llama} for c, r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
