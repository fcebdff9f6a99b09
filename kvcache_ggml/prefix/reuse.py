"""Chunk reuse by K-shift, llama-server's ``--cache-reuse N`` (llama.cpp PR #9866): which chunks of a cached
sequence a new prompt can take by moving them, and nothing else.

After the common prefix of the cached tokens and the prompt, llama-server walks two heads, one in the cache and one
in the prompt: where the tokens from both heads agree for at least N tokens, that run (as long as it goes on) is
moved to the prompt head (``seq_rm`` of the cells between the heads, ``seq_add`` of the run by the difference; the
K-shift rotates its K), and both heads pass it; elsewhere only the cache head steps on.  :func:`plan_chunks` finds
the same runs without the token-by-token walk: for the prompt head it looks for the first cache position at or after
the cache head whose next N tokens equal the prompt's next N (the first position from which llama-server's walk
would count a run of at least N), then extends the run.  :meth:`PrefixCache.attach
<kvcache_ggml.prefix.core.PrefixCache.attach>` applies the plan.

The moved cells are not what a fresh decode of the new prompt leaves: their K is rotated to the new position (exact
up to float rounding), but their K and V were computed attending to the tokens that preceded them in the old
prompt.  With one layer that makes no difference (a layer's K/V depend on the token and its position only); with
more it does, and the outputs equal a float64 cache that replays the same ``seq_rm``/``seq_add``
(:class:`~kvcache_ggml.runtime.reference.ReferenceCache`), not a fresh decode (docs/serving.md, "Cache reuse").
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

__all__ = ["ChunkMove", "ReusePlan", "plan_chunks"]


@dataclass(slots=True, frozen=True)
class ChunkMove:
    """One run of cached tokens moved into place."""

    src: int      # its first position in the cached sequence
    dst: int      # its first position in the new prompt (dst < src: runs only move back)
    n: int        # its tokens

    @property
    def delta(self) -> int:
        """The position shift, dst - src (< 0)."""
        return self.dst - self.src


@dataclass(slots=True)
class ReusePlan:
    """What chunk reuse takes from one cached sequence for one prompt."""

    n_prefix: int                                          # the common prefix, kept in place
    moves: list[ChunkMove] = field(default_factory=list)   # the runs moved, in order (dst ascending)
    n_reused: int = 0                                      # prompt tokens the sequence then holds: prefix + runs

    @property
    def n_shifted(self) -> int:
        """Tokens of the moved runs."""
        return sum(m.n for m in self.moves)


def plan_chunks(cached: np.ndarray, prompt: np.ndarray, n_prefix: int, n_min: int) -> ReusePlan:
    """The runs of at least ``n_min`` tokens of ``cached`` (int32, the sequence's tokens at positions 0..) that
    llama-server's cache-reuse walk moves into ``prompt`` after their common prefix of ``n_prefix`` tokens; the
    plan's ``n_reused`` may be the whole prompt (the caller keeps at least its last token to decode)."""
    if n_min < 1:
        raise ValueError(f"n_min must be >= 1, got {n_min}")
    nc, npr = int(cached.size), int(prompt.size)
    if not 0 <= n_prefix <= min(nc, npr):
        raise ValueError(f"n_prefix {n_prefix} out of range [0, {min(nc, npr)}]")
    plan = ReusePlan(n_prefix, [], n_prefix)
    if nc < n_min:
        return plan
    windows = sliding_window_view(cached, n_min)          # row c: cached[c:c + n_min]
    hc = hp = n_prefix
    while hp + n_min <= npr and hc + n_min <= nc:
        want = prompt[hp:hp + n_min]
        cand = np.flatnonzero(cached[hc:nc - n_min + 1] == want[0]) + hc
        hits = cand[(windows[cand] == want).all(axis=1)] if cand.size else cand
        if hits.size == 0:
            break
        c = int(hits[0])
        m = min(nc - c, npr - hp)
        differ = cached[c:c + m] != prompt[hp:hp + m]
        n = int(differ.argmax()) if differ.any() else m
        plan.moves.append(ChunkMove(c, hp, n))
        hc, hp = c + n, hp + n
    plan.n_reused = hp
    return plan
