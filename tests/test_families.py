"""Qwen2.5, Qwen3, Llama 3.2 (rope_freqs) and Mistral on the runtime against the float64 numpy forward pass.

Each model is :mod:`kvcache_ggml.runtime.family_maker`'s scaled-down preset of the published model (its tensor
names, head ratios, RoPE base and mode, biases, Q/K norms, rope factors, tied head), F32 weights and cache, two
layers, a 64-piece vocabulary.  The logits of a prompt, decode steps, a fork and a context shift agree with
:class:`~kvcache_ggml.runtime.reference.Reference` to TOL; each family's own part is checked to matter (the
reference without it is far off).  llama.cpp comparisons: tests/oracle/test_oracle_families.py.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from kvcache_ggml.batch import Batch
from kvcache_ggml.hparams import RopeType, SwaType
from kvcache_ggml.runtime import Context
from kvcache_ggml.runtime.arch import runtime_for
from kvcache_ggml.runtime.family_maker import PRESETS, FamilySpec, llama3_rope_factors, make_family_model
from kvcache_ggml.runtime.model import Model
from kvcache_ggml.runtime.qwen import QwenModel
from kvcache_ggml.runtime.reference import Reference

TOL = 2e-5
VOCAB = 64
NAMES = list(PRESETS)


def rel_err(got, want) -> float:
    return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


def tokens(n, seed=0):
    return np.random.default_rng(seed).integers(3, VOCAB, n).astype(np.int32)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("families")
    return {name: make_family_model(d / f"{name}.gguf", name, seed=4) for name in NAMES}


def ctx_of(model, **kw):
    p = dict(n_ctx=256, n_ubatch=32, n_seq_max=2, kv_unified=True, type_k="f32", type_v="f32", n_threads=1,
             n_threads_batch=1, flash_attn=False)
    p.update(kw)
    return Context(model, **p)


# hyper-parameters the presets keep from the published models: (class, rope type, head size, n_head * head size
# vs n_embd, rope factors, Q/K/V biases, Q/K norms)
EXPECT = {
    "qwen2.5-0.5b": (QwenModel, RopeType.NEOX, 16, 224, False, True, False),
    "qwen3-0.6b": (QwenModel, RopeType.NEOX, 32, 256, False, False, True),
    "llama3.2-1b": (Model, RopeType.NORM, 16, 128, True, False, False),
    "mistral-7b": (Model, RopeType.NORM, 16, 128, False, False, False),
}


@pytest.mark.parametrize("name", NAMES)
def test_model_opens_each_family_through_the_registry(paths, name):
    cls, rope, d, n_q, factors, bias, qk_norm = EXPECT[name]
    with Model(paths[name]) as m:
        hp = m.hparams
        assert type(m) is cls and runtime_for(hp.arch).model_class is cls and runtime_for(hp.arch).fused
        assert (hp.rope_type, hp.n_embd_head_k, hp.n_rot, hp.n_head(0) * hp.n_embd_head_k) == (rope, d, d, n_q)
        assert hp.swa_type == SwaType.NONE and hp.rope_freq_base_train == PRESETS[name].rope_freq_base
        assert (m.rope_freqs is not None, m.layers[1].bq is not None, m.layers[1].attn_k_norm is not None) == (
            factors, bias, qk_norm)
        assert (m.output is m.tok_embd) == PRESETS[name].tied
        with ctx_of(m) as ctx:
            assert ctx.fused is not None      # llama's graph: the fused decode step applies


def _without_feature(ref: Reference, name: str) -> None:
    """Take the family's own part out of the reference's weights (in place)."""
    if name == "llama3.2-1b":
        ref.rope_freqs = None
    for key in [k for k in ref.w if k.endswith((".bias", "attn_q_norm.weight", "attn_k_norm.weight"))]:
        del ref.w[key]
    if name == "mistral-7b":   # nothing of its own: NEOX instead of NORM must be far off
        ref.hparams.rope_type = RopeType.NEOX


@pytest.mark.parametrize("name", NAMES)
def test_prompt_and_steps_match_the_float64_reference(paths, name):
    toks = tokens(40, 1)
    with Model(paths[name]) as m, ctx_of(m) as ctx:
        rows = [ctx.decode(Batch(token=toks[:30], pos=np.arange(30, dtype=np.int32), logits=np.ones(30, np.int8)))]
        for i in range(30, 40):
            rows.append(ctx.decode(Batch(token=toks[i:i + 1], pos=np.array([i], np.int32))))
    got = np.concatenate(rows)
    ref = Reference(paths[name])
    assert rel_err(got, ref.forward(toks)) < TOL
    _without_feature(ref, name)
    assert rel_err(got, ref.forward(toks)) > 100 * TOL


@pytest.mark.parametrize("name", NAMES)
def test_fork_and_context_shift_match_the_reference(paths, name):
    """A prompt forked into a second sequence, one step each in one batch; then a context shift of sequence 1 (its
    K rotated with the family's RoPE, rope factors included) and steps on the shifted cache."""
    toks = tokens(48, 2)
    ref = Reference(paths[name])
    with Model(paths[name]) as m, ctx_of(m, flash_attn=True, type_k="f32", type_v="f32") as ctx:
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


def test_yarn_scaled_qwen_matches_the_reference(tmp_path):
    """A Qwen2.5 with YaRN (factor 4, original context 32: rope.scaling.* keys as Qwen's rope_scaling converts):
    the context resolves ext_factor 1 and the attention factor as llama.cpp does, the logits of 120 positions and a
    context shift equal the reference's YaRN rotation -- and are far from plain linear interpolation."""
    path = make_family_model(tmp_path / "yarn.gguf", "qwen2.5-0.5b", yarn=(4.0, 32), seed=3)
    toks = tokens(130, 5)
    ref = Reference(path)
    with Model(path) as m, ctx_of(m, n_ubatch=128) as ctx:
        assert (m.hparams.rope_scaling_type_train, m.hparams.rope_freq_scale_train) == (2, 0.25)
        assert ref.yarn == (32, 32.0, 1.0)
        assert (ctx.cparams.yarn_ext_factor, ctx.cparams.n_ctx_orig_yarn) == (1.0, 32)
        got = ctx.decode(Batch(token=toks[:120], logits=np.ones(120, np.int8)))
        rc = ref.cache(freq_scale=0.25)
        assert rel_err(got, rc.decode(toks[:120])) < TOL
        ctx.context_shift(0, 8, 40)
        rc.seq_rm(8, 48)
        rc.seq_add(48, 120, -40)
        got = ctx.decode(Batch(token=toks[120:130], logits=np.ones(10, np.int8)))
        assert rel_err(got, rc.decode(toks[120:130])) < TOL
    ref.yarn = None
    assert rel_err(got, ref.forward(np.concatenate([toks[:8], toks[48:130]]), freq_scale=0.25)[-10:]) > 100 * TOL


def test_llama3_rope_factors_as_the_converter_computes_them():
    """dim 16, base 500000, factor 32, low 1, high 4, original context 8192: wavelengths under 2048 keep factor 1,
    over 8192 take 32, between them the smooth mix."""
    f = llama3_rope_factors(16, 500000.0, 32.0, 1.0, 4.0, 8192)
    wavelen = [2 * math.pi * 500000.0 ** (i / 16) for i in range(0, 16, 2)]
    want = []
    for w in wavelen:
        smooth = (8192 / w - 1.0) / (4.0 - 1.0)
        want.append(1.0 if w < 2048 else 32.0 if w > 8192 else 1 / ((1 - smooth) / 32.0 + smooth))
    assert f.dtype == np.float32 and f.shape == (8,)
    assert f[0] == 1.0 and f[-1] == 32.0 and 1.0 < f[4] < 32.0      # every branch is taken
    assert np.allclose(f, want, rtol=1e-5)


def _rewrite(src: Path, dst: Path, keys: dict, extra_tensors: dict | None = None) -> Path:
    """A copy of GGUF src with keys set (name -> value) and tensors added (name -> float32 array)."""
    import gguf
    r = gguf.GGUFReader(str(src))
    arch = str(r.fields["general.architecture"].contents())
    w = gguf.GGUFWriter(str(dst), arch)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in keys:
            continue
        vt = field.types[0]
        w.add_key_value(key, field.contents(), vt, sub_type=field.types[1] if len(field.types) > 1 else None)
    for key, value in keys.items():
        if isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_uint32(key, value)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_shape=tuple(reversed([int(x) for x in t.shape])),
                     raw_dtype=t.tensor_type)
    for name, a in (extra_tensors or {}).items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_the_loader_checks_rope_scaling_window_and_biases(paths, tmp_path):
    """As llama.cpp's loader: a rope scaling type the graph does not compute is refused; llama and Qwen ignore a
    sliding-window key (no SWA layers); a bias the architecture's loader does not take is refused; qwen2's Q is
    square."""
    mistral = paths["mistral-7b"]
    with pytest.raises(ValueError, match="rope scaling type 'longrope' is not supported for arch llama"):
        Model(_rewrite(mistral, tmp_path / "longrope.gguf", {"llama.rope.scaling.type": "longrope"}))
    with pytest.raises(ValueError, match="rope scaling type 'ntk' is unknown"):
        Model(_rewrite(mistral, tmp_path / "ntk.gguf", {"llama.rope.scaling.type": "ntk"}))
    with Model(_rewrite(mistral, tmp_path / "swa.gguf", {"llama.attention.sliding_window": 8})) as m:
        assert m.hparams.n_swa == 0 and not m.hparams.is_swa_any()
        with ctx_of(m) as ctx:
            toks = tokens(20, 3)
            got = ctx.decode(Batch(token=toks, logits=np.ones(20, np.int8)))
        assert rel_err(got, Reference(mistral).forward(toks)) < TOL
    bias = {"blk.0.attn_q.bias": np.zeros(256, np.float32)}
    with pytest.raises(ValueError, match="attn_q.bias is not supported for arch qwen3"):
        Model(_rewrite(paths["qwen3-0.6b"], tmp_path / "q3b.gguf", {}, bias))
    with pytest.raises(ValueError, match="attn_output.bias is not supported for arch llama"):
        Model(_rewrite(mistral, tmp_path / "ob.gguf", {}, {"blk.1.attn_output.bias": np.zeros(128, np.float32)}))
    with pytest.raises(ValueError, match="output.bias is not supported for arch qwen2"):
        Model(_rewrite(paths["qwen2.5-0.5b"], tmp_path / "outb.gguf", {}, {"output.bias": np.zeros(64, np.float32)}))
    with pytest.raises(ValueError, match="heads \\* head_dim == embd"):
        make_family_model(tmp_path / "bad.gguf", FamilySpec(arch="qwen2", embd=64, heads=4, head_dim=32))
    with pytest.raises(ValueError, match="preset 'qwen9' is not one of qwen2.5-0.5b, qwen3-0.6b"):
        make_family_model(tmp_path / "bad.gguf", "qwen9")


def test_generate_runs_a_qwen3_model_with_a_byte_level_vocabulary(tmp_path, capsys):
    """make-model --preset with --vocab-from (GPT-2's byte-level BPE) and Q8_0 embeddings; generate's greedy
    text is the float64 reference's."""
    from kvcache_ggml.generate import main as generate_main
    from kvcache_ggml.runtime.modelmaker import main as make_model_main
    from kvcache_ggml.runtime.tokenizer import Vocab
    gpt2 = Path(__file__).parent / "data" / "vocab" / "ggml-vocab-gpt-2.gguf"
    out = tmp_path / "q3.gguf"
    assert make_model_main([str(out), "--preset", "qwen3-0.6b", "--vocab-from", str(gpt2), "--embd-type", "q8_0",
                            "--seed", "2"]) == 0
    vocab = Vocab.from_gguf(out)
    capsys.readouterr()
    prompt = "Hello world, this is"
    assert generate_main(["--model", str(out), "--prompt", prompt, "--n-predict", "5", "--threads", "1",
                          "--n-ctx", "256"]) == 0
    text = capsys.readouterr().out
    ids = vocab.tokenize(prompt)
    ref = Reference(out)
    for _ in range(5):
        ids.append(int(np.argmax(ref.forward(ids)[-1])))
    assert text == prompt + vocab.detokenize(ids[-5:]) + "\n"


def test_serve_answers_with_the_reference_tokens(tmp_path):
    """``serve`` on a Qwen2.5 preset with GPT-2's byte-level vocabulary: a greedy completion through the OpenAI
    client is the float64 reference's continuation."""
    pytest.importorskip("openai")
    from serve_helpers import GPT2_VOCAB, LiveServer

    from kvcache_ggml.runtime.tokenizer import Vocab
    path = make_family_model(tmp_path / "q2.gguf", "qwen2.5-0.5b", vocab_from=str(GPT2_VOCAB), embd_type="q8_0",
                             seed=5)
    s = LiveServer(["--model", str(path), "--alias", "qwen", "--parallel", "2", "--n-ctx", "512", "--threads", "1",
                    "-ctk", "f32", "-ctv", "f32"])
    try:
        prompt = "The quick brown fox"
        r = s.client().completions.create(model="qwen", prompt=prompt, max_tokens=5, temperature=0)
    finally:
        s.close()
    vocab = Vocab.from_gguf(path)
    ids = vocab.tokenize(prompt)
    ref = Reference(path)
    for _ in range(5):
        ids.append(int(np.argmax(ref.forward(ids)[-1])))
    assert r.choices[0].text == vocab.detokenize(ids[-5:])


def test_rope_factors_are_loaded_once_per_layer_device(tmp_path):
    """As llama.cpp's TENSOR_DUPLICATED rope_freqs: layers 0-1 on the CPU and 2-3 with the output on an RPC server
    (n_gpu_layers = n_layer/2 + 1 places them so) read a copy on their own device, so no RoPE op moves to another
    device for its factors; the logits are the CPU-only model's, bit for bit."""
    from kvcache_ggml.parity.runtime_check import placed_model
    path = make_family_model(tmp_path / "l3.gguf", "llama3.2-1b", layers=4, seed=6)
    toks = tokens(12, 7)
    with Model(path) as m, ctx_of(m) as ctx:
        want = ctx.decode(Batch(token=toks, logits=np.ones(12, np.int8)))
        assert [m.get_rope_factors(None, il) for il in range(4)] == [m.rope_freqs] * 4
    with placed_model(path, "rpc", 1, split="half") as m:
        bt = m.buffer_types()
        assert bt["rope_freqs.weight"] == "CPU" and bt["rope_freqs.weight@2"].startswith("RPC")
        assert len([n for n in bt if n.startswith("rope_freqs")]) == 2
        assert m.get_rope_factors(None, 0) is m.get_rope_factors(None, 1) is m.rope_freqs
        assert m.get_rope_factors(None, 2) is m.get_rope_factors(None, 3) is m.tensors["rope_freqs.weight@2"]
        with ctx_of(m) as ctx:
            got = ctx.decode(Batch(token=toks, logits=np.ones(12, np.int8)))
    assert np.array_equal(got, want)


def test_llama_takes_optional_qkv_biases(tmp_path):
    """llama.cpp's llama loader takes Q/K/V biases when the file has them (and llm_build_llama adds them): a
    Mistral-shaped llama with biases matches the reference, which without them is far off."""
    path = make_family_model(tmp_path / "lb.gguf", "mistral-7b", qkv_bias=True, seed=8)
    toks = tokens(24, 9)
    with Model(path) as m, ctx_of(m) as ctx:
        assert type(m) is Model and m.layers[0].bv is not None
        got = ctx.decode(Batch(token=toks, logits=np.ones(24, np.int8)))
    ref = Reference(path)
    assert rel_err(got, ref.forward(toks)) < TOL
    _without_feature(ref, "llama-with-biases")
    assert rel_err(got, ref.forward(toks)) > 100 * TOL
