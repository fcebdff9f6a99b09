"""The serving engine: one loop owns a context and its prefix cache; requests join and leave between steps.

Every step is three calls, as vLLM v1 splits it (``schedule`` / execute / ``update_from_output``):

- :meth:`Engine.plan` decides the step and claims what it needs: requests that were cancelled or passed their
  deadline end; waiting requests are admitted (:meth:`PrefixCache.pick_seq` gives a sequence,
  :meth:`PrefixCache.attach` the longest cached prefix of the prompt: those tokens are ``cached_tokens``); the batch
  is chosen under the token budget (``step_tokens``, the context's ``n_batch`` by default) -- the next token of
  every decoding request, then chunks of the prompts still being read (chunked prefill, as llama-server and vLLM do
  it), of ``prompts_per_step`` prompts at most, those with the fewest tokens left first, so that many requests
  arriving together get their first tokens one after another rather than all after the last.  With more than 4
  slots steps are split (``split_steps``): a step takes the generating requests' tokens or the prompt chunks, the
  two kinds in turn while both wait, so that a prompt step is short and a request that arrived during a generating
  step is read in the next one.  Room in the cache is claimed for the batch (:meth:`PrefixCache.claim` evicts parked
  sequences).  When the cache cannot hold the batch, the prompt chunks wait; when it cannot hold the decoding
  requests alone, the request admitted last is the victim: it ends with ``finish_reason`` "length", or goes back to
  the queue if it has no output yet (what it read stays cached for its next admission).  The result is a typed
  :class:`StepPlan`.
- :meth:`Engine.execute` decodes the plan's batch: one :meth:`PrefixCache.advance`, one ``llama_decode``.
- :meth:`Engine.update` applies the logits: prompt progress, one sampled token per request that asked for logits
  (its :class:`Sampler`), text through its :class:`~.text.TextStream` (UTF-8 safe, stop strings held back), and the
  end of a request: an end-of-generation token or a stop string ("stop"), ``max_tokens`` or the sequence's context
  ``n_ctx_seq`` ("length").

A request (:class:`~.request.Job`) moves through :class:`~.request.RequestState`; every move is checked against
:data:`~.request.TRANSITIONS`.

Threads
-------
The engine's state belongs to the thread that runs the steps (:meth:`start`'s thread, or the caller of
:meth:`run_until_idle`).  Other threads talk to it through messages only -- :meth:`submit`, :meth:`cancel` and
:meth:`call` (a function run between two steps, e.g. to evict or inspect the cache) -- and read the immutable
:class:`EngineSnapshot` it publishes after taking its messages, after every step that admits, ends or sends back a
request, and after the others at least every ``_PUBLISH_EVERY`` seconds (:meth:`snapshot`, what ``/metrics`` prints:
its counters may lag a running request's steps by that much, never an idle engine's).  Events reach the caller
through ``Job.emit``, called on the engine's thread; a caller that only queues them there is woken once after each
step that emitted any (:meth:`Engine.set_wake`).  The engine never raises out of its loop: an unexpected error ends
the requests of that step with an error event and the loop goes on.  The engine knows nothing of HTTP.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable

import numpy as np

from ..batch import Batch
from ..prefix import PrefixCache, PrefixParams, common_prefix
from ..runtime.context import DecodeError
from ..runtime.fa_tiles import TILE_Q, FaTiles
from .engine_types import Chunk, EngineParams, EngineSnapshot, EngineStats, QueueFull, StepPlan
from .request import Event, Job, RequestState
from .schedule import choose_batch, lone_chunk, step_kinds
from .shift import check_shift_fields, shift_job
from .results import TokenLogprob, Usage
from .speculative import Drafter, DraftRequest

__all__ = ["EngineParams", "Engine", "QueueFull", "EngineStats", "EngineSnapshot", "Chunk", "StepPlan"]

_perf = time.perf_counter
_S = RequestState
_PUBLISH_EVERY = 0.01  # seconds: the longest a published snapshot lags the steps while no request comes or goes


class Engine:
    """The serving loop over a context: ``submit``/``cancel``/``call`` from any thread; the steps run on the engine
    thread (``start``/``stop``) or on the caller's (``run_until_idle``, for tests and offline replays)."""

    def __init__(self, ctx: Any, vocab: Any, params: EngineParams | None = None,
                 prefix: PrefixParams | None = None, drafter: Drafter | None = None) -> None:
        self.params = params or EngineParams()
        self.ctx = ctx
        self.vocab = vocab
        self.prefix = PrefixCache(ctx, prefix)
        n_batch = int(ctx.cparams.n_batch)
        self.params.check(self.prefix.n_seq, n_batch)
        if drafter is not None:
            drafter.bind(vocab, int(ctx.model.n_vocab), self.prefix.n_seq)
        self.drafter = drafter                         # speculative decoding's drafts (None: none)
        self.budget = self.params.step_tokens or n_batch
        self.n_ctx_seq = int(ctx.n_ctx_seq())
        self.can_shift = bool(ctx.memory_can_shift())  # cache reuse and context shifts need it
        if (self.params.cache_reuse or self.params.context_shift) and not self.can_shift:
            raise ValueError("--cache-reuse and --context-shift need a cache that can shift positions; this model's "
                             "cannot (a sliding-window cache smaller than the context: use swa_full)")
        self.stats = EngineStats()                     # (engine thread)
        self._waiting: deque[Job] = deque()            # in the queue, in order (engine thread)
        self._running: list[Job] = []                  # admitted, in admission order (engine thread)
        self._n_admitted = 0                           # admissions so far (engine thread)
        self._gen_last = False                         # split steps: the last step took the generating requests'
        #                                                tokens (engine thread; schedule.step_kinds)
        self._cv = threading.Condition()               # guards the four fields below
        self._inbox: deque[tuple[str, Any]] = deque()  # messages not yet taken: ("submit" | "cancel", job) or
        #                                                ("call", (fn, future))
        self._inbox_jobs = 0                           # submissions among them
        self._stop = False                             # stop() was called
        self._snapshot = self._make_snapshot()
        self._t_published = _perf()                    # when the snapshot was made (engine thread)
        self._thread: threading.Thread | None = None
        self.ready = threading.Event()                 # set once the engine thread has warmed up
        self._wake: Callable[[], None] | None = None   # called once after events were emitted (set_wake)
        self._emitted = False                          # an event was emitted since the last wake (engine thread)
        self.tiles: FaTiles | None = None              # small steps' throwaway rows (runtime/fa_tiles.py): measured
        #                                                by warm_up() with params.fa_tiles; None: none

    # ------------------------------------------------------------------ messages (any thread)

    def submit(self, job: Job) -> None:
        """Queue ``job``; ``QueueFull`` when ``max_queue`` requests wait already, ValueError for a prompt the
        context cannot hold or with a token id outside the vocabulary."""
        n = int(job.tokens.size)
        if n == 0:
            raise ValueError("the prompt is empty")
        self.prefix.index.check_tokens(job.tokens)  # (an id outside the vocabulary would fail every request's step)
        check_shift_fields(job, self.can_shift)
        if n >= self.n_ctx_seq:
            raise ValueError(f"the prompt has {n} tokens; the context holds {self.n_ctx_seq} per sequence "
                             "(prompt and output together)")
        job.t_submit = _perf()
        job.deadline = job.t_submit + self.params.timeout
        with self._cv:
            if self._stop:
                raise RuntimeError("the engine is stopped")
            snap = self._snapshot
            free_slots = self.params.n_parallel - snap.n_running
            if snap.n_waiting + self._inbox_jobs >= self.params.max_queue + max(free_slots, 0):
                raise QueueFull(f"{self.params.max_queue} requests are waiting already")
            self._inbox.append(("submit", job))
            self._inbox_jobs += 1
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        """End ``job`` at the next step (its client went away); safe from any thread, idempotent."""
        self._post("cancel", job)

    def call(self, fn: Callable[["Engine"], Any]) -> Future:
        """Run ``fn(engine)`` on the engine's thread between two steps (to inspect or change the cache while no step
        runs); its result or exception comes through the returned future.  Without an engine thread the next
        :meth:`run_until_idle` runs it."""
        fut: Future = Future()
        self._post("call", (fn, fut))
        return fut

    def snapshot(self) -> EngineSnapshot:
        """The engine's counters and occupancy as published after its last step (immutable)."""
        return self._snapshot

    @property
    def queue_depth(self) -> int:
        """Requests waiting for admission, the ones not yet taken by the engine included."""
        with self._cv:
            return self._snapshot.n_waiting + self._inbox_jobs

    @property
    def n_running(self) -> int:
        return self._snapshot.n_running

    def set_wake(self, fn: Callable[[], None] | None) -> None:
        """Have ``fn()`` called on the engine thread once after each step (and each batch of messages, and the
        shutdown) that emitted events.  A caller whose ``Job.emit`` only queues the event -- no system call, so the
        engine thread keeps the GIL -- wakes its reader there, once a step for all its requests, where a wake-up
        per event would hand the GIL to the reader thread up to once a request and step.  Before :meth:`start`."""
        if self._thread is not None:
            raise RuntimeError("set_wake() before start()")
        self._wake = fn

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
        """Run steps on this thread until nothing waits or runs (tests and offline replays; not with start())."""
        if self._thread is not None:
            raise RuntimeError("the engine thread runs the steps: run_until_idle() is for an engine not started")
        self._take_messages()
        while self._waiting or self._running:
            self.step()

    def _post(self, kind: str, payload: Any) -> None:
        with self._cv:
            self._inbox.append((kind, payload))
            self._cv.notify()

    # ------------------------------------------------------------------ the loop (engine thread)

    def warm_up(self) -> None:
        """Decode a batch as large as a graph takes and one token, then clear the cache (on the calling thread: the
        engine thread calls it first when ``warmup`` is set); with ``fa_tiles``, then measure the small steps'
        costs (:meth:`FaTiles.calibrate`, which sets :attr:`tiles`).  Nothing may be running."""
        assert not self._running and not self.prefix.seqs, "warm_up() before any request"
        ctx, vocab = self.ctx, self.vocab
        tok = vocab.bos if vocab.bos >= 0 else 0
        n = min(int(ctx.cparams.n_ubatch), self.budget, self.n_ctx_seq - 1)
        ctx.decode(Batch(token=np.full(n, tok, np.int32)))
        ctx.decode(Batch(token=np.array([tok], np.int32)))
        ctx.memory_clear(True)
        if self.params.fa_tiles and self.budget >= TILE_Q:
            self.tiles = FaTiles.calibrate(ctx)

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
            self.step()
        self._take_messages()
        for job in [*self._running, *self._waiting]:
            self._end_error(job, "the server is shutting down")
        self._publish()
        self._wake_readers()

    def _take_messages(self) -> None:
        """Apply the messages that arrived since the last step, then publish the snapshot (in one critical section,
        so that ``queue_depth`` never misses a request between the inbox and the queue)."""
        if not self._inbox:  # (a message posted just now is taken at the next step)
            return
        calls = []
        with self._cv:
            for kind, payload in self._inbox:
                if kind == "submit":
                    self._waiting.append(payload)
                elif kind == "cancel":
                    payload.cancelled = True
                else:
                    calls.append(payload)
            self._inbox.clear()
            self._inbox_jobs = 0
            self._snapshot = self._make_snapshot()
            self._t_published = _perf()
        for fn, fut in calls:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self))
                except BaseException as err:  # noqa: BLE001 -- the caller gets it
                    fut.set_exception(err)
        if calls:
            self._publish()
            self._wake_readers()

    def step(self) -> None:
        """One step: :meth:`plan`, :meth:`execute`, :meth:`update`; then the snapshot is published (when due: see
        the module's docstring) and the readers of the step's events woken (:meth:`set_wake`)."""
        plan = self.plan()
        if plan.chunks:
            try:
                rows = self.execute(plan)
            except DecodeError as err:
                rows = None
                if err.code != 1:
                    self._fail(plan, err)
                else:  # the plan's room was not enough (a cache that reuses cells, like a sliding window's)
                    self.stats.plan_misses += 1
                    self._make_room(plan.chunks, [])
            except Exception as err:  # noqa: BLE001 -- the loop must go on; the step's requests get the error
                rows = None
                self._fail(plan, err)
            if rows is not None:
                self.update(plan, rows)
        snap = self._snapshot
        if (len(self._running) != snap.n_running or len(self._waiting) != snap.n_waiting
                or self.stats.requests != snap.stats.requests or _perf() - self._t_published >= _PUBLISH_EVERY):
            self._publish()
        self._wake_readers()

    def _wake_readers(self) -> None:
        if self._emitted:
            self._emitted = False
            if self._wake is not None:
                try:
                    self._wake()
                except Exception:  # noqa: BLE001 -- a caller's broken wake must not stop the loop
                    pass

    # ------------------------------------------------------------------ plan

    def plan(self) -> StepPlan:
        """Take the messages that arrived, end cancelled and expired requests, admit waiting ones, choose the batch
        under the token budget (with a drafter, each decoding request's draft after its token) and claim its room
        in the cache (evicting parked sequences, then dropping the drafts, then holding prompt chunks back, then
        ending or sending back the request admitted last; with split steps, a prompt step without room generates
        instead).  One request generating alone, with nothing else to do, gets the same plan in fewer calls."""
        c = None if self._inbox or self._waiting or self.drafter is not None else lone_chunk(self._running, _perf())
        if c is not None and self._claim([c]):
            self._gen_last = True
            return StepPlan([c], 1)
        plan = StepPlan()
        self._take_messages()
        self._expire()
        self._admit(plan)
        gen, read = step_kinds(self._running, self._gen_last) if self.params.split() else (True, True)
        self._gen_last, limit = gen, self.params.prompt_limit()
        drafts = self._propose() if gen else {}
        while self._running:
            chunks, held = choose_batch(self._running, drafts, self.budget, limit, gen, read)
            if self._claim(chunks):
                break
            if drafts:  # room is short: the drafts go first
                self.stats.drafts_dropped += len(drafts)
                drafts = {}
                continue
            if not gen and any(j.state is _S.DECODING for j in self._running):
                gen, read, self._gen_last = True, False, True  # no room for the prompts: a generating step
                drafts = self._propose()
                continue
            dec = [c for c in chunks if c.job.state is _S.DECODING]
            if dec and len(dec) < len(chunks) and self._claim(dec):
                chunks, held = dec, held + [c.job for c in chunks if c.job.state is _S.PREFILL]
                break
            plan.victims.append(self._make_room(chunks, dec))
        else:
            chunks, held = [], []
        plan.chunks, plan.held = chunks, held
        plan.n_tokens = sum(c.tokens.size for c in chunks)
        return plan

    def _expire(self) -> None:
        now = _perf()
        for job in [j for j in self._waiting if j.cancelled or now > j.deadline]:
            self._waiting.remove(job)
            if job.cancelled:
                self.stats.requests_cancelled += 1
                self._end(job, "cancelled")
            else:
                self._end_error(job, f"timed out after {self.params.timeout:g} s in the queue")
        for job in [j for j in self._running if j.cancelled or now > j.deadline]:
            if job.cancelled:
                self.stats.requests_cancelled += 1
            self._end(job, "cancelled" if job.cancelled else "length")

    def _admit(self, plan: StepPlan) -> None:
        deferred: list[Job] = []
        while self._waiting and len(self._running) < self.params.n_parallel:
            job = self._waiting[0]
            if job.cache_prompt and self._prefix_coming(job):
                if job.state is _S.WAITING:
                    job.move(_S.WAITING_PREFIX)
                deferred.append(self._waiting.popleft())
                continue
            try:
                n_reuse = self.params.cache_reuse if job.n_cache_reuse is None else job.n_cache_reuse
                if self._slot_idle(job.id_slot):
                    seq = job.id_slot
                elif job.cache_prompt:
                    seq = self.prefix.pick_seq(job.tokens, n_reuse)
                else:  # (nothing is reused: a free sequence, the parked ones kept as long as they can be)
                    seq = self.prefix.free_seq()
            except ValueError:
                break  # every sequence serves a request
            self._waiting.popleft()
            try:
                adm = self.prefix.attach(job.tokens, seq, n_cache_reuse=n_reuse, reuse=job.cache_prompt)
            except Exception as err:  # noqa: BLE001
                self._end_error(job, f"admission failed: {err}")
                continue
            self._n_admitted += 1
            job.seq, job.fed, job.n_cached, job.admitted = seq, adm.n_reused, adm.n_reused, self._n_admitted
            job.move(_S.PREFILL)
            self.stats.prompt_tokens += job.tokens.size
            self.stats.cached_tokens += adm.n_reused
            self._running.append(job)
            plan.admitted.append(job)
        self._waiting.extendleft(reversed(deferred))  # first in the queue again, in their order
        for job in self._waiting:
            if job.state is _S.WAITING_PREFIX and not self._prefix_coming(job):
                job.move(_S.WAITING)

    def _slot_idle(self, s: int) -> bool:
        """Sequence ``s`` (a request's ``id_slot``; -1: none) exists and serves no request."""
        e = self.prefix.seqs.get(s)
        return 0 <= s < self.prefix.n_seq and (e is None or not e.active)

    def _prefix_coming(self, job: Job) -> bool:
        """Whether a request still reading its prompt will soon hold a longer prefix of ``job``'s prompt than the
        cache holds now."""
        readers = [r for r in self._running if r.state is _S.PREFILL]
        if not readers:
            return False
        limit = job.tokens.size - 1
        cached = self.prefix.match(job.tokens, limit).n_tokens
        for r in readers:
            shared = common_prefix(r.tokens, job.tokens, limit)
            if shared > cached and r.fed < shared:
                return True
        return False

    def _propose(self) -> dict[Job, np.ndarray]:
        """Each decoding request's draft from the drafter (none shorter than ``draft_min``, none that would pass
        its ``max_tokens`` or reach the context); empty without a drafter or when it fails."""
        if self.drafter is None:
            return {}
        p, jobs, reqs = self.params, [], []
        for j in self._running:
            if j.state is not _S.DECODING:
                continue
            n = min(p.draft_max, self.n_ctx_seq - (j.tokens.size + len(j.generated) - j.n_discarded) - 1)
            if j.max_tokens is not None:
                n = min(n, j.max_tokens - len(j.generated) - 1)
            if n >= max(p.draft_min, 1):
                jobs.append(j)
                reqs.append(DraftRequest(j.seq, np.concatenate([j.tokens, np.array(j.generated, np.int32)]), n))
        if not reqs:
            return {}
        try:
            got = self.drafter.propose(reqs)
        except Exception:  # noqa: BLE001 -- a failed draft costs speed, never output: the step goes on without
            return {}
        return {j: d[:r.n_max] for j, r, d in zip(jobs, reqs, got) if d.size and d.size >= p.draft_min}

    def _claim(self, chunks: list[Chunk]) -> bool:
        """Make room in the cache for ``chunks`` (parked sequences evicted); whether it is there."""
        need: dict[int, int] = {}
        for c in chunks:
            s = self.prefix.stream_of(c.job.seq)
            need[s] = need.get(s, 0) + c.tokens.size
        return self.prefix.claim(need)

    def _make_room(self, chunks: list[Chunk], decoding: list[Chunk]) -> Job:
        """The cache cannot hold even the decoding requests: the request admitted last ends ("length") or, with no
        output yet, goes back to the head of the queue (the prefix cache keeps what it read)."""
        victim = max((c.job for c in chunks), key=lambda j: j.admitted)
        self.stats.ended_full += 1
        if victim.generated:
            self._end(victim, "length", evict=True)
        else:
            self._release(victim, evict=False)
            victim.fed = victim.n_cached = 0
            victim.move(_S.WAITING)
            self._waiting.appendleft(victim)
        return victim

    # ------------------------------------------------------------------ execute and update

    def execute(self, plan: StepPlan) -> list[np.ndarray | None]:
        """Decode the plan's batch in one call: per chunk, the float32 [n_vocab] logits of its last token (a row of
        the decode's own array) when it samples, else None; a chunk with a draft gets [1 + n_draft, n_vocab], a
        row per token."""
        return self.prefix.advance([(c.job.seq, c.tokens, c.sample) for c in plan.chunks],
                                   all_rows=[i for i, c in enumerate(plan.chunks) if c.n_draft], tiles=self.tiles)

    def update(self, plan: StepPlan, rows: list[np.ndarray | None]) -> None:
        """Apply a decoded step: prompt progress, then one sampled token per chunk that asked for logits (a token
        per accepted draft token more: :meth:`_verify`)."""
        self.stats.steps += 1
        prompt_step = False
        for c, row in zip(plan.chunks, rows):
            job = c.job
            if c.n_draft:
                self._verify(c, row)
                continue
            if job.state is _S.PREFILL:
                prompt_step = True
                job.fed += c.tokens.size
                self.stats.computed_tokens += c.tokens.size
                if not c.sample:
                    continue
                job.move(_S.DECODING)
            self._sampled(job, row)
        self.stats.prompt_steps += prompt_step

    def _verify(self, c: Chunk, rows: np.ndarray) -> None:
        """llama.cpp's rule: a token sampled from each row in turn, going on while it equals the draft's token
        there; each one goes through :meth:`_sampled` (stop strings, max_tokens, the context, end tokens apply per
        token, in order, and may end the request in the middle).  The cells of the draft tokens not accepted
        (after the last row used) are removed, the sequence's index cut to match -- parked already if it ended."""
        job, draft = c.job, c.tokens[1:]
        seq, shifted = job.seq, job.n_discarded
        end = job.tokens.size + len(job.generated) - job.n_discarded  # cells after its first token, positions < end
        i = 0
        while True:
            self._sampled(job, rows[i])
            if (i == draft.size or job.state is _S.FINISHED or job.n_discarded != shifted
                    or job.generated[-1] != draft[i]):
                break
            i += 1
        self.stats.drafts += 1
        self.stats.draft_tokens += draft.size
        self.stats.draft_accepted += i
        if i < draft.size:
            self.prefix.seq_rm(seq, end + i - (job.n_discarded - shifted), -1)

    def _sampled(self, job: Job, logits: np.ndarray) -> None:
        tok = job.sampler.sample(logits)
        if not job.t_first:
            job.t_first = _perf()
        self.stats.generated_tokens += 1
        if self.vocab.is_eog(tok) and not job.sampler.params.ignore_eos:
            self._end(job, "stop")  # (the end token is not output: no text, no logprob)
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
            self._end(job, "stop")
            return
        if piece:
            self._flush(job, piece)
        full = job.max_tokens is not None and len(job.generated) >= job.max_tokens
        if not full and job.tokens.size + len(job.generated) - job.n_discarded >= self.n_ctx_seq:
            shifted = self.params.context_shift and shift_job(self.prefix, job, self.n_ctx_seq, self.vocab.add_bos)
            self.stats.context_shifts += shifted
            full = not shifted
        if full:
            self._end(job, "length")

    # ------------------------------------------------------------------ the end of a request

    def _flush(self, job: Job, piece: str) -> None:
        self._emit(job, Event("text", piece, job.pending, job.pending_lp))
        job.pending, job.pending_lp = [], []

    def _end(self, job: Job, reason: str, evict: bool = False) -> None:
        """``job`` ends normally ("stop", "length" or "cancelled"): its text flushed, its sequence released."""
        if reason != "cancelled":
            rest = job.text.finish()
            if rest or job.pending:
                self._flush(job, rest)
        self._release(job, evict or not job.cache_prompt)
        job.move(_S.FINISHED)
        self.stats.requests += 1
        self._emit(job, Event("done", finish_reason=reason, usage=self._usage(job)))

    def _end_error(self, job: Job, message: str) -> None:
        self._release(job, evict=True)
        if job in self._waiting:
            self._waiting.remove(job)
        job.move(_S.FINISHED)
        self.stats.requests += 1
        self.stats.requests_failed += 1
        self._emit(job, Event("error", message))

    def _fail(self, plan: StepPlan, err: Exception) -> None:
        for c in plan.chunks:
            self._end_error(c.job, f"decode failed: {err}")

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

    @staticmethod
    def _usage(job: Job) -> Usage:
        return Usage(int(job.tokens.size), len(job.generated), job.n_cached)

    def _emit(self, job: Job, ev: Event) -> None:
        self._emitted = True
        try:
            job.emit(ev)
        except Exception:  # noqa: BLE001 -- a caller's broken channel must not stop the loop
            job.cancelled = True

    # ------------------------------------------------------------------ the snapshot

    def _make_snapshot(self) -> EngineSnapshot:
        kv, pst = self.ctx.kv, self.prefix.stats
        return EngineSnapshot(self.stats.copy(), len(self._running), len(self._waiting), kv.get_used(),
                              kv.get_size() * kv.get_n_stream(), pst.hits_device, pst.hits_host, pst.evictions,
                              pst.padded_steps)

    def _publish(self) -> None:
        snap = self._make_snapshot()
        with self._cv:
            self._snapshot = snap
        self._t_published = _perf()
