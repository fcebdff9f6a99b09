"""Speculative decoding in the serving engine (serve/speculative.py): drafts from the request's own tokens
(NgramDrafter) or from a second model (ModelDrafter), verified in the shared batch by llama.cpp's rule.

The reference is the same engine without a drafter: every request's tokens, its finish reason, and the cells and
index entry its sequence keeps when it ends must be the same with any drafter -- one whose every draft is accepted
(the target model itself), one whose drafts are mostly rejected (another random model: rollback), prompt lookup.
The caches are F32 (docs/prompt-cache.md: differently split batches agree to 1e-5 of the largest logit); each test
first checks that no greedy choice of the reference is within twice that of a tie, so a flip could not be hidden
noise.  The n-gram lookup is checked against a brute-force search."""
from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest

from kvcache_ggml.batch import Batch
from kvcache_ggml.generate import main as generate_main
from kvcache_ggml.prefix import PrefixCache, check
from kvcache_ggml.runtime import Context, ContextParams, Reference, load_model, make_model
from kvcache_ggml.runtime.modelmaker import ModelSpec
from kvcache_ggml.runtime.tokenizer import Vocab
from kvcache_ggml.serve.app import metrics_text
from kvcache_ggml.serve.engine import Engine, EngineParams
from kvcache_ggml.serve.protocol import SamplingParams
from kvcache_ggml.serve.request import Job
from kvcache_ggml.serve.sampling import Sampler
from kvcache_ggml.serve.slots import slots_info
from kvcache_ggml.serve.speculative import ModelDrafter, NgramDrafter, check_vocab_compatible
from kvcache_ggml.serve.text import TextStream

VOCAB = 96
GPT2_VOCAB = Path(__file__).parent / "data" / "vocab" / "ggml-vocab-gpt-2.gguf"


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec")
    return {"target": make_model(d / "t.gguf", layers=2, embd=64, heads=4, heads_kv=2, ff=128, vocab=VOCAB, seed=7),
            "other": make_model(d / "o.gguf", layers=1, embd=32, heads=2, heads_kv=1, ff=64, vocab=VOCAB, seed=21),
            "gpt2": make_model(d / "g.gguf", ModelSpec(layers=2, embd=64, heads=4, heads_kv=2, ff=96, seed=6,
                                                       ctx=1024, vocab_from=str(GPT2_VOCAB)))}


@pytest.fixture(scope="module")
def models(paths):
    with load_model(paths["target"]) as t, load_model(paths["other"]) as o:
        yield {"target": t, "other": o}


def params(n_ctx=512, n_seq=4, n_batch=256):
    return ContextParams(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_seq_max=n_seq, kv_unified=True,
                         type_k="f32", type_v="f32", n_threads=2, n_threads_batch=2)


def prompts(n, period, reps, seed):
    """Prompts that repeat a random phrase (prompt lookup finds drafts in them)."""
    rng = np.random.default_rng(seed)
    return [np.tile(rng.integers(3, VOCAB, period), reps).astype(np.int32) for _ in range(n)]


class Sink:
    def __init__(self):
        self.events, self.seq = [], -1

    def __call__(self, ev):
        self.events.append(ev)

    @property
    def tokens(self):
        return [t for e in self.events if e.kind == "text" for t in e.tokens]

    @property
    def text(self):
        return "".join(e.text for e in self.events if e.kind == "text")

    @property
    def done(self):
        ends = [e for e in self.events if e.kind != "text"]
        assert len(ends) == 1, self.events
        return ends[0]


def run(model, vocab, ps, max_tokens, drafter=None, *, n_parallel=3, ctx_params=None, stops=(), temperature=0.0,
        cache_prompt=None, **engine):
    """Serve one request per prompt; per request (tokens, finish reason, the cells and index entry of its sequence
    right after the step it ended in), the cells used at the end, the engine's stats."""
    with Context(model, ctx_params or params()) as ctx:
        eng = Engine(ctx, vocab, EngineParams(n_parallel=n_parallel, warmup=False, **engine), drafter=drafter)
        jobs = []
        for i, (p, n) in enumerate(zip(ps, max_tokens)):
            sink = Sink()
            sp = SamplingParams(temperature=temperature, seed=100 + i, max_tokens=n, ignore_eos=True)
            j = Job(p, Sampler(sp, VOCAB, [vocab.eos]), TextStream(vocab, stops), sink, max_tokens=n,
                    cache_prompt=True if cache_prompt is None else cache_prompt[i])
            eng.submit(j)
            jobs.append((j, sink))
        ended: dict[int, tuple] = {}
        for _ in range(10_000):
            if len(ended) == len(jobs):
                break
            eng.step()
            for k, (j, sink) in enumerate(jobs):
                if j.seq >= 0:
                    sink.seq = j.seq
                if k not in ended and any(e.kind != "text" for e in sink.events):
                    s, e = sink.seq, eng.prefix.seqs.get(sink.seq)
                    ended[k] = (ctx.memory_seq_pos_min(s), ctx.memory_seq_pos_max(s),
                                None if e is None else e.tokens.tolist())
            assert check(eng.prefix) == []
        out = [(s.tokens, s.done.finish_reason, ended[k], s.text) for k, (_, s) in enumerate(jobs)]
        return out, ctx.kv.get_used(), eng.stats


def margins_ok(model, vocab, ps, n):
    """The reference's greedy choices, recomputed one token a step alone, are never within 2e-5 of the largest
    logit of a tie (so two rows that each agree with it to 1e-5, however the batch was split, pick the same)."""
    for p in ps:
        with Context(model, params()) as ctx:
            row = ctx.decode(Batch(token=p))[-1]
            for _ in range(n):
                top = np.sort(row)[-2:]
                assert top[1] - top[0] > 2e-5 * np.abs(row).max()
                row = ctx.decode(Batch(token=np.array([np.argmax(row)], np.int32)))[0]


def draft_ctx(model, n_seq=4):
    return Context(model, params(n_seq=n_seq))


# ---------------------------------------------------------------------------------------------- the n-gram lookup

def brute_lookup(h, n_min, n_max, n):
    h = list(h)
    size = len(h)
    for k in range(min(n_max, size - 1), n_min - 1, -1):
        pat = h[size - k:]
        for i in range(size - 2, k - 2, -1):  # i: the last token of an earlier occurrence
            if h[i - k + 1:i + 1] == pat:
                return h[i + 1:i + 1 + n]
    return []


def test_ngram_lookup_is_the_most_recent_longest_match():
    rng = np.random.default_rng(0)
    for trial in range(400):
        alphabet = int(rng.integers(2, 6))
        h = rng.integers(0, alphabet, int(rng.integers(1, 40))).astype(np.int32)
        n_min = int(rng.integers(1, 4))
        n_max = n_min + int(rng.integers(0, 4))
        n = int(rng.integers(1, 6))
        got = NgramDrafter(n_min, n_max).lookup(h, n)
        assert got.dtype == np.int32 and got.tolist() == brute_lookup(h, n_min, n_max, n), (h, n_min, n_max, n)
    # a hand-checked case: "1 2 3 9 1 2 3 7 ... 1 2 3" -> the later "1 2 3" is followed by 7 8
    h = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3], np.int32)
    assert NgramDrafter(2, 4).lookup(h, 2).tolist() == [7, 8]
    assert NgramDrafter(4, 4).lookup(h, 2).tolist() == []       # "5 1 2 3" never came before
    with pytest.raises(ValueError, match="n_min 3, n_max 2"):
        NgramDrafter(3, 2)


# ---------------------------------------------------------------------------------------------- greedy equality

@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("kind", ["ngram", "same", "other"])
def test_greedy_output_and_cells_equal_decoding_without_draft(models, kind, split):
    """Four users, three at a time, max_tokens ending some of them in the middle of an accepted run: the tokens,
    finish reasons, the ended sequences' cells and index entries, and the cells used at the end are those of the
    engine without a drafter -- with steps mixed and split (``split_steps``: the drafts in the generating steps,
    the fourth prompt read in a step of its own)."""
    model = models["target"]
    vocab = Vocab.from_kv(model.gguf_kv)
    ps = prompts(4, 7, 4, seed=3)
    n = [17, 23, 9, 30]
    margins_ok(model, vocab, ps, max(n))
    ref, used, _ = run(model, vocab, ps, n, split_steps=split)
    dctx = None
    if kind == "ngram":
        drafter = NgramDrafter(1, 4)
    else:
        dctx = draft_ctx(models["target" if kind == "same" else "other"])
        drafter = ModelDrafter(dctx, vocab, p_min=0.0)
    try:
        got, used_d, st = run(model, vocab, ps, n, drafter, draft_max=5, split_steps=split)
    finally:
        if dctx is not None:
            dctx.close()
    assert [g[:3] for g in got] == [r[:3] for r in ref] and used_d == used
    assert st.generated_tokens == sum(n) and st.drafts > 0
    if kind == "same":  # the target drafting for itself: every draft is accepted
        assert st.draft_accepted == st.draft_tokens > st.drafts
    elif kind == "other":  # mostly rejected: the rollback ran
        assert st.draft_accepted < st.draft_tokens
    else:
        assert 0 < st.draft_accepted <= st.draft_tokens


def test_seeded_sampling_is_the_same_with_drafts(models):
    """Temperature 0.9, seeded: one draw per output token from the logits of the accepted tokens, so drafting
    changes nothing (a draft is accepted only where the draw equals it)."""
    model = models["target"]
    vocab = Vocab.from_kv(model.gguf_kv)
    ps = prompts(3, 5, 5, seed=4)
    ref, used, _ = run(model, vocab, ps, [20, 20, 20], temperature=0.9)
    with draft_ctx(model) as dctx:
        for drafter in (NgramDrafter(1, 3), ModelDrafter(dctx, vocab, p_min=0.0)):
            got, used_d, st = run(model, vocab, ps, [20, 20, 20], drafter, temperature=0.9, draft_max=4)
            assert [g[:3] for g in got] == [r[:3] for r in ref] and used_d == used and st.drafts > 0


def test_a_stop_string_in_an_accepted_run_ends_there(models):
    """A stop string completed by the 8th token of an accepted run of 6 (draft_max 5): the request stops with the
    same text, reason and cells as without a draft; the rest of the run is discarded."""
    model = models["target"]
    vocab = Vocab.from_kv(model.gguf_kv)
    ps = prompts(2, 6, 4, seed=5)
    plain, _, _ = run(model, vocab, ps, [24, 24])
    toks = plain[0][0]
    stop = vocab.detokenize(toks[6:8])
    full = vocab.detokenize(toks)
    assert stop and full.find(stop) >= len(vocab.detokenize(toks[:6]))  # (the first occurrence is there)
    ref, used, _ = run(model, vocab, ps, [24, 24], stops=[stop])
    assert ref[0][1] == "stop"
    with draft_ctx(model) as dctx:
        got, used_d, st = run(model, vocab, ps, [24, 24], ModelDrafter(dctx, vocab, p_min=0.0), stops=[stop],
                              draft_max=5)
    assert got == ref and used_d == used and st.draft_accepted > 0


def test_drafts_give_way_to_room_and_budget(models):
    """256 cells: while B (220 prompt tokens, 5 generated, not cached) runs beside A, the drafts do not fit and are
    dropped (nobody is ended for room); after B, A drafts.  Then a token budget of 4 for two requests: drafts cut
    to fit.  The same output and cells as without drafts."""
    model = models["target"]
    vocab = Vocab.from_kv(model.gguf_kv)
    ps = [prompts(1, 5, 4, seed=6)[0], prompts(1, 220, 1, seed=9)[0]]
    kw = dict(n_parallel=2, ctx_params=params(n_ctx=256, n_seq=2), cache_prompt=[True, False])
    ref, used, st0 = run(model, vocab, ps, [30, 5], **kw)
    with draft_ctx(model) as dctx:  # (the target itself, p_min 0: every draft as long as allowed)
        got, used_d, st = run(model, vocab, ps, [30, 5], ModelDrafter(dctx, vocab, p_min=0.0), draft_max=16, **kw)
    assert got == ref and used_d == used and st.ended_full == st0.ended_full == 0
    assert st.drafts_dropped > 0 and st.draft_accepted > 0
    ps = prompts(2, 8, 5, seed=6)
    ref, used, _ = run(model, vocab, ps, [20, 20], n_parallel=2, step_tokens=4)
    got, used_d, st = run(model, vocab, ps, [20, 20], NgramDrafter(1, 4), n_parallel=2, step_tokens=4,
                          draft_max=16)
    assert got == ref and used_d == used and 0 < st.draft_tokens <= 3 * st.drafts  # (4 - one token each)


# ---------------------------------------------------------------------------------------------- pieces

def test_advance_all_rows_gives_every_row_of_a_part(models):
    """advance(all_rows=[i]): part i's [n, n_vocab] rows, each the logits a one-token-a-step decode gives there;
    an index out of range is refused before anything is decoded."""
    model = models["target"]
    p = prompts(1, 9, 2, seed=7)[0]
    with Context(model, params()) as ctx:
        steps = [ctx.decode(Batch(token=p[:10]))[-1]] + [ctx.decode(Batch(token=p[k:k + 1]))[0]
                                                           for k in range(10, 18)]
    with Context(model, params()) as ctx:
        pc = PrefixCache(ctx)
        pc.attach(p[:10], 0)
        pc.attach(p[:3], 1)
        with pytest.raises(ValueError, match=r"all_rows \[2\] out of range \[0, 2\)"):
            pc.advance([(0, p[:10], True), (1, p[:3], False)], all_rows=[2])
        assert ctx.kv.get_used() == 0 and pc.seqs[0].tokens.size == 0
        out = pc.advance([(0, p[:10], True), (1, p[:3], False)])
        out = pc.advance([(0, p[10:18], False), (1, p[3:5], True)], all_rows=[0])
        assert out[0].shape == (8, VOCAB) and out[1].shape == (VOCAB,)
        scale = np.abs(steps[0]).max()
        np.testing.assert_allclose(out[0], np.stack(steps[1:]), rtol=0, atol=1e-5 * scale)
        assert check(pc) == [] and pc.seqs[0].tokens.tolist() == p[:18].tolist()


def test_bad_drafters_and_draft_limits_are_refused_and_change_nothing(models, paths):
    model = models["target"]
    vocab = Vocab.from_kv(model.gguf_kv)
    gvocab = Vocab.from_gguf(paths["gpt2"])
    with pytest.raises(ValueError, match=r"\(50257 tokens\).*\(96 tokens\)"):
        check_vocab_compatible(vocab, gvocab)
    other = copy.copy(vocab)
    other.tokens = list(vocab.tokens)
    other.tokens[40] = "<changed>"
    with pytest.raises(ValueError, match="token 40 is '<changed>'"):
        check_vocab_compatible(vocab, other)
    with Context(model, params()) as ctx:
        for bad, msg in ((EngineParams(draft_max=0), "draft_max must be >= 1.*got draft_max 0"),
                         (EngineParams(draft_max=4, draft_min=5), "draft_min 5")):
            with pytest.raises(ValueError, match=msg):
                Engine(ctx, vocab, bad, drafter=NgramDrafter())
        with load_model(paths["gpt2"]) as g, Context(g, params()) as gctx:
            with pytest.raises(ValueError, match=r"\(50257 tokens\).*\(96 tokens\)"):
                Engine(ctx, vocab, EngineParams(warmup=False), drafter=ModelDrafter(gctx, gvocab))
            assert gctx.kv.get_used() == 0
        with draft_ctx(model, n_seq=2) as dctx:
            with pytest.raises(ValueError, match="draft context has 2 sequences; the target has 4"):
                Engine(ctx, vocab, EngineParams(warmup=False), drafter=ModelDrafter(dctx, vocab))
        with pytest.raises(ValueError, match="p_min must be in"):
            ModelDrafter(ctx, vocab, p_min=1.5)
        assert ctx.kv.get_used() == 0
        eng = Engine(ctx, vocab, EngineParams(warmup=False, draft_max=4), drafter=NgramDrafter(1, 4))
        sink = Sink()
        eng.submit(Job(prompts(1, 5, 4, seed=8)[0], Sampler(SamplingParams(temperature=0), VOCAB),
                       TextStream(vocab), sink, max_tokens=12))
        eng.run_until_idle()
        assert sink.done.finish_reason == "length" and len(sink.tokens) == 12
        text = metrics_text(eng)
        st = eng.stats
        for name, value in (("drafts_total", st.drafts), ("draft_n_total", st.draft_tokens),
                            ("draft_n_accepted_total", st.draft_accepted)):
            assert f"\nkvcache_{name} {value}\n" in text
        assert st.drafts > 0
        assert [x["speculative"] for x in slots_info(eng)] == [True] * 4   # (llama-server's GET /slots field)


# ---------------------------------------------------------------------------------------------- generate

def test_generate_with_drafts_prints_the_reference_text(paths, capsys):
    prompt = "The cat sat on the mat. The cat sat"
    vocab = Vocab.from_gguf(paths["gpt2"])
    ids = vocab.tokenize(prompt)
    ref = Reference(paths["gpt2"])
    for _ in range(8):
        ids.append(int(np.argmax(ref.forward(ids)[-1])))
    want = prompt + vocab.detokenize(ids[-8:])
    base = ["--model", str(paths["gpt2"]), "--prompt", prompt, "--n-predict", "8", "--threads", "1", "--n-ctx",
            "256", "--n-par", "2"]
    for extra in (["--spec-ngram", "--spec-ngram-min", "1"], ["-md", str(paths["gpt2"]), "--draft-p-min", "0"]):
        assert generate_main(base + extra) == 0
        cap = capsys.readouterr()
        assert cap.out.splitlines() == [want, f"--- sequence 1: {want}"]
        assert "draft tokens accepted" in cap.err
    for bad, msg in ((["--spec-ngram", "--draft-max", "0"], "--draft-max must be >= 1, got 0"),
                     (["--spec-ngram", "-md", str(paths["gpt2"])], "choose one drafter"),
                     (["--spec-ngram", "--draft-min", "20"], "--draft-min must be in")):
        with pytest.raises(SystemExit):
            generate_main(base + bad)
        assert msg in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"\(96 tokens\).*\(50257 tokens\)"):
        generate_main(base + ["-md", str(paths["target"])])


def test_serve_cli_refuses_bad_draft_options(paths, capsys):
    """``serve``: --draft-max 0 and a draft model of another vocabulary stop the start-up with the reason."""
    from kvcache_ggml.serve.cli import open_service, parse_args

    base = ["--model", str(paths["target"]), "-c", "256", "-np", "2", "-t", "1"]
    with pytest.raises(SystemExit):
        parse_args(base + ["--spec-ngram", "--draft-max", "0"])
    assert "--draft-max must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"\(50257 tokens\).*\(96 tokens\)"):
        open_service(parse_args(base + ["-md", str(paths["gpt2"])]))
    model, ctx, svc = open_service(parse_args(base + ["--spec-ngram", "--draft-max", "4"]))
    try:
        assert isinstance(svc.engine.drafter, NgramDrafter) and svc.engine.params.draft_max == 4
    finally:
        ctx.close()
        model.close()
