#!/usr/bin/env python3
"""Check the trained tiny llama of ``scripts/train_tiny_llama.py`` on our runtime and on llama.cpp, and print what
each generates.

1. **Export.**  The trained model's own float64 logits on a probe text (``probe.npz``, written by the training
   script from the exported weights) against our float64 numpy reference and our runtime (F32 cache, plain
   attention) on ``tiny-llama-f32.gguf``: proves the tensor names, layouts, RoPE mode and tied head.
2. **Text.**  For each prompt, greedy generation by our runtime (``python -m kvcache_ggml generate``'s defaults:
   flash attention, F16 cache; then again with plain attention) and by llama.cpp's own greedy sampler
   (llama-cpp-python 0.3.17, ``llama_runner``'s ``generate`` op) on the same file with the same settings: the
   token ids must be equal, the logits of every step are compared (bit for bit is what docs/exactness.md
   claims), and both texts are printed.

Run with the project's Python (llama.cpp from the oracle at /tmp/kvoracle, or ``ORACLE_PY``):

    PYTHONPATH=. .venv/bin/python scripts/check_tiny_llama.py [--dir /tmp/tinyllama] [--n-predict 40] [PROMPT ...]

Exits 1 if the export disagrees beyond 1e-4 (relative to the largest logit), or if any tokens differ.
"""
from __future__ import annotations

import argparse
import base64
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "oracle"))  # llama_runner

from kvcache_ggml.batch import Batch
from kvcache_ggml.runtime import Context, ContextParams, Model, Reference, Vocab
from llama_runner import b64_floats, llama_available, run_llama

PROMPTS = ("Return the number of", "This module provides", "If the file does not exist,", "The default value")


def export_check(gguf: Path, probe: Path) -> float:
    """Max |logit difference| / max |logit| of our reference and runtime against the trained model's logits."""
    p = np.load(probe)
    tokens, want = p["tokens"], p["logits"]
    scale = float(np.abs(want).max())
    ref = Reference(gguf).forward(tokens)
    with Model(gguf) as m, Context(m, ContextParams(n_ctx=len(tokens), n_batch=len(tokens), flash_attn=False,
                                                    type_k="f32", type_v="f32", n_threads=1,
                                                    n_threads_batch=1)) as ctx:
        ours = ctx.decode(Batch(token=tokens.astype(np.int32), pos=np.arange(len(tokens), dtype=np.int32),
                                logits=np.ones(len(tokens), np.int8)))
    d_ref = float(np.abs(ref - want).max()) / scale
    d_rt = float(np.abs(ours - want).max()) / scale
    same = np.array_equal(np.argmax(ours, 1), np.argmax(want, 1))
    print(f"export: {len(tokens)} probe tokens, max |logit| {scale:.2f}; max diff / max |logit|: numpy reference "
          f"{d_ref:.1e}, runtime (f32 cache) {d_rt:.1e}; argmax {'equal' if same else 'DIFFERENT'}")
    return max(d_ref, d_rt)


def ours_greedy(gguf: Path, prompt: list[int], n_predict: int, flash_attn: bool, vocab: Vocab):
    """Our runtime's greedy tokens and the logit rows they were taken from."""
    n_ctx = len(prompt) + n_predict
    with Model(gguf) as m, Context(m, ContextParams(n_ctx=n_ctx, n_batch=n_ctx, kv_unified=True,
                                                    flash_attn=flash_attn, n_threads=1, n_threads_batch=1)) as ctx:
        row = ctx.decode(Batch(token=np.array(prompt, np.int32), pos=np.arange(len(prompt), dtype=np.int32)))[-1]
        toks, rows = [], []
        while True:
            rows.append(row)
            toks.append(int(np.argmax(row)))
            if vocab.is_eog(toks[-1]) or len(toks) >= n_predict:
                break
            row = ctx.decode(Batch(token=np.array(toks[-1:], np.int32),
                                   pos=np.array([len(prompt) + len(toks) - 1], np.int32)))[-1]
    return toks, np.array(rows)


def llama_greedy(gguf: Path, prompt: list[int], n_predict: int, flash_attn: bool, n_vocab: int):
    """llama.cpp's greedy tokens, its text, and the logit rows (same context settings as ours_greedy)."""
    n_ctx = len(prompt) + n_predict
    params = {"n_ctx": n_ctx, "n_batch": n_ctx, "kv_unified": True, "flash_attn": flash_attn, "n_threads": 1}
    ans = run_llama({"model": str(gguf), "params": params,
                     "ops": [{"op": "generate", "prompt": prompt, "n_predict": n_predict}]})[0]
    if "tokens" not in ans:
        raise RuntimeError(f"llama.cpp failed: {ans}")
    return ans["tokens"], base64.b64decode(ans["text"]).decode(errors="replace"), b64_floats(ans["logits"], n_vocab)


def text_check(gguf: Path, prompts, n_predict: int) -> bool:
    """Our greedy text and llama.cpp's for each prompt, flash attention on and off; True when all tokens agree."""
    vocab = Vocab.from_gguf(gguf)
    ok = True
    for text in prompts:
        prompt = vocab.tokenize(text, add_special=True, parse_special=True)
        for fa in (True, False):
            ours, our_rows = ours_greedy(gguf, prompt, n_predict, fa, vocab)
            print(f"\n[{gguf.name}, {'flash attention' if fa else 'plain attention'}] prompt {text!r} "
                  f"({len(prompt)} tokens)\n  ours:      {text}{vocab.detokenize(ours)}")
            if llama_available() is not None:
                print(f"  llama.cpp: not run ({llama_available()})")
                continue
            theirs, their_text, their_rows = llama_greedy(gguf, prompt, n_predict, fa, vocab.n_tokens)
            same = ours == theirs
            ok &= same
            n = min(len(our_rows), len(their_rows))
            diff = float(np.abs(our_rows[:n] - their_rows[:n]).max())
            print(f"  llama.cpp: {text}{their_text}\n  tokens {'equal' if same else 'DIFFERENT'} "
                  f"({len(ours)} vs {len(theirs)}); logits of {n} steps: max |diff| {diff:.3g}"
                  f"{' (bit-identical)' if diff == 0.0 else ''}")
    return ok


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("prompts", nargs="*", default=list(PROMPTS))
    ap.add_argument("--dir", type=Path, default=Path("/tmp/tinyllama"), help="the training script's --out")
    ap.add_argument("--n-predict", type=int, default=40)
    a = ap.parse_args(argv)
    rc = 0
    if export_check(a.dir / "tiny-llama-f32.gguf", a.dir / "probe.npz") > 1e-4:
        print("export: MISMATCH")
        rc = 1
    for wtype in ("f32", "q8_0"):
        path = a.dir / f"tiny-llama-{wtype}.gguf"
        if path.exists() and not text_check(path, a.prompts, a.n_predict):
            rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
