"""kvcache_ggml.serve.protocol: requests validated once, responses that parse as the openai package's models."""
from __future__ import annotations

import json
import math

import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from kvcache_ggml.serve import protocol as P
from kvcache_ggml.serve.protocol import RequestError, parse_chat, parse_completion
from kvcache_ggml.serve.results import Usage


def _err(fn, body) -> RequestError:
    with pytest.raises(RequestError) as ei:
        fn(body)
    return ei.value


def _chat(**kw):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}


def _comp(**kw):
    return {"model": "m", "prompt": "hi", **kw}


# ------------------------------------------------------------------------------------------- errors

def test_error_body_shape():
    e = RequestError("bad x", param="x", code="c")
    assert e.status == 400 and str(e) == "bad x"
    assert e.body() == {"error": {"message": "bad x", "type": "invalid_request_error", "param": "x", "code": "c"}}
    assert RequestError("no key", status=401).type == "authentication_error"
    assert RequestError("boom", status=500).type == "server_error"
    assert RequestError("t", status=503, type="overloaded").type == "overloaded"


def test_body_json_utf8_depth_and_surrogates():
    """parse_json: UTF-8 JSON only (a BOM dropped); a lone surrogate, escaped or as UTF-8 bytes, and nesting past the
    recursion limit are 400s (they were 500s: the tokenizer refuses such a string, json.loads raises RecursionError);
    an escaped pair (an emoji as ensure_ascii writes it) and an escaped backslash before "ud800" are text."""
    assert P.parse_json(b'{"a": "\\ud83d\\ude00", "b": "\\\\ud800"}') == {"a": "\U0001f600", "b": "\\ud800"}
    assert P.parse_json("\ufeff[1]".encode()) == [1]
    for body, says in [(b'{"prompt": "x\\ud800y"}', "lone surrogate \\ud800 at character 1"),
                       (b'{"m": [{"\\uDC01": 1}]}', "lone surrogate \\udc01 at character 0"),
                       (b'{"prompt": "\\ude00\\ud83d"}', "lone surrogate \\ude00 at character 0"),
                       (b'{"prompt": "\xed\xa0\x80"}', "can't decode byte 0xed"),
                       ('"x"'.encode("utf-16"), "can't decode byte 0xff"),
                       (b"[" * 5000 + b"]" * 5000, "nests arrays or objects too deeply"),
                       (b"{not json", "Expecting property name")]:
        e = _err(P.parse_json, body)
        assert e.status == 400 and e.message.startswith("the body is not valid JSON: ") and says in e.message, body


def test_body_must_be_object():
    for body in ([1], "x", None, 3):
        assert _err(parse_chat, body).status == 400
        assert "JSON object" in _err(parse_completion, body).message


def test_missing_required_fields_name_param():
    assert _err(parse_completion, {"prompt": "x"}).param == "model"
    assert _err(parse_completion, {"model": "m"}).param == "prompt"
    assert _err(parse_chat, {"model": "m"}).param == "messages"
    assert _err(parse_chat, {"messages": []}).param == "model"


# ------------------------------------------------------------------------------------------- completions

def test_completion_defaults():
    r = parse_completion(_comp(extra_field={"ignored": True}))
    assert (r.model, r.prompt, r.stream, r.stream_include_usage, r.echo, r.user) == ("m", "hi", False, False,
                                                                                  False, None)
    s = r.sampling
    assert (s.temperature, s.top_k, s.top_p, s.min_p, s.seed, s.max_tokens) == (1.0, 0, 1.0, 0.0, None, None)
    assert (s.presence_penalty, s.frequency_penalty, s.logit_bias, s.logprobs, s.top_logprobs, s.stop,
            s.ignore_eos) == (0.0, 0.0, {}, False, 0, [], False)


def test_completion_prompt_forms():
    assert parse_completion(_comp(prompt=[1, 2, 3])).prompt == [1, 2, 3]
    assert parse_completion(_comp(prompt=["one"])).prompt == "one"
    assert parse_completion(_comp(prompt=[[4, 5]])).prompt == [4, 5]
    assert parse_completion(_comp(prompt="")).prompt == ""
    e = _err(parse_completion, _comp(prompt=["a", "b"]))
    assert e.param == "prompt" and "got 2" in e.message
    for bad in ([], [1, True], [1.0], [1, "a"], 5, {"a": 1}):
        assert _err(parse_completion, _comp(prompt=bad)).param == "prompt"


def test_completion_echo_stream_options_logprobs():
    assert _err(parse_completion, _comp(echo=True)).param == "echo"
    assert parse_completion(_comp(echo=False)).echo is False
    e = _err(parse_completion, _comp(stream_options={"include_usage": True}))
    assert e.param == "stream_options" and "stream" in e.message
    r = parse_completion(_comp(stream=True, stream_options={"include_usage": True}))
    assert r.stream and r.stream_include_usage
    r = parse_completion(_comp(logprobs=3))
    assert r.sampling.logprobs and r.sampling.top_logprobs == 3
    r = parse_completion(_comp(logprobs=0))
    assert r.sampling.logprobs and r.sampling.top_logprobs == 0
    assert _err(parse_completion, _comp(logprobs=6)).message == "logprobs must be in [0, 5], got 6"
    assert _err(parse_completion, _comp(logprobs=True)).param == "logprobs"


def test_completion_prompt_ids_checked_against_vocab():
    r = parse_completion(_comp(prompt=[1, 99], logit_bias={"7": 1}))
    r.check_vocab(100)
    e = pytest.raises(RequestError, r.check_vocab, 99).value
    assert "99" in e.message and e.param == "prompt"


# ------------------------------------------------------------------------------------------- sampling fields

@pytest.mark.parametrize("field,value", [
    ("temperature", 2.5), ("temperature", -0.1), ("top_p", 0), ("top_p", 1.5), ("min_p", 1.1), ("top_k", -2),
    ("presence_penalty", 2.1), ("frequency_penalty", -3), ("max_tokens", 0), ("top_logprobs", 21),
])
def test_range_errors_name_value(field, value):
    body = _chat(**{field: value}, logprobs=True)
    e = _err(parse_chat, body)
    assert e.status == 400 and e.param == field and repr(value) in e.message


def test_max_tokens_message_exact():
    assert _err(parse_completion, _comp(max_tokens=0)).message == "max_tokens must be >= 1, got 0"
    assert _err(parse_chat, _chat(top_p=0)).message == "top_p must be in (0, 1], got 0"


@pytest.mark.parametrize("field,value", [
    ("stream", 1), ("stream", "true"), ("ignore_eos", 0), ("max_tokens", 5.0), ("max_tokens", True),
    ("top_k", 1.5), ("seed", "1"), ("temperature", True), ("temperature", "1"), ("temperature", math.nan),
    ("user", 5), ("model", 1),
])
def test_strict_types(field, value):
    assert _err(parse_chat, _chat(**{field: value})).param == field


def test_sampling_values_and_nulls():
    r = parse_chat(_chat(temperature=0, top_p=0.5, top_k=40, min_p=0.05, seed=7, max_tokens=9, presence_penalty=1,
                         frequency_penalty=-1.5, ignore_eos=True, stop="###", n=1, user="u", top_logprobs=None,
                         logit_bias=None))
    s = r.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed, s.max_tokens) == (0.0, 0.5, 40, 0.05, 7, 9)
    assert isinstance(s.temperature, float) and isinstance(s.presence_penalty, float)
    assert (s.presence_penalty, s.frequency_penalty, s.ignore_eos, s.stop, r.user) == (1.0, -1.5, True, ["###"],
                                                                                      "u")
    assert parse_chat(_chat(seed=-1)).sampling.seed is None


def test_n_and_stop_limits():
    e = _err(parse_chat, _chat(n=2))
    assert e.param == "n" and "only n=1 is supported" in e.message
    assert _err(parse_completion, _comp(best_of=3)).param == "best_of"
    assert parse_chat(_chat(stop=["a", "b", "c", "d"])).sampling.stop == ["a", "b", "c", "d"]
    assert "at most 4" in _err(parse_chat, _chat(stop=list("abcde"))).message
    for bad in ([""], "", [1], {"a": 1}):
        assert _err(parse_chat, _chat(stop=bad)).param == "stop"


def test_logit_bias():
    s = parse_chat(_chat(logit_bias={"5": 100, 7: -100, "9": 0.5})).sampling
    assert s.logit_bias == {5: 100.0, 7: -100.0, 9: 0.5}
    for bad in ({"x": 1}, {"-1": 1}, {"5": 101}, {"5": "1"}, {"5": True}, [1], {"": 1}, {"5": math.nan},
                {"5": -math.inf}):
        assert _err(parse_chat, _chat(logit_bias=bad)).param == "logit_bias"
    # digits that are not ASCII: "²" (int() refuses it) and "٣" (int() reads it as 3) are no token ids
    for key in ("\u00b2", "\u0663", "1\u0663"):
        e = _err(parse_chat, _chat(logit_bias={key: 1}))
        assert e.param == "logit_bias" and repr(key) in e.message
    s.check_vocab(10)
    e = pytest.raises(RequestError, s.check_vocab, 8).value
    assert e.status == 400 and "9" in e.message and "8" in e.message and e.param == "logit_bias"


# ------------------------------------------------------------------------------------------- chat

def test_chat_messages():
    r = parse_chat({"model": "m", "messages": [
        {"role": "system", "content": "sys"}, {"role": "developer", "content": "dev"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "x"},
        {"role": "assistant", "content": None}, {"role": "tool", "content": "t", "tool_call_id": "1"}]})
    assert [m["content"] for m in r.messages] == ["sys", "dev", "a\nb", "", "t"]
    assert r.messages[2]["name"] == "x" and r.messages[4]["tool_call_id"] == "1"
    e = _err(parse_chat, _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]))
    assert "image_url" in e.message and e.param == "messages[0].content"
    assert _err(parse_chat, _chat(messages=[{"role": "bot", "content": "x"}])).param == "messages[0].role"
    assert _err(parse_chat, _chat(messages=[{"role": "user"}])).param == "messages[0].content"
    assert _err(parse_chat, _chat(messages=["hi"])).param == "messages[0]"
    assert _err(parse_chat, _chat(messages=[])).param == "messages"


def test_chat_logprobs_max_tokens_kwargs():
    s = parse_chat(_chat(logprobs=True, top_logprobs=5)).sampling
    assert s.logprobs and s.top_logprobs == 5
    assert _err(parse_chat, _chat(top_logprobs=2)).param == "top_logprobs"
    assert _err(parse_chat, _chat(logprobs=1)).param == "logprobs"
    assert parse_chat(_chat(max_tokens=10, max_completion_tokens=20)).sampling.max_tokens == 20
    assert parse_chat(_chat(max_tokens=10)).sampling.max_tokens == 10
    r = parse_chat(_chat(chat_template_kwargs={"enable_thinking": False}))
    assert r.chat_template_kwargs == {"enable_thinking": False}
    assert _err(parse_chat, _chat(chat_template_kwargs=[1])).param == "chat_template_kwargs"
    assert _err(parse_chat, _chat(stream=False, stream_options={})).param == "stream_options"
    r = parse_chat(_chat(stream=True, stream_options={"include_usage": False}))
    assert r.stream and not r.stream_include_usage


# ------------------------------------------------------------------------------------------- responses

def _roundtrip(d):
    return json.loads(json.dumps(d, allow_nan=False))


def test_completion_response_parses_as_openai():
    lp = P.completion_logprobs(["He", "llo"], [-0.5, -math.inf], [{"He": -0.5, "A": -1.0}, {"llo": -2.0}], [0, 2])
    d = _roundtrip(P.completion_response("cmpl-1", 123, "m", "Hello", "length", P.usage_dict(Usage(4, 2, 3)), lp))
    c = Completion.model_validate(d)
    assert c.id == "cmpl-1" and c.object == "text_completion" and c.created == 123 and c.model == "m"
    ch = c.choices[0]
    assert (ch.index, ch.text, ch.finish_reason) == (0, "Hello", "length")
    assert ch.logprobs.tokens == ["He", "llo"] and ch.logprobs.token_logprobs == [-0.5, -9999.0]
    assert ch.logprobs.top_logprobs[0] == {"He": -0.5, "A": -1.0} and ch.logprobs.text_offset == [0, 2]
    assert (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) == (4, 2, 6)
    assert c.usage.prompt_tokens_details.cached_tokens == 3


def test_completion_chunks():
    last = Completion.model_validate(_roundtrip(P.completion_chunk("c", 1, "m", "!", "stop")))
    assert last.choices[0].text == "!" and last.choices[0].finish_reason == "stop" and last.usage is None
    mid = P.completion_chunk("c", 1, "m", "x")
    assert mid["choices"][0]["finish_reason"] is None and mid["object"] == "text_completion"
    u = Completion.model_validate(_roundtrip(P.usage_chunk("c", 1, "m", P.usage_dict(Usage(1, 2, 0)), chat=False)))
    assert u.choices == [] and u.usage.total_tokens == 3


def test_chat_response_and_chunks_parse_as_openai():
    top = [("a", b"a", -0.1), ("\u00e9", "\u00e9".encode(), -2.5)]
    lp = [P.chat_token_logprob("a", b"a", -0.1, top)]
    c = ChatCompletion.model_validate(_roundtrip(
        P.chat_response("chatcmpl-1", 5, "m", "a", "stop", P.usage_dict(Usage(3, 1, 0)), lp)))
    assert c.object == "chat.completion" and c.choices[0].message.role == "assistant"
    assert c.choices[0].message.content == "a" and c.choices[0].finish_reason == "stop"
    e = c.choices[0].logprobs.content[0]
    assert (e.token, e.logprob, e.bytes) == ("a", -0.1, [97])
    assert [(t.token, t.logprob, t.bytes) for t in e.top_logprobs] == [("a", -0.1, [97]), ("\u00e9", -2.5,
                                                                                          [0xC3, 0xA9])]
    assert c.usage.total_tokens == 4 and c.usage.prompt_tokens_details.cached_tokens == 0
    first = ChatCompletionChunk.model_validate(_roundtrip(
        P.chat_chunk("chatcmpl-1", 5, "m", {"role": "assistant", "content": ""})))
    assert first.object == "chat.completion.chunk" and first.choices[0].delta.role == "assistant"
    assert first.choices[0].finish_reason is None and first.choices[0].logprobs is None
    mid = ChatCompletionChunk.model_validate(_roundtrip(P.chat_chunk("chatcmpl-1", 5, "m", {"content": "a"},
                                                                     logprobs=lp)))
    assert mid.choices[0].delta.content == "a" and mid.choices[0].logprobs.content[0].token == "a"
    end = ChatCompletionChunk.model_validate(_roundtrip(P.chat_chunk("chatcmpl-1", 5, "m", {}, "length")))
    assert end.choices[0].finish_reason == "length" and end.choices[0].delta.content is None
    usage = P.usage_dict(Usage(3, 1, 0))
    u = ChatCompletionChunk.model_validate(_roundtrip(P.usage_chunk("chatcmpl-1", 5, "m", usage, chat=True)))
    assert u.choices == [] and u.usage.completion_tokens == 1


def test_models_response():
    d = _roundtrip(P.models_response(["a", "b"], 9))
    assert d["object"] == "list"
    ms = [Model.model_validate(x) for x in d["data"]]
    assert [(m.id, m.created, m.owned_by, m.object) for m in ms] == [("a", 9, "kvcache_ggml", "model"),
                                                                     ("b", 9, "kvcache_ggml", "model")]
