"""A thin serving loop: requests as token lists in, generated tokens out, prompt reuse reported per request.

:class:`Server` runs a :class:`~kvcache_ggml.prefix.PrefixCache` over a :class:`~kvcache_ggml.runtime.context.
Context`.  Each waiting request gets a sequence (:meth:`PrefixCache.pick_seq`: the parked sequence it extends, else
a free or evicted one) and is admitted -- its cached prefix reused, the rest of the prompt decoded -- as soon as
fewer than ``max_active`` requests are decoding; then every active request advances one token per step, all in one
batch (greedy sampling, or the request's ``forced`` tokens for replays).  A finished request's sequence stays cached
for the next request that shares its prefix.

:func:`chat_workload` makes the benchmark's workload: N users, M turns each, one shared system prompt.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..prefix import PrefixCache, PrefixParams, Retention

__all__ = ["Request", "Response", "Server", "chat_workload", "format_responses"]

_perf = time.perf_counter


@dataclass(slots=True)
class Request:
    """One completion request."""

    tokens: Sequence[int]                     # the prompt's token ids
    max_new_tokens: int = 16                  # tokens to generate (>= 1; the first comes from the prompt's logits)
    forced: Sequence[int] | None = None       # generate exactly these tokens instead of sampling (replays)
    retention: Retention | None = None        # how strongly its sequence is kept once done (None: the default)
    name: str = ""                            # a label for reports

    def check(self) -> None:
        if len(self.tokens) == 0:
            raise ValueError(f"request {self.name!r}: empty prompt")
        if self.max_new_tokens < 1:
            raise ValueError(f"request {self.name!r}: max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.forced is not None and len(self.forced) < self.max_new_tokens:
            raise ValueError(f"request {self.name!r}: {len(self.forced)} forced tokens for max_new_tokens = "
                             f"{self.max_new_tokens}")


@dataclass(slots=True)
class Response:
    """What serving one request did."""

    name: str                    # the request's label
    seq_id: int                  # the sequence that served it
    n_prompt: int                # prompt tokens
    n_reused: int                # prompt tokens taken from the cache
    n_decoded: int               # prompt tokens decoded
    source: str                  # where the reused prefix came from: "own", "device", "host" or "none"
    output: list[int]            # generated tokens
    ttft: float                  # seconds from taking the request to its first token
    seconds: float               # seconds from taking the request to its last token
    first_logits: np.ndarray | None = None  # float32 [n_vocab] logits of the first token (keep_logits)


@dataclass(slots=True)
class _Live:
    """A request being decoded."""

    req: Request                 # the request
    resp: Response               # its response so far
    t0: float                    # when it was taken


class Server:
    """Requests in, tokens out, over one context and its prefix cache."""

    def __init__(self, ctx: Any, prefix: PrefixCache | PrefixParams | None = None, *, max_active: int = 0,
                 keep_logits: bool = False) -> None:
        self.ctx = ctx
        self.prefix = prefix if isinstance(prefix, PrefixCache) else PrefixCache(ctx, prefix)
        n_seq = self.prefix.n_seq
        self.max_active = max_active or n_seq
        if not 1 <= self.max_active <= n_seq:
            raise ValueError(f"max_active must be in [1, {n_seq}] (the context's sequences), got {max_active}")
        self.keep_logits = keep_logits
        self.queue: deque[Request] = deque()
        self.active: dict[int, _Live] = {}

    def submit(self, req: Request) -> None:
        req.check()
        self.queue.append(req)

    def serve(self, requests: Sequence[Request]) -> list[Response]:
        """Submit ``requests`` and run them to the end; responses in request order."""
        for r in requests:
            self.submit(r)
        done = self.run()
        order = {id(r): i for i, r in enumerate(requests)}
        return [resp for _, resp in sorted(done, key=lambda p: order[id(p[0])])]

    def run(self) -> list[tuple[Request, Response]]:
        """Serve until nothing waits or decodes; (request, response) pairs in completion order."""
        done: list[tuple[Request, Response]] = []
        while self.queue or self.active:
            while self.queue and len(self.active) < self.max_active:
                self._take(self.queue.popleft(), done)
            if self.active:
                self._step(done)
        return done

    # ------------------------------------------------------------------ internals

    def _take(self, req: Request, done: list) -> None:
        t0 = _perf()
        pc = self.prefix
        seq = pc.pick_seq(req.tokens)
        adm = pc.admit(req.tokens, seq, retention=req.retention)
        tok = self._next(req, 0, adm.logits)
        t1 = _perf()
        resp = Response(req.name, seq, adm.n_prompt, adm.n_reused, adm.n_decoded, adm.source, [tok], t1 - t0,
                        t1 - t0, adm.logits.copy() if self.keep_logits else None)
        live = _Live(req, resp, t0)
        if req.max_new_tokens == 1:
            self._finish(seq, live, done)
        else:
            self.active[seq] = live

    def _step(self, done: list) -> None:
        seqs = sorted(self.active)
        toks = [self.active[s].resp.output[-1] for s in seqs]
        logits = self.prefix.step(seqs, toks)
        for row, s in enumerate(seqs):
            live = self.active[s]
            out = live.resp.output
            out.append(self._next(live.req, len(out), logits[row]))
            if len(out) == live.req.max_new_tokens:
                del self.active[s]
                self._finish(s, live, done)

    def _finish(self, seq: int, live: _Live, done: list) -> None:
        live.resp.seconds = _perf() - live.t0
        self.prefix.release(seq)
        done.append((live.req, live.resp))

    @staticmethod
    def _next(req: Request, k: int, logits: np.ndarray) -> int:
        return int(req.forced[k]) if req.forced is not None else int(np.argmax(logits))


def chat_workload(n_users: int, n_turns: int, system_len: int, *, user_len: tuple[int, int] = (16, 48),
                  reply_len: int = 16, vocab: int = 64, seed: int = 0) -> list[Request]:
    """Multi-turn chats sharing one system prompt, turns round-robin over the users.

    Request (u, t) is ``system + user_1 + reply_1 + ... + user_t`` (message lengths uniform in ``user_len``,
    token ids in [3, vocab)); its reply is forced to ``reply_len`` fixed tokens, which the next turn's prompt
    contains -- as a chat client sends the whole history back.
    """
    if n_users < 1 or n_turns < 1 or system_len < 0 or reply_len < 1 or vocab < 4:
        raise ValueError(f"chat_workload needs n_users, n_turns, reply_len >= 1, system_len >= 0 and vocab >= 4, "
                         f"got {n_users}, {n_turns}, {reply_len}, {system_len}, {vocab}")
    rng = np.random.default_rng(seed)
    system = rng.integers(3, vocab, system_len).astype(np.int32)
    history = [system.copy() for _ in range(n_users)]
    reqs = []
    for t in range(n_turns):
        for u in range(n_users):
            msg = rng.integers(3, vocab, int(rng.integers(user_len[0], user_len[1] + 1))).astype(np.int32)
            reply = rng.integers(3, vocab, reply_len).astype(np.int32)
            prompt = np.concatenate([history[u], msg])
            reqs.append(Request(prompt, reply_len, forced=reply, name=f"u{u}t{t}"))
            history[u] = np.concatenate([prompt, reply])
    return reqs


def format_responses(responses: Sequence[Response]) -> str:
    """One line per response: prompt, reused, decoded, source, time to first token."""
    lines = [f"{'request':>8} {'seq':>4} {'prompt':>7} {'reused':>7} {'decoded':>8} {'source':>7} {'ttft ms':>8}"]
    for r in responses:
        lines.append(f"{r.name:>8} {r.seq_id:>4} {r.n_prompt:>7} {r.n_reused:>7} {r.n_decoded:>8} {r.source:>7} "
                     f"{1e3 * r.ttft:>8.2f}")
    n_p = sum(r.n_prompt for r in responses)
    n_r = sum(r.n_reused for r in responses)
    lines.append(f"{'total':>8} {'':>4} {n_p:>7} {n_r:>7} {n_p - n_r:>8} {'':>7} "
                 f"{1e3 * sum(r.ttft for r in responses):>8.2f}")
    return "\n".join(lines)

