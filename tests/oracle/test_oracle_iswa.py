"""Differential: random traces on llama.cpp's own llama_kv_cache_iswa and on KVCacheISWA, compared after every step.

llama.cpp's side is kv_oracle_iswa.cpp (built by scripts/build_reference.sh against the
reference's llama.cpp) driven by replay_iswa.py in a subprocess; the model is a tiny Gemma 2 GGUF of our model maker (layers
0 and 2 slide).  Compared after every op: the result (each token's cell in both caches and the ubatch sizes, or the
rejection; removal results; positions), then every cell of both caches -- position, shift, sequences -- and every
head; state ops compare the blobs byte for byte (whole cache, one sequence, the SWA part only) and round trips.
"""
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kvcache_ggml.batch import Batch, BatchAllocator
from kvcache_ggml.cache import MemoryStatus
from kvcache_ggml.cache.iswa import STATE_SEQ_FLAGS_PARTIAL_ONLY, KVCacheISWA
from kvcache_ggml.runtime.gemma import GemmaShape
from kvcache_ggml.runtime.gemma_maker import GemmaSpec, make_gemma_model

from conftest import BUILD_REFERENCE, ORACLE_DIR, ORACLE_PY

pytestmark = pytest.mark.oracle

HERE = Path(__file__).resolve().parent
VOCAB = 64
PARTIAL = STATE_SEQ_FLAGS_PARTIAL_ONLY


@pytest.fixture(scope="session")
def iswa_lib():
    out = ORACLE_DIR / "libkvoracle_iswa.so"
    if not out.exists() or out.stat().st_mtime < (HERE / "kv_oracle_iswa.cpp").stat().st_mtime:
        pytest.skip(f"{out} missing or older than kv_oracle_iswa.cpp: run bash {BUILD_REFERENCE}")
    return out


def our_decode(mem, pos, seqs, n_ubatch, use_pos):
    ba = BatchAllocator(1)
    try:
        ba.init(Batch(token=np.full(len(pos), 3), pos=pos if use_pos else None, seq_id=seqs,
                      logits=[0] * (len(pos) - 1) + [1]), VOCAB, mem, 64, mem.n_seq_max, False)
    except ValueError:
        return -1
    ctx = mem.init_batch(ba, n_ubatch)
    if ctx.get_status() != MemoryStatus.SUCCESS:
        return -2
    out = {"base": [], "swa": [], "sizes": []}
    while True:
        ctx.apply()
        for which, kc in (("base", ctx.get_base()), ("swa", ctx.get_swa())):
            si, size = kc.get_sinfo(), kc.kv.get_size()
            for s, idx in zip(si.strm, si.idxs):
                out[which] += (s * size + idx).tolist()
        out["sizes"].append(ctx.get_ubatch().n_tokens)
        if not ctx.next():
            break
    return out


def dump(kv):
    return {"pos": [c.pos_array.tolist() for c in kv.v_cells],
            "shift": [np.where(c.pos_array < 0, 0, c.shift_array).tolist() for c in kv.v_cells],
            "seq": [c.seq_bits.T.tolist() for c in kv.v_cells], "heads": list(kv.v_heads)}


def dump_both(mem):
    return {"base": dump(mem.get_base()), "swa": dump(mem.get_swa())}


def _decode_op(rng, mem, cfg):
    n_seq = cfg["n_seq_max"]
    seqs = rng.choice(n_seq, size=int(rng.integers(1, min(3, n_seq) + 1)), replace=False).tolist()
    pos, rows = [], []
    for s in seqs:
        k = int(rng.choice([1, 2, 3, 5, 8, 40, 90], p=[0.25, 0.15, 0.15, 0.15, 0.1, 0.12, 0.08]))
        p0 = mem.seq_pos_max(s) + 1 + (2 if rng.random() < 0.03 else 0)   # now and then a gap: both refuse
        for j in range(k):
            row = [s]
            if cfg["unified"] and n_seq > 1 and rng.random() < 0.1:
                o = int(rng.integers(0, n_seq))
                if o != s and mem.seq_pos_max(o) + 1 == p0 + j:
                    row.append(o)
            rows.append(row)
            pos.append(p0 + j)
    if rng.random() < 0.3:
        perm = rng.permutation(len(pos))
        pos, rows = [pos[i] for i in perm], [rows[i] for i in perm]
    op = ["decode", pos, rows, int(rng.choice([1, 3, 8, 32, 512])), bool(rng.random() < 0.8)]
    return op, our_decode(mem, *op[1:])


def _seq_op(rng, mem, cfg, ops, ours):
    n_seq = cfg["n_seq_max"]
    s = int(rng.integers(0, n_seq))
    p0 = int(rng.integers(-1, 120))
    p1 = -1 if rng.random() < 0.4 else p0 + int(rng.integers(0, 60))
    which = rng.choice(["seq_rm", "seq_cp", "seq_keep", "seq_add", "seq_div", "clear", "state", "state_rt"],
                       p=[0.3, 0.15, 0.05, 0.2, 0.05, 0.03, 0.11, 0.11])
    if which == "seq_rm":
        s = -1 if rng.random() < 0.1 else s
        return ["seq_rm", s, p0, p1], int(mem.seq_rm(s, p0, p1))
    if which == "seq_cp":
        d = int(rng.integers(0, n_seq))
        if not cfg["unified"]:
            p0, p1 = -1, -1
        # llama.cpp's release build counts a copy onto cells that already hold d twice: keep to the defined case
        hi = p1 if p1 >= 0 else 2**31 - 1
        if cfg["unified"] and d != s and any(kv.v_cells[0].find(max(p0, 0), hi, d).size
                                             for kv in (mem.get_base(), mem.get_swa())):
            ops.append(["seq_rm", d, p0, p1])
            ours.append((int(mem.seq_rm(d, p0, p1)), dump_both(mem)))
        mem.seq_cp(s, d, p0, p1)
        return ["seq_cp", s, d, p0, p1], None
    if which == "seq_keep":
        mem.seq_keep(s)
        return ["seq_keep", s], None
    if which in ("seq_add", "seq_div"):
        d = int(rng.integers(-30, 31)) if which == "seq_add" else int(rng.integers(1, 4))
        getattr(mem, which)(s, p0, p1, d)
        return [which, s, p0, p1, d], None
    if which == "clear":
        mem.clear(True)
        return ["clear"], None
    flags = PARTIAL if rng.random() < 0.4 else 0
    seq = -1 if (rng.random() < 0.3 and cfg["unified"]) else s  # multi-stream whole restores differ by design
    if which == "state":
        return ["state", seq, flags], mem.state_save(seq, flags).hex()
    blob = mem.state_save(seq, flags)
    return ["state_rt", seq, flags], mem.state_load(blob, seq, flags)


def make_trace(rng, mem, cfg, n_ops):
    ops, ours = [], []
    for _ in range(n_ops):
        if rng.random() < cfg.get("p_decode", 0.5):
            op, res = _decode_op(rng, mem, cfg)
        else:
            op, res = _seq_op(rng, mem, cfg, ops, ours)
        ops.append(op)
        ours.append((res, dump_both(mem)))
    return ops, ours


CONFIGS = {
    "unified-1": dict(n_swa=8, kv_size=512, n_seq_max=1, unified=True, n_ubatch=16),
    "unified-3": dict(n_swa=70, kv_size=512, n_seq_max=3, unified=True, n_ubatch=8),
    # mostly decodes: three windows fill the SWA cache, and a long ubatch fits the base cache but not the SWA one
    "unified-3-busy": dict(n_swa=70, kv_size=1024, n_seq_max=3, unified=True, n_ubatch=8, p_decode=0.9),
    "streams-2": dict(n_swa=20, kv_size=512, n_seq_max=2, unified=False, n_ubatch=16),
    "swa-full-2": dict(n_swa=12, kv_size=256, n_seq_max=2, unified=True, n_ubatch=16, swa_full=True),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("seed", range(4))
def test_random_iswa_trace_matches_llama_cpp(name, seed, iswa_lib, tmp_path):
    cfg = CONFIGS[name]
    model = make_gemma_model(tmp_path / "g2.gguf", GemmaSpec(arch="gemma2", layers=4, n_swa=cfg["n_swa"],
                                                             vocab=VOCAB))
    cache = {k: v for k, v in cfg.items() if k not in ("n_swa", "p_decode")}
    mem = KVCacheISWA(GemmaShape(model), **cache)
    rng = np.random.default_rng(1000 * seed + sum(name.encode()))
    ops, ours = make_trace(rng, mem, cfg, 60)
    spec = {"lib": str(iswa_lib), "model": str(model), "cache": cache, "ops": ops}
    p = subprocess.run([str(ORACLE_PY), str(HERE / "replay_iswa.py")], input=json.dumps(spec), capture_output=True,
                       text=True, timeout=600)
    theirs = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert len(theirs) == len(ops), f"oracle stopped early (rc {p.returncode}): {p.stderr[-2000:]}"
    for k, (op, (res, cells), t) in enumerate(zip(ops, ours, theirs)):
        where = f"step {k}: {op[:1] + op[1:][:4]}"
        if op[0] != "seq_cp":
            assert res == t["r"], where
        assert cells["base"] == t["base"], where + " (base cache)"
        assert cells["swa"] == t["swa"], where + " (SWA cache)"
    mem.close()
