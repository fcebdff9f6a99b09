"""Which cached sequence (or host blob) goes first when room is needed.

A policy sees :class:`Candidate` value objects and names the victim.  :class:`LRUPolicy` (the default) evicts the
lowest *effective retention priority* first and, among equals, the least recently used -- with every priority left
at its default that is plain LRU.  Priorities follow TensorRT-LLM's KV-cache retention: an integer in [0, 100]
(default 35), higher is kept longer, optionally for a limited time only, after which it falls back to the default.
A request sets it with :class:`Retention`; any callable ``victim(candidates) -> Candidate`` can replace the policy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

__all__ = ["Retention", "Candidate", "EvictionPolicy", "LRUPolicy", "DEFAULT_PRIORITY", "PRIORITY_MAX"]

DEFAULT_PRIORITY = 35   # TensorRT-LLM's default retention priority
PRIORITY_MAX = 100


@dataclass(slots=True)
class Retention:
    """How strongly a request's sequence is kept once the request is done (TensorRT-LLM's retention config)."""

    priority: int = DEFAULT_PRIORITY   # 0..100, higher is evicted later
    duration: float = math.inf         # seconds of the prefix cache's clock the priority lasts, then the default

    def check(self) -> None:
        if not 0 <= self.priority <= PRIORITY_MAX:
            raise ValueError(f"retention priority must be in [0, {PRIORITY_MAX}], got {self.priority}")
        if not self.duration > 0:
            raise ValueError(f"retention duration must be > 0 seconds, got {self.duration}")


@dataclass(slots=True)
class Candidate:
    """One evictable sequence or host blob, as a policy sees it."""

    entry: Any          # the device or host entry (returned as the victim)
    n_tokens: int       # tokens of the prefix it holds
    nbytes: int         # bytes it occupies (host blobs; 0 for device sequences)
    last_used: int      # tick of its last use (attach, reuse, decode); larger is more recent
    priority: int       # retention priority in effect now


class EvictionPolicy(Protocol):
    """Chooses the victim among non-empty candidates."""

    def __call__(self, candidates: Sequence[Candidate]) -> Candidate: ...


class LRUPolicy:
    """Lowest retention priority first, then least recently used (plain LRU when priorities are equal)."""

    def __call__(self, candidates: Sequence[Candidate]) -> Candidate:
        if not candidates:
            raise ValueError("no candidate to evict")
        return min(candidates, key=lambda c: (c.priority, c.last_used))

    def __repr__(self) -> str:
        return "LRUPolicy()"


def effective_priority(priority: int, since: float, duration: float, now: float) -> int:
    """``priority`` while ``now - since < duration``, the default after that."""
    return priority if now - since < duration else DEFAULT_PRIORITY
