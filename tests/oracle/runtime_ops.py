"""Shared by the runtime oracle tests (llama and Gemma): our side of the runner's protocol, and the comparison of
two state blobs.  Test modules import this, never each other."""
from __future__ import annotations

import base64

import numpy as np

from kvcache_ggml.batch import Batch
from kvcache_ggml.runtime import Context, DecodeError
from kvcache_ggml.cache.state import parse_state

__all__ = ["apply_ops", "compare_state"]


def apply_ops(ctx: Context, ops: list[dict]) -> list[dict]:
    """Our side of the runner's protocol."""
    out = []
    for op in ops:
        kind = op["op"]
        ans: dict = {"op": kind}
        if kind == "decode":
            n = len(op["tokens"])
            width = max(len(s) for s in op["seq"])
            seq = np.full((n, width), -1, np.int32)
            for i, s in enumerate(op["seq"]):
                seq[i, :len(s)] = s
            try:
                lg = ctx.decode(Batch(token=np.array(op["tokens"], np.int32), pos=np.array(op["pos"], np.int32),
                                      seq_id=seq, logits=np.array(op["logits"], np.int8)))
                ans.update(ret=0, logits=lg)
            except DecodeError as e:
                ans.update(ret=e.code, logits=np.zeros((0, ctx.n_vocab), np.float32))
        elif kind in ("seq_rm", "seq_cp", "seq_keep", "seq_add", "seq_div"):
            ans["ret"] = getattr(ctx, "memory_" + kind)(*op["args"])
        elif kind == "pos_max":
            ans["ret"] = ctx.memory_seq_pos_max(op["seq"])
        elif kind == "pos_min":
            ans["ret"] = ctx.memory_seq_pos_min(op["seq"])
        elif kind == "state_seq_get":
            ans["blob"] = ctx.state_seq_get_data(op["seq"])
        elif kind == "state_seq_set":
            ans["ret"] = ctx.state_seq_set_data(base64.b64decode(op["blob"]), op["seq"])
        else:
            raise ValueError(kind)
        out.append(ans)
    return out


def _data_ranges(info):
    """(offset, nbytes, type) of every K/V data region of a parsed state."""
    out = []
    for st in info.streams:
        for L in st.layers:
            out.append((L.k_offset, L.k_nbytes, L.k_type))
            out.append((L.v_offset, L.v_nbytes, L.v_type))
    return out


def compare_state(ours: bytes, theirs: bytes, tol=0.0):
    """Same length and metadata (every byte outside the K/V data), K/V data within tol (0: byte for byte)."""
    assert len(ours) == len(theirs), f"state of {len(ours)} bytes, llama.cpp {len(theirs)}"
    a, b = parse_state(ours), parse_state(theirs)
    assert a.to_dict() == b.to_dict()
    meta = np.ones(len(ours), bool)
    ua, ub = np.frombuffer(ours, np.uint8), np.frombuffer(theirs, np.uint8)
    for off, n, t in _data_ranges(a):
        meta[off:off + n] = False
        dt = {0: np.float32, 1: np.float16}[t]
        xa = ua[off:off + n].view(dt).astype(np.float64)
        xb = ub[off:off + n].view(dt).astype(np.float64)
        if xb.size:
            assert np.abs(xa - xb).max() <= tol * max(np.abs(xb).max(), 1.0), f"K/V data at offset {off} differ"
    assert np.array_equal(ua[meta], ub[meta]), "state metadata differ"
