"""Phi-3-mini-4k, Phi-3.5-mini (LongRoPE) and Phi-4-mini (partial RoPE, GQA, tied) on the runtime against the
float64 numpy forward pass.

Each model is :mod:`kvcache_ggml.runtime.phi3_maker`'s scaled-down preset (fused QKV and gate/up, LongRoPE factors
and attention factor, 3/4 of each head rotated for Phi-4-mini), F32 weights and cache, two layers, a 320-token
vocabulary shaped as Phi-3's.  The logits of a prompt, decode steps, a fork and a context shift agree with
:class:`~kvcache_ggml.runtime.phi3_reference.Phi3Reference` to TOL; each Phi-3 part is checked to matter (the
reference without it is far off).  llama.cpp comparisons: tests/oracle/test_oracle_phi3.py.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from kvcache_ggml.batch import Batch
from kvcache_ggml.hparams import RopeType, SwaType
from kvcache_ggml.runtime import Context
from kvcache_ggml.runtime.arch import runtime_for, supported_archs
from kvcache_ggml.runtime.model import Model
from kvcache_ggml.runtime.phi3 import Phi3Model
from kvcache_ggml.runtime.phi3_maker import (PHI3_PRESETS, PHI3_SPECIAL, longrope_attn_factor, longrope_factors,
                                             make_phi3_model)
from kvcache_ggml.runtime.phi3_reference import Phi3Reference

TOL = 2e-5
VOCAB = PHI3_PRESETS["phi3-mini-4k"].vocab   # 320: 3 special, 256 byte pieces, 50 pieces, 11 added tokens
NAMES = list(PHI3_PRESETS)


def rel_err(got, want) -> float:
    return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


def tokens(n, seed=0):
    return np.random.default_rng(seed).integers(3, VOCAB - len(PHI3_SPECIAL), n).astype(np.int32)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("phi3")
    return {name: make_phi3_model(d / f"{name}.gguf", name, seed=4) for name in NAMES}


def ctx_of(model, **kw):
    p = dict(n_ctx=512, n_ubatch=32, n_seq_max=2, kv_unified=True, type_k="f32", type_v="f32", n_threads=1,
             n_threads_batch=1, flash_attn=False)
    p.update(kw)
    return Context(model, **p)


# (n_rot, head size, n_head_kv, LongRoPE, tied)
EXPECT = {"phi3-mini-4k": (24, 24, 4, False, False), "phi3.5-mini": (24, 24, 4, True, False),
          "phi4-mini": (24, 32, 2, True, True)}


@pytest.mark.parametrize("name", NAMES)
def test_model_opens_each_preset_through_the_registry(paths, name):
    n_rot, d, n_kv, longrope, tied = EXPECT[name]
    spec = PHI3_PRESETS[name]
    with Model(paths[name]) as m:
        hp = m.hparams
        assert type(m) is Phi3Model and runtime_for("phi3").model_class is Phi3Model and "phi3" in supported_archs()
        assert (hp.rope_type, hp.n_rot, hp.n_embd_head_k, hp.n_head_kv(0)) == (RopeType.NEOX, n_rot, d, n_kv)
        # the file has a sliding_window key (but Phi-4-mini's 0): llama.cpp switches Phi-3's window off
        assert hp.swa_type == SwaType.NONE and hp.n_swa == 0 and not hp.is_swa_any()
        assert (m.rope_long is not None, m.rope_short is not None, m.output is m.tok_embd) == (longrope, longrope,
                                                                                                tied)
        with ctx_of(m) as ctx:
            assert ctx.fused is None                          # the fused step is llama's graph only
            want = np.float32(longrope_attn_factor(spec.ctx, spec.orig_ctx)) if longrope else 1.0
            assert ctx.cparams.yarn_attn_factor == want and ctx.cparams.n_ctx_seq == 512
            assert m.get_rope_factors(ctx.cparams, 1) is (m.rope_long if longrope else None)
        with ctx_of(m, n_ctx=256) as ctx:                     # n_ctx_seq 256 = the original context: short
            assert m.get_rope_factors(ctx.cparams, 0) is (m.rope_short if longrope else None)


def _decode_prompt_and_steps(path, toks, **kw):
    with Model(path) as m, ctx_of(m, **kw) as ctx:
        rows = [ctx.decode(Batch(token=toks[:30], pos=np.arange(30, dtype=np.int32), logits=np.ones(30, np.int8)))]
        for i in range(30, len(toks)):
            rows.append(ctx.decode(Batch(token=toks[i:i + 1], pos=np.array([i], np.int32))))
    return np.concatenate(rows)


@pytest.mark.parametrize("fa", [False, True], ids=["nofa", "fa"])
@pytest.mark.parametrize("name", NAMES)
def test_prompt_and_steps_match_the_float64_reference(paths, name, fa):
    """n_ctx 512: the long factors; each Phi-3 part matters -- the attention factor, the factor set, the partial
    rotation (Phi-4-mini), the order of the fused gate and up halves."""
    toks = tokens(40, 1)
    got = _decode_prompt_and_steps(paths[name], toks, flash_attn=fa)
    ref = Phi3Reference(paths[name], 512)
    assert rel_err(got, ref.forward(toks)) < TOL
    if PHI3_PRESETS[name].orig_ctx:
        wrong = Phi3Reference(paths[name], 512)
        wrong.attn_factor = 1.0
        assert rel_err(got, wrong.forward(toks)) > 100 * TOL
        assert rel_err(got, Phi3Reference(paths[name], 256).forward(toks)) > 100 * TOL   # the short factors
    if name == "phi4-mini":
        wrong = Phi3Reference(paths[name], 512)
        wrong.hparams.n_rot, wrong.rope_freqs = 32, np.concatenate([wrong.rope_freqs, np.ones(4)])
        assert rel_err(got, wrong.forward(toks)) > 100 * TOL
    wrong = Phi3Reference(paths[name], 512)
    for il in range(2):
        b = f"blk.{il}."
        wrong.w[b + "ffn_gate.weight"], wrong.w[b + "ffn_up.weight"] = wrong.w[b + "ffn_up.weight"], \
            wrong.w[b + "ffn_gate.weight"]
    assert rel_err(got, wrong.forward(toks)) > 100 * TOL


@pytest.mark.parametrize("name", ["phi3.5-mini", "phi4-mini"])
def test_short_factors_within_the_original_context(paths, name):
    """n_ctx 256 (one sequence's context = the original one): the short factors."""
    toks = tokens(40, 5)
    got = _decode_prompt_and_steps(paths[name], toks, n_ctx=256)
    assert rel_err(got, Phi3Reference(paths[name], 256).forward(toks)) < TOL
    assert rel_err(got, Phi3Reference(paths[name], 512).forward(toks)) > 100 * TOL


@pytest.mark.parametrize("name", NAMES)
def test_fork_and_context_shift_match_the_reference(paths, name):
    """A prompt forked into a second sequence, one step each in one batch; then a context shift of sequence 1 (its
    K rotated over the first n_rot dims with the factors and the attention factor, as llama.cpp's K-shift) and
    steps on the shifted cache."""
    toks = tokens(48, 2)
    ref = Phi3Reference(paths[name], 512)
    with Model(paths[name]) as m, ctx_of(m, flash_attn=True) as ctx:
        ctx.decode(Batch(token=toks[:24]))
        rc0 = ref.cache()
        rc0.decode(toks[:24])
        ctx.memory_seq_cp(0, 1)
        rc1 = rc0.copy()
        got = ctx.decode(Batch(token=toks[24:26], pos=np.array([24, 24], np.int32),
                               seq_id=np.array([0, 1], np.int32), logits=np.ones(2, np.int8)))
        assert rel_err(got[0], rc0.decode(toks[24:25])[0]) < TOL
        assert rel_err(got[1], rc1.decode(toks[25:26])[0]) < TOL
        ctx.context_shift(1, 4, 10)
        rc1.seq_rm(4, 14)
        rc1.seq_add(14, 25, -10)
        got = ctx.decode(Batch(token=toks[26:32], seq_id=np.full(6, 1, np.int32), logits=np.ones(6, np.int8)))
        assert ctx.memory_seq_pos_max(1) == 20
        assert rel_err(got, rc1.decode(toks[26:32])) < TOL


def test_longrope_keys_as_the_converter_writes_them(paths):
    """attn_factor sqrt(1 + ln(32)/ln(256)) for 8192 over 256; the factors [n_rot/2], short near 1, long to 32."""
    assert math.isclose(longrope_attn_factor(8192, 256), math.sqrt(1 + math.log(32) / math.log(256)))
    assert longrope_attn_factor(4096, 4096) == 1.0
    long, short = longrope_factors(24, 8192, 256)
    assert long.shape == short.shape == (12,) and long.dtype == np.float32
    assert long[0] == short[0] == 1.0 and long[-1] == 32.0 and short[-1] == 2.5
    ref = Phi3Reference(paths["phi4-mini"], 512)
    assert ref.hparams.n_ctx_orig_yarn == 256 and np.array_equal(ref.rope_freqs, long.astype(np.float64))


def test_the_loader_refuses_a_broken_phi3(paths, tmp_path):
    """A fused matrix of the wrong height, a missing fused QKV, and n_head * head size != n_embd are ValueErrors
    naming the tensor or the sizes; an unknown architecture's error names it and the supported ones."""
    import gguf

    src = gguf.GGUFReader(str(paths["phi3-mini-4k"]))

    def rewrite(dst, drop=(), change=None):
        w = gguf.GGUFWriter(str(dst), "phi3")
        for key, field in src.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            w.add_key_value(key, field.contents(), field.types[0],
                            sub_type=field.types[1] if len(field.types) > 1 else None)
        for t in src.tensors:
            if t.name in drop:
                continue
            a = np.asarray(t.data)
            if change and t.name == change[0]:
                a = change[1](a)
            w.add_tensor(t.name, a)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return dst

    with pytest.raises(ValueError, match="missing tensors blk.1.attn_qkv.weight"):
        Model(rewrite(tmp_path / "a.gguf", drop=("blk.1.attn_qkv.weight",)))
    with pytest.raises(ValueError, match=r"blk.0.ffn_up.weight has ne \(96, 384, 1, 1\), expected \(96, 512\)"):
        Model(rewrite(tmp_path / "b.gguf", change=("blk.0.ffn_up.weight", lambda a: a[:384])))
    with pytest.raises(ValueError, match="architecture 'phi2' is not supported \\(supported: .*phi3"):
        runtime_for("phi2")


def test_generate_runs_phi3(paths, capsys):
    """``generate`` on Phi-3.5-mini: greedy text equals the float64 reference's continuation (a prompt whose five
    greedy tokens hold no end-of-generation token, so that generate prints all five)."""
    from kvcache_ggml.generate import main as generate_main
    from kvcache_ggml.runtime.tokenizer import Vocab
    path = paths["phi3.5-mini"]
    vocab = Vocab.from_gguf(path)
    ref = Phi3Reference(path, 512)
    for seed in range(20):
        prompt = "Hello " + "".join(f"t{i}" for i in np.random.default_rng(seed).integers(0, 40, 6))
        ids = vocab.tokenize(prompt)
        for _ in range(5):
            ids.append(int(np.argmax(ref.forward(ids)[-1])))
        if not any(vocab.is_eog(t) for t in ids[-5:]):
            break
    capsys.readouterr()
    assert generate_main(["--model", str(path), "--prompt", prompt, "--n-predict", "5", "--threads", "1",
                          "--n-ctx", "512"]) == 0
    assert capsys.readouterr().out == prompt + vocab.detokenize(ids[-5:]) + "\n"


def test_make_model_writes_a_phi3_preset(tmp_path, capsys):
    """make-model --preset phi4-mini --type q8_0: the preset's shape with Q8_0 matrices; an unknown preset is an
    error listing both makers' presets."""
    from kvcache_ggml import ggml as G
    from kvcache_ggml.runtime.modelmaker import main as make_model_main
    out = tmp_path / "p4.gguf"
    assert make_model_main([str(out), "--preset", "phi4-mini", "--type", "q8_0", "--seed", "1"]) == 0
    with Model(out) as m:
        assert type(m) is Phi3Model and (m.hparams.n_rot, m.hparams.n_embd_head_k, m.hparams.n_head(0)) == (24, 32, 6)
        assert G.ttype(m.layers[0].wqkv) == G.GGMLType.Q8_0 and m.output is m.tok_embd
    with pytest.raises(SystemExit):
        make_model_main([str(out), "--preset", "phi2"])
    assert "phi3-mini-4k, phi3.5-mini, phi4-mini" in capsys.readouterr().err


def test_an_unsupported_architecture_is_a_clear_error(tmp_path, capsys):
    """Model(path) names the file's architecture and the supported ones; generate and serve refuse the file with
    that message as a usage error (exit status 2) before loading anything."""
    import gguf

    from kvcache_ggml.generate import main as generate_main
    from kvcache_ggml.serve.cli import parse_args
    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_block_count(1)
    w.add_context_length(16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    want = "architecture 'falcon' is not supported (supported: llama, gemma2, gemma3, qwen2, qwen3, phi3)"
    with pytest.raises(ValueError) as e:
        Model(path)
    assert str(e.value) == want
    for run in (lambda: generate_main(["--model", str(path), "--prompt", "x"]),
                lambda: parse_args(["--model", str(path)])):
        with pytest.raises(SystemExit) as ex:
            run()
        assert ex.value.code == 2 and capsys.readouterr().err.strip().endswith(f"--model {path}: {want}")
