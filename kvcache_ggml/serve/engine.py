"""The serving engine: one thread owns the context and its prefix cache; requests join and leave between steps.

Each step is **one batch** (:meth:`PrefixCache.advance`): the next token of every request that is generating, then
chunks of the prompts still being read, first come first served, up to a token budget (``step_tokens``, the
context's ``n_batch`` by default) -- chunked prefill as llama-server and vLLM do it.  A request's logits come with
the step that decodes its last prompt token, and every step after that samples its next token.

Life of a request (:class:`Job`)
--------------------------------
1. ``submit`` puts it in the queue (``QueueFull`` past ``max_queue`` waiting requests).
2. Admission, between steps, while fewer than ``n_parallel`` requests run: :meth:`PrefixCache.pick_seq` gives it a
   sequence and :meth:`PrefixCache.attach` the longest cached prefix of its prompt (its own parked sequence, a
   ``seq_cp`` of another's, or a host-tier blob): those tokens are ``cached_tokens`` and are not computed again.
   A request whose prompt shares a longer prefix with one that another request is still reading waits until that
   prefix is in the cache (users who arrive together with one system prompt compute it once).
3. Prefill in chunks, then one token a step, each sampled by the request's :class:`~.sampling.Sampler` and turned
   into text by its :class:`~.text.TextStream` (UTF-8 safe, stop strings held back).
4. It ends at an end-of-generation token or a stop string (``finish_reason`` "stop"), at ``max_tokens`` or the
   sequence's context (``n_ctx_seq``; "length"), when cancelled (its client went away), or at its deadline
   ("length").  Its sequence is released to the prefix cache, which keeps what it indexes (parked, evictable, the
   host tier behind it); with ``cache_prompt`` off the sequence is evicted instead, leaving nothing in the cells.

When the cache fills up
-----------------------
The prefix cache evicts parked sequences first (to the host tier when it has one).  If a step still has no room,
its prompt chunks wait (the step runs with the generating requests alone); if generating requests alone do not fit,
the one admitted last ends with ``finish_reason`` "length" and its cells are freed.  A request alone in the cache
always fits, since prompts must be shorter than ``n_ctx_seq``.  The engine never raises out of its thread: an
unexpected error ends the requests of that step with an error event and the loop goes on.

Events reach the caller through ``Job.emit`` (called on the engine thread; the HTTP layer hands them to its event
loop).  The engine knows nothing of HTTP.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..batch import Batch
from ..prefix import PrefixCache, PrefixParams
from ..runtime.context import DecodeError
from .results import TokenLogprob, Usage
from .sampling import Sampler
from .text import TextStream

__all__ = ["EngineParams", "Engine", "Job", "Event", "QueueFull", "EngineStats"]

_perf = time.perf_counter


def _common_prefix(a: np.ndarray, b: np.ndarray, limit: int) -> int:
    m = min(a.size, b.size, limit)
    neq = np.flatnonzero(a[:m] != b[:m])
    return int(neq[0]) if neq.size else m


class QueueFull(Exception):
    """The queue holds ``max_queue`` waiting requests already."""


@dataclass(slots=True)
class EngineParams:
    """How the engine schedules requests."""

    n_parallel: int = 4            # requests generating or reading their prompt at once (<= the context's sequences)
    step_tokens: int = 0           # token budget of one step (0: the context's n_batch)
    max_queue: int = 64            # requests waiting for admission; one more gets QueueFull
    timeout: float = 600.0         # seconds from submission to the last token; then the request ends ("length")
    warmup: bool = True            # the engine thread first decodes a graph-sized batch and one token, then clears
    #                                the cache (llama.cpp's warm-up): buffers allocated before the first request, and
    #                                on the thread that computes (ggml's OpenMP team is per calling thread)

    def check(self, n_seq: int, n_batch: int) -> None:
        if not 1 <= self.n_parallel <= n_seq:
            raise ValueError(f"n_parallel must be in [1, {n_seq}] (the context's sequences), got {self.n_parallel}")
        if not 0 <= self.step_tokens <= n_batch:
            raise ValueError(f"step_tokens must be in [0, n_batch = {n_batch}], got {self.step_tokens}")
        if self.step_tokens and self.step_tokens < self.n_parallel:
            raise ValueError(f"step_tokens {self.step_tokens} < n_parallel {self.n_parallel}: a step must hold "
                             "one token of every generating request")
        if self.max_queue < 0 or self.timeout <= 0:
            raise ValueError(f"max_queue must be >= 0 and timeout > 0, got {self.max_queue}, {self.timeout}")


@dataclass(slots=True)
class Event:
    """What the engine tells a request's caller."""

    kind: str                              # "text" (a piece of output), "done" (the end) or "error"
    text: str = ""                         # text: the piece; error: the message
    tokens: list[int] = field(default_factory=list)        # text: the tokens this piece completes
    logprobs: list[TokenLogprob] = field(default_factory=list)  # text: one per token (when asked for)
    finish_reason: str | None = None       # done: "stop" or "length"
    usage: Usage | None = None             # done: the request's token counts


@dataclass(slots=True, eq=False)
class Job:
    """One request inside the engine (fields below the line are the engine's)."""

    tokens: np.ndarray                     # int32 prompt
    sampler: Sampler                       # its sampler (seeded per request)
    text: TextStream                       # its detokenizer with the stop strings
    emit: Callable[[Event], None]          # called on the engine thread with each event
    max_tokens: int | None = None          # most tokens to generate (None: until the context is full)
    cache_prompt: bool = True              # keep its sequence in the prefix cache when done
    top_logprobs: int = -1                 # -1: no logprobs; k >= 0: the sampled token's and the k best
    cancelled: bool = False                # set by the caller (any thread) to end it
    # ---- engine state
    seq: int = -1                          # its sequence once admitted
    fed: int = 0                           # prompt tokens in its sequence (reused + decoded)
    n_cached: int = 0                      # prompt tokens the prefix cache reused
    generated: list[int] = field(default_factory=list)     # sampled tokens
    pending: list[int] = field(default_factory=list)       # sampled tokens whose text is not out yet
    pending_lp: list[TokenLogprob] = field(default_factory=list)  # their logprobs
    t_submit: float = 0.0                  # perf_counter at submission
    t_first: float = 0.0                   # perf_counter at the first token (0: none yet)
    deadline: float = 0.0                  # perf_counter past which it ends
    admitted: int = 0                      # admission order (the last admitted ends first when the cache is full)


@dataclass(slots=True)
class EngineStats:
    """Counters since the engine started (the metrics endpoint prints them)."""

    requests: int = 0              # requests finished (any reason)
    requests_failed: int = 0       # ended by an error
    requests_cancelled: int = 0    # ended because their client went away
    prompt_tokens: int = 0         # prompt tokens of admitted requests
    cached_tokens: int = 0         # of them reused from the prefix cache
    computed_tokens: int = 0       # of them decoded
    generated_tokens: int = 0      # tokens sampled
    steps: int = 0                 # batches decoded
    ended_full: int = 0            # requests ended with "length" because the cache was full


class Engine:
    """The serving loop over a context: ``submit`` from any thread, ``start``/``stop`` the engine thread."""

    def __init__(self, ctx: Any, vocab: Any, params: EngineParams | None = None,
                 prefix: PrefixParams | None = None) -> None:
        self.params = params or EngineParams()
        self.ctx = ctx
        self.vocab = vocab
        self.prefix = PrefixCache(ctx, prefix)
        n_batch = int(ctx.cparams.n_batch)
        self.params.check(self.prefix.n_seq, n_batch)
        self.budget = self.params.step_tokens or n_batch
        self.n_ctx_seq = int(ctx.n_ctx_seq())
        self.stats = EngineStats()
        self._inbox: deque[Job] = deque()      # submitted, not yet seen by the loop (guarded by _cv)
        self._waiting: deque[Job] = deque()    # seen, waiting for admission (engine thread only)
        self._running: list[Job] = []          # admitted (engine thread only)
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._n_admitted = 0
        self.ready = threading.Event()         # set once the engine thread has warmed up and takes requests

    # ------------------------------------------------------------------ caller side (any thread)

    def submit(self, job: Job) -> None:
        """Queue ``job``; ``QueueFull`` when ``max_queue`` requests wait already, ValueError for a prompt the
        context cannot hold."""
        n = int(job.tokens.size)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= self.n_ctx_seq:
            raise ValueError(f"the prompt has {n} tokens; the context holds {self.n_ctx_seq} per sequence "
                             "(prompt and output together)")
        job.t_submit = _perf()
        job.deadline = job.t_submit + self.params.timeout
        with self._cv:
            if self._stop:
                raise RuntimeError("the engine is stopped")
            free_slots = self.params.n_parallel - len(self._running)
            if self.queue_depth >= self.params.max_queue + max(free_slots, 0):
                raise QueueFull(f"{self.params.max_queue} requests are waiting already")
            self._inbox.append(job)
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        """End ``job`` at the next step (its client went away); safe from any thread, idempotent."""
        job.cancelled = True
        with self._cv:
            self._cv.notify()

    @property
    def queue_depth(self) -> int:
        return len(self._waiting) + len(self._inbox)

    @property
    def n_running(self) -> int:
        return len(self._running)

    def start(self) -> "Engine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="kvcache-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop: running and waiting requests end with an error event; the thread is joined."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def run_until_idle(self) -> None:
        """Run steps on this thread until nothing waits or runs (tests and offline use; not with start())."""
        while self._take_inbox() or self._waiting or self._running:
            self._step()

    # ------------------------------------------------------------------ the loop

    def warm_up(self) -> None:
        """Decode a batch as large as a graph takes and one token, then clear the cache (on the calling thread: the
        engine thread calls it first when ``warmup`` is set).  Nothing may be running."""
        assert not self._running and not self.prefix.seqs, "warm_up() before any request"
        ctx, vocab = self.ctx, self.vocab
        tok = vocab.bos if vocab.bos >= 0 else 0
        n = min(int(ctx.cparams.n_ubatch), self.budget, self.n_ctx_seq - 1)
        ctx.decode(Batch(token=np.full(n, tok, np.int32)))
        ctx.decode(Batch(token=np.array([tok], np.int32)))
        ctx.memory_clear(True)

    def _loop(self) -> None:
        if self.params.warmup:
            try:
                self.warm_up()
            except Exception:  # noqa: BLE001 -- a failed warm-up leaves the first request to pay; it is not fatal
                self.ctx.memory_clear(True)
        self.ready.set()
        while True:
            with self._cv:
                while not self._stop and not self._inbox and not self._waiting and not self._running:
                    self._cv.wait()
                if self._stop:
                    break
            self._take_inbox()
            self._step()
        for job in [*self._running, *self._waiting, *self._inbox]:
            self._end_error(job, "the server is shutting down")
        self._running.clear()
        self._waiting.clear()
        self._inbox.clear()

    def _take_inbox(self) -> bool:
        with self._cv:
            took = bool(self._inbox)
            self._waiting.extend(self._inbox)
            self._inbox.clear()
        return took

    def _step(self) -> None:
        now = _perf()
        for job in [j for j in self._waiting if j.cancelled or now > j.deadline]:
            self._waiting.remove(job)
            if job.cancelled:
                self.stats.requests_cancelled += 1
                self._emit(job, Event("done", finish_reason="cancelled", usage=self._usage(job)))
            else:
                self._end_error(job, f"timed out after {self.params.timeout:g} s in the queue")
        for job in [j for j in self._running if j.cancelled or now > j.deadline]:
            if job.cancelled:
                self.stats.requests_cancelled += 1
            self._finish(job, "cancelled" if job.cancelled else "length")
        self._admit()
        if not self._running:
            return
        gen = [j for j in self._running if j.fed == j.tokens.size]
        fill = sorted((j for j in self._running if j.fed < j.tokens.size), key=lambda j: j.admitted)
        parts: list[tuple[Job, np.ndarray, bool]] = [(j, np.array(j.generated[-1:], np.int32), True) for j in gen]
        left = self.budget - len(parts)
        for j in fill:
            if left <= 0:
                break
            chunk = j.tokens[j.fed:j.fed + left]
            parts.append((j, chunk, j.fed + chunk.size == j.tokens.size))
            left -= chunk.size
        try:
            ran = self._decode(parts)
        except Exception as err:  # noqa: BLE001 -- the loop must go on; the step's requests get the error
            for j, _, _ in parts:
                self._end_error(j, f"decode failed: {err}")
            return
        if not ran:
            return
        self.stats.steps += 1
        for (j, toks, want), row in ran:
            if j.fed < j.tokens.size:
                j.fed += toks.size
                self.stats.computed_tokens += toks.size
            if want:
                self._sampled(j, row)

    def _decode(self, parts: list[tuple[Job, np.ndarray, bool]]) -> list[tuple[tuple, np.ndarray | None]]:
        """Decode the step: the (part, logits) pairs that ran.  On a full cache the prompt chunks wait (the
        generating requests run alone); when those alone do not fit, the request admitted last ends ("length")
        or, still reading its prompt, goes back to the head of the queue; then nothing ran."""
        try:
            return list(zip(parts, self.prefix.advance([(j.seq, t, w) for j, t, w in parts])))
        except DecodeError as err:
            if err.code != 1:
                raise
        gen = [p for p in parts if p[0].fed == p[0].tokens.size]
        if gen and len(gen) < len(parts):
            try:
                return list(zip(gen, self.prefix.advance([(j.seq, t, w) for j, t, w in gen])))
            except DecodeError as err:
                if err.code != 1:
                    raise
        victim = max((p[0] for p in parts), key=lambda j: j.admitted)
        self.stats.ended_full += 1
        if victim.generated:
            self._finish(victim, "length", evict=True)
        else:  # back to the queue; the prefix cache keeps what it read, for its next admission
            self._release(victim, evict=False)
            victim.fed = victim.n_cached = 0
            self._waiting.appendleft(victim)
        return []

    # ------------------------------------------------------------------ admission and the end of a request

    def _admit(self) -> None:
        deferred: list[Job] = []
        while self._waiting and len(self._running) < self.params.n_parallel:
            job = self._waiting[0]
            if self._prefix_coming(job):
                deferred.append(self._waiting.popleft())
                continue
            try:
                seq = self.prefix.pick_seq(job.tokens)
            except ValueError:
                break  # every sequence serves a request
            self._waiting.popleft()
            try:
                adm = self.prefix.attach(job.tokens, seq)
            except Exception as err:  # noqa: BLE001
                self._end_error(job, f"admission failed: {err}")
                continue
            self._n_admitted += 1
            job.seq, job.fed, job.n_cached, job.admitted = seq, adm.n_reused, adm.n_reused, self._n_admitted
            self.stats.prompt_tokens += job.tokens.size
            self.stats.cached_tokens += adm.n_reused
            self._running.append(job)
        self._waiting.extendleft(reversed(deferred))  # first in the queue again, in their order

    def _prefix_coming(self, job: Job) -> bool:
        """Whether a request still reading its prompt will soon hold a longer prefix of ``job``'s prompt than the
        cache holds now: ``job`` then waits for it and reuses it, rather than computing the same tokens beside it
        (users arriving together with one system prompt)."""
        readers = [r for r in self._running if r.fed < r.tokens.size]
        if not readers:
            return False
        limit = job.tokens.size - 1
        cached = self.prefix.match(job.tokens, limit).n_tokens
        for r in readers:
            shared = _common_prefix(r.tokens, job.tokens, limit)
            if shared > cached and r.fed < shared:
                return True
        return False

    def _sampled(self, job: Job, logits: np.ndarray) -> None:
        tok = job.sampler.sample(logits)
        if not job.t_first:
            job.t_first = _perf()
        self.stats.generated_tokens += 1
        if self.vocab.is_eog(tok) and not job.sampler.params.ignore_eos:
            self._finish(job, "stop")  # (the end token is not output: no text, no logprob)
            return
        if job.top_logprobs >= 0:
            lp, top = job.sampler.logprobs(logits, tok, job.top_logprobs)
            job.pending_lp.append(TokenLogprob(tok, lp, tuple(top)))
        job.sampler.accept(tok)
        job.generated.append(tok)
        job.pending.append(tok)
        piece = job.text.push(tok)
        if job.text.stopped:
            self._flush(job, piece)
            self._finish(job, "stop")
            return
        if piece:
            self._flush(job, piece)
        full = job.max_tokens is not None and len(job.generated) >= job.max_tokens
        if full or job.tokens.size + len(job.generated) >= self.n_ctx_seq:
            self._finish(job, "length")

    def _flush(self, job: Job, piece: str) -> None:
        self._emit(job, Event("text", piece, job.pending, job.pending_lp))
        job.pending, job.pending_lp = [], []

    def _finish(self, job: Job, reason: str, evict: bool = False) -> None:
        if reason != "cancelled":
            rest = job.text.finish()
            if rest or job.pending:
                self._flush(job, rest)
        self._release(job, evict or not job.cache_prompt)
        self.stats.requests += 1
        self._emit(job, Event("done", finish_reason=reason, usage=self._usage(job)))

    def _release(self, job: Job, evict: bool) -> None:
        if job in self._running:
            self._running.remove(job)
        if job.seq < 0:
            return
        seq, job.seq = job.seq, -1
        try:
            self.prefix.release(seq)
            if evict and seq in self.prefix.seqs:
                self.prefix.evict(seq, keep=False)
        except Exception:  # noqa: BLE001 -- a lost sequence must not stop the loop; drop its cells
            self.ctx.memory_seq_rm(seq, -1, -1)

    def _end_error(self, job: Job, message: str) -> None:
        self._release(job, evict=True)
        self.stats.requests += 1
        self.stats.requests_failed += 1
        self._emit(job, Event("error", message))

    @staticmethod
    def _usage(job: Job) -> Usage:
        return Usage(int(job.tokens.size), len(job.generated), job.n_cached)

    @staticmethod
    def _emit(job: Job, ev: Event) -> None:
        try:
            job.emit(ev)
        except Exception:  # noqa: BLE001 -- a caller's broken channel must not stop the loop
            job.cancelled = True
