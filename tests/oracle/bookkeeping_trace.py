"""The random bookkeeping traces of the oracle suite: ops generated against our cache, with our result and cells
after each (test_oracle_bookkeeping compares them with llama.cpp's, test_oracle_masks replays them for masks)."""
import numpy as np

from kvcache_ggml.batch import Batch, BatchAllocator
from kvcache_ggml.cache import KVCache, MemoryStatus

from helpers import TINY_GGUF, ToyModel


def our_decode(kv, pos, seqs, n_ubatch, use_pos):
    ba = BatchAllocator(1)
    try:
        ba.init(Batch(token=np.full(len(pos), 3), pos=pos if use_pos else None, seq_id=seqs,
                      logits=[0] * (len(pos) - 1) + [1]), 64, kv, 64, kv.n_seq_max, False)
    except ValueError:
        return -1
    try:
        ctx = kv.init_batch(ba, n_ubatch)
    except ValueError:
        return -2  # a ubatch larger than the cache: llama.cpp reports it as a failed prepare
    if ctx.get_status() != MemoryStatus.SUCCESS:
        return -2
    cells, sizes = [], []
    while True:
        ctx.apply()
        si = ctx.get_sinfo()
        for s, idx in zip(si.strm, si.idxs):
            cells += (s * kv.get_size() + idx).tolist()
        sizes.append(ctx.get_ubatch().n_tokens)
        if not ctx.next():
            break
    return {"cells": cells, "sizes": sizes}


def dump(kv):
    pos, sh, seq = [], [], []
    for c in kv.v_cells:
        empty = c.pos_array < 0
        pos.append(c.pos_array.tolist())
        sh.append(np.where(empty, 0, c.shift_array).tolist())
        seq.append(c.seq_bits.T.tolist())
    return pos, sh, seq, list(kv.v_heads)


def make_trace(rng, cfg, n_ops):
    """Ops generated against our cache (positions continue each sequence); returns (ops, our results)."""
    kv = KVCache(ToyModel(**TINY_GGUF), kv_size=cfg["kv_size"], n_seq_max=cfg["n_seq_max"], unified=cfg["unified"],
                 n_swa=cfg.get("n_swa", 0), swa_type=cfg.get("swa_type", 0))
    n_seq = cfg["n_seq_max"]
    ops, ours = [], []
    for _ in range(n_ops):
        r = rng.random()
        if r < 0.5:
            seqs = rng.choice(n_seq, size=int(rng.integers(1, min(3, n_seq) + 1)), replace=False).tolist()
            pos, rows = [], []
            for s in seqs:
                k = int(rng.integers(1, 6))
                p0 = kv.seq_pos_max(s) + 1
                if rng.random() < 0.05:
                    p0 += 2  # a gap: both sides must reject it
                for j in range(k):
                    row = [s]
                    if cfg["unified"] and n_seq > 1 and rng.random() < 0.1:
                        o = int(rng.integers(0, n_seq))
                        if o != s and kv.seq_pos_max(o) + 1 == p0 + j:
                            row.append(o)
                    rows.append(row)
                    pos.append(p0 + j)
            if rng.random() < 0.3:
                perm = rng.permutation(len(pos))
                pos = [pos[i] for i in perm]
                rows = [rows[i] for i in perm]
            n_ubatch = int(rng.choice([1, 2, 3, 4, 512]))
            use_pos = bool(rng.random() < 0.8)
            op = ["decode", pos, rows, n_ubatch, use_pos]
            res = our_decode(kv, pos, rows, n_ubatch, use_pos)
        else:
            s = int(rng.integers(0, n_seq))
            p0 = int(rng.integers(-1, 20))
            p1 = -1 if rng.random() < 0.4 else p0 + int(rng.integers(0, 10))
            which = rng.choice(["seq_rm", "seq_rm_all", "seq_cp", "seq_keep", "seq_add", "seq_div", "clear"],
                               p=[0.3, 0.05, 0.2, 0.1, 0.2, 0.1, 0.05])
            if which == "seq_rm":
                op, res = ["seq_rm", s, p0, p1], int(kv.seq_rm(s, p0, p1))
            elif which == "seq_rm_all":
                op, res = ["seq_rm", -1, p0, p1], int(kv.seq_rm(-1, p0, p1))
            elif which == "seq_cp":
                d = int(rng.integers(0, n_seq))
                if not cfg["unified"]:
                    p0, p1 = -1, -1
                # llama.cpp's release build counts a copy onto cells that already hold d twice: keep traces
                # to the defined case, where the destination has no cell in the copied range
                if cfg["unified"] and d != s and kv.v_cells[0].find(max(p0, 0), p1 if p1 >= 0 else 2**31 - 1,
                                                                   d).size:
                    kv.seq_rm(d, p0, p1)
                    ops.append(["seq_rm", d, p0, p1])
                    ours.append((1, dump(kv)))
                op, res = ["seq_cp", s, d, p0, p1], None
                kv.seq_cp(s, d, p0, p1)
            elif which == "seq_keep":
                op, res = ["seq_keep", s], None
                kv.seq_keep(s)
            elif which == "seq_add":
                d = int(rng.integers(-8, 9))
                op, res = ["seq_add", s, p0, p1, d], None
                kv.seq_add(s, p0, p1, d)
            elif which == "seq_div":
                d = int(rng.integers(1, 4))
                op, res = ["seq_div", s, p0, p1, d], None
                kv.seq_div(s, p0, p1, d)
            else:
                op, res = ["clear"], None
                kv.clear(True)
        ops.append(op)
        ours.append((res, dump(kv)))
    return ops, ours


CONFIGS = {
    "unified-1": dict(kv_size=32, n_seq_max=1, unified=True),
    "unified-4": dict(kv_size=48, n_seq_max=4, unified=True),
    "streams-3": dict(kv_size=24, n_seq_max=3, unified=False),
    "swa-standard": dict(kv_size=16, n_seq_max=2, unified=True, n_swa=6, swa_type=1),
    "swa-chunked": dict(kv_size=16, n_seq_max=2, unified=True, n_swa=4, swa_type=2),
    "swa-symmetric": dict(kv_size=16, n_seq_max=2, unified=True, n_swa=6, swa_type=3),
    "streams-swa": dict(kv_size=12, n_seq_max=2, unified=False, n_swa=5, swa_type=1),
}
