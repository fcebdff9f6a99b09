"""One prompt, several continuations: the prompt decoded once, forked with ``seq_cp``, then one batch per step.

:func:`fork_decode` is llama.cpp's ``batched`` example on a :class:`~kvcache_ggml.runtime.context.Context`: the
prompt is decoded in sequence 0, copied into sequences 1..n-1 (``memory_seq_cp``: no second prefill), and every step
decodes the newest token of each live sequence in one batch.  Each sequence has its own sampler (the
:class:`~kvcache_ggml.serve.sampling.Sampler` interface: ``sample``, ``accept``); a sequence ends at an
end-of-generation token (unless its sampler's ``params.ignore_eos``) or after ``n_predict`` tokens.  When the cache
has no room for a step (decode returns 1), the caller's ``on_full`` may free some (a context shift) and the step is
tried again.  ``python -m kvcache_ggml generate`` and the demo both run on it.
"""
from __future__ import annotations

import time
from copy import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from ..batch import Batch
from .context import DecodeError
from .step_times import StepTimes

__all__ = ["ForkRun", "fork_decode"]


@dataclass(slots=True)
class ForkRun:
    """A :func:`fork_decode` run: what each sequence generated and what it cost."""

    prompt: np.ndarray                 # int32 prompt ids, decoded once in sequence 0
    tokens: list[list[int]]            # ids generated per sequence; the last of each was sampled, not decoded
    n_past: np.ndarray                 # int32 per sequence: the position of its last token (= cells its cache holds)
    n_steps: int = 0                   # batched decode steps that succeeded
    t_prompt: float = 0.0              # seconds decoding the prompt
    t_gen: float = 0.0                 # seconds of the steps (context shifts included)
    times: StepTimes = field(default_factory=StepTimes)  # the context's host times of the steps alone
    stopped: DecodeError | None = None  # the decode error that ended the run early; None: every sequence ended


def fork_decode(ctx: Any, prompt: np.ndarray, samplers: Sequence[Any], n_predict: int, *,
                is_eog: Callable[[int], bool] | None = None,
                first: Callable[[np.ndarray], np.ndarray] | None = None,
                on_token: Callable[[int, int], None] | None = None,
                on_full: Callable[[ForkRun], np.ndarray | None] | None = None) -> ForkRun:
    """Decode ``prompt`` in sequence 0, fork it into ``len(samplers)`` sequences, generate until each has ended.

    ``samplers[s]`` picks sequence s's tokens from its logits row and is told each one (``accept``).  ``first``
    (optional) maps the prompt's last logits row to the first token of every sequence instead (int [n_seq]).
    ``is_eog(token)`` ends a sequence at that token (None: only ``n_predict`` ends them).  ``on_token(seq, token)``
    sees every token as it is chosen.  ``on_full(run)`` is called when the cache has no room for the next step;
    it may free cells (a context shift) and returns how many positions each sequence moved back (int [n_seq]),
    or None to end the run (the error then in ``run.stopped``).  Any other decode error ends the run the same way.
    The sequences 0..n_seq-1 must be empty; the context's ``n_batch`` must hold the prompt.
    """
    n_seq = len(samplers)
    if n_seq < 1 or n_predict < 1:
        raise ValueError(f"fork_decode needs >= 1 sampler and n_predict >= 1, got {n_seq} and {n_predict}")
    prompt = np.asarray(prompt, dtype=np.int32).reshape(-1)
    if prompt.size == 0:
        raise ValueError("fork_decode: empty prompt")
    run = ForkRun(prompt, [[] for _ in range(n_seq)], np.full(n_seq, prompt.size, np.int32))
    t0 = time.perf_counter()
    row = ctx.decode(Batch(token=prompt, pos=np.arange(prompt.size, dtype=np.int32)))[-1]
    run.t_prompt = time.perf_counter() - t0
    for s in range(1, n_seq):
        ctx.memory_seq_cp(0, s, -1, -1)
    live = np.ones(n_seq, bool)
    firsts = [samplers[s].sample(row) for s in range(n_seq)] if first is None else np.asarray(first(row))
    _take(run, samplers, np.arange(n_seq), firsts, live, n_predict, is_eog, on_token)
    before = copy(ctx.times)
    t0 = time.perf_counter()
    while live.any():
        seqs = np.flatnonzero(live).astype(np.int32)
        batch = Batch(token=np.array([run.tokens[s][-1] for s in seqs], np.int32), pos=run.n_past[seqs],
                      seq_id=seqs, logits=np.ones(seqs.size, np.int8))
        try:
            logits = ctx.decode(batch)
        except DecodeError as e:
            moved = on_full(run) if e.code == 1 and on_full is not None else None
            if moved is None:
                run.stopped = e
                break
            run.n_past -= np.asarray(moved, np.int32)
            continue
        run.n_past[seqs] += 1
        run.n_steps += 1
        _take(run, samplers, seqs, [samplers[s].sample(logits[i]) for i, s in enumerate(seqs)], live, n_predict,
              is_eog, on_token)
    run.t_gen = time.perf_counter() - t0
    run.times = ctx.times.since(before)
    return run


def _take(run: ForkRun, samplers: Sequence[Any], seqs: np.ndarray, toks: Sequence[int], live: np.ndarray,
          n_predict: int, is_eog: Callable[[int], bool] | None, on_token: Callable[[int, int], None] | None) -> None:
    """Record the tokens chosen for ``seqs``; end the sequences that reached an end token or n_predict."""
    for s, tok in zip(seqs.tolist(), toks):
        tok = int(tok)
        samplers[s].accept(tok)
        run.tokens[s].append(tok)
        if on_token is not None:
            on_token(s, tok)
        eog = is_eog is not None and is_eog(tok) and not samplers[s].params.ignore_eos
        if eog or len(run.tokens[s]) >= n_predict:
            live[s] = False
