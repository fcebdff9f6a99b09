"""Our tokenizer against llama.cpp's (llama_tokenize of llama-cpp-python 0.3.17, vocab-only model) on a corpus of
code, numbers (long digit runs: llama-bpe cuts them into pieces of up to three digits, qwen2 into single digits),
CJK and other scripts, emoji (ZWJ sequences, flags, modifiers), mixed whitespace, tabs, CRLF and blank lines
(tests/data/tokenizer_corpus.txt), plus chat prompts with special tokens; and llama_detokenize of those ids.

Vocabularies: GPT-2's pieces and merges relabelled as Qwen2's, Llama 3's and Phi-4-mini's (gpt-4o)
(runtime.vocab_maker: the pre-tokenizer and the special tokens, as the default suite's random models carry them), and, when the oracle's source tree has
them, llama.cpp's own ggml-vocab-qwen2, -llama-bpe and -phi-3 GGUFs (the published vocabularies)."""
from __future__ import annotations

import base64
from pathlib import Path

import pytest

from kvcache_ggml.runtime.tokenizer import Vocab
from kvcache_ggml.runtime.vocab_maker import relabel_vocab
from llama_runner import ORACLE_DIR, llama_available, run_llama

pytestmark = [pytest.mark.oracle,
              pytest.mark.skipif(llama_available() is not None, reason=str(llama_available()))]

DATA = Path(__file__).parents[1] / "data"
ORACLE_MODELS = ORACLE_DIR / "src" / "llama_cpp_python-0.3.17" / "vendor" / "llama.cpp" / "models"
CORPUS = (DATA / "tokenizer_corpus.txt").read_bytes().decode("utf-8").split("\n__ggml_vocab_test__\n")
CHATS = ["<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi 123456!<|im_end|>\n"
         "<|im_start|>assistant\n",
         "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nDate: 26 Jul 2024<|eot_id|>"
         "<|start_header_id|>assistant<|end_header_id|>\n\n",
         "<|user|>\nWrite 2+2 in 日本語 🦙<|end|>\n<|assistant|>\n", "<|system|>  spaced  <|end|>  \n<|user|>x"]


@pytest.fixture(scope="module")
def vocabs(tmp_path_factory):
    d = tmp_path_factory.mktemp("vocab_corpus")
    gpt2 = DATA / "vocab" / "ggml-vocab-gpt-2.gguf"
    out = {f"gpt-2 as {pre}": relabel_vocab(gpt2, d / f"{pre}.gguf", pre) for pre in ("qwen2", "llama-bpe", "gpt-4o")}
    for name in ("qwen2", "llama-bpe", "phi-3"):
        p = ORACLE_MODELS / f"ggml-vocab-{name}.gguf"
        if p.exists():
            out[name] = p
    return out


@pytest.mark.parametrize("name", ["gpt-2 as qwen2", "gpt-2 as llama-bpe", "gpt-2 as gpt-4o", "qwen2", "llama-bpe",
                                  "phi-3"])
def test_corpus_ids_equal_llama_cpps(vocabs, name):
    if name not in vocabs:
        pytest.skip(f"ggml-vocab-{name}.gguf is not in the oracle's source tree")
    path = vocabs[name]
    v = Vocab.from_gguf(path)
    assert len(CORPUS) >= 18 and any("\r\n" in t for t in CORPUS)
    ops = [{"op": "tokenize", "text": t, "add_special": add, "parse_special": ps}
           for t in CORPUS + CHATS for add in (False, True) for ps in (False, True)]
    theirs = run_llama({"model": str(path), "vocab_only": True, "ops": ops})
    assert len(theirs) == len(ops), theirs[-1]
    bad = [(op, v.tokenize(op["text"], op["add_special"], op["parse_special"]), a["tokens"])
           for op, a in zip(ops, theirs) if v.tokenize(op["text"], op["add_special"], op["parse_special"])
           != a["tokens"]]
    assert not bad, f"{len(bad)} of {len(ops)} differ, first: {bad[0][0]}: ours {bad[0][1][:24]}, " \
                    f"llama.cpp {bad[0][2][:24]}"
    # and back: llama_detokenize of llama.cpp's ids, with and without the special tokens' text
    dops = [{"op": "detokenize", "tokens": a["tokens"], "special": sp} for a in theirs for sp in (False, True)]
    back = run_llama({"model": str(path), "vocab_only": True, "ops": dops})
    assert len(back) == len(dops), back[-1]
    for op, a in zip(dops, back):
        assert v.detokenize(op["tokens"], op["special"]) == base64.b64decode(a["text"]).decode("utf-8", "replace"), op
