"""Golden traces: llama.cpp's own KV cache, recorded once, replayed on KVCache in every default run.

``tests/data/golden_traces.npz`` holds random traces that ``tests/oracle/record_golden.py`` ran on llama.cpp 0.3.17's
``llama_kv_cache`` (the oracle; its module docstring spells out the format).  Each trace is replayed here through
the public API only (``KVCache``, ``Batch``, ``BatchAllocator``, ``init_batch``/``apply``, ``seq_*``,
``state_save``, ``KVCacheContext.kq_mask``, ``k_shift``), and after every step everything is compared with what
llama.cpp did: the operation's result (the cell of every token, the ubatch sizes, or the rejection), every cell's
position, pending shift and sequence bits, the heads, ``seq_pos_min/max``, the kq mask of every ubatch bit for bit,
and the state blobs (whole cache and per sequence, by hash; the whole blob after the last step byte for byte).
An operation that llama.cpp aborts on must raise here and leave the cache as it was.

Two deliberate deviations (the closing notes of issues 2-8) are kept out of the traces or accepted as such: a copy
onto cells that already hold the destination is never recorded (the recorder removes the destination first, as the
oracle suite does), and a ubatch larger than the cache raises ValueError here where llama.cpp fails the prepare.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from kvcache_ggml.batch import Batch, BatchAllocator
from kvcache_ggml.cache import KVCache, MemoryStatus
from kvcache_ggml.hparams import HParams
from kvcache_ggml.cache.state import parse_state

DATA = Path(__file__).with_name("data") / "golden_traces.npz"
NEG_INF_BITS = np.uint32(0xFF800000)
HASH_BYTES = 8


@dataclass(slots=True)
class Trace:
    """One recorded trace and its slices of the file's arrays."""

    name: str                 # "<configuration>/seed<k>"
    config: dict              # the cache's constructor arguments
    state_seqs: list[int]     # sequences whose state and seq_pos_min/max are recorded
    ops: list[list]           # every operation (the aborting one last, when there is one)
    results: list             # llama.cpp's result of each recorded step
    abort: dict | None        # {"step", "op", "rc", ...}: llama.cpp aborted on ops[step]
    pos: np.ndarray           # int32 [n_steps, n_stream, kv_size]
    shift: np.ndarray         # int32 [n_steps, n_stream, kv_size]
    seq: np.ndarray           # uint64 [n_steps, n_stream, kv_size, 4]
    heads: np.ndarray         # uint32 [n_steps, n_stream]
    minmax: np.ndarray        # int32 [n_steps, len(state_seqs), 2]
    hashes: np.ndarray        # uint8 [n_steps, 1 + len(state_seqs), 8]
    masks: list[np.ndarray]   # bool [n_stream, n_tokens per stream, n_kv] (True: -inf) of every ubatch, in order
    final: bytes              # whole-cache state after the last step (b"" when llama.cpp aborted mid-trace)


class TinyLlama:
    """The model the oracle loads (make_tiny_llama.py); only its hyper-parameters matter to the cache."""

    def __init__(self, m: dict) -> None:
        self.hparams = HParams.simple(n_layer=m["n_layer"], n_embd_head=m["n_embd_head"], n_head=m["n_head"],
                                      n_head_kv=m["n_head_kv"], n_vocab=m["n_vocab"])

    def dev_layer(self, il: int) -> None:
        return None


# name -> (dtype, shape after the first axis) of each array of the file
ARRAYS = {"meta": (np.uint8, ()), "pos": (np.int32, ()), "shift": (np.int32, ()), "seq": (np.uint64, (4,)),
          "heads": (np.uint32, ()), "minmax": (np.int32, (2,)), "state_hash": (np.uint8, (HASH_BYTES,)),
          "mask_shape": (np.int32, (3,)), "mask_bits": (np.uint8, ()), "final_state": (np.uint8, ()),
          "final_len": (np.int64, ())}


@lru_cache(maxsize=1)
def load() -> tuple[dict, list[Trace]]:
    """The file's metadata and its traces, every array checked against the sizes the metadata implies."""
    with np.load(DATA) as z:
        missing = sorted(set(ARRAYS) - set(z.files))
        assert not missing, f"{DATA}: arrays {missing} missing (has {z.files})"
        a = {k: z[k] for k in ARRAYS}
    for k, (dtype, tail) in ARRAYS.items():
        assert a[k].dtype == dtype and a[k].shape[1:] == tail, \
            f"{DATA}: {k} is {a[k].dtype} {a[k].shape}, expected {np.dtype(dtype)} [*{', ' if tail else ''}" \
            f"{', '.join(map(str, tail))}]"
    assert len(a["pos"]) == len(a["shift"]) == len(a["seq"]), \
        f"{DATA}: pos, shift, seq have {len(a['pos'])}, {len(a['shift'])}, {len(a['seq'])} cells"
    meta = json.loads(a["meta"].tobytes())
    assert meta.get("format") == 1, f"{DATA}: format {meta.get('format')!r}, expected 1"
    off = dict.fromkeys(("pos", "heads", "minmax", "state_hash", "mask_shape", "mask_bits", "final_len",
                         "final_state"), 0)

    def take(t: dict, key: str, count: int, shape: tuple = (-1,)) -> np.ndarray:
        """The next ``count`` entries of ``key``, reshaped to ``shape`` (then the array's own tail)."""
        got = a[key][off[key]:off[key] + count]
        assert len(got) == count, f"{DATA}: trace {t['name']}: {key} has {len(got)} entries left, expected {count}"
        off[key] += count
        return got.reshape(shape + got.shape[1:])

    traces = []
    for t in meta["traces"]:
        c = t["config"]
        n = len(t["results"])
        ns = 1 if c["unified"] else c["n_seq_max"]
        nq = len(t["state_seqs"])
        at = off["pos"]
        take(t, "pos", n * ns * c["kv_size"])
        cells = slice(at, off["pos"])
        shape = (n, ns, c["kv_size"])
        # stored as differences from the previous step (the first from the empty cache)
        pos = np.cumsum(a["pos"][cells].reshape(shape), axis=0, dtype=np.int32) - 1
        shift = np.cumsum(a["shift"][cells].reshape(shape), axis=0, dtype=np.int32)
        seq = np.bitwise_xor.accumulate(a["seq"][cells].reshape(shape + (4,)), axis=0)
        masks = []
        for mshape in take(t, "mask_shape", t["n_masks"]):
            size = int(np.prod(mshape))
            bits = take(t, "mask_bits", (size + 7) // 8)
            masks.append(np.unpackbits(bits, count=size).astype(bool).reshape(mshape))
        flen = int(take(t, "final_len", 1)[0])
        traces.append(Trace(
            name=t["name"], config=c, state_seqs=t["state_seqs"], ops=t["ops"], results=t["results"],
            abort=t["abort"], pos=pos, shift=shift, seq=seq, heads=take(t, "heads", n * ns, (n, ns)),
            minmax=take(t, "minmax", n * nq, (n, nq)), hashes=take(t, "state_hash", n * (1 + nq), (n, 1 + nq)),
            masks=masks, final=take(t, "final_state", flen).tobytes()))
    for key, used in off.items():
        assert used == len(a[key]), f"{DATA}: {key} has {len(a[key])} entries, the traces use {used}"
    return meta, traces


def _trace_names() -> list[str]:
    return [t.name for t in load()[1]] if DATA.exists() else []


# ================================================================================================ replay

def _op_text(op: list) -> str:
    s = json.dumps(op)
    return s if len(s) <= 160 else s[:150] + " ...]"


def _decode(kv: KVCache, pos: list, rows: list, n_ubatch: int, use_pos: bool, dims: tuple[int, int, int]) -> tuple:
    """(result as the oracle reports it, masks of the ubatches); result "too big" when a ubatch larger than the
    cache raised (a deliberate deviation: llama.cpp fails the prepare, -2)."""
    n = len(pos)
    ba = BatchAllocator(1)
    try:
        ba.init(Batch(token=np.full(n, 3), pos=pos if use_pos else None, seq_id=rows,
                      logits=[0] * (n - 1) + [1]), dims[0], kv, dims[1], dims[2], False)
    except ValueError:
        return -1, []
    try:
        ctx = kv.init_batch(ba, n_ubatch)
    except ValueError:
        return "too big", []
    if ctx.get_status() != MemoryStatus.SUCCESS:
        return -2, []
    cells, sizes, masks = [], [], []
    while True:
        ctx.apply()
        si = ctx.get_sinfo()
        for s, idx in zip(si.strm, si.idxs):
            cells += (s * kv.get_size() + idx).tolist()
        sizes.append(ctx.get_ubatch().n_tokens)
        masks.append(ctx.kq_mask(causal=True))
        if not ctx.next():
            break
    return {"cells": cells, "sizes": sizes}, masks


def _apply(kv: KVCache, op: list, dims: tuple[int, int, int]) -> tuple:
    """Run ``op``; (result as the oracle reports it, kq masks).  ``dims``: n_vocab, n_embd, n_seq_max for
    ``BatchAllocator.init``, as llama.cpp's decode passes them."""
    name, args = op[0], op[1:]
    if name == "decode":
        return _decode(kv, *args, dims=dims)
    if name == "clear":
        kv.clear(True)
        return None, []
    r = getattr(kv, name)(*args)
    return (bool(r) if name == "seq_rm" else r), []


def _snapshot(kv: KVCache) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
    """Every cell's position, shift (0 when empty) and sequence bits, per stream, and the heads."""
    pos = np.stack([c.pos_array for c in kv.v_cells])                                 # [n_stream, kv_size]
    shift = np.stack([np.where(c.pos_array < 0, 0, c.shift_array) for c in kv.v_cells])
    seq = np.stack([c.seq_bits.T for c in kv.v_cells])                                # [n_stream, kv_size, 4]
    return pos, shift, seq, list(kv.v_heads)


def _first_cell(where: str, what: str, ours: np.ndarray, theirs: np.ndarray) -> None:
    if np.array_equal(ours, theirs):
        return
    diff = np.argwhere(ours != theirs)[0]
    s, i = int(diff[0]), int(diff[1])
    raise AssertionError(f"{where}: stream {s} cell {i}: {what} {ours[s, i]}, llama.cpp {theirs[s, i]}")


def _seq_text(bits: np.ndarray) -> str:
    ids = [w * 64 + b for w in range(bits.shape[-1]) for b in range(64) if int(bits[w]) >> b & 1]
    return f"sequences {ids}"


def _check_cells(where: str, kv: KVCache, t: Trace, k: int) -> None:
    pos, shift, seq, heads = _snapshot(kv)
    assert pos.shape == t.pos[k].shape, f"{where}: cells {pos.shape}, llama.cpp {t.pos[k].shape}"
    _first_cell(where, "position", pos, t.pos[k])
    if not np.array_equal(seq, t.seq[k]):
        s, i = (int(x) for x in np.argwhere((seq != t.seq[k]).any(axis=2))[0])
        raise AssertionError(f"{where}: stream {s} cell {i} (position {pos[s, i]}): {_seq_text(seq[s, i])}, "
                             f"llama.cpp {_seq_text(t.seq[k][s, i])}")
    _first_cell(where, "shift", shift, t.shift[k])
    assert heads == t.heads[k].tolist(), f"{where}: heads {heads}, llama.cpp {t.heads[k].tolist()}"
    k_shift = kv.k_shift().reshape(pos.shape)
    _first_cell(where, "k_shift input", k_shift, t.shift[k])
    for q, s in enumerate(t.state_seqs):
        mm = [kv.seq_pos_min(s), kv.seq_pos_max(s)]
        assert mm == t.minmax[k, q].tolist(), \
            f"{where}: sequence {s}: seq_pos_min/max {mm}, llama.cpp {t.minmax[k, q].tolist()}"


def _check_states(where: str, kv: KVCache, t: Trace, k: int) -> None:
    for q, s in enumerate([-1] + t.state_seqs):
        blob = kv.state_save(s)
        h = hashlib.sha256(blob).digest()[:HASH_BYTES]
        if h != t.hashes[k, q].tobytes():
            what = "the whole cache" if s < 0 else f"sequence {s}"
            raise AssertionError(f"{where}: state of {what} differs from llama.cpp's (sha256 {h.hex()} vs "
                                 f"{t.hashes[k, q].tobytes().hex()}); ours: {parse_state(blob).to_dict()}")


def _check_masks(where: str, ours: list[np.ndarray], theirs: list[np.ndarray]) -> None:
    assert len(ours) == len(theirs), f"{where}: {len(ours)} masks, llama.cpp {len(theirs)}"
    for u, (m, ref) in enumerate(zip(ours, theirs)):
        assert m.shape == ref.shape, \
            f"{where}, ubatch {u}: mask [n_stream, n_tokens, n_kv] {list(m.shape)}, llama.cpp {list(ref.shape)}"
        bits = m.view(np.uint32)
        want = np.where(ref, NEG_INF_BITS, np.uint32(0))
        if not np.array_equal(bits, want):
            s, i, j = (int(x) for x in np.argwhere(bits != want)[0])
            raise AssertionError(f"{where}, ubatch {u}: mask stream {s}, token {i}, cell {j}: {m[s, i, j]!r} "
                                 f"(bits {int(bits[s, i, j]):#010x}), llama.cpp {'-inf' if ref[s, i, j] else '0.0'}")


def replay(t: Trace, model: dict) -> int:
    """Replay ``t`` on a fresh KVCache, comparing after every step; returns the number of steps."""
    kv = KVCache(TinyLlama(model), **t.config)
    dims = (model["n_vocab"], model["n_head"] * model["n_embd_head"], t.config["n_seq_max"])
    mask_at = 0
    for k, (op, want) in enumerate(zip(t.ops, t.results)):
        where = f"trace {t.name}, step {k} {_op_text(op)}"
        got, masks = _apply(kv, op, dims)
        if got == "too big":
            n, n_ubatch = len(op[1]), op[3]
            assert want == -2 and min(n, n_ubatch) > kv.get_size(), \
                f"{where}: init_batch raised ValueError (a ubatch larger than the cache), llama.cpp returned {want}"
        elif op[0] == "decode" and isinstance(want, dict) and isinstance(got, dict):
            for key in ("sizes", "cells"):
                if got[key] != want[key]:
                    i = next(i for i, (a, b) in enumerate(zip(got[key] + [None], want[key] + [None])) if a != b)
                    raise AssertionError(f"{where}: {key}[{i}] = {(got[key] + [None])[i]}, llama.cpp "
                                         f"{(want[key] + [None])[i]} (ours {got[key]}, llama.cpp {want[key]})")
        else:
            assert got == want, f"{where}: result {got!r}, llama.cpp {want!r}"
        n_masks = len(want["sizes"]) if isinstance(want, dict) else 0
        _check_masks(where, masks, t.masks[mask_at:mask_at + n_masks])
        mask_at += n_masks
        _check_cells(where, kv, t, k)
        _check_states(where, kv, t, k)
    assert mask_at == len(t.masks), f"trace {t.name}: {mask_at} masks replayed, {len(t.masks)} recorded"
    if t.final:
        blob = kv.state_save(-1)
        assert blob == t.final, f"trace {t.name}: final whole-cache state differs from llama.cpp's: ours " \
                                f"{parse_state(blob).to_dict()}, llama.cpp {parse_state(t.final).to_dict()}"
    if t.abort is not None:
        op = t.ops[t.abort["step"]]
        where = f"trace {t.name}, step {t.abort['step']} {_op_text(op)}"
        before = _snapshot(kv)
        state = kv.state_save(-1)
        with pytest.raises((ValueError, RuntimeError)):
            _apply(kv, op, dims)
            raise AssertionError(f"{where}: llama.cpp aborts on this operation (rc {t.abort['rc']}), ours did "
                                 "not raise")
        after = _snapshot(kv)
        for a, b in zip(before[:3], after[:3]):
            assert np.array_equal(a, b), f"{where}: the failed call changed the cells"
        assert before[3] == after[3] and kv.state_save(-1) == state, f"{where}: the failed call changed the cache"
    return len(t.results)


# ================================================================================================ tests

pytestmark = pytest.mark.skipif(not DATA.exists(), reason=f"{DATA} missing: run tests/oracle/record_golden.py")


@pytest.mark.parametrize("name", _trace_names())
def test_trace_matches_llama_cpp(name):
    meta, traces = load()
    t = next(t for t in traces if t.name == name)
    assert replay(t, meta["model"]) == len(t.results) > 0


def test_recording_covers_every_configuration():
    """The file is what the recorder promises: llama.cpp 0.3.17, and every configuration and event kind."""
    meta, traces = load()
    assert meta["llama_cpp"]["llama_cpp_python"] == "0.3.17"
    cfgs = [t.config for t in traces]
    assert {c["unified"] for c in cfgs} == {True, False}
    assert {(c["swa_type"], c["unified"]) for c in cfgs} >= {(s, u) for s in (0, 1, 2, 3) for u in (True, False)}
    assert {c["v_trans"] for c in cfgs} == {True, False}
    assert {"q8_0", "q4_0", "f32", "f16"} <= {c["type_k"] for c in cfgs} | {c["type_v"] for c in cfgs}
    assert any(c["n_pad"] > 256 for c in cfgs) and any(c["kv_size"] > 256 for c in cfgs)
    assert any(c["n_seq_max"] > 64 for c in cfgs)
    decodes = [(op, r) for t in traces for op, r in zip(t.ops, t.results) if op[0] == "decode"]
    ok = [(op, r) for op, r in decodes if isinstance(r, dict)]
    assert any(not op[4] for op, _ in ok), "no decode with positions filled by the allocator"
    assert any(max(map(len, op[2])) > 1 for op, _ in ok), "no decode with tokens shared by sequences"
    assert any(len(r["sizes"]) > 1 for _, r in ok), "no decode split into several ubatches"
    assert {-1, -2} <= {r for _, r in decodes if isinstance(r, int)}, "no rejected or failed batch"
    assert any(r == -2 and min(len(op[1]), op[3]) > c["kv_size"] for t in traces for c in [t.config]
               for op, r in zip(t.ops, t.results) if op[0] == "decode"), "no batch too big for the cache"
    names = {op[0] for t in traces for op in t.ops}
    assert names >= {"decode", "seq_rm", "seq_cp", "seq_keep", "seq_add", "seq_div", "clear"}
    assert any(t.shift.any() for t in traces), "no pending K-shift"
    assert sum(t.abort is not None for t in traces) >= 5
