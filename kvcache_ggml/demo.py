"""`python -m kvcache_ggml demo`: parallel greedy generation on the KV cache, llama.cpp style.

With no arguments a tiny random-weight llama model is written to a temporary folder (``--model PATH`` runs any
llama, Gemma 2 or Gemma 3 GGUF instead; a sliding-window model runs on the iSWA cache pair).  The run:

1. decodes a shared prompt once in sequence 0 and forks it into ``--n-par`` sequences with ``seq_cp``;
2. generates greedily in parallel, one token per sequence per step (sequence s starts from the (s+1)-th most
   likely first token, so the sequences differ);
3. when the cache has no room for the next step (decode returns 1, as llama_decode), applies llama.cpp's context
   shift to every sequence -- keep ``--n-keep`` positions, discard half of the rest (``seq_rm`` + ``seq_add``; the
   K-shift graph runs at the next decode) -- and goes on;
4. saves one sequence to a sequence state file and restores it into another slot, then checks that both give the
   same next-token logits;
5. prints the cell maps ('.' empty, a sequence digit, 'M' shared), tokens per second and the host time per step
   split into cache bookkeeping and graph work.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

__all__ = ["main"]


def _cell_maps(ctx, width: int = 128) -> list[str]:
    """The cache's cell map per stream (both caches of a sliding-window model), cut into lines of ``width`` cells."""
    from .cache import cell_map_text
    from .iswa import KVCacheISWA
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


def run(args: argparse.Namespace, model_path: Path) -> int:
    from .batch import Batch
    from .runtime.arch import load_model
    from .runtime.context import Context, DecodeError, RuntimeParams

    n_par = args.n_par
    rng = np.random.default_rng(args.seed)
    params = RuntimeParams(n_ctx=args.n_ctx, n_batch=max(args.n_ctx, args.prompt_len), n_ubatch=512,
                           n_seq_max=n_par, kv_unified=args.unified, flash_attn=args.flash_attn,
                           type_k=args.type_k, type_v=args.type_v, n_threads=args.threads,
                           n_threads_batch=args.threads, swa_full=args.swa_full)
    t_load = time.perf_counter()
    with load_model(model_path) as model, Context(model, params) as ctx:
        hp = model.hparams
        t_load = time.perf_counter() - t_load
        print(f"model {model.name!r} ({model_path}): {hp.n_layer} layers, n_embd {hp.n_embd}, heads "
              f"{hp.n_head(0)}/{hp.n_head_kv(0)}, n_vocab {model.n_vocab}, {model.size_bytes() / 2**20:.2f} MiB "
              f"(loaded in {t_load:.2f} s)")
        print(f"context: n_ctx {ctx.n_ctx()}, {ctx.kv.n_stream} stream(s) x {ctx.kv.get_size()} cells, "
              f"{n_par} sequences, K {args.type_k} / V {args.type_v}, flash attention "
              f"{'on' if args.flash_attn else 'off'}, {args.threads} thread(s)")

        # 1. the shared prompt, once, in sequence 0
        lo = 3 if model.n_vocab > 3 else 0                     # skip <unk>, <s>, </s> of an SPM vocabulary
        prompt = rng.integers(lo, model.n_vocab, args.prompt_len).astype(np.int32)
        if model.bos_token_id >= 0:
            prompt[0] = model.bos_token_id
        t0 = time.perf_counter()
        logits = ctx.decode(Batch(token=prompt, pos=np.arange(len(prompt), dtype=np.int32)))
        t_prompt = time.perf_counter() - t0
        for s in range(1, n_par):
            ctx.memory_seq_cp(0, s, -1, -1)
        first = np.argsort(-logits[-1], kind="stable")[:n_par]     # sequence s starts with the (s+1)-th best token
        n_past = [len(prompt)] * n_par
        history = [list(prompt) for _ in range(n_par)]            # tokens each sequence's cache holds, in order
        generated: list[list[int]] = [[] for _ in range(n_par)]
        events: list[tuple] = [("decode", prompt.tolist())]      # what happened to sequence 0, for the numpy check
        nxt = first.astype(np.int32)
        print(f"prompt: {len(prompt)} tokens decoded in {t_prompt * 1e3:.1f} ms "
              f"({len(prompt) / t_prompt:.0f} tokens/s), forked into {n_par} sequences with seq_cp")

        # 2. parallel greedy generation, with 3. context shifts when the cache is full
        if args.n_gen is None:  # enough steps to fill the cache, then 24 more on the shifted one
            room = ctx.kv.get_size() - len(prompt)
            args.n_gen = (room // n_par if ctx.kv.n_stream == 1 else room) + 24
        ctx.times.reset()
        shifts = 0
        maps_before: list[str] | None = None
        t0 = time.perf_counter()
        step = 0
        while step < args.n_gen:
            batch = Batch(token=nxt, pos=np.array(n_past, np.int32), seq_id=np.arange(n_par, dtype=np.int32),
                          logits=np.ones(n_par, np.int8))
            try:
                logits = ctx.decode(batch)
            except DecodeError as e:
                if e.code != 1:
                    raise
                if maps_before is not None and shifts >= args.max_shifts:
                    raise
                maps_before = _cell_maps(ctx)
                for s in range(n_par):
                    n_discard = (n_past[s] - args.n_keep) // 2
                    ctx.context_shift(s, args.n_keep, n_discard)
                    if s == 0:
                        events.append(("shift", args.n_keep, n_discard, n_past[0]))
                    del history[s][args.n_keep:args.n_keep + n_discard]
                    n_past[s] -= n_discard
                shifts += 1
                print(f"step {step}: the cache is full (decode returned 1): context shift of every sequence, "
                      f"keep {args.n_keep}, discard {n_discard} (last sequence), n_past -> {n_past}")
                continue
            events.append(("decode", [int(nxt[0])]))
            for s in range(n_par):
                history[s].append(int(nxt[s]))
                generated[s].append(int(nxt[s]))
                n_past[s] += 1
            nxt = np.argmax(logits, axis=1).astype(np.int32)
            step += 1
        t_gen = time.perf_counter() - t0
        times = ctx.times
        n_tok = n_par * args.n_gen
        if maps_before is not None:
            print("cell map before the context shift:")
            for line in maps_before:
                print(line)
        _print_map("after generation" + (" (shifted)" if shifts else ""), ctx)
        for s in range(n_par):
            toks = " ".join(str(t) for t in generated[s][:16])
            print(f"  seq {s}: pos_min {ctx.memory_seq_pos_min(s)}, pos_max {ctx.memory_seq_pos_max(s)}, "
                  f"tokens {toks}{' ...' if len(generated[s]) > 16 else ''}")
        print(f"generation: {n_tok} tokens ({args.n_gen} steps x {n_par} sequences) in {t_gen:.2f} s = "
              f"{n_tok / t_gen:.0f} tokens/s, {shifts} context shift(s)")
        print(f"host time per step: {_step_split(times, args.n_gen)}")

        # the shifted cache against a numpy re-encoding of the same tokens at their new positions
        ok_ref = True
        if args.check and hp.arch != "llama":
            print(f"numpy check: only for llama models, not {hp.arch}")
        elif args.check:
            ok_ref = _check_reference(model_path, ctx, events, n_past[0], int(nxt[0]), (args.type_k, args.type_v))

        # 4. save one sequence and restore it into another slot
        same = True
        if n_par >= 2:
            src, dst = 0, n_par - 1
            with tempfile.TemporaryDirectory(prefix="kvcache_demo_") as tmp:
                f = Path(tmp) / f"seq{src}.bin"
                size = ctx.state_seq_save_file(f, src, history[src])
                ctx.memory_seq_rm(dst, -1, -1)
                tokens = ctx.state_seq_load_file(f, dst)
            ok_tokens = tokens.tolist() == history[src]
            probe = np.array([nxt[src], nxt[src]], np.int32)
            pos = np.array([n_past[src], n_past[src]], np.int32)
            out = ctx.decode(Batch(token=probe, pos=pos, seq_id=np.array([src, dst], np.int32),
                                   logits=np.ones(2, np.int8)))
            diff = float(np.abs(out[0] - out[1]).max() / max(np.abs(out[0]).max(), 1e-30))
            # the same values in other cells: only the summation order differs (F16 V accumulates in F16)
            same = diff < (1e-5 if args.type_v == "f32" else 5e-3) and ok_tokens
            _print_map(f"after saving seq {src} ({size} bytes) to a file and restoring it into seq {dst}", ctx)
            print(f"restore check: seq {dst} gives seq {src}'s next-token logits (max rel diff {diff:.1e}), "
                  f"tokens {'match' if ok_tokens else 'DIFFER'} -> {'OK' if same else 'MISMATCH'}")
    return 0 if same and ok_ref else 1


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
    ap.add_argument("--prompt-len", type=int, default=32, help="shared prompt tokens (default %(default)s)")
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
                path = make_model(Path(tmp) / "tiny-llama.gguf",
                                  ModelSpec(layers=4, embd=128, heads=8, heads_kv=4, ff=256, vocab=256, seed=args.seed))
                rc = run(args, path)
    except Exception as e:  # a clear one-line failure for the CLI
        print(f"demo failed: {type(e).__name__}: {e}", file=sys.stderr)
        raise
    print(f"done in {time.perf_counter() - t0:.1f} s -> {'OK' if rc == 0 else 'FAILED'}")
    return rc
