"""What the engine hands back for a request, typed: the tokens' log-probabilities and the usage counts.

The engine makes these on its thread and never changes one after handing it out (frozen), so the HTTP side may
read them on its event loop without a lock.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TokenLogprob", "Usage"]


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    """One generated token's log-probability under the model's raw logits, with the most likely alternatives."""

    id: int                                  # the generated token
    logprob: float                           # its log-probability (log-softmax of the raw logits, float64)
    top: tuple[tuple[int, float], ...] = ()  # the k most likely (id, logprob), most likely first, ties to lower id


@dataclass(slots=True, frozen=True)
class Usage:
    """A request's token counts (OpenAI's ``usage``)."""

    prompt_tokens: int       # tokens of the prompt
    completion_tokens: int   # tokens generated (the end-of-generation token is not counted)
    cached_tokens: int       # prompt tokens reused from the prefix cache (usage.prompt_tokens_details)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens
