"""The serving engine without HTTP: mixed batches (PrefixCache.attach/advance), chunked prefill, a full cache, the
queue's limits.  Steps run on the test's thread (``run_until_idle``), so every schedule is deterministic.

Reference values come from the runtime alone: each prompt decoded on a fresh context in one batch, then one token a
step, greedy.  The caches are F32, where differently split batches agree to 1e-5 of the largest logit
(docs/prompt-cache.md)."""
from __future__ import annotations

import sys
import threading
import time
from dataclasses import replace

import numpy as np
import pytest

from kvcache_ggml.batch import Batch
from kvcache_ggml.prefix import PrefixParams, check
from kvcache_ggml.runtime import Context, ContextParams, load_model, make_model
from kvcache_ggml.runtime.tokenizer import Vocab
from kvcache_ggml.serve.engine import Engine, EngineParams, QueueFull
from kvcache_ggml.serve.request import TRANSITIONS, Job, RequestState
from kvcache_ggml.serve.protocol import SamplingParams
from kvcache_ggml.serve.sampling import Sampler
from kvcache_ggml.serve.text import TextStream

VOCAB = 96


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_model(tmp_path_factory.mktemp("engine") / "m.gguf", layers=2, embd=64, heads=4, heads_kv=2, ff=128,
                      vocab=VOCAB, seed=7)
    with load_model(path) as m:
        yield m


def params(n_ctx=512, n_seq=4, n_batch=512, unified=True):
    return ContextParams(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=min(n_batch, 512), n_seq_max=n_seq,
                         kv_unified=unified, type_k="f32", type_v="f32", n_threads=2, n_threads_batch=2)


def alone(model, prompt, n):
    """Greedy tokens and their logits rows for ``prompt`` served alone on a fresh context."""
    with Context(model, params()) as ctx:
        logits = ctx.decode(Batch(token=np.asarray(prompt, np.int32)))[-1]
        toks, rows = [], []
        for _ in range(n):
            rows.append(logits.copy())
            toks.append(int(np.argmax(logits)))
            logits = ctx.decode(Batch(token=np.array(toks[-1:], np.int32)))[0]
    return toks, rows


def prompts(n, length, seed=0, shared=0):
    rng = np.random.default_rng(seed)
    head = rng.integers(3, VOCAB, shared)
    return [np.concatenate([head, rng.integers(3, VOCAB, length - shared)]).astype(np.int32) for _ in range(n)]


class Collect:
    """A job's events, as the HTTP layer would receive them."""

    def __init__(self):
        self.events = []

    def __call__(self, ev):
        self.events.append(ev)

    @property
    def done(self):
        ends = [e for e in self.events if e.kind != "text"]
        assert len(ends) == 1, self.events
        return ends[0]

    @property
    def tokens(self):
        return [t for e in self.events if e.kind == "text" for t in e.tokens]


def serve_all(eng, vocab, ps, n):
    """Submit one greedy job of ``n`` tokens per prompt, run the engine until idle; the jobs' sinks."""
    sinks = []
    for p in ps:
        j, s = job(vocab, p, n)
        eng.submit(j)
        sinks.append(s)
    eng.run_until_idle()
    return sinks


def job(vocab, prompt, n, **sp):
    sink = Collect()
    p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **sp)
    j = Job(np.asarray(prompt, np.int32), Sampler(p, VOCAB, [vocab.eos]), TextStream(vocab), sink, max_tokens=n,
            top_logprobs=0)
    return j, sink


# ---------------------------------------------------------------------------------------------- the prefix cache

def test_advance_mixes_prompt_chunks_and_steps(model):
    """attach + advance: a prompt read in chunks beside another sequence's one-token steps gives that prompt's
    logits alone, and the index stays exact (the audit compares it with the cells)."""
    from kvcache_ggml.prefix import PrefixCache
    a, b = prompts(2, 30, seed=1)
    ref_a, rows_a = alone(model, a, 4)
    ref_b, rows_b = alone(model, b, 1)
    with Context(model, params()) as ctx:
        pc = PrefixCache(ctx)
        assert pc.attach(a, 0).n_decoded == 30 and pc.attach(a[:1], 2).n_decoded == 1
        pc.release(2)
        out = pc.advance([(0, a, True)])
        assert pc.attach(b, 1).n_reused == 0
        toks_a = [int(np.argmax(out[0]))]
        for k in range(0, 30, 12):  # b in chunks of 12 beside a's steps
            last = k + 12 >= 30
            out = pc.advance([(0, toks_a[-1:], True), (1, b[k:k + 12], last)])
            assert (out[1] is not None) == last
            np.testing.assert_allclose(out[0], rows_a[len(toks_a)], rtol=0, atol=1e-5 * np.abs(rows_a[0]).max())
            toks_a.append(int(np.argmax(out[0])))
        np.testing.assert_allclose(out[1], rows_b[0], rtol=0, atol=1e-5 * np.abs(rows_b[0]).max())
        assert toks_a == ref_a and int(np.argmax(out[1])) == ref_b[0]
        assert check(pc) == []
        with pytest.raises(ValueError, match="distinct"):
            pc.advance([(0, [5], True), (0, [6], True)])
        with pytest.raises(ValueError, match="n_batch"):
            pc.advance([(0, np.full(513, 5), True)])
        with pytest.raises(RuntimeError, match="serves no request"):
            pc.advance([(3, [5], True)])
        assert check(pc) == []


# ---------------------------------------------------------------------------------------------- the engine

def test_chunked_prefill_gives_each_prompt_its_tokens_alone(model):
    """A token budget of 16 per step: two long prompts are read in chunks while two short requests generate; every
    request's greedy tokens equal its prompt served alone."""
    vocab = Vocab.from_kv(model.gguf_kv)
    ps = prompts(2, 6, seed=2) + prompts(2, 40, seed=3)
    refs = [alone(model, p, 6)[0] for p in ps]
    with Context(model, params()) as ctx:
        eng = Engine(ctx, vocab, EngineParams(n_parallel=4, step_tokens=16))
        sinks = serve_all(eng, vocab, ps, 6)
        for s, ref in zip(sinks, refs):
            assert s.done.finish_reason == "length" and s.tokens == ref
        # 6 + 6 + 40 + 40 prompt tokens at <= 16 a step, the first token of each request with its last chunk
        assert eng.stats.computed_tokens == 92 and eng.stats.steps >= 92 // 16
        assert eng.stats.generated_tokens == 24
        assert check(eng.prefix) == []


def test_shared_prefix_is_reused_between_requests(model):
    vocab = Vocab.from_kv(model.gguf_kv)
    a, b = prompts(2, 48, seed=4, shared=40)
    with Context(model, params()) as ctx:
        eng = Engine(ctx, vocab, EngineParams(n_parallel=2))
        ja, sa = job(vocab, a, 4)
        eng.submit(ja)
        eng.run_until_idle()
        jb, sb = job(vocab, b, 4)
        eng.submit(jb)
        eng.run_until_idle()
        assert sa.done.usage.cached_tokens == 0 and sb.done.usage.cached_tokens == 40
        assert eng.stats.computed_tokens == 48 + 8
        assert sb.tokens == alone(model, b, 4)[0]



def test_cache_prompt_false_decodes_the_whole_prompt_and_keeps_nothing(model):
    """llama-server's ``cache_prompt: false``: nothing cached is reused (the whole prompt is decoded, so the answer
    does not depend on what the cache held) and nothing of the request stays; a parked sequence holding its prefix
    is left as it was.  The same request with caching reuses that prefix."""
    from kvcache_ggml.prefix import HostParams
    vocab = Vocab.from_kv(model.gguf_kv)
    a, b = prompts(2, 48, seed=5, shared=40)
    with Context(model, params(n_seq=3)) as ctx:
        eng = Engine(ctx, vocab, EngineParams(n_parallel=1), PrefixParams(host=HostParams(budget=1 << 20)))
        serve_all(eng, vocab, [a], 4)
        held = ctx.kv.get_used()
        jb, sb = job(vocab, b, 4)
        jb.cache_prompt = False
        eng.submit(jb)
        eng.run_until_idle()
        assert sb.done.usage.cached_tokens == 0 and eng.stats.computed_tokens == 48 + 48
        assert sb.tokens == alone(model, b, 4)[0]
        ref = alone(model, b, 1)[1][0]
        first = eng.prefix.stats
        assert first.host_saves == 0 and first.evictions == 1      # b's own sequence, dropped at its end
        assert ctx.kv.get_used() == held and eng.prefix.match(a).n_tokens == a.size   # a's sequence as it was
        assert check(eng.prefix) == []
        jc, sc = job(vocab, b, 1)                                 # the same with caching: a's 40 tokens reused
        eng.submit(jc)
        eng.run_until_idle()
        assert sc.done.usage.cached_tokens == 40 and sc.tokens == [int(np.argmax(ref))]
@pytest.mark.parametrize("split", [False, True])
def test_a_full_cache_ends_requests_with_length_and_never_crashes(model, split):
    """64 cells for three requests that would each take 60: the engine ends the last admitted ("length") as room
    runs out, and the others go on; every request gets its end event; the cells stay consistent.  With
    ``split_steps`` too, where a prompt step without room generates instead."""
    vocab = Vocab.from_kv(model.gguf_kv)
    with Context(model, params(n_ctx=64, n_seq=3, n_batch=64)) as ctx:
        eng = Engine(ctx, vocab, EngineParams(n_parallel=3, split_steps=split))
        sinks = serve_all(eng, vocab, prompts(3, 12, seed=5), None)
        reasons = [s.done.finish_reason for s in sinks]
        assert reasons.count("length") == 3 and eng.stats.ended_full >= 1
        assert all(s.done.kind == "done" for s in sinks)
        assert sum(len(s.tokens) for s in sinks) >= 64 - 3 * 12
        assert check(eng.prefix) == []


@pytest.mark.parametrize("split", [False, True])
def test_a_prompt_without_room_waits_while_the_generating_request_goes_on(model, split):
    """256 cells: one request (100-token prompt) generates; a second (100 tokens) arrives once the first holds more
    than 156 cells.  Its prompt waits -- with ``split_steps``, each of its prompt steps generates instead -- until
    the first ends at its context ("length"), then it is read and gets its greedy tokens served alone."""
    vocab = Vocab.from_kv(model.gguf_kv)
    pa, pb = prompts(1, 100, seed=70)[0], prompts(1, 100, seed=71)[0]
    with Context(model, params(n_ctx=256, n_seq=2, n_batch=256)) as ctx:
        assert ctx.kv.get_size() == 256
        eng = Engine(ctx, vocab, EngineParams(n_parallel=2, split_steps=split))
        (a, sa), (b, sb) = job(vocab, pa, 1000), job(vocab, pb, 4)
        eng.submit(a)
        while len(a.generated) < 60:
            eng.step()
        eng.submit(b)
        steps = []
        while not sa.events or sa.events[-1].kind == "text":
            plan = eng.plan()
            steps.append([c.job for c in plan.chunks])
            assert b.state is RequestState.PREFILL and b.fed == 0
            eng.update(plan, eng.execute(plan))
        assert all(s == [a] for s in steps) and len(steps) == 256 - 100 - 60
        assert sa.done.finish_reason == "length" and len(a.generated) == 256 - 100
        eng.run_until_idle()
        assert sb.done.finish_reason == "length" and sb.tokens == alone(model, pb, 4)[0]
        assert check(eng.prefix) == []


def test_queue_limit_prompt_limit_and_cancel(model):
    vocab = Vocab.from_kv(model.gguf_kv)
    with Context(model, params(n_ctx=256, n_seq=2)) as ctx:
        eng = Engine(ctx, vocab, EngineParams(n_parallel=2, max_queue=1))
        jobs = [job(vocab, p, 50) for p in prompts(4, 8, seed=6)]
        for j, _ in jobs[:3]:  # two slots and one place in the queue
            eng.submit(j)
        with pytest.raises(QueueFull, match="1 requests are waiting"):
            eng.submit(jobs[3][0])
        with pytest.raises(ValueError, match="300 tokens.*256 per sequence"):
            eng.submit(job(vocab, np.full(300, 5), 1)[0])
        # ids outside the vocabulary are refused at submission: planned, they failed the step (every request in it)
        with pytest.raises(ValueError, match=rf"token id {VOCAB + 3} out of range \[0, n_vocab={VOCAB}\)"):
            eng.submit(job(vocab, [5, 6, VOCAB + 3], 1)[0])
        with pytest.raises(ValueError, match=r"token ids must be in \[0, 2\*\*31\), got \[-2, 7\]"):
            eng.submit(job(vocab, [5, -2, 7], 1)[0])
        eng.cancel(jobs[0][0])
        eng.run_until_idle()
        assert jobs[0][1].done.finish_reason == "cancelled" and jobs[0][1].tokens == []
        assert [s.done.finish_reason for _, s in jobs[1:3]] == ["length", "length"]
        assert eng.stats.requests_cancelled == 1
        with pytest.raises(ValueError, match="n_parallel must be in"):
            Engine(ctx, vocab, EngineParams(n_parallel=3))
        assert check(eng.prefix) == []


def test_requests_arriving_together_compute_a_shared_prefix_once(model):
    """Four prompts sharing 60 tokens, submitted at once, read 16 tokens a step: the first computes the shared part,
    the others wait for it and reuse it (prompt tokens computed: the ideal, 60 + each one's own 10), and each gets
    its tokens alone."""
    vocab = Vocab.from_kv(model.gguf_kv)
    ps = prompts(4, 70, seed=8, shared=60)
    refs = [alone(model, p, 3)[0] for p in ps]
    with Context(model, params()) as ctx:
        eng = Engine(ctx, vocab, EngineParams(n_parallel=4, step_tokens=16))
        sinks = serve_all(eng, vocab, ps, 3)
        assert eng.stats.computed_tokens == 60 + 4 * 10
        assert [s.done.usage.cached_tokens for s in sinks] == [0, 60, 60, 60]
        assert [s.tokens for s in sinks] == refs
        assert check(eng.prefix) == []


def _lone_trace(model, monkeypatch, lone: bool):
    """Five phases on one engine (two slots, 256 cells shared): a request alone; one generating to the context's
    end (room made by evicting the parked one); one joined by a second while generating, then cancelled; one past
    its deadline while generating; one cancelled while generating alone.  What every request got, the counters,
    the cells, and whether each plan was the lone one (``lone``: the engine's; else switched off, every step
    planned in full)."""
    import kvcache_ggml.serve.engine as E
    from kvcache_ggml.serve.schedule import lone_chunk

    taken = []

    def chunk(running, now):
        c = lone_chunk(running, now) if lone else None
        taken.append(c is not None)
        return c

    monkeypatch.setattr(E, "lone_chunk", chunk)
    vocab = Vocab.from_kv(model.gguf_kv)
    with Context(model, params(n_ctx=256, n_seq=3)) as ctx:
        eng = Engine(ctx, vocab, EngineParams(n_parallel=2))
        jobs = [job(vocab, p, n) for p, n in zip(prompts(6, 40, seed=31, shared=12), [30, None, 40, 20, 50, 50])]
        script = "s0 idle s1 idle s2 5 s3 10 c2 idle s4 6 d4 idle s5 4 c5 idle"  # (submit, steps, cancel, deadline)
        for op in script.split():
            if op == "idle":
                eng.run_until_idle()
            elif op.isdigit():
                for _ in range(int(op)):
                    eng.step()
            else:
                j = jobs[int(op[1:])][0]
                {"s": eng.submit, "c": eng.cancel, "d": lambda j: setattr(j, "deadline", 0.0)}[op[0]](j)
        assert check(eng.prefix) == []
        got = [(s.tokens, s.done.kind, s.done.finish_reason) for _, s in jobs]
        return got, replace(eng.stats), replace(eng.prefix.stats), ctx.state_get_data(), taken


def test_a_request_generating_alone_gets_the_general_plan(model, monkeypatch):
    """The plan of a request generating alone (``schedule.lone_chunk``, fewer calls) against the general plan of the
    same step: the same tokens and ends, counters and cells over the phases of :func:`_lone_trace`, where the lone
    plan was taken in most steps."""
    on = _lone_trace(model, monkeypatch, True)
    off = _lone_trace(model, monkeypatch, False)
    assert on[:4] == off[:4]
    (j0, j1, j2, j3, j4, j5), stats = on[0], on[1]
    assert j0[2] == "length" and len(j0[0]) == 30 and j1[2] == "length" and len(j1[0]) == 256 - 40
    assert j2[2] == "cancelled" and j3[2] == "length" and len(j3[0]) == 20 and j4[2] == "length"
    assert 6 <= len(j4[0]) < 50 and j5[2] == "cancelled" and len(j5[0]) < 50
    assert stats.requests_cancelled == 2 and on[2].evictions >= 1
    assert sum(on[4]) > 250 and not any(off[4])


def test_a_request_past_its_deadline_in_the_queue_gets_an_error(model):
    """``timeout``: requests still waiting when their deadline has passed end with an error event, running ones
    are not started; nothing stays in the cells."""
    vocab = Vocab.from_kv(model.gguf_kv)
    with Context(model, params()) as ctx:
        eng = Engine(ctx, vocab, EngineParams(n_parallel=1, timeout=1e-9))
        sinks = serve_all(eng, vocab, prompts(2, 8, seed=9), 4)
        assert [s.done.kind for s in sinks] == ["error", "error"]
        assert all("timed out" in s.done.text for s in sinks)
        assert eng.stats.requests_failed == 2 and eng.stats.computed_tokens == 0
        assert sum(c.get_used() for c in ctx.kv.v_cells) == 0


# ---------------------------------------------------------------------------------------------- request states

def test_every_transition_is_driven_and_no_other_is_allowed(model):
    """Four schedules drive every edge of TRANSITIONS (collected from the requests' histories), and a move the table
    does not list raises."""
    vocab = Vocab.from_kv(model.gguf_kv)
    seen: set[tuple[RequestState, RequestState]] = set()

    def edges(jobs):
        for j, _ in jobs:
            path = [*j.history, j.state]
            seen.update(zip(path, path[1:]))
            assert j.state is RequestState.FINISHED

    with Context(model, params()) as ctx:
        # WAITING -> WAITING_PREFIX -> PREFILL -> DECODING -> FINISHED: four users with one system prompt
        eng = Engine(ctx, vocab, EngineParams(n_parallel=4, step_tokens=16))
        jobs = [job(vocab, p, 2) for p in prompts(4, 40, seed=11, shared=32)]
        for j, _ in jobs:
            eng.submit(j)
        eng.step()
        S = RequestState
        assert [j.state for j, _ in jobs] == [S.PREFILL, S.WAITING_PREFIX, S.WAITING_PREFIX, S.WAITING_PREFIX]
        eng.cancel(jobs[3][0])  # WAITING_PREFIX -> FINISHED
        eng.run_until_idle()
        assert jobs[3][1].done.finish_reason == "cancelled"
        edges(jobs)
        # WAITING_PREFIX -> WAITING (the prefix is read, but both places are taken), WAITING -> FINISHED (cancelled
        # in the queue)
        eng = Engine(ctx, vocab, EngineParams(n_parallel=2, step_tokens=8))
        a, b = prompts(2, 30, seed=12, shared=24)
        ja, jb, jc = job(vocab, a, 6), job(vocab, b, 2), job(vocab, prompts(1, 5, seed=13)[0], 8)
        je = job(vocab, prompts(1, 5, seed=14)[0], 2)
        for j, _ in (ja, jb, jc, je):
            eng.submit(j)
        for _ in range(6):
            eng.step()
        assert jb[0].state is RequestState.WAITING and RequestState.WAITING_PREFIX in jb[0].history
        assert je[0].state is RequestState.WAITING
        eng.cancel(je[0])
        eng.run_until_idle()
        assert je[1].done.finish_reason == "cancelled"
        edges([ja, jb, jc, je])
    with Context(model, params(n_ctx=256, n_seq=2, n_batch=64)) as ctx:
        # PREFILL -> WAITING: two prompts of 150 fill 256 cells; the one admitted last goes back to the queue
        eng = Engine(ctx, vocab, EngineParams(n_parallel=2, step_tokens=64))
        ps = prompts(2, 150, seed=15)
        jobs = [job(vocab, ps[0], 12), job(vocab, ps[1], 3)]
        for j, _ in jobs:
            eng.submit(j)
        eng.run_until_idle()
        assert eng.stats.ended_full == 1 and jobs[1][0].history.count(RequestState.PREFILL) == 2
        assert [s.tokens for _, s in jobs] == [alone(model, ps[0], 12)[0], alone(model, ps[1], 3)[0]]
        edges(jobs)
        # PREFILL -> FINISHED: cancelled while its prompt is read
        eng = Engine(ctx, vocab, EngineParams(n_parallel=2, step_tokens=8))
        jf = job(vocab, prompts(1, 40, seed=16)[0], 3)
        eng.submit(jf[0])
        eng.step()
        assert jf[0].state is RequestState.PREFILL
        eng.cancel(jf[0])
        eng.run_until_idle()
        edges([jf])
    want = {(a, b) for a, bs in TRANSITIONS.items() for b in bs}
    assert seen == want, sorted((a.name, b.name) for a, b in want - seen)
    j = job(vocab, [5, 6], 1)[0]
    with pytest.raises(AssertionError, match="WAITING -> DECODING"):
        j.move(RequestState.DECODING)
    assert j.state is RequestState.WAITING and j.history == []


def test_the_wake_comes_once_a_step_that_emitted(model):
    """set_wake: the function is called once after each step that emitted events, however many requests did, and
    not after a step that emitted none; the events themselves arrive through each job's emit, in order."""
    vocab = Vocab.from_kv(model.gguf_kv)
    ps = prompts(1, 20, seed=31) + prompts(2, 6, seed=32)   # (the first steps read the long prompt: no event)
    with Context(model, params()) as ctx:
        eng = Engine(ctx, vocab, EngineParams(n_parallel=3, step_tokens=8, prompts_per_step=0))  # (arrival order)
        wakes = []
        eng.set_wake(lambda: wakes.append(eng.stats.steps))
        js = [job(vocab, p, 3) for p in ps]
        for j, _ in js:
            eng.submit(j)
        counts = []
        while eng.n_running or eng.queue_depth:
            before = len(wakes)
            n_events = sum(len(s.events) for _, s in js)
            eng.step()
            emitted = sum(len(s.events) for _, s in js) - n_events
            counts.append((emitted, len(wakes) - before))
        assert all(w == (1 if e else 0) for e, w in counts), counts
        assert counts[0] == (0, 0) and max(e for e, _ in counts) > 1   # a step with no event; one with several
        for (j, s), p in zip(js, ps):
            assert s.done.finish_reason == "length" and s.tokens == alone(model, p, 3)[0]
        eng.start()
        with pytest.raises(RuntimeError, match="before start"):
            eng.set_wake(None)
        eng.stop()


@pytest.mark.parametrize("every", [0.0, 1e9])
def test_the_snapshot_follows_every_change_of_requests_and_the_counters_at_its_interval(model, monkeypatch, every):
    """The snapshot is published after each step that admits, ends or sends back a request; after the others only
    once _PUBLISH_EVERY has passed (0: every step; 1e9: none), so an idle engine's snapshot is always current."""
    import kvcache_ggml.serve.engine as engine_module
    monkeypatch.setattr(engine_module, "_PUBLISH_EVERY", every)
    vocab = Vocab.from_kv(model.gguf_kv)
    ps = prompts(2, 12, seed=41)
    with Context(model, params()) as ctx:
        eng = Engine(ctx, vocab, EngineParams(n_parallel=1))
        js = [job(vocab, p, n) for p, n in zip(ps, (5, 3))]
        for j, _ in js:
            eng.submit(j)
        seen = []
        while eng.n_running or eng.queue_depth:
            before = (eng.stats.requests, len(eng._running), len(eng._waiting))
            eng.step()
            snap = eng.snapshot()
            changed = before != (eng.stats.requests, len(eng._running), len(eng._waiting))
            seen.append((changed, snap.stats == eng.stats))
            if changed or every == 0.0:
                assert snap.stats == eng.stats and snap.n_running == len(eng._running)
                assert snap.n_waiting == len(eng._waiting) and snap.kv_used == ctx.kv.get_used()
        assert eng.snapshot().stats == eng.stats and eng.snapshot().n_running == 0
        if every:  # (the steps that only generated left the counters of the step before)
            assert [c for c, _ in seen] == [fresh for _, fresh in seen] and seen.count((False, False)) >= 4
        for (j, s), p, n in zip(js, ps, (5, 3)):
            assert s.tokens == alone(model, p, n)[0]


def test_plan_execute_update_are_separate_steps(model):
    """plan() claims the room and admits without decoding; execute() decodes exactly the plan's tokens; update()
    samples: the cells grow by the plan's n_tokens, and the first token equals the prompt served alone."""
    vocab = Vocab.from_kv(model.gguf_kv)
    p = prompts(1, 20, seed=17)[0]
    with Context(model, params()) as ctx:
        eng = Engine(ctx, vocab, EngineParams(n_parallel=1, step_tokens=12))
        j, sink = job(vocab, p, 2)
        eng.submit(j)
        assert eng.queue_depth == 1 and eng.n_running == 0
        plan = eng.plan()             # takes the message, admits, claims 12 cells: decodes nothing
        assert plan.admitted == [j] and plan.n_tokens == 12 and [c.sample for c in plan.chunks] == [False]
        assert ctx.kv.get_used() == 0 and j.state is RequestState.PREFILL
        eng.update(plan, eng.execute(plan))
        assert ctx.kv.get_used() == 12 and j.fed == 12 and sink.events == []
        plan = eng.plan()
        assert plan.n_tokens == 8 and plan.chunks[0].sample
        eng.update(plan, eng.execute(plan))
        assert j.state is RequestState.DECODING and j.generated == alone(model, p, 1)[0]


@pytest.mark.parametrize("per_step", [1, 2])
def test_prompts_per_step_reads_the_fewest_tokens_left_first(model, per_step):
    """Four prompts arriving together (30, 8, 20, 8 tokens) with a budget of 24: each step reads at most
    ``per_step`` prompts, those with the fewest tokens left first (arrival order among equals), beside every
    generating request's token; each request's greedy tokens are its prompt's served alone."""
    vocab = Vocab.from_kv(model.gguf_kv)
    lengths = [30, 8, 20, 8]
    ps = [prompts(1, n, seed=40 + i)[0] for i, n in enumerate(lengths)]
    refs = [alone(model, p, 3)[0] for p in ps]
    with Context(model, params()) as ctx:
        eng = Engine(ctx, vocab, EngineParams(n_parallel=4, step_tokens=24, prompts_per_step=per_step))
        sinks, index = [], {}
        for i, p in enumerate(ps):
            j, sk = job(vocab, p, 3)
            eng.submit(j)
            sinks.append(sk)
            index[id(j)] = i
        left, generating = list(lengths), set()
        while any(not sk.events or sk.events[-1].kind == "text" for sk in sinks):  # (until every request ended)
            plan = eng.plan()
            # the brute-force plan: every generating request's token, then up to per_step reading prompts by
            # (tokens left, arrival), each as much as the budget leaves
            budget = 24 - len(generating)
            want = [(i, 1) for i in sorted(generating)]
            for i in sorted((i for i in range(4) if left[i]), key=lambda i: (left[i], i))[:per_step]:
                if budget > 0:
                    want.append((i, min(left[i], budget)))
                    budget -= want[-1][1]
            got = [(index[id(c.job)], c.tokens.size) for c in plan.chunks]
            assert sorted(got) == sorted(want)
            eng.update(plan, eng.execute(plan))
            for i, n in want:
                if left[i]:
                    left[i] -= n
                    if not left[i]:
                        generating.add(i)
            generating -= {i for i in generating if sinks[i].events and sinks[i].events[-1].kind != "text"}
        for sk, ref in zip(sinks, refs):
            assert sk.done.finish_reason == "length" and sk.tokens == ref
        assert check(eng.prefix) == []
    with pytest.raises(ValueError, match="prompts_per_step must be >= 0"):
        EngineParams(prompts_per_step=-1).check(4, 512)


def test_prompts_per_step_and_split_steps_unset_act_only_with_more_than_four_slots():
    """Unset, steps are split with more than 4 slots, and read one prompt a step there (two when not split); no
    limit up to 4 slots.  A value given is kept, 0 too."""
    assert [EngineParams(n_parallel=n).split() for n in (1, 4, 5, 8)] == [False, False, True, True]
    assert [EngineParams(n_parallel=n).prompt_limit() for n in (1, 4, 5, 8)] == [0, 0, 1, 1]
    assert EngineParams(n_parallel=8, split_steps=False).prompt_limit() == 2
    assert EngineParams(n_parallel=2, split_steps=True).prompt_limit() == 0
    assert EngineParams(n_parallel=8, split_steps=False).split() is False
    assert EngineParams(n_parallel=2, split_steps=True).split() is True
    assert EngineParams(n_parallel=8, prompts_per_step=0).prompt_limit() == 0
    assert EngineParams(n_parallel=2, prompts_per_step=3).prompt_limit() == 3



def test_split_steps_alternate_and_late_arrivals_join_the_prompt_step(model):
    """``split_steps``: requests arrive while others generate (one submitted while each listed step computes, after
    its plan).  No step holds both a generating token and a prompt chunk; while both kinds run, a step is of the
    other kind than the step before; a generating step holds every generating request's token, a prompt step up to
    two prompts, the fewest tokens left first -- a request that arrived while the step before computed included.
    Every request gets its prompt's greedy tokens served alone."""
    vocab = Vocab.from_kv(model.gguf_kv)
    lengths = [10, 40, 12, 7, 9, 20]
    arrive_at = {0: [0, 1], 2: [2], 3: [3], 5: [4], 12: [5]}  # step -> requests submitted while it computes
    ps = [prompts(1, n, seed=60 + i)[0] for i, n in enumerate(lengths)]
    refs = [alone(model, p, 5)[0] for p in ps]
    with Context(model, params()) as ctx:
        eng = Engine(ctx, vocab, EngineParams(n_parallel=4, step_tokens=24, prompts_per_step=2, split_steps=True))
        jobs = [job(vocab, p, 5) for p in ps]
        index = {id(j): i for i, (j, _) in enumerate(jobs)}
        eng.submit(jobs[0][0])
        prev, n, seen, came, reads = None, 0, set(), [], 0
        while n < 6 or any(not s.events or s.events[-1].kind == "text" for _, s in jobs):
            plan = eng.plan()
            gen = sorted(index[id(j)] for j, _ in jobs if j.state is RequestState.DECODING)
            read = [j for j, _ in jobs if j.state is RequestState.PREFILL]
            kind = "read" if read and (not gen or prev == "gen") else "gen" if gen else None
            if kind == "gen":
                want = [(i, 1) for i in gen]
            else:
                left, want = 24, []
                for j in sorted(read, key=lambda j: (j.tokens.size - j.fed, j.admitted))[:2]:
                    want.append((index[id(j)], min(j.tokens.size - j.fed, left)))
                    left -= want[-1][1]
            assert sorted((index[id(c.job)], c.tokens.size) for c in plan.chunks) == sorted(want), (n, kind)
            seen.add((kind, bool(gen and read)))
            late = [i for i in want if i[0] in came] if kind == "read" else []
            seen.update(("late", i) for i, _ in late)
            came = [i for i in arrive_at.get(n, []) if i and kind == "gen"]
            for i in arrive_at.get(n, []):
                if i:  # (the first was submitted before the first plan)
                    eng.submit(jobs[i][0])
            if plan.chunks:
                eng.update(plan, eng.execute(plan))
                reads += kind == "read"
            prev, n = kind, n + 1
        assert ("gen", True) in seen and ("read", True) in seen  # both kinds ran beside each other
        assert sorted(i for k, i in seen if k == "late") == [3, 5]  # read in the step after the one they came in
        assert eng.stats.prompt_steps == reads and eng.stats.steps == n
        assert [s.tokens for _, s in jobs] == refs
        assert check(eng.prefix) == []


# ---------------------------------------------------------------------------------------------- threads

def test_many_clients_with_cancellations_and_bad_requests_under_fast_thread_switching(model):
    """64 client threads against the engine thread, Python switching threads every microsecond: random
    cancellations, empty and too-long prompts between them, retries on QueueFull.  At the end every accepted request
    has exactly one end event, the counters add up, the published snapshot equals the engine's counters, and the
    cells hold exactly the parked sequences (audited, then all evicted: nothing left)."""
    vocab = Vocab.from_kv(model.gguf_kv)
    rng = np.random.default_rng(21)
    ps = prompts(64, 12, seed=22, shared=6)
    plan = [(p, int(rng.integers(1, 6)), bool(rng.random() < 0.3)) for p in ps]
    greedy = {}

    def alone_tokens(p, n):
        key = p.tobytes()
        if key not in greedy:
            greedy[key] = alone(model, p, 5)[0]
        return greedy[key][:n]

    results: list = [None] * 64
    bad = []
    old = sys.getswitchinterval()
    with Context(model, params(n_ctx=512, n_seq=4)) as ctx:
        eng = Engine(ctx, vocab, EngineParams(n_parallel=4, max_queue=8, warmup=False)).start()

        def client(i):
            p, n, cancel = plan[i]
            if i % 8 == 3:  # a bad request first
                for toks in (np.zeros(0, np.int32), np.full(600, 5, np.int32)):
                    try:
                        eng.submit(job(vocab, toks, 1)[0])
                    except ValueError as err:
                        bad.append(str(err))
            j, sink = job(vocab, p, n)
            while True:
                try:
                    eng.submit(j)
                    break
                except QueueFull:
                    threading.Event().wait(0.001)
            if cancel:
                eng.cancel(j)
            t0 = time.monotonic()
            while not any(e.kind != "text" for e in list(sink.events)):
                threading.Event().wait(0.001)
                assert time.monotonic() - t0 < 60, f"client {i} got no end"
            results[i] = (j, sink)

        sys.setswitchinterval(1e-6)
        try:
            threads = [threading.Thread(target=client, args=(i,)) for i in range(64)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
        finally:
            sys.setswitchinterval(old)
        assert len(bad) == 16 and all("empty" in b or "600 tokens" in b for b in bad)
        done = [s.done for _, s in results]
        assert all(d.kind == "done" for d in done)
        st = eng.call(lambda e: replace(e.stats)).result(30)
        cancelled = sum(d.finish_reason == "cancelled" for d in done)
        assert st.requests == 64 and st.requests_cancelled == cancelled and st.requests_failed == 0
        assert st.generated_tokens == sum(d.usage.completion_tokens for d in done)
        admissions = [j.history.count(RequestState.PREFILL) for j, _ in results]
        assert st.prompt_tokens == sum(n * len(j.tokens) for n, (j, _) in zip(admissions, results))
        for (j, s), (p, n, c) in zip(results, plan):
            assert s.done.finish_reason == "cancelled" or s.tokens == alone_tokens(p, n)
        assert eng.snapshot().stats == st and eng.snapshot().n_running == 0 and eng.queue_depth == 0
        audit = eng.call(lambda e: check(e.prefix)).result(30)
        assert audit == []

        def drop(e):
            for x in e.prefix.entries():
                e.prefix.evict(x.seq_id, keep=False)
            return e.ctx.kv.get_used()
        assert eng.call(drop).result(30) == 0
        eng.stop()


# ---------------------------------------------------------------------------------------------- replays

def test_replayed_workload_reuses_everything_it_shares(model):
    """A chat workload replayed with forced replies, two requests at a time, on a cache with room for everything:
    each turn reuses exactly the longest prefix it shares with what was served before (its own history, the system
    prompt), outputs are the forced tokens, and each first-token logits row equals the prompt decoded alone."""
    from _workload import chat_workload, format_served, replay
    vocab = Vocab.from_kv(model.gguf_kv)
    turns = chat_workload(3, 3, 32, user_len=(4, 10), reply_len=5, vocab=VOCAB, seed=1)
    for unified in (True, False):
        with Context(model, params(n_ctx=1024, unified=unified)) as ctx:
            eng = Engine(ctx, vocab, EngineParams(n_parallel=2))
            served = replay(eng, turns, keep_logits=True)
            seen, want = [], []
            for t in turns:
                n = t.tokens.size
                want.append(max((min(common_len(s, t.tokens), n - 1) for s in seen), default=0))
                seen.append(np.concatenate([t.tokens, t.reply[:-1]]))
            assert [s.n_cached for s in served] == want, format_served(served)
            assert [s.output for s in served] == [t.reply.tolist() for t in turns]
            assert eng.stats.computed_tokens == sum(t.tokens.size for t in turns) - sum(want)
            for t, s in zip(turns, served):
                ref = alone(model, t.tokens, 1)[1][0]
                np.testing.assert_allclose(s.first_logits, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
            assert check(eng.prefix) == []
    with Context(model, params()) as ctx:  # no reuse: every prompt token computed
        eng = Engine(ctx, vocab, EngineParams(n_parallel=2), PrefixParams(reuse=False))
        served = replay(eng, turns[:4], together=True)
        assert [s.n_cached for s in served] == [0] * 4 and "total" in format_served(served)
        assert eng.stats.computed_tokens == sum(t.tokens.size for t in turns[:4])


def common_len(a, b):
    m = min(len(a), len(b))
    neq = np.flatnonzero(np.asarray(a[:m]) != np.asarray(b[:m]))
    return int(neq[0]) if neq.size else m


def test_stats_copy_is_a_detached_copy_of_every_counter():
    """EngineStats.copy (the snapshot's copy after every step) carries each counter and shares nothing after."""
    from dataclasses import fields

    from kvcache_ggml.serve.engine import EngineStats
    st = EngineStats(**{f.name: 10 + i for i, f in enumerate(fields(EngineStats))})
    cp = st.copy()
    assert cp == st and cp is not st
    for f in fields(EngineStats):
        setattr(st, f.name, getattr(st, f.name) + 1)
        assert getattr(cp, f.name) == getattr(st, f.name) - 1
