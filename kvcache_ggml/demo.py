"""`python -m kvcache_ggml demo`: parallel greedy generation on the KV cache, llama.cpp style.

With no arguments a tiny random-weight llama model is written to a temporary folder (``--model PATH`` runs any
llama, Gemma 2 or Gemma 3 GGUF instead; a sliding-window model runs on the iSWA cache pair).  The run:

1. decodes a shared prompt once in sequence 0 and forks it into ``--n-par`` sequences with ``seq_cp``;
2. generates greedily in parallel, one token per sequence per step (sequence s starts from the (s+1)-th most
   likely first token, so the sequences differ);
3. when the cache has no room for the next step (decode returns 1, as llama_decode), applies llama.cpp's context
   shift to every sequence -- keep ``--n-keep`` positions, discard half of the rest (``seq_rm`` + ``seq_add``; the
   K-shift graph runs at the next decode) -- and goes on;
4. prints the cell maps ('.' empty, a sequence digit, 'M' shared) with each sequence's text beside them (token
   ids when the model has no usable tokenizer), tokens per second and the host time per step split into cache
   bookkeeping and graph work;
5. saves one sequence to a sequence state file and restores it into another slot, then checks like with like:
   the restored cells equal the source's byte for byte, and both give the same next-token logits up to the
   stated roundoff bound of summing the attention in another order
   (:func:`~kvcache_ggml.runtime.restore_check.restore_check`).

Steps 1-3 are :func:`~kvcache_ggml.runtime.parallel.fork_decode` with a greedy
:class:`~kvcache_ggml.serve.sampling.Sampler` per sequence; this module prints what they did.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["main"]


def _cell_maps(ctx, width: int = 128) -> list[str]:
    """The cache's cell map per stream (both caches of a sliding-window model), cut into lines of ``width`` cells."""
    from .cache import cell_map_text
    from .cache.iswa import KVCacheISWA
    lines = []
    caches = ([("base cache, ", ctx.kv.get_base()), ("SWA cache, ", ctx.kv.get_swa())]
              if isinstance(ctx.kv, KVCacheISWA) else [("", ctx.kv)])
    for title, kv in caches:
        for s, cells in enumerate(kv.v_cells):
            text = "".join(cell_map_text(cells).replace(" *", "").split("\n"))
            used = cells.get_used()
            head = f"  {title}" + (f"stream {s}: " if kv.n_stream > 1 else "") + f"{used}/{cells.size()} cells used"
            lines.append(head)
            lines += ["    " + text[i:i + width] for i in range(0, len(text), width)]
    return lines


def _print_map(title: str, ctx) -> None:
    print(f"cell map {title}:")
    for line in _cell_maps(ctx):
        print(line)


def _step_split(times, n_steps: int) -> str:
    if n_steps == 0:
        return "n/a"
    us = 1e6 / n_steps
    cache = times.batch + times.bookkeeping + times.update
    graph = times.build + times.inputs + times.compute
    return (f"{(cache + graph) * us:8.1f} us/step: cache bookkeeping {cache * us:7.1f} us "
            f"(batch split {times.batch * us:.1f}, slots and cells {times.bookkeeping * us:.1f}, "
            f"updates/K-shift {times.update * us:.1f}) | graph {graph * us:7.1f} us "
            f"(build {times.build * us:.1f}, inputs {times.inputs * us:.1f}, compute {times.compute * us:.1f}); "
            f"graphs reused {times.n_graph_reused}/{times.n_ubatch}")


@dataclass(slots=True)
class _Shift:
    """One context shift of every sequence."""

    step: int                  # batched steps decoded before it
    n_past: np.ndarray         # int32 cells each sequence held before it
    n_discard: np.ndarray      # int32 positions each sequence dropped


@dataclass(slots=True)
class _Shifter:
    """3. llama.cpp's context shift of every sequence when the cache is full: keep n_keep, discard half of the rest
    (``fork_decode``'s ``on_full``)."""

    ctx: Any                                  # the context
    n_keep: int                               # positions kept at the start of each sequence
    max_shifts: int                           # shifts allowed after the first one
    done: list[_Shift] = field(default_factory=list)       # the shifts applied, in order
    lines: list[str] = field(default_factory=list)         # what to print about them
    maps_before: list[str] | None = None      # the cell maps before the first shift

    def __call__(self, run: Any) -> np.ndarray | None:
        if self.done and len(self.done) >= self.max_shifts:
            return None
        if self.maps_before is None:
            self.maps_before = _cell_maps(self.ctx)
        n_discard = (run.n_past - self.n_keep) // 2
        for s, n in enumerate(n_discard.tolist()):
            self.ctx.context_shift(s, self.n_keep, n)
        self.done.append(_Shift(run.n_steps, run.n_past.copy(), n_discard))
        self.lines.append(f"step {run.n_steps}: the cache is full (decode returned 1): context shift of every "
                          f"sequence, keep {self.n_keep}, discard {int(n_discard[-1])} (last sequence), n_past -> "
                          f"{(run.n_past - n_discard).tolist()}")
        return n_discard

    def cached(self, prompt: np.ndarray, decoded: list[int], s: int) -> list[int]:
        """The ids sequence s's cache holds after decoding ``decoded`` (the shifts' discards taken out)."""
        held, shifts = [int(t) for t in prompt], iter(self.done)
        nxt = next(shifts, None)
        for k, tok in enumerate(decoded):
            while nxt is not None and nxt.step == k:
                del held[self.n_keep:self.n_keep + int(nxt.n_discard[s])]
                nxt = next(shifts, None)
            held.append(tok)
        return held

    def events(self, prompt: np.ndarray, decoded: list[int]) -> list[tuple]:
        """Sequence 0's decodes and shifts in order (what the numpy check replays)."""
        out: list[tuple] = [("decode", [int(t) for t in prompt])]
        shifts = iter(self.done)
        nxt = next(shifts, None)
        for k, tok in enumerate(decoded):
            while nxt is not None and nxt.step == k:
                out.append(("shift", self.n_keep, int(nxt.n_discard[0]), int(nxt.n_past[0])))
                nxt = next(shifts, None)
            out.append(("decode", [tok]))
        return out


def _vocab(model):
    """The model's tokenizer, or None when its vocabulary cannot be loaded (the tiny model's pieces are fine)."""
    from .runtime.tokenizer import Vocab
    try:
        return Vocab.from_kv(model.gguf_kv, str(model.path))
    except (ValueError, ImportError, KeyError):
        return None


def _prompt(args, model, vocab, rng) -> np.ndarray:
    """The shared prompt: the text's ids, else random ids (BOS first when the model has one)."""
    if args.prompt is not None and vocab is not None:
        return np.array(vocab.tokenize(args.prompt, add_special=True, parse_special=True), np.int32)
    lo = 3 if model.n_vocab > 3 else 0                  # skip <unk>, <s>, </s> of an SPM vocabulary
    prompt = rng.integers(lo, model.n_vocab, args.prompt_len).astype(np.int32)
    if model.bos_token_id >= 0:
        prompt[0] = model.bos_token_id
    return prompt


def _generate(args, model, ctx, prompt: np.ndarray, shifter: _Shifter):
    """1. the prompt forked into every sequence, 2. parallel greedy generation with 3. context shifts when the cache
    is full (fork_decode); sequence s starts from the (s+1)-th most likely first token."""
    from .runtime.parallel import fork_decode
    from .serve.protocol import SamplingParams
    from .serve.sampling import Sampler
    n_par = args.n_par
    if args.n_gen is None:  # enough steps to fill the cache, then 24 more on the shifted one
        room = ctx.kv.get_size() - len(prompt)
        args.n_gen = (room // n_par if ctx.kv.n_stream == 1 else room) + 24
    greedy = [Sampler(SamplingParams(temperature=0.0), model.n_vocab) for _ in range(n_par)]
    run = fork_decode(ctx, prompt, greedy, args.n_gen + 1, on_full=shifter,
                      first=lambda row: np.argsort(-row, kind="stable")[:n_par])
    if run.stopped is not None:
        raise run.stopped
    t = run.t_prompt
    print(f"prompt: {len(prompt)} tokens decoded in {t * 1e3:.1f} ms ({len(prompt) / t:.0f} "
          f"tokens/s), forked into {n_par} sequences with seq_cp")
    for line in shifter.lines:
        print(line)
    return run


def _report(args, ctx, run, shifter: _Shifter, vocab) -> None:
    """4. the cell maps, each sequence's text (or ids) beside them, the speed."""
    if shifter.maps_before is not None:
        print("cell map before the context shift:")
        for line in shifter.maps_before:
            print(line)
    n_shifts = len(shifter.done)
    _print_map("after generation" + (" (shifted)" if n_shifts else ""), ctx)
    for s in range(args.n_par):
        head = f"  seq {s}: pos {ctx.memory_seq_pos_min(s)}..{ctx.memory_seq_pos_max(s)} | "
        decoded = run.tokens[s][:-1]  # the last token was chosen, not decoded
        if vocab is not None:
            text = vocab.detokenize(decoded).replace("\n", "\\n")
            print(head + repr(text[:160] + ("..." if len(text) > 160 else "")))
        else:
            toks = " ".join(str(t) for t in decoded[:16])
            print(head + f"tokens {toks}{' ...' if len(decoded) > 16 else ''}")
    n_tok = args.n_par * run.n_steps
    print(f"generation: {n_tok} tokens ({run.n_steps} steps x {args.n_par} sequences) in {run.t_gen:.2f} s = "
          f"{n_tok / run.t_gen:.0f} tokens/s, {n_shifts} context shift(s)")
    print(f"host time per step: {_step_split(run.times, run.n_steps)}")


def _checks(args, model_path: Path, ctx, run, shifter: _Shifter) -> bool:
    """The shifted cache against a numpy re-encoding of the same tokens at their new positions (llama models), and
    5. one sequence saved and restored into another slot (two sequences or more)."""
    from .runtime.restore_check import restore_check
    ok_ref = True
    arch = ctx.model.hparams.arch
    if args.check and arch != "llama":
        print(f"numpy check: only for llama models, not {arch}")
    elif args.check:
        ok_ref = _check_reference(model_path, ctx, shifter.events(run.prompt, run.tokens[0][:-1]),
                                  int(run.n_past[0]), run.tokens[0][-1], (args.type_k, args.type_v))
    ok_restore = True
    if args.n_par >= 2:
        src, dst = 0, args.n_par - 1
        held = shifter.cached(run.prompt, run.tokens[src][:-1], src)
        rc = restore_check(ctx, src, dst, held, run.tokens[src][-1], args.flash_attn, args.type_v)
        _print_map(f"after saving seq {src} to a file and restoring it into seq {dst}", ctx)
        print(f"restore check: seq {dst}'s cells {'equal' if rc.same_cells else 'DIFFER from'} seq {src}'s "
              f"byte for byte, tokens {'match' if rc.same_tokens else 'DIFFER'}, next-token logits max rel "
              f"diff {rc.diff:.1e} (tolerance {rc.tol:.1e} = {rc.n_layer} layers x {rc.n_attended} cells x "
              f"the {'F16' if rc.f16_sum else 'F32'} roundoff of an attention sum whose order differs) -> "
              f"{'OK' if rc.ok else 'MISMATCH'}")
        ok_restore = rc.ok
    return ok_ref and ok_restore


def run(args: argparse.Namespace, model_path: Path) -> int:
    from . import ggml as G
    from .runtime.arch import load_model
    from .cparams import ContextParams
    from .runtime.context import Context
    from .runtime.memory import kv_memory_plan

    G.set_log_level(3)
    params = ContextParams(n_ctx=args.n_ctx, n_batch=max(args.n_ctx, args.prompt_len, 512), n_ubatch=512,
                           n_seq_max=args.n_par, kv_unified=args.unified, flash_attn=args.flash_attn,
                           type_k=args.type_k, type_v=args.type_v, n_threads=args.threads,
                           n_threads_batch=args.threads, swa_full=args.swa_full, no_perf=False)
    t_load = time.perf_counter()
    with load_model(model_path) as model:
        hp = model.hparams
        vocab = _vocab(model)
        print(f"model {model.name!r} ({model_path}): {hp.n_layer} layers, n_embd {hp.n_embd}, heads "
              f"{hp.n_head(0)}/{hp.n_head_kv(0)}, n_vocab {model.n_vocab}, {model.size_bytes() / 2**20:.2f} MiB "
              f"(loaded in {time.perf_counter() - t_load:.2f} s)")
        for line in kv_memory_plan(model, params).describe(args.type_k, args.type_v):
            print(line)
        with Context(model, params) as ctx:
            print(f"context: n_ctx {ctx.n_ctx()}, {ctx.kv.n_stream} stream(s) x {ctx.kv.get_size()} cells, "
                  f"{args.n_par} sequences, flash attention {'on' if args.flash_attn else 'off'}, "
                  f"{args.threads} thread(s)")
            prompt = _prompt(args, model, vocab, np.random.default_rng(args.seed))
            shifter = _Shifter(ctx, args.n_keep, args.max_shifts)
            gen = _generate(args, model, ctx, prompt, shifter)
            _report(args, ctx, gen, shifter, vocab)
            ok = _checks(args, model_path, ctx, gen, shifter)
    return 0 if ok else 1


def _check_reference(model_path: Path, ctx, events: list[tuple], n_past: int, nxt: int,
                     types: tuple[str, str]) -> bool:
    """Sequence 0's next logits against a float64 numpy cache that went through the same decodes and shifts."""
    from .batch import Batch
    from .runtime.reference import Reference
    got = ctx.decode(Batch(token=np.array([nxt], np.int32), pos=np.array([n_past], np.int32),
                           seq_id=np.array([0], np.int32)))[0]
    ctx.memory_seq_rm(0, n_past, -1)  # undo the probe
    ref = Reference(model_path).cache()
    n_shift = 0
    for ev in events:
        if ev[0] == "decode":
            ref.decode(ev[1])
        else:
            _, n_keep, n_discard, past = ev
            ref.seq_rm(n_keep, n_keep + n_discard)
            ref.seq_add(n_keep + n_discard, past, -n_discard)
            n_shift += 1
    want = ref.decode([nxt], [n_past])[-1]
    err = float(np.abs(got - want).max() / np.abs(want).max())
    tol = 1e-4 if types == ("f32", "f32") else 1e-2
    ok = err < tol
    print(f"numpy check: seq 0's next logits vs a float64 numpy cache replaying its {len(events)} decodes and "
          f"{n_shift} shift(s): max rel diff {err:.1e} (tolerance {tol:.0e} with K/V {types[0]}/{types[1]}) -> "
          f"{'OK' if ok else 'MISMATCH'}")
    return ok


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcache_ggml demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="a llama, gemma2 or gemma3 GGUF (default: a tiny random llama model "
                                               "in a temp dir)")
    ap.add_argument("--n-par", type=int, default=4, help="parallel sequences (default %(default)s)")
    ap.add_argument("--prompt-len", type=int, default=32, help="random prompt tokens (default %(default)s)")
    ap.add_argument("--prompt", help="the shared prompt as text (with a model that has a tokenizer)")
    ap.add_argument("--n-gen", type=int, help="generation steps (default: fill the cache, then 24 more)")
    ap.add_argument("--n-ctx", type=int, default=256, help="context size in cells (default %(default)s)")
    ap.add_argument("--n-keep", type=int, default=4, help="positions a context shift keeps (default %(default)s)")
    ap.add_argument("--max-shifts", type=int, default=1000, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=max(1, min(4, (os.cpu_count() or 2) // 2)),
                    help="CPU threads (default %(default)s)")
    ap.add_argument("--type-k", default="f16", help="K cache type (default %(default)s)")
    ap.add_argument("--type-v", default="f16", help="V cache type (default %(default)s)")
    ap.add_argument("--no-flash-attn", dest="flash_attn", action="store_false",
                    help="mul_mat + soft_max attention over a transposed V cache")
    ap.add_argument("--no-unified", dest="unified", action="store_false",
                    help="one cache stream per sequence (seq_cp copies streams)")
    ap.add_argument("--swa-full", action=argparse.BooleanOptionalAction, default=True,
                    help="sliding-window models: a full-size SWA cache (llama.cpp's default); --no-swa-full keeps "
                         "only the windows plus a ubatch")
    ap.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                    help="compare a shifted sequence with a numpy re-encoding (default: on for the tiny model)")
    ap.add_argument("--seed", type=int, default=0, help="prompt and tiny-model seed (default %(default)s)")
    args = ap.parse_args(argv)
    for name in ("n_par", "prompt_len", "n_gen", "n_ctx", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.n_keep < 0 or args.n_keep >= args.prompt_len:
        ap.error(f"--n-keep must be in [0, --prompt-len={args.prompt_len}), got {args.n_keep}")
    if args.check is None:
        args.check = args.model is None
    t0 = time.perf_counter()
    try:
        if args.model is not None:
            if not args.model.is_file():
                ap.error(f"--model {args.model}: no such file")
            rc = run(args, args.model)
        else:
            from .runtime.modelmaker import ModelSpec, make_model
            with tempfile.TemporaryDirectory(prefix="kvcache_demo_") as tmp:
                spec = ModelSpec(layers=4, embd=128, heads=8, heads_kv=4, ff=256, vocab=256, seed=args.seed)
                path = make_model(Path(tmp) / "tiny-llama.gguf", spec)
                rc = run(args, path)
    except Exception as e:  # a clear one-line failure for the CLI
        print(f"demo failed: {type(e).__name__}: {e}", file=sys.stderr)
        raise
    print(f"done in {time.perf_counter() - t0:.1f} s -> {'OK' if rc == 0 else 'FAILED'}")
    return rc
