"""kvcache_ggml.serve.formatters: each endpoint's prompt and chunks, against JSON written out by hand.

The vocabularies are the real GGUF ones (tests/data/vocab): GPT-2's (15496 "Hello", 995 " world", 127 and 102 the
bytes C3 and A9 of "é", 1 '"') and llama's SentencePiece one (BOS 1 "<s>", added by the tokenizer).
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kvcache_ggml.runtime.tokenizer import Vocab
from kvcache_ggml.serve import app
from kvcache_ggml.serve.chat import ChatTemplate
from kvcache_ggml.serve.formatters import ChatFormatter, CompletionFormatter, Formatter
from kvcache_ggml.serve.protocol import RequestError, parse_chat, parse_completion
from kvcache_ggml.serve.request import Event
from kvcache_ggml.serve.results import TokenLogprob, Usage
from serve_helpers import CHATML, GPT2_VOCAB

SPM_VOCAB = GPT2_VOCAB.parent / "ggml-vocab-llama-spm.gguf"


@pytest.fixture(scope="module")
def gpt2():
    return Vocab.from_gguf(GPT2_VOCAB)


@pytest.fixture(scope="module")
def spm():
    return Vocab.from_gguf(SPM_VOCAB)


def _chat_req(**kw):
    return parse_chat({"model": "m", "messages": [{"role": "user", "content": "Hi"}], **kw})


# two tokens: "Hello" (with " world" as the alternative) and " world" (with "Hello"; -inf is OpenAI's -9999.0)
LPS = [TokenLogprob(15496, -0.25, ((15496, -0.25), (995, -1.5))), TokenLogprob(995, -0.5, ((995, -0.5),
                                                                                            (15496, -math.inf)))]
USAGE = Usage(prompt_tokens=5, completion_tokens=2, cached_tokens=3)
USAGE_JSON = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
              "prompt_tokens_details": {"cached_tokens": 3}}


# ---------------------------------------------------------------------------------------------- prompts

def test_completion_prompt_text_and_ids(gpt2):
    f = CompletionFormatter(gpt2)
    got = f.prompt(parse_completion({"model": "m", "prompt": "Hello world"}))
    assert got.dtype == np.int32 and got.tolist() == [15496, 995]
    assert f.prompt(parse_completion({"model": "m", "prompt": [7, 8, 9]})).tolist() == [7, 8, 9]
    assert (f.id_prefix, f.param) == ("cmpl", "prompt")


def test_chat_prompt_renders_the_template(gpt2):
    f = ChatFormatter(gpt2, ChatTemplate(CHATML), "m")
    got = f.prompt(_chat_req())
    # "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n": GPT-2 has no <|im_start|>, so it is plain text
    want = gpt2.tokenize("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", add_special=True,
                         parse_special=True)
    assert got.dtype == np.int32 and got.tolist() == want
    assert (f.id_prefix, f.param) == ("chatcmpl", "messages")


def test_chat_prompt_has_one_bos(spm):
    """A template that writes the BOS itself, on a tokenizer that adds one: the prompt starts with one BOS."""
    t = ChatTemplate("{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}",
                     bos_token="<s>")
    got = ChatFormatter(spm, t, "m").prompt(_chat_req(chat_template_kwargs={}))
    assert got.tolist() == [1, 518, 1792, 29962, 6324, 13]  # <s> "▁[" "user" "]" "▁Hi" "\n"
    # a template without BOS: the tokenizer's own
    t = ChatTemplate("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}", bos_token="<s>")
    assert ChatFormatter(spm, t, "m").prompt(_chat_req()).tolist() == [1, 518, 1792, 29962, 6324, 13]


def test_chat_without_template_is_refused(gpt2):
    with pytest.raises(RequestError) as ei:
        ChatFormatter(gpt2, None, "tiny").prompt(_chat_req())
    e = ei.value
    assert e.status == 400 and e.param == "messages"
    assert e.message == ("model 'tiny' has no chat template (tokenizer.chat_template); use /v1/completions")


def test_parse_is_the_endpoints_parser(gpt2):
    body = {"model": "m", "prompt": "x", "messages": [{"role": "user", "content": "y"}], "max_tokens": 3}
    assert CompletionFormatter(gpt2).parse(body).prompt == "x"
    assert ChatFormatter(gpt2, None, "m").parse(body).messages == [{"role": "user", "content": "y"}]
    with pytest.raises(RequestError) as ei:
        ChatFormatter(gpt2, None, "m").parse({"model": "m", "prompt": "x"})
    assert ei.value.param == "messages"


# ---------------------------------------------------------------------------------------------- chat shapes

def _chat_chunk(delta, finish_reason=None, logprobs=None):
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 9, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}]}


CHAT_LPS = [{"token": "Hello", "logprob": -0.25, "bytes": [72, 101, 108, 108, 111],
             "top_logprobs": [{"token": "Hello", "logprob": -0.25, "bytes": [72, 101, 108, 108, 111]},
                              {"token": " world", "logprob": -1.5, "bytes": [32, 119, 111, 114, 108, 100]}]},
            {"token": " world", "logprob": -0.5, "bytes": [32, 119, 111, 114, 108, 100],
             "top_logprobs": [{"token": " world", "logprob": -0.5, "bytes": [32, 119, 111, 114, 108, 100]},
                              {"token": "Hello", "logprob": -9999.0, "bytes": [72, 101, 108, 108, 111]}]}]


def test_chat_stream_chunks(gpt2):
    f = ChatFormatter(gpt2, None, "m")
    assert f.first_chunk("chatcmpl-1", 9, "m") == _chat_chunk({"role": "assistant", "content": ""})
    assert f.text_chunk("chatcmpl-1", 9, "m", "Hi") == _chat_chunk({"content": "Hi"})
    assert f.text_chunk("chatcmpl-1", 9, "m", "Hello world", LPS, 4) == _chat_chunk(
        {"content": "Hello world"}, logprobs={"content": CHAT_LPS})
    assert f.final_chunk("chatcmpl-1", 9, "m", "length") == _chat_chunk({}, "length")
    assert f.usage_chunk("chatcmpl-1", 9, "m", USAGE) == {"id": "chatcmpl-1", "object": "chat.completion.chunk",
                                                          "created": 9, "model": "m", "choices": [],
                                                          "usage": USAGE_JSON}


def test_chat_logprobs_of_a_partial_character(gpt2):
    """A token that is half of "é": its text is the replacement character, its bytes the raw byte."""
    got = ChatFormatter(gpt2, None, "m").text_chunk("c", 1, "m", "", [TokenLogprob(127, -2.0, ((102, -3.0),))])
    assert got["choices"][0]["logprobs"] == {"content": [
        {"token": "\ufffd", "logprob": -2.0, "bytes": [0xC3],
         "top_logprobs": [{"token": "\ufffd", "logprob": -3.0, "bytes": [0xA9]}]}]}


def test_chat_response(gpt2):
    f = ChatFormatter(gpt2, None, "m")
    want = {"id": "chatcmpl-1", "object": "chat.completion", "created": 9, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello world"},
                         "finish_reason": "stop", "logprobs": None}], "usage": USAGE_JSON}
    assert f.response("chatcmpl-1", 9, "m", "Hello world", "stop", USAGE) == want
    want["choices"][0]["logprobs"] = {"content": CHAT_LPS}
    assert f.response("chatcmpl-1", 9, "m", "Hello world", "stop", USAGE, LPS) == want
    want["choices"][0]["logprobs"] = {"content": []}  # asked for, none generated
    assert f.response("chatcmpl-1", 9, "m", "Hello world", "stop", USAGE, []) == want


# ---------------------------------------------------------------------------------------------- completion shapes

def _cmpl_chunk(text, finish_reason=None, logprobs=None):
    return {"id": "cmpl-1", "object": "text_completion", "created": 9, "model": "m",
            "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}]}


def test_completion_stream_chunks(gpt2):
    f = CompletionFormatter(gpt2)
    assert f.first_chunk("cmpl-1", 9, "m") is None
    assert f.text_chunk("cmpl-1", 9, "m", "Hi") == _cmpl_chunk("Hi")
    # offset 4: four characters streamed before; " world" starts 5 characters after "Hello"
    assert f.text_chunk("cmpl-1", 9, "m", "Hello world", LPS, 4) == _cmpl_chunk("Hello world", logprobs={
        "tokens": ["Hello", " world"], "token_logprobs": [-0.25, -0.5],
        "top_logprobs": [{"Hello": -0.25, " world": -1.5}, {" world": -0.5, "Hello": -9999.0}],
        "text_offset": [4, 9]})
    assert f.final_chunk("cmpl-1", 9, "m", "stop") == _cmpl_chunk("", "stop")
    assert f.usage_chunk("cmpl-1", 9, "m", USAGE) == {"id": "cmpl-1", "object": "text_completion", "created": 9,
                                                      "model": "m", "choices": [], "usage": USAGE_JSON}


def test_completion_response(gpt2):
    f = CompletionFormatter(gpt2)
    want = {"id": "cmpl-1", "object": "text_completion", "created": 9, "model": "m",
            "choices": [{"index": 0, "text": "Hello world", "finish_reason": "length", "logprobs": None}],
            "usage": USAGE_JSON}
    assert f.response("cmpl-1", 9, "m", "Hello world", "length", USAGE) == want
    # the whole text's offsets count from 0; a partial character counts as the one replacement character
    lps = [TokenLogprob(127, -1.0), TokenLogprob(102, -2.0), TokenLogprob(1, -3.0)]
    want["choices"][0]["logprobs"] = {"tokens": ["\ufffd", "\ufffd", '"'], "token_logprobs": [-1.0, -2.0, -3.0],
                                      "top_logprobs": [{}, {}, {}], "text_offset": [0, 1, 2]}
    assert f.response("cmpl-1", 9, "m", "Hello world", "length", USAGE, lps) == want


# ---------------------------------------------------------------------------------------------- one interface

@pytest.mark.parametrize("make", [lambda v: ChatFormatter(v, None, "m"), CompletionFormatter])
def test_both_have_the_whole_interface(gpt2, make):
    f = make(gpt2)
    members = [n for n in vars(Formatter) if not n.startswith("_")] + list(Formatter.__annotations__)
    assert sorted(set(members)) == ["final_chunk", "first_chunk", "id_prefix", "param", "parse", "prompt",
                                    "response", "text_chunk", "usage_chunk"]
    for n in members:
        assert hasattr(f, n), n


@pytest.mark.parametrize("make", [lambda v: ChatFormatter(v, None, "m"), CompletionFormatter])
@pytest.mark.parametrize("text", ["", "Hello", 'a "quoted"\\ text\n', "caf\u00e9 \u4e16\u754c \U0001F600",
                                  "\u2028\u0000\t\x7f", "\ufffd"])
def test_precomputed_text_chunk_is_byte_identical(gpt2, make, text):
    """The app's per-request prefix and suffix around the text's JSON string: the bytes the formatter's chunk
    gives through json.dumps (the hot path of a stream without logprobs)."""
    f = make(gpt2)
    p = app._Prepared(f, None, None, None, None, "tiny")
    assert p.id.startswith(f.id_prefix + "-") and len(p.id) == len(f.id_prefix) + 33
    head, tail = p.text_sse
    want = "data: " + json.dumps(f.text_chunk(p.id, p.created, "tiny", text), ensure_ascii=False,
                                 separators=(",", ":")) + "\n\n"
    assert head + json.dumps(text, ensure_ascii=False) + tail == want
    # what the engine thread writes on a one-slot server (serve/direct.py): the same bytes as one chunked-coding chunk
    want_b = want.encode()
    assert p.wire(Event("text", text)) == (b"%x\r\n" % len(want_b) + want_b + b"\r\n", False)
    assert p.wire(Event("text", text, logprobs=[TokenLogprob(1, -0.5, ())])) is None
    assert p.wire(Event("error", "failed")) is None


@pytest.mark.parametrize("make", [lambda v: ChatFormatter(v, None, "m"), CompletionFormatter])
@pytest.mark.parametrize("usage", [False, True])
def test_the_end_on_the_wire_is_the_streams_end(gpt2, make, usage):
    """What the engine thread writes for a stream's end (serve/direct.py), read back by h11 as a client: one chunk
    with the final chunk (the finish reason), the usage when asked for and [DONE], then the end of the body."""
    h11 = pytest.importorskip("h11")
    f = make(gpt2)
    body = {"model": "tiny", "stream": True, "stream_options": {"include_usage": usage}, "prompt": "Hi",
            "messages": [{"role": "user", "content": "Hi"}]}
    p = app._Prepared(f, f.parse(body), None, None, None, "tiny")
    data, last = p.wire(Event("done", finish_reason="length", usage=Usage(7, 3, 2)))
    assert last
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="POST", target="/", headers=[("host", "x"), ("content-length", "0")]))
    client.send(h11.EndOfMessage())
    client.receive_data(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + data)
    events = []
    while (ev := client.next_event()) is not h11.NEED_DATA:
        events.append(ev)
        if isinstance(ev, h11.EndOfMessage):
            break
    assert [type(e) for e in events] == [h11.Response, h11.Data, h11.EndOfMessage]
    sse = events[1].data.decode().split("\n\n")
    assert sse[-1] == "" and sse[-2] == "data: [DONE]" and all(s.startswith("data: ") for s in sse[:-1])
    chunks = [json.loads(s[6:]) for s in sse[:-2]]
    assert len(chunks) == 1 + usage
    assert chunks[0]["id"] == p.id and chunks[0]["choices"][0]["finish_reason"] == "length"
    if usage:
        assert chunks[1]["choices"] == []
        assert (chunks[1]["usage"]["prompt_tokens"], chunks[1]["usage"]["completion_tokens"],
                chunks[1]["usage"]["total_tokens"]) == (7, 3, 10)
