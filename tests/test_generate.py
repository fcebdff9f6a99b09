"""`python -m kvcache_ggml generate`: text in, streamed text out; and the KV memory plan (n_ctx = 0)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvcache_ggml.generate import main as generate_main
from kvcache_ggml.runtime import Context, ContextParams, Model, Reference, make_model
from kvcache_ggml.runtime.memory import kv_memory_plan
from kvcache_ggml.runtime.modelmaker import ModelSpec
from kvcache_ggml.runtime.tokenizer import Vocab

GPT2_VOCAB = Path(__file__).parent / "data" / "vocab" / "ggml-vocab-gpt-2.gguf"


@pytest.fixture(scope="module")
def gpt2_model(tmp_path_factory):  # (heads of 32: the q8_0 K of test_memory_plan needs a head its block divides)
    return make_model(tmp_path_factory.mktemp("gen") / "g.gguf",
                      ModelSpec(layers=2, embd=64, heads=2, heads_kv=1, ff=96, seed=6, ctx=1024,
                                vocab_from=str(GPT2_VOCAB)))


def test_greedy_text_is_the_reference_continuation(gpt2_model, capsys):
    prompt = "Hello world, this is"
    assert generate_main(["--model", str(gpt2_model), "--prompt", prompt, "--n-predict", "6", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    # the float64 numpy forward pass, greedy, independently
    vocab = Vocab.from_gguf(gpt2_model)
    ids = vocab.tokenize(prompt)
    ref = Reference(gpt2_model)
    for _ in range(6):
        ids.append(int(np.argmax(ref.forward(ids)[-1])))
    assert out == prompt + vocab.detokenize(ids[-6:]) + "\n"


def test_parallel_sampling_is_seeded(gpt2_model, capsys):
    args = ["--model", str(gpt2_model), "--prompt", "Once", "--n-predict", "5", "--n-par", "3", "--temp", "0.9",
            "--seed", "3", "--threads", "1"]
    assert generate_main(args) == 0
    first = capsys.readouterr().out
    assert generate_main(args) == 0
    assert capsys.readouterr().out == first
    assert generate_main(args[:-4] + ["--seed", "4", "--threads", "1"]) == 0
    assert capsys.readouterr().out != first                     # another seed, other draws
    lines = first.splitlines()
    texts = [lines[0]] + [ln[len("--- sequence 1: "):] for ln in lines[1:]]
    assert len(set(texts)) > 1                                  # each sequence its own seed: they draw apart
    assert lines[0].startswith("Once") and [ln[:19] for ln in lines[1:]] == ["--- sequence 1: Onc",
                                                                              "--- sequence 2: Onc"]


def test_forked_greedy_sequences_all_follow_the_reference(gpt2_model, capsys):
    """Forked with seq_cp and decoded in one batch per step, every greedy sequence is the reference's text."""
    prompt = "The cat"
    assert generate_main(["--model", str(gpt2_model), "--prompt", prompt, "--n-predict", "5", "--n-par", "3",
                          "--threads", "1"]) == 0
    vocab = Vocab.from_gguf(gpt2_model)
    ids = vocab.tokenize(prompt)
    ref = Reference(gpt2_model)
    for _ in range(5):
        ids.append(int(np.argmax(ref.forward(ids)[-1])))
    want = prompt + vocab.detokenize(ids[-5:])
    assert capsys.readouterr().out.splitlines() == [want, f"--- sequence 1: {want}", f"--- sequence 2: {want}"]


def test_bad_sampling_options_are_refused(gpt2_model, capsys):
    for flag, value in (("--top-p", "0"), ("--top-p", "1.5"), ("--min-p", "-0.1"), ("--top-k", "-1")):
        with pytest.raises(SystemExit):
            generate_main(["--model", str(gpt2_model), "--prompt", "x", flag, value])
        assert value in capsys.readouterr().err


def test_a_prompt_that_is_not_utf8_is_refused(gpt2_model, capsys):
    """argv's bytes that are not UTF-8 reach Python as lone surrogates (surrogateescape): a usage error naming the
    byte, where the tokenizer raised a traceback."""
    with pytest.raises(SystemExit):
        generate_main(["--model", str(gpt2_model), "--prompt", b"ab\xffcd".decode("utf-8", "surrogateescape")])
    assert "--prompt is not UTF-8 text: b'\\xff' at character 2" in capsys.readouterr().err


def test_memory_plan_before_allocation(gpt2_model):
    with Model(gpt2_model) as m:
        for p in (ContextParams(n_ctx=0, n_seq_max=3), ContextParams(n_ctx=300, n_seq_max=2, kv_unified=True,
                                                                    type_k="q8_0", type_v="f32")):
            plan = kv_memory_plan(m, p)
            with Context(m, p) as ctx:
                assert plan.n_ctx == ctx.n_ctx() and plan.kv_size == ctx.kv.get_size()
                assert plan.total == ctx.kv.size_k_bytes() + ctx.kv.size_v_bytes()
                assert {ln.buft: ln.total for ln in plan.lines} == ctx.kv.memory_breakdown()
        # n_ctx = 0: the model's training context (1024), split into 3 streams padded to 256
        plan = kv_memory_plan(m, ContextParams(n_ctx=0, n_seq_max=3))
        assert (plan.n_ctx, plan.kv_size, plan.n_stream) == (3 * 512, 512, 3)
        hp = m.hparams
        assert plan.lines[0].bytes_per_token == hp.n_layer * 2 * 2 * hp.n_embd_k_gqa(0)  # f16 K and V
