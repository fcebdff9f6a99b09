"""The runtime (kvcache_ggml.runtime) end to end against a float64 numpy forward pass of the same GGUF.

Every case decodes with ggml on the cache and compares the logits with :mod:`kvcache_ggml.runtime.reference`:
``Reference.forward`` (the whole sequence encoded from scratch) or ``ReferenceCache`` (a float64 cache that replays
the same steps, for context shifts).  F32 weights and an F32 cache: the logits agree to 1e-4 of the largest one.
"""
from __future__ import annotations

import numpy as np
import pytest

from kvcache_ggml.batch import Batch
from kvcache_ggml.cparams import AttentionType, ContextParams, CParams
from kvcache_ggml.hparams import HParams
from kvcache_ggml.runtime import Context, DecodeError, Model, Reference, make_model
from kvcache_ggml.runtime.modelmaker import ModelSpec
from kvcache_ggml.runtime.modelmaker import main as make_model_main

TOL = 1e-4
VOCAB = 64


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("rt") / "tiny.gguf", ModelSpec(layers=2, embd=64, heads=4,
                                                                            heads_kv=2, ff=96, vocab=VOCAB))


@pytest.fixture(scope="module")
def ref(tiny):
    return Reference(tiny)


@pytest.fixture(scope="module")
def model(tiny):
    with Model(tiny) as m:
        yield m


def ctx_of(model, **kw):
    p = dict(n_ctx=256, n_seq_max=4, type_k="f32", type_v="f32", n_threads=1, n_threads_batch=1)
    p.update(kw)
    return Context(model, **p)


def tokens(n, seed=0):
    return np.random.default_rng(seed).integers(3, VOCAB, n).astype(np.int32)


MODES = [pytest.param(fa, uni, id=f"{'fa' if fa else 'nofa'}-{'unified' if uni else 'streams'}")
         for fa in (True, False) for uni in (True, False)]


# ---------------------------------------------------------------------------------------------- generation

@pytest.mark.parametrize("no_perf", [True, False])
def test_no_perf_keeps_the_counts_and_times_only_when_off(model, no_perf):
    """llama.cpp's ``no_perf`` (default True): StepTimes counts every decode, ubatch and token either way; the
    phases' seconds are measured only with no_perf=False -- on the general path (a prompt) and the fused step."""
    with ctx_of(model, no_perf=no_perf, n_seq_max=2) as ctx:
        ctx.decode(Batch(token=tokens(8), seq_id=np.repeat(np.arange(2, dtype=np.int32), 4),
                         pos=np.tile(np.arange(4, dtype=np.int32), 2), logits=np.ones(8, np.int8)))
        for i in range(4):
            ctx.decode(Batch(token=tokens(2, i), pos=np.full(2, 4 + i, np.int32), seq_id=np.arange(2, dtype=np.int32),
                             logits=np.ones(2, np.int8)))
        ctx.decode(Batch(token=tokens(1), pos=np.array([8], np.int32)))  # one token of sequence 0
        tm = ctx.times
        assert (tm.n_decode, tm.n_tokens) == (6, 17) and ctx.fused.n_steps >= 3
        phases = (tm.batch, tm.bookkeeping, tm.inputs, tm.compute)
        assert all(t == 0.0 for t in phases) if no_perf else all(t > 0.0 for t in phases), phases


@pytest.mark.parametrize("fa,unified", MODES)
def test_prompt_then_decode(model, ref, fa, unified):
    toks = tokens(24)
    want = ref.forward(toks)
    with ctx_of(model, flash_attn=fa, kv_unified=unified) as ctx:
        got = [ctx.decode(Batch(token=toks[:16], logits=np.ones(16, np.int8)))]
        for i in range(16, 24):
            got.append(ctx.decode(Batch(token=toks[i:i + 1])))  # positions continue from the memory
        assert ctx.memory_seq_pos_max(0) == 23
        assert ctx.times.n_graph_reused >= 6  # the one-token graphs are built once
    assert rel_err(np.concatenate(got), want) < TOL


@pytest.mark.parametrize("fa,unified", MODES)
def test_several_sequences_in_one_batch(model, ref, fa, unified):
    prompts = [tokens(n, seed) for seed, n in ((1, 7), (2, 11), (3, 5))]
    # interleave the three prompts in one batch, every token an output
    order = sorted(((i, s) for s, p in enumerate(prompts) for i in range(len(p))), key=lambda t: (t[0], t[1]))
    tok = np.array([prompts[s][i] for i, s in order], np.int32)
    pos = np.array([i for i, s in order], np.int32)
    seq = np.array([s for i, s in order], np.int32)
    with ctx_of(model, flash_attn=fa, kv_unified=unified) as ctx:
        got = ctx.decode(Batch(token=tok, pos=pos, seq_id=seq, logits=np.ones(len(tok), np.int8)))
        assert got.shape == (len(tok), VOCAB)
        for s, p in enumerate(prompts):
            rows = np.flatnonzero(seq == s)
            assert rel_err(got[rows], ref.forward(p)) < TOL
        # then one token per sequence, outputs in batch order (the batch lists the sequences backwards)
        nxt = np.array([9, 8, 7], np.int32)
        step = ctx.decode(Batch(token=nxt[::-1].copy(), seq_id=np.array([2, 1, 0], np.int32),
                                logits=np.ones(3, np.int8)))
        for row, s in enumerate((2, 1, 0)):
            want = ref.forward(np.append(prompts[s], nxt[s]))[-1]
            assert rel_err(step[row], want) < TOL
            assert np.array_equal(ctx.get_logits_ith(row), step[row])


@pytest.mark.parametrize("fa,unified", MODES)
def test_one_token_steps_leave_earlier_results_alone(model, ref, fa, unified):
    """The decode fast path reuses the graph and its buffers, never a result: each decode's logits and output ids
    stay as returned through later decodes, and equal a from-scratch forward pass."""
    prompts = [tokens(5, seed) for seed in (21, 22, 23)]
    with ctx_of(model, flash_attn=fa, kv_unified=unified) as ctx:
        for s, p in enumerate(prompts):
            ctx.decode(Batch(token=p, seq_id=np.full(5, s, np.int32)))
        seqs = np.arange(3, dtype=np.int32)
        kept = []
        for step in range(4):
            nxt = np.array([11 + step, 30 - step, 40 + step], np.int32)
            got = ctx.decode(Batch(token=nxt, seq_id=seqs, logits=np.ones(3, np.int8)))
            assert ctx.output_ids.tolist() == [0, 1, 2]
            kept.append((got, got.copy(), ctx.output_ids, nxt))
            prompts = [np.append(p, t) for p, t in zip(prompts, nxt)]
            for s in range(3):
                assert rel_err(got[s], ref.forward(prompts[s])[-1]) < TOL
        ctx.decode(Batch(token=np.array([5], np.int32), seq_id=np.array([1], np.int32)))  # another shape
        for got, copy, ids, _ in kept:
            assert np.array_equal(got, copy) and ids.tolist() == [0, 1, 2]
        assert ctx.output_ids.tolist() == [0] and ctx.logits.shape == (1, VOCAB)


def test_steady_one_token_step_makes_one_graph_compute(model):
    """A one-token step on a reused graph: one C call of the runtime's own (the compute) and the few of the cache's
    input setting, and no call at all to update the memory when nothing is pending."""
    from native_calls import NativeCalls
    with ctx_of(model) as ctx:
        ctx.decode(Batch(token=tokens(6, seed=31)))
        for t in (4, 5):
            ctx.decode(Batch(token=np.array([t], np.int32)))
        with NativeCalls() as nc:
            for t in (6, 7, 8, 9):
                ctx.decode(Batch(token=np.array([t], np.int32)))
        assert ctx.times.update == 0.0
    assert nc.calls["ggml_backend_sched_graph_compute"] == 4
    assert nc.total() <= 4 * 4 and nc.struct_reads <= 4 * 4, (dict(nc.calls), nc.struct_reads)


def test_embeddings_input(model, ref):
    """A batch of embeddings (llama_batch.embd) instead of token ids gives the same logits."""
    toks = tokens(6, seed=14)
    with ctx_of(model) as ctx:
        got = ctx.decode(Batch(embd=ref.tok_embd[toks].astype(np.float32), logits=np.ones(6, np.int8)))
        nxt = ctx.decode(Batch(token=toks[:1]))
    assert rel_err(got, ref.forward(toks)) < TOL
    assert rel_err(nxt, ref.forward(np.append(toks, toks[0]))[-1:]) < TOL


@pytest.mark.parametrize("n_ubatch", [1, 3, 8])
def test_ubatches_and_selected_outputs(model, ref, n_ubatch):
    toks = tokens(10, seed=4)
    flags = np.zeros(10, np.int8)
    flags[[2, 5, 9]] = 1
    with ctx_of(model, n_ubatch=n_ubatch) as ctx:
        got = ctx.decode(Batch(token=toks, logits=flags))
        assert ctx.times.n_ubatch == -(-10 // n_ubatch)
        assert ctx.output_ids.tolist() == [-1, -1, 0, -1, -1, 1, -1, -1, -1, 2]
        assert rel_err(ctx.get_logits_ith(5), ref.forward(toks)[5]) < TOL
    assert rel_err(got, ref.forward(toks)[[2, 5, 9]]) < TOL


@pytest.mark.parametrize("fa,unified", MODES)
def test_seq_cp_fork(model, ref, fa, unified):
    prompt = tokens(12, seed=5)
    with ctx_of(model, flash_attn=fa, kv_unified=unified) as ctx:
        ctx.decode(Batch(token=prompt))
        for s in (1, 2, 3):
            ctx.memory_seq_cp(0, s, -1, -1)
        if unified:
            assert (ctx.kv.v_cells[0].seq_count_many(np.arange(12)) == 4).all()  # shared cells
        cont = np.array([[11, 12], [13, 14], [15, 16], [17, 18]], np.int32)
        for step in range(2):
            got = ctx.decode(Batch(token=cont[:, step].copy(), seq_id=np.arange(4, dtype=np.int32),
                                   logits=np.ones(4, np.int8)))
            for s in range(4):
                want = ref.forward(np.concatenate([prompt, cont[s, :step + 1]]))[-1]
                assert rel_err(got[s], want) < TOL


@pytest.mark.parametrize("fa,unified", MODES)
def test_context_shift(model, ref, fa, unified):
    """seq_rm + seq_add + K-shift, against a float64 cache that rotates the same K entries."""
    toks = tokens(40, seed=6)
    with ctx_of(model, flash_attn=fa, kv_unified=unified) as ctx:
        rc = ref.cache()
        ctx.decode(Batch(token=toks[:30], seq_id=np.full(30, 1, np.int32)))
        rc.decode(toks[:30])
        ctx.context_shift(1, 4, 10)
        rc.seq_rm(4, 14)
        rc.seq_add(14, 30, -10)
        assert ctx.kv.get_has_shift()
        got = ctx.decode(Batch(token=toks[30:36], seq_id=np.full(6, 1, np.int32), logits=np.ones(6, np.int8)))
        assert not ctx.kv.get_has_shift()  # applied by the decode's memory update
        assert ctx.memory_seq_pos_min(1) == 0 and ctx.memory_seq_pos_max(1) == 25
        assert rel_err(got, rc.decode(toks[30:36])) < TOL
        # and a second shift on top of the first
        ctx.context_shift(1, 2, 5)
        rc.seq_rm(2, 7)
        rc.seq_add(7, 26, -5)
        got = ctx.decode(Batch(token=toks[36:37], seq_id=np.full(1, 1, np.int32)))
        assert rel_err(got, rc.decode(toks[36:37])) < TOL


def test_context_shift_one_layer_equals_reencoding(tmp_path):
    """With one layer the cached K/V depend on the token and position only: a shifted cache is a re-encoding."""
    path = make_model(tmp_path / "one.gguf", ModelSpec(layers=1, vocab=VOCAB, seed=3))
    toks = tokens(30, seed=7)
    with Model(path) as m, ctx_of(m) as ctx:
        ctx.decode(Batch(token=toks[:24]))
        ctx.context_shift(0, 3, 9)
        got = ctx.decode(Batch(token=toks[24:30], logits=np.ones(6, np.int8)))
    kept = np.concatenate([toks[:3], toks[12:30]])
    assert rel_err(got, Reference(path).forward(kept)[-6:]) < TOL


def test_seq_div_and_keep(model, ref):
    toks = tokens(8, seed=8)
    with ctx_of(model, kv_unified=True) as ctx:
        ctx.decode(Batch(token=toks, seq_id=np.zeros(8, np.int32)))
        ctx.decode(Batch(token=toks[:3], seq_id=np.ones(3, np.int32)))
        ctx.memory_seq_keep(0)
        assert ctx.memory_seq_pos_max(1) == -1
        ctx.memory_seq_div(0, 4, 8, 2)  # positions 4..7 -> 2,2,3,3
        assert ctx.memory_seq_pos_max(0) == 3
        got = ctx.decode(Batch(token=toks[:2], pos=np.array([4, 5], np.int32), logits=np.ones(2, np.int8)))
    rc = ref.cache()
    rc.decode(toks)
    rc.seq_div(4, 8, 2)
    assert rel_err(got, rc.decode(toks[:2], [4, 5])) < TOL


@pytest.mark.parametrize("fa,unified", MODES)
def test_state_save_restore(model, ref, tmp_path, fa, unified):
    prompt = tokens(9, seed=9)
    with ctx_of(model, flash_attn=fa, kv_unified=unified) as ctx:
        ctx.decode(Batch(token=prompt))
        blob = ctx.state_seq_get_data(0)
        ctx.memory_seq_rm(0, -1, -1)
        assert ctx.memory_seq_pos_max(0) == -1
        assert ctx.state_seq_set_data(blob, 2) == len(blob)
        size = ctx.state_seq_save_file(tmp_path / "s.bin", 2, prompt)
        assert size > len(blob)
        got_tokens = ctx.state_seq_load_file(tmp_path / "s.bin", 3)
        assert got_tokens.tolist() == prompt.tolist()
        got = ctx.decode(Batch(token=np.array([5, 5], np.int32), seq_id=np.array([2, 3], np.int32),
                               logits=np.ones(2, np.int8)))
        want = ref.forward(np.append(prompt, 5))[-1]
        assert rel_err(got[0], want) < TOL and rel_err(got[1], want) < TOL


# ---------------------------------------------------------------------------------------------- weights and types

@pytest.mark.parametrize("wtype,tol", [("f16", 1e-2), ("q8_0", 5e-2)])
def test_quantized_weights(tmp_path, wtype, tol):
    path = make_model(tmp_path / f"{wtype}.gguf", ModelSpec(type=wtype, vocab=VOCAB, seed=1))
    toks = tokens(12, seed=10)
    with Model(path) as m, ctx_of(m) as ctx:
        assert G_type_name(m.layers[0].wq) == wtype
        got = ctx.decode(Batch(token=toks, logits=np.ones(12, np.int8)))
    assert rel_err(got, Reference(path).forward(toks)) < tol


def G_type_name(t):
    from kvcache_ggml import ggml as G
    return G.type_name(G.ttype(t))


@pytest.mark.parametrize("type_kv,tol", [("f16", 1e-2), ("q8_0", 5e-2)])
def test_cache_types(tmp_path, type_kv, tol):
    # q8_0 rows need a head size that is a whole number of 32-element blocks
    path = make_model(tmp_path / "h32.gguf", ModelSpec(embd=64, heads=2, heads_kv=1, vocab=VOCAB, seed=4))
    toks = tokens(10, seed=11)
    with Model(path) as m, ctx_of(m, type_k=type_kv, type_v=type_kv, flash_attn=True) as ctx:
        got = ctx.decode(Batch(token=toks, logits=np.ones(10, np.int8)))
        ctx.context_shift(0, 2, 3)  # the K-shift of a quantized cache: dequantize, rotate, quantize
        shifted = ctx.decode(Batch(token=toks[:1]))
    assert rel_err(got, Reference(path).forward(toks)) < tol
    rc = Reference(path).cache()
    rc.decode(toks)
    rc.seq_rm(2, 5)
    rc.seq_add(5, 10, -3)
    assert rel_err(shifted, rc.decode(toks[:1])) < tol


def test_tied_output_and_device_hook(tmp_path):
    path = make_model(tmp_path / "tied.gguf", ModelSpec(tied=True, vocab=VOCAB, seed=2))
    asked = []

    def dev_layer(il):
        from kvcache_ggml.runtime.model import cpu_device
        asked.append(il)
        return cpu_device()

    toks = tokens(6, seed=12)
    with Model(path, dev_layer=dev_layer) as m, ctx_of(m) as ctx:
        assert m.output is m.tok_embd
        assert sorted(set(asked)) == [0, 1]
        got = ctx.decode(Batch(token=toks, logits=np.ones(6, np.int8)))
    assert rel_err(got, Reference(path).forward(toks)) < TOL


def test_yarn_free_rope_overrides(model, ref):
    """rope_freq_base / rope_freq_scale overrides reach the graph (and the reference takes the same)."""
    toks = tokens(10, seed=13)
    with ctx_of(model, rope_freq_base=5000.0, rope_freq_scale=0.5) as ctx:
        got = ctx.decode(Batch(token=toks, logits=np.ones(10, np.int8)))
    assert rel_err(got, ref.forward(toks, freq_base=5000.0, freq_scale=0.5)) < TOL


# ---------------------------------------------------------------------------------------------- errors, ownership

def test_decode_errors(model):
    with ctx_of(model, n_ctx=256, n_seq_max=1, n_batch=256) as ctx:
        with pytest.raises(DecodeError) as e:
            ctx.decode(Batch(token=np.array([VOCAB], np.int32)))
        assert e.value.code == -1 and "n_vocab" in str(e.value)
        with pytest.raises(DecodeError) as e:
            ctx.decode(Batch(token=np.zeros(300, np.int32)))
        assert e.value.code == -1 and "n_batch" in str(e.value)
        ctx.decode(Batch(token=np.full(200, 5, np.int32)))
        with pytest.raises(DecodeError) as e:
            ctx.decode(Batch(token=np.full(60, 5, np.int32)))
        assert e.value.code == 1
        assert ctx.memory_seq_pos_max(0) == 199  # the failed batch left the cache as it was
        ctx.decode(Batch(token=np.full(56, 5, np.int32)))  # exactly fills the cache
        with pytest.raises(ValueError, match="n_keep"):
            ctx.context_shift(0, 250, 10)


def test_close_is_idempotent(tiny):
    m = Model(tiny)
    ctx = Context(m, n_ctx=256, n_threads=1)
    ctx.close()
    ctx.close()
    assert ctx.closed
    with pytest.raises(ValueError, match="closed"):
        ctx.decode(Batch(token=np.array([3], np.int32)))
    m.close()
    m.close()
    assert m.closed
    with pytest.raises(ValueError, match="closed"):
        Context(m)


@pytest.mark.parametrize("field,value,msg", [
    ("n_batch", 0, "n_batch must be >= 1, got 0"), ("n_seq_max", 0, "n_seq_max must be >= 1, got 0"),
    ("n_seq_max", 257, "n_seq_max must be <= 256, got 257"), ("n_threads", 0, "n_threads must be >= 1"),
    ("n_threads_batch", -2, "n_threads_batch must be >= 1, got -2"), ("n_ctx", -1, "n_ctx must be >= 0"),
    ("n_ubatch", -1, r"n_ubatch must be >= 0 \(0: n_batch\), got -1"), ("graph_cache", -1, "graph_cache must be"),
    ("graph_cache_tokens", 0, "graph_cache_tokens must be >= 1"), ("rope_freq_scale", -0.5, "rope_freq_scale"),
    ("rope_scaling_type", 7, "rope_scaling_type must be one of"), ("attention_type", 2, "attention_type must be"),
    ("type_k", "f13", "type_k: unknown ggml type name 'f13'"), ("type_v", "q9", "type_v: unknown ggml type"),
])
def test_context_params_check_names_the_field_and_the_limit(field, value, msg):
    p = ContextParams(**{field: value})
    before = repr(p)
    with pytest.raises(ValueError, match=msg):
        p.check()
    assert repr(p) == before                                        # nothing changed
    with pytest.raises(ValueError, match=msg):
        CParams.from_hparams(HParams.simple(1, 8, 1, 1), p)         # resolving checks first
    ContextParams().check()                                         # llama.cpp's defaults pass


def test_cache_types_the_model_cannot_take_are_refused_at_creation(tmp_path):
    """As llama_init_from_model: a quantized V without flash attention (its transposed V was written wrong: the
    logits came out silently different), and a block type whose block does not divide the head size (before: a
    ValueError at the first decode, after the server had started)."""
    with Model(make_model(tmp_path / "h32.gguf", ModelSpec(layers=1, embd=64, heads=2, heads_kv=1, ff=64))) as m:
        with pytest.raises(ValueError, match=r"V cache quantization requires flash_attn \(type_v q8_0\)"):
            Context(m, n_ctx=256, type_v="q8_0", flash_attn=False)
        for kw in (dict(type_k="q8_0", flash_attn=False), dict(type_k="q4_0", type_v="iq4_nl", flash_attn=True),
                   dict(type_k="bf16", type_v="bf16", flash_attn=False)):
            Context(m, n_ctx=256, **kw).close()  # (head size 32: any block of 32 divides it)
    with Model(make_model(tmp_path / "h16.gguf", ModelSpec(layers=1, embd=64, heads=4, heads_kv=1, ff=64))) as m:
        for kw, msg in [(dict(type_k="q8_0"), "K cache type q8_0 with block size 32 does not divide n_embd_head_k=16"),
                        (dict(type_v="q4_0"), "V cache type q4_0 with block size 32 does not divide n_embd_head_v=16")]:
            with pytest.raises(ValueError, match=msg):
                Context(m, n_ctx=256, flash_attn=True, **kw)


def test_context_params_resolve_as_llama_context(model):
    """n_ubatch 0 is n_batch and the attention type the model's unless set (llama_context's constructor)."""
    with Context(model, n_ctx=256, n_batch=64, n_ubatch=0) as ctx:
        assert (ctx.cparams.n_batch, ctx.cparams.n_ubatch, ctx.cparams.causal_attn) == (64, 64, True)
    hp = HParams.simple(1, 8, 1, 1)
    assert CParams.from_hparams(hp, ContextParams(n_batch=4096, n_ctx=300)).n_batch == 300  # capped at n_ctx
    c = CParams.from_hparams(hp, ContextParams(n_batch=4096, n_ctx=300, attention_type=AttentionType.NON_CAUSAL))
    assert not c.causal_attn and c.n_batch == 4096                  # no cap without causal attention


def test_bad_params(model, tmp_path):
    with pytest.raises(ValueError, match="n_ubatch"):
        Context(model, n_ubatch=-1)
    with pytest.raises(ValueError, match="unknown ggml type"):
        Context(model, type_k="f13")
    with pytest.raises(FileNotFoundError):
        Model(tmp_path / "missing.gguf")
    with pytest.raises(ValueError, match="multiple of heads"):
        make_model(tmp_path / "x.gguf", ModelSpec(embd=63))
    with pytest.raises(ValueError, match="q8_0 needs ff"):
        make_model(tmp_path / "x.gguf", ModelSpec(type="q8_0", ff=100))


def test_make_model_cli(tmp_path, capsys):
    out = tmp_path / "cli.gguf"
    assert make_model_main([str(out), "--layers", "1", "--embd", "32", "--heads", "2", "--heads-kv", "1",
                            "--ff", "64", "--vocab", "40", "--type", "f16"]) == 0
    assert str(out) in capsys.readouterr().out
    with Model(out) as m:
        hp = m.hparams
        assert (hp.n_layer, hp.n_embd, hp.n_head(0), hp.n_head_kv(0), m.n_vocab) == (1, 32, 2, 1, 40)


def explicit_weights(spec: ModelSpec, n_vocab: int, seed: int = 7) -> dict[str, np.ndarray]:
    """Every tensor of a llama spec, from a generator independent of the maker's own."""
    rng = np.random.default_rng(seed)
    e, kv, ff = spec.embd, spec.embd // spec.heads * spec.heads_kv, spec.ff
    shapes = {"token_embd.weight": (n_vocab, e), "output_norm.weight": (e,)}
    for il in range(spec.layers):
        shapes.update({f"blk.{il}.{k}": v for k, v in (
            ("attn_norm.weight", (e,)), ("attn_q.weight", (e, e)), ("attn_k.weight", (kv, e)),
            ("attn_v.weight", (kv, e)), ("attn_output.weight", (e, e)), ("ffn_norm.weight", (e,)),
            ("ffn_gate.weight", (ff, e)), ("ffn_up.weight", (ff, e)), ("ffn_down.weight", (e, ff)))})
    return {k: (rng.standard_normal(v) * 0.3).astype(np.float32) for k, v in shapes.items()}


def test_make_model_explicit_weights(tmp_path):
    """weights=: the file holds exactly the given arrays under their names (tied head: no output.weight), and the
    runtime computes what the numpy reference computes from them."""
    spec = ModelSpec(layers=2, embd=32, heads=4, heads_kv=2, ff=64, vocab=VOCAB, tied=True)
    w = explicit_weights(spec, VOCAB)
    path = make_model(tmp_path / "given.gguf", spec, weights=w)
    ref = Reference(path)
    assert sorted(ref.w) == sorted(w)
    for name, arr in w.items():
        np.testing.assert_array_equal(ref.w[name], arr, err_msg=name)
    toks = tokens(12, seed=3)
    with Model(path) as m, ctx_of(m) as ctx:
        got = ctx.decode(Batch(token=toks, pos=np.arange(12, dtype=np.int32), logits=np.ones(12, np.int8)))
    assert rel_err(got, ref.forward(toks)) < TOL


def test_make_model_explicit_weights_errors(tmp_path):
    spec = ModelSpec(layers=1, embd=32, heads=4, heads_kv=2, ff=64, vocab=VOCAB)
    w = explicit_weights(spec, VOCAB)
    with pytest.raises(ValueError, match="output.weight is missing"):
        make_model(tmp_path / "x.gguf", spec, weights=w)
    w["output.weight"] = w["token_embd.weight"]
    make_model(tmp_path / "x.gguf", spec, weights=w)
    for name, bad, msg in (("blk.0.ffn_up.weight", np.zeros((64, 31), np.float32), r"has shape \(64, 31\)"),
                           ("blk.0.attn_norm.weight", np.full(32, np.nan, np.float32), "non-finite"),
                           ("blk.1.attn_q.weight", np.zeros((32, 32), np.float32), "does not have")):
        with pytest.raises(ValueError, match=msg):
            make_model(tmp_path / "x.gguf", spec, weights={**w, name: bad})


def test_make_model_cli_weights(tmp_path, capsys):
    """make-model --weights NPZ: layers, embd, ff, vocab and the tied head follow the arrays; Q8_0 storage."""
    spec = ModelSpec(layers=3, embd=64, heads=2, heads_kv=2, ff=96, vocab=50, tied=True)
    w = explicit_weights(spec, 50)
    np.savez(tmp_path / "w.npz", **w)
    out = tmp_path / "cli.gguf"
    assert make_model_main([str(out), "--weights", str(tmp_path / "w.npz"), "--heads", "2", "--heads-kv", "2",
                            "--type", "q8_0"]) == 0
    with Model(out) as m:
        hp = m.hparams
        assert (hp.n_layer, hp.n_embd, m.n_vocab) == (3, 64, 50)
    ref = Reference(out)
    assert "output.weight" not in ref.w and ref.w["blk.0.ffn_up.weight"].shape == (96, 64)
    q = ref.w["blk.2.ffn_down.weight"]  # Q8_0: within half a step (amax/127, an f16 scale) of each block of 32
    step = np.abs(w["blk.2.ffn_down.weight"]).reshape(64, -1, 32).max(-1, keepdims=True) / 127
    assert (np.abs(q - w["blk.2.ffn_down.weight"]).reshape(64, -1, 32) <= step * 0.6).all()


def test_demo_default_run(capsys):
    """`python -m kvcache_ggml demo`: fork, context shift, numpy check, save/restore -- all OK."""
    from kvcache_ggml.demo import main as demo_main
    assert demo_main(["--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "context shift of every sequence" in out
    assert "numpy check" in out and "restore check" in out and out.rstrip().endswith("-> OK")
    assert "M" in out.split("cell map before the context shift:")[1]
