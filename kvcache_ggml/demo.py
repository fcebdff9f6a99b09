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
   stated roundoff bound of summing the attention in another order (see :func:`restore_check`).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["main", "restore_check", "RestoreCheck", "same_sequence_state"]


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
class _State:
    """What the demo tracks while it runs."""

    prompt: np.ndarray                       # int32 shared prompt ids
    n_past: list[int]                        # next position per sequence
    history: list[list[int]]                 # ids each sequence's cache holds, in order
    generated: list[list[int]]               # ids generated per sequence
    events: list[tuple] = field(default_factory=list)  # sequence 0's decodes and shifts (the numpy check)
    nxt: np.ndarray | None = None            # int32 next id per sequence
    shifts: int = 0                          # context shifts applied
    maps_before: list[str] | None = None     # cell map before the first shift


@dataclass(slots=True)
class RestoreCheck:
    """Sequence src saved to a file and restored into dst: is dst the same sequence?"""

    same_cells: bool      # dst's state (cells in order, positions, K and V bytes) equals src's, byte for byte
    same_tokens: bool     # the file's tokens are src's
    diff: float           # max |logits(src) - logits(dst)| / max |logits(src)| for the same next token
    tol: float            # the bound on diff from the summation order alone (see restore_check)
    n_attended: int       # cells the probe attends to
    n_layer: int          # attention layers the difference goes through
    f16_sum: bool         # the attention sums V in F16 (flash attention over an F16 V), else in F32

    @property
    def ok(self) -> bool:
        return self.same_cells and self.same_tokens and self.diff <= self.tol


def restore_check(ctx, src: int, dst: int, history: list[int], probe: int, flash_attn: bool, type_v: str,
                  corrupt=None) -> RestoreCheck:
    """Save sequence src to a file, restore it into dst, compare like with like.

    The cells, exactly: dst's state must equal src's as it was saved, byte for byte (the same cells in the same
    order, positions, K and V rows; :func:`same_sequence_state`; the state src has afterwards may be smaller: a
    sliding-window cache reuses cells outside every window, src's too, when it places dst's).  The logits of the same next token in both, within a stated
    bound: dst's cells sit elsewhere in the cache, so the probe's own new cell lands at another place among them
    and the attention adds the same terms in another order.  With an F16 V and flash attention the CPU kernel
    accumulates V in F16 (unit roundoff u = 2^-11), otherwise in F32 (u = 2^-24).  Reordering a sum of n terms
    moves it by at most about n*u of its magnitude (first order), in each of the n_layer attention layers, and the
    residual stream adds the layers' perturbations: tol = n_layer * n_attended * u.  That is a worst-case bound
    (seen: 3e-2 against 0.25 for 8 layers and 64 cells in F16; 0 or ~1e-7 with F32 sums); the exact part of the
    check is the cells.  ``corrupt(ctx, dst)`` (tests) may damage dst after the restore.
    """
    from .batch import Batch
    saved = ctx.state_seq_get_data(src)
    with tempfile.TemporaryDirectory(prefix="kvcache_demo_") as tmp:
        f = Path(tmp) / f"seq{src}.bin"
        ctx.state_seq_save_file(f, src, history)
        ctx.memory_seq_rm(dst, -1, -1)
        tokens = ctx.state_seq_load_file(f, dst)
    if corrupt is not None:
        corrupt(ctx, dst)
    same_cells = same_sequence_state(saved, ctx.state_seq_get_data(dst))
    pos = ctx.memory_seq_pos_max(src) + 1
    n_attended = pos - _full_attention_cache(ctx.kv).seq_pos_min(src) + 1
    out = ctx.decode(Batch(token=np.array([probe, probe], np.int32), pos=np.array([pos, pos], np.int32),
                           seq_id=np.array([src, dst], np.int32), logits=np.ones(2, np.int8)))
    for s in (src, dst):
        ctx.memory_seq_rm(s, pos, -1)  # undo the probe
    diff = float(np.abs(out[0] - out[1]).max() / max(np.abs(out[0]).max(), 1e-30))
    f16_sum = flash_attn and type_v != "f32"
    n_layer = ctx.model.hparams.n_layer
    tol = n_layer * n_attended * (2.0 ** -11 if f16_sum else 2.0 ** -24)
    return RestoreCheck(same_cells, tokens.tolist() == list(history), diff, tol, n_attended, n_layer, f16_sum)


def _full_attention_cache(kv):
    """The cache the full-attention layers read: the iSWA pair's base cache (whose positions of a sequence are a
    superset of the SWA cache's), else the cache itself."""
    from .cache.iswa import KVCacheISWA
    return kv.get_base() if isinstance(kv, KVCacheISWA) else kv


def same_sequence_state(a: bytes, b: bytes) -> bool:
    """Two sequence state blobs hold the same cells: same order, positions and K/V bytes (the sequence ids and the
    stream, which a single-sequence blob also records, may differ).  A blob of a sliding-window model is the base
    cache's state followed by the SWA cache's: every cache's part is compared."""
    from .cache.state.files import parse_state

    def content(blob: bytes) -> list:
        out, rest = [], memoryview(blob)
        while True:  # one cache's state per pass (two for the iSWA pair)
            info = parse_state(rest)
            for st, sd in zip(info.streams, info.to_dict()["streams"]):
                if not st.cell_count:
                    continue
                cells = [(c["pos"], c["n_cells"]) for c in sd["cells"]]
                data = [bytes(rest[o:o + n]) for L in st.layers
                        for o, n in ((L.k_offset, L.k_nbytes), (L.v_offset, L.v_nbytes))]
                layers = [{k: v for k, v in ld.items() if "offset" not in k} for ld in sd["layers"]]
                out.append((cells, sd["v_trans"], layers, data))
            out.append("end of a cache's state")
            if not info.trailing:
                return out
            rest = rest[len(rest) - info.trailing:]

    return content(a) == content(b)


def _vocab(model):
    """The model's tokenizer, or None when its vocabulary cannot be loaded (the tiny model's pieces are fine)."""
    from .runtime.tokenizer import Vocab
    try:
        return Vocab.from_kv(model.gguf_kv, str(model.path))
    except (ValueError, ImportError, KeyError):
        return None


def _start(args, model, ctx, vocab, rng) -> _State:
    """1. the shared prompt, once, in sequence 0, forked into every sequence."""
    from .batch import Batch
    if args.prompt is not None and vocab is not None:
        prompt = np.array(vocab.tokenize(args.prompt, add_special=True, parse_special=True), np.int32)
    else:
        lo = 3 if model.n_vocab > 3 else 0                  # skip <unk>, <s>, </s> of an SPM vocabulary
        prompt = rng.integers(lo, model.n_vocab, args.prompt_len).astype(np.int32)
        if model.bos_token_id >= 0:
            prompt[0] = model.bos_token_id
    t0 = time.perf_counter()
    logits = ctx.decode(Batch(token=prompt, pos=np.arange(len(prompt), dtype=np.int32)))
    t_prompt = time.perf_counter() - t0
    for s in range(1, args.n_par):
        ctx.memory_seq_cp(0, s, -1, -1)
    st = _State(prompt, [len(prompt)] * args.n_par, [list(prompt) for _ in range(args.n_par)],
                [[] for _ in range(args.n_par)], [("decode", prompt.tolist())])
    st.nxt = np.argsort(-logits[-1], kind="stable")[:args.n_par].astype(np.int32)  # seq s: the (s+1)-th best
    print(f"prompt: {len(prompt)} tokens decoded in {t_prompt * 1e3:.1f} ms ({len(prompt) / t_prompt:.0f} "
          f"tokens/s), forked into {args.n_par} sequences with seq_cp")
    return st


def _shift_all(args, ctx, st: _State, step: int) -> None:
    """3. llama.cpp's context shift of every sequence: keep n_keep, discard half of the rest."""
    st.maps_before = _cell_maps(ctx) if st.maps_before is None else st.maps_before
    for s in range(args.n_par):
        n_discard = (st.n_past[s] - args.n_keep) // 2
        ctx.context_shift(s, args.n_keep, n_discard)
        if s == 0:
            st.events.append(("shift", args.n_keep, n_discard, st.n_past[0]))
        del st.history[s][args.n_keep:args.n_keep + n_discard]
        st.n_past[s] -= n_discard
    st.shifts += 1
    print(f"step {step}: the cache is full (decode returned 1): context shift of every sequence, keep "
          f"{args.n_keep}, discard {n_discard} (last sequence), n_past -> {st.n_past}")


def _generate(args, ctx, st: _State) -> float:
    """2. parallel greedy generation, with 3. context shifts when the cache is full; the seconds it took."""
    from .batch import Batch
    from .runtime.context import DecodeError
    n_par = args.n_par
    if args.n_gen is None:  # enough steps to fill the cache, then 24 more on the shifted one
        room = ctx.kv.get_size() - len(st.prompt)
        args.n_gen = (room // n_par if ctx.kv.n_stream == 1 else room) + 24
    ctx.times.reset()
    t0 = time.perf_counter()
    step = 0
    while step < args.n_gen:
        batch = Batch(token=st.nxt, pos=np.array(st.n_past, np.int32), seq_id=np.arange(n_par, dtype=np.int32),
                      logits=np.ones(n_par, np.int8))
        try:
            logits = ctx.decode(batch)
        except DecodeError as e:
            if e.code != 1 or (st.maps_before is not None and st.shifts >= args.max_shifts):
                raise
            _shift_all(args, ctx, st, step)
            continue
        st.events.append(("decode", [int(st.nxt[0])]))
        for s in range(n_par):
            st.history[s].append(int(st.nxt[s]))
            st.generated[s].append(int(st.nxt[s]))
            st.n_past[s] += 1
        st.nxt = np.argmax(logits, axis=1).astype(np.int32)
        step += 1
    return time.perf_counter() - t0


def _report(args, ctx, st: _State, vocab, t_gen: float) -> None:
    """4. the cell maps, each sequence's text (or ids) beside them, the speed."""
    if st.maps_before is not None:
        print("cell map before the context shift:")
        for line in st.maps_before:
            print(line)
    _print_map("after generation" + (" (shifted)" if st.shifts else ""), ctx)
    for s in range(args.n_par):
        head = f"  seq {s}: pos {ctx.memory_seq_pos_min(s)}..{ctx.memory_seq_pos_max(s)} | "
        if vocab is not None:
            text = vocab.detokenize(st.generated[s]).replace("\n", "\\n")
            print(head + repr(text[:160] + ("..." if len(text) > 160 else "")))
        else:
            toks = " ".join(str(t) for t in st.generated[s][:16])
            print(head + f"tokens {toks}{' ...' if len(st.generated[s]) > 16 else ''}")
    n_tok = args.n_par * args.n_gen
    print(f"generation: {n_tok} tokens ({args.n_gen} steps x {args.n_par} sequences) in {t_gen:.2f} s = "
          f"{n_tok / t_gen:.0f} tokens/s, {st.shifts} context shift(s)")
    print(f"host time per step: {_step_split(ctx.times, args.n_gen)}")


def run(args: argparse.Namespace, model_path: Path) -> int:
    from . import ggml as G
    from .runtime.arch import load_model
    from .runtime.context import Context, RuntimeParams
    from .runtime.memory import kv_memory_plan

    G.set_log_level(3)
    params = RuntimeParams(n_ctx=args.n_ctx, n_batch=max(args.n_ctx, args.prompt_len, 512), n_ubatch=512,
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
            st = _start(args, model, ctx, vocab, np.random.default_rng(args.seed))
            _report(args, ctx, st, vocab, _generate(args, ctx, st))
            # the shifted cache against a numpy re-encoding of the same tokens at their new positions
            ok_ref = True
            if args.check and hp.arch != "llama":
                print(f"numpy check: only for llama models, not {hp.arch}")
            elif args.check:
                ok_ref = _check_reference(model_path, ctx, st.events, st.n_past[0], int(st.nxt[0]),
                                          (args.type_k, args.type_v))
            ok_restore = True
            if args.n_par >= 2:  # 5. save one sequence, restore it into another slot
                src, dst = 0, args.n_par - 1
                rc = restore_check(ctx, src, dst, st.history[src], int(st.nxt[src]), args.flash_attn, args.type_v)
                _print_map(f"after saving seq {src} to a file and restoring it into seq {dst}", ctx)
                print(f"restore check: seq {dst}'s cells {'equal' if rc.same_cells else 'DIFFER from'} seq {src}'s "
                      f"byte for byte, tokens {'match' if rc.same_tokens else 'DIFFER'}, next-token logits max rel "
                      f"diff {rc.diff:.1e} (tolerance {rc.tol:.1e} = {rc.n_layer} layers x {rc.n_attended} cells x "
                      f"the {'F16' if rc.f16_sum else 'F32'} roundoff of an attention sum whose order differs) -> "
                      f"{'OK' if rc.ok else 'MISMATCH'}")
                ok_restore = rc.ok
    return 0 if ok_restore and ok_ref else 1


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
                path = make_model(Path(tmp) / "tiny-llama.gguf",
                                  ModelSpec(layers=4, embd=128, heads=8, heads_kv=4, ff=256, vocab=256, seed=args.seed))
                rc = run(args, path)
    except Exception as e:  # a clear one-line failure for the CLI
        print(f"demo failed: {type(e).__name__}: {e}", file=sys.stderr)
        raise
    print(f"done in {time.perf_counter() - t0:.1f} s -> {'OK' if rc == 0 else 'FAILED'}")
    return rc
