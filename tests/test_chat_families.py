"""The published chat templates of Qwen2.5 and Qwen3 (ChatML), Llama 3.2 and Phi-3.5 written into random models of
their families, rendered by ``serve``'s chat endpoint, and their vocabularies' pre-tokenizers checked by hand.

Each model is a scaled-down preset (runtime.family_maker / runtime.phi3_maker) with its published template
(runtime.chat_templates) and a vocabulary shaped as its own: GPT-2's pieces relabelled as Qwen2's or Llama 3's
(runtime.vocab_maker: pre-tokenizer and special tokens), the maker's Phi-3 vocabulary.  The prompt each template
renders is compared with the text written out by hand; through a live server, the chat completion's prompt is that
text's tokens and its greedy reply the float64 reference's continuation.  llama.cpp's ids on a corpus:
tests/oracle/test_oracle_tokenizer_corpus.py.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvcache_ggml.runtime.chat_templates import LLAMA3_2, PHI3_5, QWEN2_5, QWEN3
from kvcache_ggml.runtime.family_maker import make_family_model
from kvcache_ggml.runtime.phi3_maker import make_phi3_model
from kvcache_ggml.runtime.phi3_reference import Phi3Reference
from kvcache_ggml.runtime.reference import Reference
from kvcache_ggml.runtime.tokenizer import Vocab
from kvcache_ggml.runtime.vocab_maker import relabel_vocab

GPT2 = Path(__file__).parent / "data" / "vocab" / "ggml-vocab-gpt-2.gguf"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi 12345!"}]
# the prompt each published template renders for MESSAGES with add_generation_prompt, written out by hand
EXPECTED = {
    "qwen2.5-0.5b": "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi 12345!<|im_end|>\n"
                    "<|im_start|>assistant\n",
    "qwen3-0.6b": "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi 12345!<|im_end|>\n"
                  "<|im_start|>assistant\n<think>\n\n</think>\n\n",
    "llama3.2-1b": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: "
                   "December 2023\nToday Date: 26 Jul 2024\n\nYou are terse.<|eot_id|><|start_header_id|>user"
                   "<|end_header_id|>\n\nHi 12345!<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    "phi3.5-mini": "<|system|>\nYou are terse.<|end|>\n<|user|>\nHi 12345!<|end|>\n<|assistant|>\n",
}
# (Llama 3.2's default date is today's; Qwen3 without thinking closes an empty <think> block)
KWARGS = {"llama3.2-1b": {"date_string": "26 Jul 2024"}, "qwen3-0.6b": {"enable_thinking": False}}


def make_models(d: Path) -> dict[str, Path]:
    """The three chat models, written into folder d (tests/oracle/test_oracle_chat_families.py uses them too)."""
    qwen = relabel_vocab(GPT2, d / "qwen2-vocab.gguf", "qwen2")
    llama = relabel_vocab(GPT2, d / "llama-bpe-vocab.gguf", "llama-bpe")
    return {
        "qwen2.5-0.5b": make_family_model(d / "qwen.gguf", "qwen2.5-0.5b", vocab_from=str(qwen), embd_type="q8_0",
                                          chat_template=QWEN2_5, seed=1),
        "qwen3-0.6b": make_family_model(d / "qwen3.gguf", "qwen3-0.6b", vocab_from=str(qwen), embd_type="q8_0",
                                        chat_template=QWEN3, seed=4),
        "llama3.2-1b": make_family_model(d / "llama.gguf", "llama3.2-1b", vocab_from=str(llama), embd_type="q8_0",
                                         chat_template=LLAMA3_2, seed=2),
        "phi3.5-mini": make_phi3_model(d / "phi.gguf", "phi3.5-mini", chat_template=PHI3_5, seed=3),
    }


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("chat_families"))


def test_the_pre_tokenizers_split_as_their_models_do(models, tmp_path):
    """Digits: Qwen2 one per piece, Llama 3 and gpt-4o (Phi-4-mini) up to three; gpt-4o cuts words at their
    capitals; specials parsed whole; Phi-3's eat the whitespace after them (llama.cpp's RSTRIP), the SPM space prefix
    then starts the text."""
    qwen, llama = Vocab.from_gguf(models["qwen2.5-0.5b"]), Vocab.from_gguf(models["llama3.2-1b"])
    gpt4o = Vocab.from_gguf(relabel_vocab(GPT2, tmp_path / "gpt-4o.gguf", "gpt-4o"))
    assert [gpt4o.detokenize([t]) for t in gpt4o.tokenize("12345")] == ["123", "45"] and not gpt4o.add_bos
    # a word's pieces: gpt-4o cuts at each capital after a lower-case letter, llama-bpe keeps the word whole
    assert [gpt4o.detokenize([t]) for t in gpt4o.tokenize(" JavaScript")] == [" Java", "Script"]
    assert [llama.detokenize([t]) for t in llama.tokenize(" JavaScript", add_special=False)] == [" JavaScript"]
    assert [qwen.detokenize([t]) for t in qwen.tokenize("12345")] == list("12345")
    assert [llama.detokenize([t]) for t in llama.tokenize("12345", add_special=False)] == ["123", "45"]
    assert llama.tokenize("x")[0] == llama.bos == llama.tokens.index("<|begin_of_text|>") and not qwen.add_bos
    im_start = qwen.tokens.index("<|im_start|>")
    assert qwen.tokenize("<|im_start|>user", parse_special=True) == [im_start] + qwen.tokenize("user")
    assert llama.tokens[llama.eos] == "<|eot_id|>" and qwen.tokens[qwen.eos] == "<|im_end|>"
    phi = Vocab.from_gguf(models["phi3.5-mini"])
    user, end = phi.tokens.index("<|user|>"), phi.tokens.index("<|end|>")
    assert phi.tokenize("<|user|>\n t1t2<|end|>  ", add_special=False, parse_special=True) == \
        [user] + phi.tokenize("t1t2", add_special=False) + [end]
    assert phi.is_eog(end) and phi.is_eog(phi.tokens.index("<|endoftext|>"))


@pytest.mark.parametrize("name", list(EXPECTED))
def test_published_templates_render_the_prompt_written_by_hand(models, name):
    from kvcache_ggml.serve.chat import ChatTemplate
    vocab = Vocab.from_gguf(models[name])
    t = ChatTemplate.from_gguf_kv(_kv(models[name]), vocab)
    assert t.render(MESSAGES, add_generation_prompt=True, **KWARGS.get(name, {})) == EXPECTED[name]


def _kv(path):
    from kvcache_ggml._gguf import read_kv
    return read_kv(path)


def _reference_reply(name, path, vocab, prompt_ids, n):
    ref = Phi3Reference(path, 512) if name.startswith("phi") else Reference(path)
    ids = list(prompt_ids)
    for _ in range(n):
        t = int(np.argmax(ref.forward(ids)[-1]))
        if vocab.is_eog(t):
            break
        ids.append(t)
    return vocab.detokenize(ids[len(prompt_ids):])


@pytest.mark.parametrize("name", list(EXPECTED))
def test_serve_chat_renders_the_gguf_template(models, name):
    """``serve`` on the model: the chat completion's prompt is the hand-written prompt's tokens (one BOS), its
    greedy reply the float64 reference's continuation."""
    pytest.importorskip("openai")
    from serve_helpers import LiveServer
    path = models[name]
    vocab = Vocab.from_gguf(path)
    text = EXPECTED[name]
    if vocab.add_bos and text.startswith(vocab.tokens[vocab.bos]):
        text = text[len(vocab.tokens[vocab.bos]):]
    prompt_ids = vocab.tokenize(text, add_special=True, parse_special=True)
    assert prompt_ids.count(vocab.bos) == (1 if vocab.add_bos else 0)
    s = LiveServer(["--model", str(path), "--alias", name, "--parallel", "1", "--n-ctx", "512", "--threads", "1",
                    "-ctk", "f32", "-ctv", "f32"])
    try:
        r = s.client().chat.completions.create(model=name, messages=MESSAGES, max_tokens=4, temperature=0,
                                               extra_body={"chat_template_kwargs": KWARGS.get(name, {})})
    finally:
        s.close()
    assert r.usage.prompt_tokens == len(prompt_ids)
    want = _reference_reply(name, path, vocab, prompt_ids, 4)
    assert want and r.choices[0].message.content == want


def test_header_types_are_read_as_gguf_reads_them(models):
    """GGUFFile.kv_types (what the makers copy a vocabulary with) equals gguf's own reader on every key of a model
    file: scalars, strings, arrays of strings, int32 and float32."""
    import gguf

    from kvcache_ggml._gguf import GGUFFile
    path = models["phi3.5-mini"]
    ours, theirs = GGUFFile(path).kv_types, gguf.GGUFReader(str(path)).fields
    want = {k: (int(f.types[0]), int(f.types[1]) if len(f.types) > 1 else None)
            for k, f in theirs.items() if not k.startswith("GGUF.")}
    assert ours == want
    assert {t for t, _ in ours.values()} >= {4, 6, 7, 8, 9} and {i for _, i in ours.values()} >= {5, 6, 8}
