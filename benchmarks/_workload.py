"""The chat workload the prefix-cache benchmark and tests replay, and its replay through the serving engine.

:func:`chat_workload` makes N users' M turns sharing one system prompt, each prompt the whole history (as a chat
client sends it), each reply a fixed list of tokens.  :func:`replay` serves them through
:class:`~kvcache_ggml.serve.engine.Engine` on the caller's thread (``run_until_idle``), every reply forced
(:class:`~kvcache_ggml.serve.sampling.ForcedSampler`), so every engine and every cache setting generates the same
tokens and the next turn's prompt holds the previous reply.

Benchmarks import it as ``from _workload import ...`` (this folder on ``sys.path``); tests put this folder on
``sys.path`` in tests/conftest.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvcache_ggml.serve.engine import Engine
from kvcache_ggml.serve.request import Event, Job
from kvcache_ggml.serve.sampling import ForcedSampler
from kvcache_ggml.serve.text import TextStream

__all__ = ["Turn", "Served", "chat_workload", "replay", "format_served"]


@dataclass(slots=True)
class Turn:
    """One request of the workload."""

    name: str                    # "u{user}t{turn}"
    tokens: np.ndarray           # int32 prompt: the system prompt and the user's whole history
    reply: np.ndarray            # int32 tokens the reply is forced to (the next turn's prompt holds them)


@dataclass(slots=True)
class Served:
    """What serving one turn did."""

    name: str                    # the turn's name
    n_prompt: int                # prompt tokens
    n_cached: int                # of them reused from the prefix cache
    output: list[int]            # generated tokens
    ttft: float                  # seconds from submission to the first token
    first_logits: np.ndarray | None   # float32 [n_vocab] logits of the first token (keep_logits)

    @property
    def n_decoded(self) -> int:
        return self.n_prompt - self.n_cached


def chat_workload(n_users: int, n_turns: int, system_len: int, *, user_len: tuple[int, int] = (16, 48),
                  reply_len: int = 16, vocab: int = 64, seed: int = 0) -> list[Turn]:
    """Multi-turn chats sharing one system prompt, turns round-robin over the users: turn (u, t) is
    ``system + user_1 + reply_1 + ... + user_t`` (message lengths uniform in ``user_len``, token ids in
    [3, vocab)), its reply ``reply_len`` fixed tokens."""
    if n_users < 1 or n_turns < 1 or system_len < 0 or reply_len < 1 or vocab < 4:
        raise ValueError(f"chat_workload needs n_users, n_turns, reply_len >= 1, system_len >= 0 and vocab >= 4, "
                         f"got {n_users}, {n_turns}, {reply_len}, {system_len}, {vocab}")
    rng = np.random.default_rng(seed)
    system = rng.integers(3, vocab, system_len).astype(np.int32)
    history = [system.copy() for _ in range(n_users)]
    turns = []
    for t in range(n_turns):
        for u in range(n_users):
            msg = rng.integers(3, vocab, int(rng.integers(user_len[0], user_len[1] + 1))).astype(np.int32)
            reply = rng.integers(3, vocab, reply_len).astype(np.int32)
            prompt = np.concatenate([history[u], msg])
            turns.append(Turn(f"u{u}t{t}", prompt, reply))
            history[u] = np.concatenate([prompt, reply])
    return turns


def replay(engine: Engine, turns: Sequence[Turn], *, together: bool = False,
           keep_logits: bool = False) -> list[Served]:
    """Serve ``turns`` with forced replies on the caller's thread: one after another (each turn submitted when the
    one before has ended, as a single user would), or all submitted at once (``together``: the engine runs up to
    its ``n_parallel`` at a time).  Results in the turns' order; raises if a turn ends with an error."""
    sinks: list[list[Event]] = []
    jobs: list[Job] = []

    def submit(turn: Turn) -> None:
        events: list[Event] = []
        job = Job(turn.tokens, ForcedSampler(turn.reply, keep_logits=keep_logits), TextStream(engine.vocab),
                  events.append, max_tokens=int(turn.reply.size))
        engine.submit(job)
        sinks.append(events)
        jobs.append(job)

    for turn in turns:
        submit(turn)
        if not together:
            engine.run_until_idle()
    engine.run_until_idle()
    out = []
    for turn, job, events in zip(turns, jobs, sinks):
        end = events[-1]
        if end.kind != "done":
            raise RuntimeError(f"turn {turn.name} ended with {end.kind}: {end.text}")
        out.append(Served(turn.name, int(turn.tokens.size), end.usage.cached_tokens, list(job.generated),
                          job.t_first - job.t_submit, job.sampler.first_logits))
    return out


def format_served(served: Sequence[Served]) -> str:
    """One line per turn: prompt, reused, decoded, time to first token; then the totals."""
    lines = [f"{'turn':>8} {'prompt':>7} {'reused':>7} {'decoded':>8} {'ttft ms':>8}"]
    for r in served:
        lines.append(f"{r.name:>8} {r.n_prompt:>7} {r.n_cached:>7} {r.n_decoded:>8} {1e3 * r.ttft:>8.2f}")
    n_p = sum(r.n_prompt for r in served)
    n_r = sum(r.n_cached for r in served)
    lines.append(f"{'total':>8} {n_p:>7} {n_r:>7} {n_p - n_r:>8} {1e3 * sum(r.ttft for r in served):>8.2f}")
    return "\n".join(lines)
