"""kvcache_ggml.serve.chat: chat templates rendered as transformers renders them."""
from __future__ import annotations

import datetime

import pytest

from kvcache_ggml.serve.chat import ChatTemplate, TemplateError
from kvcache_ggml.serve.protocol import RequestError

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
          " + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
          "{% endif %}")

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "  Why?  "}]


def test_chatml():
    t = ChatTemplate(CHATML)
    want = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
            "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\n  Why?  <|im_end|>\n")
    assert t.render(MSGS, add_generation_prompt=False) == want
    assert t.render(MSGS) == want + "<|im_start|>assistant\n"


def test_llama3_with_bos():
    t = ChatTemplate(LLAMA3, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    want = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nWhy?<|eot_id|>")
    assert t.render(MSGS, add_generation_prompt=False) == want
    assert t.render(MSGS, add_generation_prompt=True) == want + "<|start_header_id|>assistant<|end_header_id|>\n\n"


def test_trim_and_lstrip_blocks():
    src = ("{% for m in messages %}\n"
           "    {% if m.role == 'user' %}\n"
           "U: {{ m.content }}\n"
           "    {% else %}\n"
           "O: {{ m.content }}\n"
           "    {% endif %}\n"
           "{% endfor %}\n")
    assert ChatTemplate(src).render(MSGS[:3]) == "O: Be brief.\nU: Hi!\nO: Hello.\n"


def test_kwargs_win_and_reach_the_template():
    src = "{{ bos_token }}{% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}"
    t = ChatTemplate(src, bos_token="<s>")
    assert t.render([]) == "<s>"
    assert t.render([], enable_thinking=False) == "<s>/no_think"
    assert t.render([], bos_token="[B]") == "[B]"


def test_raise_exception_is_a_400():
    src = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation roles must alternate "
           "user/assistant/user/assistant/...') }}{% endif %}ok")
    t = ChatTemplate(src)
    assert t.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(TemplateError) as ei:
        t.render(MSGS)
    e = ei.value
    assert isinstance(e, RequestError) and e.status == 400 and "roles must alternate" in e.message
    assert e.body()["error"]["type"] == "invalid_request_error"


def test_loop_controls():
    src = "{% for m in messages %}{% if m.role == 'assistant' %}{% break %}{% endif %}{{ m.content }}|{% endfor %}"
    assert ChatTemplate(src).render(MSGS) == "Be brief.|Hi!|"
    src = "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}{{ m.role }},{% endfor %}"
    assert ChatTemplate(src).render(MSGS) == "user,assistant,user,"


def test_sandbox_blocks_unsafe_access():
    t = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(TemplateError) as ei:
        t.render(MSGS)
    assert ei.value.status == 400 and "unsafe" in ei.value.message
    # immutable sandbox: no mutation of the messages
    with pytest.raises(TemplateError):
        ChatTemplate("{{ messages.append(1) }}").render(MSGS)


def test_tojson_and_strftime_now():
    t = ChatTemplate("{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2) }}")
    out = t.render([{"role": "user", "content": "<b>caf\u00e9</b>"}])
    assert out == ('{"role": "user", "content": "<b>caf\u00e9</b>"}|'
                   '{\n  "role": "user",\n  "content": "<b>caf\u00e9</b>"\n}')
    year = ChatTemplate("{{ strftime_now('%Y') }}").render([])
    assert year in {str(datetime.date.today().year), str(datetime.date.today().year + 1)}


def test_other_render_failures_are_template_errors():
    with pytest.raises(TemplateError):
        ChatTemplate("{{ messages[0]['content'] + 1 }}").render(MSGS)
    with pytest.raises(TemplateError):
        ChatTemplate("{{ nothing.here }}").render(MSGS)


def test_syntax_error_at_construction():
    with pytest.raises(ValueError, match="syntax error at line 1"):
        ChatTemplate("{% for m in messages %}{{ m }}")
    with pytest.raises(ValueError, match="syntax error"):
        ChatTemplate("{{ }")


class _Vocab:
    tokens = ["<unk>", "<s>", "</s>", "a"]
    bos, eos = 1, 2


def test_from_gguf_kv():
    t = ChatTemplate.from_gguf_kv({"tokenizer.chat_template": LLAMA3}, _Vocab())
    assert (t.bos_token, t.eos_token) == ("<s>", "</s>")
    assert t.render(MSGS[1:2], add_generation_prompt=False) == ("<s><|start_header_id|>user<|end_header_id|>\n\n"
                                                                "Hi!<|eot_id|>")
    assert ChatTemplate.from_gguf_kv({"general.name": "x"}, _Vocab()) is None
    v = _Vocab()
    v.bos, v.eos = -1, 2
    t = ChatTemplate.from_gguf_kv({"tokenizer.chat_template": CHATML}, v)
    assert (t.bos_token, t.eos_token) == ("", "</s>")
