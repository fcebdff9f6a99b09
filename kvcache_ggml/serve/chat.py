"""Chat templates rendered as transformers renders them (``apply_chat_template``).

The template is compiled as transformers' ``_compile_jinja_template`` compiles it: a
``jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with the ``loopcontrols``
extension (``{% break %}``, ``{% continue %}``), the globals ``raise_exception(message)`` and ``strftime_now(format)``
and a ``tojson`` filter that does not escape HTML and keeps non-ASCII text (``json.dumps(ensure_ascii=False)`` with
the optional ``indent``, ``separators`` and ``sort_keys``).  It is rendered with ``messages``,
``add_generation_prompt``, ``bos_token`` and ``eos_token`` (the vocabulary's BOS/EOS text) and the request's
``chat_template_kwargs``, which win over those.

A syntax error in the template is a ``ValueError`` at construction (the server's configuration is at fault).  Any
failure while rendering -- ``raise_exception`` called by the template, an unsafe access the sandbox stops, an
undefined variable used wrongly -- is a :class:`TemplateError`, a :class:`RequestError` with HTTP status 400 (the
messages the client sent are what the template refused).

The template of a GGUF file is its ``tokenizer.chat_template`` key (:meth:`ChatTemplate.from_gguf_kv`).
"""
from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .protocol import RequestError

__all__ = ["ChatTemplate", "TemplateError", "GGUF_KEY"]

GGUF_KEY = "tokenizer.chat_template"


class TemplateError(RequestError):
    """The chat template refused the messages or failed on them (HTTP 400)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, status=400, param="messages")


def _raise_exception(message: str) -> None:
    raise TemplateError(f"chat template error: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    """A compiled chat template with the vocabulary's BOS and EOS text."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        self.source = source          # the jinja2 template text
        self.bos_token = bos_token    # the text of the BOS token ("" when the vocabulary has none)
        self.eos_token = eos_token    # the text of the EOS token ("" when the vocabulary has none)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template syntax error at line {e.lineno}: {e.message}") from None

    @classmethod
    def from_gguf_kv(cls, kv: dict[str, Any], vocab: Any) -> ChatTemplate | None:
        """The template of a GGUF's key/values (``Model.gguf_kv``), with BOS/EOS text from ``vocab``
        (``vocab.tokens[vocab.bos]``, ``vocab.tokens[vocab.eos]`` when the id is >= 0); None without a template."""
        source = kv.get(GGUF_KEY)
        if not source:
            return None
        if not isinstance(source, str):
            raise ValueError(f"{GGUF_KEY} must be a string, got {type(source).__name__}")

        def text(i: int) -> str:
            return vocab.tokens[i] if 0 <= i < len(vocab.tokens) else ""

        return cls(source, bos_token=text(vocab.bos), eos_token=text(vocab.eos))

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
               **kwargs: Any) -> str:
        """The prompt text of ``messages``; ``add_generation_prompt`` appends the assistant turn's opening.
        ``kwargs`` (a request's ``chat_template_kwargs``) are more template variables and win over the others."""
        variables = {"messages": list(messages), "add_generation_prompt": add_generation_prompt,
                     "bos_token": self.bos_token, "eos_token": self.eos_token, **kwargs}
        try:
            return self._template.render(**variables)
        except TemplateError:
            raise
        except jinja2.exceptions.SecurityError as e:
            raise TemplateError(f"chat template made an unsafe access: {e}") from None
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template error: {e}") from None
        except Exception as e:  # a template failing on the client's data (a TypeError adding a list...)
            raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from None

    def __repr__(self) -> str:
        return f"ChatTemplate({len(self.source)} chars, bos={self.bos_token!r}, eos={self.eos_token!r})"
