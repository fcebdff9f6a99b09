"""Our tokenizer against llama.cpp's (llama_tokenize / llama_detokenize of llama-cpp-python 0.3.17, vocab-only
model) on the same GGUF vocabularies: BPE gpt-2, BPE llama-bpe (llama 3, when the oracle's source tree has it) and
SPM llama; every string of llama.cpp's test set plus special-token, whitespace and digit cases, with and without
add_special and parse_special; detokenize with and without special."""
from __future__ import annotations

import base64
from pathlib import Path

import pytest

from kvcache_ggml.runtime.tokenizer import Vocab
from llama_runner import ORACLE_DIR, llama_available, run_llama

pytestmark = [pytest.mark.oracle,
              pytest.mark.skipif(llama_available() is not None, reason=str(llama_available()))]

DATA = Path(__file__).parents[1] / "data" / "vocab"
ORACLE_MODELS = ORACLE_DIR / "src" / "llama_cpp_python-0.3.17" / \
    "vendor" / "llama.cpp" / "models"
EXTRA = ["<|endoftext|>hello<s> </s>", "   leading and trailing   ", "tab\there\r\nnext", "日本語 テキスト",
         "123456789 3.14159 1,000,000", "a\n\n\nb", "<unk>x<0x41>", "Hello <|begin_of_text|> world", "it's we'll I'd",
         "   ", "", "ÄÖÜ äöü ß", "🦙🦙 llama"]


def _vocab_path(name: str) -> Path:
    p = DATA / f"ggml-vocab-{name}.gguf"
    return p if p.exists() else ORACLE_MODELS / f"ggml-vocab-{name}.gguf"


@pytest.mark.parametrize("name", ["gpt-2", "llama-spm", "llama-bpe"])
def test_tokenize_and_detokenize_match_llama(name):
    path = _vocab_path(name)
    if not path.exists():
        pytest.skip(f"{path} missing")
    v = Vocab.from_gguf(path)
    texts = path.with_suffix(".gguf.inp").read_text().split("\n__ggml_vocab_test__\n") + EXTRA
    ops = [{"op": "tokenize", "text": t, "add_special": add, "parse_special": ps}
           for t in texts for add in (False, True) for ps in (False, True)]
    theirs = run_llama({"model": str(path), "vocab_only": True, "ops": ops})
    assert len(theirs) == len(ops), theirs[-1]
    for op, a in zip(ops, theirs):
        ours = v.tokenize(op["text"], op["add_special"], op["parse_special"])
        assert ours == a["tokens"], f"{op}: {ours[:16]} vs llama.cpp {a['tokens'][:16]}"
    dops = [{"op": "detokenize", "tokens": a["tokens"], "special": sp} for a in theirs for sp in (False, True)]
    back = run_llama({"model": str(path), "vocab_only": True, "ops": dops})
    for op, a in zip(dops, back):
        want = base64.b64decode(a["text"]).decode("utf-8", "replace")
        assert v.detokenize(op["tokens"], op["special"]) == want, op
