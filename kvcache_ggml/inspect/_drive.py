"""Inspection: driving a cache without a model (:func:`decode_steps`, :func:`decode`), the memory half of
``llama_decode``."""
from __future__ import annotations

from typing import Any, Iterable, Iterator, Sequence

import numpy as np


# ============================================================================================== driving a cache

def decode_steps(kv: Any, pos: Sequence[int] | np.ndarray | None, seqs: Iterable[Any], *, n_ubatch: int = 512,
                 output_all: bool = False) -> Iterator[Any]:
    """The memory half of ``llama_decode`` for one batch, without a model: validate the batch (positions ``pos``,
    or None to continue each sequence; ``seqs`` one sequence id or a list of ids per token), find a slot for
    every ubatch (``init_batch``), then ``apply()`` each ubatch in turn, yielding the memory context after each
    apply -- the place to read ``ctx.kq_mask()``, ``ctx.get_sinfo()``, ``ctx.k_idxs()``.  The generator must be
    consumed for every ubatch to land.  RuntimeError when no slot is found."""
    from ..batch import Batch, BatchAllocator
    from ..cache import MemoryStatus

    rows = [list(s) if isinstance(s, (list, tuple, np.ndarray)) else [int(s)] for s in seqs]
    if not rows:
        raise ValueError("decode needs at least one token")
    hp = kv.hparams
    ba = BatchAllocator(hp.n_pos_per_embd())
    ba.init(Batch(token=np.zeros(len(rows), np.int32), pos=pos, seq_id=rows), 1, kv, hp.n_embd, kv.n_seq_max,
            output_all)
    ctx = kv.init_batch(ba, n_ubatch)
    if ctx.get_status() != MemoryStatus.SUCCESS:
        raise RuntimeError(f"no slot for a batch of {len(rows)} tokens ({ctx.get_status().name}): the cache has "
                           f"{[c.size() - c.get_used() for c in kv.v_cells]} free cells per stream")
    while True:
        ctx.apply()
        yield ctx
        if not ctx.next():
            return


def decode(kv: Any, pos: Sequence[int] | np.ndarray | None, seqs: Iterable[Any], *, n_ubatch: int = 512) -> Any:
    """:func:`decode_steps` run to the end; returns the memory context (its ``sinfos`` say where each ubatch
    went)."""
    ctx = None
    for ctx in decode_steps(kv, pos, seqs, n_ubatch=n_ubatch):
        pass
    return ctx
