"""Phi-3-mini-4k, Phi-3.5-mini (LongRoPE) and Phi-4-mini (partial RoPE, GQA, tied) against llama.cpp itself
(llama-cpp-python in a subprocess).

The models are :mod:`kvcache_ggml.runtime.phi3_maker`'s scaled-down presets, stored F32 and Q8_0.  With flash
attention on and off: a scenario of prompts, steps, several sequences in one batch, a fork, a context shift and
state round trips (llama.cpp's blob into ours and ours into llama.cpp) compared op by op -- logits bit for bit,
return codes, state blobs byte for byte; greedy generation (the same tokens, the same logits at every step); the
decode graph node by node (op, name, type, shapes); and both LongRoPE factor sets (n_ctx_seq over and within the
original context).
"""
from __future__ import annotations

import base64

import numpy as np
import pytest

from kvcache_ggml.runtime import Context, Model, NodeList
from kvcache_ggml.runtime.phi3_maker import PHI3_PRESETS, PHI3_SPECIAL, make_phi3_model
from llama_runner import b64_floats, llama_available, run_llama

from runtime_ops import apply_ops, compare_state

pytestmark = [pytest.mark.oracle,
              pytest.mark.skipif(llama_available() is not None, reason=str(llama_available()))]

VOCAB = PHI3_PRESETS["phi3-mini-4k"].vocab   # 320: 3 special, 256 byte pieces, 50 pieces, 11 added tokens
NAMES = list(PHI3_PRESETS)
# llama.cpp's end-of-generation tokens of the maker's Phi-3 vocabulary: </s>, <|endoftext|> (EOS) and <|end|>
EOG = {2} | {VOCAB - len(PHI3_SPECIAL) + PHI3_SPECIAL.index(t) for t in ("<|endoftext|>", "<|end|>")}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("oracle_phi3")
    return {(name, wt): make_phi3_model(d / f"{name}-{wt}.gguf", name, seed=7, type=wt)
            for name in NAMES for wt in ("f32", "q8_0")}


def rng_tokens(n, seed):
    return np.random.default_rng(seed).integers(3, VOCAB, n).tolist()


def dec(tokens, pos, seq, logits=None):
    n = len(tokens)
    seq = [[s] if isinstance(s, int) else list(s) for s in (seq if isinstance(seq, list) else [seq] * n)]
    return {"op": "decode", "tokens": list(map(int, tokens)), "pos": list(map(int, pos)), "seq": seq,
            "logits": [1] * n if logits is None else list(logits)}


def params(fa, uni=True, tk="f32", n_seq_max=4, n_ctx=512):
    return {"n_ctx": n_ctx, "n_batch": 512, "n_ubatch": 512, "n_seq_max": n_seq_max, "kv_unified": uni,
            "flash_attn": fa, "type_k": tk, "type_v": tk, "n_threads": 1}


def theirs_of(path, p, ops):
    out = run_llama({"model": str(path), "params": p, "ops": ops})
    assert "abort" not in out[-1], out[-1]
    return out


def ours_of(path, p, ops):
    with Model(path) as m, Context(m, n_threads=1, n_threads_batch=1, fa_cast_f32_kv=True,
                                   **{k: v for k, v in p.items() if k != "n_threads"}) as ctx:
        return apply_ops(ctx, ops)


def compare(ours, theirs):
    """Op by op: decode return codes and logits bit for bit, state blobs byte for byte, other answers equal."""
    assert len(ours) == len(theirs), f"{len(ours)} answers, llama.cpp {len(theirs)}"
    for k, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a["op"] == b["op"]
        if a["op"] == "decode":
            assert a["ret"] == b["ret"], f"op {k}: decode returned {a['ret']}, llama.cpp {b['ret']}"
            lb = b64_floats(b["logits"], b["n_vocab"])
            assert a["logits"].shape == lb.shape, f"op {k}"
            assert np.array_equal(a["logits"], lb), \
                f"op {k}: logits differ by {np.abs(a['logits'] - lb).max() / np.abs(lb).max():.2e} (relative)"
        elif a["op"] == "state_seq_get":
            compare_state(a["blob"], base64.b64decode(b["blob"]))
        elif "ret" in a:
            assert a["ret"] == b["ret"], f"op {k} {a['op']}: {a['ret']} vs llama.cpp {b['ret']}"


def _scenario() -> list[dict]:
    p, q = rng_tokens(20, 1), rng_tokens(9, 2)
    ops = [dec(p[:14], range(14), 0)]
    ops += [dec([t], [14 + i], 0) for i, t in enumerate(p[14:17])]
    ops.append(dec(q[:5] + [p[17]], list(range(5)) + [17], [1] * 5 + [0]))        # two sequences, one batch
    ops += [{"op": "seq_cp", "args": [0, 2, -1, -1]}, {"op": "seq_cp", "args": [0, 3, -1, -1]}]  # fork
    ops.append(dec([5, 6, 7, 8], [18, 18, 5, 18], [0, 2, 1, 3]))
    ops += [{"op": "seq_rm", "args": [2, 4, 10]}, {"op": "seq_add", "args": [2, 10, 19, -6]}]  # context shift
    ops += [{"op": "pos_max", "seq": 2}, dec([9, 10], [13, 14], [2, 2])]
    ops += [{"op": "state_seq_get", "seq": 3}, {"op": "seq_rm", "args": [1, -1, -1]}]
    return ops


@pytest.mark.parametrize("wt", ["f32", "q8_0"])
@pytest.mark.parametrize("fa", [False, True], ids=["nofa", "fa"])
@pytest.mark.parametrize("name", NAMES)
def test_fork_shift_and_state_both_ways_bit_exact(models, name, fa, wt):
    """The scenario on both runtimes (n_ctx_seq 512: LongRoPE's long factors); then sequence 3's state as llama.cpp
    saved it restored into our sequence 1, and as we saved it into llama.cpp's, each followed by a decode."""
    path, p = models[(name, wt)], params(fa)
    ops = _scenario()
    theirs, ours = theirs_of(path, p, ops), ours_of(path, p, ops)
    compare(ours, theirs)
    their_blob, our_blob = theirs[-2]["blob"], base64.b64encode(ours[-2]["blob"]).decode()
    for blob in (their_blob, our_blob):
        more = ops + [{"op": "state_seq_set", "seq": 1, "blob": blob}, dec([11, 11], [19, 19], [1, 3])]
        a, b = ours_of(path, p, more), theirs_of(path, p, more)
        compare(a, b)
        assert a[-2]["ret"] == b[-2]["ret"] == len(ours[-2]["blob"])


@pytest.mark.parametrize("fa", [False, True], ids=["nofa", "fa"])
@pytest.mark.parametrize("name", ["phi3.5-mini", "phi4-mini"])
def test_short_factors_within_the_original_context(models, name, fa):
    """n_ctx 256 = the original context: the short factors (and a split cache of 4 streams, n_ctx_seq 128)."""
    path = models[(name, "f32")]
    ops = _scenario()[:8]
    for p in (params(fa, n_ctx=256), params(fa, uni=False, n_ctx=512)):
        compare(ours_of(path, p, ops), theirs_of(path, p, ops))


def _greedy(path, p, prompt, n_gen):
    """Our greedy run: the generated tokens and the logits each was picked from."""
    toks, n = list(prompt), len(prompt)
    with Model(path) as m, Context(m, n_threads=1, n_threads_batch=1, fa_cast_f32_kv=True,
                                   **{k: v for k, v in p.items() if k != "n_threads"}) as ctx:
        rows = [apply_ops(ctx, [dec(prompt, range(n), 0, [0] * (n - 1) + [1])])[0]["logits"]]
        for _ in range(n_gen):
            toks.append(int(np.argmax(rows[-1][-1])))
            rows.append(apply_ops(ctx, [dec([toks[-1]], [len(toks) - 1], 0)])[0]["logits"])
    return toks[n:], np.concatenate(rows)[:n_gen]


@pytest.mark.parametrize("wt", ["f32", "q8_0"])
@pytest.mark.parametrize("fa", [False, True], ids=["nofa", "fa"])
@pytest.mark.parametrize("name", NAMES)
def test_greedy_generation_gives_llama_cpps_tokens(models, name, fa, wt):
    """A 16-token prompt and 48 greedy steps on ours (the first prompt whose run has 24 tokens before an
    end-of-generation token, as llama.cpp stops there); llama.cpp's greedy sampler from the same prompt picks the
    same tokens from bit-identical logits."""
    path, p = models[(name, wt)], params(fa, n_seq_max=1)
    for seed in range(3, 40):
        prompt = rng_tokens(16, seed)
        toks, rows = _greedy(path, p, prompt, 48)
        if not EOG & set(toks[:24]):
            break
    else:
        pytest.fail("no prompt gives 24 tokens before an end-of-generation token")
    ans = theirs_of(path, p, [{"op": "generate", "prompt": prompt, "n_predict": 48}])[0]
    n = len(ans["tokens"])                 # llama.cpp stops after an end-of-generation token
    assert n >= 24 and ans["tokens"] == toks[:n] and (n == 48 or toks[n - 1] in EOG)
    assert np.array_equal(rows[:n], b64_floats(ans["logits"], VOCAB))


@pytest.mark.parametrize("fa", [False, True], ids=["nofa", "fa"])
@pytest.mark.parametrize("name", NAMES)
def test_decode_graph_is_llama_cpps_node_by_node(models, name, fa):
    """A prompt and a step of two sequences: the same nodes as llama.cpp's scheduler computes (op, name, type,
    ne, nb), in the same order -- the fused QKV's views, the rope factors, the fused SwiGLU."""
    path = models[(name, "f32")]
    p = dict(n_ctx=512, n_seq_max=2, kv_unified=False, flash_attn=fa, type_k="f16", type_v="f16")
    ops = [dec(rng_tokens(9, 1), range(9), 0), {"op": "seq_cp", "args": [0, 1, -1, -1]}, dec([5, 6], [9, 9], [0, 1])]
    theirs = run_llama({"model": str(path), "params": dict(p, n_threads=1, graph=True), "ops": ops})
    assert "abort" not in theirs[-1], theirs[-1]
    want = [a["graph"] for a in theirs if a["op"] == "decode"]
    with Model(path) as m, Context(m, n_threads=1, n_threads_batch=1, **p) as ctx:
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


@pytest.mark.parametrize("name", ["phi3.5-mini", "phi4-mini"])
def test_greedy_text_with_the_published_kind_of_vocabulary(tmp_path, name):
    """Phi-3.5-mini with llama.cpp's own ggml-vocab-phi-3 (SentencePiece, Phi-3's added tokens), Phi-4-mini with
    GPT-2's pieces relabelled as its gpt-4o BPE (Q8_0 embeddings): a chat-shaped prompt (special tokens, the
    whitespace after them stripped), 12 greedy steps -- the same tokens, bit-identical logits and llama.cpp's
    detokenized text."""
    import importlib.util
    import sys
    from pathlib import Path

    from kvcache_ggml.runtime import Vocab
    from kvcache_ggml.runtime.vocab_maker import relabel_vocab
    from llama_runner import ORACLE_DIR
    root = Path(__file__).resolve().parents[2]
    if name == "phi3.5-mini":
        vocab_path = ORACLE_DIR / "src" / "llama_cpp_python-0.3.17" / "vendor" / "llama.cpp" / "models" / \
            "ggml-vocab-phi-3.gguf"
        if not vocab_path.exists():
            pytest.skip(f"{vocab_path} missing")
    else:
        vocab_path = relabel_vocab(root / "tests" / "data" / "vocab" / "ggml-vocab-gpt-2.gguf",
                                   tmp_path / "gpt-4o.gguf", "gpt-4o")
    spec = importlib.util.spec_from_file_location("check_tiny_llama", root / "scripts" / "check_tiny_llama.py")
    chk = importlib.util.module_from_spec(spec)
    sys.modules["check_tiny_llama"] = chk
    try:
        spec.loader.exec_module(chk)
    finally:
        del sys.modules["check_tiny_llama"]
    path = make_phi3_model(tmp_path / f"{name}.gguf", name, seed=4, vocab_from=str(vocab_path), embd_type="q8_0")
    vocab = Vocab.from_gguf(path)
    prompt = vocab.tokenize("<|user|>\n  The llama's 3 friends ate 1,234 apples.<|end|>\n<|assistant|>\n",
                            add_special=True, parse_special=True)
    ours, our_rows = chk.ours_greedy(path, prompt, 12, True, vocab)
    theirs, text, their_rows = chk.llama_greedy(path, prompt, 12, True, vocab.n_tokens)
    assert ours == theirs and len(ours) == 12, (len(ours), ours)
    assert text == vocab.detokenize(ours)
    np.testing.assert_array_equal(our_rows, their_rows)
