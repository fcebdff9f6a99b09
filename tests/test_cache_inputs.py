"""KVCache inputs (set_input_*): the vectorised fills against plain transcriptions of the seed's loops.

The kq mask is compared bit for bit (-inf included) with ``seed_mask``, the seed's loop per token and cell written
out in Python, on real caches filled by random sessions: causal and not, every SWA type, ALiBi, M-RoPE 2-D
positions, several streams, F32 and F16 masks, n_kv from the context or arbitrary.
"""
import socket
import subprocess
import sys
import time
from functools import partial

import numpy as np
import pytest

from kvcache_ggml import ggml as G
from kvcache_ggml.cache import masks as _masks
from kvcache_ggml.batch import Batch, BatchAllocator
from kvcache_ggml.cache import KVCache, MemoryStatus
from kvcache_ggml.hparams import (RopeType, SwaType, is_masked_swa, is_masked_swa_np,
                                   llama_relative_position_bucket)

from helpers import N_VOCAB, make_cache

# 2 layers of 2 heads of 4 dims, 1 KV head (model keyword arguments such as use_alibi go to the model)
make = partial(make_cache, kv_size=32, n_layer=2, n_embd_head=4, n_vocab=N_VOCAB)


# ------------------------------------------------------------------------------------------------ tensors

class HostTensor:
    """A tensor in its own CPU buffer, with its data as a numpy view."""

    def __init__(self, type_, ne, name="dst"):
        self.ctx = G.Context.for_tensors(2)
        self.t = self.ctx.new_tensor(type_, ne, name)
        self.buf = G.BackendBuffer.for_context(self.ctx, G.cpu_buffer_type())

    def array(self):
        return G.to_numpy(self.t, ndim=4)

    def close(self):
        self.buf.close()
        self.ctx.close()


def fill_mask(kv, ub, n_kv, n_stream, causal, type_="f32"):
    ht = HostTensor(type_, (n_kv, ub.n_tokens // n_stream, 1, n_stream))
    try:
        ht.array()[...] = 7  # the fill must overwrite every element
        kv.set_input_kq_mask(ht.t, ub, causal)
        return ht.array()[:, 0].copy()
    finally:
        ht.close()


def same_bits(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype
    ui = np.uint32 if a.dtype == np.float32 else np.uint16
    return np.array_equal(a.view(ui), b.view(ui))


# ------------------------------------------------------------------------------------------------ seed transcriptions

def seed_mask(kv, ub, n_kv, n_stream, causal):
    """llama_kv_cache::set_input_kq_mask, loop for loop."""
    n_tokens = ub.n_tokens
    assert n_tokens % n_stream == 0
    n_tps = n_tokens // n_stream
    data = np.full(n_kv * n_tps * n_stream, -np.inf, np.float32)
    for h in range(1):
        for s in range(n_stream):
            for ii in range(n_tps):
                i = s * n_tps + ii
                seq_id = int(ub.seq_id[i][0])
                cells = kv.v_cells[int(kv.seq_to_stream[seq_id])]
                p1 = int(ub.pos[i])
                is_2d = ub.is_pos_2d()
                p1_x = int(ub.pos[i + n_tokens * 2]) if is_2d else 0
                p1_y = int(ub.pos[i + n_tokens]) if is_2d else 0
                idst = n_kv * (h * n_stream * n_tps + s * n_tps + ii)
                for j in range(n_kv):
                    if cells.is_empty(j):
                        continue
                    if not cells.seq_has(j, seq_id):
                        continue
                    p0 = cells.pos_get(j)
                    if causal and p0 > p1:
                        continue
                    if causal and is_2d and p0 == p1:
                        if cells.ext_get(j).is_2d_gt(p1_x, p1_y):
                            continue
                    if is_masked_swa(kv.n_swa, kv.swa_type, p0, p1):
                        continue
                    data[idst + j] = -abs(p0 - p1) if kv.hparams.use_alibi else 0.0
    return data.reshape(n_stream, n_tps, n_kv)


def seed_pos_bucket(kv, ub, n_kv):
    """llama_kv_cache::set_input_pos_bucket, loop for loop."""
    cells = kv.v_cells[0]
    n_tokens = ub.n_tokens
    data = np.zeros(n_kv * n_tokens, np.int32)
    for i in range(n_tokens):
        for j in range(n_kv):
            p0 = -1 if cells.is_empty(j) else cells.pos_get(j)
            data[i * n_kv + j] = llama_relative_position_bucket(p0, int(ub.pos[i]), kv.hparams.n_rel_attn_bkts,
                                                                False)
    return data.reshape(n_tokens, n_kv)


def seed_v_idxs(kv, ub, sinfo):
    """llama_kv_cache::set_input_v_idxs, loop for loop."""
    kv_size = kv.get_size()
    if not kv.v_trans:
        return [s * kv_size + int(i) for s, idx in zip(sinfo.strm, sinfo.idxs) for i in idx]
    n_embd = kv.hparams.n_embd_v_gqa_max()
    data = [0] * (ub.n_tokens * n_embd)
    for s in range(sinfo.n_stream()):
        offs = sinfo.strm[s] * kv_size * n_embd
        for i in range(sinfo.size()):
            for j in range(n_embd):
                data[s * sinfo.size() * n_embd + i * n_embd + j] = offs + j * kv_size + int(sinfo.idxs[s][i])
    return data


# ------------------------------------------------------------------------------------------------ sessions

def allocate(kv, pos, seqs, embd=False):
    """A BatchAllocator holding the batch (ValueError when the allocator rejects it)."""
    ba = BatchAllocator(kv.hparams.n_pos_per_embd())
    n = len(seqs)
    rows = [s if isinstance(s, (list, tuple)) else [s] for s in seqs]
    n_embd = kv.hparams.n_embd
    if embd:
        b = Batch(embd=np.zeros((n, n_embd), np.float32), pos=np.asarray(pos, np.int32), seq_id=rows)
    else:
        b = Batch(token=np.full(n, 3), pos=np.asarray(pos, np.int32), seq_id=rows)
    ba.init(b, N_VOCAB, kv, n_embd, kv.n_seq_max, False)
    return ba


def decode(kv, pos, seqs, n_ubatch=512, embd=False, on_ubatch=None, ba=None):
    """balloc.init + init_batch + apply of every ubatch, calling on_ubatch(ctx) after each apply(); returns the
    context on its last ubatch (None when the batch does not fit)."""
    ba = ba or allocate(kv, pos, seqs, embd)
    ctx = kv.init_batch(ba, n_ubatch)
    if ctx.get_status() != MemoryStatus.SUCCESS:
        return None
    while True:
        ctx.apply()
        if on_ubatch is not None:
            on_ubatch(ctx)
        if ctx.i_cur == len(ctx.ubatches) - 1:
            return ctx  # still on its last ubatch, for the tests that read its inputs
        ctx.next()


def random_session(rng, kv, n_steps, on_ubatch):
    """Random decodes (coupled sequences in a unified cache, M-RoPE images) mixed with removals and shifts."""
    n_seq = kv.n_seq_max
    mrope = kv.hparams.n_pos_per_embd() > 1
    for _ in range(n_steps):
        r = rng.random()
        if r < 0.65:
            seqs = rng.choice(n_seq, size=int(rng.integers(1, min(3, n_seq) + 1)), replace=False).tolist()
            if kv.n_stream > 1:
                k = int(rng.integers(1, 5))  # split_equal: the same count per sequence keeps one ubatch
            pos, rows, yx = [], [], []
            image = mrope and rng.random() < 0.5
            for s in seqs:
                if kv.n_stream == 1:
                    k = int(rng.integers(1, 7))
                pmax = kv.seq_pos_max(s)
                for j in range(k):
                    row = [s]
                    if kv.n_stream == 1 and n_seq > 1 and rng.random() < 0.15:
                        o = int(rng.integers(0, n_seq))
                        if o != s and kv.seq_pos_max(o) == pmax and kv.seq_pos_min(o) == kv.seq_pos_min(s):
                            row.append(o)
                    rows.append(row)
                    if image:  # an image: one temporal position (the last one again, or the next), a 2-D grid
                        if j == 0:
                            p_img = pmax if pmax >= 0 and rng.random() < 0.5 else pmax + 1
                        pos.append(p_img)
                        yx.append((int(rng.integers(0, 3)), int(rng.integers(0, 3))))
                    else:
                        pos.append(pmax + 1 + j)
                        yx.append((pmax + 1 + j, pmax + 1 + j))
            if rng.random() < 0.3:
                perm = rng.permutation(len(pos))
                pos, rows, yx = [pos[i] for i in perm], [rows[i] for i in perm], [yx[i] for i in perm]
            if mrope:
                y, x = zip(*yx)
                pos = [pos, list(y), list(x), [0] * len(pos)]
            n_ubatch = int(rng.choice([1, 3, 4, 512]))
            try:
                ba = allocate(kv, pos, rows, embd=mrope)
            except ValueError:
                continue  # a batch the allocator rejects (coupled sequences that diverged): nothing placed
            decode(kv, pos, rows, n_ubatch, on_ubatch=on_ubatch, ba=ba)
        elif r < 0.8:
            s = int(rng.integers(0, n_seq))
            pmax = kv.seq_pos_max(s)
            if pmax >= 0:
                kv.seq_rm(s, int(rng.integers(0, pmax + 1)), -1)
        elif r < 0.9 and not mrope:
            s = int(rng.integers(0, n_seq))
            kv.seq_add(s, int(rng.integers(0, 8)), -1, int(rng.integers(-3, 4)))
        elif r < 0.97 and kv.n_stream == 1 and n_seq > 1:  # share a sequence's cells with another one
            s, o = rng.choice(n_seq, size=2, replace=False).tolist()
            kv.seq_rm(o, -1, -1)
            kv.seq_cp(s, o, -1, -1)
        else:
            s = int(rng.integers(0, n_seq))
            kv.seq_rm(s, -1, -1)


# ------------------------------------------------------------------------------------------------ the kq mask

MASK_CONFIGS = {
    "plain": dict(kv_size=48, n_seq_max=1),
    "unified-3": dict(kv_size=48, n_seq_max=3),
    "streams-3": dict(kv_size=24, n_seq_max=3, unified=False),
    "standard-1": dict(kv_size=24, n_seq_max=2, n_swa=1, swa_type=SwaType.STANDARD),
    "standard-5": dict(kv_size=32, n_seq_max=2, n_swa=5, swa_type=SwaType.STANDARD),
    "chunked-4": dict(kv_size=32, n_seq_max=2, n_swa=4, swa_type=SwaType.CHUNKED),
    "chunked-1": dict(kv_size=16, n_seq_max=1, n_swa=1, swa_type=SwaType.CHUNKED),
    "symmetric-6": dict(kv_size=32, n_seq_max=2, n_swa=6, swa_type=SwaType.SYMMETRIC),
    "symmetric-5": dict(kv_size=32, n_seq_max=2, n_swa=5, swa_type=SwaType.SYMMETRIC),
    "symmetric-0": dict(kv_size=16, n_seq_max=1, n_swa=0, swa_type=SwaType.SYMMETRIC),
    "streams-swa": dict(kv_size=16, n_seq_max=2, unified=False, n_swa=3, swa_type=SwaType.STANDARD),
    "alibi": dict(kv_size=48, n_seq_max=2, use_alibi=True),
    "alibi-chunked": dict(kv_size=32, n_seq_max=2, n_swa=8, swa_type=SwaType.CHUNKED,
                          use_alibi=True),
    "mrope": dict(kv_size=48, n_seq_max=2, rope_type=RopeType.MROPE),
    "mrope-streams": dict(kv_size=24, n_seq_max=2, unified=False, rope_type=RopeType.IMROPE),
    "mrope-swa": dict(kv_size=32, n_seq_max=1, n_swa=4, swa_type=SwaType.STANDARD,
                      rope_type=RopeType.MROPE),
}


@pytest.mark.parametrize("name", sorted(MASK_CONFIGS))
def test_mask_matches_seed_loop(name, monkeypatch):
    cfg = MASK_CONFIGS[name]
    rng = np.random.default_rng(sum(name.encode()))
    kv = make(**cfg)
    seen = {"ubatches": 0, "visible": 0}

    def check(ctx):
        ub, sinfo = ctx.get_ubatch(), ctx.get_sinfo()
        ns = sinfo.n_stream()
        for causal in (True, False):
            for n_kv in (ctx.get_n_kv(), int(rng.integers(1, kv.get_size() + 1))):
                want = seed_mask(kv, ub, n_kv, ns, causal)
                # whole rows, the default choice, and always the shared row + the differing columns
                for band_max in (-1.0, _masks._BAND_MAX, 1.0):
                    with monkeypatch.context() as mp:
                        mp.setattr(_masks, "_BAND_MAX", band_max)
                        got = fill_mask(kv, ub, n_kv, ns, causal)
                        assert same_bits(got, want), (name, causal, n_kv, band_max, ub.pos, ub.seq_id.tolist())
                got16 = fill_mask(kv, ub, n_kv, ns, causal, "f16")
                assert same_bits(got16, want.astype(np.float16)), (name, causal, n_kv)
                seen["visible"] += int(np.isfinite(want).sum())
        np.testing.assert_array_equal(ctx.kq_mask(), seed_mask(kv, ub, ctx.get_n_kv(), ns, True))
        seen["ubatches"] += 1

    random_session(rng, kv, 45, check)
    assert seen["ubatches"] >= 20 and seen["visible"] > 0


def test_mask_hand_worked_two_sequences():
    kv = make(kv_size=16, n_seq_max=2)
    ctx = decode(kv, [0, 1, 2, 0, 1], [0, 0, 0, 1, 1])
    m = ctx.kq_mask()
    assert m.shape == (1, 5, 16)
    vis = np.isfinite(m[0, :, :6]).astype(int).tolist()
    assert vis == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                   [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0]]
    assert np.isneginf(m[0, :, 5:]).all() and (m[np.isfinite(m)] == 0).all()
    assert not np.signbit(m[np.isfinite(m)]).any()  # +0.0, as the seed writes
    non_causal = ctx.kq_mask(causal=False)
    assert np.isfinite(non_causal[0, :3, :3]).all() and np.isneginf(non_causal[0, :3, 3:]).all()


def test_mask_mrope_2d_rule():
    kv = make(kv_size=16, rope_type=RopeType.MROPE)
    # an image of 2x2 at temporal position 0: rows y, x
    ctx = decode(kv, [[0, 0, 0, 0], [0, 0, 1, 1], [0, 1, 0, 1], [0, 0, 0, 0]], [0] * 4, embd=True)
    np.testing.assert_array_equal(kv.v_cells[0].ext_array[:4], [[0, 0], [1, 0], [0, 1], [1, 1]])
    vis = np.isfinite(ctx.kq_mask()[0, :, :4]).astype(int)
    np.testing.assert_array_equal(vis, np.tril(np.ones((4, 4), int)))  # row-major order of (y, x)
    assert np.isfinite(ctx.kq_mask(causal=False)[0, :, :4]).all()


def test_mask_alibi_values():
    kv = make(kv_size=16, use_alibi=True)
    ctx = decode(kv, [0, 1, 2, 3], [0] * 4)
    m = ctx.kq_mask()[0, :, :4]
    want = -np.abs(np.arange(4)[None, :] - np.arange(4)[:, None]).astype(np.float32)
    np.testing.assert_array_equal(np.where(np.tril(np.ones((4, 4))) > 0, want, -np.inf), m)


def test_mask_streams_read_their_own_cells():
    kv = make(kv_size=8, n_seq_max=2, unified=False)
    ctx = decode(kv, [0, 1, 0, 1], [0, 0, 1, 1])
    sinfo = ctx.get_sinfo()
    assert sinfo.strm == [0, 1]
    m = ctx.kq_mask()
    assert m.shape == (2, 2, 8)
    # each stream holds its sequence in cells 0, 1
    np.testing.assert_array_equal(np.isfinite(m).astype(int),
                                  [[[1, 0, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0]]] * 2)
    # a later ubatch of sequence 1 alone: one stream in the mask, stream 1's cells
    ctx = decode(kv, [2], [1])
    assert ctx.get_sinfo().strm == [1]
    np.testing.assert_array_equal(np.isfinite(ctx.kq_mask()[0, 0, :3]), [True, True, True])


def test_mask_one_token_large_cache():
    kv = make(kv_size=4096, n_seq_max=2)
    decode(kv, list(range(300)), [0] * 300)
    decode(kv, list(range(200)), [1] * 200)
    kv.seq_rm(0, 100, 150)
    ctx = decode(kv, [300], [0])
    n_kv = ctx.get_n_kv()
    assert n_kv == 512 and kv.v_cells[0].pos_get(100) == 300  # the freed cells take the token
    m = ctx.kq_mask()[0, 0]
    cells = kv.v_cells[0]
    pos = cells.pos_array[:n_kv]
    want = np.where(cells.seq_mask(0, n_kv) & (pos >= 0) & (pos <= 300), 0.0, -np.inf).astype(np.float32)
    assert same_bits(m, want)


# ------------------------------------------------------------------------------------------------ index inputs

def idx_tensor(n):
    ht = HostTensor("i64", (n,))
    ht.array()[...] = -7
    return ht


def test_k_v_idxs_hand_worked_unified():
    kv = make(kv_size=16)  # n_embd_v_gqa = 4
    decode(kv, [0, 1, 2], [0, 0, 0])
    kv.seq_rm(0, 1, 2)  # a hole at cell 1
    ctx = decode(kv, [3, 4, 5], [0, 0, 0])
    np.testing.assert_array_equal(ctx.k_idxs(), [1, 3, 4])
    np.testing.assert_array_equal(ctx.v_idxs(), [1, 17, 33, 49, 3, 19, 35, 51, 4, 20, 36, 52])


def test_k_v_idxs_hand_worked_streams():
    kv = make(kv_size=8, n_seq_max=2, unified=False)
    ctx = decode(kv, [0, 1, 0, 1], [0, 0, 1, 1])
    np.testing.assert_array_equal(ctx.k_idxs(), [0, 1, 8, 9])
    # stream stride kv_size * n_embd = 32; element j at j * kv_size
    np.testing.assert_array_equal(ctx.v_idxs(), [0, 8, 16, 24, 1, 9, 17, 25, 32, 40, 48, 56, 33, 41, 49, 57])


@pytest.mark.parametrize("v_trans", [True, False])
@pytest.mark.parametrize("unified", [True, False])
def test_k_v_idxs_match_seed_loops(v_trans, unified):
    # variable V width across layers: the transposed layout pads every layer to n_embd_v_gqa_max = 12
    kv = make(kv_size=24, n_seq_max=3, unified=unified, v_trans=v_trans, n_head_kv=[2, 3])
    rng = np.random.default_rng(7 + v_trans + 2 * unified)
    n_checked = [0]

    def check(ctx):
        ub, sinfo = ctx.get_ubatch(), ctx.get_sinfo()
        want_k = [s * kv.get_size() + int(i) for s, idx in zip(sinfo.strm, sinfo.idxs) for i in idx]
        np.testing.assert_array_equal(ctx.k_idxs(), want_k)
        np.testing.assert_array_equal(ctx.v_idxs(), seed_v_idxs(kv, ub, sinfo))
        n_checked[0] += 1

    random_session(rng, kv, 60, check)
    assert n_checked[0] >= 15


@pytest.mark.parametrize("v_trans", [True, False])
@pytest.mark.parametrize("unified", [True, False])
def test_input_views_filled_again_match_set_input(v_trans, unified):
    """The runtime's path: input_views of a graph's three tensors, checked once, then fill_inputs for every later
    ubatch of the same shape writes what set_input_* writes into fresh tensors."""
    kv = make(kv_size=24, n_seq_max=3, unified=unified, v_trans=v_trans)
    rng = np.random.default_rng(11 + v_trans + 2 * unified)
    graphs = {}  # (n_tokens, n_kv, n_stream) -> (tensors, views): one "graph" per shape, reused
    n_reused = [0]

    def check(ctx):
        ub, n_kv, ns = ctx.get_ubatch(), ctx.get_n_kv(), ctx.get_sinfo().n_stream()
        key = (ub.n_tokens, n_kv, ns)
        if key in graphs:
            n_reused[0] += 1
        else:
            n_v = ub.n_tokens * (kv.hparams.n_embd_v_gqa_max() if v_trans else 1)
            hts = (idx_tensor(ub.n_tokens), idx_tensor(n_v), HostTensor("f32", (n_kv, ub.n_tokens // ns, 1, ns)))
            graphs[key] = (hts, ctx.input_views(hts[0].t, hts[1].t, hts[2].t, ub.n_tokens))
        hts, views = graphs[key]
        hts[2].array()[...] = 7  # every element is written
        ctx.fill_inputs(views, ub, True)
        np.testing.assert_array_equal(hts[0].array().reshape(-1), ctx.k_idxs())
        np.testing.assert_array_equal(hts[1].array().reshape(-1), ctx.v_idxs())
        assert same_bits(hts[2].array()[:, 0], ctx.kq_mask())

    try:
        random_session(rng, kv, 60, check)
    finally:
        for hts, _ in graphs.values():
            for ht in hts:
                ht.close()
    assert n_reused[0] >= 10


@pytest.mark.parametrize("v_trans", [True, False])
def test_set_input_serves_the_last_tensor_again_only_while_its_header_holds(v_trans):
    """set_input_* keep the view of the tensor they wrote last: a decode loop that alternates two tensor sets, and
    one whose ne[0] is rewritten in place between calls (as llama.cpp's own timing loop does with its mask), get
    exactly what fresh tensors get; a header rewritten to a wrong shape is refused with nothing written."""
    kv = make(kv_size=32, n_seq_max=2, v_trans=v_trans)
    n_v = kv.hparams.n_embd_v_gqa_max() if v_trans else 1
    sets = [(idx_tensor(1), idx_tensor(n_v), HostTensor("f32", (32, 1, 1, 1))) for _ in range(2)]
    try:
        decode(kv, [0, 1, 2], [0, 0, 0])
        decode(kv, [0, 1, 2], [1, 1, 1])
        for step in range(8):
            seq = step % 2
            ctx = decode(kv, [3 + step // 2], [seq])
            ub, sinfo = ctx.get_ubatch(), ctx.get_sinfo()
            tk, tv, tm = sets[step % 2 if step < 4 else 0]
            n_kv = 32 if step % 3 else 16  # the mask's cells are the tensor's: any n_kv up to the cache size
            words = G.header_words(tm.t)  # live: ne[0] is word 2, nb[1..3] words 7..9
            words[2], words[7], words[8], words[9] = n_kv, 4 * n_kv, 4 * n_kv, 4 * n_kv
            tm.array()[...] = 7
            kv.set_input_k_idxs(tk.t, ub, sinfo)
            kv.set_input_v_idxs(tv.t, ub, sinfo)
            kv.set_input_kq_mask(tm.t, ub, True)
            np.testing.assert_array_equal(tk.array().reshape(-1), [sinfo.idxs[0][0]])
            np.testing.assert_array_equal(tv.array().reshape(-1), seed_v_idxs(kv, ub, sinfo))
            assert same_bits(tm.array().reshape(-1), ctx.kq_mask().reshape(-1)[:n_kv])
            words[2] = n_kv - 1  # ne[0] no longer matches its strides: refused, nothing written
            before = tm.array().copy()
            with pytest.raises(ValueError, match="not contiguous"):
                kv.set_input_kq_mask(tm.t, ub, True)
            assert same_bits(tm.array(), before)
            words[2] = 32
            words[7] = words[8] = words[9] = 128
            with pytest.raises(ValueError, match="has ne"):  # a k_idxs tensor of two tokens for a one-token ubatch
                words_k = G.header_words(tk.t)
                words_k[2] = 2
                try:
                    kv.set_input_k_idxs(tk.t, ub, sinfo)
                finally:
                    words_k[2] = 1
    finally:
        for hts in sets:
            for ht in hts:
                ht.close()


def test_k_shift_values():
    kv = make(kv_size=16, n_seq_max=2, unified=False)
    decode(kv, [0, 1, 2, 3, 0, 1, 2, 3], [0, 0, 0, 0, 1, 1, 1, 1])
    kv.seq_add(0, 2, -1, 5)
    kv.seq_add(1, 0, 2, -1)   # position 0 -> -1: the cell empties (its shift reads 0)
    kv.seq_div(1, 2, -1, 2)
    got = kv.k_shift()
    want = np.zeros(32, np.int32)
    want[[2, 3]] = 5
    want[16 + 1] = -1          # position 1 -> 0
    want[16 + 2], want[16 + 3] = 1, 2  # 2 -> 1, 3 -> 1
    np.testing.assert_array_equal(got, want)
    ht = HostTensor("i32", (32,))
    try:
        ht.array()[...] = 99
        kv.set_input_k_shift(ht.t)
        np.testing.assert_array_equal(ht.array().reshape(-1), want)
    finally:
        ht.close()


# ------------------------------------------------------------------------------------------------ pos bucket

def test_pos_bucket_matches_seed_loop():
    kv = make(kv_size=512, n_seq_max=2, n_rel_attn_bkts=32)
    decode(kv, list(range(200)), [0] * 200)
    kv.seq_rm(0, 10, 20)
    ba = BatchAllocator(1)
    ba.init(Batch(token=np.full(5, 3), pos=[200, 201, 0, 1, 202], seq_id=[0, 0, 1, 1, 0]), N_VOCAB, kv, 8, 2, False)
    ctx = kv.init_batch(ba, 512)
    ctx.apply()
    ub = ctx.get_ubatch()
    for n_kv in (ctx.get_n_kv(), 37):
        ht = HostTensor("i32", (n_kv, ub.n_tokens))
        try:
            kv.set_input_pos_bucket(ht.t, ub)
            np.testing.assert_array_equal(ht.array()[0, 0], seed_pos_bucket(kv, ub, n_kv))
        finally:
            ht.close()


def test_pos_bucket_refuses_streams_and_equal_ubatches():
    kv = make(kv_size=16, n_seq_max=2, unified=False, n_rel_attn_bkts=32)
    ctx = decode(kv, [0], [0])
    ht = HostTensor("i32", (16, 1))
    try:
        ht.array()[...] = 5
        with pytest.raises(ValueError, match="one stream"):
            kv.set_input_pos_bucket(ht.t, ctx.get_ubatch())
        kv1 = make(kv_size=16, n_rel_attn_bkts=32)
        ba = BatchAllocator(1)
        ba.init(Batch(token=[3], pos=[0]), N_VOCAB, kv1, 8, 1, False)
        ba.split_reset()
        ub = ba.split_equal(8, False)
        assert ub.equal_seqs()
        with pytest.raises(ValueError, match="split_simple"):
            kv1.set_input_pos_bucket(ht.t, ub)
        assert (ht.array() == 5).all()
    finally:
        ht.close()


# ------------------------------------------------------------------------------------------------ bad tensors

@pytest.fixture
def placed():
    kv = make(kv_size=16, n_seq_max=2)
    ctx = decode(kv, [0, 1, 2], [0, 0, 0])
    return kv, ctx


def refused(call, ht, match):
    before = ht.array().copy()
    with pytest.raises(ValueError, match=match):
        call(ht.t)
    assert same_bits(ht.array(), before) if before.dtype.kind == "f" else np.array_equal(ht.array(), before)


@pytest.mark.parametrize("type_, ne, match", [
    ("f32", (3,), "is f32, expected i64"),
    ("i64", (4,), r"has ne \(4, 1, 1, 1\), expected \((3|12), 1, 1, 1\)"),  # V transposed: 3 x 4
    ("i64", (3, 2), "has ne"),
])
def test_bad_idx_tensors_are_left_untouched(placed, type_, ne, match):
    kv, ctx = placed
    ht = HostTensor(type_, ne)
    try:
        ht.array()[...] = 11
        refused(lambda t: kv.set_input_k_idxs(t, ctx.get_ubatch(), ctx.get_sinfo()), ht, match)
        refused(lambda t: kv.set_input_v_idxs(t, ctx.get_ubatch(), ctx.get_sinfo()), ht, match)
    finally:
        ht.close()


@pytest.mark.parametrize("type_, ne, match", [
    ("i32", (16, 3, 1, 1), "is i32, expected f32 or f16"),
    ("f32", (16, 2, 1, 1), r"expected \(16, 3, 1, 1\)"),
    ("f32", (16, 3, 2, 1), "expected"),
    ("f32", (16, 1, 1, 2), "do not split"),
    ("f32", (17, 3, 1, 1), "exceeds the cache size 16"),
])
def test_bad_mask_tensors_are_left_untouched(placed, type_, ne, match):
    kv, ctx = placed
    ht = HostTensor(type_, ne)
    try:
        ht.array()[...] = 3
        refused(lambda t: kv.set_input_kq_mask(t, ctx.get_ubatch(), True), ht, match)
    finally:
        ht.close()


def test_mask_view_that_is_not_contiguous_is_refused(placed):
    kv, ctx = placed
    ht = HostTensor("f32", (3, 16))
    try:
        ht.array()[...] = 3
        view = G.ggml_transpose(ht.ctx.ptr, ht.t)  # ne (16, 3), nb swapped
        with pytest.raises(ValueError, match="not contiguous"):
            kv.set_input_kq_mask(view, ctx.get_ubatch(), True)
        assert (ht.array() == 3).all()
    finally:
        ht.close()


def test_tensor_without_data_is_refused(placed):
    kv, ctx = placed
    c = G.Context.for_tensors(1)
    try:
        t = c.new_tensor("i64", (3,), "unallocated")
        with pytest.raises(ValueError, match="'unallocated'.*no buffer.*has no data"):
            kv.set_input_k_idxs(t, ctx.get_ubatch(), ctx.get_sinfo())
    finally:
        c.close()


def test_tensor_in_a_non_host_buffer_is_refused(placed, monkeypatch):
    kv, ctx = placed
    ht = HostTensor("f32", (16, 3, 1, 1), "kq_mask")
    try:
        ht.array()[...] = 3
        monkeypatch.setattr(G, "ggml_backend_buffer_is_host", lambda buf: False)
        with pytest.raises(ValueError, match="'kq_mask' is in buffer 'CPU', which is not a host buffer"):
            kv.set_input_kq_mask(ht.t, ctx.get_ubatch(), True)
        monkeypatch.undo()
        assert (ht.array() == 3).all()
    finally:
        ht.close()


@pytest.mark.skipif(not G.rpc_available(), reason="ggml built without RPC")
def test_tensor_in_an_rpc_buffer_is_refused(placed, tmp_path):
    # a real non-host buffer: the CPU of an RPC server in a subprocess
    kv, ctx = placed
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{sk.getsockname()[1]}"
    server = subprocess.Popen([sys.executable, "-c", "from kvcache_ggml import ggml as G; "
                               f"G.rpc_start_server({endpoint!r}, [G.device('CPU')])"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):
            try:
                socket.create_connection(tuple(endpoint.split(":")), timeout=0.1).close()
                break
            except OSError:
                time.sleep(0.05)
        buft = G.ggml_backend_rpc_buffer_type(endpoint.encode(), 0)
        assert buft and not G.ggml_backend_buft_is_host(buft)
        c = G.Context.for_tensors(1)
        try:
            t = c.new_tensor("f32", (16, 3, 1, 1), "kq_mask")
            buf = G.BackendBuffer.for_context(c, buft)
            try:
                G.set_tensor(t, np.full((3, 16), 3, np.float32))
                with pytest.raises(ValueError, match="'kq_mask' is in buffer 'RPC.*not a host buffer"):
                    kv.set_input_kq_mask(t, ctx.get_ubatch(), True)
                assert (G.to_numpy(t, copy=True) == 3).all()
            finally:
                buf.close()
        finally:
            c.close()
    finally:
        server.kill()
        server.wait()


def test_ubatch_that_does_not_match_its_slot_is_refused(placed):
    kv, ctx = placed
    other = decode(kv, [3], [0])
    ht = idx_tensor(3)
    try:
        with pytest.raises(RuntimeError, match="does not match its slot"):
            kv.set_input_k_idxs(ht.t, ctx.get_ubatch(), other.get_sinfo())
        assert (ht.array() == -7).all()
    finally:
        ht.close()


def test_conveniences_need_an_applied_ubatch():
    kv = make(kv_size=16)
    ba = BatchAllocator(1)
    ba.init(Batch(token=[3], pos=[0]), N_VOCAB, kv, 8, 1, False)
    ctx = kv.init_batch(ba, 8)
    with pytest.raises(RuntimeError, match="apply"):
        ctx.kq_mask()
    with pytest.raises(RuntimeError, match="no ubatch"):
        kv.init_full().k_idxs()


@pytest.mark.parametrize("swa_type", list(SwaType))
def test_window_bounds_equal_is_masked_swa(swa_type):
    # the interval lo <= p0 <= hi of each query is exactly the causal rule plus is_masked_swa
    p0 = np.arange(0, 41)
    p1 = np.arange(0, 41)
    for n_swa in range(0 if swa_type != SwaType.CHUNKED else 1, 10):
        for causal in (True, False):
            lo, hi = _masks.window(p1.astype(np.int32), causal, n_swa, swa_type)
            got = np.ones((p1.size, p0.size), bool)
            if lo is not None:
                got &= p0[None, :] >= lo[:, None]
            if hi is not None:
                got &= p0[None, :] <= hi[:, None]
            want = ~is_masked_swa_np(n_swa, swa_type, p0[None, :], p1[:, None])
            if causal:
                want &= p0[None, :] <= p1[:, None]
            np.testing.assert_array_equal(got, want, err_msg=f"n_swa={n_swa} causal={causal}")
