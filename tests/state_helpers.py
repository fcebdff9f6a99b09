"""Shared by the state tests (test_state.py, test_state_checks.py): caches of several layouts, data fillers, the
comparisons of restored cells and data, and the golden cache."""
from functools import partial

import numpy as np

from kvcache_ggml import ggml as G

from helpers import make_cache
from helpers import decode as decode_batch


MODELS = {
    "small": dict(),
    "gqa-var": dict(n_layer=3, n_head=4, n_head_kv=[1, 2, 1]),   # transposed V padded to the widest layer
    "q8": dict(n_embd_head=32),                                   # rows of whole q8_0 blocks
}

# name -> (model, cache kwargs)
CONFIGS = {
    "unified-trans-f16": ("small", dict(unified=True, v_trans=True)),
    "unified-rows-f16": ("small", dict(unified=True, v_trans=False)),
    "streams-trans-f16": ("small", dict(unified=False, v_trans=True)),
    "streams-rows-f32": ("small", dict(unified=False, v_trans=False, type_k="f32", type_v="f32")),
    "unified-rows-q8": ("q8", dict(unified=True, v_trans=False, type_k="q8_0", type_v="q8_0")),
    "unified-trans-q8k": ("q8", dict(unified=True, v_trans=True, type_k="q8_0", type_v="f16")),
    "streams-rows-q8": ("q8", dict(unified=False, v_trans=False, type_k="q8_0", type_v="q8_0")),
    "unified-trans-gqa": ("gqa-var", dict(unified=True, v_trans=True, type_v="f32")),
}


def make(cfg="unified-trans-f16", kv_size=32, n_seq_max=3, **kw):
    model, params = CONFIGS[cfg]
    return make_cache(kv_size, n_seq_max, **MODELS[model], **dict(params, **kw))


decode = partial(decode_batch, check=True)  # decode(kv, pos, seqs): a batch that must fit


def randomize_data(kv, rng):
    for layer in kv.layers:
        for t in (layer.k, layer.v):
            a = rng.integers(0, 256, G.nbytes(t), dtype=np.uint8)
            G.ggml_backend_tensor_set(t, a.ctypes.data, 0, a.size)


def fill(kv, rng, n_ops=12):
    """Random decodes (continuing each sequence), removals that leave holes and, unified, shared cells."""
    randomize_data(kv, rng)
    for _ in range(n_ops):
        s = int(rng.integers(0, kv.n_seq_max))
        r = rng.random()
        if r < 0.6:
            free = min(c.size() - c.get_used() for c in kv.v_cells)
            k = int(min(rng.integers(1, 6), free))
            if k:
                p0 = kv.seq_pos_max(s) + 1
                decode(kv, list(range(p0, p0 + k)), [s] * k)
        elif r < 0.8:
            p0 = int(rng.integers(0, 8))
            kv.seq_rm(s, p0, p0 + int(rng.integers(1, 3)))
        elif kv.n_stream == 1 and kv.n_seq_max > 1:
            d = (s + 1) % kv.n_seq_max
            kv.seq_rm(d, -1, -1)
            kv.seq_cp(s, d, 0, int(rng.integers(1, 6)))


def raw(t):
    return G.to_numpy(t, copy=not G.is_host(t)).reshape(-1).view(np.uint8)


def cell_data(kv, strm, idxs):
    """Per layer, the K rows and the V rows (or transposed V columns) of the cells ``idxs`` of stream ``strm``."""
    n = kv.get_size()
    out = []
    for layer in kv.layers:
        out.append(raw(layer.k_stream[strm]).reshape(n, -1)[idxs].copy())
    for layer in kv.layers:
        v = raw(layer.v_stream[strm])
        if kv.v_trans:
            el = G.type_size(G.ttype(layer.v))
            out.append(v.reshape(-1, n, el)[:kv.hparams.n_embd_v_gqa(layer.il)][:, idxs].copy())
        else:
            out.append(v.reshape(n, -1)[idxs].copy())
    return out


def seq_cells(kv, seq):
    """Per stream: (cells, positions, sequence bits) of the cells holding ``seq`` (every non-empty cell for -1)."""
    res = []
    for c in kv.v_cells:
        m = c.pos_array >= 0
        if seq >= 0:
            m &= c.seq_mask(seq)
        idx = np.flatnonzero(m)
        res.append((idx, c.pos_array[idx].copy(), c.seq_bits[:, idx].copy()))
    return res


def snapshot_seq(kv, seq):
    """Per stream, the cells of ``seq``, their positions and their data (a shared cell's other sequences may
    change when one of them is removed)."""
    cells = seq_cells(kv, seq)
    return [(idx, pos, cell_data(kv, s, idx)) for s, (idx, pos, _) in enumerate(cells)]


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, (list, tuple)):
            assert_same(x, y)
        else:
            np.testing.assert_array_equal(x, y)


def assert_consistent(kv):
    """The derived indices of every stream agree with its arrays."""
    for c in kv.v_cells:
        used = np.flatnonzero(c.pos_array >= 0)
        assert c.get_used() == used.size
        for q in range(kv.n_seq_max):
            ps = c.pos_array[used[c.seq_mask_at(q, used)]] if used.size else np.empty(0, np.int32)
            assert c.seq_pos_min(q) == (int(ps.min()) if ps.size else -1)
            assert c.seq_pos_max(q) == (int(ps.max()) if ps.size else -1)


def assert_restored(src, dst, seq, dst_seq=None):
    """``dst`` holds the cells of ``seq`` of ``src`` (as ``dst_seq``), in order, with the same data."""
    dst_seq = seq if dst_seq is None else dst_seq
    for s, ((si, sp, sb), (di, dp, db)) in enumerate(zip(seq_cells(src, seq), seq_cells(dst, dst_seq))):
        if seq >= 0 and src.n_stream > 1:
            if s != src.seq_to_stream[seq]:
                continue
        np.testing.assert_array_equal(sp, dp)
        if seq == -1:
            np.testing.assert_array_equal(sb, db)
        assert_same(cell_data(src, s, si), cell_data(dst, s if seq == -1 else dst.seq_to_stream[dst_seq], di))


def pattern(kv):
    """Data where every byte tells its tensor and place."""
    for li, layer in enumerate(kv.layers):
        for j, t in enumerate((layer.k, layer.v)):
            a = ((np.arange(G.nbytes(t)) * 7 + 31 * li + 101 * j) % 251).astype(np.uint8)
            G.ggml_backend_tensor_set(t, a.ctypes.data, 0, a.size)


def golden_cache():
    kv = make("unified-trans-f16", kv_size=16, n_seq_max=3)
    pattern(kv)
    decode(kv, [0, 1, 2, 3], [0, 0, 0, 0])
    decode(kv, [0, 1], [[1, 2], [1, 2]])
    decode(kv, [2], [2])
    kv.seq_rm(0, 1, 2)
    return kv
