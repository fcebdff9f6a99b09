"""Differential: the state blobs of llama.cpp's own KV cache and of KVCache, and llama.cpp exchanging sequence
states with this library.

1. Random traces run on llama.cpp's ``llama_kv_cache`` (the oracle) and on KVCache; at checkpoints both write
   their whole state and every sequence's state, which must be byte-identical.  Neither side writes tensor data
   (the oracle's decode places cells only and both caches start zeroed), so this compares the cells and the layout.
2. llama-cpp-python (the oracle's venv) runs tiny.gguf in a real ``llama_context``: its
   ``llama_state_seq_get_data`` bytes (with the K/V its decode computed) restore here to the same cells and write
   back unchanged, its sequence state file loads here, and ours load there (``llama_state_seq_set_data``,
   ``llama_state_seq_load_file``) to the same ``llama_memory_seq_pos_min/max``; its whole-context state (the arch
   string, then the whole cache) restores here completely.
"""
import json
import os
import subprocess
import textwrap

import numpy as np
import pytest

from kvcache_ggml import ggml as G
from kvcache_ggml.batch import Batch, BatchAllocator
from kvcache_ggml.cache import KVCache, MemoryStatus
from kvcache_ggml.cache.state import load_seq_file, parse_state, save_seq_file

from conftest import ORACLE_DIR, ORACLE_PY, ORACLE_SRC
from helpers import TINY_GGUF, ToyModel

pytestmark = pytest.mark.oracle


def run_py(code: str, payload: dict, timeout: int = 300) -> list[dict]:
    """Run ``code`` under the oracle's interpreter with ``payload`` on stdin; its JSON lines."""
    env = dict(os.environ, ORACLE_DIR=str(ORACLE_DIR), KVORACLE_SRC=str(ORACLE_SRC))
    p = subprocess.run([str(ORACLE_PY), "-c", code], input=json.dumps(payload), capture_output=True, text=True,
                       env=env, timeout=timeout, cwd=str(ORACLE_DIR))
    out = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert p.returncode == 0, f"oracle process failed ({p.returncode}): {p.stderr[-3000:]}"
    return out


# ================================================================================================ 1. random traces

REPLAY = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, os.environ["KVORACLE_SRC"])
    import kvoracle
    spec = json.load(sys.stdin)
    c = spec["cache"]
    oc = kvoracle.OracleCache(os.path.join(os.environ["ORACLE_DIR"], "tiny.gguf"), c["type_k"], c["type_v"],
                              c["v_trans"], c["unified"], c["kv_size"], c["n_seq_max"], 1, c.get("n_swa", 0),
                              c.get("swa_type", 0))
    for op in spec["ops"]:
        name, args = op[0], op[1:]
        if name == "state":
            print(json.dumps({str(s): oc.state(s).hex() for s in [-1] + list(range(c["n_seq_max"]))}), flush=True)
        elif name == "decode":
            oc.decode(*args)
        elif name == "clear":
            oc.clear()
        else:
            getattr(oc, name)(*args)
    oc.close()
""")


def our_decode(kv, pos, seqs, n_ubatch):
    ba = BatchAllocator(1)
    try:
        ba.init(Batch(token=np.full(len(pos), 3), pos=pos, seq_id=seqs), 64, kv, 64, kv.n_seq_max, False)
        ctx = kv.init_batch(ba, n_ubatch)
    except ValueError:
        return
    if ctx.get_status() != MemoryStatus.SUCCESS:
        return
    while True:
        ctx.apply()
        if not ctx.next():
            break


def states(kv):
    return {str(s): kv.state_save(s).hex() for s in [-1] + list(range(kv.n_seq_max))}


def make_trace(rng, cfg, n_ops, every):
    """Ops generated against our cache, with a "state" checkpoint every ``every`` ops; (ops, our states)."""
    kv = KVCache(ToyModel(**TINY_GGUF), kv_size=cfg["kv_size"], n_seq_max=cfg["n_seq_max"], unified=cfg["unified"],
                 v_trans=cfg["v_trans"], type_k=cfg["type_k"], type_v=cfg["type_v"], n_swa=cfg.get("n_swa", 0),
                 swa_type=cfg.get("swa_type", 0))
    n_seq = cfg["n_seq_max"]
    ops, ours = [], []
    for k in range(n_ops):
        r = rng.random()
        s = int(rng.integers(0, n_seq))
        if r < 0.55:
            seqs = [s]
            if cfg["unified"] and n_seq > 1 and rng.random() < 0.3:
                seqs = sorted(rng.choice(n_seq, size=2, replace=False).tolist())
            pos, rows = [], []
            for q in seqs:
                p0 = kv.seq_pos_max(q) + 1
                n = int(rng.integers(1, 7))
                pos += list(range(p0, p0 + n))
                rows += [[q]] * n
            op = ["decode", pos, rows, int(rng.choice([2, 3, 512])), True]
            our_decode(kv, pos, rows, op[3])
        elif r < 0.75:
            p0 = int(rng.integers(-1, 12))
            p1 = -1 if rng.random() < 0.3 else p0 + int(rng.integers(1, 6))
            op = ["seq_rm", s, p0, p1]
            kv.seq_rm(s, p0, p1)
        elif r < 0.85 and n_seq > 1:
            d = int(rng.integers(0, n_seq))
            if d != s:
                ops.append(["seq_rm", d, -1, -1])
                kv.seq_rm(d, -1, -1)
            op = ["seq_cp", s, d, -1, -1]
            kv.seq_cp(s, d, -1, -1)
        elif r < 0.92:
            delta = int(rng.integers(-3, 4))
            op = ["seq_add", s, 0, -1, delta]
            kv.seq_add(s, 0, -1, delta)
        elif r < 0.97:
            op = ["seq_keep", s]
            kv.seq_keep(s)
        else:
            op = ["clear"]
            kv.clear(True)
        ops.append(op)
        if (k + 1) % every == 0 or k == n_ops - 1:
            ops.append(["state"])
            ours.append(states(kv))
    return ops, ours


TRACE_CONFIGS = {
    "unified-1-trans-f16": dict(kv_size=32, n_seq_max=1, unified=True, v_trans=True, type_k="f16", type_v="f16"),
    "unified-4-trans-f16": dict(kv_size=48, n_seq_max=4, unified=True, v_trans=True, type_k="f16", type_v="f16"),
    "unified-4-rows-f32": dict(kv_size=48, n_seq_max=4, unified=True, v_trans=False, type_k="f32", type_v="f32"),
    "unified-3-rows-q8": dict(kv_size=40, n_seq_max=3, unified=True, v_trans=False, type_k="q8_0", type_v="q8_0"),
    "unified-3-trans-q8k": dict(kv_size=40, n_seq_max=3, unified=True, v_trans=True, type_k="q8_0", type_v="f16"),
    "streams-3-trans-f16": dict(kv_size=24, n_seq_max=3, unified=False, v_trans=True, type_k="f16", type_v="f16"),
    "streams-3-rows-q8": dict(kv_size=24, n_seq_max=3, unified=False, v_trans=False, type_k="q8_0",
                              type_v="q8_0"),
    "swa-unified-2": dict(kv_size=16, n_seq_max=2, unified=True, v_trans=True, type_k="f16", type_v="f16",
                          n_swa=6, swa_type=1),
}


@pytest.mark.parametrize("name", sorted(TRACE_CONFIGS))
@pytest.mark.parametrize("seed", range(3))
def test_state_blobs_match_llama_cpp(name, seed):
    cfg = TRACE_CONFIGS[name]
    rng = np.random.default_rng(7000 + 100 * seed + sum(name.encode()))
    ops, ours = make_trace(rng, cfg, 48, 8)
    theirs = run_py(REPLAY, {"cache": cfg, "ops": ops})
    assert len(theirs) == len(ours)
    for k, (a, b) in enumerate(zip(ours, theirs)):
        for s in a:
            assert a[s] == b[s], f"checkpoint {k}, state of sequence {s}: {parse_state(bytes.fromhex(b[s]))}"


# ================================================================================================ 2. llama-cpp-python

LLAMA = textwrap.dedent("""
    import ctypes, json, os, sys
    import llama_cpp as L
    spec = json.load(sys.stdin)
    L.llama_backend_init()
    model = L.llama_model_load_from_file(os.path.join(os.environ["ORACLE_DIR"], "tiny.gguf").encode(),
                                         L.llama_model_default_params())
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 256, 64, 64, 2
    cp.kv_unified = spec["unified"]
    cp.flash_attn_type = 1 if spec["flash_attn"] else 0      # LLAMA_FLASH_ATTN_TYPE_ENABLED / _DISABLED
    ctx = L.llama_init_from_model(model, cp)
    mem = L.llama_get_memory(ctx)

    def decode(seq, toks, p0):
        b = L.llama_batch_init(len(toks), 0, 1)
        b.n_tokens = len(toks)
        for i, t in enumerate(toks):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, p0 + i, 1, int(i == len(toks) - 1)
            b.seq_id[i][0] = seq
        r = L.llama_decode(ctx, b)
        L.llama_batch_free(b)
        assert r == 0, r

    def get(seq):
        n = L.llama_state_seq_get_size(ctx, seq)
        buf = (ctypes.c_uint8 * n)()
        assert L.llama_state_seq_get_data(ctx, buf, n, seq) == n
        return bytes(buf).hex()

    def pos():
        return [[L.llama_memory_seq_pos_min(mem, s), L.llama_memory_seq_pos_max(mem, s)] for s in (0, 1)]

    toks0, toks1 = spec["tokens0"], spec["tokens1"]
    decode(0, toks0, 0)
    decode(1, toks1, 0)
    out = {"pos_before": pos(), "seq0": get(0), "seq1": get(1)}
    arr = (L.llama_token * len(toks0))(*toks0)
    out["file_size"] = L.llama_state_seq_save_file(ctx, spec["their_file"].encode(), 0, arr, len(toks0))
    # ours: the blob into sequence 0, the file into sequence 1
    ours = bytes.fromhex(spec["ours"])
    src = (ctypes.c_uint8 * len(ours)).from_buffer_copy(ours)
    out["set_read"] = L.llama_state_seq_set_data(ctx, src, len(ours), 0)
    out["pos_after_set"] = pos()
    out["seq0_after_set"] = get(0)
    cap = 64
    got = (L.llama_token * cap)()
    n_got = ctypes.c_size_t(0)
    out["load_read"] = L.llama_state_seq_load_file(ctx, spec["our_file"].encode(), 1, got, cap, ctypes.byref(n_got))
    out["load_tokens"] = list(got[:n_got.value])
    out["pos_after_load"] = pos()
    out["seq1_after_load"] = get(1)
    # the whole context: the arch string, then the whole cache
    n = L.llama_state_get_size(ctx)
    buf = (ctypes.c_uint8 * n)()
    assert L.llama_state_get_data(ctx, buf, n) == n
    out["whole"] = bytes(buf).hex()
    out["pos_before_whole"] = pos()
    out["whole_read"] = L.llama_state_set_data(ctx, buf, n)
    out["pos_after_whole"] = pos()
    print(json.dumps(out))
""")


def ours_cache(unified, flash_attn):
    return KVCache(ToyModel(**TINY_GGUF), kv_size=256, n_seq_max=2, unified=unified, v_trans=not flash_attn)


@pytest.mark.parametrize("unified", [True, False], ids=["unified", "streams"])
@pytest.mark.parametrize("flash_attn", [False, True], ids=["v_trans", "flash_attn"])
def test_llama_cpp_exchanges_sequence_states(tmp_path, flash_attn, unified):
    rng = np.random.default_rng(5)
    # ours: sequence 0 with 7 cells of random (finite) f16 data, positions 3..9
    kv = ours_cache(unified, flash_attn)
    for layer in kv.layers:
        for t in (layer.k, layer.v):
            a = rng.standard_normal(G.nbytes(t) // 2).astype(np.float16)
            G.ggml_backend_tensor_set(t, a.ctypes.data, 0, a.nbytes)
    ba = BatchAllocator(1)
    ba.init(Batch(token=np.full(7, 3), pos=list(range(3, 10)), seq_id=[[0]] * 7), 64, kv, 64, 2, False)
    ctx = kv.init_batch(ba, 512)
    ctx.apply()
    ours = kv.state_save(0)
    our_file = tmp_path / "ours.ggsq"
    save_seq_file(our_file, kv, 0, [11, 12, 13])
    their_file = tmp_path / "theirs.ggsq"
    tokens0, tokens1 = [1, 5, 9, 13, 17, 21, 25, 29, 33, 37], [2, 4, 6, 8, 10]
    out = run_py(LLAMA, {"flash_attn": flash_attn, "unified": unified, "tokens0": tokens0, "tokens1": tokens1,
                         "ours": ours.hex(), "our_file": str(our_file), "their_file": str(their_file)})[0]
    assert out["pos_before"] == [[0, 9], [0, 4]]

    # their bytes here: same cells, and written back byte for byte (their real K/V included)
    for seq, n in ((0, 10), (1, 5)):
        blob = bytes.fromhex(out[f"seq{seq}"])
        info = parse_state(blob)
        assert info.n_stream == (1 if unified else 2) and info.trailing == 0
        assert [st.v_trans for st in info.streams if st.cell_count] == [not flash_attn]
        mine = ours_cache(unified, flash_attn)
        assert mine.state_load(blob, seq) == len(blob)
        assert (mine.seq_pos_min(seq), mine.seq_pos_max(seq)) == (0, n - 1)
        assert mine.state_save(seq) == blob
        assert mine.state_size(seq) == len(blob)
        # into the other sequence too
        other = ours_cache(unified, flash_attn)
        other.state_load(blob, 1 - seq)
        assert (other.seq_pos_min(1 - seq), other.seq_pos_max(1 - seq)) == (0, n - 1)
    mine = ours_cache(unified, flash_attn)
    assert load_seq_file(their_file, mine, 0).tolist() == tokens0
    assert their_file.stat().st_size == out["file_size"]
    assert (mine.seq_pos_min(0), mine.seq_pos_max(0)) == (0, 9)
    assert mine.state_save(0) == bytes.fromhex(out["seq0"])

    # ours there, written back unchanged (as sequence 1 after the file: the blob names its sequence)
    assert out["set_read"] == len(ours)
    assert out["pos_after_set"] == [[3, 9], [0, 4]]
    assert bytes.fromhex(out["seq0_after_set"]) == ours
    assert out["load_tokens"] == [11, 12, 13]
    assert out["load_read"] == our_file.stat().st_size
    assert out["pos_after_load"] == [[3, 9], [3, 9]]
    as_seq1 = ours_cache(unified, flash_attn)
    as_seq1.state_load(ours, 1)
    assert bytes.fromhex(out["seq1_after_load"]) == as_seq1.state_save(1)

    # their whole-context state: u32 length + "llama", then the whole cache, which restores here completely
    whole = bytes.fromhex(out["whole"])
    assert whole[:9] == b"\x05\x00\x00\x00llama"
    mine = ours_cache(unified, flash_attn)
    assert mine.state_load(whole[9:]) == len(whole) - 9
    assert [(mine.seq_pos_min(s), mine.seq_pos_max(s)) for s in (0, 1)] == [(3, 9), (3, 9)]
    assert mine.state_save() == whole[9:]
    assert out["whole_read"] == len(whole)
    # llama.cpp's own restore of it, with two streams, keeps the last non-empty stream only (it empties the whole
    # cache before each stream): the reason for this library's one-clear-up-front restore
    assert out["pos_after_whole"] == ([[3, 9], [3, 9]] if unified else [[-1, -1], [3, 9]])
