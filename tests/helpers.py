"""Helpers shared by the test modules: a toy model and cache, a decode that drives a cache as llama_decode drives
its memory, and snapshots of the bookkeeping.

tests/ is on sys.path under pytest (its conftest.py puts it there, as for kvmodel.py), so a test module, also one
under tests/oracle/, does ``from helpers import ToyModel, make_cache``.  No test module imports another one.
"""
from __future__ import annotations

import ctypes
import dataclasses
import os
from pathlib import Path

import numpy as np

from kvcache_ggml.batch import Batch, BatchAllocator
from kvcache_ggml.cache import KVCache, KVCacheParams, MemoryStatus
from kvcache_ggml.hparams import HParams

N_VOCAB = 64  # vocabulary of the toy model's batches (token ids are always 3)

# the oracle's tiny.gguf: 2 layers, 4 heads of 16, 2 KV heads
TINY_GGUF = dict(n_layer=2, n_embd_head=16, n_head=4, n_head_kv=2, n_vocab=N_VOCAB)

_CACHE_FIELDS = frozenset(f.name for f in dataclasses.fields(KVCacheParams))


class ToyModel:
    """The least a KVCache asks of a model: ``hparams`` (``HParams.simple``'s arguments; by default 2 layers of
    2 heads of 8 and 1 KV head, or one layer per entry of a per-layer ``n_head_kv``) and every layer on the CPU."""

    def __init__(self, n_layer: int | None = None, n_embd_head: int = 8, n_head=2, n_head_kv=1, **kw) -> None:
        if n_layer is None:
            n_layer = 2 if isinstance(n_head_kv, int) else len(n_head_kv)
        self.hparams = HParams.simple(n_layer=n_layer, n_embd_head=n_embd_head, n_head=n_head,
                                      n_head_kv=n_head_kv, **kw)

    def dev_layer(self, il: int) -> None:
        return None


def make_cache(kv_size: int = 16, n_seq_max: int = 1, unified: bool = True, *, model=None,
               n_stream: int | None = None, **kw) -> KVCache:
    """A KVCache on ``model`` (default: a ToyModel).

    Keyword arguments that KVCacheParams has go to the cache (``n_swa``/``swa_type`` included), the others to
    ToyModel.  ``n_stream=k`` asks for k streams of one sequence each (k = 1: one unified stream)."""
    params = {k: kw.pop(k) for k in list(kw) if k in _CACHE_FIELDS}
    if model is None:
        model = ToyModel(**kw)
    elif kw:
        raise TypeError(f"make_cache: model given, so {sorted(kw)} would be ignored")
    if n_stream is not None:
        unified, n_seq_max = n_stream == 1, max(n_stream, 1)
    return KVCache(model, kv_size=kv_size, n_seq_max=n_seq_max, unified=unified, **params)


def decode(kv: KVCache, pos, seqs, n_ubatch: int = 512, use_pos: bool = True, check: bool = False):
    """balloc.init + init_batch + apply of every ubatch, as llama_decode does for the memory.

    ``seqs``: per token a sequence id or a list of them.  Returns (the memory context, the cells of the tokens
    as stream * kv_size + cell in ubatch order); cells is None when the batch does not fit (with ``check``: an
    AssertionError instead)."""
    ba = BatchAllocator(1)
    seq_rows = [s if isinstance(s, (list, tuple)) else [s] for s in seqs]
    ba.init(Batch(token=np.full(len(seq_rows), 3), pos=pos if use_pos else None, seq_id=seq_rows),
            N_VOCAB, kv, 16, kv.n_seq_max, False)
    ctx = kv.init_batch(ba, n_ubatch)
    if ctx.get_status() != MemoryStatus.SUCCESS:
        assert not check, f"the batch does not fit: {ctx.get_status()}"
        return ctx, None
    cells = []
    while True:
        ctx.apply()
        si = ctx.get_sinfo()
        for s, idx in zip(si.strm, si.idxs, strict=True):
            cells += (s * kv.get_size() + idx).tolist()
        if not ctx.next():
            break
    return ctx, cells


def snapshot(kv: KVCache) -> tuple:
    """Every stream's cells (positions, shifts, sequence bits), heads, per-sequence ranges of sequences 0..7,
    used_max_p1 and used count: what a failed call must leave unchanged."""
    return ([c.pos_array.copy() for c in kv.v_cells], [c.shift_array.copy() for c in kv.v_cells],
            [c.seq_bits.copy() for c in kv.v_cells], list(kv.v_heads),
            [[(c.seq_pos_min(s), c.seq_pos_max(s)) for s in range(8)] for c in kv.v_cells],
            [c.used_max_p1() for c in kv.v_cells], [c.get_used() for c in kv.v_cells])


def assert_same_snapshot(a: tuple, b: tuple) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        if isinstance(x, list) and x and isinstance(x[0], np.ndarray):
            assert len(x) == len(y)
            for u, v in zip(x, y, strict=True):
                np.testing.assert_array_equal(u, v)
        else:
            assert x == y


# AddressSanitizer's runtime is in this process (python3 build.py --asan test preloads it)
UNDER_ASAN = hasattr(ctypes.CDLL(None), "__asan_init")


def rss_bytes() -> int:
    """This process's resident memory (Linux: /proc/self/statm, in the system's pages)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def prefill(pc, tokens, seq: int, retention=None):
    """A prompt through a PrefixCache's one request API: ``attach`` (the cached prefix reused), then ``advance``
    over the rest in n_batch chunks, logits for the last token only.  Returns (the admission, float32 [n_vocab]
    logits of the last token).  A decode that fails releases the sequence (what was decoded stays cached, parked)
    and raises."""
    adm = pc.attach(tokens, seq, retention=retention)
    rest = np.asarray(tokens, np.int32)[adm.n_reused:]
    n_batch = pc.ctx.cparams.n_batch
    try:
        for i in range(0, rest.size, n_batch):
            (row,) = pc.advance([(seq, rest[i:i + n_batch], i + n_batch >= rest.size)])
    except BaseException:
        pc.release(seq)
        raise
    return adm, row
