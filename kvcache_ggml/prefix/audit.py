"""The prefix cache checked from scratch against the cells: what a property test asserts after every step."""
from __future__ import annotations

from typing import Any

import numpy as np

from .index import memory_cells

__all__ = ["check"]


def check(pc: Any) -> list[str]:
    """Every disagreement between a :class:`~kvcache_ggml.prefix.PrefixCache`, its tree, its host tier and the
    cache's cells (an empty list: consistent).

    Per sequence: an entry exists iff the sequence has cells or serves a request; the entry's tokens sit at
    positions 0..n-1, one cell each, with no K-shift pending; ``clean`` iff no other cell holds the sequence.  An
    iSWA memory is checked in its base cache (its SWA cache holds only each sequence's window).
    """
    out: list[str] = []
    tokens_of: dict[Any, np.ndarray] = {e: e.tokens for e in pc.seqs.values() if e.tokens.size}
    tokens_of.update({h: h.tokens for h in pc.host_entries()})
    out += pc.tree.check(tokens_of)
    if pc.host is not None:
        out += pc.host.check()
    t = memory_cells(pc.ctx.kv)
    t = t[t["pos"] >= 0]
    for s in range(pc.n_seq):
        stream = pc.stream_of(s)
        mine = t[(t["stream"] == stream) & ((t["seq_bits"][:, s // 64] >> np.uint64(s % 64)) & np.uint64(1) != 0)]
        others = t[(t["stream"] != stream) & ((t["seq_bits"][:, s // 64] >> np.uint64(s % 64)) & np.uint64(1) != 0)]
        if others.size:
            out.append(f"sequence {s}: {others.size} cells outside its stream {stream}")
        e = pc.seqs.get(s)
        if e is None:
            if mine.size:
                out.append(f"sequence {s}: {mine.size} cells but no entry")
            continue
        out += _check_entry(e, s, stream, mine)
    return out


def _check_entry(e: Any, s: int, stream: int, mine: np.ndarray) -> list[str]:
    out = []
    if e.seq_id != s or e.stream != stream:
        out.append(f"sequence {s}: entry says sequence {e.seq_id} in stream {e.stream}, expected stream {stream}")
    n = e.tokens.size
    pos = mine["pos"]
    low = np.sort(pos[pos < n])
    if not np.array_equal(low, np.arange(n)):
        out.append(f"sequence {s}: its {n} tokens need positions 0..{n - 1} once each, the cells hold "
                   f"{low.size} positions below {n} ({np.unique(low).size} distinct)")
    if (mine["shift"][pos < n] != 0).any():
        out.append(f"sequence {s}: K-shift pending on a cell of its indexed prefix")
    if e.clean != (pos.size == n):
        out.append(f"sequence {s}: clean is {e.clean}, but {pos.size} cells hold it for {n} tokens")
    if not e.active and pos.size == 0:
        out.append(f"sequence {s}: a parked entry without cells")
    return out
