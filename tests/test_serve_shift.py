"""The engine's position shifts: ``--context-shift`` (a request reaching the context drops tokens and goes on) and
``--cache-reuse`` (chunks of a parked sequence moved into a new prompt), with their request fields.

Generation is forced (:class:`ForcedSampler`: the tokens do not depend on the logits) and every token's logprob is
compared with a float64 cache (``ReferenceCache``) replaying the same decodes and the same ``seq_rm``/``seq_add``
with llama-server's amounts, computed here; F32 cache and weights: 1e-4 of the largest logit
(tests/test_runtime.py)."""
from __future__ import annotations

import numpy as np
import pytest

from kvcache_ggml.prefix import check
from kvcache_ggml.runtime import Context, Reference, load_model, make_model
from kvcache_ggml.runtime.tokenizer import Vocab
from kvcache_ggml.serve.engine import Engine, EngineParams
from kvcache_ggml.serve.request import Job
from kvcache_ggml.serve.sampling import ForcedSampler
from kvcache_ggml.serve.text import TextStream

VOCAB = 96
TOL = 1e-4


class Collect(list):
    @property
    def done(self):
        (end,) = [e for e in self if e.kind != "text"]
        return end

    @property
    def logprobs(self):
        return [lp for e in self if e.kind == "text" for lp in e.logprobs]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("shift") / "m.gguf", layers=2, embd=64, heads=4, heads_kv=2, ff=128,
                      vocab=VOCAB, seed=7)


@pytest.fixture(scope="module")
def model(path):
    with load_model(path) as m:
        yield m


def ctx_of(model, n_seq=2):
    """One stream of 256 cells per sequence (the smallest: streams are padded to 256)."""
    return Context(model, n_ctx=256 * n_seq, n_batch=256, n_ubatch=256, n_seq_max=n_seq, kv_unified=False, type_k="f32",
                   type_v="f32", n_threads=2, n_threads_batch=2)


def forced_job(vocab, prompt, forced, **kw):
    sink = Collect()
    j = Job(np.asarray(prompt, np.int32), ForcedSampler(forced), TextStream(vocab), sink.append,
            max_tokens=len(forced), top_logprobs=0, **kw)
    return j, sink


def log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def replay(path, prompt, forced, n_ctx_seq, n_keep, n_discard, add_bos):
    """A float64 cache through the same request: per forced token the reference's logprob and its logits' scale,
    the shifts (n_keep, n_discard) llama-server would make, and the tokens the sequence holds at the end."""
    rc = Reference(path).cache()
    logits = rc.decode(prompt)[-1]
    held, lps, scales, shifts = list(prompt), [], [], []
    for i, tok in enumerate(forced):
        lps.append(log_softmax(logits)[tok])
        scales.append(np.abs(logits).max())
        if i == len(forced) - 1:
            break   # max_tokens: the last token is not decoded
        if len(held) + 1 >= n_ctx_seq:  # its position would reach the context
            k = min(n_ctx_seq - 4, (len(prompt) if n_keep < 0 else n_keep) + add_bos)
            d = min(n_discard or (len(held) - k) // 2, len(held) - k)
            rc.seq_rm(k, k + d)
            rc.seq_add(k + d, len(held), -d)
            held = held[:k] + held[k + d:]
            shifts.append((k, d))
        logits = rc.decode([tok])[-1]
        held.append(tok)
    return np.array(lps), np.array(scales), shifts, held


@pytest.mark.parametrize("n_keep,n_discard", [(0, 0), (5, 0), (-1, 17)])
def test_generation_goes_on_past_the_context(model, path, n_keep, n_discard):
    vocab = Vocab.from_kv(model.gguf_kv)
    rng = np.random.default_rng(n_discard + 10 * n_keep)
    prompt = rng.integers(3, VOCAB, 30).astype(np.int32)
    forced = rng.integers(3, VOCAB, 380).astype(np.int32)
    with ctx_of(model) as ctx:
        eng = Engine(ctx, vocab, EngineParams(n_parallel=1, context_shift=True, warmup=False))
        assert eng.n_ctx_seq == 256
        j, sink = forced_job(vocab, prompt, forced, n_keep=n_keep, n_discard=n_discard)
        eng.submit(j)
        eng.run_until_idle()
        lps, scales, shifts, held = replay(path, prompt, forced, 256, n_keep, n_discard, int(vocab.add_bos))
        assert sink.done.finish_reason == "length" and len(sink.logprobs) == 380
        got = np.array([lp.logprob for lp in sink.logprobs])
        assert [lp.id for lp in sink.logprobs] == forced.tolist()
        assert np.all(np.abs(got - lps) < 2 * TOL * scales)
        assert len(shifts) >= 2 and eng.stats.context_shifts == len(shifts)
        assert j.n_discarded == sum(d for _, d in shifts)
        e = eng.prefix.seqs[0]   # the sequence stays indexed, as it now holds its tokens
        assert np.array_equal(e.tokens, held) and check(eng.prefix) == []


def test_a_shift_moving_cells_shared_with_a_parked_sequence(model, path):
    """Unified cache, through the prefix cache: the shifted sequence's prompt prefix is a parked sequence's cells
    (seq_cp); the shift moves some of them for both, so the index cuts the parked one at n_keep, and keeps the
    shifted one (reindex) as holding its tokens less the discarded ones; its next logits are the float64 cache's."""
    from kvcache_ggml.prefix import PrefixCache

    rng = np.random.default_rng(9)
    system = rng.integers(3, VOCAB, 60)
    first = np.concatenate([system, rng.integers(3, VOCAB, 5)]).astype(np.int32)
    prompt = np.concatenate([system, rng.integers(3, VOCAB, 10)]).astype(np.int32)
    with Context(model, n_ctx=256, n_batch=256, n_ubatch=256, n_seq_max=2, kv_unified=True, type_k="f32",
                 type_v="f32", n_threads=2, n_threads_batch=2) as ctx:
        pc = PrefixCache(ctx)
        for s, p in ((0, first), (1, prompt)):
            adm = pc.attach(p, s)
            pc.advance([(s, p[adm.n_reused:], False)])
        assert adm.n_reused == 60 and adm.source == "device"
        pc.release(0)
        pc.context_shift(1, 4, 30, reindex=True)         # drops [4, 34), moves [34, 70): shared cells among them
        assert pc.seqs[0].tokens.size == 4 and not pc.seqs[0].clean
        kept = np.concatenate([prompt[:4], prompt[34:]])
        assert np.array_equal(pc.seqs[1].tokens, kept) and pc.seqs[1].clean and check(pc) == []
        (row,) = pc.advance([(1, [7], True)])
        rc = Reference(path).cache()
        rc.decode(prompt)
        rc.seq_rm(4, 34)
        rc.seq_add(34, 70, -30)
        want = rc.decode([7])[-1]
        assert float(np.abs(row - want).max()) < TOL * np.abs(want).max()
        assert np.array_equal(pc.seqs[1].tokens, np.append(kept, 7)) and check(pc) == []


def test_without_context_shift_the_request_ends_at_the_context(model):
    vocab = Vocab.from_kv(model.gguf_kv)
    prompt = np.arange(3, 33, dtype=np.int32)
    with ctx_of(model) as ctx:
        eng = Engine(ctx, vocab, EngineParams(n_parallel=1, warmup=False))
        j, sink = forced_job(vocab, prompt, np.full(300, 7))
        eng.submit(j)
        eng.run_until_idle()
        assert sink.done.finish_reason == "length" and len(j.generated) == 256 - 30
        assert eng.stats.context_shifts == 0


def test_cache_reuse_moves_the_chunks_of_the_last_prompt(model, path):
    """A document, then the same with a passage cut out: the tail's chunk is moved, not decoded again, and counts
    as cached; the first token's logprob is the float64 cache's after the same seq_rm/seq_add."""
    vocab = Vocab.from_kv(model.gguf_kv)
    rng = np.random.default_rng(3)
    doc = rng.integers(3, VOCAB, 90).astype(np.int32)
    cut = np.concatenate([doc[:20], doc[35:]])
    with ctx_of(model, n_seq=2) as ctx:
        eng = Engine(ctx, vocab, EngineParams(n_parallel=1, cache_reuse=8, warmup=False))
        for p in (doc, cut):
            j, sink = forced_job(vocab, p, [5])
            eng.submit(j)
            eng.run_until_idle()
        assert sink.done.usage.cached_tokens == 74 and eng.prefix.stats.tokens_shifted == 54
        assert eng.stats.computed_tokens == 90 + 1
        rc = Reference(path).cache()
        rc.decode(doc)
        rc.seq_rm(20, 35)
        rc.seq_add(35, 90, -15)
        rc.seq_rm(74, -1)
        want = rc.decode(cut[74:])[-1]
        assert abs(sink.logprobs[0].logprob - log_softmax(want)[5]) < 2 * TOL * np.abs(want).max()
        # the request's own n_cache_reuse wins: 0 turns it off
        j, sink = forced_job(vocab, doc[40:], [5], n_cache_reuse=0)
        eng.submit(j)
        eng.run_until_idle()
        assert sink.done.usage.cached_tokens == 0


def test_bad_fields_are_refused_at_submission(model):
    vocab = Vocab.from_kv(model.gguf_kv)
    prompt = np.arange(3, 13, dtype=np.int32)
    with ctx_of(model) as ctx:
        eng = Engine(ctx, vocab, EngineParams(n_parallel=1, context_shift=True, warmup=False))
        for kw, msg in [({"n_keep": 11}, r"n_keep must be in \[-1, 10\]"), ({"n_keep": -2}, "n_keep must be in"),
                        ({"n_discard": -1}, "n_discard must be >= 0"),
                        ({"n_cache_reuse": -1}, "n_cache_reuse must be >= 0")]:
            j, _ = forced_job(vocab, prompt, [5], **kw)
            with pytest.raises(ValueError, match=msg):
                eng.submit(j)
        assert eng.queue_depth == 0
        with pytest.raises(ValueError, match="cache_reuse must be >= 0"):
            Engine(ctx, vocab, EngineParams(n_parallel=1, cache_reuse=-1, warmup=False))


def test_a_cache_that_cannot_shift_is_refused_at_start(tmp_path):
    from kvcache_ggml.runtime.gemma_maker import GemmaSpec, make_gemma_model

    path = make_gemma_model(tmp_path / "g.gguf", GemmaSpec(arch="gemma2", n_swa=8, vocab=VOCAB, seed=3))
    with load_model(path) as m, Context(m, n_ctx=512, n_ubatch=32, n_seq_max=1, swa_full=False, n_threads=1,
                                        n_threads_batch=1) as ctx:
        vocab = Vocab.from_kv(m.gguf_kv)
        for kw in ({"context_shift": True}, {"cache_reuse": 16}):
            with pytest.raises(ValueError, match="need a cache that can shift positions"):
                Engine(ctx, vocab, EngineParams(n_parallel=1, warmup=False, **kw))
        eng = Engine(ctx, vocab, EngineParams(n_parallel=1, warmup=False))
        j, _ = forced_job(vocab, np.arange(3, 13, dtype=np.int32), [5], n_cache_reuse=4)
        with pytest.raises(ValueError, match="n_cache_reuse 4: this model's cache cannot shift"):
            eng.submit(j)


# ---------------------------------------------------------------------------------------------- through HTTP

def test_http_fields_options_and_errors(tmp_path):
    """``--cache-reuse`` and ``--context-shift`` through the CLI and the OpenAI client: cached_tokens counts the
    moved chunk, a reply runs past the context, bad fields are 400s naming the field and change nothing."""
    pytest.importorskip("openai")
    from serve_helpers import LiveServer, http, make_chat_model

    from kvcache_ggml.serve.cli import parse_args

    path = make_chat_model(tmp_path / "chat.gguf")
    with pytest.raises(SystemExit):
        parse_args(["--model", str(path), "--cache-reuse", "-1"])
    s = LiveServer(["--model", str(path), "--alias", "tiny", "--parallel", "1", "--n-ctx", "256", "-t", "2",
                    "--cache-reuse", "4", "--context-shift", "--no-fa-tiles"])
    try:
        assert s.engine.tiles is None  # --no-fa-tiles: no measurement, no throwaway rows
        cl = s.client()
        words = " ".join(f"w{i}" for i in range(60))
        r1 = cl.completions.create(model="tiny", prompt=words, max_tokens=1, temperature=0)
        cut = " ".join(f"w{i}" for i in range(60) if not 5 <= i < 15)
        r2 = cl.completions.create(model="tiny", prompt=cut, max_tokens=1, temperature=0)
        n1, n2 = r1.usage.prompt_tokens, r2.usage.prompt_tokens
        assert n2 < n1 and r2.usage.prompt_tokens_details.cached_tokens == n2 - 1  # all but the last: moved
        assert s.engine.prefix.stats.tokens_shifted > n2 // 2
        r = cl.completions.create(model="tiny", prompt="Once upon a time", max_tokens=300, temperature=0,
                                  extra_body={"ignore_eos": True, "n_keep": 2})
        assert r.usage.completion_tokens == 300 and s.engine.snapshot().stats.context_shifts >= 1
        metrics = http(s.url + "/metrics").text
        shifts = [ln for ln in metrics.splitlines() if ln.startswith("kvcache_context_shifts_total ")]
        assert shifts == [f"kvcache_context_shifts_total {s.engine.snapshot().stats.context_shifts}"]
        assert "kvcache_fa_tiles 0" in metrics.splitlines()
        before = s.engine.snapshot().stats.requests
        for field, value, msg in [("n_cache_reuse", -1, "n_cache_reuse must be >= 0"),
                                  ("n_keep", 99, "n_keep must be in [-1, 4]"), ("n_keep", -2, "n_keep must be in"),
                                  ("n_discard", -1, "n_discard must be >= 0"),
                                  ("n_cache_reuse", "4", "n_cache_reuse must be an integer")]:
            r = http(s.url + "/v1/completions", {"model": "tiny", "prompt": "Once upon a time", field: value})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == field and msg in err["message"], (field, err)
        s.wait_idle()
        assert s.engine.snapshot().stats.requests == before
        assert s.engine.prefix.stats.padded_steps == 0
    finally:
        s.close()
