"""Checkpoints of the SWA cache: prompt reuse on a sliding-window model (llama-server's context checkpoints).

A small SWA cache keeps only the newest positions of a sequence.  A new prompt that shares only an older prefix
with the cached one cannot continue from the end of that prefix: the tokens the next position's window needs are
gone from the SWA cache (while the base cache still has them).  llama.cpp's answer, reproduced here: while the
prompt is processed, save the SWA cache's cells of the sequence now and then (``state_save(seq_id,
PARTIAL_ONLY)``, a few hundred KiB for a real model); to reuse a prefix, restore the newest checkpoint that still
holds the window of a position at or before the reuse point, drop everything after that position, and decode the
rest of the new prompt from there.

:meth:`SWACheckpoints.reuse` follows llama-server (tools/server/server-context.cpp of llama.cpp):

- ``pos_min_thold = max(0, n_past - n_swa)``; the cache alone suffices when the sequence's smallest position in the
  SWA cache is below it (or when nothing is to be dropped: ``n_past`` is 0 or the whole cached sequence);
- otherwise the newest checkpoint with ``pos_min < pos_min_thold`` is restored and ``n_past`` becomes
  ``min(n_past, max(pos_min + 1, pos_max), n_tokens)`` of that checkpoint -- the checkpoint's last position is
  decoded again, so at least one token is processed; without such a checkpoint ``n_past`` becomes 0;
- checkpoints with ``pos_max > n_past`` are forgotten (they hold tokens of the old prompt after the reuse point),
  and positions ``[n_past, ...)`` of the sequence are removed from the memory.

Positions are token indices here (one position per token, from 0), as in a plain text prompt.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from .iswa import STATE_SEQ_FLAGS_PARTIAL_ONLY

__all__ = ["SWACheckpoint", "SWACheckpoints"]


@dataclass(slots=True)
class SWACheckpoint:
    """The SWA cache's cells of one sequence at one moment."""

    pos_min: int       # the sequence's smallest position in the SWA cache when saved
    pos_max: int       # its largest position (the last token processed)
    n_tokens: int      # prompt tokens processed when saved (pos_max + 1 unless the caller says otherwise)
    data: bytes        # state_save(seq_id, PARTIAL_ONLY): the SWA cache's part of the sequence's state


class SWACheckpoints:
    """The checkpoints of one sequence, oldest first, at most ``n_max`` (llama-server's ``--ctx-checkpoints``)."""

    def __init__(self, n_max: int = 8) -> None:
        if n_max < 1:
            raise ValueError(f"n_max must be >= 1, got {n_max}")
        self.n_max = n_max
        self._items: list[SWACheckpoint] = []

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[SWACheckpoint]:
        return iter(list(self._items))

    def save(self, mem: Any, seq_id: int, n_tokens: int | None = None) -> SWACheckpoint:
        """Save the SWA cache's cells of ``seq_id`` (the oldest checkpoint goes when ``n_max`` are kept)."""
        pos_min, pos_max = mem.seq_pos_min(seq_id), mem.seq_pos_max(seq_id)
        if pos_max < 0:
            raise ValueError(f"sequence {seq_id} has no cells to checkpoint")
        n = pos_max + 1 if n_tokens is None else int(n_tokens)
        if not 0 < n <= pos_max + 1:
            raise ValueError(f"n_tokens {n} out of range [1, {pos_max + 1}] (the sequence ends at {pos_max})")
        cp = SWACheckpoint(pos_min, pos_max, n, mem.state_save(seq_id, STATE_SEQ_FLAGS_PARTIAL_ONLY))
        while len(self._items) >= self.n_max:
            self._items.pop(0)
        self._items.append(cp)
        return cp

    def find(self, pos_min_thold: int) -> SWACheckpoint | None:
        """The newest checkpoint whose SWA cells reach below ``pos_min_thold``."""
        for cp in reversed(self._items):
            if cp.pos_min < pos_min_thold:
                return cp
        return None

    def reuse(self, mem: Any, seq_id: int, n_past: int) -> int:
        """Prepare ``seq_id`` to continue a new prompt whose first ``n_past`` tokens equal the cached ones;
        returns the number of tokens kept (decode the new prompt from there).  See the module docstring."""
        n_cached = mem.seq_pos_max(seq_id) + 1
        if not 0 <= n_past <= n_cached:
            raise ValueError(f"n_past {n_past} out of range [0, {n_cached}] (the cached tokens of sequence "
                             f"{seq_id})")
        pos_next = n_past
        if 0 < n_past < n_cached:
            pos_min_thold = max(0, pos_next - max(0, mem.n_swa))
            if mem.seq_pos_min(seq_id) >= pos_min_thold:
                cp = self.find(pos_min_thold)
                restored = False
                if cp is not None:
                    try:
                        mem.state_load(cp.data, seq_id, STATE_SEQ_FLAGS_PARTIAL_ONLY)
                        restored = True
                    except ValueError:
                        pass  # the sequence is gone from both caches: start over, as llama-server does
                if restored:
                    pos_next = min(pos_next, max(cp.pos_min + 1, cp.pos_max))
                    n_past = min(pos_next, cp.n_tokens)
                else:
                    pos_next = n_past = 0
        self._items = [cp for cp in self._items if cp.pos_max <= pos_next]
        mem.seq_rm(seq_id, pos_next, -1)
        return n_past
