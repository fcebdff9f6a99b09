"""Graphs kept per topology (runtime/graph_cache.py): a step of a shape seen before computes its kept graph, in its
own scheduler, without building it -- and gives the same bytes as a context that keeps only the previous graph
(llama.cpp's reuse, ``graph_cache=0``), which builds a graph at every change of shape."""
from __future__ import annotations

import numpy as np
import pytest

from kvcache_ggml.batch import Batch
from kvcache_ggml.runtime import Context, Model, make_model
from kvcache_ggml.runtime.modelmaker import ModelSpec

VOCAB = 64


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_model(tmp_path_factory.mktemp("gc") / "tiny.gguf", ModelSpec(layers=2, embd=64, heads=4, heads_kv=2,
                                                                             ff=96, vocab=VOCAB))
    with Model(path) as m:
        yield m


def serve_like(ctx, n_steps=24, seed=0):
    """A prompt in each of 3 sequences, then one-token steps whose set of sequences changes every other step (as
    requests join and leave a serving loop; the second step of a shape can take the fused path): 1, 2 and 3 tokens
    per step in turn.  Every logits row, in order."""
    rng = np.random.default_rng(seed)
    out = []
    pos = [0, 0, 0]
    for s in range(3):
        n = 6 + 3 * s
        out.append(ctx.decode(Batch(token=rng.integers(3, VOCAB, n).astype(np.int32),
                                    pos=np.arange(n, dtype=np.int32), seq_id=np.full(n, s, np.int32))))
        pos[s] = n
    groups = [[0], [0, 1], [0, 1, 2], [2], [1, 2]]
    for k in range(n_steps):
        seqs = groups[(k // 2) % len(groups)]
        out.append(ctx.decode(Batch(token=rng.integers(3, VOCAB, len(seqs)).astype(np.int32),
                                    pos=np.array([pos[s] for s in seqs], np.int32),
                                    seq_id=np.array(seqs, np.int32), logits=np.ones(len(seqs), np.int8))))
        for s in seqs:
            pos[s] += 1
    return out


@pytest.mark.parametrize("fa,unified", [(True, True), (True, False), (False, True), (False, False)])
def test_kept_graphs_give_the_bytes_of_rebuilt_ones(model, fa, unified):
    p = dict(n_ctx=384, n_seq_max=3, type_k="f16", type_v="f16", n_threads=1, n_threads_batch=1,
             flash_attn=fa, kv_unified=unified)
    with Context(model, graph_cache=0, **p) as plain, Context(model, **p) as kept:
        want, got = serve_like(plain), serve_like(kept)
        for w, g in zip(want, got):
            assert np.array_equal(w, g)
        tp, tk = plain.times, kept.times
        assert tp.n_ubatch == tk.n_ubatch
        assert tp.n_graph_kept == 0
        # the plain context builds at every change of shape; the kept one once per shape (+ 3 prompts)
        assert tp.n_ubatch - tp.n_graph_reused >= 12
        built = tk.n_ubatch - tk.n_graph_reused
        assert built <= 3 + 5 and tk.n_graph_kept >= 12 - 5
        if kept.fused is not None:  # the fused path computes kept graphs too: every step of a shape seen before
            assert plain.fused.n_steps == 12 and kept.fused.n_steps >= 24 - 5


def test_eviction_keeps_the_results_and_the_limit(model):
    """Two kept graphs for five shapes: the least recently used is evicted (and the fused step lets go of its
    views), results unchanged."""
    p = dict(n_ctx=384, n_seq_max=3, type_k="f32", type_v="f32", n_threads=1, n_threads_batch=1, kv_unified=True)
    with Context(model, graph_cache=0, **p) as plain, Context(model, graph_cache=2, **p) as kept:
        for w, g in zip(serve_like(plain), serve_like(kept)):
            assert np.array_equal(w, g)
        assert kept.times.n_graph_kept > 0
        assert len(kept.kept_graphs) == 2


def test_large_graphs_are_not_kept_and_callbacks_reach_kept_graphs(model):
    seen = []
    with Context(model, n_ctx=256, n_seq_max=1, graph_cache_tokens=4, n_threads=1, n_threads_batch=1) as ctx:
        ctx.set_eval_callback(lambda t, ask: seen.append(ask) or True)
        toks = np.arange(3, 13, dtype=np.int32)
        ctx.decode(Batch(token=toks))               # 10 tokens: built in the main scheduler, not kept
        ctx.decode(Batch(token=toks[:2]))           # 2 tokens: kept
        ctx.decode(Batch(token=toks[:1]))           # 1 token: kept
        n = len(seen)
        ctx.decode(Batch(token=toks[:2]))           # a kept graph: the callback still sees its nodes
        assert len(seen) > n
        assert ctx.times.n_graph_kept == 1
        assert [k.n_tokens for k in ctx.kept_graphs] == [1, 2]
        nodes = ctx.node_backends()  # asked of the kept graph's own scheduler
        assert nodes and {backend for _, _, backend in nodes} == {"CPU"}
    with pytest.raises(ValueError, match="graph_cache must be >= 0"):
        Context(model, graph_cache=-1)
