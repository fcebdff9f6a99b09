"""The runtime against llama.cpp itself: the same GGUF, the same batches, llama-cpp-python 0.3.17 in a subprocess.

Each scenario is a list of operations (decode, sequence operations, state get/set) run by
:mod:`kvcache_ggml.runtime.llama_runner` on llama.cpp and by :func:`apply_ops` here on our runtime; the answers
are compared op by op: logits bit for bit, return codes and positions exactly, and
per-sequence state blobs byte for byte (the K/V data too, now that the arithmetic is the same).
"""
from __future__ import annotations

import base64

import numpy as np
import pytest

from kvcache_ggml.runtime import Context, Model, NodeList, make_model
from llama_runner import b64_floats, llama_available, run_llama
from kvcache_ggml.runtime.modelmaker import ModelSpec

from runtime_ops import apply_ops, compare_state

pytestmark = [pytest.mark.oracle,
              pytest.mark.skipif(llama_available() is not None, reason=str(llama_available()))]

# bit-identical (docs/exactness.md): the same graph, llama.cpp's buffer types and a ggml-cpu built with
# llamafile's sgemm as llama.cpp's is; with flash attention an F32 cache is cast to F16 as llama.cpp does
# (fa_cast_f32_kv=True below)
TOL = 0.0
FA_TOL = 0.0
VOCAB = 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("oracle_rt") / "tiny.gguf",
                      ModelSpec(layers=2, embd=64, heads=4, heads_kv=2, ff=96, vocab=VOCAB, seed=5))


def rng_tokens(n, seed):
    return np.random.default_rng(seed).integers(3, VOCAB, n).tolist()


def dec(tokens, pos, seq, logits=None):
    n = len(tokens)
    seq = [[s] if isinstance(s, int) else list(s) for s in (seq if isinstance(seq, list) else [seq] * n)]
    return {"op": "decode", "tokens": list(map(int, tokens)), "pos": list(map(int, pos)), "seq": seq,
            "logits": [1] * n if logits is None else list(logits)}


def run_both(path, params, ops):
    theirs = run_llama({"model": str(path), "params": params, "ops": ops})
    assert "abort" not in theirs[-1], theirs[-1]
    ours_params = {k: v for k, v in params.items() if k != "n_threads"}
    with Model(path) as m, Context(m, n_threads=1, n_threads_batch=1, fa_cast_f32_kv=True, **ours_params) as ctx:
        ours = apply_ops(ctx, ops)
    return ours, theirs


def compare(ours, theirs, tol=TOL):
    assert len(ours) == len(theirs), f"{len(ours)} answers, llama.cpp {len(theirs)}"
    for k, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a["op"] == b["op"]
        if a["op"] == "decode":
            assert a["ret"] == b["ret"], f"op {k}: decode returned {a['ret']}, llama.cpp {b['ret']}"
            lb = b64_floats(b["logits"], b["n_vocab"])
            assert a["logits"].shape == lb.shape, f"op {k}"
            if lb.size:
                err = np.abs(a["logits"] - lb).max() / np.abs(lb).max()
                assert err <= tol, f"op {k}: logits differ by {err:.2e} (relative)"
        elif a["op"] == "state_seq_get":
            compare_state(a["blob"], base64.b64decode(b["blob"]))
        elif "ret" in a:
            assert a["ret"] == b["ret"], f"op {k} {a['op']}: {a['ret']} vs llama.cpp {b['ret']}"


MODES = [pytest.param(fa, uni, tk, id=f"{'fa' if fa else 'nofa'}-{'unified' if uni else 'streams'}-{tk}")
         for fa in (True, False) for uni in (True, False) for tk in ("f32", "f16")]


def params(fa, uni, tk, n_seq_max=4):
    return {"n_ctx": 512, "n_batch": 512, "n_ubatch": 512, "n_seq_max": n_seq_max, "kv_unified": uni,
            "flash_attn": fa, "type_k": tk, "type_v": tk, "n_threads": 1}


@pytest.mark.parametrize("fa,uni,tk", MODES)
def test_generation_fork_shift_state(tiny, fa, uni, tk):
    """Prompt, decode, several sequences in one batch, a seq_cp fork, a context shift, state get/set."""
    p = rng_tokens(20, 1)
    q = rng_tokens(9, 2)
    ops = [dec(p[:14], range(14), 0, [1] * 14)]
    ops += [dec([t], [14 + i], 0) for i, t in enumerate(p[14:17])]
    # a second prompt in sequence 1, interleaved with a step of sequence 0, in one batch
    ops.append(dec(q[:5] + [p[17]], list(range(5)) + [17], [1] * 5 + [0]))
    # fork sequence 0 into 2 and 3, then one token each in one batch
    ops += [{"op": "seq_cp", "args": [0, 2, -1, -1]}, {"op": "seq_cp", "args": [0, 3, -1, -1]}]
    ops.append(dec([5, 6, 7, 8], [18, 18, 5, 18], [0, 2, 1, 3]))
    # context shift of sequence 2: keep 4, discard 6, then decode on the shifted cache
    ops += [{"op": "seq_rm", "args": [2, 4, 10]}, {"op": "seq_add", "args": [2, 10, 19, -6]}]
    ops += [{"op": "pos_max", "seq": 2}, dec([9, 10], [13, 14], [2, 2])]
    # a state round trip: get sequence 3, restore it into sequence 1 (replacing it), decode both
    ops += [{"op": "state_seq_get", "seq": 3}, {"op": "state_seq_get", "seq": 2},
            {"op": "seq_rm", "args": [1, -1, -1]}]
    ours, theirs = run_both(tiny, params(fa, uni, tk), ops)
    tol = TOL if tk == "f32" and not fa else FA_TOL
    compare(ours, theirs, tol)
    blob3 = base64.b64encode(ours[-3]["blob"]).decode()
    ops2 = ops + [{"op": "state_seq_set", "seq": 1, "blob": blob3}, dec([11, 11], [19, 19], [1, 3])]
    ours, theirs = run_both(tiny, params(fa, uni, tk), ops2)
    compare(ours, theirs, tol)
    assert ours[-2]["ret"] == theirs[-2]["ret"] == len(ours[-5]["blob"])


@pytest.mark.parametrize("fa", [True, False])
def test_seq_div_matches_llama(tiny, fa):
    p = rng_tokens(16, 3)
    ops = [dec(p, range(16), 0, [0] * 15 + [1]), {"op": "seq_div", "args": [0, 8, 16, 2]},
           {"op": "pos_max", "seq": 0}, dec(p[:3], [8, 9, 10], 0)]
    compare(*run_both(tiny, params(fa, True, "f32", 1), ops), TOL if not fa else FA_TOL)


def test_ubatches_and_output_order(tiny):
    """Small ubatches, selected outputs, sequences interleaved: llama.cpp's output order."""
    p, q = rng_tokens(11, 4), rng_tokens(7, 5)
    toks = p[:4] + q[:4] + p[4:11] + q[4:7]
    pos = list(range(4)) * 2 + list(range(4, 11)) + list(range(4, 7))
    seq = [0] * 4 + [1] * 4 + [0] * 7 + [1] * 3
    flags = [1 if i % 3 == 0 else 0 for i in range(len(toks))]
    for uni in (True, False):
        pr = dict(params(True, uni, "f32", 2), n_ubatch=4)
        compare(*run_both(tiny, pr, [dec(toks, pos, seq, flags), dec([3, 4], [11, 7], [0, 1])]), FA_TOL)


def test_full_cache_returns_1(tiny):
    pr = dict(params(True, True, "f32", 1), n_ctx=256, n_batch=256)
    ops = [dec([5] * 250, range(250), 0, [0] * 250), dec([5] * 10, range(250, 260), 0),
           {"op": "pos_max", "seq": 0}, dec([5] * 6, range(250, 256), 0)]
    ours, theirs = run_both(tiny, pr, ops)
    assert theirs[1]["ret"] == ours[1]["ret"] == 1
    compare(ours, theirs, FA_TOL)


@pytest.mark.parametrize("n_par", [1, 3])
@pytest.mark.parametrize("fa,uni", [(True, False), (True, True), (False, False), (False, True)])
def test_decode_graph_is_llama_cpps_node_by_node(tiny, fa, uni, n_par):
    """The graph of a prompt and of a one-token-per-sequence step: the same nodes as llama.cpp's scheduler computes
    (count, op, name, type, ne, nb -- views, permutes and conts included), in the same order."""
    params = dict(n_ctx=256 * n_par, n_seq_max=n_par, kv_unified=uni, flash_attn=fa, type_k="f16", type_v="f16")
    ops = [dec(rng_tokens(9, 1), range(9), 0)] + [{"op": "seq_cp", "args": [0, s, -1, -1]} for s in range(1, n_par)]
    ops.append(dec([5 + s for s in range(n_par)], [9] * n_par, list(range(n_par))))
    theirs = run_llama({"model": str(tiny), "params": dict(params, n_threads=1, graph=True), "ops": ops})
    assert "abort" not in theirs[-1], theirs[-1]
    want = [a["graph"] for a in theirs if a["op"] == "decode"]
    with Model(tiny) as m, Context(m, n_threads=1, n_threads_batch=1, **params) as ctx:
        got = []
        for op in ops:
            with NodeList(ctx) as nl:
                apply_ops(ctx, [op])
            if op["op"] == "decode":
                got.append(nl.nodes)
    for g, w in zip(got, want, strict=True):
        assert len(g) == len(w)
        for i, (a, b) in enumerate(zip(g, w)):
            assert a == b, f"node {i}: ours {a}, llama.cpp {b}"
