"""``python -m kvcache_ggml generate --model PATH --prompt TEXT``: text in, text out, streamed as it is generated.

The prompt is tokenized with the model's own vocabulary (BOS as the vocabulary asks, special tokens in the text
parsed), decoded once in sequence 0 and forked into ``--n-par`` sequences with ``seq_cp``; then every step decodes
one token per live sequence in one batch.  Sampling: greedy with ``--temp 0`` (the default), else a draw from
softmax(logits / temp) restricted to the ``--top-k`` best, with a seeded generator (``--seed``).  A sequence stops at
an end-of-generation token or after ``--n-predict`` tokens.  Sequence 0's text is printed as it comes; with several
sequences each one's text follows at the end.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["main", "sample", "SamplerParams"]


@dataclass(slots=True)
class SamplerParams:
    """How the next token is chosen."""

    temp: float = 0.0     # 0: greedy (argmax); > 0: sample from softmax(logits / temp)
    top_k: int = 40       # sample among the top_k best tokens only (0: all)
    seed: int = 0         # seed of the generator


def sample(logits: np.ndarray, sp: SamplerParams, rng: np.random.Generator) -> np.ndarray:
    """One token id per row of logits [n, n_vocab] (int32 [n])."""
    if sp.temp <= 0:
        return np.argmax(logits, axis=1).astype(np.int32)
    out = np.empty(len(logits), np.int32)
    for r, row in enumerate(logits):
        k = row.size if sp.top_k <= 0 else min(sp.top_k, row.size)
        cand = np.argpartition(-row, k - 1)[:k] if k < row.size else np.arange(row.size)
        z = row[cand].astype(np.float64) / sp.temp
        p = np.exp(z - z.max())
        out[r] = cand[rng.choice(k, p=p / p.sum())]
    return out


def _args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m kvcache_ggml generate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="a llama, gemma2 or gemma3 GGUF with a tokenizer")
    ap.add_argument("--prompt", required=True, help="the text to continue")
    ap.add_argument("--n-predict", type=int, default=64,
                    help="most tokens generated per sequence (default %(default)s)")
    ap.add_argument("--n-par", type=int, default=1, help="parallel sequences (default %(default)s)")
    ap.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 = greedy (default %(default)s)")
    ap.add_argument("--top-k", type=int, default=40, help="sample among the k best (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (default %(default)s)")
    ap.add_argument("--n-ctx", type=int, default=0, help="context size; 0 = the model's training context")
    ap.add_argument("--threads", type=int, default=4, help="CPU threads (default %(default)s)")
    ap.add_argument("--no-flash-attn", dest="flash_attn", action="store_false", help="mul_mat + soft_max attention")
    a = ap.parse_args(argv)
    for name in ("n_predict", "n_par", "threads"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.temp < 0 or a.n_ctx < 0:
        ap.error("--temp and --n-ctx must be >= 0")
    if not a.model.is_file():
        ap.error(f"--model {a.model}: no such file")
    return a


def main(argv: list[str]) -> int:
    from .batch import Batch
    from .runtime.context import Context, DecodeError, RuntimeParams
    from .runtime.arch import load_model
    from .runtime.memory import kv_memory_plan
    from .runtime.tokenizer import StreamDecoder, Vocab

    from . import ggml as G

    a = _args(argv)
    G.set_log_level(3)
    out = sys.stdout
    with load_model(a.model) as model:
        vocab = Vocab.from_kv(model.gguf_kv, str(a.model))
        prompt = np.array(vocab.tokenize(a.prompt, add_special=True, parse_special=True), np.int32)
        params = RuntimeParams(n_ctx=a.n_ctx, n_batch=max(len(prompt), a.n_par), n_seq_max=a.n_par,
                               kv_unified=True, flash_attn=a.flash_attn, n_threads=a.threads,
                               n_threads_batch=a.threads)
        for line in kv_memory_plan(model, params).describe(params.type_k, params.type_v):
            print(f"[{line.strip()}]", file=sys.stderr)
        with Context(model, params) as ctx:
            print(f"[{model.name}: {len(prompt)} prompt tokens, {a.n_par} sequence(s), n_ctx {ctx.n_ctx()}, "
                  f"{'greedy' if a.temp <= 0 else f'temp {a.temp} top-k {a.top_k} seed {a.seed}'}]", file=sys.stderr)
            t0 = time.perf_counter()
            logits = ctx.decode(Batch(token=prompt, pos=np.arange(len(prompt), dtype=np.int32)))[-1:]
            t_prompt = time.perf_counter() - t0
            for s in range(1, a.n_par):
                ctx.memory_seq_cp(0, s, -1, -1)
            rng = np.random.default_rng(a.seed)
            sp = SamplerParams(a.temp, a.top_k, a.seed)
            nxt = sample(np.repeat(logits, a.n_par, axis=0), sp, rng)
            gen: list[list[int]] = [[] for _ in range(a.n_par)]
            live = np.ones(a.n_par, bool)
            stream = StreamDecoder(vocab, skip_leading_space=False)
            out.write(a.prompt)
            out.flush()
            t0 = time.perf_counter()
            n_steps = 0
            while live.any():
                seqs = np.flatnonzero(live).astype(np.int32)
                for i, s in enumerate(seqs):
                    gen[s].append(int(nxt[i]))
                    if s == 0:
                        out.write(stream.push(int(nxt[i])))
                        out.flush()
                done = np.array([vocab.is_eog(gen[s][-1]) or len(gen[s]) >= a.n_predict for s in seqs])
                live[seqs[done]] = False
                seqs = seqs[~done]
                if not len(seqs):
                    break
                pos = np.array([len(prompt) + len(gen[s]) - 1 for s in seqs], np.int32)
                try:
                    logits = ctx.decode(Batch(token=np.array([gen[s][-1] for s in seqs], np.int32), pos=pos,
                                              seq_id=seqs, logits=np.ones(len(seqs), np.int8)))
                except DecodeError as e:
                    print(f"\n[stopped: {e}]", file=sys.stderr)
                    break
                nxt = sample(logits, sp, rng)
                n_steps += 1
            out.write(stream.flush() + "\n")
            t_gen = time.perf_counter() - t0
            for s in range(1, a.n_par):
                out.write(f"--- sequence {s}: {a.prompt}{vocab.detokenize(gen[s])}\n")
            n_tok = sum(len(g) for g in gen)
            print(f"[prompt {len(prompt)} tokens in {t_prompt * 1e3:.0f} ms; generated {n_tok} tokens in "
                  f"{t_gen:.2f} s ({n_tok / max(t_gen, 1e-9):.1f} tokens/s, {n_steps} batched steps)]",
                  file=sys.stderr)
    return 0
