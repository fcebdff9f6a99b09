"""Built decoder graphs kept per topology, so that a step whose shape was seen before neither builds nor allocates.

llama.cpp keeps one graph: the previous one, computed again when the next ubatch has the same topology (its
``can_reuse``).  A serving loop changes the batch's shape from step to step -- requests join and leave, prompt
chunks come and go -- and alternates between a few shapes, so a single previous graph is rarely the right one, and
building a graph from Python costs more than llama.cpp's C++ build.  :class:`GraphCache` keeps the last
``capacity`` small graphs (at most ``max_tokens`` tokens: the decode steps; a prompt chunk's graph is dominated by
its compute and is built as before), least recently used first out.

Each kept graph lives in its own graph context (metadata) and stays allocated in its own scheduler, whose compute
buffer holds its intermediate tensors.  ggml's allocator cannot allocate a graph a second time (it takes a tensor
that has a data pointer for one allocated elsewhere), so a kept graph is never re-allocated: switching to it costs
nothing, and it is the same graph a new build for its key would give, so the results are the same bytes.  The
memory cost is one compute buffer per kept graph, sized to it (small for decode steps: activations of a few tokens
and their logits).  A context with buffers on an RPC server keeps no graphs: a new scheduler allocates on the
server, and when a lost server fails that allocation ggml's allocator goes on with a NULL buffer (a crash), where
the one scheduler's buffers, sized by the first steps, need no new allocation.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from .. import ggml as G

__all__ = ["GraphCache", "KeptGraph"]


@dataclass(slots=True)
class KeptGraph:
    """A graph kept by the cache, with what it lives in."""

    ctx: G.Context        # the graph context holding its tensors' metadata
    sched: G.Sched        # the scheduler it is allocated in (alone)
    graph: Any            # the DecoderGraph


class GraphCache:
    """The last ``capacity`` built graphs of at most ``max_tokens`` tokens, by key."""

    def __init__(self, capacity: int, max_tokens: int, n_tensors: int, new_sched: Callable[[], G.Sched]) -> None:
        if capacity < 0 or max_tokens < 1:
            raise ValueError(f"a graph cache needs capacity >= 0 and max_tokens >= 1, got {capacity}, {max_tokens}")
        self.capacity = capacity              # graphs kept (0: none, every new shape builds, as llama.cpp)
        self.max_tokens = max_tokens          # larger graphs are not kept
        self._n_tensors = n_tensors           # tensors (and nodes) one graph context holds
        self._new_sched = new_sched           # a scheduler over the context's backends
        self._kept: OrderedDict[Any, KeptGraph] = OrderedDict()  # key -> kept graph, least recently used first
        self._by_size: dict[tuple[int, int, int], Any] = {}  # (n_tokens, s0, s1) -> the key of the last used
        #   graph of that many tokens, all outputs, on those streams (the fused step's candidate for a step of one
        #   token per sequence)

    def keeps(self, key: Any) -> bool:
        """Whether a graph of ``key`` is kept once built."""
        return self.capacity > 0 and key.n_tokens <= self.max_tokens

    def get(self, key: Any) -> Any | None:
        """The kept graph of ``key`` (now the most recently used), or None."""
        kept = self._kept.get(key)
        if kept is None:
            return None
        self._kept.move_to_end(key)
        self._note(key)
        return kept.graph

    def for_step(self, n_tokens: int, s0: int, s1: int) -> Any | None:
        """The last used kept graph of ``n_tokens`` tokens, every one an output, on streams s0..s1, or None: the
        fused step tries it for a step of one token per sequence (its placement checks the rest of the key).  A
        candidate is not a use: :meth:`get` marks the graph used when the step takes it."""
        key = self._by_size.get((n_tokens, s0, s1))
        return None if key is None else self._kept[key].graph

    def _note(self, key: Any) -> None:
        if key.n_outputs == key.n_tokens:
            self._by_size[(key.n_tokens, key.s0, key.s1)] = key

    def build(self, key: Any, make: Callable[[G.Context], Any], on_evict: Callable[[Any], None]) -> KeptGraph:
        """``make(ctx)`` in a free graph context, allocated in its own scheduler and kept under ``key`` (``keeps``
        must hold); evicts the least recently used graph when full, after ``on_evict(graph)``."""
        assert self.keeps(key) and key not in self._kept
        while len(self._kept) >= self.capacity:
            old_key, old = self._kept.popitem(last=False)
            size = (old_key.n_tokens, old_key.s0, old_key.s1)
            if self._by_size.get(size) == old_key:
                del self._by_size[size]
            on_evict(old.graph)
            self._free(old)
        sched = self._new_sched()  # (a fresh one: a used scheduler would lay the graph out as its last graph)
        try:
            slot = KeptGraph(G.Context.for_tensors(self._n_tensors, self._n_tensors), sched, None)
        except BaseException:
            sched.close()
            raise
        try:
            g = make(slot.ctx)
            slot.sched.alloc_graph(g.graph)
        except BaseException:
            self._free(slot)
            raise
        slot.graph = g
        self._kept[key] = slot
        self._note(key)
        return slot

    def scheds(self) -> list[G.Sched]:
        """Every scheduler the cache owns (an eval callback is set on each)."""
        return [k.sched for k in self._kept.values()]

    def close(self, on_evict: Callable[[Any], None] = lambda g: None) -> None:
        """Free every graph, its context and its scheduler (idempotent)."""
        for kept in self._kept.values():
            on_evict(kept.graph)
            self._free(kept)
        self._kept.clear()
        self._by_size.clear()

    def __len__(self) -> int:
        return len(self._kept)

    def keys(self) -> list[Any]:
        """The kept graphs' keys, least recently used first."""
        return list(self._kept)

    @staticmethod
    def _free(kept: KeptGraph) -> None:
        kept.graph = None
        kept.ctx.close()
        kept.sched.close()
