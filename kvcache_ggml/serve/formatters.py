"""What differs between ``/v1/chat/completions`` and ``/v1/completions``, one class each behind one interface.

The HTTP side (:mod:`.app`) picks a :class:`Formatter` per endpoint once and asks it for everything the two
endpoints do differently: the request's parsing, the response id's prefix, the prompt's tokens (the chat template
rendered, or the raw prompt), the streamed chunks (chat opens with a role chunk; completions does not), the
logprobs' shape (chat's ``logprobs.content`` entries, or the legacy completions object with text offsets), the
whole response, and the request field an error about the prompt names (``messages`` or ``prompt``).

The chunks and responses are plain dicts made by :mod:`.protocol`'s builders; the caller writes them as JSON or
server-sent events.  A formatter holds no per-request state: one instance serves every request of its endpoint.
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence

import numpy as np

from . import protocol as P
from .chat import ChatTemplate
from .results import TokenLogprob, Usage

__all__ = ["Formatter", "ChatFormatter", "CompletionFormatter"]


class Formatter(Protocol):
    """One endpoint's request and response shapes."""

    id_prefix: str   # the response id's prefix ("chatcmpl", "cmpl"); the id is "<prefix>-<32 hex digits>"
    param: str       # the request field an error about the prompt names ("messages", "prompt")

    def parse(self, body: Any) -> Any:
        """The decoded JSON body as a validated request (:class:`~.protocol.RequestError` when invalid)."""
        ...

    def prompt(self, req: Any) -> np.ndarray:
        """The request's prompt as int32 token ids."""
        ...

    def first_chunk(self, id: str, created: int, model: str) -> dict[str, Any] | None:
        """The stream's opening chunk, before any text; None: the stream opens with its first text."""
        ...

    def text_chunk(self, id: str, created: int, model: str, text: str,
                   logprobs: Sequence[TokenLogprob] | None = None, offset: int = 0) -> dict[str, Any]:
        """A streamed piece of text, with its tokens' logprobs (None: not asked for); ``offset``: the length of
        the text streamed before this piece."""
        ...

    def final_chunk(self, id: str, created: int, model: str, finish_reason: str) -> dict[str, Any]:
        """The stream's last chunk with a choice: no text, the finish reason."""
        ...

    def usage_chunk(self, id: str, created: int, model: str, usage: Usage) -> dict[str, Any]:
        """The chunk after the final one when the request asked for ``stream_options.include_usage``."""
        ...

    def response(self, id: str, created: int, model: str, text: str, finish_reason: str, usage: Usage,
                 logprobs: Sequence[TokenLogprob] | None = None) -> dict[str, Any]:
        """The whole answer of a request that did not stream (``logprobs``: None when not asked for)."""
        ...


def _piece(vocab: Any, t: int) -> tuple[str, bytes]:
    """A token's text (invalid UTF-8 replaced) and its raw bytes."""
    b = vocab.token_to_piece(int(t))
    return b.decode("utf-8", errors="replace"), b


class ChatFormatter:
    """``/v1/chat/completions``: the conversation through the model's chat template; ``chat.completion`` shapes."""

    id_prefix = "chatcmpl"
    param = "messages"

    def __init__(self, vocab: Any, template: ChatTemplate | None, model_name: str) -> None:
        self.vocab = vocab            # the model's Vocab (tokenizer, token pieces, BOS)
        self.template = template      # the GGUF's chat template (None: every request is refused, 400)
        self.model_name = model_name  # the served name, for the error when there is no template

    def parse(self, body: Any) -> P.ChatRequest:
        return P.parse_chat(body)

    def prompt(self, req: P.ChatRequest) -> np.ndarray:
        """The rendered conversation, tokenized with special tokens; a BOS the template writes is dropped when the
        tokenizer adds one itself (llama.cpp's common_chat_templates_apply does the same), so there is one."""
        vocab = self.vocab
        if self.template is None:
            raise P.RequestError(f"model {self.model_name!r} has no chat template (tokenizer.chat_template); "
                                 "use /v1/completions", param=self.param)
        text = self.template.render(req.messages, add_generation_prompt=True, **req.chat_template_kwargs)
        bos = vocab.tokens[vocab.bos] if vocab.bos >= 0 else ""
        if vocab.add_bos and bos and text.startswith(bos):
            text = text[len(bos):]
        return np.array(vocab.tokenize(text, add_special=True, parse_special=True), np.int32)

    def logprobs(self, lps: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
        """Chat's ``logprobs.content`` entries: each token's text, bytes and logprob, with its alternatives'."""
        out = []
        for d in lps:
            text, raw = _piece(self.vocab, d.id)
            top = [(*_piece(self.vocab, i), lp) for i, lp in d.top]
            out.append(P.chat_token_logprob(text, raw, d.logprob, top))
        return out

    def first_chunk(self, id: str, created: int, model: str) -> dict[str, Any]:
        return P.chat_chunk(id, created, model, {"role": "assistant", "content": ""})

    def text_chunk(self, id: str, created: int, model: str, text: str,
                   logprobs: Sequence[TokenLogprob] | None = None, offset: int = 0) -> dict[str, Any]:
        return P.chat_chunk(id, created, model, {"content": text}, None,
                            None if logprobs is None else self.logprobs(logprobs))

    def final_chunk(self, id: str, created: int, model: str, finish_reason: str) -> dict[str, Any]:
        return P.chat_chunk(id, created, model, {}, finish_reason)

    def usage_chunk(self, id: str, created: int, model: str, usage: Usage) -> dict[str, Any]:
        return P.usage_chunk(id, created, model, P.usage_dict(usage), chat=True)

    def response(self, id: str, created: int, model: str, text: str, finish_reason: str, usage: Usage,
                 logprobs: Sequence[TokenLogprob] | None = None) -> dict[str, Any]:
        return P.chat_response(id, created, model, text, finish_reason, P.usage_dict(usage),
                               None if logprobs is None else self.logprobs(logprobs))


class CompletionFormatter:
    """``/v1/completions``: the raw prompt (text or token ids); ``text_completion`` shapes."""

    id_prefix = "cmpl"
    param = "prompt"

    def __init__(self, vocab: Any) -> None:
        self.vocab = vocab  # the model's Vocab (tokenizer, token pieces)

    def parse(self, body: Any) -> P.CompletionRequest:
        return P.parse_completion(body)

    def prompt(self, req: P.CompletionRequest) -> np.ndarray:
        """Token ids as given; a text tokenized with special tokens (the tokenizer adds BOS when the model wants)."""
        if isinstance(req.prompt, list):
            return np.array(req.prompt, np.int32)
        return np.array(self.vocab.tokenize(req.prompt, add_special=True, parse_special=True), np.int32)

    def logprobs(self, lps: Sequence[TokenLogprob], offset: int) -> dict[str, Any]:
        """The legacy logprobs object; each token's text offset counts from ``offset`` (the text before it)."""
        toks, lp, tops, offs = [], [], [], []
        for d in lps:
            text = _piece(self.vocab, d.id)[0]
            toks.append(text)
            lp.append(d.logprob)
            tops.append({_piece(self.vocab, i)[0]: x for i, x in d.top})
            offs.append(offset)
            offset += len(text)
        return P.completion_logprobs(toks, lp, tops, offs)

    def first_chunk(self, id: str, created: int, model: str) -> None:
        return None

    def text_chunk(self, id: str, created: int, model: str, text: str,
                   logprobs: Sequence[TokenLogprob] | None = None, offset: int = 0) -> dict[str, Any]:
        return P.completion_chunk(id, created, model, text, None,
                                  None if logprobs is None else self.logprobs(logprobs, offset))

    def final_chunk(self, id: str, created: int, model: str, finish_reason: str) -> dict[str, Any]:
        return P.completion_chunk(id, created, model, "", finish_reason)

    def usage_chunk(self, id: str, created: int, model: str, usage: Usage) -> dict[str, Any]:
        return P.usage_chunk(id, created, model, P.usage_dict(usage), chat=False)

    def response(self, id: str, created: int, model: str, text: str, finish_reason: str, usage: Usage,
                 logprobs: Sequence[TokenLogprob] | None = None) -> dict[str, Any]:
        return P.completion_response(id, created, model, text, finish_reason, P.usage_dict(usage),
                                     None if logprobs is None else self.logprobs(logprobs, 0))
