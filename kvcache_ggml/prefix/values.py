"""The prefix cache's value objects: its parameters (:class:`PrefixParams`), what a lookup finds (:class:`Match`)
and what an admission did (:class:`Admission`)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .host import HostParams
from .policy import EvictionPolicy, LRUPolicy

__all__ = ["PrefixParams", "Match", "Admission"]


@dataclass(slots=True)
class PrefixParams:
    """How a prefix cache reuses, evicts and keeps sequences."""

    reuse: bool = True                                           # reuse cached prefixes; False: decode every prompt
    min_reuse: int = 1                                           # shortest prefix worth reusing, in tokens
    host: HostParams = field(default_factory=HostParams)         # host tier budgets (all 0: no host tier)
    policy: EvictionPolicy = field(default_factory=LRUPolicy)   # victim choice, device sequences and host blobs
    clock: Callable[[], float] = time.monotonic                  # seconds, for retention durations

    def check(self) -> None:
        if self.min_reuse < 1:
            raise ValueError(f"min_reuse must be >= 1 token, got {self.min_reuse}")
        self.host.check()


@dataclass(slots=True)
class Match:
    """The longest cached prefix of a token list."""

    n_tokens: int = 0                # length of the prefix (0: nothing cached)
    tier: str = "none"               # "device" (a sequence in the cache), "host" (a saved blob) or "none"
    seq_id: int = -1                 # device: the sequence holding the prefix
    stream: int = -1                 # device: its stream
    entry: Any = None                # the SeqEntry or HostEntry

    @property
    def positions(self) -> range:
        """The positions the prefix occupies in the holding sequence."""
        return range(self.n_tokens)


@dataclass(slots=True)
class Admission:
    """What :meth:`PrefixCache.attach` did for one request."""

    seq_id: int              # the sequence now holding the request
    n_prompt: int            # tokens asked for
    n_reused: int            # of them taken from the cache (at most n_prompt - 1)
    n_decoded: int           # of them left to decode, with advance() (at least 1: the last token's logits)
    source: str              # "own" (the sequence itself), "device" (seq_cp), "host" (state_load) or "none"
    source_seq: int          # device: the sequence copied from; else -1
    n_shifted: int = 0       # of n_reused, the tokens moved into place by K-shift (chunk reuse; 0 without)
