"""Tokenizer from a GGUF's own vocabulary against llama.cpp's reference tokenizations.

tests/data/vocab holds two of llama.cpp's vocabulary-only GGUFs (gpt-2: byte-level BPE; llama-spm: SentencePiece)
with the test strings (``.inp``, separated by ``__ggml_vocab_test__`` lines) and the ids llama.cpp's tokenizer
gives them (``.out``, one line per string, ``add_special=False``): ASCII, Unicode, whitespace runs, digits, emoji.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvcache_ggml.runtime.tokenizer import StreamDecoder, TokenType, Vocab

DATA = Path(__file__).parent / "data" / "vocab"
NAMES = ["gpt-2", "llama-spm"]


@pytest.fixture(scope="module", params=NAMES)
def vocab_case(request):
    path = DATA / f"ggml-vocab-{request.param}.gguf"
    inp = path.with_suffix(".gguf.inp").read_text().split("\n__ggml_vocab_test__\n")
    out = path.with_suffix(".gguf.out").read_text().split("\n")
    return request.param, Vocab.from_gguf(path), list(zip(inp, out))


def test_reference_tokenizations(vocab_case):
    name, v, cases = vocab_case
    assert len(cases) >= 40
    for text, ids in cases:
        assert v.tokenize(text, add_special=False) == [int(x) for x in ids.split()], f"{name}: {text!r}"


def test_round_trip_and_stream(vocab_case):
    name, v, cases = vocab_case
    for text, _ in cases:
        ids = v.tokenize(text, add_special=False)
        back = v.detokenize(ids)
        if name == "llama-spm":
            # SentencePiece: the prefixed space is removed again; what it cannot keep is a leading space
            assert back == text or back == text.lstrip(" ") or " " + back == text, repr(text)
        else:
            assert v.detokenize(ids) == v.detokenize(v.tokenize(back, add_special=False))
        # streaming, one id at a time, gives the pieces' text (gpt-2's detokenize also cleans up spaces)
        dec = StreamDecoder(v)
        streamed = "".join(dec.push(t) for t in ids) + dec.flush()
        if name == "llama-spm":
            assert streamed == back
        else:
            assert streamed == b"".join(v.token_to_piece(t) for t in ids).decode("utf-8", "replace")


def test_special_tokens():
    v = Vocab.from_gguf(DATA / "ggml-vocab-llama-spm.gguf")
    assert (v.bos, v.eos, v.unk, v.add_bos) == (1, 2, 0, True)
    assert v.tokenize("Hello")[0] == 1 and v.tokenize("Hello", add_special=False)[0] != 1
    # control tokens are text unless parse_special
    assert 2 not in v.tokenize("a</s>b", add_special=False)
    ids = v.tokenize("a</s>b", add_special=False, parse_special=True)
    assert ids.count(2) == 1 and v.types[2] == TokenType.CONTROL
    # the text after a special token gets the SentencePiece space prefix again, as in llama.cpp
    assert v.detokenize(ids) == "a b" and v.detokenize(ids, special=True) == "a</s> b"
    g = Vocab.from_gguf(DATA / "ggml-vocab-gpt-2.gguf")
    eot = g.tokens.index("<|endoftext|>")
    assert g.tokenize("x<|endoftext|>y", parse_special=True) == g.tokenize("x") + [eot] + g.tokenize("y")
    assert eot not in g.tokenize("x<|endoftext|>y")
    assert g.is_eog(eot)


def test_byte_fallback_and_errors(tmp_path):
    v = Vocab.from_gguf(DATA / "ggml-vocab-llama-spm.gguf")
    ids = v.tokenize("🦙", add_special=False)
    assert all(v.types[i] in (TokenType.BYTE, TokenType.NORMAL) for i in ids)
    assert v.detokenize(ids) == "🦙"
    with pytest.raises(ValueError, match="out of range"):
        v.token_to_piece(v.n_tokens)
    from kvcache_ggml.runtime import make_model
    path = make_model(tmp_path / "m.gguf", vocab=16)  # the model maker's minimal SPM vocabulary
    small = Vocab.from_gguf(path)
    assert small.n_tokens == 16 and small.tokenize("t1t2", add_special=False)


@pytest.mark.parametrize("name", NAMES)
def test_a_lone_surrogate_is_a_value_error(name):
    """A str holding a lone surrogate (from JSON's "\\ud800", or surrogateescape'd bytes) is no Unicode text: a
    ValueError naming it, where ``tokenizers`` raised a bare TypeError; a pair's character (an emoji) tokenizes."""
    v = Vocab.from_gguf(DATA / f"ggml-vocab-{name}.gguf")
    for text in ("ab\ud800c", "\udcff", "x" * 40000 + "\udfff"):  # (the last: too long for the fragment cache)
        with pytest.raises(ValueError, match=r"lone surrogate '\\ud[89a-f]..'"):
            v.tokenize(text)
    assert v.detokenize(v.tokenize("\U0001f600", add_special=False)) == "\U0001f600"


def _fragments_brute(v, text, parse_special):
    """llama.cpp's tokenizer_st_partition spelled out: every special token in turn (longest first), each fragment
    split at every occurrence of it."""
    frags = [text] if text else []
    for s_text, s_id, control in v._special:
        if (control and not parse_special) or not s_text:
            continue
        out = []
        for f in frags:
            if isinstance(f, int):
                out.append(f)
                continue
            for j, p in enumerate(f.split(s_text)):
                if j:
                    out.append(s_id)
                    if s_id in v.rstrip:
                        p = p.lstrip(" \t\n\v\f\r")
                if p:
                    out.append(p)
        frags = out
    return frags


def _tokenize_brute(v, text, parse_special):
    """The plain partition's fragments, each text one encoded (SPM: with a space first where it starts the text or
    follows a special token)."""
    frags = _fragments_brute(v, text, parse_special)
    spm = v.model == "llama" and v.add_space_prefix
    out = []
    for k, f in enumerate(frags):
        lead = " " if spm and (k == 0 or isinstance(frags[k - 1], int)) else ""
        out += [f] if isinstance(f, int) else v._tk.encode(lead + f, add_special_tokens=False).ids
    return out


@pytest.mark.parametrize("name", NAMES)
def test_fragments_and_the_fragment_cache_equal_the_plain_partition(name):
    """Vocab.tokenize looks for special tokens by groups of their first characters and keeps recent fragments' ids:
    the same ids as the plain partition and encode, on texts built from overlapping special tokens (user-defined
    ones added to the vocabulary: prefixes of each other, sharing first characters, one inside another) and
    text, each tokenized twice (the second time from the cache), the rstrip rule included."""
    v = Vocab.from_gguf(DATA / f"ggml-vocab-{name}.gguf")
    rng = np.random.default_rng(5)
    normal = [i for i, t in enumerate(v.tokens) if v.types[i] == TokenType.NORMAL and 2 <= len(t) <= 6]
    picked = [int(i) for i in rng.choice(normal, 40, replace=False)]
    ids = {t: i for i, t in enumerate(v.tokens)}
    for i in list(picked):  # prefixes and suffixes of the picked pieces that are pieces too: overlapping specials
        t = v.tokens[i]
        picked += [ids[u] for u in (t[:-1], t[1:], t[:2]) if u in ids and v.types[ids[u]] == TokenType.NORMAL]
    for i in picked:
        v.types[i] = int(TokenType.USER_DEFINED)
    v.rstrip = frozenset(picked[::7])
    v.build_tokenizer()
    assert len({s[:3] for s, _, _ in v._special}) < len(v._special)  # (groups of several tokens)
    pieces = [v.tokens[i].replace("▁", " ") for i in picked] + [s for s, _, _ in v._special[:3]]
    words = ["hello", " world", "  ", "\n", "ab", "é", "x"]
    for k in range(60):
        parts = rng.choice(pieces + words, int(rng.integers(1, 25)))
        text = "".join(parts) + ("" if k % 10 else "".join(parts[:5]) * 8000)[:40000]  # (past the cache's limit)
        for parse_special in (False, True):
            want = _tokenize_brute(v, text, parse_special)
            assert v._fragments(text, parse_special) == _fragments_brute(v, text, parse_special)
            assert v.tokenize(text, add_special=False, parse_special=parse_special) == want
            assert v.tokenize(text, add_special=False, parse_special=parse_special) == want
    assert v._encode_cached.cache_info().hits > 0
