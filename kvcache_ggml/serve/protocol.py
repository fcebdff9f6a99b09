"""OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` requests, parsed and validated once into typed objects.

Rules (each broken rule is a :class:`RequestError`, HTTP 400 unless said, naming the field in ``param`` and the
offending value and the limit in the message):

* the body is JSON in UTF-8 (``parse_json``): bytes that are not UTF-8, text that does not parse, nests deeper than Python's recursion limit allows
  or holds a string with a lone UTF-16 surrogate (``"\\ud800"``, which no UTF-8 text can hold) is refused; the
  parsers below take the decoded object, and anything else than an object is refused.  Unknown fields are ignored
  (clients send extras); a field given as JSON ``null`` counts as absent.
* types are strict: a boolean must be ``true``/``false`` (not ``1``), an integer must be an integer (not ``true``,
  not ``1.0``), a number may be an integer or a float (not a boolean), a string must be a string.
* ranges: ``temperature`` [0, 2], ``top_p`` (0, 1], ``min_p`` [0, 1], ``top_k`` >= -1 (0 and -1: off; a
  llama-server extension like ``min_p`` and ``ignore_eos``), ``max_tokens`` >= 1 (absent: until the context is full),
  ``presence_penalty`` and ``frequency_penalty`` [-2, 2], ``logit_bias`` values [-100, 100] with keys that are token
  ids (``"50256"`` or ``50256``; the ids are checked against the vocabulary later by ``check_vocab``),
  ``top_logprobs`` [0, 20], ``stop`` at most 4 non-empty strings (a single string is a list of one), ``n`` (and
  ``best_of``) 1 only, ``seed`` any integer (``-1``: llama-server's "random", as absent).
* completions: ``prompt`` is a string or a list of token ids; a list holding exactly one string (or one list of ids)
  is that prompt, more than one prompt is refused; ``echo`` must be false; ``logprobs`` is the legacy integer 0..5
  (the number of alternatives per token), which turns token logprobs on.
* chat: ``messages`` is a non-empty list of objects with ``role`` in system/user/assistant/developer/tool and
  ``content`` a string or a list of ``{"type": "text", "text": ...}`` parts (joined with ``"\\n"``; other part
  types are refused; an assistant message may have no content); ``logprobs`` is a boolean and ``top_logprobs``
  needs it true; ``max_completion_tokens`` wins over the deprecated ``max_tokens``; ``chat_template_kwargs``
  (an object) is passed to the template.
* ``stream_options`` (``{"include_usage": bool}``) is only allowed with ``stream: true``, as OpenAI has it.

The response builders return plain dicts in OpenAI's JSON shapes (they parse as the ``openai`` package's models).
A logprob of ``-inf`` is written as ``-9999.0``, OpenAI's value for "very unlikely" (JSON has no infinity).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from .results import Usage

__all__ = ["RequestError", "parse_json", "SamplingParams", "CompletionRequest", "ChatRequest", "parse_completion", "parse_chat",
           "usage_dict", "completion_response", "completion_chunk", "completion_logprobs", "chat_response",
           "chat_chunk", "chat_token_logprob", "usage_chunk", "models_response", "ROLES", "MIN_LOGPROB",
           "ShiftFields", "parse_shift_fields"]

ROLES = frozenset({"system", "user", "assistant", "developer", "tool"})
MIN_LOGPROB = -9999.0  # OpenAI's logprob for a token the model gives no chance
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 429: "rate_limit_error"}
_ABSENT = object()


class RequestError(Exception):
    """A request the server refuses, with its HTTP status and OpenAI's error fields."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, type: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status      # HTTP status of the error response
        self.message = message    # human-readable, names the offending value and the limit
        self.param = param        # the request field at fault, or None
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.code = code          # OpenAI's machine-readable code ("model_not_found"...), or None

    def body(self) -> dict[str, Any]:
        """OpenAI's error response body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------------------------------------- field readers

_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")  # a UTF-16 surrogate written as a JSON escape


def parse_json(data: bytes | bytearray) -> Any:
    """The request body's JSON, decoded; a :class:`RequestError` (400) where it is not UTF-8 (a leading BOM is
    dropped), does not parse, nests too deeply or holds a lone surrogate.  Only a body with a surrogate's escape
    (a pair is how ``ensure_ascii`` writes an emoji) is walked to look for one."""
    try:
        v = json.loads(data.decode("utf-8-sig"))  # (strict: json.loads of bytes would let encoded surrogates pass)
    except (ValueError, UnicodeDecodeError) as err:
        raise RequestError(f"the body is not valid JSON: {err}") from None
    except RecursionError:
        raise RequestError("the body is not valid JSON: it nests arrays or objects too deeply") from None
    if _ESCAPED_SURROGATE.search(data):
        stack = [v]
        while stack:
            x = stack.pop()
            if isinstance(x, str):
                try:
                    x.encode("utf-8")
                except UnicodeEncodeError as err:
                    raise RequestError(f"the body is not valid JSON: a string holds a lone surrogate "
                                       f"\\u{ord(x[err.start]):04x} at character {err.start} (UTF-16 surrogates "
                                       f"come in pairs)") from None
            elif isinstance(x, dict):
                stack += x.keys()
                stack += x.values()
            elif isinstance(x, list):
                stack += x
    return v


def _get(body: dict[str, Any], name: str) -> Any:
    v = body.get(name)
    return _ABSENT if v is None else v


def _bool(body: dict[str, Any], name: str, default: bool = False) -> bool:
    v = _get(body, name)
    if v is _ABSENT:
        return default
    if not isinstance(v, bool):
        raise RequestError(f"{name} must be a boolean, got {v!r}", param=name)
    return v


def _int(body: dict[str, Any], name: str, default: Any = None, lo: int | None = None,
         hi: int | None = None) -> Any:
    v = _get(body, name)
    if v is _ABSENT:
        return default
    if not isinstance(v, int) or isinstance(v, bool):
        raise RequestError(f"{name} must be an integer, got {v!r}", param=name)
    _range(name, v, lo, hi)
    return v


def _float(body: dict[str, Any], name: str, default: float, lo: float | None = None, hi: float | None = None,
           lo_open: bool = False) -> float:
    v = _get(body, name)
    if v is _ABSENT:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise RequestError(f"{name} must be a finite number, got {v!r}", param=name)
    if lo_open and not lo < v <= hi:  # type: ignore[operator]
        raise RequestError(f"{name} must be in ({lo:g}, {hi:g}], got {v!r}", param=name)
    _range(name, v, lo, hi)
    return float(v)


def _range(name: str, v: float, lo: float | None, hi: float | None) -> None:
    if lo is not None and hi is not None and not lo <= v <= hi:
        raise RequestError(f"{name} must be in [{lo:g}, {hi:g}], got {v!r}", param=name)
    if lo is not None and hi is None and v < lo:
        raise RequestError(f"{name} must be >= {lo:g}, got {v!r}", param=name)
    if hi is not None and lo is None and v > hi:
        raise RequestError(f"{name} must be <= {hi:g}, got {v!r}", param=name)


def _str(body: dict[str, Any], name: str, required: bool = False) -> str | None:
    v = _get(body, name)
    if v is _ABSENT:
        if required:
            raise RequestError(f"missing required parameter {name!r}", param=name)
        return None
    if not isinstance(v, str):
        raise RequestError(f"{name} must be a string, got {v!r}", param=name)
    return v


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


# ---------------------------------------------------------------------------------------------- requests

@dataclass(slots=True)
class SamplingParams:
    """How tokens are chosen and reported (OpenAI's defaults; llama-server's extensions marked)."""

    temperature: float = 1.0          # softmax temperature; <= 0 is greedy
    top_k: int = 0                    # keep the k most likely tokens; 0 or -1: off (llama-server extension)
    top_p: float = 1.0                # keep the smallest top set with this much probability mass
    min_p: float = 0.0                # drop tokens less likely than min_p * the best one (llama-server extension)
    seed: int | None = None           # seed of the request's random generator; None: from OS entropy
    max_tokens: int | None = None     # most tokens to generate; None: until the context is full
    presence_penalty: float = 0.0     # subtracted once from each token already generated
    frequency_penalty: float = 0.0    # subtracted per occurrence from each token already generated
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    logprobs: bool = False            # report the logprob of each generated token
    top_logprobs: int = 0             # and this many most likely alternatives per position
    stop: list[str] = field(default_factory=list)  # generation ends before the first of these strings
    ignore_eos: bool = False          # end-of-generation tokens never sampled (llama-server extension)

    def check_vocab(self, n_vocab: int) -> None:
        """Refuse logit_bias ids outside the vocabulary of ``n_vocab`` tokens."""
        for t in self.logit_bias:
            if not 0 <= t < n_vocab:
                raise RequestError(f"logit_bias token id {t} is out of range for a vocabulary of {n_vocab} tokens",
                                   param="logit_bias")


@dataclass(slots=True)
class CompletionRequest:
    """A validated ``/v1/completions`` request."""

    model: str                        # the model name asked for (checked against served names by the caller)
    prompt: str | list[int]           # the text, or the token ids, to continue
    stream: bool = False              # answer as server-sent events
    stream_include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    echo: bool = False                # always False (echo is refused)
    sampling: SamplingParams = field(default_factory=SamplingParams)  # how tokens are chosen
    user: str | None = None           # the end user's id, as sent

    def check_vocab(self, n_vocab: int) -> None:
        """Refuse prompt or logit_bias ids outside the vocabulary of ``n_vocab`` tokens."""
        if isinstance(self.prompt, list):
            for t in self.prompt:
                if not 0 <= t < n_vocab:
                    raise RequestError(f"prompt token id {t} is out of range for a vocabulary of {n_vocab} tokens",
                                       param="prompt")
        self.sampling.check_vocab(n_vocab)


@dataclass(slots=True)
class ChatRequest:
    """A validated ``/v1/chat/completions`` request."""

    model: str                        # the model name asked for (checked against served names by the caller)
    messages: list[dict[str, Any]]    # the conversation; each content a string (text parts joined)
    stream: bool = False              # answer as server-sent events
    stream_include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    sampling: SamplingParams = field(default_factory=SamplingParams)  # how tokens are chosen
    user: str | None = None           # the end user's id, as sent
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # extra variables for the chat template

    def check_vocab(self, n_vocab: int) -> None:
        """Refuse logit_bias ids outside the vocabulary of ``n_vocab`` tokens."""
        self.sampling.check_vocab(n_vocab)


def _stop(body: dict[str, Any]) -> list[str]:
    v = _get(body, "stop")
    if v is _ABSENT:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError(f"stop must be a string or a list of strings, got {v!r}", param="stop")
    if len(stops) > 4:
        raise RequestError(f"stop takes at most 4 strings, got {len(stops)}", param="stop")
    if any(not s for s in stops):
        raise RequestError("stop strings must not be empty, got ''", param="stop")
    return list(stops)


def _logit_bias(body: dict[str, Any]) -> dict[int, float]:
    v = _get(body, "logit_bias")
    if v is _ABSENT:
        return {}
    if not isinstance(v, dict):
        raise RequestError(f"logit_bias must be an object of token id -> bias, got {v!r}", param="logit_bias")
    out: dict[int, float] = {}
    for k, b in v.items():
        # (ASCII digits only: str.isdigit also takes '²', which int() refuses, and '٣', which it reads as 3)
        if (isinstance(k, bool) or not isinstance(k, (int, str))
                or (isinstance(k, str) and not (k.isascii() and k.isdigit()))):
            raise RequestError(f"logit_bias keys must be token ids, got {k!r}", param="logit_bias")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            raise RequestError(f"logit_bias values must be numbers in [-100, 100], got {b!r} for token {k}",
                               param="logit_bias")
        out[int(k)] = float(b)
    return out


def _sampling(body: dict[str, Any], max_tokens: int | None, logprobs: bool, top_logprobs: int) -> SamplingParams:
    for name in ("n", "best_of"):
        if _int(body, name, 1) != 1:
            raise RequestError(f"only {name}=1 is supported, got {body[name]}", param=name)
    seed = _int(body, "seed")
    return SamplingParams(
        temperature=_float(body, "temperature", 1.0, 0.0, 2.0), top_k=_int(body, "top_k", 0, -1),
        top_p=_float(body, "top_p", 1.0, 0.0, 1.0, lo_open=True), min_p=_float(body, "min_p", 0.0, 0.0, 1.0),
        seed=None if seed == -1 else seed, max_tokens=max_tokens,
        presence_penalty=_float(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_float(body, "frequency_penalty", 0.0, -2.0, 2.0), logit_bias=_logit_bias(body),
        logprobs=logprobs, top_logprobs=top_logprobs, stop=_stop(body), ignore_eos=_bool(body, "ignore_eos"))


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = _bool(body, "stream")
    opts = _get(body, "stream_options")
    if opts is _ABSENT:
        return stream, False
    if not stream:
        raise RequestError("stream_options is only allowed when stream is true", param="stream_options")
    if not isinstance(opts, dict):
        raise RequestError(f"stream_options must be an object, got {opts!r}", param="stream_options")
    return stream, _bool(opts, "include_usage")


def _prompt(body: dict[str, Any]) -> str | list[int]:
    v = _get(body, "prompt")
    if v is _ABSENT:
        raise RequestError("missing required parameter 'prompt'", param="prompt")
    if isinstance(v, list) and v and isinstance(v[0], (str, list)):
        if len(v) != 1:
            raise RequestError(f"only one prompt per request is supported, got {len(v)}", param="prompt")
        v = v[0]
    if isinstance(v, str):
        return v
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise RequestError(f"prompt must be a string or a list of token ids, got {v!r:.200}", param="prompt")
    if not v:
        raise RequestError("prompt must not be an empty list of token ids", param="prompt")
    return list(v)


def parse_completion(body: Any) -> CompletionRequest:
    """A ``/v1/completions`` body (decoded JSON) as a validated request; :class:`RequestError` when invalid."""
    body = _object(body)
    model = _str(body, "model", required=True)
    prompt = _prompt(body)
    stream, include_usage = _stream(body)
    if _bool(body, "echo"):
        raise RequestError("echo=true is not supported", param="echo")
    n_logprobs = _int(body, "logprobs", None, 0, 5)
    sampling = _sampling(body, _int(body, "max_tokens", None, 1), n_logprobs is not None, n_logprobs or 0)
    return CompletionRequest(model=model, prompt=prompt, stream=stream, stream_include_usage=include_usage,
                             echo=False, sampling=sampling, user=_str(body, "user"))


def _message(i: int, m: Any) -> dict[str, Any]:
    p = f"messages[{i}]"
    if not isinstance(m, dict):
        raise RequestError(f"{p} must be an object, got {m!r:.200}", param=p)
    role = m.get("role")
    if role not in ROLES:
        raise RequestError(f"{p}.role must be one of {', '.join(sorted(ROLES))}, got {role!r}", param=f"{p}.role")
    content = m.get("content")
    if content is None and role == "assistant":
        content = ""
    elif isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"{p}.content[{j}]: content part type {kind!r} is not supported "
                                   "(only 'text' parts with a string 'text')", param=f"{p}.content")
            texts.append(part["text"])
        content = "\n".join(texts)
    elif not isinstance(content, str):
        raise RequestError(f"{p}.content must be a string or a list of text parts, got {content!r:.200}",
                           param=f"{p}.content")
    return {**m, "content": content}


def parse_chat(body: Any) -> ChatRequest:
    """A ``/v1/chat/completions`` body (decoded JSON) as a validated request; :class:`RequestError` when invalid."""
    body = _object(body)
    model = _str(body, "model", required=True)
    messages = _get(body, "messages")
    if messages is _ABSENT:
        raise RequestError("missing required parameter 'messages'", param="messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"messages must be a non-empty list, got {messages!r:.200}", param="messages")
    msgs = [_message(i, m) for i, m in enumerate(messages)]
    stream, include_usage = _stream(body)
    logprobs = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, 0, 20)
    if top and not logprobs:
        raise RequestError(f"top_logprobs={top} requires logprobs to be true", param="top_logprobs")
    max_tokens = _int(body, "max_completion_tokens", None, 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", None, 1)
    kwargs = _get(body, "chat_template_kwargs")
    if kwargs is not _ABSENT and not isinstance(kwargs, dict):
        raise RequestError(f"chat_template_kwargs must be an object, got {kwargs!r:.200}",
                           param="chat_template_kwargs")
    return ChatRequest(model=model, messages=msgs, stream=stream, stream_include_usage=include_usage,
                       sampling=_sampling(body, max_tokens, logprobs, top), user=_str(body, "user"),
                       chat_template_kwargs={} if kwargs is _ABSENT else dict(kwargs))


@dataclass(slots=True)
class ShiftFields:
    """llama-server's per-request position-shift fields (either endpoint)."""

    n_cache_reuse: int | None = None  # least tokens of a cached chunk reused by K-shift (None: the server's)
    n_keep: int = 0                   # context shift: prompt tokens kept (-1: the whole prompt)
    n_discard: int = 0                # context shift: tokens dropped after them (0: half of the rest)


def parse_shift_fields(body: dict[str, Any], n_prompt: int, can_shift: bool) -> ShiftFields:
    """``n_cache_reuse`` >= 0 (and 0 on a cache that cannot shift), ``n_keep`` in [-1, ``n_prompt``],
    ``n_discard`` >= 0."""
    n_reuse = _int(body, "n_cache_reuse", None, 0)
    if n_reuse and not can_shift:
        raise RequestError(f"n_cache_reuse {n_reuse}: this model's cache cannot shift positions, so no chunk can "
                           "be reused (0 or absent only)", param="n_cache_reuse")
    return ShiftFields(n_reuse, _int(body, "n_keep", 0, -1, n_prompt), _int(body, "n_discard", 0, 0))


# ---------------------------------------------------------------------------------------------- responses

def _lp(x: float) -> float:
    return max(float(x), MIN_LOGPROB)


def usage_dict(usage: Usage) -> dict[str, Any]:
    """OpenAI's usage object (``prompt_tokens_details.cached_tokens``: prompt tokens whose cache was reused)."""
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens, "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def completion_logprobs(tokens: Sequence[str], token_logprobs: Sequence[float],
                        top_logprobs: Sequence[dict[str, float]], text_offset: Sequence[int]) -> dict[str, Any]:
    """The legacy completions logprobs object: per token its text, logprob, alternatives and text offset."""
    return {"tokens": list(tokens), "token_logprobs": [_lp(x) for x in token_logprobs],
            "top_logprobs": [{t: _lp(x) for t, x in d.items()} for d in top_logprobs],
            "text_offset": list(text_offset)}


def chat_token_logprob(token: str, token_bytes: bytes, logprob: float,
                       top: Sequence[tuple[str, bytes, float]] = ()) -> dict[str, Any]:
    """One entry of chat's ``logprobs.content``: the token and its alternatives (text, bytes, logprob)."""
    return {"token": token, "logprob": _lp(logprob), "bytes": list(token_bytes),
            "top_logprobs": [{"token": t, "logprob": _lp(x), "bytes": list(b)} for t, b, x in top]}


def completion_response(id: str, created: int, model: str, text: str, finish_reason: str,
                        usage: dict[str, Any], logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """A whole ``text_completion`` response."""
    return {"id": id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}],
            "usage": usage}


def completion_chunk(id: str, created: int, model: str, text: str, finish_reason: str | None = None,
                     logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed ``text_completion`` chunk (``finish_reason`` None until the last one)."""
    return {"id": id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}]}


def chat_response(id: str, created: int, model: str, content: str, finish_reason: str, usage: dict[str, Any],
                  logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A whole ``chat.completion`` response (``logprobs``: the :func:`chat_token_logprob` entries)."""
    return {"id": id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                         "finish_reason": finish_reason,
                         "logprobs": None if logprobs is None else {"content": logprobs}}],
            "usage": usage}


def chat_chunk(id: str, created: int, model: str, delta: dict[str, Any], finish_reason: str | None = None,
               logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One streamed ``chat.completion.chunk``; the first one's delta is ``{"role": "assistant", "content": ""}``."""
    return {"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason,
                         "logprobs": None if logprobs is None else {"content": logprobs}}]}


def usage_chunk(id: str, created: int, model: str, usage: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The last streamed chunk when ``stream_options.include_usage``: no choices, the usage."""
    return {"id": id, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage}


def models_response(names: Sequence[str], created: int, owned_by: str = "kvcache_ggml") -> dict[str, Any]:
    """``/v1/models``: the served model names."""
    return {"object": "list",
            "data": [{"id": n, "object": "model", "created": created, "owned_by": owned_by} for n in names]}
