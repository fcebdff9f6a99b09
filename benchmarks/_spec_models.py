"""The models and prompts of ``bench_serve.py --spec`` (speculative decoding).

A random model drafts nothing useful for another, and its replies repeat nothing, so the two models are made for it:

* the target: 16 llama layers (n_embd 512, ff 2048, Q8_0, GPT-2's vocabulary) whose attention outputs are scaled
  by 0.02 and whose layers after the first add only 0.003 of their usual output -- a model that reads mostly its
  last token (close to a bigram model: given the same few last tokens it continues the same way) and whose first
  layer decides most of its choices;
* the draft: that first layer alone (the same embeddings, layer 0 and head): about a third of the target's cost per
  token, its greedy choice the target's about 70 % of the time along a free run (more where it is handed the
  target's own tokens, as in verification).

The prompts are a code-editing workload whose reply repeats the prompt: per user, a random 150-token "file" A, a
reply D of ``--spec-reply`` tokens, and the prompt A + D + A, where D is the target's own greedy reply to A + D + A
(computed here with the runtime, :func:`spec_prompts`): the reply, again after A, is D again, which prompt lookup
finds in the prompt.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

LAYERS, EMBD, HEADS, HEADS_KV, FF = 16, 512, 8, 4, 2048
ATTN_SCALE, DEEP_SCALE, OUT_SCALE = 0.001, 0.003, 8.0


def spec_models(target: Path, draft: Path, vocab: Path, template: str) -> tuple[Path, Path]:
    """Write the target and the draft (once: kept where they are)."""
    from kvcache_ggml.runtime.modelmaker import ModelSpec, make_model

    if target.exists() and draft.exists():
        return target, draft
    n_vocab, hd = 50257, EMBD // HEADS
    rng = np.random.default_rng(1)

    def mat(rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * (1.6 / math.sqrt(cols)) * scale).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(EMBD)).astype(np.float32)

    w = {"token_embd.weight": rng.standard_normal((n_vocab, EMBD)).astype(np.float32),
         "output_norm.weight": norm(), "output.weight": mat(n_vocab, EMBD, OUT_SCALE)}
    for il in range(LAYERS):
        b, deep = f"blk.{il}.", 1.0 if il == 0 else DEEP_SCALE
        w.update({b + "attn_norm.weight": norm(), b + "ffn_norm.weight": norm(), b + "attn_q.weight": mat(EMBD, EMBD),
                  b + "attn_k.weight": mat(hd * HEADS_KV, EMBD), b + "attn_v.weight": mat(hd * HEADS_KV, EMBD),
                  b + "attn_output.weight": mat(EMBD, EMBD, ATTN_SCALE * deep), b + "ffn_gate.weight": mat(FF, EMBD),
                  b + "ffn_up.weight": mat(FF, EMBD), b + "ffn_down.weight": mat(EMBD, FF, deep)})
    spec = dict(embd=EMBD, heads=HEADS, heads_kv=HEADS_KV, ff=FF, type="q8_0", vocab_from=str(vocab),
                chat_template=template, ctx=16384)
    make_model(target, ModelSpec(layers=LAYERS, **spec), weights=w)
    first = {k: v for k, v in w.items() if not k.startswith("blk.") or k.startswith("blk.0.")}
    make_model(draft, ModelSpec(layers=1, **spec), weights=first)
    return target, draft


def spec_prompts(target: Path, users: int, n_reply: int, banned: list[int], seed: int = 5,
                 tries: int = 4) -> list[list[int]]:
    """Per user the token prompt A + D + A (module docstring): D starts as the greedy continuation of A and is
    replaced by the greedy reply to A + D + A until that reply is D (at most 4 rounds); of ``tries`` random A the one
    whose reply has the widest smallest gap between its two best logits is kept (a near tie there would let the
    rounding of a batch -- a server's, a verification's -- send the reply off D).  D avoids the ``banned`` ids (the
    servers get them as a logit bias)."""
    from kvcache_ggml.runtime import load_model

    rng = np.random.default_rng(seed)
    out = []
    with load_model(target) as m:
        for _ in range(users):
            best: tuple[float, list[int]] = (-1.0, [])
            for _ in range(tries):
                a = [int(t) for t in rng.integers(300, 20000, 150)]
                d, gap = _greedy(m, a, n_reply, banned)
                for _ in range(4):
                    again, gap = _greedy(m, a + d + a, n_reply, banned)
                    if again == d:
                        break
                    d = again
                best = max(best, (gap, a + d + a), key=lambda x: x[0])
            out.append(best[1])
    return out


def _greedy(model, tokens: list[int], n: int, banned: list[int]) -> tuple[list[int], float]:
    """``n`` greedy tokens after ``tokens`` and the smallest gap between the two best logits on the way, relative
    to the largest logit."""
    from kvcache_ggml.batch import Batch
    from kvcache_ggml.cparams import ContextParams
    from kvcache_ggml.runtime import Context

    with Context(model, ContextParams(n_ctx=1024, n_batch=512, n_threads=2, n_threads_batch=2)) as ctx:
        row = ctx.decode(Batch(token=np.array(tokens, np.int32)))[-1]
        d: list[int] = []
        gap = np.inf
        for _ in range(n):
            row = np.array(row)
            row[banned] = -np.inf
            top = np.sort(row)[-2:]
            gap = min(gap, float((top[1] - top[0]) / top[1]))
            d.append(int(np.argmax(row)))
            row = ctx.decode(Batch(token=np.array(d[-1:], np.int32)))[0]
    return d, gap
