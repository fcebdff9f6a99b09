"""Gemma 2 / Gemma 3 on the iSWA cache against llama.cpp itself (llama-cpp-python 0.3.17 in a subprocess).

A tiny random-weight GGUF of each architecture (our model maker; llama.cpp loads it), a window of 16 and a
256-cell SWA cache.  Our runtime decodes a prompt and then 600 tokens greedily; llama.cpp decodes the same tokens
and every step's logits are compared: equal to 1e-5 of the largest (in practice bit-identical) when our ggml is
built with the CPU backend's llamafile matmuls as llama.cpp's is (build.py does), argmax equal at every step either
way (so greedy decoding gives the same tokens).  Without llamafile an F32 mul_mat sums in another order (~1e-6)
and the float16 table of ggml's GELU turns that into float16 steps now and then: FALLBACK_TOL.
"""
from __future__ import annotations

import base64

import numpy as np
import pytest

from kvcache_ggml import ggml as G
from kvcache_ggml.batch import Batch
from kvcache_ggml.runtime import Context
from kvcache_ggml.runtime.arch import load_model
from kvcache_ggml.runtime.gemma_maker import GemmaSpec, make_gemma_model
from llama_runner import b64_floats, llama_available, run_llama
from kvcache_ggml.cache.state import parse_state

from runtime_ops import apply_ops, compare_state

pytestmark = [pytest.mark.oracle,
              pytest.mark.skipif(llama_available() is not None, reason=str(llama_available()))]

EXACT = bool(G.ggml_cpu_has_llamafile())
TOL = 1e-5 if EXACT else 2e-3
FA_TOL = 1e-5 if EXACT else 3e-3
VOCAB = 64
N_SWA = 16


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def model_path(request, tmp_path_factory):
    return make_gemma_model(tmp_path_factory.mktemp("oracle_gemma") / f"{request.param}.gguf",
                            GemmaSpec(arch=request.param, layers=4, embd=64, heads=4, heads_kv=2, head_dim=32,
                                      ff=128, vocab=VOCAB, n_swa=N_SWA, seed=11))


def params(fa, tk="f32", **kw):
    p = {"n_ctx": 1024, "n_batch": 1024, "n_ubatch": 64, "n_seq_max": 1, "kv_unified": True, "flash_attn": fa,
         "type_k": tk, "type_v": tk, "n_threads": 1, "swa_full": False}
    p.update(kw)
    return p


def ours_ctx(model, p):
    return Context(model, n_threads=1, n_threads_batch=1, fa_cast_f32_kv=True,
                   **{k: v for k, v in p.items() if k != "n_threads"})


def dec(tokens, pos, seq=0, logits=None):
    n = len(tokens)
    return {"op": "decode", "tokens": [int(t) for t in tokens], "pos": [int(p) for p in pos],
            "seq": [[seq]] * n, "logits": [1] * n if logits is None else list(logits)}


def theirs_logits(path, p, ops):
    out = run_llama({"model": str(path), "params": p, "ops": ops})
    assert "abort" not in out[-1], out[-1]
    return out


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("fa", [False, True], ids=["nofa", "fa"])
def test_greedy_generation_slides_the_window(model_path, fa):
    """64-token prompt, 600 greedy steps: the 256-cell SWA cache wraps twice, the window slides 600 times."""
    p = params(fa)
    prompt = np.random.default_rng(1).integers(3, VOCAB, 64).astype(np.int32)
    n_gen = 600
    with load_model(model_path) as m, ours_ctx(m, p) as ctx:
        rows = [ctx.decode(Batch(token=prompt, pos=np.arange(64, dtype=np.int32), logits=np.ones(64, np.int8)))]
        toks = [int(np.argmax(rows[0][-1]))]
        for i in range(n_gen):
            rows.append(ctx.decode(Batch(token=np.array([toks[-1]], np.int32), pos=np.array([64 + i], np.int32))))
            toks.append(int(np.argmax(rows[-1][-1])))
        assert ctx.kv.get_swa().get_size() == 256 and ctx.kv.seq_pos_min(0) == 64 + n_gen - 256
    ours = np.concatenate(rows)
    ops = [dec(prompt, range(64))] + [dec([t], [64 + i]) for i, t in enumerate(toks[:n_gen])]
    theirs = np.concatenate([b64_floats(a["logits"], a["n_vocab"]) for a in theirs_logits(model_path, p, ops)])
    assert ours.shape == theirs.shape == (64 + n_gen, VOCAB)
    err = np.abs(ours - theirs).max(axis=1) / np.abs(theirs).max()
    assert err.max() < (FA_TOL if fa else TOL), f"max rel diff {err.max():.2e} at row {err.argmax()}"
    # greedy: llama.cpp picks the same token at every step of the same history
    assert (theirs[63:].argmax(axis=1) == np.array(toks)).all()


def _split_iswa_state(blob: bytes) -> tuple[bytes, bytes]:
    """An iSWA state: the base cache's state, then the SWA cache's."""
    n = parse_state(blob).nbytes
    return blob[:n], blob[n:]


def _compare(ours, theirs, tol):
    for k, (a, b) in enumerate(zip(ours, theirs)):
        assert a["op"] == b["op"], k
        if a["op"] == "decode":
            assert a["ret"] == b["ret"], f"op {k}: decode returned {a['ret']}, llama.cpp {b['ret']}"
            lb = b64_floats(b["logits"], b["n_vocab"])
            assert a["logits"].shape == lb.shape, f"op {k}"
            if lb.size:
                assert rel(a["logits"], lb) < tol, f"op {k}: logits differ by {rel(a['logits'], lb):.2e}"
        elif a["op"] == "state_seq_get":
            mine, their = base64.b64decode(base64.b64encode(a["blob"])), base64.b64decode(b["blob"])
            for x, y in zip(_split_iswa_state(mine), _split_iswa_state(their)):
                compare_state(x, y, tol=tol if EXACT else 1e-3)
        elif "ret" in a:
            assert a["ret"] == b["ret"], f"op {k} {a['op']}: {a['ret']} vs llama.cpp {b['ret']}"


SCENARIOS = [pytest.param(uni, full, id=f"{'unified' if uni else 'streams'}-{'swa_full' if full else 'swa_small'}")
             for uni in (True, False) for full in (False, True)]


@pytest.mark.parametrize("unified,swa_full", SCENARIOS)
def test_two_sequences_state_and_shift(model_path, unified, swa_full):
    """Two prompts in one batch split in ubatches of 16, interleaved steps past the SWA cache, a sequence state
    saved and restored into the other sequence, and (full-size SWA cache) a context shift whose K-shift rotates
    each layer with its own RoPE base."""
    rng = np.random.default_rng(2)
    a, b = rng.integers(3, VOCAB, 300).tolist(), rng.integers(3, VOCAB, 300).tolist()
    ops = [dec(a[:40] + b[:40], list(range(40)) * 2, 0, [1] * 80)]
    ops[0]["seq"] = [[0]] * 40 + [[1]] * 40
    for i in range(40, 300, 20):          # 20 tokens of each sequence per batch
        op = dec(a[i:i + 20] + b[i:i + 20], list(range(i, i + 20)) * 2, 0, [0] * 19 + [1] + [0] * 19 + [1])
        op["seq"] = [[0]] * 20 + [[1]] * 20
        ops.append(op)
    ops += [{"op": "pos_min", "seq": 0}, {"op": "pos_max", "seq": 1}, {"op": "state_seq_get", "seq": 0},
            {"op": "seq_rm", "args": [1, -1, -1]}]
    if swa_full:
        ops += [{"op": "seq_rm", "args": [0, 10, 60]}, {"op": "seq_add", "args": [0, 60, 300, -50]},
                dec(a[:3], [250, 251, 252], 0)]
    p = params(False, n_seq_max=2, kv_unified=unified, n_ubatch=16, swa_full=swa_full)
    theirs = theirs_logits(model_path, p, ops)
    blob = base64.b64decode(next(t["blob"] for t in theirs if t["op"] == "state_seq_get"))
    ops2 = [{"op": "state_seq_set", "seq": 1, "blob": base64.b64encode(blob).decode()},
            dec([5, 5], [300 if not swa_full else 253, 300], 0, [1, 1])]
    ops2[1]["seq"] = [[0], [1]]
    theirs += theirs_logits(model_path, p, ops + ops2)[len(ops):]
    with load_model(model_path) as m, ours_ctx(m, p) as ctx:
        ours = apply_ops(ctx, ops + ops2)
        if not swa_full:
            assert ctx.kv.seq_pos_min(0) > 0       # the small SWA cache forgot the start of both sequences
    _compare(ours, theirs, TOL)
    assert ours[len(ops)]["ret"] == theirs[len(ops)]["ret"] == len(blob)
