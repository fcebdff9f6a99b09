"""Gemma 2 / Gemma 3 on the iSWA cache against a float64 numpy forward pass, and SWA checkpoints for prompt reuse.

The models are tiny random-weight GGUFs from :mod:`kvcache_ggml.runtime.gemma_maker` with a window of 8 and a
256-cell SWA cache, decoded for 300 positions so the SWA cache wraps.  F32 weights and cache; the reference runs
the FFN's GELU through float16 as ggml does, so the logits agree to 2e-3 of the largest one (the float16 GELU turns
ggml's float32 rounding into an occasional float16 step).
"""
from __future__ import annotations

import numpy as np
import pytest

from kvcache_ggml import ggml as G
from kvcache_ggml.batch import Batch
from kvcache_ggml.cache import KVCache
from kvcache_ggml.hparams import HParams, SwaType
from kvcache_ggml.cache.iswa import KVCacheISWA
from kvcache_ggml.runtime import Context, ContextParams
from kvcache_ggml.runtime.arch import load_model, runtime_for
from kvcache_ggml.runtime.gemma import GemmaModel, GemmaParams
from kvcache_ggml.runtime.gemma_maker import GemmaSpec, make_gemma_model
from kvcache_ggml.runtime.gemma_reference import GemmaReference, gelu_ggml, rope_neox
from kvcache_ggml.runtime.model import Model
from kvcache_ggml.runtime.modelmaker import ModelSpec, make_model
from kvcache_ggml.cache.swa_checkpoint import SWACheckpoints

TOL = 2e-3
# the same computation over another cell layout: the SIMD partial sums of the attention group the cells
# differently, and the float16 GELU turns the last-bit differences into float16 steps now and then
LAYOUT_TOL = 1e-4
VOCAB = 64
N_SWA = 8


def rel_err(got, want) -> float:
    return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


def tokens(n, seed=0):
    return np.random.default_rng(seed).integers(3, VOCAB, n).astype(np.int32)


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma(request, tmp_path_factory):
    path = make_gemma_model(tmp_path_factory.mktemp("gemma") / f"{request.param}.gguf",
                            GemmaSpec(arch=request.param, n_swa=N_SWA, vocab=VOCAB, seed=3))
    with load_model(path) as m:
        yield m, GemmaReference(path)


def ctx_of(model, **kw):
    p = dict(n_ctx=512, n_ubatch=32, n_seq_max=1, kv_unified=True, type_k="f32", type_v="f32", n_threads=1,
             n_threads_batch=1, swa_full=False, flash_attn=False)
    p.update(kw)
    return Context(model, **p)


def run(ctx, toks, n_prompt):
    """The prompt in one batch (every logit), then one token per step; float32 [n, n_vocab]."""
    out = [ctx.decode(Batch(token=toks[:n_prompt], pos=np.arange(n_prompt, dtype=np.int32),
                            logits=np.ones(n_prompt, np.int8)))]
    for i in range(n_prompt, len(toks)):
        out.append(ctx.decode(Batch(token=toks[i:i + 1], pos=np.array([i], np.int32))))
    return np.concatenate(out)


# ---------------------------------------------------------------------------------------------- hyper-parameters

def _hp(arch, n_layer=8):
    return HParams.simple(n_layer=n_layer, n_embd_head=16, n_head=4, n_head_kv=2, arch=arch)


def test_gemma2_defaults_match_llama_cpp():
    hp = _hp("gemma2")
    gp = GemmaParams.resolve({}, hp)   # no keys at all: llama.cpp's gemma2 defaults
    assert hp.n_swa == 4096 and hp.swa_type == SwaType.STANDARD
    assert hp.swa_layers == (True, False) * 4                     # period 2: every other layer slides
    assert (gp.attn_softcap, gp.final_softcap, gp.qk_norm) == (50.0, 30.0, False)
    assert gp.rope_freq_base_swa == hp.rope_freq_base_train
    assert gp.attention_scale == float(np.float32(0.25))          # 1/sqrt(16)
    assert gp.embd_scale == 8.0                                   # sqrt(64)


def test_gemma3_window_and_pattern():
    hp = _hp("gemma3", 12)
    gp = GemmaParams.resolve({"gemma3.attention.sliding_window": 512}, hp)
    assert hp.n_swa == 512 and hp.swa_layers == ((True,) * 5 + (False,)) * 2   # period 6
    assert (gp.attn_softcap, gp.final_softcap, gp.qk_norm, gp.rope_freq_base_swa) == (0.0, 0.0, True, 10000.0)
    hp = _hp("gemma3", 12)
    gp = GemmaParams.resolve({"gemma3.attention.sliding_window": 16, "gemma3.attention.sliding_window_pattern": 3,
                              "gemma3.rope.freq_base_swa": 2000.0, "gemma3.final_logit_softcapping": 20.0}, hp)
    assert hp.swa_layers == (True, True, False) * 4 and gp.rope_freq_base_swa == 2000.0 and gp.final_softcap == 20
    hp = _hp("gemma3")
    GemmaParams.resolve({}, hp)                                   # no window: no SWA at all
    assert hp.swa_type == SwaType.NONE and not any(hp.swa_layers)


def test_27b_attention_scale():
    hp = HParams.simple(n_layer=46, n_embd_head=128, n_head=32, n_head_kv=16, n_embd=4608, arch="gemma2")
    assert GemmaParams.resolve({}, hp).attention_scale == float(np.float32(1.0) / np.float32(12.0))  # 1/sqrt(144)


def test_rope_neox_and_gelu_reference_helpers():
    x = np.arange(8, dtype=np.float64).reshape(1, 1, 8)
    y = rope_neox(x, np.array([1]), 8, 10000.0)
    # NEOX pairs dim i with i + 4: dim 0 with 4 rotated by 1 radian
    assert np.allclose(y[0, 0, [0, 4]], [0 * np.cos(1) - 4 * np.sin(1), 0 * np.sin(1) + 4 * np.cos(1)])
    assert np.allclose(np.sum(y ** 2), np.sum(x ** 2))
    g = gelu_ggml(np.array([-11.0, 0.0, 1.0, 12.0]))
    assert g[0] == 0.0 and g[1] == 0.0 and g[3] == 12.0 and abs(g[2] - 0.8412) < 1e-3


# ---------------------------------------------------------------------------------------------- model and memory

def test_model_of_any_supported_architecture_opens_with_one_call(gemma, tmp_path):
    """Model(path) opens a Gemma GGUF as llama_model_load_from_file does (a GemmaModel, still a Model); a class
    named explicitly loads its own architectures only; an unknown architecture names the supported ones."""
    model, _ = gemma
    with Model(model.path) as m:
        assert type(m) is GemmaModel and isinstance(m, Model) and m.hparams.arch == model.hparams.arch
        assert m.n_vocab == model.n_vocab
    llama = make_model(tmp_path / "llama.gguf", ModelSpec(layers=1, embd=32, heads=2, heads_kv=1, ff=64, vocab=64))
    with Model(llama) as m:
        assert type(m) is Model
    with pytest.raises(ValueError, match="architecture 'llama' is not supported"):
        GemmaModel(llama)
    other = tmp_path / "other.gguf"
    other.write_bytes(llama.read_bytes().replace(b"llama", b"mamba", 1))
    with pytest.raises(ValueError, match=r"'mamba' is not supported \(supported: llama, gemma2, gemma3\b"):
        Model(other)


def test_model_loads_as_gemma_with_an_iswa_memory(gemma):
    model, _ = gemma
    assert isinstance(model, GemmaModel) and runtime_for(model.hparams.arch).model_class is GemmaModel
    hp = model.hparams
    assert hp.n_swa == N_SWA and hp.swa_layers == (True, False, True, False)
    assert model.get_rope_freq_base(None, 0) == 1e4                # the SWA layers' base
    with ctx_of(model) as ctx:
        assert isinstance(ctx.kv, KVCacheISWA)
        assert ctx.kv.get_swa().get_size() == 256 and ctx.kv.get_base().get_size() == 512
    with ctx_of(model, swa_full=True) as ctx:
        assert ctx.kv.get_swa().get_size() == 512 and ctx.kv.get_can_shift()


def test_context_shift_refused_when_the_memory_cannot_shift(gemma):
    """An iSWA memory with a smaller window cache cannot shift (llama.cpp's update would abort): context_shift
    refuses before touching the cells; with swa_full it shifts."""
    model, _ = gemma
    toks = tokens(40, 3)
    with ctx_of(model) as ctx:
        run(ctx, toks, 40)
        assert not ctx.memory_can_shift()
        before = ctx.state_get_data()
        with pytest.raises(RuntimeError, match="cannot shift"):
            ctx.context_shift(0, 4, 10)
        assert ctx.state_get_data() == before and ctx.memory_seq_pos_max(0) == 39
    with ctx_of(model, swa_full=True) as ctx:
        run(ctx, toks, 40)
        ctx.context_shift(0, 4, 10)
        assert ctx.memory_seq_pos_max(0) == 29 and ctx.memory_seq_pos_min(0) == 0


@pytest.mark.parametrize("fa", [False, True])
def test_decoding_past_the_swa_cache_matches_the_reference(gemma, fa):
    model, ref = gemma
    toks = tokens(300, 1)
    with ctx_of(model, flash_attn=fa) as ctx:
        got = run(ctx, toks, 40)
        swa = ctx.kv.get_swa()
        assert swa.v_cells[0].get_used() == 256 and ctx.kv.seq_pos_min(0) == 300 - 256  # the SWA cache wrapped
    want = ref.forward(toks)
    assert rel_err(got, want) < TOL
    assert (got.argmax(1) == want.argmax(1)).all()


def test_small_ubatches_and_two_sequences(gemma):
    """Two sequences in one unified cache, prompts split in ubatches of 8, interleaved decode steps."""
    model, ref = gemma
    a, b = tokens(40, 2), tokens(40, 3)
    with ctx_of(model, n_seq_max=2, n_ubatch=8) as ctx:
        toks = np.concatenate([a[:24], b[:24]])
        pos = np.concatenate([np.arange(24), np.arange(24)]).astype(np.int32)
        seq = np.array([0] * 24 + [1] * 24, np.int32)
        got = [ctx.decode(Batch(token=toks, pos=pos, seq_id=seq, logits=np.ones(48, np.int8)))]
        for i in range(24, 40):
            got.append(ctx.decode(Batch(token=np.array([a[i], b[i]], np.int32), pos=np.array([i, i], np.int32),
                                        seq_id=np.array([0, 1], np.int32), logits=np.ones(2, np.int8))))
    ga = np.concatenate([got[0][:24]] + [g[:1] for g in got[1:]])
    gb = np.concatenate([got[0][24:]] + [g[1:] for g in got[1:]])
    assert rel_err(ga, ref.forward(a)) < TOL and rel_err(gb, ref.forward(b)) < TOL


def test_gemma3_without_window_uses_one_cache(tmp_path):
    path = make_gemma_model(tmp_path / "g3dense.gguf", GemmaSpec(arch="gemma3", n_swa=0, vocab=VOCAB,
                                                                 final_softcap=25.0, tied=False))
    toks = tokens(40, 4)
    with load_model(path) as m, ctx_of(m) as ctx:
        assert type(ctx.kv) is KVCache and m.gemma.final_softcap == 25.0
        got = run(ctx, toks, 20)
    assert rel_err(got, GemmaReference(path).forward(toks)) < TOL


def test_sequence_state_round_trip(gemma):
    model, _ = gemma
    toks = tokens(120, 5)
    with ctx_of(model, n_seq_max=2) as ctx:
        run(ctx, toks[:100], 100)
        blob = ctx.state_seq_get_data(0)
        assert blob == ctx.kv.get_base().state_save(0) + ctx.kv.get_swa().state_save(0)
        assert ctx.state_seq_set_data(blob, 1) == len(blob)
        nxt = ctx.decode(Batch(token=np.array([toks[100]] * 2, np.int32), pos=np.array([100, 100], np.int32),
                               seq_id=np.array([0, 1], np.int32), logits=np.ones(2, np.int8)))
    assert rel_err(nxt[1], nxt[0]) < LAYOUT_TOL


@pytest.mark.parametrize("swa_full,unified", [(False, True), (False, False), (True, True)])
def test_memory_plan_has_both_caches(gemma, swa_full, unified):
    from kvcache_ggml.runtime.memory import kv_memory_plan
    model, _ = gemma
    p = ContextParams(n_ctx=1024, n_ubatch=32, n_seq_max=2, kv_unified=unified, swa_full=swa_full)
    plan = kv_memory_plan(model, p)
    with Context(model, p) as ctx:
        base, swa = ctx.kv.get_base(), ctx.kv.get_swa()
        assert plan.kv_size == base.get_size() and plan.n_stream == base.get_n_stream()
        assert {ln.cache: ln.total for ln in plan.lines} == {"base": base.total_size(), "SWA": swa.total_size()}
        assert {ln.cache: ln.cells for ln in plan.lines} == {c: kv.get_size() * kv.get_n_stream()
                                                              for c, kv in (("base", base), ("SWA", swa))}
        assert plan.total == sum(ctx.kv.memory_breakdown().values())
        assert (swa.get_size() < base.get_size()) is not swa_full


def _corrupt_one_swa_k_row(ctx, dst):
    """Overwrite the K row of one of dst's cells in the SWA cache's first layer (an F32 cache) with 0.5s."""
    swa = ctx.kv.get_swa()
    cells = swa.v_cells[0]
    idx = [i for i in range(cells.size()) if not cells.is_empty(i) and cells.seq_has(i, dst)]
    k = swa.layers[0].k
    row = G.nb(k)[1]
    junk = np.full(row // 4, 0.5, np.float32)
    G.ggml_backend_tensor_set(k, junk.ctypes.data, idx[len(idx) // 2] * row, row)


def test_demo_restore_check_compares_both_caches_parts(gemma):
    """The demo's like-with-like check on an iSWA blob (base state, then SWA state): a damaged SWA row is seen."""
    from kvcache_ggml.runtime.restore_check import restore_check
    model, _ = gemma
    toks = tokens(40, seed=5)
    for corrupt, same in ((None, True), (_corrupt_one_swa_k_row, False)):
        with ctx_of(model, n_seq_max=2) as ctx:
            ctx.decode(Batch(token=toks))
            rc = restore_check(ctx, 0, 1, toks.tolist(), 7, False, "f32", corrupt=corrupt)
            assert rc.same_tokens and rc.same_cells is same and rc.ok is same, rc


# ---------------------------------------------------------------------------------------------- checkpoints

@pytest.mark.parametrize("saved,n_past_want,kept", [
    # every 64 tokens: the newest checkpoint reaching below 150 - 8 holds positions 128..383, so decoding goes on
    # at 150 itself; the checkpoints after 150 hold the old prompt's tokens and are forgotten
    ((64, 128, 192, 256, 320, 384, 400), 150, [63, 127]),
    # only after 128 tokens: restored, and its last position (127) is decoded again
    ((128,), 127, [127]),
])
def test_prompt_reuse_from_a_checkpoint(gemma, saved, n_past_want, kept):
    """A 400-token prompt with checkpoints, then a new prompt sharing its first 150 tokens: the SWA cache has
    lost the window of position 150, a checkpoint restores it; the logits equal a decode from scratch."""
    model, _ = gemma
    old = tokens(400, 6)
    new = np.concatenate([old[:150], tokens(30, 7)])
    with ctx_of(model, n_ctx=1024) as scratch:
        want = run(scratch, new, len(new))
    cps = SWACheckpoints(n_max=8)
    with ctx_of(model, n_ctx=1024) as ctx:
        for p0 in range(0, 400, 64):
            n = min(64, 400 - p0)
            ctx.decode(Batch(token=old[p0:p0 + n], pos=np.arange(p0, p0 + n, dtype=np.int32)))
            if p0 + n in saved:
                cps.save(ctx.kv, 0)
        assert ctx.kv.seq_pos_min(0) == 144 > 150 - N_SWA     # the window of position 150 is gone
        assert [cp.n_tokens for cp in cps] == list(saved)
        n_past = cps.reuse(ctx.kv, 0, 150)
        assert n_past == n_past_want
        assert [cp.pos_max for cp in cps] == kept
        assert ctx.kv.seq_pos_max(0) == n_past - 1 == ctx.kv.get_base().seq_pos_max(0)
        assert ctx.kv.seq_pos_min(0) <= n_past - N_SWA
        got = ctx.decode(Batch(token=new[n_past:], pos=np.arange(n_past, len(new), dtype=np.int32),
                               logits=np.ones(len(new) - n_past, np.int8)))
    assert rel_err(got, want[n_past:]) < LAYOUT_TOL


def test_reuse_without_a_usable_checkpoint_starts_over_and_naive_reuse_is_wrong(gemma):
    model, _ = gemma
    old = tokens(400, 8)
    new = np.concatenate([old[:150], tokens(10, 9)])
    with ctx_of(model, n_ctx=1024) as scratch:
        want = run(scratch, new, len(new))
    with ctx_of(model, n_ctx=1024) as ctx:
        ctx.decode(Batch(token=old, pos=np.arange(400, dtype=np.int32)))
        # naive reuse: drop the old tail and go on -- the SWA layers miss positions 143..149 of the window
        ctx.memory_seq_rm(0, 150, -1)
        naive = ctx.decode(Batch(token=new[150:], pos=np.arange(150, 160, dtype=np.int32),
                                 logits=np.ones(10, np.int8)))
        assert rel_err(naive[0], want[150]) > 5e-2
        ctx.memory_clear()
        ctx.decode(Batch(token=old, pos=np.arange(400, dtype=np.int32)))
        cps = SWACheckpoints()
        assert cps.reuse(ctx.kv, 0, 150) == 0 and ctx.kv.seq_pos_max(0) == -1
        again = run(ctx, new, len(new))
    assert rel_err(again, want) < LAYOUT_TOL


def test_reuse_when_the_swa_cache_still_holds_the_window(gemma):
    model, _ = gemma
    old = tokens(200, 10)
    with ctx_of(model) as ctx:
        ctx.decode(Batch(token=old, pos=np.arange(200, dtype=np.int32)))
        cps = SWACheckpoints()
        with pytest.raises(ValueError, match="n_past"):
            cps.reuse(ctx.kv, 0, 201)
        assert cps.reuse(ctx.kv, 0, 180) == 180 and ctx.kv.seq_pos_max(0) == 179
        assert cps.reuse(ctx.kv, 0, 180) == 180                 # nothing to drop


# ---------------------------------------------------------------------------------------------- CLI

def test_make_model_cli_and_demo_run_a_gemma_model(tmp_path, capsys):
    from kvcache_ggml.demo import main as demo_main
    from kvcache_ggml.runtime.modelmaker import main as make_model_main
    out = tmp_path / "g3.gguf"
    assert make_model_main([str(out), "--arch", "gemma3", "--layers", "4", "--embd", "64", "--heads", "4",
                            "--heads-kv", "2", "--vocab", "64", "--n-swa", "8"]) == 0
    with load_model(out) as m:
        assert m.hparams.arch == "gemma3" and m.hparams.n_swa == 8 and m.hparams.n_embd_head_k == 16
    capsys.readouterr()
    assert demo_main(["--model", str(out), "--threads", "1", "--n-ctx", "256", "--n-par", "2", "--n-gen", "140",
                      "--no-swa-full"]) == 0
    text = capsys.readouterr().out
    assert "SWA cache" in text and "base cache" in text and "-> OK" in text


def test_generate_on_a_gemma_model_with_a_real_vocabulary(tmp_path, capsys):
    """The model maker's --vocab-from and --embd-type on a Gemma file; generate's greedy text is the reference's."""
    from pathlib import Path

    from kvcache_ggml.generate import main as generate_main
    from kvcache_ggml.runtime.modelmaker import main as make_model_main
    from kvcache_ggml.runtime.tokenizer import Vocab
    gpt2 = Path(__file__).parent / "data" / "vocab" / "ggml-vocab-gpt-2.gguf"
    out = tmp_path / "g2.gguf"
    assert make_model_main([str(out), "--arch", "gemma2", "--layers", "2", "--embd", "64", "--vocab-from", str(gpt2),
                            "--embd-type", "q8_0", "--ctx", "512", "--n-swa", "4", "--seed", "2"]) == 0
    vocab = Vocab.from_gguf(out)
    with load_model(out) as m:
        assert m.n_vocab == vocab.n_tokens > 50000 and m.hparams.n_swa == 4
    capsys.readouterr()
    prompt = "Hello world, this is"
    assert generate_main(["--model", str(out), "--prompt", prompt, "--n-predict", "6", "--threads", "1"]) == 0
    text = capsys.readouterr().out
    ids = vocab.tokenize(prompt)
    ref = GemmaReference(out)
    for _ in range(6):
        ids.append(int(np.argmax(ref.forward(ids)[-1])))
    assert text == prompt + vocab.detokenize(ids[-6:]) + "\n"
