"""``python -m kvcache_ggml generate --model PATH --prompt TEXT``: text in, text out, streamed as it is generated.

The prompt is tokenized with the model's own vocabulary (BOS as the vocabulary asks, special tokens in the text
parsed), decoded once in sequence 0 and forked into ``--n-par`` sequences with ``seq_cp``; then every step decodes
one token per live sequence in one batch (:func:`~kvcache_ggml.runtime.parallel.fork_decode`).  Sampling is the
server's :class:`~kvcache_ggml.serve.sampling.Sampler`: greedy with ``--temp 0`` (the default), else ``--top-k``,
``--top-p``, ``--min-p`` and a draw at temperature ``--temp``; sequence s's generator is seeded with ``--seed`` + s,
so a seed gives the same text every run.  A sequence stops at an end-of-generation token or after ``--n-predict``
tokens.  Sequence 0's text is printed as it comes; with several sequences each one's text follows at the end.

Speculative decoding (``--model-draft PATH`` or ``--spec-ngram``, with ``--draft-max``, ``--draft-min`` and
``--draft-p-min``, as ``serve`` has them): the sequences run as requests of the serving engine (one prompt read once,
then shared through the prefix cache), each step verifying every sequence's draft in one batch; the text is the
same as without a draft (docs/serving.md, "Speculative decoding").
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

__all__ = ["main"]


def _args(argv: list[str]) -> argparse.Namespace:
    from .runtime.arch import supported_archs, unsupported_arch
    from .serve.speculative import add_spec_args, check_spec_args

    ap = argparse.ArgumentParser(prog="python -m kvcache_ggml generate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True,
                    help=f"a GGUF with a tokenizer ({', '.join(supported_archs())})")
    ap.add_argument("--prompt", required=True, help="the text to continue")
    ap.add_argument("--n-predict", type=int, default=64,
                    help="most tokens generated per sequence (default %(default)s)")
    ap.add_argument("--n-par", type=int, default=1, help="parallel sequences (default %(default)s)")
    ap.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 = greedy (default %(default)s)")
    ap.add_argument("--top-k", type=int, default=40, help="sample among the k best; 0 = all (default %(default)s)")
    ap.add_argument("--top-p", type=float, default=1.0,
                    help="sample among the most likely tokens holding this much probability (default %(default)s)")
    ap.add_argument("--min-p", type=float, default=0.0,
                    help="drop tokens less likely than min-p times the best one (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (default %(default)s)")
    ap.add_argument("--n-ctx", type=int, default=0, help="context size; 0 = the model's training context")
    ap.add_argument("--threads", type=int, default=4, help="CPU threads (default %(default)s)")
    ap.add_argument("--no-flash-attn", dest="flash_attn", action="store_false", help="mul_mat + soft_max attention")
    add_spec_args(ap)
    a = ap.parse_args(argv)
    check_spec_args(ap, a)
    for name in ("n_predict", "n_par", "threads"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.temp < 0 or a.n_ctx < 0 or a.top_k < 0:
        ap.error(f"--temp, --top-k and --n-ctx must be >= 0, got {a.temp}, {a.top_k} and {a.n_ctx}")
    if not (0 < a.top_p <= 1 and 0 <= a.min_p <= 1):
        ap.error(f"--top-p must be in (0, 1] and --min-p in [0, 1], got {a.top_p} and {a.min_p}")
    try:
        a.prompt.encode("utf-8")
    except UnicodeEncodeError as e:  # (bytes that are not UTF-8 come from argv as lone surrogates)
        ap.error(f"--prompt is not UTF-8 text: {a.prompt[e.start].encode('utf-8', 'surrogateescape')!r} at "
                 f"character {e.start}")
    if not a.model.is_file():
        ap.error(f"--model {a.model}: no such file")
    why = unsupported_arch(a.model)
    if why:
        ap.error(f"--model {a.model}: {why}")
    return a


def main(argv: list[str]) -> int:
    from . import ggml as G
    from .runtime.arch import load_model
    from .cparams import ContextParams
    from .runtime.context import Context
    from .runtime.memory import kv_memory_plan
    from .runtime.parallel import fork_decode
    from .runtime.tokenizer import StreamDecoder, Vocab
    from .serve.protocol import SamplingParams
    from .serve.sampling import Sampler

    a = _args(argv)
    G.set_log_level(3)
    out = sys.stdout
    with load_model(a.model) as model:
        vocab = Vocab.from_kv(model.gguf_kv, str(a.model))
        prompt = np.array(vocab.tokenize(a.prompt, add_special=True, parse_special=True), np.int32)
        spec = a.spec_ngram or a.model_draft is not None
        n_batch = max(len(prompt), a.n_par * (1 + a.draft_max if spec else 1))
        params = ContextParams(n_ctx=a.n_ctx, n_batch=n_batch, n_seq_max=a.n_par,
                               kv_unified=True, flash_attn=a.flash_attn, n_threads=a.threads,
                               n_threads_batch=a.threads)
        for line in kv_memory_plan(model, params).describe(params.type_k, params.type_v):
            print(f"[{line.strip()}]", file=sys.stderr)
        samplers = [Sampler(SamplingParams(temperature=a.temp, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
                                           seed=a.seed + s), model.n_vocab) for s in range(a.n_par)]
        how = ("greedy" if a.temp <= 0 else
               f"temp {a.temp} top-k {a.top_k} top-p {a.top_p} min-p {a.min_p} seed {a.seed}")
        with Context(model, params) as ctx:
            print(f"[{model.name}: {len(prompt)} prompt tokens, {a.n_par} sequence(s), n_ctx {ctx.n_ctx()}, {how}]",
                  file=sys.stderr)
            stream = StreamDecoder(vocab, skip_leading_space=False)
            out.write(a.prompt)
            out.flush()
            if spec:
                return _speculative(a, ctx, vocab, prompt, samplers, out)

            def show(seq: int, token: int) -> None:
                if seq == 0:
                    out.write(stream.push(token))
                    out.flush()

            run = fork_decode(ctx, prompt, samplers, a.n_predict, is_eog=vocab.is_eog, on_token=show)
            if run.stopped is not None:
                print(f"\n[stopped: {run.stopped}]", file=sys.stderr)
            out.write(stream.flush() + "\n")
            for s in range(1, a.n_par):
                out.write(f"--- sequence {s}: {a.prompt}{vocab.detokenize(run.tokens[s])}\n")
            n_tok = sum(len(g) for g in run.tokens)
            print(f"[prompt {len(prompt)} tokens in {run.t_prompt * 1e3:.0f} ms; generated {n_tok} tokens in "
                  f"{run.t_gen:.2f} s ({n_tok / max(run.t_gen, 1e-9):.1f} tokens/s, {run.n_steps} batched steps)]",
                  file=sys.stderr)
    return 0


def _speculative(a: argparse.Namespace, ctx, vocab, prompt: np.ndarray, samplers: list, out) -> int:
    """The sequences as requests of the serving engine with a drafter (the module docstring); the same output as
    :func:`main`'s own loop."""
    import time

    from .serve.engine import Engine, EngineParams
    from .serve.request import Job
    from .serve.speculative import close_drafter, open_drafter
    from .serve.text import TextStream

    drafter = open_drafter(a, ctx)
    try:
        eng = Engine(ctx, vocab, EngineParams(n_parallel=a.n_par, warmup=False, draft_max=a.draft_max,
                                              draft_min=a.draft_min), drafter=drafter)
        tokens: list[list[int]] = [[] for _ in range(a.n_par)]
        errors: list[str] = []

        def sink(s: int):
            def emit(ev) -> None:
                if ev.kind == "text":
                    tokens[s].extend(ev.tokens)
                    if s == 0:
                        out.write(ev.text)
                        out.flush()
                elif ev.kind == "error":
                    errors.append(f"sequence {s}: {ev.text}")
            return emit

        for s in range(a.n_par):
            eng.submit(Job(prompt, samplers[s], TextStream(vocab), sink(s), max_tokens=a.n_predict))
        t0 = time.perf_counter()
        eng.run_until_idle()
        dt = time.perf_counter() - t0
    finally:
        close_drafter(drafter)
    out.write("\n")
    for s in range(1, a.n_par):
        out.write(f"--- sequence {s}: {a.prompt}{vocab.detokenize(tokens[s])}\n")
    for e in errors:
        print(f"[error: {e}]", file=sys.stderr)
    st, n_tok = eng.stats, sum(len(t) for t in tokens)
    print(f"[generated {n_tok} tokens in {dt:.2f} s ({n_tok / max(dt, 1e-9):.1f} tokens/s, {st.steps} steps); "
          f"{st.drafts} drafts, {st.draft_accepted} of {st.draft_tokens} draft tokens accepted]", file=sys.stderr)
    return 1 if errors else 0
