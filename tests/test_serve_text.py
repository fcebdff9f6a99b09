"""kvcache_ggml.serve.text: streamed text that is whole characters and never leaks part of a stop string."""
from __future__ import annotations

import pytest

from kvcache_ggml.serve.text import TextStream


class FakeVocab:
    """Token id -> bytes, the part of Vocab that StreamDecoder uses."""

    add_space_prefix = False

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    def token_to_piece(self, t: int) -> bytes:
        return self.pieces[t]


def _stream(pieces: list[bytes | str], stop: list[str]) -> tuple[TextStream, list[str]]:
    """Push every piece in order (stopping early when the stream stops) and finish."""
    vocab = FakeVocab([p.encode() if isinstance(p, str) else p for p in pieces])
    ts = TextStream(vocab, stop)
    out = []
    for t in range(len(pieces)):
        out.append(ts.push(t))
        if ts.stopped:
            break
    out.append(ts.finish())
    return ts, out


def test_plain_text_passes_through():
    ts, out = _stream([" Hello", ",", " world"], [])
    assert out == [" Hello", ",", " world", ""]  # the first space is kept (skip_leading_space=False)
    assert ts.text == " Hello, world" and not ts.stopped and ts.stop is None


def test_multibyte_char_split_over_three_tokens():
    euro = "\u20ac".encode()  # 3 bytes
    assert len(euro) == 3
    ts, out = _stream([b"a", euro[:1], euro[1:2], euro[2:], b"b"], [])
    assert out == ["a", "", "", "\u20ac", "b", ""]
    assert ts.text == "a\u20acb"


def test_unfinished_char_at_finish_is_replacement():
    ts, out = _stream([b"x", "\u20ac".encode()[:2]], [])
    assert out == ["x", "", "\ufffd"]


def test_stop_split_over_tokens():
    ts, out = _stream(["He", "llo wor", "ld"], ["o w"])
    assert "".join(out) == "Hell" and ts.text == "Hell"
    assert ts.stopped and ts.stop == "o w"
    assert out == ["He", "Hell"[2:], ""]
    assert ts.push(2) == "" and ts.finish() == ""


def test_stop_prefix_never_leaks_across_chunks():
    ts, out = _stream(["Hell", "o", " ", "w"], ["o w"])
    assert out == ["Hell", "", "", "", ""]
    assert ts.stopped and ts.text == "Hell"


def test_partial_stop_prefix_released_at_finish():
    ts, out = _stream(["abc", "</", "sto"], ["</stop>"])
    assert out == ["abc", "", "", "</sto"]
    assert not ts.stopped and ts.text == "abc</sto"


def test_prefix_that_stops_matching_is_released():
    ts, out = _stream(["a<", "/", "b>"], ["</stop>"])
    assert out == ["a", "", "</b>", ""]
    assert ts.text == "a</b>"


def test_earliest_stop_wins():
    ts, out = _stream(["xx END yy STOP"], ["STOP", "END"])
    assert ts.stop == "END" and ts.text == "xx "
    ts, out = _stream(["one ", "tw", "o three"], ["three", "two"])
    assert ts.stop == "two" and ts.text == "one "
    ts, out = _stream(["abcdef"], ["cd", "cdef"])  # same start: the longer one
    assert ts.stop == "cdef" and ts.text == "ab"


def test_stop_is_suffix_of_a_longer_piece():
    ts, out = _stream(["Say", " hello<|end|>"], ["<|end|>"])
    assert out == ["Say", " hello", ""] and ts.stopped and ts.stop == "<|end|>"
    ts, out = _stream(["Hello"], ["llo"])
    assert out == ["He", ""] and ts.text == "He"


def test_stop_at_start_and_multibyte_stop():
    ts, out = _stream(["\n\n", "x"], ["\n\n"])
    assert out == ["", ""] and ts.stopped and ts.text == ""
    e = "\u00e9".encode()
    ts, out = _stream([b"caf", e[:1], e[1:], b"!"], ["\u00e9!"])
    assert "".join(out) == "caf" and ts.stopped


def test_empty_stop_string_refused():
    with pytest.raises(ValueError, match="must not be empty"):
        TextStream(FakeVocab([]), ["a", ""])
