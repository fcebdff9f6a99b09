"""A request inside the serving engine: what the caller gives (:class:`Job`), the states it moves through
(:class:`RequestState`, checked against :data:`TRANSITIONS`) and what it is told (:class:`Event`).

::

    WAITING --+--> PREFILL ----> DECODING ----> FINISHED
       ^   |  |       |  \\______________________^  ^
       |   v  |       +--> WAITING (preempted: the cache was full before its first token)
    WAITING_PREFIX ---+--> FINISHED (cancelled, timed out)   (WAITING and PREFILL end the same ways)

``WAITING_PREFIX``: another request is still reading a longer prefix of this prompt than the cache holds; this one
waits for it and reuses it instead of computing the same tokens beside it (users arriving together with one system
prompt compute it once).  A move the table does not list is a bug of the engine (AssertionError).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Protocol

import numpy as np

from .results import TokenLogprob, Usage
from .text import TextStream

__all__ = ["RequestState", "TRANSITIONS", "TokenSampler", "Job", "Event"]


class RequestState(Enum):
    """Where a request is in its life (llama-server's ``slot_state``, vLLM's ``RequestStatus``)."""

    WAITING = "waiting"                  # in the queue, not admitted
    WAITING_PREFIX = "waiting_prefix"    # in the queue, waiting for another request to compute its prefix
    PREFILL = "prefill"                  # admitted: its prompt is read in chunks
    DECODING = "decoding"                # its prompt is read: one token a step
    FINISHED = "finished"                # ended; its last event ("done" or "error") is sent


_S = RequestState
TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    _S.WAITING: frozenset({_S.WAITING_PREFIX, _S.PREFILL, _S.FINISHED}),
    _S.WAITING_PREFIX: frozenset({_S.WAITING, _S.PREFILL, _S.FINISHED}),
    _S.PREFILL: frozenset({_S.DECODING, _S.WAITING, _S.FINISHED}),
    _S.DECODING: frozenset({_S.FINISHED}),
    _S.FINISHED: frozenset(),
}


class TokenSampler(Protocol):
    """What the engine asks of a request's sampler (:class:`~.sampling.Sampler`, or a forced one for replays)."""

    params: Any   # its sampling parameters; the engine reads ``ignore_eos``

    def sample(self, logits: np.ndarray) -> int: ...
    def accept(self, token: int) -> None: ...
    def logprobs(self, logits: np.ndarray, token: int, top_n: int = 0) -> tuple[float, list[tuple[int, float]]]: ...


@dataclass(slots=True)
class Event:
    """What the engine tells a request's caller."""

    kind: str                              # "text" (a piece of output), "done" (the end) or "error"
    text: str = ""                         # text: the piece; error: the message
    tokens: list[int] = field(default_factory=list)             # text: the tokens this piece completes
    logprobs: list[TokenLogprob] = field(default_factory=list)  # text: one per token (when asked for)
    finish_reason: str | None = None       # done: "stop", "length" or "cancelled"
    usage: Usage | None = None             # done: the request's token counts


@dataclass(slots=True, eq=False)
class Job:
    """One request.  The caller fills the fields above the line and never changes them after :meth:`Engine.submit`;
    the fields below belong to the engine's thread."""

    tokens: np.ndarray                     # int32 prompt
    sampler: TokenSampler                  # its sampler (seeded per request)
    text: TextStream                       # its detokenizer with the stop strings
    emit: Callable[[Event], None]          # called on the engine thread with each event
    max_tokens: int | None = None          # most tokens to generate (None: until the context is full)
    cache_prompt: bool = True              # reuse cached prefixes for its prompt and keep its sequence cached
    #                                        when done (False: the whole prompt decoded, nothing kept)
    top_logprobs: int = -1                 # -1: no logprobs; k >= 0: the sampled token's and the k best
    n_cache_reuse: int | None = None       # chunk reuse by K-shift, least tokens a chunk (None: the engine's)
    n_keep: int = 0                        # context shift: prompt tokens kept (-1: all; BOS counts apart)
    n_discard: int = 0                     # context shift: tokens dropped after them (0: half of the rest)
    id_slot: int = -1                      # the sequence it prefers when that one serves no request (-1: any)
    # ---- the engine's
    state: RequestState = RequestState.WAITING     # see TRANSITIONS
    history: list[RequestState] = field(default_factory=list)  # the states it left, in order
    cancelled: bool = False                # a cancel message arrived, or its emit failed: ends at the next plan
    seq: int = -1                          # its sequence once admitted
    fed: int = 0                           # prompt tokens in its sequence (reused + decoded)
    n_cached: int = 0                      # prompt tokens the prefix cache reused
    n_discarded: int = 0                   # tokens its context shifts dropped from its sequence
    generated: list[int] = field(default_factory=list)     # sampled tokens
    pending: list[int] = field(default_factory=list)       # sampled tokens whose text is not out yet
    pending_lp: list[TokenLogprob] = field(default_factory=list)  # their logprobs
    t_submit: float = 0.0                  # perf_counter at submission
    t_first: float = 0.0                   # perf_counter at the first token (0: none yet)
    deadline: float = 0.0                  # perf_counter past which it ends
    admitted: int = 0                      # admission order (the last admitted is the victim of a full cache)

    def move(self, state: RequestState) -> None:
        """Go to ``state``; a move :data:`TRANSITIONS` does not allow is a bug of the engine."""
        if state not in TRANSITIONS[self.state]:
            raise AssertionError(f"request state {self.state.name} -> {state.name} is not a transition")
        self.history.append(self.state)
        self.state = state
