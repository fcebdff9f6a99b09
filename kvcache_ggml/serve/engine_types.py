"""The serving engine's value objects: its parameters (:class:`EngineParams`), counters (:class:`EngineStats`), the
snapshot other threads read (:class:`EngineSnapshot`) and one step's plan (:class:`Chunk`, :class:`StepPlan`); the
engine itself is :mod:`.engine`, which re-exports them."""
from __future__ import annotations

import operator
from dataclasses import dataclass, field, fields

import numpy as np

from .request import Job

__all__ = ["EngineParams", "QueueFull", "EngineStats", "EngineSnapshot", "Chunk", "StepPlan"]


class QueueFull(Exception):
    """The queue holds ``max_queue`` waiting requests already."""


@dataclass(slots=True)
class EngineParams:
    """How the engine schedules requests."""

    n_parallel: int = 4            # requests generating or reading their prompt at once (<= the context's sequences)
    step_tokens: int = 0           # token budget of one step (0: the context's n_batch)
    max_queue: int = 64            # requests waiting for admission; one more gets QueueFull
    timeout: float = 600.0         # seconds from submission to the last token; then the request ends ("length")
    warmup: bool = True            # the engine thread first decodes a graph-sized batch and one token, then clears
    #                                the cache (llama.cpp's warm-up): buffers allocated before the first request, and
    #                                on the thread that computes (ggml's OpenMP team is per calling thread)
    cache_reuse: int = 0           # chunk reuse by K-shift: least tokens a reused chunk (0: off; llama-server's
    #                                --cache-reuse); a request's n_cache_reuse overrides it
    context_shift: bool = False    # a request reaching n_ctx_seq drops n_discard tokens after n_keep and goes on
    #                                (serve/shift.py); False: it ends ("length")
    draft_max: int = 16            # with a drafter: most draft tokens verified per request and step (llama.cpp's)
    draft_min: int = 0             # with a drafter: a shorter draft is not verified (the request decodes one token)
    prompts_per_step: int | None = None  # prompts read in one step, the fewest tokens left first (0: as many as
    #                                the budget holds, in admission order): the first tokens sooner when many requests
    #                                arrive together; None: with n_parallel > 4, 1 with split steps, else 2; up to 4
    #                                slots 0 (prompt_limit())
    split_steps: bool | None = None  # a step generates or reads prompts, never both: while requests of both kinds
    #                                run the steps alternate, and a prompt step is planned after the generating step
    #                                before it (requests that arrived meanwhile join it); None: with n_parallel > 4
    #                                (split())
    fa_tiles: bool = True          # warm_up() measures whether small steps are cheaper with throwaway rows up to
    #                                ggml's CPU flash-attention tile, and steps take them where so (fa_tiles.py)

    def split(self) -> bool:
        """Whether steps keep generating tokens and prompt chunks apart.  Unset, with more than 4 slots: at 8 users,
        with one prompt a step, the TTFT p50 fell by 30 % at 2 % fewer tokens/s; at 4 users it gained 8 % and cost
        4 % (docs/serving.md, "Prompt steps apart")."""
        return self.split_steps if self.split_steps is not None else self.n_parallel > 4

    def prompt_limit(self) -> int:
        """Prompts a step reads at most (0: no limit).  Unset, with more than 4 slots one a step when steps are
        split, else two: at 8 users two a step in mixed steps cut the TTFT p50 by a quarter to a third at equal
        tokens/s; up to 4 slots no limit, where two a step cost 2-14 % of the tokens/s and gained nothing
        (docs/serving.md, "Prompts per step")."""
        if self.prompts_per_step is not None:
            return self.prompts_per_step
        if self.n_parallel <= 4:
            return 0
        return 1 if self.split() else 2

    def check(self, n_seq: int, n_batch: int) -> None:
        if not 1 <= self.n_parallel <= n_seq:
            raise ValueError(f"n_parallel must be in [1, {n_seq}] (the context's sequences), got {self.n_parallel}")
        if not 0 <= self.step_tokens <= n_batch:
            raise ValueError(f"step_tokens must be in [0, n_batch = {n_batch}], got {self.step_tokens}")
        if self.step_tokens and self.step_tokens < self.n_parallel:
            raise ValueError(f"step_tokens {self.step_tokens} < n_parallel {self.n_parallel}: a step must hold "
                             "one token of every generating request")
        if self.prompts_per_step is not None and self.prompts_per_step < 0:
            raise ValueError(f"prompts_per_step must be >= 0 (0: no limit), got {self.prompts_per_step}")
        if self.max_queue < 0 or self.timeout <= 0:
            raise ValueError(f"max_queue must be >= 0 and timeout > 0, got {self.max_queue}, {self.timeout}")
        if self.draft_max < 1 or not 0 <= self.draft_min <= self.draft_max:
            raise ValueError(f"draft_max must be >= 1 and draft_min in [0, draft_max], got draft_max "
                             f"{self.draft_max}, draft_min {self.draft_min}")
        if self.cache_reuse < 0:
            raise ValueError(f"cache_reuse must be >= 0 (0: off), got {self.cache_reuse}")


@dataclass(slots=True)
class EngineStats:
    """Counters since the engine started (the metrics endpoint prints them)."""

    requests: int = 0              # requests finished (any reason)
    requests_failed: int = 0       # ended by an error
    requests_cancelled: int = 0    # ended because their client went away
    prompt_tokens: int = 0         # prompt tokens of admitted requests
    cached_tokens: int = 0         # of them reused from the prefix cache
    computed_tokens: int = 0       # of them decoded
    generated_tokens: int = 0      # tokens sampled
    steps: int = 0                 # batches decoded
    prompt_steps: int = 0          # of them, those with prompt chunks
    ended_full: int = 0            # requests ended ("length") or sent back to the queue because the cache was full
    plan_misses: int = 0           # steps whose decode found no slot although the plan had claimed the room
    drafts: int = 0                # drafts verified (speculative decoding)
    draft_tokens: int = 0          # their tokens (llama-server's draft_n)
    draft_accepted: int = 0        # of them, the tokens accepted (llama-server's draft_n_accepted)
    drafts_dropped: int = 0        # drafts proposed but not verified: the cache had no room for them
    context_shifts: int = 0        # context shifts of decoding requests (``context_shift``)

    def copy(self) -> "EngineStats":
        """A copy (the snapshot's: a fifth of ``dataclasses.replace``'s cost)."""
        return EngineStats(*_stats_values(self))


_stats_values = operator.attrgetter(*(f.name for f in fields(EngineStats)))  # (the counters, in field order)


@dataclass(slots=True, frozen=True)
class EngineSnapshot:
    """The engine as it stood after its last step (or after taking its messages): safe to read from any thread."""

    stats: EngineStats             # a copy of the counters (never changed after publishing)
    n_running: int                 # requests admitted (reading their prompt or decoding)
    n_waiting: int                 # requests in the queue
    kv_used: int                   # cells holding a token (the base cache's, for iSWA)
    kv_size: int                   # cells of the cache, all streams
    prefix_hits_device: int        # admissions that reused a sequence in the cache
    prefix_hits_host: int          # admissions that restored a host-tier blob
    prefix_evictions: int          # parked sequences evicted
    padded_steps: int = 0          # steps given throwaway rows up to flash attention's tile (runtime/fa_tiles.py)


@dataclass(slots=True)
class Chunk:
    """One request's part of a step's batch."""

    job: Job                       # the request
    tokens: np.ndarray             # int32 [n]: a prompt chunk, or the one token it sampled last and its draft
    sample: bool                   # a token is sampled from the logits of its last token
    n_draft: int = 0               # tokens after the first that are a draft (logits on every row, verified)


@dataclass(slots=True)
class StepPlan:
    """What one step does, decided (and its room claimed) by :meth:`Engine.plan`."""

    chunks: list[Chunk] = field(default_factory=list)     # the batch: decoding requests first, then prompt chunks
    n_tokens: int = 0              # tokens in the batch (<= the token budget)
    admitted: list[Job] = field(default_factory=list)     # requests admitted by this plan
    held: list[Job] = field(default_factory=list)         # reading requests whose chunk waits for room
    victims: list[Job] = field(default_factory=list)      # requests ended or sent back to the queue for room
