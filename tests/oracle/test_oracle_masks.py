"""Differential: the causal kq mask of every ubatch of every decode, llama.cpp's against ours, bit for bit.

The traces are test_oracle_bookkeeping's, from bookkeeping_trace.py (random decodes, removals, copies, shifts);
llama.cpp takes each ubatch's mask right after its apply(), with n_kv = get_n_kv() and one mask stream per stream
of the ubatch, and so do we (KVCacheContext.kq_mask after apply()).
"""
import numpy as np
import pytest

from kvcache_ggml.batch import Batch, BatchAllocator
from kvcache_ggml.cache import KVCache, MemoryStatus

from bookkeeping_trace import CONFIGS as BOOKKEEPING_CONFIGS
from bookkeeping_trace import make_trace
from conftest import run_oracle
from helpers import TINY_GGUF, ToyModel

pytestmark = pytest.mark.oracle

CONFIGS = dict(BOOKKEEPING_CONFIGS)
CONFIGS["unified-4-512"] = dict(kv_size=512, n_seq_max=4, unified=True)  # n_kv (256) below the cache size
CONFIGS["streams-2-512-swa"] = dict(kv_size=512, n_seq_max=2, unified=False, n_swa=7, swa_type=1)


def our_masks(kv, pos, seqs, n_ubatch, use_pos):
    """Decode as llama.cpp does and return the causal mask of each ubatch after its apply() (None: rejected)."""
    ba = BatchAllocator(1)
    try:
        ba.init(Batch(token=np.full(len(pos), 3), pos=pos if use_pos else None, seq_id=seqs,
                      logits=[0] * (len(pos) - 1) + [1]), 64, kv, 64, kv.n_seq_max, False)
        ctx = kv.init_batch(ba, n_ubatch)
    except ValueError:
        return None
    if ctx.get_status() != MemoryStatus.SUCCESS:
        return None
    masks = []
    while True:
        ctx.apply()
        masks.append(ctx.kq_mask(causal=True))
        if ctx.i_cur == len(ctx.ubatches) - 1:
            return masks
        ctx.next()


def replay(cfg, ops):
    """Our masks for every decode of the trace (other ops replayed for their effect on the cells)."""
    kv = KVCache(ToyModel(**TINY_GGUF), kv_size=cfg["kv_size"], n_seq_max=cfg["n_seq_max"], unified=cfg["unified"],
                 n_swa=cfg.get("n_swa", 0), swa_type=cfg.get("swa_type", 0))
    out = []
    for op in ops:
        name, args = op[0], op[1:]
        if name == "decode":
            out.append(our_masks(kv, *args))
            continue
        if name == "clear":
            kv.clear(True)
        else:
            getattr(kv, name)(*args)
        out.append(None)
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("seed", range(4))
def test_masks_match_llama_cpp(name, seed):
    cfg = CONFIGS[name]
    rng = np.random.default_rng(7919 * seed + sum(name.encode()))
    ops, _ = make_trace(rng, cfg, 60)
    ours = replay(cfg, ops)
    theirs = run_oracle({"cache": cfg, "ops": ops, "masks": True})
    assert len(theirs) == len(ops), f"oracle stopped early: {theirs[-1] if theirs else 'no output'}"
    n_masks = 0
    for k, (op, mine, t) in enumerate(zip(ops, ours, theirs)):
        if op[0] != "decode":
            continue
        where = f"step {k}: {op}"
        if not isinstance(t["r"], dict):
            assert mine is None, where
            continue
        assert mine is not None and len(mine) == len(t["masks"]), where
        for u, (m, tm) in enumerate(zip(mine, t["masks"])):
            ref = np.asarray(tm, np.float32)
            assert m.shape == ref.shape, f"{where}, ubatch {u}: shape {m.shape} vs {ref.shape}"
            assert np.array_equal(m.view(np.uint32), ref.view(np.uint32)), f"{where}, ubatch {u}"
            n_masks += 1
    assert n_masks > 0
