"""``python -m kvcache_ggml generate --model PATH --prompt TEXT``: text in, text out, streamed as it is generated.

The prompt is tokenized with the model's own vocabulary (BOS as the vocabulary asks, special tokens in the text
parsed), decoded once in sequence 0 and forked into ``--n-par`` sequences with ``seq_cp``; then every step decodes
one token per live sequence in one batch (:func:`~kvcache_ggml.runtime.parallel.fork_decode`).  Sampling is the
server's :class:`~kvcache_ggml.serve.sampling.Sampler`: greedy with ``--temp 0`` (the default), else ``--top-k``,
``--top-p``, ``--min-p`` and a draw at temperature ``--temp``; sequence s's generator is seeded with ``--seed`` + s,
so a seed gives the same text every run.  A sequence stops at an end-of-generation token or after ``--n-predict``
tokens.  Sequence 0's text is printed as it comes; with several sequences each one's text follows at the end.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

__all__ = ["main"]


def _args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m kvcache_ggml generate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="a llama, gemma2 or gemma3 GGUF with a tokenizer")
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
    a = ap.parse_args(argv)
    for name in ("n_predict", "n_par", "threads"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.temp < 0 or a.n_ctx < 0 or a.top_k < 0:
        ap.error(f"--temp, --top-k and --n-ctx must be >= 0, got {a.temp}, {a.top_k} and {a.n_ctx}")
    if not (0 < a.top_p <= 1 and 0 <= a.min_p <= 1):
        ap.error(f"--top-p must be in (0, 1] and --min-p in [0, 1], got {a.top_p} and {a.min_p}")
    if not a.model.is_file():
        ap.error(f"--model {a.model}: no such file")
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
        params = ContextParams(n_ctx=a.n_ctx, n_batch=max(len(prompt), a.n_par), n_seq_max=a.n_par,
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
