"""The engine's use of position shifts, as llama-server has them: the per-request fields ``n_cache_reuse``,
``n_keep`` and ``n_discard`` checked, and the amounts of a context shift (``--context-shift``).

A context shift happens when a decoding request's sequence would reach the context (``n_ctx_seq``): its first
``n_keep`` positions stay (-1: the whole prompt; one more when the vocabulary adds BOS, as llama-server counts it;
at most ``n_ctx_seq - 4``), the next ``n_discard`` go (0: half of the rest; at most the rest), the remainder moves
back by K-shift, and generation goes on: :func:`shift_job`, through :meth:`PrefixCache.context_shift
<kvcache_ggml.prefix.core.PrefixCache.context_shift>` (``reindex``: the sequence stays indexed, as llama-server's
slot keeps its shifted tokens).
"""
from __future__ import annotations

from typing import Any

__all__ = ["check_shift_fields", "shift_amounts", "shift_job"]


def check_shift_fields(job: Any, can_shift: bool) -> None:
    """ValueError (naming the value and the limit) for a request's ``n_cache_reuse`` below 0 or above 0 on a memory
    that cannot shift, ``n_keep`` below -1 or beyond its prompt, ``n_discard`` below 0."""
    n = int(job.tokens.size)
    if job.n_cache_reuse is not None and job.n_cache_reuse < 0:
        raise ValueError(f"n_cache_reuse must be >= 0 (0: off), got {job.n_cache_reuse}")
    if job.n_cache_reuse and not can_shift:
        raise ValueError(f"n_cache_reuse {job.n_cache_reuse}: this model's cache cannot shift positions (a "
                         "sliding-window cache smaller than the context), so no chunk can be reused")
    if not -1 <= job.n_keep <= n:
        raise ValueError(f"n_keep must be in [-1, {n}] (-1: the whole prompt of {n} tokens), got {job.n_keep}")
    if job.n_discard < 0:
        raise ValueError(f"n_discard must be >= 0 (0: half of the tokens after n_keep), got {job.n_discard}")


def shift_amounts(job: Any, n_past: int, n_ctx_seq: int, add_bos: bool) -> tuple[int, int]:
    """(n_keep, n_discard) of a context shift of ``job``'s sequence holding ``n_past`` positions (llama-server's
    rule; n_discard 0 when nothing can go)."""
    n_keep = int(job.tokens.size) if job.n_keep < 0 else job.n_keep
    n_keep = max(0, min(n_ctx_seq - 4, n_keep + (1 if add_bos else 0)))
    n_left = max(n_past - n_keep, 0)
    n_discard = min(job.n_discard or n_left // 2, n_left)
    return n_keep, n_discard


def shift_job(prefix: Any, job: Any, n_ctx_seq: int, add_bos: bool) -> bool:
    """Context shift of a decoding ``job`` whose next token would reach ``n_ctx_seq`` (its token just sampled not
    yet decoded); whether it shifted (False: nothing can go, the request ends)."""
    n_past = int(job.tokens.size) + len(job.generated) - 1 - job.n_discarded
    n_keep, n_discard = shift_amounts(job, n_past, n_ctx_seq, add_bos)
    if n_discard < 1:
        return False
    prefix.context_shift(job.seq, n_keep, n_discard, reindex=True)
    job.n_discarded += n_discard
    return True
