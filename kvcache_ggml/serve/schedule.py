"""One step's batch, chosen from the engine's running requests: which kinds of chunk the step takes
(:func:`step_kinds`) and the chunks themselves under the token budget (:func:`choose_batch`; :func:`lone_chunk`
where one request generates alone).  Pure functions of
the requests' states and progress; :meth:`.engine.Engine.plan` calls them and claims the room."""
from __future__ import annotations

import numpy as np

from .engine_types import Chunk
from .request import Job, RequestState

__all__ = ["step_kinds", "choose_batch", "lone_chunk"]

_S = RequestState


def step_kinds(running: list[Job], gen_last: bool) -> tuple[bool, bool]:
    """For split steps (``EngineParams.split``): whether the step takes the generating requests' tokens, and
    whether it takes prompt chunks -- one or the other.  While requests of both kinds run, the kind the step before
    (``gen_last``: it generated) did not take; otherwise the kind that runs."""
    kinds = {j.state for j in running}
    gen = _S.DECODING in kinds and (_S.PREFILL not in kinds or not gen_last)
    return gen, not gen


def choose_batch(running: list[Job], drafts: dict[Job, np.ndarray], budget: int, limit: int, gen: bool = True,
                 read: bool = True) -> tuple[list[Chunk], list[Job]]:
    """The step's chunks under the token ``budget``: with ``gen``, every decoding request's last token, then the
    drafts (as many of their tokens as the budget leaves, in admission order); with ``read``, prompt chunks -- of
    ``limit`` prompts at most, the fewest tokens left first, or with 0 of every prompt in admission order; and the
    reading requests left out for the budget or the limit."""
    chunks = [Chunk(j, np.array(j.generated[-1:], np.int32), True) for j in running
              if gen and j.state is _S.DECODING]
    left, held = budget - len(chunks), []
    for c in chunks:
        d = drafts.get(c.job)
        if d is not None and left > 0:
            d = d[:left]
            c.tokens, c.n_draft = np.concatenate([c.tokens, d]), d.size
            left -= d.size
    reading = [j for j in running if read and j.state is _S.PREFILL]
    if limit:
        reading.sort(key=lambda j: j.tokens.size - j.fed)  # (stable: admission order among equals)
    for i, j in enumerate(reading):
        if left <= 0 or (limit and i >= limit):
            held.append(j)
            continue
        piece = j.tokens[j.fed:j.fed + left]
        chunks.append(Chunk(j, piece, j.fed + piece.size == j.tokens.size))
        left -= piece.size
    return chunks, held


def lone_chunk(running: list[Job], now: float) -> Chunk | None:
    """The batch of a step with nothing waiting and no drafts where one request runs, decoding, neither cancelled
    nor past its deadline at ``now`` (which the engine's plan would otherwise end): its next token, the one chunk
    :func:`choose_batch` gives then; None otherwise."""
    if len(running) != 1:
        return None
    j = running[0]
    if j.state is not _S.DECODING or j.cancelled or now > j.deadline:
        return None
    return Chunk(j, np.array(j.generated[-1:], np.int32), True)
