"""Greedy text generation against llama.cpp's own greedy sampler (``llama_runner``'s ``generate`` op).

On a random-weight model with the GPT-2 vocabulary the generated ids and the logits of every step must be equal;
on the trained tiny llama of ``scripts/train_tiny_llama.py`` (when its folder exists: ``TINY_LLAMA_DIR``, default
/tmp/tinyllama; it is not in the repository) the export and the texts are checked by ``scripts/check_tiny_llama.py``.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from kvcache_ggml.runtime import Vocab, make_model
from llama_runner import llama_available
from kvcache_ggml.runtime.modelmaker import ModelSpec

pytestmark = [pytest.mark.oracle,
              pytest.mark.skipif(llama_available() is not None, reason=str(llama_available()))]

ROOT = Path(__file__).resolve().parents[2]
GPT2 = ROOT / "tests" / "data" / "vocab" / "ggml-vocab-gpt-2.gguf"
TRAINED = Path(os.environ.get("TINY_LLAMA_DIR", "/tmp/tinyllama"))


def load_check():
    spec = importlib.util.spec_from_file_location("check_tiny_llama", ROOT / "scripts" / "check_tiny_llama.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["check_tiny_llama"] = mod
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules["check_tiny_llama"]
    return mod


@pytest.mark.parametrize("fa", [True, False], ids=["fa", "nofa"])
def test_greedy_tokens_and_logits_equal_llama_cpp(tmp_path, fa):
    chk = load_check()
    path = make_model(tmp_path / "gpt2.gguf", ModelSpec(layers=2, embd=64, heads=4, heads_kv=2, ff=128, seed=3,
                                                        vocab_from=str(GPT2), tied=True))
    vocab = Vocab.from_gguf(path)
    prompt = vocab.tokenize("Return the number of items", add_special=True)
    ours, our_rows = chk.ours_greedy(path, prompt, 16, fa, vocab)
    theirs, text, their_rows = chk.llama_greedy(path, prompt, 16, fa, vocab.n_tokens)
    assert ours == theirs and len(ours) == 16
    assert text == vocab.detokenize(ours)
    np.testing.assert_array_equal(our_rows, their_rows)


@pytest.mark.skipif(not (TRAINED / "tiny-llama-f32.gguf").exists(), reason=f"no trained model in {TRAINED}")
def test_trained_tiny_llama(capsys):
    chk = load_check()
    assert chk.export_check(TRAINED / "tiny-llama-f32.gguf", TRAINED / "probe.npz") < 1e-4
    assert chk.text_check(TRAINED / "tiny-llama-f32.gguf", chk.PROMPTS[:2], 24)
