"""`python -m kvcache_ggml demo`: a tiny real ggml graph on the CPU backend, checked against numpy.

The graph does what the KV cache does on every ubatch: ggml_set_rows writes the new keys into chosen cache rows,
and ggml_rope_ext rotates keys by their positions (the K-shift).
"""
from __future__ import annotations

import argparse

import numpy as np

from . import _ggml as G


def rope_norm_reference(x: np.ndarray, pos: np.ndarray, n_dims: int, freq_base: float) -> np.ndarray:
    """RoPE, normal mode: pairs (2i, 2i+1) of each head rotated by pos * freq_base^(-2i/n_dims).

    x: numpy shape [n_tokens, n_head, head_dim] (ggml ne: head_dim, n_head, n_tokens); pos: [n_tokens]."""
    out = x.astype(np.float64).copy()
    i = np.arange(0, n_dims, 2)
    theta = pos[:, None].astype(np.float64) * freq_base ** (-i / n_dims)  # [n_tokens, n_dims/2]
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    x0, x1 = x[..., 0:n_dims:2], x[..., 1:n_dims:2]
    out[..., 0:n_dims:2] = x0 * cos - x1 * sin
    out[..., 1:n_dims:2] = x0 * sin + x1 * cos
    return out


def demo(args: argparse.Namespace) -> int:
    for line in G.summary_lines():
        print(line)
    n_embd_k, kv_size, n_tokens = 8, 6, 3  # cache: ne (n_embd_k, kv_size); new keys: ne (n_embd_k, n_tokens)
    head_dim, n_head = 4, 2  # rope input: ne (head_dim, n_head, n_tokens)
    rng = np.random.default_rng(0)
    cache0 = np.full((kv_size, n_embd_k), -1.0, np.float32)
    k_cur = rng.standard_normal((n_tokens, n_embd_k)).astype(np.float32)
    rows = np.array([4, 0, 2], np.int64)
    pos = np.array([0, 5, 17], np.int32)
    freq_base = 10000.0

    with G.Context.for_tensors(8) as ctx, G.Context.for_tensors(0, graph_size=16) as gctx, \
            G.Backend.cpu(args.threads) as backend:
        cache = ctx.new_tensor("f32", (n_embd_k, kv_size), "cache_k")
        cur = ctx.new_tensor("f32", (n_embd_k, n_tokens), "k_cur")
        idxs = ctx.new_tensor("i64", (n_tokens,), "k_idxs")
        ppos = ctx.new_tensor("i32", (n_tokens,), "pos")
        stored = G.ggml_set_rows(ctx.ptr, cache, cur, idxs)  # a view of cache with the rows written
        heads = G.ggml_reshape_3d(ctx.ptr, cur, head_dim, n_head, n_tokens)
        roped = G.ggml_rope_ext(ctx.ptr, heads, ppos, None, head_dim, G.GGML_ROPE_TYPE_NORMAL, 0, freq_base, 1.0,
                                0.0, 1.0, 32.0, 1.0)
        with G.BackendBuffer.for_context(ctx, G.cpu_buffer_type()) as buf:
            for t, a in ((cache, cache0), (cur, k_cur), (idxs, rows), (ppos, pos)):
                G.set_tensor(t, a)
            graph = G.Graph(gctx, 16)
            graph.expand(stored)
            graph.expand(roped)
            backend.compute(graph)
            got_cache = G.to_numpy(cache, copy=True)
            got_rope = G.to_numpy(roped, copy=True)
            print(f"buffer {buf.name}: {buf.size} bytes; graph: "
                  f"{', '.join(f'{G.op_name(G.op(n))}' for n in graph.nodes())}")

    want_cache = cache0.copy()
    want_cache[rows] = k_cur
    want_rope = rope_norm_reference(k_cur.reshape(n_tokens, n_head, head_dim), pos, head_dim, freq_base)
    ok_rows = np.array_equal(got_cache, want_cache)
    err_rope = float(np.abs(got_rope - want_rope).max())
    ok_rope = err_rope < 1e-5
    np.set_printoptions(precision=3, suppress=True)
    print(f"set_rows: rows {rows.tolist()} of a {kv_size}-row cache -> {'OK' if ok_rows else 'MISMATCH'}")
    print(got_cache)
    print(f"rope_ext (norm, positions {pos.tolist()}): max |ggml - numpy| = {err_rope:.2e} -> "
          f"{'OK' if ok_rope else 'MISMATCH'}")
    return 0 if ok_rows and ok_rope else 1


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcache_ggml demo", description=__doc__)
    ap.add_argument("--threads", type=int, default=1, help="CPU backend threads (default: %(default)s)")
    return demo(ap.parse_args(argv))
