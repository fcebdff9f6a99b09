"""Host time per phase of a context's decode steps (:class:`StepTimes`), and the allocator wrapper that times the
ubatch splits (:class:`TimedSplits`)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Callable

from ..batch import BatchAllocator

__all__ = ["StepTimes", "TimedSplits"]


@dataclass(slots=True)
class StepTimes:
    """Host seconds spent per phase since the last :meth:`reset` (and counts).  The seconds are measured only by a
    context made with ``no_perf=False``; otherwise they stay 0 (llama.cpp's default: no performance timings)."""

    batch: float = 0.0          # BatchAllocator: validation, auto-fill and the ubatch splits
    bookkeeping: float = 0.0    # the cache's cells: slot search (prepare), apply(), n_kv
    update: float = 0.0         # memory updates: stream copies and K-shift graphs
    inputs: float = 0.0         # filling the graph inputs (tokens, positions, K/V indices, kq mask)
    build: float = 0.0          # building the graph and allocating it in the scheduler
    compute: float = 0.0        # computing the graph and reading the logits back
    n_decode: int = 0           # decode() calls
    n_ubatch: int = 0           # graphs computed
    n_tokens: int = 0           # tokens decoded
    n_graph_reused: int = 0     # graphs computed again without rebuilding (the previous one, or a kept one)
    n_graph_kept: int = 0       # of them, graphs of an earlier shape kept allocated (GraphCache)

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, f.default)

    def since(self, before: "StepTimes") -> "StepTimes":
        """The seconds and counts added since ``before`` (an earlier copy of these times)."""
        return StepTimes(**{f.name: getattr(self, f.name) - getattr(before, f.name) for f in fields(self)})

    def host_total(self) -> float:
        return self.batch + self.bookkeeping + self.update + self.inputs + self.build + self.compute

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


class TimedSplits:
    """The context's BatchAllocator as init_batch sees it: the splits add their time to ``seconds`` (so init_batch's
    time can be divided between the splits and the slot search).  One per context, reused every step; the other
    methods the caches call are the allocator's own bound methods."""

    def __init__(self, balloc: BatchAllocator, clock: Callable[[], float]) -> None:
        self._balloc = balloc
        self._clock = clock
        self.seconds = 0.0
        for name in ("split_reset", "get_n_tokens", "get_n_used", "get_n_outputs", "ubatch_reserve"):
            setattr(self, name, getattr(balloc, name))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._balloc, name)

    def split_simple(self, n_ubatch: int) -> Any:
        t0 = self._clock()
        try:
            return self._balloc.split_simple(n_ubatch)
        finally:
            self.seconds += self._clock() - t0

    def split_equal(self, n_ubatch: int, sequential: bool) -> Any:
        t0 = self._clock()
        try:
            return self._balloc.split_equal(n_ubatch, sequential)
        finally:
            self.seconds += self._clock() - t0
